#include "linear/linear_reference.h"

#include <algorithm>
#include <cmath>

#include "dsa_decode/numerics.h"

namespace dsa::reference {

float gemv_sum(const uint16_t* input, const uint16_t* weight, int64_t k) {
  constexpr int kLanes = 32, kLaneColumns = 8;
  float lane_sums[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) {
    float sum = 0.0f;
    for (int64_t first = lane * kLaneColumns; first < k; first += kLanes * kLaneColumns) {
      for (int i = 0; i < kLaneColumns; ++i) {
        sum = std::fma(num::bf16_to_float(input[first + i]), num::bf16_to_float(weight[first + i]), sum);
      }
    }
    lane_sums[lane] = sum;
  }
  for (int distance = 1; distance < kLanes; distance *= 2) {
    float next[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) next[lane] = lane_sums[lane] + lane_sums[lane ^ distance];
    std::copy(next, next + kLanes, lane_sums);
  }
  return lane_sums[0];
}

std::vector<uint16_t> linear_gemv(const std::vector<uint16_t>& x, int64_t m, int64_t k,
                                  const std::vector<uint16_t>& weight, int64_t n) {
  std::vector<uint16_t> out(size_t(m * n));
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < n; ++j) {
      out[size_t(t * n + j)] = num::float_to_bf16(gemv_sum(&x[size_t(t * k)], &weight[size_t(j * k)], k));
    }
  }
  return out;
}

}  // namespace dsa::reference
