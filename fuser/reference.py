"""The float64 oracle: evaluates a Fusion with numpy, in exact arithmetic as far as numpy allows.

Every float value is computed in float64, every integer in int64 and every bool as bool, whatever
the fusion's dtypes say: a cast to a float type does not round, so the oracle is the exact math a
kernel approximates, and `tolerance()` says how far a kernel of a given output dtype may stray.
Only values a kernel *receives* are stored in their declared dtype first (a Float scalar input of
0.1 is the float32 nearest 0.1), because those are the values the kernel really works on.
Integer overflow is not modelled: Int32 arithmetic is done in int64.

The elementwise and reduction math comes from the op table (ops.py); this module only adds the
structural ops (cast, size, broadcast_in_dim, var_mean) and the input checks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fuser.dtypes import Category, DataType
from fuser.errors import BadInputError, DefinitionError, InternalError, ValidationError
from fuser.ir import Expr, Extent, Fusion, Scalar, Tensor, Val, as_tensor
from fuser.ops import ELEMENTWISE, REDUCTIONS

# ----- values -----------------------------------------------------------------------------------


def _exact(x, dtype: DataType):
    """`x` converted to the oracle's type for `dtype`'s category (float64, int64 or bool).

    This is also the oracle's cast: to Bool is `!= 0`, to an int type truncates toward zero (as C
    does), to a float type is exact.
    """
    x = np.asarray(x)
    if dtype.category is Category.BOOL:
        return x != 0
    if dtype.category is Category.INT:
        if x.dtype.kind == "b" or np.issubdtype(x.dtype, np.integer):
            return x.astype(np.int64)
        with np.errstate(invalid="ignore"):
            return np.trunc(x.astype(np.float64)).astype(np.int64)
    return x.astype(np.float64)


def _category_of(x) -> Category | None:
    if isinstance(x, bool | np.bool_):
        return Category.BOOL
    if isinstance(x, int | np.integer):
        return Category.INT
    if isinstance(x, float | np.floating):
        return Category.FLOAT
    return None


def _input_scalar(i: int, v: Val, x):
    where = f"input {i} ({v.name})"
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = x[()]
    category = _category_of(x)
    if category is None:
        got = f"an array of shape {x.shape}" if hasattr(x, "shape") else f"{type(x).__name__} {x!r}"
        raise BadInputError(f"{where}: expected a {v.dtype} scalar (a Python number), got {got}")
    if category > v.dtype.category:
        raise BadInputError(
            f"{where}: expected a {v.dtype} scalar, got {x!r}; pass a value of that kind"
        )
    try:
        stored = np.array(x, dtype=v.dtype.numpy)
    except OverflowError:
        raise BadInputError(f"{where}: {x!r} does not fit in {v.dtype}") from None
    return _exact(stored, v.dtype)[()]


def _input_tensor(i: int, v: Tensor, x) -> np.ndarray:
    where = f"input {i} ({v.name})"
    expected = f"a rank-{v.ndim} {v.dtype} array"
    if _category_of(x) is not None or not (isinstance(x, np.ndarray) or hasattr(x, "__array__")):
        raise BadInputError(f"{where}: expected {expected}, got {type(x).__name__} {x!r}")
    arr = np.asarray(x)
    got = DataType.from_numpy(arr.dtype)
    if got is None or got.category > v.dtype.category:
        raise BadInputError(
            f"{where}: expected {expected}, got dtype {arr.dtype}; convert it to "
            f"{v.dtype.numpy} first"
        )
    if got is not v.dtype:
        # Another dtype of the same or a lower category is accepted when it holds exactly
        # values the declared dtype can store (a bf16 tensor upcast to float32, say); anything
        # else would make the oracle see other data than the kernel does.
        stored = arr.astype(v.dtype.numpy)
        if not np.array_equal(stored.astype(arr.dtype), arr, equal_nan=got.is_float):
            raise BadInputError(
                f"{where}: expected {expected}, got dtype {arr.dtype} whose values are not all "
                f"representable in {v.dtype}; convert it with .astype({v.dtype.numpy}) first"
            )
        arr = stored
    return _exact(arr, v.dtype)


# ----- sizes ------------------------------------------------------------------------------------


class Sizes:
    """The value of every extent of a fusion, bound from the shapes of its tensor inputs."""

    def __init__(self):
        self._bound: dict[Extent, tuple[int, str]] = {}  # root extent -> (size, who bound it)

    def bind(self, extent: Extent | None, size: int, here: str) -> None:
        if extent is None:
            if size != 1:
                raise BadInputError(
                    f"{here} has size {size} but the definition makes it a broadcast dimension, "
                    "which must have size 1"
                )
            return
        if size < 1:
            raise BadInputError(f"{here} has size {size}; empty tensors are not supported")
        root = extent.find()
        if root.value is not None and root.value != size:
            why = "" if extent.value is not None else f" (it must equal {root.label})"
            raise BadInputError(
                f"{here} has size {size} but the definition fixes it to {root.value}{why}"
            )
        if root in self._bound and self._bound[root][0] != size:
            other_size, other = self._bound[root]
            raise BadInputError(
                f"{here} has size {size} but {other}, which must be equal, has {other_size}"
            )
        self._bound.setdefault(root, (size, here))

    def value(self, extent: Extent | None) -> int:
        if extent is None:
            return 1
        root = extent.find()
        if root.value is not None:
            return root.value
        if root in self._bound:
            return self._bound[root][0]
        raise DefinitionError(
            f"the size {extent.label} is neither a fixed number nor equal to any input's "
            "dimension; give broadcast_in_dim a size taken from a tensor (t.size(i)) or an int"
        )

    def shape(self, t: Tensor) -> tuple[int, ...]:
        return tuple(self.value(e) for e in t.dims)


def _check_count(fusion: Fusion, inputs: Sequence) -> None:
    if len(inputs) != len(fusion.inputs):
        raise BadInputError(
            f"the fusion takes {len(fusion.inputs)} inputs "
            f"({', '.join(v.name for v in fusion.inputs)}), got {len(inputs)}"
        )


def bind_shapes(fusion: Fusion, shapes: Sequence[tuple[int, ...] | None]) -> Sizes:
    """Check tensor input shapes against the definition and bind its extents.

    `shapes` has one entry per fusion input: the shape of a tensor, None for a scalar.
    """
    _check_count(fusion, shapes)
    sizes = Sizes()
    for i, (v, shape) in enumerate(zip(fusion.inputs, shapes, strict=True)):
        if not isinstance(v, Tensor):
            continue
        if shape is None:
            raise BadInputError(
                f"input {i} ({v.name}) is a rank-{v.ndim} tensor, but its entry in shapes is "
                "None; give its shape (None is for scalar inputs)"
            )
        if len(shape) != v.ndim:
            raise BadInputError(
                f"input {i} ({v.name}): expected rank {v.ndim} (dims {list(v.dims)}), got rank "
                f"{len(shape)} with shape {tuple(shape)}"
            )
        for d, (extent, size) in enumerate(zip(v.dims, shape, strict=True)):
            sizes.bind(extent, int(size), f"{v.name} dimension {d}")
    return sizes


def _check_inputs(fusion: Fusion, inputs: list) -> tuple[list, Sizes]:
    _check_count(fusion, inputs)
    values = [
        _input_tensor(i, v, x) if isinstance(v, Tensor) else _input_scalar(i, v, x)
        for i, (v, x) in enumerate(zip(fusion.inputs, inputs, strict=True))
    ]
    shapes = [
        x.shape if isinstance(v, Tensor) else None
        for v, x in zip(fusion.inputs, values, strict=True)
    ]
    return values, bind_shapes(fusion, shapes)


# ----- evaluation -------------------------------------------------------------------------------


def _needed(fusion: Fusion) -> set[int]:
    """ids of the Exprs the outputs depend on (dead code is not evaluated)."""
    needed: set[int] = set()
    stack: list[Val] = list(fusion.outputs)
    while stack:
        v = stack.pop()
        e = v.definition
        if e is not None and id(e) not in needed:
            needed.add(id(e))
            stack.extend(e.inputs)
    return needed


def _run(e: Expr, args: list, sizes: Sizes) -> list:
    out = e.outputs[0]
    if e.op in ELEMENTWISE:
        compute = e.attr("compute")
        if e.op == "where":
            args = [args[0], *(_exact(a, compute) for a in args[1:])]
        else:
            args = [_exact(a, compute) for a in args]
        return [_exact(ELEMENTWISE[e.op].reference(*args), out.dtype)]
    if e.op == "cast":
        return [_exact(args[0], out.dtype)]
    if e.op == "size":
        return [np.int64(sizes.value(as_tensor(e.inputs[0]).dims[e.attr("dim")]))]
    if e.op == "broadcast_in_dim":
        src = np.asarray(args[0])
        result = as_tensor(out)
        staged = [1] * result.ndim
        for i, d in enumerate(e.attr("broadcast_dims")):
            staged[d] = src.shape[i]
        return [np.broadcast_to(src.reshape(staged), sizes.shape(result))]
    dims, keepdim = e.attr("dims"), e.attr("keepdim")
    if e.op in REDUCTIONS:
        x = _exact(args[0], out.dtype)  # sum(x, dtype=...) converts x first, as torch does
        return [_exact(REDUCTIONS[e.op].reference(x, axis=dims, keepdims=keepdim), out.dtype)]
    if e.op == "var_mean":
        x = np.asarray(args[0], dtype=np.float64)
        n = math.prod(x.shape[d] for d in dims)
        mean = x.mean(axis=dims, keepdims=True)
        squares = ((x - mean) ** 2).sum(axis=dims, keepdims=keepdim)
        var = squares / max(n - e.attr("correction"), 0)  # torch clamps n - correction at 0
        return [var, mean if keepdim else mean.reshape(var.shape)]
    raise InternalError(
        f"reference: no evaluation rule for op {e.op!r} ({out.name}); every op of the IR needs "
        "one in reference._run, so this is a fuser bug"
    )


def evaluate(fusion: Fusion, inputs: list) -> list[np.ndarray]:
    """Run `fusion` on numpy inputs (in `fusion.inputs` order); one float64/int64/bool array per
    output. Raises BadInputError when the inputs disagree with the definition."""
    values, sizes = _check_inputs(fusion, list(inputs))
    return _evaluate(fusion, values, sizes)


def _evaluate(fusion: Fusion, values: list, sizes: Sizes) -> list[np.ndarray]:
    """evaluate() on checked input values (float64 / int64 / bool, as _check_inputs gives)."""
    env: dict[Val, object] = dict(zip(fusion.inputs, values, strict=True))
    for v in fusion.vals:
        if isinstance(v, Scalar) and v.definition is None and v.value is not None:
            env[v] = _exact(np.array(v.value, dtype=v.dtype.numpy), v.dtype)[()]
    needed = _needed(fusion)
    for e in fusion.exprs:
        if id(e) not in needed:
            continue
        with np.errstate(all="ignore"):  # NaN and inf propagate, as they do on the device
            results = _run(e, [env[v] for v in e.inputs], sizes)
        for out, r in zip(e.outputs, results, strict=True):
            if isinstance(out, Tensor) and np.shape(r) != sizes.shape(out):
                raise InternalError(
                    f"reference: {out.name} = {e.op}(...) has shape {np.shape(r)}, but its "
                    f"extents say {sizes.shape(out)}; this is a fuser bug"
                )
            env[out] = r
    return [np.array(env[o], order="C") for o in fusion.outputs]


# ----- comparing a kernel's outputs with the oracle ---------------------------------------------

# Base (rtol, atol) of an output stored in each float dtype, for O(1) data. For Half and
# BFloat16, rtol is two units in the last place (one for rounding the output, one for an
# intermediate rounding) and atol one unit at 1.0. Float is wider than its 2**-23 ulp because
# fast-math intrinsics (__expf, rsqrtf...) promise a few ulps that grow with |x|.
_BASE_TOLERANCE = {
    DataType.Double: (1e-12, 1e-12),
    DataType.Float: (1e-5, 1e-5),
    DataType.Half: (2e-3, 1e-3),
    DataType.BFloat16: (1.6e-2, 1e-2),
}
_REDUCTION_GROWTH = 4.0  # how many compute-type epsilons each sqrt(element) of a reduction adds
_SENSITIVE = (DataType.Float, DataType.Double)  # outputs stored at their compute precision
_SENSITIVITY_FACTOR = 4.0


def tolerance(dtype: DataType, reduction_size: int = 1) -> tuple[float, float]:
    """(rtol, atol) for comparing a kernel output of `dtype` with the float64 oracle.

    Why it grows with the reduction: a kernel accumulates a sum of n terms in its compute type
    (float for Half/BFloat16/Float, double for Double) and every addition rounds. The rounding
    errors have random signs, so they add up like a random walk, to about sqrt(n) epsilons of
    the compute type (a serial loop can do worse, a tree reduction better). That error reaches
    the output relative to the statistic's size: an RMSNorm / LayerNorm / softmax output is
    scaled by 1/sqrt(mean) or 1/sum, so its relative error grows by the same amount. Hence

        rtol = base_rtol(dtype) + 4 * eps(compute type) * sqrt(n)   (atol likewise)

    It is added to, not multiplied into, the base: half and bf16 outputs accumulate in float,
    and float's sqrt(n) error stays far below their own rounding. Integer and Bool outputs must
    match exactly. An output that is itself a sum (a weight gradient) may cancel to near zero
    while its partial sums were as large as its neighbours': compare() also allows the growth
    times the output's median size there (sum_allowance()).
    """
    if reduction_size < 0:
        raise BadInputError(
            f"reduction_size must be >= 0 (the number of elements a sum combines; 0 or 1 for "
            f"none), got {reduction_size}"
        )
    if not dtype.is_float:
        return 0.0, 0.0
    rtol, atol = _BASE_TOLERANCE[dtype]
    growth = _growth(dtype, reduction_size)
    return rtol + growth, atol + growth


def _compute_eps(dtype: DataType) -> float:
    """The machine epsilon of the type a floating dtype is computed in (float or double)."""
    return float(np.finfo(np.float64 if dtype is DataType.Double else np.float32).eps)


def _growth(dtype: DataType, reduction_size: int) -> float:
    """The sqrt(n) rounding growth of a sum of n terms, in the compute type's epsilons."""
    return _REDUCTION_GROWTH * _compute_eps(dtype) * math.sqrt(max(reduction_size, 1))


def input_sensitivity(fusion: Fusion, inputs: list,
                      references: Sequence | None = None) -> list[np.ndarray | None]:
    """Per output stored in Float or Double (None for the others): how far each element moves
    when every floating tensor input moves by one epsilon of its compute type, the largest
    |change| over two draws of signs: alternating along the last axis (a row never moves as a
    whole, which a normalization would cancel), then random (a fixed seed: the same on every
    run).

    Why: a kernel rounds in its compute type from the first op on, so no kernel is closer to
    the exact result than the oracle is to itself on inputs moved by that much. A well
    conditioned output moves by about an epsilon, far inside tolerance(); an ill-conditioned
    one moves by the epsilon times its condition number, and so does every correct kernel's
    value: LayerNorm of a short row whose elements nearly agree (x - mean cancels, rstd is
    large) missed a 1e-5 tolerance by 1.5x in float32 at hidden 3. Half and BFloat16 outputs
    round far above float's epsilon and get no allowance. `references`, evaluate()'s outputs
    for these inputs where the caller has them, saves evaluating them again.
    """
    values, sizes = _check_inputs(fusion, list(inputs))
    if not any(o.dtype in _SENSITIVE for o in fusion.outputs):
        return [None] * len(fusion.outputs)
    base = list(references) if references is not None else _evaluate(fusion, values, sizes)
    spread = [np.zeros(np.shape(b)) if o.dtype in _SENSITIVE else None
              for o, b in zip(fusion.outputs, base, strict=True)]
    rng = np.random.default_rng(0)
    for draw in ("alternating", "random"):
        moved = [_moved(v, x, draw, rng) for v, x in zip(fusion.inputs, values, strict=True)]
        for k, out in enumerate(_evaluate(fusion, moved, sizes)):
            so_far = spread[k]
            if so_far is not None:
                with np.errstate(all="ignore"):
                    change = np.abs(np.asarray(out, np.float64) - base[k])
                spread[k] = np.maximum(so_far, np.where(np.isfinite(change), change, 0.0))
    return spread


def _moved(v: Val, x, draw: str, rng: np.random.Generator):
    """A floating tensor input times (1 +- one epsilon of its compute type), the signs
    alternating along the last axis or random; other inputs as they are."""
    if not (isinstance(v, Tensor) and v.dtype.is_float):
        return x
    eps = _compute_eps(v.dtype)
    shape = np.shape(x)
    if draw == "alternating":
        signs = np.broadcast_to(1.0 - 2.0 * (np.arange(shape[-1] if shape else 1) % 2), shape)
    else:
        signs = rng.choice(np.array([-1.0, 1.0]), size=shape)
    return x * (1.0 + eps * signs)


def sensitivity_allowance(spread) -> float | np.ndarray:
    """Extra absolute error allowed per element: _SENSITIVITY_FACTOR times input_sensitivity()'s
    spread (0 where there is none). A kernel rounds several times, not once."""
    return 0.0 if spread is None else _SENSITIVITY_FACTOR * spread


def is_sum(t: Tensor) -> bool:
    """True when `t` is a sum (through casts): its elements add up other values, so a
    chunk of rows contributes additively and its rounding follows its partial sums."""
    e = t.definition
    while e is not None and e.op == "cast":
        e = e.inputs[0].definition
    return e is not None and e.op == "sum"


def sum_allowance(t: Tensor, reduction_size: int, typical: float) -> float:
    """Extra absolute error allowed in every element of a sum output: the rounding growth
    times the output's typical size (the median |value|). A sum that cancels to near zero
    rounded its partial sums, which were as large as its neighbours', so a tolerance relative
    to its own small value would be too tight. The median, not the RMS: one outlier column
    does not loosen the others, and nothing overflows."""
    if not (t.dtype.is_float and is_sum(t)):
        return 0.0
    return _growth(t.dtype, reduction_size) * typical


def output_reduction_sizes(fusion: Fusion, inputs: list) -> list[int]:
    """For each output, how many elements the sums upstream of it combine (see tolerance()).

    Sums and var_mean round as they accumulate; max is exact and does not count. Two
    reductions on one path (softmax's max then sum, a backward pass's several sums) add up.
    """
    inputs = list(inputs)
    _check_count(fusion, inputs)
    shapes = [
        np.shape(x) if isinstance(v, Tensor) else None
        for v, x in zip(fusion.inputs, inputs, strict=True)
    ]
    sizes = bind_shapes(fusion, shapes)
    result = []
    for out in fusion.outputs:
        seen: set[int] = set()
        total = 0
        stack: list[Val] = [out]
        while stack:
            e = stack.pop().definition
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            if e.op in ("sum", "var_mean"):
                extents = as_tensor(e.inputs[0]).dims
                total += math.prod(sizes.value(extents[d]) for d in e.attr("dims"))
            stack.extend(e.inputs)
        result.append(total)
    return result


def _index(flat: int, shape) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def _compare_one(label: str, t: Tensor, got, ref, n: int, spread=None) -> str | None:
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return f"{label}: shape {got.shape}, but the reference has shape {ref.shape}"
    if not t.dtype.is_float:
        g, r = _exact(got, t.dtype), _exact(ref, t.dtype)
        bad = g != r
        if not bad.any():
            return None
        first = _index(int(np.argmax(bad)), bad.shape)
        return (
            f"{label}: {int(bad.sum())} of {bad.size} elements differ (exact match required); "
            f"first at index {first}: got {g[first].item()!r}, expected {r[first].item()!r}"
        )
    g, r = got.astype(np.float64), ref.astype(np.float64)
    rtol, atol = tolerance(t.dtype, n)
    finite = np.isfinite(g) & np.isfinite(r)
    nonfinite_bad = ~finite & ~((g == r) | (np.isnan(g) & np.isnan(r)))
    err = np.where(finite, np.abs(g - r), 0.0)
    allowed = atol + rtol * np.abs(r) + sensitivity_allowance(spread)
    if finite.any():
        allowed = allowed + sum_allowance(t, n, float(np.median(np.abs(r[finite]))))
    bad = (finite & (err > allowed)) | nonfinite_bad
    if not bad.any():
        return None
    lines = [f"{label}: {int(bad.sum())} of {bad.size} elements differ from the float64 reference"]
    if (finite & (err > allowed)).any():
        ratio = np.where(finite, err / allowed, 0.0)
        worst = _index(int(np.argmax(ratio)), r.shape)
        rel = np.where(finite & (r != 0), err / np.where(r == 0, 1.0, np.abs(r)), 0.0)
        rel = np.where(finite & (r == 0) & (err > 0), np.inf, rel)
        at_abs, at_rel = _index(int(np.argmax(err)), r.shape), _index(int(np.argmax(rel)), r.shape)
        lines += [
            f"  worst at index {worst}: got {float(g[worst])!r}, expected {float(r[worst])!r} "
            f"(|err| {err[worst]:.3g} > allowed {allowed[worst]:.3g})",
            f"  max abs err {err[at_abs]:.3g} at {at_abs}; "
            f"max rel err {rel[at_rel]:.3g} at {at_rel}",
        ]
    if nonfinite_bad.any():
        first = _index(int(np.argmax(nonfinite_bad)), r.shape)
        lines.append(
            f"  {int(nonfinite_bad.sum())} NaN/inf mismatches, first at index {first}: "
            f"got {float(g[first])!r}, expected {float(r[first])!r}"
        )
    lines.append(f"  tolerance: rtol {rtol:.3g}, atol {atol:.3g} (reduction size {n})")
    return "\n".join(lines)


def compare(outputs, references, fusion: Fusion, reduction_sizes: int | Sequence[int],
            sensitivities: Sequence | None = None) -> None:
    """Check a kernel's outputs against the oracle's; raise ValidationError (an AssertionError)
    with a report, or BadInputError when the counts of outputs and references disagree.

    `reduction_sizes` is one int per output, or one for all (see output_reduction_sizes()). The
    tolerance is that of each output's declared dtype, widened by `sensitivities` (one
    input_sensitivity() array or None per output) where given; NaN must meet NaN and inf the
    same inf.
    """
    outputs, references = list(outputs), list(references)
    names = ", ".join(t.name for t in fusion.outputs)
    if not len(outputs) == len(references) == len(fusion.outputs):
        raise BadInputError(
            f"the fusion has {len(fusion.outputs)} outputs ({names}); got {len(outputs)} "
            f"outputs and {len(references)} references: give one of each per output"
        )
    if isinstance(reduction_sizes, int):
        reduction_sizes = [reduction_sizes] * len(outputs)
    if sensitivities is None:
        sensitivities = [None] * len(outputs)
    failures = []
    for i, (t, got, ref, n, spread) in enumerate(
        zip(fusion.outputs, outputs, references, reduction_sizes, sensitivities, strict=True)
    ):
        label = f"output {i} ({t.name}, {t.dtype}, shape {np.shape(ref)})"
        with np.errstate(all="ignore"):  # inf - inf and x / 0 are dealt with explicitly
            report = _compare_one(label, t, got, ref, int(n), spread)
        if report is not None:
            failures.append(report)
    if failures:
        raise ValidationError("\n".join(failures))
