"""GPU: every hint is honoured with correct results, or refused before launch.

A grid of Hints over the ten row normalizations of fuser.fusions (bf16, 64 rows, hidden 1000
and 4096, and 24576 for rows split over clusters): one factor at a time (threads_per_row,
rows_per_block, cluster, stages, storage of every row input, accumulators, finalize_lanes,
fused_finalize, aligned_copy, dealing), then a few pairs (threads_per_row x rows_per_block,
storage x stages, cluster x storage, accumulators x storage, a counter x two stages or a ring,
a fused finalize beside each other hint), and skewed rows at 4099 beside each other hint. At
64 rows every row group goes to a block of the first wave: tests/test_gpu_dealing.py deals
many. Each run is EITHER validated against the float64 reference, with a schedule that does
what every hint says, OR refused with a HintError and nothing launched.
Values the kernels once took and got wrong (threads_per_row 7, 33, 48, 96: the warp
reduction mixed rows) are in the grid.

1468 runs (624 over the first six fusions took about 30 s with `pytest -n 8` on an H200,
most of it NVRTC). `pytest -s` prints how
many hint sets were honoured and refused; with pytest-xdist, set
FUSER_HINT_OUTCOMES=file.jsonl and run `python tests/test_gpu_hints.py file.jsonl`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from functools import cache

import pytest
from test_gpu_fusions import poisoned_outputs, to_device  # noqa: F401 (an autouse fixture)
from test_hints import unhonoured

import fuser.executor as executor
from fuser import DataType, FuserError, HintError
from fuser.analysis import analyze
from fuser.cache import KernelCache
from fuser.fusions import FUSIONS, ROW_FUSIONS, make_inputs
from fuser.launch import EntryLauncher
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes
from fuser.schedulers import Hints

pytestmark = pytest.mark.gpu

BF16 = DataType.BFloat16
ROWS = 64
HIDDENS = (1000, 4096)
CLUSTER_HIDDEN = 24576  # 3072 elements per block over 8: rows big enough to split
SKEWED_HIDDEN = 4099  # rows start on any element: skewed rows (RowSchedule.skew)
STORAGES = ("registers", "smem", "global", "ring")
OUTCOMES: list[dict] = []  # one per run: fusion, hidden, hints, outcome


@cache
def _inputs_of(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(row input names, column input names) of fusion `name`."""
    info = analyze(ROW_FUSIONS[name](BF16).fusion)
    return (tuple(t.name for t in info.full_inputs), tuple(t.name for t in info.col_inputs))


def storage(name: str, word: str) -> tuple[tuple[str, str], ...]:
    """Every row input of `name` in storage `word`, its column inputs in shared memory."""
    full, cols = _inputs_of(name)
    return tuple((t, word) for t in full) + tuple((t, "smem") for t in cols)


def one_factor(name: str) -> list[dict]:
    """Each hint alone, over its values (bad ones too)."""
    grid = [{"threads_per_row": k} for k in (7, 33, 48, 96, 32, 64, 256)]
    grid += [{"rows_per_block": k} for k in (1, 2, 3)]
    grid += [{"cluster": k} for k in (1, 2, 4, 8)]
    grid += [{"stages": k} for k in (1, 2, 3)]
    grid += [{"storage": storage(name, w)} for w in STORAGES]
    grid += [{"accumulators": w} for w in ("registers", "smem", "global")]
    grid += [{"finalize_lanes": k} for k in (3, 16, 1024)]
    grid += [{"fused_finalize": b} for b in (True, False)]
    grid += [{"aligned_copy": b} for b in (True, False)]
    grid += [{"dealing": d} for d in ("strided", "dynamic", "grid")]
    return grid


def pairs(name: str) -> list[dict]:
    """A handful of pairs: sub-warp and partial-warp blocks, stages of each storage,
    cluster parts of each storage, column accumulators with rows re-read."""
    grid = [{"threads_per_row": t, "rows_per_block": r} for t in (16, 64, 256) for r in (2, 3)]
    grid += [{"storage": storage(name, w), "stages": s} for w in STORAGES for s in (1, 2, 3)]
    grid += [{"cluster": k, "storage": storage(name, w)} for k in (2, 8)
             for w in ("smem", "global", "ring")]
    grid += [{"dealing": "dynamic", "storage": storage(name, "smem"), "stages": 2},
             {"dealing": "dynamic", "storage": storage(name, "ring")}]
    if name.endswith("_bwd"):
        grid += [{"accumulators": a, "storage": storage(name, "global")}
                 for a in ("smem", "global")]
        grid += [{"fused_finalize": True, **kw} for kw in (
            {"accumulators": "smem"}, {"accumulators": "global"}, {"stages": 2}, {"stages": 3},
            {"threads_per_row": 16, "rows_per_block": 3}, {"storage": storage(name, "ring")},
            {"cluster": 2}, {"dealing": "dynamic"}, {"finalize_lanes": 16})]
    return grid


def skewed(name: str) -> list[dict]:
    """At SKEWED_HIDDEN (rows starting on any element): skewed rows and not, and skewed rows
    beside each other hint, those a skewed row cannot take (aligned copies, a cluster)
    refused."""
    return ([{"skewed": b} for b in (True, False)]
            + [{"skewed": True, **kw} for kw in (
                {"stages": 2}, {"stages": 3}, {"threads_per_row": 32}, {"rows_per_block": 2},
                {"storage": storage(name, "global")}, {"storage": storage(name, "smem")},
                {"dealing": "dynamic"}, {"aligned_copy": True}, {"cluster": 2})])


def clustered(name: str) -> list[dict]:
    """Rows split over a cluster at CLUSTER_HIDDEN: each size, and with rows in shared
    memory, streamed through the ring, and two or three stages."""
    return ([{"cluster": k} for k in (2, 4, 8)]
            + [{"cluster": 2, "storage": storage(name, w)} for w in ("smem", "ring")]
            + [{"cluster": 4, "stages": 2}, {"cluster": 2, "stages": 3}])


CASES = ([(name, hidden, kw) for name in sorted(ROW_FUSIONS) for hidden in HIDDENS
          for kw in one_factor(name) + pairs(name)]
         + [(name, CLUSTER_HIDDEN, kw) for name in sorted(ROW_FUSIONS) for kw in clustered(name)]
         + [(name, SKEWED_HIDDEN, kw) for name in sorted(ROW_FUSIONS) for kw in skewed(name)])


def case_id(case) -> str:
    name, hidden, kw = case
    return f"{name}-{hidden}-{Hints(**kw).words().replace(', ', '-').replace(',', '+')}"


@pytest.fixture
def calls(monkeypatch) -> dict[str, list]:
    """Compiles and launches of this test, recorded as they happen (and still done)."""
    seen: dict[str, list] = {"compiles": [], "launches": []}
    compile_, launch = KernelCache.get_or_compile, EntryLauncher.__call__

    def compiling(self, source, name, *args, **kwargs):
        seen["compiles"].append(name)
        return compile_(self, source, name, *args, **kwargs)

    def launching(self, *args, **kwargs):
        seen["launches"].append(self.name)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(KernelCache, "get_or_compile", compiling)
    monkeypatch.setattr(EntryLauncher, "__call__", launching)
    return seen


@pytest.fixture(scope="module", autouse=True)
def summary():
    """How many hint sets were honoured and refused, printed after the module (-s shows it)."""
    yield
    if OUTCOMES:
        print("\n" + summarize(OUTCOMES))


def record(name: str, rows: int, hidden: int, hints: Hints, outcome: str,
           detail: str = "") -> None:
    entry = {"fusion": name, "rows": rows, "hidden": hidden, "hints": hints.words(),
             "outcome": outcome, "detail": detail}
    OUTCOMES.append(entry)
    path = os.environ.get("FUSER_HINT_OUTCOMES")
    if path:
        with open(path, "a") as f:  # one short line per write: workers append whole lines
            f.write(json.dumps(entry) + "\n")


def summarize(outcomes: list[dict]) -> str:
    counts = collections.Counter(o["outcome"] for o in outcomes)
    by_hint = collections.defaultdict(collections.Counter)
    for o in outcomes:
        key = ", ".join(sorted(part.split("=")[0] for part in o["hints"].split(", ")))
        by_hint[key][o["outcome"]] += 1
    lines = [f"hint sweep: {len(outcomes)} runs: "
             + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
    lines += [f"  {key:<32} " + ", ".join(f"{n} {k}" for k, n in sorted(c.items()))
              for key, c in sorted(by_hint.items())]
    return "\n".join(lines)


@pytest.mark.parametrize(("name", "hidden", "kw"), CASES, ids=[case_id(c) for c in CASES])
def test_hint_is_honoured_or_refused_before_launch(name, hidden, kw, rng, calls):
    honoured_or_refused(name, ROWS, hidden, Hints(**kw), rng, calls)


def honoured_or_refused(name: str, rows: int, hidden: int, hints: Hints, rng, calls,
                        dtype: DataType = BF16) -> str:
    """Run fusion `name` (a key of fuser.fusions.FUSIONS) on fresh random inputs with
    `hints`: either refused with a HintError that names the hints, with nothing launched, or
    run as hinted, with results within the float64 reference's tolerance. Returns (and
    records) the outcome."""
    what = f"{name} at {rows} x {hidden} ({dtype.name}) with Hints({hints.words()})"
    fd = FUSIONS[name](dtype)
    host = make_inputs(name, rows, hidden, dtype, rng)
    try:
        outs = executor.execute(fd, to_device(host), hints=hints)
    except HintError as exc:
        assert not calls["launches"], f"{what}: refused after launching {calls['launches']}"
        assert "Hints(" in str(exc), f"{what}: the refusal does not name the hints: {exc}"
        outcome = "refused after compiling" if calls["compiles"] else "refused"
        record(name, rows, hidden, hints, outcome, str(exc).splitlines()[0])
        return outcome
    except FuserError as exc:
        pytest.fail(f"{what}: neither honoured nor refused with a HintError: "
                    f"{type(exc).__name__}: {exc}", pytrace=False)
    kernel = fd._last_run.kernel
    wrong = unhonoured(kernel.schedule, hints, kernel.finalize)
    assert not wrong, f"{what}: ran, but not as hinted: {'; '.join(wrong)}\n{kernel.schedule}"
    refs = evaluate(fd.fusion, host)
    try:
        compare([executor.to_host(o) for o in outs], refs, fd.fusion,
                output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))
    except AssertionError as exc:
        raise AssertionError(f"{what}: WRONG RESULT\n{exc}\n{kernel.schedule}") from None
    record(name, rows, hidden, hints, "honoured", kernel.schedule.reason)
    return "honoured"


if __name__ == "__main__":  # the summary of a FUSER_HINT_OUTCOMES file
    with open(sys.argv[1]) as f:
        print(summarize([json.loads(line) for line in f if line.strip()]))
