// core/launch.cuh: what every PDL launch of the library sets up.
#include <gtest/gtest.h>

#include "core/launch.cuh"
#include "support.h"

namespace dsa {
namespace {

__global__ void waiting_kernel(int* out) {
  pdl_wait();
  pdl_release_dependents();
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = 7;
}

// The carveout promise (core/shared_memory.h): after its first PDL launch a
// kernel prefers the largest shared-memory carveout, so that the stage's
// kernels on its two streams can share an SM.
TEST(LaunchGpu, PdlLaunchesPreferTheLargestSharedMemoryCarveout) {
  DSA_REQUIRE_GPU();
  int* out = nullptr;
  DSA_ASSERT_CUDA(cudaMalloc(&out, sizeof(int)));
  DSA_ASSERT_OK(launch_pdl(waiting_kernel, dim3(1), dim3(32), 0, nullptr, out));
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  int value = 0;
  DSA_ASSERT_CUDA(cudaMemcpy(&value, out, sizeof(int), cudaMemcpyDeviceToHost));
  cudaFree(out);
  EXPECT_EQ(value, 7);
  cudaFuncAttributes attributes{};
  DSA_ASSERT_CUDA(cudaFuncGetAttributes(&attributes, waiting_kernel));
  EXPECT_EQ(attributes.preferredShmemCarveout, int(cudaSharedmemCarveoutMaxShared));
}

}  // namespace
}  // namespace dsa
