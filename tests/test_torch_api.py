"""CPU: fuser.torch without a GPU. The modules' constructors, parameters and state_dict keys
against torch.nn's; patch() on a small model; the custom ops' schemas, fake implementations
and autograd registrations (torch.library.opcheck); torch.compile(fullgraph=True) through
them; the errors; `import fuser` without torch.

Where a test runs the ops on CPU tensors, the fusion is run by fuser's float64 oracle
(fuser.reference.evaluate) in place of the GPU executor (`oracle` fixture): that checks the
fusions' math (against torch's own modules and by gradcheck in float64) and everything
fuser.torch does around them; the GPU tests run the kernels (tests/test_gpu_torch.py).
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_ddp_train import LlamaRMSNorm  # noqa: E402  (Hugging Face's, as written there)

import fuser.torch as ft  # noqa: E402
from fuser import explain  # noqa: E402
from fuser.dtypes import DataType  # noqa: E402
from fuser.errors import BadInputError, UnsupportedFusionError  # noqa: E402
from fuser.frontend import FusionDefinition  # noqa: E402
from fuser.ir import Tensor as FusionTensor  # noqa: E402
from fuser.reference import evaluate  # noqa: E402
from fuser.torch import _cross_entropy, _fusions  # noqa: E402
from fuser.torch._fusions import NormSpec  # noqa: E402
from fuser.torch._support import TORCH_DTYPES  # noqa: E402

F64 = torch.float64


def _host(x):
    if not isinstance(x, torch.Tensor):
        return x
    assert x.is_contiguous(), "the executor takes contiguous tensors"
    x = x.detach()
    return x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()


def run_on_oracle(fd, inputs):
    """fd.execute's contract on CPU tensors: outputs of the declared dtypes, from the oracle."""
    outs = evaluate(fd.fusion, [_host(x) for x in inputs])
    return [torch.from_numpy(np.asarray(o, dtype=np.float64)).to(TORCH_DTYPES[v.dtype])
            for o, v in zip(outs, fd.fusion.outputs, strict=True)]


def rescale_on_host(data, factor, record):
    """fuser.rescale's contract on CPU tensors: data scaled in place unless the factor is
    one (through .data: the kernel writes through a pointer, which autograd's version
    counter does not see), the record written."""
    not_one = bool(factor.reshape(()) != 1)
    record.fill_(int(not_one))
    if not_one:
        data.data.mul_(factor.reshape(()))


@pytest.fixture
def oracle(monkeypatch):
    monkeypatch.setattr(FusionDefinition, "execute", run_on_oracle)
    monkeypatch.setattr(_fusions, "rescale", rescale_on_host)


# ----- packaging -----


def test_import_fuser_does_not_import_torch():
    code = "import sys, fuser, fuser.executor; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fuser_torch_without_torch_says_how_to_install():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import fuser.torch\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert "needs PyTorch" in out and "pip install" in out and "[torch]" in out


# ----- modules: the torch.nn contract -----


@pytest.mark.parametrize(("ours", "theirs"), [(ft.RMSNorm, torch.nn.RMSNorm),
                                              (ft.LayerNorm, torch.nn.LayerNorm)])
def test_norm_constructors_are_torchs(ours, theirs):
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert issubclass(ours, theirs)


@pytest.mark.parametrize("kwargs", [
    {"normalized_shape": 8},
    {"normalized_shape": (3, 8), "eps": 1e-3},
    {"normalized_shape": [8], "elementwise_affine": False},
    {"normalized_shape": 8, "bias": False},
    {"normalized_shape": 8, "dtype": torch.bfloat16},
])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_state_dicts_load_both_ways(kind, kwargs):
    ours, theirs = (ft.RMSNorm, torch.nn.RMSNorm) if kind == "rms" else (ft.LayerNorm,
                                                                          torch.nn.LayerNorm)
    if kind == "rms":
        kwargs = {k: v for k, v in kwargs.items() if k != "bias"}
    a, b = ours(**kwargs), theirs(**kwargs)
    assert a.state_dict().keys() == b.state_dict().keys()
    for t in b.state_dict().values():
        t.uniform_()
    a.load_state_dict(b.state_dict())
    for key, t in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], t) and a.state_dict()[key].dtype == t.dtype
    b.load_state_dict(ours(**kwargs).state_dict())
    assert repr(a).split("(", 1)[1] == repr(b).split("(", 1)[1]


def test_dropout_add_modules_have_torchs_parameters():
    rms = ft.DropoutAddRMSNorm(8, p=0.1)
    assert rms.state_dict().keys() == torch.nn.RMSNorm(8).state_dict().keys()
    ln = ft.DropoutAddLayerNorm((2, 8), p=0.1, bias=False)
    assert ln.state_dict().keys() == torch.nn.LayerNorm((2, 8), bias=False).state_dict().keys()
    assert ft.DropoutAddLayerNorm(8, elementwise_affine=False).weight is None
    assert torch.equal(ln.weight, torch.ones(2, 8)) and ln.bias is None
    assert "p=0.1" in repr(rms)


def test_softmax_modules_default_to_the_last_dim():
    assert ft.Softmax().dim == -1 and ft.Softmax(1).dim == 1
    assert isinstance(ft.Softmax(), torch.nn.Softmax)
    assert ft.LogSoftmax().dim == -1 and ft.LogSoftmax(0).dim == 0
    assert isinstance(ft.LogSoftmax(), torch.nn.LogSoftmax)


# ----- numerics of the fusions (run by the oracle) against torch's modules -----


def _grads(module, x, g):
    y = module(x)
    params = [p for p in module.parameters()]
    return [y, *torch.autograd.grad(y, [x, *params], g)]


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 33), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("ours", "theirs", "kwargs"), [
    (ft.RMSNorm, torch.nn.RMSNorm, {}),
    (ft.RMSNorm, torch.nn.RMSNorm, {"eps": 1e-2, "elementwise_affine": False}),
    (ft.LayerNorm, torch.nn.LayerNorm, {}),
    (ft.LayerNorm, torch.nn.LayerNorm, {"bias": False}),
    (ft.LayerNorm, torch.nn.LayerNorm, {"elementwise_affine": False}),
])
def test_modules_match_torch(oracle, ours, theirs, kwargs, dtype, shape):
    torch.manual_seed(0)
    a, b = ours(shape[-1], dtype=dtype, **kwargs), theirs(shape[-1], dtype=dtype, **kwargs)
    for p in a.parameters():
        p.data.uniform_(0.5, 1.5)
    b.load_state_dict(a.state_dict())
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    rtol, atol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-12, 1e-12)
    for got, want in zip(_grads(a, x, g), _grads(b, x, g), strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_multi_dim_normalized_shape(oracle):
    x = torch.randn(2, 3, 4, 5, dtype=F64, requires_grad=True)
    w = torch.rand(4, 5, dtype=F64, requires_grad=True)
    b = torch.rand(4, 5, dtype=F64, requires_grad=True)
    torch.testing.assert_close(ft.rms_norm(x, (4, 5), w), torch.nn.functional.rms_norm(
        x, (4, 5), w))
    torch.testing.assert_close(ft.layer_norm(x, [4, 5], w, b, 1e-3),
                               torch.nn.functional.layer_norm(x, [4, 5], w, b, 1e-3))
    assert torch.autograd.gradcheck(lambda x, w, b: ft.layer_norm(x, (4, 5), w, b), (x, w, b))


SOFTMAXES = {"softmax": (ft.softmax, torch.softmax, ft.Softmax, torch.nn.Softmax),
             "log_softmax": (ft.log_softmax, torch.log_softmax, ft.LogSoftmax,
                             torch.nn.LogSoftmax)}


@pytest.mark.parametrize("dim", [-1, 0, 1, 2])
@pytest.mark.parametrize("kind", list(SOFTMAXES))
def test_softmax_matches_torch_along_any_dim(oracle, kind, dim):
    ours, theirs, our_module, their_module = SOFTMAXES[kind]
    x = torch.randn(3, 4, 5, dtype=F64, requires_grad=True)
    y = ours(x, dim)
    torch.testing.assert_close(y, theirs(x, dim))
    assert y.is_contiguous()
    assert torch.autograd.gradcheck(lambda x: ours(x, dim), (x,))
    torch.testing.assert_close(our_module(dim)(x), their_module(dim)(x))
    torch.testing.assert_close(ours(x.float(), dim, dtype=F64), theirs(x.float(), dim,
                                                                      dtype=F64))


@pytest.mark.parametrize("kind", list(SOFTMAXES))
@pytest.mark.parametrize(("shape", "dim", "operand"), [
    ((6, 16), 1, (6, 16)), ((2, 3, 16), -1, (6, 16)), ((32, 16), 0, (1, 32, 16)),
    ((2, 30, 4, 5), 1, (2, 30, 20)), ((2, 3, 4, 1, 1), 2, (6, 4)), ((7,), 0, (1, 7)),
    ((1, 5, 1), 1, (1, 5)), ((), 0, (1, 1)), ((3, 1, 400), 1, (3, 1, 400)),
    ((6, 16), 0, (16, 6)), ((2, 3, 4, 5), 1, (40, 3)), ((3, 1, 4), 1, (12, 1))], ids=str)
def test_softmax_runs_on_its_operand_one_fusion_a_pass(oracle, monkeypatch, kind, shape, dim,
                                                       operand):
    """Along the last dim (or a dim whose later dims are all of size 1) the fusion takes rows
    [N, H]; along another, [G, N, H] around the dim, normalized along N in each group, or
    for groups of fewer than COLUMNS_MIN_GROUP elements rows [G * H, N] moved from x, y and
    dy: one fusion forward and one backward, bf16 kept to the fusion and its output in x's
    shape, matching torch."""
    ours, theirs = SOFTMAXES[kind][:2]
    ran = []
    monkeypatch.setattr(_fusions, "run", lambda fd, inputs: ran.append(
        (fd.name, [tuple(t.shape) for t in inputs])) or run_on_oracle(fd, inputs))
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    y = ours(x, dim)
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
    rank = 3 if len(operand) == 3 else 2
    assert [(name.startswith(kind + ("_columns" if rank == 3 else "_")), shapes)
            for name, shapes in ran] == [(True, [operand]), (True, [operand, operand])]
    assert y.shape == grad.shape == x.shape and y.dtype == torch.bfloat16
    want = theirs(x.double(), dim)
    (want_grad,) = torch.autograd.grad(want, x, torch.ones_like(want))
    torch.testing.assert_close(y.double(), want, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(grad.double(), want_grad.double(), atol=3e-2, rtol=3e-2)


def test_rms_norm_default_eps_is_torchs(oracle):
    """torch's default is the compute type's epsilon (float32's for half types)."""
    for dtype in (torch.bfloat16, torch.float32, F64):
        x = torch.full((2, 4), 1e-4, dtype=dtype)
        torch.testing.assert_close(ft.rms_norm(x, (4,)), torch.nn.functional.rms_norm(x, (4,)))


def test_gradcheck_in_float64(oracle):
    x = torch.randn(5, 12, dtype=F64, requires_grad=True)
    r = torch.randn(5, 12, dtype=F64, requires_grad=True)
    w = torch.rand(12, dtype=F64, requires_grad=True)
    b = torch.rand(12, dtype=F64, requires_grad=True)

    def dropped(fn, *args, **kwargs):
        torch.manual_seed(3)  # the same mask at every evaluation
        return fn(*args, p=0.3, **kwargs)

    cases = [
        (lambda x, w: ft.rms_norm(x, 12, w), (x, w)),
        (lambda x: ft.rms_norm(x, 12), (x,)),
        (lambda x, w, b: ft.layer_norm(x, 12, w, b), (x, w, b)),
        (lambda x, w: ft.hf_rms_norm(x, w, 1e-6), (x, w)),
        (lambda x, w: ft.gemma_rms_norm(x, w, 1e-6), (x, w)),
        (lambda x: ft.cross_entropy(x, torch.tensor([3, 0, -100, 11, 5])), (x,)),
        (lambda x: ft.cross_entropy(x, torch.tensor([3, 0, 1, 11, 5]), reduction="none",
                                    label_smoothing=0.1), (x,)),
        (lambda x, r, w: dropped(ft.dropout_add_rms_norm, x, r, 12, w), (x, r, w)),
        (lambda x, w: dropped(ft.dropout_add_rms_norm, x, None, 12, w), (x, w)),
        (lambda x, r: ft.dropout_add_rms_norm(x, r, 12, None), (x, r)),
        (lambda x, r, w, b: dropped(ft.dropout_add_layer_norm, x, r, 12, w, b), (x, r, w, b)),
        (lambda x, r, b: dropped(ft.dropout_add_layer_norm, x, r, 12, None, b), (x, r, b)),
    ]
    for fn, args in cases:
        assert torch.autograd.gradcheck(fn, args)


def test_a_frozen_weight_gets_no_column_sum(monkeypatch):
    """Without a weight gradient to compute, the backward fusion has no column reduction."""
    ran = []
    monkeypatch.setattr(_fusions, "run", lambda fd, inputs: ran.append(fd) or run_on_oracle(
        fd, inputs))
    x = torch.randn(4, 8, requires_grad=True)
    norm = ft.RMSNorm(8)
    norm.weight.requires_grad_(False)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is None
    assert [len(fd.fusion.outputs) for fd in ran] == [2, 1]  # (y, rstd), (grad_x)


@pytest.mark.parametrize("module", [ft.RMSNorm, ft.LayerNorm])
def test_autograd_records_a_call_only_where_a_gradient_is_wanted(oracle, monkeypatch, module):
    """The eager path runs its implementation bare where autograd would record nothing, and
    through its autograd.Function where any argument wants a gradient: the weight alone (an
    input that does not) counts, and so does x alone (a frozen weight)."""
    applied = []
    apply = torch.autograd.Function.apply.__func__
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(
        lambda cls, *args: applied.append(cls.__name__) or apply(cls, *args)))
    x = torch.randn(4, 8, dtype=F64)
    norm = module(8, dtype=F64)
    expected = norm(x.clone().requires_grad_())
    assert len(applied) == 1
    with torch.no_grad():
        inference = norm(x.clone().requires_grad_())
    assert inference.grad_fn is None and torch.equal(inference, expected.detach())
    assert norm(x).grad_fn is not None  # only the weight wants one
    assert len(applied) == 2
    norm.requires_grad_(False)
    assert norm(x).grad_fn is None and len(applied) == 2  # bare
    assert norm(x.clone().requires_grad_()).grad_fn is not None
    assert ft.softmax(x.clone().requires_grad_(), -1).grad_fn is not None
    assert ft.softmax(x, -1).grad_fn is None
    assert len(applied) == 4


@pytest.mark.parametrize("op", [lambda t: ft.rms_norm(t, [8]), lambda t: ft.softmax(t, -1)],
                         ids=["rms_norm", "softmax"])
def test_forward_mode_ad_is_refused_not_dropped(oracle, op):
    """A dual tensor does not require grad, so forward-mode AD must not take the bare path
    (its tangent would be lost without a word): the autograd.Function refuses it, under
    torch.no_grad too (which does not turn forward AD off)."""
    from torch.autograd import forward_ad

    x = torch.randn(4, 8, dtype=F64)
    for context in (torch.enable_grad, torch.no_grad):
        with forward_ad.dual_level(), context():
            dual = forward_ad.make_dual(x, torch.ones_like(x))
            with pytest.raises(RuntimeError, match="jvp"):
                op(dual)


# ----- dropout + residual add + norm -----


def _reference_block(x, residual, mask, p, norm):
    """torch's pre-norm block, with fuser's mask: h = residual + dropout(x); norm(h)."""
    h = x * mask / (1 - p) if mask is not None else x
    h = h if residual is None else residual + h
    return norm(h), h


@pytest.mark.parametrize("normalized", [(16,), (2, 8)], ids=["last", "last-two"])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_dropout_add_norm_matches_torch_with_the_same_mask(oracle, kind, with_residual,
                                                           normalized):
    """Also over the last two dimensions, where the rows are [6, 16] of a [2, 3, 2, 8] input
    and the residual must be flattened as x is (not along x's last dimension alone)."""
    p, shape = 0.25, (2, 3, *((16,) if normalized == (16,) else (2, 8)))
    ours = (ft.DropoutAddRMSNorm(normalized, p=p, dtype=F64) if kind == "rms"
            else ft.DropoutAddLayerNorm(normalized, p=p, dtype=F64))
    theirs = (torch.nn.RMSNorm(normalized, dtype=F64) if kind == "rms"
              else torch.nn.LayerNorm(normalized, dtype=F64))
    for t in ours.parameters():
        t.data.uniform_(0.5, 1.5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    residual = torch.randn(shape, dtype=F64, requires_grad=True) if with_residual else None
    torch.manual_seed(7)
    y, h = ours(x, residual)
    torch.manual_seed(7)  # the mask fuser.torch draws: torch's bernoulli_ on a bool tensor
    mask = torch.empty((6, 16), dtype=torch.bool).bernoulli_(1 - p).view(shape)
    y_ref, h_ref = _reference_block(x, residual, mask, p, theirs)
    torch.testing.assert_close((y, h), (y_ref, h_ref))
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    leaves = [t for t in (x, residual, *ours.parameters()) if t is not None]
    ref_leaves = [t for t in (x, residual, *theirs.parameters()) if t is not None]
    got = torch.autograd.grad((y, h), leaves, (gy, gh))
    want = torch.autograd.grad((y_ref, h_ref), ref_leaves, (gy, gh))
    torch.testing.assert_close(got, want)


def test_dropout_is_repeatable_under_manual_seed_and_off_in_eval(oracle):
    block = ft.DropoutAddRMSNorm(16, p=0.5)
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    torch.manual_seed(1)
    first = block(x, residual)
    torch.manual_seed(1)
    assert all(torch.equal(a, b) for a, b in zip(first, block(x, residual), strict=True))
    assert not torch.equal(first[1], block(x, residual)[1])  # a fresh mask
    block.eval()
    y, h = block(x, residual)
    torch.testing.assert_close(h, x + residual)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + residual, (16,),
                                                               block.weight))


def test_first_block_without_dropout_returns_x_as_the_residual(oracle):
    x = torch.randn(4, 16)
    y, h = ft.DropoutAddLayerNorm(16, p=0.1).eval()(x)
    assert h is x
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,)))


# ----- mixed dtypes and Hugging Face's LlamaRMSNorm -----


class GemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: the same look, but it scales by 1 + weight."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
def test_hf_rms_norm_matches_llama(oracle, x_dtype, w_dtype):
    hf = LlamaRMSNorm(64).to(w_dtype)
    hf.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64).to(x_dtype)
    y = ft.hf_rms_norm(x, hf.weight, hf.variance_epsilon)
    want = hf(x)
    assert y.dtype == want.dtype
    torch.testing.assert_close(y, want)


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32)])
def test_gemma_rms_norm_matches_gemma(oracle, x_dtype, w_dtype):
    """Output and gradients of fuser's GemmaRMSNorm against Gemma's own: y scaled by 1 +
    weight in float32, in x's dtype; the weight's gradient in its own dtype. Each is as close
    to Gemma's module run in float64 as Gemma's own in these dtypes (twice its error, plus
    one unit of the output's dtype at the largest value: both round, at different ties)."""
    torch.manual_seed(0)
    theirs = GemmaRMSNorm(64).to(w_dtype)
    theirs.weight.data.uniform_(-0.5, 0.5)
    ours = ft.GemmaRMSNorm(64, eps=theirs.eps, dtype=w_dtype)
    ours.load_state_dict(theirs.state_dict())
    exact = GemmaRMSNorm(64).double()
    exact.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 64).to(x_dtype).requires_grad_()
    g = torch.randn(3, 5, 64).to(x_dtype)
    got, want = _grads(ours, x, g), _grads(theirs, x, g)
    truth = _grads(exact, x.detach().double().requires_grad_(), g.double())
    assert [t.dtype for t in got] == [t.dtype for t in want] == [x_dtype, x_dtype, w_dtype]
    for i, (a, b, t) in enumerate(zip(got, want, truth, strict=True)):
        ours_err, gemma_err = ((u.double() - t).abs().max().item() for u in (a, b))
        floor = (2.0**-8 if a.dtype == torch.bfloat16 else 2.0**-20) * t.abs().max().item()
        assert ours_err <= 2 * gemma_err + floor, (i, ours_err, gemma_err, floor)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_mixed_dtypes_follow_torch(oracle):
    """A float32 weight on bfloat16 input: y in the input's dtype, each grad in its own."""
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    norm, ref = ft.RMSNorm(32), torch.nn.RMSNorm(32)
    y = norm(x)
    assert y.dtype == ref(x).dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32
    ln = ft.LayerNorm(32)
    assert ln(x).dtype == torch.nn.LayerNorm(32)(x).dtype


# ----- cross entropy -----


GRADIENT_IN_FORWARD, TWO_KERNELS = "_GradientInForwardBackward", "fuser_cross_entropyBackward"


def _node(loss) -> str:
    """The name of the autograd node that computed `loss` (under a reshape's view)."""
    node = loss.grad_fn
    while type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return type(node).__name__


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize(("reduction", "path"), [
    ("mean", GRADIENT_IN_FORWARD), ("sum", GRADIENT_IN_FORWARD), ("mean", TWO_KERNELS),
    ("sum", TWO_KERNELS), ("none", TWO_KERNELS)])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", [(7, 33), (1, 5), (33,), (2, 33, 4), (3, 5, 2, 3),
                                   (2, 40, 8), (3, 70, 2, 3)])
def test_cross_entropy_matches_torch(oracle, monkeypatch, shape, dtype, reduction, path,
                                     label_smoothing):
    """Loss and the logits' gradient against torch's, with an ignored row where there are
    several, for each reduction, with and without label smoothing, the gradient written in
    the forward or by the two kernels (forced: the record otherwise follows the last
    backward)."""
    record = _cross_entropy._FactorRecord.of(torch.empty(0))
    monkeypatch.setattr(record, "not_one", lambda: path == TWO_KERNELS)
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    classes = shape[1] if len(shape) > 2 else shape[-1]
    target = torch.randint(0, classes, shape[:1] + shape[2:] if len(shape) > 2 else shape[:-1])
    if len(shape) >= 2 and shape[0] > 2:
        target[2] = -100
    got = ft.cross_entropy(x, target, reduction=reduction, label_smoothing=label_smoothing)
    want = torch.nn.functional.cross_entropy(x, target, reduction=reduction,
                                             label_smoothing=label_smoothing)
    g = torch.randn_like(want)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _node(got) == path
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(torch.autograd.grad(got, x, g), torch.autograd.grad(want, x, g),
                               **tol)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("path", [GRADIENT_IN_FORWARD, TWO_KERNELS])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(7, 33), (33,), (2, 33, 4), (2, 40, 8)])
def test_cross_entropy_with_class_weights_matches_torch(oracle, monkeypatch, shape, reduction,
                                                        path, label_smoothing):
    """Each row's loss and gradient scaled by its target's weight, a mean divided by the sum
    of the weights of the rows not ignored, and label smoothing's term weighted per class,
    as torch's; the weights get no gradient."""
    record = _cross_entropy._FactorRecord.of(torch.empty(0))
    monkeypatch.setattr(record, "not_one", lambda: path == TWO_KERNELS)
    torch.manual_seed(1)
    classes = shape[1] if len(shape) > 1 else shape[0]
    x = torch.randn(shape, dtype=F64, requires_grad=True)
    target = torch.randint(0, classes, shape[:1] + shape[2:] if len(shape) > 2 else shape[:-1])
    if len(shape) > 1:
        target[1] = -100
    weight = torch.rand(classes, dtype=F64) + 0.5
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
    got = ft.cross_entropy(x, target, weight, **kwargs)
    want = torch.nn.functional.cross_entropy(x, target, weight, **kwargs)
    g = torch.randn_like(want)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x, g), torch.autograd.grad(want, x, g))
    if reduction != "none":
        assert _node(got) == path
    module = ft.CrossEntropyLoss(weight=weight, **kwargs)
    torch.testing.assert_close(module(x, target), want)


def test_class_weights_beside_label_smoothing_take_the_row_kernels(oracle, monkeypatch):
    """The smoothing term weighted per class is a column input of a row kernel: [N, C, d]
    logits are moved to rows for it (the outer kernel would need it along its rows), and the
    kernels get the weights, in the compute type, after the row scales."""
    ran = []
    monkeypatch.setattr(_fusions, "run", lambda fd, inputs: ran.append(
        (fd.name, [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs]))
        or run_on_oracle(fd, inputs))
    x = torch.randn(2, 40, 8, requires_grad=True)
    target = torch.randint(0, 40, (2, 8))
    torch.autograd.grad(ft.cross_entropy(x, target, torch.rand(40), label_smoothing=0.1), x)
    assert ran and all("_weighted_" in name and "_columns" not in name for name, _ in ran)
    assert ran[0][1][0] == (16, 40) and ran[0][1][-1] == (40,)
    ran.clear()
    torch.autograd.grad(ft.cross_entropy(x, target, torch.rand(40)), x)
    assert ran and all("_weighted" not in name and "_columns_" in name for name, _ in ran)


@pytest.mark.parametrize(("shape", "operand"), [((2, 40, 8), (2, 40, 8)),
                                                ((3, 70, 2, 3), (3, 70, 6)),
                                                ((2, 33, 4), (8, 33)), ((5, 300, 1), (5, 300))])
def test_cross_entropy_of_classes_along_dim_1_reads_them_in_place(oracle, monkeypatch,
                                                                  shape, operand):
    """Logits [N, C, d1, ...] go to the kernels as [N, C, d1 * ...] (classes along dim 1,
    the fusions' columns form), but for groups of fewer than COLUMNS_MIN_GROUP elements,
    moved to rows [N * d1 * ..., C]; trailing dims of one element are rows as they are."""
    ran = []
    monkeypatch.setattr(_fusions, "run", lambda fd, inputs: ran.append(
        (fd.name, tuple(inputs[0].shape))) or run_on_oracle(fd, inputs))
    x = torch.randn(shape, requires_grad=True)
    target = torch.randint(0, shape[1], shape[:1] + shape[2:])
    torch.autograd.grad(ft.cross_entropy(x, target), x)
    assert ran and {op for _, op in ran} == {operand}  # one kernel or two (the record's form)
    assert all(("_columns_" in name) == (len(operand) == 3) for name, _ in ran)


def test_cross_entropy_module_and_ignore_index(oracle):
    """CrossEntropyLoss is torch's module on fuser's op; a custom ignore_index; a batch
    whose rows are all ignored gives torch's nan mean and zero gradient."""
    torch.manual_seed(1)
    x = torch.randn(6, 10, requires_grad=True)
    target = torch.tensor([1, 7, 7, 0, 9, 7])
    ours = ft.CrossEntropyLoss(ignore_index=7, label_smoothing=0.2)
    assert isinstance(ours, torch.nn.CrossEntropyLoss)
    theirs = torch.nn.CrossEntropyLoss(ignore_index=7, label_smoothing=0.2)
    got, want = ours(x, target), theirs(x, target)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x), torch.autograd.grad(want, x))
    ignored = torch.full((6,), 7)
    got = ours(x, ignored)
    assert torch.isnan(got) and torch.isnan(theirs(x, ignored))
    (grad,) = torch.autograd.grad(got, x)
    assert torch.equal(grad, torch.zeros_like(x))


@pytest.fixture
def fresh_record(monkeypatch):
    """No backward of a reduced loss recorded yet: the next writes its gradient in the
    forward."""
    monkeypatch.setattr(_cross_entropy._FactorRecord, "_kept", {})




@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_writes_the_gradient_in_the_forward_while_the_factor_is_one(
        oracle, fresh_record, reduction, label_smoothing):
    """A reduced loss writes the logits' gradient in its forward and its backward scales it
    by the loss's gradient; a backward given another factor than one sends the next forward
    to the two kernels, and one given one sends it back. Each loss and gradient is torch's."""
    torch.manual_seed(2)
    x = torch.randn(7, 33, dtype=F64, requires_grad=True)
    target = torch.tensor([3, 0, -100, 11, 5, 32, 0])
    kwargs = {"reduction": reduction, "label_smoothing": label_smoothing}
    want = torch.nn.functional.cross_entropy(x, target, **kwargs)
    for factor, node in [(1.0, GRADIENT_IN_FORWARD), (1.0, GRADIENT_IN_FORWARD),
                         (0.25, GRADIENT_IN_FORWARD), (3.0, TWO_KERNELS),
                         (1.0, TWO_KERNELS), (-2.0, GRADIENT_IN_FORWARD),
                         (1.0, TWO_KERNELS), (1.0, GRADIENT_IN_FORWARD)]:
        got = ft.cross_entropy(x, target, **kwargs)
        assert _node(got) == node, factor
        g = torch.tensor(factor, dtype=F64)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(torch.autograd.grad(got, x, g),
                                   torch.autograd.grad(want, x, g, retain_graph=True))
        assert _cross_entropy._FactorRecord.of(x).not_one() == (factor != 1)


def test_cross_entropy_gradient_in_forward_only_where_it_is_wanted(oracle, fresh_record):
    """Unreduced losses, logits without a gradient, no grad mode and saved-tensor hooks
    (which may hand the backward a copy of the gradient it scales in place) keep the two
    kernels; the forward that writes the gradient keeps it alone, not the logits."""
    x = torch.randn(6, 16, requires_grad=True)
    target = torch.tensor([1, 2, 3, 4, 5, 6])
    loss = ft.cross_entropy(x, target)
    (kept,) = loss.grad_fn.saved_tensors
    assert kept.shape == x.shape and kept.data_ptr() != x.data_ptr()
    assert _node(ft.cross_entropy(x, target, reduction="none")) == TWO_KERNELS
    assert ft.cross_entropy(x.detach(), target).grad_fn is None
    with torch.no_grad():
        assert ft.cross_entropy(x, target).grad_fn is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        loss = ft.cross_entropy(x, target)
    assert _node(loss) == TWO_KERNELS
    torch.testing.assert_close(torch.autograd.grad(loss, x), torch.autograd.grad(
        torch.nn.functional.cross_entropy(x, target), x))


def test_cross_entropy_gradient_in_forward_serves_a_second_backward(oracle, fresh_record):
    """retain_graph=True: a second backward scales again the gradient the first left
    scaled; where the first scaled it by zero, nothing is left to scale and it is refused.
    create_graph=True is refused by name."""
    x = torch.randn(5, 9, dtype=F64, requires_grad=True)
    target = torch.tensor([0, 8, 3, -100, 4])
    want = torch.nn.functional.cross_entropy(x, target, label_smoothing=0.2)
    got = ft.cross_entropy(x, target, label_smoothing=0.2)
    assert _node(got) == GRADIENT_IN_FORWARD
    for factor in (0.5, 3.0, 1.0):
        g = torch.tensor(factor, dtype=F64)
        torch.testing.assert_close(torch.autograd.grad(got, x, g, retain_graph=True),
                                   torch.autograd.grad(want, x, g, retain_graph=True))
    _cross_entropy._FactorRecord.of(x).record.fill_(0)
    got = ft.cross_entropy(x, target)
    torch.autograd.grad(got, x, torch.tensor(0.0, dtype=F64), retain_graph=True)
    with pytest.raises(UnsupportedFusionError, match=r"scaled it by 0\.0"):
        torch.autograd.grad(got, x)
    _cross_entropy._FactorRecord.of(x).record.fill_(0)
    with pytest.raises(UnsupportedFusionError, match="create_graph=True"):
        torch.autograd.grad(ft.cross_entropy(x, target), x, create_graph=True)


# ----- patch -----


class ShiftedRMSNorm(GemmaRMSNorm):
    """An RMSNorm's look (name, weight, eps) over other math: patch must leave it alone."""

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + 1


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({
            "rms": torch.nn.RMSNorm(16, eps=1e-5), "ln": torch.nn.LayerNorm(16, bias=False),
            "hf": LlamaRMSNorm(16), "gemma": GemmaRMSNorm(16), "shifted": ShiftedRMSNorm(16),
            "proj": torch.nn.Linear(16, 16),
        }) for _ in range(2)])
        self.shared = self.layers[0]["rms"]
        self.final = torch.nn.RMSNorm(16, elementwise_affine=False)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer["proj"](layer["shifted"](layer["gemma"](layer["hf"](layer["ln"](
                layer["rms"](h))))))
        return self.final(self.shared(h))


def test_patch_swaps_norms_keeping_their_parameters(oracle):
    torch.manual_seed(0)
    model = TinyModel()
    for t in model.parameters():
        t.data.uniform_(0.5, 1.5)
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 8)
    before = model(x)
    model.eval()
    with pytest.warns(UserWarning) as warned:
        replaced = ft.patch(model)
    assert [str(w.message).split(":")[0] for w in warned] == [
        f"fuser.torch.patch left layers.{i}.shifted (ShiftedRMSNorm) alone" for i in (0, 1)]
    assert "computes neither LlamaRMSNorm's" in str(warned[0].message)
    names = [r.name for r in replaced]
    assert names == ["layers.0.rms", "layers.0.ln", "layers.0.hf", "layers.0.gemma",
                     "layers.1.rms", "layers.1.ln", "layers.1.hf", "layers.1.gemma", "shared",
                     "final"]
    assert type(model.layers[0]["rms"]) is ft.RMSNorm and model.shared is model.layers[0]["rms"]
    assert type(model.layers[1]["ln"]) is ft.LayerNorm and model.layers[1]["ln"].bias is None
    assert type(model.layers[0]["hf"]) is ft.HFRMSNorm
    assert type(model.layers[0]["gemma"]) is ft.GemmaRMSNorm
    assert type(model.layers[0]["shifted"]) is ShiftedRMSNorm
    assert isinstance(replaced[0].old, torch.nn.RMSNorm) and replaced[0].new is model.shared
    assert all(not r.new.training for r in replaced)
    assert model.layers[0]["rms"].eps == 1e-5 and model.layers[0]["hf"].variance_epsilon == 1e-6
    assert model.layers[1]["gemma"].eps == 1e-6
    assert all(a is b for a, b in zip(params.values(), model.parameters(), strict=True))
    assert dict(model.named_parameters()).keys() == params.keys()
    assert model.state_dict().keys() == state.keys()
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_patch_leaves_models_without_norms_and_meta_weights_alone():
    assert ft.patch(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []
    with torch.device("meta"):
        model = torch.nn.Sequential(LlamaRMSNorm(4))
    with pytest.warns(UserWarning, match="meta device"):
        assert ft.patch(model) == []


# ----- custom ops: schemas, fake implementations, autograd registrations -----


def _op_cases():
    x, r, w, b = torch.randn(6, 16), torch.randn(6, 16), torch.rand(16), torch.rand(16)
    mask = torch.rand(6, 16) > 0.3
    xb = x.bfloat16()

    def grad(*ts):
        return [t.clone().requires_grad_() for t in ts]

    xg, rg, wg, bg = grad(x, r, w, b)
    ops = torch.ops.fuser
    return [
        (ops.rms_norm.default, (x, None, None, w, 1.0, 1e-6, torch.float32, False, False)),
        (ops.rms_norm.default, (xg, None, None, wg, 1.0, 1e-6, torch.float32, False, False)),
        (ops.rms_norm.default, (xg, None, None, None, 1.0, 1e-6, torch.float32, False, False)),
        (ops.rms_norm.default, (xb, None, None, w, 1.0, 1e-6, torch.float32, True, False)),
        (ops.rms_norm.default, (xg, None, None, wg, 1.0, 1e-6, torch.float32, False, True)),
        (ops.rms_norm.default, (xg, mask, rg, wg, 1 / 0.7, 1e-6, torch.float32, False, False)),
        (ops.rms_norm.default, (xg, mask, None, wg, 1 / 0.7, 1e-6, torch.float32, False,
                                False)),
        (ops.layer_norm.default, (xg, None, None, wg, bg, 1.0, 1e-5)),
        (ops.layer_norm.default, (xg, None, None, None, bg, 1.0, 1e-5)),
        (ops.layer_norm.default, (xg, mask, rg, wg, bg, 1 / 0.7, 1e-5)),
        (ops.layer_norm.default, (xg, None, rg, wg, None, 1.0, 1e-5)),
        (ops.softmax.default, (xg, 1, False)),
        (ops.softmax.default, (xb, 1, False)),
        (ops.softmax.default, (xg, 0, True)),
        (ops.softmax.default, (xg.reshape(2, 3, 16).detach().requires_grad_(), 1, False)),
        (ops.softmax.default, (xb.reshape(2, 3, 16), 2, True)),
        (ops.cross_entropy.default, (xg, torch.tensor([3, 0, -100, 15, 1, 2]), None, -100,
                                     0.0, "mean")),
        (ops.cross_entropy.default, (xb, torch.tensor([3, 0, 4, 15, 1, 2]), None, -100, 0.1,
                                     "none")),
        (ops.cross_entropy.default, (xg, torch.tensor([3, 0, 4, 15, 1, 2]), None, 4, 0.1,
                                     "sum")),
        (ops.cross_entropy.default, (xg, torch.tensor([3, 0, -100, 15, 1, 2]), w, -100, 0.0,
                                     "mean")),
        (ops.cross_entropy.default, (xg.reshape(2, 16, 3).detach().requires_grad_(),
                                     torch.tensor([[3, 0, -100], [15, 1, 2]]), w, -100, 0.0,
                                     "none")),
        (ops.cross_entropy.default, (xg, torch.tensor([3, 0, -100, 15, 1, 2]), w, -100, 0.1,
                                     "sum")),
    ]


@pytest.mark.parametrize("case", range(len(_op_cases())))
def test_opcheck(oracle, case):
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args)


def test_backward_ops_opcheck(oracle):
    x, dy, w = torch.randn(6, 16), torch.randn(6, 16), torch.rand(16)
    _, _, rstd = torch.ops.fuser.rms_norm(x, None, None, w, 1.0, 1e-6, torch.float32, False,
                                          False)
    _, _, mean, rstd_ln = torch.ops.fuser.layer_norm(x, None, None, w, w, 1.0, 1e-5)
    ops = torch.ops.fuser
    for unit_offset in (False, True):
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, None, x, None, None, rstd, w,
                                                              1.0, True, unit_offset))
    torch.library.opcheck(ops.layer_norm_backward.default, (dy, None, x, None, None, mean,
                                                            rstd_ln, w, torch.float32, 1.0,
                                                            True))
    for dim in (0, 1):
        torch.library.opcheck(ops.softmax_backward.default, (dy, torch.softmax(x, dim), dim,
                                                             False))
        torch.library.opcheck(ops.softmax_backward.default, (dy, torch.log_softmax(x, dim), dim,
                                                             True))
    target = torch.tensor([3, 0, -100, 15, 1, 2])
    _, lse = ops.cross_entropy(x, target, None, -100, 0.1, "none")
    torch.library.opcheck(ops.cross_entropy_backward.default,
                          (torch.randn(6), x, target, None, lse, -100, 0.1, "none"))
    for smoothing in (0.0, 0.1):
        _, lse = ops.cross_entropy(x, target, w, -100, smoothing, "mean")
        torch.library.opcheck(ops.cross_entropy_backward.default,
                              (torch.randn(()), x, target, w, lse, -100, smoothing, "mean"))


def test_fake_and_meta_tensors_give_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        y = ft.RMSNorm(64, dtype=torch.float32)(x)
        y2, h = ft.DropoutAddLayerNorm(64, p=0.1)(x, x)
        s = ft.softmax(x, 1)
        ls = ft.log_softmax(x, -1)
        loss = ft.cross_entropy(x.reshape(6, 64), torch.zeros(6, dtype=torch.int64))
        losses = ft.cross_entropy(x.reshape(6, 64), torch.zeros(6, dtype=torch.int64),
                                  reduction="none")
    assert (loss.shape, loss.dtype, losses.shape) == ((), torch.bfloat16, (6,))
    assert (y.shape, y.dtype) == ((2, 3, 64), torch.bfloat16)
    assert y2.shape == h.shape == (2, 3, 64) and s.shape == ls.shape == (2, 3, 64)
    meta = ft.LayerNorm(64, device="meta")(torch.empty(5, 64, device="meta"))
    assert meta.device.type == "meta" and meta.shape == (5, 64)


def test_saved_tensors_are_the_minimum(oracle):
    """The backward keeps x, the weight and the per-row statistics: no normalized copy."""
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    x = torch.randn(6, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ft.rms_norm(x, 16, torch.rand(16, requires_grad=True))
    assert sorted(saved) == [(6, 1), (6, 16), (16,)]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ft.layer_norm(x, 16)
    assert sorted(saved) == [(6, 1), (6, 1), (6, 16)]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ft.softmax(x, -1)
        ft.log_softmax(x, 0)
    assert saved == [(6, 16), (6, 16)]


def test_double_backward_raises_a_fuser_error(oracle):
    x = torch.randn(4, 8, requires_grad=True)
    for fn in (lambda x: ft.rms_norm(x, 8), lambda x: ft.layer_norm(x, 8),
               lambda x: ft.softmax(x, -1)):
        (g,) = torch.autograd.grad((fn(x) ** 2).sum(), x, create_graph=True)
        with pytest.raises(UnsupportedFusionError, match="double backward"):
            g.sum().backward()


# ----- torch.compile -----


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = ft.DropoutAddRMSNorm(16, p=0.2)
        self.proj = torch.nn.Linear(16, 16)
        self.norm2 = ft.LayerNorm(16)
        self.attn = ft.Softmax(-1)

    def forward(self, x):
        y, residual = self.norm1(x)
        return self.attn(self.norm2(self.proj(y))) + residual


def _recording_compile(fn, **kwargs):
    """torch.compile(fn, fullgraph=True, **kwargs) with a backend that keeps each graph dynamo
    traces: (the compiled function, the graphs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend, **kwargs), graphs


def _ops_in(graphs) -> set[str]:
    return {str(n.target).removesuffix(".default") for gm in graphs for n in gm.graph.nodes}


def test_compile_fullgraph_has_the_ops_and_no_break(oracle):
    compiled, graphs = _recording_compile(Block(), dynamic=True)
    for rows in (3, 5):
        compiled(torch.randn(rows, 2, 16, requires_grad=True)).sum().backward()
    assert {"fuser.rms_norm", "fuser.layer_norm", "fuser.softmax"} <= _ops_in(graphs)


def test_compile_fullgraph_takes_cross_entropy(oracle):
    loss, graphs = _recording_compile(lambda x, t: ft.cross_entropy(x, t, label_smoothing=0.1))
    x = torch.randn(5, 16, requires_grad=True)
    target = torch.tensor([1, 0, -100, 15, 3])
    got = loss(x, target)
    (grad,) = torch.autograd.grad(got, x)
    want = torch.nn.functional.cross_entropy(x, target, label_smoothing=0.1)
    torch.testing.assert_close((got, grad), (want, torch.autograd.grad(want, x)[0]))
    assert "fuser.cross_entropy" in _ops_in(graphs)


def test_compile_aot_matches_eager(oracle):
    torch._dynamo.reset()
    block = Block().eval()
    x = torch.randn(3, 4, 16, requires_grad=True)
    eager = block(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    (g_compiled,) = torch.autograd.grad(compiled.sum(), x)
    torch.testing.assert_close((compiled, g_compiled), (eager, g_eager))


# ----- errors -----


@pytest.mark.parametrize(("call", "message"), [
    (lambda: ft.rms_norm(torch.ones(2, 4, dtype=torch.int32), 4), r"input has dtype torch.int32"),
    (lambda: ft.rms_norm(torch.ones(2, 4), (3,)), r"normalized_shape \[3\] must be the last"),
    (lambda: ft.rms_norm(torch.ones(2, 4), (2, 2, 4)), r"normalized_shape"),
    (lambda: ft.layer_norm(torch.ones(2, 4), 4, torch.ones(3)), r"weight has shape \[3\]"),
    (lambda: ft.layer_norm(torch.ones(2, 4), 4, None, torch.ones(4, dtype=torch.int64)),
     r"bias has dtype torch.int64; fuser.torch takes torch.bfloat16"),
    (lambda: ft.softmax(torch.ones(2, 4), 2), r"dim=2 .* pass an int from -2 to 1"),
    (lambda: ft.softmax(torch.ones(2, 4), None), r"dim=None"),
    (lambda: ft.softmax(torch.ones(2, 4, dtype=torch.complex64), -1), r"complex64"),
    (lambda: ft.softmax(torch.ones(2, 4), True), r"dim=True .* pass an int from -2 to 1"),
    (lambda: ft.log_softmax(torch.ones(2, 4), -3), r"log_softmax: dim=-3 .* from -2 to 1"),
    (lambda: ft.log_softmax(torch.ones(2, 4), 0, dtype=torch.int32), r"torch.int32"),
    (lambda: ft.dropout_add_rms_norm(torch.ones(2, 4), None, 4, p=1.5),
     r"p=1.5; it must be in \[0, 1\]"),
    (lambda: ft.dropout_add_rms_norm(torch.ones(2, 4), torch.ones(4), 4),
     r"residual has shape \[4\]; it must be the input's shape \[2, 4\]"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64),
                              weight=torch.ones(3)), r"weight has shape \[3\]; .* \[4\]"),
    (lambda: ft.cross_entropy(torch.ones(2, 4, 5), torch.zeros(2, 5, dtype=torch.int64),
                              weight=torch.ones(5)), r"weight has shape \[5\]; .* \[4\]"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64),
                              weight=torch.ones(4, dtype=torch.int64)), r"weight has dtype"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64),
                              weight=torch.ones(4, requires_grad=True)),
     r"weight requires a gradient.* pass weight.detach\(\)"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64),
                              reduction="avg"), r"reduction='avg'; pass one of 'mean'"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64),
                              label_smoothing=1.5), r"label_smoothing=1.5; it must be in"),
    (lambda: ft.cross_entropy(torch.ones(2, 4, 3), torch.zeros(2, 4, dtype=torch.int64)),
     r"target has shape \[2, 4\]; for input of shape \[2, 4, 3\] it must be \[2, 3\]"),
    (lambda: ft.cross_entropy(torch.ones(()), torch.zeros((), dtype=torch.int64)),
     r"input is a scalar; fuser takes logits \[C\], \[N, C\] or \[N, C, d1, ...\]"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, 4)),
     r"target has dtype torch.float32; .* torch.int64"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(3, dtype=torch.int64)),
     r"target has shape \[3\]; for input of shape \[2, 4\] it must be \[2\]"),
    (lambda: ft.cross_entropy(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64,
                                                            device="meta")),
     r"target is on meta, input on cpu; move target to cpu"),
])
def test_errors_name_the_value_and_the_allowed_set(call, message):
    with pytest.raises(BadInputError, match=message):
        call()


def test_cpu_tensors_are_refused_by_the_executor():
    with pytest.raises(BadInputError, match="move it to a CUDA device"):
        ft.RMSNorm(8)(torch.randn(2, 8))


# ----- every fusion fuser.torch builds schedules and compiles (NVRTC, offline) -----


def _specs():
    bf, f32 = DataType.BFloat16, DataType.Float
    for rms in (True, False):
        for weight in (None, bf):
            for residual in (None, bf, f32):
                for dropout in (False, True):
                    yield NormSpec(rms, bf, bf, weight=weight, bias=None if rms else weight,
                                   residual=residual, dropout=dropout)
    yield NormSpec(True, bf, f32, weight=f32, hf=True)
    yield NormSpec(True, bf, bf, weight=bf, unit_offset=True)
    yield NormSpec(True, bf, bf, weight=f32, unit_offset=True)
    yield NormSpec(False, DataType.Double, DataType.Double, weight=DataType.Double,
                   bias=DataType.Double, residual=DataType.Double, dropout=True)


def _fusion_cases() -> list:
    cases = []
    for spec in _specs():
        cases.append(pytest.param(lambda spec=spec: _fusions.norm_forward(spec),
                                  id=f"{spec.name('fwd')}-{spec}"))
        for affine in sorted({True, spec.weight is not None}):
            cases.append(pytest.param(lambda spec=spec, affine=affine: _fusions.norm_backward(
                spec, affine), id=f"{spec.name('bwd')}-{spec}-{affine}"))
    for dtype in (DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double):
        for log in (False, True):
            for columns in (False, True):
                cases.append(pytest.param(
                    lambda d=dtype, log=log, columns=columns: _fusions.softmax_forward(
                        d, log, columns), id=f"softmax-{dtype}-log{log}-columns{columns}"))
                cases.append(pytest.param(
                    lambda d=dtype, log=log, columns=columns: _fusions.softmax_backward(
                        d, d, log, columns), id=f"softmax-bwd-{dtype}-log{log}-columns{columns}"))
        cases.append(pytest.param(lambda d=dtype: _fusions.logsumexp_forward(d, True),
                                  id=f"logsumexp-{dtype}"))
        for columns in (False, True):
            cases.append(pytest.param(
                lambda d=dtype, columns=columns: _fusions.cross_entropy_backward(d, columns),
                id=f"cross-entropy-bwd-{dtype}-columns{columns}"))
            for sums in (False, True):
                cases.append(pytest.param(
                    lambda d=dtype, c=columns, s=sums: _fusions.cross_entropy_forward_gradient(
                        d, s, c), id=f"cross-entropy-fwd-grad-{dtype}-sums{sums}-columns{columns}"))
        cases.append(pytest.param(
            lambda d=dtype: _fusions.cross_entropy_forward_gradient(d, True, False, True),
            id=f"cross-entropy-fwd-grad-weighted-{dtype}"))
        cases.append(pytest.param(lambda d=dtype: _fusions.cross_entropy_backward(d, False, True),
                                  id=f"cross-entropy-bwd-weighted-{dtype}"))
        cases.append(pytest.param(lambda d=dtype: _fusions.logsumexp_forward(d, True, False, True),
                                  id=f"logsumexp-weighted-{dtype}"))
        cases.append(pytest.param(lambda d=dtype: _fusions.logsumexp_forward(d, False, True),
                                  id=f"logsumexp-columns-{dtype}"))
    return cases


@pytest.mark.parametrize("build", _fusion_cases())
def test_fusion_builds_offline(build):
    fd = build()
    rows, hidden = 7, 24578
    shapes = [None if not isinstance(v, FusionTensor) else (hidden,) if v.ndim == 1
              else ((3, 1, hidden) if v.contiguity[1] is None else (3, rows, hidden))
              if v.ndim == 3
              else (rows, 1) if v.dims[1] is None or v.contiguity[1] is None else (rows, hidden)
              for v in fd.fusion.inputs]
    report = explain(fd, shapes, device="h200")
    assert all(r.spill_stores == 0 for r in report.resources.values()), str(report)


def test_eager_calls_run_through_an_autograd_function_not_the_op_dispatch(oracle):
    """Eager mode skips the custom op's dispatch (fuser/torch/_eager.py: about 150 us a call);
    fake tensors, as torch.compile traces them, still take the op and its fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(6, 16, requires_grad=True)

    def node(y):
        return type(y.grad_fn).__name__

    # [rows, hidden] in and out: no reshape or view around the op (no node of theirs)
    assert node(ft.rms_norm(x, 16, torch.rand(16))) == "fuser_rms_normBackward"
    assert node(ft.layer_norm(x, 16)) == "fuser_layer_normBackward"
    assert node(ft.softmax(x, -1)) == "fuser_softmaxBackward"
    y = ft.rms_norm(torch.randn(2, 3, 16, requires_grad=True), 16)
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "fuser_rms_normBackward"
    with FakeTensorMode():
        fake = torch.empty(6, 16, requires_grad=True)
        assert node(ft.rms_norm(fake, 16)) != "fuser_rms_normBackward"


def test_vmap_and_tracers_still_see_the_custom_ops(oracle):
    """Where something other than autograd must see the op (vmap's fallback, make_fx and other
    dispatch-mode tracers), the eager path steps aside and the custom op runs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(3, 5, 16)
    w = torch.rand(16)
    batched = torch.vmap(lambda a: ft.rms_norm(a, 16, w))(x)
    torch.testing.assert_close(batched, torch.stack([ft.rms_norm(a, 16, w) for a in x]))
    torch.testing.assert_close(torch.vmap(lambda a: ft.softmax(a, -1))(x), ft.softmax(x, -1))
    graph = make_fx(lambda a: ft.softmax(a, -1) + ft.rms_norm(a, 16, w))(x[0])
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"fuser.softmax.default", "fuser.rms_norm.default"} <= targets, targets
