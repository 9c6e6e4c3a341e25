"""fuser.torch's modules: drop-ins for torch.nn.RMSNorm, LayerNorm, Softmax and LogSoftmax
(subclasses, so their constructors, parameters, state_dict keys and isinstance checks are
torch's own), the dropout + residual add + norm modules of pre-norm transformer blocks,
stand-ins for Hugging Face's LlamaRMSNorm and GemmaRMSNorm, and torch.nn.CrossEntropyLoss."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from fuser.torch import functional as F


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm, forward and backward on fuser's kernels."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm, forward and backward on fuser's kernels."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Softmax(torch.nn.Softmax):
    """torch.nn.Softmax over `dim` (the last by default), on fuser's kernels."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__(dim)

    def forward(self, x: Tensor) -> Tensor:
        return F.softmax(x, self.dim)


class LogSoftmax(torch.nn.LogSoftmax):
    """torch.nn.LogSoftmax over `dim` (the last by default), on fuser's kernels."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__(dim)

    def forward(self, x: Tensor) -> Tensor:
        return F.log_softmax(x, self.dim)


class HFRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm (and its look-alikes: Mistral, Qwen2, ...) on fuser's
    kernels: the same `weight` and `variance_epsilon`, the same numerics (fuser.torch.
    functional.hf_rms_norm). fuser.torch.patch puts it in their place."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.hf_rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GemmaRMSNorm(torch.nn.Module):
    """Hugging Face's GemmaRMSNorm (Gemma 1 to 3, and norms written like it) on fuser's
    kernels: a `weight` stored as an offset from one (zeros at initialization; y is scaled by
    1 + weight) and `eps`, the same numerics (fuser.torch.functional.gemma_rms_norm).
    fuser.torch.patch puts it in their place."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.gemma_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _affine(module: torch.nn.Module, shape: tuple, affine: bool, bias: bool | None,
            device, dtype) -> None:
    """A weight of ones and (where `bias`) a bias of zeros, or none, as torch's norms have."""
    kwargs = {"device": device, "dtype": dtype}
    weight = torch.nn.Parameter(torch.ones(shape, **kwargs)) if affine else None
    module.register_parameter("weight", weight)
    if bias is not None:
        keep = affine and bias
        module.register_parameter("bias", torch.nn.Parameter(torch.zeros(shape, **kwargs))
                                  if keep else None)


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


class DropoutAddRMSNorm(torch.nn.Module):
    """forward(x, residual=None) -> (rms_norm(h), h), h = residual + dropout(x, p): the
    pre-norm block's residual add and norm in one kernel (backward too: the dropout + RMSNorm
    backward fusion). Dropout only in training mode; its mask comes from torch's generator."""

    weight: torch.nn.Parameter | None

    def __init__(self, normalized_shape, p: float = 0.0, eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.p, self.eps, self.elementwise_affine = p, eps, elementwise_affine
        _affine(self, self.normalized_shape, elementwise_affine, None, device, dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return F.dropout_add_rms_norm(x, residual, self.normalized_shape, self.weight, self.p,
                                      self.eps, self.training)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, p={self.p}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class DropoutAddLayerNorm(torch.nn.Module):
    """DropoutAddRMSNorm with LayerNorm (weight and optional bias, as torch.nn.LayerNorm)."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None

    def __init__(self, normalized_shape, p: float = 0.0, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.p, self.eps, self.elementwise_affine = p, eps, elementwise_affine
        _affine(self, self.normalized_shape, elementwise_affine, bias, device, dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return F.dropout_add_layer_norm(x, residual, self.normalized_shape, self.weight,
                                        self.bias, self.p, self.eps, self.training)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, p={self.p}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss of logits and class indices on fuser's kernels
    (fuser.torch.functional.cross_entropy): its constructor and state."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                               self.label_smoothing)
