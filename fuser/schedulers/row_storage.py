"""Storage orders: which StorageChoices a phase of the row search tries, in order.

The on-chip order is the policy's (RowPolicy.on_chip); once no cluster size keeps a row on
chip, both policies re-read the same way (re_read_order). Hints replace the order: a storage
hint is the one choice, a stages hint fixes the stages of on-chip choices, and an
accumulators hint puts the column accumulators where it says in every choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from fuser.schedulers.base import Storage
from fuser.schedulers.row_geometry import short_rows
from fuser.schedulers.row_records import Phase, Reach, StorageChoice


def choices(phase: Phase) -> Iterator[StorageChoice]:
    """Every storage choice of a phase, in order, with the hints applied."""
    hints = phase.hints
    accumulators = hints.accumulators
    for choice in _ordered(phase):
        yield choice if accumulators is None else replace(choice, accumulators=accumulators)


def _ordered(phase: Phase) -> Iterator[StorageChoice]:
    hints = phase.hints
    if hints.storage is not None:  # inputs not named: registers (a skewed row's columns: global)
        forced = dict(hints.storage)
        columns = Storage.GLOBAL if phase.geometry.skew else Storage.REGISTERS
        yield StorageChoice.of(hints.stages or 1, {
            **{t.name: forced.get(t.name, Storage.REGISTERS) for t in phase.fusion.full},
            **{t.name: forced.get(t.name, columns) for t in phase.fusion.cols}})
        return
    if phase.reach is not Reach.OFF_CHIP:
        yield from phase.policy.on_chip(phase)
    if phase.reach is not Reach.ON_CHIP:
        yield from re_read_order(phase)


def stage_order(phase: Phase) -> list[int]:
    """Stages to try for shared row buffers: the hinted ones, else two first, or one first
    for rows short enough that many fit an SM (row_geometry.SHORT_ROWS_PER_SM) and for
    skewed rows, whose blocks wait on one thread's extra vector at every reduction while
    others fill the SM (H200 bf16 24578, 512 threads: softmax_fwd 0.82 -> 0.93 of the copy
    with one stage; bench/TUNING.md, "skewed rows")."""
    if phase.hints.stages:
        return [phase.hints.stages]
    geo = phase.geometry
    return [1, 2] if geo.skew or short_rows(phase.fusion, geo.part, phase.device) else [2, 1]


def staged(phase: Phase, stages: int) -> dict[str, Storage]:
    """Every row buffer in shared memory that `stages` allows there, the others in registers:
    a buffer cp.async cannot fill is copied through registers, which a second stage would
    stall on, so with two stages it stays in registers."""
    return {t.name: Storage.SMEM if phase.can_async(t) or stages == 1 else Storage.REGISTERS
            for t in phase.fusion.full}


def staged_choice(phase: Phase, stages: int, col_storage: Storage) -> StorageChoice:
    """Every row buffer staged in shared memory as `staged` allows, the columns in
    `col_storage`."""
    return StorageChoice.of(stages, {**staged(phase, stages),
                                     **{t.name: col_storage for t in phase.fusion.cols}})


def re_read_order(phase: Phase) -> Iterator[StorageChoice]:
    """Fewer rows on chip, the others re-read in every pass: a row just read is usually still
    in L2, so the second read costs L2, not HBM, bandwidth. The least reused buffers go first,
    each through the staging ring, else by plain loads, with the column inputs in shared
    memory, registers or re-read. Then every row buffer re-read, with the column accumulators
    in shared memory (each thread its own slots) and, when those do not fit either, in the
    block's own partial rows of the workspace (read and written each row: while the partial
    rows fit in L2, that traffic stays in L2)."""
    full, cols = phase.fusion.full, phase.fusion.cols
    for reread in range(1, len(full) + 1):
        for through in (Storage.RING, Storage.GLOBAL):
            for col_storage in (Storage.SMEM, Storage.REGISTERS, Storage.GLOBAL):
                storage = {t.name: Storage.SMEM if phase.can_async(t) else Storage.REGISTERS
                           for t in full}
                storage.update({t.name: through for t in full[:reread]})
                storage.update({t.name: col_storage for t in cols})
                yield StorageChoice.of(1, storage)
    if not phase.fusion.accumulator_bytes:
        return
    for accumulators in (Storage.SMEM, Storage.GLOBAL):
        for through in (Storage.RING, Storage.GLOBAL):
            for col_storage in (Storage.SMEM, Storage.REGISTERS, Storage.GLOBAL):
                yield StorageChoice.of(1, {**{t.name: through for t in full},
                                           **{t.name: col_storage for t in cols}}, accumulators)
