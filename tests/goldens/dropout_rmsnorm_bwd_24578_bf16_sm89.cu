// fuser kernel module for fusion 'dropout_rmsnorm_bwd' (templates <templates>)
// 
// kind:              inner + outer reduction
// full inputs:       T0:BFloat16, T1:BFloat16, T2:Bool, T4:BFloat16
// row inputs:        T3:Float
// column inputs:     T5:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16, T1:BFloat16, T2:Bool, T4:BFloat16
// inner level 0:     sum(T21)->T22
// outer reductions:  sum(T32)->T33
// outputs:           T36:full, T37:full, T38:col
// 
// RowSchedule
//   scheduler          inner_outer_persistent
//   reason             smem-first policy: T1, T4 in smem, T0,T5 re-read each pass, ~64 regs/thread, ~1 block(s)/SM (1 block(s) cannot keep the row on chip)
//   hidden             24578
//   vec                2
//   threads_per_row    1024
//   rows_per_block     1
//   cluster            1
//   batch              13
//   unroll             13
//   full_unroll        True
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->global, T1:BFloat16->smem(cp.async), T2:Bool->registers, T4:BFloat16->smem(cp.async), T5:BFloat16->global
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      64
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T1         49156       0    49280  row buffer T1 (BFloat16), 1 stage(s) x 1 row(s) x 24578
// s_T4         49156   49280    49280  row buffer T4 (BFloat16), 1 stage(s) x 1 row(s) x 24578
// s_reduce       256   98560      256  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 32 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 98944 B = dynamic 98816 + static 128; limit 101376 B; headroom 2432 B; alignment 128 B
// 
// FinalizeSchedule
//   hidden             24578
//   cols_per_block     32
//   partial_lanes      16
//   unroll             16
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes       4096       0     4096  1 column sum(s) x 16 lanes x 32 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 4224 B = dynamic 4096 + static 128; limit 101376 B; headroom 97152 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 1024, ... (13 of them, 2 elements each);
// shared row buffers are indexed the same way, so a thread only ever reads back what it copied.
extern "C" __global__ void __launch_bounds__(1024, 1)
dropout_rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    const bool* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T4,
    const __nv_bfloat16* __restrict__ g_T5,
    const float* __restrict__ g_T3,
    __nv_bfloat16* __restrict__ g_T36,
    __nv_bfloat16* __restrict__ g_T37,
    float* __restrict__ g_part_T33,
    long long n_rows)
{
  constexpr int H = 24578;
  constexpr int VEC = 2;
  constexpr int NV = 12289;  // vectors per row
  constexpr int TPR = 1024;
  constexpr int RPB = 1;
  constexpr int BATCH = 13;
  constexpr int STAGES = 1;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end
  fm::Vec<__nv_bfloat16, VEC>* s_T1 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);
  fm::Vec<__nv_bfloat16, VEC>* s_T4 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 49280);
  float* s_reduce = reinterpret_cast<float*>(smem + 98560);
  const double S6 = 1.1111111111111112;
  const long long S13 = n_rows;
  const long long S14 = static_cast<long long>(H);
  const long long S23 = static_cast<long long>(H);
  const long long S25 = n_rows;
  const long long S26 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 13
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
    if (j < NV) {
    }
  }

  // Column accumulators, in registers.
  float acc_T33[BATCH][VEC];
#pragma unroll 13
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (j < NV) acc_T33[b][i] = float(0);
    }
  }

  const long long row_stride = static_cast<long long>(gridDim.x) * RPB;
  long long row0 = static_cast<long long>(blockIdx.x) * RPB;
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + ty + zero;
    const bool valid = row < n_rows;
    const int stage = STAGES == 2 ? (it & 1) : 0;
    if (valid) {
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int j = b * TPR + tx;
        if (j < NV) {
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T1[ty * NV + j], g_T1 + row * H + j * VEC);
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T4[ty * NV + j], g_T4 + row * H + j * VEC);
        }
      }
    }
    fm::cp_async_commit();
    // Row buffers kept in registers: every load of the row issued before any is used.
    fm::Vec<bool, VEC> r_T2[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      r_T2[b] = (valid && j < NV) ? fm::load<VEC>(g_T2 + row * H + j * VEC) : fm::Vec<bool, VEC>{};
    }
    const float row_T3 = valid ? fm::to_compute(g_T3[row]) : float(0);
    fm::cp_async_wait<0>();

    // Inner reduction level 0.
    float row_T22 = float(0);
#pragma unroll 13
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = (valid ? fm::load<VEC>(g_T0 + row * H + j * VEC) : fm::Vec<__nv_bfloat16, VEC>{});
        const fm::Vec<__nv_bfloat16, VEC> x_T1 = s_T1[(stage * RPB + ty) * NV + j];
        const fm::Vec<bool, VEC> x_T2 = r_T2[b];
        const fm::Vec<__nv_bfloat16, VEC> x_T4 = s_T4[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T5 = fm::load<VEC>(g_T5 + j * VEC);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T7 = static_cast<float>(fm::to_compute(x_T2.v[i]));
          const float e_T8 = fm::to_compute(x_T1.v[i]);
          const float e_T9 = fm::to_compute(x_T0.v[i]);
          const float e_T10 = (e_T7 * e_T9);
          const float e_T11 = (e_T10 * static_cast<float>(S6));
          const float e_T12 = (e_T8 + e_T11);
          const float e_T16 = fm::reciprocal(row_T3);
          const float e_T17 = fm::to_compute(x_T4.v[i]);
          const float e_T18 = fm::to_compute(c_T5.v[i]);
          const float e_T19 = (e_T17 * e_T18);
          const float e_T20 = (e_T12 * e_T16);
          const float e_T21 = (e_T19 * e_T20);
          row_T22 = fm::Sum{}(row_T22, e_T21);
        }
      }
    }
    row_T22 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T22, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      float* slot = s_reduce + ((it * 1 + 0) & 1) * (1 * RPB * (TPR / 32));
      if ((tx & 31) == 0) {
        slot[(0 * RPB + ty) * (TPR / 32) + tx / 32] = row_T22;
      }
      __syncthreads();
      row_T22 = slot[(0 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T22 = fm::Sum{}(row_T22, slot[(0 * RPB + ty) * (TPR / 32) + w]);
      }
    }
    const float row_T24 = (row_T22 / static_cast<float>(S23));

    // Outputs of the row and the column accumulators.
#pragma unroll 13
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = (valid ? fm::load<VEC>(g_T0 + row * H + j * VEC) : fm::Vec<__nv_bfloat16, VEC>{});
        const fm::Vec<__nv_bfloat16, VEC> x_T1 = s_T1[(stage * RPB + ty) * NV + j];
        const fm::Vec<bool, VEC> x_T2 = r_T2[b];
        const fm::Vec<__nv_bfloat16, VEC> x_T4 = s_T4[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T5 = fm::load<VEC>(g_T5 + j * VEC);
        fm::Vec<__nv_bfloat16, VEC> o_T36;
        fm::Vec<__nv_bfloat16, VEC> o_T37;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T7 = static_cast<float>(fm::to_compute(x_T2.v[i]));
          const float e_T8 = fm::to_compute(x_T1.v[i]);
          const float e_T9 = fm::to_compute(x_T0.v[i]);
          const float e_T10 = (e_T7 * e_T9);
          const float e_T11 = (e_T10 * static_cast<float>(S6));
          const float e_T12 = (e_T8 + e_T11);
          const float e_T16 = fm::reciprocal(row_T3);
          const float e_T17 = fm::to_compute(x_T4.v[i]);
          const float e_T18 = fm::to_compute(c_T5.v[i]);
          const float e_T19 = (e_T17 * e_T18);
          const float e_T20 = (e_T12 * e_T16);
          const float e_T28 = (e_T20 * row_T24);
          const float e_T29 = (e_T19 - e_T28);
          const float e_T30 = (e_T29 * e_T16);
          const float e_T31 = fm::to_compute(x_T4.v[i]);
          const float e_T32 = (e_T31 * e_T20);
          const float e_T34 = (e_T30 * e_T7);
          const float e_T35 = (e_T34 * static_cast<float>(S6));
          const float e_T36 = fm::round_bf16(e_T35);
          const float e_T37 = fm::round_bf16(e_T30);
          o_T36.v[i] = fm::to_storage<__nv_bfloat16>(e_T36);
          o_T37.v[i] = fm::to_storage<__nv_bfloat16>(e_T37);
          if (valid) acc_T33[b][i] = fm::Sum{}(acc_T33[b][i], e_T32);
        }
        if (valid) fm::store<VEC>(g_T36 + row * H + j * VEC, o_T36);
        if (valid) fm::store<VEC>(g_T37 + row * H + j * VEC, o_T37);
      }
    }
  }

  // One partial row per block: the finalize kernel sums them per column.
  if (ty == 0) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          g_part_T33[static_cast<long long>(blockIdx.x) * H + j * VEC + i] = acc_T33[b][i];
        }
      }
    }
  }
}

// Column finalize: sums the [partial_rows, H] partials of each outer reduction per column, in a
// fixed order (lanes stride the partial rows, then lane 0 adds the lanes up), then writes the
// column outputs. No atomics: the result is the same from run to run.
extern "C" __global__ void __launch_bounds__(512)
dropout_rmsnorm_bwd_finalize(
    const float* __restrict__ g_part_T33,
    const __nv_bfloat16* __restrict__ g_T5,
    __nv_bfloat16* __restrict__ g_T38,
    long long n_rows,
    int partial_rows)
{
  constexpr int H = 24578;
  constexpr int COLS = 32;
  constexpr int LANES = 16;
  const int lane = threadIdx.y;
  const int col = blockIdx.x * COLS + threadIdx.x;
  fm::wait_for_prior_grid();  // the row kernel's partial rows are complete past this point
  extern __shared__ __align__(128) unsigned char smem[];
  double* s_lanes = reinterpret_cast<double*>(smem + 0);
  double sum_T33 = 0;
  if (col < H) {
#pragma unroll 16
    for (int p = lane; p < partial_rows; p += LANES) {
      sum_T33 = fm::Sum{}(sum_T33, static_cast<double>(g_part_T33[static_cast<long long>(p) * H + col]));
    }
  }
  s_lanes[(0 * LANES + lane) * COLS + threadIdx.x] = sum_T33;
  __syncthreads();
  if (lane != 0 || col >= H) return;
  for (int l = 1; l < LANES; ++l) {
    sum_T33 = fm::Sum{}(sum_T33, s_lanes[(0 * LANES + l) * COLS + threadIdx.x]);
  }
  const float tot_T33 = static_cast<float>(sum_T33);
  const double S6 = 1.1111111111111112;
  const long long S13 = n_rows;
  const long long S14 = static_cast<long long>(H);
  const long long S23 = static_cast<long long>(H);
  const long long S25 = n_rows;
  const long long S26 = static_cast<long long>(H);
  const float c_T38 = fm::round_bf16(tot_T33);
  g_T38[col] = fm::to_storage<__nv_bfloat16>(c_T38);
}
