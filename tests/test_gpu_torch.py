"""GPU (-m gpu): fuser.torch on the device.

The modules' outputs and every gradient against torch.nn's own, at odd shapes, in float32
and bfloat16: fuser's error against a float64 run of torch's module must be within twice
torch's own error (plus a few units of the dtype), so neither side's rounding is taken for
the truth. gradcheck in float64. torch.compile(fullgraph=True) (a graph break raises) and
its CUDA graphs; torch.cuda.graph capture and replay; CuPy's stream capture of fd.execute;
no synchronizing torch call (set_sync_debug_mode). A 20-step bf16 training of a small
transformer patched by fuser.torch.patch against the unpatched one, eager and compiled.
Dropout + add + RMSNorm repeatable under torch.manual_seed, its gradients against torch
with the same mask. Two GPUs: inputs on cuda:1 leave the current device alone, threads on
both devices at once, and DDP / FSDP2 through torchrun (tests/torch_ddp_train.py).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_ddp_train as tiny  # noqa: E402
from test_torch_api import GRADIENT_IN_FORWARD, TWO_KERNELS, GemmaRMSNorm  # noqa: E402

import fuser.torch as ft  # noqa: E402
from fuser import DataType  # noqa: E402
from fuser.torch import _cross_entropy, _fusions  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(3, 5, 1000), (7, 24578), (2, 4097)]
DTYPES = [torch.float32, torch.bfloat16]
# Units of the dtype (relative to the largest reference value) fuser may be off by where
# torch happens to be exact: an output rounded once, a sum of rows rounded once.
FLOOR = {torch.float32: 4e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def _torch_cuda():
    if not torch.cuda.is_available():
        if os.environ.get("FUSER_REQUIRE_GPU") == "1":
            pytest.fail("FUSER_REQUIRE_GPU=1 but torch sees no CUDA device", pytrace=False)
        pytest.skip("torch sees no CUDA device")


def _two_gpus() -> None:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs two GPUs; {count} visible")


def assert_as_close_as_torch(ours, theirs, reference, what="", floor_dtype=None,
                             same_dtypes=True):
    """Each of ours is as close to the float64 reference as torch's is (twice its error,
    plus FLOOR units of its dtype, or of floor_dtype), and of torch's shape and dtype."""
    for i, (a, b, r) in enumerate(zip(ours, theirs, reference, strict=True)):
        assert a.shape == b.shape and (a.dtype == b.dtype or not same_dtypes), (what, i)
        r = r.double()
        ours_err = (a.double() - r).abs().max().item()
        torch_err = (b.double() - r).abs().max().item()
        floor = FLOOR[floor_dtype or a.dtype] * r.abs().max().item()
        assert ours_err <= 2 * torch_err + floor, (
            f"{what} output {i}: fuser's error {ours_err:.3g}, torch's {torch_err:.3g}, "
            f"floor {floor:.3g}")


def outputs_and_grads(module, x, g, *extra):
    """[y, grad x, grad of each extra input, grad of each parameter] of module(x, *extra),
    for output gradients g (converted to each output's dtype)."""
    x = x.detach().clone().requires_grad_()
    extra = [e.detach().clone().requires_grad_() for e in extra]
    y = module(x, *extra)
    ys = y if isinstance(y, tuple) else (y,)
    gs = [gi.to(yi.dtype) for gi, yi in zip(g if isinstance(g, tuple) else (g,), ys,
                                              strict=True)]
    leaves = [x, *extra, *module.parameters()]
    return [*ys, *torch.autograd.grad(ys, leaves, gs)]


def _fill(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.uniform_(-0.5, 0.5)
    return module


NORMS = {
    "rms": (ft.RMSNorm, torch.nn.RMSNorm, {}),
    "rms_eps": (ft.RMSNorm, torch.nn.RMSNorm, {"eps": 1e-5}),
    "rms_no_affine": (ft.RMSNorm, torch.nn.RMSNorm, {"elementwise_affine": False}),
    "layer": (ft.LayerNorm, torch.nn.LayerNorm, {}),
    "layer_no_bias": (ft.LayerNorm, torch.nn.LayerNorm, {"bias": False}),
    "layer_no_affine": (ft.LayerNorm, torch.nn.LayerNorm, {"elementwise_affine": False}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(NORMS))
def test_norm_modules_match_torch(kind, shape, dtype):
    ours_cls, torch_cls, kwargs = NORMS[kind]
    torch.manual_seed(0)
    ours = _fill(ours_cls(shape[-1], device="cuda", dtype=dtype, **kwargs))
    theirs = torch_cls(shape[-1], device="cuda", dtype=dtype, **kwargs)
    reference = torch_cls(shape[-1], device="cuda", dtype=torch.float64, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(shape, device="cuda", dtype=dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    assert_as_close_as_torch(outputs_and_grads(ours, x, g), outputs_and_grads(theirs, x, g),
                             outputs_and_grads(reference, x.double(), g.double()), kind)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_float16_norms_and_softmax(kind):
    ours_cls, torch_cls, _ = NORMS[kind]
    ours = _fill(ours_cls(1000, device="cuda", dtype=torch.float16))
    theirs = torch_cls(1000, device="cuda", dtype=torch.float16)
    reference = torch_cls(1000, device="cuda", dtype=torch.float64)
    theirs.load_state_dict(ours.state_dict())
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 1000, device="cuda", dtype=torch.float16)
    g = torch.randn(3, 5, 1000, device="cuda", dtype=torch.float16)
    assert_as_close_as_torch(outputs_and_grads(ours, x, g), outputs_and_grads(theirs, x, g),
                             outputs_and_grads(reference, x.double(), g.double()), kind)
    assert_as_close_as_torch(outputs_and_grads(ft.Softmax(), x, g),
                             outputs_and_grads(torch.nn.Softmax(-1), x, g),
                             outputs_and_grads(torch.nn.Softmax(-1), x.double(), g.double()))


SOFTMAX_MODULES = {"softmax": (ft.Softmax, torch.nn.Softmax),
                   "log_softmax": (ft.LogSoftmax, torch.nn.LogSoftmax)}


@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(SOFTMAX_MODULES))
def test_softmax_matches_torch(kind, shape, dtype, dim):
    _softmax_as_close_as_torch(kind, shape, dtype, dim)


def _softmax_as_close_as_torch(kind: str, shape, dtype, dim: int) -> None:
    ours, theirs = SOFTMAX_MODULES[kind]
    x = 4 * torch.randn(shape, device="cuda", dtype=dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    assert_as_close_as_torch(outputs_and_grads(ours(dim), x, g),
                             outputs_and_grads(theirs(dim), x, g),
                             outputs_and_grads(theirs(dim), x.double(), g.double()))


@pytest.mark.parametrize(("shape", "dim"), [((8, 1024, 512), 1), ((3, 7, 1000), 1),
                                            ((2, 3, 4099, 5), 2), ((4, 1, 9), 1),
                                            ((1000, 3, 2), 1), ((2, 300000, 8), 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", list(SOFTMAX_MODULES))
def test_softmax_along_a_middle_dim_matches_torch(kind, shape, dtype, dim):
    """One outer kernel per pass, a grid row of clusters per group of the dims before `dim`
    (and the segments of a dim too tall to keep on chip, 300000); groups of fewer than
    COLUMNS_MIN_GROUP elements ([1, 9], [3, 2]) moved to rows and back."""
    _softmax_as_close_as_torch(kind, shape, dtype, dim)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_float32_weights_on_bfloat16_input(kind):
    ours_cls, torch_cls, _ = NORMS[kind]
    ours = _fill(ours_cls(4097, device="cuda"))
    theirs = torch_cls(4097, device="cuda")
    theirs.load_state_dict(ours.state_dict())
    reference = torch_cls(4097, device="cuda", dtype=torch.float64)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(6, 4097, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(6, 4097, device="cuda", dtype=torch.bfloat16)
    got = outputs_and_grads(ours, x, g)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16] + [torch.float32] * (
        len(got) - 2)  # y and grad x in x's dtype, as torch's LayerNorm; the rest the weight's
    try:
        baseline = outputs_and_grads(theirs, x, g)
    except RuntimeError:  # torch 2.11's layer_norm refuses a float32 weight on bfloat16 input:
        # its float32 computation, rounded to our dtypes, is the baseline then
        baseline = [t.to(ours_t.dtype) for t, ours_t in
                    zip(outputs_and_grads(theirs, x.float(), g.float()), got, strict=True)]
    assert_as_close_as_torch(got, baseline, outputs_and_grads(reference, x.double(), g.double()),
                             same_dtypes=False)


@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
def test_patched_hf_rms_norm_matches_llamas(w_dtype):
    hf = _fill(tiny.LlamaRMSNorm(1000).to("cuda", w_dtype))
    patched = torch.nn.Sequential(copy.deepcopy(hf))
    assert [type(r.new) for r in ft.patch(patched)] == [ft.HFRMSNorm]
    reference = copy.deepcopy(hf).double()
    x = torch.randn(3, 5, 1000, device="cuda", dtype=torch.bfloat16)
    out_dtype = torch.promote_types(w_dtype, torch.bfloat16)
    g = torch.randn(3, 5, 1000, device="cuda", dtype=out_dtype)
    # Both round the normalized x to bfloat16 before the weight: units of bfloat16 apart.
    assert_as_close_as_torch(outputs_and_grads(patched[0], x, g), outputs_and_grads(hf, x, g),
                             outputs_and_grads(reference, x.double(), g.double()),
                             floor_dtype=torch.bfloat16)


@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [1000, 4099, 24578])
def test_patched_gemma_rms_norm_matches_gemmas(w_dtype, hidden):
    """Gemma's RMSNorm (y scaled by 1 + weight in float32) swapped by patch: its output and
    gradients as close to its float64 run as its own module's, at aligned and odd sizes."""
    gemma = GemmaRMSNorm(hidden).to("cuda", w_dtype)
    with torch.no_grad():
        gemma.weight.uniform_(-0.5, 0.5)
    patched = torch.nn.Sequential(copy.deepcopy(gemma))
    assert [type(r.new) for r in ft.patch(patched)] == [ft.GemmaRMSNorm]
    reference = copy.deepcopy(gemma).double()
    x = torch.randn(3, 5, hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(3, 5, hidden, device="cuda", dtype=torch.bfloat16)
    assert_as_close_as_torch(outputs_and_grads(patched[0], x, g), outputs_and_grads(gemma, x, g),
                             outputs_and_grads(reference, x.double(), g.double()),
                             floor_dtype=torch.bfloat16)


def _loss_and_grad(fn, logits, target, g, **kwargs) -> list:
    """[fn's loss, the logits' gradient for the loss's gradient g (in the loss's dtype)]."""
    logits = logits.detach().requires_grad_()
    loss = fn(logits, target, **kwargs)
    return [loss, *torch.autograd.grad(loss, logits, g.to(loss.dtype).reshape(loss.shape))]


def _force_path(monkeypatch, path: str) -> None:
    """Send a reduced loss to `path` (the record otherwise follows the last backward)."""
    record = _cross_entropy._FactorRecord.of(torch.empty(0, device="cuda"))
    monkeypatch.setattr(record, "not_one", lambda: path == TWO_KERNELS)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize(("reduction", "path", "factor"), [
    ("mean", GRADIENT_IN_FORWARD, "one"), ("mean", GRADIENT_IN_FORWARD, "random"),
    ("sum", GRADIENT_IN_FORWARD, "random"), ("mean", TWO_KERNELS, "random"),
    ("none", TWO_KERNELS, "random")])
@pytest.mark.parametrize(("rows", "classes", "dtype"), [
    (64, 50257, torch.bfloat16), (16, 128256, torch.bfloat16), (300, 32000, torch.float16),
    (33, 1000, torch.float32), (1, 7, torch.bfloat16)])
def test_cross_entropy_matches_torch(monkeypatch, rows, classes, dtype, reduction, path, factor,
                                     label_smoothing):
    """Loss and the logits' gradient as close to float64 as torch's own, with ignored rows,
    at vocabulary sizes of GPT-2, Llama 3 and Llama 2: the gradient written in the forward
    (scaled in place by the loss's gradient, or left as it is where that is one) and by the
    two kernels."""
    _force_path(monkeypatch, path)
    x = (3 * torch.randn(rows, classes, device="cuda")).to(dtype)
    target = torch.randint(0, classes, (rows,), device="cuda")
    target[1::5] = -100
    shape = (rows,) if reduction == "none" else ()
    g = (torch.ones if factor == "one" else torch.rand)(shape, device="cuda", dtype=torch.float64)
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
    ours = _loss_and_grad(ft.cross_entropy, x, target, g, **kwargs)
    assert type(ours[0].grad_fn).__name__ == path
    assert_as_close_as_torch(
        ours, _loss_and_grad(torch.nn.functional.cross_entropy, x, target, g, **kwargs),
        _loss_and_grad(torch.nn.functional.cross_entropy, x.double(), target, g, **kwargs))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("shape", "dtype"), [((4, 21, 64, 64), torch.bfloat16),
                                              ((3, 1000, 7), torch.float32),
                                              ((2, 150, 33, 31), torch.float16),
                                              ((64, 5, 3), torch.bfloat16)], ids=str)
def test_cross_entropy_of_classes_along_dim_1_matches_torch(shape, dtype, reduction):
    """Logits [N, C, d1, ...] (a segmentation's per-pixel classes), read where they lie by
    the outer kernels (moved to rows for [5, 3] groups): the loss per element or its mean,
    and the logits' gradient, as close to float64 as torch's own."""
    x = (3 * torch.randn(shape, device="cuda")).to(dtype)
    target = torch.randint(0, shape[1], shape[:1] + shape[2:], device="cuda")
    target[:, ::3] = -100
    g = torch.rand(target.shape if reduction == "none" else (), device="cuda",
                   dtype=torch.float64)
    kwargs = {"reduction": reduction, "label_smoothing": 0.1}
    assert_as_close_as_torch(
        _loss_and_grad(ft.cross_entropy, x, target, g, **kwargs),
        _loss_and_grad(torch.nn.functional.cross_entropy, x, target, g, **kwargs),
        _loss_and_grad(torch.nn.functional.cross_entropy, x.double(), target, g, **kwargs))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("path", [GRADIENT_IN_FORWARD, TWO_KERNELS])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("shape", [(300, 32000), (4, 21, 64, 64)], ids=str)
def test_cross_entropy_with_class_weights_matches_torch(monkeypatch, shape, reduction, path,
                                                        label_smoothing):
    """Class weights: each row's loss and gradient scaled by its target's weight, a mean over
    the weights' sum, label smoothing's term weighted per class (the row kernels' column
    input), as close to float64 as torch's own."""
    _force_path(monkeypatch, path)
    x = (3 * torch.randn(shape, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, shape[1], shape[:1] + shape[2:], device="cuda")
    target[1::5] = -100
    weight = (torch.rand(shape[1], device="cuda") + 0.5).to(torch.bfloat16)  # torch's dtype
    g = torch.rand(target.shape if reduction == "none" else (), device="cuda",
                   dtype=torch.float64)
    kwargs = {"weight": weight, "reduction": reduction, "label_smoothing": label_smoothing}
    ours = _loss_and_grad(ft.cross_entropy, x, target, g, **kwargs)
    assert reduction == "none" or type(ours[0].grad_fn).__name__ == path
    assert_as_close_as_torch(
        ours, _loss_and_grad(torch.nn.functional.cross_entropy, x, target, g, **kwargs),
        _loss_and_grad(torch.nn.functional.cross_entropy, x.double(), target, g,
                       **{**kwargs, "weight": weight.double()}))


def test_a_recorded_call_explains_the_schedule_that_ran():
    """fuser.torch.recorded() on the GPU: each call's explanation (on the device the call ran
    on, by default) has the schedule the executor ran for it."""
    norm = _fill(ft.RMSNorm(4096, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(4, 1000, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(512, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with ft.recorded() as calls:
        norm(x).sum().backward()
        ft.softmax(x.detach(), 1)
        ft.cross_entropy(logits, torch.randint(0, 32000, (512,), device="cuda")).backward()
    torch.cuda.synchronize()
    # 4 calls, or 5 where the last loss's gradient was not one (cross entropy's two kernels)
    assert len({c.name for c in calls}) == len(calls) in (4, 5), [str(c) for c in calls]
    assert all(c.device == torch.cuda.current_device() for c in calls)
    for call in calls:
        assert call.explain().schedule == call.fusion.last_schedule(), str(call)


def test_cross_entropy_follows_the_last_loss_gradient():
    """The rescale kernel records whether the loss's gradient was one: a backward given
    another factor sends the next forward to the two kernels, one given one sends it back;
    every loss and gradient as close to float64 as torch's."""
    x = (3 * torch.randn(64, 50257, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, 50257, (64,), device="cuda")
    record = _cross_entropy._FactorRecord.of(x)
    record.record.fill_(0)
    for factor, path in [(1.0, GRADIENT_IN_FORWARD), (0.25, GRADIENT_IN_FORWARD),
                         (4.0, TWO_KERNELS), (1.0, TWO_KERNELS), (1.0, GRADIENT_IN_FORWARD)]:
        logits = x.detach().requires_grad_()
        loss = ft.cross_entropy(logits, target)
        assert type(loss.grad_fn).__name__ == path, factor
        g = torch.tensor(factor, device="cuda", dtype=torch.bfloat16)
        (grad,) = torch.autograd.grad(loss, logits, g)
        torch.cuda.synchronize()
        assert record.not_one() == (factor != 1)
        want = [torch.nn.functional.cross_entropy(x.double(), target)]
        logits64 = x.double().requires_grad_()
        want.append(torch.autograd.grad(torch.nn.functional.cross_entropy(logits64, target),
                                        logits64, g.double())[0])
        theirs = _loss_and_grad(torch.nn.functional.cross_entropy, x, target, g)
        assert_as_close_as_torch([loss.detach(), grad], theirs, want, what=str(factor))


def test_cross_entropy_gradient_in_forward_serves_a_second_backward(monkeypatch):
    """retain_graph=True: each backward's gradient as close to float64 as torch's."""
    _force_path(monkeypatch, GRADIENT_IN_FORWARD)
    x = (3 * torch.randn(40, 32000, device="cuda")).to(torch.bfloat16)
    target = torch.randint(0, 32000, (40,), device="cuda")
    logits = x.detach().requires_grad_()
    loss = ft.cross_entropy(logits, target, label_smoothing=0.1)
    for factor in (0.5, 3.0, 1.0):
        g = torch.tensor(factor, device="cuda", dtype=torch.float64)
        ours = [loss, *torch.autograd.grad(loss, logits, g.to(loss.dtype), retain_graph=True)]
        assert_as_close_as_torch(
            ours, _loss_and_grad(torch.nn.functional.cross_entropy, x, target, g,
                                 label_smoothing=0.1),
            _loss_and_grad(torch.nn.functional.cross_entropy, x.double(), target, g,
                           label_smoothing=0.1), what=str(factor))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=str)
@pytest.mark.parametrize(("n", "offset"), [(1, 0), (8 * 1000 + 5, 0), (8 * 1000 + 5, 1),
                                           (3 * 2**20 + 3, 0)])
def test_rescale_scales_in_place_unless_the_factor_is_one(dtype, n, offset):
    """fuser.rescale's kernel: elements rounded once as torch's multiply rounds them, a tail
    short of a vector and a start off 16 bytes (one element an access), the grid's stride
    over a few million; a factor of one leaves every bit as it was; the record says which."""
    base = torch.randn(n + offset, device="cuda").to(dtype)
    record = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    for factor in (1.0, 0.37, -3.0):
        data = base.clone()[offset:]
        f = torch.tensor(factor, device="cuda", dtype=dtype)
        _fusions.rescale(data, f, record)
        torch.cuda.synchronize()
        assert bool(record[0]) == (factor != 1)
        assert torch.equal(data, base[offset:] * f), factor


def test_gradcheck_float64():
    def x_like(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float64, requires_grad=True)

    x, r, w, b = x_like(4, 33), x_like(4, 33), x_like(33), x_like(33)

    def dropped(fn, *args, **kwargs):
        torch.manual_seed(5)  # the same mask at every evaluation
        return fn(*args, p=0.25, **kwargs)

    cases = [
        (lambda x, w: ft.rms_norm(x, 33, w), (x, w)),
        (lambda x: ft.rms_norm(x, 33, eps=1e-3), (x,)),
        (lambda x, w, b: ft.layer_norm(x, 33, w, b), (x, w, b)),
        (lambda x, w: ft.hf_rms_norm(x, w, 1e-6), (x, w)),
        (lambda x, w: ft.gemma_rms_norm(x, w, 1e-6), (x, w)),
        (lambda x: ft.cross_entropy(x, torch.tensor([3, -100, 32, 0], device="cuda"),
                                    label_smoothing=0.1), (x,)),
        (lambda x: ft.softmax(x, -1), (x,)),
        (lambda x: ft.softmax(x, 0), (x,)),
        (lambda x: ft.log_softmax(x, -1), (x,)),
        (lambda x: ft.log_softmax(x.reshape(4, 3, 11), 1), (x,)),
        (lambda x, r, w: dropped(ft.dropout_add_rms_norm, x, r, 33, w), (x, r, w)),
        (lambda x, w: dropped(ft.dropout_add_rms_norm, x, None, 33, w), (x, w)),
        (lambda x, r, w, b: dropped(ft.dropout_add_layer_norm, x, r, 33, w, b), (x, r, w, b)),
    ]
    for i, (fn, args) in enumerate(cases):
        assert torch.autograd.gradcheck(fn, args), i


@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_dropout_add_norm_repeats_and_matches_torch_with_its_mask(kind, residual_dtype):
    p, shape, rows = 0.2, (4, 7, 1000), 28
    block = _fill(ft.DropoutAddRMSNorm(1000, p=p, device="cuda") if kind == "rms"
                  else ft.DropoutAddLayerNorm(1000, p=p, device="cuda"))
    norm = (torch.nn.RMSNorm(1000, device="cuda", dtype=torch.float64) if kind == "rms"
            else torch.nn.LayerNorm(1000, device="cuda", dtype=torch.float64))
    norm.load_state_dict(block.state_dict())
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    residual = (None if residual_dtype is None
                else torch.randn(shape, device="cuda", dtype=residual_dtype))
    g = (torch.randn(shape, device="cuda", dtype=torch.bfloat16),
         torch.randn(shape, device="cuda", dtype=residual_dtype or torch.bfloat16))
    extra = () if residual is None else (residual,)
    torch.manual_seed(11)
    got = outputs_and_grads(block, x, g, *extra)
    torch.manual_seed(11)
    again = outputs_and_grads(block, x, g, *extra)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    torch.manual_seed(11)  # the mask fuser.torch draws, drawn again
    mask = torch.empty(rows, 1000, dtype=torch.bool, device="cuda").bernoulli_(1 - p)
    assert 0.7 < mask.float().mean().item() < 0.9

    def reference(x, *res):
        h = x * mask.view(shape) / (1 - p) + (res[0] if res else 0)
        return norm(h), h

    want = outputs_and_grads(_Call(reference, norm), x.double(), tuple(t.double() for t in g),
                             *(t.double() for t in extra))
    assert (got[1].dtype, got[0].dtype) == (residual_dtype or torch.bfloat16, torch.bfloat16)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 2e-2 * scale, (kind, i)


class _Call(torch.nn.Module):
    """A function as a module whose parameters are those of `owner`."""

    def __init__(self, fn, owner):
        super().__init__()
        self.fn, self.owner = fn, owner

    def forward(self, *args):
        return self.fn(*args)


# ----- torch.compile, CUDA graphs, no synchronization -----


class Mixer(torch.nn.Module):
    """Every fuser module in a few lines: norms, dropout + add + norm, softmax."""

    def __init__(self, hidden=1000, p=0.0):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.rms = ft.RMSNorm(hidden)
        self.add_norm = ft.DropoutAddRMSNorm(hidden, p=p)
        self.ln = ft.LayerNorm(hidden)
        self.add_ln = ft.DropoutAddLayerNorm(hidden, p=p)
        self.softmax = ft.Softmax(-1)

    def forward(self, x):
        y, residual = self.add_norm(self.proj(self.rms(x)), x)
        y, residual = self.add_ln(self.softmax(self.ln(y)), residual)
        return y + residual


def _counting(monkeypatch) -> list:
    """Count the fusions fuser.torch runs (the ops call _fusions.run at run time)."""
    ran: list = []
    real = _fusions.run
    monkeypatch.setattr(_fusions, "run", lambda fd, inputs: ran.append(fd.name) or real(
        fd, inputs))
    return ran


def _fresh_grads(model, x) -> list[torch.Tensor]:
    """[y, each parameter's gradient] of a fresh forward and backward, copied."""
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.float().square().sum().backward()
    return [y.detach().clone(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize(("mode", "rows"), [(None, (4, 6, 9)), ("reduce-overhead", (6, 6, 6))])
def test_compile_fullgraph_runs_fusers_kernels(monkeypatch, mode, rows):
    """fullgraph=True raises on a graph break; under reduce-overhead, inductor's CUDA graphs
    replay fuser's kernels without calling into Python (so only the first calls count)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _fill(Mixer()).cuda()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    ran = _counting(monkeypatch)
    counts = []
    for n in rows:
        x = torch.randn(2, n, 1000, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        got = _fresh_grads(compiled, x)
        counts.append(len(ran))
        want = _fresh_grads(model, x)
        ran.clear()
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert counts[0] >= 6, counts  # the forward fusions, then the backward ones


def test_no_synchronization_in_forward_and_backward():
    model = _fill(Mixer(p=0.1)).cuda()
    x = torch.randn(4, 1000, device="cuda", requires_grad=True)
    model(x).sum().backward()  # plans and kernels exist
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_capture_and_replay_forward_and_backward():
    torch.manual_seed(0)
    model = _fill(Mixer()).cuda()
    eager_model = copy.deepcopy(model)
    static_x = torch.randn(3, 5, 1000, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: plans, kernels and workspaces exist before capture
        for _ in range(3):
            _fresh_grads(model, static_x)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.float().square().sum().backward()
    static_grads = [p.grad for p in model.parameters()]  # written by every replay
    for _ in range(2):
        x = torch.randn(3, 5, 1000, device="cuda")
        static_x.copy_(x)
        graph.replay()
        eager = _fresh_grads(eager_model, x)
        for a, b in zip([static_y, *static_grads], eager, strict=True):
            torch.testing.assert_close(a, b)


def test_cupy_stream_capture_of_fd_execute():
    import cupy

    from fuser.fusions import make_inputs, rmsnorm_bwd

    fd = rmsnorm_bwd(DataType.Float)
    rng = np.random.default_rng(0)
    inputs = [cupy.asarray(a) for a in make_inputs("rmsnorm_bwd", 64, 4097, DataType.Float,
                                                   rng)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fd.execute(inputs)  # the plan, the kernels and this stream's workspace
        stream.synchronize()
        stream.begin_capture()
        captured = fd.execute(inputs)
        graph = stream.end_capture()
        for _ in range(2):
            for d, h in zip(inputs, make_inputs("rmsnorm_bwd", 64, 4097, DataType.Float, rng),
                            strict=True):
                d[...] = cupy.asarray(h)
            graph.launch(stream)
            eager = fd.execute(inputs)
            for a, b in zip(captured, eager, strict=True):
                np.testing.assert_allclose(cupy.asnumpy(a), cupy.asnumpy(b), rtol=1e-6,
                                           atol=1e-6)
        stream.synchronize()


# ----- training a small transformer -----


def _models(dtype):
    """(unpatched, patched): Hugging Face's Llama with a random init where transformers is
    installed, else tests/torch_ddp_train.py's TinyLlama (the same design)."""
    try:
        import transformers
    except ImportError:
        reference = tiny.make_model("cuda", dtype)
    else:
        config = transformers.LlamaConfig(
            vocab_size=tiny.VOCAB, hidden_size=tiny.DIM, intermediate_size=tiny.FFN,
            num_hidden_layers=tiny.LAYERS, num_attention_heads=tiny.HEADS,
            num_key_value_heads=tiny.HEADS // 2, max_position_embeddings=2 * tiny.SEQ)
        torch.manual_seed(0)
        reference = transformers.LlamaForCausalLM(config).to("cuda", dtype)
    patched = copy.deepcopy(reference)
    replaced = ft.patch(patched)
    assert len(replaced) == 2 * tiny.LAYERS + 1, [r.name for r in replaced]
    return reference, patched


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_matches_unpatched_within_two_percent(monkeypatch, compiled):
    torch._dynamo.reset()
    reference, patched = _models(torch.bfloat16)
    ran = _counting(monkeypatch)
    hf = hasattr(patched, "config")
    run = torch.compile(patched, fullgraph=not hf) if compiled else patched
    data = tiny.batches(20, 8, "cuda")
    want = tiny.train(reference, data, torch.optim.AdamW(reference.parameters(), lr=3e-3))
    got = tiny.train(run, data, torch.optim.AdamW(patched.parameters(), lr=3e-3))
    assert ran
    want_, got_ = torch.stack(want).tolist(), torch.stack(got).tolist()
    assert want_[-1] < want_[0], want_  # it learns
    for step, (a, b) in enumerate(zip(got_, want_, strict=True)):
        assert abs(a - b) <= 0.02 * abs(b), (step, got_, want_)


# ----- several GPUs -----


def test_inputs_on_the_second_gpu_leave_the_current_device_alone():
    _two_gpus()
    torch.cuda.set_device(0)
    norm = _fill(ft.RMSNorm(4097, device="cuda:1"))
    x = torch.randn(5, 4097, device="cuda:1", requires_grad=True)
    y = norm(x)
    y.sum().backward()
    assert y.device == x.grad.device == norm.weight.grad.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0
    want = torch.nn.functional.rms_norm(x, (4097,), norm.weight)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_threads_on_two_gpus_at_once():
    _two_gpus()
    errors: list = []
    barrier = threading.Barrier(2)

    def work(device: int):
        try:
            torch.cuda.set_device(device)
            norm = _fill(ft.LayerNorm(24578, device=f"cuda:{device}"))
            barrier.wait()
            for i in range(30):
                x = torch.randn(7 + i % 3, 24578, device=f"cuda:{device}")
                want = torch.nn.functional.layer_norm(x, (24578,), norm.weight, norm.bias)
                torch.testing.assert_close(norm(x), want, rtol=1e-4, atol=1e-4)
        except Exception as exc:  # reported by the main thread
            errors.append((device, exc))

    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_ddp_and_fsdp2_match_a_single_gpu_run():
    _two_gpus()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                      os.environ.get(
                                                                          "PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(ROOT / "tests" / "torch_ddp_train.py")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {"ddp", "fsdp2"}, report
