// fuser device helpers for outer-persistent kernels (outer_kernel.cu.j2): a slab of columns
// owned by a thread-block cluster, each block's share of its rows kept in shared memory (or,
// streamed, read from global memory as it is summed), and the column folds, in a fixed order
// so that every block (and every run) gets the same totals.
#pragma once
#include "fuser_cluster.cuh"
#include "fuser_copy.cuh"
#include "fuser_math.cuh"

namespace fm {

// One vector of BYTES bytes into shared memory: cp.async from 4 bytes (its smallest copy),
// through a register below.
template <int BYTES>
__device__ __forceinline__ void copy_vector(void* dst, const void* src) {
  if constexpr (BYTES >= 4) {
    cp_async<BYTES>(dst, src);
  } else if constexpr (BYTES == 2) {
    *static_cast<unsigned short*>(dst) = *static_cast<const unsigned short*>(src);
  } else {
    *static_cast<unsigned char*>(dst) = *static_cast<const unsigned char*>(src);
  }
}

// A column's running max m and the sum s of exp(x - m) over the values folded so far: the
// pair fuser.schedulers.outer_folds folds in one level where a max's next level sums
// exp(x - max). Same totals as the two levels': an element beyond m rescales s, partials meet
// at the larger max. NaN and inf as the two levels give them: x = +inf adds exp(inf - inf),
// NaN; x = -inf adds exp(-inf - m) = 0 (nothing, where m is still -inf: a column of -inf
// only gets m = -inf and s = 0, whose sum online_sum makes NaN).
struct MaxSum {
  float m, s;
};

struct OnlineSum {
  template <typename T>
  static __device__ __forceinline__ T identity() { return T{lowest<float>(), 0.0f}; }
  // One element, one exponential: of m - x where x is the new max (s rescaled, plus exp(x - x),
  // 1 or NaN, as (x - x) + 1), else of x - m.
  __device__ __forceinline__ MaxSum operator()(MaxSum a, float x) const {
    const bool up = x > a.m;
    const float e = exp(up ? a.m - x : x - a.m);
    if (up) return MaxSum{x, a.s * e + ((x - x) + 1.0f)};
    return MaxSum{a.m, x == lowest<float>() ? a.s : a.s + e};
  }
  // Two partials: each sum rescaled to the larger max (-inf for both: nothing to rescale).
  __device__ __forceinline__ MaxSum operator()(MaxSum a, MaxSum b) const {
    const float m = a.m < b.m ? b.m : a.m;
    if (m == lowest<float>()) return MaxSum{m, a.s + b.s};
    return MaxSum{m, a.s * exp(a.m - m) + b.s * exp(b.m - m)};
  }
};

// The sum of a column's folded pair: a column of -inf only (m = -inf, s = 0: its -inf values
// added nothing) sums to NaN, exp(-inf - -inf), as the two levels give.
__device__ __forceinline__ float online_sum(MaxSum t) {
  return t.m == lowest<float>() ? __int_as_float(0x7fc00000) : t.s;
}

__device__ __forceinline__ MaxSum shfl_xor(MaxSum x, int offset) {
  return MaxSum{shfl_xor(x.m, offset), shfl_xor(x.s, offset)};
}

// A column partial (8 bytes: a double, a 64-bit integer or a MaxSum) into slot `local` of the cluster's
// block `rank`, counted off that block's mbarrier at `local_bar`'s address (st.async).
template <typename Total>
__device__ __forceinline__ void push_to_peer(Total* local, Total value,
                                             unsigned long long* local_bar, unsigned rank) {
  static_assert(sizeof(Total) == 8, "column partials are 8-byte totals");
  unsigned long long word;
  memcpy(&word, &value, sizeof(word));
  store_to_peer(reinterpret_cast<unsigned long long*>(local), word, local_bar, rank);
}

// A slab of W = LANES x VEC columns of [n_rows, H] tensors, owned by a cluster of CLUSTER
// blocks (or by one block): the block of rank k keeps rows [k * share, (k + 1) * share) of it,
// share = ceil(n_rows / CLUSTER). Thread (tx, ty) owns the VEC columns from col and visits
// the rows ty, ty + ROW_LANES, ... of its block.
template <int H_, int VEC_, int LANES_, int ROW_LANES_, int GROUPS_, int CLUSTER_>
struct ColumnSlab {
  static constexpr int H = H_, VEC = VEC_, LANES = LANES_, ROW_LANES = ROW_LANES_;
  static constexpr int GROUPS = GROUPS_, CLUSTER = CLUSTER_;
  static constexpr int W = LANES * VEC;
  static constexpr int THREADS = LANES * ROW_LANES;
  // A warp holds SPAN row lanes of each column lane, folded by shuffles; the GROUPS left (rows
  // of the lanes buffers, as the shared-memory plan sized them) are folded through them.
  static constexpr int SPAN = LANES < 32 ? 32 / LANES : 1;
  static_assert(THREADS % 32 == 0 && ROW_LANES % SPAN == 0, "whole warps of whole spans");
  static_assert(GROUPS == ROW_LANES / SPAN, "the planned lanes buffers hold every group");

  int tx, ty;
  unsigned rank;   // the block's rank in its cluster (0 without one)
  int col0;        // the slab's first column
  int col;         // the thread's first column
  bool owns;       // the thread's columns exist (H is a multiple of VEC)
  long long row0;  // the block's first row
  int rows;        // rows the block keeps (a streamed kernel's: reads)

  __device__ __forceinline__ explicit ColumnSlab(long long n_rows)
      : tx(threadIdx.x), ty(threadIdx.y), rank(CLUSTER > 1 ? cluster_rank() : 0u) {
    const int slab = CLUSTER > 1 ? static_cast<int>(cluster_index()) : static_cast<int>(blockIdx.x);
    col0 = slab * W;
    col = col0 + tx * VEC;
    owns = col < H;
    const long long share = (n_rows + CLUSTER - 1) / CLUSTER;
    row0 = share * rank;
    const long long left = n_rows - row0;
    rows = static_cast<int>(left <= 0 ? 0 : left < share ? left : share);
  }

  // The block's rows of the slab of `g` into `tile` ([rows][W]) by cp.async (the caller
  // commits and waits): each thread copies its own vectors, the ones it later reads, so no
  // block barrier stands between the copies and the first pass. (Copies in groups that the
  // first pass followed one by one ran slower: bench/TUNING.md, "outer-persistent kernels".)
  // From row `first` on (a multiple of ROW_LANES: the rows before it are held in registers),
  // into a tile of the rows from `first`.
  template <typename T>
  __device__ __forceinline__ void fill(T* tile, const T* g, int first = 0) const {
    if (!owns) return;
#pragma unroll 4
    for (int r = first + ty; r < rows; r += ROW_LANES) {
      copy_vector<VEC * static_cast<int>(sizeof(T))>(tile + (r - first) * W + tx * VEC,
                                                      g + (row0 + r) * H + col);
    }
  }

  // The thread's first N rows of the block's rows of `g` (ty, ty + ROW_LANES, ...) into its
  // registers, read once from global memory: a held input's (the rest go to shared memory
  // by fill from row N * ROW_LANES). Rows past the block's are left unset and never read.
  template <int N, typename T>
  __device__ __forceinline__ void hold(Vec<T, VEC> (&held)[N], const T* g) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int r = ty + j * ROW_LANES;
      if (owns && r < rows) held[j] = load<VEC>(g + (row0 + r) * H + col);
    }
  }

  template <typename T>
  __device__ __forceinline__ Vec<T, VEC> at(const T* tile, int r) const {
    return load<VEC>(tile + r * W + tx * VEC);
  }

  // A streamed kernel's vector of row r (of the block's) of `g`, read from global memory.
  template <typename T>
  __device__ __forceinline__ Vec<T, VEC> read(const T* g, int r) const {
    return load<VEC>(g + (row0 + r) * H + col);
  }

  // Row r's (of the block's) value of a per-row input `g` ([rows, 1]), as C.
  template <typename C, typename T>
  __device__ __forceinline__ C row_value(const T* g, int r) const {
    return static_cast<C>(to_compute(g[row0 + r]));
  }

  // Fold step 1: each thread's partials of its columns, folded over its warp's row lanes,
  // into `lanes` ([GROUPS][W], of the partials' own type: the 8-byte totals start at step 2).
  // Every thread takes part (the shuffles need the whole warp).
  template <typename R, typename F>
  __device__ __forceinline__ void put(R* lanes, const R (&acc)[VEC], F f) const {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      R x = acc[i];
#pragma unroll
      for (int offset = LANES; offset < 32; offset *= 2) x = f(x, shfl_xor(x, offset));
      if (ty % SPAN == 0) lanes[(ty / SPAN) * W + tx * VEC + i] = x;
    }
  }

  // Fold step 2, after a block barrier: the block's partial of each column, its groups in
  // order. Without a cluster it is the slab's total (into `out`, the totals buffer); in a
  // cluster it goes to row `rank` of every block's inbox ([CLUSTER][W], this block's too),
  // counted off each block's mbarrier `bar` of this level, which expects all CLUSTER rows.
  // The pushes are the fold's only exchange: no cluster barrier per level, whose release
  // would wait on every memory access the SM has in flight (MEMBAR.ALL.GPU).
  template <typename Lane, typename Total, typename F>
  __device__ __forceinline__ void fold_groups(const Lane* lanes, Total* out, F f,
                                              unsigned long long* bar = nullptr) const {
    for (int c = ty * LANES + tx; c < W; c += THREADS) {
      Total x = F::template identity<Total>();
#pragma unroll
      for (int g = 0; g < GROUPS; ++g) x = f(x, static_cast<Total>(lanes[g * W + c]));
      if constexpr (CLUSTER > 1) {
#pragma unroll 1  // once per level: unrolled, its peer addresses would take registers
        for (int k = 0; k < CLUSTER; ++k) {
          push_to_peer(out + rank * W + c, x, bar, static_cast<unsigned>(k));
        }
      } else {
        out[c] = x;
      }
    }
  }

  // Fold step 3 (clusters), once this block's mbarrier of the level has seen every row of
  // its inbox: the slab's total of each column, the blocks' partials in rank order (the same
  // sum in every block).
  template <typename Total, typename F>
  __device__ __forceinline__ void fold_blocks(const Total* inbox, Total* total, F f) const {
    for (int c = ty * LANES + tx; c < W; c += THREADS) {
      Total x = F::template identity<Total>();
#pragma unroll
      for (int k = 0; k < CLUSTER; ++k) x = f(x, inbox[k * W + c]);
      total[c] = x;
    }
  }

  // Fold step 4, after a block barrier: the totals of the thread's columns.
  template <typename R, typename Total>
  __device__ __forceinline__ void get(const Total* total, R (&out)[VEC]) const {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = static_cast<R>(total[tx * VEC + i]);
  }
};

}  // namespace fm
