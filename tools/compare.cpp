#include "compare.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "dsa_decode/numerics.h"

namespace dsa::cli {

namespace {

// Position on the number line of a sign-magnitude code with `magnitude_bits`.
int64_t ordered(uint32_t code, int magnitude_bits) {
  const uint32_t magnitude = code & ((1u << magnitude_bits) - 1);
  return (code >> magnitude_bits) & 1u ? -int64_t{magnitude} : int64_t{magnitude};
}

template <class T>
Difference code_difference(const std::vector<T>& a, const std::vector<T>& b, int magnitude_bits) {
  Difference d;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    if (a[i] == b[i]) continue;
    if (d.differing++ == 0) d.first_index = i;
    d.max_steps = std::max(d.max_steps, std::abs(ordered(a[i], magnitude_bits) - ordered(b[i], magnitude_bits)));
  }
  return d;
}

// The spacing of BF16 values (8 significant bits) at |x| > 0.
double bf16_ulp(double x) {
  int exponent = 0;
  std::frexp(x, &exponent);  // x = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(1.0, exponent - 8);
}

}  // namespace

Difference bf16_difference(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  return code_difference(a, b, 15);
}

Difference fp8_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  return code_difference(a, b, 7);
}

double bf16_error_in_scale_ulps(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  double sum_squares = 0;
  for (size_t i = 0; i < n; ++i) sum_squares += std::pow(double{num::bf16_to_float(b[i])}, 2);
  const double rms = n > 0 ? std::sqrt(sum_squares / n) : 0.0;
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = num::bf16_to_float(a[i]), y = num::bf16_to_float(b[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;  // e.g. an output left unwritten (NaN)
    const double scale = std::max(std::fabs(y), rms);
    if (scale > 0) worst = std::max(worst, std::fabs(x - y) / bf16_ulp(scale));
  }
  return worst;
}

size_t count_saturated_fp8(const std::vector<uint8_t>& codes) {
  return static_cast<size_t>(std::count_if(codes.begin(), codes.end(), [](uint8_t c) { return (c & 0x7F) == 0x7E; }));
}

uint64_t fnv1a(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t hash = 0xCBF29CE484222325ull;
  for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001B3ull;
  return hash;
}

}  // namespace dsa::cli
