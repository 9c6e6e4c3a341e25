// fuser kernel module for fusion 'layernorm_fwd' (templates <templates>)
// 
// kind:              inner reduction
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     T1:BFloat16, T2:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16
// inner level 0:     sum(T3)->T5
// inner level 1:     sum(T11)->T14
// outputs:           T34:full, T18:row, T21:row
// 
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: T0, T1, T2 in smem (2 stages), ~48 regs/thread, ~1 block(s)/SM
//   hidden             16384
//   vec                8
//   threads_per_row    512
//   rows_per_block     1
//   cluster            1
//   batch              4
//   unroll             4
//   full_unroll        False
//   stages             2
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T1:BFloat16->smem, T2:BFloat16->smem
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         65536       0    65536  row buffer T0 (BFloat16), 2 stage(s) x 1 row(s) x 16384
// s_T1         32768   65536    32768  column buffer T1 (BFloat16) x 16384
// s_T2         32768   98304    32768  column buffer T2 (BFloat16) x 16384
// s_reduce       128  131072      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 131328 B = dynamic 131200 + static 128; limit 232448 B; headroom 101120 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 512, ... (4 of them, 8 elements each);
// shared row buffers are indexed the same way, so a thread only ever reads back what it copied.
extern "C" __global__ void __launch_bounds__(512, 1)
layernorm_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    const __nv_bfloat16* __restrict__ g_T2,
    __nv_bfloat16* __restrict__ g_T34,
    float* __restrict__ g_T18,
    float* __restrict__ g_T21,
    long long n_rows)
{
  constexpr int H = 16384;
  constexpr int VEC = 8;
  constexpr int NV = 2048;  // vectors per row
  constexpr int TPR = 512;
  constexpr int RPB = 1;
  constexpr int BATCH = 4;
  constexpr int STAGES = 2;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::Vec<__nv_bfloat16, VEC>* s_T0 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);
  fm::Vec<__nv_bfloat16, VEC>* s_T1 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 65536);
  fm::Vec<__nv_bfloat16, VEC>* s_T2 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 98304);
  float* s_reduce = reinterpret_cast<float*>(smem + 131072);
  const long long S4 = static_cast<long long>(H);
  const long long S7 = n_rows;
  const long long S8 = static_cast<long long>(H);
  const long long S12 = 0LL;
  const long long S16 = n_rows;
  const double S19 = 1e-05;
  const long long S22 = n_rows;
  const long long S23 = static_cast<long long>(H);
  const long long S26 = n_rows;
  const long long S27 = static_cast<long long>(H);
  const long long S13 = (S4 - S12);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 4
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
    if (j < NV) {
      if (ty == 0) s_T1[j] = fm::load<VEC>(g_T1 + j * VEC);
      if (ty == 0) s_T2[j] = fm::load<VEC>(g_T2 + j * VEC);
    }
  }
  __syncthreads();  // column buffers are shared by the block's rows


  const long long row_stride = static_cast<long long>(gridDim.x) * RPB;
  long long row0 = static_cast<long long>(blockIdx.x) * RPB;
  // Prologue of the two-stage pipeline: this block's first rows start loading now.
  if (row0 + ty < n_rows) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
        fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T0[ty * NV + j], g_T0 + (row0 + ty) * H + j * VEC);
      }
    }
  }
  fm::cp_async_commit();
  // Per-row values load a row ahead too: loaded in the iteration that uses them, their
  // latency would stall every row although the row buffers are already on chip.
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + ty + zero;
    const bool valid = row < n_rows;
    const int stage = STAGES == 2 ? (it & 1) : 0;
    // Next rows into the other stage while this one computes.
    const long long next = row + row_stride;
    if (next < n_rows) {
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int j = b * TPR + tx;
        if (j < NV) {
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T0[((stage ^ 1) * RPB + ty) * NV + j], g_T0 + next * H + j * VEC);
        }
      }
    }
    fm::cp_async_commit();
    fm::cp_async_wait<1>();

    // Inner reduction level 0.
    float row_T5 = float(0);
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T1 = s_T1[j];
        const fm::Vec<__nv_bfloat16, VEC> c_T2 = s_T2[j];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T3 = fm::to_compute(x_T0.v[i]);
          row_T5 = fm::Sum{}(row_T5, e_T3);
        }
      }
    }
    row_T5 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T5, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      float* slot = s_reduce + ((it * 2 + 0) & 1) * (1 * RPB * (TPR / 32));
      if ((tx & 31) == 0) {
        slot[(0 * RPB + ty) * (TPR / 32) + tx / 32] = row_T5;
      }
      __syncthreads();
      row_T5 = slot[(0 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T5 = fm::Sum{}(row_T5, slot[(0 * RPB + ty) * (TPR / 32) + w]);
      }
    }
    const float row_T6 = (row_T5 / static_cast<float>(S4));

    // Inner reduction level 1.
    float row_T14 = float(0);
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T1 = s_T1[j];
        const fm::Vec<__nv_bfloat16, VEC> c_T2 = s_T2[j];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T3 = fm::to_compute(x_T0.v[i]);
          const float e_T10 = (e_T3 - row_T6);
          const float e_T11 = (e_T10 * e_T10);
          row_T14 = fm::Sum{}(row_T14, e_T11);
        }
      }
    }
    row_T14 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T14, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      float* slot = s_reduce + ((it * 2 + 1) & 1) * (1 * RPB * (TPR / 32));
      if ((tx & 31) == 0) {
        slot[(0 * RPB + ty) * (TPR / 32) + tx / 32] = row_T14;
      }
      __syncthreads();
      row_T14 = slot[(0 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T14 = fm::Sum{}(row_T14, slot[(0 * RPB + ty) * (TPR / 32) + w]);
      }
    }
    const float row_T15 = (row_T14 / static_cast<float>(S13));
    const float row_T20 = (row_T15 + static_cast<float>(S19));
    const float row_T21 = fm::rsqrt(row_T20);

    // Outputs of the row.
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T1 = s_T1[j];
        const fm::Vec<__nv_bfloat16, VEC> c_T2 = s_T2[j];
        fm::Vec<__nv_bfloat16, VEC> o_T34;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T3 = fm::to_compute(x_T0.v[i]);
          const float e_T25 = (e_T3 - row_T6);
          const float e_T29 = (e_T25 * row_T21);
          const float e_T30 = fm::to_compute(c_T1.v[i]);
          const float e_T31 = (e_T29 * e_T30);
          const float e_T32 = fm::to_compute(c_T2.v[i]);
          const float e_T33 = (e_T31 + e_T32);
          const float e_T34 = fm::round_bf16(e_T33);
          o_T34.v[i] = fm::to_storage<__nv_bfloat16>(e_T34);
        }
        if (valid) fm::store_vector<VEC>(g_T34 + row * H + j * VEC, o_T34);
      }
    }
    if (valid && tx == 0) g_T18[row] = fm::to_storage<float>(row_T6);
    if (valid && tx == 0) g_T21[row] = fm::to_storage<float>(row_T21);
  }
}
