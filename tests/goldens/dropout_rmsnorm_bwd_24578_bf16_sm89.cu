// fuser kernel module for fusion 'dropout_rmsnorm_bwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T2 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Bool)
//     T3 = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=DataType.Float)
//     T4 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T5 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     S6 = fd.define_scalar(1.1111111111111112, dtype=DataType.Double)
//     T7 = fd.ops.cast(T2, dtype=DataType.Float)
//     T8 = fd.ops.cast(T1, dtype=DataType.Float)
//     T9 = fd.ops.cast(T0, dtype=DataType.Float)
//     T10 = fd.ops.mul(T7, T9)
//     T11 = fd.ops.mul(T10, S6)
//     T12 = fd.ops.add(T8, T11)
//     S13 = fd.ops.size(T0, dim=0)
//     S14 = fd.ops.size(T0, dim=1)
//     T15 = fd.ops.broadcast_in_dim(T3, shape=[S13, S14], broadcast_dims=[0, 1])
//     T16 = fd.ops.reciprocal(T15)
//     T17 = fd.ops.cast(T4, dtype=DataType.Float)
//     T18 = fd.ops.cast(T5, dtype=DataType.Float)
//     T19 = fd.ops.mul(T17, T18)
//     T20 = fd.ops.mul(T12, T16)
//     T21 = fd.ops.mul(T19, T20)
//     T22 = fd.ops.sum(T21, dims=[1], keepdim=True, dtype=DataType.Float)
//     S23 = fd.ops.size(T0, dim=1)
//     T24 = fd.ops.div(T22, S23)
//     S25 = fd.ops.size(T0, dim=0)
//     S26 = fd.ops.size(T0, dim=1)
//     T27 = fd.ops.broadcast_in_dim(T24, shape=[S25, S26], broadcast_dims=[0, 1])
//     T28 = fd.ops.mul(T20, T27)
//     T29 = fd.ops.sub(T19, T28)
//     T30 = fd.ops.mul(T29, T16)
//     T31 = fd.ops.cast(T4, dtype=DataType.Float)
//     T32 = fd.ops.mul(T31, T20)
//     T33 = fd.ops.sum(T32, dims=[0], keepdim=False, dtype=DataType.Float)
//     T34 = fd.ops.mul(T30, T7)
//     T35 = fd.ops.mul(T34, S6)
//     T36 = fd.ops.cast(T35, dtype=DataType.BFloat16)
//     T37 = fd.ops.cast(T30, dtype=DataType.BFloat16)
//     T38 = fd.ops.cast(T33, dtype=DataType.BFloat16)
//     fd.add_output(T36)
//     fd.add_output(T37)
//     fd.add_output(T38)
//
// kind:              inner + outer reduction
// full inputs:       T0:BFloat16, T1:BFloat16, T2:Bool, T4:BFloat16
// row inputs:        T3:Float
// column inputs:     T5:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16, T1:BFloat16, T2:Bool, T4:BFloat16
// inner level 0:     sum(T21)->T22
// outer reductions:  sum(T32)->T33
// outputs:           T36:full, T37:full, T38:col
//
// RowSchedule
//   scheduler          inner_outer_persistent
//   reason             smem-first policy: T1, T4 in smem, T0 re-read each pass, ~124 regs/thread, ~1 block(s)/SM (1
//       block(s) cannot keep the row on chip)
//   hidden             24578
//   vec                2
//   skew               0
//   threads_per_row    512
//   rows_per_block     1
//   cluster            1
//   batch              25
//   unroll             25
//   full_unroll        True
//   kept               ()
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->global, T1:BFloat16->smem(cp.async), T2:Bool->registers,
//       T4:BFloat16->smem(cp.async), T5:BFloat16->registers
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      124
//   blocks_per_sm      1
//   dealing            strided
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T1         49156       0    49280  row buffer T1 (BFloat16), 1 stage(s) x 1 row(s) x 24578
// s_T4         49156   49280    49280  row buffer T4 (BFloat16), 1 stage(s) x 1 row(s) x 24578
// s_reduce       128   98560      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 98816 B = dynamic 98688 + static 128; limit 101376 B; headroom 2560 B; alignment 128 B
//
// FinalizeSchedule
//   reason             a kernel of its own (the row kernel cannot finalize: with the lanes' sums its shared memory
//       (98816 -> 102912 B a block) leaves room for 0 of its 1 blocks per SM): 32 columns x 16 lane(s) a block, the
//       widest tile that gives every SM two blocks
//   hidden             24578
//   cols_per_block     32
//   partial_lanes      16
//   unroll             16
//   fused              False
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes_T33   4096       0     4096  the lanes' sums of T33: 16 lane(s) x 32 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 4224 B = dynamic 4096 + static 128; limit 101376 B; headroom 97152 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a persistent grid, each block taking every grid-th row group.
// Thread x of a row owns vectors x, x + 512, ... (25 of them, 2 element(s) each) of the row.
// Inputs: T2, T5 in registers; T1, T4 in smem; T0 in global.
extern "C" __global__ void __launch_bounds__(512, 1)
dropout_rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    const bool* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T4,
    const __nv_bfloat16* __restrict__ g_T5,
    const float* __restrict__ g_T3,
    __nv_bfloat16* __restrict__ g_T36,
    __nv_bfloat16* __restrict__ g_T37,
    float* __restrict__ g_part_T33,
    long long n_rows)
{
  constexpr int H = 24578;  // elements per row
  constexpr int RPB = 1;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 2, 512, RPB, 25, 25, 1, 0>;
  const Part part;
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // row buffer T1 (BFloat16), 1 stage(s) x 1 row(s) x 24578
  unsigned char* const s_T1 = smem;
  // row buffer T4 (BFloat16), 1 stage(s) x 1 row(s) x 24578
  unsigned char* const s_T4 = smem + 49280;
  // inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
  unsigned char* const s_reduce = smem + 98560;
  const double S6 = 1.1111111111111112;
  const long long S23 = static_cast<long long>(H);

  fm::ColumnInRegisters<__nv_bfloat16, Part> T5(part, g_T5);
  // column reduction sum(T32) -> T33, in registers
  fm::AccumulatorInRegisters<float, fm::Sum, Part> acc_T33(part, g_part_T33, nullptr);
  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(s_reduce, nullptr);
  fm::RowInGlobal<__nv_bfloat16, Part> T0(g_T0);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 49156> T1(s_T1, g_T1);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 49156> T4(s_T4, g_T4);

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // 0: rows start on vector boundaries
    const int slot = part.ty;
    T1.copy(part, slot, row, n_rows);
    T4.copy(part, slot, row, n_rows);
    fm::cp_async_commit();
    const fm::RowInRegisters<bool, Part> T2(part, g_T2, row, valid);
    const float row_T3 = fm::row_value<float>(g_T3, row, valid);
    fm::cp_async_wait<0>();
    T1.ready(part, slot, row);
    T4.ready(part, slot, row);
    T0.ready(row, valid);
    const float row_T16 = fm::reciprocal(row_T3);

    // Inner reduction level 0: sum(T21) -> T22.
    float row_T22 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T1 = T1.at(v);
      const auto x_T2 = T2.at(v);
      const auto x_T4 = T4.at(v);
      const auto c_T5 = T5.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T7 = static_cast<float>(fm::element(x_T2, i));
        const float e_T8 = fm::element(x_T1, i);
        const float e_T9 = fm::element(x_T0, i);
        const float e_T10 = (e_T7 * e_T9);
        const float e_T11 = (e_T10 * static_cast<float>(S6));
        const float e_T12 = (e_T8 + e_T11);
        const float e_T17 = fm::element(x_T4, i);
        const float e_T18 = fm::element(c_T5, i);
        const float e_T19 = (e_T17 * e_T18);
        const float e_T20 = (e_T12 * row_T16);
        const float e_T21 = (e_T19 * e_T20);
        if (fm::in_row<Part>(v, i)) row_T22 = fm::Sum{}(row_T22, e_T21);
      }
    });
    reduce(part, fm::reduced(row_T22, fm::Sum{}));
    const float row_T24 = (row_T22 / static_cast<float>(S23));

    // Outputs of the row and the column accumulators.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T1 = T1.at(v);
      const auto x_T2 = T2.at(v);
      const auto x_T4 = T4.at(v);
      const auto c_T5 = T5.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T36;
      fm::Vec<__nv_bfloat16, Part::VEC> o_T37;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T7 = static_cast<float>(fm::element(x_T2, i));
        const float e_T8 = fm::element(x_T1, i);
        const float e_T9 = fm::element(x_T0, i);
        const float e_T10 = (e_T7 * e_T9);
        const float e_T11 = (e_T10 * static_cast<float>(S6));
        const float e_T12 = (e_T8 + e_T11);
        const float e_T17 = fm::element(x_T4, i);
        const float e_T18 = fm::element(c_T5, i);
        const float e_T19 = (e_T17 * e_T18);
        const float e_T20 = (e_T12 * row_T16);
        const float e_T28 = (e_T20 * row_T24);
        const float e_T29 = (e_T19 - e_T28);
        const float e_T30 = (e_T29 * row_T16);
        const float e_T31 = fm::element(x_T4, i);
        const float e_T32 = (e_T31 * e_T20);
        const float e_T34 = (e_T30 * e_T7);
        const float e_T35 = (e_T34 * static_cast<float>(S6));
        o_T36.v[i] = fm::to_storage<__nv_bfloat16>(e_T35);
        o_T37.v[i] = fm::to_storage<__nv_bfloat16>(e_T30);
        if (valid) acc_T33.add(v, i, e_T32);
      }
      if (valid) fm::store_visit<Part, false>(g_T36 + row * H, v, o_T36);
      if (valid) fm::store_visit<Part, false>(g_T37 + row * H, v, o_T37);
    });
  }
  acc_T33.finish(part);  // this block's partial row of T33
}

// Column finalize: sums the [partial_rows, H] partials of each outer reduction per column, in a
// fixed order (lanes stride the partial rows, then lane 0 adds the lanes up), then writes the
// column outputs. No atomics: the result is the same from run to run.
extern "C" __global__ void __launch_bounds__(512)
dropout_rmsnorm_bwd_finalize(
    const float* __restrict__ g_part_T33,
    const __nv_bfloat16* __restrict__ g_T5,
    __nv_bfloat16* __restrict__ g_T38,
    long long n_rows,
    int partial_rows)
{
  constexpr int H = 24578;
  constexpr int COLS = 32;
  constexpr int LANES = 16;
  const int lane = threadIdx.y;
  const int col = blockIdx.x * COLS + threadIdx.x;
  fm::wait_for_prior_grid();  // the row kernel's partial rows are complete past this point
  extern __shared__ __align__(128) unsigned char smem[];
  // the lanes' sums of T33: 16 lane(s) x 32 columns (double)
  double* const s_lanes_T33 = reinterpret_cast<double*>(smem);
  double total_T33 = fm::Sum::identity<double>();
  if (col < H) {
    int p = lane;
    constexpr int UNROLL = 16;
    // whole rounds of UNROLL partial rows: loaded first, their loads in flight together, then
    // added in row order
    for (; p + (UNROLL - 1) * LANES < partial_rows; p += UNROLL * LANES) {
      float rows_T33[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const long long at = (static_cast<long long>(p) + u * LANES) * H + col;
        rows_T33[u] = g_part_T33[at];
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        total_T33 = fm::Sum{}(total_T33, static_cast<double>(rows_T33[u]));
      }
    }
    #pragma unroll 1
    for (; p < partial_rows; p += LANES) {  // the rows left, one at a time, in order
      const long long at = static_cast<long long>(p) * H + col;
      total_T33 = fm::Sum{}(total_T33, static_cast<double>(g_part_T33[at]));
    }
  }
  s_lanes_T33[lane * COLS + threadIdx.x] = total_T33;
  __syncthreads();
  if (lane == 0 && col < H) {
    for (int l = 1; l < LANES; ++l) {
      const double lane_total = s_lanes_T33[l * COLS + threadIdx.x];
      total_T33 = fm::Sum{}(total_T33, lane_total);
    }
    const float tot_T33 = static_cast<float>(total_T33);
    g_T38[col] = fm::to_storage<__nv_bfloat16>(tot_T33);
  }
}
