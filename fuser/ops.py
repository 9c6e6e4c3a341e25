"""The op table: one entry per elementwise or reduction op.

Each entry is the single source of truth for an op: how many operands it takes, the type its
operands are computed in and the type it returns, the CUDA expression codegen emits (operands
already converted to the operand type, `fm::` helpers from templates/fuser_math.cuh), and the
numpy function the float64 reference evaluator runs. Ops with structure (cast, broadcast_in_dim,
size, mean, var_mean, var) live in ir.py; they are not elementwise. The keys of REDUCTIONS are the
reduction ops everywhere else (frontend methods, analysis, codegen, the oracle).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fuser.dtypes import DataType, float_result, promote
from fuser.errors import DefinitionError


@dataclass(frozen=True)
class TypeRule:
    """How an op types its operands and its result, from the operands' types."""

    operand: Callable[[list[DataType], list[DataType]], DataType]
    result: Callable[[DataType], DataType]


def _same(tensors, scalars):
    return promote(tensors, scalars)


def _floating(tensors, scalars):
    return float_result(promote(tensors, scalars))


def _numeric(tensors, scalars):
    dtype = promote(tensors, scalars)
    if dtype is DataType.Bool:
        raise DefinitionError(
            "clamp: every operand is Bool, and torch.clamp refuses Bool; cast x to a number "
            "type first (fd.ops.cast(x, DataType.Int32)), or use logical_and / logical_or"
        )
    return dtype


def _logical(tensors, scalars):
    return DataType.Bool


ARITH = TypeRule(_same, lambda t: t)
FLOATING = TypeRule(_floating, lambda t: t)
COMPARE = TypeRule(_same, lambda t: DataType.Bool)  # also isnan / isinf / isfinite
NUMERIC = TypeRule(_numeric, lambda t: t)  # ARITH without Bool (clamp)
LOGICAL = TypeRule(_logical, lambda t: DataType.Bool)  # operands taken as `!= 0`, as torch does


@dataclass(frozen=True)
class ElementwiseOp:
    name: str
    arity: int
    types: TypeRule
    cuda: str  # Python format string over the operand expressions {0}, {1}, {2}
    reference: Callable  # numpy function on float64 / int64 / bool arrays
    doc: str
    # the reference where the op computes in float and the kernel's math differs from the
    # exact one by design (fm::exp's flush and overflow), else None: `reference`
    float_reference: Callable | None = None


@dataclass(frozen=True)
class ReductionOp:
    name: str
    functor: str  # CUDA functor combining two partial values (templates/fuser_math.cuh)
    identity: str  # CUDA expression of the identity, over the compute type {t}
    reference: Callable  # numpy reduction taking (array, axis=, keepdims=)
    doc: str


# fm::exp in float is ex2.approx.ftz of x log2(e): results below 2^-126 flush to 0, and
# from 2^128 on it is inf (templates/fuser_math.cuh).
_FLOAT_EXP_FLUSH = -126 * math.log(2)
_FLOAT_EXP_OVERFLOW = 128 * math.log(2)


def _float_exp(x):
    """exp as fm::exp computes it in float, otherwise exact: 0 below x = -87.34, inf from
    x = 88.72 (a comparison with 0 downstream sees the kernel's 0, not 6.7e-39)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        exact = np.exp(x)
    return np.where(x < _FLOAT_EXP_FLUSH, 0.0, np.where(x >= _FLOAT_EXP_OVERFLOW, np.inf, exact))


def _silu(x, exp=np.exp):
    return x / (1.0 + exp(-x))


def _sigmoid(x, exp=np.exp):
    return 1.0 / (1.0 + exp(-x))


def _where(c, a, b):
    return np.where(c, a, b)


_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    """erf in float64 through the C library's erf (numpy has none): exact to an ulp, about
    0.1 us per element."""
    return np.asarray(_ERF(np.asarray(x, dtype=np.float64)), dtype=np.float64)


def _softplus(x, beta, threshold, exp=np.exp):
    y = x * beta
    with np.errstate(over="ignore"):
        return np.where(y > threshold, x, np.log1p(exp(y)) / beta)


def _in_float(reference: Callable) -> Callable:
    """`reference` with fm::exp's float behaviour (_float_exp) for its exp."""
    return functools.partial(reference, exp=_float_exp)


def _clamp(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)  # numpy's maximum / minimum propagate NaN


def _float_class(test: Callable, integers: bool) -> Callable:
    """`test` on float arrays; `integers` for every element of an int or bool array."""

    def reference(x):
        x = np.asarray(x)
        return test(x) if x.dtype.kind == "f" else np.full(x.shape, integers)

    return reference


ELEMENTWISE: dict[str, ElementwiseOp] = {
    op.name: op
    for op in [
        ElementwiseOp("add", 2, ARITH, "({0} + {1})", np.add, "a + b"),
        ElementwiseOp("sub", 2, ARITH, "({0} - {1})", np.subtract, "a - b"),
        ElementwiseOp("mul", 2, ARITH, "({0} * {1})", np.multiply, "a * b"),
        ElementwiseOp("div", 2, FLOATING, "({0} / {1})", np.divide, "true division a / b"),
        ElementwiseOp("pow", 2, ARITH, "fm::pow({0}, {1})", np.power, "a ** b"),
        ElementwiseOp("maximum", 2, ARITH, "fm::max({0}, {1})", np.maximum,
                      "larger of a, b (NaN if either is NaN, as torch.maximum)"),
        ElementwiseOp("minimum", 2, ARITH, "fm::min({0}, {1})", np.minimum,
                      "smaller of a, b (NaN if either is NaN, as torch.minimum)"),
        ElementwiseOp("eq", 2, COMPARE, "({0} == {1})", np.equal, "a == b"),
        ElementwiseOp("ne", 2, COMPARE, "({0} != {1})", np.not_equal, "a != b"),
        ElementwiseOp("lt", 2, COMPARE, "({0} < {1})", np.less, "a < b"),
        ElementwiseOp("le", 2, COMPARE, "({0} <= {1})", np.less_equal, "a <= b"),
        ElementwiseOp("gt", 2, COMPARE, "({0} > {1})", np.greater, "a > b"),
        ElementwiseOp("ge", 2, COMPARE, "({0} >= {1})", np.greater_equal, "a >= b"),
        ElementwiseOp("neg", 1, ARITH, "(-{0})", np.negative, "-a"),
        ElementwiseOp("abs", 1, ARITH, "fm::abs({0})", np.abs, "|a|"),
        ElementwiseOp("relu", 1, ARITH, "fm::relu({0})", lambda x: np.maximum(x, 0),
                      "max(a, 0); NaN stays NaN, as torch.relu"),
        ElementwiseOp("reciprocal", 1, FLOATING, "fm::reciprocal({0})", np.reciprocal, "1 / a"),
        ElementwiseOp("sqrt", 1, FLOATING, "fm::sqrt({0})", np.sqrt, "square root"),
        ElementwiseOp("rsqrt", 1, FLOATING, "fm::rsqrt({0})", lambda x: 1.0 / np.sqrt(x), "1/sqrt"),
        ElementwiseOp("exp", 1, FLOATING, "fm::exp({0})", np.exp,
                      "e ** a; in float fuser's fast exp: results below 2^-126 (a < -87.3) "
                      "are 0, and from a = 88.7 on inf", _float_exp),
        ElementwiseOp("log", 1, FLOATING, "fm::log({0})", np.log, "natural logarithm"),
        ElementwiseOp("tanh", 1, FLOATING, "fm::tanh({0})", np.tanh, "hyperbolic tangent"),
        ElementwiseOp("sigmoid", 1, FLOATING, "fm::sigmoid({0})", _sigmoid, "1 / (1 + e ** -a)",
                      _in_float(_sigmoid)),
        ElementwiseOp("silu", 1, FLOATING, "fm::silu({0})", _silu, "a * sigmoid(a)",
                      _in_float(_silu)),
        ElementwiseOp("where", 3, ARITH, "({0} ? {1} : {2})", _where, "b where cond else c"),
        ElementwiseOp("erf", 1, FLOATING, "fm::erf({0})", _erf,
                      "the error function (exact GELU: x * 0.5 * (1 + erf(x / sqrt(2))))"),
        ElementwiseOp("log1p", 1, FLOATING, "fm::log1p({0})", np.log1p,
                      "log(1 + a), accurate for small a (-1 gives -inf, below -1 NaN)"),
        ElementwiseOp("expm1", 1, FLOATING, "fm::expm1({0})", np.expm1,
                      "e ** a - 1, accurate for small a (-inf gives -1)"),
        ElementwiseOp(
            "softplus", 3, FLOATING, "fm::softplus({0}, {1}, {2})", _softplus,
            "softplus(x, beta=1.0, threshold=20.0), as torch: x where x * beta > threshold, "
            "else log1p(exp(x * beta)) / beta. beta and threshold may be numbers, scalars or "
            "tensors. Unlike torch, int and bool x are computed as Float (torch refuses them); "
            "in float, exp is fuser's fast one, so results below 2^-126 (x * beta < -87) "
            "are 0, and with a threshold above 88 exp overflows first: x * beta between 88.7 "
            "and the threshold gives inf, as torch's float softplus does (the oracle too)",
            _in_float(_softplus),
        ),
        ElementwiseOp(
            "clamp", 3, NUMERIC, "fm::clamp({0}, {1}, {2})", _clamp,
            "clamp(x, min=None, max=None), as torch: min(max(x, min), max), so max where min > "
            "max; a NaN in x, min or max gives NaN; bounds are numbers, scalars or tensors and "
            "take part in type promotion; Bool operands are refused. Where x and a bound are "
            "zeros of opposite signs the zero's sign is unspecified (torch's CPU and CUDA "
            "differ too)",
        ),
        ElementwiseOp("isnan", 1, COMPARE, "fm::isnan({0})", _float_class(np.isnan, False),
                      "a is NaN (Bool; never for int and bool a)"),
        ElementwiseOp("isinf", 1, COMPARE, "fm::isinf({0})", _float_class(np.isinf, False),
                      "a is +inf or -inf (Bool; never for int and bool a)"),
        ElementwiseOp("isfinite", 1, COMPARE, "fm::isfinite({0})",
                      _float_class(np.isfinite, True),
                      "a is neither NaN nor inf (Bool; always for int and bool a)"),
        ElementwiseOp("logical_and", 2, LOGICAL, "({0} && {1})", np.logical_and,
                      "a and b, each true where nonzero (NaN is true), as torch (Bool)"),
        ElementwiseOp("logical_or", 2, LOGICAL, "({0} || {1})", np.logical_or,
                      "a or b, each true where nonzero (NaN is true), as torch (Bool)"),
        ElementwiseOp("logical_not", 1, LOGICAL, "(!{0})", np.logical_not,
                      "not a: true where a is zero, as torch (Bool)"),
    ]
}

_EXTREME_DOC = (
    "{0} over dims, as torch.{1} (int and bool values too; the result keeps x's dtype unless "
    "dtype= is given); a NaN anywhere in the reduced values gives NaN, as torch.{1}"
)

REDUCTIONS: dict[str, ReductionOp] = {
    op.name: op
    for op in [
        ReductionOp("sum", "fm::Sum", "{t}(0)", np.sum,
                    "sum over dims, as torch.sum (bool and int values add up in Int64 unless "
                    "dtype= is given)"),
        ReductionOp("max", "fm::Max", "fm::lowest<{t}>()", np.max,
                    _EXTREME_DOC.format("maximum", "amax")),
        ReductionOp("min", "fm::Min", "fm::highest<{t}>()", np.min,
                    _EXTREME_DOC.format("minimum", "amin")),
    ]
}


# Ops that move elements to other positions: no kernel runs them. Segmentation cuts the fusion
# at each; the executor makes the result from its operand between kernels (permute: a
# contiguous copy in the new order; reshape: a view, the same bytes).
LAYOUT_OPS = ("permute", "reshape", "expand")


def sum_result_type(dtype: DataType) -> DataType:
    """torch.sum's result type: bools and ints accumulate in Int64, floats keep their type."""
    return dtype if dtype.is_float else DataType.Int64
