// The a-projection's two RMSNorms in one launch (vLLM's fused_q_kv_rmsnorm):
//   q_out[t]  = rmsnorm(qkv[t, 0 : q_size], q_weight)
//   kv_out[t] = rmsnorm(qkv[t, q_size : q_size + kv_size], kv_weight)
//   rmsnorm(x, g) = BF16((x * rsqrt(sum(x^2) / size + eps)) * g), FP32
// Within 1 BF16 ulp of the CPU reference (src/norm/norm_reference.h, the same
// summation order; rsqrt and the division are the hardware approximations
// Triton emits); deterministic and batch invariant. PDL: the weights are read
// before griddepcontrol.wait, everything else after it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kNormMaxSize = 8 * 1024;

// One launch's pointers and sizes, filled (and checked) by make_qkv_norm_params.
struct QkvNormParams {
  const void* qkv;        // [m, qkv_row_pitch] BF16: q part in columns [0, q_size),
                          //   kv part in [q_size, q_size + kv_size); 16-byte aligned
  const void* q_weight;   // [q_size] BF16 gamma of the q part
  const void* kv_weight;  // [kv_size] BF16 gamma of the kv part
  void* q_out;            // [m, q_size] BF16, contiguous; must not overlap qkv
  void* kv_out;           // [m, kv_size] BF16, contiguous; must not overlap qkv
  int64_t qkv_row_pitch;  // elements from one token's row of qkv to the next (any when m == 1)
  int m;                  // tokens
  int q_size;             // multiple of 8, kv_size <= q_size <= kNormMaxSize
  int kv_size;            // multiple of 8, >= 8
  float eps;              // finite, >= 0
};

// qkv [m, q_size + kv_size] BF16, dim 1 contiguous, row stride % 8 == 0 and
// >= the row (any when m == 1); weights and outputs contiguous; q_size,
// kv_size multiples of 8 with 8 <= kv_size <= q_size <= kNormMaxSize; eps
// finite, >= 0; all on CUDA, 16 B aligned. Errors name the argument.
Status make_qkv_norm_params(const TensorView& qkv,        // [m, q_size + kv_size] BF16
                            const TensorView& q_weight,   // [q_size] BF16
                            const TensorView& kv_weight,  // [kv_size] BF16
                            float eps,
                            const TensorView& q_out,   // [m, q_size] BF16
                            const TensorView& kv_out,  // [m, kv_size] BF16
                            QkvNormParams* params);

// PDL launch; re-checks sizes and pointers (integer tests only).
Status launch_qkv_norm(const QkvNormParams& params, cudaStream_t stream);

Status qkv_rmsnorm(const TensorView& qkv,        // [m, q_size + kv_size] BF16
                   const TensorView& q_weight,   // [q_size] BF16
                   const TensorView& kv_weight,  // [kv_size] BF16
                   float eps,
                   const TensorView& q_out,   // [m, q_size] BF16
                   const TensorView& kv_out,  // [m, kv_size] BF16
                   cudaStream_t stream);

}  // namespace dsa
