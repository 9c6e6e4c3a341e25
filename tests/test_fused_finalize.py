"""CPU: a row kernel that finalizes its own columns (FinalizeSchedule.fused). Where it is the
default (a call of one wave of row groups) and where not; its shared-memory plan (the row
kernel's buffers, then the lanes' sums, without a block per SM fewer); its tile of columns
covering the block's threads; its signature (every output, the partial rows, the barrier's
counter; no finalize kernel); the hint that asks for it steering the row search or refused
naming why; and every fused kernel compiled by NVRTC without spills."""

from __future__ import annotations

import pytest

import fuser.kernels
from fuser import DataType, HintError
from fuser.analysis import Role, analyze
from fuser.cache import KernelCache
from fuser.device import PRESETS
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints, Problem, finalize, schedule
from fuser.schedulers.base import Dealing, ceil_div, next_pow2
from fuser.schedulers.finalize import finalized
from fuser.signature import Source

H200 = PRESETS["h200"]
BF16 = DataType.BFloat16
COLUMN_SUMS = ("rmsnorm_bwd", "layernorm_bwd", "dropout_rmsnorm_bwd", "gelu_bwd")


def info_of(name: str, dtype: DataType = BF16):
    return analyze(FUSIONS[name](dtype).fusion)


def plan(name: str, rows: int, hidden: int, hints: Hints | None = None, device=H200,
         dtype: DataType = BF16):
    info = info_of(name, dtype)
    problem = Problem(hidden, min(rows, 1024), 16)
    return finalized(info, schedule(info, problem, device, hints), problem, device, hints)


@pytest.mark.parametrize("name", COLUMN_SUMS)
@pytest.mark.parametrize("hidden", [1000, 1024, 4096])
def test_a_call_of_one_wave_finalizes_in_the_row_kernel_and_a_long_one_does_not(name, hidden):
    s, final = plan(name, 16, hidden)
    assert final.fused and s.cluster == 1, (s, final)
    _, long = plan(name, 16384, hidden)
    assert not long.fused


def test_rows_split_over_a_cluster_keep_a_finalize_kernel_by_default():
    s, final = plan("layernorm_bwd", 16, 8192)
    assert s.cluster == 2 and not final.fused


@pytest.mark.parametrize("name", COLUMN_SUMS)
@pytest.mark.parametrize(("rows", "hidden"), [(16, 1024), (300, 4099), (64, 24578),
                                              (16384, 2048), (16384, 24578)])
def test_the_fused_plan_adds_the_lanes_sums_after_the_rows_and_keeps_the_blocks(
        name, rows, hidden):
    try:
        s, final = plan(name, rows, hidden, Hints(fused_finalize=True))
    except HintError as error:  # layernorm_bwd at 24578: its rows fill the shared memory
        assert (name, hidden) == ("layernorm_bwd", 24578), error
        assert "its shared memory (" in str(error) and "leaves room for 0 of its 1 blocks" in (
            str(error))
        return
    plain = schedule(info_of(name), Problem(hidden, min(rows, 1024), 16), H200,
                     Hints(fused_finalize=True).for_rows())
    assert final.fused and final.smem is s.smem
    lanes = [b for b in s.smem.buffers if b.name.startswith("s_lanes_")]
    assert [b.name for b in s.smem.buffers[:-len(lanes)]] == [b.name for b in plain.smem.buffers]
    assert len(lanes) == len(info_of(name).outer_reductions)
    assert all(b.nbytes == s.threads * 8 for b in lanes)
    assert final.cols_per_block * final.partial_lanes == s.threads
    assert final.cols_per_block % 8 == 0 or final.cols_per_block == s.threads
    per_sm = H200.smem_per_sm // (s.smem.total + H200.reserved_smem_per_block)
    assert s.smem.fits and per_sm >= s.blocks_per_sm


@pytest.mark.parametrize("name", COLUMN_SUMS)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1024), (16, 1024), (16, 4096), (100, 1000)])
def test_a_small_call_sums_its_columns_in_few_tiles_a_block(name, rows, hidden):
    """A call of a few row groups has as few blocks and partial rows: each block sums at most
    twice the tiles its threads need, and a tile has no more lanes than the partial rows
    reach (8-column tiles gave 16 rows x 1024 32 tiles a block, each waiting on L2 and then
    on 32 lanes' sums)."""
    s, final = plan(name, rows, hidden)
    assert final.fused
    grid = finalize.fused_grid(s, Problem(hidden, rows, 16), H200)
    assert grid == ceil_div(rows, s.rows_per_block)
    tiles = ceil_div(ceil_div(hidden, final.cols_per_block), grid)
    assert tiles <= 2 * ceil_div(hidden, s.threads * grid), (final, grid)
    assert final.partial_lanes <= max(8, next_pow2(grid * s.partial_rows_per_block)), final


@pytest.mark.parametrize(("name", "hidden", "cols"), [
    ("rmsnorm_bwd", 1024, 8), ("gelu_bwd", 4096, 8), ("dropout_rmsnorm_bwd", 1024, 16)])
def test_a_fused_call_of_every_resident_block_keeps_narrow_tiles(name, hidden, cols):
    """From ROWS_SEEN rows the grid is every resident block, hundreds of partial rows: narrow
    tiles of many lanes, each lane one round of loads."""
    s, final = plan(name, 16384, hidden, Hints(fused_finalize=True))
    assert finalize.fused_grid(s, Problem(hidden, 1024, 16), H200) == (
        s.blocks_per_sm * H200.sm_count)
    assert final.cols_per_block == cols, final


def test_the_tile_model_counts_tiles_rounds_and_lanes():
    one = finalize.fused_tile_cycles(1024, 256, 1, 4, 4, 16)
    assert finalize.fused_tile_cycles(1024, 8, 32, 4, 4, 16) == 32 * (
        finalize.L2_ROUND_TRIP + 32 * finalize.LANE_ADD + finalize.TILE_BARRIERS)
    assert one == 4 * finalize.L2_ROUND_TRIP + finalize.LANE_ADD + finalize.TILE_BARRIERS
    # 33 rows a lane: two rounds of 16 and one row left, three round trips
    assert finalize.fused_tile_cycles(8, 8, 16, 1, 528, 16) == (
        3 * finalize.L2_ROUND_TRIP + 16 * finalize.LANE_ADD + finalize.TILE_BARRIERS)


@pytest.mark.parametrize(("name", "hidden", "then"), [("rmsnorm_bwd", 16384, "(3 stages)"),
                                                    ("dropout_rmsnorm_bwd", 32768, "re-read")])
def test_a_build_hinted_to_fuse_passes_over_rows_that_leave_no_room(name, hidden, then,
                                                                   tmp_path):
    """The first candidates fill the shared memory (their lanes' sums would not fit); the
    build passes them over for one that leaves room and fuses: rows in three stages of a
    smaller block (rmsnorm_bwd), or an input re-read (dropout_rmsnorm_bwd)."""
    hints = Hints(fused_finalize=True)
    with pytest.raises(HintError, match="leaves room for 0 of its 1 blocks per SM"):
        plan(name, 16384, hidden, hints)
    built = fuser.kernels.build(name, info_of(name), Problem(hidden, 1024, 16), H200, hints,
                                cache=KernelCache(str(tmp_path)))
    assert built.finalize.fused and then in built.schedule.reason, built.schedule
    assert built.schedule.smem.fits
    assert not built.compiled.resource(built.source.row_entry).spills


def test_the_signature_carries_every_output_the_partial_rows_and_the_counter(tmp_path):
    info = info_of("layernorm_bwd")
    built = fuser.kernels.build("layernorm_bwd", info, Problem(1024, 16, 16), H200,
                                cache=KernelCache(str(tmp_path)))
    assert built.finalize.fused and built.source.finalize_entry is None
    (row,) = built.source.signatures
    outputs = {p.index for p in row.params if p.source is Source.OUTPUT}
    assert outputs == set(range(len(info.fusion.outputs)))
    assert info.outputs(Role.COL)
    sources = [p.source for p in row.params]
    assert sources[-2:] == [Source.PARTIAL_ROWS, Source.ROW_TICKETS]
    assert [entry for entry, _ in built.plans()] == [row.entry]
    assert "fm::grid_barrier(g_grid_barrier);" in built.source.source
    assert "_finalize(" not in built.source.source


def test_the_hint_steers_the_rows_to_a_schedule_that_can_fuse():
    """layernorm_bwd at 8192 splits its rows over a cluster of 2 by default; asked to fuse,
    the row search keeps whole rows to a block."""
    default, _ = plan("layernorm_bwd", 16384, 8192)
    assert default.cluster == 2
    s, final = plan("layernorm_bwd", 16384, 8192, Hints(fused_finalize=True))
    assert final.fused and s.cluster == 1 and s.dealing is Dealing.STRIDED and not s.skew


@pytest.mark.parametrize(("kw", "says"), [
    ({"cluster": 2}, "its rows are split over clusters of 2 blocks"),
    ({"dealing": "dynamic"}, "its row groups are dealt dynamic, not by fixed strides"),
    ({"threads_per_row": 4, "rows_per_block": 3},
     "its 12 threads a block are not a multiple of 8 columns"),
])
def test_a_fused_finalize_the_rows_cannot_take_is_refused_naming_why(kw, says):
    with pytest.raises(HintError) as error:
        plan("rmsnorm_bwd", 16384, 4096, Hints(fused_finalize=True, **kw))
    message = str(error.value)
    assert message.startswith("Hints(fused_finalize=True): this row kernel cannot finalize "
                              "its own columns: "), message
    assert says in message and message.endswith("allowed here: fused_finalize=False")


def test_lanes_of_a_finalize_kernel_and_a_fused_finalize_are_refused_together():
    with pytest.raises(HintError, match="finalize_lanes shapes a finalize kernel of its own"):
        plan("rmsnorm_bwd", 16, 1024, Hints(fused_finalize=True, finalize_lanes=16))
    _, final = plan("rmsnorm_bwd", 16, 1024, Hints(finalize_lanes=16))
    assert not final.fused and final.partial_lanes == 16


@pytest.mark.parametrize("dtype", [BF16, DataType.Float])
@pytest.mark.parametrize("name", COLUMN_SUMS)
@pytest.mark.parametrize(("rows", "hidden", "hints"), [
    (16, 1024, None), (7, 4099, None), (300, 1000, None), (64, 24578, None),
    (16384, 8192, Hints(fused_finalize=True)), (16384, 2048, Hints(fused_finalize=True)),
])
def test_every_fused_kernel_compiles_without_spills(name, dtype, rows, hidden, hints,
                                                     tmp_path):
    built = fuser.kernels.build(name, info_of(name, dtype), Problem(hidden, min(rows, 1024), 16),
                                H200, hints, cache=KernelCache(str(tmp_path)))
    assert built.finalize.fused or built.schedule.cluster > 1
    for entry, _ in built.plans():
        assert not built.compiled.resource(entry).spills, (entry, built.schedule)


def test_rows_that_keep_nothing_in_shared_memory_still_declare_it_for_the_lanes_sums(
        tmp_path):
    """The lanes' sums are the plan's only buffers: the kernel declares the dynamic shared
    memory they live in (it once did only for the row passes' buffers, and failed to
    compile)."""
    hints = Hints(storage=(("T0", "registers"), ("T3", "registers"), ("T4", "registers")),
                  accumulators="registers", rows_per_block=1, fused_finalize=True)
    built = fuser.kernels.build("layernorm_bwd", info_of("layernorm_bwd"),
                                Problem(3, 16, 16), H200, hints,
                                cache=KernelCache(str(tmp_path)))
    assert built.finalize.fused
    assert all(b.name.startswith("s_lanes_") for b in built.schedule.smem.buffers)
    assert "extern __shared__" in built.source.source
    assert not built.compiled.resource(built.source.row_entry).spills


@pytest.mark.parametrize(("name", "hidden", "unroll"), [
    ("layernorm_bwd", 1, 1), ("layernorm_bwd", 100, 1), ("layernorm_bwd", 1024, 16),
    ("rmsnorm_bwd", 1024, 16), ("dropout_rmsnorm_bwd", 4099, 16)])
def test_a_fused_finalize_loads_rounds_of_rows_where_the_row_kernel_leaves_registers(
        name, hidden, unroll, tmp_path):
    """Rounds of 16 partial rows (their loads in flight together) where the row kernel's
    threads hold 64 registers or more; one row at a time beside small blocks packed many to
    an SM, whose rounds ptxas spilled (layernorm_bwd at hidden 1: ten rebuilds)."""
    built = fuser.kernels.build(name, info_of(name), Problem(hidden, 64, 16), H200,
                                cache=KernelCache(str(tmp_path)))
    s, final = built.schedule, built.finalize
    assert final.fused and final.unroll == unroll, final
    assert (H200.regs_per_sm // (s.blocks_per_sm * s.threads) >= 64) is (unroll > 1)
    assert "spilled" not in s.reason, s.reason
    assert ("float rows_" in built.source.source) is (unroll > 1)
