"""Column reductions per group (issue 15): reductions over the trailing row axes of an N-D
tensor (a mean over the sequence of [batch, seq, hidden]) keep the leading ones as groups,
each a [rows, hidden] problem of its own, run by the row kernel and its finalize with a grid
row of blocks per group, where the axes used to be moved first (a transposing copy, 0.34 of
the copy's speed on an H100); a normalization by them (x minus its mean over the sequence)
by the outer-persistent kernel with a grid row of clusters per group, where it was
reordered (copies around an outer kernel). Offline: the analysis, what falls back to
segments, the kernels on every preset, the launch's sizes; on the GPU (-m gpu): against the
float64 oracle and torch at odd, large, empty and many-group shapes."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_layout import assert_chained_matches_the_oracle

from fuser import DataType, FusionDefinition, UnsupportedFusionError, explain
from fuser.analysis import Kind, Role, analyze
from fuser.device import PRESETS, DeviceSpec
from fuser.executor import segments_of
from fuser.ops import REDUCTIONS
from fuser.reference import evaluate
from fuser.schedulers import Hints, outer_persistent

BF16, F16, F = DataType.BFloat16, DataType.Half, DataType.Float
REDUCE_OPS = tuple(REDUCTIONS)


def mean_over(dims: list[int], rank: int = 3, dtype: DataType = BF16,
              keepdim: bool = False, op: str = "sum") -> FusionDefinition:
    """op(x, dims) of a rank-`rank` x in float, a mean for sum (divided by the reduced
    sizes' product), cast back to x's dtype."""
    with FusionDefinition(f"{op}_over_{'_'.join(map(str, dims))}") as fd:
        x = fd.define_tensor([-1] * rank, dtype=dtype)
        xf = fd.ops.cast(x, F)
        y = getattr(fd.ops, op)(xf, dims, keepdim=keepdim)
        if op == "sum":
            count = x.size(dims[0])
            for d in dims[1:]:
                count = fd.ops.mul(count, x.size(d))
            y = fd.ops.div(y, count)
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


def sums_per_row_and_group(dtype: DataType = BF16) -> FusionDefinition:
    """[A, B, C]: y = x * 2 (every element), sums along C (per row) and along B (per group
    of A) in one row kernel."""
    with FusionDefinition("row_and_group_sums") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=dtype)
        xf = fd.ops.cast(x, F)
        fd.add_output(fd.ops.cast(fd.ops.mul(xf, 2.0), dtype))
        fd.add_output(fd.ops.sum(xf, [2], keepdim=True))
        fd.add_output(fd.ops.max(xf, [1]))
    return fd


def centered_over(dims: list[int], rank: int = 3, dtype: DataType = BF16,
                  op: str = "mean") -> FusionDefinition:
    """x normalized by its column statistics over `dims` (trailing row axes), per group of
    the leading ones: op "mean" outputs x - mean and the mean (keepdim), "var" (x - mean) *
    rsqrt(var + 1e-5) * w + b with w, b of the hidden axis and the variance, "softmax"
    exp(x - max) / sum, all in float, cast back to x's dtype."""
    with FusionDefinition(f"{op}_centered_over_{'_'.join(map(str, dims))}") as fd:
        x = fd.define_tensor([-1] * rank, dtype=dtype)
        xf = fd.ops.cast(x, F)
        shape = [x.size(d) for d in range(rank)]
        if op == "softmax":
            peak = fd.ops.max(xf, dims, keepdim=True)
            e = fd.ops.exp(fd.ops.sub(xf, peak))
            fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims, keepdim=True)), dtype))
            return fd
        var, mean = fd.ops.var_mean(xf, dims, correction=0, keepdim=True)
        if op == "mean":
            fd.add_output(fd.ops.cast(fd.ops.sub(xf, mean), dtype))
            fd.add_output(mean)
            return fd
        w = fd.define_tensor([-1], dtype=dtype)
        b = fd.define_tensor([-1], dtype=dtype)
        wide = [fd.ops.broadcast_in_dim(fd.ops.cast(t, F), shape=shape, broadcast_dims=[rank - 1])
                for t in (w, b)]
        y = fd.ops.mul(fd.ops.sub(xf, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
        fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.mul(y, wide[0]), wide[1]), dtype))
        fd.add_output(fd.ops.squeeze(var, dims))
    return fd


def test_a_reduction_over_the_sequence_keeps_the_batch_as_groups():
    info = analyze(mean_over([1]).fusion)
    assert (info.kind, info.group_axes, len(info.row_axes)) == (Kind.OUTER, 1, 3 - 1)
    assert info.counted_axes == info.row_axes[1:]
    (out,) = info.fusion.outputs
    assert info.roles[out] is Role.COL
    assert "groups:" in info.describe()
    four = analyze(mean_over([2], rank=4).fusion)
    assert (four.group_axes, len(four.counted_axes)) == (2, 1)
    two_counted = analyze(mean_over([1, 2], rank=4).fusion)
    assert (two_counted.group_axes, len(two_counted.counted_axes)) == (1, 2)
    assert analyze(mean_over([0, 1]).fusion).group_axes == 0  # every row axis: one group
    both = analyze(sums_per_row_and_group().fusion)
    assert (both.kind, both.group_axes) == (Kind.INNER_OUTER, 1)
    assert [both.roles[o] for o in both.fusion.outputs] == [Role.FULL, Role.ROW, Role.COL]


def test_a_mean_over_the_sequence_streams_through_one_column_kernel_per_group():
    """No move between kernels and no finalize: the column kernel's pointers move to the
    block's group (grid row), its slabs' rows are a group's; the mean divides by a group's
    rows (n_rows), which is the sequence's length."""
    from fuser.schedulers.base import OuterSchedule

    fd = mean_over([1])
    assert segments_of(fd) is None
    report = explain(fd, [(8, 1024, 4096)], device="h200")
    assert isinstance(report.schedule, OuterSchedule) and report.schedule.streamed
    source = report.source
    assert "permute" not in str(report) and "_finalize(" not in source
    assert "g_T0 += group * n_rows * H;" in source and " += group * H;" in source
    assert source.count("if (group >= n_groups) return;") == 1
    assert "= n_rows;" in source


def test_a_hinted_mean_over_the_sequence_runs_in_one_row_kernel_with_a_finalize_per_group():
    """The row kernel's pointers move to the block's group (grid row), and the finalize's to
    the group's partial rows and columns."""
    fd = mean_over([1])
    report = explain(fd, [(8, 1024, 4096)], device="h200", hints=Hints(fused_finalize=False))
    source = report.source
    assert "g_T0 += group * n_rows * H;" in source
    assert source.count("if (group >= n_groups) return;") == 2  # the row kernel, the finalize
    assert "g_T4 += group * H;" in source or "+= group * H;" in source
    assert "n_rows" in source.split("_finalize(")[1]


def test_a_normalization_by_group_sums_is_one_outer_kernel_per_group():
    """x minus its mean over the sequence: the outer-persistent kernel keeps a group's rows of
    a slab on chip (a cluster's rows are the sequence's, not the batch's), its pointers moved
    to the group of its grid row, each group's mean written to its own row of the output."""
    from fuser.schedulers.base import OuterSchedule

    fd = centered_over([1])
    info = analyze(fd.fusion)
    assert (info.kind, info.group_axes) == (Kind.OUTER_NORM, 1)
    assert segments_of(fd) is None
    report = explain(fd, [(8, 1024, 4096)], device="h200")
    assert isinstance(report.schedule, OuterSchedule) and report.schedule.rows == 1024
    assert report.problem.rows == 1024  # a group's rows, not the batch's 8192
    source = report.source
    assert "long long n_groups)" in source
    assert "if (group >= n_groups) return;" in source
    assert "g_T0 += group * n_rows * H;" in source
    assert source.count("+= group * H;") == 1  # the mean, a row of [8, 1, 4096] per group


def test_an_outer_launch_takes_a_grid_row_per_group():
    from fuser.loader import launch_sizes
    from fuser.schedulers import Problem, schedule

    h200 = DeviceSpec.get("h200")
    info = analyze(centered_over([1]).fusion)
    s = schedule(info, Problem(4096, 1024, 16), h200)
    kernel = types.SimpleNamespace(schedule=s, finalize=None)
    launch, final = launch_sizes(kernel, 1024, h200, 8)
    assert (launch.grid, launch.groups, final) == (s.slabs * s.cluster, 8, None)


def test_a_sequence_too_tall_for_a_cluster_runs_as_segments():
    """2**18 rows of a group: no cluster keeps them on chip, so the segments run (a column sum
    per group, then the normalization), and their chain equals the oracle."""
    from test_layout import assert_chained_matches_the_oracle

    from fuser.explain import SegmentedExplanation

    fd = centered_over([1], dtype=F)
    report = explain(fd, [(2, 2**18, 64)], device="h200")
    assert isinstance(report, SegmentedExplanation)
    assert "cannot run it here" in report.segmentation.refusal
    assert all(not hasattr(p, "parts") for p in report.parts)
    host = [np.random.default_rng(3).standard_normal((3, 7, 5)).astype(np.float32)]
    assert_chained_matches_the_oracle(fd, host, atol=1e-5)


def _pre(name: str, fd, x, w):
    """f(x) before the reduction: x itself, exp(-|x|), x squared, tanh(x), or x times the
    [hidden] weight."""
    if name == "weight":
        return fd.ops.mul(x, fd.ops.broadcast_in_dim(w, shape=x.shape(),
                                                      broadcast_dims=[len(x.shape()) - 1]))
    return {"none": lambda: x, "exp": lambda: fd.ops.exp(fd.ops.neg(fd.ops.abs(x))),
            "square": lambda: fd.ops.mul(x, x), "tanh": lambda: fd.ops.tanh(x)}[name]()


def _post(name: str, fd, x, reduced, dims):
    """x combined with its reduction r: none, x - r, x / (|r| + 1), or (x - r) over the root
    of the mean of (x - r)^2 over the same axes plus 1e-5 (a second level)."""
    if name == "none":
        return None
    if name == "sub":
        return fd.ops.sub(x, reduced)
    if name == "div":
        return fd.ops.div(x, fd.ops.add(fd.ops.abs(reduced), 1.0))
    d = fd.ops.sub(x, reduced)
    count = x.size(dims[0])
    for k in dims[1:]:
        count = fd.ops.mul(count, x.size(k))
    var = fd.ops.div(fd.ops.sum(fd.ops.mul(d, d), dims, keepdim=True), count)
    return fd.ops.mul(d, fd.ops.rsqrt(fd.ops.add(var, 1e-5)))


@st.composite
def group_fusions(draw, shapes=None):
    """x of rank 3 or 4 (and a [hidden] weight where f uses it), f(x) reduced (sum, max or
    min) over trailing row axes (or over the first of three, which is no group), the result
    kept or squeezed, and x combined with it (or not): (shape, dims, op, pre, post, keepdim,
    dtype). `shapes`: rank -> the shapes to draw from (one fixed shape each without)."""
    rank = draw(st.sampled_from((3, 4)))
    dims = draw(st.sampled_from(((1,), (0,)) if rank == 3 else ((2,), (1, 2))))
    options = (shapes or {3: [(3, 37, 1000)], 4: [(2, 3, 17, 264)]})[rank]
    return (draw(st.sampled_from(options)), list(dims), draw(st.sampled_from(REDUCE_OPS)),
            draw(st.sampled_from(("none", "exp", "square", "tanh", "weight"))),
            draw(st.sampled_from(("none", "sub", "div", "norm"))), draw(st.booleans()),
            draw(st.sampled_from((BF16, F16, F))))


def _group_fusion(shape, dims, op, pre, post, keepdim, dtype) -> FusionDefinition:
    with FusionDefinition("random_groups") as fd:
        x = fd.define_tensor([-1] * len(shape), dtype=dtype)
        w = fd.define_tensor([-1], dtype=dtype) if pre == "weight" else None
        xf = fd.ops.cast(x, F)
        wf = fd.ops.cast(w, F) if w is not None else None
        reduced = getattr(fd.ops, op)(_pre(pre, fd, xf, wf), dims, keepdim=True)
        fd.add_output(reduced if keepdim else fd.ops.squeeze(reduced, dims))
        combined = _post(post, fd, xf, reduced, dims)
        if combined is not None:
            fd.add_output(fd.ops.cast(combined, dtype))
    return fd


def _group_inputs(fd, shape, dtype, rng) -> list[np.ndarray]:
    return [rng.standard_normal(s).astype(np.float32).astype(dtype.numpy)
            for s in (shape, shape[-1:])[:len(fd.fusion.inputs)]]


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=group_fusions())
def test_random_group_fusions_build_one_kernel_chain_or_segment_like_the_oracle(case):
    """Each random fusion of reductions over trailing row axes is one kernel chain (a row
    kernel and its finalize per group, or an outer kernel per group for x combined with the
    reduction) whose kernels move every full tensor to its group and compile without
    spills; anything else runs as segments whose chain, on the oracle, is the whole
    fusion's."""
    from fuser.explain import SegmentedExplanation
    from fuser.schedulers.base import OuterSchedule, RowSchedule

    shape, dims, *_, dtype = case
    fd = _group_fusion(*case)
    grouped = dims != [0]
    report = explain(fd, [shape, shape[-1:]][:len(fd.fusion.inputs)], device="h200")
    if isinstance(report, SegmentedExplanation):
        assert not grouped, report.segmentation
        small = (2, 5, 3) if len(shape) == 3 else (2, 2, 3, 4)
        host = _group_inputs(fd, small, dtype, np.random.default_rng(4))
        assert_chained_matches_the_oracle(fd, host, atol=1e-4)
        return
    assert grouped
    info = analyze(fd.fusion)
    streams = (info.kind is Kind.OUTER
               and outer_persistent.can_schedule(info, report.problem, report.device) is None)
    expected = OuterSchedule if info.kind is Kind.OUTER_NORM or streams else RowSchedule
    assert isinstance(report.schedule, expected) and info.group_axes == len(shape) - 1 - len(dims)
    assert "if (group >= n_groups) return;" in report.source
    assert "g_T0 += group * n_rows * H;" in report.source
    assert not any(r.spills for r in report.resources.values())


@pytest.mark.parametrize("device", sorted(PRESETS))
@pytest.mark.parametrize("shape", [(8, 1024, 4096), (3, 7, 1000), (5, 3, 24578), (2, 9, 1)],
                         ids=str)
def test_group_kernels_compile_without_spills_on_every_preset(shape, device):
    for fd in (mean_over([1]), sums_per_row_and_group(), centered_over([1]),
               centered_over([1], op="var"), centered_over([1], op="softmax")):
        shapes = [shape, shape[-1:], shape[-1:]][:len(fd.fusion.inputs)]
        report = explain(fd, shapes, device=device)
        for entry, resources in report.resources.items():
            assert not resources.spills, (entry, resources)


@pytest.mark.parametrize("build", [
    # a sum per group beside a sum over every row axis
    lambda fd, x: fd.ops.add(fd.ops.sum(x, [1]), fd.ops.sum(fd.ops.sum(x, [0]), [0])),
], ids=["two_kinds_of_column_sums"])
def test_what_no_group_kernel_runs_runs_as_segments(build):
    """Refused by the analysis, so the segmentation runs it (as before groups existed), and
    the chain of segments equals the oracle."""
    from test_layout import assert_chained_matches_the_oracle

    with FusionDefinition("segmented") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        fd.add_output(build(fd, x))
    assert segments_of(fd) is not None
    host = [np.random.default_rng(2).standard_normal((3, 7, 5)).astype(np.float32)]
    assert_chained_matches_the_oracle(fd, host, atol=1e-5)


def test_an_output_of_the_hidden_axis_only_beside_group_sums_runs_as_segments():
    """Each group's finalize would write a [hidden] output: refused, and segmented."""
    with FusionDefinition("col_beside_groups") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        w = fd.define_tensor([-1], dtype=F)
        wx = fd.ops.broadcast_in_dim(w, shape=[x.size(0), x.size(1), x.size(2)],
                                     broadcast_dims=[2])
        fd.add_output(fd.ops.sum(fd.ops.mul(x, wx), [1]))
        fd.add_output(fd.ops.mul(w, 2.0))
    with pytest.raises(UnsupportedFusionError, match="every group would write it"):
        analyze(fd.fusion)
    assert segments_of(fd) is not None


def test_a_group_size_in_arithmetic_is_refused_and_a_group_rows_size_is_n_rows():
    with FusionDefinition("batch_size") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        fd.add_output(fd.ops.div(fd.ops.sum(x, [1]), x.size(0)))
    with pytest.raises(UnsupportedFusionError, match="leading dimensions"):
        analyze(fd.fusion)
    fd = mean_over([1, 2], rank=4, dtype=F)
    source = explain(fd, [(2, 3, 5, 7)], device="h200").source
    assert "= n_rows;" in source  # the product of both reduced sizes: a group's rows


def test_a_launch_shares_the_resident_blocks_among_the_groups():
    """8 groups, 528 resident blocks: 66 a group, each group's partial rows its own; the
    finalize a grid row per group too."""
    from fuser.loader import launch_sizes
    from fuser.schedulers import Problem, schedule
    from fuser.schedulers.finalize import finalize_schedule

    h200 = DeviceSpec.get("h200")
    info = analyze(mean_over([1]).fusion)
    s = schedule(info, Problem(4096, 8192, 16), h200, Hints(fused_finalize=False))
    f = finalize_schedule(info, Problem(4096, 8192, 16), h200)
    kernel = types.SimpleNamespace(schedule=s, resident_groups=528, finalize=f)
    launch, final = launch_sizes(kernel, 1024, h200, 8)
    assert (launch.grid, launch.groups, launch.partial_rows) == (66, 8, 66)
    assert (final.groups, final.partial_rows) == (8, 66)
    assert (f.cols_per_block, f.partial_lanes) == (32, 16)  # a group's few partial rows
    few = launch_sizes(kernel, 1024, h200, 100000)[0]
    assert (few.grid, few.groups) == (1, 100000)


def test_more_groups_than_the_grid_holds_are_refused_before_any_launch():
    from fuser import OutOfResourcesError
    from fuser.loader import launch_sizes
    from fuser.schedulers import Problem, schedule

    h200 = DeviceSpec.get("h200")
    info = analyze(centered_over([1]).fusion)
    kernel = types.SimpleNamespace(schedule=schedule(info, Problem(8, 2, 16), h200), finalize=None)
    assert launch_sizes(kernel, 2, h200, 65535 * 65535)[0].groups == 65535 * 65535
    with pytest.raises(OutOfResourcesError, match=r"4294836226 groups .* at most 65535 x 65535 "
                                                  r"= 4294836225 \(gridDim.y x gridDim.z\)"):
        launch_sizes(kernel, 2, h200, 65535 * 65535 + 1)


def test_a_launch_of_more_groups_than_grid_rows_splits_them_over_z(monkeypatch):
    import ctypes

    from test_launch import POINTER, FakeDriver

    from fuser import launch

    fake = FakeDriver()
    monkeypatch.setattr(launch, "driver", lambda: fake)
    entry = launch.EntryLauncher("k", 1, [POINTER, ctypes.c_float], registers=32)
    entry(4, (128, 1), 0, 5, [1, 0.0], 70000)
    entry(4, (128, 1), 0, 5, [1, 0.0], 3)
    assert [c[1] for c in fake.calls] == [(4, 65535, 2), (4, 3, 1)]


def test_the_oracle_of_a_mean_over_the_sequence_is_numpys():
    x = np.random.default_rng(5).standard_normal((3, 7, 5)).astype(np.float32)
    (got,) = evaluate(mean_over([1], dtype=F).fusion, [x])
    np.testing.assert_allclose(got, x.astype(np.float64).mean(1), rtol=1e-6)


# ----- GPU ------------------------------------------------------------------------------------

GPU_SHAPES = [(3, 7, 1000), (8, 1024, 4096), (2, 1, 5), (5, 3, 1), (4, 33, 4099),
              (1, 1000, 24578), (2, 3000, 65537), (70000, 3, 8)]


def _array(rng, shape, dtype: DataType):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_a_mean_over_the_sequence_matches_the_oracle(shape, dtype, rng):
    """One kernel and its finalize (no segments), at odd hidden sizes, one row per group,
    hidden 1, groups past gridDim.y's 65535."""
    fd = mean_over([1], dtype=dtype)
    (out,) = fd.validate([_array(rng, shape, dtype)])
    assert tuple(out.shape) == (shape[0], shape[2])
    assert not hasattr(fd.last_schedule(), "segments")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("case", [([1], 3, (6, 77, 1000)), ([2], 4, (3, 4, 50, 264)),
                                  ([1, 2], 4, (3, 4, 50, 264))], ids=str)
def test_gpu_reductions_over_trailing_row_axes_match_the_oracle(case, op, rng):
    dims, rank, shape = case
    for keepdim in (False, True):
        fd = mean_over(dims, rank, F, keepdim, op)
        (out,) = fd.validate([_array(rng, shape, F)])
        kept = tuple(1 if d in dims else n for d, n in enumerate(shape))
        assert tuple(out.shape) == (kept if keepdim else tuple(n for d, n in enumerate(shape)
                                                              if d not in dims))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 7, 1000), (8, 1024, 4096), (2, 5, 24578)], ids=str)
def test_gpu_row_sums_and_group_sums_in_one_kernel_match_the_oracle(shape, rng):
    fd = sums_per_row_and_group()
    _, rows, groups = fd.validate([_array(rng, shape, BF16)])
    assert (tuple(rows.shape), tuple(groups.shape)) == ((*shape[:2], 1), (shape[0], shape[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 5, 8), (4, 0, 8)], ids=str)
def test_gpu_an_empty_group_or_sequence_is_refused_on_the_host(shape):
    """fuser refuses empty tensors before any launch, groups of no rows and no groups too."""
    import cupy

    from fuser import BadInputError

    with pytest.raises(BadInputError, match="has size 0; empty tensors are not supported"):
        mean_over([1], dtype=F).execute([cupy.zeros(shape, dtype=np.float32)])


@pytest.mark.gpu
def test_gpu_a_mean_over_the_sequence_matches_torch(has_torch_cuda):
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    x = torch.randn(8, 1024, 4096, device="cuda").bfloat16()
    (got,) = mean_over([1]).execute([x])
    torch.testing.assert_close(got.float(), x.float().mean(1), atol=1e-2, rtol=1e-2)


# 70000 groups of 8 rows, not 3: a float variance of 3 rows is near 0 in some of 560000
# columns, where (x - mean) * rsqrt(var + 1e-5) magnifies the mean's rounding up to 316 times,
# past the oracle's float tolerance in any float32 arithmetic (numpy's too, seed 4093634530)
NORM_SHAPES = [(3, 7, 1000), (8, 1024, 4096), (2, 1, 5), (5, 3, 1), (4, 33, 4099),
               (1, 1000, 24578), (70000, 8, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["mean", "var", "softmax"])
def test_gpu_a_normalization_over_the_sequence_matches_the_oracle(op, shape, dtype, rng):
    """One outer-persistent kernel per call (a grid row of clusters per group): x minus its
    mean, a normalization by the variance with a weight and bias, softmax over the sequence;
    one row per group, hidden 1 and odd, groups past gridDim.y's 65535."""
    from fuser.schedulers.base import OuterSchedule

    fd = centered_over([1], dtype=dtype, op=op)
    inputs = [_array(rng, shape, dtype)] + [_array(rng, shape[-1:], dtype)
                                            for _ in fd.fusion.inputs[1:]]
    outs = fd.validate(inputs)
    assert tuple(outs[0].shape) == shape
    assert isinstance(fd.last_schedule(), OuterSchedule)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [([2], 4, (3, 4, 50, 264)), ([1, 2], 4, (3, 4, 50, 264)),
                                  ([1, 2], 4, (2, 3, 700, 4099))], ids=str)
def test_gpu_normalizations_over_trailing_row_axes_match_the_oracle(case, rng):
    from fuser.schedulers.base import OuterSchedule

    dims, rank, shape = case
    for op in ("mean", "softmax"):
        fd = centered_over(dims, rank, F, op)
        fd.validate([_array(rng, shape, F)])
        assert isinstance(fd.last_schedule(), OuterSchedule)


@pytest.mark.gpu
def test_gpu_x_minus_its_mean_over_the_sequence_matches_torch(has_torch_cuda):
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    torch.manual_seed(0)
    x = torch.randn(8, 1024, 4096, device="cuda").bfloat16()
    centered, mean = centered_over([1]).execute([x])
    want = x.float().mean(1, keepdim=True)
    torch.testing.assert_close(mean, want, atol=1e-5, rtol=1e-5)
    # a mean one float ulp off torch's may round x - mean to the bf16 beside torch's (one of
    # 33554432 elements did, 2026-12-06): one bf16 ulp, 2^-7 of the value at most
    torch.testing.assert_close(centered.float(), (x.float() - want).bfloat16().float(),
                               rtol=2**-7, atol=1e-5)


# rows a group: never 2 or 3, whose float variances come near 0 (see NORM_SHAPES)
GPU_GROUP_SHAPES = {3: [(3, 37, 1000), (2, 1, 7), (5, 9, 4099), (4, 700, 24)],
                    4: [(2, 3, 17, 264), (1, 2, 5, 24578)]}


@pytest.mark.gpu
@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=group_fusions(GPU_GROUP_SHAPES))
def test_gpu_random_group_fusions_match_the_oracle(case):
    """The random fusions of reductions over trailing row axes above, on the GPU at odd
    shapes (one row a group, hidden 7, 24 and 24578, 700 rows a group), against the float64
    oracle: whichever kernel chain or segments run them."""
    import cupy

    shape, *_, dtype = case
    fd = _group_fusion(*case)
    fd.validate([cupy.asarray(a)
                 for a in _group_inputs(fd, shape, dtype, np.random.default_rng(7))])


# (normalize, hinted): an outer normalization has no row kernel to hint
PER_GROUP_OFFLINE = pytest.mark.parametrize(
    ("normalize", "hinted"), [(False, False), (False, True), (True, False)],
    ids=["sum", "sum_row_kernel", "normalized"])


def scaled_over_sequence(normalize: bool, dtype: DataType = BF16) -> FusionDefinition:
    """x [batch, seq, hidden] with a [batch, hidden] input g of columns per sample: (x -
    its mean over the sequence) * g (an outer normalization), or the sum over the sequence
    of x, times g (an outer reduction whose column epilogue reads g)."""
    with FusionDefinition(f"scaled_over_seq{'_norm' if normalize else ''}") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=dtype)
        g = fd.define_tensor([-1, -1], dtype=F)
        xf = fd.ops.cast(x, F)
        if normalize:
            wide = fd.ops.broadcast_in_dim(g, shape=x.shape(), broadcast_dims=[0, 2])
            mean = fd.ops.div(fd.ops.sum(xf, [1], keepdim=True), x.size(1))
            fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.sub(xf, mean), wide), dtype))
        else:
            fd.add_output(fd.ops.mul(fd.ops.sum(xf, [1]), g))
    return fd


@PER_GROUP_OFFLINE
def test_columns_per_group_are_read_at_the_groups_row(normalize, hinted):
    """A [batch, hidden] input beside reductions over the sequence: each kernel (the outer
    one, or the row kernel and the finalize that reads it in its column epilogue) moves its
    pointer to its group's row of columns."""
    from fuser.schedulers.base import OuterSchedule

    fd = scaled_over_sequence(normalize)
    info = analyze(fd.fusion)
    assert [t.name for t in info.group_columns] == ["T1"]
    report = explain(fd, [(8, 1024, 4096), (8, 4096)], device="h200",
                     hints=Hints(fused_finalize=False) if hinted else None)
    assert isinstance(report.schedule, OuterSchedule) is not hinted
    # the outer kernel's move, or the row kernel's and the finalize's
    assert report.source.count("g_T1 += group * H;") == (2 if hinted else 1)
    assert not any(r.spills for r in report.resources.values())


def _validated_on_gpu(fd: FusionDefinition, host: list, hints: Hints | None) -> None:
    """fd on the GPU against the float64 oracle: fd.validate, or through execute() with
    `hints` (which validate does not take)."""
    import cupy

    from fuser.executor import execute, to_host
    from fuser.reference import compare, input_sensitivity, output_reduction_sizes

    inputs = [cupy.asarray(a) for a in host]
    if hints is None:
        fd.validate(inputs)
        return
    outs = execute(fd, inputs, hints=hints)
    refs = evaluate(fd.fusion, host)
    compare([to_host(o) for o in outs], refs, fd.fusion, output_reduction_sizes(fd.fusion, host),
            input_sensitivity(fd.fusion, host, refs))



def tempered_over_sequence(normalize: bool, dtype: DataType = BF16) -> FusionDefinition:
    """x [batch, seq, hidden] with t [batch, 1] holding one value per sample: (x - its mean
    over the sequence) / t (an outer normalization), or the sum over the sequence of x / t
    (an outer reduction): t and 1 / t are read once per kernel, at the group's value."""
    with FusionDefinition(f"tempered_over_seq{'_norm' if normalize else ''}") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=dtype)
        t = fd.define_tensor([-1, 1], dtype=F)
        xf = fd.ops.cast(x, F)
        inv = fd.ops.reciprocal(fd.ops.broadcast_in_dim(t, shape=[x.size(0), 1, 1],
                                                        broadcast_dims=[0, 1]))
        wide = fd.ops.broadcast_in_dim(inv, shape=x.shape(), broadcast_dims=[0, 1, 2])
        if normalize:
            mean = fd.ops.div(fd.ops.sum(xf, [1], keepdim=True), x.size(1))
            fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.sub(xf, mean), wide), dtype))
        else:
            fd.add_output(fd.ops.sum(fd.ops.mul(xf, wide), [1]))
    return fd


@PER_GROUP_OFFLINE
def test_values_per_group_are_read_once_at_the_groups_value(normalize, hinted):
    """A [batch, 1] input beside reductions over the sequence is a value input of each
    group: every kernel moves its pointer to the group's value before its prologue reads it."""
    from fuser.schedulers.base import OuterSchedule

    fd = tempered_over_sequence(normalize)
    info = analyze(fd.fusion)
    assert [t.name for t in info.group_values] == ["T1"] and "one a group" in info.describe()
    report = explain(fd, [(8, 1024, 4096), (8, 1)], device="h200",
                     hints=Hints(fused_finalize=False) if hinted else None)
    assert isinstance(report.schedule, OuterSchedule) is not hinted
    source = report.source
    moved = source.index("g_T1 += group;")
    assert moved < source.index("fm::to_compute(g_T1[0])")
    # the outer kernel's move, or the row kernel's and the finalize's (which takes every
    # value input for its column epilogue)
    assert source.count("g_T1 += group;") == (2 if hinted else 1)
    assert not any(r.spills for r in report.resources.values())


def test_a_value_per_group_reduced_from_its_elements_runs_over_merged_axes():
    """x minus its total per sample: no group kernel holds the total, so the fusion runs as
    a row normalization over [batch, seq * hidden] (views of the same bytes)."""
    from fuser.explain import SegmentedExplanation

    with FusionDefinition("total_per_sample") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        total = fd.ops.sum(x, [1, 2], keepdim=True)
        fd.add_output(fd.ops.sub(x, fd.ops.broadcast_in_dim(total, shape=x.shape(),
                                                            broadcast_dims=[0, 1, 2])))
    with pytest.raises(UnsupportedFusionError):
        analyze(fd.fusion)
    report = explain(fd, [(8, 64, 256)], device="h100")
    assert isinstance(report, SegmentedExplanation)
    assert "merged into one axis" in str(report)


def test_an_output_of_one_value_per_group_is_refused_with_its_reason():
    with FusionDefinition("doubled_temperature") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=F)
        t = fd.define_tensor([-1, 1], dtype=F)
        fd.add_output(fd.ops.sum(x, [1]))
        per_sample = fd.ops.broadcast_in_dim(t, shape=[x.size(0), 1, 1], broadcast_dims=[0, 1])
        fd.add_output(fd.ops.mul(per_sample, 2.0))
    with pytest.raises(UnsupportedFusionError, match=r"T\d+ holds one value per group"):
        analyze(fd.fusion)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(2, 1, 7), (5, 9, 4099), (8, 1024, 4096), (3000, 8, 24)],
                         ids=str)
@pytest.mark.parametrize(("normalize", "hints"), [
    (False, None), (True, None), (False, Hints(fused_finalize=False))],
    ids=["sum", "normalized", "sum_row_kernel"])
@pytest.mark.parametrize("per_group", ["columns", "values"])
def test_gpu_inputs_per_group_match_the_oracle(per_group, normalize, hints, shape, dtype):
    """A [batch, hidden] input of columns per sample (scaled_over_sequence), or a [batch, 1]
    one of a value per sample (tempered_over_sequence), beside reductions over the sequence:
    the outer kernel, streamed or keeping the rows, and the hinted row kernel with its
    finalize, against the float64 oracle."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    if per_group == "columns":
        fd, other = scaled_over_sequence(normalize, dtype), (shape[0], shape[2])
    else:
        fd, other = tempered_over_sequence(normalize, dtype), (shape[0], 1)
    _validated_on_gpu(fd, [x, rng.uniform(0.5, 2.0, other).astype(np.float32)], hints)
