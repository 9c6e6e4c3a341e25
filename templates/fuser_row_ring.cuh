// The staging ring of fuser's row kernels: rows re-read each pass, streamed in chunks through
// a ring of shared-memory slots that copies refill ahead of the passes (RowInRing is the row
// buffer that reads through it). Built on fuser_rows.cuh's RowPart and visits.
#pragma once
#include "fuser_rows.cuh"

namespace fm {

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

// Chunk `ch` of the row a repeated input's buffer reads for it (RepeatedRows).
__device__ __forceinline__ RingChunk repeated(const RepeatedRows& rows, RingChunk ch) {
  ch.row = rows.source_row(ch.row);
  return ch;
}

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

}  // namespace fm
