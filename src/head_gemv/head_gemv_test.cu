// head_gemv: argument checks (CPU), the CPU reference against float64 (CPU),
// and the kernel bitwise against the reference, cuBLAS, guard bands, graph
// capture and batch invariance (GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <tuple>

#include "core/launch.cuh"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/stock.h"
#include "head_gemv/head_gemv_kernels.h"
#include "head_gemv/head_gemv_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

// ---------------------------------------------------------------- CPU tests

// Views of disjoint, suitably aligned addresses; the checks never dereference them.
void* fake_address(int region) { return reinterpret_cast<void*>(uintptr_t(region) << 32); }

struct FakeArgs {
  TensorView x = make_tensor(fake_address(1), DType::kBF16, {2, 4, 256});
  TensorView weight = make_tensor(fake_address(2), DType::kBF16, {4, 256, 512});
  TensorView out = make_tensor(fake_address(3), DType::kFP8E4M3, {2, 4, 512});
  TensorView scale = make_tensor(fake_address(4), DType::kF32, {1});
  KvCacheWrite cache{make_tensor(fake_address(5), DType::kBF16, {2, 512}),
                     make_tensor(fake_address(6), DType::kFP8E4M3, {8, 128, 512}),
                     make_tensor(fake_address(7), DType::kI64, {2}), make_tensor(fake_address(8), DType::kF32, {1})};
  HeadGemvArgs args() {
    HeadGemvArgs a{x, weight, out, scale, &cache};
    return a;
  }
};

void expect_rejected(const HeadGemvArgs& a, const std::string& argument, const std::string& words) {
  testing::expect_rejected(check_head_gemv(a), argument, words);
}

TEST(HeadGemvChecks, AcceptsTheGlm5NextAbsorb) {
  FakeArgs f;
  EXPECT_TRUE(check_head_gemv(f.args()).ok()) << check_head_gemv(f.args()).to_string();
  // One token: its stride is never used, so any stride is fine (PyTorch size-1 dims).
  f.x.shape[0] = f.out.shape[0] = f.cache.kv.shape[0] = 1;
  f.x.strides[0] = f.cache.kv.strides[0] = 3;
  EXPECT_TRUE(check_head_gemv(f.args()).ok()) << check_head_gemv(f.args()).to_string();
}

// So are the strides of one head, one cache block and blocks of one entry;
// where the dimension is stepped, the same stride is refused.
TEST(HeadGemvChecks, SizeOneDimensionsTakeAnyStride) {
  FakeArgs one_head;
  one_head.x = make_tensor(one_head.x.data, DType::kBF16, {2, 1, 256});
  one_head.weight = make_strided(one_head.weight.data, DType::kBF16, {1, 256, 512}, {3, 512, 1});
  one_head.out = make_tensor(one_head.out.data, DType::kFP8E4M3, {2, 1, 512});
  EXPECT_TRUE(check_head_gemv(one_head.args()).ok()) << check_head_gemv(one_head.args()).to_string();
  FakeArgs one_block;
  one_block.cache.cache = make_strided(one_block.cache.cache.data, DType::kFP8E4M3, {1, 128, 512}, {3, 512, 1});
  EXPECT_TRUE(check_head_gemv(one_block.args()).ok()) << check_head_gemv(one_block.args()).to_string();
  FakeArgs one_entry;
  one_entry.cache.cache = make_strided(one_entry.cache.cache.data, DType::kFP8E4M3, {8, 1, 512}, {512, 3, 1});
  EXPECT_TRUE(check_head_gemv(one_entry.args()).ok()) << check_head_gemv(one_entry.args()).to_string();

  const auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f);
    expect_rejected(f.args(), argument, words);
  };
  rejected([](FakeArgs& f) { f.cache.kv.strides[0] = 3; }, "cache.kv", "row stride a multiple of 8");
  rejected([](FakeArgs& f) { f.weight.strides[0] = 3; }, "weight", "multiples of 8");
  rejected([](FakeArgs& f) { f.cache.cache.strides[0] = 3; }, "cache.cache", "multiples of 8");
  rejected([](FakeArgs& f) { f.cache.cache.strides[1] = 3; }, "cache.cache", "multiples of 8");
}

TEST(HeadGemvChecks, ShapesWithoutATacticAreUnsupportedNotMisnamed) {
  FakeArgs f;
  f.x.shape[2] = f.weight.shape[1] = 200;  // 200 rows: no rows_per_thread divides it at m = 2
  f.x.strides[1] = 200;
  f.x.strides[0] = 4 * 200;
  f.weight.strides[1] = 512;
  f.weight.strides[0] = 200 * 512;
  ASSERT_TRUE(check_head_gemv(f.args()).ok()) << check_head_gemv(f.args()).to_string();
  HeadGemvArgs seed = f.args();
  seed.sums = HeadGemvSums::kSeedOrder;
  Status s = head_gemv(seed, nullptr);
  EXPECT_EQ(s.code(), ErrorCode::kUnsupported) << s.to_string();
  EXPECT_NE(s.message().find("I = 200"), std::string::npos) << s.message();
}

TEST(HeadGemvChecks, TensorCoreSumsTakeNoTacticAndNameUnsupportedShapes) {
  {
    FakeArgs f;
    HeadGemvArgs a = f.args();
    a.sums = HeadGemvSums::kTensorCores;
    const HeadGemvTactic tactic{64, 8};
    testing::expect_rejected(head_gemv(a, nullptr, &tactic), "tactic", "none with sums = kTensorCores");
    a.sums = static_cast<HeadGemvSums>(7);
    testing::expect_rejected(check_head_gemv(a), "sums", "kTensorCores (0) or kSeedOrder (1)");
    HeadGemvArgs seed = f.args();
    seed.sums = HeadGemvSums::kSeedOrder;
    testing::expect_rejected(head_gemv_tensor_cores_with_tile(seed, 64, nullptr), "sums", "kTensorCores");
    a.sums = HeadGemvSums::kTensorCores;
    a.out.data = static_cast<char*>(a.out.data) + 4;  // fine for the seed order, not for the four-column stores
    testing::expect_rejected(check_head_gemv(a), "out", "aligned to 8 bytes");
    a.sums = HeadGemvSums::kSeedOrder;
    EXPECT_TRUE(check_head_gemv(a).ok()) << check_head_gemv(a).to_string();
  }
  {
    FakeArgs f;  // I = 200: a seed-order tactic would not run it either, but the message names the sums' limits
    f.x.shape[2] = f.weight.shape[1] = 200;
    f.x.strides[1] = 200;
    f.x.strides[0] = 4 * 200;
    f.weight.strides[1] = 512;
    f.weight.strides[0] = 200 * 512;
    HeadGemvArgs a = f.args();
    a.sums = HeadGemvSums::kTensorCores;
    const Status s = head_gemv(a, nullptr);
    EXPECT_EQ(s.code(), ErrorCode::kUnsupported) << s.to_string();
    EXPECT_NE(s.message().find("I a multiple of 64"), std::string::npos) << s.message();
  }
}

TEST(HeadGemvChecks, StockEntryPointsNameTheirArguments) {
  FakeArgs f;
  KvCacheWrite bad = f.cache;
  bad.cache.strides[1] = 500;
  Status s = stock_concat_and_cache_mla(bad, nullptr);
  EXPECT_NE(s.message().find("'cache.cache'"), std::string::npos) << s.message();
  TensorView in = make_tensor(fake_address(9), DType::kBF16, {2, 4, 512});
  TensorView out = make_tensor(fake_address(10), DType::kFP8E4M3, {2, 4, 256});
  const Status wrong_shape = stock_static_fp8_quant(in, out, f.scale, nullptr);
  EXPECT_NE(wrong_shape.message().find("'out'"), std::string::npos) << wrong_shape.message();
  const Status in_place =
      stock_static_fp8_quant(in, make_tensor(in.data, DType::kFP8E4M3, {2, 4, 512}), f.scale, nullptr);
  EXPECT_NE(in_place.message().find("disjoint from 'in'"), std::string::npos) << in_place.message();
  // cuBLAS's int leading dimension: one token's stride is never used, so it is not refused past 2^31 (the call
  // then fails on the null handle, not on the arguments); two tokens' is.
  const int64_t past_int = int64_t(1) << 40;
  const TensorView one_token = make_strided(f.x.data, DType::kBF16, {1, 4, 256}, {past_int, 256, 1});
  const Status one =
      cublas_head_bmm(nullptr, one_token, f.weight, make_tensor(fake_address(11), DType::kBF16, {1, 4, 512}));
  EXPECT_NE(one.code(), ErrorCode::kInvalidArgument) << one.to_string();
  const TensorView two_tokens = make_strided(f.x.data, DType::kBF16, {2, 4, 256}, {past_int, 256, 1});
  testing::expect_rejected(
      cublas_head_bmm(nullptr, two_tokens, f.weight, make_tensor(fake_address(11), DType::kBF16, {2, 4, 512})),
      "x, weight", "token stride");
}

TEST(HeadGemvChecks, NamesEachBadArgument) {
  {
    FakeArgs f;
    f.x.dtype = DType::kF32;
    expect_rejected(f.args(), "x", "bf16");
  }
  {
    FakeArgs f;
    f.x.shape[0] = 17;
    f.out.shape[0] = 17;
    expect_rejected(f.args(), "x", "1..16 tokens");
  }
  {
    FakeArgs f;
    f.x.strides[0] = 4 * 256 + 4;  // not a multiple of 8
    expect_rejected(f.args(), "x", "token stride");
  }
  {
    FakeArgs f;
    f.x.data = static_cast<char*>(f.x.data) + 2;
    expect_rejected(f.args(), "x", "aligned to 16");
  }
  {
    FakeArgs f;
    f.x.shape[1] = -4;
    f.weight.shape[0] = -4;
    f.out.shape[1] = -4;
    expect_rejected(f.args(), "x", "non-negative sizes");
  }
  {
    FakeArgs f;
    f.out.data = static_cast<char*>(f.x.data) + 1024;  // an in-place product would read what it overwrites
    expect_rejected(f.args(), "out", "disjoint from 'x'");
  }
  {
    FakeArgs f;
    f.cache.cache.data = f.weight.data;
    expect_rejected(f.args(), "cache.cache", "disjoint from 'weight'");
  }
  {
    FakeArgs f;
    f.cache.slot_mapping.data = static_cast<char*>(f.out.data) + 64;
    expect_rejected(f.args(), "out", "disjoint from 'cache.slot_mapping'");
  }
  {
    FakeArgs f;
    f.weight.shape[0] = 3;
    expect_rejected(f.args(), "weight", "shape [4, 256, *]");
  }
  {
    FakeArgs f;
    f.weight.strides[2] = 2;
    expect_rejected(f.args(), "weight", "stride 1 in dim 2");
  }
  {
    FakeArgs f;
    f.out.shape[2] = 256;
    expect_rejected(f.args(), "out", "shape [2, 4, 512]");
  }
  {
    FakeArgs f;
    f.out.dtype = DType::kF32;
    expect_rejected(f.args(), "out", "bf16 or fp8_e4m3");
  }
  {
    FakeArgs f;
    f.scale = TensorView{};
    expect_rejected(f.args(), "scale", "null");
  }
  {
    FakeArgs f;
    f.out.dtype = DType::kBF16;  // a scale with a BF16 out is a caller mistake
    expect_rejected(f.args(), "scale", "no scale");
  }
  {
    FakeArgs f;
    f.cache.kv.shape[0] = 3;
    expect_rejected(f.args(), "cache.kv", "shape [2, *]");
  }
  {
    FakeArgs f;
    f.cache.cache.dtype = DType::kBF16;
    expect_rejected(f.args(), "cache.cache", "fp8_e4m3");
  }
  {
    FakeArgs f;
    f.cache.cache.strides[1] = 500;  // entries overlap
    expect_rejected(f.args(), "cache.cache", "multiples of 8");
  }
  {
    FakeArgs f;
    f.cache.slot_mapping.dtype = DType::kI32;
    expect_rejected(f.args(), "cache.slot_mapping", "i64");
  }
  {
    FakeArgs f;
    f.cache.k_scale.shape[0] = 2;
    expect_rejected(f.args(), "cache.k_scale", "shape [1]");
  }
  // The rest of the layout rules, one case each.
  const auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f);
    expect_rejected(f.args(), argument, words);
  };
  rejected([](FakeArgs& f) { f.x.shape[2] = f.weight.shape[1] = 252; }, "x", "a multiple of 8");
  rejected([](FakeArgs& f) { f.weight.strides[1] = 504; }, "weight", "do not overlap");        // rows overlap
  rejected([](FakeArgs& f) { f.weight.strides[0] = 255 * 512; }, "weight", "do not overlap");  // heads overlap
  rejected(
      [](FakeArgs& f) {
        f.weight.strides[1] = 516;
        f.weight.strides[0] = 256 * 516;
      },
      "weight", "multiples of 8");
  rejected([](FakeArgs& f) { f.weight.data = static_cast<char*>(f.weight.data) + 8; }, "weight", "aligned to 16");
  rejected(
      [](FakeArgs& f) {
        f.out.strides[1] = 520;
        f.out.strides[0] = 4 * 520;
      },
      "out", "contiguous");
  rejected([](FakeArgs& f) { f.scale.dtype = DType::kBF16; }, "scale", "f32");
  rejected([](FakeArgs& f) { f.scale.data = static_cast<char*>(f.scale.data) + 2; }, "scale", "aligned to 4");
  rejected([](FakeArgs& f) { f.cache.kv.strides[0] = 516; }, "cache.kv", "row stride a multiple of 8");
  rejected([](FakeArgs& f) { f.cache.kv.data = static_cast<char*>(f.cache.kv.data) + 8; }, "cache.kv", "aligned to 16");
  rejected([](FakeArgs& f) { f.cache.cache.shape[0] = 0; }, "cache.cache", "do not overlap");  // no block
  rejected([](FakeArgs& f) { f.cache.cache.data = static_cast<char*>(f.cache.cache.data) + 4; }, "cache.cache",
           "aligned to 8");
  rejected([](FakeArgs& f) { f.cache.slot_mapping.strides[0] = 2; }, "cache.slot_mapping", "a contiguous vector");
  rejected([](FakeArgs& f) { f.cache.slot_mapping.data = static_cast<char*>(f.cache.slot_mapping.data) + 4; },
           "cache.slot_mapping", "aligned to 8");
  rejected([](FakeArgs& f) { f.cache.k_scale.dtype = DType::kBF16; }, "cache.k_scale", "f32");
  rejected(
      [](FakeArgs& f) {
        f.cache.error_count = reinterpret_cast<unsigned int*>(static_cast<char*>(fake_address(9)) + 2);
      },
      "cache.error_count", "4-byte aligned");
}

TEST(HeadGemvChecks, TacticTableGivesValidTacticsAndBadOnesAreNamed) {
  for (int heads : {1, 8, 16, 64, 128}) {
    for (auto [rows, cols] : {std::pair{256, 512}, {512, 256}, {192, 512}, {128, 512}, {512, 128}, {1024, 512},
                              {768, 256}}) {
      for (int m = 1; m <= kHeadGemvMaxTokens; ++m) {
        const HeadGemvTactic tactic = head_gemv_tactic(heads, rows, cols, m);
        const HeadGemvTactic single_token = head_gemv_tactic(heads, rows, cols, 1);
        EXPECT_TRUE(tactic.tile == single_token.tile && tactic.rows_per_thread == single_token.rows_per_thread)
            << "the table's tactic changes with m, so a token's bits would depend on its batch";
        EXPECT_TRUE(check_head_gemv_tactic(rows, cols, m, tactic).ok())
            << check_head_gemv_tactic(rows, cols, m, tactic).to_string() << " H " << heads << " I " << rows << " J " << cols << " m " << m;
      }
    }
  }
  Status s = check_head_gemv_tactic(256, 512, 1, HeadGemvTactic{24, 8});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'tactic'"), std::string::npos) << s.message();
  EXPECT_FALSE(check_head_gemv_tactic(256, 512, 16, HeadGemvTactic{128, 8}).ok());  // 2 groups x 512 threads
  EXPECT_TRUE(check_head_gemv_tactic(256, 512, 8, HeadGemvTactic{128, 8}).ok());
  EXPECT_FALSE(check_head_gemv_tactic(512, 256, 1, HeadGemvTactic{256, 32}).ok());  // 256 KiB weight slab
  EXPECT_FALSE(check_head_gemv_tactic(200, 512, 1, HeadGemvTactic{64, 16}).ok());   // rows % 16
  EXPECT_FALSE(check_head_gemv_tactic(256, 512, 1, HeadGemvTactic{64, 128}).ok());  // rows_per_thread
}

// The reference's fixed order is still a sum: it must agree with float64.
TEST(HeadGemvReference, AgreesWithFloat64) {
  std::mt19937_64 rng(testing::test_seed());
  const int m = 3, heads = 2, rows = 256, cols = 64;
  std::vector<uint16_t> x = testing::random_bf16(m * heads * rows, 1.0f, rng);
  std::vector<uint16_t> w = testing::random_bf16(heads * rows * cols, 0.05f, rng);
  reference::HeadGemvHost a{x.data(), heads * rows, w.data(), rows * cols, cols, m, heads, rows, cols};
  for (HeadGemvTactic tactic : {HeadGemvTactic{64, 8}, HeadGemvTactic{16, 16}, HeadGemvTactic{32, 8}}) {
    const std::vector<float> sums = reference::head_gemv_sums(a, tactic);
    for (int t = 0; t < m; ++t) {
      for (int h = 0; h < heads; ++h) {
        for (int j = 0; j < cols; ++j) {
          double exact = 0, magnitude = 0;
          for (int r = 0; r < rows; ++r) {
            const double p = double(num::bf16_to_float(x[(t * heads + h) * rows + r])) *
                             num::bf16_to_float(w[(h * rows + r) * cols + j]);
            exact += p;
            magnitude += std::fabs(p);
          }
          EXPECT_NEAR(sums[(t * heads + h) * cols + j], exact, 1e-6 * magnitude + 1e-30);
        }
      }
    }
  }
}

// The tensor-core contract's check: the seed order's outputs lie within the
// bound (its FP32 error is far below 2^-14 of the sum of |products|), and an
// output moved by three BF16 ulps or FP8 steps does not. (How far the seed
// order lies from the rounding of the exact sum is not checked: near zero
// the bound spans several ulps, and about one seed in a thousand puts an
// output there.)
TEST(HeadGemvReference, DeviationAcceptsTheSeedOrderAndFlagsAMovedOutput) {
  std::mt19937_64 rng(testing::test_seed());
  const int m = 2, heads = 3, rows = 256, cols = 64;
  std::vector<uint16_t> x = testing::random_bf16(m * heads * rows, 1.0f, rng);
  std::vector<uint16_t> w = testing::random_bf16(heads * rows * cols, 0.05f, rng);
  const reference::HeadGemvHost a{x.data(), heads * rows, w.data(), rows * cols, cols, m, heads, rows, cols};
  const HeadGemvTactic tactic{64, 8};
  std::vector<uint16_t> bf16 = reference::head_gemv_bf16(a, tactic);
  reference::HeadGemvDeviation d = reference::head_gemv_deviation(a, bf16.data(), false, 1.0f);
  EXPECT_EQ(d.outside, 0);
  EXPECT_EQ(d.compared, int64_t(m) * heads * cols);
  // The largest output moves: its ulp exceeds its interval's width (near
  // zero the bound spans many ulps, so a small output may move unflagged).
  size_t moved_bf16 = 0;
  for (size_t i = 0; i < bf16.size(); ++i) {
    if ((bf16[i] & 0x7FFF) > (bf16[moved_bf16] & 0x7FFF)) moved_bf16 = i;
  }
  bf16[moved_bf16] = static_cast<uint16_t>(bf16[moved_bf16] + 3);  // away from zero by 3 ulps
  d = reference::head_gemv_deviation(a, bf16.data(), false, 1.0f);
  EXPECT_EQ(d.outside, 1);

  const float scale = 0.0125f;
  std::vector<uint8_t> fp8 = reference::head_gemv_fp8(a, tactic, scale);
  EXPECT_EQ(reference::head_gemv_deviation(a, fp8.data(), true, scale).outside, 0);
  // The largest output below code 0x70 (3 steps up stay below 0x7E, the
  // largest finite e4m3 code), for the same reason as above.
  size_t moved = 0;
  for (size_t i = 0; i < fp8.size(); ++i) {
    const int code = fp8[i] & 0x7F;
    if (code < 0x70 && (code > (fp8[moved] & 0x7F) || (fp8[moved] & 0x7F) >= 0x70)) moved = i;
  }
  ASSERT_LT(fp8[moved] & 0x7F, 0x70);
  fp8[moved] = static_cast<uint8_t>(fp8[moved] + 3);
  EXPECT_EQ(reference::head_gemv_deviation(a, fp8.data(), true, scale).outside, 1);
}

TEST(HeadGemvReference, CacheWriteSkipsPaddingAndCountsOutOfRange) {
  const int width = 16, blocks = 2, block_size = 4;
  std::vector<uint16_t> kv(3 * width);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = num::float_to_bf16(0.25f * static_cast<float>(i));
  std::vector<uint8_t> cache(blocks * block_size * width, 0xA5);
  const int64_t slots[3] = {5, -1, 8};  // 8 = capacity: out of range
  const int bad = reference::cache_write(kv.data(), width, 3, width, slots, 3, 0.5f, cache.data(), blocks,
                                         block_size, block_size * width, width);
  EXPECT_EQ(bad, 1);
  for (int i = 0; i < width; ++i) EXPECT_EQ(cache[5 * width + i], num::float_to_e4m3(0.5f * i));
  EXPECT_EQ(std::count(cache.begin(), cache.end(), 0xA5), static_cast<long>(cache.size() - width));
}

// ---------------------------------------------------------------- GPU tests

// Max distance in BF16 units in the last place (same sign-magnitude ordering).
int bf16_ulp_distance(uint16_t a, uint16_t b) {
  auto ordered = [](uint16_t v) { return (v & 0x8000) ? -static_cast<int>(v & 0x7FFF) : static_cast<int>(v); };
  return std::abs(ordered(a) - ordered(b));
}

// Distance in E4M3 code steps (codes are sign-magnitude: +0 and -0 are 0 apart).
int fp8_code_distance(uint8_t a, uint8_t b) {
  auto ordered = [](uint8_t v) { return (v & 0x80) ? -static_cast<int>(v & 0x7F) : static_cast<int>(v); };
  return std::abs(ordered(a) - ordered(b));
}

struct Case {
  int heads, rows, cols, m;
  bool fp8;
  bool cache;
  int x_pad = 0;       // extra elements per token row of x
  int weight_pad = 0;  // extra elements per weight row
  std::optional<HeadGemvTactic> tactic;
  HeadGemvSums sums = HeadGemvSums::kSeedOrder;  // kTensorCores: checked against the bound, not bitwise
};

std::string describe(const Case& c) {
  std::string s = "H " + std::to_string(c.heads) + " I " + std::to_string(c.rows) + " J " + std::to_string(c.cols) +
                  " m " + std::to_string(c.m) + (c.fp8 ? " fp8" : " bf16") + (c.cache ? " +cache" : "");
  if (c.tactic) s += " tactic " + std::to_string(c.tactic->tile) + "/" + std::to_string(c.tactic->rows_per_thread);
  if (c.sums == HeadGemvSums::kTensorCores) s += " tensor cores";
  return s;
}

constexpr size_t kGuard = 256;  // poisoned bytes on each side of every output
constexpr uint8_t kPoison = 0xFF;

// Runs one case on the GPU and checks it against the reference: bitwise for
// the seed order, within the contract's bound for the tensor-core sums (whose
// deviation, when given, is added up there).
void run_case(const Case& c, std::mt19937_64& rng, reference::HeadGemvDeviation* total_deviation = nullptr) {
  SCOPED_TRACE(describe(c));
  const HeadGemvTactic tactic = c.tactic ? *c.tactic : head_gemv_tactic(c.heads, c.rows, c.cols, c.m);
  const int64_t x_stride = int64_t(c.heads) * c.rows + c.x_pad;
  const int64_t w_row_stride = c.cols + c.weight_pad;
  const int64_t w_head_stride = c.rows * w_row_stride;
  std::vector<uint16_t> x = testing::random_bf16(c.m * x_stride, 1.0f, rng);
  std::vector<uint16_t> w = testing::random_bf16(c.heads * w_head_stride, 0.05f, rng);
  DeviceBuffer<uint16_t> x_dev(x), w_dev(w);

  const size_t out_bytes = size_t(c.m) * c.heads * c.cols * (c.fp8 ? 1 : 2);
  DeviceBuffer<uint8_t> out_dev(out_bytes + 2 * kGuard);
  out_dev.fill_bytes(kPoison);
  const float scale = 0.0125f;  // puts the sums' tails past 448: saturation is exercised
  DeviceBuffer<float> scale_dev(std::vector<float>{scale});

  // Cache: 3 blocks of 16 entries, entry and block strides padded.
  const int width = 512, block_size = 16, blocks = 3;
  const int64_t entry_stride = width + 16, block_stride = block_size * entry_stride + 64;
  const size_t cache_bytes = blocks * block_stride;
  const int64_t kv_stride = c.m % 3 == 1 ? width + 8 : width;  // padded rows for some m
  std::vector<uint16_t> kv = testing::random_bf16(c.m * kv_stride, 1.0f, rng);
  std::vector<uint8_t> cache(cache_bytes + 2 * kGuard, 0xA5);
  // Distinct slots; every third token is padding (-1); token 1's slot is past the
  // capacity (exactly at it for even m); the slot mapping is two longer than m
  // for even m and one shorter (graph padding) for odd m > 2.
  const int64_t capacity = int64_t(blocks) * block_size;
  std::vector<int64_t> slots(c.m + 2);
  std::vector<int64_t> pool(capacity);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = int64_t(i);
  std::shuffle(pool.begin(), pool.end(), rng);
  for (int t = 0; t < c.m + 2; ++t) slots[t] = t % 3 == 2 ? -1 : pool[t];
  if (c.m >= 2) slots[1] = c.m % 2 == 0 ? capacity : capacity + 7;
  const int n_slots = c.m % 2 == 0 ? c.m + 2 : c.m > 2 ? c.m - 1 : c.m;
  DeviceBuffer<uint16_t> kv_dev(kv);
  DeviceBuffer<uint8_t> cache_dev(cache), stock_cache_dev(cache);
  DeviceBuffer<int64_t> slots_dev(std::vector<int64_t>(slots.begin(), slots.begin() + n_slots));
  const float k_scale = 0.02f;
  DeviceBuffer<float> k_scale_dev(std::vector<float>{k_scale});
  DeviceBuffer<unsigned int> errors_dev(std::vector<unsigned int>{0}), stock_errors_dev(std::vector<unsigned int>{0});
  const bool count_errors = c.m % 4 != 3;  // a null counter must be accepted too

  HeadGemvArgs args;
  args.x = make_strided(x_dev.get(), DType::kBF16, {c.m, c.heads, c.rows}, {x_stride, c.rows, 1});
  args.weight = make_strided(w_dev.get(), DType::kBF16, {c.heads, c.rows, c.cols}, {w_head_stride, w_row_stride, 1});
  args.out = make_tensor(out_dev.get() + kGuard, c.fp8 ? DType::kFP8E4M3 : DType::kBF16, {c.m, c.heads, c.cols});
  if (c.fp8) args.scale = make_tensor(scale_dev.get(), DType::kF32, {1});
  KvCacheWrite write{make_strided(kv_dev.get(), DType::kBF16, {c.m, width}, {kv_stride, 1}),
                     make_strided(cache_dev.get() + kGuard, DType::kFP8E4M3, {blocks, block_size, width},
                                  {block_stride, entry_stride, 1}),
                     make_tensor(slots_dev.get(), DType::kI64, {n_slots}), make_tensor(k_scale_dev.get(), DType::kF32, {1}),
                     count_errors ? errors_dev.get() : nullptr};
  if (c.cache) args.cache = &write;
  args.sums = c.sums;

  Status s = head_gemv(args, nullptr, c.tactic ? &*c.tactic : nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (!s.ok()) return;

  reference::HeadGemvHost host{x.data(), x_stride, w.data(), w_head_stride, w_row_stride, c.m, c.heads, c.rows, c.cols};
  const std::vector<uint8_t> got = out_dev.download();
  const uint8_t* out = got.data() + kGuard;
  std::vector<uint8_t> expected;
  if (c.sums == HeadGemvSums::kTensorCores) {
    const reference::HeadGemvDeviation d = reference::head_gemv_deviation(host, out, c.fp8, scale);
    EXPECT_EQ(d.outside, 0) << d.outside << " of " << d.compared << " outputs outside the bound";
    if (total_deviation != nullptr) {
      total_deviation->outside += d.outside;
      total_deviation->differing += d.differing;
      total_deviation->compared += d.compared;
      total_deviation->max_steps = std::max(total_deviation->max_steps, d.max_steps);
    }
  } else if (c.fp8) {
    expected = reference::head_gemv_fp8(host, tactic, scale);
  } else {
    std::vector<uint16_t> bf16 = reference::head_gemv_bf16(host, tactic);
    expected.resize(bf16.size() * 2);
    std::memcpy(expected.data(), bf16.data(), expected.size());
  }
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (out[i] != expected[i] && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << "first mismatch at byte " << first << ": got " << int(out[first])
                            << ", expected " << int(expected[first]);
  for (size_t i = 0; i < kGuard; ++i) {
    ASSERT_EQ(got[i], kPoison) << "write before the output at guard byte " << i;
    ASSERT_EQ(got[got.size() - 1 - i], kPoison) << "write past the output";
  }

  const std::vector<uint8_t> cache_got = cache_dev.download();
  const unsigned int errors = errors_dev.download()[0];
  if (c.cache) {
    const int bad = reference::cache_write(kv.data(), kv_stride, c.m, width, slots.data(), n_slots, k_scale,
                                           cache.data() + kGuard, blocks, block_size, block_stride, entry_stride);
    EXPECT_EQ(errors, count_errors ? static_cast<unsigned>(bad) : 0u);
    // The stock write (the fallback path) on the same arguments: same bytes, same count.
    KvCacheWrite stock = write;
    stock.cache.data = stock_cache_dev.get() + kGuard;
    stock.error_count = stock_errors_dev.get();
    DSA_ASSERT_OK(stock_concat_and_cache_mla(stock, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(stock_cache_dev.download() == cache) << "the stock cache write differs from the reference";
    EXPECT_EQ(stock_errors_dev.download()[0], static_cast<unsigned>(bad));
  } else {
    EXPECT_EQ(errors, 0u);
  }
  EXPECT_TRUE(cache_got == cache) << "cache bytes (incl. padding and guards) differ from the reference";
  // Nothing written into the inputs.
  EXPECT_TRUE(x_dev.download() == x) << "x changed";
  EXPECT_TRUE(w_dev.download() == w) << "weight changed";
  EXPECT_TRUE(kv_dev.download() == kv) << "kv changed";
  EXPECT_TRUE(slots_dev.download() == std::vector<int64_t>(slots.begin(), slots.begin() + n_slots)) << "slots changed";
  EXPECT_EQ(scale_dev.download()[0], scale) << "scale changed";
  EXPECT_EQ(k_scale_dev.download()[0], k_scale) << "k_scale changed";
}

// The bitwise sweep's cases: every shape with every m in 1..16 (quick mode:
// m = 1, 6, 11, 16, at most 8 heads). Over a shape's 16 token counts, every
// head count meets every output variant (BF16; FP8; FP8 + cache write where
// J is the absorb's 512): the head index steps by 2 mod 5, the variant by 1
// mod 3.
std::vector<Case> bitwise_sweep(bool quick) {
  const std::vector<std::pair<int, int>> shapes = {{256, 512}, {512, 256}, {192, 512}, {128, 512}, {512, 128}};
  const int head_counts[] = {1, 8, 16, 64, 128};
  std::vector<Case> cases;
  int case_index = 0;
  for (auto [rows, cols] : shapes) {
    for (int m = 1; m <= kHeadGemvMaxTokens; ++m) {
      if (quick && m % 5 != 1) continue;
      const int heads = head_counts[(m + case_index) % 5];
      const int variant = case_index % 3;
      Case c{heads, rows, cols, m, /*fp8=*/variant > 0, /*cache=*/variant == 2 && cols == 512};
      c.x_pad = (m % 3 == 0) ? 8 : 0;
      c.weight_pad = (m % 4 == 0) ? 16 : 0;
      if (quick) c.heads = std::min(c.heads, 8);
      cases.push_back(c);
      ++case_index;
    }
  }
  return cases;
}

// The sweep itself (an earlier version tied the dtype to the parity of m +
// case index, which never changed: it ran BF16 only).
TEST(HeadGemvSweep, CoversEveryHeadCountOutputVariantAndShape) {
  std::set<std::tuple<int, int, int, bool, bool>> combos;  // rows, cols, heads, fp8, cache
  std::set<std::pair<bool, int>> cache_parity;            // (cache, m % 2)
  std::set<std::tuple<bool, int, int>> padding;           // (fp8, x_pad, weight_pad)
  for (const Case& c : bitwise_sweep(/*quick=*/false)) {
    combos.insert({c.rows, c.cols, c.heads, c.fp8, c.cache});
    cache_parity.insert({c.cache, c.m % 2});
    padding.insert({c.fp8, c.x_pad, c.weight_pad});
  }
  // 5 head counts x (BF16, FP8, FP8 + cache) for the three J = 512 shapes, x (BF16, FP8) for the two others.
  EXPECT_EQ(combos.size(), 5u * (3 * 3 + 2 * 2));
  EXPECT_EQ(cache_parity.size(), 4u) << "the cache write with even and odd m (the slot cases differ)";
  EXPECT_EQ(padding.size(), 8u) << "both dtypes with every padding combination";
  int quick_fp8 = 0, quick_cache = 0;
  for (const Case& c : bitwise_sweep(/*quick=*/true)) {
    quick_fp8 += c.fp8;
    quick_cache += c.cache;
  }
  EXPECT_GT(quick_fp8, 0) << "the sanitizer runs (quick mode) meet FP8 out";
  EXPECT_GT(quick_cache, 0) << "the sanitizer runs (quick mode) meet the cache write";
}

TEST(HeadGemvGpu, BitwiseEqualToReferenceOverShapesHeadsAndTokens) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  for (const Case& c : bitwise_sweep(testing::quick_mode())) run_case(c, rng);
}

TEST(HeadGemvGpu, EveryTacticAndTokenCapacityMatchesReference) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 1);
  for (int tile : {16, 32, 64, 128, 256}) {
    for (int rows_per_thread : {8, 16, 32, 64}) {
      for (int m : {1, 2, 3, 4, 7, 8, 9, 16}) {
        for (auto [rows, cols] : {std::pair{256, 512}, {512, 256}}) {
          const HeadGemvTactic tactic{tile, rows_per_thread};
          if (!check_head_gemv_tactic(rows, cols, m, tactic).ok()) continue;
          if (testing::quick_mode() && m != 3) continue;
          run_case(Case{8, rows, cols, m, m % 2 == 1, m % 2 == 1, 0, 0, tactic}, rng);
        }
      }
    }
  }
}

// The batch-invariance tests' setup: x of 16 tokens and the weights on the
// device (fresh random values), and BF16 out views of m tokens from any first token.
struct SixteenTokens {
  int heads, rows, cols;
  std::vector<uint16_t> x, w;
  DeviceBuffer<uint16_t> x_dev, w_dev, out_dev;

  SixteenTokens(int heads_, int rows_, int cols_, std::mt19937_64& rng)
      : heads(heads_),
        rows(rows_),
        cols(cols_),
        x(testing::random_bf16(16 * heads_ * rows_, 1.0f, rng)),
        w(testing::random_bf16(heads_ * rows_ * cols_, 0.05f, rng)),
        x_dev(x),
        w_dev(w),
        out_dev(16 * heads_ * cols_) {}
  // Tokens first_token .. first_token + m - 1 into out's first m rows.
  HeadGemvArgs args(int first_token, int m, HeadGemvSums sums) const {
    HeadGemvArgs a;
    a.x = make_tensor(x_dev.get() + first_token * heads * rows, DType::kBF16, {m, heads, rows});
    a.weight = make_tensor(w_dev.get(), DType::kBF16, {heads, rows, cols});
    a.out = make_tensor(out_dev.get(), DType::kBF16, {m, heads, cols});
    a.sums = sums;
    return a;
  }
  // out's first m rows, after the device finished.
  std::vector<uint16_t> out(int m) const {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> host = out_dev.download();
    host.resize(size_t(m) * heads * cols);
    return host;
  }
  reference::HeadGemvHost host() const {
    return reference::HeadGemvHost{x.data(), heads * rows, w.data(), rows * cols, cols, 16, heads, rows, cols};
  }
};

TEST(HeadGemvGpu, RepeatedRunsAndBatchesGiveTheSameBits) {
  DSA_REQUIRE_GPU();
  // One tactic for every m: a token's bits must not depend on the batch.
  const HeadGemvTactic tactic{64, 16};
  std::mt19937_64 rng(testing::test_seed() + 2);
  SixteenTokens d(8, 256, 512, rng);
  auto run = [&](int first_token, int m) {
    d.out_dev.fill_bytes(kPoison);
    EXPECT_TRUE(head_gemv(d.args(first_token, m, HeadGemvSums::kSeedOrder), nullptr, &tactic).ok());
    return d.out(m);
  };
  const std::vector<uint16_t> batch = run(0, 16);
  // The batch itself is the reference's bits (so equal runs cannot be two unwritten outputs).
  EXPECT_TRUE(batch == reference::head_gemv_bf16(d.host(), tactic)) << "the batch of 16 differs from the reference";
  EXPECT_EQ(run(0, 16), batch);
  for (int t : {0, 5, 15}) {
    const std::vector<uint16_t> alone = run(t, 1);
    EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batch.begin() + size_t(t) * d.heads * d.cols))
        << "token " << t << " alone differs from the same token in a batch of 16";
  }
}

// The tensor-core sums (opt-in): every output within the contract's bound on
// the bitwise sweep's cases (shapes the kernel runs: I a multiple of 64), with
// the same guard bands, cache writes and untouched inputs.
TEST(HeadGemvGpu, TensorCoreSumsStayWithinTheBound) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 3);
  reference::HeadGemvDeviation total;
  for (Case c : bitwise_sweep(testing::quick_mode())) {
    c.sums = HeadGemvSums::kTensorCores;
    run_case(c, rng, &total);
  }
  // The largest I the kernel runs, with a padded weight row; the smallest (one
  // warp per CTA) with J = 48 (column tile 16), FP8 out and the cache write.
  run_case(Case{8, 1024, 64, 5, false, false, 8, 16, std::nullopt, HeadGemvSums::kTensorCores}, rng, &total);
  run_case(Case{3, 64, 48, 7, true, true, 8, 16, std::nullopt, HeadGemvSums::kTensorCores}, rng, &total);
  EXPECT_EQ(total.outside, 0);
  std::printf(
      "[head_gemv tensor cores] %lld outputs: %lld outside the bound, %lld differ from the rounding of the "
      "exact sum, by at most %d step(s)\n",
      static_cast<long long>(total.compared), static_cast<long long>(total.outside),
      static_cast<long long>(total.differing), total.max_steps);
}

// The tensor-core sums' other promises: the same bits on every run, for a token
// alone and inside a batch of 16, whatever the column tile, and from a graph.
TEST(HeadGemvGpu, TensorCoreSumsAreRepeatableBatchInvariantAndTileInvariant) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 4);
  SixteenTokens d(8, 512, 256, rng);
  auto args_for = [&](int first_token, int m) { return d.args(first_token, m, HeadGemvSums::kTensorCores); };
  auto run = [&](int first_token, int m, int tile) {
    d.out_dev.fill_bytes(kPoison);
    const HeadGemvArgs a = args_for(first_token, m);
    const Status launched = tile == 0 ? head_gemv(a, nullptr) : head_gemv_tensor_cores_with_tile(a, tile, nullptr);
    EXPECT_TRUE(launched.ok()) << launched.to_string();
    return d.out(m);
  };
  const std::vector<uint16_t> batch = run(0, 16, 0);
  EXPECT_EQ(reference::head_gemv_deviation(d.host(), batch.data(), false, 1.0f).outside, 0)
      << "the batch of 16 is outside the bound";
  EXPECT_EQ(run(0, 16, 0), batch);
  for (int tile : {16, 32, 64, 128}) EXPECT_EQ(run(0, 16, tile), batch) << "column tile " << tile;
  for (int t : {0, 5, 8, 15}) {
    for (int m : {1, 3}) {
      if (t + m > 16) continue;
      const std::vector<uint16_t> alone = run(t, m, 0);
      EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batch.begin() + size_t(t) * d.heads * d.cols))
          << "tokens " << t << ".." << t + m - 1 << " alone differ from the same tokens in a batch of 16";
    }
  }
  // Captured into a CUDA graph and replayed twice.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  DSA_ASSERT_OK(head_gemv(args_for(0, 16), stream));  // outside the capture: raises the shared-memory limit
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status captured = head_gemv(args_for(0, 16), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  DSA_ASSERT_OK(captured);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    d.out_dev.fill_bytes(kPoison);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(d.out(16), batch) << "graph replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(HeadGemvGpu, CapturedGraphReplaysTheSameResult) {
  DSA_REQUIRE_GPU();
  const int heads = 16, rows = 256, cols = 512, m = 4;
  std::mt19937_64 rng(testing::test_seed() + 3);
  DeviceBuffer<uint16_t> x_dev(testing::random_bf16(m * heads * rows, 1.0f, rng));
  DeviceBuffer<uint16_t> w_dev(testing::random_bf16(heads * rows * cols, 0.05f, rng));
  DeviceBuffer<uint8_t> out_dev(m * heads * cols);
  DeviceBuffer<float> scale_dev(std::vector<float>{0.02f});
  HeadGemvArgs a;
  a.x = make_tensor(x_dev.get(), DType::kBF16, {m, heads, rows});
  a.weight = make_tensor(w_dev.get(), DType::kBF16, {heads, rows, cols});
  a.out = make_tensor(out_dev.get(), DType::kFP8E4M3, {m, heads, cols});
  a.scale = make_tensor(scale_dev.get(), DType::kF32, {1});
  // With the fused cache write as a decode step captures it: a padding token
  // (slot -1) and a slot mapping one shorter than m (CUDA-graph padding).
  const int width = 512, block_size = 16, blocks = 2;
  const std::vector<uint8_t> cache_before(size_t(blocks) * block_size * width, 0xA5);
  DeviceBuffer<uint16_t> kv_dev(testing::random_bf16(m * width, 1.0f, rng));
  DeviceBuffer<uint8_t> cache_dev(cache_before);
  DeviceBuffer<int64_t> slots_dev(std::vector<int64_t>{5, 17, -1});
  DeviceBuffer<float> k_scale_dev(std::vector<float>{0.02f});
  KvCacheWrite write{make_tensor(kv_dev.get(), DType::kBF16, {m, width}),
                     make_tensor(cache_dev.get(), DType::kFP8E4M3, {blocks, block_size, width}),
                     make_tensor(slots_dev.get(), DType::kI64, {m - 1}), make_tensor(k_scale_dev.get(), DType::kF32, {1}),
                     nullptr};
  a.cache = &write;
  cudaStream_t stream;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DSA_ASSERT_OK(head_gemv(a, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> direct = out_dev.download();
  const std::vector<uint8_t> direct_cache = cache_dev.download();
  ASSERT_NE(direct_cache, cache_before) << "the direct launch wrote no cache entry";

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  Status captured = head_gemv(a, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  out_dev.fill_bytes(kPoison);
  cache_dev.upload(cache_before);
  for (int i = 0; i < 3; ++i) DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(out_dev.download(), direct);
  EXPECT_EQ(cache_dev.download(), direct_cache) << "the replays' cache bytes differ from the direct launch's";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---------------------------------------------------------------- PDL chain

// The chain's producer is testing::launch_late_writer: it releases the PDL
// kernel after it at once, spins, then copies the step's new x and kv over
// the old ones.

// The chain's consumer, launched with PDL: after its wait, copies the step's
// q and z into the step's snapshots.
__global__ void snapshot_kernel(const uint4* q, uint4* q_snapshot, int q_vectors, const uint4* z, uint4* z_snapshot,
                                int z_vectors) {
  pdl_wait();
  pdl_release_dependents();
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < q_vectors; i += stride) q_snapshot[i] = q[i];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < z_vectors; i += stride) z_snapshot[i] = z[i];
}

// Launched with PDL right after the producer, reads x before its wait: what a
// head_gemv without its wait would read there.
__global__ void early_reader_kernel(const uint4* x, uint4* seen, int vectors) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vectors; i += gridDim.x * blockDim.x) seen[i] = x[i];
  pdl_wait();  // every CTA of a chain waits before it exits (core/launch.cuh)
}

// "" when equal, else how many elements differ and the first of them.
template <class T>
std::string differences(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  size_t count = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && count++ == 0) first = i;
  }
  if (count == 0) return "";
  return std::to_string(count) + " of " + std::to_string(got.size()) + " differ, first at " + std::to_string(first) +
         ": " + std::to_string(got[first]) + " vs " + std::to_string(want[first]);
}

// A blocking stream: it orders after DeviceBuffer's uploads and poison fills,
// which run on the legacy default stream.
class BlockingStream {
 public:
  BlockingStream() { testing::expect_cuda(cudaStreamCreate(&stream_), "cudaStreamCreate"); }
  ~BlockingStream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// The contract's PDL promise (head_gemv.h, core/launch.cuh): head_gemv loads
// its weights before griddepcontrol.wait, reads x and kv only after it,
// releases its dependents after it (before it when asked, with the same
// bits), and launches with programmatic stream serialization. A chain of steps: a slow producer writes new x and kv and
// releases its dependents at once; then three head_gemv launches with PDL,
// the absorb A (x -> q, FP8 out with the fused cache write of kv), B (x -> y,
// BF16) and V (y -> z, BF16: head_gemv reading head_gemv's output); then a
// consumer launched with PDL copies q and z out. Even steps run A, B, V and
// odd steps B, V, A, so both variants meet the producer while it still runs
// and both feed the consumer directly. Back to back, and replayed from a
// captured graph, the chain gives the bits of the same launches with a
// stream synchronize after each, and those are the reference's.
TEST(HeadGemvGpu, PdlChainMatchesSerializedLaunchesAndItsGraphReplays) {
  DSA_REQUIRE_GPU();
  constexpr int kHeads = 8, kRows = 256, kCols = 512, kWidth = 512;
  constexpr int kBlocks = 4, kBlockSize = 16;  // 64 cache slots: every token of every step gets its own
  constexpr long long kSpinCycles = 200000;    // about 100 us at the H200's clocks
  constexpr int kProducerCtas = 8, kThreads = 256;
  constexpr float kScale = 0.0125f, kKScale = 0.02f;
  const int steps = testing::quick_mode() ? 2 : 4;
  std::mt19937_64 rng(testing::test_seed() + 5);
  BlockingStream stream;

  // Whether this device shows a missing wait at all: a kernel launched with
  // PDL after the producer that reads x without waiting sees the old values.
  // The first round loads both kernels (lazy module loading synchronizes, so
  // a first launch cannot overlap); the second round is the one printed.
  {
    const int count = 4096;
    const std::vector<uint16_t> old_x = testing::random_bf16(count, 1.0f, rng);
    const std::vector<uint16_t> new_x = testing::random_bf16(count, 1.0f, rng);
    DeviceBuffer<uint16_t> x_dev(count), source_dev(new_x), seen_dev(count);
    int stale = 0;
    for (int round = 0; round < 2; ++round) {
      x_dev.upload(old_x);
      seen_dev.fill_bytes(kPoison);
      DSA_ASSERT_CUDA(testing::launch_late_writer(source_dev.get(), x_dev.get(), count / 8, nullptr, nullptr, 0,
                                                  kSpinCycles, kProducerCtas, kThreads, stream.get()));
      DSA_ASSERT_OK(launch_pdl(early_reader_kernel, dim3(1), dim3(kThreads), 0, stream.get(),
                               reinterpret_cast<const uint4*>(x_dev.get()), reinterpret_cast<uint4*>(seen_dev.get()),
                               count / 8));
      DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
      ASSERT_EQ(differences(x_dev.download(), new_x), "") << "the producer did not write x";
      const std::vector<uint16_t> seen = seen_dev.download();
      stale = 0;
      for (int i = 0; i < count; ++i) stale += seen[i] == old_x[i] && old_x[i] != new_x[i];
    }
    std::printf(
        "[head_gemv PDL chain] a PDL kernel skipping the wait read %d of %d values of x before the producer "
        "wrote them (0: this device cannot show a missing wait in the chain below)\n",
        stale, count);
  }

  for (const int m : testing::quick_mode() ? std::vector<int>{4} : std::vector<int>{1, 4, 9}) {
    SCOPED_TRACE("m " + std::to_string(m));
    const int64_t x_count = int64_t(m) * kHeads * kRows;  // BF16 x, and z
    const int64_t kv_count = int64_t(m) * kWidth;         // BF16 kv
    const int64_t q_count = int64_t(m) * kHeads * kCols;  // FP8 q, and BF16 y
    const std::vector<uint16_t> x_steps = testing::random_bf16(steps * x_count, 1.0f, rng);
    const std::vector<uint16_t> kv_steps = testing::random_bf16(steps * kv_count, 1.0f, rng);
    const std::vector<uint16_t> x_old = testing::random_bf16(x_count, 1.0f, rng);
    const std::vector<uint16_t> kv_old = testing::random_bf16(kv_count, 1.0f, rng);
    const std::vector<uint16_t> a_weight = testing::random_bf16(kHeads * kRows * kCols, 0.05f, rng);
    const std::vector<uint16_t> b_weight = testing::random_bf16(kHeads * kRows * kCols, 0.05f, rng);
    const std::vector<uint16_t> v_weight = testing::random_bf16(kHeads * kCols * kRows, 0.05f, rng);
    std::vector<int64_t> slots(kBlocks * kBlockSize);  // step s, token t: slots[s * m + t]
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = int64_t(i);
    std::shuffle(slots.begin(), slots.end(), rng);
    const std::vector<uint8_t> cache_before(size_t(kBlocks) * kBlockSize * kWidth, 0xA5);

    DeviceBuffer<uint16_t> x_source(x_steps), kv_source(kv_steps), x(x_old), kv(kv_old);
    DeviceBuffer<uint16_t> a_w(a_weight), b_w(b_weight), v_w(v_weight);
    DeviceBuffer<uint8_t> q(q_count), q_snapshots(steps * q_count), cache(cache_before);
    DeviceBuffer<uint16_t> y(q_count), z(x_count), z_snapshots(steps * x_count);
    DeviceBuffer<int64_t> slots_dev(slots);
    DeviceBuffer<float> scale_dev(std::vector<float>{kScale}), k_scale_dev(std::vector<float>{kKScale});

    std::vector<KvCacheWrite> writes;  // step s writes its m tokens' kv at slots[s * m ..]
    for (int s = 0; s < steps; ++s) {
      writes.push_back(KvCacheWrite{make_tensor(kv.get(), DType::kBF16, {m, kWidth}),
                                    make_tensor(cache.get(), DType::kFP8E4M3, {kBlocks, kBlockSize, kWidth}),
                                    make_tensor(slots_dev.get() + s * m, DType::kI64, {m}),
                                    make_tensor(k_scale_dev.get(), DType::kF32, {1}), nullptr});
    }
    HeadGemvArgs a, b, v;
    a.x = b.x = make_tensor(x.get(), DType::kBF16, {m, kHeads, kRows});
    a.weight = make_tensor(a_w.get(), DType::kBF16, {kHeads, kRows, kCols});
    a.out = make_tensor(q.get(), DType::kFP8E4M3, {m, kHeads, kCols});
    a.scale = make_tensor(scale_dev.get(), DType::kF32, {1});
    b.weight = make_tensor(b_w.get(), DType::kBF16, {kHeads, kRows, kCols});
    b.out = make_tensor(y.get(), DType::kBF16, {m, kHeads, kCols});
    v.x = make_tensor(y.get(), DType::kBF16, {m, kHeads, kCols});
    v.weight = make_tensor(v_w.get(), DType::kBF16, {kHeads, kCols, kRows});
    v.out = make_tensor(z.get(), DType::kBF16, {m, kHeads, kRows});
    a.sums = b.sums = v.sums = HeadGemvSums::kSeedOrder;  // checked bitwise against the reference

    // Enqueues every step; with synchronize_each, a stream synchronize after each launch.
    const auto enqueue_chain = [&](bool synchronize_each) -> Status {
      const auto after_launch = [&]() -> Status {
        if (synchronize_each) DSA_CUDA_RETURN(cudaStreamSynchronize(stream.get()));
        return Status();
      };
      for (int s = 0; s < steps; ++s) {
        DSA_CUDA_RETURN(testing::launch_late_writer(
            x_source.get() + s * x_count, x.get(), static_cast<int>(x_count / 8), kv_source.get() + s * kv_count,
            kv.get(), static_cast<int>(kv_count / 8), kSpinCycles, kProducerCtas, kThreads, stream.get()));
        DSA_RETURN_IF_ERROR(after_launch());
        a.cache = &writes[s];
        for (const HeadGemvArgs* launch :
             s % 2 == 0 ? std::vector<const HeadGemvArgs*>{&a, &b, &v} : std::vector<const HeadGemvArgs*>{&b, &v, &a}) {
          DSA_RETURN_IF_ERROR(head_gemv(*launch, stream.get()));
          DSA_RETURN_IF_ERROR(after_launch());
        }
        DSA_RETURN_IF_ERROR(launch_pdl(
            snapshot_kernel, dim3(16), dim3(kThreads), 0, stream.get(), reinterpret_cast<const uint4*>(q.get()),
            reinterpret_cast<uint4*>(q_snapshots.get() + s * q_count), static_cast<int>(q_count / 16),
            reinterpret_cast<const uint4*>(z.get()), reinterpret_cast<uint4*>(z_snapshots.get() + s * x_count),
            static_cast<int>(x_count / 8)));
        DSA_RETURN_IF_ERROR(after_launch());
      }
      return Status();
    };
    // Outputs, snapshots and cache poisoned or reset; x and kv back to the old values when asked.
    const auto reset = [&](bool old_inputs) {
      if (old_inputs) {
        x.upload(x_old);
        kv.upload(kv_old);
      }
      cache.upload(cache_before);
      for (DeviceBuffer<uint8_t>* buffer : {&q, &q_snapshots}) buffer->fill_bytes(kPoison);
      for (DeviceBuffer<uint16_t>* buffer : {&y, &z, &z_snapshots}) buffer->fill_bytes(kPoison);
    };
    struct Result {
      std::vector<uint8_t> q;
      std::vector<uint16_t> z;
      std::vector<uint8_t> cache;
    };
    const auto expect_same = [&](const Result& got, const Result& want, const std::string& what) {
      EXPECT_EQ(differences(got.q, want.q), "") << what << ": q (FP8 out of the absorb)";
      EXPECT_EQ(differences(got.z, want.z), "") << what << ": z (BF16 out of head_gemv on head_gemv's output)";
      EXPECT_EQ(differences(got.cache, want.cache), "") << what << ": cache bytes of the fused write";
    };

    // Serialized, against the reference.
    reset(true);
    DSA_ASSERT_OK(enqueue_chain(true));
    DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
    const Result serialized{q_snapshots.download(), z_snapshots.download(), cache.download()};
    Result expected{{}, {}, cache_before};
    const HeadGemvTactic absorb_tactic = head_gemv_tactic(kHeads, kRows, kCols, m);
    const HeadGemvTactic value_up_tactic = head_gemv_tactic(kHeads, kCols, kRows, m);
    for (int s = 0; s < steps; ++s) {
      const uint16_t* x_step = x_steps.data() + s * x_count;
      const reference::HeadGemvHost a_host{x_step, kHeads * kRows, a_weight.data(), kRows * kCols, kCols,
                                           m,      kHeads,         kRows,           kCols};
      const std::vector<uint8_t> q_step = reference::head_gemv_fp8(a_host, absorb_tactic, kScale);
      reference::HeadGemvHost b_host = a_host;
      b_host.weight = b_weight.data();
      const std::vector<uint16_t> y_step = reference::head_gemv_bf16(b_host, absorb_tactic);
      const reference::HeadGemvHost v_host{
          y_step.data(), kHeads * kCols, v_weight.data(), kCols * kRows, kRows, m, kHeads, kCols, kRows};
      const std::vector<uint16_t> z_step = reference::head_gemv_bf16(v_host, value_up_tactic);
      expected.q.insert(expected.q.end(), q_step.begin(), q_step.end());
      expected.z.insert(expected.z.end(), z_step.begin(), z_step.end());
      ASSERT_EQ(
          reference::cache_write(kv_steps.data() + s * kv_count, kWidth, m, kWidth, slots.data() + s * m, m, kKScale,
                                 expected.cache.data(), kBlocks, kBlockSize, kBlockSize * kWidth, kWidth),
          0);
    }
    expect_same(serialized, expected, "serialized launches vs the reference");

    // Back to back with PDL; then with every launch releasing its dependents
    // before its wait (HeadGemvArgs::release_dependents_early): the same bits.
    for (const bool early : {false, true}) {
      a.release_dependents_early = b.release_dependents_early = v.release_dependents_early = early;
      reset(true);
      DSA_ASSERT_OK(enqueue_chain(false));
      DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
      DSA_ASSERT_CUDA(cudaGetLastError());
      expect_same(Result{q_snapshots.download(), z_snapshots.download(), cache.download()}, serialized,
                  early ? "PDL chain releasing early vs serialized launches" : "PDL chain vs serialized launches");
    }
    a.release_dependents_early = b.release_dependents_early = v.release_dependents_early = false;

    // The PDL chain captured once and replayed: the first replay from the old
    // inputs, the second from what the first left in x and kv (the last
    // step's values, which differ from the first step's too).
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
    const Status captured = enqueue_chain(false);
    DSA_ASSERT_CUDA(cudaStreamEndCapture(stream.get(), &graph));
    DSA_ASSERT_OK(captured);
    DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      reset(replay == 0);
      DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream.get()));
      DSA_ASSERT_CUDA(cudaStreamSynchronize(stream.get()));
      expect_same(Result{q_snapshots.download(), z_snapshots.download(), cache.download()}, serialized,
                  "graph replay " + std::to_string(replay) + " vs serialized launches");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// Fused vs the stock sequence (cuBLAS bmm, then the stock quant): the sums
// differ only in order, so the BF16 results differ by a rounding at most
// except where cancellation makes the result tiny.
TEST(HeadGemvGpu, AgreesWithCublasAndTheStockQuant) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 4);
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  for (auto [rows, cols] : {std::pair{256, 512}, {512, 256}}) {
    for (int heads : {8, 64}) {
      for (int m : {1, 4, 16}) {
        if (testing::quick_mode() && (heads != 8 || m != 4)) continue;
        SCOPED_TRACE("I " + std::to_string(rows) + " J " + std::to_string(cols) + " H " + std::to_string(heads) +
                     " m " + std::to_string(m));
        const size_t n_out = size_t(m) * heads * cols;
        DeviceBuffer<uint16_t> x_dev(testing::random_bf16(size_t(m) * heads * rows, 1.0f, rng));
        DeviceBuffer<uint16_t> w_dev(testing::random_bf16(size_t(heads) * rows * cols, 0.05f, rng));
        DeviceBuffer<uint16_t> ours(n_out), theirs(n_out);
        DeviceBuffer<uint8_t> ours_fp8(n_out), theirs_fp8(n_out);
        DeviceBuffer<float> scale_dev(std::vector<float>{0.0125f});
        HeadGemvArgs a;
        a.x = make_tensor(x_dev.get(), DType::kBF16, {m, heads, rows});
        a.weight = make_tensor(w_dev.get(), DType::kBF16, {heads, rows, cols});
        a.out = make_tensor(ours.get(), DType::kBF16, {m, heads, cols});
        DSA_ASSERT_OK(head_gemv(a, nullptr));
        HeadGemvArgs a8 = a;
        a8.out = make_tensor(ours_fp8.get(), DType::kFP8E4M3, {m, heads, cols});
        a8.scale = make_tensor(scale_dev.get(), DType::kF32, {1});
        DSA_ASSERT_OK(head_gemv(a8, nullptr));
        // Poisoned: the comparison below then also shows cuBLAS wrote every value
        // (and initcheck, which does not see cuBLAS's bulk stores, sees the bytes set).
        theirs.fill_bytes(kPoison);
        const TensorView theirs_view = make_tensor(theirs.get(), DType::kBF16, {m, heads, cols});
        DSA_ASSERT_OK(cublas_head_bmm(handle, a.x, a.weight, theirs_view));
        DSA_ASSERT_OK(stock_static_fp8_quant(theirs_view, make_tensor(theirs_fp8.get(), DType::kFP8E4M3, {m, heads, cols}),
                                             a8.scale, nullptr));
        DSA_ASSERT_CUDA(cudaDeviceSynchronize());
        const std::vector<uint16_t> o = ours.download(), r = theirs.download();
        // Raw ulp distances blow up where cancellation leaves a value near zero
        // (a sign flip there is thousands of "ulp"), so the bound is on the
        // difference in ulp of the larger of the two values and the outputs' RMS.
        double square_sum = 0;
        for (uint16_t v : r) square_sum += double(num::bf16_to_float(v)) * num::bf16_to_float(v);
        const double rms = std::sqrt(square_sum / double(n_out));
        int max_ulp = 0;
        double max_scaled_ulp = 0;
        size_t over_one = 0;
        for (size_t i = 0; i < n_out; ++i) {
          const int d = bf16_ulp_distance(o[i], r[i]);
          max_ulp = std::max(max_ulp, d);
          over_one += d > 1;
          const double a = num::bf16_to_float(o[i]), b = num::bf16_to_float(r[i]);
          const double magnitude = std::max({std::fabs(a), std::fabs(b), rms});
          const double ulp = std::ldexp(1.0, std::ilogb(magnitude) - 7);  // BF16: 8 significant bits
          max_scaled_ulp = std::max(max_scaled_ulp, std::fabs(a - b) / ulp);
        }
        const std::vector<uint8_t> o8 = ours_fp8.download(), r8 = theirs_fp8.download();
        int max_fp8_steps = 0;
        for (size_t i = 0; i < n_out; ++i) {
          max_fp8_steps = std::max(max_fp8_steps, fp8_code_distance(o8[i], r8[i]));
        }
        std::printf("[head_gemv vs cuBLAS] I %d J %d H %d m %d: max %d BF16 ulp (%.2f at the outputs' scale), %zu of %zu "
                    "over 1 ulp; FP8 max %d code steps\n",
                    rows, cols, heads, m, max_ulp, max_scaled_ulp, over_one, n_out, max_fp8_steps);
        EXPECT_LE(over_one, n_out / 1000) << "more than 0.1% of values differ by over 1 BF16 ulp";
        EXPECT_LE(max_scaled_ulp, 2.0) << "a difference beyond what summation order explains";
        EXPECT_LE(max_fp8_steps, 1);
      }
    }
  }
  cublasDestroy(handle);
}

}  // namespace
}  // namespace dsa
