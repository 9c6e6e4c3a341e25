"""Geometry and storage search shared by the persistent (row) schedulers.

The persistent schedulers differ in their storage policy, not in the shape of the kernel:
inner_persistent keeps rows in registers first (RMSNorm forward: the row is read once and
normalized from registers), except that fusions of three passes over each row (softmax,
LayerNorm forward) stage their rows in shared memory first; inner_outer_persistent stages
rows in shared memory first (backward norms: five or more row buffers plus fp32
weight-gradient accumulators would not fit in registers). This module turns a policy into a
concrete schedule: it enumerates the storage candidates in policy order and takes the first
whose shared memory and registers fit the device with at least one resident block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

from fuser.analysis import FusionInfo, Role
from fuser.device import DeviceSpec
from fuser.errors import OutOfResourcesError
from fuser.ir import Tensor
from fuser.schedulers.base import (
    GLOBAL,
    REGISTERS,
    RING,
    SMEM,
    Placement,
    Problem,
    RowSchedule,
    aligned_row_bytes,
    aligned_row_chunks,
    ceil_div,
    next_pow2,
    pick_vec,
)
from fuser.schedulers.staging import RING_BYTES, RING_DEPTHS, bulk_aligned, plan_ring
from fuser.smem import SmemPlan

# Threads per row, by storage policy (smem_first). Rows kept in registers want a few vectors
# per thread (~32 bf16 elements: loads in flight without a pipeline). Rows staged in shared
# memory have cp.async keep loads in flight and want more warps: one vector per thread up to
# 128 threads per row, then two, at most 512 threads unless that leaves a thread more than 8
# vectors. Small blocks pay there: more of them fit an SM, so more rows are in flight. As the
# row kernel's fraction of the copy bandwidth on the H200 (bf16, 16384 rows, 2026-11-30):
# rmsnorm_bwd at hidden 1024 ran 0.94 with 128-thread blocks of one row against 0.88 with
# 256-thread blocks of two; at 2048, 0.89 with 128 threads of 2 vectors each (8 blocks per
# SM) against 0.78 with 256 threads of one; at 4096 / 8192, 0.91 / 0.88 with 2 vectors per
# thread against 0.69 / 0.70 with 1 and 0.36 with 4; dropout_rmsnorm_bwd at 1024 ran 1.05
# (the copy of its bytes is slower than the kernel) against 0.88, and at 16384 0.94 with 512
# threads against 0.80 with 1024. Rows packed several to a block with more than one vector per
# thread ran at a third of that (rmsnorm_bwd 4096, 2 rows of 256 threads: 0.33); the PTX
# showed the output vectors stored element by element, which fm::store_vector now prevents (not
# re-measured yet: the one-row blocks above were faster with one vector per thread too).
TARGET_VECTORS_PER_THREAD = {False: 4, True: 2}
ONE_VECTOR_UP_TO = 128  # smem-first: threads per row that still get one vector each
MAX_THREADS_PER_ROW = {False: 1024, True: 512}
MAX_VECTORS_PER_THREAD = 8
CLUSTER_SIZES = (2, 4, 8)  # blocks a row is split over, in order, when one block cannot hold it
# Short rows are packed several to a block up to this many threads, by policy (smem_first).
MIN_BLOCK_THREADS = {False: 256, True: 128}
# Blocks of one row each write a partial row per outer reduction; packing two rows to a block
# halves those partial rows (workspace writes, and the finalize's reads). Where the partial
# rows weigh at least PACK_FOR_PARTIALS of a row's own bytes (4 B per outer reduction against
# the bytes of every full input and output per element), smem-first blocks take 256 threads.
# H200, bf16, 16384 rows, two rows of 128 threads against one: rmsnorm_bwd (4 B against 6,
# 0.67) 2048 64.9 against 69.0 us, 1024 even; layernorm_bwd (8 against 6) 1024 51.0 against
# 58.9, 2048 79.7 against 92.3; dropout_rmsnorm_bwd (4 against 11) 1024 65.1 against 60.6.
PACK_FOR_PARTIALS = 0.5
# Registers beyond the buffers: indices, pointers, loop state, reduction temporaries. A kernel
# cannot do with fewer than MIN_OVERHEAD; the residency is planned with PLANNED_OVERHEAD, and
# kernels.build() lowers it when ptxas spills.
MIN_OVERHEAD_REGISTERS = 16
SHORT_ROWS_PER_SM = 12  # rows per SM one stage must hold to skip the two-stage pipeline
PARTIAL_UNROLL = 4  # batch iterations unrolled when no register array needs all of them
PLANNED_OVERHEAD_REGISTERS = 32
# Registers-first kernels of this many passes over each row (softmax, LayerNorm: two
# reduction levels and the output) stage their rows in shared memory before trying registers:
# the row is read from global memory once and its later passes read shared memory, where
# registers or a ring of whole rows (which refetches the row from L2 every pass) measured
# slower. H200, bf16, 16384 rows, row kernel in us, staged / ring / registers: softmax_fwd
# 2048 43.2 / 45.2, 4096 79.8 / 83.2, 8192 153.9 / 160.6, 16384 307.9 / 361.3,
# 24578 684.1 / - / 818.9; layernorm_fwd 16384 278.7 / 295.2.
STAGED_PASSES_FIRST = 3
# Registers-first kernels whose register plan leaves one block per SM stream their rows
# through a staging ring where one fits, for rows of at least RING_MIN_THREADS threads
# (measured from there: 2048 bf16 elements); see ring_first in _candidates.
RING_MIN_THREADS = 64


@dataclass(frozen=True)
class Hints:
    """Overrides for tuning and tests; None lets the heuristic decide."""

    threads_per_row: int | None = None
    rows_per_block: int | None = None
    cluster: int | None = None  # blocks of a thread-block cluster sharing each row (sm_90)
    stages: int | None = None
    # (tensor name, REGISTERS | SMEM | GLOBAL | RING); tensors not named are in registers
    storage: tuple[tuple[str, str], ...] | None = None
    finalize_lanes: int | None = None  # threads summing one column's partial rows (finalize)
    # Fill smem row buffers with 16-byte copies from below each row's start (RowSchedule.
    # aligned_copy) where vec is narrower than 16 bytes and the inputs are 16-byte aligned.
    # None and True: wherever that holds; False: never (copies of vec bytes).
    aligned_copy: bool | None = None


def _weight_related(t: Tensor, info: FusionInfo) -> bool:
    """True when values of `t` meet a column input before any reduction (grad_out * weight):
    such a buffer is re-read with the weight every row, so it stays in smem longest."""
    fusion = info.fusion
    stack, seen = [t], {t}
    while stack:
        v = stack.pop()
        for e in fusion.uses(v):
            if e.op in ("sum", "max"):
                continue
            if any(info.roles[i] is Role.COL for i in e.inputs):
                return True
            for o in e.outputs:
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return False


def _short_rows(info: FusionInfo, hidden: int, device: DeviceSpec) -> bool:
    """Rows short enough that one stage of shared memory holds SHORT_ROWS_PER_SM of them: the
    blocks resident on an SM then overlap each other's loads, and a second stage would only
    halve how many rows are in flight (measured on the H200: dropout_rmsnorm_bwd, bf16, hidden
    2048 ran 0.72 of the copy with one stage, 0.37 with two; at 8192, 0.75 against 0.88)."""
    row_bytes = hidden * info.row_buffer_bytes
    return device.smem_per_sm // max(row_bytes, 1) >= SHORT_ROWS_PER_SM


def _regs_per_vectors(batch: int, vec: int, itemsize: int) -> int:
    return ceil_div(batch * vec * itemsize, 4)


def blocks_per_sm(device: DeviceSpec, threads: int, regs: int, smem_total: int) -> int:
    """Resident blocks per SM by threads, registers and shared memory (with the reserve)."""
    by_threads = device.max_threads_per_sm // threads
    by_regs = device.regs_per_sm // (regs * threads)
    by_smem = device.smem_per_sm // (smem_total + device.reserved_smem_per_block)
    return max(0, min(device.max_blocks_per_sm, by_threads, by_regs, by_smem))


def row_split(hidden: int, itemsizes: list[int], align_bytes: int, smem_first: bool,
              device: DeviceSpec, threads_per_row: int | None = None,
              parts: int = 1) -> tuple[int, int, int]:
    """(vec, threads per row, batch): how a row is cut into vectors and dealt to threads.

    The row's vectors are split into `parts` equal ranges (the blocks of a cluster; one range
    without a cluster). In a range, vector v = b * threads_per_row + x (b < batch) goes to
    thread x; its vec elements are v * vec ... v * vec + vec - 1. vec divides hidden, so the
    vectors cover the row exactly, and batch is the fewest rounds that reach the last vector.
    """
    vec = pick_vec(hidden, itemsizes, align_bytes)
    vectors = ceil_div(hidden // vec, parts)
    per_thread = 1 if smem_first and vectors <= ONE_VECTOR_UP_TO else (
        TARGET_VECTORS_PER_THREAD[smem_first])
    tpr = threads_per_row or min(
        MAX_THREADS_PER_ROW[smem_first], next_pow2(ceil_div(vectors, per_thread))
    )
    if not threads_per_row and ceil_div(vectors, tpr) > MAX_VECTORS_PER_THREAD:
        tpr = device.max_threads_per_block
    return vec, tpr, ceil_div(vectors, tpr)


def row_schedule_candidates(
    info: FusionInfo,
    problem: Problem,
    device: DeviceSpec,
    scheduler: str,
    smem_first: bool,
    hints: Hints | None = None,
) -> Iterator[RowSchedule]:
    """Every schedule whose estimated shared memory and registers fit, in policy order.

    The first is the heuristic's choice; kernels.build() moves on to the next when ptxas
    shows that an estimate was wrong (spills at one block per SM). Rows stay on chip as long
    as any cluster size can hold them there: one block first, then the row split over 2, 4
    and 8 blocks of a cluster (sm_90), and only then re-read from global memory in every
    pass (through a staging ring where one fits), split over the largest cluster, which keeps
    the most of the row on chip. Registers-first kernels of STAGED_PASSES_FIRST passes try
    their rows in shared memory before registers, and the others take a ring of whole rows
    before registers where that measured faster (ring_first in _candidates).
    """
    hints = hints or Hints()
    tried: list[str] = []
    itemsizes = [t.dtype.itemsize
                 for t in (*info.full_inputs, *info.col_inputs, *info.outputs(Role.FULL))]
    if hints.cluster is not None or hints.storage is not None:
        phases = [(hints.cluster or 1, None, "as hinted")]
    else:
        vectors = problem.hidden // pick_vec(problem.hidden, itemsizes, problem.align_bytes)
        splits = [1] + [k for k in CLUSTER_SIZES if device.arch >= 90 and k <= vectors]
        phases = [(1, False, "")]
        phases += [(k, False, "the plans for fewer blocks do not keep the row on chip")
                   for k in splits[1:]]
        phases.append((splits[-1], True, f"{splits[-1]} block(s) cannot keep the row on chip"))
    for cluster, off_chip, why in phases:
        def of_phase(chunked: bool, cluster=cluster, off_chip=off_chip, why=why):
            return _candidates(info, problem, device, scheduler, smem_first, hints, itemsizes,
                               cluster, off_chip, why, tried, chunked)
        yield from _copy_choice(of_phase, hints)
    raise OutOfResourcesError(
        f"no storage fits one row of hidden {problem.hidden} ({info.row_buffer_bytes} B per "
        f"element of row buffers) on {device.name}: shared memory limit "
        f"{device.smem_per_block_optin} B per block. Tried:\n  "
        + "\n  ".join(list(dict.fromkeys(tried))[-6:])
        + "\nUse a device with more shared memory or a smaller hidden size."
    )


def _rereads(s: RowSchedule) -> int:
    """Row buffers (and accumulators) a schedule keeps in global memory, re-read every pass."""
    return (sum(p.role == "full" and p.storage in (GLOBAL, RING) for p in s.placements)
            + (s.accumulators == GLOBAL))


def _copy_choice(of_phase, hints: Hints) -> Iterable[RowSchedule]:
    """One phase's candidates, those with aligned 16-byte row copies first, unless their
    slightly larger row slots (up to 15 bytes per row) leave more buffers re-read from global
    memory than copies of vec bytes do (the 100 KB part at hidden 24578 would re-read two
    input rows instead of one input row and the weight)."""
    if hints.aligned_copy is False:
        return of_phase(False)
    chunked = of_phase(True)
    first = next(chunked, None)
    if first is None:
        return of_phase(False)
    if not first.aligned_copy:  # no row buffer to copy in chunks: the same plans either way
        return chain([first], chunked)
    plain = of_phase(False)
    other = next(plain, None)
    if other is not None and _rereads(other) < _rereads(first):
        return chain([other], plain, [first], chunked)
    return chain([first], chunked, [other] if other is not None else [], plain)


def _accumulator_bytes(info: FusionInfo) -> list[int]:
    """Bytes per element of each outer reduction's accumulator (and partial row)."""
    return [8 if e.outputs[0].dtype.compute_type == "double" else 4
            for e in info.outer_reductions]


def _min_block_threads(info: FusionInfo, smem_first: bool) -> int:
    """Threads a block of short rows reaches by packing rows (see PACK_FOR_PARTIALS)."""
    if smem_first and info.outer_reductions:
        row_bytes = sum(t.dtype.itemsize for t in (*info.full_inputs, *info.outputs(Role.FULL)))
        if sum(_accumulator_bytes(info)) >= PACK_FOR_PARTIALS * row_bytes:
            return 2 * MIN_BLOCK_THREADS[smem_first]
    return MIN_BLOCK_THREADS[smem_first]


def _split_words(hidden: int, part: int, cluster: int) -> str:
    """'a cluster of 4 blocks of 16386 elements (16386+16386+16386+16380)': each block's
    share of the row, listed when they differ (the last ones may hold less, or nothing)."""
    shares = [min(part, max(0, hidden - k * part)) for k in range(cluster)]
    listed = "" if len(set(shares)) == 1 else f" ({'+'.join(map(str, shares))})"
    return f"a cluster of {cluster} blocks of {part} elements{listed}"


def _candidates(info: FusionInfo, problem: Problem, device: DeviceSpec, scheduler: str,
                smem_first: bool, hints: Hints, itemsizes: list[int], cluster: int,
                off_chip: bool | None, why: str, tried: list[str],
                chunked: bool) -> Iterator[RowSchedule]:
    """The fitting schedules of one cluster size: with every row buffer and accumulator on
    chip (off_chip False), with some re-read from global memory (True), or both (None). `why`
    says in the reason why this cluster size and storage were reached; `itemsizes` are those
    of the tensors a row's vectors must suit; `chunked` asks for aligned 16-byte row copies
    where they apply."""
    hidden = problem.hidden
    vec, tpr, batch = row_split(hidden, itemsizes, problem.align_bytes, smem_first, device,
                                hints.threads_per_row, cluster)
    if cluster > 1 and (cluster not in CLUSTER_SIZES or cluster > hidden // vec
                        or device.arch < 90):
        raise OutOfResourcesError(
            f"a cluster of {cluster} blocks per row needs sm_90 ({device.name} is sm_"
            f"{device.arch}), a power of two up to 8, and at least that many vectors "
            f"({hidden // vec} of {vec} elements at hidden {hidden})"
        )
    part = ceil_div(hidden // vec, cluster) * vec  # elements of a row each block keeps
    # 16-byte copies from below the row's (or the block's part's) start need the inputs
    # 16-byte aligned; they pay where the vectors of the widest input are narrower than 16
    # bytes. On the H200 (bf16, 16384 rows, hidden 24578: 2-element vectors) they took
    # dropout_rmsnorm_bwd from 0.57 to 0.82 of the copy bandwidth and rmsnorm_bwd from 0.60
    # to 0.69; where only the bool mask's vectors were narrow (8 bytes at 8192), they cost
    # dropout_rmsnorm_bwd 0.86 -> 0.67.
    aligned = (chunked and problem.align_bytes >= 16
               and vec * max(t.dtype.itemsize for t in info.full_inputs) < 16)
    rpb = hints.rows_per_block or max(
        1, min(_min_block_threads(info, smem_first) // tpr, next_pow2(max(problem.rows, 1)))
    )
    threads = tpr * rpb
    if threads > device.max_threads_per_block:  # another cluster size may need fewer
        tried.append(f"cluster={cluster}: {threads} threads per block ({tpr} per row x {rpb} "
                     f"rows) exceed the device limit of {device.max_threads_per_block}; lower "
                     f"threads_per_row or rows_per_block")
        return

    width = max((len(level) for level in info.inner_levels), default=0)
    double = any(e.outputs[0].dtype.compute_type == "double"
                 for level in info.inner_levels for e in level)
    red_bytes = 8 if double else 4
    warps = max(1, tpr // 32)
    acc_bytes = _accumulator_bytes(info)

    def can_async(t: Tensor) -> bool:
        """cp.async copies 4, 8 or 16 bytes. Narrower vectors (a bool mask at vec 2) are copied
        through registers, which only pays with one stage: a two-stage pipeline would stall
        on the copy, so there they stay in registers. Aligned copies are always 16 bytes."""
        return aligned or vec * t.dtype.itemsize in (4, 8, 16)

    def row_slot_bytes(t: Tensor) -> int:
        return aligned_row_bytes(part, t.dtype.itemsize) if aligned else part * t.dtype.itemsize

    def staged(stages: int) -> dict[str, str]:
        """Every row buffer in smem that `stages` allows there, the others in registers."""
        return {t.name: SMEM if can_async(t) or stages == 1 else REGISTERS for t in full}

    full = list(info.full_inputs)
    # Buffers leave smem for registers in this order: least reused first, weight-related last.
    full.sort(key=lambda t: (_weight_related(t, info), t in info.persistent, t.index))
    cols = list(info.col_inputs)

    def storages():
        """(stages, storage by tensor, accumulator storage), in policy order."""
        if hints.storage is not None:
            forced = dict(hints.storage)
            yield (hints.stages or 1,
                   {t.name: forced.get(t.name, REGISTERS) for t in full + cols}, REGISTERS)
            return
        if off_chip is not True:
            yield from on_chip()
        if off_chip is not False:
            yield from re_read()

    def on_chip():
        stage_options = [hints.stages] if hints.stages else (
            [1, 2] if _short_rows(info, part, device) else [2, 1])
        if smem_first:
            for stages in stage_options:
                for moved in range(len(full) + 1):
                    for cols_in_smem in (True, False):
                        storage = staged(stages)
                        storage.update({t.name: REGISTERS for t in full[:moved]})
                        storage.update({t.name: SMEM if cols_in_smem else REGISTERS
                                        for t in cols})
                        yield (stages if moved < len(full) else 1), storage, REGISTERS
        else:
            in_registers = {t.name: REGISTERS for t in full + cols}
            staged_first = passes >= STAGED_PASSES_FIRST

            def in_smem(col_storages: tuple[str, str]):
                for stages in stage_options:
                    for col_storage in col_storages:
                        yield (stages, {**staged(stages), **{t.name: col_storage for t in cols}},
                               REGISTERS)

            # Rows staged first keep the columns in smem too: in registers they cost blocks
            # per SM (layernorm_fwd 8192: 106 registers, 2 blocks per SM, 178.9 us; in smem
            # 54 registers, 4 blocks, 147.8 us).
            if staged_first:
                yield from in_smem((SMEM, REGISTERS))
            if ring_first(in_registers):
                yield 1, {**{t.name: RING for t in full}, **{t.name: SMEM for t in cols}}, REGISTERS
            yield 1, in_registers, REGISTERS
            if not staged_first:
                yield from in_smem((REGISTERS, SMEM))

    def ring_first(in_registers: dict[str, str]) -> bool:
        """Whether a registers-first kernel streams its rows through a bulk-filled ring of
        whole rows (RING_DEPTHS[0] slots within RING_BYTES, one row per block) instead of
        holding them in registers: where the register plan fits but leaves a single block per
        SM, and rows span at least RING_MIN_THREADS threads. Every pass refetches the row into
        the next slot (from L2), so fusions of STAGED_PASSES_FIRST passes stage rows in shared
        memory before this.
        Measured on the H200 (bf16, 16384 rows, fraction of the copy bandwidth, ring against
        registers): rmsnorm_fwd (two passes) 0.90 / 0.77 at 16384 (one block per SM) but
        0.95 / 0.99, 0.88 / 0.91 and 0.89 / 0.91 at 2048 to 8192 (three blocks per SM). Split
        over a cluster the ring lost (0.38 to 0.67 against 0.65 to 0.91 at 32768 to 131072),
        and copied by cp.async in chunks of a vector per thread too (0.20 to 0.31 at 24578)."""
        row_vectors = hidden // vec  # a chunk of the whole row, in one block
        if (hints.storage is not None or cluster > 1 or tpr < RING_MIN_THREADS
                or not all(bulk_aligned(hidden, vec, t.dtype.itemsize, row_vectors, row_vectors,
                                        1, problem.align_bytes, device.arch) for t in full)
                or RING_DEPTHS[0] * hidden * sum(t.dtype.itemsize for t in full) > RING_BYTES):
            return False
        registers = _schedule(1, in_registers, REGISTERS)
        return registers is not None and registers.blocks_per_sm <= 1

    def re_read():
        # Keep fewer rows on chip and re-read the others in every pass: a row just read is
        # usually still in L2, so the second read costs L2, not HBM, bandwidth. They stream
        # through a staging ring where one fits (sized to the shared memory the row buffers
        # leave, before the column inputs and scratch are placed: a ring that then does not fit
        # moves on to the column inputs' next storage), else they go straight to registers.
        for reread in range(1, len(full) + 1):
            for through in (RING, GLOBAL):
                for col_storage in (SMEM, REGISTERS, GLOBAL):
                    storage = {t.name: SMEM if can_async(t) else REGISTERS for t in full}
                    storage.update({t.name: through for t in full[:reread]})
                    storage.update({t.name: col_storage for t in cols})
                    yield 1, storage, REGISTERS
        # Column accumulators too wide for registers (several outer reductions of a long row)
        # accumulate in shared memory, each thread in its own slots, and when shared memory
        # cannot hold them either, in the block's own partial rows of the workspace (read and
        # written each row; while the partial rows fit in L2, that traffic stays in L2).
        if info.outer_reductions:
            for acc_storage in (SMEM, GLOBAL):
                for through in (RING, GLOBAL):
                    for col_storage in (SMEM, REGISTERS, GLOBAL):
                        yield 1, {**{t.name: through for t in full},
                                  **{t.name: col_storage for t in cols}}, acc_storage

    passes = len(info.inner_levels) + 1  # one per inner reduction level, one for the outputs

    def _schedule(stages: int, storage: dict[str, str], acc_storage: str) -> RowSchedule | None:
        """The schedule of one storage choice, or None (noted in `tried`) when it does not fit.
        A staging ring serves one row per block: storages with one take one row per block
        unless rows_per_block is hinted."""
        rows = 1 if hints.rows_per_block is None and RING in storage.values() else rpb
        block_threads = tpr * rows
        max_regs = min(device.max_regs_per_thread, device.regs_per_block // block_threads)
        scratch = 2 * width * rows * warps * red_bytes if tpr > 32 else 0
        if any(storage[t.name] == SMEM and not can_async(t) for t in full):
            stages = 1  # cp.async fills the two-stage pipeline; a copied row buffer has one
        requests = []
        for t in full:
            if storage[t.name] == SMEM:
                slot = ("" if not aligned else
                        f" in {aligned_row_chunks(part, t.dtype.itemsize)} 16-byte chunks")
                requests.append((f"s_{t.name}", stages * rows * row_slot_bytes(t),
                                 f"row buffer {t.name} ({t.dtype.label}), "
                                 f"{stages} stage(s) x {rows} row(s) x {part}{slot}"))
        if any(storage[t.name] == RING for t in cols):
            tried.append(f"{storage}: a staging ring holds row buffers, not the column inputs "
                         f"{', '.join(t.name for t in cols if storage[t.name] == RING)}; give "
                         f"those {SMEM}, {REGISTERS} or {GLOBAL}")
            return None
        ringed = [t for t in full if storage[t.name] == RING]
        ring = None
        if ringed:
            room = SmemPlan.build(requests, device.smem_per_block_optin).headroom
            planned = plan_ring([(t.name, t.dtype.itemsize) for t in ringed], hidden, vec, tpr,
                                batch, cluster, passes, problem.align_bytes, device.arch,
                                room) if rows == 1 else None
            left = [t.name for t in ringed if planned is None or t.name not in planned[0].tensors]
            if planned is None or (left and hints.storage is not None):
                tried.append(f"cluster={cluster} {storage}: no staging ring for "
                             f"{', '.join(left)} (one row per block, vectors of 4, 8 or 16 "
                             f"bytes, and {room} B of shared memory left at {rows} row(s) "
                             f"per block)")
                return None
            ring, ring_requests = planned
            requests += ring_requests
            storage = {**storage, **{n: GLOBAL for n in left}}  # copied by plain loads
        for t in cols:
            if storage[t.name] == SMEM:
                requests.append((f"s_{t.name}", part * t.dtype.itemsize,
                                 f"column buffer {t.name} ({t.dtype.label}) x {part}"))
        for e, nbytes in zip(info.outer_reductions, acc_bytes, strict=True):
            if acc_storage == SMEM:
                requests.append((f"s_acc_{e.outputs[0].name}", rows * part * nbytes,
                                 f"column accumulator {e.outputs[0].name} x {rows} row(s) "
                                 f"x {part}"))
        requests.append(("s_reduce", scratch, f"inner-reduction scratch: 2 parities x {width} "
                         f"x {rows} row(s) x {warps} warps x {red_bytes} B"))
        if acc_storage == REGISTERS and rows > 1:
            requests.append(("s_outer", sum(part * b for b in acc_bytes),
                             f"outer-reduction combine across {rows} rows"))
        if cluster > 1:
            requests.append(("s_cluster", 2 * width * rows * red_bytes,
                             f"cluster exchange: 2 parities x {width} x {rows} row(s) x "
                             f"{red_bytes} B, read by the {cluster} blocks of the cluster"))
        plan = SmemPlan.build(requests, device.smem_per_block_optin)
        acc_regs = (sum(_regs_per_vectors(batch, vec, b) for b in acc_bytes)
                    if acc_storage == REGISTERS else 0)
        buffers = 2 * vec + acc_regs + sum(
            _regs_per_vectors(batch, vec, t.dtype.itemsize)
            for t in full + cols if storage[t.name] == REGISTERS
        )
        regs = min(max_regs, buffers + PLANNED_OVERHEAD_REGISTERS)
        residency = blocks_per_sm(device, block_threads, regs, plan.total)
        tried.append(f"cluster={cluster} stages={stages}{' aligned copies' if aligned else ''} "
                     f"{storage} accumulators in "
                     f"{acc_storage}: smem {plan.total} B, >= {buffers + MIN_OVERHEAD_REGISTERS} "
                     f"of {max_regs} registers per thread at {block_threads} threads")
        if not (plan.fits and buffers + MIN_OVERHEAD_REGISTERS <= max_regs and residency >= 1):
            return None
        placements = tuple(
            Placement(t.name, t.dtype, "full" if t in info.full_inputs else "col",
                      storage[t.name], storage[t.name] == SMEM and t in full and can_async(t))
            for t in info.fusion.inputs if isinstance(t, Tensor) and t.name in storage
        )
        in_smem = [t.name for t in full + cols if storage[t.name] == SMEM]
        rows_aligned = aligned and any(storage[t.name] == SMEM for t in full)
        split = f", rows split over {_split_words(hidden, part, cluster)}" if cluster > 1 else ""
        reread = [t.name for t in full + cols if storage[t.name] == GLOBAL]
        through_ring = (f", {', '.join(ring.tensors)} re-read each pass through a staging ring "
                        f"({ring.fill}, {ring.depth} slots x {ring.chunks} chunk(s))"
                        if ring else "")
        reason = (
            f"{'smem-first' if smem_first else 'registers-first'} policy: "
            f"{', '.join(in_smem) or ('only the staging ring' if ring else 'nothing')} in smem"
            f"{f' ({stages} stages)' if stages > 1 and in_smem else ''}"
            f"{f', {chr(44).join(reread)} re-read each pass' if reread else ''}{through_ring}"
            f"{', rows copied in aligned 16-byte chunks' if rows_aligned else ''}"
            f"{'' if acc_storage == REGISTERS else f', column accumulators in {acc_storage}'}"
            f"{split}, ~{regs} regs/thread, ~{residency} block(s)/SM"
            f"{f' ({why})' if why else ''}"
        )
        # Register arrays are indexed by the batch loop's counter, so they need it unrolled;
        # with every row in smem or re-read, a partly unrolled loop keeps registers free.
        register_arrays = (acc_storage == REGISTERS and info.outer_reductions) or any(
            storage[t.name] == REGISTERS for t in full + cols)
        return RowSchedule(
            scheduler=scheduler,
            reason=reason,
            hidden=hidden,
            vec=vec,
            threads_per_row=tpr,
            rows_per_block=rows,
            batch=batch,
            cluster=cluster,
            unroll=(batch if register_arrays else ring.units if ring
                    else min(batch, PARTIAL_UNROLL)),
            full_unroll=bool(register_arrays),
            stages=stages if any(storage[t.name] == SMEM for t in full) else 1,
            aligned_copy=rows_aligned,
            placements=placements,
            accumulators=acc_storage,
            ring=ring,
            reduction_bytes=red_bytes,
            regs_estimate=regs,
            blocks_per_sm=residency,
            smem=plan,
        )

    for stages, storage, acc_storage in storages():
        schedule = _schedule(stages, storage, acc_storage)
        if schedule is not None:
            yield schedule
