"""The user surface: `with FusionDefinition() as fd:` and `fd.ops.*`, as nvFuser users know it.

FusionDefinition builds a Fusion (ir.py) and is also the user's handle on everything after:
execute(), validate() and the inspection calls delegate to the executor, named where called
(`import fuser` has loaded it already). Neither importing fuser nor defining and printing
fusions needs CuPy or a GPU.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re

import numpy as np

from fuser.dtypes import DataType
from fuser.errors import BadInputError, DefinitionError, FuserError, UnknownOpError
from fuser.ir import Fusion, Scalar, Tensor, Val
from fuser.ops import ELEMENTWISE, REDUCTIONS

_SHOWN_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _parameters(method) -> list[inspect.Parameter]:
    """A method's parameters after `self`."""
    return list(inspect.signature(method).parameters.values())[1:]


def _call_form(name: str, parameters: list[inspect.Parameter]) -> str:
    """`fd.ops.sum(t, dims, keepdim=False, dtype=None)`: how a method is called."""
    shown = [f"*{p.name}" if p.kind is p.VAR_POSITIONAL else p.name if p.default is p.empty
             else f"{p.name}={p.default!r}" for p in parameters]
    return f"fd.ops.{name}({', '.join(shown)})"


def _argument_error(name: str, method, kwargs: dict, error: TypeError) -> str:
    """What is wrong with the arguments of fd.ops.<name>, and what it takes."""
    parameters = _parameters(method)
    keywords = [p.name for p in parameters if p.kind in _SHOWN_KINDS]
    form = _call_form(name, parameters)
    unknown = [k for k in kwargs if k not in keywords]
    if not unknown:
        return f"{form}: {error}"
    close = sorted({c for k in unknown for c in difflib.get_close_matches(k, keywords, 1)
                    or [w for w in keywords if min(len(k), len(w)) > 2 and (k in w or w in k)]})
    meant = f" (did you mean {' or '.join(close)}?)" if close else ""
    return (f"{form}: no keyword {', '.join(map(repr, unknown))}{meant}; its keywords are "
            f"{', '.join(keywords)}")


def _checked(name: str, method):
    """`method`, checking its arguments against its signature first: a missing, extra or
    unknown argument is a DefinitionError naming the call form and the keywords allowed,
    not Python's TypeError."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError as e:
            raise DefinitionError(_argument_error(name, method, kwargs, e)) from None
        return method(self, *args, **kwargs)

    return call


def _checked_arguments(cls):
    """Class decorator: every public method of `cls` gets _checked()."""
    for name, method in list(vars(cls).items()):
        if callable(method) and not name.startswith("_"):
            setattr(cls, name, _checked(name, method))
    return cls


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _clamp_bound(fusion: Fusion, bound, dtype: DataType, lower: bool) -> Val:
    """A bound of clamp computed in `dtype`, as torch takes it: None is no bound (-inf / inf,
    or an integer type's limit); a Python int beyond an integer `dtype`'s range is no bound
    where it cuts nothing (a min below the range, a max above it) and refused otherwise."""
    which = "min" if lower else "max"
    if _is_int(bound) and not dtype.is_float:
        info = np.iinfo(dtype.numpy)
        if not info.min <= bound <= info.max:
            if (bound < info.min) != lower:
                raise DefinitionError(
                    f"clamp: {which}={bound} is outside the range of {dtype} ({info.min} to "
                    f"{info.max}): every element would become a value {dtype} cannot hold "
                    "(torch refuses it too); cast x to a wider type first"
                )
            bound = None
    elif _is_int(bound) and not -(2**63) <= bound < 2**63:
        bound = float(bound)  # a float computation: beyond Int64 as a Double constant
    if bound is not None:
        return fusion.as_val(bound)
    if dtype.is_float:
        return fusion.define_scalar(-math.inf if lower else math.inf, dtype=dtype)
    info = np.iinfo(dtype.numpy)
    return fusion.define_scalar(int(info.min if lower else info.max), dtype=dtype)


def _clamp_operands(fusion: Fusion, x, lo, hi) -> list[Val]:
    """x, min and max of clamp as operands (see _clamp_bound for None and Python ints)."""
    if lo is None and hi is None:
        raise DefinitionError(
            "fd.ops.clamp(x, min=None, max=None): min and max are both None; give at least one "
            "(as torch.clamp)"
        )
    x = fusion.as_val(x)
    bounds = [b if b is None or _is_int(b) else fusion.as_val(b) for b in (lo, hi)]
    given = [x, *(b for b in bounds if b is not None)]
    tensors = [v.dtype for v in given if isinstance(v, Tensor)]
    scalars = [v.dtype if isinstance(v, Val) else DataType.Int64 for v in given
               if not isinstance(v, Tensor)]
    dtype = ELEMENTWISE["clamp"].types.operand(tensors, scalars)  # refuses Bool
    return [x, _clamp_bound(fusion, bounds[0], dtype, True),
            _clamp_bound(fusion, bounds[1], dtype, False)]


def _reduction_method(name: str):
    """fd.ops.<name> for a reduction of ops.REDUCTIONS (sum, max, min)."""

    def method(self, t, dims, keepdim: bool = False, dtype: DataType | None = None):
        return self._fusion.reduction(name, t, dims, keepdim, dtype)

    method.__name__ = name
    method.__qualname__ = f"Ops.{name}"
    method.__doc__ = (f"fd.ops.{name}(t, dims, keepdim=False, dtype=None): "
                      f"{REDUCTIONS[name].doc} (fuser.ops.REDUCTIONS[{name!r}].doc)")
    return method


def _with_reductions(cls):
    """Class decorator: a method per reduction of ops.REDUCTIONS, its one source."""
    for name in REDUCTIONS:
        setattr(cls, name, _reduction_method(name))
    return cls


@_checked_arguments
@_with_reductions
class Ops:
    """`fd.ops`: every op of ops.py, plus the structural ones.

    Misuse is a DefinitionError: an unknown op (UnknownOpError, also an AttributeError) lists
    the ops that exist; a wrong keyword or argument count names the call form and the
    keywords allowed."""

    def __init__(self, fusion: Fusion):
        self._fusion = fusion

    def __getattr__(self, name):
        if name.startswith("_"):  # copy, pickle and friends probe for dunders
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name not in ELEMENTWISE:
            raise self._unknown(name)
        fusion, arity = self._fusion, ELEMENTWISE[name].arity

        def op(*operands, **keywords):
            if keywords:
                raise DefinitionError(
                    f"fd.ops.{name} takes its {arity} operand{'s' if arity > 1 else ''} by "
                    f"position and no keywords; got {', '.join(f'{k}=' for k in keywords)}"
                )
            return fusion.elementwise(name, list(operands))

        op.__name__ = name
        op.__doc__ = ELEMENTWISE[name].doc
        return op

    @classmethod
    def _methods(cls) -> list[str]:
        return sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n)))

    def _unknown(self, name: str) -> UnknownOpError:
        elementwise = sorted(ELEMENTWISE)
        others = [n for n in self._methods() if n not in ELEMENTWISE]
        close = difflib.get_close_matches(name, elementwise + others, 3)
        meant = f" (did you mean {' or '.join(close)}?)" if close else ""
        return UnknownOpError(
            f"fd.ops has no op {name!r}{meant}. Elementwise ops: {', '.join(elementwise)}. "
            f"Reductions and structural ops: {', '.join(others)}"
        )

    def __dir__(self):
        return sorted({*ELEMENTWISE, *self._methods()})

    def clamp(self, x, min=None, max=None):
        """torch.clamp(x, min, max): min(max(x, min), max); either bound may be None (no
        bound), a number, a scalar or a tensor. See fuser.ops.ELEMENTWISE['clamp'].doc."""
        return self._fusion.elementwise("clamp", _clamp_operands(self._fusion, x, min, max))

    def softplus(self, x, beta=1.0, threshold=20.0):
        """torch.nn.functional.softplus(x, beta, threshold): x where x * beta > threshold, else
        log1p(exp(x * beta)) / beta. See fuser.ops.ELEMENTWISE['softplus'].doc."""
        return self._fusion.elementwise("softplus", [x, beta, threshold])

    def cast(self, v, dtype: DataType, rounds: bool = True):
        """`v` as `dtype`; to Half or BFloat16 rounded to nearest even, unless rounds=False:
        then the value stays the float the kernel computes (as an op's result of that type
        does) and is rounded only where it is stored."""
        return self._fusion.cast(v, dtype, rounds)

    def broadcast_in_dim(self, t, shape, broadcast_dims):
        return self._fusion.broadcast_in_dim(t, shape, broadcast_dims)

    def mean(self, t, dims, keepdim: bool = False):
        """torch.mean(t, dims, keepdim=): the sum over dims of a float tensor divided by the
        number of elements summed, in t's type (a Half or BFloat16 sum is a float in the
        kernel, rounded once at the end)."""
        return self._fusion.mean(t, dims, keepdim)

    def var_mean(self, t, dims, correction: int = 1, keepdim: bool = False):
        """torch.var_mean(t, dims, correction=, keepdim=): (variance, mean) over dims of a
        float tensor, the variance divided by max(n - correction, 0) (a correction at or past
        n gives inf, nan where the values are all equal, as torch)."""
        return self._fusion.var_mean(t, dims, correction, keepdim)

    def var(self, t, dims, correction: int = 1, keepdim: bool = False):
        """torch.var(t, dims, correction=, keepdim=): var_mean's variance alone."""
        return self._fusion.var(t, dims, correction, keepdim)

    def unsqueeze(self, t, dim: int):
        """torch.unsqueeze(t, dim): a size-1 axis inserted at dim (a broadcast_in_dim)."""
        return self._fusion.unsqueeze(t, dim)

    def squeeze(self, t, dims):
        """torch.squeeze(t, dims): the listed size-1 axes removed (dims an int or a list; each
        axis must be declared size 1)."""
        return self._fusion.squeeze(t, dims)

    def permute(self, t, dims):
        """torch.permute(t, dims): t's axes reordered (output axis i is axis dims[i]). It runs
        between kernels: a contiguous copy in the new order, made when its operand exists."""
        return self._fusion.permute(t, dims)

    def reshape(self, t, new_shape):
        """torch.reshape(t, new_shape): the same elements in row-major order under a new shape
        (ints, one of them -1, or sizes taken with t.size(i)). It runs between kernels: a view
        of its operand, written by an earlier kernel unless it is an input."""
        return self._fusion.reshape(t, new_shape)

    def size(self, t, dim: int):
        return self._fusion.size(t, dim)

    def shape(self, t):
        return self._fusion._require_tensor("shape", t).shape()


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NAME_LENGTH = 100  # kernels and FUSER_DUMP_DIR files are named after the fusion


@functools.cache
def _executor():
    """fuser.executor, looked up once: an import statement in fd.execute cost each cached
    call 1 us."""
    import fuser.executor

    return fuser.executor


def check_name(name) -> str:
    """`name` if it can name a fusion, else DefinitionError: kernels are C++ functions named
    after it (NVRTC takes ASCII identifiers) and FUSER_DUMP_DIR files too (a file name holds
    255 bytes), so ASCII letters, digits and _, not starting with a digit, at most 100."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DefinitionError(
            f"FusionDefinition name {name!r} must be a Python identifier in ASCII: letters "
            "A-Z a-z, digits and _, not starting with a digit (kernels are C++ functions "
            "named after it)"
        )
    if len(name) > MAX_NAME_LENGTH:
        raise DefinitionError(
            f"FusionDefinition name {name[:20]}... has {len(name)} characters; at most "
            f"{MAX_NAME_LENGTH} (kernels and FUSER_DUMP_DIR files are named after it)"
        )
    return name


class FusionDefinition:
    """Define a fusion in a `with` block, then execute, validate and inspect it.

    The definition is final once the `with` block closes: defining more then raises, as does
    a block that closes with no outputs."""

    def __init__(self, name: str = "fusion"):
        self.name = name
        self.fusion = Fusion()
        self.ops = Ops(self.fusion)
        self._last_run = None  # the executor's record of the latest execute()

    @classmethod
    def from_fusion(cls, fusion: Fusion, name: str) -> FusionDefinition:
        """A definition around a Fusion built elsewhere (a segment of a segmented fusion)."""
        fd = cls(name)
        fd.fusion = fusion
        fd.ops = Ops(fusion)
        return fd

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, name: str) -> None:
        self._name = check_name(name)

    def __enter__(self) -> FusionDefinition:
        self.fusion._check_open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.fusion.closed_by = f"FusionDefinition {self.name!r}"
        if exc_type is None:
            self._require_outputs()

    def _require_outputs(self) -> None:
        if not self.fusion.outputs:
            raise DefinitionError(
                f"fusion {self.name!r} has no outputs; call fd.add_output(t) inside the `with` "
                "block for each result you need"
            )

    # ----- definition -----

    def define_tensor(self, shape, contiguity=None, dtype: DataType = DataType.Float) -> Tensor:
        return self.fusion.define_tensor(shape, contiguity, dtype)

    def define_scalar(self, value=None, dtype: DataType | None = None) -> Scalar:
        return self.fusion.define_scalar(value, dtype)

    def add_output(self, t) -> None:
        self.fusion.add_output(t)

    def __repr__(self) -> str:
        return (
            self.fusion.python_definition()
            + "\n\nwith FusionDefinition() as fd:\n    define_fusion(fd)\n"
        )

    @classmethod
    def from_python(cls, source: str, name: str = "fusion") -> FusionDefinition:
        """Rebuild a fusion from the text repr(fd) printed.

        Raises DefinitionError when the text does not run (a syntax error, an unknown name...)
        or defines neither `fd` nor `define_fusion(fd)`."""
        namespace: dict[str, object] = {"FusionDefinition": cls, "DataType": DataType}
        where = f"<fuser definition {name}>"
        try:
            exec(compile(source, where, "exec"), namespace)
            fd = namespace.get("fd")
            if not isinstance(fd, cls):
                define = namespace.get("define_fusion")
                if not callable(define):
                    raise DefinitionError(
                        f"FusionDefinition.from_python({name!r}): the source defines neither "
                        "`fd` nor a function `define_fusion(fd)`; pass the text repr(fd) printed"
                    )
                fd = cls(name)
                with fd:
                    define(fd)
        except FuserError:
            raise
        except Exception as e:
            raise DefinitionError(
                f"FusionDefinition.from_python({name!r}): running the source failed with "
                f"{type(e).__name__}: {e}; pass the text repr(fd) printed, unchanged"
            ) from e
        fd.name = name
        return fd

    # ----- execution and inspection (executor.py does the work) -----

    def execute(self, inputs, *, device=None):
        """Run the fusion on CuPy arrays or torch CUDA tensors; returns outputs of that kind."""
        return _executor().execute(self, self._inputs("execute", inputs), device=device)

    def validate(self, inputs, reference_outputs=None, *, device=None):
        """Execute and compare with the float64 reference; raises fuser.ValidationError (an
        AssertionError) on mismatch."""
        inputs = self._inputs("validate", inputs)
        return _executor().validate(self, inputs, reference_outputs, device=device)

    def _inputs(self, call: str, inputs) -> list:
        """`inputs` as a list, after checking that there is something to run."""
        self._require_outputs()
        if not isinstance(inputs, list | tuple):
            names = ", ".join(v.name for v in self.fusion.inputs)
            raise BadInputError(
                f"fd.{call}(inputs): inputs must be a list or tuple with one array or number "
                f"per fusion input ({names}), got {type(inputs).__name__} {inputs!r:.80}"
            )
        return list(inputs)

    def _last(self):
        if self._last_run is None:
            raise DefinitionError("nothing has run yet; call fd.execute(inputs) first")
        return self._last_run

    def _segmented(self):
        """The last run's SegmentedRun (executor.py), or None for a one-kernel fusion."""
        run = self._last()
        return run if hasattr(run, "segmentation") else None

    def last_schedule(self):
        """The last kernel's schedule; for a segmented fusion, a SegmentSchedules record: each
        segment, why the fusion is cut there, and its schedule."""
        from fuser.segment import SegmentSchedules

        segmented = self._segmented()
        if segmented is None:
            return self._last().kernel.schedule
        leaves = segmented.leaves()
        return SegmentSchedules(tuple(s for s, _ in leaves),
                                tuple(r.kernel.schedule for _, r in leaves))

    def last_smem_plan(self):
        """The shared-memory plan of the last row kernel (a tuple, one per segment)."""
        segmented = self._segmented()
        if segmented is None:
            return self._last().kernel.schedule.smem
        return tuple(r.kernel.schedule.smem for _, r in segmented.leaves())

    def last_cuda_code(self) -> str:
        """The CUDA source of the last run (each segment's, in order, under a header; then
        each permute kernel that ran between them)."""
        segmented = self._segmented()
        if segmented is None:
            return self._last().kernel.source.source
        return "\n".join([f"// ===== {s}\n{r.kernel.source.source}"
                          for s, r in segmented.leaves()]
                         + [f"// ===== between kernels: {m.what}\n{m.kernel.source}"
                            for m in segmented.all_moves()])

    def last_resources(self):
        """Registers, spills and shared memory of the last kernel, as CuPy reports them (a
        tuple, one per segment, for a segmented fusion)."""
        segmented = self._segmented()
        if segmented is None:
            return self._last().kernel.resources()
        return tuple(r.kernel.resources() for _, r in segmented.leaves())
