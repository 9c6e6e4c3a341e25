"""CPU: fusions over N-D tensors run as rows over their flattened leading dimensions.

[batch, seq, hidden] inputs, [hidden] weights and [batch, seq, 1] or [batch, seq] per-row
statistics, as users write them: classified, scheduled and rendered as the [batch * seq,
hidden] form is (the same schedule), the float64 oracle agrees with the 2-D form, and what
N-D rows cannot run is refused with a message that says why."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fuser import DataType, FusionDefinition, UnsupportedFusionError
from fuser.analysis import Kind, analyze
from fuser.device import PRESETS
from fuser.fusions import FUSIONS
from fuser.reference import evaluate
from fuser.schedulers import Problem, schedule

F32, BF16 = DataType.Float, DataType.BFloat16
H200 = PRESETS["h200"]


def rmsnorm_3d(dtype: DataType = BF16, eps: float = 1e-6) -> FusionDefinition:
    """x [B, S, H], weight [H] -> y [B, S, H], rstd [B, S, 1]."""
    with FusionDefinition("rmsnorm_3d") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        xf = fd.ops.cast(x, F32)
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), dims=[2], keepdim=True), x.size(2))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, eps))
        y = fd.ops.mul(fd.ops.mul(xf, fd.ops.broadcast_in_dim(rstd, x.shape(), [0, 1, 2])),
                       fd.ops.broadcast_in_dim(fd.ops.cast(w, F32), x.shape(), [2]))
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(rstd)
    return fd


def rmsnorm_bwd_3d(dtype: DataType = BF16) -> FusionDefinition:
    """x [B, S, H], rms [B, S] (no keepdim), dy [B, S, H], w [H] -> dx, dw."""
    with FusionDefinition("rmsnorm_bwd_3d") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=dtype)
        rms = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=F32)
        dy = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        inv = fd.ops.reciprocal(fd.ops.broadcast_in_dim(rms, x.shape(), [0, 1]))
        xhat = fd.ops.mul(fd.ops.cast(x, F32), inv)
        wdy = fd.ops.mul(fd.ops.cast(dy, F32), fd.ops.broadcast_in_dim(fd.ops.cast(w, F32),
                                                                        x.shape(), [2]))
        c = fd.ops.div(fd.ops.sum(fd.ops.mul(wdy, xhat), dims=[2], keepdim=True), x.size(2))
        dx = fd.ops.mul(fd.ops.sub(wdy, fd.ops.mul(xhat, fd.ops.broadcast_in_dim(
            c, x.shape(), [0, 1, 2]))), inv)
        fd.add_output(fd.ops.cast(dx, dtype))
        fd.add_output(fd.ops.cast(fd.ops.sum(fd.ops.mul(fd.ops.cast(dy, F32), xhat),
                                             dims=[0, 1]), dtype))
    return fd


def _compact(s) -> tuple:
    return (s.scheduler, s.vec, s.threads_per_row, s.rows_per_block, s.batch, s.cluster,
            s.stages, s.aligned_copy, tuple((p.storage, p.async_copy) for p in s.placements),
            s.accumulators, s.smem.total)


@pytest.mark.parametrize("hidden", [1, 1000, 4096, 24578, 65537])
def test_3d_rows_get_the_schedule_of_their_2d_form(hidden):
    three = analyze(rmsnorm_3d().fusion)
    two = analyze(FUSIONS["rmsnorm_fwd"](BF16).fusion)
    assert three.kind is Kind.INNER and len(three.row_axes) == 2
    problem = Problem(hidden, 1024, 16)
    assert _compact(schedule(three, problem, H200)) == _compact(schedule(two, problem, H200))
    back3, back2 = (analyze(rmsnorm_bwd_3d().fusion),
                    analyze(FUSIONS["rmsnorm_bwd"](BF16).fusion))
    assert back3.kind is Kind.INNER_OUTER
    assert _compact(schedule(back3, problem, H200)) == _compact(schedule(back2, problem, H200))


def test_the_oracle_agrees_with_the_2d_form(rng):
    b, s, h = 3, 7, 40
    x = rng.standard_normal((b, s, h)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    y3, rstd3 = evaluate(rmsnorm_3d(F32).fusion, [x, w])
    y2, rstd2 = evaluate(FUSIONS["rmsnorm_fwd"](F32).fusion, [x.reshape(b * s, h), w])
    assert y3.shape == (b, s, h) and rstd3.shape == (b, s, 1)
    np.testing.assert_array_equal(y3.reshape(b * s, h), y2)
    np.testing.assert_array_equal(rstd3.reshape(b * s, 1), rstd2)


def test_a_3d_kernel_renders_and_compiles(tmp_path):
    from fuser.cache import KernelCache
    from fuser.kernels import build

    for fd in (rmsnorm_3d(), rmsnorm_bwd_3d()):
        built = build(fd.name, analyze(fd.fusion), Problem(24578, 1024, 16), H200,
                      cache=KernelCache(str(tmp_path)))
        assert not built.compiled.resource(built.source.row_entry).spills


def test_a_weight_over_leading_dimensions_with_a_gap_is_refused():
    """A [B, T, H] weight over [B, S, T, H] spans leading dimensions that are not a run (S
    between them): no kernel row maps to one of its rows by a division and a remainder."""
    with FusionDefinition("gap") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1, -1], dtype=F32)
        w = fd.define_tensor(shape=[-1, -1, -1], dtype=F32)  # [B, T, H]
        fd.add_output(fd.ops.mul(x, fd.ops.broadcast_in_dim(w, x.shape(), [0, 2, 3])))
    with pytest.raises(UnsupportedFusionError, match=r"T1 spans 3 of the fusion's 4 dimensions "
                                                     r"in another way"):
        analyze(fd.fusion)


def test_the_size_of_one_leading_dimension_in_arithmetic_is_refused():
    with FusionDefinition("batch_size") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=F32)
        fd.add_output(fd.ops.div(fd.ops.sum(x, dims=[2], keepdim=True), x.size(0)))
    with pytest.raises(UnsupportedFusionError, match=r"one of the 2 leading dimensions, feeds "
                                                     r"div: kernels over N-D rows know only"):
        analyze(fd.fusion)


def test_a_count_of_every_leading_dimension_is_the_row_count(tmp_path):
    """x / (B * S) over [B, S, H]: the product of every leading size, in any nesting, is the
    kernel's row count (times the other factors); the oracle and the kernel agree on it."""
    from fuser.cache import KernelCache
    from fuser.kernels import build

    with FusionDefinition("per_count") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=F32)
        count = fd.ops.mul(fd.ops.mul(x.size(1), x.size(2)), x.size(0))
        fd.add_output(fd.ops.div(x, count))
    info = analyze(fd.fusion)
    built = build(fd.name, info, Problem(1000, 6, 16), H200, cache=KernelCache(str(tmp_path)))
    assert re.search(r"const long long S\d+ = n_rows \* S2;",
                     built.source.source), built.source.source
    x = np.arange(2 * 3 * 1000, dtype=np.float32).reshape(2, 3, 1000)
    np.testing.assert_array_equal(evaluate(fd.fusion, [x])[0], x / 6000)


def test_a_part_of_the_row_count_in_other_arithmetic_is_refused():
    with FusionDefinition("part_of_count") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1, -1], contiguity=[True] * 4, dtype=F32)
        part = fd.ops.mul(x.size(0), x.size(1))
        fd.add_output(fd.ops.div(fd.ops.sum(x, dims=[3], keepdim=True),
                                 fd.ops.mul(part, x.size(2))))
        fd.add_output(fd.ops.add(x, part))
    with pytest.raises(UnsupportedFusionError, match=r"S\d+, a product of some of the 3 leading "
                                                     r"dimensions' sizes feeds add"):
        analyze(fd.fusion)


def test_a_row_sum_broadcast_along_the_last_dimension_is_explained():
    """numpy aligns trailing dimensions: x - sum(x, dims=[1]) without keepdim subtracts a
    [rows] vector along the hidden dimension, which makes the two sizes one (issue 13)."""
    with FusionDefinition("no_keepdim") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=F32)
        fd.add_output(fd.ops.sub(x, fd.ops.sum(x, dims=[1])))
    with pytest.raises(UnsupportedFusionError, match=r"keepdim=True"):
        analyze(fd.fusion)
