"""Build plans: what a build decided, kept in the kernel cache so a later process skips the
search.

kernels.build searches schedules, renders each candidate and compiles until one does not
spill. A process whose kernel is already in the disk cache still paid for that search and
for rendering it: the schedulers, codegen and Jinja (about 100 ms of imports and work on a
CPU, most of a first call). A plan holds the outcome (the schedule, the finalize schedule and
the rendered source) under a key of everything the outcome depends on:

- the lowered fusion, as the Python that rebuilds it (printer.python_definition), and the
  kernel's name;
- the problem (hidden size, rows, pointer alignment), the device spec and the hints;
- fuser's own code and templates (a digest of their names, sizes and modification times)
  and where the templates are (an include folder of the compile);
- the NVRTC (its ptxas decided which schedules spill) and the CUDA headers, as the kernel
  cache's key names them.

A hit hands the stored source to the kernel cache, which loads its cubin, or compiles it
again where it was evicted. A plan that fails to load counts as a miss and is searched and
stored afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
from collections.abc import Iterator

import fuser
from fuser.analysis import FusionInfo
from fuser.compile import cuda_headers_hash, nvrtc_key, template_dir
from fuser.device import DeviceSpec
from fuser.printer import python_definition
from fuser.schedulers.base import FinalizeSchedule, KernelSchedule, Problem
from fuser.schedulers.hints import Hints
from fuser.signature import KernelSource

FORMAT = 2  # of the key and the record; bumped when either changes meaning

Plan = tuple[KernelSchedule, FinalizeSchedule | None, KernelSource]


@functools.cache
def code_digest() -> str:
    """sha256 over fuser's Python modules and templates (name, size, modification time of
    each): any change to the schedulers, the renderer or a template may change what a build
    picks. Their stat, not their contents: reading them cost 7 ms of a first call; walked
    with os.scandir, not pathlib (whose rglob and relative_to took 8 ms more)."""
    digest = hashlib.sha256()
    package = os.path.dirname(os.path.realpath(fuser.__file__))
    for base, suffix in ((package, ".py"), (str(template_dir()), "")):
        for relative, st in sorted(_files(base, suffix)):
            digest.update(f"{relative}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def _files(base: str, suffix: str, prefix: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to base, with '/', stat) of every file under base ending in suffix,
    bytecode caches left out (Python rewrites them)."""
    with os.scandir(os.path.join(base, prefix) if prefix else base) as entries:
        for entry in entries:
            relative = f"{prefix}/{entry.name}" if prefix else entry.name
            if entry.is_dir():
                if entry.name == "__pycache__":
                    continue
                yield from _files(base, suffix, relative)
            elif entry.is_file() and entry.name.endswith(suffix):
                yield relative, entry.stat()


def plan_key(name: str, info: FusionInfo, problem: Problem, device: DeviceSpec,
             hints: Hints | None) -> str:
    """The key of a build's plan (the module docstring lists what it covers)."""
    parts = {
        "format": FORMAT,
        "name": name,
        "fusion": python_definition(info.fusion),
        "problem": repr(problem),
        "device": repr(device),
        "hints": repr(hints),
        "code": code_digest(),
        "templates": str(template_dir()),
        "nvrtc": nvrtc_key(),
        "cuda_headers": cuda_headers_hash(),
        "fuser": fuser.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def encode(plan: Plan) -> bytes:
    return pickle.dumps((FORMAT, plan), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Plan:
    """The plan in `data`; ValueError where it is not one this fuser wrote."""
    try:
        version, plan = pickle.loads(data)
        schedule, final, source = plan
    except Exception as exc:  # any unpickling failure means a damaged or foreign file
        raise ValueError(f"not a build plan ({type(exc).__name__}: {exc})") from None
    if (version != FORMAT or not isinstance(schedule, KernelSchedule)
            or not isinstance(final, FinalizeSchedule | None)
            or not isinstance(source, KernelSource)):
        raise ValueError("not a build plan of this format")
    return schedule, final, source
