// The GPU select step (indexer_select, indexer_select_baseline) against the
// CPU reference: K caches filled by the reference's prefill, a decode step
// prepared by the reference, then the GPU rows, slots and logits compared bit
// for bit (the logits kernel's head dots are exact, as the reference's); with
// plan.logits = kFp32Accumulation the logits within their bound and the rows
// bitwise the reference's selection over the GPU's own logits.
// indexer_remap (caller rows) against reference::indexer_remap.
// GPU tests: IndexerSelectGpu.*, IndexerRemapGpu.*; argument checks without a GPU: IndexerSelectChecks.*,
// IndexerRemapChecks.*.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "baselines.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "indexer/indexer_math.h"
#include "indexer/indexer_reference.h"
#include "indexer/indexer_test_state.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;
using testing::normal_floats;
constexpr int kDim = kIndexerDim;
constexpr int kHeads = kIndexerHeads;
constexpr int kWidth = kIndexerRowWidth;
constexpr uint8_t kPoison = 0xAB;

// The plan of a scenario: one token per request, the largest context sized;
// heads, pool and top-k from `shape` (RING = pool).
IndexerPlan scenario_plan(const std::vector<int64_t>& contexts, int block_size, const IndexerPlan& shape) {
  IndexerPlan plan = shape;
  plan.ring = shape.pool;
  plan.logits = IndexerLogits::kExact;  // bitwise against the reference (the default's bound: its own test)
  plan.max_tokens = static_cast<int>(contexts.size());
  plan.block_size = block_size;
  plan.max_context = std::max<int64_t>(1, *std::max_element(contexts.begin(), contexts.end()));
  return plan;
}

// The plan of a step with draft tokens: RING 2 S (up to S + 1 tokens of one
// request), the largest position sized.
IndexerPlan draft_plan(const std::vector<int64_t>& positions, int block_size, const IndexerPlan& shape) {
  IndexerPlan plan = shape;
  plan.logits = IndexerLogits::kExact;
  plan.max_tokens = static_cast<int>(positions.size());
  plan.block_size = block_size;
  plan.ring = 2 * shape.pool;
  plan.max_context = *std::max_element(positions.begin(), positions.end()) + 1;
  return plan;
}

// A step on the host: state after the reference's prefill and prepare, and
// the reference's rows. contexts[t] = L of token t, 0 = a padding token; each
// real token is its own request (RING 4: one token per request per step).
// The second constructor takes the step's positions and token_requests as
// given (draft tokens: several tokens of one request, RING 8).
struct Scenario : testing::IndexerHostState {
  int m = 0;
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;
  reference::IndexerQueryHost query;
  reference::IndexerRowsHost rows;
  // The step's prepare inputs and the state before the prepare (for the GPU
  // prepare chained with the select).
  std::vector<float> norm_weight, norm_bias, ape, head_weights;
  std::vector<uint16_t> index_q, index_k, gate;
  std::vector<uint16_t> ring_before_prepare;
  std::vector<uint8_t> k_cache_before_prepare;
  // The prefills that made the state before the prepare: request, k and gate [n, 128].
  struct Prefill {
    int32_t request;
    std::vector<uint16_t> k, gate;
  };
  std::vector<Prefill> prefills;

  Scenario(const std::vector<int64_t>& contexts, int block_size, std::mt19937_64& rng,
           const IndexerPlan& shape = IndexerPlan())
      : IndexerHostState(scenario_plan(contexts, block_size, shape), static_cast<int64_t>(contexts.size()),
                         (scenario_plan(contexts, block_size, shape).max_context + block_size - 1) / block_size, rng),
        m(static_cast<int>(contexts.size())) {
    for (int t = 0; t < m; ++t) {
      positions.push_back(contexts[t] > 0 ? contexts[t] - 1 : 0);
      token_requests.push_back(contexts[t] > 0 ? t : -1);
    }
  }
  Scenario(const std::vector<int64_t>& step_positions, const std::vector<int32_t>& step_requests, int block_size,
           std::mt19937_64& rng, const IndexerPlan& shape = IndexerPlan())
      : IndexerHostState(draft_plan(step_positions, block_size, shape),
                         *std::max_element(step_requests.begin(), step_requests.end()) + 1,
                         (draft_plan(step_positions, block_size, shape).max_context + block_size - 1) / block_size,
                         rng),
        m(static_cast<int>(step_positions.size())),
        positions(step_positions),
        token_requests(step_requests) {}

  // Prefill of positions 0..pos-1 of every real request, pos the position of
  // its first token in the step, then the reference's prepare (completing the
  // pool of tokens with L % S == 0) and select.
  void fill_and_run_reference(std::mt19937_64& rng) {
    const int heads = plan.heads;
    norm_weight = normal_floats(kDim, 1.0f, 0.2f, rng);
    norm_bias = normal_floats(kDim, 0.0f, 0.1f, rng);
    ape = normal_floats(size_t(plan.pool) * kDim, 0.0f, 0.5f, rng);
    const reference::IndexerParamsHost params{norm_weight.data(), norm_bias.data(), ape.data()};
    for (int t = 0; t < m; ++t) {
      const int32_t request = token_requests[t];
      if (std::find(token_requests.begin(), token_requests.begin() + t, request) != token_requests.begin() + t) {
        continue;  // a draft token: its request was prefilled at its first token
      }
      const int64_t n = request < 0 ? 0 : positions[t];
      if (n < 1) continue;
      const std::vector<uint16_t> k = testing::random_bf16(n * kDim, 1.0f, rng);
      const std::vector<uint16_t> gate = testing::random_bf16(n * kDim, 1.0f, rng);
      int64_t errors = -1;
      DSA_ASSERT_OK(reference::indexer_prefill(plan, k.data(), gate.data(), n, request, params, view, &errors));
      ASSERT_EQ(errors, 0);
      prefills.push_back({request, k, gate});
    }
    index_q = testing::random_bf16(size_t(m) * heads * kDim, 1.0f, rng);
    index_k = testing::random_bf16(size_t(m) * kDim, 1.0f, rng);
    gate = testing::random_bf16(size_t(m) * kDim, 1.0f, rng);
    head_weights = normal_floats(size_t(m) * heads, 0.0f, 1.0f, rng);
    ring_before_prepare = ring;
    k_cache_before_prepare = k_cache;
    const reference::IndexerStepHost step{m, index_q.data(), index_k.data(), head_weights.data(), gate.data(),
                                          positions.data(), token_requests.data()};
    int64_t errors = -1;
    DSA_ASSERT_OK(reference::indexer_prepare(plan, step, params, view, &query, &errors));
    ASSERT_EQ(errors, 0);
    run_reference_select();
  }

  void run_reference_select() {
    const reference::IndexerStepHost step{m, nullptr, nullptr, nullptr, nullptr, positions.data(),
                                          token_requests.data()};
    DSA_ASSERT_OK(reference::indexer_select(plan, step, query, view, &rows));
  }
};

// The scenario's state, workspace and outputs on the device.
struct DeviceStep {
  DeviceBuffer<int32_t> block_table;
  DeviceBuffer<uint16_t> ring;
  DeviceBuffer<uint8_t> k_cache, workspace, baseline_workspace;
  DeviceBuffer<int64_t> positions;
  DeviceBuffer<int32_t> token_requests, topk_positions, slots;
  DeviceBuffer<unsigned int> errors;
  IndexerWorkspaceLayout layout;
  IndexerSelectArgs args;

  explicit DeviceStep(const Scenario& s)
      : block_table(s.block_table),
        ring(s.ring),
        k_cache(s.k_cache),
        workspace(size_t(indexer_workspace_layout(s.plan).bytes)),
        positions(s.positions),
        token_requests(s.token_requests),
        topk_positions(size_t(s.m) * indexer_row_width(s.plan)),
        slots(size_t(s.m) * indexer_row_width(s.plan)),
        errors(1),
        layout(indexer_workspace_layout(s.plan)) {
    std::vector<uint8_t> host(layout.bytes, 0);
    std::memcpy(&host[layout.q_fp8], s.query.q_fp8.data(), s.query.q_fp8.size());
    std::memcpy(&host[layout.head_weights], s.query.head_weights.data(), s.query.head_weights.size() * 4);
    workspace.upload(host);
    args.plan = s.plan;
    args.positions = make_tensor(positions.get(), DType::kI64, {s.m});
    args.token_requests = make_tensor(token_requests.get(), DType::kI32, {s.m});
    args.state.block_table = make_tensor(block_table.get(), DType::kI32, {s.requests, s.width});
    args.state.ring = make_tensor(ring.get(), DType::kBF16, {s.requests, 2, s.plan.ring, kDim});
    args.state.k_cache = make_strided(k_cache.get(), DType::kU8, {s.blocks, indexer_page_bytes(s.plan)},
                                      {s.page_stride, 1});
    args.workspace = make_tensor(workspace.get(), DType::kU8, {layout.bytes});
    const int width = indexer_row_width(s.plan);
    args.topk_positions = make_tensor(topk_positions.get(), DType::kI32, {s.m, width});
    args.slots = make_tensor(slots.get(), DType::kI32, {s.m, width});
    args.error_count = errors.get();
  }

  // Poisons the outputs and the logits, runs one path, waits.
  void run(bool baseline, cudaStream_t stream) {
    topk_positions.fill_bytes(kPoison);
    slots.fill_bytes(kPoison);
    errors.fill_bytes(0);
    const int64_t logits_bytes = layout.bytes - layout.logits;  // the logits are the last region
    testing::expect_cuda(cudaMemset(workspace.get() + layout.logits, kPoison, logits_bytes), "poison logits");
    testing::expect_cuda(cudaDeviceSynchronize(), "poison logits");
    if (baseline) {
      if (baseline_workspace.size() == 0) {
        int64_t bytes = 0;
        const Status s = indexer_select_baseline_workspace_bytes(args.plan, &bytes);
        ASSERT_TRUE(s.ok()) << s.to_string();
        baseline_workspace = DeviceBuffer<uint8_t>(size_t(bytes));
      }
      const Status s = indexer_select_baseline(args, baseline_workspace.get(), baseline_workspace.size(), stream);
      ASSERT_TRUE(s.ok()) << s.to_string();
    } else {
      const Status s = indexer_select(args, stream);
      ASSERT_TRUE(s.ok()) << s.to_string();
    }
    testing::expect_cuda(cudaStreamSynchronize(stream), "indexer select");
    testing::expect_cuda(cudaGetLastError(), "indexer select");
  }
};

// GPU rows, slots and error count equal the reference's; the GPU logits of
// up to `logit_checks` long tokens equal the reference's bit for bit.
void expect_matches_reference(const Scenario& s, DeviceStep& d, const std::string& what, int logit_checks) {
  const std::vector<int32_t> topk = d.topk_positions.download(), slots = d.slots.download();
  const int width = indexer_row_width(s.plan), heads = s.plan.heads, pool = s.plan.pool;
  EXPECT_EQ(d.errors.download()[0], 0u) << what;
  for (int t = 0; t < s.m; ++t) {
    const std::string where = what + " token " + std::to_string(t) + " L " +
                              std::to_string(s.token_requests[t] < 0 ? 0 : s.positions[t] + 1);
    for (int c = 0; c < width; ++c) {
      ASSERT_EQ(topk[t * width + c], s.rows.topk_positions[t * width + c]) << where << " column " << c;
      ASSERT_EQ(slots[t * width + c], s.rows.slots[t * width + c]) << where << " column " << c;
    }
  }
  const std::vector<uint8_t> workspace = d.workspace.download();
  const int64_t stride = d.layout.logits_stride;
  for (int t = 0; t < s.m && logit_checks > 0; ++t) {
    const int64_t L = s.positions[t] + 1;
    if (s.token_requests[t] < 0 || L <= s.plan.topk) continue;
    --logit_checks;
    const std::vector<float> expected = reference::indexer_logits(
        s.plan, s.view, s.token_requests[t], L / pool, &s.query.q_fp8[size_t(t) * heads * kDim],
        &s.query.head_weights[size_t(t) * heads]);
    const uint8_t* got = &workspace[d.layout.logits + size_t(t) * stride * 4];
    for (int64_t p = 0; p < L / pool; ++p) {
      float value;
      std::memcpy(&value, got + p * 4, 4);
      if (value != value && expected[p] != expected[p]) continue;  // NaN payloads differ (GPU: canonical NaN)
      ASSERT_EQ(num::float_bits(value), num::float_bits(expected[p])) << what << " token " << t << " pool " << p
                                                                      << ": " << value << " vs " << expected[p];
    }
  }
}

// Under IndexerLogits::kFp32Accumulation: every long token's GPU logits
// within reference::indexer_logit_bounds of the exact ones, and the GPU rows,
// slots and error count bitwise the reference's selection over those GPU
// logits. Returns the worst |error| / bound and, through `moved`, how many
// pools the rows choose that the exact logits would not.
double expect_follows_own_logits(const Scenario& s, DeviceStep& d, const std::string& what, int64_t* moved) {
  const std::vector<uint8_t> workspace = d.workspace.download();
  const int64_t stride = d.layout.logits_stride;
  const int width = indexer_row_width(s.plan), heads = s.plan.heads, pool = s.plan.pool, topk = s.plan.topk;
  std::vector<std::vector<float>> logits(s.m);
  double worst = 0;
  int64_t outside = 0;
  for (int t = 0; t < s.m; ++t) {
    const int64_t L = s.positions[t] + 1;
    if (s.token_requests[t] < 0 || L <= topk) continue;
    logits[t].resize(L / pool);
    std::memcpy(logits[t].data(), &workspace[d.layout.logits + size_t(t) * stride * 4], logits[t].size() * 4);
    const reference::LogitDeviation deviation = reference::indexer_logit_deviation(
        s.plan, s.view, s.token_requests[t], L / pool, &s.query.q_fp8[size_t(t) * heads * kDim],
        &s.query.head_weights[size_t(t) * heads], logits[t].data());
    outside += deviation.outside;
    worst = std::max(worst, deviation.worst);
  }
  EXPECT_EQ(outside, 0) << what << ": logits outside their bound (worst |error| / bound " << worst << ")";
  reference::IndexerRowsHost own;
  const reference::IndexerStepHost step{
      s.m, nullptr, nullptr, nullptr, nullptr, s.positions.data(), s.token_requests.data()};
  const Status selected = reference::indexer_select_on_logits(s.plan, step, logits, s.view, &own);
  EXPECT_TRUE(selected.ok()) << selected.to_string();
  EXPECT_TRUE(d.topk_positions.download() == own.topk_positions) << what << ": rows";
  EXPECT_TRUE(d.slots.download() == own.slots) << what << ": slots";
  EXPECT_EQ(int64_t(d.errors.download()[0]) > 0, own.errors > 0) << what;
  *moved = 0;
  for (size_t c = 0; c < own.topk_positions.size(); c += pool) {
    const int32_t position = own.topk_positions[c];
    if (position < 0 || c % width >= size_t(topk)) continue;
    const size_t row = c / width * width;
    const auto begin = s.rows.topk_positions.begin() + row, end = begin + topk;
    if (!std::binary_search(begin, std::find(begin, end, -1), position)) ++*moved;
  }
  return worst;
}

// The reference's rows for `s`, then the fused select's (and the baseline's)
// rows compared with them.
void check_scenario(Scenario& s, std::mt19937_64& rng, const std::string& what, bool with_baseline,
                    int logit_checks = 2) {
  s.fill_and_run_reference(rng);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceStep d(s);
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  d.run(false, stream);
  expect_matches_reference(s, d, what + " fused", logit_checks);
  if (with_baseline && !::testing::Test::HasFatalFailure()) {
    d.run(true, stream);
    expect_matches_reference(s, d, what + " baseline", 1);
  }
  cudaStreamDestroy(stream);
}

void check_contexts(const std::vector<int64_t>& contexts, int block_size, const std::string& what, bool with_baseline) {
  std::mt19937_64 rng(testing::test_seed());
  Scenario s(contexts, block_size, rng);
  check_scenario(s, rng, what, with_baseline);
}

// Short rows (L <= 2048, L = 2049..2051 with exactly 512 pools), every L % 4,
// a padding token, and contexts 4k+ at m = 16.
TEST(IndexerSelectGpu, MatchesReferenceM16Around4k) {
  DSA_REQUIRE_GPU();
  if (testing::quick_mode()) {
    check_contexts({1, 5, 2049, 0}, 128, "quick m 4", true);
    return;
  }
  check_contexts({1, 5, 2047, 2048, 2049, 2050, 2051, 0, 2052, 4093, 4094, 4095, 4096, 4097, 5000, 6143}, 256,
                 "m 16", true);
}

TEST(IndexerSelectGpu, MatchesReferenceM4At32k) {
  DSA_REQUIRE_GPU();
  if (testing::quick_mode()) {
    check_contexts({4096 + 3}, 128, "quick m 1", false);
    return;
  }
  check_contexts({32768, 32768 + 1, 0, 32768 + 3}, 256, "m 4 32k", true);
  check_contexts({32768 + 2, 20000, 9000, 2100}, 128, "m 4 block 128", false);
}

TEST(IndexerSelectGpu, MatchesReferenceAt128kAndAbove) {
  DSA_REQUIRE_GPU();
  if (testing::quick_mode()) GTEST_SKIP() << "quick mode: long contexts run in the full suite";
  check_contexts({131072}, 256, "m 1 128k", true);
  // 37500 pools: the select keeps 2^15 keys in shared memory and reads the
  // rest from the logits on every pass.
  check_contexts({150001, 131072}, 256, "m 2 above 128k", false);
}

// Draft tokens (MTP decoding): several tokens of one request in a step, at
// positions pos, pos + 1, ... sharing the request's K cache and block table
// (RING 8), once interleaved with another request's token (the contract asks
// only that a request's tokens come in increasing consecutive positions). The
// first draft's position is 2 mod 4, so its second token completes a pool:
// the drafts score n and n + 1 pools and have tails of 3, 0, 1 and 2 tokens.
// At 32k the pool counts straddle the select's 8192-pool round, around 2048
// the short rows (L <= 2048) and the top-k path; the interleaved drafts also
// cross a block boundary.
struct DraftCase {
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;  // request 0's tokens are the drafts
  int block_size;
  std::string what;
};

std::vector<DraftCase> draft_cases(bool quick) {
  if (quick) {
    return {{{2046, 2047, 2048, 2049}, {0, 0, 0, 0}, 128, "quick m 4 drafts at L 2047..2050"},
            {{2558, 2559, 3000, 2560}, {0, 0, 1, 0}, 128, "quick m 4 drafts interleaved with another request"}};
  }
  return {{{32770, 32771, 32772, 32773}, {0, 0, 0, 0}, 256, "m 4 drafts at 32k (8192, then 8193 pools)"},
          {{2046, 2047, 2048, 2049}, {0, 0, 0, 0}, 128, "m 4 drafts at L 2047..2050 (short rows, then top-k)"},
          {{20478, 20479, 9001, 20480}, {0, 0, 1, 0}, 128, "m 4 drafts interleaved with another request"},
          {{4094, 4095}, {0, 0}, 128, "m 2 drafts at 4k"}};
}

// The GPU test's premise, without a GPU: the reference accepts every draft
// step (RING 8, interleaving), the first draft's position is 2 mod 4, and the
// reference's rows give the drafts two pool counts and a different tail each
// (as many tail tokens from column 2048 as L % 4; none in a short row).
TEST(IndexerSelectReference, DraftCasesStraddleAPoolBoundary) {
  for (bool quick : {true, false}) {
    for (const DraftCase& c : draft_cases(quick)) {
      SCOPED_TRACE(c.what);
      ASSERT_EQ(c.positions[0] % 4, 2) << "the first draft must complete a pool at the second";
      std::mt19937_64 rng(testing::test_seed());
      Scenario s(c.positions, c.token_requests, c.block_size, rng);
      s.fill_and_run_reference(rng);
      if (HasFatalFailure()) return;
      std::set<int64_t> pool_counts, tails;
      for (int t = 0; t < s.m; ++t) {
        if (s.token_requests[t] != 0) continue;
        const int64_t L = s.positions[t] + 1;
        const int32_t* row = &s.rows.topk_positions[size_t(t) * kWidth];
        const int64_t tail = std::count_if(row + kIndexerPooledColumns, row + kWidth, [](int32_t p) { return p >= 0; });
        if (L > kIndexerPooledColumns) {
          EXPECT_EQ(tail, L % 4) << "token " << t;
        } else {
          EXPECT_EQ(tail, 0) << "token " << t << ": a short row has no tail";
          EXPECT_EQ(row[L - 1], L - 1) << "token " << t;
        }
        pool_counts.insert(L / 4);
        tails.insert(L % 4);
      }
      EXPECT_EQ(pool_counts.size(), 2u) << "the drafts score n and n + 1 pools";
      EXPECT_EQ(tails.size(), std::min<size_t>(4, std::count(s.token_requests.begin(), s.token_requests.end(), 0)))
          << "a different tail for each draft";
    }
  }
}

// The drafts' positions, slots and every long token's logits equal the
// reference's bit for bit, for the fused select and the baseline.
TEST(IndexerSelectGpu, DraftTokensOfOneRequestMatchTheReference) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 11);
  for (const DraftCase& c : draft_cases(testing::quick_mode())) {
    SCOPED_TRACE(c.what);
    Scenario s(c.positions, c.token_requests, c.block_size, rng);
    check_scenario(s, rng, c.what, /*with_baseline=*/true, /*logit_checks=*/s.m);
    if (HasFatalFailure()) return;
  }
}

// Slots in rows with a padded token stride between poisoned guard bands, and
// no topk_positions (the stage's call): the slots equal the reference's and
// no byte outside the rows' 2176 columns is written.
// The step as a decode chain runs it: the GPU prepare, then the select in
// the same stream with PDL and no synchronization between them, from the
// state before the prepare. The step completes pools (draft tokens of one
// request, one completing pool 1023; another request's token completing pool
// 1535): the select must score them as the prepare wrote them, so their
// logits are compared bit for bit (before the step their K cache entries are
// zero, a stale read would give another logit).
TEST(IndexerSelectGpu, ChainedAfterTheGpuPrepareScoresThePoolsTheStepCompletes) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 5);
  Scenario s({4094, 4095, 4096, 6143}, {0, 0, 0, 1}, 128, rng);
  s.fill_and_run_reference(rng);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceStep d(s);
  d.ring.upload(s.ring_before_prepare);
  d.k_cache.upload(s.k_cache_before_prepare);
  DeviceBuffer<uint16_t> index_q(s.index_q), index_k(s.index_k), gate(s.gate);
  DeviceBuffer<float> head_weights(s.head_weights), norm_weight(s.norm_weight), norm_bias(s.norm_bias), ape(s.ape);
  IndexerPrepareArgs prepare;
  prepare.plan = s.plan;
  prepare.index_q = make_tensor(index_q.get(), DType::kBF16, {s.m, kHeads, kDim});
  prepare.index_k = make_tensor(index_k.get(), DType::kBF16, {s.m, kDim});
  prepare.head_weights = make_tensor(head_weights.get(), DType::kF32, {s.m, kHeads});
  prepare.gate = make_tensor(gate.get(), DType::kBF16, {s.m, kDim});
  prepare.k_norm_weight = make_tensor(norm_weight.get(), DType::kF32, {kDim});
  prepare.k_norm_bias = make_tensor(norm_bias.get(), DType::kF32, {kDim});
  prepare.ape = make_tensor(ape.get(), DType::kF32, {4, kDim});
  prepare.positions = d.args.positions;
  prepare.token_requests = d.args.token_requests;
  prepare.state = d.args.state;
  prepare.workspace = d.args.workspace;
  prepare.error_count = d.args.error_count;
  // The workspace as the prepare must write it: poisoned first, so the select reads the GPU prepare's q.
  d.workspace.fill_bytes(kPoison);
  d.topk_positions.fill_bytes(kPoison);
  d.slots.fill_bytes(kPoison);
  d.errors.fill_bytes(0);  // synchronizes the device: the uploads are complete
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Status prepared = indexer_prepare(prepare, stream);
  const Status selected = indexer_select(d.args, stream);
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  DSA_ASSERT_OK(prepared);
  DSA_ASSERT_OK(selected);
  EXPECT_TRUE(d.k_cache.download() == s.k_cache) << "the GPU prepare's K cache differs from the reference's";
  EXPECT_TRUE(d.ring.download() == s.ring) << "the GPU prepare's ring differs from the reference's";
  expect_matches_reference(s, d, "prepare then select", /*logit_checks=*/4);
}

// Contexts of the every-shape GPU test: a token completing a pool past top-k,
// one with a tail of S - 1 tokens, padding, a short row.
std::vector<int64_t> every_shape_contexts(const IndexerPlan& shape) {
  const int64_t K = shape.topk, S = shape.pool;
  return {2 * K + S, 3 * K + S - 1, 0, K - 1};
}

// The every-shape GPU test's draft step (RING 2 S): request 0's tokens at
// positions 2K + 1 .. 2K + c, c = min(S + 1, 15), the one at 2K + S - 1
// completing pool 2K / S from one ring row (2K) and S - 1 of the step's own
// tokens; then request 1's token completing pool (3K + S - 1) / S from the
// ring alone.
struct EveryShapeDraftStep {
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;
};
EveryShapeDraftStep every_shape_draft_step(const IndexerPlan& shape) {
  const int64_t K = shape.topk, S = shape.pool;
  const int64_t c = std::min<int64_t>(S + 1, 15);
  EveryShapeDraftStep step;
  for (int64_t i = 1; i <= c; ++i) {
    step.positions.push_back(2 * K + i);
    step.token_requests.push_back(0);
  }
  step.positions.push_back(3 * K + S - 1);
  step.token_requests.push_back(1);
  return step;
}

// The every-shape GPU test's premise, without a GPU: at each shape the
// reference's prepare writes the pool token 0 completes, token 1's row ends
// with S - 1 tail tokens from column K, and token 3's row is 0..L-1; the
// draft step (RING 2 S) is a valid batch whose prepare completes pool 2K / S
// from S - 1 tokens of the step (the token at 2K + S - 1 scores it; its tail
// is empty).
TEST(IndexerSelectReference, EveryShapeScenarioCompletesAPoolAndHasATail) {
  std::mt19937_64 rng(testing::test_seed());
  for (const IndexerPlan& shape : testing::every_shape()) {
    SCOPED_TRACE(testing::shape_name(shape));
    Scenario s(every_shape_contexts(shape), 256, rng, shape);
    s.fill_and_run_reference(rng);
    if (HasFatalFailure()) return;
    EXPECT_FALSE(s.k_cache == s.k_cache_before_prepare) << "the step completes a pool";
    EXPECT_EQ(s.prefills.size(), 3u);
    const int width = indexer_row_width(shape), S = shape.pool, K = shape.topk;
    const int32_t* tail = &s.rows.topk_positions[size_t(1) * width + K];
    const int64_t L = 3 * int64_t(K) + S - 1;
    for (int j = 0; j < width - K; ++j) EXPECT_EQ(tail[j], j < S - 1 ? L - (S - 1) + j : -1) << "column " << K + j;
    const int32_t* short_row = &s.rows.topk_positions[size_t(3) * width];
    for (int c = 0; c < width; ++c) ASSERT_EQ(short_row[c], c < K - 1 ? c : -1) << "column " << c;

    const EveryShapeDraftStep step = every_shape_draft_step(shape);
    Scenario draft(step.positions, step.token_requests, 256, rng, shape);
    ASSERT_EQ(draft.plan.ring, 2 * S);
    ASSERT_LE(draft.m, kIndexerMaxTokens);
    draft.fill_and_run_reference(rng);
    if (HasFatalFailure()) return;
    const int64_t pool = 2 * int64_t(K) / S;  // completed by the token at 2K + S - 1 (index S - 2)
    const reference::PoolEntry entry = reference::read_pool(draft.plan, draft.view, 0, pool);
    ASSERT_NE(entry.codes, nullptr);
    const size_t at = size_t(entry.codes - draft.k_cache.data());
    EXPECT_FALSE(std::equal(draft.k_cache.begin() + at, draft.k_cache.begin() + at + kDim,
                            draft.k_cache_before_prepare.begin() + at))
        << "the draft step completes pool 2K / S";
    EXPECT_EQ(draft.positions[S - 2], 2 * int64_t(K) + S - 1);
    const int32_t* row = &draft.rows.topk_positions[size_t(S - 2) * width];
    for (int c = K; c < width; ++c) EXPECT_EQ(row[c], -1) << "an empty tail, column " << c;
  }
}

// The chain of the every-shape GPU test for one scenario (reference run):
// the GPU prefills from a zero state leave the reference's ring and K cache;
// the prepare then the select (PDL, no synchronization) leave its state, q
// and folded weights and give its rows, slots and logits bit for bit (exact
// logits); indexer_remap of its rows gives its slots; FP32-accumulated
// logits are within their bound with the rows the selection over them.
void expect_chain_matches_reference(Scenario& s, const std::string& what, cudaStream_t stream) {
  const int64_t S = s.plan.pool;
  DeviceStep d(s);
  DeviceBuffer<float> norm_weight(s.norm_weight), norm_bias(s.norm_bias), ape(s.ape);
  const TensorView weight_view = make_tensor(norm_weight.get(), DType::kF32, {kDim});
  const TensorView bias_view = make_tensor(norm_bias.get(), DType::kF32, {kDim});
  const TensorView ape_view = make_tensor(ape.get(), DType::kF32, {S, kDim});

  // Prefill from a zero state.
  d.ring.fill_bytes(0);
  d.k_cache.fill_bytes(0);
  d.errors.fill_bytes(0);
  std::vector<DeviceBuffer<uint16_t>> keep;
  std::vector<IndexerPrefillArgs> prefills;
  for (const Scenario::Prefill& prefill : s.prefills) {
    const int64_t n = static_cast<int64_t>(prefill.k.size()) / kDim;
    keep.emplace_back(prefill.k);
    const TensorView k_view = make_tensor(keep.back().get(), DType::kBF16, {n, kDim});
    keep.emplace_back(prefill.gate);
    const TensorView gate_view = make_tensor(keep.back().get(), DType::kBF16, {n, kDim});
    prefills.push_back({s.plan, k_view, gate_view, weight_view, bias_view, ape_view, prefill.request, d.args.state,
                        d.args.error_count});
  }
  // cudaMemcpy from pageable memory may return before its DMA lands, and the
  // non-blocking stream does not wait for the legacy stream's copies.
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  for (const IndexerPrefillArgs& args : prefills) DSA_ASSERT_OK(indexer_prefill(args, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  ASSERT_TRUE(d.k_cache.download() == s.k_cache_before_prepare) << what << " prefill: K cache";
  ASSERT_TRUE(d.ring.download() == s.ring_before_prepare) << what << " prefill: ring";

  // Prepare, then select, exact logits.
  DeviceBuffer<uint16_t> index_q(s.index_q), index_k(s.index_k), gate(s.gate);
  DeviceBuffer<float> head_weights(s.head_weights);
  IndexerPrepareArgs prepare;
  prepare.plan = s.plan;
  prepare.index_q = make_tensor(index_q.get(), DType::kBF16, {s.m, s.plan.heads, kDim});
  prepare.index_k = make_tensor(index_k.get(), DType::kBF16, {s.m, kDim});
  prepare.head_weights = make_tensor(head_weights.get(), DType::kF32, {s.m, s.plan.heads});
  prepare.gate = make_tensor(gate.get(), DType::kBF16, {s.m, kDim});
  prepare.k_norm_weight = weight_view;
  prepare.k_norm_bias = bias_view;
  prepare.ape = ape_view;
  prepare.positions = d.args.positions;
  prepare.token_requests = d.args.token_requests;
  prepare.state = d.args.state;
  prepare.workspace = d.args.workspace;
  prepare.error_count = d.args.error_count;
  d.workspace.fill_bytes(kPoison);  // synchronizes the device: the uploads above are complete
  d.topk_positions.fill_bytes(kPoison);
  d.slots.fill_bytes(kPoison);
  const Status prepared = indexer_prepare(prepare, stream);
  const Status selected = indexer_select(d.args, stream);
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  DSA_ASSERT_OK(prepared);
  DSA_ASSERT_OK(selected);
  EXPECT_TRUE(d.k_cache.download() == s.k_cache) << what << " prepare: K cache";
  EXPECT_TRUE(d.ring.download() == s.ring) << what << " prepare: ring";
  const std::vector<uint8_t> workspace = d.workspace.download();
  EXPECT_EQ(std::memcmp(&workspace[d.layout.q_fp8], s.query.q_fp8.data(), s.query.q_fp8.size()), 0)
      << what << " prepare: q_fp8";
  EXPECT_EQ(
      std::memcmp(&workspace[d.layout.head_weights], s.query.head_weights.data(), s.query.head_weights.size() * 4), 0)
      << what << " prepare: folded head weights";
  expect_matches_reference(s, d, what + " exact", /*logit_checks=*/s.m);
  if (::testing::Test::HasFatalFailure()) return;

  // Remap of the reference's rows.
  DeviceBuffer<int32_t> caller_rows(s.rows.topk_positions), remapped(s.rows.slots.size());
  remapped.fill_bytes(kPoison);
  const int width = indexer_row_width(s.plan);
  IndexerRemapArgs remap{s.plan, d.args.positions, d.args.token_requests, d.args.state,
                         make_tensor(caller_rows.get(), DType::kI32, {s.m, width}),
                         make_tensor(remapped.get(), DType::kI32, {s.m, width}), d.args.error_count};
  DSA_ASSERT_OK(indexer_remap(remap, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(remapped.download() == s.rows.slots) << what << " remap";

  // FP32-accumulated logits over the same workspace q.
  s.plan.logits = IndexerLogits::kFp32Accumulation;
  d.args.plan.logits = IndexerLogits::kFp32Accumulation;
  d.run(false, stream);
  if (::testing::Test::HasFatalFailure()) return;
  int64_t moved = 0;
  const double worst = expect_follows_own_logits(s, d, what + " fp32 accumulation", &moved);
  std::printf("[every shape] %s: worst |logit error| / bound %.3g, %lld pools moved\n", what.c_str(), worst,
              static_cast<long long>(moved));
}

// Every shape (heads 16, 32, 64 x pool 4, 8, 16 at top-k 2048 and 512), the
// whole chain on the GPU (expect_chain_matches_reference) for two steps:
// RING = S with one token completing a pool past top-k, one with a tail of
// S - 1 tokens, padding, a short row; and RING = 2 S with draft tokens of one
// request completing a pool from S - 1 of the step's own tokens.
TEST(IndexerSelectGpu, EveryShapeMatchesTheReferenceFromPrefillToRemap) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 13);
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const IndexerPlan& shape : testing::every_shape()) {
    const std::string what = testing::shape_name(shape);
    SCOPED_TRACE(what);
    Scenario s(every_shape_contexts(shape), 256, rng, shape);
    s.fill_and_run_reference(rng);
    if (HasFatalFailure()) break;
    expect_chain_matches_reference(s, what, stream);
    if (HasFatalFailure()) break;

    const EveryShapeDraftStep step = every_shape_draft_step(shape);
    Scenario draft(step.positions, step.token_requests, 256, rng, shape);
    draft.fill_and_run_reference(rng);
    if (HasFatalFailure()) break;
    expect_chain_matches_reference(draft, what + " drafts RING " + std::to_string(draft.plan.ring), stream);
    if (HasFatalFailure()) break;
  }
  cudaStreamDestroy(stream);
}

TEST(IndexerSelectGpu, PaddedSlotRowsWithoutPositionsStayInsideTheirColumns) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 7);
  const std::vector<int64_t> contexts = testing::quick_mode() ? std::vector<int64_t>{2050, 0, 5001}
                                                              : std::vector<int64_t>{2050, 0, 32768 + 1, 5001};
  Scenario s(contexts, 256, rng);
  s.fill_and_run_reference(rng);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceStep d(s);
  constexpr int64_t kGuard = 64, kStride = kWidth + 16;  // int32 elements
  DeviceBuffer<int32_t> padded(size_t(s.m) * kStride + 2 * kGuard);
  padded.fill_bytes(kPoison);
  d.args.slots = make_strided(padded.get() + kGuard, DType::kI32, {s.m, kWidth}, {kStride, 1});
  d.args.topk_positions = TensorView{};
  d.errors.fill_bytes(0);
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DSA_ASSERT_OK(indexer_select(d.args, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
  const std::vector<int32_t> got = padded.download();
  int32_t poison;
  std::memset(&poison, kPoison, sizeof(poison));
  for (int64_t i = 0; i < kGuard; ++i) {
    ASSERT_EQ(got[i], poison) << "write before the slots at guard element " << i;
    ASSERT_EQ(got[got.size() - 1 - i], poison) << "write past the slots";
  }
  for (int t = 0; t < s.m; ++t) {
    const int32_t* row = got.data() + kGuard + t * kStride;
    for (int c = 0; c < kWidth; ++c) {
      ASSERT_EQ(row[c], s.rows.slots[t * kWidth + c]) << "token " << t << " column " << c;
    }
    if (t + 1 < s.m) {
      for (int64_t c = kWidth; c < kStride; ++c) ASSERT_EQ(row[c], poison) << "write into token " << t << "'s padding";
    }
  }
  EXPECT_EQ(d.errors.download()[0], 0u);
}

// Ties at the 512th value, -0 against +0, NaN and untrusted pages: every pool
// a copy of one entry (equal logits), a few with a larger scale, some with
// scale 0 (logits +-0) or NaN (ranked -inf); rows equal the reference's.
TEST(IndexerSelectGpu, TiesSignedZerosAndNaNFollowTheReference) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  // About 90% of the pools share one logit, at a short and a long context
  // (up to 8192 pools, 7000-odd of them tied).
  const std::vector<int64_t> contexts = testing::quick_mode() ? std::vector<int64_t>{2048 + 600, 20480 + 2}
                                                              : std::vector<int64_t>{16384 + 2, 32768 + 2};
  for (const int64_t L : contexts) {
    SCOPED_TRACE("context " + std::to_string(L));
    Scenario s({L, L - 1, 3000}, 128, rng);
    s.query.q_fp8.resize(size_t(s.m) * kHeads * kDim);
    s.query.head_weights = normal_floats(size_t(s.m) * kHeads, 0.0f, 1.0f, rng);
    std::uniform_int_distribution<int> code(0, 0x7E);
    for (uint8_t& c : s.query.q_fp8) c = static_cast<uint8_t>(code(rng) | (rng() & 0x80));
    std::vector<uint8_t> entry(kDim);
    for (uint8_t& c : entry) c = static_cast<uint8_t>(code(rng) | (rng() & 0x80));
    const int64_t per_page = s.plan.block_size / 4;
    std::uniform_int_distribution<int> kind(0, 99);
    for (int64_t b = 0; b < s.blocks; ++b) {
      uint8_t* page = &s.k_cache[b * s.page_stride];
      for (int64_t e = 0; e < per_page; ++e) {
        std::memcpy(page + e * kDim, entry.data(), kDim);
        const int k = kind(rng);
        const float scale = k < 3    ? 2.0f
                            : k < 6  ? 0.0f
                            : k < 8  ? -0.0f
                            : k < 10 ? std::numeric_limits<float>::quiet_NaN()
                                     : 1.0f;
        std::memcpy(page + per_page * kDim + e * 4, &scale, 4);
      }
    }
    // The common logit's sign depends on the random weights; token 1 gets token
    // 0's weights negated, so one of the two sees it positive (scale-2 pools on
    // top) and the other negative (the +-0 pools on top, then the ties).
    std::copy(s.query.q_fp8.begin(), s.query.q_fp8.begin() + kHeads * kDim, s.query.q_fp8.begin() + kHeads * kDim);
    for (int h = 0; h < kHeads; ++h) s.query.head_weights[kHeads + h] = -s.query.head_weights[h];
    s.run_reference_select();
    DeviceStep d(s);
    cudaStream_t stream = nullptr;
    DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    d.run(false, stream);
    expect_matches_reference(s, d, "ties fused", 3);
    d.run(true, stream);
    expect_matches_reference(s, d, "ties baseline", 0);
    cudaStreamDestroy(stream);
  }
}

// The opt-in FP32-accumulated logits (plan.logits = kFp32Accumulation) at
// m = 16 around 4k (short rows, every L % 4, a padding token) and m = 4 at 32k
// and 128k: logits within their bound, rows the reference's selection over the
// GPU's logits, for the fused select and the baseline; the same bits again on
// a second run. The worst |error| / bound and the pools chosen differently
// from the exact logits are printed.
TEST(IndexerSelectGpu, Fp32AccumulatedLogitsStayWithinTheirBoundAndRowsFollowThem) {
  DSA_REQUIRE_GPU();
  const std::vector<std::vector<int64_t>> cases =
      testing::quick_mode() ? std::vector<std::vector<int64_t>>{{1, 2049, 0, 4097}}
                            : std::vector<std::vector<int64_t>>{{1, 5, 2047, 2048, 2049, 2050, 2051, 0, 2052, 4093,
                                                                 4094, 4095, 4096, 4097, 5000, 6143},
                                                                {32768, 32768 + 1, 0, 32768 + 3},
                                                                {131072 + 2}};
  std::mt19937_64 rng(testing::test_seed());
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const std::vector<int64_t>& contexts : cases) {
    const std::string what = "m " + std::to_string(contexts.size()) + " up to L " +
                             std::to_string(*std::max_element(contexts.begin(), contexts.end()));
    Scenario s(contexts, 256, rng);
    s.plan.logits = IndexerLogits::kFp32Accumulation;
    s.fill_and_run_reference(rng);
    if (HasFatalFailure()) break;
    DeviceStep d(s);
    for (bool baseline : {false, true}) {
      const std::string path = what + (baseline ? " baseline" : " fused");
      d.run(baseline, stream);
      if (HasFatalFailure()) break;
      int64_t moved = 0;
      const double worst = expect_follows_own_logits(s, d, path, &moved);
      std::printf(
          "[fp32 accumulation] %s: worst |logit error| / bound %.3g; %lld chosen pools differ from the exact "
          "logits' choice\n",
          path.c_str(), worst, static_cast<long long>(moved));
      const std::vector<int32_t> first = d.slots.download();
      d.run(baseline, stream);
      EXPECT_TRUE(d.slots.download() == first) << path << ": a second run";
    }
  }
  cudaStreamDestroy(stream);
}

// The same inputs give the same bits on every run, direct and from a CUDA
// graph; an untrusted block table entry is counted and remaps to -1, as in
// the reference.
TEST(IndexerSelectGpu, RepeatableGraphCapturableAndUntrustedBlocksCounted) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const int64_t L = testing::quick_mode() ? 2048 + 515 : 8192 + 1;
  Scenario s({L, 1000, L - 2}, 128, rng);
  s.fill_and_run_reference(rng);
  if (HasFatalFailure()) return;
  DeviceStep d(s);
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  d.run(false, stream);
  const std::vector<int32_t> first_topk = d.topk_positions.download(), first_slots = d.slots.download();
  for (int i = 0; i < 3; ++i) {
    d.run(false, stream);
    ASSERT_TRUE(d.topk_positions.download() == first_topk) << "run " << i;
    ASSERT_TRUE(d.slots.download() == first_slots) << "run " << i;
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = indexer_select(d.args, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  d.topk_positions.fill_bytes(kPoison);
  d.slots.fill_bytes(kPoison);
  for (int i = 0; i < 3; ++i) DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(d.topk_positions.download() == first_topk);
  EXPECT_TRUE(d.slots.download() == first_slots);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // Token 0's second page points past the cache (its pools score -inf) and
  // the page of its tail is negative (the tail remaps to -1): the error
  // counters are not zero.
  s.block_table[0 * s.width + 1] = static_cast<int32_t>(s.blocks + 5);
  s.block_table[0 * s.width + (L - 1) / s.plan.block_size] = -7;
  s.run_reference_select();
  EXPECT_GT(s.rows.errors, 0);
  d.block_table.upload(s.block_table);
  for (bool baseline : {false, true}) {
    d.run(baseline, stream);
    EXPECT_GT(d.errors.download()[0], 0u);
    EXPECT_TRUE(d.topk_positions.download() == s.rows.topk_positions) << "baseline " << baseline;
    EXPECT_TRUE(d.slots.download() == s.rows.slots) << "baseline " << baseline;
  }
  cudaStreamDestroy(stream);
}

// Caller rows (MTP draft steps reusing step 0's selection) through
// indexer_remap: every kind of entry (valid, -1, from the future, on a page
// past the table, on a block outside the cache), a padding token, a graph
// replay; the slots are the reference's bit for bit, and the counter counts.
TEST(IndexerRemapGpu, CallerRowsMatchTheReference) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  IndexerPlan plan;
  plan.max_tokens = 4;
  plan.max_context = 8192;
  plan.block_size = 128;
  testing::IndexerHostState state(plan, /*requests=*/3, /*table_width=*/40, rng);
  state.block_table[2 * state.width + 3] = static_cast<int32_t>(state.blocks + 9);  // request 2's page 3: untrusted
  const std::vector<int64_t> positions = {5000, 700, 4800, 123};
  const std::vector<int32_t> requests = {0, 1, 2, -1};
  std::vector<int32_t> rows(size_t(4) * kWidth);
  std::uniform_int_distribution<int> kind(0, 9);
  for (int t = 0; t < 4; ++t) {
    std::uniform_int_distribution<int32_t> in_context(0, static_cast<int32_t>(positions[t]));
    for (int c = 0; c < kWidth; ++c) {
      const int k = kind(rng);
      int32_t& v = rows[size_t(t) * kWidth + c];
      v = k == 0   ? (c % 2 == 0 ? -1 : -7 - c)  // every negative position stays -1, uncounted
          : k == 1 ? static_cast<int32_t>(positions[t] + 1 + c % 7)
          : k == 2 ? 40 * 128 + c
                   : in_context(rng);
    }
  }
  const reference::IndexerStepHost step{4, nullptr, nullptr, nullptr, nullptr, positions.data(), requests.data()};
  reference::IndexerRowsHost expected;
  DSA_ASSERT_OK(reference::indexer_remap(plan, step, state.view, rows, &expected));
  ASSERT_GT(expected.errors, 0);

  DeviceBuffer<int64_t> d_positions(positions);
  DeviceBuffer<int32_t> d_requests(requests), d_rows(rows), d_table(state.block_table), d_slots(rows.size());
  DeviceBuffer<uint16_t> d_ring(state.ring);
  DeviceBuffer<uint8_t> d_cache(state.k_cache);
  DeviceBuffer<unsigned int> d_errors(std::vector<unsigned int>{0});
  IndexerRemapArgs a;
  a.plan = plan;
  a.positions = make_tensor(d_positions.get(), DType::kI64, {4});
  a.token_requests = make_tensor(d_requests.get(), DType::kI32, {4});
  a.state.block_table = make_tensor(d_table.get(), DType::kI32, {state.requests, state.width});
  a.state.ring = make_tensor(d_ring.get(), DType::kBF16, {state.requests, 2, plan.ring, kDim});
  a.state.k_cache = make_strided(d_cache.get(), DType::kU8, {state.blocks, plan.block_size / 4 * kIndexerPoolBytes},
                                 {state.page_stride, 1});
  a.topk_positions = make_tensor(d_rows.get(), DType::kI32, {4, kWidth});
  a.slots = make_tensor(d_slots.get(), DType::kI32, {4, kWidth});
  a.error_count = d_errors.get();
  d_slots.fill_bytes(kPoison);
  DSA_ASSERT_OK(indexer_remap(a, nullptr));
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(d_slots.download() == expected.slots);
  EXPECT_GT(d_errors.download()[0], 0u);

  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = indexer_remap(a, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  d_slots.fill_bytes(kPoison);
  DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(d_slots.download() == expected.slots);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Checks without a GPU: a step of 4 tokens over 4 requests at made-up device addresses.
void fake_step(TensorView* positions, TensorView* token_requests, IndexerState* state) {
  *positions = make_tensor(reinterpret_cast<void*>(uintptr_t{0x40000} << 16), DType::kI64, {4});
  *token_requests = make_tensor(reinterpret_cast<void*>(uintptr_t{0x41000} << 16), DType::kI32, {4});
  state->block_table = make_tensor(reinterpret_cast<void*>(uintptr_t{0x10000} << 16), DType::kI32, {4, 512});
  state->ring = make_tensor(reinterpret_cast<void*>(uintptr_t{0x20000} << 16), DType::kBF16, {4, 2, 4, kDim});
  state->k_cache = make_tensor(reinterpret_cast<void*>(uintptr_t{0x30000} << 16), DType::kU8, {1000, 64 * 132});
}

TEST(IndexerRemapChecks, RejectsBadRowsAndSlotsOverTheirInputs) {
  IndexerRemapArgs a;
  a.plan.max_tokens = 4;
  fake_step(&a.positions, &a.token_requests, &a.state);
  a.topk_positions = make_tensor(reinterpret_cast<void*>(uintptr_t{0x70000} << 16), DType::kI32, {4, kWidth - 1});
  a.slots = make_tensor(reinterpret_cast<void*>(uintptr_t{0x80000} << 16), DType::kI32, {4, kWidth});
  Status s = indexer_remap(a, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'topk_positions'"), std::string::npos) << s.message();
  a.topk_positions = make_tensor(reinterpret_cast<void*>(uintptr_t{0x70000} << 16), DType::kI32, {4, kWidth});
  DSA_ASSERT_OK(check_indexer_remap(a));
  a.slots.data = a.topk_positions.data;  // in place: the kernel reads a row while other CTAs write
  const Status in_place = check_indexer_remap(a);
  ASSERT_FALSE(in_place.ok());
  EXPECT_NE(in_place.message().find("'slots'"), std::string::npos) << in_place.message();
}

// Without a GPU: the launchers check their arguments before launching.
TEST(IndexerSelectChecks, LaunchersRejectBadArgumentsBeforeLaunching) {
  IndexerSelectArgs a;
  a.plan.max_tokens = 4;
  fake_step(&a.positions, &a.token_requests, &a.state);
  a.workspace = make_tensor(reinterpret_cast<void*>(uintptr_t{0x100000} << 16), DType::kU8, {indexer_workspace_layout(a.plan).bytes});
  a.topk_positions = make_tensor(reinterpret_cast<void*>(uintptr_t{0x70000} << 16), DType::kI32, {4, kWidth});
  a.slots = make_tensor(reinterpret_cast<void*>(uintptr_t{0x80000} << 16), DType::kI32, {3, kWidth});  // wrong m
  Status s = indexer_select(a, nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'slots'"), std::string::npos) << s.message();
  a.slots = make_tensor(reinterpret_cast<void*>(uintptr_t{0x80000} << 16), DType::kI32, {4, kWidth});
  // Rows written over the workspace's logits, or both outputs in one buffer.
  IndexerSelectArgs aliased = a;
  aliased.topk_positions.data = a.slots.data;
  const Status same_buffer = check_indexer_select(aliased);
  EXPECT_NE(same_buffer.message().find("disjoint from 'topk_positions'"), std::string::npos) << same_buffer.message();
  aliased = a;
  aliased.slots.data = a.workspace.data;
  const Status over_workspace = check_indexer_select(aliased);
  EXPECT_NE(over_workspace.message().find("'slots'"), std::string::npos) << over_workspace.message();
  a.topk_positions = TensorView();
  const Status baseline = indexer_select_baseline(a, nullptr, 0, nullptr);
  ASSERT_FALSE(baseline.ok());
  EXPECT_NE(baseline.message().find("'topk_positions'"), std::string::npos) << baseline.message();
}

}  // namespace
}  // namespace dsa
