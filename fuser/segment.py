"""Segmentation: a fusion that no single kernel can run, split into a chain of kernels.

A row kernel sweeps the rows once: inner reductions (along a row) at any depth, outer
reductions (over the rows, per column) finished after the sweep. A value computed from an
outer reduction's result therefore needs another sweep: softmax over dim 0, BatchNorm-style
statistics then the normalization, a row normalization followed by a column one. segment()
cuts the lowered fusion there. Each segment is an ordinary fusion, scheduled by the existing
schedulers; reduction results and the fusion's outputs are written to global memory by the
segment that computes them and read by the later ones that need them. Any other value is
recomputed in each segment that uses it, from that segment's inputs: an [R, H] intermediate
would cost a write and a read of the whole tensor, recomputing it one more read of what it
is made of.

The stage of a value: 0 for inputs and constants; an outer reduction's result is one past its
operand's stage, and so is a layout op's (permute, reshape: fuser/layouts.py) where a kernel
computes its operand; any other value takes the largest stage of its operands. Segment k computes
the reductions whose operand is at stage k (an inner one's result is at stage k too, an outer
one's at k + 1) and the fusion outputs at stage k.

Before it is cut, a fusion whose axes fit rows and a hidden axis only in another order (or
with inputs copied broadcast) is written again in that order (fuser/reorder.py). A fusion with
layout ops is cut at those alone first, where every segment between them is one kernel chain
(an outer normalization between reshape views: one column kernel). Where the cut at the
reductions over the rows leaves a segment no kernel runs, the fusion is cut after every
reduction instead; and a segment no kernel runs may run as segments of its own, one level
deep (a segment after a layout op, which the reordering of the whole fusion does not reach).

Inside a kernel a Half or BFloat16 value is a float, rounded only where it is stored or cast;
a value carried from one segment to the next must not be rounded either. So a reduction whose
result type is Half or BFloat16 is computed as a Float one, the values made from it are Float
too, and the outputs are cast back to the user's types; a Half or BFloat16 output that is not
a cast is recomputed, not read, by a later segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fuser import layouts, reorder
from fuser.analysis import analyze
from fuser.dtypes import DataType
from fuser.errors import HintError, InternalError, UnsupportedFusionError
from fuser.ir import (
    Expr,
    Fusion,
    Scalar,
    Tensor,
    Val,
    as_tensor,
    rounding_cast,
    spanned_axes,
)
from fuser.lowering import copy_expr, define_like, equate_extents, lower
from fuser.ops import ELEMENTWISE, LAYOUT_OPS, REDUCTIONS

if TYPE_CHECKING:
    from fuser.frontend import FusionDefinition
    from fuser.shapes import Sizes


Cuts = Literal["layouts", "rows", "every"]  # where stages() cuts, fewest cuts first


@dataclass(frozen=True, eq=False)
class Segment:
    """One kernel chain of a segmented fusion: `definition` (a FusionDefinition of its own)
    reads `inputs` and writes `outputs`, values of the lowered fusion."""

    index: int
    definition: FusionDefinition  # executor.execute runs it like any other
    inputs: tuple[Val, ...]
    outputs: tuple[Val, ...]
    why: str

    def arguments(self, values: dict[Val, Any], sizes: Sizes | None = None) -> list:
        """The segment's inputs, from `values` (the fusion's inputs and what earlier segments
        wrote, by value of the lowered fusion): a size it takes as a scalar input is the
        bound size of its extent where `sizes` (the lowered fusion's) has it, else read off
        the shape of a tensor there with the same extent."""
        return [values[v] if v in values else _size_from(v, values, sizes)
                for v in self.inputs]

    def __str__(self) -> str:
        names = ", ".join(v.name for v in self.outputs)
        reads = ", ".join(v.name for v in self.inputs)
        return f"segment {self.index} ({self.definition.name}): {reads} -> {names}: {self.why}"


@dataclass(frozen=True, eq=False)
class Segmentation:
    """The lowered fusion (its inputs and outputs in the user's order), its segments, and the
    layout ops (permute, reshape) made between them, in definition order: each as soon as its
    operand exists (an input, or a value a segment wrote)."""

    lowered: Fusion
    segments: tuple[Segment, ...]
    layouts: tuple[Expr, ...] = ()
    # why one kernel does not run it, where that depends on the sizes (columns too tall for
    # the outer-persistent kernel); the analysis' reason otherwise
    refusal: str = ""
    # the order of axes the fusion runs in where it is not its own, and the inputs expanded
    # (reorder.explain_order)
    order: str = ""

    def __str__(self) -> str:
        count = f"{len(self.segments)} segment{'' if len(self.segments) == 1 else 's'}"
        if self.refusal:
            head = f"runs as {count} ({self.refusal})"
        elif self.order:
            head = f"runs as {count} ({self.order})"
        elif self.layouts:
            head = (f"runs as {count} (permute and reshape move elements, which no kernel "
                    "does: they run between kernels)")
        elif len(self.segments) == 1:  # e.g. what one kernel could not run, no output needs
            head = ("runs as 1 segment (a copy of the fusion with only what its outputs need, "
                    "which one kernel can run)")
        else:
            head = (f"runs as {count} (no single kernel can: a value needs a reduction's "
                    "results from other rows)")
        head += ":"
        lines = [head] + [str(s) for s in self.segments]
        lines += [f"between kernels: {layouts.describe(e)}" for e in self.layouts]
        return "\n  ".join(lines)

    def hint_error(self, name: str) -> HintError:
        """Why hints are refused for fusion `name` (executor and explain raise it)."""
        return HintError(f"fusion '{name}' {self}\nhints steer one kernel chain: pass "
                         "hints=None (each segment is scheduled by the heuristic)")


@dataclass(frozen=True, eq=False)
class SegmentSchedules:
    """fd.last_schedule() of a segmented fusion: each segment and the schedule it ran with."""

    segments: tuple[Segment, ...]
    schedules: tuple[object, ...]

    def __str__(self) -> str:
        return "\n".join(f"{segment}\n    {schedule}"
                         for segment, schedule in zip(self.segments, self.schedules, strict=True))


def _size_from(size: Val, values: dict[Val, Any], sizes: Sizes | None = None) -> int:
    extent = _extent_of(size)
    if extent is None:
        return 1
    if extent.value is not None:  # a constant size (a broadcast to 4 columns)
        return int(extent.value)
    bound = sizes.known(extent) if sizes is not None else None
    if bound is not None:  # no search of the values' shapes (a third of a small call's time)
        return bound
    found = _dim_of(size, values)
    if found is None:
        raise InternalError(f"segment input {size.name}: no tensor of its extent was passed")
    return int(values[found[0]].shape[found[1]])


def is_outer(e: Expr) -> bool:
    """A reduction over leading (row) axes that keeps the last one: finished after a sweep."""
    if e.op not in REDUCTIONS:
        return False
    t = as_tensor(e.inputs[0])
    return t.ndim > 0 and (t.ndim - 1) not in e.attr("dims")


def stages(fusion: Fusion, cuts: Cuts = "rows") -> dict[Val, int]:
    """The stage of every value of `fusion` (see the module docstring), cut where `cuts`
    says, fewest cuts first: "layouts", only after a layout op whose operand a kernel computes;
    "rows", also at the reductions over the rows; "every", also after every reduction (its
    result one past its operand's stage, as an outer one's). A per-row result of
    an inner reduction (keepdim=False, or a keepdim one squeezed) that an elementwise op meets
    with a tensor of higher rank is aligned, as numpy aligns, with the trailing axes:
    `x - sum(x, dims=[1])` subtracts row j's sum from column j, so every row sum must exist
    first, and that op is one stage later, as if the sum were an outer reduction; so is a
    broadcast_in_dim that lays such a result along the columns. A reduction of such results
    over the rows (the second half of a full reduction, analysis._reduction) is one stage
    later too, and its result is one value of the whole tensor: what meets a tensor of any
    dimension with it is later again."""
    stage: dict[Val, int] = {v: 0 for v in fusion.vals if v.definition is None}
    per_row: set[Val] = set()  # inner reductions' rank-reduced results, and values of them
    kept: set[Val] = set()  # inner reductions' keepdim results, and values of them
    whole: set[Val] = set()  # full reductions' results, and values of them of no dimension
    for e in fusion.exprs:
        out = e.outputs[0]
        if e.op in LAYOUT_OPS:  # made after the segment that writes its operand
            written = layouts.kernel_made(e.inputs[0])
            stage[out] = max(stage[i] for i in e.inputs) + (1 if written else 0)
            continue
        rank = _rank(out)
        of_whole = any(i in whole for i in e.inputs)
        # a reduction of per-row results (kept or not) is one value, or (over N-D rows) per
        # row of fewer rows
        across = e.op in REDUCTIONS and (e.inputs[0] in per_row or e.inputs[0] in kept)
        lifted = ((e.op in ELEMENTWISE and any(i in per_row and _rank(i) < rank
                                               for i in e.inputs))
                  or _across_rows(e, per_row) or across or (of_whole and _span(out) > 0))
        cut = cuts != "layouts" and (is_outer(e) or lifted
                                     or (cuts == "every" and e.op in REDUCTIONS))
        s = max((stage[i] for i in e.inputs), default=0) + (1 if cut else 0)
        for o in e.outputs:
            stage[o] = s
        if (across or of_whole) and _span(out) == 0:
            whole.add(out)
            continue
        inner = e.op in REDUCTIONS and not is_outer(e)
        same_rank = (e.op in ELEMENTWISE or e.op == "cast")
        widened = (e.op == "broadcast_in_dim" and e.inputs[0] in per_row
                   and _span(out) == _span(e.inputs[0]))  # size-1 axes added (unsqueeze)
        if (inner and e.attr("keepdim")) or widened or (same_rank and any(
                i in kept and _rank(i) == rank and _span(i) == _span(out) for i in e.inputs)):
            kept.add(out)
        reduced_row = inner and not e.attr("keepdim")
        of_reduced_rows = same_rank and any(i in per_row and _rank(i) == rank for i in e.inputs)
        squeezed_row = e.op == "squeeze" and (e.inputs[0] in kept or e.inputs[0] in per_row)
        if reduced_row or of_reduced_rows or squeezed_row:
            per_row.add(out)
    return stage


def _span(v: Val) -> int:
    """The dimensions of `v` that are not broadcast (size 1)."""
    return sum(d is not None for d in v.dims) if isinstance(v, Tensor) else 0


def _across_rows(e: Expr, per_row: set[Val]) -> bool:
    """A broadcast_in_dim that lays a per-row value along other axes than the row axes it came
    from (broadcast_dims [1] for a [rows] sum): as numpy's alignment, a column of row sums."""
    if e.op != "broadcast_in_dim" or e.inputs[0] not in per_row:
        return False
    return list(e.attr("broadcast_dims")) != list(range(_rank(e.inputs[0])))


def _rank(v: Val) -> int:
    return v.ndim if isinstance(v, Tensor) else 0


def segment(fusion: Fusion, name: str, reason: UnsupportedFusionError,
            nested: bool = False) -> Segmentation:
    """`fusion` cut into segments that each run as one kernel chain (one segment where a copy
    with only what the outputs need runs: the values one kernel could not run were ones no
    output needs), or (unless `nested`) as a segmentation of its own: a segment after a
    layout op or a cut, which the reordering of the whole fusion does not reach (the peaks
    of [batch, seq, hidden] over seq, which a later segment subtracts: rows [batch, hidden]
    along seq), reordered itself.
    Raises `reason` (why one kernel cannot run it) when that does not help, with a note where
    a segment cannot run either. Where cutting at the reductions over the rows does not help,
    cutting after every reduction is tried before that: each reduction's result written by
    the segment that sweeps its operand, so that a later one reducing over other axes reads
    it as an input (the row sums of [A, B, C], then sums over A of what they centred)."""
    widened = _widened(lower(fusion))
    order = reorder.order_of(widened)
    moved = reorder.rewritten(widened, order)
    lowered = layouts.on_inputs(moved)
    why = "" if order is None or moved is widened else reorder.explain_order(widened, order)
    # (fusion, why, nested, cuts), tried in this order; the cut at the rows' refusal is raised
    attempts: list[tuple[Fusion, str, bool, Cuts]] = []
    grouped = reorder.grouped_order(widened, order)
    if grouped is not None:  # taken where every segment is then one kernel chain
        attempts.append((layouts.on_inputs(reorder.rewritten(widened, grouped)),
                         reorder.explain_order(widened, grouped), True, "layouts"))
    views = bool(layouts.needed(lowered))
    if views:  # every segment one kernel chain, none segmented again
        attempts.append((lowered, why, True, "layouts"))
    attempts += [(lowered, why, nested, "rows"), (lowered, why, nested, "every")]
    if views and not nested:  # the segments between the layout ops, each reordered on its own
        attempts.append((lowered, why, False, "layouts"))
    refused: UnsupportedFusionError | None = None
    for candidate, explained, inner, cuts in attempts:
        try:
            return _segmented(candidate, explained, name, reason, nested=inner, cuts=cuts)
        except UnsupportedFusionError as exc:
            if cuts == "rows":
                refused = exc
    assert refused is not None
    raise refused from None


def _segmented(lowered: Fusion, order: str, name: str, reason: UnsupportedFusionError,
               nested: bool, cuts: Cuts) -> Segmentation:
    """segment() of the lowered (and reordered: `order` says how) fusion, cut where `cuts`
    (stages) says."""
    from fuser.frontend import FusionDefinition

    stage = stages(lowered, cuts)
    home = _homes(lowered, stage, cuts == "every")
    last = max(home.values(), default=0)
    demanded: dict[int, list[Val]] = {k: [] for k in range(last + 1)}
    moves = layouts.needed(lowered)
    for v in layouts.kernel_operands(moves):
        demanded[home[v]].append(v)
    built: list[Segment] = []
    for k in range(last, -1, -1):
        outputs = list(dict.fromkeys(
            [o for o in lowered.outputs if home.get(o) == k] + demanded[k]))
        if not outputs:
            continue
        groups = _groups(lowered, outputs, home, k)
        for part, group in reversed(list(enumerate(groups))):  # built is reversed at the end
            sub, inputs = _extract(lowered, group, home, k)
            for v in inputs:
                if v not in lowered.inputs and v in home:  # else a size (Segment.arguments)
                    demanded[home[v]].append(v)  # or a layout op's result (layouts)
            sub.closed_by = f"segment {k} of FusionDefinition {name!r}"
            suffix = f"_s{k}" if len(groups) == 1 else f"_s{k}_{part}"
            definition = FusionDefinition.from_fusion(sub, _segment_name(name, suffix))
            built.append(Segment(k, definition, tuple(inputs), tuple(group),
                                 _why(k, inputs, lowered)))
    segments = tuple(_renumbered(reversed(built)))
    _check_each_runs(name, segments, reason, nested,
                     cut=len(segments) > 1 or (cuts == "layouts" and bool(moves)))
    return Segmentation(lowered, segments, tuple(moves), order=order)


def _segment_name(name: str, suffix: str) -> str:
    """`name` with the segment's suffix, cut to fit check_name's limit (the kernel cache and
    FUSER_DUMP_DIR tell sources apart by their hash, not by this name)."""
    from fuser.frontend import MAX_NAME_LENGTH

    return name[:MAX_NAME_LENGTH - len(suffix)] + suffix


def _groups(f: Fusion, outputs: list[Val], home: dict[Val, int], k: int) -> list[list[Val]]:
    """The outputs of stage k in one group where one kernel chain computes them all; else in
    groups that share no axis (a total's row results beside a column value: rows of one size
    and columns of another meet in no tensor), each a segment of its own; a group that one
    kernel still cannot run is split by the innermost axis of its outputs' widest tensors (x
    beside its transpose, made between kernels: the same axes, rows and columns swapped), and
    one that still cannot into its outputs, each a segment of its own (reductions of one
    tensor along different axes, [A, B, C] summed over C and over B: each segment reads the
    tensor, and is reordered where it needs it)."""
    if _runs(f, outputs, home, k):
        return [outputs]
    axes = {o: _axes_touched(f, o, home, k) for o in outputs}
    groups: list[list[Val]] = []
    for o in outputs:
        joined = [g for g in groups if any(axes[o] & axes[p] for p in g)]
        merged = [p for g in joined for p in g] + [o]
        groups = [g for g in groups if g not in joined] + [merged]
    split: list[list[Val]] = []
    for g in groups:
        if len(g) == 1 or _runs(f, g, home, k):
            split.append(g)
            continue
        by_axis: dict[Any, list[Val]] = {}
        for o in g:
            by_axis.setdefault(_innermost_axis(f, o, home, k), []).append(o)
        for part in by_axis.values():
            if len(part) > 1 and not _runs(f, part, home, k):
                split.extend([o] for o in part)
            else:
                split.append(part)
    ordered = [sorted(g, key=outputs.index) for g in split]
    return sorted(ordered, key=lambda g: outputs.index(g[0]))


def _runs(f: Fusion, outputs: list[Val], home: dict[Val, int], k: int) -> bool:
    """Whether one kernel chain computes `outputs` in segment k."""
    try:
        analyze(_extract(f, outputs, home, k)[0])
        return True
    except UnsupportedFusionError:
        return False


def _innermost_axis(f: Fusion, output: Val, home: dict[Val, int], k: int):
    """The innermost extent of the widest tensor segment k computes or reads for `output`."""
    needed, reads, _ = _segment_values(f, [output], home, k)
    tensors = [v for v in (*needed, *reads, output) if isinstance(v, Tensor) and _span(v)]
    if not tensors:
        return None
    widest = max(tensors, key=lambda t: (_span(t), -t.index))
    return [e for e in widest.dims if e is not None][-1].find()


def _axes_touched(f: Fusion, output: Val, home: dict[Val, int], k: int) -> set:
    """The extents of every tensor segment k would compute or read for `output` alone."""
    needed, reads, _ = _segment_values(f, [output], home, k)
    return {e.find() for v in (*needed, *reads, output) if isinstance(v, Tensor)
            for e in v.dims if e is not None}


def _check_each_runs(name: str, segments: tuple[Segment, ...],
                     reason: UnsupportedFusionError, nested: bool, cut: bool) -> None:
    """Raise, at definition time rather than half-way through a run, when a segment is still
    one that no kernel chain runs (a reduction over some of the row axes, rows of unrelated
    sizes...) nor (unless `nested`) a segmentation of its own, which the executor and
    explain() run and show as they do any fusion's: the whole fusion's reason, then the
    segment's; the reason alone where nothing was `cut` (one segment, no layout op between
    kernels: the fusion without the values no output needs). One segment of the cut at the
    layout ops is a fusion without them, which may be reordered where the whole one was not
    (GroupNorm over channels-last [N, H * W, G, C / G] views: rows [N, G] moved together)."""
    for s in segments:
        try:
            analyze(s.definition.fusion)
        except UnsupportedFusionError as exc:
            if not nested and cut and _segments_itself(s, exc):
                continue
            if not cut:
                raise reason from None
            raise UnsupportedFusionError(
                f"{reason}\nCutting fusion {name!r} at its reductions over the rows does not "
                f"help: segment {s.index} ({', '.join(v.name for v in s.outputs)}) cannot run "
                f"as one kernel either: {exc}") from exc


def _segments_itself(s: Segment, reason: UnsupportedFusionError) -> bool:
    """Whether segment `s`, which no one kernel runs, runs as segments of its own."""
    try:
        segment(s.definition.fusion, s.definition.name, reason, nested=True)
    except UnsupportedFusionError:
        return False
    return True


_NARROW = (DataType.Half, DataType.BFloat16)


def _widened(f: Fusion) -> Fusion:
    """A copy of `f` whose Half and BFloat16 reductions give Float results (so the values
    computed from them are Float too), with each output cast back to its type where that
    changed: the same values as `f` (kernels compute Half and BFloat16 in float), but a
    reduction result written between segments keeps float precision."""
    out = Fusion()
    new: dict[Val, Val] = {}
    for v in f.vals:
        e = v.definition
        if e is None:
            new[v] = define_like(out, v, v in f.inputs)
        elif e.op in REDUCTIONS and v.dtype in _NARROW:
            new[v] = out.reduction(e.op, new[e.inputs[0]], e.attr("dims"), e.attr("keepdim"),
                                   DataType.Float)
        elif (e.op in LAYOUT_OPS and layouts.kernel_made(e.inputs[0])
              and not _readable(new[e.inputs[0]])):
            # a kernel writes its operand for it: in Float, not rounded to Half or BFloat16
            mapping = {**new, e.inputs[0]: out.cast(new[e.inputs[0]], DataType.Float)}
            copy_expr(out, e, mapping)
            new[v] = mapping[v]
        elif v is e.outputs[0]:
            copy_expr(out, e, new)
    for o in f.outputs:
        o_new = new[o]
        out.outputs.append(as_tensor(o_new if o_new.dtype is o.dtype else out.cast(o_new, o.dtype)))
    return out


def _homes(f: Fusion, stage: dict[Val, int], after_every: bool = False) -> dict[Val, int]:
    """The segment that computes each value written to global memory: an outer reduction's
    result (at its operand's stage: finished after that segment's sweep), an inner one's (at
    its own stage: a full reduction's second half is one row of the first half's results,
    after them), and each fusion output and each operand of a layout op a kernel computes (at
    its own stage; a cast of a reduction's result where the reduction is, rather than in one
    more segment). A layout op's result is made between kernels: it has no home. With
    `after_every`, every reduction's result is finished where its operand is swept."""
    home: dict[Val, int] = {}
    for e in f.exprs:
        if e.op in REDUCTIONS:
            swept = is_outer(e) or after_every
            home[e.outputs[0]] = stage[e.inputs[0] if swept else e.outputs[0]]
    written = layouts.kernel_operands(f.exprs)
    for v in written + [o for o in f.outputs if not layouts.layout_made(o)]:
        d = v.definition
        source = d.inputs[0] if d is not None and d.op == "cast" else v
        home.setdefault(v, home.get(source, stage[v]))
    return home


def _readable(v: Val) -> bool:
    """Whether a later segment may read `v` as written: not a Half or BFloat16 value that the
    store rounded (the kernel, and the oracle, use it unrounded); those are recomputed."""
    e = v.definition  # an output (_widened left no Half or BFloat16 reduction)
    return v.dtype not in _NARROW or (e is not None and rounding_cast(e))


def _extract(f: Fusion, outputs: list[Val], home: dict[Val, int],
             k: int) -> tuple[Fusion, list[Val]]:
    """The fusion segment k runs to compute `outputs`, and the values of `f` it reads: the
    fusion's inputs, the values earlier segments wrote (home before k), and the sizes it
    uses in arithmetic of tensors it reads nothing else of (the count of a mean over every
    element, in the segment that finishes the sum: scalar inputs, Segment.arguments)."""
    needed, reads, aliases = _segment_values(f, outputs, home, k)
    inputs = [v for v in f.inputs if v in reads] + [v for v in f.vals
                                                    if v in reads and v not in f.inputs]
    sub = Fusion()
    new: dict[Val, Val] = {v: define_like(sub, v, True) for v in inputs}
    for v in f.vals:
        if v in needed and v.definition is None:
            new[v] = define_like(sub, v, False)
    for e in f.exprs:
        if e.outputs[0] in aliases:
            tensor, dim = aliases[e.outputs[0]]
            new[e.outputs[0]] = sub.size(new[tensor], dim)
        elif any(o in needed for o in e.outputs):
            copy_expr(sub, e, new)
    # A value read from an earlier segment (a column of statistics written as an output) may
    # meet no other tensor here; its sizes are still those of the tensors it came from.
    equate_extents(new, f"segment {k}", _one_size_axes(f))
    sub.outputs.extend(as_tensor(new[o]) for o in outputs)
    return sub, inputs


def _segment_values(f: Fusion, outputs: list[Val], home: dict[Val, int], k: int
                    ) -> tuple[set[Val], set[Val], dict[Val, tuple[Val, int]]]:
    """(values segment k computes, values it reads, sizes it takes of another tensor it
    reads: size -> (tensor, dim)). A size that shapes a broadcast needs a tensor of its
    extent here: the one it was taken of, or (when that one is not read) one that is read;
    a size used in arithmetic only, of a tensor not read, is read as a scalar."""
    needed: set[Val] = set()
    reads: set[Val] = set()
    sizes: dict[Val, Val] = {}  # a size -> its tensor
    aliases: dict[Val, tuple[Val, int]] = {}
    stack = list(outputs)
    while stack:
        while stack:
            v = stack.pop()
            if v in needed or v in reads:
                continue
            if v in f.inputs or layouts.layout_made(v) or (home.get(v, k) < k and _readable(v)):
                reads.add(v)
            elif v.definition is not None and v.definition.op == "size":
                sizes[v] = v.definition.inputs[0]
            else:
                needed.add(v)
                stack.extend(v.definition.inputs if v.definition is not None else ())
        for v, tensor in list(sizes.items()):
            shapes = any(u.op == "broadcast_in_dim" and u.outputs[0] in needed
                         for u in f.uses(v))
            if tensor in needed or tensor in reads or shapes:
                del sizes[v]
                needed.add(v)
                alias = None if tensor in needed or tensor in reads else _dim_of(v, reads)
                if alias is not None:
                    aliases[v] = alias
                else:
                    stack.append(tensor)
    return needed, reads | set(sizes), aliases


def _extent_of(size: Val):
    return size.extent.find() if isinstance(size, Scalar) and size.extent is not None else None


def _dim_of(size: Val, tensors) -> tuple[Val, int] | None:
    """A tensor among `tensors` (in definition order) and its dimension of `size`'s extent."""
    extent = _extent_of(size)
    for t in sorted(tensors, key=lambda v: v.index):
        if extent is not None and isinstance(t, Tensor):
            for d, e in enumerate(t.dims):
                if e is not None and e.find() is extent:
                    return t, d
    return None


def _one_size_axes(f: Fusion) -> frozenset:
    """The extents `f` made one with another axis of the same tensor (x - sum(x, dims=[1]) on
    a square x): a segment equating them would make its rows its columns, so its own ops
    relate them."""
    roots = [list(spanned_axes(t)) for t in f.vals if isinstance(t, Tensor)]
    return frozenset(r for dims in roots for r in dims if dims.count(r) > 1)


def _why(k: int, inputs: list[Val], f: Fusion) -> str:
    moved = [f"{v.name} ({v.definition.op} of {v.definition.inputs[0].name})"
             for v in inputs if v.definition is not None and layouts.layout_made(v)]
    carried = [v.name for v in inputs if v not in f.inputs and isinstance(v, Tensor)
               and not layouts.layout_made(v)]
    sizes = [v.name for v in inputs if v not in f.inputs and not isinstance(v, Tensor)]
    given = f" ({', '.join(sizes)}: sizes, passed as scalars)" if sizes else ""
    if moved:
        given = f"; reads {', '.join(moved)}, made between kernels" + given
    if not carried:
        return "the first sweep over the rows" + given
    return (f"needs {', '.join(carried)}, reduced by an earlier segment (every value of it must "
            f"exist before other rows use it){given}")


def _renumbered(segments) -> list[Segment]:
    return [Segment(i, s.definition, s.inputs, s.outputs, s.why)
            for i, s in enumerate(segments)]
