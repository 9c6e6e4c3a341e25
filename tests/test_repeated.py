"""Inputs that span a run of the row axes only, read repeated by one kernel (analysis.RowRun):
adaLN's [batch, hidden] scale and shift over rows [batch, seq], a [q, k] mask over scores
[batch, heads, q, k], a [seq, hidden] table over [batch, seq, hidden], a [C] weight over NCHW
rows [N, C, H]. Before, each was copied broadcast to the full shape between kernels.

CPU: the run each input spans, the kernel parameters and the launch values from the shapes,
skewed rows refused beside a repeated input (hinted: a HintError that says why), every
storage of a repeated row buffer rendered and compiled without spills, and what still
cannot be read repeated (an output of some row axes, an outer reduction's column kernels)
segmented with the input copied broadcast. GPU (`gpu` marker): fd.validate() against the
float64 oracle at odd and large shapes in bf16, fp16 and fp32, in every storage the hints
allow, with CuPy and torch arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_layout import assert_chained_matches_the_oracle
from test_reorder import _nd_fusion, _weight_shape, nd_fusions

from bench import nd
from fuser import (
    DataType,
    FusionDefinition,
    HintError,
    UnsupportedFusionError,
    executor,
    explain,
)
from fuser.analysis import analyze
from fuser.executor import repeated_rows, segments_of
from fuser.explain import SegmentedExplanation
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes
from fuser.schedulers import Hints
from fuser.schedulers.base import Storage
from fuser.segment import segment
from fuser.shapes import bind_shapes
from fuser.signature import Source, row_signature

F, F16, BF16 = DataType.Float, DataType.Half, DataType.BFloat16
_bcast = nd.broadcast_like


def masked_fill(fd, dtype=BF16):
    """Scores [batch, heads, q, k] where a [q, k] mask holds, else 0 (pointwise: the mask's
    row for kernel row r is r % q)."""
    s = fd.define_tensor([-1, -1, -1, -1], dtype=dtype)
    m = fd.define_tensor([-1, -1], dtype=DataType.Bool)
    fd.add_output(fd.ops.where(_bcast(fd, m, s, [2, 3]), s, 0.0))



def positions_added(fd, dtype=BF16):
    """[batch, seq, hidden] plus a [seq, hidden] table (position embeddings)."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    p = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.cast(x, F), _bcast(fd, p, x, [1, 2])), dtype))



def positions_normalized(fd, dtype=BF16):
    """[batch, seq, hidden] plus a [seq, hidden] table, then LayerNorm along hidden."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    p = fd.define_tensor([-1, -1])
    h = fd.ops.add(fd.ops.cast(x, F), _bcast(fd, p, x, [1, 2]))
    var, mean = fd.ops.var_mean(h, [2], correction=0, keepdim=True)
    fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.sub(h, mean),
                                         fd.ops.rsqrt(fd.ops.add(var, 1e-5))), dtype))



def modulated_rmsnorm_aligned(fd, dtype=BF16):
    """adaLN as users write it with numpy's alignment: RMSNorm of [batch, seq, hidden], then
    * (1 + scale) + shift with scale and shift [batch, 1, hidden] met by mul and add, and a
    [seq, hidden] table added first, no broadcast_in_dim anywhere."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    table = fd.define_tensor([-1, -1])
    scale = fd.define_tensor([-1, 1, -1])
    shift = fd.define_tensor([-1, 1, -1])
    h = fd.ops.add(fd.ops.cast(x, F), table)
    ms = fd.ops.div(fd.ops.sum(fd.ops.mul(h, h), [2], keepdim=True), x.size(2))
    y = fd.ops.mul(h, fd.ops.rsqrt(fd.ops.add(ms, 1e-6)))
    y = fd.ops.add(fd.ops.mul(y, fd.ops.add(scale, 1.0)), shift)
    fd.add_output(fd.ops.cast(y, dtype))


def modulated_rmsnorm_column_sums(fd, dtype=BF16):
    """RMSNorm of [batch, seq, hidden] times (1 + scale), scale [batch, hidden], and the sums
    over every row of the result (a bias gradient's shape): an inner and an outer reduction,
    the scale read repeated by the row kernel that feeds the column sums."""
    x = fd.define_tensor([-1, -1, -1], dtype=dtype)
    scale = fd.define_tensor([-1, -1])
    xf = fd.ops.cast(x, F)
    ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), [2], keepdim=True), x.size(2))
    y = fd.ops.mul(fd.ops.mul(xf, fd.ops.rsqrt(fd.ops.add(ms, 1e-6))),
                   fd.ops.add(_bcast(fd, scale, x, [0, 2]), 1.0))
    fd.add_output(fd.ops.cast(y, dtype))
    fd.add_output(fd.ops.sum(y, [0, 1]))


# builder -> (the run each repeated input spans, kernel kind, odd shapes, large shapes)
CASES = {
    "modulated_layernorm": (nd.modulated_layernorm, {"T1": (0, 1), "T2": (0, 1)}, "inner",
                            [(3, 7, 1000), (3, 1000), (3, 1000)],
                            [(8, 1024, 4096), (8, 4096), (8, 4096)]),
    "masked_softmax": (nd.masked_softmax, {"T1": (2, 3)}, "inner",
                       [(2, 3, 7, 9), (7, 9)], [(2, 16, 1024, 1024), (1024, 1024)]),
    "channel_scale": (nd.channel_scale, {"T1": (1, 2)}, "pointwise",
                      [(3, 5, 7, 9), (5,)], [(32, 64, 56, 56), (64,)]),
    "masked_fill": (masked_fill, {"T1": (2, 3)}, "pointwise",
                    [(2, 3, 7, 9), (7, 9)], [(4, 16, 1024, 1024), (1024, 1024)]),
    "positions_added": (positions_added, {"T1": (1, 2)}, "pointwise",
                        [(3, 7, 1000), (7, 1000)], [(8, 1024, 4096), (1024, 4096)]),
    "positions_normalized": (positions_normalized, {"T1": (1, 2)}, "inner",
                             [(3, 7, 1000), (7, 1000)], [(8, 1024, 4096), (1024, 4096)]),
    "modulated_rmsnorm_column_sums": (modulated_rmsnorm_column_sums, {"T1": (0, 1)},
                                      "inner + outer", [(3, 7, 1000), (3, 1000)],
                                      [(8, 1024, 4096), (8, 4096)]),
    "modulated_rmsnorm_aligned": (
        modulated_rmsnorm_aligned, {"T1": (1, 2), "T2": (0, 1), "T3": (0, 1)}, "inner",
        [(3, 7, 1000), (7, 1000), (3, 1, 1000), (3, 1, 1000)],
        [(8, 1024, 4096), (1024, 4096), (8, 1, 4096), (8, 1, 4096)]),
}


def _fd(name: str, dtype=BF16) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        CASES[name][0](fd, dtype)
    return fd


def _inputs(fd: FusionDefinition, shapes, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for v, shape in zip(fd.fusion.inputs, shapes, strict=True):
        if v.dtype is DataType.Bool:
            arrays.append(nd.mask(rng, shape))
        else:
            arrays.append(rng.standard_normal(shape).astype(np.float32).astype(v.dtype.numpy))
    return arrays


@pytest.mark.parametrize("name", list(CASES))
def test_each_narrow_input_is_read_repeated_by_one_kernel(name):
    """No segmentation, no copy: the run of the row axes each narrow input spans."""
    fd = _fd(name)
    info = analyze(fd.fusion)
    assert {t.name: (r.first, r.stop) for t, r in info.repeated} == CASES[name][1]
    assert CASES[name][2] in info.kind.value
    assert segments_of(fd) is None
    assert "repeated inputs:" in info.describe()


def test_the_launch_passes_each_run_as_the_rows_after_it_and_its_count():
    """adaLN over [8, 1024, 4096]: the scale's row for kernel row r is r / 1024 (% 8); a
    [q, k] mask over [2, 16, 1024, 1024]: r % 1024 (the rows after it: 1)."""
    for name, shapes, want in (("modulated_layernorm", CASES["modulated_layernorm"][4],
                                (1024, 8, 1024, 8)),
                               ("masked_softmax", CASES["masked_softmax"][4], (1, 1024))):
        info = analyze(_fd(name).fusion)
        assert repeated_rows(info, bind_shapes(info.fusion, shapes)) == want
        params = [p for p in row_signature(info, "k", False).params
                  if p.source is Source.ROW_REPEATS]
        assert [(p.index, p.type) for p in params] == [(i, "long long") for i in range(len(want))]
    report = str(explain(_fd("modulated_layernorm"), CASES["modulated_layernorm"][4]))
    assert "repeated: T1 (1 of 2 row axes) row (r / 1024) % 8 for kernel row r" in report


def test_skewed_rows_are_refused_beside_a_repeated_input():
    """A repeated row starts at a skew of its own: skewed=True names the input."""
    fd = _fd("modulated_layernorm")
    with pytest.raises(HintError, match=r"no input repeated along some row axes.*T1"):
        explain(fd, [(3, 7, 4099), (3, 4099), (3, 4099)], device="h200",
                hints=Hints(skewed=True))


STORAGES = [Storage.REGISTERS, Storage.SMEM, Storage.GLOBAL, Storage.RING]


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s.value)
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2].startswith("inner")])
def test_a_repeated_row_in_each_storage_compiles_without_spills(name, storage):
    fd = _fd(name)
    hints = Hints(storage=tuple((t, storage) for t in CASES[name][1]))
    report = explain(fd, CASES[name][4], device="h200", hints=hints)
    assert "fm::RepeatedRows" in report.source
    for resource in report.resources.values():
        assert resource.spill_stores == resource.spill_loads == 0, resource


def test_an_output_of_some_row_axes_is_refused_by_a_kernel_and_segmented():
    """A value of the scale alone as an output would be written once per row of seq: no
    kernel takes the fusion, the segmentation runs it (another order of the axes) and its
    chain equals the oracle."""
    with FusionDefinition("scale_out") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=BF16)
        scale = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(fd.ops.cast(x, F), _bcast(fd, scale, x, [0, 2])))
        fd.add_output(fd.ops.mul(scale, 2.0))
    with pytest.raises(UnsupportedFusionError, match="spans 1 of the 2 row dimensions") as refused:
        analyze(fd.fusion)
    assert segment(fd.fusion, fd.name, refused.value).layouts
    assert_chained_matches_the_oracle(fd, _inputs(fd, [(3, 7, 5), (3, 5)]), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, F16, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("size", ["odd", "large"])
@pytest.mark.parametrize("name", list(CASES))
def test_repeated_inputs_match_the_oracle_on_the_gpu(name, size, dtype):
    import cupy

    fd = _fd(name, dtype)
    shapes = CASES[name][3 if size == "odd" else 4]
    fd.validate([cupy.asarray(a) for a in _inputs(fd, shapes)])
    assert "fm::RepeatedRows" in fd.last_cuda_code()


@pytest.mark.gpu
@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s.value)
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2].startswith("inner")])
def test_a_repeated_row_in_each_storage_matches_the_oracle_on_the_gpu(name, storage):
    import cupy

    fd = _fd(name)
    hints = Hints(storage=tuple((t, storage) for t in CASES[name][1]))
    for shapes in (CASES[name][3], CASES[name][4]):
        host = _inputs(fd, shapes)
        if storage is Storage.RING and shapes[1][-1] * min(a.itemsize for a in host) % 4:
            with pytest.raises(HintError, match="no staging ring for T1"):
                executor.execute(fd, [cupy.asarray(a) for a in host], hints=hints)
            continue
        outs = executor.execute(fd, [cupy.asarray(a) for a in host], hints=hints)
        want = evaluate(fd.fusion, host)
        compare([executor.to_host(o) for o in outs], want, fd.fusion,
                output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, want))
        assert "fm::RepeatedRows" in fd.last_cuda_code()


@pytest.mark.gpu
def test_adaln_matches_torch(has_torch_cuda):
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    x = torch.randn(4, 333, 2048, device="cuda").bfloat16()
    scale, shift = torch.randn(4, 2048, device="cuda"), torch.randn(4, 2048, device="cuda")
    (y,) = _fd("modulated_layernorm").execute([x, scale, shift])
    want = nd.CASES["modulated_layernorm"].eager(x, scale, shift)[0]
    torch.testing.assert_close(y.float(), want.float(), atol=3e-2, rtol=3e-2)


# ----- random N-D fusions (test_reorder's generator) that one kernel takes -----


def _random(case, widen: int = 1):
    """The fusion of a drawn case, its input shapes (the last axis `widen` times longer),
    and its analysis, or None where no one kernel takes it (the segmentation's business)."""
    shape, weight, combine, reduced, op, keepdim = case
    shape = (*shape[:-1], shape[-1] * widen)
    fd = _nd_fusion(weight, combine, reduced, op, keepdim, len(shape))
    shapes = [shape] + ([_weight_shape(weight, combine, shape)] if weight is not None else [])
    try:
        return fd, shapes, analyze(fd.fusion)
    except UnsupportedFusionError:
        return fd, shapes, None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nd_fusions())
def test_random_nd_fusions_one_kernel_takes_compile_without_spills(case):
    """Every drawn fusion one kernel takes, repeated inputs and all, builds for the H200
    without spills, and reads its repeated inputs through fm::RepeatedRows."""
    fd, shapes, info = _random(case, widen=173)
    if info is None:
        return
    reports = _leaves(explain(fd, shapes, device="h200"))
    for report in reports:
        for resource in report.resources.values():
            assert resource.spill_stores == resource.spill_loads == 0, (resource, repr(fd))
    if info.repeated:
        assert all("fm::RepeatedRows" in r.source for r in reports), repr(fd)


def _leaves(report) -> list:
    """The Explanations of a report's kernels (an outer normalization whose columns do not
    fit runs as segments: theirs)."""
    if isinstance(report, SegmentedExplanation):
        return [leaf for part in report.parts for leaf in _leaves(part)]
    return [report]


@pytest.mark.gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nd_fusions())
def test_random_nd_fusions_one_kernel_takes_match_the_oracle_on_the_gpu(case):
    import cupy

    fd, shapes, info = _random(case, widen=173)
    if info is None:
        return
    fd.validate([cupy.asarray(a) for a in _inputs(fd, shapes)])


@st.composite
def repeated_fusions(draw):
    """(dtype, shape, the axes of a second input: a run of the row axes, with or without the
    last axis, combining op, reduction along the last axis or None): built by _repeated_fusion.
    Odd and size-1 row axes, rows of 1 to 4099 elements."""
    rank = draw(st.sampled_from((3, 4)))
    rows = draw(st.lists(st.integers(1, 7), min_size=rank - 1, max_size=rank - 1))
    shape = (*rows, draw(st.sampled_from((1, 3, 8, 1000, 4099))))
    first = draw(st.integers(0, rank - 2))
    stop = draw(st.integers(first + 1, rank - 1 if first else rank - 2))  # not every row axis
    dims = [*range(first, stop), *([rank - 1] if draw(st.booleans()) else [])]
    combine = draw(st.sampled_from(("add", "mul", "where")))
    reduction = draw(st.sampled_from((None, "sum", "max")))
    return draw(st.sampled_from((F, F16, BF16))), shape, dims, combine, reduction


def _repeated_fusion(dtype, shape, dims, combine, reduction):
    """x (dtype) combined with a float32 input of `dims` broadcast over it (added, multiplied
    or, where that input is positive, kept), then normalized along the last axis by the
    reduction (subtracted) or passed through exp; the input's shape."""
    rank = len(shape)
    with FusionDefinition("repeated") as fd:
        x = fd.define_tensor([-1] * rank, dtype=dtype)
        w = fd.define_tensor([-1] * len(dims))
        xf, wb = fd.ops.cast(x, F), _bcast(fd, w, x, dims)
        if combine == "where":
            v = fd.ops.where(fd.ops.gt(wb, 0.0), xf, 0.0)
        else:
            v = getattr(fd.ops, combine)(xf, wb)
        if reduction is None:
            y = fd.ops.exp(v)
        else:
            y = fd.ops.sub(v, getattr(fd.ops, reduction)(v, [rank - 1], keepdim=True))
        fd.add_output(fd.ops.cast(y, dtype))
    return fd, [shape, tuple(shape[d] for d in dims)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repeated_fusions())
def test_random_repeated_inputs_are_one_kernel_and_compile_without_spills(case):
    fd, shapes = _repeated_fusion(*case)
    info = analyze(fd.fusion)
    assert [t.name for t, _ in info.repeated] == ["T1"], repr(fd)
    report = explain(fd, shapes, device="h200")
    assert "fm::RepeatedRows" in report.source
    for resource in report.resources.values():
        assert resource.spill_stores == resource.spill_loads == 0, (resource, repr(fd))


def test_a_select_on_a_repeated_row_value_compiles_without_spills():
    """exp(x where a repeated per-row value is positive, else 0) at rows of 3: its vectors
    cross rows, and ptxas 13.5 kept one in local memory at four vectors a round (24 B of
    spills; Hypothesis found it). The build takes the pointwise scheduler's second schedule,
    one vector a round, where the first spills."""
    fd, shapes = _repeated_fusion(BF16, (1, 3, 3), [0], "where", None)
    report = explain(fd, shapes, device="h200")
    assert report.schedule.across_rows and report.schedule.unroll in (4, 1), report.schedule
    assert ("(4 spilled registers)" in report.schedule.reason) == (report.schedule.unroll == 1)
    for resource in report.resources.values():
        assert resource.spill_stores == resource.spill_loads == 0, resource


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 3, 3), (7, 5, 3), (3, 1000, 7)])
def test_a_select_on_a_repeated_row_value_matches_the_oracle_on_the_gpu(shape):
    """The case above on the GPU, at rows that fill several rounds of the kernel's loop."""
    import cupy

    fd, shapes = _repeated_fusion(BF16, shape, [0], "where", None)
    fd.validate([cupy.asarray(a) for a in _inputs(fd, shapes)])


@pytest.mark.gpu
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repeated_fusions())
def test_random_repeated_inputs_match_the_oracle_on_the_gpu(case):
    import cupy

    fd, shapes = _repeated_fusion(*case)
    fd.validate([cupy.asarray(a) for a in _inputs(fd, shapes)])
