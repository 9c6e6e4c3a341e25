// fuser kernel module for fusion 'rmsnorm_fwd' (templates <templates>)
// 
// kind:              inner reduction
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     T1:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16
// inner level 0:     sum(T3)->T4
// outputs:           T16:full, T9:row
// 
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: only the staging ring in smem, T1 re-read each pass, T0 re-read each pass through a staging ring (cp.async.bulk, 4 slots x 8 chunk(s)), rows split over a cluster of 8 blocks of 131072 elements, ~48 regs/thread, ~1 block(s)/SM (8 block(s) cannot keep the row on chip)
//   hidden             1048576
//   vec                8
//   threads_per_row    1024
//   rows_per_block     1
//   cluster            8
//   batch              16
//   unroll             2
//   full_unroll        False
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->ring, T1:BFloat16->global
//   accumulators       registers
//   ring               T0 by cp.async.bulk: 4 slots, 8 chunk(s) of 16384 elements (tail 16384) per pass, 2 pass(es) per row
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer        bytes  offset  aligned  purpose
// s_ring_T0    131072       0   131072  staging ring T0: 4 slots x 16384 elements, 8 chunk(s) per pass, tail 16384
// s_ring_full      32  131072      128  4 mbarriers (8 B each), one per ring slot: the slot's bulk copies have landed
// s_reduce        256  131200      256  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 32 warps x 4 B
// s_cluster         8  131456      128  cluster exchange: 2 parities x 1 x 1 row(s) x 4 B, read by the 8 blocks of the cluster
// static slot     128  static      128  static __shared__ (magic zero)
// total 131712 B = dynamic 131584 + static 128; limit 232448 B; headroom 100736 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 1024, ... (16 of them, 8 elements each);
// row buffers in the staging ring are read chunk by chunk from its slots, after the chunk
// has landed (by bulk copies, a whole chunk at once).
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(1024, 1)
rmsnorm_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T16,
    float* __restrict__ g_T9,
    long long n_rows)
{
  constexpr int H = 1048576;
  constexpr int VEC = 8;
  constexpr int NV = 131072;  // vectors per row
  constexpr int TPR = 1024;
  constexpr int RPB = 1;
  constexpr int BATCH = 16;
  constexpr int STAGES = 1;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  // The row's vectors are split over the 8 blocks of a cluster: this block owns [jbase, jend).
  constexpr int NVC = 16384;  // vectors per block of the cluster
  const unsigned rank = fm::cluster_rank();
  const unsigned cluster = fm::cluster_index();
  const int jbase = static_cast<int>(rank) * NVC;
  const int jend = min(NV, jbase + NVC);
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  float* s_cluster = reinterpret_cast<float*>(smem + 131456);
  float* s_reduce = reinterpret_cast<float*>(smem + 131200);
  // Staging ring: T0 by cp.async.bulk: 4 slots, 8 chunk(s) of 16384 elements (tail 16384) per pass, 2 pass(es) per row.
  // Every pass over a row reads its chunks in turn; the block's q-th chunk read goes through
  // slot q % RING_DEPTH, where it was copied RING_DEPTH chunks earlier.
  constexpr int RING_DEPTH = 4;
  constexpr int RING_UNITS = 2;  // vectors per thread per chunk
  constexpr int RING_CV = 2048;  // vectors per chunk: RING_UNITS x TPR
  constexpr int RING_CHUNKS = 8;  // chunks per pass: BATCH / RING_UNITS
  constexpr int RING_PASSES = 2;  // passes per row
  fm::Vec<__nv_bfloat16, VEC>* ring_T0 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 0);  // slots 2048 vectors apart
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "this kernel's staging ring is filled by cp.async.bulk on mbarriers, which needs sm_90"
#endif
  unsigned long long* ring_full = reinterpret_cast<unsigned long long*>(smem + 131072);
  if (tx == 0 && ty == 0) {
    for (int k = 0; k < RING_DEPTH; ++k) fm::mbarrier_init(&ring_full[k], 1);  // one arrival per phase: the copying thread's
    fm::fence_mbarrier_init();  // the initialised barriers are visible to the bulk copy engine
  }
  __syncthreads();
  const long long S5 = static_cast<long long>(H);
  const double S7 = 1e-06;
  const long long S10 = n_rows;
  const long long S11 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 2
  for (int b = 0; b < BATCH; ++b) {
    const int j = jbase + b * TPR + tx;
    if (j < jend) {
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
    fm::mbarrier_expect_tx(&ring_full[k], vectors * VEC * (sizeof(__nv_bfloat16)));
    if (vectors > 0) {
      fm::bulk_copy(&ring_T0[k * 2048], g_T0 + r * H + (jbase + c * RING_CV) * VEC, vectors * VEC * static_cast<int>(sizeof(__nv_bfloat16)), &ring_full[k]);
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

    // Inner reduction level 0.
    float row_T4 = float(0);
#pragma unroll 1
    for (int c = 0; c < RING_CHUNKS; ++c, ++ring_q) {
      const int ring_slot = ring_q % RING_DEPTH;
      fm::mbarrier_wait(&ring_full[ring_slot], (ring_q / RING_DEPTH) & 1);  // the chunk has landed
#pragma unroll
      for (int u = 0; u < RING_UNITS; ++u) {
        const int b = c * RING_UNITS + u;
        const int j = jbase + b * TPR + tx;
        if (true) {
          const fm::Vec<__nv_bfloat16, VEC> x_T0 = ring_T0[ring_slot * 2048 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> c_T1 = fm::load<VEC>(g_T1 + j * VEC);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float e_T2 = fm::to_compute(x_T0.v[i]);
            const float e_T3 = (e_T2 * e_T2);
            row_T4 = fm::Sum{}(row_T4, e_T3);
          }
        }
      }
      __syncthreads();  // every thread is done with the slot: refill it, RING_DEPTH chunks ahead
      if (tx == 0) ring_fill(ring_q + RING_DEPTH);
    }
    row_T4 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T4, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      float* slot = s_reduce + ((it * 1 + 0) & 1) * (1 * RPB * (TPR / 32));
      if ((tx & 31) == 0) {
        slot[(0 * RPB + ty) * (TPR / 32) + tx / 32] = row_T4;
      }
      __syncthreads();
      row_T4 = slot[(0 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T4 = fm::Sum{}(row_T4, slot[(0 * RPB + ty) * (TPR / 32) + w]);
      }
    }
    {
      // Across the cluster: each block posts its part of the row's sums, one cluster barrier,
      // every block adds all parts in rank order (the same sum, in the same order, in each).
      float* post = s_cluster + ((it * 1 + 0) & 1) * (1 * RPB);
      if (tx == 0) {
        post[0 * RPB + ty] = row_T4;
      }
      fm::cluster_sync();
      row_T4 = fm::load_peer(&post[0 * RPB + ty], 0);
      for (unsigned q = 1; q < 8; ++q) {
        row_T4 = fm::Sum{}(row_T4, fm::load_peer(&post[0 * RPB + ty], q));
      }
    }
    const float row_T6 = (row_T4 / static_cast<float>(S5));
    const float row_T8 = (row_T6 + static_cast<float>(S7));
    const float row_T9 = fm::rsqrt(row_T8);

    // Outputs of the row.
#pragma unroll 1
    for (int c = 0; c < RING_CHUNKS; ++c, ++ring_q) {
      const int ring_slot = ring_q % RING_DEPTH;
      fm::mbarrier_wait(&ring_full[ring_slot], (ring_q / RING_DEPTH) & 1);  // the chunk has landed
#pragma unroll
      for (int u = 0; u < RING_UNITS; ++u) {
        const int b = c * RING_UNITS + u;
        const int j = jbase + b * TPR + tx;
        if (true) {
          const fm::Vec<__nv_bfloat16, VEC> x_T0 = ring_T0[ring_slot * 2048 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> c_T1 = fm::load<VEC>(g_T1 + j * VEC);
          fm::Vec<__nv_bfloat16, VEC> o_T16;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float e_T2 = fm::to_compute(x_T0.v[i]);
            const float e_T13 = (e_T2 * row_T9);
            const float e_T14 = fm::to_compute(c_T1.v[i]);
            const float e_T15 = (e_T13 * e_T14);
            const float e_T16 = fm::round_bf16(e_T15);
            o_T16.v[i] = fm::to_storage<__nv_bfloat16>(e_T16);
          }
          if (valid) fm::store_vector<VEC>(g_T16 + row * H + j * VEC, o_T16);
        }
      }
      __syncthreads();  // every thread is done with the slot: refill it, RING_DEPTH chunks ahead
      if (tx == 0) ring_fill(ring_q + RING_DEPTH);
    }
    if (valid && tx == 0 && rank == 0) g_T9[row] = fm::to_storage<float>(row_T9);
  }
  fm::cluster_sync();  // no block leaves while a peer may still read its shared memory
}
