// fuser kernel module for fusion 'sequence_mean' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1, -1], contiguity=[True, True, True], dtype=DataType.BFloat16)
//     T1 = fd.ops.cast(T0, dtype=DataType.Float)
//     T2 = fd.ops.sum(T1, dims=[1], keepdim=False, dtype=DataType.Float)
//     S3 = fd.ops.size(T0, dim=1)
//     T4 = fd.ops.div(T2, S3)
//     T5 = fd.ops.cast(T4, dtype=DataType.BFloat16)
//     fd.add_output(T5)
//
// kind:              outer reduction
// full inputs:       T0:BFloat16
// row inputs:        -
// column inputs:     -
// scalar inputs:     -
// persistent:        -
// groups:            row axes 0..0 of 2 (the column reductions' results are per group: each group's rows run in a grid
//     row of blocks of their own)
// outer reductions:  sum(T1)->T2
// outputs:           T5:col
//
// OuterSchedule
//   scheduler          outer_persistent
//   reason             128-byte row segments streamed: 64 slabs of 64 columns, a cluster of 2 each
//   hidden             4096
//   rows               1024
//   vec                8
//   slab               64
//   col_lanes          8
//   row_lanes          64
//   fold_rows          16
//   cluster            2
//   rank_rows          512
//   blocks_per_sm      2
//   streamed           True
//
// shared memory plan:
// buffer        bytes  offset  aligned  purpose
// s_lanes0_f32   4096       0     4096  sum(T1) over each warp's rows, level by level: 16 x 64
// s_inbox_T2     1024    4096     1024  T2: the cluster's partials per column, pushed here by each block: 2 x 64
// s_total0_f64    512    5120      512  T2: the slab's totals per column, level by level
// s_level_bars      8    5632      128  one mbarrier per level (1): the inboxes' rows have arrived
// static slot     128  static      128  static __shared__ (magic zero)
// total 5888 B = dynamic 5760 + static 128; limit 232448 B; headroom 226560 B; alignment 128 B

#include "fuser_columns.cuh"

// Each slab of 64 columns streams its rows from global memory (a cluster of 2 blocks shares each slab's rows, block k
// the k-th share), 4 rows' loads of a thread in flight; none are kept.
// Thread (x, y) owns columns x * 8 to x * 8 + 7 of the slab and rows y, y + 64, ... of its block; each level's column
// totals are folded over the block's rows, then over the cluster's blocks in rank order.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(512, 2)
sequence_mean_outer(
    const __nv_bfloat16* __restrict__ g_T0,
    __nv_bfloat16* __restrict__ g_T5,
    long long n_rows,
    long long n_groups)
{
  constexpr int H = 4096;  // columns
  // This block's group of rows (a grid row per group): the pointers move to its part.
  const long long group = blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z;
  if (group >= n_groups) return;  // a grid row past the groups (split over z)
  g_T0 += group * n_rows * H;
  g_T5 += group * H;
  // H, VEC, LANES (threads across the slab), ROW_LANES (threads down its rows), GROUPS (rows of
  // the fold buffers), CLUSTER
  using Slab = fm::ColumnSlab<H, 8, 8, 64, 16, 2>;
  constexpr int VEC = Slab::VEC;
  const Slab slab(n_rows);
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // sum(T1) over each warp's rows, level by level: 16 x 64
  float* const s_lanes0_f32 = reinterpret_cast<float*>(smem);
  // T2: the cluster's partials per column, pushed here by each block: 2 x 64
  double* const s_inbox_T2 = reinterpret_cast<double*>(smem + 4096);
  // T2: the slab's totals per column, level by level
  double* const s_total0_f64 = reinterpret_cast<double*>(smem + 5120);
  // one mbarrier per level (1): the inboxes' rows have arrived
  unsigned long long* const s_level_bars = reinterpret_cast<unsigned long long*>(smem + 5632);
  const long long S3 = n_rows;

  // Each level's mbarrier expects the cluster's pushes into this block's inboxes; the cluster
  // barrier's first half tells the peers they may push (its second half comes before the first push).
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    fm::mbarrier_init(&s_level_bars[0], 1);
    fm::fence_mbarrier_init();
    fm::mbarrier_expect_tx(&s_level_bars[0], 1024);
  }
  fm::cluster_arrive_relaxed();


  // Outer level 0: sum(T1) -> T2, over every row of the slab.
  float acc_T2[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc_T2[i] = fm::Sum::identity<float>();
  if (slab.owns) {
#pragma unroll 4
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.read(g_T0, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T1 = fm::element(x_T0, i);
        acc_T2[i] = fm::Sum{}(acc_T2[i], e_T1);
      }
    }
  }
  slab.put(s_lanes0_f32, acc_T2, fm::Sum{});
  __syncthreads();  // every warp's partials are in the lanes buffers
  fm::cluster_wait();  // every block's mbarriers are ready for the pushes
  slab.fold_groups(s_lanes0_f32, s_inbox_T2, fm::Sum{}, &s_level_bars[0]);
  fm::mbarrier_wait(&s_level_bars[0], 0);  // every block's partials are in the inboxes
  slab.fold_blocks(s_inbox_T2, s_total0_f64, fm::Sum{});
  fm::cluster_arrive_relaxed();  // nothing more will be pushed to this block
  __syncthreads();  // the slab's totals are complete
  float r_T2[VEC];
  slab.get(s_total0_f64, r_T2);

  // Column outputs.
  if (slab.owns && slab.rank == 0 && slab.ty == 0) {  // the column outputs, once per slab
    fm::Vec<__nv_bfloat16, VEC> o_T5;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float col_T4 = (r_T2[i] / static_cast<float>(S3));
      o_T5.v[i] = fm::to_storage<__nv_bfloat16>(col_T4);
    }
    fm::store_pieces<VEC>(g_T5 + slab.col, o_T5);
  }
  fm::cluster_wait();  // no block leaves while its pushes may still be on their way to a peer
}
