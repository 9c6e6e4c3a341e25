"""A planned call: what depends only on the inputs' kinds, dtypes, shapes, devices and
alignment is planned once (Plan, keyed by `signature`), and each call with that signature only
gathers pointers, allocates its outputs and launches (`run`). This is the path every cached
fd.execute takes, so it builds as little as it can: the plan holds each kernel's launcher,
sizes and argument order, a launcher packs its parameters in one call.

CuPy arrays in give CuPy arrays out; torch CUDA tensors in give torch tensors out (allocated by
torch, launched on torch's current stream).
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import TypeVar

from fuser.checks import scalar_value
from fuser.driver import DriverError, driver
from fuser.dtypes import DataType
from fuser.errors import LaunchError, OutOfResourcesError
from fuser.loader import Kernel
from fuser.schedulers.base import Launch, ceil_div
from fuser.tickets import counters as ticket_counters

T = TypeVar("T")

PER_THREAD_STREAM = 2  # cudaStreamPerThread: the same handle in every thread

# With torch tensors, a column-sum workspace of at most this many bytes comes from a buffer of
# this size kept for each stream (KeptWorkspace: device memory of fuser's own, outside torch's
# caching allocator, never freed), so that a call allocates only its outputs: small calls are
# bound by host time, of which each torch allocation took 3.0 us of 25.8 on the H200's host
# (bench/results/2026-12-03-host-parts.txt). Larger workspaces come from torch's allocator
# every call, where torch sees the memory.
KEPT_TORCH_WORKSPACE_BYTES = 1 << 20
WORKSPACE_ALIGN = 256  # bytes between the starts of a kept workspace's partial-row buffers


@cache
def cupy_module():
    """CuPy, imported where a call first needs it (import fuser does not)."""
    import cupy

    return cupy


def is_torch(x) -> bool:
    """Whether `x` is a torch tensor (else a CuPy array, by the executor's checks)."""
    return type(x).__module__.startswith("torch")


@cache
def torch_module():
    """torch, imported where a call first needs it."""
    import torch

    return torch


@dataclass
class Run:
    """What the latest execute() did: the kernel and how it was launched."""

    kernel: Kernel
    launch: Launch
    finalize_launch: Launch | None


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
    # the row kernel takes a counter of fuser.tickets: it deals its row groups from it, or its
    # blocks meet at it before they finalize the columns themselves
    counted: bool
    inputs: int  # the fusion's inputs: the INPUT slot's length (a scalar's too)
    # each repeated input's `after` and `count` (signature.Source.ROW_REPEATS), from the shapes
    repeats: tuple = ()
    # FusionInfo.group_axes' groups (the product of those row axes); `rows` is then a group's
    groups: int = 1
    # owner (_owner: a stream, or the per-thread default stream and a thread) -> Workspace
    workspaces: dict = field(default_factory=dict, compare=False)
    # Held from the row kernel's launch to the finalize's, so that two threads sharing a stream
    # cannot enqueue row A, row B, finalize A (which would read B's partial rows), where the
    # workspace is the plan's own (Workspace.lock: a kept one's is its owner's)
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False)

    @cached_property
    def run(self) -> Run:
        """What fd._last_run holds after a call with this plan (one record for all such
        calls), which fd.last_schedule() and last_cuda_code() read."""
        return Run(self.kernel, self.launch, self.finalize_launch)

    @cached_property
    def launches(self) -> tuple:
        """(launcher, Launch, picker) of each kernel, in launch order: what a call walks
        through, looked up once. A call lays its values out flat, slot after slot in
        loader._SLOT_ORDER (the inputs, the outputs, the partial rows, then the rows, the
        partial row count, the counter, the groups and the repeated inputs' row maps); a
        picker takes a kernel's parameters from them in its signature's order, in one C
        call."""
        lengths = (self.inputs, len(self.outputs), len(self.partials), 1, 1, 1, 1,
                   len(self.repeats))
        starts = [sum(lengths[:slot]) for slot in range(len(lengths))]
        return tuple((self.kernel.launchers[entry], size,
                      _picker([starts[slot] + i for slot, i in arguments]))
                     for (entry, arguments), size in zip(
                         self.kernel.arguments, (self.launch, self.finalize_launch),
                         strict=False))

    @cached_property
    def array_outputs(self) -> tuple:
        """(shape, the array library's dtype) per fusion output, resolved once."""
        return tuple((shape, _array_dtype(dtype, self.torch_kind)) for shape, dtype in self.outputs)

    @cached_property
    def array_partials(self) -> tuple:
        """(shape, the array library's dtype) per partial-row buffer, resolved once."""
        return tuple((shape, _array_dtype(dtype, self.torch_kind))
                     for shape, dtype in self.partials)

    @cached_property
    def _kept_bounds(self) -> tuple[int, ...]:
        """The partial-row buffers' bounds in a kept workspace, WORKSPACE_ALIGN-aligned one
        after another: each one's start, then the last one's aligned end."""
        bounds = [0]
        for (rows, hidden), dtype in self.partials:
            bounds.append(bounds[-1] + ceil_div(rows * hidden * dtype.itemsize,
                                                WORKSPACE_ALIGN) * WORKSPACE_ALIGN)
        return tuple(bounds)

    @property
    def partial_offsets(self) -> tuple[int, ...]:
        """Where each partial-row buffer starts in a kept workspace."""
        return self._kept_bounds[:-1]

    @cached_property
    def own_workspace(self) -> bool:
        """Whether a call outside a CUDA graph's capture takes its stream's kept workspace
        (KeptWorkspace) where it has torch tensors: its buffers fit KEPT_TORCH_WORKSPACE_BYTES
        (a multiple of WORKSPACE_ALIGN, so the aligned end fits where the end does)."""
        return (self.torch_kind and bool(self.partials)
                and self._kept_bounds[-1] <= KEPT_TORCH_WORKSPACE_BYTES)

    @cached_property
    def asks_capture(self) -> bool:
        """Whether a call asks the driver if its stream is capturing a CUDA graph: where it
        counts on a counter (fuser.tickets), or takes fuser's own workspace."""
        return self.counted or self.own_workspace


@dataclass(frozen=True)
class Workspace:
    """A call's partial-row buffers: what holds their memory (arrays or tensors; nothing for
    a kept workspace's), their device addresses in Plan.partials' order, and the lock a call
    holds from its first launch to its last."""

    buffers: tuple
    addresses: list
    lock: threading.Lock


@dataclass(frozen=True)
class KeptWorkspace:
    """KEPT_TORCH_WORKSPACE_BYTES of fuser's own device memory for the calls of one owner
    (a stream, or the per-thread default stream of one thread) whose workspace fits, every
    plan's, and the lock each of those calls holds from its first launch to its last, so that
    no other call's launches come between them. Never freed: freeing would synchronize the
    device (from whichever thread collected it), and one buffer per stream stays small."""

    address: int
    lock: threading.Lock


_kept: dict = {}  # (device id, owner) -> KeptWorkspace
_kept_lock = threading.Lock()


def _kept_workspace(device_id: int, owner) -> KeptWorkspace | None:
    """The owner's kept workspace on the device (the current context's), allocated at its
    first call; None where the driver cannot allocate it, and the call then takes torch's: the
    device's memory is taken, or another thread is capturing a CUDA graph in global mode
    (torch's default), whose capture the attempt invalidates as any cudaMalloc's would, and
    as fuser.tickets' first counter buffer does: call a fusion once on each stream before
    capturing on another."""
    found = _kept.get((device_id, owner))
    if found is None:
        with _kept_lock:
            found = _kept.get((device_id, owner))
            if found is None:
                try:
                    address = driver().device_memory(KEPT_TORCH_WORKSPACE_BYTES)
                except DriverError:
                    return None
                found = _kept[(device_id, owner)] = KeptWorkspace(address, threading.Lock())
    return found


def _picker(positions: list[int]) -> Callable[[list], tuple]:
    """The values at `positions`, as a tuple (itemgetter returns a lone value bare)."""
    if len(positions) == 1:
        (position,) = positions
        return lambda values: (values[position],)
    return operator.itemgetter(*positions)


_TORCH, _CUPY, _OTHER = range(3)
_KINDS: dict[type, int] = {}  # the kind of each input type seen, classified once


def _kind(cls: type) -> int:
    """Whether an input type is torch's, CuPy's or another (a scalar's), remembered."""
    module = cls.__module__
    kind = _KINDS[cls] = (_TORCH if module.startswith("torch") else
                          _CUPY if module.startswith("cupy") else _OTHER)
    return kind


def signature(inputs) -> tuple:
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


def input_pointers(plan: Plan, inputs: list) -> list:
    """Per input, its data pointer where the kernels read it as one (else None): the INPUT
    slot of the call's arguments, which the scalar inputs' values fill in."""
    pointers: list = [None] * len(inputs)
    if plan.torch_kind:
        for i in plan.kernel.tensor_inputs:
            pointers[i] = inputs[i].data_ptr()
    else:
        for i in plan.kernel.tensor_inputs:
            pointers[i] = inputs[i].data.ptr
    return pointers


def _array_dtype(dtype: DataType, torch_kind: bool):
    """torch's or numpy's dtype (for CuPy) of `dtype`, resolved when a plan is made."""
    return getattr(torch_module(), dtype.numpy.name) if torch_kind else dtype.numpy


def _arrays(specs: tuple, torch_kind: bool, like) -> list:
    """An uninitialized array per (shape, array dtype) of `specs`: torch's on `like`'s device
    (like.new_empty: 1 us less host time a tensor than torch.empty(device=like.device)), else
    CuPy's on its current device (the allocator looked up once)."""
    if torch_kind:
        return [like.new_empty(shape, dtype=dtype) for shape, dtype in specs]
    empty = cupy_module().empty
    return [empty(shape, dtype=dtype) for shape, dtype in specs]


def stream_of(torch_kind: bool, device_id: int) -> int:
    """The stream to launch on, as a handle: torch's current stream for torch tensors, else
    CuPy's."""
    if not torch_kind:
        return cupy_module().cuda.get_current_stream(device_id).ptr
    return _torch_stream()(device_id)


@cache
def _torch_stream() -> Callable[[int], int]:
    """torch's current stream of a device, as a handle: its raw-stream getter (what
    torch.compile's kernels call) skips building a Stream object; the public call is the
    fallback."""
    torch = torch_module()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device_id: torch.cuda.current_stream(device_id).cuda_stream


def _partials(plan: Plan, owner, like, capturing: bool) -> Workspace:
    """The column-sum workspace of one call on a stream of `owner` (_owner). The partial rows are
    written and read only by this call's kernels, in stream order (the workspace's lock keeps
    another call's launches from coming between them), so one workspace per stream serves every
    call; the per-thread default stream has one handle for a different stream in every thread,
    so its workspaces are per thread. With CuPy arrays it is CuPy's memory, the plan's. With
    torch tensors it is the owner's KeptWorkspace where it fits and the stream is not capturing
    a CUDA graph; otherwise a new one from torch's caching allocator every call: torch then sees
    the memory and orders its reuse on the stream, and a CUDA graph (torch.cuda.graph, or
    torch.compile's CUDA graph trees, which also warm up in their own pool and refuse
    allocations there that no output holds) gets its own, so no capture holds fuser's."""
    if plan.torch_kind and (capturing or not plan.own_workspace):
        return _workspace(plan, like)
    partials = plan.workspaces.get(owner)
    if partials is None:
        if plan.torch_kind:
            kept = _kept_workspace(plan.device_id, owner)
            if kept is None:
                return _workspace(plan, like)
            partials = Workspace((), [kept.address + at for at in plan.partial_offsets],
                                 kept.lock)
        else:
            partials = _workspace(plan, like)
        plan.workspaces[owner] = partials
    return partials


def _owner(stream: int):
    """Who a stream's buffers belong to: the stream, or for the per-thread default stream
    (one handle for a different stream in every thread) the stream and the thread."""
    return (stream, threading.get_ident()) if stream == PER_THREAD_STREAM else stream


def run(plan: Plan, inputs: list, pointers: list) -> list:
    """Allocate the outputs and launch, with the plan's device current: as it mostly is
    already (one driver call says so), else made current for the call (and for CuPy arrays
    through CuPy, which allocates on the runtime's current device). Another context of the
    same device is refused: the caller's stream would be that context's.

    A thread with no context current whose runtime device is 0 (as the array library reports
    it) gets device 0's primary context bound and left bound: the CUDA runtime binds that
    context at the thread's next call that needs one, so nothing else changes.
    autograd's device thread for device 0 is such a thread (torch skips cudaSetDevice where
    the device is 0 already), and every backward of fuser.torch runs there: bound for each
    call and unbound after it, each call paid two context switches, and the runtime bound it
    again at the next torch op."""
    gpu = driver()
    if gpu.current_context() == plan.context:
        return _enqueue(plan, inputs, pointers)
    return in_context(plan.device_id, plan.context, plan.torch_kind,
                      lambda: _enqueue(plan, inputs, pointers))


def in_context(device_id: int, context: int, torch_kind: bool, call: Callable[[], T]) -> T:
    """call() with device `device_id`'s primary context (`context`) current: run()'s rules,
    for any launch (the permute kernels' too)."""
    gpu = driver()
    current = gpu.current_context()
    if current == context:
        return call()
    if not current and device_id == 0 and _runtime_device(torch_kind) == 0:
        gpu.bind_primary(0)
        return call()
    if current and gpu.current_device() == device_id:
        raise LaunchError(
            f"the current CUDA context ({current:#x}) of device {device_id} is not its "
            f"primary context ({context:#x}), the one torch and CuPy run in and fuser "
            "loads its kernels into: the stream a launch would go to belongs to another "
            "context. Make the primary context current (torch.cuda.set_device, "
            "cupy.cuda.Device, or cuDevicePrimaryCtxRetain and cuCtxSetCurrent)")
    with contextlib.ExitStack() as stack:
        if not torch_kind:
            stack.enter_context(cupy_module().cuda.Device(device_id))
        stack.enter_context(gpu.on_device(device_id))
        return call()


def in_primary_context(device_id: int, torch_kind: bool, call: Callable[[], T]) -> T:
    """call() with device `device_id`'s primary context current (in_context), for a launch
    of a kernel outside a plan (the rescale kernel of fuser.torch's cross entropy)."""
    return in_context(device_id, driver().primary_context(device_id), torch_kind, call)


def _runtime_device(torch_kind: bool) -> int:
    """The CUDA runtime's current device of this thread, as torch or CuPy reads it."""
    if torch_kind:
        return torch_module().cuda.current_device()
    return cupy_module().cuda.runtime.getDevice()


def _enqueue(plan: Plan, inputs: list, pointers: list) -> list:
    torch_kind = plan.torch_kind
    like = inputs[plan.kernel.tensor_inputs[0]]
    outs = _arrays(plan.array_outputs, torch_kind, like)
    stream = stream_of(torch_kind, plan.device_id)
    capturing = plan.asks_capture and driver().stream_capturing(stream)
    owner = _owner(stream)
    partials = _partials(plan, owner, like, capturing) if plan.partials else None
    for i, (v, t) in plan.scalar_types.items():
        pointers[i] = t(scalar_value(i, v, inputs[i]))
    addresses = [o.data_ptr() for o in outs] if torch_kind else [o.data.ptr for o in outs]
    if partials is not None:
        addresses += partials.addresses
    tickets = (ticket_counters(plan.device_id).counter(owner, stream, capturing)
               if plan.counted else 0)
    # in loader._SLOT_ORDER, flat (Plan.launches)
    values = pointers + addresses + [plan.rows, plan.launch.partial_rows, tickets, plan.groups,
                                     *plan.repeats]
    with plan.lock if partials is None else partials.lock:
        for launcher, size, pick in plan.launches:
            launcher(size.grid, size.block, size.dynamic_smem, stream, pick(values), size.groups)
    return outs


def _workspace(plan: Plan, like) -> Workspace:
    """Partial-row buffers from the array library. A device out of memory for them is named
    with their size (torch's and CuPy's own errors would not say what the memory was for)."""
    try:
        arrays = _arrays(plan.array_partials, plan.torch_kind, like)
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
    addresses = [a.data_ptr() for a in arrays] if plan.torch_kind else [a.data.ptr for a in arrays]
    return Workspace(tuple(arrays), addresses, plan.lock)
