// Thread-block cluster barrier halves (sm_90), for the kernels that combine
// split-K partials through distributed shared memory. Every thread of every
// CTA of the cluster executes them (.aligned).
#pragma once

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

}  // namespace dsa
