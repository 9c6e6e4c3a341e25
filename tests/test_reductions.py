"""The min, mean and var reductions (issue 15) next to sum and max: the float64 oracle against
torch's semantics written out with numpy (CPU), every reduction over every dtype rendered and
compiled offline for sm_90 (CPU), and the kernels against torch.amin / torch.var and the
oracle on the GPU (-m gpu)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_layout import assert_each_segment_compiles_without_spills

from fuser import DataType, DefinitionError, FusionDefinition, explain
from fuser.analysis import Kind, analyze
from fuser.device import DeviceSpec
from fuser.executor import segments_of
from fuser.ir import rounding_cast
from fuser.kernels import build
from fuser.lowering import lower
from fuser.ops import REDUCTIONS
from fuser.printer import python_definition
from fuser.reference import evaluate
from fuser.schedulers import Problem

BOOL, INT32, INT64 = DataType.Bool, DataType.Int32, DataType.Int64
BF16, FLOAT, DOUBLE = DataType.BFloat16, DataType.Float, DataType.Double
H200 = DeviceSpec.get("h200")


def _values(dtype: DataType, shape=(5, 7)) -> np.ndarray:
    rng = np.random.default_rng(11)
    if dtype is BOOL:
        return rng.random(shape) < 0.5
    if dtype.is_float:
        return (rng.standard_normal(shape) * 3).astype(dtype.numpy)
    info = np.iinfo(dtype.numpy)
    x = rng.integers(-1000, 1000, shape).astype(dtype.numpy)
    x[0, 0], x[-1, -1] = info.min, info.max  # the identities' neighbours are values too
    return x


def _reduction_fusion(op: str, dtype: DataType) -> FusionDefinition:
    with FusionDefinition(f"{op}_{dtype.name}") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        fd.add_output(getattr(fd.ops, op)(x, [1]))
        fd.add_output(getattr(fd.ops, op)(x, [0], keepdim=True))
    return fd


@pytest.mark.parametrize("dtype", [BOOL, INT32, INT64, FLOAT, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_oracle_reductions_follow_torch_types_and_values(op, dtype):
    """sum of bools and ints is Int64 (torch.sum); max / min keep the dtype (torch.amax)."""
    x = _values(dtype)
    fd = _reduction_fusion(op, dtype)
    rows, columns = evaluate(fd.fusion, [x])
    numpy_op = {"sum": np.sum, "max": np.max, "min": np.min}[op]
    wide = x.astype(np.int64) if op == "sum" and not dtype.is_float else x
    expected_dtype = INT64 if op == "sum" and not dtype.is_float else dtype
    assert [t.dtype for t in fd.fusion.outputs] == [expected_dtype, expected_dtype]
    np.testing.assert_allclose(rows, numpy_op(wide, axis=1), rtol=1e-6)
    np.testing.assert_allclose(columns, numpy_op(wide, axis=0, keepdims=True), rtol=1e-6)


def test_oracle_min_and_max_propagate_nan():
    x = np.array([[1.0, np.nan, -2.0], [np.inf, 0.0, -np.inf]])
    for op, expected in (("min", [np.nan, -np.inf]), ("max", [np.nan, np.inf])):
        rows, _ = evaluate(_reduction_fusion(op, DOUBLE).fusion, [x])
        np.testing.assert_array_equal(rows, expected)


@pytest.mark.parametrize("correction", [0, 1, 2, 6, 7, 100])
@pytest.mark.parametrize("keepdim", [False, True])
def test_oracle_var_divides_by_n_minus_correction_clamped_at_zero(correction, keepdim):
    """torch.var: sum of squared deviations / max(n - correction, 0), so inf at or past n, and
    nan where every value of a row is equal; var alone is var_mean's first output."""
    x = np.random.default_rng(5).standard_normal((4, 7))
    x[3] = 2.5  # a constant row
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1], dtype=DOUBLE)
        fd.add_output(fd.ops.var(t, [1], correction=correction, keepdim=keepdim))
        fd.add_output(fd.ops.var_mean(t, [1], correction=correction, keepdim=keepdim)[0])
    var, var_of_var_mean = evaluate(fd.fusion, [x])
    squares = ((x - x.mean(axis=1, keepdims=True)) ** 2).sum(axis=1, keepdims=keepdim)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = squares / max(7 - correction, 0)
    np.testing.assert_allclose(var, expected, rtol=1e-13)
    np.testing.assert_array_equal(var, var_of_var_mean)
    assert "var(T0, dims=[1], correction=" in repr(fd)


def test_var_refuses_ints_and_bad_corrections():
    from fuser import DefinitionError

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=INT32)
        with pytest.raises(DefinitionError, match=r"var: T0 has dtype .*Int32; cast it"):
            fd.ops.var(x, [1])
        y = fd.define_tensor([-1, -1], dtype=FLOAT)
        with pytest.raises(DefinitionError, match=r"var\(T1\): correction must be an int"):
            fd.ops.var(y, [1], correction=0.5)
        fd.add_output(fd.ops.var(y, [1]))


def _means(dtype: DataType, shape: list[int]) -> FusionDefinition:
    """torch.mean as users write it: along the last axis (keepdim, subtracted from x: a row
    kernel), over the leading ones (a column mean) and over every axis."""
    with FusionDefinition(f"means_{dtype.name}") as fd:
        x = fd.define_tensor(shape, dtype=dtype)
        fd.add_output(fd.ops.sub(x, fd.ops.mean(x, [-1], keepdim=True)))
        fd.add_output(fd.ops.mean(x, list(range(len(shape) - 1))))
        fd.add_output(fd.ops.mean(x, list(range(len(shape)))))
    return fd


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dims", [[1], [0, 2], [-1, 0, 1]])
def test_oracle_mean_is_the_sum_over_the_count_in_the_input_type(dims, keepdim):
    """torch.mean: numpy's mean of the float64 values, in the input's type (a BFloat16 mean is
    rounded once, from the exact one), and the lowered fusion (a sum, then a division by the
    product of the reduced sizes) gives the same."""
    x = _values(BF16, (3, 5, 7))
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1, -1, -1], dtype=BF16)
        fd.add_output(fd.ops.mean(t, dims, keepdim=keepdim))
    (got,) = evaluate(fd.fusion, [x])
    axes = tuple(d % 3 for d in dims)
    exact = x.astype(np.float64).mean(axis=axes, keepdims=keepdim)
    np.testing.assert_array_equal(got, exact.astype(BF16.numpy).astype(np.float64))
    (lowered,) = evaluate(lower(fd.fusion), [x])
    np.testing.assert_allclose(lowered, got, rtol=2.0 ** -7)
    assert f"mean(T0, dims={sorted(axes)}, keepdim={keepdim})" in repr(fd)
    assert "fd.ops.mean(" in python_definition(fd.fusion)


def test_mean_refuses_ints_and_empty_dims():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=INT64)
        with pytest.raises(DefinitionError, match=r"mean: T0 has dtype .*Int64; cast it"):
            fd.ops.mean(x, [1])
        y = fd.define_tensor([-1, -1], dtype=FLOAT)
        with pytest.raises(DefinitionError, match=r"mean\(T1\): dims is empty"):
            fd.ops.mean(y, [])
        fd.add_output(fd.ops.mean(y, 1))


@pytest.mark.parametrize("dtype", [BF16, FLOAT, DOUBLE], ids=lambda d: d.name)
def test_means_compile_without_spills(dtype):
    """_means' segments (a row kernel, a column mean, a full one) each build for sm_90."""
    segmentation = segments_of(_means(dtype, [-1, -1]))
    assert len(segmentation.segments) == 3, segmentation
    assert_each_segment_compiles_without_spills(segmentation.segments)


@pytest.mark.parametrize("dtype", [BOOL, INT32, INT64, BF16, FLOAT, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_every_reduction_compiles_for_every_dtype(op, dtype):
    """Inner and outer reductions of each dtype render and compile for sm_90 without spills
    (the identities: 0, lowest, highest of bool, int, long long, float and double)."""
    fd = _reduction_fusion(op, dtype)
    built = build(fd.name, analyze(fd.fusion), Problem(4096, 1000, 16), H200)
    for entry, _plan in built.plans():
        assert not built.compiled.resource(entry).spills


# ----- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BOOL, INT32, INT64, BF16, FLOAT, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 7, 4096, 24578])
@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_gpu_reductions_match_torch(op, hidden, dtype, has_torch_cuda):
    """Over rows and over columns, against torch.sum / amax / amin on the same device tensor."""
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    host = _values(dtype, (64, hidden))
    if dtype is BF16:  # torch.from_numpy takes no ml_dtypes.bfloat16 (exact via float32)
        x = torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16).cuda()
    else:
        x = torch.from_numpy(host).cuda()
    rows, columns = _reduction_fusion(op, dtype).execute([x])
    reference = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[op]
    for got, expected in ((rows, reference(x, dim=1)),
                          (columns, reference(x, dim=0, keepdim=True))):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        if dtype.is_float and op == "sum":
            tolerance = 2e-2 if dtype is BF16 else 1e-5
            torch.testing.assert_close(got.double(), expected.double(), rtol=tolerance,
                                       atol=tolerance * 8)
        else:
            assert torch.equal(got, expected), (got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FLOAT, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 2, 1000, 24578])
@pytest.mark.parametrize("correction", [0, 1, 2])
def test_gpu_var_matches_torch(correction, hidden, dtype, has_torch_cuda):
    """Rows of mean 100 (the two-pass form keeps them exact), one row constant; corrections at
    or past n give inf (nan for the constant row) as torch.var does."""
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    tdtype = {BF16: torch.bfloat16, FLOAT: torch.float32, DOUBLE: torch.float64}[dtype]
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(32, hidden, generator=g, dtype=torch.float64) + 100).to(tdtype)
    x[5] = 3.0
    x = x.cuda()
    with FusionDefinition("var") as fd:
        t = fd.define_tensor([-1, -1], dtype=dtype)
        fd.add_output(fd.ops.var(t, [1], correction=correction))
    (got,) = fd.execute([x])
    expected = torch.var(x.double(), dim=1, correction=correction).to(tdtype)
    torch.testing.assert_close(got.double(), expected.double(), rtol=2e-2 if dtype is BF16
                               else 1e-4, atol=1e-6, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FLOAT, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (1000, 4099), (3, 7, 24578)], ids=str)
def test_gpu_means_match_the_oracle(shape, dtype):
    """Each of _means' outputs against the float64 oracle (fd.validate's tolerances)."""
    import cupy

    fd = _means(dtype, [-1] * len(shape))
    fd.validate([cupy.asarray(_values(dtype, shape))])


def _scaled_minus_its_extreme(op: str, dim: int, dtype: DataType) -> FusionDefinition:
    """y - max(y) (or min) along `dim`, y = x / t * s with s and t per row (dim 1) or per
    column (dim 0): a product the compiler would contract into fma(x / t, s, -max) where the
    extreme is subtracted (x / t by a row value is a product too, by its reciprocal)."""
    with FusionDefinition(f"scaled_minus_{op}") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        shape = [-1, 1] if dim == 1 else [1, -1]
        s = fd.define_tensor(shape, dtype=dtype)
        t = fd.define_tensor(shape, dtype=dtype)
        y = fd.ops.mul(fd.ops.div(x, t), s)
        fd.add_output(fd.ops.sub(y, getattr(fd.ops, op)(y, [dim], keepdim=True)))
    return fd


@pytest.mark.parametrize("dim", [1, 0])
def test_what_a_max_reduces_is_rounded_alike_in_every_pass(dim):
    """The value a max or min reduces is computed again in each pass; its product is emitted
    as __fmul_rn everywhere (never contracted into an FMA with what uses it), so y - max(y)
    is exactly 0 at the maximum and nowhere above it. GPU fuzz seed 4049 shard 18: tanh(y -
    max(y)) > 0 at a few elements of 13 rows of 64. A product that only a sum reads is left to
    the compiler."""
    fd = _scaled_minus_its_extreme("max", dim, FLOAT)
    scale = (300, 1) if dim == 1 else (1, 1000)
    shapes = [(300, 1000), scale, scale]
    source = explain(fd, shapes, device="h200").source
    products = [line for line in source.splitlines() if re.search(r"const float \w+_T4 = ", line)]
    assert len(products) >= 2 and all("__fmul_rn(" in line for line in products), products
    with FusionDefinition("sum_of_product") as summed:
        x = summed.define_tensor([-1, -1], dtype=FLOAT)
        s = summed.define_tensor([-1, 1], dtype=FLOAT)
        y = summed.ops.mul(x, s)
        summed.add_output(summed.ops.sub(y, summed.ops.sum(y, [1], keepdim=True)))
    assert "__fmul_rn" not in explain(summed, [(300, 1000), (300, 1)], device="h200").source


def _minus_its_own_max(dtype: DataType, cast_first: bool) -> FusionDefinition:
    """y - max(y) over y's axis of size 1, y = 1.5 x computed in y's type: zero unless the
    max (or a cast before it, with `cast_first`) rounds y."""
    with FusionDefinition("minus_max") as fd:
        x = fd.define_tensor([-1, 1], dtype=dtype)
        y = fd.ops.mul(x, 1.5)
        z = fd.ops.cast(y, dtype) if cast_first else y
        fd.add_output(fd.ops.sub(y, fd.ops.max(z, [1], keepdim=True, dtype=dtype)))
    return fd


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half])
def test_a_reduction_over_size_1_axes_does_not_round_its_result(dtype):
    """A Half or BFloat16 reduction's result is the float the kernel accumulates, over a row
    or over one element: the size-1 case lowers to a cast with rounds=False (no round_bf16 /
    round_half in the kernel), while a user's own cast still rounds. The GPU fuzz found the
    kernel rounding where the oracle did not (y - max(y) of 0.0337 instead of 0)."""
    fd = _minus_its_own_max(dtype, cast_first=False)
    lowered = lower(fd.fusion)
    casts = [e for e in lowered.exprs if e.op == "cast"]
    assert len(casts) == 1 and not rounding_cast(casts[0])
    assert "rounds=False" in python_definition(lowered)
    assert "fm::round_" not in explain(fd, [(64, 1)], [dtype]).source
    x = (np.arange(64, dtype=np.float64).reshape(64, 1) / 7 + 1).astype(dtype.numpy)
    np.testing.assert_array_equal(evaluate(fd.fusion, [x])[0].astype(np.float64), 0)
    rounded = _minus_its_own_max(dtype, cast_first=True)
    assert "fm::round_" in explain(rounded, [(64, 1)], [dtype]).source
    assert np.any(evaluate(rounded.fusion, [x])[0].astype(np.float64) != 0)


def test_cast_rounds_takes_a_bool_and_survives_the_printed_definition():
    """fd.ops.cast(..., rounds=False) is printed as written, so repr(fd) rebuilds the same
    fusion; any other value than True or False is a DefinitionError naming it."""
    with FusionDefinition("unrounded") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.cast(fd.ops.mul(x, 3.0), DataType.BFloat16, rounds=False))
    assert "rounds=False" in repr(fd)
    namespace: dict = {}
    exec(repr(fd), {"FusionDefinition": FusionDefinition, "DataType": DataType}, namespace)
    assert repr(namespace["fd"]) == repr(fd)
    with FusionDefinition("bad") as bad:
        x = bad.define_tensor([-1, -1], dtype=DataType.Float)
        with pytest.raises(DefinitionError, match=r"rounds must be True or False, got 'no'"):
            bad.ops.cast(x, DataType.Half, rounds="no")
        bad.add_output(bad.ops.neg(x))


def test_ops_no_output_depends_on_are_left_out_of_the_kernel():
    """A variance, a max and a row min that no output uses are not lowered: the kernel of
    the column min alone is an outer reduction with no row reductions (the GPU fuzz's
    kernel had reduced and exchanged all of them), and the oracle skips them too."""
    with FusionDefinition("dead") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        fd.ops.var(x, [1], correction=1)
        fd.ops.max(x, [0])
        fd.ops.min(x, [1])
        fd.add_output(fd.ops.min(x, [0]))
    info = analyze(fd.fusion)
    assert info.kind is Kind.OUTER and not info.inner_levels
    assert [e.op for e in info.fusion.exprs] == ["min"]


def test_a_reduction_over_size_1_axes_is_each_element_on_its_own():
    """torch.sum(x, dim) along an axis of size 1 (a keepdim statistic, a [R, 1] column): each
    element its own result, a cast to the result's type (squeezed unless keepdim), so one
    kernel runs it; var of one element is 0 (nan with a correction of 1, as torch)."""
    with FusionDefinition("kept") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        rows = fd.ops.sum(x, [1], keepdim=True)
        fd.add_output(fd.ops.sum(rows, [1]))
        fd.add_output(fd.ops.max(rows, [1], keepdim=True))
        fd.add_output(fd.ops.var(rows, [1], correction=0, keepdim=False))
    assert analyze(fd.fusion).kind is Kind.INNER
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(DataType.BFloat16.numpy)
    total, peak, var = evaluate(fd.fusion, [x])
    want = x.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(total.astype(np.float64), want, rtol=2.0 ** -8)  # in bf16
    np.testing.assert_allclose(peak.astype(np.float64), want.reshape(5, 1), rtol=2.0 ** -8)
    assert total.shape == (5,) and peak.shape == (5, 1) and np.all(var == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half])
def test_a_reduction_over_size_1_axes_does_not_round_on_the_gpu(dtype):
    """y - max(y) over y's axis of size 1 is exactly 0 from the kernel too."""
    import cupy

    x = (np.arange(1000, dtype=np.float64).reshape(1000, 1) / 7 + 1).astype(dtype.numpy)
    (got,) = _minus_its_own_max(dtype, cast_first=False).execute([cupy.asarray(x)])
    np.testing.assert_array_equal(cupy.asnumpy(got).astype(np.float64), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FLOAT, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1000, 4099, 24578])
@pytest.mark.parametrize("op,dim", [("max", 1), ("min", 1), ("max", 0)])
def test_gpu_what_a_max_reduces_is_rounded_alike_in_every_pass(op, dim, hidden, dtype):
    """y - max(y) <= 0 everywhere and == 0 somewhere in each row (column), y = x / t * s (min:
    >= 0): with the product contracted into the subtraction the maximum came out a rounding
    above 0 in about half the rows."""
    import cupy

    rows = 300 if dim == 1 else 64
    rng = np.random.default_rng(hidden)
    shape = (rows, 1) if dim == 1 else (1, hidden)
    x, s, t = (rng.standard_normal(size).astype(np.float32).astype(dtype.numpy)
               for size in ((rows, hidden), shape, shape))
    fd = _scaled_minus_its_extreme(op, dim, dtype)
    (d,) = fd.execute([cupy.asarray(a) for a in (x, s, t)])
    d = cupy.asnumpy(d).astype(np.float64)
    beyond = d > 0 if op == "max" else d < 0
    assert not beyond.any(), (np.argwhere(beyond)[:8], d[beyond][:8])
    assert (d == 0).any(axis=dim).all()
