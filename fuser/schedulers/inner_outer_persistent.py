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

# The finalize reads [partial rows, hidden] fp32 (about 1000 x hidden at 8 blocks per SM) that
# the row kernel just wrote to L2. Its time is the latency of each thread's chain of loads, so
# it wants many blocks and few partial rows per thread: FINALIZE_THREADS per block, split into
# as many columns as still leave every SM two blocks (at least 8 columns: a warp then reads
# whole 32-byte sectors), the rest lanes that stride a column's partial rows. Measured on the
# H200 (rmsnorm_bwd, bf16, 16384 rows, 1056 partial rows): 32 columns x 16 lanes took 6.0 us
# at hidden 2048 (64 blocks) and 6.6 us at 1024.
FINALIZE_THREADS = 512
FINALIZE_COLUMNS = (32, 16, 8)
# Partial rows each lane loads before it adds them to its sum: unrolled, the loads are all in
# flight at once while the adds stay in row order (the same sum on every run). 16 covers a
# lane's share at 8 blocks per SM and 64 lanes (~1056 / 64) in one round trip to L2.
FINALIZE_UNROLL = 16


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


def finalize_columns(hidden: int, device: DeviceSpec) -> int:
    """The widest column tile that still gives every SM two finalize blocks (else the
    narrowest)."""
    for cols in FINALIZE_COLUMNS:
        if -(-hidden // cols) >= 2 * device.sm_count:
            return cols
    return FINALIZE_COLUMNS[-1]


def finalize_heuristic(info: FusionInfo, problem: Problem, device: DeviceSpec,
                       lanes: int | None = None) -> FinalizeSchedule:
    """Columns per block from finalize_columns() and the rest of FINALIZE_THREADS as lanes;
    a `lanes` hint fixes the lanes and leaves FINALIZE_THREADS / lanes columns (1 to 32)."""
    if lanes is None:
        cols = finalize_columns(problem.hidden, device)
        lanes = FINALIZE_THREADS // cols
    else:
        cols = max(1, min(FINALIZE_COLUMNS[0], FINALIZE_THREADS // max(lanes, 1)))
    if lanes < 1 or lanes * cols > device.max_threads_per_block:
        raise OutOfResourcesError(
            f"finalize_lanes={lanes}: {lanes} lanes x {cols} column(s) must be 1 to "
            f"{device.max_threads_per_block} threads per block; use 1 to "
            f"{device.max_threads_per_block} lanes"
        )
    n = len(info.outer_reductions)
    plan = SmemPlan.build(
        [("s_lanes", n * lanes * cols * 8,
          f"{n} column sum(s) x {lanes} lanes x {cols} columns (double)")],
        device.smem_per_block_optin,
    )
    return FinalizeSchedule(problem.hidden, cols, lanes, FINALIZE_UNROLL, plan)
