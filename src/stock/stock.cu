// The stock path's kernels (see include/dsa_decode/stock.h).
#include <algorithm>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/stock.h"

namespace dsa {
namespace {

// One thread per 8 values.
__global__ void static_fp8_quant_kernel(const uint4* in, uint2* out, int64_t groups, const float* scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  const float inverse = num::div_rn(1.0f, *scale);
  const uint4 v = in[i];
  const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
  uint32_t packed[2] = {0, 0};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float value = num::bf16_to_float(static_cast<uint16_t>(pairs[k / 2] >> (16 * (k & 1))));
    packed[k / 4] |= static_cast<uint32_t>(num::quant_fp8_static(value, inverse)) << (8 * (k % 4));
  }
  out[i] = make_uint2(packed[0], packed[1]);
}

// CTA t writes token t's latent row; one thread per 8 values.
__global__ void concat_and_cache_mla_kernel(const uint16_t* kv, int64_t kv_token_stride, int width, uint8_t* cache,
                                            int64_t block_stride, int64_t entry_stride, int block_size,
                                            int64_t capacity, const int64_t* slots, const float* k_scale,
                                            unsigned int* error_count) {
  const int t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  if (slot >= capacity) {
    if (threadIdx.x == 0 && error_count != nullptr) atomicAdd(error_count, 1u);
    return;
  }
  const float scale = *k_scale;
  uint8_t* entry = cache + slot / block_size * block_stride + slot % block_size * entry_stride;
  for (int i = threadIdx.x; i < width; i += blockDim.x) entry[i] = num::cache_fp8(kv[t * kv_token_stride + i], scale);
}

}  // namespace

Status cublas_head_bmm(cublasHandle_t handle, const TensorView& x, const TensorView& weight, const TensorView& out) {
  DSA_RETURN_IF_ERROR(check_dtype(x, "x", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(x, "x", {-1, -1, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(x, "x"));
  const int64_t m = x.size(0), heads = x.size(1), rows = x.size(2);
  DSA_RETURN_IF_ERROR(check_stride(x, "x", 2, 1));
  DSA_RETURN_IF_ERROR(check_stride(x, "x", 1, rows));
  DSA_RETURN_IF_ERROR(check_dtype(weight, "weight", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(weight, "weight", {heads, rows, -1}));
  DSA_RETURN_IF_ERROR(check_stride(weight, "weight", 2, 1));
  const int64_t cols = weight.size(2);
  DSA_RETURN_IF_ERROR(check_on_cuda(weight, "weight"));
  DSA_RETURN_IF_ERROR(check_dtype(out, "out", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(out, "out", {m, heads, cols}));
  DSA_RETURN_IF_ERROR(check_on_cuda(out, "out"));
  if (!out.is_contiguous()) return invalid_argument("out", "a contiguous tensor", out.describe());
  // cuBLAS wants a leading dimension of at least the row even where it steps
  // no further: a single token or weight row is given its contiguous stride,
  // whatever the view's (never used) one.
  const int64_t x_token_stride = m > 1 ? x.stride(0) : heads * rows;
  const int64_t weight_row_stride = rows > 1 ? weight.stride(1) : cols;
  const int64_t weight_head_stride = heads > 1 ? weight.stride(0) : rows * weight_row_stride;
  // cuBLAS takes int sizes and leading dimensions.
  constexpr int64_t kIntMax = (int64_t{1} << 31) - 1;
  if (m < 1 || heads < 1 || rows < 1 || cols < 1 || heads * cols > kIntMax || x_token_stride > kIntMax ||
      weight_row_stride > kIntMax) {
    return invalid_argument("x, weight", "sizes >= 1 and H*J, x's token stride and weight's row stride < 2^31",
                            x.describe() + ", " + weight.describe());
  }
  DSA_RETURN_IF_ERROR(check_no_overlap(out, "out", x, "x"));
  DSA_RETURN_IF_ERROR(check_no_overlap(out, "out", weight, "weight"));
  // alpha and beta are host values: the handle must be in CUBLAS_POINTER_MODE_HOST (the default).
  // Column-major view per head h: out_h^T [J, m] = W_h^T [J, I] * x_h^T [I, m].
  const float alpha = 1.0f, beta = 0.0f;
  DSA_CUBLAS_RETURN(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(cols), static_cast<int>(m), static_cast<int>(rows), &alpha,
      weight.data, CUDA_R_16BF, static_cast<int>(weight_row_stride), weight_head_stride, x.data, CUDA_R_16BF,
      static_cast<int>(x_token_stride), rows, &beta, out.data, CUDA_R_16BF, static_cast<int>(heads * cols), cols,
      static_cast<int>(heads), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return Status();
}

Status stock_static_fp8_quant(const TensorView& in, const TensorView& out, const TensorView& scale,
                              cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_dtype(in, "in", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_on_cuda(in, "in"));
  DSA_RETURN_IF_ERROR(check_dtype(out, "out", DType::kFP8E4M3));
  DSA_RETURN_IF_ERROR(check_on_cuda(out, "out"));
  DSA_RETURN_IF_ERROR(check_dtype(scale, "scale", DType::kF32));
  DSA_RETURN_IF_ERROR(check_shape(scale, "scale", {1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(scale, "scale"));
  DSA_RETURN_IF_ERROR(check_aligned(scale, "scale", 4));
  if (!in.is_contiguous() || in.numel() % 8 != 0) {
    return invalid_argument("in", "a contiguous tensor of a multiple of 8 elements", in.describe());
  }
  bool same_shape = in.ndim == out.ndim;
  for (int d = 0; same_shape && d < in.ndim; ++d) same_shape = in.size(d) == out.size(d);
  if (!same_shape || !out.is_contiguous()) {
    return invalid_argument("out", "a contiguous tensor of in's shape " + in.describe(), out.describe());
  }
  DSA_RETURN_IF_ERROR(check_no_overlap(out, "out", in, "in"));
  DSA_RETURN_IF_ERROR(check_aligned(in, "in", 16));
  DSA_RETURN_IF_ERROR(check_aligned(out, "out", 8));
  const int64_t groups = in.numel() / 8;
  if (groups == 0) return Status();
  const int threads = 256;
  static_fp8_quant_kernel<<<static_cast<unsigned>((groups + threads - 1) / threads), threads, 0, stream>>>(
      static_cast<const uint4*>(in.data), static_cast<uint2*>(out.data), groups, static_cast<const float*>(scale.data));
  DSA_CUDA_RETURN(cudaGetLastError());
  return Status();
}

Status stock_concat_and_cache_mla(const KvCacheWrite& w, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_present(w.kv, "cache.kv"));
  DSA_RETURN_IF_ERROR(check_kv_cache_write(w, w.kv.ndim == 2 ? w.kv.size(0) : -1));
  const int64_t width = w.kv.size(1);
  const int64_t tokens = std::min(w.kv.size(0), w.slot_mapping.size(0));
  if (tokens == 0) return Status();
  concat_and_cache_mla_kernel<<<static_cast<unsigned>(tokens), 128, 0, stream>>>(
      static_cast<const uint16_t*>(w.kv.data), w.kv.stride(0), static_cast<int>(width),
      static_cast<uint8_t*>(w.cache.data), w.cache.stride(0), w.cache.stride(1), static_cast<int>(w.cache.size(1)),
      w.cache.size(0) * w.cache.size(1), static_cast<const int64_t*>(w.slot_mapping.data),
      static_cast<const float*>(w.k_scale.data), w.error_count);
  DSA_CUDA_RETURN(cudaGetLastError());
  return Status();
}

}  // namespace dsa
