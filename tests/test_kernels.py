"""CPU: the kernel builder. A compile error carries the numbered source and leaves nothing in
the cache; spills make the builder rebuild for fewer blocks per SM; nothing is half-built."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import fuser.kernels as kernels
from fuser import BadInputError, CompileError, DataType, DefinitionError, OutOfResourcesError
from fuser.analysis import analyze
from fuser.cache import KernelCache
from fuser.device import DeviceSpec
from fuser.fusions import ROW_FUSIONS
from fuser.schedulers import Hints, Problem
from fuser.schedulers.base import Dealing

H200 = DeviceSpec.get("h200")


def _build(cache, name="rmsnorm_bwd", hidden=1024):
    fd = ROW_FUSIONS[name](DataType.BFloat16)
    return kernels.build(fd.name, analyze(fd.fusion), Problem(hidden, 16384, 16), H200,
                         cache=cache)


def test_compile_error_leaves_no_entry_and_the_next_build_works(tmp_path, monkeypatch):
    cache = KernelCache(str(tmp_path))
    real = kernels._render

    def broken(*args):
        source = real(*args)
        broken_text = source.source.replace("const Part part;", "const Part part =;")
        return dataclasses.replace(source, source=broken_text)

    monkeypatch.setattr(kernels, "_render", broken)
    with pytest.raises(CompileError) as error:
        _build(cache)
    assert "rmsnorm_bwd_row" in error.value.source and error.value.log
    assert "--gpu-architecture=sm_90" in str(error.value)
    assert any(line.strip().startswith("1  ") for line in str(error.value).splitlines())
    assert cache.stats()["entries"] == 0 and cache.stats()["in_memory"] == 0
    monkeypatch.setattr(kernels, "_render", real)
    built = _build(cache)
    assert not built.compiled.resource(built.source.row_entry).spills
    assert cache.stats()["entries"] == 1


def test_spills_rebuild_for_fewer_blocks_per_sm(tmp_path, monkeypatch):
    """ptxas's report decides: a kernel that spills is rebuilt for one block per SM fewer."""
    cache = KernelCache(str(tmp_path))
    real = cache.get_or_compile
    first = _build(KernelCache(str(tmp_path / "probe")))
    planned = first.schedule.blocks_per_sm
    assert planned > 1

    class Spilling:
        """The real module, but its row kernel reports spills at the planned residency (each
        module its own flag: builds may compile attempts in threads)."""

        def __init__(self, compiled, spilling):
            self._compiled, self._spilling = compiled, spilling

        def resource(self, name):
            r = self._compiled.resource(name)
            return dataclasses.replace(r, spill_stores=64) if self._spilling else r

    def get_or_compile(source, *args):
        compiled = real(source, *args)
        return Spilling(compiled, f"__launch_bounds__({first.schedule.threads}, {planned})"
                        in source)

    monkeypatch.setattr(cache, "get_or_compile", get_or_compile)
    built = _build(cache)
    assert built.schedule.blocks_per_sm == planned - 1
    assert f"ptxas spilled at {planned} block(s)/SM" in built.schedule.reason
    assert f"__launch_bounds__({first.schedule.threads}, {planned - 1})" in built.source.source



class _SpillingWhere:
    """A cache whose modules report spills in the row kernel where `spills(source)` holds."""

    def __init__(self, cache, spills):
        self._cache, self._spills = cache, spills

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def get_or_compile(self, source, *args):
        compiled = self._cache.get_or_compile(source, *args)
        spilling = self._spills(source)

        class Module:
            def __getattr__(self, name):
                return getattr(compiled, name)

            def resource(self, entry):
                r = compiled.resource(entry)
                return dataclasses.replace(r, spill_stores=64) if spilling else r

        return Module()


@pytest.mark.parametrize("only_candidate", [False, True])
def test_no_rebuild_below_512_resident_threads_while_a_candidate_follows(
        only_candidate, tmp_path, monkeypatch):
    """dropout_rmsnorm_fwd at 2048 plans registers for 2 blocks of 256 threads per SM; when
    that spills, one block of 256 would leave 8 warps an SM: the next candidate is compiled
    instead, unless the first is the only candidate."""
    fd = ROW_FUSIONS["dropout_rmsnorm_fwd"](DataType.BFloat16)
    info = analyze(fd.fusion)
    planned = next(kernels.candidates(info, Problem(2048, 16384, 16), H200, None))
    assert (planned.blocks_per_sm - 1) * planned.threads < kernels.MIN_REBUILT_THREADS
    if only_candidate:
        monkeypatch.setattr(kernels, "candidates", lambda *args: iter([planned]))
    cache = _SpillingWhere(KernelCache(str(tmp_path / "cache")),
                           lambda source: planned.reason in source and
                           f"__launch_bounds__({planned.threads}, {planned.blocks_per_sm})"
                           in source)
    built = kernels.build(fd.name, info, Problem(2048, 16384, 16), H200, cache=cache)
    if only_candidate:
        assert built.schedule.blocks_per_sm == planned.blocks_per_sm - 1
        assert "rebuilt for" in built.schedule.reason
    else:
        assert built.schedule.reason != planned.reason and "rebuilt" not in built.schedule.reason
        assert built.schedule.blocks_per_sm * built.schedule.threads >= 512

@pytest.mark.parametrize("only_candidate", [False, True])
def test_a_block_per_group_is_not_rebuilt_below_two_blocks_per_sm(only_candidate, tmp_path,
                                                                  monkeypatch):
    """rmsnorm_fwd at 16384 plans one stage of 512 threads, two blocks per SM, a block per
    row group; when that spills, one block per SM would leave the SM idle while the hardware
    starts the next: the next candidate is compiled instead, and where there is none the
    rebuild deals the row groups at fixed strides."""
    fd = ROW_FUSIONS["rmsnorm_fwd"](DataType.BFloat16)
    info = analyze(fd.fusion)
    problem = Problem(16384, 16384, 16)
    planned = next(kernels.candidates(info, problem, H200, None))
    assert (planned.blocks_per_sm, planned.dealing) == (2, Dealing.GRID)
    if only_candidate:
        monkeypatch.setattr(kernels, "candidates", lambda *args: iter([planned]))
    cache = _SpillingWhere(KernelCache(str(tmp_path / "cache")),
                           lambda source: f"__launch_bounds__({planned.threads}, 2)" in source)
    built = kernels.build(fd.name, info, problem, H200, cache=cache)
    if only_candidate:
        assert (built.schedule.blocks_per_sm, built.schedule.dealing) == (1, Dealing.STRIDED)
    else:
        assert built.schedule.reason != planned.reason and "rebuilt" not in built.schedule.reason
        assert not (built.schedule.dealing is Dealing.GRID and built.schedule.blocks_per_sm < 2)


def test_a_hinted_block_per_group_stays_so_when_rebuilt(tmp_path):
    """Hinted a block per group, rmsnorm_fwd 81920 over a cluster of 2 at 256 threads per row
    spills at every residency but one block per SM: the hint is kept there too (a hint is
    honoured or refused, never swapped for another dealing)."""
    fd = ROW_FUSIONS["rmsnorm_fwd"](DataType.BFloat16)
    hints = Hints(cluster=2, stages=1, storage=(("T0", "smem"),), dealing="grid",
                  threads_per_row=256)
    built = kernels.build(fd.name, analyze(fd.fusion), Problem(81920, 16384, 16), H200,
                          hints, cache=KernelCache(str(tmp_path)))
    s = built.schedule
    assert "rebuilt for" in s.reason and s.blocks_per_sm == 1, s.reason
    assert s.dealing is Dealing.GRID


def test_dump_dir_receives_source_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_DUMP_DIR", str(tmp_path / "dump"))
    built = _build(KernelCache(str(tmp_path / "cache")))
    sources = list((tmp_path / "dump").glob("rmsnorm_bwd_*.cu"))
    reports = list((tmp_path / "dump").glob("rmsnorm_bwd_*.txt"))
    assert len(sources) == len(reports) == 1
    assert sources[0].read_text() == built.source.source
    report = reports[0].read_text()
    assert "RowSchedule" in report and "static slot" in report and "registers" in report


def test_a_dump_dir_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """FUSER_DUMP_DIR at a file (or anywhere unwritable) is a BadInputError naming it, not
    an OSError from deep in a build."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv("FUSER_DUMP_DIR", str(blocked / "dump"))
    with pytest.raises(BadInputError, match=r"FUSER_DUMP_DIR='.*a_file/dump': the kernel's "
                                            r"source and report cannot be written there"):
        _build(KernelCache(str(tmp_path / "cache")))


def test_last_accessors_return_what_ran():
    """fd.last_cuda_code() is the CUDA text (not the KernelSource record), and the schedule and
    plan are the ones the kernel was built from; before any run they say so."""
    fd = ROW_FUSIONS["rmsnorm_fwd"](DataType.BFloat16)
    with pytest.raises(DefinitionError, match="nothing has run yet"):
        fd.last_cuda_code()
    built = kernels.build(fd.name, analyze(fd.fusion), Problem(4096, 64, 16),
                          DeviceSpec.get("h200"))
    fd._last_run = SimpleNamespace(kernel=SimpleNamespace(source=built.source,
                                                          schedule=built.schedule))
    assert fd.last_cuda_code() == built.source.source
    assert fd.last_schedule() is built.schedule and fd.last_smem_plan() is built.schedule.smem


def _normalize_by(divisor: str):
    """x / (a row value or a full tensor), fp32: what the division is made of."""
    from fuser import FusionDefinition

    with FusionDefinition(f"normalize_by_{divisor}") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        s = fd.ops.sum(fd.ops.abs(x), dims=[1], keepdim=True)
        row = fd.ops.broadcast_in_dim(s, shape=x.shape(), broadcast_dims=[0, 1])
        full = fd.ops.add(fd.ops.abs(x), fd.define_scalar(1.0))
        fd.add_output(fd.ops.div(x, row if divisor == "row" else full))
    return fd


def test_division_by_a_row_value_multiplies_by_its_reciprocal(tmp_path):
    """An element divided by a row value (softmax's sum) is multiplied by the value's
    reciprocal, computed once per row; a division by a full tensor stays a division."""
    cache = KernelCache(str(tmp_path))
    for divisor, expected in (("row", "* row_rcp_"), ("full", " / ")):
        fd = _normalize_by(divisor)
        built = kernels.build(fd.name, analyze(fd.fusion), Problem(1024, 64, 16), H200,
                              cache=cache)
        source = built.source.source
        outputs = [line for line in source.splitlines() if "const float e_" in line
                   and ("/" in line or "row_rcp_" in line)]
        assert outputs and all(expected in line for line in outputs), outputs
        assert ("const float row_rcp_" in source) == (divisor == "row")


class _AlwaysSpilling:
    """A cache whose every kernel reports spills; it counts the compiles asked of it."""

    def __init__(self, cache):
        self.cache, self.calls = cache, 0

    def get_or_compile(self, source, *args):
        self.calls += 1
        return _Spilled(self.cache.get_or_compile(source, *args))

    def holds(self, *args):
        return self.cache.holds(*args)

    def plan(self, key):  # no plans held: every build searches
        return None

    def store_plan(self, key, payload):
        pass


class _Spilled:
    def __init__(self, compiled):
        self._compiled = compiled

    def resource(self, name):
        return dataclasses.replace(self._compiled.resource(name), spill_stores=64)


@pytest.mark.parametrize("threads", ["1", "4"])
def test_a_build_gives_up_after_its_compile_budget_naming_the_spills(threads, tmp_path,
                                                                     monkeypatch):
    """Issue 13: a fusion whose every schedule spills retried every residency of every
    candidate (116 compiles, 646 s); FUSER_BUILD_MAX_COMPILES bounds it, one compile at a time
    or several."""
    monkeypatch.setenv("FUSER_BUILD_MAX_COMPILES", "3")
    monkeypatch.setenv("FUSER_BUILD_THREADS", threads)
    cache = _AlwaysSpilling(KernelCache(str(tmp_path)))
    with pytest.raises(OutOfResourcesError, match=r"(?s)gave up building fusion 'rmsnorm_bwd' "
                       r"at hidden \d+ after 3 compiles.*FUSER_BUILD_MAX_COMPILES=3.*spill"):
        _build(cache)
    assert cache.calls == 3


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_build_budget_is_refused_naming_the_variable(value, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_BUILD_MAX_SECONDS", value)
    with pytest.raises(BadInputError, match=rf"FUSER_BUILD_MAX_SECONDS='{value}': a positive "):
        _build(KernelCache(str(tmp_path)))


def _many_inputs(count: int, reduce: bool):
    """The sum of `count` bf16 row inputs (over the row, then normalized, when `reduce`)."""
    from fuser import FusionDefinition

    with FusionDefinition() as fd:
        ts = [fd.define_tensor(shape=[-1, -1], dtype=DataType.BFloat16) for _ in range(count)]
        acc = fd.ops.cast(ts[0], DataType.Float)
        for t in ts[1:]:
            acc = fd.ops.add(acc, fd.ops.cast(t, DataType.Float))
        if reduce:
            acc = fd.ops.mul(acc, fd.ops.reciprocal(fd.ops.sum(acc, dims=[1], keepdim=True)))
        fd.add_output(fd.ops.cast(acc, DataType.BFloat16))
    return fd


@pytest.mark.parametrize(("count", "reduce", "vec"), [(64, True, 4), (128, True, 2),
                                                      (128, False, 2)])
def test_many_inputs_build_in_one_compile_without_spills(count, reduce, vec, tmp_path,
                                                          monkeypatch):
    """Issue 13: 64 bf16 inputs summed with an inner reduction at hidden 4096 took 116 NVRTC
    compiles (every schedule spilled: 8-element vectors of 64 inputs are 255 registers);
    vectors now read at most MAX_INPUT_BYTES_PER_VECTOR per step, and the first schedule
    compiles. The same for a 128-input pointwise sum, which spilled with no fallback."""
    monkeypatch.setenv("FUSER_BUILD_THREADS", "1")  # counts the compiles this build needs
    compiles = []
    spend = kernels.BuildBudget.spend
    monkeypatch.setattr(kernels.BuildBudget, "spend",
                        lambda self, attempts: compiles.append(1) or spend(self, attempts))
    fd = _many_inputs(count, reduce)
    built = kernels.build(fd.name, analyze(fd.fusion), Problem(4096, 1024, 16), H200,
                          cache=KernelCache(str(tmp_path)))
    resources = built.compiled.resource(built.source.row_entry)
    assert (len(compiles), resources.spills, built.schedule.vec) == (1, False, vec)


def test_pick_vec_bounds_the_input_bytes_of_a_vector_step():
    from fuser.schedulers.base import MAX_INPUT_BYTES_PER_VECTOR, pick_vec

    assert pick_vec(4096, [2] * 6, 16, input_bytes=10) == 8
    assert pick_vec(4096, [2] * 65, 16, input_bytes=128) == 4
    assert pick_vec(4096, [2] * 65, 16, input_bytes=130) == 2
    assert pick_vec(4096, [4], 16, input_bytes=4 * MAX_INPUT_BYTES_PER_VECTOR) == 1
    assert pick_vec(4098, [2, 2], 16, input_bytes=4) == 2


@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_candidates_are_offered_once_each(name):
    """The steps overlap (the largest cluster's on-chip choices come again when rows are
    re-read; both copy modes give the same plan where vectors are 16 bytes): a schedule
    offered twice would be compiled twice when the first spills."""
    from fuser.schedulers import candidates

    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    for hidden in (1024, 24578, 65536):
        offered = list(candidates(info, Problem(hidden, 16384, 16), H200))
        assert offered and len(set(offered)) == len(offered)


def test_a_build_whose_every_schedule_spills_says_so(tmp_path, monkeypatch):
    """Past the last candidate the error names the spills, not a lack of shared memory."""
    monkeypatch.setenv("FUSER_BUILD_MAX_COMPILES", "1000")
    cache = _AlwaysSpilling(KernelCache(str(tmp_path)))
    with pytest.raises(OutOfResourcesError) as error:
        _build(cache, "softmax_fwd", hidden=1000)
    assert str(error.value).startswith("every schedule of fusion 'softmax_fwd' at hidden 1000 "
                                       "spills registers on H200")
    assert "shared memory limit" not in str(error.value)


# ----- several attempts compiled at once ---------------------------------------------------------


def test_attempts_compiled_at_once_give_the_build_one_at_a_time_gives(tmp_path, monkeypatch):
    """rmsnorm_bwd at hidden 24578 (bf16) spills once (its first choice: two stages at 512
    threads, the weight in registers) before its second attempt compiles cleanly: compiled
    four at a time, the build takes the same second attempt."""
    fd = ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    info, problem = analyze(fd.fusion), Problem(24578, 16384, 16)
    built, caches = {}, {}
    for threads in ("1", "4"):
        monkeypatch.setenv("FUSER_BUILD_THREADS", threads)
        caches[threads] = KernelCache(str(tmp_path / threads))
        built[threads] = kernels.build(fd.name, info, problem, H200, cache=caches[threads])
    one, four = built["1"], built["4"]
    assert caches["1"].stats()["compiles"] == 2  # the one before it spilled
    assert (four.schedule, four.finalize, four.source) == (one.schedule, one.finalize, one.source)


class _Failing:
    """A cache whose compiles of some sources fail (a CompileError), whichever thread asks."""

    def __init__(self, cache, fails):
        self.cache, self.fails = cache, fails

    def get_or_compile(self, source, *args):
        if self.fails(source):
            raise CompileError("planted", log="", options=(), source=source)
        return self.cache.get_or_compile(source, *args)

    def holds(self, *args):
        return self.cache.holds(*args)

    def plan(self, key):  # no plans held: every build searches
        return None

    def store_plan(self, key, payload):
        pass


def test_an_attempt_after_the_answer_cannot_fail_the_build(tmp_path, monkeypatch):
    """The later attempts of a batch compile before the first's result is known; their
    errors count only where the build gets to them (rmsnorm_bwd at hidden 1024: its first
    attempt compiles cleanly)."""
    monkeypatch.setenv("FUSER_BUILD_THREADS", "4")
    fd = ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    info, problem = analyze(fd.fusion), Problem(1024, 16384, 16)
    first = next(kernels._attempts(fd.name, info, problem, H200, None)).source.source
    cache = KernelCache(str(tmp_path))
    built = _build(_Failing(cache, lambda source: source != first))
    assert built.source.source == first
    with pytest.raises(CompileError, match="planted"):  # as one at a time: the first fails
        _build(_Failing(cache, lambda source: source == first))


class _FirstSpills(_AlwaysSpilling):
    """A cache whose first module reports spills, the others as compiled."""

    def get_or_compile(self, source, *args):
        compiled = self.cache.get_or_compile(source, *args)
        self.calls += 1
        return _Spilled(compiled) if self.calls == 1 else compiled


def test_the_first_attempt_compiles_alone_then_a_batch(tmp_path, monkeypatch):
    """Most builds compile their first attempt cleanly, so it compiles alone; after it
    spills, the next attempts render and compile together. An error rendering a later one
    of that batch (any exception, not only a FuserError) counts only where the build gets to
    it: the batch's first attempt here compiles cleanly and is the answer."""
    monkeypatch.setenv("FUSER_BUILD_THREADS", "4")
    real, rendered = kernels._render, []

    def render(*args):
        rendered.append(args[2])
        if len(rendered) > 2:
            raise ZeroDivisionError("planted render bug")
        return real(*args)

    monkeypatch.setattr(kernels, "_render", render)
    cache = _FirstSpills(KernelCache(str(tmp_path)))
    built = _build(cache)
    assert built.schedule == rendered[1] and len(rendered) == 3 and cache.calls == 2


def test_builds_at_interpreter_shutdown_compile_one_at_a_time(tmp_path, monkeypatch):
    """No thread may start once the interpreter is finalizing (an atexit hook that builds):
    the batch compiles in the calling thread instead."""
    import threading

    monkeypatch.setenv("FUSER_BUILD_THREADS", "4")
    monkeypatch.setattr(kernels.sys, "is_finalizing", lambda: True)
    started = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    built = _build(KernelCache(str(tmp_path)), "dropout_rmsnorm_bwd", 65536)
    assert started == [] and built.schedule is not None


def test_build_threads(monkeypatch):
    monkeypatch.delenv("FUSER_BUILD_THREADS", raising=False)
    for cpus, threads in ((1, 1), (2, 2), (16, kernels.DEFAULT_BUILD_THREADS),
                          (128, kernels.DEFAULT_BUILD_THREADS)):  # the CPUs it may use
        monkeypatch.setattr(kernels.os, "sched_getaffinity", lambda pid, c=cpus: set(range(c)),
                            raising=False)
        assert kernels.build_threads() == threads
    monkeypatch.delattr(kernels.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(kernels.os, "cpu_count", lambda: None)
    assert kernels.build_threads() == 1
    monkeypatch.setenv("FUSER_BUILD_THREADS", "3")
    assert kernels.build_threads() == 3
    monkeypatch.setenv("FUSER_BUILD_THREADS", "0")
    with pytest.raises(BadInputError, match="FUSER_BUILD_THREADS='0': a positive integer"):
        kernels.build_threads()


def test_a_cached_first_attempt_compiles_nothing_ahead(tmp_path, monkeypatch):
    """A process whose kernel the disk cache holds takes it without compiling the attempts
    after it: four threads would otherwise compile three kernels it never uses."""
    monkeypatch.setenv("FUSER_BUILD_THREADS", "4")
    _build(KernelCache(str(tmp_path)))  # fills the folder
    fresh = KernelCache(str(tmp_path))  # a new process's cache: nothing in memory
    _build(fresh)
    assert (fresh.stats()["compiles"], fresh.stats()["disk_hits"]) == (0, 1)
