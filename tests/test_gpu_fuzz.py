"""GPU: random fusions (tests/fuzz_fusions.py) at random shapes, run through fd.execute and
compared with the float64 oracle by fd.validate(); a mismatch fails with the shrunk repro.

The plans are built tame (fuzz_fusions.build(tame=True, traps=False)): log(|x| + 1),
a / (|b| + 1), exp(min(x, 8)), |x| ** 2, var_mean with correction 0, no [rows] value left to
numpy broadcasting; every value stays finite (tests/test_fuzz.py checks that against the
oracle on the CPU), so a mismatch is a wrong number, not a NaN or inf the kernel and the
oracle reach by different roads. Shapes: rows 1 to 1000, hidden 1 to 32768 (aligned and
not), at most 2**20 elements, so the oracle stays fast. One case in five asks for rows split
over a cluster of 2 or 4 blocks (Hints(cluster=k); a fusion with no row kernel refuses it
with a HintError, and another case is drawn): clusters otherwise come only at large hidden
sizes, and their exchange hung where levels reduce different numbers of values (8a40593).

FUSER_GPU_FUZZ_CASES (default 1008) fusion x shape cases run on the GPU in
FUSER_GPU_FUZZ_SHARDS (16) shards, seeded from FUSER_GPU_FUZZ_SEED: `make test-gpu
PYTEST_ARGS="-n 8"` spreads the shards. A case the fuser refuses (UnsupportedFusionError,
OutOfResourcesError...) or that fails in a filed class (fuzz_fusions.KNOWN) does not count and
another is drawn; an InternalError, a BadInputError (the inputs are made to the definition) or
a LaunchError fails like a mismatch. Each shard prints its counts (-s or -rA shows them).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import pytest
from fuzz_fusions import (
    NotCompiled,
    Plan,
    build,
    compile_error_summary,
    gpu_inputs,
    known_failure,
    plans,
)
from hypothesis import HealthCheck, given, note, reject, seed, settings
from hypothesis import strategies as st

from fuser import FusionDefinition, executor
from fuser.errors import (
    BadInputError,
    CompileError,
    FuserError,
    HintError,
    InternalError,
    LaunchError,
    ValidationError,
)
from fuser.reference import compare, evaluate, input_sensitivity, output_reduction_sizes
from fuser.schedulers import Hints

pytestmark = pytest.mark.gpu

CASES = int(os.environ.get("FUSER_GPU_FUZZ_CASES", "1008"))
SHARDS = int(os.environ.get("FUSER_GPU_FUZZ_SHARDS", "16"))
SEED = int(os.environ.get("FUSER_GPU_FUZZ_SEED", "2026"))
MAX_ELEMENTS = 2**20
HIDDEN = (1, 2, 3, 8, 31, 100, 128, 1000, 1024, 2048, 4096, 4097, 8192, 24578, 32768)
ROWS = (1, 2, 7, 64, 300, 1000)


@dataclass(frozen=True)
class GpuCase:
    plan: Plan
    rows: int
    hidden: int
    data_seed: int
    cluster: int | None = None  # Hints(cluster=...), None for the default schedule


@st.composite
def gpu_cases(draw) -> GpuCase:
    plan = draw(plans(max_steps=8))
    hidden = draw(st.one_of(st.sampled_from(HIDDEN), st.integers(1, 32768)))
    rows = min(draw(st.sampled_from(ROWS)), max(1, MAX_ELEMENTS // hidden))
    cluster = draw(st.sampled_from((None, None, None, 2, 4)))
    return GpuCase(plan, rows, hidden, draw(st.integers(0, 2**32 - 1)), cluster)


def repro(fd: FusionDefinition, case: GpuCase) -> str:
    run = ("fd.validate(inputs)" if case.cluster is None else
           f"fuser.executor.execute(fd, inputs, hints=Hints(cluster={case.cluster})) against "
           "fuser.reference.evaluate(fd.fusion, host inputs)")
    return (f"--- repro ---\n{fd!r}\ninputs: fuzz_fusions.gpu_inputs(fd, rows={case.rows}, "
            f"hidden={case.hidden}, seed={case.data_seed}) as CuPy arrays; {run}")


def validate(fd: FusionDefinition, host: list, inputs: list, cluster: int | None) -> None:
    """fd.validate(inputs), or with Hints(cluster=cluster) the same comparison of the hinted
    kernel's outputs with the oracle's."""
    if cluster is None:
        fd.validate(inputs)
        return
    outputs = executor.execute(fd, inputs, hints=Hints(cluster=cluster))
    refs = evaluate(fd.fusion, host)
    compare([executor.to_host(o) for o in outputs], refs, fd.fusion,
            output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))


def run_on_gpu(case: GpuCase, counts: Counter[str]) -> None:
    """Validate one case; count and reject what does not run, raise on a mismatch or a
    failure that is not a FuserError."""
    import cupy

    try:
        fd = build(case.plan, tame=True, traps=False)
        host = gpu_inputs(fd, case.rows, case.hidden, case.data_seed)
    except FuserError as e:
        if isinstance(e, InternalError):
            raise
        counts[f"{type(e).__name__} (before running)"] += 1
        reject()
    note(repro(fd, case))
    inputs = [cupy.asarray(x) if hasattr(x, "shape") else x for x in host]
    try:
        validate(fd, host, inputs, case.cluster)
    except ValidationError:
        counts["MISMATCH"] += 1
        raise
    except CompileError as e:
        failure = NotCompiled(f"{compile_error_summary(e)}\n{repro(fd, case)}")
        known = known_failure(failure)
        if known is None:
            counts["FAILED (compile)"] += 1
            raise failure from e
        counts[f"known failure (compile): {known.test}"] += 1
        reject()
    except HintError:
        if case.cluster is None:  # no hint was given: nothing to refuse
            raise
        counts["HintError (the cluster refused)"] += 1
        reject()
    except (InternalError, BadInputError, LaunchError) as e:
        # a fuser bug by its own account; inputs made to the definition refused; a launch the
        # driver refused after every host check passed
        counts[f"FAILED ({type(e).__name__})"] += 1
        raise
    except FuserError as e:  # refused: UnsupportedFusionError, OutOfResourcesError...
        counts[f"{type(e).__name__}"] += 1
        reject()
    counts["validated"] += 1


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_fusions_match_the_oracle(shard):
    counts: Counter[str] = Counter()
    examples = -(-CASES // SHARDS)

    @seed(SEED + shard)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=gpu_cases())
    def fuzz(case):
        run_on_gpu(case, counts)

    fuzz()
    print(f"shard {shard}: {dict(counts)}")
    assert counts["validated"] >= examples, counts
