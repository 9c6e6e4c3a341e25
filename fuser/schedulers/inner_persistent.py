"""Inner persistent scheduler: row reductions whose rows stay on chip between passes.

RMSNorm and LayerNorm forward, softmax: every row is read once, reduced (one or more levels),
then normalized from the copy kept on chip. Its policy keeps rows in registers first: a
forward norm holds one or two row buffers, which fit in registers for hidden sizes up to tens
of thousands, and registers need no extra copy. Three exceptions, where they measured faster
(bench/TUNING.md): rows too long to be short are first staged in one stage of shared memory
at a geometry that lets the hardware deal a row group to each of several blocks per SM
(dealt_first; not LayerNorm forward's), fusions of three passes over each row (softmax,
LayerNorm forward) stage their rows in shared memory first, and rows whose register plan
leaves one block per SM stream through a staging ring of whole rows.
"""

from __future__ import annotations

from collections.abc import Iterator

from fuser.analysis import FusionInfo, Kind
from fuser.device import DeviceSpec
from fuser.schedulers.base import Problem, RowSchedule, Storage, skewed_columns_at_skew
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_fit import fit
from fuser.schedulers.row_records import Phase, RowPolicy, StorageChoice
from fuser.schedulers.row_search import RowSearch
from fuser.schedulers.row_storage import stage_order, staged_choice
from fuser.schedulers.staging import RING_BYTES, RING_DEPTHS, bulk_aligned

# Fusions of this many passes over each row (two reduction levels and the output) stage their
# rows in shared memory before trying registers: the row is read from global memory once and
# its later passes read shared memory ("staged forward rows" in bench/TUNING.md).
STAGED_PASSES_FIRST = 3
# Rows of at least this many threads (2048 bf16 elements) may stream through a whole-row
# staging ring instead of registers ("whole-row ring" in bench/TUNING.md).
RING_MIN_THREADS = 64


def registers_first_order(phase: Phase) -> Iterator[StorageChoice]:
    """Rows on chip: staged in shared memory first for STAGED_PASSES_FIRST passes and skewed
    rows (at most 512 threads a row: in registers, ptxas may leave one block of 16 warps per
    SM; H200 fp16 softmax_bwd 4099 / 24578 ran 0.71 / 0.71 so, bf16's staged rows 0.92 /
    0.98), at each
    stage count (stage_order) with the columns in shared memory, else in registers (there they
    cost blocks per SM, but a second stage is worth more: it loads the next row while this one
    makes its passes; "staged forward rows" in bench/TUNING.md), then a whole-row ring where
    ring_first says so, then registers, then shared memory for fusions of fewer passes."""
    fusion = phase.fusion
    if phase.geometry.skew and fusion.cols:
        yield from skewed_columns_order(phase)
        return
    in_registers = {t.name: Storage.REGISTERS for t in fusion.buffers}
    staged_first = phase.policy.stages_first(fusion.passes) or bool(phase.geometry.skew)
    if staged_first:
        for stages in stage_order(phase):
            for col_storage in (Storage.SMEM, Storage.REGISTERS):
                yield staged_choice(phase, stages, col_storage)
    if ring_first(phase, StorageChoice.of(1, in_registers)):
        yield StorageChoice.of(1, {**{t.name: Storage.RING for t in fusion.full},
                                   **{t.name: Storage.SMEM for t in fusion.cols}})
    yield StorageChoice.of(1, in_registers)
    if not staged_first:
        for stages in stage_order(phase):
            for col_storage in (Storage.REGISTERS, Storage.SMEM):
                yield staged_choice(phase, stages, col_storage)


def skewed_columns_order(phase: Phase) -> Iterator[StorageChoice]:
    """Skewed rows of fusions with column inputs: the rows staged in shared memory (at each
    stage count, stage_order), the columns re-read from global memory in pieces at each row's
    skew (SkewedColumn), then the rows in registers. A skewed row's lane holds a different
    column in every row, so columns cannot stay in registers, and in shared memory they cost
    the blocks that hide a row's uneven last round (H200 bf16, fraction of the copy, rows
    staged in one stage: rmsnorm_fwd 24578 0.88 against 0.68 with the weight in shared memory
    and 0.64 with the rows in registers, 4099 0.81 / 0.78; layernorm_fwd 24578 0.66 / 0.56,
    4099 0.58 / 0.54; bench/TUNING.md, "skewed rows"). Over a cluster, one row a block, the
    columns go in shared memory first, at the rows' skew (a block's part of each: H100 bf16
    layernorm_fwd 65537, a cluster of 2, 0.87 against 0.73 re-read; bench/TUNING.md, "skewed
    rows over a cluster")."""
    fusion, geo = phase.fusion, phase.geometry
    if geo.cluster > 1 and skewed_columns_at_skew(geo.skew, geo.rows_per_block):
        for stages in stage_order(phase):
            yield staged_choice(phase, stages, Storage.SMEM)
    for stages in stage_order(phase):
        yield staged_choice(phase, stages, Storage.GLOBAL)
    yield StorageChoice.of(1, {**{t.name: Storage.REGISTERS for t in fusion.full},
                               **{t.name: Storage.GLOBAL for t in fusion.cols}})


def ring_first(phase: Phase, in_registers: StorageChoice) -> bool:
    """Whether rows stream through a bulk-filled ring of whole rows (RING_DEPTHS[0] slots
    within RING_BYTES, one row per block) before registers: where the register plan fits but
    leaves one block per SM, rows span RING_MIN_THREADS threads or more, one block owns a row
    (over a cluster the ring lost), and every row is a 16-byte multiple at a 16-byte boundary
    (filled by cp.async one vector per thread at a time it lost too). Every pass refetches the
    row into the next slot (from L2), so three-pass fusions stage rows in smem before this."""
    geo, problem, device = phase.geometry, phase.problem, phase.device
    full = phase.fusion.full
    row_vectors = geo.vectors
    if (geo.cluster > 1 or geo.threads_per_row < RING_MIN_THREADS
            or not all(bulk_aligned(problem.hidden, geo.vec, t.dtype.itemsize, row_vectors,
                                    row_vectors, 1, problem.align_bytes, device.arch)
                       for t in full)
            or RING_DEPTHS[0] * problem.hidden * sum(t.dtype.itemsize for t in full)
            > RING_BYTES):
        return False
    registers = fit(phase, in_registers)
    return isinstance(registers, RowSchedule) and registers.blocks_per_sm <= 1


# Registers first: a few vectors per thread keep loads in flight without a pipeline.
POLICY = RowPolicy(
    scheduler="inner_persistent",
    name="registers-first",
    vectors_per_thread=4,  # ~32 bf16 elements per thread
    one_vector_up_to=0,  # never one vector per thread: registers want several loads in flight
    max_threads_per_row=1024,
    staged_passes=STAGED_PASSES_FIRST,
    # 512 threads (25 vectors of 2 at 24578) let two blocks of ~38 registers share an SM:
    # softmax 0.60 -> 0.71, log_softmax 0.62 -> 0.75, LayerNorm forward 0.61 -> 0.66 of the
    # copy at 24578 ("odd sizes: threads per row" in bench/TUNING.md)
    staged_narrow_threads=512,
    staged_narrow_bytes=8,  # every vector narrower than 16 bytes
    min_block_threads=256,  # short rows are packed to 256-thread blocks
    partials_pack=None,  # no column reductions here
    # 64 threads for 4099's 514 vectors (9 rounds) against 256 (3 rounds where most had 2):
    # softmax_fwd 0.69 -> 0.84, softmax_bwd 0.59 -> 0.93 ("skewed rows" in bench/TUNING.md)
    skewed_vectors_per_thread=6,
    on_chip=registers_first_order,
    dealt_first=True,
)


def can_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    if info.kind is not Kind.INNER:
        return f"inner_persistent handles inner reductions only, not {info.kind.value}"
    return None


def candidates(info: FusionInfo, problem: Problem, device: DeviceSpec,
               hints: Hints | None = None) -> Iterator[RowSchedule]:
    """Fitting schedules, best first (row_search.RowSearch)."""
    return RowSearch(info, problem, device, POLICY, hints).candidates()
