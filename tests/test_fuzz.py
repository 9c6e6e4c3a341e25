"""CPU fuzz: random fusions (tests/fuzz_fusions.py) through analyze -> the first candidate
schedule -> its shared-memory plans -> render, and NVRTC for a sample: every outcome is a
rendered (or compiled) kernel or a FuserError; a crash, a plan violation, a kernel that does
not compile or a repr that does not rebuild the fusion fails with the shrunk repro.

`make test` runs a fixed-seed slice: 300 cases in 4 shards, about 50 of them through NVRTC
(Hypothesis draws the compile draw's small numbers often). `make fuzz` runs 10,000 over
pytest-xdist with every rendered kernel compiled and prints the outcome counts. Environment:

    FUSER_FUZZ_CASES   cases in all (300)             FUSER_FUZZ_SHARDS  test shards (4)
    FUSER_FUZZ_NVRTC   compile draw below (2 of 1000) FUSER_FUZZ_SEED    seed of shard 0 (2026)
    FUSER_FUZZ_STRICT  1: filed failure classes fail too, instead of being counted
    FUSER_FUZZ_REPORT  folder each shard writes its counts to (tests/fuzz_fusions.py summary)

Each failure class the fuzz finds stays below as a regression test (the shrunk repro of its
class): strict-xfail, with a fuzz_fusions.KNOWN entry so that long runs count it, until it is
fixed; then a plain test.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from fuzz_fusions import (
    KNOWN,
    Crash,
    PlanViolation,
    ReprMismatch,
    build,
    cases,
    check_fusion,
    check_plan,
    gpu_inputs,
    plans,
    run_case,
    summary,
    write_report,
)
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fuser import FusionDefinition
from fuser.device import DeviceSpec
from fuser.errors import FuserError
from fuser.reference import evaluate
from fuser.schedulers import Problem
from fuser.smem import SmemPlan

CASES = int(os.environ.get("FUSER_FUZZ_CASES", "300"))
SHARDS = int(os.environ.get("FUSER_FUZZ_SHARDS", "4"))
NVRTC = int(os.environ.get("FUSER_FUZZ_NVRTC", "2"))
SEED = int(os.environ.get("FUSER_FUZZ_SEED", "2026"))
STRICT = os.environ.get("FUSER_FUZZ_STRICT") == "1"
REPORT = os.environ.get("FUSER_FUZZ_REPORT")
H200 = DeviceSpec.get("h200")


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_fusions_fuzz_shard(shard):
    counts: Counter[str] = Counter()

    @seed(SEED + shard)
    @settings(max_examples=-(-CASES // SHARDS), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(NVRTC))
    def fuzz(case):
        run_case(case, counts, strict=STRICT)

    started = time.monotonic()
    try:
        fuzz()
    finally:
        if REPORT:
            write_report(REPORT, shard, counts, time.monotonic() - started)
    assert sum(counts.values()) >= CASES // SHARDS, counts


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(plan=plans(max_steps=8), rows=st.sampled_from((1, 7)), hidden=st.sampled_from((1, 3, 100)),
       data_seed=st.integers(0, 2**32 - 1))
def test_tame_fusions_stay_finite_in_the_oracle(plan, rows, hidden, data_seed):
    """The GPU fuzz's premise: a tame plan on gpu_inputs() has finite outputs, so a mismatch
    there is a wrong number, not a NaN or inf reached by another road."""
    try:
        fd = build(plan, tame=True, traps=False)
        inputs = gpu_inputs(fd, rows, hidden, data_seed)
    except FuserError:
        return
    for out in evaluate(fd.fusion, inputs):
        assert out.dtype.kind != "f" or np.isfinite(out).all(), repr(fd)


def test_plan_violations_are_caught():
    ok = SmemPlan.build([("s_a", 100, "a"), ("s_b", 4096, "b")], H200.smem_per_block_optin)
    check_plan(ok, H200, "plan")
    shifted = replace(ok, buffers=(ok.buffers[0], replace(ok.buffers[1], offset=64)))
    with pytest.raises(PlanViolation, match="offsets must be multiples of 128"):
        check_plan(shifted, H200, "plan")
    big = SmemPlan.build([("s_a", H200.smem_per_block_optin, "a")], H200.smem_per_block_optin)
    with pytest.raises(PlanViolation, match="over the device limit"):
        check_plan(big, H200, "plan")


def test_an_exception_that_is_not_a_fuser_error_is_a_crash(monkeypatch):
    import fuzz_fusions

    def broken(fusion):
        raise KeyError("T3")

    monkeypatch.setattr(fuzz_fusions, "analyze", broken)
    with pytest.raises(Crash, match="KeyError at analysis") as info:
        check_fusion(rebuilt(FIXED["int64-sum"]), Problem(8, 8, 16), H200, nvrtc=False)
    assert "fd.define_tensor(shape=[-1, -1]" in str(info.value)  # the repro


def test_the_summary_adds_up_shards(tmp_path):
    write_report(str(tmp_path), 0, Counter({"compiled [pointwise]": 2, "DefinitionError": 1}), 1)
    write_report(str(tmp_path), 1, Counter({"compiled [pointwise]": 1,
                                            "known failure (compile): test_x": 1}), 2)
    text = summary(str(tmp_path))
    assert text.startswith("fuzz: 5 cases in 2 shards (3 s of shard time), 4 through NVRTC, "
                           "0 failed"), text
    assert re.search(r"compiled \[pointwise\] +3\n", text), text


# ----- regression cases: the shrunk repro of each failure class -------------------------------


def rebuilt(body: str) -> FusionDefinition:
    """The fusion of `body`, the statements of a repr(fd)'s define_fusion."""
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return FusionDefinition.from_python(f"def define_fusion(fd):\n{lines}\n", "fuzz")


def compiles(body: str, hidden: int = 1024, device: DeviceSpec = H200) -> str:
    outcome = check_fusion(rebuilt(body), Problem(hidden, 1024, 16), device, nvrtc=True)
    assert outcome.startswith("compiled"), outcome
    return outcome


INTO_ANOTHER_TYPE = {
    # sum of Int32 / Bool accumulates in Int64 (torch.sum's type): (long long, int) / (long
    # long, bool)
    "int32-sum": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Int32)
T1 = fd.ops.sum(T0, dims=[1], keepdim=True)
fd.add_output(T1)""",
    "bool-sum": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
T1 = fd.ops.sum(T0, dims=[1], keepdim=False)
fd.add_output(T1)""",
    # sum(x, dtype=...) of another type: (double, float), (long long, float), (float, double)
    "float-sum-to-double": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
T1 = fd.ops.sum(T0, dims=[1], keepdim=True, dtype=DataType.Double)
fd.add_output(T1)""",
    "half-sum-to-int64": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Half)
T1 = fd.ops.sum(T0, dims=[1], keepdim=True, dtype=DataType.Int64)
fd.add_output(T1)""",
    "double-sum-to-float": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
T1 = fd.ops.sum(T0, dims=[1], keepdim=True, dtype=DataType.Float)
fd.add_output(T1)""",
    "float-max-to-int64": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
T1 = fd.ops.max(T0, dims=[1], keepdim=True, dtype=DataType.Int64)
fd.add_output(T1)""",
    # found by the fuzz at Problem(hidden=3, rows=1024, align_bytes=4) on a100: an Int32 input
    # minus a bf16 one is a Float, summed into Int64
    "mixed-inputs": """
T0 = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=DataType.Int32)
T1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
T2 = fd.ops.sub(T0, T1)
T3 = fd.ops.sum(T2, dims=[1], keepdim=True, dtype=DataType.Int64)
fd.add_output(T3)""",
}


@pytest.mark.parametrize("name", sorted(INTO_ANOTHER_TYPE))
def test_inner_reduction_into_another_type_compiles(name):
    compiles(INTO_ANOTHER_TYPE[name])


@pytest.mark.parametrize("hidden", [1024, 24578])
def test_max_over_bool_rows_compiles(hidden):
    compiles(MAX_OVER_BOOL_ROWS, hidden)


MAX_OVER_BOOL_ROWS = """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
T1 = fd.ops.max(T0, dims=[1], keepdim=True)
fd.add_output(T1)"""


@pytest.mark.parametrize(("dtype", "hidden"), [("Int64", 32768), ("Int32", 65536)])
def test_integer_rows_over_a_cluster_compile(dtype, hidden):
    """Found by the fuzz: rows this long are split over a cluster on sm_90."""
    compiles(integer_rows(dtype), hidden)


def integer_rows(dtype: str) -> str:
    return f"""
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.{dtype})
T1 = fd.ops.max(T0, dims=[1], keepdim=True)
fd.add_output(T1)"""


# Classes the issue filed (at 26f1f1f) that compile now: kept as regression cases.
FIXED = {
    "int64-sum": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Int64)
T1 = fd.ops.sum(T0, dims=[1], keepdim=True)
fd.add_output(T1)""",
    "int64-bool-outer-sums": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Int64)
T1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
T2 = fd.ops.add(T0, T1)
fd.add_output(fd.ops.sum(T2, dims=[0]))
fd.add_output(fd.ops.sum(T1, dims=[0]))""",
    "max-over-bool-columns": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
T1 = fd.ops.max(T0, dims=[0])
fd.add_output(T1)""",
    "double-and-float-inner-sums": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
T1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
T2 = fd.ops.add(T1, T0)
fd.add_output(fd.ops.sum(T0, dims=[1], keepdim=True))
fd.add_output(fd.ops.sum(T2, dims=[1], keepdim=True))""",
    "double-then-float-levels": """
T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
T1 = fd.ops.sum(T0, dims=[1], keepdim=True)
T2 = fd.ops.cast(fd.ops.sub(T0, T1), dtype=DataType.Float)
fd.add_output(fd.ops.max(T2, dims=[1], keepdim=True))""",
}


@pytest.mark.parametrize("hidden", [3, 4096, 24578])
@pytest.mark.parametrize("name", sorted(FIXED))
def test_filed_classes_that_compile_now(name, hidden):
    compiles(FIXED[name], hidden)


def test_every_known_class_has_its_test():
    tests = {name for name in globals() if name.startswith("test_")}
    assert {k.test for k in KNOWN} <= tests


@settings(max_examples=400, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(plan=plans(max_steps=8), rows=st.sampled_from((2, 7)), hidden=st.sampled_from((3, 100)),
       data_seed=st.integers(0, 2**32 - 1))
def test_segments_chained_on_the_oracle_equal_the_whole_fusion(plan, rows, hidden, data_seed):
    """Random fusions that one kernel cannot run (traps kept: values computed from reductions
    over the rows meet rows), cut into segments: each segment evaluated on the float64 oracle
    in order, on the fusion's inputs and earlier segments' stored outputs, gives what the
    whole fusion gives (up to float32 storage of what segments pass on)."""
    from test_segment import _segments

    try:
        fd = build(plan, tame=True, traps=True)
        segmentation = _segments(fd)
        inputs = gpu_inputs(fd, rows, hidden, data_seed)
        whole = evaluate(fd.fusion, inputs)
    except FuserError:
        return
    if segmentation is None:
        return
    values = dict(zip(segmentation.lowered.inputs, inputs, strict=True))
    for s in segmentation.segments:
        values.update(zip(s.outputs, evaluate(s.definition.fusion, s.arguments(values)),
                          strict=True))
    for out, got, expected in zip(fd.fusion.outputs, (values[o] for o in
                                  segmentation.lowered.outputs), whole, strict=True):
        assert got.shape == expected.shape, repr(fd)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True,
                                   err_msg=f"{out.name}\n{fd!r}")


def test_a_fusion_whose_repr_does_not_rebuild_is_a_failure_not_an_outcome():
    """repr(fd) of any fusion fuser made (a segment too) must rebuild it: an empty segment's
    did not, and the fuzz counted it as an outcome (978 cases) instead of failing."""
    from fuser.ir import Fusion

    empty = FusionDefinition.from_fusion(Fusion(), "empty_segment")
    with pytest.raises(ReprMismatch, match=r"repr\(fd\) does not rebuild"):
        check_fusion(empty, Problem(64, 64, 16), DeviceSpec.get("h200"), False)
