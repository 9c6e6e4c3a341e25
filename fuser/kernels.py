"""Fusion + problem + device -> schedule -> CUDA source -> compiled module, with no GPU.

The scheduler sizes a persistent kernel for a residency (blocks per SM) from a register
estimate, and the template asks ptxas to honour it through __launch_bounds__. An estimate is
only an estimate: when ptxas reports spills, the kernel is rebuilt for one block fewer per SM,
unless that leaves an SM fewer than MIN_REBUILT_THREADS threads and another candidate follows; at
one block per SM, with a batch loop unrolled half as far (where no register array needs it
fully unrolled); then the next candidate schedule is tried (another storage of the rows).
The schedule that comes out is the one the binary was built from, so the header comment, the
cache key and the launch all agree. A build is bounded: past FUSER_BUILD_MAX_COMPILES renders
(default 32) or FUSER_BUILD_MAX_SECONDS (default 600) it gives up, naming what it tried.
Once the first attempt has spilled, the next attempts in that order compile at once where CPUs
are free (FUSER_BUILD_THREADS, default up to DEFAULT_BUILD_THREADS), and the first that does
not spill is taken: the same answer, sooner when ptxas spills.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TypeVar

from fuser import plans
from fuser.analysis import FusionInfo
from fuser.cache import KernelCache, default_cache
from fuser.compile import CompiledModule, template_dir
from fuser.device import DeviceSpec
from fuser.errors import BadInputError, FuserError, HintError, OutOfResourcesError
from fuser.schedulers import Hints, Problem, candidates
from fuser.schedulers.base import (
    FinalizeSchedule,
    KernelSchedule,
    OuterSchedule,
    PointwiseSchedule,
    RowSchedule,
)
from fuser.schedulers.finalize import finalized
from fuser.schedulers.outer_persistent import rebuilt_blocks
from fuser.schedulers.row_dealing import rebuilt_dealing
from fuser.signature import KernelSource

T = TypeVar("T")

# Attempts a build compiles at once, by default, after its first spilled. On the H200 preset
# (bf16 and fp32, hidden 1024 to 131072) 38 of 324 defaults take more than one compile, at
# most five (gelu_bwd 65536 / 131072; four: rmsnorm_bwd 24578, dropout_layernorm_fwd 1024):
# at three a build, all of them finish in at most three rounds.
DEFAULT_BUILD_THREADS = 3
# A spilled schedule is rebuilt for fewer blocks per SM only while this many threads (16 warps)
# stay resident, unless no other candidate follows: fewer leave a memory-bound row kernel too
# few loads in flight, and the next candidate (rows in shared memory, fewer registers) keeps
# the planned residency (dropout+RMSNorm forward at 8192, bf16, H200: a register plan rebuilt
# for one block of 256 threads ran at 0.63 of the copy, its neighbours at 0.93).
MIN_REBUILT_THREADS = 512


@dataclass(frozen=True)
class Built:
    """A compiled kernel module and everything it was built from."""

    info: FusionInfo
    schedule: KernelSchedule
    finalize: FinalizeSchedule | None
    source: KernelSource
    compiled: CompiledModule
    # The path of a file holding the cubin, written when first asked for (KernelCache.
    # cubin_file): for the tools that read one; kernels load from compiled.cubin
    cubin_file: Callable[[], str]

    def plans(self):
        """(entry name, smem plan) of each kernel in the module."""
        yield self.source.row_entry, self.schedule.smem
        if self.finalize is not None and not self.finalize.fused:
            yield self.source.finalize_entry, self.finalize.smem


def _render(name, info, sched, final) -> KernelSource:
    from fuser.codegen import (  # not needed where a plan is held
        render_outer,
        render_pointwise,
        render_row,
    )

    if isinstance(sched, PointwiseSchedule):
        return render_pointwise(name, info, sched)
    if isinstance(sched, OuterSchedule):
        return render_outer(name, info, sched)
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
    attempt (_attempts' order) that compiles without spills. After the first attempt spills,
    up to build_threads() attempts compile at once (NVRTC releases the GIL), and the first in
    that order that does not spill is taken, so the result is the one compiling them one by
    one gives. A stored plan (fuser.plans) skips all of it."""
    cache = cache or default_cache()
    plan_key = plans.plan_key(name, info, problem, device, hints)
    planned = _planned(cache, plan_key, name, info, device)
    if planned is not None:
        return planned
    attempts: list[str] = []
    budget = BuildBudget.from_environment(f"fusion '{name}' at hidden {problem.hidden}")
    order = _attempts(name, info, problem, device, hints)
    threads = build_threads()
    try:
        # The first attempt alone (most compile cleanly: nothing to compile ahead), then
        # `threads` at a time once one has spilled.
        while batch := _next_batch(order, threads if attempts else 1, budget, attempts,
                                   _held(cache, name, device)):
            for attempt, result in zip(batch, _compiled(batch, name, device, cache), strict=True):
                if isinstance(attempt, Exception):
                    raise attempt
                compiled = result()
                resources = compiled.resource(attempt.source.row_entry)
                if not resources.spills:
                    built = Built(info, attempt.schedule, attempt.finalize, attempt.source,
                                  compiled, _cubin_file(cache, attempt.source, name, device))
                    cache.store_plan(plan_key, plans.encode(
                        (attempt.schedule, attempt.finalize, attempt.source)))
                    _dump(built)
                    return built
                attempts.append(f"{attempt.schedule.reason}: {resources}")
    except (HintError, OutOfResourcesError) as exc:
        if not attempts:
            raise
        raise type(exc)(f"{exc}\nCompiled, and spilled registers (ptxas):\n  "
                        + "\n  ".join(attempts)) from None
    raise OutOfResourcesError(
        f"every schedule of fusion '{name}' at hidden {problem.hidden} spills registers on "
        f"{device.name}:\n  " + "\n  ".join(attempts)
    )


def _planned(cache: KernelCache, key: str, name: str, info: FusionInfo,
             device: DeviceSpec) -> Built | None:
    """The build a stored plan (fuser.plans) names, its module from the kernel cache (compiled
    again where it was evicted); None where no plan is held, or it does not decode (then it
    is dropped) or its module now spills (a changed toolchain the key missed)."""
    data = cache.plan(key)
    if data is None:
        return None
    try:
        schedule, final, source = plans.decode(data)
    except ValueError:
        cache.discard_plan(key)
        return None
    compiled = cache.get_or_compile(*_cache_args(source, name, device))
    if compiled.resource(source.row_entry).spills:
        cache.discard_plan(key)
        return None
    built = Built(info, schedule, final, source, compiled,
                  _cubin_file(cache, source, name, device))
    _dump(built)
    return built


@dataclass(frozen=True)
class _Attempt:
    """One schedule a build may compile, rendered."""

    schedule: KernelSchedule
    finalize: FinalizeSchedule | None
    source: KernelSource


def _attempts(name: str, info: FusionInfo, problem: Problem, device: DeviceSpec,
              hints: Hints | None) -> Iterator[_Attempt]:
    """Every schedule a build may compile, best first: each candidate, then, while ptxas
    spills, that candidate rebuilt for one block per SM fewer, then (at one block per SM)
    with its batch loop unrolled half as far (_rebuilt). A candidate's shared-memory plans
    are checked when it is reached. Hinted to fuse the finalize, candidates whose rows cannot
    take it are passed over (the last one's refusal is raised)."""
    for sched, last in _marking_last(candidates(info, problem, device, hints)):
        final = None
        if isinstance(sched, RowSchedule):
            try:
                sched, final = finalized(info, sched, problem, device, hints)
            except HintError:  # hinted to fuse, and these rows cannot take it
                if not last:
                    continue  # a later candidate (less in shared memory) may
                raise
        for plan in (sched.smem, final.smem if final else None):
            if plan is not None:
                plan.check(f"fusion '{name}' at hidden {problem.hidden}")
        current: KernelSchedule | None = sched
        while current is not None:
            yield _Attempt(current, final, _render(name, info, current, final))
            current = _rebuilt(current, last, device,
                               hints is not None and hints.dealing is not None)


def _marking_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """(item, whether it is the last) for each item, looking one ahead. Where looking ahead
    raises (the candidates of a hint run out with a HintError), the item in hand is the last
    and the error is raised after it, as it was without the look ahead."""
    pending: list[T] = []
    try:
        for item in items:
            if pending:
                yield pending.pop(), False
            pending.append(item)
    except FuserError:
        if pending:
            yield pending.pop(), True
        raise
    if pending:
        yield pending.pop(), True


def _rebuilt(sched: KernelSchedule, last: bool, device: DeviceSpec, dealing_hinted: bool
             ) -> RowSchedule | OuterSchedule | None:
    """What to compile after `sched` spilled, or None: one block per SM fewer (not below
    MIN_REBUILT_THREADS resident threads, nor below the blocks its dealing needs
    (row_dealing.rebuilt_dealing; a hinted dealing stays as hinted), unless `sched` comes
    from the last candidate), then a batch loop unrolled half as far; an outer schedule
    rebuilt for fewer blocks per SM, as many as leave its threads a quarter more registers
    (outer_persistent.rebuilt_blocks), unless it holds rows in registers to fit its blocks
    (the next candidate keeps them all in shared memory); a pointwise schedule has no
    rebuild."""
    if isinstance(sched, OuterSchedule):
        if sched.held_rows and not last:
            return None
        fewer = rebuilt_blocks(sched, device)
        if fewer is None:
            return None
        return replace(sched, blocks_per_sm=fewer, reason=sched.reason + f"; ptxas spilled at "
                       f"{sched.blocks_per_sm} block(s)/SM, rebuilt for {fewer}")
    if not isinstance(sched, RowSchedule):
        return None
    fewer = (sched.blocks_per_sm - 1) * sched.threads
    if sched.blocks_per_sm > 1 and not last and fewer < MIN_REBUILT_THREADS:
        return None
    if sched.blocks_per_sm > 1:
        dealing = (sched.dealing if dealing_hinted
                   else rebuilt_dealing(sched.dealing, sched.blocks_per_sm - 1))
        if dealing is not sched.dealing and not last:
            return None
        return replace(sched, blocks_per_sm=sched.blocks_per_sm - 1, dealing=dealing,
                       reason=sched.reason + f"; ptxas spilled at {sched.blocks_per_sm} "
                       f"block(s)/SM, rebuilt for {sched.blocks_per_sm - 1}")
    if not sched.full_unroll and sched.unroll > 1:
        return replace(sched, unroll=sched.unroll // 2,
                       reason=sched.reason + f"; ptxas spilled unrolling {sched.unroll}, "
                       f"rebuilt unrolling {sched.unroll // 2}")
    return None


def _next_batch(order: Iterator[_Attempt], width: int, budget: BuildBudget,
                attempts: list[str], held: Callable[[_Attempt], bool]
                ) -> list[_Attempt | Exception]:
    """Up to `width` next attempts, each counted against the budget; one alone where the
    cache holds it (a process whose kernels are cached compiles nothing ahead). An error on
    the way (a plan that does not fit, hints no schedule honours, the budget spent, a render
    that fails) ends the batch as its last item: the build raises it only if no attempt
    before it compiles cleanly, as a build of one attempt at a time would."""
    batch: list[_Attempt | Exception] = []
    while len(batch) < width:
        try:
            attempt = next(order)
            budget.spend(attempts)
        except StopIteration:
            break
        except Exception as exc:  # raised where reached, as one attempt at a time would
            batch.append(exc)
            break
        batch.append(attempt)
        if len(batch) == 1 and held(attempt):
            break
    return batch


def _held(cache: KernelCache, name: str, device: DeviceSpec) -> Callable[[_Attempt], bool]:
    def held(attempt: _Attempt) -> bool:
        return cache.holds(*_cache_args(attempt.source, name, device))

    return held


def _cache_args(source: KernelSource, name: str, device: DeviceSpec) -> tuple:
    """What the kernel cache keys a module on, in the order its methods take: the source, the
    name, the arch and the include folders (the templates')."""
    return source.source, name, device.arch, (str(template_dir()),)


def _cubin_file(cache: KernelCache, source: KernelSource, name: str,
                device: DeviceSpec) -> Callable[[], str]:
    """Built.cubin_file: the cache writes the file when it is first asked for."""
    def cubin_file() -> str:
        return cache.cubin_file(*_cache_args(source, name, device))

    return cubin_file


def _compiled(batch: list[_Attempt | Exception], name: str, device: DeviceSpec,
              cache: KernelCache) -> list[Callable[[], CompiledModule]]:
    """Per item of `batch`, a function returning its module, raising its
    compile error: one compile runs here, several run in threads; those still running when
    the build has its answer finish in the background (into the cache)."""
    jobs = [_cache_args(a.source, name, device) if isinstance(a, _Attempt) else None
            for a in batch]
    one_by_one = [functools.partial(cache.get_or_compile, *job) if job else _never
                  for job in jobs]
    if sum(job is not None for job in jobs) <= 1 or sys.is_finalizing():
        return one_by_one  # at interpreter shutdown no thread may start
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(len(jobs), thread_name_prefix="fuser-build")
    try:
        futures = [pool.submit(cache.get_or_compile, *job) if job else None for job in jobs]
    except RuntimeError:  # shutdown began meanwhile: what was submitted finishes unused
        pool.shutdown(wait=False)
        return one_by_one
    pool.shutdown(wait=False)
    return [future.result if future else _never for future in futures]


def _never() -> CompiledModule:
    raise AssertionError("an error item of a batch has no module")  # build raises it first


def build_threads() -> int:
    """How many attempts a build compiles at once: $FUSER_BUILD_THREADS, else
    DEFAULT_BUILD_THREADS where the process may use that many CPUs (fewer where it may use
    fewer; one on one CPU). Only a build whose first attempt spills compiles more than one."""
    if os.environ.get("FUSER_BUILD_THREADS") is not None:
        return _positive("FUSER_BUILD_THREADS", 1)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(DEFAULT_BUILD_THREADS, cpus))


@dataclass
class BuildBudget:
    """How many kernels a build may render and compile, and for how long, before it gives
    up: a fusion whose every schedule spills would otherwise retry every residency of every
    candidate (over a hundred NVRTC runs, minutes that look like a hang). Both are checked
    before each compile starts: compiles started in time (one, or a batch of them in
    threads) run to their end."""

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
    stem = os.path.join(folder, f"{built.source.name}_"
                        f"{hashlib.sha256(built.source.source.encode()).hexdigest()[:12]}")
    report = [str(built.schedule)] + ([str(built.finalize)] if built.finalize else [])
    for entry, plan in built.plans():
        report += [f"shared memory plan of {entry}:", plan.table(),
                   str(built.compiled.resource(entry))]
    try:
        os.makedirs(folder, exist_ok=True)
        with open(stem + ".cu", "w") as f:
            f.write(built.source.source)
        with open(stem + ".txt", "w") as f:
            f.write("\n\n".join(report) + "\n")
    except OSError as exc:
        raise BadInputError(
            f"FUSER_DUMP_DIR={folder!r}: the kernel's source and report cannot be written "
            f"there ({exc.strerror or exc}); point it at a folder you can write, or unset it"
        ) from exc
