"""The folds of an outer-persistent kernel: its column reductions level by level, a max and
the sum of exp(x - max) in one level as a pair.

Softmax over the rows takes a column max, then the column sum of exp(x - max): two levels,
each a pass over the slab's rows on chip and a fold over the cluster's blocks, before the
output pass. Folded as one pair (m, s), the running max and the sum of exp(x - m) rescaled
whenever m grows (the online normalizer of Milakov & Gimelshein, 2018), the same totals come
from one pass and one fold: fm::OnlineSum in fuser_columns.cuh. Pairs are of float values
(both 4-byte halves of the 8-byte column totals the folds push), so a max and sum in double
keep their two levels.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuser.analysis import FusionInfo
from fuser.dtypes import DataType
from fuser.emit import through_broadcasts
from fuser.ir import Expr, Val


@dataclass(frozen=True)
class Fold:
    """One column reduction of a level, or a max with the sum of exp(operand - that max)
    (`online_sum`) folded beside it from the max's operand."""

    reduction: Expr
    online_sum: Expr | None = None

    @property
    def name(self) -> str:
        """The fold's buffers and totals are named after its reduction's output."""
        return self.reduction.outputs[0].name

    @property
    def operand(self) -> Val:
        return self.reduction.inputs[0]

    @property
    def exprs(self) -> tuple[Expr, ...]:
        return (self.reduction,) if self.online_sum is None else (self.reduction,
                                                                   self.online_sum)

    @property
    def totals(self) -> str:
        """The outputs the fold's totals are: its reduction's, and its online sum's."""
        return ", ".join(e.outputs[0].name for e in self.exprs)

    def operation(self) -> str:
        """What the fold reduces, as the shared-memory plan names a buffer's users."""
        op = f"{self.reduction.op}({self.operand.name})"
        if self.online_sum is None:
            return op
        return f"{op} with sum(exp({self.operand.name} - {self.name}))"

    def words(self) -> str:
        """What the fold computes, as the kernel's comments and the schedule say it."""
        out, operand = self.reduction.outputs[0].name, self.operand.name
        if self.online_sum is None:
            return f"{self.reduction.op}({operand}) -> {out}"
        return (f"max({operand}) -> {out} with sum(exp({operand} - {out})) -> "
                f"{self.online_sum.outputs[0].name}, online")


def fold_levels(info: FusionInfo) -> tuple[tuple[Fold, ...], ...]:
    """info.outer_levels as folds: each sum of exp(v - max(v)) over the rows joins the level
    of its max (_online_sums), and a level it leaves empty is dropped."""
    sums = _online_sums(info)
    paired = set(sums.values())
    levels = [tuple(Fold(e, sums.get(e)) for e in level if e not in paired)
              for level in info.outer_levels]
    return tuple(level for level in levels if level)


def _online_sums(info: FusionInfo) -> dict[Expr, Expr]:
    """Each float column max whose next level sums exp(v - max) of the max's own operand v,
    with that sum: the sum's operand is computed from v and the max alone, so the pair's one
    pass over v gives both."""
    maxima = {e.outputs[0]: e for e in info.outer_reductions
              if e.op == "max" and _float(e.inputs[0]) and _float(e.outputs[0])}
    found: dict[Expr, Expr] = {}
    for e in info.outer_reductions:
        if e.op != "sum" or not _float(e.outputs[0]):
            continue
        exp = e.inputs[0].definition
        if exp is None or exp.op != "exp" or not _float(exp.outputs[0]):
            continue
        sub = exp.inputs[0].definition
        if sub is None or sub.op != "sub" or not _float(sub.outputs[0]):
            continue
        m = maxima.get(through_broadcasts(sub.inputs[1]))
        if m is not None and m not in found and through_broadcasts(sub.inputs[0]) is m.inputs[0]:
            found[m] = e
    return found


def _float(v: Val) -> bool:
    return v.dtype is DataType.Float
