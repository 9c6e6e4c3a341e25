"""The row search shared by the persistent schedulers: every schedule that fits, in policy
order.

Rows stay on chip as long as any cluster size can hold them there: one block first, then the
row split over 2, 4 and 8 blocks of a cluster (sm_90), and only then re-read from global
memory in every pass (through a staging ring where one fits), split over the largest cluster,
which keeps the most of the row on chip. Where the policy packs rows several to a block, the
on-chip steps run with packed rows first, then with plain blocks (_steps). Within each step,
schedules whose shared row buffers are filled by aligned 16-byte copies come first where the
vectors are narrower than 16 bytes (see _by_copy_mode), and a choice at one row of 1024 threads
is followed by itself at 512 where rows are staged first (_halved). Before all of these,
where the policy says so, rows too long to be short try one stage in shared memory dealt a
block per row group, several blocks to an SM (row_dealt.py); and where the policy says why
(RowPolicy.split_first), the first schedule of a cluster of two goes before one block's
(_split_first), and where it names why (RowPolicy.packed_first), the first schedule of
packed rows over a cluster goes before all of them (_packed_first); where the policy names
why the schedule first then holds its rows back (RowPolicy.fewer_rows_first), blocks of
fewer rows in more stages go before everything (_fewer_rows_first). The first schedule is
the heuristic's; kernels.build() moves on to the next only when ptxas spills.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from fuser.analysis import FusionInfo, Role
from fuser.device import DeviceSpec
from fuser.errors import OutOfResourcesError
from fuser.schedulers import row_variance
from fuser.schedulers.base import Problem, RowSchedule, Storage
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_dealt import dealt_schedules, dealt_shapes, dealt_why, shapes_block
from fuser.schedulers.row_fit import fit
from fuser.schedulers.row_geometry import (
    MAX_STAGED_VECTORS_PER_THREAD,
    cluster_sizes,
    geometry,
    packed,
)
from fuser.schedulers.row_hints import SearchHints
from fuser.schedulers.row_records import (
    Phase,
    Reach,
    Rejection,
    RowFusion,
    RowPolicy,
    StorageChoice,
)
from fuser.schedulers.row_skew import (
    clustered_skewed_keeps,
    clustered_skewed_rows,
    clustered_skewed_why,
    skewed_geometry,
    skewed_loses,
    skews,
)
from fuser.schedulers.row_storage import choices

SHOWN_REJECTIONS = 6  # the last rejections an error lists


@dataclass(frozen=True)
class _Step:
    """One step of the search: a cluster size, the storages it tries, why the search got
    there, and the policy that deals its rows."""

    cluster: int
    reach: Reach
    why: str
    policy: RowPolicy
    skewed: bool = False  # rows in the widest vectors, skewed (RowSchedule.skew)
    # A step of RowSearch._dealt_steps (row_dealt.dealt_shapes): one stage of staged rows
    # at its shape's threads per row, a block per row group
    dealt: bool = False
    # A step of this schedule alone, found ahead of the search (RowSearch._split_first,
    # _packed_first, _fewer_rows_first, _clustered_skewed_step)
    schedule: RowSchedule | None = None
    # The threads per row, rows per block and stages the step's phase takes as hints on top
    # of the search's (None: the search's own): RowSearch._fewer_rows_first's blocks, the
    # dealt steps' threads
    shape: tuple[int, int | None, int | None] | None = None


class RowSearch:
    """One search: a fusion, a problem, a device, a policy and hints; it keeps the choices it
    rejected, for the error that ends a search in which nothing fits."""

    def __init__(self, info: FusionInfo, problem: Problem, device: DeviceSpec,
                 policy: RowPolicy, hints: Hints | None = None):
        self.fusion = RowFusion.of(info, row_variance.folds(info, problem.hidden,
                                                            problem.align_bytes))
        self.problem = problem
        self.device = device
        self.policy = policy
        self.hints = (hints or Hints()).for_rows()
        self.checked = SearchHints(self.fusion, problem, device, policy, self.hints,
                                   hints or Hints(), self._heuristic)
        self.rejections: list[Rejection] = []

    def candidates(self) -> Iterator[RowSchedule]:
        """Every fitting schedule, best first, each once whatever its reason says (steps
        overlap: the largest cluster's on-chip choices come again in its re-read step, and
        plain blocks repeat the packed steps' where rows are not packed); raises when none
        fits, and after the last one when hints were given (the build ran out of schedules it
        could compile)."""
        self.checked.check()
        seen: set[RowSchedule] = set()
        for step in self._steps():
            schedules = [step.schedule] if step.schedule else self._by_copy_mode(step)
            for s in schedules:
                decisions = replace(s, reason="")  # plain blocks may repeat a packed step's
                if decisions not in seen:
                    seen.add(decisions)
                    yield s
        if not seen or self.hints.given():  # hinted: say which hints no schedule honours
            raise self._exhausted()

    def _steps(self) -> list[_Step]:
        """The steps in order; a hinted cluster or storage tries everything at the hinted
        cluster size (packed rows, then plain blocks). Where the policy packs rows several to
        a block (RowPolicy.packed), every cluster size is tried with packed rows before any
        with the policy's plain blocks, which may keep on chip what packed rows cannot (a part
        without clusters); rows re-read from global memory are dealt in plain blocks."""
        plain = replace(self.policy, packed=None)
        policies = [self.policy, plain] if packed(self.fusion, self.policy) else [plain]
        if self.hints.cluster is not None or self.hints.storage is not None:
            steps = [_Step(self.hints.cluster or 1, Reach.ANY, "as hinted", policy)
                     for policy in policies]
        else:
            sizes = cluster_sizes(self.fusion, self.problem, self.device)
            steps = [_Step(k, Reach.ON_CHIP,
                           _on_chip_why(k, after_packed=policy is not policies[0]), policy)
                     for policy in policies for k in sizes]
            steps.append(_Step(sizes[-1], Reach.OFF_CHIP,
                               f"{sizes[-1]} block(s) cannot keep the row on chip", plain))
            steps = self._dealt_steps(plain) + self._fewer_rows_first(
                self._packed_first(self._split_first(steps)), plain)
        return self._skewed_first(steps)

    def _split_first(self, steps: list[_Step]) -> list[_Step]:
        """`steps`, with the first schedule of the first policy's cluster of two before its
        one block where the policy names why (RowPolicy.split_first). The cluster's other
        schedules keep their place after one block's, so a first schedule that spills falls
        back on one block. Not under hints that shape the block (row_dealt.MOOT_HINTS are
        the others): the rule was measured on the heuristic's own schedules."""
        split = self.policy.split_first
        if split is None or shapes_block(self.hints):
            return steps
        one = steps[0]  # one block (cluster_sizes starts at 1), on chip
        two = next((step for step in steps if step.cluster == 2 and step.policy is one.policy
                    and step.reach is Reach.ON_CHIP), None)
        if two is None:
            return steps
        one_first, two_first = self._probe(one), self._probe(two)
        if one_first is None or two_first is None:
            return steps
        why = split(self.fusion, one_first, two_first)
        if why is None:
            return steps
        two = replace(two, why=why)
        return [replace(two, schedule=self._probe(two)), *steps]

    def _packed_first(self, steps: list[_Step]) -> list[_Step]:
        """`steps`, with a schedule of packed rows over a cluster before all of them: over
        the smallest cluster whose packed geometry the policy names a reason for
        (RowPolicy.packed_first), the first of that step's schedules the policy keeps, its
        reason the rule's. The step keeps its place too, so a schedule that spills falls
        back on the order without the rule. Not under hints that shape the block, as
        _split_first."""
        rule, rows = self.policy.packed_first, self.policy.packed
        if rule is None or rows is None or shapes_block(self.hints):
            return steps

        def qualified(step: _Step) -> _Step | None:
            if step.policy.packed is None or step.cluster == 1 or step.reach is not Reach.ON_CHIP:
                return None
            geo = self._phase(step, False).geometry
            if geo.threads_per_row != rows.threads_per_row:
                return None  # packed rows do not hold this cluster's part
            why = rule.why(self.fusion, geo)
            return replace(step, why=why) if why is not None else None
        return self._pinned(filter(None, map(qualified, steps)), lambda s: (
            s.threads_per_row == rows.threads_per_row and rule.keeps(s))) + steps

    def _fewer_rows_first(self, steps: list[_Step], plain: RowPolicy) -> list[_Step]:
        """`steps`, with a block of fewer rows in more stages before all of them where the
        policy names why, given the search's first schedule (RowPolicy.fewer_rows_first):
        the first of its shapes that fits on one block with every buffer in shared memory, in
        a step of its own. The steps keep their order after it, so a schedule that spills
        falls back on the order without the rule. Not under hints that shape the block, as
        _split_first."""
        rule = self.policy.fewer_rows_first
        if rule is None or shapes_block(self.hints):
            return steps
        first = next(filter(None, (step.schedule or self._probe(step) for step in steps)),
                     None)
        why = rule.why(self.fusion, first) if first is not None else None
        if why is None:
            return steps
        shaped = (_Step(1, Reach.ON_CHIP, why, plain,
                        shape=(rule.threads_per_row, rows, rule.stages))
                  for rows in rule.rows_per_block)
        # every buffer in shared memory: the shape's stages, which hold the rows there
        return self._pinned(shaped, lambda s: (
            s.accumulators is Storage.REGISTERS and s.buffers_in_smem)) + steps

    def _pinned(self, steps, keep: Callable[[RowSchedule], bool]) -> list[_Step]:
        """The first of `steps` with a schedule `keep` takes, as a step of that schedule alone
        (none: [])."""
        for step in steps:
            found = self._probe(step, keep)
            if found is not None:
                return [replace(step, schedule=found)]
        return []

    def _probe(self, step: _Step,
               keep: Callable[[RowSchedule], bool] = lambda s: True) -> RowSchedule | None:
        """The first of the step's schedules that `keep` takes, for a rule that reorders the
        steps; the rejections met on the way are dropped (the search meets them again, in
        order, for the error that ends it)."""
        kept = len(self.rejections)
        found = next((s for s in self._by_copy_mode(step) if keep(s)), None)
        del self.rejections[kept:]
        return found

    def _dealt_steps(self, plain: RowPolicy) -> list[_Step]:
        """A step per row_dealt.dealt_shapes: one stage of rows in shared memory at its
        cluster size and threads per row, dealt a block per row group."""
        return [_Step(cluster, Reach.ON_CHIP, dealt_why(cluster, threads), plain,
                      dealt=True, shape=(threads, None, None))
                for cluster, threads in dealt_shapes(self.fusion, self.problem, self.device,
                                                     plain, self.hints)]

    def _skewed_first(self, steps: list[_Step]) -> list[_Step]:
        """The steps of one block per row again with skewed rows, before all the others, where
        the fusion's rows may be skewed (RowFusion.skew) and the hints allow it; only those
        with skewed=True. Skewed rows move 16-byte vectors where the plain ones move 2 or 4
        bytes (H200 bf16, 16384 rows, fraction of the copy: softmax_fwd 24578 0.70 -> 0.89,
        4099 0.49 -> 0.84, softmax_bwd 4099 0.42 -> 0.92; bench/TUNING.md, "skewed rows").
        Fusions with column inputs re-read them from global memory
        (inner_persistent.skewed_columns_order): rmsnorm_fwd 4099 0.34 -> 0.81,
        dropout_rmsnorm_fwd 4099 0.45 -> 0.81, dropout_layernorm_fwd 4099 0.52 -> 0.67;
        the skewed steps go after the others where their first schedule re-reads them at one
        block per SM (row_skew.skewed_loses), and such rows of narrow plain vectors are split
        over a cluster first, their columns in shared memory at the rows' skew
        (_clustered_skewed_step)."""
        if not skews(self.fusion, self.problem, self.hints):
            return steps
        # packed rows' threads are sized for the vectors that divide the row; skewed rows
        # take their own (row_skew.skewed_threads); over a cluster only when one is hinted
        skewed = [_skewed(step) for step in steps
                  if (step.cluster == 1 or self.hints.cluster)
                  and step.reach is not Reach.OFF_CHIP and step.policy.packed is None]
        if not self.hints.skewed:
            first = next(filter(None, map(self._probe, skewed)), None)
            why = skewed_loses(first) if first is not None else None
            # one block's skewed rows lose, or no block holds one: over a cluster first
            if first is None or why is not None:
                clustered = self._clustered_skewed_step(steps)
                return clustered + [replace(step, why="; ".join(filter(None, (step.why, why))))
                                    for step in steps] + skewed
            return skewed + steps
        # hinted: rows too long for a block's shared memory are re-read, by one block
        return skewed + [_skewed(step, cluster=1) for step in steps
                         if step.reach is Reach.OFF_CHIP]

    def _clustered_skewed_step(self, steps: list[_Step]) -> list[_Step]:
        """A step of skewed rows over the smallest cluster whose first schedule that keeps
        every buffer in shared memory (the columns at the rows' skew) holds
        row_skew.CLUSTERED_MIN_BLOCKS blocks per SM, where row_skew.clustered_skewed_rows
        says (none: [])."""
        if not clustered_skewed_rows(self.fusion, self.problem):
            return []
        return self._pinned((_skewed(step, why=clustered_skewed_why(step.cluster))
                             for step in steps if step.cluster > 1
                             and step.reach is Reach.ON_CHIP and step.policy.packed is None),
                            clustered_skewed_keeps)

    def _phase(self, step: _Step, chunked: bool) -> Phase:
        """A step's phase. Aligned 16-byte row copies (`chunked`) need the inputs 16-byte
        aligned, and pay only where the widest row input's vectors are narrower than 16 bytes
        (bench/TUNING.md, "aligned row copies")."""
        if step.skewed:
            return self._skewed_phase(step)
        geo = geometry(self.fusion, self.problem, self.device, step.policy,
                       _shaped(self.hints, step.shape), step.cluster)
        aligned = chunked and self.problem.align_bytes >= 16 and self.fusion.narrow(geo.vec)
        # a shaped step's storage orders see its shape as hints (its stages)
        return Phase(self.fusion, self.problem, self.device, step.policy,
                     _shaped(self.hints, step.shape), geo, aligned, step.reach, step.why)

    def _skewed_phase(self, step: _Step) -> Phase:
        """A skewed step's phase (row_skew.skewed_geometry). Shared row buffers are filled a
        vector at a time, each thread its own (so no barrier comes between the copies and the
        reads): the vectors are already whole."""
        geo = skewed_geometry(self.fusion, self.problem, self.device, step.policy, self.hints,
                              step.cluster)
        return Phase(self.fusion, self.problem, self.device, step.policy, self.hints, geo,
                     False, step.reach, step.why)

    def _fits(self, phase: Phase) -> Iterator[RowSchedule]:
        """The phase's choices that fit and honour the hints, in order."""
        geo = phase.geometry
        if geo.threads > self.device.max_threads_per_block:  # another cluster may need fewer
            self.rejections.append(Rejection(
                f"cluster={geo.cluster}",
                f"{geo.threads} threads per block ({geo.threads_per_row} per row x "
                f"{geo.rows_per_block} rows) exceed the device limit of "
                f"{self.device.max_threads_per_block}; lower threads_per_row or rows_per_block"))
            return
        halved = self._halved(phase)
        for choice in choices(phase):
            full = self._fitted(phase, choice)
            if full is None:
                continue  # a choice that does not fit a full block is not tried at half
            yield full
            half = self._fitted(halved, choice) if halved is not None else None
            if half is not None:
                yield half

    def _fitted(self, phase: Phase, choice: StorageChoice) -> RowSchedule | None:
        """The choice's schedule in this phase where it fits and honours the hints; else
        None, with the rejection kept for the error."""
        result = fit(phase, choice)
        if isinstance(result, RowSchedule):
            result = self.checked.honoured(result)
        if isinstance(result, Rejection):
            self.rejections.append(result)
            return None
        return result

    def _halved(self, phase: Phase) -> Phase | None:
        """The phase at half its threads per row, where the phase's policy stages the
        fusion's rows in shared memory first (RowPolicy.stages_first: every backward row,
        three-pass forward rows) and its block is one row of the device's threads, where
        ptxas has 64 registers a thread: each choice that fits is followed by itself at half
        the threads, which kernels.build reaches only where the full block spills. Rows in
        registers first lost at half the threads. None where threads per row are hinted, or
        a thread would own more than MAX_STAGED_VECTORS_PER_THREAD vectors ("builds that
        fall back on spills" in bench/TUNING.md), and for skewed rows (at most
        row_skew.SKEWED_MAX_THREADS threads already)."""
        geo = phase.geometry
        if (not phase.policy.stages_first(self.fusion.passes)
                or self.hints.threads_per_row is not None
                or geo.threads_per_row < self.device.max_threads_per_block):
            return None
        half = replace(self.hints, threads_per_row=geo.threads_per_row // 2)
        halved = geometry(self.fusion, self.problem, self.device, phase.policy, half,
                          geo.cluster)
        if halved.batch > MAX_STAGED_VECTORS_PER_THREAD:
            return None
        return replace(phase, geometry=halved,
            why="; ".join(filter(None, (phase.why, f"{geo.threads_per_row // 2} threads per "
                                        f"row, where {geo.threads_per_row} spill"))))

    def _by_copy_mode(self, step: _Step) -> Iterator[RowSchedule]:
        """One step's schedules, those with aligned 16-byte row copies first, unless their
        slightly larger row slots (up to 15 bytes per row) leave more buffers re-read from
        global memory than copies of vec bytes do (the 100 KB part at hidden 24578 would
        re-read two input rows instead of one input row and the weight)."""
        if step.dealt:
            yield from dealt_schedules(self._phase(step, False))
            return
        if step.skewed or self.hints.aligned_copy is False:
            yield from self._fits(self._phase(step, False))
            return
        first, chunked = _peek(self._fits(self._phase(step, True)))
        if self.hints.aligned_copy is True or (first is not None and not first.aligned_copy):
            yield from chunked  # hinted, or no row buffer to copy in chunks: the same plans
            return
        other, plain = _peek(self._fits(self._phase(step, False)))
        if first is None or (other is not None and _rereads(other) < _rereads(first)):
            yield from itertools.chain(plain, chunked)
        else:
            yield from itertools.chain(chunked, plain)

    def _exhausted(self) -> Exception:
        """The error that ends the search: what was tried last, and the way out."""
        tried = "\n  ".join(dict.fromkeys(str(r) for r in self.rejections))
        tried = "\n  ".join(tried.split("\n  ")[-SHOWN_REJECTIONS:])
        if self.hints.given():
            return self.checked.refusal(tried)
        return OutOfResourcesError(
            f"no storage fits one row of hidden {self.problem.hidden} "
            f"({self.fusion.info.row_buffer_bytes} B per element of row buffers) on "
            f"{self.device.name}: shared memory limit {self.device.smem_per_block_optin} B "
            f"per block. Tried:\n  {tried}\nUse a device with more shared memory or a "
            "smaller hidden size.")

    def _heuristic(self) -> RowSchedule | OutOfResourcesError:
        """The unhinted search's first schedule, or why there is none."""
        try:
            return next(RowSearch(self.fusion.info, self.problem, self.device,
                                  self.policy).candidates())
        except OutOfResourcesError as exc:
            return exc


def _skewed(step: _Step, **changes) -> _Step:
    """`step`'s cluster, reach, why and policy with skewed rows (and `changes`): a pinned
    schedule, a dealt mark or a shape are the plain rows' own, not the skewed rows'."""
    return replace(_Step(step.cluster, step.reach, step.why, step.policy, skewed=True),
                   **changes)


def _shaped(hints: Hints, shape: tuple[int, int | None, int | None] | None) -> Hints:
    """`hints` with a step's shape (threads per row, rows per block, stages), where it has
    one."""
    if shape is None:
        return hints
    threads, rows, stages = shape
    return replace(hints, threads_per_row=threads, rows_per_block=rows, stages=stages)


def _on_chip_why(cluster: int, after_packed: bool) -> str:
    """Why an on-chip step was reached: plain blocks after packed rows, a cluster after
    fewer blocks."""
    why = ["packed rows do not stay on chip"] if after_packed else []
    if cluster > 1:
        why.append("the plans for fewer blocks do not keep the row on chip")
    return "; ".join(why)


def _peek(schedules: Iterator[RowSchedule]
          ) -> tuple[RowSchedule | None, Iterator[RowSchedule]]:
    """The first of `schedules` (None: there are none) and all of them, that one first."""
    first = next(schedules, None)
    return first, (itertools.chain([first], schedules) if first is not None else iter(()))


def _rereads(s: RowSchedule) -> int:
    """Row buffers (and accumulators) a schedule keeps in global memory, re-read every pass."""
    return (sum(p.storage in (Storage.GLOBAL, Storage.RING) for p in s.placements
                if p.role is Role.FULL)
            + (s.accumulators is Storage.GLOBAL))
