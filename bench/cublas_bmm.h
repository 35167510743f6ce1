// The stock path's per-head batched product, exactly as vLLM runs it through
// torch.bmm(x.transpose(0, 1), W, out=out.transpose(0, 1)): one
// cublasGemmStridedBatchedEx over the heads, BF16 in and out, FP32 compute.
// Benchmarks of the fused kernels time it as their baseline.
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

// out[t, h, j] = sum_i x[t, h, i] * w[h, i, j] for t < m, h < heads, as BF16.
//   x:   BF16, token t head h row i at t * x_token_stride + h * rows_I + i
//   w:   BF16, head h row i column j at h * w_head_stride + i * w_row_stride + j
//   out: BF16 [m, heads, cols_J], contiguous
// `handle` must already be bound to `stream` (CublasHandle::create); the
// call allocates nothing and synchronizes nothing, so it can be captured.
Status cublas_head_bmm(cublasHandle_t handle, const void* x, int64_t x_token_stride, const void* w,
                       int64_t w_head_stride, int64_t w_row_stride, void* out, int m, int heads, int rows_I,
                       int cols_J, cudaStream_t stream);

}  // namespace dsa::bench
