"""The kernel cache: hits, corruption recovery, atomic files, environment, threads, processes,
OS errors (read-only folder, unreadable entry, folders and files in the wrong places, no
space), the size cap (no GPU)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import multiprocessing
import os
import tempfile
import threading
import time

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

import fuser.cache
from fuser.cache import DEFAULT_MAX_BYTES, KernelCache, default_cache_dir, max_cache_bytes
from fuser.compile import CompiledModule, KernelResources, compile_cuda
from fuser.errors import BadInputError, ToolchainError

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


def both(cache: KernelCache, *args) -> tuple[CompiledModule, str]:
    """The module and its cubin file, as a build that is then explained asks for them."""
    return cache.get_or_compile(*args), cache.cubin_file(*args)


def entry_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".fuser"))


def test_env_dir_is_used_and_files_are_written(cache_dir, compiles):
    cache = KernelCache()
    assert cache.directory == cache_dir and default_cache_dir() == cache_dir
    compiled, path = both(cache, SOURCE, "add_one", 90)
    key = cache.key(SOURCE, "add_one", 90)
    assert entry_files(cache_dir) == [key + ".fuser"]
    assert path == os.path.join(cache_dir, key + ".cubin")
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert compiled.resource("add_one").static_smem == 128
    assert compiles == ["add_one"]


def test_default_dir_without_env(monkeypatch):
    monkeypatch.delenv("FUSER_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    expected = os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    assert KernelCache().directory == expected


def test_xdg_cache_home_is_honoured_and_fuser_cache_dir_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("FUSER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "fuser")
    assert KernelCache().directory == str(tmp_path / "xdg" / "fuser")
    # the XDG rules: a relative XDG_CACHE_HOME is ignored
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "fuser")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == str(tmp_path / "mine")


def test_the_test_session_never_uses_the_users_cache():
    """tests/conftest.py points FUSER_CACHE_DIR at a folder of the session (issue 13: `make
    test` wrote 64 MB into ~/.cache/fuser)."""
    folder = os.environ["FUSER_CACHE_DIR"]
    assert folder == os.environ["FUSER_TEST_SESSION_CACHE_DIR"] and os.path.isdir(folder)
    assert default_cache_dir() == folder
    users = [os.path.join(os.path.expanduser("~"), ".cache", "fuser")]
    if os.path.isabs(os.environ.get("XDG_CACHE_HOME", "")):
        users.append(os.path.join(os.environ["XDG_CACHE_HOME"], "fuser"))
    if not os.environ.get("FUSER_TEST_CACHE_DIR"):
        assert os.path.abspath(folder) not in [os.path.abspath(u) for u in users]


def test_memory_and_disk_hits_do_not_recompile(cache_dir, compiles):
    first = KernelCache()
    compiled, path = both(first, SOURCE, "add_one", 90)
    assert both(first, SOURCE, "add_one", 90) == (compiled, path)
    assert first.stats()["memory_hits"] == 1
    # a new process (a fresh cache object) reads the disk entry back, equal in every field
    second = KernelCache()
    again, again_path = both(second, SOURCE, "add_one", 90)
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
    monkeypatch.setattr(fuser.cache, "nvrtc_key", lambda: "nvrtc 99.0")
    assert cache.key(SOURCE, "add_one", 90) != base
    monkeypatch.undo()
    monkeypatch.setattr(fuser, "__version__", "0.0.0-other")
    assert cache.key(SOURCE, "add_one", 90) != base


@pytest.mark.parametrize("where", ["cubin byte", "json byte", "checksum", "format", "truncated"])
def test_corrupt_entry_is_deleted_and_recompiled(cache_dir, compiles, where, caplog):
    compiled, _ = both(KernelCache(), SOURCE, "add_one", 90)
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
        again, _ = both(cache, SOURCE, "add_one", 90)
    assert "deleting bad entry" in caplog.text
    assert compiles == ["add_one", "add_one"]
    assert again.cubin == compiled.cubin
    assert cache.stats()["bad_entries"] == 1
    # the rewritten entry is good: a third cache hits it
    third = KernelCache()
    assert both(third, SOURCE, "add_one", 90)[0] == again
    assert compiles == ["add_one", "add_one"]


def test_missing_or_damaged_cubin_file_is_rewritten_without_compiling(cache_dir, compiles):
    compiled, path = both(KernelCache(), SOURCE, "add_one", 90)
    os.unlink(path)
    assert both(KernelCache(), SOURCE, "add_one", 90)[1] == path
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    with open(path, "r+b") as f:
        f.write(b"junk")
    both(KernelCache(), SOURCE, "add_one", 90)
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert compiles == ["add_one"]


def test_writes_leave_no_temp_files(cache_dir, compiles):
    cache = KernelCache()
    for arch in (80, 90):
        both(cache, SOURCE, "add_one", arch)
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
        compiled, path = both(cache, SOURCE, "add_one", 90)
    assert "cannot write" in caplog.text
    monkeypatch.undo()
    assert [n for n in os.listdir(cache_dir) if n.endswith(".tmp")] == []
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert entry_files(cache_dir) == []
    assert both(cache, SOURCE, "add_one", 90) == (compiled, path)


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
            results.append(both(cache, SOURCE, "add_one", 90))
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
    compiled, path = both(cache, SOURCE, "add_one", 90)
    assert not os.path.exists(cache_dir)
    with open(path, "rb") as f:
        assert f.read() == compiled.cubin
    assert both(cache, SOURCE, "add_one", 90) == (compiled, path)
    # nothing on disk: another cache compiles again (the log differs: it has compile times)
    assert both(KernelCache(), SOURCE, "add_one", 90)[0].cubin == compiled.cubin
    assert compiles == ["add_one", "add_one"]
    assert cache.stats()["entries"] == 0


def test_clear_and_stats(cache_dir, compiles):
    cache = KernelCache()
    both(cache, SOURCE, "add_one", 90)
    both(cache, SOURCE, "add_one", 80)
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
    both(cache, SOURCE, "add_one", 90)
    assert compiles == ["add_one", "add_one", "add_one"]


def test_unwritable_cubin_file_is_a_toolchain_error(cache_dir, compiles, monkeypatch):
    def refuse(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fuser.cache, "_atomic_write", refuse)
    cache = KernelCache()
    with pytest.raises(ToolchainError, match=r"cannot write the cubin file .*FUSER_CACHE_DIR"):
        both(cache, SOURCE, "add_one", 90)


# --- OS errors: each recovered from (recompile, memory only with one warning) or a FuserError


def refuse_changes(monkeypatch, folder: str, code: int = errno.EACCES) -> None:
    """Make `folder` refuse every change (create, write-open, rename, delete, mkdir, utime)
    with OSError(`code`), as a read-only folder does. Permission bits alone do not stop root
    (these tests may run as root), so the refusal is made by the os functions themselves."""
    folder = os.path.abspath(folder)

    def inside(path) -> bool:
        path = os.path.abspath(os.fspath(path))
        return path == folder or path.startswith(folder + os.sep)

    def refuse(path):
        raise OSError(code, os.strerror(code), os.fspath(path))

    real_open = os.open

    def guarded_open(path, flags, *args, **kwargs):
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC)
        if inside(path) and (writes or (flags & os.O_CREAT and not os.path.exists(path))):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def guard(name, arg=0):
        real = getattr(os, name)

        def guarded(*args, **kwargs):
            if inside(args[arg]):
                refuse(args[arg])
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, guarded)

    monkeypatch.setattr(os, "open", guarded_open)
    for name in ("unlink", "remove", "mkdir", "utime", "rmdir"):
        guard(name)
    guard("replace", 1)
    guard("rename", 1)


def flip_byte(path: str, offset: int = -10) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[offset] ^= 0x01
        f.seek(0)
        f.write(data)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def warnings_with(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_read_only_folder_with_a_corrupt_entry_recompiles_into_memory(
        cache_dir, compiles, monkeypatch, caplog):
    compiled, path = both(KernelCache(), SOURCE, "add_one", 90)
    entry = os.path.join(cache_dir, KernelCache().key(SOURCE, "add_one", 90) + ".fuser")
    flip_byte(entry)
    flip_byte(path)
    before = {n: read(os.path.join(cache_dir, n)) for n in os.listdir(cache_dir)}
    with monkeypatch.context() as m:
        refuse_changes(m, cache_dir)
        cache = KernelCache()
        with caplog.at_level(logging.WARNING, logger="fuser.cache"):
            again, again_path = both(cache, SOURCE, "add_one", 90)
            both(cache, SOURCE, "add_one", 80)
    assert again.cubin == compiled.cubin and read(again_path) == compiled.cubin
    assert not again_path.startswith(cache_dir + os.sep)  # the folder's cubin is damaged
    assert warnings_with(caplog, "deleting bad entry") == 1
    assert warnings_with(caplog, "cannot write") == 1  # one warning, however many kernels
    assert "Permission denied" in caplog.text and "point FUSER_CACHE_DIR at a folder" in caplog.text
    assert {n: read(os.path.join(cache_dir, n)) for n in os.listdir(cache_dir)} == before
    assert compiles == ["add_one", "add_one", "add_one"]
    assert cache.stats()["writable"] is False and cache.stats()["bad_entries"] == 1


def test_read_only_folder_with_good_entries_still_serves_them(cache_dir, compiles, monkeypatch):
    compiled, path = both(KernelCache(), SOURCE, "add_one", 90)
    with monkeypatch.context() as m:
        refuse_changes(m, cache_dir, errno.EROFS)
        assert both(KernelCache(), SOURCE, "add_one", 90) == (compiled, path)
    assert compiles == ["add_one"]


def test_unreadable_entry_is_recompiled_and_replaced(cache_dir, compiles, monkeypatch, caplog):
    compiled, _ = both(KernelCache(), SOURCE, "add_one", 90)
    entry = os.path.join(cache_dir, KernelCache().key(SOURCE, "add_one", 90) + ".fuser")
    os.chmod(entry, 0)
    real_open = os.open

    def unreadable(path, flags, *args, **kwargs):  # root reads through mode 0: refuse anyway
        if os.fspath(path) == entry and os.stat(entry).st_mode & 0o777 == 0:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), entry)
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "open", unreadable)
        cache = KernelCache()
        with caplog.at_level(logging.WARNING, logger="fuser.cache"):
            again, path = both(cache, SOURCE, "add_one", 90)
    assert f"cannot read {entry}" in caplog.text and "recompiling" in caplog.text
    assert again.cubin == compiled.cubin and read(path) == compiled.cubin
    assert cache.stats()["unreadable_entries"] == 1 and cache.stats()["writable"]
    # the recompile replaced the unreadable file: a new cache hits it
    assert both(KernelCache(), SOURCE, "add_one", 90)[0] == again
    assert compiles == ["add_one", "add_one"]


def test_entry_path_that_is_a_folder_is_left_alone_and_the_kernel_kept_in_memory(
        cache_dir, compiles, caplog):
    key = KernelCache().key(SOURCE, "add_one", 90)
    entry = os.path.join(cache_dir, key + ".fuser")
    os.makedirs(entry)
    with open(os.path.join(entry, "someone's file"), "w") as f:
        f.write("not ours")
    cache = KernelCache()
    with caplog.at_level(logging.WARNING, logger="fuser.cache"):
        compiled, path = both(cache, SOURCE, "add_one", 90)
    assert f"{entry} is a folder where fuser keeps a file: remove that folder" in caplog.text
    assert read(path) == compiled.cubin and path == os.path.join(cache_dir, key + ".cubin")
    assert os.listdir(entry) == ["someone's file"]
    assert cache.stats()["writable"]  # one entry's problem does not stop the folder
    assert both(cache, SOURCE, "add_one", 80)[1].startswith(cache_dir + os.sep)
    assert compiles == ["add_one", "add_one"]


def test_a_cubin_path_that_is_a_folder_falls_back_to_a_temporary_file(cache_dir, compiles):
    key = KernelCache().key(SOURCE, "add_one", 90)
    os.makedirs(os.path.join(cache_dir, key + ".cubin"))
    compiled, path = both(KernelCache(), SOURCE, "add_one", 90)
    assert not path.startswith(cache_dir + os.sep) and read(path) == compiled.cubin


def test_cache_dir_that_is_a_file_keeps_kernels_in_memory_with_one_warning(
        tmp_path, monkeypatch, compiles, caplog):
    folder = tmp_path / "not-a-folder"
    folder.write_text("a file")
    monkeypatch.setenv("FUSER_CACHE_DIR", str(folder))
    cache = KernelCache()
    with caplog.at_level(logging.WARNING, logger="fuser.cache"):
        for arch in (90, 80, 90):
            compiled, path = both(cache, SOURCE, "add_one", arch)
            assert read(path) == compiled.cubin
    assert warnings_with(caplog, "cannot write") == 1 and len(caplog.records) == 1
    assert f"{folder} (or a folder above it) is a file: point FUSER_CACHE_DIR" in caplog.text
    assert folder.read_text() == "a file"
    assert compiles == ["add_one", "add_one"]
    stats = cache.stats()
    assert stats["entries"] == 0 and not stats["writable"] and stats["memory_hits"] == 1
    cache.clear()  # nothing to list in a file: no error either
    assert folder.read_text() == "a file"


@pytest.mark.parametrize("resources", ["none", "another kernel's"])
def test_entry_missing_a_kernels_resources_is_recompiled(cache_dir, compiles, resources, caplog):
    compiled, _ = both(KernelCache(), SOURCE, "add_one", 90)
    key = KernelCache().key(SOURCE, "add_one", 90)
    kept = () if resources == "none" else (dataclasses.replace(compiled.resources[0],
                                                               name="other"),)
    with open(os.path.join(cache_dir, key + ".fuser"), "wb") as f:  # checksum and all valid
        f.write(fuser.cache._encode(key, dataclasses.replace(compiled, resources=kept)))
    cache = KernelCache()
    with caplog.at_level(logging.WARNING, logger="fuser.cache"):
        again, _ = both(cache, SOURCE, "add_one", 90)
    assert "no ptxas resource report for kernel(s) ['add_one']" in caplog.text
    assert again.resource("add_one") == compiled.resource("add_one")
    assert compiles == ["add_one", "add_one"] and cache.stats()["bad_entries"] == 1
    assert both(KernelCache(), SOURCE, "add_one", 90)[0] == again


def _no_space_under(monkeypatch, root: str) -> None:
    """os.write into any file under `root` fails with ENOSPC, as on a full disk."""
    real_write = os.write

    def full(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(root + os.sep):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("full", ["cache", "cache and temp"])
def test_no_space_left(tmp_path, cache_dir, compiles, monkeypatch, caplog, full):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    cache = KernelCache()
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="fuser.cache"):
        _no_space_under(m, cache_dir if full == "cache" else str(tmp_path))
        if full == "cache":
            compiled, path = both(cache, SOURCE, "add_one", 90)
            assert path.startswith(str(temp) + os.sep) and read(path) == compiled.cubin
        else:  # the kernel still runs (from memory); only a file for the tools is refused
            assert cache.get_or_compile(SOURCE, "add_one", 90).cubin
            with pytest.raises(ToolchainError, match=(
                    r"cannot write the cubin file [0-9a-f]{64}\.cubin, which explain and "
                    rf"disassemblers read the kernel from: not in {cache_dir} \(.*No space "
                    rf"left.*\) nor in a temporary folder under {temp} \(.*No space left.*\)\. "
                    r"Free disk space")):
                cache.cubin_file(SOURCE, "add_one", 90)
    assert warnings_with(caplog, "cannot write") == 1
    assert "lower FUSER_CACHE_MAX_BYTES" in caplog.text
    leftovers = [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith(".tmp")]
    assert leftovers == [] and entry_files(cache_dir) == []
    # space again: the same cache works (in memory, as it said), a new one writes the folder
    again, path = both(cache, SOURCE, "add_one", 90)
    assert read(path) == again.cubin and path.startswith(str(temp) + os.sep)
    both(KernelCache(), SOURCE, "add_one", 90)
    assert len(entry_files(cache_dir)) == 1
    assert compiles == ["add_one"] * 2


def test_a_folder_failing_every_read_and_write_still_builds(tmp_path, compiles, monkeypatch,
                                                           caplog):
    """EIO on every open, rename and delete in the folder: the entry is unreadable (one
    warning), writes stop (one warning), the kernel comes from a fresh compile in memory."""
    folder = str(tmp_path / "kernels")
    first, _ = both(KernelCache(folder), SOURCE, "add_one", 90)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="fuser.cache"):
        refuse_changes(m, folder, errno.EIO)
        real_open = os.open

        def no_reads(path, flags, *args, **kwargs):
            if os.path.abspath(os.fspath(path)).startswith(folder + os.sep):
                raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
            return real_open(path, flags, *args, **kwargs)

        m.setattr(os, "open", no_reads)
        cache = KernelCache(folder)
        compiled, path = both(cache, SOURCE, "add_one", 90)
    assert compiled.cubin == first.cubin and read(path) == first.cubin
    assert not path.startswith(folder + os.sep)
    assert warnings_with(caplog, "cannot read") == 1 and warnings_with(caplog, "cannot write") == 1
    assert "Input/output error" in caplog.text and "FUSER_CACHE=0" in caplog.text
    assert compiles == ["add_one", "add_one"]


# --- cubin files: written when asked for, re-checked whenever handed out


def test_a_build_writes_no_cubin_file_until_one_is_asked_for(cache_dir, compiles):
    """Kernels load from the module's bytes: get_or_compile writes the entry only; the
    .cubin file beside it comes when a tool asks for one."""
    cache = KernelCache()
    compiled = cache.get_or_compile(SOURCE, "add_one", 90)
    assert [n for n in os.listdir(cache_dir) if n.endswith(".cubin")] == []
    path = cache.cubin_file(SOURCE, "add_one", 90)
    assert read(path) == compiled.cubin and os.path.dirname(path) == cache_dir
    assert cache.stats()["memory_hits"] == 0 and compiles == ["add_one"]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "deleted"])
def test_a_damaged_cubin_file_is_never_handed_out_again(cache_dir, compiles, damage, caplog):
    cache = KernelCache()
    compiled, path = both(cache, SOURCE, "add_one", 90)
    if damage == "flipped byte":
        flip_byte(path, len(compiled.cubin) // 2)
    elif damage == "truncated":
        os.truncate(path, 100)
    else:
        os.unlink(path)
    with caplog.at_level(logging.WARNING, logger="fuser.cache"):
        again, again_path = both(cache, SOURCE, "add_one", 90)
    assert again is compiled and read(again_path) == compiled.cubin
    assert ("no longer holds the kernel" in caplog.text) == (damage != "deleted")
    stats = cache.stats()
    assert stats["memory_hits"] == 1 and stats["cubins_rewritten"] == (damage != "deleted")
    assert compiles == ["add_one"]
    assert both(cache, SOURCE, "add_one", 90) == (compiled, again_path)
    assert cache.stats()["cubins_rewritten"] == (damage != "deleted")


# --- processes: one compile per key across processes


def _fake_module(source: str, arch: int, size: int = 4000) -> CompiledModule:
    """A module as compile_cuda returns it, without NVRTC: its cubin bytes depend on the
    source and arch, its resources name add_one."""
    seed = (source + str(arch)).encode()
    cubin = (seed * (size // len(seed) + 1))[:size]
    return CompiledModule(cubin=cubin, log="ptxas info: fake", options=("--fake",),
                          resources=(KernelResources(name="add_one", registers=16),),
                          nvrtc_version=(13, 0))


def _build_in_a_process(folder: str, record: str, start) -> None:
    """One of the processes of the test below: its compile appends its pid to `record` and
    takes half a second, so the others ask for the kernel while it runs."""

    def recording(source, name, arch, include_dirs=()):
        with open(record, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        return _fake_module(source, arch)

    fuser.cache.compile_cuda = recording
    start.wait(timeout=120)
    compiled, path = both(KernelCache(folder, disk=True), SOURCE, "add_one", 90)
    if read(path) != compiled.cubin or compiled != _fake_module(SOURCE, 90):
        raise SystemExit(3)


def test_processes_building_one_key_compile_it_once(tmp_path):
    """Issue 13: eight processes building one kernel all compiled it."""
    folder, record = str(tmp_path / "kernels"), str(tmp_path / "compiles.txt")
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(6)
    workers = [context.Process(target=_build_in_a_process, args=(folder, record, start))
               for _ in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=180)
    assert [w.exitcode for w in workers] == [0] * 6
    with open(record) as f:
        assert len(f.read().split()) == 1
    assert len(entry_files(folder)) == 1
    assert not [n for n in os.listdir(folder) if n.endswith((".lock", ".tmp"))]


def test_the_lock_is_taken_on_the_file_its_path_names(cache_dir, compiles):
    """A lock file unlinked while a process waited on it (the holder removes it when done) is
    not a lock: the waiter locks the file the path names now."""
    cache = KernelCache()
    key = cache.key(SOURCE, "add_one", 90)
    fd = cache._open_lock(key)
    assert fd is not None and os.path.exists(os.path.join(cache_dir, key + ".lock"))
    os.unlink(os.path.join(cache_dir, key + ".lock"))
    other = cache._open_lock(key)  # not blocked by the unlinked file's lock
    assert other is not None
    os.close(fd)
    os.close(other)


# --- the size cap, least recently used first


@pytest.fixture
def fake_compiles(monkeypatch) -> list[str]:
    """compile_cuda without NVRTC: 40 kB cubins; each call appends the source's last line."""
    calls: list[str] = []

    def fake(source, name, arch, include_dirs=()):
        calls.append(source.splitlines()[-1])
        return _fake_module(source, arch, 40_000)

    monkeypatch.setattr(fuser.cache, "compile_cuda", fake)
    return calls


def source(label: str) -> str:
    return SOURCE + f"// {label}"


def keys_on_disk(folder: str, labels) -> list[str]:
    on_disk = set(entry_files(folder))
    return [label for label in labels
            if KernelCache(folder).key(source(label), "add_one", 90) + ".fuser" in on_disk]


@pytest.mark.parametrize("hit", ["memory", "disk"])
def test_size_cap_evicts_the_least_recently_used(cache_dir, fake_compiles, monkeypatch, hit):
    monkeypatch.setenv("FUSER_CACHE_MAX_BYTES", "200000")  # two kernels of ~81 kB, not three
    cache = KernelCache()
    assert cache.max_bytes == 200_000
    for label in ("a", "b"):
        both(cache, source(label), "add_one", 90)
    for when, label in ((1000, "a"), (2000, "b")):  # a is older than b...
        key = cache.key(source(label), "add_one", 90)
        for suffix in (".fuser", ".cubin"):
            os.utime(os.path.join(cache_dir, key + suffix), (when, when))
    user = cache if hit == "memory" else KernelCache()
    both(user, source("a"), "add_one", 90)  # ...until this hit uses a
    both(user, source("c"), "add_one", 90)
    assert keys_on_disk(cache_dir, "abc") == ["a", "c"]
    assert user.stats()["evictions"] == 1 and user.stats()["bytes"] <= 200_000
    assert fake_compiles == ["// a", "// b", "// c"]
    fresh = KernelCache()
    for label in "ac":
        compiled, path = both(fresh, source(label), "add_one", 90)
        assert read(path) == compiled.cubin
    assert fresh.stats()["disk_hits"] == 2 and len(fake_compiles) == 3


def test_a_kernel_larger_than_the_cap_is_kept_alone(cache_dir, fake_compiles, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_MAX_BYTES", "1000")
    cache = KernelCache()
    for label in "ab":
        compiled, path = both(cache, source(label), "add_one", 90)
        assert read(path) == compiled.cubin
    assert keys_on_disk(cache_dir, "ab") == ["b"]
    assert len(os.listdir(cache_dir)) == 2  # b's entry and cubin
    # the memory layer still has a; its cubin file is written again when handed out
    compiled, path = both(cache, source("a"), "add_one", 90)
    assert read(path) == compiled.cubin and fake_compiles == ["// a", "// b"]


@pytest.mark.parametrize("text, expected", [
    (None, DEFAULT_MAX_BYTES), ("", DEFAULT_MAX_BYTES), ("2048", 2048), ("512M", 512 << 20),
    ("1 GiB", 1 << 30), ("3k", 3072), ("2TB", 2 << 40),
])
def test_max_bytes_from_the_environment(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv("FUSER_CACHE_MAX_BYTES", raising=False)
    else:
        monkeypatch.setenv("FUSER_CACHE_MAX_BYTES", text)
    assert max_cache_bytes() == expected
    assert DEFAULT_MAX_BYTES == 1 << 30


@pytest.mark.parametrize("text", ["0", "-5", "lots", "1.5G", "12 apples"])
def test_a_bad_max_bytes_is_refused(monkeypatch, text):
    monkeypatch.setenv("FUSER_CACHE_MAX_BYTES", text)
    with pytest.raises(BadInputError, match=rf"FUSER_CACHE_MAX_BYTES='{text}': a positive size "
                                            r"in bytes is needed, e\.g\. 1073741824 or 1G"):
        KernelCache()


@pytest.mark.parametrize("text, disk", [("0", False), ("1", True), (" 1 ", True), ("", True)])
def test_the_disk_cache_switch(monkeypatch, text, disk):
    monkeypatch.setenv("FUSER_CACHE", text)
    assert KernelCache().disk is disk


@pytest.mark.parametrize("text", ["false", "off", "no", "2", "00"])
def test_a_disk_cache_switch_other_than_0_or_1_is_refused(monkeypatch, text):
    """FUSER_CACHE=false would have left the disk cache on; it is refused with the values."""
    monkeypatch.setenv("FUSER_CACHE", text)
    with pytest.raises(BadInputError, match=rf"FUSER_CACHE='{text}': set 0 to keep compiled "
                                            r"kernels in memory only, or 1 \(the default\)"):
        KernelCache()


def test_compiled_templates_are_kept_beside_the_kernels_and_a_damaged_one_recompiles(
        tmp_path, monkeypatch):
    """codegen's Jinja bytecode cache (templates/ in the cache folder): a fresh environment
    loads the compiled template instead of compiling it; a damaged file is compiled again; a
    cache folder that is a file means no bytecode cache, not an error."""
    import jinja2

    import fuser.codegen as codegen

    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    compiled = []
    real_compile = jinja2.Environment.compile

    def counting(self, *args, **kwargs):
        compiled.append(args[1] if len(args) > 1 else kwargs.get("name"))
        return real_compile(self, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)

    def render() -> None:
        codegen._environment.cache_clear()
        codegen._environment().get_template("finalize.cu.j2")

    render()
    files = list((tmp_path / "cache" / "templates").iterdir())
    assert len(compiled) == 1 and len(files) == 1
    render()
    assert len(compiled) == 1  # loaded, not compiled
    files[0].write_bytes(b"damaged")
    render()
    assert len(compiled) == 2  # compiled again
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "file"))
    codegen._environment.cache_clear()
    assert codegen._environment().bytecode_cache is None
    codegen._environment.cache_clear()


# ----- what a process's first cache hit loads ---------------------------------------------------

HIT_PROBE = """
import sys, time
from fuser import DataType
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.kernels import build
from fuser.schedulers import Problem
fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
build(fd.name, analyze(fd.fusion), Problem(4096, 64, 16), DeviceSpec.get("h200"))
loaded = [m for m in ("cuda.bindings.nvrtc", "cuda.pathfinder", "cupy") if m in sys.modules]
print("loaded:", ",".join(loaded) or "nothing")
"""


def test_a_disk_cache_hit_loads_neither_nvrtc_nor_pathfinder_nor_cupy(tmp_path):
    """The key of a cached kernel is made without loading NVRTC (nvrtc_key: the wheel's
    library files), importing cuda.pathfinder (the wheel's include folder is looked at first)
    or CuPy (its version is read from its files): 55-75 ms -> about 10 ms on this machine."""
    import subprocess
    import sys

    env = {**os.environ, "FUSER_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", HIT_PROBE], env=env, check=True,
                           capture_output=True, text=True).stdout
    assert "cuda.bindings.nvrtc" in first  # the miss compiled
    again = subprocess.run([sys.executable, "-c", HIT_PROBE], env=env, check=True,
                           capture_output=True, text=True).stdout
    assert again.strip() == "loaded: nothing"


def test_nvrtc_key_names_the_wheels_library_files(tmp_path, monkeypatch):
    from fuser import compile as compile_module

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libnvrtc.so.13").write_bytes(b"x" * 10)
    (lib / "other.so").write_bytes(b"")
    asked = []

    def wheel_dirs(candidates):
        asked.append(candidates)
        return iter([str(lib)])

    monkeypatch.setattr(compile_module, "wheel_dirs", wheel_dirs)
    monkeypatch.setattr(compile_module, "_loaded_nvrtc", lambda major: None)
    monkeypatch.setattr(compile_module, "_bindings_major", lambda: 13)
    monkeypatch.setattr(compile_module, "nvrtc_version", lambda: (12, 9))
    compile_module.nvrtc_key.cache_clear()
    try:
        key = compile_module.nvrtc_key()
        assert key.startswith(f"libraries {os.path.realpath(lib)} libnvrtc.so.13:10:")
        assert "other.so" not in key and asked == [(("cu13", "lib"),)]
        (lib / "libnvrtc.so.13").write_bytes(b"y" * 11)  # another NVRTC in its place
        compile_module.nvrtc_key.cache_clear()
        assert compile_module.nvrtc_key() != key
        # cuda-bindings 12 loads libnvrtc.so.12: a folder holding only CUDA 13's is not it
        monkeypatch.setattr(compile_module, "_bindings_major", lambda: 12)
        compile_module.nvrtc_key.cache_clear()
        assert compile_module.nvrtc_key() == "nvrtc 12.9"
        assert asked[-1] == (("cuda_nvrtc", "lib"),)
        monkeypatch.setattr(compile_module, "wheel_dirs", lambda candidates: iter([]))
        compile_module.nvrtc_key.cache_clear()
        assert compile_module.nvrtc_key() == "nvrtc 12.9"  # no wheel: the version it reports
    finally:
        compile_module.nvrtc_key.cache_clear()


def test_nvrtc_key_names_an_nvrtc_already_loaded_before_the_wheels(tmp_path, monkeypatch):
    """A libnvrtc.so.13 the process has loaded (preloaded, or by CuPy) is the one
    cuda.pathfinder hands cuda-bindings: the key names its folder's files, not the wheel's."""
    from fuser import compile as compile_module

    wheel, elsewhere = tmp_path / "wheel", tmp_path / "elsewhere"
    for folder, size in ((wheel, 10), (elsewhere, 20)):
        folder.mkdir()
        (folder / "libnvrtc.so.13").write_bytes(b"x" * size)
        (folder / "libnvrtc-builtins.so.13.0").write_bytes(b"b")
    monkeypatch.setattr(compile_module, "wheel_dirs", lambda candidates: iter([str(wheel)]))
    monkeypatch.setattr(compile_module, "_bindings_major", lambda: 13)
    compile_module.nvrtc_key.cache_clear()
    try:
        monkeypatch.setattr(compile_module, "_loaded_nvrtc", lambda major: None)
        from_wheel = compile_module.nvrtc_key()
        assert "libnvrtc-builtins.so.13.0:1:" in from_wheel
        monkeypatch.setattr(compile_module, "_loaded_nvrtc", lambda major: str(wheel))
        compile_module.nvrtc_key.cache_clear()
        assert compile_module.nvrtc_key() == from_wheel  # the wheel's, loaded or not
        monkeypatch.setattr(compile_module, "_loaded_nvrtc", lambda major: str(elsewhere))
        compile_module.nvrtc_key.cache_clear()
        assert compile_module.nvrtc_key().startswith(
            f"libraries {os.path.realpath(elsewhere)} libnvrtc-builtins.so.13.0:1:")
    finally:
        compile_module.nvrtc_key.cache_clear()


def test_wheel_folders_are_searched_in_site_packages_not_on_sys_path(tmp_path, monkeypatch):
    """cuda.pathfinder finds wheels in site-packages only: an nvidia/ folder on sys.path
    (PYTHONPATH) is not the NVRTC or the headers it loads, so fuser does not look there."""
    import site
    import sys

    from fuser import compile as compile_module

    on_path, in_site = tmp_path / "path", tmp_path / "site"
    for root in (on_path, in_site):
        (root / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(on_path), *sys.path])
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(in_site)])
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
    assert list(compile_module.wheel_dirs((("cu13", "lib"),))) == [
        str(in_site / "nvidia" / "cu13" / "lib")]
