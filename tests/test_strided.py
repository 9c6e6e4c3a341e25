"""Inputs declared non-contiguous: the kernels read contiguous rows, so execute() copies a
strided array passed for such an input into a contiguous one first; `show` and explain() say
so. Inputs declared contiguous stay uncopied, and a strided array there is refused with both
ways out."""

from __future__ import annotations

import numpy as np
import pytest

import fuser.executor as executor
from fuser import BadInputError, DataType, FusionDefinition
from fuser.analysis import analyze, strided_inputs
from fuser.explain import explain
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes


def _rms(contiguity=(False, True)) -> FusionDefinition:
    """y = x * rsqrt(mean(x^2) + eps) * w, x declared with `contiguity`."""
    with FusionDefinition("strided_rms") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=list(contiguity), dtype=DataType.Float)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(x, x), dims=[1], keepdim=True), x.size(1))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, fd.define_scalar(1e-6)))
        fd.add_output(fd.ops.mul(fd.ops.mul(x, fd.ops.broadcast_in_dim(rstd, x.shape(), [0, 1])),
                                 w))
    return fd


def test_a_non_contiguous_input_is_scheduled_and_shown_as_copied():
    fd = _rms()
    info = analyze(fd.fusion)
    assert [t.name for t in strided_inputs(info.fusion)] == ["T0"]
    report = explain(fd, [(64, 4096), (4096,)])
    assert ("strided inputs:    T0:Float (copied to contiguous arrays when passed strided; a "
            "permuted view by fuser's permute kernel)") in str(report)
    contiguous = explain(_rms((True, True)), [(64, 4096), (4096,)])
    assert "strided inputs" not in str(contiguous)
    assert report.schedule == contiguous.schedule  # the kernels read the same rows


def test_only_strided_arrays_at_inputs_declared_non_contiguous_are_copied():
    torch = pytest.importorskip("torch")
    fd = _rms()
    base = torch.arange(12.0).reshape(4, 3)
    strided, w = base.t(), torch.ones(4)  # a transposed view: [3, 4], strides (1, 3)
    out = executor._contiguous(fd, [strided, w])
    assert out[0].is_contiguous() and torch.equal(out[0], strided) and out[1] is w
    ready = base.clone()
    assert executor._contiguous(fd, [ready, w])[0] is ready  # nothing to copy
    declared = _rms((True, True))
    assert executor._contiguous(declared, [strided, w])[0] is strided  # left to the checks


def test_a_permuted_view_of_contiguous_memory_is_copied_by_the_permute_kernel(monkeypatch):
    """A CUDA array that is a permuted view of contiguous memory (a transposed matrix, heads
    and sequence swapped) is copied by fuser's permute kernel (moves.permuted, stood in
    for here by torch's copy): the order handed to it brings the memory back to `x`'s axes.
    A column slice, a view with gaps, is the array library's to copy."""
    torch = pytest.importorskip("torch")
    calls = []

    def permuted(moved, dims):
        assert moved.is_contiguous()
        calls.append(dims)
        return moved.permute(dims).contiguous()

    monkeypatch.setattr(executor.moves, "permuted", permuted)
    heads = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    for x, dims in [(torch.arange(12.0).reshape(4, 3).t(), (1, 0)),
                    (heads.permute(0, 2, 1, 3), (0, 2, 1, 3)),
                    (heads.permute(3, 1, 0, 2), (3, 1, 0, 2)),
                    (heads[:1].permute(0, 2, 1, 3), (0, 2, 1, 3))]:
        got = executor._permuted_view_copy(x)
        assert got.is_contiguous() and torch.equal(got, x)
        assert calls.pop() == dims or x.shape[0] == 1  # an axis of 1 may sit anywhere
    sliced = torch.arange(24.0).reshape(4, 6)[:, 1:4]
    got = executor._permuted_view_copy(sliced)
    assert torch.equal(got, sliced) and got.is_contiguous() and not calls


def test_a_strided_numpy_array_is_refused_as_a_host_array_not_copied():
    """numpy arrays have .flags and .device too: the copy is CuPy's only for CuPy arrays, and
    a host array gets the error that says to move it to the device (review found a TypeError
    from cupy.ascontiguousarray)."""
    from fuser import BadInputError

    x = np.zeros((4, 3), np.float32).T
    assert executor._contiguous(_rms(), [x, np.ones(4, np.float32)])[0] is x
    with pytest.raises(BadInputError, match=r"input 0 \(T0\) is a numpy.ndarray; fuser runs on "
                                            r"CuPy arrays or torch CUDA tensors"):
        _rms().execute([x, np.ones(4, np.float32)])


@pytest.mark.gpu
def test_a_strided_array_for_an_input_declared_contiguous_names_both_fixes():
    torch = pytest.importorskip("torch")
    x, w = torch.zeros(4, 3, device="cuda").t(), torch.ones(4, device="cuda")
    with pytest.raises(BadInputError, match=r"(?s)not contiguous.*declares it contiguous; pass "
                       r"x.contiguous\(\), or declare a False in its contiguity"):
        _rms((True, True)).execute([x, w])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize(("rows", "hidden"), [(7, 1000), (300, 4099), (64, 24578)])
def test_strided_views_match_the_reference(kind, rows, hidden, rng):
    """A transposed view and a column slice (a storage offset, rows strided) of a bigger
    array, against the float64 reference of the same values."""
    fd = _rms()
    wide = rng.standard_normal((rows, hidden + 3)).astype(np.float32)
    w = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    if kind == "torch":
        torch = pytest.importorskip("torch")

        def as_device(a):
            return torch.from_numpy(np.ascontiguousarray(a)).cuda()

        views = [as_device(wide.T).t()[:, :hidden], as_device(wide)[:, 3:]]
    else:
        import cupy

        as_device = cupy.asarray
        views = [cupy.asarray(wide.T).T[:, :hidden], cupy.asarray(wide)[:, 3:]]
    for x in views:
        host = [np.asarray(executor.to_host(x)), w]
        outs = fd.execute([x, as_device(w)])
        refs = evaluate(fd.fusion, host)
        compare([executor.to_host(o) for o in outs], refs, fd.fusion,
                output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("order", [(1, 0, 2), (2, 0, 1), (0, 2, 1)], ids=str)
def test_permuted_3d_views_match_the_reference(kind, order, rng):
    """An RMSNorm over the last axis of a [S, B, H]-like permuted view of contiguous memory
    (runs where the last axis stays, tiles where it moves): copied by the permute kernel
    before the row kernel, against the float64 reference of the same values."""
    with FusionDefinition("strided_rms_3d") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], contiguity=[False, False, False],
                             dtype=DataType.BFloat16)
        xf = fd.ops.cast(x, DataType.Float)
        ms = fd.ops.div(fd.ops.sum(fd.ops.mul(xf, xf), dims=[2], keepdim=True), x.size(2))
        rstd = fd.ops.rsqrt(fd.ops.add(ms, fd.define_scalar(1e-6)))
        fd.add_output(fd.ops.cast(fd.ops.mul(xf, fd.ops.broadcast_in_dim(rstd, x.shape(),
                                                                         [0, 1, 2])),
                                  DataType.BFloat16))
    base = rng.standard_normal((6, 130, 72)).astype(np.float32).astype(DataType.BFloat16.numpy)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        device = torch.from_numpy(base.view(np.int16)).cuda().view(torch.bfloat16)
        view = device.permute(*order)
        assert not view.is_contiguous()
    else:
        import cupy

        view = cupy.asarray(base).transpose(order)
        assert not view.flags.c_contiguous
    fd.validate([view])


def test_a_strided_input_of_a_segmented_fusion_is_cut_as_a_contiguous_one():
    """x - sum(x, dims=[0]) runs as segments; declared non-contiguous, its x is copied once
    by the whole fusion's execute, before the segments run."""
    from test_segment import _segments

    def centered(contiguity):
        with FusionDefinition("centered") as fd:
            x = fd.define_tensor([-1, -1], contiguity=contiguity)
            fd.add_output(fd.ops.sub(x, fd.ops.sum(x, [0], keepdim=True)))
        return fd

    strided = _segments(centered([False, True]))
    plain = _segments(centered([True, True]))
    assert strided is not None and plain is not None
    assert len(strided.segments) == len(plain.segments) == 2
