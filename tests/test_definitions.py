"""Misused definitions raise a DefinitionError naming the value and what is allowed (issue 13,
"raw exceptions instead of FuserError"), never a raw TypeError / ValueError / OverflowError
from deep inside fuser or a definition that fails later."""

from __future__ import annotations

import numpy as np
import pytest

from fuser import BadInputError, DataType, DefinitionError, FuserError, FusionDefinition

FLOAT, INT32, INT64, BOOL = DataType.Float, DataType.Int32, DataType.Int64, DataType.Bool


def open_fd() -> tuple[FusionDefinition, object]:
    """A definition used outside `with` (never closed), with one [-1, -1] Float input."""
    fd = FusionDefinition()
    return fd, fd.define_tensor([-1, -1], dtype=FLOAT)


def test_define_tensor_with_an_int_for_a_shape():
    with pytest.raises(DefinitionError, match=r"shape must be a list or tuple \(one int per "
                                              r"dimension, e.g. \[-1, -1\]\), got 5"):
        FusionDefinition().define_tensor(5)


@pytest.mark.parametrize("op", ["sum", "max", "var_mean"])
def test_reductions_take_one_int_for_dims_as_torch_does(op):
    results = []
    for dims in (1, [1], -1, np.int64(1)):
        fd, x = open_fd()
        getattr(fd.ops, op)(x, dims=dims)
        results.append(repr(fd))
    assert len(set(results)) == 1  # dims=1 defines what dims=[1] does
    fd, x = open_fd()
    with pytest.raises(DefinitionError, match=rf"{op}: dim 2 is out of range for T0 of rank 2; "
                                              r"give an int from -2 to 1"):
        getattr(fd.ops, op)(x, dims=2)
    with pytest.raises(DefinitionError, match=rf"{op}: dim True is out of range"):
        getattr(fd.ops, op)(x, dims=[True])
    with pytest.raises(DefinitionError, match=rf"{op}: dims must be a list or tuple .*got 1.0"):
        getattr(fd.ops, op)(x, dims=1.0)


def test_broadcast_dims_must_be_ints():
    fd = FusionDefinition()
    x = fd.define_tensor([-1])
    with pytest.raises(DefinitionError, match=r"broadcast_dims\[0\] = 0.5; broadcast_dims must "
                                              r"be ints, the output dimension \(0 to 1\) of each "
                                              r"dimension of T0"):
        fd.ops.broadcast_in_dim(x, [2, 3], [0.5])
    with pytest.raises(DefinitionError, match=r"broadcast_dims\[0\] = True"):
        fd.ops.broadcast_in_dim(x, [2, 3], [True])
    assert fd.ops.broadcast_in_dim(x, [2, -1], [np.int64(1)]).ndim == 2


@pytest.mark.parametrize("correction", ["a", "3", 1.5, True, None, [1], 2**64])
def test_var_mean_correction_must_be_an_int(correction):
    fd, x = open_fd()
    with pytest.raises(DefinitionError, match=r"var_mean\(T0\): correction must be an int \(0: "
                                              r"population variance, 1: sample variance; .*got "):
        fd.ops.var_mean(x, dims=[1], correction=correction)


def test_var_mean_correction_takes_numpy_ints_and_any_size():
    fd, x = open_fd()
    fd.ops.var_mean(x, dims=[1], correction=np.int64(2))
    fd.ops.var_mean(x, dims=[1], correction=10)  # may exceed n: the variance is then inf
    assert "correction=2" in repr(fd) and "correction=10" in repr(fd)


@pytest.mark.parametrize("name", [123, None, b"fusion", "fusé", "名前", "1abc", "a b", "",
                                  "a-b", "ǅ"])
def test_fusion_names_are_ascii_identifiers(name):
    """Kernels are C++ functions named after the fusion: a name str.isidentifier() accepts
    but NVRTC does not ('fusé') must be refused up front."""
    with pytest.raises(DefinitionError, match=r"must be a Python identifier in ASCII: letters "
                                              r"A-Z a-z, digits and _"):
        FusionDefinition(name)


def test_fusion_names_are_checked_wherever_they_are_set():
    fd = FusionDefinition("rms_norm_2")
    with pytest.raises(DefinitionError, match="in ASCII"):
        fd.name = "rms·norm"
    assert fd.name == "rms_norm_2"
    source = "def define_fusion(fd):\n    fd.add_output(fd.define_tensor([-1]) * 2)\n"
    assert FusionDefinition.from_python(source, name="_x9").name == "_x9"
    with pytest.raises(DefinitionError, match="in ASCII"):
        FusionDefinition.from_python(source, name="naïve")


def test_long_names_are_refused_before_they_reach_file_names():
    """A 300-character name made FUSER_DUMP_DIR's files longer than a file name may be."""
    assert FusionDefinition("a" * 100).name == "a" * 100
    with pytest.raises(DefinitionError, match=r"has 300 characters; at most 100 \(kernels and "
                                              r"FUSER_DUMP_DIR files are named after it\)"):
        FusionDefinition("a" * 300)


ALLOWED = ("DataType.Bool, DataType.Int32, DataType.Int64, DataType.Half, DataType.BFloat16, "
           "DataType.Float, DataType.Double")


@pytest.mark.parametrize(("dtype", "meant"), [
    ("float", "DataType.Float"), ("bfloat16", "DataType.BFloat16"), ("half", "DataType.Half"),
    ("torch.float16", "DataType.Half"), (np.float32, None), (3, None), ("fp8", None),
])
@pytest.mark.parametrize("where", ["define_tensor", "define_scalar", "cast", "sum", "max"])
def test_a_dtype_must_be_a_datatype(where, dtype, meant):
    fd, x = open_fd()
    define = {
        "define_tensor": lambda: fd.define_tensor([-1], dtype=dtype),
        "define_scalar": lambda: fd.define_scalar(dtype=dtype),
        "cast": lambda: fd.ops.cast(x, dtype),
        "sum": lambda: fd.ops.sum(x, [1], dtype=dtype),
        "max": lambda: fd.ops.max(x, [1], dtype=dtype),
    }[where]
    with pytest.raises(DefinitionError) as info:
        define()
    message = str(info.value)
    assert message.startswith(f"{where}: dtype must be a fuser.DataType")
    assert f"got {dtype!r}" in message and message.endswith(f"the types are {ALLOWED}")
    assert (f"pass {meant}" in message) == (meant is not None)


@pytest.mark.parametrize(("value", "dtype", "message"), [
    (2**70, None, r"define_scalar\(1180591620717411303424, dtype=DataType.Int64\): the value is "
                  r"outside Int64's range -9223372036854775808 to 9223372036854775807"),
    (-(2**63) - 1, INT64, "outside Int64's range"),
    (2**40, INT32, r"outside Int32's range -2147483648 to 2147483647"),
    (float("nan"), DataType.Int, r"an Int64 constant must be an int, not NaN"),
    (float("inf"), INT32, r"an Int32 constant must be an int, not inf"),
    (1.5, INT64, r"must be an int, not 1.5; round it yourself"),
    (True, INT64, r"must be an int, not True"),
    (3, BOOL, r"a Bool constant must be True or False"),
    (2**2000, DataType.Double, r"\.\.\.\(603 digits\), dtype=DataType.Double\): the value is "
                               r"beyond the range of every float type"),
    ("1.0", None, r"value must be a number \(a bool, an int or a float\), got str '1.0'"),
    (1 + 2j, FLOAT, r"got complex"),
])
def test_out_of_range_literals_are_refused(value, dtype, message):
    with pytest.raises(DefinitionError, match=message):
        FusionDefinition().define_scalar(value, dtype=dtype)


def test_literals_every_kernel_can_hold_are_accepted():
    fd, x = open_fd()
    for value, dtype in [(2**63 - 1, INT64), (-(2**31), INT32), (1e300, FLOAT),
                         (float("nan"), FLOAT), (float("-inf"), DataType.Double),
                         (2**70, DataType.Double), (np.float32(0.5), None),
                         (np.int64(3), INT32), (np.True_, BOOL), (False, None)]:
        s = fd.define_scalar(value, dtype=dtype)
        assert type(s.value) in (bool, int, float)  # numpy scalars become Python numbers
    assert fd.define_scalar(np.int64(3)).dtype is INT64
    assert (x * np.float64(2.0)).dtype is FLOAT


def test_an_out_of_range_operand_is_refused_where_it_is_used():
    _, x = open_fd()
    with pytest.raises(DefinitionError, match=r"outside Int64's range"):
        x + 2**70
    assert (x + float(2**70)).dtype is FLOAT


def _closed() -> tuple[FusionDefinition, object]:
    with FusionDefinition("closed") as fd:
        x = fd.define_tensor([-1, -1])
        fd.add_output(x * 2)
    return fd, x


@pytest.mark.parametrize("late", [
    lambda fd, x: fd.ops.neg(x),
    lambda fd, x: x * 3,
    lambda fd, x: fd.ops.sum(x, [1]),
    lambda fd, x: fd.ops.cast(x, DataType.Half),
    lambda fd, x: x.size(0),
    lambda fd, x: fd.define_tensor([-1]),
    lambda fd, x: fd.define_scalar(1.0),
    lambda fd, x: fd.add_output(x),
    lambda fd, x: fd.__enter__(),
])
def test_defining_after_the_with_block_closes_raises(late):
    fd, x = _closed()
    before = repr(fd)
    with pytest.raises(DefinitionError, match=r"FusionDefinition 'closed': its `with` block has "
                                              r"closed, so the definition is final"):
        late(fd, x)
    assert repr(fd) == before  # nothing was appended


def test_a_block_that_raised_is_closed_too():
    fd = FusionDefinition()
    with pytest.raises(ZeroDivisionError), fd:
        x = fd.define_tensor([-1])
        1 / 0  # noqa: B018
    with pytest.raises(DefinitionError, match="has closed"):
        fd.add_output(x)


def test_a_fusion_without_outputs_names_add_output():
    empty = FusionDefinition("empty")
    with pytest.raises(DefinitionError, match=r"fusion 'empty' has no outputs; call "
                                              r"fd.add_output\(t\) inside the `with` block"), empty:
        empty.define_tensor([-1])
    fd = FusionDefinition("never_closed")  # used without `with`: refused when run
    fd.define_tensor([-1])
    for run in (fd.execute, fd.validate):
        with pytest.raises(DefinitionError, match=r"'never_closed' has no outputs"):
            run([np.ones(3, np.float32)])


@pytest.mark.parametrize("inputs", [None, 3, "x", np.ones(3, np.float32)])
def test_execute_needs_a_list_of_inputs(inputs):
    fd, _ = _closed()
    for call, run in (("execute", fd.execute), ("validate", fd.validate)):
        with pytest.raises(BadInputError, match=rf"fd.{call}\(inputs\): inputs must be a list or "
                                                r"tuple with one array or number per fusion "
                                                r"input \(T0\), got "):
            run(inputs)


def test_every_refusal_here_is_a_fuser_error():
    assert issubclass(DefinitionError, FuserError) and issubclass(BadInputError, FuserError)
