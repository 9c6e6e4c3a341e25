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
//   reason             registers-first policy: T1 in smem, T0 re-read each pass through a staging ring (cp.async.bulk, 4 slots x 1 chunk(s)), ~48 regs/thread, ~1 block(s)/SM
//   hidden             16384
//   vec                8
//   threads_per_row    512
//   rows_per_block     1
//   cluster            1
//   batch              4
//   unroll             4
//   full_unroll        False
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->ring, T1:BFloat16->smem
//   accumulators       registers
//   ring               T0 by cp.async.bulk: 4 slots, 1 chunk(s) of 16384 elements (tail 16384) per pass, 2 pass(es) per row
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      1
// 
// shared memory plan:
// buffer        bytes  offset  aligned  purpose
// s_ring_T0    131072       0   131072  staging ring T0: 4 slots x 16384 elements, 1 chunk(s) per pass, tail 16384
// s_ring_full      32  131072      128  4 mbarriers (8 B each), one per ring slot: the slot's bulk copies have landed
// s_T1          32768  131200    32768  column buffer T1 (BFloat16) x 16384
// s_reduce        128  163968      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
// static slot     128  static      128  static __shared__ (magic zero)
// total 164224 B = dynamic 164096 + static 128; limit 232448 B; headroom 68224 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 512, ... (4 of them, 8 elements each);
// row buffers in the staging ring are read chunk by chunk from its slots, after the chunk
// has landed (by bulk copies, a whole chunk at once).
extern "C" __global__ void __launch_bounds__(512, 1)
rmsnorm_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T16,
    float* __restrict__ g_T9,
    long long n_rows)
{
  constexpr int H = 16384;
  constexpr int VEC = 8;
  constexpr int NV = 2048;  // vectors per row
  constexpr int TPR = 512;
  constexpr int RPB = 1;
  constexpr int BATCH = 4;
  constexpr int STAGES = 1;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  fm::Vec<__nv_bfloat16, VEC>* s_T1 = reinterpret_cast<fm::Vec<__nv_bfloat16, VEC>*>(smem + 131200);
  float* s_reduce = reinterpret_cast<float*>(smem + 163968);
  // Staging ring: T0 by cp.async.bulk: 4 slots, 1 chunk(s) of 16384 elements (tail 16384) per pass, 2 pass(es) per row.
  // Every pass over a row reads its chunks in turn; the block's q-th chunk read goes through
  // slot q % RING_DEPTH, where it was copied RING_DEPTH chunks earlier.
  constexpr int RING_DEPTH = 4;
  constexpr int RING_UNITS = 4;  // vectors per thread per chunk
  constexpr int RING_CV = 2048;  // vectors per chunk: RING_UNITS x TPR
  constexpr int RING_CHUNKS = 1;  // chunks per pass: BATCH / RING_UNITS
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
#pragma unroll 4
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
    if (j < NV) {
      if (ty == 0) s_T1[j] = fm::load<VEC>(g_T1 + j * VEC);
    }
  }
  __syncthreads();  // column buffers are shared by the block's rows


  const long long row_stride = static_cast<long long>(gridDim.x) * RPB;
  long long row0 = static_cast<long long>(blockIdx.x) * RPB;
  // Copies the block's q-th chunk into slot q % RING_DEPTH: chunk q % RING_CHUNKS of its row
  // q / (RING_CHUNKS * RING_PASSES) (every pass reads the row again); nothing past the last row.
  const long long ring_row0 = row0;
  auto ring_fill = [&](int q) {
    const long long r = ring_row0 + static_cast<long long>(q / (RING_CHUNKS * RING_PASSES)) * row_stride;
    const int c = q % RING_CHUNKS;
    const int k = q % RING_DEPTH;
    const int vectors = max(0, min(RING_CV, (NV - 0) - c * RING_CV));  // StagingRing.spans: the tail chunk holds fewer
    if (r >= n_rows) return;
    fm::mbarrier_expect_tx(&ring_full[k], vectors * VEC * (sizeof(__nv_bfloat16)));
    if (vectors > 0) {
      fm::bulk_copy(&ring_T0[k * 2048], g_T0 + r * H + (0 + c * RING_CV) * VEC, vectors * VEC * static_cast<int>(sizeof(__nv_bfloat16)), &ring_full[k]);
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
        const int j = b * TPR + tx;
        if (true) {
          const fm::Vec<__nv_bfloat16, VEC> x_T0 = ring_T0[ring_slot * 2048 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> c_T1 = s_T1[j];
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
        const int j = b * TPR + tx;
        if (true) {
          const fm::Vec<__nv_bfloat16, VEC> x_T0 = ring_T0[ring_slot * 2048 + u * TPR + tx];
          const fm::Vec<__nv_bfloat16, VEC> c_T1 = s_T1[j];
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
    if (valid && tx == 0) g_T9[row] = fm::to_storage<float>(row_T9);
  }
}
