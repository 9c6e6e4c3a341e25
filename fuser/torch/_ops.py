"""The norm ops: torch.library custom ops running fuser's fusions, with fake implementations
(torch.compile traces a model through them with no graph break) and autograd formulas whose
backward is a custom op too (the one-pass inner-outer kernel).

`fuser::rms_norm` and `fuser::layer_norm` cover plain norms and norm(residual + dropout(x))
alike: the mask and the residual are optional inputs, and the new residual h is an output
left empty where there is neither. Each op takes [rows, hidden] tensors; fuser.torch's
functions flatten the leading dimensions. They save what the backward kernel reads (x, the
residual and the mask it re-adds in registers, the per-row statistics), never the normalized
x. Outputs come from torch's allocator and run on torch's current stream, with no host
synchronization, so CUDA graphs capture them. apply_rms_norm and apply_layer_norm call them:
the custom op under torch.compile, its implementation through an autograd.Function in eager
mode (_eager.py says why).

The implementations are what every eager call runs, so they look up the fusion and the
outputs' layout once per combination of dtypes (a cache keyed on torch's dtypes, cheaper to
hash than a NormSpec) and leave an absent output None: the ops, whose schema returns tensors,
fill those with empty ones (_filled). So apply_rms_norm and apply_layer_norm give None for h
(and the backward for an absent gradient) in eager mode and an empty tensor through the op;
their callers read h only where there is a mask or a residual.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

from fuser.dtypes import DataType
from fuser.torch import _fusions
from fuser.torch._eager import dispatcher, eager_backward
from fuser.torch._fusions import NormSpec, norm_backward, norm_forward
from fuser.torch._support import (
    TORCH_DTYPES,
    forbid_double_backward,
    fuser_dtype,
    materialize,
)

MATRIX, ROW, COLUMN = "matrix", "row", "column"  # an output's shape: [N, H], [N, 1], [H]


@cache
def _norm_spec(rms: bool, x: torch.dtype, out: torch.dtype, dropout: bool,
               residual: torch.dtype | None, weight: torch.dtype | None,
               bias: torch.dtype | None, hf: bool, unit_offset: bool) -> NormSpec:
    """The NormSpec of a norm over tensors of these torch dtypes (None: absent)."""
    def of(dtype: torch.dtype | None) -> DataType | None:
        return None if dtype is None else fuser_dtype(dtype)

    return NormSpec(rms, fuser_dtype(x), fuser_dtype(out), weight=of(weight), bias=of(bias),
                    residual=of(residual), dropout=dropout, hf=hf, unit_offset=unit_offset)


def _dtype(t: Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _spec(rms: bool, x: Tensor, out: torch.dtype, mask: Tensor | None, residual: Tensor | None,
          weight: Tensor | None, bias: torch.dtype | None = None, hf: bool = False,
          unit_offset: bool = False) -> NormSpec:
    return _norm_spec(rms, x.dtype, out, mask is not None, _dtype(residual), _dtype(weight),
                      bias, hf, unit_offset)


def _forward_layout(spec: NormSpec) -> list:
    """(shape kind, dtype) per output of the op; None for an output this spec leaves empty
    (the new residual of a plain norm). The others are the fusion's outputs, in order."""
    stat = TORCH_DTYPES[spec.compute]
    h = (MATRIX, TORCH_DTYPES[spec.h]) if spec.adds else None
    mean = [] if spec.rms else [(ROW, stat)]
    return [(MATRIX, TORCH_DTYPES[spec.out]), h, *mean, (ROW, stat)]


def _backward_layout(spec: NormSpec, affine_grads: bool) -> list:
    """(grad_x, grad_residual, grad_weight[, grad_bias]), as _forward_layout."""
    def column(dtype: DataType | None):
        return (COLUMN, TORCH_DTYPES[dtype]) if affine_grads and dtype is not None else None

    residual = (MATRIX, TORCH_DTYPES[spec.residual]) if spec.residual is not None else None
    bias = [] if spec.rms else [column(spec.bias)]
    return [(MATRIX, TORCH_DTYPES[spec.x]), residual, column(spec.weight), *bias]


def _allocate(layout: list, x: Tensor, fill) -> list[Tensor | None]:
    """Tensors of `layout` for [rows, hidden] input `x`, made by `fill` (x.new_empty, or
    x.new_zeros for the column sums of no rows); None for an empty slot."""
    rows, hidden = x.shape
    shapes = {MATRIX: (rows, hidden), ROW: (rows, 1), COLUMN: (hidden,)}
    return [None if slot is None else fill(shapes[slot[0]], dtype=slot[1]) for slot in layout]


def _filled(x: Tensor, outputs) -> tuple:
    """`outputs` with each absent one (None) an empty tensor: what an op returns."""
    return tuple(x.new_empty((0,)) if t is None else t for t in outputs)


def _execute(fd, layout: list, x: Tensor, inputs: list) -> tuple:
    """Run `fd` and place its outputs in the op's layout, None in its empty slots. A batch of
    no rows launches nothing (fuser refuses empty tensors): its column sums are zeros, as
    torch's."""
    if x.shape[0] == 0:
        return tuple(_allocate(layout, x, x.new_zeros))
    outputs = iter(_fusions.run(fd, [t.contiguous() if isinstance(t, Tensor) else t
                                     for t in inputs]))
    return tuple(None if slot is None else next(outputs) for slot in layout)


@cache
def _forward_plan(*dtypes) -> tuple:
    """(the forward fusion, its outputs' layout) of _norm_spec(*dtypes)."""
    spec = _norm_spec(*dtypes)
    return norm_forward(spec), _forward_layout(spec)


@cache
def _backward_plan(affine_grads: bool, unit_offset: bool, *dtypes) -> tuple:
    """(the backward fusion, its outputs' layout) of _norm_spec(*dtypes), dtypes' `out` being
    dy's dtype (hf's rounding is the forward's alone)."""
    spec = _norm_spec(*dtypes, False, unit_offset)
    return norm_backward(spec, affine_grads), _backward_layout(spec, affine_grads)


def _sum_inputs(x: Tensor, mask: Tensor | None, scale: float, residual: Tensor | None) -> list:
    """The fusions' first inputs: x, [mask, scale], [residual]."""
    inputs: list = [x]
    if mask is not None:
        inputs += [mask, scale]
    if residual is not None:
        inputs.append(residual)
    return inputs


def _adds(mask: Tensor | None, residual: Tensor | None) -> bool:
    """Whether the op sums h = residual + mask * x * scale (NormSpec.adds): a mask or a
    residual, without which h is x."""
    return mask is not None or residual is not None


def _new_residual_grad(dh: Tensor | None, x: Tensor, mask: Tensor | None,
                       residual: Tensor | None) -> Tensor | None:
    """The new residual's gradient where the op had one (zeros if nothing used it), else
    None."""
    if not _adds(mask, residual):
        return None
    return materialize(dh, x, x.dtype if residual is None else residual.dtype)


# ----- RMSNorm -----


def _rms_norm(x: Tensor, mask: Tensor | None, residual: Tensor | None, weight: Tensor | None,
             scale: float, eps: float, out_dtype: torch.dtype, hf: bool,
             unit_offset: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """(y, h, rstd) of RMSNorm over the last dimension of h = residual + mask * x * scale;
    h is None where there is neither a mask nor a residual (h would be x). unit_offset: y is
    scaled by 1 + weight (NormSpec.unit_offset)."""
    fd, layout = _forward_plan(True, x.dtype, out_dtype, mask is not None, _dtype(residual),
                               _dtype(weight), None, hf, unit_offset)
    inputs = [*_sum_inputs(x, mask, scale, residual), *([weight] if weight is not None else []),
              eps]
    return _execute(fd, layout, x, inputs)


def _rms_norm_op(x: Tensor, mask: Tensor | None, residual: Tensor | None,
                 weight: Tensor | None, scale: float, eps: float, out_dtype: torch.dtype,
                 hf: bool, unit_offset: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _filled(x, _rms_norm(x, mask, residual, weight, scale, eps, out_dtype, hf,
                                unit_offset))


rms_norm = torch.library.custom_op("fuser::rms_norm", _rms_norm_op, mutates_args=())


@rms_norm.register_fake
def _(x, mask, residual, weight, scale, eps, out_dtype, hf, unit_offset):
    spec = _spec(True, x, out_dtype, mask, residual, weight, hf=hf, unit_offset=unit_offset)
    return _filled(x, _allocate(_forward_layout(spec), x, x.new_empty))


def _rms_norm_backward(dy: Tensor, dh: Tensor | None, x: Tensor, mask: Tensor | None,
                      residual: Tensor | None, rstd: Tensor, weight: Tensor | None,
                      scale: float, affine_grads: bool, unit_offset: bool) -> tuple:
    """(grad_x, grad_residual, grad_weight), the absent ones None; dh is the new residual's
    gradient, given where the forward had a mask or a residual."""
    fd, layout = _backward_plan(affine_grads, unit_offset, True, x.dtype, dy.dtype,
                                mask is not None, _dtype(residual), _dtype(weight), None)
    inputs = [*_sum_inputs(x, mask, scale, residual), rstd, dy,
              *([weight] if weight is not None else []), *([dh] if _adds(mask, residual) else [])]
    return _execute(fd, layout, x, inputs)


def _rms_norm_backward_op(dy: Tensor, dh: Tensor | None, x: Tensor, mask: Tensor | None,
                          residual: Tensor | None, rstd: Tensor, weight: Tensor | None,
                          scale: float, affine_grads: bool,
                          unit_offset: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _filled(x, _rms_norm_backward(dy, dh, x, mask, residual, rstd, weight, scale,
                                         affine_grads, unit_offset))


rms_norm_backward = torch.library.custom_op("fuser::rms_norm_backward", _rms_norm_backward_op,
                                            mutates_args=())


@rms_norm_backward.register_fake
def _(dy, dh, x, mask, residual, rstd, weight, scale, affine_grads, unit_offset):
    spec = _spec(True, x, dy.dtype, mask, residual, weight, unit_offset=unit_offset)
    return _filled(x, _allocate(_backward_layout(spec, affine_grads), x, x.new_empty))


def _rms_setup(ctx, inputs, output) -> None:
    x, mask, residual, weight, scale, _eps, out_dtype, _hf, unit_offset = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, mask, residual, weight, output[2])
    ctx.scale, ctx.out_dtype, ctx.unit_offset = scale, out_dtype, unit_offset


def _rms_grads(ctx, dy, dh, _drstd):
    x, mask, residual, weight, rstd = ctx.saved_tensors
    dy = materialize(dy, x, ctx.out_dtype)
    dh = _new_residual_grad(dh, x, mask, residual)
    affine = weight is not None and ctx.needs_input_grad[3]
    backward = eager_backward(ctx, rms_norm_backward, _rms_norm_backward)
    gx, gres, gw = backward(dy, dh, x, mask, residual, rstd, weight, ctx.scale, affine,
                            ctx.unit_offset)
    return (gx, None, gres if residual is not None else None, gw if affine else None,
            None, None, None, None, None)


rms_norm.register_autograd(_rms_grads, setup_context=_rms_setup)
forbid_double_backward(rms_norm_backward)
apply_rms_norm = dispatcher(rms_norm, _rms_norm, _rms_setup, _rms_grads)


# ----- LayerNorm -----


def _layer_norm(x: Tensor, mask: Tensor | None, residual: Tensor | None, weight: Tensor | None,
               bias: Tensor | None, scale: float,
               eps: float) -> tuple:
    """(y, h, mean, rstd) of LayerNorm over the last dimension of h, as rms_norm; y in x's
    dtype."""
    fd, layout = _forward_plan(False, x.dtype, x.dtype, mask is not None, _dtype(residual),
                               _dtype(weight), _dtype(bias), False, False)
    inputs = [*_sum_inputs(x, mask, scale, residual),
              *(t for t in (weight, bias) if t is not None), eps]
    return _execute(fd, layout, x, inputs)


def _layer_norm_op(x: Tensor, mask: Tensor | None, residual: Tensor | None,
                   weight: Tensor | None, bias: Tensor | None, scale: float,
                   eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _filled(x, _layer_norm(x, mask, residual, weight, bias, scale, eps))


layer_norm = torch.library.custom_op("fuser::layer_norm", _layer_norm_op, mutates_args=())


@layer_norm.register_fake
def _(x, mask, residual, weight, bias, scale, eps):
    spec = _spec(False, x, x.dtype, mask, residual, weight, _dtype(bias))
    return _filled(x, _allocate(_forward_layout(spec), x, x.new_empty))


def _layer_norm_backward(dy: Tensor, dh: Tensor | None, x: Tensor, mask: Tensor | None,
                        residual: Tensor | None, mean: Tensor, rstd: Tensor,
                        weight: Tensor | None, bias_dtype: torch.dtype | None, scale: float,
                        affine_grads: bool) -> tuple:
    """(grad_x, grad_residual, grad_weight, grad_bias), as rms_norm_backward."""
    fd, layout = _backward_plan(affine_grads, False, False, x.dtype, dy.dtype,
                                mask is not None, _dtype(residual), _dtype(weight), bias_dtype)
    inputs = [*_sum_inputs(x, mask, scale, residual), mean, rstd, dy,
              *([weight] if weight is not None else []), *([dh] if _adds(mask, residual) else [])]
    return _execute(fd, layout, x, inputs)


def _layer_norm_backward_op(dy: Tensor, dh: Tensor | None, x: Tensor, mask: Tensor | None,
                            residual: Tensor | None, mean: Tensor, rstd: Tensor,
                            weight: Tensor | None, bias_dtype: torch.dtype | None,
                            scale: float,
                            affine_grads: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _filled(x, _layer_norm_backward(dy, dh, x, mask, residual, mean, rstd, weight,
                                           bias_dtype, scale, affine_grads))


layer_norm_backward = torch.library.custom_op("fuser::layer_norm_backward",
                                              _layer_norm_backward_op, mutates_args=())


@layer_norm_backward.register_fake
def _(dy, dh, x, mask, residual, mean, rstd, weight, bias_dtype, scale, affine_grads):
    spec = _spec(False, x, dy.dtype, mask, residual, weight, bias_dtype)
    return _filled(x, _allocate(_backward_layout(spec, affine_grads), x, x.new_empty))


def _ln_setup(ctx, inputs, output) -> None:
    x, mask, residual, weight, bias, scale, _eps = inputs
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, mask, residual, weight, output[2], output[3])
    ctx.scale, ctx.bias_dtype = scale, None if bias is None else bias.dtype


def _ln_grads(ctx, dy, dh, _dmean, _drstd):
    x, mask, residual, weight, mean, rstd = ctx.saved_tensors
    dy = materialize(dy, x, x.dtype)
    dh = _new_residual_grad(dh, x, mask, residual)
    affine = (weight is not None and ctx.needs_input_grad[3]) or (
        ctx.bias_dtype is not None and ctx.needs_input_grad[4])
    backward = eager_backward(ctx, layer_norm_backward, _layer_norm_backward)
    gx, gres, gw, gb = backward(dy, dh, x, mask, residual, mean, rstd, weight, ctx.bias_dtype,
                                ctx.scale, affine)
    return (gx, None, gres if residual is not None else None,
            gw if affine and weight is not None else None,
            gb if affine and ctx.bias_dtype is not None else None, None, None)


layer_norm.register_autograd(_ln_grads, setup_context=_ln_setup)
forbid_double_backward(layer_norm_backward)
apply_layer_norm = dispatcher(layer_norm, _layer_norm, _ln_setup, _ln_grads)
