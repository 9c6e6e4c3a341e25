"""The frontend and the IR: result dtypes, shape inference, extents, repr round trips, misuse."""

from __future__ import annotations

import pytest

from fuser import DataType, DefinitionError, FusionDefinition, UnknownOpError
from fuser.ir import Scalar, Tensor
from fuser.ops import ELEMENTWISE

BF16, HALF, FLOAT, DOUBLE = DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double
INT32, INT64, BOOL = DataType.Int32, DataType.Int64, DataType.Bool

# Hand-kept classification of the op table: a new op must be added here, with its typing rule.
ARITH_OPS = {"add", "sub", "mul", "pow", "maximum", "minimum", "neg", "abs", "relu", "where",
             "clamp"}
FLOATING_OPS = {"div", "reciprocal", "sqrt", "rsqrt", "exp", "log", "tanh", "sigmoid", "silu",
                "erf", "log1p", "expm1", "softplus"}
COMPARE_OPS = {"eq", "ne", "lt", "le", "gt", "ge",  # Bool results
               "isnan", "isinf", "isfinite", "logical_and", "logical_or", "logical_not"}


def new_fd() -> FusionDefinition:
    """A definition used outside `with` (so no output is required)."""
    return FusionDefinition()


def shape(t: Tensor) -> list:
    """A tensor's shape as a list: 1 for broadcast dims, the fixed size, or -1 when symbolic."""
    out = []
    for e in t.dims:
        if e is None:
            out.append(1)
        else:
            value = e.find().value
            out.append(-1 if value is None else value)
    return out


def same_extent(a, b) -> bool:
    return a is not None and b is not None and a.find() is b.find()


def apply(fd: FusionDefinition, op: str, dtype: DataType):
    """Apply `op` to tensors of `dtype` (a Bool condition for where)."""
    arity = ELEMENTWISE[op].arity
    operands = [fd.define_tensor([-1, -1], dtype=dtype) for _ in range(arity)]
    if op == "where":
        operands[0] = fd.define_tensor([-1, -1], dtype=BOOL)
    return getattr(fd.ops, op)(*operands)


# ----- dtypes -----------------------------------------------------------------------------------


def test_op_classification_covers_the_table():
    assert set(ELEMENTWISE) == ARITH_OPS | FLOATING_OPS | COMPARE_OPS
    assert not (ARITH_OPS & FLOATING_OPS or ARITH_OPS & COMPARE_OPS or FLOATING_OPS & COMPARE_OPS)


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
@pytest.mark.parametrize("dtype", [BF16, HALF, FLOAT, DOUBLE, INT32, INT64])
def test_every_elementwise_op_result_dtype(op, dtype):
    fd = new_fd()
    out = apply(fd, op, dtype)
    assert isinstance(out, Tensor)
    if op in COMPARE_OPS:
        expected = BOOL
    elif op in FLOATING_OPS and not dtype.is_float:
        expected = FLOAT
    else:
        expected = dtype
    assert out.dtype is expected
    assert out.definition.op == op
    assert shape(out) == [-1, -1]


def _t(dtype):
    return lambda fd: fd.define_tensor([-1], dtype=dtype)


def _s(value):
    return lambda fd: fd.define_scalar(value)


PROMOTIONS = [
    # (description, op, operand builders, expected result dtype)
    ("bf16*bf16", "mul", [_t(BF16), _t(BF16)], BF16),
    ("bf16+half", "add", [_t(BF16), _t(HALF)], FLOAT),
    ("half+float", "add", [_t(HALF), _t(FLOAT)], FLOAT),
    ("float+double", "add", [_t(FLOAT), _t(DOUBLE)], DOUBLE),
    ("int32+int64", "add", [_t(INT32), _t(INT64)], INT64),
    ("int32+half", "add", [_t(INT32), _t(HALF)], HALF),
    ("bool+int32", "add", [_t(BOOL), _t(INT32)], INT32),
    ("bool*bool", "mul", [_t(BOOL), _t(BOOL)], BOOL),
    ("int32+Double scalar", "add", [_t(INT32), _s(2.5)], FLOAT),
    ("bf16*Double scalar", "mul", [_t(BF16), _s(2.0)], BF16),
    ("half*Int64 scalar", "mul", [_t(HALF), _s(3)], HALF),
    ("int32*Int64 scalar", "mul", [_t(INT32), _s(3)], INT32),
    ("bool+Int64 scalar", "add", [_t(BOOL), _s(1)], INT64),
    ("bool+Double scalar", "add", [_t(BOOL), _s(1.0)], FLOAT),
    ("int32*Bool scalar", "mul", [_t(INT32), _s(True)], INT32),
    ("int32/int32", "div", [_t(INT32), _t(INT32)], FLOAT),
    ("bf16/bf16", "div", [_t(BF16), _t(BF16)], BF16),
    ("int32**Double scalar", "pow", [_t(INT32), _s(0.5)], FLOAT),
    ("int32 < Double scalar", "lt", [_t(INT32), _s(0.5)], BOOL),
    ("bf16 == half", "eq", [_t(BF16), _t(HALF)], BOOL),
    ("sqrt(int32)", "sqrt", [_t(INT32)], FLOAT),
    ("exp(bool)", "exp", [_t(BOOL)], FLOAT),
    ("tanh(double)", "tanh", [_t(DOUBLE)], DOUBLE),
    ("where(b, int32, Double scalar)", "where", [_t(BOOL), _t(INT32), _s(1.5)], FLOAT),
    ("where(b, bf16, half)", "where", [_t(BOOL), _t(BF16), _t(HALF)], FLOAT),
    ("Int64 scalar+Double scalar", "add", [_s(1), _s(2.0)], DOUBLE),
    ("Int64 scalar/Int64 scalar", "div", [_s(1), _s(2)], FLOAT),
]


@pytest.mark.parametrize(
    ("op", "builders", "expected"),
    [p[1:] for p in PROMOTIONS],
    ids=[p[0] for p in PROMOTIONS],
)
def test_promotion_table(op, builders, expected):
    fd = new_fd()
    out = getattr(fd.ops, op)(*(b(fd) for b in builders))
    assert out.dtype is expected


def test_scalar_only_ops_give_scalars():
    fd = new_fd()
    out = fd.ops.add(fd.define_scalar(1), fd.define_scalar(2.0))
    assert isinstance(out, Scalar)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(INT32, INT64), (BOOL, INT64), (INT64, INT64), (BF16, BF16), (HALF, HALF), (FLOAT, FLOAT)],
)
def test_sum_result_dtype(dtype, expected):
    fd = new_fd()
    assert fd.ops.sum(fd.define_tensor([-1, -1], dtype=dtype), [1]).dtype is expected


def test_reduction_dtypes():
    fd = new_fd()
    x = fd.define_tensor([-1, -1], dtype=BF16)
    assert fd.ops.sum(x, [1], dtype=FLOAT).dtype is FLOAT
    assert fd.ops.max(x, [1]).dtype is BF16
    assert fd.ops.max(fd.define_tensor([-1], dtype=INT32), [0]).dtype is INT32
    var, mean = fd.ops.var_mean(x, [1])
    assert (var.dtype, mean.dtype) == (BF16, BF16)


def test_cast_and_python_operators():
    fd = new_fd()
    a = fd.define_tensor([-1], dtype=BF16)
    assert fd.ops.cast(a, FLOAT).dtype is FLOAT
    assert fd.ops.cast(a, DataType.Int).dtype is INT64  # nvFuser's alias
    assert (a * 2.0).dtype is BF16
    assert (2 - a).definition.op == "sub"
    assert [v.name for v in (2 - a).definition.inputs][1] == a.name  # operands keep their order
    assert (a / 3).definition.op == "div"
    assert (1.0 / a).dtype is BF16
    assert (-a).definition.op == "neg"
    assert (a + a).dtype is BF16


# ----- shapes -----------------------------------------------------------------------------------


def test_broadcasting_is_right_aligned():
    fd = new_fd()
    x = fd.define_tensor([-1, -1, 4])
    w = fd.define_tensor([4])
    row = fd.define_tensor([-1, 1, 1])
    out = x * w
    assert shape(out) == [-1, -1, 4]
    assert same_extent(out.dims[0], x.dims[0]) and same_extent(out.dims[1], x.dims[1])
    out2 = row + w
    assert shape(out2) == [-1, 1, 4]
    assert same_extent(out2.dims[0], row.dims[0]) and out2.dims[1] is None


def test_broadcasting_unifies_symbolic_extents():
    fd = new_fd()
    a = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1])
    c = fd.define_tensor([7])
    a + b
    assert same_extent(a.dims[1], b.dims[0])
    assert not same_extent(a.dims[0], b.dims[0])
    b + c  # fixes b's (and so a's last) extent to 7
    assert shape(a) == [-1, 7]


def test_fixed_size_mismatch_raises_at_definition():
    fd = new_fd()
    a = fd.define_tensor([-1, 4])
    b = fd.define_tensor([5])
    with pytest.raises(DefinitionError, match=r"add\(T0.*T1.*dimension 1: sizes 4.*5"):
        fd.ops.add(a, b)


def test_transitive_fixed_size_mismatch_raises():
    fd = new_fd()
    a = fd.define_tensor([-1, -1])
    b = fd.define_tensor([-1, 4])
    c = fd.define_tensor([-1, 6])
    a + b
    with pytest.raises(DefinitionError, match=r"sizes (4.*6|6.*4)"):
        a + c


def test_broadcast_in_dim_with_ints():
    fd = new_fd()
    w = fd.define_tensor([-1])
    out = fd.ops.broadcast_in_dim(w, shape=[3, -1], broadcast_dims=[1])
    assert shape(out) == [3, -1]
    assert same_extent(out.dims[1], w.dims[0])
    fixed = fd.ops.broadcast_in_dim(fd.define_tensor([4]), shape=[1, 4], broadcast_dims=[1])
    assert shape(fixed) == [1, 4] and fixed.dims[0] is None
    with pytest.raises(DefinitionError, match=r"broadcast_in_dim.*sizes"):
        fd.ops.broadcast_in_dim(fd.define_tensor([4]), shape=[2, 5], broadcast_dims=[1])


def test_broadcast_in_dim_with_symbolic_sizes():
    fd = new_fd()
    x = fd.define_tensor([-1, -1])
    w = fd.define_tensor([-1])
    out = fd.ops.broadcast_in_dim(w, x.shape(), [1])
    assert same_extent(out.dims[0], x.dims[0])
    assert same_extent(w.dims[0], x.dims[1])  # the weight's size is now tied to the row
    keep = fd.ops.sum(x, [1], keepdim=True)
    out2 = fd.ops.broadcast_in_dim(fd.ops.sum(x, [1]), [x.size(0), x.size(1)], [0])
    assert same_extent(out2.dims[1], x.dims[1]) and same_extent(out2.dims[0], keep.dims[0])
    assert [v.definition.op for v in out2.definition.inputs[1:]] == ["size", "size"]


def test_broadcast_in_dim_errors():
    fd = new_fd()
    x = fd.define_tensor([-1, -1])
    w = fd.define_tensor([-1])
    with pytest.raises(DefinitionError, match=r"one entry per dimension of T1"):
        fd.ops.broadcast_in_dim(w, [4, 4], [0, 1])
    with pytest.raises(DefinitionError, match=r"increasing"):
        fd.ops.broadcast_in_dim(x, [4, 4, 4], [2, 0])
    with pytest.raises(DefinitionError, match=r"output dimension 0 has size 1"):
        fd.ops.broadcast_in_dim(w, [1, 4], [0])
    with pytest.raises(DefinitionError, match=r"is not a tensor size"):
        fd.ops.broadcast_in_dim(w, [fd.define_scalar(dtype=INT64), -1], [1])
    with pytest.raises(DefinitionError, match=r"shape\[0\] = 0"):
        fd.ops.broadcast_in_dim(w, [0, -1], [1])


def test_reductions_with_and_without_keepdim():
    fd = new_fd()
    x = fd.define_tensor([-1, -1, -1])
    s = fd.ops.sum(x, [1])
    assert shape(s) == [-1, -1]
    assert same_extent(s.dims[0], x.dims[0]) and same_extent(s.dims[1], x.dims[2])
    k = fd.ops.max(x, [-1, 0], keepdim=True)
    assert shape(k) == [1, -1, 1]
    assert same_extent(k.dims[1], x.dims[1])
    assert k.definition.attr("dims") == (0, 2)  # normalized and sorted
    with pytest.raises(DefinitionError, match=r"dims is empty"):
        fd.ops.sum(x, [])


def test_var_mean_shapes():
    fd = new_fd()
    x = fd.define_tensor([-1, -1])
    var, mean = fd.ops.var_mean(x, [1], correction=0)
    assert shape(var) == shape(mean) == [-1]
    assert var.definition is mean.definition
    assert var.definition.attr("correction") == 0
    var_k, _ = fd.ops.var_mean(x, [-1], keepdim=True)
    assert shape(var_k) == [-1, 1]
    assert var_k.definition.attr("correction") == 1  # torch's default
    with pytest.raises(DefinitionError, match=r"var_mean: T5 has dtype DataType\.Int32"):
        fd.ops.var_mean(fd.define_tensor([-1], dtype=INT32), [0])


def test_size_and_shape():
    fd = new_fd()
    x = fd.define_tensor([-1, 1, 8])
    s0, s_last = x.size(0), fd.ops.size(x, -1)
    assert isinstance(s0, Scalar) and s0.dtype is INT64
    assert s0.extent is x.dims[0] and s0.definition.attr("dim") == 0
    assert s_last.definition.attr("dim") == 2 and s_last.extent.find().value == 8
    assert x.size(1).value == 1 and x.size(1).extent is None
    sizes = x.shape()
    assert [s.definition.attr("dim") for s in sizes] == [0, 1, 2]
    ops_sizes = fd.ops.shape(x)
    assert [s.extent for s in ops_sizes] == [s.extent for s in sizes]
    with pytest.raises(DefinitionError, match=r"size: dim 3 is out of range for T0 of rank 3"):
        x.size(3)
    with pytest.raises(DefinitionError, match=r"shape: S.* is a scalar"):
        fd.ops.shape(fd.define_scalar(1.0))


# ----- repr round trips -------------------------------------------------------------------------


def rmsnorm_fwd():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        w = fd.define_tensor([-1], dtype=BF16)
        xf = fd.ops.cast(x, FLOAT)
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), [1], keepdim=True), x.size(1))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, 1e-6))
        wb = fd.ops.broadcast_in_dim(fd.ops.cast(w, FLOAT), x.shape(), [1])
        fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.mul(xf, rstd), wb), BF16))
        fd.add_output(rstd)
    return fd


def layernorm_fwd():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=HALF)
        w = fd.define_tensor([-1], dtype=HALF)
        b = fd.define_tensor([-1], dtype=HALF)
        xf = fd.ops.cast(x, FLOAT)
        var, mean = fd.ops.var_mean(xf, [1], correction=0, keepdim=True)
        rstd = fd.ops.rsqrt(var + 1e-5)
        y = (xf - mean) * rstd
        y = y * fd.ops.broadcast_in_dim(w, x.shape(), [1])
        y = y + fd.ops.broadcast_in_dim(b, x.shape(), [1])
        fd.add_output(fd.ops.cast(y, HALF))
        fd.add_output(mean)
        fd.add_output(rstd)
    return fd


def softmax_fwd():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1], contiguity=[True, False, True], dtype=FLOAT)
        m = fd.ops.max(x, [2], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(x, m))
        s = fd.ops.sum(e, [-1], keepdim=True)
        fd.add_output(fd.ops.div(e, s))
    return fd


def python_operators():
    with FusionDefinition() as fd:
        a = fd.define_tensor([-1, 4], dtype=FLOAT)
        b = fd.define_tensor([1, 4], dtype=FLOAT)
        fd.add_output(a * 2.0 + b)
        fd.add_output(1 - (-a) / b)
    return fd


def scalar_input():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        scale = fd.define_scalar(dtype=FLOAT)
        flag = fd.define_scalar(True)
        y = fd.ops.where(fd.ops.gt(x, 0), fd.ops.mul(x, scale), fd.ops.mul(x, 0.01))
        fd.add_output(fd.ops.cast(fd.ops.mul(y, fd.ops.cast(flag, FLOAT)), INT32))
    return fd


@pytest.mark.parametrize(
    "build", [rmsnorm_fwd, layernorm_fwd, softmax_fwd, python_operators, scalar_input]
)
def test_repr_round_trip(build):
    fd = build()
    text = repr(fd)
    rebuilt = FusionDefinition.from_python(text)
    assert repr(rebuilt) == text
    assert [v.dtype for v in rebuilt.fusion.outputs] == [v.dtype for v in fd.fusion.outputs]
    assert [shape(v) for v in rebuilt.fusion.outputs] == [shape(v) for v in fd.fusion.outputs]
    assert [v.name for v in rebuilt.fusion.inputs] == [v.name for v in fd.fusion.inputs]


def test_repr_is_readable_python():
    text = repr(python_operators())
    lines = [line.strip() for line in text.splitlines()]
    for expected in [
        "T0 = fd.define_tensor(shape=[-1, 4], contiguity=[True, True], dtype=DataType.Float)",
        "T1 = fd.define_tensor(shape=[1, 4], contiguity=[None, True], dtype=DataType.Float)",
        "S2 = fd.define_scalar(2.0, dtype=DataType.Double)",
        "T3 = fd.ops.mul(T0, S2)",
        "T4 = fd.ops.add(T3, T1)",
        "fd.add_output(T4)",
    ]:
        assert expected in lines
    assert lines[-1] == "define_fusion(fd)"


def test_repr_of_scalar_input_and_reductions():
    text = repr(scalar_input())
    assert "S1 = fd.define_scalar(None, dtype=DataType.Float)" in text
    assert "S2 = fd.define_scalar(True, dtype=DataType.Bool)" in text
    text = repr(layernorm_fwd())
    assert "fd.ops.var_mean(T3, dims=[1], correction=0, keepdim=True)" in text
    assert "fd.ops.broadcast_in_dim(T1, shape=[S" in text
    assert "fd.ops.max(T0, dims=[2], keepdim=True, dtype=DataType.Float)" in repr(softmax_fwd())


def test_equal_definitions_print_equal_text():
    assert repr(rmsnorm_fwd()) == repr(rmsnorm_fwd())
    assert repr(rmsnorm_fwd()) != repr(layernorm_fwd())


# ----- misuse -----------------------------------------------------------------------------------


def test_where_needs_a_bool_condition():
    fd = new_fd()
    x = fd.define_tensor([-1], dtype=FLOAT)
    with pytest.raises(DefinitionError, match=r"where: the condition T0 has dtype DataType.Float"):
        fd.ops.where(x, x, 0.0)


@pytest.mark.parametrize(
    ("shape_", "contiguity", "message"),
    [
        ([1, -1], [True, True], "dimension 0 is a broadcast .* must be None, not True"),
        ([-1, -1], [True], "contiguity has 1 entries for a rank-2 shape"),
        ([-1], [True, True], "contiguity has 2 entries for a rank-1 shape"),
        ([-1, 4], [None, True], "dimension 0 has size -1, so its contiguity must be True or False"),
        ([-1, 0], None, r"shape\[1\] = 0"),
        ([-2], None, r"shape\[0\] = -2"),
        ([2.0], None, r"shape\[0\] = 2.0"),
        (4, None, r"define_tensor: shape must be a list or tuple .*got 4"),
        ([-1], 1, r"define_tensor: contiguity must be a list or tuple .*got 1"),
    ],
)
def test_define_tensor_misuse(shape_, contiguity, message):
    with pytest.raises(DefinitionError, match=message):
        new_fd().define_tensor(shape_, contiguity)


def test_define_tensor_and_scalar_need_a_datatype():
    fd = new_fd()
    with pytest.raises(DefinitionError, match=r"define_tensor: dtype must be a fuser.DataType"):
        fd.define_tensor([-1], dtype="float32")
    with pytest.raises(DefinitionError, match=r"an input scalar .* needs a dtype"):
        fd.define_scalar()
    with pytest.raises(DefinitionError, match=r"value must be a number"):
        fd.define_scalar("1.0")
    with pytest.raises(DefinitionError, match=r"cast: dtype must be a fuser.DataType"):
        fd.ops.cast(fd.define_tensor([-1]), "half")
    with pytest.raises(DefinitionError, match=r"define_scalar: dtype must be a fuser.DataType"):
        fd.define_scalar(1.0, dtype="float32")
    with pytest.raises(DefinitionError, match=r"sum: dtype must be a fuser.DataType or None"):
        fd.ops.sum(fd.define_tensor([-1, -1]), [1], dtype="float32")


def test_malformed_op_arguments_are_definition_errors():
    """Arguments of the wrong kind are named, not left to fail as a TypeError inside fuser."""
    fd = new_fd()
    x = fd.define_tensor([-1, -1])
    with pytest.raises(DefinitionError, match=r"sum: dims must be a list or tuple .*got 'a'"):
        fd.ops.sum(x, "a")
    with pytest.raises(DefinitionError, match=r"var_mean: dims must be a list or tuple"):
        fd.ops.var_mean(x, None)
    with pytest.raises(DefinitionError, match=r"correction must be an int .*got 'one'"):
        fd.ops.var_mean(x, [1], correction="one")
    with pytest.raises(DefinitionError, match=r"broadcast_in_dim: shape must be a list or tuple"):
        fd.ops.broadcast_in_dim(x, 4, [0, 1])
    with pytest.raises(DefinitionError, match=r"broadcast_dims must be ints"):
        fd.ops.broadcast_in_dim(x, [4, 4], ["a", 1])
    with pytest.raises(UnknownOpError, match=r"no elementwise op 'softmax'"):
        fd.fusion.elementwise("softmax", [x])


def test_contiguity_shorthands():
    fd = new_fd()
    assert fd.define_tensor([1, -1, 3]).contiguity == (None, True, True)
    assert fd.define_tensor([1, -1], contiguity=False).contiguity == (None, False)


@pytest.mark.parametrize("dim", [2, -3, 1.0])
def test_reduction_dim_out_of_range(dim):
    fd = new_fd()
    x = fd.define_tensor([-1, -1])
    with pytest.raises(DefinitionError, match=r"sum: dim .* is out of range for T0 of rank 2"):
        fd.ops.sum(x, [dim])
    with pytest.raises(DefinitionError, match=r"var_mean: dim .* is out of range"):
        fd.ops.var_mean(x, [dim])


def test_add_output_misuse():
    fd = new_fd()
    x = fd.define_tensor([-1])
    s = fd.define_scalar(dtype=FLOAT)
    with pytest.raises(DefinitionError, match=r"add_output: S1 is a scalar"):
        fd.add_output(s)
    with pytest.raises(DefinitionError, match=r"add_output: .* is a scalar"):
        fd.add_output(fd.ops.mul(s, 2.0))
    with pytest.raises(DefinitionError, match=r"add_output: T0 is a fusion input"):
        fd.add_output(x)
    y = fd.ops.exp(x)
    fd.add_output(y)
    with pytest.raises(DefinitionError, match=f"add_output: {y.name} is already an output"):
        fd.add_output(y)


def test_tensor_from_another_fusion():
    other = new_fd().define_tensor([-1])
    fd = new_fd()
    x = fd.define_tensor([-1])
    with pytest.raises(DefinitionError, match=r"T0 belongs to another FusionDefinition"):
        fd.ops.add(x, other)
    with pytest.raises(DefinitionError, match=r"belongs to another FusionDefinition"):
        fd.add_output(other)
    with pytest.raises(DefinitionError, match=r"belongs to another FusionDefinition"):
        fd.ops.sum(other, [0])


def test_fusion_without_outputs():
    with (
        pytest.raises(DefinitionError, match=r"no outputs.*fd\.add_output"),
        FusionDefinition() as fd,
    ):
        fd.define_tensor([-1])


def test_error_inside_with_is_not_masked():
    with pytest.raises(DefinitionError, match=r"where: the condition"), FusionDefinition() as fd:
        x = fd.define_tensor([-1])
        fd.ops.where(x, x, x)


def test_unknown_op_and_operand_count():
    fd = new_fd()
    x = fd.define_tensor([-1])
    with pytest.raises(UnknownOpError, match=r"fd.ops has no op 'softmax'"):
        fd.ops.softmax(x)
    assert issubclass(UnknownOpError, AttributeError) and not hasattr(fd.ops, "softmax")
    with pytest.raises(DefinitionError, match=r"add takes 2 operands, got 1"):
        fd.ops.add(x)
    with pytest.raises(DefinitionError, match=r"expected a tensor, a scalar or a number"):
        fd.ops.add(x, "1")
    assert {"sum", "var_mean", "shape", *ELEMENTWISE} <= set(dir(fd.ops))


def test_abs_and_neg_reject_bool():
    fd = new_fd()
    b = fd.define_tensor([-1], dtype=BOOL)
    with pytest.raises(DefinitionError, match=r"neg: operands T0 are Bool"):
        fd.ops.neg(b)
    with pytest.raises(DefinitionError, match=r"abs: operands T0 are Bool"):
        fd.ops.abs(b)


def test_fusion_definition_name():
    with pytest.raises(DefinitionError, match=r"must be a Python identifier"):
        FusionDefinition("my fusion")
    with pytest.raises(DefinitionError, match=r"must be a Python identifier"):
        FusionDefinition(3)  # type: ignore[arg-type]
    assert FusionDefinition.from_python(repr(softmax_fwd()), name="softmax").name == "softmax"


def test_graph_and_uses():
    fd = softmax_fwd()
    g = fd.fusion.graph()
    x = fd.fusion.inputs[0]
    assert {e.op for e in fd.fusion.uses(x)} == {"max", "sub"}
    out = fd.fusion.outputs[0].name
    import networkx as nx

    assert nx.has_path(g, x.name, out)
    assert nx.is_directed_acyclic_graph(g)


# ----- regressions: IR bugs these tests found -----


def test_repr_of_infinite_constant_round_trips():
    """printer.py prints float('-inf') as `-inf`, which is not Python (a masked softmax uses it)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        mask = fd.define_tensor([-1, -1], dtype=BOOL)
        fd.add_output(fd.ops.where(mask, x, float("-inf")))
        fd.add_output(fd.ops.add(x, float("nan")))
    text = repr(fd)
    assert repr(FusionDefinition.from_python(text)) == text


def test_broadcast_in_dim_rejects_size_from_another_fusion():
    """ir.py broadcast_in_dim takes a size Scalar without checking that it is of this fusion."""
    other = new_fd().define_tensor([-1, -1])
    fd = new_fd()
    w = fd.define_tensor([-1])
    with pytest.raises(DefinitionError, match=r"belongs to another FusionDefinition"):
        fd.ops.broadcast_in_dim(w, other.shape(), [1])


def test_sub_of_bools_is_rejected():
    """torch rejects bool - bool (and numpy cannot evaluate it); ir.py only rejects neg/abs."""
    fd = new_fd()
    a = fd.define_tensor([-1], dtype=BOOL)
    b = fd.define_tensor([-1], dtype=BOOL)
    with pytest.raises(DefinitionError, match=r"sub"):
        fd.ops.sub(a, b)


def test_var_mean_rejects_empty_dims():
    """ir.py reduction() rejects dims=[]; var_mean() accepts it and would reduce nothing."""
    fd = new_fd()
    x = fd.define_tensor([-1, -1])
    with pytest.raises(DefinitionError, match=r"dims is empty"):
        fd.ops.var_mean(x, [])


def test_from_python_names_what_is_wrong_with_the_text():
    with pytest.raises(DefinitionError, match=r"defines neither `fd` nor .*define_fusion"):
        FusionDefinition.from_python("x = 1")
    with pytest.raises(DefinitionError, match=r"failed with SyntaxError"):
        FusionDefinition.from_python("def define_fusion(fd) -> None\n    pass\n")
    with pytest.raises(DefinitionError, match=r"failed with NameError: name 'T9' is not defined"):
        FusionDefinition.from_python("def define_fusion(fd):\n    fd.add_output(T9)\n")
    with pytest.raises(DefinitionError, match=r"fusion 'fusion' has no outputs"):  # its own
        FusionDefinition.from_python("def define_fusion(fd):\n    pass\n")


@pytest.mark.parametrize(("dim", "shape"), [(0, (1, 3, 4)), (1, (3, 1, 4)), (2, (3, 4, 1)),
                                            (-1, (3, 4, 1)), (-3, (1, 3, 4))])
def test_unsqueeze_inserts_a_size_one_axis_as_torch(dim, shape):
    import numpy as np

    from fuser.reference import evaluate

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        y = fd.ops.unsqueeze(x, dim)
        fd.add_output(y)
    assert y.ndim == 3 and y.dims[shape.index(1)] is None
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    (got,) = evaluate(fd.fusion, [data])
    np.testing.assert_array_equal(got, np.expand_dims(data, dim))
    assert "broadcast_in_dim(T0" in repr(fd)


def test_unsqueeze_of_a_row_statistic_is_a_per_row_value():
    """rms_norm written with unsqueeze instead of keepdim: one inner-reduction kernel, as the
    keepdim form, over [B, S, H] too."""
    from fuser.analysis import Kind, analyze

    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1, -1])
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(x, x), [2]), x.size(2))
        fd.add_output(fd.ops.mul(x, fd.ops.rsqrt(fd.ops.unsqueeze(ms, -1))))
    assert analyze(fd.fusion).kind is Kind.INNER


@pytest.mark.parametrize("dim", [3, -4, 1.0, True, "1"])
def test_unsqueeze_refuses_a_dim_out_of_range(dim):
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1])
        with pytest.raises(DefinitionError, match=r"unsqueeze: dim .* give an int from -3 to 2"):
            fd.ops.unsqueeze(x, dim)
        fd.add_output(fd.ops.neg(x))


@pytest.mark.parametrize(("shape", "dims", "out"), [([-1, 1], 1, (3,)), ([1, -1], [0], (4,)),
                                                     ([1, -1, 1], [0, -1], (4,)),
                                                     ([-1, 1, -1], [-2], (3, 4))])
def test_squeeze_removes_axes_declared_size_1_as_torch(shape, dims, out):
    import numpy as np

    from fuser.reference import evaluate

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape)
        fd.add_output(fd.ops.squeeze(x, dims))
    sizes = [s for s in out]
    data = np.arange(int(np.prod(out)), dtype=np.float32).reshape(
        [1 if s == 1 else sizes.pop(0) for s in shape])
    (got,) = evaluate(fd.fusion, [data])
    assert got.shape == out
    np.testing.assert_array_equal(got, data.reshape(out))
    assert "fd.ops.squeeze(T0, dims=[" in repr(fd)
    again = FusionDefinition.from_python(repr(fd)).fusion.python_definition()
    assert again == fd.fusion.python_definition()


def test_squeeze_refuses_an_axis_not_declared_size_1_or_listed_twice():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, 1])
        with pytest.raises(DefinitionError, match=r"dimension 0 of T0 is not declared size 1"):
            fd.ops.squeeze(x, [0])
        with pytest.raises(DefinitionError, match=r"a dimension is listed twice"):
            fd.ops.squeeze(x, [1, -1])
        with pytest.raises(DefinitionError, match=r"squeeze: dim 2 is out of range"):
            fd.ops.squeeze(x, 2)
        fd.add_output(fd.ops.neg(x))


def test_a_squeezed_row_statistic_is_a_per_row_value_and_aligns_as_numpy():
    """rms_norm written with keepdim then squeeze is the one-kernel inner reduction; the
    squeezed [rows] sum met by x directly aligns with x's last axis as numpy does (x square),
    which runs as two segments, as x - sum(x, dims=[1]) does."""
    import numpy as np
    from test_segment import _segments

    from fuser.analysis import Kind, analyze
    from fuser.reference import evaluate

    with FusionDefinition("squeezed_rms") as fd:
        x = fd.define_tensor([-1, -1])
        ms = fd.ops.squeeze(fd.ops.sum(fd.ops.mul(x, x), [1], keepdim=True), [1])
        r = fd.ops.rsqrt(fd.ops.add(fd.ops.div(ms, x.size(1)), 1e-6))
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(r, x.shape(), [0])))
    assert analyze(fd.fusion).kind is Kind.INNER
    with FusionDefinition("aligned") as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.sub(x, fd.ops.squeeze(fd.ops.sum(x, [1], keepdim=True), 1)))
    assert len(_segments(fd).segments) == 2
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    np.testing.assert_array_equal(evaluate(fd.fusion, [a])[0], a - a.sum(1))
    with FusionDefinition("unsqueezed_then_squeezed") as fd:
        x = fd.define_tensor([-1, -1])
        kept = fd.ops.unsqueeze(fd.ops.sum(x, [1]), 1)  # a per-row value kept as [rows, 1]
        fd.add_output(fd.ops.sub(x, fd.ops.squeeze(kept, [1])))
    assert len(_segments(fd).segments) == 2


def _squeezed_rms(dtype=DataType.BFloat16) -> FusionDefinition:
    with FusionDefinition("squeezed_rms") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        xf = fd.ops.cast(x, DataType.Float)
        ms = fd.ops.squeeze(fd.ops.sum(fd.ops.mul(xf, xf), [1], keepdim=True), [1])
        r = fd.ops.rsqrt(fd.ops.add(fd.ops.div(ms, x.size(1)), 1e-6))
        fd.add_output(fd.ops.cast(fd.ops.mul(xf, fd.ops.broadcast_in_dim(r, x.shape(), [0])),
                                  dtype))
        fd.add_output(r)
    return fd


def test_a_squeeze_compiles_as_an_alias():
    from fuser.analysis import analyze
    from fuser.device import DeviceSpec
    from fuser.kernels import build
    from fuser.schedulers import Problem

    fd = _squeezed_rms()
    built = build(fd.name, analyze(fd.fusion), Problem(4096, 1024, 16), DeviceSpec.get("h200"))
    kernel = built.source.source.split("#include", 1)[1]
    assert "T4" not in kernel and "row_T3 / " in kernel  # T4 = squeeze(T3): T3 itself
    assert not built.compiled.resource(built.source.row_entry).spills


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (7, 1000), (1000, 4096), (64, 24578)])
def test_a_squeezed_statistic_matches_the_oracle_on_the_gpu(rows, hidden):
    import cupy
    import numpy as np

    x = np.random.default_rng(8).standard_normal((rows, hidden)).astype(DataType.BFloat16.numpy)
    _squeezed_rms().validate([cupy.asarray(x)])
