"""Schedules: the decisions a scheduler makes, as frozen, printable data.

A schedule holds only what changes the compiled binary (it is the kernel cache key and the
header comment of the generated source). What changes per call, the grid and the number of
partial rows, is a Launch, computed by loader.launch_sizes from the row count and the
occupancy that the driver reports for the compiled kernel.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields

from fuser.analysis import FusionInfo, Kind, Role
from fuser.dtypes import DataType
from fuser.errors import FuserError, UnsupportedFusionError
from fuser.smem import SmemPlan

MAX_HIDDEN = 2**31 - 1  # elements of a row: the kernels index them with 32-bit ints


class Storage(str, enum.Enum):
    """Where a buffer lives while a block works on a row (and the Hints vocabulary for it)."""

    REGISTERS = "registers"  # kept in registers between passes
    SMEM = "smem"  # kept in shared memory between passes
    GLOBAL = "global"  # nothing is kept: every pass re-reads the row (mostly from L2)
    RING = "ring"  # re-read every pass like GLOBAL, streamed through a shared-memory ring

    def __str__(self) -> str:
        return self.value


class Dealing(str, enum.Enum):
    """How a row kernel's row groups (rows_per_block rows each) are dealt to its blocks."""

    # A persistent grid (the blocks resident at once): block b takes groups b, b + grid, ...
    STRIDED = "strided"
    # A persistent grid whose blocks take their next group from a counter as they finish one:
    # an SM that streams faster takes more groups (fixed strides leave the call as slow as
    # its slowest SM).
    DYNAMIC = "dynamic"
    # One block per group, the hardware starting each as another finishes; a block's setup
    # (column loads, barrier and ring initialisation) is repeated per group.
    GRID = "grid"

    def __str__(self) -> str:
        return self.value


# The dealings of a fusion with column sums: a block per row group would write a partial row of
# the sums per group, not per resident block.
COLUMN_SUM_DEALINGS = (Dealing.STRIDED, Dealing.DYNAMIC)


class Fill(str, enum.Enum):
    """How a staging ring's slots are filled."""

    BULK = "cp.async.bulk"  # by the bulk copy engine, one mbarrier per slot (sm_90)
    ASYNC = "cp.async"  # by each thread's own cp.async vector copies

    def __str__(self) -> str:
        return self.value




@dataclass(frozen=True)
class Problem:
    """What a heuristic may look at besides the fusion: sizes and pointer alignment."""

    hidden: int  # extent of the innermost axis (1 when the fusion has none)
    rows: int  # extent of the row axis (1 when the fusion has none)
    align_bytes: int  # largest power of two (<= 16) dividing every data pointer
    # the groups of rows an outer reduction's column kernel spreads over the SMs beside its
    # slabs, as problem_groups rounds them; 1 for every other fusion
    groups: int = 1

    def __post_init__(self):
        if self.hidden < 1 or self.rows < 0:
            raise FuserError(f"bad problem size rows={self.rows} hidden={self.hidden}: "
                             "hidden must be at least 1 and rows at least 0")
        if self.hidden > MAX_HIDDEN:
            raise UnsupportedFusionError(
                f"hidden size {self.hidden} is over {MAX_HIDDEN}: the kernels index a row's "
                "elements with 32-bit ints; split the rows (reshape [N, H] to [N * k, H / k] "
                "where the fusion allows it)")


@dataclass(frozen=True)
class Placement:
    """Where one input buffer lives while a block works on its rows."""

    tensor: str  # the fusion input's name, e.g. "T0"
    dtype: DataType
    role: Role  # FULL ([rows, hidden], reloaded each row) or COL ([hidden], loaded once)
    storage: Storage
    async_copy: bool  # smem only: filled with cp.async (vector of 4, 8 or 16 bytes)


def aligned_row_bytes(hidden: int, itemsize: int) -> int:
    """Bytes of a row slot filled by 16-byte copies from the 16-byte boundary at or below the
    row's start: whole chunks covering the row at any offset (0 to 15 bytes)."""
    return 16 * aligned_row_chunks(hidden, itemsize)


def aligned_row_chunks(hidden: int, itemsize: int) -> int:
    """16-byte chunks that cover a row of hidden x itemsize bytes starting 0 to 15 bytes past
    a 16-byte boundary."""
    return -(-(hidden * itemsize + 15) // 16)


@dataclass(frozen=True)
class StagingRing:
    """How re-read rows are streamed through shared memory: every pass
    over a row reads the block's part of it (the whole row, or a cluster block's share) in
    `chunks` chunks of `chunk_vectors` vectors, each into the next of `depth` slots, while the
    next depth - 1 chunks are on their way. The chunk arithmetic lives here, and the template
    only places these numbers: chunk c holds vectors [c * chunk_vectors, min((c + 1) *
    chunk_vectors, part)) of the part, so the last (tail) chunk holds what is left."""

    fill: Fill
    tensors: tuple[str, ...]  # the full inputs that go through the ring
    depth: int  # slots; depth - 1 chunks are in flight while one is read
    units: int  # vectors per thread per chunk (divides the schedule's batch)
    chunk_vectors: int  # vectors per chunk: units x threads per row
    chunks: int  # chunks per pass: batch / units
    part_vectors: int  # vectors of a block's part of the row (the last block may own fewer)
    vec: int  # elements per vector
    passes: int  # passes over each row: one per inner reduction level, one for the outputs

    @property
    def chunk_elements(self) -> int:
        return self.chunk_vectors * self.vec

    @property
    def tail_elements(self) -> int:
        """Elements of the last chunk of a full part."""
        return (self.part_vectors - (self.chunks - 1) * self.chunk_vectors) * self.vec

    def spans(self, part_vectors: int) -> list[tuple[int, int]]:
        """(first element, elements) of each chunk of a part of `part_vectors` vectors, in
        element units from the part's start; a chunk past a short part's end holds nothing."""
        return [(c * self.chunk_elements,
                 max(0, min(self.chunk_vectors, part_vectors - c * self.chunk_vectors)) * self.vec)
                for c in range(self.chunks)]

    def __str__(self) -> str:
        return (f"{', '.join(self.tensors)} by {self.fill}: {self.depth} slots, {self.chunks} "
                f"chunk(s) of {self.chunk_elements} elements (tail {self.tail_elements}) per "
                f"pass, {self.passes} pass(es) per row")


def _field_lines(obj, skip=()) -> list[str]:
    lines = []
    for f in fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        if isinstance(value, tuple) and value and isinstance(value[0], Placement):
            value = ", ".join(
                f"{p.tensor}:{p.dtype.label}->{p.storage}{'(cp.async)' if p.async_copy else ''}"
                for p in value
            )
        lines.append(f"{f.name:<18} {value}")
    return lines


@dataclass(frozen=True)
class RowSchedule:
    """A normalization kernel: each block owns `rows_per_block` rows at a time, taking row
    groups as `dealing` says; inside a row, thread x of `threads_per_row` owns vectors
    x, x + threads_per_row, ... (`batch` of them) of `vec` elements each."""

    scheduler: str  # the scheduler module that made this schedule
    reason: str  # why this storage and geometry, in words
    hidden: int  # the kernel is specialised on the hidden size: every loop is unrolled
    vec: int  # elements per vector access; divides hidden (unless skewed); at most 16 bytes
    # 0, or skewed rows (fuser_rows.cuh, RowPart): vec does not divide hidden and rows start
    # on boundaries of `skew` elements (which divides hidden and vec); a thread's vectors are
    # the tensor's vec-element ones from the boundary below the row's start, the row's first
    # and last masked. The vectors of hidden 24578 are 16 bytes, not 4.
    skew: int
    threads_per_row: int  # threads sharing one row (blockDim.x); a power of two
    rows_per_block: int  # rows a block works on at once (blockDim.y)
    cluster: int  # blocks sharing each row as a thread-block cluster (1: a block owns rows)
    batch: int  # vectors per thread per row = ceil(hidden / vec / cluster / threads_per_row)
    unroll: int  # batch iterations unrolled per pass
    full_unroll: bool  # register arrays are indexed by the batch loop: it must unroll fully
    # element values computed once and kept in registers for a later pass over the row
    # (analysis.kept_values: softmax's exp(x - max)), by name; needs full_unroll
    kept: tuple[str, ...]
    stages: int  # smem row buffers: 2 or 3 = the next one or two rows load while these compute
    # smem row buffers filled by 16-byte cp.async from the 16-byte boundary at or below each
    # row's start, whatever vec is: rows of a hidden size like 24578 start on 4-byte
    # boundaries, and element-wide copies move 4 bytes each. Threads read the row at its
    # offset in the buffer (after a barrier: each thread no longer reads only what it copied).
    aligned_copy: bool
    placements: tuple[Placement, ...]  # storage of every full and column input
    accumulators: Storage  # where outer-reduction accumulators live: REGISTERS, SMEM or GLOBAL
    ring: StagingRing | None  # the staging ring of the RING placements (None without any)
    reduction_bytes: int  # 4, or 8 when any inner reduction accumulates in double
    regs_estimate: int  # registers per thread this schedule was sized for
    blocks_per_sm: int  # residency it was sized for; __launch_bounds__ holds ptxas to it
    dealing: Dealing  # how row groups are dealt to blocks (row_dealing.py)
    smem: SmemPlan  # every shared buffer, with the static slot
    # a variance's two reduction levels run as one pass of shifted sums (row_variance.py)
    shifted_variance: bool = False

    @property
    def threads(self) -> int:
        return self.threads_per_row * self.rows_per_block

    @property
    def partial_rows_per_block(self) -> int:
        """Workspace rows a block writes: one, or one per row slot when the accumulators live
        in the workspace itself (each slot then owns a partial row and nothing is folded)."""
        return self.rows_per_block if self.accumulators is Storage.GLOBAL else 1

    @property
    def group_period(self) -> int:
        """1, or for skewed rows the row groups after which the rows' skews repeat (vec //
        skew rows). A grid striding over a multiple of it gives each thread rows of one skew,
        so a lane of its column sums holds the same column in every row it visits
        (fuser_rows.cuh, AccumulatorIn*)."""
        if not self.skew:
            return 1
        period = self.vec // self.skew
        return period // math.gcd(period, self.rows_per_block)

    @property
    def columns_at_skew(self) -> bool:
        """Whether the column inputs in shared memory are kept at the skew of the block's rows
        (fuser_row_columns.cuh, ColumnAtSkew): skewed rows one to a block, whose grid strides
        over whole periods of the skews (group_period), so every row a block visits has the
        skew of its first, and a visit reads its columns in whole vectors, as the row's own.
        Skewed rows several to a block read them in pieces (SkewedColumn)."""
        return columns_at_skew(self.skew, self.rows_per_block, self.placements)

    @property
    def buffers_in_smem(self) -> bool:
        """Whether every row and column buffer lives in shared memory (none in registers,
        re-read or in a ring): what the search's reordering rules ask of the schedules they
        move first."""
        return all(p.storage is Storage.SMEM for p in self.placements)

    def placement(self, tensor: str) -> Placement:
        return next(p for p in self.placements if p.tensor == tensor)

    def __str__(self) -> str:
        skip: tuple[str, ...] = ("smem",) if self.ring else ("smem", "ring")  # none: not shown
        skip += () if self.shifted_variance else ("shifted_variance",)
        return "RowSchedule\n  " + "\n  ".join(_field_lines(self, skip=skip))


@dataclass(frozen=True)
class PointwiseSchedule:
    """A flat elementwise kernel: a grid-stride loop over vectors of `vec` elements. A vector
    never crosses a row, so per-row and per-column operands are indexed once per vector;
    unless `across_rows` (a fusion without column operands): the vectors then run over the
    rows laid end to end (a row's length does not bound them), a per-row operand is read as a
    vector reaches each row, and the last elements short of a vector go one at a time."""

    scheduler: str
    reason: str
    hidden: int  # specialised on, so row and column indices are a multiply-shift
    vec: int
    threads: int  # threads per block
    unroll: int  # vectors per thread per loop iteration (independent loads in flight)
    smem: SmemPlan  # empty: only the static slot
    across_rows: bool = False

    def __str__(self) -> str:
        return "PointwiseSchedule\n  " + "\n  ".join(_field_lines(self, skip=("smem",)))


@dataclass(frozen=True)
class OuterSchedule:
    """Outer normalization in one kernel: a cluster of `cluster` blocks owns a slab of `slab`
    columns of every [rows, hidden] input, each block a share of its rows (at most `rank_rows`)
    kept in shared memory. The column reductions fold each block's rows, then the cluster's
    blocks in rank order (every block gets the same totals), and the outputs are computed from
    the rows still on chip: the inputs are read once. `streamed`: an outer reduction with
    column outputs only, whose rows are read from global memory in the one pass that
    accumulates them, none kept: any number of rows fits."""

    scheduler: str
    reason: str
    hidden: int  # columns of the [rows, hidden] tensors
    rows: int  # rows built for (base.problem_rows of the call's): blocks keep rank_rows each
    # (streamed: read a share of any size)
    vec: int  # columns of one vector (one copy, load and store)
    slab: int  # columns a cluster owns: col_lanes x vec
    col_lanes: int  # threads across a slab (blockDim.x)
    row_lanes: int  # threads down the rows (blockDim.y): thread y takes rows y, y + row_lanes, ...
    # row lanes left once each warp has folded its own: rows of the fold buffers (ColumnSlab's
    # GROUPS; not FusionInfo.group_axes' groups, the leading axes a grid row each runs)
    fold_rows: int
    cluster: int  # blocks sharing a slab's rows (a thread-block cluster from 2, sm_90)
    rank_rows: int  # rows one block keeps, ceil(rows / cluster): calls up to cluster x this fit
    blocks_per_sm: int  # resident blocks its threads, registers and shared memory allow
    smem: SmemPlan
    streamed: bool = False  # rows read in the one pass, not kept (rank_rows: the built-for share)
    # a full input whose first held_rows rows of each thread (rows y, y + row_lanes, ...) stay
    # in its registers, read once from global memory, and the rest in shared memory: room for
    # another block of the SM where its whole share would not leave it ("" and 0: none)
    held: str = ""
    held_rows: int = 0

    @property
    def tile_start(self) -> int:
        """The first of its block's rows the held input's tile holds (held_tile_start)."""
        return held_tile_start(self.held_rows, self.row_lanes)

    @property
    def threads(self) -> int:
        return self.col_lanes * self.row_lanes

    @property
    def slabs(self) -> int:
        return ceil_div(self.hidden, self.slab)

    def __str__(self) -> str:
        skip = ("smem",) if self.held_rows else ("smem", "held", "held_rows")
        return "OuterSchedule\n  " + "\n  ".join(_field_lines(self, skip=skip))


@dataclass(frozen=True)
class FinalizeSchedule:
    """Sums the [partial_rows, hidden] fp32 partials of the outer reductions per column, then
    runs the column epilogue (casts, ops on dW/dB) and writes the column outputs: in a kernel
    of its own, or (fused) in the row kernel itself, past a grid-wide barrier, each block
    taking tiles of columns in turn."""

    reason: str  # where it runs and why its tile, in words
    hidden: int
    cols_per_block: int  # a tile's columns: one per thread of a row of lanes
    partial_lanes: int  # threads sharing a column's partial rows
    # partial rows a lane loads before adding them (in order) to its sum; 1: one at a time
    unroll: int
    smem: SmemPlan  # the cross-lane combine buffer (fused: the row kernel's plan, which has it)
    fused: bool = False  # run by the row kernel after a grid barrier (a cooperative launch)

    def __str__(self) -> str:
        return "FinalizeSchedule\n  " + "\n  ".join(_field_lines(self, skip=("smem",)))


# The schedule of a module's main kernel.
KernelSchedule = RowSchedule | PointwiseSchedule | OuterSchedule


@dataclass(frozen=True)
class Launch:
    """Per-call launch parameters, derived from the row count and the kernel's occupancy."""

    grid: int
    block: tuple[int, int]
    dynamic_smem: int
    # rows of the outer-reduction workspace (a group's; 0 without outer reductions)
    partial_rows: int
    groups: int = 1  # grid rows (gridDim.y x gridDim.z), one per group (FusionInfo.group_axes)


# Bytes of inputs one vector step may read: a thread loads every input's vector of an element
# group before it computes, and ptxas keeps them all live. 64 bf16 row inputs at 8 elements
# (1024 B) take 255 registers and spill in every schedule; at 4 elements (512 B) they take 40;
# 48 at 8 elements (768 B) take 52, 52 at 8 take 229 (NVRTC 13.0, sm_90). The six ready
# fusions read at most 80 B per vector step.
MAX_INPUT_BYTES_PER_VECTOR = 512


def pick_vec(hidden: int, itemsizes: list[int], align_bytes: int, *, input_bytes: int) -> int:
    """Largest power-of-two vector that divides hidden, keeps every access within 16 bytes and
    within the pointers' alignment, and reads at most MAX_INPUT_BYTES_PER_VECTOR of the
    inputs (`input_bytes` per element) per vector step."""
    widest = max(itemsizes, default=1)
    vec = max(1, min(16, align_bytes) // widest)
    while vec > 1 and (hidden % vec or input_bytes * vec > MAX_INPUT_BYTES_PER_VECTOR):
        vec //= 2
    return vec


def skewed_columns_at_skew(skew: int, rows_per_block: int) -> bool:
    """Whether a skewed row's column buffers hold the block's part of each column at the skew
    of its rows (RowSchedule.columns_at_skew): one row per block."""
    return bool(skew) and rows_per_block == 1


def columns_at_skew(skew: int, rows_per_block: int, placements: tuple[Placement, ...]) -> bool:
    """RowSchedule.columns_at_skew of these rows and placements (row_fit decides the dealing
    with it before the schedule exists)."""
    return skewed_columns_at_skew(skew, rows_per_block) and any(
        p.role is Role.COL and p.storage is Storage.SMEM for p in placements)


def skewed_column_pad(itemsize: int, skew: int) -> int:
    """Bytes of padding after every 128 of a column buffer that skewed rows read
    (fuser_rows.cuh SkewedColumn): a piece (skew x itemsize bytes), at least 4, so that the
    pieces of lanes 16 bytes apart fall in different banks and stay aligned."""
    return max(4, skew * itemsize)


def skewed_column_bytes(hidden: int, itemsize: int, skew: int) -> int:
    """Bytes of a column buffer that skewed rows read: the column with skewed_column_pad bytes
    after every 128."""
    nbytes = hidden * itemsize
    return nbytes + skewed_column_pad(itemsize, skew) * ((nbytes - 1) // 128)


def skewed_vectors(hidden: int, vec: int, skew: int) -> int:
    """Vectors of `vec` elements that cover a skewed row at any of its starts (0 to vec -
    skew elements past a vector boundary; fuser_rows.cuh RowPart::NV)."""
    return ceil_div(hidden + vec - skew, vec)


ROWS_SEEN = 1024  # the most rows a row kernel's schedule is built for (problem_rows)


def problem_rows(info: FusionInfo, rows: int, groups: int = 1) -> int:
    """The rows a schedule is built for, of a call of `groups` groups of `rows` rows each
    (FusionInfo.group_axes; one group of every row without them). A row kernel's choices
    look at few rows: at most 1024 of all the groups', rounded up to a power of two; of an
    outer reduction, a group's (its column kernel splits a group's rows over a slab's blocks,
    its row kernel runs a grid row of blocks per group). An outer-persistent kernel keeps a
    group's rows on chip, so it is built for them rounded up to a multiple of an eighth of the
    power of two at or above them (the shared memory it plans is at most 25% over what they
    need)."""
    if info.kind is Kind.OUTER:
        return min(next_pow2(rows), ROWS_SEEN)
    if info.kind is not Kind.OUTER_NORM:
        return min(next_pow2(rows * groups), ROWS_SEEN)
    step = max(1, next_pow2(rows) // 8)
    return max(1, ceil_div(rows, step) * step)


def held_tile_start(held_rows: int, row_lanes: int) -> int:
    """The first of a block's rows that a held input's tile holds: each thread's first
    `held_rows` rows (y, y + row_lanes, ...) are in its registers, so the tile starts after
    held_rows rows of every row lane."""
    return held_rows * row_lanes


def problem_groups(info: FusionInfo, groups: int) -> int:
    """The groups (FusionInfo.group_axes) a schedule is built for: of an outer reduction,
    whose streamed column kernel runs a grid of slabs per group, the power of two at or below
    the call's (so its grid is never counted fuller than it is), at most ROWS_SEEN; 1 for
    every other fusion, whose schedules do not look at them."""
    if info.kind is not Kind.OUTER:
        return 1
    return min(1 << (max(groups, 1).bit_length() - 1), ROWS_SEEN)


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
