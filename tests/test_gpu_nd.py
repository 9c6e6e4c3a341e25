"""GPU: fusions over [batch, seq, hidden] tensors against the float64 reference (issue 15),
with [batch, seq, 1] and [batch, seq] per-row statistics, at odd and large 3-D shapes."""

from __future__ import annotations

import numpy as np
import pytest
from test_nd import rmsnorm_3d, rmsnorm_bwd_3d

from fuser import DataType

pytestmark = pytest.mark.gpu

SHAPES = [(3, 7, 24578), (8, 1024, 4096), (1, 1, 1000), (2, 5, 65537)]


def _device(a: np.ndarray):
    import cupy

    return cupy.asarray(a)


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_3d_rmsnorm_forward_matches_reference(shape, dtype, rng):
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    w = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32).astype(dtype.numpy)
    fd = rmsnorm_3d(dtype)
    y, rstd = fd.validate([_device(x), _device(w)])
    assert tuple(y.shape) == shape and tuple(rstd.shape) == (*shape[:2], 1)


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_3d_rmsnorm_backward_matches_reference(shape, dtype, rng):
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=2) + 1e-6).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    w = (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32).astype(dtype.numpy)
    dx, dw = rmsnorm_bwd_3d(dtype).validate([_device(a) for a in (x, rms, dy, w)])
    assert tuple(dx.shape) == shape and tuple(dw.shape) == (shape[-1],)


SMALL_ND = {"batchnorm_nchw": [(4, 8, 5, 7), (8,), (8,)],
            "group_norm_affine": [(2, 64, 3, 5), (64,), (64,)],
            "mean_over_sequence": [(3, 50, 72)]}


@pytest.mark.parametrize("name", list(SMALL_ND))
def test_segmented_calls_after_the_first_match_the_reference(name):
    """bench/nd.py's segmented fusions called again with the same shapes: the later calls
    walk the steps the first one recorded (executor._segment_step), also where the first
    input sits 2 bytes past an aligned address (a segment that reads it then takes the full
    path)."""
    from bench import nd

    fd = nd.definition(name, DataType.BFloat16)
    for seed in range(3):
        host = nd.host_inputs(name, DataType.BFloat16, SMALL_ND[name], seed)
        fd.validate([_device(a) for a in host])
    host = nd.host_inputs(name, DataType.BFloat16, SMALL_ND[name], 3)
    padded = _device(np.concatenate([host[0].ravel()[:1], host[0].ravel()]))
    shifted = padded[1:].reshape(host[0].shape)
    assert shifted.data.ptr % 4 == 2
    fd.validate([shifted, *[_device(a) for a in host[1:]]])
