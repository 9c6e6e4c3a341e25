"""PyTorch references of every fusion in fuser/fusions.py: the eager baseline, and, wrapped in
torch.compile, the compiled one.

Each function takes the fusion's inputs in definition order and returns a tuple of its outputs
in definition order, with the same dtypes and shapes (statistics [N, 1] fp32, column outputs [H] in
the storage dtype). The math is the fusions' own, in fp32, written with explicit formulas (no
autograd). Only tensor methods are used, so this module imports without torch and dynamo traces
it without module look-ups.
"""

from __future__ import annotations

RMS_EPS = 1e-6  # fusions.rmsnorm_fwd
LN_EPS = 1e-5  # fusions.layernorm_fwd
DROPOUT_P = 0.1  # fusions.dropout_rmsnorm_bwd


def rmsnorm_fwd(x, w):
    xf = x.float()
    rstd = (xf * xf).mean(1, keepdim=True).add(RMS_EPS).rsqrt()
    return (xf * rstd * w.float()).to(x.dtype), rstd


def layernorm_fwd(x, w, b):
    xf = x.float()
    mean = xf.mean(1, keepdim=True)
    var = xf.var(1, correction=0, keepdim=True)
    rstd = var.add(LN_EPS).rsqrt()
    y = (xf - mean) * rstd * w.float() + b.float()
    return y.to(x.dtype), mean, rstd


def softmax_fwd(x):
    return (x.float().softmax(1).to(x.dtype),)


def _rms_backward(x, rms, dy, w):
    """fp32 (grad_x, grad_weight) of y = x / rms * w, as fusions._rms_backward."""
    inv = rms.reciprocal()
    dyf = dy.float()
    wdy = dyf * w.float()
    xhat = x * inv
    mean_wdy_xhat = (wdy * xhat).mean(1, keepdim=True)
    grad_x = (wdy - xhat * mean_wdy_xhat) * inv
    grad_w = (dyf * xhat).sum(0)
    return grad_x, grad_w


def rmsnorm_bwd(x, rms, dy, w):
    grad_x, grad_w = _rms_backward(x.float(), rms, dy, w)
    return grad_x.to(x.dtype), grad_w.to(x.dtype)


def dropout_rmsnorm_bwd(in1, in2, mask, rms, dy, w):
    scale = 1.0 / (1.0 - DROPOUT_P)
    maskf = mask.float()
    x = in2.float() + maskf * in1.float() * scale
    grad_x, grad_w = _rms_backward(x, rms, dy, w)
    return (grad_x * maskf * scale).to(in1.dtype), grad_x.to(in1.dtype), grad_w.to(in1.dtype)


def layernorm_bwd(x, mean, rstd, dy, w):
    dyf = dy.float()
    xhat = (x.float() - mean) * rstd
    wdy = dyf * w.float()
    c1 = (wdy * xhat).mean(1, keepdim=True)
    c2 = wdy.mean(1, keepdim=True)
    grad_x = (wdy - xhat * c1 - c2) * rstd
    return grad_x.to(x.dtype), (dyf * xhat).sum(0).to(x.dtype), dyf.sum(0).to(x.dtype)


EAGER = {
    "rmsnorm_fwd": rmsnorm_fwd,
    "layernorm_fwd": layernorm_fwd,
    "softmax_fwd": softmax_fwd,
    "rmsnorm_bwd": rmsnorm_bwd,
    "dropout_rmsnorm_bwd": dropout_rmsnorm_bwd,
    "layernorm_bwd": layernorm_bwd,
}


def compiled(name: str):
    """torch.compile (default mode, static shapes) of the eager reference of `name`. Dynamo's
    caches are reset first, so every size compiles afresh instead of hitting the recompile
    limit (the on-disk Inductor/Triton caches still apply)."""
    import torch

    torch._dynamo.reset()
    return torch.compile(EAGER[name], dynamic=False)


def device_copy(nbytes: int, device="cuda"):
    """(fn, bytes moved): `dst.copy_(src)` of two uint8 buffers of nbytes // 2, so that read +
    write = the fusion's byte count (rounded down to even)."""
    import torch

    half = max(1, nbytes // 2)
    src = torch.randint(0, 256, (half,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * half
