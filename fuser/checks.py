"""Host-side checks of what a call passes that the definition cannot know: scalar values,
pointer alignment, the device a kernel was scheduled for. Each failure raises a
BadInputError naming the value, the limit and the way out, before anything launches (a
device fault would poison the CUDA context for every later call).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import cast

import numpy as np

from fuser.device import DeviceSpec
from fuser.dtypes import DataType
from fuser.errors import BadInputError
from fuser.ir import INT_RANGES, Scalar, Tensor

# (the scalar's dtype, the Python type of a value that needs no other check): a bool for
# Bool, a float for the floating types; an int for the integer types needs its range checked
_PLAIN = frozenset({(DataType.Bool, bool)} | {(d, float) for d in DataType if d.is_float})


def alignment(pointers: list[int]) -> int:
    """Largest power of two up to 16 dividing every pointer (16 bytes is the widest access)."""
    align = 16
    for p in pointers:
        while p % align:
            align //= 2
    return align


def scalar_value(index: int, v: Scalar, x: object) -> object:
    """`x` as the value of scalar input `v` (its kernel parameter), after checking its kind
    and range: a bool for Bool; an integer (not a float, not a bool) within Int32 / Int64;
    any real number for the floating types (inf and nan included; a Float scalar beyond
    float32's range becomes inf in the kernel, as in torch). Plain Python values of the
    scalar's own kind take a short path (every call checks every scalar input: a segment's
    sizes were 3 us each of a segmented call's host time)."""
    dtype, kind = v.dtype, type(x)
    if (dtype, kind) in _PLAIN:
        return x
    if kind is int and dtype in INT_RANGES:
        low, high = INT_RANGES[dtype]
        if low <= cast(int, x) <= high:
            return x
    return _checked_scalar(index, v, x)


def _checked_scalar(index: int, v: Scalar, x: object) -> object:
    """scalar_value's checks for any value: numpy scalars, ints out of range, wrong kinds."""
    where = f"input {index} ({v.name}, a {v.dtype.label} scalar)"
    dtype = v.dtype
    if dtype is DataType.Bool:
        if not isinstance(x, bool | np.bool_):
            raise BadInputError(f"{where} got {x!r}; pass True or False")
        return bool(x)
    if isinstance(x, str | bytes | np.str_ | np.bytes_) or not isinstance(x, numbers.Number):
        raise BadInputError(f"{where} got {type(x).__name__} {x!r}; pass a Python or numpy "
                            "number")
    if not dtype.is_float:
        if isinstance(x, bool | np.bool_) or not isinstance(x, numbers.Integral):
            raise BadInputError(f"{where} got {x!r}; pass an int (a float would be truncated)")
        low, high = INT_RANGES.get(dtype, INT_RANGES[DataType.Int64])
        if not low <= int(x) <= high:
            raise BadInputError(f"{where} got {x}, outside {dtype.label}'s range {low} to {high}")
        return int(x)
    if isinstance(x, numbers.Complex) and not isinstance(x, numbers.Real):
        raise BadInputError(f"{where} got the complex number {x!r}; pass a real number")
    return float(x)  # type: ignore[arg-type]


def check_pointer(index: int, t: Tensor, pointer: int) -> None:
    """A tensor's data must start on a multiple of its element size: the kernels load whole
    elements (vectors of them), and a misaligned load faults on the device."""
    check_element_aligned(t.dtype.itemsize, pointer,
                          lambda: f"input {index} ({t.name}, {t.dtype.label})")


def check_element_aligned(itemsize: int, pointer: int, what: Callable[[], str]) -> None:
    """Data of `itemsize`-byte elements must start on a multiple of `itemsize` (the
    kernels', the permute kernel's too, loads of whole elements fault otherwise); what()
    names the array in the error (built only then: the permute checks every call)."""
    if pointer % itemsize:
        raise BadInputError(
            f"{what()} starts at address {pointer:#x}, not a multiple of its element size "
            f"{itemsize} B; pass a tensor whose data is aligned (a fresh allocation, or a copy: "
            "x.clone() in torch, x.copy() in CuPy)")


def check_device(spec: DeviceSpec, actual: DeviceSpec, device_id: int) -> None:
    """A kernel scheduled for preset `spec` must load and fit on the GPU the inputs are on:
    the same architecture, and no limit larger than the GPU's."""
    where = (f"device={spec.name!r} schedules for sm_{spec.arch}, but the inputs are on "
             f"cuda:{device_id}, {actual.name} (sm_{actual.arch})")
    if spec.arch != actual.arch:
        raise BadInputError(f"{where}: its kernels would not load there; pass device=None "
                            "(the GPU's own limits) or a preset of that architecture")
    limits = ("smem_per_block_optin", "smem_per_sm", "max_threads_per_block", "regs_per_block",
              "regs_per_sm", "max_threads_per_sm", "max_blocks_per_sm")
    over = [f"{name} {getattr(spec, name)} > {getattr(actual, name)}" for name in limits
            if getattr(spec, name) > getattr(actual, name)]
    if over:
        raise BadInputError(f"{where}: the preset allows more than the GPU has "
                            f"({'; '.join(over)}); pass device=None or a smaller preset")
