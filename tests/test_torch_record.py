"""CPU: fuser.torch.recorded(), the list of fusion calls a PyTorch user inspects. The fusions
run on the float64 oracle (test_torch_api's `oracle` fixture); each recorded call explains
itself offline as fuser.explain does (tests/test_gpu_torch.py checks on the GPU that the
explanation's schedule is the one that ran)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from test_torch_api import oracle  # noqa: E402, F401  (the fixture)

import fuser.torch as ft  # noqa: E402
from fuser.dtypes import DataType  # noqa: E402
from fuser.explain import Explanation  # noqa: E402
from fuser.schedulers.base import RowSchedule  # noqa: E402

BF16 = DataType.BFloat16


def _training_step(norm, x):
    norm(x).sum().backward()


def test_a_training_step_records_its_forward_and_backward_calls(oracle):  # noqa: F811
    norm = ft.RMSNorm(64, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16, requires_grad=True)
    with ft.recorded() as calls:
        _training_step(norm, x)
    assert [c.name for c in calls] == ["rms_norm_fwd_bf16", "rms_norm_bwd_bf16"]
    forward, backward = calls
    assert forward.fusion.fusion.inputs[0].ndim == 2  # the rows fuser.torch made of x
    assert forward.shapes == ((6, 64), (64,), None)
    assert forward.dtypes == (BF16, BF16, None)
    assert forward.device is None  # CPU tensors
    assert backward.shapes == ((6, 64), (6, 1), (6, 64), (64,))
    assert backward.dtypes == (BF16, DataType.Float, BF16, BF16)
    assert str(forward) == "rms_norm_fwd_bf16(BFloat16[6, 64], BFloat16[64], Float scalar)"


def test_a_dropout_mask_is_recorded_as_bool(oracle):  # noqa: F811
    x = torch.randn(4, 32)
    with ft.recorded() as calls:
        ft.dropout_add_rms_norm(x, x, 32, torch.ones(32), p=0.25)
    (call,) = calls
    assert call.dtypes[1] is DataType.Bool and call.shapes[1] == (4, 32)
    assert "Bool[4, 32]" in str(call)


def test_nothing_is_recorded_outside_a_block_and_nested_blocks_each_get_every_call(
        oracle):  # noqa: F811
    x = torch.randn(4, 32)
    ft.softmax(x, -1)
    with ft.recorded() as outer:
        ft.softmax(x, -1)
        with ft.recorded() as inner:
            ft.log_softmax(torch.randn(16, 32), 0)
        with ft.recorded() as empty:
            pass
        ft.layer_norm(x, 32)
    ft.softmax(x, -1)
    assert [c.name for c in outer] == ["softmax_fwd_f32", "log_softmax_columns_fwd_f32",
                                       "layer_norm_fwd_f32"]
    assert [c.name for c in inner] == ["log_softmax_columns_fwd_f32"]
    assert empty == []
    assert inner[0] is outer[1]
    assert inner[0].shapes == ((1, 16, 32),)


def test_calls_from_other_threads_are_recorded(oracle):  # noqa: F811
    """autograd runs a CUDA backward on a thread of its own: a recording sees every
    thread's calls."""
    x = torch.randn(4, 32)
    with ft.recorded() as calls:
        worker = threading.Thread(target=lambda: ft.rms_norm(x, 32))
        worker.start()
        worker.join()
    assert [c.name for c in calls] == ["rms_norm_fwd_f32"]


def test_a_recording_is_closed_when_its_block_raises(oracle):  # noqa: F811
    from fuser.torch import _record

    with pytest.raises(RuntimeError), ft.recorded():
        raise RuntimeError("a step failed")
    assert _record._open == []


@pytest.mark.parametrize("device", [None, "h100"])
def test_a_recorded_call_explains_itself(oracle, device):  # noqa: F811
    """The report fuser.explain gives for the fusion at the call's shapes and dtypes: the
    schedule, the shared-memory plan, the CUDA and ptxas's resources (compiled offline)."""
    norm = ft.RMSNorm(4096, dtype=torch.bfloat16)
    with ft.recorded() as calls:
        norm(torch.randn(8, 4096, dtype=torch.bfloat16))
    report = calls[0].explain(device)
    assert isinstance(report, Explanation) and isinstance(report.schedule, RowSchedule)
    assert report.name == "rms_norm_fwd_bf16" and report.shapes == ((8, 4096), (4096,), None)
    assert report.device.name.lower().startswith(device or "h200")
    assert "__global__" in report.source
    assert all(r.spill_stores == 0 for r in report.resources.values())


def test_calls_under_torch_compile_are_recorded(oracle):  # noqa: F811
    """torch.compile keeps fuser's custom ops in its graph; their implementations run the
    fusions, so a compiled model's calls are recorded as an eager one's."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ft.rms_norm(x, 32), fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 32, requires_grad=True)
    with ft.recorded() as calls:
        compiled(x).sum().backward()
    assert [c.name for c in calls] == ["rms_norm_fwd_f32", "rms_norm_bwd_f32"]
