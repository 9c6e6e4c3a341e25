// fuser kernel module for fusion 'rmsnorm_fwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T2 = fd.ops.cast(T0, dtype=DataType.Float)
//     T3 = fd.ops.mul(T2, T2)
//     T4 = fd.ops.sum(T3, dims=[1], keepdim=True, dtype=DataType.Float)
//     S5 = fd.ops.size(T0, dim=1)
//     T6 = fd.ops.div(T4, S5)
//     S7 = fd.define_scalar(1e-06, dtype=DataType.Double)
//     T8 = fd.ops.add(T6, S7)
//     T9 = fd.ops.rsqrt(T8)
//     S10 = fd.ops.size(T0, dim=0)
//     S11 = fd.ops.size(T0, dim=1)
//     T12 = fd.ops.broadcast_in_dim(T9, shape=[S10, S11], broadcast_dims=[0, 1])
//     T13 = fd.ops.mul(T2, T12)
//     T14 = fd.ops.cast(T1, dtype=DataType.Float)
//     T15 = fd.ops.mul(T13, T14)
//     T16 = fd.ops.cast(T15, dtype=DataType.BFloat16)
//     fd.add_output(T16)
//     fd.add_output(T9)
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
//   reason             registers-first policy: T0, T1 in smem, ~48 regs/thread, ~2 block(s)/SM (one stage at 512
//       threads per row, a block per row group)
//   hidden             16384
//   vec                8
//   skew               0
//   threads_per_row    512
//   rows_per_block     1
//   cluster            1
//   batch              4
//   unroll             4
//   full_unroll        False
//   kept               ()
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T1:BFloat16->smem
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      2
//   dealing            grid
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         32768       0    32768  row buffer T0 (BFloat16), 1 stage(s) x 1 row(s) x 16384
// s_T1         32768   32768    32768  column buffer T1 (BFloat16) x 16384
// s_reduce       128   65536      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 65792 B = dynamic 65664 + static 128; limit 232448 B; headroom 166656 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a block per row group.
// Thread x of a row owns vectors x, x + 512, ... (4 of them, 8 element(s) each) of the row.
// Inputs: T0, T1 in smem.
extern "C" __global__ void __launch_bounds__(512, 2)
rmsnorm_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T16,
    float* __restrict__ g_T9,
    long long n_rows)
{
  constexpr int H = 16384;  // elements per row
  constexpr int RPB = 1;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 8, 512, RPB, 4, 4, 1, 0>;
  const Part part;
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // row buffer T0 (BFloat16), 1 stage(s) x 1 row(s) x 16384
  unsigned char* const s_T0 = smem;
  // column buffer T1 (BFloat16) x 16384
  unsigned char* const s_T1 = smem + 32768;
  // inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
  unsigned char* const s_reduce = smem + 65536;
  const long long S5 = static_cast<long long>(H);
  const double S7 = 1e-06;

  fm::ColumnInSmem<__nv_bfloat16, Part> T1(part, s_T1, g_T1);
  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(s_reduce, nullptr);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 32768> T0(s_T0, g_T0);
  __syncthreads();  // the column buffers are shared by the block's rows

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // 0: rows start on vector boundaries
    const int slot = part.ty;
    T0.copy(part, slot, row, n_rows);
    fm::cp_async_commit();
    fm::cp_async_wait<0>();
    T0.ready(part, slot, row);

    // Inner reduction level 0: sum(T3) -> T4.
    float row_T4 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T2 = fm::element(x_T0, i);
        const float e_T3 = (e_T2 * e_T2);
        if (fm::in_row<Part>(v, i)) row_T4 = fm::Sum{}(row_T4, e_T3);
      }
    });
    reduce(part, fm::reduced(row_T4, fm::Sum{}));
    const float row_T6 = (row_T4 / static_cast<float>(S5));
    const float row_T8 = (row_T6 + static_cast<float>(S7));
    const float row_T9 = fm::rsqrt(row_T8);

    // Outputs of the row.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto c_T1 = T1.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T16;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T2 = fm::element(x_T0, i);
        const float e_T13 = (e_T2 * row_T9);
        const float e_T14 = fm::element(c_T1, i);
        const float e_T15 = (e_T13 * e_T14);
        o_T16.v[i] = fm::to_storage<__nv_bfloat16>(e_T15);
      }
      if (valid) fm::store_visit<Part, true>(g_T16 + row * H, v, o_T16);
    });
    if (valid && part.writes_row_values()) g_T9[row] = fm::to_storage<float>(row_T9);
  }
}
