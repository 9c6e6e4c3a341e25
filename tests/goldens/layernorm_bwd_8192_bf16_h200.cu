// fuser kernel module for fusion 'layernorm_bwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=DataType.Float)
//     T2 = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=DataType.Float)
//     T3 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T4 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T5 = fd.ops.cast(T3, dtype=DataType.Float)
//     T6 = fd.ops.cast(T0, dtype=DataType.Float)
//     S7 = fd.ops.size(T0, dim=0)
//     S8 = fd.ops.size(T0, dim=1)
//     T9 = fd.ops.broadcast_in_dim(T1, shape=[S7, S8], broadcast_dims=[0, 1])
//     T10 = fd.ops.sub(T6, T9)
//     S11 = fd.ops.size(T0, dim=0)
//     S12 = fd.ops.size(T0, dim=1)
//     T13 = fd.ops.broadcast_in_dim(T2, shape=[S11, S12], broadcast_dims=[0, 1])
//     T14 = fd.ops.mul(T10, T13)
//     T15 = fd.ops.cast(T4, dtype=DataType.Float)
//     T16 = fd.ops.mul(T5, T15)
//     S17 = fd.ops.size(T0, dim=1)
//     T18 = fd.ops.mul(T16, T14)
//     T19 = fd.ops.sum(T18, dims=[1], keepdim=True, dtype=DataType.Float)
//     T20 = fd.ops.div(T19, S17)
//     T21 = fd.ops.sum(T16, dims=[1], keepdim=True, dtype=DataType.Float)
//     T22 = fd.ops.div(T21, S17)
//     S23 = fd.ops.size(T0, dim=0)
//     S24 = fd.ops.size(T0, dim=1)
//     T25 = fd.ops.broadcast_in_dim(T20, shape=[S23, S24], broadcast_dims=[0, 1])
//     T26 = fd.ops.mul(T14, T25)
//     T27 = fd.ops.sub(T16, T26)
//     S28 = fd.ops.size(T0, dim=0)
//     S29 = fd.ops.size(T0, dim=1)
//     T30 = fd.ops.broadcast_in_dim(T22, shape=[S28, S29], broadcast_dims=[0, 1])
//     T31 = fd.ops.sub(T27, T30)
//     S32 = fd.ops.size(T0, dim=0)
//     S33 = fd.ops.size(T0, dim=1)
//     T34 = fd.ops.broadcast_in_dim(T2, shape=[S32, S33], broadcast_dims=[0, 1])
//     T35 = fd.ops.mul(T31, T34)
//     T36 = fd.ops.cast(T35, dtype=DataType.BFloat16)
//     T37 = fd.ops.mul(T5, T14)
//     T38 = fd.ops.sum(T37, dims=[0], keepdim=False, dtype=DataType.Float)
//     T39 = fd.ops.cast(T38, dtype=DataType.BFloat16)
//     T40 = fd.ops.sum(T5, dims=[0], keepdim=False, dtype=DataType.Float)
//     T41 = fd.ops.cast(T40, dtype=DataType.BFloat16)
//     fd.add_output(T36)
//     fd.add_output(T39)
//     fd.add_output(T41)
//
// kind:              inner + outer reduction
// full inputs:       T0:BFloat16, T3:BFloat16
// row inputs:        T1:Float, T2:Float
// column inputs:     T4:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16, T3:BFloat16
// inner level 0:     sum(T18)->T19, sum(T16)->T21
// outer reductions:  sum(T37)->T38, sum(T5)->T40
// outputs:           T36:full, T39:col, T41:col
//
// RowSchedule
//   scheduler          inner_outer_persistent
//   reason             smem-first policy: T0, T3, T4 in smem (2 stages), rows split over a cluster of 2 blocks of 4096
//       elements, ~176 regs/thread, ~1 block(s)/SM (packed rows over a cluster of 2 first: 128 registers of column sums
//       a thread, every buffer in shared memory)
//   hidden             8192
//   vec                8
//   skew               0
//   threads_per_row    64
//   rows_per_block     4
//   cluster            2
//   batch              8
//   unroll             8
//   full_unroll        True
//   kept               ()
//   stages             2
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T3:BFloat16->smem(cp.async), T4:BFloat16->smem
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      176
//   blocks_per_sm      1
//   dealing            strided
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         65536       0    65536  row buffer T0 (BFloat16), 2 stage(s) x 4 row(s) x 4096
// s_T3         65536   65536    65536  row buffer T3 (BFloat16), 2 stage(s) x 4 row(s) x 4096
// s_T4          8192  131072     8192  column buffer T4 (BFloat16) x 4096
// s_reduce       128  139264      128  inner-reduction scratch: 2 parities x 2 x 4 row(s) x 2 warps x 4 B
// s_outer_T38  16384  139392    16384  column accumulator T38: 4 rows combined
// s_outer_T40  16384  155776    16384  column accumulator T40: 4 rows combined
// s_cluster      144  172160      256  cluster exchange: 2 parities x (an mbarrier + 2 ranks x 2 x 4 row(s) x 4 B),
//     sent by the blocks of the cluster
// static slot    128  static      128  static __shared__ (magic zero)
// total 172544 B = dynamic 172416 + static 128; limit 232448 B; headroom 59904 B; alignment 128 B
//
// FinalizeSchedule
//   reason             a kernel of its own (the row kernel cannot finalize: its rows are split over clusters of 2
//       blocks): 16 columns x 32 lane(s) a block, the widest tile that gives every SM two blocks
//   hidden             8192
//   cols_per_block     16
//   partial_lanes      32
//   unroll             16
//   fused              False
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes_T38   4096       0     4096  the lanes' sums of T38: 32 lane(s) x 16 columns (double)
// s_lanes_T40   4096    4096     4096  the lanes' sums of T40: 32 lane(s) x 16 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 8320 B = dynamic 8192 + static 128; limit 232448 B; headroom 224128 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 4 row(s) at a time; a persistent grid, each block taking every grid-th row group.
// Thread x of a row owns vectors x, x + 64, ... (8 of them, 8 element(s) each) of its block's part of the row (2 blocks
// of a cluster share each row).
// Inputs: T0, T3, T4 in smem.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256, 1)
layernorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T3,
    const __nv_bfloat16* __restrict__ g_T4,
    const float* __restrict__ g_T1,
    const float* __restrict__ g_T2,
    __nv_bfloat16* __restrict__ g_T36,
    float* __restrict__ g_part_T38,
    float* __restrict__ g_part_T40,
    long long n_rows)
{
  constexpr int H = 8192;  // elements per row
  constexpr int RPB = 4;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 8, 64, RPB, 8, 8, 2, 0>;
  const Part part;
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // row buffer T0 (BFloat16), 2 stage(s) x 4 row(s) x 4096
  unsigned char* const s_T0 = smem;
  // row buffer T3 (BFloat16), 2 stage(s) x 4 row(s) x 4096
  unsigned char* const s_T3 = smem + 65536;
  // column buffer T4 (BFloat16) x 4096
  unsigned char* const s_T4 = smem + 131072;
  // inner-reduction scratch: 2 parities x 2 x 4 row(s) x 2 warps x 4 B
  unsigned char* const s_reduce = smem + 139264;
  // column accumulator T38: 4 rows combined
  unsigned char* const s_outer_T38 = smem + 139392;
  // column accumulator T40: 4 rows combined
  unsigned char* const s_outer_T40 = smem + 155776;
  // cluster exchange: 2 parities x (an mbarrier + 2 ranks x 2 x 4 row(s) x 4 B), sent by the blocks of the cluster
  unsigned char* const s_cluster = smem + 172160;
  const long long S17 = static_cast<long long>(H);

  fm::ColumnInSmem<__nv_bfloat16, Part> T4(part, s_T4, g_T4);
  // column reduction sum(T37) -> T38, in registers
  fm::AccumulatorInRegisters<float, fm::Sum, Part> acc_T38(part, g_part_T38, s_outer_T38);
  // column reduction sum(T5) -> T40, in registers
  fm::AccumulatorInRegisters<float, fm::Sum, Part> acc_T40(part, g_part_T40, s_outer_T40);
  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 2> reduce(s_reduce, s_cluster);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 8192> T0(s_T0, g_T0);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 8192> T3(s_T3, g_T3);
  __syncthreads();  // the column buffers are shared by the block's rows

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  // 2 stages: this block's first row starts loading now, a row more each time one computes.
  T0.copy(part, part.ty, row0 + part.ty, n_rows);
  T3.copy(part, part.ty, row0 + part.ty, n_rows);
  fm::cp_async_commit();
  float ahead0_T1 = fm::row_value<float>(g_T1, row0 + part.ty, row0 + part.ty < n_rows);
  float ahead0_T2 = fm::row_value<float>(g_T2, row0 + part.ty, row0 + part.ty < n_rows);
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // 0: rows start on vector boundaries
    const int slot = (it % 2) * RPB + part.ty;  // this row's slot
    const long long next = row + row_stride;
    T0.copy(part, ((it + 1) % 2) * RPB + part.ty, next, n_rows);
    T3.copy(part, ((it + 1) % 2) * RPB + part.ty, next, n_rows);
    fm::cp_async_commit();
    const float row_T1 = ahead0_T1;
    ahead0_T1 = fm::row_value<float>(g_T1, next, next < n_rows);
    const float row_T2 = ahead0_T2;
    ahead0_T2 = fm::row_value<float>(g_T2, next, next < n_rows);
    fm::cp_async_wait<1>();
    T0.ready(part, slot, row);
    T3.ready(part, slot, row);

    // Inner reduction level 0: sum(T18) -> T19, sum(T16) -> T21.
    float row_T19 = fm::Sum::identity<float>();
    float row_T21 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T3 = T3.at(v);
      const auto c_T4 = T4.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T5 = fm::element(x_T3, i);
        const float e_T6 = fm::element(x_T0, i);
        const float e_T10 = (e_T6 - row_T1);
        const float e_T14 = (e_T10 * row_T2);
        const float e_T15 = fm::element(c_T4, i);
        const float e_T16 = (e_T5 * e_T15);
        const float e_T18 = (e_T16 * e_T14);
        if (fm::in_row<Part>(v, i)) row_T19 = fm::Sum{}(row_T19, e_T18);
        if (fm::in_row<Part>(v, i)) row_T21 = fm::Sum{}(row_T21, e_T16);
      }
    });
    reduce(part, fm::reduced(row_T19, fm::Sum{}), fm::reduced(row_T21, fm::Sum{}));
    const float row_T20 = (row_T19 / static_cast<float>(S17));
    const float row_T22 = (row_T21 / static_cast<float>(S17));

    // Outputs of the row and the column accumulators.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T3 = T3.at(v);
      const auto c_T4 = T4.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T36;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T5 = fm::element(x_T3, i);
        const float e_T6 = fm::element(x_T0, i);
        const float e_T10 = (e_T6 - row_T1);
        const float e_T14 = (e_T10 * row_T2);
        const float e_T15 = fm::element(c_T4, i);
        const float e_T16 = (e_T5 * e_T15);
        const float e_T26 = (e_T14 * row_T20);
        const float e_T27 = (e_T16 - e_T26);
        const float e_T31 = (e_T27 - row_T22);
        const float e_T35 = (e_T31 * row_T2);
        const float e_T37 = (e_T5 * e_T14);
        o_T36.v[i] = fm::to_storage<__nv_bfloat16>(e_T35);
        if (valid) acc_T38.add(v, i, e_T37);
        if (valid) acc_T40.add(v, i, e_T5);
      }
      if (valid) fm::store_visit<Part, true>(g_T36 + row * H, v, o_T36);
    });
  }
  acc_T38.finish(part);  // this block's partial row of T38
  acc_T40.finish(part);  // this block's partial row of T40
  fm::cluster_arrive_and_wait();  // no block leaves while a peer may still store to it
}

// Column finalize: sums the [partial_rows, H] partials of each outer reduction per column, in a
// fixed order (lanes stride the partial rows, then lane 0 adds the lanes up), then writes the
// column outputs. No atomics: the result is the same from run to run.
extern "C" __global__ void __launch_bounds__(512)
layernorm_bwd_finalize(
    const float* __restrict__ g_part_T38,
    const float* __restrict__ g_part_T40,
    const __nv_bfloat16* __restrict__ g_T4,
    __nv_bfloat16* __restrict__ g_T39,
    __nv_bfloat16* __restrict__ g_T41,
    long long n_rows,
    int partial_rows)
{
  constexpr int H = 8192;
  constexpr int COLS = 16;
  constexpr int LANES = 32;
  const int lane = threadIdx.y;
  const int col = blockIdx.x * COLS + threadIdx.x;
  fm::wait_for_prior_grid();  // the row kernel's partial rows are complete past this point
  extern __shared__ __align__(128) unsigned char smem[];
  // the lanes' sums of T38: 32 lane(s) x 16 columns (double)
  double* const s_lanes_T38 = reinterpret_cast<double*>(smem);
  // the lanes' sums of T40: 32 lane(s) x 16 columns (double)
  double* const s_lanes_T40 = reinterpret_cast<double*>(smem + 4096);
  double total_T38 = fm::Sum::identity<double>();
  double total_T40 = fm::Sum::identity<double>();
  if (col < H) {
    int p = lane;
    constexpr int UNROLL = 16;
    // whole rounds of UNROLL partial rows: loaded first, their loads in flight together, then
    // added in row order
    for (; p + (UNROLL - 1) * LANES < partial_rows; p += UNROLL * LANES) {
      float rows_T38[UNROLL];
      float rows_T40[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const long long at = (static_cast<long long>(p) + u * LANES) * H + col;
        rows_T38[u] = g_part_T38[at];
        rows_T40[u] = g_part_T40[at];
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        total_T38 = fm::Sum{}(total_T38, static_cast<double>(rows_T38[u]));
        total_T40 = fm::Sum{}(total_T40, static_cast<double>(rows_T40[u]));
      }
    }
    #pragma unroll 1
    for (; p < partial_rows; p += LANES) {  // the rows left, one at a time, in order
      const long long at = static_cast<long long>(p) * H + col;
      total_T38 = fm::Sum{}(total_T38, static_cast<double>(g_part_T38[at]));
      total_T40 = fm::Sum{}(total_T40, static_cast<double>(g_part_T40[at]));
    }
  }
  s_lanes_T38[lane * COLS + threadIdx.x] = total_T38;
  s_lanes_T40[lane * COLS + threadIdx.x] = total_T40;
  __syncthreads();
  if (lane == 0 && col < H) {
    for (int l = 1; l < LANES; ++l) {
      const double lane_total = s_lanes_T38[l * COLS + threadIdx.x];
      total_T38 = fm::Sum{}(total_T38, lane_total);
    }
    const float tot_T38 = static_cast<float>(total_T38);
    for (int l = 1; l < LANES; ++l) {
      const double lane_total = s_lanes_T40[l * COLS + threadIdx.x];
      total_T40 = fm::Sum{}(total_T40, lane_total);
    }
    const float tot_T40 = static_cast<float>(total_T40);
    g_T39[col] = fm::to_storage<__nv_bfloat16>(tot_T38);
    g_T41[col] = fm::to_storage<__nv_bfloat16>(tot_T40);
  }
}
