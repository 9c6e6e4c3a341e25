"""The cross-entropy ops: fuser::cross_entropy over [rows, classes] logits with class-index
targets [rows] (or logits [G, classes, H] with targets [G, H]: torch's [N, C, d1, ...] form,
classes along dim 1, each position's log-sum-exp taken along them by one outer kernel where
the logits lie), and its backward; apply_cross_entropy calls them (the op under
torch.compile, else an autograd.Function: _eager.py), or writes the gradient in the forward
(below).

The forward reads the logits once, in one fuser kernel (the log-sum-exp of each row, and its
sum where labels are smoothed); the target's logit of each row is gathered by torch (one
element a row), and the loss per row, its reduction and the ignored rows are torch's
arithmetic on [rows] values. The backward reads the logits once and writes their gradient
once, scale * (softmax - smoothing / classes) a row, in one fuser kernel; the one-hot term is
then written into each row's target element, computed again from the gathered logit in the
compute type, so that element is rounded once, as every other. It keeps the logits, the
targets and the log-sum-exps, never the softmax.

That reads the logits twice in a training step. Where the loss is reduced (mean or sum) and
the logits want a gradient, the eager path writes it in the forward instead, for a loss
gradient of one, in the kernel that reads the logits for the log-sum-exps
(_GradientInForward): the step reads the logits once and writes their gradient once, and
keeps the gradient, not the logits. Its backward scales the gradient in place by the loss's
gradient, read on the device (fuser.rescale: a launch and no pass where it is one, as after a
plain `loss.backward()`). A loss scaled before its backward (gradient accumulation, a
GradScaler) would pay that pass on top: the rescale kernel records whether the factor was one,
and where the last backward's was not, the next forward leaves the gradient to the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.autograd import forward_ad

from fuser.errors import UnsupportedFusionError
from fuser.torch import _fusions
from fuser.torch._eager import dispatcher, eager_backward, plain
from fuser.torch._support import TORCH_DTYPES, forbid_double_backward, fuser_dtype

REDUCTIONS = ("mean", "sum", "none")


def _compute(x: Tensor) -> torch.dtype:
    """The dtype the kernels compute x's rows in (float32 for half types, float64 for
    float64), which the log-sum-exps are kept in."""
    return TORCH_DTYPES[_fusions.compute_type(fuser_dtype(x.dtype))]


def _positions(x: Tensor) -> torch.Size:
    """The shape of the per-position values of logits x (targets, losses, log-sum-exps): x's
    without its classes (dim 1): [rows], or [G, H]."""
    return x.shape[:1] + x.shape[2:]


def _picked(x: Tensor, target: Tensor, valid: Tensor, dtype: torch.dtype) -> tuple:
    """(each row's target index, 0 for an ignored row, kept along dim 1; the logit there, in
    `dtype`)."""
    index = torch.where(valid, target, 0).unsqueeze(1)
    return index, x.gather(1, index).squeeze(1).to(dtype)


@dataclass(frozen=True)
class _ClassWeights:
    """A call's class weights in the compute type, taken once: per class (what the kernels
    read beside label smoothing), at each row's target (an ignored row's read at class 0 and
    masked by its users) and their total (label smoothing's sum(w))."""

    per_class: Tensor
    per_row: Tensor
    total: Tensor


def _class_weights(weight: Tensor | None, target: Tensor, valid: Tensor, dtype: torch.dtype
                   ) -> _ClassWeights | None:
    """The call's _ClassWeights, None without class weights."""
    if weight is None:
        return None
    per_class = weight.to(dtype)
    return _ClassWeights(per_class, per_class[torch.where(valid, target, 0)], per_class.sum())


def _row_statistics(x: Tensor, row_sums: bool, weights: _ClassWeights | None
                    ) -> tuple[Tensor, Tensor | None]:
    """Each row's log-sum-exp (_positions) and, where `row_sums`, its sum (of x * w with
    class weights) or None, in the compute type: one fuser kernel over the logits."""
    positions = _positions(x)
    if x.numel() == 0:  # fuser refuses empty tensors: no row, nothing to reduce
        empty = x.new_empty(positions, dtype=_compute(x))
        return empty, empty if row_sums else None
    per_class = weights.per_class if row_sums and weights is not None else None
    fd = _fusions.logsumexp_forward(fuser_dtype(x.dtype), row_sums, x.dim() == 3,
                                    per_class is not None)
    outs = _fusions.run(fd, [x] if per_class is None else [x, per_class])
    return outs[0].view(positions), outs[1].view(positions) if row_sums else None


def _count(valid: Tensor, weights: _ClassWeights | None, reduction: str) -> Tensor | None:
    """What a mean divides by: the rows not ignored, or with class weights the sum of their
    weights (torch's weighted mean); None for the other reductions."""
    if reduction != "mean":
        return None
    return valid.sum() if weights is None else torch.where(valid, weights.per_row, 0).sum()


def _loss(lse: Tensor, sums: Tensor | None, logit: Tensor, valid: Tensor,
          weights: _ClassWeights | None, count: Tensor | None, classes: int, smoothing: float,
          reduction: str) -> Tensor:
    """The loss from each row's log-sum-exp, sum (where labels are smoothed; of x * w with
    class weights), target logit and class weight, in the compute type: [rows] where
    reduction is 'none', else a scalar (a mean divided by `count`, _count's). With class
    weights, torch's: (1 - smoothing) * w[t] * (lse - x[t]) + smoothing * (sum(w) * lse -
    sum(w * x)) / classes."""
    losses = lse - logit
    if weights is not None:
        losses = losses * weights.per_row
    if sums is not None:
        smooth = (lse - sums / classes if weights is None
                  else (weights.total * lse - sums) / classes)
        losses = (1 - smoothing) * losses + smoothing * smooth
    losses = torch.where(valid, losses, 0)
    if reduction == "none":
        return losses
    return losses.sum() if count is None else losses.sum() / count


def _cross_entropy(x: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                   smoothing: float, reduction: str) -> tuple[Tensor, Tensor]:
    """(loss, lse): the loss of logits x [rows, classes] for class indices `target` [rows],
    with class weights [classes] or None, in x's dtype ([rows] where reduction is 'none',
    else a scalar), and each row's log-sum-exp [rows] in the compute type; for x
    [G, classes, H], target, losses and log-sum-exps [G, H]."""
    x = x.contiguous()
    valid = target != ignore_index
    weights = _class_weights(weight, target, valid, _compute(x))
    lse, sums = _row_statistics(x, smoothing > 0, weights)
    _, logit = _picked(x, target, valid, lse.dtype)
    loss = _loss(lse, sums, logit, valid, weights, _count(valid, weights, reduction),
                 x.shape[1], smoothing, reduction)
    return loss.to(x.dtype), lse


@dataclass(frozen=True)
class _RowGradient:
    """How the kernels write each row's gradient: scale * (softmax - shift) for a scalar
    shift (label smoothing's share of each class), or, with class weights beside label
    smoothing, scale * softmax - shift * per_class for a shift per row; and `off` [rows],
    what the row's target element has less than scale * softmax, its own shift and the
    one-hot term together."""

    scale: Tensor
    shift: Tensor | float
    off: Tensor
    per_class: Tensor | None = None  # the class weights the shift multiplies, if any

    @property
    def weighted(self) -> bool:
        """Whether the kernels take the weighted form (cross_entropy_backward's `weighted`)."""
        return self.per_class is not None

    def kernel_inputs(self) -> list:
        """The kernels' inputs after x (and lse): the scale, the shift, the class weights."""
        scale = self.scale.unsqueeze(1)
        if isinstance(self.shift, float) or self.per_class is None:
            return [scale, self.shift]
        return [scale, self.shift.unsqueeze(1), self.per_class]

    def at_target(self, logit: Tensor, lse: Tensor) -> Tensor:
        """Each row's gradient at its target element, in the compute type."""
        return self.scale * torch.exp(logit - lse) - self.off


def _row_gradient(grad: Tensor, valid: Tensor, weights: _ClassWeights | None,
                  count: Tensor | None, classes: int, smoothing: float, dtype: torch.dtype
                  ) -> _RowGradient:
    """The rows' _RowGradient for the loss's gradient `grad` (a mean's divided by `count`,
    _count's; 0 for an ignored row). Without class weights: scale s, shift smoothing /
    classes, off s * (shift + 1 - smoothing). With them, s * w[t] where torch's loss has
    w[t], and beside label smoothing the smoothing term's derivative, s * smoothing / classes
    * (sum(w) * softmax - w)."""
    s = grad.to(dtype)
    if count is not None:
        s = s / count
    s = torch.where(valid, s, 0)
    if weights is None:
        shift = smoothing / classes
        return _RowGradient(s, shift, s * (shift + 1 - smoothing))
    nll = s * weights.per_row * (1 - smoothing)
    if smoothing == 0:
        return _RowGradient(nll, 0.0, nll)
    share = s * (smoothing / classes)
    return _RowGradient(nll + share * weights.total, share, share * weights.per_row + nll,
                        weights.per_class)


def _cross_entropy_backward(grad: Tensor, x: Tensor, target: Tensor, weight: Tensor | None,
                            lse: Tensor, ignore_index: int, smoothing: float, reduction: str
                            ) -> Tensor:
    """The logits' gradient, in x's dtype: the rows' _RowGradient written by one fuser
    kernel, then each row's target element."""
    x = x.contiguous()
    if x.numel() == 0:
        return torch.empty_like(x)
    valid = target != ignore_index
    weights = _class_weights(weight, target, valid, lse.dtype)
    rows = _row_gradient(grad, valid, weights, _count(valid, weights, reduction), x.shape[1],
                         smoothing, lse.dtype)
    fd = _fusions.cross_entropy_backward(fuser_dtype(x.dtype), x.dim() == 3, rows.weighted)
    (out,) = _fusions.run(fd, [x, lse.unsqueeze(1), *rows.kernel_inputs()])
    index, logit = _picked(x, target, valid, lse.dtype)
    return _with_one_hot(out, index, rows.at_target(logit, lse))


def _with_one_hot(out: Tensor, index: Tensor, at_target: Tensor) -> Tensor:
    """`out` (the gradient but for its one-hot term) with each row's target element written
    from `at_target` (_RowGradient.at_target, in the compute type, so rounded once)."""
    return out.scatter_(1, index, at_target.to(out.dtype).unsqueeze(1))


cross_entropy = torch.library.custom_op("fuser::cross_entropy", _cross_entropy, mutates_args=())


@cross_entropy.register_fake
def _(x, target, weight, ignore_index, smoothing, reduction):
    positions = _positions(x)
    loss = x.new_empty(positions if reduction == "none" else ())
    return loss, x.new_empty(positions, dtype=_compute(x))


cross_entropy_backward = torch.library.custom_op(
    "fuser::cross_entropy_backward", _cross_entropy_backward, mutates_args=())


@cross_entropy_backward.register_fake
def _(grad, x, target, weight, lse, ignore_index, smoothing, reduction):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    x, target, weight, ignore_index, smoothing, reduction = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, target, weight, output[1])
    ctx.ignore_index, ctx.smoothing, ctx.reduction = ignore_index, smoothing, reduction


def _grads(ctx, grad, _dlse):
    x, target, weight, lse = ctx.saved_tensors
    if grad is None:  # nothing used the loss
        return None, None, None, None, None, None
    backward = eager_backward(ctx, cross_entropy_backward, _cross_entropy_backward)
    if backward is _cross_entropy_backward and ctx.reduction != "none":
        _FactorRecord.of(x).write(grad)
    return (backward(grad, x, target, weight, lse, ctx.ignore_index, ctx.smoothing,
                     ctx.reduction), None, None, None, None, None)


cross_entropy.register_autograd(_grads, setup_context=_setup)
forbid_double_backward(cross_entropy_backward)
_two_kernels = dispatcher(cross_entropy, _cross_entropy, _setup, _grads)


def apply_cross_entropy(x: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                        smoothing: float, reduction: str) -> Tensor:
    """The loss of logits x [rows, classes] for class indices `target` [rows] (and class
    weights, or None): the gradient written in the forward where that saves a pass
    (_writes_gradient), else the two-kernel ops."""
    if _writes_gradient(x, reduction):
        return _GradientInForward.apply(x, target, weight, ignore_index, smoothing, reduction)
    return _two_kernels(x, target, weight, ignore_index, smoothing, reduction)[0]


def _writes_gradient(x: Tensor, reduction: str) -> bool:
    """Whether the forward writes the logits' gradient: on the eager path (nothing but
    autograd watching, no forward-mode AD, no saved-tensor hooks), for a loss reduced to a
    scalar whose gradient the last backward found to be one (or no backward yet), where the
    logits want a gradient and there are rows."""
    return (reduction != "none" and x.requires_grad and torch.is_grad_enabled()
            and x.numel() > 0 and forward_ad._current_level < 0 and plain(x)
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            and not _FactorRecord.of(x).not_one())


def _loss_and_gradient(x: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                       smoothing: float, reduction: str) -> tuple[Tensor, Tensor]:
    """(loss, grad): the loss as _cross_entropy gives it ('mean' or 'sum'), and the logits'
    gradient for a loss gradient of one, from one fuser kernel over the logits."""
    x = x.contiguous()
    classes, positions = x.shape[1], _positions(x)
    dtype = _compute(x)
    valid = target != ignore_index
    weights = _class_weights(weight, target, valid, dtype)
    count = _count(valid, weights, reduction)
    rows = _row_gradient(valid.new_ones((), dtype=dtype), valid, weights, count, classes,
                         smoothing, dtype)
    fd = _fusions.cross_entropy_forward_gradient(fuser_dtype(x.dtype), smoothing > 0,
                                                 x.dim() == 3, rows.weighted)
    outs = _fusions.run(fd, [x, *rows.kernel_inputs()])
    lse, grad = outs[0].view(positions), outs[-1]
    sums = outs[1].view(positions) if smoothing > 0 else None
    index, logit = _picked(x, target, valid, dtype)
    loss = _loss(lse, sums, logit, valid, weights, count, classes, smoothing, reduction)
    return loss.to(x.dtype), _with_one_hot(grad, index, rows.at_target(logit, lse))


class _GradientInForward(torch.autograd.Function):
    """Cross entropy whose forward writes the logits' gradient (for a loss gradient of one)
    and keeps it, in place of the logits; the backward scales it in place by the loss's
    gradient and hands it over. A second backward through the same graph
    (retain_graph=True, gradcheck) finds it scaled by the first's factor (_scaled_again)."""

    @staticmethod
    def forward(ctx, x, target, weight, ignore_index, smoothing, reduction):
        loss, grad = _loss_and_gradient(x, target, weight, ignore_index, smoothing, reduction)
        ctx.save_for_backward(grad)
        ctx.first_factor = None
        return loss

    @staticmethod
    def backward(ctx, factor):
        if torch.is_grad_enabled():
            raise UnsupportedFusionError(
                "fuser.torch.cross_entropy wrote the logits' gradient in its forward, which "
                "has no derivative of its own: a backward with create_graph=True through it "
                "is not supported; use torch.nn.functional.cross_entropy where second "
                "derivatives are needed")
        (grad,) = ctx.saved_tensors
        factor = factor.to(grad.dtype).contiguous()
        if ctx.first_factor is not None:
            return _scaled_again(grad, ctx.first_factor, factor), None, None, None, None, None
        _fusions.rescale(grad, factor, _FactorRecord.of(grad).record)
        ctx.first_factor = factor
        return grad, None, None, None, None, None


def _scaled_again(grad: Tensor, first: Tensor, factor: Tensor) -> Tensor:
    """The logits' gradient for the loss gradient `factor`, from the gradient the first
    backward scaled in place by `first` (the saved tensor itself: _writes_gradient refuses
    saved-tensor hooks, which could hand over a copy), rounded once more unless `first` is
    one. Reads `first` on the host, which waits for the GPU: only a repeated backward does."""
    c = _compute(grad)
    first = first.to(c)
    if not bool(torch.isfinite(first) & (first != 0)):
        raise UnsupportedFusionError(
            "fuser.torch.cross_entropy wrote the logits' gradient in its forward; the first "
            f"backward through this loss scaled it by {first.item()}, which leaves nothing "
            "to scale again for a second backward through the same graph. Compute the loss "
            "again for each backward, or take reduction='none' (the two-kernel form, which "
            "keeps the logits) and reduce the losses yourself")
    return (grad.to(c) * (factor.to(c) / first)).to(grad.dtype)


class _FactorRecord:
    """Whether the last backward of a reduced loss was given a gradient other than one: an
    int32 that the backward writes on the device (the rescale kernel, or the two-kernel
    backward by an asynchronous copy) and the next forward reads without waiting for the
    GPU, in pinned host memory for CUDA tensors (the device writes it through unified
    addressing). Read early, it may miss the last backward; the forward after sees it."""

    _kept: ClassVar[dict[bool, _FactorRecord]] = {}

    def __init__(self, cuda: bool):
        self.record = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._host = self.record.numpy()

    @classmethod
    def of(cls, x: Tensor) -> _FactorRecord:
        """The record of x's kind of device (one for every CUDA device: pinned memory is
        every device's)."""
        found = cls._kept.get(x.is_cuda)
        if found is None:
            found = cls._kept[x.is_cuda] = cls(x.is_cuda)
        return found

    def not_one(self) -> bool:
        return bool(self._host[0])

    def write(self, factor: Tensor) -> None:
        """Record whether `factor` (the loss's gradient) is not one, on its stream: an int32
        computed on its device, copied as it is (a copy that converts the type on its way
        to the host would wait for the GPU)."""
        self.record.copy_((factor != 1).to(torch.int32).view(1), non_blocking=True)
