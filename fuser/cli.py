"""python -m fuser: look at every step of a fusion, with or without a GPU.

    python -m fuser show dropout_rmsnorm_bwd --shape 16384x24578 --dtype bf16 --device h200
    python -m fuser show rmsnorm_bwd --shape 16384x24578 --hint aligned_copy=true --hint stages=1
    python -m fuser show my_fusions.py:fd --shape 16384x4096       # a fusion of your own
    python -m fuser show my_fusions.py:build --dtype fp16 --input-shape 8x1024x4096 \
        --input-shape 4096
    python -m fuser demo            # the headline fusion, step by step; runs it if a GPU is here
    python -m fuser info            # device presets, versions, kernel cache
    python -m fuser cache-clear
    python -m fuser --version       # fuser's version, then CuPy's and NVRTC's

Installed, the same command is `fuser-kernels` (not `fuser`: psmisc's /usr/bin/fuser has
that name on most Linux systems).

`show` needs no GPU: the kernel is scheduled for the named device preset and compiled offline
by NVRTC, so the ptxas report is the real one. It prints fuser.explain()'s report.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fuser.analysis import axes
from fuser.device import PRESETS, DeviceSpec
from fuser.dtypes import DataType
from fuser.errors import BadInputError, DefinitionError, FuserError, HintError
from fuser.explain import Explanation, SegmentedExplanation, explain, section
from fuser.frontend import FusionDefinition
from fuser.fusions import FUSIONS, make_inputs
from fuser.ir import Tensor
from fuser.lowering import lower
from fuser.schedulers import Hints

DTYPES = {"bf16": DataType.BFloat16, "fp16": DataType.Half, "fp32": DataType.Float}
HEADLINE = ("dropout_rmsnorm_bwd", 16384, 24578, "bf16")
SHOW_SHAPE = (16384, 4096)  # show's --shape when neither it nor --input-shape is given
VALIDATION_ROWS = 512  # rows checked against the float64 reference on the host


def _shape(text: str) -> tuple[int, int]:
    try:
        rows, hidden = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not ROWSxHIDDEN, e.g. 16384x4096") from None
    if rows < 1 or hidden < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} needs positive sizes")
    return rows, hidden


def _show_shape(text: str) -> tuple[int, int]:
    """show's --shape: _shape, and where it names more than two sizes (a 3-D input), the two
    ways to say it: the rows flattened for a ready fusion (defined on [rows, hidden]), or one
    --input-shape per input for a fusion of the user's own of that rank."""
    try:
        return _shape(text)
    except argparse.ArgumentTypeError as exc:
        dims = _dims_or_none(text)
        if dims is None or len(dims) < 3:
            raise
        shape = "x".join(map(str, dims))
        raise argparse.ArgumentTypeError(
            f"{exc}; a ready fusion takes its rows flattened (--shape "
            f"{math.prod(dims[:-1])}x{dims[-1]}), a fusion of your own of that rank one "
            f"--input-shape per tensor input, in order (--input-shape {shape} --input-shape "
            f"{dims[-1]} for an input and its weight)") from None


def _dims_or_none(text: str) -> tuple[int, ...] | None:
    """_dims, or None where the text is not positive sizes joined by x."""
    try:
        return _dims(text)
    except argparse.ArgumentTypeError:
        return None


def _dims(text: str) -> tuple[int, ...]:
    """An --input-shape: sizes joined by x (16384x4096, 4096, 16384x1; () for a 0-d tensor)."""
    cleaned = text.strip().lower()
    if cleaned in ("()", ""):
        return ()
    try:
        dims = tuple(int(x) for x in cleaned.replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"input shape {text!r} is not sizes joined by x, e.g. 16384x4096 or 4096") from None
    if any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"input shape {text!r} needs positive sizes")
    return dims


_HINT_KINDS = tuple(f.name for f in dataclasses.fields(Hints))
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def _hint(text: str) -> tuple[str, object]:
    """KEY=VALUE of a Hints field, parsed into the type Hints takes: true/false for
    aligned_copy, skewed and fused_finalize, a word for accumulators (a storage) and dealing,
    for storage a comma list of TENSOR:STORAGE, an int for the others. Only the syntax is
    checked here: Hints and the scheduler hold the values against the fusion and the device
    (a HintError names what is allowed and what the heuristic picks)."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or key not in _HINT_KINDS:
        raise argparse.ArgumentTypeError(
            f"hint {text!r} is not KEY=VALUE with KEY one of {', '.join(_HINT_KINDS)}")
    if key in ("aligned_copy", "skewed", "fused_finalize"):
        if value.lower() not in _BOOLEANS:
            raise argparse.ArgumentTypeError(f"{key}={value!r}: use true or false")
        return key, _BOOLEANS[value.lower()]
    if key == "accumulators":
        return key, value
    if key == "dealing":
        return key, value.lower()
    if key == "storage":
        pairs = tuple(tuple(x.strip() for x in item.split(":", 1))
                      for item in value.split(",") if item.strip())
        if not pairs or any(len(p) != 2 or not all(p) for p in pairs):
            raise argparse.ArgumentTypeError(
                f"storage={value!r}: use TENSOR:STORAGE pairs, e.g. T0:smem,T2:registers")
        return key, pairs
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}={value!r}: an integer is needed") from None


def _hints(given: list[tuple[str, object]]) -> Hints | None:
    """The Hints of the --hint options (None without any); Hints checks their types and
    storage words, the scheduler their values."""
    if not given:
        return None
    keys = [k for k, _ in given]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise HintError(f"--hint {', '.join(twice)} given more than once; give each hint once")
    fields: dict[str, Any] = dict(given)
    return Hints(**fields)


def describe(fusion: str | FusionDefinition, rows: int, hidden: int, dtype: str | None,
             device: DeviceSpec, hints: Hints | None = None,
             input_shapes: Sequence[tuple[int, ...]] = ()
             ) -> tuple[str, FusionDefinition, Explanation | SegmentedExplanation]:
    """Every step for a ready fusion (its name; built for `dtype`, bf16 by default) or for a
    FusionDefinition: (printable report, the fusion definition, fuser.explain's record). The
    tensor inputs' shapes are `input_shapes` (one per tensor input) or, without them, follow
    from rows and hidden (shapes_of)."""
    if isinstance(fusion, str):
        if fusion not in FUSIONS:
            raise BadInputError(
                f"no ready fusion named {fusion!r}; pass one of {', '.join(FUSIONS)}, or "
                "path/to/file.py:NAME for a fusion of your own")
        fd = FUSIONS[fusion](DTYPES[dtype or "bf16"])
    else:
        fd = fusion
    shapes = _given_shapes(fd, input_shapes) if input_shapes else shapes_of(fd, rows, hidden)
    report = explain(fd, shapes, device=device, hints=hints)
    return str(report), fd, report


def shapes_of(fd: FusionDefinition, rows: int, hidden: int) -> list[tuple[int, ...] | None]:
    """The input shapes --shape ROWSxHIDDEN gives: each tensor input's dimensions by what
    they are in the fusion, rows or hidden ([rows, hidden] for a [-1, -1] input, [hidden] for
    a [-1] weight, [rows, 1] for [-1, 1] statistics), 1 where the input broadcasts; None for
    a scalar input."""
    lowered = lower(fd.fusion)  # a segmented fusion has no analyze(), but its axes
    row_axes, hidden_axis = axes(lowered)
    hidden_root = hidden_axis.find() if hidden_axis is not None else None
    row_roots = [e.find() for e in row_axes]
    shapes: list[tuple[int, ...] | None] = []
    for v in lowered.inputs:
        if not isinstance(v, Tensor):
            shapes.append(None)
            continue
        dims = []
        for e in v.dims:
            root = e.find() if e is not None else None
            if root is None:
                dims.append(1)
            elif root is hidden_root:
                dims.append(hidden)
            elif len(row_roots) == 1 and root is row_roots[0]:
                dims.append(rows)
            elif root.value is not None:
                dims.append(root.value)
            else:
                raise BadInputError(
                    f"input {v.name} of fusion '{fd.name}' has {v.ndim} dimensions, more than "
                    "--shape ROWSxHIDDEN gives; give each tensor input's shape with "
                    f"--input-shape, in order ({_tensor_names(fd)}), e.g. --input-shape "
                    "8x1024x4096")
        shapes.append(tuple(dims))
    return shapes


def _tensor_names(fd: FusionDefinition) -> str:
    return ", ".join(v.name for v in fd.fusion.inputs if isinstance(v, Tensor)) or "none"


def _given_shapes(fd: FusionDefinition, given: Sequence[tuple[int, ...]]
                  ) -> list[tuple[int, ...] | None]:
    """The --input-shape options, one per tensor input, with None for the scalar inputs."""
    tensors = [v for v in fd.fusion.inputs if isinstance(v, Tensor)]
    if len(given) != len(tensors):
        raise BadInputError(
            f"fusion '{fd.name}' has {len(tensors)} tensor inputs ({_tensor_names(fd)}), got "
            f"{len(given)} --input-shape; give one per tensor input, in order (e.g. "
            "--input-shape 16384x4096 --input-shape 4096), or --shape ROWSxHIDDEN alone")
    shapes = iter(given)
    return [next(shapes) if isinstance(v, Tensor) else None for v in fd.fusion.inputs]


# ----- a fusion in a user's file -------------------------------------------------------------

_RUN_NAME = "__fuser_show__"  # the user file's __name__: its `if __name__ == "__main__":` skipped


def is_file_target(text: str) -> bool:
    """Whether show's FUSION argument names a file (path/to/file.py:NAME), not a ready fusion."""
    return ":" in text or text.endswith(".py") or "/" in text or os.sep in text


def load_fusion(target: str, dtype: str | None = None) -> FusionDefinition:
    """The FusionDefinition that `path/to/file.py:NAME` names. The file runs as a script
    would (its folder first on sys.path; `if __name__ == "__main__":` blocks do not run), then
    NAME is a FusionDefinition in it, or a function returning one, called with no arguments
    or with the `dtype`'s DataType (as the ready fusion builders are). Without :NAME, the
    file's one FusionDefinition. Each failure is a one-line FuserError naming the fix."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not path_text:
        path_text, name = target, ""
    path = Path(path_text)
    if not path.is_file():
        raise BadInputError(
            f"no file {path_text!r} (from {target!r}); show takes a ready fusion "
            f"({', '.join(FUSIONS)}) or path/to/file.py:NAME of a file that exists")
    namespace = _run_file(path)
    found = _fusions_in(namespace)
    if not name:
        objects = [n for n, v in found.items() if isinstance(v, FusionDefinition)]
        if len(objects) != 1:
            raise BadInputError(
                f"{path} defines {len(objects)} FusionDefinition objects; name the one to show "
                f"as {path}:NAME (there: {', '.join(found) or 'none'})")
        name = objects[0]
    if name not in namespace:
        raise BadInputError(
            f"{path} has no name {name!r}; the FusionDefinitions and functions in it: "
            f"{', '.join(found) or 'none'} (show {path}:NAME)")
    obj = namespace[name]
    where = f"{path}:{name}"
    if isinstance(obj, FusionDefinition):
        if dtype is not None:
            raise BadInputError(
                f"--dtype {dtype}: {where} is a FusionDefinition, whose inputs have the dtypes "
                "it declares; drop --dtype, or make NAME a function taking the dtype")
        return obj
    if not callable(obj):
        raise BadInputError(
            f"{where} is {type(obj).__name__} {obj!r:.40}, not a FusionDefinition or a function "
            "returning one; name the fusion's `fd`, or a function that builds and returns it")
    fd = _call_builder(obj, where, path, dtype)
    if not isinstance(fd, FusionDefinition):
        raise BadInputError(
            f"{where}() returned {type(fd).__name__} {fd!r:.40}, not a FusionDefinition; "
            "return the `fd` of `with FusionDefinition() as fd:`")
    return fd


def _fusions_in(namespace: dict[str, Any]) -> dict[str, Any]:
    """The file's FusionDefinition objects and the functions defined in it, by name."""
    return {n: v for n, v in namespace.items() if not n.startswith("_") and (
        isinstance(v, FusionDefinition)
        or (inspect.isfunction(v) and v.__module__ == _RUN_NAME))}


def _run_file(path: Path) -> dict[str, Any]:
    """Run the user's file, its folder first on sys.path as `python file.py` has it (so that
    it imports its neighbours): its globals. sys.path and sys.argv[0] are restored after."""
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        return runpy.run_path(str(path), run_name=_RUN_NAME)
    except BaseException as error:
        raise _failure(error, f"running {path}", path) from error
    finally:
        sys.path.remove(folder)


def _call_builder(fn: Any, where: str, path: Path, dtype: str | None) -> Any:
    """fn() or fn(DataType): the ready builders' convention."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = any(p.kind in positional or p.kind is inspect.Parameter.VAR_POSITIONAL
                for p in params)
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (*positional, inspect.Parameter.KEYWORD_ONLY)]
    if len(required) > 1 or (required and required[0] is not params[0]) or any(
            p.kind is inspect.Parameter.KEYWORD_ONLY for p in required):
        raise BadInputError(
            f"{where}({', '.join(p.name for p in required)}) has parameters without defaults "
            "that show cannot give; show calls it with no arguments, or with the --dtype's "
            "DataType as the first: give the others defaults")
    if dtype is not None and not takes:
        raise BadInputError(
            f"--dtype {dtype}: {where}() takes no arguments; drop --dtype, or give it a dtype "
            "parameter")
    args = (DTYPES[dtype or "bf16"],) if required or dtype is not None else ()
    try:
        return fn(*args)
    except BaseException as error:
        raise _failure(error, f"calling {where}()", path) from error


def _failure(error: BaseException, doing: str, path: Path) -> BaseException:
    """A one-line FuserError for what the user's code raised, naming the line: a FuserError
    keeps its kind (its message says what to fix in the definition), anything else becomes a
    DefinitionError; Ctrl-C passes through."""
    if isinstance(error, KeyboardInterrupt | GeneratorExit):
        return error
    line: int | None = None
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename) == path:
        line = error.lineno
    else:
        here = path.resolve()
        mine = [f.lineno for f in traceback.extract_tb(error.__traceback__)
                if Path(f.filename).resolve() == here]
        line = mine[-1] if mine else None
    at = doing + (f" (line {line})" if line is not None else "")
    if isinstance(error, FuserError):
        try:
            return type(error)(f"{at}: {error}")
        except TypeError:  # an error class with more arguments (CompileError)
            return error
    if isinstance(error, SystemExit):
        what = f"called sys.exit({error.code!r})"
    else:
        what = f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return DefinitionError(
        f"{at}: {what.rstrip(': ')}; fix the file (python {path} shows the traceback)")


def _run_on_gpu(fd, rows: int, hidden: int, dtype: str) -> str:
    """Execute and validate on the GPU here, and time against a copy of the same bytes."""
    import cupy
    import numpy as np

    # Validate on a slice of the rows (the float64 reference runs on the host), then time the
    # full size on those rows repeated: real data, not zeros.
    sample = min(rows, VALIDATION_ROWS)
    host = make_inputs(fd.name, sample, hidden, DTYPES[dtype], np.random.default_rng(0))
    fd.validate([cupy.asarray(a) for a in host])
    reps = -(-rows // sample)
    inputs = [cupy.asarray(np.tile(a, (reps, 1))[:rows] if a.ndim == 2 else a) for a in host]
    outputs = fd.execute(inputs)
    nbytes = sum(a.nbytes for a in inputs) + sum(o.nbytes for o in outputs)
    src = cupy.empty(nbytes // 2, dtype=cupy.uint8)
    dst = cupy.empty_like(src)

    def median_us(fn, repeat: int = 50) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(repeat):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        return float(np.median(times))

    fuser_us = median_us(lambda: fd.execute(inputs))
    copy_us = median_us(lambda: dst.__setitem__(Ellipsis, src))
    run = fd._last_run
    return "\n".join([
        section("run on this GPU"),
        f"validated against the float64 reference on {sample} rows: ok ({len(outputs)} "
        "outputs)",
        f"launch: grid {run.launch.grid}, block {run.launch.block}, "
        f"dynamic smem {run.launch.dynamic_smem} B",
        f"fuser {fuser_us:.1f} us = {nbytes / fuser_us / 1e3:.0f} GB/s; copy of the same "
        f"{nbytes / 1e6:.1f} MB {copy_us:.1f} us = {nbytes / copy_us / 1e3:.0f} GB/s; "
        f"fuser / copy = {copy_us / fuser_us:.2f}",
    ])


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def version_text() -> str:
    """What --version prints: `fuser X.Y.Z` on the first line, then the CuPy wheel and the
    NVRTC library in use, the two things a bug report about a kernel needs. CuPy's version
    comes from its metadata, without importing it (0.7 s); NVRTC's from the library itself,
    since a CUDA toolkit's may be the one loaded."""
    import platform
    from importlib import metadata

    import fuser
    from fuser.compile import nvrtc_version

    cupy = ", ".join(f"{name} {metadata.version(name)}"
                     for name in sorted(set(metadata.packages_distributions().get("cupy", []))))
    try:
        nvrtc = ".".join(map(str, nvrtc_version()))
    except (FuserError, RuntimeError, OSError) as error:  # no cuda12 / cuda13 extra installed
        nvrtc = f"not found ({type(error).__name__})"
    return (f"fuser {fuser.__version__}\nCuPy: {cupy or 'not installed'}; NVRTC: {nvrtc}; "
            f"Python {platform.python_version()}")


class _Version(argparse.Action):
    """--version, computed only when asked for: reading NVRTC's version loads the library."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fuser", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="classification, schedule, smem plan, CUDA, ptxas report")
    show.add_argument("fusion", metavar="FUSION",
                      help=f"a ready fusion ({', '.join(FUSIONS)}) or path/to/file.py:NAME, "
                           "NAME a FusionDefinition in that file or a function returning one "
                           "(called with no arguments, or with the --dtype)")
    show.add_argument("--shape", type=_show_shape, default=None,
                      help="ROWSxHIDDEN: [rows, hidden] inputs, [hidden] weights, [rows, 1] "
                           f"statistics (default {SHOW_SHAPE[0]}x{SHOW_SHAPE[1]})")
    show.add_argument("--input-shape", type=_dims, action="append", default=[], metavar="DIMS",
                      help="instead of --shape, each tensor input's shape in order, once per "
                           "input, e.g. --input-shape 8x1024x4096 --input-shape 4096")
    show.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="the dtype a ready fusion or a builder function is built for "
                           "(default bf16)")
    show.add_argument("--device", choices=sorted(PRESETS), default="h200")
    show.add_argument("--hint", type=_hint, action="append", default=[], metavar="KEY=VALUE",
                      help="override the heuristic (fuser.schedulers.Hints), e.g. "
                           "aligned_copy=true, stages=2, threads_per_row=256, cluster=2, "
                           "storage=T0:smem,T2:ring, accumulators=smem, finalize_lanes=32")
    demo = sub.add_parser("demo", help="the headline fusion, every step; runs it on a GPU")
    demo.add_argument("--shape", type=_shape, default=HEADLINE[1:3], help="ROWSxHIDDEN")
    sub.add_parser("info", help="device presets, versions and the kernel cache")
    sub.add_parser("cache-clear", help="delete fuser's compiled kernels on disk")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "show":
            if args.shape is not None and args.input_shape:
                raise BadInputError("give --shape ROWSxHIDDEN or one --input-shape per tensor "
                                    "input, not both")
            rows, hidden = args.shape or SHOW_SHAPE
            hints = _hints(args.hint)
            fusion = (load_fusion(args.fusion, args.dtype) if is_file_target(args.fusion)
                      else args.fusion)
            print(describe(fusion, rows, hidden, args.dtype, DeviceSpec.get(args.device),
                           hints, args.input_shape)[0])
        elif args.command == "demo":
            rows, hidden = args.shape
            gpu = _gpu_available()
            device = DeviceSpec.from_gpu() if gpu else DeviceSpec.get("h200")
            text, fd, _ = describe(HEADLINE[0], rows, hidden, HEADLINE[3], device)
            print(text)
            if gpu:
                print(_run_on_gpu(fd, rows, hidden, HEADLINE[3]))
            else:
                print(section("run") + "\nno CUDA GPU here: scheduled and compiled for the "
                      "H200 preset only (make test-gpu and make bench run it on a GPU)")
        elif args.command == "info":
            _info()
        else:
            from fuser.cache import default_cache

            default_cache().clear()
            print("kernel cache cleared")
    except FuserError as error:
        print(f"fuser: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _info() -> None:
    import fuser
    from fuser.cache import default_cache
    from fuser.compile import nvrtc_version

    print(f"fuser {fuser.__version__}; NVRTC {'.'.join(map(str, nvrtc_version()))}")
    print(f"GPU here: {DeviceSpec.from_gpu() if _gpu_available() else 'none'}")
    print("device presets:")
    for name, spec in sorted(PRESETS.items()):
        print(f"  {name:<12} {spec}")
    print(f"kernel cache: {default_cache().stats()}")
