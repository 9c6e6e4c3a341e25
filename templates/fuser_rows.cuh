// fuser row kernels' device library: the parts a row kernel (row_kernel.cu.j2) is assembled
// from, as templates with compile-time parameters. This file holds a block's rows (RowPart, the
// counter that deals them), the visits of a row's vectors and the row buffers; the staging
// ring, the reductions over a row and the columns are in fuser_row_ring.cuh,
// fuser_row_reduce.cuh and fuser_row_columns.cuh. The scheduler decides where each buffer
// lives; the kernel declares one object per buffer, of the class that storage calls for, and
// every class of a role has the same interface: a row buffer or a column yields vector v of a
// pass with at(v), an accumulator adds with add(v, i, x) and writes its partial row with
// finish(). So the kernel's passes read the same whatever the schedule chose.
#pragma once
#include "fuser_cluster.cuh"
#include "fuser_copy.cuh"
#include "fuser_math.cuh"

// The architecture compiled for (NVRTC compiles device code only: __CUDA_ARCH__ is set).
#ifdef __CUDA_ARCH__
#define FM_ARCH __CUDA_ARCH__
#else
#define FM_ARCH 0
#endif

namespace fm {

// ----- which rows a block works on, and which vectors of a row a thread owns -----

// A row of H elements is NV = H / VEC vectors. A block works on RPB rows at a time (thread
// row ty) and owns each row whole, or in a cluster of CLUSTER blocks the PART vectors
// [first, end) of its rank. Thread tx of the TPR of a row owns vectors first + b * TPR + tx,
// b < BATCH, those that lie in [first, end). A block (or a cluster) takes the row group at
// first_row() first, then every row_stride() rows or from a counter (CountedRows). A pass
// over a row unrolls UNROLL of the BATCH rounds.
// Skewed rows (SKEW > 0): VEC does not divide H, so row r starts skew(r) = r * H % VEC
// elements past a VEC-element boundary (a multiple of SKEW, which divides H and VEC). Its
// vectors are then the VEC-element ones of the tensor, from the boundary at or below the row's
// start: vector j holds the row's elements j * VEC - skew(r) on, whole vectors in every tensor
// whatever its element size (every base is 16-byte aligned), and the row's first and last
// vectors (edges) hold elements of the rows beside it, which are masked. In a cluster, the
// first rank's part holds the first edge and the last rank's the last.
template <int H_, int VEC_, int TPR_, int RPB_, int BATCH_, int UNROLL_, int CLUSTER_, int SKEW_>
struct RowPart {
  static constexpr int H = H_, VEC = VEC_, TPR = TPR_, RPB = RPB_, BATCH = BATCH_;
  static constexpr int UNROLL = UNROLL_, CLUSTER = CLUSTER_, SKEW = SKEW_;
  static_assert(SKEW == 0 || (H % SKEW == 0 && VEC % SKEW == 0 && SKEW < VEC),
                "skewed rows are read in vectors of a multiple of SKEW");
  static constexpr int NV = SKEW ? (H + 2 * VEC - SKEW - 1) / VEC : H / VEC;
  static constexpr int PART = (NV + CLUSTER - 1) / CLUSTER;  // vectors a block keeps per row
  static constexpr int LAST_FIRST = (CLUSTER - 1) * PART;   // the last rank's first vector
  static constexpr bool EXACT = BATCH * TPR * CLUSTER == NV;  // every visited vector exists
  int tx;          // the thread's lane in its row
  int ty;          // the thread's row of the block
  unsigned rank;   // the block's rank in its cluster (0 without one)
  unsigned group;  // the block's index, or its cluster's: the owner of rows and partial rows
  int first;       // the block's first vector of each row
  int end;         // one past its last

  __device__ __forceinline__ RowPart()
      : tx(threadIdx.x), ty(threadIdx.y), rank(CLUSTER > 1 ? cluster_rank() : 0),
        group(CLUSTER > 1 ? cluster_index() : blockIdx.x), first(int(rank) * PART),
        end(CLUSTER > 1 ? min(NV, first + PART) : NV) {}

  // Elements row r starts past a VEC-element boundary (0 unless SKEW).
  static __device__ __forceinline__ int skew(long long r) {
    return SKEW ? static_cast<int>((r * H) & (VEC - 1)) : 0;
  }
  // Whether round b may visit an edge: the first vector of the row (the first rank's round
  // 0) or one reaching its end (a round of the last rank's part that reaches it).
  static __device__ __forceinline__ bool may_edge(int b) {
    return SKEW && (b == 0 || (LAST_FIRST + (b + 1) * TPR) * VEC > H);
  }
  // Whether the vector at element e, visited in round b, is an edge: it holds elements
  // outside the row.
  static __device__ __forceinline__ bool is_edge(int b, int e) {
    return may_edge(b) && (e < 0 || e + VEC > H);
  }
  __device__ __forceinline__ int vector(int b) const { return first + b * TPR + tx; }
  __device__ __forceinline__ bool owns(int j) const { return EXACT || j < end; }
  __device__ __forceinline__ long long first_row() const {
    return static_cast<long long>(group) * RPB;
  }
  __device__ __forceinline__ long long row_stride() const {
    return static_cast<long long>(CLUSTER > 1 ? cluster_count() : gridDim.x) * RPB;
  }
  // Bytes of the block's part of a row of T.
  template <typename T>
  __device__ __forceinline__ int bytes() const {
    return (end - first) * VEC * static_cast<int>(sizeof(T));
  }
  // Whether this thread writes the row's per-row values (one thread of the row's cluster).
  __device__ __forceinline__ bool writes_row_values() const { return tx == 0 && rank == 0; }
};

// ----- row groups from a counter -----

// Without a counter a block takes groups first_row(), first_row() + row_stride(), ... (the
// kernel's own loop). From a counter: the grid's first groups (its first two with AHEAD, a
// pipelined kernel loading the group after this one during it) go one per block as with fixed
// strides, each later one to the block that asks next. The lead thread takes a ticket at the
// start of each iteration (more(): its latency hidden behind the iteration's first pass; taken
// just before a barrier, it held every thread there) and publish(it) writes its group to the
// parity's shared slot. With BARRIER the dealer publishes in advance() and waits at a barrier
// of its own; without, the kernel calls publish() before a block barrier it has anyway (a
// multi-warp row reduction: RowReducer's barrier), and advance() only reads. counter[0]
// counts tickets, counter[1] blocks done (64-bit: a ticket never wraps onto a group dealt
// before); the last block done zeroes both, so the next launch on the stream finds them zero
// (fuser.tickets hands out one per stream).
__device__ __forceinline__ long long* dealt_groups() {
  __shared__ long long groups[2];
  return groups;
}

template <typename Part, bool AHEAD, bool BARRIER>
struct CountedRows {
  static_assert(BARRIER || Part::TPR > 32,
                "without a barrier of its own the dealer publishes before a row reduction's, "
                "which only rows of several warps have");
  long long row0;   // the first row of the group this iteration works on
  long long next0;  // with AHEAD: the first row of the group after it
  unsigned long long* counter;
  unsigned long long ticket = 0;
  bool lead;

  __device__ __forceinline__ CountedRows(const Part& part, unsigned long long* counter)
      : row0(part.first_row()), next0(part.first_row() + part.row_stride()), counter(counter),
        lead(threadIdx.x == 0 && threadIdx.y == 0) {}
  __device__ __forceinline__ long long ahead() const { return next0; }
  // Whether the current group has rows; if so the lead takes the ticket of the group after it
  // (or after the next, loading ahead).
  __device__ __forceinline__ bool more(long long n_rows) {
    if (row0 >= n_rows) return false;
    if (lead) ticket = atomicAdd(counter, 1ull);
    return true;
  }
  __device__ __forceinline__ void publish(int it) {
    if (lead) {
      dealt_groups()[it & 1] =
          static_cast<long long>(gridDim.x * (AHEAD ? 2ull : 1ull) + ticket) * Part::RPB;
    }
  }
  // On to the next iteration's group, at the end of iteration it.
  __device__ __forceinline__ void advance(int it) {
    if constexpr (BARRIER) {
      publish(it);
      __syncthreads();
    }
    if constexpr (AHEAD) {
      row0 = next0;
      next0 = dealt_groups()[it & 1];
    } else {
      row0 = dealt_groups()[it & 1];
    }
  }
  // The first row group of iteration it + 1, which publish(it) wrote before a row
  // reduction's barrier that has passed: what advance(it) will read.
  __device__ __forceinline__ long long dealt(int it) const {
    static_assert(!AHEAD && !BARRIER, "the next group is published a row ahead, or at the end");
    return dealt_groups()[it & 1];
  }
  __device__ __forceinline__ void finish() {
    if (!lead) return;
    __threadfence();  // this block's tickets are taken before it counts itself done
    if (atomicAdd(counter + 1, 1ull) == gridDim.x - 1) {
      *reinterpret_cast<ulonglong2*>(counter) = make_ulonglong2(0, 0);  // both, 16-byte aligned
    }
  }
};

// The vector a pass visits: the thread's b-th vector of the part, j-th of the row, k-th of
// the block's part; through a staging ring, also its slot and its index there; e, the row's
// element in its first lane (j * VEC - the row's skew). An EdgeVisit is a skewed row's vector
// that holds elements outside the row (e < 0 or e + VEC > H): its reads, reductions and stores
// take only the row's elements, in pieces of Part::SKEW.
struct Visit {
  static constexpr bool EDGE = false;
  int b;
  int j;
  int k;
  int slot;
  int in_slot;
  int e;
};
struct EdgeVisit : Visit {
  static constexpr bool EDGE = true;
};

// Whether lane i of visit v is an element of the row (always, but in an edge).
template <typename Part, typename X>
__device__ __forceinline__ bool in_row(const X& v, int i) {
  if constexpr (X::EDGE) {
    return static_cast<unsigned>(v.e + i) < static_cast<unsigned>(Part::H);
  } else {
    return true;
  }
}

// One pass over the thread's vectors of its part: body(v) for each; `skew`, the row's
// (Part::skew), sends a skewed row's edges to body as EdgeVisits.
template <typename Part, typename Body>
__device__ __forceinline__ void for_each_vector(const Part& part, int skew, Body&& body) {
#pragma unroll Part::UNROLL
  for (int b = 0; b < Part::BATCH; ++b) {
    const int j = part.vector(b);
    if (!part.owns(j)) continue;
    const Visit v{b, j, j - part.first, 0, 0, j * Part::VEC - skew};
    if constexpr (Part::SKEW > 0) {
      if (Part::is_edge(b, v.e)) {
        body(EdgeVisit{v});
        continue;
      }
    }
    body(v);
  }
}

// A skewed row's vector from element e on, in pieces of Part::SKEW elements (each lies
// wholly in or out of the row): piece k from get(e + k), where EDGE only the row's pieces
// (the others zero).
template <typename Part, typename T, bool EDGE, typename Get>
__device__ __forceinline__ Vec<T, Part::VEC> gather_pieces(int e, Get&& get) {
  constexpr int P = Part::SKEW > 0 ? Part::SKEW : 1;
  Vec<T, Part::VEC> x{};
#pragma unroll
  for (int k = 0; k < Part::VEC; k += P) {
    if (!EDGE || static_cast<unsigned>(e + k) < static_cast<unsigned>(Part::H)) {
      const Vec<T, P> piece = get(e + k);
#pragma unroll
      for (int i = 0; i < P; ++i) x.v[k + i] = piece.v[i];
    }
  }
  return x;
}

// The row's pieces of vector x, whose lane 0 is element e: put(e + k, piece k) for each.
template <typename Part, typename T, typename Put>
__device__ __forceinline__ void scatter_pieces(const Vec<T, Part::VEC>& x, int e, Put&& put) {
  constexpr int P = Part::SKEW > 0 ? Part::SKEW : 1;
#pragma unroll
  for (int k = 0; k < Part::VEC; k += P) {
    if (static_cast<unsigned>(e + k) < static_cast<unsigned>(Part::H)) {
      Vec<T, P> piece;
#pragma unroll
      for (int i = 0; i < P; ++i) piece.v[i] = x.v[k + i];
      put(e + k, piece);
    }
  }
}

// The row's elements of the vector at element e of `row` (others zero): a skewed row's edge.
template <typename Part, typename T>
__device__ __forceinline__ Vec<T, Part::VEC> load_edge(const T* row, int e) {
  return gather_pieces<Part, T, true>(e, [&](int at) { return load<Part::SKEW>(row + at); });
}

// The vector at element e of `row`, visited in round b: an edge's elements of the row, or the
// whole vector.
template <typename Part, typename T>
__device__ __forceinline__ Vec<T, Part::VEC> load_vector(const T* row, int e, int b) {
  if constexpr (Part::SKEW > 0) {
    if (Part::is_edge(b, e)) return load_edge<Part>(row, e);
  }
  return load<Part::VEC>(row + e);
}

// Vector x of visit v into its place in `row`: whole (PTX: by store_vector), or an edge's
// elements of the row, in pieces of Part::SKEW (scatter_pieces written out: through its
// callable, ptxas took softmax_bwd 4099 from 46 registers to 53).
template <typename Part, bool PTX, typename T, typename X>
__device__ __forceinline__ void store_visit(T* row, const X& v, const Vec<T, Part::VEC>& x) {
  if constexpr (X::EDGE) {
    constexpr int P = Part::SKEW;
#pragma unroll
    for (int k = 0; k < Part::VEC; k += P) {
      if (static_cast<unsigned>(v.e + k) < static_cast<unsigned>(Part::H)) {
        Vec<T, P> piece;
#pragma unroll
        for (int i = 0; i < P; ++i) piece.v[i] = x.v[k + i];
        store_vector<P>(row + v.e + k, piece);  // one store of the piece (plain ones split)
      }
    }
  } else if constexpr (PTX) {
    store_vector<Part::VEC>(row + v.e, x);
  } else {
    store<Part::VEC>(row + v.e, x);
  }
}

// One value per row ([rows, 1] inputs), 0 past the last row.
template <typename C, typename T>
__device__ __forceinline__ C row_value(const T* g, long long row, bool valid) {
  return valid ? static_cast<C>(to_compute(g[row])) : C(0);
}

// The shift of a row's variance sums (fuser/schedulers/row_variance.py): the mean of the row's
// first N elements (N: the lanes of a warp a row has, at most hidden), from element `at` on,
// summed by every warp in the same order, so each thread of the row (and each block of its
// cluster) holds the same value. 0 where it is not finite (an inf there would make every
// shifted element NaN, where the exact form's mean is inf).
template <typename Part, typename T>
__device__ __forceinline__ float row_shift(const Part& part, const T* g, long long at, bool valid) {
  constexpr int LANES = Part::TPR < 32 ? Part::TPR : 32;
  constexpr int N = LANES < Part::H ? LANES : Part::H;
  const int lane = part.tx % LANES;
  const float first = row_value<float>(g, at + lane, valid && lane < N);
  const float k = warp_reduce<LANES>(first, Sum{}) * (1.0f / N);
  return isfinite(k) ? k : 0.0f;
}

// ----- row buffers ([rows, hidden] inputs): at(v) is vector v of the current row -----

// Kept in registers: the thread's vectors of the row, all loads issued before any is used.
template <typename T, typename Part>
struct RowInRegisters {
  using V = Vec<T, Part::VEC>;
  V v[Part::BATCH];

  __device__ __forceinline__ RowInRegisters(const Part& part, const T* g, long long row,
                                            bool valid) {
    const T* r = g + row * Part::H;
    const int skew = Part::skew(row);
#pragma unroll
    for (int b = 0; b < Part::BATCH; ++b) {
      const int j = part.vector(b);
      const int e = j * Part::VEC - skew;
      v[b] = load_or_zero<T, Part::VEC>(valid && part.owns(j),
                                        [&] { return load_vector<Part>(r, e, b); });
    }
  }
  __device__ __forceinline__ V at(const Visit& x) const { return v[x.b]; }
};

// How a shared row buffer is filled: by cp.async of one vector per thread (each thread then
// reads back only what it copied), by cp.async of the 16-byte chunks from the boundary at or
// below the row's start (threads read each other's chunks: a barrier comes between), or
// through registers (vectors too narrow for cp.async).
enum class Copy { VECTORS, CHUNKS, REGISTERS };

// Kept in shared memory: row slot `slot` (of STAGES x RPB) of SLOT_BYTES each; copy() fills a
// slot, ready() points the buffer at the row in its slot.
template <typename T, typename Part, Copy COPY, int SLOT_BYTES>
struct RowInSmem {
  static_assert(Part::SKEW == 0 || COPY != Copy::CHUNKS,
                "a skewed row's vectors are whole: each thread copies its own");
  using V = Vec<T, Part::VEC>;
  static constexpr int ROUNDS = (SLOT_BYTES / 16 + Part::TPR - 1) / Part::TPR;  // chunks each
  unsigned char* base;
  const T* g;
  const V* row = nullptr;

  __device__ __forceinline__ RowInSmem(unsigned char* base, const T* g) : base(base), g(g) {}

  // Row r of n_rows (nothing past the last row).
  __device__ __forceinline__ void copy(const Part& part, int slot, long long r, long long n_rows) {
    if (r >= n_rows) return;
    unsigned char* dst = base + slot * SLOT_BYTES;
    if constexpr (COPY == Copy::CHUNKS) {
      copy_row_chunks<ROUNDS>(dst, g + r * Part::H + part.first * Part::VEC, part.template bytes<T>(),
                              part.tx, Part::TPR, r + 1 == n_rows);
    } else {
      const T* src = g + r * Part::H;
      const int skew = Part::skew(r);
#pragma unroll
      for (int b = 0; b < Part::BATCH; ++b) {
        const int j = part.vector(b);
        const int e = j * Part::VEC - skew;
        if (part.owns(j)) {
          V* to = reinterpret_cast<V*>(dst) + (j - part.first);
          if constexpr (COPY == Copy::VECTORS) {
            copy_vector(to, src, e, Part::may_edge(b) && r + 1 == n_rows);
          } else {
            *to = load_vector<Part>(src, e, b);
          }
        }
      }
    }
  }
  // cp.async of the vector at element e of `src` into `to`. A skewed row's vectors reach
  // past its ends into the rows beside it; past the tensor's end (`last`: its last row, a
  // round that may hold its edge) only the row's bytes are read (copy_tail), and a vector
  // wholly past the row is not copied.
  __device__ __forceinline__ void copy_vector(V* to, const T* src, int e, bool last) {
    if constexpr (Part::SKEW > 0) {
      if (last && e + Part::VEC > Part::H) {
        if (e < Part::H) {
          copy_tail(reinterpret_cast<unsigned char*>(to),
                    reinterpret_cast<const unsigned char*>(src + e),
                    (Part::H - e) * static_cast<int>(sizeof(T)));
        }
        return;
      }
    }
    cp_async<sizeof(V)>(to, src + e);
  }
  // Row r's copy of the vector a row's last pass has just read (x, `read` its value; a zero
  // vector where the pass does not read this buffer), into its place: a thread reads back only
  // what it copied (Copy::VECTORS), so the next row loads while this one's last pass runs,
  // with no barrier.
  __device__ __forceinline__ void refill(const Visit& x, const V& read, int slot, long long r,
                                         long long n_rows) {
    static_assert(COPY == Copy::VECTORS && Part::SKEW == 0,
                  "only a thread's own vectors are refilled, and only where they divide rows");
    if (r < n_rows) {
      cp_async_after(reinterpret_cast<V*>(base + slot * SLOT_BYTES) + x.k,
                     g + r * Part::H + x.j * Part::VEC, read);
    }
  }
  __device__ __forceinline__ void ready(const Part& part, int slot, long long r) {
    const unsigned char* p = base + slot * SLOT_BYTES;
    if constexpr (COPY == Copy::CHUNKS) {
      p += row_offset(g, (r * Part::H + part.first * Part::VEC) * static_cast<long long>(sizeof(T)));
    }
    row = reinterpret_cast<const V*>(p);
  }
  __device__ __forceinline__ V at(const Visit& x) const { return row[x.k]; }
};

// Re-read from global memory in every pass (mostly from L2, where the row just was).
template <typename T, typename Part>
struct RowInGlobal {
  using V = Vec<T, Part::VEC>;
  const T* g;
  const T* row = nullptr;
  bool valid = false;

  __device__ __forceinline__ explicit RowInGlobal(const T* g) : g(g) {}
  __device__ __forceinline__ void ready(long long r, bool v) {
    row = g + r * Part::H;
    valid = v;
  }
  __device__ __forceinline__ V at(const Visit& x) const {
    return load_or_zero<T, Part::VEC>(valid, [&] { return load<Part::VEC>(row + x.e); });
  }
  __device__ __forceinline__ V at(const EdgeVisit& x) const {
    return load_or_zero<T, Part::VEC>(valid, [&] { return load_edge<Part>(row, x.e); });
  }
};

}  // namespace fm
