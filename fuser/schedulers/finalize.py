"""The finalize kernel's schedule: sums the row kernel's [partial rows, hidden] fp32 partials
per column (no atomics: the same sum on every run), then runs the column epilogue.

Its time is the latency of each thread's chain of loads from L2, so it wants many blocks and
few partial rows per thread: FINALIZE_THREADS per block, split into as many columns as still
leave every SM two blocks (at least 8 columns, so a warp reads whole 32-byte sectors), the
rest lanes that stride a column's partial rows (bench/TUNING.md, "finalize").
"""

from __future__ import annotations

from fuser.analysis import FusionInfo, Role
from fuser.device import DeviceSpec
from fuser.dtypes import DataType
from fuser.schedulers.base import FinalizeSchedule, Problem
from fuser.smem import SmemPlan

FINALIZE_THREADS = 512
FINALIZE_COLUMNS = (32, 16, 8)  # columns per block, widest first
# Partial rows each lane loads before it adds them to its sum: unrolled, the loads are all in
# flight at once while the adds stay in row order. 16 covers a lane's share at 8 blocks per SM
# and 64 lanes (~1056 / 64) in one round trip to L2.
FINALIZE_UNROLL = 16


def total_type(dtype: DataType) -> str:
    """The C++ type the finalize adds a column's partials up in: double for a float reduction
    (float partials, one rounding fewer), the accumulator's own integer or bool type
    otherwise. A double total of Int64 partials rounded sums past 2**53 (a column holding
    the type's minimum summed to min + 4096 where torch gives min + 2590)."""
    compute = dtype.compute_type
    return "double" if compute in ("float", "double") else compute


def needs_finalize(info: FusionInfo) -> bool:
    """Whether a row kernel of this fusion is followed by a finalize: it has column
    reductions to sum, or column outputs to write."""
    return bool(info.outer_reductions or info.outputs(Role.COL))


def finalize_columns(hidden: int, device: DeviceSpec) -> int:
    """The widest column tile that still gives every SM two finalize blocks (else the
    narrowest)."""
    for cols in FINALIZE_COLUMNS:
        if -(-hidden // cols) >= 2 * device.sm_count:
            return cols
    return FINALIZE_COLUMNS[-1]


def default_lanes(hidden: int, device: DeviceSpec) -> int:
    """The lanes the heuristic gives each column: the rest of FINALIZE_THREADS."""
    return FINALIZE_THREADS // finalize_columns(hidden, device)


def finalize_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec,
                      lanes: int | None = None) -> FinalizeSchedule:
    """Columns per block from finalize_columns() and the rest of FINALIZE_THREADS as lanes;
    a `lanes` hint (checked against the device by hints.check) fixes the lanes and leaves
    FINALIZE_THREADS / lanes columns, 1 to 32."""
    if lanes is None:
        cols = finalize_columns(problem.hidden, device)
        lanes = FINALIZE_THREADS // cols
    else:
        cols = max(1, min(FINALIZE_COLUMNS[0], FINALIZE_THREADS // lanes))
    plan = SmemPlan.build(
        [(f"s_lanes_{e.outputs[0].name}", lanes * cols * 8,
          f"the lanes' sums of {e.outputs[0].name}: {lanes} lanes x {cols} columns "
          f"({total_type(e.outputs[0].dtype)})")
         for e in info.outer_reductions],
        device.smem_per_block_optin,
    )
    return FinalizeSchedule(problem.hidden, cols, lanes, FINALIZE_UNROLL, plan)
