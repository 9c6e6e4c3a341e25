"""The softmax ops: fuser::softmax (softmax or log_softmax of x along `dim`) and its backward,
which reads only the saved output y and dy: grad_x = y * (dy - sum(dy * y)) for softmax,
dy - exp(y) * sum(dy) for log_softmax. apply_softmax calls them (the op under torch.compile,
else an autograd.Function: _eager.py).

Along the last dim (or one whose later dims are all of size 1) x is rows [N, H] for the row
kernels. Along another dim x is [G, N, H] (the dims before it flattened into G, those after
it into H), normalized along N in each group by one outer kernel that reads x and writes y
where they lie, with a grid row of blocks per group; smaller groups
(_support.normalized_along_columns) are moved instead: x to rows [G * H, N] and y back, a
copy each way, around the row kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fuser.torch import _fusions
from fuser.torch._eager import dispatcher, eager_backward
from fuser.torch._fusions import softmax_backward as _backward_fusion
from fuser.torch._fusions import softmax_forward as _forward_fusion
from fuser.torch._support import forbid_double_backward, fuser_dtype, normalized_along_columns


def _run(forward: bool, tensors: list[Tensor], dim: int, log: bool) -> Tensor:
    """The fusion of `tensors` (x, or y and dy) on their operand (module docstring); the
    output in y's shape, contiguous."""
    like = tensors[0]
    if like.numel() == 0:  # fuser refuses empty tensors: nothing to normalize
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    shape = like.shape
    groups, along, after = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    columns = normalized_along_columns(along, after)
    moved = after > 1 and not columns

    def operand(t: Tensor) -> Tensor:
        t = t.contiguous().view(groups, along, after)
        if columns:
            return t
        return (t.transpose(1, 2).contiguous() if moved else t).view(-1, along)

    dtypes = [fuser_dtype(t.dtype) for t in tensors]
    fd = (_forward_fusion(dtypes[0], log, columns) if forward
          else _backward_fusion(dtypes[0], dtypes[1], log, columns))
    out = _fusions.run(fd, [operand(t) for t in tensors])[0]
    if moved:
        out = out.view(groups, after, along).transpose(1, 2).contiguous()
    return out.view(shape)


def _softmax(x: Tensor, dim: int, log: bool) -> Tensor:
    """Softmax (log_softmax where `log`) of x along `dim` (0 to x.dim() - 1), in x's
    dtype."""
    return _run(True, [x], dim, log)


softmax = torch.library.custom_op("fuser::softmax", _softmax, mutates_args=())


@softmax.register_fake
def _(x, dim, log):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _softmax_backward(dy: Tensor, y: Tensor, dim: int, log: bool) -> Tensor:
    """grad_x of softmax (log_softmax where `log`) along `dim` from its output y and y's
    gradient dy, in y's dtype."""
    return _run(False, [y, dy], dim, log)


softmax_backward = torch.library.custom_op("fuser::softmax_backward", _softmax_backward,
                                           mutates_args=())


@softmax_backward.register_fake
def _(dy, y, dim, log):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.log = inputs
    ctx.save_for_backward(output)


def _grads(ctx, dy):
    (y,) = ctx.saved_tensors
    dx = eager_backward(ctx, softmax_backward, _softmax_backward)(dy, y, ctx.dim, ctx.log)
    return dx, None, None


softmax.register_autograd(_grads, setup_context=_setup)
forbid_double_backward(softmax_backward)
apply_softmax = dispatcher(softmax, _softmax, _setup, _grads)
