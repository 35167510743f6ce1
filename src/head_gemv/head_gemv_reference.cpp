#include "head_gemv/head_gemv_reference.h"

#include <algorithm>
#include <cmath>

#include "core/reference_bounds.h"
#include "dsa_decode/numerics.h"

namespace dsa::reference {

std::vector<float> head_gemv_sums(const HeadGemvHost& a, HeadGemvTactic tactic) {
  const int col_threads = tactic.tile / 8;
  const int groups_per_warp = 32 / col_threads;  // row groups one warp holds
  const int row_groups = a.rows / tactic.rows_per_thread;
  const int warps = row_groups / groups_per_warp;
  const size_t cols = static_cast<size_t>(a.cols);
  std::vector<float> sums(a.m * a.heads * cols);
  // [groups_per_warp][cols]: every column at once, so the weight rows stream in order.
  std::vector<float> group_sums(groups_per_warp * cols), next(groups_per_warp * cols);
  std::vector<float> w_row(cols);
  for (int t = 0; t < a.m; ++t) {
    for (int h = 0; h < a.heads; ++h) {
      const uint16_t* x = a.x + t * a.x_token_stride + static_cast<int64_t>(h) * a.rows;
      const uint16_t* w = a.weight + h * a.weight_head_stride;
      float* total = &sums[(static_cast<size_t>(t) * a.heads + h) * cols];
      std::fill(total, total + cols, 0.0f);
      for (int warp = 0; warp < warps; ++warp) {
        // 1. each row group's fused multiply-add chain, from 0
        std::fill(group_sums.begin(), group_sums.end(), 0.0f);
        for (int i = 0; i < groups_per_warp; ++i) {
          float* acc = &group_sums[i * cols];
          const int first_row = (warp * groups_per_warp + i) * tactic.rows_per_thread;
          for (int r = first_row; r < first_row + tactic.rows_per_thread; ++r) {
            const float xr = num::bf16_to_float(x[r]);
            for (size_t j = 0; j < cols; ++j) w_row[j] = num::bf16_to_float(w[r * a.weight_row_stride + j]);
            for (size_t j = 0; j < cols; ++j) acc[j] = std::fma(xr, w_row[j], acc[j]);
          }
        }
        // 2. the butterfly: at each level, row group i adds row group i ^ bit
        for (int bit = 1; bit < groups_per_warp; bit *= 2) {
          for (int i = 0; i < groups_per_warp; ++i) {
            for (size_t j = 0; j < cols; ++j) next[i * cols + j] = group_sums[i * cols + j] + group_sums[(i ^ bit) * cols + j];
          }
          group_sums.swap(next);
        }
        // 3. warps in order
        for (size_t j = 0; j < cols; ++j) total[j] += group_sums[j];
      }
    }
  }
  return sums;
}

std::vector<uint16_t> head_gemv_bf16(const HeadGemvHost& a, HeadGemvTactic tactic) {
  const std::vector<float> sums = head_gemv_sums(a, tactic);
  std::vector<uint16_t> out(sums.size());
  for (size_t i = 0; i < sums.size(); ++i) out[i] = num::float_to_bf16(sums[i]);
  return out;
}

std::vector<uint8_t> head_gemv_fp8(const HeadGemvHost& a, HeadGemvTactic tactic, float scale) {
  const std::vector<float> sums = head_gemv_sums(a, tactic);
  const float inverse = num::div_rn(1.0f, scale);
  std::vector<uint8_t> out(sums.size());
  for (size_t i = 0; i < sums.size(); ++i) out[i] = num::quant_fp8_static(num::round_bf16(sums[i]), inverse);
  return out;
}

HeadGemvDeviation head_gemv_deviation(const HeadGemvHost& a, const void* out, bool fp8, float scale) {
  const float inverse = num::div_rn(1.0f, scale);
  // The kernel's rounding of a total, as an ordered code.
  auto rounded = [&](float total) {
    return fp8 ? ordered_fp8(num::quant_fp8_static(num::round_bf16(total), inverse))
               : ordered_bf16(num::float_to_bf16(total));
  };
  HeadGemvDeviation deviation;
  std::vector<double> exact(a.cols), magnitude(a.cols);
  for (int t = 0; t < a.m; ++t) {
    for (int h = 0; h < a.heads; ++h) {
      const uint16_t* x = a.x + t * a.x_token_stride + static_cast<int64_t>(h) * a.rows;
      const uint16_t* w = a.weight + h * a.weight_head_stride;
      std::fill(exact.begin(), exact.end(), 0.0);
      std::fill(magnitude.begin(), magnitude.end(), 0.0);
      for (int r = 0; r < a.rows; ++r) {
        const double xr = num::bf16_to_float(x[r]);
        for (int j = 0; j < a.cols; ++j) {
          const double product = xr * num::bf16_to_float(w[r * a.weight_row_stride + j]);  // exact in double
          exact[j] += product;
          magnitude[j] += std::fabs(product);
        }
      }
      for (int j = 0; j < a.cols; ++j) {
        const size_t index = (static_cast<size_t>(t) * a.heads + h) * a.cols + j;
        const int got = fp8 ? ordered_fp8(static_cast<const uint8_t*>(out)[index])
                            : ordered_bf16(static_cast<const uint16_t*>(out)[index]);
        const double bound = std::ldexp(magnitude[j], -14);
        const int low = rounded(float_below(exact[j] - bound)), high = rounded(float_above(exact[j] + bound));
        const int nearest = rounded(static_cast<float>(exact[j]));
        deviation.outside += got < low || got > high;
        if (got != nearest) {
          ++deviation.differing;
          deviation.max_steps = std::max(deviation.max_steps, std::abs(got - nearest));
        }
        ++deviation.compared;
      }
    }
  }
  return deviation;
}

int cache_write(const uint16_t* kv, int64_t kv_token_stride, int m, int width, const int64_t* slots, int n_slots,
                float k_scale, uint8_t* cache, int64_t blocks, int block_size, int64_t block_stride,
                int64_t entry_stride) {
  int out_of_range = 0;
  for (int t = 0; t < m && t < n_slots; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    if (slot >= blocks * block_size) {
      ++out_of_range;
      continue;
    }
    uint8_t* entry = cache + slot / block_size * block_stride + slot % block_size * entry_stride;
    for (int i = 0; i < width; ++i) entry[i] = num::cache_fp8(kv[t * kv_token_stride + i], k_scale);
  }
  return out_of_range;
}

std::vector<uint8_t> static_fp8_quant(const std::vector<uint16_t>& values, float scale) {
  const float inverse = num::div_rn(1.0f, scale);
  std::vector<uint8_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = num::quant_fp8_static(num::bf16_to_float(values[i]), inverse);
  return out;
}

}  // namespace dsa::reference
