"""Fusions whose axes fit rows and a hidden axis in another order than their own (issue 15:
N-D tensors, "UnsupportedFusionError only for what no chain can run"): BatchNorm over NCHW,
a mean over the middle axis, InstanceNorm over the last two axes. fuser/reorder.py writes
each again in an order that fits; the segmentation moves the inputs into it and the outputs
back between kernels.

CPU: the order taken and the moves it costs (a view where only merged axes change, a copy
where axes move), the segments chained on the float64 oracle (moves made as the executor
makes them) equal to the whole fusion, every segment compiled without spills, explain()'s
report, and a fusion no order fits refused as before. GPU (`gpu` marker): fd.validate()
against the oracle at odd and large shapes, CuPy and torch arrays."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_layout import (
    _chained,
    assert_chained_matches_the_oracle,
    assert_each_segment_compiles_without_spills,
)

import fuser
from bench import nd
from fuser import DataType, FusionDefinition, UnsupportedFusionError
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.executor import segments_of
from fuser.lowering import lower
from fuser.reference import evaluate
from fuser.reorder import _axes, grouped_order, order_of, reordered
from fuser.segment import SegmentSchedules, _widened, segment

F, BF16 = DataType.Float, DataType.BFloat16
H200 = DeviceSpec.get("h200")


_bcast = nd.broadcast_like


def batchnorm_nchw(fd, dtype=BF16):
    """BatchNorm2d's training forward over NCHW: statistics per channel (the middle axis) over
    N, H and W, the normalization with a [C] weight and bias; y, the mean and 1 / std."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    w = fd.define_tensor([-1])
    b = fd.define_tensor([-1])
    xf = fd.ops.cast(x, F)
    var, mean = fd.ops.var_mean(xf, [0, 2, 3], correction=0, keepdim=False)
    invstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
    y = fd.ops.mul(fd.ops.sub(xf, _bcast(fd, mean, x, [1])), _bcast(fd, invstd, x, [1]))
    y = fd.ops.add(fd.ops.mul(y, _bcast(fd, w, x, [1])), _bcast(fd, b, x, [1]))
    fd.add_output(fd.ops.cast(y, dtype))
    fd.add_output(mean)
    fd.add_output(invstd)


# BatchNorm2d's backward over NCHW from the saved mean and 1 / std: the bench's fusion
batchnorm_nchw_backward = nd.batchnorm_nchw_backward


def instance_norm(fd, dtype=BF16):
    """InstanceNorm over NCHW: statistics per (n, c) over H and W, kept as [N, C, 1, 1]."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    var, mean = fd.ops.var_mean(xf, [2, 3], correction=0, keepdim=True)
    y = fd.ops.mul(fd.ops.sub(xf, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
    fd.add_output(fd.ops.cast(y, dtype))
    fd.add_output(mean)


def sum_over_batch(fd, dtype=BF16):
    """The sum of [batch, seq, hidden] over its first axis: [seq, hidden] column sums."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    fd.add_output(fd.ops.sum(fd.ops.cast(x, F), [0]))


def outer_axes_kept(fd, dtype=BF16):
    """A max over the first and last axes of [A, B, C], kept as [1, B, 1], subtracted from
    the input: the kept axis sits between the reduced ones."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    m = fd.ops.max(xf, [0, 2], keepdim=True)
    fd.add_output(fd.ops.cast(fd.ops.sub(xf, m), dtype))
    fd.add_output(m)


def centered_over_dim_0(fd, dtype=BF16):
    """[A, B, C] minus its means over the first axis: columns of B * C."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    mean = fd.ops.div(fd.ops.sum(xf, [0], keepdim=True), x.size(0))
    fd.add_output(fd.ops.cast(fd.ops.sub(xf, mean), dtype))


def softmax_over_a_middle_axis(fd, dtype=BF16):
    """[B, S, A, D] softmax over S: rows [B, S] and hidden [A * D] (views), a column kernel
    per group of S rows (reorder.grouped_order), where moving S last took two copies."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, [1], keepdim=True)))
    fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True)), dtype))


def masked_column_sums(fd, dtype=BF16):
    """Scores [batch, heads, q, k] where a [q, k] mask holds, summed over all but k: the
    column kernels of an outer reduction read no input repeated, so the mask is copied
    broadcast to the full shape."""
    s = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    m = fd.define_tensor([-1, -1], dtype=DataType.Bool)
    fd.add_output(fd.ops.sum(fd.ops.where(_bcast(fd, m, s, [2, 3]), fd.ops.cast(s, F), 0.0),
                             [0, 1, 2]))


def weight_with_a_gap(fd, dtype=BF16):
    """[B, S, T, H] times a [B, T, H] weight: its leading axes are not a run of the rows
    [B, S, T] (S lies between them), but they are of rows [B, S] along T * H, where a kernel
    reads the weight [B, T * H] repeated over S: views only, where it was copied broadcast."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    w = fd.define_tensor([-1, -1, -1])
    fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.cast(x, F), _bcast(fd, w, x, [0, 2, 3])), dtype))


# GroupNorm over channels of 8 at the small shapes here: 4 groups
group_norm_affine = functools.partial(nd.group_norm_affine, groups=4)

# builder -> (copies: permutes and expands, reshape views, segments, input shapes); the
# builders of bench/nd.py are the fusions users write that its bench times
CASES = {
    "batchnorm_nchw": (batchnorm_nchw, 2, 4, 1, [(3, 5, 4, 6), (5,), (5,)]),
    "batchnorm_nchw_backward": (batchnorm_nchw_backward, 3, 5, 1,
                                [(3, 5, 4, 6), (3, 5, 4, 6), (5,), (5,), (5,)]),
    "instance_norm": (instance_norm, 0, 3, 1, [(3, 5, 4, 6)]),
    "sum_over_batch": (sum_over_batch, 0, 2, 1, [(3, 7, 5)]),
    "outer_axes_kept": (outer_axes_kept, 2, 3, 1, [(3, 7, 5)]),
    "centered_over_dim_0": (centered_over_dim_0, 0, 2, 1, [(3, 7, 5)]),
    "softmax_over_a_middle_axis": (softmax_over_a_middle_axis, 0, 2, 1, [(3, 7, 4, 5)]),
    "masked_column_sums": (masked_column_sums, 1, 1, 1, [(2, 3, 4, 6), (4, 6)]),
    "weight_with_a_gap": (weight_with_a_gap, 0, 3, 1, [(3, 5, 4, 6), (3, 4, 6)]),
}


def centered_by_sequence_peaks(fd, dtype=BF16):
    """x minus its peaks over seq ([batch, 1, hidden]), summed along hidden: the peaks are a
    segment of their own (column maxima per batch: a group of rows each, no input moved), and
    the later segment reads them repeated along seq."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    peaks = fd.ops.max(xf, [1], keepdim=True)
    fd.add_output(fd.ops.sum(fd.ops.sub(xf, peaks), [2]))


def sums_along_two_axes(fd, dtype=BF16):
    """[A, B, C] minus its sums along C, over 1 + the square of its sums along B: both sums
    are one segment (rows [A, B] summed along C, and per group of A along B), and the last
    reads the sums along B repeated along B."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    b = fd.ops.sum(xf, [1], keepdim=True)
    y = fd.ops.div(fd.ops.sub(xf, fd.ops.sum(xf, [2], keepdim=True)),
                   fd.ops.add(fd.ops.mul(b, b), 1.0))
    fd.add_output(fd.ops.cast(y, dtype))


# builder -> (segments, of which run as segments of their own, kernels in all, input shapes)
NESTED = {
    "group_norm_affine": (group_norm_affine, 2, 0, 2, [(3, 8, 4, 6), (8,), (8,)]),
    "centered_by_sequence_peaks": (centered_by_sequence_peaks, 2, 0, 2, [(3, 7, 5)]),
    "sums_along_two_axes": (sums_along_two_axes, 2, 0, 2, [(3, 7, 5)]),
}


def _fd(name: str, dtype=BF16) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        (CASES.get(name) or NESTED[name])[0](fd, dtype)
    return fd


def _inputs(fd: FusionDefinition, shapes, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32).astype(v.dtype.numpy)
              for v, s in zip(fd.fusion.inputs, shapes, strict=True)]
    for i, v in enumerate(fd.fusion.inputs):
        if v.dtype is DataType.Bool:
            arrays[i] = nd.mask(rng, shapes[i])
    if fd.name == "batchnorm_nchw_backward":
        arrays[3] = np.abs(arrays[3]) + 0.5  # 1 / std
    return arrays


def _taken(fd: FusionDefinition):
    """The lowered fusion and the order its segmentation takes (the grouped one first)."""
    widened = _widened(lower(fd.fusion))
    plain = order_of(widened)
    return widened, grouped_order(widened, plain) or plain


def _own_order(fd: FusionDefinition) -> bool:
    """Whether the order taken is the fusion's own (only inputs expanded, or axes merged)."""
    widened, order = _taken(fd)
    return order is not None and order.axes == _axes(widened)


def _merged_in_own_order(fd: FusionDefinition) -> bool:
    """Whether the order taken is the fusion's own with several hidden axes merged."""
    order = _taken(fd)[1]
    return _own_order(fd) and order is not None and len(order.hidden) > 1


def _segmentation(fd: FusionDefinition):
    with pytest.raises(UnsupportedFusionError) as refused:
        analyze(fd.fusion)
    return segment(fd.fusion, fd.name, refused.value)


@pytest.mark.parametrize("name", list(CASES))
def test_the_order_moves_what_it_must(name):
    fd = _fd(name)
    segmentation = _segmentation(fd)
    copies = [e for e in segmentation.layouts if e.op in ("permute", "expand")]
    views = [e for e in segmentation.layouts if e.op == "reshape"]
    assert (len(copies), len(views), len(segmentation.segments)) == CASES[name][1:4], \
        segmentation
    assert ("another order" in str(segmentation)) == (not _own_order(fd))
    assert "merged into one axis" in str(segmentation) or not _merged_in_own_order(fd)
    expands = [e for e in segmentation.layouts if e.op == "expand"]
    assert str(segmentation).count("copied broadcast to") == len(expands)
    for s in segmentation.segments:
        analyze(s.definition.fusion)


def test_a_grouped_order_only_where_it_saves_copies():
    """grouped_order: rows [B, S] in groups of B for softmax over S of [B, S, A, D] (no copy,
    where order_of moves S last: two); none where order_of's order copies no more (its own
    order merged, [A, B, C] centred over A) or fits the own order (reorder nothing)."""
    widened = _widened(lower(_fd("softmax_over_a_middle_axis").fusion))
    axes = _axes(widened)
    plain = order_of(widened)
    grouped = grouped_order(widened, plain)
    assert (grouped.rows, grouped.hidden, grouped.expanded) == (axes[:2], axes[2:], ())
    assert plain.hidden == axes[1:2]
    for name in ("centered_over_dim_0", "instance_norm", "sum_over_batch"):
        widened = _widened(lower(_fd(name).fusion))
        assert grouped_order(widened, order_of(widened)) is None, name


@pytest.mark.parametrize("name", list(CASES))
def test_segments_chained_on_the_oracle_equal_the_whole_fusion(name):
    fd = _fd(name)
    _segmentation(fd)
    assert_chained_matches_the_oracle(fd, _inputs(fd, CASES[name][4]), atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_every_segment_compiles_without_spills(name):
    assert_each_segment_compiles_without_spills(_segmentation(_fd(name)).segments)


@pytest.mark.parametrize("name", list(NESTED))
def test_a_fusion_cut_first_runs_its_segments_as_any(name):
    """The whole fusion holds a layout op or a normalization no one kernel runs, so it is cut
    first; each segment runs as one kernel chain (column sums per group included) or, where
    none runs it, as segments of its own (the peaks over batch and hidden below), which the
    executor and explain() run and show as any."""
    fd = _fd(name)
    segmentation = _segmentation(fd)
    nested = [s for s in segmentation.segments if segments_of(s.definition) is not None]
    assert (len(segmentation.segments), len(nested)) == NESTED[name][1:3]
    assert_chained_matches_the_oracle(fd, _inputs(fd, NESTED[name][4]), atol=1e-5)
    shapes = [tuple(4 * n if n > 1 else n for n in shape) for shape in NESTED[name][4]]
    report = str(fuser.explain(fd, shapes, device="h200"))
    for s in nested:
        assert f"=== {s.definition.name}: 1 segment" in report


def test_batchnorm_over_nchw_runs_as_rows_of_channels():
    """Rows of one channel each (C rows of N * H * W): the channel's statistics are a row
    reduction, and the weight and bias per-row values."""
    widened = _widened(lower(_fd("batchnorm_nchw").fusion))
    order = order_of(widened)
    x = widened.inputs[0]
    assert order is not None
    assert order.rows == (x.dims[1].find(),)
    assert order.hidden == tuple(x.dims[d].find() for d in (0, 2, 3))
    report = str(fuser.explain(_fd("batchnorm_nchw"), [(32, 64, 28, 28), (64,), (64,)],
                               device="h200"))
    assert "64 rows x hidden 25088" in report
    assert "permute(T0, [1, 0, 2, 3]): a contiguous copy" in report


def test_a_fusion_that_fits_its_own_order_is_not_rewritten():
    with FusionDefinition("rows") as fd:
        x = fd.define_tensor([-1, -1, -1])
        fd.add_output(fd.ops.sum(x, [2]))
    lowered = lower(fd.fusion)
    assert order_of(lowered) is None and reordered(lowered) is lowered


def test_reductions_no_order_serves_together_run_a_segment_each():
    """The peaks of [batch, seq, hidden] over batch and hidden ([1, seq, 1]) subtracted, then
    sums along hidden: no split into rows and hidden axes fits both reductions, and cutting
    at the reductions over the rows leaves them in one sweep; cut after every reduction, the
    peaks are a segment (reordered: segments of its own) and the sums another, one kernel
    that reads the [seq] peaks repeated over rows [batch, seq]."""
    with FusionDefinition("peaks") as fd:
        x = fd.define_tensor([-1, -1, -1])
        peaks = fd.ops.max(x, [0, 2], keepdim=True)
        fd.add_output(fd.ops.sum(fd.ops.sub(x, peaks), [2]))
    lowered = lower(fd.fusion)
    assert order_of(lowered) is None and reordered(lowered) is lowered
    segmentation = _segmentation(fd)
    assert len(segmentation.segments) == 2
    assert [segments_of(s.definition) is not None for s in segmentation.segments] == [True, False]
    assert analyze(segmentation.segments[1].definition.fusion).repeated
    x = np.random.default_rng(3).standard_normal((3, 7, 5)).astype(np.float32)
    assert_chained_matches_the_oracle(fd, [x], atol=1e-5)


# ----- GPU -----

GPU_SHAPES = {
    "batchnorm_nchw": [[(3, 5, 7, 9), (5,), (5,)], [(32, 64, 56, 56), (64,), (64,)]],
    "batchnorm_nchw_backward": [[(3, 5, 7, 9)] * 2 + [(5,)] * 3,
                                [(16, 128, 28, 28)] * 2 + [(128,)] * 3],
    "instance_norm": [[(3, 5, 7, 9)], [(8, 256, 32, 32)]],
    "sum_over_batch": [[(3, 7, 4099)], [(8, 1024, 4096)]],
    "outer_axes_kept": [[(3, 7, 1000)], [(16, 4096, 64)]],
    "centered_over_dim_0": [[(3, 7, 1000)], [(16, 64, 4096)]],
    "softmax_over_a_middle_axis": [[(3, 7, 4, 9)], [(4, 512, 8, 64)]],
    "masked_column_sums": [[(2, 3, 7, 9), (7, 9)], [(2, 16, 1024, 1024), (1024, 1024)]],
    "weight_with_a_gap": [[(3, 5, 7, 9), (3, 7, 9)], [(8, 16, 64, 512), (8, 64, 512)]],
    "group_norm_affine": [[(3, 8, 7, 9), (8,), (8,)], [(8, 256, 32, 32), (256,), (256,)]],
    "centered_by_sequence_peaks": [[(3, 7, 1000)], [(8, 1024, 4096)]],
    "sums_along_two_axes": [[(3, 7, 1000)], [(8, 1024, 4096)]],
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize(("name", "shapes"),
                         [(n, s) for n, cases in GPU_SHAPES.items() for s in cases], ids=str)
def test_reordered_fusions_match_the_oracle_on_the_gpu(name, shapes, dtype):
    import cupy

    fd = _fd(name, dtype)
    fd.validate([cupy.asarray(a) for a in _inputs(fd, shapes)])
    schedules = fd.last_schedule()
    assert isinstance(schedules, SegmentSchedules)
    kernels = CASES[name][3] if name in CASES else NESTED[name][3]
    assert len(schedules.segments) == kernels == len(fd.last_smem_plan())


@pytest.mark.gpu
def test_batchnorm_over_nchw_matches_torch(has_torch_cuda):
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    x = torch.randn(8, 32, 17, 19, device="cuda").bfloat16()
    w, b = torch.randn(32, device="cuda"), torch.randn(32, device="cuda")
    y, mean, invstd = _fd("batchnorm_nchw").execute([x, w, b])
    want = torch.nn.functional.batch_norm(x.float(), None, None, w, b, training=True, eps=1e-5)
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(mean, x.float().mean((0, 2, 3)), atol=1e-5, rtol=1e-5)
    var = x.float().var((0, 2, 3), unbiased=False)
    torch.testing.assert_close(invstd, torch.rsqrt(var + 1e-5), atol=1e-4, rtol=1e-4)


def test_an_expanded_input_is_a_contiguous_broadcast_copy():
    """moves.expanded, as the executor makes an expand between kernels (torch's path, on
    the CPU)."""
    torch = pytest.importorskip("torch")
    from fuser.moves import expanded

    x = torch.arange(6.0).reshape(2, 3)
    got = expanded(x, (0, 2), (2, 4, 3))
    assert got.is_contiguous() and got.data_ptr() != x.data_ptr()
    assert torch.equal(got, x[:, None, :].expand(2, 4, 3))


# ----- random N-D fusions: reductions over any axes, tensors over any of them -----

@st.composite
def nd_fusions(draw):
    """(shape, a subset of axes a second input spans or None, combining op, the reduced axes,
    the reduction, keepdim): built by _nd_fusion."""
    rank = draw(st.sampled_from((3, 4)))
    shape = tuple(draw(st.permutations([2, 3, 4, 5, 6][:rank])))
    axes = list(range(rank))
    subset = st.lists(st.sampled_from(axes), min_size=1, max_size=rank - 1, unique=True)
    weight = draw(st.none() | subset.map(sorted))
    combine = draw(st.sampled_from(("add", "mul", "aligned_add", "aligned_mul")))
    reduced = sorted(draw(st.lists(st.sampled_from(axes), min_size=1, max_size=rank,
                                   unique=True)))
    op = draw(st.sampled_from(("sum", "max", "min")))
    return shape, weight, combine, reduced, op, draw(st.booleans())


def _weight_shape(weight, combine, shape) -> tuple[int, ...]:
    """The second input's shape: its axes' sizes, or (met by numpy's alignment, "aligned_")
    the trailing axes from its first one on, size 1 where it does not span them."""
    if not combine.startswith("aligned_"):
        return tuple(shape[a] for a in weight)
    return tuple(shape[a] if a in weight else 1 for a in range(weight[0], len(shape)))


def _nd_fusion(weight, combine, reduced, op, keepdim, rank) -> FusionDefinition:
    with FusionDefinition("nd") as fd:
        x = fd.define_tensor([-1] * rank)
        v = x
        if weight is not None and combine.startswith("aligned_"):
            w = fd.define_tensor([-1 if a in weight else 1 for a in range(weight[0], rank)])
            v = getattr(fd.ops, combine.removeprefix("aligned_"))(x, w)
        elif weight is not None:
            w = fd.define_tensor([-1] * len(weight))
            v = getattr(fd.ops, combine)(x, _bcast(fd, w, x, weight))
        r = getattr(fd.ops, op)(fd.ops.tanh(v), reduced, keepdim=keepdim)
        fd.add_output(r)
        if keepdim:
            fd.add_output(fd.ops.sub(v, r))
    return fd


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nd_fusions())
def test_random_nd_fusions_segment_to_what_the_oracle_gives(case):
    """Every random fusion either runs (its segments chained on the oracle, moves made as the
    executor makes them, equal to the whole fusion) or is refused with an
    UnsupportedFusionError; one that fits an order of its axes always runs."""
    shape, weight, combine, reduced, op, keepdim = case
    fd = _nd_fusion(weight, combine, reduced, op, keepdim, len(shape))
    shapes = [shape] + ([_weight_shape(weight, combine, shape)] if weight is not None else [])
    try:
        analyze(fd.fusion)
        return  # one kernel runs it: not this test's business
    except UnsupportedFusionError as exc:
        reason = exc
    fits = order_of(_widened(lower(fd.fusion))) is not None
    try:
        segment(fd.fusion, fd.name, reason)
    except UnsupportedFusionError:
        assert not fits, repr(fd)
        return
    inputs = _inputs(fd, shapes)
    for got, want in zip(_chained(fd, inputs), evaluate(fd.fusion, inputs), strict=True):
        assert got.shape == want.shape, repr(fd)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=repr(fd))


@st.composite
def two_reductions(draw):
    """(shape, the axes of a first reduction, of a second, the first's op, whether the second
    reduces what the first centred): built by _two_reduction_fusion."""
    rank = draw(st.sampled_from((3, 4)))
    shape = tuple(draw(st.permutations([2, 3, 4, 5, 6][:rank])))
    axes = st.lists(st.sampled_from(range(rank)), min_size=1, max_size=rank, unique=True)
    return (shape, sorted(draw(axes)), sorted(draw(axes)), draw(st.sampled_from(("sum", "max"))),
            draw(st.booleans()))


def _two_reduction_fusion(rank, first, second, op, chained) -> FusionDefinition:
    """(x - op(x, first)) / (1 + sum(v, second)^2), v the centred x or x itself."""
    with FusionDefinition("two") as fd:
        x = fd.define_tensor([-1] * rank)
        y = fd.ops.sub(x, getattr(fd.ops, op)(x, first, keepdim=True))
        b = fd.ops.sum(fd.ops.mul(y, y) if chained else x, second, keepdim=True)
        fd.add_output(fd.ops.div(y, fd.ops.add(fd.ops.mul(b, b), 1.0)))
    return fd


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_reductions())
def test_random_fusions_of_two_reductions_segment_to_what_the_oracle_gives(case):
    """Two reductions along any axes: a fusion that runs (one kernel, or segments reordered,
    expanded, nested or split per output) equals the oracle when its segments are chained;
    the rest are refused with an UnsupportedFusionError before anything runs."""
    shape, first, second, op, chained = case
    fd = _two_reduction_fusion(len(shape), first, second, op, chained)
    try:
        analyze(fd.fusion)
        return
    except UnsupportedFusionError as exc:
        reason = exc
    try:
        segment(fd.fusion, fd.name, reason)
    except UnsupportedFusionError:
        return
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert_chained_matches_the_oracle(fd, [x], atol=1e-5)
