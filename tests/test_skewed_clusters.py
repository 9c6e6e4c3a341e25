"""CPU: skewed rows over a thread-block cluster, and columns kept in shared memory at the
skew of a block's rows (RowSchedule.columns_at_skew): what the search builds for the hints,
what it refuses, the grid that keeps each block's rows at one skew, and kernels that compile
unspilled for the H100."""

from __future__ import annotations

import types

import pytest

from fuser import DataType, explain
from fuser.analysis import analyze
from fuser.cli import shapes_of
from fuser.device import DeviceSpec
from fuser.errors import HintError
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints, Problem, schedule

H100 = DeviceSpec.get("h100")
LAYERNORM_SMEM = (("T0", "smem"), ("T1", "smem"), ("T2", "smem"))


def _schedule(name, hidden, hints, dtype=DataType.BFloat16, rows=16384):
    info = analyze(FUSIONS[name](dtype).fusion)
    return schedule(info, Problem(hidden, rows, 16), H100, Hints(**hints))


@pytest.mark.parametrize(("name", "hidden", "cluster"), [
    ("softmax_fwd", 65537, 2), ("rmsnorm_fwd", 65537, 2), ("layernorm_fwd", 65537, 2),
    ("layernorm_fwd", 98305, 4), ("rmsnorm_bwd", 65537, 4), ("layernorm_bwd", 65537, 4),
    ("dropout_rmsnorm_bwd", 65537, 4), ("softmax_bwd", 24578, 2)])
def test_skewed_rows_split_over_a_cluster_compile_unspilled(name, hidden, cluster, tmp_path):
    """Hinted skewed over a cluster: the tensor's own 16-byte vectors, split into the
    cluster's parts (the first edge in the first rank's, the last in the last rank's)."""
    from fuser.cache import KernelCache

    fd = FUSIONS[name](DataType.BFloat16)
    report = explain(fd, shapes_of(fd, 16384, hidden), None, device="h100",
                     hints=Hints(skewed=True, cluster=cluster), cache=KernelCache(tmp_path))
    s = report.schedule
    assert s.skew and s.cluster == cluster and s.vec == 8, s
    assert f"fm::RowPart<H, 8, {s.threads_per_row}, RPB, {s.batch}, {s.unroll}, {cluster}, " \
        f"{s.skew}>" in report.source
    assert not any(r.spills for r in report.resources.values()), report.resources


def test_columns_at_the_rows_skew_are_a_part_of_each_column():
    """One skewed row a block with its weight and bias in shared memory: each buffer holds
    the block's part of the column (at the rows' skew), not the whole padded column."""
    s = _schedule("layernorm_fwd", 65537, dict(skewed=True, cluster=2, storage=LAYERNORM_SMEM,
                                               stages=1))
    assert s.columns_at_skew and s.group_period == 8, s
    sizes = {b.name: b.nbytes for b in s.smem.buffers}
    assert sizes["s_T1"] == sizes["s_T2"] == 4097 * 8 * 2, sizes  # a part of 4097 vectors


def test_the_kernel_reads_columns_at_the_rows_skew(tmp_path):
    from fuser.cache import KernelCache

    fd = FUSIONS["layernorm_fwd"](DataType.BFloat16)
    report = explain(fd, shapes_of(fd, 16384, 24578), None, device="h100",
                     hints=Hints(skewed=True, storage=LAYERNORM_SMEM, stages=1),
                     cache=KernelCache(tmp_path))
    assert report.schedule.columns_at_skew
    assert "fm::ColumnAtSkew<__nv_bfloat16, Part> T1(part, s_T1, g_T1);" in report.source
    assert "SkewedColumn" not in report.source.split("extern \"C\"")[1]
    assert not any(r.spills for r in report.resources.values()), report.resources


def test_several_skewed_rows_a_block_read_columns_in_pieces():
    """Rows of a block have skews of their own: the whole padded column (SkewedColumn)."""
    s = _schedule("layernorm_fwd", 4099, dict(skewed=True, threads_per_row=64,
                                              rows_per_block=2, storage=LAYERNORM_SMEM))
    assert s.skew and not s.columns_at_skew, s
    assert {b.name: b.nbytes for b in s.smem.buffers}["s_T1"] > 4099 * 2


def test_a_clusters_skewed_rows_several_to_a_block_keep_no_columns_nor_their_sums():
    """Each row of such a block covers other columns of the block's part: its columns are
    re-read, and the backward's column sums need one row a block."""
    with pytest.raises(HintError, match=r"columns T1, T2 cannot stay in smem; give "
                                        r"rows_per_block=1"):
        _schedule("layernorm_fwd", 4099, dict(skewed=True, cluster=2, threads_per_row=64,
                                              rows_per_block=2, storage=LAYERNORM_SMEM))
    with pytest.raises(HintError, match=r"column sums T\d+, T\d+ cannot be combined"):
        _schedule("layernorm_bwd", 4099, dict(skewed=True, cluster=2, threads_per_row=64,
                                              rows_per_block=2))
    s = _schedule("layernorm_bwd", 4099, dict(skewed=True, cluster=2, rows_per_block=1))
    assert s.skew and s.cluster == 2 and s.rows_per_block == 1, s


def test_a_counter_does_not_deal_rows_whose_columns_sit_at_their_skew():
    """A counter would hand a block rows of any skew."""
    with pytest.raises(HintError, match="dealing=dynamic"):
        _schedule("layernorm_fwd", 24578, dict(skewed=True, storage=LAYERNORM_SMEM, stages=1,
                                               dealing="dynamic"))
    s = _schedule("layernorm_fwd", 24578, dict(skewed=True, stages=1, dealing="dynamic",
                                               storage=(("T0", "smem"), ("T1", "global"),
                                                        ("T2", "global"))))
    assert str(s.dealing) == "dynamic" and not s.columns_at_skew


@pytest.mark.parametrize(("resident", "rows", "clusters"), [
    (66, 16384, 64), (5, 16384, 8), (66, 40, 40)])
def test_the_grid_strides_over_whole_periods_of_skews(resident, rows, clusters):
    """65537 bf16 rows repeat their skews every 8 rows: 66 resident clusters stride by 64, 5
    take a second wave of 8, and 40 rows take a cluster each."""
    from fuser.loader import launch_sizes

    s = _schedule("layernorm_fwd", 65537, dict(skewed=True, cluster=2, storage=LAYERNORM_SMEM,
                                               stages=1), rows=rows)
    kernel = types.SimpleNamespace(schedule=s, resident_groups=resident, finalize=None)
    launch, _ = launch_sizes(kernel, rows, H100)
    assert launch.grid == clusters * 2, launch
