"""The kernel cache: hits, corruption recovery, atomic files, environment, threads (no GPU)."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

import fuser.cache
from fuser.cache import KernelCache, default_cache_dir
from fuser.compile import compile_cuda
from fuser.errors import ToolchainError

SOURCE = r"""
extern "C" __global__ void add_one(float* p, int n) {
  __shared__ float tile[32];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  tile[threadIdx.x % 32] = i < n ? p[i] : 0.0f;
  __syncthreads();
  if (i < n) p[i] = tile[threadIdx.x % 32] + 1.0f;
}
"""


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """Counts real compilations: each call of compile_cuda made by the cache appends its name."""
    calls: list[str] = []

    def counting(source, name, arch, include_dirs=()):
        calls.append(name)
        return compile_cuda(source, name, arch, include_dirs)

    monkeypatch.setattr(fuser.cache, "compile_cuda", counting)
    return calls


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> str:
    folder = tmp_path / "kernels"
    monkeypatch.setenv("FUSER_CACHE_DIR", str(folder))
    monkeypatch.delenv("FUSER_CACHE", raising=False)
    return str(folder)


def entry_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".fuser"))


def test_env_dir_is_used_and_files_are_written(cache_dir, compiles):
    cache = KernelCache()
    assert cache.directory == cache_dir and default_cache_dir() == cache_dir
    compiled, path = cache.get_or_compile(SOURCE, "add_one", 90)
    key = cache.key(SOURCE, "add_one", 90)
    assert entry_files(cache_dir) == [key + ".fuser"]
    assert path == os.path.join(cache_dir, key + ".cubin")
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert compiled.resource("add_one").static_smem == 128
    assert compiles == ["add_one"]


def test_default_dir_without_env(monkeypatch):
    monkeypatch.delenv("FUSER_CACHE_DIR", raising=False)
    expected = os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    assert KernelCache().directory == expected


def test_memory_and_disk_hits_do_not_recompile(cache_dir, compiles):
    first = KernelCache()
    compiled, path = first.get_or_compile(SOURCE, "add_one", 90)
    assert first.get_or_compile(SOURCE, "add_one", 90) == (compiled, path)
    assert first.stats()["memory_hits"] == 1
    # a new process (a fresh cache object) reads the disk entry back, equal in every field
    second = KernelCache()
    again, again_path = second.get_or_compile(SOURCE, "add_one", 90)
    assert again == compiled and again.cubin == compiled.cubin and again_path == path
    assert second.stats()["disk_hits"] == 1
    assert compiles == ["add_one"]


def test_every_key_component_changes_the_key(cache_dir, monkeypatch):
    cache = KernelCache()
    base = cache.key(SOURCE, "add_one", 90)
    assert base == KernelCache().key(SOURCE, "add_one", 90)
    assert (
        len(
            {
                base,
                cache.key(SOURCE + " ", "add_one", 90),
                cache.key(SOURCE, "other", 90),
                cache.key(SOURCE, "add_one", 80),
                cache.key(SOURCE, "add_one", 90, ("/templates",)),
            }
        )
        == 5
    )
    monkeypatch.setattr(fuser.cache, "nvrtc_version", lambda: (99, 0))
    assert cache.key(SOURCE, "add_one", 90) != base
    monkeypatch.undo()
    monkeypatch.setattr(fuser, "__version__", "0.0.0-other")
    assert cache.key(SOURCE, "add_one", 90) != base
    monkeypatch.undo()
    monkeypatch.setattr(fuser.cache, "_cupy_version", lambda: "0.0")
    assert cache.key(SOURCE, "add_one", 90) != base


@pytest.mark.parametrize("where", ["cubin byte", "json byte", "checksum", "format", "truncated"])
def test_corrupt_entry_is_deleted_and_recompiled(cache_dir, compiles, where, caplog):
    compiled, _ = KernelCache().get_or_compile(SOURCE, "add_one", 90)
    (name,) = entry_files(cache_dir)
    entry = os.path.join(cache_dir, name)
    with open(entry, "rb") as f:
        data = bytearray(f.read())
    header_end = data.index(b"\n", data.index(b"\n") + 1) + 1
    if where == "cubin byte":
        data[-10] ^= 0x01
    elif where == "json byte":
        data[header_end + 5] ^= 0x01
    elif where == "checksum":
        data[header_end - 2] = ord("0") if data[header_end - 2] != ord("0") else ord("1")
    elif where == "format":
        data[: data.index(b"\n")] = b"FUSER-KERNEL-CACHE 999"
    else:
        data = data[: len(data) // 2]
    with open(entry, "wb") as f:
        f.write(data)
    cache = KernelCache()
    with caplog.at_level(logging.WARNING, logger="fuser.cache"):
        again, _ = cache.get_or_compile(SOURCE, "add_one", 90)
    assert "deleting bad entry" in caplog.text
    assert compiles == ["add_one", "add_one"]
    assert again.cubin == compiled.cubin
    assert cache.stats()["bad_entries"] == 1
    # the rewritten entry is good: a third cache hits it
    third = KernelCache()
    assert third.get_or_compile(SOURCE, "add_one", 90)[0] == again
    assert compiles == ["add_one", "add_one"]


def test_missing_or_damaged_cubin_file_is_rewritten_without_compiling(cache_dir, compiles):
    compiled, path = KernelCache().get_or_compile(SOURCE, "add_one", 90)
    os.unlink(path)
    assert KernelCache().get_or_compile(SOURCE, "add_one", 90)[1] == path
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    with open(path, "r+b") as f:
        f.write(b"junk")
    KernelCache().get_or_compile(SOURCE, "add_one", 90)
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert compiles == ["add_one"]


def test_writes_leave_no_temp_files(cache_dir, compiles):
    cache = KernelCache()
    for arch in (80, 90):
        cache.get_or_compile(SOURCE, "add_one", arch)
    names = os.listdir(cache_dir)
    assert len(names) == 4
    assert all(n.endswith((".fuser", ".cubin")) and not n.startswith(".") for n in names)


def test_failed_write_removes_its_temp_file(cache_dir, compiles, monkeypatch, caplog):
    real_replace = os.replace

    def refuse(src, dst):
        if dst.endswith(".fuser"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(fuser.cache.os, "replace", refuse)
    cache = KernelCache()
    with caplog.at_level(logging.WARNING, logger="fuser.cache"):
        compiled, path = cache.get_or_compile(SOURCE, "add_one", 90)
    assert "cannot write" in caplog.text
    monkeypatch.undo()
    assert [n for n in os.listdir(cache_dir) if n.endswith(".tmp")] == []
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert entry_files(cache_dir) == []
    assert cache.get_or_compile(SOURCE, "add_one", 90) == (compiled, path)


def test_four_threads_compile_once(cache_dir, monkeypatch):
    calls = []

    def slow(source, name, arch, include_dirs=()):
        calls.append(name)
        time.sleep(0.3)  # keep the first compile running while the other threads arrive
        return compile_cuda(source, name, arch, include_dirs)

    monkeypatch.setattr(fuser.cache, "compile_cuda", slow)
    cache = KernelCache()
    start = threading.Barrier(4)
    results, errors = [], []

    def worker():
        start.wait()
        try:
            results.append(cache.get_or_compile(SOURCE, "add_one", 90))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert calls == ["add_one"]
    assert len(results) == 4 and all(r == results[0] for r in results)
    assert cache.stats()["memory_hits"] == 3


def test_cache_off_keeps_memory_only(cache_dir, compiles, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE", "0")
    cache = KernelCache()
    assert not cache.disk
    compiled, path = cache.get_or_compile(SOURCE, "add_one", 90)
    assert not os.path.exists(cache_dir)
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert cache.get_or_compile(SOURCE, "add_one", 90) == (compiled, path)
    # nothing on disk: another cache compiles again (the log differs: it has compile times)
    assert KernelCache().get_or_compile(SOURCE, "add_one", 90)[0].cubin == compiled.cubin
    assert compiles == ["add_one", "add_one"]
    assert cache.stats()["entries"] == 0


def test_clear_and_stats(cache_dir, compiles):
    cache = KernelCache()
    cache.get_or_compile(SOURCE, "add_one", 90)
    cache.get_or_compile(SOURCE, "add_one", 80)
    foreign = os.path.join(cache_dir, "notes.txt")
    with open(foreign, "w") as f:
        f.write("not ours")
    stats = cache.stats()
    assert stats["dir"] == cache_dir and stats["entries"] == 2 and stats["in_memory"] == 2
    on_disk = sum(
        os.path.getsize(os.path.join(cache_dir, n))
        for n in os.listdir(cache_dir)
        if n != "notes.txt"
    )
    assert stats["bytes"] == on_disk > 0
    cache.clear()
    assert os.listdir(cache_dir) == ["notes.txt"]
    assert cache.stats()["entries"] == 0 and cache.stats()["in_memory"] == 0
    cache.get_or_compile(SOURCE, "add_one", 90)
    assert compiles == ["add_one", "add_one", "add_one"]


def test_unwritable_cubin_file_is_a_toolchain_error(cache_dir, compiles, monkeypatch):
    def refuse(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fuser.cache, "_atomic_write", refuse)
    cache = KernelCache()
    with pytest.raises(ToolchainError, match=r"cannot write the cubin file .*FUSER_CACHE_DIR"):
        cache.get_or_compile(SOURCE, "add_one", 90)
