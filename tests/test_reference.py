"""The float64 oracle against formulas derived by hand, its input checks, tolerances and compare."""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest

from fuser import BadInputError, DataType, DefinitionError, FusionDefinition, ValidationError
from fuser.ops import ELEMENTWISE
from fuser.reference import (
    compare,
    evaluate,
    output_reduction_sizes,
    precision,
    stored,
    tolerance,
)
from fuser.shapes import bind_shapes

BF16, HALF, FLOAT, DOUBLE = DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double
INT32, INT64, BOOL = DataType.Int32, DataType.Int64, DataType.Bool
bf16 = ml_dtypes.bfloat16


def close(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def in_f32(x):
    """`x` rounded to float32, in float64: what a Float output or a cast to Float holds."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


# ----- whole fusions against hand-derived formulas ----------------------------------------------


def rmsnorm(dtype=DOUBLE, eps=1e-6):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        w = fd.define_tensor([-1], dtype=dtype)
        xf = fd.ops.cast(x, FLOAT)
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), [1], keepdim=True), x.size(1))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, eps))
        y = fd.ops.mul(fd.ops.mul(xf, rstd), fd.ops.broadcast_in_dim(w, x.shape(), [1]))
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


def test_rmsnorm_forward(rng):
    x, w = rng.standard_normal((5, 33)), rng.standard_normal(33)
    (y,) = evaluate(rmsnorm().fusion, [x, w])
    xf = in_f32(x)  # the fusion casts x to Float: rounded to float32, then computed exactly
    close(y, xf / np.sqrt(np.mean(xf**2, axis=1, keepdims=True) + 1e-6) * w)
    assert y.dtype == np.float64


def test_rmsnorm_forward_bf16_is_computed_in_float64_and_rounded_once(rng):
    x = rng.standard_normal((4, 64)).astype(bf16)
    w = rng.standard_normal(64).astype(bf16)
    (y,) = evaluate(rmsnorm(BF16).fusion, [x, w])
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    exact = xd / np.sqrt(np.mean(xd**2, axis=1, keepdims=True) + 1e-6) * wd
    assert y.dtype == np.float64
    # computed exactly, then rounded by the cast to bf16 (through float32), as the kernel does
    assert np.array_equal(y, exact.astype(np.float32).astype(bf16).astype(np.float64))
    assert not np.array_equal(y, exact)


def test_layernorm_forward_via_var_mean(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=HALF)
        w = fd.define_tensor([-1], dtype=HALF)
        b = fd.define_tensor([-1], dtype=HALF)
        xf = fd.ops.cast(x, FLOAT)
        var, mean = fd.ops.var_mean(xf, [1], correction=0, keepdim=True)
        rstd = fd.ops.rsqrt(var + 1e-5)
        y = (xf - mean) * rstd * fd.ops.broadcast_in_dim(w, x.shape(), [1])
        y = y + fd.ops.broadcast_in_dim(b, x.shape(), [1])
        fd.add_output(fd.ops.cast(y, HALF))
        fd.add_output(mean)
        fd.add_output(rstd)
    xs = (3 + 2 * rng.standard_normal((6, 40))).astype(np.float16)
    ws, bs = rng.standard_normal(40).astype(np.float16), rng.standard_normal(40).astype(np.float16)
    y, mean, rstd = evaluate(fd.fusion, [xs, ws, bs])
    xd = xs.astype(np.float64)
    mu = xd.mean(axis=1, keepdims=True)
    sigma2 = ((xd - mu) ** 2).sum(axis=1, keepdims=True) / 40
    close(mean, in_f32(mu))  # Float outputs, stored in float32
    close(rstd, in_f32(1 / np.sqrt(sigma2 + 1e-5)))
    exact = (xd - mu) / np.sqrt(sigma2 + 1e-5) * ws.astype(np.float64) + bs.astype(np.float64)
    assert np.array_equal(y, exact.astype(np.float32).astype(np.float16).astype(np.float64))
    assert (y.shape, mean.shape, rstd.shape) == ((6, 40), (6, 1), (6, 1))


@pytest.mark.parametrize(("correction", "keepdim"), [(0, False), (1, False), (1, True), (2, True)])
def test_var_mean_correction(rng, correction, keepdim):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=DOUBLE)
        var, mean = fd.ops.var_mean(x, [0, 2], correction=correction, keepdim=keepdim)
        fd.add_output(var)
        fd.add_output(mean)
    xs = rng.standard_normal((3, 4, 5))
    var, mean = evaluate(fd.fusion, [xs])
    close(var, np.var(xs, axis=(0, 2), ddof=correction, keepdims=keepdim))
    close(mean, np.mean(xs, axis=(0, 2), keepdims=keepdim))


def test_var_mean_of_a_single_element_with_correction_is_not_finite():
    with FusionDefinition() as fd:
        var, _ = fd.ops.var_mean(fd.define_tensor([-1, -1], dtype=DOUBLE), [1])
        fd.add_output(var)
    (var,) = evaluate(fd.fusion, [np.ones((2, 1))])
    assert np.isnan(var).all()  # 0 / max(1 - 1, 0), as torch.var gives


@pytest.mark.parametrize("correction", [3, 4, 10])
def test_var_mean_with_correction_at_or_beyond_n_is_inf_as_in_torch(correction):
    """torch divides by max(0, n - correction): inf where the row varies, NaN where it is
    constant (0 / 0); never a negative variance."""
    with FusionDefinition() as fd:
        var, mean = fd.ops.var_mean(fd.define_tensor([-1, -1], dtype=FLOAT), [1],
                                    correction=correction)
        fd.add_output(var)
        fd.add_output(mean)
    xs = np.array([[1.0, 2.0, 4.0], [5.0, 5.0, 5.0]], np.float32)
    var, mean = evaluate(fd.fusion, [xs])
    assert np.isposinf(var[0]) and np.isnan(var[1])
    assert mean.tolist() == [float(np.float32(7 / 3)), 5.0]  # Float outputs: float32


def test_softmax_max_subtracted(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        m = fd.ops.max(x, [1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        fd.add_output(fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True)))
    xs = (50 * rng.standard_normal((3, 17))).astype(np.float32)
    (y,) = evaluate(fd.fusion, [xs])
    xd = xs.astype(np.float64)
    e = np.exp(xd - xd.max(axis=1, keepdims=True))
    close(y, in_f32(e / e.sum(axis=1, keepdims=True)))
    np.testing.assert_allclose(y.sum(axis=1), np.ones(3), rtol=1e-6)


def test_outer_reduction_and_broadcast_back(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DOUBLE)
        col = fd.ops.sum(x, [0])
        back = fd.ops.broadcast_in_dim(col, [x.size(0), x.size(1)], [1])
        fd.add_output(fd.ops.sub(x, back))
        fd.add_output(fd.ops.max(x, [0, 1]))
    xs = rng.standard_normal((7, 3))
    centered, top = evaluate(fd.fusion, [xs])
    close(centered, xs - xs.sum(axis=0))
    assert top.shape == () and top == xs.max()


def test_scalar_input_and_size(rng):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=DOUBLE)
        scale = fd.define_scalar(dtype=DOUBLE)
        fd.add_output(x * scale / x.size(1) + x.size(0))
    xs = rng.standard_normal((2, 5))
    (y,) = evaluate(fd.fusion, [xs, 3.0])
    close(y, xs * 3.0 / 5 + 2)


def test_scalar_inputs_are_stored_in_their_dtype():
    """A Float scalar input of 0.1 is the float32 nearest 0.1: that is what the kernel gets."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DOUBLE)
        fd.add_output(x * fd.define_scalar(dtype=FLOAT) + fd.define_scalar(dtype=INT32))
    (y,) = evaluate(fd.fusion, [np.ones(2), 0.1, np.int32(2)])
    assert y[0] == float(np.float32(0.1)) + 2


def test_dead_code_is_not_evaluated():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DOUBLE)
        fd.ops.broadcast_in_dim(x, [-1, -1], [1])  # unused, and its new size is unknowable
        fd.add_output(fd.ops.neg(x))
    (y,) = evaluate(fd.fusion, [np.arange(3.0)])
    close(y, -np.arange(3.0))


def test_unknowable_size_is_a_definition_error():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DOUBLE)
        fd.add_output(fd.ops.broadcast_in_dim(x, [-1, -1], [1]))
    with pytest.raises(DefinitionError, match="neither a fixed number nor equal to any input"):
        evaluate(fd.fusion, [np.arange(3.0)])


def test_broadcast_in_dim_sizes_fixed_later_are_known(rng):
    with FusionDefinition() as fd:
        w = fd.define_tensor([-1], dtype=DOUBLE)
        x = fd.define_tensor([-1, -1], dtype=DOUBLE)
        fd.add_output(fd.ops.broadcast_in_dim(w, [-1, -1], [1]) + x)
    ws, xs = rng.standard_normal(4), rng.standard_normal((3, 4))
    close(evaluate(fd.fusion, [ws, xs])[0], ws + xs)


def test_outputs_are_writable_copies():
    with FusionDefinition() as fd:
        w = fd.define_tensor([-1], dtype=DOUBLE)
        fd.add_output(fd.ops.broadcast_in_dim(w, [3, -1], [1]))
    (y,) = evaluate(fd.fusion, [np.arange(2.0)])
    y[0, 0] = 7.0
    assert y.flags.writeable and y.flags.c_contiguous and y[1, 0] == 0.0


# ----- every elementwise op against numpy written out -------------------------------------------

DIRECT = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a**b,
    "maximum": lambda a, b: np.where(a > b, a, b),
    "minimum": lambda a, b: np.where(a < b, a, b),
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "neg": lambda a: -a,
    "abs": lambda a: np.where(a < 0, -a, a),
    "relu": lambda a: np.where(a > 0, a, 0.0),
    "reciprocal": lambda a: 1 / a,
    "sqrt": lambda a: a**0.5,
    "rsqrt": lambda a: a**-0.5,
    "exp": lambda a: np.e**a,
    "log": lambda a: np.log(a),
    "tanh": lambda a: (np.exp(2 * a) - 1) / (np.exp(2 * a) + 1),
    "sigmoid": lambda a: np.exp(a) / (np.exp(a) + 1),
    "silu": lambda a: a * np.exp(a) / (np.exp(a) + 1),
    "where": lambda c, a, b: np.array([x if k else y for k, x, y in zip(c, a, b, strict=True)]),
    "erf": lambda a: np.array([math.erf(x) for x in a]),
    "log1p": lambda a: np.log(np.where(a > -1, 1 + a, np.nan)),
    "expm1": lambda a: np.e**a - 1,
    "softplus": lambda a, b, t: np.where(a * b > t, a, np.log(1 + np.exp(a * b)) / b),
    "clamp": lambda a, lo, hi: np.array([min(max(x, m), n) for x, m, n in zip(a, lo, hi,
                                                                              strict=True)]),
    "isnan": lambda a: a != a,
    "isinf": lambda a: np.abs(a) == np.inf,
    "isfinite": lambda a: np.abs(a) < np.inf,
    "logical_and": lambda a, b: (a != 0) & (b != 0),
    "logical_or": lambda a, b: (a != 0) | (b != 0),
    "logical_not": lambda a: a == 0,
}


def test_direct_table_covers_every_op():
    assert set(DIRECT) == set(ELEMENTWISE)


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_elementwise_op(rng, op):
    arity = ELEMENTWISE[op].arity
    with FusionDefinition() as fd:
        dtypes = [BOOL, DOUBLE, DOUBLE] if op == "where" else [DOUBLE] * arity
        ts = [fd.define_tensor([-1], dtype=d) for d in dtypes]
        fd.add_output(getattr(fd.ops, op)(*ts))
    values = [rng.uniform(0.25, 2.0, 9) for _ in range(arity)]
    values[0][:3] = -values[0][:3]  # some negatives for neg/abs/relu/compare...
    values[-1][3] = values[0][3]  # and a tie for the comparisons
    if op in ("sqrt", "rsqrt", "log", "pow"):
        values[0] = np.abs(values[0])
    if op == "where":
        values[0] = rng.uniform(size=9) < 0.5
    (got,) = evaluate(fd.fusion, values)
    expected = DIRECT[op](*values)
    if expected.dtype == bool:
        assert got.dtype == bool and np.array_equal(got, expected)
    else:
        close(got, expected)


def test_broadcast_of_elementwise_is_right_aligned(rng):
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, 1, -1], dtype=DOUBLE)
        b = fd.define_tensor([-1, 1], dtype=DOUBLE)
        fd.add_output(a * b + 1)
    xa, xb = rng.standard_normal((2, 1, 3)), rng.standard_normal((4, 1))
    (y,) = evaluate(fd.fusion, [xa, xb])
    assert y.shape == (2, 4, 3)
    close(y, xa * xb + 1)


# ----- dtypes and casts -------------------------------------------------------------------------


def as_kernel(x, dtype):
    """What a kernel's cast of float64 values to half / bf16 holds: through float32 first."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float32).astype(dtype).astype(np.float64)


def cast_chain(*dtypes, src=DOUBLE):
    with FusionDefinition() as fd:
        v = x = fd.define_tensor([-1], dtype=src)
        for dtype in dtypes:
            v = fd.ops.cast(v, dtype)
        fd.add_output(fd.ops.cast(v, DOUBLE) if v is not x else fd.ops.neg(x))
    return fd


def test_cast_to_half_and_bfloat16_rounds_to_nearest_even_through_float32():
    tie, above = 1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-40  # bf16 has 8 significant bits
    xs = np.array([tie, 1 + 3 * 2.0**-8, above, np.pi, 1e-9, -2.5e-8, np.nan, -np.inf])
    (y,) = evaluate(cast_chain(BF16).fusion, [xs])
    assert y[:3].tolist() == [1.0, 1 + 2.0**-6, 1.0]  # ties to even; `above` rounds to
    # float32's 1 + 2**-8 first, then ties to even, as static_cast<float> + __float2bfloat16_rn
    np.testing.assert_array_equal(y, as_kernel(xs, bf16))
    (y,) = evaluate(cast_chain(HALF, BF16).fusion, [xs])
    np.testing.assert_array_equal(y, as_kernel(as_kernel(xs, np.float16), bf16))
    assert y[4] == as_kernel(1e-9, np.float16) == 0.0  # below half's smallest subnormal
    (y,) = evaluate(cast_chain(FLOAT).fusion, [xs])
    np.testing.assert_array_equal(y, in_f32(xs))


def test_cast_to_half_and_bfloat16_overflows_to_inf_like_the_kernel():
    # cast(x * 1e5, half): inf on the GPU, so in the oracle too
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(fd.ops.cast(fd.ops.cast(x * 1e5, HALF), FLOAT))
        fd.add_output(fd.ops.cast(fd.ops.cast(x * 1e38, BF16), FLOAT))
    xs = np.array([0.5, 0.6550399, 0.6552, -1.0, 3.39, 3.398], dtype=np.float32)
    half, bfloat = evaluate(fd.fusion, [xs])
    assert half.tolist()[:4] == [49984.0, 65504.0, np.inf, -np.inf]  # 50000 ties to even
    np.testing.assert_array_equal(half, as_kernel(xs.astype(np.float64) * 1e5, np.float16))
    # 3.398e38 is a float32, but rounds past bf16's largest finite value 3.3895e38
    assert np.isinf(bfloat).tolist() == [False, False, False, False, False, True]
    assert bfloat[4] == float(ml_dtypes.finfo(bf16).max)


def test_round_trip_through_bfloat16_leaves_the_rounding_error():
    # cast(cast(x, bf16), float) - x: the bf16 rounding error of x, as the kernel computes it
    # (it was 0 when the oracle's casts were exact)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        fd.add_output(fd.ops.cast(fd.ops.cast(x, BF16), FLOAT) - x)
    xs = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    (err,) = evaluate(fd.fusion, [xs])
    kernel = xs.astype(bf16).astype(np.float32) - xs  # exact in float32 (Sterbenz)
    np.testing.assert_array_equal(err, kernel)
    assert np.count_nonzero(err) > 200


def test_outputs_are_stored_rounded_and_overflow_like_the_kernel():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=HALF)
        y = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(x * 1e5)  # a Half output: computed in float, stored as half
        fd.add_output(y * 1e30 * 1e30)  # a Float output beyond float32's range
        fd.add_output(fd.ops.cast(y, DOUBLE) * 1e30 * 1e30)  # Double holds it
    xs, ys = np.array([0.5, 1.0, 1e-3], np.float16), np.array([1.0, -1.0, 0.0], np.float32)
    half, single, double = evaluate(fd.fusion, [xs, ys])
    assert half.tolist()[:2] == [49984.0, np.inf]
    assert half[2] == as_kernel(float(xs[2]) * 1e5, np.float16)
    assert single.tolist() == [np.inf, -np.inf, 0.0]
    assert double.tolist() == [1.0 * 1e30 * 1e30, -1.0 * 1e30 * 1e30, 0.0]


def test_cast_to_int_truncates_toward_zero_and_saturates():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DOUBLE)
        fd.add_output(fd.ops.cast(x, INT32))
        fd.add_output(fd.ops.cast(fd.ops.cast(x, INT64), DOUBLE) / 2)
        fd.add_output(fd.ops.cast(x, INT64))
    xs = np.array([-2.7, -0.5, 0.5, 2.7, 3.0, -1e10, np.nan, np.inf, 1e19])
    as_int, halves, as_long = evaluate(fd.fusion, [xs])
    assert as_int.dtype == np.int64
    # PTX's float-to-int conversion (cvt.rzi) clamps to the type's range; NaN from a double
    # gives the type's minimum
    assert as_int.tolist() == [-2, 0, 0, 2, 3, -(2**31), -(2**31), 2**31 - 1, 2**31 - 1]
    assert as_long.tolist() == [-2, 0, 0, 2, 3, -10**10, -(2**63), 2**63 - 1, 2**63 - 1]
    assert halves.tolist()[:6] == [-1.0, 0.0, 0.0, 1.0, 1.5, -5e9]


def test_nan_cast_from_float_to_int32_gives_zero_and_to_int64_the_minimum():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(fd.ops.cast(x, INT32))
        fd.add_output(fd.ops.cast(x, INT64))
    as_int, as_long = evaluate(fd.fusion, [np.array([np.nan, -np.inf, 2.5], np.float32)])
    assert as_int.tolist() == [0, -(2**31), 2]  # PTX: 0 unless from .f64 or to .s64
    assert as_long.tolist() == [-(2**63), -(2**63), 2]


def test_cast_from_int64_to_int32_keeps_the_low_bits():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=INT64)
        fd.add_output(fd.ops.cast(x, INT32))
        fd.add_output(fd.ops.cast(x, FLOAT))
    xs = np.array([2**32 + 5, -(2**31) - 1, 7, 2**62 + 1], dtype=np.int64)
    narrow, single = evaluate(fd.fusion, [xs])
    assert narrow.tolist() == [5, 2**31 - 1, 7, 1]
    assert single.tolist() == [float(np.float32(v)) for v in xs]


def test_double_and_integer_operands_of_a_float_op_are_rounded_to_float32():
    """A Float op converts a Double scalar or an integer operand to float first, as the
    kernel's static_cast<float> does: x * 5.2e38 is inf, n + x loses n's low bits."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        n = fd.define_scalar(dtype=INT64)
        fd.add_output(x * 5.2e38)
        fd.add_output(x + n)
        fd.add_output(fd.ops.cast(x, DOUBLE) * 5.2e38)  # a Double op keeps the scalar
    big, summed, double = evaluate(fd.fusion, [np.array([0.5, 0.0], np.float32), 2**24 + 1])
    assert np.isinf(big[0]) and np.isnan(big[1])  # float(5.2e38) is inf; 0 * inf is NaN
    assert summed.tolist() == [2.0**24, 2.0**24]  # 2**24 + 1 is 2**24 in float32
    assert double.tolist() == [2.6e38, 0.0]


def test_half_and_bfloat16_scalars_are_held_in_float32():
    """A kernel holds Half / BFloat16 scalars (inputs and constants) in its compute type."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(x * fd.define_scalar(dtype=HALF) + fd.define_scalar(70000.0, dtype=BF16))
    (y,) = evaluate(fd.fusion, [np.ones(1, np.float32), 0.1])
    assert y[0] == float(np.float32(np.float32(0.1) + np.float32(70000.0)))


def test_cast_to_bool_is_nonzero_and_back():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        b = fd.ops.cast(x, BOOL)
        fd.add_output(b)
        fd.add_output(fd.ops.cast(b, FLOAT) + fd.ops.cast(b, INT32))
    flags, twos = evaluate(fd.fusion, [np.array([0.0, 0.1, -3.0, -0.0], dtype=np.float32)])
    assert flags.dtype == bool and flags.tolist() == [False, True, True, False]
    assert twos.tolist() == [0.0, 2.0, 2.0, 0.0]


def test_integer_arithmetic_and_reductions():
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, -1], dtype=INT32)
        b = fd.define_tensor([-1, -1], dtype=INT32)
        fd.add_output(a / b)  # true division
        fd.add_output(fd.ops.sum(a * b, [1]))
        fd.add_output(fd.ops.sum(fd.ops.gt(a, b), [0, 1]))
        fd.add_output(fd.ops.max(a, [1]))
    xa = np.array([[7, -7, 2**30], [1, 2, 3]], dtype=np.int32)
    xb = np.array([[2, 2, 4], [3, 2, 1]], dtype=np.int32)
    quotient, dot, count, top = evaluate(fd.fusion, [xa, xb])
    close(quotient, in_f32(xa / xb))
    assert dot.dtype == np.int64 and dot.tolist() == [14 - 14 + 2**32, 3 + 4 + 3]
    assert count.dtype == np.int64 and count == 3
    assert top.dtype == np.int64 and top.tolist() == [2**30, 3]


def test_sum_with_dtype_and_bool_inputs():
    with FusionDefinition() as fd:
        m = fd.define_tensor([-1], dtype=BOOL)
        x = fd.define_tensor([-1], dtype=BF16)
        fd.add_output(fd.ops.sum(m, [0]))
        fd.add_output(fd.ops.sum(x, [0], dtype=FLOAT))
        fd.add_output(fd.ops.where(m, x, 0.5))
    mask = np.array([True, False, True])
    xs = np.array([1.5, 2.25, -4.0], dtype=bf16)
    count, total, picked = evaluate(fd.fusion, [mask, xs])
    assert count == 2 and total == -0.25
    assert picked.tolist() == [1.5, 0.5, -4.0]


def test_nan_and_inf_propagate_without_warnings():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(fd.ops.log(x) + fd.ops.reciprocal(x))
    with np.errstate(all="raise"):
        (y,) = evaluate(fd.fusion, [np.array([0.0, -1.0, 1.0], dtype=np.float32)])
    assert np.isnan(y[0]) or np.isinf(y[0])
    assert np.isnan(y[1]) and y[2] == 1.0


# ----- bad inputs -------------------------------------------------------------------------------


def two_inputs():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        w = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(x * w)
    return fd.fusion


def f32(*shape):
    return np.ones(shape, dtype=np.float32)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([f32(2, 3)], r"the fusion takes 2 inputs \(T0, T1\), got 1"),
        ([f32(2, 3), f32(3), f32(3)], "takes 2 inputs .* got 3"),
        ([f32(2, 3, 1), f32(3)], r"input 0 \(T0\): expected rank 2 .* got rank 3 with shape"),
        ([f32(2, 3), f32(3, 1)], r"input 1 \(T1\): expected rank 1"),
        (
            [f32(2, 1024), f32(4096)],
            "T1 dimension 0 has size 4096 but T0 dimension 1, which must be equal, has 1024",
        ),
        ([f32(2, 3), 1.0], r"input 1 \(T1\): expected a rank-1 DataType.Float array, got float"),
        ([f32(2, 3), np.float32(1.0)], r"input 1 \(T1\): expected .* array, got float32"),
        ([f32(2, 3), f32(3).astype(np.complex64)], r"input 1 \(T1\): .*got dtype complex64"),
        ([f32(2, 3), np.full(3, 0.1)], "not all representable in DataType.Float"),
        ([f32(2, 3), [1.0, 2.0, 3.0]], r"input 1 \(T1\): expected .* got list"),
    ],
)
def test_bad_inputs(inputs, message):
    with pytest.raises(BadInputError, match=message):
        evaluate(two_inputs(), inputs)


def test_int_inputs_take_no_floats():
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.neg(fd.define_tensor([-1], dtype=INT32)))
    with pytest.raises(BadInputError, match=r"input 0 \(T0\): .* got dtype float32"):
        evaluate(fd.fusion, [f32(2)])
    with pytest.raises(BadInputError, match=r"not all representable in DataType\.Int32"):
        evaluate(fd.fusion, [np.array([2**40])])
    assert evaluate(fd.fusion, [np.array([2, -3])])[0].tolist() == [-2, 3]  # int64, exact


def test_wider_arrays_holding_representable_values_are_accepted():
    x = np.array([[1.5, -2.0]], dtype=bf16)
    (y,) = evaluate(two_inputs(), [x.astype(np.float64), np.array([2.0, 0.5])])
    assert y.tolist() == [[3.0, -1.0]]


def test_fixed_and_broadcast_dimensions_are_checked():
    with FusionDefinition() as fd:
        x = fd.define_tensor([1, 8], dtype=FLOAT)
        y = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(x + y)
    with pytest.raises(BadInputError, match="T0 dimension 1 has size 7 but the definition fixes"):
        evaluate(fd.fusion, [f32(1, 7), f32(7)])
    with pytest.raises(
        BadInputError, match=r"T1 dimension 0 has size 7 .* fixes it to 8 \(it must"
    ):
        evaluate(fd.fusion, [f32(1, 8), f32(7)])
    with pytest.raises(BadInputError, match=r"T0 dimension 0 has size 2 .* broadcast dimension"):
        evaluate(fd.fusion, [f32(2, 8), f32(8)])


def test_scalar_input_checks():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        n = fd.define_scalar(dtype=INT32)
        flag = fd.define_scalar(dtype=BOOL)
        fd.add_output(fd.ops.where(flag, x * n, x))
    with pytest.raises(BadInputError, match=r"input 1 \(S1\): expected a DataType.Int32 scalar"):
        evaluate(fd.fusion, [f32(2), 2.5, True])
    with pytest.raises(BadInputError, match=r"input 1 \(S1\): .* got an array of shape \(2,\)"):
        evaluate(fd.fusion, [f32(2), f32(2), True])
    with pytest.raises(BadInputError, match=r"does not fit in DataType\.Int32"):
        evaluate(fd.fusion, [f32(2), 2**40, True])
    with pytest.raises(BadInputError, match=r"input 2 \(S2\): expected a DataType.Bool scalar"):
        evaluate(fd.fusion, [f32(2), 3, 1])
    assert evaluate(fd.fusion, [f32(2), np.int32(3), np.True_])[0].tolist() == [3.0, 3.0]


def test_empty_inputs_are_rejected():
    with pytest.raises(BadInputError, match="T0 dimension 0 has size 0"):
        evaluate(two_inputs(), [f32(0, 3), f32(3)])


def test_bind_shapes_is_usable_without_data():
    fusion = two_inputs()
    sizes = bind_shapes(fusion, [(4, 6), (6,)])
    assert sizes.shape(fusion.outputs[0]) == (4, 6)
    with pytest.raises(BadInputError, match="T1 dimension 0 has size 5"):
        bind_shapes(fusion, [(4, 6), (5,)])
    with pytest.raises(BadInputError, match=r"input 1 \(T1\) is a rank-1 tensor, but .* None"):
        bind_shapes(fusion, [(4, 6), None])


# ----- tolerances -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [DOUBLE, FLOAT, HALF, BF16])
def test_tolerance_grows_with_reduction_size(dtype):
    sizes = [0, 1, 2, 64, 1024, 24578, 65536, 2**20]
    tols = [tolerance(dtype, n) for n in sizes]
    assert tols[0] == tols[1]
    for (r0, a0), (r1, a1) in itertools.pairwise(tols[1:]):
        assert r1 > r0 and a1 > a0
    assert tols[-1][0] < 2 * tols[1][0] + 1e-2  # grows, but stays a tolerance


def test_tolerance_per_dtype():
    rtols = [tolerance(d, 1024)[0] for d in (DOUBLE, FLOAT, HALF, BF16)]
    assert rtols == sorted(rtols)
    assert tolerance(DOUBLE, 1)[0] < 1e-11
    assert 1e-6 <= tolerance(FLOAT, 1)[0] <= 1e-4
    assert 1e-3 <= tolerance(HALF, 1)[0] <= 1e-2
    assert 5e-3 <= tolerance(BF16, 1)[0] <= 3e-2
    # a bf16 output rounded once, from any value, is within its own tolerance
    x = np.random.default_rng(0).standard_normal(10_000)
    rtol, atol = tolerance(BF16, 1)
    assert np.all(np.abs(x.astype(bf16).astype(np.float64) - x) <= atol + rtol * np.abs(x))
    for d in (INT32, INT64, BOOL):
        assert tolerance(d, 4096) == (0.0, 0.0)
    with pytest.raises(BadInputError, match="reduction_size must be >= 0"):
        tolerance(FLOAT, -1)


def test_output_reduction_sizes():
    fd = rmsnorm()
    assert output_reduction_sizes(fd.fusion, [f32(3, 100), f32(100)]) == [100]
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        m = fd.ops.max(x, [1], keepdim=True)  # max is exact: it does not count
        e = fd.ops.exp(x - m)
        fd.add_output(e / fd.ops.sum(e, [1], keepdim=True))
        fd.add_output(e)
        var, _ = fd.ops.var_mean(x, [0, 1])
        fd.add_output(fd.ops.sum(e, [0]) + var)
    assert output_reduction_sizes(fd.fusion, [f32(3, 50)]) == [50, 0, 3 + 150]


# ----- compare ----------------------------------------------------------------------------------


def bf16_rmsnorm_case(rng):
    fd = rmsnorm(BF16)
    x = rng.standard_normal((8, 256)).astype(bf16)
    w = rng.standard_normal(256).astype(bf16)
    refs = evaluate(fd.fusion, [x, w])
    return fd.fusion, refs, output_reduction_sizes(fd.fusion, [x, w])


def test_compare_passes_on_exact_and_on_rounded_outputs(rng):
    fusion, refs, sizes = bf16_rmsnorm_case(rng)
    compare(refs, refs, fusion, sizes)
    compare([refs[0].astype(bf16)], refs, fusion, sizes)  # what a correct kernel stores


def test_compare_reports_a_planted_error(rng):
    fusion, refs, sizes = bf16_rmsnorm_case(rng)
    out = refs[0].astype(bf16)
    out[3, 17] = out[3, 17] + bf16(0.75)
    with pytest.raises(ValidationError) as info:
        compare([out], refs, fusion, sizes)
    report = str(info.value)
    name = fusion.outputs[0].name
    assert f"output 0 ({name}, DataType.BFloat16, shape (8, 256))" in report
    assert "1 of 2048 elements differ" in report
    assert "worst at index (3, 17)" in report
    assert "max abs err" in report and "max rel err" in report
    assert "tolerance: rtol" in report and "(reduction size 256)" in report


@pytest.mark.parametrize(
    ("got", "ref", "ok"),
    [
        (np.nan, 1.0, False),
        (1.0, np.nan, False),
        (np.nan, np.nan, True),
        (np.inf, np.inf, True),
        (-np.inf, np.inf, False),
        (np.inf, 1e30, False),
        (1.0, 1.0 + 1e-7, True),
        (1.0, 1.001, False),
    ],
)
def test_compare_nonfinite_values(got, ref, ok):
    fusion = two_inputs()
    outs, refs = [np.array([[0.5, got]])], [np.array([[0.5, ref]])]
    if ok:
        compare(outs, refs, fusion, 1)
    else:
        with pytest.raises(ValidationError, match=r"1 of 2 elements differ"):
            compare(outs, refs, fusion, 1)


def test_compare_report_names_nan_mismatches():
    fusion = two_inputs()
    with pytest.raises(ValidationError, match=r"1 NaN/inf mismatches, first at index \(0, 1\)"):
        compare([np.array([[0.5, np.nan]])], [np.array([[0.5, 2.0]])], fusion, [1])


def test_compare_shapes_counts_and_integers():
    fusion = two_inputs()
    with pytest.raises(ValidationError, match=r"shape \(2, 3\), but the reference has shape"):
        compare([np.zeros((2, 3))], [np.zeros((3, 2))], fusion, 1)
    with pytest.raises(BadInputError, match=r"the fusion has 1 outputs \(T2\); got 2 outputs"):
        compare([np.zeros(1)] * 2, [np.zeros(1)], fusion, 1)
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.sum(fd.define_tensor([-1, -1], dtype=INT32), [1]))
    compare([np.array([5, 6])], [np.array([5, 6])], fd.fusion, 4096)
    with pytest.raises(ValidationError, match=r"exact match required.*index \(1,\): got 7, expe"):
        compare([np.array([5, 7])], [np.array([5, 6])], fd.fusion, 4096)


def test_compare_tolerance_follows_the_reduction_size():
    fusion = two_inputs()
    rtol_small, _ = tolerance(FLOAT, 1)
    rtol_big, _ = tolerance(FLOAT, 2**20)
    ref = np.array([[1.0]])
    off = np.array([[1.0 + (rtol_small + rtol_big) / 2]])
    with pytest.raises(ValidationError):
        compare([off], [ref], fusion, 1)
    compare([off], [ref], fusion, [2**20])


def test_compare_judges_a_cancelling_sum_by_the_size_of_its_neighbours():
    """A column sum of 16384 float terms that cancels to near zero rounds like its neighbours
    (the partial sums are as large): float32 accumulation error passes, a lost term does not.
    A fixed seed: about 1 draw in 150 gives a serial float32 sum within 1e-6 of the exact one,
    which would not show the point."""
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.sum(fd.define_tensor([-1, -1], dtype=FLOAT), [0]))
    terms = np.random.default_rng(1).standard_normal((16384, 64))
    terms[:, 0] -= terms[:, 0].mean()  # column 0 cancels to about 1e-13
    ref = terms.sum(axis=0)
    rounded = np.cumsum(terms.astype(np.float32), axis=0, dtype=np.float32)[-1]  # serial
    assert abs(rounded[0] - ref[0]) > 1e-6  # far beyond any bound relative to ref[0]
    compare([rounded], [ref], fd.fusion, [16384])
    lost = ref.copy()
    lost[0] -= terms[np.argmax(np.abs(terms[:, 0])), 0]  # a term as large as they come: a
    # random one can be smaller than the allowance (about 1 seed in 200 drew one)
    with pytest.raises(ValidationError, match=r"1 of 64 elements differ"):
        compare([lost], [ref], fd.fusion, [16384])


@pytest.mark.parametrize("dtype", [FLOAT, DOUBLE], ids=lambda d: d.name)
def test_an_outlier_sum_does_not_loosen_the_others(dtype):
    """The allowance for a sum output follows its median size: one huge column (a weight
    gradient's outlier feature, or 1e200 in double) leaves the others' tolerance tight."""
    with FusionDefinition() as fd:
        fd.add_output(fd.ops.sum(fd.define_tensor([-1, -1], dtype=dtype), [0]))
    ref = np.ones(64)
    ref[0] = 1e4 if dtype is FLOAT else 1e200
    got = ref.copy()
    got[5] = 1.01
    with pytest.raises(ValidationError, match=r"1 of 64 elements differ"):
        compare([got], [ref], fd.fusion, [16384])


@pytest.mark.parametrize(
    ("index", "change", "message"),
    [(2, lambda a: a.astype(np.float32), r"input 2 \(T2\): expected a rank-2 DataType.Bool"),
     (3, lambda a: a[:, 0], r"input 3 \(T3\): expected rank 2 .* got rank 1 with shape \(8,\)"),
     (3, lambda a: a[:4], r"T3 dimension 0 has size 4 but T0 dimension 0, .* has 8"),
     (5, lambda a: a[:32], r"T5 dimension 0 has size 32 but T0 dimension 1, .* has 64")],
    ids=["mask-dtype", "rms-rank", "rms-rows", "weight-hidden"],
)
def test_norm_backward_inputs_are_checked_with_their_names(index, change, message):
    """dropout + RMSNorm backward: a float mask, an rms of the wrong rank or rows, a weight
    whose hidden differs from x's: the shared checks (bind_shapes, the dtype check) name the
    input and the sizes. The executor runs the same shape binding before any launch."""
    from fuser.fusions import FUSIONS, make_inputs

    fd = FUSIONS["dropout_rmsnorm_bwd"](BF16)
    host = make_inputs("dropout_rmsnorm_bwd", 8, 64, BF16, np.random.default_rng(0))
    host[index] = change(host[index])
    with pytest.raises(BadInputError, match=message):
        evaluate(fd.fusion, host)


def _float32_layernorm(x, w, b, eps=1e-5):
    """What a float32 kernel computes for layernorm_fwd: every op rounded to float32."""
    x, w, b = (a.astype(np.float32) for a in (x, w, b))
    mean = x.mean(axis=1, keepdims=True, dtype=np.float32)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True, dtype=np.float32)
    rstd = (np.float32(1) / np.sqrt(var + np.float32(eps))).astype(np.float32)
    return [(x - mean) * rstd * w + b, mean, rstd]


def _short_layernorm_rows(rng, rows=64):
    """Rows of 3 elements near 100 that agree to about 1e-3: x - mean cancels to a thousandth
    of x, so one float32 rounding of x moves the output by about 1e-2 of itself. Every other
    row is well conditioned."""
    x = rng.standard_normal((rows, 3))
    x[::2] = 100.0 + 1e-3 * rng.standard_normal((rows // 2, 3))
    return [x.astype(np.float32), (1 + 0.1 * rng.standard_normal(3)).astype(np.float32),
            (0.1 * rng.standard_normal(3)).astype(np.float32)]


def test_ill_conditioned_rows_get_the_allowance_a_float32_kernel_needs(rng):
    from fuser.fusions import layernorm_fwd
    from fuser.reference import input_sensitivity, output_reduction_sizes

    fusion = layernorm_fwd(FLOAT).fusion
    inputs = _short_layernorm_rows(rng)
    refs = evaluate(fusion, inputs)
    sizes = output_reduction_sizes(fusion, inputs)
    kernel = _float32_layernorm(*inputs)
    with pytest.raises(ValidationError, match="output 0"):
        compare(kernel, refs, fusion, sizes)  # the plain tolerance cannot hold, by ~1000x
    spread = input_sensitivity(fusion, inputs)
    compare(kernel, refs, fusion, sizes, spread)
    y_spread = spread[0]
    # Only the cancelling rows get a large allowance (over 3000 seeds: random rows at most
    # 3.5e-5, their median 2.2e-7; cancelling rows at least 8.2e-4).
    assert y_spread[1::2].max() < 1e-4 < 2e-4 < y_spread[::2].min()
    assert all(np.array_equal(a, b) for a, b in zip(spread, input_sensitivity(fusion, inputs),
                                                     strict=True))  # a fixed draw
    given = input_sensitivity(fusion, inputs, refs)  # the oracle's outputs passed in
    assert all(np.array_equal(a, b) for a, b in zip(spread, given, strict=True))


def test_the_allowance_still_catches_an_error_in_a_well_conditioned_row(rng):
    from fuser.fusions import layernorm_fwd
    from fuser.reference import input_sensitivity, output_reduction_sizes

    fusion = layernorm_fwd(FLOAT).fusion
    inputs = _short_layernorm_rows(rng)
    refs = evaluate(fusion, inputs)
    kernel = _float32_layernorm(*inputs)
    kernel[0][5, 1] += np.float32(1e-3)  # row 5 is well conditioned; 100x its tolerance
    with pytest.raises(ValidationError, match=r"1 of 192 elements differ .*\n.*worst at index "
                                             r"\(5, 1\)"):
        compare(kernel, refs, fusion, output_reduction_sizes(fusion, inputs),
                input_sensitivity(fusion, inputs))


def _centred_by_column_sums(rows: int, columns: int, rng):
    """(fusion, inputs, float32 kernel outputs) of (x - sum(x, dim 0)) * rows, the sums added
    up row by row in float32 as a serial loop does: where a column's sum nearly equals one of
    its elements, the difference cancels and the sum's rounding is all that is left."""
    with FusionDefinition("minus_column_sums") as fd:
        x = fd.define_tensor([-1, -1])
        b = fd.define_scalar(None, dtype=FLOAT)
        fd.add_output(fd.ops.mul(fd.ops.sub(x, fd.ops.sum(x, [0], keepdim=True)), b))
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    sums = np.cumsum(x, axis=0, dtype=np.float32)[-1:]
    return fd.fusion, [x, float(rows)], [(x - sums) * np.float32(rows)]


def test_a_cancelled_sum_gets_the_allowance_of_a_serial_float32_loop(rng):
    """On the H200, x - sum(x, dim 0) at 16384 x 4096 missed by 7x where one element nearly
    equalled its column's sum: moving the inputs by an epsilon had moved those columns' sums
    by less than their rounding."""
    from fuser.reference import input_sensitivity

    fusion, inputs, kernel = _centred_by_column_sums(16384, 64, rng)
    refs = evaluate(fusion, inputs)
    sizes = output_reduction_sizes(fusion, inputs)
    compare(kernel, refs, fusion, sizes, input_sensitivity(fusion, inputs, refs))


def test_two_cancelled_sums_get_both_roundings(rng):
    """sum(a, dim 0) - sum(b, dim 0) where b holds a's rows in another order: the two sums
    agree in exact arithmetic, and two serial float32 loops round them differently. Moving
    both sums the same way had cancelled the allowance (found in review: 40 of 40 seeds)."""
    from fuser.reference import input_sensitivity

    with FusionDefinition("sums_apart") as fd:
        a = fd.define_tensor([-1, -1])
        b = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sub(fd.ops.sum(a, [0]), fd.ops.sum(b, [0])))
    x = rng.standard_normal((16384, 64)).astype(np.float32)
    y = x[rng.permutation(len(x))]
    inputs = [x, y]
    kernel = [np.cumsum(x, 0, dtype=np.float32)[-1] - np.cumsum(y, 0, dtype=np.float32)[-1]]
    compare(kernel, evaluate(fd.fusion, inputs), fd.fusion,
            output_reduction_sizes(fd.fusion, inputs), input_sensitivity(fd.fusion, inputs))


def test_the_serial_rounding_of_huge_partial_sums_does_not_overflow_to_nothing():
    from fuser.reference import _serial_rounding

    x = np.full((4, 3), 1e300)
    rounding = _serial_rounding(x, (0,), False, FLOAT)
    assert np.all(np.isfinite(rounding)) and np.all(rounding > 1e290)


def test_the_sum_allowance_still_catches_a_sum_off_by_one_term(rng):
    from fuser.reference import input_sensitivity

    fusion, inputs, kernel = _centred_by_column_sums(16384, 64, rng)
    x = inputs[0]
    column = int(np.argmax(np.abs(x[-1])))  # its last row is the largest: at least 1.5 here
    kernel[0][:, column] += x[-1, column] * np.float32(16384)  # that sum missed its last row
    with pytest.raises(ValidationError, match=rf"worst at index \(\d+, {column}\)"):
        compare(kernel, evaluate(fusion, inputs), fusion, output_reduction_sizes(fusion, inputs),
                input_sensitivity(fusion, inputs))


def test_half_and_bfloat16_outputs_get_no_sensitivity_allowance(rng):
    from fuser.fusions import layernorm_fwd
    from fuser.reference import input_sensitivity

    inputs = [a.astype(bf16) for a in _short_layernorm_rows(rng)]
    spread = input_sensitivity(layernorm_fwd(DataType.BFloat16).fusion, inputs)
    assert spread[0] is None  # y is stored in bf16, whose rounding is far coarser
    assert spread[1] is not None and spread[2] is not None  # mean and rstd are float32


def test_a_bool_of_float_values_sees_them_in_float32():
    """isinf / comparisons of a Float-computed value that overflows float32 in the kernel
    (and in torch) give the kernel's answer: the oracle's float64 intermediate is rounded
    first (a Bool output has no tolerance)."""
    with FusionDefinition("overflow") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        y = fd.ops.mul(fd.ops.mul(x, 1e30), 1e30)
        fd.add_output(fd.ops.isinf(y))
        fd.add_output(fd.ops.isfinite(y))
    inf, finite = evaluate(fd.fusion, [np.ones((2, 3), np.float32)])
    assert inf.all() and not finite.any()


def test_a_double_output_computed_in_float_gets_floats_tolerance():
    """The GPU fuzz: cast(log(|x| + 1), Double) of a Float x is float32 math; a Double output
    of double math alone keeps Double's tolerance, and so does one of a Float input only
    converted (exactly) to double."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        d = fd.define_tensor([-1, -1], dtype=DOUBLE)
        via_float = fd.ops.cast(fd.ops.log(fd.ops.add(fd.ops.abs(x), 1.0)), DOUBLE)
        fd.add_output(via_float)
        fd.add_output(fd.ops.log(fd.ops.add(fd.ops.abs(d), 1.0)))
        fd.add_output(fd.ops.mul(fd.ops.cast(x, DOUBLE), d))
        fd.add_output(fd.ops.log(x))
    assert [precision(o) for o in fd.fusion.outputs] == [FLOAT, DOUBLE, DOUBLE, FLOAT]
    x_host = np.array([[0.25]], dtype=np.float32)
    (ref, *_rest) = evaluate(fd.fusion, [x_host, np.array([[2.0]])])
    kernel = np.float32(np.log(np.float32(1.25)) * np.float32(1 + 3e-7))  # a few float ulps off
    compare([np.array([[float(kernel)]]), *_rest], [ref, *_rest], fd.fusion, 0)


def test_unrounded_sums_add_up_over_chunks_of_rows():
    """A bf16 column sum of 40 chunks of the same rows: the chunks' unrounded sums added and
    rounded once equal the oracle on all the rows; 40 times one chunk's rounded sum does not."""
    rng = np.random.default_rng(1)
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        column = fd.ops.sum(fd.ops.cast(x, FLOAT), dims=[0])
        fd.add_output(fd.ops.cast(column, BF16))
        fd.add_output(fd.ops.cast(fd.ops.mul(x, 2.0), BF16))
    chunk = rng.standard_normal((7, 64)).astype(bf16)
    (whole, _) = evaluate(fd.fusion, [np.tile(chunk, (40, 1))])
    (sum_of_chunk, rows) = evaluate(fd.fusion, [chunk], sums_unrounded=True)
    (rounded_chunk, rows_rounded) = evaluate(fd.fusion, [chunk])
    np.testing.assert_array_equal(stored(40 * sum_of_chunk, fd.fusion.outputs[0]), whole)
    assert not np.array_equal(40 * rounded_chunk, whole)
    np.testing.assert_array_equal(rows, rows_rounded)  # not a sum: rounded as usual


def _through_exp(dtype: DataType, op: str):
    """[op(x), op(x) > 0] of a [1, 5] tensor of `dtype`; softplus with beta 3432 and
    threshold 7, as the GPU fuzz drew it."""
    with FusionDefinition("exp_edges") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        if op == "softplus":
            y = fd.ops.softplus(fd.ops.div(x, 3432.0), 3432.0, 7.0)
        else:
            y = getattr(fd.ops, op)(x)
        fd.add_output(fd.ops.cast(y, DataType.Double))
        fd.add_output(fd.ops.gt(y, 0))
    return fd


EXP_EDGES = np.array([[-90.0, -87.9, -80.0, 0.0, 89.0]])


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.Half])
def test_the_oracle_follows_the_kernels_float_exp_at_its_edges(dtype):
    """In float, fm::exp flushes results below 2^-126 to 0 and is inf from 2^128 on, and so
    are sigmoid, silu and softplus built on it: the oracle's values, and comparisons of them
    with 0, follow (the GPU fuzz: softplus(x, 3432, 7) > 0 at x * 3432 = -87.9 was True in
    the oracle, False in the kernel). In Double, exp is exact."""
    x = EXP_EDGES.astype(dtype.numpy)
    value, positive = evaluate(_through_exp(dtype, "exp").fusion, [x])
    wide = x.astype(np.float64)
    np.testing.assert_array_equal(value[0, :2], 0.0)
    np.testing.assert_allclose(value[0, 2:4], np.exp(wide[0, 2:4]), rtol=1e-15)
    assert value[0, 4] == np.inf
    assert positive.tolist() == [[False, False, True, True, True]]
    sigmoid, _ = evaluate(_through_exp(dtype, "sigmoid").fusion, [-x])
    assert sigmoid[0, 4] == 0.0 and sigmoid[0, 0] == 1.0
    softplus, positive = evaluate(_through_exp(dtype, "softplus").fusion, [x])
    assert positive.tolist() == [[False, False, True, True, True]]
    assert softplus[0, 0] == 0.0 and softplus[0, 2] > 0


def test_the_oracle_keeps_exp_exact_in_double():
    value, positive = evaluate(_through_exp(DataType.Double, "exp").fusion, [EXP_EDGES])
    np.testing.assert_allclose(value, np.exp(EXP_EDGES), rtol=1e-15)
    assert positive.all()
