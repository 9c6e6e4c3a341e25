"""Reductions spread along hidden (fuser.spread, a pass of lowering; issue 15): a mean of x
under a mask m [batch, seq, 1] (or m [batch, seq] with its count kept as [batch, 1]),
sum(x * m, [1]) / sum(m, [1]), ran as three segments, since sum(m, [1]) alone is a value
per sample reduced from per-row values. Lowering computes it along hidden beside
sum(x * m, [1]), so the fusion is one column kernel. Offline: what is
spread and what is not, the lowered fusion against the user's on the float64 oracle, the one
kernel on every preset; on the GPU (-m gpu): streamed, kept rows and the hinted row kernel
against the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from fuser import DataType, FusionDefinition, explain
from fuser.analysis import Kind, analyze
from fuser.device import PRESETS
from fuser.explain import SegmentedExplanation
from fuser.lowering import lower
from fuser.reference import evaluate
from fuser.schedulers import Hints

BF16, F16, F = DataType.BFloat16, DataType.Half, DataType.Float


def masked_mean(dtype: DataType = BF16, rank: int = 3, centered: bool = False,
                keepdim: bool = False) -> FusionDefinition:
    """The mean over the sequence of x [batch, seq, hidden] (rank 2: over the rows of
    [rows, hidden]) under a Bool mask m [..., 1] of one value per row, in float, cast back to
    x's dtype; `centered`: x minus that mean instead (a normalization by it)."""
    axis = rank - 2
    with FusionDefinition(f"masked_mean_{rank}d{'_centered' if centered else ''}") as fd:
        x = fd.define_tensor([-1] * rank, dtype=dtype)
        m = fd.define_tensor([-1] * (rank - 1) + [1], dtype=DataType.Bool)
        xf, mf = fd.ops.cast(x, F), fd.ops.cast(m, F)
        keep = keepdim or centered
        mean = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, mf), [axis], keepdim=keep),
                          fd.ops.sum(mf, [axis], keepdim=keep))
        fd.add_output(fd.ops.cast(fd.ops.sub(xf, mean) if centered else mean, dtype))
    return fd


def masked_mean_of_rows_mask(dtype: DataType = BF16) -> FusionDefinition:
    """The same mean with the mask as torch code writes it, m [batch, seq]:
    (x * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True)."""
    with FusionDefinition("masked_mean_rows_mask") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=dtype)
        m = fd.ops.cast(fd.define_tensor([-1, -1], dtype=DataType.Bool), F)
        wide = fd.ops.broadcast_in_dim(m, shape=x.shape(), broadcast_dims=[0, 1])
        mean = fd.ops.div(fd.ops.sum(fd.ops.mul(fd.ops.cast(x, F), wide), [1]),
                          fd.ops.sum(m, [1], keepdim=True))
        fd.add_output(fd.ops.cast(mean, dtype))
    return fd


def host_inputs(shape, dtype: DataType, seed: int = 0, column: bool = True) -> list:
    """x standard normal in `dtype`; a mask holding most rows and each group's first, of
    shape [..., 1] (`column`) or x's without hidden."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    m = rng.random(shape[:-1]) < 0.7
    m[..., 0] = True
    return [x, m[..., None] if column else m]


def _spread_sums(fd: FusionDefinition) -> list:
    """The lowered fusion's reductions whose operand is a broadcast (a spread reduction)."""
    lowered = lower(fd.fusion)
    return [e for e in lowered.exprs if e.op == "sum"
            and e.inputs[0].definition is not None
            and e.inputs[0].definition.op == "broadcast_in_dim"]


@pytest.mark.parametrize(("rank", "centered", "keepdim"),
                         [(3, False, False), (3, False, True), (2, False, False),
                          (3, True, False), (2, True, False)])
def test_a_masked_mean_is_one_column_kernel(rank, centered, keepdim):
    fd = masked_mean(rank=rank, centered=centered, keepdim=keepdim)
    assert len(_spread_sums(fd)) == 1
    info = analyze(fd.fusion)
    assert info.kind is (Kind.OUTER_NORM if centered else Kind.OUTER)
    assert len(info.outer_reductions) == 2
    shape = (8, 1024, 4096) if rank == 3 else (4096, 1024)
    report = explain(fd, [shape, (*shape[:-1], 1)], device="h100")
    assert not isinstance(report, SegmentedExplanation)
    assert report.spread == ("T6 = sum(T3) beside T5 = sum(T4)",)  # as the user named them
    assert "spread along hidden" in str(report)


def test_a_mask_of_the_rows_with_its_count_kept_is_one_column_kernel():
    fd = masked_mean_of_rows_mask()
    assert len(_spread_sums(fd)) == 1
    assert analyze(fd.fusion).kind is Kind.OUTER
    report = explain(fd, [(8, 1024, 4096), (8, 1024)], device="h100")
    assert not isinstance(report, SegmentedExplanation)


@pytest.mark.parametrize(("rank", "centered"), [(3, False), (2, False), (3, True), (0, False)])
def test_the_lowered_fusion_computes_the_users_values(rank, centered):
    """The float64 oracle on the lowered fusion (the spread sum) and on the user's (rank 0:
    the mask of the rows, masked_mean_of_rows_mask)."""
    fd = masked_mean(F, rank, centered) if rank else masked_mean_of_rows_mask(F)
    host = host_inputs((30, 40) if rank == 2 else (3, 7, 40), F, column=bool(rank))
    got, want = evaluate(lower(fd.fusion), host), evaluate(fd.fusion, host)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_a_reduction_that_is_an_output_is_not_spread():
    """The mask's count written out: spread, it would be [batch, hidden], not [batch, 1]."""
    with FusionDefinition("mean_and_count") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        m = fd.define_tensor([-1, -1, 1], dtype=F)
        count = fd.ops.sum(m, [1])
        fd.add_output(fd.ops.div(fd.ops.sum(fd.ops.mul(x, m), [1]), count))
        fd.add_output(count)
    assert not _spread_sums(fd)


TAILS = {
    "relu": lambda fd, c: fd.ops.relu(c),
    "squared_and_summed": lambda fd, c: fd.ops.sum(fd.ops.mul(c, c), [1]),
    "relu_squeezed": lambda fd, c: fd.ops.squeeze(fd.ops.relu(c), [1]),
    "doubled": lambda fd, c: fd.ops.mul(c, 2.0),
}


@pytest.mark.parametrize("tail", list(TAILS))
def test_a_count_that_reaches_an_output_through_other_ops_is_not_spread(tail):
    """The count also used where nothing beside it has hidden (relu(c), c * c, c * 2.0):
    spread, that use's result would be [batch, hidden] and carry it on to an output. Found
    by review: relu(c) came out [3, 40] where the user's is [3, 1], sum(c * c, [1]) 40
    times too large."""
    with FusionDefinition(f"count_{tail}") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        m = fd.define_tensor([-1, -1, 1], dtype=F)
        count = fd.ops.sum(m, [1])
        fd.add_output(fd.ops.div(fd.ops.sum(fd.ops.mul(x, m), [1]), count))
        fd.add_output(TAILS[tail](fd, count))
    assert not _spread_sums(fd)
    host = host_inputs((3, 7, 40), F)
    host[1] = host[1].astype(np.float32)
    for got, want in zip(evaluate(lower(fd.fusion), host), evaluate(fd.fusion, host),
                         strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12)
    explain(fd, [(8, 1024, 4096), (8, 1024, 1)], device="h100")


def test_a_reduction_beside_no_reduction_over_its_axes_is_not_spread():
    """sum(m, [1]) times a [batch, hidden] input: nothing beside it reduces the sequence, so
    spreading it would not make the fusion a kernel of the others' kind."""
    with FusionDefinition("count_times_columns") as fd:
        m = fd.define_tensor([-1, -1, 1], dtype=F)
        w = fd.define_tensor([-1, -1], dtype=F)
        fd.add_output(fd.ops.mul(w, fd.ops.sum(m, [1])))
    assert not _spread_sums(fd)


def test_a_reduction_used_by_another_reduction_is_not_spread():
    """The count summed over the batch beside the mean: spread, that sum would add every
    column; only elementwise uses are followed."""
    with FusionDefinition("count_reduced") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        m = fd.define_tensor([-1, -1, 1], dtype=F)
        count = fd.ops.sum(m, [1])
        fd.add_output(fd.ops.div(fd.ops.sum(fd.ops.mul(x, m), [1]), count))
        fd.add_output(fd.ops.sum(count, [0]))
    assert not _spread_sums(fd)


def test_a_reduction_over_the_last_axis_is_not_spread():
    """sum(c, [1]) of a column input c [1, hidden] beside row sums: spread along the rows,
    each row would hold a copy of the columns; it stays a segment of its own, as before."""
    with FusionDefinition("colsum_ratio") as fd:
        x = fd.define_tensor([-1, -1], dtype=F)
        c = fd.define_tensor([1, -1], dtype=F)
        fd.add_output(fd.ops.div(fd.ops.sum(x, [1]), fd.ops.sum(c, [1])))
    assert not _spread_sums(fd)
    assert isinstance(explain(fd, [(4096, 1024), (1, 1024)], device="h100"),
                      SegmentedExplanation)


@pytest.mark.parametrize("device", sorted(PRESETS))
@pytest.mark.parametrize("centered", [False, True])
def test_masked_means_compile_without_spills_on_every_preset(device, centered):
    shape = (8, 1024, 4096) if not centered else (8, 512, 4096)
    report = explain(masked_mean(centered=centered), [shape, (*shape[:-1], 1)], device=device)
    assert not isinstance(report, SegmentedExplanation)
    assert all(r.spill_stores == 0 for r in report.resources.values())


GPU_SHAPES = [(3, 7, 1000), (8, 1024, 4096), (2, 5, 24578), (3000, 8, 24), (1, 4096, 513)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("hints", [None, Hints(fused_finalize=False)],
                         ids=["column_kernel", "row_kernel"])
def test_gpu_a_masked_mean_matches_the_oracle(hints, shape, dtype):
    _validated(masked_mean(dtype), host_inputs(shape, dtype), hints)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_a_mean_under_a_mask_of_the_rows_matches_the_oracle(shape, dtype):
    fd = masked_mean_of_rows_mask(dtype)
    _validated(fd, host_inputs(shape, dtype, column=False), None)
    assert not hasattr(fd.last_schedule(), "segments")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F], ids=lambda d: d.name)
@pytest.mark.parametrize(("rank", "shape"), [(2, (1000, 1000)), (2, (16384, 1024)),
                                             (3, (3, 7, 1000)), (3, (4, 512, 4096))], ids=str)
@pytest.mark.parametrize("centered", [False, True])
def test_gpu_masked_means_and_centering_match_the_oracle(centered, rank, shape, dtype):
    fd = masked_mean(dtype, rank, centered)
    _validated(fd, host_inputs(shape, dtype), None)
    assert not hasattr(fd.last_schedule(), "segments")


def _validated(fd: FusionDefinition, host: list, hints: Hints | None) -> None:
    """fd on the GPU against the float64 oracle, through execute() with `hints` (which
    fd.validate does not take)."""
    import cupy

    from fuser.executor import execute, to_host
    from fuser.reference import compare, input_sensitivity, output_reduction_sizes

    if hints is None:
        fd.validate([cupy.asarray(a) for a in host])
        return
    outs = execute(fd, [cupy.asarray(a) for a in host], hints=hints)
    refs = evaluate(fd.fusion, host)
    compare([to_host(o) for o in outs], refs, fd.fusion, output_reduction_sizes(fd.fusion, host),
            input_sensitivity(fd.fusion, host, refs))
