// Tests of include/dsa_decode/numerics.h.
//
// CPU tests check the host formulations against independent ones written here
// from the formats' definitions (double arithmetic, nearest-value search over
// all E4M3 values, exact midpoint comparisons), never against the header's own
// bit tricks. GPU tests run the device paths (hardware instructions) on the
// same inputs and require the host's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "dsa_decode/numerics.h"
#include "support.h"

namespace dsa {
namespace {

using dsa::testing::DeviceBuffer;
using dsa::testing::quick_mode;
using dsa::testing::test_seed;

// ---------------------------------------------------------------------------
// Bits, formatting and mismatch reports

uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

float float_of(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

template <class T>
std::string hex(T value) {
  static_assert(std::is_unsigned_v<T>);
  char text[24];
  std::snprintf(text, sizeof text, "0x%0*llx", static_cast<int>(2 * sizeof(T)), static_cast<unsigned long long>(value));
  return text;
}

struct FloatPair {
  float numerator;
  float denominator;
};

std::string describe(float x) {
  std::ostringstream out;
  out << hex(bits_of(x)) << " (" << std::setprecision(9) << x << ")";
  return out.str();
}
std::string describe(uint16_t bf16_code) { return "bf16 " + hex(bf16_code); }
std::string describe(uint8_t e4m3_code) { return "e4m3 " + hex(e4m3_code); }
std::string describe(const FloatPair& pair) { return describe(pair.numerator) + " / " + describe(pair.denominator); }

// Counts disagreements and keeps the first few, so a broken helper fails with a
// short readable message rather than millions of lines.
class MismatchReport {
 public:
  template <class Input, class Bits>
  void check(const Input& input, Bits expected, Bits actual) {
    if (expected != actual) record(describe(input) + ": expected " + hex(expected) + ", got " + hex(actual));
  }
  void record(const std::string& line) {
    if (count_ < kShown) examples_ += "  " + line + "\n";
    ++count_;
  }
  ::testing::AssertionResult result(const std::string& what, size_t checked) const {
    if (count_ == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << ": " << count_ << " of " << checked
                                         << " inputs disagree; the first ones:\n"
                                         << examples_;
  }

 private:
  static constexpr size_t kShown = 10;
  size_t count_ = 0;
  std::string examples_;
};

template <class Input, class Expected, class Actual>
::testing::AssertionResult all_match(const std::string& what, const std::vector<Input>& inputs, Expected expected,
                                     Actual actual) {
  MismatchReport report;
  for (const Input& input : inputs) report.check(input, expected(input), actual(input));
  return report.result(what, inputs.size());
}

// Random sweeps are long enough to matter but cut to ~65k under
// compute-sanitizer (quick mode), which slows every access by orders of magnitude.
size_t random_count() { return quick_mode() ? size_t{1} << 16 : size_t{4'000'000}; }

std::string seed_note() { return "random inputs from seed " + std::to_string(test_seed()) + " (DSA_TEST_SEED)"; }

// ---------------------------------------------------------------------------
// Independent formulations

// A BF16 code's value from the format's definition: 8-bit exponent of bias
// 127, 7-bit mantissa, exponent 0 subnormal (step 2^-133), exponent 255
// infinity or NaN.
double bf16_value_by_definition(uint16_t code) {
  const int exponent_field = (code >> 7) & 0xFF;
  const int mantissa_field = code & 0x7F;
  double magnitude;
  if (exponent_field == 0xFF) {
    magnitude = mantissa_field == 0 ? INFINITY : NAN;
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(mantissa_field, -133);
  } else {
    magnitude = std::ldexp(1.0 + mantissa_field / 128.0, exponent_field - 127);
  }
  return (code & 0x8000) ? -magnitude : magnitude;
}

// FP32 -> BF16 from the definition of rounding: the nearest multiple of the
// BF16 spacing of x's binade (8 significant bits; spacing 2^-133 below 2^-126),
// ties to the even multiple (std::nearbyint in the default rounding mode), and
// infinity once the rounded magnitude reaches 2^128. NaN -> 0x7FFF, the
// canonical NaN cvt.rn.bf16.f32 produces.
uint16_t bf16_nearest_even_by_definition(float x) {
  if (std::isnan(x)) return 0x7FFF;
  if (std::isinf(x)) return x > 0 ? 0x7F80 : 0xFF80;
  const int binade = std::max(std::ilogb(x), -126);  // ilogb(0) is very negative: spacing 2^-133
  const double spacing = std::ldexp(1.0, binade - 7);
  const double rounded = std::nearbyint(static_cast<double>(x) / spacing) * spacing;  // keeps the sign of zero
  if (std::fabs(rounded) >= 0x1p128) return std::signbit(x) ? 0xFF80 : 0x7F80;
  // rounded has at most 8 significant bits and lies in FP32 range: the float is
  // exact and its upper half is the BF16 code.
  return static_cast<uint16_t>(bits_of(static_cast<float>(rounded)) >> 16);
}

// An E4M3 ("fn") code's value from the format's definition: 4-bit exponent of
// bias 7, 3-bit mantissa, exponent 0 subnormal (step 2^-9), 0x7F/0xFF NaN and
// no infinities.
double e4m3_value_by_definition(uint8_t code) {
  if ((code & 0x7F) == 0x7F) return NAN;
  const int exponent_field = (code >> 3) & 0xF;
  const int mantissa_field = code & 0x7;
  const double magnitude =
      exponent_field == 0 ? std::ldexp(mantissa_field, -9) : std::ldexp(1.0 + mantissa_field / 8.0, exponent_field - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

// Values of the non-negative finite codes 0x00..0x7E, indexed by code; they
// increase with the code, which the decode test checks.
const std::vector<double>& finite_e4m3_magnitudes() {
  static const std::vector<double> magnitudes = [] {
    std::vector<double> values;
    for (int code = 0; code <= 0x7E; ++code) values.push_back(e4m3_value_by_definition(static_cast<uint8_t>(code)));
    return values;
  }();
  return magnitudes;
}

// FP32 -> E4M3 as the satfinite round-to-nearest-even conversion must give it,
// by searching all finite values for the nearest one (ties to the even code,
// whose lowest bit is the mantissa's). Magnitudes above 448 round to 448 or to
// a value past the format, which satfinite brings back to 448; infinity too.
uint8_t e4m3_nearest_even_by_search(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const std::vector<double>& values = finite_e4m3_magnitudes();
  const double magnitude = std::fabs(static_cast<double>(x));
  if (magnitude >= values.back()) return sign | 0x7E;
  const size_t above = std::lower_bound(values.begin(), values.end(), magnitude) - values.begin();
  if (values[above] == magnitude) return static_cast<uint8_t>(sign | above);  // includes both zeros
  const size_t below = above - 1;
  // Exact: magnitude and both neighbours lie within one binade's reach, so the
  // differences fit in double's 53 bits and ties are detected exactly.
  const double distance_below = magnitude - values[below];
  const double distance_above = values[above] - magnitude;
  size_t nearest;
  if (distance_below != distance_above) {
    nearest = distance_below < distance_above ? below : above;
  } else {
    nearest = below % 2 == 0 ? below : above;
  }
  return static_cast<uint8_t>(sign | nearest);
}

// a / b rounded to FP32 by way of double: double keeps 53 >= 2*24 + 2 bits, so
// rounding the double quotient to float equals rounding the exact quotient
// (double rounding is innocuous for division at that precision, Figueroa 1995).
float quotient_rounded_via_double(float a, float b) {
  return static_cast<float>(static_cast<double>(a) / static_cast<double>(b));
}

// True when q is a / b rounded to nearest even, decided exactly: the exact
// quotient must lie between the midpoints that separate |q| from its float
// neighbours, and on a midpoint only an even |q| is allowed. A midpoint has at
// most 25 significant bits and |b| at most 24, so midpoint * |b| is exact in
// double and comparing it with |a| decides the side exactly.
bool is_quotient_rounded_to_nearest_even(float a, float b, float q) {
  const bool undefined = std::isnan(a) || std::isnan(b) || (a == 0 && b == 0) || (std::isinf(a) && std::isinf(b));
  if (undefined) return std::isnan(q);
  if (std::isnan(q) || std::signbit(q) != (std::signbit(a) != std::signbit(b))) return false;
  if (std::isinf(a) || b == 0) return std::isinf(q);
  if (std::isinf(b)) return q == 0;

  const double numerator = std::fabs(static_cast<double>(a));
  const double denominator = std::fabs(static_cast<double>(b));
  const float magnitude = std::fabs(q);
  const bool even = (bits_of(magnitude) & 1u) == 0;  // infinity counts as even, as RNE's overflow does
  // Past FLT_MAX the next "neighbour" is 2^128: the overflow threshold is
  // FLT_MAX + half its ulp.
  const double overflow_threshold = static_cast<double>(FLT_MAX) + 0x1p103;
  const double upper_midpoint =
      std::isinf(magnitude) ? INFINITY
      : magnitude == FLT_MAX
          ? overflow_threshold
          : (static_cast<double>(magnitude) + static_cast<double>(std::nextafter(magnitude, INFINITY))) / 2;
  const double lower_midpoint =
      std::isinf(magnitude)
          ? overflow_threshold
          : (static_cast<double>(magnitude) + static_cast<double>(std::nextafter(magnitude, 0.0f))) / 2;
  const double upper_product = upper_midpoint * denominator;
  const double lower_product = lower_midpoint * denominator;
  const bool not_above = numerator < upper_product || (numerator == upper_product && even);
  const bool not_below = magnitude == 0 || numerator > lower_product || (numerator == lower_product && even);
  return not_above && not_below;
}

// True when y is 1/sqrt(x) rounded to nearest, for positive finite x whose
// result is a normal float: x * midpoint^2 must be >= 1 for the upper midpoint
// and <= 1 for the lower one. midpoint^2 (at most 50 bits) is exact in double;
// the product's rounding error is recovered exactly with fma, and
// product - 1 is exact because the product is near 1. 1/sqrt(x) is never a
// midpoint (that would make x = 1/midpoint^2 a float), so no tie rule is needed.
bool is_rsqrt_rounded_to_nearest(float x, float y) {
  const auto at_least_one = [x](double midpoint) {
    const double square = midpoint * midpoint;
    const double product = static_cast<double>(x) * square;
    const double error = std::fma(static_cast<double>(x), square, -product);
    return product - 1.0 >= -error;
  };
  const double upper_midpoint = (static_cast<double>(y) + static_cast<double>(std::nextafter(y, INFINITY))) / 2;
  const double lower_midpoint = (static_cast<double>(y) + static_cast<double>(std::nextafter(y, 0.0f))) / 2;
  return at_least_one(upper_midpoint) && !at_least_one(lower_midpoint);
}

// ---------------------------------------------------------------------------
// Inputs

std::vector<uint16_t> all_bf16_codes() {
  std::vector<uint16_t> codes(1 << 16);
  for (uint32_t code = 0; code < codes.size(); ++code) codes[code] = static_cast<uint16_t>(code);
  return codes;
}

std::vector<uint8_t> all_e4m3_codes() {
  std::vector<uint8_t> codes(256);
  for (uint32_t code = 0; code < codes.size(); ++code) codes[code] = static_cast<uint8_t>(code);
  return codes;
}

// Values every conversion must get right and random bits rarely produce.
std::vector<float> special_floats() {
  const uint32_t patterns[] = {
      0x00000000, 0x80000000,  // +-0
      0x00000001, 0x80000001,  // smallest subnormals
      0x007FFFFF, 0x807FFFFF,  // largest subnormals
      0x00800000, 0x80800000,  // FLT_MIN
      0x3F800000, 0xBF800000,  // +-1
      0x7F7F7FFF, 0xFF7F7FFF,  // one bit below the BF16 overflow tie: the largest BF16 value
      0x7F7F8000, 0xFF7F8000,  // the tie between the largest BF16 value (odd) and infinity
      0x7F7FFFFF, 0xFF7FFFFF,  // FLT_MAX, rounds to BF16 infinity
      0x7F800000, 0xFF800000,  // +-infinity
      0x7FC00000, 0xFFC00000,  // quiet NaNs
      0x7F800001, 0xFF800001,  // signalling NaNs
      0x7FFFFFFF, 0xFFFFFFFF,  // NaNs with full payloads
      0x43E00000, 0xC3E00000,  // +-448, the largest E4M3 value
      0x43E80000, 0x43E80001,  // 464 (the tie past 448) and just above it
      0x44800000, 0xC4800000,  // +-1024
      0x3A800000, 0xBA800000,  // +-2^-10, the tie between 0 and the smallest E4M3 subnormal
  };
  std::vector<float> values;
  for (uint32_t bits : patterns) values.push_back(float_of(bits));
  return values;
}

// Uniform 32-bit patterns reach every exponent, subnormals, infinities and NaN
// payloads; every fourth one is moved onto a BF16 rounding tie or one bit off
// it, which uniform bits almost never hit. The special values are appended.
std::vector<float> random_fp32_patterns(size_t count, std::mt19937_64& rng) {
  const uint32_t tie_neighbourhood[] = {0x8000, 0x7FFF, 0x8001};
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng() >> 32);
    if (i % 4 == 3) bits = (bits & 0xFFFF0000u) | tie_neighbourhood[(i / 4) % 3];
    values[i] = float_of(bits);
  }
  const std::vector<float> specials = special_floats();
  values.insert(values.end(), specials.begin(), specials.end());
  return values;
}

// Random floats whose magnitudes are spread evenly over the binades of
// [2^-12, 1024), where E4M3 rounding actually happens (uniform bit patterns
// mostly saturate or underflow), with random signs.
std::vector<float> random_e4m3_range_floats(size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> exponent(-12, 9);
  std::vector<float> values(count);
  for (float& value : values) {
    const uint32_t random_bits = static_cast<uint32_t>(rng() >> 32);
    const uint32_t sign = random_bits & 0x80000000u;
    const uint32_t mantissa = random_bits & 0x007FFFFFu;
    value = float_of(sign | static_cast<uint32_t>(exponent(rng) + 127) << 23 | mantissa);
  }
  return values;
}

// The point halfway between two adjacent non-negative finite E4M3 values.
struct E4m3Midpoint {
  float value;
  uint8_t code_below;  // the code above is code_below + 1
};

std::vector<E4m3Midpoint> e4m3_midpoints() {
  const std::vector<double>& values = finite_e4m3_magnitudes();
  std::vector<E4m3Midpoint> midpoints;
  for (size_t code = 0; code + 1 < values.size(); ++code) {
    // At most 5 significant bits: exact in float.
    midpoints.push_back({static_cast<float>((values[code] + values[code + 1]) / 2), static_cast<uint8_t>(code)});
  }
  return midpoints;
}

std::vector<float> bf16_values_as_floats() {
  std::vector<float> values;
  for (uint16_t code : all_bf16_codes()) values.push_back(float_of(static_cast<uint32_t>(code) << 16));
  return values;
}

// Everything the FP32 conversions are run on, on the device as on the host.
std::vector<float> conversion_inputs(std::mt19937_64& rng) {
  std::vector<float> inputs = bf16_values_as_floats();
  for (uint8_t code : all_e4m3_codes()) inputs.push_back(static_cast<float>(e4m3_value_by_definition(code)));
  for (const E4m3Midpoint& midpoint : e4m3_midpoints()) {
    for (float value :
         {midpoint.value, std::nextafter(midpoint.value, 0.0f), std::nextafter(midpoint.value, INFINITY)}) {
      inputs.push_back(value);
      inputs.push_back(-value);
    }
  }
  const std::vector<float> random_bits = random_fp32_patterns(random_count(), rng);
  inputs.insert(inputs.end(), random_bits.begin(), random_bits.end());
  const std::vector<float> e4m3_range = random_e4m3_range_floats(random_count(), rng);
  inputs.insert(inputs.end(), e4m3_range.begin(), e4m3_range.end());
  return inputs;
}

// Division operands: uniform bit patterns (specials, subnormals, overflowing
// and underflowing quotients), moderate magnitudes, and subnormal numerators
// over small powers of two, the only way to land a quotient exactly on a
// rounding tie.
std::vector<FloatPair> division_inputs(size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> moderate_exponent(-30, 30);
  std::uniform_int_distribution<int> small_power(1, 4);
  const auto random_bits = [&rng] { return static_cast<uint32_t>(rng() >> 32); };
  const auto moderate = [&] {
    return float_of((random_bits() & 0x807FFFFFu) | static_cast<uint32_t>(moderate_exponent(rng) + 127) << 23);
  };
  std::vector<FloatPair> pairs(count);
  for (size_t i = 0; i < count; ++i) {
    switch (i % 3) {
      case 0:
        pairs[i] = {float_of(random_bits()), float_of(random_bits())};
        break;
      case 1:
        pairs[i] = {moderate(), moderate()};
        break;
      default:
        pairs[i] = {float_of(random_bits() & 0x807FFFFFu), std::ldexp(1.0f, small_power(rng))};
        break;
    }
  }
  const std::vector<float> specials = special_floats();
  for (float a : specials) {
    for (float b : specials) pairs.push_back({a, b});
  }
  return pairs;
}

// ---------------------------------------------------------------------------
// CPU: BF16

TEST(NumericsCpu, Bf16ToFloatDecodesEveryCode) {
  MismatchReport report;
  for (uint16_t code : all_bf16_codes()) {
    const float decoded = num::bf16_to_float(code);
    const double expected = bf16_value_by_definition(code);
    if (std::isnan(expected)) {
      // A BF16 load is the upper half of a float, so even NaN payloads survive.
      if (!std::isnan(decoded) || (bits_of(decoded) >> 16) != code) report.record(describe(code) + ": NaN not kept");
    } else {
      report.check(code, bits_of(static_cast<float>(expected)), bits_of(decoded));
    }
  }
  EXPECT_TRUE(report.result("bf16_to_float", 1 << 16));
}

TEST(NumericsCpu, FloatToBf16RoundTripsEveryBf16Value) {
  EXPECT_TRUE(all_match(
      "float_to_bf16(bf16_to_float(code))", all_bf16_codes(),
      [](uint16_t code) { return std::isnan(bf16_value_by_definition(code)) ? num::kBF16CanonicalNaN : code; },
      [](uint16_t code) { return num::float_to_bf16(num::bf16_to_float(code)); }));
}

TEST(NumericsCpu, FloatToBf16BreaksEveryTieToEven) {
  // For every finite BF16 value, the float halfway to its neighbour away from
  // zero must go to whichever of the two is even, and one float ulp either
  // side of the tie to the nearer one. Covers even and odd lower neighbours in
  // every binade, subnormals, and the tie past the largest value (to infinity).
  MismatchReport report;
  size_t checked = 0;
  for (uint16_t code : all_bf16_codes()) {
    if (std::isnan(bf16_value_by_definition(code)) || std::isinf(bf16_value_by_definition(code))) continue;
    const uint16_t away = static_cast<uint16_t>(code + 1);  // next BF16 magnitude, same sign
    const uint32_t base = static_cast<uint32_t>(code) << 16;
    report.check(float_of(base | 0x8000u), (code & 1) ? away : code, num::float_to_bf16(float_of(base | 0x8000u)));
    report.check(float_of(base | 0x7FFFu), code, num::float_to_bf16(float_of(base | 0x7FFFu)));
    report.check(float_of(base | 0x8001u), away, num::float_to_bf16(float_of(base | 0x8001u)));
    checked += 3;
  }
  EXPECT_TRUE(report.result("float_to_bf16 at ties", checked));
}

TEST(NumericsCpu, FloatToBf16RoundsRandomBitPatternsToNearestEven) {
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed());
  EXPECT_TRUE(all_match("float_to_bf16", random_fp32_patterns(random_count(), rng), bf16_nearest_even_by_definition,
                        num::float_to_bf16));
}

TEST(NumericsCpu, FloatToBf16SpecialValues) {
  EXPECT_EQ(num::float_to_bf16(NAN), 0x7FFF);
  EXPECT_EQ(num::float_to_bf16(-NAN), 0x7FFF);
  EXPECT_EQ(num::float_to_bf16(float_of(0x7F800001u)), 0x7FFF);  // signalling NaN whose payload would truncate to inf
  EXPECT_EQ(num::float_to_bf16(INFINITY), 0x7F80);
  EXPECT_EQ(num::float_to_bf16(-INFINITY), 0xFF80);
  EXPECT_EQ(num::float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(num::float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(num::float_to_bf16(FLT_MAX), 0x7F80);
  EXPECT_EQ(num::float_to_bf16(-FLT_MAX), 0xFF80);
  EXPECT_EQ(num::float_to_bf16(float_of(0x00000001u)), 0x0000);  // subnormals are rounded, not flushed...
  EXPECT_EQ(num::float_to_bf16(float_of(0x80000001u)), 0x8000);
  EXPECT_EQ(num::float_to_bf16(float_of(0x00010000u)), 0x0001);    // ...and the smallest BF16 subnormal survives
  EXPECT_EQ(num::round_bf16(1.0f + 0x1p-8f), 1.0f);                // tie, even lower neighbour
  EXPECT_EQ(num::round_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);  // tie, odd lower neighbour
}

// ---------------------------------------------------------------------------
// CPU: E4M3

TEST(NumericsCpu, E4m3ToFloatDecodesEveryCode) {
  MismatchReport report;
  for (uint8_t code : all_e4m3_codes()) {
    const float decoded = num::e4m3_to_float(code);
    const double expected = e4m3_value_by_definition(code);
    if (std::isnan(expected)) {
      if (!std::isnan(decoded)) report.record(describe(code) + ": expected NaN, got " + describe(decoded));
    } else {
      report.check(code, bits_of(static_cast<float>(expected)), bits_of(decoded));
    }
  }
  EXPECT_TRUE(report.result("e4m3_to_float", 256));

  EXPECT_TRUE(std::isnan(num::e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(num::e4m3_to_float(0xFF)));
  EXPECT_EQ(num::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(num::e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(num::e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(num::e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(bits_of(num::e4m3_to_float(0x80)), 0x80000000u);
  const std::vector<double>& magnitudes = finite_e4m3_magnitudes();
  EXPECT_TRUE(std::is_sorted(magnitudes.begin(), magnitudes.end(), std::less_equal<double>()))
      << "E4M3 values must increase strictly with the code";
}

TEST(NumericsCpu, FloatToE4m3RoundTripsEveryCode) {
  EXPECT_TRUE(all_match(
      "float_to_e4m3(e4m3_to_float(code))", all_e4m3_codes(),
      [](uint8_t code) { return std::isnan(e4m3_value_by_definition(code)) ? num::kFp8E4M3NaN : code; },
      [](uint8_t code) { return num::float_to_e4m3(num::e4m3_to_float(code)); }));
}

TEST(NumericsCpu, FloatToE4m3BreaksEveryTieToEven) {
  MismatchReport report;
  size_t checked = 0;
  for (const E4m3Midpoint& midpoint : e4m3_midpoints()) {
    const uint8_t below = midpoint.code_below;
    const uint8_t above = static_cast<uint8_t>(below + 1);
    const uint8_t even = (below % 2 == 0) ? below : above;
    for (uint8_t sign : {uint8_t{0x00}, uint8_t{0x80}}) {
      const float direction = sign ? -1.0f : 1.0f;
      const float tie = direction * midpoint.value;
      report.check(tie, static_cast<uint8_t>(sign | even), num::float_to_e4m3(tie));
      const float just_below = direction * std::nextafter(midpoint.value, 0.0f);
      report.check(just_below, static_cast<uint8_t>(sign | below), num::float_to_e4m3(just_below));
      const float just_above = direction * std::nextafter(midpoint.value, INFINITY);
      report.check(just_above, static_cast<uint8_t>(sign | above), num::float_to_e4m3(just_above));
      checked += 3;
    }
  }
  EXPECT_TRUE(report.result("float_to_e4m3 at midpoints", checked));
}

TEST(NumericsCpu, FloatToE4m3SpecialValues) {
  EXPECT_EQ(num::float_to_e4m3(NAN), 0x7F);
  EXPECT_EQ(num::float_to_e4m3(-NAN), 0x7F);
  EXPECT_EQ(num::float_to_e4m3(float_of(0x7F800001u)), 0x7F);
  EXPECT_EQ(num::float_to_e4m3(INFINITY), 0x7E);  // satfinite: infinity saturates too
  EXPECT_EQ(num::float_to_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(num::float_to_e4m3(FLT_MAX), 0x7E);
  EXPECT_EQ(num::float_to_e4m3(-FLT_MAX), 0xFE);
  EXPECT_EQ(num::float_to_e4m3(464.0f), 0x7E);                            // tie between 448 and 480: even 448
  EXPECT_EQ(num::float_to_e4m3(std::nextafter(464.0f, INFINITY)), 0x7E);  // would round to 480: saturates
  EXPECT_EQ(num::float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(num::float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(num::float_to_e4m3(-0x1p-11f), 0x80);  // negative values that round to zero keep the sign
  EXPECT_EQ(num::float_to_e4m3(-0x1p-10f), 0x80);  // the tie with the smallest subnormal: even zero
  EXPECT_EQ(num::float_to_e4m3(float_of(0x80000001u)), 0x80);
  EXPECT_EQ(num::float_to_e4m3(0x1p-10f + 0x1p-30f), 0x01);
  EXPECT_EQ(num::float_to_e4m3(0x1p-6f - 0x1p-11f), 0x08);  // rounds up out of the subnormals
}

TEST(NumericsCpu, FloatToE4m3MatchesNearestCodeOnEveryBf16Value) {
  EXPECT_TRUE(all_match("float_to_e4m3", bf16_values_as_floats(), e4m3_nearest_even_by_search, num::float_to_e4m3));
}

TEST(NumericsCpu, FloatToE4m3MatchesNearestCodeOnRandomBitPatterns) {
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed());
  EXPECT_TRUE(all_match("float_to_e4m3", random_fp32_patterns(random_count(), rng), e4m3_nearest_even_by_search,
                        num::float_to_e4m3));
}

TEST(NumericsCpu, FloatToE4m3MatchesNearestCodeOnDenseMagnitudeSweep) {
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed() + 1);
  EXPECT_TRUE(all_match("float_to_e4m3", random_e4m3_range_floats(random_count(), rng), e4m3_nearest_even_by_search,
                        num::float_to_e4m3));
}

// ---------------------------------------------------------------------------
// CPU: quantization and cache store

// Scales as a quantizer sees them: 1, powers of two, and inexact reciprocals.
const float kInverseScales[] = {1.0f, 64.0f, 0x1p-20f, 1.0f / 0.0123f, 1.0f / 3.7f, 448.0f / 6.5f};
const float kCacheScales[] = {1.0f, 0.5f, 0.0123f, 3.7f, 1.0f / 448.0f, 0x1p-20f, 1e30f};

TEST(NumericsCpu, QuantFp8StaticClampsNanToPlus448AndSaturates) {
  for (float inverse_scale : kInverseScales) {
    SCOPED_TRACE("inverse_scale " + describe(inverse_scale));
    // fminf/fmaxf return the non-NaN operand: the clamp turns NaN into +448.
    for (uint32_t nan_bits : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu}) {
      EXPECT_EQ(num::quant_fp8_static(float_of(nan_bits), inverse_scale), 0x7E) << hex(nan_bits);
    }
    EXPECT_EQ(num::quant_fp8_static(INFINITY, inverse_scale), 0x7E);
    EXPECT_EQ(num::quant_fp8_static(-INFINITY, inverse_scale), 0xFE);
    EXPECT_EQ(num::quant_fp8_static(FLT_MAX, inverse_scale), 0x7E);
    EXPECT_EQ(num::quant_fp8_static(-FLT_MAX, inverse_scale), 0xFE);
    EXPECT_EQ(num::quant_fp8_static(-0.0f, inverse_scale), 0x80);
  }
  EXPECT_EQ(num::quant_fp8_static(3e38f, 10.0f), 0x7E);  // the product overflows to infinity, then clamps
  EXPECT_EQ(num::quant_fp8_static(1000.0f, 1.0f), 0x7E);
  EXPECT_EQ(num::quant_fp8_static(-1000.0f, 1.0f), 0xFE);
}

TEST(NumericsCpu, QuantFp8StaticEqualsNearestCodeOfScaledValue) {
  // Outside NaN, clamping to +-448 before a saturating conversion changes
  // nothing, so the quant is the nearest code of x * inverse_scale everywhere.
  for (float inverse_scale : kInverseScales) {
    const auto expected = [inverse_scale](float x) {
      return std::isnan(x) ? uint8_t{0x7E} : e4m3_nearest_even_by_search(x * inverse_scale);
    };
    const auto actual = [inverse_scale](float x) { return num::quant_fp8_static(x, inverse_scale); };
    EXPECT_TRUE(all_match("quant_fp8_static, inverse_scale " + describe(inverse_scale), bf16_values_as_floats(),
                          expected, actual));
  }
}

TEST(NumericsCpu, CacheFp8EqualsNearestCodeOfRoundedQuotient) {
  for (float k_scale : kCacheScales) {
    const auto expected = [k_scale](uint16_t code) {
      const float value = static_cast<float>(bf16_value_by_definition(code));
      return e4m3_nearest_even_by_search(quotient_rounded_via_double(value, k_scale));
    };
    const auto actual = [k_scale](uint16_t code) { return num::cache_fp8(code, k_scale); };
    EXPECT_TRUE(all_match("cache_fp8, k_scale " + describe(k_scale), all_bf16_codes(), expected, actual));
  }
  EXPECT_EQ(num::cache_fp8(0x7FC0, 1.0f), 0x7F);  // NaN stays NaN in the cache (no clamp, unlike the quant)
  EXPECT_EQ(num::cache_fp8(0xFF80, 1.0f), 0xFE);  // -infinity saturates
}

// ---------------------------------------------------------------------------
// CPU: division and reciprocal square root

TEST(NumericsCpu, DivisionIsCorrectlyRoundedOnTheHost) {
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed() + 2);
  const std::vector<FloatPair> pairs = division_inputs(random_count() / 2, rng);
  MismatchReport report;
  for (const FloatPair& pair : pairs) {
    for (const auto& [name, quotient] : {std::pair{"div_rn", num::div_rn(pair.numerator, pair.denominator)},
                                         std::pair{"div_full", num::div_full(pair.numerator, pair.denominator)}}) {
      if (!is_quotient_rounded_to_nearest_even(pair.numerator, pair.denominator, quotient)) {
        report.record(std::string(name) + "(" + describe(pair) + ") = " + describe(quotient) +
                      " is not rounded to nearest");
      }
    }
  }
  EXPECT_TRUE(report.result("host division", pairs.size()));
  EXPECT_EQ(num::div_rn(0x1p-149f, 2.0f), 0.0f);           // tie with zero: even zero
  EXPECT_EQ(num::div_rn(3 * 0x1p-149f, 2.0f), 0x1p-148f);  // tie between odd and even subnormals
}

TEST(NumericsCpu, RsqrtIsCorrectlyRoundedOnTheHost) {
  // 1/sqrt(4x) = 1/sqrt(x) / 2 exactly, and the host computes in double where
  // scaling by 4 is exact too, so every float in [1, 4) stands for all
  // positive finite inputs (subnormal ones included). Quick mode samples them.
  const uint32_t first = bits_of(1.0f);
  const uint32_t end = bits_of(4.0f);
  const uint32_t stride = quick_mode() ? 257 : 1;
  MismatchReport report;
  size_t checked = 0;
  for (uint32_t bits = first; bits < end; bits += stride, ++checked) {
    const float x = float_of(bits);
    const float y = num::rsqrt_approx(x);
    if (!is_rsqrt_rounded_to_nearest(x, y)) report.record("rsqrt_approx(" + describe(x) + ") = " + describe(y));
  }
  EXPECT_TRUE(report.result("host rsqrt_approx", checked));
}

// ---------------------------------------------------------------------------
// GPU: device paths against host paths
//
// Each functor applies one helper; called on the host it takes the host path,
// inside map_kernel the device path (the hardware instructions).

struct FloatToBf16 {
  __host__ __device__ uint16_t operator()(float x) const { return num::float_to_bf16(x); }
};
struct FloatToE4m3 {
  __host__ __device__ uint8_t operator()(float x) const { return num::float_to_e4m3(x); }
};
struct QuantFp8Static {
  float inverse_scale;
  __host__ __device__ uint8_t operator()(float x) const { return num::quant_fp8_static(x, inverse_scale); }
};
struct Bf16ToFloatBits {
  __host__ __device__ uint32_t operator()(uint16_t code) const { return num::float_bits(num::bf16_to_float(code)); }
};
struct E4m3ToFloatBits {
  __host__ __device__ uint32_t operator()(uint8_t code) const { return num::float_bits(num::e4m3_to_float(code)); }
};
struct CacheFp8 {
  float k_scale;
  __host__ __device__ uint8_t operator()(uint16_t code) const { return num::cache_fp8(code, k_scale); }
};
// NaN bits are canonicalised: x86 propagates an operand's payload or gives
// 0xFFC00000 where the GPU gives 0x7FFFFFFF, and no kernel stores a quotient's
// NaN bits (the FP8 conversion turns every NaN into 0x7F).
struct DivRnBits {
  __host__ __device__ uint32_t operator()(FloatPair pair) const {
    const float quotient = num::div_rn(pair.numerator, pair.denominator);
    return quotient != quotient ? 0x7FFFFFFFu : num::float_bits(quotient);
  }
};
struct RsqrtApprox {
  __host__ __device__ float operator()(float x) const { return num::rsqrt_approx(x); }
};
struct DivFull {
  __host__ __device__ float operator()(FloatPair pair) const { return num::div_full(pair.numerator, pair.denominator); }
};

template <class In, class Out, class Fn>
__global__ void map_kernel(const In* inputs, Out* outputs, size_t count, Fn fn) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    outputs[i] = fn(inputs[i]);
  }
}

template <class Fn, class In>
auto map_on_host(Fn fn, const std::vector<In>& inputs) {
  std::vector<std::invoke_result_t<Fn, In>> outputs(inputs.size());
  std::transform(inputs.begin(), inputs.end(), outputs.begin(), fn);
  return outputs;
}

template <class T>
Status allocation_status(const DeviceBuffer<T>& buffer, const char* what) {
  if (buffer.get() != nullptr) return Status();
  return Status(ErrorCode::kCudaError, std::string("cudaMalloc of ") + what + " (" +
                                           std::to_string(buffer.size() * sizeof(T)) +
                                           " bytes) failed: " + cudaGetErrorString(cudaGetLastError()));
}

template <class Fn, class In, class Out>
Status map_on_device(Fn fn, const std::vector<In>& inputs, std::vector<Out>* outputs) {
  static_assert(std::is_same_v<Out, std::invoke_result_t<Fn, In>>);
  DeviceBuffer<In> device_inputs(inputs.size());
  DeviceBuffer<Out> device_outputs(inputs.size());
  DSA_RETURN_IF_ERROR(allocation_status(device_inputs, "inputs"));
  DSA_RETURN_IF_ERROR(allocation_status(device_outputs, "outputs"));
  DSA_CUDA_RETURN(cudaMemcpy(device_inputs.get(), inputs.data(), inputs.size() * sizeof(In), cudaMemcpyHostToDevice));
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<size_t>((inputs.size() + kThreads - 1) / kThreads, 4096));
  map_kernel<<<blocks, kThreads>>>(device_inputs.get(), device_outputs.get(), inputs.size(), fn);
  DSA_CUDA_RETURN(cudaGetLastError());
  DSA_CUDA_RETURN(cudaDeviceSynchronize());
  outputs->resize(inputs.size());
  DSA_CUDA_RETURN(
      cudaMemcpy(outputs->data(), device_outputs.get(), inputs.size() * sizeof(Out), cudaMemcpyDeviceToHost));
  return Status();
}

template <class In, class Out>
::testing::AssertionResult same_bits(const std::string& what, const std::vector<In>& inputs,
                                     const std::vector<Out>& host, const std::vector<Out>& device) {
  MismatchReport report;
  for (size_t i = 0; i < inputs.size(); ++i) report.check(inputs[i], host[i], device[i]);
  return report.result(what + " (host expected, device got)", inputs.size());
}

// Runs fn on the device and on the host over the same inputs; the bits must agree.
template <class Fn, class In>
::testing::AssertionResult device_matches_host(const std::string& what, Fn fn, const std::vector<In>& inputs) {
  std::vector<std::invoke_result_t<Fn, In>> device;
  const Status status = map_on_device(fn, inputs, &device);
  if (!status.ok()) return ::testing::AssertionFailure() << what << ": " << status.to_string();
  return same_bits(what, inputs, map_on_host(fn, inputs), device);
}

TEST(NumericsGpu, FloatConversionsMatchHostBitwise) {
  DSA_REQUIRE_GPU();
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed() + 3);
  const std::vector<float> inputs = conversion_inputs(rng);
  EXPECT_TRUE(device_matches_host("float_to_bf16", FloatToBf16{}, inputs));
  EXPECT_TRUE(device_matches_host("float_to_e4m3", FloatToE4m3{}, inputs));
  for (float inverse_scale : kInverseScales) {
    EXPECT_TRUE(device_matches_host("quant_fp8_static, inverse_scale " + describe(inverse_scale),
                                    QuantFp8Static{inverse_scale}, inputs));
  }
}

TEST(NumericsGpu, DecodesMatchHostBitwise) {
  DSA_REQUIRE_GPU();
  EXPECT_TRUE(device_matches_host("bf16_to_float", Bf16ToFloatBits{}, all_bf16_codes()));
  EXPECT_TRUE(device_matches_host("e4m3_to_float", E4m3ToFloatBits{}, all_e4m3_codes()));
}

TEST(NumericsGpu, CacheFp8MatchesHostBitwise) {
  DSA_REQUIRE_GPU();
  const std::vector<uint16_t> codes = all_bf16_codes();
  for (float k_scale : kCacheScales) {
    EXPECT_TRUE(device_matches_host("cache_fp8, k_scale " + describe(k_scale), CacheFp8{k_scale}, codes));
  }
}

TEST(NumericsGpu, DivRnMatchesHostBitwise) {
  DSA_REQUIRE_GPU();
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed() + 4);
  EXPECT_TRUE(device_matches_host("div_rn", DivRnBits{}, division_inputs(random_count(), rng)));
}

// Distance in FP32 ulps between two finite floats of the same sign.
int64_t ulp_distance(float a, float b) {
  return std::llabs(static_cast<int64_t>(bits_of(a)) - static_cast<int64_t>(bits_of(b)));
}

// Largest distance between device and host results, with a line naming the
// worst input; NaN or a sign change counts as unbounded.
template <class In>
std::pair<int64_t, std::string> max_ulp_distance(const std::vector<In>& inputs, const std::vector<float>& host,
                                                 const std::vector<float>& device) {
  int64_t worst = -1;
  std::string where;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool comparable =
        !std::isnan(host[i]) && !std::isnan(device[i]) && std::signbit(host[i]) == std::signbit(device[i]);
    const int64_t distance = comparable ? ulp_distance(host[i], device[i]) : INT64_MAX;
    if (distance > worst) {
      worst = distance;
      where = describe(inputs[i]) + ": host " + describe(host[i]) + ", device " + describe(device[i]);
    }
  }
  return {worst, where};
}

TEST(NumericsGpu, ApproximationsStayWithinUlpsOfExactHost) {
  DSA_REQUIRE_GPU();
  SCOPED_TRACE(seed_note());
  std::mt19937_64 rng(test_seed() + 5);
  const size_t count = random_count();
  const auto random_bits = [&rng] { return static_cast<uint32_t>(rng() >> 32); };

  // rsqrt.approx: every positive normal input (the norm's argument is at least
  // eps). The PTX bound is 2^-22.9 relative error, up to ~2.1 ulp near the
  // bottom of a binade; the host's own rounding adds at most half an ulp.
  std::vector<float> rsqrt_inputs(count);
  std::uniform_int_distribution<uint32_t> normal_exponent(1, 254);
  for (float& x : rsqrt_inputs) x = float_of(normal_exponent(rng) << 23 | (random_bits() & 0x007FFFFFu));
  std::vector<float> rsqrt_device;
  DSA_ASSERT_OK(map_on_device(RsqrtApprox{}, rsqrt_inputs, &rsqrt_device));
  const auto [rsqrt_ulps, rsqrt_worst] =
      max_ulp_distance(rsqrt_inputs, map_on_host(RsqrtApprox{}, rsqrt_inputs), rsqrt_device);
  std::cout << "[ INFO     ] rsqrt_approx: max " << rsqrt_ulps << " ulp from the correctly rounded value over " << count
            << " inputs; worst " << rsqrt_worst << "\n";
  EXPECT_LE(rsqrt_ulps, 3) << rsqrt_worst;

  // div.full: operands and quotients kept normal (div.full flushes subnormals;
  // the norm divides a sum of squares by a row size). PTX bound: 2 ulp.
  std::vector<FloatPair> division_pairs(count);
  std::uniform_int_distribution<int> moderate_exponent(-60, 60);
  const auto moderate = [&] {
    return float_of((random_bits() & 0x807FFFFFu) | static_cast<uint32_t>(moderate_exponent(rng) + 127) << 23);
  };
  for (FloatPair& pair : division_pairs) pair = {moderate(), moderate()};
  std::vector<float> division_device;
  DSA_ASSERT_OK(map_on_device(DivFull{}, division_pairs, &division_device));
  const auto [division_ulps, division_worst] =
      max_ulp_distance(division_pairs, map_on_host(DivFull{}, division_pairs), division_device);
  std::cout << "[ INFO     ] div_full: max " << division_ulps << " ulp from the correctly rounded value over " << count
            << " inputs; worst " << division_worst << "\n";
  EXPECT_LE(division_ulps, 2) << division_worst;
}

}  // namespace
}  // namespace dsa
