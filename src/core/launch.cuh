// Kernel launches with programmatic dependent launch (PDL) and the two
// griddepcontrol instructions every kernel of the chain uses.
//
// A PDL kernel may start while its predecessor in the stream still runs: it
// loads what does not depend on the predecessor (weights), then waits. It
// releases its dependents once its own wait has passed (head_gemv before it,
// on request: HeadGemvArgs::release_dependents_early): a dependent still
// waits for this kernel's completion before reading its outputs, so the
// release only lets the dependent's prologue overlap this kernel.
//
// Every launch here asks for the largest shared-memory carveout, so that the
// library's kernels on the stage's two streams can share SMs
// (prefer_max_shared_carveout, core/shared_memory.h); cuBLAS's kernels and
// the stock kernels (launched with <<<>>>) keep the driver's choice.
//
// Two rules the chain relies on:
//  - before pdl_wait, read only what no kernel still in flight writes (weights
//    written at load time, never the outputs of earlier kernels of the step);
//  - every CTA calls pdl_wait before it exits, so that completion still
//    orders a kernel after all earlier ones in the stream, not only the last.
#pragma once

#include <cuda_runtime.h>

#include "core/shared_memory.h"
#include "dsa_decode/cuda_check.h"

namespace dsa {

// Blocks until the predecessor grid has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Lets the next kernel in the stream start its prologue.
__device__ __forceinline__ void pdl_release_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// cudaLaunchKernelEx with the programmatic-stream-serialization attribute
// and, when `extra` is not null, that attribute too.
template <class... KernelArgs, class... Args>
Status launch_pdl_with(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                       const cudaLaunchAttribute* extra, Args&&... args) {
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (extra != nullptr) attribute[1] = *extra;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = extra != nullptr ? 2 : 1;
  DSA_RETURN_IF_ERROR(prefer_max_shared_carveout(reinterpret_cast<const void*>(kernel)));
  DSA_CUDA_RETURN(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  return Status();
}

// With PDL and, when cluster_x > 0, thread-block clusters of cluster_x CTAs
// along x (grid.x must be a multiple of it; 1 still launches as clusters, of
// one CTA).
template <class... KernelArgs, class... Args>
Status launch_pdl_clustered(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                            cudaStream_t stream, unsigned cluster_x, Args&&... args) {
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_x;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  return launch_pdl_with(kernel, grid, block, shared_bytes, stream, cluster_x > 0 ? &cluster : nullptr,
                         std::forward<Args>(args)...);
}

// With PDL, cooperative: the launch fails unless all of its CTAs can be
// resident at once, so CTAs may wait for each other.
template <class... KernelArgs, class... Args>
Status launch_pdl_cooperative(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  return launch_pdl_with(kernel, grid, block, shared_bytes, stream, &cooperative, std::forward<Args>(args)...);
}

// With PDL alone.
template <class... KernelArgs, class... Args>
Status launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                  cudaStream_t stream, Args&&... args) {
  return launch_pdl_with(kernel, grid, block, shared_bytes, stream, nullptr, std::forward<Args>(args)...);
}

// cudaOccupancyMaxActiveClusters for `kernel` launched as grid x block with
// shared_bytes of dynamic shared memory in clusters of cluster_x CTAs along
// x: the clusters the device holds at once, into *clusters. The CUDA error
// is the caller's to judge (a part that cannot answer may mean 0 clusters).
template <class... KernelArgs>
cudaError_t occupancy_max_active_clusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                                          unsigned cluster_x, int* clusters) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster_x;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(clusters, kernel, &config);
}

}  // namespace dsa
