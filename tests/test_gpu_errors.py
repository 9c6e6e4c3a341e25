"""GPU: failures leave nothing behind. After a compile error, a resource error or a bad input
(with the caller on a stream and device of their own), the current device and stream are the
caller's, no half-built kernel is cached, and the next call with good inputs works."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fuser.calls as calls
import fuser.executor as executor
import fuser.kernels as kernels
import fuser.loader as loader
from fuser import (
    BadInputError,
    CompileError,
    DataType,
    HintError,
    LaunchError,
    OutOfResourcesError,
)
from fuser.fusions import FUSIONS, make_inputs
from fuser.schedulers import Hints

pytestmark = pytest.mark.gpu


def _inputs(rng, hidden=2048, rows=64):
    import cupy

    host = make_inputs("rmsnorm_bwd", rows, hidden, DataType.BFloat16, rng)
    return [cupy.asarray(a) for a in host]


def _state():
    import cupy

    return cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr


def test_compile_error_changes_nothing_and_the_next_call_works(rng, monkeypatch, tmp_path):
    """A kernel cache of its own, and no loaded kernels: another test of the session may have
    built this fusion at this size, and its stored plan or loaded kernel would skip the render
    this test breaks."""
    import cupy

    import fuser.cache

    monkeypatch.setattr(fuser.cache, "_default", fuser.cache.KernelCache(str(tmp_path)))
    monkeypatch.setattr(loader, "_kernels", {})
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    real = kernels._render

    def broken(*args):
        source = real(*args)
        return dataclasses.replace(source, source=source.source + "\n#error planted\n")

    monkeypatch.setattr(kernels, "_render", broken)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        before = _state()
        with pytest.raises(CompileError, match="planted"):
            fd.execute(_inputs(rng))
        assert _state() == before
    assert not fd.__dict__.get("_plans")
    monkeypatch.setattr(kernels, "_render", real)
    fd.validate(_inputs(rng))


def test_resource_error_changes_nothing(rng):
    import cupy

    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    hints = Hints(threads_per_row=1024, rows_per_block=2)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        before = _state()
        with pytest.raises(HintError, match=r"rows_per_block=2\): allowed: 1 to 1"):
            executor.execute(fd, _inputs(rng), hints=hints)
        assert _state() == before
    fd.validate(_inputs(rng))


def test_bad_input_after_a_stream_switch_leaves_the_callers_stream(rng):
    import cupy

    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    good = _inputs(rng)
    bad = list(good)
    bad[1] = bad[1].astype(np.float64)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        with pytest.raises(BadInputError, match="dtype float64"):
            fd.execute(bad)
        assert cupy.cuda.get_current_stream().ptr == stream.ptr
        outs = fd.execute(good)  # runs on the caller's stream
        stream.synchronize()
    assert all(bool(cupy.isfinite(o.astype(np.float32)).all()) for o in outs)


def test_torch_stream_is_respected_and_restored(rng):
    torch = pytest.importorskip("torch")
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    host = make_inputs("rmsnorm_bwd", 64, 2048, DataType.BFloat16, rng)
    inputs = [torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
              if a.dtype.name == "bfloat16" else torch.from_numpy(a).cuda() for a in host]
    side = torch.cuda.Stream()
    before = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        outs = fd.execute(inputs)
        with pytest.raises(BadInputError):
            fd.execute(inputs[:2])
        assert torch.cuda.current_stream() == side
    side.synchronize()
    assert torch.cuda.current_stream() == before
    assert all(torch.isfinite(o.float()).all() for o in outs)


def test_a_refused_launch_names_the_numbers_and_the_next_call_works(rng):
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    fd.validate(_inputs(rng))
    kernel = fd._last_run.kernel
    launcher = kernel.launchers[kernel.source.row_entry]
    before = _state()
    with pytest.raises(LaunchError, match=r"rmsnorm_bwd_row \(grid 1, block 2048 x 1, 0 B .*"
                                          r"CUDA_ERROR_INVALID_VALUE"):
        launcher(1, (2048, 1), 0, 0, [0] * launcher.param_count)
    assert _state() == before
    fd.validate(_inputs(rng))


@pytest.mark.parametrize("streams", ["own", "shared", "per-thread default"])
def test_threads_launching_one_kernel_get_their_own_arguments(rng, streams):
    """Each kernel entry stages its parameters in one buffer per entry (fuser/launch.py), and
    a plan's partial rows are one buffer per stream: threads calling the same fusion on their
    own streams, on one shared stream, or each on its per-thread default stream (one handle
    for a different stream per thread) must still get their own results."""
    import threading

    import cupy

    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    sets = [_inputs(rng) for _ in range(4)]
    expected = [[cupy.asnumpy(o) for o in fd.execute(inputs)] for inputs in sets]
    results, errors = {}, []
    shared = cupy.cuda.Stream(non_blocking=True)

    def work(k: int) -> None:
        try:
            stream = {"own": lambda: cupy.cuda.Stream(non_blocking=True),
                      "shared": lambda: shared,
                      "per-thread default": lambda: cupy.cuda.Stream.ptds}[streams]()
            with stream:
                for _ in range(25):
                    outs = fd.execute(sets[k])
                stream.synchronize()
            results[k] = [cupy.asnumpy(o) for o in outs]
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(sets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, outs in results.items():
        for got, want in zip(outs, expected[k], strict=True):
            np.testing.assert_array_equal(got, want)
    assert len(results) == len(sets)


def test_a_thread_with_no_cuda_call_yet_can_execute(rng):
    """The driver launches into the current context, which a fresh thread does not have
    until some CUDA call binds it. With torch tensors nothing else binds it: torch's cached
    allocations and its raw-stream getter make no such call. execute() binds the device's
    primary context itself."""
    import threading

    torch = pytest.importorskip("torch")
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    host = make_inputs("rmsnorm_bwd", 64, 2048, DataType.BFloat16, rng)
    inputs = [torch.from_numpy(a.astype(np.float32)).cuda().bfloat16()
              if a.dtype.name == "bfloat16" else torch.from_numpy(a).cuda() for a in host]
    expected = [o.float().cpu() for o in fd.execute(inputs)]
    got, errors = [], []

    def work() -> None:
        try:
            got.extend(fd.execute(inputs))
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.cuda.synchronize()
    for g, want in zip(got, expected, strict=True):
        assert torch.equal(g.float().cpu(), want)


def test_a_workspace_the_device_cannot_hold_is_named_with_its_size(rng, monkeypatch):
    """Out of device memory for the partial rows: an OutOfResourcesError with the workspace's
    shape and bytes, not the allocator's bare error; nothing is cached and the next call
    works."""
    import cupy

    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    real = calls._arrays

    def short_of_memory(specs, torch_kind, like):
        for shape, dtype in specs:
            if dtype == np.float32 and len(shape) == 2 and shape[1] == 2048:
                raise cupy.cuda.memory.OutOfMemoryError(shape[0] * shape[1] * 4, 0)
        return real(specs, torch_kind, like)

    monkeypatch.setattr(calls, "_arrays", short_of_memory)
    with pytest.raises(OutOfResourcesError, match=r"column-sum workspace \(\d+ x 2048 x 4 B = "
                                                  r"\d+ B: one partial row per resident block\)"):
        fd.execute(_inputs(rng))
    monkeypatch.setattr(calls, "_arrays", real)
    assert not any(p.workspaces for p in fd.__dict__.get("_plans", {}).values())
    fd.validate(_inputs(rng))


def _misaligned(a, offset_bytes: int):
    """A view of `a`'s memory starting `offset_bytes` past its start (a pointer a kernel
    cannot load elements from)."""
    import cupy

    base = cupy.empty(a.nbytes + 64, dtype=cupy.uint8)
    moved = cupy.ndarray(a.shape, dtype=a.dtype, memptr=base.data + offset_bytes)
    return moved


@pytest.mark.parametrize(("dtype", "offset"), [("float16", 1), ("float32", 2)])
def test_a_pointer_off_its_element_size_is_refused_and_the_context_stays_usable(dtype, offset,
                                                                                rng):
    """Issue 13: such a pointer passed every check and the kernel died with
    cudaErrorMisalignedAddress, poisoning the context."""
    import cupy

    with FusionDefinitionFor(dtype) as fd:
        pass
    x = _misaligned(cupy.zeros((8, 256), dtype=dtype), offset)
    with pytest.raises(BadInputError, match=r"not a multiple of its element size"):
        fd.execute([x])
    cupy.cuda.Device().synchronize()
    fd.validate([cupy.asarray(rng.standard_normal((8, 256)).astype(dtype))])


def test_a_row_over_32_bit_indices_is_refused_before_launch():
    """Issue 13: hidden >= 2**31 passed every check and the kernel faulted."""
    import cupy

    from fuser import UnsupportedFusionError

    with FusionDefinitionFor("float16") as fd:
        pass
    x = cupy.zeros((1, 2**31 + 16), dtype=cupy.float16)
    with pytest.raises(UnsupportedFusionError, match=r"hidden size 2147483664 is over"):
        fd.execute([x])
    del x
    cupy.cuda.Device().synchronize()


def test_a_preset_of_another_architecture_is_refused_before_launch(rng):
    """Issue 13: device='a100' on an sm_90 GPU failed in the driver (NO_BINARY_FOR_GPU)."""
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    with pytest.raises(BadInputError, match=r"schedules for sm_80, but the inputs are on"):
        executor.execute(fd, _inputs(rng), device="a100")
    fd.validate(_inputs(rng))


class FusionDefinitionFor:
    """A softmax-like row fusion over one [rows, hidden] input of `dtype` (a numpy name)."""

    def __init__(self, dtype: str):
        from fuser import FusionDefinition

        self.dtype = DataType.from_numpy(np.dtype(dtype))
        self.fd = FusionDefinition("row_scale")

    def __enter__(self):
        fd = self.fd.__enter__()
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=self.dtype)
        xf = fd.ops.cast(x, DataType.Float)
        s = fd.ops.sum(fd.ops.mul(xf, xf), dims=[1], keepdim=True)
        fd.add_output(fd.ops.cast(fd.ops.mul(xf, fd.ops.broadcast_in_dim(
            s, shape=x.shape(), broadcast_dims=[0, 1])), self.dtype))
        return fd

    def __exit__(self, *exc):
        return self.fd.__exit__(*exc)


@pytest.mark.parametrize("dtype", [DataType.Half, DataType.BFloat16], ids=lambda d: d.name)
def test_a_16_bit_scalar_input_reaches_the_kernel_as_the_oracle_holds_it(dtype):
    """A Half / BFloat16 scalar is a float32 kernel parameter (dtypes.scalar_numpy): the
    executor rounded it to 16 bits first, so 0.1 + x differed from the oracle by 4.5e-5
    (found by the GPU fuzz); now both hold float32(0.1)."""
    import cupy

    from fuser import FusionDefinition

    with FusionDefinition("scalar_plus") as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=DataType.Float)
        fd.add_output(fd.ops.add(fd.define_scalar(None, dtype=dtype), x))
    values = cupy.linspace(-2, 2, 64, dtype=cupy.float32).reshape(4, 16)
    (got,) = fd.execute([values, 0.1])
    assert cupy.array_equal(got, values + cupy.float32(0.1))
    fd.validate([values, 0.1])
