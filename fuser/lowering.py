"""Lowering: the Fusion a scheduler sees, copied from the user's. Composite ops (var_mean,
var) become primitives, a reduction over every axis of a tensor becomes two (each row's,
then over the rows' results), one over axes of size 1 a cast that does not round, a
reduction over the rows of a value without the hidden axis that meets only such reductions
of values with it is computed on its operand spread along hidden (fuser.spread), and the
ops no output depends on are left out. The user's definition (and its repr) stays as
written. The copying helpers (define_like, copy_expr, equate_extents) serve every pass that
rewrites a fusion into another (segment.py, reorder.py, layouts.py)."""

from __future__ import annotations

from fuser.dtypes import DataType
from fuser.ir import Expr, Extent, Fusion, Scalar, Tensor, Val, as_tensor, copy_cast, upstream
from fuser.ops import REDUCTIONS
from fuser.spread import spread_reduction, spreads


def lower(fusion: Fusion) -> Fusion:
    """A copy of `fusion` with composite ops (var_mean, var) expanded into primitives and the
    ops no output depends on left out: a kernel would read, reduce and exchange for them all
    the same (the oracle skips them too). Their size equalities stay (equate_extents)."""
    out = Fusion()
    new: dict[Val, Val] = {}
    needed = upstream(fusion.outputs)
    spread = spreads(fusion, needed)
    kept = {id(e) for e in needed}
    for v in fusion.vals:
        e = v.definition
        if e is None:
            new[v] = define_like(out, v, v in fusion.inputs)
        elif v is e.outputs[0] and id(e) in kept:
            wide = spread_reduction(out, e, spread[id(e)], new) if id(e) in spread else None
            if wide is None:
                copy_expr(out, e, new)
            else:
                new[v] = wide
    for o in fusion.outputs:
        out.outputs.append(as_tensor(new[o]))
    equate_extents(new, "lower")
    return out


def left_out(fusion: Fusion) -> tuple[str, ...]:
    """The ops of `fusion` (as written) that no output depends on, which lower() leaves out,
    each as "T2 = var(T1)": explain() lists them under the definition."""
    needed = {id(e) for e in upstream(fusion.outputs)}
    return tuple(
        f"{', '.join(o.name for o in e.outputs)} = {e.op}({', '.join(i.name for i in e.inputs)})"
        for e in fusion.exprs if id(e) not in needed)


def equate_extents(new: dict[Val, Val], context: str, keep_apart: frozenset = frozenset()) -> None:
    """Make the sizes of the copies in `new` one where the originals' are: define_like gives a
    copied input fresh extents, and an equality that no copied op restores (segment inputs,
    equated by segment.py rather than by an op) would otherwise be lost, and with it the
    analysis' rows and hidden axis. Extents whose root is in `keep_apart` are left alone."""
    first: dict[Extent, Extent] = {}
    for old, v in new.items():
        if not isinstance(old, Tensor):
            continue
        for d, (before, after) in enumerate(zip(old.dims, as_tensor(v).dims, strict=True)):
            if before is None or after is None or before.find() in keep_apart:
                continue
            first.setdefault(before.find(), after).union(
                after, f"{context}: {old.name} dimension {d}")


def define_like(out: Fusion, v: Val, is_input: bool) -> Val:
    """A value of `out` standing for the undefined value `v` of another fusion: a tensor input
    of the same rank, sizes (1 where `v` broadcasts, constant where `v` has a constant
    extent), contiguity and dtype; a scalar input (`is_input`) or the same constant."""
    if isinstance(v, Tensor):
        sizes = [1 if e is None else (-1 if e.value is None else e.value) for e in v.dims]
        return out.define_tensor(sizes, list(v.contiguity), v.dtype)
    assert isinstance(v, Scalar), v
    return out.define_scalar(None if is_input else v.value, v.dtype)


def copy_expr(out: Fusion, e: Expr, new: dict[Val, Val]) -> None:
    """Define `e` again in `out` on the values `new` maps its inputs to, and map its outputs
    (var_mean and var are expanded into primitives here)."""
    args = [new[i] for i in e.inputs]
    a = dict(e.attrs)
    if e.op == "cast":
        results = [copy_cast(out, e, args[0])]
    elif e.op == "size":
        results = [out.size(args[0], a["dim"])]
    elif e.op == "squeeze":
        results = [out.squeeze(args[0], list(a["dims"]))]
    elif e.op == "permute":
        results = [out.permute(args[0], list(a["dims"]))]
    elif e.op in ("broadcast_in_dim", "expand"):
        broadcast = out.broadcast_in_dim if e.op == "broadcast_in_dim" else out.expand
        results = [broadcast(args[0], _shape_of(e, new), a["broadcast_dims"])]
    elif e.op == "reshape":
        results = [out.reshape(args[0], _shape_of(e, new))]
    elif e.op in REDUCTIONS:
        results = [reduction(out, e.op, as_tensor(args[0]), a["dims"], a["keepdim"],
                              e.outputs[0].dtype)]
    elif e.op == "mean":
        results = [_expand_mean(out, as_tensor(args[0]), a["dims"], a["keepdim"])]
    elif e.op in ("var_mean", "var"):
        results = _expand_var_mean(
            out, as_tensor(args[0]), a["dims"], a["correction"], a["keepdim"],
            with_mean=e.op == "var_mean",
        )
    else:
        results = [out.elementwise(e.op, args)]
    for old, nv in zip(e.outputs, results, strict=True):
        new[old] = nv


def _shape_of(e: Expr, new: dict[Val, Val]) -> list:
    """The `shape` of a broadcast_in_dim or reshape, its size scalars mapped through `new`."""
    by_name = {s.name: new[s] for s in e.inputs[1:]}
    return [by_name[s] if isinstance(s, str) else s for s in e.attr("shape")]


def reduction(f: Fusion, op: str, x: Tensor, dims, keepdim: bool, dtype: DataType) -> Tensor:
    """A reduction. One over every axis of a tensor of rank 2 or more (a full reduction) is
    two: along the last axis (each row's), then over the rows' results, which segmentation
    runs as a later kernel (it needs every row's result) over one row; a Half or BFloat16
    result's partials are Float, as a kernel holds them. One over axes of size 1 only is each
    element on its own (torch.sum(x, dim) of a [R, 1] x along 1): a cast to the result's
    type that does not round (a reduction's Half or BFloat16 result is a float in the
    kernel), squeezed unless keepdim."""
    if all(x.dims[d] is None for d in dims):
        kept = as_tensor(f.cast(x, dtype, rounds=False))
        return kept if keepdim else f.squeeze(kept, list(dims))
    if (x.ndim < 2 or sorted(dims) != list(range(x.ndim))
            or any(d is None for d in x.dims)):  # a size-1 axis: one row or one column
        return f.reduction(op, x, dims, keepdim, dtype)
    narrow = dtype in (DataType.Half, DataType.BFloat16)
    per_row = f.reduction(op, x, [x.ndim - 1], False, DataType.Float if narrow else dtype)
    total = reduction(f, op, per_row, list(range(x.ndim - 1)), False, dtype)
    return f.broadcast_in_dim(total, [1] * x.ndim, []) if keepdim else total


def _count(f: Fusion, x: Tensor, dims) -> Val:
    """The number of elements of `x` a reduction over `dims` combines: the product of their
    sizes, as scalars of the call."""
    count: Val | None = None
    for d in dims:
        size = f.size(x, d)
        count = size if count is None else f.elementwise("mul", [count, size])
    assert count is not None, dims
    return count


def _keepdim(f: Fusion, x: Tensor, dims, results: list) -> list:
    """Reductions of `x` over `dims` given back their reduced axes, as size 1 (keepdim)."""
    kept = [d for d in range(x.ndim) if d not in dims]
    shape = [1 if d in dims else f.size(x, d) for d in range(x.ndim)]
    return [f.broadcast_in_dim(r, shape, kept) for r in results]


def _mean(f: Fusion, x: Tensor, dims, count: Val) -> Val:
    """sum(x) / count over dims, in x's type (a Half or BFloat16 sum is a float in the
    kernel), without the reduced axes."""
    return f.elementwise("div", [reduction(f, "sum", x, dims, False, x.dtype), count])


def _expand_mean(f: Fusion, x: Tensor, dims, keepdim) -> Val:
    """torch.mean: sum(x)/n."""
    mean = _mean(f, x, dims, _count(f, x, dims))
    return _keepdim(f, x, dims, [mean])[0] if keepdim else mean


def _expand_var_mean(f: Fusion, x: Tensor, dims, correction, keepdim, with_mean: bool = True):
    """mean = sum(x)/n; var = sum((x - mean)^2)/max(n - correction, 0): two passes, exact; a
    correction at or past n gives inf (nan for a constant row), as torch.var_mean does.
    [var, mean], or [var] alone without `with_mean` (torch.var)."""
    count = _count(f, x, dims)
    kept = [d for d in range(x.ndim) if d not in dims]
    mean = _mean(f, x, dims, count)
    centered = f.elementwise("sub", [x, f.broadcast_in_dim(mean, x.shape(), kept)])
    sq = f.elementwise("mul", [centered, centered])
    denominator = f.elementwise("maximum", [
        f.elementwise("sub", [count, f.define_scalar(correction)]), f.define_scalar(0)])
    var = f.elementwise("div", [reduction(f, "sum", as_tensor(sq), dims, False, sq.dtype),
                                denominator])
    results = [var, mean] if with_mean else [var]
    return _keepdim(f, x, dims, results) if keepdim else results
