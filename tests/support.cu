#include "support.h"

#include "core/launch.cuh"
#include "dsa_decode/numerics.h"

namespace dsa::testing {

namespace {
__global__ void late_writer_kernel(const uint4* first_source, uint4* first, int first_vectors,
                                   const uint4* second_source, uint4* second, int second_vectors,
                                   long long spin_cycles) {
  pdl_release_dependents();
  if (threadIdx.x == 0) {
    const long long start = clock64();
    while (clock64() - start < spin_cycles) {
    }
  }
  __syncthreads();
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < first_vectors; i += stride) first[i] = first_source[i];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < second_vectors; i += stride) second[i] = second_source[i];
}
}  // namespace

cudaError_t launch_late_writer(const void* first_source, void* first, int first_vectors, const void* second_source,
                               void* second, int second_vectors, long long spin_cycles, int ctas, int threads,
                               cudaStream_t stream) {
  late_writer_kernel<<<ctas, threads, 0, stream>>>(static_cast<const uint4*>(first_source), static_cast<uint4*>(first),
                                                   first_vectors, static_cast<const uint4*>(second_source),
                                                   static_cast<uint4*>(second), second_vectors, spin_cycles);
  return cudaGetLastError();
}

namespace {
struct GpuProbe {
  bool available = false;
  std::string reason;
  GpuProbe() {
    int count = 0;
    cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess || count == 0) {
      reason = std::string("no CUDA device (cudaGetDeviceCount: ") +
               (error == cudaSuccess ? "0 devices" : cudaGetErrorString(error)) + ")";
      cudaGetLastError();
      return;
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    if (prop.major != 9 || prop.minor != 0) {
      reason = std::string("device 0 (") + prop.name + ") is sm_" + std::to_string(prop.major * 10 + prop.minor) +
               "; the kernels are built for sm_90a only";
      return;
    }
    available = true;
  }
};
const GpuProbe& probe() {
  static const GpuProbe instance;
  return instance;
}
}  // namespace

bool gpu_available() { return probe().available; }
const std::string& gpu_skip_reason() { return probe().reason; }

bool quick_mode() {
  const char* value = std::getenv("DSA_TEST_QUICK");
  return value != nullptr && value[0] == '1';
}

uint64_t test_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* value = std::getenv("DSA_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(value, nullptr, 10));
    return static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}();
  }();
  return seed;
}

std::vector<uint16_t> random_bf16(size_t count, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<uint16_t> values(count);
  for (uint16_t& v : values) v = num::float_to_bf16(normal(rng));
  return values;
}

}  // namespace dsa::testing
