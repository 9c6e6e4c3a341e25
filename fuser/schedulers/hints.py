"""Hints: overrides of the heuristic, in the vocabulary of the schedulers' policies.

Every hint is either honoured, with results as correct as the heuristic's, or refused before
anything is compiled with a HintError that names the value, the allowed values and what the
heuristic picks. `Hints` normalizes its fields when built (storage names become `Storage`
members, lists become tuples, so Hints stay hashable cache keys); `check` then holds each
value against the fusion and the device, and the row search refuses a hint no schedule can
honour, naming what it tried.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

from fuser.device import DeviceSpec
from fuser.errors import HintError
from fuser.schedulers.base import COLUMN_SUM_DEALINGS, Dealing, Storage

CLUSTER_SIZES = (2, 4, 8)  # blocks a row may be split over (a thread-block cluster, sm_90)
PORTABLE_CLUSTER = max(CLUSTER_SIZES)  # more blocks a cluster need a kernel attribute (16)
# smem row buffers per row slot: 2 loads the next row while this one computes, 3 the next two
STAGES = (1, 2, 3)
ACCUMULATOR_STORAGES = (Storage.REGISTERS, Storage.SMEM, Storage.GLOBAL)


@dataclass(frozen=True)
class Hints:
    """Overrides for tuning and tests; None lets the heuristic decide.

    threads_per_row   threads sharing one row: a power of two (rows reduce by warp shuffles
                      over aligned groups of lanes), at most the device's threads per block
    rows_per_block    rows a block works on at once (threads_per_row x this <= the limit)
    cluster           blocks of a thread-block cluster sharing each row: 1, or 2, 4, 8 on sm_90
                      (an outer normalization's slab of columns: 16 too)
    stages            1, 2 or 3: the next one or two rows' shared row buffers load while
                      these compute (3 not beside dealing=dynamic)
    storage           ((tensor, storage), ...): where each named full or column input lives,
                      `registers`, `smem`, `global` (re-read each pass) or `ring` (re-read
                      through the staging ring, full inputs only); inputs not named stay in
                      registers (a skewed row's columns: global)
    accumulators      where the column (outer) reductions accumulate: registers, smem or
                      global (the block's own partial rows of the workspace)
    finalize_lanes    threads summing one column's partial rows in a finalize kernel of its
                      own (given alone, it asks for that kernel)
    fused_finalize    True: the row kernel sums its own columns after a grid-wide barrier
                      (refused where it cannot: a cluster, a counter's dealing, skewed rows,
                      or shared memory it would cost a block per SM); False: a finalize
                      kernel of its own
    aligned_copy      True: fill shared row buffers with 16-byte copies from below each row's
                      start (where vectors are narrower than 16 bytes and the inputs 16-byte
                      aligned); False: copies of one vector each
    skewed            True: rows whose vectors are narrower than the dtypes allow (hidden
                      24578: 2 bf16) take the widest vectors from the boundary below each
                      row's start, the row's edges masked (RowSchedule.skew), over a
                      cluster too where one is hinted (then one row a block where columns stay
                      in smem or are summed); False: vectors that divide hidden
    dealing           how row groups reach blocks: `strided` (a persistent grid, fixed
                      strides), `dynamic` (a persistent grid taking groups from a counter;
                      blocks that own whole rows outside a staging ring, not skewed ones with
                      column sums or one a block with columns in smem (a block's rows share a
                      skew there); column sums then differ from run to run in their last
                      bits) or `grid` (a block per group;
                      fusions without column sums)
    """

    threads_per_row: int | None = None
    rows_per_block: int | None = None
    cluster: int | None = None
    stages: int | None = None
    storage: tuple[tuple[str, Storage], ...] | None = None
    accumulators: Storage | None = None
    finalize_lanes: int | None = None
    fused_finalize: bool | None = None
    aligned_copy: bool | None = None
    skewed: bool | None = None
    dealing: Dealing | None = None

    def __post_init__(self) -> None:
        for name in ("threads_per_row", "rows_per_block", "cluster", "stages", "finalize_lanes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise HintError(f"Hints({name}={value!r}): an int is needed")
        for name in ("aligned_copy", "skewed", "fused_finalize"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise HintError(f"Hints({name}={value!r}): True or False")
        if self.storage is not None:
            object.__setattr__(self, "storage", _storage_pairs(self.storage))
        if self.accumulators is not None:
            object.__setattr__(self, "accumulators",
                               _storage("accumulators", self.accumulators))
        if self.dealing is not None:
            object.__setattr__(self, "dealing", _dealing(self.dealing))

    def given(self) -> dict[str, object]:
        """The hints that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def words(self) -> str:
        """'threads_per_row=64, storage=T0:smem,T1:ring': the set hints, as written."""
        return ", ".join(f"{k}={_value_words(v)}" for k, v in self.given().items())

    def for_rows(self) -> Hints:
        """These hints as the row scheduler takes them: less the finalize's, and where a fused
        finalize is asked for, what it needs of the rows unless hinted otherwise (no
        cluster, fixed strides, rows not skewed)."""
        rows = replace(self, finalize_lanes=None, fused_finalize=None)
        if self.fused_finalize:
            rows = replace(rows, cluster=_given(self.cluster, 1),
                           dealing=_given(self.dealing, Dealing.STRIDED),
                           skewed=_given(self.skewed, False))
        return rows


def _given(value, otherwise):
    return otherwise if value is None else value


def _value_words(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{name}:{storage}" for name, storage in value)
    return str(value)


def _storage(what: str, value: object) -> Storage:
    try:
        return Storage(value)
    except ValueError:
        raise HintError(f"Hints({what}=...): {value!r} is not a storage; allowed: "
                        f"{', '.join(s.value for s in Storage)}") from None


def _dealing(value: object) -> Dealing:
    try:
        return Dealing(value)
    except ValueError:
        raise HintError(f"Hints(dealing={value!r}): not a dealing; allowed: "
                        f"{', '.join(d.value for d in Dealing)}") from None


def _storage_pairs(value: object) -> tuple[tuple[str, Storage], ...]:
    """`value` as ((tensor name, Storage), ...); a dict is taken as its items."""
    items = value.items() if isinstance(value, dict) else value
    pairs: list[tuple] = []
    if isinstance(items, Iterable) and not isinstance(items, str):
        try:
            pairs = [tuple(p) for p in items]
        except TypeError:
            pairs = []
    if not pairs or any(len(p) != 2 or not isinstance(p[0], str) for p in pairs):
        raise HintError(f"Hints(storage={value!r}): give (tensor name, storage) pairs, e.g. "
                        "(('T0', 'smem'), ('T2', 'registers'))")
    names = [p[0] for p in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise HintError(f"Hints(storage=...): {', '.join(twice)} named more than once")
    return tuple((name, _storage(f"storage {name}", s)) for name, s in pairs)


@dataclass(frozen=True)
class HintContext:
    """What the values of hints are checked against: the fusion's inputs and the device."""

    full_inputs: tuple[str, ...]  # names of the [rows, hidden] inputs
    col_inputs: tuple[str, ...]  # names of the [hidden] inputs
    vectors: int  # vectors per row (hidden / vec): each block of a cluster needs at least one
    # threads per row that rows_per_block multiplies: the hinted ones, or the geometry's at
    # the hinted cluster size (1 without one), so a block-size hint never brings in a cluster
    threads_per_row: int
    has_accumulators: bool  # the fusion has outer reductions
    has_finalize: bool  # a finalize kernel follows the row kernel
    device: DeviceSpec


def powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def check(hints: Hints, ctx: HintContext, default: Callable[[str], object]) -> None:
    """Raise a HintError for the first hint whose value the kernels cannot honour here;
    `default(name)` says what the heuristic picks for that hint (None: nothing to pick)."""
    for name, problem in _problems(hints, ctx):
        picked = default(name)
        raise HintError(f"Hints({name}={_value_words(getattr(hints, name))}): {problem}"
                        + (f"; the heuristic picks {name}={_value_words(picked)} here"
                           if picked is not None else ""))


def _problems(hints: Hints, ctx: HintContext):
    """(hint name, what is wrong with its value and what is allowed) for each bad hint."""
    device = ctx.device
    tpr = hints.threads_per_row
    sizes = powers_of_two(device.max_threads_per_block)
    if tpr is not None and tpr not in sizes:
        yield "threads_per_row", (
            "a row's threads must be a power of two (they reduce by warp shuffles over "
            f"aligned groups of lanes); allowed: {_listed(sizes)}")
    rpb = hints.rows_per_block
    if rpb is not None:
        most = device.max_threads_per_block // ctx.threads_per_row
        if not 1 <= rpb <= most:
            yield "rows_per_block", (
                f"allowed: 1 to {most} ({device.max_threads_per_block} threads per block on "
                f"{device.name} / {ctx.threads_per_row} threads per row"
                + ("" if tpr else ", more with fewer threads per row (a threads_per_row or "
                   "cluster hint)") + ")")
    if hints.cluster is not None:
        allowed = [1] + [k for k in CLUSTER_SIZES if device.arch >= 90 and k <= ctx.vectors]
        if hints.cluster not in allowed:
            yield "cluster", (
                f"allowed on {device.name} (sm_{device.arch}) with {ctx.vectors} vector(s) per "
                f"row: {_listed(allowed)} (clusters need sm_90, and each block at least one "
                "vector of the row)")
    if hints.stages is not None and hints.stages not in STAGES:
        yield "stages", f"allowed: {_listed(STAGES)}"
    yield from _storage_problems(hints, ctx)
    if hints.accumulators is not None:
        if not ctx.has_accumulators:
            yield "accumulators", "this fusion has no column (outer) reductions to accumulate"
        elif hints.accumulators not in ACCUMULATOR_STORAGES:
            yield "accumulators", f"allowed: {_listed(s.value for s in ACCUMULATOR_STORAGES)}"
    if hints.dealing is not None and ctx.has_accumulators and (
            hints.dealing not in COLUMN_SUM_DEALINGS):
        yield "dealing", (
            "a block per row group would write a partial row of the column sums per group; "
            f"allowed for this fusion: {_listed(COLUMN_SUM_DEALINGS)}")
    lanes = hints.finalize_lanes
    if lanes is not None:
        if not ctx.has_finalize:
            yield "finalize_lanes", "this fusion has no finalize kernel (no column outputs)"
        elif not 1 <= lanes <= device.max_threads_per_block:
            yield "finalize_lanes", f"allowed: 1 to {device.max_threads_per_block}"
        elif hints.fused_finalize:
            yield "finalize_lanes", ("a fused finalize takes the row kernel's threads as its "
                                     "lanes; finalize_lanes shapes a finalize kernel of its "
                                     "own (fused_finalize=False or unset)")
    if hints.fused_finalize is not None and not ctx.has_finalize:
        yield "fused_finalize", "this fusion has no column outputs to finalize"


def _storage_problems(hints: Hints, ctx: HintContext):
    if hints.storage is None:
        return
    known = ctx.full_inputs + ctx.col_inputs
    for name, storage in hints.storage:
        if name not in known:
            yield "storage", (
                f"{name} is not a row or column input of this fusion; allowed names: "
                f"{_listed(known)} (row inputs: {_listed(ctx.full_inputs)})")
        elif storage is Storage.RING and name in ctx.col_inputs:
            yield "storage", (
                f"the staging ring streams row inputs, not the column input {name}; allowed for "
                f"{name}: registers, smem, global")


def _listed(values) -> str:
    return ", ".join(str(v) for v in values) or "none"
