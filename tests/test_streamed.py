"""The streamed column kernel: an outer reduction with column outputs only (column sums,
means and extremes, a mean over the sequence per sample) read once by the outer-persistent
kernel, no rows kept and no finalize kernel (OuterSchedule.streamed). Offline: which
fusions stream, the plan and source they get, and where the row kernel keeps them (full
outputs beside the sums, hints, slabs too few to fill the SMs, a column kernel that
spills). Marked gpu: against the float64 oracle at odd
shapes, with groups, and the same bits from run to run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fuser import DataType, FusionDefinition, HintError
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.explain import explain
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints, Problem, outer_persistent
from fuser.schedulers.base import OuterSchedule, RowSchedule, ceil_div, problem_rows
from fuser.schedulers.outer_persistent import STREAMED_MIN_ROWS, STREAMED_SEGMENT, STREAMED_WAVE

BF16, F, HALF = DataType.BFloat16, DataType.Float, DataType.Half


def column_reduction(op: str, dtype: DataType, rank: int = 2) -> FusionDefinition:
    """`op` (sum, mean, max, min) of x over its last row axis, in float, stored as x's type;
    rank 3 reduces the sequence of [batch, seq, hidden] per sample (a group each)."""
    with FusionDefinition(f"column_{op}") as fd:
        x = fd.define_tensor([-1] * rank, dtype=dtype)
        xf = fd.ops.cast(x, F)
        axis = rank - 2
        if op == "mean":
            r = fd.ops.div(fd.ops.sum(xf, [axis]), fd.ops.size(x, axis))
        else:
            r = getattr(fd.ops, op)(xf, [axis])
        fd.add_output(fd.ops.cast(r, dtype))
    return fd


def _explained(fd, shapes, hints=None):
    return explain(fd, shapes, device="h100", hints=hints)


@pytest.mark.parametrize(("shape", "cluster", "slab"),
                         [((16384, 4096), 2, 64), ((8, 1024, 4096), 1, 64),
                          ((4096, 24578), 1, 64), ((1000, 1000), 8, 64)], ids=str)
def test_column_sums_stream_through_one_kernel(shape, cluster, slab):
    e = _explained(column_reduction("sum", BF16, len(shape)), [shape])
    s = e.schedule
    assert isinstance(s, OuterSchedule) and s.streamed and e.finalize is None
    assert (s.cluster, s.slab) == (cluster, slab)
    assert not [b for b in s.smem.buffers if b.name.startswith("s_T")]  # no rows kept
    assert all(r.spill_stores == 0 for r in e.resources.values())
    source = e.source
    assert "slab.read(g_T0, r)" in source and "slab.fill" not in source


def test_a_bias_gradient_keeps_the_row_kernel_that_writes_its_elements_as_it_sums():
    e = _explained(FUSIONS["gelu_bwd"](BF16), [(16384, 4096), (4096,), (16384, 4096)])
    assert isinstance(e.schedule, RowSchedule) and e.finalize is not None
    assert "; not streamed: full outputs (T" in e.schedule.reason


def test_a_hint_asks_for_the_row_kernel_and_its_finalize():
    fd = column_reduction("sum", BF16)
    e = _explained(fd, [(16384, 4096)], Hints(rows_per_block=4))
    assert isinstance(e.schedule, RowSchedule) and e.finalize is not None
    assert "not streamed" not in e.schedule.reason  # the hint's choice, not a refusal
    with pytest.raises(HintError, match="takes no hints"):
        info = analyze(fd.fusion)
        next(outer_persistent.candidates(info, Problem(4096, 1024, 16), DeviceSpec.get("h100"),
                                          Hints(cluster=2)))


def test_groups_of_few_rows_keep_the_row_kernel():
    """[4096, 8, 4096]: 8 rows a group, fewer than a streamed block reads at least."""
    fd = column_reduction("sum", BF16, 3)
    e = _explained(fd, [(4096, 8, 4096)])
    assert isinstance(e.schedule, RowSchedule) and e.problem.rows == 8  # a group's rows
    info = analyze(fd.fusion)
    reason = outer_persistent.can_schedule(info, Problem(4096, problem_rows(info, 8, 4096), 16),
                                           DeviceSpec.get("h100"))
    assert reason is not None and "fewer than the 64 a streamed block reads" in reason


@pytest.mark.parametrize(("shape", "groups"),
                         [((64, 4096, 512), 64), ((256, 256, 1024), 256),
                          ((100, 2048, 1024), 64)], ids=str)
def test_groups_fill_the_sms_that_one_group_s_slabs_would_not(shape, groups):
    """8 or 16 slabs of one group keep few SMs busy, so one group alone takes the row kernel
    or a cluster per slab (groups of these shapes ran 0.83 to 0.87 of the copy on the row
    kernel, 0.86 to 0.93 streamed, on an H100): every group's slabs together fill the SMs,
    one block each. 100 groups count as 64, the power of two below."""
    fd = column_reduction("sum", BF16, 3)
    e = _explained(fd, [shape])
    s = e.schedule
    assert isinstance(s, OuterSchedule) and s.streamed and s.cluster == 1
    assert e.problem.groups == groups
    assert f"in each of {groups} or more groups" in s.reason
    alone = _explained(fd, [(1, *shape[1:])]).schedule  # one such group
    assert isinstance(alone, RowSchedule) or alone.cluster > 1


@pytest.mark.parametrize(("shape", "dtype", "segment", "slab"),
                         [((128, 64, 2048), BF16, 512, 256), ((128, 64, 2048), F, 512, 128),
                          ((32, 128, 4096), BF16, 256, 128), ((256, 256, 1024), BF16, 128, 64),
                          ((8, 1024, 4096), BF16, 128, 64)], ids=str)
def test_groups_of_few_rows_stream_through_wider_slabs(shape, dtype, segment, slab):
    """A block of 64 rows in 128-byte slabs gives each of its 512 threads one row: wider
    slabs (up to 1024 bytes) give each four, while the groups' slabs fill the SMs."""
    e = _explained(column_reduction("sum", dtype, 3), [shape])
    s = e.schedule
    assert isinstance(s, OuterSchedule) and s.streamed and s.cluster == 1
    assert (s.slab, s.reason.split("-byte")[0]) == (slab, str(segment))
    assert ceil_div(s.rank_rows, s.row_lanes) >= 4  # rows a thread reads
    assert all(r.spill_stores == 0 for r in e.resources.values())


def test_fold_buffers_over_shared_memory_are_named_as_the_reason():
    info = analyze(_many_column_sums_only(48).fusion)
    reason = outer_persistent.can_schedule(info, Problem(4096, 1024, 16), DeviceSpec.get("h100"))
    assert reason is not None
    assert "fold buffers of 48 column reductions over a cluster of 2" in reason


def test_slabs_too_few_to_fill_the_sms_keep_the_row_kernel():
    """64 columns are one slab even 16 bytes of a row wide: 8 blocks a cluster would leave
    most SMs idle, where the row kernel spreads 2**20 rows over every SM."""
    e = _explained(column_reduction("sum", BF16), [(2**20, 64)])
    assert isinstance(e.schedule, RowSchedule)
    assert "; not streamed: 1 slab(s) of 64 columns" in e.schedule.reason  # show says why
    reason = outer_persistent.can_schedule(analyze(column_reduction("sum", BF16).fusion),
                                           Problem(64, 1024, 16), DeviceSpec.get("h100"))
    assert reason is not None and "132 SMs" in reason


# ----- GPU -----------------------------------------------------------------------------------


def _x(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, HALF, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 8), (3, 1000), (1001, 257), (16384, 4096), (4099, 24578),
                                   (5, 3, 4099), (8, 1024, 4096), (70000, 8, 24)], ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_gpu_column_reductions_match_the_oracle(op, shape, dtype):
    import cupy

    fd = column_reduction(op, dtype, len(shape))
    fd.validate([cupy.asarray(_x(shape, dtype, 3))])
    streams = shape[-1] >= 1000 and shape[-2] >= 1000  # slabs enough, and a group's rows
    assert (isinstance(fd.last_schedule(), OuterSchedule)
            and fd.last_schedule().streamed) is streams


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(128, 64, 2048), (32, 128, 4096), (1024, 64, 1000),
                                   (300, 70, 3000)], ids=str)
@pytest.mark.parametrize("op", ["mean", "max"])
def test_gpu_wider_slabs_of_groups_of_few_rows_match_the_oracle(op, shape, dtype):
    """Slabs of 256 and 512 bytes (STREAMED_WIDEST), at odd hidden sizes and group rows."""
    import cupy

    fd = column_reduction(op, dtype, len(shape))
    fd.validate([cupy.asarray(_x(shape, dtype, 5))])
    s = fd.last_schedule()
    assert isinstance(s, OuterSchedule) and s.streamed and s.slab * dtype.itemsize > 128


@pytest.mark.gpu
def test_gpu_the_same_bits_from_run_to_run():
    """Each block sums its rows of a column in order, the cluster folds its blocks in rank
    order: no atomics, the same bits every run."""
    import cupy

    from fuser.executor import to_host

    fd = column_reduction("sum", BF16)
    x = cupy.asarray(_x((65536, 4096), BF16, 4))
    first = to_host(fd.execute([x])[0])
    for _ in range(3):
        assert to_host(fd.execute([x])[0]).tobytes() == first.tobytes()


def _many_column_sums_only(count: int) -> FusionDefinition:
    """`count` column sums of x scaled or exponentiated, each an output: accumulators that
    outgrow a streamed thread's registers."""
    with FusionDefinition(f"sums_only{count}") as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        xf = fd.ops.cast(x, F)
        for k in range(count):
            p = fd.ops.mul(xf, float(k + 1)) if k % 2 else fd.ops.exp(fd.ops.mul(xf, 0.1 * k))
            fd.add_output(fd.ops.sum(p, [0]))
    return fd


def test_a_column_kernel_that_spills_hands_the_sums_to_the_row_kernel():
    e = _explained(_many_column_sums_only(32), [(4096, 4096)])
    assert isinstance(e.schedule, RowSchedule) and e.finalize is not None
    assert not any(r.spills for r in e.resources.values())


@pytest.mark.gpu
def test_gpu_sums_the_column_kernel_spills_on_match_the_oracle():
    import cupy

    fd = _many_column_sums_only(32)
    fd.validate([cupy.asarray((0.1 * _x((4096, 4096), F, 8)).astype(BF16.numpy))])
    assert isinstance(fd.last_schedule(), RowSchedule)


@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 1 << 20), hidden=st.integers(1, 70000),
       op=st.sampled_from(["sum", "mean", "max", "min"]),
       dtype=st.sampled_from([F, HALF, BF16, DataType.Double]),
       preset=st.sampled_from(["h100", "h200", "a100"]))
def test_random_column_reductions_stream_only_where_the_policy_says(rows, hidden, op, dtype,
                                                                    preset):
    """Where the column kernel takes an outer reduction, its clusters fill 90% of the SMs
    with 128-byte slabs, each block reading at least 64 rows of the call's (as problem_rows
    counts them), and it compiles without spills; elsewhere the row kernel runs, with its
    finalize."""
    e = explain(column_reduction(op, dtype), [(rows, hidden)], device=preset)
    s = e.schedule
    event(type(s).__name__)
    if isinstance(s, OuterSchedule):
        assert s.streamed and e.finalize is None
        assert s.slab * dtype.itemsize <= STREAMED_SEGMENT
        assert s.slabs * s.cluster >= STREAMED_WAVE * DeviceSpec.get(preset).sm_count
        assert s.rank_rows >= STREAMED_MIN_ROWS
    else:
        assert isinstance(s, RowSchedule) and e.finalize is not None
    assert not any(r.spills for r in e.resources.values())
