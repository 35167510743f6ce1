// The a-projection's two RMSNorms in one launch (vLLM's fused_q_kv_rmsnorm):
//
//   q_out[t]  = rmsnorm(qkv[t, 0 : q_size],                 q_weight)
//   kv_out[t] = rmsnorm(qkv[t, q_size : q_size + kv_size],  kv_weight)
//   rmsnorm(x, gamma) = x * rsqrt(sum(x^2) / size + eps) * gamma
//
// Kernel contract (src/norm/norm.cu; the CPU reference src/norm/norm_reference.h
// follows the same order):
//  - Work split: grid (m, 2). CTA (t, 0) owns row t of q_out, CTA (t, 1) row t
//    of kv_out; no other CTA touches them. Both use round_up(q_size / 8, 32)
//    threads; thread i owns the 8 consecutive values [8 i, 8 i + 8) of its part
//    (16-byte loads and stores). Threads with i >= size / 8 add zero and store
//    nothing. A token's result never depends on the other tokens of the batch.
//  - Summation order, in FP32: each thread's 8 squares in sequence as fused
//    multiply-adds from 0, then a butterfly across the 32 lanes of a warp (xor
//    16, 8, 4, 2, 1), then the warps' partials added in warp order from 0.
//  - rrms = rsqrt.approx(div.full(total, size) + eps); y = (x * rrms) * gamma as
//    two rounded FP32 multiplies; y rounded to BF16 to nearest even.
//    rsqrt.approx and div.full are the hardware approximations Triton emits,
//    so the result matches the CPU reference within 1 BF16 ulp (bitwise but
//    for a tiny fraction of values), and repeats bit for bit on the GPU.
//  - PDL: the weights are loaded before griddepcontrol.wait (they do not depend
//    on the previous kernel); dependents are released right after the wait.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

// The largest q_size: one thread per 8 values, at most 1024 threads per CTA.
inline constexpr int kNormMaxSize = 8 * 1024;

// Device pointers and sizes of one launch. Fill it with make_qkv_norm_params
// (which validates the tensors) once, then launch it any number of times.
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

// Validates the views and fills `params`. Requirements (each violation returns
// kInvalidArgument naming the argument, what it was and what was expected):
//   qkv       [m, q_size + kv_size] BF16, m >= 1, stride(1) == 1, stride(0) a
//             multiple of 8 and >= q_size + kv_size (a padded row pitch is
//             fine; any when m == 1)
//   q_weight  [q_size] BF16 contiguous;  kv_weight [kv_size] BF16 contiguous
//   q_out     [m, q_size] BF16 contiguous; kv_out [m, kv_size] BF16 contiguous
//   q_size and kv_size multiples of 8, 8 <= kv_size <= q_size <= kNormMaxSize;
//   eps finite and >= 0; every tensor on CUDA, data 16-byte aligned.
Status make_qkv_norm_params(const TensorView& qkv,        // [m, q_size + kv_size] BF16
                            const TensorView& q_weight,   // [q_size] BF16
                            const TensorView& kv_weight,  // [kv_size] BF16
                            float eps,
                            const TensorView& q_out,   // [m, q_size] BF16
                            const TensorView& kv_out,  // [m, kv_size] BF16
                            QkvNormParams* params);

// Enqueues the kernel on `stream` with programmatic dependent launch. Checks
// the params' sizes, pitch and pointers again (integer tests only, so the run
// path stays cheap) and returns the launch's CUDA status. Never synchronizes.
Status launch_qkv_norm(const QkvNormParams& params, cudaStream_t stream);

// make_qkv_norm_params then launch_qkv_norm.
Status qkv_rmsnorm(const TensorView& qkv,        // [m, q_size + kv_size] BF16
                   const TensorView& q_weight,   // [q_size] BF16
                   const TensorView& kv_weight,  // [kv_size] BF16
                   float eps,
                   const TensorView& q_out,   // [m, q_size] BF16
                   const TensorView& kv_out,  // [m, kv_size] BF16
                   cudaStream_t stream);

}  // namespace dsa
