#include "cublas_bmm.h"

#include <climits>
#include <string>

#include "dsa_decode/cuda_check.h"

namespace dsa::bench {

CublasHandle::~CublasHandle() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

Status CublasHandle::create(cudaStream_t stream, size_t workspace_bytes) {
  if (handle_ != nullptr) return invalid_argument("CublasHandle", "a handle not yet created", "a second create()");
  DSA_RETURN_IF_ERROR(workspace_.allocate(workspace_bytes));
  DSA_CUBLAS_RETURN(cublasCreate(&handle_));
  // Stream first: cublasSetStream resets the workspace to cuBLAS's own pool.
  DSA_CUBLAS_RETURN(cublasSetStream(handle_, stream));
  DSA_CUBLAS_RETURN(cublasSetWorkspace(handle_, workspace_.get(), workspace_.bytes()));
  return Status();
}

Status cublas_head_bmm(cublasHandle_t handle, const void* x, int64_t x_token_stride, const void* w,
                       int64_t w_head_stride, int64_t w_row_stride, void* out, int m, int heads, int rows_I,
                       int cols_J, cudaStream_t stream) {
  if (handle == nullptr) return invalid_argument("handle", "a created cuBLAS handle", "null");
  if (x == nullptr || w == nullptr || out == nullptr) {
    return invalid_argument("x, w, out", "device pointers", "a null pointer");
  }
  if (m < 1 || heads < 1 || rows_I < 1 || cols_J < 1) {
    return invalid_argument("m, heads, rows_I, cols_J", "all >= 1",
                            std::to_string(m) + ", " + std::to_string(heads) + ", " + std::to_string(rows_I) +
                                ", " + std::to_string(cols_J));
  }
  const int64_t out_token_stride = int64_t{heads} * cols_J;
  if (x_token_stride < int64_t{heads} * rows_I || x_token_stride > INT_MAX) {
    return invalid_argument("x_token_stride", "heads * rows_I <= stride <= INT_MAX", std::to_string(x_token_stride));
  }
  if (w_row_stride < cols_J || w_row_stride > INT_MAX) {
    return invalid_argument("w_row_stride", "cols_J <= stride <= INT_MAX", std::to_string(w_row_stride));
  }
  if (w_head_stride < rows_I * w_row_stride) {
    return invalid_argument("w_head_stride", ">= rows_I * w_row_stride", std::to_string(w_head_stride));
  }
  if (out_token_stride > INT_MAX) {
    return invalid_argument("heads * cols_J", "<= INT_MAX", std::to_string(out_token_stride));
  }
  // Re-binding would drop the explicit workspace (see CublasHandle), so a
  // handle bound elsewhere is the caller's mistake, not something to fix here.
  cudaStream_t bound = nullptr;
  DSA_CUBLAS_RETURN(cublasGetStream(handle, &bound));
  if (bound != stream) {
    return invalid_argument("stream", "the stream the cuBLAS handle is bound to (CublasHandle::create)",
                            "another stream");
  }

  // cuBLAS is column-major. Per head h the row-major product out_h = x_h W_h
  // is, transposed, out_h^T [J x m] = W_h^T [J x I] * x_h^T [I x m]: a
  // row-major matrix with row stride s is the column-major transpose with
  // leading dimension s, so no operand is transposed (what torch.bmm does for
  // these strides: ldc = H * J puts each head's columns into the [m, H, J] out).
  const float alpha = 1.0f;
  const float beta = 0.0f;
  DSA_CUBLAS_RETURN(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_N, /*m=*/cols_J, /*n=*/m, /*k=*/rows_I, &alpha,  //
      w, CUDA_R_16BF, static_cast<int>(w_row_stride), w_head_stride,                  //
      x, CUDA_R_16BF, static_cast<int>(x_token_stride), rows_I,                       //
      &beta, out, CUDA_R_16BF, static_cast<int>(out_token_stride), cols_J,            //
      heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status();
}

}  // namespace dsa::bench
