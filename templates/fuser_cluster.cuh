// fuser device helpers: thread-block clusters, programmatic dependent launch, magic zero.
#pragma once

namespace fm {

// ----- thread-block clusters (sm_90): rank, barriers, stores to a peer block's shared memory --
// Plain PTX, so that no cooperative_groups (and its CCCL headers) is needed under NVRTC.

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_index() {
  unsigned r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_count() {
  unsigned r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster arrives; shared-memory writes before it are
// visible to the peers' reads after it (release / acquire). The release is a GPU-wide memory
// fence (MEMBAR.ALL.GPU: it waits for the block's global stores too), so row loops exchange
// values with store_to_peer instead and this runs once, after the exchange's mbarriers are
// initialized.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The same barrier without ordering memory: no block of the cluster passes it before every
// block has arrived (so none exits while a peer's stores to it may still be on their way).
__device__ __forceinline__ void cluster_arrive_and_wait() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n"
               "barrier.cluster.wait.aligned;\n" ::: "memory");
}
// The same barrier in two halves, so that a block's work goes on between them: arrive says
// what this block had to do before its peers may go on is done (relaxed: it orders no memory
// by itself; an mbarrier's initialization is published by fence_mbarrier_init before it),
// wait returns once every block of the cluster has arrived (acquire, the default).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned peer_address(const void* local, unsigned rank) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(address), "r"(rank));
  return remote;
}
// Writes `value` to the block of rank `rank` at the address `local` has here, and counts
// its bytes off that block's mbarrier at `local_bar`'s address (st.async: the receiver's
// wait on the mbarrier's phase makes the value visible, no fence on either side).
__device__ __forceinline__ void store_to_peer(unsigned* local, unsigned value,
                                              unsigned long long* local_bar, unsigned rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n"
               ::"r"(peer_address(local, rank)), "r"(value), "r"(peer_address(local_bar, rank))
               : "memory");
}
__device__ __forceinline__ void store_to_peer(unsigned long long* local, unsigned long long value,
                                              unsigned long long* local_bar, unsigned rank) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];\n"
               ::"r"(peer_address(local, rank)), "l"(value), "r"(peer_address(local_bar, rank))
               : "memory");
}

// ----- programmatic dependent launch (sm_90): the finalize launches while the row kernel ends --
// The row kernel allows its dependent grid to launch as soon as it starts; the finalize, launched
// with programmatic stream serialization, waits here until the row kernel has finished and its
// writes are visible. Without that launch attribute (or before sm_90) both are no-ops.

__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ----- magic zero -----
// An int that is 0 at run time but that the compiler cannot prove is 0. Adding it to the row
// index keeps NVRTC from hoisting every unrolled address computation out of the row loop (and
// holding them all in registers). It lives in static shared memory: the 128-byte static slot
// that every SmemPlan reserves. Written with atomicMin, as nvFuser does, so it is not optimised
// away.
__device__ __forceinline__ int magic_zero() {
  __shared__ int fuser_zero_s;
  if (threadIdx.x == 0 && threadIdx.y == 0) fuser_zero_s = 0;
  __syncthreads();
  atomicMin(&fuser_zero_s, static_cast<int>(threadIdx.x));
  return fuser_zero_s;
}

}  // namespace fm
