"""OuterSchedule + FusionInfo -> the names and statements outer_kernel.cu.j2 places.

Inside a pass over the rows, an element's operands are the thread's vector of the row
(x_<input>: from the rows kept in shared memory or a held input's registers, or read from
global memory where the kernel is streamed), the row's value of each per-row input
(row_<input>), the thread's column inputs (c_<input>), the totals of earlier levels
(r_<value>) and column values computed from them (k_<value>): a value of one column (rsqrt
of a variance, a mean) is computed once per column before the pass that needs it, not once
per element.
"""

from __future__ import annotations

import textwrap

from fuser.analysis import FusionInfo, Role
from fuser.emit import (
    Emitter,
    ctype,
    divisors,
    element_env,
    input_tensors,
    reciprocal,
    scalar_prologue,
    through_broadcasts,
    used_lines,
)
from fuser.ir import Val
from fuser.row_codegen import reduction
from fuser.schedulers.base import OuterSchedule
from fuser.schedulers.outer_folds import Fold, fold_levels
from fuser.schedulers.outer_persistent import (
    LEVEL_BARRIERS,
    ONLINE_PAIR,
    STREAMED_UNROLL,
    fold_buffer_types,
    inbox_buffer,
    lanes_buffer,
    tile_buffer,
    total_buffer,
)


class _Columns:
    """The column values known so far (C++ expressions of element i of the thread's
    columns), the reciprocals of those that elements are divided by, and the statements that
    compute more of them."""

    def __init__(self, info: FusionInfo, env: dict[Val, str]):
        self.info = info
        self.env = env  # scalars and column inputs to start with
        self.divisors = divisors(info, lambda v: info.roles[v] is Role.COL)
        # (column value, compute type) -> k_rcp_<value>[i], for the Emitters of the passes
        self.reciprocals: dict[tuple[Val, str], str] = {}

    def hoist(self, targets, elements: dict[Val, str]) -> dict:
        """Column values the element statements for `targets` read, and the reciprocals of
        those they divide by: computed here, once per column, into register arrays
        k_<value>[VEC] (k_rcp_<value>[VEC])."""
        wanted, divided = self._frontier(targets, elements)
        emitter = Emitter(self.info, self.env, "col_")
        lines = emitter.emit(wanted)
        arrays = []
        for v in wanted:
            lines.append(f"k_{v.name}[i] = {emitter.env[v]};")
            arrays.append({"name": f"k_{v.name}", "ctype": ctype(v)})
            self.env[v] = f"k_{v.name}[i]"
        for v, ct in divided:
            name, value = reciprocal("k_", v, ct, self.env[v])
            lines.append(f"{name}[i] = {value};")
            arrays.append({"name": name, "ctype": ct})
            self.reciprocals[(v, ct)] = f"{name}[i]"
        return {"lines": lines, "arrays": arrays}

    def _frontier(self, targets, elements: dict[Val, str]
                  ) -> tuple[list[Val], list[tuple[Val, str]]]:
        """The column values (not yet known) met walking from `targets` down to what is
        known, in definition order, and the (column value, compute type) of each division by
        one met on the way whose reciprocal is not computed yet."""
        found: set[Val] = set()
        divided: set[tuple[Val, str]] = set()
        seen: set[Val] = set()
        stack = list(targets)
        while stack:
            v = stack.pop()
            if v in seen or v in self.env or v in elements:
                continue
            seen.add(v)
            if self.info.roles[v] is Role.COL:
                found.add(v)
            elif (d := v.definition) is not None:
                stack.extend(d.inputs)
                divisor = through_broadcasts(d.inputs[1]) if d.op == "div" else None
                if divisor in self.divisors:
                    divided.add((divisor, d.attr("compute").compute_type))
        divided -= set(self.reciprocals)
        return (sorted(found, key=lambda v: v.index),
                sorted(divided, key=lambda p: (p[0].index, p[1])))

    def total(self, fold: Fold) -> None:
        """A fold's totals are known from here on: r_<name>[i], or a pair's two halves."""
        if fold.online_sum is None:
            self.env[fold.reduction.outputs[0]] = f"r_{fold.name}[i]"
        else:
            self.env[fold.reduction.outputs[0]] = f"r_{fold.name}[i].m"
            self.env[fold.online_sum.outputs[0]] = f"fm::online_sum(r_{fold.name}[i])"


def _reduction(levels: tuple[tuple[Fold, ...], ...], fold: Fold, value: str) -> dict:
    """row_codegen.reduction's record of the fold (for a pair: fm::OnlineSum over the max's
    float operand), with the names of its shared buffers (lanes, inbox, total)."""
    if fold.online_sum is None:
        record = reduction(fold.reduction, value)
    else:
        record = {"ctype": ONLINE_PAIR, "functor": "fm::OnlineSum", "value": value}
    return {**record, "name": fold.name, "lanes": lanes_buffer(levels, fold),
            "inbox": inbox_buffer(fold), "total": total_buffer(levels, fold)}


def _inbox_bytes(s: OuterSchedule, level: tuple[Fold, ...]) -> int:
    """Bytes a level's mbarrier waits for: its folds' inboxes, as planned (clusters)."""
    return sum(s.smem.buffer(inbox_buffer(fold)).nbytes for fold in level) if s.cluster > 1 else 0


def _cluster_steps(k: int, count: int) -> dict:
    """The split cluster barrier's halves around level k's pushes (of `count` levels): every
    block's mbarriers are ready before the first level's first push, and after the last
    level's wait nothing more will be pushed to this block (the kernel's end waits for that)."""
    return {"before_push": ["fm::cluster_wait();  // every block's mbarriers are ready for the "
                            "pushes"] if k == 0 else [],
            "after_fold": ["fm::cluster_arrive_relaxed();  // nothing more will be pushed to "
                           "this block"] if k == count - 1 else []}


def _rows_read(info: FusionInfo, emitter: Emitter, s: OuterSchedule) -> list[dict]:
    """The full inputs the emitted statements read, and how a thread reads its vector of row
    r: from the rows kept in shared memory, or (streamed) from global memory; a held input's
    first rows (j < held_rows) from its registers ("held"), the rest from its tile, which
    starts at the first row not held."""
    rows = []
    for t in input_tensors(info, emitter.used)[0]:
        if s.streamed:
            read = held = f"slab.read(g_{t.name}, r)"
        elif t.name == s.held:
            read = f"slab.at({tile_buffer(t)}, r - {s.tile_start})"
            held = f"h_{t.name}[j]"
        else:
            read = held = f"slab.at({tile_buffer(t)}, r)"
        rows.append({"name": t.name, "read": read, "held": held})
    return rows


def _row_values_read(info: FusionInfo, emitter: Emitter) -> list[dict]:
    """The per-row inputs ([rows, 1]) the emitted statements read: row r's value of each,
    read from global memory in the pass (row_<input>)."""
    return [{"name": t.name, "ctype": ctype(t)} for t in info.row_inputs if t in emitter.used]


def _stores(outputs, stored: dict[Val, str]) -> list[dict]:
    return [{"name": o.name, "ctype": o.dtype.cuda_type, "value": stored[o]} for o in outputs]


def outer_context(info: FusionInfo, s: OuterSchedule) -> dict:
    """Everything outer_kernel.cu.j2 places but the header and the signature."""
    scalar_lines, scalar_env = scalar_prologue(info)
    env = element_env(info, scalar_env)
    elements: dict[Val, str] = {t: env.pop(t) for t in info.full_inputs}
    elements.update({t: f"row_{t.name}" for t in info.row_inputs})
    columns = _Columns(info, env)
    levels: list[dict] = []
    folds = fold_levels(info)
    for k, level in enumerate(folds):
        operands = [fold.operand for fold in level]
        hoisted = columns.hoist(operands, elements)
        emitter = Emitter(info, {**columns.env, **elements}, "e_", columns.reciprocals)
        lines = emitter.emit(operands)
        words = ", ".join(fold.words() for fold in level)
        reductions = [_reduction(folds, fold, emitter.env[fold.operand]) for fold in level]
        levels.append({"title": f"Outer level {k}: {words}, over every row of the slab.",
                       "barrier": f"&{LEVEL_BARRIERS}[{k}]",
                       "inbox_bytes": _inbox_bytes(s, level),
                       **_cluster_steps(k, len(folds)),
                       "hoisted": hoisted, "rows": _rows_read(info, emitter, s),
                       "row_values": _row_values_read(info, emitter),
                       "element_lines": lines,
                       "reductions": reductions})
        for fold in level:
            columns.total(fold)
    full_outputs = info.outputs(Role.FULL)  # none where streamed (outer_persistent)
    hoisted = columns.hoist(full_outputs, elements)
    emitter = Emitter(info, {**columns.env, **elements}, "e_", columns.reciprocals)
    lines, stored = emitter.emit_stored(full_outputs)
    col_outputs = info.outputs(Role.COL)
    col_emitter = Emitter(info, columns.env, "col_")
    col_lines, col_stored = col_emitter.emit_stored(col_outputs)
    final: dict = {"hoisted": hoisted, "rows": _rows_read(info, emitter, s),
                   "row_values": _row_values_read(info, emitter), "element_lines": lines,
                   "outputs": _stores(full_outputs, stored),
                   "column_lines": col_lines,
                   "column_outputs": _stores(col_outputs, col_stored)}
    readers = [line for q in [*levels, final] for line in q["element_lines"]
               + q["hoisted"]["lines"]]
    readers += [r["value"] for q in levels for r in q["reductions"]]
    readers += [o["value"] for o in final["outputs"] + final["column_outputs"]] + col_lines
    types = _buffer_types(info, folds)
    return {
        "intro": _intro(s),
        "s": s,
        "row_unroll": STREAMED_UNROLL if s.streamed else 1,
        "tile_start": s.tile_start,
        "smem": [{"name": b.name, "offset": b.offset, "purpose": b.purpose,
                  "ctype": types[b.name]} for b in s.smem.buffers],
        "tiles": [] if s.streamed else [
            {"name": t.name, "buffer": tile_buffer(t), "ctype": t.dtype.cuda_type,
             "first": s.tile_start if t.name == s.held else 0}
            for t in info.full_inputs],
        "columns": [{"name": t.name, "ctype": t.dtype.cuda_type} for t in info.col_inputs],
        "scalar_lines": used_lines(scalar_lines, readers),
        "levels": levels,
        "final": final,
    }


def _buffer_types(info: FusionInfo, folds: tuple[tuple[Fold, ...], ...]) -> dict[str, str]:
    """The C++ type of each buffer outer_persistent plans: a tile holds its input's type; the
    fold buffers' types are the scheduler's (fold_buffer_types)."""
    types = {tile_buffer(t): t.dtype.cuda_type for t in info.full_inputs}
    types[LEVEL_BARRIERS] = "unsigned long long"
    return {**types, **fold_buffer_types(folds)}


def _intro(s: OuterSchedule) -> list[str]:
    shared = f"a cluster of {s.cluster} blocks shares each slab's rows, block k the k-th share"
    if s.streamed:
        who = shared if s.cluster > 1 else "one block reads each slab's rows"
        kept = (f"Each slab of {s.slab} columns streams its rows from global memory ({who}), "
                f"{STREAMED_UNROLL} rows' loads of a thread in flight; none are kept.")
    else:
        who = shared if s.cluster > 1 else "one block keeps each slab's rows"
        kept = (f"Each slab of {s.slab} columns is kept on chip: {who} (at most "
                f"{s.rank_rows} rows) in shared memory, copied once.")
        if s.held_rows:
            kept += (f" Of {s.held}, each thread's first {s.held_rows} rows stay in its "
                     "registers instead, read once from global memory.")
    lines = [kept,
             f"Thread (x, y) owns columns x * {s.vec} to x * {s.vec} + {s.vec - 1} of the slab "
             f"and rows y, y + {s.row_lanes}, ... of its block; each level's column totals are "
             "folded over the block's rows, then over the cluster's blocks in rank order."]
    return [part for line in lines for part in textwrap.wrap(line, 117)]
