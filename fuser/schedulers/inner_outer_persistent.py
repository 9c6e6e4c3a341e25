"""Inner-outer persistent scheduler: norm backward in one pass over the big tensors.

One kernel reads each [rows, hidden] input once per row, computes the row reductions and the
row outputs (dX), and accumulates the column reductions (dW, dB) for all rows it visits in fp32
registers; each block then writes one partial row to a [blocks, hidden] fp32 workspace, and a
small finalize kernel (finalize.py) sums the partials per column (no atomics, and each block's
rows fixed by its stride: the result is the same from run to run, unless a hint deals the
rows from a counter, row_dealing.py). Fusions with only outer reductions use the same kernel
with no row reductions.

Its policy stages rows in shared memory first: cp.async fills them, the next rows' copies in
flight while this row computes, when two stages fit (three where they put more rows in
flight, _three_stages); rows go over a cluster of two before one block where one block would
hold them back (_split_first), and packed rows over a cluster before both where a thread's
column sums fill a measured band of registers (_packed_first_why). When the plan is over
budget, buffers move to registers, least reused first and weight-related last, as nvFuser's
InnerOuter scheduler does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache

from fuser.analysis import FusionInfo, Kind
from fuser.device import DeviceSpec
from fuser.schedulers.base import Problem, RowSchedule, Storage
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_fit import fit
from fuser.schedulers.row_geometry import staged_cap
from fuser.schedulers.row_records import (
    FewerRowsFirst,
    NarrowSums,
    PackedFirst,
    PackedRows,
    Phase,
    Rejection,
    RowFusion,
    RowGeometry,
    RowPolicy,
    StorageChoice,
)
from fuser.schedulers.row_search import RowSearch
from fuser.schedulers.row_storage import stage_order, staged, staged_choice


def smem_first_order(phase: Phase) -> Iterator[StorageChoice]:
    """Rows on chip: every row buffer in shared memory, then one buffer after another moved
    to registers (full[:moved], least reused first), each with the columns in shared memory,
    then in registers; two stages first unless rows are short and one stage leaves other
    blocks resident, three before them where they put more rows in flight (_stage_order).
    Skewed rows' columns cannot stay in registers (a lane holds a different column in every
    row): they are re-read from global memory first, as the skewed forward measured faster
    (inner_persistent.skewed_columns_order), which leaves room for two stages of rows
    (rmsnorm_bwd bf16 24578: 197 KB), then a padded shared buffer. Rows of the narrow
    vectors whose threads the policy caps (row_geometry.staged_cap) keep every row buffer in
    shared memory unless the stages are hinted: at 512 threads a thread's many narrow
    vectors fit registers where at 1024 they did not, and two stages with rows in registers
    ran slower than one stage in shared memory (H100, fp16 dropout_rmsnorm_bwd 24578: 0.85
    against 0.93)."""
    full, cols = phase.fusion.full, phase.fusion.cols
    col_storages = ((Storage.GLOBAL, Storage.SMEM) if phase.geometry.skew
                    else (Storage.SMEM, Storage.REGISTERS))
    cap = staged_cap(phase.fusion, phase.problem, phase.policy)
    capped = cap is not None and phase.geometry.threads_per_row <= cap
    for stages in _stage_order(phase):
        # an unhinted third stage, or unhinted stages of capped rows, only ever keep every
        # row buffer in shared memory
        movable = len(full) if phase.hints.stages or (stages <= 2 and not capped) else 0
        for moved in range(movable + 1):
            for col_storage in col_storages:
                storage = staged(phase, stages)
                storage.update({t.name: Storage.REGISTERS for t in full[:moved]})
                storage.update({t.name: col_storage for t in cols})
                yield StorageChoice.of(stages if moved < len(full) else 1, storage)


def _stage_order(phase: Phase) -> list[int]:
    """The order of one and two stages (_one_or_two_first), three first where _three_stages
    says so."""
    staged_fit = cache(lambda stages: fit(phase, staged_choice(phase, stages, Storage.SMEM)))
    order = _one_or_two_first(phase, staged_fit)
    if len(order) == 2 and _three_stages(phase, order[0], staged_fit):
        return [3, *order]
    return order


# stages -> fit() of every row buffer staged in that many stages, the columns in shared memory
StagedFit = Callable[[int], RowSchedule | Rejection]


def _one_or_two_first(phase: Phase, staged_fit: StagedFit) -> list[int]:
    """row_storage.stage_order, but two stages first for rows where one stage would leave
    one block per SM, and for short unskewed rows whose one stage fills less than half an
    SM's shared memory where two stages keep its blocks per SM: one stage relies on the other
    resident blocks to load while a block computes, and a second stage loads the next rows
    while this one computes (_TWO_STAGES_BELOW)."""
    order = stage_order(phase)
    if order != [1, 2]:
        return order
    one = staged_fit(1)
    if not isinstance(one, RowSchedule):
        return order
    if one.blocks_per_sm <= 1:
        return [2, 1]
    if phase.geometry.skew or (one.smem.total * one.blocks_per_sm
                               >= phase.device.smem_per_sm * _TWO_STAGES_BELOW):
        return order
    two = staged_fit(2)
    if isinstance(two, RowSchedule) and two.blocks_per_sm >= one.blocks_per_sm:
        return [2, 1]
    return order


def _three_stages(phase: Phase, stages: int, staged_fit: StagedFit) -> bool:
    """Whether rows take a third stage before `stages`, the first of one and two: while a
    row computes, and while its warps wait at its reduction's barrier, more rows' copies are
    in flight. Where three stages fit with every row buffer still in shared memory and put
    more stages in flight per SM (_stages_in_flight) than the first choice, which has one
    stage or one block per SM; rows split over at most two blocks of a cluster (in 16-byte
    vectors there: rmsnorm_bwd 24578 over two blocks in three stages ran 0.70, one block
    0.85) and not skewed (whose one stage first stays: row_storage.stage_order), elements
    of 2 bytes or narrower, a fusion that reduces rows and sums at most one column. H200,
    16384 rows, fraction of the copy (bench/TUNING.md, "three stages"), two stages at one
    block -> three: rmsnorm_bwd bf16 12288 / 16384 0.81 / 0.88 -> 0.93 / 0.92, fp16 0.83 /
    0.90 -> 0.92 / 0.93; one stage at two to four blocks -> three at one or two:
    rmsnorm_bwd bf16 2048 / 3072 / 4096 0.85 / 0.90 / 0.86 -> 0.86 / 0.93 / 0.89,
    dropout_rmsnorm_bwd 1000 / 1024 0.85 / 0.88 -> 0.89 / 0.91 (fp16 alike). Not taken
    where they lost: over two stages at four blocks (rmsnorm_bwd 1000 / 1024 0.79 / 0.84 ->
    0.78 / 0.82), column sums without a row reduction (gelu_bwd fp16 16384 0.89 -> 0.86),
    two column sums (layernorm_bwd 12288 0.90 -> 0.88), 4-byte elements (fp32 rmsnorm_bwd
    8192 0.96 -> 0.95)."""
    fusion, geo = phase.fusion, phase.geometry
    if (geo.cluster > 2 or geo.skew or (geo.cluster == 2 and fusion.narrow(geo.vec))
            or not _three_stage_fusion(fusion)):
        return False
    first, three = staged_fit(stages), staged_fit(3)
    if not (isinstance(first, RowSchedule) and isinstance(three, RowSchedule)
            and (first.stages == 1 or first.blocks_per_sm == 1)
            and three.placements == first.placements):
        return False
    more = _stages_in_flight(three) - _stages_in_flight(first)
    return more > 0 or (more == 0 and _planned_blocks_hold_as_many(geo, first, three))


def _three_stage_fusion(fusion: RowFusion) -> bool:
    """Whether the fusion's rows may take a third stage (_three_stages, _fewer_rows_why): a
    row reduction, at most one column sum, row inputs of 2 bytes or narrower."""
    return (bool(fusion.info.inner_levels) and len(fusion.info.outer_reductions) <= 1
            and bool(fusion.full) and fusion.widest <= 2)


def _planned_blocks_hold_as_many(geo: RowGeometry, first: RowSchedule,
                                 three: RowSchedule) -> bool:
    """Whether three stages on one block per SM take a tie with one stage of three or more
    blocks: those blocks hold as many rows in flight only as long as ptxas builds them
    within the planned registers, and the estimate falls short for fusions of many row
    inputs (dropout_rmsnorm_bwd bf16 2048: planned for three blocks at 80 registers, built
    for two at 96). H200, 16384 rows, fraction of the copy, the tree before -> the tie
    taken, median of two runs each (bench/TUNING.md, "fewer rows in three stages"):
    dropout_rmsnorm_bwd 2048 bf16 / fp16 0.88 / 0.87 -> 0.91 / 0.92 (1024, unchanged:
    even); it moves 1536 too (not measured). Rows of one element (three stages at three
    blocks against one at seven) were not measured, and keep one stage."""
    return (geo.cluster == 1 and first.stages == 1 and first.blocks_per_sm >= 3
            and three.blocks_per_sm == 1)


def _stages_in_flight(s: RowSchedule) -> int:
    """An SM's stages of rows being copied while a block computes one: the block's other
    stages, and with one stage the other blocks' rows."""
    return s.blocks_per_sm * (s.stages - 1) if s.stages > 1 else s.blocks_per_sm - 1


def _wide_vectors_of_2_bytes(fusion: RowFusion, vec: int) -> bool:
    """Rows of elements of 2 bytes or narrower in 16-byte vectors: the only rows the rules
    that reorder the search by clusters (_split_first, _packed_first_why) were measured to
    gain on."""
    return fusion.widest <= 2 and not fusion.narrow(vec)


def _vectors_of_two_2_byte_elements(fusion: RowFusion, vec: int) -> bool:
    """Rows of 2-byte elements in vectors of two (bf16 24574, 24578, 24586)."""
    return fusion.widest == 2 and vec == 2


def _split_first(fusion: RowFusion, one: RowSchedule, two: RowSchedule) -> str | None:
    """Why rows go over a cluster of two before one block (RowPolicy.split_first), or None:
    one block keeps them on chip only at one stage and one block per SM, or only with a
    buffer moved to registers, and two blocks keep every buffer in shared memory in two
    stages or more (three where _three_stages says so), or one block keeps two stages at one
    block per SM and two blocks three; row elements of 2 bytes or narrower in 16-byte
    vectors. H200, 16384 rows, fraction of the copy, bf16, before -> after (bench/TUNING.md,
    "a cluster of two before one block"): rmsnorm_bwd 6144 / 8192 / 24576 / 32768 0.91 /
    0.92 / 0.91 / 0.92 -> 0.96 / 0.93 / 0.96 / 0.93 (three stages; two stages there ran
    0.72-0.87), from two stages at one block 19456 / 20480 / 21504 / 22528 0.91 / 0.93 /
    0.93 / 0.92 -> 0.96 / 0.97 / 0.98 / 0.98 (17408 even; fp16 17408 0.91 -> 0.95),
    dropout_rmsnorm_bwd 20480 / 24576 0.93 -> 0.95 (two), layernorm_bwd 6144 / 24576 0.81 /
    0.82 -> 0.93 / 0.92 (two), gelu_bwd 32768 0.80 -> 0.84, gelu_tanh_bwd 32768 0.88 ->
    0.93; fp16 alike. Not where two blocks also move a
    buffer to registers (dropout_rmsnorm_bwd 8192, three stages with two in registers: 0.95
    -> 0.84), nor for rows of narrower vectors (rmsnorm_bwd 24578 0.85 -> 0.70 at 1024
    threads) or of 4-byte elements (fp32 rmsnorm_bwd / layernorm_bwd 12288 0.96 / 0.94 ->
    0.84 / 0.86), but for vectors of two 2-byte elements where one block is one stage at one
    block per SM (H100, bf16, 512 threads: layernorm_bwd 24578 0.82 -> 0.92; 24574 at 1024
    threads in the cluster ran 0.73)."""
    if two.stages < 2 or not two.buffers_in_smem:
        return None
    in_registers = [p.tensor for p in one.placements if p.storage is Storage.REGISTERS]
    one_stage = not in_registers and one.stages == 1 and one.blocks_per_sm == 1
    one_stage_why = "one block keeps the row on chip only at one stage and one block per SM"
    if _vectors_of_two_2_byte_elements(fusion, one.vec):  # the one-stage rule alone measured
        return one_stage_why if one_stage else None
    if not _wide_vectors_of_2_bytes(fusion, one.vec):
        return None
    if in_registers:
        return f"one block keeps the row on chip only with {', '.join(in_registers)} in registers"
    if one_stage:
        return one_stage_why
    if one.stages == 2 and one.blocks_per_sm == 1 and two.stages == 3:
        return "one block keeps the row on chip in two stages at one block per SM, two in three"
    return None


def _packed_first_why(fusion: RowFusion, geo: RowGeometry) -> str | None:
    """Why packed rows over a cluster go before one block's rows (RowPolicy.packed_first), or
    None: each thread's column-sum registers (vectors x elements x sums, in 4-byte words)
    come to PACKED_FIRST_WORDS, in 16-byte vectors of 2-byte elements or narrower (the
    schedule must also keep every buffer in shared memory: _packed_first_keeps). Such a
    thread keeps 8 to 20 vectors of a row in flight, where one block of 512 threads keeps 2
    to 4. H200, 16384 rows, fraction of the copy, before -> after, bf16 (fp16 alike;
    bench/TUNING.md, "packed rows over a cluster first"): rmsnorm_bwd 16384 / 32768 0.92 /
    0.92 -> 0.96 / 0.93 (one stage over 2 / 4 blocks, 128 words), layernorm_bwd 16384 /
    20480 / 32768 0.87 / 0.88 / 0.90 -> 0.95 / 0.95 / 0.94 (two stages over 4 / 4 / 8
    blocks, 128 / 160 / 128 words). Not where they lost or gained nothing: fewer words
    (rmsnorm_bwd 20480 over 4 blocks: 80 words, 0.94 -> 0.83; 24576: 96, 0.95 -> 0.93;
    layernorm_bwd 12288: 96, 0.89 -> 0.87), more (layernorm_bwd 24576: 192, 0.92 -> 0.76),
    or a last round of vectors some threads have and others not (layernorm_bwd 16392 /
    29696 / 40000, rmsnorm_bwd 31744: 0.79 / 0.88 / 0.89 / 0.96 -> 0.63 / 0.76 / 0.71 /
    0.77, where whole rounds gained: layernorm_bwd 10240 0.84 -> 0.94, 36864 0.92 -> 0.93).
    Rows in narrower vectors and of 4-byte elements were not measured."""
    if not _wide_vectors_of_2_bytes(fusion, geo.vec) or not geo.whole_rounds:
        return None
    words = geo.batch * geo.vec * sum(fusion.accumulator_bytes) // 4
    if not PACKED_FIRST_WORDS[0] <= words <= PACKED_FIRST_WORDS[1]:
        return None
    return (f"packed rows over a cluster of {geo.cluster} first: {words} registers of column "
            "sums a thread, every buffer in shared memory")


def _fewer_rows_why(fusion: RowFusion, first: RowSchedule) -> str | None:
    """Why blocks of fewer rows in three stages go before the search's first schedule
    (RowPolicy.fewer_rows_first), or None: packed rows keep one block per SM in two stages,
    every buffer in shared memory, on one block or a cluster of two, where three stages of
    them do not fit; for fusions _three_stages takes (a row reduction, at most one column
    sum, elements of 2 bytes or narrower in 16-byte vectors, rows not skewed). Then two rows
    of 128 threads a block in three stages, else one, where either keeps every buffer in
    shared memory: more rows' copies in flight while a block computes and meets at its
    barrier. H200, 16384 rows, fraction of the copy, the tree before -> the rule, median of
    two runs each (bench/TUNING.md, "fewer rows in three stages"): dropout_rmsnorm_bwd bf16
    3072 / 6144 / 7168 0.87 / 0.89 / 0.92 -> 0.97 / 0.98 / 0.95 (two rows, one, one),
    rmsnorm_bwd 5120 0.83 -> 0.95 (two); fp16 0.92 / 0.93 / 0.95 -> 0.98 / 0.98 / 0.96 and
    0.85 -> 0.95. Not where the packed rows already have three stages (rmsnorm_bwd 3072 /
    6144: 0.93 / 0.97 against 0.89 / 0.93-0.94 with fewer rows) or one stage
    (dropout_rmsnorm_bwd 8192: 0.95 against 0.84), nor with two column sums (layernorm_bwd
    3072 / 6144 0.92 / 0.94 against 0.83 / 0.90), nor where packed rows moved a buffer to
    registers (dropout_rmsnorm_bwd 4096: 0.93 against 0.92). Measured on the H200 only; on
    the A100 preset it moves rmsnorm_bwd 4096 (bf16, fp16), which the H200 keeps packed in
    three stages."""
    packed_rows = POLICY.packed
    if (packed_rows is None or first.skew or not _three_stage_fusion(fusion)
            or fusion.narrow(first.vec)):
        return None
    if (first.threads_per_row != packed_rows.threads_per_row or first.rows_per_block < 2
            or first.blocks_per_sm != 1 or first.stages != 2 or first.cluster > 2
            or not first.buffers_in_smem):
        return None
    return ("packed rows keep one block per SM in two stages: fewer rows a block in three "
            "stages first")


def _packed_first_keeps(s: RowSchedule) -> bool:
    """Whether a packed schedule over a cluster may go first (_packed_first_why): every
    buffer in shared memory, the column sums in registers (dropout_rmsnorm_bwd 16384 with a
    row input out of shared memory: 0.94 -> 0.72), and blocks of one stage in a cluster of
    at most PACKED_FIRST_ONE_STAGE_CLUSTER (rmsnorm_bwd 65536, one stage over 8 blocks: 0.97
    -> 0.92; a block with no next row in flight waits out each row's meeting of its
    cluster)."""
    return (s.accumulators is Storage.REGISTERS and s.buffers_in_smem
            and (s.stages > 1 or s.cluster <= PACKED_FIRST_ONE_STAGE_CLUSTER))


# A thread's column-sum registers, fewest and most, where packed rows over a cluster go
# first, and the largest cluster of blocks of one stage that does (_packed_first_why,
# _packed_first_keeps).
PACKED_FIRST_WORDS = (128, 160)
PACKED_FIRST_ONE_STAGE_CLUSTER = 4


# Short rows take a second stage while one stage fills less than this share of an SM's
# shared memory. H200, 16384 rows, fraction of the copy, one stage -> two, blocks per SM
# kept (bench/TUNING.md, "two stages for short rows"): bf16 layernorm_bwd 1024 / 2048 0.77 /
# 0.80 -> 0.83 / 0.88 (one stage 78 / 104 KB per SM), gelu_bwd 1024 / 4096 0.70 / 0.72 ->
# 0.77 / 0.78; rmsnorm_bwd 1024 even (89 KB); fp32 gelu_bwd 1024 0.85 -> 0.79 and
# layernorm_bwd 1000 0.89 -> 0.87, with one stage already 121 / 130 KB per SM.
_TWO_STAGES_BELOW = 0.5


# Shared memory first: cp.async keeps the loads in flight, so rows want more warps and fewer
# vectors per thread than registers do ("smem-first geometry" in bench/TUNING.md).
POLICY = RowPolicy(
    scheduler="inner_outer_persistent",
    name="smem-first",
    # Rows past the packed ones (bf16 from 16384): 2 vectors per thread, up to 512 threads
    vectors_per_thread=2,
    one_vector_up_to=128,  # one vector per thread up to 128 threads per row
    max_threads_per_row=512,  # unless that leaves a thread more than 8 vectors
    staged_passes=1,  # smem first: every fusion's rows are staged first
    # single-element vectors (4099) at 512 threads: rmsnorm_bwd 0.29 -> 0.53, dropout_rmsnorm_bwd
    # 0.44 -> 0.77, layernorm_bwd 0.23 -> 0.45 (H200); vectors of 2 bf16 (4 bytes): H100, bf16,
    # 1024 threads -> 512, layernorm_bwd 12290 0.87 -> 0.93, gelu_bwd 12290 0.84 -> 0.89, the
    # rest even; where that leaves one block one stage at one block per SM, rows go over a
    # cluster of two first (_split_first) ("odd sizes" in bench/TUNING.md). Vectors of 8 bytes
    # (fp32 24578) keep the policy's threads: not measured since 2026-12-01's mixed results.
    staged_narrow_threads=512,
    staged_narrow_bytes=4,
    # Narrow rows of two column sums (LayerNorm backward's weight and bias gradients), bf16
    # and fp16, at 256 threads: four or three blocks per SM where 512 left two. H100, bf16,
    # the tree before against this: layernorm_bwd 2050 / 3001 / 4099 0.57 / 0.71 / 0.74 ->
    # 0.73 / 0.75 / 0.80 (up to 17 vectors a thread); 5001 (20) 0.80 -> 0.79 and 6147 (25)
    # lost, fp32 3001 0.90 -> 0.88, and rows of one column sum lost or held (rmsnorm_bwd 3001
    # 0.83 -> 0.77) ("narrow rows of two column sums" in bench/TUNING.md)
    staged_narrow_sums=NarrowSums(column_sums=2, element_bytes=2, threads=256, vectors=17),
    min_block_threads=128,  # small blocks: more fit an SM, so more rows are in flight
    partials_pack=0.5,  # two rows per block where partial rows weigh half a row or more
    # a thread's column sums hold 8 fp32 lanes per vector: 128 threads for 4099's 514
    # vectors, against 64 (H200 bf16, skewed=True): rmsnorm_bwd 0.43 -> 0.59,
    # dropout_rmsnorm_bwd 0.52 -> 0.65, layernorm_bwd 0.50 -> 0.52 ("skewed rows", column sums)
    skewed_vectors_per_thread=3,
    on_chip=smem_first_order,
    # Rows of 65 to 1024 vectors (bf16 1024 to 8192) of fusions with row reductions: 64
    # threads each, 4 to a block. Against 128-512 threads and one or two rows a block (H200,
    # bf16): rmsnorm_bwd 4096 / 8192 0.81 / 0.88 -> 0.87 / 0.93, dropout_rmsnorm_bwd 0.89 /
    # 0.88 -> 0.92 / 0.96, layernorm_bwd 0.68 / 0.86 -> 0.88 / 0.93 ("packed backward rows"
    # in bench/TUNING.md)
    packed=PackedRows(threads_per_row=64, rows_per_block=4, vectors_per_thread=16,
                      above_vectors=64),
    split_first=_split_first,
    packed_first=PackedFirst(_packed_first_why, _packed_first_keeps),
    fewer_rows_first=FewerRowsFirst(_fewer_rows_why, threads_per_row=128, rows_per_block=(2, 1),
                                    stages=3),
)


def can_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    if info.kind not in (Kind.INNER_OUTER, Kind.OUTER):
        return f"inner_outer_persistent needs outer reductions; this fusion is {info.kind.value}"
    return None


def candidates(info: FusionInfo, problem: Problem, device: DeviceSpec,
               hints: Hints | None = None) -> Iterator[RowSchedule]:
    """Fitting schedules, best first (row_search.RowSearch)."""
    return RowSearch(info, problem, device, POLICY, hints).candidates()
