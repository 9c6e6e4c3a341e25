"""CPU: the ctypes type of every kernel parameter matches what codegen declares."""

from __future__ import annotations

import ctypes

import pytest

from fuser import DataType
from fuser.launch import POINTER, ctype_of

SIZES = {"bool": 1, "int": 4, "long long": 8, "float": 4, "double": 8}


@pytest.mark.parametrize("dtype", list(DataType), ids=lambda d: d.name)
def test_scalar_parameters_have_the_compute_types_size(dtype):
    """Scalars are declared in their compute type (a Half or BFloat16 scalar is a float
    parameter), so the slot must have that type's size, not the storage type's."""
    assert ctypes.sizeof(ctype_of(dtype)) == SIZES[dtype.compute_type]


def test_pointers_are_64_bit():
    assert ctypes.sizeof(POINTER) == 8
