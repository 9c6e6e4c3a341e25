"""The CUDA driver API, called through ctypes: everything fuser asks of a GPU at run time.

fuser loads its kernels, reads their attributes and the device's limits, asks for occupancy,
allocates its row counters and launches, all through the driver library the NVIDIA driver
installs (libcuda), so that neither array library is needed for it: torch tensors in, and
CuPy is never imported (its import cost 80 ms of a torch user's first call); a call on the
current device asks the driver one question (its current context) and enters no device
context. cuda-bindings is not used at run time either: its wrappers build an enum member for
every call's status, and importing them cost 13 to 49 ms of a process's first call.

The exported names used here have had one ABI since CUDA 11.8 (the `_v2` ones where cuda.h
maps the plain name to them), and the plain (not `_ptsz`) stream semantics, the ones
cuda-bindings resolves too. Kernels are loaded into each device's primary context, the one
the CUDA runtime (and so torch and CuPy) makes current for that device, and launched there.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from fuser.errors import ToolchainError

CUDA_SUCCESS = 0
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6

# CUfunction_attribute
FUNC_SHARED_SIZE_BYTES = 1
FUNC_LOCAL_SIZE_BYTES = 3
FUNC_NUM_REGS = 4
FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


class LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: a 64-byte union (8-byte aligned: some members hold pointers);
    only the int flags are set here (cooperative, programmatic serialization: the same int at
    offset 0)."""

    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int), ("align", ctypes.c_uint64)]


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the attribute id, padding to 8 bytes, then the value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig, as cuda.h declares it."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_int, _uint, _ptr = ctypes.c_int, ctypes.c_uint, ctypes.c_void_p
_out_int, _out_ptr = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p)
#: The entry points fuser calls, with their C parameter types (each returns a CUresult).
_SIGNATURES = {
    "cuInit": [_uint],
    "cuDeviceGet": [_out_int, _int],
    "cuDeviceGetAttribute": [_out_int, _int, _int],
    "cuDeviceGetName": [ctypes.c_char_p, _int, _int],
    "cuDevicePrimaryCtxRetain": [_out_ptr, _int],
    "cuCtxGetCurrent": [_out_ptr],
    "cuCtxSetCurrent": [_ptr],
    "cuCtxGetDevice": [_out_int],
    "cuCtxSynchronize": [],
    "cuModuleLoadData": [_out_ptr, ctypes.c_char_p],
    "cuModuleUnload": [_ptr],
    "cuModuleGetFunction": [_out_ptr, _ptr, ctypes.c_char_p],
    "cuFuncGetAttribute": [_out_int, _int, _ptr],
    "cuFuncSetAttribute": [_ptr, _int, _int],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [_out_int, _ptr, _int, ctypes.c_size_t],
    "cuOccupancyMaxActiveClusters": [_out_int, _ptr, ctypes.POINTER(LaunchConfig)],
    "cuStreamIsCapturing": [_ptr, _out_int],
    "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
    "cuMemsetD8_v2": [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t],
    "cuLaunchKernelEx": [ctypes.POINTER(LaunchConfig), _ptr, _ptr, _ptr],
    "cuGetErrorName": [_int, ctypes.POINTER(ctypes.c_char_p)],
}


class DriverError(ToolchainError):
    """A driver call failed: the call, its CUresult name and what fuser was doing."""


@dataclass(frozen=True)
class Function:
    """A loaded kernel entry and what the driver says about it."""

    name: str
    handle: int  # CUfunction
    num_regs: int
    static_smem: int  # bytes of __shared__ declared in the kernel
    local_bytes: int  # local memory per thread (spills, stack)
    max_dynamic_smem: int  # the dynamic shared memory a launch may ask for


class Driver:
    """The driver entry points fuser calls (one ctypes function each, typed from
    _SIGNATURES), with Python methods that raise DriverError naming the failed call."""

    def __init__(self, library: ctypes.CDLL):
        self._calls = {}
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
            self._calls[name] = function
        # what every launch calls, looked up once
        self.launch_ex = self._calls["cuLaunchKernelEx"]
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._check(self._calls["cuInit"](0), "cuInit", "initializing the CUDA driver")

    def error_name(self, status: int) -> str:
        name = ctypes.c_char_p()
        if (self._calls["cuGetErrorName"](status, ctypes.byref(name)) != CUDA_SUCCESS
                or not name.value):
            return f"CUresult {status}"
        return name.value.decode()

    def _check(self, status: int, call: str, doing: str) -> None:
        if status != CUDA_SUCCESS:
            raise DriverError(f"{call} failed with {self.error_name(status)} while {doing}")

    def _int(self, call: str, doing: str, *args) -> int:
        value = ctypes.c_int()
        self._check(self._calls[call](ctypes.byref(value), *args), call, doing)
        return value.value

    # ----- devices and contexts -----

    def device_attribute(self, device_id: int, attribute: int) -> int:
        return self._int("cuDeviceGetAttribute", f"reading attribute {attribute} of device "
                         f"{device_id}", attribute, self._device(device_id))

    def device_name(self, device_id: int) -> str:
        name = ctypes.create_string_buffer(256)
        self._check(self._calls["cuDeviceGetName"](name, len(name), self._device(device_id)),
                    "cuDeviceGetName", f"reading the name of device {device_id}")
        return name.value.decode("utf-8", errors="replace")

    def _device(self, device_id: int) -> int:
        return self._int("cuDeviceGet", f"opening device {device_id}", device_id)

    def current_context(self) -> int:
        """The calling thread's current context (0 where it has none: a thread that made no
        CUDA call yet; the runtime binds one lazily)."""
        context = ctypes.c_void_p()
        if self._calls["cuCtxGetCurrent"](ctypes.byref(context)) != CUDA_SUCCESS:
            return 0
        return context.value or 0

    def current_device(self) -> int:
        """The device of the thread's current context: the one torch and CuPy call current
        (0 where no context is current, as the runtime's cudaGetDevice says then)."""
        if not self.current_context():
            return 0
        return self._int("cuCtxGetDevice", "reading the current device")

    def primary_context(self, device_id: int) -> int:
        """The device's primary context (retained once, for the life of the process)."""
        context = self._contexts.get(device_id)
        if context is None:
            with self._lock:
                if device_id not in self._contexts:
                    handle = ctypes.c_void_p()
                    self._check(self._calls["cuDevicePrimaryCtxRetain"](
                        ctypes.byref(handle), self._device(device_id)),
                        "cuDevicePrimaryCtxRetain", f"opening the context of device {device_id}")
                    self._contexts[device_id] = handle.value or 0
                context = self._contexts[device_id]
        return context

    def bind_primary(self, device_id: int) -> None:
        """Make the device's primary context current in this thread, and leave it so."""
        self._check(self._calls["cuCtxSetCurrent"](self.primary_context(device_id)),
                    "cuCtxSetCurrent", f"making device {device_id} current")

    @contextlib.contextmanager
    def on_device(self, device_id: int) -> Iterator[None]:
        """The device's primary context current in this thread for the block (the previous
        one, or none, current again after it)."""
        target, previous = self.primary_context(device_id), self.current_context()
        if previous == target:
            yield
            return
        self._check(self._calls["cuCtxSetCurrent"](target), "cuCtxSetCurrent",
                    f"making device {device_id} current")
        try:
            yield
        finally:
            self._calls["cuCtxSetCurrent"](previous or None)

    # ----- modules and functions (in the current context) -----

    def load_module(self, image: bytes, what: str) -> int:
        module = ctypes.c_void_p()
        self._check(self._calls["cuModuleLoadData"](ctypes.byref(module), image),
                    "cuModuleLoadData", f"loading {what}")
        return module.value or 0

    def unload_module(self, module: int) -> None:
        """Unload a module whose kernels are not kept (a load that failed its checks, or one
        another thread loaded first); a failure here leaves it loaded, which is harmless."""
        self._calls["cuModuleUnload"](module)

    def function(self, module: int, name: str) -> Function:
        handle = ctypes.c_void_p()
        self._check(self._calls["cuModuleGetFunction"](ctypes.byref(handle), module,
                                                       name.encode()),
                    "cuModuleGetFunction", f"finding kernel {name}")
        return self._described(name, handle.value or 0)

    def _described(self, name: str, handle: int) -> Function:
        def attribute(which: int) -> int:
            return self._int("cuFuncGetAttribute", f"reading attribute {which} of {name}",
                             which, handle)

        return Function(name, handle, attribute(FUNC_NUM_REGS), attribute(FUNC_SHARED_SIZE_BYTES),
                        attribute(FUNC_LOCAL_SIZE_BYTES),
                        attribute(FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES))

    def allow_dynamic_smem(self, function: Function, nbytes: int) -> Function:
        """Let launches of `function` ask for `nbytes` of dynamic shared memory (above 48 KiB
        a kernel must opt in); the function as the driver then describes it."""
        self._check(self._calls["cuFuncSetAttribute"](
            function.handle, FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
            "cuFuncSetAttribute", f"allowing {nbytes} B of dynamic shared memory to "
            f"{function.name}")
        return self._described(function.name, function.handle)

    def allow_large_clusters(self, function: Function) -> None:
        """Let `function` launch in clusters of more than the portable 8 blocks (16 on
        Hopper)."""
        self._check(self._calls["cuFuncSetAttribute"](
            function.handle, FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
            "cuFuncSetAttribute", f"allowing {function.name} clusters of more than 8 blocks")

    def max_active_blocks(self, function: Function, threads: int, dynamic_smem: int) -> int:
        return self._int("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                         f"asking the occupancy of {function.name}", function.handle, threads,
                         dynamic_smem)

    def max_active_clusters(self, function: Function, config: LaunchConfig) -> tuple[int, int]:
        """(CUresult, clusters): the caller words a failure, which has a fix (a smaller
        cluster) the driver's name does not say."""
        clusters = ctypes.c_int()
        status = self._calls["cuOccupancyMaxActiveClusters"](ctypes.byref(clusters),
                                                              function.handle, config)
        return status, clusters.value

    # ----- streams and memory -----

    def stream_capturing(self, stream: int) -> bool:
        """Whether `stream` is capturing a CUDA graph (or a capture it was part of failed)."""
        status = ctypes.c_int()  # CUstreamCaptureStatus, after the stream (not first)
        result = self._calls["cuStreamIsCapturing"](stream or None, ctypes.byref(status))
        if result != CUDA_SUCCESS:
            self._check(result, "cuStreamIsCapturing", f"asking whether stream {stream:#x} "
                        "captures")
        return status.value != 0

    def device_memory(self, nbytes: int) -> int:
        """A device address of `nbytes` uninitialized bytes in the current context, never
        freed (fuser's buffers live as long as the process: freeing would synchronize the
        device)."""
        address = ctypes.c_uint64()
        self._check(self._calls["cuMemAlloc_v2"](ctypes.byref(address), nbytes),
                    "cuMemAlloc_v2", f"allocating {nbytes} B")
        return address.value

    def zeroed_memory(self, nbytes: int) -> int:
        """A device address of `nbytes` zeroed bytes in the current context, never freed; the
        zeroing is complete on return (the device is synchronized)."""
        address = self.device_memory(nbytes)
        self._check(self._calls["cuMemsetD8_v2"](address, 0, nbytes), "cuMemsetD8_v2",
                    f"zeroing {nbytes} B")
        self._check(self._calls["cuCtxSynchronize"](), "cuCtxSynchronize",
                    f"zeroing {nbytes} B")
        return address


@functools.cache
def driver() -> Driver:
    """The CUDA driver library (loaded already by torch or CuPy where either runs)."""
    name = "nvcuda.dll" if os.name == "nt" else "libcuda.so.1"
    try:
        return Driver(ctypes.CDLL(name))
    except (OSError, AttributeError) as exc:
        raise ToolchainError(
            f"the CUDA driver library {name} could not be loaded with the entry points fuser "
            f"runs kernels through ({exc}); install an NVIDIA driver that supports CUDA 11.8 or "
            "later") from None
