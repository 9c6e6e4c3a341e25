"""GPU: the outer-persistent kernel (normalization along columns in one kernel) against the
float64 reference: every cluster size a hint allows, row counts that leave blocks of a
cluster short or empty, 3-D inputs, columns too tall for any cluster (run as segments), and
the same bits from run to run."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_fusions import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    poisoned_outputs,
    run_and_validate,
)
from test_outer_persistent import column_shares
from test_segment import _fd, _host_inputs

from fuser import DataType
from fuser.executor import execute, to_host
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes
from fuser.schedulers import Hints
from fuser.schedulers.base import OuterSchedule
from fuser.segment import SegmentSchedules

pytestmark = pytest.mark.gpu

BF16, F = DataType.BFloat16, DataType.Float


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 8), (9, 1000), (1001, 257), (4096, 4096)],
                         ids=str)
@pytest.mark.parametrize("name", ["batchnorm_fwd", "batchnorm_bwd"])
def test_every_cluster_size_matches_the_reference(name, rows, hidden, cluster, rng):
    fd = run_and_validate(name, BF16, hidden, rows, rng, hints=Hints(cluster=cluster))
    schedule = fd.last_schedule()
    assert isinstance(schedule, OuterSchedule) and schedule.cluster == cluster


@pytest.mark.parametrize("dtype", [F, DataType.Half, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize(("rows", "hidden"), [(3, 5), (16384, 1024), (1024, 16384), (30000, 24)],
                         ids=str)
@pytest.mark.parametrize("name", ["batchnorm_fwd", "batchnorm_bwd", "softmax_dim0_fwd"])
def test_heuristic_schedules_match_the_reference(name, rows, hidden, dtype, rng):
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    assert isinstance(fd.last_schedule(), OuterSchedule)


@pytest.mark.parametrize(("name", "dtype", "rows", "hidden", "held"), [
    ("batchnorm_bwd", BF16, 16384, 1000, 7), ("batchnorm_bwd", DataType.Half, 13000, 520, 3),
    ("batchnorm_bwd", F, 16384, 1000, 6), ("batchnorm_bwd", F, 16000, 1023, 21)], ids=str)
def test_rows_held_in_registers_match_the_reference(name, dtype, rows, hidden, held, rng):
    """Schedules that hold each thread's first rows of one input in registers (the rest in
    shared memory): fewer rows than built for (13000 of 14336; 16000 of 16384), a last slab
    of 8 columns (520), one-element vectors (1023). Each at most 2^24 elements, validated in
    full (test_gpu_fusions.validate_tiled refuses normalizations along columns)."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    assert fd.last_schedule().held_rows == held


def _device_inputs(name: str, dtype: DataType, shape: tuple[int, ...], seed: int) -> list:
    import cupy

    host = _host_inputs(name, dtype)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    rest = [rng.standard_normal(shape[-1:]).astype(np.float32) if isinstance(a, np.ndarray)
            else float(np.prod(shape[:-1])) for a in host[1:]]
    return [cupy.asarray(x)] + [cupy.asarray(a) if isinstance(a, np.ndarray) else a
                                for a in rest]


@pytest.mark.parametrize(("name", "shape"), [("softmax_dim0", (3001, 67)),
                                             ("batch_norm", (5000, 520)),
                                             ("centered_3d", (3, 700, 1000))], ids=str)
def test_user_fusions_along_columns_match_the_oracle(name, shape):
    fd = _fd(name, BF16)
    fd.validate(_device_inputs(name, BF16, shape, 5))
    assert isinstance(fd.last_schedule(), OuterSchedule)


@pytest.mark.parametrize("dtype", [DataType.Double, F, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(7, 1), (1000, 4099), (4096, 24578)], ids=str)
def test_elements_divided_by_a_column_value_match_the_oracle(shape, dtype):
    """Each element's share of its column's sum, x / sum(x, dim 0), and (x - 1) / the
    column's largest magnitude: the kernel multiplies by each column's reciprocal, computed
    once per column (in the division's compute type: double for Double inputs)."""
    import cupy

    fd = column_shares(dtype)
    rng = np.random.default_rng(9)
    x = rng.uniform(0.5, 2.0, shape).astype(dtype.numpy)
    fd.validate([cupy.asarray(x)])
    assert isinstance(fd.last_schedule(), OuterSchedule)


def test_columns_too_tall_for_a_cluster_run_as_segments():
    """2**18 rows of 64 bf16 columns: 256 KiB per block of a cluster of 16 even 8 columns
    wide, over the 227 KiB a block may have, so the three sweeps of the segments run."""
    fd = _fd("batch_norm", BF16)
    fd.validate(_device_inputs("batch_norm", BF16, (2**18, 64), 6))
    schedules = fd.last_schedule()
    assert isinstance(schedules, SegmentSchedules) and len(schedules.segments) == 3


def test_the_same_bits_from_run_to_run():
    """Column totals are folded over a block's rows, then the cluster's blocks in rank order:
    no atomics, so every run gives the same bits."""
    fd = _fd("batch_norm", BF16)
    inputs = _device_inputs("batch_norm", BF16, (16384, 1024), 7)
    first = [to_host(o) for o in fd.execute(inputs)]
    for _ in range(3):
        again = [to_host(o) for o in fd.execute(inputs)]
        for a, b in zip(first, again, strict=True):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize(("count", "rows", "kind"), [
    (16, 4096, OuterSchedule), (16, 16384, OuterSchedule), (32, 4096, SegmentSchedules)])
def test_kernels_rebuilt_after_spills_and_the_segments_match_the_oracle(count, rows, kind):
    """16 column sums: over 4096 rows rebuilt for one block per SM (255 registers), over
    16384 built at the next ORDER entry (256 threads for 512); 32: spilling in every
    schedule, so the segments run (test_outer_persistent has the offline half)."""
    import cupy
    from test_outer_persistent import _many_column_sums

    fd = _many_column_sums(count)
    x = np.random.default_rng(8).standard_normal((rows, 256)).astype(np.float32)
    fd.validate([cupy.asarray((0.1 * x).astype(BF16.numpy))])
    assert isinstance(fd.last_schedule(), kind)


def _online_columns(dtype: DataType, shape: tuple[int, int], seed: int) -> np.ndarray:
    """x for a max folded online with its sum of exponentials (outer_folds): normal columns,
    then columns whose max grows every row (each row rescales the running sum), a column of
    -inf, a column holding one +inf, one NaN, one -inf among finite values, and values of
    +-80 (exp(x - max) under float's smallest normal)."""
    rng = np.random.default_rng(seed)
    rows, cols = shape
    x = rng.standard_normal(shape).astype(np.float32)
    special = [np.linspace(-30, 30, rows), np.full(rows, -np.inf), x[:, 0].copy(),
               x[:, 0].copy(), x[:, 0].copy(), np.where(np.arange(rows) % 2, 80.0, -80.0)]
    special[2][rows // 2] = np.inf
    special[3][rows // 3] = np.nan
    special[4][rows - 1] = -np.inf
    for k, column in enumerate(special[:cols]):
        x[:, cols - 1 - k] = column
    return x.astype(dtype.numpy)


def _online_fusion(kind: str, dtype: DataType):
    """Softmax, log-softmax or logsumexp over the rows (dim 0), as a user writes them."""
    from fuser import FusionDefinition

    with FusionDefinition(f"{kind}_dim0") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        xf = fd.ops.cast(x, F)
        m = fd.ops.max(xf, [0], keepdim=True)
        shifted = fd.ops.sub(xf, m)
        s = fd.ops.sum(fd.ops.exp(shifted), [0], keepdim=True)
        if kind == "softmax":
            out = fd.ops.div(fd.ops.exp(shifted), s)
        elif kind == "log_softmax":
            out = fd.ops.sub(shifted, fd.ops.log(s))
        else:
            out = fd.ops.add(fd.ops.log(s), m)
        fd.add_output(fd.ops.cast(out, dtype) if kind != "logsumexp" else out)
    return fd


@pytest.mark.parametrize("dtype", [F, DataType.Half, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "cluster"), [((5, 7), None), ((3001, 67), None),
                                                ((3001, 67), 4), ((16384, 1024), None),
                                                ((4096, 4104), 16)], ids=str)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "logsumexp"])
def test_a_max_and_its_sum_of_exponentials_folded_online_match_the_oracle(kind, shape,
                                                                           cluster, dtype):
    """One level folds each column's running max and its rescaled sum of exp(x - max)
    (fm::OnlineSum): the float64 reference's values, inf and NaN where it has them, over one
    block and clusters."""
    import cupy

    fd = _online_fusion(kind, dtype)
    x = cupy.asarray(_online_columns(dtype, shape, 11))
    if cluster is None:
        fd.validate([x])
    else:
        host = [cupy.asnumpy(x)]
        outs = execute(fd, [x], hints=Hints(cluster=cluster))
        refs = evaluate(fd.fusion, host)
        compare([to_host(o) for o in outs], refs, fd.fusion,
                output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))
    schedule = fd.last_schedule()
    assert isinstance(schedule, OuterSchedule), schedule
    assert "online (one pass and one fold for both)" in schedule.reason, schedule.reason
