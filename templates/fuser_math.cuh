// fuser device helpers: math on compute types, vector access, cp.async, reductions.
// Half and bfloat16 values are computed in float; casts to them round (round_half/round_bf16).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace fm {

// ----- element vectors: N elements moved by one load or store -----

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

// A plain vector store: the compiler keeps it whole in blocks of one row whose batch loop is
// fully unrolled, and schedules it freely.
template <int N, typename T>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& x) {
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

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

// ----- conversions between storage and compute types -----

__device__ __forceinline__ float to_compute(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_compute(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T to_compute(T x) { return x; }

template <typename S>
struct Storage {
  template <typename C>
  static __device__ __forceinline__ S from(C x) { return static_cast<S>(x); }
};
template <>
struct Storage<__nv_bfloat16> {
  template <typename C>
  static __device__ __forceinline__ __nv_bfloat16 from(C x) {
    return __float2bfloat16_rn(static_cast<float>(x));
  }
};
template <>
struct Storage<__half> {
  template <typename C>
  static __device__ __forceinline__ __half from(C x) {
    return __float2half_rn(static_cast<float>(x));
  }
};
template <typename S, typename C>
__device__ __forceinline__ S to_storage(C x) { return Storage<S>::from(x); }

__device__ __forceinline__ float round_bf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float round_half(float x) { return __half2float(__float2half_rn(x)); }

// ----- math, overloaded on the compute type -----

__device__ __forceinline__ float sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt(double x) { return ::sqrt(x); }
__device__ __forceinline__ float rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double rsqrt(double x) { return ::rsqrt(x); }
// exp(x) = 2^(x log2 e) on the special function unit: two instructions where expf takes about
// nine, as Triton's tl.exp does. Relative error: ex2.approx's 2 ulp plus |x| * 2^-24 from
// rounding x log2 e (6e-7 at |x| = 10), far inside float outputs' 1e-5; results below 2^-126
// flush to zero. softmax_fwd evaluates exp twice per element and was compute-bound with
// expf: 0.65 of the copy bandwidth at hidden 4096 on the H200, 0.75 with this.
__device__ __forceinline__ float exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
__device__ __forceinline__ double exp(double x) { return ::exp(x); }
__device__ __forceinline__ float log(float x) { return logf(x); }
__device__ __forceinline__ double log(double x) { return ::log(x); }
__device__ __forceinline__ float tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh(double x) { return ::tanh(x); }
__device__ __forceinline__ float pow(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow(double a, double b) { return ::pow(a, b); }
template <typename T>
__device__ __forceinline__ T pow(T a, T b) {  // integer power, b >= 0 (negative gives 0)
  T r = 1;
  if (b < 0) return a == 1 ? 1 : 0;
  for (; b > 0; b >>= 1, a *= a) {
    if (b & 1) r *= a;
  }
  return r;
}
__device__ __forceinline__ float reciprocal(float x) { return 1.0f / x; }
__device__ __forceinline__ double reciprocal(double x) { return 1.0 / x; }
template <typename T>
__device__ __forceinline__ T sigmoid(T x) { return T(1) / (T(1) + exp(-x)); }
template <typename T>
__device__ __forceinline__ T silu(T x) { return x / (T(1) + exp(-x)); }
template <typename T>
__device__ __forceinline__ T abs(T x) { return x < T(0) ? -x : x; }
template <typename T>
__device__ __forceinline__ T relu(T x) { return x > T(0) ? x : T(0); }
__device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double min(double a, double b) { return fmin(a, b); }
template <typename T>
__device__ __forceinline__ T max(T a, T b) { return a < b ? b : a; }
template <typename T>
__device__ __forceinline__ T min(T a, T b) { return b < a ? b : a; }

template <typename T>
__device__ __forceinline__ T lowest();
template <>
__device__ __forceinline__ float lowest<float>() { return -__int_as_float(0x7f800000); }
template <>
__device__ __forceinline__ double lowest<double>() {
  return -__longlong_as_double(0x7ff0000000000000LL);
}
template <>
__device__ __forceinline__ int lowest<int>() { return -2147483647 - 1; }
template <>
__device__ __forceinline__ long long lowest<long long>() { return -9223372036854775807LL - 1; }
template <>
__device__ __forceinline__ bool lowest<bool>() { return false; }

__device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }

// ----- reduction functors (ops.py REDUCTIONS names them) -----

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return max(a, b); }
};

// ----- warp reduction over groups of WIDTH lanes (WIDTH a power of two <= 32) -----

template <int WIDTH, typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2) {
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

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
// 16 bytes into shared memory, of which the first `src_bytes` (1 to 16) are read from global
// memory and the rest are zero: the last chunk of a row never reads past the row's end.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
}

// Copy one row (or a cluster block's part of it) of `bytes` bytes starting at `row` (any
// address) into `slot` as the 16-byte chunks from the boundary at or below `row`: thread x of
// `threads` copies chunks x, x + threads, ... (ROUNDS of them). The row then starts
// row_offset() bytes into the slot. A part with no bytes (the last blocks of a cluster may
// own none) copies nothing: its address may lie past the tensor's end.
template <int ROUNDS>
__device__ __forceinline__ void copy_row_chunks(unsigned char* slot, const void* row, int bytes,
                                                int x, int threads) {
  if (bytes <= 0) return;
  const unsigned long long start = reinterpret_cast<unsigned long long>(row);
  const unsigned char* base = reinterpret_cast<const unsigned char*>(start & ~15ull);
  const int span = static_cast<int>(start & 15ull) + bytes;  // bytes from base to the row's end
#pragma unroll
  for (int c = 0; c < ROUNDS; ++c) {
    const int k = c * threads + x;
    const int left = span - 16 * k;
    if (left > 0) cp_async_16(slot + 16 * k, base + 16 * k, left < 16 ? left : 16);
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

// ----- thread-block clusters (sm_90): rank, barrier, reads of a peer block's shared memory --
// Plain PTX, so that no cooperative_groups (and its CCCL headers) is needed under NVRTC.

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_index() {
  unsigned r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_count() {
  unsigned r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster arrives; shared-memory writes before it are
// visible to the peers' reads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned peer_address(const void* local, unsigned rank) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(address), "r"(rank));
  return remote;
}
__device__ __forceinline__ float load_peer(const float* local, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(peer_address(local, rank)));
  return v;
}
__device__ __forceinline__ double load_peer(const double* local, unsigned rank) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];\n" : "=d"(v) : "r"(peer_address(local, rank)));
  return v;
}

// ----- programmatic dependent launch (sm_90): the finalize launches while the row kernel ends --
// The row kernel allows its dependent grid to launch as soon as it starts; the finalize, launched
// with programmatic stream serialization, waits here until the row kernel has finished and its
// writes are visible. Without that launch attribute (or before sm_90) both are no-ops.

__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ----- magic zero -----
// An int that is 0 at run time but that the compiler cannot prove is 0. Adding it to the row
// index keeps NVRTC from hoisting every unrolled address computation out of the row loop (and
// holding them all in registers). It lives in static shared memory: the 128-byte static slot
// that every SmemPlan reserves. Written with atomicMin, as nvFuser does, so it is not optimised
// away.
__device__ __forceinline__ int magic_zero() {
  __shared__ int fuser_zero_s;
  if (threadIdx.x == 0 && threadIdx.y == 0) fuser_zero_s = 0;
  __syncthreads();
  atomicMin(&fuser_zero_s, static_cast<int>(threadIdx.x));
  return fuser_zero_s;
}

}  // namespace fm
