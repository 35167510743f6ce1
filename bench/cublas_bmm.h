// A cuBLAS handle for benchmarks and the program: bound to one stream with its
// workspace allocated up front, so products through it (dsa::cublas_head_bmm,
// include/dsa_decode/stock.h) can be captured in a CUDA graph.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "dsa_decode/status.h"
#include "harness.h"

namespace dsa::bench {

// A cuBLAS handle bound to one stream with a workspace allocated up front.
// cuBLAS would otherwise allocate its workspace on first use, which a CUDA
// graph capture cannot hold. Bind once: cublasSetStream resets the workspace
// to cuBLAS's own pool, so the handle must not be re-bound behind its back.
class CublasHandle {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's advice for Hopper

  CublasHandle() = default;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle();

  Status create(cudaStream_t stream, size_t workspace_bytes = kWorkspaceBytes);
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
  DeviceMemory workspace_;
};

}  // namespace dsa::bench
