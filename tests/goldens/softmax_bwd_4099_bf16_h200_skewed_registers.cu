// fuser kernel module for fusion 'softmax_bwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T2 = fd.ops.cast(T0, dtype=DataType.Float)
//     T3 = fd.ops.cast(T1, dtype=DataType.Float)
//     T4 = fd.ops.mul(T3, T2)
//     T5 = fd.ops.sum(T4, dims=[1], keepdim=True, dtype=DataType.Float)
//     S6 = fd.ops.size(T0, dim=0)
//     S7 = fd.ops.size(T0, dim=1)
//     T8 = fd.ops.broadcast_in_dim(T5, shape=[S6, S7], broadcast_dims=[0, 1])
//     T9 = fd.ops.sub(T3, T8)
//     T10 = fd.ops.mul(T2, T9)
//     T11 = fd.ops.cast(T10, dtype=DataType.BFloat16)
//     fd.add_output(T11)
//
// kind:              inner reduction
// full inputs:       T0:BFloat16, T1:BFloat16
// row inputs:        -
// column inputs:     -
// scalar inputs:     -
// persistent:        T0:BFloat16, T1:BFloat16
// inner level 0:     sum(T4)->T5
// outputs:           T11:full
//
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: nothing in smem, skewed rows (8-element vectors from the boundary below
//       each row's start, which lies on a multiple of 1), ~120 regs/thread, ~2 block(s)/SM (as hinted)
//   hidden             4099
//   vec                8
//   skew               1
//   threads_per_row    64
//   rows_per_block     4
//   cluster            1
//   batch              9
//   unroll             9
//   full_unroll        True
//   kept               ()
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->registers, T1:BFloat16->registers
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      120
//   blocks_per_sm      2
//   dealing            grid
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_reduce        64       0      128  inner-reduction scratch: 2 parities x 1 x 4 row(s) x 2 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 256 B = dynamic 128 + static 128; limit 232448 B; headroom 232192 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 4 row(s) at a time; a block per row group.
// Thread x of a row owns vectors x, x + 64, ... (9 of them, 8 element(s) each) of the row.
// Inputs: T0, T1 in registers.
// Rows are skewed: 8 does not divide 4099, so a row's vectors start at the 8-element boundary at or below its start,
// and its first and last vectors are masked to the row's elements.
extern "C" __global__ void __launch_bounds__(256, 2)
softmax_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T11,
    long long n_rows)
{
  constexpr int H = 4099;  // elements per row
  constexpr int RPB = 4;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 8, 64, RPB, 9, 9, 1, 1>;
  const Part part;
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // inner-reduction scratch: 2 parities x 1 x 4 row(s) x 2 warps x 4 B
  unsigned char* const s_reduce = smem;

  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(s_reduce, nullptr);

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // elements from the row's vector boundary to its start (a multiple of 1)
    const fm::RowInRegisters<__nv_bfloat16, Part> T0(part, g_T0, row, valid);
    const fm::RowInRegisters<__nv_bfloat16, Part> T1(part, g_T1, row, valid);

    // Inner reduction level 0: sum(T4) -> T5.
    float row_T5 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T1 = T1.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T2 = fm::element(x_T0, i);
        const float e_T3 = fm::element(x_T1, i);
        const float e_T4 = (e_T3 * e_T2);
        if (fm::in_row<Part>(v, i)) row_T5 = fm::Sum{}(row_T5, e_T4);
      }
    });
    reduce(part, fm::reduced(row_T5, fm::Sum{}));

    // Outputs of the row.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T1 = T1.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T11;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T2 = fm::element(x_T0, i);
        const float e_T3 = fm::element(x_T1, i);
        const float e_T9 = (e_T3 - row_T5);
        const float e_T10 = (e_T2 * e_T9);
        o_T11.v[i] = fm::to_storage<__nv_bfloat16>(e_T10);
      }
      if (valid) fm::store_visit<Part, true>(g_T11 + row * H, v, o_T11);
    });
  }
}
