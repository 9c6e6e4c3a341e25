"""permute and reshape (issue 15, item 6): ops that move elements, which no kernel here does.
Segmentation cuts the fusion at each; the executor makes the result between kernels from its
operand (an input, or a value the segment before wrote): permute a contiguous copy in the new
order, reshape a view.

CPU: definitions and their errors, repr, the float64 oracle against numpy, the segments
chained on the oracle (layouts made between them as the executor makes them) equal to the
whole fusion, every segment compiled without spills, element counts checked on the host.
GPU (`gpu` marker): fd.validate() of the chain against the oracle, CuPy and torch arrays."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_segment import _segments

from fuser import (
    BadInputError,
    DataType,
    DefinitionError,
    FusionDefinition,
    UnsupportedFusionError,
)
from fuser.analysis import Kind, analyze
from fuser.device import DeviceSpec
from fuser.executor import _unshared, execute
from fuser.kernels import build
from fuser.reference import bind_shapes, evaluate
from fuser.schedulers import Problem

F, BF16 = DataType.Float, DataType.BFloat16
H200 = DeviceSpec.get("h200")


def flatten_then_transpose(fd):
    """[B, S, H] bf16 flattened to [B * S, H] (a view of an input), times a weight, then
    transposed (a copy of what the first kernel wrote) and summed along its rows: the
    weighted column sums, and the transposed product itself."""
    x = fd.define_tensor([-1, -1, -1], dtype=BF16)
    w = fd.define_tensor([-1])
    y = fd.ops.mul(fd.ops.reshape(x, [-1, x.size(2)]), w)
    t = fd.ops.permute(y, [1, 0])
    fd.add_output(fd.ops.sum(t, [1]))
    fd.add_output(t)


def group_norm(fd):
    """GroupNorm without affine over [N, 8, 16], 2 groups: each group of 4 channels x 16 a row
    of 64, normalized, then put back in the input's shape."""
    x = fd.define_tensor([-1, 8, 16])
    rows = fd.ops.reshape(x, [-1, 64])
    var, mean = fd.ops.var_mean(rows, [1], correction=0, keepdim=True)
    y = fd.ops.mul(fd.ops.sub(rows, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
    fd.add_output(fd.ops.reshape(y, [-1, 8, 16]))


def softmax_over_columns(fd):
    """softmax over dim 0 written as a transpose of the input, a row softmax and a transpose
    back of its bf16 result: one kernel between two copies."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    t = fd.ops.cast(fd.ops.permute(x, [1, 0]), F)
    e = fd.ops.exp(fd.ops.sub(t, fd.ops.max(t, [1], keepdim=True)))
    s = fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True))
    fd.add_output(fd.ops.permute(fd.ops.cast(s, BF16), [1, 0]))


def softmax_over_a_middle_axis_reshaped(fd):
    """[B, S, A, D] bf16 softmax over S as users write it on [B, S, A * D] views: the
    reshapes are views of the input and of the output, and between them one normalization
    along the columns per group of S rows, one column kernel (not a segment per reduction)."""
    x = fd.define_tensor([-1, -1, -1, -1], dtype=BF16)
    xf = fd.ops.reshape(fd.ops.cast(x, F), [x.size(0), x.size(1), -1])
    e = fd.ops.exp(fd.ops.sub(xf, fd.ops.max(xf, [1], keepdim=True)))
    y = fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True))
    fd.add_output(fd.ops.cast(fd.ops.reshape(y, [x.size(i) for i in range(4)]), BF16))


def group_norm_channels_last(fd):
    """GroupNorm without affine over channels-last [N, H, W, 32], 4 groups, as users write it:
    views [N, H * W, 4, 8] normalized over axes 1 and 3, put back. No order fits the whole
    fusion (its views), so the segment between the views is reordered on its own: rows [N, 4]
    moved together (a copy each way) around one row kernel."""
    x = fd.define_tensor([-1, -1, -1, 32])
    g = fd.ops.reshape(x, [x.size(0), -1, 4, 8])
    var, mean = fd.ops.var_mean(g, [1, 3], correction=0, keepdim=True)
    y = fd.ops.mul(fd.ops.sub(g, mean), fd.ops.rsqrt(fd.ops.add(var, 1e-5)))
    fd.add_output(fd.ops.reshape(y, [x.size(i) for i in range(4)]))


def cast_then_transposed(fd):
    """softmax over dim 0 as users write it: cast, transpose, row softmax, transpose back,
    cast. The transposes are moved onto the input and the output's cast: one kernel."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    t = fd.ops.permute(fd.ops.cast(x, F), [1, 0])
    e = fd.ops.exp(fd.ops.sub(t, fd.ops.max(t, [1], keepdim=True)))
    s = fd.ops.div(e, fd.ops.sum(e, [1], keepdim=True))
    fd.add_output(fd.ops.cast(fd.ops.permute(s, [1, 0]), BF16))


def product_of_inputs_reshaped(fd):
    """(x * y + 1) of two [B, S, H] inputs, reshaped to rows: the reshape is moved onto both
    inputs (views), and the row sums and the product are one kernel."""
    x = fd.define_tensor([-1, -1, -1])
    y = fd.define_tensor([-1, -1, -1])
    p = fd.ops.reshape(fd.ops.add(fd.ops.mul(x, y), 1.0), [-1, x.size(2)])
    fd.add_output(fd.ops.sum(p, [1]))
    fd.add_output(p)


def chain_of_moves(fd):
    """A reshape of a permute of x * y: both moved onto x and y (two passes), the row sums
    one kernel."""
    x = fd.define_tensor([-1, -1, -1])
    y = fd.define_tensor([-1, -1, -1])
    p = fd.ops.permute(fd.ops.mul(x, y), [2, 0, 1])
    fd.add_output(fd.ops.sum(fd.ops.reshape(p, [p.size(0), -1]), [1]))


def op_after_a_sized_reshape(fd):
    """abs of a reshape (sized by x.size(i)) of a value a kernel computes runs before the
    reshape, in that kernel (make fuzz found the sizes missing from the moved reshape)."""
    x = fd.define_tensor([-1, -1])
    s = fd.ops.sub(x, fd.ops.sum(x, [1], keepdim=True))
    fd.add_output(fd.ops.abs(fd.ops.reshape(s, [x.size(1), x.size(0)])))


def needed_as_it_is(fd):
    """x + y is an output and reshaped: it stays where it is (one kernel writes it, the
    reshape is a view of it) rather than moving onto x and y, which would compute x + y in a
    second kernel."""
    x = fd.define_tensor([-1, -1])
    y = fd.define_tensor([-1, -1])
    v = fd.ops.add(x, y)
    fd.add_output(v)
    fd.add_output(fd.ops.reshape(v, [-1]))


def doubling_chain(fd):
    """v = v + v forty times over x * y, transposed and summed: moved onto x and y in time
    linear in the chain (each value is looked at once)."""
    x = fd.define_tensor([-1, -1])
    y = fd.define_tensor([-1, -1])
    v = fd.ops.mul(x, y)
    for _ in range(40):
        v = fd.ops.add(v, v)
    fd.add_output(fd.ops.sum(fd.ops.permute(v, [1, 0]), [1]))


def narrow_product_transposed(fd):
    """x * sum(x) of a bf16 x is a BFloat16 value the kernel holds in float: written for the
    transpose in Float, not rounded to bf16 (a reduction between it and the input keeps the
    transpose where it is)."""
    x = fd.define_tensor([-1, -1], dtype=BF16)
    p = fd.ops.mul(x, fd.ops.sum(x, [1], keepdim=True))
    fd.add_output(fd.ops.sum(fd.ops.permute(p, [1, 0]), [1]))


def both_orientations(fd):
    """A stage that reads x as it is and transposed (the transpose moved onto the input): one
    kernel cannot hold both orientations, so each is a segment of its own."""
    a = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.neg(a))
    fd.add_output(fd.ops.permute(fd.ops.exp(a), [1, 0]))
    fd.add_output(fd.ops.sum(fd.ops.permute(a, [1, 0]), [1]))


def narrow_after_the_move(fd):
    """tanh of a Half value after a transpose of a kernel-computed value stays after the
    transpose: moved before it, the kernel would write tanh's result rounded to Half."""
    a = fd.define_tensor([-1, -1])
    t = fd.ops.permute(fd.ops.sub(a, fd.ops.max(a, [1], keepdim=True)), [1, 0])
    h = fd.ops.tanh(fd.ops.cast(t, DataType.Half))
    fd.add_output(fd.ops.sum(h, [1], dtype=F))


def size_of_a_later_reshape(fd):
    """z reshaped with a size of r1, a reshape of row sums made after the first kernel."""
    a = fd.define_tensor([-1, -1])
    z = fd.define_tensor([-1])
    r1 = fd.ops.reshape(fd.ops.sum(a, [1]), [-1])
    fd.add_output(fd.ops.add(r1, fd.ops.reshape(z, [r1.size(0)])))


def narrow_column_sums_reshaped(fd):
    """bf16 column sums (a Float sum cast back) reshaped: the cast is written by the kernel
    that finishes the sums, not by one more."""
    a = fd.define_tensor([-1, -1], dtype=BF16)
    fd.add_output(fd.ops.reshape(fd.ops.sum(a, [0]), [-1, 2]))


def reshaped_input_out(fd):
    """An input reshaped and returned: no kernel; the caller gets a copy, not a view."""
    x = fd.define_tensor([-1, -1])
    fd.add_output(fd.ops.reshape(x, [-1]))


CASES = {  # name -> (builder, segments, input shapes)
    "flatten_then_transpose": (flatten_then_transpose, 2, [(3, 10, 17), (17,)]),
    "group_norm": (group_norm, 1, [(5, 8, 16)]),
    "softmax_over_columns": (softmax_over_columns, 1, [(30, 17)]),
    "cast_then_transposed": (cast_then_transposed, 1, [(30, 17)]),
    "group_norm_channels_last": (group_norm_channels_last, 1, [(3, 5, 2, 32)]),
    "softmax_over_a_middle_axis_reshaped": (softmax_over_a_middle_axis_reshaped, 1,
                                            [(3, 7, 4, 5)]),
    "product_of_inputs_reshaped": (product_of_inputs_reshaped, 1, [(3, 10, 17), (3, 10, 17)]),
    "narrow_product_transposed": (narrow_product_transposed, 2, [(30, 17)]),
    "chain_of_moves": (chain_of_moves, 1, [(3, 4, 5), (3, 4, 5)]),
    "op_after_a_sized_reshape": (op_after_a_sized_reshape, 1, [(6, 4)]),
    "needed_as_it_is": (needed_as_it_is, 1, [(4, 6), (4, 6)]),
    "doubling_chain": (doubling_chain, 1, [(4, 6), (4, 6)]),
    "reshaped_input_out": (reshaped_input_out, 0, [(30, 17)]),
    "both_orientations": (both_orientations, 2, [(30, 17)]),
    "narrow_after_the_move": (narrow_after_the_move, 2, [(64, 48)]),
    "size_of_a_later_reshape": (size_of_a_later_reshape, 2, [(4, 6), (4,)]),
    "narrow_column_sums_reshaped": (narrow_column_sums_reshaped, 1, [(30, 18)]),
}


def _fd(name: str) -> FusionDefinition:
    with FusionDefinition(name) as fd:
        CASES[name][0](fd)
    return fd


def _inputs(fd: FusionDefinition, shapes, seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32).astype(v.dtype.numpy)
            for v, s in zip(fd.fusion.inputs, shapes, strict=True)]


def _layouts_on_host(layouts, values: dict, sizes) -> None:
    """The executor's between-kernel step (moves.make_layouts), for numpy arrays."""
    for e in layouts:
        out, x = e.outputs[0], values.get(e.inputs[0])
        if out in values or x is None:
            continue
        if e.op == "permute":
            values[out] = np.array(np.transpose(x, e.attr("dims")), order="C", copy=True)
        elif e.op == "expand":
            staged = [1] * out.ndim
            for i, d in enumerate(e.attr("broadcast_dims")):
                staged[d] = x.shape[i]
            values[out] = np.ascontiguousarray(np.broadcast_to(x.reshape(staged),
                                                               sizes.shape(out)))
        else:
            values[out] = x.reshape(sizes.shape(out))


def _chained(fd: FusionDefinition, inputs: list) -> list[np.ndarray]:
    """`fd` run as the executor runs its segments, each on the oracle (a segment that runs as
    segments of its own, chained in turn), the layout ops made between them."""
    segmentation = _segments(fd)
    lowered = segmentation.lowered
    sizes = bind_shapes(lowered, [np.shape(x) for x in inputs])
    values = dict(zip(lowered.inputs, inputs, strict=True))
    _layouts_on_host(segmentation.layouts, values, sizes)
    for s in segmentation.segments:
        arguments = s.arguments(values)
        outs = (evaluate(s.definition.fusion, arguments) if _segments(s.definition) is None
                else _chained(s.definition, arguments))
        values.update(zip(s.outputs, outs, strict=True))
        _layouts_on_host(segmentation.layouts, values, sizes)
    return _unshared(lowered, values)


def test_the_oracle_permutes_and_reshapes_as_numpy():
    fd = _fd("flatten_then_transpose")
    x, w = _inputs(fd, [(3, 10, 17), (17,)])
    sums, t = evaluate(fd.fusion, [x, w])
    expected = (x.astype(np.float64).reshape(30, 17) * w).T
    np.testing.assert_allclose(t, expected, rtol=1e-6)
    np.testing.assert_allclose(sums, expected.sum(axis=1), rtol=1e-6)
    (y,) = evaluate(_fd("group_norm").fusion, [x8 := _inputs(_fd("group_norm"), [(5, 8, 16)])[0]])
    rows = x8.astype(np.float64).reshape(-1, 64)
    normed = (rows - rows.mean(1, keepdims=True)) / np.sqrt(rows.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, normed.reshape(5, 8, 16), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
def test_segments_chained_on_the_oracle_equal_the_whole_fusion(name):
    fd = _fd(name)
    with pytest.raises(UnsupportedFusionError, match="moves elements to other positions"):
        analyze(fd.fusion)
    segmentation = _segments(fd)
    assert len(segmentation.segments) == CASES[name][1], segmentation
    assert "between kernels" in str(segmentation)
    for s in segmentation.segments:
        assert not any(e.op in ("permute", "reshape") for e in s.definition.fusion.exprs)
    assert_chained_matches_the_oracle(fd, _inputs(fd, CASES[name][2]), atol=1e-6)


def assert_chained_matches_the_oracle(fd: FusionDefinition, inputs: list, atol: float) -> None:
    """_chained(fd) equals the oracle of the whole fusion, output by output."""
    for got, want, o in zip(_chained(fd, inputs), evaluate(fd.fusion, inputs),
                            fd.fusion.outputs, strict=True):
        assert got.shape == want.shape, o
        rtol = 2.0 ** -8 if o.dtype is BF16 else 1e-6
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=o.name)


def assert_each_segment_compiles_without_spills(segments) -> None:
    """Every kernel of each segment (of each of its own segments, where it has some) built
    for the H200 at 4096 x 1024 with no spill."""
    for s in segments:
        if (own := _segments(s.definition)) is not None:
            assert_each_segment_compiles_without_spills(own.segments)
            continue
        built = build(s.definition.name, analyze(s.definition.fusion), Problem(4096, 1024, 16),
                      H200)
        for entry, _plan in built.plans():
            assert not built.compiled.resource(entry).spills, entry


@pytest.mark.parametrize("name", list(CASES))
def test_every_segment_compiles_without_spills(name):
    assert_each_segment_compiles_without_spills(_segments(_fd(name)).segments)


def test_no_output_shares_memory_with_an_input_or_another_output():
    """Reshapes are views: of an input, of another output, or two of one value, each comes
    back as a copy; a permute is always new memory (even when the order does not change)."""
    with FusionDefinition("views") as fd:
        a = fd.define_tensor([-1, -1])
        s = fd.ops.exp(fd.ops.sub(a, fd.ops.sum(a, [1], keepdim=True)))
        fd.add_output(fd.ops.reshape(s, [-1]))
        fd.add_output(s)
        fd.add_output(fd.ops.reshape(s, [a.size(1), a.size(0)]))
        fd.add_output(fd.ops.reshape(a, [-1]))
        fd.add_output(fd.ops.permute(a, [0, 1]))
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    outs = _chained(fd, [x])
    for got, want in zip(outs, evaluate(fd.fusion, [x]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    arrays = [x, *outs]
    assert not any(np.shares_memory(p, q) for i, p in enumerate(arrays) for q in arrays[i + 1:])


def test_an_outer_normalization_between_views_is_one_column_kernel():
    """Cut only at the layout ops first (segment.stages' "layouts"): the segment between the
    input's reshape and the output's is one outer normalization in groups, where cutting at
    its reductions over the rows made three segments (column maxima, sums, the quotients)."""
    segments = _segments(_fd("softmax_over_a_middle_axis_reshaped"))
    (only,) = segments.segments
    info = analyze(only.definition.fusion)
    assert info.kind is Kind.OUTER_NORM and info.group_axes == 1
    assert [e.op for e in segments.layouts] == ["reshape", "reshape"]


def test_an_op_on_an_output_layout_stays_after_it():
    """p = permute(s) is an output and neg(p) another: neg stays after the permute (moved
    before it, s would be permuted twice)."""
    with FusionDefinition("kept") as fd:
        x = fd.define_tensor([-1, -1])
        p = fd.ops.permute(fd.ops.sub(x, fd.ops.sum(x, [1], keepdim=True)), [1, 0])
        fd.add_output(p)
        fd.add_output(fd.ops.neg(p))
    assert [e.op for e in _segments(fd).layouts] == ["permute"]


def test_a_narrow_value_is_written_in_float_for_a_layout_op():
    segmentation = _segments(_fd("narrow_product_transposed"))
    first, second = segmentation.segments
    assert [v.dtype for v in first.outputs] == [F]
    assert [v.dtype for v in second.definition.fusion.inputs] == [F]


def test_repr_rebuilds_permute_and_reshape():
    fd = _fd("flatten_then_transpose")
    text = repr(fd)
    assert "fd.ops.reshape(T0, new_shape=[-1, S2])" in text
    assert "fd.ops.permute(T4, dims=[1, 0])" in text
    assert repr(FusionDefinition.from_python(text)) == text


@pytest.mark.parametrize(("call", "match"), [
    (lambda fd, x: fd.ops.permute(x, [0, 0, 1]), r"a permutation of \[0, 1, 2\]"),
    (lambda fd, x: fd.ops.permute(x, [0, 1]), r"a permutation of \[0, 1, 2\]"),
    (lambda fd, x: fd.ops.permute(x, [0, 1, 3]), "out of range"),
    (lambda fd, x: fd.ops.reshape(x, [-1, -1]), "at most one size may be -1"),
    (lambda fd, x: fd.ops.reshape(x, [2.5, -1]), r"new_shape\[0\] = 2.5"),
    (lambda fd, x: fd.ops.reshape(x, [0, -1]), r"shape\[0\] = 0 is not a valid size"),
    (lambda fd, x: fd.ops.reshape(x, "ab"), "must be a list or tuple"),
    (lambda fd, x: fd.ops.permute(fd.ops.sum(x, [0, 1, 2]), []), "no dimensions to reorder"),
])
def test_bad_layout_arguments_are_definition_errors(call, match):
    with FusionDefinition("bad") as fd:
        x = fd.define_tensor([-1, -1, -1])
        with pytest.raises(DefinitionError, match=match):
            call(fd, x)
        fd.add_output(fd.ops.neg(x))


def test_fixed_sizes_that_cannot_reshape_are_refused_at_definition():
    with FusionDefinition("bad") as fd:
        x = fd.define_tensor([4, 6])
        with pytest.raises(DefinitionError, match=r"has 24 elements, which the new shape's "
                                                  r"fixed sizes \(25 elements\) cannot hold"):
            fd.ops.reshape(x, [5, 5])
        with pytest.raises(DefinitionError, match=r"\(5 elements and one more size\)"):
            fd.ops.reshape(x, [-1, 5])
        fd.add_output(fd.ops.reshape(x, [3, 8]))


def test_element_counts_are_checked_with_the_input_shapes():
    """bind_shapes (every run's first check) infers the -1 and refuses counts that cannot
    agree, naming the shapes, before any kernel runs."""
    fd = _fd("group_norm")
    sizes = bind_shapes(fd.fusion, [(5, 8, 16)])
    reshaped = fd.fusion.exprs[0].outputs[0]
    assert sizes.shape(reshaped) == (10, 64)
    with FusionDefinition("odd") as odd:
        x = odd.define_tensor([-1, -1])
        odd.add_output(odd.ops.mul(odd.ops.reshape(x, [-1, 64]), 2.0))
    with pytest.raises(BadInputError, match=r"shape \(3, 10\), 30 elements, which cannot take "
                                            r"the shape \[-1, 64\]"):
        bind_shapes(odd.fusion, [(3, 10)])
    with pytest.raises(BadInputError, match=r"is a numpy\.ndarray; fuser runs on CuPy arrays"):
        execute(odd, [np.zeros((3, 10), np.float32)])  # checked before any layout op runs


def test_explain_shows_the_layouts_between_segments():
    import fuser

    fd = _fd("flatten_then_transpose")
    report = str(fuser.explain(fd, [(8, 128, 4096), (4096,)], [BF16, F]))
    assert "T3 = reshape(T0, [-1, S2]): a view of the same bytes" in report
    assert "T5 = permute(T4, [1, 0]): a contiguous copy in the new order" in report
    assert "[4096 x 1024]" in report  # the second segment's rows are the columns
    assert "at [1024, 4096]: tiles of 32 x 32 through shared memory in 16-byte words" in report
    assert "permute_tiles_1024x4096_10_4_w16(const uint4* __restrict__ in" in report


GPU_SHAPES = {  # name -> input shapes, odd and large
    "flatten_then_transpose": [[(1, 7, 3), (3,)], [(4, 250, 4099), (4099,)]],
    "group_norm": [[(1, 8, 16)], [(1000, 8, 16)]],
    "softmax_over_columns": [[(7, 1)], [(4099, 300)], [(1000, 24578)]],
    "cast_then_transposed": [[(4099, 300)]],
    "product_of_inputs_reshaped": [[(2, 500, 4099), (2, 500, 4099)]],
    "narrow_product_transposed": [[(1, 1)], [(1000, 4099)]],
    "reshaped_input_out": [[(7, 3)]],
    "both_orientations": [[(300, 257)]],
    "narrow_after_the_move": [[(1000, 4099)]],
    "size_of_a_later_reshape": [[(1000, 4099), (1000,)]],
    "narrow_column_sums_reshaped": [[(1000, 4098)]],
    "softmax_over_a_middle_axis_reshaped": [[(3, 7, 4, 9)], [(4, 512, 8, 64)]],
    "group_norm_channels_last": [[(1, 1, 1, 32)], [(2, 7, 9, 32)], [(8, 64, 64, 32)]],
}


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "shapes"),
                         [(n, s) for n, cases in GPU_SHAPES.items() for s in cases], ids=str)
def test_layouts_match_the_oracle_on_the_gpu(name, shapes):
    import cupy

    fd = _fd(name)
    fd.validate([cupy.asarray(a) for a in _inputs(fd, shapes)])
    assert len(fd.last_schedule().segments) == CASES[name][1]


@pytest.mark.gpu
def test_element_counts_are_checked_before_a_kernel_runs():
    import cupy

    with FusionDefinition("odd") as odd:
        x = odd.define_tensor([-1, -1])
        odd.add_output(odd.ops.mul(odd.ops.reshape(x, [-1, 64]), 2.0))
    with pytest.raises(BadInputError, match="30 elements, which cannot take"):
        odd.execute([cupy.zeros((3, 10), np.float32)])


@pytest.mark.gpu
def test_torch_tensors_and_no_output_aliases_an_input():
    torch = pytest.importorskip("torch")
    fd = _fd("reshaped_input_out")
    x = torch.randn(30, 17, device="cuda")
    (y,) = fd.execute([x])
    assert y.shape == (510,) and torch.equal(y, x.reshape(-1))
    assert y.data_ptr() != x.data_ptr()
    with FusionDefinition("same_order") as same:
        a = same.define_tensor([-1, -1])
        same.add_output(same.ops.permute(a, [0, 1]))
    (z,) = same.execute([x])
    assert torch.equal(z, x) and z.data_ptr() != x.data_ptr()
    fd = _fd("softmax_over_columns")
    x = torch.randn(300, 257, device="cuda").bfloat16()
    (y,) = fd.execute([x])
    torch.testing.assert_close(y, torch.softmax(x.float(), dim=0).bfloat16())


# ----- random chains of layout ops, elementwise ops and reductions -----

STEPS = ("tanh", "scale", "half_round", "permute", "flatten_rows", "flatten_all",
         "minus_row_sums", "minus_column_sums", "plus_tanh")


@st.composite
def layout_chains(draw):
    """(input shape, steps, permutation seed): a chain the builder below turns into a fusion."""
    rank = draw(st.sampled_from((2, 3)))
    shape = tuple(draw(st.integers(2, 5)) for _ in range(rank))
    steps = draw(st.lists(st.sampled_from(STEPS), min_size=1, max_size=6))
    return shape, steps, draw(st.integers(0, 2 ** 16))


def _chain_fusion(shape, steps, seed) -> FusionDefinition:
    """Each step applied to the running tensor; sizes in reshapes are the concrete ones (or
    -1); the running tensor and the first permuted value (if any) are the outputs."""
    rng = np.random.default_rng(seed)
    with FusionDefinition("chain") as fd:
        t = fd.define_tensor([-1] * len(shape))
        dims = list(shape)
        extra = None
        for step in steps:
            if step == "tanh":
                t = fd.ops.tanh(t)
            elif step == "scale":
                t = fd.ops.mul(t, 0.5)
            elif step == "half_round":
                t = fd.ops.cast(fd.ops.cast(t, DataType.Half), F)
            elif step == "permute":
                order = [int(d) for d in rng.permutation(len(dims))]
                t, dims = fd.ops.permute(t, order), [dims[d] for d in order]
                extra = t if extra is None else extra
            elif step == "flatten_rows" and len(dims) > 2:
                t, dims = fd.ops.reshape(t, [-1, dims[-1]]), [int(np.prod(dims[:-1])), dims[-1]]
            elif step == "flatten_all" and len(dims) > 1:
                t, dims = fd.ops.reshape(t, [-1]), [int(np.prod(dims))]
            elif step == "minus_row_sums":
                t = fd.ops.sub(t, fd.ops.sum(t, [len(dims) - 1], keepdim=True))
            elif step == "minus_column_sums" and len(dims) == 2:
                t = fd.ops.sub(t, fd.ops.sum(t, [0], keepdim=True))
            elif step == "plus_tanh":
                t = fd.ops.add(t, fd.ops.tanh(t))
        fd.add_output(fd.ops.neg(t) if t is fd.fusion.inputs[0] else t)
        if extra is not None and extra is not t:
            fd.add_output(extra)
    return fd


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(chain=layout_chains())
def test_random_layout_chains_segment_to_what_the_oracle_gives(chain):
    """Every chain either runs as segments and layouts whose results, chained on the oracle,
    are the whole fusion's, or is refused with UnsupportedFusionError at definition."""
    shape, steps, seed = chain
    fd = _chain_fusion(shape, steps, seed)
    try:
        segmentation = _segments(fd)
    except UnsupportedFusionError:
        return  # a reduction no chain of kernels runs (over the rows of a 3-D tensor)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if segmentation is None:
        return  # one kernel: no layout op survived (the fusion has none)
    for got, want in zip(_chained(fd, [x]), evaluate(fd.fusion, [x]), strict=True):
        assert got.shape == want.shape
        # values between segments are stored in float32: a few of its units of the largest
        # value, where later subtractions cancel
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (1 + np.abs(want).max()))
