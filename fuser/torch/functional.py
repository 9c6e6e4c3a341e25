"""fuser.torch's functions: torch.nn.functional's rms_norm, layer_norm, softmax, log_softmax
and cross_entropy, Hugging Face's Llama and Gemma RMSNorms, and the dropout + residual add +
norm of pre-norm transformer blocks, on fuser's kernels.

Each checks its arguments (a FuserError naming the value and what is allowed), flattens the
leading dimensions into rows (softmax's op views x around its dim itself) and calls a fuser op
(_ops.py, _softmax.py, _cross_entropy.py); the reshapes are torch ops, so autograd and
torch.compile see through them. Dropout masks come from torch's default generator
(torch.manual_seed makes them repeatable; torch.compile draws them its own way).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fuser.errors import BadInputError
from fuser.torch import _cross_entropy, _ops, _softmax
from fuser.torch._support import (
    check_float,
    check_normalized_shape,
    check_parameter,
    normalized_along_columns,
)

_EPS = {torch.float64: torch.finfo(torch.float64).eps}
_FLOAT_EPS = torch.finfo(torch.float32).eps


def _default_eps(x: Tensor, eps: float | None) -> float:
    """torch's RMSNorm default: the epsilon of the type it computes in (float32 for half
    types, as torch's kernels do, although its docs say x's dtype)."""
    return _EPS.get(x.dtype, _FLOAT_EPS) if eps is None else float(eps)


def _reshaped(t: Tensor, shape) -> Tensor:
    """t in `shape`: t itself where it has that shape already (a reshape that changes nothing
    is still a view, and autograd's node for it costs host time in the backward)."""
    return t if t.shape == shape else t.reshape(shape)


def _rows(where: str, x: Tensor, normalized_shape, params: dict) -> tuple[Tensor, list]:
    """x as [rows, hidden] and each parameter as [hidden], after the checks."""
    check_float(where, "input", x)
    shape = check_normalized_shape(where, x, normalized_shape)
    for name, t in params.items():
        check_parameter(where, name, t, shape)
    hidden = math.prod(shape)
    rows = x if x.dim() == 2 and len(shape) == 1 else x.reshape(-1, hidden)
    return rows, [None if t is None else _reshaped(t, (hidden,)) for t in params.values()]


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """torch.nn.functional.rms_norm: x / sqrt(mean(x^2) + eps) * weight over the trailing
    normalized_shape dimensions, in x's dtype (eps=None: float32's epsilon, float64's for
    float64 input, as torch)."""
    rows, (w,) = _rows("fuser.torch.rms_norm", x, normalized_shape, {"weight": weight})
    eps = _default_eps(x, eps)
    y, _, _ = _ops.apply_rms_norm(rows, None, None, w, 1.0, eps, x.dtype, False, False)
    return _reshaped(y, x.shape)


def hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face LlamaRMSNorm's numerics: x normalized in float32, rounded to x's dtype,
    times the weight, in the promoted dtype of the two (float32 for a float32 weight)."""
    where = "fuser.torch.hf_rms_norm"
    rows, (w,) = _rows(where, x, weight.shape[-1:], {"weight": weight})
    out = torch.promote_types(weight.dtype, x.dtype)
    y, _, _ = _ops.apply_rms_norm(rows, None, None, w, 1.0, float(eps), out, True, False)
    return _reshaped(y, x.shape)


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Hugging Face GemmaRMSNorm's numerics (Gemma 1 to 3, and the norms written like it):
    x normalized in float32, times 1 + weight (the weight an offset from one, zero at
    initialization) in float32, rounded once to x's dtype."""
    where = "fuser.torch.gemma_rms_norm"
    rows, (w,) = _rows(where, x, weight.shape[-1:], {"weight": weight})
    y, _, _ = _ops.apply_rms_norm(rows, None, None, w, 1.0, float(eps), x.dtype, False, True)
    return _reshaped(y, x.shape)


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.layer_norm over the trailing normalized_shape dimensions, in x's
    dtype."""
    rows, (w, b) = _rows("fuser.torch.layer_norm", x, normalized_shape,
                         {"weight": weight, "bias": bias})
    y, _, _, _ = _ops.apply_layer_norm(rows, None, None, w, b, 1.0, float(eps))
    return _reshaped(y, x.shape)


def _dropout(where: str, rows: Tensor, p: float, training: bool) -> tuple[Tensor | None, float]:
    """The keep mask (True keeps; torch's default generator) and the scale 1 / (1 - p); no
    mask in eval mode or at p = 0."""
    if not 0.0 <= p <= 1.0:
        raise BadInputError(f"{where}: dropout probability p={p}; it must be in [0, 1]")
    if not training or p == 0.0:
        return None, 1.0
    if p == 1.0:
        return torch.zeros(rows.shape, dtype=torch.bool, device=rows.device), 0.0
    mask = torch.empty(rows.shape, dtype=torch.bool, device=rows.device).bernoulli_(1.0 - p)
    return mask, 1.0 / (1.0 - p)


def _residual_rows(where: str, x: Tensor, rows: Tensor,
                   residual: Tensor | None) -> Tensor | None:
    """The residual as x's rows are (`rows`), after checking that it has x's shape."""
    if residual is None:
        return None
    check_float(where, "residual", residual)
    if residual.shape != x.shape:
        raise BadInputError(f"{where}: residual has shape {list(residual.shape)}; it must be "
                            f"the input's shape {list(x.shape)}")
    return _reshaped(residual, rows.shape)


def dropout_add_rms_norm(x: Tensor, residual: Tensor | None, normalized_shape,
                         weight: Tensor | None = None, p: float = 0.0,
                         eps: float | None = None,
                         training: bool = True) -> tuple[Tensor, Tensor]:
    """(rms_norm(h), h) where h = residual + dropout(x, p), as pre-norm transformer blocks
    use it; residual None (the first block) means h = dropout(x). h is computed in float32
    and normalized before rounding; it is returned in the residual's dtype (x's without)."""
    where = "fuser.torch.dropout_add_rms_norm"
    rows, (w,) = _rows(where, x, normalized_shape, {"weight": weight})
    res = _residual_rows(where, x, rows, residual)
    mask, scale = _dropout(where, rows, p, training)
    if mask is None and res is None:
        return rms_norm(x, normalized_shape, weight, eps), x
    eps = _default_eps(x, eps)
    y, h, _ = _ops.apply_rms_norm(rows, mask, res, w, scale, eps, x.dtype, False, False)
    return _reshaped(y, x.shape), _reshaped(h, x.shape)


def dropout_add_layer_norm(x: Tensor, residual: Tensor | None, normalized_shape,
                           weight: Tensor | None = None, bias: Tensor | None = None,
                           p: float = 0.0, eps: float = 1e-5,
                           training: bool = True) -> tuple[Tensor, Tensor]:
    """(layer_norm(h), h) where h = residual + dropout(x, p), as dropout_add_rms_norm."""
    where = "fuser.torch.dropout_add_layer_norm"
    rows, (w, b) = _rows(where, x, normalized_shape, {"weight": weight, "bias": bias})
    res = _residual_rows(where, x, rows, residual)
    mask, scale = _dropout(where, rows, p, training)
    if mask is None and res is None:
        return layer_norm(x, normalized_shape, weight, bias, eps), x
    y, h, _, _ = _ops.apply_layer_norm(rows, mask, res, w, b, scale, float(eps))
    return _reshaped(y, x.shape), _reshaped(h, x.shape)


def _softmax_along(where: str, x: Tensor, dim, dtype: torch.dtype | None, log: bool) -> Tensor:
    """softmax's and log_softmax's shared body: x cast to `dtype` (as torch's dtype argument
    does), the checks, then the op along dim, in place in x's layout (a contiguous output, as
    torch's)."""
    x = x if dtype is None else x.to(dtype)
    check_float(where, "input", x)
    ndim = max(x.dim(), 1)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise BadInputError(f"{where}: dim={dim!r} for an input of {x.dim()} dimensions; pass "
                            f"an int from {-ndim} to {ndim - 1}")
    if x.dim() == 0:
        return _softmax.apply_softmax(x.reshape(1), 0, log).reshape(())
    return _softmax.apply_softmax(x, dim % ndim, log)


def softmax(x: Tensor, dim: int | None, dtype: torch.dtype | None = None) -> Tensor:
    """torch.softmax(x, dim, dtype). Along the last dim x is rows for the row kernels; along
    another, one outer kernel normalizes x where it lies (fuser/torch/_softmax.py)."""
    return _softmax_along("fuser.torch.softmax", x, dim, dtype, log=False)


def log_softmax(x: Tensor, dim: int | None, dtype: torch.dtype | None = None) -> Tensor:
    """torch.log_softmax(x, dim, dtype): (x - max) - log(sum(exp(x - max))) along dim, its
    backward from the output alone (dy - exp(y) * sum(dy)), as softmax."""
    return _softmax_along("fuser.torch.log_softmax", x, dim, dtype, log=True)


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """torch.nn.functional.cross_entropy of logits `input` [N, C] (or [C], or [N, C, d1, ...]
    with the classes along dim 1) and class indices `target` [N] (or a scalar, or
    [N, d1, ...]), with class weights [C] or without: one fuser kernel over the logits for the
    log-sum-exp of each row, which also writes their gradient where the loss is reduced and
    the logits want one, else another kernel writes it in the backward (_cross_entropy.py).
    Logits [N, C, d1, ...] are taken where they lie as [N, C, d1 * ...] (one outer kernel
    along the classes, _cross_entropy.py), or, where C * d1 * ... is small
    (_support.normalized_along_columns), moved to rows [N * d1 * ..., C] (a copy, and one of
    their gradient back); [B, T, C] logits are torch's [N, C, d1] form too, so a caller with
    classes last flattens them to [B * T, C] (a view). A class index outside [0, C) other
    than ignore_index fails on the device, in torch's gather, as in torch's own loss
    (checking it on the host would wait for the GPU every call). Class weights scale each
    row's loss and gradient by its target's weight (a mean divides by the weights' sum), and
    beside label smoothing weight its term per class, as torch's: the row kernels then take
    the weights as a column input, so [N, C, d1, ...] logits are moved to rows for them."""
    where = "fuser.torch.cross_entropy"
    check_float(where, "input", input)
    if reduction not in _cross_entropy.REDUCTIONS:
        raise BadInputError(f"{where}: reduction={reduction!r}; pass one of "
                            f"{', '.join(map(repr, _cross_entropy.REDUCTIONS))}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise BadInputError(f"{where}: label_smoothing={label_smoothing}; it must be in [0, 1]")
    if input.dim() == 0:
        raise BadInputError(f"{where}: input is a scalar; fuser takes logits [C], [N, C] or "
                            "[N, C, d1, ...]")
    if target.dtype != torch.int64:
        raise BadInputError(
            f"{where}: target has dtype {target.dtype}; fuser takes class indices of dtype "
            "torch.int64 (targets of class probabilities are not supported)")
    target_shape = input.shape[:1] + input.shape[2:] if input.dim() > 2 else input.shape[:-1]
    if target.shape != target_shape:
        raise BadInputError(f"{where}: target has shape {list(target.shape)}; for input of "
                            f"shape {list(input.shape)} it must be {list(target_shape)}")
    if target.device != input.device:
        raise BadInputError(f"{where}: target is on {target.device}, input on {input.device}; "
                            f"move target to {input.device}")
    classes = input.shape[1 if input.dim() > 1 else 0]
    if weight is not None:
        _check_class_weights(where, weight, classes, input)
    positions = math.prod(input.shape[2:])
    per_class = weight is not None and label_smoothing > 0  # a column input: rows only
    if normalized_along_columns(classes, positions) and not per_class:
        logits, targets = input.reshape(input.shape[0], classes, positions), target.reshape(
            input.shape[0], positions)
    else:
        logits = (input.movedim(1, -1) if input.dim() > 2 else input).reshape(-1, classes)
        targets = target.reshape(-1)
    loss = _cross_entropy.apply_cross_entropy(logits, targets, weight, int(ignore_index),
                                              float(label_smoothing), reduction)
    return loss.reshape(target_shape) if reduction == "none" else loss


def _check_class_weights(where: str, weight: Tensor, classes: int, input: Tensor) -> None:
    """Class weights fuser takes: [C] of a float dtype on the logits' device, needing no
    gradient (torch's loss has no derivative for them)."""
    check_float(where, "weight", weight)
    if tuple(weight.shape) != (classes,):
        raise BadInputError(f"{where}: weight has shape {list(weight.shape)}; class weights "
                            f"must be one per class, [{classes}]")
    if weight.device != input.device:
        raise BadInputError(f"{where}: weight is on {weight.device}, input on {input.device}; "
                            f"move weight to {input.device}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise BadInputError(f"{where}: weight requires a gradient, which the loss has no "
                            "derivative for (torch's has none either); pass weight.detach()")
