"""The layout ops a segmented call makes between its kernels: permutes as contiguous copies by
fuser's permute kernel (fuser/permute.py), reshapes as views, expands as broadcast copies.

Each is a step (layout_step) that a later call with the same input signature walks again
(executor._execute_segments). A permute step keeps the kernel its first copy planned and
loaded, so a later copy of an operand of that shape is an allocation and a launch: no plan
lookup, no kernel lookup, no shape arithmetic (about half of an NCHW BatchNorm call's host
time was its two permutes' lookups)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fuser import calls, permute
from fuser.calls import cupy_module, is_torch
from fuser.checks import alignment, check_element_aligned
from fuser.driver import driver
from fuser.ir import as_tensor
from fuser.layouts import describe


@dataclass(frozen=True)
class Move:
    """A permute between a segmented call's kernels: the layout op (layouts.describe) and
    the permute kernel that made it."""

    what: str
    kernel: permute.PermuteKernel


def make_layouts(layouts, values: dict, sizes, moves: list) -> list[Callable]:
    """Each permute, reshape or expand whose operand is in `values` and result is not yet,
    made (layout_step), each permute's Move appended to `moves`; the steps that made them,
    in order."""
    made = []
    for e in layouts:
        if e.outputs[0] not in values and e.inputs[0] in values:
            step = layout_step(e, sizes)
            move = step(values)
            if move is not None:
                moves.append(move)
            made.append(step)
    return made


def layout_step(e, sizes) -> Callable[[dict], Move | None]:
    """Layout op `e` as a step: permute as a copy in the new order, always new memory (the
    next kernels read contiguous rows; the step returns its Move), reshape as a view of the
    shape bind_shapes gave its result, expand as a contiguous copy of the operand broadcast
    to its result's shape."""
    out, x = e.outputs[0], e.inputs[0]
    if e.op == "reshape":
        shape = sizes.shape(as_tensor(out))

        def reshaped(values: dict) -> None:
            values[out] = values[x].reshape(shape)

        return reshaped
    if e.op == "expand":
        dims, shape = e.attr("broadcast_dims"), sizes.shape(as_tensor(out))

        def expand(values: dict) -> None:
            values[out] = expanded(values[x], dims, shape)

        return expand
    return PermuteStep(e)


class PermuteStep:
    """A permute as a step. Its first call (and any whose operand does not fit) copies
    through permuted_launch; it then keeps the operand's shape, the kernel and its Move, and
    a later call whose operand is contiguous, of that shape and at an address the kernel's
    words can load allocates the result and launches that kernel. An operand too misaligned
    for those words is planned on its own each time, and the wider kernel stays kept."""

    def __init__(self, e):
        self.out, self.x, self.order, self.what = e.outputs[0], e.inputs[0], tuple(
            e.attr("dims")), describe(e)
        self.moves: dict[permute.PermuteKernel, Move] = {}  # one record per kernel run
        self.kept: _Kept | None = None

    def __call__(self, values: dict) -> Move | None:
        x, kept = values[self.x], self.kept
        if kept is not None and kept.torch_kind == is_torch(x) and tuple(x.shape) == kept.shape:
            source = _contiguous_pointer(x, kept.torch_kind)
            if source is not None and source % kept.word == 0:
                values[self.out] = _launch_kept(x, source, kept)
                return None if kept.kernel is None else self.moves[kept.kernel]
        values[self.out], kernel = permuted_launch(x, self.order)
        word = 1 if kernel is None else kernel.plan.vector * kernel.plan.itemsize
        if kept is None or word >= kept.word:  # an operand off the kept words: this call only
            self.kept = _Kept(tuple(x.shape), is_torch(x), kernel, word,
                              tuple(x.shape[d] for d in self.order))
        if kernel is None:  # nothing to copy
            return None
        return self.moves.setdefault(kernel, Move(self.what, kernel))


@dataclass(frozen=True)
class _Kept:
    """What a PermuteStep's copy planned: the operand's shape and kind, the kernel (None for
    no elements), the bytes of its words (the alignment its loads need) and the result's
    shape."""

    shape: tuple[int, ...]
    torch_kind: bool
    kernel: permute.PermuteKernel | None
    word: int
    result: tuple[int, ...]


def _contiguous_pointer(x, torch_kind: bool) -> int | None:
    """`x`'s address where it is contiguous, else None."""
    if torch_kind:
        return x.data_ptr() if x.is_contiguous() else None
    return x.data.ptr if x.flags.c_contiguous else None


def _launch_kept(x, source: int, kept: _Kept):
    """The copy of `x` (at `source`) by the kernel a PermuteStep kept."""
    torch_kind, kernel = kept.torch_kind, kept.kernel
    if torch_kind:
        out = x.new_empty(kept.result)
        destination = out.data_ptr()
    else:
        with x.device:
            out = cupy_module().empty(kept.result, dtype=x.dtype)
        destination = out.data.ptr
    if kernel is None:
        return out
    device_id = x.get_device() if torch_kind else x.data.device_id
    stream = calls.stream_of(torch_kind, device_id)
    gpu = driver()
    context = gpu.primary_context(device_id)
    if gpu.current_context() == context:
        permute.launch(kernel, source, destination, stream)
    else:
        calls.in_context(device_id, context, torch_kind,
                         lambda: permute.launch(kernel, source, destination, stream))
    return out


def permuted(x, dims: tuple[int, ...]):
    """A contiguous copy of `x` in the order `dims`, new memory on `x`'s device, made by
    fuser's permute kernel (fuser/permute.py) on the array library's current stream."""
    return permuted_launch(x, dims)[0]


def permuted_launch(x, dims: tuple[int, ...]) -> tuple:
    """permuted's copy and the permute kernel that made it (None where it has no
    elements)."""
    torch_kind = is_torch(x)
    if torch_kind:
        x = x if x.is_contiguous() else x.contiguous()
        source, device_id, itemsize = x.data_ptr(), x.get_device(), x.element_size()
    else:
        with x.device:
            x = cupy_module().ascontiguousarray(x)
        source, device_id, itemsize = x.data.ptr, x.data.device_id, x.itemsize
    check_element_aligned(itemsize, source,
                          lambda: f"an array to permute (shape {tuple(x.shape)})")
    if torch_kind:
        out = x.new_empty([x.shape[d] for d in dims])
        destination = out.data_ptr()
    else:
        with x.device:
            out = cupy_module().empty([x.shape[d] for d in dims], dtype=x.dtype)
        destination = out.data.ptr
    if (out.numel() if torch_kind else out.size) == 0:
        return out, None
    plan = permute.plan(tuple(int(s) for s in x.shape), dims, itemsize, alignment([source]))
    kernel = permute.kernel(plan, device_id)
    calls.in_context(device_id, driver().primary_context(device_id), torch_kind,
                     lambda: permute.launch(kernel, source, destination,
                                            calls.stream_of(torch_kind, device_id)))
    return out, kernel


def expanded(x, broadcast_dims, shape):
    """`x` broadcast to `shape` (axis i of `x` at axis broadcast_dims[i]), as a new contiguous
    array on `x`'s device."""
    staged = [1] * len(shape)
    for i, d in enumerate(broadcast_dims):
        staged[d] = x.shape[i]
    if is_torch(x):
        return x.reshape(staged).expand(*shape).contiguous()
    with x.device:
        return cupy_module().ascontiguousarray(cupy_module().broadcast_to(x.reshape(staged),
                                                                         shape))
