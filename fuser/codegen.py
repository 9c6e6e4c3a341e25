"""Fusion + schedule -> CUDA source, through Jinja templates.

Every decision is made here or earlier: the emitter (emit.py) turns the fusion's values into
C++ statements (one per value, named after the IR value), row_codegen.py turns a RowSchedule
into objects of the device library and the lists of what acts when, and the templates only
place names, numbers and those statements. Rendering is deterministic: equal inputs give
byte-identical source, so the source itself is a sound cache key.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import textwrap
from functools import cache

import jinja2

from fuser.analysis import FusionInfo, Role
from fuser.compile import template_dir
from fuser.emit import Emitter, ctype, element_env, scalar_prologue, used_lines
from fuser.ir import Tensor
from fuser.ops import REDUCTIONS
from fuser.outer_codegen import outer_context
from fuser.row_codegen import repeat_lines, row_access, row_context, rows_of
from fuser.schedulers.base import (
    Dealing,
    FinalizeSchedule,
    OuterSchedule,
    PointwiseSchedule,
    RowSchedule,
)
from fuser.schedulers.finalize import lanes_buffers, total_type
from fuser.signature import (
    KernelSource,
    Param,
    Signature,
    Source,
    accumulator_type,
    finalize_signature,
    pointwise_signature,
    row_signature,
)

MAX_LINE = 120  # characters per line of generated source


# ----- templates -----


class _TemplateBytecode(jinja2.FileSystemBytecodeCache):
    """The templates compiled to Python, kept beside the kernel cache (templates/ in its
    folder): a fresh process renders its first kernel without compiling them again, which
    was 65 ms of a first call whose kernel the disk cache already held. Jinja keys each file
    by the template's name and checks its source's checksum and its own version on load. A
    folder that cannot be written or a damaged file only means compiling as before."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # unreadable or damaged (pickle, marshal): compile afresh
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        with contextlib.suppress(OSError):
            super().dump_bytecode(bucket)


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    from fuser.cache import default_cache_dir

    folder = os.path.join(default_cache_dir(), "templates")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # no disk cache here (read-only, FUSER_CACHE_DIR names a file...)
        return None
    return _TemplateBytecode(folder)


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=_bytecode_cache(),
    )


@cache
def templates_hash() -> str:
    """Hash of every template and header: part of each kernel's header, hence its cache key."""
    digest = hashlib.sha256()
    for path in sorted(template_dir().glob("*")):
        if path.suffix in (".j2", ".cuh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _wrapped(lines: list[str]) -> list[str]:
    """Header lines of at most MAX_LINE - 3 characters (they become `// line`), continued
    lines indented."""
    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out += textwrap.wrap(line, MAX_LINE - 3, subsequent_indent=indent,
                             break_on_hyphens=False) or [""]
    return out


def _header(name: str, info: FusionInfo, schedules) -> list[str]:
    lines = [f"fuser kernel module for fusion '{name}' (templates {templates_hash()})", "",
             "The fusion, lowered to primitives (Python that rebuilds it):",
             *info.fusion.python_definition().rstrip().splitlines(), "",
             *info.describe().splitlines(), ""]
    for s in schedules:
        lines += [*str(s).splitlines(), ""]
        lines += ["shared memory plan:", *s.smem.table().splitlines(), ""]
    return _wrapped(lines[:-1])


def render_template(template: str, context: dict) -> str:
    """`template` (a file of templates/) rendered with `context`."""
    return _environment().get_template(template).render(context)


# ----- groups (FusionInfo.group_axes): a grid row of blocks per group -----

GROUP = ("// This block's group of rows (a grid row per group): the pointers move to its part.",
         "const long long group = blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z;",
         "if (group >= n_groups) return;  // a grid row past the groups (split over z)")
_GROUP_SIZES = {"rows": "n_rows", "hidden": "H"}


def group_lines(info: FusionInfo, params: tuple[Param, ...]) -> list[str]:
    """With groups, a kernel's first statements: its group (the grid row it runs in) and
    each of its parameters (`params`, its Signature's) that holds a part per group moved to
    the group's part (FusionInfo.group_part: n_rows x H of a tensor of every row, n_rows of
    a per-row one, H of columns per group, one value per group; a workspace's partial_rows x
    H). The rest of the kernel works on one group's rows as on a fusion's, and its prologue
    reads a value per group after the move."""
    if not info.group_axes:
        return []
    moves = []
    for p in params:
        if p.source is Source.PARTIALS:
            moves.append(f"{p.name} += group * partial_rows * H;")
        elif p.source in (Source.INPUT, Source.OUTPUT) and p.dtype is None:  # a tensor
            t = (info.fusion.inputs if p.source is Source.INPUT else info.fusion.outputs)[p.index]
            part = info.group_part(t) if isinstance(t, Tensor) else None
            if part is not None:
                sizes = " * ".join(["group", *(_GROUP_SIZES[a] for a in part)])
                moves.append(f"{p.name} += {sizes};")
    return [*GROUP, *moves]


# ----- the row kernel (inner and inner-outer persistent) -----


def render_row(name: str, info: FusionInfo, schedule: RowSchedule,
               finalize: FinalizeSchedule | None) -> KernelSource:
    fused = finalize is not None and finalize.fused
    row = row_signature(info, f"{name}_row", schedule.dealing is Dealing.DYNAMIC, fused)
    context = row_context(info, schedule, finalize)
    context.update(header=_header(name, info, [schedule] + ([finalize] if finalize else [])),
                   entry=row.entry, params=row.params, group_lines=group_lines(info, row.params),
                   fused=_totals(info, finalize, context["scalar_env"],
                                 declared=context["scalar_lines"])
                   if finalize is not None and fused else None)
    source = render_template("row_kernel.cu.j2", context)
    signatures: tuple[Signature, ...] = (row,)
    if finalize is not None and not fused:
        final = finalize_signature(info, f"{name}_finalize")
        source += render_template("finalize.cu.j2", {
            "entry": final.entry, "params": final.params,
            "group_lines": group_lines(info, final.params),
            "t": _totals(info, finalize, context["scalar_env"])})
        signatures = (row, final)
    return KernelSource(name, source, signatures)


def _totals(info: FusionInfo, schedule: FinalizeSchedule, scalar_env: dict,
            declared=()) -> dict:
    """What templates/column_totals.j2 places: the accumulators with their lanes' buffers,
    the column epilogue's lines (less the scalar lines `declared` in the kernel already) and
    the column outputs."""
    env = dict(scalar_env)
    for e in info.outer_reductions:
        env[e.outputs[0]] = f"tot_{e.outputs[0].name}"
    for t in info.col_inputs:
        env[t] = f"fm::to_compute(g_{t.name}[col])"
    col_outputs = info.outputs(Role.COL)
    emitter = Emitter(info, env, "c_")
    lines, stored = emitter.emit_stored(col_outputs)
    outputs = [{"name": o.name, "ctype": o.dtype.cuda_type, "value": stored[o]}
               for o in col_outputs]
    scalar_lines, _ = scalar_prologue(info)
    lanes = {b.name: b for b in schedule.smem.buffers}
    return {
        "f": schedule,
        # partial rows a lane loads in a round before adding them, or None: one at a time
        "rounds": schedule.unroll if schedule.unroll > 1 else None,
        "accumulators": [{"name": e.outputs[0].name, "functor": REDUCTIONS[e.op].functor,
                          "ctype": accumulator_type(e.outputs[0].dtype),
                          "total": total_type(e.outputs[0].dtype),
                          "lanes": lanes[buffer],
                          # a partial row's value: in a fused finalize written by other blocks
                          # of this grid, so read from L2 (fuser_row_columns.cuh, from_l2)
                          "partial": (f"fm::from_l2(g_part_{e.outputs[0].name} + at)"
                                      if schedule.fused else f"g_part_{e.outputs[0].name}[at]")}
                         for buffer, e in zip(lanes_buffers(info), info.outer_reductions,
                                              strict=True)],
        "scalar_lines": [line for line in used_lines(scalar_lines,
                                                     lines + [o["value"] for o in outputs])
                         if line not in declared],
        "lines": lines,
        "outputs": outputs,
    }


# ----- the outer-persistent kernel -----


def render_outer(name: str, info: FusionInfo, schedule: OuterSchedule) -> KernelSource:
    signature = pointwise_signature(info, f"{name}_outer")
    context = outer_context(info, schedule)
    context.update(header=_header(name, info, [schedule]), entry=signature.entry,
                   params=signature.params, group_lines=group_lines(info, signature.params))
    return KernelSource(name, render_template("outer_kernel.cu.j2", context), (signature,))


# ----- the pointwise kernel -----


def render_pointwise(name: str, info: FusionInfo, schedule: PointwiseSchedule) -> KernelSource:
    scalar_lines, scalar_env = scalar_prologue(info)
    env = element_env(info, scalar_env)
    row_env = dict(scalar_env)
    for t in info.row_inputs:
        env[t] = row_env[t] = f"row_{t.name}"
    outs = {r: info.outputs(r) for r in (Role.FULL, Role.ROW, Role.COL)}
    row_emitter = Emitter(info, row_env, "row_")
    row_lines = row_emitter.emit(outs[Role.ROW])
    env.update(row_emitter.env)
    emitter = Emitter(info, env, "e_")
    element_lines, stored = emitter.emit_stored([*outs[Role.FULL], *outs[Role.COL]])
    signature = pointwise_signature(info, f"{name}_pointwise")

    def described(ts, values):
        return [{"name": o.name, "ctype": o.dtype.cuda_type, "value": values[o]} for o in ts]

    readers = (row_lines + element_lines + [row_emitter.env[o] for o in outs[Role.ROW]]
               + list(stored.values()))
    context = {
        "header": _header(name, info, [schedule]),
        "entry": signature.entry,
        "params": signature.params,
        "s": schedule,
        "nv": schedule.hidden // schedule.vec,
        "scalar_lines": used_lines(scalar_lines, readers),
        "full": [{"name": t.name, "ctype": t.dtype.cuda_type} for t in info.full_inputs],
        "cols": [{"name": t.name, "ctype": t.dtype.cuda_type} for t in info.col_inputs],
        "row_inputs": [_row_read(t, info, schedule.across_rows) for t in info.row_inputs],
        "access": row_access(info),
        "repeat_lines": repeat_lines(info),
        "row_lines": row_lines,
        "element_lines": element_lines,
        "full_outputs": described(outs[Role.FULL], stored),
        "col_outputs": described(outs[Role.COL], stored),
        "row_outputs": described(outs[Role.ROW], row_emitter.env),
    }
    return KernelSource(name, render_template("pointwise.cu.j2", context), (signature,))


def _row_read(t: Tensor, info: FusionInfo, across_rows: bool) -> dict:
    """How the pointwise kernel reads per-row input `t` for its row `row`: the expression
    (`read`), and where vectors cross rows the walk through a repeated input's rows that it
    declares at a vector's first row (`walk`) and steps at each row after (`advance`)."""
    rows = rows_of(t, info)
    walked = across_rows and bool(rows)
    index = f"w_{t.name}.source" if walked else row_access(info)[t.name].row("row")
    return {"name": t.name, "ctype": ctype(t), "read": f"fm::to_compute(g_{t.name}[{index}])",
            "walk": [f"fm::RepeatedRowWalk w_{t.name}({rows}, row);"] if walked else [],
            "advance": [f"w_{t.name}.next();"] if walked else []}
