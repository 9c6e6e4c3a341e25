"""The kernel cache: a dict in memory in front of self-checked files on disk.

A key is the sha256 of everything that changes the binary: the source (whose header comment
carries the templates' hash), the full NVRTC option list, the arch, the kernel file name, the
NVRTC version, the hash of the CUDA headers and fuser's version. Each entry is
ONE file, `<key>.fuser`, written to a temp file in the same folder and renamed over the target
(atomic on POSIX), so readers see a whole old entry or a whole new one, never a mix:

    FUSER-KERNEL-CACHE <format>\\n
    <sha256 hex of the payload>\\n
    <payload: one JSON line (log, options, resources, ...)>\\n<raw cubin bytes>

A file that fails any check (magic, format, checksum, JSON, key, length, a resource report for
every `extern "C" __global__` kernel of the source) is deleted and counts as a miss, so a
truncated or flipped entry is recompiled instead of loaded. Kernels load from the checked bytes
in memory (fuser.driver); where a tool needs a file (cuobjdump, nvdisasm: `explain`'s
instruction mix), `cubin_file` writes `<key>.cubin` beside the entry. It is derived data,
written (atomically) from the checked entry when asked for and missing or different: a cubin
file damaged after it was written is never handed out again.

Beside the entries, `<key>.plan` files hold build plans (fuser.plans: the schedule and source a
build picked, under a key of everything that picks them), checked by a sha256 line like the
entries and evicted with them, so a process whose kernel is cached skips the search as well.

Processes share the folder safely: building a key holds an flock on `<key>.lock` beside the
entry (removed when the build is done), so N processes asking for one new kernel compile it
once and the others load the entry. The folder is capped (FUSER_CACHE_MAX_BYTES): after each
store the least recently used entries (a hit touches its entry) are deleted until the cache's
files fit.

Nothing on disk is needed for correctness, so OS errors degrade rather than fail: an entry that
cannot be read is recompiled; the first write that fails (read-only folder, no space,
FUSER_CACHE_DIR naming a file) logs one warning and from then on this cache keeps kernels in
memory, their cubin files in a private temporary folder. Only when a cubin file is asked for
and can be written nowhere does a ToolchainError name both folders and the way out.

Environment: FUSER_CACHE_DIR (default $XDG_CACHE_HOME/fuser, else ~/.cache/fuser);
FUSER_CACHE_MAX_BYTES (default 1 GiB; K, M, G suffixes are powers of 1024); FUSER_CACHE=0
keeps the memory layer only (cubin files then go to a private temporary folder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import fuser
from fuser.compile import (
    CompiledModule,
    KernelResources,
    binary_options,
    compile_cuda,
    cuda_headers_hash,
    nvrtc_key,
)
from fuser.errors import BadInputError, ToolchainError

try:
    import fcntl
except ImportError:  # no flock (Windows): processes may then compile one new key twice
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import logging
    import tempfile


def _log() -> logging.Logger:
    """The cache's logger. logging and tempfile are imported where used, not with the module:
    a process's first call imports this module and, on a hit, uses neither (together 9 ms of
    imports on the CPU machine)."""
    import logging

    return logging.getLogger("fuser.cache")

MAGIC = b"FUSER-KERNEL-CACHE"
FORMAT = 1
ENTRY_SUFFIX = ".fuser"
CUBIN_SUFFIX = ".cubin"
PLAN_SUFFIX = ".plan"
PLAN_MAGIC = b"FUSER-BUILD-PLAN"
LOCK_SUFFIX = ".lock"
TEMP_SUFFIX = ".tmp"
#: The default size cap of the cache folder: about 10,000 typical fuser kernels.
DEFAULT_MAX_BYTES = 1 << 30
#: The files this cache writes (entries, cubins, build plans, locks, temp files); clear() deletes
#: only these.
_OWN_FILE = re.compile(r"^\.?([0-9a-f]{64})\.(fuser|cubin|plan|lock)(\S*\.tmp)?$")
#: The name of each `extern "C" __global__` kernel, past attributes like __launch_bounds__(..).
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__\w+__\s*\([^()]*\)\s*)*(\w+)\s*\(')
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
#: errnos of one entry's path rather than the whole folder: that entry is skipped, not the disk.
_ENTRY_ERRNOS = (errno.EISDIR,)


def default_cache_dir() -> str:
    """FUSER_CACHE_DIR, else $XDG_CACHE_HOME/fuser, else ~/.cache/fuser: the XDG base
    directory rules, which ignore an XDG_CACHE_HOME that is not an absolute path."""
    explicit = os.environ.get("FUSER_CACHE_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fuser")


def disk_cache_on() -> bool:
    """FUSER_CACHE: 1 (the default, also when unset or empty) keeps kernels on disk too, 0
    in memory only; any other value is refused: FUSER_CACHE=false or =off had left the disk
    cache on."""
    text = os.environ.get("FUSER_CACHE", "").strip() or "1"
    if text not in ("0", "1"):
        raise BadInputError(
            f"FUSER_CACHE={text!r}: set 0 to keep compiled kernels in memory only, or 1 (the "
            "default) to keep them on disk too")
    return text == "1"


def max_cache_bytes() -> int:
    """FUSER_CACHE_MAX_BYTES as bytes (default DEFAULT_MAX_BYTES); a value that is not a
    positive size is refused, since silently ignoring it could fill a disk."""
    text = os.environ.get("FUSER_CACHE_MAX_BYTES", "")
    if not text.strip():
        return DEFAULT_MAX_BYTES
    value = 0
    if match := _SIZE.match(text):
        value = int(match.group(1)) * 1024 ** " kmgt".index(match.group(2).lower() or " ")
    if value < 1:
        raise BadInputError(
            f"FUSER_CACHE_MAX_BYTES={text!r}: a positive size in bytes is needed, e.g. "
            f"1073741824 or 1G (default {DEFAULT_MAX_BYTES}); to keep no kernels on disk set "
            "FUSER_CACHE=0 instead"
        )
    return value


def _read_file(path: str) -> bytes:
    """The bytes of `path` through os.open/os.read, so every failure is an OSError (a folder
    in the file's place fails on read with EISDIR)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _file_holds(path: str, data: bytes) -> bool:
    """Whether `path` holds exactly `data` (False when it cannot be read)."""
    try:
        return os.path.getsize(path) == len(data) and _read_file(path) == data
    except OSError:
        return False


def _names_file(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (False when it names nothing)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _atomic_write(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same folder and os.replace; a failure
    at any step (no space, no permission) removes the temp file and raises the OSError."""
    import tempfile

    folder = os.path.dirname(path)
    fd, temp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path), suffix=TEMP_SUFFIX)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
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


def _missing_kernels(compiled: CompiledModule, source: str) -> list[str]:
    """The kernels `source` declares that `compiled` has no ptxas report for: the builder
    reads each kernel's registers and spills, so such a module is unusable."""
    return [k for k in _KERNEL.findall(source) if k not in compiled.kernel_names]


class KernelCache:
    """Compiled modules by key, in memory and (unless FUSER_CACHE=0) on disk.

    Thread-safe: one lock per key, so concurrent callers asking for the same kernel compile it
    once and the others wait for that result; different keys compile in parallel. Across
    processes an flock per key does the same (see the module docstring).
    """

    def __init__(self, directory: str | None = None, disk: bool | None = None,
                 max_bytes: int | None = None):
        self.directory = os.path.abspath(directory or default_cache_dir())
        self.disk = disk_cache_on() if disk is None else disk
        self.max_bytes = max_cache_bytes() if max_bytes is None else max_bytes
        self._memory: dict[str, CompiledModule] = {}
        self._plans: dict[str, bytes] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._scratch: tempfile.TemporaryDirectory | None = None
        #: Why writes to the folder stopped (the first write that failed), or None.
        self.write_failure: str | None = None
        self.counts = {"memory_hits": 0, "disk_hits": 0, "compiles": 0, "bad_entries": 0,
                       "unreadable_entries": 0, "cubins_rewritten": 0, "evictions": 0,
                       "plan_hits": 0, "bad_plans": 0}

    def key(self, source: str, name: str, arch: int, include_dirs: tuple[str, ...] = ()) -> str:
        parts = {
            "format": FORMAT,
            "source": source,
            "name": name,
            "arch": int(arch),
            "options": [*binary_options(arch), *(f"-I{d}" for d in include_dirs)],
            "nvrtc": nvrtc_key(),
            "cuda_headers": cuda_headers_hash(),
            "fuser": fuser.__version__,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def get_or_compile(
        self, source: str, name: str, arch: int, include_dirs: tuple[str, ...] = ()
    ) -> CompiledModule:
        """The compiled module for this source: from memory, from its entry on disk, or from
        NVRTC (then stored)."""
        key = self.key(source, name, arch, include_dirs)
        with self._lock_for(key):
            hit = self._memory.get(key)
            if hit is not None:
                self._count("memory_hits")
                self._touch(key)
                return hit
            with self._process_lock(key):
                compiled = self._load(key, source)
                fresh = compiled is None
                if compiled is None:
                    compiled = compile_cuda(source, name, arch, include_dirs)
                    self._count("compiles")
                    self._store(key, compiled, source)
                else:
                    self._count("disk_hits")
            if fresh:
                self._evict(keep=key)
            self._memory[key] = compiled
            return compiled

    def cubin_file(self, source: str, name: str, arch: int,
                   include_dirs: tuple[str, ...] = ()) -> str:
        """The path of a plain file holding this module's cubin, for the tools that read one
        (cuobjdump, nvdisasm: `explain`'s instruction mix): `<key>.cubin` beside the entry,
        written when it is missing or no longer holds the bytes (a file changed since, by a
        user, a disk fault, another tool, would show another kernel than the one whose
        resources the cache returns), else one in this cache's temporary folder. Kernels run
        from the bytes in memory: only this asks for the file."""
        key = self.key(source, name, arch, include_dirs)
        compiled = self._memory.get(key) or self.get_or_compile(source, name, arch, include_dirs)
        with self._lock_for(key):
            return self._cubin_file(key, compiled)

    def holds(self, source: str, name: str, arch: int,
              include_dirs: tuple[str, ...] = ()) -> bool:
        """Whether get_or_compile would find this module without compiling (in memory, or an
        entry file on disk: one that turns out damaged is compiled afresh then)."""
        key = self.key(source, name, arch, include_dirs)
        return key in self._memory or (self.disk and os.path.isfile(self._entry_path(key)))

    def plan(self, key: str) -> bytes | None:
        """The build plan (fuser.plans) stored under `key`, in memory or in its checked file;
        None where there is none or its file is damaged (then deleted)."""
        held = self._plans.get(key)
        if held is not None or not self.disk:
            self._count("plan_hits", held is not None)
            return held
        path = self._path(key, PLAN_SUFFIX)
        try:
            data = _read_file(path)
        except OSError:
            return None
        first, digest, payload = [*data.split(b"\n", 2), b"", b""][:3]
        if first != PLAN_MAGIC or hashlib.sha256(payload).hexdigest().encode() != digest:
            _log().warning("fuser cache: deleting bad build plan %s; building afresh", path)
            self._count("bad_plans")
            self._discard(key, (PLAN_SUFFIX,))
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        self._plans[key] = payload
        self._count("plan_hits")
        return payload

    def store_plan(self, key: str, payload: bytes) -> None:
        """Keep a build plan in memory and, while writes reach the folder, in its file."""
        self._plans[key] = payload
        if not self._writes_on():
            return
        path = self._path(key, PLAN_SUFFIX)
        digest = hashlib.sha256(payload).hexdigest().encode()
        try:
            os.makedirs(self.directory, exist_ok=True)
            _atomic_write(path, PLAN_MAGIC + b"\n" + digest + b"\n" + payload)
        except OSError as e:
            self._write_failed(path, e)

    def discard_plan(self, key: str) -> None:
        """Forget a plan that did not decode (fuser.plans.decode), in memory and on disk."""
        self._plans.pop(key, None)
        self._count("bad_plans")
        self._discard(key, (PLAN_SUFFIX,))

    def clear(self) -> None:
        """Forget every entry: the memory layer and this cache's files in its folder."""
        with self._guard:
            self._memory.clear()
            self._plans.clear()
        folders = [self.directory] + ([self._scratch.name] if self._scratch else [])
        for folder in folders:
            for path in self._own_files(folder):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def stats(self) -> dict:
        """Entries and bytes on disk (entry plus cubin files), the folder, the cap, whether
        writes still reach the folder, and the counters."""
        files = self._own_files(self.directory) if self.disk else []
        sizes = []
        for path in files:
            with contextlib.suppress(OSError):
                sizes.append(os.path.getsize(path))
        return {
            "dir": self.directory,
            "disk": self.disk,
            "writable": self.disk and self.write_failure is None,
            "max_bytes": self.max_bytes,
            "entries": sum(p.endswith(ENTRY_SUFFIX) for p in files),
            "plans": sum(p.endswith(PLAN_SUFFIX) for p in files),
            "bytes": sum(sizes),
            "in_memory": len(self._memory),
            **self.counts,
        }

    def _count(self, counter: str, n: int = 1) -> None:
        with self._guard:
            self.counts[counter] += n

    def _lock_for(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _path(self, key: str, suffix: str) -> str:
        return os.path.join(self.directory, key + suffix)

    def _entry_path(self, key: str) -> str:
        return self._path(key, ENTRY_SUFFIX)

    def _writes_on(self) -> bool:
        return self.disk and self.write_failure is None

    def _touch(self, key: str) -> None:
        """Mark an entry used now, for the least-recently-used eviction."""
        if self.disk:
            with contextlib.suppress(OSError):
                os.utime(self._entry_path(key))

    @contextlib.contextmanager
    def _process_lock(self, key: str) -> Iterator[None]:
        """An exclusive flock on `<key>.lock` while this process loads or builds `key`, so
        processes asking for one new kernel compile it once. The holder unlinks the file
        before letting go (waiters then find the path gone and lock a new file), so no lock
        files pile up. Without a lock file (memory-only, a read-only folder, no space, no
        flock) it goes on unlocked: at worst two processes compile one kernel, and atomic
        renames keep the entry whole."""
        fd = self._open_lock(key) if self.disk and fcntl is not None else None
        try:
            yield
        finally:
            if fd is not None:
                if _names_file(self._path(key, LOCK_SUFFIX), fd):
                    self._discard(key, (LOCK_SUFFIX,))
                os.close(fd)  # closing the descriptor releases the flock

    def _open_lock(self, key: str) -> int | None:
        """A descriptor holding the flock of `key`'s lock file, or None. The lock must be on
        the file the path names when it is held: the last holder (or clear()) unlinks the file
        while others may wait on it, so a lock on an unlinked file is dropped and retaken."""
        path = self._path(key, LOCK_SUFFIX)
        for _ in range(16):
            try:
                if self._writes_on():
                    os.makedirs(self.directory, exist_ok=True)
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as e:
                _log().debug("fuser cache: building %s without a lock (%s)", path, e)
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _names_file(path, fd):
                    return fd
            except OSError as e:
                _log().debug("fuser cache: building %s without a lock (%s)", path, e)
                os.close(fd)
                return None
            os.close(fd)  # unlinked while we waited: lock the file the path names now
        return None

    def _load(self, key: str, source: str) -> CompiledModule | None:
        """The checked entry of `key`, or None (a miss): missing, unreadable, or bad, where a
        bad entry is deleted so it is rewritten by the recompile."""
        if not self.disk:
            return None
        path = self._entry_path(key)
        try:
            data = _read_file(path)
        except (FileNotFoundError, NotADirectoryError):
            return None  # NotADirectoryError: the folder is a file, reported once by _store
        except OSError as e:
            _log().warning("fuser cache: cannot read %s (%s); recompiling. %s", path, e,
                           self._way_out(e, path))
            self._count("unreadable_entries")
            return None
        try:
            compiled = _decode(key, data)
            if missing := _missing_kernels(compiled, source):
                raise ValueError(f"no ptxas resource report for kernel(s) {missing}")
        except (ValueError, TypeError, KeyError) as e:
            _log().warning("fuser cache: deleting bad entry %s (%s); recompiling", path, e)
            self._count("bad_entries")
            self._discard(key, (ENTRY_SUFFIX, CUBIN_SUFFIX))
            return None
        self._touch(key)
        return compiled

    def _store(self, key: str, compiled: CompiledModule, source: str) -> None:
        """Write the entry (unless writes stopped). A module whose report lacks a kernel of
        the source is not stored: _load would reject it, warning in every process."""
        if not self._writes_on() or _missing_kernels(compiled, source):
            return
        path = self._entry_path(key)
        try:
            os.makedirs(self.directory, exist_ok=True)
            _atomic_write(path, _encode(key, compiled))
        except OSError as e:
            self._write_failed(path, e)

    def _write_failed(self, path: str, error: OSError) -> None:
        """Report a failed write. A folder in the entry's place spoils that entry only; any
        other failure (no space, no permission, the folder is a file) stops writes to the
        folder for this cache, with one warning, so a full disk does not warn per kernel."""
        way_out = self._way_out(error, path)
        if error.errno in _ENTRY_ERRNOS:
            _log().warning("fuser cache: cannot write %s (%s); keeping it in memory. %s",
                           path, error, way_out)
            return
        with self._guard:
            first = self.write_failure is None
            if first:
                self.write_failure = f"{path}: {error}"
        if first:
            _log().warning("fuser cache: cannot write %s (%s); %s. Until this process ends, "
                           "kernels are kept in memory only (cubin files in a temporary folder)",
                           path, error, way_out)

    def _way_out(self, error: OSError, path: str) -> str:
        """What the user can do about `error` on `path`, by its errno."""
        code = error.errno
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return (f"Make {self.directory} writable and readable, or point FUSER_CACHE_DIR "
                    "at a folder that is")
        if code in (errno.ENOSPC, errno.EDQUOT):
            return (f"Free space on the disk of {self.directory}, lower FUSER_CACHE_MAX_BYTES "
                    f"(now {self.max_bytes}), or point FUSER_CACHE_DIR at another disk")
        if code in (errno.ENOTDIR, errno.EEXIST):
            return (f"{self.directory} (or a folder above it) is a file: point FUSER_CACHE_DIR "
                    "at a folder")
        if code == errno.EISDIR:
            return f"{path} is a folder where fuser keeps a file: remove that folder"
        return ("Point FUSER_CACHE_DIR at a writable folder, or set FUSER_CACHE=0 to keep "
                "kernels in memory only")

    def _cubin_file(self, key: str, compiled: CompiledModule) -> str:
        """A plain file holding compiled.cubin (for the tools that read one)."""
        try:
            return self._write_cubin(key, compiled)
        except OSError as e:
            where = (f"not in {self.directory} ({self.write_failure or 'not writable'}) nor"
                     if self.disk else "not")
            import tempfile

            raise ToolchainError(
                f"cannot write the cubin file {key}{CUBIN_SUFFIX}, which explain and "
                f"disassemblers read the kernel from: {where} in a temporary folder under "
                f"{tempfile.gettempdir()} ({e}). "
                "Free disk space, or point FUSER_CACHE_DIR (and TMPDIR) at writable folders "
                "with free space"
            ) from e

    def _write_cubin(self, key: str, compiled: CompiledModule) -> str:
        """The cache folder's cubin file when it holds the bytes or can be written, else one
        in this cache's temporary folder (memory-only, or writes to the folder stopped)."""
        if self.disk:
            path = self._path(key, CUBIN_SUFFIX)
            if _file_holds(path, compiled.cubin):
                return path
            if os.path.exists(path):
                _log().warning("fuser cache: the cubin file %s no longer holds the kernel "
                               "compiled into it (changed since); writing a fresh copy from "
                               "memory", path)
                self._count("cubins_rewritten")
            if self._writes_on():
                try:
                    os.makedirs(self.directory, exist_ok=True)
                    _atomic_write(path, compiled.cubin)
                    return path
                except OSError as e:
                    self._write_failed(path, e)
        path = os.path.join(self._scratch_dir(), key + CUBIN_SUFFIX)
        if not _file_holds(path, compiled.cubin):
            _atomic_write(path, compiled.cubin)
        return path

    def _scratch_dir(self) -> str:
        with self._guard:
            if self._scratch is None:
                import tempfile

                self._scratch = tempfile.TemporaryDirectory(prefix="fuser-cubins-")
            return self._scratch.name

    def _evict(self, keep: str) -> None:
        """Delete the least recently used entries (entry and cubin files) until this
        cache's files in the folder total at most max_bytes. `keep`, the entry just stored,
        always stays: a cap below one kernel keeps exactly the newest one. Files of other
        processes may vanish meanwhile; every failure here is ignored (the cap is a goal)."""
        if not self._writes_on():
            return
        usage = self._usage()
        total = sum(size for _, size in usage.values())
        for key in sorted(usage, key=lambda k: usage[k][0]):
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            self._discard(key, (ENTRY_SUFFIX, CUBIN_SUFFIX, PLAN_SUFFIX))
            total -= usage[key][1]
            self._count("evictions")
        if total > self.max_bytes:
            _log().debug("fuser cache: %s holds %d bytes over FUSER_CACHE_MAX_BYTES=%d",
                         self.directory, total, self.max_bytes)

    def _usage(self) -> dict[str, tuple[float, int]]:
        """Each key with files in the folder: (last use, bytes). Last use is the entry's
        mtime (touched on every hit), else the newest of its other files' mtimes."""
        entries: dict[str, float] = {}
        others: dict[str, float] = {}
        sizes: dict[str, int] = {}
        for path in self._own_files(self.directory):
            match = _OWN_FILE.match(os.path.basename(path))
            if match is None or match.group(3) or match.group(2) == "lock":
                continue  # a build in progress: its temp file, its lock
            try:
                info = os.stat(path)
            except OSError:
                continue
            key = match.group(1)
            sizes[key] = sizes.get(key, 0) + info.st_size
            times = entries if match.group(2) == "fuser" else others
            times[key] = max(times.get(key, info.st_mtime), info.st_mtime)
        return {k: (entries.get(k, others.get(k, 0.0)), size) for k, size in sizes.items()}

    def _discard(self, key: str, suffixes: tuple[str, ...]) -> None:
        for suffix in suffixes:
            with contextlib.suppress(OSError):  # gone, or a read-only folder: nothing to do
                os.unlink(self._path(key, suffix))

    @staticmethod
    def _own_files(folder: str) -> list[str]:
        try:
            names = os.listdir(folder)
        except OSError:  # missing, a file, unreadable: nothing of ours to list
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
