"""CPU: classification, scheduler choices on every device preset, shared-memory plans (exact
aligned layouts, the static slot, the first seed's hidden size and its neighbours), and the
same fusion spelled three ways scheduling the same way."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fuser import DataType, FusionDefinition, HintError, OutOfResourcesError, row_codegen
from fuser.analysis import Kind, Role, analyze
from fuser.codegen import render_pointwise, render_row
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS, ROW_FUSIONS
from fuser.kernels import build
from fuser.schedulers import Hints, Problem, candidates, schedule
from fuser.schedulers.base import Dealing, PointwiseSchedule, RowSchedule, Storage
from fuser.schedulers.row_skew import skewed_loses
from fuser.smem import ALIGNMENT, STATIC_SLOT, SmemPlan, align

H200 = DeviceSpec.get("h200")
H100 = DeviceSpec.get("h100")
SMALL = DeviceSpec.get("sm89-100kb")
DTYPES = [DataType.Float, DataType.Half, DataType.BFloat16]


def plan_for(name, dtype, hidden, device=H200, rows=16384):
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    return info, schedule(info, Problem(hidden, rows, 16), device)


def assert_plan_invariants(plan: SmemPlan):
    ends = 0
    for b in plan.buffers:
        assert b.offset % ALIGNMENT == 0, b
        assert b.offset >= ends, f"{b.name} overlaps the buffer before it"
        ends = b.offset + align(b.nbytes)
    assert plan.dynamic_bytes == ends
    assert plan.static_slot == STATIC_SLOT == 128
    assert plan.total == plan.dynamic_bytes + STATIC_SLOT <= plan.limit
    assert plan.headroom == plan.limit - plan.total >= 0


@pytest.mark.parametrize(
    ("name", "kind"),
    [("rmsnorm_fwd", Kind.INNER), ("layernorm_fwd", Kind.INNER), ("softmax_fwd", Kind.INNER),
     ("rmsnorm_bwd", Kind.INNER_OUTER), ("dropout_rmsnorm_bwd", Kind.INNER_OUTER),
     ("layernorm_bwd", Kind.INNER_OUTER)],
)
def test_classification(name, kind):
    assert analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion).kind is kind


def test_layernorm_backward_reduces_both_row_sums_in_one_level():
    info = analyze(ROW_FUSIONS["layernorm_bwd"](DataType.BFloat16).fusion)
    assert [len(level) for level in info.inner_levels] == [2]
    assert len(info.outer_reductions) == 2
    assert [t.name for t in info.persistent] == ["T0", "T3"]  # x and grad_out, not the stats


@pytest.mark.parametrize(("name", "hidden", "aligned"), [
    ("dropout_rmsnorm_bwd", 24578, True), ("rmsnorm_bwd", 24578, True),
    ("dropout_rmsnorm_bwd", 8192, False), ("dropout_rmsnorm_bwd", 1024, False),
    ("rmsnorm_bwd", 8192, False), ("layernorm_bwd", 4098, True)])
def test_aligned_copies_where_the_widest_vectors_are_narrow(name, hidden, aligned):
    """Aligned 16-byte row copies by default where the widest input's vectors are narrower
    than 16 bytes (bf16 at 24578: 4 bytes); not where only the bool mask's are (8 bytes at
    8192, which cost dropout_rmsnorm_bwd 0.86 -> 0.67 of the copy on the H200)."""
    _, s = plan_for(name, DataType.BFloat16, hidden)
    assert s.aligned_copy is aligned, s


@pytest.mark.parametrize("aligned", [True, False])
def test_seed_case_exact_plan(aligned):
    """dropout + RMSNorm backward, bf16, hidden 24578 on the H200 (NVIDIA/Fuser #5272), the
    whole row in one block of 1024 threads as nvFuser plans it (hinted: the default splits it
    over a cluster of two, test_seed_case_default_plan): every row buffer in smem, each
    rounded up to 128 bytes, the static slot counted, and it fits. Row buffers hold whole
    16-byte chunks (the row plus the bytes before it back to a 16-byte boundary) by default,
    and the row itself with aligned_copy=False."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    hints = Hints(aligned_copy=aligned, threads_per_row=1024, cluster=1)
    s = schedule(info, Problem(24578, 16384, 16), H200, hints)
    sizes = {b.name: (b.nbytes, b.offset) for b in s.smem.buffers}
    assert s.vec == 2 and s.threads_per_row == 1024 and s.batch == 13
    assert s.aligned_copy is aligned
    row, mask = (16 * 3074, 16 * 1538) if aligned else (49156, 24578)
    assert {n: b for n, (b, _) in sizes.items()} == {
        "s_T0": row, "s_T1": row, "s_T2": mask, "s_T4": row, "s_T5": 49156,
        "s_reduce": 2 * 32 * 4,
    }
    assert s.smem.dynamic_bytes == 4 * 49280 + 24704 + 256 == 222080
    assert s.smem.total == 222208 <= 232448
    assert_plan_invariants(s.smem)


def test_seed_case_default_plan():
    """The seed case's default: its 2-element vectors cap a row at 512 threads, where one
    block keeps the row only in one stage at one block per SM, so the row goes over a cluster
    of two blocks in two stages (inner_outer_persistent._split_first), every row buffer in
    shared memory, each block's half row in whole 16-byte chunks, and the plan fits with its
    static slot."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(24578, 16384, 16), H200)
    assert (s.vec, s.threads_per_row, s.cluster, s.stages) == (2, 512, 2, 2), s.reason
    assert all(p.storage is Storage.SMEM for p in s.placements), s.reason
    assert "one block keeps the row on chip only at one stage and one block per SM" in s.reason
    assert s.smem.total <= 232448
    assert_plan_invariants(s.smem)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(
    "hidden",
    [24578 + d for d in range(-16, 17)] + [1024, 4096, 8192, 12288, 16384, 20480, 24576, 32768],
)
def test_plan_invariants_and_offline_compile_around_the_seed(hidden, dtype, tmp_path_factory):
    """The sweep of the first seed's neighbourhood: plans hold their invariants and every
    kernel compiles with zero spills and static shared memory within the reserved slot."""
    fd = ROW_FUSIONS["dropout_rmsnorm_bwd"](dtype)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 16384, 16), H200)
    for entry, plan in built.plans():
        assert_plan_invariants(plan)
        r = built.compiled.resource(entry)
        assert not r.spills, f"{entry}: {r}"
        assert r.static_smem <= plan.static_slot


def test_storage_policy_moves_least_reused_buffers_first():
    """Over budget, row buffers leave smem least-reused first, the weight-related (grad_out,
    which meets the weight every row) last; the mask is copied through registers."""
    _, s = plan_for("dropout_rmsnorm_bwd", DataType.BFloat16, 32768)
    storage = {p.tensor: p.storage for p in s.placements}
    assert storage["T4"] == Storage.SMEM  # grad_out
    assert storage["T0"] == Storage.SMEM and storage["T1"] == Storage.SMEM


@pytest.mark.parametrize(
    ("device", "hidden", "expected"),
    [(H200, 2048, {"T0": Storage.SMEM, "T1": Storage.SMEM, "T4": Storage.SMEM, "T5": Storage.SMEM}),
     # four packed rows in two stages: the least reused row buffer goes to registers
     (H200, 4096, {"T0": Storage.REGISTERS, "T1": Storage.SMEM, "T4": Storage.SMEM}),
     (H200, 24578, {"T0": Storage.SMEM, "T1": Storage.SMEM, "T4": Storage.SMEM}),
     (SMALL, 8192, {"T0": Storage.REGISTERS, "T1": Storage.SMEM, "T4": Storage.SMEM}),
     # 512 threads (2-element vectors): the weight fits registers beside re-read rows
     (SMALL, 24578, {"T0": Storage.GLOBAL, "T1": Storage.SMEM, "T4": Storage.SMEM,
                     "T5": Storage.REGISTERS})],
)
def test_storage_choices_per_device(device, hidden, expected):
    """The 100 KB part leaves the all-smem plan much earlier than the H200."""
    _, s = plan_for("dropout_rmsnorm_bwd", DataType.BFloat16, hidden, device)
    storage = {p.tensor: p.storage for p in s.placements}
    assert {k: storage[k] for k in expected} == expected
    assert s.smem.total <= device.smem_per_block_optin


@pytest.mark.parametrize("name", ["softmax_fwd", "layernorm_fwd"])
@pytest.mark.parametrize("hidden", [1024, 2048, 8192, 16384, 24578, 32768])
def test_three_pass_forward_rows_are_staged_in_smem_with_their_columns(name, hidden):
    """softmax and LayerNorm forward (two reduction levels and the output) keep their rows in
    shared memory wherever one block holds them: never in registers, and never through the
    whole-row ring, which refetches each pass. LayerNorm's weight and bias stay there too,
    except where they would leave the row one stage: at 32768 (bf16) two stages with the
    columns in registers come first (built: 63 registers, no spills); and skewed rows
    (24578) re-read them from global memory."""
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    s = build(name, info, Problem(hidden, 16384, 16), H200).schedule
    assert s.ring is None and s.cluster == 1, s.reason
    assert bool(s.skew) == (hidden == 24578), s.reason
    columns_in_registers = (name, hidden) == ("layernorm_fwd", 32768)
    for p in s.placements:
        expected = (Storage.REGISTERS if columns_in_registers and p.role is Role.COL
                    else Storage.GLOBAL if s.skew and p.role is Role.COL else Storage.SMEM)
        assert p.storage == expected, (p.tensor, s.reason)
    assert s.stages == 2 or not columns_in_registers, s.reason
    assert_plan_invariants(s.smem)


@pytest.mark.parametrize(("name", "hidden", "threads", "fp32_threads"), [
    ("softmax_fwd", 24578, 512, 512), ("log_softmax_fwd", 24574, 512, 512),
    ("layernorm_fwd", 24586, 512, 512), ("dropout_layernorm_fwd", 4099, 512, 512),
    ("softmax_fwd", 65537, 1024, 1024),  # 129 vectors a thread at 512: over the cap
    ("softmax_fwd", 32768, 1024, 1024), ("softmax_fwd", 40000, 1024, 1024),  # 16-byte vectors
    ("rmsnorm_fwd", 24578, 1024, 1024), ("softmax_bwd", 24578, 1024, 1024),  # two passes
    # smem-first: vectors of at most 4 bytes (bf16 24578: 2 elements; fp32 there: 8 bytes)
    ("rmsnorm_bwd", 24578, 512, 1024), ("dropout_rmsnorm_bwd", 24578, 512, 1024),
    ("layernorm_bwd", 12290, 512, 1024),
    ("rmsnorm_bwd", 4099, 512, 512), ("dropout_rmsnorm_bwd", 4099, 512, 512),
    ("layernorm_bwd", 65537, 1024, 1024),
])
def test_staged_rows_of_narrow_vectors_take_at_most_512_threads(name, hidden, threads,
                                                               fp32_threads):
    """Rows staged in shared memory first (three-pass forward rows; every backward row) whose
    vectors are narrower than 16 bytes (the backward's: of at most 4 bytes) take the policy's
    staged_narrow_threads threads per row where a thread then owns at most
    MAX_STAGED_VECTORS_PER_THREAD vectors, so two blocks can share an SM's registers. Rows
    not skewed: skewed ones (RowSchedule.skew) have 16-byte vectors; and at fixed strides:
    long rows dealt a block each take their own threads (row_dealt.dealt_shapes)."""
    for dtype, want in ((DataType.BFloat16, threads), (DataType.Float, fp32_threads)):
        info = analyze(ROW_FUSIONS[name](dtype).fusion)
        hints = Hints(skewed=False, dealing="strided")
        s = schedule(info, Problem(hidden, 16384, 16), H200, hints)
        assert isinstance(s, RowSchedule) and s.threads_per_row == want, (dtype, s.reason)
        assert s.batch <= 32 or want == 1024


@pytest.mark.parametrize(("name", "dtype", "hidden", "threads"), [
    ("layernorm_bwd", DataType.BFloat16, 2050, 256),
    ("layernorm_bwd", DataType.BFloat16, 4099, 256),
    ("layernorm_bwd", DataType.Half, 3001, 256),
    ("layernorm_bwd", DataType.BFloat16, 5001, 512),  # 20 vectors a thread at 256: over 17
    ("layernorm_bwd", DataType.Float, 3001, 512),  # 4-byte elements
    ("rmsnorm_bwd", DataType.BFloat16, 4099, 512),  # one column sum
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 3001, 512),
], ids=str)
def test_narrow_rows_of_two_column_sums_take_256_threads(name, dtype, hidden, threads):
    """Narrow backward rows of 2-byte elements of fusions with two column sums (LayerNorm
    backward) take 256 threads where a thread then owns at most 17 vectors (NarrowSums):
    four or three blocks per SM where 512 left two (H100: layernorm_bwd bf16 2050 / 4099
    0.57 / 0.74 -> 0.73 / 0.80); others, fp32 and longer rows keep 512. Every row buffer
    stays in shared memory."""
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    assert (s.threads_per_row, s.cluster, s.skew) == (threads, 1, 0), s.reason
    assert all(p.storage is Storage.SMEM for p in s.placements
               if p.tensor in {t.name for t in info.full_inputs}), s.reason


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half])
@pytest.mark.parametrize("hidden", [12290, 24574, 24578, 4099])
def test_capped_narrow_backward_rows_keep_their_row_buffers_in_shared_memory(dtype, hidden):
    """Backward rows whose narrow vectors cap their threads at 512 keep every row buffer in
    shared memory (inner_outer_persistent.smem_first_order) rather than move one to
    registers for a second stage: at 512 threads dropout_rmsnorm_bwd fp16 24578 fitted two
    of its rows in registers in two stages, which ran 0.85 of the copy against 0.93 with
    them in shared memory (H100)."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    assert s.threads_per_row == 512, s.reason
    assert all(p.storage is Storage.SMEM for p in s.placements), s.reason


def test_hinted_stages_of_capped_narrow_rows_may_move_row_buffers_to_registers():
    """The shared-memory rule of capped rows orders the heuristic's own choices; a hinted
    stage count is honoured as everywhere else, row buffers moved to registers where two
    stages do not fit shared memory (refused from 5bf8e78 to this test)."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(24578, 16384, 16), H200,
                 Hints(threads_per_row=512, cluster=1, stages=2))
    assert (s.threads_per_row, s.cluster, s.stages) == (512, 1, 2), s.reason
    assert not s.buffers_in_smem, s.reason


def _candidates(name, dtype, hidden, hints=None):
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    return info, list(itertools.islice(candidates(info, Problem(hidden, 16384, 16), H200, hints),
                                       12))


@pytest.mark.parametrize(("name", "dtype", "hidden"), [
    ("rmsnorm_bwd", DataType.Float, 24578), ("layernorm_bwd", DataType.Float, 24578),
    ("dropout_layernorm_fwd", DataType.BFloat16, 40000)])
def test_full_staged_blocks_are_followed_by_half_the_threads(name, dtype, hidden):
    """A choice for rows staged in shared memory first (backward, three-pass forward) at one
    row of 1024 threads (64 registers each) is followed by the same choice at 512 threads, so
    that a build whose full block spills keeps that storage (two stages) instead of falling to
    the next choice."""
    _, found = _candidates(name, dtype, hidden)
    for full, half in itertools.pairwise(found):
        if full.threads_per_row == 1024:
            assert half.threads_per_row == 512, half.reason
            assert (half.placements, half.stages, half.cluster) == (
                full.placements, full.stages, full.cluster)
            assert half.batch == -(-hidden // full.vec // full.cluster // 512)
            assert half.reason.endswith("512 threads per row, where 1024 spill)")
    assert any(s.threads_per_row == 1024 for s in found)


@pytest.mark.parametrize(("name", "dtype", "hidden", "hints"), [
    ("rmsnorm_fwd", DataType.BFloat16, 24578, None),  # rows in registers first: no halving
    ("softmax_bwd", DataType.BFloat16, 24578, None),
    ("softmax_fwd", DataType.BFloat16, 65537, None),
    ("layernorm_bwd", DataType.BFloat16, 65537, None),  # 33 vectors a thread at a cluster of 4
    ("rmsnorm_bwd", DataType.BFloat16, 24578, Hints(threads_per_row=1024)),
])
def test_blocks_are_not_halved_where_the_rule_does_not_hold(name, dtype, hidden, hints):
    _, found = _candidates(name, dtype, hidden, hints)
    assert not any(s.threads_per_row == 512 and "where 1024 spill" in s.reason for s in found)


def test_a_spilling_full_backward_block_builds_at_half_the_threads():
    """layernorm_bwd fp32 at 24578: its first choice, two stages over a cluster of two,
    spills at 1024 threads (ptxas 13.5), so the build takes the same choice at 512 threads,
    not the next choice at 1024 (rmsnorm_bwd bf16 24578 so ran 0.70 -> 0.84 of the copy on
    the H200, before its 2-element vectors capped it at 512 threads)."""
    info = analyze(ROW_FUSIONS["layernorm_bwd"](DataType.Float).fusion)
    built = build("layernorm_bwd", info, Problem(24578, 16384, 16), H200)
    s = built.schedule
    assert (s.threads_per_row, s.stages, s.cluster) == (512, 2, 2), s.reason
    assert s.reason.endswith("512 threads per row, where 1024 spill)"), s.reason
    assert not built.compiled.resource(built.source.row_entry).spills


def test_a_hinted_storage_that_spills_packed_builds_in_plain_blocks():
    """Every buffer of dropout + RMSNorm backward forced into registers at 4096: four packed
    rows of 64 threads spill (8 vectors of five buffers and the dW accumulators a thread), so
    the build goes on to the policy's plain block, one row of 256 threads, which compiles
    cleanly. (RMSNorm backward's three buffers so fit in 254 registers since bf16 elements
    are read by word.)"""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    buffers = ("T0", "T1", "T2", "T4", "T5")
    hints = Hints(storage=tuple((n, Storage.REGISTERS) for n in buffers), stages=1)
    problem = Problem(4096, 333, 16)
    first = next(candidates(info, problem, H200, hints))
    assert (first.threads_per_row, first.rows_per_block) == (64, 4), first.reason
    built = build("dropout_rmsnorm_bwd", info, problem, H200, hints)
    assert (built.schedule.threads_per_row, built.schedule.rows_per_block) == (256, 1)
    assert not built.compiled.resource(built.source.row_entry).spills


@pytest.mark.parametrize(("hidden", "ring"), [(8192, False), (16384, True)])
def test_two_pass_forward_takes_the_ring_only_at_one_block_per_sm(hidden, ring):
    """rmsnorm_fwd keeps its rows in registers while they leave several blocks per SM, and
    streams them through the bulk-filled ring where registers would leave one (16384, bf16)
    and no block per row group is dealt (hinted fixed strides here: by default one stage of
    rows in shared memory is dealt a block per group there)."""
    info = analyze(ROW_FUSIONS["rmsnorm_fwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200, Hints(dealing="strided"))
    assert (s.ring is not None) == ring, s.reason
    assert s.placement("T0").storage == (Storage.RING if ring else Storage.REGISTERS)


def _off_chip(s: RowSchedule) -> bool:
    return s.accumulators == Storage.GLOBAL or any(
        p.storage in (Storage.GLOBAL, Storage.RING) for p in s.placements)


@pytest.mark.parametrize(
    ("device", "hidden", "cluster", "off_chip"),
    [(H200, 12288, 1, False), (H200, 65536, 2, False), (H200, 131072, 4, False),
     (H200, 262144, 8, False), (H200, 1048576, 8, True),
     (DeviceSpec.get("a100"), 65536, 1, True)],
)
def test_long_rows_split_over_the_smallest_cluster_that_keeps_them_on_chip(
        device, hidden, cluster, off_chip):
    """rmsnorm_bwd, bf16: a row one block cannot hold on chip is split over 2, 4, then 8 blocks
    of a cluster (sm_90); rows are re-read from global memory only when 8 cannot hold it, and
    on parts without clusters (the A100: sm_80)."""
    _, s = plan_for("rmsnorm_bwd", DataType.BFloat16, hidden, device)
    assert (s.cluster, _off_chip(s)) == (cluster, off_chip), s.reason
    assert (f"cluster of {cluster} blocks of" in s.reason) == (cluster > 1)
    if off_chip:
        assert f"({cluster} block(s) cannot keep the row on chip)" in s.reason
    elif cluster > 1:
        assert "(the plans for fewer blocks do not keep the row on chip)" in s.reason
    assert s.batch * s.threads_per_row * s.vec * s.cluster >= hidden



@pytest.mark.parametrize(
    ("device", "last_on_chip", "beyond"),
    [("h200", 20480, "cluster"), ("h100", 20480, "cluster"), ("a100", 20480, "re-read"),
     ("sm89-100kb", 16384, "re-read")],
)
def test_where_each_preset_leaves_one_block_on_chip(device, last_on_chip, beyond):
    """rmsnorm_bwd, fp32, hidden in steps of 1024: the largest row one block keeps on chip on
    each preset, and what the next size gets: a split over a cluster on sm_90, rows re-read
    from global memory where there are no clusters (the 100 KB part leaves earliest). (2-byte
    rows go over a cluster of two earlier, by choice: inner_outer_persistent._split_first.)"""
    info = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.Float).fusion)
    spec = DeviceSpec.get(device)

    def plan(hidden):
        return schedule(info, Problem(hidden, 16384, 16), spec)

    below, above = plan(last_on_chip), plan(last_on_chip + 1024)
    assert below.cluster == 1 and not _off_chip(below), below.reason
    if beyond == "cluster":
        assert above.cluster == 2 and not _off_chip(above), above.reason
    else:
        assert above.cluster == 1 and _off_chip(above) and "re-read each pass" in above.reason
    assert_plan_invariants(below.smem)
    assert_plan_invariants(above.smem)


@pytest.mark.parametrize(
    ("name", "hidden", "threads_per_row", "rows_per_block", "batch"),
    [("dropout_rmsnorm_bwd", 512, 64, 2, 1), ("dropout_rmsnorm_bwd", 1024, 64, 4, 2),
     ("dropout_rmsnorm_bwd", 2048, 64, 4, 4), ("dropout_rmsnorm_bwd", 4096, 64, 4, 8),
     ("rmsnorm_bwd", 512, 64, 4, 1), ("rmsnorm_bwd", 1024, 64, 4, 2),
     ("rmsnorm_bwd", 2048, 64, 4, 4), ("rmsnorm_bwd", 8192, 64, 4, 8),  # half a row each:
     # a cluster of two (inner_outer_persistent._split_first)
     ("layernorm_bwd", 1024, 64, 4, 2), ("layernorm_bwd", 4096, 64, 4, 8),
     ("rmsnorm_bwd", 12288, 512, 1, 3),  # past 1024 vectors: plain blocks, or
     ("rmsnorm_bwd", 16384, 64, 4, 16)],  # packed over a cluster (_packed_first)
)
def test_short_backward_rows_get_small_blocks(name, hidden, threads_per_row, rows_per_block,
                                              batch):
    """bf16 on the H200: the block shapes measured fastest ("packed backward rows" in
    bench/TUNING.md). Rows of 65 to 1024 vectors take 64 threads each, four rows to a block;
    rows of up to 64 vectors one vector per thread, in blocks of 128 threads, or 256 where the
    partial rows of the outer reductions weigh half a row's bytes or more (rmsnorm_bwd),
    which halves the partial rows the finalize reads."""
    _, s = plan_for(name, DataType.BFloat16, hidden)
    assert (s.threads_per_row, s.rows_per_block, s.batch) == (
        threads_per_row, rows_per_block, batch), s


def test_short_rows_take_two_stages_where_one_leaves_a_single_block():
    """Packed short rows may take one stage first: dropout + RMSNorm backward's (fp32 1024)
    keeps three blocks per SM; LayerNorm backward's (bf16 4096) two column accumulators leave
    one block per SM, so it takes two stages (0.74 -> 0.88 of the copy). bf16 dropout +
    RMSNorm backward 2048 ties one stage at three blocks with three stages at one, and takes
    three (inner_outer_persistent._planned_blocks_hold_as_many)."""
    _, rms = plan_for("dropout_rmsnorm_bwd", DataType.Float, 1024)
    _, ln = plan_for("layernorm_bwd", DataType.BFloat16, 4096)
    _, tie = plan_for("dropout_rmsnorm_bwd", DataType.BFloat16, 2048)
    assert (rms.stages, rms.blocks_per_sm) == (1, 3), rms.reason
    assert (ln.stages, ln.blocks_per_sm) == (2, 1), ln.reason
    assert (tie.stages, tie.blocks_per_sm) == (3, 1), tie.reason


@pytest.mark.parametrize(("name", "dtype", "hidden", "stages"), [
    ("layernorm_bwd", DataType.BFloat16, 1024, 2), ("layernorm_bwd", DataType.BFloat16, 2048, 2),
    ("gelu_bwd", DataType.BFloat16, 1024, 2), ("rmsnorm_bwd", DataType.BFloat16, 4099, 2),
    ("gelu_bwd", DataType.Float, 1024, 1), ("layernorm_bwd", DataType.Float, 1000, 1),
    ("dropout_rmsnorm_bwd", DataType.Float, 1024, 1)])
def test_short_rows_take_a_second_stage_while_one_fills_under_half_an_sm(name, dtype, hidden,
                                                                         stages):
    """Short rows take two stages first where one stage fills less than half an SM's shared
    memory and two keep its blocks per SM (bf16 layernorm_bwd 1024 / 2048: 0.77 / 0.80 ->
    0.83 / 0.88); one where one stage already fills more (fp32 gelu_bwd 1024: 121 KB per
    SM, two stages 0.85 -> 0.79) or where two cost a block (fp32 dropout_rmsnorm_bwd 1024)."""
    info = analyze(FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    one = schedule(info, Problem(hidden, 16384, 16), H200, Hints(stages=1))
    assert s.stages == stages, s.reason
    assert s.blocks_per_sm == one.blocks_per_sm, (s.reason, one.reason)
    two = schedule(info, Problem(hidden, 16384, 16), H200, Hints(stages=2))
    below = one.smem.total * one.blocks_per_sm < H200.smem_per_sm // 2
    keeps = two.blocks_per_sm == one.blocks_per_sm
    assert (below and keeps) == (stages == 2), (one.reason, two.reason)


@pytest.mark.parametrize(("name", "dtype", "hidden", "stages"), [
    ("rmsnorm_bwd", DataType.BFloat16, 12288, 3), ("rmsnorm_bwd", DataType.Half, 12288, 3),
    ("gelu_bwd", DataType.BFloat16, 16384, 2),  # no row reduction
    ("layernorm_bwd", DataType.BFloat16, 12288, 2),  # two column sums
    ("rmsnorm_bwd", DataType.Float, 8192, 2),  # 4-byte elements
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 12288, 2),  # three would move a row out of smem
    ("rmsnorm_bwd", DataType.BFloat16, 17408, 3),  # over two blocks (_split_first)
    ("rmsnorm_bwd", DataType.BFloat16, 4096, 3),  # one stage at two blocks -> three at one
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 1024, 3),  # one at four -> three at two
    ("dropout_rmsnorm_bwd", DataType.Half, 2048, 3),  # a tie with one stage at three blocks
    ("rmsnorm_bwd", DataType.BFloat16, 1024, 2),  # two stages at four blocks stay
    ("rmsnorm_bwd", DataType.BFloat16, 4099, 2)])  # as many in flight at two blocks
def test_rows_take_a_third_stage_where_it_puts_more_rows_in_flight(name, dtype, hidden,
                                                                     stages):
    """A third stage first (inner_outer_persistent._three_stages) where three keep every row
    buffer in shared memory and put more rows in flight per SM than one stage, or two at one
    block, for 2-byte rows of a fusion with a row reduction and at most one column sum (bf16
    rmsnorm_bwd 4096 / 12288: 0.86 / 0.81 -> 0.89 / 0.93 of the copy); one or two stages
    otherwise, where three lost (rmsnorm_bwd 1024 over two stages at four blocks 0.84 ->
    0.82, gelu_bwd fp16 16384 0.89 -> 0.86, layernorm_bwd 12288 0.90 -> 0.88, fp32
    rmsnorm_bwd 8192 0.96 -> 0.95)."""
    info = analyze(FUSIONS[name](dtype).fusion)
    problem = Problem(hidden, 16384, 16)
    s = schedule(info, problem, H200)
    assert s.stages == stages, s.reason
    if stages == 3:
        assert all(p.storage is Storage.SMEM for p in s.placements), s.reason


def test_rows_keep_two_stages_where_three_do_not_fit_one_block():
    """rmsnorm_bwd bf16 20480 at one block (hinted: by default two blocks of a cluster take
    it in three stages, _split_first): three stages do not fit in shared memory at all, so
    one block keeps two."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(20480, 16384, 16), H200, Hints(cluster=1))
    assert (s.cluster, s.stages) == (1, 2), s.reason
    assert all(p.storage is Storage.SMEM for p in s.placements), s.reason


@pytest.mark.parametrize(("name", "dtype", "hidden", "cluster", "stages"), [
    ("rmsnorm_bwd", DataType.BFloat16, 6144, 2, 3),  # one block: the weight in registers
    ("rmsnorm_bwd", DataType.Half, 24576, 2, 3),  # one block: a row input in registers
    ("layernorm_bwd", DataType.BFloat16, 6144, 2, 2),  # one block: one stage at one block
    ("gelu_bwd", DataType.BFloat16, 32768, 2, 2),
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 8192, 1, 1),  # two blocks: a row in registers
    ("rmsnorm_bwd", DataType.BFloat16, 24578, 1, 2),  # narrower vectors: one block in two
    ("layernorm_bwd", DataType.BFloat16, 24574, 2, 2),  # stages; in one, two blocks first
    ("rmsnorm_bwd", DataType.BFloat16, 4099, 1, 2),  # single elements
    ("rmsnorm_bwd", DataType.Float, 12288, 1, 2),  # 4-byte elements
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 4096, 1, 2),  # two blocks: one stage
    ("rmsnorm_bwd", DataType.BFloat16, 20480, 2, 3),  # one block: two stages, two: three
    ("rmsnorm_bwd", DataType.Half, 17408, 2, 3),
    ("layernorm_bwd", DataType.BFloat16, 12288, 1, 2),  # two blocks: two stages too
    ("rmsnorm_bwd", DataType.BFloat16, 12288, 1, 3)])  # one block keeps three stages
def test_rows_split_over_two_blocks_where_one_holds_them_back(name, dtype, hidden, cluster,
                                                               stages):
    """Rows over a cluster of two before one block (inner_outer_persistent._split_first)
    where one block keeps them on chip only at one stage and one block per SM or with a
    buffer in registers, and two blocks keep every buffer in shared memory in two stages or
    more: three for rmsnorm_bwd (bf16 6144 0.91 -> 0.96 of the copy), two for layernorm_bwd
    (6144 0.81 -> 0.93); and where one block keeps two stages at one block per SM and two
    blocks three (rmsnorm_bwd bf16 17408-22528: 20480 0.93 -> 0.97). Not where it lost: two
    blocks with a row in registers (dropout_rmsnorm_bwd 8192 0.95 -> 0.84), rows of narrower
    vectors (rmsnorm_bwd 24578 0.85 -> 0.70) but those of two 2-byte elements that one block
    keeps only at one stage and one block per SM (H100 bf16 layernorm_bwd 24578 0.82 -> 0.92),
    4-byte elements (fp32 rmsnorm_bwd 12288 0.96 -> 0.84)."""
    info = analyze(FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    assert (s.cluster, s.stages) == (cluster, stages), s.reason
    if cluster == 2:
        assert all(p.storage is Storage.SMEM for p in s.placements), s.reason
        assert "one block keeps the row on chip" in s.reason


@pytest.mark.parametrize(("name", "dtype", "hidden", "shape"), [
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 3072, (128, 2, 1, 3)),
    ("dropout_rmsnorm_bwd", DataType.Half, 6144, (128, 1, 1, 3)),
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 7168, (128, 1, 1, 3)),
    ("rmsnorm_bwd", DataType.BFloat16, 5120, (128, 2, 1, 3)),
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 4096, (64, 4, 1, 2)),  # a row in registers
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 8192, (64, 4, 1, 1)),  # one stage
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 5120, (64, 4, 2, 3)),  # three stages
    ("rmsnorm_bwd", DataType.BFloat16, 3072, (64, 4, 1, 3)),  # three stages
    ("layernorm_bwd", DataType.BFloat16, 3072, (64, 4, 1, 2)),  # two column sums
    ("dropout_rmsnorm_bwd", DataType.Float, 3072, None)])  # 4-byte elements
def test_fewer_rows_in_three_stages_where_packed_rows_keep_two(name, dtype, hidden, shape):
    """Blocks of two rows of 128 threads in three stages, else one row, before packed rows
    that keep one block per SM in two stages, every buffer in shared memory
    (inner_outer_persistent._fewer_rows_why: dropout_rmsnorm_bwd bf16 3072 / 6144 0.87 / 0.90
    -> 0.97 / 0.98 of the copy). Not where the packed rows keep a row in registers, one
    stage or three, nor for two column sums or 4-byte elements."""
    info = analyze(FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    got = (s.threads_per_row, s.rows_per_block, s.cluster, s.stages)
    moved = "fewer rows a block in three stages first" in s.reason
    if shape is None:
        assert not moved, s.reason
        return
    assert got == shape, s.reason
    assert moved == (shape[0] == 128), s.reason
    if moved:
        assert all(p.storage is Storage.SMEM for p in s.placements), s.reason


def test_a_split_row_falls_back_on_one_block_and_is_not_hinted():
    """rmsnorm_bwd bf16 6144: the reason names what held one block back (the weight in
    registers); where the split build spills, the next candidate is one block's (not the
    cluster's others, such as its two stages: 0.72 of the copy); and hints that shape the
    block (stages=2, measured 0.72 over two blocks) leave the rule out."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    problem = Problem(6144, 16384, 16)
    first, second = itertools.islice(candidates(info, problem, H200), 2)
    assert (first.cluster, first.stages) == (2, 3), first.reason
    assert "only with T3 in registers" in first.reason
    assert second.cluster == 1, second.reason
    hinted = next(iter(candidates(info, problem, H200, Hints(stages=2))))
    assert (hinted.cluster, hinted.stages) == (1, 2), hinted.reason


@pytest.mark.parametrize("hidden", [255, 513])
def test_skewed_short_rows_keep_one_stage_first(hidden):
    """Skewed rows (hinted, for column sums) keep row_storage.stage_order's one stage first,
    though two stages would keep their blocks per SM: each of their blocks waits on one
    thread's extra vector at every reduction while others fill the SM."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200, Hints(skewed=True))
    assert s.skew and s.stages == 1, s.reason


@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_column_sums_alone_are_not_packed(hidden):
    """Packing rows serves the row reductions' barriers: bias-GELU backward (column sums, no
    row reduction) lost with it (0.86 -> 0.66 of the copy at 8192) and keeps its blocks of
    one or two rows of 128 threads or more."""
    info = analyze(FUSIONS["gelu_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    assert s.rows_per_block <= 2 and s.threads_per_row >= 128, s.reason


def test_packed_rows_that_cannot_stay_on_chip_take_plain_blocks():
    """On a part without clusters (sm_89, 100 KB) four packed rows of 8192 do not fit on chip:
    the search takes the plain block of one row, on chip, before re-reading rows."""
    _, s = plan_for("dropout_rmsnorm_bwd", DataType.BFloat16, 8192, SMALL)
    assert (s.threads_per_row, s.rows_per_block) == (512, 1), s.reason
    assert not _off_chip(s), s.reason
    _, s = plan_for("dropout_rmsnorm_bwd", DataType.BFloat16, 8192)
    assert (s.threads_per_row, s.rows_per_block) == (64, 4), s.reason

@pytest.mark.parametrize("device", ["h100", "h200", "a100", "sm89-100kb"])
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_every_fusion_schedules_on_every_preset(name, device):
    spec = DeviceSpec.get(device)
    for hidden in (1, 127, 4096, 16384):
        _, s = plan_for(name, DataType.BFloat16, hidden, spec)
        assert isinstance(s, RowSchedule)
        assert (s.hidden % s.vec == 0) != bool(s.skew) and s.vec * 2 <= 16
        assert s.threads_per_row * s.rows_per_block <= spec.max_threads_per_block
        covered = s.batch * s.threads_per_row * s.vec * s.cluster
        assert covered >= hidden + (s.vec - s.skew if s.skew else 0)
        assert_plan_invariants(s.smem)


def test_pointwise_fusion_gets_the_pointwise_scheduler():
    with FusionDefinition("scale") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        fd.add_output(fd.ops.mul(x, 2.0))
    s = schedule(analyze(fd.fusion), Problem(4096, 100, 16), H200)
    assert isinstance(s, PointwiseSchedule) and s.vec == 8


def test_pointwise_vectors_are_sized_by_the_rows_and_columns_read_in_pieces():
    """bf16 rows with fp32 column operands (BatchNorm's normalization): 16-byte vectors of
    the rows, the columns read in 16-byte pieces; where the pointers are only 8-byte aligned
    a piece would not be, so the columns bound the vector again."""
    with FusionDefinition("normalize") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        mean = fd.define_tensor([-1], dtype=DataType.Float)
        y = fd.ops.sub(fd.ops.cast(x, DataType.Float), mean)
        fd.add_output(fd.ops.cast(y, DataType.BFloat16))
    info = analyze(fd.fusion)
    assert schedule(info, Problem(4096, 100, 16), H200).vec == 8
    assert schedule(info, Problem(4096, 100, 8), H200).vec == 2
    assert schedule(info, Problem(4100, 100, 16), H200).vec == 4  # 4100 = 4 x 1025
    assert not schedule(info, Problem(4099, 100, 16), H200).across_rows  # columns bound it


def _scaled_rows(repeated: bool = False, row_output: bool = False) -> FusionDefinition:
    """relu(x) * r over bf16 rows, r one value per row ([rows, 1]), or with `repeated` per
    channel of an NCHW x (a [C] input, read again along N, H and W)."""
    with FusionDefinition("scaled_rows") as fd:
        if repeated:
            x = fd.define_tensor([-1, -1, -1, -1], dtype=DataType.BFloat16)
            c = fd.define_tensor([-1])
            r = fd.ops.broadcast_in_dim(c, shape=x.shape(), broadcast_dims=[1])
        else:
            x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
            r = fd.define_tensor([-1, 1], contiguity=[True, None])
        y = fd.ops.mul(fd.ops.relu(fd.ops.cast(x, DataType.Float)), r)
        fd.add_output(fd.ops.cast(y, DataType.BFloat16))
        if row_output:
            fd.add_output(fd.ops.mul(r, 2.0))
    return fd


@pytest.mark.parametrize(("hidden", "align", "vec"), [
    (7, 16, 8), (3, 16, 8), (1, 16, 8), (4099, 16, 8), (24578, 16, 8), (24578, 8, 4)])
def test_pointwise_vectors_cross_rows_where_a_row_bounds_them(hidden, align, vec):
    """Rows whose length bounds a vector within them (7, 4099: one element; 24578: two) take
    vectors laid over the rows end to end, as wide as the tensors and the pointers' alignment
    allow; a per-row operand is read as a vector reaches each row, the elements short of a
    last vector one at a time (the template's tail)."""
    s = schedule(analyze(_scaled_rows().fusion), Problem(hidden, 100, align), H200)
    assert isinstance(s, PointwiseSchedule) and s.across_rows and s.vec == vec
    assert f"{vec}-element vectors over the rows end to end (a row of {hidden} bounds" in s.reason
    source = render_pointwise("scaled_rows", analyze(_scaled_rows().fusion), s).source
    assert "if (i > 0 && ++j == H) {  // the next row" in source
    assert "row_T1 = fm::to_compute(g_T1[row]);" in source
    assert "if (blockIdx.x == 0 && threadIdx.x < elements - total * VEC) {" in source


def test_pointwise_vectors_within_rows_where_they_are_as_wide_or_cannot_cross():
    """Rows of 4096 give 16-byte vectors within them: nothing to gain across rows. A per-row
    output (written once a row) keeps vectors within rows, as does a full input read at other
    rows than the kernel's ([B, H] over [B, S, H]). A per-row input repeated along other row
    axes (a [C] scale over NCHW rows) crosses rows: a walk (fm::RepeatedRowWalk) steps
    through its rows as the vector reaches each kernel row."""
    assert not schedule(analyze(_scaled_rows().fusion), Problem(4096, 100, 16), H200).across_rows
    s = schedule(analyze(_scaled_rows(row_output=True).fusion), Problem(7, 100, 16), H200)
    assert not s.across_rows and s.vec == 1
    with FusionDefinition("modulated") as fd:
        x = fd.define_tensor([-1, -1, -1])
        scale = fd.define_tensor([-1, -1])
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(scale, x.shape(), [0, 2])))
    s = schedule(analyze(fd.fusion), Problem(7, 100, 16), H200)
    assert not s.across_rows and s.vec == 1
    info = analyze(_scaled_rows(repeated=True).fusion)
    s = schedule(info, Problem(7, 100, 16), H200)
    assert s.across_rows and s.vec == 8
    source = render_pointwise("scaled_rows", info, s).source
    assert "fm::RepeatedRowWalk w_T1(r_T1, row);" in source and "w_T1.next();" in source


def test_a_storage_that_cannot_fit_raises_with_the_numbers():
    """Every size schedules by itself on a real part (re-reading rows at worst); a part too
    small for any storage, or a forced storage that cannot hold the row, names the row, the
    limits and what was tried."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.Float).fusion)
    tiny = dataclasses.replace(SMALL, smem_per_block_optin=256, smem_per_sm=2048,
                               regs_per_block=16384, regs_per_sm=16384)
    with pytest.raises(OutOfResourcesError, match=r"(?s)hidden 1048576 \(13 B per element.*"
                       r"limit 256 B per block.*smem 384 B of 256.*of 16 registers per thread"):
        schedule(info, Problem(1048576, 64, 16), tiny)
    forced = Hints(storage=(("T0", Storage.REGISTERS),))
    with pytest.raises(HintError, match=r"(?s)no schedule honours Hints\(storage=T0:registers\) "
                       r"at hidden 1048576.*of 64 registers per thread at 1024 threads.*"
                       r"without them the heuristic's schedule is: smem-first policy"):
        schedule(info, Problem(1048576, 64, 16), H200, forced)
    with pytest.raises(HintError, match=r"rows_per_block=2\): allowed: 1 to 1 \(1024 threads "
                       r"per block on H200 / 1024 threads per row\); the heuristic picks "
                       r"rows_per_block=4"):
        schedule(info, Problem(4096, 64, 16), H200, Hints(threads_per_row=1024,
                                                            rows_per_block=2))


def test_a_copied_row_buffer_keeps_one_stage_and_compiles():
    """At hidden 24578 (vec 2) the bool mask's 2-byte vectors are too narrow for cp.async and
    are copied through registers; forced into shared memory, the kernel has one stage
    (cp.async fills the second, so two stages are refused) and compiles."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    in_smem = tuple((n, Storage.SMEM) for n in ("T0", "T1", "T2", "T4", "T5"))
    with pytest.raises(HintError, match=r"stages=2: .*this choice runs one stage"):
        schedule(info, Problem(24578, 64, 16), H200,
                 Hints(storage=in_smem, stages=2, aligned_copy=False))
    all_smem = Hints(storage=in_smem, aligned_copy=False)
    built = build("dropout_rmsnorm_bwd", info, Problem(24578, 64, 16), H200, all_smem)
    s = built.schedule
    assert s.vec == 2 and s.stages == 1
    assert {p.tensor: p.storage for p in s.placements}["T2"] == Storage.SMEM
    assert "T2:Bool->smem, " in str(s)  # copied, not cp.async
    assert not built.compiled.resource(built.source.row_entry).spills


@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_every_size_schedules_on_the_smallest_part(name):
    for hidden in (32768, 65537, 131072, 1048576):
        _, s = plan_for(name, DataType.Float, hidden, SMALL, rows=64)
        assert_plan_invariants(s.smem)


def test_smem_plan_table_and_limit_error():
    plan = SmemPlan.build([("s_a", 100, "a"), ("s_b", 129, "b"), ("s_c", 0, "nothing")], 400)
    assert [(b.name, b.offset) for b in plan.buffers] == [("s_a", 0), ("s_b", 128)]
    assert plan.dynamic_bytes == 384 and plan.total == 512 and plan.headroom == -112
    text = plan.table()
    assert "static slot" in text and "headroom -112 B" in text
    with pytest.raises(OutOfResourcesError, match=r"needs 512 B .* over the device limit of "
                       r"400 B by 112 B"):
        plan.check("test kernel")


# ----- the same fusion spelled differently -----


def _rmsnorm_bwd_spelled(style: str) -> FusionDefinition:
    """RMSNorm backward written three ways: sub vs add(neg), reciprocal vs div, op order."""
    F32 = DataType.Float
    with FusionDefinition(f"rmsnorm_bwd_{style}") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        rms = fd.define_tensor([-1, 1], contiguity=[True, None], dtype=F32)
        dy = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        w = fd.define_tensor([-1], dtype=DataType.BFloat16)
        rms_b = fd.ops.broadcast_in_dim(rms, shape=x.shape(), broadcast_dims=[0, 1])
        if style == "reciprocal":
            inv = fd.ops.reciprocal(rms_b)
        else:
            inv = fd.ops.div(fd.define_scalar(1.0), rms_b)
        xf, dyf = fd.ops.cast(x, F32), fd.ops.cast(dy, F32)
        if style == "reordered":
            wdy, xhat = fd.ops.mul(fd.ops.cast(w, F32), dyf), fd.ops.mul(inv, xf)
        else:
            wdy, xhat = fd.ops.mul(dyf, fd.ops.cast(w, F32)), fd.ops.mul(xf, inv)
        mean = fd.ops.div(fd.ops.sum(fd.ops.mul(wdy, xhat), dims=[1], keepdim=True), x.size(1))
        proj = fd.ops.mul(xhat, fd.ops.broadcast_in_dim(mean, shape=x.shape(),
                                                        broadcast_dims=[0, 1]))
        diff = (fd.ops.add(wdy, fd.ops.neg(proj)) if style == "add_neg"
                else fd.ops.sub(wdy, proj))
        fd.add_output(fd.ops.cast(fd.ops.mul(diff, inv), DataType.BFloat16))
        fd.add_output(fd.ops.cast(fd.ops.sum(fd.ops.mul(dyf, xhat), dims=[0]), DataType.BFloat16))
    return fd


def _shape_of(s: RowSchedule):
    return (s.scheduler, s.vec, s.threads_per_row, s.rows_per_block, s.batch, s.stages,
            s.accumulators, tuple(p.storage for p in s.placements),
            tuple(b.nbytes for b in s.smem.buffers))


@pytest.mark.parametrize("hidden", [1024, 4096, 24578])
def test_respellings_classify_and_schedule_the_same(hidden):
    shapes = set()
    for style in ("reciprocal", "add_neg", "reordered"):
        info = analyze(_rmsnorm_bwd_spelled(style).fusion)
        assert info.kind is Kind.INNER_OUTER
        shapes.add(_shape_of(schedule(info, Problem(hidden, 16384, 16), H200)))
    reference = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    shapes.add(_shape_of(schedule(reference, Problem(hidden, 16384, 16), H200)))
    assert len(shapes) == 1, shapes


@pytest.mark.parametrize("policy", ["inner_persistent", "inner_outer_persistent"])
@pytest.mark.parametrize("itemsizes", [(2, 2, 1, 2, 2), (4, 4, 1, 4, 4), (1,), (8, 4)])
def test_row_split_covers_every_hidden_exactly(itemsizes, policy):
    """For every hidden size from 1 to 200000, whole or split over the 2, 4 or 8 blocks of a
    cluster: the vectors tile the row exactly (vec divides hidden, at most 16 bytes per
    access), the blocks' shares add up to the row with none over its buffer of `part`
    vectors, and in a block every thread round but the last is full and the last not empty."""
    from fuser.schedulers import inner_outer_persistent, inner_persistent
    from fuser.schedulers.hints import CLUSTER_SIZES
    from fuser.schedulers.row_geometry import row_split

    row_policy = {"inner_persistent": inner_persistent.POLICY,
                  "inner_outer_persistent": inner_outer_persistent.POLICY}[policy]
    widest = max(itemsizes)
    for hidden in range(1, 200001):
        for parts in (1, *CLUSTER_SIZES):
            vec, tpr, batch = row_split(hidden, list(itemsizes), 16, row_policy, H200,
                                        parts=parts, input_bytes=sum(itemsizes))
            vectors = hidden // vec
            if vectors < parts:  # the scheduler never splits fewer vectors than blocks
                continue
            part = -(-vectors // parts)
            shares = [min(part, max(0, vectors - k * part)) for k in range(parts)]
            assert vectors * vec == hidden and vec * widest <= 16
            assert sum(shares) == vectors and max(shares) == part
            assert tpr & (tpr - 1) == 0 and tpr <= H200.max_threads_per_block
            assert (batch - 1) * tpr < part <= batch * tpr


def _copied_chunks(start: int, nbytes: int, threads: int, rounds: int) -> list[tuple[int, int]]:
    """(address, bytes) of every cp.async that fm::copy_row_chunks issues for one row (the
    device code, step for step)."""
    base, span = start & ~15, (start & 15) + nbytes
    copies = []
    for x in range(threads):
        for c in range(rounds):
            k = c * threads + x
            left = span - 16 * k
            if left > 0:
                copies.append((base + 16 * k, min(16, left)))
    return sorted(copies)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_aligned_chunks_cover_every_row_exactly_and_fit_the_slot(itemsize):
    """For every hidden size from 1 to 200000 and every offset a row of it can start at past
    a 16-byte boundary: the 16-byte chunks copied from that boundary reach exactly the row's
    last byte (the last chunk reads only what is left, zero-filling the rest), none starts
    past it, and they fit the planned slot with the row at its offset. The chunk walk itself
    is replayed byte for byte below 3000."""
    import numpy as np

    from fuser.schedulers.base import aligned_row_bytes, aligned_row_chunks

    hidden = np.arange(1, 200001, dtype=np.int64)
    nbytes = hidden * itemsize
    slot = np.array([aligned_row_bytes(h, itemsize) for h in range(1, 200001)])
    chunks_max = np.array([aligned_row_chunks(h, itemsize) for h in range(1, 200001)])
    assert (slot == 16 * chunks_max).all()
    for row in range(16):  # row r starts r * hidden * itemsize bytes past a 16-byte base
        shift = (row * nbytes) % 16
        needed = -(-(shift + nbytes) // 16)
        assert (needed <= chunks_max).all()
        assert (shift + nbytes <= slot).all()
        assert (16 * (needed - 1) < shift + nbytes).all()  # the last chunk is not empty
    for h in range(1, 3000, 7):
        for row in range(4):
            start, n = 4096 + row * h * itemsize, h * itemsize
            threads = 32
            rounds = -(-aligned_row_chunks(h, itemsize) // threads)
            copies = _copied_chunks(start, n, threads, rounds)
            covered = start & ~15
            for address, size in copies:
                assert address == covered and address % 16 == 0 and 1 <= size <= 16
                covered += size
            assert covered == start + n


def test_aligned_copy_hint_plans_chunked_row_slots():
    """Hints(aligned_copy=True) at the seed's hidden size: each smem row buffer holds whole
    16-byte chunks per row slot (the row plus up to 15 bytes before it), the plan says so,
    and the schedule's repr shows the choice; inputs not 16-byte aligned cannot use it. The
    whole row in one block of 1024 threads, as test_seed_case_exact_plan."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    hints = Hints(aligned_copy=True, threads_per_row=1024, cluster=1)
    s = schedule(info, Problem(24578, 16384, 16), H200, hints)
    assert s.aligned_copy and "rows copied in aligned 16-byte chunks" in s.reason
    assert "aligned_copy       True" in str(s)
    chunks = {"T0": 3074, "T1": 3074, "T2": 1538, "T4": 3074}
    buffers = {b.name: b for b in s.smem.buffers}
    for name, n in chunks.items():
        b = buffers[f"s_{name}"]
        assert b.nbytes == s.stages * 16 * n, b
        assert f"in {n} 16-byte chunks" in b.purpose
        assert s.placement(name).async_copy
    assert_plan_invariants(s.smem)
    with pytest.raises(HintError, match=r"aligned_copy=True\): .*these are 4-byte aligned"):
        schedule(info, Problem(24578, 16384, 4), H200, Hints(aligned_copy=True))
    assert schedule(info, Problem(24578, 16384, 16), H200).aligned_copy  # on by default
    off = Hints(aligned_copy=False)
    assert not schedule(info, Problem(24578, 16384, 16), H200, off).aligned_copy
    # Split over a cluster, each block's slot holds the chunks of its part (12290 elements).
    c = schedule(info, Problem(24578, 16384, 16), H200, Hints(aligned_copy=True, cluster=2))
    assert c.aligned_copy and c.cluster == 2
    part_chunks = -(-(12290 * 2 + 15) // 16)
    t0 = next(b for b in c.smem.buffers if b.name == "s_T0")
    assert t0.nbytes == c.stages * 16 * part_chunks and f"in {part_chunks} 16-byte" in t0.purpose


def test_no_fit_error_lists_each_attempt_once_and_names_aligned_copies():
    """Aligned and vector row copies are both tried; the error names which is which and
    lists no attempt twice."""
    info = analyze(ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    forced = Hints(cluster=1, storage=tuple((n, Storage.SMEM) for n in ("T0", "T1", "T2", "T4")))
    with pytest.raises(HintError) as error:
        schedule(info, Problem(49154, 16384, 16), H200, forced)
    tried = [line for line in str(error.value).splitlines() if line.startswith("  cluster=")]
    assert len(tried) == len(set(tried)) == 2
    assert sum("aligned copies" in line for line in tried) == 1


@pytest.mark.parametrize(("name", "hidden", "align", "dealing"), [
    # several blocks per SM, one stage, the columns no heavier than the group's rows
    ("rmsnorm_fwd", 4096, 16, Dealing.GRID),
    ("softmax_fwd", 2048, 16, Dealing.GRID),
    # a weight and a bias (32 KB) over one row of 16 KB: reloading them per group costs more;
    # one stage in shared memory: the counter's rows are refilled by each row's last pass
    ("layernorm_fwd", 8192, 16, Dealing.DYNAMIC),
    ("rmsnorm_fwd", 65536, 16, Dealing.DYNAMIC),  # one block per SM, one stage
    ("rmsnorm_fwd", 131072, 16, Dealing.STRIDED),  # a cluster of 2, one block per SM
    ("layernorm_fwd", 16384, 16, Dealing.STRIDED),  # two stages
    ("rmsnorm_bwd", 4096, 16, Dealing.STRIDED),  # column sums: the same order every run
    ("softmax_bwd", 131072, 16, Dealing.STRIDED),  # rows in registers over a cluster
    ("rmsnorm_fwd", 16384, 16, Dealing.GRID),  # one stage at 512 threads: 2 blocks per SM
    ("rmsnorm_bwd", 131072, 16, Dealing.STRIDED),  # a cluster of blocks shares each row
])
def test_row_groups_are_dealt_by_grid_counter_or_stride(name, hidden, align, dealing):
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 16384, align), H200)
    assert s.dealing is dealing, s


@pytest.mark.parametrize(("name", "dtype", "hidden", "threads"), [
    ("rmsnorm_fwd", DataType.BFloat16, 16384, 512),  # else a staging ring, one block per SM
    ("softmax_fwd", DataType.BFloat16, 16384, 256),  # 512 threads keep exp: one block per SM
    ("softmax_fwd", DataType.BFloat16, 32768, 512),  # else two stages of 1024 threads
    ("softmax_bwd", DataType.Half, 16384, 512),  # else rows in registers, one block per SM
    ("softmax_fwd", DataType.Float, 16384, 512),
    ("softmax_fwd", DataType.BFloat16, 49152, 512),  # 12 vectors a thread
    ("rmsnorm_fwd", DataType.BFloat16, 32768, 512),  # the weight re-read from L2
])
def test_long_rows_are_dealt_a_block_each_where_several_share_an_sm(name, dtype, hidden,
                                                                     threads):
    """Rows too long to be short are staged in one stage, at the policy's threads or half of
    them, where that lets the hardware deal a row group to each of several blocks per SM."""
    _, s = plan_for(name, dtype, hidden)
    assert (s.dealing, s.stages, s.threads_per_row, s.cluster) == (
        Dealing.GRID, 1, threads, 1), s.reason
    assert s.blocks_per_sm >= 2 and s.ring is None
    assert all(p.storage is Storage.SMEM for p in s.placements if p.role is Role.FULL)
    assert f"one stage at {threads} threads per row, a block per row group" in s.reason
    assert s.batch <= 16


@pytest.mark.parametrize(("name", "dtype", "hidden", "blocks"), [
    ("softmax_fwd", DataType.BFloat16, 65536, 2),  # 128 KB a row: one block per SM alone
    ("log_softmax_fwd", DataType.Half, 65536, 2),
    ("softmax_fwd", DataType.Float, 32768, 3),
    ("softmax_bwd", DataType.BFloat16, 49152, 2),  # two row inputs: 192 KB a row
])
def test_rows_of_more_than_half_an_sm_are_dealt_over_a_cluster_of_two(name, dtype, hidden,
                                                                       blocks):
    """Rows without column inputs whose one stage fills more than half an SM's shared memory
    are split over a cluster of two, each block half a row in one stage at 512 threads, and
    dealt a block per row group, several to an SM."""
    _, s = plan_for(name, dtype, hidden)
    assert (s.cluster, s.dealing, s.stages, s.threads_per_row, s.blocks_per_sm) == (
        2, Dealing.GRID, 1, 512, blocks), s.reason
    assert "one stage at 512 threads per row in a cluster of 2, a block per row group" in (
        s.reason)


@pytest.mark.parametrize(("name", "dtype", "hidden"), [
    ("softmax_fwd", DataType.BFloat16, 131072),  # half a row is more than half an SM
    ("softmax_bwd", DataType.Float, 32768),
    ("rmsnorm_fwd", DataType.BFloat16, 65536),  # a weight: lost over a cluster
])
def test_rows_dealt_over_a_cluster_only_where_two_blocks_hold_them_in_half_an_sm(name, dtype,
                                                                                 hidden):
    _, s = plan_for(name, dtype, hidden)
    assert "a block per row group" not in s.reason, s.reason


@pytest.mark.parametrize(("name", "hidden"), [
    ("layernorm_fwd", 16384),  # a weight and a bias outweigh the row: two stages, strides
    ("dropout_layernorm_fwd", 8192),  # three passes with column inputs
    ("rmsnorm_fwd", 65536),  # no staged choice leaves two blocks per SM
    ("rmsnorm_fwd", 4096),  # short rows: one stage first already
    ("softmax_fwd", 24578),  # vectors narrower than 16 bytes: skewed rows
])
def test_rows_not_dealt_a_block_each_keep_the_search_they_had(name, hidden):
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    first = schedule(info, Problem(hidden, 16384, 16), H200)
    assert "a block per row group" not in first.reason, first.reason


def test_hinted_searches_take_no_dealt_step():
    """Hints speak the policy's own vocabulary: a hint that fixes the geometry, stages,
    storage or dealing takes the search it always took (here rmsnorm_fwd 16384's staging
    ring, one block per SM at fixed strides); hints that cannot change rows of whole 16-byte
    vectors leave the default as it is."""
    info = analyze(ROW_FUSIONS["rmsnorm_fwd"](DataType.BFloat16).fusion)
    problem = Problem(16384, 16384, 16)
    hinted = schedule(info, problem, H200, Hints(dealing="strided"))
    assert hinted.ring is not None and hinted.dealing is Dealing.STRIDED, hinted.reason
    default = schedule(info, problem, H200)
    for moot in (Hints(skewed=False), Hints(aligned_copy=False)):
        assert schedule(info, problem, H200, moot) == default


@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_a_counter_by_default_only_where_the_rows_are_refilled(name):
    """Without refills a counter lost to fixed strides (bench/TUNING.md, "refilled rows"):
    every default that deals from a counter refills its row slots in the last pass, and a
    hinted counter renders (without refills) where the rows cannot be."""
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    for hidden in (2048, 8192, 32768, 65536):
        problem = Problem(hidden, 16384, 16)
        for s in itertools.islice(candidates(info, problem, H200), 6):
            refilled = row_codegen.refill(info, s, row_codegen.variance_of(info, s))
            assert (s.dealing is Dealing.DYNAMIC) == bool(refilled), s
    hinted = candidates(info, Problem(4096, 16384, 16), H200, Hints(dealing="dynamic"))
    for s in itertools.islice(hinted, 3):
        source = render_row(name, info, s, None).source
        if not row_codegen.refill(info, s, row_codegen.variance_of(info, s)):
            assert "refill(" not in source and "if (it == 0)" not in source, s
            continue
        # the first row's copies only; the next group read after the first reduction's
        # barrier published it; each refill after it, and their commit after the last
        assert "if (it == 0) " in source, s
        published = source.index("rows.dealt(it)")
        assert source.index("reduce(part") < published < source.index(".refill(v, "), s
        committed = source.index("fm::cp_async_commit();  // the next row's copies")
        assert source.rindex(".refill(v, ") < committed, s


def test_rows_copied_in_aligned_chunks_keep_fixed_strides():
    """Their copies end in a barrier of their own; with a counter's they ran slower."""
    info = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    aligned = [s for s in candidates(info, Problem(24578, 16384, 16), H200) if s.aligned_copy]
    assert aligned and all(s.dealing is Dealing.STRIDED for s in aligned)


@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_no_schedule_deals_what_its_kernel_cannot(name):
    """A block per group only without column sums (one partial row per resident block); a
    counter only for blocks that own whole rows outside a staging ring, and by default never
    for column sums, whose order of summing would change from run to run."""
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    for hidden in (1000, 4096, 24578, 65537, 131072):
        for s in itertools.islice(candidates(info, Problem(hidden, 16384, 16), H200), 6):
            assert not (s.dealing is Dealing.GRID and info.outer_reductions), s
            assert not (s.dealing is Dealing.DYNAMIC and (s.cluster > 1 or s.ring)), s
            assert not (s.dealing is Dealing.DYNAMIC and info.outer_reductions), s


@pytest.mark.parametrize(("name", "dtype", "hidden", "skew", "threads"), [
    ("softmax_fwd", DataType.BFloat16, 24578, 2, 512),
    ("log_softmax_fwd", DataType.BFloat16, 24574, 2, 512),
    ("softmax_bwd", DataType.BFloat16, 4099, 1, 64),  # 514 vectors: 6 a thread at most 64
    ("softmax_fwd", DataType.Float, 24578, 2, 512),
    ("softmax_fwd", DataType.Half, 65537, 1, 512),
])
def test_rows_are_skewed_where_vectors_would_be_narrow(name, dtype, hidden, skew, threads):
    """16-byte vectors from the boundary below each row's start instead of the few bytes that
    divide hidden; at most 512 threads a row, six vectors a thread, rows in one stage."""
    _, s = plan_for(name, dtype, hidden)
    assert (s.skew, s.vec * dtype.itemsize, s.threads_per_row) == (skew, 16, threads), s.reason
    assert s.stages == 1 and not s.aligned_copy and s.cluster == 1, s.reason
    assert s.batch * s.threads_per_row * s.vec >= hidden + s.vec - s.skew
    assert "skewed rows" in s.reason


@pytest.mark.parametrize(("name", "hidden", "align", "why"), [
    ("softmax_fwd", 24578, 4, "4-byte aligned inputs"),
    ("softmax_fwd", 24576, 16, "vectors divide the row"),
    ("softmax_fwd", 30, 16, "rows of fewer than 4 vectors"),
])
def test_rows_are_not_skewed_where_they_cannot_be(name, hidden, align, why):
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    for s in itertools.islice(candidates(info, Problem(hidden, 16384, align), H200), 8):
        assert not s.skew and hidden % s.vec == 0, (why, s.reason)


@pytest.mark.parametrize(("name", "dtype", "hidden"), [
    ("rmsnorm_fwd", DataType.Float, 32769),
    ("rmsnorm_fwd", DataType.Float, 40961),
    ("layernorm_fwd", DataType.Float, 49153),
])
def test_skewed_rows_do_not_re_read_columns_at_one_block_per_sm(name, dtype, hidden):
    """A skewed row of this length fills a block per SM in one stage and would re-read its
    weight (and bias) every pass: the plain rows come first, and say why; the hint still
    gets skewed rows."""
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    problem = Problem(hidden, 16384, 16)
    s = schedule(info, problem, H200)
    assert not s.skew and "skewed rows would re-read" in s.reason, s.reason
    hinted = schedule(info, problem, H200, Hints(skewed=True))
    assert hinted.skew and hinted.blocks_per_sm == 1 and hinted.stages == 1, hinted.reason
    assert skewed_loses(hinted) is not None


@pytest.mark.parametrize(("name", "dtype", "hidden", "cluster", "blocks"), [
    ("layernorm_fwd", DataType.BFloat16, 65537, 4, 2),
    ("layernorm_fwd", DataType.Half, 98305, 8, 3),
    ("layernorm_fwd", DataType.BFloat16, 131073, 8, 2),  # no block holds the row
    ("rmsnorm_fwd", DataType.BFloat16, 65537, 4, 3),
    ("rmsnorm_fwd", DataType.BFloat16, 81921, 4, 2),
    ("rmsnorm_fwd", DataType.Half, 98305, 4, 2),
    ("rmsnorm_fwd", DataType.BFloat16, 131073, 8, 3),
])
def test_single_element_rows_under_columns_as_heavy_are_skewed_over_a_cluster(
        name, dtype, hidden, cluster, blocks):
    """LayerNorm forward's weight and bias, and RMSNorm forward's weight, weigh as much as
    their row or more: where one block's skewed rows would re-read them, or no block holds
    the row, and the plain rows are single 2-byte elements, the rows are skewed over the
    smallest cluster that keeps every buffer in shared memory (the columns at the rows'
    skew) at two blocks per SM or more."""
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H100)
    assert (s.skew, s.cluster, s.blocks_per_sm) == (1, cluster, blocks), s.reason
    assert s.columns_at_skew and s.buffers_in_smem and str(s.dealing) == "strided", s
    assert f"skewed rows over a cluster of {cluster} keep the columns" in s.reason
    fp32 = analyze(ROW_FUSIONS[name](DataType.Float).fusion)
    assert not schedule(fp32, Problem(49153, 16384, 16), H100).skew  # 4-byte elements


@pytest.mark.parametrize(("name", "dtype", "hidden"), [
    ("softmax_fwd", DataType.BFloat16, 65537),  # no columns
    ("rmsnorm_fwd", DataType.BFloat16, 49153),  # two blocks per SM
    ("dropout_rmsnorm_fwd", DataType.BFloat16, 24577),  # columns lighter than the rows
    ("layernorm_fwd", DataType.Float, 16385),  # three blocks per SM
])
def test_skewed_rows_stay_first_where_columns_do_not_hold_them(name, dtype, hidden):
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    assert s.skew and skewed_loses(s) is None, s.reason


def test_skewed_hints_are_honoured_or_refused():
    info = analyze(ROW_FUSIONS["softmax_fwd"](DataType.BFloat16).fusion)
    problem = Problem(24578, 16384, 16)
    assert schedule(info, problem, H200, Hints(skewed=False)).vec == 2
    assert schedule(info, problem, H200, Hints(skewed=True)).skew == 2
    clustered = schedule(info, problem, H200, Hints(skewed=True, cluster=2))
    assert (clustered.skew, clustered.cluster) == (2, 2), clustered.reason
    with pytest.raises(HintError, match=r"aligned_copy None or False"):
        schedule(info, problem, H200, Hints(skewed=True, aligned_copy=True))
    with pytest.raises(HintError, match=r"skewed='yes'\): True or False"):
        Hints(skewed="yes")
    bwd = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    assert not schedule(bwd, problem, H200).skew  # column sums: skewed only when hinted
    assert schedule(bwd, problem, H200, Hints(skewed=True)).dealing is Dealing.STRIDED
    with pytest.raises(HintError, match=r"dealing None or 'strided' \(a thread's rows must "
                                        r"share a skew for its column sums\)"):
        schedule(bwd, problem, H200, Hints(skewed=True, dealing="dynamic"))
    assert not schedule(bwd, problem, H200, Hints(dealing="dynamic")).skew


def test_skewed_rows_read_their_columns_from_shared_or_global_memory():
    """A skewed row's lane holds a different column in every row: skewed rows re-read the
    weight and bias from global memory (the default, staging the row), or keep them in shared
    memory where hinted (one row a block: the block's part of each column at the rows' skew;
    several: the whole column, padded), never registers."""
    ln = analyze(ROW_FUSIONS["layernorm_fwd"](DataType.BFloat16).fusion)
    problem = Problem(24578, 16384, 16)
    for s in (schedule(ln, problem, H200), schedule(ln, problem, H200, Hints(skewed=True))):
        assert s.skew == 2 and [s.placement(t).storage for t in ("T1", "T2")] == ["global"] * 2
        assert s.placement("T0").storage == "smem", s.reason
    s = schedule(ln, problem, H200,
                 Hints(skewed=True, storage=(("T0", "smem"), ("T1", "smem"), ("T2", "smem"))))
    assert s.skew and s.columns_at_skew and s.smem.buffer("s_T1").nbytes == 3073 * 8 * 2
    s = schedule(ln, problem, H200, Hints(skewed=True, rows_per_block=2, threads_per_row=256,
                                          storage=(("T0", "smem"), ("T1", "smem"),
                                                   ("T2", "smem"))))
    assert s.skew and not s.columns_at_skew, s.reason
    assert s.smem.buffer("s_T1").nbytes == 24578 * 2 + 4 * (24578 * 2 // 128)
    with pytest.raises(HintError, match=r"not kept in registers"):
        schedule(ln, problem, H200, Hints(skewed=True, storage=(("T1", "registers"),)))


def test_hints_beside_skewed_rows_are_checked_against_the_skewed_geometry():
    """rows_per_block is held against the threads a skewed row takes (64 at bf16 4099, so 16
    rows fit a block), and skewed=True reaches rows too long for one block's shared memory by
    re-reading them (a skewed row is one block's)."""
    info = analyze(ROW_FUSIONS["softmax_fwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(4099, 16384, 16), H200, Hints(rows_per_block=4))
    assert (s.skew, s.threads_per_row, s.rows_per_block) == (1, 64, 4), s.reason
    s = schedule(info, Problem(131074, 16384, 16), H200, Hints(skewed=True))
    assert s.skew and s.cluster == 1 and s.placement("T0").storage == "global", s.reason
    with pytest.raises(HintError, match=r"the 8-element vectors that divide hidden 4096 are the "
                                        r"widest already\); allowed here: None or False"):
        schedule(info, Problem(4096, 16384, 16), H200, Hints(skewed=True))


def test_small_odd_rows_are_not_skewed_by_default():
    """Below SKEWED_DEFAULT_MIN_VECTORS skewed vectors (bf16: 4089 elements) nothing was timed
    skewed: the default keeps the vectors that divide the row; skewed=True still skews."""
    info = analyze(ROW_FUSIONS["softmax_fwd"](DataType.BFloat16).fusion)
    for hidden in (127, 1026, 4082):
        assert not schedule(info, Problem(hidden, 16384, 16), H200).skew
        assert schedule(info, Problem(hidden, 16384, 16), H200, Hints(skewed=True)).skew


def test_skewed_column_sums_take_their_own_geometry():
    """Hinted skewed rows of a backward: a thread's column sums hold 8 fp32 lanes a vector, so
    at most 3 vectors a thread down to 128 threads (4099: 128 threads, not the 64 of packed
    rows), and the weight re-read from global memory, which leaves room for two stages of
    rows at 24578."""
    info = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(4099, 16384, 16), H200, Hints(skewed=True))
    assert s.skew and s.threads_per_row == 128, s.reason
    s = schedule(info, Problem(24578, 16384, 16), H200, Hints(skewed=True))
    assert s.skew and s.threads_per_row == 512 and s.stages == 2, s.reason
    assert s.placement("T3").storage is Storage.GLOBAL, s.reason


@pytest.mark.parametrize(("name", "dtype", "hidden", "cluster", "first"), [
    ("rmsnorm_bwd", DataType.BFloat16, 16384, 2, True),  # one stage over 2, 128 words
    ("rmsnorm_bwd", DataType.Half, 32768, 4, True),  # one stage over 4
    ("layernorm_bwd", DataType.BFloat16, 16384, 4, True),  # two stages, 128 words
    ("layernorm_bwd", DataType.BFloat16, 20480, 4, True),  # 160 words
    ("layernorm_bwd", DataType.BFloat16, 32768, 8, True),  # two stages over 8
    ("rmsnorm_bwd", DataType.BFloat16, 65536, 2, False),  # one stage over 8 lost
    ("rmsnorm_bwd", DataType.BFloat16, 20480, 2, False),  # 80 words over 4: split first
    ("layernorm_bwd", DataType.BFloat16, 24576, 2, False),  # 192 words over 4
    ("dropout_rmsnorm_bwd", DataType.BFloat16, 16384, 1, False),  # a buffer out of smem
    ("layernorm_bwd", DataType.BFloat16, 10240, 2, True),  # 160 words over 2
    ("layernorm_bwd", DataType.BFloat16, 16392, 1, False),  # a ragged last vector round
    ("rmsnorm_bwd", DataType.BFloat16, 31744, 2, False),  # ragged over 4: 0.96 -> 0.77
    ("layernorm_bwd", DataType.BFloat16, 15364, 1, False),  # 8-byte vectors
    ("rmsnorm_bwd", DataType.Float, 16384, 1, False)])  # 4-byte elements
def test_packed_rows_over_a_cluster_go_first_where_their_column_sums_fill_the_band(
        name, dtype, hidden, cluster, first):
    """Packed rows (64 threads a row, four rows a block) over a cluster before one block's
    rows (inner_outer_persistent._packed_first) where they keep every buffer in shared memory
    and 128 to 160 registers of column sums a thread, one stage over at most four blocks:
    bf16 rmsnorm_bwd 16384 0.92 -> 0.96 of the copy, layernorm_bwd 16384 / 20480 / 32768
    0.87 / 0.88 / 0.90 -> 0.95 / 0.95 / 0.94. Not where they lost: one stage over eight
    (rmsnorm_bwd 65536 0.97 -> 0.92), 80, 96 or 192 registers, a row buffer out of shared
    memory (dropout_rmsnorm_bwd 16384 0.94 -> 0.72), a last round of vectors that some
    threads have and others not (rmsnorm_bwd 31744 0.96 -> 0.77); rows of narrower vectors
    and fp32 were not measured. The reason says so."""
    info = analyze(FUSIONS[name](dtype).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), H200)
    assert s.cluster == cluster, s.reason
    assert ("packed rows over a cluster of" in s.reason) == first, s.reason
    if first:
        assert (s.threads_per_row, s.rows_per_block) == (64, 4), s.reason
        assert all(p.storage is Storage.SMEM for p in s.placements), s.reason
        assert 128 <= s.batch * s.vec * len(info.outer_reductions) <= 160, s.reason


def test_packed_rows_first_fall_back_on_one_block_and_are_not_hinted():
    """rmsnorm_bwd bf16 16384: where the packed build spills, the next candidate is the one
    the search had first without the rule (one block, three stages); hints that shape the
    block leave the rule out."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    problem = Problem(16384, 16384, 16)
    first, second = itertools.islice(candidates(info, problem, H200), 2)
    assert (first.cluster, first.threads_per_row) == (2, 64), first.reason
    assert (second.cluster, second.threads_per_row, second.stages) == (1, 512, 3), second.reason
    assert "(packed rows over a cluster of 2 first: 128 registers" in first.reason
    assert "the plans for fewer blocks" not in first.reason  # one block was not the reason
    hinted = next(iter(candidates(info, problem, H200, Hints(stages=1))))
    assert (hinted.cluster, hinted.threads_per_row, hinted.stages) == (1, 512, 1), hinted.reason


def test_a_block_size_hint_refused_at_one_block_names_the_clusters_default():
    """Hints are checked at one block (a block-size hint never brings in a cluster); where
    the heuristic's rows go over a cluster in packed rows, the refusal says the default's
    rows per block with its threads per row and cluster, not a bare number outside the
    range it just gave."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    with pytest.raises(HintError, match=r"allowed: 1 to 2 .*the heuristic picks "
                       r"rows_per_block=4 \(of 64 threads per row, over a cluster of 2\) here"):
        schedule(info, Problem(16384, 16384, 16), H200, Hints(rows_per_block=4))
