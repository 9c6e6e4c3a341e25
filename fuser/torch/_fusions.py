"""The fusions behind fuser.torch's ops, written with the public frontend.

Each builder is a function of a small frozen spec (the dtypes, and which optional inputs are
there), so every combination a model uses is built once per process and cached here; each
FusionDefinition caches its compiled kernels per input signature. Half and bfloat16 values
are computed in float32 and Double in double; each output is rounded once, where it is stored.
The scalars that vary between modules (eps, the dropout scale) are scalar inputs, not
constants, so that one kernel serves every module of a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from fuser.dtypes import DataType
from fuser.frontend import FusionDefinition
from fuser.torch import _record

_SHORT = {DataType.BFloat16: "bf16", DataType.Half: "f16", DataType.Float: "f32",
          DataType.Double: "f64"}


def compute_type(*dtypes: DataType | None) -> DataType:
    """Double where any operand is Double, else Float (half types compute in float)."""
    return DataType.Double if DataType.Double in dtypes else DataType.Float


def _matrix(fd: FusionDefinition, dtype: DataType):
    return fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)


def _vector(fd: FusionDefinition, dtype: DataType):
    return fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)


def _per_row(fd: FusionDefinition, dtype: DataType):
    return fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=dtype)


def _spread(fd: FusionDefinition, t, like):
    """A statistic reduced with keepdim ([N, 1] of rows, or [G, 1, H] along columns)
    broadcast to `like`'s shape."""
    return fd.ops.broadcast_in_dim(t, shape=like.shape(), broadcast_dims=list(range(like.ndim)))


def _row_mean(fd: FusionDefinition, t, like):
    return fd.ops.div(fd.ops.sum(t, dims=[1], keepdim=True), like.size(1))


@dataclass(frozen=True)
class NormSpec:
    """One norm fusion: RMSNorm (rms) or LayerNorm of h = residual + mask * x * scale (the
    residual and the dropout mask optional), with an optional weight and bias.

    `hf` is Hugging Face LlamaRMSNorm's rounding: the normalized value is rounded to x's dtype
    before the weight multiplies it. `unit_offset`: the weight is stored as an offset from
    one, and y is scaled by 1 + weight (Gemma's RMSNorm, zero-initialized); the weight's
    gradient is the same sum. `out` is y's dtype."""

    rms: bool
    x: DataType
    out: DataType
    weight: DataType | None = None
    bias: DataType | None = None
    residual: DataType | None = None
    dropout: bool = False
    hf: bool = False
    unit_offset: bool = False

    @property
    def adds(self) -> bool:
        """Whether h differs from x, so the new residual h is an output of its own."""
        return self.residual is not None or self.dropout

    @property
    def h(self) -> DataType:
        """The new residual's dtype: the residual's where there is one."""
        return self.residual or self.x

    @property
    def compute(self) -> DataType:
        return compute_type(self.x, self.out, self.weight, self.bias, self.residual)

    def name(self, suffix: str) -> str:
        kind = "rms_norm" if self.rms else "layer_norm"
        prefix = (("dropout_" if self.dropout else "") + ("add_" if self.residual else "")
                  + ("unit_offset_" if self.unit_offset else ""))
        return f"{prefix}{kind}_{suffix}_{_SHORT[self.x]}"


def _sum_inputs(fd: FusionDefinition, spec: NormSpec):
    """Inputs x, [mask, scale], [residual], in that order; returns x, h in the compute type,
    and the dropout factor mask * scale (None without dropout)."""
    c = spec.compute
    x = _matrix(fd, spec.x)
    h = fd.ops.cast(x, c)
    keep = None
    if spec.dropout:
        mask = _matrix(fd, DataType.Bool)
        keep = fd.ops.mul(fd.ops.cast(mask, c), fd.define_scalar(dtype=c))
        h = fd.ops.mul(h, keep)
    if spec.residual is not None:
        h = fd.ops.add(fd.ops.cast(_matrix(fd, spec.residual), c), h)
    return x, h, keep


def _weight(fd: FusionDefinition, spec: NormSpec):
    """Input [weight], in the compute type: the factor y is scaled by (1 + weight where
    spec.unit_offset)."""
    if spec.weight is None:
        return None
    w = fd.ops.cast(_vector(fd, spec.weight), spec.compute)
    return fd.ops.add(w, fd.define_scalar(1.0, dtype=spec.compute)) if spec.unit_offset else w


def _affine(fd: FusionDefinition, spec: NormSpec):
    """Inputs [weight], [bias], in the compute type (the weight as _weight gives it)."""
    w = _weight(fd, spec)
    b = fd.ops.cast(_vector(fd, spec.bias), spec.compute) if spec.bias is not None else None
    return w, b


@cache
def norm_forward(spec: NormSpec) -> FusionDefinition:
    """Inputs: x [N, H], [mask [N, H] bool, scale], [residual [N, H]], [weight [H]],
    [bias [H]], eps. Outputs: y [N, H]; h [N, H] where spec.adds; mean [N, 1] for LayerNorm;
    rstd [N, 1] (in the compute type)."""
    c = spec.compute
    with FusionDefinition(spec.name("fwd")) as fd:
        x, h, _ = _sum_inputs(fd, spec)
        w, b = _affine(fd, spec)
        eps = fd.define_scalar(dtype=c)
        if spec.rms:
            mean = None
            rstd = fd.ops.rsqrt(fd.ops.add(_row_mean(fd, fd.ops.mul(h, h), x), eps))
            hhat = fd.ops.mul(h, _spread(fd, rstd, x))
        else:
            var, mean = fd.ops.var_mean(h, dims=[1], correction=0, keepdim=True)
            rstd = fd.ops.rsqrt(fd.ops.add(var, eps))
            hhat = fd.ops.mul(fd.ops.sub(h, _spread(fd, mean, x)), _spread(fd, rstd, x))
        if spec.hf:
            hhat = fd.ops.cast(fd.ops.cast(hhat, spec.x), c)
        y = hhat if w is None else fd.ops.mul(hhat, w)
        y = y if b is None else fd.ops.add(y, b)
        fd.add_output(fd.ops.cast(y, spec.out))
        if spec.adds:
            fd.add_output(fd.ops.cast(h, spec.h))
        if mean is not None:
            fd.add_output(mean)
        fd.add_output(rstd)
    return fd


@cache
def norm_backward(spec: NormSpec, affine_grads: bool) -> FusionDefinition:
    """Inputs: x, [mask, scale], [residual], [mean] (LayerNorm), rstd, dy [N, H] (y's gradient,
    of dtype spec.out), [weight],
    [dh [N, H], the new residual's gradient, where spec.adds]. Outputs: grad_x; grad_residual
    where there is a residual; then, where affine_grads, grad_weight and grad_bias [H] (the
    column sums that make this the one-pass inner-outer kernel)."""
    c = spec.compute
    with FusionDefinition(spec.name("bwd")) as fd:
        x, h, keep = _sum_inputs(fd, spec)
        mean = None if spec.rms else _per_row(fd, c)
        rstd = _spread(fd, _per_row(fd, c), x)
        dy = fd.ops.cast(_matrix(fd, spec.out), c)
        w = _weight(fd, spec)
        centered = h if mean is None else fd.ops.sub(h, _spread(fd, mean, x))
        hhat = fd.ops.mul(centered, rstd)
        wdy = dy if w is None else fd.ops.mul(dy, w)
        projection = _spread(fd, _row_mean(fd, fd.ops.mul(wdy, hhat), x), x)
        inner = fd.ops.sub(wdy, fd.ops.mul(hhat, projection))
        if mean is not None:
            inner = fd.ops.sub(inner, _spread(fd, _row_mean(fd, wdy, x), x))
        grad_h = fd.ops.mul(inner, rstd)
        if spec.adds:
            grad_h = fd.ops.add(grad_h, fd.ops.cast(_matrix(fd, spec.h), c))
        grad_x = grad_h if keep is None else fd.ops.mul(grad_h, keep)
        fd.add_output(fd.ops.cast(grad_x, spec.x))
        if spec.residual is not None:
            fd.add_output(fd.ops.cast(grad_h, spec.residual))
        if affine_grads and spec.weight is not None:
            fd.add_output(fd.ops.cast(fd.ops.sum(fd.ops.mul(dy, hhat), dims=[0]), spec.weight))
        if affine_grads and spec.bias is not None:
            fd.add_output(fd.ops.cast(fd.ops.sum(dy, dims=[0]), spec.bias))
    return fd


def _operand(fd: FusionDefinition, dtype: DataType, columns: bool):
    """A softmax's or cross entropy's operand: [N, H] normalized along its rows (along H),
    or, for `columns`, [G, N, H] normalized along N in each of G groups (torch's dim with the
    dims before it flattened into G and those after it into H), which fuser runs as one
    outer kernel with a grid row of clusters per group, reading x where it lies."""
    if not columns:
        return _matrix(fd, dtype)
    return fd.define_tensor(shape=[-1] * 3, contiguity=[True] * 3, dtype=dtype)


def _statistic(fd: FusionDefinition, dtype: DataType, columns: bool):
    """A value per normalized vector of an _operand: [N, 1], or [G, 1, H] for `columns`."""
    if not columns:
        return _per_row(fd, dtype)
    return fd.define_tensor(shape=[-1, 1, -1], contiguity=[True, None, True], dtype=dtype)


def _entropy_name(kind: str, dtype: DataType, row_sums: bool, columns: bool,
                  weighted: bool = False) -> str:
    return (f"{kind}{'_rowsum' if row_sums else ''}{'_weighted' if weighted else ''}"
            f"{'_columns' if columns else ''}_{_SHORT[dtype]}")


def _per_class(fd: FusionDefinition, w, like):
    """Class weights w [C] broadcast along `like`'s classes (dim 1)."""
    return fd.ops.broadcast_in_dim(w, shape=like.shape(), broadcast_dims=[1])


def _class_sums(fd: FusionDefinition, xf, x, w):
    """sum(xf) along the classes, kept; with class weights w, sum(xf * w): label smoothing's
    term of the loss."""
    return fd.ops.sum(xf if w is None else fd.ops.mul(xf, _per_class(fd, w, x)), dims=[1],
                      keepdim=True)


def _softmax_name(kind: str, dtype: DataType, log: bool, columns: bool) -> str:
    return f"{'log_' if log else ''}softmax{'_columns' if columns else ''}_{kind}_{_SHORT[dtype]}"


@cache
def softmax_forward(dtype: DataType, log: bool = False, columns: bool = False) -> FusionDefinition:
    """softmax of x along its normalized axis (_operand), max-subtracted, in x's dtype; for
    `log`, log_softmax: (x - max) - log(sum(exp(x - max))), as torch computes it."""
    c = compute_type(dtype)
    with FusionDefinition(_softmax_name("fwd", dtype, log, columns)) as fd:
        x = _operand(fd, dtype, columns)
        xf = fd.ops.cast(x, c)
        shifted = fd.ops.sub(xf, _spread(fd, fd.ops.max(xf, dims=[1], keepdim=True), x))
        e = fd.ops.exp(shifted)
        s = fd.ops.sum(e, dims=[1], keepdim=True)
        y = (fd.ops.sub(shifted, _spread(fd, fd.ops.log(s), x)) if log
             else fd.ops.div(e, _spread(fd, s, x)))
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


@cache
def softmax_backward(y_dtype: DataType, dy_dtype: DataType, log: bool = False,
                     columns: bool = False) -> FusionDefinition:
    """y (softmax's output), dy -> grad_x = y * (dy - sum(dy * y)), or for `log` (y is
    log_softmax's output) grad_x = dy - exp(y) * sum(dy), sums along the normalized axis, in
    y's dtype."""
    c = compute_type(y_dtype, dy_dtype)
    with FusionDefinition(_softmax_name("bwd", y_dtype, log, columns)) as fd:
        y = _operand(fd, y_dtype, columns)
        yf = fd.ops.cast(y, c)
        dy = fd.ops.cast(_operand(fd, dy_dtype, columns), c)
        if log:
            total = fd.ops.sum(dy, dims=[1], keepdim=True)
            dx = fd.ops.sub(dy, fd.ops.mul(fd.ops.exp(yf), _spread(fd, total, y)))
        else:
            dot = fd.ops.sum(fd.ops.mul(dy, yf), dims=[1], keepdim=True)
            dx = fd.ops.mul(yf, fd.ops.sub(dy, _spread(fd, dot, y)))
        fd.add_output(fd.ops.cast(dx, y_dtype))
    return fd


def _log_sum_exp(fd: FusionDefinition, xf, x):
    """max + log(sum(exp(xf - max))) along dim 1 of xf (x [N, C] or [G, C, H], _operand),
    kept ([N, 1] or [G, 1, H]), in the compute type."""
    m = fd.ops.max(xf, dims=[1], keepdim=True)
    e = fd.ops.exp(fd.ops.sub(xf, _spread(fd, m, x)))
    return fd.ops.add(fd.ops.log(fd.ops.sum(e, dims=[1], keepdim=True)), m)


def _entropy_gradient(fd: FusionDefinition, xf, x, lse, scale, shift, dtype: DataType,
                      w=None):
    """scale * (exp(xf - lse) - shift) in x's shape and `dtype`, shift a scalar: cross
    entropy's gradient but for its one-hot term; with class weights w [C] (beside label
    smoothing), scale * exp(xf - lse) - shift * w, shift a statistic."""
    p = fd.ops.exp(fd.ops.sub(xf, _spread(fd, lse, x)))
    if w is None:
        grad = fd.ops.mul(fd.ops.sub(p, shift), _spread(fd, scale, x))
    else:
        grad = fd.ops.sub(fd.ops.mul(p, _spread(fd, scale, x)),
                          fd.ops.mul(_spread(fd, shift, x), _per_class(fd, w, x)))
    return fd.ops.cast(grad, dtype)


@cache
def logsumexp_forward(dtype: DataType, row_sums: bool, columns: bool = False,
                      weighted: bool = False) -> FusionDefinition:
    """x [N, C] -> lse [N, 1] = max + log(sum(exp(x - max))) in the compute type, and where
    `row_sums` sum(x) [N, 1] too (label smoothing's term): cross entropy's forward, which
    reads the logits once. For `columns`, x [G, C, H] (classes along dim 1, as torch's
    [N, C, d1, ...] logits) -> [G, 1, H] statistics. `weighted` (with `row_sums`): class
    weights w [C] in the compute type after x, and the sums are of x * w."""
    c = compute_type(dtype)
    name = _entropy_name("logsumexp", dtype, row_sums, columns, weighted)
    with FusionDefinition(name) as fd:
        x = _operand(fd, dtype, columns)
        w = _vector(fd, c) if weighted else None
        xf = fd.ops.cast(x, c)
        fd.add_output(_log_sum_exp(fd, xf, x))
        if row_sums:
            fd.add_output(_class_sums(fd, xf, x, w))
    return fd


@cache
def cross_entropy_forward_gradient(dtype: DataType, row_sums: bool, columns: bool = False,
                                   weighted: bool = False) -> FusionDefinition:
    """x [N, C], scale [N, 1], shift (a scalar) -> lse [N, 1] (and sum(x) [N, 1] where
    `row_sums`), as logsumexp_forward, and the gradient cross_entropy_backward writes, from
    the lse computed in the same kernel: the forward that writes the gradient too, reading
    the logits once for both. For `columns`, x [G, C, H] and [G, 1, H] statistics.
    `weighted` (with `row_sums`): shift a statistic and class weights w [C] after it, as
    cross_entropy_backward's."""
    c = compute_type(dtype)
    name = _entropy_name("cross_entropy_fwd_grad", dtype, row_sums, columns, weighted)
    with FusionDefinition(name) as fd:
        x = _operand(fd, dtype, columns)
        scale = _statistic(fd, c, columns)
        shift = _statistic(fd, c, columns) if weighted else fd.define_scalar(dtype=c)
        w = _vector(fd, c) if weighted else None
        xf = fd.ops.cast(x, c)
        lse = _log_sum_exp(fd, xf, x)
        fd.add_output(lse)
        if row_sums:
            fd.add_output(_class_sums(fd, xf, x, w))
        fd.add_output(_entropy_gradient(fd, xf, x, lse, scale, shift, dtype, w))
    return fd


@cache
def cross_entropy_backward(dtype: DataType, columns: bool = False, weighted: bool = False
                           ) -> FusionDefinition:
    """x [N, C], lse [N, 1], scale [N, 1] (the loss's gradient for each row, 0 for an
    ignored one), shift (label smoothing's share of each class, a scalar) -> grad_x =
    scale * (exp(x - lse) - shift) [N, C] in x's dtype: cross entropy's gradient but for its
    one-hot term, which the caller writes into the target's element after. For `columns`,
    x [G, C, H] and [G, 1, H] statistics. `weighted` (class weights beside label smoothing):
    shift [N, 1] a statistic and class weights w [C] after it, grad_x = scale * exp(x - lse)
    - shift * w."""
    c = compute_type(dtype)
    name = _entropy_name("cross_entropy_bwd", dtype, False, columns, weighted)
    with FusionDefinition(name) as fd:
        x = _operand(fd, dtype, columns)
        lse, scale = _statistic(fd, c, columns), _statistic(fd, c, columns)
        shift = _statistic(fd, c, columns) if weighted else fd.define_scalar(dtype=c)
        w = _vector(fd, c) if weighted else None
        fd.add_output(_entropy_gradient(fd, fd.ops.cast(x, c), x, lse, scale, shift, dtype, w))
    return fd


def run(fd: FusionDefinition, inputs: list) -> list:
    """Execute `fd` on torch tensors (outputs allocated by torch, launched on its current
    stream): the one place fuser.torch's ops call the executor, and where the recordings of
    fuser.torch.recorded() see each call."""
    if _record._open:
        _record.note(fd, inputs)
    return fd.execute(inputs)


def rescale(data, factor, record) -> None:
    """Scale the contiguous CUDA tensor `data` in place by `factor` (a tensor of one element
    of its dtype, on its device) unless that is one, on torch's current stream, and write
    whether it was not (0 or 1) into `record`, an int32 tensor in pinned host memory:
    fuser.rescale's kernel, the one place fuser.torch launches it."""
    from fuser import calls
    from fuser import rescale as kernels
    from fuser.torch._support import fuser_dtype

    device = data.device.index
    calls.in_primary_context(device, True, lambda: kernels.launch(
        fuser_dtype(data.dtype), device, data.data_ptr(), factor.data_ptr(), record.data_ptr(),
        data.numel(), calls.stream_of(True, device)))
