"""Axis reordering: a fusion whose axes fit rows and a hidden axis in another order than its
own, run in that order.

A kernel here runs tensors of all the fusion's axes, of its leading ones (per-row values) or
of its last one (per-column values), and reduces along the last axis or over the leading
ones (analysis.axes). BatchNorm over NCHW (statistics over N, H and W, per channel C in the
middle) and a mean over the sequence of a [batch, seq, hidden] tensor do not fit that order,
but they fit another: rows of one channel, [C, N * H * W], or rows [batch, hidden] along seq.
`reordered` finds such an order, splitting the axes into row axes R and hidden axes H (merged
into one axis where there are several), and writes the fusion again on it: each input is
permuted into the order (a contiguous copy, made between kernels as a user's permute is;
none where its axes are in that order already) and its hidden axes merged (a view), every op
works on tensors of the new axes, and each output is moved back into its own order (a view
where only merged axes split again, a copy where its axes move). The segmentation then runs
the copy like any fusion with layout ops, and `show` lists each move.

Of the orders that fit, the one with the fewest copies is taken, then the one with the fewest
reductions over the rows (a value computed from one takes another kernel; from a reduction
along the hidden axis, the same sweep), then the one whose hidden axes hold the fusion's
innermost axis; a fusion that fits in its own order is not touched. The choice depends on
the definition alone, not the sizes, so it is made once per fusion. An order in which a
reduction over the trailing row axes keeps the leading ones as groups (analysis.group_axes)
is tried first where it copies less (grouped_order), and taken where every segment then runs
as one kernel chain: softmax over S of [B, S, A, D] as rows [B, S] in groups of B and hidden
[A * D], views only, where moving S last copies the input and the output.

A kernel reads an input that spans a run of the row axes repeated (analysis.RowRun: a
[q, k] mask over scores [batch, heads, q, k] normalized along k, adaLN's [batch, hidden]
scale over [batch, seq, hidden]), so such fusions never get here. Where no order fits
because an input spans some of the row axes otherwise (axes that are not a run, or in a
segment with an outer reduction, whose column kernels read no input repeated), the fewest
such inputs are expanded: copied broadcast to all the axes between kernels (Fusion.expand),
after which they are full inputs. Only inputs whose every narrow
use is broadcast to all the axes before it meets a reduction or an output are expanded, so
the copy changes no value.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from fuser.ir import (
    Expr,
    Extent,
    Fusion,
    Scalar,
    Tensor,
    Val,
    as_tensor,
    copy_cast,
    dim_axes,
    reduced_axes,
    spanned_axes,
)
from fuser.lowering import define_like, equate_extents, reduction
from fuser.ops import ELEMENTWISE, LAYOUT_OPS, REDUCTIONS

# the ops a fusion to reorder may hold: the lowered ones (var_mean and var expanded)
_MAPPED = frozenset({"cast", "size", "squeeze", "broadcast_in_dim"}) | set(ELEMENTWISE)


@dataclass(frozen=True)
class Order:
    """Row axes and hidden axes (each in the fusion's order), the order a rewrite takes."""

    rows: tuple[Extent, ...]
    hidden: tuple[Extent, ...]
    # inputs a kernel cannot read broadcast in this order: each is copied broadcast to its
    # target (an expand) between kernels
    expanded: tuple[Tensor, ...] = ()

    @property
    def axes(self) -> tuple[Extent, ...]:
        return self.rows + self.hidden

    def target(self, v: Tensor) -> frozenset[Extent]:
        """The axes an expanded input is copied broadcast to: the row axes where it spans
        some of them only (N * C values of a [C] weight over rows [N, C]: a small copy), the
        hidden axes likewise, else all of them (a copy of the full shape)."""
        span = set(spanned_axes(v))
        for axes in (self.rows, self.hidden):
            if span <= set(axes):
                return frozenset(axes)
        return frozenset(self.axes)

    def position(self, axis: Extent) -> int:
        """The axis' position among the rewritten tensors' axes: the hidden axes share the
        last one."""
        return self.rows.index(axis) if axis in self.rows else len(self.rows)


def _fits(f: Fusion, order: Order, groups: bool = False) -> bool:
    """Whether every tensor spans no axis, the row axes, the hidden axes or all of them in the
    rewrite (the values made of expanded inputs with their targets' axes), and every reduction
    reduces all of its operand's axes, or a tensor of every axis over the row axes or over the
    hidden ones. With `groups`, also a tensor of a leading run of the row axes (with or without
    the hidden ones), and a reduction of a tensor of every axis over the row axes after such
    a run (the run's rows are its groups)."""
    rows, hidden, every = set(order.rows), set(order.hidden), set(order.axes)
    widening = _widening(f, order)
    if widening is None:
        return False
    leading = [set(order.rows[:k]) for k in range(1, len(order.rows))] if groups else []
    spans = [set(), rows, hidden, every, *leading, *(run | hidden for run in leading)]
    trailing = [rows - run for run in leading]
    repeated = _repeated_runs(f, order)
    for v in f.vals:
        if not isinstance(v, Tensor):
            continue
        span = set(spanned_axes(v)) | widening.get(v, set())
        if span not in spans and (v in f.outputs or span not in repeated):
            return False
    for e in f.exprs:
        if e.op in REDUCTIONS:
            span, reduced = set(spanned_axes(as_tensor(e.inputs[0]))), reduced_axes(e)
            if reduced != span and not (span == every and reduced in (rows, hidden, *trailing)):
                return False
    return True


def _repeated_runs(f: Fusion, order: Order) -> list[set[Extent]]:
    """The spans an input (or a value of it that is not an output) may have in `order` that
    a kernel reads repeated (analysis.RowRun): a run of the row axes, with or without the
    hidden ones, where no reduction is over the rows (column kernels read every row of each
    input); none otherwise. A [B, T, H] weight over rows [B, S] along T * H: [B] and the
    hidden axes."""
    rows, hidden = set(order.rows), set(order.hidden)
    if any(e.op in REDUCTIONS and reduced_axes(e) & rows for e in f.exprs):
        return []
    runs = [set(order.rows[i:j]) for i in range(len(order.rows))
            for j in range(i + 1, len(order.rows) + 1) if j - i < len(order.rows)]
    return runs + [run | hidden for run in runs]


def _widening(f: Fusion, order: Order) -> dict[Val, frozenset[Extent]] | None:
    """The axes each value made narrow of an expanded input gains in the rewrite (its
    target's), or None where an expanded input cannot take its target."""
    extra: dict[Val, frozenset[Extent]] = {}
    for v in order.expanded:
        target = order.target(v)
        narrow = _narrow_values(f, v, target)
        if narrow is None:
            return None
        for u in narrow:
            extra[u] = extra.get(u, frozenset()) | target
    return extra


def _narrow_values(f: Fusion, v: Val, target: frozenset[Extent]) -> set[Val] | None:
    """`v` and the values made of it by elementwise ops, casts, broadcasts and squeezes that
    do not span all of `target`; None where one of them is reduced, is an output, or is used
    otherwise (expanding `v` to `target` would change what that sees)."""
    narrow: set[Val] = set()
    stack = [v]
    while stack:
        u = stack.pop()
        if u in narrow:
            continue
        if u in f.outputs:
            return None
        narrow.add(u)
        for e in f.uses(u):
            if e.op == "size":
                continue
            if e.op not in ELEMENTWISE and e.op not in ("cast", "broadcast_in_dim", "squeeze"):
                return None
            if not target <= set(spanned_axes(as_tensor(e.outputs[0]))):
                stack.append(e.outputs[0])
    return narrow


def _axes(f: Fusion) -> tuple[Extent, ...] | None:
    """The fusion's axes in its own order (its widest tensor's), or None where a tensor has an
    axis twice, an axis the widest tensor lacks, or its axes in another order."""
    tensors = [v for v in f.vals if isinstance(v, Tensor)]
    if not tensors:
        return None
    widest = spanned_axes(max(tensors, key=lambda t: len(spanned_axes(t))))
    if len(set(widest)) != len(widest):
        return None
    for t in tensors:
        span = spanned_axes(t)
        if len(set(span)) != len(span) or any(a not in widest for a in span):
            return None
        if [widest.index(a) for a in span] != sorted(widest.index(a) for a in span):
            return None
    return widest


def _copies(f: Fusion, order: Order) -> tuple[int, int]:
    """The copies of the full shape the order makes (inputs and outputs it moves, inputs it
    expands to all the axes), then the size of the small ones (inputs expanded to the row or
    the hidden axes alone), counted in axes: sizes are not known here, and a target of fewer
    axes is most often the smaller ([N, C] rather than [C, H, W])."""
    rank = {a: i for i, a in enumerate(order.axes)}
    full = small = 0
    for t in [*f.inputs, *f.outputs]:
        if isinstance(t, Tensor) and t not in order.expanded:
            span = [rank[a] for a in spanned_axes(t)]
            full += span != sorted(span)
    for v in order.expanded:
        if order.target(v) == frozenset(order.axes):
            full += 1
        else:
            small += len(order.target(v))
    return full, small


def _over_rows(f: Fusion, order: Order) -> int:
    """The reductions the order makes outer (over the rows): what a row kernel computes from
    an inner reduction's result it writes in the same sweep, but a value computed from an
    outer one takes another kernel."""
    rows = set(order.rows)
    return sum(1 for e in f.exprs if e.op in REDUCTIONS and reduced_axes(e) == rows
               and set(spanned_axes(as_tensor(e.inputs[0]))) == set(order.axes))


def _expandable(f: Fusion, axes: tuple[Extent, ...]) -> list[Tensor]:
    """Tensor inputs of some but not all axes: each might be expanded (copied broadcast
    between kernels) where an order needs it (_widening says where it can)."""
    return [v for v in f.inputs if isinstance(v, Tensor) and 0 < len(spanned_axes(v)) < len(axes)]


def order_of(f: Fusion) -> Order | None:
    """The order to rewrite `f` in, or None: where it fits its own order (rows, then the last
    axis), no order fits it whatever inputs it expands, or it holds what the rewrite does not
    take (layout ops, ops of several results, an input that is an output). Of the orders that
    fit: the fewest copies of the full shape, then the smallest others, then the fewest
    reductions over the rows, then the innermost axis hidden, then the most hidden axes (the
    longest rows)."""
    return _best(f, groups=False)


def grouped_order(f: Fusion, plain: Order | None) -> Order | None:
    """An order with fewer copies than `plain` (order_of's) that fits only where a reduction
    over the trailing row axes keeps the leading ones as groups (analysis.group_axes: a column
    kernel per group of rows), or None: softmax over S of [B, S, A, D] as rows [B, S] and
    hidden [A * D] (views), where order_of's moves S last (two copies). The segmentation takes
    it only where every segment then runs as one kernel chain (segment.segment)."""
    best = _best(f, groups=True)
    if best is None or _fits(f, best):  # order_of's rules fit it
        return None
    return best if plain is None or _copies(f, best) < _copies(f, plain) else None


def _best(f: Fusion, groups: bool) -> Order | None:
    """order_of's choice, with reductions in groups (_fits) where `groups`."""
    if any(e.op in LAYOUT_OPS or (e.op not in _MAPPED and e.op not in REDUCTIONS)
           or len(e.outputs) != 1 for e in f.exprs) or any(o in f.inputs for o in f.outputs):
        return None
    axes = _axes(f)
    if axes is None or len(axes) < 2:
        return None
    if _fits(f, Order(axes[:-1], axes[-1:]), groups):
        return None
    expandable = _expandable(f, axes)
    fitting = [order for order in (_with_expansions(f, split, expandable)
                                   for split in _splits(axes))
               if _fits(f, order, groups)]
    if not fitting:
        return None
    return min(fitting, key=lambda o: (_copies(f, o), _over_rows(f, o),
                                       axes[-1] not in o.hidden, -len(o.hidden)))


def _splits(axes: tuple[Extent, ...]) -> list[Order]:
    """Every split of `axes` into (at least one) row axes and hidden axes, in their order."""
    return [Order(tuple(a for a in axes if a not in hidden), hidden)
            for count in range(1, len(axes)) for hidden in combinations(axes, count)]


def _with_expansions(f: Fusion, split: Order, expandable: list[Tensor]) -> Order:
    """`split` with the inputs expanded whose own axes it does not fit, nor a kernel reads
    repeated (no input whose axes fit gains from a copy): linear in the inputs, not a search
    over their subsets."""
    allowed: list[set[Extent]] = [set(), set(split.rows), set(split.hidden), set(split.axes),
                                  *_repeated_runs(f, split)]
    return Order(split.rows, split.hidden,
                 tuple(v for v in expandable if set(spanned_axes(v)) not in allowed))


def reordered(f: Fusion) -> Fusion:
    """`f` written again in the order order_of finds (see the module docstring), or `f` itself
    where none is needed or none fits (the analysis' refusal then stands)."""
    return rewritten(f, order_of(f))


def rewritten(f: Fusion, order: Order | None) -> Fusion:
    """`f` written again on `order` (order_of's), or `f` itself where there is none or an axis
    the rewrite needs a size of has none an input gives."""
    if order is None:
        return f
    try:
        return _Rewrite(f, order).out
    except _NoSize:
        return f


class _NoSize(Exception):
    """No input gives the size of an axis the rewrite needs a size of."""


class _Rewrite:
    """`f` on the axes of `order`: every tensor of the rewrite has one axis per row axis and
    one for the hidden axes, size 1 where it does not span it."""

    def __init__(self, f: Fusion, order: Order):
        self.f, self.order = f, order
        self.widening = _widening(f, order) or {}  # axes narrow values gain
        self.out = Fusion()
        self.rank = len(order.rows) + 1
        self.merged = len(order.hidden) > 1
        self.new: dict[Val, Val] = {}
        raw = {v: define_like(self.out, v, True) for v in f.inputs}
        equate_extents(raw, "reorder")
        # an axis' size, as a tensor input gives it
        self.input_size: dict[Extent, tuple[Tensor, int]] = {}
        for v, r in raw.items():
            if isinstance(v, Tensor):
                for d, e in enumerate(v.dims):
                    if e is not None:
                        self.input_size.setdefault(e.find(), (as_tensor(r), d))
        for v, r in raw.items():
            if v in order.expanded:
                target = [a for a in order.axes if a in order.target(v)]
                self.new[v] = self._placed(list(target), self._expanded(v, r, target))
            elif isinstance(v, Tensor):
                self.new[v] = self._placed(dim_axes(v), as_tensor(r))
            else:
                self.new[v] = r
        self.sizes = self._position_sizes()
        for v in f.vals:
            if v.definition is None and v not in f.inputs:
                self.new[v] = define_like(self.out, v, False)
            elif v.definition is not None:
                self.new[v] = self._op(v.definition)
        for o in f.outputs:
            self.out.add_output(self._restored(as_tensor(o)))

    def _positions(self, t: Tensor) -> list[int]:
        """The positions of `t`'s axes in the rewrite, ascending, one per axis it spans there
        (the hidden axes once; a value made of an expanded input, its target's too)."""
        span = set(spanned_axes(t)) | self.widening.get(t, set())
        return sorted({self.order.position(a) for a in span})

    def _expanded(self, v: Tensor, r: Val, axes: list[Extent]) -> Tensor:
        """Input `r` (a copy of `v`) copied broadcast to `axes` (its target, in the rewrite's
        order, so that the copy needs no move after it): its size-1 axes dropped first (a
        view), and its own axes put in that order where they are not (a copy of the small
        input, before it is broadcast)."""
        t = as_tensor(r)
        if any(e is None for e in v.dims):
            t = self.out.reshape(t, [self.out.size(t, d) for d, e in enumerate(v.dims)
                                     if e is not None])
        where = [axes.index(a) for a in spanned_axes(v)]
        if where != sorted(where):
            t = self.out.permute(t, sorted(range(len(where)), key=where.__getitem__))
            where = sorted(where)
        return self.out.expand(t, [self._axis_size(a) for a in axes], where)

    def _placed(self, axis: list[Extent | None], r: Tensor) -> Tensor:
        """Input tensor `r`, whose axes are `axis` (None for size 1), on the rewrite's axes:
        permuted into the order (none where its axes are in it), its hidden axes merged (a
        view), then laid out with an axis per position."""
        order_rank = {a: i for i, a in enumerate(self.order.axes)}
        rank_of = {d: order_rank[a] for d, a in enumerate(axis) if a is not None}
        dims = list(rank_of)
        by_order = sorted(dims, key=rank_of.__getitem__)
        source = list(range(len(axis)))  # the axis of r each axis of t is
        t: Tensor = r
        if by_order != dims:
            source = by_order + [d for d, a in enumerate(axis) if a is None]
            t = self.out.permute(t, source)
        unit = [i for i, d in enumerate(source) if axis[d] is None]
        hidden = [i for i, d in enumerate(source) if axis[d] in self.order.hidden]
        if self.merged and hidden:
            kept = [self.out.size(t, i) for i in range(t.ndim) if i not in unit + hidden]
            t = self.out.reshape(t, [*kept, -1])
        elif unit:
            t = self.out.squeeze(t, unit)
        positions = sorted({self.order.position(a) for a in axis if a is not None})
        if positions == list(range(self.rank)):
            return t
        shape: list[Scalar | int] = [1] * self.rank
        for i, p in enumerate(positions):
            shape[p] = self.out.size(t, i)
        return self.out.broadcast_in_dim(t, shape, positions)

    def _position_sizes(self) -> list[Scalar]:
        """A size for each position of the rewrite, from the placed inputs."""
        sizes: list[Scalar | None] = [None] * self.rank
        for v in self.f.inputs:
            t = self.new[v]
            if isinstance(t, Tensor) and v not in self.order.expanded:
                for p, e in enumerate(t.dims):
                    if e is not None and sizes[p] is None:
                        sizes[p] = self.out.size(t, p)
        if None in sizes:
            raise _NoSize
        return [s for s in sizes if s is not None]

    def _op(self, e: Expr) -> Val:
        out, args = self.out, [self.new[i] for i in e.inputs]
        result = e.outputs[0]
        if e.op == "size":
            return self._size(as_tensor(e.inputs[0]), e.attr("dim"))
        if e.op == "squeeze":
            return args[0]
        if e.op == "cast":
            return copy_cast(out, e, args[0])
        if e.op == "broadcast_in_dim":
            shape: list[Scalar | int] = [1] * self.rank
            for p in self._positions(as_tensor(result)):
                shape[p] = self.sizes[p]
            return out.broadcast_in_dim(args[0], shape, list(range(self.rank)))
        if e.op in REDUCTIONS:
            reduced = sorted({self.order.position(a) for a in reduced_axes(e)})
            return reduction(out, e.op, as_tensor(args[0]), reduced, True, result.dtype)
        return out.elementwise(e.op, args)

    def _size(self, t: Tensor, dim: int) -> Scalar:
        """size(t, dim) of the fusion: the size of that axis, taken from an input that has it."""
        extent = t.dims[dim]
        return self.out.define_scalar(1, None) if extent is None else self._axis_size(extent.find())

    def _restored(self, o: Tensor) -> Tensor:
        """Output `o`'s rewrite moved back into `o`'s own shape, between kernels: a view
        without its size-1 axes and with its hidden axes split again, its axes permuted back
        (a copy, where they moved), and a view with its own size-1 axes. A kernel writes the
        rewrite itself: a squeeze there would be an op on a reduction's result, which takes
        a kernel of its own."""
        t = as_tensor(self.new[o])
        order_rank = {a: i for i, a in enumerate(self.order.axes)}
        span = spanned_axes(o)
        by_order = sorted(span, key=order_rank.__getitem__)
        own = [1 if e is None else self._axis_size(e.find()) for e in o.dims]
        if by_order == list(span):
            same = [e is None for e in t.dims] == [e is None for e in o.dims]
            return t if same else self.out.reshape(t, own)
        t = self.out.reshape(t, [self._axis_size(a) for a in by_order])
        t = self.out.permute(t, [by_order.index(a) for a in span])
        return t if t.ndim == o.ndim else self.out.reshape(t, own)

    def _axis_size(self, axis: Extent) -> Scalar:
        """The size of `axis`, from an input that has it (its original shape, before any move:
        a merged axis has no size of its own members)."""
        found = self.input_size.get(axis)
        if found is None:
            raise _NoSize
        return self.out.size(*found)


def explain_order(f: Fusion, order: Order) -> str:
    """Why and how fusion `f` runs reordered on `order` or with inputs expanded, for the
    segmentation's heading."""
    own = _axes(f) or ()
    parts = []
    if order.axes != own:
        parts.append(f"its axes fit rows and a hidden axis in another order: rows over "
                     f"{_names(order.rows)}, hidden {_names(order.hidden)}; the inputs are "
                     "moved into that order and the outputs back, between kernels")
    elif order.hidden != own[-1:]:
        parts.append(f"rows over {_names(order.rows)}, hidden {_names(order.hidden)} merged "
                     "into one axis: views of the inputs and outputs, between kernels")
    for v in order.expanded:
        target = order.target(v)
        which = ("row axes" if target == frozenset(order.rows) else
                 "hidden axes" if target == frozenset(order.hidden) else "axes")
        onto = "the full shape" if which == "axes" else f"all the {which}"
        parts.append(f"{v.name} spans part of the {which}, which no kernel here reads "
                     "repeated (a kernel does read an input of a run of the row axes, with "
                     "or without the hidden ones, outside an outer reduction): copied "
                     f"broadcast to {onto} between kernels")
    return "; ".join(parts)


def _names(axes: tuple[Extent, ...]) -> str:
    return ", ".join(str(a) for a in axes) or "none"

