"""GPU: segmented fusions (fuser/segment.py) run as chains of kernels and match the float64
oracle of the whole fusion; fd.last_schedule() and fd.last_cuda_code() show every segment.
Normalizations along columns run as one outer-persistent kernel at these sizes (their
segments: test_gpu_outer.py); softmax over dim 0 matches torch's."""

from __future__ import annotations

import numpy as np
import pytest
from test_segment import CASES, OUTER_NORMS, _fd, _host_inputs

from fuser import DataType
from fuser.schedulers.base import OuterSchedule
from fuser.segment import SegmentSchedules

pytestmark = pytest.mark.gpu

SIZES = {2: [(300, 257), (7, 24578), (16384, 4096)], 3: [(4, 75, 257), (2, 1024, 4096)]}
SQUARE = [(257, 257), (4096, 4096)]  # sum_by_column, sum_along_columns: row sums as columns


def _sizes(name: str) -> list[tuple[int, ...]]:
    return SQUARE if name.startswith("sum_") else SIZES[len(CASES[name][2][0])]


def _inputs(name: str, dtype: DataType, shape: tuple[int, ...]) -> list:
    import cupy

    host = _host_inputs(name, dtype)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype.numpy)
    rest = [rng.standard_normal(shape[-1:]).astype(np.float32) if isinstance(a, np.ndarray)
            else float(np.prod(shape[:-1])) for a in host[1:]]
    return [cupy.asarray(x)] + [cupy.asarray(a) if isinstance(a, np.ndarray) else a
                                for a in rest]


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=lambda d: d.name)
@pytest.mark.parametrize(("name", "shape"), [(n, s) for n in CASES for s in _sizes(n)],
                         ids=str)
def test_segmented_fusion_matches_the_oracle(name, shape, dtype):
    fd = _fd(name, dtype)
    fd.validate(_inputs(name, dtype, shape))
    schedules = fd.last_schedule()
    if name in OUTER_NORMS:  # one kernel: these columns fit on chip
        assert isinstance(schedules, OuterSchedule)
        return
    assert isinstance(schedules, SegmentSchedules)
    assert len(schedules.segments) == CASES[name][1] == len(fd.last_smem_plan())
    assert fd.last_cuda_code().count("// ===== segment ") == CASES[name][1]


@pytest.mark.parametrize("shape", [(300, 257), (4096, 1000), (65536, 64)], ids=str)
def test_softmax_over_dim_0_matches_torch(shape, has_torch_cuda):
    if not has_torch_cuda:
        pytest.skip("needs torch with CUDA")
    import torch

    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    (got,) = _fd("softmax_dim0", DataType.BFloat16).execute([x])
    expected = torch.softmax(x.double(), dim=0)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, rtol=1.6e-2, atol=1e-4)
