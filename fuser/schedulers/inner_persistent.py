"""Inner persistent scheduler: row reductions whose rows stay on chip between passes.

RMSNorm and LayerNorm forward, softmax: every row is read once, reduced (one or more levels),
then normalized from the copy kept in registers, or in shared memory when registers run out.
Registers come first: a forward norm holds one or two row buffers, which fit in registers for
hidden sizes up to tens of thousands, and registers need no extra copy. Fusions of three passes
over each row (softmax, LayerNorm forward) stage rows in shared memory first, where that
measured faster (row_geometry.STAGED_PASSES_FIRST).
"""

from __future__ import annotations

from collections.abc import Iterator

from fuser.analysis import FusionInfo, Kind
from fuser.device import DeviceSpec
from fuser.schedulers.base import Problem, RowSchedule
from fuser.schedulers.row_geometry import Hints, row_schedule_candidates


def can_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    if info.kind is not Kind.INNER:
        return f"inner_persistent handles inner reductions only, not {info.kind.value}"
    return None


def candidates(
    info: FusionInfo, problem: Problem, device: DeviceSpec, hints: Hints | None = None
) -> Iterator[RowSchedule]:
    """Fitting schedules, best first (see row_geometry.row_schedule_candidates)."""
    return row_schedule_candidates(info, problem, device, "inner_persistent", False, hints)


def heuristic(
    info: FusionInfo, problem: Problem, device: DeviceSpec, hints: Hints | None = None
) -> RowSchedule:
    return next(candidates(info, problem, device, hints))
