"""CPU: rendered CUDA against checked-in goldens, so every change to what fuser generates is
seen in review. After an intended change: FUSER_UPDATE_GOLDENS=1 pytest tests/test_goldens.py,
then read the diff of tests/goldens/ before committing it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fuser import DataType
from fuser.analysis import analyze
from fuser.codegen import render_pointwise, render_row, templates_hash
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.schedulers import Problem, schedule
from fuser.schedulers.base import PointwiseSchedule
from fuser.schedulers.inner_outer_persistent import finalize_heuristic

GOLDENS = Path(__file__).parent / "goldens"
CASES = [("rmsnorm_fwd", 4096), ("softmax_fwd", 1024), ("dropout_rmsnorm_bwd", 24578),
         ("layernorm_bwd", 8192)]


def render(name: str, hidden: int) -> str:
    info = analyze(FUSIONS[name](DataType.BFloat16).fusion)
    problem = Problem(hidden, 16384, 16)
    device = DeviceSpec.get("h200")
    s = schedule(info, problem, device)
    if isinstance(s, PointwiseSchedule):
        return render_pointwise(name, info, s).source
    final = finalize_heuristic(info, problem, device) if info.outer_reductions else None
    # The templates' hash is in the header; the golden holds a placeholder so that it shows
    # only what the change to the templates did to the source.
    return render_row(name, info, s, final).source.replace(templates_hash(), "<templates>")


@pytest.mark.parametrize(("name", "hidden"), CASES)
def test_rendered_source_matches_golden(name, hidden):
    path = GOLDENS / f"{name}_{hidden}_bf16_h200.cu"
    text = render(name, hidden)
    if os.environ.get("FUSER_UPDATE_GOLDENS") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden {path.name}; run with FUSER_UPDATE_GOLDENS=1"
    assert text == path.read_text(), f"{path.name} changed; see the module docstring"


def test_templates_hold_no_device_side_traps():
    """Nothing the host can check is checked on the device: no assert, trap or printf."""
    templates = Path(__file__).resolve().parent.parent / "templates"
    for path in templates.glob("*"):
        if path.suffix in (".j2", ".cuh"):
            text = path.read_text()
            for word in ("assert(", "__trap", "asm(\"trap", "printf("):
                assert word not in text, f"{path.name} contains {word}"
