"""Time fuser's default schedule against named Hints, size by size, in one process.

    PYTHONPATH=. python3 bench/variants.py --case rmsnorm_bwd:65536 --case softmax_fwd:4096 \
        --variant 'c4s2={"cluster": 4, "stages": 2}' [--rows 16384] [--dtype bf16] [--out f.json]

For each case, the default schedule and every variant (a name and the Hints fields as JSON)
run on the same inputs; outputs are checked against the default's (max relative error), and
each is timed with bench.run's timer (triton's do_bench median, L2 flushed before each call).
A variant the scheduler refuses is reported with its HintError. Prints one line per run and,
with --out, writes them as json. The tool behind policy decisions that compare schedules of
one source tree (bench/TUNING.md); bench/run.py measures the defaults against peers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import (
    DTYPES,
    device_inputs,
    gbps,
    make_timer,
    max_rel_err,
    minimal_bytes,
    rows_for_budget,
    source_digest,
    sync,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/variants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", required=True, metavar="FUSION:HIDDEN")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def variants(specs: list[str]) -> list[tuple[str, dict]]:
    """('default', {}) and each NAME=JSON given."""
    out = [("default", {})]
    for spec in specs:
        name, _, fields = spec.partition("=")
        out.append((name, json.loads(fields)))
    return out


def run_case(fusion: str, hidden: int, args, timer) -> list[dict]:
    from fuser import DataType, HintError
    from fuser.executor import execute
    from fuser.fusions import FUSIONS
    from fuser.schedulers import Hints

    dtype = getattr(DataType, DTYPES[args.dtype])
    rows = rows_for_budget(fusion, args.rows, hidden, dtype.itemsize)
    fd = FUSIONS[fusion](dtype)
    inputs = device_inputs(fusion, rows, hidden, dtype, 2048, 0)
    reference = None
    records = []
    for name, fields in variants(args.variant):
        record = {"fusion": fusion, "hidden": hidden, "rows": rows, "variant": name,
                  "hints": fields}
        hints = Hints(**fields) if fields else None
        try:
            outputs = execute(fd, inputs, hints=hints)
            sync()
        except HintError as exc:
            record["refused"] = str(exc).splitlines()[0]
            records.append(record)
            continue
        reference = reference if reference is not None else outputs
        record["max_rel_err"] = max_rel_err(outputs, reference)
        s = fd.last_schedule()
        record["schedule"] = s.reason
        us = timer(lambda h=hints: execute(fd, inputs, hints=h)) * 1000.0
        record["time_us"] = us
        record["gbps"] = gbps(minimal_bytes(inputs, outputs), us)
        records.append(record)
        print(f"{fusion:20s} {hidden:7d} {name:12s} {us:9.1f} us {record['gbps']:7.1f} GB/s "
              f"err {record['max_rel_err']:.1e}  {s.reason}", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, timer = make_timer("auto")
    records = []
    for case in args.case:
        fusion, _, hidden = case.partition(":")
        records += run_case(fusion, int(hidden), args, timer)
    for r in records:
        if "refused" in r:
            print(f"{r['fusion']:20s} {r['hidden']:7d} {r['variant']:12s} refused: {r['refused']}")
    if args.out:
        args.out.write_text(json.dumps({"source": source_digest(), "dtype": args.dtype,
                                        "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
