"""The cross-entropy ops: fuser::cross_entropy over [rows, classes] logits with class-index
targets, and its backward; apply_cross_entropy calls them (the op under torch.compile, else an
autograd.Function: _eager.py).

The forward reads the logits once, in one fuser kernel (the log-sum-exp of each row, and its
sum where labels are smoothed); the target's logit of each row is gathered by torch (one
element a row), and the loss per row, its reduction and the ignored rows are torch's
arithmetic on [rows] values. The backward reads the logits once and writes their gradient
once, scale * (softmax - smoothing / classes) a row, in one fuser kernel; the one-hot term is
then written into each row's target element, computed again from the gathered logit in the
compute type, so that element is rounded once, as every other. It keeps the logits, the
targets and the log-sum-exps, never the softmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fuser.torch import _fusions
from fuser.torch._eager import dispatcher, eager_backward
from fuser.torch._support import TORCH_DTYPES, forbid_double_backward, fuser_dtype

REDUCTIONS = ("mean", "sum", "none")


def _compute(x: Tensor) -> torch.dtype:
    """The dtype the kernels compute x's rows in (float32 for half types, float64 for
    float64), which the log-sum-exps are kept in."""
    return TORCH_DTYPES[_fusions.compute_type(fuser_dtype(x.dtype))]


def _picked(x: Tensor, target: Tensor, valid: Tensor, dtype: torch.dtype) -> tuple:
    """(each row's target index, 0 for an ignored row; the logit there, in `dtype`)."""
    index = torch.where(valid, target, 0).unsqueeze(1)
    return index, x.gather(1, index).squeeze(1).to(dtype)


def _row_statistics(x: Tensor, row_sums: bool) -> tuple[Tensor, Tensor | None]:
    """Each row's log-sum-exp [rows] and, where `row_sums`, its sum (else None), in the
    compute type: one fuser kernel over the logits."""
    rows = x.shape[0]
    if rows == 0:  # fuser refuses empty tensors: no row, nothing to reduce
        empty = x.new_empty((0,), dtype=_compute(x))
        return empty, empty if row_sums else None
    outs = _fusions.run(_fusions.logsumexp_forward(fuser_dtype(x.dtype), row_sums), [x])
    return outs[0].view(rows), outs[1].view(rows) if row_sums else None


def _cross_entropy(x: Tensor, target: Tensor, ignore_index: int, smoothing: float,
                   reduction: str) -> tuple[Tensor, Tensor]:
    """(loss, lse): the loss of logits x [rows, classes] for class indices `target` [rows]
    ([rows] where reduction is 'none', else a scalar; in x's dtype), and each row's
    log-sum-exp [rows] in the compute type."""
    x = x.contiguous()
    classes = x.shape[1]
    lse, sums = _row_statistics(x, smoothing > 0)
    valid = target != ignore_index
    _, logit = _picked(x, target, valid, lse.dtype)
    losses = lse - logit
    if sums is not None:
        losses = (1 - smoothing) * losses + smoothing * (lse - sums / classes)
    losses = torch.where(valid, losses, 0)
    if reduction == "none":
        loss = losses
    elif reduction == "sum":
        loss = losses.sum()
    else:
        loss = losses.sum() / valid.sum()
    return loss.to(x.dtype), lse


def _row_scale(grad: Tensor, valid: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    """The loss's gradient for each row, 0 for an ignored one."""
    grad = grad.to(dtype)
    if reduction == "mean":
        grad = grad / valid.sum()
    return torch.where(valid, grad, 0)


def _cross_entropy_backward(grad: Tensor, x: Tensor, target: Tensor, lse: Tensor,
                            ignore_index: int, smoothing: float, reduction: str) -> Tensor:
    """The logits' gradient, in x's dtype: scale * (softmax(x) - smoothing / classes) less
    scale * (1 - smoothing) in each row's target element."""
    x = x.contiguous()
    rows, classes = x.shape
    if rows == 0:
        return torch.empty_like(x)
    valid = target != ignore_index
    scale = _row_scale(grad, valid, reduction, lse.dtype)
    shift = smoothing / classes
    (out,) = _fusions.run(_fusions.cross_entropy_backward(fuser_dtype(x.dtype)),
                          [x, lse.view(rows, 1), scale.view(rows, 1), shift])
    index, logit = _picked(x, target, valid, lse.dtype)
    at_target = scale * (torch.exp(logit - lse) - shift - (1 - smoothing))
    return out.scatter_(1, index, at_target.to(out.dtype).unsqueeze(1))


cross_entropy = torch.library.custom_op("fuser::cross_entropy", _cross_entropy, mutates_args=())


@cross_entropy.register_fake
def _(x, target, ignore_index, smoothing, reduction):
    rows = x.shape[0]
    loss = x.new_empty((rows,) if reduction == "none" else ())
    return loss, x.new_empty((rows,), dtype=_compute(x))


cross_entropy_backward = torch.library.custom_op(
    "fuser::cross_entropy_backward", _cross_entropy_backward, mutates_args=())


@cross_entropy_backward.register_fake
def _(grad, x, target, lse, ignore_index, smoothing, reduction):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    x, target, ignore_index, smoothing, reduction = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, target, output[1])
    ctx.ignore_index, ctx.smoothing, ctx.reduction = ignore_index, smoothing, reduction


def _grads(ctx, grad, _dlse):
    x, target, lse = ctx.saved_tensors
    if grad is None:  # nothing used the loss
        return None, None, None, None, None
    backward = eager_backward(ctx, cross_entropy_backward, _cross_entropy_backward)
    return (backward(grad, x, target, lse, ctx.ignore_index, ctx.smoothing, ctx.reduction),
            None, None, None, None)


cross_entropy.register_autograd(_grads, setup_context=_setup)
forbid_double_backward(cross_entropy_backward)
apply_cross_entropy = dispatcher(cross_entropy, _cross_entropy, _setup, _grads)
