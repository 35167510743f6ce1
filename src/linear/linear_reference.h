// CPU reference of linear_gemv (include/dsa_decode/linear.h), bit for bit:
// the same fixed order of every sum, which indexer_project_gemv shares.
#pragma once

#include <cstdint>
#include <vector>

namespace dsa::reference {

// One GEMV output before its rounding: the FP32 sum of input[i] * weight[i]
// over i < k (both [k] BF16 bits, k a multiple of 8) as the 32 lanes of a
// warp add it: lane l chains columns 8l..8l+7, 8l+256.. with fmaf from +0,
// then the xor butterfly over lane distances 1, 2, 4, 8, 16.
float gemv_sum(const uint16_t* input, const uint16_t* weight, int64_t k);

// out [m, n] BF16 bits = BF16(gemv_sum(x row t, weight row j)) for x [m, k]
// and weight [n, k] BF16 bits, all row-major and contiguous.
std::vector<uint16_t> linear_gemv(const std::vector<uint16_t>& x, int64_t m, int64_t k,
                                  const std::vector<uint16_t>& weight, int64_t n);

}  // namespace dsa::reference
