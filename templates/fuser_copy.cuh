// fuser device helpers: copies into shared memory (cp.async, the bulk copy engine on
// mbarriers), and the one-instruction vector store to global memory.
#pragma once
#include "fuser_math.cuh"

namespace fm {

// ----- stores to global memory -----

// A vector store to global memory (st.global: never pass a shared-memory pointer) of 4, 8 or
// 16 bytes written as one PTX instruction. In blocks of several rows, or with a batch loop
// not fully unrolled, the compiler split plain vector stores into element stores interleaved
// with the math (16 four-byte stores per fp32 row pass; such kernels ran at a third of the
// bandwidth). The inline PTX is an ordering point for the compiler, which costs registers
// elsewhere; codegen picks this store only where the plain one was split.
__device__ __forceinline__ void store_bits(void* p, unsigned a) {
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(a) : "memory");
}
__device__ __forceinline__ void store_bits(void* p, uint2 a) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(p), "r"(a.x), "r"(a.y) : "memory");
}
__device__ __forceinline__ void store_bits(void* p, uint4 a) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(a.x), "r"(a.y),
               "r"(a.z), "r"(a.w) : "memory");
}

template <int BYTES> struct Bits { using type = void; };  // 1 or 2 bytes: a plain store
template <> struct Bits<4> { using type = unsigned; };
template <> struct Bits<8> { using type = uint2; };
template <> struct Bits<16> { using type = uint4; };

template <int N, typename T>
__device__ __forceinline__ void store_vector(T* p, const Vec<T, N>& x) {
  using B = typename Bits<sizeof(T) * N>::type;
  if constexpr (sizeof(T) * N >= 4) {
    B bits;
    memcpy(&bits, &x, sizeof(B));
    store_bits(p, bits);
  } else {
    store<N>(p, x);
  }
}

// store_vector in accesses of at most 16 bytes, to 16-byte aligned memory (load_pieces'
// partner).
template <int N, typename T>
__device__ __forceinline__ void store_pieces(T* p, const Vec<T, N>& x) {
  constexpr int P = sizeof(T) * N > 16 ? 16 / static_cast<int>(sizeof(T)) : N;
#pragma unroll
  for (int k = 0; k < N; k += P) {
    Vec<T, P> piece;
#pragma unroll
    for (int i = 0; i < P; ++i) piece.v[i] = x.v[k + i];
    store_vector<P>(p + k, piece);
  }
}

// ----- which row of an input a kernel row reads -----

// The row of an input that spans a run of the row axes only (a [batch, hidden] scale over
// rows [batch, seq]) that the kernel's row r reads: (r / after) % count, `after` the product
// of the row axes past the run and `count` the run's (analysis.RowRun). The kernel passes
// it, and `count` as the input's rows, where it passes r and n_rows for the other inputs
// (row_codegen.RowAccess): the row buffers' code is the same for both.
struct RepeatedRows {
  long long after;
  long long count;
  __device__ __forceinline__ long long source_row(long long r) const {
    return (r / after) % count;
  }
};

// The rows of such an input that kernel rows r, r + 1, r + 2, ... read: one division at r,
// then a step per row (a pointwise kernel whose vectors cross rows reads them in turn).
struct RepeatedRowWalk {
  long long after;
  long long count;
  long long within;  // r % after
  long long source;  // the input's row: (r / after) % count
  __device__ __forceinline__ RepeatedRowWalk(const RepeatedRows& rows, long long r)
      : after(rows.after), count(rows.count), within(r % rows.after),
        source(rows.source_row(r)) {}
  __device__ __forceinline__ void next() {
    if (++within == after) {
      within = 0;
      if (++source == count) source = 0;
    }
  }
};

// ----- cp.async: global to shared without passing through registers (sm_80+) -----

template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem_src),
                 "n"(BYTES));
  }
}
// cp.async of a vector (4, 8 or 16 bytes) into the place this thread has just read it from,
// with every word of what it read as an operand: the compiler must have the whole read done
// before it issues the copy (a memory clobber would also have held back every later shared
// load, and cost rmsnorm_bwd 8192 62 registers). The operands only name the order; they are
// a comment in the instruction.
template <typename V>
__device__ __forceinline__ void cp_async_after(void* smem_dst, const void* gmem_src,
                                               const V& read) {
  static_assert(sizeof(V) == 4 || sizeof(V) == 8 || sizeof(V) == 16, "cp.async sizes");
  unsigned w[4] = {0u, 0u, 0u, 0u};
  memcpy(w, &read, sizeof(V));
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  if constexpr (sizeof(V) == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16; // after %2 %3 %4 %5\n" ::"r"(dst),
                 "l"(gmem_src), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2; // after %3 %4\n" ::"r"(dst),
                 "l"(gmem_src), "n"(int(sizeof(V))), "r"(w[0]), "r"(w[1]));
  }
}

// 16 bytes into shared memory, of which the first `src_bytes` (1 to 16) are read from global
// memory and the rest are zero.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}

// The last `left` bytes (1 to 15) of a tensor's last row, from a 16-byte boundary: 8- and 4-byte
// cp.async, then a 2-byte and a 1-byte copy through a register. A 16-byte cp.async with a
// source size of `left` reads only those bytes, but compute-sanitizer's initcheck counts all
// 16 as read, and past the tensor's end no one wrote them: initcheck reported those reads.
// Rows before the last use that cp.async (what follows their end is the next row).
__device__ __forceinline__ void copy_tail(unsigned char* dst, const unsigned char* src, int left) {
  int at = 0;
  if (left >= 8) {
    cp_async<8>(dst, src);
    at = 8;
  }
  if (left - at >= 4) {
    cp_async<4>(dst + at, src + at);
    at += 4;
  }
  if (left - at >= 2) {
    *reinterpret_cast<unsigned short*>(dst + at) = *reinterpret_cast<const unsigned short*>(src + at);
    at += 2;
  }
  if (left - at >= 1) dst[at] = src[at];
}

// Copy one row (or a cluster block's part of it) of `bytes` bytes starting at `row` (any
// address) into `slot` as the 16-byte chunks from the boundary at or below `row`: thread x of
// `threads` copies chunks x, x + threads, ... (ROUNDS of them); the partial chunk at the end
// reads only the row's bytes. The row then starts row_offset() bytes into the slot. A part
// with no bytes (the last blocks of a cluster may own none) copies nothing: its address may
// lie past the tensor's end. `last`: the tensor's last row (copy_tail for its end).
template <int ROUNDS>
__device__ __forceinline__ void copy_row_chunks(unsigned char* slot, const void* row, int bytes,
                                                int x, int threads, bool last) {
  if (bytes <= 0) return;
  const unsigned long long start = reinterpret_cast<unsigned long long>(row);
  const unsigned char* base = reinterpret_cast<const unsigned char*>(start & ~15ull);
  const int span = static_cast<int>(start & 15ull) + bytes;  // bytes from base to the row's end
#pragma unroll
  for (int c = 0; c < ROUNDS; ++c) {
    const int k = c * threads + x;
    const int left = span - 16 * k;
    if (left >= 16 || (left > 0 && !last)) {
      cp_async_16(slot + 16 * k, base + 16 * k, left < 16 ? left : 16);
    } else if (left > 0) {
      copy_tail(slot + 16 * k, base + 16 * k, left);
    }
  }
}

// Where the row `byte_offset` bytes past `base` starts in its 16-byte chunks (integer math:
// the row may lie past the tensor's end for a block's idle row slot, which is never read).
__device__ __forceinline__ int row_offset(const void* base, long long byte_offset) {
  return static_cast<int>((reinterpret_cast<unsigned long long>(base) + byte_offset) & 15ull);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

// ----- mbarriers and the bulk copy engine (sm_90): the staging ring's bulk fill -----
// One thread arrives on a slot's mbarrier announcing the bytes on their way (expect_tx), and
// hands the copies to the bulk copy engine (cp.async.bulk), which counts them off the barrier
// as they land; the phase completes when all have. Readers wait on the phase's parity.
// Sources, destinations and sizes are multiples of 16 bytes (the scheduler checks this).

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned arrivals) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)),
               "r"(arrivals) : "memory");
#endif
}
__device__ __forceinline__ void fence_mbarrier_init() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbarrier_expect_tx(unsigned long long* bar, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   smem_address(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy(void* smem_dst, const void* gmem_src, int bytes,
                                          unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_address(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_address(bar))
      : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
  unsigned done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_address(bar)), "r"(parity) : "memory");
  } while (!done);
#endif
}

}  // namespace fm
