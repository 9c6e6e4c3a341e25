"""The user surface: `with FusionDefinition() as fd:` and `fd.ops.*`, as nvFuser users know it.

FusionDefinition builds a Fusion (ir.py) and is also the user's handle on everything after:
execute(), validate() and the inspection calls delegate to the executor, imported when first
used so that defining and printing fusions needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import re

from fuser.dtypes import DataType
from fuser.errors import BadInputError, DefinitionError, FuserError, UnknownOpError
from fuser.ir import Fusion, Scalar, Tensor
from fuser.ops import ELEMENTWISE


class Ops:
    """`fd.ops`: every op of ops.py, plus the structural ones."""

    def __init__(self, fusion: Fusion):
        self._fusion = fusion

    def __getattr__(self, name):
        if name in ELEMENTWISE:
            fusion = self._fusion

            def op(*operands):
                return fusion.elementwise(name, list(operands))

            op.__name__ = name
            op.__doc__ = ELEMENTWISE[name].doc
            return op
        raise UnknownOpError(f"fd.ops has no op {name!r}; see fuser.ops.ELEMENTWISE for the list")

    def __dir__(self):
        return sorted([*ELEMENTWISE, "cast", "broadcast_in_dim", "sum", "max", "var_mean",
                       "size", "shape"])

    def cast(self, v, dtype: DataType):
        return self._fusion.cast(v, dtype)

    def broadcast_in_dim(self, t, shape, broadcast_dims):
        return self._fusion.broadcast_in_dim(t, shape, broadcast_dims)

    def sum(self, t, dims, keepdim: bool = False, dtype: DataType | None = None):
        return self._fusion.reduction("sum", t, dims, keepdim, dtype)

    def max(self, t, dims, keepdim: bool = False, dtype: DataType | None = None):
        return self._fusion.reduction("max", t, dims, keepdim, dtype)

    def var_mean(self, t, dims, correction: int = 1, keepdim: bool = False):
        return self._fusion.var_mean(t, dims, correction, keepdim)

    def size(self, t, dim: int):
        return self._fusion.size(t, dim)

    def shape(self, t):
        return self._fusion._require_tensor("shape", t).shape()


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NAME_LENGTH = 100  # kernels and FUSER_DUMP_DIR files are named after the fusion


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
        inputs = self._inputs("execute", inputs)
        from fuser.executor import execute

        return execute(self, inputs, device=device)

    def validate(self, inputs, reference_outputs=None, *, device=None):
        """Execute and compare with the float64 reference; raises fuser.ValidationError (an
        AssertionError) on mismatch."""
        inputs = self._inputs("validate", inputs)
        from fuser.executor import validate

        return validate(self, inputs, reference_outputs, device=device)

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

    def last_schedule(self):
        return self._last().kernel.schedule

    def last_smem_plan(self):
        return self._last().kernel.schedule.smem

    def last_cuda_code(self) -> str:
        return self._last().kernel.source.source

    def last_resources(self):
        """Registers, spills and shared memory of the last kernel, as CuPy reports them."""
        return self._last().kernel.resources()
