"""What fuser.torch's ops and functions share: the dtype maps, the input checks that name
the value and the allowed set, and the guard that refuses double backward."""

from __future__ import annotations

import torch
from torch import Tensor

from fuser.dtypes import DataType
from fuser.errors import BadInputError, UnsupportedFusionError

TORCH_DTYPES = {DataType.BFloat16: torch.bfloat16, DataType.Half: torch.float16,
                DataType.Float: torch.float32, DataType.Double: torch.float64}
_ALLOWED = "torch.bfloat16, torch.float16, torch.float32, torch.float64"


_FUSER_DTYPES = {t: d for d, t in TORCH_DTYPES.items()}
# every torch dtype a fusion's input may have: the floats fuser.torch computes on, and the
# masks and indices beside them (fuser.torch.recorded names each input's)
INPUT_DTYPES = {**_FUSER_DTYPES, torch.bool: DataType.Bool, torch.int32: DataType.Int32,
                torch.int64: DataType.Int64}


def fuser_dtype(dtype: torch.dtype, where: str = "fuser.torch", name: str = "a tensor") -> DataType:
    """The fusions' DataType of a torch dtype fuser.torch computes on."""
    found = _FUSER_DTYPES.get(dtype)
    if found is None:
        raise BadInputError(f"{where}: {name} has dtype {dtype}; fuser.torch takes {_ALLOWED}")
    return found


def check_float(where: str, name: str, t: Tensor | None) -> None:
    """A tensor fuser.torch computes on must be of a floating dtype the fusions take."""
    if t is not None:
        fuser_dtype(t.dtype, where, name)


def check_normalized_shape(where: str, x: Tensor, normalized_shape) -> tuple[int, ...]:
    """`normalized_shape` as a tuple, after checking that it ends x's shape."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise BadInputError(
            f"{where}: normalized_shape {list(shape)} must be the last dimensions of the input, "
            f"whose shape is {list(x.shape)}; pass normalized_shape={list(x.shape[-1:])} to "
            "normalize over the last dimension")
    return shape


def check_parameter(where: str, name: str, t: Tensor | None, shape: tuple[int, ...]) -> None:
    """A weight or bias must be of the normalized shape (and of a dtype fuser takes)."""
    if t is None:
        return
    check_float(where, name, t)
    if tuple(t.shape) != shape:
        raise BadInputError(f"{where}: {name} has shape {list(t.shape)}; it must be the "
                            f"normalized shape {list(shape)}")


# Elements of a group below which a normalization along a dim other than the last moves its
# operand to rows: one warp of 16-byte vectors of 2-byte elements. The outer kernel gives a
# smaller group a block of a few dozen threads (100000 groups of [3, 5]: 100000 blocks of 32
# threads for 15 elements each), where the move is a copy each way around one row kernel.
# Chosen by the block sizes the outer scheduler gives such groups, not measured yet.
COLUMNS_MIN_GROUP = 256


def normalized_along_columns(along: int, after: int) -> bool:
    """Whether a softmax or cross entropy along a dim of `along` elements, followed by dims of
    `after` elements together, runs on x where it lies, as groups [along, after] of the
    outer kernel (else as rows [.., along]: x itself where `after` is one, else moved)."""
    return after > 1 and along * after >= COLUMNS_MIN_GROUP


def materialize(grad: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """An output's gradient, zeros where nothing used the output (the ops ask autograd not to
    materialize them: most are statistics no one differentiates)."""
    return torch.zeros(like.shape, dtype=dtype, device=like.device) if grad is None else grad


def _no_double_backward(ctx, *grads):
    raise UnsupportedFusionError(
        "fuser.torch's backward kernels have no derivative of their own: double backward "
        "(torch.autograd.grad(..., create_graph=True) through a fuser op, then backward "
        "again) is not supported; use torch's own modules where second derivatives are needed")


def forbid_double_backward(op) -> None:
    """Give a backward op an autograd formula that refuses, with a FuserError that says so
    (torch's default error would ask for register_autograd)."""
    op.register_autograd(_no_double_backward)
