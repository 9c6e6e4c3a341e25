"""PyTorch baselines of every fusion in fuser/fusions.py.

eager(name, inputs): what PyTorch itself runs for the fusion's step, the ATen ops behind the
functions users call: `F.rms_norm` (`_fused_rms_norm`), `F.layer_norm` (`native_layer_norm`),
`torch.softmax`, `torch.log_softmax`, and the backward ops autograd runs for them
(`_fused_rms_norm_backward`, `native_layer_norm_backward`, `native_dropout_backward`,
`_softmax_backward_data`). compiled(name): torch.compile of
FORMULAS, the fusions' own math written with explicit fp32 formulas (no autograd), which is
what Inductor would see of a user's forward and backward graph.

Every baseline takes the fusion's inputs in definition order and returns a tuple of its outputs
in definition order, with the same dtypes and shapes (statistics [N, 1] fp32, column outputs
[H] in the storage dtype). FORMULAS use only tensor methods, so they import without torch and
dynamo traces them without module look-ups.
"""

from __future__ import annotations

from fuser.fusions import INV_SQRT_2PI, SQRT_HALF, TANH_CUBIC, TANH_SCALE

RMS_EPS = 1e-6  # fusions.rmsnorm_fwd
LN_EPS = 1e-5  # fusions.layernorm_fwd and dropout_layernorm_fwd
BN_EPS = 1e-5  # fusions.batchnorm_fwd
DROPOUT_P = 0.1  # fusions.dropout_rmsnorm_fwd and _bwd, dropout_layernorm_fwd


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


def log_softmax_fwd(x):
    return (x.float().log_softmax(1).to(x.dtype),)


def softmax_dim0_fwd(x):
    return (x.float().softmax(0).to(x.dtype),)


def dropout_rmsnorm_fwd(in1, in2, mask, w):
    scale = 1.0 / (1.0 - DROPOUT_P)
    x = in2.float() + mask.float() * in1.float() * scale
    rms = (x * x).mean(1, keepdim=True).add(RMS_EPS).sqrt()
    return (x / rms * w.float()).to(in1.dtype), x.to(in1.dtype), rms


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


def softmax_bwd(y, dy):
    yf, dyf = y.float(), dy.float()
    return ((yf * (dyf - (dyf * yf).sum(1, keepdim=True))).to(y.dtype),)


def dropout_layernorm_fwd(in1, in2, mask, w, b):
    x = in2.float() + mask.float() * in1.float() * (1.0 / (1.0 - DROPOUT_P))
    mean = x.mean(1, keepdim=True)
    rstd = x.var(1, correction=0, keepdim=True).add(LN_EPS).rsqrt()
    return ((x - mean) * rstd * w.float() + b.float()).to(in1.dtype), x.to(in1.dtype), mean, rstd


def _gelu(x, approximate: str):
    """(gelu(x), gelu'(x)) of an fp32 x, as fusions._gelu."""
    if approximate == "none":
        cdf = ((x * SQRT_HALF).erf() + 1.0) * 0.5
        return x * cdf, cdf + x * (x * x * -0.5).exp() * INV_SQRT_2PI
    t = ((x + x * x * x * TANH_CUBIC) * TANH_SCALE).tanh()
    cdf = (t + 1.0) * 0.5
    slope = x * 0.5 * (t * t * -1.0 + 1.0) * (x * x * (3 * TANH_CUBIC) + 1.0) * TANH_SCALE
    return x * cdf, cdf + slope


def _bias_gelu_fwd(approximate: str):
    def bias_gelu(x, b):
        return (_gelu(x.float() + b.float(), approximate)[0].to(x.dtype),)

    return bias_gelu


def _bias_gelu_bwd(approximate: str):
    def bias_gelu_backward(x, b, dy):
        dx = dy.float() * _gelu(x.float() + b.float(), approximate)[1]
        return dx.to(x.dtype), dx.sum(0).to(x.dtype)

    return bias_gelu_backward


def _silu(a):
    sig = a.sigmoid()
    return a * sig, sig * (a * (sig * -1.0 + 1.0) + 1.0)


def _glu_fwd(activation):
    def glu(a, b):
        return ((activation(a.float())[0] * b.float()).to(a.dtype),)

    return glu


def _glu_bwd(activation):
    def glu_backward(a, b, dy):
        act, slope = activation(a.float())
        dyf = dy.float()
        return (dyf * b.float() * slope).to(a.dtype), (dyf * act).to(a.dtype)

    return glu_backward


def _gelu_tanh(x):
    return _gelu(x, "tanh")


def batchnorm_fwd(x, w, b):
    xf = x.float()
    mean = xf.mean(0)
    rstd = xf.var(0, correction=0).add(BN_EPS).rsqrt()
    return ((xf - mean) * rstd * w.float() + b.float()).to(x.dtype), mean, rstd


def batchnorm_bwd(x, mean, rstd, dy, w):
    dyf = dy.float()
    xhat = (x.float() - mean) * rstd
    n = x.shape[0]
    db, dw = dyf.sum(0), (dyf * xhat).sum(0)
    dx = w.float() * rstd * (dyf - db / n - xhat * (dw / n))
    return dx.to(x.dtype), dw.to(x.dtype), db.to(x.dtype)


FORMULAS = {
    "rmsnorm_fwd": rmsnorm_fwd,
    "layernorm_fwd": layernorm_fwd,
    "softmax_fwd": softmax_fwd,
    "log_softmax_fwd": log_softmax_fwd,
    "dropout_rmsnorm_fwd": dropout_rmsnorm_fwd,
    "dropout_layernorm_fwd": dropout_layernorm_fwd,
    "rmsnorm_bwd": rmsnorm_bwd,
    "dropout_rmsnorm_bwd": dropout_rmsnorm_bwd,
    "layernorm_bwd": layernorm_bwd,
    "softmax_bwd": softmax_bwd,
    "gelu_fwd": _bias_gelu_fwd("none"),
    "gelu_tanh_fwd": _bias_gelu_fwd("tanh"),
    "gelu_bwd": _bias_gelu_bwd("none"),
    "gelu_tanh_bwd": _bias_gelu_bwd("tanh"),
    "swiglu_fwd": _glu_fwd(_silu),
    "swiglu_bwd": _glu_bwd(_silu),
    "geglu_fwd": _glu_fwd(_gelu_tanh),
    "geglu_bwd": _glu_bwd(_gelu_tanh),
    "batchnorm_fwd": batchnorm_fwd,
    "batchnorm_bwd": batchnorm_bwd,
    "softmax_dim0_fwd": softmax_dim0_fwd,
}


def compiled(name: str):
    """torch.compile (default mode, static shapes) of FORMULAS[name]. Dynamo's
    caches are reset first, so every size compiles afresh instead of hitting the recompile
    limit (the on-disk Inductor/Triton caches still apply)."""
    import torch

    torch._dynamo.reset()
    return torch.compile(FORMULAS[name], dynamic=False)


def eager(name: str, inputs: list):
    """A function of no arguments that runs PyTorch's own ops for the fusion `name` on
    `inputs` and returns its outputs. What a trained model's forward or autograd's backward
    would have at hand is prepared once, outside it: rstd = 1 / rms, the bias that
    native_layer_norm_backward takes the shape of db from, and, for dropout + RMSNorm, the
    residual sum x that the forward saved (the fusion recomputes x from its three inputs;
    PyTorch reads the saved x instead, and passes grad_x on as the residual's gradient)."""
    import torch

    aten = torch.ops.aten
    if name == "rmsnorm_fwd":
        x, w = inputs
        return lambda: aten._fused_rms_norm(x, [x.shape[-1]], w, RMS_EPS)
    if name == "layernorm_fwd":
        x, w, b = inputs
        return lambda: aten.native_layer_norm(x, [x.shape[-1]], w, b, LN_EPS)
    if name == "softmax_fwd":
        (x,) = inputs
        return lambda: (torch.softmax(x, 1),)
    if name == "log_softmax_fwd":
        (x,) = inputs
        return lambda: (torch.log_softmax(x, 1),)
    if name == "softmax_dim0_fwd":
        (x,) = inputs
        return lambda: (torch.softmax(x, 0),)
    if name == "dropout_rmsnorm_fwd":
        in1, in2, mask, w = inputs
        scale = 1.0 / (1.0 - DROPOUT_P)

        def dropout_add_rms_norm():
            x = torch.add(in2, in1 * mask, alpha=scale)
            y, rstd = aten._fused_rms_norm(x, [x.shape[-1]], w, RMS_EPS)
            return y, x, rstd.reciprocal()

        return dropout_add_rms_norm
    if name == "dropout_layernorm_fwd":
        in1, in2, mask, w, b = inputs
        scale = 1.0 / (1.0 - DROPOUT_P)

        def dropout_add_layer_norm():
            x = torch.add(in2, in1 * mask, alpha=scale)
            y, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], w, b, LN_EPS)
            return y, x, mean, rstd

        return dropout_add_layer_norm
    if name in ("gelu_fwd", "gelu_tanh_fwd"):
        x, b = inputs
        approximate = "tanh" if "tanh" in name else "none"
        return lambda: (torch.nn.functional.gelu(x + b, approximate=approximate),)
    if name in ("gelu_bwd", "gelu_tanh_bwd"):
        x, b, dy = inputs
        approximate = "tanh" if "tanh" in name else "none"

        def bias_gelu_backward():
            dx = aten.gelu_backward(dy, x + b, approximate=approximate)
            return dx, dx.sum(0)

        return bias_gelu_backward
    if name in ("swiglu_fwd", "geglu_fwd"):
        a, b = inputs
        if name == "swiglu_fwd":
            return lambda: (torch.nn.functional.silu(a) * b,)
        return lambda: (torch.nn.functional.gelu(a, approximate="tanh") * b,)
    if name == "swiglu_bwd":
        a, b, dy = inputs
        return lambda: (aten.silu_backward(dy * b, a), dy * torch.nn.functional.silu(a))
    if name == "geglu_bwd":
        a, b, dy = inputs
        return lambda: (aten.gelu_backward(dy * b, a, approximate="tanh"),
                        dy * torch.nn.functional.gelu(a, approximate="tanh"))
    if name == "batchnorm_fwd":
        x, w, b = inputs
        return lambda: aten.native_batch_norm(x, w, b, None, None, True, 0.0, BN_EPS)
    if name == "batchnorm_bwd":
        x, mean, rstd, dy, w = inputs
        return lambda: aten.native_batch_norm_backward(dy, x, w, None, None, mean, rstd, True,
                                                       BN_EPS, [True, True, True])
    if name == "softmax_bwd":
        y, dy = inputs
        return lambda: (aten._softmax_backward_data(dy, y, 1, y.dtype),)
    if name == "rmsnorm_bwd":
        x, rms, dy, w = inputs
        rstd = rms.reciprocal()
        return lambda: aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, w, [True, True])
    if name == "dropout_rmsnorm_bwd":
        in1, in2, mask, rms, dy, w = inputs
        scale = 1.0 / (1.0 - DROPOUT_P)
        x, rstd = in2 + in1 * mask * scale, rms.reciprocal()

        def dropout_rmsnorm_backward():
            grad_x, grad_w = aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, w,
                                                           [True, True])
            return aten.native_dropout_backward(grad_x, mask, scale), grad_x, grad_w

        return dropout_rmsnorm_backward
    if name == "layernorm_bwd":
        x, mean, rstd, dy, w = inputs
        bias = torch.zeros_like(w)
        return lambda: aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, bias,
                                                       [True, True, True])
    raise KeyError(f"no eager baseline for fusion {name!r}; known: {', '.join(FORMULAS)}")


def device_copy(nbytes: int, device="cuda"):
    """(fn, bytes moved): `dst.copy_(src)` of two uint8 buffers of nbytes // 2, so that read +
    write = the fusion's byte count (rounded down to even)."""
    import torch

    half = max(1, nbytes // 2)
    src = torch.randint(0, 256, (half,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * half
