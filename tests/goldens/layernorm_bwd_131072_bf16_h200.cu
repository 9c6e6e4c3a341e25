// fuser kernel module for fusion 'layernorm_bwd' (templates <templates>)
// 
// kind:              inner + outer reduction
// full inputs:       T0:BFloat16, T3:BFloat16
// row inputs:        T1:Float, T2:Float
// column inputs:     T4:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16, T3:BFloat16
// inner level 0:     sum(T18)->T19, sum(T16)->T21
// outer reductions:  sum(T37)->T38, sum(T5)->T40
// outputs:           T36:full, T39:col, T41:col
// 
// RowSchedule
//   scheduler          inner_outer_persistent
//   reason             smem-first policy: T0, T3, T4 in smem (2 stages), rows split over a cluster of 8 blocks of 16384 elements, ~112 regs/thread, ~1 block(s)/SM (the plans for fewer blocks do not keep the row on chip)
//   hidden             131072
//   vec                8
//   threads_per_row    512
//   rows_per_block     1
//   cluster            8
//   batch              4
//   unroll             4
//   full_unroll        True
//   stages             2
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T3:BFloat16->smem(cp.async), T4:BFloat16->smem
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      112
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         65536       0    65536  row buffer T0 (BFloat16), 2 stage(s) x 1 row(s) x 16384
// s_T3         65536   65536    65536  row buffer T3 (BFloat16), 2 stage(s) x 1 row(s) x 16384
// s_T4         32768  131072    32768  column buffer T4 (BFloat16) x 16384
// s_reduce       256  163840      256  inner-reduction scratch: 2 parities x 2 x 1 row(s) x 16 warps x 4 B
// s_cluster       16  164096      128  cluster exchange: 2 parities x 2 x 1 row(s) x 4 B, read by the 8 blocks of the cluster
// static slot    128  static      128  static __shared__ (magic zero)
// total 164352 B = dynamic 164224 + static 128; limit 232448 B; headroom 68096 B; alignment 128 B
// 
// FinalizeSchedule
//   hidden             131072
//   cols_per_block     32
//   partial_lanes      16
//   unroll             16
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes       8192       0     8192  2 column sum(s) x 16 lanes x 32 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 8320 B = dynamic 8192 + static 128; limit 232448 B; headroom 224128 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 512, ... (4 of them, 8 elements each);
// shared row buffers are indexed the same way, so a thread only ever reads back what it copied.
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(512, 1)
layernorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T3,
    const __nv_bfloat16* __restrict__ g_T4,
    const float* __restrict__ g_T1,
    const float* __restrict__ g_T2,
    __nv_bfloat16* __restrict__ g_T36,
    float* __restrict__ g_part_T38,
    float* __restrict__ g_part_T40,
    long long n_rows)
{
  constexpr int H = 131072;
  constexpr int VEC = 8;
  constexpr int NV = 16384;  // vectors per row
  constexpr int TPR = 512;
  constexpr int RPB = 1;
  constexpr int BATCH = 4;
  constexpr int STAGES = 2;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  // The row's vectors are split over the 8 blocks of a cluster: this block owns [jbase, jend).
  constexpr int NVC = 2048;  // vectors per block of the cluster
  const unsigned rank = fm::cluster_rank();
  const unsigned cluster = fm::cluster_index();
  const int jbase = static_cast<int>(rank) * NVC;
  const int jend = min(NV, jbase + NVC);
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end
  fm::Vec<__nv_bfloat16, VEC>* s_T0 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);
  fm::Vec<__nv_bfloat16, VEC>* s_T3 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 65536);
  fm::Vec<__nv_bfloat16, VEC>* s_T4 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 131072);
  float* s_cluster = reinterpret_cast<float*>(smem + 164096);
  float* s_reduce = reinterpret_cast<float*>(smem + 163840);
  const long long S7 = n_rows;
  const long long S8 = static_cast<long long>(H);
  const long long S11 = n_rows;
  const long long S12 = static_cast<long long>(H);
  const long long S17 = static_cast<long long>(H);
  const long long S23 = n_rows;
  const long long S24 = static_cast<long long>(H);
  const long long S28 = n_rows;
  const long long S29 = static_cast<long long>(H);
  const long long S32 = n_rows;
  const long long S33 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 4
  for (int b = 0; b < BATCH; ++b) {
    const int j = jbase + b * TPR + tx;
    if (j < jend) {
      if (ty == 0) s_T4[(j - jbase)] = fm::load<VEC>(g_T4 + j * VEC);
    }
  }
  __syncthreads();  // column buffers are shared by the block's rows

  // Column accumulators, in registers.
  float acc_T38[BATCH][VEC];
  float acc_T40[BATCH][VEC];
#pragma unroll 4
  for (int b = 0; b < BATCH; ++b) {
    const int j = jbase + b * TPR + tx;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (j < jend) acc_T38[b][i] = float(0);
      if (j < jend) acc_T40[b][i] = float(0);
    }
  }

  const long long row_stride = static_cast<long long>(fm::cluster_count()) * RPB;
  long long row0 = static_cast<long long>(cluster) * RPB;
  // Prologue of the two-stage pipeline: this block's first rows start loading now.
  if (row0 + ty < n_rows) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (j < jend) {
        fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T0[ty * NVC + (j - jbase)], g_T0 + (row0 + ty) * H + j * VEC);
        fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T3[ty * NVC + (j - jbase)], g_T3 + (row0 + ty) * H + j * VEC);
      }
    }
  }
  fm::cp_async_commit();
  // Per-row values load a row ahead too: loaded in the iteration that uses them, their
  // latency would stall every row although the row buffers are already on chip.
  float ahead_T1 = row0 + ty < n_rows ? fm::to_compute(g_T1[row0 + ty]) : float(0);
  float ahead_T2 = row0 + ty < n_rows ? fm::to_compute(g_T2[row0 + ty]) : float(0);
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + ty + zero;
    const bool valid = row < n_rows;
    const int stage = STAGES == 2 ? (it & 1) : 0;
    // Next rows into the other stage while this one computes.
    const long long next = row + row_stride;
    if (next < n_rows) {
#pragma unroll
      for (int b = 0; b < BATCH; ++b) {
        const int j = jbase + b * TPR + tx;
        if (j < jend) {
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T0[((stage ^ 1) * RPB + ty) * NVC + (j - jbase)], g_T0 + next * H + j * VEC);
          fm::cp_async<VEC * sizeof(__nv_bfloat16)>(&s_T3[((stage ^ 1) * RPB + ty) * NVC + (j - jbase)], g_T3 + next * H + j * VEC);
        }
      }
    }
    fm::cp_async_commit();
    const float row_T1 = ahead_T1;
    ahead_T1 = next < n_rows ? fm::to_compute(g_T1[next]) : float(0);
    const float row_T2 = ahead_T2;
    ahead_T2 = next < n_rows ? fm::to_compute(g_T2[next]) : float(0);
    fm::cp_async_wait<1>();

    // Inner reduction level 0.
    float row_T19 = float(0);
    float row_T21 = float(0);
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NVC + (j - jbase)];
        const fm::Vec<__nv_bfloat16, VEC> x_T3 = s_T3[(stage * RPB + ty) * NVC + (j - jbase)];
        const fm::Vec<__nv_bfloat16, VEC> c_T4 = s_T4[(j - jbase)];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T5 = fm::to_compute(x_T3.v[i]);
          const float e_T6 = fm::to_compute(x_T0.v[i]);
          const float e_T10 = (e_T6 - row_T1);
          const float e_T14 = (e_T10 * row_T2);
          const float e_T15 = fm::to_compute(c_T4.v[i]);
          const float e_T16 = (e_T5 * e_T15);
          const float e_T18 = (e_T16 * e_T14);
          row_T19 = fm::Sum{}(row_T19, e_T18);
          row_T21 = fm::Sum{}(row_T21, e_T16);
        }
      }
    }
    row_T19 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T19, fm::Sum{});
    row_T21 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T21, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      float* slot = s_reduce + ((it * 1 + 0) & 1) * (2 * RPB * (TPR / 32));
      if ((tx & 31) == 0) {
        slot[(0 * RPB + ty) * (TPR / 32) + tx / 32] = row_T19;
        slot[(1 * RPB + ty) * (TPR / 32) + tx / 32] = row_T21;
      }
      __syncthreads();
      row_T19 = slot[(0 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T19 = fm::Sum{}(row_T19, slot[(0 * RPB + ty) * (TPR / 32) + w]);
      }
      row_T21 = slot[(1 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T21 = fm::Sum{}(row_T21, slot[(1 * RPB + ty) * (TPR / 32) + w]);
      }
    }
    {
      // Across the cluster: each block posts its part of the row's sums, one cluster barrier,
      // every block adds all parts in rank order (the same sum, in the same order, in each).
      float* post = s_cluster + ((it * 1 + 0) & 1) * (2 * RPB);
      if (tx == 0) {
        post[0 * RPB + ty] = row_T19;
        post[1 * RPB + ty] = row_T21;
      }
      fm::cluster_sync();
      row_T19 = fm::load_peer(&post[0 * RPB + ty], 0);
      for (unsigned q = 1; q < 8; ++q) {
        row_T19 = fm::Sum{}(row_T19, fm::load_peer(&post[0 * RPB + ty], q));
      }
      row_T21 = fm::load_peer(&post[1 * RPB + ty], 0);
      for (unsigned q = 1; q < 8; ++q) {
        row_T21 = fm::Sum{}(row_T21, fm::load_peer(&post[1 * RPB + ty], q));
      }
    }
    const float row_T20 = (row_T19 / static_cast<float>(S17));
    const float row_T22 = (row_T21 / static_cast<float>(S17));

    // Outputs of the row and the column accumulators.
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (true) {
        const fm::Vec<__nv_bfloat16, VEC> x_T0 = s_T0[(stage * RPB + ty) * NVC + (j - jbase)];
        const fm::Vec<__nv_bfloat16, VEC> x_T3 = s_T3[(stage * RPB + ty) * NVC + (j - jbase)];
        const fm::Vec<__nv_bfloat16, VEC> c_T4 = s_T4[(j - jbase)];
        fm::Vec<__nv_bfloat16, VEC> o_T36;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T5 = fm::to_compute(x_T3.v[i]);
          const float e_T6 = fm::to_compute(x_T0.v[i]);
          const float e_T10 = (e_T6 - row_T1);
          const float e_T14 = (e_T10 * row_T2);
          const float e_T15 = fm::to_compute(c_T4.v[i]);
          const float e_T16 = (e_T5 * e_T15);
          const float e_T26 = (e_T14 * row_T20);
          const float e_T27 = (e_T16 - e_T26);
          const float e_T31 = (e_T27 - row_T22);
          const float e_T35 = (e_T31 * row_T2);
          const float e_T36 = fm::round_bf16(e_T35);
          const float e_T37 = (e_T5 * e_T14);
          o_T36.v[i] = fm::to_storage<__nv_bfloat16>(e_T36);
          if (valid) acc_T38[b][i] = fm::Sum{}(acc_T38[b][i], e_T37);
          if (valid) acc_T40[b][i] = fm::Sum{}(acc_T40[b][i], e_T5);
        }
        if (valid) fm::store<VEC>(g_T36 + row * H + j * VEC, o_T36);
      }
    }
  }

  // One partial row per block: the finalize kernel sums them per column.
  if (ty == 0) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (j < jend) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          g_part_T38[static_cast<long long>(cluster) * H + j * VEC + i] = acc_T38[b][i];
          g_part_T40[static_cast<long long>(cluster) * H + j * VEC + i] = acc_T40[b][i];
        }
      }
    }
  }
  fm::cluster_sync();  // no block leaves while a peer may still read its shared memory
}

// Column finalize: sums the [partial_rows, H] partials of each outer reduction per column, in a
// fixed order (lanes stride the partial rows, then lane 0 adds the lanes up), then writes the
// column outputs. No atomics: the result is the same from run to run.
extern "C" __global__ void __launch_bounds__(512)
layernorm_bwd_finalize(
    const float* __restrict__ g_part_T38,
    const float* __restrict__ g_part_T40,
    const __nv_bfloat16* __restrict__ g_T4,
    __nv_bfloat16* __restrict__ g_T39,
    __nv_bfloat16* __restrict__ g_T41,
    long long n_rows,
    int partial_rows)
{
  constexpr int H = 131072;
  constexpr int COLS = 32;
  constexpr int LANES = 16;
  const int lane = threadIdx.y;
  const int col = blockIdx.x * COLS + threadIdx.x;
  fm::wait_for_prior_grid();  // the row kernel's partial rows are complete past this point
  extern __shared__ __align__(128) unsigned char smem[];
  double* s_lanes = reinterpret_cast<double*>(smem + 0);
  double sum_T38 = 0;
  double sum_T40 = 0;
  if (col < H) {
#pragma unroll 16
    for (int p = lane; p < partial_rows; p += LANES) {
      sum_T38 = fm::Sum{}(sum_T38, static_cast<double>(g_part_T38[static_cast<long long>(p) * H + col]));
      sum_T40 = fm::Sum{}(sum_T40, static_cast<double>(g_part_T40[static_cast<long long>(p) * H + col]));
    }
  }
  s_lanes[(0 * LANES + lane) * COLS + threadIdx.x] = sum_T38;
  s_lanes[(1 * LANES + lane) * COLS + threadIdx.x] = sum_T40;
  __syncthreads();
  if (lane != 0 || col >= H) return;
  for (int l = 1; l < LANES; ++l) {
    sum_T38 = fm::Sum{}(sum_T38, s_lanes[(0 * LANES + l) * COLS + threadIdx.x]);
  }
  const float tot_T38 = static_cast<float>(sum_T38);
  for (int l = 1; l < LANES; ++l) {
    sum_T40 = fm::Sum{}(sum_T40, s_lanes[(1 * LANES + l) * COLS + threadIdx.x]);
  }
  const float tot_T40 = static_cast<float>(sum_T40);
  const long long S7 = n_rows;
  const long long S8 = static_cast<long long>(H);
  const long long S11 = n_rows;
  const long long S12 = static_cast<long long>(H);
  const long long S17 = static_cast<long long>(H);
  const long long S23 = n_rows;
  const long long S24 = static_cast<long long>(H);
  const long long S28 = n_rows;
  const long long S29 = static_cast<long long>(H);
  const long long S32 = n_rows;
  const long long S33 = static_cast<long long>(H);
  const float c_T39 = fm::round_bf16(tot_T38);
  const float c_T41 = fm::round_bf16(tot_T40);
  g_T39[col] = fm::to_storage<__nv_bfloat16>(c_T39);
  g_T41[col] = fm::to_storage<__nv_bfloat16>(c_T41);
}
