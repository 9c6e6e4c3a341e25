"""Fusion + schedule -> CUDA source, through Jinja templates.

All decisions are made here or earlier: this module turns the fusion's expressions into C++
statements (one per value, named after the IR value) for each place a template evaluates
them (kernel prologue, once per row, per element, per column), and hands the templates
prepared lists. Templates only place what they are given. Rendering is deterministic: equal
inputs give byte-identical source, so the source itself is a sound cache key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from fuser.analysis import FusionInfo, Role
from fuser.dtypes import DataType
from fuser.errors import UnsupportedFusionError
from fuser.ir import Expr, Scalar, Tensor, Val
from fuser.ops import ELEMENTWISE, REDUCTIONS
from fuser.schedulers.base import Fill, FinalizeSchedule, PointwiseSchedule, RowSchedule, Storage


@dataclass(frozen=True)
class KernelSource:
    """A rendered CUDA module and the entry points the executor launches."""

    name: str  # the fusion's name
    source: str
    row_entry: str  # the main kernel (pointwise or row kernel)
    finalize_entry: str | None  # the column finalize kernel, when there is one


# ----- templates -----


@cache
def template_dir() -> Path:
    """templates/ of the installed wheel (package fuser.templates), else of the source tree."""
    try:
        from importlib.resources import files

        path = Path(str(files("fuser.templates")))
        if (path / "fuser_math.cuh").exists():
            return path
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parent.parent / "templates"


def _nest(code: str, width: int) -> str:
    """`code` indented by `width` more spaces, except blank lines and preprocessor lines
    (#pragma stays in column 0, as everywhere in the templates)."""
    return "".join(line if not line.strip() or line.startswith("#") else " " * width + line
                   for line in code.splitlines(keepends=True))


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["nest"] = _nest
    return env


@cache
def templates_hash() -> str:
    """Hash of every template and header: part of each kernel's header, hence its cache key."""
    digest = hashlib.sha256()
    for path in sorted(template_dir().glob("*")):
        if path.suffix in (".j2", ".cuh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


# ----- expressions -----


def _ctype(v: Val) -> str:
    return v.dtype.compute_type


def _convert(expr: str, src: str, dst: str) -> str:
    return expr if src == dst else f"static_cast<{dst}>({expr})"


def _literal(value, dtype: DataType) -> str:
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


class Emitter:
    """Writes C++ statements for values of a fusion, given C++ expressions for what is known.

    `env` maps values to expressions already available at the emission point; `emit` adds one
    `const` statement per missing value in definition order (aliases such as broadcast_in_dim
    emit nothing) and records the new names in `env`.
    """

    def __init__(self, info: FusionInfo, env: dict[Val, str], prefix: str,
                 reciprocals: dict[tuple[Val, str], str] | None = None):
        self.info = info
        self.env = dict(env)
        self.prefix = prefix
        # (row value, compute type) -> the C++ name of its reciprocal, computed once per row:
        # an element divided by it is multiplied by the reciprocal instead.
        self.reciprocals = reciprocals if reciprocals is not None else {}

    def emit(self, targets) -> list[str]:
        needed: set[Val] = set()
        stack = [t for t in targets if t not in self.env]
        while stack:
            v = stack.pop()
            if v in needed or v in self.env:
                continue
            if v.definition is None or v.definition.op in ("sum", "max"):
                raise UnsupportedFusionError(
                    f"{v.name} is needed where it is not available (internal scheduling error)"
                )
            needed.add(v)
            stack.extend(v.definition.inputs)
        lines = []
        for v in sorted(needed, key=lambda v: v.index):
            expr = self._expression(v.definition, v)
            if v.definition.op == "broadcast_in_dim" or (
                v.definition.op == "cast" and self._is_alias(v.definition)
            ):
                self.env[v] = expr
                continue
            name = f"{self.prefix}{v.name}"
            lines.append(f"const {_ctype(v)} {name} = {expr};")
            self.env[v] = name
        return lines

    @staticmethod
    def _is_alias(e: Expr) -> bool:
        src, dst = e.inputs[0].dtype, e.outputs[0].dtype
        return src is dst

    def _operand(self, v: Val, compute: str) -> str:
        return _convert(self.env[v], _ctype(v), compute)

    def _expression(self, e: Expr, v: Val) -> str:
        if e.op == "broadcast_in_dim":
            return self.env[e.inputs[0]]
        if e.op == "cast":
            src = e.inputs[0]
            x = self.env[src]
            target = e.attr("dtype")
            if target is DataType.BFloat16:
                return f"fm::round_bf16({_convert(x, _ctype(src), 'float')})"
            if target is DataType.Half:
                return f"fm::round_half({_convert(x, _ctype(src), 'float')})"
            if target is DataType.Bool and src.dtype is not DataType.Bool:
                return f"({x} != 0)"
            return _convert(x, _ctype(src), target.compute_type)
        if e.op == "size":
            raise AssertionError("sizes are bound in the kernel prologue")
        compute = e.attr("compute").compute_type
        if e.op == "where":
            args = [self.env[e.inputs[0]]] + [self._operand(i, compute) for i in e.inputs[1:]]
        elif e.op == "div" and (
                rcp := self.reciprocals.get((_through_broadcasts(e.inputs[1]), compute))):
            return f"({self._operand(e.inputs[0], compute)} * {rcp})"
        else:
            args = [self._operand(i, compute) for i in e.inputs]
        return ELEMENTWISE[e.op].cuda.format(*args)


def _through_broadcasts(v: Val) -> Val:
    """The value a chain of broadcast_in_dim aliases stands for."""
    while v.definition is not None and v.definition.op == "broadcast_in_dim":
        v = v.definition.inputs[0]
    return v


def _row_divisors(info: FusionInfo) -> dict[Val, set[str]]:
    """Row values that elements are divided by, with the compute types of those divisions.
    A division costs the H200 about ten instructions per element (IEEE div.rn with its slow
    path), a multiply one: fuser divides by such a value through its reciprocal, computed once
    per row (x * (1 / s) is within 1.5 ulp of x / s). softmax_fwd, which divides every element
    by its row's sum, is compute-bound without it."""
    out: dict[Val, set[str]] = {}
    for v in info.fusion.vals:
        d = v.definition
        if d is None or d.op != "div" or info.roles[v] is Role.ROW:
            continue
        src = _through_broadcasts(d.inputs[1])
        if info.roles.get(src) is Role.ROW:
            out.setdefault(src, set()).add(d.attr("compute").compute_type)
    return out


def _scalar_prologue(info: FusionInfo) -> tuple[list[str], dict[Val, str]]:
    """Statements for every scalar value (constants, sizes, scalar arithmetic), evaluated once."""
    env: dict[Val, str] = {}
    lines = []
    for s in info.scalar_inputs:
        env[s] = s.name
    for v in info.fusion.vals:
        if not isinstance(v, Scalar) or v in env:
            continue
        if v.definition is None:
            lines.append(f"const {_ctype(v)} {v.name} = {_literal(v.value, v.dtype)};")
            env[v] = v.name
        elif v.definition.op == "size":
            extent = v.extent.find() if v.extent is not None else None
            size = ("1LL" if extent is None else "static_cast<long long>(H)"
                    if extent is info.hidden_axis else "n_rows")
            lines.append(f"const long long {v.name} = {size};")
            env[v] = v.name
    emitter = Emitter(info, env, "")
    scalars = [v for v in info.fusion.vals if isinstance(v, Scalar) and v not in env]
    lines += emitter.emit(scalars)
    return lines, emitter.env


def _element_env(info: FusionInfo, scalar_env: dict[Val, str]) -> dict[Val, str]:
    """Inside a per-element loop: element i of the vectors the templates name x_<input>
    (row inputs) and c_<input> (column inputs), converted to the compute type."""
    env = dict(scalar_env)
    for t in info.full_inputs:
        env[t] = f"fm::to_compute(x_{t.name}.v[i])"
    for t in info.col_inputs:
        env[t] = f"fm::to_compute(c_{t.name}.v[i])"
    return env


def _param(t: Tensor, const: bool) -> str:
    qualifier = "const " if const else ""
    return f"{qualifier}{t.dtype.cuda_type}* __restrict__ g_{t.name}"


def _scalar_params(info: FusionInfo) -> list[str]:
    return [f"{s.dtype.compute_type} {s.name}" for s in info.scalar_inputs]


def _header(name: str, info: FusionInfo, schedules) -> list[str]:
    lines = [f"fuser kernel module for fusion '{name}' (templates {templates_hash()})", ""]
    lines += [*info.describe().splitlines(), ""]
    for s in schedules:
        lines += [*str(s).splitlines(), ""]
        lines += ["shared memory plan:", *s.smem.table().splitlines(), ""]
    return lines


# ----- the row kernel (inner and inner-outer persistent) -----


def _cluster_names(schedule: RowSchedule) -> dict[str, str]:
    """C++ expressions the row template uses for the vectors a block owns. Without a cluster a
    block owns whole rows; in a cluster of k blocks, each owns [jbase, jend) of every row its
    cluster works on, keeps only those vectors (NVC of them) in shared memory, and the cluster
    (not the block) owns rows and partial rows."""
    if schedule.cluster == 1:
        return {
            "J": "b * TPR + tx", "JBASE": "0", "JEND": "NV", "NVS": "NV", "JS": "j",
            "OWNER": "blockIdx.x",
            "OUTER_STRIDE": "H", "ROW_WRITER": "tx == 0",
            "ROW0": "static_cast<long long>(blockIdx.x) * RPB",
            "ROWSTEP": "static_cast<long long>(gridDim.x) * RPB",
        }
    return {
        "J": "jbase + b * TPR + tx", "JBASE": "jbase", "JEND": "jend", "NVS": "NVC",
        "JS": "(j - jbase)",
        "OWNER": "cluster", "OUTER_STRIDE": "NVC * VEC", "ROW_WRITER": "tx == 0 && rank == 0",
        "ROW0": "static_cast<long long>(cluster) * RPB",
        "ROWSTEP": "static_cast<long long>(fm::cluster_count()) * RPB",
    }


def _output_store(schedule: RowSchedule) -> str:
    """The device function that stores a vector of a full-row output. NVRTC split plain vector
    stores into element stores in blocks of several rows and in batch loops not fully
    unrolled (every such schedule of the six fusions at 1024 to 65536, fp32 and bf16; a CPU
    test on the PTX pins it), so those get fm::store_vector, one st.global by inline PTX.
    Elsewhere the plain fm::store stays whole, and leaves the compiler free to schedule: the
    inline PTX cost rmsnorm_bwd bf16 at 65536 (cluster of 2, 8 vectors per thread) 32 B of
    spills on NVRTC 13.0, and the cluster-of-4 fallback that avoided them ran 16% slower on
    the H200."""
    if schedule.rows_per_block > 1 or not schedule.full_unroll:
        return "fm::store_vector"
    return "fm::store"


def _fetch(t: Tensor, storage: str, full: bool, where: dict[str, str], aligned: bool,
           ring_slot_vectors: int) -> str:
    """C++ expression of vector j of input `t` in a pass over the row, wherever it is kept
    (`ring_slot_vectors`: vectors between the slots of its staging ring buffer)."""
    if storage == Storage.REGISTERS:
        return f"r_{t.name}[b]"
    if storage == Storage.RING:  # vector u * TPR + tx of the chunk in the slot being read
        return f"ring_{t.name}[ring_slot * {ring_slot_vectors} + u * TPR + tx]"
    if full and storage == Storage.SMEM and aligned:
        return f"s_{t.name}_row[{where['JS']}]"  # the row at its offset in its 16-byte chunks
    if full and storage == Storage.SMEM:
        return f"s_{t.name}[(stage * RPB + ty) * {where['NVS']} + {where['JS']}]"
    if full:
        return (f"(valid ? fm::load<VEC>(g_{t.name} + row * H + j * VEC) : "
                f"fm::Vec<{t.dtype.cuda_type}, VEC>{{}})")
    if storage == Storage.SMEM:
        return f"s_{t.name}[{where['JS']}]"
    return f"fm::load<VEC>(g_{t.name} + j * VEC)"


def _reduction_entry(e: Expr, var: str, value: str) -> dict:
    op = REDUCTIONS[e.op]
    ct = _ctype(e.outputs[0])
    return {
        "var": var,
        "ctype": ct,
        "identity": op.identity.format(t=ct),
        "functor": f"{op.functor}{{}}",
        "value": _convert(value, _ctype(e.inputs[0]), ct),
    }


def render_row(
    name: str, info: FusionInfo, schedule: RowSchedule, finalize: FinalizeSchedule | None
) -> KernelSource:
    fusion = info.fusion
    roles = info.roles
    scalar_lines, scalar_env = _scalar_prologue(info)
    where = _cluster_names(schedule)

    def buffer(t: Tensor) -> dict:
        p = schedule.placement(t.name)
        aligned = schedule.aligned_copy and p.role is Role.FULL and p.storage == Storage.SMEM
        # Aligned copies: one row slot of the planned buffer (stages x rows slots), in bytes.
        slot = (schedule.smem.buffer(f"s_{t.name}").nbytes
                // (schedule.stages * schedule.rows_per_block) if aligned else 0)
        ring = schedule.ring
        # Bytes between a ring buffer's slots (each 128-byte aligned), and in vectors.
        ring_slot = (schedule.smem.buffer(f"s_ring_{t.name}").nbytes // ring.depth
                     if p.storage == Storage.RING else 0)
        ring_vectors = ring_slot // (schedule.vec * t.dtype.itemsize)
        return {
            "name": t.name,
            "ctype": t.dtype.cuda_type,
            "smem": p.storage == Storage.SMEM,
            "reread": p.storage in (Storage.GLOBAL, Storage.RING),
            "ring": p.storage == Storage.RING,
            "async": p.async_copy,
            "offset": (schedule.smem.offset(f"s_{t.name}") if p.storage == Storage.SMEM
                       else schedule.smem.offset(f"s_ring_{t.name}") if p.storage == Storage.RING
                       else 0),
            "ring_vectors": ring_vectors,
            "fetch": _fetch(t, p.storage, p.role is Role.FULL, where, aligned, ring_vectors),
            "slot": slot,
            "rounds": -(-(slot // 16) // schedule.threads_per_row),  # chunks per thread
        }

    full = [buffer(t) for t in info.full_inputs]
    ring = None
    if schedule.ring is not None:
        ring = {
            "ring": schedule.ring,
            "bulk": schedule.ring.fill == Fill.BULK,
            "tensors": [b for b in full if b["ring"]],
            # Bytes of one vector of every ring buffer: a chunk's mbarrier counts vectors x this.
            "vector_bytes": " + ".join(f"sizeof({b['ctype']})" for b in full if b["ring"]),
            "barriers": (schedule.smem.offset("s_ring_full") if schedule.ring.fill == Fill.BULK
                         else None),
        }
    cols = [buffer(t) for t in info.col_inputs]
    element_env = _element_env(info, scalar_env)

    # Row values: row inputs, inner reduction results, and what is computed from them alone.
    row_env = dict(scalar_env)
    for t in info.row_inputs:
        row_env[t] = f"row_{t.name}"
    row_values = [v for v in fusion.vals if roles[v] is Role.ROW and v.definition is not None
                  and v.definition.op not in ("sum", "max")]

    divisors = _row_divisors(info)
    reciprocals: dict[tuple[Val, str], str] = {}

    def row_lines(level: int) -> list[str]:
        """The row values of `level`, then the reciprocal of each divisor now known."""
        emitter = Emitter(info, row_env, "row_")
        ready = [v for v in row_values if info.level[v] == level and v not in row_env]
        lines = emitter.emit(ready)
        row_env.update(emitter.env)
        for v, computes in divisors.items():
            for ct in sorted(computes):
                if v in row_env and (v, ct) not in reciprocals:
                    name = f"row_rcp{'_d' if ct == 'double' else ''}_{v.name}"
                    lines.append(f"const {ct} {name} = {ct}(1) / "
                                 f"{_convert(row_env[v], _ctype(v), ct)};")
                    reciprocals[(v, ct)] = name
        return lines

    levels = []
    start_lines = row_lines(0)
    for k, level in enumerate(info.inner_levels):
        emitter = Emitter(info, {**element_env, **row_env}, "e_", reciprocals)
        element_lines = emitter.emit([e.inputs[0] for e in level])
        reductions = [
            _reduction_entry(e, f"row_{e.outputs[0].name}", emitter.env[e.inputs[0]])
            for e in level
        ]
        for e in level:
            row_env[e.outputs[0]] = f"row_{e.outputs[0].name}"
        levels.append({"element_lines": element_lines, "reductions": reductions,
                       "after_lines": row_lines(k + 1)})

    # The final phase: full outputs and the values accumulated by outer reductions.
    full_outputs = info.outputs(Role.FULL)
    emitter = Emitter(info, {**element_env, **row_env}, "e_", reciprocals)
    final_lines = emitter.emit([*full_outputs, *(e.inputs[0] for e in info.outer_reductions)])
    outputs = [{"name": o.name, "ctype": o.dtype.cuda_type, "value": emitter.env[o]}
               for o in full_outputs]
    in_smem = schedule.accumulators == Storage.SMEM
    refs = {  # element i of vector j of this thread's accumulator, wherever it lives
        Storage.REGISTERS: "acc_{0}[b][i]",
        Storage.SMEM: f"s_acc_{{0}}[(ty * {where['NVS']} + {where['JS']}) * VEC + i]",
        Storage.GLOBAL: f"g_part_{{0}}[(static_cast<long long>({where['OWNER']}) * RPB + ty) * H + "
                "j * VEC + i]",
    }
    accumulators = [
        {**_reduction_entry(e, f"acc_{e.outputs[0].name}", emitter.env[e.inputs[0]]),
         "name": e.outputs[0].name,
         "offset": schedule.smem.offset(f"s_acc_{e.outputs[0].name}") if in_smem else None,
         "ref": refs[schedule.accumulators].format(e.outputs[0].name)}
        for e in info.outer_reductions
    ]
    row_outputs = [{"name": o.name, "ctype": o.dtype.cuda_type, "value": row_env[o]}
                   for o in info.outputs(Role.ROW)]

    params = ([_param(t, True) for t in (*info.full_inputs, *info.col_inputs, *info.row_inputs)]
              + [_param(o, False) for o in (*full_outputs, *info.outputs(Role.ROW))]
              + [f"{a['ctype']}* __restrict__ g_part_{a['name']}" for a in accumulators]
              + _scalar_params(info))
    entry = f"{name}_row"
    context = {
        "header": _header(name, info, [schedule] + ([finalize] if finalize else [])),
        "entry": entry,
        "params": params,
        "s": schedule,
        "nv": schedule.hidden // schedule.vec,
        # Whether every vector a thread visits lies in its block's range (no bound check).
        "in_range": ("true" if schedule.batch * schedule.threads_per_row * schedule.vec
                     * schedule.cluster == schedule.hidden else f"j < {where['JEND']}"),
        "nvc": -(-schedule.hidden // schedule.vec // schedule.cluster),
        "cluster_dims": (f"__cluster_dims__({schedule.cluster}, 1, 1) "
                         if schedule.cluster > 1 else ""),
        "smem_cluster": (schedule.smem.offset("s_cluster") if "s_cluster" in schedule.smem
                         else None),
        **where,
        # Structural choices the template makes, decided here.
        "clustered": schedule.cluster > 1,
        "finalized": finalize is not None,  # a finalize kernel follows: let it launch early
        "pipelined": schedule.stages == 2,  # the next rows load while this one computes
        "aligned_copy": schedule.aligned_copy,  # 16-byte chunks from below each row's start
        "store": _output_store(schedule),
        "pending_copies": 1 if schedule.stages == 2 else 0,  # cp.async groups left in flight
        "cross_warp": schedule.threads_per_row > 32,  # a row spans warps: reduce through smem
        "fold_rows": schedule.rows_per_block > 1,  # fold the block's rows' accumulators
        "smem_reduce": schedule.smem.offset("s_reduce") if "s_reduce" in schedule.smem else None,
        "smem_outer": schedule.smem.offset("s_outer") if "s_outer" in schedule.smem else None,
        "width": max((len(lv) for lv in info.inner_levels), default=0),
        "scalar_lines": scalar_lines,
        "full": full,
        "ring": ring,  # the staging ring of the re-read row buffers, or None
        "async_full": [b for b in full if b["async"]],
        "copied_full": [b for b in full if b["smem"] and not b["async"]],
        "registers_full": [b for b in full if not b["smem"] and not b["reread"]],
        "cols": cols,
        "row_inputs": [{"name": t.name, "ctype": _ctype(t)} for t in info.row_inputs],
        "start_lines": start_lines,
        "levels": levels,
        "final_lines": final_lines,
        "outputs": outputs,
        "row_outputs": row_outputs,
        "accumulators": accumulators,
        "acc_storage": schedule.accumulators,
    }
    source = _environment().get_template("row_kernel.cu.j2").render(context)
    finalize_entry = None
    if finalize is not None:
        finalize_entry = f"{name}_finalize"
        source += _render_finalize(finalize_entry, info, finalize, scalar_lines, scalar_env,
                                   accumulators)
    return KernelSource(name, source, entry, finalize_entry)


def _render_finalize(entry, info, schedule, scalar_lines, scalar_env, accumulators) -> str:
    env = dict(scalar_env)
    for e in info.outer_reductions:
        env[e.outputs[0]] = f"tot_{e.outputs[0].name}"
    for t in info.col_inputs:
        env[t] = f"fm::to_compute(g_{t.name}[col])"
    col_outputs = info.outputs(Role.COL)
    emitter = Emitter(info, env, "c_")
    lines = emitter.emit(col_outputs)
    params = ([f"const {a['ctype']}* __restrict__ g_part_{a['name']}" for a in accumulators]
              + [_param(t, True) for t in info.col_inputs]
              + [_param(o, False) for o in col_outputs]
              + _scalar_params(info))
    context = {
        "entry": entry,
        "params": params,
        "f": schedule,
        "smem_lanes": schedule.smem.offset("s_lanes") if accumulators else None,
        "accumulators": accumulators,
        "scalar_lines": scalar_lines,
        "lines": lines,
        "outputs": [{"name": o.name, "ctype": o.dtype.cuda_type, "value": emitter.env[o]}
                    for o in col_outputs],
    }
    return _environment().get_template("finalize.cu.j2").render(context)


# ----- the pointwise kernel -----


def render_pointwise(name: str, info: FusionInfo, schedule: PointwiseSchedule) -> KernelSource:
    scalar_lines, scalar_env = _scalar_prologue(info)
    env = _element_env(info, scalar_env)
    row_lines_env = dict(scalar_env)
    for t in info.row_inputs:
        env[t] = row_lines_env[t] = f"row_{t.name}"
    outs = {r: info.outputs(r) for r in (Role.FULL, Role.ROW, Role.COL)}
    row_emitter = Emitter(info, row_lines_env, "row_")
    row_lines = row_emitter.emit(outs[Role.ROW])
    env.update(row_emitter.env)
    emitter = Emitter(info, env, "e_")
    element_lines = emitter.emit([*outs[Role.FULL], *outs[Role.COL]])
    entry = f"{name}_pointwise"
    params = ([_param(t, True) for t in (*info.full_inputs, *info.col_inputs, *info.row_inputs)]
              + [_param(o, False) for r in (Role.FULL, Role.COL, Role.ROW) for o in outs[r]]
              + _scalar_params(info))

    def described(ts, env_):
        return [{"name": o.name, "ctype": o.dtype.cuda_type, "value": env_[o]} for o in ts]

    context = {
        "header": _header(name, info, [schedule]),
        "entry": entry,
        "params": params,
        "s": schedule,
        "nv": schedule.hidden // schedule.vec,
        "scalar_lines": scalar_lines,
        "full": [{"name": t.name, "ctype": t.dtype.cuda_type} for t in info.full_inputs],
        "cols": [{"name": t.name, "ctype": t.dtype.cuda_type} for t in info.col_inputs],
        "row_inputs": [{"name": t.name, "ctype": _ctype(t)} for t in info.row_inputs],
        "row_lines": row_lines,
        "element_lines": element_lines,
        "full_outputs": described(outs[Role.FULL], emitter.env),
        "col_outputs": described(outs[Role.COL], emitter.env),
        "row_outputs": described(outs[Role.ROW], row_emitter.env),
    }
    source = _environment().get_template("pointwise.cu.j2").render(context)
    return KernelSource(name, source, entry, None)
