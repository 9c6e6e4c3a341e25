"""The row kernel's template context: a RowSchedule turned into names and numbers.

Each buffer becomes an object of a row-library class (templates/fuser_row*.cuh) chosen here
from its storage (row buffers: RowInRegisters, RowInSmem, RowInGlobal, RowInRing; columns:
ColumnIn*; column reductions: AccumulatorIn*), declared with its type and constructor
arguments; the lists of which objects copy, wait and point at the row at each step of a row
are decided here too.
The passes over a row (one per inner reduction level, then the outputs) get their C++
statements from the emitter, with the buffers each pass reads.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from fuser.analysis import FusionInfo, Role, per_row
from fuser.emit import (
    Emitter,
    convert,
    ctype,
    divisors,
    element_env,
    input_tensors,
    reciprocal,
    scalar_prologue,
    used_lines,
)
from fuser.ir import Expr, Tensor, Val
from fuser.ops import REDUCTIONS
from fuser.schedulers import row_dealing
from fuser.schedulers.base import (
    Dealing,
    Fill,
    FinalizeSchedule,
    RowSchedule,
    Storage,
    skewed_column_pad,
)
from fuser.schedulers.finalize import lanes_buffers
from fuser.schedulers.row_variance import (
    ShiftedVariance,
    pass_levels,
    row_passes,
    shifted_variance,
)
from fuser.signature import accumulator_type

COPY = {True: "fm::Copy::CHUNKS", False: "fm::Copy::VECTORS"}


@dataclass
class Declaration:
    """One object of the kernel: `type name(args...);`, with comment lines above it."""

    type: str
    name: str
    args: list[str]
    comment: list[str] = field(default_factory=list)


def variance_of(info: FusionInfo, s: RowSchedule) -> ShiftedVariance | None:
    """The variance whose two levels the schedule runs as one pass, or None."""
    return shifted_variance(info) if s.shifted_variance else None


def _smem(schedule: RowSchedule, name: str) -> str:
    """The pointer to planned shared buffer `name`, or nullptr where the plan has none."""
    return name if name in schedule.smem else "nullptr"


def repeat_lines(info: FusionInfo) -> list[str]:
    """The declaration of each repeated input's fm::RepeatedRows (analysis.RowRun), from its
    two parameters (signature.Source.ROW_REPEATS): the row of it each kernel row reads."""
    return [f"const fm::RepeatedRows {rows_of(t, info)}{{r_{t.name}_after, r_{t.name}_count}};"
            f"  // the row of {t.name} each row reads ({t.name} repeats along other row axes)"
            for t, _ in info.repeated]


def rows_of(t: Tensor, info: FusionInfo) -> str:
    """The name of input `t`'s fm::RepeatedRows, or "" where it spans every row axis."""
    return f"r_{t.name}" if t in dict(info.repeated) else ""


@dataclass(frozen=True)
class RowAccess:
    """How the kernel hands a row buffer the row it reads for a kernel row: the row itself
    and n_rows, or for a repeated input the row its fm::RepeatedRows names and its count of
    rows, the copy guarded by the kernel row (the buffer checks the row it is given against
    the rows it is given). The row library's code is the same for both."""

    rows: str  # the input's fm::RepeatedRows, or "" (rows_of)

    def row(self, r: str) -> str:
        return f"{self.rows}.source_row({r})" if self.rows else r

    def bound(self) -> str:
        return f"{self.rows}.count" if self.rows else "n_rows"

    def guard(self, r: str) -> str:
        return f"if ({r} < n_rows) " if self.rows else ""

    def chunk(self) -> str:
        """The ring chunk its fill takes (fm::repeated: the chunk of its own row)."""
        return f"fm::repeated({self.rows}, chunk)" if self.rows else "chunk"


def row_access(info: FusionInfo) -> dict[str, RowAccess]:
    """The RowAccess of every full and per-row input, by name."""
    return {t.name: RowAccess(rows_of(t, info)) for t in (*info.full_inputs, *info.row_inputs)}


def row_buffer(t: Tensor, s: RowSchedule, info: FusionInfo) -> Declaration:
    """The object of row input `t`, wherever the schedule keeps it."""
    p = s.placement(t.name)
    vector = t.dtype.cuda_type
    if p.storage is Storage.SMEM:
        slot = s.smem.buffer(f"s_{t.name}").nbytes // (s.stages * s.rows_per_block)
        copy = COPY[s.aligned_copy] if p.async_copy else "fm::Copy::REGISTERS"
        return Declaration(f"fm::RowInSmem<{vector}, Part, {copy}, {slot}>", t.name,
                           [f"s_{t.name}", f"g_{t.name}"])
    if p.storage is Storage.RING:
        ring = s.ring
        assert ring is not None
        slot_vectors = s.smem.buffer(f"s_ring_{t.name}").nbytes // ring.depth // (
            s.vec * t.dtype.itemsize)
        bulk = str(ring.fill is Fill.BULK).lower()
        return Declaration(f"fm::RowInRing<{vector}, Part, {bulk}, {slot_vectors}>", t.name,
                           [f"s_ring_{t.name}", f"g_{t.name}"])
    if p.storage is Storage.GLOBAL:
        return Declaration(f"fm::RowInGlobal<{vector}, Part>", t.name, [f"g_{t.name}"])
    return Declaration(f"fm::RowInRegisters<{vector}, Part>", t.name,
                       ["part", f"g_{t.name}", RowAccess(rows_of(t, info)).row("row"), "valid"])


def _column(t: Tensor, s: RowSchedule) -> Declaration:
    storage = s.placement(t.name).storage
    vector = t.dtype.cuda_type
    if storage is Storage.SMEM and s.columns_at_skew:
        return Declaration(f"fm::ColumnAtSkew<{vector}, Part>", t.name,
                           ["part", f"s_{t.name}", f"g_{t.name}"])
    if storage is Storage.SMEM:
        pad = f", {skewed_column_pad(t.dtype.itemsize, s.skew)}" if s.skew else ""
        return Declaration(f"fm::ColumnInSmem<{vector}, Part{pad}>", t.name,
                           ["part", f"s_{t.name}", f"g_{t.name}"])
    if storage is Storage.GLOBAL:
        return Declaration(f"fm::ColumnInGlobal<{vector}, Part>", t.name, [f"g_{t.name}"])
    return Declaration(f"fm::ColumnInRegisters<{vector}, Part>", t.name, ["part", f"g_{t.name}"])


def _accumulator(e: Expr, s: RowSchedule) -> Declaration:
    name = e.outputs[0].name
    kind = {Storage.REGISTERS: "Registers", Storage.SMEM: "Smem",
            Storage.GLOBAL: "Global"}[s.accumulators]
    args = ["part", f"g_part_{name}"]
    if s.accumulators is Storage.REGISTERS:
        args.append(_smem(s, f"s_outer_{name}"))
    elif s.accumulators is Storage.SMEM:
        args.append(f"s_acc_{name}")
    return Declaration(
        f"fm::AccumulatorIn{kind}<{accumulator_type(e.outputs[0].dtype)}, "
        f"{REDUCTIONS[e.op].functor}, Part>", f"acc_{name}", args,
        [f"column reduction {e.op}({e.inputs[0].name}) -> {name}, in {s.accumulators}"])


def block_objects(info: FusionInfo, s: RowSchedule, fold: ShiftedVariance | None
                  ) -> list[Declaration]:
    """The objects a block declares once: columns, accumulators, the reducer (of the widest
    pass's reductions, `fold`'s two levels as one), the ring and the row buffers that are not
    registers (those are declared per row)."""
    objects = [_column(t, s) for t in info.col_inputs]
    objects += [_accumulator(e, s) for e in info.outer_reductions]
    if info.inner_levels:
        levels = pass_levels(info, fold)
        width = max(len(level) for level in levels)
        red_type = max((ctype(e.outputs[0]) for level in levels for e in level),
                       key=lambda t: (_bytes(t), t != "bool"))
        objects.append(Declaration(
            f"fm::RowReducer<{red_type}, Part, {width}>", "reduce",
            [_smem(s, "s_reduce"), _smem(s, "s_cluster")],
            ["the row reductions: warps, then the row's warps, then the cluster's blocks"]))
    if s.ring is not None:
        r = s.ring
        bytes_per_vector = s.vec * sum(t.dtype.itemsize for t in info.full_inputs
                                       if t.name in r.tensors)
        objects.append(Declaration(
            f"fm::StagingRing<Part, {str(r.fill is Fill.BULK).lower()}, {r.depth}, {r.units}, "
            f"{r.chunks}, {r.passes}, {bytes_per_vector}>", "ring",
            [_smem(s, "s_ring_full"), "part"], textwrap.wrap(f"staging ring: {r}", 96)))
    objects += [row_buffer(t, s, info) for t in info.full_inputs
                if s.placement(t.name).storage is not Storage.REGISTERS]
    return objects


def copies(info: FusionInfo, s: RowSchedule) -> dict:
    """Which shared row buffers are copied by cp.async (staged) or through registers
    (copied), whether a barrier guards their slots (aligned chunks are read by every thread
    of the row), and how many cp.async groups a row may leave in flight (the next row's)."""
    in_smem = [s.placement(t.name) for t in info.full_inputs]
    return {
        "staged": [p.tensor for p in in_smem if p.storage is Storage.SMEM and p.async_copy],
        "copied": [p.tensor for p in in_smem if p.storage is Storage.SMEM and not p.async_copy],
        "barrier": s.aligned_copy,
        "pending": s.stages - 1,  # the rows ahead, each in a cp.async group of its own
        "guard": "",  # before each row's copies: "if (it == 0) " where later rows are refilled
    }


def refill(info: FusionInfo, s: RowSchedule, fold: ShiftedVariance | None) -> list[str]:
    """The row buffers a row's last pass refills with the next row as it reads them (none:
    []): rows dealt from a counter where row_dealing.refills() says they can be, over the
    passes the kernel runs (`fold`: variance_of, its two levels as one). With one
    stage, the next row's copies would otherwise start only after the last pass; refilled,
    they overlap it. H200 bf16, fraction of the copy: layernorm_fwd 8192 0.74 -> 0.93,
    rmsnorm_fwd 65536 0.86 -> 0.97, log_softmax_fwd 65536 0.71 -> 0.88, softmax_bwd 32768 0.83
    -> 1.01, softmax_fwd 65536 0.91 -> 0.88; rows at fixed strides lost (rmsnorm_bwd 8192 0.92
    -> 0.80, softmax_fwd 131072 0.88 -> 0.83) and are not refilled: bench/TUNING.md, "refilled
    rows"."""
    staged = copies(info, s)["staged"]
    passes = row_passes(info, fold)
    if s.dealing is not Dealing.DYNAMIC or not row_dealing.refills(
            info, passes, s.stages, s.aligned_copy, bool(staged), s.ring, s.threads_per_row,
            s.skew):
        return []
    return staged


def _refilled(body: dict, copied: dict, buffers: list[str], access: dict[str, RowAccess]
              ) -> None:
    """Place the refills of `buffers` (refill()): the first row's copies only, and in the last
    pass the next row's name, each vector's copy after its reads, the copies' commit after."""
    if not buffers:
        return
    copied["guard"] = "if (it == 0) "
    last = body["passes"][-1]
    last["opening_lines"] = [
        "const long long next = rows.dealt(it) + part.ty + zero;  // refilling the row slots",
        *last["opening_lines"]]
    last["vector_lines"] = [
        f"{access[b].guard('next')}{b}.refill(v, {f'x_{b}' if b in last['rows'] else '{}'}, "
        f"slot, {access[b].row('next')}, {access[b].bound()});"
        for b in buffers]
    last["after_lines"] = ["fm::cp_async_commit();  // the next row's copies", *last["after_lines"]]


def reduction(e: Expr, value: str) -> dict:
    """One inner reduction of a pass: its row variable, type, functor, and the element value
    it folds in, converted to the reduction's type (an Int32 sum accumulates in Int64)."""
    out = e.outputs[0]
    return {"var": f"row_{out.name}", "ctype": ctype(out), "functor": REDUCTIONS[e.op].functor,
            "value": convert(value, ctype(e.inputs[0]), ctype(out))}


def _bytes(type_name: str) -> int:
    """Bytes of a reduction's partial of this C++ type in the reducer's slots (1-byte bools
    take 4)."""
    return 8 if type_name in ("double", "long long") else 4


class Passes:
    """The statements of each pass over a row, and the per-row values between them. A value
    in `kept` is stored to its register array by the pass that first computes it, and later
    passes read it there (its element of the thread's vector v.b)."""

    def __init__(self, info: FusionInfo, scalar_env: dict[Val, str], kept: tuple[Val, ...]):
        self.info = info
        self.kept = kept
        self.kept_env: dict[Val, str] = {}
        self.rows = per_row(info)
        self.row_env = dict(scalar_env)
        for t in info.row_inputs:
            self.row_env[t] = f"row_{t.name}"
        self.elements = element_env(info, scalar_env)
        rows = self.rows
        self.divisors = divisors(info, lambda v: v in rows or info.roles[v] is Role.ROW)
        self.reciprocals: dict[tuple[Val, str], str] = {}

    def row_lines(self, level: int) -> list[str]:
        """The per-row values of `level`, then the reciprocal of each divisor now known."""
        emitter = Emitter(self.info, self.row_env, "row_")
        ready = [v for v in self.info.fusion.vals
                 if v in self.rows and self.info.level[v] == level and v not in self.row_env]
        lines = emitter.emit(ready)
        self.row_env.update(emitter.env)
        for v, computes in self.divisors.items():
            for ct in sorted(computes):
                if v in self.row_env and (v, ct) not in self.reciprocals:
                    name, value = reciprocal("row_", v, ct, self.row_env[v])
                    lines.append(f"const {ct} {name} = {value};")
                    self.reciprocals[(v, ct)] = name
        return lines

    def _emitter(self) -> Emitter:
        return Emitter(self.info, {**self.elements, **self.row_env, **self.kept_env}, "e_",
                       self.reciprocals)

    def _keep(self, emitter: Emitter) -> list[str]:
        """Stores of the kept values this pass computed, which later passes read instead."""
        lines = []
        for v in self.kept:
            if v in emitter.env and v not in self.kept_env:
                lines.append(f"kept_{v.name}[v.b][i] = {emitter.env[v]};")
                self.kept_env[v] = f"kept_{v.name}[v.b][i]"
        return lines

    def level(self, k: int, level: tuple[Expr, ...]) -> dict:
        emitter = self._emitter()
        lines = emitter.emit([e.inputs[0] for e in level])
        lines += self._keep(emitter)
        reductions = [reduction(e, emitter.env[e.inputs[0]]) for e in level]
        for e in level:
            self.row_env[e.outputs[0]] = f"row_{e.outputs[0].name}"
        words = ", ".join(f"{e.op}({e.inputs[0].name}) -> {e.outputs[0].name}" for e in level)
        return {**self._reads(emitter), "title": f"Inner reduction level {k}: {words}.",
                "opening_lines": [], "vector_lines": [],
                "element_lines": lines, "reductions": reductions, "outputs": [],
                "accumulators": [], "after_lines": self.row_lines(k + 1)}

    def shifted(self, fold: ShiftedVariance) -> dict:
        """The pass of a variance's two levels (row_variance.py): the first level's pass, with
        sum((x - k)^2) beside its sum(x); after the exchange, the squared deviations from the
        mean made from the two, then the row values of the second level."""
        k = fold.level
        body = self.level(k, self.info.inner_levels[k])
        x, total, squares = fold.operand.name, fold.total.outputs[0], fold.squares.outputs[0]
        s, q, dev = f"row_{total.name}", f"row_{squares.name}", f"dev_{total.name}"
        value = next(r["value"] for r in body["reductions"] if r["var"] == s)  # x, in float
        d = f"({value} - {fold.shift})"
        body["reductions"].append({"var": q, "ctype": ctype(squares),
                                   "functor": REDUCTIONS["sum"].functor, "value": f"{d} * {d}"})
        count = f"static_cast<float>({self.row_env[fold.count]})"
        self.row_env[squares] = q
        body["after_lines"] += [
            f"const float {dev} = fmaf(-{fold.shift}, {count}, {s});  // sum({x} - {fold.shift})",
            f"{q} -= {dev} * ({dev} / {count});  // sum(({x} - mean)^2)",
            f"if ({q} < 0.0f) {q} = 0.0f;  // rounded below 0 (a NaN stays NaN)",
            *self.row_lines(k + 2)]
        body["title"] = (f"Inner reduction levels {k} and {k + 1}, one pass: sum({x}) -> "
                         f"{total.name}, sum(({x} - mean)^2) -> {squares.name}.")
        return body

    def final(self) -> dict:
        info = self.info
        outputs = info.outputs(Role.FULL)
        emitter = self._emitter()
        lines, stored = emitter.emit_stored(outputs, [e.inputs[0] for e in info.outer_reductions])
        title = "Outputs of the row" + (" and the column accumulators." if
                                        info.outer_reductions else ".")
        return {**self._reads(emitter), "title": title, "element_lines": lines,
                "opening_lines": [], "vector_lines": [],
                "reductions": [], "after_lines": [],
                "outputs": [{"name": o.name, "ctype": o.dtype.cuda_type, "value": stored[o]}
                            for o in outputs],
                "accumulators": [{"name": f"acc_{e.outputs[0].name}",
                                  "value": emitter.env[e.inputs[0]]}
                                 for e in info.outer_reductions]}

    def _reads(self, emitter: Emitter) -> dict:
        rows, columns = input_tensors(self.info, emitter.used)
        return {"rows": [t.name for t in rows], "columns": [t.name for t in columns]}

    def row_outputs(self) -> list[dict]:
        return [{"name": o.name, "ctype": o.dtype.cuda_type, "value": self.row_env[o]}
                for o in self.info.outputs(Role.ROW)]


def passes_context(info: FusionInfo, kept: tuple[str, ...] = (),
                   fold: ShiftedVariance | None = None) -> dict:
    """The scalar prologue, the statements before the first pass, the register arrays of the
    `kept` values (RowSchedule.kept), every pass (a variance's two levels as one where `fold`
    says) and the row outputs, with the declarations nothing reads left out."""
    scalar_lines, scalar_env = scalar_prologue(info)
    kept_vals = tuple(v for v in info.fusion.vals if v.name in kept)
    p = Passes(info, scalar_env, kept_vals)
    start = p.row_lines(0)
    passes = []
    for k, level in enumerate(info.inner_levels):
        if fold is not None and k == fold.level:
            passes.append(p.shifted(fold))
        elif fold is None or k != fold.level + 1:
            passes.append(p.level(k, level))
    if info.row_passes > len(info.inner_levels):
        passes.append(p.final())
    row_outputs = p.row_outputs()
    readers = [line for q in passes for line in q["element_lines"]]
    readers += [r["value"] for q in passes for r in q["reductions"]]
    readers += [o["value"] for q in passes for o in q["outputs"]]
    readers += [a["value"] for q in passes for a in q["accumulators"]]
    readers += [o["value"] for o in row_outputs]
    for q in reversed(passes):
        q["after_lines"] = used_lines(q["after_lines"], readers)
        readers += q["after_lines"]
    start = used_lines(start, readers)
    readers += start
    return {"scalar_lines": used_lines(scalar_lines, readers), "start_lines": start,
            "kept": [{"name": f"kept_{v.name}", "ctype": ctype(v),
                      "why": f"{v.definition.op} {v.name}, computed once per element"}
                     for v in kept_vals if v.definition is not None],
            "passes": passes, "row_outputs": row_outputs, "scalar_env": scalar_env}


def ptx_store(s: RowSchedule) -> bool:
    """Whether a vector of a full-row output is stored by fm::store_vector (one st.global by
    inline PTX) rather than the plain fm::store. NVRTC split plain vector stores into element
    stores in blocks of several rows and in batch loops not fully unrolled (a CPU test on the
    PTX pins it), so those take the PTX store; elsewhere the plain store stays whole and
    leaves the compiler free to schedule (the inline PTX cost registers: bench/TUNING.md,
    "output stores")."""
    return s.rows_per_block > 1 or not s.full_unroll


def skew_words(s: RowSchedule) -> str:
    """The comment on the row's skew in the kernel (RowSchedule.skew)."""
    if not s.skew:
        return "0: rows start on vector boundaries"
    return f"elements from the row's vector boundary to its start (a multiple of {s.skew})"


# How the rows reach the blocks, in the words of intro().
DEALT = {
    Dealing.STRIDED: "a persistent grid, each block taking every grid-th row group.",
    Dealing.DYNAMIC: "a persistent grid, each block taking its next row group from a counter.",
    Dealing.GRID: "a block per row group.",
}


def dealer(info: FusionInfo, s: RowSchedule) -> dict:
    """Whether the kernel takes its row groups from a counter (fm::CountedRows; otherwise
    its own loop strides over them), the dealer's type and comment, the pass before whose
    reduction the next group is published (None: the dealer's own barrier shares it; only
    rows of several warps reduce through a block barrier), and the row loop's expressions:
    the group's first row, the loop's condition and step, and the row whose copies start in
    this iteration (the next row, or with three stages the one after it)."""
    if s.dealing is not Dealing.DYNAMIC:
        ahead = _times(max(s.stages - 1, 1), "row_stride")
        return {"counted": False, "publish_pass": None, "row0": "row0", "more": "row0 < n_rows",
                "step": "row0 += row_stride", "next_row": f"row + {ahead}"}
    shared = row_dealing.publishes_at_reduction(info, s.threads_per_row)
    ahead = "true" if s.stages == 2 else "false"
    return {"type": f"fm::CountedRows<Part, {ahead}, {'false' if shared else 'true'}>",
            "counted": True, "publish_pass": 0 if shared else None,
            "comment": "row groups from a counter, as blocks finish theirs"
                       + (" (the next group known a row ahead, for its loads)"
                          if s.stages == 2 else ""),
            "row0": "rows.row0", "more": "rows.more(n_rows)", "step": "rows.advance(it)",
            "next_row": "rows.ahead() + part.ty + zero"}


def pipeline(s: RowSchedule, dealt: dict) -> dict | None:
    """Rows in several stages (None in one): the rows whose copies start before the loop
    (each its slot and its row, the stages but one; a per-row input's value is read with
    them, into ahead<k>), and in the loop the slot this row computes from, the one the copies
    of the row `stages - 1` ahead go to, and the values read ahead, each moved one down
    (ahead<to> = ahead<next>) as a row ends."""
    stages = s.stages
    if stages == 1:
        return None
    row0 = dealt["row0"]
    first = [{"k": k, "slot": f"{_times(k, 'RPB')} + part.ty" if k else "part.ty",
              "row": f"{row0} + {_times(k, 'row_stride')} + part.ty" if k else f"{row0} + part.ty"}
             for k in range(stages - 1)]
    words = "row starts" if stages == 2 else f"{stages - 1} rows start"
    return {"comment": f"{stages} stages: this block's first {words} loading now, a row more "
                       "each time one computes.",
            "first": first, "slot": f"(it % {stages}) * RPB + part.ty",
            "ahead_slot": f"((it + {stages - 1}) % {stages}) * RPB + part.ty",
            "moved": [{"to": k, "next": k + 1} for k in range(stages - 2)],
            "last": stages - 2}


def _times(k: int, name: str) -> str:
    """`name` k times, as C: `name` for one, `k * name` for more."""
    return name if k == 1 else f"{k} * {name}"


def intro(info: FusionInfo, s: RowSchedule) -> list[str]:
    """The kernel's shape in words, above its signature."""
    share = (f"its block's part of the row ({s.cluster} blocks of a cluster share each row)"
             if s.cluster > 1 else "the row")
    where = {st: [p.tensor for p in s.placements if p.storage is st] for st in Storage}
    kept = "; ".join(f"{', '.join(names)} in {st}" for st, names in where.items() if names)
    lines = [f"Each block works on {s.rows_per_block} row(s) at a time; {DEALT[s.dealing]}",
             f"Thread x of a row owns vectors x, x + {s.threads_per_row}, ... ({s.batch} of them, "
             f"{s.vec} element(s) each) of {share}.", f"Inputs: {kept}."]
    if s.skew:
        lines.append(f"Rows are skewed: {s.vec} does not divide {s.hidden}, so a row's vectors "
                     f"start at the {s.vec}-element boundary at or below its start, and its "
                     "first and last vectors are masked to the row's elements.")
    if s.aligned_copy:
        lines.append("Shared row buffers are filled in 16-byte chunks from the boundary at or "
                     "below each row's start.")
    return [part for line in lines for part in textwrap.wrap(line, 117)]


def row_start_lines(fold: ShiftedVariance | None, access: dict[str, RowAccess]) -> list[str]:
    """The statements of each row placed after its copies are issued and before they are
    waited for: the shift of a variance's sums (row_variance.py), from the first elements of
    its source's row, whose load and shuffles then hold back no copy."""
    if fold is None:
        return []
    source = fold.source.name
    return ["// the shift of the row's variance sums, from its first elements (copies in flight)",
            f"const float {fold.shift} = fm::row_shift(part, g_{source}, "
            f"{access[source].row('row')} * H, valid);"]


def row_context(info: FusionInfo, s: RowSchedule, finalize: FinalizeSchedule | None) -> dict:
    """Everything row_kernel.cu.j2 places but the header and the signature."""
    fold = variance_of(info, s)
    body = passes_context(info, s.kept, fold)
    dealt = dealer(info, s)
    copied = copies(info, s)
    access = row_access(info)
    _refilled(body, copied, refill(info, s, fold), access)
    ring = None
    if s.ring is not None:
        ring = {"buffers": list(s.ring.tensors),
                "unroll": s.ring.chunks if s.full_unroll else 1}
    return {
        "intro": intro(info, s),
        "s": s,
        # a finalize kernel follows: let it launch early
        "finalized": finalize is not None and not finalize.fused,
        # the dynamic shared memory, declared wherever the plan holds a buffer (a fused
        # finalize's lanes' buffers alone included), and the row passes' buffers in it (the
        # fused finalize declares its lanes' buffers itself)
        "dynamic_smem": bool(s.smem.buffers),
        "smem": [{"name": b.name, "offset": b.offset, "purpose": b.purpose}
                 for b in s.smem.buffers if b.name not in lanes_buffers(info)],
        "block_objects": block_objects(info, s, fold),
        "column_barrier": any(s.placement(t.name).storage is Storage.SMEM
                              for t in info.col_inputs),
        "row_objects": [row_buffer(t, s, info) for t in info.full_inputs
                        if s.placement(t.name).storage is Storage.REGISTERS],
        "global_rows": [t.name for t in info.full_inputs
                        if s.placement(t.name).storage is Storage.GLOBAL],
        "copies": copied,
        "pipeline": pipeline(s, dealt),  # None: no rows load while this one computes
        "dealer": dealt,
        "ring": ring,
        "access": access,
        "row_inputs": [{"name": t.name, "ctype": ctype(t)} for t in info.row_inputs],
        "row_start_lines": row_start_lines(fold, access),  # placed before the copies' wait
        "repeat_lines": repeat_lines(info),
        "ptx_store": str(ptx_store(s)).lower(),
        "skew_words": skew_words(s),
        "accumulators": [{"name": f"acc_{e.outputs[0].name}", "output": e.outputs[0].name}
                         for e in info.outer_reductions],
        **body,
    }
