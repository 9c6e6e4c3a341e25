"""GPU: rows dealt to blocks at a fixed stride, from a counter, or a block per group, against
the float64 reference, over more row groups than the grid holds at once (so blocks take
groups from the counter); a counter is zero again after every call, and two streams running
one kernel at once each count on their own.
"""

from __future__ import annotations

import pytest
from test_gpu_fusions import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    on_streams,
    poisoned_outputs,
    run_and_validate,
)

import fuser.executor as executor
from fuser import DataType
from fuser.fusions import FUSIONS, make_inputs
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes
from fuser.schedulers import Hints
from fuser.schedulers.base import Dealing

pytestmark = pytest.mark.gpu

FORWARD = ("rmsnorm_fwd", "layernorm_fwd", "softmax_fwd", "dropout_rmsnorm_fwd",
           "dropout_layernorm_fwd")
BACKWARD = ("rmsnorm_bwd", "layernorm_bwd", "dropout_rmsnorm_bwd", "softmax_bwd")
ROWS = {1000: 20011, 4096: 6007}  # several row groups per resident block


def variants(name: str, hidden: int) -> list[dict]:
    """Each dealing, a counter for pipelined rows, fixed strides over rows three stages deep,
    a counter for rows in one stage of shared memory (refilled by each row's last pass) and
    (where rows are many enough for the blocks of 128 threads the GPU holds) one for
    single-warp rows, whose reductions have no block barrier to publish the next group at."""
    dealings = ("strided", "dynamic") + (("grid",) if name in FORWARD else ())
    return ([{"dealing": d} for d in dealings]
            + [{"dealing": "dynamic", "stages": 2}, {"dealing": "strided", "stages": 3}]
            + ([{"dealing": "dynamic", "threads_per_row": 32, "rows_per_block": 4}]
               if hidden == 1000 else [REFILLED]))


REFILLED = {"dealing": "dynamic", "stages": 1, "storage": (("T0", "smem"),)}


CASES = [(name, hidden, kw) for name in FORWARD + BACKWARD for hidden in ROWS
         for kw in variants(name, hidden)]


def validated(name: str, rows: int, hidden: int, hints: Hints, rng):
    """The kernel that ran `name` with `hints` on fresh inputs, its outputs checked against
    the float64 reference (test_gpu_fusions.run_and_validate)."""
    return run_and_validate(name, DataType.BFloat16, hidden, rows, rng, hints)._last_run.kernel


@pytest.mark.parametrize(("name", "hidden", "kw"), CASES,
                         ids=[f"{n}-{h}-{Hints(**kw).words()}" for n, h, kw in CASES])
def test_dealt_rows_match_the_reference(name, hidden, kw, rng):
    hints = Hints(**kw)
    kernel = validated(name, ROWS[hidden], hidden, hints, rng)
    s = kernel.schedule
    assert s.dealing is hints.dealing
    refilled = "refill(" in kernel.source.source
    assert refilled or kw is not REFILLED, "the refilled variant's rows were not refilled"
    assert not refilled or s.dealing is Dealing.DYNAMIC, s
    if s.dealing is Dealing.DYNAMIC:
        assert kernel.resident_groups * s.rows_per_block < ROWS[hidden] // 2, (
            "too few rows: every group went to a block of the first wave")


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_bwd"])
def test_a_counter_is_zero_again_after_each_call(name, rng):
    """Calls with different row counts (fewer rows than the grid holds among them, and so
    another kernel: the counter is the stream's, not the kernel's), one after another: each
    finds its counter zeroed by the last block of the call before, and every counter handed
    out reads zero once the device is idle."""
    import cupy

    from fuser.tickets import COUNTER_BYTES, counters

    hints = Hints(dealing="dynamic")
    for rows in (6007, 20011, 7, 3001):
        validated(name, rows, 4096, hints, rng)
    device = cupy.cuda.Device()
    device.synchronize()
    given = list(counters(device.id)._given.values())
    assert given
    for address in given:
        memory = cupy.cuda.UnownedMemory(address, COUNTER_BYTES, None)
        words = cupy.ndarray((COUNTER_BYTES // 8,), cupy.uint64, cupy.cuda.MemoryPointer(memory, 0))
        assert not cupy.asnumpy(words).any(), f"counter at {address:#x}: {cupy.asnumpy(words)}"


def test_two_streams_running_one_kernel_count_on_their_own(rng):
    """The same kernel queued on two streams without a sync between: the launches may run at
    once, and with a shared counter they would take each other's groups."""
    fd = FUSIONS["rmsnorm_fwd"](DataType.BFloat16)
    hints = Hints(dealing="dynamic")
    hosts = [make_inputs("rmsnorm_fwd", 20011, 4096, DataType.BFloat16, rng) for _ in range(2)]
    streams, inputs = on_streams(hosts)
    outs: list = [None, None]
    for _ in range(3):
        for k, stream in enumerate(streams):
            with stream:
                outs[k] = executor.execute(fd, inputs[k], hints=hints)
    for stream in streams:
        stream.synchronize()
    for host, out in zip(hosts, outs, strict=True):
        refs = evaluate(fd.fusion, host)
        compare([executor.to_host(o) for o in out], refs, fd.fusion,
                output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))


# Defaults whose rows are too long to be short, staged in one stage and dealt a block per row
# group (row_dealt.py), in each dtype, in one block or over a cluster
DEALT_DEFAULTS = [
    ("rmsnorm_fwd", DataType.BFloat16, 16384), ("rmsnorm_fwd", DataType.Float, 12288),
    ("rmsnorm_fwd", DataType.Half, 24576),
    ("softmax_fwd", DataType.BFloat16, 16384), ("softmax_fwd", DataType.BFloat16, 32768),
    ("softmax_fwd", DataType.Float, 16384), ("softmax_fwd", DataType.Half, 20480),
    ("log_softmax_fwd", DataType.BFloat16, 24576), ("log_softmax_fwd", DataType.Float, 8192),
    ("dropout_rmsnorm_fwd", DataType.BFloat16, 12288),
    ("dropout_rmsnorm_fwd", DataType.Float, 8192),
    ("softmax_bwd", DataType.BFloat16, 16384), ("softmax_bwd", DataType.Float, 12288),
    # rows split over a cluster, a block per row group (row_dealt.dealt_clusters)
    ("softmax_fwd", DataType.BFloat16, 65536), ("softmax_fwd", DataType.Float, 32768),
    ("log_softmax_fwd", DataType.Half, 65536), ("softmax_bwd", DataType.BFloat16, 49152),
    ("softmax_bwd", DataType.Half, 32768),
    # a weight re-read from L2 beside the staged row, and up to 16 vectors a thread
    ("rmsnorm_fwd", DataType.BFloat16, 32768), ("rmsnorm_fwd", DataType.Float, 24576),
    ("dropout_rmsnorm_fwd", DataType.BFloat16, 20480), ("softmax_fwd", DataType.Half, 49152),
    ("log_softmax_fwd", DataType.BFloat16, 98304),
]


@pytest.mark.parametrize("rows", [3, 1000])
@pytest.mark.parametrize(("name", "dtype", "hidden"), DEALT_DEFAULTS,
                         ids=[f"{n}-{d.name}-{h}" for n, d, h in DEALT_DEFAULTS])
def test_long_rows_dealt_a_block_each_match_the_reference(name, dtype, hidden, rows, rng):
    """Fewer blocks than SMs (3 rows), and many more row groups than the resident blocks,
    which the hardware starts as others end (1000 rows)."""
    kernel = run_and_validate(name, dtype, hidden, rows, rng)._last_run.kernel
    s = kernel.schedule
    assert s.dealing is Dealing.GRID and s.stages == 1, s.reason
    assert "a block per row group" in s.reason and s.blocks_per_sm >= 2, s.reason
