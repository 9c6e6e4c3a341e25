"""Random fusions, drawn by Hypothesis from the op table: on the CPU every one classifies,
schedules, renders and compiles for sm_90 with zero spills; on the GPU every one matches the
float64 reference. Each draw is a chain of elementwise ops on a [rows, hidden] input, a
column input and a row input, with optional row reductions (sum or max, broadcast back) and
an optional column sum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser import DataType, FusionDefinition
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.kernels import build
from fuser.schedulers import Problem

UNARY = ["neg", "abs", "relu", "sigmoid", "tanh", "silu", "exp_small"]
BINARY = ["add", "sub", "mul", "maximum", "minimum", "div_safe", "where_gt"]
STORAGE = [DataType.Float, DataType.Half, DataType.BFloat16]


@st.composite
def fusion_plans(draw):
    """A plan: storage dtype, a list of steps, whether to end with a column sum."""
    steps = draw(st.lists(
        st.one_of(
            st.tuples(st.just("unary"), st.sampled_from(UNARY)),
            st.tuples(st.just("binary"), st.sampled_from(BINARY),
                      st.sampled_from(["x", "w", "r", "prev"])),
            st.tuples(st.just("reduce"), st.sampled_from(["sum", "max"])),
        ),
        min_size=1, max_size=8,
    ))
    return draw(st.sampled_from(STORAGE)), steps, draw(st.booleans())


def make_fusion(plan) -> FusionDefinition:
    dtype, steps, column_sum = plan
    F32 = DataType.Float
    with FusionDefinition("fuzz") as fd:
        x_in = fd.define_tensor([-1, -1], dtype=dtype)
        w_in = fd.define_tensor([-1], dtype=dtype)
        r_in = fd.define_tensor([-1, 1], contiguity=[True, None], dtype=F32)
        x = fd.ops.cast(x_in, F32)
        operands = {
            "x": x,
            "w": fd.ops.broadcast_in_dim(fd.ops.cast(w_in, F32), shape=x_in.shape(),
                                         broadcast_dims=[1]),
            "r": fd.ops.broadcast_in_dim(r_in, shape=x_in.shape(), broadcast_dims=[0, 1]),
        }
        value, previous = x, x
        for step in steps:
            current = value
            if step[0] == "unary":
                op = step[1]
                value = (fd.ops.exp(fd.ops.mul(value, 0.25)) if op == "exp_small"
                         else getattr(fd.ops, op)(value))
            elif step[0] == "binary":
                op, other = step[1], operands.get(step[2], previous)
                if op == "div_safe":  # keep the divisor away from zero
                    value = fd.ops.div(value, fd.ops.add(fd.ops.abs(other), 1.0))
                elif op == "where_gt":
                    value = fd.ops.where(fd.ops.gt(value, other), value, other)
                else:
                    value = getattr(fd.ops, op)(value, other)
            else:
                reduced = getattr(fd.ops, step[1])(value, dims=[1], keepdim=True)
                if step[1] == "sum":
                    reduced = fd.ops.div(reduced, x_in.size(1))
                value = fd.ops.sub(value, fd.ops.broadcast_in_dim(
                    reduced, shape=x_in.shape(), broadcast_dims=[0, 1]))
            previous = current
        fd.add_output(fd.ops.cast(value, dtype))
        if column_sum:
            fd.add_output(fd.ops.sum(value, dims=[0]))
    return fd


FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(plan=fusion_plans(), hidden=st.sampled_from([1, 3, 100, 1024, 4096, 24578]))
def test_random_fusions_schedule_and_compile_clean(plan, hidden):
    fd = make_fusion(plan)
    info = analyze(fd.fusion)
    built = build(fd.name, info, Problem(hidden, 1000, 16), DeviceSpec.get("h200"))
    for entry, plan_ in built.plans():
        r = built.compiled.resource(entry)
        assert not r.spills, f"{entry} spills: {r}\n{fd!r}"
        assert r.static_smem <= plan_.static_slot
        assert plan_.total <= plan_.limit


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(plan=fusion_plans(), hidden=st.sampled_from([1, 3, 100, 1024, 4096, 24578]),
       rows=st.sampled_from([1, 7, 300]))
def test_random_fusions_match_reference(plan, hidden, rows):
    import cupy

    fd = make_fusion(plan)
    rng = np.random.default_rng(hidden * 1000 + rows)
    dtype = plan[0].numpy
    host = [rng.standard_normal((rows, hidden)).astype(np.float32).astype(dtype),
            rng.standard_normal(hidden).astype(np.float32).astype(dtype),
            rng.standard_normal((rows, 1)).astype(np.float32)]
    fd.validate([cupy.asarray(a) for a in host])
