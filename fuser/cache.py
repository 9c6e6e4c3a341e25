"""The kernel cache: a dict in memory in front of self-checked files on disk.

A key is the sha256 of everything that changes the binary: the source (whose header comment
carries the templates' hash), the full NVRTC option list, the arch, the kernel file name, the
NVRTC version, the hash of the CUDA headers, fuser's version and CuPy's version. Each entry is
ONE file, `<key>.fuser`, written to a temp file in the same folder and renamed over the target
(atomic on POSIX), so readers see a whole old entry or a whole new one, never a mix:

    FUSER-KERNEL-CACHE <format>\\n
    <sha256 hex of the payload>\\n
    <payload: one JSON line (log, options, resources, ...)>\\n<raw cubin bytes>

A file that fails any check (magic, format, checksum, JSON, key, length) is deleted and counts
as a miss, so a truncated or flipped entry is recompiled instead of loaded. `cupy.RawModule`
loads from a path, so the cubin is also kept as `<key>.cubin` beside the entry; it is derived
data, rewritten (atomically) from the checked entry whenever it is missing or differs.

Environment: FUSER_CACHE_DIR (default ~/.cache/fuser); FUSER_CACHE=0 keeps the memory layer
only (cubin files then go to a private temporary folder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading

import fuser
from fuser.compile import (
    CompiledModule,
    KernelResources,
    compile_cuda,
    cuda_headers_hash,
    nvrtc_version,
    options_for,
)
from fuser.errors import ToolchainError

log = logging.getLogger("fuser.cache")

MAGIC = b"FUSER-KERNEL-CACHE"
FORMAT = 1
ENTRY_SUFFIX = ".fuser"
CUBIN_SUFFIX = ".cubin"
TEMP_SUFFIX = ".tmp"
#: The files this cache writes (entries, cubins, temp files of both); clear() deletes only these.
_OWN_FILE = re.compile(r"^\.?[0-9a-f]{64}\.(fuser|cubin)(\S*\.tmp)?$")


@functools.cache
def _cupy_version() -> str:
    try:
        import cupy
    except Exception:  # no CuPy (or a broken one) is a key component too
        return "none"
    return str(cupy.__version__)


def default_cache_dir() -> str:
    return os.environ.get("FUSER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "fuser"
    )


def _atomic_write(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder and os.replace."""
    folder = os.path.dirname(path)
    fd, temp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path), suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _encode(key: str, compiled: CompiledModule) -> bytes:
    header = {
        "key": key,
        "cubin_bytes": len(compiled.cubin),
        "log": compiled.log,
        "options": list(compiled.options),
        "resources": [dataclasses.asdict(r) for r in compiled.resources],
        "nvrtc_version": list(compiled.nvrtc_version),
    }
    payload = json.dumps(header, sort_keys=True).encode() + b"\n" + compiled.cubin
    digest = hashlib.sha256(payload).hexdigest().encode()
    return MAGIC + b" " + str(FORMAT).encode() + b"\n" + digest + b"\n" + payload


def _decode(key: str, data: bytes) -> CompiledModule:
    """The entry in `data`; ValueError (or a JSON/Type error) when any check fails."""
    first, digest, payload = data.split(b"\n", 2)
    if first != MAGIC + b" " + str(FORMAT).encode():
        raise ValueError(f"format line {first[:40]!r}")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("checksum mismatch")
    line, cubin = payload.split(b"\n", 1)
    header = json.loads(line)
    if header["key"] != key or header["cubin_bytes"] != len(cubin):
        raise ValueError("entry does not match its key or length")
    return CompiledModule(
        cubin=cubin,
        log=header["log"],
        options=tuple(header["options"]),
        resources=tuple(KernelResources(**r) for r in header["resources"]),
        nvrtc_version=tuple(header["nvrtc_version"]),
    )


class KernelCache:
    """Compiled modules by key, in memory and (unless FUSER_CACHE=0) on disk.

    Thread-safe: one lock per key, so concurrent callers asking for the same kernel compile it
    once and the others wait for that result; different keys compile in parallel.
    """

    def __init__(self, directory: str | None = None, disk: bool | None = None):
        self.directory = os.path.abspath(directory or default_cache_dir())
        self.disk = os.environ.get("FUSER_CACHE", "1") != "0" if disk is None else disk
        self._memory: dict[str, tuple[CompiledModule, str]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.counts = {"memory_hits": 0, "disk_hits": 0, "compiles": 0, "bad_entries": 0}

    def key(self, source: str, name: str, arch: int, include_dirs: tuple[str, ...] = ()) -> str:
        parts = {
            "format": FORMAT,
            "source": source,
            "name": name,
            "arch": int(arch),
            "options": list(options_for(arch, include_dirs)),
            "nvrtc": list(nvrtc_version()),
            "cuda_headers": cuda_headers_hash(),
            "fuser": fuser.__version__,
            "cupy": _cupy_version(),
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def get_or_compile(
        self, source: str, name: str, arch: int, include_dirs: tuple[str, ...] = ()
    ) -> tuple[CompiledModule, str]:
        """The compiled module for this source and the path of a file holding its cubin."""
        key = self.key(source, name, arch, include_dirs)
        with self._lock_for(key):
            hit = self._memory.get(key)
            if hit is not None and os.path.isfile(hit[1]):
                self._count("memory_hits")
                return hit
            compiled = hit[0] if hit is not None else self._load(key)
            if compiled is None:
                compiled = compile_cuda(source, name, arch, include_dirs)
                self._count("compiles")
                self._store(key, compiled)
            elif hit is None:
                self._count("disk_hits")
            path = self._cubin_file(key, compiled)
            self._memory[key] = (compiled, path)
            return compiled, path

    def clear(self) -> None:
        """Forget every entry: the memory layer and this cache's files in its folder."""
        with self._guard:
            self._memory.clear()
        folders = [self.directory] + ([self._scratch.name] if self._scratch else [])
        for folder in folders:
            for path in self._own_files(folder):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def stats(self) -> dict:
        """Entries and bytes on disk (entry plus cubin files), the folder, and the counters."""
        files = self._own_files(self.directory) if self.disk else []
        sizes = []
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                sizes.append(os.path.getsize(path))
        return {
            "dir": self.directory,
            "disk": self.disk,
            "entries": sum(p.endswith(ENTRY_SUFFIX) for p in files),
            "bytes": sum(sizes),
            "in_memory": len(self._memory),
            **self.counts,
        }

    def _count(self, counter: str) -> None:
        with self._guard:
            self.counts[counter] += 1

    def _lock_for(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _entry_path(self, key: str) -> str:
        return os.path.join(self.directory, key + ENTRY_SUFFIX)

    def _load(self, key: str) -> CompiledModule | None:
        if not self.disk:
            return None
        path = self._entry_path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            return _decode(key, data)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("fuser cache: deleting bad entry %s (%s); recompiling", path, e)
            self._count("bad_entries")
            for stale in (path, os.path.join(self.directory, key + CUBIN_SUFFIX)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
            return None

    def _store(self, key: str, compiled: CompiledModule) -> None:
        if not self.disk:
            return
        path = self._entry_path(key)
        try:
            os.makedirs(self.directory, exist_ok=True)
            _atomic_write(path, _encode(key, compiled))
        except OSError as e:
            log.warning("fuser cache: cannot write %s (%s); keeping it in memory", path, e)

    def _cubin_file(self, key: str, compiled: CompiledModule) -> str:
        """A plain file holding compiled.cubin (for cupy.RawModule(path=...))."""
        try:
            return self._write_cubin(key, compiled)
        except OSError as e:
            where = (f", neither in {self.directory} nor in a temporary folder" if self.disk
                     else " in a temporary folder")
            raise ToolchainError(
                f"cannot write the cubin file {key}{CUBIN_SUFFIX}, which CuPy loads the kernel "
                f"from{where} ({e}); free disk space, or set FUSER_CACHE_DIR (and TMPDIR) to a "
                "writable folder"
            ) from e

    def _write_cubin(self, key: str, compiled: CompiledModule) -> str:
        folder = self.directory if self.disk else self._scratch_dir()
        path = os.path.join(folder, key + CUBIN_SUFFIX)
        try:
            with open(path, "rb") as f:
                if f.read() == compiled.cubin:
                    return path
        except FileNotFoundError:
            pass
        try:
            os.makedirs(folder, exist_ok=True)
            _atomic_write(path, compiled.cubin)
        except OSError:
            if folder == self._scratch_dir():
                raise
            path = os.path.join(self._scratch_dir(), key + CUBIN_SUFFIX)
            _atomic_write(path, compiled.cubin)
        return path

    def _scratch_dir(self) -> str:
        with self._guard:
            if self._scratch is None:
                self._scratch = tempfile.TemporaryDirectory(prefix="fuser-cubins-")
            return self._scratch.name

    @staticmethod
    def _own_files(folder: str) -> list[str]:
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return []
        return [os.path.join(folder, n) for n in names if _OWN_FILE.match(n)]


_default: KernelCache | None = None
_default_guard = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache, created on first use from the environment."""
    global _default
    with _default_guard:
        if _default is None:
            _default = KernelCache()
        return _default
