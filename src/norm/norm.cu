// Both RMSNorms of the a-projection output in one launch. The contract (work
// split, summation order, roundings, PDL) is stated in include/dsa_decode/norm.h;
// src/norm/norm_reference.cpp is its CPU twin.
#include <climits>
#include <cmath>
#include <cstdio>
#include <string>

#include "core/bf16.cuh"
#include "core/launch.cuh"
#include "dsa_decode/norm.h"
#include "dsa_decode/numerics.h"

namespace dsa {
namespace {

constexpr int kValuesPerThread = 8;  // one 16-byte access of BF16
constexpr int kWarpSize = 32;
constexpr int kMaxThreads = kNormMaxSize / kValuesPerThread;
constexpr int kMaxWarps = kMaxThreads / kWarpSize;

int norm_threads(int q_size) {
  return (q_size / kValuesPerThread + kWarpSize - 1) / kWarpSize * kWarpSize;
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&values)[kValuesPerThread]) {
  uint32_t word[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    word[i] = static_cast<uint32_t>(num::float_to_bf16(values[2 * i])) |
              static_cast<uint32_t>(num::float_to_bf16(values[2 * i + 1])) << 16;
  }
  return make_uint4(word[0], word[1], word[2], word[3]);
}

// Grid (m, 2): CTA (t, 0) normalizes token t's q part, CTA (t, 1) its kv part.
__global__ void __launch_bounds__(kMaxThreads) qkv_rmsnorm_kernel(const __grid_constant__ QkvNormParams params) {
  __shared__ float warp_partials[kMaxWarps];
  const int token = blockIdx.x;
  const bool kv_part = blockIdx.y == 1;
  const int size = kv_part ? params.kv_size : params.q_size;
  const int column = threadIdx.x * kValuesPerThread;  // of this thread's first value in the part
  const bool active = column < size;

  // The weights do not depend on the previous kernel: load them before the wait.
  // They are read-only for the model's life, so the non-coherent path is safe.
  float gamma[kValuesPerThread] = {};
  if (active) {
    const auto* weight = static_cast<const uint16_t*>(kv_part ? params.kv_weight : params.q_weight);
    unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(weight + column)), gamma);
  }
  pdl_wait();
  // Dependents read our outputs only after their own wait, which waits for our completion.
  pdl_release_dependents();

  // qkv was written by the previous kernel: a plain (coherent) load.
  float x[kValuesPerThread] = {};
  if (active) {
    const auto* row = static_cast<const uint16_t*>(params.qkv) + static_cast<int64_t>(token) * params.qkv_row_pitch +
                      (kv_part ? params.q_size : 0);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(row + column), x);
  }

  // The fixed FP32 order: the thread's values, the lanes, the warps.
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kValuesPerThread; ++i) squares = fmaf(x[i], x[i], squares);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
  }
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) warp_partials[warp] = squares;
  __syncthreads();
  float total = 0.0f;
  const int warps = blockDim.x / kWarpSize;
  for (int w = 0; w < warps; ++w) total += warp_partials[w];
  const float rrms = num::rsqrt_approx(num::div_full(total, static_cast<float>(size)) + params.eps);

  if (active) {
    float y[kValuesPerThread];
    // Two rounded multiplies, as the stock kernel's x * rrms * gamma.
#pragma unroll
    for (int i = 0; i < kValuesPerThread; ++i) y[i] = __fmul_rn(__fmul_rn(x[i], rrms), gamma[i]);
    auto* out = static_cast<uint16_t*>(kv_part ? params.kv_out : params.q_out) + static_cast<int64_t>(token) * size;
    *reinterpret_cast<uint4*>(out + column) = pack_bf16x8(y);
  }
}

Status check_bf16_on_cuda(const TensorView& t, const char* name) {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, DType::kBF16));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  return check_aligned(t, name, 16);
}

Status check_contiguous(const TensorView& t, const char* name) {
  if (!t.is_contiguous()) return invalid_argument(name, "a contiguous tensor", t.describe());
  return Status();
}

// The scalar requirements, on 64-bit values so that a view's sizes are checked
// before they are narrowed into the params.
Status check_sizes(int64_t m, int64_t q_size, int64_t kv_size, int64_t pitch, float eps) {
  if (m < 1 || m > INT_MAX) {
    return invalid_argument("m (qkv.size(0))", "1 to " + std::to_string(INT_MAX) + " tokens", std::to_string(m));
  }
  if (kv_size < kValuesPerThread || kv_size % kValuesPerThread != 0) {
    return invalid_argument("kv_size (kv_weight.size(0))", "a positive multiple of 8", std::to_string(kv_size));
  }
  if (q_size % kValuesPerThread != 0 || q_size > kNormMaxSize) {
    return invalid_argument("q_size (q_weight.size(0))",
                            "a multiple of 8 of at most " + std::to_string(kNormMaxSize) + " (1024 threads)",
                            std::to_string(q_size));
  }
  if (q_size < kv_size) {
    return invalid_argument("q_size (q_weight.size(0))",
                            "at least kv_size = " + std::to_string(kv_size) + " (the kv CTA uses the q CTA's threads)",
                            std::to_string(q_size));
  }
  // The pitch only steps to rows 1..m-1: any for one token (tensor.h).
  if (m > 1 && (pitch % kValuesPerThread != 0 || pitch < q_size + kv_size)) {
    return invalid_argument("qkv_row_pitch (qkv.stride(0))",
                            "a multiple of 8 elements (16-byte rows) of at least q_size + kv_size = " +
                                std::to_string(q_size + kv_size),
                            std::to_string(pitch));
  }
  if (!std::isfinite(eps) || eps < 0.0f) {
    return invalid_argument("eps", "a finite value >= 0", std::to_string(eps));
  }
  return Status();
}

Status check_device_pointer(const void* pointer, const char* name) {
  if (pointer == nullptr) return invalid_argument(name, "a device pointer", "a null pointer");
  if (reinterpret_cast<uintptr_t>(pointer) % 16 != 0) {
    char address[32];
    std::snprintf(address, sizeof(address), "%p", pointer);
    return invalid_argument(name, "a 16-byte aligned pointer", address);
  }
  return Status();
}

}  // namespace

Status make_qkv_norm_params(const TensorView& qkv, const TensorView& q_weight, const TensorView& kv_weight, float eps,
                            const TensorView& q_out, const TensorView& kv_out, QkvNormParams* params) {
  DSA_RETURN_IF_ERROR(check_bf16_on_cuda(qkv, "qkv"));
  DSA_RETURN_IF_ERROR(check_bf16_on_cuda(q_weight, "q_weight"));
  DSA_RETURN_IF_ERROR(check_bf16_on_cuda(kv_weight, "kv_weight"));
  DSA_RETURN_IF_ERROR(check_bf16_on_cuda(q_out, "q_out"));
  DSA_RETURN_IF_ERROR(check_bf16_on_cuda(kv_out, "kv_out"));

  DSA_RETURN_IF_ERROR(check_shape(q_weight, "q_weight", {-1}));
  DSA_RETURN_IF_ERROR(check_contiguous(q_weight, "q_weight"));
  DSA_RETURN_IF_ERROR(check_shape(kv_weight, "kv_weight", {-1}));
  DSA_RETURN_IF_ERROR(check_contiguous(kv_weight, "kv_weight"));
  const int64_t q_size = q_weight.size(0);
  const int64_t kv_size = kv_weight.size(0);

  DSA_RETURN_IF_ERROR(check_shape(qkv, "qkv", {-1, q_size + kv_size}));
  DSA_RETURN_IF_ERROR(check_stride(qkv, "qkv", 1, 1));
  const int64_t m = qkv.size(0);
  DSA_RETURN_IF_ERROR(check_sizes(m, q_size, kv_size, qkv.stride(0), eps));

  DSA_RETURN_IF_ERROR(check_shape(q_out, "q_out", {m, q_size}));
  DSA_RETURN_IF_ERROR(check_contiguous(q_out, "q_out"));
  DSA_RETURN_IF_ERROR(check_shape(kv_out, "kv_out", {m, kv_size}));
  DSA_RETURN_IF_ERROR(check_contiguous(kv_out, "kv_out"));
  // Outputs written while other CTAs still read qkv and the weights.
  for (const auto& [out, out_name] : {std::pair{&q_out, "q_out"}, {&kv_out, "kv_out"}}) {
    for (const auto& [in, in_name] : {std::pair{&qkv, "qkv"}, {&q_weight, "q_weight"}, {&kv_weight, "kv_weight"}}) {
      DSA_RETURN_IF_ERROR(check_no_overlap(*out, out_name, *in, in_name));
    }
  }
  DSA_RETURN_IF_ERROR(check_no_overlap(q_out, "q_out", kv_out, "kv_out"));

  params->qkv = qkv.data;
  params->q_weight = q_weight.data;
  params->kv_weight = kv_weight.data;
  params->q_out = q_out.data;
  params->kv_out = kv_out.data;
  params->qkv_row_pitch = qkv.stride(0);
  params->m = static_cast<int>(m);
  params->q_size = static_cast<int>(q_size);
  params->kv_size = static_cast<int>(kv_size);
  params->eps = eps;
  return Status();
}

Status launch_qkv_norm(const QkvNormParams& params, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sizes(params.m, params.q_size, params.kv_size, params.qkv_row_pitch, params.eps));
  DSA_RETURN_IF_ERROR(check_device_pointer(params.qkv, "qkv"));
  DSA_RETURN_IF_ERROR(check_device_pointer(params.q_weight, "q_weight"));
  DSA_RETURN_IF_ERROR(check_device_pointer(params.kv_weight, "kv_weight"));
  DSA_RETURN_IF_ERROR(check_device_pointer(params.q_out, "q_out"));
  DSA_RETURN_IF_ERROR(check_device_pointer(params.kv_out, "kv_out"));
  return launch_pdl(qkv_rmsnorm_kernel, dim3(params.m, 2), dim3(norm_threads(params.q_size)), 0, stream, params);
}

Status qkv_rmsnorm(const TensorView& qkv, const TensorView& q_weight, const TensorView& kv_weight, float eps,
                   const TensorView& q_out, const TensorView& kv_out, cudaStream_t stream) {
  QkvNormParams params;
  DSA_RETURN_IF_ERROR(make_qkv_norm_params(qkv, q_weight, kv_weight, eps, q_out, kv_out, &params));
  return launch_qkv_norm(params, stream);
}

}  // namespace dsa
