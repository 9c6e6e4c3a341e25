"""The default candidate schedules of every ready fusion, as a table of text lines.

The safety net of the row scheduler: `table()` lists, for each ready fusion x dtype x hidden
size x device preset (and a few row counts and pointer alignments), the first CANDIDATES
schedules the scheduler offers in order (kernels.build moves to the next only when ptxas
spills), one compact line each, then how many candidates follow and a digest of all of them.
tests/test_schedule_table.py compares it with tests/goldens/schedules.txt, so any change of a
default decision shows up in review, line by line.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator

from fuser import DataType
from fuser.analysis import analyze
from fuser.device import PRESETS, DeviceSpec
from fuser.errors import FuserError
from fuser.fusions import ROW_FUSIONS
from fuser.schedulers import Problem, candidates
from fuser.schedulers.base import PointwiseSchedule, RowSchedule

CANDIDATES = 3  # candidates written out per case; the rest are counted and digested
HIDDEN = (1, 3, 127, 1000, 1024, 4096, 16384, 24578, 32768, 65537, 131072, 1048576)
DTYPES = (DataType.BFloat16, DataType.Half, DataType.Float)


def compact(s: RowSchedule | PointwiseSchedule) -> str:
    """Every decision of a schedule on one line (the reason's words and the plan's purposes
    left out): geometry, storage of each input, accumulators, ring, kept values, residency, smem
    buffers."""
    if isinstance(s, PointwiseSchedule):
        return f"pointwise vec={s.vec} threads={s.threads} unroll={s.unroll}"
    placements = ",".join(f"{p.tensor}:{p.storage}{'+async' if p.async_copy else ''}"
                          for p in s.placements)
    buffers = ",".join(f"{b.name}={b.nbytes}" for b in s.smem.buffers)
    return (f"{s.scheduler} cluster={s.cluster} vec={s.vec}"
            f"{f' skew={s.skew}' if s.skew else ''} tpr={s.threads_per_row} "
            f"rpb={s.rows_per_block} batch={s.batch} unroll={s.unroll}"
            f"{'(full)' if s.full_unroll else ''} stages={s.stages}"
            f"{' aligned' if s.aligned_copy else ''} [{placements}] acc={s.accumulators}"
            f"{f' ring=({s.ring})' if s.ring else ''}"
            f"{' kept=' + ','.join(s.kept) if s.kept else ''} red={s.reduction_bytes} "
            f"regs={s.regs_estimate} blocks/sm={s.blocks_per_sm} dealing={s.dealing} "
            f"smem={s.smem.total} "
            f"[{buffers}]")


def cases() -> Iterator[tuple[str, DataType, int, str, int, int]]:
    """(fusion, dtype, hidden, preset, rows, pointer alignment) of every table entry."""
    for name, dtype, hidden, preset in itertools.product(ROW_FUSIONS, DTYPES, HIDDEN, PRESETS):
        yield name, dtype, hidden, preset, 1024, 16
    for name, hidden in itertools.product(ROW_FUSIONS, HIDDEN):
        yield name, DataType.BFloat16, hidden, "h200", 3, 16
        yield name, DataType.BFloat16, hidden, "h200", 1024, 4


def entry(name: str, dtype: DataType, hidden: int, preset: str, rows: int,
          align: int) -> list[str]:
    """The table's lines for one case."""
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    device: DeviceSpec = PRESETS[preset]
    lines, every = [], []
    ending = "end"
    try:
        for s in candidates(info, Problem(hidden, rows, align), device):
            every.append(compact(s))
    except FuserError as exc:
        ending = type(exc).__name__
    lines.append(f"## {name} {dtype.label} hidden={hidden} {preset} rows={rows} align={align}")
    lines += [f"{k}: {line}" for k, line in enumerate(every[:CANDIDATES])]
    digest = hashlib.sha256("\n".join(every).encode()).hexdigest()[:12]
    lines.append(f"candidates={len(every)} then {ending} digest={digest}")
    return lines


def table() -> str:
    return "\n".join(line for case in cases() for line in entry(*case)) + "\n"
