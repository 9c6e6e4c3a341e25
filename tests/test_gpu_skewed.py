"""GPU: skewed rows (RowSchedule.skew) against the float64 reference. Rows whose length the
widest vector does not divide start 1, 2 or 4 elements past a vector boundary, a different
one row to row; their first and last vectors hold the neighbouring rows' elements, which
must stay out of the reductions, the column sums and the stores. Every row storage, one and
two stages, each dealing, several rows a block, every place of the column sums over grids
of more rows than blocks, and the tensors' last row (its last vector reaches past the
tensor's end) are covered, in every dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_fusions import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    poisoned_outputs,
    run_and_validate,
    to_device,
)

import fuser.executor as executor
from fuser import DataType
from fuser.fusions import FUSIONS, make_inputs
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes
from fuser.schedulers import Hints

pytestmark = pytest.mark.gpu

SKEWED = ("softmax_fwd", "log_softmax_fwd", "softmax_bwd", "rmsnorm_fwd", "layernorm_fwd",
          "dropout_rmsnorm_fwd", "dropout_layernorm_fwd", "rmsnorm_bwd", "dropout_rmsnorm_bwd",
          "layernorm_bwd")
DTYPES = (DataType.BFloat16, DataType.Half, DataType.Float)
# Rows starting on 1-, 2- and 4-element boundaries: 8 x 1 element, 4 x 2, 2 x 4 (bf16).
HIDDEN = (37, 130, 4099, 24574, 24578, 24580)
STORAGES = {
    "registers": {"storage": (("T0", "registers"),)},
    "smem": {"storage": (("T0", "smem"),), "stages": 1},
    "smem2": {"storage": (("T0", "smem"),), "stages": 2},
    "global": {"storage": (("T0", "global"),)},
}


def _kernel(name, dtype, hidden, rows, rng, **hints):
    fd = run_and_validate(name, dtype, hidden, rows, rng, Hints(**hints))
    return fd._last_run.kernel.schedule


# Each dtype at each size its widest vector does not divide (24580: 4-element skews of bf16
# and fp16; fp32's 4-element vectors divide it).
SIZES = [(hidden, dtype) for hidden in HIDDEN for dtype in DTYPES
         if hidden % (16 // dtype.itemsize)]


@pytest.mark.parametrize("rows", [1, 7, 400])
@pytest.mark.parametrize(("hidden", "dtype"), SIZES, ids=[f"{h}-{d.name}" for h, d in SIZES])
@pytest.mark.parametrize("name", SKEWED)
def test_skewed_rows_match_reference(name, hidden, dtype, rows, rng):
    s = _kernel(name, dtype, hidden, rows, rng, skewed=True)
    widest = 16 // dtype.itemsize
    assert s.skew and s.vec == widest and hidden % s.vec, s


# softmax_bwd's two 24578 rows in registers spill (128 registers at 512 threads): refused.
STORED = [(name, hidden, where) for name in ("softmax_fwd", "softmax_bwd")
          for hidden in (130, 4099, 24578) for where in sorted(STORAGES)
          if (name, hidden, where) != ("softmax_bwd", 24578, "registers")]


@pytest.mark.parametrize(("name", "hidden", "where"), STORED)
def test_each_storage_of_skewed_rows_matches_reference(name, hidden, where, rng):
    hints = dict(STORAGES[where])
    if name == "softmax_bwd":  # both row inputs where T0 goes
        hints["storage"] = hints["storage"] + (("T1", hints["storage"][0][1]),)
    s = _kernel(name, DataType.BFloat16, hidden, 333, rng, skewed=True, **hints)
    assert s.skew, s


# fp32 24578 with the row and two padded columns in shared memory needs 295 KB: refused.
COLUMNS = [(hidden, dtype, where) for hidden in (130, 4099, 24578) for dtype in DTYPES
           for where in ("smem", "global")
           if (hidden, dtype, where) != (24578, DataType.Float, "smem")]


@pytest.mark.parametrize(("hidden", "dtype", "where"), COLUMNS,
                         ids=[f"{h}-{d.name}-{w}" for h, d, w in COLUMNS])
def test_columns_of_skewed_rows_match_reference(hidden, dtype, where, rng):
    """The weight and bias read in pieces at each row's skew: from a padded shared buffer, or
    from global memory."""
    s = _kernel("layernorm_fwd", dtype, hidden, 333, rng, skewed=True,
                storage=(("T0", "smem"), ("T1", where), ("T2", where)), stages=1)
    assert s.skew and s.placement("T1").storage == where, s


@pytest.mark.parametrize("rows", [3, 333])
def test_columns_of_skewed_rows_several_to_a_block_match_reference(rows, rng):
    """Two skewed rows a block, each its own skew: the weight and bias in shared memory are
    read in pieces from the whole padded column (SkewedColumn), not at one skew."""
    s = _kernel("layernorm_fwd", DataType.BFloat16, 4099, rows, rng, skewed=True,
                threads_per_row=64, rows_per_block=2,
                storage=(("T0", "smem"), ("T1", "smem"), ("T2", "smem")), stages=1)
    assert s.skew and s.rows_per_block == 2 and not s.columns_at_skew, s


# Skewed rows over a cluster: the first edge in the first rank's part, the last in the last
# rank's; columns in shared memory at the rows' skew (a block's part of each) or re-read in
# pieces; the column sums of the backward over more rows than resident clusters (the grid
# strides over whole periods of the skews) and fewer.
CLUSTERED = [(name, hidden, cluster, rows)
             for name in ("softmax_fwd", "rmsnorm_fwd", "layernorm_fwd", "softmax_bwd",
                          "rmsnorm_bwd", "dropout_rmsnorm_bwd", "layernorm_bwd")
             for hidden, cluster in ((4099, 2), (24578, 2), (65537, 2), (65537, 4))
             for rows in (7, 1001)
             if not (name in ("layernorm_bwd", "dropout_rmsnorm_bwd") and cluster == 2
                     and hidden == 65537)
             and not (name.endswith("_bwd") and name != "softmax_bwd" and hidden == 4099)]


@pytest.mark.parametrize(("name", "hidden", "cluster", "rows"), CLUSTERED,
                         ids=["-".join(map(str, case)) for case in CLUSTERED])
def test_skewed_rows_over_a_cluster_match_reference(name, hidden, cluster, rows, rng):
    fd = run_and_validate(name, DataType.BFloat16, hidden, rows, rng,
                          Hints(skewed=True, cluster=cluster))
    run = fd._last_run
    s = run.kernel.schedule
    assert s.skew and s.cluster == cluster, s
    clusters = run.launch.grid // cluster
    assert clusters == -(-rows // s.rows_per_block) or clusters % s.group_period == 0 or (
        not s.columns_at_skew and run.kernel.finalize is None), run.launch


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_column_sums_of_skewed_rows_over_a_cluster_match_reference(name, rng):
    """One row a block (each of a block's rows would cover other columns of its part)."""
    fd = run_and_validate(name, DataType.BFloat16, 4099, 1001, rng,
                          Hints(skewed=True, cluster=2, rows_per_block=1))
    s = fd._last_run.kernel.schedule
    assert s.skew and s.cluster == 2 and s.rows_per_block == 1, s


# The weight (and bias) of skewed rows in shared memory at the rows' skew, one row a block:
# without a cluster and over one, forward and backward, bf16, fp16 and fp32 (fp32 65537 in
# 16-byte vectors of 4 elements, skewed by 1; its row and columns fit a cluster of 4).
AT_SKEW_COLUMNS = {"layernorm_fwd": ("T1", "T2"), "rmsnorm_fwd": ("T1",), "rmsnorm_bwd": ("T3",)}
AT_SKEW = [(name, dtype, hidden, cluster)
           for name in AT_SKEW_COLUMNS for dtype in DTYPES
           for hidden, cluster in ((4099, 1), (24578, 1), (65537, 2), (65537, 4))
           if not (dtype is DataType.Float and (hidden == 24578 or cluster == 2))
           and not (name == "rmsnorm_bwd" and cluster == 2)]


@pytest.mark.parametrize(("name", "dtype", "hidden", "cluster"), AT_SKEW,
                         ids=[f"{n}-{d.name}-{h}-{c}" for n, d, h, c in AT_SKEW])
def test_columns_at_the_rows_skew_match_reference(name, dtype, hidden, cluster, rng):
    storage = (("T0", "smem"), *((c, "smem") for c in AT_SKEW_COLUMNS[name]))
    fd = run_and_validate(name, dtype, hidden, 1001, rng,
                          Hints(skewed=True, cluster=cluster, rows_per_block=1,
                                storage=storage))
    run = fd._last_run
    s = run.kernel.schedule
    assert s.skew and s.columns_at_skew and s.cluster == cluster, s
    clusters = run.launch.grid // cluster  # a cluster per row, or strides over whole periods
    assert clusters == 1001 or clusters % s.group_period == 0, run.launch


@pytest.mark.parametrize("dealing", ["strided", "dynamic", "grid"])
@pytest.mark.parametrize("hidden", [130, 24578])
def test_skewed_rows_dealt_each_way_match_reference(hidden, dealing, rng):
    s = _kernel("log_softmax_fwd", DataType.BFloat16, hidden, 5003, rng, skewed=True,
                dealing=dealing)
    assert s.skew and str(s.dealing) == dealing, s


@pytest.mark.parametrize("rows_per_block", [2, 4])
def test_skewed_rows_several_to_a_block_match_reference(rows_per_block, rng):
    s = _kernel("softmax_fwd", DataType.BFloat16, 130, 1001, rng, skewed=True,
                threads_per_row=16, rows_per_block=rows_per_block)
    assert s.skew and s.rows_per_block == rows_per_block, s


@pytest.mark.parametrize("hidden", [4099, 24578])
def test_rows_not_skewed_when_hinted_match_reference(hidden, rng):
    s = _kernel("softmax_fwd", DataType.BFloat16, hidden, 333, rng, skewed=False)
    assert not s.skew and hidden % s.vec == 0, s


@pytest.mark.parametrize("hidden", [4099, 24578])
@pytest.mark.parametrize("name", ["softmax_fwd", "log_softmax_fwd"])
def test_the_row_max_takes_only_the_rows_elements(name, hidden, rng):
    """Odd rows 200 above even ones: an edge whose neighbour's elements reached the row's max
    would subtract about 200 from an even row, and every exp of it would underflow (a sum of
    0, outputs of 0 or NaN), which the reference comparison catches."""
    host = make_inputs(name, 64, hidden, DataType.BFloat16, rng)
    x = host[0].astype(np.float32)
    x[1::2] += 200.0
    host[0] = x.astype(host[0].dtype)
    fd = FUSIONS[name](DataType.BFloat16)
    outs = executor.execute(fd, to_device(host), hints=Hints(skewed=True))
    assert fd._last_run.kernel.schedule.skew
    refs = evaluate(fd.fusion, host)
    compare([executor.to_host(o) for o in outs], refs, fd.fusion,
            output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("name", ["softmax_bwd", "layernorm_fwd"])
def test_skewed_rows_stay_inside_exact_allocations(name, rows, rng):
    """Inputs and outputs allocated at their exact sizes (no memory pool rounding them up):
    under compute-sanitizer's memcheck (make memcheck) a read or write past the tensor's last
    row, which the rows' last vector reaches, would be reported."""
    import cupy

    cupy.cuda.set_allocator(None)
    try:
        s = _kernel(name, DataType.BFloat16, 24578, rows, rng, skewed=True)
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    assert s.skew


# Column sums of skewed rows, in each storage, one and several rows a block (each row of a
# block has its own skew), over fewer row groups than resident blocks (3 rows; 5003 rows of
# 130) and over more (5003 rows of 4099 and 24578: the grid strides over whole periods of
# the skews, at 4099 with 2 rows a block over 4 groups of 8 rows).
SUMS = [(name, hidden, accumulators, rpb, rows)
        for name in ("rmsnorm_bwd", "layernorm_bwd")
        for hidden, rpb in ((130, 1), (130, 2), (130, 4), (4099, 1), (4099, 2), (24578, 1))
        for accumulators in ("registers", "smem", "global")
        for rows in (3, 5003)
        # layernorm_bwd's two sums of 24578 in registers spill at 512 threads: refused
        if (name, hidden, accumulators) != ("layernorm_bwd", 24578, "registers")]


@pytest.mark.parametrize(("name", "hidden", "accumulators", "rpb", "rows"), SUMS,
                         ids=["-".join(map(str, case)) for case in SUMS])
def test_column_sums_of_skewed_rows_match_reference(name, hidden, accumulators, rpb, rows,
                                                    rng):
    tpr = {130: 16, 4099: 64, 24578: 512}[hidden]
    fd = run_and_validate(name, DataType.BFloat16, hidden, rows, rng,
                          Hints(skewed=True, accumulators=accumulators, threads_per_row=tpr,
                                rows_per_block=rpb))
    run = fd._last_run
    s = run.kernel.schedule
    assert s.skew and s.rows_per_block == rpb and str(s.accumulators) == accumulators, s
    groups = -(-rows // rpb)
    assert run.launch.grid == groups or run.launch.grid % s.group_period == 0, run.launch

