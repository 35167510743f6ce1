// CPU references of nn.Linear products out[t, j] = sum_i x[t, i] * weight[j, i]
// (x [m, k], weight [n, k], BF16 bits, row-major and contiguous):
// linear_gemv's fixed order bit for bit (include/dsa_decode/linear.h; the
// same order as indexer_project_gemv's), and the float64 truth that GEMMs in
// an unstated order (cuBLASLt) are held to within a tolerance.
#pragma once

#include <cstdint>
#include <vector>

namespace dsa::reference {

// One GEMV output before its rounding: the FP32 sum of input[i] * weight[i]
// over i < k (both [k] BF16 bits, k a multiple of 8) as the 32 lanes of a
// warp add it: lane l chains columns 8l..8l+7, 8l+256.. with fmaf from +0,
// then the xor butterfly over lane distances 1, 2, 4, 8, 16.
float gemv_sum(const uint16_t* input, const uint16_t* weight, int64_t k);

// gemv_sum of every (x row t, weight row j), [m, n].
std::vector<float> gemv_sums(const uint16_t* x, int64_t m, int64_t k, const uint16_t* weight, int64_t n);

// linear_gemv's outputs: those sums rounded to BF16 bits, [m, n].
std::vector<uint16_t> linear_gemv(const std::vector<uint16_t>& x, int64_t m, int64_t k,
                                  const std::vector<uint16_t>& weight, int64_t n);

// sum[t, j] = sum_i x[t, i] * weight[j, i] and magnitude[t, j] = sum_i
// |x[t, i] * weight[j, i]|, both [m, n], in double. A product of two BF16
// values is exact in double and k such products sum with an error below
// k * 2^-53 * magnitude, negligible next to any FP32 bound: the sums count
// as exact (the magnitude sizes the tolerance of an unstated order).
struct ExactProduct {
  std::vector<double> sum, magnitude;
};
ExactProduct exact_product(const uint16_t* x, int64_t m, int64_t k, const uint16_t* weight, int64_t n);

// ||got - want|| / ||want||: BF16 outputs (bits) against float64 truth, such
// as exact_product's sums. A size mismatch gives infinity and a NaN in `got`
// gives NaN, so both fail any bound.
double relative_frobenius(const std::vector<uint16_t>& got, const std::vector<double>& want);

}  // namespace dsa::reference
