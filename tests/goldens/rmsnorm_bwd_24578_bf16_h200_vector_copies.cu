// fuser kernel module for fusion 'rmsnorm_bwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1, 1], contiguity=[True, None], dtype=DataType.Float)
//     T2 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T3 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T4 = fd.ops.cast(T0, dtype=DataType.Float)
//     S5 = fd.ops.size(T0, dim=0)
//     S6 = fd.ops.size(T0, dim=1)
//     T7 = fd.ops.broadcast_in_dim(T1, shape=[S5, S6], broadcast_dims=[0, 1])
//     T8 = fd.ops.reciprocal(T7)
//     T9 = fd.ops.cast(T2, dtype=DataType.Float)
//     T10 = fd.ops.cast(T3, dtype=DataType.Float)
//     T11 = fd.ops.mul(T9, T10)
//     T12 = fd.ops.mul(T4, T8)
//     T13 = fd.ops.mul(T11, T12)
//     T14 = fd.ops.sum(T13, dims=[1], keepdim=True, dtype=DataType.Float)
//     S15 = fd.ops.size(T0, dim=1)
//     T16 = fd.ops.div(T14, S15)
//     S17 = fd.ops.size(T0, dim=0)
//     S18 = fd.ops.size(T0, dim=1)
//     T19 = fd.ops.broadcast_in_dim(T16, shape=[S17, S18], broadcast_dims=[0, 1])
//     T20 = fd.ops.mul(T12, T19)
//     T21 = fd.ops.sub(T11, T20)
//     T22 = fd.ops.mul(T21, T8)
//     T23 = fd.ops.cast(T2, dtype=DataType.Float)
//     T24 = fd.ops.mul(T23, T12)
//     T25 = fd.ops.sum(T24, dims=[0], keepdim=False, dtype=DataType.Float)
//     T26 = fd.ops.cast(T22, dtype=DataType.BFloat16)
//     T27 = fd.ops.cast(T25, dtype=DataType.BFloat16)
//     fd.add_output(T26)
//     fd.add_output(T27)
//
// kind:              inner + outer reduction
// full inputs:       T0:BFloat16, T2:BFloat16
// row inputs:        T1:Float
// column inputs:     T3:BFloat16
// scalar inputs:     -
// persistent:        T0:BFloat16, T2:BFloat16
// inner level 0:     sum(T13)->T14
// outer reductions:  sum(T24)->T25
// outputs:           T26:full, T27:col
//
// RowSchedule
//   scheduler          inner_outer_persistent
//   reason             smem-first policy: T0, T2 in smem (2 stages), ~111 regs/thread, ~1 block(s)/SM
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
//   stages             2
//   aligned_copy       False
//   placements         T0:BFloat16->smem(cp.async), T2:BFloat16->smem(cp.async), T3:BFloat16->registers
//   accumulators       registers
//   reduction_bytes    4
//   regs_estimate      111
//   blocks_per_sm      1
//   dealing            strided
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_T0         98312       0    98432  row buffer T0 (BFloat16), 2 stage(s) x 1 row(s) x 24578
// s_T2         98312   98432    98432  row buffer T2 (BFloat16), 2 stage(s) x 1 row(s) x 24578
// s_reduce       128  196864      128  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 197120 B = dynamic 196992 + static 128; limit 232448 B; headroom 35328 B; alignment 128 B
//
// FinalizeSchedule
//   reason             a kernel of its own (the call's row groups take more than one wave): 32 columns x 16 lane(s) a
//       block, the widest tile that gives every SM two blocks
//   hidden             24578
//   cols_per_block     32
//   partial_lanes      16
//   unroll             16
//   fused              False
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes_T25   4096       0     4096  the lanes' sums of T25: 16 lane(s) x 32 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 4224 B = dynamic 4096 + static 128; limit 232448 B; headroom 228224 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a persistent grid, each block taking every grid-th row group.
// Thread x of a row owns vectors x, x + 512, ... (25 of them, 2 element(s) each) of the row.
// Inputs: T3 in registers; T0, T2 in smem.
extern "C" __global__ void __launch_bounds__(512, 1)
rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T3,
    const float* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T26,
    float* __restrict__ g_part_T25,
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
  // row buffer T0 (BFloat16), 2 stage(s) x 1 row(s) x 24578
  unsigned char* const s_T0 = smem;
  // row buffer T2 (BFloat16), 2 stage(s) x 1 row(s) x 24578
  unsigned char* const s_T2 = smem + 98432;
  // inner-reduction scratch: 2 parities x 1 x 1 row(s) x 16 warps x 4 B
  unsigned char* const s_reduce = smem + 196864;
  const long long S15 = static_cast<long long>(H);

  fm::ColumnInRegisters<__nv_bfloat16, Part> T3(part, g_T3);
  // column reduction sum(T24) -> T25, in registers
  fm::AccumulatorInRegisters<float, fm::Sum, Part> acc_T25(part, g_part_T25, nullptr);
  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(s_reduce, nullptr);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 49156> T0(s_T0, g_T0);
  fm::RowInSmem<__nv_bfloat16, Part, fm::Copy::VECTORS, 49156> T2(s_T2, g_T2);

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  // 2 stages: this block's first row starts loading now, a row more each time one computes.
  T0.copy(part, part.ty, row0 + part.ty, n_rows);
  T2.copy(part, part.ty, row0 + part.ty, n_rows);
  fm::cp_async_commit();
  float ahead0_T1 = fm::row_value<float>(g_T1, row0 + part.ty, row0 + part.ty < n_rows);
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // 0: rows start on vector boundaries
    const int slot = (it % 2) * RPB + part.ty;  // this row's slot
    const long long next = row + row_stride;
    T0.copy(part, ((it + 1) % 2) * RPB + part.ty, next, n_rows);
    T2.copy(part, ((it + 1) % 2) * RPB + part.ty, next, n_rows);
    fm::cp_async_commit();
    const float row_T1 = ahead0_T1;
    ahead0_T1 = fm::row_value<float>(g_T1, next, next < n_rows);
    fm::cp_async_wait<1>();
    T0.ready(part, slot, row);
    T2.ready(part, slot, row);
    const float row_T8 = fm::reciprocal(row_T1);

    // Inner reduction level 0: sum(T13) -> T14.
    float row_T14 = fm::Sum::identity<float>();
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T2 = T2.at(v);
      const auto c_T3 = T3.at(v);
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T4 = fm::element(x_T0, i);
        const float e_T9 = fm::element(x_T2, i);
        const float e_T10 = fm::element(c_T3, i);
        const float e_T11 = (e_T9 * e_T10);
        const float e_T12 = (e_T4 * row_T8);
        const float e_T13 = (e_T11 * e_T12);
        if (fm::in_row<Part>(v, i)) row_T14 = fm::Sum{}(row_T14, e_T13);
      }
    });
    reduce(part, fm::reduced(row_T14, fm::Sum{}));
    const float row_T16 = (row_T14 / static_cast<float>(S15));

    // Outputs of the row and the column accumulators.
    fm::for_each_vector(part, skew, [&](const auto& v) {
      const auto x_T0 = T0.at(v);
      const auto x_T2 = T2.at(v);
      const auto c_T3 = T3.at(v);
      fm::Vec<__nv_bfloat16, Part::VEC> o_T26;
#pragma unroll
      for (int i = 0; i < Part::VEC; ++i) {
        const float e_T4 = fm::element(x_T0, i);
        const float e_T9 = fm::element(x_T2, i);
        const float e_T10 = fm::element(c_T3, i);
        const float e_T11 = (e_T9 * e_T10);
        const float e_T12 = (e_T4 * row_T8);
        const float e_T20 = (e_T12 * row_T16);
        const float e_T21 = (e_T11 - e_T20);
        const float e_T22 = (e_T21 * row_T8);
        const float e_T23 = fm::element(x_T2, i);
        const float e_T24 = (e_T23 * e_T12);
        o_T26.v[i] = fm::to_storage<__nv_bfloat16>(e_T22);
        if (valid) acc_T25.add(v, i, e_T24);
      }
      if (valid) fm::store_visit<Part, false>(g_T26 + row * H, v, o_T26);
    });
  }
  acc_T25.finish(part);  // this block's partial row of T25
}

// Column finalize: sums the [partial_rows, H] partials of each outer reduction per column, in a
// fixed order (lanes stride the partial rows, then lane 0 adds the lanes up), then writes the
// column outputs. No atomics: the result is the same from run to run.
extern "C" __global__ void __launch_bounds__(512)
rmsnorm_bwd_finalize(
    const float* __restrict__ g_part_T25,
    const __nv_bfloat16* __restrict__ g_T3,
    __nv_bfloat16* __restrict__ g_T27,
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
  // the lanes' sums of T25: 16 lane(s) x 32 columns (double)
  double* const s_lanes_T25 = reinterpret_cast<double*>(smem);
  double total_T25 = fm::Sum::identity<double>();
  if (col < H) {
    int p = lane;
    constexpr int UNROLL = 16;
    // whole rounds of UNROLL partial rows: loaded first, their loads in flight together, then
    // added in row order
    for (; p + (UNROLL - 1) * LANES < partial_rows; p += UNROLL * LANES) {
      float rows_T25[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const long long at = (static_cast<long long>(p) + u * LANES) * H + col;
        rows_T25[u] = g_part_T25[at];
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        total_T25 = fm::Sum{}(total_T25, static_cast<double>(rows_T25[u]));
      }
    }
    #pragma unroll 1
    for (; p < partial_rows; p += LANES) {  // the rows left, one at a time, in order
      const long long at = static_cast<long long>(p) * H + col;
      total_T25 = fm::Sum{}(total_T25, static_cast<double>(g_part_T25[at]));
    }
  }
  s_lanes_T25[lane * COLS + threadIdx.x] = total_T25;
  __syncthreads();
  if (lane == 0 && col < H) {
    for (int l = 1; l < LANES; ++l) {
      const double lane_total = s_lanes_T25[l * COLS + threadIdx.x];
      total_T25 = fm::Sum{}(total_T25, lane_total);
    }
    const float tot_T25 = static_cast<float>(total_T25);
    g_T27[col] = fm::to_storage<__nv_bfloat16>(tot_T25);
  }
}
