// RoPE: the presets' configurations, the YaRN table against the closed form,
// the reference's FP32 order against float64, the argument checks (CPU); the
// RoPE absorb against the references at the dsv32 (TP1, TP8) and glm5 shapes,
// batch invariance, graph replay and the PDL wait (GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <map>
#include <string>

#include "dsa_decode/numerics.h"
#include "dsa_decode/rope.h"
#include "head_gemv/head_gemv_mma.cuh"
#include "rope/rope_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

constexpr double kPi = 3.14159265358979323846;

RopeConfig preset_config(const char* preset, RopeTarget target = RopeTarget::kAttention) {
  RopeConfig c;
  const Status s = rope_preset_config(preset, target, &c);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return c;
}

// ---------------------------------------------------------------- CPU tests

TEST(RopeConfig, PresetsAreTheServedConfigurations) {
  const RopeConfig d = preset_config("dsv32");
  EXPECT_EQ(d.rope_dim, 64);
  EXPECT_EQ(d.theta, 10000.0);
  EXPECT_EQ(d.factor, 40.0);
  EXPECT_EQ(d.original_max_position, 4096);
  EXPECT_EQ(d.beta_fast, 32.0);
  EXPECT_EQ(d.beta_slow, 1.0);
  EXPECT_EQ(d.mscale, 1.0);
  EXPECT_EQ(d.mscale_all_dim, 1.0);
  EXPECT_EQ(d.max_position, 4096 * 40);  // vLLM's cache rows: original_max_position * factor
  EXPECT_EQ(d.style, RopeStyle::kInterleaved);
  EXPECT_EQ(preset_config("dsv32", RopeTarget::kIndexer).style, RopeStyle::kHalfSplit);

  const RopeConfig g = preset_config("glm5");
  EXPECT_EQ(g.rope_dim, 64);
  EXPECT_EQ(g.theta, 1000000.0);
  EXPECT_EQ(g.factor, 1.0);
  EXPECT_EQ(g.max_position, 202752);
  EXPECT_EQ(g.style, RopeStyle::kInterleaved);
  EXPECT_EQ(preset_config("glm5", RopeTarget::kIndexer).style, RopeStyle::kInterleaved);

  for (const char* preset : {"dsv32", "glm5"}) {
    for (RopeTarget target : {RopeTarget::kAttention, RopeTarget::kIndexer}) {
      const Status s = check_rope_config(preset_config(preset, target));
      EXPECT_TRUE(s.ok()) << preset << ": " << s.to_string();
    }
  }
  RopeConfig unused;
  testing::expect_rejected(rope_preset_config("glm5next", RopeTarget::kAttention, &unused), "preset", "dsv32 or glm5");
  testing::expect_rejected(rope_preset_config("dsv32", static_cast<RopeTarget>(5), &unused), "target", "kIndexer");
}

TEST(RopeConfig, SoftmaxAndTableScales) {
  // DeepSeek-V3.2: 192^-0.5 (0.1 ln 40 + 1)^2 = 0.135234 (DESIGN.md: 0.13523).
  const RopeConfig d = preset_config("dsv32");
  EXPECT_NEAR(rope_softmax_scale(d, 192), 0.1352337788608801, 1e-15);
  EXPECT_NEAR(rope_softmax_scale(d, 192), 0.13523, 5e-6);
  EXPECT_EQ(rope_table_scale(d), 1.0);  // mscale == mscale_all_dim: cos / sin unscaled
  // GLM-5: no YaRN, 256^-0.5.
  const RopeConfig g = preset_config("glm5");
  EXPECT_EQ(rope_softmax_scale(g, 256), 1.0 / 16.0);
  EXPECT_EQ(rope_table_scale(g), 1.0);
  // A config whose magnitude terms differ scales the table by their ratio (vLLM's mscale).
  RopeConfig k = d;
  k.mscale = 0.707;
  EXPECT_NEAR(rope_table_scale(k), (0.0707 * std::log(40.0) + 1.0) / (0.1 * std::log(40.0) + 1.0), 1e-15);
  std::vector<float> row(64);
  DSA_ASSERT_OK(rope_cos_sin_table(k, 0, 1, row.data()));
  EXPECT_EQ(row[0], static_cast<float>(rope_table_scale(k)));  // cos(0) * scale
  EXPECT_EQ(row[32], 0.0f);
}

// The closed form written out for dsv32: correction dims 10.47 and 22.51 give
// the ramp from pair 10 to pair 23; below it the original frequency, above it
// the frequency / 40.
TEST(RopeTable, YarnFrequenciesMatchTheClosedForm) {
  const RopeConfig d = preset_config("dsv32");
  auto correction = [](double rotations) { return 64 * std::log(4096 / (rotations * 2 * kPi)) / (2 * std::log(1e4)); };
  EXPECT_NEAR(correction(32), 10.4722408, 1e-6);
  EXPECT_NEAR(correction(1), 22.5134406, 1e-6);
  const double low = 10, high = 23;
  for (int i = 0; i < 32; ++i) {
    const double original = std::pow(1e4, -i / 32.0);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double expected = original / 40 * ramp + original * (1 - ramp);
    EXPECT_NEAR(rope_frequency(d, i), expected, 4e-16 * expected) << "pair " << i;
    if (i <= 10) EXPECT_NEAR(rope_frequency(d, i), original, 4e-16 * original);
    if (i >= 23) EXPECT_NEAR(rope_frequency(d, i), original / 40, 4e-16 * original);
  }
  const RopeConfig g = preset_config("glm5");
  for (int i = 0; i < 32; ++i) EXPECT_NEAR(rope_frequency(g, i), std::pow(1e6, -i / 32.0), 4e-16) << "pair " << i;
}

TEST(RopeTable, EntriesWithinTwoToTheMinus24OfTheClosedForm) {
  for (const char* preset : {"dsv32", "glm5"}) {
    const RopeConfig c = preset_config(preset);
    std::vector<double> frequency(32);
    for (int i = 0; i < 32; ++i) {
      const double original = std::pow(c.theta, -i / 32.0);
      const double ramp = c.factor > 1 ? std::clamp((i - 10.0) / 13.0, 0.0, 1.0) : 0.0;
      frequency[i] = original / c.factor * ramp + original * (1 - ramp);
    }
    for (int64_t position : {int64_t{0}, int64_t{1}, int64_t{4095}, int64_t{4096}, int64_t{65537}, int64_t{131072},
                             c.max_position - 1}) {
      std::vector<float> row(64);
      DSA_ASSERT_OK(rope_cos_sin_table(c, position, 1, row.data()));
      for (int i = 0; i < 32; ++i) {
        const double angle = static_cast<double>(position) * frequency[i];
        EXPECT_LE(std::fabs(row[i] - std::cos(angle)), std::ldexp(1.0, -24)) << preset << " " << position << " " << i;
        EXPECT_LE(std::fabs(row[32 + i] - std::sin(angle)), std::ldexp(1.0, -24)) << preset << " " << position;
      }
      if (position == 0) {
        for (int i = 0; i < 32; ++i) {
          EXPECT_EQ(row[i], 1.0f);
          EXPECT_EQ(row[32 + i], 0.0f);
        }
      }
    }
    // A block of rows from an offset equals the rows made one at a time.
    std::vector<float> block(3 * 64), one(64);
    DSA_ASSERT_OK(rope_cos_sin_table(c, 131071, 3, block.data()));
    for (int r = 0; r < 3; ++r) {
      DSA_ASSERT_OK(rope_cos_sin_table(c, 131071 + r, 1, one.data()));
      EXPECT_TRUE(std::equal(one.begin(), one.end(), block.begin() + r * 64)) << "row " << r;
    }
  }
  RopeConfig bad = preset_config("dsv32");
  std::vector<float> row(64);
  testing::expect_rejected(rope_cos_sin_table(bad, -1, 1, row.data()), "first_position", "positions from 0");
  testing::expect_rejected(rope_cos_sin_table(bad, 0, 1, nullptr), "out", "host buffer");
  bad.rope_dim = 48;
  testing::expect_rejected(rope_cos_sin_table(bad, 0, 1, row.data()), "rope_dim", "16, 32, 64, 128 or 256");
  bad = preset_config("dsv32");
  bad.factor = 0.5;
  testing::expect_rejected(check_rope_config(bad), "factor", ">= 1");
  bad = preset_config("dsv32");
  bad.theta = 1.0;
  testing::expect_rejected(check_rope_config(bad), "theta", "> 1");
  bad = preset_config("dsv32");
  bad.beta_slow = 0.0;
  testing::expect_rejected(check_rope_config(bad), "beta_fast", "> 0");
  bad = preset_config("dsv32");
  bad.style = static_cast<RopeStyle>(2);
  testing::expect_rejected(check_rope_config(bad), "style", "kHalfSplit");
}

// vLLM builds its cache in FP32 (inv_freq, then angle = position x inv_freq,
// rounded): far from position 0 its entries drift from the float64 closed
// form by far more than the 2^-24 of rope_cos_sin_table, which is why the
// kernel takes the table as an argument (the engine's own reproduces its
// angles). Emulated here with FP32 arithmetic (powf for torch's pow).
TEST(RopeTable, Fp32AnglesOfAnEngineTableDriftFromTheFloat64Form) {
  const RopeConfig d = preset_config("dsv32");
  auto drift_at = [&](int64_t position) {
    double worst = 0;
    for (int i = 0; i < 32; ++i) {
      const float powered = std::pow(10000.0f, static_cast<float>(2 * i) / 64.0f);
      const float extrapolation = 1.0f / powered, interpolation = 1.0f / (40.0f * powered);
      const float ramp = std::clamp((static_cast<float>(i) - 10.0f) / 13.0f, 0.0f, 1.0f);
      const float keep = 1.0f - ramp;
      const float frequency = interpolation * (1.0f - keep) + extrapolation * keep;
      const float angle = static_cast<float>(position) * frequency;
      const double exact = static_cast<double>(position) * rope_frequency(d, i);
      worst = std::max({worst, std::fabs(std::cos(double(angle)) - std::cos(exact)),
                        std::fabs(std::sin(double(angle)) - std::sin(exact))});
    }
    return worst;
  };
  EXPECT_LT(drift_at(1), 1e-6);
  EXPECT_GT(drift_at(163839), 1e-4);
  EXPECT_LT(drift_at(163839), 2e-2);
  std::printf("[rope table] FP32-angle table vs float64: %.2e at 4096, %.2e at 131072, %.2e at 163839\n",
              drift_at(4096), drift_at(131072), drift_at(163839));
}

// Which values form a pair: interleaved (GPT-J) pairs neighbours, half-split
// (NeoX) pairs i with i + 32. A unit vector at index 1 shows it.
TEST(RopeReference, StylesPairTheRightValues) {
  const RopeConfig c = preset_config("dsv32");
  std::vector<double> cos(32), sin(32);
  reference::rope_cos_sin64(c, 3, cos.data(), sin.data());
  std::vector<uint16_t> x(64, 0);
  x[1] = num::float_to_bf16(1.0f);
  std::vector<double> out(64);
  reference::rope_rotate_f64(x.data(), cos.data(), sin.data(), 64, RopeStyle::kInterleaved, out.data());
  for (int k = 0; k < 64; ++k) {
    const double expected = k == 0 ? -sin[0] : k == 1 ? cos[0] : 0.0;
    EXPECT_EQ(out[k], expected) << "interleaved, value " << k;
  }
  reference::rope_rotate_f64(x.data(), cos.data(), sin.data(), 64, RopeStyle::kHalfSplit, out.data());
  for (int k = 0; k < 64; ++k) {
    const double expected = k == 1 ? cos[1] : k == 33 ? sin[1] : 0.0;
    EXPECT_EQ(out[k], expected) << "half-split, value " << k;
  }
  // x[33] in half-split is the partner of x[1]: rotating it gives -sin at 1.
  std::fill(x.begin(), x.end(), 0);
  x[33] = num::float_to_bf16(1.0f);
  reference::rope_rotate_f64(x.data(), cos.data(), sin.data(), 64, RopeStyle::kHalfSplit, out.data());
  EXPECT_EQ(out[1], -sin[1]);
  EXPECT_EQ(out[33], cos[1]);
  EXPECT_EQ(reference::rope_partner(1, 64, RopeStyle::kInterleaved), 0);
  EXPECT_EQ(reference::rope_partner(1, 64, RopeStyle::kHalfSplit), 33);
  EXPECT_EQ(reference::rope_pair(33, 64, RopeStyle::kHalfSplit), 1);
  EXPECT_EQ(reference::rope_pair(33, 64, RopeStyle::kInterleaved), 16);
}

TEST(RopeReference, RotationPreservesPairNormsAndFp32OrderIsWithinTheBound) {
  std::mt19937_64 rng(testing::test_seed());
  const int64_t positions[] = {0, 1, 4095, 4096, 4097, 100000, 131072, 163839};
  double worst_f32 = 0.0;  // largest |fp32 - float64| / bound seen
  for (const char* preset : {"dsv32", "glm5"}) {
    for (RopeStyle style : {RopeStyle::kInterleaved, RopeStyle::kHalfSplit}) {
      RopeConfig c = preset_config(preset);
      c.style = style;
      for (int64_t position : positions) {
        std::vector<double> cos(32), sin(32);
        reference::rope_cos_sin64(c, position, cos.data(), sin.data());
        std::vector<float> table(64);
        DSA_ASSERT_OK(rope_cos_sin_table(c, position, 1, table.data()));
        for (int trial = 0; trial < 20; ++trial) {
          const std::vector<uint16_t> x = testing::random_bf16(64, trial % 2 ? 30.0f : 1.0f, rng);
          std::vector<double> exact(64);
          std::vector<float> f32(64);
          reference::rope_rotate_f64(x.data(), cos.data(), sin.data(), 64, style, exact.data());
          reference::rope_rotate_f32(x.data(), table.data(), table.data() + 32, 64, style, f32.data());
          for (int k = 0; k < 64; ++k) {
            const int partner = reference::rope_partner(k, 64, style);
            const double a = num::bf16_to_float(x[k]), b = num::bf16_to_float(x[partner]);
            if (k < partner) {  // each pair once
              const double before = a * a + b * b;
              const double after = exact[k] * exact[k] + exact[partner] * exact[partner];
              EXPECT_NEAR(after, before, 1e-13 * before + 1e-300) << "float64 pair norm, position " << position;
              const double after32 = double(f32[k]) * f32[k] + double(f32[partner]) * f32[partner];
              EXPECT_NEAR(after32, before, std::ldexp(before, -19) + 1e-300) << "FP32 pair norm";
            }
            const double bound = std::ldexp(std::fabs(a) + std::fabs(b), -21);
            EXPECT_LE(std::fabs(f32[k] - exact[k]), bound) << preset << " position " << position << " value " << k;
            if (bound > 0) worst_f32 = std::max(worst_f32, std::fabs(f32[k] - exact[k]) / bound);
          }
        }
      }
    }
  }
  EXPECT_GT(worst_f32, 0.0) << "the FP32 order never differed from float64: the comparison is not looking";
  std::printf("[rope reference] largest FP32-order error: %.3f of the 2^-21 (|a| + |b|) bound\n", worst_f32);
}

// The deviation check has teeth: the reference's own rows pass, a row moved
// by two BF16 steps or a wrong style or position does not.
TEST(RopeReference, DeviationAcceptsTheReferenceAndFlagsWrongRows) {
  std::mt19937_64 rng(testing::test_seed() + 1);
  const RopeConfig c = preset_config("dsv32");
  const int m = 3, heads = 2, rows = 64, latent = 32, r = 64;
  // Rows 0..4105 of the table: positions 4093 and 4105 inside, 4106 past it.
  const int64_t table_rows = 4106;
  std::vector<float> table(table_rows * r);
  DSA_ASSERT_OK(rope_cos_sin_table(c, 0, table_rows, table.data()));
  const std::vector<uint16_t> q_nope = testing::random_bf16(m * heads * rows, 1.0f, rng);
  const std::vector<uint16_t> q_pe = testing::random_bf16(m * heads * r, 1.0f, rng);
  const std::vector<uint16_t> k_pe = testing::random_bf16(m * r, 1.0f, rng);
  const std::vector<uint16_t> weight = testing::random_bf16(heads * rows * latent, 0.05f, rng);
  const std::vector<int64_t> positions = {4093, 4105, 4106};
  reference::RopeAbsorbHost a{q_nope.data(), heads * rows, rows, q_pe.data(), heads * r, r, k_pe.data(), r,
                              positions.data(), table.data(), false, r, table_rows, weight.data(), rows * latent, latent,
                              m, heads, rows, latent, r, RopeStyle::kInterleaved};
  const reference::RopeRows expected = reference::rope_rows(a);
  EXPECT_EQ(expected.out_of_range, 1);
  // The output the kernel would write: the rounded float64 latent and the FP32-order rows.
  const reference::RopeAbsorbExact exact = reference::rope_absorb_f64(a, nullptr);
  std::vector<uint16_t> out(size_t(m) * heads * (latent + r));
  for (int t = 0; t < m; ++t) {
    for (int h = 0; h < heads; ++h) {
      uint16_t* row = &out[(size_t(t) * heads + h) * (latent + r)];
      for (int j = 0; j < latent; ++j) {
        row[j] = num::float_to_bf16(static_cast<float>(exact.q[(size_t(t) * heads + h) * (latent + r) + j]));
      }
      std::copy_n(&expected.q[(size_t(t) * heads + h) * r], r, row + latent);
    }
  }
  for (int k = 0; k < r; ++k) EXPECT_EQ(out[(size_t(2) * heads + 1) * (latent + r) + latent + k], 0) << "zeros";
  // Within the bound against the table's own values and against the closed form.
  for (const RopeConfig* closed_form : {static_cast<const RopeConfig*>(nullptr), &c}) {
    const reference::RopeAbsorbDeviation d =
        reference::rope_absorb_deviation(a, out.data(), expected.k.data(), closed_form);
    EXPECT_EQ(d.latent.outside, 0);
    EXPECT_EQ(d.rope_outside, 0) << (closed_form ? "against the closed form" : "against the table");
    EXPECT_EQ(d.rope_compared, int64_t(m) * (heads + 1) * r);
  }

  auto outside_after = [&](auto&& spoil) {
    std::vector<uint16_t> o = out, k = expected.k;
    spoil(o, k);
    return reference::rope_absorb_deviation(a, o.data(), k.data(), nullptr).rope_outside;
  };
  // The largest rotated value of token 0, head 1, moved by two BF16 steps.
  EXPECT_GT(outside_after([&](std::vector<uint16_t>& o, std::vector<uint16_t>&) {
              uint16_t* row = &o[size_t(1) * (latent + r) + latent];
              int biggest = 0;
              for (int k = 1; k < r; ++k) biggest = std::fabs(num::bf16_to_float(row[k])) > std::fabs(num::bf16_to_float(row[biggest])) ? k : biggest;
              row[biggest] += 2;
            }),
            0);
  // A value where the position is past the table must be zero.
  EXPECT_GT(outside_after([&](std::vector<uint16_t>&, std::vector<uint16_t>& k) { k[2 * r + 5] = 0x3F80; }), 0);
  // The other style's rotation.
  reference::RopeAbsorbHost other = a;
  other.style = RopeStyle::kHalfSplit;
  const reference::RopeRows neox = reference::rope_rows(other);
  EXPECT_GT(outside_after([&](std::vector<uint16_t>&, std::vector<uint16_t>& k) { k = neox.k; }), 0);
  // Another token's position.
  reference::RopeAbsorbHost moved = a;
  const std::vector<int64_t> other_positions = {4094, 4105, 4106};
  moved.positions = other_positions.data();
  const reference::RopeRows later = reference::rope_rows(moved);
  EXPECT_GT(outside_after([&](std::vector<uint16_t>&, std::vector<uint16_t>& k) { k = later.k; }), 0);
  // The latent columns keep head_gemv's check: the largest of token 0's head
  // 0 moved by 4 steps is caught (a value near zero could be within the bound,
  // which is stated at the scale of the row's products).
  std::vector<uint16_t> spoiled = out;
  int largest = 0;
  for (int j = 1; j < latent; ++j) {
    if (std::fabs(num::bf16_to_float(out[j])) > std::fabs(num::bf16_to_float(out[largest]))) largest = j;
  }
  spoiled[largest] += 4;
  EXPECT_GT(reference::rope_absorb_deviation(a, spoiled.data(), expected.k.data(), nullptr).latent.outside, 0);
}

// Views of disjoint, suitably aligned addresses; the checks never dereference them.
void* fake_address(int region) { return reinterpret_cast<void*>(uintptr_t(region) << 32); }

// dsv32 at TP8: H 16, P 128, L 512, R 64; q_nope and q_pe are views into q [m, H, 192].
struct FakeRope {
  int m = 4, heads = 16, rows = 128, latent = 512, rope = 64;
  char* q = static_cast<char*>(fake_address(1));
  TensorView q_nope = make_strided(q, DType::kBF16, {m, heads, rows}, {heads * 192, 192, 1});
  TensorView q_pe = make_strided(q + rows * 2, DType::kBF16, {m, heads, rope}, {heads * 192, 192, 1});
  TensorView k_pe = make_strided(static_cast<char*>(fake_address(2)) + 512 * 2, DType::kBF16, {m, rope}, {576, 1});
  TensorView positions = make_tensor(fake_address(3), DType::kI64, {m});
  TensorView cos_sin = make_tensor(fake_address(4), DType::kF32, {163840, rope});
  TensorView weight = make_tensor(fake_address(5), DType::kBF16, {heads, rows, latent});
  TensorView out = make_tensor(fake_address(6), DType::kBF16, {m, heads, latent + rope});
  TensorView k_pe_out = make_tensor(fake_address(7), DType::kBF16, {m, rope});
  unsigned int* errors = static_cast<unsigned int*>(fake_address(8));
  RopeAbsorbArgs args() const {
    return RopeAbsorbArgs{q_nope, q_pe, k_pe, positions, cos_sin, weight, out, k_pe_out, RopeStyle::kInterleaved, errors};
  }
};

TEST(RopeChecks, AcceptsTheDsv32AndGlm5Shapes) {
  FakeRope f;
  EXPECT_TRUE(check_rope_absorb(f.args()).ok()) << check_rope_absorb(f.args()).to_string();
  FakeRope glm;  // glm5 TP1: H 64, P 192, BF16 table, half-split, one token, no counter
  glm.m = 1;
  glm.heads = 64;
  glm.rows = 192;
  glm.q_nope = make_strided(glm.q, DType::kBF16, {1, 64, 192}, {64 * 256, 256, 1});
  glm.q_pe = make_strided(glm.q + 192 * 2, DType::kBF16, {1, 64, 64}, {64 * 256, 256, 1});
  glm.k_pe = make_tensor(glm.k_pe.data, DType::kBF16, {1, 64});
  glm.positions = make_tensor(glm.positions.data, DType::kI64, {8});  // graph padding: more positions than tokens
  glm.cos_sin = make_tensor(glm.cos_sin.data, DType::kBF16, {202752, 64});
  glm.weight = make_tensor(glm.weight.data, DType::kBF16, {64, 192, 512});
  glm.out = make_tensor(glm.out.data, DType::kBF16, {1, 64, 576});
  glm.k_pe_out = make_tensor(glm.k_pe_out.data, DType::kBF16, {1, 64});
  RopeAbsorbArgs a = glm.args();
  a.style = RopeStyle::kHalfSplit;
  a.error_count = nullptr;
  EXPECT_TRUE(check_rope_absorb(a).ok()) << check_rope_absorb(a).to_string();
}

TEST(RopeChecks, NamesEachBadArgument) {
  const auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeRope f;
    RopeAbsorbArgs a = f.args();
    breaks(f, a);
    testing::expect_rejected(check_rope_absorb(a), argument, words);
    // rope_absorb checks before it launches anything.
    testing::expect_rejected(rope_absorb(a, nullptr), argument, words);
  };
  using F = FakeRope;
  using A = RopeAbsorbArgs;
  rejected([](F&, A& a) { a.style = static_cast<RopeStyle>(3); }, "style", "kHalfSplit");
  rejected([](F&, A& a) { a.q_nope.data = nullptr; }, "q_nope", "a tensor");
  rejected([](F&, A& a) { a.q_nope.dtype = DType::kF32; }, "q_nope", "dtype bf16");
  rejected([](F& f, A& a) { a.q_nope = make_tensor(f.q, DType::kBF16, {17, 16, 128}); }, "q_nope", "1..16 tokens");
  rejected([](F& f, A& a) { a.q_nope = make_tensor(f.q, DType::kBF16, {4, 16, 96}); }, "q_nope", "multiple of 64");
  rejected([](F& f, A& a) { a.q_nope = make_strided(f.q, DType::kBF16, {4, 16, 128}, {16 * 192, 100, 1}); },
           "q_nope", "multiples of 8");
  rejected([](F& f, A& a) { a.q_nope = make_strided(f.q, DType::kBF16, {4, 16, 128}, {16 * 192, 192, 2}); },
           "q_nope", "stride 1 in dim 2");
  rejected([](F& f, A& a) { a.q_nope.data = f.q + 8; }, "q_nope", "aligned to 16 bytes");
  rejected([](F& f, A& a) { a.q_pe = make_strided(f.q + 256, DType::kBF16, {4, 16, 48}, {16 * 192, 192, 1}); },
           "q_pe", "16, 32, 64, 128 or 256");
  rejected([](F& f, A& a) { a.q_pe = make_strided(f.q + 256, DType::kBF16, {4, 8, 64}, {16 * 192, 192, 1}); },
           "q_pe", "shape [4, 16, *]");
  rejected([](F& f, A& a) { a.q_pe = make_strided(f.q + 256, DType::kBF16, {4, 16, 64}, {16 * 192, 60, 1}); },
           "q_pe", "multiples of 8");
  rejected([](F&, A& a) { a.k_pe = make_strided(a.k_pe.data, DType::kBF16, {4, 64}, {60, 1}); }, "k_pe",
           "multiple of 8");
  rejected([](F&, A& a) { a.k_pe = make_tensor(a.k_pe.data, DType::kBF16, {4, 32}); }, "k_pe", "shape [4, 64]");
  rejected([](F&, A& a) { a.positions.dtype = DType::kI32; }, "positions", "dtype i64");
  rejected([](F&, A& a) { a.positions = make_tensor(a.positions.data, DType::kI64, {3}); }, "positions",
           "one position per token");
  rejected([](F&, A& a) { a.positions = make_strided(a.positions.data, DType::kI64, {4}, {2}); }, "positions",
           "contiguous");
  rejected([](F&, A& a) { a.positions.device.kind = DeviceKind::kCPU; }, "positions", "a CUDA tensor");
  rejected([](F&, A& a) { a.cos_sin.dtype = DType::kF16; }, "cos_sin", "f32 or bf16");
  rejected([](F&, A& a) { a.cos_sin = make_tensor(a.cos_sin.data, DType::kF32, {163840, 32}); }, "cos_sin",
           "shape [*, 64]");
  rejected([](F&, A& a) { a.cos_sin = make_strided(a.cos_sin.data, DType::kF32, {163840, 64}, {68, 1}); },
           "cos_sin", "multiple of 8");
  rejected([](F&, A& a) { a.cos_sin.data = static_cast<char*>(a.cos_sin.data) + 8; }, "cos_sin", "16 bytes");
  rejected([](F&, A& a) { a.weight = make_tensor(a.weight.data, DType::kBF16, {16, 192, 512}); }, "weight",
           "shape [16, 128, *]");
  rejected([](F&, A& a) { a.weight = make_tensor(a.weight.data, DType::kBF16, {16, 128, 520}); }, "weight",
           "multiple of 16");
  rejected([](F&, A& a) { a.out = make_tensor(a.out.data, DType::kBF16, {4, 16, 512}); }, "out", "shape [4, 16, 576]");
  rejected([](F&, A& a) { a.out.dtype = DType::kFP8E4M3; }, "out", "dtype bf16");
  rejected([](F&, A& a) { a.out = make_strided(a.out.data, DType::kBF16, {4, 16, 576}, {16 * 584, 584, 1}); }, "out",
           "contiguous");
  rejected([](F&, A& a) { a.out.data = static_cast<char*>(a.out.data) + 8; }, "out", "16 bytes");
  rejected([](F&, A& a) { a.k_pe_out = make_tensor(nullptr, DType::kBF16, {4, 64}); }, "k_pe_out", "a tensor");
  rejected([](F&, A& a) { a.error_count = reinterpret_cast<unsigned int*>(static_cast<char*>(fake_address(8)) + 2); },
           "error_count", "4-byte aligned");
  // Outputs overlapping inputs or each other.
  rejected([](F& f, A& a) { a.out.data = f.q; }, "out", "memory disjoint from 'q_nope'");
  rejected([](F&, A& a) { a.k_pe_out.data = a.k_pe.data; }, "k_pe_out",
           "memory disjoint from 'k_pe'");
  rejected([](F&, A& a) { a.k_pe_out.data = a.out.data; }, "k_pe_out", "memory disjoint from 'out'");
  rejected([](F&, A& a) { a.out.data = a.cos_sin.data; }, "out", "memory disjoint from 'cos_sin'");
}

// head_gemv's own instances of the shared tensor-core kernel index x and out
// packed and see HeadGemvParams' fields where they were before the RoPE
// absorb's head strides existed (their SASS is the pre-template one); only
// the RoPE tail reads the strides, which come last.
TEST(RopeAbsorbLaunch, HeadGemvInstancesKeepTheirIndexingAndParameterOffsets) {
  static_assert(!head_gemv_mma_detail::CacheWriteTail::kHeadStrides, "head_gemv's tail indexes x and out packed");
  EXPECT_EQ(offsetof(HeadGemvParams, kv), offsetof(HeadGemvParams, rows_per_thread) + sizeof(int))
      << "a field inserted between the tactic and the cache write moves every later parameter";
  EXPECT_EQ(offsetof(HeadGemvParams, x_head_stride), offsetof(HeadGemvParams, error_count) + sizeof(unsigned int*));
  EXPECT_EQ(offsetof(HeadGemvParams, out_head_stride) + sizeof(int64_t), sizeof(HeadGemvParams));
}

// ---------------------------------------------------------------- GPU tests

constexpr size_t kGuard = 64;  // poisoned BF16 values on each side of every output
constexpr uint16_t kPoison = 0xFFFF;

// The full table of a preset (F32, and its BF16 rounding), built once.
const std::vector<float>& full_table(const RopeConfig& c) {
  static std::map<std::pair<double, int64_t>, std::vector<float>> tables;
  auto& table = tables[{c.theta * c.factor, c.max_position}];
  if (table.empty()) {
    table.resize(size_t(c.max_position) * c.rope_dim);
    EXPECT_TRUE(rope_cos_sin_table(c, 0, c.max_position, table.data()).ok());
  }
  return table;
}

struct GpuCase {
  const char* preset;
  int heads, rows, m;
  bool bf16_table = false;
  bool untrusted_positions = false;  // a padding (-1) and an out-of-table position
  RopeTarget target = RopeTarget::kAttention;
  // q_pe from its own buffer, head stride R + 16 and token stride H (R + 16) + 8,
  // rather than q's columns P..P+R: strides unlike q_nope's, so that a launch
  // that reads q_pe through q_nope's strides (or q_nope through q_pe's) fails.
  bool separate_q_pe = false;
};

std::string describe(const GpuCase& c) {
  return std::string(c.preset) + " H " + std::to_string(c.heads) + " P " + std::to_string(c.rows) + " m " +
         std::to_string(c.m) + (c.bf16_table ? " bf16 table" : " f32 table") +
         (c.untrusted_positions ? " untrusted positions" : "") +
         (c.target == RopeTarget::kIndexer ? " (indexer style)" : "") +
         (c.separate_q_pe ? " (q_pe apart)" : "");
}

// Device buffers of one case, vLLM's layouts: q [m, H, P + R] (q_nope | q_pe),
// kv [m, L + R] (k_pe at L), out [m, H, L + R], k_pe_out [m, R + 8].
struct RopeData {
  GpuCase c;
  RopeConfig config;
  int latent = 512, rope = 64;
  int64_t q_token_stride, k_out_stride;
  int64_t pe_head_stride = 0, pe_token_stride = 0;  // separate_q_pe
  std::vector<uint16_t> q, q_pe, kv, weight, table_bf16;
  std::vector<int64_t> positions;
  DeviceBuffer<uint16_t> q_dev, q_pe_dev, kv_dev, weight_dev, out_dev, k_out_dev, table_bf16_dev;
  DeviceBuffer<float> table_dev;
  DeviceBuffer<int64_t> positions_dev;
  DeviceBuffer<unsigned int> errors_dev;

  RopeData(const GpuCase& gpu_case, std::mt19937_64& rng) : c(gpu_case), config(preset_config(c.preset, c.target)) {
    const int width = c.rows + rope;
    q_token_stride = int64_t(c.heads) * width + (c.m % 2 ? 8 : 0);  // padded tokens for odd m
    k_out_stride = rope + 8;
    q = testing::random_bf16(size_t(c.m) * q_token_stride, 1.0f, rng);
    if (c.separate_q_pe) {
      pe_head_stride = rope + 16;
      pe_token_stride = int64_t(c.heads) * pe_head_stride + 8;
      q_pe = testing::random_bf16(size_t(c.m) * pe_token_stride, 1.0f, rng);
      q_pe_dev = DeviceBuffer<uint16_t>(q_pe);
    }
    kv = testing::random_bf16(size_t(c.m) * (latent + rope), 2.0f, rng);
    weight = testing::random_bf16(size_t(c.heads) * c.rows * latent, 0.05f, rng);
    // Positions: 0, past the original 4096, the table's last row, random; the
    // untrusted case puts padding (-1) at token 1 and the table's row count at token 2.
    const int64_t rows = config.max_position;
    const int64_t picks[] = {0, 4097, 131072, rows - 1, 1, 4095, 100000, 65536};
    std::uniform_int_distribution<int64_t> any(0, rows - 1);
    positions.resize(c.m + 3);
    for (int t = 0; t < c.m + 3; ++t) positions[t] = t < 8 ? picks[t] : any(rng);
    if (c.untrusted_positions) {
      if (c.m > 1) positions[1] = -1;
      positions[c.m > 2 ? 2 : 0] = rows + (c.m > 2 ? 0 : 5);
    }
    q_dev = DeviceBuffer<uint16_t>(q);
    kv_dev = DeviceBuffer<uint16_t>(kv);
    weight_dev = DeviceBuffer<uint16_t>(weight);
    out_dev = DeviceBuffer<uint16_t>(size_t(c.m) * c.heads * (latent + rope) + 2 * kGuard);
    k_out_dev = DeviceBuffer<uint16_t>(size_t(c.m) * k_out_stride + 2 * kGuard);
    const std::vector<float>& table = full_table(config);
    if (c.bf16_table) {
      table_bf16.resize(table.size());
      for (size_t i = 0; i < table.size(); ++i) table_bf16[i] = num::float_to_bf16(table[i]);
      table_bf16_dev = DeviceBuffer<uint16_t>(table_bf16);
    } else {
      table_dev = DeviceBuffer<float>(table);
    }
    positions_dev = DeviceBuffer<int64_t>(positions);
    errors_dev = DeviceBuffer<unsigned int>(std::vector<unsigned int>{0});
  }

  // Tokens first..first + m - 1 of the data.
  RopeAbsorbArgs args(int first = 0, int m = -1) {
    if (m < 0) m = c.m;
    const int width = c.rows + rope;
    uint16_t* q0 = q_dev.get() + first * q_token_stride;
    RopeAbsorbArgs a;
    a.q_nope = make_strided(q0, DType::kBF16, {m, c.heads, c.rows}, {q_token_stride, width, 1});
    a.q_pe = c.separate_q_pe ? make_strided(q_pe_dev.get() + first * pe_token_stride, DType::kBF16, {m, c.heads, rope},
                                            {pe_token_stride, pe_head_stride, 1})
                             : make_strided(q0 + c.rows, DType::kBF16, {m, c.heads, rope}, {q_token_stride, width, 1});
    a.k_pe = make_strided(kv_dev.get() + first * (latent + rope) + latent, DType::kBF16, {m, rope}, {latent + rope, 1});
    a.positions = make_tensor(positions_dev.get() + first, DType::kI64, {int64_t(positions.size()) - first});
    a.cos_sin = c.bf16_table ? make_tensor(table_bf16_dev.get(), DType::kBF16, {config.max_position, rope})
                             : make_tensor(table_dev.get(), DType::kF32, {config.max_position, rope});
    a.weight = make_tensor(weight_dev.get(), DType::kBF16, {c.heads, c.rows, latent});
    a.out = make_tensor(out_dev.get() + kGuard, DType::kBF16, {m, c.heads, latent + rope});
    a.k_pe_out = make_strided(k_out_dev.get() + kGuard, DType::kBF16, {m, rope}, {k_out_stride, 1});
    a.style = config.style;
    a.error_count = errors_dev.get();
    return a;
  }

  reference::RopeAbsorbHost host() const {
    const int width = c.rows + rope;
    return reference::RopeAbsorbHost{q.data(),
                                     q_token_stride,
                                     width,
                                     c.separate_q_pe ? q_pe.data() : q.data() + c.rows,
                                     c.separate_q_pe ? pe_token_stride : q_token_stride,
                                     c.separate_q_pe ? pe_head_stride : width,
                                     kv.data() + latent,
                                     latent + rope,
                                     positions.data(),
                                     c.bf16_table ? static_cast<const void*>(table_bf16.data())
                                                  : static_cast<const void*>(full_table(config).data()),
                                     c.bf16_table,
                                     rope,
                                     config.max_position,
                                     weight.data(),
                                     int64_t(c.rows) * latent,
                                     latent,
                                     c.m,
                                     c.heads,
                                     c.rows,
                                     latent,
                                     rope,
                                     config.style};
  }

  // out (without guards) and k_pe_out packed to [m, R].
  std::vector<uint16_t> out(int m) const {
    const std::vector<uint16_t> all = out_dev.download();
    return std::vector<uint16_t>(all.begin() + kGuard, all.begin() + kGuard + size_t(m) * c.heads * (latent + rope));
  }
  std::vector<uint16_t> k_out(int m) const {
    const std::vector<uint16_t> all = k_out_dev.download();
    std::vector<uint16_t> packed(size_t(m) * rope);
    for (int t = 0; t < m; ++t) std::copy_n(&all[kGuard + t * k_out_stride], rope, &packed[size_t(t) * rope]);
    return packed;
  }
  void poison() {
    out_dev.fill_bytes(0xFF);
    k_out_dev.fill_bytes(0xFF);
  }
};

void run_case(const GpuCase& gc, std::mt19937_64& rng) {
  SCOPED_TRACE(describe(gc));
  RopeData d(gc, rng);
  d.poison();
  const RopeAbsorbArgs args = d.args();
  const Status s = rope_absorb(args, nullptr);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::vector<uint16_t> out = d.out(gc.m), k_out = d.k_out(gc.m);
  const reference::RopeAbsorbHost host = d.host();
  // The rotated rows: bitwise the FP32-order reference on the same table.
  const reference::RopeRows expected = reference::rope_rows(host);
  const int width = d.latent + d.rope;
  size_t mismatches = 0;
  for (int t = 0; t < gc.m; ++t) {
    for (int h = 0; h < gc.heads; ++h) {
      for (int k = 0; k < d.rope; ++k) {
        const uint16_t got = out[(size_t(t) * gc.heads + h) * width + d.latent + k];
        const uint16_t want = expected.q[(size_t(t) * gc.heads + h) * d.rope + k];
        if (got != want && mismatches++ < 5) {
          ADD_FAILURE() << "q rope value t " << t << " h " << h << " k " << k << ": got " << got << ", want " << want;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << "rotated q_pe differs from the FP32-order reference";
  EXPECT_TRUE(k_out == expected.k) << "rotated k_pe differs from the FP32-order reference";
  // Against float64: the latent within head_gemv's bound, the rotation within
  // rope.h's (the closed form with the F32 table, the table's values with BF16).
  const reference::RopeAbsorbDeviation dev =
      reference::rope_absorb_deviation(host, out.data(), k_out.data(), gc.bf16_table ? nullptr : &d.config);
  EXPECT_EQ(dev.latent.outside, 0) << dev.latent.outside << " of " << dev.latent.compared << " latent values";
  EXPECT_EQ(dev.rope_outside, 0) << dev.rope_outside << " of " << dev.rope_compared << " rotated values";
  EXPECT_EQ(dev.latent.compared, int64_t(gc.m) * gc.heads * d.latent);
  EXPECT_EQ(dev.rope_compared, int64_t(gc.m) * (gc.heads + 1) * d.rope);
  EXPECT_EQ(d.errors_dev.download()[0], static_cast<unsigned>(expected.out_of_range));
  if (gc.untrusted_positions) EXPECT_EQ(expected.out_of_range, 1);
  // Guards and k_pe_out's row padding untouched; inputs unchanged.
  const std::vector<uint16_t> all_out = d.out_dev.download(), all_k = d.k_out_dev.download();
  for (size_t i = 0; i < kGuard; ++i) {
    ASSERT_EQ(all_out[i], kPoison) << "write before out";
    ASSERT_EQ(all_out[all_out.size() - 1 - i], kPoison) << "write past out";
    ASSERT_EQ(all_k[i], kPoison) << "write before k_pe_out";
    ASSERT_EQ(all_k[all_k.size() - 1 - i], kPoison) << "write past k_pe_out";
  }
  for (int t = 0; t < gc.m; ++t) {
    for (int64_t k = d.rope; k < d.k_out_stride; ++k) {
      ASSERT_EQ(all_k[kGuard + t * d.k_out_stride + k], kPoison) << "write into k_pe_out's row padding";
    }
  }
  EXPECT_TRUE(d.q_dev.download() == d.q) << "q changed";
  if (gc.separate_q_pe) EXPECT_TRUE(d.q_pe_dev.download() == d.q_pe) << "q_pe changed";
  EXPECT_TRUE(d.kv_dev.download() == d.kv) << "kv changed";
  EXPECT_TRUE(d.weight_dev.download() == d.weight) << "weight changed";
  EXPECT_TRUE(d.positions_dev.download() == d.positions) << "positions changed";
  std::printf("[rope %s] latent: %lld of %lld differ from the rounded exact sum; rotated: %lld of %lld differ (max %d "
              "step)\n",
              describe(gc).c_str(), static_cast<long long>(dev.latent.differing),
              static_cast<long long>(dev.latent.compared), static_cast<long long>(dev.rope_differing),
              static_cast<long long>(dev.rope_compared), dev.rope_max_steps);
}

TEST(RopeGpu, AbsorbWithinTheBoundAtThePresetShapes) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 2);
  const GpuCase shapes[] = {{"dsv32", 128, 128, 0}, {"dsv32", 16, 128, 0}, {"glm5", 64, 192, 0}};
  for (GpuCase shape : shapes) {
    for (int m : {1, 4, 16}) {
      if (testing::quick_mode() && m == 4) continue;
      GpuCase c = shape;
      c.m = m;
      c.untrusted_positions = m == 16;
      run_case(c, rng);
    }
  }
  // One token whose position is past the table: zeros and a count.
  run_case(GpuCase{"dsv32", 16, 128, 1, false, true}, rng);
  // A BF16 table (vLLM's cos_sin_cache without FlashInfer) and the indexer's
  // half-split style on the absorb's shapes.
  run_case(GpuCase{"dsv32", 16, 128, 5, /*bf16_table=*/true, false}, rng);
  run_case(GpuCase{"dsv32", 16, 128, 9, false, true, RopeTarget::kIndexer}, rng);
  run_case(GpuCase{"glm5", 8, 192, 3, true, true}, rng);
  // q_pe apart from q, with strides unlike q_nope's: interleaved with a BF16
  // table, and half-split with a padded q token stride (odd m) and untrusted
  // positions.
  run_case(GpuCase{"glm5", 64, 192, 4, /*bf16_table=*/true, false, RopeTarget::kAttention, /*separate_q_pe=*/true},
           rng);
  run_case(GpuCase{"dsv32", 16, 128, 7, false, true, RopeTarget::kIndexer, /*separate_q_pe=*/true}, rng);
}

// A token's bits do not depend on the batch around it; repeated runs and a
// graph replay give the same bits.
TEST(RopeGpu, RepeatableBatchInvariantAndGraphReplayable) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 3);
  RopeData d(GpuCase{"dsv32", 16, 128, 16}, rng);
  const int width = d.latent + d.rope;
  auto run = [&](int first, int m, cudaStream_t stream = nullptr) {
    d.poison();
    const Status s = rope_absorb(d.args(first, m), stream);
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return std::make_pair(d.out(m), d.k_out(m));
  };
  const auto batch = run(0, 16);
  EXPECT_TRUE(run(0, 16) == batch) << "a second run differs";
  for (int first : {0, 5, 8, 15}) {
    for (int m : {1, 3}) {
      if (first + m > 16) continue;
      const auto alone = run(first, m);
      EXPECT_TRUE(std::equal(alone.first.begin(), alone.first.end(), batch.first.begin() + size_t(first) * 16 * width))
          << "q of tokens " << first << ".." << first + m - 1 << " alone differs from the batch";
      EXPECT_TRUE(std::equal(alone.second.begin(), alone.second.end(), batch.second.begin() + size_t(first) * d.rope))
          << "k_pe of tokens " << first << ".." << first + m - 1 << " alone differs from the batch";
    }
  }
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DSA_ASSERT_OK(rope_absorb(d.args(), stream));  // outside the capture: raises the shared-memory limit
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status captured = rope_absorb(d.args(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  DSA_ASSERT_OK(captured);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    d.poison();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_TRUE(std::make_pair(d.out(16), d.k_out(16)) == batch) << "graph replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// PDL: a producer that releases at once, spins, then writes q and the
// positions; the absorb launched after it must see the written values (it
// reads them only after griddepcontrol.wait).
TEST(RopeGpu, ReadsQAndPositionsOnlyAfterThePdlWait) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 4);
  RopeData d(GpuCase{"dsv32", 16, 128, 4}, rng);  // m = 4, no padding: q is whole 16-byte vectors
  ASSERT_EQ(d.q.size() * 2 % 16, 0u);
  // The real inputs wait in source buffers; q and positions start as other values.
  DeviceBuffer<uint16_t> q_source(d.q);
  std::vector<int64_t> real_positions = d.positions;
  real_positions.resize(8, 0);  // 64 bytes: four vectors
  d.positions.resize(8, 0);
  DeviceBuffer<int64_t> positions_source(real_positions);
  std::vector<int64_t> stale_positions(8, 7);
  d.positions_dev = DeviceBuffer<int64_t>(stale_positions);
  d.q_dev.upload(testing::random_bf16(d.q.size(), 1.0f, rng));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DSA_ASSERT_OK(rope_absorb(d.args(), stream));  // first call outside the timed chain
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  d.q_dev.upload(testing::random_bf16(d.q.size(), 1.0f, rng));
  d.positions_dev.upload(stale_positions);
  d.poison();
  DSA_ASSERT_CUDA(testing::launch_late_writer(q_source.get(), d.q_dev.get(), int(d.q.size() * 2 / 16),
                                              positions_source.get(), d.positions_dev.get(), 4, 200000, 1, 128, stream));
  DSA_ASSERT_OK(rope_absorb(d.args(), stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  d.positions = real_positions;
  const reference::RopeRows expected = reference::rope_rows(d.host());
  const std::vector<uint16_t> out = d.out(4);
  const int width = d.latent + d.rope;
  size_t mismatches = 0;
  for (int t = 0; t < 4; ++t) {
    for (int h = 0; h < 16; ++h) {
      mismatches += !std::equal(&out[(size_t(t) * 16 + h) * width + d.latent],
                                &out[(size_t(t) * 16 + h) * width + width], &expected.q[(size_t(t) * 16 + h) * 64]);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "rotated q rows made from the values before the producer wrote";
  EXPECT_TRUE(d.k_out(4) == expected.k) << "k_pe rotated at the stale positions";
  const reference::RopeAbsorbDeviation dev =
      reference::rope_absorb_deviation(d.host(), out.data(), d.k_out(4).data(), &d.config);
  EXPECT_EQ(dev.latent.outside, 0) << "the latent columns were made from the stale q";
}

}  // namespace
}  // namespace dsa
