"""The Makefile's compute-sanitizer selections pick the GPU tests they name.

`make memcheck` and friends run on the GPU machine only; a -k expression that drifts from
the test ids (a renamed test, a changed parameter id) would make them sanitize nothing or
only part of what the Makefile comment promises. This checks the selections offline.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import sanitize  # noqa: E402

from fuser.fusions import ROW_FUSIONS  # noqa: E402


def makefile_selection(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{name} \?= (.*)$", text, re.MULTILINE)
    assert match, f"{name} missing from the Makefile"
    return match.group(1)


@pytest.fixture(scope="module")
def selected() -> dict[str, list[str]]:
    files = makefile_selection("SANITIZE_FILES").split()
    return {name: sanitize.collect(files, makefile_selection(name))
            for name in ("SANITIZE_TESTS", "RACECHECK_TESTS")}


def test_memcheck_covers_every_storage_cluster_ring_and_copy(selected):
    tests = selected["SANITIZE_TESTS"]
    assert any("seed_case" in t for t in tests)
    assert any("each_storage_path" in t for t in tests)
    for fusion in ROW_FUSIONS:
        assert any(fusion in t and "cluster2" in t for t in tests), fusion
        assert any(fusion in t and "4096-7-BFloat16" in t for t in tests), fusion
    assert any("aligned_copy_matches_reference" in t for t in tests)
    assert any("staging_ring" in t for t in tests)
    outer = [t for t in tests if "every_cluster_size" in t]
    assert len(outer) == 10  # both BatchNorms at clusters of 1, 2, 4, 8 and 16
    assert sum("rows_held" in t for t in tests) == 4  # every held schedule's test
    assert sum("wider_slabs" in t for t in tests) == 8  # the means: 4 shapes, 2 dtypes
    assert sum("masked_mean_matches" in t for t in tests) == 5  # the spread count, bf16


def test_racecheck_is_a_subset_with_one_persistent_and_cluster_kernel_per_fusion(selected):
    race, mem = selected["RACECHECK_TESTS"], set(selected["SANITIZE_TESTS"])
    assert set(race) <= mem
    assert len(race) < len(mem)
    for fusion in ROW_FUSIONS:
        assert any(fusion in t and "cluster2" in t for t in race), fusion
    assert sum("staging_ring" in t for t in race) == 4
    assert sum("every_cluster_size" in t for t in race) == 5
    assert sum("rows_held" in t for t in race) == 1
    assert sum("wider_slabs" in t for t in race) == 2  # the mean of [128, 64, 2048], 2 dtypes


def test_unknown_selection_is_refused():
    assert sanitize.collect(["tests/test_gpu_fusions.py"], "no_such_test_anywhere") == []
    assert sanitize.main(["--tool", "memcheck", "-k", "no_such_test_anywhere"]) == 1


def test_tool_outside_the_four_is_refused(capsys):
    with pytest.raises(SystemExit):
        sanitize.parse_args(["--tool", "leakcheck"])
    assert "invalid choice" in capsys.readouterr().err
