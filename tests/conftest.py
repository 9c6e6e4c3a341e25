"""Shared test setup: a kernel cache of the session, GPU gating, a freshly seeded random
generator per test, torch detection.

Markers (`gpu`, `slow`) are declared in pyproject.toml. A test marked `gpu` is skipped when no
CUDA device is usable, unless FUSER_REQUIRE_GPU=1, where it errors instead: a GPU run must never
pass by skipping everything.

Tests never write into the user's kernel cache (~/.cache/fuser): FUSER_CACHE_DIR points at a
temporary folder of the session, removed when it ends. FUSER_TEST_CACHE_DIR=<folder> uses (and
keeps) that folder instead, e.g. to keep compiled kernels between GPU runs. Under pytest-xdist
each build compiles one attempt at a time (FUSER_BUILD_THREADS=1, unless set).
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import tempfile

import numpy as np
import pytest

_SEED_KEY = pytest.StashKey[int]()
#: The session's cache folder, exported so pytest-xdist workers (and nested sessions) share it.
_SESSION_CACHE = "FUSER_TEST_SESSION_CACHE_DIR"


def pytest_configure(config: pytest.Config) -> None:
    """Point FUSER_CACHE_DIR at the session's folder before any test module is imported (so
    before fuser.cache.default_cache() can be created). pytest-xdist starts its workers after
    this, from this process's environment, so every worker and every subprocess a test starts
    shares the folder, and the cache's per-key file lock compiles each kernel once for all of
    them; a worker (the variable already set, its folder there) keeps it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The workers already use the CPUs: a build compiles one attempt at a time there
        # (FUSER_BUILD_THREADS still says otherwise where it is set).
        os.environ.setdefault("FUSER_BUILD_THREADS", "1")
    inherited = os.environ.get(_SESSION_CACHE)
    if inherited and os.path.isdir(inherited):
        os.environ["FUSER_CACHE_DIR"] = inherited
        return
    before = {name: os.environ.get(name) for name in ("FUSER_CACHE_DIR", _SESSION_CACHE)}
    chosen = os.environ.get("FUSER_TEST_CACHE_DIR")
    folder = os.path.abspath(chosen) if chosen else tempfile.mkdtemp(prefix="fuser-test-cache-")
    os.makedirs(folder, exist_ok=True)
    os.environ["FUSER_CACHE_DIR"] = os.environ[_SESSION_CACHE] = folder
    config.add_cleanup(functools.partial(_end_session_cache, before, None if chosen else folder))


def _end_session_cache(before: dict[str, str | None], remove: str | None) -> None:
    """Restore the environment (pytest.main() may run again in this process) and remove the
    session's temporary folder."""
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)


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
