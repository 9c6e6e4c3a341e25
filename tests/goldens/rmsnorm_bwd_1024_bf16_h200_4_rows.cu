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
//   reason             smem-first policy: T0, T2, T3 in smem, ~64 regs/thread, ~4 block(s)/SM
//   hidden             1024
//   vec                8
//   threads_per_row    64
//   rows_per_block     4
//   cluster            1
//   batch              2
//   unroll             2
//   full_unroll        True
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T2:BFloat16->smem(cp.async), T3:BFloat16->smem
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      64
//   blocks_per_sm      4
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0          8192       0     8192  row buffer T0 (BFloat16), 1 stage(s) x 4 row(s) x 1024
// s_T2          8192    8192     8192  row buffer T2 (BFloat16), 1 stage(s) x 4 row(s) x 1024
// s_T3          2048   16384     2048  column buffer T3 (BFloat16) x 1024
// s_reduce        64   18432      128  inner-reduction scratch: 2 parities x 1 x 4 row(s) x 2 warps x 4 B
// s_outer       4096   18560     4096  outer-reduction combine across 4 rows
// static slot    128  static      128  static __shared__ (magic zero)
// total 22784 B = dynamic 22656 + static 128; limit 232448 B; headroom 209664 B; alignment 128 B
// 
// FinalizeSchedule
//   hidden             1024
//   cols_per_block     8
//   partial_lanes      64
//   unroll             16
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes       4096       0     4096  1 column sum(s) x 64 lanes x 8 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 4224 B = dynamic 4096 + static 128; limit 232448 B; headroom 228224 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 4 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 64, ... (2 of them, 8 elements each);
// shared row buffers are indexed the same way, so a thread only ever reads back what it copied.
extern "C" __global__ void __launch_bounds__(256, 4)
rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T3,
    const float* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T26,
    float* __restrict__ g_part_T25,
    long long n_rows)
{
  constexpr int H = 1024;
  constexpr int VEC = 8;
  constexpr int NV = 128;  // vectors per row
  constexpr int TPR = 64;
  constexpr int RPB = 4;
  constexpr int BATCH = 2;
  constexpr int STAGES = 1;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end
  fm::Vec<__nv_bfloat16, VEC>* s_T0 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);
  fm::Vec<__nv_bfloat16, VEC>* s_T2 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 8192);
  fm::Vec<__nv_bfloat16, VEC>* s_T3 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 16384);
  float* s_reduce = reinterpret_cast<float*>(smem + 18432);
  const long long S5 = n_rows;
  const long long S6 = static_cast<long long>(H);
  const long long S15 = static_cast<long long>(H);
  const long long S17 = n_rows;
  const long long S18 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 2
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
    if (j < NV) {
      if (ty == 0) s_T3[j] = fm::load<VEC>(g_T3 + j * VEC);
    }
  }
  __syncthreads();  // column buffers are shared by the block's rows

  // Column accumulators, in registers.
  float acc_T25[BATCH][VEC];
#pragma unroll 2
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (j < NV) acc_T25[b][i] = float(0);
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
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T0[ty * NV + j], g_T0 + row * H + j * VEC);
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T2[ty * NV + j], g_T2 + row * H + j * VEC);
        }
      }
    }
    fm::cp_async_commit();
    const float row_T1 = valid ? fm::to_compute(g_T1[row]) : float(0);
    fm::cp_async_wait<0>();

    // Inner reduction level 0.
    float row_T14 = float(0);
#pragma unroll 2
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> x_T2 = s_T2[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T3 = s_T3[j];
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
#pragma unroll 2
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> x_T2 = s_T2[(stage * RPB + ty) * NV + j];
        const fm::Vec<__nv_bfloat16, VEC> c_T3 = s_T3[j];
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
        if (valid) fm::store_vector<VEC>(g_T26 + row * H + j * VEC, o_T26);
      }
    }
  }

  // Fold the block's rows into row 0 through shared memory, one row at a time.
  {
    float* s_outer_T25 = reinterpret_cast<float*>(smem + 18560) + 0 * H;
    for (int y = 1; y < RPB; ++y) {
      __syncthreads();
      if (ty == y) {
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          const int j = b * TPR + tx;
          if (j < NV) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              s_outer_T25[j * VEC + i] = acc_T25[b][i];
            }
          }
        }
      }
      __syncthreads();
      if (ty == 0) {
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
          const int j = b * TPR + tx;
          if (j < NV) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              acc_T25[b][i] = fm::Sum{}(acc_T25[b][i], s_outer_T25[j * VEC + i]);
            }
          }
        }
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
  constexpr int H = 1024;
  constexpr int COLS = 8;
  constexpr int LANES = 64;
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
