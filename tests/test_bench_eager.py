"""bench/baselines.eager(): PyTorch's own ops for each fusion give the fusion's outputs, in its
order, dtypes and shapes, against the float64 oracle: on the CPU where torch's CPU ops do what
its CUDA ops do (CPU_CASES), on the GPU for every fusion."""

from __future__ import annotations

import numpy as np
import pytest

from bench import baselines
from fuser import DataType
from fuser.fusions import FUSIONS, make_inputs
from fuser.reference import evaluate

torch = pytest.importorskip("torch")

# Cases whose ops differ on torch's CPU: the RMSNorm backward op has no CPU kernel, and the CPU
# LayerNorm and BatchNorm keep a bf16 input's statistics in bf16 (CUDA's, and the fusion's, are
# fp32; CUDA's BatchNorm backward takes them so).
CPU_CASES = [(name, dtype) for name in FUSIONS for dtype in (DataType.BFloat16, DataType.Float)
             if name not in ("rmsnorm_bwd", "dropout_rmsnorm_bwd")
             and not (("layernorm" in name or "batchnorm" in name)
                      and dtype is DataType.BFloat16)]


def _torch_dtype(numpy_name: str):
    return getattr(torch, numpy_name)  # float32, bfloat16, bool, ... name the same in both


def _check(name: str, dtype: DataType, device: str, rng) -> None:
    inputs = make_inputs(name, 64, 96, dtype, rng)
    fusion = FUSIONS[name](dtype).fusion
    refs = evaluate(fusion, inputs)
    tensors = [torch.from_numpy(a.astype(np.float32))
               .to(device=device, dtype=_torch_dtype(a.dtype.name)) for a in inputs]
    outs = baselines.eager(name, tensors)()
    assert len(outs) == len(refs) == len(fusion.outputs)
    for i, (o, r, v) in enumerate(zip(outs, refs, fusion.outputs, strict=True)):
        assert o.dtype is _torch_dtype(v.dtype.numpy.name), (name, i, o.dtype)
        assert tuple(o.shape) == r.shape, (name, i)
        got = o.float().cpu().numpy().astype(np.float64)
        ref = np.asarray(r, np.float64)
        assert np.max(np.abs(got - ref)) <= 2e-2 * np.max(np.abs(ref)), (name, i)


@pytest.mark.parametrize(("name", "dtype"), CPU_CASES, ids=str)
def test_eager_baselines_match_the_oracle_on_the_cpu(name, dtype, rng):
    _check(name, dtype, "cpu", rng)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float])
@pytest.mark.parametrize("name", list(FUSIONS))
def test_eager_baselines_match_the_oracle_on_the_gpu(name, dtype, rng):
    _check(name, dtype, "cuda", rng)


def test_every_fusion_has_both_baselines():
    """A FORMULAS entry and an eager() function, made here on the CPU also where the ops they
    call are CUDA-only (made, not run)."""
    assert set(FUSIONS) <= set(baselines.FORMULAS)
    for name in FUSIONS:
        inputs = [torch.from_numpy(a.astype(np.float32))
                  for a in make_inputs(name, 4, 8, DataType.Float, np.random.default_rng(0))]
        assert callable(baselines.eager(name, inputs)), name
    with pytest.raises(KeyError, match="no eager baseline for fusion 'nope'"):
        baselines.eager("nope", [])
