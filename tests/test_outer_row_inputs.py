"""Per-row inputs ([rows, 1], or [batch, seq, 1] beside reductions over the sequence) in the
outer-persistent kernel: a thread reads row r's value in each pass that uses it, its pointer
moved to the group's rows. Offline: the kernel they get and its source; marked gpu: against
the float64 oracle at odd shapes, kept and streamed, with and without groups."""

from __future__ import annotations

import numpy as np
import pytest

from fuser import DataType, FusionDefinition
from fuser.explain import explain
from fuser.schedulers.base import OuterSchedule

BF16, F = DataType.BFloat16, DataType.Float


def weighted(rank: int, normalize: bool, dtype: DataType = BF16) -> FusionDefinition:
    """x [.., rows, hidden] and w [.., rows, 1] (float): the sum over the rows of x * w
    (streamed), or (normalize) x minus its mean over the rows, divided by w, and that mean
    (an outer normalization, the rows kept)."""
    with FusionDefinition(f"weighted_{rank}d{'_norm' if normalize else ''}") as fd:
        x = fd.define_tensor([-1] * rank, dtype=dtype)
        w = fd.define_tensor([-1] * (rank - 1) + [1], dtype=F)
        xf = fd.ops.cast(x, F)
        wide = fd.ops.broadcast_in_dim(w, shape=x.shape(), broadcast_dims=list(range(rank)))
        axis = rank - 2
        if normalize:
            mean = fd.ops.div(fd.ops.sum(xf, [axis], keepdim=True), x.size(axis))
            fd.add_output(fd.ops.cast(fd.ops.div(fd.ops.sub(xf, mean), wide), dtype))
            fd.add_output(mean)
        else:
            fd.add_output(fd.ops.sum(fd.ops.mul(xf, wide), [axis]))
    return fd


@pytest.mark.parametrize(("rank", "normalize"), [(2, False), (3, False), (2, True), (3, True)])
def test_per_row_inputs_are_read_in_the_column_kernel(rank, normalize):
    shape = (16384, 4096) if rank == 2 else (8, 1024, 4096)
    fd = weighted(rank, normalize)
    e = explain(fd, [shape, (*shape[:-1], 1)], device="h100")
    assert isinstance(e.schedule, OuterSchedule) and e.schedule.streamed is not normalize
    source = e.source
    # read in the one pass that uses it: the sum's, or the outputs' (not the mean's), whose
    # rows held in registers (2-D: x's first rows of each thread) are a loop of their own
    loops = 2 if e.schedule.held_rows else 1
    assert source.count("const float row_T1 = slab.row_value<float>(g_T1, r);") == loops
    assert ("g_T1 += group * n_rows;" in source) is (rank == 3)
    assert not any(r.spills for r in e.resources.values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(1, 8), (1001, 257), (16384, 4096), (5, 9, 4099),
                                   (8, 1024, 4096), (3000, 8, 24)], ids=str)
@pytest.mark.parametrize("normalize", [False, True], ids=["sum", "normalized"])
def test_gpu_per_row_inputs_match_the_oracle(normalize, shape, dtype):
    import cupy

    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    w = rng.uniform(0.5, 2.0, (*shape[:-1], 1)).astype(np.float32)
    fd = weighted(len(shape), normalize, dtype)
    fd.validate([cupy.asarray(x), cupy.asarray(w)])
    # a sum over groups of fewer than 64 rows (5 x 9) takes the row kernel and its finalize
    if shape[-1] >= 1000 and (normalize or shape[-2] >= 64):
        assert isinstance(fd.last_schedule(), OuterSchedule)
