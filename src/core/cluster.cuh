// Thread-block cluster primitives (sm_90), for the kernels that combine
// split-K partials across a cluster: the barrier halves, which every thread
// of every CTA of the cluster executes (.aligned), and a store into a peer
// CTA's shared memory (distributed shared memory), which any thread may do.
#pragma once

#include <cstdint>

namespace dsa {

// Arrives without ordering this thread's earlier memory accesses: "this CTA
// has started" (a peer may then store into its shared memory).
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;"); }
// Arrives and releases this thread's earlier memory accesses to the cluster.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
// Waits for every thread of the cluster to arrive; acquires what they released.
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// The address in the shared memory of the cluster's CTA `rank` that
// `address` (this CTA's shared memory) has in this CTA.
__device__ __forceinline__ uint32_t cluster_map(uint32_t address, int rank) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(mapped) : "r"(address), "r"(rank));
  return mapped;
}
// Stores into a cluster peer's shared memory (an address from cluster_map).
__device__ __forceinline__ void cluster_store(uint32_t mapped, float value) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(mapped), "f"(value) : "memory");
}

}  // namespace dsa
