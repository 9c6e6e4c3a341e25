"""The fusion IR: a DAG of values (tensors and scalars) and the expressions that define them.

Shapes are symbolic. Every non-broadcast dimension of a tensor carries an `Extent`; extents that
must be equal (the two operands of an add, a weight broadcast along a row...) are merged with
union-find when the op is defined, so a mismatch between two fixed sizes is caught at definition
time and a mismatch between bound sizes is caught, by name, when inputs arrive. A broadcast
dimension (size 1) carries no extent.

`Fusion.python_definition()` prints Python that rebuilds an equal fusion; it doubles as the
fusion's canonical signature (names are assigned in definition order, so equal fusions print
equal text).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from fuser.dtypes import DataType
from fuser.errors import DefinitionError, InternalError, UnknownOpError

if TYPE_CHECKING:
    from collections.abc import Sequence

    import networkx as nx


class Extent:
    """A symbolic dimension size. Merged extents share one representative (union-find)."""

    _ids = itertools.count()

    def __init__(self, label: str, value: int | None = None):
        self.label = label
        self.value = value
        self.id = next(Extent._ids)
        self._parent: Extent | None = None

    def find(self) -> Extent:
        node = self
        while node._parent is not None:
            node = node._parent
        return node

    def union(self, other: Extent, context: str) -> None:
        a, b = self.find(), other.find()
        if a is b:
            return
        if a.value is not None and b.value is not None and a.value != b.value:
            raise DefinitionError(
                f"{context}: sizes {a.value} ({a.label}) and {b.value} ({b.label}) must be equal"
            )
        if a.value is None and b.value is not None:
            a, b = b, a
        if a.value is None and b.id < a.id:
            a, b = b, a
        b._parent = a  # the representative: the fixed size if any, else the oldest extent

    def __repr__(self) -> str:
        root = self.find()
        return str(root.value) if root.value is not None else root.label


@dataclass(eq=False)
class Val:
    fusion: Fusion
    index: int
    dtype: DataType
    definition: Expr | None = None
    prefix: ClassVar[str] = "V"  # of the name: "T" for tensors, "S" for scalars

    @property
    def name(self) -> str:
        return f"{self.prefix}{self.index}"

    def __repr__(self) -> str:
        return self.name

    # Python operators, for users who prefer `a * b` to fd.ops.mul(a, b).
    def _binary(self, op, other, reverse=False):
        other = self.fusion.as_val(other)
        return self.fusion.elementwise(op, [other, self] if reverse else [self, other])

    def __add__(self, o):
        return self._binary("add", o)

    def __radd__(self, o):
        return self._binary("add", o, True)

    def __sub__(self, o):
        return self._binary("sub", o)

    def __rsub__(self, o):
        return self._binary("sub", o, True)

    def __mul__(self, o):
        return self._binary("mul", o)

    def __rmul__(self, o):
        return self._binary("mul", o, True)

    def __truediv__(self, o):
        return self._binary("div", o)

    def __rtruediv__(self, o):
        return self._binary("div", o, True)

    def __neg__(self):
        return self.fusion.elementwise("neg", [self])


@dataclass(eq=False, repr=False)
class Tensor(Val):
    dims: tuple[Extent | None, ...] = ()  # None marks a broadcast (size-1) dimension
    contiguity: tuple[bool | None, ...] = ()
    prefix = "T"

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def size(self, dim: int) -> Scalar:
        return self.fusion.size(self, dim)

    def shape(self) -> list[Scalar]:
        return [self.size(d) for d in range(self.ndim)]


@dataclass(eq=False, repr=False)
class Scalar(Val):
    value: float | int | bool | None = None  # None: a fusion input given at execute()
    extent: Extent | None = None  # set when this scalar is a tensor's size
    prefix = "S"


@dataclass(frozen=True)
class Expr:
    op: str
    inputs: tuple[Val, ...]
    outputs: tuple[Val, ...]
    attrs: tuple = ()  # sorted (name, value) pairs; values hashable

    def attr(self, name):
        return dict(self.attrs)[name]


@dataclass(eq=False)
class Fusion:
    vals: list[Val] = field(default_factory=list)
    exprs: list[Expr] = field(default_factory=list)
    inputs: list[Val] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    # Set when the `with FusionDefinition() as fd:` block that built it closes: what was
    # defined is final (a kernel may already be built from it), so defining more raises.
    closed_by: str | None = None

    # ----- building -----

    def _check_open(self) -> None:
        if self.closed_by is not None:
            raise DefinitionError(
                f"{self.closed_by}: its `with` block has closed, so the definition is final; "
                "define every input, op and output inside `with FusionDefinition() as fd:`, "
                "or build a new FusionDefinition"
            )

    def _tensor(self, dtype, dims, contiguity=None, definition=None) -> Tensor:
        self._check_open()
        if contiguity is None:
            contiguity = tuple(None if d is None else True for d in dims)
        t = Tensor(self, len(self.vals), dtype, None, tuple(dims), tuple(contiguity))
        self.vals.append(t)
        return t

    def _scalar(self, dtype, value=None, extent=None) -> Scalar:
        self._check_open()
        s = Scalar(self, len(self.vals), dtype, None, value, extent)
        self.vals.append(s)
        return s

    def _define(self, op, inputs, outputs, **attrs) -> None:
        expr = Expr(op, tuple(inputs), tuple(outputs), tuple(sorted(attrs.items())))
        for out in outputs:
            out.definition = expr
        self.exprs.append(expr)

    def define_tensor(self, shape, contiguity, dtype) -> Tensor:
        self._check_open()
        _require_dtype("define_tensor", dtype)
        shape = _listed("define_tensor", "shape", shape, "one int per dimension, e.g. [-1, -1]")
        dims = []
        for d, size in enumerate(shape):
            if not isinstance(size, int) or size == 0 or size < -1:
                raise DefinitionError(
                    f"define_tensor: shape[{d}] = {size!r}; use -1 for any size, 1 for a "
                    "broadcast dimension or a positive fixed size"
                )
            label = f"T{len(self.vals)}.size({d})"
            dims.append(None if size == 1 else Extent(label, None if size == -1 else size))
        if contiguity is None:
            contiguity = [None if d is None else True for d in dims]
        elif isinstance(contiguity, bool):
            contiguity = [None if d is None else contiguity for d in dims]
        contiguity = _listed(
            "define_tensor", "contiguity", contiguity, "True, False or one bool/None per dimension"
        )
        if len(contiguity) != len(dims):
            raise DefinitionError(
                f"define_tensor: contiguity has {len(contiguity)} entries for a rank-{len(dims)} "
                "shape; give one per dimension (None for broadcast dimensions)"
            )
        for d, (extent, c) in enumerate(zip(dims, contiguity, strict=True)):
            if extent is None and c is not None:
                raise DefinitionError(
                    f"define_tensor: dimension {d} is a broadcast (size 1), so its contiguity "
                    f"must be None, not {c!r}"
                )
            if extent is not None and not isinstance(c, bool):
                raise DefinitionError(
                    f"define_tensor: dimension {d} has size {shape[d]}, so its contiguity must be "
                    f"True or False, not {c!r}"
                )
        t = self._tensor(dtype, dims, contiguity)
        self.inputs.append(t)
        return t

    def define_scalar(self, value=None, dtype=None) -> Scalar:
        if value is None and dtype is None:
            raise DefinitionError("define_scalar: an input scalar (no value) needs a dtype")
        if value is not None:
            value = _python_number(value)
        if dtype is not None:
            _require_dtype("define_scalar", dtype)
        if dtype is None:
            dtype = (
                DataType.Bool
                if isinstance(value, bool)
                else DataType.Int64
                if isinstance(value, int)
                else DataType.Double
            )
        if value is not None:
            _check_literal(value, dtype)
        s = self._scalar(dtype, value)
        if value is None:
            self.inputs.append(s)
        return s

    def as_val(self, x) -> Val:
        """A Val of this fusion; Python numbers become constant scalars."""
        if isinstance(x, Val):
            if x.fusion is not self:
                raise DefinitionError(f"{x.name} belongs to another FusionDefinition")
            return x
        if isinstance(x, bool | int | float | np.bool_ | np.integer | np.floating):
            return self.define_scalar(x)
        raise DefinitionError(f"expected a tensor, a scalar or a number, got {x!r}")

    def add_output(self, t: Val) -> None:
        self._check_open()
        t = self.as_val(t)
        if not isinstance(t, Tensor):
            raise DefinitionError(f"add_output: {t.name} is a scalar; outputs must be tensors")
        if t in self.inputs:
            raise DefinitionError(f"add_output: {t.name} is a fusion input; output a copy instead")
        if t in self.outputs:
            raise DefinitionError(f"add_output: {t.name} is already an output")
        self.outputs.append(t)

    # ----- ops -----

    def _broadcast_dims(self, op: str, tensors: list[Tensor]) -> list[Extent | None]:
        """Right-aligned broadcasting of operand shapes (numpy / PyTorch rules)."""
        rank = max(t.ndim for t in tensors)
        dims: list[Extent | None] = [None] * rank
        for t in tensors:
            offset = rank - t.ndim
            for d, extent in enumerate(t.dims):
                if extent is None:
                    continue
                merged = dims[offset + d]
                if merged is None:
                    dims[offset + d] = extent
                else:
                    operands = ", ".join(f"{x.name}{list(x.dims)}" for x in tensors)
                    merged.union(extent, f"{op}({operands}) dimension {offset + d}")
        return dims

    def elementwise(self, op: str, operands: list) -> Val:
        from fuser.ops import ELEMENTWISE

        info = ELEMENTWISE.get(op)
        if info is None:
            raise UnknownOpError(
                f"no elementwise op {op!r}; the ops are {', '.join(sorted(ELEMENTWISE))}"
            )
        vals = [self.as_val(x) for x in operands]
        if len(vals) != info.arity:
            raise DefinitionError(f"{op} takes {info.arity} operands, got {len(vals)}")
        typed = vals
        if op == "where":
            if vals[0].dtype is not DataType.Bool:
                raise DefinitionError(
                    f"where: the condition {vals[0].name} has dtype {vals[0].dtype}; it must be "
                    "DataType.Bool (compare with fd.ops.ne(t, 0) or cast it)"
                )
            typed = vals[1:]
        tensors = [v for v in vals if isinstance(v, Tensor)]
        operand_type = info.types.operand(
            [v.dtype for v in typed if isinstance(v, Tensor)],
            [v.dtype for v in typed if isinstance(v, Scalar)],
        )
        if op in ("abs", "neg", "sub") and operand_type is DataType.Bool:
            raise DefinitionError(
                f"{op}: operands {', '.join(v.name for v in vals)} are Bool; {op} needs numbers "
                "(cast them, or use ne/eq for logic)"
            )
        result_type = info.types.result(operand_type)
        out: Val
        if tensors:
            out = self._tensor(result_type, self._broadcast_dims(op, tensors))
        else:
            out = self._scalar(result_type)
        self._define(op, vals, [out], compute=operand_type)
        return out

    def cast(self, v, dtype: DataType, rounds: bool = True) -> Val:
        """`v` as `dtype`. To Half or BFloat16 a cast rounds to nearest even; with
        rounds=False the result stays the float a kernel holds, as every other value of
        those types does (an op's, a reduction's: only casts and stores round them)."""
        v = self.as_val(v)
        _require_dtype("cast", dtype)
        if not isinstance(rounds, bool):
            raise DefinitionError(f"cast: rounds must be True or False, got {rounds!r}")
        out: Val = self._tensor(dtype, v.dims) if isinstance(v, Tensor) else self._scalar(dtype)
        attrs: dict = {"dtype": dtype}
        if not rounds and dtype in (DataType.Half, DataType.BFloat16):
            attrs["rounds"] = False  # to Float or an int type the kernel's value is the cast's
        self._define("cast", [v], [out], **attrs)
        return out

    def size(self, t: Val, dim: int) -> Scalar:
        t = self._require_tensor("size", t)
        d = self._normalize_dim("size", t, dim)
        extent = t.dims[d]
        out = self._scalar(DataType.Int64, extent=extent)
        if extent is None:
            out.value = 1
        self._define("size", [t], [out], dim=d)
        return out

    def unsqueeze(self, t, dim: int) -> Tensor:
        """torch.unsqueeze: `t` with a size-1 axis inserted at `dim` (-ndim - 1 to ndim), as the
        broadcast_in_dim that keeps every axis of `t` (repr(fd) prints that)."""
        t = self._require_tensor("unsqueeze", t)
        at = self._normalize_dim("unsqueeze", t, dim, rank=t.ndim + 1)
        sizes: list[Scalar | int] = [1 if e is None else self.size(t, d)
                                     for d, e in enumerate(t.dims)]
        kept = [d if d < at else d + 1 for d in range(t.ndim)]
        return self.broadcast_in_dim(t, [*sizes[:at], 1, *sizes[at:]], kept)

    def squeeze(self, t, dims) -> Tensor:
        """torch.squeeze(t, dims): `t` without the listed axes, each of which must be declared
        size 1 (a 1 in define_tensor's shape, a reduction's keepdim axis, a 1 in a broadcast's
        shape): the same elements in the same order."""
        t = self._require_tensor("squeeze", t)
        listed = _listed("squeeze", "dims", [dims] if isinstance(dims, int) else dims,
                         f"the size-1 dimensions of {t.name} to remove")
        axes = sorted({self._normalize_dim("squeeze", t, d) for d in listed})
        if len(axes) != len(listed):
            raise DefinitionError(f"squeeze({t.name}, dims={listed}): a dimension is listed twice")
        for d in axes:
            if t.dims[d] is not None:
                raise DefinitionError(
                    f"squeeze({t.name}, dims={listed}): dimension {d} of {t.name} is not "
                    "declared size 1; squeeze only axes declared so (a 1 in define_tensor's "
                    "shape, a keepdim reduction's axis, a 1 in a broadcast's shape)")
        out = self._tensor(t.dtype, [e for d, e in enumerate(t.dims) if d not in axes])
        self._define("squeeze", [t], [out], dims=tuple(axes))
        return out

    def permute(self, t, dims) -> Tensor:
        """torch.permute(t, dims): `t` with its axes reordered, output axis i being axis
        dims[i] of `t`. A layout op: it runs between kernels (LAYOUT_OPS)."""
        t = self._require_tensor("permute", t)
        listed = _listed("permute", "dims", dims, f"a reordering of {t.name}'s {t.ndim} axes")
        context = f"permute({t.name}, dims={listed})"
        if t.ndim == 0:
            raise DefinitionError(f"{context}: {t.name} has no dimensions to reorder; use it "
                                  "as it is")
        axes = [self._normalize_dim(context, t, d) for d in listed]
        if sorted(axes) != list(range(t.ndim)):
            raise DefinitionError(
                f"{context}: dims must name each of {t.name}'s {t.ndim} axes once (a "
                f"permutation of {list(range(t.ndim))})")
        out = self._tensor(t.dtype, [t.dims[d] for d in axes])
        self._define("permute", [t], [out], dims=tuple(axes))
        return out

    def reshape(self, t, new_shape) -> Tensor:
        """torch.reshape(t, new_shape): the same elements in the same (row-major) order under
        another shape. Each size is an int (1 for a broadcast axis, -1 for the one size the
        element count decides), or a size taken from a tensor (t.size(i)). A layout op: it
        runs between kernels (LAYOUT_OPS); the element counts are checked when inputs arrive."""
        t = self._require_tensor("reshape", t)
        shape = _listed("reshape", "new_shape", new_shape,
                        "one size per output dimension: ints (one may be -1) or t.size(i)")
        context = f"reshape({t.name}, new_shape={shape})"
        if sum(1 for size in shape if isinstance(size, int) and size == -1) > 1:
            raise DefinitionError(f"{context}: at most one size may be -1 (inferred)")
        for d, size in enumerate(shape):
            if isinstance(size, bool) or not isinstance(size, int | np.integer | Scalar):
                raise DefinitionError(
                    f"{context}: new_shape[{d}] = {size!r}; give an int (-1 once, for the "
                    "inferred size) or a size taken from a tensor (t.size(i))")
        shape = [int(size) if isinstance(size, int | np.integer) else size for size in shape]
        dims = [self._broadcast_extent(context, d, size) for d, size in enumerate(shape)]
        fixed = [e.find().value for e in t.dims if e is not None]
        wanted = [e.find().value for e in dims if e is not None]
        if None not in fixed and wanted.count(None) <= 1:
            count, known = math.prod(v or 1 for v in fixed), math.prod(v or 1 for v in wanted)
            if reshaped(count, wanted) is None:
                raise DefinitionError(
                    f"{context}: {t.name} has {count} elements, which the new shape's fixed "
                    f"sizes ({known} elements{' and one more size' if None in wanted else ''}) "
                    "cannot hold")
        out = self._tensor(t.dtype, dims)
        self._define("reshape", [t, *[size for size in shape if isinstance(size, Scalar)]],
                     [out], shape=tuple(s if isinstance(s, int) else s.name for s in shape))
        return out

    def broadcast_in_dim(self, t, shape, broadcast_dims) -> Tensor:
        return self._broadcast("broadcast_in_dim", t, shape, broadcast_dims)

    def expand(self, t, shape, broadcast_dims) -> Tensor:
        """broadcast_in_dim made between kernels, as a contiguous copy of `t` broadcast to
        `shape`: a layout op (LAYOUT_OPS) that fuser.reorder writes where a kernel cannot read
        `t` broadcast (a [seq, hidden] table over [batch, seq, hidden] rows normalized along
        hidden). Not an op of fd.ops: users broadcast with broadcast_in_dim."""
        return self._broadcast("expand", t, shape, broadcast_dims)

    def _broadcast(self, op: str, t, shape, broadcast_dims) -> Tensor:
        t = self._require_tensor(op, t)
        shape = _listed(op, "shape", shape, "one size per output dimension")
        broadcast_dims = _listed(
            op, "broadcast_dims", broadcast_dims,
            f"one output dimension (an int) per dimension of {t.name}",
        )
        context = f"{op}({t.name}, shape={shape}, broadcast_dims={broadcast_dims})"
        if len(broadcast_dims) != t.ndim:
            raise DefinitionError(
                f"{context}: broadcast_dims needs one entry per dimension of {t.name} "
                f"(rank {t.ndim})"
            )
        for i, d in enumerate(broadcast_dims):
            if isinstance(d, bool) or not isinstance(d, int | np.integer):
                raise DefinitionError(
                    f"{context}: broadcast_dims[{i}] = {d!r}; broadcast_dims must be ints, the "
                    f"output dimension (0 to {len(shape) - 1}) of each dimension of {t.name}"
                )
        broadcast_dims = [int(d) for d in broadcast_dims]
        if sorted(set(broadcast_dims)) != broadcast_dims or any(
            not 0 <= d < len(shape) for d in broadcast_dims
        ):
            raise DefinitionError(
                f"{context}: broadcast_dims must be increasing and within the output rank "
                f"{len(shape)}"
            )
        dims = [self._broadcast_extent(context, d, size) for d, size in enumerate(shape)]
        size_inputs = [size for size in shape if isinstance(size, Scalar)]
        for i, d in enumerate(broadcast_dims):
            src = t.dims[i]
            if src is None:
                continue
            dst = dims[d]
            if dst is None:
                raise DefinitionError(
                    f"{context}: dimension {i} of {t.name} has size {src}, but output dimension "
                    f"{d} has size 1"
                )
            dst.union(src, context)
            dims[d] = src
        out = self._tensor(t.dtype, dims)
        self._define(
            op,
            [t, *size_inputs],
            [out],
            shape=tuple(s if isinstance(s, int) else s.name for s in shape),
            broadcast_dims=tuple(broadcast_dims),
        )
        return out

    def _broadcast_extent(self, context: str, d: int, size) -> Extent | None:
        """The extent of output dimension d of a broadcast: a tensor's size (a Scalar this
        fusion took with t.size(i)), a fixed int, -1 (symbolic), or None for size 1."""
        if isinstance(size, Scalar):
            if size.fusion is not self:
                raise DefinitionError(
                    f"{context}: shape[{d}] = {size.name} belongs to another FusionDefinition"
                )
            if size.extent is None and size.value != 1:
                raise DefinitionError(
                    f"{context}: shape[{d}] = {size.name} is not a tensor size; pass an int "
                    "or a size taken from a tensor (t.size(i), t.shape())"
                )
            return size.extent
        if isinstance(size, int) and (size == -1 or size >= 1):
            return None if size == 1 else Extent(f"{context}[{d}]", None if size == -1 else size)
        raise DefinitionError(f"{context}: shape[{d}] = {size!r} is not a valid size")

    def reduction(self, op: str, t, dims, keepdim: bool, dtype: DataType | None = None) -> Tensor:
        from fuser.ops import REDUCTIONS, sum_result_type

        if op not in REDUCTIONS:
            raise DefinitionError(f"no reduction {op!r}; the reductions are "
                                  f"{', '.join(REDUCTIONS)}")
        t = self._require_tensor(op, t)
        dims = self._reduced(op, t, dims)
        if dtype is not None:
            _require_dtype(op, dtype, "or None")
        if dtype is None:
            dtype = sum_result_type(t.dtype) if op == "sum" else t.dtype
        out = self._tensor(dtype, self._reduced_dims(t, dims, keepdim))
        self._define(op, [t], [out], dims=dims, keepdim=bool(keepdim))
        return out

    def mean(self, t, dims, keepdim: bool) -> Tensor:
        """torch.mean: the sum over dims divided by the number of elements summed, of a float
        tensor, in its type (lowering.py expands it into that sum and division)."""
        t = self._require_float("mean", t, " (as torch.mean, which takes floats only), or sum it")
        dims = self._reduced("mean", t, dims)
        out = self._tensor(t.dtype, self._reduced_dims(t, dims, keepdim))
        self._define("mean", [t], [out], dims=dims, keepdim=bool(keepdim))
        return out

    def var_mean(self, t, dims, correction: int, keepdim: bool) -> tuple[Tensor, Tensor]:
        t, dims, correction = self._variance_operands("var_mean", t, dims, correction)
        out_dims = self._reduced_dims(t, dims, keepdim)
        var, mean = self._tensor(t.dtype, out_dims), self._tensor(t.dtype, out_dims)
        self._define(
            "var_mean", [t], [var, mean], dims=dims, correction=correction,
            keepdim=bool(keepdim),
        )
        return var, mean

    def var(self, t, dims, correction: int, keepdim: bool) -> Tensor:
        """torch.var: var_mean's variance alone (lowering.py expands both the same way)."""
        t, dims, correction = self._variance_operands("var", t, dims, correction)
        var = self._tensor(t.dtype, self._reduced_dims(t, dims, keepdim))
        self._define("var", [t], [var], dims=dims, correction=correction, keepdim=bool(keepdim))
        return var

    def _variance_operands(self, op: str, t, dims, correction) -> tuple[Tensor, tuple, int]:
        """The tensor, normalized dims and int correction of var_mean / var, checked."""
        t = self._require_float(op, t)
        dims = self._reduced(op, t, dims)
        try:
            if isinstance(correction, bool | np.bool_):
                raise TypeError
            correction = operator.index(correction)
            if not -(2**63) <= correction < 2**63:
                raise TypeError
        except TypeError:
            raise DefinitionError(
                f"{op}({t.name}): correction must be an int (0: population variance, "
                f"1: sample variance; the divisor is max(n - correction, 0)) that fits in "
                f"Int64, got {correction!r}"
            ) from None
        return t, dims, int(correction)

    def _reduced(self, op: str, t: Tensor, dims) -> tuple[int, ...]:
        """The sorted, normalized dimensions a reduction names: a list or tuple of ints, or one
        int (as torch takes dim=1 for dim=[1])."""
        if isinstance(dims, int | np.integer) and not isinstance(dims, bool | np.bool_):
            dims = [dims]
        dims = _listed(op, "dims", dims, f"the dimensions of {t.name} to reduce, e.g. [1] or 1")
        normalized = tuple(sorted({self._normalize_dim(op, t, d) for d in dims}))
        if not normalized:
            raise DefinitionError(f"{op}({t.name}): dims is empty; name the dimensions to reduce")
        return normalized

    @staticmethod
    def _reduced_dims(t: Tensor, dims, keepdim: bool) -> list[Extent | None]:
        return [None if d in dims else e for d, e in enumerate(t.dims) if keepdim or d not in dims]

    def _require_float(self, op: str, t, hint: str = "") -> Tensor:
        """`t` as a tensor of a float type (mean, var_mean, var), else a DefinitionError."""
        t = self._require_tensor(op, t)
        if not t.dtype.is_float:
            raise DefinitionError(
                f"{op}: {t.name} has dtype {t.dtype}; cast it to a float type{hint}")
        return t

    def _require_tensor(self, op, t) -> Tensor:
        t = self.as_val(t)
        if not isinstance(t, Tensor):
            raise DefinitionError(f"{op}: {t.name} is a scalar; {op} needs a tensor")
        return t

    @staticmethod
    def _normalize_dim(op, t: Tensor, dim, rank: int | None = None) -> int:
        """`dim` as an axis from 0 of a result of `rank` (t's own by default; unsqueeze's is
        one more), negative dims counting from the end, as torch."""
        rank = t.ndim if rank is None else rank
        if (isinstance(dim, bool | np.bool_) or not isinstance(dim, int | np.integer)
                or not -rank <= dim < rank):
            raise DefinitionError(
                f"{op}: dim {dim!r} is out of range for {t.name} of rank {t.ndim}; give an "
                f"int from {-rank} to {rank - 1}"
            )
        return int(dim) % rank

    # ----- views -----

    def graph(self) -> nx.DiGraph:
        """Values as nodes (by name), an edge from each operand to each result (networkx is
        imported here, not with fuser: it costs a tenth of a second)."""
        import networkx as nx

        g = nx.DiGraph()
        for v in self.vals:
            g.add_node(v.name, val=v)
        for e in self.exprs:
            for i in e.inputs:
                for o in e.outputs:
                    g.add_edge(i.name, o.name, op=e.op)
        return g

    def uses(self, v: Val) -> list[Expr]:
        return [e for e in self.exprs if v in e.inputs]

    def python_definition(self) -> str:
        from fuser.printer import python_definition

        return python_definition(self)


_DTYPE_NAMES = {
    "bool": DataType.Bool, "int32": DataType.Int32, "int": DataType.Int64,
    "int64": DataType.Int64, "long": DataType.Int64, "half": DataType.Half,
    "float16": DataType.Half, "bfloat16": DataType.BFloat16, "float": DataType.Float,
    "float32": DataType.Float, "double": DataType.Double, "float64": DataType.Double,
}


def _require_dtype(op: str, dtype, also: str = "") -> None:
    """DefinitionError naming the allowed DataTypes (and the one meant, for a name such as
    "float" or torch.float32) unless `dtype` is a DataType."""
    if isinstance(dtype, DataType):
        return
    allowed = ", ".join(repr(d) for d in DataType)
    meant = _DTYPE_NAMES.get(str(dtype).lower().removeprefix("torch.").removeprefix("dtype."))
    hint = f"; for {dtype!r} pass {meant!r}" if meant is not None else ""
    raise DefinitionError(
        f"{op}: dtype must be a fuser.DataType{' ' + also if also else ''}, got {dtype!r} "
        f"({type(dtype).__name__}){hint}; the types are {allowed}"
    )


def _python_number(value) -> bool | int | float:
    """`value` as a Python bool, int or float (numpy scalars too); DefinitionError otherwise."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    raise DefinitionError(
        f"define_scalar: value must be a number (a bool, an int or a float), got "
        f"{type(value).__name__} {value!r}"
    )


INT_RANGES = {DataType.Int32: (-(2**31), 2**31 - 1), DataType.Int64: (-(2**63), 2**63 - 1)}


def _check_literal(value: bool | int | float, dtype: DataType) -> None:
    """A constant must be a value of its dtype, as execute() requires of scalar inputs: a bool
    for Bool, an int within range for Int32 / Int64 (a float would be truncated), a number a
    float can hold for the float types (inf and nan included; beyond float32 it is inf)."""
    text = repr(value)
    shown = text if len(text) <= 30 else f"{text[:12]}...({len(text)} digits)"
    where = f"define_scalar({shown}, dtype={dtype!r})"
    if dtype is DataType.Bool:
        if not isinstance(value, bool):
            raise DefinitionError(f"{where}: a Bool constant must be True or False")
    elif not dtype.is_float:
        if isinstance(value, bool) or not isinstance(value, int):
            kind = "NaN" if isinstance(value, float) and math.isnan(value) else repr(value)
            raise DefinitionError(
                f"{where}: an {dtype.label} constant must be an int, not {kind}; round it "
                "yourself (int(x)), or give a float dtype"
            )
        low, high = INT_RANGES[dtype]
        if not low <= value <= high:
            raise DefinitionError(
                f"{where}: the value is outside {dtype.label}'s range {low} to {high}; use "
                "a float (dtype DataType.Double) for a larger number"
            )
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            raise DefinitionError(
                f"{where}: the value is beyond the range of every float type (about 1.8e308)"
            ) from None


def reshaped(count: int, sizes: list[int | None]) -> list[int] | None:
    """`sizes` with its one unknown (None) inferred so that they hold `count` elements; None
    where they cannot (two unknowns, or counts that do not agree)."""
    rest = math.prod(s for s in sizes if s is not None)
    unknown = sizes.count(None)
    if unknown > 1 or (count % rest if unknown else count != rest):
        return None
    return [count // rest if s is None else s for s in sizes]


def _listed(op: str, what: str, x, expected: str) -> list:
    """`x` as a list; DefinitionError naming `op`'s argument when it is not a sequence."""
    if isinstance(x, str | bytes):
        raise DefinitionError(f"{op}: {what} must be a list or tuple ({expected}), got {x!r}")
    try:
        return list(x)
    except TypeError:
        raise DefinitionError(
            f"{op}: {what} must be a list or tuple ({expected}), got {x!r}"
        ) from None


def dim_axes(t: Tensor) -> list[Extent | None]:
    """The axis (root extent) of each of `t`'s dimensions, None where it has size 1."""
    return [None if e is None else e.find() for e in t.dims]


def spanned_axes(t: Tensor) -> tuple[Extent, ...]:
    """The axes `t` spans (its dimensions not of size 1), in its order."""
    return tuple(e.find() for e in t.dims if e is not None)


def reduced_axes(e: Expr) -> frozenset[Extent]:
    """The axes reduction `e` reduces (its dims that are not of size 1)."""
    src = as_tensor(e.inputs[0])
    return frozenset(src.dims[d].find() for d in e.attr("dims") if src.dims[d] is not None)


def rounding_cast(e: Expr) -> bool:
    """A cast that rounds as casts do (not one made with rounds=False)."""
    return e.op == "cast" and dict(e.attrs).get("rounds", True)


def copy_cast(out: Fusion, e: Expr, operand: Val) -> Val:
    """Cast `e` again in `out`, on `operand`."""
    return out.cast(operand, e.attr("dtype"), rounds=rounding_cast(e))


def upstream(vals: Sequence[Val]) -> list[Expr]:
    """The Exprs `vals` depend on, each once."""
    seen: dict[int, Expr] = {}
    stack: list[Val] = list(vals)
    while stack:
        e = stack.pop().definition
        if e is not None and id(e) not in seen:
            seen[id(e)] = e
            stack.extend(e.inputs)
    return list(seen.values())


def as_tensor(v: Val) -> Tensor:
    """`v`, which the IR guarantees to be a tensor here (the operand of a reduction or of
    broadcast_in_dim, the result of a tensor op); InternalError if it is not."""
    if not isinstance(v, Tensor):
        raise InternalError(
            f"{v.name} is a scalar where the fusion IR must hold a tensor "
            f"(defined by {v.definition}); this is a fuser bug, please report it"
        )
    return v
