// Helpers shared by every test: GPU detection (GPU tests skip with a message
// when there is none), device buffers, reproducible random inputs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/status.h"

namespace dsa::testing {

// The producer of a PDL chain in the GPU tests (`ctas` x `threads` on
// `stream`, no PDL attribute of its own): it releases the kernel launched
// after it at once (griddepcontrol.launch_dependents before anything else),
// spins for about `spin_cycles` clocks, then copies `first_vectors` 16-byte
// vectors from `first_source` over `first` and `second_vectors` from
// `second_source` over `second` (a count of 0 copies nothing). A kernel after
// it that read `first` or `second` before its griddepcontrol.wait would see
// the old values. Returns the launch's error.
cudaError_t launch_late_writer(const void* first_source, void* first, int first_vectors, const void* second_source,
                               void* second, int second_vectors, long long spin_cycles, int ctas, int threads,
                               cudaStream_t stream);

// True when a CUDA device of compute capability 9.0 (the sm_90a build's target) is usable.
bool gpu_available();
// Why GPU tests are skipped, e.g. "no CUDA device (cudaGetDeviceCount: ...)".
const std::string& gpu_skip_reason();
// DSA_TEST_QUICK=1 (set by scripts/gpu-check under compute-sanitizer) trims sweeps.
bool quick_mode();
// A fresh seed per test run unless DSA_TEST_SEED is set; printed on failure.
uint64_t test_seed();

#define DSA_REQUIRE_GPU()                                                    \
  do {                                                                       \
    if (!::dsa::testing::gpu_available()) {                                  \
      GTEST_SKIP() << "GPU test skipped: " << ::dsa::testing::gpu_skip_reason(); \
    }                                                                        \
  } while (0)

#define DSA_ASSERT_OK(expr)                              \
  do {                                                   \
    ::dsa::Status s_ = (expr);                           \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.to_string(); \
  } while (0)

#define DSA_ASSERT_CUDA(expr) DSA_ASSERT_OK(::dsa::cuda_status((expr), #expr))

// The status is an invalid-argument error naming `argument` (quoted, as every
// check writes it) and holding `words`.
inline void expect_rejected(const Status& s, const std::string& argument, const std::string& words) {
  ASSERT_FALSE(s.ok()) << "expected an error naming '" << argument << "'";
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'" + argument + "'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(words), std::string::npos) << s.message();
}

// A failed CUDA call inside a test helper fails the running test (a sticky
// fault must not leave zeros behind that compare equal).
inline void expect_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) ADD_FAILURE() << what << ": " << cudaGetErrorString(error);
}

// Device memory owned by a test; copies in and out synchronously.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count == 0) return;
    if (cudaMalloc(&ptr_, count * sizeof(T)) != cudaSuccess) {
      ptr_ = nullptr;
      count_ = 0;
      ADD_FAILURE() << "cudaMalloc of " << count * sizeof(T) << " bytes failed";
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; o.count_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    return *this;
  }
  ~DeviceBuffer() { cudaFree(ptr_); }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    expect_cuda(cudaMemcpy(ptr_, host.data(), std::min(host.size(), count_) * sizeof(T), cudaMemcpyHostToDevice),
                "DeviceBuffer::upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    expect_cuda(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost), "DeviceBuffer::download");
    return host;
  }
  // Fills every byte with `byte` (poisoning outputs before a run); synchronous,
  // so work on any stream that follows sees the poison.
  void fill_bytes(uint8_t byte) {
    expect_cuda(cudaMemset(ptr_, byte, count_ * sizeof(T)), "DeviceBuffer::fill_bytes");
    expect_cuda(cudaDeviceSynchronize(), "DeviceBuffer::fill_bytes");
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// BF16 bit patterns of normal(0, stddev) samples.
std::vector<uint16_t> random_bf16(size_t count, float stddev, std::mt19937_64& rng);

// normal(mean, stddev) samples.
inline std::vector<float> normal_floats(size_t count, float mean, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// rows [count, width] -> [count, stride] with `fill` in each row's padding.
template <class T>
std::vector<T> pad_rows(const std::vector<T>& rows, int64_t width, int64_t stride, T fill) {
  const int64_t count = static_cast<int64_t>(rows.size()) / width;
  std::vector<T> padded(count * stride, fill);
  for (int64_t r = 0; r < count; ++r) std::copy_n(&rows[r * width], width, &padded[r * stride]);
  return padded;
}

}  // namespace dsa::testing
