#include "dsa_decode/status.h"

#include "dsa_decode/cuda_check.h"

namespace dsa {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kCudaError: return "CUDA error";
    case ErrorCode::kCublasError: return "cuBLAS error";
    case ErrorCode::kNoDevice: return "no CUDA device";
  }
  return "unknown error";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(error_code_name(code_)) + ": " + message_;
}

Status invalid_argument(std::string_view name, std::string_view expected, std::string_view got) {
  std::string message = "argument '";
  message.append(name).append("': expected ").append(expected).append(", got ").append(got);
  return Status(ErrorCode::kInvalidArgument, std::move(message));
}

Status unsupported(std::string message) { return Status(ErrorCode::kUnsupported, std::move(message)); }

Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status();
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) {
    return Status(ErrorCode::kNoDevice, std::string(what) + ": " + cudaGetErrorString(error));
  }
  return Status(ErrorCode::kCudaError,
                std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
}

Status cublas_status(cublasStatus_t error, const char* what) {
  if (error == CUBLAS_STATUS_SUCCESS) return Status();
  return Status(ErrorCode::kCublasError, std::string(what) + ": " + cublasGetStatusName(error));
}

}  // namespace dsa
