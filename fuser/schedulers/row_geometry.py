"""Row geometry: how a row is cut into vectors and dealt to the threads of a block (or of a
cluster of blocks), and how many blocks fit an SM. Pure functions over records; the numbers
that steer them are the policies' (inner_persistent.POLICY, inner_outer_persistent.POLICY)
and the few below, shared by both."""

from __future__ import annotations

from fuser.analysis import Role
from fuser.device import DeviceSpec
from fuser.schedulers.base import Problem, ceil_div, next_pow2, pick_vec
from fuser.schedulers.hints import CLUSTER_SIZES, Hints
from fuser.schedulers.row_records import PackedRows, RowFusion, RowGeometry, RowPolicy

# More vectors per thread than this take every thread of a block instead (the unrolled loads
# and register arrays of a thread grow with its vectors).
MAX_VECTORS_PER_THREAD = 8
# Where a policy lowers a row's threads (staged_narrow_threads; RowSearch._halved in
# row_search), a thread owns at most this many vectors: beyond it (hidden 65537, 129
# single-element vectors a thread at 512 threads) the capped rows ran 4-16% slower than at the
# policy's own threads, and halved backward rows of 33 lost to a larger cluster.
MAX_STAGED_VECTORS_PER_THREAD = 32
# Rows short enough that one stage of shared memory holds this many of them per SM try one
# stage before two: the blocks resident on an SM then overlap each other's loads, and a second
# stage would only halve the rows in flight (bench/TUNING.md, "one stage for short rows").
SHORT_ROWS_PER_SM = 12


def row_split(hidden: int, itemsizes: tuple[int, ...] | list[int], align_bytes: int,
              policy: RowPolicy, device: DeviceSpec, threads_per_row: int | None = None,
              parts: int = 1, *, input_bytes: int, max_staged_threads: int | None = None,
              packed_rows: PackedRows | None = None) -> tuple[int, int, int]:
    """(vec, threads per row, batch) of a row cut into `parts` equal ranges of vectors.

    vec divides hidden, so the vectors cover the row exactly; a range's vector v =
    b * threads_per_row + x (b < batch) goes to thread x, and batch is the fewest rounds that
    reach the last vector. Threads per row: the packed threads per row where `packed_rows`
    (packed()) hold this many vectors; else enough for the policy's vectors per thread (one
    each in rows of up to policy.one_vector_up_to vectors), a power of two, at most the
    policy's maximum, unless that leaves a thread more than MAX_VECTORS_PER_THREAD; at most
    `max_staged_threads` either way where one is given (staged_cap()) and leaves a thread no
    more than MAX_STAGED_VECTORS_PER_THREAD.
    """
    vec = pick_vec(hidden, list(itemsizes), align_bytes, input_bytes=input_bytes)
    vectors = ceil_div(hidden // vec, parts)
    if not threads_per_row and packed_rows is not None and packed_rows.holds(vectors):
        return vec, packed_rows.threads_per_row, ceil_div(vectors, packed_rows.threads_per_row)
    per_thread = (1 if vectors <= policy.one_vector_up_to else policy.vectors_per_thread)
    tpr = threads_per_row or min(policy.max_threads_per_row,
                                 next_pow2(ceil_div(vectors, per_thread)))
    if not threads_per_row and ceil_div(vectors, tpr) > MAX_VECTORS_PER_THREAD:
        tpr = device.max_threads_per_block
    if (not threads_per_row and max_staged_threads is not None
            and ceil_div(vectors, max_staged_threads) <= MAX_STAGED_VECTORS_PER_THREAD):
        tpr = min(tpr, max_staged_threads)
    return vec, tpr, ceil_div(vectors, tpr)


def packed(fusion: RowFusion, policy: RowPolicy) -> PackedRows | None:
    """The policy's packed rows (RowPolicy.packed) where this fusion's rows may be packed
    several to a block, else None: only rows that reduce, since packing serves the row
    reductions' barriers (column sums alone lost with it: gelu_bwd bf16 8192 0.86 -> 0.66 of
    the copy)."""
    return policy.packed if fusion.width > 0 else None


def staged_cap(fusion: RowFusion, problem: Problem, policy: RowPolicy) -> int | None:
    """policy.staged_narrow_threads where the policy stages this fusion's rows first (its
    passes reach policy.staged_passes) and their vectors are narrower than 16 bytes, of at
    most policy.staged_narrow_bytes (of the widest row input's elements); fewer where the
    fusion has policy.staged_narrow_sums' column sums and a thread keeps few enough vectors
    at its threads."""
    if not policy.stages_first(fusion.passes):
        return None
    vec = fusion.vec(problem)
    if not (fusion.narrow(vec) and vec * fusion.widest <= policy.staged_narrow_bytes):
        return None
    sums = policy.staged_narrow_sums
    if (sums is not None and len(fusion.info.outer_reductions) >= sums.column_sums
            and fusion.widest <= sums.element_bytes
            and ceil_div(problem.hidden, vec * sums.threads) <= sums.vectors):
        return sums.threads
    return policy.staged_narrow_threads


def fusion_split(fusion: RowFusion, problem: Problem, policy: RowPolicy, device: DeviceSpec,
                 threads_per_row: int | None, parts: int) -> tuple[int, int, int]:
    """row_split of this fusion's rows: its tensors' item sizes, the policy's limit on the
    threads of narrow staged rows (staged_cap) and its packed rows (packed())."""
    return row_split(problem.hidden, fusion.itemsizes, problem.align_bytes, policy, device,
                     threads_per_row, parts, input_bytes=fusion.input_bytes,
                     max_staged_threads=staged_cap(fusion, problem, policy),
                     packed_rows=packed(fusion, policy))


def min_block_threads(fusion: RowFusion, policy: RowPolicy) -> int:
    """Threads a block of short rows reaches by packing rows: twice the policy's minimum
    where the column reductions' partial rows weigh policy.partials_pack of a row's bytes
    (two rows to a block halve the partial rows written and summed)."""
    pack = policy.partials_pack
    if pack is not None and fusion.accumulator_bytes and (
            sum(fusion.accumulator_bytes) >= pack * fusion.row_bytes):
        return 2 * policy.min_block_threads
    return policy.min_block_threads


def geometry(fusion: RowFusion, problem: Problem, device: DeviceSpec, policy: RowPolicy,
             hints: Hints, cluster: int) -> RowGeometry:
    """The geometry of rows split over `cluster` blocks, with the hinted threads per row and
    rows per block where given. Rows per block: as many as reach min_block_threads (at least
    the policy's packed rows where those hold), no more than the rows there are (rounded up
    to a power of two)."""
    vec, tpr, batch = fusion_split(fusion, problem, policy, device, hints.threads_per_row,
                                   cluster)
    wanted = min_block_threads(fusion, policy) // tpr
    rows_packed = packed(fusion, policy)
    if (rows_packed is not None and tpr == rows_packed.threads_per_row
            and rows_packed.holds(ceil_div(problem.hidden // vec, cluster))):
        wanted = max(wanted, rows_packed.rows_per_block)
    if only_column_sums(fusion) and cluster == 1:
        whole = device.max_threads_per_block // tpr
        if 2 * whole * problem.hidden * fusion.row_bytes <= device.smem_per_sm // 2:
            wanted = max(wanted, whole)
    rows = hints.rows_per_block or max(1, min(wanted, next_pow2(max(problem.rows, 1))))
    return RowGeometry(problem.hidden, vec, tpr, batch, cluster, rows)


def only_column_sums(fusion: RowFusion) -> bool:
    """A fusion whose rows only feed column sums (no row reduction, no output of every
    element): its blocks do nothing per row but add it up, and a block's partial row (4 or 8
    bytes a column, written and summed again) weighs as much as a few of its rows. Such rows
    take blocks of the device's most threads, one per SM where two stages of them take half
    its shared memory: fewer partial rows, as many rows in flight. H100, fp16, the column
    sums of [8192, 4096] (and per group of [8, 1024, 4096]), fuser's own time: one row of
    256 threads a block, four blocks per SM, 62.8 (64.1) us; four rows a block, one per SM,
    34.3 (42.2) us (the copy of the same bytes 24 us)."""
    info = fusion.info
    return bool(info.outer_reductions) and not info.inner_levels and not info.outputs(Role.FULL)


def cluster_sizes(fusion: RowFusion, problem: Problem, device: DeviceSpec) -> list[int]:
    """Blocks a row may be split over here, in order: 1, then 2, 4 and 8 on sm_90 while every
    block keeps at least one vector."""
    vectors = problem.hidden // fusion.vec(problem)
    return [1] + [k for k in CLUSTER_SIZES if device.arch >= 90 and k <= vectors]


def blocks_per_sm(device: DeviceSpec, threads: int, regs: int, smem_total: int) -> int:
    """Resident blocks per SM by threads, registers and shared memory (with the reserve)."""
    by_threads = device.max_threads_per_sm // threads
    by_regs = device.regs_per_sm // (regs * threads)
    return max(0, min(device.max_blocks_per_sm, by_threads, by_regs,
                      blocks_by_smem(device, smem_total)))


def register_limit(device: DeviceSpec, threads: int, blocks: int) -> int:
    """Registers a thread may hold where `blocks` blocks of `threads` threads share an SM (what
    __launch_bounds__(threads, blocks) leaves ptxas: the register file over blocks x threads,
    in steps of 8, at most the per-thread maximum)."""
    per_thread = device.regs_per_sm // (blocks * threads) // 8 * 8
    return min(device.max_regs_per_thread, per_thread)


def blocks_by_smem(device: DeviceSpec, smem_total: int) -> int:
    """Blocks of `smem_total` bytes (dynamic + static slot) that fit in an SM's shared memory,
    each with the driver's reserve."""
    return device.smem_per_sm // (smem_total + device.reserved_smem_per_block)


def stage_bytes(fusion: RowFusion, part: int) -> int:
    """Bytes of one stage of a row part of `part` elements: every row buffer of the fusion."""
    return part * fusion.info.row_buffer_bytes


def over_half_an_sm(nbytes: int, device: DeviceSpec) -> bool:
    """Whether `nbytes` fill more than half an SM's shared memory: two of them do not fit."""
    return nbytes > device.smem_per_sm // 2


def short_rows(fusion: RowFusion, part: int, device: DeviceSpec) -> bool:
    """Whether one stage of shared memory holds SHORT_ROWS_PER_SM rows of `part` elements."""
    return device.smem_per_sm // max(stage_bytes(fusion, part), 1) >= SHORT_ROWS_PER_SM
