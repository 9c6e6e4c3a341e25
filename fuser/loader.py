"""Kernels onto the device: build (schedule, render, compile, cached), load into the GPU's
primary context, check what the driver reports against the plans (static shared memory, the
resident blocks and clusters), and size each launch. A loaded kernel is kept per fusion,
problem class, device preset, hints and GPU, so a process builds and loads it once.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from fuser.analysis import FusionInfo
from fuser.compile import CompiledModule
from fuser.device import DeviceSpec
from fuser.driver import Function, LaunchConfig, driver
from fuser.errors import InternalError, OutOfResourcesError
from fuser.kernels import build
from fuser.launch import MAX_GRID_Y, POINTER, EntryLauncher, ctype_of
from fuser.schedulers import Problem
from fuser.schedulers.base import (
    Dealing,
    FinalizeSchedule,
    KernelSchedule,
    Launch,
    OuterSchedule,
    PointwiseSchedule,
    RowSchedule,
    ceil_div,
)
from fuser.schedulers.hints import PORTABLE_CLUSTER
from fuser.signature import KernelSource, Signature, Source


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
    tensor_inputs: tuple[int, ...]  # indices of the fusion inputs passed as data pointers
    vector_inputs: tuple[int, ...]  # those of them loaded in vectors (not a value input's element)

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


_kernels: dict = {}
_kernels_lock = threading.Lock()


def _load(name: str, info: FusionInfo, problem: Problem, device: DeviceSpec, hints,
          device_id: int) -> Kernel:
    built = build(name, info, problem, device, hints)
    gpu = driver()
    with gpu.on_device(device_id):
        module = gpu.load_module(built.compiled.cubin, f"the kernels of fusion '{name}'")
        try:
            functions, occupancy, groups = _checked_functions(name, built, module, device)
        except BaseException:
            gpu.unload_module(module)  # refused: nothing keeps its kernels
            raise
    s = built.schedule
    fused = built.finalize is not None and built.finalize.fused
    launchers = {sig.entry: _launcher(sig, functions[sig.entry],
                                      programmatic=sig.entry == built.source.finalize_entry
                                      and device.arch >= 90,
                                      cooperative=fused and sig.entry == built.source.row_entry)
                 for sig in built.source.signatures}
    arguments = tuple((sig.entry, tuple((_SLOTS[p.source], p.index) for p in sig.params))
                      for sig in built.source.signatures)
    tensor_inputs = sorted({p.index for sig in built.source.signatures for p in sig.params
                            if p.source is Source.INPUT and p.dtype is None})
    values = {i for i, v in enumerate(built.info.fusion.inputs) if v in built.info.value_inputs}
    return Kernel(built.source, s, built.finalize, built.compiled, functions, launchers, device,
                  module, occupancy, groups, arguments, tuple(tensor_inputs),
                  tuple(i for i in tensor_inputs if i not in values))


def _checked_functions(name: str, built, module: int, device: DeviceSpec
                       ) -> tuple[dict[str, Function], int, int]:
    """The module's functions (checked against their shared-memory plans, opted in to their
    dynamic shared memory), the row kernel's resident blocks per SM and resident groups
    (blocks, or clusters) on the GPU; raises where a kernel cannot run."""
    gpu = driver()
    functions = {}
    for entry, plan in built.plans():
        fn = gpu.function(module, entry)
        check_static_smem(name, fn, plan, device)
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


_SIZE_CTYPES = {Source.ROWS: ctypes.c_int64, Source.PARTIAL_ROWS: ctypes.c_int32,
                Source.ROW_REPEATS: ctypes.c_int64, Source.GROUPS: ctypes.c_int64}
# A call's launch arguments by source: calls.run builds one tuple in this order, and
# Kernel.arguments index it by position (an Enum key hashes in Python: 20 such hashes a call
# were 8% of a small call's host time under cProfile).
_SLOT_ORDER = (Source.INPUT, Source.OUTPUT, Source.PARTIALS, Source.ROWS, Source.PARTIAL_ROWS,
               Source.ROW_TICKETS, Source.GROUPS, Source.ROW_REPEATS)
_SLOTS = {source: slot for slot, source in enumerate(_SLOT_ORDER)}


def _launcher(signature: Signature, fn: Function, programmatic: bool,
              cooperative: bool) -> EntryLauncher:
    """The launcher of one entry, its parameter types read from the kernel's signature: a
    pointer per tensor, a scalar input's own type, the sizes. The finalize launches
    programmatically on sm_90 (it overlaps the row kernel's end); a row kernel that
    finalizes its columns itself, cooperatively (its grid barrier needs every block
    resident)."""
    types = [_SIZE_CTYPES.get(p.source) or (ctype_of(p.dtype) if p.dtype is not None
                                            else POINTER) for p in signature.params]
    return EntryLauncher(signature.entry, fn.handle, types, fn.num_regs, programmatic,
                         cooperative)


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


def check_static_smem(name: str, fn: Function, plan, device: DeviceSpec) -> None:
    """The static shared memory the driver reports must fit the plan's reserved slot, and
    static + dynamic must fit the device: the check nvFuser's schedulers once missed. `name`:
    the fusion the kernel runs (or the permute kernel's entry)."""
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


def get_kernel(name: str, info: FusionInfo, definition: str, problem: Problem,
               device: DeviceSpec, device_id: int, hints=None) -> Kernel:
    """The compiled kernel for this fusion (its name, analysis and Python definition), problem
    class and device (compiled at most once), loaded on GPU `device_id`: each GPU has its own
    function handles and attributes, so its id is part of the key even where two GPUs share a
    DeviceSpec."""
    key = (definition, name, problem, device, hints, device_id)
    with _kernels_lock:
        kernel = _kernels.get(key)
    if kernel is None:
        loaded = _load(name, info, problem, device, hints, device_id)
        with _kernels_lock:
            kernel = _kernels.setdefault(key, loaded)
        if kernel is not loaded:  # another thread's load came first
            with driver().on_device(device_id):
                driver().unload_module(loaded.module)
    return kernel


def launch_sizes(kernel: Kernel, rows: int, device: DeviceSpec, n_groups: int = 1
                 ) -> tuple[Launch, Launch | None]:
    """The grid, block and shared memory of the kernel's launch (and its finalize's) for a
    call of `rows` rows, in each of `n_groups` groups (FusionInfo.group_axes: a grid row of
    blocks per group, which share the resident blocks; refused past the grid's rows)."""
    if n_groups > MAX_GRID_Y * MAX_GRID_Y:
        raise OutOfResourcesError(
            f"{n_groups} groups of the leading dimensions: a kernel runs a grid row of blocks "
            f"per group, at most {MAX_GRID_Y} x {MAX_GRID_Y} = {MAX_GRID_Y * MAX_GRID_Y} "
            "(gridDim.y x gridDim.z); split the leading dimensions over several calls")
    s = kernel.schedule
    if isinstance(s, PointwiseSchedule):
        # Every thread takes UNROLL vectors once and the hardware deals the blocks to SMs as
        # they free up; the kernel's loop strides only past max_grid_x. A persistent grid of
        # 8 blocks per SM striding over the vectors ended with its slowest SM (H200 bf16:
        # swiglu_bwd 0.86-0.88 -> 0.98-1.00 of the copy, geglu_fwd 0.96 -> 1.00).
        vectors = ceil_div(rows * s.hidden, s.vec)  # a row's, where vec divides hidden
        grid = max(1, min(ceil_div(vectors, s.threads * s.unroll), device.max_grid_x))
        return Launch(grid, _block(s), 0, 0), None
    if isinstance(s, OuterSchedule):
        # A cluster per slab of columns (in each group's grid row); each block keeps at most
        # rank_rows of its rows (streamed, any share).
        if not s.streamed and ceil_div(rows, s.cluster) > s.rank_rows:
            raise InternalError(f"{rows} rows for a kernel built for {s.rows} (a fuser bug)")
        return Launch(s.slabs * s.cluster, _block(s), s.smem.dynamic_bytes, 0, n_groups), None
    # A cluster of k blocks works on each group of rows: the grid is a multiple of k, and no
    # larger than what is resident at once (a persistent grid has no second wave), unless a
    # block (cluster) takes each group. The column sums of skewed rows, and their columns
    # kept at the rows' skew (RowSchedule.columns_at_skew), need each thread's rows to share
    # a skew: a grid that strides strides over whole periods of the skews
    # (RowSchedule.group_period), a second wave where fewer than one period are resident.
    groups = ceil_div(rows, s.rows_per_block)
    most = (device.max_grid_x // s.cluster if s.dealing is Dealing.GRID
            else max(1, kernel.resident_groups // n_groups))
    clusters = max(1, min(groups, most))
    if (kernel.finalize is not None or s.columns_at_skew) and clusters < groups:
        clusters = min(groups, max(s.group_period, clusters - clusters % s.group_period))
    grid = clusters * s.cluster
    partial_rows = clusters * s.partial_rows_per_block if kernel.finalize is not None else 0
    launch = Launch(grid, _block(s), s.smem.dynamic_bytes, partial_rows, n_groups)
    final = None
    if kernel.finalize is not None and not kernel.finalize.fused:
        f = kernel.finalize
        final = Launch(ceil_div(f.hidden, f.cols_per_block), (f.cols_per_block, f.partial_lanes),
                       f.smem.dynamic_bytes, partial_rows, n_groups)
    return launch, final
