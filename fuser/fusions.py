"""Ready fusion definitions, written with the public frontend like any user fusion.

Each builder takes the storage dtype of the big tensors and returns a FusionDefinition; its
docstring gives the inputs in order. `FUSIONS` maps the names the CLI, tests, demo and bench use
to the builders, and `make_inputs` draws valid random inputs for any of them.
"""

from __future__ import annotations

import numpy as np

from fuser.dtypes import DataType
from fuser.errors import BadInputError
from fuser.frontend import FusionDefinition

F32 = DataType.Float


def _row(fd: FusionDefinition, t, like):
    """Broadcast a per-row [N] or [N, 1] tensor to the shape of `like`."""
    return fd.ops.broadcast_in_dim(t, shape=like.shape(), broadcast_dims=[0, 1][: t.ndim])


def _dropout_add(fd: FusionDefinition, in1, in2, mask, scale):
    """input2 + mask * input1 * scale in float: dropout of input1 added to the residual."""
    return fd.ops.add(fd.ops.cast(in2, F32),
                      fd.ops.mul(fd.ops.mul(fd.ops.cast(mask, F32), fd.ops.cast(in1, F32)),
                                 scale))


def _standardized(fd: FusionDefinition, xf, w, b, eps: float, like, over_rows: bool = False):
    """(y, mean, rstd) of y = (xf - mean) * rstd * w + b with the biased variance: the
    statistics along each row ([N, 1], LayerNorm), or over the rows per column ([H],
    BatchNorm, broadcast down the columns as numpy aligns them)."""
    if over_rows:
        var, mean = fd.ops.var_mean(xf, dims=[0], correction=0, keepdim=False)
    else:
        var, mean = fd.ops.var_mean(xf, dims=[1], correction=0, keepdim=True)

    def spread(t):
        return t if over_rows else _row(fd, t, like)

    rstd = fd.ops.rsqrt(fd.ops.add(var, fd.define_scalar(eps)))
    xhat = fd.ops.mul(fd.ops.sub(xf, spread(mean)), spread(rstd))
    y = fd.ops.add(fd.ops.mul(xhat, fd.ops.cast(w, F32)), fd.ops.cast(b, F32))
    return y, mean, rstd


def rmsnorm_fwd(dtype: DataType = DataType.BFloat16, eps: float = 1e-6) -> FusionDefinition:
    """x [N, H], weight [H] -> y = x * rsqrt(mean(x^2) + eps) * weight, rstd [N, 1] fp32."""
    with FusionDefinition("rmsnorm_fwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), dims=[1], keepdim=True), x.size(1))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, fd.define_scalar(eps)))
        y = fd.ops.mul(fd.ops.mul(xf, _row(fd, rstd, x)), fd.ops.cast(w, F32))
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(rstd)
    return fd


def layernorm_fwd(dtype: DataType = DataType.BFloat16, eps: float = 1e-5) -> FusionDefinition:
    """x [N, H], weight [H], bias [H] -> y, mean [N, 1] fp32, rstd [N, 1] fp32."""
    with FusionDefinition("layernorm_fwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        y, mean, rstd = _standardized(fd, fd.ops.cast(x, F32), w, b, eps, x)
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(mean)
        fd.add_output(rstd)
    return fd


def softmax_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H] -> softmax over the hidden dimension (max-subtracted)."""
    with FusionDefinition("softmax_fwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        m = fd.ops.max(xf, dims=[1], keepdim=True)
        e = fd.ops.exp(fd.ops.sub(xf, _row(fd, m, x)))
        s = fd.ops.sum(e, dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.div(e, _row(fd, s, x)), dtype))
    return fd


def log_softmax_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H] -> log_softmax over the hidden dimension: (x - max) - log(sum(exp(x - max)))."""
    with FusionDefinition("log_softmax_fwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        shifted = fd.ops.sub(xf, _row(fd, fd.ops.max(xf, dims=[1], keepdim=True), x))
        lse = fd.ops.log(fd.ops.sum(fd.ops.exp(shifted), dims=[1], keepdim=True))
        fd.add_output(fd.ops.cast(fd.ops.sub(shifted, _row(fd, lse, x)), dtype))
    return fd


def dropout_rmsnorm_fwd(dtype: DataType = DataType.BFloat16, p: float = 0.1,
                        eps: float = 1e-6) -> FusionDefinition:
    """input1, input2 [N, H], dropout_mask [N, H] bool, weight [H] -> y [N, H], the residual
    sum x = input2 + mask * input1 / (1 - p) [N, H], rms [N, 1] fp32 (= sqrt(mean(x^2) + eps)):
    the forward whose saved inputs dropout_rmsnorm_bwd takes."""
    with FusionDefinition("dropout_rmsnorm_fwd") as fd:
        in1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        in2 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        mask = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        x = _dropout_add(fd, in1, in2, mask, fd.define_scalar(1.0 / (1.0 - p)))
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(x, x), dims=[1], keepdim=True), x.size(1))
        rms = fd.ops.sqrt(fd.ops.add(ms, fd.define_scalar(eps)))
        y = fd.ops.mul(fd.ops.div(x, _row(fd, rms, in1)), fd.ops.cast(w, F32))
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(fd.ops.cast(x, dtype))
        fd.add_output(rms)
    return fd


def softmax_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """y [N, H] (softmax's output), grad_out [N, H] -> grad_x = y * (grad_out - sum(grad_out *
    y)) [N, H]."""
    with FusionDefinition("softmax_bwd") as fd:
        y = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        yf, dyf = fd.ops.cast(y, F32), fd.ops.cast(dy, F32)
        dot = fd.ops.sum(fd.ops.mul(dyf, yf), dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.mul(yf, fd.ops.sub(dyf, _row(fd, dot, y))), dtype))
    return fd


def rmsnorm_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H], rms [N, 1] fp32 (= sqrt(mean(x^2) + eps)), grad_out [N, H], weight [H]
    -> grad_x [N, H], grad_weight [H]."""
    with FusionDefinition("rmsnorm_bwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        rms = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=F32)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        grad_x, grad_w = _rms_backward(fd, fd.ops.cast(x, F32), rms, dy, w, x)
        fd.add_output(fd.ops.cast(grad_x, dtype))
        fd.add_output(fd.ops.cast(grad_w, dtype))
    return fd


def dropout_rmsnorm_bwd(dtype: DataType = DataType.BFloat16, p: float = 0.1) -> FusionDefinition:
    """input1, input2 [N, H], dropout_mask [N, H] bool, rms [N, 1] fp32, grad_out [N, H],
    weight [H] -> grad_input1, grad_input2 [N, H], grad_weight [H]; x = input2 + mask *
    input1 / (1 - p), as in nvFuser's benchmark."""
    with FusionDefinition("dropout_rmsnorm_bwd") as fd:
        in1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        in2 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        mask = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
        rms = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=F32)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        scale = fd.define_scalar(1.0 / (1.0 - p))
        maskf = fd.ops.cast(mask, F32)
        x = fd.ops.add(
            fd.ops.cast(in2, F32), fd.ops.mul(fd.ops.mul(maskf, fd.ops.cast(in1, F32)), scale)
        )
        grad_x, grad_w = _rms_backward(fd, x, rms, dy, w, in1)
        fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.mul(grad_x, maskf), scale), dtype))
        fd.add_output(fd.ops.cast(grad_x, dtype))
        fd.add_output(fd.ops.cast(grad_w, dtype))
    return fd


def _rms_backward(fd, x, rms, dy, w, like):
    """d/dx of x / rms * w: (w*dy - x * mean(w*dy*x) / rms^2) / rms, and dW = sum(dy * x/rms)."""
    inv = fd.ops.reciprocal(_row(fd, rms, like))
    wdy = fd.ops.mul(fd.ops.cast(dy, F32), fd.ops.cast(w, F32))
    xhat = fd.ops.mul(x, inv)
    mean_wdy_xhat = fd.ops.div(
        fd.ops.sum(fd.ops.mul(wdy, xhat), dims=[1], keepdim=True), like.size(1)
    )
    grad_x = fd.ops.mul(fd.ops.sub(wdy, fd.ops.mul(xhat, _row(fd, mean_wdy_xhat, like))), inv)
    grad_w = fd.ops.sum(fd.ops.mul(fd.ops.cast(dy, F32), xhat), dims=[0])
    return grad_x, grad_w


def layernorm_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H], mean [N, 1] fp32, rstd [N, 1] fp32, grad_out [N, H], weight [H]
    -> grad_x [N, H], grad_weight [H], grad_bias [H]."""
    with FusionDefinition("layernorm_bwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        mean = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=F32)
        rstd = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=F32)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        dyf = fd.ops.cast(dy, F32)
        xhat = fd.ops.mul(fd.ops.sub(fd.ops.cast(x, F32), _row(fd, mean, x)), _row(fd, rstd, x))
        wdy = fd.ops.mul(dyf, fd.ops.cast(w, F32))
        n = x.size(1)
        c1 = fd.ops.div(fd.ops.sum(fd.ops.mul(wdy, xhat), dims=[1], keepdim=True), n)
        c2 = fd.ops.div(fd.ops.sum(wdy, dims=[1], keepdim=True), n)
        inner = fd.ops.sub(fd.ops.sub(wdy, fd.ops.mul(xhat, _row(fd, c1, x))), _row(fd, c2, x))
        fd.add_output(fd.ops.cast(fd.ops.mul(inner, _row(fd, rstd, x)), dtype))
        fd.add_output(fd.ops.cast(fd.ops.sum(fd.ops.mul(dyf, xhat), dims=[0]), dtype))
        fd.add_output(fd.ops.cast(fd.ops.sum(dyf, dims=[0]), dtype))
    return fd


def dropout_layernorm_fwd(dtype: DataType = DataType.BFloat16, p: float = 0.1,
                          eps: float = 1e-5) -> FusionDefinition:
    """input1, input2 [N, H], dropout_mask [N, H] bool, weight [H], bias [H] -> y [N, H], the
    residual sum x = input2 + mask * input1 / (1 - p) [N, H], mean [N, 1] fp32, rstd [N, 1]
    fp32: dropout, residual add and LayerNorm in one pass, as a pre-norm block's forward."""
    with FusionDefinition("dropout_layernorm_fwd") as fd:
        in1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        in2 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        mask = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        x = _dropout_add(fd, in1, in2, mask, fd.define_scalar(1.0 / (1.0 - p)))
        y, mean, rstd = _standardized(fd, x, w, b, eps, in1)
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(fd.ops.cast(x, dtype))
        fd.add_output(mean)
        fd.add_output(rstd)
    return fd


# ----- activations: elementwise, and the bias gradient a column sum ----------------------------

SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
TANH_SCALE = 0.7978845608028654  # sqrt(2 / pi), the tanh approximation's
TANH_CUBIC = 0.044715


def _gelu(fd, x, approximate: str):
    """(gelu(x), gelu'(x)) in float, as torch.nn.functional.gelu with `approximate`: "none"
    is x * Phi(x) with the erf; "tanh" is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    ops, half, one = fd.ops, fd.define_scalar(0.5), fd.define_scalar(1.0)
    if approximate == "none":
        cdf = ops.mul(ops.add(ops.erf(ops.mul(x, fd.define_scalar(SQRT_HALF))), one), half)
        pdf = ops.mul(ops.exp(ops.mul(ops.mul(x, x), fd.define_scalar(-0.5))),
                      fd.define_scalar(INV_SQRT_2PI))
        return ops.mul(x, cdf), ops.add(cdf, ops.mul(x, pdf))
    x2 = ops.mul(x, x)
    inner = ops.mul(ops.mul(x, ops.add(one, ops.mul(x2, fd.define_scalar(TANH_CUBIC)))),
                    fd.define_scalar(TANH_SCALE))
    t = ops.tanh(inner)
    cdf = ops.mul(ops.add(one, t), half)
    d_inner = ops.mul(ops.add(one, ops.mul(x2, fd.define_scalar(3 * TANH_CUBIC))),
                      fd.define_scalar(TANH_SCALE))
    slope = ops.mul(ops.mul(ops.mul(x, half), ops.sub(one, ops.mul(t, t))), d_inner)
    return ops.mul(x, cdf), ops.add(cdf, slope)


def _bias_gelu_fwd(approximate: str, name: str, dtype: DataType) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        y, _ = _gelu(fd, fd.ops.add(fd.ops.cast(x, F32), fd.ops.cast(b, F32)), approximate)
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


def _bias_gelu_bwd(approximate: str, name: str, dtype: DataType) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        _, slope = _gelu(fd, fd.ops.add(fd.ops.cast(x, F32), fd.ops.cast(b, F32)), approximate)
        dx = fd.ops.mul(fd.ops.cast(dy, F32), slope)
        fd.add_output(fd.ops.cast(dx, dtype))
        fd.add_output(fd.ops.cast(fd.ops.sum(dx, dims=[0]), dtype))
    return fd


def gelu_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H], bias [H] -> y = gelu(x + bias) [N, H], exact (erf) GELU: a bias-GELU."""
    return _bias_gelu_fwd("none", "gelu_fwd", dtype)


def gelu_tanh_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H], bias [H] -> y = gelu(x + bias, approximate="tanh") [N, H]."""
    return _bias_gelu_fwd("tanh", "gelu_tanh_fwd", dtype)


def gelu_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, H], bias [H], grad_out [N, H] -> grad_x = grad_out * gelu'(x + bias) [N, H],
    grad_bias = its sum over the rows [H]; exact (erf) GELU."""
    return _bias_gelu_bwd("none", "gelu_bwd", dtype)


def gelu_tanh_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """gelu_bwd of the tanh approximation."""
    return _bias_gelu_bwd("tanh", "gelu_tanh_bwd", dtype)


def _gated(fd, a, approximate: str | None):
    """(act(a), act'(a)) in float: SiLU where `approximate` is None, else GELU."""
    if approximate is not None:
        return _gelu(fd, a, approximate)
    sig = fd.ops.sigmoid(a)
    one = fd.define_scalar(1.0)
    return fd.ops.mul(a, sig), fd.ops.mul(sig, fd.ops.add(one, fd.ops.mul(a, fd.ops.sub(one,
                                                                                     sig))))


def _glu_fwd(approximate: str | None, name: str, dtype: DataType) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        a = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        b = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        act, _ = _gated(fd, fd.ops.cast(a, F32), approximate)
        fd.add_output(fd.ops.cast(fd.ops.mul(act, fd.ops.cast(b, F32)), dtype))
    return fd


def _glu_bwd(approximate: str | None, name: str, dtype: DataType) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        a = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        b = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        act, slope = _gated(fd, fd.ops.cast(a, F32), approximate)
        dyf = fd.ops.cast(dy, F32)
        fd.add_output(fd.ops.cast(fd.ops.mul(fd.ops.mul(dyf, fd.ops.cast(b, F32)), slope),
                                  dtype))
        fd.add_output(fd.ops.cast(fd.ops.mul(dyf, act), dtype))
    return fd


def swiglu_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """a [N, H] (gate), b [N, H] (up) -> silu(a) * b [N, H]."""
    return _glu_fwd(None, "swiglu_fwd", dtype)


def swiglu_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """a [N, H], b [N, H], grad_out [N, H] -> grad_a = grad_out * b * silu'(a), grad_b =
    grad_out * silu(a)."""
    return _glu_bwd(None, "swiglu_bwd", dtype)


def geglu_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """a [N, H] (gate), b [N, H] (up) -> gelu(a, approximate="tanh") * b [N, H]."""
    return _glu_fwd("tanh", "geglu_fwd", dtype)


def geglu_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """a [N, H], b [N, H], grad_out [N, H] -> grad_a, grad_b of geglu_fwd."""
    return _glu_bwd("tanh", "geglu_bwd", dtype)


# ----- normalization over the rows, per column: one outer-persistent kernel (segments where the
# columns are too tall for it) ----------------------------------------------------------------


def batchnorm_fwd(dtype: DataType = DataType.BFloat16, eps: float = 1e-5) -> FusionDefinition:
    """x [N, C], weight [C], bias [C] -> y [N, C], mean [C] fp32, rstd [C] fp32: BatchNorm in
    training (biased variance), the statistics torch's native_batch_norm saves. Channels-last
    [N, H, W, C] is this with N * H * W rows (or defined 4-D: var_mean over dims [0, 1, 2])."""
    with FusionDefinition("batchnorm_fwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        y, mean, rstd = _standardized(fd, fd.ops.cast(x, F32), w, b, eps, x, over_rows=True)
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(mean)
        fd.add_output(rstd)
    return fd


def softmax_dim0_fwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, C] -> softmax over the rows (dim 0), each column max-subtracted."""
    with FusionDefinition("softmax_dim0_fwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, dims=[0], keepdim=True)))
        fd.add_output(fd.ops.cast(fd.ops.div(e, fd.ops.sum(e, dims=[0], keepdim=True)), dtype))
    return fd


def batchnorm_bwd(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """x [N, C], mean [C] fp32, rstd [C] fp32, grad_out [N, C], weight [C] -> grad_x [N, C],
    grad_weight [C], grad_bias [C] of batchnorm_fwd."""
    with FusionDefinition("batchnorm_bwd") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        mean = fd.define_tensor(shape=[-1], contiguity=[True], dtype=F32)
        rstd = fd.define_tensor(shape=[-1], contiguity=[True], dtype=F32)
        dy = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        dyf = fd.ops.cast(dy, F32)
        xhat = fd.ops.mul(fd.ops.sub(fd.ops.cast(x, F32), mean), rstd)
        db = fd.ops.sum(dyf, dims=[0])
        dw = fd.ops.sum(fd.ops.mul(dyf, xhat), dims=[0])
        n = x.size(0)
        centered = fd.ops.sub(fd.ops.sub(dyf, fd.ops.div(db, n)),
                              fd.ops.mul(xhat, fd.ops.div(dw, n)))
        dx = fd.ops.mul(fd.ops.mul(fd.ops.cast(w, F32), rstd), centered)
        fd.add_output(fd.ops.cast(dx, dtype))
        fd.add_output(fd.ops.cast(dw, dtype))
        fd.add_output(fd.ops.cast(db, dtype))
    return fd


# Normalizations along the rows: one kernel each, the row schedulers' own tests run over them.
ROW_FUSIONS = {
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
}
# Elementwise activations (one pointwise kernel), and their bias gradients (a column sum).
ACTIVATIONS = {
    "gelu_fwd": gelu_fwd,
    "gelu_tanh_fwd": gelu_tanh_fwd,
    "gelu_bwd": gelu_bwd,
    "gelu_tanh_bwd": gelu_tanh_bwd,
    "swiglu_fwd": swiglu_fwd,
    "swiglu_bwd": swiglu_bwd,
    "geglu_fwd": geglu_fwd,
    "geglu_bwd": geglu_bwd,
}
# Normalizations over the rows, per column: one outer-persistent kernel each.
COLUMN_FUSIONS = {
    "batchnorm_fwd": batchnorm_fwd,
    "batchnorm_bwd": batchnorm_bwd,
    "softmax_dim0_fwd": softmax_dim0_fwd,
}
FUSIONS = {**ROW_FUSIONS, **ACTIVATIONS, **COLUMN_FUSIONS}  # every ready fusion, by name


def make_inputs(name: str, rows: int, hidden: int, dtype: DataType, rng: np.random.Generator,
                p: float = 0.1) -> list[np.ndarray]:
    """Random inputs of fusion `name` (host arrays, in definition order), statistics consistent
    with the data (rms, mean and rstd computed from x, so backward inputs are realistic)."""
    storage = dtype.numpy

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    x = randn(rows, hidden)
    w = (1.0 + 0.1 * randn(hidden)).astype(storage)
    bias = (0.1 * randn(hidden)).astype(storage)
    if name in ("rmsnorm_fwd", "softmax_fwd", "log_softmax_fwd", "softmax_dim0_fwd"):
        return [x.astype(storage), w] if name == "rmsnorm_fwd" else [x.astype(storage)]
    if name in ("layernorm_fwd", "batchnorm_fwd"):
        return [x.astype(storage), w, bias]
    if name in ("dropout_rmsnorm_fwd", "dropout_layernorm_fwd"):
        mask = rng.random((rows, hidden)) >= p
        extra = [bias] if name == "dropout_layernorm_fwd" else []
        return [x.astype(storage), randn(rows, hidden).astype(storage), mask, w, *extra]
    if name in ("gelu_fwd", "gelu_tanh_fwd"):
        return [x.astype(storage), bias]
    if name in ("swiglu_fwd", "geglu_fwd"):
        return [x.astype(storage), randn(rows, hidden).astype(storage)]
    dy = randn(rows, hidden).astype(storage)
    if name in ("gelu_bwd", "gelu_tanh_bwd"):
        return [x.astype(storage), bias, dy]
    if name in ("swiglu_bwd", "geglu_bwd"):
        return [x.astype(storage), randn(rows, hidden).astype(storage), dy]
    if name == "batchnorm_bwd":
        xs = x.astype(storage)
        x64 = xs.astype(np.float64)
        mean = x64.mean(axis=0)
        rstd = 1.0 / np.sqrt(x64.var(axis=0) + 1e-5)
        return [xs, mean.astype(np.float32), rstd.astype(np.float32), dy, w]
    if name == "rmsnorm_bwd":
        xs = x.astype(storage)
        rms = np.sqrt(np.mean(xs.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6)
        return [xs, rms.astype(np.float32), dy, w]
    if name == "dropout_rmsnorm_bwd":
        in1, in2 = x.astype(storage), randn(rows, hidden).astype(storage)
        mask = rng.random((rows, hidden)) >= p
        full = in2.astype(np.float64) + mask * in1.astype(np.float64) / (1 - p)
        rms = np.sqrt(np.mean(full**2, axis=1, keepdims=True) + 1e-6).astype(np.float32)
        return [in1, in2, mask, rms, dy, w]
    if name == "softmax_bwd":
        x64 = x.astype(storage).astype(np.float64)
        e = np.exp(x64 - x64.max(axis=1, keepdims=True))
        return [(e / e.sum(axis=1, keepdims=True)).astype(storage), dy]
    if name == "layernorm_bwd":
        xs = x.astype(storage)
        x64 = xs.astype(np.float64)
        mean = x64.mean(axis=1, keepdims=True)
        rstd = 1.0 / np.sqrt(x64.var(axis=1, keepdims=True) + 1e-5)
        return [xs, mean.astype(np.float32), rstd.astype(np.float32), dy, w]
    raise BadInputError(f"no fusion named {name!r}; pass one of: {', '.join(FUSIONS)}")
