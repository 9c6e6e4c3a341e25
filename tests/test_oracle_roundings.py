"""The oracle rounds where a kernel rounds (issue 13, "the oracle models the kernel's roundings").

A float32 model of fuser's kernels (`emulate`: Float / Half / BFloat16 values computed in
float32, casts and stores through __float2half_rn / __float2bfloat16_rn, as emit.py writes them)
runs random fusions with casts to half and bf16 in the middle; `validate`'s comparison (the
oracle, its tolerances and its sensitivity allowance) must accept every one, and the oracle of
before, whose casts were exact and never overflowed, must reject most of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from fuser import DataType, FusionDefinition, ValidationError, reference
from fuser.ir import Fusion, Scalar, as_tensor
from fuser.ops import ELEMENTWISE, REDUCTIONS
from fuser.reference import (
    compare,
    evaluate,
    input_sensitivity,
    output_reduction_sizes,
)
from fuser.shapes import bind_shapes

BF16, HALF, FLOAT, DOUBLE = DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double


# ----- a float32 model of the kernels -----------------------------------------------------------


def _compute(dtype: DataType) -> np.dtype:
    """The numpy type of a dtype's compute type (emit.py ctype)."""
    return {"float": np.dtype(np.float32), "double": np.dtype(np.float64),
            "int": np.dtype(np.int32), "long long": np.dtype(np.int64),
            "bool": np.dtype(bool)}[dtype.compute_type]


def _kernel_cast(a: np.ndarray, target: DataType) -> np.ndarray:
    """Emitter._cast: round_half / round_bf16 of static_cast<float>, else static_cast."""
    with np.errstate(over="ignore"):
        if target in (HALF, BF16):
            return a.astype(np.float32).astype(target.numpy).astype(np.float32)
        return a.astype(_compute(target))


def _kernel_op(e, args: list, sizes) -> np.ndarray:
    out = e.outputs[0]
    if e.op in ELEMENTWISE:
        c = _compute(e.attr("compute"))
        first = 1 if e.op == "where" else 0
        args = args[:first] + [np.asarray(a).astype(c) for a in args[first:]]
        return np.asarray(ELEMENTWISE[e.op].reference(*args)).astype(_compute(out.dtype))
    if e.op == "cast":
        return _kernel_cast(np.asarray(args[0]), e.attr("dtype"))
    if e.op == "size":
        return np.int64(sizes.value(as_tensor(e.inputs[0]).dims[e.attr("dim")]))
    if e.op == "broadcast_in_dim":
        staged = [1] * as_tensor(out).ndim
        for i, d in enumerate(e.attr("broadcast_dims")):
            staged[d] = np.shape(args[0])[i]
        return np.broadcast_to(np.reshape(args[0], staged), sizes.shape(as_tensor(out)))
    x = np.asarray(args[0]).astype(_compute(out.dtype))
    return REDUCTIONS[e.op].reference(x, axis=e.attr("dims"), keepdims=e.attr("keepdim"))


def emulate(fusion: Fusion, inputs: list) -> list[np.ndarray]:
    """What fuser's kernels compute, modelled in numpy float32 (float64 for Double): every
    op rounds in its compute type, casts and stores round as the kernels do."""
    sizes = bind_shapes(fusion, [np.shape(x) if not isinstance(v, Scalar) else None
                                 for v, x in zip(fusion.inputs, inputs, strict=True)])
    env = {v: np.asarray(x).astype(_compute(v.dtype))
           for v, x in zip(fusion.inputs, inputs, strict=True)}
    for v in fusion.vals:
        if isinstance(v, Scalar) and v.definition is None and v.value is not None:
            env[v] = np.asarray(v.value).astype(_compute(v.dtype))
    for e in fusion.exprs:
        with np.errstate(all="ignore"):
            env[e.outputs[0]] = _kernel_op(e, [env[i] for i in e.inputs], sizes)
    with np.errstate(over="ignore"):
        return [np.asarray(env[o]).astype(o.dtype.numpy) for o in fusion.outputs]


def check(fusion: Fusion, inputs: list, outputs: list) -> None:
    """fd.validate's comparison of `outputs` with the oracle."""
    refs = evaluate(fusion, inputs)
    compare(outputs, refs, fusion, output_reduction_sizes(fusion, inputs),
            input_sensitivity(fusion, inputs, refs))


def exact_casts(x, dtype: DataType) -> np.ndarray:
    """The oracle of before: casts to float types and stores were exact, never overflowing."""
    return np.asarray(x).astype(np.float64)


# ----- the issue's two examples -----------------------------------------------------------------


def _round_trip() -> FusionDefinition:
    with FusionDefinition("round_trip") as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        fd.add_output(fd.ops.cast(fd.ops.cast(x, BF16), FLOAT) - x)
    return fd


def _scaled_to_half() -> FusionDefinition:
    with FusionDefinition("scaled_to_half") as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        fd.add_output(fd.ops.cast(x * 1e5, HALF))
    return fd


@pytest.mark.parametrize("make", [_round_trip, _scaled_to_half])
def test_the_issues_examples_validate_and_failed_before(make, monkeypatch):
    fusion = make().fusion
    inputs = [np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)]
    kernel = emulate(fusion, inputs)
    check(fusion, inputs, kernel)
    monkeypatch.setattr(reference, "_rounded", exact_casts)
    with pytest.raises(ValidationError):
        check(fusion, inputs, kernel)


# ----- random fusions ---------------------------------------------------------------------------

_STEPS = ["add_w", "mul_w", "div_safe", "tanh", "sigmoid", "exp_small", "neg", "center",
          "bf16_trip", "half_trip", "half_overflow", "bf16_scaled"]
_ROUNDING = ["bf16_trip", "half_trip", "half_overflow", "bf16_scaled"]


def _step(fd: FusionDefinition, step: str, v, w, x_in):
    ops = fd.ops
    if step in ("add_w", "mul_w"):
        return getattr(ops, step[:3])(v, w)
    if step == "div_safe":
        return ops.div(v, ops.add(ops.abs(w), 1.0))
    if step == "exp_small":
        return ops.exp(ops.mul(v, 0.25))
    if step in ("tanh", "sigmoid", "neg"):
        return getattr(ops, step)(v)
    if step == "center":
        mean = ops.div(ops.sum(v, dims=[1], keepdim=True), x_in.size(1))
        return ops.sub(v, ops.broadcast_in_dim(mean, x_in.shape(), [0, 1]))
    if step in ("bf16_trip", "half_trip"):
        return ops.cast(ops.cast(v, BF16 if step == "bf16_trip" else HALF), FLOAT)
    if step == "half_overflow":  # |v| > 6.55 overflows half: inf on the GPU
        return ops.mul(ops.cast(ops.cast(ops.mul(v, 1e4), HALF), FLOAT), 1e-4)
    return ops.cast(ops.cast(ops.mul(v, 3.0), BF16), FLOAT)  # bf16_scaled


def random_case(seed: int) -> tuple[Fusion, list]:
    """A chain of 2 to 7 steps with at least one rounding cast; a Float output, the same value
    stored in the input dtype, and Float column sums."""
    rng = np.random.default_rng(seed)
    dtype = [FLOAT, HALF, BF16][seed % 3]
    steps = list(rng.choice(_STEPS, size=int(rng.integers(1, 7))))
    steps.insert(int(rng.integers(0, len(steps) + 1)), str(rng.choice(_ROUNDING)))
    with FusionDefinition(f"oracle_{seed}") as fd:
        x_in = fd.define_tensor([-1, -1], dtype=dtype)
        w_in = fd.define_tensor([-1], dtype=dtype)
        v = fd.ops.cast(x_in, FLOAT)
        w = fd.ops.broadcast_in_dim(fd.ops.cast(w_in, FLOAT), x_in.shape(), [1])
        for step in steps:
            v = _step(fd, step, v, w, x_in)
        fd.add_output(v)
        fd.add_output(fd.ops.cast(v, dtype))
        fd.add_output(fd.ops.sum(v, dims=[0]))
    x = (3.0 * rng.standard_normal((96, 384))).astype(dtype.numpy)
    w = rng.standard_normal(384).astype(dtype.numpy)
    return fd.fusion, [x, w]


SEEDS = range(30)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_float32_kernel_validates_against_the_oracle(seed):
    fusion, inputs = random_case(seed)
    check(fusion, inputs, emulate(fusion, inputs))


def test_the_exact_oracle_rejected_most_of_them(monkeypatch):
    monkeypatch.setattr(reference, "_rounded", exact_casts)
    rejected = []
    for seed in SEEDS:
        fusion, inputs = random_case(seed)
        try:
            check(fusion, inputs, emulate(fusion, inputs))
        except ValidationError:
            rejected.append(seed)
    assert len(rejected) >= len(SEEDS) * 2 // 3, rejected


def test_a_kernel_that_skips_a_cast_is_still_caught():
    """The allowance for casts that may round the other way covers only operands near a
    rounding boundary: a kernel that does not round at all fails."""
    fusion = _round_trip().fusion
    inputs = [np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32)]
    with pytest.raises(ValidationError, match="elements differ"):
        check(fusion, inputs, [np.zeros((64, 256), np.float32)])


def test_casts_near_a_rounding_boundary_get_an_allowance_only_there():
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=FLOAT)
        fd.add_output(fd.ops.cast(fd.ops.cast(x * 3.0, BF16), FLOAT))
    # 3 * x lands within a float ulp of a bf16 tie (1 + 2**-8) for the first element, far
    # from one for the second: a kernel's 3 * x may round either way at the first only
    xs = np.array([(1 + 2.0**-8) / 3, 1.1], dtype=np.float32)
    (ref,) = evaluate(fd.fusion, [xs])
    (spread,) = input_sensitivity(fd.fusion, [xs])
    assert spread[0] == pytest.approx(2.0**-7, rel=1e-4)  # one bf16 unit at 1.0
    assert spread[1] < 1e-6  # an input's rounding, no more
    other = np.array([1.0 if ref[0] != 1.0 else 1 + 2.0**-7, ref[1]], np.float32)
    check(fd.fusion, [xs], [other])  # the other neighbour of the tie: accepted
    with pytest.raises(ValidationError, match="1 of 2 elements differ"):
        check(fd.fusion, [xs], [np.array([ref[0], ref[1] + 2.0**-7], np.float32)])


# ----- stores of casts: to_storage rounds as the cast does ---------------------------------------


def test_a_cast_to_the_outputs_own_type_is_stored_from_its_operand():
    """emit_stored skips the cast's rounding where the store rounds the same way: the kernel
    stores fm::to_storage of the operand, and a second use of the cast still gets it."""
    from fuser.analysis import analyze
    from fuser.emit import Emitter, element_env

    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], dtype=BF16)
        square = fd.ops.mul(fd.ops.cast(x, FLOAT), fd.ops.cast(x, FLOAT))
        y = fd.ops.cast(square, BF16)
        h = fd.ops.cast(square, HALF)
        fd.add_output(y)
        fd.add_output(h)
        fd.add_output(fd.ops.cast(fd.ops.add(y, y), FLOAT))
    info = analyze(fd.fusion)
    y, h, z = info.fusion.outputs
    emitter = Emitter(info, element_env(info, {}), "e_")
    lines, stored = emitter.emit_stored([y, h, z])
    square_name = f"e_{y.definition.inputs[0].name}"
    assert stored[y] == stored[h] == square_name
    assert not any("round_half" in line for line in lines)
    assert sum("round_bf16" in line for line in lines) == 1  # for the sum of y, not its store


@pytest.mark.parametrize("target", [BF16, HALF])
def test_rounding_twice_to_nearest_even_stores_the_same_bits(target):
    """to_storage(round(x)) == to_storage(x), the identity emit_stored relies on, over random
    floats, the target's halfway points, overflow and NaN."""
    rng = np.random.default_rng(3)
    scaled = rng.standard_normal(100_000) * 10.0 ** rng.integers(-8, 8, 100_000)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [np.inf, -np.inf, np.nan, 65520.0, 3.4e38, -0.0]
    x = np.concatenate([scaled.astype(np.float32), bits, np.float32(edges)])
    assert x.dtype == np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        once = x.astype(target.numpy)
        twice = x.astype(target.numpy).astype(np.float32).astype(target.numpy)
    same = (once.view(np.uint16) == twice.view(np.uint16)) | (np.isnan(once) & np.isnan(twice))
    assert same.all()


def _nonzero_variance(constant: bool):
    """logical_and(y, var(y) over rows): y a row of equal values where `constant` (var is 0 in
    the oracle, a few squared epsilons above it in a float loop), else x itself."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1, -1], dtype=FLOAT)
        y = fd.ops.add(fd.ops.mul(x, 0.0), 0.3) if constant else x
        v = fd.ops.var(y, dims=[1], correction=0, keepdim=True)
        fd.add_output(fd.ops.logical_and(y, v))
        fd.add_output(fd.ops.gt(x, 0.0))
    return fd


def _float_kernel_var(rows: int, hidden: int) -> np.ndarray:
    """What a float32 loop gives var of a row of 0.3s: the mean off by its rounding."""
    y = np.full(hidden, 0.3, np.float32)
    total = np.float32(0)
    for value in y:
        total = np.float32(total + value)
    mean = np.float32(total / np.float32(hidden))
    return np.full((rows, 1), np.float32(np.sum(np.square(y - mean)) / hidden))


def test_a_bool_of_a_variance_the_oracle_has_at_zero_may_take_either_value():
    """The GPU fuzz's case (seed 3038, shard 48): var of equal values is 0 in float64 and
    above 0 in a float loop, so `var != 0` is True on the GPU; such elements are not compared,
    and every other Bool element still must match."""
    rows, hidden = 6, 100
    assert (_float_kernel_var(rows, hidden) > 0).all()  # the kernel's side, emulated
    fd = _nonzero_variance(constant=True)
    x = np.random.default_rng(3).standard_normal((rows, hidden)).astype(np.float32)
    refs = evaluate(fd.fusion, [x])
    assert not refs[0].any()
    sens = input_sensitivity(fd.fusion, [x], refs)
    assert (sens[0] > 0).all() and not (sens[1] > 0).any()
    sizes = output_reduction_sizes(fd.fusion, [x])
    compare([np.ones_like(refs[0]), refs[1]], refs, fd.fusion, sizes, sens)
    wrong = refs[1].copy()
    wrong[2, 7] = ~wrong[2, 7]
    with pytest.raises(ValidationError, match=r"1 of 600 elements differ"):
        compare([refs[0], wrong], refs, fd.fusion, sizes, sens)


def test_a_bool_of_a_variance_far_from_zero_is_compared_exactly():
    fd = _nonzero_variance(constant=False)
    x = np.random.default_rng(4).standard_normal((6, 100)).astype(np.float32)
    refs = evaluate(fd.fusion, [x])
    sens = input_sensitivity(fd.fusion, [x], refs)
    assert not (sens[0] > 0).any()
    wrong = refs[0].copy()
    wrong[0, 0] = ~wrong[0, 0]
    with pytest.raises(ValidationError, match=r"output 0 .*1 of 600 elements differ"):
        compare([wrong, refs[1]], refs, fd.fusion, output_reduction_sizes(fd.fusion, [x]), sens)


def test_an_int_cast_of_a_value_a_float_rounds_onto_an_integer_may_take_either_side():
    """The GPU fuzz's case (seed 4049, shard 59): cast(erf(x), Int64) at x = 4 is 0 in the
    oracle (erf(4) = 1 - 1.5e-8) and 1 on the GPU, whose float erf is 1.0f there. Elements
    near such a boundary are not compared; one far from it still must match."""
    with FusionDefinition() as fd:
        x = fd.define_tensor([-1], dtype=HALF)
        fd.add_output(fd.ops.cast(fd.ops.erf(x), DataType.Int64))
    xs = np.array([4.0, 0.5, -4.0], np.float16)
    assert np.float32(1 - 1.5e-8) == 1.0  # the kernel's erf(4) in float
    (ref,) = evaluate(fd.fusion, [xs])
    assert ref.tolist() == [0, 0, 0]
    sens = input_sensitivity(fd.fusion, [xs], [ref])
    assert (sens[0] > 0).tolist() == [True, False, True]
    sizes = output_reduction_sizes(fd.fusion, [xs])
    compare([np.array([1, 0, -1])], [ref], fd.fusion, sizes, sens)
    with pytest.raises(ValidationError, match="1 of 3 elements differ"):
        compare([np.array([1, 1, 0])], [ref], fd.fusion, sizes, sens)
