"""Rows forced through the staging ring, for the CPU compile tests (test_staging.py) and the
GPU reference tests (test_gpu_fusions.py)."""

from __future__ import annotations

from fuser import DataType
from fuser.analysis import analyze
from fuser.fusions import ROW_FUSIONS
from fuser.schedulers import Hints
from fuser.schedulers.base import Storage, pick_vec


def ring_hints(name: str, dtype: DataType, hidden: int, align_bytes: int = 16,
               cluster: int | None = None) -> Hints:
    """Every full input the ring can take through it (the others re-read by plain loads),
    every column input in shared memory; a ring serves one row per block, which the
    scheduler then takes by itself. Rows of 24578 keep 1024 threads (RING_THREADS)."""
    info = analyze(ROW_FUSIONS[name](dtype).fusion)
    sizes = [t.dtype.itemsize for t in (*info.full_inputs, *info.col_inputs)]
    vec = pick_vec(hidden, sizes, align_bytes, input_bytes=sum(sizes))
    ringed = {t.name: Storage.RING if (hidden * t.dtype.itemsize % 16 == 0 or
                               vec * t.dtype.itemsize >= 4) else Storage.GLOBAL
              for t in info.full_inputs}
    return Hints(storage=(*ringed.items(), *((t.name, Storage.SMEM) for t in info.col_inputs)),
                 cluster=cluster, threads_per_row=RING_THREADS.get(hidden))


# The ring cases at 24578 were written for the 1024-thread rows they had; softmax's and
# LayerNorm forward's default there is 512 threads since (staged_narrow_threads), at which
# LayerNorm's fp32 columns and ring exceed shared memory.
RING_THREADS = {24578: 1024}


# (fusion, hidden, cluster) forced through a ring: bulk-filled where rows are whole multiples
# of 16 bytes (4096; 24576 over a cluster of 2), by cp.async where they are not (24578). At
# 24578 dropout + RMSNorm backward spills (its 13 ring chunks unrolled for the dW registers)
# and LayerNorm backward's two dW/dB register arrays need 72 of the 64 registers a 1024-thread
# block allows: the scheduler keeps those rows on chip anyway.
RING_CASES = ([(n, 4096, None) for n in sorted(ROW_FUSIONS)]
              + [(n, 24576, 2) for n in sorted(ROW_FUSIONS)]
              + [(n, 24578, None) for n in ("layernorm_fwd", "rmsnorm_bwd", "rmsnorm_fwd",
                                           "softmax_fwd")])
