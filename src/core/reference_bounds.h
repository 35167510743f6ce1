// Pieces of the host references' error bounds (head_gemv, rope): the ends of
// an interval in float without narrowing it, and codes in value order, so
// that a kernel's output can be checked to lie within a bound of the exact
// result counted in representable values.
#pragma once

#include <cmath>
#include <cstdint>

namespace dsa::reference {

// The largest float <= v, and the smallest float >= v.
inline float float_below(double v) {
  float f = static_cast<float>(v);
  return static_cast<double>(f) > v ? std::nextafter(f, -INFINITY) : f;
}
inline float float_above(double v) {
  float f = static_cast<float>(v);
  return static_cast<double>(f) < v ? std::nextafter(f, INFINITY) : f;
}

// Codes in value order (sign-magnitude: +0 and -0 are 0 apart).
inline int ordered_bf16(uint16_t v) { return (v & 0x8000) ? -static_cast<int>(v & 0x7FFF) : static_cast<int>(v); }
inline int ordered_fp8(uint8_t v) { return (v & 0x80) ? -static_cast<int>(v & 0x7F) : static_cast<int>(v); }

}  // namespace dsa::reference
