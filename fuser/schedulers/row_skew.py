"""Skewed rows (RowSchedule.skew) in the row search: whether it tries them, the geometry
they take, and why a skewed=True hint is refused.

A row whose length the 16-byte vector does not divide (bf16 24578 = 2 x 12289) is read in the
tensor's own 16-byte vectors from the boundary at or below its start, its first and last
vectors masked to its elements (fuser_rows.cuh, RowPart with SKEW), where the plain row is
cut into the 2- or 4-byte vectors that divide it ("skewed rows" in bench/TUNING.md).
"""

from __future__ import annotations

from dataclasses import replace

from fuser.analysis import Role
from fuser.device import DeviceSpec
from fuser.schedulers.base import Dealing, Problem, RowSchedule, Storage, ceil_div, skewed_vectors
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_geometry import geometry
from fuser.schedulers.row_records import RowFusion, RowGeometry, RowPolicy

# At most this many threads a row, and fewer while a thread would own fewer vectors than the
# policy's skewed_vectors_per_thread (skewed_threads).
SKEWED_MAX_THREADS = 512
# Rows are skewed by default only from this many skewed vectors (skews).
SKEWED_DEFAULT_MIN_VECTORS = 512
# Fusions with column inputs skew their rows by default only where the vectors that divide
# the row are at most this many bytes wide (skews).
SKEWED_COLUMNS_MAX_NARROW_BYTES = 4


# Skewed rows over a cluster are tried first (where skewed_loses moves one block's after the
# plain rows) only where the plain rows' vectors are at most this many bytes wide
# (clustered_skewed_rows), and with at least this many blocks per SM (clustered_skewed_keeps).
SKEWED_CLUSTER_MAX_NARROW_BYTES = 2
CLUSTERED_MIN_BLOCKS = 2


def skews(fusion: RowFusion, problem: Problem, hints: Hints) -> bool:
    """Whether the search tries skewed rows: where the fusion's rows may be skewed
    (RowFusion.skew), the hints allow it (no aligned copies), and, unless
    skewed=True, the row spans at least SKEWED_DEFAULT_MIN_VECTORS skewed vectors (4099
    bf16, 514, is the smallest row timed skewed; below it the row's edges weigh more and
    nothing was measured); for fusions with column inputs, the vectors that divide the
    row are at most SKEWED_COLUMNS_MAX_NARROW_BYTES wide: fp32 24578 (8-byte vectors,
    copied in aligned 16-byte chunks) lost skewed, layernorm_fwd 0.81 -> 0.77,
    dropout_layernorm_fwd 0.82 -> 0.74, where bf16's 4-byte vectors gained. Fusions with
    column sums only when hinted: their skewed rows, of the forward's geometry, lost at
    bf16 24578 (rmsnorm_bwd 0.85 -> 0.79) and 4099 (dropout_rmsnorm_bwd 0.77 -> 0.52;
    bench/TUNING.md, "skewed rows")."""
    skew = fusion.skew(problem)
    if not skew or hints.skewed is False or _broken_by(hints):
        return False
    if hints.skewed:
        return True
    narrow = skew * fusion.widest
    return (ceil_div(problem.hidden, fusion.skewed_vec(problem)) >= SKEWED_DEFAULT_MIN_VECTORS
            and (not fusion.cols or narrow <= SKEWED_COLUMNS_MAX_NARROW_BYTES)
            and not fusion.info.outer_reductions)


def skewed_loses(schedule: RowSchedule) -> str | None:
    """Why the search passes over a skewed schedule for the rows' own vectors, in words (None:
    it keeps it first): one block per SM in one stage that re-reads its column inputs from
    global memory every pass, columns of at least as many bytes an element as its row inputs.
    Such a block stalls on the columns' loads with no other block on its SM, and no stage
    loading the next row, where the plain rows split over a cluster load the next row while
    they compute (H100 80GB HBM3, bf16, 16384 rows, fraction of the copy, skewed -> plain:
    rmsnorm_fwd 65537 0.79 -> 0.90, 98305 0.65 -> 0.85, layernorm_fwd 65537 0.60 -> 0.63;
    fp32 32769 rmsnorm_fwd 0.77 -> 0.92, layernorm_fwd 0.64 -> 0.93). Dropout's three row
    inputs outweigh its columns and keep skewed rows (bf16 24577: dropout_rmsnorm_fwd 0.91
    skewed against 0.88, dropout_layernorm_fwd 0.78 against 0.75; bench/TUNING.md, "skewed
    rows at one block per SM")."""
    if not schedule.skew or schedule.blocks_per_sm > 1 or schedule.stages > 1:
        return None
    reread = sum(p.dtype.itemsize for p in schedule.placements
                 if p.role is Role.COL and p.storage is Storage.GLOBAL)
    rows = sum(p.dtype.itemsize for p in schedule.placements if p.role is Role.FULL)
    if not reread or reread < rows:
        return None
    return (f"skewed rows would re-read {reread} bytes of columns an element at one block per "
            "SM in one stage")


def clustered_skewed_rows(fusion: RowFusion, problem: Problem) -> bool:
    """Whether the search tries skewed rows over a cluster before the plain rows, where one
    block's skewed rows lose (skewed_loses) or no block holds the row: the plain rows'
    vectors are at most SKEWED_CLUSTER_MAX_NARROW_BYTES wide (single 2-byte elements: bf16 /
    fp16 65537 to 131073; fp32's 4-byte ones ran 0.89-0.92 plain at 32769-57345) and the
    column inputs weigh at least as much an element as the row inputs: LayerNorm forward's
    weight and bias, RMSNorm forward's weight, which the plain rows read a single element at
    a time beside x. bf16, 16384 rows, H100 80GB HBM3, fraction of the copy, plain -> skewed
    over a cluster: LayerNorm 65537 0.68 -> 0.85, 98305 0.60 -> 0.87, 131073 0.59 -> 0.76;
    RMSNorm 65537 0.91 -> 0.90, 81921 0.83 -> 0.89, 98305 0.86 -> 0.89, 131073 0.87 -> 0.88
    (bench/TUNING.md, "skewed rows over a cluster")."""
    cols = sum(t.dtype.itemsize for t in fusion.cols)
    rows = sum(t.dtype.itemsize for t in fusion.full)
    return (fusion.vec(problem) * fusion.widest <= SKEWED_CLUSTER_MAX_NARROW_BYTES
            and cols >= rows)


def clustered_skewed_keeps(schedule: RowSchedule) -> bool:
    """Whether the search takes this schedule of skewed rows over a cluster first: every
    buffer in shared memory, the columns at the rows' skew, CLUSTERED_MIN_BLOCKS blocks per
    SM. LayerNorm forward, bf16, 16384 rows, H100 80GB HBM3, fraction of the copy (plain
    single-element rows over a cluster: 0.68 at 65537, 0.60 at 98305): skewed over a cluster
    of 2 / 4 (one / two blocks per SM) 0.87 / 0.85 at 65537; of 4 / 8 (one / three) 0.60 /
    0.87 at 98305; the columns re-read from global memory instead 0.73 / 0.75
    (bench/TUNING.md, "skewed rows over a cluster")."""
    return (schedule.columns_at_skew and schedule.buffers_in_smem
            and schedule.blocks_per_sm >= CLUSTERED_MIN_BLOCKS)


def clustered_skewed_why(cluster: int) -> str:
    return (f"skewed rows over a cluster of {cluster} keep the columns in shared memory at the "
            "rows' skew, where the plain rows are single elements")


def skewed_geometry(fusion: RowFusion, problem: Problem, device: DeviceSpec,
                    policy: RowPolicy, hints: Hints, cluster: int) -> RowGeometry:
    """The geometry of a skewed row: that of a row as long as its vectors reach (the policies
    then see the vectors a thread owns), at most skewed_threads() threads a row, with the
    row's own length and skew."""
    vec, skew = fusion.skewed_vec(problem), fusion.skew(problem)
    spanned = replace(problem, hidden=skewed_vectors(problem.hidden, vec, skew) * vec)
    geo = geometry(fusion, spanned, device, policy, hints, cluster)
    most = skewed_threads(ceil_div(geo.vectors, cluster), policy.skewed_vectors_per_thread)
    if hints.threads_per_row is None and geo.threads_per_row > most:
        geo = geometry(fusion, spanned, device, policy, replace(hints, threads_per_row=most),
                       cluster)
    return replace(geo, hidden=problem.hidden, skew=skew)


def skewed_threads(vectors: int, per_thread: int) -> int:
    """Threads a skewed row of `vectors` vectors takes at most: SKEWED_MAX_THREADS, fewer
    (down to a warp) while a thread would own under `per_thread` of them. Such a row rarely
    fills its last round (hidden 24578: 3073 vectors), so one thread makes one round more
    than the others, and the row's block waits for it at every reduction; with more vectors
    a thread the extra round weighs less, and with smaller blocks others fill the SM
    meanwhile (bench/TUNING.md, "skewed rows")."""
    threads = SKEWED_MAX_THREADS
    while threads > 32 and vectors < per_thread * threads:
        threads //= 2
    return threads


def hint_refusals(fusion: RowFusion, problem: Problem, hints: Hints) -> list[str]:
    """What skewed=True needs and does not have here, in words (none: it is honoured): rows
    that may be skewed (RowFusion.skew_refusals), and no hint that skewed rows break."""
    why = fusion.skew_refusals(problem) + _broken_by(hints)
    if fusion.info.outer_reductions and hints.dealing is Dealing.DYNAMIC:
        why.append("dealing None or 'strided' (a thread's rows must share a skew for its "
                   "column sums)")
    return why


def _broken_by(hints: Hints) -> list[str]:
    """The hints that no skewed row honours, as what they must be instead (none: the hints
    leave skewed rows possible): the search does not try skewed rows beside them, and
    skewed=True beside them is refused."""
    why = []
    if hints.aligned_copy:
        why.append("aligned_copy None or False (skewed rows copy whole vectors)")
    return why
