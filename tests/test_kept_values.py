"""Element values kept in registers between passes over a row (analysis.kept_values,
RowSchedule.kept): which values are kept, when a schedule keeps them, that the kernel then
computes each once, and (GPU) that the results still match the float64 reference on every
path a hint can reach: rows in shared memory or registers, several rows per block, two
stages, rows split over a cluster."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_gpu_fusions import poisoned_outputs, to_device  # noqa: F401 (an autouse fixture)

from fuser import DataType, FusionDefinition
from fuser.analysis import analyze, kept_values
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.kernels import build
from fuser.schedulers import Hints, Problem

F32 = DataType.Float
H200 = DeviceSpec.get("h200")


def _row(fd, t, like):
    return fd.ops.broadcast_in_dim(t, shape=like.shape(), broadcast_dims=[0, 1])


def entropy_weighted(dtype: DataType = DataType.BFloat16) -> FusionDefinition:
    """p = softmax(x); h = sum(p * (x - max)); out = p * h: exp(x - max) is made by the
    second pass (the sum of exps) and needed by the third (h) and the fourth (the output)."""
    with FusionDefinition("entropy_weighted") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        shifted = fd.ops.sub(xf, _row(fd, fd.ops.max(xf, dims=[1], keepdim=True), x))
        e = fd.ops.exp(shifted)
        p = fd.ops.div(e, _row(fd, fd.ops.sum(e, dims=[1], keepdim=True), x))
        h = fd.ops.sum(fd.ops.mul(p, shifted), dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.mul(p, _row(fd, h, x)), dtype))
    return fd


def _ops(values) -> list[str]:
    return [v.definition.op for v in values]


def test_softmax_keeps_its_exp_and_other_ready_fusions_keep_nothing():
    kept = {name: _ops(kept_values(analyze(make().fusion)))
            for name, make in FUSIONS.items() if not name.startswith("batchnorm")}
    assert kept.pop("softmax_fwd") == ["exp"]
    # log_softmax's output pass needs x - max, not the exp; the others have no costly op
    # that two passes share.
    assert all(ops == [] for ops in kept.values()), kept


def test_a_value_two_later_passes_need_is_kept_once():
    info = analyze(entropy_weighted().fusion)
    assert len(info.inner_levels) == 3 and _ops(kept_values(info)) == ["exp"]


def test_a_costly_value_one_pass_uses_is_not_kept():
    """gelu's erf and log_softmax's exp are each computed in one pass only."""
    for name in ("gelu_fwd", "log_softmax_fwd"):
        assert kept_values(analyze(FUSIONS[name]().fusion)) == ()


def _built(fd, hidden, hints=None):
    return build(fd.name, analyze(fd.fusion), Problem(hidden, 16384, 16), H200, hints)


# 16384 by default deals its rows a block each at 256 threads, five blocks per SM, whose
# registers leave no room for kept values; at fixed strides it is one block of 512 threads
@pytest.mark.parametrize(("hidden", "hints"), [(1, None), (1000, None), (4096, None),
                                               (16384, Hints(dealing="strided"))])
def test_softmax_schedules_keep_the_exp_where_the_batch_loop_unrolls(hidden, hints):
    s = _built(FUSIONS["softmax_fwd"](), hidden, hints).schedule
    assert s.kept and s.full_unroll and s.unroll == s.batch, s
    assert "kept in registers" in s.reason


def test_kept_values_never_squeeze_the_planned_overhead():
    """At 32768 and fixed strides a row takes 1024 threads, so 64 registers each: the 32
    floats of the kept exps would leave less than the planned overhead (measured 2% slower),
    so none is kept."""
    s = _built(FUSIONS["softmax_fwd"](), 32768, Hints(dealing="strided")).schedule
    assert s.threads == 1024 and s.batch * s.vec == 32 and s.kept == (), s


def test_staged_rows_of_many_vectors_recompute_instead():
    """At 24578 a thread owns 13 vectors of a row in shared memory: its batch loop unrolls
    4 at a time, and register arrays would need it unrolled fully."""
    s = _built(FUSIONS["softmax_fwd"](), 24578).schedule
    assert s.kept == () and not s.full_unroll and s.batch > 4


def test_a_staging_ring_recomputes_instead():
    fd = FUSIONS["softmax_fwd"]()
    s = _built(fd, 65536, Hints(storage=(("T0", "ring"),), cluster=2)).schedule
    assert s.ring is not None and s.kept == ()


def test_kept_values_cost_registers_in_the_plan():
    """The arrays count in the registers a schedule is sized for: batch x vec floats."""
    fd = FUSIONS["softmax_fwd"]()
    s = _built(fd, 4096).schedule
    plain = _built(FUSIONS["log_softmax_fwd"](), 4096).schedule
    assert (s.batch, s.vec) == (plain.batch, plain.vec)
    assert s.regs_estimate - plain.regs_estimate == s.batch * s.vec


def test_the_kernel_exponentiates_once_per_element_over_three_later_passes():
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of

    fd = entropy_weighted()
    built = _built(fd, 4096)
    s = built.schedule
    assert s.kept
    source = built.source.source
    assert len(re.findall(r"kept_T\d+\[v\.b\]\[i\] = ", source)) == 1
    assert len(re.findall(r"fm::exp\(", source)) == 1
    start = (ptx := ptx_of(source, fd.name, 90, (str(template_dir()),))).index(
        f".entry {built.source.row_entry}(")
    assert len(re.findall(r"\bex2\.approx\.ftz\.f32\b", ptx[start:])) == s.batch * s.vec


# Hints that reach each path a kept value travels: rows in smem (one or two stages, several
# rows per block), rows in registers, rows split over a cluster.
KEPT_HINTS = {
    "default": None,
    "smem-1-stage": Hints(storage=(("T0", "smem"),), stages=1),
    "smem-2-stages": Hints(storage=(("T0", "smem"),), stages=2),
    "registers": Hints(storage=(("T0", "registers"),)),
    "4-rows": Hints(rows_per_block=4, threads_per_row=128),
    "cluster-2": Hints(cluster=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half, DataType.Float],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("hint", list(KEPT_HINTS))
@pytest.mark.parametrize("hidden", [7, 1000, 4096, 16384])
@pytest.mark.parametrize("make", [FUSIONS["softmax_fwd"], entropy_weighted],
                         ids=["softmax_fwd", "entropy_weighted"])
def test_kept_values_match_the_reference(make, hidden, hint, dtype, rng):
    """Each hinted path runs, with the exp kept where its batch loop unrolls fully and the
    registers allow (all of them by default), and matches the float64 reference; x spreads
    to +-10, so the kept exps span e^20."""
    from fuser.executor import execute, to_host
    from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes

    fd = make(dtype)
    host = [(3 * rng.standard_normal((37, hidden))).astype(np.float32).astype(dtype.numpy)]
    outputs = execute(fd, to_device(host), hints=KEPT_HINTS[hint])
    schedule = fd._last_run.kernel.schedule
    assert not schedule.kept or schedule.full_unroll, schedule
    # 16384 by default stages the row in smem at 512 threads, its batch loop unrolled in part
    if hint == "default" and hidden < 16384:
        assert schedule.kept, schedule
    refs = evaluate(fd.fusion, host)
    compare([to_host(o) for o in outputs], refs, fd.fusion,
            output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))
