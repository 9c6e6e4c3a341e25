"""Run a fusion: check inputs, plan the call (loader.py builds and loads its kernels), run it
(calls.py, which every later call with the same input signature goes straight to), or run its
segments where no one kernel chain can.

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

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from fuser import calls, moves
from fuser.analysis import FusionInfo, Kind, Role, analyze, strided_inputs
from fuser.calls import Plan, Run, is_torch
from fuser.calls import cupy_module as _cupy
from fuser.checks import alignment, check_device, check_pointer, scalar_value
from fuser.device import DeviceSpec
from fuser.driver import driver
from fuser.dtypes import DataType
from fuser.errors import BadInputError, FuserError, OutOfResourcesError, UnsupportedFusionError
from fuser.ir import Scalar, Tensor, as_tensor
from fuser.loader import get_kernel, launch_sizes
from fuser.moves import Move, make_layouts
from fuser.schedulers import Hints, Problem
from fuser.schedulers.base import Dealing, RowSchedule, problem_groups, problem_rows
from fuser.segment import Segment, Segmentation, segment
from fuser.shapes import Sizes, bind_shapes
from fuser.signature import workspace_dtype

T = TypeVar("T")


@dataclass(frozen=True)
class SegmentedRun:
    """What the latest execute() of a segmented fusion did: each segment's Run (a
    SegmentedRun of its own for a segment that runs as segments), in order, and the permute
    kernels that ran between them."""

    segmentation: Segmentation
    runs: tuple[Run | SegmentedRun, ...]
    moves: tuple[Move, ...] = ()

    def all_moves(self) -> tuple[Move, ...]:
        """The permute kernels that ran between kernels, this call's then its nested
        segmentations'."""
        found = list(self.moves)
        for r in self.runs:
            if isinstance(r, SegmentedRun):
                found += r.all_moves()
        return tuple(found)

    def leaves(self) -> tuple[tuple[Segment, Run], ...]:
        """Each kernel chain that ran and the segment it ran for, in order, nested
        segmentations flattened."""
        return tuple(pair for s, r in zip(self.segmentation.segments, self.runs, strict=True)
                     for pair in (r.leaves() if isinstance(r, SegmentedRun) else ((s, r),)))


def _info(fd) -> tuple[FusionInfo, str]:
    """FusionInfo and signature (its Python definition) of `fd`, recomputed only when the
    definition grew since the last call."""
    stamp = (len(fd.fusion.vals), len(fd.fusion.outputs))
    cached = getattr(fd, "_info_cache", None)
    if cached is None or cached[0] != stamp:
        fd._info_cache = (stamp, analyze(fd.fusion), fd.fusion.python_definition())
    return fd._info_cache[1], fd._info_cache[2]


# ----- inputs -----


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _describe(x) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


def _check_tensor(i: int, t: Tensor, x, torch_kind: bool):
    """(dtype, shape, pointer, device id) of input `x`, after checking its kind and layout."""
    where = f"input {i} ({t.name})"
    if torch_kind:
        if not is_torch(x):
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


MAX_PLANS = 64  # plans kept per fusion definition (distinct shapes seen recently)


def _checked_inputs(fusion, inputs: list) -> tuple[bool, list]:
    """Whether the tensors are torch's, and per input _check_tensor's (shape, pointer, device)
    (None for a scalar input, whose value is checked)."""
    tensors = [x for v, x in zip(fusion.inputs, inputs, strict=True) if isinstance(v, Tensor)]
    torch_kind = bool(tensors) and is_torch(tensors[0])
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
    info, definition = _info(fd)
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
    groups, rows = info.group_rows(sizes)  # rows: a group's, with groups
    hidden = sizes.value(info.hidden_axis) if info.hidden_axis is not None else 1
    device_id = devices.pop() if devices else driver().current_device()
    align = alignment(pointers + group_offsets(info, rows, hidden))
    actual = DeviceSpec.from_gpu(device_id)
    spec = actual if device is None else DeviceSpec.get(device)
    if device is not None:
        check_device(spec, actual, device_id)
    problem = Problem(hidden, problem_rows(info, rows, groups), align,
                      problem_groups(info, groups))
    kernel = get_kernel(fd.name, info, definition, problem, spec, device_id, hints)
    launch, final = launch_sizes(kernel, rows, spec, groups)
    partials = () if kernel.finalize is None else tuple(
        ((max(launch.partial_rows, 1) * groups, hidden), workspace_dtype(e.outputs[0].dtype))
        for e in info.outer_reductions)
    scalar_types = {i: (v, v.dtype.scalar_numpy.type) for i, v in enumerate(fusion.inputs)
                    if isinstance(v, Scalar)}
    counted = ((isinstance(kernel.schedule, RowSchedule)
               and kernel.schedule.dealing is Dealing.DYNAMIC)
               or (kernel.finalize is not None and kernel.finalize.fused))
    return Plan(kernel, launch, final, torch_kind, device_id, driver().primary_context(device_id),
                align, rows, tuple((sizes.shape(o), o.dtype) for o in fusion.outputs), partials,
                scalar_types, counted, len(fusion.inputs), repeated_rows(info, sizes), groups)


def group_offsets(info: FusionInfo, rows: int, hidden: int) -> list[int]:
    """The bytes from one group's part to the next's (FusionInfo.group_part; `rows` a
    group's) of each tensor a kernel reads or writes in vectors: those of every row and the
    column inputs per group. A kernel of a fusion with groups moves its pointers by them, so
    its vectors need them aligned as the pointers themselves."""
    sizes = {"rows": rows, "hidden": hidden}
    return [math.prod(sizes[a] for a in part) * t.dtype.itemsize
            for t in (*info.full_inputs, *info.outputs(Role.FULL), *info.group_columns)
            if (part := info.group_part(t)) is not None]


def repeated_rows(info, sizes) -> tuple[int, ...]:
    """`after` and `count` of each repeated input (analysis.RowRun), flat: the products of
    the row axes' sizes past its run and in it (at least 1: a kernel divides by them, and
    with no rows reads none)."""
    values: list[int] = []
    row_sizes = [sizes.value(a) for a in info.row_axes]
    for _, run in info.repeated:
        values += [max(math.prod(row_sizes[run.stop:]), 1),
                   max(math.prod(row_sizes[run.first:run.stop]), 1)]
    return tuple(values)


def execute(fd, inputs: list, *, device=None, hints: Hints | None = None):
    inputs = _contiguous(fd, list(inputs))
    plans = fd.__dict__.setdefault("_plans", {})
    try:
        key = (calls.signature(inputs), device, hints)
        plan = plans.get(key)
    except TypeError:  # an unhashable input: the full checks will name it
        key, plan = None, None
    if plan is None:
        # A fusion one kernel chain runs has plans (a cached one skips this question); so has
        # an outer normalization that runs its segments at these shapes (columns_too_tall).
        segmentation = segments_of(fd)
        if segmentation is not None:
            return _execute_segments(fd, segmentation, inputs, device, hints, key)
        plan = planned(fd, lambda: _plan(fd, inputs, device, hints))
        if key is not None:
            _remember(plans, key, plan)
    if isinstance(plan, Segmentation):
        return _execute_segments(fd, plan, inputs, device, hints, key)
    pointers = calls.input_pointers(plan, inputs)
    align = plan.align
    for i in plan.kernel.vector_inputs:  # the pointers loaded in vectors
        if pointers[i] % align:
            # Same shapes, but an input starts at an address the cached kernel cannot load
            # with its vector width (a view at an offset): plan this call on its own.
            plan = planned(fd, lambda: _plan(fd, inputs, device, hints))
            if isinstance(plan, Segmentation):
                return _execute_segments(fd, plan, inputs, device, hints)
            pointers = calls.input_pointers(plan, inputs)
            break
    outputs = calls.run(plan, inputs, pointers)
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
        if is_torch(x):
            if not x.is_contiguous():
                inputs[i] = _permuted_view_copy(x) if x.is_cuda else x.contiguous()
        elif _is_cupy(x) and not x.flags.c_contiguous:
            with x.device:  # the copy on the array's own GPU, not the current one
                inputs[i] = _permuted_view_copy(x)
    return inputs


def _permuted_view_copy(x):
    """A contiguous copy of the strided array `x`: by fuser's permute kernel where `x` is a
    permuted view of contiguous memory (a transposed matrix, [B, H, S, D] viewed as [B, S, H,
    D]; torch's and CuPy's copies of those ran at 0.15-0.5 of a device copy on the H200,
    bench/results/2026-12-03-permute.json), else by the array library (a column slice, a
    view with gaps or flipped axes)."""
    torch_kind = is_torch(x)
    strides = x.stride() if torch_kind else x.strides
    order = sorted(range(x.ndim), key=lambda d: (x.shape[d] > 1, -strides[d], d))
    moved = x.permute(order) if torch_kind else x.transpose(order)
    if moved.is_contiguous() if torch_kind else moved.flags.c_contiguous:
        return moves.permuted(moved, tuple(order.index(d) for d in range(x.ndim)))
    return x.contiguous() if torch_kind else _cupy().ascontiguousarray(x)


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


def _execute_segments(fd, segmentation: Segmentation, inputs: list, device, hints,
                      key=None) -> list:
    """Run the segments in order, each on the fusion's inputs and earlier segments' outputs,
    the layout ops made between them. Every input is checked first (kind, device, dtype, rank
    and sizes against the whole fusion): a layout op may touch it before any segment does.
    `key`: the call's plan key (calls.signature), under which the checked sizes are kept, and
    the steps the first call took (moves.layout_step, _segment_step), which later calls with that
    key walk (_segment_call)."""
    lowered = segmentation.lowered
    if hints is not None:
        raise segmentation.hint_error(fd.name)
    if len(inputs) != len(lowered.inputs):
        raise BadInputError(
            f"fusion '{fd.name}' takes {len(lowered.inputs)} inputs, got {len(inputs)}")
    sizes, program = _segment_call(fd, lowered, inputs, key)
    values = dict(zip(lowered.inputs, inputs, strict=True))
    runs: list[Run | SegmentedRun] = []
    moves: list[Move] = []
    if program is not None:
        for step in program:
            done = step(values)
            if isinstance(done, Move):
                moves.append(done)
            elif done is not None:
                runs.append(done)
        fd._last_run = SegmentedRun(segmentation, tuple(runs), tuple(moves))
        return _unshared(lowered, values)
    steps: list = make_layouts(segmentation.layouts, values, sizes, moves)
    for s in segmentation.segments:
        arguments = s.arguments(values, sizes)
        outs = execute(s.definition, arguments, device=device)
        values.update(zip(s.outputs, outs, strict=True))
        run = s.definition._last_run
        assert isinstance(run, Run | SegmentedRun)
        runs.append(run)
        steps.append(_segment_step(s, arguments, values, device))
        steps += make_layouts(segmentation.layouts, values, sizes, moves)
    fd._last_run = SegmentedRun(segmentation, tuple(runs), tuple(moves))
    if key is not None and None not in steps:
        _remember(fd._segment_calls, (key, lowered), (sizes, tuple(steps)))
    return _unshared(lowered, values)


def _segment_step(s, arguments: list, values: dict, device
                  ) -> Callable[[dict], Run | SegmentedRun] | None:
    """Segment `s` as a step of a later call with the same signature: its arguments from the
    values (or, for the sizes it takes as scalars, the ones this call passed), its kernels
    launched with the plan this call made for them (calls.run: no signature, no plan lookup,
    no execute() per segment), through execute() where an input sits at an address the plan's
    vectors cannot load. Where `s` ran as segments of its own (no one plan), through
    execute(), which walks the steps its own first call recorded. None where it did neither."""
    plan = s.definition.__dict__.get("_plans", {}).get(
        (calls.signature(arguments), device, None))
    inputs, outputs = s.inputs, s.outputs
    given = {i: a for i, (v, a) in enumerate(zip(inputs, arguments, strict=True))
             if v not in values}  # the sizes it takes as scalars, fixed by the signature

    def arguments_from(values: dict) -> list:
        return [values[v] if i not in given else given[i] for i, v in enumerate(inputs)]

    if not isinstance(plan, Plan):
        if not isinstance(s.definition._last_run, SegmentedRun):
            return None

        def nested(values: dict) -> SegmentedRun:
            outs = execute(s.definition, arguments_from(values), device=device)
            values.update(zip(outputs, outs, strict=True))
            return s.definition._last_run

        return nested
    vector_inputs, align = plan.kernel.vector_inputs, plan.align

    def step(values: dict) -> Run:
        args = arguments_from(values)
        pointers = calls.input_pointers(plan, args)
        if any(pointers[i] % align for i in vector_inputs):
            outs = execute(s.definition, args, device=device)
            run = s.definition._last_run
        else:
            outs, run = calls.run(plan, args, pointers), plan.run
        values.update(zip(outputs, outs, strict=True))
        return run

    return step


def _segment_call(fd, lowered, inputs: list, key) -> tuple[Sizes, tuple | None]:
    """The sizes of `lowered`'s extents for `inputs`, after the checks of every input, and
    the steps an earlier call with this key recorded (None before one has): both kept per
    plan key (each input's kind, dtype, shape, contiguity and device, all that the tensor
    checks and the binding read; a third of a segmented call's host time was the binding).
    A scalar input's value, which the key leaves out, is checked every call."""
    cache = fd.__dict__.setdefault("_segment_calls", {})
    found = cache.get((key, lowered)) if key is not None else None
    if found is not None:
        for i, v in enumerate(lowered.inputs):
            if isinstance(v, Scalar):
                scalar_value(i, v, inputs[i])
        return found
    sizes = bind_shapes(lowered, [c[0] if c is not None else None
                                  for c in _checked_inputs(lowered, inputs)[1]])
    if key is not None:
        _remember(cache, (key, lowered), (sizes, None))
    return sizes, None


def _remember(cache: dict, key, value) -> None:
    """`value` under `key`, the oldest entry dropped where a new key would pass
    MAX_PLANS."""
    if key not in cache and len(cache) >= MAX_PLANS:
        cache.pop(next(iter(cache)))
    cache[key] = value


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
    return x.clone() if is_torch(x) else x.copy()


# ----- validate -----


def to_host(x) -> np.ndarray:
    if is_torch(x):
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
