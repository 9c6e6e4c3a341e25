"""GPU: random combinations of hints (tests/hint_draws.py) give the float64 reference's
numbers, or are refused before launch.

test_gpu_hints.py runs a grid of single hints and chosen pairs; here hypothesis draws several
hints at once over the ready fusions, in bf16, fp16 and fp32, at aligned, odd and
cluster-sized hidden sizes (at most MAX_ELEMENTS a call, so the oracle stays fast). Each draw
is run by test_gpu_hints.honoured_or_refused: refused with a HintError naming the hints and
nothing launched, or run with kernels that do what every hint says and match the reference.
A failure is shrunk toward the fewest hints.

FUSER_GPU_HINT_CASES (default 384) draws in FUSER_GPU_HINT_SHARDS (8) shards, seeded from
FUSER_GPU_HINT_SEED; each shard prints its counts (-s shows them).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from hint_draws import hint_cases
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from test_gpu_fusions import poisoned_outputs  # noqa: F401 (an autouse fixture)
from test_gpu_hints import calls, honoured_or_refused  # noqa: F401 (calls: a fixture)

from fuser.schedulers import Hints

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("FUSER_GPU_HINT_CASES", "384"))
SHARDS = int(os.environ.get("FUSER_GPU_HINT_SHARDS", "8"))
SEED = int(os.environ.get("FUSER_GPU_HINT_SEED", "2026"))
MAX_ELEMENTS = 2**21


@pytest.mark.parametrize("shard", range(SHARDS))
def test_hint_combinations_match_the_reference_or_are_refused(shard, calls):  # noqa: F811
    counts: Counter[str] = Counter()
    examples = -(-CASES // SHARDS)

    @seed(SEED + shard)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=hint_cases(max_elements=MAX_ELEMENTS), data_seed=st.integers(0, 2**32 - 1))
    def draw(case, data_seed):
        note(f"{case}, inputs: make_inputs(..., np.random.default_rng({data_seed}))")
        for seen in calls.values():  # what this draw compiles and launches, not the last's
            seen.clear()
        counts[honoured_or_refused(case.name, case.rows, case.hidden, Hints(**case.hints),
                                   np.random.default_rng(data_seed), calls, case.dtype)] += 1

    draw()
    print(f"shard {shard}: {dict(counts)}")
    assert counts["honoured"] >= examples // 16, counts
