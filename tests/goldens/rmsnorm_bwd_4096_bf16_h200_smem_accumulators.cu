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
//   reason             smem-first policy: T3 in smem, T0, T2 re-read each pass through a staging ring (cp.async.bulk, 4 slots x 1 chunk(s)), column accumulators in smem, rows split over a cluster of 8 blocks of 512 elements, ~48 regs/thread, ~18 block(s)/SM (8 block(s) cannot keep the row on chip)
//   hidden             4096
//   vec                8
//   threads_per_row    64
//   rows_per_block     1
//   cluster            8
//   batch              1
//   unroll             1
//   full_unroll        False
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->ring, T2:BFloat16->ring, T3:BFloat16->smem
//   accumulators       smem
//   ring               T0, T2 by cp.async.bulk: 4 slots, 1 chunk(s) of 512 elements (tail 512) per pass, 2 pass(es) per row
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      18
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_ring_T0     4096       0     4096  staging ring T0: 4 slots x 512 elements, 1 chunk(s) per pass, tail 512
// s_ring_T2     4096    4096     4096  staging ring T2: 4 slots x 512 elements, 1 chunk(s) per pass, tail 512
// s_ring_full     32    8192      128  4 mbarriers (8 B each), one per ring slot: the slot's bulk copies have landed
// s_T3          1024    8320     1024  column buffer T3 (BFloat16) x 512
// s_acc_T25     2048    9344     2048  column accumulator T25 x 1 row(s) x 512
// s_reduce        16   11392      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 2 warps x 4 B
// s_cluster        8   11520      128  cluster exchange: 2 parities x 1 x 1 row(s) x 4 B, read by the 8 blocks of the cluster
// static slot    128  static      128  static __shared__ (magic zero)
// total 11776 B = dynamic 11648 + static 128; limit 232448 B; headroom 220672 B; alignment 128 B
// 
// FinalizeSchedule
//   hidden             4096
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

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 64, ... (1 of them, 8 elements each);
// row buffers in the staging ring are read chunk by chunk from its slots, after the chunk
// has landed (by bulk copies, a whole chunk at once).
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(64, 18)
rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T3,
    const float* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T26,
    float* __restrict__ g_part_T25,
    long long n_rows)
{
  constexpr int H = 4096;
  constexpr int VEC = 8;
  constexpr int NV = 512;  // vectors per row
  constexpr int TPR = 64;
  constexpr int RPB = 1;
  constexpr int BATCH = 1;
  constexpr int STAGES = 1;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  // The row's vectors are split over the 8 blocks of a cluster: this block owns [jbase, jend).
  constexpr int NVC = 64;  // vectors per block of the cluster
  const unsigned rank = fm::cluster_rank();
  const unsigned cluster = fm::cluster_index();
  const int jbase = static_cast<int>(rank) * NVC;
  const int jend = min(NV, jbase + NVC);
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end
  fm::Vec<__nv_bfloat16, VEC>* s_T3 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 8320);
  float* s_cluster = reinterpret_cast<float*>(smem + 11520);
  float* s_reduce = reinterpret_cast<float*>(smem + 11392);
  // Staging ring: T0, T2 by cp.async.bulk: 4 slots, 1 chunk(s) of 512 elements (tail 512) per pass, 2 pass(es) per row.
  // Every pass over a row reads its chunks in turn; the block's q-th chunk read goes through
  // slot q % RING_DEPTH, where it was copied RING_DEPTH chunks earlier.
  constexpr int RING_DEPTH = 4;
  constexpr int RING_UNITS = 1;  // vectors per thread per chunk
  constexpr int RING_CV = 64;  // vectors per chunk: RING_UNITS x TPR
  constexpr int RING_CHUNKS = 1;  // chunks per pass: BATCH / RING_UNITS
  constexpr int RING_PASSES = 2;  // passes per row
  fm::Vec<__nv_bfloat16, VEC>* ring_T0 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);  // slots 64 vectors apart
  fm::Vec<__nv_bfloat16, VEC>* ring_T2 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 4096);  // slots 64 vectors apart
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "this kernel's staging ring is filled by cp.async.bulk on mbarriers, which needs sm_90"
#endif
  unsigned long long* ring_full = reinterpret_cast<unsigned long long*>(smem + 8192);
  if (tx == 0 && ty == 0) {
    for (int k = 0; k < RING_DEPTH; ++k) fm::mbarrier_init(&ring_full[k], 1);  // one arrival per phase: the copying thread's
    fm::fence_mbarrier_init();  // the initialised barriers are visible to the bulk copy engine
  }
  __syncthreads();
  const long long S5 = n_rows;
  const long long S6 = static_cast<long long>(H);
  const long long S15 = static_cast<long long>(H);
  const long long S17 = n_rows;
  const long long S18 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 1
  for (int b = 0; b < BATCH; ++b) {
    const int j = jbase + b * TPR + tx;
    if (j < jend) {
      if (ty == 0) s_T3[(j - jbase)] = fm::load<VEC>(g_T3 + j * VEC);
    }
  }
  __syncthreads();  // column buffers are shared by the block's rows

  // Column accumulators, in shared memory (each thread its own slots).
  float* s_acc_T25 = reinterpret_cast<float*>(smem + 9344);
#pragma unroll 1
  for (int b = 0; b < BATCH; ++b) {
    const int j = jbase + b * TPR + tx;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (j < jend) s_acc_T25[(ty * NVC + (j - jbase)) * VEC + i] = float(0);
    }
  }

  const long long row_stride = static_cast<long long>(fm::cluster_count()) * RPB;
  long long row0 = static_cast<long long>(cluster) * RPB;
  // Copies the block's q-th chunk into slot q % RING_DEPTH: chunk q % RING_CHUNKS of its row
  // q / (RING_CHUNKS * RING_PASSES) (every pass reads the row again); nothing past the last row.
  const long long ring_row0 = row0;
  auto ring_fill = [&](int q) {
    const long long r = ring_row0 + static_cast<long long>(q / (RING_CHUNKS * RING_PASSES)) * row_stride;
    const int c = q % RING_CHUNKS;
    const int k = q % RING_DEPTH;
    const int vectors = max(0, min(RING_CV, (jend - jbase) - c * RING_CV));  // StagingRing.spans: the tail chunk holds fewer
    if (r >= n_rows) return;
    fm::mbarrier_expect_tx(&ring_full[k], vectors * VEC * (sizeof(__nv_bfloat16) + sizeof(__nv_bfloat16)));
    if (vectors > 0) {
      fm::bulk_copy(&ring_T0[k * 64], g_T0 + r * H + (jbase + c * RING_CV) * VEC, vectors * VEC * static_cast<int>(sizeof(__nv_bfloat16)), &ring_full[k]);
      fm::bulk_copy(&ring_T2[k * 64], g_T2 + r * H + (jbase + c * RING_CV) * VEC, vectors * VEC * static_cast<int>(sizeof(__nv_bfloat16)), &ring_full[k]);
    }
  };
  int ring_q = 0;  // chunks this block has read
  if (tx == 0) {
    for (int q = 0; q < RING_DEPTH; ++q) ring_fill(q);  // the first RING_DEPTH chunks
  }
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + ty + zero;
    const bool valid = row < n_rows;
    const int stage = STAGES == 2 ? (it & 1) : 0;
    const float row_T1 = valid ? fm::to_compute(g_T1[row]) : float(0);

    // Inner reduction level 0.
    float row_T14 = float(0);
#pragma unroll 1
    for (int c = 0; c < RING_CHUNKS; ++c, ++ring_q) {
      const int ring_slot = ring_q % RING_DEPTH;
      fm::mbarrier_wait(&ring_full[ring_slot], (ring_q / RING_DEPTH) & 1);  // the chunk has landed
#pragma unroll
      for (int u = 0; u < RING_UNITS; ++u) {
        const int b = c * RING_UNITS + u;
        const int j = jbase + b * TPR + tx;
        if (true) {
          const fm::Vec<__nv_bfloat16, VEC> x_T0 = ring_T0[ring_slot * 64 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> x_T2 = ring_T2[ring_slot * 64 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> c_T3 = s_T3[(j - jbase)];
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
      __syncthreads();  // every thread is done with the slot: refill it, RING_DEPTH chunks ahead
      if (tx == 0) ring_fill(ring_q + RING_DEPTH);
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
    {
      // Across the cluster: each block posts its part of the row's sums, one cluster barrier,
      // every block adds all parts in rank order (the same sum, in the same order, in each).
      float* post = s_cluster + ((it * 1 + 0) & 1) * (1 * RPB);
      if (tx == 0) {
        post[0 * RPB + ty] = row_T14;
      }
      fm::cluster_sync();
      row_T14 = fm::load_peer(&post[0 * RPB + ty], 0);
      for (unsigned q = 1; q < 8; ++q) {
        row_T14 = fm::Sum{}(row_T14, fm::load_peer(&post[0 * RPB + ty], q));
      }
    }
    const float row_T16 = (row_T14 / static_cast<float>(S15));

    // Outputs of the row and the column accumulators.
#pragma unroll 1
    for (int c = 0; c < RING_CHUNKS; ++c, ++ring_q) {
      const int ring_slot = ring_q % RING_DEPTH;
      fm::mbarrier_wait(&ring_full[ring_slot], (ring_q / RING_DEPTH) & 1);  // the chunk has landed
#pragma unroll
      for (int u = 0; u < RING_UNITS; ++u) {
        const int b = c * RING_UNITS + u;
        const int j = jbase + b * TPR + tx;
        if (true) {
          const fm::Vec<__nv_bfloat16, VEC> x_T0 = ring_T0[ring_slot * 64 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> x_T2 = ring_T2[ring_slot * 64 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> c_T3 = s_T3[(j - jbase)];
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
            if (valid) s_acc_T25[(ty * NVC + (j - jbase)) * VEC + i] = fm::Sum{}(s_acc_T25[(ty * NVC + (j - jbase)) * VEC + i], e_T24);
          }
          if (valid) fm::store_vector<VEC>(g_T26 + row * H + j * VEC, o_T26);
        }
      }
      __syncthreads();  // every thread is done with the slot: refill it, RING_DEPTH chunks ahead
      if (tx == 0) ring_fill(ring_q + RING_DEPTH);
    }
  }

  // Fold the block's rows into one partial row, straight from the accumulator slots.
  __syncthreads();
  if (ty == 0) {
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = jbase + b * TPR + tx;
      if (j < jend) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float total_T25 = s_acc_T25[(j - jbase) * VEC + i];
          for (int y = 1; y < RPB; ++y) {
            total_T25 = fm::Sum{}(total_T25, s_acc_T25[(y * NVC + (j - jbase)) * VEC + i]);
          }
          g_part_T25[static_cast<long long>(cluster) * H + j * VEC + i] = total_T25;
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
rmsnorm_bwd_finalize(
    const float* __restrict__ g_part_T25,
    const __nv_bfloat16* __restrict__ g_T3,
    __nv_bfloat16* __restrict__ g_T27,
    long long n_rows,
    int partial_rows)
{
  constexpr int H = 4096;
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
