"""CPU: a row's variance in one pass (fuser/schedulers/row_variance.py): which fusions' two
reduction levels fold, where the schedulers take the fold, that it leaves the schedule's
geometry as it was, and that the kernel runs one pass for both levels and compiles."""

from __future__ import annotations

import dataclasses

import pytest

from fuser import DataType, FusionDefinition, explain
from fuser.analysis import analyze
from fuser.cli import shapes_of
from fuser.codegen import render_row
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.schedulers import Problem, candidates
from fuser.schedulers import row_variance as rv
from fuser.schedulers.base import RowSchedule

F32 = DataType.Float
GEOMETRY = ("hidden", "vec", "skew", "threads_per_row", "rows_per_block", "cluster", "batch",
            "unroll", "stages", "placements", "accumulators", "blocks_per_sm", "dealing", "kept")


def layernorm_fwd(dtype=DataType.BFloat16):
    return FUSIONS["layernorm_fwd"](dtype)


def users_variance(dtype=DataType.BFloat16, other_operand=False, beside=None, divisor=None):
    """var(x) over rows written out as a user would: sum(x) / n, then sum((x - mean)^2) / n;
    with `other_operand` the squares are of another input's deviations from x's mean,
    `beside` adds that reduction of x to the squares' level, and `divisor` divides the sum by
    something else than the row's size: a constant, a per-row input, an elementwise one."""
    with FusionDefinition("users_variance") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        y = fd.define_tensor([-1, -1], dtype=dtype)
        xf, yf = fd.ops.cast(x, F32), fd.ops.cast(y, F32)
        n = {None: lambda: fd.ops.size(x, 1),
             "constant": lambda: fd.define_scalar(1000.0),
             "row": lambda: fd.define_tensor([-1, 1], dtype=F32),
             "elements": lambda: yf}[divisor]()
        mean = fd.ops.div(fd.ops.sum(xf, dims=[1], keepdim=True), n)
        centered = fd.ops.sub(yf if other_operand else xf, mean)
        var = fd.ops.div(fd.ops.sum(fd.ops.mul(centered, centered), dims=[1], keepdim=True), n)
        fd.add_output(var)
        if beside is not None:
            scaled = fd.ops.mul(xf, fd.ops.broadcast_in_dim(mean, x.shape(), [0, 1]))
            fd.add_output(getattr(fd.ops, beside)(scaled, dims=[1], keepdim=True))
        fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.add(yf, xf), var), dtype))
    return fd


def test_layernorm_forward_statistics_fold_into_one_pass():
    """lowering's var_mean: the mean's sum of T3 = cast(T0) at level 0, the squares' sum at
    level 1, one pass for both, two passes for the row instead of three."""
    info = analyze(layernorm_fwd().fusion)
    fold = rv.shifted_variance(info)
    assert fold is not None and fold.level == 0
    assert fold.source.name == "T0" and fold.operand.definition.op == "cast"
    assert [e.outputs[0] for e in fold_levels(info, fold)] == [
        fold.total.outputs[0], fold.squares.outputs[0]]
    assert rv.row_passes(info, fold) == info.row_passes - 1 == 2
    assert rv.pass_levels(info, None) == info.inner_levels


def fold_levels(info, fold):
    (level,) = rv.pass_levels(info, fold)
    return level


def test_a_users_own_variance_folds_and_other_squares_do_not():
    """The pattern, not the op's name: a user's sum((x - sum(x) / n)^2) folds; the squared
    deviations of another input from x's mean, another reduction beside the squares in their
    level, a computed operand (dropout + LayerNorm: x is no input's cast) and fp32 rows'
    variances (found, not taken: 4-byte elements keep the exact form) do not."""
    assert rv.shifted_variance(analyze(users_variance().fusion)) is not None
    assert rv.shifted_variance(analyze(users_variance(other_operand=True).fusion)) is None
    assert rv.shifted_variance(analyze(users_variance(beside="max").fusion)) is None
    for divisor in ("constant", "row", "elements"):
        assert rv.shifted_variance(analyze(users_variance(divisor=divisor).fusion)) is None
    assert rv.shifted_variance(analyze(FUSIONS["dropout_layernorm_fwd"](
        DataType.BFloat16).fusion)) is None
    fp32 = analyze(layernorm_fwd(DataType.Float).fusion)
    assert rv.shifted_variance(fp32) is not None and rv.folds(fp32, 65537, 16) is None
    for name in ("rmsnorm_fwd", "softmax_fwd", "layernorm_bwd"):
        assert rv.shifted_variance(analyze(FUSIONS[name](DataType.BFloat16).fusion)) is None


@pytest.mark.parametrize(("hidden", "align", "folded"), [
    (65537, 16, True), (24578, 16, True), (24574, 16, True), (4099, 16, True), (7, 16, True),
    (4096, 16, False), (40000, 16, False), (1000, 16, False), (4096, 4, True)])
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half], ids=lambda d: d.name)
def test_the_fold_is_taken_where_rows_miss_16_byte_boundaries(hidden, align, folded, dtype):
    """Rows of 2-byte elements that do not all start on 16-byte boundaries (the hidden size,
    or pointers aligned to less) fold; aligned rows keep two levels (at 4096 the fold lost:
    bench/TUNING.md, "LayerNorm forward at odd sizes")."""
    info = analyze(layernorm_fwd(dtype).fusion)
    assert (rv.folds(info, hidden, align) is not None) is folded


@pytest.mark.parametrize("device", ["h100", "h200"])
@pytest.mark.parametrize("hidden", [7, 4099, 24578, 65537, 98305])
def test_folded_schedules_keep_their_geometry(hidden, device, monkeypatch):
    """The fold changes the passes a kernel runs, not the schedule the policy tables pick
    (they count the two levels, as they were measured): the first candidates with and
    without it have the same geometry and storage, the folded ones say so and plan the
    reduction scratch for two sums."""
    info = analyze(layernorm_fwd().fusion)
    spec = DeviceSpec.get(device)
    problem = Problem(hidden, 16384, 16)
    folded = list(candidates(info, problem, spec))[:3]
    monkeypatch.setattr(rv, "folds", lambda *args: None)
    plain = list(candidates(info, problem, spec))[:3]
    assert len(folded) == len(plain) > 0
    for f, p in zip(folded, plain, strict=True):
        assert isinstance(f, RowSchedule) and f.shifted_variance and not p.shifted_variance
        assert {k: getattr(f, k) for k in GEOMETRY} == {k: getattr(p, k) for k in GEOMETRY}
        assert "in one pass, shifted by the mean of the row's first elements" in f.reason
        scratch = [b.nbytes for s in (f, p) for b in s.smem.buffers if b.name == "s_reduce"]
        assert not scratch or scratch[0] == 2 * scratch[1]


def test_a_folded_kernel_runs_one_pass_for_both_levels():
    """The source: the shift read as each row starts, one pass with both sums (a reducer of
    two: x as the mean's level sums it, and (x - k)^2), the squared deviations from the mean
    made from them after the exchange, then the output pass; two passes over the row where
    the unfolded kernel has three."""
    info = analyze(layernorm_fwd().fusion)
    spec = DeviceSpec.get("h100")
    s = next(iter(candidates(info, Problem(24578, 16384, 16), spec)))
    source = render_row("layernorm_fwd", info, s, None).source
    plain = render_row("layernorm_fwd", info, dataclasses.replace(s, shifted_variance=False),
                       None).source
    assert source.count("fm::for_each_vector(") == 2 and plain.count("fm::for_each_vector(") == 3
    assert "const float shift_T5 = fm::row_shift(part, g_T0, row * H, valid);" in source
    assert "fm::RowReducer<float, Part, 2> reduce" in source
    assert "row_T5 = fm::Sum{}(row_T5, e_T3);" in source  # the mean's sum, as unfolded
    assert "row_T16 = fm::Sum{}(row_T16, (e_T3 - shift_T5) * (e_T3 - shift_T5));" in source
    assert "const float dev_T5 = fmaf(-shift_T5, static_cast<float>(S4), row_T5);" in source
    assert "row_T16 -= dev_T5 * (dev_T5 / static_cast<float>(S4));" in source
    assert "if (row_T16 < 0.0f) row_T16 = 0.0f;" in source
    assert source.index("if (row_T16 < 0.0f)") < source.index("const float row_T17 =")


@pytest.mark.parametrize(("dtype", "hidden"), [
    (DataType.BFloat16, 65537), (DataType.BFloat16, 24578), (DataType.BFloat16, 4099),
    (DataType.Half, 4099), (DataType.BFloat16, 7)])
def test_folded_kernels_compile_without_spills(dtype, hidden, tmp_path):
    """Through NVRTC and ptxas for the H100 (no GPU): the folded kernels build, unspilled."""
    from fuser.cache import KernelCache

    fd = layernorm_fwd(dtype)
    report = explain(fd, shapes_of(fd, 16384, hidden), None, device="h100",
                     cache=KernelCache(tmp_path))
    assert report.schedule.shifted_variance
    (resources,) = report.resources.values()
    assert not resources.spills, resources



def norm_3d(dims, dtype=DataType.BFloat16):
    """A normalization over `dims` of [A, B, C] (torch.var_mean's default correction)."""
    with FusionDefinition("norm_3d") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        var, mean = fd.ops.var_mean(xf, dims=dims, correction=1, keepdim=True)
        y = fd.ops.mul(fd.ops.sub(xf, mean), fd.ops.rsqrt(fd.ops.add(var, fd.define_scalar(1e-5))))
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


@pytest.mark.parametrize(("dims", "shape", "folded"), [
    ([2], [3, 7, 4099], True), ([2], [2, 5, 7], True), ([2], [3, 7, 4096], False),
    ([1, 2], [8, 7, 7], False)])
def test_n_d_rows_fold_where_their_count_is_known(dims, shape, folded, tmp_path):
    """Rows over the last axis of a 3-D tensor fold at odd sizes, the count the variance
    divides by (correction 1: n - 1) the axis' size as the kernel reads it; compiled unspilled.
    Rows over the last two axes run as a view whose count reaches the kernel as the product
    of two scalar inputs, which the fold cannot tie to the row's elements: two levels."""
    from fuser.cache import KernelCache

    report = explain(norm_3d(dims), [shape], None, device="h100", cache=KernelCache(tmp_path))
    (part,) = getattr(report, "parts", (report,))
    assert part.schedule.shifted_variance is folded
    (resources,) = part.resources.values()
    assert not resources.spills, resources
    if folded:
        assert "fm::row_shift(part, g_T0, row * H, valid)" in part.source
