// Comparisons of BF16 / FP8 outputs and their fingerprints, for the checks
// and the printouts of both paths.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dsa::cli {

// How far apart two outputs of the same shape are, in steps of their format
// (adjacent representable values; +0 and -0 are the same point).
struct Difference {
  int64_t max_steps = 0;
  size_t differing = 0;    // elements whose bits differ
  size_t first_index = 0;  // of the first element that differs (when differing > 0)
};

Difference bf16_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b);
Difference fp8_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

// max |a - b| in BF16 ulps of max(|b|, rms(b)). Two FP32 sums of the same
// terms in different orders, each rounded to BF16, are at most 1 such ulp
// apart unless the sums differ by more than rounding noise: near zero, where
// plain ulps shrink, the order noise is measured against the values' scale.
double bf16_error_in_scale_ulps(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b);

// Elements whose bytes differ (every element when the sizes differ).
template <class T>
size_t differing(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t count = 0;
  for (size_t i = 0; i < a.size(); ++i) count += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return count;
}

// Values at +-448, the e4m3 limit the static quant clamps to.
size_t count_saturated_fp8(const std::vector<uint8_t>& codes);

// FNV-1a, 64 bits: a fingerprint of the output's bytes.
uint64_t fnv1a(const void* data, size_t bytes);
template <class T>
uint64_t fingerprint(const std::vector<T>& values) {
  return fnv1a(values.data(), values.size() * sizeof(T));
}

}  // namespace dsa::cli
