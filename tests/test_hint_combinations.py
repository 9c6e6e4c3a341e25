"""CPU: random combinations of hints (tests/hint_draws.py) are honoured or refused, offline.

Each draw is explained (classified, scheduled, rendered and compiled by NVRTC, no GPU) on a
device preset: it either raises a HintError that names the hints, or gives kernels that do
what every hint says (test_hints.unhonoured) and that ptxas compiled without spilling. Any
other exception fails. tests/test_gpu_hint_combinations.py runs the same draws on the GPU
against the float64 reference.
"""

from __future__ import annotations

from collections import Counter

from hint_draws import HintCase, hint_cases
from hypothesis import HealthCheck, given, note, seed, settings
from hypothesis import strategies as st
from test_hints import unhonoured

from fuser import HintError
from fuser.cli import shapes_of
from fuser.explain import explain
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints

DEVICES = ("h100", "h200", "a100", "sm89-100kb")
EXAMPLES = 200


def outcome(case: HintCase, device: str) -> str:
    """'honoured' or 'refused'; raises AssertionError for kernels that do otherwise than the
    hints say or spill, and whatever else explain raises."""
    fd = FUSIONS[case.name](case.dtype)
    hints = Hints(**case.hints)
    try:
        report = explain(fd, shapes_of(fd, case.rows, case.hidden), device=device, hints=hints)
    except HintError as exc:
        assert "Hints(" in str(exc), f"{case} on {device}: the refusal names no hints: {exc}"
        return "refused"
    wrong = unhonoured(report.schedule, hints, report.finalize)
    assert not wrong, f"{case} on {device}: not as hinted: {'; '.join(wrong)}"
    spills = {entry: (r.spill_stores, r.spill_loads) for entry, r in report.resources.items()
              if r.spill_stores or r.spill_loads}
    assert not spills, f"{case} on {device}: spilled (stores, loads): {spills}"
    return "honoured"


def test_hint_combinations_are_honoured_unspilled_or_refused_naming_the_hints():
    counts: Counter[str] = Counter()

    @seed(2026)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=hint_cases(max_elements=2**26), device=st.sampled_from(DEVICES))
    def draw(case, device):
        note(f"{case} on {device}")
        counts[outcome(case, device)] += 1

    draw()
    print(dict(counts))
    # The draws must reach kernels, not only refusals: a strategy that drifted into hints
    # nothing honours would pass without testing a kernel.
    assert counts["honoured"] >= EXAMPLES // 16, counts
