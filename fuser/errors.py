"""The errors fuser raises.

Every error names the numbers involved and the way out, so a user can act on the message alone.
All derive from FuserError, so `except fuser.FuserError` catches everything fuser raises on
purpose; anything else escaping fuser is a bug.
"""

from collections.abc import Iterable


class FuserError(Exception):
    """Base class of every error fuser raises on purpose."""


class DefinitionError(FuserError):
    """A fusion definition misuses an op: wrong operand kinds, dtypes, shapes or arguments."""


class UnsupportedFusionError(FuserError):
    """The fusion is valid, but no scheduler of this version can turn it into a kernel."""


class UnknownOpError(DefinitionError, AttributeError):
    """`fd.ops.<name>` names no op. Also an AttributeError, as attribute lookups must raise
    (hasattr(fd.ops, name) stays False)."""


class BadInputError(FuserError):
    """Inputs given to execute() disagree with the definition (count, dtype, shape, device...),
    or an argument of another fuser call names nothing that exists (a device preset, a fusion,
    a kernel, a shared-memory buffer) or is out of range."""


class HintError(BadInputError):
    """A tuning hint (fuser.schedulers.Hints) no kernel can honour here: refused before
    anything is compiled."""


class OutOfResourcesError(FuserError):
    """A kernel would need more of a device resource than the device has."""


class CompileError(FuserError):
    """NVRTC rejected generated source. Carries everything needed to reproduce it."""

    def __init__(
        self,
        message: str,
        source: str,
        log: str,
        options: Iterable[str],
        schedule: object = None,
    ):
        self.source = source
        self.log = log
        self.options = tuple(options)
        self.schedule = schedule
        numbered = "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(source.splitlines()))
        super().__init__(
            f"{message}\n--- NVRTC log ---\n{log.strip()}\n--- options ---\n"
            f"{' '.join(self.options)}\n--- schedule ---\n{schedule}\n--- source ---\n{numbered}"
        )


class LaunchError(FuserError):
    """The driver refused a kernel launch that passed every host-side check."""


class ValidationError(FuserError, AssertionError):
    """validate() / reference.compare(): outputs differ from the reference by more than the
    tolerance. Also an AssertionError, so test runners report it as a failed check."""


class ToolchainError(FuserError):
    """The CUDA toolchain or files fuser builds and loads kernels with (cuda-bindings, NVRTC,
    the CUDA headers, CuPy, cubin files) are missing, misconfigured or misbehaving: nothing is
    wrong with the fusion or its inputs."""


class InternalError(FuserError):
    """A fuser bug: an internal invariant failed. The message says what; please report it."""
