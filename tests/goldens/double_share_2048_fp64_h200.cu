// fuser kernel module for fusion 'double_share' (templates <templates>)
// 
// kind:              inner reduction
// full inputs:       T0:Double
// row inputs:        -
// column inputs:     -
// scalar inputs:     -
// persistent:        T0:Double
// inner level 0:     sum(T0)->T1
// outputs:           T5:full, T1:row
// 
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: nothing in smem, ~52 regs/thread, ~4 block(s)/SM
//   hidden             2048
//   vec                2
//   threads_per_row    256
//   rows_per_block     1
//   cluster            1
//   batch              4
//   unroll             4
//   full_unroll        True
//   stages             1
//   aligned_copy       False
//   placements         T0:Double->registers
//   accumulators       registers
//   reduction_bytes    8
//   regs_estimate      52
//   blocks_per_sm      4
// 
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_reduce       128       0      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 8 warps x 8 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 256 B = dynamic 128 + static 128; limit 232448 B; headroom 232192 B; alignment 128 B
// 
#include "fuser_math.cuh"

// Each block works on 1 row(s) at a time and strides over all rows.
// Thread x of a row owns vectors x, x + 256, ... (4 of them, 2 elements each);
// shared row buffers are indexed the same way, so a thread only ever reads back what it copied.
extern "C" __global__ void __launch_bounds__(256, 4)
double_share_row(
    const double* __restrict__ g_T0,
    double* __restrict__ g_T5,
    double* __restrict__ g_T1,
    long long n_rows)
{
  constexpr int H = 2048;
  constexpr int VEC = 2;
  constexpr int NV = 1024;  // vectors per row
  constexpr int TPR = 256;
  constexpr int RPB = 1;
  constexpr int BATCH = 4;
  constexpr int STAGES = 1;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  extern __shared__ __align__(128) unsigned char smem[];
  const int zero = fm::magic_zero();
  double* s_reduce = reinterpret_cast<double*>(smem + 0);
  const long long S2 = n_rows;
  const long long S3 = static_cast<long long>(H);

  // Column inputs kept on chip: loaded once per block.
#pragma unroll 4
  for (int b = 0; b < BATCH; ++b) {
    const int j = b * TPR + tx;
    if (j < NV) {
    }
  }


  const long long row_stride = static_cast<long long>(gridDim.x) * RPB;
  long long row0 = static_cast<long long>(blockIdx.x) * RPB;
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + ty + zero;
    const bool valid = row < n_rows;
    const int stage = STAGES == 2 ? (it & 1) : 0;
    // Row buffers kept in registers: every load of the row issued before any is used.
    fm::Vec<double, VEC> r_T0[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      r_T0[b] = (valid && j < NV) ? fm::load<VEC>(g_T0 + row * H + j * VEC) : fm::Vec<double, VEC>{};
    }

    // Inner reduction level 0.
    double row_T1 = double(0);
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<double, VEC> x_T0 = r_T0[b];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          row_T1 = fm::Sum{}(row_T1, fm::to_compute(x_T0.v[i]));
        }
      }
    }
    row_T1 = fm::warp_reduce<(TPR < 32 ? TPR : 32)>(row_T1, fm::Sum{});
    {
      // Across the row's warps: lane 0 of each warp posts its partial, one barrier, every
      // thread sums the row's partials. Two parities so the next level never overwrites
      // partials that slower threads are still reading.
      double* slot = s_reduce + ((it * 1 + 0) & 1) * (1 * RPB * (TPR / 32));
      if ((tx & 31) == 0) {
        slot[(0 * RPB + ty) * (TPR / 32) + tx / 32] = row_T1;
      }
      __syncthreads();
      row_T1 = slot[(0 * RPB + ty) * (TPR / 32)];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) {
        row_T1 = fm::Sum{}(row_T1, slot[(0 * RPB + ty) * (TPR / 32) + w]);
      }
    }
    const double row_rcp_d_T1 = double(1) / row_T1;

    // Outputs of the row.
#pragma unroll 4
    for (int b = 0; b < BATCH; ++b) {
      const int j = b * TPR + tx;
      if (true) {
        const fm::Vec<double, VEC> x_T0 = r_T0[b];
        fm::Vec<double, VEC> o_T5;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const double e_T5 = (fm::to_compute(x_T0.v[i]) * row_rcp_d_T1);
          o_T5.v[i] = fm::to_storage<double>(e_T5);
        }
        if (valid) fm::store<VEC>(g_T5 + row * H + j * VEC, o_T5);
      }
    }
    if (valid && tx == 0) g_T1[row] = fm::to_storage<double>(row_T1);
  }
}
