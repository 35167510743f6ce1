// CUDA / cuBLAS return codes turned into Status, for library code and tests.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "dsa_decode/status.h"

namespace dsa {

Status cuda_status(cudaError_t error, const char* what);
Status cublas_status(cublasStatus_t error, const char* what);

}  // namespace dsa

// Evaluates a CUDA runtime call; returns a kCudaError Status naming the call.
#define DSA_CUDA_RETURN(call) DSA_RETURN_IF_ERROR(::dsa::cuda_status((call), #call))
#define DSA_CUBLAS_RETURN(call) DSA_RETURN_IF_ERROR(::dsa::cublas_status((call), #call))
