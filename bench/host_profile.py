"""Host time of fd.execute: microseconds per call, and where they go (cProfile).

    PYTHONPATH=. python3 bench/host_profile.py [--fusion rmsnorm_bwd] [--hidden 1024]
        [--rows 16] [--kind torch|cupy] [--calls 2000] [--top 25]

A small problem keeps the GPU idle, so the loop measures what Python, CuPy and torch spend to
check, allocate and launch. At small hidden sizes the bench's fuser time is this cost, not
the kernel's (bench json: host_us against time_us).

--parts times the pieces of a cached call on their own, each in bursts of 64 with the device
synchronized (untimed) between bursts, medians: the plan key, the pointers, one output's
allocation, the partial rows, the stream's lookup, the driver's current-context query (and
its stream-capture query, for a call that counts on a counter or keeps its own workspace),
each kernel's launcher, and each kernel's bare cuLaunchKernelEx through ctypes with the
launcher's configuration and parameters (the floor no Python change lowers). The partial
rows are timed outside a capture: a workspace the stream keeps (calls.KeptWorkspace, and
CuPy's) is a lookup, a torch tensor's larger one an allocation.

--module rmsnorm|layernorm|softmax times what a model pays instead: fuser.torch's module
against torch.nn's, an inference (the forward under torch.no_grad), a forward (x requiring
grad) and a training step (the forward, then torch.autograd.grad of x and the parameters),
per step, with autograd's device threads (as a training loop runs) and without them
(torch.autograd.set_multithreading_enabled(False)), which separates the hand-over of the
backward to autograd's thread from the Python around the kernels; then cProfile of fuser's
step, threads off (the backward in this thread).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fusion", default="rmsnorm_bwd")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--kind", choices=("torch", "cupy"), default="torch",
                   help="array kind of the inputs (and outputs)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25, help="cProfile entries printed")
    p.add_argument("--parts", action="store_true",
                   help="also time the pieces of a cached call (bursts of 64, medians)")
    p.add_argument("--module", choices=("rmsnorm", "layernorm", "softmax"),
                   help="time fuser.torch's module against torch.nn's instead of fd.execute")
    args = p.parse_args(argv)
    if min(args.hidden, args.rows, args.calls, args.top) < 1:
        p.error("--hidden, --rows, --calls and --top must be positive")
    return args


def device_arrays(host: list, kind: str) -> list:
    """Host arrays of make_inputs on the GPU as torch tensors or CuPy arrays."""
    import numpy as np

    if kind == "cupy":
        import cupy

        return [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in host]
    import torch

    out = []
    for a in host:
        if not isinstance(a, np.ndarray):
            out.append(a)
        elif a.dtype.name == "bfloat16":
            out.append(torch.from_numpy(a.astype(np.float32)).cuda().bfloat16())
        else:
            out.append(torch.from_numpy(a).cuda())
    return out


def cached_call(fusion: str, hidden: int, rows: int, kind: str) -> tuple:
    """(fd, inputs) of a ready fusion on bf16 [rows, hidden] inputs of `kind`, called 50
    times (compile, plan, warm the allocators) so that the next call takes the cached path."""
    import cupy
    import numpy as np

    from fuser import DataType
    from fuser.fusions import FUSIONS, make_inputs

    fd = FUSIONS[fusion](DataType.BFloat16)
    host = make_inputs(fusion, rows, hidden, DataType.BFloat16, np.random.default_rng(0))
    inputs = device_arrays(host, kind)
    for _ in range(50):
        fd.execute(inputs)
    cupy.cuda.runtime.deviceSynchronize()
    return fd, inputs


def per_call_us(fd, inputs: list, calls: int, burst: int = 100, sync=None) -> float:
    """Microseconds per fd.execute: the median over bursts of `burst` calls (`calls` in all,
    after one burst to warm up), the device synchronized between bursts so that its queue
    never fills and the GPU stays idle. A median of bursts, not one loop's mean: the host's
    other work (a lent machine's CPUs are shared) once moved one loop's mean from 27 to
    50 us."""
    import statistics

    if sync is None:
        import cupy

        sync = cupy.cuda.runtime.deviceSynchronize
    samples = []
    for round_ in range(max(1, calls // burst) + 1):
        start = time.perf_counter()
        for _ in range(burst):
            fd.execute(inputs)
        elapsed = time.perf_counter() - start
        sync()
        if round_:
            samples.append(elapsed / burst * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    import cupy

    args = parse_args(argv)
    if args.module:
        module_report(args)
        return
    fd, inputs = cached_call(args.fusion, args.hidden, args.rows, args.kind)
    per_call = per_call_us(fd, inputs, args.calls)
    print(f"{args.fusion} [{args.rows} x {args.hidden}] bf16, {args.kind} inputs: "
          f"{per_call:.1f} us per fd.execute ({args.calls} calls)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        fd.execute(inputs)
    profiler.disable()
    cupy.cuda.runtime.deviceSynchronize()
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    if args.parts:
        for name, us in call_parts(fd, inputs).items():
            print(f"{name:32s} {us:7.2f} us")


def module_report(args: argparse.Namespace) -> None:
    """Host time per step of fuser.torch's module and torch.nn's (module docstring)."""
    import torch

    from bench.modules import fuser_module, pass_fn, torch_module

    x = torch.randn(args.rows, args.hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    steps = {}
    for impl, make in (("torch.nn", torch_module), ("fuser.torch", fuser_module)):
        m = make(args.module, args.hidden)
        if isinstance(m, torch.nn.Module):
            m = m.to(device="cuda", dtype=torch.bfloat16)
        for pass_ in ("forward", "train", "infer"):
            steps[impl, pass_] = pass_fn(m, pass_, x, dy)
    sync = torch.cuda.synchronize
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        for (impl, pass_), step in steps.items():
            for _ in range(50):
                step()
            sync()
            us = per_call_us(_Call(step), [], args.calls, sync=sync)
            print(f"{args.module} [{args.rows} x {args.hidden}] bf16 {impl:11s} {pass_:7s} "
                  f"autograd threads {'on ' if threads else 'off'}: {us:7.1f} us per step")
    profiler = cProfile.Profile()  # threads off: the backward runs in this thread, profiled
    step = steps["fuser.torch", "train"]
    profiler.enable()
    for _ in range(args.calls):
        step()
    profiler.disable()
    sync()
    torch.autograd.set_multithreading_enabled(True)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)


class _Call:
    """A step in the shape per_call_us times: execute(inputs) calls it."""

    def __init__(self, step):
        self.execute = lambda _inputs: step()


def call_parts(fd, inputs: list, burst: int = 64, bursts: int = 60) -> dict[str, float]:
    """Microseconds of each piece of a cached fd.execute (its plan the first one cached),
    timed on its own: `bursts` bursts of `burst` calls, the device synchronized between them."""
    import statistics

    import cupy

    from fuser import calls
    from fuser.driver import driver

    def timed(piece) -> float:
        for _ in range(burst):
            piece()
        cupy.cuda.runtime.deviceSynchronize()
        samples = []
        for _ in range(bursts):
            start = time.perf_counter()
            for _ in range(burst):
                piece()
            samples.append((time.perf_counter() - start) / burst * 1e6)
            cupy.cuda.runtime.deviceSynchronize()
        return statistics.median(samples)

    plan = next(iter(fd._plans.values()))
    like = inputs[plan.kernel.tensor_inputs[0]]
    stream = calls.stream_of(plan.torch_kind, plan.device_id)
    parts = {
        "fd.execute": timed(lambda: fd.execute(inputs)),
        "plan key (calls.signature)": timed(lambda: calls.signature(inputs)),
        "pointers": timed(lambda: calls.input_pointers(plan, inputs)),
        "one output (_arrays)": timed(
            lambda: calls._arrays(plan.array_outputs[:1], plan.torch_kind, like)),
    }
    if plan.partials:
        parts["partial rows (_partials)"] = timed(
            lambda: calls._partials(plan, calls._owner(stream), like, False))
    gpu = driver()
    parts["stream (calls._stream)"] = timed(
        lambda: calls.stream_of(plan.torch_kind, plan.device_id))
    parts["current context (driver)"] = timed(gpu.current_context)
    if plan.asks_capture:
        parts["stream capturing (driver)"] = timed(lambda: gpu.stream_capturing(stream))
    held = fd.execute(inputs)  # its outputs stay allocated while the launches rewrite them
    for launcher, size, _ in plan.launches:
        args = launcher._layout.unpack_from(launcher._buffer)  # that call's parameters
        parts[f"launcher {launcher.name}"] = timed(
            lambda launcher=launcher, size=size, args=args: launcher(
                size.grid, size.block, size.dynamic_smem, stream, args, size.groups))
        _, address = launcher._configs[(size.grid, size.block, size.dynamic_smem, size.groups)]
        parts[f"cuLaunchKernelEx {launcher.name}"] = timed(
            lambda launcher=launcher, address=address: gpu.launch_ex(
                address, launcher._function, launcher._params, None))
    del held
    return parts


if __name__ == "__main__":
    main()
