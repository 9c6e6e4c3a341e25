"""CPU: fuser.explain(fd, shapes) reports every step for any fusion without a GPU: the same
problem fd.execute() would derive from inputs of those shapes, the same schedule, plans, source
and ptxas report fuser.kernels.build gives for it, and the report `python -m fuser show`
prints (one implementation: cli.describe() is explain())."""

from __future__ import annotations

import dataclasses
import re

import pytest

import fuser
from fuser import BadInputError, DataType, DefinitionError, FusionDefinition, HintError
from fuser.analysis import analyze
from fuser.cache import KernelCache
from fuser.cli import describe, shapes_of
from fuser.device import DeviceSpec
from fuser.explain import Explanation, SegmentedExplanation
from fuser.fusions import ACTIVATIONS, COLUMN_FUSIONS, FUSIONS, ROW_FUSIONS
from fuser.kernels import build
from fuser.schedulers import Hints, Problem

H200 = DeviceSpec.get("h200")
F32, BF16 = DataType.Float, DataType.BFloat16
SECTIONS = ("fusion definition (repr)", "=== classification", "=== schedule",
            "=== shared memory plan: ", "=== ptxas report (NVRTC, offline)", "=== CUDA source")


def _ready_shapes(fd: FusionDefinition, rows: int, hidden: int) -> list:
    """[rows, hidden], [rows, 1] and [hidden] inputs, as the ready fusions' docstrings give."""
    shapes = []
    for v in fd.fusion.inputs:
        dims = getattr(v, "dims", None)
        if dims is None:
            shapes.append(None)
        elif len(dims) == 1:
            shapes.append((hidden,))
        else:
            shapes.append((rows, 1 if dims[1] is None else hidden))
    return shapes


@pytest.mark.parametrize("name", sorted({**ROW_FUSIONS, **ACTIVATIONS}))
def test_explain_gives_the_schedule_build_gives(name):
    """Each one-kernel ready fusion at 1000 rows (the heuristic sees 1024, as execute() rounds
    them)."""
    fd = FUSIONS[name](BF16)
    report = fuser.explain(fd, _ready_shapes(fd, 1000, 4096), device="h200")
    built = build(fd.name, analyze(fd.fusion), Problem(4096, 1024, 16), H200)
    assert isinstance(report, Explanation)
    assert report.problem == Problem(4096, 1024, 16)
    assert (report.rows, report.hidden) == (1000, 4096)
    assert report.schedule == built.schedule and report.finalize == built.finalize
    assert dict(report.smem_plans) == dict(built.plans())
    assert report.entries[0] == built.source.row_entry
    assert report.source == built.source.source
    assert dict(report.resources) == {e: built.compiled.resource(e) for e, _ in built.plans()}
    assert not any(r.spills for r in report.resources.values())
    assert report.info.kind is analyze(fd.fusion).kind
    text = str(report)
    for section in SECTIONS:
        assert section in text, section
    assert f"=== {name}  [1000 x 4096]  " in text and "  on H200 " in text


@pytest.mark.parametrize(("name", "segments"), [("batchnorm_fwd", 3), ("batchnorm_bwd", 2),
                                              ("softmax_dim0_fwd", 3)])
def test_column_normalizations_are_explained_segment_by_segment(name, segments):
    """One outer-persistent kernel where the columns fit on chip; past that BatchNorm forward
    runs the column means, then the variances about them, then the normalization, and
    backward the two column sums, then grad_x. Each segment compiles for the H200 without
    spills."""
    assert set(COLUMN_FUSIONS) == {"batchnorm_fwd", "batchnorm_bwd", "softmax_dim0_fwd"}
    fd = FUSIONS[name](BF16)
    one = fuser.explain(fd, _ready_shapes(fd, 1000, 4096), device="h200")
    assert isinstance(one, Explanation) and one.info.kind.name == "OUTER_NORM"
    report = fuser.explain(fd, _ready_shapes(fd, 2**21, 64), device="h200")
    assert isinstance(report, SegmentedExplanation)
    assert len(report.parts) == segments
    assert f"runs as {segments} segments" in str(report)
    for part in report.parts:
        assert not any(r.spills for r in part.resources.values()), part.name


def test_show_prints_what_explain_returns():
    """cli.describe() (what `show` prints) is explain()'s report, not a copy of its code."""
    text, fd, report = describe("rmsnorm_bwd", 64, 4096, "bf16", H200)
    assert isinstance(report, Explanation)
    assert text == str(report) == str(fuser.explain(fd, _ready_shapes(fd, 64, 4096)))
    assert shapes_of(fd, 64, 4096) == [(64, 4096), (64, 1), (64, 4096), (4096,)]


def _scaled_rmsnorm(dtype: DataType = BF16) -> FusionDefinition:
    """A user's fusion: a weight, per-row statistics in, a scalar input, two outputs."""
    with FusionDefinition("my_scaled_rmsnorm") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        bias = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=F32)
        scale = fd.define_scalar(dtype=F32)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        xf = fd.ops.add(fd.ops.mul(fd.ops.cast(x, F32), scale),
                        fd.ops.broadcast_in_dim(bias, shape=x.shape(), broadcast_dims=[0, 1]))
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), dims=[1], keepdim=True), x.size(1))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, 1e-6))
        y = fd.ops.mul(fd.ops.mul(xf, fd.ops.broadcast_in_dim(rstd, shape=x.shape(),
                                                              broadcast_dims=[0, 1])),
                       fd.ops.cast(w, F32))
        fd.add_output(fd.ops.cast(y, dtype))
        fd.add_output(rstd)
    return fd


def test_explain_a_users_fusion(tmp_path):
    fd = _scaled_rmsnorm()
    cache = KernelCache(directory=str(tmp_path / "cache"))
    report = fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], device="a100", cache=cache)
    assert report.device is DeviceSpec.get("a100")
    assert report.problem == Problem(3000, 8, 16)
    assert report.shapes == ((7, 3000), (7, 1), None, (3000,))
    assert report.info.kind.value == "inner reduction"
    built = build(fd.name, analyze(fd.fusion), Problem(3000, 8, 16), DeviceSpec.get("a100"),
                  cache=cache)
    assert report.schedule == built.schedule and report.source == built.source.source
    assert cache.stats()["entries"] >= 1
    text = str(report)
    assert text.startswith("\n=== my_scaled_rmsnorm  [7 x 3000]  BFloat16, Float  on A100")
    assert "inputs:  T0 BFloat16 [7, 3000], T1 Float [7, 1], S2 Float scalar, " \
           "T3 BFloat16 [3000]" in text
    assert "the heuristic sees rows=8, 16-byte aligned inputs" in text
    assert "my_scaled_rmsnorm_row" in report.entries[0]
    # One shape per tensor input (scalars skipped), dtypes checked like arrays, a DeviceSpec,
    # hints as a dict: the same kernel.
    again = fuser.explain(fd, [(7, 3000), (7, 1), (3000,)],
                          dtypes=[BF16, "float32", None, DataType.BFloat16],
                          device=DeviceSpec.get("a100"), cache=cache)
    assert again.schedule == report.schedule and again.shapes == report.shapes
    hinted = fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], hints={"threads_per_row": 64},
                           cache=cache)
    assert hinted.hints == Hints(threads_per_row=64)
    assert hinted.schedule.threads_per_row == 64
    assert "with threads_per_row=64" in str(hinted).splitlines()[1]


def test_the_record_is_frozen():
    fd = FUSIONS["softmax_fwd"](BF16)
    report = fuser.explain(fd, [(64, 1024)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.source = ""
    with pytest.raises(TypeError):
        report.smem_plans["x"] = None


def test_rows_are_the_product_of_the_row_extents():
    """[batch, seq, hidden]: rows are batch * seq, as execute() flattens them."""
    with FusionDefinition("my_rms3d") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], dtype=BF16)
        xf = fd.ops.cast(x, F32)
        s = fd.ops.sum(fd.ops.mul(xf, xf), dims=[2], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.mul(xf, fd.ops.broadcast_in_dim(
            fd.ops.rsqrt(s), shape=x.shape(), broadcast_dims=[0, 1, 2])), BF16))
    report = fuser.explain(fd, [(3, 7, 1000)])
    assert (report.rows, report.hidden) == (21, 1000)
    assert report.problem == Problem(1000, 32, 16)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda fd: fuser.explain("rmsnorm_fwd", [(4, 4)]), BadInputError,
     "fd is a builtins.str, not a FusionDefinition"),
    (lambda fd: fuser.explain(fd, [(7, 3000)]), BadInputError,
     "has 4 inputs (T0, T1, S2, T3), got 1 shapes; give one per input, None for a scalar "
     "input, or one per tensor input (T0, T1, T3)"),
    (lambda fd: fuser.explain(fd, (7, 3000)), BadInputError, "has 4 inputs"),
    (lambda fd: fuser.explain(fd, "7x3000"), BadInputError,
     "shapes must be a list with one entry per input"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), (1,), (3000,)]), BadInputError,
     "shapes[2] is (1,) for the scalar input S2; give None for scalar inputs"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, None]), BadInputError,
     "input 3 (T3) is a rank-1 tensor, but its entry in shapes is None"),
    (lambda fd: fuser.explain(fd, [(7, 3000), 7, None, (3000,)]), BadInputError,
     "shapes[1] for the tensor input T1 is 7; give its shape as a tuple of ints"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7,), None, (3000,)]), BadInputError,
     "input 1 (T1): expected rank 2"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (8, 1), None, (3000,)]), BadInputError,
     "has size 8 but T0 dimension 0, which must be equal, has 7"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], dtypes=[F32, F32, None,
                                                                             BF16]),
     BadInputError, "input 0 (T0) has dtype DataType.Float; the definition declares "
                    "DataType.BFloat16"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], dtypes=[1, 2, 3, 4]),
     BadInputError, "dtypes[0] for T0 is 1; give a fuser.DataType"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], device="h300"),
     BadInputError, "unknown device 'h300'"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], hints={"stage": 2}),
     HintError, "stage is not a hint; the hints are threads_per_row, rows_per_block"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)], hints=[1]),
     BadInputError, "pass a fuser.schedulers.Hints or a dict of its fields"),
    (lambda fd: fuser.explain(fd, [(7, 3000), (7, 1), None, (3000,)],
                              hints=Hints(threads_per_row=48)),
     HintError, "Hints(threads_per_row=48)"),
])
def test_errors_name_the_fix(call, error, message):
    with pytest.raises(error) as raised:
        call(_scaled_rmsnorm())
    assert message in str(raised.value), str(raised.value)


def test_a_definition_without_outputs_is_refused():
    fd = FusionDefinition("my_empty")
    fd.define_tensor(shape=[-1, -1], dtype=F32)
    with pytest.raises(DefinitionError, match=re.escape("has no outputs; call fd.add_output")):
        fuser.explain(fd, [(4, 4)])


def test_the_report_lists_the_ops_no_output_depends_on():
    """Ops of the definition that no output uses are left out of the kernels, and the
    report says so under the definition, in its names; a segmented fusion's report too; a
    fusion without such ops has no such line."""
    with FusionDefinition("unused") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        fd.ops.var(x, [1], correction=1)
        fd.add_output(fd.ops.min(x, [0]))
    report = str(fuser.explain(fd, [(8, 64)]))
    assert ("left out (no output depends on them, so no kernel computes them): "
            "T1 = var(T0)") in report
    assert report.index("left out") < report.index("=== classification")
    with FusionDefinition("unused_segmented") as cut:
        x = cut.define_tensor([-1, -1], dtype=DataType.Float)
        cut.ops.max(x, [0])
        total = cut.ops.sum(x, [1], keepdim=True)
        cut.add_output(cut.ops.sub(x, cut.ops.sum(total, [0], keepdim=True)))
    explained = fuser.explain(cut, [(8, 64)])
    assert isinstance(explained, SegmentedExplanation)
    assert explained.left_out == ("T1 = max(T0)",)
    assert "left out (no output depends on them" in str(explained)
    assert "left out" not in str(fuser.explain(FUSIONS["rmsnorm_fwd"](DataType.BFloat16),
                                               [(8, 64), (64,)]))
