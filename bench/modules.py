"""Module-level bandwidth: fuser.torch's modules against torch.nn's, eager and compiled, and
Liger-Kernel's, called as a model calls them.

    PYTHONPATH=. python3 bench/modules.py [--module rmsnorm,layernorm,softmax,cross_entropy,...]
        [--hidden 1024,4096,...] [--rows 16384] [--dtype bf16] [--no-compile] [--out DIR]

For each module and hidden size, two passes on [rows, hidden] inputs:

- `forward`: y = m(x), x requiring grad as in training (so what autograd saves is made too);
- `train`: the forward, then torch.autograd.grad(y, [x, *parameters], dy).

Cross entropy has two more: `infer`, the forward under torch.no_grad (where fuser's forward
reads the logits alone; in `forward` it writes their gradient too), and `train_scaled`, the
train pass for a loss gradient of 0.5, as a loss scaled for gradient accumulation (fuser's
forward then leaves the gradient to its backward, after the first call).

Modules: rmsnorm, layernorm, softmax and log_softmax (over the last dim), softmax_dim0 (over
the rows: one outer kernel each way in fuser), cross_entropy.

Implementations: `fuser` (fuser.torch.RMSNorm / LayerNorm / Softmax / LogSoftmax /
CrossEntropyLoss), `eager` (torch.nn's module), `compile` (torch.compile of torch.nn's
module, default mode, dynamic=False, compiled afresh per size), `liger` (Liger-Kernel's
LigerRMSNorm / LigerLayerNorm / LigerSoftmax / LigerCrossEntropyLoss with their defaults,
LigerRMSNorm's in_place off, where liger_kernel imports; it has no log_softmax and no softmax
over dim 0), and `copy` (a device copy of the same bytes, the
ceiling). `cross_entropy` is the mean loss of logits x [rows, hidden] (hidden classes) for
random class indices, a scalar whose gradient is 1 in `train`; Liger's loss writes the
logits' gradient over the logits in its forward, so it runs last. Every module has the same
parameters (weight 1 + 0.1 N(0, 1), bias 0.1 N(0, 1), rounded to the dtype); before timing,
each one's y and gradients are compared with torch.nn's module run in float64 on those
(`max_rel_err`, as bench/run.py's; above 5e-2 the entry is marked wrong).

Bytes: each pass's minimal traffic, every tensor read or written once. forward: x and y, and
each [hidden] parameter; train: that, plus dy and x read and dx written, and each parameter
read and its gradient written (the saved per-row statistics, 4 or 8 bytes a row, are left
out); cross_entropy's forward reads the logits, and its train reads them and writes their
gradient (the class indices, 8 bytes a row, left out). Writes
OUT/<date>-module-<module>-<pass>.json and .png in bench/run.py's format (so bench/plot.py
redraws them) and prints a markdown table per pass.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shlex
import sys
import time

from bench.run import (
    ITEMSIZE,
    TOLERANCE,
    add_common_args,
    csv_list,
    environment,
    error_record,
    finish_entry,
    make_timer,
    markdown_table,
    max_rel_err,
    output_paths,
    sync,
    write_report,
)

MODULES = ("rmsnorm", "layernorm", "softmax", "log_softmax", "softmax_dim0", "cross_entropy")
SOFTMAX_DIMS = {"softmax": -1, "log_softmax": -1, "softmax_dim0": 0}
PASSES = ("forward", "train")
LOSS_PASSES = ("infer", "forward", "train", "train_scaled")  # cross_entropy's (docstring)
DEFAULT_HIDDEN = (1024, 4096, 8192, 16384, 32768)
PARAMETERS = {"rmsnorm": 1, "layernorm": 2, "cross_entropy": 0, **dict.fromkeys(SOFTMAX_DIMS, 0)}
RMS_EPS, LN_EPS = 1e-6, 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/modules.py",
        description="fuser.torch modules vs torch.nn (eager, torch.compile) vs Liger, GB/s",
    )
    p.add_argument("--module", type=csv_list(str), default=list(MODULES),
                   help="comma-separated modules (default: %(default)s)")
    add_common_args(p, DEFAULT_HIDDEN)
    args = p.parse_args(argv)
    unknown = [m for m in args.module if m not in MODULES]
    if unknown:
        p.error(f"unknown module {', '.join(unknown)}; known: {', '.join(MODULES)}")
    if args.rows < 1 or any(h < 1 for h in args.hidden):
        p.error("--rows and --hidden must be positive")
    return args


def pass_bytes(module: str, pass_: str, rows: int, hidden: int, itemsize: int) -> int:
    """The minimal bytes of one pass (module docstring): forward 2 [rows, hidden] tensors and
    P parameters; train 5 [rows, hidden] tensors and 3 P parameter-sized ones. Cross entropy:
    the logits (infer, forward), the logits and their gradient (train, train_scaled)."""
    if module == "cross_entropy":
        return (1 if pass_ in ("infer", "forward") else 2) * rows * hidden * itemsize
    big, params = (2, 1) if pass_ == "forward" else (5, 3)
    return (big * rows * hidden + params * PARAMETERS[module] * hidden) * itemsize


# ----- GPU side ---------------------------------------------------------------------------------


def torch_module(module: str, hidden: int):
    """torch.nn's module."""
    import torch

    if module == "cross_entropy":
        return torch.nn.CrossEntropyLoss()
    if module == "rmsnorm":
        return torch.nn.RMSNorm(hidden, eps=RMS_EPS)
    if module == "layernorm":
        return torch.nn.LayerNorm(hidden, eps=LN_EPS)
    if module == "log_softmax":
        return torch.nn.LogSoftmax(dim=-1)
    return torch.nn.Softmax(dim=SOFTMAX_DIMS[module])


def fuser_module(module: str, hidden: int):
    import fuser.torch as ft

    if module == "cross_entropy":
        return ft.CrossEntropyLoss()
    if module == "rmsnorm":
        return ft.RMSNorm(hidden, eps=RMS_EPS)
    if module == "layernorm":
        return ft.LayerNorm(hidden, eps=LN_EPS)
    if module == "log_softmax":
        return ft.LogSoftmax(dim=-1)
    return ft.Softmax(dim=SOFTMAX_DIMS[module])


def liger_module(module: str, hidden: int):
    """Liger-Kernel's module with its defaults, but for LigerRMSNorm's in_place: its default
    backward writes dx over dy, which would feed every timed step the last one's dx (the
    same bytes move either way)."""
    from liger_kernel.transformers import (
        LigerCrossEntropyLoss,
        LigerLayerNorm,
        LigerRMSNorm,
        LigerSoftmax,
    )

    if module == "cross_entropy":
        return LigerCrossEntropyLoss()
    if module == "rmsnorm":
        return LigerRMSNorm(hidden, eps=RMS_EPS, in_place=False)
    if module == "layernorm":
        return LigerLayerNorm(hidden, eps=LN_EPS, bias=True)
    return LigerSoftmax()


def _targeted(loss, target):
    """A loss module called as the others are, m(x): `loss` of x and `target`."""
    import torch

    class Targeted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.loss = loss

        def forward(self, x):
            return self.loss(x, target)

    return Targeted()


def with_parameters(m, params: list, device, dtype):
    """`m` on the device in `dtype`, its weight (and bias) set to `params`."""
    import torch

    m = m.to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, value in zip(("weight", "bias"), params, strict=False):
            getattr(m, name).copy_(value)
    return m


def pass_fn(m, pass_: str, x, dy):
    """The timed call: the forward, the forward under torch.no_grad ("infer", as a model
    serving requests runs it), or the forward and the gradients of x and the parameters
    (for dy, or dy / 2: "train_scaled")."""
    import torch

    if pass_ == "forward":
        return lambda: m(x)
    if pass_ == "infer":

        def infer():
            with torch.no_grad():
                return m(x)

        return infer
    wrt = [x, *m.parameters()]
    if pass_ == "train_scaled":
        dy = dy * 0.5

    def train():
        return torch.autograd.grad(m(x), wrt, dy)

    return train


def passes(module: str) -> tuple[str, ...]:
    return LOSS_PASSES if module == "cross_entropy" else PASSES


def results(m, x, dy) -> list:
    """y, dx and each parameter's gradient, in float64 (one call; dy is cloned, in case a
    backward writes over it)."""
    import torch

    y = m(x)
    grads = torch.autograd.grad(y, [x, *m.parameters()], dy.clone())
    return [t.detach().double() for t in (y, *grads)]


def bench_size(module: str, hidden: int, args, timer) -> dict[str, dict]:
    """pass -> the entry of one hidden size: every implementation's time, GB/s and check."""
    import torch

    from bench import baselines

    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype])
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    x = torch.randn(args.rows, hidden, device="cuda", generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(args.rows, hidden, device="cuda", generator=gen).to(dtype)
    target = None
    if module == "cross_entropy":  # the loss is a scalar: its gradient is 1
        target = torch.randint(0, hidden, (args.rows,), device="cuda", generator=gen)
        dy = torch.ones((), device="cuda", dtype=dtype)
    params = [(1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype),
              (0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)]
    params = params[:PARAMETERS[module]]  # in the modules' dtype, so the reference has them too
    reference = with_parameters(_made(torch_module, module, hidden, target), params, "cuda",
                                torch.float64)
    ref = results(reference, x.detach().double().requires_grad_(), dy.double())
    del reference
    entries = {}
    for pass_ in passes(module):
        nbytes = pass_bytes(module, pass_, args.rows, hidden, ITEMSIZE[args.dtype])
        entries[pass_] = {"hidden": hidden, "rows": args.rows, "bytes": nbytes, "impls": {}}
        try:
            copy_fn, copy_bytes = baselines.device_copy(nbytes)
            entries[pass_]["impls"]["copy"] = {"time_us": timer(copy_fn) * 1e3,
                                               "bytes": copy_bytes}
            del copy_fn
        except Exception as exc:
            entries[pass_]["impls"]["copy"] = error_record(exc)
    makers = {"fuser": fuser_module, "eager": torch_module, "compile": torch_module,
              "liger": liger_module}
    for impl, make in makers.items():
        skipped = _skipped(impl, module, args)
        if skipped:
            for entry in entries.values():
                entry["impls"][impl] = {"skipped": skipped}
            continue
        try:  # one module per size: compiled once, its forward graph serving both passes
            m = with_parameters(_made(make, module, hidden, target), params, "cuda", dtype)
            if impl == "compile":
                torch._dynamo.reset()
                m = torch.compile(m, dynamic=False)
            t0 = time.perf_counter()
            err = max_rel_err(results(m, x, dy), ref)
            sync()
            check = {"first_call_s": round(time.perf_counter() - t0, 2), "max_rel_err": err,
                     "correct": err <= TOLERANCE}
            for pass_, entry in entries.items():
                entry["impls"][impl] = {**check,
                                        "time_us": timer(pass_fn(m, pass_, x, dy)) * 1e3}
        except Exception as exc:
            for entry in entries.values():
                entry["impls"].setdefault(impl, error_record(exc))
        m = None
        gc.collect()
        torch.cuda.empty_cache()
    return {pass_: finish_entry(entry) for pass_, entry in entries.items()}


def _made(make, module: str, hidden: int, target):
    """make(module, hidden), called as m(x): a loss module with its target bound."""
    m = make(module, hidden)
    return m if target is None else _targeted(m, target)


def _skipped(impl: str, module: str, args) -> str | None:
    """Why `impl` is not measured, or None."""
    if impl == "compile" and args.no_compile:
        return "--no-compile"
    if impl == "liger" and module in ("log_softmax", "softmax_dim0"):
        return f"Liger-Kernel has no {module} module"
    if impl == "liger":
        try:
            import liger_kernel  # noqa: F401
        except Exception as exc:
            return f"liger_kernel does not import ({type(exc).__name__}: {exc})"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/modules.py needs a CUDA GPU", file=sys.stderr)
        return 2
    timer_desc, timer = make_timer(args.timer)
    env = environment()
    try:
        from importlib.metadata import version

        env["liger_kernel"] = version("liger-kernel")
    except Exception as exc:
        env["liger_kernel"] = f"unavailable ({type(exc).__name__})"
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = "PYTHONPATH=. python3 bench/modules.py " + shlex.join(sys.argv[1:] if argv is None
                                                                     else argv)
    for module in args.module:
        reports = {p: {"fusion": f"module-{module}-{p}", "command": command, "date": date,
                       **env, "dtype": args.dtype, "rows": args.rows, "timer": timer_desc,
                       "pass": p, "results": []} for p in passes(module)}
        for hidden in args.hidden:
            for pass_, entry in bench_size(module, hidden, args, timer).items():
                reports[pass_]["results"].append(entry)
                write_report(reports[pass_], args.out)
        for report in reports.values():
            from bench.plot import plot_report

            _, png = output_paths(args.out, date, report["fusion"])
            plot_report(report, png)
            print(markdown_table(report), "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
