"""Outer-persistent scheduler: normalization along columns (softmax over dim 0, BatchNorm) in
one kernel that reads every input once.

A column's reductions need every row before any output of that column can be written. The
rows of a slab of columns are kept on chip instead of read again: a thread-block cluster
owns a slab, each of its blocks a share of the rows in shared memory. A block folds its rows
per column, the cluster folds its blocks' partials in rank order through distributed shared
memory, and the outputs are computed from the rows still held. A slab is as wide as its
rows' shared memory allows: SEGMENT_BYTES of each row, widest first, over as few blocks as
hold them. Columns too tall for any cluster, like kernels that spill or clusters the driver
cannot keep resident, are left to the segments (fuser/segment.py: a sweep per level, the
executor's columns_too_tall).

An outer reduction with column outputs only (column sums, means and extremes, a mean over
the sequence) keeps nothing: its rows stream through the same kernel (OuterSchedule.streamed),
each block accumulating its share of a slab's rows in registers as it reads them, the
cluster folding the shares as above. No partial rows go through global memory and no
finalize kernel follows, as they do behind the row kernel (inner_outer_persistent), which
keeps the fusions whose slabs are too few to fill the SMs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fuser.analysis import FusionInfo, Kind, Role
from fuser.device import DeviceSpec
from fuser.errors import HintError, UnsupportedFusionError
from fuser.ir import Tensor
from fuser.schedulers.base import (
    OuterSchedule,
    Problem,
    ceil_div,
    held_tile_start,
    next_pow2,
    pick_vec,
)
from fuser.schedulers.finalize import total_type
from fuser.schedulers.hints import CLUSTER_SIZES, Hints
from fuser.schedulers.outer_folds import Fold, fold_levels
from fuser.schedulers.pointwise import vector_itemsizes
from fuser.schedulers.row_geometry import blocks_per_sm, register_limit
from fuser.smem import SmemPlan

# Bytes of each row a slab spans, widest first: a warp's loads and stores of a row are whole
# 32-byte sectors from 32 bytes, whole 128-byte lines at 128.
SEGMENT_BYTES = (128, 64, 32, 16)
LARGE_CLUSTER = 16  # past PORTABLE_CLUSTER: a kernel attribute allows it on sm_90
THREADS = 512  # per block, where the rows are enough to give every thread one
# (row segment bytes, threads per block, least resident blocks per SM), tried in this order
# with the fewest blocks per cluster first. Two blocks of an SM overlap one's copies with the
# other's passes and stores, but not at the price of segments under 64 bytes (H200 bf16,
# 16384 x 4096: 0.49 at 32 bytes and two blocks, 0.52 at 64 and one; 4096 x 16384: 0.69 at
# 128 and two, 0.56 at 128 and one). Each entry that fits is a candidate, so a kernel that
# spills at 512 threads (fewer registers each) is built next at 256, the same segments.
ORDER = ((128, 256, 2), (64, 256, 2), (128, THREADS, 1), (64, THREADS, 1), (128, 256, 1),
         (64, 256, 1), *((s, t, 1) for s in SEGMENT_BYTES[2:] for t in (THREADS, 256)))
TOTAL_BYTES = 8  # a column partial past a warp's (a double, or a 64-bit integer)
# The fewest registers a thread is built with: __launch_bounds__ asks for as many blocks per
# SM as shared memory holds, up to those that leave each thread this many (three of 256
# threads at 80), and a kernel that spills there is rebuilt for one block fewer. The kernels
# take 71 to 104 (bf16 softmax over dim 0, BatchNorm forward and backward, NVRTC 13); a third
# block of softmax over dim 0 (84 registers at two) is worth squeezing it to 80.
REGISTERS = 80
# The most registers a thread's held rows may take (OuterSchedule.held_rows): a 2-block entry
# of ORDER whose shares do not fit shared memory twice keeps the first rows of each thread of
# one input in registers instead, as few as make room for the second block. BatchNorm
# backward at [16384, 4096] bf16 keeps x and dy, 64 KB each a block of a cluster of 16: one
# block per SM, where 7 of dy's 16 rows a thread held (28 registers) leave two of 256 threads.
HELD_REGISTERS = 32


def can_schedule(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    if info.kind not in (Kind.OUTER_NORM, Kind.OUTER):
        return (f"outer_persistent normalizes or reduces along columns; this fusion is "
                f"{info.kind.value}")
    if info.outputs(Role.ROW):
        names = ", ".join(t.name for t in info.outputs(Role.ROW))
        return f"per-row outputs ({names}): the column kernel writes full and column outputs"
    for e in info.outer_reductions:
        if total_type(e.outputs[0].dtype) not in ("double", "long long"):
            return (f"{e.op}({e.inputs[0].name}) of {e.outputs[0].dtype.label}: the kernel "
                    "folds column partials of 8-byte types only (double, Int64)")
    if info.kind is Kind.OUTER:
        return _not_streamed(info, problem, device)
    clusters = _clusters(device)
    if next(_fits(info, problem, device, clusters), None) is None:
        return _refusal(info, problem, device, clusters)
    return None


def candidates(info: FusionInfo, problem: Problem, device: DeviceSpec,
               hints: Hints | None = None) -> Iterator[OuterSchedule]:
    """The schedules that fit, best first: the widest slab over the fewest blocks (or the
    hinted cluster's), then the next ORDER entries, which the build tries where one spills."""
    if info.kind is Kind.OUTER:
        if hints is not None and hints.given():
            raise HintError("an outer reduction's column kernel takes no hints (a hint asks "
                            "for the row kernel with its finalize: inner_outer_persistent)")
        yield from _streamed(info, problem, device)
        return
    allowed = _clusters(device)
    if hints is not None:
        _check_hints(hints, allowed)
    clusters = allowed if hints is None or hints.cluster is None else (hints.cluster,)
    fits = _fits(info, problem, device, clusters)
    first = next(fits, None)
    if first is None:
        refusal = _refusal(info, problem, device, clusters)
        if hints is not None and hints.cluster is not None:
            held = [k for k in allowed if next(_fits(info, problem, device, (k,)), None)]
            raise HintError(f"Hints(cluster={hints.cluster}): {refusal}; clusters that hold "
                            f"these rows: {', '.join(map(str, held))}")
        raise UnsupportedFusionError(refusal)
    yield first
    yield from fits


def _clusters(device: DeviceSpec) -> tuple[int, ...]:
    """Blocks a slab may be shared by: clusters from sm_90, up to the 16 Hopper allows a
    kernel that opts in (the loader sets its non-portable cluster size attribute)."""
    return (1, *CLUSTER_SIZES, LARGE_CLUSTER) if device.arch >= 90 else (1,)


def _check_hints(hints: Hints, allowed: tuple[int, ...]) -> None:
    others = [name for name in hints.given() if name != "cluster"]
    if others:
        raise HintError(f"Hints({', '.join(others)}=...): outer_persistent takes only the "
                        "cluster hint (blocks sharing a slab's rows)")
    if hints.cluster is not None and hints.cluster not in allowed:
        raise HintError(f"Hints(cluster={hints.cluster}): allowed: "
                        f"{', '.join(map(str, allowed))}")


def _fits(info: FusionInfo, problem: Problem, device: DeviceSpec,
          clusters: tuple[int, ...]) -> Iterator[OuterSchedule]:
    """For each ORDER entry, the first cluster whose shared memory fits the entry's slab with
    its least blocks per SM; where no entry of two or more blocks fits so, the first cluster
    that fits each such entry with rows held in registers (_held); each geometry once."""
    seen = set()
    vec = _vec(info, problem)
    plain = [_first_resident((_schedule(info, problem, device, vec, segment, k, threads)
                              for k in clusters), blocks)
             for segment, threads, blocks in ORDER]
    one_block = all(s is None for s, (_, _, blocks) in zip(plain, ORDER, strict=True)
                    if blocks > 1)
    for (segment, threads, blocks), schedule in zip(ORDER, plain, strict=True):
        if schedule is None and blocks > 1 and one_block:
            schedule = _first_resident((h for k in clusters for h in _held(
                info, problem, device, vec, segment, k, threads)), blocks)
        if schedule is not None:
            geometry = (schedule.slab, schedule.threads, schedule.cluster, schedule.held_rows)
            if geometry not in seen:
                seen.add(geometry)
                yield schedule


def _first_resident(schedules: Iterable[OuterSchedule], blocks: int) -> OuterSchedule | None:
    """The first of `schedules` whose shared memory fits with `blocks` blocks per SM."""
    return next((s for s in schedules if s.smem.fits and s.blocks_per_sm >= blocks), None)


def _held(info: FusionInfo, problem: Problem, device: DeviceSpec, vec: int, segment: int,
          cluster: int, threads: int) -> Iterator[OuterSchedule]:
    """_schedule's slab with 1, 2, ... rows of each thread of the last full input held in
    registers (OuterSchedule.held_rows), up to HELD_REGISTERS and the rows a thread visits."""
    rows = 1
    while rows * row_registers(vec, info.full_inputs[-1]) <= HELD_REGISTERS:
        schedule = _schedule(info, problem, device, vec, segment, cluster, threads, rows)
        if schedule.held_rows < rows:  # a thread visits fewer rows than that
            return
        yield schedule
        rows += 1


def row_registers(vec: int, t: Tensor) -> int:
    """Registers a thread's vector of a row of t takes."""
    return max(1, vec * t.dtype.itemsize // 4)


def _refusal(info: FusionInfo, problem: Problem, device: DeviceSpec,
             clusters: tuple[int, ...]) -> str:
    """Why no schedule fits: the smallest one's shared memory (the narrowest slab, ORDER's
    last entry, over the largest cluster)."""
    segment, threads, _ = ORDER[-1]
    smallest = _schedule(info, problem, device, _vec(info, problem), segment, clusters[-1],
                         threads)
    return (f"columns of {smallest.rows} rows (the call's, rounded up as kernels are built) of "
            f"{len(info.full_inputs)} input(s) do not fit on a cluster of {clusters[-1]} "
            f"block(s) even {smallest.slab} column(s) wide: {smallest.smem.total} B of shared "
            f"memory per block, over the {device.smem_per_block_optin} B limit")


# Streamed column kernels (an outer reduction): each slab, 128 bytes of each row wide, has
# its rows split over a cluster of the fewest blocks (of STREAMED_CLUSTERS) that gives the
# grid at least STREAMED_WAVE of the SMs a block each; where none does the row kernel with its
# finalize takes the fusion (many rows of few columns: 65536 x 768 bf16 ran 0.75 of the copy
# in 64-byte segments over clusters of 8, 0.82 in the row kernel, H100). Blocks of
# STREAMED_THREADS, each thread STREAMED_UNROLL rows' loads in flight, keep an SM's copies
# going without a second block. Against the row kernel and its finalize (bf16, H100, one
# job): a mean over the sequence of [8, 1024, 4096] 0.64 -> 0.77 of the copy, of
# [4, 4096, 16384] 0.81 -> 0.97, column sums of 16384 x 1024 / 4096 0.79 / 0.77 -> 0.93 /
# 0.82, 2048 x 4096 0.50 -> 0.75, the max of 16384 x 24578 0.91 even.
STREAMED_SEGMENT = 128
STREAMED_CLUSTERS = (1, 2, 4, 8)
STREAMED_WAVE = 0.9
# The fewest rows of a group a streamed block reads: fewer leave its row lanes idle and its
# folds most of its work (a group of 8 rows would take 4096 blocks of 64 threads per 128
# slabs); such groups, and clusters that would split a group's rows finer, are the row
# kernel's. (The wave counts one group's blocks: more groups only add waves.)
STREAMED_MIN_ROWS = 64
STREAMED_THREADS = 512
STREAMED_UNROLL = 4
# Wider slabs for groups of few rows: at 128 bytes a block of 64 rows gives each thread one
# row to read before its folds; a slab of up to STREAMED_WIDEST bytes has fewer row lanes,
# each reading STREAMED_UNROLL rows, while the groups' slabs still fill every SM's blocks.
# H100, bf16 means over the sequence: [128, 64, 2048] 0.46 -> 0.81-0.85 of the copy (512-byte
# slabs), [1024, 64, 1024] 0.40 -> 0.87, [32, 128, 4096] 0.56 -> 0.79-0.82 (256 bytes).
STREAMED_WIDEST = 1024
# Registers a streamed kernel's thread is built with: two blocks of 512 threads per SM, so a
# grid of up to twice the SMs runs in one wave (a column's accumulators and four rows' loads
# in flight take 30 to 60).
STREAMED_REGISTERS = 64


def _streamed(info: FusionInfo, problem: Problem, device: DeviceSpec
              ) -> Iterator[OuterSchedule]:
    """The streamed schedule of an outer reduction (_streamed_or_why), if any."""
    found = _streamed_or_why(info, problem, device)
    if isinstance(found, OuterSchedule):
        yield found


def _streamed_or_why(info: FusionInfo, problem: Problem, device: DeviceSpec
                     ) -> OuterSchedule | str:
    """The streamed schedule of an outer reduction: over the fewest blocks per slab that
    fill the SMs with the slabs of every group (Problem.groups), each reading at least
    STREAMED_MIN_ROWS of a group's rows; or why none is (full outputs, fold buffers over
    shared memory, groups of few rows, slabs too few)."""
    if info.outputs(Role.FULL):  # bias gradients ran 0.64-0.90 streamed, 0.86-0.94 as rows
        names = ", ".join(o.name for o in info.outputs(Role.FULL))
        return (f"full outputs ({names}) beside the column reductions: the row kernel writes "
                "them as it sums")
    vec = _vec(info, problem)
    for k in (k for k in STREAMED_CLUSTERS if k in _clusters(device)):
        schedule = _schedule(info, problem, device, vec, STREAMED_SEGMENT, k, STREAMED_THREADS,
                             streamed=True)
        if not schedule.smem.fits:
            return (f"the fold buffers of {len(info.outer_reductions)} column reductions over "
                    f"a cluster of {k} take {schedule.smem.total} B of shared memory per block, "
                    f"over the {device.smem_per_block_optin} B limit")
        if schedule.rank_rows < STREAMED_MIN_ROWS:
            return (f"a group's {problem.rows} rows over a cluster of {k} leave a block "
                    f"{schedule.rank_rows}, fewer than the {STREAMED_MIN_ROWS} a streamed "
                    "block reads at least: the row kernel takes whole rows")
        if schedule.slabs * k * problem.groups >= STREAMED_WAVE * device.sm_count:
            return _widened(info, problem, device, schedule) if k == 1 else schedule
    groups = f" in each of {problem.groups} groups" if problem.groups > 1 else ""
    return (f"{schedule.slabs} slab(s) of {schedule.slab} columns{groups} over clusters of at "
            f"most {k} keep fewer than {STREAMED_WAVE:.0%} of the {device.sm_count} SMs busy: "
            "the row kernel's grid spreads the rows")


def _widened(info: FusionInfo, problem: Problem, device: DeviceSpec,
             schedule: OuterSchedule) -> OuterSchedule:
    """`schedule` (one block a slab) with its slab doubled up to STREAMED_WIDEST bytes while
    its threads read fewer than STREAMED_UNROLL rows each, as long as the slabs of every
    group still fill STREAMED_WAVE of the SMs' resident blocks."""
    segment = STREAMED_SEGMENT
    while ceil_div(schedule.rank_rows, schedule.row_lanes) < STREAMED_UNROLL:
        segment *= 2
        if segment > STREAMED_WIDEST:
            break
        wider = _schedule(info, problem, device, schedule.vec, segment, 1, STREAMED_THREADS,
                          streamed=True)
        resident = wider.blocks_per_sm * device.sm_count
        if (wider.slab == schedule.slab or not wider.smem.fits
                or wider.slabs * problem.groups < STREAMED_WAVE * resident):
            break
        schedule = wider
    return schedule


def _not_streamed(info: FusionInfo, problem: Problem, device: DeviceSpec) -> str | None:
    """Why an outer reduction's rows cannot stream through the column kernel (None: they
    can)."""
    found = _streamed_or_why(info, problem, device)
    return found if isinstance(found, str) else None


def _vec(info: FusionInfo, problem: Problem) -> int:
    """Vectors as wide as the [rows, hidden] tensors allow; column operands wider than that
    (fp32 statistics of bf16 rows) move in 16-byte pieces where the pointers allow."""
    return pick_vec(problem.hidden, vector_itemsizes(info, problem.align_bytes),
                    problem.align_bytes, input_bytes=info.row_buffer_bytes)


def _slab(hidden: int, vec: int, columns: int) -> int:
    """Columns of a slab: a power-of-two number of vectors, about `columns`, no wider than the
    power of two that covers the row."""
    lanes = next_pow2(max(1, columns // vec))
    return vec * min(lanes, next_pow2(ceil_div(hidden, vec)))


def _schedule(info: FusionInfo, problem: Problem, device: DeviceSpec, vec: int, segment: int,
              cluster: int, threads: int, held_rows: int = 0, streamed: bool = False
              ) -> OuterSchedule:
    """The schedule of a slab `segment` bytes of each row wide (of its widest input) over
    `cluster` blocks in vectors of `vec` (_vec), at most `threads` a block (fewer where the
    rows are few, never less than a warp); `streamed`, with no rows kept; `held_rows` of each
    thread's rows of the last full input in registers (at most the rows a thread visits)."""
    widest = max((t.dtype.itemsize for t in info.full_inputs), default=1)
    slab = _slab(problem.hidden, vec, max(1, segment // widest))
    rows = max(problem.rows, 1)
    col_lanes = slab // vec
    rank_rows = ceil_div(rows, cluster)
    row_lanes = max(1, min(threads // col_lanes, next_pow2(rank_rows)))
    row_lanes = max(row_lanes, ceil_div(device.warp_size, col_lanes))  # whole warps
    groups = fold_groups(col_lanes, row_lanes, device.warp_size)
    held_rows = min(held_rows, ceil_div(rank_rows, row_lanes))
    held = info.full_inputs[-1] if held_rows else None
    levels = fold_levels(info)
    plan = _smem(info, levels, slab, groups, rank_rows, cluster, device, streamed,
                 held, held_tile_start(held_rows, row_lanes))
    registers = STREAMED_REGISTERS if streamed else REGISTERS
    if held is not None:
        registers += held_rows * row_registers(vec, held)
    blocks = blocks_per_sm(device, col_lanes * row_lanes, registers, plan.total)
    where = f"cluster of {cluster}" if cluster > 1 else "one block"
    if streamed:
        reason = (f"{segment}-byte row segments streamed: {ceil_div(problem.hidden, slab)} "
                  f"slabs of {slab} columns, {'a ' if cluster > 1 else ''}{where} each")
        if problem.groups > 1:
            reason += f", in each of {problem.groups} or more groups"
    else:
        reason = (f"{segment}-byte row segments: {rank_rows} rows x {slab} columns per block, "
                  f"{where} per slab")
    if held is not None:
        reason += (f"; {held.name}'s first {held_rows} rows of each thread held in registers, "
                   f"for {blocks} blocks per SM")
    reason += "".join(f"; {fold.words()} (one pass and one fold for both)"
                      for level in levels for fold in level if fold.online_sum is not None)
    return OuterSchedule("outer_persistent", reason, problem.hidden, rows, vec, slab, col_lanes,
                         row_lanes, groups, cluster, rank_rows, max(1, blocks), plan, streamed,
                         held.name if held is not None else "", held_rows)


def rebuilt_blocks(s: OuterSchedule, device: DeviceSpec) -> int | None:
    """Blocks per SM to rebuild `s` for after ptxas spilled at s.blocks_per_sm: the most whose
    register limit (__launch_bounds__'s: the register file over blocks x threads, in steps of
    8) is at least a quarter above this one's, or None where it is at the per-thread maximum.
    One block fewer at a time would often compile again under the same limit (thread counts
    of 32 to 64 at a few rows run 12 to 25 blocks)."""
    now = register_limit(device, s.threads, s.blocks_per_sm)
    return next((b for b in range(s.blocks_per_sm - 1, 0, -1)
                 if register_limit(device, s.threads, b) * 4 >= now * 5), None)


def fold_groups(col_lanes: int, row_lanes: int, warp: int) -> int:
    """Row lanes left after a warp folds its own (those of one column lane) by shuffles: the
    rows of the fold buffers (OuterSchedule.fold_rows, which the kernel gets as ColumnSlab's
    GROUPS and checks against its shuffles)."""
    span = warp // col_lanes if col_lanes < warp else 1
    return max(1, row_lanes // span)


def _smem(info: FusionInfo, levels: tuple[tuple[Fold, ...], ...], slab: int, groups: int,
          rank_rows: int, cluster: int, device: DeviceSpec, streamed: bool,
          held: Tensor | None = None, held_rows: int = 0) -> SmemPlan:
    """The shared-memory plan of a slab: the block's rows of each full input (none where
    streamed; of `held`, those past its first `held_rows`, which the threads keep in
    registers), the fold buffers of `levels` (fold_levels), a cluster's inboxes and
    mbarriers."""
    requests = []
    for t in () if streamed else info.full_inputs:
        kept = rank_rows - held_rows if t is held else rank_rows
        past = f", the block's rows from {held_rows} on" if t is held else ""
        requests.append((tile_buffer(t), max(kept, 0) * slab * t.dtype.itemsize,
                         f"{t.name}'s rows of the slab ({t.dtype.label}{past}): "
                         f"{max(kept, 0)} x {slab}"))
    lanes: dict[str, list[Fold]] = {}  # the folds taking turns in each buffer
    totals: dict[str, list[Fold]] = {}
    for fold in (fold for level in levels for fold in level):
        lanes.setdefault(lanes_buffer(levels, fold), []).append(fold)
        totals.setdefault(total_buffer(levels, fold), []).append(fold)
    for name, users in lanes.items():
        words = ", ".join(fold.operation() for fold in users)
        requests.append((name, groups * slab * _BYTES[lane_type(users[0])],
                         f"{words} over each warp's rows, level by level: {groups} x {slab}"))
    if cluster > 1:  # a level's inbox bytes fit shared memory, under an mbarrier's 2^20 count
        requests += [(inbox_buffer(fold), cluster * slab * TOTAL_BYTES,
                      f"{fold.totals}: the cluster's partials per column, pushed here "
                      f"by each block: {cluster} x {slab}")
                     for level in levels for fold in level]
    requests += [(name, slab * TOTAL_BYTES, f"{', '.join(fold.totals for fold in users)}: "
                  "the slab's totals per column, level by level")
                 for name, users in totals.items()]
    if cluster > 1:
        requests.append((LEVEL_BARRIERS, len(levels) * 8,
                         f"one mbarrier per level ({len(levels)}): the inboxes' rows have "
                         "arrived"))
    return SmemPlan.build(requests, device.smem_per_block_optin)


def tile_buffer(t: Tensor) -> str:
    """The shared buffer of full input t's rows."""
    return f"s_{t.name}"


# A level's lanes and totals buffers are free once its totals are read (two block barriers
# before the next level's first write), so the levels take turns in them: the n-th fold of
# each type in a level uses the n-th buffer of that type. Inboxes are each fold's own: a peer
# may push the next level's partials before this block has read this level's. A max folded
# with its sum of exponentials (outer_folds) is one 8-byte pair, fm::MaxSum, from the warps on.
ONLINE_PAIR = "fm::MaxSum"
_WORDS = {"float": "f32", "double": "f64", "long long": "i64", ONLINE_PAIR: "pair"}
_BYTES = {"float": 4, "double": 8, "long long": 8, ONLINE_PAIR: 8}
LEVEL_BARRIERS = "s_level_bars"  # a cluster's mbarriers, one per level of column reductions


def lane_type(fold: Fold) -> str:
    """The C++ type of a warp's partial of a fold: the reduction's own (compute) type, a
    float for Float and narrower sums (the 8-byte totals start past the warps), or a pair."""
    if fold.online_sum is not None:
        return ONLINE_PAIR
    return fold.reduction.outputs[0].dtype.compute_type


def lanes_buffer(levels: tuple[tuple[Fold, ...], ...], fold: Fold) -> str:
    return f"s_lanes{_turn(levels, fold, lane_type)}_{_WORDS[lane_type(fold)]}"


def total_buffer(levels: tuple[tuple[Fold, ...], ...], fold: Fold) -> str:
    return f"s_total{_turn(levels, fold, fold_total_type)}_{_WORDS[fold_total_type(fold)]}"


def inbox_buffer(fold: Fold) -> str:
    return f"s_inbox_{fold.name}"


def fold_buffer_types(levels: tuple[tuple[Fold, ...], ...]) -> dict[str, str]:
    """The C++ type of each lanes, inbox and totals buffer of the folds of `levels`."""
    types = {}
    for fold in (fold for level in levels for fold in level):
        types[lanes_buffer(levels, fold)] = lane_type(fold)
        types[inbox_buffer(fold)] = types[total_buffer(levels, fold)] = fold_total_type(fold)
    return types


def fold_total_type(fold: Fold) -> str:
    """The C++ type of a fold's column totals past the warps (8 bytes: what a push moves)."""
    if fold.online_sum is not None:
        return ONLINE_PAIR
    return total_type(fold.reduction.outputs[0].dtype)


def _turn(levels: tuple[tuple[Fold, ...], ...], fold: Fold, kind) -> int:
    """How many folds of the fold's level before it have its type (`kind` of them)."""
    level = next(lv for lv in levels if fold in lv)
    return sum(kind(other) == kind(fold) for other in level[:level.index(fold)])
