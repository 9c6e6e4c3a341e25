"""What a fusion is, as a scheduler sees it: FusionInfo.

Every supported fusion lives on at most two axes: a row axis and a hidden (innermost, contiguous)
axis. Each tensor's role follows from which axes it spans:

    FULL    [rows, hidden]    read or written once per element
    ROW     [rows, 1]         a per-row statistic (rms, mean, rstd, an inner reduction)
    COL     [hidden]          a per-column vector (weight, bias, an outer reduction)
    SCALAR  []                constants, scalar inputs, sizes

With several row axes, an input may span a run of them only (adaLN's [batch, hidden] scale
over rows [batch, seq], a [q, k] mask over scores [batch, heads, q, k], a [C] weight over
rows [N, C, H]): it is FULL or ROW all the same, and a kernel reads row (r / after) % count
of it for its row r (RowRun), where the segmentation would otherwise copy it broadcast.

Outer reductions may reduce the trailing row axes only (a mean over the sequence of [batch,
seq, hidden]): the leading row axes they keep are groups (FusionInfo.group_axes), each a
[rows, hidden] problem of its own, and their results are columns per group ([batch, hidden],
role COL). The kernels see one group's rows, the launch a grid row of blocks per group.

Inner reductions (over hidden) are grouped into levels: a level holds the reductions whose
inputs depend only on earlier levels, so one block-wide round trip serves the whole level (the
two sums of LayerNorm backward share one barrier). Outer reductions (over rows) accumulate per
block and are finished by a small second kernel, or folded over a cluster's blocks in the
outer-persistent kernel (an outer normalization, or an outer reduction streamed through it).

The analysis classifies the lowered fusion (lowering.py: composite ops expanded, unused ops
left out), a new Fusion, so the user's definition (and its repr) stays as written.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from fuser.errors import UnsupportedFusionError
from fuser.ir import (
    Expr,
    Extent,
    Fusion,
    Scalar,
    Tensor,
    Val,
    as_tensor,
    reduced_axes,
    spanned_axes,
)
from fuser.lowering import lower
from fuser.ops import LAYOUT_OPS, REDUCTIONS


class Kind(enum.Enum):
    POINTWISE = "pointwise"
    INNER = "inner reduction"
    OUTER = "outer reduction"
    INNER_OUTER = "inner + outer reduction"
    # outer reductions whose results full values use (softmax over dim 0, BatchNorm): the
    # columns are kept on chip while the reductions finish (outer_persistent)
    OUTER_NORM = "outer normalization"


class Role(enum.Enum):
    FULL = "full"
    ROW = "row"
    COL = "col"
    SCALAR = "scalar"


@dataclass(frozen=True)
class RowRun:
    """The row axes row_axes[first:stop] an input spans, the others broadcast: its row for
    the kernel's row r is (r / after) % count, `after` the product of the row axes past the
    run and `count` the run's (repeated_rows, the launch's values)."""

    first: int
    stop: int


@dataclass(frozen=True)
class FusionInfo:
    """A lowered fusion plus everything schedulers and codegen ask about it."""

    fusion: Fusion  # the lowered fusion: primitives only
    kind: Kind
    roles: dict  # Val -> Role
    # representatives of the extents rows are made of, outer first (rows are their product;
    # one axis for [rows, hidden], two for [batch, seq, hidden]; none without rows)
    row_axes: tuple[Extent, ...]
    hidden_axis: Extent | None
    full_inputs: tuple[Tensor, ...]  # [rows, hidden] inputs: the row buffers
    # [hidden] inputs (with groups, also [batch, hidden]: group_columns): loaded once per block
    col_inputs: tuple[Tensor, ...]
    row_inputs: tuple[Tensor, ...]  # [rows, 1] inputs: one value per row
    # tensors of no dimension (or of the groups only): one value (per group), read once
    value_inputs: tuple[Tensor, ...]
    scalar_inputs: tuple[Scalar, ...]
    inner_levels: tuple[tuple[Expr, ...], ...]  # inner reductions, by dependency level
    outer_reductions: tuple[Expr, ...]
    level: dict  # Val -> number of inner-reduction levels it waits for (0: none)
    after_outer: frozenset  # Vals computed from an outer reduction (finalize kernel)
    # the outer reductions by dependency level (level k reduces values computed from level
    # k - 1's results): more than one only in an OUTER_NORM fusion
    outer_levels: tuple[tuple[Expr, ...], ...]
    persistent: tuple[Tensor, ...]  # full inputs read in more than one phase of a row
    # inputs that span a run of the row axes only, each with its run: read repeated
    repeated: tuple[tuple[Tensor, RowRun], ...] = ()
    # leading row axes the outer reductions keep: each of their index tuples is a group, a
    # [rows, hidden] problem of its own over the other row axes (0: one group, every row)
    group_axes: int = 0

    @property
    def counted_axes(self) -> tuple[Extent, ...]:
        """The row axes a kernel's rows run over (n_rows: their product): those past the
        groups."""
        return self.row_axes[self.group_axes:]

    def group_rows(self, sizes) -> tuple[int, int]:
        """(the number of groups, a group's rows) of a call whose extents are `sizes`
        (shapes.Sizes): one group of every row without groups."""
        return (math.prod(sizes.value(a) for a in self.row_axes[:self.group_axes]),
                math.prod(sizes.value(a) for a in self.counted_axes))

    def outputs(self, role: Role) -> tuple[Tensor, ...]:
        return tuple(o for o in self.fusion.outputs if self.roles[o] is role)

    def group_part(self, t: Tensor) -> tuple[str, ...] | None:
        """The extents of one group's part of tensor t, past which each kernel moves t's
        pointer per group before it reads or writes t: "rows" (a group's) and "hidden" for
        a tensor of every row, "rows" for a per-row one, "hidden" for columns per group
        ([batch, hidden]), none for one value per group ([batch, 1]); None where t is not
        per group (a [hidden] column input, a value of no dimension, or no groups)."""
        groups = set(self.row_axes[:self.group_axes])
        if not groups & set(spanned_axes(t)):
            return None
        return {Role.FULL: ("rows", "hidden"), Role.ROW: ("rows",), Role.COL: ("hidden",),
                Role.SCALAR: ()}[self.roles[t]]

    @property
    def group_values(self) -> tuple[Tensor, ...]:
        """The value inputs that hold one value per group ([batch, 1] beside reductions over
        the sequence of [batch, seq, hidden]): each kernel moves their pointers to its
        group's value before it reads them."""
        return tuple(t for t in self.value_inputs if self.group_part(t) is not None)

    @property
    def group_columns(self) -> tuple[Tensor, ...]:
        """The column inputs that hold a row of columns per group ([batch, hidden] beside
        reductions over the sequence of [batch, seq, hidden]): each kernel moves their
        pointers to its group's row, as it moves the full tensors' to the group's rows."""
        return tuple(t for t in self.col_inputs if self.group_part(t) is not None)

    @property
    def row_passes(self) -> int:
        """Passes of a row kernel over each row: one per inner reduction level, then one that
        writes the full outputs and feeds the column accumulators, where there are any (a
        fusion whose outputs are per-row values has nothing to do in it)."""
        last = bool(self.outputs(Role.FULL) or self.outer_reductions)
        return len(self.inner_levels) + int(last)

    @property
    def row_buffer_bytes(self) -> int:
        """Bytes of one row of every full input, per hidden element."""
        return sum(t.dtype.itemsize for t in self.full_inputs)

    def describe(self) -> str:
        names = lambda ts: ", ".join(f"{t.name}:{t.dtype.label}" for t in ts) or "-"  # noqa: E731
        lines = [
            f"kind:              {self.kind.value}",
            f"full inputs:       {names(self.full_inputs)}",
            f"row inputs:        {names(self.row_inputs)}",
            f"column inputs:     {names(self.col_inputs)}",
            f"scalar inputs:     {names(self.scalar_inputs)}",
            f"persistent:        {names(self.persistent)}",
        ]
        if self.group_axes:
            lines.append(f"groups:            row axes 0..{self.group_axes - 1} of "
                         f"{len(self.row_axes)} (the column reductions' results are per group: "
                         "each group's rows run in a grid row of blocks of their own)")
        if self.repeated:
            lines.append("repeated inputs:   " + ", ".join(
                f"{t.name}:{t.dtype.label} (row axes {r.first}..{r.stop - 1} of "
                f"{len(self.row_axes)}, read again along the others)" for t, r in self.repeated))
        if self.value_inputs:
            per_group = (" (one a group)" if self.group_values else "")
            lines.append(f"value inputs:      {names(self.value_inputs)} (no dimension: one "
                         f"value, read once{per_group})")
        if strided := strided_inputs(self.fusion):
            lines.append(f"strided inputs:    {names(strided)} (copied to contiguous arrays "
                         "when passed strided; a permuted view by fuser's permute kernel)")
        for i, level in enumerate(self.inner_levels):
            lines.append(
                f"inner level {i}:     "
                + ", ".join(f"{e.op}({e.inputs[0].name})->{e.outputs[0].name}" for e in level)
            )
        if self.kind is Kind.OUTER_NORM:
            for i, level in enumerate(self.outer_levels):
                lines.append(
                    f"outer level {i}:     "
                    + ", ".join(f"{e.op}({e.inputs[0].name})->{e.outputs[0].name}" for e in level)
                )
        elif self.outer_reductions:
            lines.append(
                "outer reductions:  "
                + ", ".join(f"{e.op}({e.inputs[0].name})->{e.outputs[0].name}"
                            for e in self.outer_reductions)
            )
        outs = [f"{o.name}:{self.roles[o].value}" for o in self.fusion.outputs]
        lines.append(f"outputs:           {', '.join(outs)}")
        return "\n".join(lines)


def analyze(fusion: Fusion) -> FusionInfo:
    """Classify `fusion`; raise UnsupportedFusionError naming what this version cannot do."""
    lowered = lower(fusion)
    _check_no_layout_ops(lowered)
    row_axes, hidden_axis = axes(lowered)
    groups = group_axes(lowered, row_axes, hidden_axis)
    roles = {v: _role(v, row_axes, hidden_axis, groups) for v in lowered.vals}
    _check_inputs_and_outputs(lowered, roles, row_axes[:groups])
    _check_row_sizes(lowered, row_axes, groups)
    reductions = _Reductions(lowered, roles, row_axes, hidden_axis, groups)
    inner, outer, level = reductions.inner, reductions.outer, reductions.level
    levels: dict[int, list[Expr]] = {}
    for lv, e in inner:
        levels.setdefault(lv, []).append(e)
    kind = {
        (False, False): Kind.POINTWISE,
        (True, False): Kind.INNER,
        (False, True): Kind.OUTER,
        (True, True): Kind.INNER_OUTER,
    }[(bool(inner), bool(outer))]
    if reductions.full_after_outer:
        if inner:
            v = reductions.full_after_outer[0]
            raise UnsupportedFusionError(
                f"{v.name} ({roles[v].value}) uses the result of an outer reduction in a fusion "
                "with inner reductions: no one kernel normalizes along rows and columns")
        kind = Kind.OUTER_NORM
    inputs = [t for t in lowered.inputs if isinstance(t, Tensor)]
    if groups:
        _check_groups(lowered, roles, row_axes[:groups])
    repeated = _repeated(lowered, row_axes, kind, groups)
    full_inputs = tuple(t for t in inputs if roles[t] is Role.FULL)
    inner_exprs = {e for _, e in inner}
    return FusionInfo(
        fusion=lowered,
        kind=kind,
        roles=roles,
        row_axes=row_axes,
        hidden_axis=hidden_axis,
        full_inputs=full_inputs,
        col_inputs=tuple(t for t in inputs if roles[t] is Role.COL),
        row_inputs=tuple(t for t in inputs if roles[t] is Role.ROW),
        value_inputs=tuple(t for t in inputs if roles[t] is Role.SCALAR),
        scalar_inputs=tuple(s for s in lowered.inputs if isinstance(s, Scalar)),
        inner_levels=tuple(tuple(levels[k]) for k in sorted(levels)),
        outer_reductions=tuple(outer),
        level=level,
        after_outer=frozenset(reductions.after_outer),
        outer_levels=reductions.outer_levels(),
        persistent=tuple(t for t in full_inputs
                         if _phases_using(t, lowered, level, inner_exprs) > 1),
        repeated=repeated,
        group_axes=groups,
    )


def group_axes(lowered: Fusion, row_axes: tuple[Extent, ...], hidden: Extent | None) -> int:
    """How many leading row axes the fusion's outer reductions keep: g where every reduction
    of a full tensor that is not over the hidden axis reduces row_axes[g:] exactly, g >= 1;
    0 where they reduce every row axis (or there are none, or they disagree: _is_inner
    refuses those)."""
    kept = set()
    for e in lowered.exprs:
        if e.op not in REDUCTIONS:
            continue
        reduced = reduced_axes(e)
        if reduced == {hidden} or not reduced or not reduced <= set(row_axes):
            continue
        first = min(row_axes.index(a) for a in reduced)
        if reduced != set(row_axes[first:]):
            return 0
        kept.add(first)
    return kept.pop() if len(kept) == 1 else 0


def _check_groups(lowered: Fusion, roles: dict, groups: tuple[Extent, ...]) -> None:
    """What a fusion of per-group column reductions may hold besides them (a normalization
    by them is an outer-persistent kernel per group): no output of the hidden axis only
    (each group's finalize or slab would write it). Inputs of the groups' columns and values
    are read per group (FusionInfo.group_columns, group_values); a value of the groups only
    is such an input or computed from them (a reduction to one is refused as a reduction
    neither inner nor outer, _Reductions), and outputs of one are refused with the others of
    no dimension (_check_inputs_and_outputs)."""
    spans = set(groups)
    for v in lowered.vals:
        if not isinstance(v, Tensor):
            continue
        rows = {a for a in spanned_axes(v) if a in spans}
        if v in lowered.outputs and roles[v] is Role.COL and rows != spans:
            raise UnsupportedFusionError(
                f"output {v.name} spans the hidden dimension only, beside column reductions "
                "per group of the leading dimensions: every group would write it")


def _repeated(lowered: Fusion, row_axes: tuple[Extent, ...], kind: Kind,
              groups: int = 0) -> tuple[tuple[Tensor, RowRun], ...]:
    """Each input that spans a run of the row axes only, with its run (axes() checked that
    every tensor of some row axes spans a run). A value of such an input that spans some
    row axes only is computed for every row of the kernel, as it repeats: an output of it
    would be written once per repeat, so it is refused (the segmentation copies the input
    broadcast instead); a reduction over some row axes only is refused by _is_inner. The
    row kernels and the pointwise kernel read repeated rows; the column kernels of outer
    reductions do not. A column value per group (the `groups` leading row axes and the
    hidden one) is not repeated: each group's finalize writes its own."""
    rows = set(row_axes)
    groups_span = list(row_axes[:groups]) if groups else None
    runs = []
    for v in lowered.vals:
        if not isinstance(v, Tensor):
            continue
        span = [a for a in spanned_axes(v) if a in rows]
        if not span or len(span) == len(row_axes) or span == groups_span:
            continue
        if v in lowered.outputs:
            raise UnsupportedFusionError(
                f"output {v.name} spans {len(span)} of the {len(row_axes)} row dimensions: a "
                "kernel over every row would write it once per row of the others")
        if v in lowered.inputs:
            first = row_axes.index(span[0])
            runs.append((v, RowRun(first, first + len(span))))
    if runs and (kind in (Kind.OUTER, Kind.OUTER_NORM) or groups):
        raise UnsupportedFusionError(
            f"{runs[0][0].name} spans some of the row dimensions only, in an outer reduction "
            "over the rows: the column kernels read every row of each input")
    return tuple(runs)


def _role(v: Val, row_axes: tuple[Extent, ...], hidden_axis: Extent | None,
          groups: int = 0) -> Role:
    """A value's role from the axes it spans (axes() checked they are all rows, or none); of
    the first `groups` row axes only (and the hidden one), a column per group: COL."""
    if not isinstance(v, Tensor):
        return Role.SCALAR
    spans = set(spanned_axes(v))
    if groups and spans & set(row_axes) == set(row_axes[:groups]):
        # a value per group: read once per kernel, at its group (a value input), as a
        # scalar; _check_groups refuses one computed by a reduction
        return Role.COL if hidden_axis in spans else Role.SCALAR
    # without row axes the fusion is one row: a tensor along the hidden axis is that row, a
    # tensor of no axis (a full reduction's result) its per-row value; a tensor of some row
    # axes only repeats along the others (RowRun)
    has_row = not row_axes or bool(set(row_axes) & spans)
    has_hidden = hidden_axis is not None and hidden_axis in spans
    return {
        (True, True): Role.FULL,
        (True, False): Role.ROW,
        (False, True): Role.COL,
        (False, False): Role.SCALAR,
    }[(has_row, has_hidden)]


def strided_inputs(fusion: Fusion) -> tuple[Tensor, ...]:
    """Tensor inputs declared non-contiguous (a False in their contiguity): the kernels read
    contiguous rows, so execute() copies an array passed for one that is not contiguous into
    a contiguous one first (one read and one write of it)."""
    return tuple(t for t in fusion.inputs
                 if isinstance(t, Tensor) and any(c is False for c in t.contiguity))


def _check_no_layout_ops(lowered: Fusion) -> None:
    for e in lowered.exprs:
        if e.op in LAYOUT_OPS:
            raise UnsupportedFusionError(
                f"{e.outputs[0].name} = {e.op}({e.inputs[0].name}) moves elements to other "
                "positions, which no kernel here does; it runs between kernels")


def _check_inputs_and_outputs(lowered: Fusion, roles: dict, groups: tuple[Extent, ...] = ()
                              ) -> None:
    """Outputs of no dimension only where the fusion is one row (a full reduction's result
    is the second of its two kernels, segment.py): a kernel over rows has no place to write
    one, nor one value per group of the leading dimensions (`groups`). (An input of no
    dimension, or of the groups only, is read once, as a scalar input is.)"""
    for o in lowered.outputs:
        if roles[o] is Role.SCALAR and groups and set(spanned_axes(o)) == set(groups):
            raise UnsupportedFusionError(
                f"output {o.name} holds one value per group of the leading dimensions, beside "
                "column reductions per group: no kernel over a group's rows writes one; it "
                "runs reordered")
        if roles[o] is Role.SCALAR:
            raise UnsupportedFusionError(
                f"output {o.name} is a single value (no row or hidden dimension) that a kernel "
                "over rows would have to write: a total over every axis of a [rows, hidden] "
                "tensor, or of per-row values, runs as kernels of its own; one of column "
                "values (beside them) or of a tensor with size-1 axes between its others does "
                "not yet"
            )


def _check_row_sizes(lowered: Fusion, row_axes: tuple[Extent, ...], groups: int = 0) -> None:
    """With several row axes, a kernel knows only the product of those past the groups (its
    rows, n_rows): the size of one of them may shape a broadcast, or be a factor of a product
    that multiplies each of those once (row_counts: a mean over the leading dimensions), or
    stand alone where it is the only one (a mean over the sequence, per batch), not enter
    other arithmetic; a group's size enters none."""
    if len(row_axes) < 2:
        return
    counted = row_axes[groups:]
    counts = row_counts(lowered, counted) if len(counted) > 1 else {}
    partial = {p for factors in counts.values() for p in factors.partial}
    for v in lowered.vals:
        e = v.definition
        extent = v.extent.find() if isinstance(v, Scalar) and v.extent is not None else None
        if v in partial:
            what = f"{v.name}, a product of some of the {len(row_axes)} leading dimensions' sizes"
        elif e is not None and e.op == "size" and extent in row_axes:
            if extent in counted and len(counted) == 1:
                continue  # the kernel's n_rows
            what = (f"{v.name} = size of {e.inputs[0].name} dimension {e.attr('dim')}, one of "
                    f"the {len(row_axes)} leading dimensions,")
        else:
            continue
        group = extent in row_axes[:groups]
        used = [u.op for u in lowered.uses(v) if u.op != "broadcast_in_dim"
                and (group or not (u.op == "mul" and (u.outputs[0] in counts
                                                      or u.outputs[0] in partial)))]
        if used:
            raise UnsupportedFusionError(
                f"{what} feeds {used[0]}: kernels over N-D rows know only the number of rows "
                "(their product, which a product of every leading size may use); flatten the "
                "leading dimensions into one, or pass the size as a scalar input"
            )


@dataclass(frozen=True)
class RowCount:
    """A product of sizes that multiplies every row axis once: the number of rows times
    `others` (sizes of the hidden axis or of broadcast axes); `partial` are the products
    inside it that leave a row axis out (no kernel knows those)."""

    others: tuple[Scalar, ...]
    partial: tuple[Scalar, ...]


def row_counts(fusion: Fusion, row_axes: tuple[Extent, ...]) -> dict[Scalar, RowCount]:
    """The products of sizes (mul of sizes, at any nesting) in `fusion` that hold every row
    axis exactly once, as a mean over the leading dimensions of an N-D tensor counts its
    elements (var_mean over dims [0, 1, 2] of [N, H, W, C]): a kernel over N-D rows knows the
    row count, not each leading size, and such a product is that count times the rest."""
    roots = sorted(row_axes, key=id)
    out: dict[Scalar, RowCount] = {}
    for v in fusion.vals:
        if not isinstance(v, Scalar) or v.definition is None or v.definition.op != "mul":
            continue
        factors = _size_factors(v)
        if factors is None:
            continue
        extents = [s.extent.find() if s.extent is not None else None for s in factors[0]]
        if sorted((e for e in extents if e in row_axes), key=id) == roots:
            others = tuple(s for s, e in zip(factors[0], extents, strict=True)
                           if e not in row_axes)
            out[v] = RowCount(others, factors[1])
    return {v: RowCount(c.others, tuple(p for p in c.partial if p not in out))
            for v, c in out.items()}


def _size_factors(v: Scalar) -> tuple[list[Scalar], tuple[Scalar, ...]] | None:
    """The size leaves of the mul tree `v` is (with repeats) and its inner products, or None
    where a leaf is not a size."""
    leaves: list[Scalar] = []
    products: list[Scalar] = []
    stack: list[Val] = [v]
    while stack:
        u = stack.pop()
        e = u.definition
        if not isinstance(u, Scalar) or e is None:
            return None
        if e.op == "size":
            leaves.append(u)
        elif e.op == "mul":
            if u is not v:
                products.append(u)
            stack.extend(e.inputs)
        else:
            return None
    return leaves, tuple(products)


class _Reductions:
    """The inner reductions (with their levels) and outer reductions of a lowered fusion, the
    level every value waits for, and the values computed from an outer reduction."""

    def __init__(self, lowered: Fusion, roles: dict, row_axes: tuple[Extent, ...],
                 hidden_axis: Extent | None, groups: int = 0):
        self.roles, self.row_axes, self.hidden_axis = roles, set(row_axes), hidden_axis
        self.reduced_rows = set(row_axes[groups:])  # what an outer reduction reduces
        self.level: dict[Val, int] = {}
        self.after_outer: set[Val] = set()
        self.outer_level: dict[Val, int] = {}  # outer reductions a value waits for
        self.full_after_outer: list[Val] = []  # full values computed from an outer result
        self.inner: list[tuple[int, Expr]] = []
        self.outer: list[Expr] = []
        for v in lowered.vals:
            self._visit(v)

    def _visit(self, v: Val) -> None:
        e = v.definition
        if e is None:
            self.level[v] = 0
            self.outer_level[v] = 0
            return
        lv = max((self.level[i] for i in e.inputs), default=0)
        self.outer_level[v] = max((self.outer_level[i] for i in e.inputs), default=0)
        downstream_of_outer = any(i in self.after_outer for i in e.inputs)
        if e.op in REDUCTIONS:
            if self._is_inner(e):
                if downstream_of_outer:
                    raise UnsupportedFusionError(
                        f"{e.outputs[0].name}: an inner reduction of an outer reduction's result"
                    )
                if v is e.outputs[0]:
                    self.inner.append((lv, e))
                lv += 1
            else:
                if v is e.outputs[0]:
                    self.outer.append(e)
                self.outer_level[v] += 1
                downstream_of_outer = True
        self.level[v] = lv
        if downstream_of_outer:
            self.after_outer.add(v)
            if self.roles[v] is Role.ROW:
                raise UnsupportedFusionError(
                    f"{v.name} (row) uses the result of an outer reduction: a per-row value "
                    "of per-column results is not supported"
                )
            if self.roles[v] is Role.FULL:
                self.full_after_outer.append(v)

    def outer_levels(self) -> tuple[tuple[Expr, ...], ...]:
        """The outer reductions grouped by how many outer reductions their operand waits for."""
        levels: dict[int, list[Expr]] = {}
        for e in self.outer:
            levels.setdefault(self.outer_level[e.inputs[0]], []).append(e)
        return tuple(tuple(levels[k]) for k in sorted(levels))

    def _is_inner(self, e: Expr) -> bool:
        """True for a reduction over the hidden axis, False over the rows; anything else is
        refused."""
        src = as_tensor(e.inputs[0])
        reduced = set(reduced_axes(e))
        if self.roles[src] is Role.FULL and reduced in ({self.hidden_axis}, self.reduced_rows):
            return reduced == {self.hidden_axis}
        raise UnsupportedFusionError(
            f"{e.op}({src.name}, dims={list(e.attr('dims'))}): only reductions of a "
            "[rows, hidden] tensor over its hidden dimension (inner) or over its rows "
            "(outer) are supported"
        )


def _phases_using(t: Tensor, fusion: Fusion, level: dict, inner: set) -> int:
    """In how many phases of a row `t` is read: phase k feeds inner level k, the last phase
    writes outputs and feeds outer reductions. More than one means the row must be kept."""
    final = max(level.values(), default=0) + 1
    phases: set[int] = set()
    stack: list[Val] = [t]
    seen: set[Val] = {t}
    while stack:
        v = stack.pop()
        if v in fusion.outputs:
            phases.add(final)
        for e in fusion.uses(v):
            if e.op in REDUCTIONS:
                phases.add(level[e.inputs[0]] if e in inner else final)
                continue
            for o in e.outputs:
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return len(phases)


def operands(e: Expr) -> tuple[Val, ...]:
    """The values an expression computes from: a broadcast's shape sizes only describe it."""
    return e.inputs[:1] if e.op == "broadcast_in_dim" else tuple(e.inputs)


def per_row(info: FusionInfo) -> set[Val]:
    """Computed values that are the same along a row: per-row values, and values computed
    from them and scalars alone (a row statistic broadcast over the row, then transformed:
    1 / rms). The kernel computes each once per row, not once per element."""
    out: set[Val] = set()
    for v in info.fusion.vals:
        e = v.definition
        if e is None or e.op in REDUCTIONS or e.op == "size":
            continue
        if info.roles[v] is not Role.SCALAR and all(
                info.roles[i] in (Role.ROW, Role.SCALAR) or i in out for i in e.inputs):
            out.add(v)
    return out


# Ops worth keeping in registers from one pass over a row to a later one instead of computing
# them again: each takes the special-function pipe (ex2, lg2, tanh, rcp) or a long polynomial
# per element, where a kept value costs a register per element a thread owns.
COSTLY_OPS = frozenset({"exp", "log", "tanh", "sigmoid", "silu", "erf", "log1p", "expm1",
                        "softplus", "pow"})


def _pass_roots(info: FusionInfo) -> list[list[Val]]:
    """What each pass over a row computes: the operands of inner level k's reductions, then
    (the last pass) the full outputs and the operands of the column reductions."""
    roots = [[e.inputs[0] for e in level] for level in info.inner_levels]
    if info.row_passes > len(roots):
        roots.append([*info.outputs(Role.FULL), *(e.inputs[0] for e in info.outer_reductions)])
    return roots


def kept_values(info: FusionInfo) -> tuple[Val, ...]:
    """Element values made by a COSTLY_OPS op that a pass over the row computes and a later
    pass needs again (softmax's exp(x - max): the sum's pass and the output's), in the order
    they are first computed. A row kernel may keep them in registers between the passes.
    Each pass is walked from its roots down; a value an earlier pass computed stops the walk
    there when it is costly (it would be kept), and is computed again otherwise."""
    rows = per_row(info)
    first: dict[Val, int] = {}
    kept: list[Val] = []
    for k, roots in enumerate(_pass_roots(info)):
        stack, seen = list(roots), set()
        while stack:
            v = stack.pop()
            e = v.definition
            if (v in seen or e is None or e.op in REDUCTIONS or v in rows
                    or info.roles[v] is not Role.FULL):
                continue
            seen.add(v)
            if v in kept:
                continue
            if first.get(v, k) < k and e.op in COSTLY_OPS:
                kept.append(v)
                continue
            first.setdefault(v, k)
            stack.extend(operands(e))
    return tuple(sorted(kept, key=lambda v: v.index))


def axes(fusion: Fusion) -> tuple[tuple[Extent, ...], Extent | None]:
    """The row axes (the outer dimensions, in order) and the hidden axis (the innermost) of
    the fusion's widest tensor. Every tensor spans all of them (a row tensor), the row axes
    only (per-row values, [batch, seq] or [batch, seq, 1]), the hidden axis only (per-column
    values) or none: rows are the row axes flattened, so [batch, seq, hidden] runs as
    [batch * seq, hidden] with the same kernels."""
    tensors = [v for v in fusion.vals if isinstance(v, Tensor)]
    spans = {t: spanned_axes(t) for t in tensors}
    widest = max(tensors, key=lambda t: len(spans[t]), default=None)
    if widest is None or not spans[widest]:
        return (), None
    axes = spans[widest]
    if len(axes) == 1:
        roots = {e for s in spans.values() for e in s}
        if len(roots) > 1:
            raise UnsupportedFusionError(
                "the fusion combines unrelated 1-D tensors; give them a common [rows, hidden] "
                "shape with broadcast_in_dim"
            )
        return (), axes[0]
    if len(set(axes)) != len(axes):
        raise UnsupportedFusionError(
            f"{widest.name} has two dimensions the definition made one size: a per-row value "
            "was broadcast along the last dimension (numpy aligns trailing dimensions, so "
            "x - sum(x, dims=[1]) needs x square); keep it per row with keepdim=True or "
            "broadcast_in_dim(..., broadcast_dims=[0])"
        )
    row_axes, hidden = axes[:-1], axes[-1]
    for t in tensors:
        if spans[t] not in ((), (hidden,), row_axes, axes) and not _is_run(spans[t], axes):
            raise UnsupportedFusionError(
                f"{t.name} spans {len(spans[t])} of the fusion's {len(axes)} dimensions in "
                f"another way than its rows and hidden size ({', '.join(map(str, axes))}): "
                "fuser runs tensors of all the dimensions, of the leading ones (per-row "
                "values), of a run of the leading ones with or without the last one, or of "
                "the last one (per-column values), in that order; the "
                "segmentation reorders the axes, copies inputs broadcast and cuts the fusion "
                "where that helps (fuser/reorder.py, fuser/segment.py), which it did not here"
            )
    return row_axes, hidden


def _is_run(span: tuple[Extent, ...], axes: tuple[Extent, ...]) -> bool:
    """Whether `span` is consecutive leading (row) axes of `axes`, with or without its last
    (hidden) axis after them: an input a kernel reads repeated (RowRun)."""
    run = span[:-1] if span and span[-1] == axes[-1] else span
    if not run or axes[-1] in run or any(a not in axes for a in run):
        return False
    first = axes.index(run[0])
    return tuple(axes[first:first + len(run)]) == tuple(run)
