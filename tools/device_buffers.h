// dsa-decode's GPU paths: a stream of their own and device buffers filled
// from host vectors (bench::DeviceMemory, freed with their owner).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/status.h"
#include "timing.h"

namespace dsa::cli {

// A stream of our own: graph capture cannot use the legacy default stream.
class OwnedStream {
 public:
  OwnedStream() = default;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Status create() {
    DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return Status();
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// `host` into a new allocation of `device` (at least 16 bytes, so an empty
// vector still gives an aligned, valid pointer), in stream order.
template <class T>
Status upload(const std::vector<T>& host, bench::DeviceMemory* device, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(device->allocate(std::max<size_t>(host.size() * sizeof(T), 16)));
  if (host.empty()) return Status();
  DSA_CUDA_RETURN(cudaMemcpyAsync(device->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  return Status();
}

// `bytes` of `device`, every byte set to `byte`, in stream order.
inline Status allocate_filled(size_t bytes, int byte, bench::DeviceMemory* device, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(device->allocate(bytes));
  DSA_CUDA_RETURN(cudaMemsetAsync(device->get(), byte, bytes, stream));
  return Status();
}

}  // namespace dsa::cli
