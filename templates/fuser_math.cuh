// fuser device helpers: element vectors, conversions, math on compute types, reduction
// functors, the warp reduction. Half and bfloat16 values are computed in float; casts to them
// round (round_half / round_bf16). Copies and barriers are in fuser_copy.cuh, clusters in
// fuser_cluster.cuh, the parts row kernels are made of in fuser_rows.cuh.
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

// N elements in accesses of at most 16 bytes (the widest there is), from 16-byte aligned
// memory: a column operand of a pointwise kernel may be wider than the rows' vector (fp32
// statistics beside bf16 rows).
template <int N, typename T>
__device__ __forceinline__ Vec<T, N> load_pieces(const T* p) {
  constexpr int P = sizeof(T) * N > 16 ? 16 / static_cast<int>(sizeof(T)) : N;
  Vec<T, N> x;
#pragma unroll
  for (int k = 0; k < N; k += P) {
    const Vec<T, P> piece = load<P>(p + k);
#pragma unroll
    for (int i = 0; i < P; ++i) x.v[k + i] = piece.v[i];
  }
  return x;
}

// A plain vector store: the compiler keeps it whole in blocks of one row whose batch loop is
// fully unrolled, and schedules it freely (fm::store_vector in fuser_copy.cuh is the other).
template <int N, typename T>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& x) {
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

// ----- conversions between storage and compute types -----

__device__ __forceinline__ float to_compute(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_compute(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T to_compute(T x) { return x; }

// The vector `load()` returns where `keep`, else zeros. Chosen element by element, a vector of
// 16-bit elements cost a PRMT for each half of each word (ptxas merged the halves of the
// predicated load into registers it had zeroed half by half), so those are chosen in 32-bit
// words. Other element types keep the plain choice: through words, a vector of bools was
// loaded behind a branch and its bytes re-packed one by one.
template <typename T, int N, typename Load>
__device__ __forceinline__ Vec<T, N> load_or_zero(bool keep, Load&& load) {
  if constexpr (sizeof(T) == 2 && N % 2 == 0) {
    Vec<unsigned, N / 2> words{};
    if (keep) {
      const Vec<T, N> x = load();
      memcpy(&words, &x, sizeof(words));
    }
    Vec<T, N> x;
    memcpy(&x, &words, sizeof(x));
    return x;
  } else {
    return keep ? load() : Vec<T, N>{};
  }
}

// Element i of a vector, in the compute type. Two bf16 elements share a 32-bit word and a
// bf16 is the top half of its float, so the word's high element is the word with its low
// half cleared (one LOP3) and the low one the word shifted up (one SHF), where converting
// an element taken out of the word costs a PRMT and a SHF for the high one. i is a constant
// wherever it is called (an unrolled loop over the vector), so the branch folds away.
// Vectors of two elements keep the plain conversion: they are the step of fusions of many
// inputs (base.pick_vec caps the bytes a step reads), whose elements ptxas reads from shared
// memory one at a time as it adds them; read as words, a 128-input sum kept every input's
// word live across the step and spilled.
template <typename T, int N>
__device__ __forceinline__ auto element(const Vec<T, N>& x, int i) { return to_compute(x.v[i]); }

template <int N>
__device__ __forceinline__ float element(const Vec<__nv_bfloat16, N>& x, int i) {
  if constexpr (N % 2 == 0 && N >= 4) {
    unsigned word;
    memcpy(&word, &x.v[i & ~1], sizeof(word));
    return __uint_as_float(i & 1 ? word & 0xffff0000u : word << 16);
  } else {
    return __bfloat162float(x.v[i]);
  }
}

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
// nine, as Triton's tl.exp does (softmax_fwd was compute-bound with expf: bench/TUNING.md).
// Relative error: ex2.approx's 2 ulp plus |x| * 2^-24 from rounding x log2 e (6e-7 at
// |x| = 10), far inside float outputs' 1e-5; results below 2^-126 flush to zero.
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
// relu, max and min propagate NaN as torch does (fmaxf / fminf would drop it): relu(NaN) is NaN,
// and a NaN anywhere in a max / min reduction makes the result NaN. For float, PTX's max.NaN /
// min.NaN (sm_80 and later) is the same one instruction as fmaxf.
template <typename T>
__device__ __forceinline__ T relu(T x) { return x < T(0) ? T(0) : x; }
__device__ __forceinline__ float max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float min(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ double max(double a, double b) {
  return isnan(a) || isnan(b) ? a + b : fmax(a, b);
}
__device__ __forceinline__ double min(double a, double b) {
  return isnan(a) || isnan(b) ? a + b : fmin(a, b);
}
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

// The identity of min: +inf, or an integer type's largest value (true for bool).
template <typename T>
__device__ __forceinline__ T highest();
template <>
__device__ __forceinline__ float highest<float>() { return __int_as_float(0x7f800000); }
template <>
__device__ __forceinline__ double highest<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}
template <>
__device__ __forceinline__ int highest<int>() { return 2147483647; }
template <>
__device__ __forceinline__ long long highest<long long>() { return 9223372036854775807LL; }
template <>
__device__ __forceinline__ bool highest<bool>() { return true; }

__device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }

// ----- more elementwise math (ops.py: erf, log1p, expm1, softplus, clamp, isnan...) -----
// Each follows torch's semantics, NaN and inf included; none is used by the functions above.

__device__ __forceinline__ float erf(float x) { return erff(x); }
__device__ __forceinline__ double erf(double x) { return ::erf(x); }
__device__ __forceinline__ float log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p(double x) { return ::log1p(x); }
__device__ __forceinline__ float expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double expm1(double x) { return ::expm1(x); }

// Floating-point classes; integers and bools are always finite. Written as comparisons
// (fuser compiles without fast math, so x != x holds only for NaN).
__device__ __forceinline__ bool isnan(float x) { return x != x; }
__device__ __forceinline__ bool isnan(double x) { return x != x; }
template <typename T>
__device__ __forceinline__ bool isnan(T) { return false; }
__device__ __forceinline__ bool isinf(float x) { return fabsf(x) == __int_as_float(0x7f800000); }
__device__ __forceinline__ bool isinf(double x) { return fabs(x) == inf(); }
template <typename T>
__device__ __forceinline__ bool isinf(T) { return false; }
__device__ __forceinline__ bool isfinite(float x) {
  return fabsf(x) < __int_as_float(0x7f800000);
}
__device__ __forceinline__ bool isfinite(double x) { return fabs(x) < inf(); }
template <typename T>
__device__ __forceinline__ bool isfinite(T) { return true; }

// torch.softplus: x where x * beta > threshold, else log1p(exp(x * beta)) / beta. In float,
// exp is fm::exp above (results below 2^-126 flush to zero).
template <typename T>
__device__ __forceinline__ T softplus(T x, T beta, T threshold) {
  const T y = x * beta;
  return y > threshold ? x : log1p(exp(y)) / beta;
}

// torch.clamp: min(max(x, lo), hi), so hi where lo > hi; a NaN in x, lo or hi gives NaN.
template <typename T>
__device__ __forceinline__ T clamp(T x, T lo, T hi) {
  const T m = x < lo ? lo : x;
  return hi < m ? hi : m;
}
__device__ __forceinline__ float clamp(float x, float lo, float hi) {
  if (isnan(x)) return x;
  if (isnan(lo)) return lo;
  if (isnan(hi)) return hi;
  return fminf(fmaxf(x, lo), hi);
}
__device__ __forceinline__ double clamp(double x, double lo, double hi) {
  if (isnan(x)) return x;
  if (isnan(lo)) return lo;
  if (isnan(hi)) return hi;
  return fmin(fmax(x, lo), hi);
}

// ----- reduction functors (ops.py REDUCTIONS names them), with their identities -----

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
  template <typename T>
  static __device__ __forceinline__ T identity() { return T(0); }
};
struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return max(a, b); }
  template <typename T>
  static __device__ __forceinline__ T identity() { return lowest<T>(); }
};
struct Min {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return min(a, b); }
  template <typename T>
  static __device__ __forceinline__ T identity() { return highest<T>(); }
};

// ----- warp reduction over groups of WIDTH lanes (WIDTH a power of two <= 32) -----

template <typename T>
__device__ __forceinline__ T shfl_xor(T x, int offset) {
  return __shfl_xor_sync(0xffffffffu, x, offset);
}
__device__ __forceinline__ bool shfl_xor(bool x, int offset) {  // no bool shuffle: via int
  return __shfl_xor_sync(0xffffffffu, static_cast<int>(x), offset) != 0;
}

template <int WIDTH, typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset /= 2) {
    x = op(x, shfl_xor(x, offset));
  }
  return x;
}

}  // namespace fm
