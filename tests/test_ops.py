"""CPU: the elementwise ops added for issue 15 (erf, log1p, expm1, softplus, clamp, isnan, isinf,
isfinite, logical_and / logical_or / logical_not) and fd.ops misuse.

For every new op: its typing for Bool / Int / Float operands; the float64 oracle against torch's
semantics written out element by element with Python's math module (NaN, inf, -0.0 and the
other edges included); its CUDA through NVRTC for every compute type it can get; and small
fusions using it (pointwise, and an inner normalization that reduces it) built offline for the
H200 at hidden 1, 7 and 1000 with zero spills. fd.ops misuse: unknown ops and wrong keywords or
argument counts are DefinitionErrors naming what exists."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from fuser import DataType, DefinitionError, FusionDefinition, UnknownOpError
from fuser.analysis import analyze
from fuser.cache import KernelCache
from fuser.codegen import template_dir
from fuser.compile import compile_cuda
from fuser.device import PRESETS
from fuser.ir import Tensor
from fuser.kernels import build
from fuser.ops import ELEMENTWISE
from fuser.reference import evaluate
from fuser.schedulers import Problem

BF16, HALF, FLOAT, DOUBLE = DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double
INT32, INT64, BOOL = DataType.Int32, DataType.Int64, DataType.Bool
H200 = PRESETS["h200"]

NEW_OPS = ("erf", "log1p", "expm1", "softplus", "clamp", "isnan", "isinf", "isfinite",
           "logical_and", "logical_or", "logical_not")
FLOAT_FUNCTIONS = ("erf", "log1p", "expm1", "softplus")
CLASSES = ("isnan", "isinf", "isfinite")
LOGICAL = ("logical_and", "logical_or", "logical_not")

INF, NAN = math.inf, math.nan
EDGES = [NAN, INF, -INF, -0.0, 0.0, 5e-324, 1e-300, -1e-300, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0,
         -1.0 - 2**-40, -1.5, 2.0, 3.5, -3.5, 6.0, 19.5, 20.0, 20.5, -20.0, 30.0, 88.0, -88.0,
         89.0, 100.0, -100.0, 710.0, -710.0, 1e300, -1e300]


def test_every_new_op_is_in_the_table():
    assert set(NEW_OPS) <= set(ELEMENTWISE)
    for name in NEW_OPS:
        op = ELEMENTWISE[name]
        assert op.doc and op.cuda and callable(op.reference)
        assert op.arity == (3 if name in ("clamp", "softplus") else 2 if name in
                            ("logical_and", "logical_or") else 1)


# ----- typing -----------------------------------------------------------------------------------

TYPED = [BOOL, INT32, INT64, HALF, BF16, FLOAT, DOUBLE]


def _result(name: str, dtype: DataType, bounds=(0, 1)) -> tuple[DataType, DataType]:
    """(result dtype, compute dtype) of `name` on a [-1] tensor of `dtype`."""
    fd = FusionDefinition()
    x = fd.define_tensor([-1], dtype=dtype)
    if name == "clamp":
        y = fd.ops.clamp(x, *bounds)
    elif name in ("logical_and", "logical_or"):
        y = getattr(fd.ops, name)(x, x)
    else:
        y = getattr(fd.ops, name)(x)
    assert isinstance(y, Tensor) and y.definition is not None
    return y.dtype, y.definition.attr("compute")


@pytest.mark.parametrize("dtype", TYPED, ids=lambda d: d.name)
@pytest.mark.parametrize("name", FLOAT_FUNCTIONS)
def test_float_functions_type_ints_and_bools_as_float(name, dtype):
    expected = dtype if dtype.is_float else FLOAT
    assert _result(name, dtype) == (expected, expected)


@pytest.mark.parametrize("dtype", TYPED, ids=lambda d: d.name)
@pytest.mark.parametrize("name", CLASSES + LOGICAL)
def test_classes_and_logical_ops_give_bool(name, dtype):
    result, compute = _result(name, dtype)
    assert result is BOOL
    # the classes test the value in its own type; logical ops take `!= 0` of each operand
    assert compute is (BOOL if name in LOGICAL else dtype)


@pytest.mark.parametrize(("dtype", "bounds", "expected"), [
    (INT32, (0, 1), INT32),  # int bounds keep an int tensor's type
    (INT64, (0, 1), INT64),
    (BOOL, (0, 1), INT64),  # as torch: an int scalar over a Bool tensor is Int64
    (INT32, (0.5, 2.5), FLOAT),  # float bounds promote an int tensor to Float (as torch)
    (BOOL, (None, 2.5), FLOAT),
    (BF16, (0.5, 2.5), BF16),  # a number does not raise a tensor's float type
    (HALF, (-1, None), HALF),
    (FLOAT, (0, 1), FLOAT),
    (DOUBLE, (None, 1), DOUBLE),
], ids=str)
def test_clamp_typing(dtype, bounds, expected):
    assert _result("clamp", dtype, bounds) == (expected, expected)


def test_clamp_tensor_bounds_promote():
    fd = FusionDefinition()
    x = fd.define_tensor([-1, -1], dtype=BF16)
    lo = fd.define_tensor([-1], dtype=HALF)
    hi = fd.define_tensor([-1, 1], dtype=INT32)
    y = fd.ops.clamp(x, lo, hi)
    assert y.dtype is FLOAT and len(y.dims) == 2  # bf16 with half is Float, as torch
    assert fd.ops.clamp(hi, None, fd.define_scalar(dtype=FLOAT)).dtype is FLOAT


def test_clamp_refuses_bool_and_impossible_int_bounds():
    fd = FusionDefinition()
    b = fd.define_tensor([-1], dtype=BOOL)
    with pytest.raises(DefinitionError, match=r"clamp: every operand is Bool"):
        fd.ops.clamp(b, False, True)
    with pytest.raises(DefinitionError, match=r"min and max are both None"):
        fd.ops.clamp(b)
    i = fd.define_tensor([-1], dtype=INT32)
    with pytest.raises(DefinitionError, match=r"min=4294967296 is outside the range of "
                                              r"DataType.Int32"):
        fd.ops.clamp(i, 2**32)
    with pytest.raises(DefinitionError, match=r"max=-4294967296 is outside the range"):
        fd.ops.clamp(i, None, -(2**32))


def test_softplus_defaults_and_scalar_operands():
    fd = FusionDefinition()
    x = fd.define_tensor([-1], dtype=BF16)
    y = fd.ops.softplus(x)
    assert y.definition is not None
    beta, threshold = y.definition.inputs[1:]
    assert (beta.value, threshold.value) == (1.0, 20.0)  # torch's defaults
    s = fd.define_scalar(dtype=FLOAT)
    z = fd.ops.softplus(x, beta=s, threshold=5)
    assert z.dtype is BF16 and z.definition is not None and z.definition.inputs[1] is s


# ----- the oracle against torch's semantics, element by element ---------------------------------


def _erf_series(x: float) -> float:
    """erf without the C library: 2/sqrt(pi) e^-x^2 sum (2x^2)^n x / (2n+1)!! (terms all of one
    sign, so no cancellation) below 3, 1 - erfc's continued fraction above."""
    if math.isnan(x) or x == 0:
        return x
    a = abs(x)
    if a < 3:
        term = total = a
        n = 0
        while term > 1e-18 * total:
            n += 1
            term *= 2 * a * a / (2 * n + 1)
            total += term
        value = 2 / math.sqrt(math.pi) * math.exp(-a * a) * total
    elif a < 27:
        fraction = 0.0
        for k in range(200, 0, -1):
            fraction = (k / 2) / (a + fraction)
        value = 1 - math.exp(-a * a) / math.sqrt(math.pi) / (a + fraction)
    else:
        value = 1.0
    return math.copysign(value, x)


def _log1p(x: float) -> float:
    if x == -1:
        return -INF
    return NAN if x < -1 or math.isnan(x) else math.log1p(x)


def _expm1(x: float) -> float:
    try:
        return math.expm1(x)
    except OverflowError:
        return INF


def _exp(y: float) -> float:
    try:
        return math.exp(y)
    except OverflowError:
        return INF


def _float_exp(y: float) -> float:
    """fm::exp in float: 0 below 2^-126 (flushed), inf from 2^128."""
    if y < -126 * math.log(2):
        return 0.0
    return INF if y >= 128 * math.log(2) else math.exp(y)


def _softplus(x: float, beta: float = 1.0, threshold: float = 20.0, exp=_exp) -> float:
    """torch: x where x * beta > threshold, else log1p(exp(x * beta)) / beta."""
    y = x * beta
    if y > threshold:
        return x
    return math.log1p(exp(y)) / beta


def _clamp(x, lo, hi):
    """torch.clamp: a NaN of x, then of min, then of max wins; else min(max(x, lo), hi)."""
    for v in (x, lo, hi):
        if isinstance(v, float) and math.isnan(v):
            return v
    m = lo if x < lo else x
    return hi if hi < m else m


DIRECT = {
    "erf": _erf_series,
    "log1p": _log1p,
    "expm1": _expm1,
    "softplus": _softplus,
    "isnan": lambda x: isinstance(x, float) and math.isnan(x),
    "isinf": lambda x: isinstance(x, float) and math.isinf(x),
    "isfinite": lambda x: not isinstance(x, float) or math.isfinite(x),
    "logical_not": lambda x: not x,  # bool(nan) is True, bool(-0.0) False, as torch
    "logical_and": lambda a, b: bool(a) and bool(b),
    "logical_or": lambda a, b: bool(a) or bool(b),
    "clamp": _clamp,
}
# computed in float, with the kernel's exp (the oracle follows it: ops.float_reference)
IN_FLOAT = {**DIRECT, "softplus": functools.partial(_softplus, exp=_float_exp)}


def _stored(values, dtype: DataType) -> np.ndarray:
    """`values` (float64) as a kernel stores a `dtype` output: through float32, then to dtype."""
    x = np.asarray(values, dtype=np.float64)
    if dtype is DOUBLE:
        return x
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(dtype.numpy).astype(np.float64)


def _same(got: np.ndarray, expected: np.ndarray, rtol: float = 4e-16, zeros: bool = True):
    """Equal within `rtol`, NaN where NaN, infinities equal, and (if `zeros`) zeros of the
    same sign."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape
    if expected.dtype == bool:
        assert got.dtype == bool and np.array_equal(got, expected), (got, expected)
        return
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=0, equal_nan=True)
    if zeros:
        z = expected == 0
        assert np.array_equal(np.signbit(got[z]), np.signbit(expected[z])), (got[z], expected[z])


def _unary_fusion(name: str, dtype: DataType, **keywords) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        x = fd.define_tensor([-1], dtype=dtype)
        fd.add_output(getattr(fd.ops, name)(x, **keywords))
    return fd


@pytest.mark.parametrize("name", FLOAT_FUNCTIONS + CLASSES + ("logical_not",))
def test_unary_oracle_matches_torch_semantics_in_double(name):
    (got,) = evaluate(_unary_fusion(name, DOUBLE).fusion, [np.array(EDGES)])
    expected = np.array([DIRECT[name](x) for x in EDGES])
    # erf: the oracle is the C library's, the direct value a series: a few ulp apart
    _same(got, expected, rtol=1e-14 if name == "erf" else 4e-16)


@pytest.mark.parametrize("dtype", [FLOAT, BF16, HALF], ids=lambda d: d.name)
@pytest.mark.parametrize("name", FLOAT_FUNCTIONS + CLASSES + ("logical_not",))
def test_unary_oracle_rounds_inputs_and_outputs_as_kernels(name, dtype):
    """An input holds its dtype's value; a float output is stored rounded (through float32);
    softplus's exp is the kernel's (flushed below 2^-126)."""
    with np.errstate(over="ignore"):
        x = np.array(EDGES).astype(np.float32).astype(dtype.numpy)
    (got,) = evaluate(_unary_fusion(name, dtype).fusion, [x])
    exact = np.array([IN_FLOAT[name](float(v)) for v in x.astype(np.float64)])
    expected = exact if exact.dtype == bool else _stored(exact, dtype)
    _same(got, expected, rtol=0 if name != "erf" else 1e-14)


@pytest.mark.parametrize("dtype", [BOOL, INT32, INT64], ids=lambda d: d.name)
@pytest.mark.parametrize("name", FLOAT_FUNCTIONS + CLASSES + ("logical_not",))
def test_unary_oracle_on_ints_and_bools(name, dtype):
    values = np.array([0, 1, -1, 3, -7, 2**31 - 1, -(2**31)] if dtype is not BOOL
                      else [True, False, True])
    x = values.astype(dtype.numpy)
    (got,) = evaluate(_unary_fusion(name, dtype).fusion, [x])
    if name in FLOAT_FUNCTIONS:  # computed as Float: the int as a float32, the output stored
        operands = x.astype(np.float32).astype(np.float64)
        _same(got, _stored([DIRECT[name](float(v)) for v in operands], FLOAT), rtol=1e-14)
    else:
        _same(got, np.array([DIRECT[name](int(v)) for v in x]))


@pytest.mark.parametrize("name", ["logical_and", "logical_or"])
def test_logical_binary_oracle(name):
    pairs = [(a, b) for a in (NAN, 0.0, -0.0, 1.5, -INF) for b in (NAN, 0.0, -0.0, 2.0, INF)]
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1], dtype=DOUBLE)
        b = fd.define_tensor([-1], dtype=INT32)  # mixed types: each operand taken as != 0
        f = fd.define_tensor([-1], dtype=DOUBLE)
        op = getattr(fd.ops, name)
        fd.add_output(op(a, f))
        fd.add_output(op(a, b))
        fd.add_output(op(a, 1e-50))  # a Double number below float32's range is still true
    xa, xf = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    xb = np.array([0, 3, -1, 0, 7] * 5, dtype=np.int32)
    got_f, got_b, got_s = evaluate(fd.fusion, [xa, xb, xf])
    _same(got_f, np.array([DIRECT[name](p, q) for p, q in pairs]))
    _same(got_b, np.array([DIRECT[name](p, int(q)) for p, q in zip(xa, xb, strict=True)]))
    _same(got_s, np.array([DIRECT[name](p, 1e-50) for p in xa]))


SOFTPLUS_PARAMS = [(1.0, 20.0), (2.0, 10.0), (0.5, 20.0), (-1.0, 20.0), (1.0, 0.0), (3, 1000.0)]


@pytest.mark.parametrize(("beta", "threshold"), SOFTPLUS_PARAMS, ids=str)
def test_softplus_beta_and_threshold(beta, threshold):
    """Numbers, then the same values as scalar inputs given at run time."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DOUBLE)
        s_beta, s_threshold = fd.define_scalar(dtype=DOUBLE), fd.define_scalar(dtype=DOUBLE)
        fd.add_output(fd.ops.softplus(x, beta, threshold))
        fd.add_output(fd.ops.softplus(x, beta=s_beta, threshold=s_threshold))
    got, got_scalars = evaluate(fd.fusion, [np.array(EDGES), float(beta), float(threshold)])
    expected = np.array([_softplus(v, beta, threshold) for v in EDGES])
    _same(got, expected, rtol=1e-15)
    _same(got_scalars, expected, rtol=1e-15)


CLAMP_VALUES = [NAN, -INF, INF, -0.0, 0.0, -2.0, -1.0, 0.5, 1.0, 3.0]


def test_clamp_tensor_bounds_every_edge_combination():
    """All of x, min, max tensors: every combination of NaN, infinities, zeros, min > max."""
    triples = [(x, lo, hi) for x in CLAMP_VALUES for lo in CLAMP_VALUES for hi in CLAMP_VALUES]
    with FusionDefinition() as fd:
        ts = [fd.define_tensor([-1], dtype=DOUBLE) for _ in range(3)]
        fd.add_output(fd.ops.clamp(*ts))
    (got,) = evaluate(fd.fusion, [np.array(c) for c in zip(*triples, strict=True)])
    expected = np.array([_clamp(*t) for t in triples])
    # where x and a bound are zeros of opposite signs the zero's sign is unspecified (doc)
    _same(got, expected, rtol=0, zeros=False)
    assert np.isnan(expected).sum() == 10 * 10 * 10 - 9 * 9 * 9  # a NaN anywhere gives NaN


@pytest.mark.parametrize(("lo", "hi"), [(-1.0, 1.0), (1.0, -1.0), (None, 0.5), (-0.5, None),
                                        (NAN, 1.0), (0.0, NAN), (-INF, INF), (0, 2)], ids=str)
def test_clamp_number_and_scalar_bounds(lo, hi):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=DOUBLE)
        fd.add_output(fd.ops.clamp(x, lo, hi))
        given = [fd.define_scalar(dtype=DOUBLE) if b is not None else None for b in (lo, hi)]
        fd.add_output(fd.ops.clamp(x, min=given[0], max=given[1]))
    got, got_scalars = evaluate(fd.fusion, [np.array(EDGES)] + [float(b) for b in (lo, hi)
                                                                 if b is not None])
    expected = np.array([_clamp(v, -INF if lo is None else lo, INF if hi is None else hi)
                         for v in EDGES])
    _same(got, expected, rtol=0, zeros=False)
    _same(got_scalars, expected, rtol=0, zeros=False)


@pytest.mark.parametrize("dtype", [INT32, INT64], ids=lambda d: d.name)
def test_clamp_ints(dtype):
    info = np.iinfo(dtype.numpy)
    x = np.array([info.min, -5, -1, 0, 1, 5, info.max], dtype=dtype.numpy)
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], dtype=dtype)
        fd.add_output(fd.ops.clamp(t, -1, 3))
        fd.add_output(fd.ops.clamp(t, None, 2))
        fd.add_output(fd.ops.clamp(t, 3, -1))  # min > max: max everywhere
        fd.add_output(fd.ops.clamp(t, -(2**70) if dtype is INT64 else -(2**40), 2**40))
        fd.add_output(fd.ops.clamp(t, 0.5, 2.5))  # float bounds: a Float result
    a, b, c, d, e = evaluate(fd.fusion, [x])
    ints = [int(v) for v in x]
    assert a.tolist() == [_clamp(v, -1, 3) for v in ints]
    assert b.tolist() == [min(v, 2) for v in ints]
    assert c.tolist() == [-1] * len(ints)
    assert d.tolist() == ints if dtype is INT32 else True
    _same(e, _stored([_clamp(float(np.float32(v)), 0.5, 2.5) for v in ints], FLOAT), rtol=0)


def test_clamp_int32_bound_beyond_its_range_cuts_nothing():
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], dtype=INT32)
        fd.add_output(fd.ops.clamp(t, -(2**40), 2**40))
    x = np.array([-(2**31), 0, 2**31 - 1], dtype=np.int32)
    assert evaluate(fd.fusion, [x])[0].tolist() == x.tolist()


def test_exact_gelu_with_erf():
    """GELU as torch computes it (approximate='none'): x / 2 (1 + erf(x / sqrt 2))."""
    x = np.concatenate([np.linspace(-6, 6, 97), [NAN, INF, -INF, -0.0]])
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], dtype=DOUBLE)
        erf = fd.ops.erf(fd.ops.mul(t, 1 / math.sqrt(2)))
        fd.add_output(fd.ops.mul(fd.ops.mul(t, 0.5), fd.ops.add(erf, 1.0)))
    (got,) = evaluate(fd.fusion, [x])
    with np.errstate(invalid="ignore"):  # -inf * (1 + erf(-inf)) is -inf * 0: NaN, as in torch
        expected = np.array([v * 0.5 * (1 + _erf_series(v / math.sqrt(2))) for v in x])
    # 1 + erf cancels for negative x: an ulp of erf (1.1e-16) times |x| (up to 6) is absolute
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=1e-14, equal_nan=True)


def test_erf_oracle_against_the_series_on_a_grid():
    x = np.concatenate([np.linspace(-8, 8, 4001), np.geomspace(1e-12, 30, 500)])
    with FusionDefinition() as fd:
        t = fd.define_tensor([-1], dtype=DOUBLE)
        fd.add_output(fd.ops.erf(t))
    (got,) = evaluate(fd.fusion, [x])
    np.testing.assert_allclose(got, [_erf_series(v) for v in x], rtol=1e-14, atol=0)


# ----- CUDA: each op's expression for every compute type it can get, through NVRTC -------------

COMPUTE_TYPES = {
    **dict.fromkeys(FLOAT_FUNCTIONS, ("float", "double")),
    **dict.fromkeys(CLASSES, ("bool", "int", "long long", "float", "double")),
    "clamp": ("int", "long long", "float", "double"),
    **dict.fromkeys(LOGICAL, ("bool",)),
}


def test_every_new_op_cuda_compiles_with_its_result_type():
    """What emit.py writes for an op (its CUDA over operands already in the compute type), in
    a device function per compute type, static_assert-ed to give the op table's result type."""
    lines = ['#include "fuser_math.cuh"',
             "template <typename A, typename B> struct same { static constexpr bool v = false; };",
             "template <typename A> struct same<A, A> { static constexpr bool v = true; };"]
    for name in NEW_OPS:
        for i, ctype in enumerate(COMPUTE_TYPES[name]):
            result = "bool" if name in CLASSES + LOGICAL else ctype
            expr = ELEMENTWISE[name].cuda.format("a", "b", "c")
            lines += [f"__device__ {result} op_{name}_{i}({ctype} a, {ctype} b, {ctype} c) {{",
                      f"  static_assert(same<decltype({expr}), {result}>::v, \"{name}\");",
                      f"  return {expr};", "}"]
    lines.append('extern "C" __global__ void ops_probe(float* y) { y[0] = '
                 'fm::softplus(y[1], y[2], y[3]) + fm::clamp(y[1], y[2], y[3]); }')
    compiled = compile_cuda("\n".join(lines) + "\n", "ops_probe", H200.arch,
                            (str(template_dir()),))
    assert compiled.resource("ops_probe").spills == 0


# ----- small fusions using each op, built offline ------------------------------------------------


def _apply(fd: FusionDefinition, name: str, x, w, s):
    """`name` over a [rows, hidden] Float value x, a [hidden] weight broadcast w and a Float
    scalar input s: tensor, broadcast, scalar and constant operands."""
    ops = fd.ops
    if name == "softplus":
        return ops.softplus(x, ops.add(s, 1.0), 20.0)
    if name == "clamp":
        return ops.clamp(x, w, s)  # a tensor min, a scalar max
    if name == "logical_and":
        return ops.logical_and(x, ops.gt(w, s))
    if name == "logical_or":
        return ops.logical_or(ops.lt(x, s), w)
    return getattr(ops, name)(x)


def _fusion(name: str, kind: str, dtype: DataType = BF16) -> FusionDefinition:
    """pointwise: the op's value as an output, next to a computed one; inner: the op's value
    summed along rows and broadcast back (an inner persistent normalization)."""
    with FusionDefinition(f"{kind}_{name}") as fd:
        x = fd.define_tensor([-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor([-1], contiguity=[True], dtype=dtype)
        s = fd.define_scalar(dtype=FLOAT)
        xf = fd.ops.cast(x, FLOAT)
        wb = fd.ops.broadcast_in_dim(fd.ops.cast(w, FLOAT), x.shape(), [1])
        y = _apply(fd, name, xf, wb, s)
        yf = fd.ops.cast(y, FLOAT) if y.dtype is BOOL else y
        if kind == "inner":
            total = fd.ops.sum(yf, dims=[1], keepdim=True)
            yf = fd.ops.sub(yf, fd.ops.broadcast_in_dim(total, x.shape(), [0, 1]))
        else:
            fd.add_output(y)
        fd.add_output(fd.ops.cast(fd.ops.add(fd.ops.mul(yf, wb), s), dtype))
    return fd


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> KernelCache:
    return KernelCache(str(tmp_path_factory.mktemp("ops-cache")))


@pytest.mark.parametrize("hidden", [1, 7, 1000])
@pytest.mark.parametrize("kind", ["pointwise", "inner"])
@pytest.mark.parametrize("name", NEW_OPS)
def test_fusion_with_op_compiles_offline(name, kind, hidden, cache):
    fd = _fusion(name, kind)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 1000, 16), H200, cache=cache)
    assert built.schedule.scheduler == ("pointwise" if kind == "pointwise"
                                        else "inner_persistent")
    source = built.source.source
    cuda = ELEMENTWISE[name].cuda
    marker = max(cuda.replace("{", "\0").replace("}", "\0").split("\0"), key=len)
    assert marker.strip() in source, f"{name}: {marker!r} not in the kernel"
    for entry, plan in built.plans():
        r = built.compiled.resource(entry)
        assert not r.spills, f"{entry} spills: {r}"
        assert r.static_smem <= plan.static_slot


@pytest.mark.parametrize("name", NEW_OPS)
def test_fusion_with_op_oracle_and_repr(name, rng):
    """The same fusions through the oracle on bf16 data with edge values, against the op's
    numpy reference applied by hand; repr(fd) rebuilds them."""
    fd = _fusion(name, "pointwise")
    again = FusionDefinition.from_python(repr(fd), fd.name)
    assert again.fusion.python_definition() == fd.fusion.python_definition()
    x = rng.standard_normal((5, 7)) * 4
    x[0, :5] = [NAN, INF, -INF, -0.0, 0.0]
    w = rng.standard_normal(7)
    w[:2] = [NAN, -0.0]
    x, w = (v.astype(np.float32).astype(BF16.numpy) for v in (x, w))
    y, out = evaluate(fd.fusion, [x, w, 0.75])
    xf, wf = x.astype(np.float64), np.broadcast_to(w.astype(np.float64), x.shape)
    with np.errstate(all="ignore"):
        expected = {
            "softplus": lambda: _stored(np.vectorize(_softplus)(xf, 1.75, 20.0), FLOAT),
            "clamp": lambda: np.vectorize(_clamp)(xf, wf, 0.75),
            "logical_and": lambda: (xf != 0) & (wf > 0.75),
            "logical_or": lambda: (xf < 0.75) | (wf != 0),
        }.get(name, lambda: ELEMENTWISE[name].reference(xf))()
    expected = _stored(expected, FLOAT) if expected.dtype != bool else expected
    _same(y, expected, rtol=1e-14, zeros=name != "clamp")
    assert out.shape == x.shape


# ----- fd.ops misuse ------------------------------------------------------------------------------


def test_unknown_op_lists_what_exists():
    fd = FusionDefinition()
    x = fd.define_tensor([-1, -1])
    with pytest.raises(UnknownOpError) as info:
        fd.ops.softmax(x)
    message = str(info.value)
    assert message.startswith("fd.ops has no op 'softmax'")
    assert "Elementwise ops: abs, add, clamp," in message and "erf" in message
    assert "Reductions and structural ops: broadcast_in_dim, cast, max," in message
    assert isinstance(info.value, DefinitionError) and isinstance(info.value, AttributeError)
    with pytest.raises(UnknownOpError, match=r"'amin' \(did you mean min\?"):
        fd.ops.amin(x, [1])  # torch's name: fd.ops.min (a reduction) and minimum (elementwise)
    with pytest.raises(UnknownOpError, match=r"'log1' \(did you mean log1p"):
        fd.ops.log1(x)
    assert not hasattr(fd.ops, "softmax") and not hasattr(fd.ops, "__array__")
    assert set(NEW_OPS) | {"sum", "max", "min", "mean", "var_mean", "var", "cast",
                           "broadcast_in_dim", "size", "shape"} <= set(dir(fd.ops))


@pytest.mark.parametrize(("call", "message"), [
    (lambda ops, x: ops.sum(x, dim=[1]),
     r"fd.ops.sum\(t, dims, keepdim=False, dtype=None\): no keyword 'dim' \(did you mean dims"
     r"\?\); its keywords are t, dims, keepdim, dtype"),
    (lambda ops, x: ops.max(x, [1], keepdims=True), r"no keyword 'keepdims' \(did you mean "
                                                    r"keepdim\?\)"),
    (lambda ops, x: ops.var_mean(x, [1], unbiased=True),
     r"fd.ops.var_mean\(t, dims, correction=1, keepdim=False\): no keyword 'unbiased'; its "
     r"keywords are t, dims, correction, keepdim"),
    (lambda ops, x: ops.cast(x),
     r"fd.ops.cast\(v, dtype, rounds=True\): missing a required argument: 'dtype'"),
    (lambda ops, x: ops.size(x, 0, 1), r"fd.ops.size\(t, dim\): too many positional"),
    (lambda ops, x: ops.broadcast_in_dim(x, shape=[2, 2], dims=[0, 1]),
     r"no keyword 'dims' \(did you mean broadcast_dims\?\)"),
    (lambda ops, x: ops.clamp(x, lo=0), r"fd.ops.clamp\(x, min=None, max=None\): no keyword "
                                        r"'lo'; its keywords are x, min, max"),
    (lambda ops, x: ops.softplus(x, beta=1, thresh=3),
     r"fd.ops.softplus\(x, beta=1.0, threshold=20.0\): no keyword 'thresh' \(did you mean "
     r"threshold\?\)"),
    (lambda ops, x: ops.add(x, other=x), r"fd.ops.add takes its 2 operands by position and no "
                                         r"keywords; got other="),
    (lambda ops, x: ops.erf(x, out=x), r"fd.ops.erf takes its 1 operand by position"),
    (lambda ops, x: ops.logical_and(x), r"logical_and takes 2 operands, got 1"),
    (lambda ops, x: ops.isnan(x, x), r"isnan takes 1 operands, got 2"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_wrong_arguments_are_definition_errors(call, message):
    fd = FusionDefinition()
    with pytest.raises(DefinitionError, match=message):
        call(fd.ops, fd.define_tensor([-1, -1]))


def test_keywords_work_where_allowed():
    fd = FusionDefinition()
    x = fd.define_tensor([-1, -1])
    assert fd.ops.sum(x, dims=[1], keepdim=True).dims[1] is None
    assert fd.ops.clamp(x, max=1.0).dtype is FLOAT
    assert fd.ops.softplus(x, threshold=5.0).dtype is FLOAT
    assert fd.ops.var_mean(t=x, dims=[1], correction=0)[0].dtype is FLOAT


# ----- GPU: the same fusions run and validated against the oracle --------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FLOAT], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 7, 1000])
@pytest.mark.parametrize("kind", ["pointwise", "inner"])
@pytest.mark.parametrize("name", NEW_OPS)
def test_gpu_fusion_with_op_matches_the_oracle(name, kind, hidden, dtype, rng):
    """Rows of standard normal data times 4, the first row starting with NaN, inf, -inf, -0.0,
    0.0, -1 and 20.5 (as many as fit), through fd.validate() (tolerances per dtype)."""
    import cupy

    fd = _fusion(name, kind, dtype)
    x = rng.standard_normal((7, hidden)) * 4
    edges = [NAN, INF, -INF, -0.0, 0.0, -1.0, 20.5][:hidden]
    x[0, :len(edges)] = edges
    w = rng.standard_normal(hidden)
    host = [v.astype(np.float32).astype(dtype.numpy) for v in (x, w)]
    fd.validate([cupy.asarray(host[0]), cupy.asarray(host[1]), 0.75])


TORCH = {
    "erf": lambda torch, x: torch.erf(x),
    "log1p": lambda torch, x: torch.log1p(x),
    "expm1": lambda torch, x: torch.expm1(x),
    "softplus": lambda torch, x: torch.nn.functional.softplus(x),
    "clamp": lambda torch, x: torch.clamp(x, -1.0, 3.5),
    "isnan": lambda torch, x: torch.isnan(x),
    "isinf": lambda torch, x: torch.isinf(x),
    "isfinite": lambda torch, x: torch.isfinite(x),
    "logical_and": lambda torch, x: torch.logical_and(x, x.flip(-1)),
    "logical_or": lambda torch, x: torch.logical_or(x, x.flip(-1)),
    "logical_not": lambda torch, x: torch.logical_not(x),
    # older ops whose NaN handling had to change to torch's (fmaxf / fminf dropped NaN)
    "relu": lambda torch, x: torch.relu(x),
    "maximum": lambda torch, x: torch.maximum(x, x.flip(-1)),
    "minimum": lambda torch, x: torch.minimum(x, x.flip(-1)),
}
BINARY_WITH_FLIPPED = ("logical_and", "logical_or", "maximum", "minimum")


def _torch_fusion(name: str, dtype: DataType) -> FusionDefinition:
    """`name` as TORCH applies it: on one [-1, -1] tensor (and its flipped copy, an input)."""
    with FusionDefinition(f"torch_{name}") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        ops = fd.ops
        if name in BINARY_WITH_FLIPPED:
            y = getattr(ops, name)(x, fd.define_tensor([-1, -1], dtype=dtype))
        elif name == "clamp":
            y = ops.clamp(x, -1.0, 3.5)
        else:
            y = getattr(ops, name)(x)
        fd.add_output(y)
    return fd


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FLOAT, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("name", list(TORCH))
def test_gpu_kernel_matches_torch_on_edges(name, dtype, has_torch_cuda):
    """The kernel against torch's own op on the GPU (where torch is installed), on every edge
    value: the semantics the op table claims."""
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    tdtype = {FLOAT: torch.float32, BF16: torch.bfloat16}[dtype]
    x = torch.tensor([EDGES], dtype=torch.float64).to(tdtype).cuda()
    inputs = [x, x.flip(-1).contiguous()] if name in BINARY_WITH_FLIPPED else [x]
    expected = TORCH[name](torch, x)
    (got,) = _torch_fusion(name, dtype).execute(inputs)
    assert got.dtype == expected.dtype
    got, expected = got.float().cpu().numpy(), expected.float().cpu().numpy()
    if expected.dtype == bool:
        assert np.array_equal(got, expected), (name, got, expected)
    else:  # fuser's exp is ex2.approx: softplus below 2^-126 is 0, 1e-5 relative otherwise
        np.testing.assert_allclose(got, expected, rtol=1e-5 if dtype is FLOAT else 8e-3,
                                   atol=1e-37, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FLOAT, BF16, DOUBLE], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [7, 1000, 24578])
def test_gpu_max_min_and_softmax_propagate_nan_as_torch(hidden, dtype, has_torch_cuda):
    """A NaN anywhere in a row makes its max, its min and its whole softmax NaN, as torch; rows
    with inf, -inf or no special value are unchanged. The NaN sits first, last and in the middle
    of its row, so every lane and every warp's partial meets it."""
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    tdtype = {FLOAT: torch.float32, BF16: torch.bfloat16, DOUBLE: torch.float64}[dtype]
    x = torch.randn(8, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[0, 0] = x[1, -1] = x[2, hidden // 2] = NAN
    x[3, 1] = x[4, 0] = INF
    x[5, -1] = -INF
    x[6, :] = -INF
    x = x.to(tdtype).cuda()
    with FusionDefinition("nan_extremes") as fd:
        t = fd.define_tensor([-1, -1], dtype=dtype)
        fd.add_output(fd.ops.max(t, [1]))
        fd.add_output(fd.ops.min(t, [1]))
        tf = fd.ops.cast(t, DataType.Float) if dtype is BF16 else t
        e = fd.ops.exp(fd.ops.sub(tf, fd.ops.max(tf, [1], keepdim=True)))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True)), dtype))
    got_max, got_min, got_softmax = fd.execute([x])
    for got, expected in [(got_max, torch.amax(x, dim=1)), (got_min, torch.amin(x, dim=1)),
                          (got_softmax, torch.softmax(x.double(), dim=1).to(tdtype))]:
        got, expected = got.double().cpu().numpy(), expected.double().cpu().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-6, equal_nan=True)
