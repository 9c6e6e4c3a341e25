"""CPU: normalization along columns (analysis Kind.OUTER_NORM, schedulers/outer_persistent.py):
classified, scheduled on every device preset, planned, rendered and compiled by NVRTC with
no spills; hints either honoured or refused naming what is allowed; columns too tall for any
cluster fall back to segments. tests/test_gpu_outer.py runs the kernels."""

from __future__ import annotations

import pytest
from test_segment import _fd

import fuser
from fuser import DataType, FusionDefinition, HintError, UnsupportedFusionError
from fuser.analysis import Kind, analyze
from fuser.cli import shapes_of
from fuser.device import PRESETS, DeviceSpec
from fuser.executor import columns_too_tall
from fuser.explain import Explanation, SegmentedExplanation
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints, Problem, candidates
from fuser.schedulers.base import OuterSchedule, problem_rows
from fuser.schedulers.outer_folds import fold_levels
from fuser.schedulers.outer_persistent import fold_groups
from fuser.smem import STATIC_SLOT

BF16, F = DataType.BFloat16, DataType.Float
H200 = DeviceSpec.get("h200")


@pytest.mark.parametrize(("name", "levels"), [("batchnorm_fwd", [["sum"], ["sum"]]),
                                              ("batchnorm_bwd", [["sum", "sum"]])])
def test_batchnorm_is_one_outer_normalization(name, levels):
    info = analyze(FUSIONS[name](BF16).fusion)
    assert info.kind is Kind.OUTER_NORM
    assert [[e.op for e in level] for level in info.outer_levels] == levels
    assert "outer level 0:" in info.describe()


def test_softmax_over_dim_0_folds_a_max_then_a_sum():
    info = analyze(_fd("softmax_dim0").fusion)
    assert [[e.op for e in level] for level in info.outer_levels] == [["max"], ["sum"]]


def _exp_sums(dtype: DataType, shifted) -> FusionDefinition:
    """x cast to `dtype`'s compute type, a column max m, and sum(exp(shifted(x, m))) over the
    rows; the output x / that sum."""
    wide = DataType.Double if dtype is DataType.Double else F
    with FusionDefinition("exp_sums") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        xw = fd.ops.cast(x, wide)
        m = fd.ops.max(xw, [0], keepdim=True)
        s = fd.ops.sum(fd.ops.exp(shifted(fd, xw, m)), [0], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.div(xw, s), dtype))
    return fd


def _levels_words(fd: FusionDefinition) -> list[list[str]]:
    return [[fold.words() for fold in level] for level in fold_levels(analyze(fd.fusion))]


def test_a_max_and_its_sum_of_exponentials_fold_in_one_level():
    """Softmax over dim 0: the column max and the sum of exp(x - max) are one online pair,
    one pass and one fold (outer_folds), in the kernel's 8-byte fm::MaxSum buffers."""
    assert _levels_words(_fd("softmax_dim0")) == [
        ["max(T1) -> T2 with sum(exp(T1 - T2)) -> T5, online"]]
    report = fuser.explain(_fd("softmax_dim0", BF16), [(16384, 4096)])
    assert "online (one pass and one fold for both)" in report.schedule.reason
    kernel = report.source.split("#include")[1]
    assert "acc_T2[i] = fm::OnlineSum{}(acc_T2[i], e_T1);" in kernel
    assert "k_rcp_T5[i] = float(1) / fm::online_sum(r_T2[i]);" in kernel
    assert "s_level_bars[1]" not in kernel and "fm::exp" in kernel
    plan = report.schedule.smem
    assert plan.buffer("s_inbox_T2").nbytes == report.schedule.cluster * report.schedule.slab * 8
    assert {"s_lanes0_pair", "s_total0_pair"} <= {b.name for b in plan.buffers}


@pytest.mark.parametrize(("dtype", "shifted"), [
    (DataType.Double, lambda fd, x, m: fd.ops.sub(x, m)),  # double: two 8-byte totals
    (BF16, lambda fd, x, m: fd.ops.sub(m, x)),  # exp(max - x)
    (BF16, lambda fd, x, m: fd.ops.sub(fd.ops.mul(x, 2.0), m)),  # not the max's operand
], ids=["double", "max-minus-x", "other-operand"])
def test_other_sums_of_exponentials_keep_their_own_level(dtype, shifted):
    levels = _levels_words(_exp_sums(dtype, shifted))
    assert len(levels) == 2 and not any("online" in w for level in levels for w in level)


def test_a_row_normalization_then_a_column_one_is_still_cut():
    with pytest.raises(UnsupportedFusionError, match="fusion with inner reductions"):
        analyze(_fd("row_then_column").fusion)


def test_problem_rows_keep_every_row_of_an_outer_normalization():
    outer, rows = analyze(_fd("batch_norm").fusion), analyze(FUSIONS["rmsnorm_fwd"](BF16).fusion)
    assert [problem_rows(outer, n) for n in (1, 7, 1000, 16384, 16385, 60000)] == [
        1, 7, 1024, 16384, 20480, 65536]
    assert [problem_rows(rows, n) for n in (7, 16384)] == [8, 1024]


@pytest.mark.parametrize(("rows", "hidden", "cluster", "slab", "blocks"),
                         [(16384, 4096, 16, 32, 3), (4096, 16384, 8, 64, 3), (7, 3, 1, 4, 25)])
def test_the_widest_slab_over_the_fewest_blocks(rows, hidden, cluster, slab, blocks):
    info = analyze(FUSIONS["batchnorm_fwd"](BF16).fusion)
    s = next(candidates(info, Problem(hidden, problem_rows(info, rows), 16), H200))
    assert isinstance(s, OuterSchedule)
    assert (s.cluster, s.slab, s.blocks_per_sm) == (cluster, slab, blocks)
    assert s.rank_rows * s.cluster >= s.rows >= rows
    assert s.slabs * s.slab >= hidden > (s.slabs - 1) * s.slab
    tile = s.smem.buffer("s_T0")
    assert tile.nbytes == s.rank_rows * s.slab * 2 and tile.offset == 0
    groups = fold_groups(s.col_lanes, s.row_lanes, H200.warp_size)
    assert s.smem.buffer("s_lanes0_f32").nbytes == groups * s.slab * 4
    assert s.smem.static_slot == STATIC_SLOT and s.smem.fits


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_runs_one_kernel_or_segments(preset):
    fd = FUSIONS["batchnorm_bwd"](BF16)
    small = fuser.explain(fd, shapes_of(fd, 1000, 1000), device=preset)
    assert isinstance(small, Explanation) and isinstance(small.schedule, OuterSchedule)
    if DeviceSpec.get(preset).arch < 90:
        assert small.schedule.cluster == 1
    tall = fuser.explain(fd, shapes_of(fd, 2**21, 64), device=preset)
    assert isinstance(tall, SegmentedExplanation)
    assert "outer-persistent kernel cannot run it here" in str(tall)
    assert "do not fit on a cluster" in str(tall)


@pytest.mark.parametrize("dtype", [BF16, DataType.Half, F], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (1000, 4099), (30000, 24), (4096, 4096)],
                         ids=str)
@pytest.mark.parametrize("name", ["batchnorm_fwd", "batchnorm_bwd", "softmax_dim0_fwd"])
def test_kernels_compile_without_spills(name, shape, dtype):
    fd = FUSIONS[name](dtype)
    report = fuser.explain(fd, shapes_of(fd, *shape))
    assert isinstance(report.schedule, OuterSchedule)
    for resources in report.resources.values():
        assert not resources.spills, resources
        assert resources.static_smem <= report.schedule.smem.static_slot


def column_shares(dtype: DataType) -> FusionDefinition:
    """Elements divided by column values: each element's share of its column's sum, and
    (x - 1) over the column's largest magnitude (in double for Double inputs)."""
    with FusionDefinition("column_shares") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        wide = fd.ops.cast(x, DataType.Double if dtype is DataType.Double else F)
        total = fd.ops.sum(wide, dims=[0], keepdim=True)
        peak = fd.ops.max(fd.ops.abs(wide), dims=[0], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.div(wide, total), dtype))
        fd.add_output(fd.ops.div(fd.ops.sub(wide, 1.0), peak))
    return fd


@pytest.mark.parametrize(("dtype", "compute"), [(DataType.Double, "double"), (F, "float"),
                                                (BF16, "float")], ids=str)
def test_elements_are_divided_by_a_column_value_through_its_reciprocal(dtype, compute):
    """An IEEE division costs about ten instructions an element, a multiply one: each column's
    reciprocal is computed once, before the pass that divides by it, in the division's type."""
    report = fuser.explain(column_shares(dtype), [(1000, 4099)])
    assert isinstance(report.schedule, OuterSchedule)
    kernel = report.source.split("#include")[1]
    suffix = "_d" if compute == "double" else ""
    for total in ("T2", "T4"):
        assert f"k_rcp{suffix}_{total}[i] = {compute}(1) / r_{total}[i];" in kernel
        assert f" * k_rcp{suffix}_{total}[i])" in kernel
    assert not [line for line in kernel.splitlines() if " e_" in line and " / " in line]
    assert not any(r.spills for r in report.resources.values())


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
def test_a_cluster_hint_is_honoured(cluster):
    fd = FUSIONS["batchnorm_fwd"](BF16)
    report = fuser.explain(fd, shapes_of(fd, 1000, 520), hints=Hints(cluster=cluster))
    assert report.schedule.cluster == cluster
    assert f"__cluster_dims__({cluster}, 1, 1)" in report.source or cluster == 1


@pytest.mark.parametrize(("hints", "message"), [
    (Hints(cluster=3), r"Hints\(cluster=3\): allowed: 1, 2, 4, 8, 16"),
    (Hints(cluster=1), r"(?s)do not fit on a cluster of 1.*clusters that hold these rows: 2, 4, "
                       r"8, 16"),
    (Hints(stages=2), r"Hints\(stages=\.\.\.\): outer_persistent takes only the cluster hint"),
])
def test_other_hints_are_refused_naming_what_is_allowed(hints, message):
    fd = FUSIONS["batchnorm_fwd"](BF16)
    with pytest.raises(HintError, match=message):
        fuser.explain(fd, shapes_of(fd, 16384, 1024), hints=hints)


def test_only_an_outer_normalization_falls_back_to_segments():
    reason = UnsupportedFusionError("a test")
    assert columns_too_tall(_fd("row_then_column"), reason) is None
    found = columns_too_tall(_fd("batch_norm"), reason)
    assert len(found.segments) == 3 and "a test" in str(found)
    assert columns_too_tall(_fd("batch_norm"), reason) is not None


def test_column_totals_fold_in_rank_order_with_no_atomics():
    fd = FUSIONS["batchnorm_bwd"](BF16)
    source = fuser.explain(fd, shapes_of(fd, 4096, 16384)).source
    assert "atomic" not in source.split("#include")[1].replace("fm::magic_zero", "")
    assert "fm::cluster_sync()" not in source  # its release would fence every access in flight
    assert source.count("fm::mbarrier_wait(&s_level_bars[0], 0);") == 1
    assert "slab.fold_groups(s_lanes0_f32, s_inbox_T9, fm::Sum{}, &s_level_bars[0]);" in source
    assert "slab.fold_blocks(s_inbox_T9, s_total0_f64, fm::Sum{});" in source
    assert "slab.fold_blocks(s_inbox_T11, s_total1_f64, fm::Sum{});" in source


def test_levels_take_turns_in_the_lanes_and_totals_buffers_but_not_the_inboxes():
    """BatchNorm forward's mean and variance sums (two levels) share one lanes and one totals
    buffer; each keeps its own inbox (a peer may push the variance's partials before this
    block has read the mean's); a Double sum beside a Float one in a level has its own."""
    fd = FUSIONS["batchnorm_fwd"](BF16)
    plan = fuser.explain(fd, shapes_of(fd, 16384, 4096)).schedule.smem
    names = [b.name for b in plan.buffers]
    assert names == ["s_T0", "s_lanes0_f32", "s_inbox_T5", "s_inbox_T16", "s_total0_f64",
                     "s_level_bars"]
    with FusionDefinition("mixed") as mixed:
        x = mixed.define_tensor([-1, -1], dtype=BF16)
        xf = mixed.ops.cast(x, F)
        a = mixed.ops.sum(xf, dims=[0], keepdim=True)
        b = mixed.ops.sum(mixed.ops.cast(xf, DataType.Double), dims=[0], keepdim=True)
        mixed.add_output(mixed.ops.cast(mixed.ops.add(mixed.ops.mul(xf, a),
                                                      mixed.ops.cast(b, F)), BF16))
    plan = fuser.explain(mixed, [(16384, 1024)]).schedule.smem
    assert {"s_lanes0_f32", "s_lanes0_f64", "s_total0_f64"} <= {b.name for b in plan.buffers}
    assert plan.buffer("s_lanes0_f64").nbytes == 2 * plan.buffer("s_lanes0_f32").nbytes


def _many_column_sums(count: int) -> FusionDefinition:
    """x plus x times each of `count` column sums of x scaled or exponentiated: one level of
    `count` reductions, whose accumulators outgrow a thread's registers."""
    with FusionDefinition(f"sums{count}") as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        xf = fd.ops.cast(x, F)
        acc = xf
        for k in range(count):
            p = fd.ops.mul(xf, float(k + 1)) if k % 2 else fd.ops.exp(fd.ops.mul(xf, 0.1 * k))
            acc = fd.ops.add(acc, fd.ops.mul(xf, fd.ops.sum(p, [0], keepdim=True)))
        fd.add_output(fd.ops.cast(acc, BF16))
    return fd


def test_a_kernel_that_spills_is_rebuilt_then_built_at_the_next_entry_then_left_to_segments():
    """16 column sums spill at two blocks per SM of 256 threads and fit at one (255
    registers); over 16384 rows their first candidate has 512 threads (128 registers), spills,
    and the next ORDER entry, at 256, runs; 32 sums spill in every schedule and run as
    segments, as they did before the outer kernel existed."""
    rebuilt = fuser.explain(_many_column_sums(16), [(4096, 4096)])
    assert isinstance(rebuilt.schedule, OuterSchedule) and rebuilt.schedule.blocks_per_sm == 1
    assert "rebuilt for 1" in rebuilt.schedule.reason
    assert not any(r.spills for r in rebuilt.resources.values())
    fd = _many_column_sums(16)
    info = analyze(fd.fusion)
    first = next(candidates(info, Problem(4096, problem_rows(info, 16384), 16), H200))
    assert first.threads == 512
    built = fuser.explain(fd, [(16384, 4096)])
    assert isinstance(built.schedule, OuterSchedule) and built.schedule.threads == 256
    assert not any(r.spills for r in built.resources.values())
    cut = fuser.explain(_many_column_sums(32), [(4096, 4096)])
    assert isinstance(cut, SegmentedExplanation)
    assert "outer-persistent kernel cannot run it here: every schedule" in str(cut)


def test_each_fallback_names_its_own_refusal():
    fd = FUSIONS["batchnorm_fwd"](BF16)
    first = fuser.explain(fd, shapes_of(fd, 2**21, 64), device="a100")
    assert "cluster of 1 block(s)" in str(first.segmentation)
    second = fuser.explain(fd, shapes_of(fd, 2**23, 4096), device="h200")
    text = str(second.segmentation)
    assert "columns of 8388608 rows" in text and "cluster of 16 block(s)" in text


def test_a_call_the_outer_kernel_cannot_run_runs_the_segments_and_remembers(monkeypatch):
    """execute(): where planning the outer kernel raises (too tall, spills, a cluster the
    driver cannot keep resident), the call runs the segments, and the next call of the same
    signature goes straight to them; any other fusion's refusal stands."""
    import numpy as np

    from fuser import OutOfResourcesError, executor

    calls = []

    def refused(fd, inputs, device, hints):
        calls.append("plan")
        raise OutOfResourcesError("clusters of 16 blocks cannot be resident (a test)")

    monkeypatch.setattr(executor, "_plan", refused)
    monkeypatch.setattr(executor, "_execute_segments",
                        lambda fd, seg, inputs, device, hints, key=None: ("segments", seg))
    fd = _fd("batch_norm")
    inputs = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)]
    ran, segmentation = executor.execute(fd, inputs)
    assert ran == "segments" and len(segmentation.segments) == 3
    assert "cannot be resident (a test)" in str(segmentation)
    assert executor.execute(fd, inputs)[0] == "segments" and calls == ["plan"]
    with pytest.raises(OutOfResourcesError, match="a test"):
        executor.execute(FUSIONS["rmsnorm_fwd"](BF16), [np.zeros((8, 4), np.float32)])


@pytest.mark.parametrize(("threads", "blocks", "chain"), [
    (256, 3, [3, 2, 1]), (512, 1, [1]), (32, 25, [25, 19, 15, 11, 8])])
def test_a_spilled_outer_kernel_is_rebuilt_for_a_quarter_more_registers_each_time(
        threads, blocks, chain):
    """Each rebuild leaves the threads at least a quarter more registers than the kernel that
    spilled (not one block fewer at a time, which at 32 threads compiled again under the same
    limit), and none follows a kernel at the per-thread maximum (255 at 8 blocks of 32)."""
    from dataclasses import replace

    from fuser.schedulers.outer_persistent import rebuilt_blocks

    info = analyze(FUSIONS["batchnorm_fwd"](BF16).fusion)
    s = next(candidates(info, Problem(4096, 16384, 16), H200))
    lanes = min(s.col_lanes, threads)
    s = replace(s, col_lanes=lanes, row_lanes=threads // lanes, blocks_per_sm=blocks)
    assert s.threads == threads
    found = [s.blocks_per_sm]
    while (fewer := rebuilt_blocks(replace(s, blocks_per_sm=found[-1]), H200)) is not None:
        found.append(fewer)
    assert found == chain


@pytest.mark.parametrize("preset", ["h200", "h100"])
def test_rows_held_in_registers_make_room_for_a_second_block(preset):
    """BatchNorm backward at [16384, 4096] bf16 keeps x and dy, 64 KB each a block of a
    cluster of 16: one block per SM. Its 2-block entry holds dy's first 7 rows of each thread
    in registers (28 of them), so dy's tile holds the block's rows from 7 x 64 on and two
    blocks of 256 threads fit; it compiles for them without spills, and both passes read
    the held rows from registers first, in the order the rows come."""
    fd = FUSIONS["batchnorm_bwd"](BF16)
    e = fuser.explain(fd, shapes_of(fd, 16384, 4096), device=preset)
    s = e.schedule
    assert (s.cluster, s.threads, s.blocks_per_sm, s.held, s.held_rows) == (16, 256, 2, "T3", 7)
    first = s.held_rows * s.row_lanes
    assert s.smem.buffer("s_T3").nbytes == (s.rank_rows - first) * s.slab * 2
    assert s.smem.buffer("s_T0").nbytes == s.rank_rows * s.slab * 2
    assert s.smem.total * 2 <= DeviceSpec.get(preset).smem_per_sm
    assert "T3's first 7 rows of each thread held in registers" in s.reason
    assert "held_rows          7" in str(s)
    source = e.source
    assert f"slab.fill(s_T3, g_T3, {first});" in source and "slab.fill(s_T0, g_T0);" in source
    assert "fm::Vec<__nv_bfloat16, VEC> h_T3[7];\n  slab.hold(h_T3, g_T3);" in source
    assert source.count("const auto x_T3 = h_T3[j];") == 2
    assert source.count(f"const auto x_T3 = slab.at(s_T3, r - {first});") == 2
    assert source.count(f"for (int r = slab.ty + {first} + zero; r < slab.rows;") == 2
    assert "__launch_bounds__(256, 2)" in source
    assert not any(r.spills for r in e.resources.values())


@pytest.mark.parametrize(("name", "dtype", "rows", "hidden", "cluster", "slab"), [
    ("batchnorm_bwd", BF16, 4096, 16384, 16, 64), ("batchnorm_fwd", F, 16384, 4096, 16, 16),
    ("softmax_dim0_fwd", F, 16384, 4096, 16, 16)])
def test_rows_are_held_only_where_every_entry_would_leave_one_block(name, dtype, rows, hidden,
                                                                    cluster, slab):
    """Rows are held only where no entry of two blocks per SM fits without them: BatchNorm
    backward at [4096, 16384] keeps both inputs twice per SM over a cluster of 16 (a cluster
    of 8 would need rows held), and fp32 BatchNorm forward and softmax over dim 0 at [16384,
    4096] take 64-byte segments at three blocks (128-byte ones would need rows held). Such
    schedules print no held fields."""
    info = analyze(FUSIONS[name](dtype).fusion)
    s = next(candidates(info, Problem(hidden, problem_rows(info, rows), 16), H200))
    assert (s.cluster, s.slab, s.held_rows, s.held) == (cluster, slab, 0, "")
    assert s.blocks_per_sm >= 2
    assert "held" not in str(s) and "held" not in s.reason


def test_a_spilled_schedule_with_held_rows_gives_way_to_the_next_candidate():
    """Rows are held only to fit another block: where that kernel spills, the next candidate
    (its rows all in shared memory) is built, not the same one for fewer blocks; the last
    candidate is still rebuilt."""
    from fuser.kernels import _rebuilt

    info = analyze(FUSIONS["batchnorm_bwd"](BF16).fusion)
    s = next(candidates(info, Problem(4096, problem_rows(info, 16384), 16), H200))
    assert s.held_rows and s.blocks_per_sm == 2
    assert _rebuilt(s, False, H200, False) is None
    assert _rebuilt(s, True, H200, False).blocks_per_sm == 1
