"""Time the outer-persistent kernel under other geometry orders than its ORDER table.

    PYTHONPATH=. python3 bench/outer_geometry.py \
        --order 'two256=[[128,256,2],[64,256,2],[128,512,1],[64,512,1],[32,512,1],[16,512,1]]' \
        [--order NAME=JSON ...] [--clusters 1,2,4,8,16] [--dtype fp32] [--no-check] [--out f.json]

Each order (a list of [row segment bytes, threads per block, least blocks per SM], the form
of fuser.schedulers.outer_persistent.ORDER) runs in a process of its own with a fresh kernel
cache, with ORDER and the allowed cluster sizes set to it: they are the scheduler's policy,
not hints, so no Hints reach them. Every case (BatchNorm forward and backward, softmax over
dim 0, in --dtype (bf16 unless given), at [16384, 4096] and [4096, 16384]) is timed with
bench.run's timer beside a device copy of the same bytes, and checked against the float64
oracle once (unless --no-check). The tool behind "outer-persistent kernels" in bench/TUNING.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.run import DTYPES

ROOT = Path(__file__).resolve().parent.parent
CASES = [(name, rows, hidden) for name in ("batchnorm_fwd", "batchnorm_bwd", "softmax_dim0_fwd")
         for rows, hidden in ((16384, 4096), (4096, 16384))]


def parse_order(text: str) -> tuple[str, list[tuple[int, int, int]]]:
    """NAME=JSON into (name, [(segment bytes, threads, least blocks per SM), ...])."""
    name, sep, body = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--order {text!r}: give NAME=JSON")
    try:
        entries = [tuple(int(v) for v in entry) for entry in json.loads(body)]
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"--order {name}: {exc}") from None
    if not entries or any(len(e) != 3 for e in entries):
        raise argparse.ArgumentTypeError(
            f"--order {name}: a list of [segment bytes, threads, least blocks per SM]")
    return name, entries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/outer_geometry.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--order", type=parse_order, action="append", required=True)
    p.add_argument("--clusters", default="1,2,4,8,16",
                   type=lambda s: tuple(int(k) for k in s.split(",")))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--no-check", action="store_true",
                   help="skip the float64 check of each case, made on the host (a run of the "
                        "six cases with their checks took over 65 s on an H100's host)")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON of one order, in its own process
    return p.parse_args(argv)


def run_order(order: list, clusters: tuple[int, ...], dtype_name: str = "bf16",
              check: bool = True) -> list[dict]:
    """Every case under `order` (this process only: it sets the scheduler's policy)."""
    import cupy
    import numpy as np

    import fuser.schedulers.outer_persistent as policy
    from bench import baselines
    from bench.run import make_timer
    from fuser import DataType
    from fuser.fusions import FUSIONS, make_inputs

    policy.ORDER = tuple(tuple(entry) for entry in order)
    policy._clusters = lambda device: clusters
    _, timer = make_timer("auto")
    records = []
    dtype = getattr(DataType, DTYPES[dtype_name])
    for name, rows, hidden in CASES:
        fd = FUSIONS[name](dtype)
        host = make_inputs(name, rows, hidden, dtype, np.random.default_rng(0))
        inputs = [cupy.asarray(a) for a in host]
        outputs = fd.execute(inputs)
        if check:
            fd.validate(inputs)
        nbytes = sum(a.nbytes for a in inputs) + sum(o.nbytes for o in outputs)
        copy_fn, _ = baselines.device_copy(nbytes)
        us = timer(lambda fd=fd, inputs=inputs: fd.execute(inputs)) * 1e3
        copy_us = timer(copy_fn) * 1e3
        records.append({"case": f"{name} {rows}x{hidden}", "time_us": round(us, 1),
                        "fraction_of_copy": round(copy_us / us, 3),
                        "schedule": fd.last_schedule().reason})
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(run_order(json.loads(args.child), args.clusters, args.dtype,
                                   not args.no_check)))
        return 0
    results = {}
    for name, order in args.order:
        env = dict(os.environ, FUSER_CACHE_DIR=tempfile.mkdtemp(prefix="fuser-geometry-"))
        done = subprocess.run(
            [sys.executable, __file__, "--order", f"{name}={json.dumps(order)}", "--clusters",
             ",".join(map(str, args.clusters)), "--dtype", args.dtype,
             *(["--no-check"] if args.no_check else []), "--child", json.dumps(order)],
            env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"order {name}: its process failed ({done.returncode}):\n"
                     f"{done.stderr[-4000:]}")
        results[name] = {"order": order, "cases": json.loads(done.stdout.splitlines()[-1])}
        for r in results[name]["cases"]:
            print(f"{name:12s} {r['case']:28s} {r['time_us']:8.1f} us "
                  f"{r['fraction_of_copy']:5.2f} of copy  {r['schedule']}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
