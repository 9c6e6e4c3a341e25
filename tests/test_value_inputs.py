"""Tensors of no dimension as inputs (a 0-d torch tensor such as a learned scale, or a full
reduction's result read by the next segment): each kernel reads the one element once, in its
prologue, as it takes a scalar input; its address does not narrow the vectors of the others."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fuser import DataType, FusionDefinition
from fuser.analysis import Kind, Role, analyze
from fuser.device import DeviceSpec
from fuser.kernels import build
from fuser.reference import evaluate, input_sensitivity
from fuser.schedulers import Problem

F32, BF16 = DataType.Float, DataType.BFloat16
H200 = DeviceSpec.get("h200")


def _scaled(kind: str) -> FusionDefinition:
    """y = x * (2 s) of a bf16 x and a 0-d fp32 s; with kind "norm" also the column sums of y
    divided by s (the finalize reads s) and the row sums of y * s (the row kernel does)."""
    with FusionDefinition(f"scaled_{kind}") as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        s = fd.define_tensor([], dtype=F32)
        y = fd.ops.mul(fd.ops.cast(x, F32), fd.ops.mul(s, 2.0))
        fd.add_output(fd.ops.cast(y, BF16))
        if kind == "norm":
            fd.add_output(fd.ops.div(fd.ops.sum(y, [0]), s))
            fd.add_output(fd.ops.sum(fd.ops.mul(y, s), [1]))
    return fd


@pytest.mark.parametrize("kind", ["pointwise", "norm"])
def test_a_0d_input_is_read_once_by_every_kernel(kind, tmp_path):
    from fuser.cache import KernelCache

    fd = _scaled(kind)
    info = analyze(fd.fusion)
    assert info.kind is (Kind.POINTWISE if kind == "pointwise" else Kind.INNER_OUTER)
    assert [t.name for t in info.value_inputs] == ["T1"] and info.roles[info.value_inputs[0]] \
        is Role.SCALAR
    built = build(fd.name, info, Problem(4096, 1024, 16), H200, cache=KernelCache(str(tmp_path)))
    reads = re.findall(r"const float T1 = fm::to_compute\(g_T1\[0\]\);", built.source.source)
    assert len(reads) == len(built.source.signatures)  # once in each kernel's prologue
    for entry, _plan in built.plans():
        assert not built.compiled.resource(entry).spills, entry


def test_the_oracle_takes_a_0d_input():
    fd = _scaled("norm")
    x = np.random.default_rng(4).standard_normal((7, 33)).astype(np.float32)
    s = np.array(0.5, np.float32)
    y, cols, rows = evaluate(fd.fusion, [x.astype(BF16.numpy), s])
    exact = x.astype(BF16.numpy).astype(np.float64) * 1.0
    np.testing.assert_allclose(cols, exact.sum(axis=0) / 0.5, rtol=1e-6)
    np.testing.assert_allclose(rows, (exact * 0.5).sum(axis=1), rtol=1e-6)
    assert y.shape == (7, 33) and rows.shape == (7,)
    spreads = input_sensitivity(fd.fusion, [x.astype(BF16.numpy), s], [y, cols, rows])
    assert [None if p is None else p.shape for p in spreads] == [None, (33,), (7,)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pointwise", "norm"])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (7, 1000), (1000, 4096), (64, 24578)])
def test_a_0d_input_matches_the_oracle_on_the_gpu(kind, rows, hidden):
    import cupy

    fd = _scaled(kind)
    x = np.random.default_rng(5).standard_normal((rows, hidden)).astype(BF16.numpy)
    scales = cupy.asarray(np.array([0.25, 3.0], np.float32))
    fd.validate([cupy.asarray(x), scales[1]])  # a 0-d view 4 bytes into its buffer
    vec = fd._last_run.kernel.schedule.vec
    fd.validate([cupy.asarray(x), cupy.asarray(np.float32(3.0))])
    assert fd._last_run.kernel.schedule.vec == vec  # the address did not narrow the vectors


@pytest.mark.gpu
def test_a_0d_torch_tensor_is_an_input():
    torch = pytest.importorskip("torch")
    fd = _scaled("pointwise")
    x = torch.randn(300, 4097, device="cuda").bfloat16()
    scale = torch.tensor(1.5, device="cuda")
    (y,) = fd.execute([x, scale])
    torch.testing.assert_close(y, (x.float() * 3.0).bfloat16())
