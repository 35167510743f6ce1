// CPU reference of the fused q/kv RMSNorm (include/dsa_decode/norm.h): the
// kernel's FP32 summation order step for step, with the host versions of
// rsqrt.approx and div.full (exactly rounded). It matches the GPU within 1 BF16
// ulp; given the GPU's rrms (norm_apply_rrms) it matches bit for bit.
// BF16 values are held as their 16-bit patterns.
#pragma once

#include <cstdint>

namespace dsa::reference {

// The kernel's sum of squares of one part: per 8-value thread group a chain of
// fused multiply-adds, a butterfly over each warp's 32 lanes, the warps' sums in
// warp order. size is a multiple of 8.
float norm_sum_of_squares(const uint16_t* x,  // [size] BF16
                          int size);

// rrms = rsqrt(total / size + eps), host versions of the kernel's approximations.
float norm_rrms(float total, int size, float eps);

// y = (x * rrms) * gamma, two rounded FP32 multiplies, rounded to BF16.
void norm_apply_rrms(const uint16_t* x,      // [size] BF16
                     const uint16_t* gamma,  // [size] BF16
                     int size, float rrms,
                     uint16_t* y);  // [size] BF16

// The whole launch: q_out[t] and kv_out[t] for every token t.
void qkv_rmsnorm(const uint16_t* qkv,  // [m, qkv_row_pitch] BF16; q part then kv part
                 int64_t qkv_row_pitch,
                 const uint16_t* q_weight,   // [q_size] BF16
                 const uint16_t* kv_weight,  // [kv_size] BF16
                 int m, int q_size, int kv_size, float eps,
                 uint16_t* q_out,    // [m, q_size] BF16
                 uint16_t* kv_out);  // [m, kv_size] BF16

// The float64 truth GEMM-fed norms are held to: `row` [size] (float64 sums
// of the a-projection) rounded to BF16 as the GPU's qkv is, then
// out = x * (sum(x^2) / size + eps)^-0.5 * gamma in double.
void rms_norm_exact(const double* row, int size, const uint16_t* gamma, float eps, double* out);

}  // namespace dsa::reference
