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
//   reason             smem-first policy: only the staging ring in smem, T3 re-read each pass, T0, T2 re-read each pass
//       through a staging ring (cp.async, 4 slots x 16 chunk(s)), column accumulators in global, ~48 regs/thread, ~1
//       block(s)/SM (1 block(s) cannot keep the row on chip)
//   hidden             131072
//   vec                8
//   skew               0
//   threads_per_row    1024
//   rows_per_block     1
//   cluster            1
//   batch              16
//   unroll             1
//   full_unroll        False
//   kept               ()
//   stages             1
//   aligned_copy       False
//   placements         T0:BFloat16->ring, T2:BFloat16->ring, T3:BFloat16->global
//   accumulators       global
//   ring               T0, T2 by cp.async: 4 slots, 16 chunk(s) of 8192 elements (tail 8192) per pass, 2 pass(es) per
//       row
//   reduction_bytes    4
//   regs_estimate      48
//   blocks_per_sm      1
//   dealing            strided
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_ring_T0    65536       0    65536  staging ring T0: 4 slots x 8192 elements, 16 chunk(s) per pass, tail 8192
// s_ring_T2    65536   65536    65536  staging ring T2: 4 slots x 8192 elements, 16 chunk(s) per pass, tail 8192
// s_reduce       256  131072      256  inner-reduction scratch: 2 parities x 1 x 1 row(s) x 32 warps x 4 B
// static slot    128  static      128  static __shared__ (magic zero)
// total 131456 B = dynamic 131328 + static 128; limit 166912 B; headroom 35456 B; alignment 128 B
//
// FinalizeSchedule
//   reason             a kernel of its own (the call's row groups take more than one wave): 32 columns x 16 lane(s) a
//       block, the widest tile that gives every SM two blocks
//   hidden             131072
//   cols_per_block     32
//   partial_lanes      16
//   unroll             16
//   fused              False
//
// shared memory plan:
// buffer       bytes  offset  aligned  purpose
// s_lanes_T25   4096       0     4096  the lanes' sums of T25: 16 lane(s) x 32 columns (double)
// static slot    128  static      128  static __shared__ (magic zero)
// total 4224 B = dynamic 4096 + static 128; limit 166912 B; headroom 162688 B; alignment 128 B

#include "fuser_rows.cuh"
#include "fuser_row_ring.cuh"
#include "fuser_row_reduce.cuh"
#include "fuser_row_columns.cuh"

// Each block works on 1 row(s) at a time; a persistent grid, each block taking every grid-th row group.
// Thread x of a row owns vectors x, x + 1024, ... (16 of them, 8 element(s) each) of the row.
// Inputs: T3 in global; T0, T2 in ring.
extern "C" __global__ void __launch_bounds__(1024, 1)
rmsnorm_bwd_row(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T3,
    const float* __restrict__ g_T1,
    __nv_bfloat16* __restrict__ g_T26,
    float* __restrict__ g_part_T25,
    long long n_rows)
{
  constexpr int H = 131072;  // elements per row
  constexpr int RPB = 1;  // rows per block
  // H, VEC, TPR, RPB, BATCH, UNROLL, CLUSTER, SKEW: the thread's rows and vectors, and their passes
  using Part = fm::RowPart<H, 8, 1024, RPB, 16, 1, 1, 0>;
  const Part part;
  const int zero = fm::magic_zero();
  fm::allow_dependent_launch();  // the finalize may launch now; it waits for this grid's end

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // staging ring T0: 4 slots x 8192 elements, 16 chunk(s) per pass, tail 8192
  unsigned char* const s_ring_T0 = smem;
  // staging ring T2: 4 slots x 8192 elements, 16 chunk(s) per pass, tail 8192
  unsigned char* const s_ring_T2 = smem + 65536;
  // inner-reduction scratch: 2 parities x 1 x 1 row(s) x 32 warps x 4 B
  unsigned char* const s_reduce = smem + 131072;
  const long long S15 = static_cast<long long>(H);

  fm::ColumnInGlobal<__nv_bfloat16, Part> T3(g_T3);
  // column reduction sum(T24) -> T25, in global
  fm::AccumulatorInGlobal<float, fm::Sum, Part> acc_T25(part, g_part_T25);
  // the row reductions: warps, then the row's warps, then the cluster's blocks
  fm::RowReducer<float, Part, 1> reduce(s_reduce, nullptr);
  // staging ring: T0, T2 by cp.async: 4 slots, 16 chunk(s) of 8192 elements (tail 8192) per pass, 2
  // pass(es) per row
  fm::StagingRing<Part, false, 4, 1, 16, 2, 32> ring(nullptr, part);
  fm::RowInRing<__nv_bfloat16, Part, false, 1024> T0(s_ring_T0, g_T0);
  fm::RowInRing<__nv_bfloat16, Part, false, 1024> T2(s_ring_T2, g_T2);

  const long long row_stride = part.row_stride();
  long long row0 = part.first_row();
  auto ring_fill = [&](const fm::RingChunk& chunk) {  // chunk's copies into its slot
    T0.fill(part, chunk, ring);
    T2.fill(part, chunk, ring);
  };
  ring.start(part, n_rows, ring_fill);
  for (int it = 0; row0 < n_rows; row0 += row_stride, ++it) {
    const long long row = row0 + part.ty + zero;
    const bool valid = row < n_rows;
    const int skew = Part::skew(row);  // 0: rows start on vector boundaries
    const float row_T1 = fm::row_value<float>(g_T1, row, valid);
    const float row_T8 = fm::reciprocal(row_T1);

    // Inner reduction level 0: sum(T13) -> T14.
    float row_T14 = fm::Sum::identity<float>();
    ring.pass<1>(part, skew, n_rows, ring_fill, [&](const auto& v) {
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
    ring.pass<1>(part, skew, n_rows, ring_fill, [&](const auto& v) {
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
      if (valid) fm::store_visit<Part, true>(g_T26 + row * H, v, o_T26);
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
  constexpr int H = 131072;
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
