"""Random Hints combinations over the ready fusions, for the CPU and GPU hint tests.

tests/test_gpu_hints.py runs a grid: each hint alone, a few chosen pairs, skewed rows beside
each other hint. A user tuning a kernel gives several hints at once, in combinations no grid
lists; the strategies here draw them: every field of Hints present in about one draw in four,
from its vocabulary (bad values too: 3, 48 threads a row), storage words for a random subset
of the fusion's full and column inputs, at aligned, odd and cluster-sized hidden sizes in the
three float dtypes. Hypothesis shrinks a failure toward fewer hints, so a repro names the
combination that matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from hypothesis import strategies as st

from fuser import DataType
from fuser.analysis import analyze
from fuser.fusions import FUSIONS, ROW_FUSIONS

# the row normalizations, and the fusions whose hints go elsewhere: BatchNorm's backward and
# softmax over dim 0 (the outer-persistent kernel: a cluster only), the forward's row kernel
NAMES = (*sorted(ROW_FUSIONS), "batchnorm_fwd", "batchnorm_bwd", "softmax_dim0_fwd")
DTYPES = (DataType.BFloat16, DataType.Half, DataType.Float)
HIDDEN = (1, 3, 64, 1000, 1024, 2050, 4096, 4099, 8192, 24576, 24578, 32768, 65537)
ROWS = (1, 7, 64, 300, 1000)
THREADS_PER_ROW = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 3, 48, 96)
ROWS_PER_BLOCK = (1, 2, 3, 4, 8)
CLUSTERS = (1, 2, 4, 8, 16)
STORAGE_WORDS = ("registers", "smem", "global", "ring")
FINALIZE_LANES = (1, 3, 16, 32, 600, 1024)


@dataclass(frozen=True)
class HintCase:
    name: str  # a key of fuser.fusions.FUSIONS
    dtype: DataType
    rows: int
    hidden: int
    hints: dict  # Hints(**hints)

    def __str__(self) -> str:
        words = ", ".join(f"{k}={v!r}" for k, v in self.hints.items())
        return f"{self.name} {self.dtype.name} {self.rows} x {self.hidden}, Hints({words})"


@cache
def tensor_inputs(name: str) -> tuple[str, ...]:
    """The names of fusion `name`'s full and column inputs: what a storage hint may name."""
    info = analyze(FUSIONS[name](DataType.BFloat16).fusion)
    return tuple(t.name for t in (*info.full_inputs, *info.col_inputs))


def _sometimes(values) -> st.SearchStrategy:
    """None three times in four, else one of `values` (shrinks to None: no hint)."""
    return st.one_of(st.none(), st.none(), st.none(), st.sampled_from(values))


@st.composite
def hint_fields(draw, name: str) -> dict:
    """A combination of hint fields for fusion `name`, each present about one time in four."""
    fields = {
        "threads_per_row": draw(_sometimes(THREADS_PER_ROW)),
        "rows_per_block": draw(_sometimes(ROWS_PER_BLOCK)),
        "cluster": draw(_sometimes(CLUSTERS)),
        "stages": draw(_sometimes((1, 2, 3))),
        "accumulators": draw(_sometimes(("registers", "smem", "global"))),
        "finalize_lanes": draw(_sometimes(FINALIZE_LANES)),
        "fused_finalize": draw(_sometimes((True, False))),
        "aligned_copy": draw(_sometimes((True, False))),
        "skewed": draw(_sometimes((True, False))),
        "dealing": draw(_sometimes(("strided", "dynamic", "grid"))),
    }
    if draw(_sometimes((True,))):
        named = draw(st.lists(st.sampled_from(tensor_inputs(name)), min_size=1, unique=True))
        fields["storage"] = tuple((t, draw(st.sampled_from(STORAGE_WORDS))) for t in named)
    return {k: v for k, v in fields.items() if v is not None}


@st.composite
def hint_cases(draw, max_elements: int) -> HintCase:
    """A fusion, dtype, shape (rows x hidden at most `max_elements`, at least one row) and a
    combination of hints, at least one."""
    name = draw(st.sampled_from(NAMES))
    hidden = draw(st.sampled_from(HIDDEN))
    rows = min(draw(st.sampled_from(ROWS)), max(1, max_elements // hidden))
    hints = draw(hint_fields(name).filter(bool))
    return HintCase(name, draw(st.sampled_from(DTYPES)), rows, hidden, hints)
