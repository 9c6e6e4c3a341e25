"""The eager path of fuser.torch's ops: the same implementation and autograd formulas as the
torch.library custom ops, called through a torch.autograd.Function.

Why: a Python custom op's dispatch costs about 55 us a call and its autograd wrapper about 100
us more (measured on the H200 with torch 2.11: RMSNorm forward at [16384, 4096] took 34 us of
host time in fd.execute, 89 us as the op, 187 us as the op with autograd), several times the
kernel's own time for rows of a few thousand elements, where the GPU then waits for the host.
An autograd.Function adds a few microseconds, and autograd and CUDA graph capture take it as
they take the op. Under torch.compile the custom op stays: dynamo traces its fake
implementation and never sees the Function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode


def dispatcher(op, impl: Callable, setup: Callable, grads: Callable) -> Callable:
    """A function of the op's arguments: the custom op `op` where anything but autograd must
    see it (torch.compile, vmap, tracers: plain), or the first argument is not a plain
    tensor with data (fake, meta, a tensor subclass); else `impl` (the op's implementation),
    bare where autograd records nothing (_differentiated), or under an autograd.Function
    whose context `setup` fills and whose backward is `grads`, the op's own setup_context
    and autograd formula. `grads` finds `ctx.eager` set, so it may call the backward's
    implementation directly (eager_backward)."""

    def forward(ctx, *args):
        out = impl(*args)
        setup(ctx, args, out)
        ctx.eager = True
        return out

    def backward(ctx, *grad_outputs):
        return grads(ctx, *grad_outputs)

    # Named for the op (autograd's node becomes fuser_rms_normBackward, and so on).
    eager: Any = type(f"fuser{impl.__name__}", (torch.autograd.Function,),
                 {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def call(x, *args: Any):
        if plain(x):
            if _differentiated(x, args):
                return eager.apply(x, *args)
            return impl(x, *args)
        return op(x, *args)

    return call


def _differentiated(x, args: tuple) -> bool:
    """Whether autograd may record the call: forward-mode AD is on (a dual tensor does not
    require grad, and the Function refuses it by name where a bare call would drop its
    tangent), or grad mode is on and a tensor argument requires a gradient. Where neither
    holds (inference, torch.no_grad, frozen weights on a detached input) the implementation
    runs bare: autograd.Function.apply costs several microseconds of host time a call even
    where it records nothing."""
    if forward_ad._current_level >= 0:
        return True
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def plain(x) -> bool:
    """Whether nothing but autograd stands between the call and the kernels: a plain tensor
    with data, and nothing that must see the op (_watched)."""
    return type(x) is torch.Tensor and not x.is_meta and not _watched()


def _watched() -> bool:
    """Whether something must see the op itself: torch.compile, functorch transforms (vmap,
    grad), dispatch modes (make_fx and other tracers, FakeTensorMode, activation-checkpointing
    policies, FLOP counters) or torch.jit.trace."""
    return (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or _get_current_dispatch_mode() is not None or torch.jit.is_tracing())


def eager_backward(ctx, op, impl: Callable) -> Callable:
    """What a backward formula calls: the backward's implementation on the eager path, or the
    backward custom op where something must see it (_watched) and where the backward itself
    is differentiated (create_graph=True: the op's own autograd formula refuses double
    backward by name)."""
    if getattr(ctx, "eager", False) and not torch.is_grad_enabled() and not _watched():
        return impl
    return op
