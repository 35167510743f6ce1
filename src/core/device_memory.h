// Device memory owned by the library's host objects (the stage's workspace,
// cuBLASLt workspaces): freed with cudaFree when its owner goes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <memory>

#include "dsa_decode/cuda_check.h"

namespace dsa {

struct CudaFree {
  void operator()(void* memory) const { cudaFree(memory); }
};
using DeviceMemory = std::unique_ptr<void, CudaFree>;

// cudaMalloc of `bytes` (at least 1, so that an empty buffer is still a
// distinct pointer) into *memory.
inline Status allocate_device(size_t bytes, DeviceMemory* memory) {
  void* data = nullptr;
  DSA_CUDA_RETURN(cudaMalloc(&data, std::max<size_t>(bytes, 1)));
  memory->reset(data);
  return Status();
}

}  // namespace dsa
