"""The row search's hints (RowSearch.checked): each value held against the fusion, the
problem and the device before the search starts (hints.check, aligned copies, skewed rows),
each schedule found held against what the hints ask, and the error that ends a hinted search
in which nothing honours them; every refusal names what the heuristic picks instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fuser.device import DeviceSpec
from fuser.errors import HintError, OutOfResourcesError
from fuser.schedulers.base import Problem, RowSchedule
from fuser.schedulers.finalize import default_lanes, finalized, needs_finalize
from fuser.schedulers.hints import HintContext, Hints, check, powers_of_two
from fuser.schedulers.row_geometry import fusion_split
from fuser.schedulers.row_records import Rejection, RowFusion, RowPolicy
from fuser.schedulers.row_skew import hint_refusals, skewed_geometry, skews


@dataclass(frozen=True)
class SearchHints:
    """One search's hints: `hints` as the rows take them (Hints.for_rows), `given` as the
    caller wrote them; `heuristic` runs the unhinted search (its first schedule, or why
    there is none), for the words that say what it picks."""

    fusion: RowFusion
    problem: Problem
    device: DeviceSpec
    policy: RowPolicy
    hints: Hints
    given: Hints
    heuristic: Callable[[], RowSchedule | OutOfResourcesError]

    def check(self) -> None:
        """Refuse, before the search, a value the fusion, the problem or the device rules
        out (HintError)."""
        check(self.given, self._context(), self._default)
        self._check_aligned_copy()
        self._check_skewed()

    def honoured(self, s: RowSchedule) -> RowSchedule | Rejection:
        """`s`, or why it does not do what the hints ask."""
        hints = self.hints
        if hints.stages is not None and s.ring is not None and hints.stages > 1:
            return Rejection(f"stages={hints.stages}", f"{s.reason}: a staging ring kernel has "
                             "one stage (the ring keeps its own copies in flight)")
        if hints.stages is not None and s.stages != hints.stages:
            return Rejection(f"stages={hints.stages}", f"{s.reason}: this choice runs one stage "
                             "(two need a row buffer in shared memory filled by cp.async, and "
                             "none copied through registers)")
        if hints.aligned_copy and not s.aligned_copy:
            return Rejection("aligned_copy=True", f"{s.reason}: no row buffer in shared memory")
        return s

    def _check_aligned_copy(self) -> None:
        """aligned_copy=True where no schedule could copy rows in 16-byte chunks."""
        if not self.hints.aligned_copy:
            return
        vec, widest = self.fusion.vec(self.problem), self.fusion.widest
        why = []
        if self.problem.align_bytes < 16:
            why.append(f"every input 16-byte aligned (these are {self.problem.align_bytes}-byte "
                       "aligned)")
        if not self.fusion.narrow(vec):
            why.append(f"row vectors narrower than 16 bytes (these are {vec} x {widest} B)")
        if why:
            raise HintError(
                f"Hints(aligned_copy=True): aligned copies need {' and '.join(why)}; allowed "
                f"here: None or False; the heuristic picks "
                f"aligned_copy={self._default('aligned_copy')} here")

    def _check_skewed(self) -> None:
        """skewed=True where rows cannot be skewed, or with a hint that skewed rows break."""
        if not self.hints.skewed:
            return
        why = hint_refusals(self.fusion, self.problem, self.hints)
        if why:
            raise HintError(
                f"Hints(skewed=True): skewed rows need {'; and '.join(why)}; allowed here: "
                f"None or False; the heuristic picks skewed={bool(self._default('skew'))} "
                "here")

    def _context(self) -> HintContext:
        """What hints.check holds the values against: the inputs a storage hint may name,
        the row's vectors, and the threads per row (the hinted ones, or the search's own
        where the hint is not a power of two: the refusal says what was allowed there)."""
        info = self.fusion.info
        vec = self.fusion.vec(self.problem)
        tpr = self.hints.threads_per_row
        if tpr not in powers_of_two(self.device.max_threads_per_block):  # the search's own
            tpr = (skewed_geometry(self.fusion, self.problem, self.device,
                                   replace(self.policy, packed=None), self.hints,
                                   1).threads_per_row
                   if skews(self.fusion, self.problem, self.hints)
                   else fusion_split(self.fusion, self.problem, self.policy, self.device, None,
                                     self.hints.cluster or 1)[1])
        return HintContext(
            full_inputs=tuple(t.name for t in info.full_inputs),
            col_inputs=tuple(t.name for t in info.col_inputs),
            vectors=self.problem.hidden // vec,
            threads_per_row=tpr,
            has_accumulators=bool(info.outer_reductions),
            has_finalize=needs_finalize(info),
            device=self.device,
        )

    def _default(self, name: str) -> object:
        """What the heuristic picks for hint `name` on this problem (None: nothing here)."""
        info = self.fusion.info
        if name == "finalize_lanes":
            return default_lanes(self.problem.hidden, self.device) if needs_finalize(info) else None
        if name == "accumulators" and not info.outer_reductions:
            return None
        if name == "fused_finalize" and not needs_finalize(info):
            return None
        s = self.heuristic()
        if isinstance(s, OutOfResourcesError):
            return "nothing (no schedule fits)"
        if name == "storage":
            return tuple((p.tensor, p.storage) for p in s.placements)
        if name == "fused_finalize":
            final = finalized(info, s, self.problem, self.device, None)[1]
            return final is not None and final.fused
        if name == "rows_per_block" and s.cluster > 1:  # hints are checked at one block
            return (f"{s.rows_per_block} (of {s.threads_per_row} threads per row, over a "
                    f"cluster of {s.cluster})")
        return getattr(s, name)

    def refusal(self, tried: str) -> HintError:
        """The error that ends a hinted search in which nothing honours the hints: what was
        tried last (`tried`), and the heuristic's schedule without them."""
        return HintError(
            f"no schedule honours Hints({self.given.words()}) at hidden {self.problem.hidden} "
            f"on {self.device.name}. Tried:\n  {tried}\nChange or drop the hints; without "
            f"them the heuristic's schedule is: {self._default_words()}")

    def _default_words(self) -> str:
        s = self.heuristic()
        if isinstance(s, OutOfResourcesError):
            return f"none ({str(s).splitlines()[0]})"
        return s.reason
