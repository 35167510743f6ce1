// nn.Linear products through cuBLASLt, for every GEMM the library issues
// itself (the indexer's projections, the stage's fused_qkv_a, q_b and o
// projections): row-major out[m, n] = in[m, k] x weight[n, k]^T, BF16 inputs,
// FP32 compute and scale (CUBLAS_COMPUTE_32F), the output written once from
// its FP32 sum (BF16 rounded to nearest even, or stored as FP32). The sums
// are cuBLASLt's: an order it does not specify, so results match a float64
// reference within a tolerance, not bit for bit; the same shape on the same
// device and library version gives the same bits on every call.
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

// A cuBLASLt handle, a workspace allocated once on the device current at
// create(), and the descriptors and algorithm of each shape (m, n, k, row
// strides, output type), chosen by cuBLASLt's heuristic on the first run or
// prepare of that shape and reused after (host memory). One stream at a
// time: every run uses the same workspace. Not thread-safe.
//
// CUDA graphs: a run is capturable once its shape has been prepared (host
// work only: descriptors and the heuristic, kept out of a capture). No PDL
// attribute is set on cuBLASLt's launches.
class LinearContext {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;  // cuBLAS's advice for Hopper

  LinearContext();  // holds nothing: create() makes a usable one
  ~LinearContext();
  LinearContext(LinearContext&&) noexcept;
  LinearContext& operator=(LinearContext&&) noexcept;

  // Replaces *context with a new handle and a workspace of workspace_bytes
  // (cudaMalloc: call it outside a graph capture).
  static Status create(LinearContext* context, size_t workspace_bytes = kDefaultWorkspaceBytes);
  bool created() const { return state_ != nullptr; }

  // out = input x weight^T. input [m, k] and weight [n, k] BF16, dim 1
  // contiguous, row strides of a multiple of 16 bytes, data 16-byte aligned
  // (the caller checks; cuBLASLt is told so); output [m, n] of output_type
  // (CUDA_R_16BF or CUDA_R_32F) with row stride output_stride elements. A
  // single row's stride is never used (any, as tensor.h's checks take it).
  // `what` names the product in errors.
  Status run(const char* what, const TensorView& input, const TensorView& weight, void* output, int64_t output_stride,
             cudaDataType_t output_type, cudaStream_t stream);
  // The same shape's plan without a launch, so that a later run may be captured.
  Status prepare(const char* what, const TensorView& input, const TensorView& weight, int64_t output_stride,
                 cudaDataType_t output_type);

 private:
  struct State;  // src/core/linear.cpp
  std::unique_ptr<State> state_;
};

}  // namespace dsa
