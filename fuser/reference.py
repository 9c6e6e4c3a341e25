"""The float64 oracle: evaluates a Fusion with numpy, in exact arithmetic except where a kernel
rounds on purpose.

Every float value is computed in float64, every integer in int64 and every bool as bool, whatever
the fusion's dtypes say: arithmetic does not round, so the oracle is the exact math a kernel
approximates, and `tolerance()` says how far a kernel of a given output dtype may stray. What a
kernel rounds by design, the oracle rounds the same way (`_cast`, `_stored`):

- a cast to Half or BFloat16 rounds to nearest even in that format and overflows to inf, through
  float32 first, as the kernels' `static_cast<float>` then `__float2half_rn` /
  `__float2bfloat16_rn` do (templates/fuser_math.cuh round_half / round_bf16); a cast to Float
  rounds to float32; a cast to an int type truncates toward zero and saturates (NaN gives 0
  or the type's minimum), as PTX's float-to-int conversion does, and Int64 to Int32 keeps the
  low 32 bits;
- an output is stored in its dtype: a Half / BFloat16 / Float output is rounded (and overflows)
  as the kernel's store does;
- an op computed in float whose kernel math departs from the exact one by design (fm::exp:
  results below 2^-126 are 0, from 2^128 on inf; sigmoid, silu and softplus through it)
  follows the kernel (ops.ElementwiseOp.float_reference);
- values a kernel *receives* are stored as the kernel receives them: a tensor input in its
  declared dtype, a scalar (input or constant) in its compute type (a Float scalar of 0.1 is the
  float32 nearest 0.1; a Half scalar is passed as a float32 too).

Values between those points are not rounded: a Half value computed by an add stays a float in
the kernel's registers until it is cast or stored. Integer overflow is not modelled: Int32
arithmetic is done in int64.

The elementwise and reduction math comes from the op table (ops.py); this module only adds the
structural ops (cast, size, broadcast_in_dim, mean, var_mean, var) and the input checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from fuser.dtypes import Category, DataType
from fuser.errors import BadInputError, InternalError, ValidationError
from fuser.ir import Expr, Fusion, Scalar, Tensor, Val, as_tensor, rounding_cast, upstream
from fuser.ops import ELEMENTWISE, REDUCTIONS
from fuser.shapes import Sizes, bind_shapes, check_count

# ----- values -----------------------------------------------------------------------------------


def _exact(x, dtype: DataType):
    """`x` converted to the oracle's type for `dtype`'s category (float64, int64 or bool): how an
    op's operands reach its compute type. To Bool is `!= 0`, to an int type truncates toward
    zero, to a float type is exact (see _cast for what a cast does)."""
    x = np.asarray(x)
    if dtype.category is Category.BOOL:
        return x != 0
    if dtype.category is Category.INT:
        if x.dtype.kind == "b" or np.issubdtype(x.dtype, np.integer):
            return x.astype(np.int64)
        with np.errstate(invalid="ignore"):
            return np.trunc(x.astype(np.float64)).astype(np.int64)
    return x.astype(np.float64)


def _rounded(x, dtype: DataType) -> np.ndarray:
    """`x` (float64, int64 or bool) converted to the float type `dtype` as a kernel converts
    it, back in float64: through float32 (`static_cast<float>`: to nearest even, overflowing to
    inf) unless `dtype` is Double, then to Half / BFloat16 to nearest even, overflowing to inf
    (`__float2half_rn` / `__float2bfloat16_rn`)."""
    x = np.asarray(x)
    if dtype is DataType.Double:
        return x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        single = x.astype(np.float32)
        if dtype is not DataType.Float:
            single = single.astype(dtype.numpy)
    return single.astype(np.float64)


def _to_int(x: np.ndarray, dtype: DataType, src: DataType = DataType.Float) -> np.ndarray:
    """A kernel's conversion of a `src` value to Int32 / Int64, in int64: from a float,
    truncation toward zero that saturates at the type's limits (PTX cvt.rzi), NaN giving 0
    from a float32 to Int32 and the type's minimum otherwise (from a double, or to Int64), as
    PTX specifies; from Int64 to Int32, the low 32 bits (static_cast<int>)."""
    info = np.iinfo(np.int32 if dtype is DataType.Int32 else np.int64)
    if x.dtype.kind == "b" or np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.int64)
        return x.astype(np.int32).astype(np.int64) if dtype is DataType.Int32 else x
    with np.errstate(invalid="ignore"):
        t = np.trunc(x.astype(np.float64))
        inside = (t >= info.min) & (t < -float(info.min))
        clamped = np.where(t > 0, info.max, info.min).astype(np.int64)
    result = np.where(inside, np.where(inside, t, 0.0).astype(np.int64), clamped)
    nan = 0 if dtype is DataType.Int32 and src is not DataType.Double else info.min
    return np.where(np.isnan(t), nan, result)


def _cast(x, src: DataType, dtype: DataType, shift: float = 0.0):
    """The oracle's cast, as the kernel's (emit.py Emitter._cast): see the module docstring.
    `shift` moves a float operand by that relative amount first, toward +inf for a positive
    shift, toward -inf for a negative one (input_sensitivity's draws of a kernel's error before
    the cast: every element moved the same way, so that the flips they cause add up in a sum)."""
    x = np.asarray(x)
    if shift and x.dtype.kind == "f":
        x = np.where(np.isfinite(x), x + shift * np.abs(x), x)
    if dtype.is_float:
        return _rounded(x, dtype)
    if dtype.category is Category.BOOL:
        return x != 0
    return _to_int(x, dtype, src)


def _operand(x, dtype: DataType, compute: DataType):
    """A `dtype` operand of an op computed in `compute`, converted as the kernel converts it
    (emit.py Emitter._operand): a Double or integer value entering a float computation is
    rounded to float32 (a Float tensor times a Double scalar multiplies by the scalar's
    float32), an Int64 value entering an Int32 computation keeps its low 32 bits; values of
    the same compute type pass as they are."""
    if compute.compute_type == dtype.compute_type or dtype is DataType.Bool:
        return _exact(x, compute)
    if compute.compute_type == "float":
        return _rounded(x, DataType.Float)
    if compute is DataType.Int32:
        return _to_int(np.asarray(x), DataType.Int32)
    return _exact(x, compute)


def _stored(x, dtype: DataType):
    """An output as the kernel stores it: Half / BFloat16 / Float rounded (see _rounded)."""
    if dtype.is_float and dtype is not DataType.Double:
        return _rounded(x, dtype)
    return x


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
        with np.errstate(over="ignore"):  # a Float scalar beyond float32 is inf, as in torch
            stored = np.array(x, dtype=v.dtype.scalar_numpy)
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


def _check_inputs(fusion: Fusion, inputs: list) -> tuple[list, Sizes]:
    check_count(fusion, inputs)
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
    return {id(e) for e in upstream(fusion.outputs)}


def _run(e: Expr, args: list, sizes: Sizes, shift: float = 0.0) -> list:
    out = e.outputs[0]
    if e.op in ELEMENTWISE:
        compute = e.attr("compute")
        operands = list(zip(e.inputs, args, strict=True))
        if e.op == "where":
            args = [args[0], *(_operand(a, v.dtype, compute) for v, a in operands[1:])]
        else:
            args = [_operand(a, v.dtype, compute) for v, a in operands]
        if out.dtype is DataType.Bool and compute.compute_type == "float":
            # A Bool of float values (isinf, a comparison) has no tolerance: take the
            # operands as the kernel holds them, in float32 (1e30 * 1e30 is inf there).
            args = [_rounded(a, DataType.Float) if np.asarray(a).dtype.kind == "f" else a
                    for a in args]
        op = ELEMENTWISE[e.op]
        reference = op.reference
        if op.float_reference is not None and compute.compute_type == "float":
            reference = op.float_reference  # fm::exp's flush and overflow
        return [_exact(reference(*args), out.dtype)]
    if e.op == "cast":
        if not rounding_cast(e):  # rounds=False: the value a kernel holds, not rounded
            return [_exact(args[0], out.dtype)]
        return [_cast(args[0], e.inputs[0].dtype, out.dtype, shift)]
    if e.op == "size":
        return [np.int64(sizes.value(as_tensor(e.inputs[0]).dims[e.attr("dim")]))]
    if e.op == "squeeze":
        return [np.squeeze(np.asarray(args[0]), axis=tuple(e.attr("dims")))]
    if e.op == "permute":
        return [np.transpose(np.asarray(args[0]), e.attr("dims"))]
    if e.op == "reshape":
        return [np.reshape(np.asarray(args[0]), sizes.shape(as_tensor(out)))]
    if e.op in ("broadcast_in_dim", "expand"):
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
    if e.op == "mean":
        return [np.asarray(args[0], dtype=np.float64).mean(axis=dims, keepdims=keepdim)]
    if e.op in ("var_mean", "var"):
        x = np.asarray(args[0], dtype=np.float64)
        n = math.prod(x.shape[d] for d in dims)
        mean = x.mean(axis=dims, keepdims=True)
        squares = ((x - mean) ** 2).sum(axis=dims, keepdims=keepdim)
        var = squares / max(n - e.attr("correction"), 0)  # torch clamps n - correction at 0
        if e.op == "var":
            return [var]
        return [var, mean if keepdim else mean.reshape(var.shape)]
    raise InternalError(
        f"reference: no evaluation rule for op {e.op!r} ({out.name}); every op of the IR needs "
        "one in reference._run, so this is a fuser bug"
    )


def evaluate(fusion: Fusion, inputs: list, *, sums_unrounded: bool = False) -> list[np.ndarray]:
    """Run `fusion` on numpy inputs (in `fusion.inputs` order); one float64/int64/bool array per
    output. Raises BadInputError when the inputs disagree with the definition.

    With `sums_unrounded`, an output that is a sum through casts (is_sum) is the sum's value
    before those casts and the store: what chunks of rows add up to. A caller that adds the
    sums of several chunks rounds the total once with stored(); adding rounded chunk sums
    would multiply one chunk's rounding by the number of chunks."""
    values, sizes = _check_inputs(fusion, list(inputs))
    env = _environment(fusion, values, sizes)
    if not sums_unrounded:
        return [np.array(_stored(env[o], o.dtype), order="C") for o in fusion.outputs]
    return [np.array(env[_under_casts(o)] if is_sum(o) else _stored(env[o], o.dtype), order="C")
            for o in fusion.outputs]


def stored(x, t: Tensor) -> np.ndarray:
    """`x` (float64) as the kernel stores output `t`: rounded to its dtype (see _rounded)."""
    return np.array(_stored(x, t.dtype), order="C")


def _evaluate(fusion: Fusion, values: list, sizes: Sizes, before: dict[int, float] | None = None,
              after: dict[int, np.ndarray] | None = None,
              added: dict[int, np.ndarray] | None = None) -> list[np.ndarray]:
    """evaluate() on checked input values (float64 / int64 / bool, as _check_inputs gives).
    For input_sensitivity()'s draws: `before` moves the operand of a cast (by id) by a relative
    amount before it rounds, `after` moves its result by a relative amount per element, `added`
    moves an Expr's result by an absolute amount per element."""
    env = _environment(fusion, values, sizes, before, after, added)
    return [np.array(_stored(env[o], o.dtype), order="C") for o in fusion.outputs]


def _environment(fusion: Fusion, values: list, sizes: Sizes,
                 before: dict[int, float] | None = None,
                 after: dict[int, np.ndarray] | None = None,
                 added: dict[int, np.ndarray] | None = None) -> dict[Val, object]:
    """The value of every Val the outputs need, as computed (outputs not yet stored)."""
    env: dict[Val, object] = dict(zip(fusion.inputs, values, strict=True))
    for v in fusion.vals:
        if isinstance(v, Scalar) and v.definition is None and v.value is not None:
            with np.errstate(over="ignore"):  # a Float constant beyond float32 is inf
                stored = np.array(v.value, dtype=v.dtype.scalar_numpy)
            env[v] = _exact(stored, v.dtype)[()]
    needed = _needed(fusion)
    before, after, added = before or {}, after or {}, added or {}
    for e in fusion.exprs:
        if id(e) not in needed:
            continue
        with np.errstate(all="ignore"):  # NaN and inf propagate, as they do on the device
            results = _run(e, [env[v] for v in e.inputs], sizes, before.get(id(e), 0.0))
            if id(e) in after:
                results = [results[0] * (1.0 + after[id(e)])]
            if id(e) in added:  # a var_mean's var: its mean stays
                results = [results[0] + added[id(e)], *results[1:]]
        for out, r in zip(e.outputs, results, strict=True):
            if isinstance(out, Tensor) and np.shape(r) != sizes.shape(out):
                raise InternalError(
                    f"reference: {out.name} = {e.op}(...) has shape {np.shape(r)}, but its "
                    f"extents say {sizes.shape(out)}; this is a fuser bug"
                )
            env[out] = r
    return env


# ----- comparing a kernel's outputs with the oracle ---------------------------------------------

# Base (rtol, atol) of an output stored in each float dtype, for O(1) data. For Half and
# BFloat16, rtol is two units in the last place and atol one unit at 1.0: the oracle rounds the
# output (and every cast) as the kernel does, but the kernel rounds a value a few float ulps
# away, so near a rounding boundary the two stored values are one unit apart (the output), and
# one more unit may come from a cast upstream that rounded the other way. Float is wider than
# its 2**-23 ulp because fast-math intrinsics (__expf, rsqrtf...) promise a few ulps that grow
# with |x|.
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


def precision(t: Tensor) -> DataType:
    """The dtype whose tolerance() output `t` gets: its own, except that a Double output with a
    value computed in float upstream (an op or cast whose result is Float, Half or BFloat16)
    is only as precise as Float. The oracle holds every value in float64, but the kernel
    rounded that value in float32 (and __logf, __expf... promise a few float ulps), an error
    no later double math takes back: log(|x| + 1) of a Float x, cast to Double, missed the
    1e-12 of a Double output by 4.8e-7 relative (the GPU fuzz)."""
    if t.dtype is not DataType.Double:
        return t.dtype
    computed_in_float = any(o.dtype.is_float and o.dtype is not DataType.Double
                            for e in upstream([t]) for o in e.outputs)
    return DataType.Float if computed_in_float else DataType.Double


def _compute_eps(dtype: DataType) -> float:
    """The machine epsilon of the type a floating dtype is computed in (float or double)."""
    return float(np.finfo(np.float64 if dtype is DataType.Double else np.float32).eps)


def _growth(dtype: DataType, reduction_size: int) -> float:
    """The sqrt(n) rounding growth of a sum of n terms, in the compute type's epsilons."""
    return _REDUCTION_GROWTH * _compute_eps(dtype) * math.sqrt(max(reduction_size, 1))


def input_sensitivity(fusion: Fusion, inputs: list,
                      references: Sequence | None = None) -> list[np.ndarray | None]:
    """Per output, how far a correct kernel's value may stray from the oracle's beyond a plain
    rounding (None for outputs with no such allowance; see sensitivity_allowance()).

    For an output stored in Float or Double: how far each element moves when every floating
    tensor input moves by one epsilon of its compute type, the largest |change| over two draws
    of signs: alternating along the last axis (a row never moves as a whole, which a
    normalization would cancel), then random (a fixed seed: the same on every run). Why: a
    kernel rounds in its compute type from the first op on, so no kernel is closer to the exact
    result than the oracle is to itself on inputs moved by that much. A well conditioned output
    moves by about an epsilon, far inside tolerance(); an ill-conditioned one moves by the
    epsilon times its condition number, and so does every correct kernel's value: LayerNorm of
    a short row whose elements nearly agree (x - mean cancels, rstd is large) missed a 1e-5
    tolerance by 1.5x in float32 at hidden 3. The results of casts to Half / BFloat16 move
    alike: the float math after such a cast rounds afresh on values the cast made exact.
    Two more draws (one for a single sum) move the result of every float sum by the rounding a
    serial loop may add to it (_serial_rounding), with random signs per sum and element, the
    second draw flipping every other sum's (an output that subtracts two sums sees them move
    apart in one of the two): where the math after a sum cancels it (x minus its
    column sum, times the row count), that rounding reaches the output at its own absolute
    size, which an epsilon's move of the inputs only matches for some columns' random draws
    (x - sum(x, dim 0) missed by 7x at 16384 x 4096 on the H200).

    For every float output: a cast that rounds (to Half / BFloat16, to an int type) is a step
    function. Where its operand lies within a kernel's error of a rounding boundary, a correct
    kernel may land on the other side, and the outputs downstream differ by that one rounding,
    far beyond a Float output's tolerance or a Half output's two units. Two more draws move
    every such cast's operand down, then up, by that error (_cast_margins), so only those
    elements get the allowance. Half and BFloat16 outputs get no other: they round far above
    float's epsilon.

    A Bool or int output computed from a float value by a step (a comparison, a logical op, a
    cast to an int type) must match exactly, except where a kernel's rounding may cross the
    step: its spread is 1 at the elements that change under the "inputs" draws above, 0
    elsewhere. The sums' draws move a variance by what a loop's mean adds to it (the variance
    of a row whose values agree is 0 in the oracle and a few squared epsilons in float, so
    `var(x) != 0` may be either). `references`, evaluate()'s outputs for these inputs where the
    caller has them, saves evaluating them again.
    """
    values, sizes = _check_inputs(fusion, list(inputs))
    margins = _cast_margins(fusion, sizes)
    kinds = [_draw_kinds(o, margins) for o in fusion.outputs]
    if not any(kinds):
        return [None] * len(fusion.outputs)
    base = list(references) if references is not None else _evaluate(fusion, values, sizes)
    spread = [np.zeros(np.shape(b)) if kind else None
              for kind, b in zip(kinds, base, strict=True)]
    for kind, outs in _draws(fusion, values, sizes, margins):
        for k, out in enumerate(outs):
            so_far = spread[k]
            if so_far is None or kind not in kinds[k]:
                continue
            if not fusion.outputs[k].dtype.is_float:  # a step crossed: 1, else 0
                spread[k] = np.maximum(so_far, np.asarray(out) != np.asarray(base[k]))
                continue
            with np.errstate(all="ignore"):
                change = np.abs(np.asarray(out, np.float64) - base[k])
            spread[k] = np.maximum(so_far, np.where(np.isfinite(change), change, 0.0))
    return spread


def _draw_kinds(out: Tensor, margins: dict[int, float]) -> set[str]:
    """Which of _draws' moves an output's allowance follows: "inputs" for Float / Double
    outputs and for Bool / int outputs of a step on a float value, "casts" for those and for
    Half / BFloat16 outputs downstream of a cast with a margin."""
    kinds = {"inputs"} if _moves_with_inputs(out) else set()
    if (out.dtype.is_float or kinds) and any(id(e) in margins for e in upstream([out])):
        kinds.add("casts")
    return kinds


def _moves_with_inputs(out: Tensor) -> bool:
    """Whether rounding in a kernel moves `out`: a Float / Double output, or a Bool / int one
    that an op computes from a float value (a step a kernel's rounding may cross)."""
    if out.dtype in _SENSITIVE:
        return True
    return not out.dtype.is_float and any(
        not e.outputs[0].dtype.is_float and any(v.dtype.is_float for v in e.inputs)
        for e in upstream([out]))


def _draws(fusion: Fusion, values: list, sizes: Sizes,
           margins: dict[int, float]) -> Iterator[tuple[str, list[np.ndarray]]]:
    """("inputs", outputs) on the inputs, and the results of casts to Half / BFloat16 (or
    Double to Float), moved by one epsilon (two draws of signs), and on the results of the
    float sums moved by their serial rounding (one or two draws); then ("casts", outputs) with
    the operand of every cast in `margins` moved down, then up, by its margin, and where there
    are several, of each alone (a flip upstream can move a later operand the other way)."""
    rng = np.random.default_rng(0)
    sensitive = [o for o in fusion.outputs if _moves_with_inputs(o)]
    narrowing = [e for e in upstream(sensitive) if _narrows(e)]
    for draw in ("alternating", "random") if sensitive else ():
        moved = [_moved(v, x, draw, rng) for v, x in zip(fusion.inputs, values, strict=True)]
        after = {id(e): _compute_eps(e.attr("dtype"))
                 * _signs(_shape(e.outputs[0], sizes), draw, rng) for e in narrowing}
        yield "inputs", _evaluate(fusion, moved, sizes, after=after)
    roundings = _sum_roundings(fusion, values, sizes, upstream(sensitive))
    signs = {k: rng.choice(np.array([-1.0, 1.0]), size=np.shape(r)) for k, r in roundings.items()}
    for flip in (1.0, -1.0) if len(roundings) > 1 else (1.0,) if roundings else ():
        # Independent signs per sum and element, then every other sum's flipped: where an
        # output adds or subtracts two sums, one of the draws moves them apart.
        added = {k: r * signs[k] * (flip if i % 2 else 1.0)
                 for i, (k, r) in enumerate(roundings.items())}
        yield "inputs", _evaluate(fusion, values, sizes, added=added)
    groups = [margins, *({k: m} for k, m in margins.items())] if len(margins) > 1 else [margins]
    for group in groups if margins else []:
        for sign in (-1.0, 1.0):
            yield "casts", _evaluate(fusion, values, sizes,
                                     {k: sign * m for k, m in group.items()})


def _sum_roundings(fusion: Fusion, values: list, sizes: Sizes,
                   exprs: list[Expr]) -> dict[int, np.ndarray]:
    """id -> _serial_rounding() of each float sum among `exprs`, and _variance_rounding() of
    each variance, from one evaluation."""
    sums = [e for e in exprs if e.op in ("sum", "mean", "var", "var_mean")
            and e.outputs[0].dtype.is_float]
    if not sums:
        return {}
    env = _environment(fusion, values, sizes)
    roundings = {}
    for e in sums:
        x, dims = np.asarray(env[e.inputs[0]]), e.attr("dims")
        rounding = _serial_rounding(x, dims, e.attr("keepdim"), e.outputs[0].dtype)
        n = math.prod(x.shape[d] for d in dims)
        if e.op == "mean":
            rounding = rounding / max(n, 1)
        elif e.op != "sum":
            rounding = _variance_rounding(rounding, n, e.attr("correction"))
        roundings[id(e)] = rounding
    return roundings


def _variance_rounding(mean_sum_rounding: np.ndarray, n: int, correction: int) -> np.ndarray:
    """How far a variance computed in a loop may rise above the exact one: its mean strays by
    the serial rounding of the sum over the n terms, d = rounding / n, and the sum of squared
    deviations from a mean d off is the exact one plus n d^2, divided by n - correction."""
    d = mean_sum_rounding / max(n, 1)
    return n * np.square(d) / max(n - correction, 1)


def _serial_rounding(x, dims: tuple[int, ...], keepdim: bool, dtype: DataType) -> np.ndarray:
    """How far a sum over `dims`, added up in a loop in `dtype`'s compute type, may stray:
    half an epsilon times sqrt(sum of the squared partial sums). Each addition rounds its
    partial sum by up to half an epsilon of it, with random signs, so the errors add up like
    a random walk. For terms of one sign this is about tolerance()'s sqrt(n) epsilons of the
    sum; for terms that cancel (a sum of centred values) it is sqrt(n) epsilons of their
    spread, however small the sum came out. A tree adds fewer roundings, never more."""
    x = np.asarray(x, dtype=np.float64)
    if len(dims) > 1:  # one axis of the reduced ones, in the order a loop walks them
        x = np.moveaxis(x, dims, range(x.ndim - len(dims), x.ndim))
        x = x.reshape(*x.shape[:x.ndim - len(dims)], -1)
    axis = dims[0] if len(dims) == 1 else x.ndim - 1
    with np.errstate(all="ignore"):
        partial = np.cumsum(x, axis=axis)
        scale = np.max(np.abs(partial), axis=axis, keepdims=True)  # no overflow when squared
        unit = np.divide(partial, scale, out=np.zeros_like(partial), where=scale > 0)
        norm = np.sqrt(np.square(unit, out=unit).sum(axis=axis)) * np.squeeze(scale, axis)
        rounding = 0.5 * _compute_eps(dtype) * norm
    rounding = np.where(np.isfinite(rounding), rounding, 0.0)  # inf and NaN compare exactly
    return np.expand_dims(rounding, dims) if keepdim else rounding


def _shape(v: Val, sizes: Sizes) -> tuple[int, ...]:
    return sizes.shape(v) if isinstance(v, Tensor) else ()


def _narrows(e: Expr) -> bool:
    """A cast to Half / BFloat16, or from Double to Float: its result is exact in a coarser
    format than the math after it rounds in."""
    return rounding_cast(e) and (e.attr("dtype") in (DataType.Half, DataType.BFloat16) or (
        e.attr("dtype") is DataType.Float and e.inputs[0].dtype is DataType.Double))


def _rounds(e: Expr) -> bool:
    """A cast that rounds a computed float value: to Half / BFloat16, Double to Float, or a
    float to an int type."""
    if not rounding_cast(e) or not e.inputs[0].dtype.is_float:
        return False
    src, dst = e.inputs[0].dtype, e.attr("dtype")
    return (dst in (DataType.Half, DataType.BFloat16) or dst.category is Category.INT
            or (dst is DataType.Float and src is DataType.Double))


def _cast_margins(fusion: Fusion, sizes: Sizes) -> dict[int, float]:
    """id -> relative margin of each rounding cast (_rounds) a float output (or a Bool / int
    output of a step on a float value) depends on: the
    relative tolerance of its operand's compute type for the sums upstream of it. A kernel's
    operand is that far from the oracle's at most, so where the oracle's lies that close to a
    rounding boundary, a correct kernel may round to the other neighbour, and the outputs
    downstream move by what that one rounding changes. Elsewhere the cast rounds alike in
    both, and a kernel that rounds wrongly (or not at all) is still caught. A cast that only
    makes a Half / BFloat16 output has none: tolerance() allows for its rounding."""
    exprs = upstream([o for o in fusion.outputs if o.dtype.is_float or _moves_with_inputs(o)])
    read = {id(v) for e in exprs for v in e.inputs}
    margins = {}
    for e in exprs:
        out = e.outputs[0]
        if not _rounds(e) or (out in fusion.outputs and out.dtype.is_float
                              and out.dtype not in _SENSITIVE and id(out) not in read):
            continue
        compute = DataType.Double if e.inputs[0].dtype is DataType.Double else DataType.Float
        margins[id(e)] = tolerance(compute, _reduction_size(e.inputs[0], sizes))[0]
    return margins


def _moved(v: Val, x, draw: str, rng: np.random.Generator):
    """A floating tensor input times (1 +- one epsilon of its compute type), the signs
    alternating along the last axis or random; other inputs as they are."""
    if not (isinstance(v, Tensor) and v.dtype.is_float):
        return x
    return x * (1.0 + _compute_eps(v.dtype) * _signs(np.shape(x), draw, rng))


def _signs(shape: tuple[int, ...], draw: str, rng: np.random.Generator) -> np.ndarray:
    """+-1 per element: alternating along the last axis (+1 for a 0-d value), or random."""
    if draw == "alternating":
        if not shape:
            return np.ones(())
        return np.broadcast_to(1.0 - 2.0 * (np.arange(shape[-1]) % 2), shape)
    return rng.choice(np.array([-1.0, 1.0]), size=shape)


def sensitivity_allowance(spread) -> float | np.ndarray:
    """Extra absolute error allowed per element: _SENSITIVITY_FACTOR times input_sensitivity()'s
    spread (0 where there is none). A kernel rounds several times, not once."""
    return 0.0 if spread is None else _SENSITIVITY_FACTOR * spread


def is_sum(t: Tensor) -> bool:
    """True when `t` is a sum (through casts): its elements add up other values, so a
    chunk of rows contributes additively and its rounding follows its partial sums."""
    e = _under_casts(t).definition
    return e is not None and e.op == "sum"


def _under_casts(v: Val) -> Val:
    """The value `v` is a chain of casts of (`v` itself when it is not a cast)."""
    while v.definition is not None and v.definition.op == "cast":
        v = v.definition.inputs[0]
    return v


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

    Sums, mean, var_mean and var round as they accumulate; max and min are exact and do not
    count. Two reductions on one path (softmax's max then sum, a backward pass's several sums)
    add up.
    """
    inputs = list(inputs)
    check_count(fusion, inputs)
    shapes = [
        np.shape(x) if isinstance(v, Tensor) else None
        for v, x in zip(fusion.inputs, inputs, strict=True)
    ]
    sizes = bind_shapes(fusion, shapes)
    return [_reduction_size(out, sizes) for out in fusion.outputs]


def _reduction_size(v: Val, sizes: Sizes) -> int:
    """How many elements the sums (and means, var_means, vars) upstream of `v` combine."""
    total = 0
    for e in upstream([v]):
        if e.op in ("sum", "mean", "var_mean", "var"):
            extents = as_tensor(e.inputs[0]).dims
            total += math.prod(sizes.value(extents[d]) for d in e.attr("dims"))
    return total


def _index(flat: int, shape) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def _compare_one(label: str, t: Tensor, got, ref, n: int, spread=None) -> str | None:
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return f"{label}: shape {got.shape}, but the reference has shape {ref.shape}"
    if not t.dtype.is_float:
        g, r = _exact(got, t.dtype), _exact(ref, t.dtype)
        either = np.zeros(r.shape, bool) if spread is None else np.asarray(spread) > 0
        bad = (g != r) & ~either
        if not bad.any():
            return None
        first = _index(int(np.argmax(bad)), bad.shape)
        skipped = f"; {int(either.sum())} a rounding may flip not compared" if either.any() else ""
        return (
            f"{label}: {int(bad.sum())} of {bad.size} elements differ (exact match required"
            f"{skipped}); first at index {first}: got {g[first].item()!r}, "
            f"expected {r[first].item()!r}"
        )
    g, r = got.astype(np.float64), ref.astype(np.float64)
    rtol, atol = tolerance(precision(t), n)
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
