#include "support.h"

#include "dsa_decode/numerics.h"

namespace dsa::testing {

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
