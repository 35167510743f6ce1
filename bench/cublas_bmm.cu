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


}  // namespace dsa::bench
