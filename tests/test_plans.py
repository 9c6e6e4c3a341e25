"""CPU: build plans (fuser.plans) let a process whose kernel is cached skip the schedule search
and the rendering, and never stand in for a build they do not describe."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fuser.kernels as kernels
import fuser.plans as plans
from fuser import DataType
from fuser.analysis import analyze
from fuser.cache import KernelCache
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints, Problem

H200 = DeviceSpec.get("h200")


def _built(cache: KernelCache, name: str = "rmsnorm_bwd", hidden: int = 4096,
           hints: Hints | None = None, device: DeviceSpec = H200, eps: float | None = None):
    fd = FUSIONS[name](DataType.BFloat16) if eps is None else FUSIONS[name](
        DataType.BFloat16, eps=eps)
    return kernels.build(fd.name, analyze(fd.fusion), Problem(hidden, 64, 16), device, hints,
                         cache)


@pytest.fixture
def searches(monkeypatch) -> list[str]:
    """Counts schedule searches: each start of kernels._attempts appends the fusion's name."""
    calls: list[str] = []
    real = kernels._attempts

    def counting(name, *args):
        calls.append(name)
        return real(name, *args)

    monkeypatch.setattr(kernels, "_attempts", counting)
    return calls


def _plan_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".plan"))


def test_a_held_plan_builds_the_same_kernel_without_a_search(tmp_path, searches):
    first = _built(KernelCache(str(tmp_path)))
    assert searches == ["rmsnorm_bwd"] and len(_plan_files(tmp_path)) == 1
    again = KernelCache(str(tmp_path))  # another process: nothing in memory
    second = _built(again)
    assert searches == ["rmsnorm_bwd"]  # no second search
    assert (second.schedule, second.finalize, second.source) == (
        first.schedule, first.finalize, first.source)
    assert second.compiled.cubin == first.compiled.cubin
    assert again.stats()["plan_hits"] == 1 and again.stats()["compiles"] == 0


def test_the_plan_key_covers_what_a_build_depends_on(monkeypatch):
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    info = analyze(fd.fusion)
    problem = Problem(4096, 64, 16)
    base = plans.plan_key(fd.name, info, problem, H200, None)
    other_eps = analyze(FUSIONS["rmsnorm_fwd"](DataType.BFloat16, eps=1e-5).fusion)
    eps = analyze(FUSIONS["rmsnorm_fwd"](DataType.BFloat16, eps=1e-6).fusion)
    assert (plans.plan_key("f", eps, problem, H200, None)
            != plans.plan_key("f", other_eps, problem, H200, None))
    variants = [
        plans.plan_key("other_name", info, problem, H200, None),
        plans.plan_key(fd.name, info, Problem(4096, 64, 8), H200, None),
        plans.plan_key(fd.name, info, Problem(4096, 1024, 16), H200, None),
        plans.plan_key(fd.name, info, problem, DeviceSpec.get("a100"), None),
        plans.plan_key(fd.name, info, problem, H200, Hints(threads_per_row=128)),
    ]
    monkeypatch.setattr(plans, "code_digest", lambda: "other code")
    variants.append(plans.plan_key(fd.name, info, problem, H200, None))
    monkeypatch.undo()
    monkeypatch.setattr(plans, "nvrtc_key", lambda: "another nvrtc")
    variants.append(plans.plan_key(fd.name, info, problem, H200, None))
    assert base not in variants and len(set(variants)) == len(variants)


def test_code_digest_changes_with_a_template(tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "row_kernel.cu.j2").write_text("a")
    monkeypatch.setattr(plans, "template_dir", lambda: templates)
    plans.code_digest.cache_clear()
    try:
        before = plans.code_digest()
        (templates / "row_kernel.cu.j2").write_text("ab")
        plans.code_digest.cache_clear()
        assert plans.code_digest() != before
    finally:
        plans.code_digest.cache_clear()


@pytest.mark.parametrize("damage", [b"", b"FUSER-BUILD-PLAN\nnot a digest\n", "payload"])
def test_a_damaged_plan_is_deleted_and_searched_again(tmp_path, searches, damage, caplog):
    _built(KernelCache(str(tmp_path)))
    (plan,) = _plan_files(tmp_path)
    path = tmp_path / plan
    if damage == "payload":  # a whole file whose pickle is not a plan: checksum right
        cache = KernelCache(str(tmp_path))
        cache.store_plan(plan.removesuffix(".plan"), b"not a pickle")
    else:
        path.write_bytes(damage)
    again = KernelCache(str(tmp_path))
    built = _built(again)
    assert searches == ["rmsnorm_bwd", "rmsnorm_bwd"]
    assert again.stats()["bad_plans"] == 1 and built.schedule is not None
    assert _plan_files(tmp_path) == [plan]  # stored afresh
    assert plans.decode(path.read_bytes().split(b"\n", 2)[2])[2] == built.source


def test_a_plan_whose_module_was_evicted_compiles_it_from_the_stored_source(tmp_path, searches):
    first = _built(KernelCache(str(tmp_path)))
    for name in os.listdir(tmp_path):
        if name.endswith((".fuser", ".cubin")):
            os.unlink(tmp_path / name)
    again = KernelCache(str(tmp_path))
    second = _built(again)
    assert searches == ["rmsnorm_bwd"] and again.stats()["compiles"] == 1
    assert second.source == first.source


def test_clear_and_eviction_take_plans_too(tmp_path):
    cache = KernelCache(str(tmp_path))
    _built(cache)
    assert cache.stats()["plans"] == 1
    cache.clear()
    assert _plan_files(tmp_path) == [] and cache.stats()["plans"] == 0
    small = KernelCache(str(tmp_path), max_bytes=1)
    _built(small, hidden=4096)
    _built(small, hidden=2048)  # evicts the first kernel: its entry, cubin and plan
    assert small.stats()["plans"] == 1 and small.stats()["entries"] == 1


HIT_PROBE = """
import sys
from fuser import DataType
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.kernels import build
from fuser.schedulers import Problem
fd = FUSIONS["layernorm_bwd"](DataType.BFloat16)
built = build(fd.name, analyze(fd.fusion), Problem(8192, 64, 16), DeviceSpec.get("h200"))
heavy = [m for m in ("jinja2", "fuser.codegen", "fuser.schedulers.inner_outer_persistent",
                     "fuser.schedulers.row_search") if m in sys.modules]
print("imported:", ",".join(heavy) or "nothing", built.schedule.reason)
"""


def test_a_process_whose_plan_is_held_imports_no_renderer_or_scheduler(tmp_path):
    """A first call whose kernel and plan are on disk skips Jinja, codegen and the row
    search (about 75 ms of imports, and the search and rendering, on this machine)."""
    env = {**os.environ, "FUSER_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", HIT_PROBE], env=env, check=True,
                           capture_output=True, text=True).stdout
    assert first.startswith("imported: jinja2")
    again = subprocess.run([sys.executable, "-c", HIT_PROBE], env=env, check=True,
                           capture_output=True, text=True).stdout
    assert again.startswith("imported: nothing ")
    assert again.split(" ", 2)[2] == first.split(" ", 2)[2]  # the same schedule


def test_code_digest_ignores_bytecode_and_sees_nested_modules(tmp_path, monkeypatch):
    """Python rewrites __pycache__ as it likes: a digest over it would miss every stored plan
    after a recompile; a module in a subpackage counts like any other."""
    import fuser

    package = tmp_path / "fuser"
    (package / "schedulers").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "__init__.py").write_text("")
    (package / "schedulers" / "policy.py").write_text("A = 1")
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "row_kernel.cu.j2").write_text("a")
    monkeypatch.setattr(fuser, "__file__", str(package / "__init__.py"))
    monkeypatch.setattr(plans, "template_dir", lambda: templates)

    def digest():
        plans.code_digest.cache_clear()
        return plans.code_digest()

    try:
        before = digest()
        (package / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
        assert digest() == before
        (package / "schedulers" / "policy.py").write_text("A = 20")
        assert digest() != before
    finally:
        plans.code_digest.cache_clear()
