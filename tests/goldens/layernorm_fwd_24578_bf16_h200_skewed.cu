// fuser kernel module for fusion 'layernorm_fwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T2 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T3 = fd.ops.cast(T0, dtype=DataType.Float)
//     S4 = fd.ops.size(T3, dim=1)
//     T5 = fd.ops.sum(T3, dims=[1], keepdim=False, dtype=DataType.Float)
//     T6 = fd.ops.div(T5, S4)
//     S7 = fd.ops.size(T3, dim=0)
//     S8 = fd.ops.size(T3, dim=1)
//     T9 = fd.ops.broadcast_in_dim(T6, shape=[S7, S8], broadcast_dims=[0])
//     T10 = fd.ops.sub(T3, T9)
//     T11 = fd.ops.mul(T10, T10)
//     S12 = fd.define_scalar(0, dtype=DataType.Int64)
//     S13 = fd.ops.sub(S4, S12)
//     S14 = fd.define_scalar(0, dtype=DataType.Int64)
//     S15 = fd.ops.maximum(S13, S14)
//     T16 = fd.ops.sum(T11, dims=[1], keepdim=False, dtype=DataType.Float)
//     T17 = fd.ops.div(T16, S15)
//     S18 = fd.ops.size(T3, dim=0)
//     T19 = fd.ops.broadcast_in_dim(T17, shape=[S18, 1], broadcast_dims=[0])
//     T20 = fd.ops.broadcast_in_dim(T6, shape=[S18, 1], broadcast_dims=[0])
//     S21 = fd.define_scalar(1e-05, dtype=DataType.Double)
//     T22 = fd.ops.add(T19, S21)
//     T23 = fd.ops.rsqrt(T22)
//     S24 = fd.ops.size(T0, dim=0)
//     S25 = fd.ops.size(T0, dim=1)
//     T26 = fd.ops.broadcast_in_dim(T20, shape=[S24, S25], broadcast_dims=[0, 1])
//     T27 = fd.ops.sub(T3, T26)
//     S28 = fd.ops.size(T0, dim=0)
//     S29 = fd.ops.size(T0, dim=1)
//     T30 = fd.ops.broadcast_in_dim(T23, shape=[S28, S29], broadcast_dims=[0, 1])
//     T31 = fd.ops.mul(T27, T30)
//     T32 = fd.ops.cast(T1, dtype=DataType.Float)
//     T33 = fd.ops.mul(T31, T32)
//     T34 = fd.ops.cast(T2, dtype=DataType.Float)
//     T35 = fd.ops.add(T33, T34)
//     T36 = fd.ops.cast(T35, dtype=DataType.BFloat16)
//     fd.add_output(T36)
//     fd.add_output(T20)
//     fd.add_output(T23)
//
// kind:              inner reduction
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     T1:BFloat16, T2:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16
// inner level 0:     sum(T3)->T5
// inner level 1:     sum(T11)->T16
// outputs:           T36:full, T20:row, T23:row
//
// RowSchedule
//   scheduler          inner_persistent
//   reason             registers-first policy: T0 in smem, T1,T2 re-read each pass, skewed rows (8-element vectors from
//       the boundary below each row's start, which lies on a multiple of 2), sum(T3) -> T5 and sum((T3 - mean)^2) ->
//       T16 in one pass, shifted by the mean of the row's first elements, ~48 regs/thread, ~2 block(s)/SM
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
//   placements         T0:BFloat16->smem(cp.async), T1:BFloat16->global, T2:BFloat16->global
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      2
//   dealing            strided
//   shifted_variance   True
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         49168       0    49280  row buffer T0 (BFloat16), 1 stage(s) x 1 row(s) x 24584
// s_reduce       256   49280      256  inner-reduction scratch: 2 parities x 2 x 1 row(s) x 16 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 49664 B = dynamic 49536 + static 128; limit 232448 B; headroom 182784 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a persistent grid, each block taking every grid-th row group.
// Thread x of a row owns vectors x, x + 512, ... (7 of them, 8 element(s) each) of the row.
// Inputs: T0 in smem; T1, T2 in global.
// Rows are skewed: 8 does not divide 24578, so a row's vectors start at the 8-element boundary at or below its start,
// and its first and last vectors are masked to the row's elements.
extern "C" __global__ void __launch_bounds__(512, 2)
layernorm_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    const __nv_bfloat16* __restrict__ g_T2,
    __nv_bfloat16* __restrict__ g_T36,
    float* __restrict__ g_T20,
    float* __restrict__ g_T23,
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
  // inner-reduction scratch: 2 parities x 2 x 1 row(s) x 16 warps x 4 B
  unsigned char* const s_reduce = smem + 49280;
  const long long S4 = static_cast<long long>(H);
  const long long S12 = 0LL;
  const long long S14 = 0LL;
  const double S21 = 1e-05;
  const long long S13 = (S4 - S12);
  const long long S15 = fm::max(S13, S14);

  fm::ColumnInGlobal<__nv_bfloat16, Part> T1(g_T1);
  fm::ColumnInGlobal<__nv_bfloat16, Part> T2(g_T2);
  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 2> reduce(s_reduce, nullptr);
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
    // the shift of the row's variance sums, from its first elements (copies in flight)
    const float shift_T5 = fm::row_shift(part, g_T0, row * H, valid);
    fm::cp_async_wait<0>();
    T0.ready(part, slot, row);

    // Inner reduction levels 0 and 1, one pass: sum(T3) -> T5, sum((T3 - mean)^2) -> T16.
    float row_T5 = fm::Sum::identity<float>();
    float row_T16 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T3 = fm::element(x_T0, i);
        if (fm::in_row<Part>(v, i)) row_T5 = fm::Sum{}(row_T5, e_T3);
        if (fm::in_row<Part>(v, i)) row_T16 = fm::Sum{}(row_T16, (e_T3 - shift_T5) * (e_T3 - shift_T5));
      }
    });
    reduce(part, fm::reduced(row_T5, fm::Sum{}), fm::reduced(row_T16, fm::Sum{}));
    const float row_T6 = (row_T5 / static_cast<float>(S4));
    const float dev_T5 = fmaf(-shift_T5, static_cast<float>(S4), row_T5);  // sum(T3 - shift_T5)
    row_T16 -= dev_T5 * (dev_T5 / static_cast<float>(S4));  // sum((T3 - mean)^2)
    if (row_T16 < 0.0f) row_T16 = 0.0f;  // rounded below 0 (a NaN stays NaN)
    const float row_T17 = (row_T16 / static_cast<float>(S15));
    const float row_T22 = (row_T17 + static_cast<float>(S21));
    const float row_T23 = fm::rsqrt(row_T22);

    // Outputs of the row.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto c_T1 = T1.at(v);
      const auto c_T2 = T2.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T36;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T3 = fm::element(x_T0, i);
        const float e_T27 = (e_T3 - row_T6);
        const float e_T31 = (e_T27 * row_T23);
        const float e_T32 = fm::element(c_T1, i);
        const float e_T33 = (e_T31 * e_T32);
        const float e_T34 = fm::element(c_T2, i);
        const float e_T35 = (e_T33 + e_T34);
        o_T36.v[i] = fm::to_storage<__nv_bfloat16>(e_T35);
      }
      if (valid) fm::store_visit<Part, true>(g_T36 + row * H, v, o_T36);
    });
    if (valid && part.writes_row_values()) g_T20[row] = fm::to_storage<float>(row_T6);
    if (valid && part.writes_row_values()) g_T23[row] = fm::to_storage<float>(row_T23);
  }
}
