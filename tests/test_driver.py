"""CPU: fuser.driver's Python side over a fake driver library (contexts, errors, memory)."""

from __future__ import annotations

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


def test_every_entry_point_is_typed(fake):
    """Each entry point gets the parameter types of _SIGNATURES and an int result: ctypes
    would otherwise pass Python ints as C ints and truncate 64-bit handles."""
    gpu, _ = fake
    for name, function in gpu._calls.items():
        assert function.argtypes == drivers._SIGNATURES[name], name
        assert function.restype is ctypes.c_int, name


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
