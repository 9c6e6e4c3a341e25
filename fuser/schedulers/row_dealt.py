"""The dealt steps of the row search (row_search.RowSearch puts them first where the policy
says so, RowPolicy.dealt_first): forward rows too long to be short, staged in one stage of
shared memory and dealt a block per row group, several blocks to an SM, which the hardware
starts as others end.

Against rows streamed through a staging ring or loaded into a second stage at one block per SM
and fixed strides, these ran (H200, bf16, 16384 rows, fraction of the copy) rmsnorm_fwd 16384
0.92 -> 0.98 (512 threads, two blocks per SM), softmax_fwd 16384 0.91 -> 0.97 (256 threads,
five) and 32768 0.94 -> 0.99 (512 threads, two) (bench/TUNING.md, "dealt rows").
"""

from __future__ import annotations

from collections.abc import Iterator

from fuser.device import DeviceSpec
from fuser.schedulers.base import Dealing, Problem, RowSchedule, Storage, ceil_div
from fuser.schedulers.hints import Hints
from fuser.schedulers.row_fit import fit
from fuser.schedulers.row_geometry import (
    cluster_sizes,
    geometry,
    over_half_an_sm,
    short_rows,
    stage_bytes,
)
from fuser.schedulers.row_records import Phase, RowFusion, RowPolicy
from fuser.schedulers.row_storage import staged_choice

# Hints that cannot change rows of whole 16-byte vectors, which the dealt steps stage: any
# other hint fixes something they decide (threads, rows and stages of a block, storage,
# dealing), and the search is the one it was
MOOT_HINTS = ("skewed", "aligned_copy")
# Vectors a thread of a dealt step may own: its row waits in shared memory, so a thread's
# vectors are not all in registers at once. At 16 (12 at bf16 49152, 512 threads), against
# one block per SM (H200, 16384 rows, fraction of the copy): softmax_fwd / log_softmax_fwd
# bf16 49152 0.92 -> 0.98 / 0.97, fp32 24576 0.93 -> 0.98 (bench/TUNING.md, "wider dealt
# steps")
VECTORS_PER_THREAD = 16


def shapes_block(hints: Hints) -> bool:
    """Whether a hint other than MOOT_HINTS is given: one that fixes what the dealt steps and
    the search's reordering rules decide (those were measured on the heuristic's own
    schedules)."""
    return bool(set(hints.given()) - set(MOOT_HINTS))


def dealt_shapes(fusion: RowFusion, problem: Problem, device: DeviceSpec, policy: RowPolicy,
                 hints: Hints) -> list[tuple[int, int]]:
    """(cluster size, threads per row) of each dealt step, in order: at each of
    dealt_clusters, the policy's threads per row and then half of them, while a thread owns
    at most VECTORS_PER_THREAD vectors. None where the policy does not deal rows first, a hint
    fixes what the steps decide, the rows are not of whole 16-byte vectors or are short (short
    rows try one stage first already), or are rows of three passes with column inputs
    (LayerNorm forward)."""
    if not policy.dealt_first or shapes_block(hints):
        return []
    if fusion.cols and policy.stages_first(fusion.passes):
        # dropout_layernorm_fwd bf16 8192 / 12288 ran 0.91 / 0.93 -> 0.86 / 0.85 so
        # (weight and bias reloaded by every block), though 4096 gained 0.90 -> 0.97
        return []
    whole = geometry(fusion, problem, device, policy, hints, 1)
    if fusion.narrow(whole.vec) or short_rows(fusion, whole.part, device):
        return []
    shapes = []
    for cluster in dealt_clusters(fusion, problem, device, whole.part):
        geo = whole if cluster == 1 else geometry(fusion, problem, device, policy, hints,
                                                  cluster)
        shapes += [(cluster, t) for t in (geo.threads_per_row, geo.threads_per_row // 2)
                   if t >= 32 and ceil_div(geo.part // geo.vec, t) <= VECTORS_PER_THREAD]
    return shapes


def dealt_clusters(fusion: RowFusion, problem: Problem, device: DeviceSpec,
                   part: int) -> list[int]:
    """Cluster sizes of the dealt steps: one block a row, and a cluster of two where one
    stage of the row (`part` elements) fills more than half an SM's shared memory (one block
    per SM at most) but half a row fills at most half, for fusions without column inputs.
    Against the row in one block per SM (H200, bf16, 16384 rows, fraction of the copy):
    softmax_fwd / log_softmax_fwd 65536 0.89 / 0.88 -> 0.95 / 0.96 (512 threads, two blocks
    per SM), softmax_bwd 32768 / 49152 1.02 / 1.01 -> 1.02. Clusters of four lost at 131072
    (softmax_fwd 0.88 -> 0.86), and rmsnorm_fwd 65536, with its weight, at two (0.97 -> 0.75)
    (bench/TUNING.md, "dealt rows over clusters")."""
    if fusion.cols or 2 not in cluster_sizes(fusion, problem, device):
        return [1]
    if (not over_half_an_sm(stage_bytes(fusion, part), device)
            or over_half_an_sm(stage_bytes(fusion, ceil_div(part, 2)), device)):
        return [1]
    return [1, 2]


def dealt_why(cluster: int, threads_per_row: int) -> str:
    """A dealt step's words in its schedules' reasons."""
    over = f" in a cluster of {cluster}" if cluster > 1 else ""
    return f"one stage at {threads_per_row} threads per row{over}, a block per row group"


def dealt_schedules(phase: Phase) -> Iterator[RowSchedule]:
    """A dealt step's schedules: one stage of rows in shared memory, the columns there, then
    in registers, then re-read from global memory (L2), each only where a block per row group
    is what row_dealing.pick deals (several blocks share an SM and the rows outweigh the
    columns). Re-read columns leave room for a second block: rmsnorm_fwd 512 threads against
    one block per SM (H200, 16384 rows, fraction of the copy) bf16 32768 / 49152 0.92 / 0.94
    -> 0.97, fp32 16384 / 24576 0.92 / 0.93 -> 0.97 (bench/TUNING.md, "wider dealt steps").
    Choices that do not fit are not rejections: the search's other steps try on."""
    for col_storage in (Storage.SMEM, Storage.REGISTERS, Storage.GLOBAL):
        result = fit(phase, staged_choice(phase, 1, col_storage))
        if isinstance(result, RowSchedule) and result.dealing is Dealing.GRID:
            yield result
