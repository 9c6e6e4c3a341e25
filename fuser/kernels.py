"""Fusion + problem + device -> schedule -> CUDA source -> compiled module, with no GPU.

The scheduler sizes a persistent kernel for a residency (blocks per SM) from a register
estimate, and the template asks ptxas to honour it through __launch_bounds__. An estimate is
only an estimate: when ptxas reports spills, the kernel is rebuilt for one block fewer per SM;
at one block per SM, with a batch loop unrolled half as far (where no register array needs it
fully unrolled); then the next candidate schedule is tried (another storage of the rows).
The schedule that comes out is the one the binary was built from, so the header comment, the
cache key and the launch all agree. A build is bounded: past FUSER_BUILD_MAX_COMPILES renders
(default 32) or FUSER_BUILD_MAX_SECONDS (default 600) it gives up, naming what it tried.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field, replace

from fuser.analysis import FusionInfo
from fuser.cache import KernelCache, default_cache
from fuser.codegen import KernelSource, render_pointwise, render_row, template_dir
from fuser.compile import CompiledModule
from fuser.device import DeviceSpec
from fuser.errors import BadInputError, HintError, OutOfResourcesError
from fuser.schedulers import Hints, Problem, candidates
from fuser.schedulers.base import FinalizeSchedule, PointwiseSchedule, RowSchedule
from fuser.schedulers.finalize import finalize_schedule, needs_finalize


@dataclass(frozen=True)
class Built:
    """A compiled kernel module and everything it was built from."""

    info: FusionInfo
    schedule: RowSchedule | PointwiseSchedule
    finalize: FinalizeSchedule | None
    source: KernelSource
    compiled: CompiledModule
    cubin_path: str

    def plans(self):
        """(entry name, smem plan) of each kernel in the module."""
        yield self.source.row_entry, self.schedule.smem
        if self.finalize is not None:
            yield self.source.finalize_entry, self.finalize.smem


def _render(name, info, sched, final) -> KernelSource:
    if isinstance(sched, PointwiseSchedule):
        return render_pointwise(name, info, sched)
    return render_row(name, info, sched, final)


def build(
    name: str,
    info: FusionInfo,
    problem: Problem,
    device: DeviceSpec,
    hints: Hints | None = None,
    cache: KernelCache | None = None,
) -> Built:
    """Schedule, render and compile fusion `name` for `problem` on `device`: the first
    candidate schedule that compiles without spills (each rebuilt for fewer blocks per SM,
    then a shorter unroll, before the next candidate is tried)."""
    cache = cache or default_cache()
    attempts: list[str] = []
    budget = BuildBudget.from_environment(f"fusion '{name}' at hidden {problem.hidden}")
    try:
        for sched in candidates(info, problem, device, hints):
            final = None
            if not isinstance(sched, PointwiseSchedule) and needs_finalize(info):
                lanes = hints.finalize_lanes if hints is not None else None
                final = finalize_schedule(info, problem, device, lanes)
            built = _compile(name, info, sched, final, problem, device, cache, attempts,
                             budget)
            if built is not None:
                return built
    except (HintError, OutOfResourcesError) as exc:
        if not attempts:
            raise
        raise type(exc)(f"{exc}\nCompiled, and spilled registers (ptxas):\n  "
                        + "\n  ".join(attempts)) from None
    raise OutOfResourcesError(
        f"every schedule of fusion '{name}' at hidden {problem.hidden} spills registers on "
        f"{device.name}:\n  " + "\n  ".join(attempts)
    )


def _compile(name: str, info: FusionInfo, sched: RowSchedule | PointwiseSchedule,
             final: FinalizeSchedule | None, problem: Problem, device: DeviceSpec,
             cache: KernelCache, attempts: list[str], budget: BuildBudget) -> Built | None:
    """The schedule compiled without spills, rebuilt for one block per SM fewer, then (at one
    block per SM) with its batch loop unrolled half as far, while ptxas spills; None (each
    attempt noted in `attempts`) when every rebuild spills."""
    for plan in (sched.smem, final.smem if final else None):
        if plan is not None:
            plan.check(f"fusion '{name}' at hidden {problem.hidden}")
    while True:
        budget.spend(attempts)
        source = _render(name, info, sched, final)
        compiled, path = cache.get_or_compile(source.source, name, device.arch,
                                              (str(template_dir()),))
        resources = compiled.resource(source.row_entry)
        if not resources.spills:
            built = Built(info, sched, final, source, compiled, path)
            _dump(built)
            return built
        attempts.append(f"{sched.reason}: {resources}")
        if not isinstance(sched, RowSchedule):
            return None
        if sched.blocks_per_sm > 1:
            sched = replace(sched, blocks_per_sm=sched.blocks_per_sm - 1,
                            reason=sched.reason + f"; ptxas spilled at {sched.blocks_per_sm} "
                            f"block(s)/SM, rebuilt for {sched.blocks_per_sm - 1}")
        elif not sched.full_unroll and sched.unroll > 1:
            sched = replace(sched, unroll=sched.unroll // 2,
                            reason=sched.reason + f"; ptxas spilled unrolling {sched.unroll}, "
                            f"rebuilt unrolling {sched.unroll // 2}")
        else:
            return None


@dataclass
class BuildBudget:
    """How many kernels a build may render and compile, and for how long, before it gives
    up: a fusion whose every schedule spills would otherwise retry every residency of every
    candidate (over a hundred NVRTC runs, minutes that look like a hang)."""

    what: str
    max_compiles: int
    max_seconds: float
    compiles: int = 0
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def from_environment(cls, what: str) -> BuildBudget:
        return cls(what, _positive("FUSER_BUILD_MAX_COMPILES", 32),
                   _positive("FUSER_BUILD_MAX_SECONDS", 600))

    def spend(self, attempts: list[str]) -> None:
        """Count one more compile, or give up naming what was tried."""
        elapsed = time.monotonic() - self.started
        if self.compiles >= self.max_compiles or elapsed >= self.max_seconds:
            raise OutOfResourcesError(
                f"gave up building {self.what} after {self.compiles} compiles in "
                f"{elapsed:.0f} s (FUSER_BUILD_MAX_COMPILES={self.max_compiles}, "
                f"FUSER_BUILD_MAX_SECONDS={self.max_seconds:g}); each spilled registers:\n  "
                + "\n  ".join(attempts[-8:])
                + "\nRaise the limits to try further schedules, or split the fusion.")
        self.compiles += 1


def _positive(variable: str, default: int) -> int:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise BadInputError(f"{variable}={text!r}: a positive integer is needed (default "
                            f"{default})")
    return value


def _dump(built: Built) -> None:
    """With FUSER_DUMP_DIR set, write each built module's CUDA source and a report (schedule,
    shared-memory plans, ptxas resources) there, named after the fusion and the source hash:
    what nvFuser users get from NVFUSER_DUMP=cuda_to_file,scheduler_params,ptxas_verbose."""
    folder = os.environ.get("FUSER_DUMP_DIR")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    stem = os.path.join(folder, f"{built.source.name}_"
                        f"{hashlib.sha256(built.source.source.encode()).hexdigest()[:12]}")
    report = [str(built.schedule)] + ([str(built.finalize)] if built.finalize else [])
    for entry, plan in built.plans():
        report += [f"shared memory plan of {entry}:", plan.table(),
                   str(built.compiled.resource(entry))]
    with open(stem + ".cu", "w") as f:
        f.write(built.source.source)
    with open(stem + ".txt", "w") as f:
        f.write("\n\n".join(report) + "\n")
