"""bench/nd.py on the CPU: each case's PyTorch baseline (torch on the CPU) against fuser's
float64 oracle at small shapes, the moves fuser makes for it, and the arguments."""

from __future__ import annotations

import numpy as np
import pytest

from bench import nd
from fuser import DataType
from fuser.reference import evaluate


@pytest.mark.parametrize("name", list(nd.CASES))
def test_nd_eager_baselines_match_the_oracle(name):
    """Each case's PyTorch baseline (on the CPU here) against fuser's float64 oracle, at small
    shapes; and the moves fuser makes between kernels: none where it reads the inputs that
    span some row axes repeated (one kernel), some where it moves axes."""
    torch = pytest.importorskip("torch")
    shape = {4: ((3, 64, 5, 7), (64,), (64,)), 3: ((2, 6, 40), (2, 40), (2, 40))}
    case = nd.CASES[name]
    small = shape[len(case.shape[0])][:len(case.shape)]
    if name == "masked_softmax":
        small = ((2, 3, 6, 9), (6, 9))
    if name == "mean_over_sequence":
        small = ((2, 6, 40),)
    fd = nd.definition(name, DataType.Float)
    host = nd.host_inputs(name, DataType.Float, small)
    want = evaluate(fd.fusion, host)
    got = case.eager(*[torch.from_numpy(a) for a in host])
    assert len(got) == len(want) == len(fd.fusion.outputs)
    for g, w in zip(got, want, strict=True):
        assert tuple(g.shape) == w.shape
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-4)
    assert bool(nd.moves(fd)) == (name not in ONE_KERNEL), name


# the cases whose narrow inputs a kernel reads repeated (analysis.RowRun): nothing is moved
ONE_KERNEL = {"modulated_layernorm", "masked_softmax", "channel_scale"}


def test_nd_parse_args():
    assert nd.parse_args([]).case == list(nd.CASES)
    assert nd.parse_args(["--case", "masked_softmax", "--dtype", "fp16"]).dtype == "fp16"
    with pytest.raises(SystemExit):
        nd.parse_args(["--case", "softmax_dim7"])
