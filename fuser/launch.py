"""Kernel launches straight through the driver's cuLaunchKernelEx, called through ctypes.

A norm backward at hidden 1024 runs for about 40 us on the H200, while a launch through
CuPy's RawKernel call cost about 10 us of host time and the whole execute() about 50: the GPU
waited on Python. So each compiled entry gets one `EntryLauncher` that owns a buffer holding
every kernel parameter, laid out as C lays out a struct of them (each at its own alignment),
and the array of their addresses (the kernelParams the driver reads); a launch packs the
call's values into that buffer with one struct.pack_into, where a ctypes object per
parameter took a Python-level store each, and hands the driver the address. The driver copies
the parameter values when the launch is enqueued, so the buffer is free again when the call
returns; a lock keeps two threads launching one entry from mixing their values.

Every launch is one cuLaunchKernelEx whose configuration (grid, block, shared memory and the
attributes: cooperative, programmatic serialization) is built once per shape, only its stream
set per call: ctypes converts four arguments, not the ten of cuLaunchKernel or
cuLaunchCooperativeKernel (on the H200's host a cooperative launch took 7.0 us of host time
that way, 5.3 through cuLaunchKernelEx).
"""

from __future__ import annotations

import ctypes
import struct
import threading

from fuser.driver import (
    CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
    CUDA_SUCCESS,
    LaunchAttribute,
    LaunchConfig,
    driver,
)
from fuser.dtypes import DataType
from fuser.errors import LaunchError, OutOfResourcesError

POINTER = ctypes.c_uint64  # device addresses are 64-bit parameters
# Scalar parameters are declared in their compute type (codegen._scalar_params): a Half or
# BFloat16 scalar is a float parameter.
_COMPUTE_CTYPES = {"bool": ctypes.c_bool, "int": ctypes.c_int32, "long long": ctypes.c_int64,
                   "float": ctypes.c_float, "double": ctypes.c_double}

# Launch configurations kept per entry: one per launch shape (a pointwise or dealt-by-grid
# kernel's grid follows the row count, so a process of many row counts would otherwise keep one
# for each); past this many they are dropped and rebuilt as needed (about 1.3 KB each).
MAX_CONFIGS = 64
# gridDim.y's limit (and gridDim.z's): a launch of more groups than this splits them over z
MAX_GRID_Y = 65535

# The struct module's code of each parameter type (the same sizes as the ctypes types)
_STRUCT_CODES: dict[type, str] = {ctypes.c_uint64: "Q", ctypes.c_int32: "i", ctypes.c_int64: "q",
                                  ctypes.c_float: "f", ctypes.c_double: "d", ctypes.c_bool: "?"}


def ctype_of(dtype: DataType) -> type:
    """The ctypes type of a kernel parameter holding a scalar of this dtype."""
    return _COMPUTE_CTYPES[dtype.compute_type]


class EntryLauncher:
    """Launches one kernel entry with parameters of the given ctypes types, in order."""

    def __init__(self, name: str, function_ptr: int, param_types: list[type],
                 registers: int, programmatic: bool = False, cooperative: bool = False):
        self.name = name
        self.registers = registers  # per thread, as the driver reports for the loaded kernel
        self._driver = driver()
        self._function = ctypes.c_void_p(function_ptr)
        # Programmatic stream serialization (sm_90): this grid may launch while the previous
        # kernel in the stream is still running, and waits for it in wait_for_prior_grid().
        self._programmatic = programmatic
        # A cooperative launch: every block resident at once (or the launch fails), which a
        # grid-wide barrier needs.
        self.cooperative = cooperative
        self._configs: dict = {}  # (grid, block, shared_mem, groups) -> (config, its address)
        self.param_count = len(param_types)
        codes = [_STRUCT_CODES[t] for t in param_types]  # '@': laid out as C lays them out
        self._layout = struct.Struct("@" + "".join(codes))
        self._buffer = ctypes.create_string_buffer(max(self._layout.size, 1))
        base = ctypes.addressof(self._buffer)
        offsets = [struct.calcsize("@" + "".join(codes[:i + 1])) - struct.calcsize(code)
                   for i, code in enumerate(codes)]
        self._addresses = (ctypes.c_void_p * len(codes))(*(base + o for o in offsets))
        self._params = ctypes.c_void_p(ctypes.addressof(self._addresses))
        self._lock = threading.Lock()

    def __call__(self, grid: int, block: tuple[int, int], shared_mem: int, stream: int,
                 args, groups: int = 1) -> None:
        with self._lock:
            self._layout.pack_into(self._buffer, 0, *args)
            found = self._configs.get((grid, block, shared_mem, groups))
            config, address = found or self._config(grid, block, shared_mem, groups)
            config.hStream = stream
            err = self._driver.launch_ex(address, self._function, self._params, None)
        if err != CUDA_SUCCESS:
            self._raise(err, grid, block, shared_mem)

    def _config(self, grid: int, block: tuple[int, int], shared_mem: int,
                groups: int = 1) -> tuple:
        """The launch configuration of one shape, with this entry's attributes, kept for the
        next launch of that shape (MAX_CONFIGS at most; called under the lock; the config
        keeps its attributes alive). `groups` grid rows of `grid` blocks: gridDim.y up to
        MAX_GRID_Y, the rest in gridDim.z (the kernel skips the rows past its groups)."""
        ids = ([CU_LAUNCH_ATTRIBUTE_COOPERATIVE] * self.cooperative
               + [CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION] * self._programmatic)
        attributes = (LaunchAttribute * max(len(ids), 1))()
        for attribute, id_ in zip(attributes, ids, strict=False):
            attribute.id = id_
            attribute.value.flag = 1
        rows = min(groups, MAX_GRID_Y)
        config = LaunchConfig(gridDimX=grid, gridDimY=rows, gridDimZ=-(-groups // rows),
                              blockDimX=block[0], blockDimY=block[1], blockDimZ=1,
                              sharedMemBytes=shared_mem, attrs=attributes, numAttrs=len(ids))
        config.keep = attributes
        if len(self._configs) >= MAX_CONFIGS:
            self._configs.clear()
        found = self._configs[(grid, block, shared_mem, groups)] = (config, ctypes.byref(config))
        return found

    def _raise(self, err: int, grid: int, block: tuple[int, int], shared_mem: int) -> None:
        what = (f"launch of {self.name} (grid {grid}, block {block[0]} x {block[1]}, "
                f"{shared_mem} B dynamic shared memory) failed: {self._driver.error_name(err)}")
        if err == CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
            threads = block[0] * block[1]
            raise OutOfResourcesError(
                f"{what}; {threads} threads x {self.registers} registers = "
                f"{threads * self.registers} registers per block may exceed what the device "
                "gives a block: lower threads_per_row or rows_per_block (Hints)")
        if err == CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
            raise OutOfResourcesError(
                f"{what}; this row kernel finalizes its own columns and needs its {grid} "
                "blocks resident at once, more than the device holds for it now (an MPS limit "
                "on its SMs?): hint Hints(fused_finalize=False), which finalizes in a kernel "
                "of its own")
        raise LaunchError(f"{what}; the host checks passed, so this is a fuser bug: please "
                          "report it with fd.last_cuda_code() and the input shapes")
