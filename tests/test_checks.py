"""CPU: the host checks of what a call passes (fuser/checks.py) and of sizes (Problem): each
refuses with a message naming the value, the limit and the way out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fuser import BadInputError, DataType, UnsupportedFusionError
from fuser.checks import check_device, check_pointer, scalar_value
from fuser.device import PRESETS
from fuser.ir import Fusion
from fuser.schedulers.base import MAX_HIDDEN, Problem


def scalar(dtype: DataType):
    return Fusion().define_scalar(None, dtype)


@pytest.mark.parametrize(("dtype", "value", "says"), [
    (DataType.Int64, 2.5, "pass an int (a float would be truncated)"),
    (DataType.Int64, 2.0, "pass an int"),
    (DataType.Int64, float("nan"), "pass an int"),
    (DataType.Int64, True, "pass an int"),
    (DataType.Int64, 2**70, "outside Int64's range"),
    (DataType.Int32, 2**40, "outside Int32's range -2147483648 to 2147483647"),
    (DataType.Int32, -(2**31) - 1, "outside Int32's range"),
    (DataType.Bool, 0.5, "pass True or False"),
    (DataType.Bool, 1, "pass True or False"),
    (DataType.Float, "2.0", "pass a Python or numpy number"),
    (DataType.Float, np.str_("x"), "pass a Python or numpy number"),
    (DataType.Double, None, "pass a Python or numpy number"),
    (DataType.Float, 1 + 2j, "complex"),
])
def test_a_bad_scalar_is_refused_naming_it(dtype, value, says):
    with pytest.raises(BadInputError, match="input 3") as error:
        scalar_value(3, scalar(dtype), value)
    assert says in str(error.value) and dtype.label in str(error.value)


@pytest.mark.parametrize(("dtype", "value", "expected"), [
    (DataType.Int64, 7, 7), (DataType.Int64, np.int32(-3), -3), (DataType.Int32, 2**31 - 1,
                                                                 2**31 - 1),
    (DataType.Bool, True, True), (DataType.Bool, np.bool_(False), False),
    (DataType.Float, 2, 2.0), (DataType.Float, np.float16(0.5), 0.5),
    (DataType.Double, float("inf"), float("inf")), (DataType.Half, 1e-3, 1e-3),
])
def test_a_good_scalar_passes_as_its_kernel_value(dtype, value, expected):
    assert scalar_value(0, scalar(dtype), value) == expected


def test_nan_passes_for_floating_scalars():
    assert np.isnan(scalar_value(0, scalar(DataType.Float), float("nan")))


@pytest.mark.parametrize(("dtype", "pointer", "ok"), [
    (DataType.Half, 4096 + 1, False), (DataType.Float, 4096 + 2, False),
    (DataType.Double, 4096 + 4, False), (DataType.Bool, 4096 + 1, True),
    (DataType.BFloat16, 4096 + 2, True), (DataType.Float, 4096 + 4, True),
])
def test_a_pointer_must_start_on_its_element_size(dtype, pointer, ok):
    t = Fusion().define_tensor([-1, -1], [True, True], dtype)
    if ok:
        check_pointer(0, t, pointer)
        return
    with pytest.raises(BadInputError, match=rf"starts at address {pointer:#x}, not a multiple "
                                            rf"of its element size {dtype.itemsize} B"):
        check_pointer(0, t, pointer)


def test_a_preset_of_another_architecture_is_refused_before_launch():
    h200 = PRESETS["h200"]
    with pytest.raises(BadInputError, match=r"device='A100' schedules for sm_80, but the inputs "
                                            r"are on cuda:0, H200 \(sm_90\).*device=None"):
        check_device(PRESETS["a100"], h200, 0)
    check_device(PRESETS["h100"], h200, 0)  # the same part as far as kernels are concerned
    smaller = dataclasses.replace(h200, smem_per_block_optin=101376)
    with pytest.raises(BadInputError, match=r"smem_per_block_optin 232448 > 101376"):
        check_device(h200, smaller, 0)


def test_a_row_longer_than_32_bit_indices_is_refused():
    Problem(MAX_HIDDEN, 1, 16)
    with pytest.raises(UnsupportedFusionError, match=r"hidden size 2147483664 is over "
                                                     r"2147483647: the kernels index"):
        Problem(2**31 + 16, 1, 16)
