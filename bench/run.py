"""Bandwidth of fuser against torch.compile, PyTorch eager and a device-to-device copy.

    PYTHONPATH=. python3 bench/run.py [--fusion rmsnorm_bwd,dropout_rmsnorm_bwd]
        [--hidden 1024,2048,...] [--rows 16384] [--dtype bf16|fp16|fp32] [--no-compile]
        [--tune] [--breakdown] [--out bench/results]

For each fusion and hidden size: inputs from fuser.fusions.make_inputs, each implementation's
median time, bandwidth = minimal bytes (every input read once, every output written once, from
the tensors' nbytes) / median time, and the fraction of a same-sized device copy in the same run.
Writes OUT/<date>-<fusion>.json and .png after every size (a killed run keeps what it measured)
and prints a markdown table. Method and L2 policy: bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

DEFAULT_FUSIONS = ("rmsnorm_bwd", "dropout_rmsnorm_bwd")
DEFAULT_HIDDEN = (1024, 2048, 4096, 8192, 16384, 24578, 32768, 65536, 131072)
DTYPES = {"bf16": "BFloat16", "fp16": "Half", "fp32": "Float"}
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
IMPLS = ("fuser", "fuser_tuned", "compile", "eager", "copy")
TABLE_IMPLS = ("fuser", "compile", "eager")
TOLERANCE = 5e-2  # max |out - ref| / max |ref|, per output, against the eager outputs
BYTES_BUDGET = 8 * 2**30  # inputs + outputs of one size; rows shrink above it
FLUSH_BYTES = 256 * 2**20  # the L2 flush buffer of the events timer (as do_bench's)
WARMUP_MS, REP_MS = 25, 100
TUNE_LIMIT = 12

# Per fusion: bytes per [N, H] element (inputs + outputs) as a function of the itemsize, bytes
# per row (fp32 statistics), number of [H] tensors of the storage dtype (column inputs +
# outputs) and, where there are any, bytes per column of fp32 column statistics. For the size
# budget and for checking; the reported bytes come from the actual tensors.
SHAPE_BYTES = {
    "rmsnorm_fwd": (lambda s: 2 * s, 4, 1),  # x, y | rstd | w
    "layernorm_fwd": (lambda s: 2 * s, 8, 2),  # x, y | mean, rstd | w, b
    "softmax_fwd": (lambda s: 2 * s, 0, 0),  # x, y
    "log_softmax_fwd": (lambda s: 2 * s, 0, 0),  # x, y
    "dropout_rmsnorm_fwd": (lambda s: 4 * s + 1, 4, 1),  # in1, in2, mask, y, x | rms | w
    "rmsnorm_bwd": (lambda s: 3 * s, 4, 2),  # x, dy, dx | rms | w, dw
    "dropout_rmsnorm_bwd": (lambda s: 5 * s + 1, 4, 2),  # in1, in2, mask, dy, g1, g2 | rms | w, dw
    "layernorm_bwd": (lambda s: 3 * s, 8, 3),  # x, dy, dx | mean, rstd | w, dw, db
    "softmax_bwd": (lambda s: 3 * s, 0, 0),  # y, dy, dx
    # in1, in2, mask, y, x | mean, rstd | w, b
    "dropout_layernorm_fwd": (lambda s: 4 * s + 1, 8, 2),
    "gelu_fwd": (lambda s: 2 * s, 0, 1),  # x, y | | bias
    "gelu_tanh_fwd": (lambda s: 2 * s, 0, 1),
    "gelu_bwd": (lambda s: 3 * s, 0, 2),  # x, dy, dx | | bias, dbias
    "gelu_tanh_bwd": (lambda s: 3 * s, 0, 2),
    "swiglu_fwd": (lambda s: 3 * s, 0, 0),  # a, b, y
    "swiglu_bwd": (lambda s: 5 * s, 0, 0),  # a, b, dy, da, db
    "geglu_fwd": (lambda s: 3 * s, 0, 0),
    "geglu_bwd": (lambda s: 5 * s, 0, 0),
    # x, y | | w, b; mean and rstd are fp32 columns: 8 bytes each whatever the dtype
    "batchnorm_fwd": (lambda s: 2 * s, 0, 2, 8),
    "batchnorm_bwd": (lambda s: 3 * s, 0, 3, 8),  # x, dy, dx | | w, dw, db; mean, rstd
    "softmax_dim0_fwd": (lambda s: 2 * s, 0, 0),  # x, y
}


# ----- pure helpers (tested on the CPU) ---------------------------------------------------------


def csv_list(kind):
    def parse(text: str) -> list:
        try:
            items = [kind(t) for t in text.split(",") if t.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def add_case_options(p: argparse.ArgumentParser, cases) -> None:
    """--case (comma-separated names of `cases`, all by default), --timer and --out: the
    options every case bench (nd.py, permute.py) takes."""
    p.add_argument("--case", type=csv_list(str), default=list(cases),
                   help=f"comma-separated ({', '.join(cases)})")
    p.add_argument("--timer", choices=("auto", "do_bench", "events"), default="auto")
    p.add_argument("--out", default="bench/results")


def check_cases(p: argparse.ArgumentParser, args: argparse.Namespace, cases) -> None:
    """Exit with a usage error naming the unknown --case values and the cases there are."""
    unknown = [c for c in args.case if c not in cases]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(cases)}")


def add_common_args(p: argparse.ArgumentParser, hidden: tuple[int, ...]) -> None:
    """The options bench/run.py and bench/modules.py share: sizes, dtype, torch.compile,
    output folder, timer and seed."""
    p.add_argument("--hidden", type=csv_list(int), default=list(hidden),
                   help="comma-separated hidden sizes (default: %(default)s)")
    p.add_argument("--rows", type=int, default=16384, help="rows N (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to build)")
    p.add_argument("--out", default="bench/results", help="output folder (default: %(default)s)")
    p.add_argument("--timer", choices=("auto", "do_bench", "events"), default="auto",
                   help="auto: triton.testing.do_bench if triton imports, else a CUDA-event loop")
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description="fuser vs torch.compile vs PyTorch eager vs device copy, GB/s per hidden size",
    )
    p.add_argument("--fusion", type=csv_list(str), default=list(DEFAULT_FUSIONS),
                   help="comma-separated fusion names (default: %(default)s)")
    add_common_args(p, DEFAULT_HIDDEN)
    p.add_argument("--tune", action="store_true",
                   help=f"also try up to {TUNE_LIMIT} fuser Hints per size and report the best")
    p.add_argument("--gen-rows", type=int, default=2048,
                   help="rows drawn by make_inputs on the host, tiled on the GPU to --rows "
                        "(0: draw all rows; slow at large sizes) (default: %(default)s)")
    p.add_argument("--no-startup", action="store_true",
                   help="skip the start-up costs (bench/startup.py: import, cold and warm "
                        "first calls in fresh processes, recorded as startup)")
    p.add_argument("--no-host", action="store_true",
                   help="skip the host time of a cached call at 16 rows of the first hidden "
                        "size (bench/host_profile.py, torch and CuPy inputs: host in the json)")
    p.add_argument("--breakdown", action="store_true",
                   help="also record each kernel's device time per call (torch.profiler) for "
                        "fuser and torch.compile: kernels_us in the json")
    args = p.parse_args(argv)
    from fuser.fusions import FUSIONS

    unknown = [f for f in args.fusion if f not in FUSIONS]
    if unknown:
        p.error(f"unknown fusion {', '.join(unknown)}; known: {', '.join(FUSIONS)}")
    if args.rows < 1 or any(h < 1 for h in args.hidden) or args.gen_rows < 0:
        p.error("--rows and --hidden must be positive, --gen-rows non-negative")
    return args


def minimal_bytes(inputs, outputs) -> int:
    """Each input read once plus each output written once (anything with .nbytes)."""
    return int(sum(int(t.nbytes) for t in (*inputs, *outputs)))


def segment_bytes(fd, inputs) -> list[int] | None:
    """Bytes each kernel of a segmented fusion moves at least (its inputs read once, its
    outputs written once), from the shapes of `inputs`; None where one kernel chain runs
    `fd`. Their sum over the copy's bandwidth is the time a chain of these segments cannot
    beat: finish_entry sets fraction_of_segments_bound against it."""
    from fuser.executor import outer_segments, segments_of
    from fuser.ir import Tensor
    from fuser.reference import bind_shapes

    segmentation = segments_of(fd)
    if segmentation is None and _ran_segments(fd):  # columns too tall for one kernel
        segmentation = outer_segments(fd)
    if segmentation is None:
        return None
    lowered = segmentation.lowered
    sizes = bind_shapes(lowered, [tuple(x.shape) if isinstance(v, Tensor) else None
                                  for v, x in zip(lowered.inputs, inputs, strict=True)])

    def nbytes(v) -> int:
        return math.prod(sizes.shape(v)) * v.dtype.itemsize if isinstance(v, Tensor) else 0

    return [sum(nbytes(v) for v in (*s.inputs, *s.outputs)) for s in segmentation.segments]


def _ran_segments(fd) -> bool:
    """Whether the last call of `fd` ran as segments (an outer normalization does where its
    columns are too tall for one kernel)."""
    from fuser import FuserError
    from fuser.segment import SegmentSchedules

    try:
        return isinstance(fd.last_schedule(), SegmentSchedules)
    except FuserError:  # not run yet
        return False


def expected_bytes(fusion: str, rows: int, hidden: int, itemsize: int) -> int:
    """The same count from the shapes alone (e.g. bf16 dropout+RMSNorm bwd: N*H*11 + N*4 +
    2*H*2, REFERENCE.md section 3)."""
    per_elem, per_row, cols, *col_stats = SHAPE_BYTES[fusion]
    return (rows * hidden * per_elem(itemsize) + rows * per_row
            + hidden * (cols * itemsize + sum(col_stats)))


def rows_for_budget(fusion: str, rows: int, hidden: int, itemsize: int,
                    budget: int = BYTES_BUDGET) -> int:
    """`rows`, or fewer (a multiple of 128 where possible) so inputs + outputs fit `budget`."""
    if expected_bytes(fusion, rows, hidden, itemsize) <= budget:
        return rows
    cols = expected_bytes(fusion, 0, hidden, itemsize)
    per_row = expected_bytes(fusion, 1, hidden, itemsize) - cols
    fit = max(1, (budget - cols) // per_row)
    return int(fit // 128 * 128 if fit >= 128 else fit)


CLUSTER_TUNE_FROM = 16384  # hidden sizes from which --tune also splits rows over clusters
# The finalize kernel sums ~SMs x blocks/SM partial rows per column; its H / 32 blocks are
# fewer than the SMs up to hidden 4096, so --tune also tries more threads per column.
FINALIZE_LANES_TUNE = (16, 64)


def tune_grid(threads_per_row: int | None, limit: int = TUNE_LIMIT,
              max_threads: int = 1024, clusters: tuple[int, ...] = (),
              finalize_lanes: tuple[int, ...] = (), aligned_copy: bool = False,
              staged: tuple[tuple[str, str], ...] | None = None,
              ringed: tuple[tuple[str, str], ...] | None = None) -> list[dict]:
    """Hints kwargs to try, the heuristic's (all None) first: copies of vec bytes instead of
    aligned 16-byte row copies (where asked: the heuristic's schedule uses them), rows split
    over each cluster size given, each finalize_lanes given, the row buffers staged in
    shared memory with two stages and with one (where `staged` gives the storage: the
    registers-first forward kernels), the rows streamed through the staging ring (where
    `ringed` gives the storage: schedules without a ring), each knob alone, then
    threads_per_row x stages; threads_per_row in {x/2, 2x} of the heuristic's x."""
    tprs = []
    if threads_per_row:
        tprs = [t for t in (threads_per_row // 2, threads_per_row * 2) if 1 <= t <= max_threads]
    grid = [{}]
    grid += [{"aligned_copy": False}] if aligned_copy else []
    grid += [{"cluster": k} for k in clusters]
    grid += [{"finalize_lanes": n} for n in finalize_lanes]
    grid += [{"storage": staged, "stages": s} for s in (2, 1)] if staged else []
    grid += [{"storage": ringed}] if ringed else []
    grid += [{"threads_per_row": t} for t in tprs]
    grid += [{"rows_per_block": r} for r in (1, 2, 4)]
    grid += [{"stages": s} for s in (1, 2)]
    grid += [{"threads_per_row": t, "stages": s} for t in tprs for s in (1, 2)]
    grid += [{"threads_per_row": t, "rows_per_block": r} for t in tprs for r in (1, 2, 4)]
    out, seen = [], set()
    for cfg in grid:
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out[:limit]


def gbps(nbytes: int, time_us: float) -> float:
    return nbytes / (time_us * 1e-6) / 1e9


def finish_entry(entry: dict) -> dict:
    """Fill gbps and fraction_of_copy of every measured implementation of one size."""
    impls = entry.get("impls", {})
    for m in impls.values():
        if "time_us" in m:
            m["gbps"] = gbps(m.get("bytes", entry["bytes"]), m["time_us"])
    copy = impls.get("copy", {}).get("gbps")
    for m in impls.values():
        if "gbps" in m:
            m["fraction_of_copy"] = m["gbps"] / copy if copy else None
        if "gbps" in m and "segment_bytes" in m:
            bound = gbps(sum(m["segment_bytes"]), m["time_us"])
            m["fraction_of_segments_bound"] = bound / copy if copy else None
    return entry


def output_paths(out_dir, date: str, fusion: str) -> tuple[Path, Path]:
    stem = Path(out_dir) / f"{date[:10]}-{fusion}"
    return stem.with_suffix(".json"), stem.with_suffix(".png")


def write_report(report: dict, out_dir) -> Path:
    """Write OUT/<YYYY-MM-DD>-<fusion>.json (the date is the report's UTC date)."""
    path, _ = output_paths(out_dir, report["date"], report["fusion"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def _cell(m: dict | None, with_frac: bool = True) -> str:
    if not m:
        return "-"
    if "error" in m:
        return "error"
    if "skipped" in m:
        return "-"
    if m.get("gbps") is None:
        return "?"
    text = f"{m['gbps']:.0f}"
    if with_frac and m.get("fraction_of_copy") is not None:
        text += f" ({m['fraction_of_copy']:.2f})"
    if m.get("correct") is False:
        text += " WRONG"
    return text


def markdown_table(report: dict) -> str:
    """hidden | copy | fuser (frac) | [fuser tuned (frac) |] compile (frac) | eager (frac)
    [| liger (frac)]: the optional columns where some size measured them."""
    def measured(impl: str) -> bool:
        return any("time_us" in e.get("impls", {}).get(impl, {}) for e in report["results"])

    cols = ["fuser", *(["fuser_tuned"] if measured("fuser_tuned") else []), "compile", "eager",
            *(["liger"] if measured("liger") else [])]
    names = {"fuser": "fuser", "fuser_tuned": "fuser tuned", "compile": "torch.compile",
             "eager": "PyTorch eager", "liger": "Liger-Kernel"}
    lines = [
        f"{report['fusion']}, {report['dtype']}, rows {report['rows']}, "
        f"{report.get('device', '?')}, GB/s (fraction of the copy):",
        "",
        "| hidden | copy | " + " | ".join(names[c] for c in cols) + " |",
        "| --- | --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for e in report["results"]:
        impls = e.get("impls", {})
        hidden = str(e["hidden"])
        if e.get("rows") not in (None, report["rows"]):
            hidden += f" (rows {e['rows']})"
        if "error" in e:
            hidden += " (error)"
        cells = [hidden, _cell(impls.get("copy"), with_frac=False)]
        cells += [_cell(impls.get(c)) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernels_line(kernels: dict) -> str:
    """'rmsnorm_bwd_row 61.2, rmsnorm_bwd_finalize 8.1' (names cut to 40 characters)."""
    if "error" in kernels:
        return kernels["error"][:200]
    return ", ".join(f"{name[:40]} {us:.1f}" for name, us in kernels.items())


def error_record(exc: BaseException) -> dict:
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return {"error": text, "traceback": traceback.format_exc(limit=6)[-3000:]}


def short_schedule(schedule) -> dict:
    """The geometry of a schedule (for tuning rows)."""
    keys = ("scheduler", "vec", "threads_per_row", "rows_per_block", "cluster", "batch",
            "stages", "aligned_copy", "blocks_per_sm")
    return {k: getattr(schedule, k) for k in keys if hasattr(schedule, k)}


# ----- timing -----------------------------------------------------------------------------------


def make_timer(kind: str):
    """(description, time_ms(fn) -> median ms)."""
    if kind in ("auto", "do_bench"):
        try:
            from triton.testing import do_bench
        except Exception:
            if kind == "do_bench":
                raise
        else:
            def time_do_bench(fn):
                return float(do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))

            return (f"triton.testing.do_bench(warmup={WARMUP_MS}, rep={REP_MS}, "
                    "return_mode='median'); it zeroes a 256 MiB buffer before every timed call",
                    time_do_bench)
    return (f"CUDA events per call, warm-up {WARMUP_MS} ms, {REP_MS} ms of calls, median; "
            "a 256 MiB buffer zeroed before every timed call", time_events)


def time_events(fn) -> float:
    """do_bench's method without triton: warm up, then per call flush L2, events around fn."""
    import torch

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(WARMUP_MS / estimate))):
        fn()
    n = max(5, min(1000, int(REP_MS / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


# ----- GPU side ---------------------------------------------------------------------------------


def source_digest(root: Path | None = None) -> str:
    """A digest of the code that makes the kernels (fuser/**/*.py and templates/*): it names
    the measured source even where the git metadata beside a copied tree is stale (the GPU
    machine's copy said an older commit twice); recompute it at a commit to match a json."""
    root = root or Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    files = sorted([*root.glob("fuser/**/*.py"), *root.glob("templates/*")])
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def environment() -> dict:
    import torch

    import fuser

    env = {"device": torch.cuda.get_device_name(), "python": sys.version.split()[0],
           "torch": torch.__version__, "numpy": np.__version__, "fuser": fuser.__version__}
    for mod in ("cupy", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:
            env[mod] = f"unavailable ({type(exc).__name__})"
    try:  # which plans ptxas spills (and so which one build() takes) differs between versions
        from fuser.compile import nvrtc_version

        env["nvrtc"] = ".".join(map(str, nvrtc_version()))
    except Exception as exc:
        env["nvrtc"] = f"unavailable ({type(exc).__name__})"
    env["source"] = source_digest()
    try:  # "-dirty": the measured tree differs from that commit (a copy of a working tree)
        env["git"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except Exception:
        env["git"] = None
    return env


def to_device(a: np.ndarray, rows: int):
    """A host array as a CUDA tensor; [gen_rows, ...] arrays tiled to `rows` rows."""
    import torch

    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    t = t.cuda()
    if t.ndim == 2 and t.shape[0] < rows:
        t = t.repeat(math.ceil(rows / t.shape[0]), 1)[:rows].contiguous()
    return t


def device_inputs(fusion: str, rows: int, hidden: int, dtype, gen_rows: int, seed: int) -> list:
    """make_inputs' random arrays (drawn for min(rows, gen_rows) rows, so consistent statistics
    per row), on the GPU, tiled to `rows`. Refuses an all-zero tensor."""
    from fuser.fusions import make_inputs

    drawn = rows if gen_rows == 0 else min(rows, gen_rows)
    host = make_inputs(fusion, drawn, hidden, dtype, np.random.default_rng(seed))
    tensors = [to_device(a, rows) for a in host]
    for i, t in enumerate(tensors):
        if not bool(t.any()):
            raise RuntimeError(f"input {i} of {fusion} is all zeros: refusing to time it")
    return tensors


def max_rel_err(outputs, references) -> float:
    """Worst over outputs of max |out - ref| / max |ref| (fp32); shapes and dtypes must agree."""
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs against {len(references)} references")
    worst = 0.0
    for i, (o, r) in enumerate(zip(outputs, references, strict=True)):
        if tuple(o.shape) != tuple(r.shape) or o.dtype != r.dtype:
            raise ValueError(f"output {i}: {o.dtype} {tuple(o.shape)} against reference "
                             f"{r.dtype} {tuple(r.shape)}")
        of, rf = o.float(), r.float()
        scale = rf.abs().max().item()
        err = (of - rf).abs().max().item()
        rel = err / scale if scale > 0 else err
        if not math.isfinite(rel):
            return math.inf
        worst = max(worst, rel)
    return worst


def sync():
    import torch

    torch.cuda.synchronize()


def breakdown(fn) -> dict:
    """Kernel name -> device us per call (bench/breakdown.py), or {"error": ...}: a profiler
    that cannot start costs the entry its breakdown, not its measurements."""
    from bench.breakdown import profile_kernels

    try:
        return profile_kernels(fn, sync)
    except Exception as exc:
        return error_record(exc)


def bench_size(fusion: str, hidden: int, args, dtype, timer) -> dict:
    """Measure every implementation at one hidden size; failures become {"error": ...}."""
    from bench import baselines
    from fuser.fusions import FUSIONS

    itemsize = ITEMSIZE[args.dtype]
    rows = rows_for_budget(fusion, args.rows, hidden, itemsize)
    entry = {"hidden": hidden, "rows": rows,
             "bytes": expected_bytes(fusion, rows, hidden, itemsize), "impls": {}}
    impls = entry["impls"]
    inputs = device_inputs(fusion, rows, hidden, dtype, args.gen_rows, args.seed)

    def timed(fn, nbytes=None) -> dict:
        m = {"time_us": timer(fn) * 1e3}
        if nbytes is not None:
            m["bytes"] = nbytes
        return m

    ref = eager = None
    try:
        eager = baselines.eager(fusion, inputs)
        ref = eager()
        sync()
        entry["bytes"] = minimal_bytes(inputs, ref)
    except Exception as exc:
        impls["eager"] = error_record(exc)

    try:
        copy_fn, copy_bytes = baselines.device_copy(entry["bytes"])
        impls["copy"] = timed(copy_fn, copy_bytes)
        del copy_fn
    except Exception as exc:
        impls["copy"] = error_record(exc)

    fd = FUSIONS[fusion](dtype)
    try:
        t0 = time.perf_counter()
        outs = fd.execute(inputs)
        sync()
        m = {"first_call_s": round(time.perf_counter() - t0, 3)}
        schedule = fd.last_schedule()
        entry["schedule"] = str(schedule)
        entry["bytes"] = minimal_bytes(inputs, outs)
        if ref is not None:
            try:
                entry["max_rel_err"] = m["max_rel_err"] = max_rel_err(outs, ref)
                m["correct"] = entry["correct"] = entry["max_rel_err"] <= TOLERANCE
            except Exception as exc:  # outputs disagree in kind with the baseline's
                m["correct"] = entry["correct"] = False
                entry["check_error"] = error_record(exc)["error"]
        del outs
        t0 = time.perf_counter()
        for _ in range(10):
            fd.execute(inputs)
        m["host_us"] = round((time.perf_counter() - t0) / 10 * 1e6, 1)  # enqueue cost per call
        sync()
        m.update(timed(lambda: fd.execute(inputs)))
        impls["fuser"] = m
        segments = segment_bytes(fd, inputs)
        if segments is not None:
            m["segment_bytes"] = segments
        if args.breakdown:
            m["kernels_us"] = breakdown(lambda: fd.execute(inputs))
        if args.tune and segments is None:  # hints steer one kernel chain
            tune(fd, inputs, ref, schedule, entry, timed)
    except Exception as exc:
        impls["fuser"] = {**impls.get("fuser", {}), **error_record(exc)}

    if eager is not None and "eager" not in impls:
        try:
            impls["eager"] = timed(eager)
        except Exception as exc:
            impls["eager"] = error_record(exc)

    if args.no_compile:
        impls["compile"] = {"skipped": "--no-compile"}
    else:
        try:
            fn = baselines.compiled(fusion)
            t0 = time.perf_counter()
            outs = fn(*inputs)
            sync()
            m = {"compile_s": round(time.perf_counter() - t0, 1)}
            if ref is not None:
                try:
                    m["max_rel_err"] = max_rel_err(outs, ref)
                    m["correct"] = m["max_rel_err"] <= TOLERANCE
                except Exception as exc:
                    m["correct"], m["check_error"] = False, error_record(exc)["error"]
            del outs
            impls["compile"] = m
            m.update(timed(lambda: fn(*inputs)))
            if args.breakdown:
                m["kernels_us"] = breakdown(lambda: fn(*inputs))
        except Exception as exc:
            impls["compile"] = {**impls.get("compile", {}), **error_record(exc)}
    return finish_entry(entry)


def tune(fd, inputs, ref, schedule, entry: dict, timed) -> None:
    """Try tune_grid's Hints; record each, and the fastest correct one as impls.fuser_tuned."""
    from fuser import FuserError
    from fuser.executor import execute
    from fuser.schedulers import Hints

    configs = []
    long_rows = schedule.hidden >= CLUSTER_TUNE_FROM
    has_finalize = len(fd.last_resources()) > 1  # a finalize kernel beside the row kernel
    # Knobs are tried at the heuristic's cluster size: their values derive from its split.
    cluster = {"cluster": schedule.cluster} if getattr(schedule, "cluster", 1) > 1 else {}
    # Registers-first kernels hold one row per block in flight; staging rows in shared memory
    # lets the next row load while this one computes. The staging ring keeps up to 4 rows (or
    # chunks of a row) in flight per block.
    staged = ringed = None
    if getattr(schedule, "scheduler", None) in ("inner_persistent", "inner_outer_persistent"):
        from fuser.analysis import analyze
        from fuser.schedulers.base import Storage

        info = analyze(fd.fusion)
        if schedule.scheduler == "inner_persistent":
            staged = tuple((t.name, Storage.SMEM) for t in info.full_inputs)
        if schedule.ring is None:
            ringed = (tuple((t.name, Storage.RING) for t in info.full_inputs)
                      + tuple((t.name, Storage.SMEM) for t in info.col_inputs))
    for cfg in tune_grid(getattr(schedule, "threads_per_row", None),
                         clusters=(1, 2, 4, 8) if long_rows else (),
                         finalize_lanes=FINALIZE_LANES_TUNE if has_finalize else (),
                         aligned_copy=getattr(schedule, "aligned_copy", False),
                         staged=staged, ringed=ringed):
        if cfg and "cluster" not in cfg:
            cfg = {**cluster, **cfg}
        hints = Hints(**cfg)
        row = {"hints": cfg}
        try:
            outs = execute(fd, inputs, hints=hints)
            sync()
            row["schedule"] = short_schedule(fd.last_schedule())
            if ref is not None:
                row["max_rel_err"] = max_rel_err(outs, ref)
                row["correct"] = row["max_rel_err"] <= TOLERANCE  # a wrong config is not best
            del outs
            row.update(timed(lambda h=hints: execute(fd, inputs, hints=h)))
        except FuserError as exc:
            row["skipped"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        except Exception as exc:
            row.update(error_record(exc))
        configs.append(row)
    entry["tune"] = {"configs": configs}
    ok = [r for r in configs if "time_us" in r and r.get("correct", True)]
    if ok:
        best = min(ok, key=lambda r: r["time_us"])
        execute(fd, inputs, hints=Hints(**best["hints"]))
        entry["tune"]["best_schedule"] = str(fd.last_schedule())
        entry["impls"]["fuser_tuned"] = {"time_us": best["time_us"], "hints": best["hints"],
                                         "correct": best.get("correct")}
    for r in configs:
        if "time_us" in r:
            r["gbps"] = gbps(entry["bytes"], r["time_us"])


def free_memory() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def run_fusion(fusion: str, args, env: dict, timer_desc: str, timer, dtype) -> dict:
    from bench.plot import plot_report

    report = {
        "schema": 1,
        "fusion": fusion,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **env,
        "dtype": args.dtype,
        "rows": args.rows,
        "timer": timer_desc,
        "l2": "cold: the timer flushes L2 (256 MiB zeroed) before every timed call; no rotation",
        "bytes": "sum of input nbytes + output nbytes (each read or written once)",
        "inputs": (f"fuser.fusions.make_inputs, seed {args.seed}, "
                   + (f"{args.gen_rows} rows drawn and tiled on the GPU" if args.gen_rows
                      else "all rows drawn")),
        "tolerance": TOLERANCE,
        "results": [],
    }
    json_path, png_path = output_paths(args.out, report["date"], fusion)
    for hidden in args.hidden:
        t0 = time.perf_counter()
        print(f"[bench] {fusion} hidden={hidden} ...", flush=True)
        try:
            entry = bench_size(fusion, hidden, args, dtype, timer)
        except Exception as exc:  # inputs could not be made: record and go on
            entry = {"hidden": hidden, **error_record(exc), "impls": {}}
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        report["results"].append(entry)
        free_memory()
        summary = ", ".join(
            f"{k} {m['gbps']:.0f} GB/s" if "gbps" in m
            else f"{k} {'error' if 'error' in m else '-'}"
            for k, m in entry["impls"].items())
        print(f"[bench]   {entry['wall_s']} s: {summary}; max_rel_err "
              f"{entry.get('max_rel_err')}", flush=True)
        for k, m in entry["impls"].items():
            if "error" in m:
                print(f"[bench]   {k}: {m['error'][:500]}", flush=True)
            if "kernels_us" in m:
                print(f"[bench]   {k} kernels (us per call of {m.get('time_us', 0):.1f}): "
                      f"{kernels_line(m['kernels_us'])}", flush=True)
            if "hints" in m:
                print(f"[bench]   {k} hints: {m['hints']}", flush=True)
        write_report(report, args.out)
        try:
            plot_report(report, png_path)
        except Exception as exc:
            print(f"[bench]   plot failed: {exc}", flush=True)
    if not args.no_startup:
        report["startup"] = startup_record(fusion, args)
        write_report(report, args.out)
    if not args.no_host:
        report["host"] = host_record(fusion, args.hidden[0])
        write_report(report, args.out)
    print(f"[bench] wrote {json_path} and {png_path}", flush=True)
    return report


def startup_record(fusion: str, args) -> dict:
    """bench/startup.py's fresh-process costs of `fusion` at 16 rows of the first hidden
    size (import, cold first call, warm first call), or {"error": ...}."""
    from bench import startup

    try:
        record = startup.measure(fusion, args.hidden[0], dtype=DTYPES[args.dtype])
    except Exception as exc:
        return error_record(exc)
    print(f"[bench] {fusion} start-up: import fuser {record['import_ms']} ms, first call "
          f"{record['cold_first_call_s']} s cold ({record['cold_compiles']} compiles), "
          f"{record['warm_first_call_ms']} ms with the disk cache", flush=True)
    return record


HOST_ROWS, HOST_CALLS = 16, 2000
# Issue 16's peer figure for the host time of a cached call, beside which ours is printed:
# nvFuser 0.2.36, RMSNorm backward [16 x 1024] bf16 with torch tensors, H200, 2026-11-30.
NVFUSER_HOST_US = {("rmsnorm_bwd", 1024): 25.0}
HOST_TARGET_US = 15.0


def host_record(fusion: str, hidden: int) -> dict:
    """Microseconds per cached fd.execute of `fusion` at HOST_ROWS x `hidden` (the GPU idle:
    what Python, the array library and the driver spend), with torch tensors and CuPy
    arrays, beside nvFuser's figure where issue 16 measured one; an error record where it
    fails."""
    from bench.host_profile import cached_call, per_call_us

    record: dict = {"rows": HOST_ROWS, "hidden": hidden, "calls": HOST_CALLS,
                    "target_us": HOST_TARGET_US}
    try:
        for kind in ("torch", "cupy"):
            fd, inputs = cached_call(fusion, hidden, HOST_ROWS, kind)
            record[f"{kind}_us"] = round(per_call_us(fd, inputs, HOST_CALLS), 1)
    except Exception as exc:
        return {**record, **error_record(exc)}
    peer = NVFUSER_HOST_US.get((fusion, hidden))
    if peer is not None:
        record["nvfuser_us"] = peer
        record["nvfuser_measured"] = "nvFuser 0.2.36, torch tensors, H200, 2026-11-30 (issue 16)"
    print(f"[bench] {fusion} host time per cached call at {HOST_ROWS} x {hidden}: torch "
          f"{record['torch_us']} us, CuPy {record['cupy_us']} us (target {HOST_TARGET_US} us"
          + (f"; nvFuser {peer} us" if peer is not None else "") + ")", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from fuser import DataType

    if not torch.cuda.is_available():
        print("bench/run.py needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    dtype = getattr(DataType, DTYPES[args.dtype])
    timer_desc, timer = make_timer(args.timer)
    env = environment()
    print(f"[bench] {env['device']}, torch {env['torch']}, cupy {env['cupy']}, "
          f"triton {env['triton']}, NVRTC {env['nvrtc']}; timer: {timer_desc}", flush=True)
    tables = []
    for fusion in args.fusion:  # each table as soon as its fusion is done, all again at the end
        tables.append(markdown_table(run_fusion(fusion, args, env, timer_desc, timer, dtype)))
        print("\n" + tables[-1] + "\n", flush=True)
    if len(tables) > 1:
        print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
