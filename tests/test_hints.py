"""CPU: Hints are honoured, or refused before anything compiles.

Every field of fuser.schedulers.Hints refuses a bad value with a HintError whose message names
the value, the values allowed and what the heuristic picks there (type errors and storage
words when the Hints are built, values against the fusion and the device when they are
scheduled, and hints no fitting schedule honours by the row search, naming what it tried);
nothing is rendered or compiled first. Every valid hint in a grid over the six ready fusions
either schedules, and the schedule does what each hint says, or is refused by the search.
`unhonoured` is shared with the GPU sweep (test_gpu_hints.py).
"""

from __future__ import annotations

from functools import cache

import pytest

import fuser.kernels
from fuser import (
    BadInputError,
    DataType,
    FuserError,
    FusionDefinition,
    HintError,
    OutOfResourcesError,
)
from fuser.analysis import Role, analyze
from fuser.cache import KernelCache
from fuser.device import PRESETS
from fuser.fusions import ROW_FUSIONS
from fuser.schedulers import Hints, Problem, candidates, schedule
from fuser.schedulers.base import (
    Dealing,
    FinalizeSchedule,
    OuterSchedule,
    RowSchedule,
    Storage,
)
from fuser.schedulers.finalize import default_lanes, finalize_schedule, finalized

H200, A100, SM89 = PRESETS["h200"], PRESETS["a100"], PRESETS["sm89-100kb"]
BF16 = DataType.BFloat16
ROWS = 64
POWERS = "allowed: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024"


@cache
def info_of(name: str, dtype: DataType = BF16):
    return analyze(ROW_FUSIONS[name](dtype).fusion)


@cache
def pointwise_info():
    with FusionDefinition("scale_bias") as fd:
        x = fd.define_tensor([-1, -1], dtype=BF16)
        w = fd.define_tensor([-1], dtype=BF16)
        wb = fd.ops.broadcast_in_dim(w, shape=x.shape(), broadcast_dims=[1])
        fd.add_output(fd.ops.add(fd.ops.mul(x, 2.0), wb))
    return analyze(fd.fusion)


def row_names(name: str) -> tuple[list[str], list[str]]:
    info = info_of(name)
    return [t.name for t in info.full_inputs], [t.name for t in info.col_inputs]


def all_rows(name: str, word: str, col_word: str = "smem") -> tuple[tuple[str, str], ...]:
    """Every row input of `name` in `word`, its column inputs in `col_word`."""
    full, cols = row_names(name)
    return tuple((t, word) for t in full) + tuple((t, col_word) for t in cols)


def unhonoured(s: RowSchedule | OuterSchedule, hints: Hints,
               finalize: FinalizeSchedule | None = None) -> list[str]:
    """What schedule `s` (and its finalize) does otherwise than `hints` say: [] when it
    honours every hint. Inputs a storage hint does not name stay in registers (a skewed
    row's columns: global). The outer-persistent kernel takes the cluster hint alone."""
    if isinstance(s, OuterSchedule):
        others = [name for name in hints.given() if name != "cluster"]
        wrong = [f"the column kernel ran with hints it takes none of: {others}"] if others else []
        if hints.cluster is not None and s.cluster != hints.cluster:
            wrong.append(f"cluster is {s.cluster}, hinted {hints.cluster}")
        return wrong
    wrong = []
    for field in ("threads_per_row", "rows_per_block", "cluster", "stages", "accumulators",
                  "aligned_copy", "dealing"):
        want = getattr(hints, field)
        if want is not None and getattr(s, field) != want:
            wrong.append(f"{field} is {getattr(s, field)}, hinted {want}")
    if hints.skewed is not None and bool(s.skew) != hints.skewed:
        wrong.append(f"skew is {s.skew}, hinted skewed={hints.skewed}")
    if hints.storage is not None:
        named = dict(hints.storage)
        for p in s.placements:
            unnamed = (Storage.GLOBAL if s.skew and p.role is Role.COL else Storage.REGISTERS)
            want = named.get(p.tensor, unnamed)
            if p.storage is not want:
                wrong.append(f"{p.tensor} is in {p.storage}, hinted {want}")
        if (s.ring is not None) != any(w is Storage.RING for w in named.values()):
            wrong.append(f"staging ring {s.ring}, hinted storage {hints.words()}")
    if hints.finalize_lanes is not None and (
            finalize is None or finalize.partial_lanes != hints.finalize_lanes):
        wrong.append(f"finalize lanes {finalize and finalize.partial_lanes}, hinted "
                     f"{hints.finalize_lanes}")
    if hints.fused_finalize is not None and (
            finalize is None or finalize.fused is not hints.fused_finalize):
        wrong.append(f"finalize fused {finalize and finalize.fused}, hinted "
                     f"{hints.fused_finalize}")
    return wrong


def heuristic_picks(name: str, field: str, problem: Problem, device=H200) -> str:
    """'the heuristic picks FIELD=VALUE here', as the refusal should say it."""
    info = info_of(name)
    if field == "finalize_lanes":
        value = default_lanes(problem.hidden, device)
    else:
        s = schedule(info, problem, device)
        value = (",".join(f"{p.tensor}:{p.storage}" for p in s.placements)
                 if field == "storage" else getattr(s, field))
    return f"the heuristic picks {field}={value} here"


def refused(name: str, hints: Hints, problem: Problem, device=H200) -> str:
    """The HintError message of scheduling `name` with `hints`."""
    with pytest.raises(HintError) as error:
        schedule(info_of(name), problem, device, hints)
    return str(error.value)


@pytest.fixture
def no_compiling(monkeypatch):
    """Rendering or compiling a kernel fails the test."""
    def fail(*args, **kwargs):
        pytest.fail("a kernel was rendered or compiled before the hint was refused")

    monkeypatch.setattr(KernelCache, "get_or_compile", fail)
    monkeypatch.setattr(fuser.kernels, "_render", fail)


# ----- values checked against the fusion and the device -----

# (fusion, hidden, device, align, hints, what the message says besides the value and pick)
BAD_VALUES = [
    *[(n, 4096, H200, 16, {"threads_per_row": k}, ["must be a power of two", POWERS])
      for n in ("rmsnorm_fwd", "layernorm_bwd") for k in (7, 33, 48, 96, 0, -32, 2048)],
    ("softmax_fwd", 1000, SM89, 16, {"threads_per_row": 48}, [POWERS]),
    ("rmsnorm_fwd", 4096, H200, 16, {"rows_per_block": 0},
     ["allowed: 1 to 8 (1024 threads per block on H200 / 128 threads per row, more with"]),
    ("rmsnorm_bwd", 4096, H200, 16, {"rows_per_block": 2048}, ["allowed: 1 to 16"]),
    # the heuristic's rows are too wide: a block-size hint never brings in a cluster
    ("rmsnorm_fwd", 4096, H200, 16, {"rows_per_block": 16}, ["allowed: 1 to 8"]),
    ("rmsnorm_fwd", 24578, H200, 16, {"rows_per_block": 3},
     ["allowed: 1 to 2 (1024 threads per block on H200 / 512 threads per row"]),
    ("rmsnorm_bwd", 4096, H200, 16, {"threads_per_row": 256, "rows_per_block": 8},
     ["allowed: 1 to 4 (1024 threads per block on H200 / 256 threads per row)"]),
    ("layernorm_fwd", 4096, A100, 16, {"threads_per_row": 1024, "rows_per_block": 2},
     ["allowed: 1 to 1 (1024 threads per block on A100 / 1024 threads per row)"]),
    *[("rmsnorm_bwd", 4096, H200, 16, {"cluster": k},
       ["allowed on H200 (sm_90) with 512 vector(s) per row: 1, 2, 4, 8",
        "clusters need sm_90"]) for k in (3, 16, 0, -2)],
    ("rmsnorm_fwd", 4096, A100, 16, {"cluster": 2},
     ["allowed on A100 (sm_80) with 512 vector(s) per row: 1 (clusters need sm_90"]),
    ("layernorm_bwd", 4096, SM89, 16, {"cluster": 4}, ["on sm89-100KB (sm_89)", ": 1 ("]),
    ("rmsnorm_fwd", 24, H200, 16, {"cluster": 4},  # 3 vectors of 8
     ["with 3 vector(s) per row: 1, 2 (", "each block at least one vector"]),
    ("layernorm_bwd", 8, H200, 16, {"cluster": 2}, ["with 1 vector(s) per row: 1 ("]),
    ("dropout_rmsnorm_bwd", 6, H200, 2, {"cluster": 8},  # 1-element vectors: 6 of them
     ["with 6 vector(s) per row: 1, 2, 4 ("]),
    *[("layernorm_fwd", 4096, H200, 16, {"stages": k}, ["allowed: 1, 2, 3"]) for k in (0, 4)],
    ("rmsnorm_bwd", 4096, H200, 16, {"storage": (("T9", "smem"),)},
     ["T9 is not a row or column input of this fusion; allowed names: T0, T2, T3 "
      "(row inputs: T0, T2)"]),
    ("rmsnorm_bwd", 4096, H200, 16, {"storage": (("T1", "smem"),)},  # rms: a per-row input
     ["T1 is not a row or column input"]),
    ("rmsnorm_bwd", 4096, H200, 16, {"storage": (("T0", "smem"), ("T3", "ring"))},
     ["the staging ring streams row inputs, not the column input T3; allowed for T3: "
      "registers, smem, global"]),
    ("layernorm_fwd", 4096, H200, 16, {"storage": {"T2": "ring"}}, ["column input T2"]),
    ("rmsnorm_bwd", 4096, H200, 16, {"accumulators": "ring"},
     ["allowed: registers, smem, global"]),
    *[("rmsnorm_bwd", 4096, H200, 16, {"finalize_lanes": k}, ["allowed: 1 to 1024"])
      for k in (0, -1, 2048)],
    ("rmsnorm_bwd", 4096, H200, 16, {"aligned_copy": True},  # 8 x 2 B: 16-byte vectors
     ["aligned copies need row vectors narrower than 16 bytes (these are 8 x 2 B)",
      "allowed here: None or False"]),
    ("dropout_rmsnorm_bwd", 24578, H200, 4, {"aligned_copy": True},
     ["(these are 4-byte aligned)", "allowed here: None or False"]),
    ("layernorm_fwd", 4096, H200, 16, {"aligned_copy": True}, ["allowed here: None or False"]),
    ("layernorm_bwd", 4096, H200, 16, {"dealing": "grid"},
     ["a block per row group would write a partial row of the column sums per group; "
      "allowed for this fusion: strided, dynamic"]),
]


@pytest.mark.parametrize(("name", "hidden", "device", "align", "kw", "says"), BAD_VALUES,
                         ids=lambda v: v.name if hasattr(v, "arch") else None)
def test_a_bad_value_is_refused_naming_it_the_allowed_values_and_the_pick(
        name, hidden, device, align, kw, says, no_compiling):
    hints = Hints(**kw)
    problem = Problem(hidden, ROWS, align)
    message = refused(name, hints, problem, device)
    field = list(kw)[-1]  # the last one given is the bad one
    value = hints.words().split(", ")[-1]
    assert message.startswith(f"Hints({value}): "), message
    for words in says:
        assert words in message, message
    assert heuristic_picks(name, field, problem, device) in message, message
    # The build path refuses the same way, before rendering or compiling anything.
    with pytest.raises(HintError) as error:
        fuser.kernels.build(name, info_of(name), problem, device, hints)
    assert str(error.value) == message


@pytest.mark.parametrize(("name", "kw", "says"), [
    ("rmsnorm_fwd", {"accumulators": "smem"},
     "this fusion has no column (outer) reductions to accumulate"),
    ("softmax_fwd", {"accumulators": Storage.REGISTERS},
     "this fusion has no column (outer) reductions to accumulate"),
    ("layernorm_fwd", {"finalize_lanes": 16},
     "this fusion has no finalize kernel (no column outputs)"),
    ("softmax_fwd", {"fused_finalize": True}, "this fusion has no column outputs to finalize"),
])
def test_a_hint_the_fusion_has_no_use_for_is_refused(name, kw, says, no_compiling):
    """Nothing to pick here: the message says why, and names no heuristic value."""
    hints = Hints(**kw)
    message = refused(name, hints, Problem(4096, ROWS, 16))
    assert message == f"Hints({hints.words()}): {says}"
    with pytest.raises(HintError, match=r"no column|no finalize"):
        fuser.kernels.build(name, info_of(name), Problem(4096, ROWS, 16), H200, hints)


@pytest.mark.parametrize("kw", [
    {"threads_per_row": 64}, {"rows_per_block": 2}, {"cluster": 1}, {"stages": 1},
    {"storage": (("T0", "smem"),)}, {"accumulators": "smem"}, {"finalize_lanes": 16},
    {"aligned_copy": False}, {"aligned_copy": True},
])
def test_a_pointwise_fusion_refuses_every_hint(kw, no_compiling):
    """A pointwise kernel takes no hints: refused rather than ignored, even at values a row
    kernel would take."""
    hints = Hints(**kw)
    with pytest.raises(HintError) as error:
        schedule(pointwise_info(), Problem(4096, ROWS, 16), H200, hints)
    assert str(error.value) == (
        f"Hints({hints.words()}): this fusion has no reductions and runs as one pointwise "
        "kernel, which takes no hints; allowed: Hints() or None")
    with pytest.raises(HintError, match="takes no hints"):
        fuser.kernels.build("scale_bias", pointwise_info(), Problem(4096, ROWS, 16), H200, hints)
    assert schedule(pointwise_info(), Problem(4096, ROWS, 16), H200, Hints()).vec == 8


# ----- types and storage words, refused when the Hints are built -----

@pytest.mark.parametrize(("kw", "message"), [
    ({"threads_per_row": 2.0}, "Hints(threads_per_row=2.0): an int is needed"),
    ({"threads_per_row": "64"}, "Hints(threads_per_row='64'): an int is needed"),
    ({"rows_per_block": 1.5}, "Hints(rows_per_block=1.5): an int is needed"),
    ({"cluster": True}, "Hints(cluster=True): an int is needed"),
    ({"stages": "2"}, "Hints(stages='2'): an int is needed"),
    ({"finalize_lanes": 16.0}, "Hints(finalize_lanes=16.0): an int is needed"),
    ({"aligned_copy": 1}, "Hints(aligned_copy=1): True or False"),
    ({"fused_finalize": "yes"}, "Hints(fused_finalize='yes'): True or False"),
    ({"aligned_copy": "true"}, "Hints(aligned_copy='true'): True or False"),
    ({"storage": (("T0", "disk"),)},
     "Hints(storage T0=...): 'disk' is not a storage; allowed: registers, smem, global, ring"),
    ({"accumulators": "disk"},
     "Hints(accumulators=...): 'disk' is not a storage; allowed: registers, smem, global, ring"),
    ({"accumulators": 1}, "Hints(accumulators=...): 1 is not a storage"),
    ({"dealing": "dynamical"},
     "Hints(dealing='dynamical'): not a dealing; allowed: strided, dynamic, grid"),
    ({"dealing": 2}, "Hints(dealing=2): not a dealing; allowed: strided, dynamic, grid"),
    ({"storage": (("T0", "smem"), ("T2", "registers"), ("T0", "global"))},
     "Hints(storage=...): T0 named more than once"),
    *[({"storage": bad}, "give (tensor name, storage) pairs, e.g. (('T0', 'smem'), ")
      for bad in ("T0:smem", (("T0",),), (("T0", "smem", "x"),), ((0, "smem"),), (), 5,
                  ("T0", "smem"), [["T0"], ["smem"]])],
])
def test_a_bad_type_or_word_is_refused_when_the_hints_are_built(kw, message):
    with pytest.raises(HintError) as error:
        Hints(**kw)
    assert message in str(error.value)
    assert isinstance(error.value, BadInputError) and isinstance(error.value, FuserError)


def test_hints_normalize_to_hashable_storage_members():
    """Storage words become Storage members and dicts and lists tuples, so equal hints are
    equal cache keys however they were spelled."""
    spelled = [Hints(storage={"T0": "smem", "T3": "registers"}, accumulators="global"),
               Hints(storage=[["T0", Storage.SMEM], ("T3", "registers")],
                     accumulators=Storage.GLOBAL),
               Hints(storage=(("T0", "smem"), ("T3", "registers")), accumulators="global")]
    assert len(set(spelled)) == 1
    assert spelled[0].storage == (("T0", Storage.SMEM), ("T3", Storage.REGISTERS))
    assert spelled[0].accumulators is Storage.GLOBAL
    assert spelled[0].words() == "storage=T0:smem,T3:registers, accumulators=global"
    assert Hints(dealing="grid") == Hints(dealing=Dealing.GRID)
    assert Hints(dealing="grid").words() == "dealing=grid"
    assert Hints().given() == {} and Hints().words() == ""


# ----- hints no fitting schedule honours: the search says what it tried -----

@pytest.mark.parametrize(("name", "hidden", "kw", "tried"), [
    ("rmsnorm_fwd", 4096, {"stages": 2, "storage": all_rows("rmsnorm_fwd", "registers")},
     "this choice runs one stage (two need a row buffer in shared memory"),
    ("rmsnorm_bwd", 4096, {"stages": 2, "storage": all_rows("rmsnorm_bwd", "ring")},
     "a staging ring kernel has one stage"),
    ("rmsnorm_bwd", 4096, {"rows_per_block": 2, "storage": all_rows("rmsnorm_bwd", "ring")},
     "no staging ring for T0, T2 (one row per block"),
    ("rmsnorm_bwd", 4098, {"aligned_copy": True,
                           "storage": all_rows("rmsnorm_bwd", "registers", "registers")},
     "aligned_copy=True: smem-first policy: nothing in smem"),
    ("layernorm_bwd", 40000, {"storage": all_rows("layernorm_bwd", "global")},
     ">= 112 of 64 registers per thread at 1024 threads"),
    ("rmsnorm_fwd", 4096, {"dealing": "dynamic", "storage": all_rows("rmsnorm_fwd", "ring")},
     "dealing=dynamic: allowed here: strided, grid (a counter cannot deal these rows: a "
     "staging ring fetches rows ahead by their stride)"),
    ("rmsnorm_bwd", 16384, {"dealing": "dynamic", "stages": 3,
                            "storage": all_rows("rmsnorm_bwd", "smem", "smem")},
     "cluster=1 stages=3 {T0: smem, T2: smem, T3: smem} dealing=dynamic: allowed here: "
     "strided (a counter cannot deal these rows: 3 stages (its dealer knows the group one "
     "row ahead, not two))"),
    ("rmsnorm_bwd", 24576, {"dealing": "dynamic", "cluster": 2},
     "dealing=dynamic: allowed here: strided (a counter cannot deal these rows: the 2 "
     "blocks of a cluster would have to agree on each group)"),
])
def test_a_hint_no_schedule_honours_is_refused_with_what_was_tried(
        name, hidden, kw, tried, no_compiling):
    hints = Hints(**kw)
    problem = Problem(hidden, ROWS, 16)
    message = refused(name, hints, problem)
    assert message.startswith(f"no schedule honours Hints({hints.words()}) at hidden {hidden} "
                              "on H200. Tried:\n  "), message
    assert tried in message, message
    if hints.aligned_copy:
        assert message.split("\n")[1].endswith("no row buffer in shared memory"), message
    assert message.endswith("Change or drop the hints; without them the heuristic's schedule "
                            f"is: {schedule(info_of(name), problem, H200).reason}"), message
    with pytest.raises(HintError, match="no schedule honours"):
        fuser.kernels.build(name, info_of(name), problem, H200, hints)


def test_later_candidates_honour_the_hints_too():
    """kernels.build() moves on to the next candidate when ptxas spills: every candidate, not
    only the first, must do what the hints say."""
    hints = Hints(threads_per_row=256, storage=all_rows("dropout_rmsnorm_bwd", "smem"))
    found = list(_until_refused(candidates(info_of("dropout_rmsnorm_bwd"),
                                           Problem(4096, ROWS, 16), H200, hints)))
    assert found
    for s in found:
        assert unhonoured(s, hints) == [], s


def test_a_hint_whose_every_schedule_spills_is_refused_naming_the_spills():
    """Found by the GPU hint sweep: grad_out (T2, not named) stays in registers at 1024
    threads with the dW accumulators, the one schedule that honours the hint, and ptxas
    spills it at one block per SM with the loop fully unrolled. (Without threads_per_row the
    same storage at 512 threads follows, and fits.)"""
    hints = Hints(threads_per_row=1024, storage=(("T0", "global"), ("T3", "global")))
    try:
        built = fuser.kernels.build("rmsnorm_bwd", info_of("rmsnorm_bwd"),
                                    Problem(24578, 512, 16), H200, hints)
    except (HintError, OutOfResourcesError) as exc:
        message = str(exc)
    else:
        pytest.skip(f"this NVRTC fits the kernel without spills: "
                    f"{built.compiled.resource(built.source.row_entry)}")
    assert "spill" in message, message


def _until_refused(schedules):
    try:
        yield from schedules
    except HintError as exc:
        assert "no schedule honours" in str(exc)


# ----- valid hints: honoured, or refused by the search -----

HIDDENS = (1000, 4096, 24578)


def most_rows(name: str, device, hidden: int = 4096) -> int:
    """The rows per block a hint may ask for: as many as the heuristic's threads per row of
    one block (no cluster) leave room for."""
    from fuser.schedulers import inner_outer_persistent, inner_persistent
    from fuser.schedulers.row_geometry import row_split
    from fuser.schedulers.row_records import RowFusion

    info = info_of(name)
    policy = (inner_outer_persistent if info.outer_reductions else inner_persistent).POLICY
    fusion = RowFusion.of(info)
    _, tpr, _ = row_split(hidden, fusion.itemsizes, 16, policy, device,
                          input_bytes=fusion.input_bytes)
    return device.max_threads_per_block // tpr


def valid_grid(name: str, device, hidden: int = 4096) -> list[dict]:
    """Valid values one factor at a time, then pairs."""
    backward = bool(info_of(name).outer_reductions)
    clusters = (1, 2, 4, 8) if device.arch >= 90 else (1,)
    grid = [{"threads_per_row": k} for k in (1, 8, 32, 64, 256, 1024)]
    grid += [{"rows_per_block": k} for k in (1, 2, 3, 4)
             if k <= most_rows(name, device, hidden)]
    grid += [{"cluster": k} for k in clusters]
    grid += [{"stages": k} for k in (1, 2, 3)]
    grid += [{"storage": all_rows(name, w, c)} for w in ("registers", "smem", "global", "ring")
             for c in ("smem", "registers", "global")]
    full, _ = row_names(name)
    grid += [{"storage": ((full[0], "smem"),)}, {"storage": ((full[-1], "global"),)}]
    grid += [{"aligned_copy": b} for b in (True, False)]
    grid += [{"threads_per_row": t, "rows_per_block": r} for t in (8, 16, 64, 256)
             for r in (2, 3)]
    grid += [{"storage": all_rows(name, w), "stages": s}
             for w in ("registers", "smem", "global", "ring") for s in (1, 2, 3)]
    grid += [{"cluster": k, "storage": all_rows(name, w)} for k in clusters[1:]
             for w in ("smem", "global", "ring")]
    grid += [{"cluster": k, "aligned_copy": True} for k in clusters[1:]]
    grid += [{"aligned_copy": True, "storage": all_rows(name, "smem"), "stages": 2}]
    dealings = ("strided", "dynamic") if backward else ("strided", "dynamic", "grid")
    grid += [{"dealing": d} for d in dealings]
    grid += [{"dealing": "dynamic", "stages": s, "storage": all_rows(name, "smem")}
             for s in (1, 2, 3)]
    grid += [{"dealing": d, "threads_per_row": 16, "rows_per_block": 3} for d in dealings[1:]]
    if backward:
        grid += [{"accumulators": a} for a in ("registers", "smem", "global")]
        grid += [{"accumulators": a, "storage": all_rows(name, w)}
                 for a in ("smem", "global") for w in ("smem", "global", "ring")]
        grid += [{"finalize_lanes": k} for k in (1, 3, 16, 32, 600, 1024)]
        grid += [{"fused_finalize": b} for b in (True, False)]
        grid += [{"fused_finalize": True, **kw} for kw in (
            {"accumulators": "global"}, {"accumulators": "smem"}, {"stages": 2}, {"stages": 3},
            {"threads_per_row": 64, "rows_per_block": 4}, {"storage": all_rows(name, "ring")})]
    return grid


@pytest.mark.parametrize("device", [H200, A100, SM89], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_every_valid_hint_is_honoured_or_refused_by_the_search(name, hidden, device):
    """Each hint set of the grid schedules with a schedule that honours every hint, or the
    row search refuses it naming the hints and what it tried (never a value check: the
    values are valid here). aligned_copy=True is valid only where vectors are narrower than
    16 bytes (24578: 2-element vectors)."""
    info, problem = info_of(name), Problem(hidden, ROWS, 16)
    honoured, wrong = 0, []
    for kw in valid_grid(name, device, hidden):
        if kw.get("aligned_copy") and hidden != 24578:
            continue
        hints = Hints(**kw)
        try:
            s = schedule(info, problem, device, hints)
        except HintError as exc:
            text = str(exc)
            if not (text.startswith(f"no schedule honours Hints({hints.words()}) ")
                    and "Tried:\n  " in text and "Change or drop the hints" in text):
                wrong.append(f"{hints.words()}: refused by a value check: {text}")
            continue
        try:
            s, final = finalized(info, s, problem, device, hints)
        except HintError as exc:
            if not str(exc).startswith("Hints(fused_finalize=True): this row kernel cannot "):
                wrong.append(f"{hints.words()}: refused by the finalize: {exc}")
            continue
        wrong += [f"{hints.words()}: {w}" for w in unhonoured(s, hints, final)]
        honoured += 1
    assert not wrong, "\n".join(wrong)
    assert honoured >= 20, f"only {honoured} hint sets honoured"


@pytest.mark.parametrize("lanes", [1, 3, 16, 32, 600, 1024])
def test_finalize_lanes_are_honoured_within_a_block(lanes):
    info = info_of("layernorm_bwd")
    f = finalize_schedule(info, Problem(4096, ROWS, 16), H200, lanes)
    assert f.partial_lanes == lanes
    assert f.cols_per_block >= 1 and f.cols_per_block * lanes <= H200.max_threads_per_block
    assert f.smem.fits


def test_every_hinted_power_of_two_is_honoured_where_the_old_values_were_wrong():
    """threads_per_row 7, 33 and 48 once produced kernels that mixed rows in the warp
    reduction; the powers of two around them are honoured."""
    info, problem = info_of("rmsnorm_fwd"), Problem(4096, ROWS, 16)
    for bad, good in ((7, 8), (33, 32), (48, 64)):
        with pytest.raises(HintError, match="power of two"):
            schedule(info, problem, H200, Hints(threads_per_row=bad))
        s = schedule(info, problem, H200, Hints(threads_per_row=good))
        assert s.threads_per_row == good
