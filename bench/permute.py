"""fuser's permute kernel (fuser/permute.py, the copies between a segmented fusion's kernels)
against PyTorch's copy of the same permuted view and a device copy of the same bytes.

    PYTHONPATH=. python3 bench/permute.py [--case NAME,...] [--out DIR]

Each case: median time of `moves.permuted` (allocation and launch, what a segmented call
runs) and of `x.permute(dims).contiguous()`, GB/s of one read and one write of the tensor and
its fraction of the copy's; both results are checked equal to PyTorch's bit for bit. Writes
OUT/<date>-permute.json (bench/run.py's report format) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

from bench.run import (
    add_case_options,
    check_cases,
    environment,
    error_record,
    finish_entry,
    make_timer,
    write_report,
)

# name: (shape, dims, torch dtype name)
CASES = {
    "seq_to_hidden_bf16": ((8, 1024, 4096), (0, 2, 1), "bfloat16"),
    "seq_to_hidden_fp32": ((8, 1024, 4096), (0, 2, 1), "float32"),
    "transpose_bf16": ((16384, 4096), (1, 0), "bfloat16"),
    "heads_bf16": ((4, 1024, 16, 128), (0, 2, 1, 3), "bfloat16"),
    "nchw_to_cnhw_bf16": ((32, 64, 56, 56), (1, 0, 2, 3), "bfloat16"),
    "nchw_to_nhwc_bf16": ((32, 64, 56, 56), (0, 2, 3, 1), "bfloat16"),
    "odd_transpose_fp16": ((4099, 3001), (1, 0), "float16"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_options(p, CASES)
    args = p.parse_args(argv)
    check_cases(p, args, CASES)
    return args


def bench_case(name: str, timer) -> dict:
    import torch

    from bench.baselines import device_copy
    from fuser import permute
    from fuser.moves import permuted

    shape, dims, dtype = CASES[name]
    x = torch.randn(shape, device="cuda").to(getattr(torch, dtype))
    nbytes = 2 * x.numel() * x.element_size()
    p = permute.plan(tuple(shape), dims, x.element_size(), 16)
    entry: dict = {"case": name, "shape": "x".join(map(str, shape)), "dims": list(dims),
                   "dtype": dtype, "bytes": nbytes, "plan": p.describe(), "impls": {}}
    copy_fn, copy_bytes = device_copy(nbytes)
    entry["impls"]["copy"] = {"bytes": copy_bytes, "time_us": timer(copy_fn) * 1e3}
    expected = x.permute(dims).contiguous()
    for impl, fn in (("fuser", lambda: permuted(x, dims)),
                     ("torch", lambda: x.permute(dims).contiguous())):
        try:
            m = {"correct": bool(torch.equal(fn(), expected))}
            m["time_us"] = timer(fn) * 1e3
            entry["impls"][impl] = m
        except Exception as exc:
            entry["impls"][impl] = error_record(exc)
    return finish_entry(entry)


def markdown(report: dict) -> str:
    lines = ["| case | shape -> dims | dtype | fuser's plan | copy GB/s | fuser | torch |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for e in report["results"]:
        if "impls" not in e:
            lines.append(f"| {e['case']} | error: {e.get('error')} | | | | | |")
            continue

        def cell(m: dict) -> str:
            if "gbps" not in m:
                return m.get("error", "-")
            return f"{m['gbps']:.0f} ({m['fraction_of_copy']:.2f})" + (
                "" if m.get("correct") else " WRONG")

        i = e["impls"]
        lines.append(f"| {e['case']} | {e['shape']} -> {e['dims']} | {e['dtype']} | {e['plan']} "
                     f"| {i['copy']['gbps']:.0f} | {cell(i['fuser'])} | {cell(i['torch'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    timer_desc, timer = make_timer(args.timer)
    report = {"fusion": "permute", "timer": timer_desc,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": "PYTHONPATH=. python3 bench/permute.py " + shlex.join(
                  sys.argv[1:] if argv is None else argv),
              **environment(), "results": []}
    for name in args.case:
        try:
            report["results"].append(bench_case(name, timer))
        except Exception as exc:
            report["results"].append({"case": name, **error_record(exc)})
        write_report(report, args.out)
    print(markdown(report))
    wrong = [e for e in report["results"]
             if "impls" not in e or e["impls"]["fuser"].get("correct") is not True]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
