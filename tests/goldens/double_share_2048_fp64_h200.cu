// fuser kernel module for fusion 'double_share' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
//     T1 = fd.ops.sum(T0, dims=[1], keepdim=True, dtype=DataType.Double)
//     S2 = fd.ops.size(T0, dim=0)
//     S3 = fd.ops.size(T0, dim=1)
//     T4 = fd.ops.broadcast_in_dim(T1, shape=[S2, S3], broadcast_dims=[0, 1])
//     T5 = fd.ops.div(T0, T4)
//     fd.add_output(T5)
//     fd.add_output(T1)
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
//   skew               0
//   threads_per_row    256
//   rows_per_block     1
//   cluster            1
//   batch              4
//   unroll             4
//   full_unroll        True
//   kept               ()
//   stages             1
//   aligned_copy       False
//   placements         T0:Double->registers
//   accumulators       registers
//   reduction_bytes    8
//   regs_estimate      52
//   blocks_per_sm      4
//   dealing            grid
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_reduce       128       0      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 8 warps x 8 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 256 B = dynamic 128 + static 128; limit 232448 B; headroom 232192 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a block per row group.
// Thread x of a row owns vectors x, x + 256, ... (4 of them, 2 element(s) each) of the row.
// Inputs: T0 in registers.
extern "C" __global__ void __launch_bounds__(256, 4)
double_share_row(
    const double* __restrict__ g_T0,
    double* __restrict__ g_T5,
    double* __restrict__ g_T1,
    long long n_rows)
{
  constexpr int H = 2048;  // elements per row
  constexpr int RPB = 1;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 2, 256, RPB, 4, 4, 1, 0>;
  const Part part;
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // inner-reduction scratch: 2 parities x 1 x 1 row(s) x 8 warps x 8 B
  unsigned char* const s_reduce = smem;

  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<double, Part, 1> reduce(s_reduce, nullptr);

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // 0: rows start on vector boundaries
    const fm::RowInRegisters<double, Part> T0(part, g_T0, row, valid);

    // Inner reduction level 0: sum(T0) -> T1.
    double row_T1 = fm::Sum::identity<double>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        if (fm::in_row<Part>(v, i)) row_T1 = fm::Sum{}(row_T1, fm::element(x_T0, i));
      }
    });
    reduce(part, fm::reduced(row_T1, fm::Sum{}));
    const double row_rcp_d_T1 = double(1) / row_T1;

    // Outputs of the row.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      fm::Vec<double, Part::VEC> o_T5;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const double e_T5 = (fm::element(x_T0, i) * row_rcp_d_T1);
        o_T5.v[i] = fm::to_storage<double>(e_T5);
      }
      if (valid) fm::store_visit<Part, false>(g_T5 + row * H, v, o_T5);
    });
    if (valid && part.writes_row_values()) g_T1[row] = fm::to_storage<double>(row_T1);
  }
}
