"""Time fuser's default schedule against named Hints, or another source tree's, size by size.

    PYTHONPATH=. python3 bench/variants.py --case rmsnorm_bwd:65536 --case softmax_fwd:4096 \
        --variant 'c4s2={"cluster": 4, "stages": 2}' [--rows 16384] [--dtype bf16] \
        [--tree DIR] [--warm 16] [--out f.json]

For each case, the default schedule and every variant (a name and the Hints fields as JSON)
run on the same inputs; outputs are checked against the default's (max relative error), the
default's against PyTorch's eager ops (`correct`: within bench.run's TOLERANCE; `eager_error`
where those ops fail), so a tree whose default is wrong shows it. Each call is timed with
bench.run's timer (triton's do_bench median, L2 flushed before each call), beside a device
copy of the same bytes. A variant the scheduler refuses is reported
with its HintError. `--tree DIR` imports fuser from DIR instead of this checkout, so two
versions run in one job one after the other (before and after a change; bench/ab.py runs
this once per tree, the trees alternated); `--warm N` compiles every kernel first in N
processes (NVRTC runs on the CPU), so the timed loop only loads them. Prints one line per run
and, with --out, writes them as json. The tool behind policy decisions that compare
schedules (bench/TUNING.md); bench/run.py measures the defaults against the peers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/variants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", default=[], metavar="FUSION:HIDDEN")
    p.add_argument("--fusion", default="", help="comma list: with --hidden, every pair is a case")
    p.add_argument("--hidden", default="", help="comma list of hidden sizes")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--gen-rows", type=int, default=256,
                   help="rows drawn on the host, tiled on the GPU (default: %(default)s)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--tree", type=Path, default=ROOT, help="the fuser source tree to time")
    p.add_argument("--warm", type=int, default=0, help="processes compiling every kernel first")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.cases = [(f, int(h)) for f, _, h in (c.partition(":") for c in args.case)]
    if args.fusion and args.hidden:
        args.cases += [(f, int(h)) for f in args.fusion.split(",") for h in args.hidden.split(",")]
    if not args.cases:
        p.error("give --case FUSION:HIDDEN, or --fusion and --hidden")
    return args


def variants(specs: list[str]) -> list[tuple[str, dict]]:
    """('default', {}) and each NAME=JSON given."""
    out: list[tuple[str, dict]] = [("default", {})]
    for spec in specs:
        name, _, fields = spec.partition("=")
        out.append((name, json.loads(fields)))
    return out


def _setup(tree: Path) -> None:
    """fuser from `tree` (its templates too), bench.run from this checkout."""
    sys.path[:0] = [str(tree), str(ROOT)] if tree != ROOT else [str(ROOT)]


def _warm(job: tuple) -> str:
    """Compile one case's kernel for the GPU here (a worker process: no CUDA context)."""
    tree, fusion, hidden, rows, dtype_name, fields, device = job
    _setup(tree)
    from fuser import DataType, FuserError
    from fuser.analysis import analyze
    from fuser.fusions import FUSIONS
    from fuser.kernels import build
    from fuser.schedulers import Hints, Problem

    fd = FUSIONS[fusion](getattr(DataType, dtype_name))
    try:
        build(fd.name, analyze(fd.fusion), Problem(hidden, min(rows, 1024), 16), device,
              Hints(**fields) if fields else None)
    except FuserError as exc:
        return f"{fusion}:{hidden} {fields}: {type(exc).__name__}"
    return ""


def warm(args) -> None:
    from bench.run import DTYPES, rows_for_budget
    from fuser.device import DeviceSpec

    device = DeviceSpec.from_gpu(0)
    dtype_name = DTYPES[args.dtype]
    jobs = [(args.tree, f, h, rows_for_budget(f, args.rows, h, 4 if args.dtype == "fp32" else 2),
             dtype_name, fields, device)
            for f, h in args.cases for _, fields in variants(args.variant)]
    with multiprocessing.get_context("spawn").Pool(args.warm) as pool:
        for message in pool.imap_unordered(_warm, jobs):
            if message:
                print(f"warm: {message}", flush=True)


def run_case(fusion: str, hidden: int, args, timer) -> list[dict]:
    import fuser
    from bench import baselines
    from bench.run import (
        DTYPES,
        device_inputs,
        gbps,
        max_rel_err,
        minimal_bytes,
        rows_for_budget,
        sync,
    )
    from fuser import DataType
    from fuser.executor import execute
    from fuser.fusions import FUSIONS
    from fuser.schedulers import Hints

    dtype = getattr(DataType, DTYPES[args.dtype])
    rows = rows_for_budget(fusion, args.rows, hidden, dtype.itemsize)
    fd = FUSIONS[fusion](dtype)
    inputs = device_inputs(fusion, rows, hidden, dtype, args.gen_rows, 0)
    reference, copy_us = None, None
    records = []
    for name, fields in variants(args.variant):
        record: dict = {"fusion": fusion, "hidden": hidden, "rows": rows, "variant": name,
                        "hints": fields}
        records.append(record)
        hints = Hints(**fields) if fields else None
        try:
            outputs = execute(fd, inputs, hints=hints)
            sync()
        except getattr(fuser, "HintError", fuser.FuserError) as exc:  # older trees lack it
            record["refused"] = str(exc).splitlines()[0]
            continue
        if reference is None:
            reference = outputs
            record.update(_against_eager(fusion, inputs, outputs))
        nbytes = minimal_bytes(inputs, outputs)
        if copy_us is None:
            copy_fn, _ = baselines.device_copy(nbytes)
            copy_us = timer(copy_fn) * 1000.0
        record["max_rel_err"] = max_rel_err(outputs, reference)
        record["schedule"] = _schedule_words(fd.last_schedule())
        record["dealing"] = str(getattr(fd.last_schedule(), "dealing", ""))
        record["time_us"] = us = timer(lambda h=hints: execute(fd, inputs, hints=h)) * 1000.0
        record["gbps"] = gbps(nbytes, us)
        record["fraction_of_copy"] = copy_us / us
        wrong = "" if record.get("correct", True) else "  WRONG against eager"
        print(f"{fusion:20s} {hidden:7d} {name:10s} {us:9.1f} us {copy_us / us:5.2f} of copy "
              f"err {record['max_rel_err']:.1e}{wrong}  {record['dealing']}: {record['schedule']}",
              flush=True)
    return records


def _schedule_words(schedule) -> str:
    """A schedule's reason; a segmented fusion's (fuser.segment.SegmentSchedules): each
    segment's reason, joined by ' | '."""
    parts = getattr(schedule, "schedules", None)
    if parts is None:
        return schedule.reason
    return " | ".join(getattr(s, "reason", str(s)) for s in parts)


def _against_eager(fusion: str, inputs: list, outputs) -> dict:
    """The default's outputs against PyTorch's eager ops on the same inputs: the error, and
    whether it is within bench.run's TOLERANCE; the eager error's text where those ops fail."""
    from bench import baselines
    from bench.run import TOLERANCE, max_rel_err

    try:
        err = max_rel_err(outputs, baselines.eager(fusion, inputs)())
    except Exception as exc:  # no eager form of this fusion, or outputs of another kind
        return {"eager_error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return {"eager_rel_err": err, "correct": err <= TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _setup(args.tree)
    if args.warm:
        warm(args)
    from bench.run import make_timer, source_digest

    _, timer = make_timer("auto")
    records = []
    for fusion, hidden in args.cases:
        records += run_case(fusion, hidden, args, timer)
    for r in records:
        if "refused" in r:
            print(f"{r['fusion']:20s} {r['hidden']:7d} {r['variant']:10s} refused: {r['refused']}")
    if args.out:
        args.out.write_text(json.dumps({"tree": str(args.tree), "dtype": args.dtype,
                                        "source": source_digest(args.tree),
                                        "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
