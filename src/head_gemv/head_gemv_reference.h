// CPU references of head_gemv and the fused cache write, in the kernel's exact
// summation order (they take the tactic) and with its roundings: GPU and CPU
// results are bitwise equal.
#pragma once

#include <cstdint>
#include <vector>

#include "dsa_decode/head_gemv.h"

namespace dsa::reference {

// Host copies in the kernel's layouts; strides in elements.
struct HeadGemvHost {
  const uint16_t* x;  // [m, H, I] BF16 bits, token stride x_token_stride
  int64_t x_token_stride;
  const uint16_t* weight;  // [H, I, J] BF16 bits
  int64_t weight_head_stride, weight_row_stride;
  int m, heads, rows, cols;
};

// FP32 totals [m, H, J] in the kernel's order for `tactic`.
std::vector<float> head_gemv_sums(const HeadGemvHost& a, HeadGemvTactic tactic);
// BF16 out [m, H, J].
std::vector<uint16_t> head_gemv_bf16(const HeadGemvHost& a, HeadGemvTactic tactic);
// FP8 out [m, H, J] statically quantized by `scale`.
std::vector<uint8_t> head_gemv_fp8(const HeadGemvHost& a, HeadGemvTactic tactic, float scale);

// HeadGemvSums::kTensorCores: where the GPU's outputs `out` [m, H, J] (BF16
// bits, or FP8 codes quantized by `scale`) lie against the contract. Each
// output must lie between the outputs of exact - bound and exact + bound,
// exact = sum_i x[i] w[i][j] in float64 and bound = 2^-14 sum_i |x[i] w[i][j]|
// (include/dsa_decode/head_gemv.h); both ends go through the same rounding as
// the kernel's total (BF16, or BF16 then the static FP8 quant), which is
// monotonic.
struct HeadGemvDeviation {
  int64_t outside = 0;    // outputs outside their interval
  int64_t differing = 0;  // outputs that differ from the rounding of the exact sum
  int max_steps = 0;      // their largest distance from it, in BF16 ulps or FP8 code steps
  int64_t compared = 0;
};
HeadGemvDeviation head_gemv_deviation(const HeadGemvHost& a, const void* out, bool fp8, float scale);

// concat_and_cache_mla into a host cache [blocks, block_size, width] with the
// given strides; returns the number of slots past the capacity (skipped).
int cache_write(const uint16_t* kv, int64_t kv_token_stride, int m, int width, const int64_t* slots, int n_slots,
                float k_scale, uint8_t* cache, int64_t blocks, int block_size, int64_t block_stride,
                int64_t entry_stride);

// The stock static FP8 quant of BF16 values.
std::vector<uint8_t> static_fp8_quant(const std::vector<uint16_t>& values, float scale);

}  // namespace dsa::reference
