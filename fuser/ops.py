"""The op table: one entry per elementwise or reduction op.

Each entry is the single source of truth for an op: how many operands it takes, the type its
operands are computed in and the type it returns, the CUDA expression codegen emits (operands
already converted to the operand type, `fm::` helpers from templates/fuser_math.cuh), and the
numpy function the float64 reference evaluator runs. Ops with structure (cast, broadcast_in_dim,
size, var_mean) live in ir.py; they are not elementwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fuser.dtypes import DataType, float_result, promote


@dataclass(frozen=True)
class TypeRule:
    """How an op types its operands and its result, from the operands' types."""

    operand: Callable[[list[DataType], list[DataType]], DataType]
    result: Callable[[DataType], DataType]


def _same(tensors, scalars):
    return promote(tensors, scalars)


def _floating(tensors, scalars):
    return float_result(promote(tensors, scalars))


ARITH = TypeRule(_same, lambda t: t)
FLOATING = TypeRule(_floating, lambda t: t)
COMPARE = TypeRule(_same, lambda t: DataType.Bool)


@dataclass(frozen=True)
class ElementwiseOp:
    name: str
    arity: int
    types: TypeRule
    cuda: str  # Python format string over the operand expressions {0}, {1}, {2}
    reference: Callable  # numpy function on float64 / int64 / bool arrays
    doc: str


@dataclass(frozen=True)
class ReductionOp:
    name: str
    functor: str  # CUDA functor combining two partial values (templates/fuser_math.cuh)
    identity: str  # CUDA expression of the identity, over the compute type {t}
    reference: Callable  # numpy reduction taking (array, axis=, keepdims=)
    doc: str


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _where(c, a, b):
    return np.where(c, a, b)


ELEMENTWISE: dict[str, ElementwiseOp] = {
    op.name: op
    for op in [
        ElementwiseOp("add", 2, ARITH, "({0} + {1})", np.add, "a + b"),
        ElementwiseOp("sub", 2, ARITH, "({0} - {1})", np.subtract, "a - b"),
        ElementwiseOp("mul", 2, ARITH, "({0} * {1})", np.multiply, "a * b"),
        ElementwiseOp("div", 2, FLOATING, "({0} / {1})", np.divide, "true division a / b"),
        ElementwiseOp("pow", 2, ARITH, "fm::pow({0}, {1})", np.power, "a ** b"),
        ElementwiseOp("maximum", 2, ARITH, "fm::max({0}, {1})", np.maximum, "larger of a, b"),
        ElementwiseOp("minimum", 2, ARITH, "fm::min({0}, {1})", np.minimum, "smaller of a, b"),
        ElementwiseOp("eq", 2, COMPARE, "({0} == {1})", np.equal, "a == b"),
        ElementwiseOp("ne", 2, COMPARE, "({0} != {1})", np.not_equal, "a != b"),
        ElementwiseOp("lt", 2, COMPARE, "({0} < {1})", np.less, "a < b"),
        ElementwiseOp("le", 2, COMPARE, "({0} <= {1})", np.less_equal, "a <= b"),
        ElementwiseOp("gt", 2, COMPARE, "({0} > {1})", np.greater, "a > b"),
        ElementwiseOp("ge", 2, COMPARE, "({0} >= {1})", np.greater_equal, "a >= b"),
        ElementwiseOp("neg", 1, ARITH, "(-{0})", np.negative, "-a"),
        ElementwiseOp("abs", 1, ARITH, "fm::abs({0})", np.abs, "|a|"),
        ElementwiseOp("relu", 1, ARITH, "fm::relu({0})", lambda x: np.maximum(x, 0), "max(a, 0)"),
        ElementwiseOp("reciprocal", 1, FLOATING, "fm::reciprocal({0})", np.reciprocal, "1 / a"),
        ElementwiseOp("sqrt", 1, FLOATING, "fm::sqrt({0})", np.sqrt, "square root"),
        ElementwiseOp("rsqrt", 1, FLOATING, "fm::rsqrt({0})", lambda x: 1.0 / np.sqrt(x), "1/sqrt"),
        ElementwiseOp("exp", 1, FLOATING, "fm::exp({0})", np.exp, "e ** a"),
        ElementwiseOp("log", 1, FLOATING, "fm::log({0})", np.log, "natural logarithm"),
        ElementwiseOp("tanh", 1, FLOATING, "fm::tanh({0})", np.tanh, "hyperbolic tangent"),
        ElementwiseOp("sigmoid", 1, FLOATING, "fm::sigmoid({0})", _sigmoid, "1 / (1 + e ** -a)"),
        ElementwiseOp("silu", 1, FLOATING, "fm::silu({0})", _silu, "a * sigmoid(a)"),
        ElementwiseOp("where", 3, ARITH, "({0} ? {1} : {2})", _where, "b where cond else c"),
    ]
}

REDUCTIONS: dict[str, ReductionOp] = {
    op.name: op
    for op in [
        ReductionOp("sum", "fm::Sum", "{t}(0)", np.sum, "sum over dims"),
        ReductionOp("max", "fm::Max", "fm::lowest<{t}>()", np.max, "maximum over dims"),
    ]
}


def sum_result_type(dtype: DataType) -> DataType:
    """torch.sum's result type: bools and ints accumulate in Int64, floats keep their type."""
    return dtype if dtype.is_float else DataType.Int64
