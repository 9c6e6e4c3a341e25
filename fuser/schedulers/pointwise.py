"""Pointwise scheduler: no reductions, one flat grid-stride loop over vectors.

Per-row ([rows, 1]) and per-column ([hidden]) operands are indexed from the vector's position;
the kernel is specialised on hidden so that division is a multiply and shift.
"""

from __future__ import annotations

from collections.abc import Iterator

from fuser.analysis import FusionInfo, Kind, Role
from fuser.device import DeviceSpec
from fuser.errors import HintError
from fuser.schedulers.base import PointwiseSchedule, Problem, pick_vec
from fuser.schedulers.hints import Hints
from fuser.smem import SmemPlan

THREADS = 256
UNROLL = 4  # independent vectors per thread per iteration
PIECE_BYTES = 16  # the widest load or store; a column operand's vector may be several


def can_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    if info.kind is not Kind.POINTWISE:
        return f"pointwise handles fusions without reductions, not {info.kind.value}"
    return None


def vector_itemsizes(info: FusionInfo, align_bytes: int) -> list[int]:
    """The itemsizes a vector of elements is sized by: the [rows, hidden] tensors', and the
    column operands' too where the pointers are aligned below PIECE_BYTES (only then are
    they read in vectors instead of 16-byte pieces)."""
    sized = [*info.full_inputs, *info.outputs(Role.FULL)]
    if align_bytes < PIECE_BYTES:
        sized += [*info.col_inputs, *info.outputs(Role.COL)]
    return [t.dtype.itemsize for t in sized]


def heuristic(info: FusionInfo, problem: Problem, device: DeviceSpec,
              unroll: int = UNROLL) -> PointwiseSchedule:
    """Vectors as wide as the [rows, hidden] tensors allow (16 bytes of the widest). Column
    operands wider than that (fp32 statistics beside bf16 rows) are read and written in
    16-byte pieces (fm::load_pieces), which needs 16-byte aligned pointers; with less the
    column operands bound the vector as well. Sized by its fp32 columns, BatchNorm's
    normalization moved bf16 rows 8 bytes at a time (H200, [16384, 16384] bf16: the whole
    BatchNorm forward 0.31 -> 0.34 of the copy). Where a row's length bounds the vector and
    vectors may cross rows (_across_rows_vec), they do: H100 bf16, SwiGLU forward at hidden
    4099 0.65 -> 0.99 of the copy, 24578 0.89 -> 1.01 (bench/TUNING.md, "vectors across
    rows")."""
    inputs = [*info.full_inputs, *info.col_inputs]
    input_bytes = sum(t.dtype.itemsize for t in inputs)
    vec = pick_vec(problem.hidden, vector_itemsizes(info, problem.align_bytes),
                   problem.align_bytes, input_bytes=input_bytes)
    across = _across_rows_vec(info, problem, input_bytes)
    across_rows = across > vec
    widest = max(vec, across)
    reason = f"{widest}-element vectors"
    if across_rows:
        reason += (f" over the rows end to end (a row of {problem.hidden} bounds vectors within "
                   f"it to {vec})")
    reason += f", {THREADS} threads x {unroll} vector{'s' * (unroll > 1)} in flight"
    if unroll != UNROLL:
        reason += f" ({UNROLL} spilled registers)"
    return PointwiseSchedule(
        scheduler="pointwise",
        reason=reason,
        hidden=problem.hidden,
        vec=widest,
        threads=THREADS,
        unroll=unroll,
        smem=SmemPlan.build([], device.smem_per_block_optin),
        across_rows=across_rows,
    )


def _across_rows_vec(info: FusionInfo, problem: Problem, input_bytes: int) -> int:
    """The vector of a kernel whose vectors cross rows (PointwiseSchedule.across_rows): as
    wide as the [rows, hidden] tensors' itemsizes and the pointers' alignment allow, whatever
    the row's length. 1 where such vectors cannot be: a full input read at other rows than
    the kernel's (a repeated one), or per-row or per-column outputs (written once per row or
    column, not per element); and where the fusion reads columns. A vector's elements then
    need columns j0 .. j0 + vec - 1 modulo hidden, which no vector load reads, and read one by
    one, a warp's 32 lanes at columns vec elements apart touch vec times the cache lines of
    one vector load for each element. Per-row operands change once a row: they are read as
    the vector reaches each row."""
    repeated = {t for t, _ in info.repeated}
    if (any(t in repeated for t in info.full_inputs) or info.outputs(Role.ROW)
            or info.outputs(Role.COL) or info.col_inputs):
        return 1
    sized = [t.dtype.itemsize for t in (*info.full_inputs, *info.outputs(Role.FULL))]
    return pick_vec(PIECE_BYTES, sized, problem.align_bytes, input_bytes=input_bytes)


def candidates(info: FusionInfo, problem: Problem, device: DeviceSpec,
               hints: Hints | None = None) -> Iterator[PointwiseSchedule]:
    """The pointwise schedule, then the same with one vector in flight a round, which the
    build takes where the first spills: ptxas kept a vector of a kernel whose vectors cross
    rows in local memory at UNROLL vectors a round (x where a repeated per-row input is
    positive, else 0: 24 B of spills at hidden 3), and compiles one a round clean. Hints
    steer the persistent row kernels; a pointwise fusion refuses them rather than ignore
    them."""
    if hints is not None and hints.given():
        raise HintError(f"Hints({hints.words()}): this fusion has no reductions and runs as "
                        "one pointwise kernel, which takes no hints; allowed: Hints() or None")
    yield heuristic(info, problem, device)
    yield heuristic(info, problem, device, unroll=1)
