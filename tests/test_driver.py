"""CPU: fuser.driver's Python side over a fake driver library (contexts, errors, memory)."""

from __future__ import annotations

import contextlib
import ctypes

import pytest

from fuser import driver as drivers
from fuser.driver import CUDA_SUCCESS, Driver, DriverError

CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906


class FakeFunction:
    """One entry point: ctypes sets argtypes / restype on it, `answer` gives its result."""

    def __init__(self, library: FakeLibrary, name: str):
        self.library, self.name = library, name
        self.argtypes = self.restype = None

    def __call__(self, *args):
        self.library.calls.append((self.name, args))
        return getattr(self.library, "do_" + self.name.removesuffix("_v2"))(*args)


class FakeLibrary:
    """A driver with two devices (primary contexts 0x1000 + id), one thread's current
    context, and status codes a test may set per call."""

    def __init__(self):
        self.calls: list = []
        self.current = 0
        self.status: dict[str, int] = {}
        self.memsets: list = []

    def __getattr__(self, name: str):
        if name.startswith("cu"):
            return FakeFunction(self, name)
        raise AttributeError(name)

    def _out(self, ref, value) -> None:
        ref._obj.value = value

    def fails(self, call: str) -> int:
        return self.status.get(call, CUDA_SUCCESS)

    # entry points (FakeFunction calls do_<name>, _v2 dropped)
    def do_cuInit(self, flags):
        return self.fails("cuInit")

    def do_cuGetErrorName(self, status, ref):
        names = {CUDA_ERROR_INVALID_DEVICE: b"CUDA_ERROR_INVALID_DEVICE",
                 CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: b"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"}
        if status not in names:
            return 1
        self._out(ref, names[status])
        return CUDA_SUCCESS

    def do_cuDeviceGet(self, ref, ordinal):
        if ordinal not in (0, 1):
            return CUDA_ERROR_INVALID_DEVICE
        self._out(ref, ordinal)
        return CUDA_SUCCESS

    def do_cuDevicePrimaryCtxRetain(self, ref, device):
        self._out(ref, 0x1000 + device)
        return CUDA_SUCCESS

    def do_cuCtxGetCurrent(self, ref):
        self._out(ref, self.current or None)
        return CUDA_SUCCESS

    def do_cuCtxSetCurrent(self, context):
        self.current = context or 0
        return CUDA_SUCCESS

    def do_cuCtxGetDevice(self, ref):
        self._out(ref, self.current - 0x1000)
        return CUDA_SUCCESS

    def do_cuStreamIsCapturing(self, stream, ref):
        self._out(ref, 1 if stream == 7 else 0)
        return self.fails("cuStreamIsCapturing")

    def do_cuMemAlloc(self, ref, nbytes):
        self._out(ref, 0xA000)
        return self.fails("cuMemAlloc")

    def do_cuMemsetD8(self, address, value, nbytes):
        self.memsets.append((address, value, nbytes))
        return CUDA_SUCCESS

    def do_cuCtxSynchronize(self):
        return CUDA_SUCCESS


@pytest.fixture
def fake() -> tuple[Driver, FakeLibrary]:
    library = FakeLibrary()
    return Driver(library), library  # type: ignore[arg-type]


def test_current_device_follows_the_current_context(fake):
    gpu, library = fake
    assert gpu.current_context() == 0 and gpu.current_device() == 0  # none yet: device 0
    library.current = 0x1001
    assert gpu.current_device() == 1


def test_on_device_switches_only_when_needed_and_restores(fake):
    gpu, library = fake
    library.current = 0x1000
    with gpu.on_device(0):
        assert library.current == 0x1000
    assert not [c for c in library.calls if c[0] == "cuCtxSetCurrent"]
    with gpu.on_device(1):
        assert library.current == 0x1001
    assert library.current == 0x1000
    library.current = 0  # a thread with no context keeps none after the block
    with gpu.on_device(1):
        assert library.current == 0x1001
    assert library.current == 0
    retained = [c for c in library.calls if c[0] == "cuDevicePrimaryCtxRetain"]
    assert len(retained) == 2  # once per device


def test_on_device_restores_after_an_error(fake):
    gpu, library = fake
    library.current = 0x1000
    with pytest.raises(RuntimeError), gpu.on_device(1):
        raise RuntimeError("inside")
    assert library.current == 0x1000


def test_a_failed_call_names_the_call_the_error_and_what_was_done(fake):
    gpu, _ = fake
    with pytest.raises(DriverError, match=r"cuDeviceGet failed with CUDA_ERROR_INVALID_DEVICE "
                                          r"while opening device 5"):
        gpu.primary_context(5)
    assert gpu.error_name(12345) == "CUresult 12345"


def test_stream_capture_status(fake):
    gpu, library = fake
    assert gpu.stream_capturing(7) and not gpu.stream_capturing(0)
    library.status["cuStreamIsCapturing"] = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    with pytest.raises(DriverError, match="CAPTURE_IMPLICIT while asking whether stream 0x3"):
        gpu.stream_capturing(3)


def test_zeroed_memory_is_set_to_zero_and_synchronized(fake):
    gpu, library = fake
    assert gpu.zeroed_memory(4096) == 0xA000
    assert library.memsets == [(0xA000, 0, 4096)]
    assert [c[0] for c in library.calls][-3:] == ["cuMemAlloc_v2", "cuMemsetD8_v2",
                                                  "cuCtxSynchronize"]


def test_a_driver_that_cannot_start_is_a_toolchain_error():
    library = FakeLibrary()
    library.status["cuInit"] = CUDA_ERROR_INVALID_DEVICE
    with pytest.raises(DriverError, match=r"cuInit failed .* initializing the CUDA driver"):
        Driver(library)  # type: ignore[arg-type]


def test_every_entry_point_matches_its_prototype_in_cuda_h():
    """Each _SIGNATURES entry has the parameter count of its cuda.h prototype, and a ctypes
    pointer exactly where the prototype has one (the output pointer of cuStreamIsCapturing
    is its second parameter, not its first); handles (CUcontext, CUstream, ...) are void
    pointers in C as here, CUdeviceptr a 64-bit integer."""
    import os
    import re

    from fuser.compile import cuda_include_dir

    folder = cuda_include_dir()
    header = os.path.join(folder, "cuda.h") if folder else ""
    assert os.path.isfile(header), f"no cuda.h beside the NVRTC headers ({folder})"
    with open(header, encoding="utf-8") as f:
        text = f.read()
    handles = ("CUcontext", "CUmodule", "CUfunction", "CUstream")
    for name, argtypes in drivers._SIGNATURES.items():
        found = (re.search(rf"CUresult CUDAAPI {name}\(([^)]*)\);", text)
                 or re.search(rf"CUresult CUDAAPI {name.removesuffix('_v2')}\(([^)]*)\);", text))
        assert found, name
        params = [p.strip() for p in found.group(1).split(",") if p.strip() not in ("", "void")]
        assert len(params) == len(argtypes), (name, params)
        for param, ours in zip(params, argtypes, strict=True):
            if "*" in param:
                assert ours in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(
                    ours, ctypes._Pointer), (name, param, ours)
            elif param.split()[0] in handles or param.startswith("const CUlaunchConfig"):
                assert ours is ctypes.c_void_p, (name, param, ours)
            else:
                assert not issubclass(ours, ctypes._Pointer) and ours is not ctypes.c_void_p, (
                    name, param, ours)
                if param.startswith("CUdeviceptr"):
                    assert ours is ctypes.c_uint64, (name, param)


# ----- the executor's side: contexts and modules ---------------------------------------------


class FakeGPU:
    """The executor's view of the driver: a current context and device, and the modules
    unloaded."""

    def __init__(self, current: int, device: int):
        self.current, self.device = current, device
        self.unloaded: list[int] = []

    def current_context(self) -> int:
        return self.current

    def current_device(self) -> int:
        return self.device

    def unload_module(self, module: int) -> None:
        self.unloaded.append(module)


def test_a_call_runs_in_the_primary_context_and_refuses_another_of_its_device(monkeypatch):
    """The plan's (primary) context current: launch as is. Another context of the same device
    current: the caller's stream is that context's, so the call is refused on the host with
    both handles and the way out, not launched into a context mismatch."""
    import types

    from fuser import calls
    from fuser.errors import LaunchError

    plan = types.SimpleNamespace(context=0x1000, device_id=0, torch_kind=True)
    monkeypatch.setattr(calls, "_enqueue", lambda plan, inputs, pointers: "launched")
    monkeypatch.setattr(calls, "driver", lambda: FakeGPU(0x1000, 0))
    assert calls.run(plan, [], []) == "launched"
    monkeypatch.setattr(calls, "driver", lambda: FakeGPU(0x7777, 0))
    with pytest.raises(LaunchError, match=r"context \(0x7777\) of device 0 is not its primary "
                                          r"context \(0x1000\).*torch\.cuda\.set_device"):
        calls.run(plan, [], [])


def test_a_module_that_fails_its_checks_is_unloaded(monkeypatch):
    """A kernel whose static shared memory overflows its plan's slot is refused after its
    module was loaded: the module is unloaded, not left in the context for every retry."""
    import types

    from fuser import loader
    from fuser.device import DeviceSpec
    from fuser.driver import Function
    from fuser.errors import OutOfResourcesError
    from fuser.smem import STATIC_SLOT

    gpu = FakeGPU(0x1000, 0)
    gpu.load_module = lambda image, what: 0xABC
    gpu.function = lambda module, name: Function(name, 1, 32, STATIC_SLOT + 16, 0, 0)
    gpu.on_device = lambda device_id: contextlib.nullcontext()
    plan = types.SimpleNamespace(static_slot=STATIC_SLOT, dynamic_bytes=0)
    built = types.SimpleNamespace(compiled=types.SimpleNamespace(cubin=b"\x7fELF"),
                                  plans=lambda: iter([("k_row", plan)]))
    monkeypatch.setattr(loader, "driver", lambda: gpu)
    monkeypatch.setattr(loader, "build", lambda *args: built)
    with pytest.raises(OutOfResourcesError, match="more than the 128 B slot"):
        loader._load("f", None, None, DeviceSpec.get("h200"), None, 0)
    assert gpu.unloaded == [0xABC]

