// fuser kernel module for fusion 'layernorm_fwd' (templates <templates>)
// 
// kind:              inner reduction
// full inputs:       T0:Float
// row inputs:        -
// column inputs:     T1:Float, T2:Float
// scalar inputs:     -
// persistent:        T0:Float
// inner level 0:     sum(T3)->T5
// inner level 1:     sum(T11)->T14
// outputs:           T34:full, T18:row, T21:row
// 
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: T0, T1, T2 in smem (2 stages), rows copied in aligned 16-byte chunks, rows split over a cluster of 2 blocks of 12290 elements (12290+12288), ~36 regs/thread, ~1 block(s)/SM (the plans for fewer blocks do not keep the row on chip)
//   hidden             24578
//   vec                2
//   threads_per_row    1024
//   rows_per_block     1
//   cluster            2
//   batch              7
//   unroll             4
//   full_unroll        False
//   stages             2
//   aligned_copy       True
//   placements         T0:Float->smem(cp.async), T1:Float->smem, T2:Float->smem
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      36
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         98368       0    98432  row buffer T0 (Float), 2 stage(s) x 1 row(s) x 12290 in 3074 16-byte chunks
// s_T1         49160   98432    49280  column buffer T1 (Float) x 12290
// s_T2         49160  147712    49280  column buffer T2 (Float) x 12290
// s_reduce       256  196992      256  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 32 warps x 4 B
// s_cluster        8  197248      128  cluster exchange: 2 parities x 1 x 1 row(s) x 4 B, read by the 2 blocks of the cluster
// static slot    128  static      128  static __shared__ (magic zero)
// total 197504 B = dynamic 197376 + static 128; limit 232448 B; headroom 34944 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 1024, ... (7 of them, 2 elements each);
// Shared row buffers are filled in 16-byte chunks from the 16-byte boundary at or below each
// row's start; a thread reads its vectors at the row's offset, after a barrier.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(1024, 1)
layernorm_fwd_row(
    const float* __restrict__ g_T0,
    const float* __restrict__ g_T1,
    const float* __restrict__ g_T2,
    float* __restrict__ g_T34,
    float* __restrict__ g_T18,
    float* __restrict__ g_T21,
    long long n_rows)
{
  constexpr int H = 24578;
  constexpr int VEC = 2;
  constexpr int NV = 12289;  // vectors per row
  constexpr int TPR = 1024;
  constexpr int RPB = 1;
  constexpr int BATCH = 7;
  constexpr int STAGES = 2;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  // The row's vectors are split over the 2 blocks of a cluster: this block owns [jbase, jend).
  constexpr int NVC = 6145;  // vectors per block of the cluster
  const unsigned rank = fm::cluster_rank();
  const unsigned cluster = fm::cluster_index();
  const int jbase = static_cast<int>(rank) * NVC;
  const int jend = min(NV, jbase + NVC);
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::Vec<float, VEC>* s_T1 = reinterpret_cast<fm::Vec<float, VEC>*>(smem + 98432);
  fm::Vec<float, VEC>* s_T2 = reinterpret_cast<fm::Vec<float, VEC>*>(smem + 147712);
  float* s_cluster = reinterpret_cast<float*>(smem + 197248);
  float* s_reduce = reinterpret_cast<float*>(smem + 196992);
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
    const int j = jbase + b * TPR + tx;
    if (j < jend) {
      if (ty == 0) s_T1[(j - jbase)] = fm::load<VEC>(g_T1 + j * VEC);
      if (ty == 0) s_T2[(j - jbase)] = fm::load<VEC>(g_T2 + j * VEC);
    }
  }
  __syncthreads();  // column buffers are shared by the block's rows


  const long long row_stride = static_cast<long long>(fm::cluster_count()) * RPB;
  long long row0 = static_cast<long long>(cluster) * RPB;
  // Prologue of the two-stage pipeline: this block's first rows start loading now.
  if (row0 + ty < n_rows) {
    fm::copy_row_chunks<4>(smem + 0 + ty * 49184, g_T0 + (row0 + ty) * H + jbase * VEC, (jend - jbase) * VEC * static_cast<int>(sizeof(float)), tx, TPR);
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
    __syncthreads();  // every thread is done with the stage the copies below overwrite
    if (next < n_rows) {
      fm::copy_row_chunks<4>(smem + 0 + ((stage ^ 1) * RPB + ty) * 49184, g_T0 + next * H + jbase * VEC, (jend - jbase) * VEC * static_cast<int>(sizeof(float)), tx, TPR);
    }
    fm::cp_async_commit();
    fm::cp_async_wait<1>();
    __syncthreads();  // the row's chunks were copied by every thread of the row
    const fm::Vec<float, VEC>* s_T0_row = reinterpret_cast<const fm::Vec<float, VEC>*>(smem + 0 + (stage * RPB + ty) * 49184 + fm::row_offset(g_T0, (row * H + jbase * VEC) * static_cast<long long>(sizeof(float))));

    // Inner reduction level 0.
    float row_T5 = float(0);
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (j < jend) {
        const fm::Vec<float, VEC> x_T0 = s_T0_row[(j - jbase)];
        const fm::Vec<float, VEC> c_T1 = s_T1[(j - jbase)];
        const fm::Vec<float, VEC> c_T2 = s_T2[(j - jbase)];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          row_T5 = fm::Sum{}(row_T5, fm::to_compute(x_T0.v[i]));
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
    {
      // Across the cluster: each block posts its part of the row's sums, one cluster barrier,
      // every block adds all parts in rank order (the same sum, in the same order, in each).
      float* post = s_cluster + ((it * 2 + 0) & 1) * (1 * RPB);
      if (tx == 0) {
        post[0 * RPB + ty] = row_T5;
      }
      fm::cluster_sync();
      row_T5 = fm::load_peer(&post[0 * RPB + ty], 0);
      for (unsigned q = 1; q < 2; ++q) {
        row_T5 = fm::Sum{}(row_T5, fm::load_peer(&post[0 * RPB + ty], q));
      }
    }
    const float row_T6 = (row_T5 / static_cast<float>(S4));

    // Inner reduction level 1.
    float row_T14 = float(0);
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (j < jend) {
        const fm::Vec<float, VEC> x_T0 = s_T0_row[(j - jbase)];
        const fm::Vec<float, VEC> c_T1 = s_T1[(j - jbase)];
        const fm::Vec<float, VEC> c_T2 = s_T2[(j - jbase)];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T10 = (fm::to_compute(x_T0.v[i]) - row_T6);
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
    {
      // Across the cluster: each block posts its part of the row's sums, one cluster barrier,
      // every block adds all parts in rank order (the same sum, in the same order, in each).
      float* post = s_cluster + ((it * 2 + 1) & 1) * (1 * RPB);
      if (tx == 0) {
        post[0 * RPB + ty] = row_T14;
      }
      fm::cluster_sync();
      row_T14 = fm::load_peer(&post[0 * RPB + ty], 0);
      for (unsigned q = 1; q < 2; ++q) {
        row_T14 = fm::Sum{}(row_T14, fm::load_peer(&post[0 * RPB + ty], q));
      }
    }
    const float row_T15 = (row_T14 / static_cast<float>(S13));
    const float row_T20 = (row_T15 + static_cast<float>(S19));
    const float row_T21 = fm::rsqrt(row_T20);

    // Outputs of the row.
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (j < jend) {
        const fm::Vec<float, VEC> x_T0 = s_T0_row[(j - jbase)];
        const fm::Vec<float, VEC> c_T1 = s_T1[(j - jbase)];
        const fm::Vec<float, VEC> c_T2 = s_T2[(j - jbase)];
        fm::Vec<float, VEC> o_T34;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float e_T25 = (fm::to_compute(x_T0.v[i]) - row_T6);
          const float e_T29 = (e_T25 * row_T21);
          const float e_T31 = (e_T29 * fm::to_compute(c_T1.v[i]));
          const float e_T33 = (e_T31 + fm::to_compute(c_T2.v[i]));
          o_T34.v[i] = fm::to_storage<float>(e_T33);
        }
        if (valid) fm::store_vector<VEC>(g_T34 + row * H + j * VEC, o_T34);
      }
    }
    if (valid && tx == 0 && rank == 0) g_T18[row] = fm::to_storage<float>(row_T6);
    if (valid && tx == 0 && rank == 0) g_T21[row] = fm::to_storage<float>(row_T21);
  }
  fm::cluster_sync();  // no block leaves while a peer may still read its shared memory
}
