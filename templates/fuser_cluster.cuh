// fuser device helpers: thread-block clusters, programmatic dependent launch, magic zero.
#pragma once

namespace fm {

// ----- thread-block clusters (sm_90): rank, barrier, reads of a peer block's shared memory --
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
// visible to the peers' reads after it (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned peer_address(const void* local, unsigned rank) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(address), "r"(rank));
  return remote;
}
__device__ __forceinline__ float load_peer(const float* local, unsigned rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(peer_address(local, rank)));
  return v;
}
__device__ __forceinline__ double load_peer(const double* local, unsigned rank) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];\n" : "=d"(v) : "r"(peer_address(local, rank)));
  return v;
}
__device__ __forceinline__ int load_peer(const int* local, unsigned rank) {
  int v;
  asm volatile("ld.shared::cluster.s32 %0, [%1];\n" : "=r"(v) : "r"(peer_address(local, rank)));
  return v;
}
__device__ __forceinline__ long long load_peer(const long long* local, unsigned rank) {
  long long v;
  asm volatile("ld.shared::cluster.s64 %0, [%1];\n" : "=l"(v) : "r"(peer_address(local, rank)));
  return v;
}
__device__ __forceinline__ bool load_peer(const bool* local, unsigned rank) {
  unsigned short v;
  asm volatile("ld.shared::cluster.u8 %0, [%1];\n" : "=h"(v) : "r"(peer_address(local, rank)));
  return v != 0;
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
