"""Staging rings: rows re-read in every pass, streamed in chunks through shared memory.

When neither registers nor shared memory of one block (or of a cluster of 8, on sm_90) hold a
row's buffers, some are re-read from global memory in every pass over the row (and
registers-first kernels whose register plan leaves one block per SM re-read whole rows by
choice, where that measured faster: inner_persistent.ring_first). Loaded straight into
registers, each thread has only the loads of its unrolled iterations in flight; a ring of
`depth` chunk slots keeps depth - 1 chunks of the row in flight while the block works on one.
Where every chunk of every row starts on a 16-byte boundary and is a multiple of 16 bytes (and
the device is sm_90), one thread hands each chunk to the bulk copy engine (cp.async.bulk),
which completes on the slot's mbarrier; otherwise each thread copies its own vectors of the
chunk with cp.async (4, 8 or 16 bytes), and a buffer whose vectors are narrower stays
re-read by plain loads.

The ring's buffers and mbarriers are requests in the kernel's SmemPlan like every other
buffer; the chunk arithmetic is StagingRing's (schedulers/base.py).
"""

from __future__ import annotations

from fuser.schedulers.base import Fill, StagingRing, ceil_div
from fuser.smem import align

RING_DEPTHS = (4, 3, 2)  # slot counts tried, deepest first: depth - 1 chunks in flight
RING_BYTES = 128 * 1024  # the most a ring's slots take (96 KB in flight at depth 4)
MAX_UNITS = 8  # vectors per thread per chunk, at most
MBARRIER_BYTES = 8  # one mbarrier (64 bits): per bulk-filled ring slot, per cluster exchange parity
MAX_TX_BYTES = (1 << 20) - 1  # the bytes one mbarrier phase can count (PTX: tx-count range)
ASYNC_BYTES = (4, 8, 16)  # the vector widths cp.async copies


def bulk_aligned(hidden: int, vec: int, itemsize: int, chunk_vectors: int, part_vectors: int,
                 cluster: int, align_bytes: int, arch: int) -> bool:
    """Whether every chunk of every row starts on a 16-byte boundary and is a multiple of 16
    bytes long, as cp.async.bulk requires: the pointers 16-byte aligned, and rows, cluster
    parts and chunks whole multiples of 16 bytes (the tail chunk then is one too)."""
    if arch < 90 or align_bytes < 16:
        return False
    sizes = [hidden * itemsize, chunk_vectors * vec * itemsize]
    if cluster > 1:
        sizes.append(part_vectors * vec * itemsize)
    return all(n % 16 == 0 for n in sizes)


def plan_ring(tensors: list[tuple[str, int]], hidden: int, vec: int, threads_per_row: int,
              batch: int, cluster: int, passes: int, align_bytes: int, arch: int,
              budget: int) -> tuple[StagingRing, list[tuple[str, int, str]]] | None:
    """The deepest ring, then the one with the largest chunks, whose buffers fit `budget`
    bytes (and RING_BYTES), for the re-read full inputs `tensors` ((name, itemsize)); with its
    SmemPlan requests. None when no ring of two slots of one vector per thread fits, or no
    tensor can be copied into one."""
    part_vectors = ceil_div(hidden // vec, cluster)
    units_options = [u for u in range(min(batch, MAX_UNITS), 0, -1) if batch % u == 0]
    for depth in RING_DEPTHS:
        for units in units_options:
            chunk_vectors = units * threads_per_row
            bulk = all(bulk_aligned(hidden, vec, size, chunk_vectors, part_vectors, cluster,
                                    align_bytes, arch) for _, size in tensors)
            members = tensors if bulk else [(n, s) for n, s in tensors if vec * s in ASYNC_BYTES]
            if not members:  # another chunk size may be bulk-aligned
                continue
            slots = {n: align(chunk_vectors * vec * s) for n, s in members}
            barriers = align(depth * MBARRIER_BYTES) if bulk else 0
            data = depth * sum(slots.values())
            chunk_bytes = sum(chunk_vectors * vec * s for _, s in members)
            if data > RING_BYTES or data + barriers > budget or chunk_bytes > MAX_TX_BYTES:
                continue
            ring = StagingRing(
                fill=Fill.BULK if bulk else Fill.ASYNC, tensors=tuple(n for n, _ in members),
                depth=depth,
                units=units, chunk_vectors=chunk_vectors, chunks=batch // units,
                part_vectors=part_vectors, vec=vec, passes=passes)
            words = (f"{depth} slots x {ring.chunk_elements} elements, {ring.chunks} chunk(s) "
                     f"per pass, tail {ring.tail_elements}")
            requests = [(f"s_ring_{n}", depth * slots[n], f"staging ring {n}: {words}")
                        for n, _ in members]
            if bulk:
                requests.append(("s_ring_full", depth * MBARRIER_BYTES,
                                 f"{depth} mbarriers ({MBARRIER_BYTES} B each), one per ring "
                                 f"slot: the slot's bulk copies have landed"))
            return ring, requests
    return None
