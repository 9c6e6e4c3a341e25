"""Reductions over axes that are not a run (lower(split=True)): BatchNorm's [0, 2, 3]
of NCHW, a max over the first and last axes. Each is split into one over the last run of its
axes (a row kernel over the others, its partials kept as size-1 axes), then one of those
partials over the rest (column sums): the input read in place, where moving the kept axes
aside copied it before and after a kernel. The segmentation tries the split form first.

CPU: which reductions split and how (recursively, narrow partials in Float), the split
fusion on the float64 oracle equal to the fusion, the column sums of the partials a segment
of their own (segment._over_row_values), a size of a leading axis read as a scalar, and the
segmentations of such fusions: no copy, each kernel compiled without spills.
GPU (`gpu` marker): fd.validate() against the oracle at odd and large shapes."""

from __future__ import annotations

import numpy as np
import pytest
from test_layout import (
    assert_chained_matches_the_oracle,
    assert_each_segment_compiles_without_spills,
)

from bench import nd
from fuser import DataType, FusionDefinition, UnsupportedFusionError
from fuser.analysis import Kind, analyze
from fuser.lowering import lower, splits
from fuser.reference import evaluate
from fuser.segment import SegmentSchedules, segment

F, BF16 = DataType.Float, DataType.BFloat16


def _reduced(rank: int, op: str, dims, keepdim: bool, dtype=F, sizes=None) -> FusionDefinition:
    with FusionDefinition(f"{op}_{''.join(map(str, dims))}") as fd:
        x = fd.define_tensor(sizes or [-1] * rank, dtype=dtype)
        fd.add_output(getattr(fd.ops, op)(x, dims, keepdim=keepdim))
    return fd


def _reductions(f) -> list[tuple[tuple[int, ...], bool, DataType]]:
    return [(tuple(e.attr("dims")), e.attr("keepdim"), e.outputs[0].dtype)
            for e in f.exprs if e.op in ("sum", "max", "min")]


@pytest.mark.parametrize(("rank", "dims"), [
    (2, [1]), (2, [0]), (2, [0, 1]), (3, [1, 2]), (3, [0, 1]), (3, [1]), (4, [0, 1, 2, 3]),
])
def test_a_run_of_axes_is_not_split(rank, dims):
    """One run (a row, a column, a middle axis, every axis): nothing to split."""
    fd = _reduced(rank, "sum", dims, False)
    assert not splits(fd.fusion)
    assert _reductions(lower(fd.fusion, split=True)) == _reductions(lower(fd.fusion))


def test_axes_of_size_one_between_reduced_ones_leave_them_a_run():
    """[A, 1, C] over axes 0 and 2: the axes not of size 1 reduced are one run."""
    fd = _reduced(3, "sum", [0, 2], False, sizes=[-1, 1, -1])
    assert not splits(fd.fusion)


@pytest.mark.parametrize(("rank", "dims", "steps"), [
    (4, [0, 2, 3], [((2, 3), True), ((0,), True)]),
    (3, [0, 2], [((2,), True), ((0,), True)]),
    (4, [1, 3], [((3,), True), ((1,), True)]),
    (5, [0, 2, 4], [((4,), True), ((2,), True), ((0,), True)]),
])
def test_the_last_run_first_then_the_rest(rank, dims, steps):
    """The last run of the reduced axes first, kept as size 1, then the rest (recursively):
    each step a reduction over one run; the result squeezed unless keepdim."""
    fd = _reduced(rank, "sum", dims, False)
    assert splits(fd.fusion)
    split = lower(fd.fusion, split=True)
    assert [(d, k) for d, k, _ in _reductions(split)] == steps
    (out,) = split.outputs
    assert out.definition.op == "squeeze" and out.ndim == rank - len(dims)


def test_narrow_partials_are_float():
    """A BFloat16 max's partials are Float, as a kernel holds them; its result BFloat16."""
    split = lower(_reduced(4, "max", [0, 2, 3], True, dtype=BF16).fusion, split=True)
    assert [dtype for _, _, dtype in _reductions(split)] == [F, BF16]


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize(("shape", "dims"), [
    ((3, 5, 4, 6), [0, 2, 3]), ((3, 7, 5), [0, 2]), ((2, 3, 4, 5), [1, 3]),
    ((2, 3, 2, 3, 4), [0, 2, 4]),
])
def test_the_split_fusion_equals_the_fusion_on_the_oracle(op, keepdim, shape, dims):
    fd = _reduced(len(shape), op, dims, keepdim)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    (want,) = evaluate(fd.fusion, [x])
    (got,) = evaluate(lower(fd.fusion, split=True), [x])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _var_mean(shape, dims, correction: int, keepdim: bool, dtype=F) -> FusionDefinition:
    with FusionDefinition("var_mean") as fd:
        x = fd.define_tensor([-1] * len(shape), dtype=dtype)
        var, mean = fd.ops.var_mean(x, dims, correction=correction, keepdim=keepdim)
        fd.add_output(var)
        fd.add_output(mean)
    return fd


def test_a_split_variance_reads_its_input_once():
    """var_mean over [0, 2, 3]: one sweep gives each row's sum and its squared deviations
    about its own mean (two reductions along [2, 3]); the rest are reductions over axis 0 of
    those partials (Chan's combination), none of the input again."""
    split = lower(_var_mean((3, 5, 4, 6), [0, 2, 3], 0, False).fusion, split=True)
    x = split.inputs[0]
    over_x = [e for e in split.exprs if e.op == "sum" and set(e.inputs[0].dims) == set(x.dims)]
    assert [tuple(e.attr("dims")) for e in over_x] == [(2, 3), (2, 3)]
    assert sorted(d for d, _, _ in _reductions(split)) == [(0,), (0,), (2, 3), (2, 3)]


@pytest.mark.parametrize(("shape", "dims"), [
    ((3, 5, 4, 6), [0, 2, 3]), ((3, 7, 5), [0, 2]), ((2, 3, 4, 5), [1, 3]),
    ((2, 3, 2, 3, 4), [0, 2, 4]), ((1, 5, 1, 3), [0, 2, 3]),
])
@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_a_split_variance_equals_the_two_pass_one_on_the_oracle(shape, dims, correction,
                                                                 keepdim):
    """Chan's combination against the exact two passes, in float64, on data far from zero
    (a mean of 1000 and a spread of 1: where sum(x^2) / n - mean^2 would lose it all)."""
    fd = _var_mean(shape, dims, correction, keepdim)
    x = (1000 + np.random.default_rng(9).standard_normal(shape)).astype(np.float32)
    want = evaluate(fd.fusion, [x])
    got = evaluate(lower(fd.fusion, split=True), [x])
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)


def _segmentation(fd: FusionDefinition):
    with pytest.raises(UnsupportedFusionError) as refused:
        analyze(fd.fusion)
    return segment(fd.fusion, fd.name, refused.value)


def test_the_column_sums_of_partials_are_a_segment_of_their_own():
    """sum over [0, 2] of [A, B, C]: rows [A, B] along C, then the column sums over A of
    those [A, B, 1] partials, which need every row's partial first: two segments, the
    second finishing the sum (and its squeeze) where one row kernel could not."""
    segmentation = _segmentation(_reduced(3, "sum", [0, 2], False))
    assert len(segmentation.segments) == 2 and not segmentation.layouts
    first, second = (analyze(s.definition.fusion) for s in segmentation.segments)
    assert (first.kind, second.kind) == (Kind.INNER, Kind.OUTER)


@pytest.mark.parametrize(("name", "kernels"), [
    ("batchnorm_nchw", 4), ("batchnorm_nchw_backward", 3), ("group_norm_affine", 2),
])
def test_normalizations_over_nchw_read_their_inputs_in_place(name, kernels):
    """bench/nd.py's BatchNorm forward (a sweep of x for each row's sum and squared
    deviations, their column sums for the mean, then Chan's combination for the variance,
    then the normalization; the count a scalar of the call) and backward (both sums in one
    sweep, their column sums, grad_input): no permute, no expand, only views; every kernel
    compiles without spills."""
    fd = nd.definition(name, BF16)
    segmentation = _segmentation(fd)
    assert len(segmentation.segments) == kernels
    assert not [m for m in nd.moves(fd) if "copy" in m], nd.moves(fd)
    shapes = {"batchnorm_nchw": [(3, 64, 5, 7), (64,), (64,)],
              "batchnorm_nchw_backward": [(3, 64, 5, 7)] * 2 + [(64,)] * 3,
              "group_norm_affine": [(3, 64, 5, 7), (64,), (64,)]}[name]
    inputs = nd.host_inputs(name, F, shapes)
    fd32 = nd.definition(name, F)
    _segmentation(fd32)
    assert_chained_matches_the_oracle(fd32, inputs, atol=1e-5)
    assert_each_segment_compiles_without_spills(segmentation.segments)


# ----- GPU -----

GPU_SHAPES = {
    "batchnorm_nchw": [[(1, 1, 1, 1), (1,), (1,)], [(3, 5, 7, 9), (5,), (5,)],
                       [(256, 512, 7, 7), (512,), (512,)], [(7, 3, 1, 4099), (3,), (3,)]],
    "batchnorm_nchw_backward": [[(3, 5, 7, 9)] * 2 + [(5,)] * 3,
                                [(256, 512, 7, 7)] * 2 + [(512,)] * 3,
                                [(32, 64, 56, 56)] * 2 + [(64,)] * 3],
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, BF16, DataType.Half], ids=lambda d: d.name)
@pytest.mark.parametrize(("name", "shapes"),
                         [(n, s) for n, cases in GPU_SHAPES.items() for s in cases], ids=str)
def test_split_fusions_match_the_oracle_on_the_gpu(name, shapes, dtype):
    import cupy

    fd = nd.definition(name, dtype)
    fd.validate([cupy.asarray(a) for a in nd.host_inputs(name, dtype, shapes)])
    assert isinstance(fd.last_schedule(), SegmentSchedules)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.gpu
def test_a_split_reduction_matches_the_oracle_on_the_gpu(op):
    import cupy

    for shape, dims in [((3, 1000, 7), [0, 2]), ((16, 64, 4099), [0, 2]), ((2, 3, 4, 5), [1, 3])]:
        fd = _reduced(len(shape), op, dims, False, dtype=BF16)
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        fd.validate([cupy.asarray(x.astype(BF16.numpy))])
