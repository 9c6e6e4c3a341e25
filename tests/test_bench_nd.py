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
    shape = {4: ((3, 64, 5, 7), (64,), (64,)), 3: ((2, 6, 40), (2, 40), (2, 40)), 2: ((40, 24),)}
    case = nd.CASES[name]
    small = shape[len(case.shape[0])][:len(case.shape)]
    if name == "masked_softmax":
        small = ((2, 3, 6, 9), (6, 9))
    if name.startswith("mean_over") or name == "centered_over_sequence":
        small = ((2, 6, 40),)
    if name == "masked_mean_pooling":
        small = ((2, 6, 40), (2, 6, 1))
    if name.startswith("batchnorm_nchw_backward"):
        small = ((3, 64, 5, 7),) * 2 + ((64,),) * 3
    fd = nd.definition(name, DataType.Float)
    host = nd.host_inputs(name, DataType.Float, small)
    want = evaluate(fd.fusion, host)
    got = case.eager(*[torch.from_numpy(a) for a in host])
    assert len(got) == len(want) == len(fd.fusion.outputs)
    for g, w in zip(got, want, strict=True):
        assert tuple(g.shape) == w.shape
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-4)
    assert bool(nd.moves(fd)) == (name not in ONE_KERNEL), name


# the cases whose narrow inputs a kernel reads repeated (analysis.RowRun), or whose column
# sums (and a normalization by them) are per group of the leading axes (analysis.group_axes):
# nothing is moved
ONE_KERNEL = {"modulated_layernorm", "masked_softmax", "channel_scale", "channel_scale_7x7",
              "mean_over_sequence", "mean_over_many_sequences", "mean_over_short_sequences",
              "masked_mean_pooling", "centered_over_sequence", "bias_gradient"}


def test_nd_parse_args():
    assert nd.parse_args([]).case == list(nd.CASES)
    assert nd.parse_args(["--case", "masked_softmax", "--dtype", "fp16"]).dtype == "fp16"
    with pytest.raises(SystemExit):
        nd.parse_args(["--case", "softmax_dim7"])


def test_nd_breakdown_gives_the_fraction_its_kernels_alone_reach():
    """--breakdown: a call of 100 us whose kernels take 20 us at 0.1 of the copy reaches 0.5
    on its kernels' time alone (a host-bound call); the table says both."""
    assert nd.parse_args(["--breakdown"]).breakdown and not nd.parse_args([]).breakdown
    m = {"gbps": 100.0, "fraction_of_copy": 0.1, "time_us": 100.0,
         "kernels_us": {"k_s0_row": 12.0, "permute_runs_2x3_10_2": 8.0}}
    assert nd.kernels_fraction(m) == pytest.approx(0.5)
    assert nd.kernels_fraction({**m, "kernels_us": {"error": "no CUPTI"}}) is None
    assert nd.kernels_fraction({k: v for k, v in m.items() if k != "kernels_us"}) is None
    report = {"dtype": "bf16", "device": "H200", "results": [
        {"case": "batchnorm_nchw", "shape": "2x3", "impls": {
            "copy": {"gbps": 1000.0}, "fuser": m, "compile": {"skipped": "--no-compile"},
            "eager": {"gbps": 50.0, "fraction_of_copy": 0.05, "time_us": 200.0}}}]}
    assert "| batchnorm_nchw | 2x3 | 1000 | 100 (0.10) {kernels 0.50} | - | 50 (0.05) |" in (
        nd.markdown(report))


def test_nd_plot_draws_each_cases_fraction_of_the_copy(tmp_path):
    """bench/plot.py draws a report of named cases as bars (plot_cases, which nd.py writes
    beside its json), and picks that form by itself from the json."""
    pytest.importorskip("matplotlib")
    import json

    from bench import plot

    report = {"fusion": "nd", "dtype": "bf16", "device": "H100", "date": "2026-12-06T05:45",
              "results": [
                  {"case": "centered_over_sequence", "shape": "8x1024x4096", "impls": {
                      "copy": {"gbps": 2700.0, "fraction_of_copy": 1.0},
                      "fuser": {"gbps": 2175.0, "fraction_of_copy": 0.8},
                      "compile": {"skipped": "--no-compile"}}},
                  {"case": "channel_scale", "error": "OutOfMemoryError"}]}
    path = plot.plot_cases(report, tmp_path / "cases.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert plot.main([str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
