"""Lowering: the Fusion a scheduler sees, copied from the user's. Composite ops (var_mean,
var) become primitives, a reduction over every axis of a tensor becomes two (each row's,
then over the rows' results), one over axes of size 1 a cast that does not round, a
reduction of a value broadcast along an axis that meets only results spanning that axis is
computed along it too (_spread), and the ops no output depends on are left out. The user's
definition (and its repr) stays as written. The copying helpers (define_like, copy_expr,
equate_extents) serve every pass that rewrites a fusion into another (segment.py,
reorder.py, layouts.py)."""

from __future__ import annotations

from fuser.dtypes import DataType
from fuser.ir import Expr, Extent, Fusion, Scalar, Tensor, Val, as_tensor, copy_cast, upstream
from fuser.ops import REDUCTIONS


def lower(fusion: Fusion) -> Fusion:
    """A copy of `fusion` with composite ops (var_mean, var) expanded into primitives and the
    ops no output depends on left out: a kernel would read, reduce and exchange for them all
    the same (the oracle skips them too). Their size equalities stay (equate_extents)."""
    out = Fusion()
    new: dict[Val, Val] = {}
    needed = upstream(fusion.outputs)
    spread = _spread(fusion, needed)
    kept = {id(e) for e in needed}
    for v in fusion.vals:
        e = v.definition
        if e is None:
            new[v] = define_like(out, v, v in fusion.inputs)
        elif v is e.outputs[0] and id(e) in kept:
            operand = _spread_operand(out, e, spread.get(id(e), {}), new)
            if operand is None:
                copy_expr(out, e, new)
            else:
                mapping = {**new, e.inputs[0]: operand}
                copy_expr(out, e, mapping)
                new[v] = mapping[v]
    for o in fusion.outputs:
        out.outputs.append(as_tensor(new[o]))
    equate_extents(new, "lower")
    return out


def _spread(fusion: Fusion, needed: list[Expr]) -> dict[int, dict[int, Extent]]:
    """The reductions to compute along axes their operand is broadcast on (id(Expr) -> {an
    operand dimension of size 1: the extent to spread it to}): a reduction over leading axes
    (not the last) whose result is no output and meets, in elementwise ops only, results of
    reductions over the same dimensions that span those axes. A mean of x under a mask m
    [batch, seq, 1], sum(x * m, [1]) / sum(m, [1]): sum(m, [1]) alone is a value per sample
    reduced from per-row values, which no kernel of the rows' columns computes; spread along
    hidden it is one more column sum beside sum(x * m, [1]), each column the same total, and
    the fusion one kernel. Nothing else changes kind: the partners already reduce over those
    rows."""
    users: dict[int, list[Expr]] = {}
    for e in needed:
        for i in e.inputs:
            users.setdefault(id(i), []).append(e)
    outputs = {id(o) for o in fusion.outputs}
    found = {}
    for e in needed:
        if e.op not in REDUCTIONS or id(e.outputs[0]) in outputs:
            continue
        x, r = as_tensor(e.inputs[0]), as_tensor(e.outputs[0])
        dims, keepdim = e.attr("dims"), e.attr("keepdim")
        if x.ndim - 1 in dims or any(x.dims[d] is None for d in dims):
            continue  # reductions over the rows only (no kernel is built by rows of columns)
        at = {d: d if keepdim else d - sum(k < d for k in dims)
              for d in range(x.ndim) if d not in dims and x.dims[d] is None}
        extents = {}
        for d, j in at.items():
            extent = _partners_extent(e, r, j, users.get(id(r), []))
            if extent is None:
                break
            extents[d] = extent
        else:
            if extents:
                found[id(e)] = extents
    return found


def _partners_extent(e: Expr, r: Tensor, j: int, uses: list[Expr]) -> Extent | None:
    """The one extent that the operands beside `r` in its uses have at r's dimension j, where
    every use is elementwise and some such operand is a result of a reduction like `e` (the
    same op's dims and keepdim) whose operand spans it; else None."""
    from fuser.ops import ELEMENTWISE

    roots, like_e = set(), False
    for u in uses:
        if u.op not in ELEMENTWISE:
            return None
        for o in u.inputs:
            if o is r or not isinstance(o, Tensor):
                continue
            if o.ndim != r.ndim:
                return None
            extent = o.dims[j]
            if extent is None:
                continue
            roots.add(extent.find())
            p = o.definition
            like_e |= (p is not None and p.op in REDUCTIONS and p.attrs == e.attrs
                       and as_tensor(p.inputs[0]).ndim == as_tensor(e.inputs[0]).ndim)
    return roots.pop() if like_e and len(roots) == 1 else None


def _spread_operand(out: Fusion, e: Expr, extents: dict[int, Extent],
                    new: dict[Val, Val]) -> Tensor | None:
    """e's operand (copied into `out`) broadcast to `extents` (_spread), each size taken from a
    copied tensor of that extent; None where nothing is spread, or no copied tensor has one
    of the extents yet (the reduction stays as written)."""
    if not extents:
        return None
    x = as_tensor(new[e.inputs[0]])
    shape: list = [1 if n is None else out.size(x, d) for d, n in enumerate(x.dims)]
    for d, extent in extents.items():
        size = next((out.size(as_tensor(nv), k) for old, nv in new.items()
                     if isinstance(old, Tensor)
                     for k, n in enumerate(old.dims) if n is not None and n.find() is extent),
                    None)
        if size is None:
            return None
        shape[d] = size
    return out.broadcast_in_dim(x, shape, list(range(x.ndim)))


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


def _expand_var_mean(f: Fusion, x: Tensor, dims, correction, keepdim, with_mean: bool = True):
    """mean = sum(x)/n; var = sum((x - mean)^2)/max(n - correction, 0): two passes, exact; a
    correction at or past n gives inf (nan for a constant row), as torch.var_mean does.
    [var, mean], or [var] alone without `with_mean` (torch.var)."""
    count: Val | None = None
    for d in dims:
        size = f.size(x, d)
        count = size if count is None else f.elementwise("mul", [count, size])
    kept = [d for d in range(x.ndim) if d not in dims]
    mean = f.elementwise("div", [reduction(f, "sum", x, dims, False, x.dtype), count])
    centered = f.elementwise("sub", [x, f.broadcast_in_dim(mean, x.shape(), kept)])
    sq = f.elementwise("mul", [centered, centered])
    denominator = f.elementwise("maximum", [
        f.elementwise("sub", [count, f.define_scalar(correction)]), f.define_scalar(0)])
    var = f.elementwise("div", [reduction(f, "sum", as_tensor(sq), dims, False, sq.dtype),
                                denominator])
    results = [var, mean] if with_mean else [var]
    if not keepdim:
        return results
    shape = [1 if d in dims else f.size(x, d) for d in range(x.ndim)]
    return [f.broadcast_in_dim(r, shape, kept) for r in results]
