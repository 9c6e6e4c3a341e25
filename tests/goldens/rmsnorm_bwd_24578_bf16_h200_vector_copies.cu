// fuser kernel module for fusion 'rmsnorm_bwd' (templates <templates>)
// 
// kind:              inner + outer reduction
// full inputs:       T0:BFloat16, T2:BFloat16
// row inputs:        T1:Float
// column inputs:     T3:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16, T2:BFloat16
// inner level 0:     sum(T13)->T14
// outer reductions:  sum(T24)->T25
// outputs:           T26:full, T27:col
// 
// RowSchedule
//   scheduler          inner_outer_persistent
//   reason             smem-first policy: T0, T2 in smem (2 stages), ~64 regs/thread, ~1 block(s)/SM
//   hidden             24578
//   vec                2
//   threads_per_row    1024
//   rows_per_block     1
//   cluster            1
//   batch              13
//   unroll             13
//   full_unroll        True
//   stages             2
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T2:BFloat16->smem(cp.async), T3:BFloat16->registers
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      64
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         98312       0    98432  row buffer T0 (BFloat16), 2 stage(s) x 1 row(s) x 24578
// s_T2         98312   98432    98432  row buffer T2 (BFloat16), 2 stage(s) x 1 row(s) x 24578
// s_reduce       256  196864      256  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 32 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 197248 B = dynamic 197120 + static 128; limit 232448 B; headroom 35200 B; alignment 128 B
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
// total 4224 B = dynamic 4096 + static 128; limit 232448 B; headroom 228224 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 1024, ... (13 of them, 2 elements each);
// shared row buffers are indexed the same way, so a thread only ever reads back what it copied.
extern "C" __global__ void __launch_bounds__(1024, 1)
rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T3,
    const float* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T26,
    float* __restrict__ g_part_T25,
    long long n_rows)
{
  constexpr int H = 24578;
  constexpr int VEC = 2;
  constexpr int NV = 12289;  // vectors per row
  constexpr int TPR = 1024;
  constexpr int RPB = 1;
  constexpr int BATCH = 13;
  constexpr int STAGES = 2;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end
  fm::Vec<__nv_bfloat16, VEC>* s_T0 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);
  fm::Vec<__nv_bfloat16, VEC>* s_T2 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 98432);
  float* s_reduce = reinterpret_cast<float*>(smem + 196864);
  const long long S5 = n_rows;
  const long long S6 = static_cast<long long>(H);
  const long long S15 = static_cast<long long>(H);
  const long long S17 = n_rows;
  const long long S18 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
  fm::Vec<__nv_bfloat16, VEC> r_T3[BATCH];
#pragma unroll 13
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
    if (j < NV) {
      r_T3[b] = fm::load<VEC>(g_T3 + j * VEC);
    }
  }

  // Column accumulators, in registers.
  float acc_T25[BATCH][VEC];
#pragma unroll 13
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (j < NV) acc_T25[b][i] = float(0);
    }
  }

  const long long row_stride = static_cast<long long>(gridDim.x) * RPB;
  long long row0 = static_cast<long long>(blockIdx.x) * RPB;
  // Prologue of the two-stage pipeline: this block's first rows start loading now.
  if (row0 + ty < n_rows) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
        fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T0[ty * NV + j], g_T0 + (row0 + ty) * H + j * VEC);
        fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T2[ty * NV + j], g_T2 + (row0 + ty) * H + j * VEC);
      }
    }
  }
  fm::cp_async_commit();
  // Per-row values load a row ahead too: loaded in the iteration that uses them, their
  // latency would stall every row although the row buffers are already on chip.
  float ahead_T1 = row0 + ty < n_rows ? fm::to_compute(g_T1[row0 + ty]) : float(0);
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
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T2[((stage ^ 1) * RPB + ty) * NV + j], g_T2 + next * H + j * VEC);
        }
      }
    }
    fm::cp_async_commit();
    const float row_T1 = ahead_T1;
    ahead_T1 = next < n_rows ? fm::to_compute(g_T1[next]) : float(0);
    fm::cp_async_wait<1>();

    // Inner reduction level 0.
    float row_T14 = float(0);
#pragma unroll 13
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> x_T2 = s_T2[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T3 = r_T3[b];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T4 = fm::to_compute(x_T0.v[i]);
          const float e_T8 = fm::reciprocal(row_T1);
          const float e_T9 = fm::to_compute(x_T2.v[i]);
          const float e_T10 = fm::to_compute(c_T3.v[i]);
          const float e_T11 = (e_T9 * e_T10);
          const float e_T12 = (e_T4 * e_T8);
          const float e_T13 = (e_T11 * e_T12);
          row_T14 = fm::Sum{}(row_T14, e_T13);
        }
      }
    }
    row_T14 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T14, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      float* slot = s_reduce + ((it * 1 + 0) & 1) * (1 * RPB * (TPR / 32));
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
    const float row_T16 = (row_T14 / static_cast<float>(S15));

    // Outputs of the row and the column accumulators.
#pragma unroll 13
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (j < NV) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> x_T2 = s_T2[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T3 = r_T3[b];
        fm::Vec<__nv_bfloat16, VEC> o_T26;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T4 = fm::to_compute(x_T0.v[i]);
          const float e_T8 = fm::reciprocal(row_T1);
          const float e_T9 = fm::to_compute(x_T2.v[i]);
          const float e_T10 = fm::to_compute(c_T3.v[i]);
          const float e_T11 = (e_T9 * e_T10);
          const float e_T12 = (e_T4 * e_T8);
          const float e_T20 = (e_T12 * row_T16);
          const float e_T21 = (e_T11 - e_T20);
          const float e_T22 = (e_T21 * e_T8);
          const float e_T23 = fm::to_compute(x_T2.v[i]);
          const float e_T24 = (e_T23 * e_T12);
          const float e_T26 = fm::round_bf16(e_T22);
          o_T26.v[i] = fm::to_storage<__nv_bfloat16>(e_T26);
          if (valid) acc_T25[b][i] = fm::Sum{}(acc_T25[b][i], e_T24);
        }
        if (valid) fm::store<VEC>(g_T26 + row * H + j * VEC, o_T26);
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
          g_part_T25[static_cast<long long>(blockIdx.x) * H + j * VEC + i] = acc_T25[b][i];
        }
      }
    }
  }
}

// Column finalize: sums the [partial_rows, H] partials of each outer reduction per column, in a
// fixed order (lanes stride the partial rows, then lane 0 adds the lanes up), then writes the
// column outputs. No atomics: the result is the same from run to run.
extern "C" __global__ void __launch_bounds__(512)
rmsnorm_bwd_finalize(
    const float* __restrict__ g_part_T25,
    const __nv_bfloat16* __restrict__ g_T3,
    __nv_bfloat16* __restrict__ g_T27,
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
  double sum_T25 = 0;
  if (col < H) {
#pragma unroll 16
    for (int p = lane; p < partial_rows; p += LANES) {
      sum_T25 = fm::Sum{}(sum_T25, static_cast<double>(g_part_T25[static_cast<long long>(p) * H + col]));
    }
  }
  s_lanes[(0 * LANES + lane) * COLS + threadIdx.x] = sum_T25;
  __syncthreads();
  if (lane != 0 || col >= H) return;
  for (int l = 1; l < LANES; ++l) {
    sum_T25 = fm::Sum{}(sum_T25, s_lanes[(0 * LANES + l) * COLS + threadIdx.x]);
  }
  const float tot_T25 = static_cast<float>(sum_T25);
  const long long S5 = n_rows;
  const long long S6 = static_cast<long long>(H);
  const long long S15 = static_cast<long long>(H);
  const long long S17 = n_rows;
  const long long S18 = static_cast<long long>(H);
  const float c_T27 = fm::round_bf16(tot_T25);
  g_T27[col] = fm::to_storage<__nv_bfloat16>(c_T27);
}
