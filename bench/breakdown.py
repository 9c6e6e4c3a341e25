"""Device time of each CUDA kernel a call launches, from the CUDA profiler (torch.profiler).

bench/run.py --breakdown records it per implementation: fuser's row and finalize kernels,
torch.compile's generated kernels. Set beside the median time of the whole call, it says where
the time goes: a kernel below the copy's bandwidth, a finalize that costs more than it should,
or gaps between kernels (the call's time minus the sum of its kernels: host-bound launches).
The profiler sees every kernel of the process (CUPTI), also those CuPy launches.
"""

from __future__ import annotations

from collections import defaultdict

BREAKDOWN_CALLS = 20  # calls profiled; the times are per call


def kernel_times(events, calls: int) -> dict[str, float]:
    """Microseconds per call of each kernel name among profiler `events`, largest first.

    An event counts when it ran on a CUDA device (device_type name "CUDA"); its time is its
    time_range's elapsed_us(). Names keep their first 120 characters."""
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if getattr(getattr(e, "device_type", None), "name", None) != "CUDA":
            continue
        totals[str(e.name)[:120]] += e.time_range.elapsed_us()
    per_call = {name: round(us / calls, 2) for name, us in totals.items()}
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1]))


def profile_kernels(fn, sync, calls: int = BREAKDOWN_CALLS) -> dict[str, float]:
    """Run fn() `calls` times under the CUDA profiler (after one warm call); kernel_times()."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    return kernel_times(prof.events(), calls)
