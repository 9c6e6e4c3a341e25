"""Random fusions for the fuzzers, drawn by Hypothesis, built with the public frontend.

A draw is a `Plan`: the fusion's inputs (tensors of shape [-1, -1], [-1] and [-1, 1] in every
dtype, scalar inputs), a list of steps over the values defined so far (every elementwise op of
fuser.ops.ELEMENTWISE with tensors, scalar inputs, sizes and constants as operands, in Python
operator form too, the ternary ones (clamp, softplus) with any operands; casts to every dtype;
broadcast_in_dim; a full tensor transposed twice, or flattened and reshaped back (permute and
reshape, which run between kernels); every reduction of fuser.ops.REDUCTIONS (sum, max, min)
over dims [1] (inner), [0] (outer) or both, with keepdim and a result dtype; var_mean and var
with a correction; softmax's shape with a costly op, f(x - max) / sum(f(x - max))) and the
outputs. Operands are picked by position
counting back from the latest value, so the plan stays valid while Hypothesis shrinks it: a
failing draw shrinks to a short chain, printed as `repr(fd)`, the Python that rebuilds the
fusion.

Two consumers:

- `check_cpu(case)` / `check_fusion(fd, problem, device, nvrtc)`: repr(fd) rebuilds the fusion
  -> analyze -> schedulers.candidates (the first schedule) -> its geometry and shared-memory
  plans against the device -> render -> (for a sample) NVRTC. Returns the outcome's name
  ("rendered [scheduler]", "compiled [scheduler]", "compiled, first schedule spills
  [scheduler]", or the FuserError that ended it and the stage); raises a `CaseFailure` (the
  failure class, NVRTC's error and the generated line, the repro) on a crash (an exception
  that is not a FuserError, or an InternalError), a kernel that does not compile, a plan
  violation, or a repr that does not rebuild the fusion. `known_failure()` names the
  strict-xfail regression test of a failure class already filed, so a long run counts those
  instead of stopping at the first of them (FUSER_FUZZ_STRICT=1 stops anyway).
- tests/test_gpu_fuzz.py: a plan built tame (`tame=True`: log(|x| + 1), a / (|b| + 1),
  exp(min(x, 8)), ... keep every value finite) on `gpu_inputs()`, through fd.validate().

`make fuzz` runs the sharded CPU fuzz in tests/test_fuzz.py at scale; each shard writes its
counts to $FUSER_FUZZ_REPORT and `python tests/fuzz_fusions.py summary DIR` adds them up.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from fuser import DataType, FusionDefinition
from fuser.analysis import Kind, analyze
from fuser.codegen import template_dir
from fuser.compile import compile_cuda
from fuser.device import PRESETS, DeviceSpec
from fuser.errors import CompileError, FuserError, InternalError, UnsupportedFusionError
from fuser.ir import Extent, Scalar, Tensor, Val
from fuser.kernels import _render
from fuser.ops import ELEMENTWISE, REDUCTIONS
from fuser.schedulers import Problem, candidates
from fuser.schedulers.base import OuterSchedule, PointwiseSchedule, RowSchedule
from fuser.schedulers.finalize import finalize_schedule, needs_finalize
from fuser.segment import Segmentation, segment
from fuser.smem import ALIGNMENT, STATIC_SLOT, SmemPlan

# Earlier entries are where Hypothesis shrinks to.
DTYPES = (DataType.Float, DataType.Half, DataType.BFloat16, DataType.Double, DataType.Int32,
          DataType.Int64, DataType.Bool)
UNARY = tuple(sorted(n for n, op in ELEMENTWISE.items() if op.arity == 1))
BINARY = tuple(sorted(n for n, op in ELEMENTWISE.items() if op.arity == 2))
TERNARY = tuple(sorted(n for n, op in ELEMENTWISE.items() if op.arity == 3 and n != "where"))
BINARY_FIRST = ("add", *(n for n in BINARY if n != "add"))
REDUCE_OPS = tuple(REDUCTIONS)  # sum, max, min
OPERATORS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
INPUT_KINDS = ("full", "col", "row1", "scalar")  # [-1, -1], [-1], [-1, 1], a scalar input
CONSTANTS = (1.0, 2, 0.5, -1, 0, 3, -2.5, 1e-6, 1000.0, True, False)
REDUCE_DIMS = ((1,), (0,), (-1,), (0, 1))  # inner, outer, inner, both
HIDDEN_SIZES = (1, 2, 3, 4, 7, 8, 31, 32, 100, 127, 128, 255, 1000, 1024, 2048, 3072, 4096, 4097,
                6144, 8192, 12288, 16384, 24576, 24578, 32768, 49152, 65536, 65537)
ROWS = tuple(2**k for k in range(11))  # the executor plans for min(next_pow2(rows), 1024)
ALIGNS = (16, 8, 4, 2, 1)
DEVICES = ("h200", *sorted(set(PRESETS) - {"h200"}))


# ----- plans ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A random fusion: inputs as (kind, dtype, op), steps as tuples (see `_step`), outputs as
    positions counted back from the latest value (the latest tensor is always an output).
    Every tensor input after the first meets a value defined before it through its `op` (a
    binary op) as soon as it is defined, so its sizes are the fusion's rows and hidden
    sizes, as the inputs of a real fusion's are; the first is a tensor."""

    inputs: tuple[tuple[str, DataType, str], ...]
    steps: tuple[tuple, ...]
    outputs: tuple[int, ...]


_index = st.integers(0, 15)  # a value, counted back from the latest one
_operand = st.one_of(
    st.tuples(st.just("val"), _index),
    st.tuples(st.just("const"), st.sampled_from(CONSTANTS),
              st.sampled_from((None, *DTYPES))),
    st.tuples(st.just("size"), st.sampled_from((1, 0))),
)
_step = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(UNARY), _index),
    st.tuples(st.just("binary"), st.sampled_from(BINARY), _index, _operand, st.booleans(),
              st.booleans()),
    st.tuples(st.just("where"), _index, _index, _operand),
    st.tuples(st.just("ternary"), st.sampled_from(TERNARY), _index, _operand, _operand),
    st.tuples(st.just("cast"), _index, st.sampled_from(DTYPES)),
    st.tuples(st.just("bcast"), _index),
    # layout ops that give back the same shape: the fusion is cut there (or the moves put
    # them on the inputs), so segments and the moves are drawn too
    st.tuples(st.just("moved"), _index, st.sampled_from(("transposed twice", "flattened"))),
    st.tuples(st.just("reduce"), st.sampled_from(REDUCE_OPS), _index,
              st.sampled_from(REDUCE_DIMS), st.booleans(),
              st.sampled_from((None, DataType.Float, DataType.Double, DataType.Int64))),
    # over the rows, var_mean normalizes along them (x - mean): always refused, so rarely
    st.tuples(st.just("var_mean"), _index, st.sampled_from(((1,), (-1,), (1,), (0,))),
              st.sampled_from((1, 0, 2)), st.booleans()),
    # mean: a sum over the count, of a float tensor (an int or bool one cast first)
    st.tuples(st.just("mean"), _index, st.sampled_from(REDUCE_DIMS), st.booleans()),
    # var too (its mean is subtracted from the rows: refused over the rows, as var_mean); a
    # correction at or past n gives inf (nan for equal values), as torch.var
    st.tuples(st.just("var"), _index, st.sampled_from(((1,), (-1,), (1,), (0,))),
              st.sampled_from((1, 0, 2, 1000)), st.booleans()),
    # softmax's shape with a costly op: f(x - max(x)) made by the sum's pass and needed again
    # by a later one, the values a row kernel keeps in registers (RowSchedule.kept)
    st.tuples(st.just("reused"), _index, st.sampled_from(("exp", "tanh", "sigmoid", "erf"))),
)
# Reductions are what the schedulers are about: give them a larger share of the steps.
_weighted_step = st.one_of(_step, st.tuples(st.just("reduce"), st.sampled_from(REDUCE_OPS),
                                            _index, st.sampled_from(REDUCE_DIMS[:2]),
                                            st.booleans(), st.just(None)))


@st.composite
def plans(draw, max_inputs: int = 4, max_steps: int = 10) -> Plan:
    first = draw(st.tuples(st.sampled_from(("full", "full", "col", "row1")),
                           st.sampled_from(DTYPES), st.just("add")))
    more = draw(st.lists(st.tuples(st.sampled_from(INPUT_KINDS), st.sampled_from(DTYPES),
                                   st.sampled_from(BINARY_FIRST)), max_size=max_inputs - 1))
    inputs = [first, *more]
    steps = draw(st.lists(_weighted_step, min_size=1, max_size=max_steps))
    outputs = draw(st.lists(_index, max_size=2))
    return Plan(tuple(inputs), tuple(steps), tuple(outputs))


# ----- building a plan with the frontend -----------------------------------------------------


class _Builder:
    """Applies a plan's steps to a FusionDefinition. Unless `traps`, operands are adapted
    where a plan would step into what fuser always refuses or what numpy broadcasting makes
    of it (meet()): a [rows] value (an inner reduction without keepdim) is broadcast to
    [rows, 1] before it meets a 2-D or [hidden] value, which numpy would align with the hidden
    axis (the fusion's rows and hidden sizes would become one), and a value computed from an
    outer reduction does not meet values with rows. `tame` keeps values finite."""

    def __init__(self, fd: FusionDefinition, tame: bool, traps: bool):
        self.fd, self.ops, self.tame, self.traps = fd, fd.ops, tame, traps
        self.pool: list[Val] = []
        self.rows: tuple[Tensor, int] | None = None  # a tensor and dim whose size is the rows
        self.hidden: tuple[Tensor, int] | None = None
        self.row_extents: list[Extent] = []  # each input's row extent
        self.hidden_extents: list[Extent] = []
        self._after_outer: dict[int, bool] = {}

    # -- values --

    def pick(self, i: int) -> Val:
        return self.pool[-1 - i % len(self.pool)]

    def pick_tensor(self, i: int) -> Tensor | None:
        """The i-th latest full tensor, else the i-th latest tensor, else None."""
        tensors = [v for v in self.pool if isinstance(v, Tensor)]
        full = [t for t in tensors if self.kind(t) == "full"]
        chosen = full or tensors
        return chosen[-1 - i % len(chosen)] if chosen else None

    def pick_full(self, i: int) -> Tensor | None:
        """pick_tensor(i), broadcast to [rows, hidden] where it is not and can be."""
        x = self.pick_tensor(i)
        if x is not None and self.kind(x) != "full":
            x = self._bcast_value(x) or x
        return x

    def kind(self, v: Val) -> str:
        """full [rows, hidden], row1 [rows, 1], hid1 [1, hidden], one [1, 1], col [hidden],
        row [rows], scalar0 (a 0-d tensor) or scalar."""
        if not isinstance(v, Tensor):
            return "scalar"
        if v.ndim == 2:
            return {(True, True): "full", (True, False): "row1", (False, True): "hid1",
                    (False, False): "one"}[(v.dims[0] is not None, v.dims[1] is not None)]
        if v.ndim == 1 and v.dims[0] is not None:
            root = v.dims[0].find()
            return "row" if any(root is e.find() for e in self.row_extents) and not any(
                root is e.find() for e in self.hidden_extents) else "col"
        return "scalar0"

    def size(self, axis: str) -> Scalar | None:
        where = self.rows if axis == "rows" else self.hidden
        return None if where is None else self.ops.size(where[0], where[1])

    def full_shape(self) -> list[Scalar] | None:
        if self.rows is None or self.hidden is None:
            return None
        if self.rows[0] is self.hidden[0]:
            return self.ops.shape(self.rows[0])  # fd.ops.shape of a [rows, hidden] tensor
        rows, hidden = self.size("rows"), self.size("hidden")
        assert rows is not None and hidden is not None
        return [rows, hidden]

    # -- adapters --

    def as_row1(self, v: Val, other: Val) -> Val:
        """A [rows] value meeting a 2-D or [hidden] value, as [rows, 1]."""
        if self.traps or self.kind(v) != "row" or self.kind(other) in ("scalar", "row"):
            return v
        rows = self.size("rows")
        assert rows is not None
        return self.ops.broadcast_in_dim(v, shape=[rows, 1], broadcast_dims=[0])

    def after_outer(self, v: Val) -> bool:
        """Whether `v` is computed from an outer reduction (a reduction over the rows)."""
        if id(v) not in self._after_outer:
            e = v.definition
            outer = (e is not None and e.op in (*REDUCE_OPS, "mean", "var_mean", "var")
                     and isinstance(e.inputs[0], Tensor) and e.inputs[0].ndim == 2
                     and e.inputs[0].dims[0] is not None and 0 in e.attr("dims"))
            self._after_outer[id(v)] = outer or (
                e is not None and any(self.after_outer(i) for i in e.inputs))
        return self._after_outer[id(v)]

    def meet(self, operands: list, cleared: Sequence = (1, 1)) -> list:
        """The operands of one op, adapted unless `traps`: [rows] values broadcast to
        [rows, 1] (as_row1), and values computed from an outer reduction replaced by their
        `cleared` constant where they would meet a value with rows (fuser does not normalize
        along rows, so such a fusion is always refused)."""
        if self.traps:
            return operands
        vals = [v for v in operands if isinstance(v, Val)]
        out = []
        for v in operands:
            for other in vals:
                if isinstance(v, Val) and other is not v:
                    v = self.as_row1(v, other)
            out.append(v)
        with_rows = any(self.kind(v) in ("full", "row1", "row") and not self.after_outer(v)
                        for v in out if isinstance(v, Val))
        if with_rows:
            out = [c if isinstance(v, Val) and self.after_outer(v) else v
                   for v, c in zip(out, cleared, strict=True)]
        return out

    def numeric(self, v: Val) -> Val:
        """Bool values as Float (tame plans: abs, neg and sub refuse Bool)."""
        return self.ops.cast(v, DataType.Float) if v.dtype is DataType.Bool else v

    def positive(self, v: Val) -> Val:
        """|v| + 1 (tame plans: the operand of log, rsqrt, reciprocal, a divisor)."""
        return self.ops.add(self.ops.abs(self.numeric(v)), 1.0)

    def operand(self, ref: tuple) -> Val | float | int | bool:
        if ref[0] == "val":
            return self.pick(ref[1])
        if ref[0] == "size":
            size = self.size("hidden" if ref[1] else "rows")
            return size if size is not None else 2
        _, value, dtype = ref
        if dtype is None:
            return value  # a Python number: the frontend makes it a constant scalar
        if self.tame and not dtype.is_float:
            value = int(value) if dtype is not DataType.Bool else bool(value)
        return self.fd.define_scalar(value, dtype)

    # -- steps --

    def step(self, step: tuple) -> None:
        getattr(self, "_" + step[0])(*step[1:])

    def _unary(self, name: str, a: int) -> None:
        x = self.pick(a)
        if self.tame:
            if name in ("abs", "neg"):
                x = self.numeric(x)
            elif name in ("log", "rsqrt", "reciprocal"):
                x = self.positive(x)
            elif name in ("sqrt", "log1p"):
                x = self.ops.abs(self.numeric(x))
            elif name in ("exp", "expm1"):
                x = self.ops.minimum(x, 8.0)
        if name == "neg" and not self.tame:
            self.pool.append(-x)  # Val.__neg__
            return
        self.pool.append(getattr(self.ops, name)(x))

    def _binary(self, name: str, a: int, b: tuple, swap: bool, operator: bool) -> None:
        self.combine(name, self.pick(a), self.operand(b), swap, operator)

    def combine(self, name: str, value: Val, y: Val | float | int | bool, swap: bool,
                operator: bool) -> None:
        x: Val | float | int | bool
        x, y = self.meet([value, y])
        if swap:
            x, y = y, x
        if self.tame:
            if name == "sub":
                x, y = (self.numeric(v) if isinstance(v, Val) else v for v in (x, y))
            if name == "div":
                y = self.positive(y) if isinstance(y, Val) else (abs(y) + 1)
            if name == "pow" and isinstance(x, Val):
                x, y = self.ops.abs(self.numeric(x)), 2
            elif name == "pow":
                x, y = 2, self.ops.minimum(y, 8)
        if operator and name in OPERATORS and (isinstance(x, Val) or isinstance(y, Val)):
            result = {"+": lambda p, q: p + q, "-": lambda p, q: p - q,
                      "*": lambda p, q: p * q, "/": lambda p, q: p / q}[OPERATORS[name]](x, y)
        else:
            result = getattr(self.ops, name)(x, y)
        self.pool.append(result)

    def _where(self, c: int, a: int, b: tuple) -> None:
        cond, x, y = self.pick(c), self.pick(a), self.operand(b)
        if cond.dtype is not DataType.Bool:
            cond = self.ops.gt(cond, 0)
        cond, x, y = self.meet([cond, x, y], cleared=[True, 1, 1])
        self.pool.append(self.ops.where(cond, x, y))

    def _ternary(self, name: str, a: int, b: tuple, c: tuple) -> None:
        """clamp(x, min, max) or softplus(x, beta, threshold), each operand any value."""
        x, y, z = self.meet([self.pick(a), self.operand(b), self.operand(c)], cleared=[1, 1, 1])
        if self.tame and name == "clamp" and isinstance(x, Val):
            x = self.numeric(x)  # clamp refuses Bool operands
        if self.tame and name == "softplus":  # beta away from 0 (it divides), and a threshold
            # below 88 (past it float's exp overflows to inf first, as torch's does; doc)
            y = self.positive(y) if isinstance(y, Val) else abs(y) + 1
            z = self.ops.minimum(z, 20.0) if isinstance(z, Val) else min(z, 20)
        self.pool.append(getattr(self.ops, name)(x, y, z))

    def _cast(self, a: int, dtype: DataType) -> None:
        self.pool.append(self.ops.cast(self.pick(a), dtype))

    def _bcast(self, a: int) -> None:
        self._bcast_value(self.pick(a))

    def _moved(self, a: int, how: str) -> None:
        """A full tensor through layout ops and back to its own shape (nothing else)."""
        x = self.pick_tensor(a)
        if x is None or self.kind(x) != "full":
            return
        if how == "transposed twice":
            moved = self.ops.permute(self.ops.permute(x, [1, 0]), [1, 0])
        else:
            moved = self.ops.reshape(self.ops.reshape(x, [-1]), [x.size(0), x.size(1)])
        self.pool.append(moved)

    def _bcast_value(self, x: Val) -> Tensor | None:
        """x broadcast to [rows, hidden] (and added to the pool), None where it cannot be."""
        shape = self.full_shape()
        dims = {"full": [0, 1], "row1": [0, 1], "hid1": [0, 1], "one": [0, 1], "col": [1],
                "row": [0]}.get(self.kind(x))
        if shape is None or dims is None or (not self.traps and self.after_outer(x)):
            return None  # nothing to broadcast to, or a scalar: the step does nothing
        out = self.ops.broadcast_in_dim(x, shape=shape, broadcast_dims=dims)
        self.pool.append(out)
        return out

    def _reduce(self, name: str, a: int, dims: tuple[int, ...], keepdim: bool,
                dtype: DataType | None) -> None:
        x = self.pick_full(a)
        if x is None or (self.tame and x.ndim < 2):
            return
        if self.tame and name != "sum" and x.dtype is DataType.Bool:
            x = self.ops.cast(x, DataType.Int32)
        reduce = getattr(self.ops, name)
        self.pool.append(reduce(x, dims=list(dims), keepdim=keepdim, dtype=dtype))

    def _reused(self, a: int, op: str) -> None:
        """f(x - max(x)) / sum(f(x - max(x))) along the rows' hidden axis, for a costly f."""
        x = self.pick_full(a)
        if x is None or x.ndim < 2:
            return
        if not x.dtype.is_float:
            x = self.ops.cast(x, DataType.Float)
        shifted = self.ops.sub(x, self.ops.max(x, dims=[1], keepdim=True))
        made = getattr(self.ops, op)(shifted)
        total = self.ops.sum(made, dims=[1], keepdim=True)
        self.pool.append(self.ops.div(made, self.positive(total) if self.tame else total))

    def _mean(self, a: int, dims: tuple[int, ...], keepdim: bool) -> None:
        x = self.pick_full(a)
        if x is None or (self.tame and x.ndim < 2):
            return
        if not x.dtype.is_float:
            x = self.ops.cast(x, DataType.Float)
        self.pool.append(self.ops.mean(x, dims=list(dims), keepdim=keepdim))

    def _var_mean(self, a: int, dims: tuple[int, ...], correction: int, keepdim: bool) -> None:
        self._variance("var_mean", a, dims, correction, keepdim)

    def _var(self, a: int, dims: tuple[int, ...], correction: int, keepdim: bool) -> None:
        self._variance("var", a, dims, correction, keepdim)

    def _variance(self, name: str, a: int, dims: tuple[int, ...], correction: int,
                  keepdim: bool) -> None:
        """var_mean ([var, mean]) or var of a float tensor (an int or bool one cast first)."""
        x = self.pick_full(a)
        if x is None or (self.tame and x.ndim < 2):
            return
        if not x.dtype.is_float:
            x = self.ops.cast(x, DataType.Float)
        if self.tame:
            correction = 0  # 1 divides by zero in rows of one element
        results = getattr(self.ops, name)(x, dims=list(dims), correction=correction,
                                          keepdim=keepdim)
        self.pool += list(results) if name == "var_mean" else [results]


def build(plan: Plan, tame: bool = False, traps: bool = True,
          name: str = "fuzz") -> FusionDefinition:
    """The plan as a FusionDefinition. Raises what the frontend raises (DefinitionError for
    definitions it refuses)."""
    with FusionDefinition(name) as fd:
        b = _Builder(fd, tame, traps)
        for kind, dtype, op in plan.inputs:
            if kind == "scalar":
                b.pool.append(fd.define_scalar(dtype=dtype))
                continue
            shape, contiguity = {"full": ([-1, -1], [True, True]), "col": ([-1], [True]),
                                 "row1": ([-1, 1], [True, None])}[kind]
            t = fd.define_tensor(shape=shape, contiguity=contiguity, dtype=dtype)
            partner = b.pick_tensor(0)
            b.pool.append(t)
            if kind in ("full", "row1"):
                b.rows = b.rows or (t, 0)
                b.row_extents += [e for e in t.dims[:1] if e is not None]
            if kind in ("full", "col"):
                b.hidden = b.hidden or (t, t.ndim - 1)
                b.hidden_extents += [e for e in t.dims[-1:] if e is not None]
            if partner is not None:
                b.combine(op, partner, t, swap=False, operator=False)
        for step in plan.steps:
            b.step(step)
        defined = [v for v in b.pool if isinstance(v, Tensor) and v not in fd.fusion.inputs]
        if not defined:
            first = next(v for v in b.pool if isinstance(v, Tensor))
            defined = [fd.ops.cast(first, DataType.Float)]
        outputs: list[Val] = [defined[-1]]
        for i in plan.outputs:
            v = defined[-1 - i % len(defined)]
            if all(v is not o for o in outputs):
                outputs.append(v)
        for o in outputs:
            fd.add_output(o)
    return fd


# ----- cases: a plan, a problem, a device ----------------------------------------------------


@dataclass(frozen=True)
class Case:
    plan: Plan
    tame: bool  # every value finite (the GPU fuzz's plans)
    traps: bool  # [rows] values meet 2-D ones by numpy broadcasting (rows == hidden)
    hidden: int
    rows: int
    align: int  # Problem.align_bytes: the largest power of two dividing every data pointer
    device: str  # a fuser.device.PRESETS key
    nvrtc: bool  # compile the rendered kernel too

    @property
    def spec(self) -> DeviceSpec:
        return PRESETS[self.device]

    @property
    def problem(self) -> Problem:
        return Problem(self.hidden, self.rows, self.align)


hidden_sizes = st.one_of(st.sampled_from(HIDDEN_SIZES), st.integers(1, 65537))


@st.composite
def cases(draw, nvrtc_per_mille: int = 0, max_steps: int = 10) -> Case:
    """A plan with a problem and a device, compiled where a draw from 0 to 999 is below
    `nvrtc_per_mille` (Hypothesis draws small numbers more often than that: 30 compiles about
    a third; 1000 compiles all)."""
    plan = draw(plans(max_steps=max_steps))
    tame = draw(st.booleans())
    traps = draw(st.booleans())
    hidden = draw(hidden_sizes)
    rows = draw(st.sampled_from(ROWS))
    align = draw(st.sampled_from(ALIGNS))
    device = draw(st.sampled_from(DEVICES))
    nvrtc = draw(st.integers(0, 999)) < nvrtc_per_mille
    return Case(plan, tame, traps, hidden, rows, align, device, nvrtc)


# ----- inputs for the GPU fuzz ---------------------------------------------------------------


def input_shapes(fd: FusionDefinition, rows: int, hidden: int) -> list[tuple[int, ...] | None]:
    """The shape of each tensor input (None for scalars) when the fusion's rows are `rows` and
    its hidden size `hidden`: each dimension by the axis its extent was merged with (a fusion
    whose rows and hidden became one extent gets `hidden` for both). Raises the
    UnsupportedFusionError analyze() raises for fusions off those two axes."""
    info = analyze(fd.fusion)
    shapes: list[tuple[int, ...] | None] = []
    for lowered in info.fusion.inputs:  # lower() keeps the inputs in order
        if not isinstance(lowered, Tensor):
            shapes.append(None)
            continue
        dims = []
        for e in lowered.dims:
            root = None if e is None else e.find()
            hidden_axis = info.hidden_axis.find() if info.hidden_axis is not None else None
            dims.append(1 if root is None else hidden if root is hidden_axis else rows)
        shapes.append(tuple(dims))
    return shapes


def gpu_inputs(fd: FusionDefinition, rows: int, hidden: int, seed: int) -> list:
    """Host inputs for `fd` (numpy arrays in each input's dtype, Python numbers for scalar
    inputs): floats standard normal, ints from -4 to 4, bools half true."""
    rng = np.random.default_rng(seed)
    values: list = []
    for v, shape in zip(fd.fusion.inputs, input_shapes(fd, rows, hidden), strict=True):
        if shape is None:
            values.append(True if v.dtype is DataType.Bool
                          else int(rng.integers(-3, 4)) if not v.dtype.is_float
                          else float(np.float32(rng.uniform(-2, 2))))
        elif v.dtype is DataType.Bool:
            values.append(rng.random(shape) < 0.5)
        elif not v.dtype.is_float:
            values.append(rng.integers(-4, 5, size=shape).astype(v.dtype.numpy))
        else:
            values.append(rng.standard_normal(shape).astype(np.float32).astype(v.dtype.numpy))
    return values


# ----- the CPU pipeline and its failures -----------------------------------------------------


class CaseFailure(Exception):
    """A fuzz case that fuser got wrong; `kind` is the failure class, the message ends with
    the repro (repr(fd), the problem and the device)."""

    kind = "failure"


class Crash(CaseFailure):
    """An exception that is not a FuserError escaped fuser (or an InternalError: a fuser bug
    by its own account)."""

    kind = "crash"


class NotCompiled(CaseFailure):
    """NVRTC rejected a rendered kernel."""

    kind = "compile"


class PlanViolation(CaseFailure):
    """A schedule or shared-memory plan that breaks a rule it promises to keep."""

    kind = "plan"


class ReprMismatch(CaseFailure):
    """repr(fd) does not rebuild the fusion."""

    kind = "repr"


def repro(fd: FusionDefinition | None, case: Case) -> str:
    fusion = repr(fd) if fd is not None else f"(the plan did not build)\n{case.plan}"
    return (f"--- repro ---\n{fusion}\nProblem(hidden={case.hidden}, rows={case.rows}, "
            f"align_bytes={case.align}) on DeviceSpec.get({case.device!r})\n")


def compile_error_summary(e: CompileError) -> str:
    """NVRTC's first error, the argument types it names, and the generated line it is on."""
    log = e.log.splitlines()
    at = next((i for i, line in enumerate(log) if ": error" in line), None)
    if at is None:
        return f"NVRTC: {e.log.strip()[:500]}"
    lines = [f"NVRTC: {log[at].strip()}"]
    lines += [line.strip() for line in log[at + 1:at + 3] if "argument types" in line]
    m = re.match(r"[^/\s(]+\.cu\((\d+)\): error", log[at].strip())  # the kernel, not a header
    source = e.source.splitlines()
    if m and int(m.group(1)) <= len(source):
        lines.append(f"at generated line {m.group(1)}: {source[int(m.group(1)) - 1].strip()}")
    return "\n".join(lines)


def check_plan(plan: SmemPlan, device: DeviceSpec, what: str) -> None:
    """The rules a shared-memory plan promises: within the device's per-block limit, every
    buffer 128-byte aligned and after the previous one, the static slot reserved."""
    problems = []
    if plan.limit != device.smem_per_block_optin:
        problems.append(f"limit {plan.limit} B is not the device's {device.smem_per_block_optin}")
    if plan.total > device.smem_per_block_optin:
        problems.append(f"total {plan.total} B over the device limit "
                        f"{device.smem_per_block_optin} B")
    if plan.static_slot < STATIC_SLOT:
        problems.append(f"static slot {plan.static_slot} B < {STATIC_SLOT} B")
    end = 0
    for b in plan.buffers:
        if b.offset % ALIGNMENT or b.offset < end or b.nbytes <= 0:
            problems.append(f"buffer {b.name}: offset {b.offset}, {b.nbytes} B (previous end "
                            f"{end}; offsets must be multiples of {ALIGNMENT})")
        end = b.end
    if plan.dynamic_bytes % ALIGNMENT:
        problems.append(f"dynamic bytes {plan.dynamic_bytes} not a multiple of {ALIGNMENT}")
    if problems:
        raise PlanViolation(f"{what}: " + "; ".join(problems) + f"\n{plan.table()}")


def check_schedule(s: RowSchedule | PointwiseSchedule | OuterSchedule, problem: Problem,
                   device: DeviceSpec) -> None:
    """The geometry rules schedules document: vec divides hidden (or the rows are skewed: the
    skew divides hidden and vec, a block owns each row, its vectors reach past the row's end
    at any start; or a pointwise kernel's vectors cross rows), at most 16 bytes per vector
    access, a block within the device's thread limit, a row covered, clusters only on sm_90
    (an outer kernel's: whole warps, slabs covering the columns, a block's rows the call's)."""
    problems = []
    skew = getattr(s, "skew", 0)
    if skew and (problem.hidden % skew or s.vec % skew or skew >= s.vec or s.cluster != 1
                 or s.batch * s.threads_per_row * s.vec < problem.hidden + s.vec - skew):
        problems.append(f"skew {skew} of vec {s.vec} does not fit hidden {problem.hidden}")
    if problem.hidden % s.vec and not skew and not getattr(s, "across_rows", False):
        problems.append(f"vec {s.vec} does not divide hidden {problem.hidden}")
    threads = s.threads
    if threads > device.max_threads_per_block:
        problems.append(f"{threads} threads per block over {device.max_threads_per_block}")
    if isinstance(s, RowSchedule):
        if s.cluster not in (1, 2, 4, 8) or (s.cluster > 1 and device.arch < 90):
            problems.append(f"cluster {s.cluster} on sm_{device.arch}")
        if s.batch * s.threads_per_row * s.vec * s.cluster < problem.hidden:
            problems.append(f"batch {s.batch} x {s.threads_per_row} threads x vec {s.vec} x "
                            f"cluster {s.cluster} does not cover hidden {problem.hidden}")
        if s.threads_per_row & (s.threads_per_row - 1):
            problems.append(f"threads_per_row {s.threads_per_row} is not a power of two")
    if isinstance(s, OuterSchedule):
        if s.cluster not in (1, 2, 4, 8, 16) or (s.cluster > 1 and device.arch < 90):
            problems.append(f"cluster {s.cluster} on sm_{device.arch}")
        if threads % device.warp_size or s.slab != s.col_lanes * s.vec:
            problems.append(f"{s.col_lanes} x {s.row_lanes} threads for a slab of {s.slab}")
        if s.slabs * s.slab < problem.hidden or s.rank_rows * s.cluster < problem.rows:
            problems.append(f"slabs or rows of the blocks do not cover {problem}")
    if problems:
        raise PlanViolation("schedule: " + "; ".join(problems) + f"\n{s}")


def check_cpu(case: Case) -> str:
    """Build `case`'s fusion and run it on the CPU (check_fusion); return the outcome's name
    or raise a CaseFailure."""
    try:
        fd = build(case.plan, tame=case.tame, traps=case.traps)
    except FuserError as e:
        if isinstance(e, InternalError):
            raise Crash(f"InternalError at definition: {e}\n{repro(None, case)}") from e
        return f"{type(e).__name__} (definition)"
    except Exception as e:
        raise Crash(f"{type(e).__name__} at definition: {e}\n{repro(None, case)}") from e
    return check_fusion(fd, case.problem, case.spec, case.nvrtc, repro(fd, case))


def check_fusion(fd: FusionDefinition, problem: Problem, device: DeviceSpec, nvrtc: bool,
                 where: str = "") -> str:
    """repr -> analyze -> the first candidate schedule -> its plans -> render (-> NVRTC);
    return the outcome's name ("rendered [scheduler]", "compiled [scheduler]", "compiled,
    first schedule spills [scheduler]" or the FuserError that ended it, with the stage), or
    raise a CaseFailure ending with `where` (the repro)."""
    where = where or f"--- repro ---\n{fd!r}\n{problem} on {device.name}\n"
    stage = "repr"
    try:
        again = FusionDefinition.from_python(repr(fd), fd.name)
        if again.fusion.python_definition() != fd.fusion.python_definition():
            raise ReprMismatch("repr(fd) rebuilds another fusion:\n"
                               + again.fusion.python_definition())
        stage = "analysis"
        try:
            info = analyze(fd.fusion)
        except UnsupportedFusionError as refusal:
            stage = "segmentation"
            return check_segments(segment(fd.fusion, fd.name, refusal), problem, device, nvrtc,
                                  where)
        stage = "schedule"
        try:
            sched = next(candidates(info, problem, device), None)
        except UnsupportedFusionError as refusal:
            if info.kind is not Kind.OUTER_NORM:
                raise
            stage = "segmentation"  # what the executor runs where one outer kernel cannot
            return check_segments(segment(fd.fusion, fd.name, refusal), problem, device, nvrtc,
                                  where)
        if sched is None:
            raise PlanViolation("schedulers.candidates() yielded nothing and raised nothing")
        final = None
        if isinstance(sched, RowSchedule) and needs_finalize(info):
            final = finalize_schedule(info, problem, device)
        stage = "plan"
        check_schedule(sched, problem, device)
        check_plan(sched.smem, device, "row kernel plan")
        if final is not None:
            check_plan(final.smem, device, "finalize plan")
        stage = "render"
        source = _render(fd.name, info, sched, final)
        if not nvrtc:
            return f"rendered [{sched.scheduler}]"
        stage = "compile"
        compiled = compile_cuda(source.source, fd.name, device.arch, (str(template_dir()),))
        spills = False
        plans = [(source.row_entry, sched.smem)]
        if final is not None and source.finalize_entry is not None:
            plans.append((source.finalize_entry, final.smem))
        for entry, plan in plans:
            r = compiled.resource(entry)
            if r.static_smem > plan.static_slot:
                raise PlanViolation(f"{entry}: ptxas reports {r.static_smem} B of static shared "
                                    f"memory, over the plan's {plan.static_slot} B slot")
            spills = spills or r.spills
        return f"compiled{', first schedule spills' if spills else ''} [{sched.scheduler}]"
    except CaseFailure as e:
        raise type(e)(f"{e}\n{where}") from e
    except CompileError as e:
        raise NotCompiled(f"{compile_error_summary(e)}\n{where}") from e
    except InternalError as e:
        raise Crash(f"InternalError at {stage}: {e}\n{where}") from e
    except FuserError as e:
        if stage == "repr":  # a fusion that exists prints Python that rebuilds it
            raise ReprMismatch(f"repr(fd) does not rebuild: {e}\n{where}") from e
        return f"{type(e).__name__} ({stage})"
    except Exception as e:
        raise Crash(f"{type(e).__name__} at {stage}: {e}\n{where}") from e


def check_segments(segmentation: Segmentation, problem: Problem, device: DeviceSpec,
                   nvrtc: bool, where: str) -> str:
    """check_fusion() of every segment of a fusion one kernel cannot run; the outcome names
    the segment count and the first segment that did not render (or compile), if any."""
    outcomes = [check_fusion(s.definition, problem, device, nvrtc, where)
                for s in segmentation.segments]
    done = "compiled" if nvrtc else "rendered"
    stopped = [o for o in outcomes if not o.startswith(done)]
    n = len(outcomes)
    return f"segmented into {n}: " + (f"a segment ended {stopped[0]}" if stopped else
                                      f"all {done}")


# ----- failure classes already filed ---------------------------------------------------------


@dataclass(frozen=True)
class KnownFailure:
    """A failure class with a strict-xfail regression test in tests/test_fuzz.py: a long run
    counts its cases under the test's name instead of stopping at the first one. Whoever
    fixes the class removes the test's xfail marker and this entry."""

    test: str
    kind: str  # CaseFailure.kind
    pattern: str  # a regular expression the failure's message matches


# Empty while every filed class is fixed: the three the fuzz found first (an inner reduction
# into another type, max over Bool rows, integer rows over a cluster) compile since 2026-11-30
# and stay as plain regression tests in tests/test_fuzz.py.
KNOWN: tuple[KnownFailure, ...] = ()


def known_failure(failure: CaseFailure) -> KnownFailure | None:
    """The filed failure class `failure` belongs to, if any."""
    text = str(failure)
    for k in KNOWN:
        if failure.kind == k.kind and re.search(k.pattern, text):
            return k
    return None


def run_case(case: Case, counts: Counter[str], strict: bool = False) -> None:
    """check_cpu(), counted; a failure of a filed class is counted under its test's name
    (unless `strict`), any other raises."""
    try:
        counts[check_cpu(case)] += 1
    except CaseFailure as failure:
        known = None if strict else known_failure(failure)
        if known is None:
            counts[f"FAILED ({failure.kind})"] += 1
            raise
        counts[f"known failure ({known.kind}): {known.test}"] += 1


# ----- reports ---------------------------------------------------------------------------------


def write_report(folder: str, shard: int, counts: Counter[str], seconds: float) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"shard-{shard}.json"), "w") as f:
        json.dump({"shard": shard, "seconds": seconds, "counts": dict(counts)}, f)


def summary(folder: str) -> str:
    total: Counter[str] = Counter()
    shards, seconds = 0, 0.0
    for path in sorted(Path(folder).glob("shard-*.json")):
        report = json.loads(path.read_text())
        total.update(report["counts"])
        shards += 1
        seconds += report["seconds"]
    cases = sum(total.values())
    nvrtc = sum(n for k, n in total.items() if k.startswith("compiled") or "(compile)" in k)
    failed = sum(n for k, n in total.items() if k.startswith("FAILED"))
    lines = [f"fuzz: {cases} cases in {shards} shards ({seconds:.0f} s of shard time), "
             f"{nvrtc} through NVRTC, {failed} failed"]
    width = max((len(k) for k in total), default=0)
    lines += [f"  {k:<{width}}  {n:6d}" for k, n in sorted(total.items(), key=lambda x: -x[1])]
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/fuzz_fusions.py summary DIR
    if len(sys.argv) != 3 or sys.argv[1] != "summary":
        sys.exit("usage: python tests/fuzz_fusions.py summary DIR")
    print(summary(sys.argv[2]))
