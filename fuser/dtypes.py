"""Data types, and PyTorch's type promotion rules.

Half and bfloat16 values are computed in float (fp32) inside kernels and rounded only where the
fusion casts or stores them; the `compute` type below is that register type.
"""

from __future__ import annotations

import enum

import numpy as np


class Category(enum.IntEnum):
    """Promotion categories, ordered as PyTorch orders them."""

    BOOL = 0
    INT = 1
    FLOAT = 2


class DataType(enum.Enum):
    """The element types a fusion can use (names as in nvFuser's DataType)."""

    #            name        bytes  category        CUDA storage type   compute type
    Bool = ("Bool", 1, Category.BOOL, "bool", "bool")
    Int32 = ("Int32", 4, Category.INT, "int", "int")
    Int64 = ("Int64", 8, Category.INT, "long long", "long long")
    Half = ("Half", 2, Category.FLOAT, "__half", "float")
    BFloat16 = ("BFloat16", 2, Category.FLOAT, "__nv_bfloat16", "float")
    Float = ("Float", 4, Category.FLOAT, "float", "float")
    Double = ("Double", 8, Category.FLOAT, "double", "double")
    Int = ("Int64", 8, Category.INT, "long long", "long long")  # nvFuser's name; alias of Int64

    def __init__(self, label, itemsize, category, cuda_type, compute_type):
        self.label = label
        self.itemsize = itemsize
        self.category = category
        self.cuda_type = cuda_type
        self.compute_type = compute_type

    def __repr__(self) -> str:
        return f"DataType.{self.name}"

    __str__ = __repr__

    @property
    def is_float(self) -> bool:
        return self.category is Category.FLOAT

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of this type (bfloat16 through ml_dtypes, as CuPy 14 does)."""
        if self is DataType.BFloat16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(_NUMPY_NAMES[self])

    @property
    def scalar_numpy(self) -> np.dtype:
        """The numpy dtype a kernel holds a scalar of this type in: a Half or BFloat16 scalar
        is a float32 kernel parameter or literal (its compute type), not rounded to 16 bits;
        the executor converts a scalar input's value, and the oracle holds it, in this dtype."""
        if self in (DataType.Half, DataType.BFloat16):
            return np.dtype(np.float32)
        return self.numpy

    @classmethod
    def from_numpy(cls, dtype) -> DataType | None:
        dtype = np.dtype(dtype)
        if dtype.name == "bfloat16":
            return cls.BFloat16
        for member, name in _NUMPY_NAMES.items():
            if dtype == np.dtype(name):
                return member
        return None

    @classmethod
    def from_torch(cls, dtype) -> DataType | None:
        return _TORCH_NAMES.get(str(dtype).removeprefix("torch."))


_NUMPY_NAMES = {
    DataType.Bool: "bool",
    DataType.Int32: "int32",
    DataType.Int64: "int64",
    DataType.Half: "float16",
    DataType.Float: "float32",
    DataType.Double: "float64",
}

_TORCH_NAMES = {
    "bool": DataType.Bool,
    "int32": DataType.Int32,
    "int64": DataType.Int64,
    "float16": DataType.Half,
    "bfloat16": DataType.BFloat16,
    "float32": DataType.Float,
    "float64": DataType.Double,
}

# The type a category takes when a scalar of a higher category meets tensors (PyTorch defaults).
_CATEGORY_DEFAULT = {
    Category.BOOL: DataType.Bool,
    Category.INT: DataType.Int64,
    Category.FLOAT: DataType.Float,
}


def promote_pair(a: DataType, b: DataType) -> DataType:
    """The common type of two tensors: PyTorch's table (half + bfloat16 gives float)."""
    if a is b:
        return a
    if a.category != b.category:
        return a if a.category > b.category else b
    if {a, b} == {DataType.Half, DataType.BFloat16}:
        return DataType.Float
    return a if a.itemsize >= b.itemsize else b


def promote(tensor_types: list[DataType], scalar_types: list[DataType]) -> DataType:
    """Result type of an op, as torch computes it for tensors and 0-dim scalars.

    Scalars only matter when their category is higher than every tensor's; then the result is
    that category's default type (a bf16 tensor times a Python float stays bf16, an int tensor
    times a float becomes Float). Without tensors, scalars promote among themselves.
    """
    if not tensor_types:
        result = scalar_types[0]
        for t in scalar_types[1:]:
            result = promote_pair(result, t)
        return result
    result = tensor_types[0]
    for t in tensor_types[1:]:
        result = promote_pair(result, t)
    top = max((s.category for s in scalar_types), default=Category.BOOL)
    if top > result.category:
        return _CATEGORY_DEFAULT[top]
    return result


def float_result(dtype: DataType) -> DataType:
    """Type of a floating-point function (sqrt, exp...) of `dtype`: ints and bools give Float."""
    return dtype if dtype.is_float else DataType.Float
