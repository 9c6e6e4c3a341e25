"""A row's variance in one pass: var_mean's two reduction levels folded into one.

lowering.py expands var_mean as torch computes it, exactly: the mean (sum(x) / n, one level),
then sum((x - mean)^2) (the next level). A row kernel runs a pass over the row and an
exchange over its threads (and its cluster) per level. Folded, one pass sums x (as the first
level does: the mean is the same) and (x - k)^2 for a per-row shift k, and then

    sum((x - mean)^2) = max(S2 - D * D / n, 0),    D = sum(x) - n * k

with S2 = sum((x - k)^2). Unshifted (k = 0) that cancels where a row's mean is large against
its spread (a mean of 1000 and a spread of 1 keep about 6 % of the variance in float); with k
near the mean it loses about float's epsilon times |mean - k| (|mean| + |k|) / spread^2 of the
variance. k is the mean of the row's first elements (as many as a warp of the row has lanes,
up to 32), which every warp of the row (and of each block of a cluster) reads from global
memory and sums in the same order while the row's copies are in flight (fm::row_shift,
row_codegen.row_start_lines), so one outlier among them moves k by a 32nd of its distance.
Sums in double instead cost the gain they were for (bench/TUNING.md, "LayerNorm forward at odd
sizes"). A first form summed x - k for the mean too: an outlier among the first elements (k 94
from a mean of 0.2) cost the mean 3e-4 of itself on the GPU.

Only where it was measured to win: rows of 2-byte elements that do not start on 16-byte
boundaries (single-element, 2-element or skewed rows: LayerNorm forward bf16 65537 / 24586
/ 4099 0.63 / 0.81 / 0.75 -> 0.67 / 0.84 / 0.78 of the copy on an H100), where the passes'
instructions, not the traffic, set the time. Aligned rows keep the two levels (unshifted
sums in one level lost 0.05 at 4096), and so do 4-byte rows, whose outputs keep the exact
form's digits.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuser.analysis import FusionInfo, Role
from fuser.dtypes import DataType
from fuser.emit import through_broadcasts
from fuser.ir import Expr, Extent, Tensor, Val, as_tensor


@dataclass(frozen=True)
class ShiftedVariance:
    """The folded pair: `total` (sum(x) -> S, inner level `level`) and `squares`
    (sum((x - S / count)^2), level + 1) of the operand x, `source`'s elements as floats."""

    level: int
    total: Expr
    squares: Expr
    source: Tensor  # the full input whose row x is (x is it, or its cast to float)
    count: Val  # the n the mean divides by

    @property
    def operand(self) -> Val:
        return self.total.inputs[0]

    @property
    def shift(self) -> str:
        """The C++ name of the row's shift k."""
        return f"shift_{self.total.outputs[0].name}"

    def words(self) -> str:
        x, s, q = self.operand.name, self.total.outputs[0].name, self.squares.outputs[0].name
        return (f"sum({x}) -> {s} and sum(({x} - mean)^2) -> {q} in one pass, shifted by the "
                "mean of the row's first elements")


def shifted_variance(info: FusionInfo) -> ShiftedVariance | None:
    """The variance whose two levels fold into one, where the fusion has one: an inner level
    holding sum(x) of a float x that is a full input or its cast, and the next level holding
    only sum((x - m)^2) with m = sum(x) / n, n the sizes of the summed axes (lowering's
    var_mean, or a user's own; not a count that reaches the kernel as scalar inputs). That
    level's pass then computes nothing a later pass keeps (its values are x, m and the
    square), so leaving it out loses no register array's stores (analysis.kept_values)."""
    levels = info.inner_levels
    for k in range(len(levels) - 1):
        if len(levels[k + 1]) != 1:
            continue
        squares = levels[k + 1][0]
        found = _centered_square(squares)
        if found is None:
            continue
        x, mean = found
        total, count = _mean_of(mean)
        if (total is None or count is None or total not in levels[k] or total.inputs[0] is not x
                or not _counts_the_row(count, total)):
            continue
        source = _float_source(x, info)
        if source is not None:
            return ShiftedVariance(k, total, squares, source, count)
    return None


def folds(info: FusionInfo, problem_hidden: int, align_bytes: int) -> ShiftedVariance | None:
    """shifted_variance() where it pays: the source's elements are 2 bytes and its rows do
    not all start on 16-byte boundaries (hidden * 2 not a multiple of 16, or pointers
    aligned to less)."""
    fold = shifted_variance(info)
    if fold is None or fold.source.dtype.itemsize != 2:
        return None
    return fold if problem_hidden * fold.source.dtype.itemsize % 16 or align_bytes < 16 else None


def pass_levels(info: FusionInfo, fold: ShiftedVariance | None) -> tuple[tuple[Expr, ...], ...]:
    """The inner reductions of each pass over a row: one level each, the fold's two as one."""
    levels = info.inner_levels
    if fold is None:
        return levels
    k = fold.level
    return (*levels[:k], (*levels[k], fold.squares), *levels[k + 2:])


def row_passes(info: FusionInfo, fold: ShiftedVariance | None) -> int:
    """info.row_passes, less the pass the fold leaves out."""
    return info.row_passes - (fold is not None)


def _centered_square(e: Expr) -> tuple[Val, Val] | None:
    """(x, m) where `e` is a float sum of (x - m) * (x - m) with m broadcast along the row."""
    if e.op != "sum" or e.outputs[0].dtype is not DataType.Float:
        return None
    sq = e.inputs[0].definition
    if sq is None or sq.op != "mul" or sq.inputs[0] is not sq.inputs[1]:
        return None
    centered = sq.inputs[0].definition
    if centered is None or centered.op != "sub":
        return None
    x, m = centered.inputs
    return x, through_broadcasts(m)


def _mean_of(m: Val) -> tuple[Expr | None, Val | None]:
    """(the sum, n) where m = sum(x) / n; (None, None) otherwise."""
    e = m.definition
    if e is None or e.op != "div":
        return None, None
    total = e.inputs[0].definition
    if total is None or total.op != "sum" or total.outputs[0].dtype is not DataType.Float:
        return None, None
    return total, e.inputs[1]


def _counts_the_row(count: Val, total: Expr) -> bool:
    """Whether `count` is the number of elements `total` sums: the sizes of its reduced axes
    (a size, or a product of sizes, as lowering's _count makes them). The folded squares,
    S2 - D * D / n, are sum((x - sum(x) / n)^2) for that n only; a mean over another count
    (a constant, a per-row tensor) keeps its two levels."""
    sizes: list[Extent] = []
    stack = [count]
    while stack:
        e = stack.pop().definition
        if e is None or e.op not in ("size", "mul"):
            return False
        if e.op == "mul":
            stack.extend(e.inputs)
            continue
        extent = e.inputs[0].dims[e.attr("dim")] if isinstance(e.inputs[0], Tensor) else None
        if extent is None:
            return False
        sizes.append(extent.find())
    x = as_tensor(total.inputs[0])
    reduced = [x.dims[d] for d in total.attr("dims")]
    if any(d is None for d in reduced):
        return False
    return sorted(map(id, sizes)) == sorted(id(d.find()) for d in reduced if d is not None)


def _float_source(x: Val, info: FusionInfo) -> Tensor | None:
    """The full input a float x is (or is the cast of), else None: the shift is read from
    its row's first elements, as the kernel reads every element."""
    if x.dtype is not DataType.Float:
        return None
    e = x.definition
    source = x if e is None else e.inputs[0] if e.op == "cast" else None
    if isinstance(source, Tensor) and source in info.full_inputs and info.roles[x] is Role.FULL:
        return source
    return None
