// fuser kernel module for fusion 'batchnorm_fwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T2 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T3 = fd.ops.cast(T0, dtype=DataType.Float)
//     S4 = fd.ops.size(T3, dim=0)
//     T5 = fd.ops.sum(T3, dims=[0], keepdim=False, dtype=DataType.Float)
//     T6 = fd.ops.div(T5, S4)
//     S7 = fd.ops.size(T3, dim=0)
//     S8 = fd.ops.size(T3, dim=1)
//     T9 = fd.ops.broadcast_in_dim(T6, shape=[S7, S8], broadcast_dims=[1])
//     T10 = fd.ops.sub(T3, T9)
//     T11 = fd.ops.mul(T10, T10)
//     S12 = fd.define_scalar(0, dtype=DataType.Int64)
//     S13 = fd.ops.sub(S4, S12)
//     S14 = fd.define_scalar(0, dtype=DataType.Int64)
//     S15 = fd.ops.maximum(S13, S14)
//     T16 = fd.ops.sum(T11, dims=[0], keepdim=False, dtype=DataType.Float)
//     T17 = fd.ops.div(T16, S15)
//     S18 = fd.define_scalar(1e-05, dtype=DataType.Double)
//     T19 = fd.ops.add(T17, S18)
//     T20 = fd.ops.rsqrt(T19)
//     T21 = fd.ops.sub(T3, T6)
//     T22 = fd.ops.mul(T21, T20)
//     T23 = fd.ops.cast(T1, dtype=DataType.Float)
//     T24 = fd.ops.mul(T22, T23)
//     T25 = fd.ops.cast(T2, dtype=DataType.Float)
//     T26 = fd.ops.add(T24, T25)
//     T27 = fd.ops.cast(T26, dtype=DataType.BFloat16)
//     fd.add_output(T27)
//     fd.add_output(T6)
//     fd.add_output(T20)
//
// kind:              outer normalization
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     T1:BFloat16, T2:BFloat16
// scalar inputs:     -
// persistent:        -
// outer level 0:     sum(T3)->T5
// outer level 1:     sum(T11)->T16
// outputs:           T27:full, T6:col, T20:col
//
// OuterSchedule
//   scheduler          outer_persistent
//   reason             64-byte row segments: 1024 rows x 32 columns per block, cluster of 16 per slab
//   hidden             4096
//   rows               16384
//   vec                8
//   slab               32
//   col_lanes          4
//   row_lanes          64
//   fold_rows          8
//   cluster            16
//   rank_rows          1024
//   blocks_per_sm      3
//   streamed           False
//
// shared memory plan:
// buffer        bytes  offset  aligned  purpose
// s_T0          65536       0    65536  T0's rows of the slab (BFloat16): 1024 x 32
// s_lanes0_f32   1024   65536     1024  sum(T3), sum(T11) over each warp's rows, level by level: 8 x 32
// s_inbox_T5     4096   66560     4096  T5: the cluster's partials per column, pushed here by each block: 16 x 32
// s_inbox_T16    4096   70656     4096  T16: the cluster's partials per column, pushed here by each block: 16 x 32
// s_total0_f64    256   74752      256  T5, T16: the slab's totals per column, level by level
// s_level_bars     16   75008      128  one mbarrier per level (2): the inboxes' rows have arrived
// static slot     128  static      128  static __shared__ (magic zero)
// total 75264 B = dynamic 75136 + static 128; limit 232448 B; headroom 157184 B; alignment 128 B

#include "fuser_columns.cuh"

// Each slab of 32 columns is kept on chip: a cluster of 16 blocks shares each slab's rows, block k the k-th share (at
// most 1024 rows) in shared memory, copied once.
// Thread (x, y) owns columns x * 8 to x * 8 + 7 of the slab and rows y, y + 64, ... of its block; each level's column
// totals are folded over the block's rows, then over the cluster's blocks in rank order.
extern "C" __global__ void __cluster_dims__(16, 1, 1) __launch_bounds__(256, 3)
batchnorm_fwd_outer(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T1,
    const __nv_bfloat16* __restrict__ g_T2,
    __nv_bfloat16* __restrict__ g_T27,
    float* __restrict__ g_T6,
    float* __restrict__ g_T20,
    long long n_rows)
{
  constexpr int H = 4096;  // columns
  // H, VEC, LANES (threads across the slab), ROW_LANES (threads down its rows), GROUPS (rows of
  // the fold buffers), CLUSTER
  using Slab = fm::ColumnSlab<H, 8, 4, 64, 8, 16>;
  constexpr int VEC = Slab::VEC;
  const Slab slab(n_rows);
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // T0's rows of the slab (BFloat16): 1024 x 32
  __nv_bfloat16* const s_T0 = reinterpret_cast<__nv_bfloat16*>(smem);
  // sum(T3), sum(T11) over each warp's rows, level by level: 8 x 32
  float* const s_lanes0_f32 = reinterpret_cast<float*>(smem + 65536);
  // T5: the cluster's partials per column, pushed here by each block: 16 x 32
  double* const s_inbox_T5 = reinterpret_cast<double*>(smem + 66560);
  // T16: the cluster's partials per column, pushed here by each block: 16 x 32
  double* const s_inbox_T16 = reinterpret_cast<double*>(smem + 70656);
  // T5, T16: the slab's totals per column, level by level
  double* const s_total0_f64 = reinterpret_cast<double*>(smem + 74752);
  // one mbarrier per level (2): the inboxes' rows have arrived
  unsigned long long* const s_level_bars = reinterpret_cast<unsigned long long*>(smem + 75008);
  const long long S4 = n_rows;
  const long long S12 = 0LL;
  const long long S14 = 0LL;
  const double S18 = 1e-05;
  const long long S13 = (S4 - S12);
  const long long S15 = fm::max(S13, S14);

  // Each level's mbarrier expects the cluster's pushes into this block's inboxes; the cluster
  // barrier's first half tells the peers they may push (its second half comes before the first push).
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    fm::mbarrier_init(&s_level_bars[0], 1);
    fm::mbarrier_init(&s_level_bars[1], 1);
    fm::fence_mbarrier_init();
    fm::mbarrier_expect_tx(&s_level_bars[0], 4096);
    fm::mbarrier_expect_tx(&s_level_bars[1], 4096);
  }
  fm::cluster_arrive_relaxed();

  // The block's rows of the slab, copied once: each thread copies the vectors it reads.
  slab.fill(s_T0, g_T0);
  fm::cp_async_commit();
  fm::Vec<__nv_bfloat16, VEC> c_T1{};
  if (slab.owns) c_T1 = fm::load_pieces<VEC>(g_T1 + slab.col);
  fm::Vec<__nv_bfloat16, VEC> c_T2{};
  if (slab.owns) c_T2 = fm::load_pieces<VEC>(g_T2 + slab.col);
  fm::cp_async_wait<0>();  // this thread's copies, the rows it reads, have landed

  // Outer level 0: sum(T3) -> T5, over every row of the slab.
  float acc_T5[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc_T5[i] = fm::Sum::identity<float>();
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T3 = fm::element(x_T0, i);
        acc_T5[i] = fm::Sum{}(acc_T5[i], e_T3);
      }
    }
  }
  slab.put(s_lanes0_f32, acc_T5, fm::Sum{});
  __syncthreads();  // every warp's partials are in the lanes buffers
  fm::cluster_wait();  // every block's mbarriers are ready for the pushes
  slab.fold_groups(s_lanes0_f32, s_inbox_T5, fm::Sum{}, &s_level_bars[0]);
  fm::mbarrier_wait(&s_level_bars[0], 0);  // every block's partials are in the inboxes
  slab.fold_blocks(s_inbox_T5, s_total0_f64, fm::Sum{});
  __syncthreads();  // the slab's totals are complete
  float r_T5[VEC];
  slab.get(s_total0_f64, r_T5);

  // Outer level 1: sum(T11) -> T16, over every row of the slab.
  float k_T6[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float col_T6 = (r_T5[i] / static_cast<float>(S4));
    k_T6[i] = col_T6;
  }
  float acc_T16[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc_T16[i] = fm::Sum::identity<float>();
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T3 = fm::element(x_T0, i);
        const float e_T10 = (e_T3 - k_T6[i]);
        const float e_T11 = (e_T10 * e_T10);
        acc_T16[i] = fm::Sum{}(acc_T16[i], e_T11);
      }
    }
  }
  slab.put(s_lanes0_f32, acc_T16, fm::Sum{});
  __syncthreads();  // every warp's partials are in the lanes buffers
  slab.fold_groups(s_lanes0_f32, s_inbox_T16, fm::Sum{}, &s_level_bars[1]);
  fm::mbarrier_wait(&s_level_bars[1], 0);  // every block's partials are in the inboxes
  slab.fold_blocks(s_inbox_T16, s_total0_f64, fm::Sum{});
  fm::cluster_arrive_relaxed();  // nothing more will be pushed to this block
  __syncthreads();  // the slab's totals are complete
  float r_T16[VEC];
  slab.get(s_total0_f64, r_T16);

  // Outputs, from the rows still in shared memory.
  float k_T20[VEC];
  float k_T23[VEC];
  float k_T25[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float col_T17 = (r_T16[i] / static_cast<float>(S15));
    const float col_T19 = (col_T17 + static_cast<float>(S18));
    const float col_T20 = fm::rsqrt(col_T19);
    const float col_T23 = fm::element(c_T1, i);
    const float col_T25 = fm::element(c_T2, i);
    k_T20[i] = col_T20;
    k_T23[i] = col_T23;
    k_T25[i] = col_T25;
  }
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
      fm::Vec<__nv_bfloat16, VEC> o_T27;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T3 = fm::element(x_T0, i);
        const float e_T21 = (e_T3 - k_T6[i]);
        const float e_T22 = (e_T21 * k_T20[i]);
        const float e_T24 = (e_T22 * k_T23[i]);
        const float e_T26 = (e_T24 + k_T25[i]);
        o_T27.v[i] = fm::to_storage<__nv_bfloat16>(e_T26);
      }
      const long long at = (slab.row0 + r) * H + slab.col;
      fm::store<VEC>(g_T27 + at, o_T27);
    }
  }
  if (slab.owns && slab.rank == 0 && slab.ty == 0) {  // the column outputs, once per slab
    fm::Vec<float, VEC> o_T6;
    fm::Vec<float, VEC> o_T20;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o_T6.v[i] = fm::to_storage<float>(k_T6[i]);
      o_T20.v[i] = fm::to_storage<float>(k_T20[i]);
    }
    fm::store_pieces<VEC>(g_T6 + slab.col, o_T6);
    fm::store_pieces<VEC>(g_T20 + slab.col, o_T20);
  }
  fm::cluster_wait();  // no block leaves while its pushes may still be on their way to a peer
}
