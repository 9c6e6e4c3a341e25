// Columns in fuser's row kernels: column inputs ([hidden], loaded once per block, at(v) is
// vector v), and the column (outer) reductions' accumulators, whose finish() leaves a partial
// row per block for the finalize kernel. Built on fuser_rows.cuh's RowPart and visits.
#pragma once
#include "fuser_rows.cuh"

namespace fm {

// ----- column inputs ([hidden]): loaded once per block; at(v) is vector v -----

template <typename T, typename Part>
struct ColumnInRegisters {
  static_assert(Part::SKEW == 0, "a skewed row's lane holds a different column in every row");
  using V = Vec<T, Part::VEC>;
  V v[Part::BATCH];

  __device__ __forceinline__ ColumnInRegisters(const Part& part, const T* g) {
#pragma unroll Part::UNROLL
    for (int b = 0; b < Part::BATCH; ++b) {
      const int j = part.vector(b);
      if (part.owns(j)) v[b] = load<Part::VEC>(g + j * Part::VEC);
    }
  }
  __device__ __forceinline__ V at(const Visit& x) const { return v[x.b]; }
};

// A skewed row's visit reads the columns from element v.e on, a multiple of Part::SKEW, in
// pieces (gather_pieces). In shared memory the column is laid out with PAD bytes after every
// 128, so that a warp's pieces, 16 bytes apart from lane to lane, fall in different banks
// (unpadded, four lanes shared a bank; base.skewed_column_pad and skewed_column_bytes).
template <typename T, typename Part, int PAD>
struct SkewedColumn {
  static constexpr int SKEW = Part::SKEW > 0 ? Part::SKEW : 1;
  static_assert(Part::SKEW == 0 || (PAD > 0 && PAD % (SKEW * sizeof(T)) == 0),
                "the padding keeps a skewed column's pieces aligned");
  using P = Vec<T, SKEW>;

  // The piece at element e of the column in its padded buffer `s`.
  static __device__ __forceinline__ P& at(unsigned char* s, int e) {
    const int b = e * static_cast<int>(sizeof(T));
    return *reinterpret_cast<P*>(s + b + PAD * (b >> 7));
  }
};

// In shared memory, shared by the block's rows (loaded by its first row of threads; a barrier
// follows the loads of every column buffer); skewed rows' columns padded by PAD bytes every
// 128 (SkewedColumn).
template <typename T, typename Part, int PAD = 0>
struct ColumnInSmem {
  using V = Vec<T, Part::VEC>;
  using Skewed = SkewedColumn<T, Part, PAD>;
  unsigned char* s;

  __device__ __forceinline__ ColumnInSmem(const Part& part, unsigned char* buffer, const T* g)
      : s(buffer) {
    if (part.ty != 0) return;
#pragma unroll Part::UNROLL
    for (int b = 0; b < Part::BATCH; ++b) {
      const int j = part.vector(b);
      if (!part.owns(j)) continue;
      if constexpr (Part::SKEW > 0) {
        scatter_pieces<Part>(load_vector<Part>(g, j * Part::VEC, b), j * Part::VEC,
                             [&](int at, const typename Skewed::P& piece) {
                               Skewed::at(s, at) = piece;
                             });
      } else {
        reinterpret_cast<V*>(s)[j - part.first] = load<Part::VEC>(g + j * Part::VEC);
      }
    }
  }
  template <typename X>
  __device__ __forceinline__ V at(const X& x) const {
    if constexpr (Part::SKEW > 0) {
      return gather_pieces<Part, T, X::EDGE>(x.e, [&](int e) { return Skewed::at(s, e); });
    } else {
      return reinterpret_cast<const V*>(s)[x.k];
    }
  }
};

// In shared memory at the skew of the block's rows, where every row the block visits has
// the same one (one row per block, the grid striding over whole periods of the skews:
// RowSchedule.columns_at_skew): lane i of the part's vector k holds column (first + k) * VEC -
// skew + i (zero outside the column), so a visit reads its columns in the whole vector x.k,
// as the row's own. Loaded once, in pieces of Part::SKEW (a barrier follows).
template <typename T, typename Part>
struct ColumnAtSkew {
  static_assert(Part::SKEW > 0 && Part::RPB == 1, "one skewed row per block");
  using V = Vec<T, Part::VEC>;
  V* s;

  __device__ __forceinline__ ColumnAtSkew(const Part& part, unsigned char* buffer, const T* g)
      : s(reinterpret_cast<V*>(buffer)) {
    const int skew = Part::skew(part.first_row());
#pragma unroll Part::UNROLL
    for (int b = 0; b < Part::BATCH; ++b) {
      const int j = part.vector(b);
      if (part.owns(j)) {
        s[j - part.first] = gather_pieces<Part, T, true>(
            j * Part::VEC - skew, [&](int at) { return load<Part::SKEW>(g + at); });
      }
    }
  }
  template <typename X>
  __device__ __forceinline__ V at(const X& x) const { return s[x.k]; }
};

template <typename T, typename Part>
struct ColumnInGlobal {
  const T* g;

  __device__ __forceinline__ explicit ColumnInGlobal(const T* g) : g(g) {}
  template <typename X>
  __device__ __forceinline__ Vec<T, Part::VEC> at(const X& x) const {
    if constexpr (Part::SKEW > 0) {
      return gather_pieces<Part, T, X::EDGE>(x.e, [&](int e) { return load<Part::SKEW>(g + e); });
    } else {
      return load<Part::VEC>(g + x.j * Part::VEC);
    }
  }
};

// ----- column (outer) reductions: each thread accumulates its vectors over the rows it
// visits; finish() leaves one partial row per block (or cluster) in the workspace, which the
// finalize kernel sums. A skewed row's lane i of vector j holds column j * VEC - skew + i: the
// same column in every row a thread visits, since the grid strides over a multiple of VEC /
// SKEW rows (RowSchedule.group_period), and only the row's own elements are summed. -----

// The skew of every row this thread visits (0 unless skewed): its first row's.
template <typename Part>
__device__ __forceinline__ int column_skew(const Part& part, int ty) {
  return Part::skew(part.first_row() + ty);
}

// f(b, c, i) for lane i of each vector the thread owns whose column is one of the row's,
// c counted from the part's first column, UNROLL rounds unrolled.
template <typename Part, int UNROLL, typename F>
__device__ __forceinline__ void each_column(const Part& part, int skew, F&& f) {
  const int first = part.first * Part::VEC;
#pragma unroll UNROLL
  for (int b = 0; b < Part::BATCH; ++b) {
    const int j = part.vector(b);
    if (part.owns(j)) {
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const int c = (j - part.first) * Part::VEC + i - skew;
        if (Part::SKEW == 0 || static_cast<unsigned>(first + c) < static_cast<unsigned>(Part::H)) {
          f(b, c, i);
        }
      }
    }
  }
}

// In registers; a block of several rows folds them into its first through `combine` (one row
// of the block's part, by column).
template <typename T, typename Op, typename Part>
struct AccumulatorInRegisters {
  T v[Part::BATCH][Part::VEC];
  T* partials;
  T* combine;
  int skew;

  __device__ __forceinline__ AccumulatorInRegisters(const Part& part, T* partials,
                                                    unsigned char* combine)
      : partials(partials), combine(reinterpret_cast<T*>(combine)),
        skew(column_skew(part, part.ty)) {
#pragma unroll Part::UNROLL
    for (int b = 0; b < Part::BATCH; ++b) {
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        if (part.owns(part.vector(b))) v[b][i] = Op::template identity<T>();
      }
    }
  }
  template <typename X>
  __device__ __forceinline__ void add(const X& x, int i, T value) {
    if (in_row<Part>(x, i)) v[x.b][i] = Op{}(v[x.b][i], value);
  }
  __device__ __forceinline__ void finish(const Part& part) {
    for (int y = 1; y < Part::RPB; ++y) {
      __syncthreads();
      if (part.ty == y) each_column<Part, Part::BATCH>(part, skew, [&](int b, int c, int i) { combine[c] = v[b][i]; });
      __syncthreads();
      if (part.ty == 0) {
        each_column<Part, Part::BATCH>(part, skew, [&](int b, int c, int i) { v[b][i] = Op{}(v[b][i], combine[c]); });
      }
    }
    if (part.ty != 0) return;
    T* const row = partials + static_cast<long long>(part.group) * Part::H + part.first * Part::VEC;
    each_column<Part, Part::BATCH>(part, skew, [&](int b, int c, int i) { row[c] = v[b][i]; });
  }
};

// In shared memory, each thread its own slots (RPB rows of the block's part, a lane's slot
// at its column + its skew); the first row of threads folds the block's rows into the
// partial row.
template <typename T, typename Op, typename Part>
struct AccumulatorInSmem {
  static constexpr int SLOTS = Part::PART * Part::VEC;  // a row of threads' slots
  T* s;
  T* partials;

  __device__ __forceinline__ AccumulatorInSmem(const Part& part, T* partials,
                                               unsigned char* slots)
      : s(reinterpret_cast<T*>(slots)), partials(partials) {
    const int skew = column_skew(part, part.ty);
    each_column<Part, Part::UNROLL>(part, skew, [&](int, int c, int) {
      s[part.ty * SLOTS + c + skew] = Op::template identity<T>();
    });
  }
  template <typename X>
  __device__ __forceinline__ void add(const X& x, int i, T value) {
    if (!in_row<Part>(x, i)) return;
    T& a = s[(threadIdx.y * Part::PART + x.k) * Part::VEC + i];
    a = Op{}(a, value);
  }
  __device__ __forceinline__ void finish(const Part& part) {
    __syncthreads();
    if (part.ty != 0) return;
    T* const row = partials + static_cast<long long>(part.group) * Part::H + part.first * Part::VEC;
    const int skew = column_skew(part, 0);
    each_column<Part, Part::BATCH>(part, skew, [&](int, int c, int) {
      T total = s[c + skew];
      for (int y = 1; y < Part::RPB; ++y) total = Op{}(total, s[y * SLOTS + c + column_skew(part, y)]);
      row[c] = total;
    });
  }
};

// In the workspace: each row of threads accumulates straight into a partial row of its own,
// by column (read and written every row; nothing to fold).
template <typename T, typename Op, typename Part>
struct AccumulatorInGlobal {
  T* row;

  __device__ __forceinline__ AccumulatorInGlobal(const Part& part, T* partials)
      : row(partials + (static_cast<long long>(part.group) * Part::RPB + part.ty) * Part::H) {
    each_column<Part, Part::UNROLL>(part, column_skew(part, part.ty), [&](int, int c, int) {
      row[part.first * Part::VEC + c] = Op::template identity<T>();
    });
  }
  template <typename X>
  __device__ __forceinline__ void add(const X& x, int i, T value) {
    if (!in_row<Part>(x, i)) return;
    T& a = row[x.e + i];
    a = Op{}(a, value);
  }
  __device__ __forceinline__ void finish(const Part&) {}
};

// ----- a row kernel that finalizes its columns itself: its blocks meet at a grid-wide
// barrier once their partial rows are in the workspace, then sum tiles of columns. -----

// Every block of the grid is past the point before this once any block is past it. The launch
// is cooperative: every block is resident (blocks waiting here would otherwise hold the SMs
// the others need). counter[0] counts the blocks arrived, counter[1] the blocks gone on; the
// last to go on zeroes both, so the next launch on the stream finds them zero (fuser.tickets
// hands out one counter per stream).
__device__ __forceinline__ void grid_barrier(unsigned long long* counter) {
  __syncthreads();  // the block's partial rows are written
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    const unsigned long long blocks = gridDim.x;
    __threadfence();  // and visible to the grid before the block counts itself arrived
    atomicAdd(counter, 1ull);
    for (;;) {
      unsigned long long arrived;
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(arrived) : "l"(counter) : "memory");
      if (arrived >= blocks) break;
      __nanosleep(32);
    }
    __threadfence();
    if (atomicAdd(counter + 1, 1ull) == blocks - 1) {
      *reinterpret_cast<ulonglong2*>(counter) = make_ulonglong2(0, 0);  // both, 16-byte aligned
    }
  }
  __syncthreads();
}

// A partial row's value, written by another block of this grid: from L2 (an SM's L1 is not
// kept coherent with the other SMs' stores).
template <typename T>
__device__ __forceinline__ T from_l2(const T* p) { return __ldcg(p); }
__device__ __forceinline__ bool from_l2(const bool* p) {
  return __ldcg(reinterpret_cast<const unsigned char*>(p)) != 0;
}

}  // namespace fm
