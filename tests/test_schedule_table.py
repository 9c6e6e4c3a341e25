"""CPU: the default candidate schedules of every ready fusion against the recorded table
(tests/goldens/schedules.txt, written by tests/schedule_table.py). A change to a default
decision fails here; after an intended one, FUSER_UPDATE_GOLDENS=1 pytest
tests/test_schedule_table.py rewrites the table, and its diff is reviewed with the commit."""

from __future__ import annotations

import os
from pathlib import Path

from tests.schedule_table import table

GOLDEN = Path(__file__).parent / "goldens" / "schedules.txt"


def test_candidate_schedules_match_the_recorded_table():
    text = table()
    if os.environ.get("FUSER_UPDATE_GOLDENS") == "1":
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"no {GOLDEN.name}; run with FUSER_UPDATE_GOLDENS=1"
    recorded = GOLDEN.read_text().splitlines()
    now = text.splitlines()
    changed = [f"- {a}\n+ {b}" for a, b in zip(recorded, now, strict=False) if a != b]
    assert len(recorded) == len(now) and not changed, (
        f"{len(changed)} line(s) differ from {GOLDEN.name} ({len(recorded)} recorded, "
        f"{len(now)} now); the first:\n" + "\n".join(changed[:5]))
