"""fuser.explain(fd, shapes): every step for any fusion, without a GPU.

    import fuser
    report = fuser.explain(fd, [(16384, 4096), (4096,)], device="h200")
    print(report)                  # what `python -m fuser show` prints
    report.schedule                # the frozen schedule record, report.smem_plans, .resources...

The problem is the one fd.execute() would schedule for inputs of those shapes (the same row
count, hidden size and rows the heuristic sees; the widest pointer alignment, 16 bytes), so
the schedule, the shared-memory plans, the CUDA source and the ptxas report are those of the
kernel that would run. The kernel is compiled offline by NVRTC for the device preset's
architecture (through the kernel cache), so the ptxas report is the real one.

`python -m fuser show` prints the same report for the ready fusions (fuser.fusions) and for a
fusion defined in a user's file (`show path/to/file.py:NAME`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fuser.dtypes import DataType
from fuser.errors import BadInputError, HintError, ToolchainError
from fuser.frontend import FusionDefinition
from fuser.ir import Scalar, Tensor, as_tensor

if TYPE_CHECKING:
    from fuser.analysis import FusionInfo
    from fuser.cache import KernelCache
    from fuser.compile import KernelResources
    from fuser.device import DeviceSpec
    from fuser.kernels import Built
    from fuser.sass import InstructionMix
    from fuser.schedulers import Hints, Problem
    from fuser.schedulers.base import FinalizeSchedule, KernelSchedule
    from fuser.segment import Segmentation
    from fuser.smem import SmemPlan

Shape = tuple[int, ...]

#: The widest access the kernels make; explain() assumes inputs aligned to it, as arrays fresh
#: from an allocator are (fd.execute() plans narrower loads for inputs at odd offsets).
ALIGN_BYTES = 16


@dataclass(frozen=True)
class Explanation:
    """Every step fuser takes for one fusion, problem and device; str() is the full report.

    smem_plans and resources map each kernel entry of the module (the row or pointwise
    kernel first, then the column finalize kernel where there is one) to its shared-memory
    plan and to what ptxas reported for it."""

    name: str  # the fusion's name (its kernels are named after it)
    input_names: tuple[str, ...]  # the fusion's inputs, as repr(fd) names them
    definition: str  # repr(fd): Python that rebuilds the fusion
    shapes: tuple[Shape | None, ...]  # per fusion input: its shape, None for a scalar input
    rows: int  # rows of the problem: the product of the row extents
    hidden: int  # the innermost extent
    device: DeviceSpec
    hints: Hints | None
    problem: Problem  # what the schedulers saw: hidden, rows (base.problem_rows), alignment
    info: FusionInfo  # the classification
    schedule: KernelSchedule
    finalize: FinalizeSchedule | None  # the column finalize kernel's schedule, if any
    smem_plans: Mapping[str, SmemPlan]  # entry -> shared-memory plan
    source: str  # the CUDA source
    resources: Mapping[str, KernelResources]  # entry -> ptxas report
    built: Built  # the compiled module (cubin path, signatures), as fuser.kernels.build gives
    left_out: tuple[str, ...] = ()  # ops no output depends on (lowering.left_out)
    spread: tuple[str, ...] = ()  # reductions computed along hidden (spread.described)

    @property
    def entries(self) -> tuple[str, ...]:
        """The kernel entry names, the main kernel first."""
        return tuple(self.smem_plans)

    def title(self) -> str:
        labels = dict.fromkeys(as_tensor(v).dtype.label for v in self.info.fusion.inputs
                               if isinstance(v, Tensor))
        words = self.hints.words() if self.hints is not None else ""
        return (f"{self.name}  [{self.rows} x {self.hidden}]  {', '.join(labels) or '-'}  on "
                f"{self.device.name}" + (f"  with {words}" if words else ""))

    def inputs(self) -> str:
        """One line: each input with its dtype and the shape it was given."""
        words = []
        for name, v, shape in zip(self.input_names, self.info.fusion.inputs, self.shapes,
                                  strict=True):
            what = list(shape or ()) if isinstance(v, Tensor) else "scalar"
            words.append(f"{name} {v.dtype.label} {what}")
        return ", ".join(words) or "-"

    def __str__(self) -> str:
        parts = [
            section(self.title()),
            f"inputs:  {self.inputs()}",
            f"problem: {self.rows} rows x hidden {self.hidden}; the heuristic sees "
            f"rows={self.problem.rows}, {self.problem.align_bytes}-byte aligned inputs",
            *self.repeated_rows(),
            "fusion definition (repr):",
            self.definition.rstrip(),
            *_left_out_lines(self.left_out),
            *_spread_lines(self.spread),
            section("classification"),
            self.info.describe(),
            section("schedule"),
            str(self.schedule),
        ]
        if self.finalize is not None:
            parts += ["", str(self.finalize)]
        for entry, plan in self.smem_plans.items():
            parts += [section(f"shared memory plan: {entry}"), plan.table()]
        parts += [section("ptxas report (NVRTC, offline)")]
        parts += [str(r) for r in self.resources.values()]
        parts += [section("machine code (nvdisasm of the cubin, static counts)")]
        parts += self._machine_code_lines()
        parts += [section("CUDA source"), self.source.rstrip()]
        return "\n".join(parts)

    def repeated_rows(self) -> list[str]:
        """A line per input read repeated (FusionInfo.repeated): the row of it kernel row r
        reads at these shapes, with the values the launch passes."""
        from fuser.executor import repeated_rows
        from fuser.shapes import bind_shapes

        values = repeated_rows(self.info, bind_shapes(self.info.fusion, list(self.shapes)))
        return [f"repeated: {t.name} ({run.stop - run.first} of {len(self.info.row_axes)} row "
                f"axes) row (r / {values[2 * k]}) % {values[2 * k + 1]} for kernel row r"
                for k, (t, run) in enumerate(self.info.repeated)]

    def instruction_mix(self) -> Mapping[str, InstructionMix]:
        """Each entry's SASS instruction counts by unit (fuser.sass), read from the cubin by
        nvdisasm; raises ToolchainError where nvdisasm is not installed."""
        from fuser.sass import instruction_mix

        mixes = instruction_mix(self.built.cubin_file())
        return MappingProxyType({e: mixes[e] for e in self.entries if e in mixes})

    def _machine_code_lines(self) -> list[str]:
        """The report's lines for instruction_mix(), or why there are none."""
        try:
            return [str(m) for m in self.instruction_mix().values()]
        except ToolchainError as exc:
            return [str(exc)]


def section(title: str) -> str:
    """A report's section heading."""
    return f"\n=== {title} " + "=" * max(0, 72 - len(title))


def _left_out_lines(left: tuple[str, ...]) -> list[str]:
    """The report's line on the ops of the definition that no output depends on."""
    if not left:
        return []
    return [f"left out (no output depends on them, so no kernel computes them): {', '.join(left)}"]


def _spread_lines(spread: tuple[str, ...]) -> list[str]:
    """The report's line on the reductions lowering computes along hidden (fuser.spread)."""
    if not spread:
        return []
    return ["spread along hidden (every column the same total, beside a reduction over the same "
            f"rows, so no segment is cut for it): {', '.join(spread)}"]


def explain(
    fd: FusionDefinition,
    shapes: Sequence[Sequence[int] | None],
    dtypes: Sequence[Any] | None = None,
    device: str | DeviceSpec = "h200",
    hints: Hints | Mapping[str, Any] | None = None,
    *,
    cache: KernelCache | None = None,
) -> Explanation | SegmentedExplanation:
    """Classify, schedule, plan, render and compile `fd` for inputs of `shapes` on `device`,
    with no GPU: the report `python -m fuser show` prints, as a record.

    shapes   one entry per fusion input, in definition order: a tensor's shape (symbolic
             extents are bound by it, as fd.execute() binds them), None for a scalar input;
             or one shape per tensor input only (scalar inputs skipped)
    dtypes   optional, the same layout: each input's dtype (a DataType or a numpy dtype, None
             to skip one), checked against the definition as fd.execute() checks arrays
    device   a preset name (fuser.device.PRESETS: 'h200', 'h100', 'a100', ...) or a DeviceSpec
    hints    fuser.schedulers.Hints (or a dict of its fields) overriding the heuristic
    cache    the kernel cache to compile through (default: fuser's, FUSER_CACHE_DIR)

    Raises BadInputError for shapes or dtypes that disagree with the definition, and what
    scheduling and compiling raise (UnsupportedFusionError, HintError, OutOfResourcesError).
    """
    from fuser.device import DeviceSpec
    from fuser.executor import planned, segments_of

    if not isinstance(fd, FusionDefinition):
        raise BadInputError(
            f"explain(fd, ...): fd is a {type(fd).__module__}.{type(fd).__qualname__}, not a "
            "FusionDefinition; pass the `fd` of `with FusionDefinition() as fd:`")
    fd._require_outputs()
    spec = DeviceSpec.get(device)
    hints = _hints(hints)
    segmentation = segments_of(fd)
    if segmentation is not None:
        return _explain_segments(fd, segmentation, shapes, dtypes, spec, hints, cache)
    found = planned(fd, lambda: _explain_one(fd, shapes, dtypes, spec, hints, cache))
    if isinstance(found, Explanation):
        return found
    return _explain_segments(fd, found, shapes, dtypes, spec, hints, cache)


def _explain_one(fd: FusionDefinition, shapes, dtypes, spec: DeviceSpec, hints: Hints | None,
                 cache: KernelCache | None) -> Explanation:
    """explain() of a fusion that one kernel chain runs."""
    from fuser.analysis import analyze
    from fuser.kernels import build
    from fuser.lowering import left_out
    from fuser.spread import described

    info = analyze(fd.fusion)
    bound = _bound_shapes(info.fusion.inputs, _per_input(fd, "shapes", shapes))
    if dtypes is not None:
        _check_dtypes(fd, _per_input(fd, "dtypes", dtypes))
    rows, hidden, problem = _problem(info, bound)
    built = build(fd.name, info, problem, spec, hints, cache)
    plans = dict(built.plans())
    return Explanation(
        name=fd.name,
        input_names=tuple(v.name for v in fd.fusion.inputs),
        definition=repr(fd),
        shapes=tuple(bound),
        rows=rows,
        hidden=hidden,
        device=spec,
        hints=hints,
        problem=problem,
        info=info,
        schedule=built.schedule,
        finalize=built.finalize,
        smem_plans=MappingProxyType(plans),
        source=built.source.source,
        resources=MappingProxyType({e: built.compiled.resource(e) for e in plans}),
        built=built,
        left_out=left_out(fd.fusion),
        spread=described(fd.fusion),
    )


@dataclass(frozen=True)
class PermuteExplanation:
    """A permute between a segmented fusion's kernels, at the explained shapes: the move, the
    plan of fuser's permute kernel (fuser/permute.py) that makes it, its CUDA and ptxas
    report."""

    move: str  # layouts.describe of the permute
    shape: Shape  # its operand's shape
    plan: Any  # permute.PermutePlan
    source: str
    resources: KernelResources

    def __str__(self) -> str:
        return "\n".join([f"{self.move}", f"  at [{', '.join(map(str, self.shape))}]: "
                          f"{self.plan.describe()}", f"  ptxas: {self.resources}", "",
                          self.source.rstrip()])


@dataclass(frozen=True)
class SegmentedExplanation:
    """explain() of a fusion that runs as a chain of segments (fuser.segment): why it is cut,
    and each segment's Explanation (its fusion, schedule, plans, ptxas report, source)."""

    name: str
    definition: str  # repr(fd) of the whole fusion
    segmentation: Segmentation
    # one per segment, in order (a segment that runs as segments of its own: theirs)
    parts: tuple[Explanation | SegmentedExplanation, ...]
    permutes: tuple[PermuteExplanation, ...] = ()  # the kernels of the moves between them
    left_out: tuple[str, ...] = ()  # ops no output depends on (lowering.left_out)

    def __str__(self) -> str:
        count = len(self.parts)
        head = [section(f"{self.name}: {count} segment{'' if count == 1 else 's'}"),
                "fusion definition (repr):", self.definition.rstrip(),
                *_left_out_lines(self.left_out), "", str(self.segmentation)]
        moves = [f"{section('permute kernel between segments')}\n{p}" for p in self.permutes]
        return "\n".join(head + [str(p) for p in self.parts] + moves)


def _explain_segments(fd: FusionDefinition, segmentation: Segmentation, shapes, dtypes,
                      spec: DeviceSpec, hints: Hints | None,
                      cache: KernelCache | None) -> SegmentedExplanation:
    """Each segment explained at the shapes its inputs have when `fd` runs on `shapes`."""
    from fuser.lowering import left_out
    from fuser.shapes import bind_shapes

    if hints is not None:
        raise segmentation.hint_error(fd.name)
    lowered = segmentation.lowered
    bound = _bound_shapes(lowered.inputs, _per_input(fd, "shapes", shapes))
    if dtypes is not None:
        _check_dtypes(fd, _per_input(fd, "dtypes", dtypes))
    sizes = bind_shapes(lowered, bound)
    parts = []
    for s in segmentation.segments:
        part = explain(s.definition, [sizes.shape(v) if isinstance(v, Tensor) else None
                                      for v in s.inputs], device=spec, cache=cache)
        parts.append(part)
    return SegmentedExplanation(fd.name, repr(fd), segmentation, tuple(parts),
                                _permutes(segmentation, sizes, spec, cache), left_out(fd.fusion))


def _permutes(segmentation: Segmentation, sizes, spec: DeviceSpec,
              cache: KernelCache | None) -> tuple[PermuteExplanation, ...]:
    """The permute kernel of each permute between kernels at `sizes`, compiled offline (its
    input taken as 16-byte aligned)."""
    from fuser import layouts, permute

    found = []
    for e in segmentation.layouts:
        if e.op != "permute":
            continue
        operand = as_tensor(e.inputs[0])
        shape = sizes.shape(operand)
        plan = permute.plan(shape, tuple(e.attr("dims")), operand.dtype.itemsize, ALIGN_BYTES)
        source, compiled = permute.compiled(plan, spec, cache)
        found.append(PermuteExplanation(layouts.describe(e), shape, plan, source,
                                        compiled.resource(permute.entry_name(plan))))
    return tuple(found)


def _problem(info: FusionInfo, shapes: list[Shape | None]) -> tuple[int, int, Problem]:
    """(rows, hidden, the Problem) as fuser.executor._plan derives them from inputs of these
    shapes: rows are the product of the row extents, and the heuristic sees them (a group's,
    FusionInfo.group_axes) as schedulers.base.problem_rows rounds them, and the groups as
    problem_groups does; the inputs are taken as 16-byte aligned."""
    from fuser.schedulers import Problem
    from fuser.schedulers.base import problem_groups, problem_rows
    from fuser.shapes import bind_shapes

    sizes = bind_shapes(info.fusion, shapes)
    rows = math.prod(sizes.value(axis) for axis in info.row_axes)
    groups, group_rows = info.group_rows(sizes)
    hidden = sizes.value(info.hidden_axis) if info.hidden_axis is not None else 1
    return rows, hidden, Problem(hidden, problem_rows(info, group_rows, groups), ALIGN_BYTES,
                                 problem_groups(info, groups))


def _hints(hints: Hints | Mapping[str, Any] | None) -> Hints | None:
    """Hints as given, or made from a dict of their fields."""
    from fuser.schedulers import Hints

    if hints is None or isinstance(hints, Hints):
        return hints
    if not isinstance(hints, Mapping):
        raise BadInputError(f"explain(hints={hints!r}): pass a fuser.schedulers.Hints or a "
                            "dict of its fields, e.g. {'stages': 2}")
    fields = [f.name for f in dataclasses.fields(Hints)]
    unknown = sorted(str(k) for k in hints if k not in fields)
    if unknown:
        raise HintError(f"explain(hints=...): {', '.join(unknown)} is not a hint; the hints "
                        f"are {', '.join(fields)}")
    return Hints(**dict(hints))


def _bound_shapes(inputs: Sequence[Any], given: list[Any]
                  ) -> list[Shape | None]:
    """Each tensor input's shape as a tuple of ints (bind_shapes checks it against the
    definition), None for the scalar inputs."""
    bound: list[Shape | None] = []
    for i, (v, shape) in enumerate(zip(inputs, given, strict=True)):
        if isinstance(v, Scalar):
            if shape is not None:
                raise BadInputError(f"shapes[{i}] is {shape!r} for the scalar input {v.name}; "
                                    "give None for scalar inputs")
            bound.append(None)
        else:
            bound.append(None if shape is None else _shape(i, v.name, shape))
    return bound


def _per_input(fd: FusionDefinition, what: str, given: Sequence[Any]) -> list[Any]:
    """`given` with one entry per fusion input: as it is, or (one entry per tensor input)
    with None put in for the scalar inputs."""
    inputs = fd.fusion.inputs
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise BadInputError(
            f"explain(fd, {what}=...): {what} must be a list with one entry per input of "
            f"fusion '{fd.name}' ({_names(inputs)}), got {type(given).__name__} {given!r:.80}")
    given = list(given)
    tensors = [v for v in inputs if isinstance(v, Tensor)]
    if len(given) == len(inputs):
        return given
    if len(given) == len(tensors):
        it = iter(given)
        return [next(it) if isinstance(v, Tensor) else None for v in inputs]
    scalars = len(inputs) - len(tensors)
    also = (f", or one per tensor input ({_names(tensors)})" if scalars else "")
    raise BadInputError(
        f"fusion '{fd.name}' has {len(inputs)} inputs ({_names(inputs)}), got {len(given)} "
        f"{what}; give one per input, None for a scalar input{also}")


def _names(vals: Sequence[Any]) -> str:
    return ", ".join(v.name for v in vals) or "none"


def _shape(i: int, name: str, shape: Any) -> Shape:
    """A tensor input's shape as a tuple of ints, or BadInputError."""
    try:
        return tuple(operator.index(d) for d in shape)
    except TypeError:
        pass
    raise BadInputError(
        f"shapes[{i}] for the tensor input {name} is {shape!r}; give its shape as a tuple of "
        "ints, e.g. (16384, 4096)")


def _check_dtypes(fd: FusionDefinition, dtypes: list[Any]) -> None:
    for i, (v, dtype) in enumerate(zip(fd.fusion.inputs, dtypes, strict=True)):
        if dtype is None:
            continue
        given = dtype if isinstance(dtype, DataType) else _from_numpy(i, v.name, dtype)
        if given is not v.dtype:
            raise BadInputError(
                f"input {i} ({v.name}) has dtype {given}; the definition declares {v.dtype}")


def _from_numpy(i: int, name: str, dtype: Any) -> DataType:
    try:
        found = DataType.from_numpy(dtype)
    except TypeError:
        found = None
    if found is None:
        raise BadInputError(
            f"dtypes[{i}] for {name} is {dtype!r}; give a fuser.DataType (e.g. "
            "DataType.BFloat16) or a numpy dtype of one")
    return found
