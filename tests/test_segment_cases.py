"""Segmentation (fuser/segment.py) on the fusions tests/test_segment.py leaves out: several
outputs at different stages, outputs that later segments read, scalar inputs only a later
segment uses, sizes, broadcasts shaped by another tensor's sizes, var over the rows, keepdim
mixtures, [B, S, H] tensors, Half / BFloat16 values carried between segments, statistics that
meet no other tensor in their segment, long names; and fusions that cutting does not help.

CPU: each fusion's segments, evaluated one after the other on the float64 oracle (each fed
the user's inputs and what earlier segments wrote, as stored), give what the oracle gives for
the whole fusion; each segment schedules and compiles for the H200 preset without spills.
GPU (`gpu` marker): fd.validate() of the chain of kernels against the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from test_segment import _segments

from fuser import DataType, FusionDefinition, UnsupportedFusionError
from fuser.analysis import Kind, Role, analyze
from fuser.device import DeviceSpec
from fuser.executor import execute, segments_of
from fuser.frontend import MAX_NAME_LENGTH
from fuser.kernels import build
from fuser.reference import evaluate
from fuser.schedulers import Problem
from fuser.schedulers.base import OuterSchedule

F, BF16, HALF = DataType.Float, DataType.BFloat16, DataType.Half
H200 = DeviceSpec.get("h200")


def two_statistics(fd):
    """A full output and a column output at stage 1, the column made only from a statistic
    that meets no full tensor in its segment (its size must still be the hidden size)."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.div(x, fd.ops.sum(x, [0], keepdim=True)))
    fd.add_output(fd.ops.mul(fd.ops.max(x, [0]), 2.0))


def statistic_and_weight(fd):
    """A [1, H] column sum, a [H] weight: the weight's output meets the full tensor only
    through the sum of the first segment."""
    x = fd.define_tensor([-1, -1])
    w = fd.define_tensor([-1])
    s = fd.ops.sum(fd.ops.mul(x, w), [0], keepdim=True)
    fd.add_output(fd.ops.div(x, fd.ops.add(fd.ops.abs(s), 1.0)))
    fd.add_output(fd.ops.add(s, w))
    fd.add_output(fd.ops.mul(w, 3.0))


def outputs_read_later(fd):
    """The centered tensor and the mean are outputs (stage 1) that segment 2 reads; the
    column sums of squares an output too."""
    x = fd.define_tensor([-1, -1])
    mean = fd.ops.div(fd.ops.sum(x, [0], keepdim=True), fd.ops.size(x, 0))
    c = fd.ops.sub(x, mean)
    ss = fd.ops.sum(fd.ops.mul(c, c), [0], keepdim=True)
    fd.add_output(c)
    fd.add_output(fd.ops.div(c, fd.ops.sqrt(fd.ops.add(ss, 1.0))))
    fd.add_output(mean)
    fd.add_output(ss)


def late_scalars(fd):
    """Scalar inputs used only by the last segment (one not at all)."""
    x = fd.define_tensor([-1, -1])
    fd.define_scalar(None, dtype=F)
    b = fd.define_scalar(None, dtype=F)
    fd.add_output(fd.ops.mul(fd.ops.sub(x, fd.ops.sum(x, [0], keepdim=True)), b))


def var_over_rows(fd):
    """var (keepdim=False) over dim 0: two dependent outer reductions, three segments."""
    x = fd.define_tensor([-1, -1])
    v = fd.ops.var(x, [0], correction=1, keepdim=False)
    fd.add_output(fd.ops.div(x, fd.ops.sqrt(fd.ops.add(v, 1.0))))
    fd.add_output(v)


def keepdim_mixture(fd):
    """Row sums kept ([N, 1]) and not ([N], broadcast as rows), column sums kept and not."""
    x = fd.define_tensor([-1, -1])
    r_kept = fd.ops.sum(x, [1], keepdim=True)
    r = fd.ops.broadcast_in_dim(fd.ops.max(x, [1]), x.shape(), [0])
    y = fd.ops.sub(fd.ops.sub(x, r), fd.ops.div(r_kept, fd.ops.size(x, 1)))
    c_kept = fd.ops.sum(y, [0], keepdim=True)
    c = fd.ops.max(y, [0])
    fd.add_output(fd.ops.add(fd.ops.sub(y, c_kept), c))


def inner_reduction_read_later(fd):
    """A row sum of the first sweep that the second segment reads; then a row softmax of a
    stage-1 tensor (an inner reduction inside segment 1)."""
    x = fd.define_tensor([-1, -1])
    r = fd.ops.sum(x, [1], keepdim=True)
    y = fd.ops.sub(fd.ops.mul(x, r), fd.ops.max(x, [0], keepdim=True))
    e = fd.ops.exp(fd.ops.sub(y, fd.ops.max(y, [1], keepdim=True)))
    fd.add_output(fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True)))


def broadcast_by_sizes(fd):
    """Column sums broadcast to the shape another input's sizes give."""
    x = fd.define_tensor([-1, -1])
    z = fd.define_tensor([-1, -1])
    y = fd.ops.add(x, z)
    s = fd.ops.sum(y, [0])
    fd.add_output(fd.ops.sub(z, fd.ops.broadcast_in_dim(s, [x.size(0), z.size(1)], [1])))


def column_chain(fd):
    """A column output made from a column statistic of a stage-1 tensor: three segments,
    the last one all [H]."""
    x = fd.define_tensor([-1, -1])
    m = fd.ops.max(fd.ops.sub(x, fd.ops.sum(x, [0])), [0])
    fd.add_output(fd.ops.mul(m, 2.0))


def centered_3d_kept_and_not(fd):
    """[B, S, H]: the mean over [0, 1] with keepdim (a scalar input counts B * S) and the
    column sums without, as outputs."""
    x = fd.define_tensor([-1, -1, -1])
    count = fd.define_scalar(None, dtype=F)
    total = fd.ops.sum(x, [0, 1])
    mean = fd.ops.div(fd.ops.sum(x, [0, 1], keepdim=True), count)
    fd.add_output(fd.ops.sub(x, mean))
    fd.add_output(total)


def rows_3d_then_columns(fd):
    """[B, S, H]: each row over its sum (an inner reduction kept as [B, S]), then over the
    column sums of that."""
    x = fd.define_tensor([-1, -1, -1])
    xa = fd.ops.add(fd.ops.abs(x), 1.0)
    r = fd.ops.broadcast_in_dim(fd.ops.sum(xa, [2]), xa.shape(), [0, 1])
    y = fd.ops.div(xa, r)
    fd.add_output(fd.ops.div(y, fd.ops.sum(y, [0, 1], keepdim=True)))


def batch_norm_narrow(fd, dtype=BF16):
    """BatchNorm statistics of a Half / BFloat16 input without a cast to Float: the sums are
    of the input's type, and must not be rounded to it between segments (the data has a mean
    of 100, where one BFloat16 unit of the sum is many of the centered values)."""
    x = fd.define_tensor([-1, -1], dtype=dtype)
    var, mean = fd.ops.var_mean(x, [0], correction=0, keepdim=True)
    fd.add_output(fd.ops.mul(fd.ops.sub(x, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5))))
    fd.add_output(mean)
    fd.add_output(var)


def narrow_output_read_later(fd):
    """exp(x) is a BFloat16 output (rounded when stored); the Float column normalization
    uses its unrounded value, so a later segment recomputes it instead of reading it."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    e = fd.ops.exp(x)
    fd.add_output(e)
    ef = fd.ops.cast(e, F)
    fd.add_output(fd.ops.div(ef, fd.ops.sum(ef, [0], keepdim=True)))


def softmax_dim0_narrow(fd):
    """softmax over dim 0 of a BFloat16 tensor with no cast: max and sum of BFloat16 type."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    e = fd.ops.exp(fd.ops.sub(x, fd.ops.max(x, [0], keepdim=True)))
    fd.add_output(fd.ops.div(e, fd.ops.sum(e, [0], keepdim=True)))
    fd.add_output(fd.ops.max(x, [0]))


def cast_statistics(fd):
    """Column statistics of a stage-1 tensor output as BFloat16 casts: written by the
    segment that reduces them (two segments, not a third one for the casts)."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    xf = fd.ops.cast(x, F)
    y = fd.ops.div(xf, fd.ops.add(fd.ops.sum(fd.ops.abs(xf), [0], keepdim=True), 1.0))
    fd.add_output(fd.ops.cast(y, BF16))
    fd.add_output(fd.ops.cast(fd.ops.sum(y, [0]), BF16))
    fd.add_output(fd.ops.cast(fd.ops.max(y, [0], keepdim=True), BF16))


def long_name(fd):
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sub(x, fd.ops.sum(x, [0], keepdim=True)))


def var_mean_3d(fd):
    """var_mean over [B, S] divides by B * S: the row count, all a kernel over N-D rows
    knows of the leading sizes."""
    x = fd.define_tensor([-1, -1, -1])
    var, mean = fd.ops.var_mean(x, [0, 1], correction=0, keepdim=True)
    fd.add_output(fd.ops.mul(fd.ops.sub(x, mean), var))


def batch_norm_nhwc(fd):
    """Channels-last BatchNorm in training: statistics over N, H and W per channel, then
    the normalization with a weight and bias; mean and rstd out per channel."""
    x = fd.define_tensor([-1, -1, -1, -1])
    w, b = fd.define_tensor([-1]), fd.define_tensor([-1])
    var, mean = fd.ops.var_mean(x, [0, 1, 2], correction=0, keepdim=False)
    rstd = fd.ops.rsqrt(fd.ops.add(var, 1e-5))
    xhat = fd.ops.mul(fd.ops.sub(x, fd.ops.broadcast_in_dim(mean, x.shape(), [3])),
                      fd.ops.broadcast_in_dim(rstd, x.shape(), [3]))
    fd.add_output(fd.ops.add(fd.ops.mul(xhat, w), b))
    fd.add_output(mean)
    fd.add_output(rstd)


def full_sum(fd):
    """A sum over both axes: each row's sum, then one row of them in a second kernel."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sum(x, [0, 1]))


def full_mean_beside_rows(fd):
    """An elementwise output of every row, and the mean of all elements (keepdim: [1, 1])."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.mul(x, 2.0))
    count = fd.ops.mul(x.size(0), x.size(1))
    fd.add_output(fd.ops.div(fd.ops.sum(x, [1, 0], keepdim=True), count))


def full_max_3d(fd):
    """max over all three axes of [B, S, H]: per row of [B * S], per B, then one value."""
    x = fd.define_tensor([-1, -1, -1])
    fd.add_output(fd.ops.max(x, [0, 1, 2]))


def full_sum_bf16(fd):
    """A bf16 sum of a bf16 tensor over both axes: the row sums carried in float."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    fd.add_output(fd.ops.sum(x, [0, 1], dtype=BF16))


def mean_over_some_leading_dims(fd):
    """A count of two of three leading dimensions, after the column sums: a size the last
    segment takes as a scalar input, as it reads nothing else of x."""
    x = fd.define_tensor([-1, -1, -1, -1])
    count = fd.ops.mul(x.size(0), x.size(1))
    fd.add_output(fd.ops.div(fd.ops.sum(x, [0, 1, 2]), count))


def shifted_by_the_kept_max(fd):
    """x minus the max of all its elements, kept as [1, 1]: the max exists before any row."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sub(x, fd.ops.max(x, [0, 1], keepdim=True)))


def var_of_everything(fd):
    """var_mean over both axes: the mean of all elements, then the squares about it."""
    var, mean = fd.ops.var_mean(fd.define_tensor([-1, -1]), [0, 1], correction=1)
    fd.add_output(var)
    fd.add_output(mean)


def total_of_kept_row_sums(fd):
    """The sum of keepdim row sums over both axes: the [rows, 1] sums, then one row of them."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sum(fd.ops.sum(x, [1], keepdim=True), [0, 1]))


def total_of_a_squeezed_variance(fd):
    """var_mean keepdim, squeezed, summed over the rows: the squeeze of a kept row value is a
    per-row value, and its sum one value after every row's."""
    var, _ = fd.ops.var_mean(fd.define_tensor([-1, -1]), [1], correction=0, keepdim=True)
    fd.add_output(fd.ops.sum(fd.ops.squeeze(var, [1]), [0]))


def total_broadcast_back(fd):
    """The total of x, kept, broadcast back to x's shape: the last kernel's output is the one
    value it reads (found by make fuzz: its read was dropped as unused)."""
    x = fd.define_tensor([-1, -1])
    total = fd.ops.sum(x, [0, 1], keepdim=True)
    fd.add_output(fd.ops.broadcast_in_dim(total, [x.size(0), x.size(1)], [0, 1]))


def column_max_beside_the_total(fd):
    """Twice the column maxima and the total: after the first sweep, one kernel over the
    columns' maxima and one over the rows' sums (no tensor has both: two segments at once)."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.mul(fd.ops.max(x, [0]), 2.0))
    fd.add_output(fd.ops.sum(x, [0, 1]))


def centered_by_the_total(fd):
    """x minus the sum of all its elements: the total exists before any row uses it."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.sub(x, fd.ops.sum(x, [0, 1])))


def rows_of_unrelated_sizes(fd):
    """The column sums of x added to each row of z, whose row count differs: the second
    segment takes the hidden size from the sums it reads, not from x (it reads no x)."""
    x = fd.define_tensor([-1, -1])
    z = fd.define_tensor([-1, -1])
    s = fd.ops.sum(x, [0])
    fd.add_output(fd.ops.add(z, fd.ops.broadcast_in_dim(s, [z.size(0), x.size(1)], [1])))


LONG = "n" * MAX_NAME_LENGTH
CASES = {  # name -> (builder, segments, inputs: a shape (standard normal float32) or a float)
    "two_statistics": (two_statistics, 2, [(30, 17)]),
    "statistic_and_weight": (statistic_and_weight, 2, [(30, 17), (17,)]),
    "outputs_read_later": (outputs_read_later, 3, [(30, 17)]),
    "late_scalars": (late_scalars, 2, [(30, 17), 2.0, 3.0]),
    "var_over_rows": (var_over_rows, 3, [(30, 17)]),
    "keepdim_mixture": (keepdim_mixture, 2, [(30, 17)]),
    "inner_reduction_read_later": (inner_reduction_read_later, 2, [(30, 17)]),
    "broadcast_by_sizes": (broadcast_by_sizes, 2, [(30, 17), (30, 17)]),
    "column_chain": (column_chain, 3, [(30, 17)]),
    "centered_3d_kept_and_not": (centered_3d_kept_and_not, 2, [(3, 10, 17), 30.0]),
    "rows_3d_then_columns": (rows_3d_then_columns, 2, [(3, 10, 17)]),
    "batch_norm_narrow": (batch_norm_narrow, 3, [(300, 17)]),
    "narrow_output_read_later": (narrow_output_read_later, 2, [(30, 17)]),
    "softmax_dim0_narrow": (softmax_dim0_narrow, 3, [(30, 17)]),
    "cast_statistics": (cast_statistics, 2, [(30, 17)]),
    "var_mean_3d": (var_mean_3d, 3, [(3, 10, 17)]),
    "batch_norm_nhwc": (batch_norm_nhwc, 3, [(2, 3, 5, 17), (17,), (17,)]),
    "full_sum": (full_sum, 2, [(30, 17)]),
    "full_mean_beside_rows": (full_mean_beside_rows, 2, [(30, 17)]),
    "full_max_3d": (full_max_3d, 3, [(3, 10, 17)]),
    "full_sum_bf16": (full_sum_bf16, 2, [(30, 17)]),
    "mean_over_some_leading_dims": (mean_over_some_leading_dims, 2, [(2, 3, 5, 17)]),
    "centered_by_the_total": (centered_by_the_total, 3, [(30, 17)]),
    "shifted_by_the_kept_max": (shifted_by_the_kept_max, 3, [(30, 17)]),
    "total_of_kept_row_sums": (total_of_kept_row_sums, 2, [(30, 17)]),
    "total_broadcast_back": (total_broadcast_back, 3, [(30, 17)]),
    "column_max_beside_the_total": (column_max_beside_the_total, 3, [(30, 17)]),
    "rows_of_unrelated_sizes": (rows_of_unrelated_sizes, 2, [(30, 17), (20, 17)]),
    "total_of_a_squeezed_variance": (total_of_a_squeezed_variance, 2, [(30, 17)]),
    "var_of_everything": (var_of_everything, 4, [(30, 17)]),
    LONG: (long_name, 2, [(30, 17)]),
}


def _fd(name: str) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        CASES[name][0](fd)
    return fd


def _inputs(fd: FusionDefinition, name: str, shape=None, seed: int = 5) -> list:
    """Standard normal inputs of each tensor input's dtype (offset by 100 for batch_norm_narrow);
    `shape` replaces the first input's shape and the trailing size of the others."""
    rng = np.random.default_rng(seed)
    specs = CASES[name][2]
    values: list = []
    for v, spec in zip(fd.fusion.inputs, specs, strict=True):
        if isinstance(spec, float):
            values.append(float(np.prod(shape[:-1])) if shape is not None else spec)
            continue
        if shape is not None:
            spec = shape if len(spec) == len(shape) else shape[-len(spec):]
        x = rng.standard_normal(spec) + (100.0 if name == "batch_norm_narrow" else 0.0)
        values.append(x.astype(np.float32).astype(v.dtype.numpy))
    return values


def _chained(fd: FusionDefinition, inputs: list) -> list[np.ndarray]:
    """The segments evaluated in order on the oracle: each on the user's inputs and what
    earlier segments wrote (as stored, in the type they wrote it)."""
    segmentation = _segments(fd)
    values = dict(zip(segmentation.lowered.inputs, inputs, strict=True))
    for s in segmentation.segments:
        outs = evaluate(s.definition.fusion, s.arguments(values))
        values.update(zip(s.outputs, outs, strict=True))
    return [values[o] for o in segmentation.lowered.outputs]


def _one_kernel(fd: FusionDefinition) -> bool:
    """Whether one kernel runs `fd` where its columns fit on chip (an outer normalization);
    the other cases are refused by the analysis."""
    try:
        return analyze(fd.fusion).kind is Kind.OUTER_NORM
    except UnsupportedFusionError:
        return False


@pytest.mark.parametrize("name", list(CASES), ids=lambda n: n[:30])
def test_segments_chained_on_the_oracle_equal_the_whole_fusion(name):
    fd = _fd(name)
    assert _one_kernel(fd) or segments_of(fd) is not None
    segmentation = _segments(fd)
    assert len(segmentation.segments) == CASES[name][1], segmentation
    inputs = _inputs(fd, name)
    expected = evaluate(fd.fusion, inputs)
    for got, want, o in zip(_chained(fd, inputs), expected, fd.fusion.outputs, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, o
        # a Half / BFloat16 output may round the other way where the chain's Float value is
        # a float32 unit away from the oracle's float64 one: one unit of that type
        rtol = 2.0 ** -(8 if o.dtype is BF16 else 11) if o.dtype in (BF16, HALF) else 1e-6
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6, err_msg=o.name)


@pytest.mark.parametrize("name", list(CASES), ids=lambda n: n[:30])
def test_every_segment_compiles_without_spills(name):
    for s in _segments(_fd(name)).segments:
        assert len(s.definition.name) <= MAX_NAME_LENGTH
        built = build(s.definition.name, analyze(s.definition.fusion), Problem(4096, 1024, 16),
                      H200)
        for entry, _plan in built.plans():
            assert not built.compiled.resource(entry).spills, entry


@pytest.mark.parametrize("hidden", [257, 4096])
@pytest.mark.parametrize("name", [n for n in CASES if _one_kernel(_fd(n))], ids=lambda n: n[:30])
def test_outer_normalizations_compile_as_one_kernel(name, hidden):
    """The cases one outer-persistent kernel runs where their columns fit: each compiles for
    the H200 without spills (column outputs of every kind: statistics, weights, chains)."""
    fd = _fd(name)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 1024, 16), H200)
    assert isinstance(built.schedule, OuterSchedule)
    assert not built.compiled.resource(built.source.row_entry).spills


def test_a_statistic_carried_between_segments_keeps_float_precision():
    """The BFloat16 sums of batch_norm_narrow are written as Float; the outputs keep the
    user's types."""
    fd = _fd("batch_norm_narrow")
    segmentation = _segments(fd)
    carried = {v for s in segmentation.segments for v in s.inputs
               if v not in segmentation.lowered.inputs}
    assert carried and all(v.dtype is F for v in carried)
    assert [o.dtype for o in segmentation.lowered.outputs] == [BF16] * 3


def test_a_rounded_narrow_output_is_recomputed_not_read():
    fd = _fd("narrow_output_read_later")
    first, second = _segments(fd).segments
    e = _segments(fd).lowered.outputs[0]
    assert e in first.outputs and e not in second.inputs


def test_segment_names_fit_the_name_limit():
    names = [s.definition.name for s in _segments(_fd(LONG)).segments]
    assert names == [LONG[:-3] + "_s0", LONG[:-3] + "_s1"]


def outer_sum_beside_row_sums(fd):
    """x[i] + x[j] of a [R, 1] column (numpy aligns the squeezed column with the size-1 axis:
    an [R, R] result, one extent on both axes), beside another tensor's row sums: no kernel
    takes a tensor whose two axes are one size, and no cut removes it."""
    x = fd.define_tensor([-1, 1])
    y = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.add(x, fd.ops.squeeze(x, [1])))
    fd.add_output(fd.ops.sum(y, [1]))


REFUSED = {  # builder -> what the error says (the segment's reason, or the whole fusion's)
    outer_sum_beside_row_sums:
        r"(?s)Cutting fusion .* does not help: segment \d .*cannot run as one kernel either: "
        r"T\d+ has two dimensions the definition made one size",
}


@pytest.mark.parametrize("builder", list(REFUSED), ids=lambda b: b.__name__)
def test_what_cutting_does_not_help_is_refused_before_anything_runs(builder):
    with FusionDefinition(builder.__name__) as fd:
        builder(fd)
    with pytest.raises(UnsupportedFusionError, match=REFUSED[builder]):
        _segments(fd)
    shape = (2, 3, 4) if fd.fusion.inputs[0].ndim == 3 else (3, 3)
    tensors = [np.zeros(shape, np.float32) for _ in fd.fusion.inputs]
    with pytest.raises(UnsupportedFusionError, match=REFUSED[builder]):
        execute(fd, tensors)  # raised before a device is touched


GPU_SHAPES = [(300, 257), (7, 24578), (16384, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(CASES), ids=lambda n: n[:30])
def test_segmented_fusion_matches_the_oracle_on_the_gpu(name, shape):
    import cupy

    ndim = len(CASES[name][2][0])
    if ndim == 3:
        shape = (2, shape[0] // 2 + 1, shape[1]) if shape[0] > 7 else (1, 7, shape[1])
    elif ndim == 4:
        shape = (2, 5, shape[0] // 10 + 1, shape[1]) if shape[0] > 7 else (1, 1, 7, shape[1])
    fd = _fd(name)
    fd.validate([cupy.asarray(a) if isinstance(a, np.ndarray) else a
                 for a in _inputs(fd, name, shape)])
    if _one_kernel(fd):  # these columns fit on chip
        assert isinstance(fd.last_schedule(), OuterSchedule)
    else:
        assert len(fd.last_schedule().segments) == CASES[name][1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [HALF, BF16], ids=lambda d: d.name)
def test_narrow_batch_norm_statistics_match_the_oracle_on_the_gpu(dtype):
    import cupy

    with FusionDefinition("batch_norm_narrow") as fd:
        batch_norm_narrow(fd, dtype)
    x = (100 + np.random.default_rng(1).standard_normal((16384, 1024))).astype(dtype.numpy)
    fd.validate([cupy.asarray(x)])


def test_a_constant_size_a_later_segment_takes_is_read_off_the_definition():
    """sum(y, dims=[0, 1]) / y.size(1) of y = x broadcast to [N, 4]: the segment finishing
    the sum takes the 4 as a scalar input, though no tensor passed to it has that size."""
    with FusionDefinition("const_size") as fd:
        x = fd.define_tensor([-1])
        y = fd.ops.broadcast_in_dim(x, [x.size(0), 4], [0])
        fd.add_output(fd.ops.div(fd.ops.sum(y, [0, 1]), y.size(1)))
    x = np.random.default_rng(6).standard_normal(5).astype(np.float32)
    (got,) = _chained(fd, [x])
    np.testing.assert_allclose(got, x.astype(np.float64).sum(), rtol=1e-6)


@pytest.mark.parametrize("shape", [[-1, 1], [1, -1]], ids=str)
def test_a_total_of_a_row_or_column_vector_is_one_kernel(shape):
    """sum over both axes of [N, 1] or [1, N]: one row of N, one inner reduction."""
    with FusionDefinition("vector_total") as fd:
        fd.add_output(fd.ops.sum(fd.define_tensor(shape), [0, 1]))
    assert analyze(fd.fusion).kind is Kind.INNER and _segments(fd) is None
    x = np.random.default_rng(7).standard_normal([9 if s == -1 else 1 for s in shape])
    (total,) = evaluate(fd.fusion, [x.astype(np.float32)])
    assert total.shape == () and np.isclose(total, x.sum(), rtol=1e-5)


def _sum_1d() -> FusionDefinition:
    with FusionDefinition("sum_1d") as fd:
        fd.add_output(fd.ops.sum(fd.define_tensor([-1]), [0]))
    return fd


def test_a_reduction_of_a_1d_tensor_is_one_row():
    """sum(x, dims=[0]) of x [N] (and the second kernel of every full reduction) is an inner
    reduction of one row, its result that row's value: one kernel, no segments."""
    fd = _sum_1d()
    info = analyze(fd.fusion)
    assert info.kind is Kind.INNER and info.row_axes == ()
    assert [info.roles[o] for o in info.fusion.outputs] == [Role.ROW]
    assert _segments(fd) is None
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    (total,) = evaluate(fd.fusion, [x])
    assert total.shape == () and np.isclose(total, x.astype(np.float64).sum())
    built = build(fd.name, info, Problem(1 << 20, 1, 16), H200)
    assert not built.compiled.resource(built.source.row_entry).spills


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_a_reduction_of_a_1d_tensor_matches_the_oracle_on_the_gpu(n):
    import cupy

    fd = _sum_1d()
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    fd.validate([cupy.asarray(x)])
    assert fd.execute([cupy.asarray(x)])[0].shape == ()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 1 << 20])
def test_a_1d_pointwise_fusion_matches_the_oracle_on_the_gpu(n):
    """A fusion of 1-D tensors is one row (its tensors full rows, as in the 1-D sum): the
    pointwise kernel over one row of n."""
    import cupy

    with FusionDefinition("pointwise_1d") as fd:
        x, w = fd.define_tensor([-1]), fd.define_tensor([-1])
        fd.add_output(fd.ops.mul(fd.ops.relu(x), w))
    info = analyze(fd.fusion)
    assert [info.roles[v] for v in info.fusion.inputs] == [Role.FULL, Role.FULL]
    rng = np.random.default_rng(9)
    fd.validate([cupy.asarray(rng.standard_normal(n).astype(np.float32)) for _ in range(2)])
