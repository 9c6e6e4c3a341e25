// fuser kernel module for fusion 'batchnorm_bwd' (templates <templates>)
//
// The fusion, lowered to primitives (Python that rebuilds it):
// def define_fusion(fd: FusionDefinition) -> None:
//     T0 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T1 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
//     T2 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.Float)
//     T3 = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
//     T4 = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
//     T5 = fd.ops.cast(T3, dtype=DataType.Float)
//     T6 = fd.ops.cast(T0, dtype=DataType.Float)
//     T7 = fd.ops.sub(T6, T1)
//     T8 = fd.ops.mul(T7, T2)
//     T9 = fd.ops.sum(T5, dims=[0], keepdim=False, dtype=DataType.Float)
//     T10 = fd.ops.mul(T5, T8)
//     T11 = fd.ops.sum(T10, dims=[0], keepdim=False, dtype=DataType.Float)
//     S12 = fd.ops.size(T0, dim=0)
//     T13 = fd.ops.div(T9, S12)
//     T14 = fd.ops.sub(T5, T13)
//     T15 = fd.ops.div(T11, S12)
//     T16 = fd.ops.mul(T8, T15)
//     T17 = fd.ops.sub(T14, T16)
//     T18 = fd.ops.cast(T4, dtype=DataType.Float)
//     T19 = fd.ops.mul(T18, T2)
//     T20 = fd.ops.mul(T19, T17)
//     T21 = fd.ops.cast(T20, dtype=DataType.BFloat16)
//     T22 = fd.ops.cast(T11, dtype=DataType.BFloat16)
//     T23 = fd.ops.cast(T9, dtype=DataType.BFloat16)
//     fd.add_output(T21)
//     fd.add_output(T22)
//     fd.add_output(T23)
//
// kind:              outer normalization
// full inputs:       T0:BFloat16, T3:BFloat16
// row inputs:        -
// column inputs:     T1:Float, T2:Float, T4:BFloat16
// scalar inputs:     -
// persistent:        -
// outer level 0:     sum(T5)->T9, sum(T10)->T11
// outputs:           T21:full, T22:col, T23:col
//
// OuterSchedule
//   scheduler          outer_persistent
//   reason             128-byte row segments: 256 rows x 64 columns per block, cluster of 16 per slab
//   hidden             16384
//   rows               4096
//   vec                8
//   slab               64
//   col_lanes          8
//   row_lanes          32
//   fold_rows          8
//   cluster            16
//   rank_rows          256
//   blocks_per_sm      2
//   streamed           False
//
// shared memory plan:
// buffer        bytes  offset  aligned  purpose
// s_T0          32768       0    32768  T0's rows of the slab (BFloat16): 256 x 64
// s_T3          32768   32768    32768  T3's rows of the slab (BFloat16): 256 x 64
// s_lanes0_f32   2048   65536     2048  sum(T5) over each warp's rows, level by level: 8 x 64
// s_lanes1_f32   2048   67584     2048  sum(T10) over each warp's rows, level by level: 8 x 64
// s_inbox_T9     8192   69632     8192  T9: the cluster's partials per column, pushed here by each block: 16 x 64
// s_inbox_T11    8192   77824     8192  T11: the cluster's partials per column, pushed here by each block: 16 x 64
// s_total0_f64    512   86016      512  T9: the slab's totals per column, level by level
// s_total1_f64    512   86528      512  T11: the slab's totals per column, level by level
// s_level_bars      8   87040      128  one mbarrier per level (1): the inboxes' rows have arrived
// static slot     128  static      128  static __shared__ (magic zero)
// total 87296 B = dynamic 87168 + static 128; limit 232448 B; headroom 145152 B; alignment 128 B

#include "fuser_columns.cuh"

// Each slab of 64 columns is kept on chip: a cluster of 16 blocks shares each slab's rows, block k the k-th share (at
// most 256 rows) in shared memory, copied once.
// Thread (x, y) owns columns x * 8 to x * 8 + 7 of the slab and rows y, y + 32, ... of its block; each level's column
// totals are folded over the block's rows, then over the cluster's blocks in rank order.
extern "C" __global__ void __cluster_dims__(16, 1, 1) __launch_bounds__(256, 2)
batchnorm_bwd_outer(
    const __nv_bfloat16* __restrict__ g_T0,
    const __nv_bfloat16* __restrict__ g_T3,
    const float* __restrict__ g_T1,
    const float* __restrict__ g_T2,
    const __nv_bfloat16* __restrict__ g_T4,
    __nv_bfloat16* __restrict__ g_T21,
    __nv_bfloat16* __restrict__ g_T22,
    __nv_bfloat16* __restrict__ g_T23,
    long long n_rows)
{
  constexpr int H = 16384;  // columns
  // H, VEC, LANES (threads across the slab), ROW_LANES (threads down its rows), GROUPS (rows of
  // the fold buffers), CLUSTER
  using Slab = fm::ColumnSlab<H, 8, 8, 32, 8, 16>;
  constexpr int VEC = Slab::VEC;
  const Slab slab(n_rows);
  const int zero = fm::magic_zero();

  // Shared memory, as planned (each buffer 128-byte aligned; the static slot is separate).
  extern __shared__ __align__(128) unsigned char smem[];
  // T0's rows of the slab (BFloat16): 256 x 64
  __nv_bfloat16* const s_T0 = reinterpret_cast<__nv_bfloat16*>(smem);
  // T3's rows of the slab (BFloat16): 256 x 64
  __nv_bfloat16* const s_T3 = reinterpret_cast<__nv_bfloat16*>(smem + 32768);
  // sum(T5) over each warp's rows, level by level: 8 x 64
  float* const s_lanes0_f32 = reinterpret_cast<float*>(smem + 65536);
  // sum(T10) over each warp's rows, level by level: 8 x 64
  float* const s_lanes1_f32 = reinterpret_cast<float*>(smem + 67584);
  // T9: the cluster's partials per column, pushed here by each block: 16 x 64
  double* const s_inbox_T9 = reinterpret_cast<double*>(smem + 69632);
  // T11: the cluster's partials per column, pushed here by each block: 16 x 64
  double* const s_inbox_T11 = reinterpret_cast<double*>(smem + 77824);
  // T9: the slab's totals per column, level by level
  double* const s_total0_f64 = reinterpret_cast<double*>(smem + 86016);
  // T11: the slab's totals per column, level by level
  double* const s_total1_f64 = reinterpret_cast<double*>(smem + 86528);
  // one mbarrier per level (1): the inboxes' rows have arrived
  unsigned long long* const s_level_bars = reinterpret_cast<unsigned long long*>(smem + 87040);
  const long long S12 = n_rows;

  // Each level's mbarrier expects the cluster's pushes into this block's inboxes; the cluster
  // barrier's first half tells the peers they may push (its second half comes before the first push).
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    fm::mbarrier_init(&s_level_bars[0], 1);
    fm::fence_mbarrier_init();
    fm::mbarrier_expect_tx(&s_level_bars[0], 16384);
  }
  fm::cluster_arrive_relaxed();

  // The block's rows of the slab, copied once: each thread copies the vectors it reads.
  slab.fill(s_T0, g_T0);
  slab.fill(s_T3, g_T3);
  fm::cp_async_commit();
  fm::Vec<float, VEC> c_T1{};
  if (slab.owns) c_T1 = fm::load_pieces<VEC>(g_T1 + slab.col);
  fm::Vec<float, VEC> c_T2{};
  if (slab.owns) c_T2 = fm::load_pieces<VEC>(g_T2 + slab.col);
  fm::Vec<__nv_bfloat16, VEC> c_T4{};
  if (slab.owns) c_T4 = fm::load_pieces<VEC>(g_T4 + slab.col);
  fm::cp_async_wait<0>();  // this thread's copies, the rows it reads, have landed

  // Outer level 0: sum(T5) -> T9, sum(T10) -> T11, over every row of the slab.
  float acc_T9[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc_T9[i] = fm::Sum::identity<float>();
  float acc_T11[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc_T11[i] = fm::Sum::identity<float>();
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
      const auto x_T3 = slab.at(s_T3, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T5 = fm::element(x_T3, i);
        const float e_T6 = fm::element(x_T0, i);
        const float e_T7 = (e_T6 - fm::element(c_T1, i));
        const float e_T8 = (e_T7 * fm::element(c_T2, i));
        const float e_T10 = (e_T5 * e_T8);
        acc_T9[i] = fm::Sum{}(acc_T9[i], e_T5);
        acc_T11[i] = fm::Sum{}(acc_T11[i], e_T10);
      }
    }
  }
  slab.put(s_lanes0_f32, acc_T9, fm::Sum{});
  slab.put(s_lanes1_f32, acc_T11, fm::Sum{});
  __syncthreads();  // every warp's partials are in the lanes buffers
  fm::cluster_wait();  // every block's mbarriers are ready for the pushes
  slab.fold_groups(s_lanes0_f32, s_inbox_T9, fm::Sum{}, &s_level_bars[0]);
  slab.fold_groups(s_lanes1_f32, s_inbox_T11, fm::Sum{}, &s_level_bars[0]);
  fm::mbarrier_wait(&s_level_bars[0], 0);  // every block's partials are in the inboxes
  slab.fold_blocks(s_inbox_T9, s_total0_f64, fm::Sum{});
  slab.fold_blocks(s_inbox_T11, s_total1_f64, fm::Sum{});
  fm::cluster_arrive_relaxed();  // nothing more will be pushed to this block
  __syncthreads();  // the slab's totals are complete
  float r_T9[VEC];
  slab.get(s_total0_f64, r_T9);
  float r_T11[VEC];
  slab.get(s_total1_f64, r_T11);

  // Outputs, from the rows still in shared memory.
  float k_T13[VEC];
  float k_T15[VEC];
  float k_T19[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float col_T13 = (r_T9[i] / static_cast<float>(S12));
    const float col_T15 = (r_T11[i] / static_cast<float>(S12));
    const float col_T18 = fm::element(c_T4, i);
    const float col_T19 = (col_T18 * fm::element(c_T2, i));
    k_T13[i] = col_T13;
    k_T15[i] = col_T15;
    k_T19[i] = col_T19;
  }
  if (slab.owns) {
    for (int r = slab.ty + zero; r < slab.rows; r += Slab::ROW_LANES) {
      const auto x_T0 = slab.at(s_T0, r);
      const auto x_T3 = slab.at(s_T3, r);
      fm::Vec<__nv_bfloat16, VEC> o_T21;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float e_T5 = fm::element(x_T3, i);
        const float e_T6 = fm::element(x_T0, i);
        const float e_T7 = (e_T6 - fm::element(c_T1, i));
        const float e_T8 = (e_T7 * fm::element(c_T2, i));
        const float e_T14 = (e_T5 - k_T13[i]);
        const float e_T16 = (e_T8 * k_T15[i]);
        const float e_T17 = (e_T14 - e_T16);
        const float e_T20 = (k_T19[i] * e_T17);
        o_T21.v[i] = fm::to_storage<__nv_bfloat16>(e_T20);
      }
      const long long at = (slab.row0 + r) * H + slab.col;
      fm::store<VEC>(g_T21 + at, o_T21);
    }
  }
  if (slab.owns && slab.rank == 0 && slab.ty == 0) {  // the column outputs, once per slab
    fm::Vec<__nv_bfloat16, VEC> o_T22;
    fm::Vec<__nv_bfloat16, VEC> o_T23;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o_T22.v[i] = fm::to_storage<__nv_bfloat16>(r_T11[i]);
      o_T23.v[i] = fm::to_storage<__nv_bfloat16>(r_T9[i]);
    }
    fm::store_pieces<VEC>(g_T22 + slab.col, o_T22);
    fm::store_pieces<VEC>(g_T23 + slab.col, o_T23);
  }
  fm::cluster_wait();  // no block leaves while its pushes may still be on their way to a peer
}
