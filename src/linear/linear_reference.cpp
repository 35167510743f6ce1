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

std::vector<float> gemv_sums(const uint16_t* x, int64_t m, int64_t k, const uint16_t* weight, int64_t n) {
  std::vector<float> sums(size_t(m * n));
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < n; ++j) sums[size_t(t * n + j)] = gemv_sum(x + t * k, weight + j * k, k);
  }
  return sums;
}

std::vector<uint16_t> linear_gemv(const std::vector<uint16_t>& x, int64_t m, int64_t k,
                                  const std::vector<uint16_t>& weight, int64_t n) {
  const std::vector<float> sums = gemv_sums(x.data(), m, k, weight.data(), n);
  std::vector<uint16_t> out(sums.size());
  std::transform(sums.begin(), sums.end(), out.begin(), [](float sum) { return num::float_to_bf16(sum); });
  return out;
}

ExactProduct exact_product(const uint16_t* x, int64_t m, int64_t k, const uint16_t* weight, int64_t n) {
  ExactProduct out;
  out.sum.assign(size_t(m) * n, 0.0);
  out.magnitude.assign(size_t(m) * n, 0.0);
  std::vector<double> row(k);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t i = 0; i < k; ++i) row[i] = num::bf16_to_float(x[t * k + i]);
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* w = weight + j * k;
      double sum = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const double product = row[i] * num::bf16_to_float(w[i]);
        sum += product;
        magnitude += std::fabs(product);
      }
      out.sum[t * n + j] = sum;
      out.magnitude[t * n + j] = magnitude;
    }
  }
  return out;
}

double relative_frobenius(const std::vector<uint16_t>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double error = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = num::bf16_to_float(got[i]) - want[i];
    error += d * d;
    norm += want[i] * want[i];
  }
  return std::sqrt(error / norm);
}

}  // namespace dsa::reference
