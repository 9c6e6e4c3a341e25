"""fuser: a JIT-compiling fusion scheduler for NVIDIA GPUs.

Define a fusion in Python, and fuser classifies it, schedules it into one normalization kernel,
plans its shared memory, renders CUDA from Jinja templates, compiles it with NVRTC and runs it,
showing every step on the way.
"""

from fuser.dtypes import DataType
from fuser.errors import (
    BadInputError,
    CompileError,
    DefinitionError,
    FuserError,
    HintError,
    InternalError,
    LaunchError,
    OutOfResourcesError,
    ToolchainError,
    UnknownOpError,
    UnsupportedFusionError,
    ValidationError,
)
from fuser.explain import Explanation, explain
from fuser.frontend import FusionDefinition

__version__ = "0.2.0"

# The executor (with the kernel cache and the driver it runs kernels through) comes with the
# package instead of with the first execute(): `import fuser` stays within its 150 ms, and a
# process's first call whose kernel is on disk costs the call, not 25-30 ms of imports
# (bench/startup.py on the H200 machine). It imports neither CuPy, torch, NVRTC nor Jinja.
from fuser import executor as _executor  # noqa: F401

__all__ = [
    "BadInputError",
    "CompileError",
    "DataType",
    "DefinitionError",
    "Explanation",
    "FuserError",
    "FusionDefinition",
    "HintError",
    "InternalError",
    "LaunchError",
    "OutOfResourcesError",
    "ToolchainError",
    "UnknownOpError",
    "UnsupportedFusionError",
    "ValidationError",
    "__version__",
    "explain",
]
