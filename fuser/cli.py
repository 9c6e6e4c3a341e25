"""python -m fuser: look at every step of a fusion, with or without a GPU.

    python -m fuser show dropout_rmsnorm_bwd --shape 16384x24578 --dtype bf16 --device h200
    python -m fuser show rmsnorm_bwd --shape 16384x24578 --hint aligned_copy=true --hint stages=1
    python -m fuser demo            # the headline fusion, step by step; runs it if a GPU is here
    python -m fuser info            # device presets, versions, kernel cache
    python -m fuser cache-clear

`show` needs no GPU: the kernel is scheduled for the named device preset and compiled offline
by NVRTC, so the ptxas report is the real one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from fuser.analysis import analyze
from fuser.device import PRESETS, DeviceSpec
from fuser.dtypes import DataType
from fuser.errors import FuserError, HintError
from fuser.fusions import FUSIONS, make_inputs
from fuser.kernels import Built, build
from fuser.schedulers import Hints, Problem

DTYPES = {"bf16": DataType.BFloat16, "fp16": DataType.Half, "fp32": DataType.Float}
HEADLINE = ("dropout_rmsnorm_bwd", 16384, 24578, "bf16")
VALIDATION_ROWS = 512  # rows checked against the float64 reference on the host


def _shape(text: str) -> tuple[int, int]:
    try:
        rows, hidden = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not ROWSxHIDDEN, e.g. 16384x4096") from None
    if rows < 1 or hidden < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} needs positive sizes")
    return rows, hidden


_HINT_KINDS = tuple(f.name for f in dataclasses.fields(Hints))
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def _hint(text: str) -> tuple[str, object]:
    """KEY=VALUE of a Hints field, parsed into the type Hints takes: true/false for
    aligned_copy, a storage word for accumulators, for storage a comma list of
    TENSOR:STORAGE, an int for the others. Only the syntax is checked here: Hints and the
    scheduler hold the values against the fusion and the device (a HintError names what is
    allowed and what the heuristic picks)."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or key not in _HINT_KINDS:
        raise argparse.ArgumentTypeError(
            f"hint {text!r} is not KEY=VALUE with KEY one of {', '.join(_HINT_KINDS)}")
    if key == "aligned_copy":
        if value.lower() not in _BOOLEANS:
            raise argparse.ArgumentTypeError(f"aligned_copy={value!r}: use true or false")
        return key, _BOOLEANS[value.lower()]
    if key == "accumulators":
        return key, value
    if key == "storage":
        pairs = tuple(tuple(x.strip() for x in item.split(":", 1))
                      for item in value.split(",") if item.strip())
        if not pairs or any(len(p) != 2 or not all(p) for p in pairs):
            raise argparse.ArgumentTypeError(
                f"storage={value!r}: use TENSOR:STORAGE pairs, e.g. T0:smem,T2:registers")
        return key, pairs
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}={value!r}: an integer is needed") from None


def _hints(given: list[tuple[str, object]]) -> Hints | None:
    """The Hints of the --hint options (None without any); Hints checks their types and
    storage words, the scheduler their values."""
    if not given:
        return None
    keys = [k for k, _ in given]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise HintError(f"--hint {', '.join(twice)} given more than once; give each hint once")
    fields: dict[str, Any] = dict(given)
    return Hints(**fields)


def _hint_words(hints: Hints | None) -> str:
    """'  with stages=2, aligned_copy=True': the hints that are set, for a title."""
    words = hints.words() if hints is not None else ""
    return f"  with {words}" if words else ""


def _section(title: str) -> str:
    return f"\n=== {title} " + "=" * max(0, 72 - len(title))


def describe(name: str, rows: int, hidden: int, dtype: str, device: DeviceSpec,
             hints: Hints | None = None) -> tuple:
    """Every step for fusion `name`: (printable report, the fusion definition, the build)."""
    fd = FUSIONS[name](DTYPES[dtype])
    info = analyze(fd.fusion)
    built: Built = build(fd.name, info, Problem(hidden, min(rows, 1024), 16), device, hints)
    parts = [
        _section(f"{name}  [{rows} x {hidden}]  {dtype}  on {device.name}" + _hint_words(hints)),
        "fusion definition (repr):",
        repr(fd).rstrip(),
        _section("classification"),
        info.describe(),
        _section("schedule"),
        str(built.schedule),
    ]
    if built.finalize is not None:
        parts += ["", str(built.finalize)]
    for entry, plan in built.plans():
        parts += [_section(f"shared memory plan: {entry}"), plan.table()]
    parts += [_section("ptxas report (NVRTC, offline)")]
    parts += [str(built.compiled.resource(entry)) for entry, _ in built.plans()]
    parts += [_section("CUDA source"), built.source.source.rstrip()]
    return "\n".join(parts), fd, built


def _run_on_gpu(fd, rows: int, hidden: int, dtype: str) -> str:
    """Execute and validate on the GPU here, and time against a copy of the same bytes."""
    import cupy
    import numpy as np

    # Validate on a slice of the rows (the float64 reference runs on the host), then time the
    # full size on those rows repeated: real data, not zeros.
    sample = min(rows, VALIDATION_ROWS)
    host = make_inputs(fd.name, sample, hidden, DTYPES[dtype], np.random.default_rng(0))
    fd.validate([cupy.asarray(a) for a in host])
    reps = -(-rows // sample)
    inputs = [cupy.asarray(np.tile(a, (reps, 1))[:rows] if a.ndim == 2 else a) for a in host]
    outputs = fd.execute(inputs)
    nbytes = sum(a.nbytes for a in inputs) + sum(o.nbytes for o in outputs)
    src = cupy.empty(nbytes // 2, dtype=cupy.uint8)
    dst = cupy.empty_like(src)

    def median_us(fn, repeat: int = 50) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(repeat):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        return float(np.median(times))

    fuser_us = median_us(lambda: fd.execute(inputs))
    copy_us = median_us(lambda: dst.__setitem__(Ellipsis, src))
    run = fd._last_run
    return "\n".join([
        _section("run on this GPU"),
        f"validated against the float64 reference on {sample} rows: ok ({len(outputs)} "
        "outputs)",
        f"launch: grid {run.launch.grid}, block {run.launch.block}, "
        f"dynamic smem {run.launch.dynamic_smem} B",
        f"fuser {fuser_us:.1f} us = {nbytes / fuser_us / 1e3:.0f} GB/s; copy of the same "
        f"{nbytes / 1e6:.1f} MB {copy_us:.1f} us = {nbytes / copy_us / 1e3:.0f} GB/s; "
        f"fuser / copy = {copy_us / fuser_us:.2f}",
    ])


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuser", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="classification, schedule, smem plan, CUDA, ptxas report")
    show.add_argument("fusion", choices=sorted(FUSIONS))
    show.add_argument("--shape", type=_shape, default=(16384, 4096), help="ROWSxHIDDEN")
    show.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    show.add_argument("--device", choices=sorted(PRESETS), default="h200")
    show.add_argument("--hint", type=_hint, action="append", default=[], metavar="KEY=VALUE",
                      help="override the heuristic (fuser.schedulers.Hints), e.g. "
                           "aligned_copy=true, stages=2, threads_per_row=256, cluster=2, "
                           "storage=T0:smem,T2:ring, accumulators=smem, finalize_lanes=32")
    demo = sub.add_parser("demo", help="the headline fusion, every step; runs it on a GPU")
    demo.add_argument("--shape", type=_shape, default=HEADLINE[1:3], help="ROWSxHIDDEN")
    sub.add_parser("info", help="device presets, versions and the kernel cache")
    sub.add_parser("cache-clear", help="delete fuser's compiled kernels on disk")
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            rows, hidden = args.shape
            hints = _hints(args.hint)
            print(describe(args.fusion, rows, hidden, args.dtype, DeviceSpec.get(args.device),
                           hints)[0])
        elif args.command == "demo":
            rows, hidden = args.shape
            gpu = _gpu_available()
            device = DeviceSpec.from_cupy() if gpu else DeviceSpec.get("h200")
            text, fd, _ = describe(HEADLINE[0], rows, hidden, HEADLINE[3], device)
            print(text)
            if gpu:
                print(_run_on_gpu(fd, rows, hidden, HEADLINE[3]))
            else:
                print(_section("run") + "\nno CUDA GPU here: scheduled and compiled for the "
                      "H200 preset only (make test-gpu and make bench run it on a GPU)")
        elif args.command == "info":
            _info()
        else:
            from fuser.cache import default_cache

            default_cache().clear()
            print("kernel cache cleared")
    except FuserError as error:
        print(f"fuser: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _info() -> None:
    import fuser
    from fuser.cache import default_cache
    from fuser.compile import nvrtc_version

    print(f"fuser {fuser.__version__}; NVRTC {'.'.join(map(str, nvrtc_version()))}")
    print(f"GPU here: {DeviceSpec.from_cupy() if _gpu_available() else 'none'}")
    print("device presets:")
    for name, spec in sorted(PRESETS.items()):
        print(f"  {name:<12} {spec}")
    print(f"kernel cache: {default_cache().stats()}")
