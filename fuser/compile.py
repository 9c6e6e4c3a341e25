"""Compile CUDA C++ to an sm_XX cubin with NVRTC, and read the ptxas resource report.

Every kernel fuser runs goes through `compile_cuda`: NVRTC (through `cuda.bindings.nvrtc`)
builds a cubin for one exact architecture with `--ptxas-options=-v`, so the registers, spills,
stack and static shared memory of every kernel are known on a machine without a GPU, and are the
same numbers as for the binary that later runs. On a GPU the cubin is loaded through the driver
(`fuser.driver`); nothing else compiles, so there is one option list (`compile_options`) and
no second path whose flags could drift.

Why a cubin and not PTX: PTX from a newer NVRTC does not JIT on an older driver, while a cubin
loads on any driver of the same CUDA major (CuPy emits cubin for the same reason).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fuser.errors import BadInputError, CompileError, ToolchainError

#: The CUDA headers fuser's kernels may include. NVRTC has no built-in copy of them (checked
#: with NVRTC 13.5: `#include <cuda_bf16.h>` fails without -I), so they come from a wheel
#: (nvidia-cuda-runtime ships nvidia/cu13/include, nvidia-cuda-runtime-cu12
#: nvidia/cuda_runtime/include) or a CUDA toolkit.
CUDA_HEADERS = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")

#: Environment variable naming a folder that holds cuda_bf16.h, to override the search.
INCLUDE_ENV = "FUSER_CUDA_INCLUDE_DIR"

#: How to get CuPy, cuda-bindings, NVRTC and the CUDA headers: they are the package's extras,
#: not its dependencies (only one cupy-cuda* wheel may be installed; see pyproject.toml).
INSTALL_CUDA = "pip install 'fuser-kernels[cuda13]' (or [cuda12] with a CUDA 12 driver)"


def _nvrtc():
    """The NVRTC bindings, imported on first use so that `import fuser` works without them."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ToolchainError(
            f"fuser compiles kernels with NVRTC through cuda-bindings, which did not import "
            f"({e}); install them with {INSTALL_CUDA}"
        ) from e
    return nvrtc


def _check(result, what: str):
    """Unwrap a cuda.bindings NVRTC return tuple, raising ToolchainError on a failed call."""
    nvrtc = _nvrtc()
    status, *values = result
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(
            f"{what} failed: {status.name} (NVRTC API call, not a compile error); check that "
            "nvidia-cuda-nvrtc matches cuda-bindings (same CUDA major) and that memory is free"
        )
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use; part of every cache key."""
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


# Where the pip wheels keep NVRTC's library (by CUDA major: the one cuda-bindings of that major
# loads) and the CUDA runtime's headers, under the `nvidia` namespace package.
_WHEEL_LIB_DIRS = {13: ("cu13", "lib"), 12: ("cuda_nvrtc", "lib")}
_BINDINGS_DIST = re.compile(r"^cuda_bindings-(\d+)\.[^-]*\.dist-info$")
_WHEEL_INCLUDE_DIRS = (("cu13", "include"), ("cuda_runtime", "include"))


def _site_roots() -> list[str]:
    """The folders cuda.pathfinder looks for pip wheels in, in its order: site-packages, the
    user's site after a virtual environment's own and before the system's otherwise (not
    sys.path: a wheel on PYTHONPATH is not one pathfinder loads)."""
    import site
    import sys

    roots = list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else ""
    if user:
        roots.insert(1 if sys.prefix != sys.base_prefix else 0, user)
    return roots


def wheel_dirs(candidates: tuple[tuple[str, ...], ...]) -> Iterator[str]:
    """The existing folders `candidates` name under nvidia/ of each site root, found without
    importing anything."""
    for root in _site_roots():
        for parts in candidates:
            folder = os.path.join(root, "nvidia", *parts)
            if os.path.isdir(folder):
                yield folder


def _loaded_nvrtc(major: int) -> str | None:
    """The folder of the libnvrtc.so.<major> this process has loaded already (preloaded, or
    loaded by CuPy or cuda-bindings), which cuda.pathfinder then uses whatever is installed;
    None where none is loaded or its file cannot be named (Linux: /proc/self/maps)."""
    import ctypes

    try:
        ctypes.CDLL(f"libnvrtc.so.{major}", mode=os.RTLD_NOLOAD)
    except (OSError, AttributeError):
        return None
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith(f"libnvrtc.so.{major}"):
                return os.path.dirname(os.path.realpath(path))
    return None


def _library_files(folder: str, major: int) -> str | None:
    """'<folder> name:size:mtime,...' of the NVRTC libraries in `folder` (libnvrtc and its
    builtins), or None where libnvrtc.so.<major> is not among them."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("libnvrtc"))
    if not any(n.startswith(f"libnvrtc.so.{major}") for n in names):
        return None
    stats = [os.stat(os.path.join(folder, n)) for n in names]
    files = ",".join(f"{n}:{st.st_size}:{st.st_mtime_ns}" for n, st in zip(names, stats,
                                                                          strict=True))
    return f"{os.path.realpath(folder)} {files}"


@functools.cache
def nvrtc_key() -> str:
    """What names the NVRTC in use in cache keys, found without loading it where it can be.

    Loading NVRTC (importing its bindings, then nvrtcVersion) costs 50 to 60 ms, the most of a
    process's first kernel that the disk cache holds. cuda-bindings loads NVRTC through
    cuda.pathfinder: a libnvrtc.so.<major> already in the process first, else a pip wheel's
    (of cuda-bindings' own CUDA major) before any other. Where either is found, its folder's
    library files (names, sizes, modification times) name it: another NVRTC changes them,
    and a process that loaded the wheel's NVRTC keys the same as one that did not. Otherwise
    (a system toolkit, conda), the version NVRTC reports."""
    major = _bindings_major()
    if major is not None:
        loaded = _loaded_nvrtc(major)
        folders = [loaded] if loaded else list(
            wheel_dirs((_WHEEL_LIB_DIRS[major],) if major in _WHEEL_LIB_DIRS else ()))
        for folder in folders:
            files = _library_files(folder, major)
            if files:
                return f"libraries {files}"
    return "nvrtc {}.{}".format(*nvrtc_version())


def _bindings_major() -> int | None:
    """The CUDA major of the installed cuda-bindings (the NVRTC soname it loads), read from
    the name of its dist-info folder in site-packages (importing importlib.metadata costs
    15 ms of a process's first cache hit), else from its metadata; None where neither
    says."""
    for root in _site_roots():
        with contextlib.suppress(OSError):
            for name in os.listdir(root):
                match = _BINDINGS_DIST.match(name)
                if match:
                    return int(match.group(1))
    from importlib import metadata

    try:
        return int(metadata.version("cuda-bindings").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


@functools.cache
def _no_cache_supported() -> bool:
    """Whether this NVRTC takes --no-cache (NVRTC 13 does; older ones may reject it)."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(b"", b"probe.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, 1, [b"--no-cache"])
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return status != nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION


def _has_headers(folder: str | None) -> bool:
    if not folder:
        return False
    return os.path.isfile(os.path.join(folder, "cuda_bf16.h"))


@functools.cache
def template_dir() -> Path:
    """templates/ of the installed wheel (package fuser.templates), else of the source tree.
    Found through the import system's spec, not importlib.resources (whose import took 5 to
    7 ms of a process's first call)."""
    import importlib.util

    spec = importlib.util.find_spec("fuser.templates")
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or ():
        path = Path(folder)
        if (path / "fuser_math.cuh").exists():
            return path
    return Path(__file__).resolve().parent.parent / "templates"


@functools.cache
def cuda_include_dir() -> str | None:
    """The folder holding cuda_fp16.h / cuda_bf16.h, or None when none was found.

    Search order: $FUSER_CUDA_INCLUDE_DIR (must hold the headers), then cuda.pathfinder's
    search for the CUDA runtime headers (pip wheel nvidia-cuda-runtime first, then conda,
    $CUDA_PATH / $CUDA_HOME and the system toolkit), then /usr/local/cuda/include. The pip
    wheel's folder is looked at first without importing cuda.pathfinder (26 ms, on the path
    of a process's first cache hit), as pathfinder would find it first.
    Without headers, kernels that include none still compile; the others fail with NVRTC's
    'could not open source file' in their CompileError.
    """
    override = os.environ.get(INCLUDE_ENV)
    if override:
        if not _has_headers(override):
            raise ToolchainError(
                f"{INCLUDE_ENV}={override} holds no cuda_bf16.h; point it at a CUDA include "
                f"folder (the one holding {', '.join(CUDA_HEADERS)}) or unset it to search"
            )
        return os.path.abspath(override)
    for folder in wheel_dirs(_WHEEL_INCLUDE_DIRS):
        if _has_headers(folder):
            return os.path.abspath(folder)
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # any failure of the optional search means "not found"
        found = None
    for folder in (found, "/usr/local/cuda/include"):
        if _has_headers(folder):
            return os.path.abspath(folder)
    return None


@functools.cache
def cuda_headers_hash() -> str:
    """sha256 over the CUDA headers kernels may include, so an upgraded header changes keys."""
    digest = hashlib.sha256()
    folder = cuda_include_dir()
    for header in CUDA_HEADERS:
        path = os.path.join(folder, header) if folder else ""
        digest.update(header.encode() + b"\0")
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def binary_options(arch: int) -> tuple[str, ...]:
    """The options that decide the binary: the cache key takes these (with the NVRTC version
    and the CUDA headers' hash) and not the rest of compile_options(), which NVRTC's own
    cache and the headers' folder add, so a cache hit runs no NVRTC probe."""
    return (f"--gpu-architecture=sm_{int(arch)}", "-std=c++17", "-ftz=false", "--fmad=true",
            "-default-device", "--ptxas-options=-v", "--ptxas-options=--warn-on-spills")


def compile_options(arch: int) -> tuple[str, ...]:
    """The one NVRTC option list used for every fuser kernel.

    - an exact `sm_XX` target, so NVRTC emits a cubin and runs ptxas;
    - `-ftz=false`: denormals are kept (NVRTC's default, but CuPy passes -ftz=true when it
      compiles; fuser checks results against float64, where flushing would show);
    - `--fmad=true`: contractions into FMA are allowed (the default, stated for the cache key);
    - `-default-device`: functions without an execution space are device functions;
    - `--ptxas-options=-v` and `--warn-on-spills`: the resource report (one flag per option,
      ptxas rejects a comma list passed through NVRTC);
    - `--no-cache` (where NVRTC takes it): when a driver is present, NVRTC 13 keeps compiled
      cubins in the driver's cache and on a hit skips ptxas, so the log holds no resource
      report (seen on the H200: a second compile of the same source logged nothing). fuser
      caches compiled modules itself;
    - `-I` the folder with cuda_fp16.h / cuda_bf16.h when one was found.
    """
    options = list(binary_options(arch))
    if _no_cache_supported():
        options.append("--no-cache")
    include = cuda_include_dir()
    if include:
        options.append(f"-I{include}")
    return tuple(options)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel (entry function) of a cubin.

    static_smem is the `__shared__` memory the kernel declares (ptxas "smem"), in bytes. The
    driver adds the per-block reserved shared memory on top of it (1 KiB on sm_90, shown by
    cuobjdump as SHARED = smem + 1024) which is NOT counted here: the per-block limit is
    static_smem + dynamic <= sharedMemPerBlockOptin, and occupancy must add the reserve per block.
    stack_frame is this function's local-memory frame (spills and local arrays);
    cumulative_stack adds the frames of the non-inlined functions it calls.
    """

    name: str
    registers: int
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    static_smem: int = 0
    barriers: int = 0
    cumulative_stack: int = 0

    @property
    def spills(self) -> bool:
        """True when ptxas spilled registers to local memory."""
        return self.spill_stores > 0 or self.spill_loads > 0

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.registers} registers, {self.static_smem} B static smem, "
            f"{self.spill_stores} B spill stores, {self.spill_loads} B spill loads, "
            f"{self.stack_frame} B stack, {self.barriers} barriers"
        )


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """The ptxas `-v` report in an NVRTC (or ptxas) log, keyed by entry name, in log order.

    The report comes in blocks: "Compiling entry function 'k'", "Function properties for k",
    a frame line (NVRTC prefixes it with `ptxas .`), then "Used N registers, used B barriers,
    S bytes cumulative stack size, M bytes smem" where the barriers, stack and smem parts are
    left out when zero by some ptxas versions. Non-inlined device functions get a
    "Function properties" block of their own and are not entries. Other lines are ignored.
    """
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, dict[str, int]] = {}
    entry = None
    properties_of = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            used.setdefault(entry, {})
        elif m := _PROPERTIES.search(line):
            properties_of = m.group(1)
        elif (m := _FRAME.search(line)) and properties_of is not None:
            frames[properties_of] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            fields = {"registers": int(m.group(1))}
            for key, pattern in (
                ("barriers", _BARRIERS),
                ("cumulative_stack", _CUMULATIVE),
                ("static_smem", _SMEM),
            ):
                if found := pattern.search(line):
                    fields[key] = int(found.group(1))
            used[entry] = fields
    result = {}
    for name, fields in used.items():
        if "registers" not in fields:
            continue
        stack, stores, loads = frames.get(name, (0, 0, 0))
        result[name] = KernelResources(
            name=name, stack_frame=stack, spill_stores=stores, spill_loads=loads, **fields
        )
    return result


@dataclass(frozen=True)
class CompiledModule:
    """A cubin with everything that made it and what ptxas said about it."""

    cubin: bytes
    log: str
    options: tuple[str, ...]
    resources: tuple[KernelResources, ...]
    nvrtc_version: tuple[int, int]

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.resources)

    def resource(self, name: str) -> KernelResources:
        """The resources of the entry `name` (the plain name of an extern "C" kernel)."""
        for r in self.resources:
            if r.name == name:
                return r
        raise BadInputError(
            f"no kernel {name!r} in this module; it has {list(self.kernel_names)}: pass one of "
            "those (the plain name of an extern \"C\" __global__ function)"
        )


def _program_log(prog) -> str:
    nvrtc = _nvrtc()
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buffer = bytearray(size)  # never b" " * size: that is the interned b" " when size is 1
    _check(nvrtc.nvrtcGetProgramLog(prog, buffer), "nvrtcGetProgramLog")
    return buffer.decode(errors="replace").rstrip("\0")


def options_for(arch: int, include_dirs: tuple[str, ...] = ()) -> tuple[str, ...]:
    """compile_options(arch) followed by one -I per extra include folder, in order."""
    return compile_options(arch) + tuple(f"-I{os.fspath(d)}" for d in include_dirs)


def _filename(name: str) -> str:
    return name if name.endswith((".cu", ".cuh")) else f"{name}.cu"


@contextlib.contextmanager
def _program(source: str, name: str, options: tuple[str, ...], target: str):
    """An NVRTC program of `source` compiled with `options`, as (program, log), destroyed on
    leaving; a failed compile raises CompileError naming the file and `target`."""
    nvrtc = _nvrtc()
    filename = _filename(name)
    prog = _check(
        nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [o.encode() for o in options]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(prog)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(
                f"NVRTC {nvrtc_version()[0]}.{nvrtc_version()[1]} could not compile {filename} "
                f"{target}: {status.name}",
                source,
                log,
                options,
            )
        yield prog, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cuda(
    source: str, name: str, arch: int, include_dirs: tuple[str, ...] = ()
) -> CompiledModule:
    """Compile `source` to a cubin for sm_`arch`; `name` names the file in NVRTC's messages.

    include_dirs are added after the CUDA headers' folder (e.g. fuser's templates folder with
    its .cuh helpers). Raises CompileError carrying the NVRTC log, the options and the source.
    """
    nvrtc = _nvrtc()
    options = options_for(arch, include_dirs)
    with _program(source, name, options, f"for sm_{arch}") as (prog, log):
        if "ptxas" not in log:  # ptxas -v always prints at least "0 bytes gmem" when it runs
            raise ToolchainError(
                f"NVRTC compiled {_filename(name)} without running ptxas (a cached cubin?), so "
                f"there is no resource report; options: {' '.join(options)}. Compile with "
                "compile_options(arch), which asks ptxas for the report (--ptxas-options=-v) "
                "and NVRTC not to serve cached cubins (--no-cache, where NVRTC takes it)"
            )
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    return CompiledModule(
        cubin=bytes(cubin),
        log=log,
        options=options,
        resources=tuple(parse_ptxas_log(log).values()),
        nvrtc_version=nvrtc_version(),
    )


def ptx_of(source: str, name: str, arch: int, include_dirs: tuple[str, ...] = ()) -> str:
    """The PTX NVRTC makes of `source` for compute_`arch`, with fuser's options otherwise (no
    ptxas runs): what the compiler made of a template, e.g. whether a vector store stayed one
    instruction. Raises CompileError like compile_cuda()."""
    nvrtc = _nvrtc()
    options = tuple(
        f"--gpu-architecture=compute_{int(arch)}" if o.startswith("--gpu-architecture=") else o
        for o in options_for(arch, include_dirs) if not o.startswith("--ptxas-options")
    )
    with _program(source, name, options, f"to PTX for compute_{arch}") as (prog, _):
        size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = bytearray(size)
        _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    return ptx.decode(errors="replace").rstrip("\0")
