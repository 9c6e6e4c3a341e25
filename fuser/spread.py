"""Spread reductions, a pass of fuser.lowering: a reduction over the rows of a value that
lacks the hidden axis, whose result only meets (in elementwise ops) the result of a
reduction over the same rows of a tensor that has it, is computed on its operand broadcast
to that tensor's shape instead. A mean of x under a mask, sum(x * m, [1]) / sum(m, [1]) with
m [batch, seq, 1] (or m [batch, seq] and its sum kept as [batch, 1]): the count alone is a
value per sample reduced from per-row values, which no kernel over the columns of the rows
computes, so the fusion ran as three segments; spread along hidden it is one more column
reduction beside the masked sum, every column holding the same total, and the fusion one
column kernel. The partner already reduces over those rows, so the fusion's kind stays."""

from __future__ import annotations

from dataclasses import dataclass

from fuser.ir import Expr, Fusion, Tensor, Val, as_tensor, upstream
from fuser.ops import ELEMENTWISE, REDUCTIONS


@dataclass(frozen=True)
class Spread:
    """How to spread one reduction: onto the operand of `like` (the partner reduction), each
    axis of the reduction's operand at `axes` there (None: an axis of size 1, dropped)."""

    like: Expr
    axes: tuple[int | None, ...]


def spreads(fusion: Fusion, needed: list[Expr]) -> dict[int, Spread]:
    """The reductions of `needed` to spread (id(Expr) -> its Spread): each one's result is no
    output of `fusion`, is used by elementwise ops only, beside operands of its rank of which
    one is a reduction's result it maps onto (_onto); spread, its result has that one's
    extents where it had size 1, and in every use another operand has them too (_grows), so
    no use's result changes shape."""
    users: dict[int, list[Expr]] = {}
    for e in needed:
        for i in e.inputs:
            users.setdefault(id(i), []).append(e)
    outputs = {id(o) for o in fusion.outputs}
    found = {}
    for e in needed:
        if e.op not in REDUCTIONS or id(e.outputs[0]) in outputs:
            continue
        r, uses = as_tensor(e.outputs[0]), users.get(id(e.outputs[0]), [])
        if not uses or any(u.op not in ELEMENTWISE for u in uses):
            continue
        others = [o for u in uses for o in u.inputs if o is not r and isinstance(o, Tensor)]
        if any(o.ndim != r.ndim for o in others):
            continue
        for like in (o.definition for o in others):
            if like is not None and like.op in REDUCTIONS:
                axes = _onto(e, like)
                if axes is not None and _grows(r, as_tensor(like.outputs[0]), uses):
                    found[id(e)] = Spread(like, axes)
                    break
    return found


def _onto(e: Expr, like: Expr) -> tuple[int | None, ...] | None:
    """The axis of like's operand for each axis of e's operand (None for one of size 1),
    where every other axis has one of the same extent, in the same order, and e reduces
    exactly the axes that `like` does, none of them the last (the hidden axis): else None."""
    x, onto = as_tensor(e.inputs[0]), as_tensor(like.inputs[0])
    roots = [None if n is None else n.find() for n in onto.dims]
    axes: list[int | None] = []
    for n in x.dims:
        if n is None:
            axes.append(None)
            continue
        matches = [k for k, root in enumerate(roots) if root is n.find()]
        if len(matches) != 1:
            return None
        axes.append(matches[0])
    placed = [k for k in axes if k is not None]
    reduced = like.attr("dims")
    if (placed != sorted(set(placed)) or onto.ndim - 1 in reduced
            or any(axes[d] is None for d in e.attr("dims"))
            or {axes[d] for d in e.attr("dims")} != set(reduced)
            or any(onto.dims[k] is None for k in reduced)):
        return None
    return tuple(axes)


def _grows(r: Tensor, spread: Tensor, uses: list[Expr]) -> bool:
    """Whether `spread` (the partner's result, the spread reduction's shape) is `r` with some
    axes of size 1 grown, and each use of r has, at each grown axis, another operand of that
    extent and none of another: each use's result then has the shape it had (a use such as
    relu(r), or r * r, would carry the grown axes on to what follows, so r is not spread)."""
    grown = []
    for j, (a, b) in enumerate(zip(r.dims, spread.dims, strict=True)):
        if a is not None:
            if b is None or a.find() is not b.find():
                return False
        elif b is not None:
            grown.append((j, b.find()))
    for u in uses:
        beside = [o for o in u.inputs if o is not r and isinstance(o, Tensor)]
        for j, root in grown:
            extents = {n.find() for n in (o.dims[j] for o in beside) if n is not None}
            if extents != {root}:
                return False
    return bool(grown)


def spread_reduction(out: Fusion, e: Expr, spread: Spread, new: dict[Val, Val]) -> Val | None:
    """e computed in `out` on its operand (copied: new) broadcast as `spread` says, each size
    taken from a copied tensor of that extent; None where some extent has no copied tensor
    yet (the reduction is then copied as written)."""
    onto = as_tensor(spread.like.inputs[0])
    x = as_tensor(new[e.inputs[0]])
    dropped = [d for d, k in enumerate(spread.axes) if k is None]
    if dropped:
        x = out.squeeze(x, dropped)
    placed = [k for k in spread.axes if k is not None]
    shape: list = []
    for n in onto.dims:
        size = 1 if n is None else _size_of(out, n.find(), new)
        if size is None:
            return None
        shape.append(size)
    wide = out.broadcast_in_dim(x, shape, placed)
    return out.reduction(e.op, wide, list(spread.like.attr("dims")),
                         spread.like.attr("keepdim"), e.outputs[0].dtype)


def _size_of(out: Fusion, root, new: dict[Val, Val]):
    """A size Scalar of `out` for the extent `root`, from the first copied tensor that has it."""
    for old, copied in new.items():
        if isinstance(old, Tensor):
            for k, n in enumerate(old.dims):
                if n is not None and n.find() is root:
                    return out.size(as_tensor(copied), k)
    return None


def described(fusion: Fusion) -> tuple[str, ...]:
    """The reductions of `fusion` (as the user wrote it) that lowering spreads, each as
    "T6 = sum(T3) beside T5 = sum(T4)": explain() lists them under the definition, since
    the classification names the spread ones' lowered values."""
    found = spreads(fusion, upstream(fusion.outputs))
    by_id = {id(e): e for e in fusion.exprs}
    return tuple(f"{_written(by_id[key])} beside {_written(s.like)}"
                 for key, s in found.items())


def _written(e: Expr) -> str:
    return f"{e.outputs[0].name} = {e.op}({e.inputs[0].name})"
