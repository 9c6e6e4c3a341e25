"""CPU: segmentation (fuser/segment.py). Fusions that use a reduction over the rows are cut
into chains of one-kernel segments; each segment schedules and compiles offline, and the
chain, evaluated segment by segment on the float64 oracle, gives what the whole fusion gives.
tests/test_gpu_segments.py runs them on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

import fuser
from fuser import DataType, FusionDefinition, HintError, UnsupportedFusionError
from fuser.analysis import Kind, analyze
from fuser.device import DeviceSpec
from fuser.executor import execute, outer_segments, segments_of
from fuser.explain import SegmentedExplanation
from fuser.kernels import build
from fuser.reference import evaluate
from fuser.schedulers import Hints, Problem
from fuser.shapes import bind_shapes

F, BF16 = DataType.Float, DataType.BFloat16
H200 = DeviceSpec.get("h200")


def softmax_dim0(fd, dtype=F):
    x = fd.define_tensor([-1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, [0], keepdim=True)))
    fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, [0], keepdim=True)), dtype))


def batch_norm(fd, dtype=F):
    """Training-mode BatchNorm over the rows: per-column mean and biased variance (var_mean
    over dim 0), then the normalized, scaled and shifted rows, and the statistics."""
    x = fd.define_tensor([-1, -1], dtype=dtype)
    w = fd.define_tensor([-1], dtype=F)
    b = fd.define_tensor([-1], dtype=F)
    xf = fd.ops.cast(x, F)
    var, mean = fd.ops.var_mean(xf, [0], correction=0, keepdim=True)
    y = fd.ops.mul(fd.ops.sub(xf, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
    fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.mul(y, w), b), dtype))
    fd.add_output(mean)
    fd.add_output(var)


def row_then_column(fd, dtype=F):
    """Each row divided by its sum, then each column of that by its sum (of |x| + 1: a row of
    standard normal values may sum to almost 0, and its quotients to anything)."""
    x = fd.define_tensor([-1, -1], dtype=dtype)
    xf = fd.ops.add(fd.ops.abs(fd.ops.cast(x, F)), 1.0)
    y = fd.ops.div(xf, fd.ops.sum(xf, [1], keepdim=True))
    fd.add_output(fd.ops.div(y, fd.ops.sum(y, [0], keepdim=True)))


def centered_3d(fd, dtype=F):
    """[B, S, H]: subtract the mean over the batch and sequence axes from every row (B * S a
    scalar input: an N-D kernel knows only the product of its row axes, not each size)."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    count = fd.define_scalar(None, dtype=F)
    xf = fd.ops.cast(x, F)
    total = fd.ops.sum(xf, [0, 1], keepdim=True)
    fd.add_output(fd.ops.sub(xf, fd.ops.div(total, count)))


def sum_by_column(fd, dtype=F):
    """x - 2 sum(x, dims=[1]) without keepdim: numpy aligns the [N] sums with the last axis,
    so column j loses twice row j's sum (x must be square); every row sum must exist first."""
    x = fd.define_tensor([-1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    fd.add_output(fd.ops.sub(xf, fd.ops.mul(fd.ops.sum(xf, [1]), 2.0)))


def sum_along_columns(fd, dtype=F):
    """The same through an explicit broadcast_in_dim(sum, x's shape, broadcast_dims=[1])."""
    x = fd.define_tensor([-1, -1], dtype=dtype)
    xf = fd.ops.cast(x, F)
    sums = fd.ops.broadcast_in_dim(fd.ops.sum(xf, [1]), xf.shape(), [1])
    fd.add_output(fd.ops.sub(xf, sums))


CASES = {  # builder -> (segments, input shapes)
    "softmax_dim0": (softmax_dim0, 3, [(300, 257)]),
    "batch_norm": (batch_norm, 3, [(300, 257), (257,), (257,)]),
    "row_then_column": (row_then_column, 2, [(300, 257)]),
    "centered_3d": (centered_3d, 2, [(4, 75, 257), 300.0]),
    "sum_by_column": (sum_by_column, 2, [(257, 257)]),
    "sum_along_columns": (sum_along_columns, 2, [(257, 257)]),
}


def _fd(name: str, dtype=F) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        CASES[name][0](fd, dtype)
    return fd


def _host_inputs(name: str, dtype=F) -> list[np.ndarray]:
    """The data input in `dtype`, weights in float32, standard normal; scalars as given."""
    rng = np.random.default_rng(7)
    shapes = CASES[name][2]
    x = rng.standard_normal(shapes[0]).astype(np.float32).astype(dtype.numpy)
    return [x] + [s if isinstance(s, float) else rng.standard_normal(s).astype(np.float32)
                  for s in shapes[1:]]


# Normalizations along columns alone: one outer-persistent kernel where the columns fit on
# chip, these segments where they do not (test_outer_persistent.py).
OUTER_NORMS = ("softmax_dim0", "batch_norm", "centered_3d")


def _segments(fd: FusionDefinition):
    """The segments `fd` runs as: segments_of(fd), or for an outer normalization the chain it
    falls back to where its columns are too tall for a cluster."""
    return segments_of(fd) or outer_segments(fd)


@pytest.mark.parametrize("name", list(CASES))
def test_one_kernel_cannot_run_it_and_segments_can(name):
    fd = _fd(name)
    if name in OUTER_NORMS:
        assert analyze(fd.fusion).kind is Kind.OUTER_NORM and segments_of(fd) is None
    else:
        with pytest.raises(UnsupportedFusionError):
            analyze(fd.fusion)
    segmentation = _segments(fd)
    assert segmentation is not None
    assert len(segmentation.segments) == CASES[name][1]
    assert "reduced by an earlier segment" in str(segmentation)
    for s in segmentation.segments:
        analyze(s.definition.fusion)  # each segment is one kernel chain


@pytest.mark.parametrize("name", list(CASES))
def test_segments_chained_on_the_oracle_equal_the_whole_fusion(name):
    """Each segment evaluated on its inputs (the user's, and earlier segments' outputs as the
    oracle stores them): the last values equal the whole fusion's oracle."""
    fd = _fd(name)
    inputs = _host_inputs(name)
    segmentation = _segments(fd)
    values = dict(zip(segmentation.lowered.inputs, inputs, strict=True))
    for s in segmentation.segments:
        outs = evaluate(s.definition.fusion, s.arguments(values))
        values.update(zip(s.outputs, outs, strict=True))
    chained = [values[o] for o in segmentation.lowered.outputs]
    for got, expected in zip(chained, evaluate(fd.fusion, inputs), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [F, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("name", list(CASES))
def test_every_segment_compiles_without_spills(name, dtype):
    for s in _segments(_fd(name, dtype)).segments:
        built = build(s.definition.name, analyze(s.definition.fusion), Problem(4096, 1024, 16),
                      H200)
        for entry, _plan in built.plans():
            assert not built.compiled.resource(entry).spills, entry


def test_a_one_kernel_fusion_is_not_segmented():
    with FusionDefinition("rows") as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.div(x, fd.ops.sum(x, [1], keepdim=True)))
    assert segments_of(fd) is None


def test_what_cutting_does_not_help_keeps_its_reason():
    with FusionDefinition("outer_sum") as fd:
        column = fd.define_tensor([-1, 1])  # x[i] + x[j]: an [R, R] outer sum, one extent twice
        fd.add_output(fd.ops.add(column, fd.ops.squeeze(column, [1])))
    with pytest.raises(UnsupportedFusionError, match=r"^T\d+ has two dimensions the definition"):
        segments_of(fd)


def test_hints_are_refused_for_a_segmented_fusion_before_anything_runs():
    fd = _fd("row_then_column")
    with pytest.raises(HintError, match=r"(?s)runs as 2 segments.*pass hints=None"):
        execute(fd, [np.zeros((4, 4), np.float32)], hints=Hints(threads_per_row=64))


def test_explain_shows_each_segment_and_why():
    """Columns of 2**21 rows: no cluster holds even 16 bytes of each of them on chip."""
    tall = 2**21
    report = fuser.explain(_fd("batch_norm", BF16), [(tall, 64), (64,), (64,)])
    assert isinstance(report, SegmentedExplanation) and len(report.parts) == 3
    text = str(report)
    assert "3 segments" in text and "needs T" in text and "do not fit on a cluster" in text
    assert [p.info.kind.name for p in report.parts] == ["OUTER", "OUTER", "POINTWISE"]
    assert report.parts[2].shapes[0] == (tall, 64)


def test_sum_by_column_follows_numpy_and_refuses_a_non_square_input():
    x = np.random.default_rng(2).standard_normal((6, 6)).astype(np.float32)
    (got,) = evaluate(_fd("sum_by_column").fusion, [x])
    wide = x.astype(np.float64)
    np.testing.assert_allclose(got, wide - 2 * wide.sum(axis=1), rtol=1e-6)
    with pytest.raises(fuser.BadInputError, match="T0 dimension 1"):  # what execute checks
        bind_shapes(_segments(_fd("sum_by_column")).lowered, [(6, 5)])


def test_a_stage_that_writes_nothing_has_no_segment():
    """A full reduction no output needs puts its second half one stage later, with nothing
    there to write: no segment for that stage (make fuzz found an empty one, whose repr did
    not rebuild)."""
    with FusionDefinition("dead_total") as fd:
        x = fd.define_tensor([-1, -1])
        fd.ops.max(x, [0, 1], keepdim=True)  # used by nothing
        fd.add_output(fd.ops.abs(fd.ops.max(x, [1], keepdim=True)))
    segmentation = segments_of(fd)
    assert segmentation is None or all(s.outputs for s in segmentation.segments)


def test_values_no_output_needs_are_left_out_of_the_kernel():
    """An unused value that normalizes along the rows (no kernel of the output's could run
    it) is left out when the fusion is lowered: one kernel of the row sum, no segmentation
    (found by the CPU fuzz, which then cut a one-segment copy)."""
    with FusionDefinition("dead") as fd:
        x = fd.define_tensor([-1, -1])
        fd.ops.sub(x, fd.ops.sum(x, [0], keepdim=True))  # used by nothing
        fd.add_output(fd.ops.sum(x, [1]))
    assert analyze(fd.fusion).kind.name == "INNER"
    assert segments_of(fd) is None
