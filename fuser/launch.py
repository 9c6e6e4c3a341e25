"""Kernel launches straight through the driver's cuLaunchKernel, called through ctypes.

A norm backward at hidden 1024 runs for about 40 us on the H200, while a launch through
CuPy's RawKernel call cost about 10 us of host time and the whole execute() about 50: the GPU
waited on Python. So each compiled entry gets one `EntryLauncher` that owns ctypes storage
for every kernel parameter and the array of their addresses (the kernelParams the driver
reads); a launch writes the call's values into that storage and hands the driver the
address, with no per-argument objects built per call. The driver copies the parameter
values when the launch is enqueued, so the storage is free again when cuLaunchKernel
returns; a lock keeps two threads launching one entry from mixing their values.

The driver library is called through ctypes, not cuda-bindings: its wrappers build a
CUresult enum member for every call's status (and importing them cost 13 to 49 ms of a
process's first call). The exported names used here have one ABI since CUDA 11.8, and the
stream semantics of the plain (not _ptsz) entry points, the ones cuda-bindings resolves too.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

from fuser.dtypes import DataType
from fuser.errors import LaunchError, OutOfResourcesError, ToolchainError

POINTER = ctypes.c_uint64  # device addresses are 64-bit parameters
# Scalar parameters are declared in their compute type (codegen._scalar_params): a Half or
# BFloat16 scalar is a float parameter.
_COMPUTE_CTYPES = {"bool": ctypes.c_bool, "int": ctypes.c_int32, "long long": ctypes.c_int64,
                   "float": ctypes.c_float, "double": ctypes.c_double}

CUDA_SUCCESS = 0
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


def ctype_of(dtype: DataType) -> type:
    """The ctypes type of a kernel parameter holding a scalar of this dtype."""
    return _COMPUTE_CTYPES[dtype.compute_type]


class LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: a 64-byte union (8-byte aligned: some members hold pointers);
    only the programmatic-serialization flag is set here."""

    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_serialization", ctypes.c_int),
                ("align", ctypes.c_uint64)]


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


class Driver:
    """The driver entry points fuser calls on every launch, with their C signatures."""

    def __init__(self, library: ctypes.CDLL):
        u, p = ctypes.c_uint, ctypes.c_void_p
        self.launch = library.cuLaunchKernel
        self.launch.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
        self.launch_ex = library.cuLaunchKernelEx
        self.launch_ex.argtypes = [ctypes.POINTER(LaunchConfig), p, p, p]
        self.current_context = library.cuCtxGetCurrent
        self.current_context.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._error_name = library.cuGetErrorName
        self._error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in (self.launch, self.launch_ex, self.current_context, self._error_name):
            f.restype = ctypes.c_int

    def error_name(self, status: int) -> str:
        name = ctypes.c_char_p()
        if self._error_name(status, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {status}"
        return name.value.decode()

    def has_context(self) -> bool:
        """Whether this thread has a current context (a thread that made no CUDA call yet
        has none: the runtime binds one lazily)."""
        context = ctypes.c_void_p()
        return self.current_context(ctypes.byref(context)) == CUDA_SUCCESS and bool(
            context.value)


@functools.cache
def driver() -> Driver:
    """The CUDA driver library (loaded already by CuPy, which fuser loads kernels with)."""
    name = "nvcuda.dll" if os.name == "nt" else "libcuda.so.1"
    try:
        return Driver(ctypes.CDLL(name))
    except (OSError, AttributeError) as exc:
        raise ToolchainError(
            f"the CUDA driver library {name} could not be loaded with the entry points fuser "
            f"launches through ({exc}); install an NVIDIA driver that supports CUDA 11.8 or "
            "later") from None


class EntryLauncher:
    """Launches one kernel entry with parameters of the given ctypes types, in order."""

    def __init__(self, name: str, function_ptr: int, param_types: list[type],
                 registers: int, programmatic: bool = False):
        self.name = name
        self.registers = registers  # per thread, as the driver reports for the loaded kernel
        self._driver = driver()
        self._function = function_ptr
        # Programmatic stream serialization (sm_90): this grid may launch while the previous
        # kernel in the stream is still running, and waits for it in wait_for_prior_grid().
        self._programmatic = programmatic
        self._configs: dict = {}  # (grid, block, shared_mem) -> LaunchConfig
        self._values = [t() for t in param_types]
        self._addresses = (ctypes.c_void_p * len(self._values))(
            *(ctypes.addressof(v) for v in self._values))
        self._params = ctypes.addressof(self._addresses)
        self._lock = threading.Lock()

    def __call__(self, grid: int, block: tuple[int, int], shared_mem: int, stream: int,
                 args) -> None:
        with self._lock:
            for slot, value in zip(self._values, args, strict=True):
                slot.value = value
            if self._programmatic:
                config = self._config(grid, block, shared_mem)
                config.hStream = stream
                err = self._driver.launch_ex(ctypes.byref(config), self._function, self._params,
                                             None)
            else:
                err = self._driver.launch(self._function, grid, 1, 1, block[0], block[1], 1,
                                          shared_mem, stream, self._params, None)
        if err != CUDA_SUCCESS:
            self._raise(err, grid, block, shared_mem)

    def _config(self, grid: int, block: tuple[int, int], shared_mem: int) -> LaunchConfig:
        """The launch configuration with the programmatic-serialization attribute, built
        once per shape (called under the lock; the config keeps its attribute alive)."""
        key = (grid, block, shared_mem)
        config = self._configs.get(key)
        if config is None:
            attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attribute.value.programmatic_serialization = 1
            config = LaunchConfig(gridDimX=grid, gridDimY=1, gridDimZ=1, blockDimX=block[0],
                                  blockDimY=block[1], blockDimZ=1, sharedMemBytes=shared_mem,
                                  attrs=ctypes.pointer(attribute), numAttrs=1)
            self._configs[key] = config
        return config

    def _raise(self, err: int, grid: int, block: tuple[int, int], shared_mem: int) -> None:
        what = (f"launch of {self.name} (grid {grid}, block {block[0]} x {block[1]}, "
                f"{shared_mem} B dynamic shared memory) failed: {self._driver.error_name(err)}")
        if err == CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
            threads = block[0] * block[1]
            raise OutOfResourcesError(
                f"{what}; {threads} threads x {self.registers} registers = "
                f"{threads * self.registers} registers per block may exceed what the device "
                "gives a block: lower threads_per_row or rows_per_block (Hints)")
        raise LaunchError(f"{what}; the host checks passed, so this is a fuser bug: please "
                          "report it with fd.last_cuda_code() and the input shapes")
