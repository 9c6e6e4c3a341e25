// fuser kernel module for fusion 'softmax_fwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.ops.cast(T0, dtype=DataType.Float)
//     T2 = fd.ops.max(T1, dims=[1], keepdim=True, dtype=DataType.Float)
//     S3 = fd.ops.size(T0, dim=0)
//     S4 = fd.ops.size(T0, dim=1)
//     T5 = fd.ops.broadcast_in_dim(T2, shape=[S3, S4], broadcast_dims=[0, 1])
//     T6 = fd.ops.sub(T1, T5)
//     T7 = fd.ops.exp(T6)
//     T8 = fd.ops.sum(T7, dims=[1], keepdim=True, dtype=DataType.Float)
//     S9 = fd.ops.size(T0, dim=0)
//     S10 = fd.ops.size(T0, dim=1)
//     T11 = fd.ops.broadcast_in_dim(T8, shape=[S9, S10], broadcast_dims=[0, 1])
//     T12 = fd.ops.div(T7, T11)
//     T13 = fd.ops.cast(T12, dtype=DataType.BFloat16)
//     fd.add_output(T13)
//
// kind:              inner reduction
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     -
// scalar inputs:     -
// persistent:        T0:BFloat16
// inner level 0:     max(T1)->T2
// inner level 1:     sum(T7)->T8
// outputs:           T13:full
//
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: T0 in smem, skewed rows (8-element vectors from the boundary below each
//       row's start, which lies on a multiple of 2), ~48 regs/thread, ~2 block(s)/SM
//   hidden             24578
//   vec                8
//   skew               2
//   threads_per_row    512
//   rows_per_block     1
//   cluster            1
//   batch              7
//   unroll             4
//   full_unroll        False
//   kept               ()
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async)
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      2
//   dealing            grid
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         49168       0    49280  row buffer T0 (BFloat16), 1 stage(s) x 1 row(s) x 24584
// s_reduce       128   49280      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 49536 B = dynamic 49408 + static 128; limit 232448 B; headroom 182912 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a block per row group.
// Thread x of a row owns vectors x, x + 512, ... (7 of them, 8 element(s) each) of the row.
// Inputs: T0 in smem.
// Rows are skewed: 8 does not divide 24578, so a row's vectors start at the 8-element boundary at or below its start,
// and its first and last vectors are masked to the row's elements.
extern "C" __global__ void __launch_bounds__(512, 2)
softmax_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    __nv_bfloat16* __restrict__ g_T13,
    long long n_rows)
{
  constexpr int H = 24578;  // elements per row
  constexpr int RPB = 1;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 8, 512, RPB, 7, 4, 1, 2>;
  const Part part;
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // row buffer T0 (BFloat16), 1 stage(s) x 1 row(s) x 24584
  unsigned char* const s_T0 = smem;
  // inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
  unsigned char* const s_reduce = smem + 49280;

  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(s_reduce, nullptr);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 49168> T0(s_T0, g_T0);

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // elements from the row's vector boundary to its start (a multiple of 2)
    const int slot = part.ty;
    T0.copy(part, slot, row, n_rows);
    fm::cp_async_commit();
    fm::cp_async_wait<0>();
    T0.ready(part, slot, row);

    // Inner reduction level 0: max(T1) -> T2.
    float row_T2 = fm::Max::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T1 = fm::element(x_T0, i);
        if (fm::in_row<Part>(v, i)) row_T2 = fm::Max{}(row_T2, e_T1);
      }
    });
    reduce(part, fm::reduced(row_T2, fm::Max{}));

    // Inner reduction level 1: sum(T7) -> T8.
    float row_T8 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T1 = fm::element(x_T0, i);
        const float e_T6 = (e_T1 - row_T2);
        const float e_T7 = fm::exp(e_T6);
        if (fm::in_row<Part>(v, i)) row_T8 = fm::Sum{}(row_T8, e_T7);
      }
    });
    reduce(part, fm::reduced(row_T8, fm::Sum{}));
    const float row_rcp_T8 = float(1) / row_T8;

    // Outputs of the row.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T13;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T1 = fm::element(x_T0, i);
        const float e_T6 = (e_T1 - row_T2);
        const float e_T7 = fm::exp(e_T6);
        const float e_T12 = (e_T7 * row_rcp_T8);
        o_T13.v[i] = fm::to_storage<__nv_bfloat16>(e_T12);
      }
      if (valid) fm::store_visit<Part, true>(g_T13 + row * H, v, o_T13);
    });
  }
}
