"""Fusion values -> C++ statements, one `const` statement per IR value, named after it.

The op table (ops.py) gives each op's CUDA; this module resolves operands, casts and aliases
(broadcast_in_dim and same-type casts emit nothing), divides by per-row values through their
reciprocal, pins the rounding of values a max or min reduces, and records which values a
group of statements read, so that a kernel loads only the buffers a pass uses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from fuser.analysis import FusionInfo, Role, operands, row_counts
from fuser.dtypes import DataType
from fuser.errors import FuserError
from fuser.ir import Expr, Scalar, Tensor, Val, rounding_cast
from fuser.ops import ELEMENTWISE, REDUCTIONS

REDUCTION_OPS = tuple(REDUCTIONS)  # sum, max, min: values a pass reduces, not computes


def ctype(v: Val) -> str:
    return v.dtype.compute_type


def convert(expr: str, src: str, dst: str) -> str:
    return expr if src == dst else f"static_cast<{dst}>({expr})"


def literal(value, dtype: DataType) -> str:
    if dtype is DataType.Bool:
        return "true" if value else "false"
    if not dtype.is_float:
        return f"{int(value)}LL"
    value = float(value)
    if math.isnan(value):
        return "fm::nan()"
    if math.isinf(value):
        return "fm::inf()" if value > 0 else "(-fm::inf())"
    return repr(value)


VIEWS = ("broadcast_in_dim", "squeeze")  # ops that name their input's values again
# The device function a cast to a 16-bit float type rounds its value with (to nearest even,
# kept in float), as fm::to_storage rounds a stored value.
ROUNDINGS = {DataType.BFloat16: "fm::round_bf16", DataType.Half: "fm::round_half"}


# Arithmetic that the compiler never contracts into an FMA (--fmad=true contracts a * b + c):
# the CUDA intrinsics for a value whose rounding must not depend on where it is used.
PINNED = {
    ("mul", "float"): "__fmul_rn({0}, {1})", ("add", "float"): "__fadd_rn({0}, {1})",
    ("sub", "float"): "__fsub_rn({0}, {1})", ("mul", "double"): "__dmul_rn({0}, {1})",
    ("add", "double"): "__dadd_rn({0}, {1})", ("sub", "double"): "__dsub_rn({0}, {1})",
}


def extreme_operands(info: FusionInfo) -> frozenset[Val]:
    """The values a max or min reduces (through aliases). Each pass recomputes them, and
    x - max(x) <= 0, x == max(x) for some x, hold only if every pass rounds x alike: left to
    the compiler, a product x = a * b is rounded where the reduction reads it but contracted
    into fma(a, b, -max) where the max is subtracted, which is above 0 at the row's maximum
    half the time. Their mul, add and sub are emitted as PINNED intrinsics."""
    out = set()
    for e in info.fusion.exprs:
        if e.op in ("max", "min"):
            v = e.inputs[0]
            while v.definition is not None and is_alias(v.definition, v):
                v = v.definition.inputs[0]
            out.add(v)
    return frozenset(out)


def is_alias(e: Expr, v: Val) -> bool:
    """Whether `e` computes nothing for its output `v`, only names its input's values again
    (a view, a cast to the type it has): no statement of its own."""
    return e.op in VIEWS or (e.op == "cast" and e.inputs[0].dtype is v.dtype)


def through_broadcasts(v: Val) -> Val:
    """The value a chain of broadcast_in_dim (and squeeze) aliases stands for."""
    while v.definition is not None and v.definition.op in VIEWS:
        v = v.definition.inputs[0]
    return v


class Emitter:
    """Writes C++ statements for values of a fusion, given C++ expressions for what is known.

    `env` maps values to expressions already available at the emission point; `emit` adds one
    `const` statement per missing value in definition order and records the new names in
    `env`; `used` collects the known values the statements read.
    """

    def __init__(self, info: FusionInfo, env: dict[Val, str], prefix: str,
                 reciprocals: dict[tuple[Val, str], str] | None = None):
        self.info = info
        self.env = dict(env)
        self.known = set(env)
        self.prefix = prefix
        self.used: set[Val] = set()
        # (per-row value, compute type) -> the C++ name of its reciprocal, computed once per
        # row: an element divided by it is multiplied by the reciprocal instead.
        self.reciprocals = reciprocals if reciprocals is not None else {}
        self.pinned = extreme_operands(info)

    def emit(self, targets) -> list[str]:
        needed: set[Val] = set()
        stack = [t for t in targets if t not in self.env]
        while stack:
            v = stack.pop()
            if v in needed or v in self.env:
                continue
            if v.definition is None or v.definition.op in REDUCTION_OPS:
                raise FuserError(f"{v.name} is needed where it is not available (a fuser bug: "
                                 "please report it with repr(fd))")
            needed.add(v)
            stack.extend(operands(v.definition))
        self.used.update(t for t in targets if t in self.known)
        lines = []
        for v in sorted(needed, key=lambda v: v.index):
            e = v.definition
            assert e is not None  # `needed` holds computed values only
            expr = self._expression(e, pin=v in self.pinned)
            if is_alias(e, v):
                self.env[v] = expr
                continue
            name = f"{self.prefix}{v.name}"
            lines.append(f"const {ctype(v)} {name} = {expr};")
            self.env[v] = name
        return lines

    def emit_stored(self, outputs, also=()) -> tuple[list[str], dict[Val, str]]:
        """emit() for outputs about to be stored through fm::to_storage (and the values
        `also`), and the expression each store writes. An output made by a cast to its own
        Half or BFloat16 type is stored from the cast's operand: to_storage rounds to nearest
        even exactly as the cast does, so the same bits land without the cast's own rounding
        (an F2F per element on sm_90, on the conversion pipe that exp's MUFU shares: a third
        of that pipe's work in softmax's bf16 kernel)."""
        sources = {o: self._stored_source(o) for o in outputs}
        lines = self.emit([*sources.values(), *also])
        return lines, {o: self.env[src] for o, src in sources.items()}

    def _stored_source(self, v: Val) -> Val:
        e = v.definition
        if v in self.env or e is None or not rounding_cast(e) or v.dtype not in ROUNDINGS:
            return v
        return e.inputs[0]

    def _ref(self, v: Val) -> str:
        if v in self.known:
            self.used.add(v)
        return self.env[v]

    def _operand(self, v: Val, compute: str) -> str:
        return convert(self._ref(v), ctype(v), compute)

    def _expression(self, e: Expr, pin: bool = False) -> str:
        if e.op in VIEWS:
            return self._ref(e.inputs[0])
        if e.op == "cast":
            return self._cast(e)
        if e.op == "size":
            raise FuserError("sizes are bound in the kernel prologue (a fuser bug)")
        compute = e.attr("compute").compute_type
        if e.op == "where":
            args = [self._ref(e.inputs[0])] + [self._operand(i, compute) for i in e.inputs[1:]]
        elif e.op == "div" and (
                rcp := self.reciprocals.get((through_broadcasts(e.inputs[1]), compute))):
            x = self._operand(e.inputs[0], compute)
            return (PINNED["mul", compute].format(x, rcp) if pin and ("mul", compute) in PINNED
                    else f"({x} * {rcp})")
        else:
            args = [self._operand(i, compute) for i in e.inputs]
        if pin and (e.op, compute) in PINNED:
            return PINNED[e.op, compute].format(*args)
        return ELEMENTWISE[e.op].cuda.format(*args)

    def _cast(self, e: Expr) -> str:
        src = e.inputs[0]
        x = self._ref(src)
        target = e.attr("dtype")
        if target in ROUNDINGS and rounding_cast(e):
            return f"{ROUNDINGS[target]}({convert(x, ctype(src), 'float')})"
        if target is DataType.Bool and src.dtype is not DataType.Bool:
            return f"({x} != 0)"
        return convert(x, ctype(src), target.compute_type)


def divisors(info: FusionInfo, constant: Callable[[Val], bool]) -> dict[Val, set[str]]:
    """Values constant along a pass (a row's per-row values, or a column's values in the
    kernels that normalize along columns) that its elements are divided by, with the compute
    types of those divisions: a division costs the H200 about ten instructions per element
    (IEEE div.rn with its slow path), a multiply one, so fuser divides by such a value through
    its reciprocal, computed once per row or column (x * (1 / s) is within 1.5 ulp of x / s)."""
    out: dict[Val, set[str]] = {}
    for v in info.fusion.vals:
        d = v.definition
        if d is None or d.op != "div" or constant(v):
            continue
        src = through_broadcasts(d.inputs[1])
        if constant(src):
            out.setdefault(src, set()).add(d.attr("compute").compute_type)
    return out


def reciprocal(prefix: str, v: Val, compute: str, value: str) -> tuple[str, str]:
    """The C++ name of the reciprocal of `v` in `compute` (<prefix>rcp[_d]_<name>) and the
    expression that computes it from `value`, v's C++ expression."""
    return (f"{prefix}rcp{'_d' if compute == 'double' else ''}_{v.name}",
            f"{compute}(1) / {convert(value, ctype(v), compute)}")


def scalar_prologue(info: FusionInfo) -> tuple[list[str], dict[Val, str]]:
    """Statements for every scalar value (constants, sizes, scalar arithmetic), evaluated
    once; `used_lines` later keeps those a kernel reads."""
    env: dict[Val, str] = {}
    lines = []
    unknown: set[Val] = set()  # sizes of one of several row axes (analysis keeps them unused)
    for s in info.scalar_inputs:
        env[s] = s.name
    for t in info.value_inputs:  # a tensor of no dimension: its one element, read once
        lines.append(f"const {ctype(t)} {t.name} = fm::to_compute(g_{t.name}[0]);")
        env[t] = t.name
    for v in info.fusion.vals:
        if not isinstance(v, Scalar) or v in env:
            continue
        if v.definition is None:
            lines.append(f"const {ctype(v)} {v.name} = {literal(v.value, v.dtype)};")
            env[v] = v.name
        elif v.definition.op == "size":
            extent = v.extent.find() if v.extent is not None else None
            counted = info.counted_axes
            if (extent is not None and extent is not info.hidden_axis and len(info.row_axes) > 1
                    and counted != (extent,)):
                unknown.add(v)
                continue
            size = ("1LL" if extent is None else "static_cast<long long>(H)"
                    if extent is info.hidden_axis else "n_rows")
            lines.append(f"const long long {v.name} = {size};")
            env[v] = v.name
    if unknown:
        for v, count in row_counts(info.fusion, info.counted_axes).items():
            factors = " * ".join(["n_rows"] + [env[s] for s in count.others])
            lines.append(f"const long long {v.name} = {factors};")
            env[v] = v.name
    emitter = Emitter(info, env, "")
    scalars = [v for v in info.fusion.vals if info.roles[v] is Role.SCALAR and v not in env
               and not _depends_on(v, unknown, env)]
    lines += emitter.emit(scalars)
    return lines, emitter.env


def _depends_on(v: Val, values: set[Val], bound: dict[Val, str]) -> bool:
    """Whether `v` is one of `values` or computed from one, other than through a value
    already `bound` (a broadcast's shape sizes only describe it: a value per group broadcast
    to the group's rows is still read once in the prologue)."""
    stack, seen = [v], set()
    while stack:
        u = stack.pop()
        if u in values:
            return True
        if u not in seen and u.definition is not None and u not in bound:
            seen.add(u)
            stack.extend(operands(u.definition))
    return False


_DECLARED = re.compile(r"^const [\w: ]+? (\w+) = ")


def used_lines(lines: list[str], readers: list[str]) -> list[str]:
    """The declarations among `lines` that `readers` (or a kept later line) read."""
    text = "\n".join(readers)
    kept: list[str] = []
    for line in reversed(lines):
        m = _DECLARED.match(line)
        if m is None or re.search(rf"\b{m.group(1)}\b", text):
            kept.append(line)
            text += "\n" + line
    return kept[::-1]


def element_env(info: FusionInfo, scalar_env: dict[Val, str]) -> dict[Val, str]:
    """Inside a per-element loop: element i of the vectors the templates name x_<input>
    (row inputs) and c_<input> (column inputs), converted to the compute type."""
    env = dict(scalar_env)
    for t in info.full_inputs:
        env[t] = f"fm::element(x_{t.name}, i)"
    for t in info.col_inputs:
        env[t] = f"fm::element(c_{t.name}, i)"
    return env


def input_tensors(info: FusionInfo, used: set[Val]) -> tuple[list[Tensor], list[Tensor]]:
    """The row and column inputs among `used`, in definition order."""
    return ([t for t in info.full_inputs if t in used],
            [t for t in info.col_inputs if t in used])
