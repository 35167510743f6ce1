// DeepSeek-V3.2's indexer as a configuration of the library's indexer: pool 1
// (a key per token, no gate, ape or ring), 64 heads, top-2048 tokens, RoPE
// (half-split, the first 64 of 128 dims) before the Hadamard on q and k.
// CPU: the plan's checks; the RoPE step against rope.h's reference; the key
// bytes against a CPU model of vLLM's indexer_k_quant_and_cache (and the
// scale rule against DeepSeek's act_quant); the reference's keys and rows
// against a float64 brute force. GPU (skipped without one): prefill,
// prepare, select and remap at the V3.2 shape, contexts 1k / 32k / 128k and
// m = 1, 4, 8, bitwise (exact logits) or within the FP32-accumulation bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/rope.h"
#include "indexer/indexer_math.h"
#include "indexer/indexer_reference.h"
#include "indexer/indexer_test_state.h"
#include "rope/rope_reference.h"
#include "support.h"

namespace dsa {
namespace {

namespace im = indexer_math;
using testing::DeviceBuffer;
using testing::expect_rejected;
constexpr int kDim = kIndexerDim;
constexpr uint8_t kPoison = 0xAB;

// DeepSeek-V3.2's indexer: 64 heads, pool 1, top-2048, RoPE on the first 64
// dims, half-split; block_size 64 (vLLM's page for V3.2).
IndexerPlan v32_plan(int64_t max_context, int max_tokens, int block_size = 64) {
  IndexerPlan plan;
  plan.heads = 64;
  plan.pool = 1;
  plan.ring = 1;
  plan.topk = 2048;
  plan.rope_dims = 64;
  plan.rope_style = RopeStyle::kHalfSplit;
  plan.block_size = block_size;
  plan.max_context = max_context;
  plan.max_tokens = max_tokens;
  return plan;
}

// The library's F32 table of the dsv32 indexer rotary, rows 0..rows-1
// (`dims` rotated dims: the preset's 64 unless asked otherwise).
std::vector<float> v32_table(int64_t rows, int dims = 64) {
  RopeConfig config;
  EXPECT_TRUE(rope_preset_config("dsv32", RopeTarget::kIndexer, &config).ok());
  config.rope_dim = dims;
  std::vector<float> table(size_t(rows) * config.rope_dim);
  EXPECT_TRUE(rope_cos_sin_table(config, 0, rows, table.data()).ok());
  return table;
}

void* fake_pointer(uintptr_t region) { return reinterpret_cast<void*>(region << 16); }

// ---------------------------------------------------------------------------
// Plan and argument checks.

TEST(IndexerV32Checks, PlanAcceptsPoolOneWithRopeAndNamesEachBadField) {
  IndexerPlan plan = v32_plan(131072, 8);
  DSA_ASSERT_OK(check_indexer_plan(plan));
  EXPECT_EQ(indexer_row_width(plan), 2048);  // no tail: K rounded up to 128
  EXPECT_EQ(indexer_top_pools(plan), 2048);
  EXPECT_EQ(indexer_pools_per_page(plan), 64);
  EXPECT_EQ(indexer_page_bytes(plan), 64 * 132);
  EXPECT_EQ(indexer_tokens_per_request(plan), kIndexerMaxTokens);  // no ring: drafts of any count
  EXPECT_EQ(indexer_ring_for(1, 8), 1);
  EXPECT_EQ(indexer_workspace_layout(plan).logits_stride, 131072);  // a logit per token
  plan.topk = 1000;
  DSA_ASSERT_OK(check_indexer_plan(plan));
  EXPECT_EQ(indexer_row_width(plan), 1024);
  plan.block_size = 256;
  DSA_ASSERT_OK(check_indexer_plan(plan));
  plan.rope_dims = 0;  // pool 1 without RoPE
  DSA_ASSERT_OK(check_indexer_plan(plan));

  plan = v32_plan(131072, 8);
  plan.topk = 4096;
  expect_rejected(check_indexer_plan(plan), "plan.topk", "1..2048 tokens (plan.pool 1)");
  plan = v32_plan(131072, 8);
  plan.ring = 2;
  expect_rejected(check_indexer_plan(plan), "plan.ring", "1 (plan.pool 1 keeps no ring)");
  plan = v32_plan(131072, 8, 96);
  expect_rejected(check_indexer_plan(plan), "plan.block_size", "multiple of 64");
  plan = v32_plan(131072, 8);
  plan.rope_dims = 48;
  expect_rejected(check_indexer_plan(plan), "plan.rope_dims", "16, 32, 64 or 128");
  plan.rope_dims = 64;
  plan.rope_style = static_cast<RopeStyle>(2);
  expect_rejected(check_indexer_plan(plan), "plan.rope_style", "kHalfSplit");
  IndexerPlan pooled;  // glm5next's default: RoPE refused with pools
  pooled.rope_dims = 64;
  expect_rejected(check_indexer_plan(pooled), "plan.rope_dims", "0 with pools of 4");
  pooled = IndexerPlan();
  pooled.pool = 2;
  expect_rejected(check_indexer_plan(pooled), "plan.pool", "4, 8 or 16 tokens per pool, or 1");
}

// Prepare and prefill at pool 1: no ring, gate or ape needed; the table is
// required, F32 or BF16, with a row for every position the plan allows.
TEST(IndexerV32Checks, PrepareAndPrefillNeedTheTableNotTheRingGateOrApe) {
  const int64_t m = 4, requests = 2, width = 2048, blocks = 4096;
  const IndexerPlan plan = v32_plan(131072, 8);
  IndexerPrepareArgs a;
  a.plan = plan;
  a.index_q = make_tensor(fake_pointer(0x1000), DType::kBF16, {m, 64, kDim});
  a.index_k = make_tensor(fake_pointer(0x2000), DType::kBF16, {m, kDim});
  a.head_weights = make_tensor(fake_pointer(0x3000), DType::kF32, {m, 64});
  a.k_norm_weight = make_tensor(fake_pointer(0x4000), DType::kF32, {kDim});
  a.k_norm_bias = make_tensor(fake_pointer(0x5000), DType::kF32, {kDim});
  a.positions = make_tensor(fake_pointer(0x6000), DType::kI64, {m});
  a.token_requests = make_tensor(fake_pointer(0x7000), DType::kI32, {m});
  a.state.block_table = make_tensor(fake_pointer(0x8000), DType::kI32, {requests, width});
  a.state.k_cache = make_tensor(fake_pointer(0x9000), DType::kU8, {blocks, 64 * 132});
  a.workspace = make_tensor(fake_pointer(0x100000), DType::kU8, {indexer_workspace_layout(plan).bytes});
  a.cos_sin = make_tensor(fake_pointer(0xA000), DType::kF32, {163840, 64});
  DSA_ASSERT_OK(check_indexer_prepare(a));
  a.cos_sin = make_tensor(fake_pointer(0xA000), DType::kBF16, {131072, 64});
  DSA_ASSERT_OK(check_indexer_prepare(a));
  a.cos_sin = make_tensor(fake_pointer(0xA000), DType::kBF16, {131071, 64});
  expect_rejected(check_indexer_prepare(a), "cos_sin", "at least plan.max_context = 131072 rows");
  a.cos_sin = make_tensor(fake_pointer(0xA000), DType::kF32, {131072, 32});
  expect_rejected(check_indexer_prepare(a), "cos_sin", "[*, 64]");
  a.cos_sin = make_tensor(fake_pointer(0xA000), DType::kI32, {131072, 64});
  expect_rejected(check_indexer_prepare(a), "cos_sin", "f32 or bf16");
  a.cos_sin = TensorView();
  expect_rejected(check_indexer_prepare(a), "cos_sin", "");
  a.cos_sin = make_tensor(fake_pointer(0x9000), DType::kF32, {131072, 64});  // inside the K cache
  expect_rejected(check_indexer_prepare(a), "k_cache", "memory disjoint from 'cos_sin'");
  a.cos_sin = make_tensor(fake_pointer(0xA000), DType::kF32, {131072, 64});
  a.state.k_cache = make_tensor(fake_pointer(0x9000), DType::kU8, {blocks, 128 / 4 * 132});  // a page of 32 pools
  expect_rejected(check_indexer_prepare(a), "k_cache", "");

  IndexerPrefillArgs f;
  f.plan = plan;
  f.index_k = make_tensor(fake_pointer(0x2000), DType::kBF16, {5000, kDim});
  f.k_norm_weight = a.k_norm_weight;
  f.k_norm_bias = a.k_norm_bias;
  f.request = 1;
  f.state.block_table = a.state.block_table;
  f.state.k_cache = make_tensor(fake_pointer(0x9000), DType::kU8, {blocks, 64 * 132});
  f.cos_sin = a.cos_sin;
  DSA_ASSERT_OK(check_indexer_prefill(f));
  f.cos_sin = TensorView();
  expect_rejected(check_indexer_prefill(f), "cos_sin", "");
}

// ---------------------------------------------------------------------------
// CPU facts.

// The indexer's RoPE step (indexer_math::rope_row) is rope.h's reference
// rotation (reference::rope_rotate_f32, then BF16) bit for bit, for both
// styles and every R, on the dsv32 indexer table; the dsv32 preset's
// indexer rotary is the V3.2 plan's (64 dims, half-split).
TEST(IndexerV32Reference, RopeStepEqualsTheRopeReference) {
  RopeConfig config;
  DSA_ASSERT_OK(rope_preset_config("dsv32", RopeTarget::kIndexer, &config));
  EXPECT_EQ(config.rope_dim, v32_plan(1, 1).rope_dims);
  EXPECT_EQ(config.style, v32_plan(1, 1).rope_style);
  std::mt19937_64 rng(testing::test_seed());
  for (int dims : {16, 32, 64, 128}) {
    for (RopeStyle style : {RopeStyle::kHalfSplit, RopeStyle::kInterleaved}) {
      RopeConfig c = config;
      c.rope_dim = dims;
      for (int64_t position : {int64_t(0), int64_t(1), int64_t(4097), int64_t(131071)}) {
        std::vector<float> row(dims);
        DSA_ASSERT_OK(rope_cos_sin_table(c, position, 1, row.data()));
        std::vector<uint16_t> x = testing::random_bf16(kDim, 2.0f, rng), mine = x;
        im::rope_row(mine.data(), dims, style == RopeStyle::kHalfSplit, row.data(), row.data() + dims / 2);
        std::vector<float> rotated(dims);
        reference::rope_rotate_f32(x.data(), row.data(), row.data() + dims / 2, dims, style, rotated.data());
        for (int k = 0; k < kDim; ++k) {
          const uint16_t expected = k < dims ? num::float_to_bf16(rotated[k]) : x[k];
          ASSERT_EQ(mine[k], expected) << "R " << dims << " style " << int(style) << " position " << position
                                       << " value " << k;
        }
      }
    }
  }
}

// vLLM's indexer_k_quant_and_cache (csrc/cache_kernels.cu) on one BF16 row:
// amax, scale = max(amax, 1e-4) / 448, ue8m0: 2^ceil(log2(scale)), codes
// e4m3(x / scale) saturating, at byte 128 e of the page and the scale at byte
// 128 block_size + 4 e (e = slot % block_size).
void vllm_indexer_cache_write(const uint16_t* k, int64_t slot, int block_size, uint8_t* cache,
                              int64_t page_stride) {
  float amax = 0.0f;
  for (int i = 0; i < kDim; ++i) amax = std::fmax(amax, std::fabs(num::bf16_to_float(k[i])));
  float scale = std::fmax(amax, 1e-4f) / 448.0f;
  scale = std::exp2(std::ceil(std::log2(scale)));
  uint8_t* page = cache + slot / block_size * page_stride;
  const int64_t entry = slot % block_size;
  for (int i = 0; i < kDim; ++i) page[entry * kDim + i] = num::float_to_e4m3(num::bf16_to_float(k[i]) / scale);
  std::memcpy(page + int64_t(block_size) * kDim + entry * 4, &scale, 4);
}

// The key the indexer caches for one token before its quant: LayerNorm, RoPE
// of the first R dims by the table row, Hadamard x 128^-0.5 in BF16 (the
// steps of indexer.h, from indexer_math's pieces).
std::vector<uint16_t> rotated_key(const IndexerPlan& plan, const uint16_t* index_k,
                                  const reference::IndexerParamsHost& params, int64_t position) {
  std::vector<uint16_t> k(kDim);
  im::layernorm128(index_k, params.k_norm_weight, params.k_norm_bias, k.data());
  float cos[kDim / 2], sin[kDim / 2];
  reference::indexer_cos_sin(plan, params, position, cos, sin);
  im::rope_row(k.data(), plan.rope_dims, plan.rope_style == RopeStyle::kHalfSplit, cos, sin);
  float x[kDim];
  for (int i = 0; i < kDim; ++i) x[i] = num::bf16_to_float(k[i]);
  im::hadamard128(x);
  for (int i = 0; i < kDim; ++i) k[i] = num::float_to_bf16(im::hadamard_output(x[i]));
  return k;
}

struct Layer {
  std::vector<float> norm_weight, norm_bias, table;
  reference::IndexerParamsHost params;
  Layer(std::mt19937_64& rng, int64_t rows) {
    norm_weight = testing::normal_floats(kDim, 1.0f, 0.2f, rng);
    norm_bias = testing::normal_floats(kDim, 0.0f, 0.1f, rng);
    table = v32_table(rows);
    params = {norm_weight.data(), norm_bias.data(), nullptr, table.data(), false, rows, 64};
  }
};

// The K cache bytes of the reference's prefill (3 pages of 64 tokens and a
// partial one, through a shuffled block table) equal vLLM's cache write of
// the same keys, and a decode step token by token writes the same bytes.
TEST(IndexerV32Reference, KeyBytesEqualVllmsCacheWrite) {
  std::mt19937_64 rng(testing::test_seed());
  const int64_t n = 200, width = 4;
  const IndexerPlan plan = v32_plan(256, 8);
  Layer layer(rng, 256);
  testing::IndexerHostState state(plan, 1, width, rng), decoded(plan, 1, width, rng);
  decoded.block_table = state.block_table;
  const std::vector<uint16_t> k = testing::random_bf16(n * kDim, 3.0f, rng);
  int64_t errors = -1;
  DSA_ASSERT_OK(reference::indexer_prefill(plan, k.data(), nullptr, n, 0, layer.params, state.view, &errors));
  EXPECT_EQ(errors, 0);
  std::vector<uint8_t> vllm(state.k_cache.size(), 0);
  for (int64_t p = 0; p < n; ++p) {
    const std::vector<uint16_t> key = rotated_key(plan, &k[p * kDim], layer.params, p);
    const int64_t slot = int64_t(state.block_table[p / 64]) * 64 + p % 64;
    vllm_indexer_cache_write(key.data(), slot, 64, vllm.data(), state.page_stride);
  }
  EXPECT_TRUE(vllm == state.k_cache) << "the K cache differs from vLLM's indexer_k_quant_and_cache";
  // Decode in steps of up to 8 tokens (drafts of one request need no ring).
  for (int64_t p = 0; p < n;) {
    const int m = static_cast<int>(std::min<int64_t>(1 + p % 8, n - p));
    std::vector<int64_t> positions(m);
    std::iota(positions.begin(), positions.end(), p);
    std::vector<int32_t> requests(m, 0);
    std::vector<uint16_t> q(size_t(m) * 64 * kDim, 0);
    std::vector<float> w(size_t(m) * 64, 1.0f);
    const reference::IndexerStepHost step{m, q.data(), &k[p * kDim], w.data(), nullptr, positions.data(),
                                          requests.data()};
    reference::IndexerQueryHost query;
    DSA_ASSERT_OK(reference::indexer_prepare(plan, step, layer.params, decoded.view, &query, &errors));
    EXPECT_EQ(errors, 0);
    p += m;
  }
  EXPECT_TRUE(decoded.k_cache == state.k_cache) << "decode differs from the prefill";
}

// The scale rule: the library's power-of-two exponent equals DeepSeek's
// act_quant (ue8m0: fast_round_scale(amax * fl(1/448)), the exponent read
// from the bits, +1 when the significand is not 1) on random floats and every
// power-of-two boundary, and vLLM's exp2f(ceilf(log2f(max(amax, 1e-4) /
// 448))) except where the quotient lies less than 2^-20 above a power of two
// 2^k: log2f rounds the excess away and vLLM takes 2^k (its largest values
// then saturate at 448, a relative change below 2^-20), the library 2^(k+1).
TEST(IndexerV32Reference, ScaleExponentEqualsDeepSeeksAndVllmsRule) {
  const auto deepseek = [](float amax) {
    const float s = std::fmax(amax, 1e-4f) * (1.0f / 448.0f);
    const uint32_t bits = num::float_bits(s);
    return int((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0 ? 1 : 0);
  };
  const auto vllm = [](float amax) { return int(std::ceil(std::log2(std::fmax(amax, 1e-4f) / 448.0f))); };
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_real_distribution<float> exponent(-20.0f, 30.0f);
  std::vector<float> values;
  for (int i = 0; i < 200000; ++i) values.push_back(std::exp2(exponent(rng)));
  for (int e = -20; e <= 30; ++e) {
    const float boundary = std::ldexp(448.0f, e);
    values.insert(values.end(), {boundary, std::nextafter(boundary, 0.0f), std::nextafter(boundary, FLT_MAX)});
  }
  int64_t vllm_lower = 0;
  for (float amax : values) {
    ASSERT_EQ(im::fp8_scale_exponent(amax), deepseek(amax)) << amax;
    const int k = im::fp8_scale_exponent(amax), v = vllm(amax);
    if (k == v) continue;
    const double quotient = double(std::fmax(amax, 1e-4f)) / 448.0;
    ASSERT_EQ(v, k - 1) << amax;
    ASSERT_LT(quotient / std::ldexp(1.0, v) - 1.0, std::ldexp(1.0, -20)) << amax;
    ++vllm_lower;
  }
  EXPECT_GT(vllm_lower, 0) << "the boundary values above 448 * 2^k";
  std::printf("vLLM's log2f rule takes the lower power of two for %lld of %zu values (all within 2^-20 above it)\n",
              static_cast<long long>(vllm_lower), values.size());
}

// The reference's pool-1 path against float64: each cached key, dequantized,
// lies within its quantization and BF16 roundings of the float64 chain
// (LayerNorm, RoPE by the table, orthonormal Hadamard); and its rows are the
// float64 top-2048 of the same dequantized q and keys (logits within FP32
// chain error of each other are allowed to swap).
TEST(IndexerV32Reference, PoolOneMatchesAFloat64BruteForce) {
  std::mt19937_64 rng(testing::test_seed());
  const int64_t L = 5000;
  const int heads = 64;
  const IndexerPlan plan = v32_plan(L, 2);
  Layer layer(rng, L);
  testing::IndexerHostState state(plan, 2, (L + 63) / 64, rng);
  const std::vector<uint16_t> k = testing::random_bf16((L - 1) * kDim, 2.0f, rng);
  int64_t errors = -1;
  DSA_ASSERT_OK(reference::indexer_prefill(plan, k.data(), nullptr, L - 1, 1, layer.params, state.view, &errors));
  const std::vector<uint16_t> q = testing::random_bf16(size_t(2) * heads * kDim, 1.0f, rng);
  const std::vector<uint16_t> last = testing::random_bf16(size_t(2) * kDim, 2.0f, rng);
  const std::vector<float> w = testing::normal_floats(size_t(2) * heads, 0.0f, 1.0f, rng);
  const std::vector<int64_t> positions = {L - 1, 7};
  const std::vector<int32_t> requests = {1, -1};  // a padding token beside
  const reference::IndexerStepHost step{2, q.data(), last.data(), w.data(), nullptr, positions.data(),
                                        requests.data()};
  reference::IndexerQueryHost query;
  DSA_ASSERT_OK(reference::indexer_prepare(plan, step, layer.params, state.view, &query, &errors));
  reference::IndexerRowsHost rows;
  DSA_ASSERT_OK(reference::indexer_select(plan, step, query, state.view, &rows));

  // Keys against float64.
  const double scale = 1.0 / std::sqrt(128.0);
  int64_t checked = 0;
  for (int64_t p = 0; p < L; p += 37) {
    const uint16_t* x = p < L - 1 ? &k[p * kDim] : last.data();
    double v[kDim], mean = 0, var = 0;
    for (int i = 0; i < kDim; ++i) mean += num::bf16_to_float(x[i]) / kDim;
    for (int i = 0; i < kDim; ++i) var += std::pow(num::bf16_to_float(x[i]) - mean, 2) / kDim;
    for (int i = 0; i < kDim; ++i) {
      v[i] = (num::bf16_to_float(x[i]) - mean) / std::sqrt(var + 1e-6) * layer.norm_weight[i] + layer.norm_bias[i];
    }
    const float* row = &layer.table[p * 64];
    double r[kDim];
    std::copy(v, v + kDim, r);
    for (int i = 0; i < 32; ++i) {  // half-split pairs (i, i + 32)
      r[i] = v[i] * row[i] - v[i + 32] * row[32 + i];
      r[i + 32] = v[i + 32] * row[i] + v[i] * row[32 + i];
    }
    double h[kDim], magnitude = 0;
    for (int i = 0; i < kDim; ++i) {
      h[i] = 0;
      for (int j = 0; j < kDim; ++j) h[i] += (__builtin_popcount(i & j) % 2 ? -r[j] : r[j]) * scale;
      magnitude = std::max(magnitude, std::fabs(h[i]));
    }
    const reference::PoolEntry entry = reference::read_pool(plan, state.view, 1, p);
    ASSERT_NE(entry.codes, nullptr);
    for (int i = 0; i < kDim; ++i) {
      const double got = double(num::e4m3_to_float(entry.codes[i])) * entry.scale;
      // e4m3: 2^-4 relative, 2^-10 scale near zero; BF16 roundings before
      // it (LayerNorm, RoPE, Hadamard): a few 2^-9 of the row's magnitude.
      const double bound = std::ldexp(std::fabs(h[i]), -4) + std::ldexp(double(entry.scale), -10) +
                           4 * std::ldexp(magnitude, -9);
      ASSERT_LE(std::fabs(got - h[i]), bound) << "position " << p << " dim " << i;
    }
    ++checked;
  }
  EXPECT_GT(checked, 100);

  // Rows against a float64 top-2048 of the dequantized values.
  std::vector<double> logits(L), fp32_slack(L);
  for (int64_t p = 0; p < L; ++p) {
    const reference::PoolEntry entry = reference::read_pool(plan, state.view, 1, p);
    double sum = 0, magnitude = 0;
    for (int h = 0; h < heads; ++h) {
      double dot = 0;
      for (int i = 0; i < kDim; ++i) {
        dot += double(num::e4m3_to_float(query.q_fp8[size_t(h) * kDim + i])) * num::e4m3_to_float(entry.codes[i]);
      }
      sum += double(query.head_weights[h]) * std::max(dot, 0.0);
      magnitude += std::fabs(double(query.head_weights[h]) * std::max(dot, 0.0));
    }
    logits[p] = sum * entry.scale;
    fp32_slack[p] = std::ldexp(magnitude * std::fabs(entry.scale), -24) * (heads + 4);
  }
  std::vector<int64_t> order(L);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  const double threshold = logits[order[2047]];
  const int32_t* row = &rows.topk_positions[0];
  ASSERT_EQ(indexer_row_width(plan), 2048);
  for (int c = 0; c < 2048; ++c) {
    ASSERT_GE(row[c], 0) << "column " << c;
    if (c > 0) ASSERT_GT(row[c], row[c - 1]) << "increasing positions";
    EXPECT_GE(logits[row[c]] + fp32_slack[row[c]], threshold - fp32_slack[order[2047]]) << "column " << c;
  }
  int64_t missing = 0;  // float64 top keys clearly above the threshold must be taken
  for (int c = 0; c < 2048; ++c) {
    const int64_t p = order[c];
    if (logits[p] - fp32_slack[p] > threshold + fp32_slack[order[2047]]) {
      missing += !std::binary_search(row, row + 2048, int32_t(p));
    }
  }
  EXPECT_EQ(missing, 0);
  for (int c = 0; c < 2048; ++c) EXPECT_EQ(rows.topk_positions[2048 + c], -1) << "padding token";
}

// ---------------------------------------------------------------------------
// GPU: the V3.2 shape end to end against the reference.

// A step at the V3.2 shape: `groups` requests, each with `per_request`
// consecutive draft tokens ending at context ~`context` (request r's last
// token at L = context - 13 r), prefilled by the reference up to its first
// token; then the reference's prepare and select.
struct V32Step : testing::IndexerHostState {
  int m;
  bool bf16_table = false;  // the table the GPU and the reference read: BF16 bits of `table`
  bool padding = false;     // a padding token (request -1, position -1) after the requests' tokens
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;
  std::vector<float> table, norm_weight, norm_bias, head_weights;
  std::vector<uint16_t> table_bf16, index_q, index_k;
  std::vector<std::vector<uint16_t>> prefill_k;  // per request
  std::vector<uint8_t> k_cache_before_prepare;
  reference::IndexerParamsHost params;
  reference::IndexerQueryHost query;
  reference::IndexerRowsHost rows;

  V32Step(int64_t context, int groups, int per_request, std::mt19937_64& rng)
      : IndexerHostState(v32_plan(context, groups * per_request), groups, (context + 63) / 64, rng),
        m(groups * per_request) {
    fill(context, groups, per_request, rng);
  }

  // Any pool-1 plan (plan.max_tokens >= groups * per_request + padding; a
  // table of plan.max_context rows of plan.rope_dims, none for 0).
  V32Step(const IndexerPlan& p, int64_t context, int groups, int per_request, bool bf16, bool with_padding,
          std::mt19937_64& rng)
      : IndexerHostState(p, groups, (p.max_context + p.block_size - 1) / p.block_size, rng),
        m(groups * per_request + (with_padding ? 1 : 0)),
        bf16_table(bf16),
        padding(with_padding) {
    fill(context, groups, per_request, rng);
  }

  void fill(int64_t context, int groups, int per_request, std::mt19937_64& rng) {
    for (int r = 0; r < groups; ++r) {
      for (int j = 0; j < per_request; ++j) {
        positions.push_back(context - 1 - 13 * r - (per_request - 1 - j));
        token_requests.push_back(r);
      }
    }
    if (padding) {
      positions.push_back(-1);
      token_requests.push_back(-1);
    }
    const int dims = plan.rope_dims;
    if (dims > 0) table = v32_table(plan.max_context, dims);
    if (bf16_table) {
      for (float v : table) table_bf16.push_back(num::float_to_bf16(v));
    }
    norm_weight = testing::normal_floats(kDim, 1.0f, 0.2f, rng);
    norm_bias = testing::normal_floats(kDim, 0.0f, 0.1f, rng);
    params = {norm_weight.data(), norm_bias.data(), nullptr, nullptr, false, 0, 0};
    if (dims > 0) {
      params.cos_sin = bf16_table ? static_cast<const void*>(table_bf16.data()) : table.data();
      params.cos_sin_bf16 = bf16_table;
      params.cos_sin_rows = plan.max_context;
      params.cos_sin_row_stride = dims;
    }
    for (int r = 0; r < groups; ++r) {
      const int64_t n = positions[size_t(r) * per_request];
      prefill_k.push_back(testing::random_bf16(n * kDim, 2.0f, rng));
      int64_t errors = -1;
      DSA_ASSERT_OK(reference::indexer_prefill(plan, prefill_k.back().data(), nullptr, n, r, params, view, &errors));
    }
    k_cache_before_prepare = k_cache;
    index_q = testing::random_bf16(size_t(m) * plan.heads * kDim, 1.0f, rng);
    index_k = testing::random_bf16(size_t(m) * kDim, 2.0f, rng);
    head_weights = testing::normal_floats(size_t(m) * plan.heads, 0.0f, 1.0f, rng);
    const reference::IndexerStepHost step{m, index_q.data(), index_k.data(), head_weights.data(), nullptr,
                                          positions.data(), token_requests.data()};
    int64_t errors = -1;
    DSA_ASSERT_OK(reference::indexer_prepare(plan, step, params, view, &query, &errors));
    EXPECT_EQ(errors, 0);
    DSA_ASSERT_OK(reference::indexer_select(plan, step, query, view, &rows));
  }
};

// GPU prefill from a zero K cache, then prepare and select (PDL, exact
// logits): K cache, q_fp8, folded weights, rows and slots bitwise the
// reference's; remap of its rows; then FP32-accumulated logits within their
// bound with rows the selection over them.
void expect_v32_chain(V32Step& s, const std::string& what) {
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const IndexerPlan plan = s.plan;
  const int width = indexer_row_width(plan), heads = plan.heads;
  DeviceBuffer<int32_t> block_table(s.block_table), topk(size_t(s.m) * width), slots(size_t(s.m) * width);
  DeviceBuffer<uint8_t> k_cache(s.k_cache.size()), workspace(size_t(indexer_workspace_layout(plan).bytes));
  DeviceBuffer<int64_t> positions(s.positions);
  DeviceBuffer<int32_t> requests(s.token_requests);
  DeviceBuffer<unsigned int> errors(1);
  DeviceBuffer<float> norm_weight(s.norm_weight), norm_bias(s.norm_bias), weights(s.head_weights);
  DeviceBuffer<float> table_f32;
  DeviceBuffer<uint16_t> table_bf16;
  if (!s.table.empty()) {
    if (s.bf16_table) {
      table_bf16 = DeviceBuffer<uint16_t>(s.table_bf16);
    } else {
      table_f32 = DeviceBuffer<float>(s.table);
    }
  }
  DeviceBuffer<uint16_t> index_q(s.index_q), index_k(s.index_k);
  k_cache.fill_bytes(0);
  errors.fill_bytes(0);
  IndexerState state;
  state.block_table = make_tensor(block_table.get(), DType::kI32, {s.requests, s.width});
  state.k_cache = make_strided(k_cache.get(), DType::kU8, {s.blocks, indexer_page_bytes(plan)}, {s.page_stride, 1});
  const TensorView cos_sin =
      plan.rope_dims == 0 ? TensorView()
      : s.bf16_table      ? make_tensor(table_bf16.get(), DType::kBF16, {plan.max_context, plan.rope_dims})
                          : make_tensor(table_f32.get(), DType::kF32, {plan.max_context, plan.rope_dims});
  const TensorView weight_view = make_tensor(norm_weight.get(), DType::kF32, {kDim});
  const TensorView bias_view = make_tensor(norm_bias.get(), DType::kF32, {kDim});

  std::vector<DeviceBuffer<uint16_t>> keep;
  for (size_t r = 0; r < s.prefill_k.size(); ++r) keep.emplace_back(s.prefill_k[r]);
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  for (size_t r = 0; r < s.prefill_k.size(); ++r) {
    IndexerPrefillArgs f;
    f.plan = plan;
    f.index_k = make_tensor(keep[r].get(), DType::kBF16, {int64_t(s.prefill_k[r].size() / kDim), kDim});
    f.k_norm_weight = weight_view;
    f.k_norm_bias = bias_view;
    f.request = static_cast<int>(r);
    f.state = state;
    f.error_count = errors.get();
    f.cos_sin = cos_sin;
    DSA_ASSERT_OK(indexer_prefill(f, stream));
  }
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_TRUE(k_cache.download() == s.k_cache_before_prepare) << what << " prefill: K cache";

  IndexerPrepareArgs a;
  a.plan = plan;
  a.plan.logits = IndexerLogits::kExact;
  a.index_q = make_tensor(index_q.get(), DType::kBF16, {s.m, heads, kDim});
  a.index_k = make_tensor(index_k.get(), DType::kBF16, {s.m, kDim});
  a.head_weights = make_tensor(weights.get(), DType::kF32, {s.m, heads});
  a.k_norm_weight = weight_view;
  a.k_norm_bias = bias_view;
  a.positions = make_tensor(positions.get(), DType::kI64, {s.m});
  a.token_requests = make_tensor(requests.get(), DType::kI32, {s.m});
  a.state = state;
  a.workspace = make_tensor(workspace.get(), DType::kU8, {indexer_workspace_layout(plan).bytes});
  a.error_count = errors.get();
  a.cos_sin = cos_sin;
  IndexerSelectArgs sel{a.plan, a.positions, a.token_requests, state, a.workspace,
                        make_tensor(topk.get(), DType::kI32, {s.m, width}),
                        make_tensor(slots.get(), DType::kI32, {s.m, width}), errors.get()};
  workspace.fill_bytes(kPoison);
  topk.fill_bytes(kPoison);
  slots.fill_bytes(kPoison);
  const Status prepared = indexer_prepare(a, stream);
  const Status selected = indexer_select(sel, stream);
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  DSA_ASSERT_OK(prepared);
  DSA_ASSERT_OK(selected);
  EXPECT_EQ(errors.download()[0], 0u) << what;
  EXPECT_TRUE(k_cache.download() == s.k_cache) << what << " prepare: K cache";
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(plan);
  const std::vector<uint8_t> ws = workspace.download();
  EXPECT_EQ(std::memcmp(&ws[layout.q_fp8], s.query.q_fp8.data(), s.query.q_fp8.size()), 0) << what << " q_fp8";
  EXPECT_EQ(std::memcmp(&ws[layout.head_weights], s.query.head_weights.data(), s.query.head_weights.size() * 4), 0)
      << what << " folded weights";
  EXPECT_TRUE(topk.download() == s.rows.topk_positions) << what << " exact: rows";
  EXPECT_TRUE(slots.download() == s.rows.slots) << what << " exact: slots";
  // The first token's logits bitwise.
  const int64_t L0 = s.positions[0] + 1;
  if (L0 > plan.topk) {
    const std::vector<float> expected =
        reference::indexer_logits(plan, s.view, 0, L0, s.query.q_fp8.data(), s.query.head_weights.data());
    for (int64_t p = 0; p < L0; ++p) {
      float got;
      std::memcpy(&got, &ws[layout.logits + p * 4], 4);
      ASSERT_EQ(num::float_bits(got), num::float_bits(expected[p])) << what << " logit " << p;
    }
  }

  // Remap of the reference's rows.
  DeviceBuffer<int32_t> caller(s.rows.topk_positions), remapped(s.rows.slots.size());
  remapped.fill_bytes(kPoison);
  const IndexerRemapArgs remap{plan, a.positions, a.token_requests, state,
                               make_tensor(caller.get(), DType::kI32, {s.m, width}),
                               make_tensor(remapped.get(), DType::kI32, {s.m, width}), errors.get()};
  DSA_ASSERT_OK(indexer_remap(remap, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(remapped.download() == s.rows.slots) << what << " remap";

  // FP32-accumulated logits (the default) over the same q.
  sel.plan.logits = IndexerLogits::kFp32Accumulation;
  topk.fill_bytes(kPoison);
  DSA_ASSERT_OK(indexer_select(sel, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> own = workspace.download();
  std::vector<std::vector<float>> logits(s.m);
  double worst = 0;
  for (int t = 0; t < s.m; ++t) {
    const int64_t L = s.positions[t] + 1;
    if (L <= plan.topk) continue;
    logits[t].resize(L);
    std::memcpy(logits[t].data(), &own[layout.logits + size_t(t) * layout.logits_stride * 4], L * 4);
    const reference::LogitDeviation d = reference::indexer_logit_deviation(
        plan, s.view, s.token_requests[t], L, &s.query.q_fp8[size_t(t) * heads * kDim],
        &s.query.head_weights[size_t(t) * heads], logits[t].data());
    EXPECT_EQ(d.outside, 0) << what << " token " << t << ": logits outside their bound";
    worst = std::max(worst, d.worst);
  }
  reference::IndexerRowsHost mine;
  const reference::IndexerStepHost step{s.m, nullptr, nullptr, nullptr, nullptr, s.positions.data(),
                                        s.token_requests.data()};
  DSA_ASSERT_OK(reference::indexer_select_on_logits(plan, step, logits, s.view, &mine));
  EXPECT_TRUE(topk.download() == mine.topk_positions) << what << " fp32: rows follow the GPU's logits";
  EXPECT_TRUE(slots.download() == mine.slots) << what << " fp32: slots";
  std::printf("[v3.2] %s: worst |logit error| / bound %.3g\n", what.c_str(), worst);
  cudaStreamDestroy(stream);
}

// Contexts 1k, 32k and 128k, m = 1 (one request), 4 (one request, 4 draft
// tokens) and 8 (two requests of 4). At 1k every row is short (L <= 2048).
TEST(IndexerV32Gpu, PrefillPrepareSelectMatchTheReferenceAtTheV32Shape) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 32);
  for (int64_t context : {int64_t(1024), int64_t(32768), int64_t(131072)}) {
    for (int m : {1, 4, 8}) {
      if (testing::quick_mode() && context == 131072 && m == 8) continue;
      const std::string what = "L " + std::to_string(context) + " m " + std::to_string(m);
      SCOPED_TRACE(what);
      V32Step s(context, m == 8 ? 2 : 1, m == 8 ? 4 : m, rng);
      if (HasFatalFailure()) return;
      expect_v32_chain(s, what);
      if (HasFatalFailure()) return;
    }
  }
}

// The pool-1 paths the V3.2 shape leaves out, each against the reference as
// above: the interleaved style and R = 16, 32, 128 (rope_lane's pairs and its
// shuffle distance R / 8), a BF16 table, pages of 128, 192, 256 and 320 keys
// (codes at 128 e, scales at 128 block_size + 4 e), no RoPE
// (prepare_kernel<1, false>), top-k below 2048 and not a multiple of 128
// (the -1 columns up to the row width), a padding token (its q rotated by
// zeros, its rows -1), two requests of 2 tokens, 16 and 32 heads, and a
// context of 40000 > 2^15 at max_context 40000 (7232 keys re-read from the
// logits on each pass beside the 32768 staged ones) at 16 heads, cheaper on
// the CPU than the 128k rows above.
TEST(IndexerV32Gpu, PoolOneVariantsMatchTheReference) {
  DSA_REQUIRE_GPU();
  struct Variant {
    const char* name;
    int heads, topk, rope_dims;
    RopeStyle style;
    int block_size;
    bool bf16_table;
    int64_t max_context, context;
    int groups, per_request;
    bool padding;
  };
  const Variant variants[] = {
      {"interleaved R 64, BF16 table, pages of 256, L 40000", 16, 2048, 64, RopeStyle::kInterleaved, 256, true, 40000,
       40000, 1, 4, true},
      {"half-split R 16, pages of 128, top-1000, two requests", 16, 1000, 16, RopeStyle::kHalfSplit, 128, false, 6000,
       6000, 2, 2, true},
      {"half-split R 128, BF16 table, pages of 192, top-512", 32, 512, 128, RopeStyle::kHalfSplit, 192, true, 3000,
       2990, 1, 1, false},
      {"interleaved R 32, pages of 64", 16, 2048, 32, RopeStyle::kInterleaved, 64, false, 5000, 5000, 1, 3, false},
      {"no RoPE, pages of 320, top-777", 16, 777, 0, RopeStyle::kHalfSplit, 320, false, 4100, 4100, 1, 2, true},
  };
  std::mt19937_64 rng(testing::test_seed() + 33);
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    IndexerPlan plan = v32_plan(v.max_context, v.groups * v.per_request + (v.padding ? 1 : 0), v.block_size);
    plan.heads = v.heads;
    plan.topk = v.topk;
    plan.rope_dims = v.rope_dims;
    plan.rope_style = v.style;
    DSA_ASSERT_OK(check_indexer_plan(plan));
    V32Step s(plan, v.context, v.groups, v.per_request, v.bf16_table, v.padding, rng);
    if (HasFatalFailure()) return;
    expect_v32_chain(s, v.name);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace dsa
