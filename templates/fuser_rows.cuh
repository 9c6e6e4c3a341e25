// fuser row kernels' device library: the parts a row kernel (row_kernel.cu.j2) is assembled
// from, as templates with compile-time parameters. The scheduler decides where each buffer
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
// Skewed rows (SKEW > 0, a whole row per block): VEC does not divide H, so row r starts
// skew(r) = r * H % VEC elements past a VEC-element boundary (a multiple of SKEW, which divides
// H and VEC). Its vectors are then the VEC-element ones of the tensor, from the boundary at or
// below the row's start: vector j holds the row's elements j * VEC - skew(r) on, whole vectors
// in every tensor whatever its element size (every base is 16-byte aligned), and the row's
// first and last vectors (edges) hold elements of the rows beside it, which are masked.
template <int H_, int VEC_, int TPR_, int RPB_, int BATCH_, int UNROLL_, int CLUSTER_, int SKEW_>
struct RowPart {
  static constexpr int H = H_, VEC = VEC_, TPR = TPR_, RPB = RPB_, BATCH = BATCH_;
  static constexpr int UNROLL = UNROLL_, CLUSTER = CLUSTER_, SKEW = SKEW_;
  static_assert(SKEW == 0 || (CLUSTER == 1 && H % SKEW == 0 && VEC % SKEW == 0 && SKEW < VEC),
                "skewed rows are whole rows of a block, in vectors of a multiple of SKEW");
  static constexpr int NV = SKEW ? (H + 2 * VEC - SKEW - 1) / VEC : H / VEC;
  static constexpr int PART = (NV + CLUSTER - 1) / CLUSTER;  // vectors a block keeps per row
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
  // Whether round b may visit an edge: the first vector of the row or one reaching its end.
  static __device__ __forceinline__ bool may_edge(int b) {
    return SKEW && (b == 0 || (b + 1) * TPR * VEC > H);
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
      v[b] = (valid && part.owns(j)) ? load_vector<Part>(r, e, b) : V{};
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
    return valid ? load<Part::VEC>(row + x.e) : V{};
  }
  __device__ __forceinline__ V at(const EdgeVisit& x) const {
    return valid ? load_edge<Part>(row, x.e) : V{};
  }
};

// ----- the staging ring: re-read rows streamed in chunks through shared-memory slots -----

// Chunk q of the block's stream: chunk c (of CHUNKS) of its row `row`, into slot q % DEPTH.
struct RingChunk {
  long long row;
  int c;
  int slot;
  int vectors;  // vectors of the block's part in this chunk (the tail chunk holds fewer)
};

// Every pass over a row reads its CHUNKS chunks of CV vectors (UNITS per thread) in turn; the
// q-th chunk the block reads is in slot q % DEPTH, copied DEPTH chunks earlier. BULK rings
// are filled by thread 0 through the bulk copy engine, one mbarrier per slot counting
// VECTOR_BYTES per vector of every ring buffer; the others by every thread's own cp.async.
template <typename Part, bool BULK, int DEPTH, int UNITS, int CHUNKS, int PASSES,
          int VECTOR_BYTES>
struct StagingRing {
  static_assert(!BULK || FM_ARCH >= 900,
                "this kernel's staging ring is filled by cp.async.bulk on mbarriers, which needs "
                "sm_90");
  static constexpr int CV = UNITS * Part::TPR;
  unsigned long long* full;  // BULK: the slots' mbarriers
  long long row0;
  long long row_stride;
  int q = 0;  // chunks this block has read

  __device__ __forceinline__ StagingRing(unsigned char* barriers, const Part& part)
      : full(reinterpret_cast<unsigned long long*>(barriers)), row0(part.first_row()),
        row_stride(part.row_stride()) {
    if constexpr (BULK) {
      if (part.tx == 0 && part.ty == 0) {
        for (int k = 0; k < DEPTH; ++k) mbarrier_init(&full[k], 1);  // the copying thread
        fence_mbarrier_init();  // the initialised barriers are visible to the copy engine
      }
      __syncthreads();
    }
  }
  __device__ __forceinline__ RingChunk chunk(const Part& part, int n) const {
    const long long row = row0 + static_cast<long long>(n / (CHUNKS * PASSES)) * row_stride;
    const int c = n % CHUNKS;
    return RingChunk{row, c, n % DEPTH, max(0, min(CV, (part.end - part.first) - c * CV))};
  }
  // Issue the copies of chunk n (nothing past the last row).
  template <typename Fill>
  __device__ __forceinline__ void fill(const Part& part, int n, long long n_rows, Fill&& f) {
    const RingChunk ch = chunk(part, n);
    if constexpr (BULK) {
      if (part.tx != 0 || ch.row >= n_rows) return;
      mbarrier_expect_tx(&full[ch.slot], ch.vectors * VECTOR_BYTES);
      if (ch.vectors > 0) f(ch);
    } else {
      if (ch.row < n_rows) f(ch);
      cp_async_commit();
    }
  }
  template <typename Fill>
  __device__ __forceinline__ void start(const Part& part, long long n_rows, Fill&& f) {
    for (int n = 0; n < DEPTH; ++n) fill(part, n, n_rows, f);  // the first DEPTH chunks
  }
  // One pass over the row, chunk by chunk (UNROLL chunks unrolled): wait for the chunk, run
  // body(v) over its vectors, then refill the slot DEPTH chunks ahead once every thread is
  // done with it.
  template <int UNROLL, typename Fill, typename Body>
  __device__ __forceinline__ void pass(const Part& part, int skew, long long n_rows, Fill&& f,
                                       Body&& body) {
#pragma unroll UNROLL
    for (int c = 0; c < CHUNKS; ++c, ++q) {
      const int slot = q % DEPTH;
      if constexpr (BULK) {
        mbarrier_wait(&full[slot], (q / DEPTH) & 1);  // the chunk has landed
      } else {
        cp_async_wait<DEPTH - 1>();  // this thread's copies of the chunk have landed
      }
#pragma unroll
      for (int u = 0; u < UNITS; ++u) {
        const int b = c * UNITS + u;
        const int j = part.vector(b);
        if (part.owns(j)) {
          const int e = j * Part::VEC - skew;
          body(Visit{b, j, j - part.first, slot, u * Part::TPR + part.tx, e});
        }
      }
      __syncthreads();  // every thread is done with the slot
      fill(part, q + DEPTH, n_rows, f);
    }
  }
};

// A row buffer streamed through the ring: DEPTH slots of SLOT_VECTORS vectors each.
template <typename T, typename Part, bool BULK, int SLOT_VECTORS>
struct RowInRing {
  static_assert(Part::SKEW == 0, "a staging ring streams vectors that divide the row");
  using V = Vec<T, Part::VEC>;
  V* slots;
  const T* g;

  __device__ __forceinline__ RowInRing(unsigned char* slots, const T* g)
      : slots(reinterpret_cast<V*>(slots)), g(g) {}
  template <typename Ring>
  __device__ __forceinline__ void fill(const Part& part, const RingChunk& ch, Ring& ring) {
    const T* src = g + ch.row * Part::H + (part.first + ch.c * Ring::CV) * Part::VEC;
    V* dst = slots + ch.slot * SLOT_VECTORS;
    if constexpr (BULK) {
      bulk_copy(dst, src, ch.vectors * static_cast<int>(sizeof(V)), &ring.full[ch.slot]);
    } else {
#pragma unroll
      for (int u = 0; u < Ring::CV / Part::TPR; ++u) {
        const int v = u * Part::TPR + part.tx;
        if (v < ch.vectors) cp_async<sizeof(V)>(dst + v, src + v * Part::VEC);
      }
    }
  }
  __device__ __forceinline__ V at(const Visit& x) const {
    return slots[x.slot * SLOT_VECTORS + x.in_slot];
  }
};

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

// ----- reductions over a row: its warps, its block's warps, its cluster's blocks -----

// One value being reduced, and how.
template <typename T, typename Op>
struct Reduced {
  T& value;
  Op op;
};
template <typename T, typename Op>
__device__ __forceinline__ Reduced<T, Op> reduced(T& value, Op op) {
  return Reduced<T, Op>{value, op};
}

// Reduces the values of one inner-reduction level (up to WIDTH of them) over each row's
// threads: shuffles within warps; across a row's warps, lane 0 of each posts its partial to
// `scratch` and, after one barrier, every thread combines the row's partials in warp order;
// across a cluster, thread 0 of each row sends the block's total to every block of the
// cluster (itself too) with store_to_peer, each block waits on its own mbarrier for all
// CLUSTER totals and combines them in rank order (the same result, in the same order, in
// each). No cluster barrier per level: its release would fence every global store in flight.
// Scratch, the exchange's slots and its two mbarriers have two parities, alternated call by
// call: a block sends level r + 2 only after every block has sent it level r + 1, which each
// does after reading level r, so no slot or phase is written while it is still read. Slots
// are of T, the widest type among the reductions; a partial of another type keeps its own
// type in its slot (the exchange's words are 4 or 8 bytes).
// The word a cluster exchange sends a partial of N bytes in (N <= 8).
template <int N>
struct WordOf {
  using type = unsigned;
};
template <>
struct WordOf<8> {
  using type = unsigned long long;
};

template <typename T, typename Part, int WIDTH>
struct RowReducer {
  static constexpr int WARPS = Part::TPR > 32 ? Part::TPR / 32 : 1;
  using Word = typename WordOf<sizeof(T)>::type;
  static constexpr int SLOTS = WIDTH * Part::RPB;  // words a block sends per level
  T* scratch;                // 2 parities x WIDTH x RPB x WARPS (rows of more than one warp)
  unsigned long long* bars;  // 2 parities of mbarriers (clusters)
  Word* words;               // 2 parities x CLUSTER ranks x WIDTH x RPB (clusters)
  int round = 0;

  // Clusters: thread 0 initializes the mbarriers, and one cluster barrier makes them visible
  // to the peers before any sends (every thread of the block constructs the reducer).
  __device__ __forceinline__ RowReducer(unsigned char* scratch, unsigned char* exchange)
      : scratch(reinterpret_cast<T*>(scratch)),
        bars(reinterpret_cast<unsigned long long*>(exchange)),
        words(Part::CLUSTER > 1 ? reinterpret_cast<Word*>(exchange + 2 * sizeof(*bars))
                                : nullptr) {
    if constexpr (Part::CLUSTER > 1) {
      if (threadIdx.x == 0 && threadIdx.y == 0) {
        mbarrier_init(&bars[0], 1);
        mbarrier_init(&bars[1], 1);
        fence_mbarrier_init();
      }
      cluster_sync();
    }
  }

  template <typename... Values>
  __device__ __forceinline__ void operator()(const Part& part, Values... values) {
    ((values.value = warp_reduce<(Part::TPR < 32 ? Part::TPR : 32)>(values.value, values.op)), ...);
    const int parity = round & 1;
    const unsigned phase = (round >> 1) & 1;
    ++round;
    if constexpr (Part::TPR > 32) {
      T* slot = scratch + parity * (WIDTH * Part::RPB * WARPS);
      if ((part.tx & 31) == 0) {
        int n = 0;
        ((ref(slot, (n++ * Part::RPB + part.ty) * WARPS + part.tx / 32, values.value) =
              values.value), ...);
      }
      __syncthreads();
      int n = 0;
      ((values.value = combine<WARPS>(&ref(slot, (n++ * Part::RPB + part.ty) * WARPS,
                                           values.value), values.op)), ...);
    }
    if constexpr (Part::CLUSTER > 1) {
      Word* level = words + parity * (Part::CLUSTER * SLOTS);
      if (part.tx == 0 && part.ty == 0) {
        mbarrier_expect_tx(&bars[parity], Part::CLUSTER * SLOTS * static_cast<int>(sizeof(Word)));
      }
      if (part.tx == 0) {
        int n = 0;
        ((send(level + part.rank * SLOTS + n++ * Part::RPB + part.ty, values.value,
               &bars[parity]), ...));
      }
      mbarrier_wait(&bars[parity], phase);
      int n = 0;
      ((values.value = combine_ranks(level + n++ * Part::RPB + part.ty, values.value,
                                     values.op)), ...);
    }
  }

  // Slot `index` of `base`, as a V (slots are sizeof(T) >= sizeof(V) bytes apart).
  static __device__ __forceinline__ T& ref(T* base, int index, const T&) { return base[index]; }
  template <typename V>
  static __device__ __forceinline__ V& ref(T* base, int index, const V&) {
    return *reinterpret_cast<V*>(base + index);
  }
  // N partials of V, sizeof(T) bytes apart, combined in order.
  template <int N, typename V, typename Op>
  static __device__ __forceinline__ V combine(const V* first, Op op) {
    V total = first[0];
#pragma unroll
    for (int w = 1; w < N; ++w) {
      total = op(total, *reinterpret_cast<const V*>(reinterpret_cast<const T*>(first) + w));
    }
    return total;
  }
  // `value` into word `slot` of every block of the cluster (this one's included).
  template <typename V>
  static __device__ __forceinline__ void send(Word* slot, const V& value,
                                              unsigned long long* bar) {
    Word word = 0;
    memcpy(&word, &value, sizeof(V));
#pragma unroll
    for (unsigned q = 0; q < Part::CLUSTER; ++q) store_to_peer(slot, word, bar, q);
  }
  // The CLUSTER ranks' words of one value (SLOTS apart), combined in rank order.
  template <typename V, typename Op>
  static __device__ __forceinline__ V combine_ranks(const Word* first, const V&, Op op) {
    V total;
    memcpy(&total, &first[0], sizeof(V));
#pragma unroll
    for (int q = 1; q < Part::CLUSTER; ++q) {
      V next;
      memcpy(&next, &first[q * SLOTS], sizeof(V));
      total = op(total, next);
    }
    return total;
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
#pragma unroll UNROLL
  for (int b = 0; b < Part::BATCH; ++b) {
    const int j = part.vector(b);
    if (part.owns(j)) {
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const int c = (j - part.first) * Part::VEC + i - skew;
        if (Part::SKEW == 0 || static_cast<unsigned>(c) < static_cast<unsigned>(Part::H)) f(b, c, i);
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

}  // namespace fm
