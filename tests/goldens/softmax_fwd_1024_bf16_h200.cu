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
//   reason             registers-first policy: T0 in smem, exp T7 kept in registers for the pass that needs it again,
//       ~80 regs/thread, ~3 block(s)/SM
//   hidden             1024
//   vec                8
//   skew               0
//   threads_per_row    32
//   rows_per_block     8
//   cluster            1
//   batch              4
//   unroll             4
//   full_unroll        True
//   kept               ('T7',)
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async)
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      80
//   blocks_per_sm      3
//   dealing            grid
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         16384       0    16384  row buffer T0 (BFloat16), 1 stage(s) x 8 row(s) x 1024
// static slot    128  static      128  static __shared__ (magic zero)
// total 16512 B = dynamic 16384 + static 128; limit 232448 B; headroom 215936 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 8 row(s) at a time; a block per row group.
// Thread x of a row owns vectors x, x + 32, ... (4 of them, 8 element(s) each) of the row.
// Inputs: T0 in smem.
extern "C" __global__ void __launch_bounds__(256, 3)
softmax_fwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    __nv_bfloat16* __restrict__ g_T13,
    long long n_rows)
{
  constexpr int H = 1024;  // elements per row
  constexpr int RPB = 8;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 8, 32, RPB, 4, 4, 1, 0>;
  const Part part;
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // row buffer T0 (BFloat16), 1 stage(s) x 8 row(s) x 1024
  unsigned char* const s_T0 = smem;

  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(nullptr, nullptr);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 2048> T0(s_T0, g_T0);

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
    float kept_T7[Part::BATCH][Part::VEC];  // exp T7, computed once per element

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
        kept_T7[v.b][i] = e_T7;
        if (fm::in_row<Part>(v, i)) row_T8 = fm::Sum{}(row_T8, e_T7);
      }
    });
    reduce(part, fm::reduced(row_T8, fm::Sum{}));
    const float row_rcp_T8 = float(1) / row_T8;

    // Outputs of the row.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      fm::Vec<__nv_bfloat16, Part::VEC> o_T13;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T12 = (kept_T7[v.b][i] * row_rcp_T8);
        o_T13.v[i] = fm::to_storage<__nv_bfloat16>(e_T12);
      }
      if (valid) fm::store_visit<Part, true>(g_T13 + row * H, v, o_T13);
    });
  }
}
