"""Layout ops (permute, reshape) in a segmented fusion: which values they need written, which
they read, and where they can move so that no kernel writes a value only to have it moved.

No kernel here moves elements to other positions; analysis.analyze refuses a fusion with a
layout op, and segmentation cuts it there (segment.stages: a layout op's result is one stage
past a kernel-made operand). The executor makes each result between kernels, as soon as its
operand exists (moves.make_layouts).
"""

from __future__ import annotations

from fuser.dtypes import DataType
from fuser.ir import (
    Expr,
    Fusion,
    Scalar,
    Tensor,
    Val,
    as_tensor,
    copy_cast,
    dim_axes,
    rounding_cast,
)
from fuser.lowering import copy_expr, define_like
from fuser.ops import ELEMENTWISE, LAYOUT_OPS


def describe(e: Expr) -> str:
    what = {"permute": "a contiguous copy in the new order (fuser/permute.py's kernel)",
            "expand": "a contiguous copy broadcast to that shape"}.get(
                e.op, "a view of the same bytes")
    shape = ", ".join(str(s) for s in e.attr("dims" if e.op == "permute" else "shape"))
    return f"{e.outputs[0].name} = {e.op}({e.inputs[0].name}, [{shape}]): {what}"


def kernel_made(v: Val) -> bool:
    """Whether a kernel computes `v` (it is neither an input nor a layout op's result)."""
    return v.definition is not None and v.definition.op not in LAYOUT_OPS


def layout_made(v: Val) -> bool:
    """Whether `v` is a permute's or reshape's result, made between kernels."""
    return v.definition is not None and v.definition.op in LAYOUT_OPS


def kernel_operands(exprs) -> list[Val]:
    """The operands of the layout ops among `exprs` that a kernel computes: each is written
    to global memory by the segment that computes it, and moved between kernels."""
    return [e.inputs[0] for e in exprs if e.op in LAYOUT_OPS and kernel_made(e.inputs[0])]


def needed(f: Fusion) -> list[Expr]:
    """The layout ops the outputs depend on, in definition order."""
    seen: set[int] = set()
    stack: list[Val] = list(f.outputs)
    while stack:
        e = stack.pop().definition
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            stack.extend(e.inputs)
    return [e for e in f.exprs if id(e) in seen and e.op in LAYOUT_OPS]


def on_inputs(f: Fusion) -> Fusion:
    """A copy of `f` where each permute or reshape of an elementwise value of inputs of its
    own shape (a cast of the input, x * y) is made of the inputs instead: the ops then run on
    the moved inputs, f(permute(x)) for permute(f(x)), so no kernel writes f(x) for the move
    and no kernel reads it back. A reshape of an input is a view; a permute of one, a copy.
    Likewise an op of one tensor (a cast) on the only use of a layout op of a value a kernel
    computes runs before the move, in that kernel: permute(cast(s)) for cast(permute(s)).
    Softmax over dim 0 written as cast, permute, row softmax, permute, cast: one kernel, not
    three. Each pass moves each layout op one step; a chain of them (a reshape of a permute of
    x * y) takes a pass per op."""
    for _ in range(sum(e.op in LAYOUT_OPS for e in f.exprs)):
        moved = _moved_once(f)
        if moved is None:
            break
        f = moved
    return f


def _moved_once(f: Fusion) -> Fusion | None:
    """One pass of on_inputs, or None where no layout op moves."""
    out = Fusion()
    new: dict[Val, Val] = {}
    changed = False
    movable: dict[Val, bool] = {}
    for v in f.vals:
        e = v.definition
        if e is None:
            new[v] = define_like(out, v, v in f.inputs)
        elif v is e.outputs[0]:
            if (e.op in LAYOUT_OPS and kernel_made(e.inputs[0])
                    and _movable(f, e.inputs[0], movable)):
                new[v], changed = _moved_down(out, e, e.inputs[0], new, {}), True
            elif (layout := _moved_up_from(f, e, new)) is not None:
                # `layout` is already of `out`: its sizes (a reshape's) stand for themselves
                mapping = {**{s: s for s in layout.inputs[1:]},
                           layout.inputs[0]: _remade(out, e, new, layout)}
                copy_expr(out, layout, mapping)
                new[v], changed = mapping[layout.outputs[0]], True
            else:
                copy_expr(out, e, new)
    out.outputs.extend(as_tensor(new[o]) for o in f.outputs)
    return out if changed else None


def _moved_up_from(f: Fusion, e: Expr, new: dict[Val, Val]) -> Expr | None:
    """The layout op (of `out`, the copy) that `e` can run before: `e` an elementwise op or
    cast of one tensor, that tensor a layout op's result with no other use in `f`, of a value
    a kernel computes."""
    if e.op not in ELEMENTWISE and e.op != "cast":
        return None
    if not rounding_cast(e) and e.outputs[0].dtype in (DataType.Half, DataType.BFloat16):
        return None  # the kernel would write it rounded, where the value is not (see _widened)
    tensors = [i for i in e.inputs if isinstance(i, Tensor)]
    if len(tensors) != 1 or not _used_once(f, tensors[0]):
        return None
    layout = new[tensors[0]].definition
    if layout is None or layout.op not in LAYOUT_OPS or not kernel_made(layout.inputs[0]):
        return None
    return layout


def _remade(out: Fusion, e: Expr, new: dict[Val, Val], layout: Expr) -> Val:
    """`e` in `out` on the layout op's operand instead of its result."""
    return _remake(out, e, [layout.inputs[0] if isinstance(i, Tensor) else new[i]
                            for i in e.inputs])


def _remake(out: Fusion, e: Expr, operands: list[Val]) -> Val:
    """Elementwise op or cast `e` in `out`, on `operands`."""
    if e.op == "cast":
        return copy_cast(out, e, operands[0])
    return out.elementwise(e.op, operands)


def _on_host(v: Val) -> bool:
    """Whether `v` is an input tensor or layout ops of one: made without a kernel."""
    while v.definition is not None and v.definition.op in LAYOUT_OPS:
        v = v.definition.inputs[0]
    return v.definition is None and isinstance(v, Tensor)


def _used_once(f: Fusion, v: Val) -> bool:
    """Whether one op uses `v`'s values (a size op reads its shape only) and it is no output
    of `f`."""
    return len([u for u in f.uses(v) if u.op != "size"]) == 1 and v not in f.outputs


def _movable(f: Fusion, v: Val, memo: dict[Val, bool]) -> bool:
    """Whether a layout op of tensor `v` can move onto what `v` is made of: elementwise ops
    and casts alone, each value used once (by the next of them) and no output, from tensors of
    its own shape that no kernel makes (_on_host) and scalars; no broadcast, no reduction.
    A value needed as it is elsewhere would be computed in both orientations: another kernel
    and more copies than the layout op itself costs."""
    if v in memo:
        return memo[v]
    e = v.definition
    if e is None or layout_made(v):
        memo[v] = _on_host(v)
        return memo[v]
    memo[v] = (e.op in ELEMENTWISE or e.op == "cast") and _used_once(f, v) and all(
        isinstance(i, Scalar) or (dim_axes(as_tensor(i)) == dim_axes(as_tensor(v))
                                  and _movable(f, i, memo))
        for i in e.inputs)
    return memo[v]


def _moved_down(out: Fusion, layout: Expr, v: Val, new: dict[Val, Val],
                moved: dict[Val, Val]) -> Val:
    """The layout op `layout` applied to `v` in `out`, moved down to the values `v` is made of
    that no kernel makes (_movable(v) holds): each tensor operand moved (once: `moved`), then
    `v`'s op."""
    if v in moved:
        return moved[v]
    e = v.definition
    if e is None or layout_made(v):
        mapping = {**new, layout.inputs[0]: new[v]}
        copy_expr(out, layout, mapping)
        result = mapping[layout.outputs[0]]
    else:
        result = _remake(out, e, [new[i] if isinstance(i, Scalar)
                                  else _moved_down(out, layout, i, new, moved)
                                  for i in e.inputs])
    moved[v] = result
    return result
