// fuser kernel module for fusion 'softmax_dim0_fwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.ops.cast(T0, dtype=DataType.Float)
//     T2 = fd.ops.max(T1, dims=[0], keepdim=True, dtype=DataType.Float)
//     T3 = fd.ops.sub(T1, T2)
//     T4 = fd.ops.exp(T3)
//     T5 = fd.ops.sum(T4, dims=[0], keepdim=True, dtype=DataType.Float)
//     T6 = fd.ops.div(T4, T5)
//     T7 = fd.ops.cast(T6, dtype=DataType.BFloat16)
//     fd.add_output(T7)
//
// kind:              outer normalization
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     -
// scalar inputs:     -
// persistent:        -
// outer level 0:     max(T1)->T2
// outer level 1:     sum(T4)->T5
// outputs:           T7:full
//
// OuterSchedule
//   scheduler          outer_persistent
//   reason             128-byte row segments: 512 rows x 64 columns per block, cluster of 8 per slab; max(T1) -> T2
//       with sum(exp(T1 - T2)) -> T5, online (one pass and one fold for both)
//   hidden             16384
//   rows               4096
//   vec                8
//   slab               64
//   col_lanes          8
//   row_lanes          32
//   fold_rows          8
//   cluster            8
//   rank_rows          512
//   blocks_per_sm      3
//   streamed           False
//
// shared memory plan:
// buffer         bytes  offset  aligned  purpose
// s_T0           65536       0    65536  T0's rows of the slab (BFloat16): 512 x 64
// s_lanes0_pair   4096   65536     4096  max(T1) with sum(exp(T1 - T2)) over each warp's rows, level by level: 8 x 64
// s_inbox_T2      4096   69632     4096  T2, T5: the cluster's partials per column, pushed here by each block: 8 x 64
// s_total0_pair    512   73728      512  T2, T5: the slab's totals per column, level by level
// s_level_bars       8   74240      128  one mbarrier per level (1): the inboxes' rows have arrived
// static slot      128  static      128  static __shared__ (magic zero)
// total 74496 B = dynamic 74368 + static 128; limit 232448 B; headroom 157952 B; alignment 128 B

#include "fuser_columns.cuh"

// Each slab of 64 columns is kept on chip: a cluster of 8 blocks shares each slab's rows, block k the k-th share (at
// most 512 rows) in shared memory, copied once.
// Thread (x, y) owns columns x * 8 to x * 8 + 7 of the slab and rows y, y + 32, ... of its block; each level's column
// totals are folded over the block's rows, then over the cluster's blocks in rank order.
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256, 3)
softmax_dim0_fwd_outer(
    const __nv_bfloat16* __restrict__ g_T0,
    __nv_bfloat16* __restrict__ g_T7,
    long long n_rows)
{
  constexpr int H = 16384;  // columns
  // H, VEC, LANES (threads across the slab), ROW_LANES (threads down its rows), GROUPS (rows of
  // the fold buffers), CLUSTER
  using Slab = fm::ColumnSlab<H, 8, 8, 32, 8, 8>;
  constexpr int VEC = Slab::VEC;
  const Slab slab(n_rows);
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // T0's rows of the slab (BFloat16): 512 x 64
  __nv_bfloat16* const s_T0 = reinterpret_cast<__nv_bfloat16*>(smem);
  // max(T1) with sum(exp(T1 - T2)) over each warp's rows, level by level: 8 x 64
  fm::MaxSum* const s_lanes0_pair = reinterpret_cast<fm::MaxSum*>(smem + 65536);
  // T2, T5: the cluster's partials per column, pushed here by each block: 8 x 64
  fm::MaxSum* const s_inbox_T2 = reinterpret_cast<fm::MaxSum*>(smem + 69632);
  // T2, T5: the slab's totals per column, level by level
  fm::MaxSum* const s_total0_pair = reinterpret_cast<fm::MaxSum*>(smem + 73728);
  // one mbarrier per level (1): the inboxes' rows have arrived
  unsigned long long* const s_level_bars = reinterpret_cast<unsigned long long*>(smem + 74240);

  // Each level's mbarrier expects the cluster's pushes into this block's inboxes; the cluster
  // barrier's first half tells the peers they may push (its second half comes before the first push).
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    fm::mbarrier_init(&s_level_bars[0], 1);
    fm::fence_mbarrier_init();
    fm::mbarrier_expect_tx(&s_level_bars[0], 4096);
  }
  fm::cluster_arrive_relaxed();

  // The block's rows of the slab, copied once: each thread copies the vectors it reads.
  slab.fill(s_T0, g_T0);
  fm::cp_async_commit();
  fm::cp_async_wait<0>();  // this thread's copies, the rows it reads, have landed

  // Outer level 0: max(T1) -> T2 with sum(exp(T1 - T2)) -> T5, online, over every row of the slab.
  fm::MaxSum acc_T2[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc_T2[i] = fm::OnlineSum::identity<fm::MaxSum>();
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T1 = fm::element(x_T0, i);
        acc_T2[i] = fm::OnlineSum{}(acc_T2[i], e_T1);
      }
    }
  }
  slab.put(s_lanes0_pair, acc_T2, fm::OnlineSum{});
  __syncthreads();  // every warp's partials are in the lanes buffers
  fm::cluster_wait();  // every block's mbarriers are ready for the pushes
  slab.fold_groups(s_lanes0_pair, s_inbox_T2, fm::OnlineSum{}, &s_level_bars[0]);
  fm::mbarrier_wait(&s_level_bars[0], 0);  // every block's partials are in the inboxes
  slab.fold_blocks(s_inbox_T2, s_total0_pair, fm::OnlineSum{});
  fm::cluster_arrive_relaxed();  // nothing more will be pushed to this block
  __syncthreads();  // the slab's totals are complete
  fm::MaxSum r_T2[VEC];
  slab.get(s_total0_pair, r_T2);

  // Outputs, from the rows still in shared memory.
  float k_rcp_T5[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    k_rcp_T5[i] = float(1) / fm::online_sum(r_T2[i]);
  }
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
      fm::Vec<__nv_bfloat16, VEC> o_T7;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T1 = fm::element(x_T0, i);
        const float e_T3 = (e_T1 - r_T2[i].m);
        const float e_T4 = fm::exp(e_T3);
        const float e_T6 = (e_T4 * k_rcp_T5[i]);
        o_T7.v[i] = fm::to_storage<__nv_bfloat16>(e_T6);
      }
      const long long at = (slab.row0 + r) * H + slab.col;
      fm::store<VEC>(g_T7 + at, o_T7);
    }
  }
  fm::cluster_wait();  // no block leaves while its pushes may still be on their way to a peer
}
