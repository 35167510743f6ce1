// The stock decode path's separate kernels, as vLLM runs them between the
// top-k and the attention: the cuBLAS absorb bmm, the static FP8 query quant
// and the MLA KV-cache write; the stage's fallback. Same roundings as the
// fused kernels (numerics.h); plain launches, no PDL.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

// torch.bmm(x.transpose(0, 1), weight, out=out.transpose(0, 1)) through
// cublasGemmStridedBatchedEx (BF16 in and out, FP32 compute):
//   x [m, H, I] BF16 (token stride any, dims 1-2 contiguous), weight [H, I, J]
//   BF16 (J contiguous), out [m, H, J] BF16 contiguous. `handle` must be
//   bound to `stream` by the caller (with a workspace set, for graph capture).
Status cublas_head_bmm(cublasHandle_t handle, const TensorView& x, const TensorView& weight, const TensorView& out);

// static_scaled_fp8_quant: out = e4m3(clamp(in * (1 / scale[0]), +-448)).
//   in [n...] BF16 contiguous, out same shape FP8 contiguous, scale [1] f32.
Status stock_static_fp8_quant(const TensorView& in, const TensorView& out, const TensorView& scale,
                              cudaStream_t stream);

// concat_and_cache_mla (FP8 cache, NoPE): cache[slot] = e4m3(kv / k_scale);
// same skipping rules and arguments as head_gemv's fused write.
Status stock_concat_and_cache_mla(const KvCacheWrite& write, cudaStream_t stream);

}  // namespace dsa
