"""fuser.torch.patch(model): put fuser's modules in the place of a model's norms, in place.

Swapped: torch.nn.RMSNorm and torch.nn.LayerNorm (their exact classes: a subclass may
compute something else), and modules that look like Hugging Face's RMSNorm (a class name
ending in RMSNorm, a 1-D `weight`, a `variance_epsilon` or `eps`) and that compute, on a
probe input, what LlamaRMSNorm computes (HFRMSNorm takes their place) or what GemmaRMSNorm
computes, which scales by 1 + weight in float32 (GemmaRMSNorm takes it); a module of that
look that computes neither is left alone, with a warning. The new modules hold the old ones'
Parameter objects, so optimizers, tied weights and checkpoints see no change; hooks
registered on the old modules do not move (patch before DDP, FSDP or torch.compile wrap the
model).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from fuser.torch.modules import GemmaRMSNorm, HFRMSNorm, LayerNorm, RMSNorm

_PROBE_TOLERANCE = 2e-2  # relative and absolute: LlamaRMSNorm's own ops, rounded as it rounds


class Replacement(NamedTuple):
    """One module patch() swapped: its qualified name in the model, the old and the new."""

    name: str
    old: torch.nn.Module
    new: torch.nn.Module


def _from_torch_rms(old: torch.nn.RMSNorm) -> RMSNorm:
    new = RMSNorm(old.normalized_shape, old.eps, old.elementwise_affine, device="meta")
    new.weight = old.weight
    return new


def _from_torch_layer(old: torch.nn.LayerNorm) -> LayerNorm:
    new = LayerNorm(old.normalized_shape, old.eps, old.elementwise_affine,
                    bias=old.bias is not None, device="meta")
    new.weight, new.bias = old.weight, old.bias
    return new


def _hf_look(module: torch.nn.Module) -> tuple[torch.nn.Parameter, float] | None:
    """(weight, eps) of a module that looks like Hugging Face's RMSNorm, else None."""
    weight = getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(
            weight, torch.nn.Parameter) or weight.dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return (weight, float(eps)) if isinstance(eps, int | float) else None


def _probe(module: torch.nn.Module, weight: torch.nn.Parameter,
           eps: float) -> tuple[type[HFRMSNorm] | type[GemmaRMSNorm] | None, str]:
    """(the module class that computes what `module` computes on a probe input, "") where it
    is LlamaRMSNorm's or GemmaRMSNorm's output, else (None, why not)."""
    if weight.device.type == "meta":
        return None, "its weight is on the meta device (patch after the weights are loaded)"
    hidden = weight.shape[0]
    generator = torch.Generator().manual_seed(0)  # the model's random streams stay untouched
    x = torch.randn(3, hidden, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            got = module(x)
        except Exception as exc:  # a forward that needs other arguments is not LlamaRMSNorm's
            return None, f"calling it on a [3, {hidden}] input raised {exc!r}"
        xf = x.float()
        normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        wants = ((HFRMSNorm, weight * normalized.to(x.dtype)),
                 (GemmaRMSNorm, (normalized * (1.0 + weight.float())).to(x.dtype)))
        for cls, want in wants:
            if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
                    got.float(), want.float(), rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE):
                return cls, ""
    return None, ("it computes neither LlamaRMSNorm's weight * x / rms(x) nor GemmaRMSNorm's "
                  "(1 + weight) * x / rms(x)")


def _from_hf(name: str, old: torch.nn.Module) -> HFRMSNorm | GemmaRMSNorm | None:
    look = _hf_look(old)
    if look is None:
        return None
    weight, eps = look
    cls, why = _probe(old, weight, eps)
    if cls is None:
        warnings.warn(f"fuser.torch.patch left {name} ({type(old).__name__}) alone: {why}",
                      stacklevel=3)
        return None
    new = cls(weight.shape[0], eps, device="meta")
    new.weight = weight
    return new


def _replacement(name: str, old: torch.nn.Module) -> torch.nn.Module | None:
    if type(old) is torch.nn.RMSNorm:
        new: torch.nn.Module | None = _from_torch_rms(old)
    elif type(old) is torch.nn.LayerNorm:
        new = _from_torch_layer(old)
    else:
        new = _from_hf(name, old)
    if new is not None:
        new.train(old.training)
    return new


def patch(model: torch.nn.Module) -> list[Replacement]:
    """Swap the norms among `model`'s submodules for fuser's (see the module docstring), in
    place; returns what was swapped, in the order of model.named_modules(). A module
    registered under several names is swapped for one new module under all of them."""
    done: dict[int, torch.nn.Module | None] = {}
    replaced = []
    for name, old in list(model.named_modules(remove_duplicate=False)):
        if old is model:
            continue
        if id(old) not in done:
            done[id(old)] = _replacement(name, old)
        new = done[id(old)]
        if new is None:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        replaced.append(Replacement(name, old, new))
    return replaced
