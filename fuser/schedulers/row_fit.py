"""fit(): one phase of the row search and one storage choice -> a RowSchedule, or a Rejection
naming the limit it broke.

The shared-memory plan is built here (row buffers, the staging ring, column buffers,
accumulators, reduction scratch, the combine of several rows' column sums, the cluster
exchange, in that order), the registers a thread
needs are estimated from the buffers it keeps, and the residency follows from both.
"""

from __future__ import annotations

from dataclasses import replace

from fuser.analysis import Role
from fuser.ir import Tensor
from fuser.schedulers import row_dealing
from fuser.schedulers.base import (
    Dealing,
    Placement,
    RowSchedule,
    StagingRing,
    Storage,
    aligned_row_bytes,
    aligned_row_chunks,
    ceil_div,
    columns_at_skew,
    skewed_column_bytes,
    skewed_columns_at_skew,
)
from fuser.schedulers.row_geometry import blocks_per_sm
from fuser.schedulers.row_records import Phase, Rejection, RowGeometry, StorageChoice
from fuser.schedulers.staging import MBARRIER_BYTES, plan_ring
from fuser.smem import SmemPlan

# Registers a thread needs beyond its buffers (indices, pointers, loop state, reduction
# temporaries): a kernel cannot do with fewer than the minimum; residency is planned with the
# planned overhead, and kernels.build() lowers it when ptxas spills.
MIN_OVERHEAD_REGISTERS = 16
PLANNED_OVERHEAD_REGISTERS = 32
# Batch iterations unrolled when no register array needs the loop fully unrolled.
PARTIAL_UNROLL = 4

Requests = list[tuple[str, int, str]]


def fit(phase: Phase, choice: StorageChoice) -> RowSchedule | Rejection:
    """The schedule of one storage choice, or why it does not fit. A staging ring serves one
    row per block: choices with one take one row per block unless rows_per_block is hinted."""
    storage = choice.by_name
    geo = phase.geometry
    if Storage.RING in storage.values() and phase.hints.rows_per_block is None:
        geo = replace(geo, rows_per_block=1)
    ringed_cols = [t.name for t in phase.fusion.cols if storage[t.name] is Storage.RING]
    if ringed_cols:
        return Rejection(_words(phase, choice), (
            f"a staging ring holds row buffers, not the column inputs {', '.join(ringed_cols)}; "
            f"give those {Storage.SMEM}, {Storage.REGISTERS} or {Storage.GLOBAL}"))
    if geo.skew and Storage.RING in storage.values():
        return Rejection(_words(phase, choice) + " skewed",
                         "a staging ring streams vectors that divide hidden; skewed rows "
                         "keep their vectors in registers, smem or global memory")
    held = [t.name for t in phase.fusion.cols if storage[t.name] is Storage.REGISTERS]
    if geo.skew and held:
        return Rejection(_words(phase, choice) + " skewed",
                         f"a skewed row's lane holds a different column in every row: the "
                         f"columns {', '.join(held)} are read from {Storage.SMEM} or "
                         f"{Storage.GLOBAL}, not kept in {Storage.REGISTERS}")
    if geo.skew and geo.cluster > 1 and geo.rows_per_block > 1:
        kept = [t.name for t in phase.fusion.cols if storage[t.name] is Storage.SMEM]
        sums = [e.outputs[0].name for e in phase.fusion.info.outer_reductions]
        if kept or sums:
            return Rejection(_words(phase, choice) + " skewed", (
                "skewed rows several to a block of a cluster each cover other columns of the "
                "block's part (their skews differ), so the part's "
                + (f"columns {', '.join(kept)} cannot stay in {Storage.SMEM}"
                   if kept else f"column sums {', '.join(sums)} cannot be combined")
                + "; give rows_per_block=1"))
    stages = _stages(phase, choice, storage)
    requests = _row_buffer_requests(phase, geo, storage, stages)
    ring = None
    if any(s is Storage.RING for s in storage.values()):
        planned = _ring(phase, geo, storage, requests)
        if isinstance(planned, Rejection):
            return planned
        ring, ring_requests, storage = planned
        requests += ring_requests
    requests += _other_requests(phase, geo, storage, choice.accumulators)
    plan = SmemPlan.build(requests, phase.device.smem_per_block_optin)
    return _resources(phase, geo, replace(choice, stages=stages), storage, ring, plan)


def _stages(phase: Phase, choice: StorageChoice, storage: dict[str, Storage]) -> int:
    """The stages of row buffers this choice runs: its own where rows are in shared memory
    and cp.async fills every one (a row buffer copied through registers has one stage), else
    one. A staging ring turns only ring buffers into re-read ones, so this holds past it."""
    staged = [t for t in phase.fusion.full if storage[t.name] is Storage.SMEM]
    return choice.stages if staged and all(phase.can_async(t) for t in staged) else 1


def _words(phase: Phase, choice: StorageChoice) -> str:
    return f"cluster={phase.geometry.cluster} {choice}"


def _storage_words(storage: dict[str, Storage]) -> str:
    return "{" + ", ".join(f"{name}: {s}" for name, s in storage.items()) + "}"


def _row_slot_bytes(phase: Phase, part: int, t: Tensor) -> int:
    return (aligned_row_bytes(part, t.dtype.itemsize) if phase.aligned
            else part * t.dtype.itemsize)


def _row_buffer_requests(phase: Phase, geo: RowGeometry, storage: dict[str, Storage],
                         stages: int) -> Requests:
    part, rows = geo.part, geo.rows_per_block
    requests = []
    for t in phase.fusion.full:
        if storage[t.name] is Storage.SMEM:
            slot = (f" in {aligned_row_chunks(part, t.dtype.itemsize)} 16-byte chunks"
                    if phase.aligned else "")
            requests.append((f"s_{t.name}", stages * rows * _row_slot_bytes(phase, part, t),
                             f"row buffer {t.name} ({t.dtype.label}), {stages} stage(s) x "
                             f"{rows} row(s) x {part}{slot}"))
    return requests


def _ring(phase: Phase, geo: RowGeometry, storage: dict[str, Storage], requests: Requests
          ) -> tuple[StagingRing, Requests, dict[str, Storage]] | Rejection:
    """The staging ring of the Storage.RING buffers in the shared memory the row buffers leave, its
    requests, and the storage with the buffers it cannot take re-read by plain loads (refused
    where the storage was hinted)."""
    device, problem = phase.device, phase.problem
    ringed = [t for t in phase.fusion.full if storage[t.name] is Storage.RING]
    room = SmemPlan.build(requests, device.smem_per_block_optin).headroom
    planned = None
    if geo.rows_per_block == 1:
        planned = plan_ring([(t.name, t.dtype.itemsize) for t in ringed], problem.hidden,
                            geo.vec, geo.threads_per_row, geo.batch, geo.cluster,
                            phase.fusion.run_passes, problem.align_bytes, device.arch, room)
    left = [t.name for t in ringed if planned is None or t.name not in planned[0].tensors]
    if planned is None or (left and phase.hints.storage is not None):
        return Rejection(f"cluster={geo.cluster} {_storage_words(storage)}", (
            f"no staging ring for {', '.join(left)} (one row per block, vectors of 4, 8 or 16 "
            f"bytes, and {room} B of shared memory left at {geo.rows_per_block} row(s) per "
            "block)"))
    ring, ring_requests = planned
    return ring, ring_requests, {**storage, **{n: Storage.GLOBAL for n in left}}


def _column_request(geo: RowGeometry, t: Tensor) -> tuple[str, int, str]:
    """A column buffer: the block's part of the column (for skewed rows one to a block, at
    their skew: base.skewed_columns_at_skew); for skewed rows several to a block the whole
    column, padded (base.skewed_column_bytes)."""
    if skewed_columns_at_skew(geo.skew, geo.rows_per_block):
        return (f"s_{t.name}", geo.part * t.dtype.itemsize,
                f"column buffer {t.name} ({t.dtype.label}) x {geo.part}, at the rows' skew")
    if geo.skew:
        return (f"s_{t.name}", skewed_column_bytes(geo.hidden, t.dtype.itemsize, geo.skew),
                f"column buffer {t.name} ({t.dtype.label}) x {geo.hidden}, padded for skewed "
                "rows")
    return (f"s_{t.name}", geo.part * t.dtype.itemsize,
            f"column buffer {t.name} ({t.dtype.label}) x {geo.part}")


def _other_requests(phase: Phase, geo: RowGeometry, storage: dict[str, Storage],
                    accumulators: Storage) -> Requests:
    """Column buffers, accumulators, the inner-reduction scratch, the combine of several
    rows' accumulators and the cluster exchange, in that order."""
    fusion = phase.fusion
    part, rows, width, red = geo.part, geo.rows_per_block, fusion.width, fusion.reduction_bytes
    requests = [_column_request(geo, t) for t in fusion.cols if storage[t.name] is Storage.SMEM]
    if accumulators is Storage.SMEM:
        requests += [(f"s_acc_{e.outputs[0].name}", rows * part * nbytes,
                      f"column accumulator {e.outputs[0].name} x {rows} row(s) x {part}")
                     for e, nbytes in zip(fusion.info.outer_reductions,
                                          fusion.accumulator_bytes, strict=True)]
    scratch = 2 * width * rows * geo.warps * red if geo.threads_per_row > 32 else 0
    requests.append(("s_reduce", scratch, f"inner-reduction scratch: 2 parities x {width} x "
                     f"{rows} row(s) x {geo.warps} warps x {red} B"))
    if accumulators is Storage.REGISTERS and rows > 1:
        requests += [(f"s_outer_{e.outputs[0].name}", part * nbytes,
                      f"column accumulator {e.outputs[0].name}: {rows} rows combined")
                     for e, nbytes in zip(fusion.info.outer_reductions,
                                          fusion.accumulator_bytes, strict=True)]
    if geo.cluster > 1:
        word = 8 if red > 4 else 4
        requests.append(("s_cluster", 2 * MBARRIER_BYTES + 2 * geo.cluster * width * rows * word,
                         f"cluster exchange: 2 parities x (an mbarrier + {geo.cluster} ranks x "
                         f"{width} x {rows} row(s) x {word} B), sent by the blocks of the "
                         "cluster"))
    return requests


def _buffer_registers(phase: Phase, geo: RowGeometry, storage: dict[str, Storage],
                      accumulators: Storage) -> int:
    """Registers per thread of the buffers a thread keeps: two vectors of temporaries, the
    register arrays of row and column buffers, and the accumulators in registers."""
    acc = (sum(_array_words(geo, b) for b in phase.fusion.accumulator_bytes)
           if accumulators is Storage.REGISTERS else 0)
    return 2 * geo.vec + acc + sum(_array_words(geo, t.dtype.itemsize)
                                   for t in phase.fusion.buffers
                                   if storage[t.name] is Storage.REGISTERS)


def _array_words(geo: RowGeometry, nbytes: int) -> int:
    """32-bit registers of a thread's array of `nbytes`-byte elements, one per element of
    its vectors (batch x vec)."""
    return ceil_div(geo.batch * geo.vec * nbytes, 4)


def _register_arrays(phase: Phase, choice: StorageChoice, storage: dict[str, Storage]) -> bool:
    """Whether a thread keeps register arrays indexed by the batch loop's counter (row or
    column buffers, column accumulators): the loop must then unroll fully."""
    fusion = phase.fusion
    accumulating = choice.accumulators is Storage.REGISTERS and bool(fusion.accumulator_bytes)
    return accumulating or any(storage[t.name] is Storage.REGISTERS for t in fusion.buffers)


def _kept(phase: Phase, geo: RowGeometry, choice: StorageChoice, storage: dict[str, Storage],
          ring: StagingRing | None, free: int) -> tuple[tuple[str, ...], int]:
    """The element values kept in registers between passes (RowFusion.kept) and their
    registers per thread: all of them where their arrays leave the planned overhead free
    (`free`: squeezed below it, softmax's 1024-thread rows at 32768 ran 2% slower kept) and
    the batch loop unrolls fully anyway (register arrays, or no more than PARTIAL_UNROLL
    vectors; a staging ring's passes are loops of their own), else none."""
    words = sum(_array_words(geo, nbytes) for nbytes in phase.fusion.kept_bytes)
    unrolled = _register_arrays(phase, choice, storage) or geo.batch <= PARTIAL_UNROLL
    if not phase.fusion.kept or ring is not None or not unrolled or words > free:
        return (), 0
    return tuple(v.name for v in phase.fusion.kept), words


def _resources(phase: Phase, geo: RowGeometry, choice: StorageChoice,
               storage: dict[str, Storage], ring: StagingRing | None,
               plan: SmemPlan) -> RowSchedule | Rejection:
    """The schedule, where its shared memory, registers and one resident block fit."""
    device = phase.device
    max_regs = min(device.max_regs_per_thread, device.regs_per_block // geo.threads)
    buffers = _buffer_registers(phase, geo, storage, choice.accumulators)
    kept, kept_regs = _kept(phase, geo, choice, storage, ring,
                            max_regs - PLANNED_OVERHEAD_REGISTERS - buffers)
    buffers += kept_regs
    regs = min(max_regs, buffers + PLANNED_OVERHEAD_REGISTERS)
    residency = blocks_per_sm(device, geo.threads, regs, plan.total)
    if not (plan.fits and buffers + MIN_OVERHEAD_REGISTERS <= max_regs and residency >= 1):
        return Rejection(
            f"cluster={geo.cluster} stages={choice.stages}"
            f"{' aligned copies' if phase.aligned else ''} {_storage_words(storage)} "
            f"accumulators in "
            f"{choice.accumulators}",
            f"smem {plan.total} B of {plan.limit}, >= {buffers + MIN_OVERHEAD_REGISTERS} of "
            f"{max_regs} registers per thread at {geo.threads} threads, {residency} block(s)/SM")
    placements = _placements(phase, storage)
    at_skew = columns_at_skew(geo.skew, geo.rows_per_block, placements)
    stages = choice.stages  # fit's _stages: of row buffers in shared memory
    hinted = phase.hints.dealing
    dealings = row_dealing.allowed(phase, geo, ring, stages, at_skew)
    if hinted is not None and hinted not in dealings:
        refusals = row_dealing.counter_refusals(phase, geo, ring, stages, at_skew)
        return Rejection(
            f"cluster={geo.cluster} stages={stages} {_storage_words(storage)} "
            f"dealing={hinted}",
            f"allowed here: {', '.join(map(str, dealings))} (a counter cannot deal these "
            f"rows: {'; '.join(refusals)})")
    return _schedule(phase, geo, choice, storage, placements, ring, plan, kept, regs,
                     residency, dealings, stages, aligned_copy=phase.aligned and any(
                         storage[t.name] is Storage.SMEM for t in phase.fusion.full),
                     at_skew=at_skew)


def _placements(phase: Phase, storage: dict[str, Storage]) -> tuple[Placement, ...]:
    info = phase.fusion.info
    return tuple(
        Placement(t.name, t.dtype, info.roles[t], storage[t.name],
                  storage[t.name] is Storage.SMEM and info.roles[t] is Role.FULL
                  and phase.can_async(t))
        for t in info.fusion.inputs if isinstance(t, Tensor) and t.name in storage)


def _schedule(phase: Phase, geo: RowGeometry, choice: StorageChoice,
              storage: dict[str, Storage], placements: tuple[Placement, ...],
              ring: StagingRing | None, plan: SmemPlan,
              kept: tuple[str, ...], regs: int, residency: int,
              dealings: tuple[Dealing, ...], stages: int, aligned_copy: bool,
              at_skew: bool) -> RowSchedule:
    fusion = phase.fusion
    info = fusion.info
    # Register arrays are indexed by the batch loop's counter, so they need it unrolled; with
    # every row in smem or re-read, a partly unrolled loop keeps registers free.
    register_arrays = _register_arrays(phase, choice, storage) or bool(kept)
    unroll = (geo.batch if register_arrays else ring.units if ring
              else min(geo.batch, PARTIAL_UNROLL))
    return RowSchedule(
        scheduler=phase.policy.scheduler,
        reason=_reason(phase, geo, choice.accumulators, stages, aligned_copy, storage, ring,
                       kept, regs, residency),
        hidden=geo.hidden,
        vec=geo.vec,
        skew=geo.skew,
        threads_per_row=geo.threads_per_row,
        rows_per_block=geo.rows_per_block,
        batch=geo.batch,
        cluster=geo.cluster,
        unroll=unroll,
        full_unroll=register_arrays,
        kept=kept,
        stages=stages,
        aligned_copy=aligned_copy,
        placements=placements,
        accumulators=choice.accumulators,
        ring=ring,
        reduction_bytes=fusion.reduction_bytes,
        regs_estimate=regs,
        blocks_per_sm=residency,
        dealing=row_dealing.pick(phase, geo, dealings, stages, residency,
                                 row_dealing.refills(info, fusion.run_passes, stages, aligned_copy,
                                                     any(p.async_copy for p in placements), ring,
                                                     geo.threads_per_row, geo.skew),
                                 at_skew),
        smem=plan,
        shifted_variance=fusion.variance is not None,
    )


def _split_words(hidden: int, part: int, cluster: int) -> str:
    """'a cluster of 4 blocks of 16386 elements (16386+16386+16386+16380)': each block's
    share of the row, listed when they differ (the last ones may hold less, or nothing)."""
    shares = [min(part, max(0, hidden - k * part)) for k in range(cluster)]
    listed = "" if len(set(shares)) == 1 else f" ({'+'.join(map(str, shares))})"
    return f"a cluster of {cluster} blocks of {part} elements{listed}"


def _reason(phase: Phase, geo: RowGeometry, accumulators: Storage, stages: int,
            aligned_copy: bool, storage: dict[str, Storage], ring: StagingRing | None,
            kept_names: tuple[str, ...],
            regs: int, residency: int) -> str:
    """Why this schedule, in words: what is kept where, and the resources it was sized for."""
    buffers = phase.fusion.buffers
    in_smem = [t.name for t in buffers if storage[t.name] is Storage.SMEM]
    reread = [t.name for t in buffers if storage[t.name] is Storage.GLOBAL]
    kept = ", ".join(in_smem) or ("only the staging ring" if ring else "nothing")
    words = [f"{phase.policy.name} policy: {kept} in smem"
             + (f" ({stages} stages)" if stages > 1 else "")]
    if reread:
        words.append(f"{','.join(reread)} re-read each pass")
    if ring:
        words.append(f"{', '.join(ring.tensors)} re-read each pass through a staging ring "
                     f"({ring.fill}, {ring.depth} slots x {ring.chunks} chunk(s))")
    if geo.skew:
        words.append(f"skewed rows ({geo.vec}-element vectors from the boundary below each "
                     f"row's start, which lies on a multiple of {geo.skew})")
    if aligned_copy:
        words.append("rows copied in aligned 16-byte chunks")
    if accumulators is not Storage.REGISTERS:
        words.append(f"column accumulators in {accumulators}")
    if geo.cluster > 1:
        words.append(f"rows split over {_split_words(geo.hidden, geo.part, geo.cluster)}")
    if kept_names:
        ops = {v.name: v.definition.op for v in phase.fusion.kept if v.definition is not None}
        words.append(f"{', '.join(f'{ops[k]} {k}' for k in kept_names)} kept in registers "
                     "for the pass that needs it again")
    if phase.fusion.variance is not None:
        words.append(phase.fusion.variance.words())
    words.append(f"~{regs} regs/thread, ~{residency} block(s)/SM")
    return ", ".join(words) + (f" ({phase.why})" if phase.why else "")
