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
