"""fuser's permute kernel (fuser/permute.py): merged axes, both forms' index arithmetic (run on
the CPU from the plan's numbers), compiled sources, and on the GPU the copies themselves
against the array libraries' own, over random shapes, orders and element sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser import permute
from fuser.compile import compile_cuda, template_dir

LIMIT = 232448


@st.composite
def permutes(draw, max_rank=5):
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.sampled_from([1, 1, 2, 3, 5, 8, 16, 33, 40]),
                                min_size=rank, max_size=rank)))
    if math.prod(shape) > 4000:  # the CPU emulation visits every element
        shape = tuple(min(s, 5) if s not in (8, 16) else s for s in shape)
        if math.prod(shape) > 4000:
            shape = tuple(min(s, 5) for s in shape)
    dims = tuple(draw(st.permutations(range(rank))))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    align = draw(st.sampled_from([1, 2, 4, 8, 16]))
    return shape, dims, itemsize, max(align, itemsize)


def emulated(p: permute.PermutePlan, flat: np.ndarray) -> np.ndarray:
    """What the kernel computes, index by index, from the plan's numbers (the template's
    arithmetic in Python): the output, flat."""
    out = np.full(p.total, -1, dtype=np.int64)
    if p.form == "runs":
        run_words = p.run // p.vector
        words = flat.reshape(-1, p.vector)
        out_words = out.reshape(-1, p.vector)
        for idx in range(p.total // p.vector):
            run, src = divmod(idx, run_words)
            for axis in reversed(p.dims[:-1]):
                run, coordinate = divmod(run, p.shape[axis])
                src += coordinate * p.strides[axis] // p.vector
            out_words[idx] = words[src]
        return out
    a, b = p.dims[-1], len(p.shape) - 1
    along_a, along_b, tiles = p.tiles
    for t in range(tiles):
        b0, a0 = (t % along_b) * p.tile, ((t // along_b) % along_a) * p.tile
        batch, src, dst = t // (along_b * along_a), 0, 0
        for axis in reversed(range(len(p.shape))):
            if axis in (a, b):
                continue
            batch, coordinate = divmod(batch, p.shape[axis])
            src += coordinate * p.strides[axis]
            dst += coordinate * p.out_strides[axis]
        if p.wide:
            _wide_tile(p, flat, out, (a0, b0), (src, dst))
            continue
        for i in range(permute.TILE):
            for j in range(permute.TILE):
                if a0 + i < p.shape[a] and b0 + j < p.shape[b]:
                    out[dst + (b0 + j) * p.out_strides[b] + a0 + i] = \
                        flat[src + (a0 + i) * p.strides[a] + b0 + j]
    return out


def _wide_tile(p: permute.PermutePlan, flat, out, corner, offsets) -> None:
    """One tile of 16-byte words as the template moves it, thread by thread: each staged
    4-byte word a tuple of `pack` elements, at its swizzled column."""
    (a0, b0), (src, dst) = corner, offsets
    a_extent, b_extent = p.shape[p.dims[-1]], p.shape[-1]
    a_stride, b_out_stride = p.strides[p.dims[-1]], p.out_strides[-1]
    v, lanes = p.vector, permute.WIDE_LANES
    tile: dict[tuple[int, int], tuple] = {}
    for thread in range(permute.WIDE_THREADS):
        lane, group = thread % lanes, thread // lanes
        a = a0 + group * p.pack
        if a < a_extent and b0 + lane * v < b_extent:
            rows = [flat[src + (a + q) * a_stride + b0 + lane * v:][:v] for q in range(p.pack)]
            for k in range(v):
                tile[lane * v + k, group ^ (lane << 2)] = tuple(row[k] for row in rows)
    for thread in range(permute.WIDE_THREADS):
        lane = thread % lanes
        for i in range(p.tile * lanes // permute.WIDE_THREADS):
            r = thread // lanes + i * (permute.WIDE_THREADS // lanes)
            if b0 + r < b_extent and a0 + lane * v < a_extent:
                word = lane ^ (r // v)
                elements = [e for c in range(4) for e in tile[r, word * 4 + c]]
                start = dst + (b0 + r) * b_out_stride + a0 + lane * v
                out[start:start + v] = elements


@settings(max_examples=150, deadline=None)
@given(permutes())
def test_the_plans_arithmetic_moves_every_element_where_numpy_puts_it(case):
    shape, dims, itemsize, align = case
    p = permute.plan(shape, dims, itemsize, align)
    x = np.arange(math.prod(shape), dtype=np.int64)
    expected = np.ascontiguousarray(x.reshape(shape).transpose(dims)).ravel()
    merged = np.ascontiguousarray(x.reshape(p.shape).transpose(p.dims)).ravel()
    np.testing.assert_array_equal(merged, expected)
    np.testing.assert_array_equal(emulated(p, x), expected)


@pytest.mark.parametrize(("shape", "dims", "merged"), [
    ((8, 1024, 4096), (0, 2, 1), ((8, 1024, 4096), (0, 2, 1))),
    ((32, 64, 56, 56), (1, 0, 2, 3), ((32, 64, 3136), (1, 0, 2))),
    ((2, 3, 4), (0, 1, 2), ((24,), (0,))),
    ((4, 1, 3), (2, 1, 0), ((4, 3), (1, 0))),
    ((1, 1), (1, 0), ((1,), (0,))),
    ((2, 3, 4, 5), (2, 3, 0, 1), ((6, 20), (1, 0))),
])
def test_axes_that_stay_neighbours_merge_and_extents_of_one_drop(shape, dims, merged):
    p = permute.plan(shape, dims, 2, 16)
    assert (p.shape, p.dims) == merged


@pytest.mark.parametrize(("run", "itemsize", "align", "vector"), [
    (3136, 2, 16, 8), (3136, 2, 4, 2), (3136, 4, 16, 4), (6, 2, 16, 2), (7, 2, 16, 1),
    (4096, 1, 16, 16), (4096, 8, 16, 2), (4096, 8, 8, 1),
])
def test_a_runs_word_is_the_widest_the_run_and_the_inputs_address_allow(run, itemsize, align,
                                                                       vector):
    p = permute.plan((5, 3, run), (1, 0, 2), itemsize, align)
    assert p.form == "runs"
    assert p.vector == vector


@pytest.mark.parametrize(("shape", "itemsize", "align", "vector"), [
    ((1024, 4096), 2, 16, 8), ((1024, 4096), 4, 16, 4), ((1024, 4096), 1, 16, 16),
    ((1000, 4096), 2, 16, 8), ((1024, 4096), 2, 8, 2), ((1004, 4096), 2, 16, 2),
    ((1024, 4098), 4, 16, 1), ((1024, 4096), 2, 2, 1), ((1023, 4096), 2, 16, 1),
    ((1024, 4095), 2, 16, 1), ((1024, 4096), 8, 16, 1), ((1024, 4096), 1, 8, 1),
])
def test_tiles_move_16_byte_words_else_2_byte_pairs_where_extents_and_address_allow(
        shape, itemsize, align, vector):
    p = permute.plan(shape, (1, 0), itemsize, align)
    assert p.form == "tiles"
    assert p.vector == vector
    assert p.wide == (vector * itemsize == 16)
    source = permute.render(p, LIMIT)
    assert ("const uint4* __restrict__ in" in source) == p.wide
    assert ("in_words" in source) == (vector == 2)
    assert p.smem(LIMIT).buffers[0].nbytes == (p.tile * 128 if p.wide else 64 * 65 * p.staged_bytes)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize(("shape", "dims"), [
    ((8, 1024, 4096), (0, 2, 1)), ((32, 64, 56, 56), (1, 0, 2, 3)),
    ((2, 3, 4, 5), (3, 2, 1, 0)), ((70000, 40000), (1, 0)), ((3,), (0,)),
])
def test_every_form_compiles_without_spills_or_static_shared_memory(shape, dims, itemsize):
    p = permute.plan(shape, dims, itemsize, 16)
    source = permute.render(p, LIMIT)
    assert source == permute.render(p, LIMIT)
    compiled = compile_cuda(source, permute.entry_name(p), 90, (str(template_dir()),))
    (resources,) = compiled.resources
    assert not resources.spills
    assert resources.static_smem == 0
    assert ("constexpr long long" in source) == (p.total >= 2**30)
    assert p.smem(LIMIT).fits


def test_an_array_off_its_element_size_is_refused_on_the_host(monkeypatch):
    """A CuPy array can start at any byte (memory pointer arithmetic); the permute kernel
    loads whole elements, so such an array is refused before any launch, with the address."""
    import contextlib
    from types import SimpleNamespace

    from fuser import BadInputError
    from fuser.moves import permuted

    class Misaligned:  # what permuted reads of a CuPy array
        shape, itemsize, device = (4, 6), 2, contextlib.nullcontext()
        data = SimpleNamespace(ptr=0x1001, device_id=0)

    monkeypatch.setattr("fuser.moves.cupy_module", lambda: SimpleNamespace(
        ascontiguousarray=lambda a: a, empty=pytest.fail))
    with pytest.raises(BadInputError, match="starts at address 0x1001, not a multiple of its "
                                            "element size"):
        permuted(Misaligned(), (1, 0))


# ----- on the GPU -----

DTYPES = ["bool", "uint8", "float16", "bfloat16", "float32", "float64", "int64"]


def _torch_array(shape, dtype: str, seed: int):
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype == "bool":
        return torch.rand(shape, generator=g, device="cuda") < 0.5
    if dtype in ("uint8", "int64"):
        return torch.randint(0, 100, shape, generator=g, device="cuda",
                             dtype=getattr(torch, dtype))
    return torch.randn(shape, generator=g, device="cuda", dtype=getattr(torch, dtype))


@pytest.mark.gpu
@settings(max_examples=60, deadline=None)
@given(permutes(max_rank=4), st.sampled_from(DTYPES), st.integers(0, 2**31))
def test_random_permutes_equal_torchs_bit_for_bit(case, dtype, seed):
    from fuser.moves import permuted

    shape, dims, _, _ = case
    x = _torch_array(shape, dtype, seed)
    got = permuted(x, dims)
    assert got.shape == x.permute(dims).shape and got.is_contiguous()
    assert got.dtype == x.dtype
    assert bool((got == x.permute(dims)).all()) or x.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "bool"])
@pytest.mark.parametrize(("shape", "dims"), [
    ((8, 1024, 4096), (0, 2, 1)), ((32, 64, 56, 56), (1, 0, 2, 3)),
    ((3, 7, 24578), (2, 0, 1)), ((1000, 4099), (1, 0)), ((2, 65537, 3), (1, 2, 0)),
    ((5, 0, 3), (2, 1, 0)),
])
def test_large_and_odd_permutes_equal_torchs(shape, dims, dtype):
    from fuser.moves import permuted

    x = _torch_array(shape, dtype, 7)
    got = permuted(x, dims)
    assert got.shape == x.permute(dims).shape
    assert bool((got == x.permute(dims)).all()) or x.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [1, 2, 3, 4])
def test_an_input_at_an_odd_address_copies_in_narrower_words(offset):
    """A view at an element offset: the words shrink to the address' alignment."""
    from fuser.moves import permuted

    torch = pytest.importorskip("torch")
    base = _torch_array((6 * 5 * 64 + offset,), "bfloat16", 3)
    x = base[offset:].view(6, 5, 64)
    for dims in [(1, 0, 2), (2, 1, 0)]:  # runs, then tiles (pairs only at an even offset)
        got = permuted(x, dims)
        assert bool((got == x.permute(dims)).all())
        assert got.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float64", "bool"])
def test_cupy_arrays_permute_on_their_own_device(dtype):
    cupy = pytest.importorskip("cupy")
    from fuser.moves import permuted

    rng = np.random.default_rng(5)
    host = rng.standard_normal((4, 33, 70)) > 0 if dtype == "bool" else \
        rng.standard_normal((4, 33, 70)).astype(dtype)
    x = cupy.asarray(host)
    for dims in [(2, 1, 0), (1, 0, 2), (0, 2, 1)]:
        got = permuted(x, dims)
        assert isinstance(got, cupy.ndarray) and got.flags.c_contiguous
        np.testing.assert_array_equal(cupy.asnumpy(got), host.transpose(dims))


def test_the_permute_bench_names_its_cases_and_tables_a_report():
    from bench import permute as bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--case", "nope"])
    assert bench.parse_args(["--case", "transpose_bf16"]).case == ["transpose_bf16"]
    entry = {"case": "transpose_bf16", "shape": "4x8", "dims": [1, 0], "dtype": "bfloat16",
             "plan": "tiles", "impls": {"copy": {"gbps": 100.0},
                                        "fuser": {"gbps": 50.0, "fraction_of_copy": 0.5,
                                                  "correct": True},
                                        "torch": {"error": "boom"}}}
    table = bench.markdown({"results": [entry, {"case": "x", "error": "e"}]})
    assert "| transpose_bf16 | 4x8 -> [1, 0] | bfloat16 | tiles | 100 | 50 (0.50) | boom |" in table
    assert "| x | error: e |" in table
