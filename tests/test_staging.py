"""CPU: the staging ring of rows that no storage keeps on chip (schedulers/staging.py): its
chunks cover every row exactly, it is planned in the SmemPlan, the scheduler picks it where
rows leave the chip on each preset, and its kernels compile without spills."""

from __future__ import annotations

import pytest
from ring_cases import RING_CASES, ring_hints
from test_schedulers import assert_plan_invariants

from fuser import DataType, HintError
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.kernels import build
from fuser.schedulers import Hints, Problem, schedule
from fuser.schedulers.base import Fill, Storage
from fuser.schedulers.inner_outer_persistent import POLICY as SMEM_FIRST
from fuser.schedulers.row_geometry import row_split
from fuser.schedulers.staging import MBARRIER_BYTES, RING_BYTES, plan_ring
from fuser.smem import align

H200 = DeviceSpec.get("h200")


def _check_cover(ring, hidden: int, cluster: int, itemsizes: dict[str, int],
                 slot_bytes: dict[str, int]) -> None:
    """Each block's chunks tile its share of the row from its first element to its last, in
    order, none larger than a slot; bulk copies start and end on 16-byte boundaries of every
    row (rows then start on one: hidden x itemsize is a multiple of 16)."""
    vectors = hidden // ring.vec
    part = ring.part_vectors
    for k in range(cluster):
        share = min(part, max(0, vectors - k * part))
        covered = 0
        for start, elements in ring.spans(share):
            if elements == 0:
                assert start >= share * ring.vec  # only past a short part's end
                continue
            assert start == covered and elements <= ring.chunk_elements
            covered += elements
            for name, size in itemsizes.items():
                assert elements * size <= slot_bytes[name]
                if ring.fill == Fill.BULK:
                    assert (k * part * ring.vec + start) * size % 16 == 0
                    assert elements * size % 16 == 0 and hidden * size % 16 == 0
        assert covered == share * ring.vec


@pytest.mark.parametrize(("cluster", "arch"), [(1, 90), (8, 90), (1, 80)])
def test_ring_chunks_cover_every_row_exactly_and_fit_their_slots(cluster, arch):
    """For every hidden size from 1 to 200000 (a bf16 and a bool row buffer, as in dropout +
    RMSNorm backward): the ring's chunks cover each block's share of the row exactly, the tail
    chunk holds what is left, every chunk fits its slot, and bulk copies are 16-byte aligned
    and sized. sm_80 has no bulk copies: its rings are filled by cp.async."""
    itemsizes = {"T0": 2, "T2": 1}
    for hidden in range(1, 200001):
        vec, tpr, batch = row_split(hidden, [2, 2, 1], 16, SMEM_FIRST, H200, parts=cluster,
                                    input_bytes=3)
        if hidden // vec < cluster:
            continue
        planned = plan_ring(list(itemsizes.items()), hidden, vec, tpr, batch, cluster, 2, 16,
                            arch, 200 * 1024)
        if planned is None:  # neither bulk-aligned nor 4-byte vectors: plain loads
            assert arch < 90 or hidden * 2 % 16 or hidden % 16
            assert vec * 2 < 4
            continue
        ring, requests = planned
        if arch < 90:
            assert ring.fill == Fill.ASYNC
        elif cluster == 1 and hidden % 16 == 0:
            assert ring.fill == Fill.BULK  # aligned rows: the bulk copy engine (_check_cover)
        assert ring.chunks * ring.units == batch and ring.chunk_vectors == ring.units * tpr
        assert ring.part_vectors == -(-(hidden // vec) // cluster)
        assert 0 < ring.tail_elements <= ring.chunk_elements
        slots = {n: b // ring.depth for n, b, _ in requests if n != "s_ring_full"}
        members = {n: itemsizes[n] for n in ring.tensors}
        _check_cover(ring, hidden, cluster, members, {n: slots[f"s_ring_{n}"] for n in members})


def test_ring_is_planned_in_the_smem_plan_and_shown():
    """rmsnorm_bwd, bf16, hidden 1048576 on the H200: more than a cluster of 8 keeps on chip.
    Both row buffers go through a bulk-filled ring of 4 slots; its buffers and its mbarriers
    are planned, 128-byte aligned, and the schedule's repr and reason say so."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(1048576, 1000, 16), H200)
    ring = s.ring
    assert s.cluster == 8 and ring is not None and ring.fill == Fill.BULK
    assert ring.tensors == ("T0", "T2") and ring.depth == 4 and ring.passes == 2
    assert {p.tensor: p.storage for p in s.placements}["T0"] == Storage.RING
    chunk_bytes = ring.chunk_elements * 2
    for name in ring.tensors:
        assert s.smem.buffer(f"s_ring_{name}").nbytes == ring.depth * align(chunk_bytes)
    assert s.smem.buffer("s_ring_full").nbytes == ring.depth * MBARRIER_BYTES
    assert ring.depth * 2 * align(chunk_bytes) <= RING_BYTES
    assert_plan_invariants(s.smem)
    assert "through a staging ring (cp.async.bulk, 4 slots x" in s.reason
    assert "ring               T0, T2 by cp.async.bulk: 4 slots, 16 chunk(s) of 8192 " in str(s)
    assert "tail 8192" in s.smem.buffer("s_ring_T0").purpose


@pytest.mark.parametrize(
    ("device", "hidden", "fill"),
    [("h200", 1048576, Fill.BULK), ("h100", 1048576, Fill.BULK), ("a100", 65536, Fill.ASYNC),
     ("sm89-100kb", 25600, Fill.ASYNC)],
)
def test_rows_that_leave_the_chip_go_through_a_ring_on_each_preset(device, hidden, fill):
    """rmsnorm_bwd, bf16: the first sizes past what each preset keeps on chip (a cluster of 8
    on sm_90; one block elsewhere, the 100 KB part first) re-read their rows through a ring,
    filled by the bulk copy engine on sm_90 and by cp.async before."""
    info = analyze(FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), DeviceSpec.get(device))
    assert s.ring is not None and s.ring.fill == fill, s.reason
    assert all(s.placement(n).storage == Storage.RING for n in s.ring.tensors)
    assert_plan_invariants(s.smem)


def test_misaligned_pointers_or_rows_fill_the_ring_by_cp_async_or_not_at_all():
    """Bulk copies need 16-byte aligned pointers and rows; otherwise cp.async fills the ring,
    and buffers whose vectors are narrower than 4 bytes (the bool mask at 24578) are re-read
    by plain loads."""
    info = analyze(FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16).fusion)
    ring_all = Hints(storage=(("T0", Storage.RING), ("T1", Storage.RING), ("T4", Storage.RING),
                              ("T5", Storage.SMEM)))
    assert schedule(info, Problem(4096, 64, 16), H200, ring_all).ring.fill == Fill.BULK
    assert schedule(info, Problem(4096, 64, 8), H200, ring_all).ring.fill == Fill.ASYNC
    s = schedule(info, Problem(24578, 64, 16), H200, ring_all)
    assert s.ring.fill == Fill.ASYNC and s.ring.tensors == ("T0", "T1", "T4")
    with pytest.raises(HintError, match=r"no staging ring for T2 \(one row per block"):
        schedule(info, Problem(24578, 64, 16), H200,
                 Hints(storage=(("T2", Storage.RING), ("T5", Storage.SMEM))))
    with pytest.raises(HintError, match="streams row inputs, not the column input T5"):
        schedule(info, Problem(4096, 64, 16), H200, Hints(storage=(("T5", Storage.RING),)))
    with pytest.raises(HintError, match="one row per block"):
        schedule(info, Problem(4096, 64, 16), H200,
                 Hints(storage=(("T0", Storage.RING), ("T5", Storage.SMEM)), rows_per_block=2))
    defaulted = schedule(info, Problem(1048576, 64, 16), H200)
    assert defaulted.ring.fill == Fill.BULK
    assert set(defaulted.ring.tensors) == {"T0", "T1", "T2", "T4"}
    plain = schedule(info, Problem(1048578, 64, 16), H200)  # rows start on 4-byte boundaries
    assert plain.ring.fill == Fill.ASYNC and "T2" not in plain.ring.tensors
    assert plain.placement("T2").storage == Storage.GLOBAL


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize(("name", "hidden", "cluster"), RING_CASES)
def test_ring_kernels_compile_without_spills(name, hidden, cluster, dtype):
    """Every fusion with its rows forced through a ring compiles with zero spills and its
    static shared memory within the slot; the ring is a bulk-filled one where planned so."""
    fd = FUSIONS[name](dtype)
    hints = ring_hints(name, dtype, hidden, cluster=cluster)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 1000, 16), H200, hints)
    ring = built.schedule.ring
    assert ring is not None and ring.fill == (Fill.BULK if hidden % 8 == 0 else Fill.ASYNC)
    for entry, plan in built.plans():
        r = built.compiled.resource(entry)
        assert not r.spills, f"{entry} spills: {r}\n{built.schedule}"
        assert r.static_smem <= plan.static_slot
    bulk = str(ring.fill is Fill.BULK).lower()
    assert f"fm::StagingRing<Part, {bulk}, {ring.depth}," in built.source.source


@pytest.mark.parametrize(("hidden", "fill"), [(4096, Fill.BULK), (24578, Fill.ASYNC)])
def test_ring_ptx_copies_with_the_planned_engine(hidden, fill):
    """The PTX of a ring kernel (rmsnorm_bwd, bf16) issues its chunks with the fill the plan
    names: cp.async.bulk completing on mbarriers that readers wait on by parity, or cp.async
    of 4-byte vectors in commit groups; never both."""
    from fuser.codegen import template_dir
    from fuser.compile import ptx_of

    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    built = build(fd.name, analyze(fd.fusion), Problem(hidden, 1000, 16), H200,
                  ring_hints("rmsnorm_bwd", DataType.BFloat16, hidden))
    assert built.schedule.ring.fill == fill
    ptx = ptx_of(built.source.source, fd.name, 90, (str(template_dir()),))
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert bulk == (fill == Fill.BULK)
    assert ("mbarrier.try_wait.parity" in ptx) == bulk
    assert ("mbarrier.arrive.expect_tx" in ptx) == bulk
    if fill == Fill.ASYNC:
        assert "cp.async.ca.shared.global" in ptx and "cp.async.wait_group 3" in ptx


def test_a_bulk_filled_ring_does_not_compile_below_sm_90():
    """The bulk copy helpers are empty below sm_90; a kernel whose ring they fill refuses to
    compile there instead of reading slots nothing filled (the scheduler never plans one)."""
    from fuser import CompileError
    from fuser.codegen import template_dir
    from fuser.compile import compile_cuda

    fd = FUSIONS["softmax_fwd"](DataType.BFloat16)
    built = build(fd.name, analyze(fd.fusion), Problem(8192, 1000, 16), H200,
                  ring_hints(fd.name, DataType.BFloat16, 8192))
    assert built.schedule.ring.fill == Fill.BULK
    with pytest.raises(CompileError, match=r"filled by cp\.async\.bulk on mbarriers, which needs"):
        compile_cuda(built.source.source, fd.name, 80, (str(template_dir()),))


@pytest.mark.parametrize(("full_output", "passes"), [(False, 1), (True, 2)])
def test_a_ring_streams_a_row_once_per_pass_that_has_work(full_output, passes):
    """Row sums alone (the first kernel of a full reduction) read each row once: no last pass
    writes full outputs, so the ring does not stream the row again (it did, doubling the
    bytes of rows past the chip). With a full output the row is streamed twice."""
    import re

    from fuser import FusionDefinition

    with FusionDefinition("row_sums") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        fd.add_output(fd.ops.sum(x, [1]))
        if full_output:
            fd.add_output(fd.ops.mul(x, 2.0))
    info = analyze(fd.fusion)
    assert info.row_passes == passes
    built = build(fd.name, info, Problem(1 << 20, 1000, 16), H200)
    ring = re.search(r"fm::StagingRing<Part, \w+, \d+, \d+, \d+, (\d+), \d+> ring",
                     built.source.source)
    assert ring is not None and int(ring.group(1)) == passes, built.schedule
    assert not built.compiled.resource(built.source.row_entry).spills
