"""The errors fuser raises.

Every error names the numbers involved and the way out, so a user can act on the message alone.
All derive from FuserError, so `except fuser.FuserError` catches everything fuser raises on
purpose; anything else escaping fuser is a bug.
"""


class FuserError(Exception):
    """Base class of every error fuser raises on purpose."""


class DefinitionError(FuserError):
    """A fusion definition misuses an op: wrong operand kinds, dtypes, shapes or arguments."""


class UnsupportedFusionError(FuserError):
    """The fusion is valid, but no scheduler of this version can turn it into a kernel."""


class BadInputError(FuserError):
    """Inputs given to execute() disagree with the definition (count, dtype, shape, device...)."""


class HintError(BadInputError):
    """A tuning hint (fuser.schedulers.Hints) no kernel can honour here: refused before
    anything is compiled."""


class OutOfResourcesError(FuserError):
    """A kernel would need more of a device resource than the device has."""


class CompileError(FuserError):
    """NVRTC rejected generated source. Carries everything needed to reproduce it."""

    def __init__(self, message: str, source: str, log: str, options: tuple, schedule=None):
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
