"""Inner-outer persistent scheduler: norm backward in one pass over the big tensors.

One kernel reads each [rows, hidden] input once per row, computes the row reductions and the
row outputs (dX), and accumulates the column reductions (dW, dB) for all rows it visits in fp32
registers; each block then writes one partial row to a [blocks, hidden] fp32 workspace, and a
small finalize kernel sums the partials per column (no atomics: the result is the same from run
to run). Fusions with only outer reductions use the same kernel with no row reductions.

Storage: row buffers start in shared memory (cp.async fills them, the next rows' copies in
flight while this row computes, when two stages fit); when the plan is over budget, buffers
move to registers, least reused first and weight-related last, as nvFuser's InnerOuter
scheduler does.
"""

from __future__ import annotations

from collections.abc import Iterator

from fuser.analysis import FusionInfo, Kind
from fuser.device import DeviceSpec
from fuser.errors import OutOfResourcesError
from fuser.schedulers.base import FinalizeSchedule, Problem, RowSchedule
from fuser.schedulers.row_geometry import Hints, row_schedule_candidates
from fuser.smem import SmemPlan

FINALIZE_COLUMNS = 32  # one warp of columns per block: coalesced partial-row reads
FINALIZE_LANES = 16  # threads splitting one column's partial rows


def can_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    if info.kind not in (Kind.INNER_OUTER, Kind.OUTER):
        return f"inner_outer_persistent needs outer reductions; this fusion is {info.kind.value}"
    return None


def candidates(
    info: FusionInfo, problem: Problem, device: DeviceSpec, hints: Hints | None = None
) -> Iterator[RowSchedule]:
    """Fitting schedules, best first (see row_geometry.row_schedule_candidates)."""
    return row_schedule_candidates(info, problem, device, "inner_outer_persistent", True, hints)


def heuristic(
    info: FusionInfo, problem: Problem, device: DeviceSpec, hints: Hints | None = None
) -> RowSchedule:
    return next(candidates(info, problem, device, hints))


def finalize_heuristic(info: FusionInfo, problem: Problem, device: DeviceSpec,
                       lanes: int | None = None) -> FinalizeSchedule:
    """One block per 32 columns, `lanes` threads (FINALIZE_LANES unless tuned) striding each
    column's partial rows."""
    lanes = FINALIZE_LANES if lanes is None else lanes
    if lanes < 1 or lanes * FINALIZE_COLUMNS > device.max_threads_per_block:
        raise OutOfResourcesError(
            f"finalize_lanes={lanes}: {lanes} x {FINALIZE_COLUMNS} columns must be 1 to "
            f"{device.max_threads_per_block} threads per block; use at most "
            f"{device.max_threads_per_block // FINALIZE_COLUMNS} lanes"
        )
    n = len(info.outer_reductions)
    plan = SmemPlan.build(
        [("s_lanes", n * lanes * FINALIZE_COLUMNS * 8,
          f"{n} column sum(s) x {lanes} lanes x {FINALIZE_COLUMNS} columns (double)")],
        device.smem_per_block_optin,
    )
    return FinalizeSchedule(problem.hidden, FINALIZE_COLUMNS, lanes, plan)
