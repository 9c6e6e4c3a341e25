"""CPU: every ready fusion, rendered and compiled offline with NVRTC for sm_90, at the hidden
sizes the GPU tests run: zero spills, and the static shared memory ptxas reports fits the
128-byte slot every plan reserves."""

from __future__ import annotations

import re

import pytest

from fuser import DataType
from fuser.analysis import Role, analyze
from fuser.device import DeviceSpec
from fuser.fusions import ACTIVATIONS, COLUMN_FUSIONS, FUSIONS, ROW_FUSIONS
from fuser.kernels import build
from fuser.schedulers import Problem, schedule

H200 = DeviceSpec.get("h200")
DTYPES = [DataType.Float, DataType.Half, DataType.BFloat16]


def compile_and_check(name: str, dtype: DataType, hidden: int, rows: int = 16384, fd=None):
    fd = fd or FUSIONS[name](dtype)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, rows, 16), H200)
    for entry, plan in built.plans():
        r = built.compiled.resource(entry)
        assert not r.spills, f"{entry} spills: {r}\n{built.schedule}"
        assert r.static_smem <= plan.static_slot, f"{entry}: {r.static_smem} B static"
        assert plan.total <= H200.smem_per_block_optin
    return built


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 3, 127, 1024, 4096, 8192])
@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_fwd", "softmax_fwd"])
def test_forward_kernels_compile_without_spills(name, hidden, dtype):
    compile_and_check(name, dtype, hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 3, 127, 1024, 4096, 16384, 24578])
@pytest.mark.parametrize("name", ["rmsnorm_bwd", "dropout_rmsnorm_bwd", "layernorm_bwd"])
def test_backward_kernels_compile_without_spills(name, hidden, dtype):
    compile_and_check(name, dtype, hidden)


@pytest.mark.parametrize(("name", "hidden"), [("layernorm_bwd", 10240), ("rmsnorm_bwd", 32768),
                                              ("layernorm_bwd", 36864)])
def test_packed_rows_over_a_cluster_compile_without_spills(name, hidden):
    """Packed rows over a cluster first (inner_outer_persistent._packed_first_why) over 2, 4
    and 8 blocks: the first build is the one kept."""
    built = compile_and_check(name, DataType.BFloat16, hidden)
    assert "packed rows over a cluster of" in built.schedule.reason, built.schedule.reason


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 3, 127, 4096, 24578, 65537])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_compile_without_spills(name, hidden, dtype):
    compile_and_check(name, dtype, hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1, 127, 4096, 24578, 65537])
@pytest.mark.parametrize("name", sorted(COLUMN_FUSIONS))
def test_column_normalization_segments_compile_without_spills(name, hidden, dtype):
    from test_segment import _segments

    for segment in _segments(FUSIONS[name](dtype)).segments:
        compile_and_check(segment.definition.name, dtype, hidden, fd=segment.definition)


def test_rendering_is_deterministic():
    a = compile_and_check("dropout_rmsnorm_bwd", DataType.BFloat16, 4096).source.source
    b = compile_and_check("dropout_rmsnorm_bwd", DataType.BFloat16, 4096).source.source
    assert a == b


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [32768, 65537, 131072, 1048576])
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_long_rows_compile_without_spills(name, hidden, dtype):
    """Rows too long to keep on chip are re-read each pass, and column accumulators too wide
    for registers or shared memory live in the block's partial rows: every size schedules."""
    compile_and_check(name, dtype, hidden, rows=1000)


@pytest.mark.parametrize("cluster", [2, 4, 8])
@pytest.mark.parametrize(("name", "hidden"), [("dropout_rmsnorm_bwd", 24578),
                                              ("rmsnorm_bwd", 65536), ("layernorm_bwd", 32768),
                                              ("rmsnorm_fwd", 131072), ("softmax_fwd", 65537)])
def test_cluster_split_rows_compile_without_spills(name, hidden, cluster):
    """Rows split over a thread-block cluster (each block keeps 1/cluster of every row, row
    sums exchanged through distributed shared memory) compile clean and plan per block."""
    from fuser.schedulers import Hints

    fd = ROW_FUSIONS[name](DataType.BFloat16)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 16384, 16), H200,
                  Hints(cluster=cluster))
    s = built.schedule
    assert s.cluster == cluster and f"__cluster_dims__({cluster}, 1, 1)" in built.source.source
    assert s.batch * s.threads_per_row * s.vec * cluster >= hidden
    for entry, plan in built.plans():
        r = built.compiled.resource(entry)
        assert not r.spills, f"{entry}: {r}"
        assert plan.total <= H200.smem_per_block_optin


def test_finalize_lanes_hint_sets_the_finalize_block():
    """Hints(finalize_lanes=n): n threads per column sum the partial rows, 512 / n columns
    (1 to 32) per block, the smem plan holds n x columns doubles per column sum; lanes over
    the device's thread limit raises."""
    from fuser import HintError
    from fuser.schedulers import Hints

    fd = ROW_FUSIONS["layernorm_bwd"](DataType.BFloat16)
    info = analyze(fd.fusion)
    built = build(fd.name, info, Problem(2048, 16384, 16), H200, Hints(finalize_lanes=32))
    f = built.finalize
    assert (f.cols_per_block, f.partial_lanes) == (16, 32)
    assert [(b.name, b.nbytes) for b in f.smem.buffers] == [
        ("s_lanes_T38", 32 * 16 * 8), ("s_lanes_T40", 32 * 16 * 8)]
    assert "__launch_bounds__(512)" in built.source.source
    assert "constexpr int LANES = 32;" in built.source.source
    assert not built.compiled.resource(built.source.finalize_entry).spills
    with pytest.raises(HintError, match=r"finalize_lanes=2048\): allowed: 1 to 1024; the "
                       r"heuristic picks finalize_lanes=64"):
        build(fd.name, info, Problem(2048, 16384, 16), H200, Hints(finalize_lanes=2048))


@pytest.mark.parametrize(("hidden", "cols"), [(1024, 8), (2048, 8), (8192, 16), (24578, 32)])
def test_finalize_blocks_cover_every_sm_twice_where_the_columns_allow(hidden, cols):
    from fuser.schedulers.finalize import finalize_schedule

    info = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    f = finalize_schedule(info, Problem(hidden, 16384, 16), H200)
    assert (f.cols_per_block, f.partial_lanes) == (cols, 512 // cols)
    assert -(-hidden // cols) >= 2 * H200.sm_count or cols == 8


def _row_entry_ptx(ptx: str, entry: str) -> str:
    start = ptx.index(f".entry {entry}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


def _global_store_bytes(ptx: str) -> list[int]:
    """Bytes written by each st.global instruction (st.global.v4.b32 -> 16)."""
    sizes = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?st\.global(?:\.v(\d))?\.[a-z](\d+)\s", line)
        if m:
            sizes.append(int(m.group(1) or 1) * int(m.group(2)) // 8)
    return sizes


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [1024, 2048, 4096, 65536])
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_full_row_outputs_are_stored_as_whole_vectors(name, hidden, dtype):
    """In the PTX of the row kernel, every store of a full-row output is one instruction of
    the schedule's vector width. Left to itself the compiler had stored the vectors of blocks
    of several rows element by element (rmsnorm_fwd, fp32, 1024: 16 four-byte stores per row
    pass instead of 4 of 16 bytes; such kernels ran at a third of the copy bandwidth). The
    only narrower stores left are per-row values and the partial rows of column sums, one
    element per store (a row-group counter is zeroed by one 16-byte store)."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of

    fd = ROW_FUSIONS[name](dtype)
    info = analyze(fd.fusion)
    built = build(fd.name, info, Problem(hidden, 16384, 16), H200)
    s = built.schedule
    ptx = _row_entry_ptx(ptx_of(built.source.source, name, 90, (str(template_dir()),)),
                         built.source.row_entry)
    width = s.vec * dtype.itemsize
    stores = _global_store_bytes(ptx)
    assert stores.count(width) >= len(info.outputs(Role.FULL)), (stores, s)
    narrow = [b for b in stores if b < width]
    allowed = len(info.outputs(Role.ROW)) + len(info.outer_reductions) * s.vec * s.batch
    assert len(narrow) <= allowed, (stores, s)


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [4099, 24578, 65537])
@pytest.mark.parametrize("name", ["softmax_fwd", "log_softmax_fwd", "softmax_bwd"])
def test_skewed_rows_move_16_byte_vectors(name, hidden, dtype):
    """Rows whose length the 16-byte vector does not divide are skewed by default where they
    fit a block: in the PTX, the copies into shared memory and the output's stores are 16
    bytes wide, and the only narrower stores are the edges' pieces (of the row's alignment:
    skew elements each)."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of

    fd = ROW_FUSIONS[name](dtype)
    info = analyze(fd.fusion)
    built = build(fd.name, info, Problem(hidden, 16384, 16), H200)
    s = built.schedule
    if not s.skew:  # rows too long for one block are split over a cluster, not skewed
        assert hidden == 65537 and s.cluster > 1, s
        return
    assert s.vec * dtype.itemsize == 16 and hidden % s.vec, s
    ptx = _row_entry_ptx(ptx_of(built.source.source, name, 90, (str(template_dir()),)),
                         built.source.row_entry)
    _assert_skewed_stores(_global_store_bytes(ptx), s, info, dtype)
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global\S*\s+\[[^]]*\], \[[^]]*\], (\d+)", ptx)
    if any(p.storage == "smem" for p in s.placements):
        assert "16" in copies, copies


def _assert_skewed_stores(stores: list[int], s, info, dtype: DataType) -> None:
    """Each unrolled round of the output pass stores every full output as one 16-byte vector
    (the round's edge path aside), and the only narrower stores are the edges' pieces, of
    skew elements each, and the per-row outputs: a pass split into element stores would
    have no 16-byte store."""
    assert stores.count(16) >= len(info.outputs(Role.FULL)) * min(s.unroll, s.batch), stores
    per_row = {o.dtype.itemsize for o in info.outputs(Role.ROW)}
    assert set(stores) <= {16, s.skew * dtype.itemsize, *per_row}, stores


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [4099, 24578])
@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_fwd", "dropout_rmsnorm_fwd",
                                  "dropout_layernorm_fwd"])
def test_skewed_rows_with_columns_compile(name, hidden, dtype):
    """Fusions with column inputs skew their rows by default where the vectors that divide
    the row are 4 bytes or narrower (fp32 24578, 8-byte vectors, only when hinted): the
    columns are read in pieces of the row's skew from global memory, and the kernel builds
    without spilling."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of
    from fuser.schedulers import Hints

    fd = ROW_FUSIONS[name](dtype)
    info = analyze(fd.fusion)
    problem = Problem(hidden, 16384, 16)
    hinted = dtype is DataType.Float and hidden == 24578
    if hinted:
        assert not schedule(info, problem, H200).skew
    built = build(fd.name, info, problem, H200, Hints(skewed=True) if hinted else None)
    s = built.schedule
    assert s.skew and all(p.storage == "global" for p in s.placements if p.role is Role.COL), s
    resource = built.compiled.resource(built.source.row_entry)
    assert resource.spill_stores == 0, resource
    ptx = _row_entry_ptx(ptx_of(built.source.source, name, 90, (str(template_dir()),)),
                         built.source.row_entry)
    _assert_skewed_stores(_global_store_bytes(ptx), s, info, dtype)


@pytest.mark.parametrize(("name", "hidden", "dtype", "dealing"), [
    ("layernorm_fwd", 8192, DataType.BFloat16, None),
    ("rmsnorm_fwd", 65536, DataType.BFloat16, None),
    ("dropout_rmsnorm_fwd", 32768, DataType.BFloat16, None),
    # defaults dealt a block per row group over a cluster of two; a counter as hinted
    ("softmax_fwd", 65536, DataType.BFloat16, "dynamic"),
    ("softmax_bwd", 32768, DataType.BFloat16, "dynamic"),
])
def test_a_refill_follows_the_read_of_the_place_it_copies_into(name, hidden, dtype, dealing):
    """A refilled row's last pass copies the next row's vector into a shared place it has just
    read: in the PTX, each such cp.async names as operands the words one earlier ld.shared
    loaded, all of them (the vector's bytes), so the compiler cannot have moved the read after
    the copy, or split it so that part of it comes later."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of
    from fuser.schedulers import Hints

    fd = ROW_FUSIONS[name](dtype)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 16384, 16), H200,
                  Hints(dealing=dealing) if dealing else None)
    assert "refill(" in built.source.source, built.schedule
    ptx = _row_entry_ptx(ptx_of(built.source.source, name, 90, (str(template_dir()),)),
                         built.source.row_entry)
    loads = {}  # register -> (the load's width in words, its line)
    refills = 0
    for number, line in enumerate(ptx.splitlines()):
        loaded = re.search(r"ld\.shared\.v(\d)\.u32\s+\{([^}]*)\}", line)
        if loaded:
            for register in loaded.group(2).split(", "):
                loads[register] = (int(loaded.group(1)), number)
        copy = re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], .* // after (.*)$", line)
        if copy:
            refills += 1
            read = [loads.get(w) for w in copy.group(1).split()]
            assert all(r is not None for r in read), (line, read)
            assert len(set(read)) == 1 and read[0][0] == len(read) == 4, (line, read)
    assert refills >= built.schedule.unroll, ptx[-3000:]  # the unrolled rounds of the last pass


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("hidden", [4098, 24577, 24578, 24580])
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_aligned_copy_kernels_compile_with_16_byte_copies_only(name, hidden, dtype):
    """Hints(aligned_copy=True): refused where vectors are already 16 bytes wide; elsewhere
    no spills, and the row kernel's cp.async move 16 bytes with a source size (a row's last
    chunk reads only up to the row's end), except the tensor's last row's last chunk, copied
    in an 8- and a 4-byte cp.async (copy_tail): a pair beside each 16-byte one."""
    from fuser import HintError
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of
    from fuser.schedulers import Hints
    from fuser.schedulers.base import pick_vec

    fd = ROW_FUSIONS[name](dtype)
    info = analyze(fd.fusion)
    if pick_vec(hidden, [dtype.itemsize], 16, input_bytes=dtype.itemsize) * dtype.itemsize == 16:
        with pytest.raises(HintError, match=r"aligned_copy=True.*narrower than 16 bytes"):
            build(fd.name, info, Problem(hidden, 16384, 16), H200, Hints(aligned_copy=True))
        return
    built = build(fd.name, info, Problem(hidden, 16384, 16), H200, Hints(aligned_copy=True))
    for entry, _ in built.plans():
        assert not built.compiled.resource(entry).spills, entry
    assert built.schedule.aligned_copy
    ptx = _row_entry_ptx(ptx_of(built.source.source, name, 90, (str(template_dir()),)),
                         built.source.row_entry)
    copies = re.findall(r"cp\.async\.(\w+)\.shared\.global \[[^\]]+\], \[[^\]]+\], (\d+)(, %r\d+)?",
                        ptx)
    assert copies, ptx[:2000]
    chunks = [c for c in copies if c[:2] == ("cg", "16") and c[2]]
    tails = [c[:2] for c in copies if c not in chunks]
    assert chunks and sorted(tails) == sorted([("ca", "8"), ("ca", "4")] * len(chunks)), copies
    # wait_group only waits for committed groups: copies never committed would be read early.
    assert "cp.async.commit_group" in ptx
    assert ptx.index("cp.async.commit_group") < ptx.index("cp.async.wait_group")


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=lambda d: d.name)
def test_softmax_divides_once_per_row_and_exponentiates_on_the_sfu(dtype):
    """softmax_fwd's row kernel divides once per row (the reciprocal of the row's sum; every
    element is multiplied by it) and takes each exp as one ex2.approx, once per element: the
    sum's pass keeps exp(x - max) in registers for the output's pass (RowSchedule.kept). The
    expf and div.rn sequences it had made the kernel compute-bound at 0.5 of the copy
    bandwidth."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of

    fd = ROW_FUSIONS["softmax_fwd"](dtype)
    built = build(fd.name, analyze(fd.fusion), Problem(4096, 16384, 16), H200)
    ptx = _row_entry_ptx(ptx_of(built.source.source, "softmax_fwd", 90,
                                (str(template_dir()),)), built.source.row_entry)
    s = built.schedule
    assert len(re.findall(r"\b(?:div|rcp)\.rn\.f32\b", ptx)) == 1  # 1 / sum, per row
    exps = len(re.findall(r"\bex2\.approx\.ftz\.f32\b", ptx))
    assert s.kept and exps == s.batch * s.vec, (exps, s)  # the sum's pass only
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) < s.batch * s.vec  # no expf reductions


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half], ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_a_16_bit_output_is_rounded_once_per_element(name, dtype):
    """The row kernel's PTX converts each element of a bf16 or fp16 full-row output to its
    storage type once: the cast that makes the output is not rounded as a value first
    (emit.Emitter.emit_stored), which had been an extra F2F per element on the pipe that
    softmax's ex2 uses (softmax_fwd 32768: 639 -> 543 us on the H200)."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of

    fd = ROW_FUSIONS[name](dtype)
    info = analyze(fd.fusion)
    built = build(fd.name, info, Problem(4096, 16384, 16), H200)
    s = built.schedule
    ptx = _row_entry_ptx(ptx_of(built.source.source, name, 90, (str(template_dir()),)),
                         built.source.row_entry)
    suffix = "bf16" if dtype is DataType.BFloat16 else "f16"
    conversions = len(re.findall(rf"\bcvt\.rn\.{suffix}\.f32\b", ptx))
    outputs = [o for o in info.outputs(Role.FULL) if o.dtype is dtype]
    rounded_values = [v for v in info.fusion.vals if v.definition is not None
                      and v.definition.op == "cast" and v.dtype is dtype
                      and v not in outputs and info.roles.get(v) is Role.FULL]
    assert conversions == (len(outputs) + len(rounded_values)) * s.batch * s.vec, (
        conversions, [o.name for o in outputs], [v.name for v in rounded_values], s)
