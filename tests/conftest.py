"""Shared test setup: GPU gating, a freshly seeded random generator per test, torch detection.

Markers (`gpu`, `slow`) are declared in pyproject.toml. A test marked `gpu` is skipped when no
CUDA device is usable, unless FUSER_REQUIRE_GPU=1, where it errors instead: a GPU run must never
pass by skipping everything.
"""

from __future__ import annotations

import functools
import os
import secrets

import numpy as np
import pytest

_SEED_KEY = pytest.StashKey[int]()


@functools.lru_cache(maxsize=1)
def _gpu_status() -> tuple[bool, str]:
    """(usable, why not), probed once per session and only when a gpu test is about to run."""
    try:
        import cupy

        if cupy.cuda.is_available():
            return True, ""
        return False, "cupy.cuda.is_available() is False"
    except Exception as exc:  # ImportError, driver errors, anything: no usable GPU
        return False, f"{type(exc).__name__}: {exc}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    usable, why = _gpu_status()
    if usable:
        return
    if os.environ.get("FUSER_REQUIRE_GPU") == "1":
        pytest.fail(f"FUSER_REQUIRE_GPU=1 but no usable CUDA device ({why})", pytrace=False)
    pytest.skip(f"needs a CUDA GPU ({why})")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy Generator with a fresh seed per test; FUSER_SEED=<n> replays a reported seed."""
    seed = int(os.environ.get("FUSER_SEED") or secrets.randbits(32))
    request.node.stash[_SEED_KEY] = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    seed = item.stash.get(_SEED_KEY, None)
    if seed is not None and report.failed:
        report.sections.append(
            ("rng seed", f"seed {seed}: rerun with FUSER_SEED={seed} pytest '{item.nodeid}'")
        )
    return report


@pytest.fixture(scope="session")
def has_torch_cuda() -> bool:
    """Whether PyTorch is installed and sees a CUDA device (torch is an optional extra)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False
