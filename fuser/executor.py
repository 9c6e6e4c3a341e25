"""Run a fusion: check inputs, schedule, compile (cached), check resources, launch.

Everything the host can know is checked before a launch, and each failure raises a FuserError
that names the quantity, the value, the limit and what to change: input count, kinds, devices,
dtypes, ranks, sizes, contiguity, pointer alignment, and the kernel's shared memory (static,
as the driver reports it for the loaded kernel, plus the planned dynamic bytes) against the
device's opt-in limit. Nothing in a kernel traps on a condition the host could have checked.

CuPy arrays in give CuPy arrays out; torch CUDA tensors in give torch tensors out (allocated by
torch, launched on torch's current stream, no copies, except of a strided array passed for an
input declared non-contiguous: the kernels read contiguous rows).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import TypeVar

import numpy as np

from fuser.analysis import FusionInfo, Kind, analyze, strided_inputs
from fuser.checks import check_device, check_pointer, scalar_value
from fuser.compile import CompiledModule
from fuser.device import DeviceSpec
from fuser.driver import Function, LaunchConfig, driver
from fuser.dtypes import DataType
from fuser.errors import (
    BadInputError,
    FuserError,
    InternalError,
    LaunchError,
    OutOfResourcesError,
    UnsupportedFusionError,
)
from fuser.ir import Scalar, Tensor, as_tensor
from fuser.kernels import build
from fuser.launch import POINTER, EntryLauncher, ctype_of
from fuser.schedulers import Hints, Problem
from fuser.schedulers.base import (
    Dealing,
    FinalizeSchedule,
    KernelSchedule,
    Launch,
    OuterSchedule,
    PointwiseSchedule,
    RowSchedule,
    ceil_div,
    problem_rows,
)
from fuser.schedulers.hints import PORTABLE_CLUSTER
from fuser.segment import Segmentation, segment
from fuser.shapes import bind_shapes
from fuser.signature import KernelSource, Signature, Source, workspace_dtype
from fuser.tickets import counters as ticket_counters

T = TypeVar("T")
PER_THREAD_STREAM = 2  # cudaStreamPerThread: the same handle in every thread


@dataclass
class Kernel:
    """A compiled, loaded kernel module, the plans it was built from, and its argument layout
    (computed once, so that a call only gathers pointers)."""

    source: KernelSource
    schedule: KernelSchedule
    finalize: FinalizeSchedule | None
    compiled: CompiledModule
    functions: dict[str, Function]  # entry name -> the loaded function (launches go through:)
    launchers: dict  # entry name -> EntryLauncher
    device: DeviceSpec
    module: int  # the CUmodule of the functions, in its GPU's primary context
    occupancy: int  # resident blocks per SM of the main kernel, as the driver computes it
    resident_groups: int  # clusters (or blocks, without a cluster) resident on the whole GPU
    # (entry, ((slot of the source in _SLOT_ORDER, index) per parameter)) of each kernel in
    # launch order, from its Signature: the one record of the parameter order, shared with
    # the template
    arguments: tuple
    tensor_inputs: frozenset  # indices of the fusion inputs passed as data pointers
    vector_inputs: frozenset  # those of them loaded in vectors (not a value input's element)

    def resources(self) -> dict:
        """Per entry: the ptxas report and what the driver says about the loaded kernel."""
        report = {}
        for name, fn in self.functions.items():
            report[name] = {
                "ptxas": self.compiled.resource(name),
                "num_regs": fn.num_regs,
                "static_smem": fn.static_smem,
                "local_bytes": fn.local_bytes,
                "max_dynamic_smem": fn.max_dynamic_smem,
            }
        return report


@dataclass
class Run:
    """What the latest execute() did: the kernel and how it was launched."""

    kernel: Kernel
    launch: Launch
    finalize_launch: Launch | None


@dataclass(frozen=True)
class SegmentedRun:
    """What the latest execute() of a segmented fusion did: each segment's Run, in order."""

    segmentation: Segmentation
    runs: tuple[Run, ...]


_kernels: dict = {}
_kernels_lock = threading.Lock()


@cache
def _cupy():
    import cupy

    return cupy


def _info(fd) -> tuple[FusionInfo, str]:
    """FusionInfo and signature (its Python definition) of `fd`, recomputed only when the
    definition grew since the last call."""
    stamp = (len(fd.fusion.vals), len(fd.fusion.outputs))
    cached = getattr(fd, "_info_cache", None)
    if cached is None or cached[0] != stamp:
        fd._info_cache = (stamp, analyze(fd.fusion), fd.fusion.python_definition())
    return fd._info_cache[1], fd._info_cache[2]


# ----- inputs -----


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _describe(x) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


def _check_tensor(i: int, t: Tensor, x, torch_kind: bool):
    """(dtype, shape, pointer, device id) of input `x`, after checking its kind and layout."""
    where = f"input {i} ({t.name})"
    if torch_kind:
        if not _is_torch(x):
            raise BadInputError(f"{where} is a {_describe(x)}; pass all tensors as torch tensors "
                                "or all as CuPy arrays")
        if x.device.type != "cuda":
            raise BadInputError(f"{where} is on {x.device}; move it to a CUDA device (.cuda())")
        dtype = DataType.from_torch(x.dtype)
        contiguous, ptr, dev = x.is_contiguous(), x.data_ptr(), x.device.index
    else:
        if not _is_cupy(x) or not isinstance(x, _cupy().ndarray):
            raise BadInputError(f"{where} is a {_describe(x)}; fuser runs on CuPy arrays or "
                                "torch CUDA tensors (cupy.asarray(x) moves a numpy array)")
        dtype = DataType.from_numpy(x.dtype)
        contiguous, ptr, dev = x.flags.c_contiguous, x.data.ptr, x.device.id
    if dtype is not t.dtype:
        raise BadInputError(f"{where} has dtype {x.dtype}; the definition declares {t.dtype}")
    if not contiguous:
        fix = "x.contiguous()" if torch_kind else "cupy.ascontiguousarray(x)"
        raise BadInputError(
            f"{where} with shape {tuple(x.shape)} is not contiguous, and the definition declares "
            f"it contiguous; pass {fix}, or declare a False in its contiguity (fuser then copies "
            "a strided array to a contiguous one before the kernels)")
    return tuple(int(s) for s in x.shape), ptr, dev


def _alignment(pointers: list[int]) -> int:
    """Largest power of two up to 16 dividing every pointer (16 bytes is the widest access)."""
    align = 16
    for p in pointers:
        while p % align:
            align //= 2
    return align


# ----- kernels -----


def _load(fd, problem: Problem, device: DeviceSpec, hints, device_id: int) -> Kernel:
    info, _ = _info(fd)
    built = build(fd.name, info, problem, device, hints)
    gpu = driver()
    with gpu.on_device(device_id):
        module = gpu.load_module(built.compiled.cubin, f"the kernels of fusion '{fd.name}'")
        try:
            functions, occupancy, groups = _checked_functions(fd.name, built, module, device)
        except BaseException:
            gpu.unload_module(module)  # refused: nothing keeps its kernels
            raise
    s = built.schedule
    launchers = {sig.entry: _launcher(sig, functions[sig.entry],
                                      programmatic=sig.entry == built.source.finalize_entry
                                      and device.arch >= 90)
                 for sig in built.source.signatures}
    arguments = tuple((sig.entry, tuple((_SLOTS[p.source], p.index) for p in sig.params))
                      for sig in built.source.signatures)
    tensor_inputs = frozenset(p.index for sig in built.source.signatures for p in sig.params
                              if p.source is Source.INPUT and p.dtype is None)
    values = {i for i, v in enumerate(built.info.fusion.inputs) if v in built.info.value_inputs}
    return Kernel(built.source, s, built.finalize, built.compiled, functions, launchers, device,
                  module, occupancy, groups, arguments, tensor_inputs, tensor_inputs - values)


def _checked_functions(name: str, built, module: int, device: DeviceSpec
                       ) -> tuple[dict[str, Function], int, int]:
    """The module's functions (checked against their shared-memory plans, opted in to their
    dynamic shared memory), the row kernel's resident blocks per SM and resident groups
    (blocks, or clusters) on the GPU; raises where a kernel cannot run."""
    gpu = driver()
    functions = {}
    for entry, plan in built.plans():
        fn = gpu.function(module, entry)
        _check_static_smem(name, fn, plan, device)
        functions[entry] = gpu.allow_dynamic_smem(fn, plan.dynamic_bytes)
    s = built.schedule
    row = functions[built.source.row_entry]
    clustered = isinstance(s, RowSchedule | OuterSchedule) and s.cluster > 1
    if clustered and s.cluster > PORTABLE_CLUSTER:
        gpu.allow_large_clusters(row)
    occupancy = gpu.max_active_blocks(row, s.threads, s.smem.dynamic_bytes)
    if occupancy < 1:
        raise OutOfResourcesError(
            f"kernel {row.name} cannot be resident: {s.threads} threads, {row.num_regs} "
            f"registers per thread, {s.smem.dynamic_bytes} B dynamic shared memory per block"
        )
    groups = occupancy * device.sm_count
    if clustered:
        groups = _max_active_clusters(row, s)
    return functions, occupancy, groups


_SIZE_CTYPES = {Source.ROWS: ctypes.c_int64, Source.PARTIAL_ROWS: ctypes.c_int32}
# A call's launch arguments by source: _run builds one tuple in this order, and Kernel.arguments
# index it by position (an Enum key hashes in Python: 20 such hashes a call were 8% of a
# small call's host time under cProfile).
_SLOT_ORDER = (Source.INPUT, Source.OUTPUT, Source.PARTIALS, Source.ROWS, Source.PARTIAL_ROWS,
               Source.ROW_TICKETS)
_SLOTS = {source: slot for slot, source in enumerate(_SLOT_ORDER)}


def _launcher(signature: Signature, fn: Function, programmatic: bool) -> EntryLauncher:
    """The launcher of one entry, its parameter types read from the kernel's signature: a
    pointer per tensor, a scalar input's own type, the sizes. The finalize launches
    programmatically on sm_90 (it overlaps the row kernel's end)."""
    types = [_SIZE_CTYPES.get(p.source) or (ctype_of(p.dtype) if p.dtype is not None
                                            else POINTER) for p in signature.params]
    return EntryLauncher(signature.entry, fn.handle, types, fn.num_regs, programmatic)


def _block(s: KernelSchedule) -> tuple[int, int]:
    """blockDim (x, y) of a schedule's main kernel."""
    if isinstance(s, PointwiseSchedule):
        return s.threads, 1
    if isinstance(s, OuterSchedule):
        return s.col_lanes, s.row_lanes
    return s.threads_per_row, s.rows_per_block


def _max_active_clusters(fn: Function, s: RowSchedule | OuterSchedule) -> int:
    """How many clusters of the kernel the driver can keep resident at once. Not SMs x blocks
    per SM / cluster: a cluster must fit in one GPC, and a GPC's SM count need not be a
    multiple of the cluster size (on the H200, 32 clusters of 4 one-block SMs are resident,
    not 33). A persistent grid one cluster over that runs a second wave for the last cluster,
    which doubles the kernel's time."""
    x, y = _block(s)
    config = LaunchConfig(gridDimX=s.cluster, gridDimY=1, gridDimZ=1, blockDimX=x, blockDimY=y,
                          blockDimZ=1, sharedMemBytes=s.smem.dynamic_bytes)
    status, clusters = driver().max_active_clusters(fn, config)
    if status or clusters < 1:
        raise OutOfResourcesError(
            f"clusters of {s.cluster} blocks ({s.threads} threads, {s.smem.dynamic_bytes} B "
            f"dynamic shared memory each) cannot be resident: the driver says "
            f"{driver().error_name(status)}, {clusters} cluster(s); use a smaller cluster "
            "(Hints(cluster=...))"
        )
    return clusters


def _check_static_smem(name: str, fn: Function, plan, device: DeviceSpec) -> None:
    """The static shared memory the driver reports must fit the plan's reserved slot, and
    static + dynamic must fit the device: the check nvFuser's schedulers once missed."""
    static, entry = fn.static_smem, fn.name
    if static > plan.static_slot:
        raise OutOfResourcesError(
            f"kernel {entry} of fusion '{name}' declares {static} B of static shared memory, "
            f"more than the {plan.static_slot} B slot its plan reserves; the plan would "
            "under-count (this is a fuser bug: please report it with the CUDA source)"
        )
    if static + plan.dynamic_bytes > device.smem_per_block_optin:
        raise OutOfResourcesError(
            f"kernel {entry} of fusion '{name}' needs {static} B static + {plan.dynamic_bytes} B "
            f"dynamic = {static + plan.dynamic_bytes} B of shared memory per block, over the "
            f"device limit of {device.smem_per_block_optin} B"
        )


def get_kernel(fd, problem: Problem, device: DeviceSpec, device_id: int, hints=None) -> Kernel:
    """The compiled kernel for this fusion, problem class and device (compiled at most once),
    loaded on GPU `device_id`: each GPU has its own function handles and attributes, so its
    id is part of the key even where two GPUs share a DeviceSpec."""
    _, signature = _info(fd)
    key = (signature, fd.name, problem, device, hints, device_id)
    with _kernels_lock:
        kernel = _kernels.get(key)
    if kernel is None:
        loaded = _load(fd, problem, device, hints, device_id)
        with _kernels_lock:
            kernel = _kernels.setdefault(key, loaded)
        if kernel is not loaded:  # another thread's load came first
            with driver().on_device(device_id):
                driver().unload_module(loaded.module)
    return kernel


def _launch(kernel: Kernel, rows: int, device: DeviceSpec) -> tuple[Launch, Launch | None]:
    s = kernel.schedule
    if isinstance(s, PointwiseSchedule):
        # Every thread takes UNROLL vectors once and the hardware deals the blocks to SMs as
        # they free up; the kernel's loop strides only past max_grid_x. A persistent grid of
        # 8 blocks per SM striding over the vectors ended with its slowest SM (H200 bf16:
        # swiglu_bwd 0.86-0.88 -> 0.98-1.00 of the copy, geglu_fwd 0.96 -> 1.00).
        vectors = rows * (s.hidden // s.vec)
        grid = max(1, min(ceil_div(vectors, s.threads * s.unroll), device.max_grid_x))
        return Launch(grid, _block(s), 0, 0), None
    if isinstance(s, OuterSchedule):
        # A cluster per slab of columns; each block keeps at most rank_rows of its rows.
        if ceil_div(rows, s.cluster) > s.rank_rows:
            raise InternalError(f"{rows} rows for a kernel built for {s.rows} (a fuser bug)")
        return Launch(s.slabs * s.cluster, _block(s), s.smem.dynamic_bytes, 0), None
    # A cluster of k blocks works on each group of rows: the grid is a multiple of k, and no
    # larger than what is resident at once (a persistent grid has no second wave), unless a
    # block (cluster) takes each group. The column sums of skewed rows need each thread's
    # rows to share a skew: a grid that strides strides over whole periods of the skews
    # (RowSchedule.group_period), a second wave where fewer than one period are resident.
    groups = ceil_div(rows, s.rows_per_block)
    most = (device.max_grid_x // s.cluster if s.dealing is Dealing.GRID
            else kernel.resident_groups)
    clusters = max(1, min(groups, most))
    if kernel.finalize is not None and clusters < groups:
        clusters = min(groups, max(s.group_period, clusters - clusters % s.group_period))
    grid = clusters * s.cluster
    partial_rows = clusters * s.partial_rows_per_block if kernel.finalize is not None else 0
    launch = Launch(grid, _block(s), s.smem.dynamic_bytes, partial_rows)
    final = None
    if kernel.finalize is not None:
        f = kernel.finalize
        final = Launch(ceil_div(f.hidden, f.cols_per_block), (f.cols_per_block, f.partial_lanes),
                       f.smem.dynamic_bytes, partial_rows)
    return launch, final


# ----- execute -----


@dataclass(frozen=True, eq=False)
class Plan:
    """What a call needs that depends only on its inputs' kinds, dtypes, shapes, devices and
    alignment: calls with equal signatures reuse it and only gather pointers and allocate."""

    kernel: Kernel
    launch: Launch
    finalize_launch: Launch | None
    torch_kind: bool
    device_id: int
    context: int  # the device's primary context, which the kernels are loaded into
    align: int  # every data pointer must be a multiple of this (the kernel's vector accesses)
    rows: int
    outputs: tuple  # (shape, DataType) per fusion output
    partials: tuple  # (shape, DataType) per outer reduction's workspace
    # input index -> (the Scalar, the numpy type of its kernel parameter), checked every call:
    # a scalar's value is not part of the plan's key
    scalar_types: dict
    counted: bool  # the row kernel deals its row groups from a counter (fuser.tickets)
    workspaces: dict = field(default_factory=dict, compare=False)  # stream -> partial buffers
    # Held from the row kernel's launch to the finalize's, so that two threads sharing a stream
    # cannot enqueue row A, row B, finalize A (which would read B's partial rows).
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False)

    @cached_property
    def run(self) -> Run:
        """What fd._last_run holds after a call with this plan (one record for all such
        calls), which fd.last_schedule() and last_cuda_code() read."""
        return Run(self.kernel, self.launch, self.finalize_launch)

    @cached_property
    def pointer_inputs(self) -> tuple[int, ...]:
        """The inputs passed as data pointers, by index, in order."""
        return tuple(sorted(self.kernel.tensor_inputs))

    @cached_property
    def vector_inputs(self) -> tuple[int, ...]:
        """The inputs loaded in vectors, whose pointers every call checks against `align`."""
        return tuple(sorted(self.kernel.vector_inputs))

    @cached_property
    def launches(self) -> tuple:
        """(launcher, Launch, (slot in _SLOT_ORDER, index) per parameter) of each kernel, in
        launch order: what a call walks through, looked up once."""
        return tuple((self.kernel.launchers[entry], size, arguments)
                     for (entry, arguments), size in zip(
                         self.kernel.arguments, (self.launch, self.finalize_launch),
                         strict=False))

    @cached_property
    def sizes(self) -> tuple[tuple[int], tuple[int]]:
        """The ROWS and PARTIAL_ROWS slots of every call's arguments."""
        final = self.finalize_launch
        return (self.rows,), (final.partial_rows if final is not None else 0,)


MAX_PLANS = 64  # plans kept per fusion definition (distinct shapes seen recently)


_TORCH, _CUPY, _OTHER = range(3)
_KINDS: dict[type, int] = {}  # the kind of each input type seen, classified once


def _kind(cls: type) -> int:
    """Whether an input type is torch's, CuPy's or another (a scalar's), remembered."""
    module = cls.__module__
    kind = _KINDS[cls] = (_TORCH if module.startswith("torch") else
                          _CUPY if module.startswith("cupy") else _OTHER)
    return kind


def _signature(inputs) -> tuple:
    """Kind, dtype, shape, contiguity and device of every input: the plan cache key. (A CuPy
    array's device id is read from its memory pointer: x.device builds a Device object.)"""
    key: list[tuple] = []
    for x in inputs:
        kind = _KINDS.get(type(x))
        if kind is None:
            kind = _kind(type(x))
        if kind == _TORCH:
            key.append((x.dtype, x.shape, x.is_contiguous(), x.get_device()))
        elif kind == _CUPY:
            key.append((x.dtype, x.shape, x.flags.c_contiguous, x.data.device_id))
        else:
            key.append((type(x),))
    return tuple(key)


def _checked_inputs(fusion, inputs: list) -> tuple[bool, list]:
    """Whether the tensors are torch's, and per input _check_tensor's (shape, pointer, device)
    (None for a scalar input, whose value is checked)."""
    tensors = [x for v, x in zip(fusion.inputs, inputs, strict=True) if isinstance(v, Tensor)]
    torch_kind = bool(tensors) and _is_torch(tensors[0])
    checked: list[tuple[tuple[int, ...], int, int] | None] = []
    for i, (v, x) in enumerate(zip(fusion.inputs, inputs, strict=True)):
        if isinstance(v, Scalar):
            scalar_value(i, v, x)
            checked.append(None)
        else:
            checked.append(_check_tensor(i, as_tensor(v), x, torch_kind))
    return torch_kind, checked


def _plan(fd, inputs: list, device, hints) -> Plan:
    """Check every input against the definition, then schedule, compile and size the call."""
    info, _ = _info(fd)
    fusion = info.fusion
    if len(inputs) != len(fusion.inputs):
        raise BadInputError(
            f"fusion '{fd.name}' takes {len(fusion.inputs)} inputs "
            f"({', '.join(v.name for v in fusion.inputs)}), got {len(inputs)}"
        )
    torch_kind, checked = _checked_inputs(fusion, inputs)
    shapes = [c[0] if c is not None else None for c in checked]
    pointers: list[int] = []
    devices: set[int] = set()
    for i, (v, c) in enumerate(zip(fusion.inputs, checked, strict=True)):
        if c is None:
            continue
        _, ptr, dev = c
        check_pointer(i, as_tensor(v), ptr)
        if v not in info.value_inputs:  # read once, element by element: no vector width
            pointers.append(ptr)
        devices.add(dev)
    if len(devices) > 1:
        raise BadInputError(f"inputs are on devices {sorted(devices)}; put them on one device")
    sizes = bind_shapes(fusion, shapes)
    rows = math.prod(sizes.value(axis) for axis in info.row_axes)
    hidden = sizes.value(info.hidden_axis) if info.hidden_axis is not None else 1
    device_id = devices.pop() if devices else driver().current_device()
    align = _alignment(pointers)
    actual = DeviceSpec.from_gpu(device_id)
    spec = actual if device is None else DeviceSpec.get(device)
    if device is not None:
        check_device(spec, actual, device_id)
    kernel = get_kernel(fd, Problem(hidden, problem_rows(info, rows), align), spec, device_id,
                        hints)
    launch, final = _launch(kernel, rows, spec)
    partials = () if final is None else tuple(
        ((max(launch.partial_rows, 1), hidden), workspace_dtype(e.outputs[0].dtype))
        for e in info.outer_reductions)
    scalar_types = {i: (v, v.dtype.scalar_numpy.type) for i, v in enumerate(fusion.inputs)
                    if isinstance(v, Scalar)}
    counted = (isinstance(kernel.schedule, RowSchedule)
               and kernel.schedule.dealing is Dealing.DYNAMIC)
    return Plan(kernel, launch, final, torch_kind, device_id, driver().primary_context(device_id),
                align, rows, tuple((sizes.shape(o), o.dtype) for o in fusion.outputs), partials,
                scalar_types, counted)


def execute(fd, inputs: list, *, device=None, hints: Hints | None = None):
    inputs = _contiguous(fd, list(inputs))
    plans = fd.__dict__.setdefault("_plans", {})
    try:
        key = (_signature(inputs), device, hints)
        plan = plans.get(key)
    except TypeError:  # an unhashable input: the full checks will name it
        key, plan = None, None
    if plan is None:
        # A fusion one kernel chain runs has plans (a cached one skips this question); so has
        # an outer normalization that runs its segments at these shapes (columns_too_tall).
        segmentation = segments_of(fd)
        if segmentation is not None:
            return _execute_segments(fd, segmentation, inputs, device, hints)
        plan = planned(fd, lambda: _plan(fd, inputs, device, hints))
        if key is not None:
            if len(plans) >= MAX_PLANS:
                plans.pop(next(iter(plans)))
            plans[key] = plan
    if isinstance(plan, Segmentation):
        return _execute_segments(fd, plan, inputs, device, hints)
    pointers = _pointers(plan, inputs)
    align = plan.align
    for i in plan.vector_inputs:
        if pointers[i] % align:
            # Same shapes, but an input starts at an address the cached kernel cannot load
            # with its vector width (a view at an offset): plan this call on its own.
            plan = planned(fd, lambda: _plan(fd, inputs, device, hints))
            if isinstance(plan, Segmentation):
                return _execute_segments(fd, plan, inputs, device, hints)
            pointers = _pointers(plan, inputs)
            break
    outputs = _run(plan, inputs, pointers)
    fd._last_run = plan.run
    return outputs


def _contiguous(fd, inputs: list) -> list:
    """`inputs`, with a contiguous copy of each array that is passed, not contiguous, for an
    input the definition declares non-contiguous (analysis.strided_inputs): the kernels read
    contiguous rows. The copy is the array library's (x.contiguous(), cupy.ascontiguousarray),
    one read and one write of that input. Inputs declared contiguous are not copied: a strided
    array there is refused with the fix (_check_tensor)."""
    stamp = len(fd.fusion.vals)
    cached = fd.__dict__.get("_strided_cache")
    if cached is None or cached[0] != stamp:
        positions = {v: i for i, v in enumerate(fd.fusion.inputs)}
        fd._strided_cache = cached = (stamp, tuple(positions[t]
                                                   for t in strided_inputs(fd.fusion)))
    for i in cached[1]:
        if i >= len(inputs):
            continue  # the input count is checked with the rest
        x = inputs[i]
        if _is_torch(x):
            if not x.is_contiguous():
                inputs[i] = x.contiguous()
        elif _is_cupy(x) and not x.flags.c_contiguous:
            with x.device:  # the copy on the array's own GPU, not the current one
                inputs[i] = _cupy().ascontiguousarray(x)
    return inputs


def segments_of(fd) -> Segmentation | None:
    """None when one kernel chain runs `fd`, else its segments (segment.py); raises the
    analysis' UnsupportedFusionError when cutting does not help either."""
    stamp = (len(fd.fusion.vals), len(fd.fusion.outputs))
    cached = fd.__dict__.get("_segments_cache")
    if cached is None or cached[0] != stamp:
        try:
            _info(fd)
            found = None
        except UnsupportedFusionError as exc:
            found = segment(fd.fusion, fd.name, exc)
        fd._segments_cache = cached = (stamp, found)
    return cached[1]


def planned(fd, plan: Callable[[], T]) -> T | Segmentation:
    """plan(), or where it raises for an outer normalization (its columns too tall for the
    outer-persistent kernel, a kernel that spills, a cluster the driver cannot keep resident)
    the segments that run it instead (columns_too_tall); explain() and execute() both ask
    here. A HintError stands; hints given to a fusion that runs as segments are refused
    there (Segmentation.hint_error), the refusal that made it segments named."""
    try:
        return plan()
    except (UnsupportedFusionError, OutOfResourcesError) as exc:
        segmentation = columns_too_tall(fd, exc)
        if segmentation is None:
            raise
        return segmentation


def columns_too_tall(fd, reason: FuserError) -> Segmentation | None:
    """The segments of an outer normalization that the outer-persistent kernel cannot run here
    (its columns too tall for any cluster to keep on chip, most often; `reason` says why), with
    that reason: two or three sweeps instead of one. None for any other fusion, whose refusal
    stands."""
    found = outer_segments(fd)
    if found is None:
        return None
    return replace(found, refusal=f"one outer-persistent kernel cannot run it here: {reason}")


def outer_segments(fd) -> Segmentation | None:
    """segment() of an outer normalization (cached per definition): the chain it runs as where
    the outer-persistent kernel cannot (columns_too_tall); None for any other fusion."""
    try:
        if _info(fd)[0].kind is not Kind.OUTER_NORM:
            return None
    except UnsupportedFusionError:  # refused by the analysis: no size makes it one kernel
        return None
    stamp = (len(fd.fusion.vals), len(fd.fusion.outputs))
    cached = fd.__dict__.get("_outer_segments")
    if cached is None or cached[0] != stamp:
        reason = UnsupportedFusionError("an outer normalization whose columns do not fit")
        fd._outer_segments = cached = (stamp, segment(fd.fusion, fd.name, reason))
    return cached[1]


def _execute_segments(fd, segmentation: Segmentation, inputs: list, device, hints) -> list:
    """Run the segments in order, each on the fusion's inputs and earlier segments' outputs,
    the layout ops made between them. Every input is checked first (kind, device, dtype, rank
    and sizes against the whole fusion): a layout op may touch it before any segment does."""
    lowered = segmentation.lowered
    if hints is not None:
        raise segmentation.hint_error(fd.name)
    if len(inputs) != len(lowered.inputs):
        raise BadInputError(
            f"fusion '{fd.name}' takes {len(lowered.inputs)} inputs, got {len(inputs)}")
    sizes = bind_shapes(lowered, [c[0] if c is not None else None
                                  for c in _checked_inputs(lowered, inputs)[1]])
    values = dict(zip(lowered.inputs, inputs, strict=True))
    _make_layouts(segmentation.layouts, values, sizes)
    runs: list[Run] = []
    for s in segmentation.segments:
        outs = execute(s.definition, s.arguments(values), device=device)
        values.update(zip(s.outputs, outs, strict=True))
        _make_layouts(segmentation.layouts, values, sizes)
        run = s.definition._last_run
        assert isinstance(run, Run)
        runs.append(run)
    fd._last_run = SegmentedRun(segmentation, tuple(runs))
    return _unshared(lowered, values)


def _make_layouts(layouts, values: dict, sizes) -> None:
    """Each permute or reshape whose operand is in `values` and result is not yet: permute as
    a copy in the new order, always new memory (the next kernels read contiguous rows),
    reshape as a view of the shape bind_shapes gave its result."""
    for e in layouts:
        out, x = e.outputs[0], values.get(e.inputs[0])
        if out in values or x is None:
            continue
        if e.op == "reshape":
            values[out] = x.reshape(sizes.shape(as_tensor(out)))
        elif _is_torch(x):
            import torch

            values[out] = x.permute(e.attr("dims")).clone(memory_format=torch.contiguous_format)
        else:
            with x.device:
                values[out] = _cupy().array(x.transpose(e.attr("dims")), order="C", copy=True)


def _unshared(lowered, values: dict) -> list:
    """The fusion's outputs, none sharing memory with an input or an earlier output: a
    reshape's result is a view of its operand, so one of an input, of another output, or of a
    value two outputs reshape, is returned as a copy."""
    held = set(lowered.inputs)  # values whose memory the caller holds, by the value viewed
    results = []
    for o in lowered.outputs:
        viewed = o
        while viewed.definition is not None and viewed.definition.op == "reshape":
            viewed = viewed.definition.inputs[0]
        results.append(_copy(values[o]) if viewed in held else values[o])
        held.add(viewed)
    return results


def _copy(x):
    return x.clone() if _is_torch(x) else x.copy()


def _pointers(plan: Plan, inputs: list) -> list:
    """Per input, its data pointer where the kernels read it as one (else None): the INPUT
    slot of the call's arguments, which the scalar inputs' values fill in."""
    pointers: list = [None] * len(inputs)
    if plan.torch_kind:
        for i in plan.pointer_inputs:
            pointers[i] = inputs[i].data_ptr()
    else:
        for i in plan.pointer_inputs:
            pointers[i] = inputs[i].data.ptr
    return pointers


@cache
def _torch():
    import torch

    return torch


# DataType label -> the array library's dtype (keyed by the label: an Enum member hashes in
# Python, a str in C)
_TORCH_DTYPES: dict[str, object] = {}
_NUMPY_DTYPES: dict[str, np.dtype] = {}


def _allocate(shape, dtype: DataType, torch_kind: bool, like):
    if torch_kind:
        array_dtype = _TORCH_DTYPES.get(dtype.label)
        if array_dtype is None:
            array_dtype = _TORCH_DTYPES[dtype.label] = getattr(_torch(), dtype.numpy.name)
        return _torch().empty(shape, dtype=array_dtype, device=like.device)
    array_dtype = _NUMPY_DTYPES.get(dtype.label)
    if array_dtype is None:
        array_dtype = _NUMPY_DTYPES[dtype.label] = dtype.numpy
    return _cupy().empty(shape, dtype=array_dtype)


def _stream(torch_kind: bool, device_id: int) -> int:
    """The stream to launch on, as a handle: torch's current stream for torch tensors, else
    CuPy's."""
    if not torch_kind:
        return _cupy().cuda.get_current_stream(device_id).ptr
    return _torch_stream()(device_id)


@cache
def _torch_stream() -> Callable[[int], int]:
    """torch's current stream of a device, as a handle: its raw-stream getter (what
    torch.compile's kernels call) skips building a Stream object; the public call is the
    fallback."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device_id: torch.cuda.current_stream(device_id).cuda_stream


def _partials(plan: Plan, stream: int, like) -> list:
    """The column-sum workspace of one call. With torch tensors, a new one from torch's
    caching allocator every call: torch then orders its reuse on the stream, and a CUDA graph
    (torch.cuda.graph, or torch.compile's CUDA graph trees, which also warm up in their own
    pool and refuse allocations there that no output holds) gets its own. With CuPy arrays,
    the partial rows are written and read only by this call's kernels, in stream order, so
    one buffer per stream serves every call; the per-thread default stream has one handle for
    a different stream in every thread, so its buffers are per thread."""
    if plan.torch_kind:
        return _workspace(plan, like)
    owner = _owner(stream)
    partials = plan.workspaces.get(owner)
    if partials is None:
        partials = plan.workspaces[owner] = _workspace(plan, like)
    return partials


def _owner(stream: int):
    """Who a stream's buffers belong to: the stream, or for the per-thread default stream
    (one handle for a different stream in every thread) the stream and the thread."""
    return (stream, threading.get_ident()) if stream == PER_THREAD_STREAM else stream


def _run(plan: Plan, inputs: list, pointers: list) -> list:
    """Allocate the outputs and launch, with the plan's device current: as it mostly is
    already (one driver call says so), else made current for the call (and for CuPy arrays
    through CuPy, which allocates on the runtime's current device). Another context of the
    same device is refused: the caller's stream would be that context's."""
    gpu = driver()
    current = gpu.current_context()
    if current == plan.context:
        return _enqueue(plan, inputs, pointers)
    if current and gpu.current_device() == plan.device_id:
        raise LaunchError(
            f"the current CUDA context ({current:#x}) of device {plan.device_id} is not its "
            f"primary context ({plan.context:#x}), the one torch and CuPy run in and fuser "
            "loads its kernels into: the stream a launch would go to belongs to another "
            "context. Make the primary context current (torch.cuda.set_device, "
            "cupy.cuda.Device, or cuDevicePrimaryCtxRetain and cuCtxSetCurrent)")
    with contextlib.ExitStack() as stack:
        if not plan.torch_kind:
            stack.enter_context(_cupy().cuda.Device(plan.device_id))
        stack.enter_context(gpu.on_device(plan.device_id))
        return _enqueue(plan, inputs, pointers)


def _enqueue(plan: Plan, inputs: list, pointers: list) -> list:
    torch_kind = plan.torch_kind
    like = inputs[plan.pointer_inputs[0]]
    outs = [_allocate(shape, dtype, torch_kind, like) for shape, dtype in plan.outputs]
    stream = _stream(torch_kind, plan.device_id)
    partials = _partials(plan, stream, like) if plan.partials else []
    for i, (v, t) in plan.scalar_types.items():
        pointers[i] = t(scalar_value(i, v, inputs[i]))
    if torch_kind:
        addresses = [o.data_ptr() for o in outs], [p.data_ptr() for p in partials]
    else:
        addresses = [o.data.ptr for o in outs], [p.data.ptr for p in partials]
    tickets = (ticket_counters(plan.device_id).counter(_owner(stream), stream)
               if plan.counted else 0)
    values = (pointers, *addresses, *plan.sizes, (tickets,))  # in _SLOT_ORDER
    with plan.lock:
        for launcher, size, arguments in plan.launches:
            launcher(size.grid, size.block, size.dynamic_smem, stream,
                     [values[slot][i] for slot, i in arguments])
    return outs


def _workspace(plan: Plan, like) -> list:
    """The partial-row buffers of one stream. A device out of memory for them is named with
    their size (torch's and CuPy's own errors would not say what the memory was for)."""
    try:
        return [_allocate(shape, dtype, plan.torch_kind, like) for shape, dtype in plan.partials]
    except Exception as exc:
        if "OutOfMemory" not in type(exc).__name__:
            raise
        sizes = " + ".join(f"{shape[0]} x {shape[1]} x {dtype.itemsize} B"
                           for shape, dtype in plan.partials)
        total = sum(shape[0] * shape[1] * dtype.itemsize for shape, dtype in plan.partials)
        raise OutOfResourcesError(
            f"the column-sum workspace ({sizes} = {total} B: one partial row per resident "
            f"block) does not fit in the free memory of device {plan.device_id} ({exc}); free "
            "device memory or run on a device with more"
        ) from None


# ----- validate -----


def to_host(x) -> np.ndarray:
    if _is_torch(x):
        import torch

        if x.dtype == torch.bfloat16:
            return x.detach().float().cpu().numpy()
        return x.detach().cpu().numpy()
    return _cupy().asnumpy(x)


def validate(fd, inputs: list, reference_outputs=None, *, device=None):
    """Execute, then compare every output with the float64 reference (or the given outputs)
    at tolerances per dtype, reduction size and, for float32 / float64 outputs, the outputs'
    sensitivity to a rounding of the inputs; raises AssertionError naming the worst miss."""
    from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes

    outputs = execute(fd, inputs, device=device)
    host_inputs = [to_host(x) if not isinstance(v, Scalar) else x
                   for v, x in zip(fd.fusion.inputs, inputs, strict=True)]
    oracle = None
    if reference_outputs is None:
        reference_outputs = oracle = evaluate(fd.fusion, host_inputs)
    else:
        reference_outputs = [to_host(r) if not isinstance(r, np.ndarray) else r
                             for r in reference_outputs]
    compare([to_host(o) for o in outputs], reference_outputs, fd.fusion,
            output_reduction_sizes(fd.fusion, host_inputs),
            input_sensitivity(fd.fusion, host_inputs, oracle))
    return outputs
