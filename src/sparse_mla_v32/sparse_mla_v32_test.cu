// sparse_mla_v32: the 656-byte format model (byte layout, the scale rule,
// round trip, special values), the plan, the argument checks, the GPU
// kernel's arithmetic modelled on the CPU against float64 (CPU), and the GPU
// kernels: the cache write bitwise against the model, the attention against
// float64 within the contract at every H with padding, out-of-range indices
// and the NaN rules (SparseMlaV32Gpu, skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "sparse_mla_v32/sparse_mla_v32_format.h"
#include "sparse_mla_v32/sparse_mla_v32_plan.h"
#include "sparse_mla_v32/sparse_mla_v32_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

constexpr int L = kSparseMlaV32Latent;
constexpr int R = kSparseMlaV32Rope;
constexpr int D = kSparseMlaV32HeadDim;
constexpr int E = kSparseMlaV32EntryBytes;
constexpr int G = kSparseMlaV32GroupSize;
constexpr float kDsv32SoftmaxScale = 0.13523f;
const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

uint16_t bf16_bits(float x) { return num::float_to_bf16(x); }
float bf16(uint16_t bits) { return num::bf16_to_float(bits); }

float entry_scale(const uint8_t* entry, int group) {
  float scale;
  std::memcpy(&scale, entry + kSparseMlaV32ScaleOffset + 4 * group, 4);
  return scale;
}

// ---------------------------------------------------------------------------
// The format model.

TEST(SparseMlaV32Format, ByteLayoutCodesScalesThenRope) {
  std::mt19937_64 rng(testing::test_seed());
  std::vector<uint16_t> kv_c = testing::random_bf16(L, 2.0f, rng);
  std::vector<uint16_t> k_pe = testing::random_bf16(R, 1.0f, rng);
  k_pe[0] = 0x7FC1;  // a NaN payload, -0, +inf: copied verbatim
  k_pe[1] = 0x8000;
  k_pe[2] = 0x7F80;
  std::vector<uint8_t> entry(E, 0xEE);
  reference::v32_quantize_token(kv_c.data(), k_pe.data(), entry.data());
  for (int g = 0; g < 4; ++g) {
    const float scale = entry_scale(entry.data(), g);
    for (int i = 0; i < G; ++i) {
      const int d = g * G + i;
      ASSERT_EQ(entry[d], num::float_to_e4m3(num::div_rn(bf16(kv_c[d]), scale))) << "code " << d;
    }
  }
  for (int i = 0; i < R; ++i) {
    uint16_t bits;
    std::memcpy(&bits, &entry[kSparseMlaV32RopeOffset + 2 * i], 2);
    ASSERT_EQ(bits, k_pe[i]) << "rope " << i;
  }
  // The scales as four little-endian floats at 512: group 0's from bytes 512..515.
  const float scale0 = entry_scale(entry.data(), 0);
  uint32_t bits0;
  std::memcpy(&bits0, &scale0, 4);
  EXPECT_EQ(entry[512], bits0 & 0xFF);
  EXPECT_EQ(entry[515], bits0 >> 24);
}

TEST(SparseMlaV32Format, ScaleIsAmaxOver448AndTheLargestValueMapsTo448) {
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint16_t> kv_c = testing::random_bf16(L, std::exp2(exponent(rng)), rng);
    std::vector<uint16_t> k_pe(R, 0);
    std::vector<uint8_t> entry(E);
    reference::v32_quantize_token(kv_c.data(), k_pe.data(), entry.data());
    for (int g = 0; g < 4; ++g) {
      float amax = 0;
      int where = g * G;
      for (int i = g * G; i < (g + 1) * G; ++i) {
        if (std::fabs(bf16(kv_c[i])) > amax) amax = std::fabs(bf16(kv_c[i])), where = i;
      }
      const float want = std::max(amax / 448.0f, FLT_MIN);
      ASSERT_EQ(entry_scale(entry.data(), g), want) << "group " << g << " amax " << amax;
      if (amax / 448.0f >= FLT_MIN) {
        ASSERT_EQ(entry[where] & 0x7F, 0x7E) << "the largest |x| of a group codes as 448";
      }
    }
  }
}

TEST(SparseMlaV32Format, RoundTripWithinHalfAnE4m3Step) {
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  double worst = 0;
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<uint16_t> kv_c = testing::random_bf16(L, std::exp2(exponent(rng)), rng);
    std::vector<uint16_t> k_pe = testing::random_bf16(R, 1.0f, rng);
    std::vector<uint8_t> entry(E);
    reference::v32_quantize_token(kv_c.data(), k_pe.data(), entry.data());
    double key[D];
    reference::v32_dequantize_token(entry.data(), key);
    ASSERT_TRUE(reference::v32_key_is_finite(key));
    for (int d = 0; d < L; ++d) {
      const double x = bf16(kv_c[d]), scale = entry_scale(entry.data(), d / G);
      // e4m3 normals: half a step is 2^-4 relative; subnormals: 2^-10 x scale absolute; the division's rounding.
      const double bound = std::ldexp(std::fabs(x), -4) + std::ldexp(scale, -10) + std::ldexp(std::fabs(x), -20);
      ASSERT_LE(std::fabs(key[d] - x), bound) << "dim " << d << " x " << x << " scale " << scale;
      if (std::fabs(x) >= std::ldexp(scale, -6)) worst = std::max(worst, std::fabs(key[d] - x) / std::fabs(x));
    }
    for (int i = 0; i < R; ++i) ASSERT_EQ(key[L + i], double(bf16(k_pe[i]))) << "RoPE is exact";
  }
  std::printf("[format] worst relative round-trip error of a latent value in the e4m3 normal range: %.3g\n", worst);
}

TEST(SparseMlaV32Format, SpecialValues) {
  std::vector<uint16_t> kv_c(L, 0), k_pe(R, 0);
  // Group 0: zeros and -0. Group 1: one NaN among ones. Group 2: all NaN. Group 3: an infinity.
  for (int i = 0; i < G; ++i) kv_c[i] = (i % 2) ? 0x8000 : 0x0000;
  for (int i = G; i < 2 * G; ++i) kv_c[i] = bf16_bits(i % 3 == 0 ? -1.0f : 1.0f);
  kv_c[G + 5] = 0x7FC0;
  for (int i = 2 * G; i < 3 * G; ++i) kv_c[i] = 0xFFC0;
  for (int i = 3 * G; i < 4 * G; ++i) kv_c[i] = bf16_bits(i % 2 ? 2.0f : -3.0f);
  kv_c[3 * G + 7] = 0x7F80;  // +inf
  std::vector<uint8_t> entry(E);
  reference::v32_quantize_token(kv_c.data(), k_pe.data(), entry.data());

  EXPECT_EQ(entry_scale(entry.data(), 0), FLT_MIN) << "an all-zero group: scale FLT_MIN";
  for (int i = 0; i < G; ++i) ASSERT_EQ(entry[i], (i % 2) ? 0x80 : 0x00) << "zeros keep their sign";
  EXPECT_EQ(entry_scale(entry.data(), 1), 1.0f / 448.0f) << "NaN is left out of amax (fmaxf)";
  EXPECT_EQ(entry[G + 5], 0x7F) << "NaN codes as NaN";
  EXPECT_EQ(entry[G + 1] & 0x7F, 0x7E) << "1.0 / (1 / 448) is 448";
  EXPECT_EQ(entry_scale(entry.data(), 2), FLT_MIN) << "an all-NaN group: fmaxf(NaN, FLT_MIN) = FLT_MIN";
  for (int i = 2 * G; i < 3 * G; ++i) ASSERT_EQ(entry[i] & 0x7F, 0x7F) << "NaN codes";
  EXPECT_EQ(entry_scale(entry.data(), 3), kInf) << "an infinity makes the scale infinite";
  EXPECT_EQ(entry[3 * G + 7], 0x7F) << "inf / inf is NaN";
  EXPECT_EQ(entry[3 * G + 0], 0x80) << "-3 / inf is -0";
  EXPECT_EQ(entry[3 * G + 1], 0x00) << "2 / inf is +0";
  double key[D];
  reference::v32_dequantize_token(entry.data(), key);
  EXPECT_FALSE(reference::v32_key_is_finite(key));

  // Tiny and huge groups: subnormal BF16 values give scale FLT_MIN; BF16's largest values stay finite.
  std::vector<uint16_t> tiny(L, 0x0001), huge(L, 0x7F7F);
  reference::v32_quantize_token(tiny.data(), k_pe.data(), entry.data());
  EXPECT_EQ(entry_scale(entry.data(), 0), FLT_MIN);
  EXPECT_EQ(entry[0], num::float_to_e4m3(bf16(0x0001) / FLT_MIN));
  reference::v32_quantize_token(huge.data(), k_pe.data(), entry.data());
  EXPECT_EQ(entry_scale(entry.data(), 0), bf16(0x7F7F) / 448.0f);
  EXPECT_EQ(entry[0], 0x7E);
  reference::v32_dequantize_token(entry.data(), key);
  EXPECT_TRUE(reference::v32_key_is_finite(key));
}

TEST(SparseMlaV32Format, DequantizeIsCodeTimesScaleForEveryCode) {
  std::vector<uint8_t> entry(E, 0);
  const float scales[4] = {1.0f / 448.0f, 3.7e-5f, 1234.5f, FLT_MIN};
  for (int g = 0; g < 4; ++g) std::memcpy(&entry[kSparseMlaV32ScaleOffset + 4 * g], &scales[g], 4);
  for (int code = 0; code < 256; ++code) {
    for (int g = 0; g < 4; ++g) entry[g * G + (code % G)] = static_cast<uint8_t>(code);
    double key[D];
    reference::v32_dequantize_token(entry.data(), key);
    for (int g = 0; g < 4; ++g) {
      const double want = double(num::e4m3_to_float(static_cast<uint8_t>(code))) * scales[g];
      const double got = key[g * G + code % G];
      ASSERT_TRUE(got == want || (std::isnan(got) && std::isnan(want))) << "code " << code << " group " << g;
    }
  }
}

TEST(SparseMlaV32Format, QGroupExponentTakesTheLargestValueTo2To14) {
  EXPECT_EQ(reference::v32_q_group_exponent(1.0f), 14);
  EXPECT_EQ(reference::v32_q_group_exponent(1.99f), 14);
  EXPECT_EQ(reference::v32_q_group_exponent(0.5f), 15);
  EXPECT_EQ(reference::v32_q_group_exponent(bf16(0x0001)), 14 + 133);  // the smallest BF16 subnormal, 2^-133
  EXPECT_EQ(reference::v32_q_group_exponent(bf16(0x7F7F)), 14 - 127);
  EXPECT_EQ(reference::v32_q_group_exponent(0.0f), 0);
  EXPECT_EQ(reference::v32_q_group_exponent(kInf), 0);
}

// ---------------------------------------------------------------------------
// The plan.

TEST(SparseMlaV32Plan, CoversEveryRowInWholeChunksWithinTheLimits) {
  for (int heads : {1, 8, 16, 17, 32, 64, 128}) {
    for (int top_k : {1, 63, 64, 65, 100, 1024, 2048, 2176, 8192, 8193, 16384}) {
      for (int64_t m : {1, 2, 4, 16, 64, 128, 65535}) {
        for (int max_splits : {1, 8, 16}) {
          const SparseMlaV32Plan plan = sparse_mla_v32_plan(m, heads, top_k, 132, max_splits);
          SCOPED_TRACE("H " + std::to_string(heads) + " K " + std::to_string(top_k) + " m " + std::to_string(m));
          EXPECT_EQ(plan.head_groups, (heads + 15) / 16);
          EXPECT_EQ(plan.rows_per_split % 64, 0);
          EXPECT_GE(plan.rows_per_split, 64);
          EXPECT_LE(plan.rows_per_split, kSparseMlaV32MaxRowsPerSplit);
          EXPECT_GE(plan.splits, 1);
          EXPECT_LE(plan.splits, kSparseMlaV32MaxSplits);
          EXPECT_GE(int64_t(plan.splits) * plan.rows_per_split, top_k);
          EXPECT_LT(int64_t(plan.splits - 1) * plan.rows_per_split, top_k) << "every split has an entry";
          EXPECT_LE(plan.splits, std::max(max_splits, (top_k + 1023) / 1024));
        }
      }
    }
  }
  // The dsv32 shapes on a 132-SM part: TP1 m = 1 fills the GPU with 8 groups x 16 splits; m = 64 at
  // TP8 streams two splits of 1024 entries.
  EXPECT_EQ(sparse_mla_v32_plan(1, 128, 2048, 132, 16).splits, 16);
  EXPECT_EQ(sparse_mla_v32_plan(64, 16, 2048, 132, 16).splits, 2);
  EXPECT_EQ(sparse_mla_v32_plan(1, 16, 2048, 132, 16).splits, 16);
}

// ---------------------------------------------------------------------------
// Argument checks (no GPU: the views' pointers are never dereferenced).

void* fake_device_pointer(uintptr_t region) { return reinterpret_cast<void*>(region << 16); }

struct FakeArgs {
  int64_t m = 4, heads = 128, top_k = 2048;
  SparseMlaV32Args args;
  SparseMlaV32CacheWriteArgs write;
  FakeArgs() {
    args.q = make_tensor(fake_device_pointer(0x10000), DType::kBF16, {m, heads, D});
    args.kv_cache = make_tensor(fake_device_pointer(0x30000), DType::kU8, {100, 64, E});
    args.indices = make_tensor(fake_device_pointer(0x50000), DType::kI32, {m, top_k});
    args.softmax_scale = kDsv32SoftmaxScale;
    args.latent = make_tensor(fake_device_pointer(0x60000), DType::kBF16, {m, heads, L});
    args.lse = make_tensor(fake_device_pointer(0x70000), DType::kF32, {m, heads});
    write.kv_c = make_tensor(fake_device_pointer(0x80000), DType::kBF16, {m, L});
    write.k_pe = make_tensor(fake_device_pointer(0x90000), DType::kBF16, {m, R});
    write.slot_mapping = make_tensor(fake_device_pointer(0xA0000), DType::kI64, {m});
    write.kv_cache = args.kv_cache;
  }
};

TEST(SparseMlaV32Checks, AcceptsTheDsv32ShapesAndTheLimits) {
  FakeArgs f;
  EXPECT_TRUE(check_sparse_mla_v32(f.args).ok()) << check_sparse_mla_v32(f.args).to_string();
  EXPECT_TRUE(check_sparse_mla_v32_cache_write(f.write).ok()) << check_sparse_mla_v32_cache_write(f.write).to_string();
  FakeArgs small;
  small.args.q = make_strided(fake_device_pointer(0x10000), DType::kBF16, {1, 1, D}, {3, 3, 1});
  small.args.indices = make_tensor(fake_device_pointer(0x50000), DType::kI32, {1, 1});
  small.args.latent = make_tensor(fake_device_pointer(0x60000), DType::kBF16, {1, 1, L});
  small.args.lse = make_tensor(fake_device_pointer(0x70000), DType::kF32, {1, 1});
  small.args.kv_cache = make_strided(fake_device_pointer(0x30000), DType::kFP8E4M3, {1, 1, E}, {5, 7, 1});
  EXPECT_TRUE(check_sparse_mla_v32(small.args).ok()) << check_sparse_mla_v32(small.args).to_string();
  FakeArgs padded;  // vLLM's padded blocks, a 672-byte entry stride
  padded.args.kv_cache = make_strided(fake_device_pointer(0x30000), DType::kU8, {100, 64, E}, {64 * 672 + 32, 672, 1});
  EXPECT_TRUE(check_sparse_mla_v32(padded.args).ok()) << check_sparse_mla_v32(padded.args).to_string();
}

TEST(SparseMlaV32Checks, NamesEachBadArgument) {
  auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f.args);
    testing::expect_rejected(check_sparse_mla_v32(f.args), argument, words);
  };
  rejected([](SparseMlaV32Args& a) { a.q.dtype = DType::kFP8E4M3; }, "q", "bf16");
  rejected([](SparseMlaV32Args& a) { a.q.shape[2] = 512; }, "q", "shape [*, *, 576]");
  rejected([](SparseMlaV32Args& a) { a.q.shape[1] = 129; }, "q", "1..128 heads");
  rejected([](SparseMlaV32Args& a) { a.q.shape[0] = 0; }, "q", "1..65535 tokens");
  rejected([](SparseMlaV32Args& a) { a.q.strides[1] = 580; }, "q", "multiples of 8");
  rejected([](SparseMlaV32Args& a) { a.q.strides[1] = 568; }, "q", "do not overlap");
  rejected([](SparseMlaV32Args& a) { a.q.strides[2] = 2; }, "q", "stride 1 in dim 2");
  rejected([](SparseMlaV32Args& a) { a.q.data = static_cast<char*>(a.q.data) + 8; }, "q", "aligned to 16");
  rejected([](SparseMlaV32Args& a) { a.q.device.kind = DeviceKind::kCPU; }, "q", "a CUDA tensor");
  rejected([](SparseMlaV32Args& a) { a.q = TensorView{}; }, "q", "null");
  rejected([](SparseMlaV32Args& a) { a.kv_cache.dtype = DType::kBF16; }, "kv_cache", "u8 or fp8_e4m3");
  rejected([](SparseMlaV32Args& a) { a.kv_cache.shape[2] = 576; }, "kv_cache", "shape [*, *, 656]");
  rejected([](SparseMlaV32Args& a) { a.kv_cache.strides[1] = 664; }, "kv_cache", "multiples of 16");
  rejected([](SparseMlaV32Args& a) { a.kv_cache.strides[1] = 640; }, "kv_cache", "do not overlap");
  rejected([](SparseMlaV32Args& a) { a.kv_cache.strides[0] = 63 * 656; }, "kv_cache", "do not overlap");
  // Found by Fuzz.SparseMlaV32CacheWriteChecks (DSA_TEST_SEED=29).
  rejected([](SparseMlaV32Args& a) { a.kv_cache.shape[1] = 2; a.kv_cache.strides[1] = int64_t{1} << 62; }, "kv_cache",
           "do not overlap");  // 2 x 2^62 wrapped past the overlap test
  rejected([](SparseMlaV32Args& a) { a.kv_cache.shape[1] = 0; }, "kv_cache", "at least one block");
  rejected([](SparseMlaV32Args& a) { a.kv_cache.data = static_cast<char*>(a.kv_cache.data) + 8; }, "kv_cache",
           "aligned to 16");
  rejected([](SparseMlaV32Args& a) { a.indices.dtype = DType::kI64; }, "indices", "i32");
  rejected([](SparseMlaV32Args& a) { a.indices.shape[0] = 3; }, "indices", "shape [4, *]");
  rejected([](SparseMlaV32Args& a) { a.indices.shape[1] = kSparseMlaV32MaxTopK + 1; }, "indices", "1..16384");
  rejected([](SparseMlaV32Args& a) { a.indices.strides[0] = 2000; }, "indices", "token stride of at least K");
  rejected([](SparseMlaV32Args& a) { a.softmax_scale = 0.0f; }, "softmax_scale", "finite value > 0");
  rejected([](SparseMlaV32Args& a) { a.softmax_scale = kNaN; }, "softmax_scale", "finite value > 0");
  rejected([](SparseMlaV32Args& a) { a.latent.dtype = DType::kF32; }, "latent", "bf16");
  rejected([](SparseMlaV32Args& a) { a.latent.shape[1] = 16; }, "latent", "shape [4, 128, 512]");
  rejected([](SparseMlaV32Args& a) { a.latent.strides[0] = 128 * 512 + 4; }, "latent", "multiple of 8");
  rejected([](SparseMlaV32Args& a) { a.latent.data = a.kv_cache.data; }, "latent", "disjoint from 'kv_cache'");
  rejected([](SparseMlaV32Args& a) { a.lse.data = a.indices.data; }, "lse", "disjoint from 'indices'");
  rejected([](SparseMlaV32Args& a) { a.lse.shape[1] = 64; }, "lse", "shape [4, 128]");
  rejected([](SparseMlaV32Args& a) { a.lse.strides[0] = 129; }, "lse", "contiguous");
  rejected(
      [](SparseMlaV32Args& a) {
        a.error_count = reinterpret_cast<unsigned int*>(static_cast<char*>(fake_device_pointer(0xB0000)) + 2);
      },
      "error_count", "4-byte aligned");

  auto write_rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f.write);
    testing::expect_rejected(check_sparse_mla_v32_cache_write(f.write), argument, words);
  };
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.kv_c.dtype = DType::kF16; }, "kv_c", "bf16");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.kv_c.shape[1] = 576; }, "kv_c", "shape [*, 512]");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.kv_c.strides[0] = 516; }, "kv_c", "multiple of 8");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.k_pe.shape[0] = 3; }, "k_pe", "shape [4, 64]");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.k_pe.data = static_cast<char*>(a.k_pe.data) + 4; }, "k_pe",
                 "aligned to 16");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.slot_mapping.dtype = DType::kI32; }, "slot_mapping", "i64");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.slot_mapping.strides[0] = 2; }, "slot_mapping",
                 "contiguous vector");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.kv_cache.shape[2] = 512; }, "kv_cache", "shape [*, *, 656]");
  write_rejected([](SparseMlaV32CacheWriteArgs& a) { a.kv_cache.data = a.kv_c.data; }, "kv_cache",
                 "disjoint from 'kv_c'");
}

// ---------------------------------------------------------------------------
// Problems: a cache written by the CPU model, q at a chosen score spread.

struct Problem {
  int m = 1, heads = 16, top_k = 64;
  int64_t blocks = 1, block_size = 64, entry_stride = E, block_stride = 64 * E;
  int64_t q_head_stride = D, q_token_stride = 16 * D, indices_token_stride = 64, latent_token_stride = 16 * L;
  float softmax_scale = kDsv32SoftmaxScale;
  std::vector<uint16_t> q;
  std::vector<uint8_t> cache;
  std::vector<int32_t> indices;

  int64_t capacity() const { return blocks * block_size; }
  uint8_t* entry(int64_t slot) { return &cache[slot / block_size * block_stride + slot % block_size * entry_stride]; }
  int32_t& index(int t, int j) { return indices[size_t(t) * indices_token_stride + j]; }
  uint16_t* q_row(int t, int h) { return &q[size_t(t) * q_token_stride + size_t(h) * q_head_stride]; }
  reference::SparseMlaV32Host host() const {
    return {q.data(), q_token_stride, q_head_stride, cache.data(),   blocks,      block_size,   block_stride,
            entry_stride, indices.data(), indices_token_stride, m, heads, top_k, softmax_scale};
  }
};

// Slots [0, capacity) hold tokens of kv_c ~ N(0, s_t) (s_t per token in
// [0.25, 4], so the scales differ) and k_pe ~ N(0, 1), quantized by the
// model; q ~ N(0, sigma) scaled so that the scores' standard deviation is
// `spread`; index rows of random valid slots; `padded` pads every stride.
// `varied`: each 128-value group of a token's kv_c gets its own magnitude
// (2^-3..2^3 x s_t: the four scales of an entry differ by up to 2^6) and each
// (head, group) of q its own (2^-5..2^2), so that a kernel that applied
// another group's scale, or another head's or group's power of two to q,
// fails. `block_size` 0: 64 padded, 256 packed (else that size, e.g. one
// that is not a power of two: the kernel's division path).
Problem random_problem(int m, int heads, int top_k, float spread, bool padded, std::mt19937_64& rng,
                       int64_t cache_slots = 4096, bool varied = false, int64_t block_size = 0) {
  Problem p;
  p.m = m, p.heads = heads, p.top_k = top_k;
  p.block_size = block_size > 0 ? block_size : padded ? 64 : 256;
  p.blocks = (cache_slots + p.block_size - 1) / p.block_size;
  p.entry_stride = padded ? 672 : E;
  p.block_stride = p.block_size * p.entry_stride + (padded ? 32 : 0);
  p.q_head_stride = D + (padded ? 64 : 0);
  p.q_token_stride = heads * p.q_head_stride + (padded ? 8 : 0);
  p.indices_token_stride = top_k + (padded ? 3 : 0);
  p.latent_token_stride = int64_t(heads) * L + (padded ? 8 : 0);
  p.cache.assign(size_t(p.blocks) * p.block_stride, 0x5A);
  std::uniform_real_distribution<float> magnitude(-2.0f, 2.0f), group_magnitude(-3.0f, 3.0f),
      q_group_magnitude(-5.0f, 2.0f);
  for (int64_t slot = 0; slot < p.capacity(); ++slot) {
    std::vector<uint16_t> kv_c = testing::random_bf16(L, std::exp2(magnitude(rng)), rng);
    if (varied) {
      for (int g = 0; g < L / G; ++g) {
        const float factor = std::exp2(group_magnitude(rng));
        for (int i = g * G; i < (g + 1) * G; ++i) kv_c[i] = bf16_bits(bf16(kv_c[i]) * factor);
      }
    }
    const std::vector<uint16_t> k_pe = testing::random_bf16(R, 1.0f, rng);
    reference::v32_quantize_token(kv_c.data(), k_pe.data(), p.entry(slot));
  }
  // q in float (N(0, 1) x the (head, group) factor), then one factor for all
  // of q that takes the RMS of softmax_scale q . k over 64 random slots per
  // (token, head) to `spread`, then BF16.
  std::vector<float> q_float(size_t(m) * heads * D);
  for (int t = 0; t < m; ++t) {
    for (int h = 0; h < heads; ++h) {
      const std::vector<float> row = testing::normal_floats(D, 0.0f, 1.0f, rng);
      float* q = &q_float[(size_t(t) * heads + h) * D];
      for (int d = 0; d < D; ++d) q[d] = row[d];
      if (!varied) continue;
      for (int g = 0; g < L / G; ++g) {
        const float factor = std::exp2(q_group_magnitude(rng));
        for (int i = g * G; i < (g + 1) * G; ++i) q[i] *= factor;
      }
    }
  }
  std::uniform_int_distribution<int32_t> slot(0, int32_t(p.capacity()) - 1);
  double squares = 0;
  int64_t samples = 0;
  for (size_t row = 0; row < size_t(m) * heads; ++row) {
    for (int k = 0; k < 64; ++k) {
      double key[D];
      reference::v32_dequantize_token(p.entry(slot(rng)), key);
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += double(q_float[row * D + d]) * key[d];
      squares += (p.softmax_scale * dot) * (p.softmax_scale * dot);
      ++samples;
    }
  }
  const double factor = spread / std::sqrt(squares / double(samples));
  p.q.assign(size_t(m) * p.q_token_stride, bf16_bits(0.0f));
  for (int t = 0; t < m; ++t) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < D; ++d) {
        p.q_row(t, h)[d] = bf16_bits(static_cast<float>(q_float[(size_t(t) * heads + h) * D + d] * factor));
      }
    }
  }
  p.indices.assign(size_t(m) * p.indices_token_stride, -1);
  for (int t = 0; t < m; ++t) {
    for (int j = 0; j < top_k; ++j) p.index(t, j) = slot(rng);
  }
  return p;
}

struct Errors {
  double latent = 0, lse = 0;
};

// got vs want: NaN and empty rows exactly, others' latent as one relative
// Frobenius error and the worst lse error; failures name the row.
Errors compare(const Problem& p, const std::vector<uint16_t>& got_latent, int64_t got_token_stride,
               const std::vector<float>& got_lse, const reference::SparseMlaV32Result& want) {
  Errors errors;
  double error_squares = 0, reference_squares = 0;
  int bad_rows = 0;
  for (int t = 0; t < p.m; ++t) {
    for (int h = 0; h < p.heads; ++h) {
      const int row = t * p.heads + h;
      const uint16_t* g = &got_latent[size_t(t) * got_token_stride + size_t(h) * L];
      const uint16_t* w = &want.latent[size_t(row) * L];
      const float want_lse = want.lse[row], got_lse_row = got_lse[row];
      bool ok = true;
      if (std::isnan(want_lse)) {
        ok = std::isnan(got_lse_row) && std::all_of(g, g + L, [](uint16_t v) { return std::isnan(bf16(v)); });
      } else if (want_lse == -kInf) {
        ok = got_lse_row == -kInf && std::all_of(g, g + L, [](uint16_t v) { return v == 0; });
      } else {
        errors.lse = std::max(errors.lse, double(std::fabs(got_lse_row - want_lse)));
        ok = std::fabs(got_lse_row - want_lse) <= 1e-3f;
        for (int d = 0; d < L; ++d) {
          const double difference = double(bf16(g[d])) - bf16(w[d]);
          error_squares += difference * difference;  // NaN or inf makes the total fail
          reference_squares += double(bf16(w[d])) * bf16(w[d]);
        }
      }
      if (!ok && bad_rows++ < 5) {
        ADD_FAILURE() << "token " << t << " head " << h << ": lse " << got_lse_row << ", reference " << want_lse
                      << ", latent[0] " << bf16(g[0]) << ", reference " << bf16(w[0]);
      }
    }
  }
  errors.latent = reference_squares > 0 ? std::sqrt(error_squares / reference_squares) : std::sqrt(error_squares);
  EXPECT_LE(errors.latent, 5e-3) << "relative Frobenius error of the latent";
  return errors;
}

// ---------------------------------------------------------------------------
// The GPU kernel's arithmetic on the CPU against float64: the design keeps the
// contract (FP16 scaled q, FP32 group partials, FP16 p x scale / max, splits).

TEST(SparseMlaV32KernelModel, WithinTheContractOfFloat64) {
  std::mt19937_64 rng(testing::test_seed());
  const bool quick = testing::quick_mode();
  for (const float spread : {1.0f, 3.0f, 10.0f}) {
    for (const int heads : {16, 128}) {
      if (quick && heads == 128) continue;
      const int m = heads == 128 ? 1 : 2;
      Problem p = random_problem(m, heads, 2048, spread, false, rng);
      p.index(0, 5) = -1;
      p.index(m - 1, 100) = int32_t(p.capacity());
      const reference::SparseMlaV32Result want = reference::sparse_mla_v32(p.host());
      for (const int rows_per_split : {128, 1024}) {
        const reference::SparseMlaV32Result got = reference::sparse_mla_v32_kernel_model(p.host(), rows_per_split);
        EXPECT_EQ(got.out_of_range, 1);
        const Errors e = compare(p, got.latent, int64_t(heads) * L, got.lse, want);
        std::printf("[kernel model, H %d, spread %.0f, %d rows a split] latent %.3g relative, lse %.3g\n", heads,
                    spread, rows_per_split, e.latent, e.lse);
      }
    }
  }
}

// Token 0: entries [128, 384) padding and [384, 512) past the cache, so that
// whole splits (of 64, 128 or 256 entries) have no valid entry while the
// others do; token 1 (when m > 1): entries [0, 512) invalid.
void empty_splits(Problem& p) {
  for (int j = 128; j < std::min(p.top_k, 512); ++j) p.index(0, j) = j < 384 ? -1 : int32_t(p.capacity()) + j;
  for (int j = 0; p.m > 1 && j < std::min(p.top_k, 512); ++j) p.index(1, j) = (j % 2) ? -3 : int32_t(p.capacity());
}

// The design keeps the contract where the four scales of an entry differ by
// up to 2^6 and q's (head, group) magnitudes by 2^7, with a block size that
// is not a power of two and splits without a valid entry.
TEST(SparseMlaV32KernelModel, VariedMagnitudesOddBlocksAndEmptySplits) {
  std::mt19937_64 rng(testing::test_seed());
  for (const float spread : {1.0f, 10.0f}) {
    Problem p = random_problem(2, 24, 1000, spread, true, rng, 2000, /*varied=*/true, /*block_size=*/48);
    empty_splits(p);
    const reference::SparseMlaV32Result want = reference::sparse_mla_v32(p.host());
    EXPECT_EQ(want.out_of_range, 128 + 256);
    for (const int rows_per_split : {64, 256, 1024}) {
      const reference::SparseMlaV32Result got = reference::sparse_mla_v32_kernel_model(p.host(), rows_per_split);
      EXPECT_EQ(got.out_of_range, want.out_of_range);
      const Errors e = compare(p, got.latent, int64_t(24) * L, got.lse, want);
      std::printf("[kernel model, varied, spread %.0f, %d rows a split] latent %.3g relative, lse %.3g\n", spread,
                  rows_per_split, e.latent, e.lse);
    }
  }
}

TEST(SparseMlaV32Reference, EdgeCases) {
  std::mt19937_64 rng(testing::test_seed());
  Problem p = random_problem(4, 16, 70, 3.0f, false, rng, 512);
  // Token 0: every entry invalid (negative or past the cache). Token 1: a NaN q in head 3.
  // Token 2: one selected entry with an infinite scale. Token 3: the same slot twice.
  for (int j = 0; j < p.top_k; ++j) p.index(0, j) = (j % 2) ? -1 : int32_t(p.capacity() + j);
  p.q_row(1, 3)[100] = 0x7FC0;
  const float inf = kInf;
  std::memcpy(p.entry(7) + kSparseMlaV32ScaleOffset + 8, &inf, 4);
  p.index(2, 9) = 7;
  for (int j = 0; j < p.top_k; ++j) {
    for (const int t : {1, 3}) {
      if (p.index(t, j) == 7) p.index(t, j) = 8;  // tokens 1 and 3 never see the bad entry
    }
  }
  p.index(3, 1) = p.index(3, 0);
  {
    const reference::SparseMlaV32Result r = reference::sparse_mla_v32(p.host());
    EXPECT_EQ(r.out_of_range, 35);
    for (int h = 0; h < 16; ++h) {
      EXPECT_EQ(r.lse[h], -kInf);
      EXPECT_EQ(r.latent[size_t(h) * L], 0);
      EXPECT_EQ(std::isnan(r.lse[16 + h]), h == 3) << "a NaN q makes its own head NaN";
      EXPECT_TRUE(std::isnan(r.lse[32 + h])) << "an infinite scale makes its token NaN";
      EXPECT_TRUE(std::isfinite(r.lse[48 + h]));
    }
  }
  const reference::SparseMlaV32Result model = reference::sparse_mla_v32_kernel_model(p.host(), 64);
  compare(p, model.latent, 16 * L, model.lse, reference::sparse_mla_v32(p.host()));
  EXPECT_EQ(model.out_of_range, 35);
}

// ---------------------------------------------------------------------------
// GPU.

struct GpuRun {
  std::vector<uint16_t> latent;  // [m, latent_token_stride] with the stride's padding
  std::vector<float> lse;
  unsigned int out_of_range = 0;
};

constexpr uint16_t kPoison = 0x7F81;  // a signalling-NaN pattern no kernel writes

// Runs sparse_mla_v32 (max_splits 0: the default) on p; padding of the
// latent rows must keep the poison.
GpuRun run_gpu(const Problem& p, int max_splits = 0) {
  GpuRun run;
  DeviceBuffer<uint16_t> q(p.q);
  DeviceBuffer<uint8_t> cache(p.cache);
  DeviceBuffer<int32_t> indices(p.indices);
  DeviceBuffer<uint16_t> latent(size_t(p.m) * p.latent_token_stride);
  DeviceBuffer<float> lse(size_t(p.m) * p.heads);
  DeviceBuffer<unsigned int> errors(1);
  latent.upload(std::vector<uint16_t>(latent.size(), kPoison));
  lse.fill_bytes(0xFF);
  errors.fill_bytes(0);
  SparseMlaV32Args a;
  a.q = make_strided(q.get(), DType::kBF16, {p.m, p.heads, D}, {p.q_token_stride, p.q_head_stride, 1});
  a.kv_cache = make_strided(cache.get(), DType::kU8, {p.blocks, p.block_size, E}, {p.block_stride, p.entry_stride, 1});
  a.indices = make_strided(indices.get(), DType::kI32, {p.m, p.top_k}, {p.indices_token_stride, 1});
  a.softmax_scale = p.softmax_scale;
  a.latent = make_strided(latent.get(), DType::kBF16, {p.m, p.heads, L}, {p.latent_token_stride, L, 1});
  a.lse = make_tensor(lse.get(), DType::kF32, {p.m, p.heads});
  a.error_count = errors.get();
  const Status s = max_splits > 0 ? sparse_mla_v32_with_max_splits(a, max_splits, nullptr) : sparse_mla_v32(a, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  testing::expect_cuda(cudaDeviceSynchronize(), "sparse_mla_v32");
  run.latent = latent.download();
  run.lse = lse.download();
  run.out_of_range = errors.download()[0];
  for (int t = 0; t < p.m; ++t) {
    for (int64_t i = int64_t(p.heads) * L; i < p.latent_token_stride; ++i) {
      if (run.latent[size_t(t) * p.latent_token_stride + i] != kPoison) {
        ADD_FAILURE() << "latent padding of token " << t << " written";
        break;
      }
    }
  }
  return run;
}

Errors expect_gpu_within_contract(const Problem& p, int max_splits = 0) {
  const reference::SparseMlaV32Result want = reference::sparse_mla_v32(p.host());
  const GpuRun got = run_gpu(p, max_splits);
  EXPECT_EQ(got.out_of_range, static_cast<unsigned>(want.out_of_range)) << "error counter";
  if (got.latent.empty()) return {};
  return compare(p, got.latent, p.latent_token_stride, got.lse, want);
}

TEST(SparseMlaV32Gpu, CacheWriteIsBitwiseTheModel) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  for (const bool padded : {false, true}) {
    for (const int64_t slots_given : {int64_t(40), int64_t(30)}) {  // len(slot_mapping) above and below m
      const int m = 37, block_size = 16, blocks = 8;
      const int64_t entry_stride = padded ? 672 : E, block_stride = block_size * entry_stride + (padded ? 32 : 0);
      const int64_t kv_stride = padded ? L + 8 : L, pe_stride = padded ? R + 16 : R;
      std::vector<uint16_t> kv_c(size_t(m) * kv_stride, 0), k_pe(size_t(m) * pe_stride, 0);
      std::uniform_real_distribution<float> magnitude(-12.0f, 12.0f);
      for (int t = 0; t < m; ++t) {
        const std::vector<uint16_t> row = testing::random_bf16(L, std::exp2(magnitude(rng)), rng);
        const std::vector<uint16_t> pe = testing::random_bf16(R, 1.0f, rng);
        std::copy(row.begin(), row.end(), &kv_c[t * kv_stride]);
        std::copy(pe.begin(), pe.end(), &k_pe[t * pe_stride]);
      }
      // Special values: NaN, infinities, zeros, subnormals, BF16's largest.
      kv_c[0 * kv_stride + 3] = 0x7FC0;
      for (int i = 128; i < 256; ++i) kv_c[1 * kv_stride + i] = 0xFFC0;
      kv_c[2 * kv_stride + 300] = 0xFF80;
      for (int i = 0; i < L; ++i) kv_c[3 * kv_stride + i] = (i % 2) ? 0x8000 : 0x0001;
      for (int i = 0; i < L; ++i) kv_c[4 * kv_stride + i] = (i % 3) ? 0x7F7F : 0xFF7F;
      k_pe[5 * pe_stride + 7] = 0x7FC1;
      // Slots: distinct random ones, with padding (-1) and slots past the cache (counted, skipped).
      std::vector<int64_t> slot_mapping(slots_given);
      std::vector<int64_t> free_slots(blocks * block_size);
      for (size_t i = 0; i < free_slots.size(); ++i) free_slots[i] = int64_t(i);
      std::shuffle(free_slots.begin(), free_slots.end(), rng);
      for (int64_t t = 0; t < slots_given; ++t) slot_mapping[t] = free_slots[t];
      slot_mapping[6] = -1;
      slot_mapping[9] = blocks * block_size;
      slot_mapping[10] = int64_t(1) << 40;
      unsigned int want_errors = 0;
      std::vector<uint8_t> want(size_t(blocks) * block_stride, 0xEE);
      for (int64_t t = 0; t < std::min<int64_t>(m, slots_given); ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot >= int64_t(blocks) * block_size) ++want_errors;
        if (slot < 0 || slot >= int64_t(blocks) * block_size) continue;
        reference::v32_quantize_token(&kv_c[t * kv_stride], &k_pe[t * pe_stride],
                                      &want[slot / block_size * block_stride + slot % block_size * entry_stride]);
      }
      DeviceBuffer<uint16_t> kv_c_d(kv_c), k_pe_d(k_pe);
      DeviceBuffer<int64_t> slots_d(slot_mapping);
      DeviceBuffer<uint8_t> cache_d(want.size());
      cache_d.fill_bytes(0xEE);
      DeviceBuffer<unsigned int> errors(1);
      errors.fill_bytes(0);
      SparseMlaV32CacheWriteArgs a;
      a.kv_c = make_strided(kv_c_d.get(), DType::kBF16, {m, L}, {kv_stride, 1});
      a.k_pe = make_strided(k_pe_d.get(), DType::kBF16, {m, R}, {pe_stride, 1});
      a.slot_mapping = make_tensor(slots_d.get(), DType::kI64, {slots_given});
      a.kv_cache = make_strided(cache_d.get(), DType::kU8, {blocks, block_size, E}, {block_stride, entry_stride, 1});
      a.error_count = errors.get();
      DSA_ASSERT_OK(sparse_mla_v32_cache_write(a, nullptr));
      DSA_ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<uint8_t> got = cache_d.download();
      size_t mismatches = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != want[i] && mismatches++ < 5) {
          ADD_FAILURE() << "byte " << i << " (slot " << (i / block_stride) * block_size + (i % block_stride) / entry_stride
                        << ", offset " << (i % block_stride) % entry_stride << "): got " << int(got[i]) << ", model "
                        << int(want[i]);
        }
      }
      EXPECT_EQ(mismatches, 0u) << (padded ? "padded" : "packed") << " cache, " << slots_given << " slots";
      EXPECT_EQ(errors.download()[0], want_errors);
    }
  }
}

TEST(SparseMlaV32Gpu, AttentionWithinTheContractAtEveryHeadCount) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const bool quick = testing::quick_mode();
  double worst_latent = 0, worst_lse = 0;
  for (const int heads : {16, 32, 64, 128, 1, 24}) {
    for (const int m : {1, 3}) {
      for (const int top_k : {2048, 100, 1}) {
        for (const float spread : {1.0f, 3.0f, 10.0f}) {
          if (quick && (spread != 10.0f || m != 1)) continue;
          const bool padded = (heads + m + top_k) % 2 == 1;
          Problem p = random_problem(m, heads, top_k, spread, padded, rng);
          // Padding and entries past the cache in the middle of the rows.
          for (int t = 0; t < m && top_k > 10; ++t) {
            p.index(t, 3) = -1;
            p.index(t, top_k / 2) = int32_t(p.capacity()) + t;
            p.index(t, top_k - 1) = -7;
          }
          SCOPED_TRACE("H " + std::to_string(heads) + " m " + std::to_string(m) + " K " + std::to_string(top_k) +
                       " spread " + std::to_string(spread) + (padded ? " padded" : ""));
          const Errors e = expect_gpu_within_contract(p);
          worst_latent = std::max(worst_latent, e.latent);
          worst_lse = std::max(worst_lse, e.lse);
        }
      }
    }
  }
  std::printf("[sparse_mla_v32] worst latent relative Frobenius %.3g, worst lse error %.3g\n", worst_latent, worst_lse);
}

TEST(SparseMlaV32Gpu, EveryPlanShapeWithinTheContractAndRepeatable) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  for (const int heads : {16, 128}) {
    Problem p = random_problem(2, heads, 2048, 3.0f, true, rng);
    for (const int max_splits : {1, 2, 3, 4, 8, 16}) {
      SCOPED_TRACE("H " + std::to_string(heads) + " max_splits " + std::to_string(max_splits));
      expect_gpu_within_contract(p, max_splits);
      const GpuRun first = run_gpu(p, max_splits), second = run_gpu(p, max_splits);
      EXPECT_EQ(first.latent, second.latent) << "the same bits on every run";
      EXPECT_EQ(std::memcmp(first.lse.data(), second.lse.data(), first.lse.size() * 4), 0);
    }
  }
  // Many items: one or two splits a (token, group), K past one split's 1024 entries.
  if (testing::quick_mode()) return;  // compute-sanitizer: the shapes above suffice
  Problem wide = random_problem(64, 16, 2048, 3.0f, false, rng, 16384);
  expect_gpu_within_contract(wide);
  Problem longest = random_problem(1, 16, kSparseMlaV32MaxTopK, 3.0f, false, rng, 20000);
  expect_gpu_within_contract(longest);
}

TEST(SparseMlaV32Gpu, NanRulesEmptyRowsAndDuplicates) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  Problem p = random_problem(6, 32, 300, 3.0f, false, rng, 1024);
  // Token 0: no valid entry. Token 1: NaN in q of head 3, +inf in q of head 20's RoPE.
  // Token 2: a NaN code in a selected entry. Token 3: an infinite RoPE value in a selected entry.
  // Token 4: a NaN scale in a selected entry. Token 5: duplicates, and the bad slots unselected.
  const int32_t nan_code = 11, inf_rope = 12, nan_scale = 13;
  for (int j = 0; j < p.top_k; ++j) p.index(0, j) = (j % 3) ? -1 : int32_t(p.capacity()) + j;
  p.q_row(1, 3)[17] = 0x7FC0;
  p.q_row(1, 20)[L + 5] = 0x7F80;
  p.entry(nan_code)[200] = 0x7F;
  std::memcpy(p.entry(inf_rope) + kSparseMlaV32RopeOffset + 2 * 33, "\x80\xFF", 2);  // -inf
  const float nan = kNaN;
  std::memcpy(p.entry(nan_scale) + kSparseMlaV32ScaleOffset + 12, &nan, 4);
  p.index(2, 250) = nan_code;
  p.index(3, 0) = inf_rope;
  p.index(4, 299) = nan_scale;
  for (int t = 0; t < 6; ++t) {
    if (t == 2 || t == 3 || t == 4) continue;
    for (int j = 0; j < p.top_k; ++j) {
      const int32_t s = p.index(t, j);
      if (s == nan_code || s == inf_rope || s == nan_scale) p.index(t, j) = 14;
    }
  }
  for (int j = 0; j < 40; ++j) p.index(5, j) = 99;
  const reference::SparseMlaV32Result want = reference::sparse_mla_v32(p.host());
  for (int h = 0; h < 32; ++h) {
    ASSERT_EQ(want.lse[h], -kInf);
    ASSERT_EQ(std::isnan(want.lse[32 + h]), h == 3 || h == 20);
    ASSERT_TRUE(std::isnan(want.lse[64 + h]) && std::isnan(want.lse[96 + h]) && std::isnan(want.lse[128 + h]));
    ASSERT_TRUE(std::isfinite(want.lse[160 + h]));
  }
  const GpuRun got = run_gpu(p);
  EXPECT_EQ(got.out_of_range, static_cast<unsigned>(want.out_of_range));
  if (!got.latent.empty()) compare(p, got.latent, p.latent_token_stride, got.lse, want);
  for (size_t i = 0; i < got.latent.size(); ++i) {
    if (std::isnan(bf16(got.latent[i])) && got.latent[i] != num::kBF16CanonicalNaN && got.latent[i] != kPoison) {
      ADD_FAILURE() << "a NaN latent is 0x7FFF, got " << got.latent[i];
      break;
    }
  }
}

// Varied magnitudes (the scale of each entry's group and the power of two of
// each (head, group) of q applied to the right dims), a block size of 48
// (the division path), splits without a valid entry beside splits with some,
// K = 1000 (a last split of 40 entries at 16 splits), every plan shape.
TEST(SparseMlaV32Gpu, VariedMagnitudesOddBlocksAndEmptySplits) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 7);
  for (const int heads : {24, 128, 1}) {
    if (testing::quick_mode() && heads == 128) continue;
    Problem p = random_problem(2, heads, 1000, 3.0f, true, rng, 2000, /*varied=*/true, /*block_size=*/48);
    empty_splits(p);
    for (const int max_splits : {1, 4, 16}) {
      SCOPED_TRACE("H " + std::to_string(heads) + " max_splits " + std::to_string(max_splits));
      expect_gpu_within_contract(p, max_splits);
    }
  }
}

// The decode chain under PDL: a kernel that releases its dependents at once
// and writes kv_c and q late, then the cache write of those kv_c rows into
// slots 0..63, then the attention over index rows that select those slots
// and q. The cache write must read the new kv_c, and the attention the new q
// and the new entries (its griddepcontrol.wait waits for the cache write,
// which waited for the writer): bits equal to a run on the final inputs.
TEST(SparseMlaV32Gpu, ReadsInputsThatThePreviousKernelsWrite) {
  DSA_REQUIRE_GPU();
  constexpr long long kSpinCycles = 200000;  // about 100 us
  constexpr int kWritten = 64;
  std::mt19937_64 rng(testing::test_seed() + 40);
  for (const int heads : {16, 128}) {
    if (testing::quick_mode() && heads == 128) continue;
    SCOPED_TRACE("H " + std::to_string(heads));
    const Problem old = random_problem(2, heads, 2048, 3.0f, false, rng, 1024);
    Problem p = random_problem(2, heads, 2048, 3.0f, false, rng, 1024);
    p.cache = old.cache;  // the old entries but slots 0..63, which the cache write replaces
    std::vector<uint16_t> kv_c(size_t(kWritten) * L), k_pe(size_t(kWritten) * R), old_kv_c(kv_c.size());
    for (int t = 0; t < kWritten; ++t) {
      const std::vector<uint16_t> row = testing::random_bf16(L, 1.5f, rng), pe = testing::random_bf16(R, 1.0f, rng);
      const std::vector<uint16_t> stale = testing::random_bf16(L, 3.0f, rng);
      std::copy(row.begin(), row.end(), &kv_c[size_t(t) * L]);
      std::copy(pe.begin(), pe.end(), &k_pe[size_t(t) * R]);
      std::copy(stale.begin(), stale.end(), &old_kv_c[size_t(t) * L]);
      reference::v32_quantize_token(row.data(), pe.data(), p.entry(t));
    }
    for (int t = 0; t < p.m; ++t) {
      for (int j = 0; j < 2 * kWritten; ++j) p.index(t, j * 16) = j % kWritten;
    }
    const GpuRun alone = run_gpu(p);

    DeviceBuffer<uint16_t> q(old.q), new_q(p.q), kv_c_d(old_kv_c), new_kv_c(kv_c), k_pe_d(k_pe);
    DeviceBuffer<uint8_t> cache(old.cache);
    DeviceBuffer<int32_t> indices(p.indices);
    std::vector<int64_t> slots(kWritten);
    for (int t = 0; t < kWritten; ++t) slots[t] = t;
    DeviceBuffer<int64_t> slot_mapping(slots);
    DeviceBuffer<uint16_t> latent(size_t(p.m) * p.latent_token_stride);
    DeviceBuffer<float> lse(size_t(p.m) * p.heads);
    SparseMlaV32CacheWriteArgs w;
    w.kv_c = make_tensor(kv_c_d.get(), DType::kBF16, {kWritten, L});
    w.k_pe = make_tensor(k_pe_d.get(), DType::kBF16, {kWritten, R});
    w.slot_mapping = make_tensor(slot_mapping.get(), DType::kI64, {kWritten});
    w.kv_cache =
        make_strided(cache.get(), DType::kU8, {p.blocks, p.block_size, E}, {p.block_stride, p.entry_stride, 1});
    SparseMlaV32Args a;
    a.q = make_strided(q.get(), DType::kBF16, {p.m, p.heads, D}, {p.q_token_stride, p.q_head_stride, 1});
    a.kv_cache = w.kv_cache;
    a.indices = make_strided(indices.get(), DType::kI32, {p.m, p.top_k}, {p.indices_token_stride, 1});
    a.softmax_scale = p.softmax_scale;
    a.latent = make_strided(latent.get(), DType::kBF16, {p.m, p.heads, L}, {p.latent_token_stride, L, 1});
    a.lse = make_tensor(lse.get(), DType::kF32, {p.m, p.heads});
    cudaStream_t stream = nullptr;  // blocking: it orders after the uploads on the legacy stream
    DSA_ASSERT_CUDA(cudaStreamCreate(&stream));
    for (int round = 0; round < 2; ++round) {  // the first launches load modules
      q.upload(old.q);
      kv_c_d.upload(old_kv_c);
      cache.upload(old.cache);
      latent.upload(std::vector<uint16_t>(latent.size(), kPoison));
      DSA_ASSERT_CUDA(testing::launch_late_writer(new_kv_c.get(), kv_c_d.get(), int(kv_c.size() * 2 / 16), new_q.get(),
                                                  q.get(), int(p.q.size() * 2 / 16), kSpinCycles, 8, 256, stream));
      DSA_ASSERT_OK(sparse_mla_v32_cache_write(w, stream));
      DSA_ASSERT_OK(sparse_mla_v32(a, stream));
      DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(latent.download() == alone.latent) << "round " << round;
      const std::vector<float> got_lse = lse.download();
      EXPECT_EQ(std::memcmp(got_lse.data(), alone.lse.data(), got_lse.size() * 4), 0) << "round " << round;
    }
    cudaStreamDestroy(stream);
  }
}

// The cache write and the attention captured into one graph (after a direct
// run, as the header asks) and replayed three times over poisoned outputs:
// the direct run's bits. H = 16, m = 1 takes 16 splits (a non-portable
// cluster where the part schedules one), H = 128, m = 2 eight groups.
TEST(SparseMlaV32Gpu, CapturedGraphReplaysTheSameResult) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 30);
  cudaStream_t stream;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const auto& [heads, m] : {std::pair<int, int>{16, 1}, std::pair<int, int>{128, 2}}) {
    SCOPED_TRACE("H " + std::to_string(heads) + " m " + std::to_string(m));
    Problem p = random_problem(m, heads, 2048, 3.0f, false, rng, 1024);
    const int written = 32;
    std::vector<uint16_t> kv_c = testing::random_bf16(size_t(written) * L, 1.0f, rng);
    std::vector<uint16_t> k_pe = testing::random_bf16(size_t(written) * R, 1.0f, rng);
    std::vector<int64_t> slots(written);
    for (int t = 0; t < written; ++t) slots[t] = 100 + 3 * t;
    DeviceBuffer<uint16_t> q(p.q), kv_c_d(kv_c), k_pe_d(k_pe), latent(size_t(m) * p.latent_token_stride);
    DeviceBuffer<uint8_t> cache(p.cache);
    DeviceBuffer<int32_t> indices(p.indices);
    DeviceBuffer<int64_t> slot_mapping(slots);
    DeviceBuffer<float> lse(size_t(m) * heads);
    DeviceBuffer<unsigned int> errors(1);
    errors.fill_bytes(0);
    SparseMlaV32CacheWriteArgs w;
    w.kv_c = make_tensor(kv_c_d.get(), DType::kBF16, {written, L});
    w.k_pe = make_tensor(k_pe_d.get(), DType::kBF16, {written, R});
    w.slot_mapping = make_tensor(slot_mapping.get(), DType::kI64, {written});
    w.kv_cache =
        make_strided(cache.get(), DType::kU8, {p.blocks, p.block_size, E}, {p.block_stride, p.entry_stride, 1});
    SparseMlaV32Args a;
    a.q = make_strided(q.get(), DType::kBF16, {p.m, p.heads, D}, {p.q_token_stride, p.q_head_stride, 1});
    a.kv_cache = w.kv_cache;
    a.indices = make_strided(indices.get(), DType::kI32, {p.m, p.top_k}, {p.indices_token_stride, 1});
    a.softmax_scale = p.softmax_scale;
    a.latent = make_strided(latent.get(), DType::kBF16, {p.m, p.heads, L}, {p.latent_token_stride, L, 1});
    a.lse = make_tensor(lse.get(), DType::kF32, {p.m, p.heads});
    a.error_count = errors.get();
    auto enqueue = [&]() -> Status {
      DSA_RETURN_IF_ERROR(sparse_mla_v32_cache_write(w, stream));
      return sparse_mla_v32(a, stream);
    };
    DSA_ASSERT_OK(enqueue());
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> direct_latent = latent.download();
    const std::vector<float> direct_lse = lse.download();
    const std::vector<uint8_t> direct_cache = cache.download();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status captured = enqueue();
    DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    DSA_ASSERT_OK(captured);
    DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    latent.fill_bytes(0xFF);
    lse.fill_bytes(0xFF);
    for (int i = 0; i < 3; ++i) DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_TRUE(latent.download() == direct_latent);
    const std::vector<float> replay_lse = lse.download();
    EXPECT_EQ(std::memcmp(replay_lse.data(), direct_lse.data(), direct_lse.size() * 4), 0);
    EXPECT_TRUE(cache.download() == direct_cache);
    EXPECT_EQ(errors.download()[0], 0u);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace dsa
