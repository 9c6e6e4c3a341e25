"""The softmax ops: fuser::softmax over the last dimension of a [rows, hidden] tensor and its
backward, grad_x = y * (dy - sum(dy * y)), which reads only the saved output y and dy;
apply_softmax calls them (the op under torch.compile, else an autograd.Function: _eager.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from fuser.torch import _fusions
from fuser.torch._eager import dispatcher, eager_backward
from fuser.torch._fusions import softmax_backward as _backward_fusion
from fuser.torch._fusions import softmax_forward as _forward_fusion
from fuser.torch._support import forbid_double_backward, fuser_dtype


def _run(fd, x: Tensor, inputs: list[Tensor]) -> Tensor:
    if x.shape[0] == 0:  # fuser refuses empty tensors; a batch of no rows has nothing to do
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return _fusions.run(fd, [t.contiguous() for t in inputs])[0]


def _softmax(x: Tensor) -> Tensor:
    """Softmax over the last dimension of x [rows, hidden], in x's dtype."""
    return _run(_forward_fusion(fuser_dtype(x.dtype)), x, [x])


softmax = torch.library.custom_op("fuser::softmax", _softmax, mutates_args=())


@softmax.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _softmax_backward(dy: Tensor, y: Tensor) -> Tensor:
    """grad_x of softmax from its output y and y's gradient dy, in y's dtype."""
    return _run(_backward_fusion(fuser_dtype(y.dtype), fuser_dtype(dy.dtype)), y, [y, dy])


softmax_backward = torch.library.custom_op("fuser::softmax_backward", _softmax_backward,
                                           mutates_args=())


@softmax_backward.register_fake
def _(dy, y):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output)


def _grads(ctx, dy):
    (y,) = ctx.saved_tensors
    return eager_backward(ctx, softmax_backward, _softmax_backward)(dy, y)


softmax.register_autograd(_grads, setup_context=_setup)
forbid_double_backward(softmax_backward)
apply_softmax = dispatcher(softmax, _softmax, _setup, _grads)
