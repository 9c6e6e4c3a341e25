"""fuser.torch's softmax, log_softmax and cross entropy along a dim other than the last: the
outer kernel on x where it lies (the columns form) against x moved to rows and back (two
copies around the row kernel), and torch eager, forward and training step.

    PYTHONPATH=. python3 bench/along_dim.py [--case NAME,...] [--out DIR]

The form fuser.torch takes is fuser.torch._support.normalized_along_columns's: columns where
a group (the dim and the dims after it) holds COLUMNS_MIN_GROUP elements or more. Each case
times both forms by setting that threshold to 0 (columns) and beyond any size (moved), so
the threshold can be placed where they cross. Bytes: a forward reads x and writes y (cross
entropy: reads the logits); a training step also reads y and dy and writes dx (cross
entropy: writes the logits' gradient). Each form's outputs and x's gradient are checked
against torch's in float64 (bench/run.py's max_rel_err, marked wrong above TOLERANCE).
Writes OUT/<date>-along-dim-<pass>.json (bench/run.py's format) and prints a table a pass.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

from bench.run import (
    TOLERANCE,
    add_case_options,
    check_cases,
    environment,
    error_record,
    finish_entry,
    make_timer,
    max_rel_err,
    write_report,
)

# name: (op, shape, dim); cross entropy's classes are dim 1
CASES = {
    "softmax_seq_8x1024x4096": ("softmax", (8, 1024, 4096), 1),
    "softmax_heads_32x12x1024": ("softmax", (32, 12, 1024), 1),
    "softmax_dim0_16384x4096": ("softmax", (16384, 4096), 0),
    "softmax_small_groups_100000x3x5": ("softmax", (100000, 3, 5), 1),
    "softmax_narrow_64x4096x4": ("softmax", (64, 4096, 4), 1),
    "softmax_groups_4096x16x64": ("softmax", (4096, 16, 64), 1),
    "softmax_groups_2048x64x2": ("softmax", (2048, 64, 2), 1),
    "log_softmax_seq_8x1024x4096": ("log_softmax", (8, 1024, 4096), 1),
    "cross_entropy_seg_8x21x256x256": ("cross_entropy", (8, 21, 256, 256), 1),
    "cross_entropy_seg_4x150x128x128": ("cross_entropy", (4, 150, 128, 128), 1),
    "cross_entropy_small_16384x5x3": ("cross_entropy", (16384, 5, 3), 1),
}
PASSES = ("forward", "train")
FORMS = {"columns": 0, "moved": 1 << 62}  # COLUMNS_MIN_GROUP that forces each form


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_options(p, CASES)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    args = p.parse_args(argv)
    check_cases(p, args, CASES)
    return args


def pass_bytes(op: str, pass_: str, numel: int, itemsize: int) -> int:
    """A pass's minimal traffic (module docstring)."""
    if op == "cross_entropy":
        return (1 if pass_ == "forward" else 2) * numel * itemsize
    return (2 if pass_ == "forward" else 5) * numel * itemsize


def functions(op: str, dim: int, target):
    """(fuser's, torch's) function of x for `op`."""
    import torch

    import fuser.torch as ft

    if op == "cross_entropy":
        return (lambda x: ft.cross_entropy(x, target),
                lambda x: torch.nn.functional.cross_entropy(x, target))
    ours, theirs = (ft.softmax, torch.softmax) if op == "softmax" else (
        ft.log_softmax, torch.log_softmax)
    return (lambda x: ours(x, dim)), (lambda x: theirs(x, dim))


def bench_case(name: str, args, timer) -> dict[str, dict]:
    """pass -> the entry of one case: each form's and torch's time, GB/s and check."""
    import torch

    from bench.baselines import device_copy
    from fuser.torch import _support

    op, shape, dim = CASES[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(shape, device="cuda", generator=gen)).to(dtype).requires_grad_()
    target = None
    if op == "cross_entropy":
        target = torch.randint(0, shape[1], shape[:1] + shape[2:], device="cuda", generator=gen)
    ours, theirs = functions(op, dim, target)
    y64 = theirs(x.detach().double().requires_grad_())
    # a plain loss.backward() for cross entropy (the form that writes the gradient in the
    # forward; bench/modules.py's train_scaled times another loss gradient)
    dy = (torch.ones(()) if op == "cross_entropy" else torch.randn(
        y64.shape, generator=gen, device="cuda")).to(device="cuda", dtype=dtype)

    def results(fn, x):
        y = fn(x)
        return [y.detach().double(), torch.autograd.grad(y, x, dy.to(y.dtype))[0].double()]

    x64 = x.detach().double().requires_grad_()
    reference = results(theirs, x64)
    entries = {}
    for pass_ in PASSES:
        nbytes = pass_bytes(op, pass_, x.numel(), x.element_size())
        copy_fn, copy_bytes = device_copy(nbytes)
        entries[pass_] = {"case": name, "op": op, "shape": "x".join(map(str, shape)),
                          "dim": dim, "bytes": nbytes, "impls": {
                              "copy": {"bytes": copy_bytes, "time_us": timer(copy_fn) * 1e3}}}
    kept = _support.COLUMNS_MIN_GROUP
    impls = {**{f"fuser_{form}": (ours, threshold) for form, threshold in FORMS.items()},
             "eager": (theirs, kept)}
    try:
        for impl, (fn, threshold) in impls.items():
            _support.COLUMNS_MIN_GROUP = threshold
            try:
                err = max_rel_err(results(fn, x), [r.to(dtype).double() for r in reference])
                check = {"max_rel_err": err, "correct": err <= TOLERANCE}
                steps = {"forward": lambda fn=fn: fn(x.detach()),
                         "train": lambda fn=fn: torch.autograd.grad(fn(x), x, dy)}
                for pass_, entry in entries.items():
                    entry["impls"][impl] = {**check, "time_us": timer(steps[pass_]) * 1e3}
            except Exception as exc:
                for entry in entries.values():
                    entry["impls"][impl] = error_record(exc)
    finally:
        _support.COLUMNS_MIN_GROUP = kept
    return {pass_: finish_entry(entry) for pass_, entry in entries.items()}


def markdown(report: dict) -> str:
    lines = [f"{report['pass']}:", "| case | shape, dim | copy GB/s | fuser columns | "
             "fuser moved | torch eager |", "| --- | --- | --- | --- | --- | --- |"]

    def cell(m: dict) -> str:
        if "gbps" not in m:
            return m.get("error", "-")[:60]
        return f"{m['gbps']:.0f} ({m['fraction_of_copy']:.2f})" + (
            "" if m.get("correct") else " WRONG")

    for e in report["results"]:
        if "impls" not in e:
            lines.append(f"| {e['case']} | error: {e.get('error', '')[:80]} | | | | |")
            continue
        i = e["impls"]
        lines.append(f"| {e['case']} | {e['shape']}, {e['dim']} | {i['copy']['gbps']:.0f} | "
                     f"{cell(i['fuser_columns'])} | {cell(i['fuser_moved'])} | "
                     f"{cell(i['eager'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    timer_desc, timer = make_timer(args.timer)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = "PYTHONPATH=. python3 bench/along_dim.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    reports = {p: {"fusion": f"along-dim-{p}", "pass": p, "timer": timer_desc, "date": date,
                   "command": command, "dtype": args.dtype, **environment(), "results": []}
               for p in PASSES}
    for name in args.case:
        try:
            for pass_, entry in bench_case(name, args, timer).items():
                reports[pass_]["results"].append(entry)
        except Exception as exc:
            for report in reports.values():
                report["results"].append({"case": name, **error_record(exc)})
        for report in reports.values():
            write_report(report, args.out)
    for report in reports.values():
        print(markdown(report), "\n")
    wrong = [e for r in reports.values() for e in r["results"] if "impls" not in e
             or any(m.get("correct") is not True for k, m in e["impls"].items() if k != "copy")]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
