"""Time the outer-persistent kernel's skeleton: its traffic and its folds without its passes'
arithmetic, geometry by geometry and fold mechanism by mechanism.

    PYTHONPATH=. python3 bench/outer_skeleton.py [--segments 64,128] [--threads 256,512] \
        [--clusters 4,8,16] [--levels 0,1,2] [--sync 0,1,2,3] [--copy 0] [--min-blocks 2] \
        [--register-rows 0,8] [--out f.json]

The skeleton is outer_kernel.cu.j2 with its statements taken out: a cluster owns a slab of
16-byte vectors of a [rows, row bytes] array (segment bytes of each row), each block copies
its share of the rows into shared memory (--copy 0: cp.async per thread, as fuser does;
1: a bulk copy per row on an mbarrier), then per level reads its rows once (one add per
4 bytes), folds over its warps and the cluster, and finally stores its rows back. --sync
picks the cluster fold: 0, a cluster barrier with release semantics (MEMBAR.ALL.GPU) then
loads from every peer (fuser before e1f9380); 1, a relaxed cluster barrier, which orders no
memory (a bound, not a correct kernel); 2, pushes into every block's inbox counted off an
mbarrier per level, after a release arrive at the start; 3, the same after
fence.mbarrier_init and a relaxed arrive (fuser since e1f9380; the push forms here end
without the split cluster barrier fuser's kernel closes with). --register-rows R keeps each
thread's first R rows in registers (plain loads, issued before the copies) and only the rest
in shared memory, which leaves room for more blocks per SM at the same slab. Each
configuration runs at
[16384, 8192 B] and [4096, 32768 B] (bf16 [16384, 4096] and [4096, 16384]) against a device
copy of the same array in the same process, triton do_bench medians; what it prints and
--out writes is one record per run. The tool behind "outer folds by pushes" in
bench/TUNING.md: what the kernel's fold and traffic cost apart from its arithmetic.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((16384, 4096 * 2), (4096, 16384 * 2))  # rows, row bytes
SOURCE = r'''
#include "fuser_cluster.cuh"
#include "fuser_copy.cuh"

template <int LANES, int ROW_LANES, int CLUSTER, int LEVELS, int COPY, int MINB, int SYNC,
          int REG>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(LANES * ROW_LANES, MINB)
skeleton(const uint4* __restrict__ x, uint4* __restrict__ y, long long n_rows, int h16) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int THREADS = LANES * ROW_LANES;
  constexpr int SPAN = LANES < 32 ? 32 / LANES : 1;
  constexpr int GROUPS = ROW_LANES / SPAN;
  constexpr int W = LANES * 4;  // floats across the slab
  const int tx = threadIdx.x % LANES, ty = threadIdx.x / LANES;
  const unsigned rank = CLUSTER > 1 ? fm::cluster_rank() : 0u;
  const int slab = CLUSTER > 1 ? static_cast<int>(fm::cluster_index()) : blockIdx.x;
  const long long share = (n_rows + CLUSTER - 1) / CLUSTER;
  const long long row0 = share * rank;
  const int rows = static_cast<int>(min(share, n_rows - row0));
  // The block's first HELD rows stay in registers (REG a thread: rows ty + j * ROW_LANES),
  // the rest in shared memory from row HELD on.
  constexpr int HELD = REG * ROW_LANES;
  const long long kept = share > HELD ? share - HELD : 0;
  uint4* tile = reinterpret_cast<uint4*>(smem);
  float* lanes = reinterpret_cast<float*>(smem + kept * LANES * 16);
  float* part = lanes + GROUPS * W;
  float* total = part + W;
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(total + W);
  unsigned long long* level_bars = bar + 1;
  float* inbox = reinterpret_cast<float*>(bar + 8);  // [LEVELS][CLUSTER][W]
  if constexpr (SYNC >= 2) {
    if (threadIdx.x == 0) {
      for (int l = 0; l < LEVELS; ++l) fm::mbarrier_init(level_bars + l, 1);
      fm::fence_mbarrier_init();
      for (int l = 0; l < LEVELS; ++l) fm::mbarrier_expect_tx(level_bars + l, CLUSTER * W * 4);
    }
    if constexpr (SYNC == 2) {
      asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    } else {
      fm::cluster_arrive_relaxed();
    }
  }
  const uint4* src = x + row0 * h16 + slab * LANES;
  uint4 held[REG > 0 ? REG : 1];
#pragma unroll
  for (int j = 0; j < REG; ++j) {
    const int r = ty + j * ROW_LANES;
    if (r < rows) held[j] = src[static_cast<long long>(r) * h16 + tx];
  }
  if constexpr (COPY == 0) {
#pragma unroll 4
    for (int r = ty + HELD; r < rows; r += ROW_LANES) {
      fm::cp_async<16>(tile + (r - HELD) * LANES + tx, src + static_cast<long long>(r) * h16 + tx);
    }
    fm::cp_async_commit();
    fm::cp_async_wait<0>();
  } else {
    if (threadIdx.x == 0) {
      fm::mbarrier_init(bar, 1);
      fm::fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) fm::mbarrier_expect_tx(bar, max(rows - HELD, 0) * LANES * 16);
    __syncthreads();
    for (int r = HELD + threadIdx.x; r < rows; r += THREADS) {
      fm::bulk_copy(tile + (r - HELD) * LANES, src + static_cast<long long>(r) * h16, LANES * 16,
                    bar);
    }
    fm::mbarrier_wait(bar, 0);
  }
  if constexpr (SYNC >= 2) fm::cluster_wait();
  float add = 0.f;
#pragma unroll 1
  for (int level = 0; level < LEVELS; ++level) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const auto fold = [&](const uint4& v) {
      acc[0] += __uint_as_float(v.x) * add;
      acc[1] += __uint_as_float(v.y);
      acc[2] += __uint_as_float(v.z);
      acc[3] += __uint_as_float(v.w);
    };
#pragma unroll
    for (int j = 0; j < REG; ++j) {
      if (ty + j * ROW_LANES < rows) fold(held[j]);
    }
    for (int r = ty + HELD; r < rows; r += ROW_LANES) fold(tile[(r - HELD) * LANES + tx]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float s = acc[i];
      for (int o = LANES; o < 32; o *= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (ty % SPAN == 0) lanes[(ty / SPAN) * W + tx * 4 + i] = s;
    }
    __syncthreads();
    if constexpr (SYNC >= 2) {
      for (int c = threadIdx.x; c < W; c += THREADS) {
        float s = 0.f;
        for (int g = 0; g < GROUPS; ++g) s += lanes[g * W + c];
        float* slot = inbox + (level * CLUSTER + rank) * W + c;
#pragma unroll
        for (int k = 0; k < CLUSTER; ++k) {
          fm::store_to_peer(reinterpret_cast<unsigned*>(slot), __float_as_uint(s),
                            level_bars + level, k);
        }
      }
      fm::mbarrier_wait(level_bars + level, 0);
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < CLUSTER; ++k) s += inbox[(level * CLUSTER + k) * W + tx * 4];
      add += s * 1e-30f;
      continue;
    }
    for (int c = threadIdx.x; c < W; c += THREADS) {
      float s = 0.f;
      for (int g = 0; g < GROUPS; ++g) s += lanes[g * W + c];
      part[c] = s;
    }
    if constexpr (CLUSTER > 1 && SYNC == 0) {
      fm::cluster_sync();
    } else if constexpr (CLUSTER > 1 && SYNC == 1) {
      fm::cluster_arrive_and_wait();
    } else {
      __syncthreads();
    }
    for (int c = threadIdx.x; c < W; c += THREADS) {
      float s = 0.f;
      if constexpr (CLUSTER > 1) {
        float p[CLUSTER];
#pragma unroll
        for (int k = 0; k < CLUSTER; ++k) {
          unsigned bits;
          asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(bits)
                       : "r"(fm::peer_address(part + c, k)) : "memory");
          p[k] = __uint_as_float(bits);
        }
#pragma unroll
        for (int k = 0; k < CLUSTER; ++k) s += p[k];
      } else {
        s = part[c];
      }
      total[c] = s;
    }
    __syncthreads();
    add += total[tx * 4] * 1e-30f;
  }
  uint4* dst = y + row0 * h16 + slab * LANES;
  const auto store = [&](int r, uint4 v) {
    v.x = __float_as_uint(__uint_as_float(v.x) + add);
    dst[static_cast<long long>(r) * h16 + tx] = v;
  };
#pragma unroll
  for (int j = 0; j < REG; ++j) {
    if (ty + j * ROW_LANES < rows) store(ty + j * ROW_LANES, held[j]);
  }
  for (int r = ty + HELD; r < rows; r += ROW_LANES) store(r, tile[(r - HELD) * LANES + tx]);
  if constexpr (CLUSTER > 1 && SYNC < 2) fm::cluster_arrive_and_wait();
}
'''


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/outer_skeleton.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--segments", type=_ints, default=(64, 128), help="row bytes of a slab")
    p.add_argument("--threads", type=_ints, default=(256, 512))
    p.add_argument("--clusters", type=_ints, default=(4, 8, 16))
    p.add_argument("--levels", type=_ints, default=(0, 1, 2))
    p.add_argument("--sync", type=_ints, default=(0, 3), help="cluster fold (see above)")
    p.add_argument("--copy", type=_ints, default=(0,), help="0 cp.async, 1 bulk copies")
    p.add_argument("--min-blocks", type=_ints, default=(2,), help="__launch_bounds__'s")
    p.add_argument("--register-rows", type=_ints, default=(0,),
                   help="rows a thread keeps in registers")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    for name in ("segments", "threads"):
        bad = [v for v in getattr(args, name) if v < 16 or v & (v - 1)]
        if bad:
            p.error(f"--{name} {bad}: powers of two from 16")
    for name, allowed in (("clusters", (1, 2, 4, 8, 16)), ("sync", (0, 1, 2, 3)),
                          ("copy", (0, 1))):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            p.error(f"--{name} {bad}: allowed {', '.join(map(str, allowed))}")
    return args


def configurations(args: argparse.Namespace) -> list[dict]:
    """Every combination asked for, with its template arguments (sync only matters with
    levels and a cluster, so the others run once, as sync 0)."""
    found = []
    for seg, threads, cluster, levels, sync, copy, minb, reg in itertools.product(
            args.segments, args.threads, args.clusters, args.levels, args.sync, args.copy,
            args.min_blocks, args.register_rows):
        if (levels == 0 or cluster == 1) and sync != args.sync[0]:
            continue
        lanes = seg // 16
        found.append({"seg": seg, "threads": threads, "cluster": cluster, "levels": levels,
                      "sync": sync, "copy": copy, "minb": minb, "register_rows": reg,
                      "entry": f"skeleton<{lanes},{threads // lanes},{cluster},{levels},{copy},"
                               f"{minb},{sync},{reg}>"})
    return found


def shared_bytes(c: dict, rows: int) -> int:
    """The skeleton's dynamic shared memory at `rows` (the kernel's layout above)."""
    lanes = c["seg"] // 16
    groups = (c["threads"] // lanes) // (32 // lanes if lanes < 32 else 1)
    share = -(-rows // c["cluster"])
    kept = max(0, share - c["register_rows"] * (c["threads"] // lanes))
    return (kept * c["seg"] + (groups + 2) * lanes * 16 + 64
            + c["levels"] * c["cluster"] * c["seg"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import cupy
    import numpy as np
    import triton.testing

    from fuser.driver import Function, driver

    configs = configurations(args)
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90",
                                                  f"-I{ROOT / 'templates'}"),
                            name_expressions=[c["entry"] for c in configs])
    limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    records = []
    for rows, row_bytes in SHAPES:
        x = cupy.random.randint(0, 2**31, size=rows * row_bytes // 4, dtype=cupy.int32)
        y = cupy.empty_like(x)
        copy_ms = triton.testing.do_bench(functools.partial(cupy.copyto, y, x), warmup=5,
                                          rep=50)
        for c in configs:
            smem = shared_bytes(c, rows)
            if smem > limit:
                continue
            kernel = module.get_function(c["entry"])
            kernel.max_dynamic_shared_size_bytes = smem
            if c["cluster"] > 8:
                handle = getattr(kernel, "kernel", kernel).ptr  # the CUfunction
                driver().allow_large_clusters(Function(
                    c["entry"], handle, kernel.num_regs, kernel.shared_size_bytes,
                    kernel.local_size_bytes, smem))
            grid = (row_bytes // c["seg"] * c["cluster"],)
            launch = functools.partial(kernel, grid, (c["threads"],),
                                       (x, y, np.int64(rows), np.int32(row_bytes // 16)),
                                       shared_mem=smem)
            ms = triton.testing.do_bench(launch, warmup=5, rep=50)
            record = {k: v for k, v in c.items() if k != "entry"}
            record.update(rows=rows, row_bytes=row_bytes, us=round(ms * 1e3, 1),
                          fraction_of_copy=round(copy_ms / ms, 3), registers=kernel.num_regs,
                          smem=smem)
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
