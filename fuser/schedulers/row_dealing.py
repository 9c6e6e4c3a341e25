"""How a row kernel deals its row groups to blocks (base.Dealing), as a rule over the schedule.

A fixed stride gives every block of a persistent grid the same number of groups, so the call
lasts as long as its slowest SM takes; launching a block per group ran the forward norms up to
8192 at 0.97-1.00 of the copy where fixed strides held them at 0.89-0.92 ("dealing rows to
blocks" in bench/TUNING.md). A block per group repeats the block's setup (its column loads,
above all) per group: it is picked only where several blocks share an SM and the columns weigh
no more than the group's rows. A counter is picked only where one stage of rows in shared
memory is refilled with the next group during each row's last pass (refills()): there it
beat fixed strides but at softmax_fwd 65536 (0.88 against 0.90), and elsewhere it lost to
them ("refilled rows"). Fusions with column sums
keep fixed strides unless hinted: each block sums its own rows into a partial row, and rows
dealt by a counter would change the order of the sums from run to run (bit-identical results
from run to run are the finalize's promise)."""

from __future__ import annotations

from fuser.analysis import FusionInfo
from fuser.schedulers.base import COLUMN_SUM_DEALINGS, Dealing, StagingRing
from fuser.schedulers.row_records import Phase, RowGeometry

# Blocks per SM from which a block per row group beat a counter (with one, the gap while an
# SM starts its next block showed: 0.65-0.89 against 0.91-0.97 at 24578-32768)
GRID_MIN_BLOCKS = 2


def allowed(phase: Phase, geo: RowGeometry, ring: StagingRing | None,
            stages: int, at_skew: bool) -> tuple[Dealing, ...]:
    """The dealings this kernel can take: a counter where counter_refusals finds nothing
    against it; a block per group not for a fusion with column sums (it would give one
    partial row per group, not per resident block)."""
    column_sums = bool(phase.fusion.info.outer_reductions)
    kinds = COLUMN_SUM_DEALINGS if column_sums else tuple(Dealing)
    counter = not counter_refusals(phase, geo, ring, stages, at_skew)
    return tuple(d for d in kinds if d is not Dealing.DYNAMIC or counter)


def counter_refusals(phase: Phase, geo: RowGeometry, ring: StagingRing | None,
                     stages: int, at_skew: bool) -> list[str]:
    """Why a counter cannot deal these rows, in words (none: it can). It deals whole rows to
    blocks outside a staging ring, in at most two stages, where a block's rows need not share
    a skew and the rows are one problem's."""
    info = phase.fusion.info
    why = []
    if geo.cluster > 1:
        why.append(f"the {geo.cluster} blocks of a cluster would have to agree on each group")
    if ring is not None:
        why.append("a staging ring fetches rows ahead by their stride")
    if stages > 2:
        why.append(f"{stages} stages (its dealer knows the group one row ahead, not two)")
    if geo.skew and info.outer_reductions:
        why.append("skewed rows' column sums need each block's rows to share a skew")
    elif at_skew:  # RowSchedule.columns_at_skew (skewed rows), RowSchedule.group_period
        why.append("columns in shared memory at skewed rows' skew need each block's rows to "
                   "share it")
    if info.group_axes:
        why.append("one counter would deal every group's rows (FusionInfo.group_axes)")
    return why


def publishes_at_reduction(info: FusionInfo, threads_per_row: int) -> bool:
    """Whether a counter's dealer publishes the next group before the first row reduction's
    barrier (fm::CountedRows without a barrier of its own): rows of several warps reduce
    through a block barrier; single-warp rows have none to share."""
    return bool(info.inner_levels) and threads_per_row > 32


def refills(info: FusionInfo, passes: int, stages: int, aligned_copy: bool, staged: bool,
            ring: StagingRing | None, threads_per_row: int, skew: int) -> bool:
    """Whether a kernel dealt rows by a counter refills its row slots with the next group
    during each row's last pass (row_codegen.refill): one stage of rows staged by cp.async of
    whole vectors (each thread reads back only what it copied) that divide the rows (not
    skewed), outside a staging ring, with a pass after the first reduction (of its `passes`
    over each row), whose barrier publishes the next group."""
    return (stages == 1 and staged and ring is None and not aligned_copy and not skew
            and passes >= 2 and publishes_at_reduction(info, threads_per_row))


def rebuilt_dealing(dealing: Dealing, blocks_per_sm: int) -> Dealing:
    """The dealing of a schedule rebuilt for `blocks_per_sm` (kernels._rebuilt, after ptxas
    spilled): a block per group needs GRID_MIN_BLOCKS of them on an SM and falls back to fixed
    strides below that (every kernel can take those); the others stay."""
    if dealing is Dealing.GRID and blocks_per_sm < GRID_MIN_BLOCKS:
        return Dealing.STRIDED
    return dealing


def pick(phase: Phase, geo: RowGeometry, dealings: tuple[Dealing, ...], stages: int,
         blocks_per_sm: int, refilled: bool, at_skew: bool) -> Dealing:
    """Of the kernel's `dealings` (allowed()): the hinted one (row_fit._resources refuses one
    not among them), else a block per group where GRID_MIN_BLOCKS blocks share an SM, rows are
    not pipelined and the group's rows outweigh the block's column loads, which are not
    gathered at the rows' skew (`at_skew`: RowSchedule.columns_at_skew, in pieces of the
    skew, once per block); else a counter where
    allowed and its rows are refilled (`refilled`: refills()), but for fusions with column
    sums (their sums would differ from run to run); else fixed strides. A counter without
    refills lost to fixed strides on 2026-12-01 (layernorm_fwd 16384 0.56 of the copy against
    0.93, softmax_bwd 16384 0.62 against 0.97) with a third of its stalls at the barrier where
    the next group is published, a cause not established (bench/TUNING.md, "refilled rows")."""
    if phase.hints.dealing is not None:
        return phase.hints.dealing
    fusion = phase.fusion
    column_bytes = geo.hidden * sum(t.dtype.itemsize for t in fusion.cols)
    group_bytes = geo.rows_per_block * geo.hidden * sum(t.dtype.itemsize for t in fusion.full)
    if (Dealing.GRID in dealings and stages == 1 and blocks_per_sm >= GRID_MIN_BLOCKS
            and column_bytes <= group_bytes and not at_skew):
        return Dealing.GRID
    counter = Dealing.DYNAMIC in dealings and refilled and not fusion.info.outer_reductions
    return Dealing.DYNAMIC if counter else Dealing.STRIDED
