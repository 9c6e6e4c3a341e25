"""The records the row search works on: a policy, the fusion as rows see it, a geometry, a
storage choice, a phase of the search, and a rejection.

The two persistent schedulers share one search (row_search.py) and differ in their RowPolicy
only, which each scheduler module states as a table with a reason per entry. The search walks
phases (a geometry and a kind of row copy each); a policy's storage order turns a phase into
StorageChoices; row_fit.fit turns a phase and a choice into a RowSchedule or a Rejection.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from fuser.analysis import FusionInfo, Role, kept_values
from fuser.device import DeviceSpec
from fuser.ir import Tensor, Val
from fuser.ops import REDUCTIONS
from fuser.schedulers.base import (
    Problem,
    RowSchedule,
    Storage,
    ceil_div,
    pick_vec,
    skewed_vectors,
)
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_variance import ShiftedVariance, pass_levels, row_passes

# Rows shorter than this many of the widest vectors are not skewed: a thread would read a
# whole vector of several rows for the few elements of its own (not measured below it).
SKEWED_MIN_VECTORS = 4


@dataclass(frozen=True)
class PackedRows:
    """Rows (or a cluster block's parts) of more than above_vectors and at most
    threads_per_row x vectors_per_thread vectors: each takes threads_per_row threads, and a
    block rows_per_block rows (where the problem has them), so the block's barriers, its
    column reads and its partial rows serve several rows, and each thread keeps many loads in
    flight ("packed backward rows" in bench/TUNING.md)."""

    threads_per_row: int
    rows_per_block: int
    vectors_per_thread: int
    above_vectors: int

    def holds(self, vectors: int) -> bool:
        return self.above_vectors < vectors <= self.threads_per_row * self.vectors_per_thread


@dataclass(frozen=True)
class PackedFirst:
    """When packed rows over a cluster go before every other step of the search
    (RowSearch._packed_first): `why` names why a step's packed geometry qualifies (None: it
    does not), and `keeps` says which of its schedules do; the step's first such schedule
    goes first. Split so that the search fits no storage for geometries that cannot qualify."""

    why: Callable[[RowFusion, RowGeometry], str | None]
    keeps: Callable[[RowSchedule], bool]


@dataclass(frozen=True)
class FewerRowsFirst:
    """When blocks of fewer rows in more stages go before the search's first schedule
    (RowSearch._fewer_rows_first): `why` names why, given the fusion and that first schedule
    (None: they do not go first). Tried in order: threads_per_row threads a row at each of
    rows_per_block, in `stages` stages with every buffer in shared memory, on one block; the
    first that fits goes first."""

    why: Callable[[RowFusion, RowSchedule], str | None]
    threads_per_row: int
    rows_per_block: tuple[int, ...]
    stages: int


@dataclass(frozen=True)
class NarrowSums:
    """Narrow staged rows of fusions with at least `column_sums` column sums, of row elements
    of at most `element_bytes`, take `threads` threads a row (below
    RowPolicy.staged_narrow_threads) where a thread then owns at most `vectors` of their
    vectors (row_geometry.staged_cap)."""

    column_sums: int
    element_bytes: int
    threads: int
    vectors: int


@dataclass(frozen=True)
class RowPolicy:
    """What distinguishes one persistent scheduler from the other: how rows are dealt to
    threads, how many threads a block of short rows reaches, the order in which storages
    are tried while the row stays on chip, and the measured rules that put a step of the
    search first (dealt_first, split_first, packed_first, fewer_rows_first) or bound staged
    narrow rows (staged_narrow_threads, staged_narrow_sums)."""

    scheduler: str  # the module that owns the policy, named in every schedule
    name: str  # the policy in words, first in every schedule's reason
    vectors_per_thread: int  # vectors a thread owns per row, the target that sets threads
    one_vector_up_to: int  # rows of up to this many vectors get one vector per thread
    max_threads_per_row: int
    # Fusions of at least this many passes over each row stage their rows in shared memory
    # before any other storage (None: the storage order decides alone).
    staged_passes: int | None
    # Threads per row, at most, of those staged rows where vectors are narrower than 16 bytes,
    # of at most staged_narrow_bytes (hidden 24578: 2 bf16, 4 bytes; 4099: 1 element): their
    # batch loops read shared memory, not register arrays, so a thread may own many vectors,
    # and a block this size leaves room for a second one in the register file (None: no such
    # limit).
    staged_narrow_threads: int | None
    staged_narrow_bytes: int
    min_block_threads: int  # short rows are packed to a block up to this many threads
    # Blocks of twice min_block_threads where the partial rows of the column reductions weigh
    # at least this share of a row's own bytes (None: never).
    partials_pack: float | None
    # Skewed rows take fewer threads (from row_skew.SKEWED_MAX_THREADS, down to a warp)
    # while a thread would own fewer of their vectors than this (row_skew.skewed_threads).
    skewed_vectors_per_thread: int
    on_chip: Callable[[Phase], Iterator[StorageChoice]]  # storage order, rows on chip
    packed: PackedRows | None = None  # rows dealt to blocks of several rows (None: never)
    # Rows too long to be short (row_geometry.short_rows) try, before every other storage,
    # one stage of rows in shared memory at the policy's threads per row and at half of them,
    # taking only the schedules whose row groups the hardware deals to blocks (Dealing.GRID:
    # several blocks share an SM; row_dealt.py).
    dealt_first: bool = False
    # The first schedule of rows split over a cluster of two before one block's where this
    # names why, given the fusion, one block's first schedule and two blocks' (None: never;
    # RowSearch._split_first)
    split_first: Callable[[RowFusion, RowSchedule, RowSchedule], str | None] | None = None
    # Where packed rows over a cluster go before every other step (None: never;
    # RowSearch._packed_first)
    packed_first: PackedFirst | None = None
    # Where blocks of fewer rows in more stages go before the search's first schedule
    # (None: never; RowSearch._fewer_rows_first)
    fewer_rows_first: FewerRowsFirst | None = None
    # Fewer threads than staged_narrow_threads for the narrow rows of fusions with several
    # column sums (None: never)
    staged_narrow_sums: NarrowSums | None = None

    def stages_first(self, passes: int) -> bool:
        """Whether a fusion of this many passes over each row stages its rows in shared
        memory before any other storage (staged_passes)."""
        return self.staged_passes is not None and passes >= self.staged_passes


@dataclass(frozen=True)
class RowFusion:
    """A fusion as the row search sees it, extracted once from FusionInfo."""

    info: FusionInfo
    full: tuple[Tensor, ...]  # row inputs, in the order they leave shared memory for registers
    cols: tuple[Tensor, ...]  # column inputs
    accumulator_bytes: tuple[int, ...]  # per outer reduction: 8 (double) or 4 (float)
    width: int  # reductions in the widest inner level (one block round trip serves a level)
    reduction_bytes: int  # 8 when any inner reduction accumulates in double, else 4
    # passes over each row: one per inner reduction level, one for the outputs; the policy
    # tables' thresholds count these, as they were measured (a folded variance too)
    passes: int
    itemsizes: tuple[int, ...]  # of every tensor a row's vectors must suit
    widest: int  # the item size of the widest row input (1 without row inputs)
    kept: tuple[Val, ...]  # element values a later pass needs again (analysis.kept_values)
    kept_bytes: tuple[int, ...]  # per kept value: 8 (double) or 4 (float)
    variance: ShiftedVariance | None = None  # a variance's two levels run as one pass

    @classmethod
    def of(cls, info: FusionInfo, variance: ShiftedVariance | None = None) -> RowFusion:
        full = sorted(info.full_inputs, key=lambda t: (
            _weight_related(t, info), t in info.persistent, t.index))
        inner = [e for level in info.inner_levels for e in level]
        levels = pass_levels(info, variance)
        kept = kept_values(info)
        return cls(
            info=info,
            full=tuple(full),
            cols=tuple(info.col_inputs),
            accumulator_bytes=tuple(_bytes(e.outputs[0]) for e in info.outer_reductions),
            width=max((len(level) for level in levels), default=0),
            reduction_bytes=max((_bytes(e.outputs[0]) for e in inner), default=4),
            passes=info.row_passes,
            itemsizes=tuple(t.dtype.itemsize for t in (
                *info.full_inputs, *info.col_inputs, *info.outputs(Role.FULL))),
            widest=max((t.dtype.itemsize for t in full), default=1),
            kept=kept,
            kept_bytes=tuple(_bytes(v) for v in kept),
            variance=variance,
        )

    @property
    def buffers(self) -> tuple[Tensor, ...]:
        return self.full + self.cols

    @property
    def run_passes(self) -> int:
        """The passes the kernel runs over each row (`variance`'s two levels as one): what a
        staging ring streams the row for, and what a refill needs two of."""
        return row_passes(self.info, self.variance)

    def narrow(self, vec: int) -> bool:
        """Whether vectors of `vec` elements of the widest row input are narrower than 16
        bytes (the widest load and store)."""
        return vec * self.widest < 16

    def vec(self, problem: Problem) -> int:
        """Elements per vector access of this fusion's rows (base.pick_vec)."""
        return pick_vec(problem.hidden, list(self.itemsizes), problem.align_bytes,
                        input_bytes=self.input_bytes)

    def skew(self, problem: Problem) -> int:
        """The skew of this fusion's rows where they may be skewed (RowSchedule.skew), else 0
        (skew_refusals says why not)."""
        return 0 if self.skew_refusals(problem) else self.vec(problem)

    def skew_refusals(self, problem: Problem) -> list[str]:
        """Why this fusion's rows cannot be skewed here, in words (none: they can): the
        vector that divides hidden must be narrower than the one the dtypes allow, the row
        span SKEWED_MIN_VECTORS of those and every input be 16-byte aligned. (A skewed row's
        lane holds a different column in every row: column inputs are read in pieces,
        SkewedColumn, and column sums take rows of one skew per thread,
        RowSchedule.group_period.)"""
        vec, wide = self.vec(problem), self.skewed_vec(problem)
        why = []
        if wide == vec:
            why.append(f"vectors narrower than the dtypes allow (the {vec}-element vectors "
                       f"that divide hidden {problem.hidden} are the widest already)")
        if problem.align_bytes < 16:
            why.append(f"every input 16-byte aligned (these are {problem.align_bytes}-byte "
                       "aligned)")
        if problem.hidden < SKEWED_MIN_VECTORS * wide:
            why.append(f"a row of at least {SKEWED_MIN_VECTORS} vectors of {wide} (hidden "
                       f"{problem.hidden})")
        if self.info.repeated:
            why.append("no input repeated along some row axes (a repeated row starts at "
                       f"another skew than its kernel row: {self.info.repeated[0][0].name})")
        return why

    def skewed_vec(self, problem: Problem) -> int:
        """The vector of this fusion's skewed rows: pick_vec of a row whose length every
        vector width divides."""
        return pick_vec(16, list(self.itemsizes), problem.align_bytes,
                        input_bytes=self.input_bytes)

    @property
    def input_bytes(self) -> int:
        """Bytes per element of every row and column input: what one element's loads hold."""
        return sum(t.dtype.itemsize for t in self.buffers)

    @property
    def row_bytes(self) -> int:
        """Bytes per element of every row input and row output."""
        return sum(t.dtype.itemsize for t in (*self.info.full_inputs,
                                               *self.info.outputs(Role.FULL)))


def _bytes(v: Val) -> int:
    """Bytes a thread holds per element of `v` (a reduction's accumulator, a kept value):
    8 in double or long long, else 4."""
    return 8 if v.dtype.compute_type in ("double", "long long") else 4


def _weight_related(t: Tensor, info: FusionInfo) -> bool:
    """True when values of `t` meet a column input before any reduction (grad_out * weight):
    such a buffer is re-read with the weight every row, so it stays in smem longest."""
    fusion = info.fusion
    stack: list[Val] = [t]
    seen: set[Val] = {t}
    while stack:
        v = stack.pop()
        for e in fusion.uses(v):
            if e.op in REDUCTIONS:
                continue
            if any(info.roles[i] is Role.COL for i in e.inputs):
                return True
            for o in e.outputs:
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return False


@dataclass(frozen=True)
class RowGeometry:
    """How rows are dealt to threads. A row's hidden / vec vectors are split into `cluster`
    equal parts (one per block of a cluster; one part without a cluster); in a part, vector
    v = b * threads_per_row + x (b < batch) goes to thread x, and a block works on
    rows_per_block rows at once."""

    hidden: int
    vec: int  # elements per vector; divides hidden (unless skewed); at most 16 bytes per access
    threads_per_row: int  # a power of two
    batch: int  # vectors per thread per row: the fewest rounds that reach a part's last vector
    cluster: int
    rows_per_block: int
    skew: int = 0  # RowSchedule.skew: rows start on boundaries of this many elements

    @property
    def vectors(self) -> int:
        """Vectors of a row; skewed, those that cover it at any of its starts."""
        if self.skew:
            return skewed_vectors(self.hidden, self.vec, self.skew)
        return self.hidden // self.vec

    @property
    def whole_rounds(self) -> bool:
        """Whether every thread of every part has `batch` vectors of the row (fuser_rows.cuh's
        RowPart::EXACT): no last round that some threads have and others not."""
        return self.batch * self.threads_per_row * self.cluster == self.vectors

    @property
    def part(self) -> int:
        """Elements of a row one block keeps: a cluster block's share (the last may own less)."""
        return ceil_div(self.vectors, self.cluster) * self.vec

    @property
    def threads(self) -> int:
        return self.threads_per_row * self.rows_per_block

    @property
    def warps(self) -> int:
        """Warps of one row (1 for rows of fewer than 32 threads)."""
        return max(1, self.threads_per_row // 32)


@dataclass(frozen=True)
class StorageChoice:
    """Where each row and column input lives, with how many stages, and where the column
    reductions accumulate."""

    stages: int
    storage: tuple[tuple[str, Storage], ...]  # (input name, storage) of every row and column input
    accumulators: Storage = Storage.REGISTERS

    @classmethod
    def of(cls, stages: int, storage: dict[str, Storage],
           accumulators: Storage = Storage.REGISTERS) -> StorageChoice:
        return cls(stages, tuple(storage.items()), accumulators)

    @cached_property
    def by_name(self) -> dict[str, Storage]:
        return dict(self.storage)

    def __str__(self) -> str:
        return (f"stages={self.stages} {{{', '.join(f'{n}: {s}' for n, s in self.storage)}}} "
                f"accumulators in {self.accumulators}")


class Reach(enum.Enum):
    """Which storages a phase tries."""

    ON_CHIP = "every row buffer and accumulator on chip"
    OFF_CHIP = "some re-read from global memory each pass"
    ANY = "on chip first, then re-read"  # a hinted cluster or storage: one phase does all


@dataclass(frozen=True)
class Phase:
    """One step of the row search: a geometry, a kind of row copy and the storages to try."""

    fusion: RowFusion
    problem: Problem
    device: DeviceSpec
    policy: RowPolicy
    hints: Hints
    geometry: RowGeometry
    # Shared row buffers filled by 16-byte copies from the 16-byte boundary at or below each
    # row's start, whatever vec is (RowSchedule.aligned_copy).
    aligned: bool
    reach: Reach
    why: str  # why the search reached this cluster size and storage, for the reason

    def can_async(self, t: Tensor) -> bool:
        """Whether cp.async can fill `t`'s shared row buffer: it copies 4, 8 or 16 bytes, and
        aligned copies always 16. Narrower vectors (a bool mask at vec 2) are copied through
        registers, which only pays with one stage."""
        return self.aligned or self.geometry.vec * t.dtype.itemsize in (4, 8, 16)


@dataclass(frozen=True)
class Rejection:
    """A storage choice that does not fit, and the limit it broke, with the numbers."""

    choice: str
    why: str

    def __str__(self) -> str:
        return f"{self.choice}: {self.why}"
