"""The finalize's schedule: sums the row kernel's [partial rows, hidden] fp32 partials per
column (no atomics: the same sum on every run), then runs the column epilogue.

Its time is the latency of each thread's chain of loads from L2, so it wants many blocks and
few partial rows per thread: FINALIZE_THREADS per block, split into as many columns as still
leave every SM two blocks (at least 8 columns, so a warp reads whole 32-byte sectors), the
rest lanes that stride a column's partial rows (bench/TUNING.md, "finalize").

Fused, the row kernel finalizes its own columns: once every block has left its partial row
(a grid-wide barrier; the launch is cooperative, so every block is resident), each block sums
tiles of columns in turn with its own threads. That saves the finalize's launch, 7 us of the
host's time per call (bench/host_profile.py --parts), but not device time: the finalize
kernel launches programmatically and overlaps the row kernel's end, and it runs more threads
than the resident row blocks have (and the fused tail's partial-row loads compile one after
another: bench/TUNING.md). On 16384 rows the fused form ran 1-3% slower at hidden
1024 to 32768 (bench/TUNING.md, "fused finalize"), so it is the default only where the
host's time is most of a call: where the call's row groups take one wave of resident blocks
(one_wave). It needs every block resident and counting on one counter: no cluster, fixed
strides (a counter's dealing has its own counter), rows not skewed (their grid may outnumber
the resident blocks), and room in shared memory for the lanes' sums without a block per SM
fewer (fusing_refusals).
"""

from __future__ import annotations

from dataclasses import replace

from fuser.analysis import FusionInfo, Role
from fuser.device import DeviceSpec
from fuser.dtypes import DataType
from fuser.errors import HintError
from fuser.schedulers.base import (
    ROWS_SEEN,
    Dealing,
    FinalizeSchedule,
    Problem,
    RowSchedule,
    ceil_div,
)
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_geometry import blocks_by_smem, register_limit
from fuser.smem import SmemPlan

FINALIZE_THREADS = 512
FINALIZE_COLUMNS = (32, 16, 8)  # columns per block, widest first
# Partial rows each lane loads before it adds them to its sum: unrolled, the loads are all in
# flight at once while the adds stay in row order. 16 covers a lane's share at 8 blocks per SM
# and 64 lanes (~1056 / 64) in one round trip to L2.
FINALIZE_UNROLL = 16
# A fused finalize's round of partial rows takes registers beside the row kernel's: where the
# row kernel leaves a thread fewer than this many (small blocks, many of them per SM), ptxas
# spilled the round (layernorm_bwd at hidden 1 to 100: rebuilt for fewer blocks up to ten
# times), and the rows are added one at a time. Few rows per lane there: a fused finalize is
# the default for one wave of row groups.
ROUND_MIN_REGISTERS = 64
# fused_tile_cycles' model, in cycles: a load's round trip to L2 past the grid's barrier, one
# of the first lane's dependent double adds of the lanes' sums (with its shared-memory load in
# flight), and a tile's two barriers.
L2_ROUND_TRIP = 600
LANE_ADD = 10
TILE_BARRIERS = 100


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
    return next((c for c in FINALIZE_COLUMNS if _two_blocks_an_sm(hidden, c, device)),
                FINALIZE_COLUMNS[-1])


def _two_blocks_an_sm(hidden: int, cols: int, device: DeviceSpec) -> bool:
    """Whether tiles of `cols` columns give a finalize kernel two blocks on every SM."""
    return ceil_div(hidden, cols) >= 2 * device.sm_count


def default_lanes(hidden: int, device: DeviceSpec) -> int:
    """The lanes the heuristic gives each column: the rest of FINALIZE_THREADS."""
    return FINALIZE_THREADS // finalize_columns(hidden, device)


def finalize_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec,
                      lanes: int | None = None, not_fused: str = "") -> FinalizeSchedule:
    """Columns per block from finalize_columns() and the rest of FINALIZE_THREADS as lanes
    (with groups, FusionInfo.group_axes, the widest tile: a group's partial rows are its share
    of the resident blocks, a few dozen at most, and its columns come again in every group;
    H100, fp16 mean over the sequence of [8, 1024, 4096]: 64 lanes 42.5 us, 16 lanes 34.7);
    a `lanes` hint (checked against the device by hints.check) fixes the lanes and leaves
    FINALIZE_THREADS / lanes columns, 1 to 32. `not_fused` says why the row kernel does not
    finalize its own columns, for the reason."""
    if lanes is None:
        if info.group_axes:
            cols, why = FINALIZE_COLUMNS[0], "the widest tile: a group's partial rows are few"
        else:
            cols = finalize_columns(problem.hidden, device)
            why = ("the widest tile that gives every SM two blocks"
                   if _two_blocks_an_sm(problem.hidden, cols, device)
                   else "the narrowest tile: none gives every SM two blocks")
        lanes = FINALIZE_THREADS // cols
    else:
        cols = max(1, min(FINALIZE_COLUMNS[0], FINALIZE_THREADS // lanes))
        why = "lanes hinted (finalize_lanes)"
    plan = SmemPlan.build(_lanes_requests(info, lanes, cols), device.smem_per_block_optin)
    reason = (f"a kernel of its own{f' ({not_fused})' if not_fused else ''}: {cols} columns x "
              f"{lanes} lane(s) a block, {why}")
    return FinalizeSchedule(reason, problem.hidden, cols, lanes, FINALIZE_UNROLL, plan)


def lanes_buffers(info: FusionInfo) -> list[str]:
    """The shared buffers the lanes' sums of each outer reduction meet in, in order."""
    return [f"s_lanes_{e.outputs[0].name}" for e in info.outer_reductions]


def _lanes_requests(info: FusionInfo, lanes: int, cols: int) -> list[tuple[str, int, str]]:
    return [(name, lanes * cols * 8,
             f"the lanes' sums of {e.outputs[0].name}: {lanes} lane(s) x {cols} columns "
             f"({total_type(e.outputs[0].dtype)})")
            for name, e in zip(lanes_buffers(info), info.outer_reductions, strict=True)]


def fused_columns(s: RowSchedule, blocks: int, partial_rows: int, unroll: int) -> int:
    """A fused finalize's tile over a grid of `blocks` blocks: of the widths that divide the
    block's threads (at least FINALIZE_COLUMNS[-1] columns, so that a warp reads whole 32-byte
    sectors, up to the whole block), the one fused_tile_cycles() finds quickest; the whole
    block where it has fewer threads than the narrowest."""
    narrowest = FINALIZE_COLUMNS[-1]
    if s.threads < narrowest:
        return s.threads
    widths = [c for c in range(narrowest, s.threads + 1, narrowest) if s.threads % c == 0]
    if not widths:
        return narrowest  # no width divides the block: fusing_refusals refuses
    return min(widths, key=lambda c: (
        fused_tile_cycles(s.hidden, c, s.threads // c, blocks, partial_rows, unroll), -c))


def fused_grid(s: RowSchedule, problem: Problem, device: DeviceSpec) -> int:
    """The blocks of a fused call's grid (loader.launch_sizes): one per row group up to the
    resident blocks; all of them from ROWS_SEEN rows, which stand for any more."""
    resident = s.blocks_per_sm * device.sm_count
    if problem.rows >= ROWS_SEEN:
        return resident
    return max(1, min(ceil_div(problem.rows, s.rows_per_block), resident))


def tiles_a_block(hidden: int, cols: int, blocks: int) -> int:
    """The most tiles of `cols` columns a block of a fused finalize sums, over `blocks`."""
    return ceil_div(ceil_div(hidden, cols), blocks)


def fused_tile_cycles(hidden: int, cols: int, lanes: int, blocks: int, partial_rows: int,
                      unroll: int) -> int:
    """A model of a fused finalize's time in cycles: each block sums its tiles of `cols`
    columns one after another, and a tile costs a round trip to L2 for each round of a lane's
    partial rows (a round of `unroll` loads in flight, then the rows left one at a time), the
    first lane's adds of every lane's sum, and the tile's barriers. With few blocks and few
    partial rows (a one-wave call of a small problem), tiles as narrow as 8 columns stacked
    tens of tiles on each block, each waiting on L2 and then on 32 to 64 lanes' sums
    (bench/TUNING.md, "fused finalize tiles")."""
    rows = ceil_div(partial_rows, lanes)
    trips = max(1, rows // unroll + rows % unroll)
    tile = trips * L2_ROUND_TRIP + lanes * LANE_ADD + TILE_BARRIERS
    return tiles_a_block(hidden, cols, blocks) * tile


def _fused(info: FusionInfo, s: RowSchedule, problem: Problem,
           device: DeviceSpec) -> FinalizeSchedule:
    """The fused finalize of row schedule s, its plan the row kernel's and the lanes' sums."""
    # partial rows loaded before they are added: FINALIZE_UNROLL where the row kernel's
    # threads may hold ROUND_MIN_REGISTERS registers each, else one at a time
    room = register_limit(device, s.threads, s.blocks_per_sm) >= ROUND_MIN_REGISTERS
    unroll = FINALIZE_UNROLL if room else 1
    blocks = fused_grid(s, problem, device)
    partial_rows = blocks * s.partial_rows_per_block
    cols = fused_columns(s, blocks, partial_rows, unroll)
    lanes = s.threads // cols
    plan = SmemPlan.build([(b.name, b.nbytes, b.purpose) for b in s.smem.buffers]
                          + _lanes_requests(info, lanes, cols), s.smem.limit)
    cycles = fused_tile_cycles(s.hidden, cols, lanes, blocks, partial_rows, unroll)
    reason = (f"in the row kernel: {cols} columns x {lanes} lane(s) a tile, "
              f"{tiles_a_block(s.hidden, cols, blocks)} tile(s) a block over the call's "
              f"{blocks} block(s) and {partial_rows} partial row(s), ~{cycles} cycles "
              "(fused_tile_cycles)")
    return FinalizeSchedule(reason, s.hidden, cols, lanes, unroll, plan, fused=True)


def fusing_refusals(info: FusionInfo, s: RowSchedule, fused: FinalizeSchedule,
                    device: DeviceSpec) -> list[str]:
    """Why row schedule s cannot finalize its own columns with `fused` (none: it can)."""
    reasons = []
    if info.group_axes:
        reasons.append("its column sums are per group of the leading dimensions (a grid "
                       "row of blocks each, which one grid barrier does not tell apart)")
    if s.cluster > 1:
        reasons.append(f"its rows are split over clusters of {s.cluster} blocks")
    if s.dealing is not Dealing.STRIDED:
        reasons.append(f"its row groups are dealt {s.dealing.value}, not by fixed strides")
    if s.skew:
        reasons.append("its rows are skewed (the grid strides over periods of skews, which "
                       "may outnumber the resident blocks)")
    if s.threads % fused.cols_per_block:
        reasons.append(f"its {s.threads} threads a block are not a multiple of "
                       f"{fused.cols_per_block} columns")
    total = fused.smem.total
    fit = blocks_by_smem(device, total)
    if total > device.smem_per_block_optin or fit < s.blocks_per_sm:
        reasons.append(f"with the lanes' sums its shared memory ({s.smem.total} -> {total} B "
                       f"a block) leaves room for {fit} of its {s.blocks_per_sm} blocks per SM")
    return reasons


def finalized(info: FusionInfo, s: RowSchedule, problem: Problem, device: DeviceSpec,
              hints: Hints | None) -> tuple[RowSchedule, FinalizeSchedule | None]:
    """The row schedule and its finalize: none without column outputs; fused where hinted
    (Hints(fused_finalize=True), refused where fusing_refusals() finds a reason) or, without
    a hint either way or a finalize_lanes hint (which shapes a finalize kernel of its own),
    where the rows take one wave and nothing refuses; a kernel of its own otherwise. Fused,
    the row schedule's shared-memory plan is the finalize's, with the lanes' sums after the
    row kernel's buffers."""
    if not needs_finalize(info):
        return s, None
    hints = hints or Hints()
    fused = _fused(info, s, problem, device)
    refusals = fusing_refusals(info, s, fused, device)
    if hints.fused_finalize and refusals:
        raise HintError(f"Hints(fused_finalize=True): this row kernel cannot finalize its own "
                        f"columns: {'; '.join(refusals)}; allowed here: fused_finalize=False")
    wanted = hints.fused_finalize
    if wanted is None:
        wanted = hints.finalize_lanes is None and one_wave(s, problem, device)
    if refusals or not wanted:
        return s, finalize_schedule(info, problem, device, hints.finalize_lanes,
                                    not_fused=_not_fused(refusals, hints))
    cause = "hinted" if hints.fused_finalize else "the call's row groups take one wave"
    return replace(s, smem=fused.smem), replace(fused, reason=f"{cause}, {fused.reason}")


def _not_fused(refusals: list[str], hints: Hints) -> str:
    """Why a finalize runs as a kernel of its own, in words."""
    if hints.fused_finalize is False:
        return "hinted fused_finalize=False"
    if hints.finalize_lanes is not None:
        return "its lanes are hinted"
    if refusals:
        return "the row kernel cannot finalize: " + "; ".join(refusals)
    return "the call's row groups take more than one wave"


def one_wave(s: RowSchedule, problem: Problem, device: DeviceSpec) -> bool:
    """Whether the call's row groups take at most one wave of the resident blocks: a call
    short enough that its host's time counts (the default for fusing). A schedule sees at
    most ROWS_SEEN rows, which stand for any more too: those calls are not one wave."""
    groups = -(-problem.rows // s.rows_per_block)
    return problem.rows < ROWS_SEEN and groups <= s.blocks_per_sm * device.sm_count
