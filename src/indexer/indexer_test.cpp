// The indexer's contract on the CPU: argument checks, the fixed-order
// arithmetic against float64 formulations, decode token by token against the
// bulk prefill (same K cache and ring bytes), the top-k's ties, rows and remap.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "indexer/indexer_math.h"
#include "indexer/indexer_reference.h"
#include "indexer/indexer_state_params.h"
#include "indexer/indexer_test_state.h"
#include "support.h"

namespace dsa {
namespace {

using namespace indexer_math;
using testing::expect_rejected;
constexpr int kDim = kIndexerDim;
constexpr int kHeads = kIndexerHeads;
const float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// Argument checks (no GPU needed: the views' pointers are never dereferenced).

// Region r of a fake address space (regions 4 GiB apart, so no views overlap);
// the checks never dereference these.
void* fake_device_pointer(uintptr_t region) { return reinterpret_cast<void*>(region << 16); }

// Valid views of a glm5next step, m = 4, block_size 256, RING 4; each test breaks one thing.
struct FakeArgs {
  int64_t m = 4, requests = 8, width = 512, blocks = 1000;
  IndexerPlan plan;
  IndexerState state;
  IndexerPrepareArgs prepare;
  IndexerSelectArgs select;
  IndexerPrefillArgs prefill;
  FakeArgs() : FakeArgs(4, 8, 1000) {}
  FakeArgs(int64_t tokens, int64_t request_count, int64_t block_count)
      : m(tokens), requests(request_count), blocks(block_count) {
    state.block_table = make_tensor(fake_device_pointer(0x10000), DType::kI32, {requests, width});
    state.ring = make_tensor(fake_device_pointer(0x20000), DType::kBF16, {requests, 2, plan.ring, kDim});
    state.k_cache = make_tensor(fake_device_pointer(0x30000), DType::kU8, {blocks, plan.block_size / 4 * 132});
    const TensorView workspace =
        make_tensor(fake_device_pointer(0x100000), DType::kU8, {indexer_workspace_layout(plan).bytes});
    const TensorView positions = make_tensor(fake_device_pointer(0x40000), DType::kI64, {m});
    const TensorView token_requests = make_tensor(static_cast<char*>(fake_device_pointer(0x40000)) + 0x1000, DType::kI32, {m});
    const TensorView weight = make_tensor(static_cast<char*>(fake_device_pointer(0x40000)) + 0x2000, DType::kF32, {kDim});
    const TensorView bias = make_tensor(static_cast<char*>(fake_device_pointer(0x40000)) + 0x3000, DType::kF32, {kDim});
    const TensorView ape = make_tensor(static_cast<char*>(fake_device_pointer(0x40000)) + 0x4000, DType::kF32, {4, kDim});
    prepare = {plan,
               make_tensor(fake_device_pointer(0x50000), DType::kBF16, {m, kHeads, kDim}),
               make_tensor(fake_device_pointer(0x60000), DType::kBF16, {m, kDim}),
               make_tensor(static_cast<char*>(fake_device_pointer(0x60000)) + 0x1000, DType::kF32, {m, kHeads}),
               make_tensor(static_cast<char*>(fake_device_pointer(0x60000)) + 0x2000, DType::kBF16, {m, kDim}),
               weight, bias, ape, positions, token_requests, state, workspace, nullptr, TensorView()};
    select = {plan, positions, token_requests, state, workspace,
              make_tensor(fake_device_pointer(0x70000), DType::kI32, {m, kIndexerRowWidth}),
              make_tensor(fake_device_pointer(0x80000), DType::kI32, {m, kIndexerRowWidth}), nullptr};
    prefill = {plan,
               make_tensor(fake_device_pointer(0x90000), DType::kBF16, {4000, kDim}),
               make_tensor(fake_device_pointer(0xA0000), DType::kBF16, {4000, kDim}),
               weight, bias, ape, 3, state, nullptr, TensorView()};
  }
};

TEST(IndexerChecks, AcceptsGlm5NextShapes) {
  FakeArgs f;
  EXPECT_TRUE(check_indexer_prepare(f.prepare).ok()) << check_indexer_prepare(f.prepare).to_string();
  EXPECT_TRUE(check_indexer_select(f.select).ok()) << check_indexer_select(f.select).to_string();
  EXPECT_TRUE(check_indexer_prefill(f.prefill).ok()) << check_indexer_prefill(f.prefill).to_string();
  f.select.topk_positions = TensorView();  // optional
  EXPECT_TRUE(check_indexer_select(f.select).ok()) << check_indexer_select(f.select).to_string();
  // A padded page stride and block size 128 (32 pools per page).
  FakeArgs padded;
  padded.plan.block_size = 128;
  padded.select.plan = padded.plan;
  padded.select.state.k_cache = make_strided(fake_device_pointer(0x30000), DType::kU8, {1000, 32 * 132},
                                             {32 * 132 + 16, 1});
  EXPECT_TRUE(check_indexer_select(padded.select).ok()) << check_indexer_select(padded.select).to_string();
}

TEST(IndexerChecks, PlanErrorsNameTheField) {
  IndexerPlan plan;
  plan.block_size = 192;
  expect_rejected(check_indexer_plan(plan), "plan.block_size", "multiple of 128");
  plan = IndexerPlan();
  plan.ring = 6;
  expect_rejected(check_indexer_plan(plan), "plan.ring", "4 (plan.pool: one token per request and step) or 8");
  plan = IndexerPlan();
  plan.pool = 16;  // the default ring (4) no longer fits
  expect_rejected(check_indexer_plan(plan), "plan.ring", "16 (plan.pool");
  plan.ring = 32;
  EXPECT_TRUE(check_indexer_plan(plan).ok());
  plan = IndexerPlan();
  plan.heads = 48;
  expect_rejected(check_indexer_plan(plan), "plan.heads", "16, 32 or 64");
  plan = IndexerPlan();
  plan.pool = 2;
  expect_rejected(check_indexer_plan(plan), "plan.pool", "4, 8 or 16");
  plan = IndexerPlan();
  plan.topk = 2050;
  expect_rejected(check_indexer_plan(plan), "plan.topk", "a multiple of plan.pool = 4 in 4..2048");
  plan.topk = 4096;
  expect_rejected(check_indexer_plan(plan), "plan.topk", "at most 512 pools");
  plan.pool = 8;
  plan.ring = 8;
  EXPECT_TRUE(check_indexer_plan(plan).ok());
  plan = IndexerPlan();
  plan.max_tokens = 17;
  expect_rejected(check_indexer_plan(plan), "plan.max_tokens", "1..16");
  plan = IndexerPlan();
  plan.max_context = kIndexerMaxContext + 1;
  expect_rejected(check_indexer_plan(plan), "plan.max_context", "1..");
  plan = IndexerPlan();
  plan.logits = static_cast<IndexerLogits>(2);
  expect_rejected(check_indexer_plan(plan), "plan.logits", "IndexerLogits::kFp32Accumulation (0) or");
  plan.logits = IndexerLogits::kFp32Accumulation;
  EXPECT_TRUE(check_indexer_plan(plan).ok());
}

// Views shaped by the default plan are refused by a plan of another shape,
// naming the view and the plan's size; views of that shape pass.
TEST(IndexerChecks, ViewsFollowThePlanShape) {
  FakeArgs f;
  IndexerPlan plan;
  plan.heads = 64;
  plan.pool = 16;
  plan.ring = 16;
  plan.topk = 1024;
  f.prepare.plan = plan;
  f.select.plan = plan;
  f.prefill.plan = plan;
  expect_rejected(check_indexer_prepare(f.prepare), "index_q", "[4, 64, 128]");
  f.prepare.index_q = make_tensor(fake_device_pointer(0x50000), DType::kBF16, {4, 64, kDim});
  expect_rejected(check_indexer_prepare(f.prepare), "head_weights", "[4, 64]");
  f.prepare.head_weights = make_tensor(static_cast<char*>(fake_device_pointer(0x60000)) + 0x1000, DType::kF32, {4, 64});
  expect_rejected(check_indexer_prepare(f.prepare), "ape", "[16, 128]");
  const TensorView ape = make_tensor(static_cast<char*>(fake_device_pointer(0x40000)) + 0x4000, DType::kF32, {16, kDim});
  f.prepare.ape = ape;
  f.prefill.ape = ape;
  expect_rejected(check_indexer_prepare(f.prepare), "ring", "[8, 2, 16, 128]");
  const TensorView ring = make_tensor(fake_device_pointer(0x20000), DType::kBF16, {8, 2, 16, kDim});
  f.prepare.state.ring = ring;
  expect_rejected(check_indexer_prepare(f.prepare), "k_cache", "[*, 2112]");  // 256 / 16 pools of 132 bytes
  const TensorView k_cache = make_tensor(fake_device_pointer(0x30000), DType::kU8, {1000, 16 * 132});
  f.prepare.state.k_cache = k_cache;
  const int64_t bytes = indexer_workspace_layout(plan).bytes;
  EXPECT_EQ(bytes, 16 * 64 * 128 + 16 * 64 * 4 + 16 * (131072 / 16) * 4);
  f.prepare.workspace = make_tensor(fake_device_pointer(0x100000), DType::kU8, {bytes - 1});
  expect_rejected(check_indexer_prepare(f.prepare), "workspace", std::to_string(bytes) + " bytes");
  const TensorView workspace = make_tensor(fake_device_pointer(0x100000), DType::kU8, {bytes});
  f.prepare.workspace = workspace;
  EXPECT_TRUE(check_indexer_prepare(f.prepare).ok()) << check_indexer_prepare(f.prepare).to_string();
  f.select.state = f.prepare.state;
  f.select.workspace = workspace;
  expect_rejected(check_indexer_select(f.select), "topk_positions", "[4, 1152]");  // 1024 + 15 -> 1152
  f.select.topk_positions = make_tensor(fake_device_pointer(0x70000), DType::kI32, {4, 1152});
  f.select.slots = make_tensor(fake_device_pointer(0x80000), DType::kI32, {4, 1152});
  EXPECT_TRUE(check_indexer_select(f.select).ok()) << check_indexer_select(f.select).to_string();
  f.prefill.state = f.prepare.state;
  EXPECT_TRUE(check_indexer_prefill(f.prefill).ok()) << check_indexer_prefill(f.prefill).to_string();
}

TEST(IndexerChecks, WorkspaceLayoutIsAlignedAndSizedByTheShapes) {
  IndexerPlan plan;
  plan.max_tokens = 16;
  plan.max_context = 131072;
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(plan);
  EXPECT_EQ(layout.q_fp8, 0);
  EXPECT_EQ(layout.head_weights, 16 * 32 * 128);
  EXPECT_EQ(layout.logits, layout.head_weights + 16 * 32 * 4);
  EXPECT_EQ(layout.bytes, layout.logits + 16 * 32768 * 4);
  for (int64_t offset : {layout.head_weights, layout.logits, layout.bytes}) EXPECT_EQ(offset % 256, 0);
}

TEST(IndexerChecks, PrepareErrorsNameTheArgument) {
  {
    FakeArgs f;
    f.prepare.index_q.dtype = DType::kF32;
    expect_rejected(check_indexer_prepare(f.prepare), "index_q", "dtype bf16");
  }
  {
    FakeArgs f;
    f.prepare.index_q = make_tensor(fake_device_pointer(0x50000), DType::kBF16, {17, kHeads, kDim});
    expect_rejected(check_indexer_prepare(f.prepare), "index_q", "1..16 tokens");
  }
  {
    FakeArgs f;
    f.prepare.head_weights.dtype = DType::kBF16;
    expect_rejected(check_indexer_prepare(f.prepare), "head_weights", "dtype f32");
  }
  {
    FakeArgs f;
    f.prepare.gate = make_tensor(static_cast<char*>(fake_device_pointer(0x60000)) + 0x2000, DType::kBF16, {3, kDim});
    expect_rejected(check_indexer_prepare(f.prepare), "gate", "shape [4, 128]");
  }
  {
    FakeArgs f;
    f.prepare.ape = make_tensor(static_cast<char*>(fake_device_pointer(0x40000)) + 0x4000, DType::kF32, {8, kDim});
    expect_rejected(check_indexer_prepare(f.prepare), "ape", "shape [4, 128]");
  }
  {
    FakeArgs f;
    f.prepare.k_norm_bias.device.kind = DeviceKind::kCPU;
    expect_rejected(check_indexer_prepare(f.prepare), "k_norm_bias", "a CUDA tensor");
  }
  {
    FakeArgs f;
    f.prepare.positions.dtype = DType::kI32;
    expect_rejected(check_indexer_prepare(f.prepare), "positions", "dtype i64");
  }
  {
    FakeArgs f;
    f.prepare.state.ring = make_tensor(fake_device_pointer(0x20000), DType::kBF16, {8, 2, 8, kDim});
    expect_rejected(check_indexer_prepare(f.prepare), "ring", "shape [8, 2, 4, 128]");
  }
  {
    FakeArgs f;
    f.prepare.state.k_cache = make_tensor(fake_device_pointer(0x30000), DType::kU8, {1000, 64 * 128});
    expect_rejected(check_indexer_prepare(f.prepare), "k_cache", "shape [*, 8448]");
  }
  {
    FakeArgs f;
    f.prepare.state.k_cache = make_tensor(static_cast<char*>(fake_device_pointer(0x30000)) + 0x0008, DType::kU8, {1000, 64 * 132});
    expect_rejected(check_indexer_prepare(f.prepare), "k_cache", "aligned to 16");
  }
  {
    FakeArgs f;
    f.prepare.workspace.shape[0] -= 1;
    expect_rejected(check_indexer_prepare(f.prepare), "workspace", "indexer_workspace_layout");
  }
  {
    FakeArgs f;
    f.prepare.state.block_table = make_tensor(fake_device_pointer(0x10000), DType::kI32, {7, 512});
    expect_rejected(check_indexer_prepare(f.prepare), "ring", "shape [7, 2, 4, 128]");
  }
}

TEST(IndexerChecks, SelectAndPrefillErrorsNameTheArgument) {
  {
    FakeArgs f;
    f.select.slots = make_tensor(fake_device_pointer(0x80000), DType::kI32, {4, 2048});
    expect_rejected(check_indexer_select(f.select), "slots", "shape [4, 2176]");
  }
  {
    FakeArgs f;
    f.select.topk_positions.dtype = DType::kI64;
    expect_rejected(check_indexer_select(f.select), "topk_positions", "dtype i32");
  }
  {
    FakeArgs f;
    f.select.state.block_table = make_strided(fake_device_pointer(0x10000), DType::kI32, {8, 512}, {1, 8});
    expect_rejected(check_indexer_select(f.select), "block_table", "stride 1 in dim 1");
  }
  {
    FakeArgs f;
    f.prefill.request = 8;
    expect_rejected(check_indexer_prefill(f.prefill), "request", "0..7");
  }
  {
    FakeArgs f;  // more tokens than the block table covers (512 blocks of 256)
    f.prefill.plan.max_context = 1 << 20;
    f.prefill.index_k = make_tensor(fake_device_pointer(0x90000), DType::kBF16, {512 * 256 + 1, kDim});
    f.prefill.gate = f.prefill.index_k;
    expect_rejected(check_indexer_prefill(f.prefill), "index_k", "block_table width * block_size");
  }
  {
    FakeArgs f;  // the optional error counter, when given, is 4-byte aligned (atomicAdd)
    unsigned int* misaligned = reinterpret_cast<unsigned int*>(static_cast<char*>(fake_device_pointer(0xA0000)) + 2);
    f.prepare.error_count = f.select.error_count = f.prefill.error_count = misaligned;
    expect_rejected(check_indexer_prepare(f.prepare), "error_count", "4-byte aligned");
    expect_rejected(check_indexer_select(f.select), "error_count", "4-byte aligned");
    expect_rejected(check_indexer_prefill(f.prefill), "error_count", "4-byte aligned");
  }
}

// The state's and the workspace's layout rules, one case each (through
// select, which checks the same state as prepare and prefill).
TEST(IndexerChecks, StateAndWorkspaceLayoutsAreNamed) {
  const auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f.select);
    expect_rejected(check_indexer_select(f.select), argument, words);
  };
  rejected([](IndexerSelectArgs& a) { a.state.block_table.strides[0] = 256; }, "block_table",
           "a request stride of at least its width");
  rejected([](IndexerSelectArgs& a) { a.state.block_table.shape[1] = 0; }, "block_table", "at least one request");
  rejected([](IndexerSelectArgs& a) { a.state.ring.strides[0] = 2 * 4 * kDim + 4; }, "ring",
           "a request stride that is a multiple of 8");
  rejected([](IndexerSelectArgs& a) { a.state.ring.data = static_cast<char*>(a.state.ring.data) + 8; }, "ring",
           "aligned to 16");
  rejected([](IndexerSelectArgs& a) { a.state.k_cache.strides[0] = 64 * 132 + 8; }, "k_cache",
           "a page stride that is a multiple of 16");
  rejected([](IndexerSelectArgs& a) { a.state.k_cache.shape[0] = (int64_t(1) << 31) / 256 + 1; }, "k_cache",
           "blocks (int32 slots)");
  rejected([](IndexerSelectArgs& a) { a.workspace.data = static_cast<char*>(a.workspace.data) + 16; }, "workspace",
           "aligned to 256");
  rejected([](IndexerSelectArgs& a) { a.workspace.shape[0] -= 1; }, "workspace", "indexer_workspace_layout");
  rejected([](IndexerSelectArgs& a) { a.positions.strides[0] = 2; }, "positions", "stride 1 in dim 0");
  rejected([](IndexerSelectArgs& a) { a.token_requests.data = static_cast<char*>(a.token_requests.data) + 2; },
           "token_requests", "aligned to 4");
  FakeArgs f;  // prefill: more tokens than the plan's context
  f.prefill.index_k = make_tensor(fake_device_pointer(0x90000), DType::kBF16, {f.plan.max_context + 1, kDim});
  f.prefill.gate = f.prefill.index_k;
  expect_rejected(check_indexer_prefill(f.prefill), "index_k", "the plan's max_context");
}

// A size-1 dimension's stride is never used (tensor.h): one token, one
// request and one K-cache block take any; more take only the strides above.
TEST(IndexerChecks, SizeOneDimensionsTakeAnyStride) {
  FakeArgs one(1, 1, 1);
  for (TensorView* t : {&one.prepare.index_q, &one.prepare.index_k, &one.prepare.head_weights, &one.prepare.gate,
                        &one.prepare.positions, &one.prepare.token_requests, &one.prepare.state.ring,
                        &one.prepare.state.k_cache, &one.select.slots, &one.select.topk_positions}) {
    t->strides[0] = 3;
  }
  one.select.positions = one.prepare.positions;
  one.select.token_requests = one.prepare.token_requests;
  one.select.state = one.prefill.state = one.prepare.state;
  one.prefill.request = 0;
  one.prefill.index_k = make_strided(one.prefill.index_k.data, DType::kBF16, {1, kDim}, {3, 1});
  one.prefill.gate = make_strided(one.prefill.gate.data, DType::kBF16, {1, kDim}, {3, 1});
  EXPECT_TRUE(check_indexer_prepare(one.prepare).ok()) << check_indexer_prepare(one.prepare).to_string();
  EXPECT_TRUE(check_indexer_select(one.select).ok()) << check_indexer_select(one.select).to_string();
  EXPECT_TRUE(check_indexer_prefill(one.prefill).ok()) << check_indexer_prefill(one.prefill).to_string();

  FakeArgs f;
  f.prepare.index_k.strides[0] = 3;
  expect_rejected(check_indexer_prepare(f.prepare), "index_k", "a token stride that is a multiple of 8");
  f.select.slots.strides[0] = 3;
  expect_rejected(check_indexer_select(f.select), "slots", "a token stride that is a multiple of 4");
}

// What a launch writes (ring, K cache, workspace) shares no byte with
// anything it reads or with each other: each pair named.
TEST(IndexerChecks, WrittenViewsShareNoMemory) {
  {
    FakeArgs f;
    f.prepare.workspace.data = f.prepare.index_q.data;
    expect_rejected(check_indexer_prepare(f.prepare), "workspace", "memory disjoint from 'index_q'");
  }
  {
    FakeArgs f;
    f.prepare.state.ring.data = f.prepare.gate.data;
    expect_rejected(check_indexer_prepare(f.prepare), "ring", "memory disjoint from 'gate'");
  }
  {
    FakeArgs f;  // the K cache's last page overlapping the workspace's start
    f.prepare.state.k_cache.data =
        static_cast<char*>(f.prepare.workspace.data) - (f.blocks - 1) * f.prepare.state.k_cache.stride(0);
    expect_rejected(check_indexer_prepare(f.prepare), "k_cache", "memory disjoint from 'workspace'");
  }
  {
    FakeArgs f;
    f.prefill.state.k_cache.data = f.prefill.index_k.data;
    expect_rejected(check_indexer_prefill(f.prefill), "k_cache", "memory disjoint from 'index_k'");
  }
  {
    FakeArgs f;
    f.prefill.state.ring.data = f.prefill.state.block_table.data;
    expect_rejected(check_indexer_prefill(f.prefill), "ring", "memory disjoint from 'block_table'");
  }
}

TEST(IndexerChecks, BatchRulesNameTheToken) {
  IndexerPlan plan;  // RING 4: one token per request
  const int64_t positions[4] = {10, 20, 30, 40};
  const int32_t requests[4] = {0, 1, -1, 2};
  EXPECT_TRUE(check_indexer_batch(plan, 4, positions, requests, 3, 4).ok());
  const int64_t negative[4] = {10, -1, 30, 40};
  expect_rejected(check_indexer_batch(plan, 4, negative, requests, 3, 4), "positions[1]", "0..1023");
  const int32_t unknown[4] = {0, 1, -1, 3};
  expect_rejected(check_indexer_batch(plan, 4, positions, unknown, 3, 4), "token_requests[3]", "0..2");
  const int32_t twice[4] = {0, 1, -1, 0};
  const int64_t consecutive[4] = {10, 20, 30, 11};
  expect_rejected(check_indexer_batch(plan, 4, consecutive, twice, 3, 4), "token_requests[3]", "RING - (pool - 1) = 1");
  plan.ring = 8;  // up to 5 tokens of one request, at consecutive positions
  EXPECT_TRUE(check_indexer_batch(plan, 4, consecutive, twice, 3, 4).ok());
  expect_rejected(check_indexer_batch(plan, 4, positions, twice, 3, 4), "positions[3]", "position 11");
  const int64_t past_table[4] = {10, 20, 30, 4 * 256};
  expect_rejected(check_indexer_batch(plan, 4, past_table, requests, 3, 4), "positions[3]", "block table");
}

// ---------------------------------------------------------------------------
// The fixed-order arithmetic.

TEST(IndexerMath, HadamardMatchesTheMatrixProduct) {
  EXPECT_EQ(num::float_bits(kHadamardScale), 0x3DB504F3u);
  EXPECT_EQ(kHadamardScale, static_cast<float>(1.0 / std::sqrt(128.0)));
  std::mt19937_64 rng(testing::test_seed());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int trial = 0; trial < 50; ++trial) {
    float x[kDim];
    double magnitude = 0;
    for (float& v : x) {
      v = normal(rng);
      magnitude += std::fabs(v);
    }
    float y[kDim];
    std::copy(x, x + kDim, y);
    hadamard128(y);
    for (int i = 0; i < kDim; ++i) {
      double exact = 0;
      for (int j = 0; j < kDim; ++j) exact += (__builtin_popcount(i & j) & 1 ? -1.0 : 1.0) * x[j];
      // 7 stages, each rounding a partial sum of at most `magnitude`.
      EXPECT_NEAR(y[i], exact, 7 * magnitude * std::ldexp(1.0, -24)) << "trial " << trial << " i " << i;
    }
  }
}

TEST(IndexerMath, HadamardIsAnInvolution) {
  // Unscaled, on small integers every sum is exact: H (H x) = 128 x bit for bit.
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_int_distribution<int> small(-1000, 1000);
  float x[kDim], y[kDim];
  for (int i = 0; i < kDim; ++i) y[i] = x[i] = static_cast<float>(small(rng));
  hadamard128(y);
  hadamard128(y);
  for (int i = 0; i < kDim; ++i) EXPECT_EQ(y[i], 128.0f * x[i]) << i;
  // Scaled, on general values: back to x within FP32 rounding.
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int i = 0; i < kDim; ++i) y[i] = x[i] = normal(rng);
  for (int round = 0; round < 2; ++round) {
    hadamard128(y);
    for (float& v : y) v *= kHadamardScale;
  }
  for (int i = 0; i < kDim; ++i) EXPECT_NEAR(y[i], x[i], 1e-5f) << i;
}

// The scale exponent from frexp (absmax = f 2^e, f in [0.5, 1); 448 = 0.875 * 2^9).
int frexp_scale_exponent(float absmax) {
  int e = 0;
  const double f = std::frexp(double(std::min(std::max(absmax, kAbsmaxFloor), FLT_MAX)), &e);
  return f <= 0.875 ? e - 9 : e - 8;
}

// The stock formula: the rounded quotient's ceil(log2), from its bits.
int stock_scale_exponent(float absmax) {
  const uint32_t bits = num::float_bits(std::max(absmax, kAbsmaxFloor) / 448.0f);
  return static_cast<int>(bits >> 23) - 127 + ((bits & 0x7FFFFFu) != 0);
}

TEST(IndexerMath, PowerOfTwoScaleEdgeCases) {
  EXPECT_EQ(fp8_scale_exponent(0.0f), -22);  // 1e-4 / 448 = 2^-22.09
  EXPECT_EQ(fp8_scale_exponent(1e-4f), -22);
  EXPECT_EQ(fp8_scale_exponent(1e-30f), -22);
  EXPECT_EQ(fp8_scale_exponent(num::bits_float(1)), -22);  // the smallest subnormal
  EXPECT_EQ(fp8_scale_exponent(-std::numeric_limits<float>::quiet_NaN()), -22);
  EXPECT_EQ(fp8_scale_exponent(kInf), 120);
  EXPECT_EQ(fp8_scale_exponent(FLT_MAX), 120);
  for (int k = -20; k <= 100; ++k) {
    const float exact = std::ldexp(448.0f, k);
    EXPECT_EQ(fp8_scale_exponent(exact), k) << "448 * 2^" << k;
    EXPECT_EQ(fp8_scale_exponent(std::nextafter(exact, kInf)), k + 1) << "just above 448 * 2^" << k;
    EXPECT_EQ(fp8_scale_exponent(std::nextafter(exact, 0.0f)), k) << "just below 448 * 2^" << k;
  }
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_int_distribution<uint32_t> bits(0, 0x7F7FFFFFu);  // every finite non-negative float
  for (int i = 0; i < 1000000; ++i) {
    const float absmax = num::bits_float(bits(rng));
    const int k = fp8_scale_exponent(absmax);
    ASSERT_EQ(k, frexp_scale_exponent(absmax)) << absmax;
    ASSERT_EQ(k, stock_scale_exponent(absmax)) << absmax;
    ASSERT_EQ(pow2(k), std::ldexp(1.0f, k));
  }
}

TEST(IndexerMath, QuantizedRowDecodesWithinFp8Precision) {
  std::mt19937_64 rng(testing::test_seed());
  for (float stddev : {1e-6f, 0.01f, 1.0f, 300.0f}) {
    const std::vector<uint16_t> row = testing::random_bf16(kDim, stddev, rng);
    uint8_t codes[kDim];
    const float scale = hadamard_quantize(row.data(), codes);
    float x[kDim], absmax = 0;
    for (int i = 0; i < kDim; ++i) x[i] = num::bf16_to_float(row[i]);
    hadamard128(x);
    for (float& v : x) {
      v = num::round_bf16(v * kHadamardScale);
      absmax = std::max(absmax, std::fabs(v));
    }
    EXPECT_EQ(scale, pow2(frexp_scale_exponent(absmax)));
    for (int i = 0; i < kDim; ++i) {
      EXPECT_EQ(codes[i], num::float_to_e4m3(x[i] / scale)) << i;  // the rounded division, directly
      EXPECT_LE(std::fabs(num::e4m3_to_float(codes[i])), 448.0f);
    }
  }
}

TEST(IndexerMath, ExpMatchesFloat64) {
  EXPECT_EQ(exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(exp_nonpositive(-0.0f), 1.0f);
  EXPECT_EQ(exp_nonpositive(-kInf), 0.0f);
  EXPECT_TRUE(std::isnan(exp_nonpositive(std::numeric_limits<float>::quiet_NaN())));
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_real_distribution<float> uniform(-104.0f, 0.0f);
  for (int i = 0; i < 1000000; ++i) {
    const float x = i < 500000 ? uniform(rng) : uniform(rng) / 100.0f;
    const double exact = std::exp(double(x));
    const float got = exp_nonpositive(x);
    // 2 ulp of a normal result; a subnormal result has a fixed step of 2^-149.
    const double ulp = exact >= FLT_MIN ? std::ldexp(1.0, std::ilogb(exact) - 23) : std::ldexp(1.0, -149);
    ASSERT_LE(std::fabs(got - exact), 2 * ulp) << "x = " << x;
  }
}

std::vector<float> random_floats(size_t count, float mean, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// |got - exact| within `ulps` BF16 ulp of the exact value, or `absolute`.
void expect_near_bf16(uint16_t got, double exact, double ulps, double absolute, const std::string& what) {
  const double ulp = exact == 0 ? 0 : std::ldexp(1.0, std::ilogb(exact) - 7);
  EXPECT_LE(std::fabs(num::bf16_to_float(got) - exact), ulps * ulp + absolute) << what << ": exact " << exact;
}

TEST(IndexerMath, LayerNormMatchesFloat64) {
  std::mt19937_64 rng(testing::test_seed());
  const std::vector<float> weight = random_floats(kDim, 1.0f, 0.3f, rng), bias = random_floats(kDim, 0.0f, 0.1f, rng);
  for (float offset : {0.0f, 5.0f}) {
    std::vector<uint16_t> k = testing::random_bf16(kDim, 2.0f, rng);
    for (uint16_t& v : k) v = num::float_to_bf16(num::bf16_to_float(v) + offset);
    uint16_t out[kDim];
    layernorm128(k.data(), weight.data(), bias.data(), out);
    double mean = 0, variance = 0;
    for (uint16_t v : k) mean += num::bf16_to_float(v) / kDim;
    for (uint16_t v : k) variance += std::pow(num::bf16_to_float(v) - mean, 2) / kDim;
    for (int i = 0; i < kDim; ++i) {
      const double exact = (num::bf16_to_float(k[i]) - mean) / std::sqrt(variance + 1e-6) * weight[i] + bias[i];
      expect_near_bf16(out[i], exact, 1.0, 1e-6, "dim " + std::to_string(i));
    }
  }
}

TEST(IndexerMath, PoolCompressionMatchesFloat64AtEveryPoolSize) {
  std::mt19937_64 rng(testing::test_seed());
  for (int pool : {4, 8, 16}) {
    const std::vector<float> ape = random_floats(pool * kDim, 0.0f, 1.0f, rng);
    std::vector<std::vector<uint16_t>> k(pool), gate(pool);
    const uint16_t* k_rows[kMaxPoolSize];
    const uint16_t* gate_rows[kMaxPoolSize];
    for (int j = 0; j < pool; ++j) {
      k[j] = testing::random_bf16(kDim, 1.0f, rng);
      gate[j] = testing::random_bf16(kDim, 3.0f, rng);
      k_rows[j] = k[j].data();
      gate_rows[j] = gate[j].data();
    }
    uint16_t pooled[kDim];
    pool_softmax128(pool, k_rows, gate_rows, ape.data(), pooled);
    for (int i = 0; i < kDim; ++i) {
      double s[kMaxPoolSize], max_s = -1e300, sum = 0, exact = 0, magnitude = 0;
      for (int j = 0; j < pool; ++j) {
        max_s = std::max(max_s, s[j] = double(num::bf16_to_float(gate[j][i])) + ape[j * kDim + i]);
      }
      for (int j = 0; j < pool; ++j) sum += std::exp(s[j] - max_s);
      for (int j = 0; j < pool; ++j) {
        const double term = std::exp(s[j] - max_s) / sum * num::bf16_to_float(k[j][i]);
        exact += term;
        magnitude += std::fabs(term);
      }
      // BF16 rounding of the result, plus FP32 cancellation among the terms.
      expect_near_bf16(pooled[i], exact, 1.0, magnitude * 1e-6,
                       "pool " + std::to_string(pool) + " dim " + std::to_string(i));
    }
  }
}

TEST(IndexerMath, HeadWeightFoldIsTheScaleOfTheHeadCount) {
  for (int heads : {16, 32, 64}) {
    EXPECT_EQ(head_weight_scale(heads), static_cast<float>(1.0 / std::sqrt(128.0 * heads))) << heads;
    // (w s) c with s a power of two: one rounding of w c.
    EXPECT_EQ(fold_head_weight(0.3f, 0.25f, heads), static_cast<float>(0.3f * 0.25f) * head_weight_scale(heads));
  }
  EXPECT_EQ(head_weight_scale(32), 0.015625f);
}

// ---------------------------------------------------------------------------
// The reference's steps on a host state.

using HostState = testing::IndexerHostState;

struct LayerParams {
  std::vector<float> weight, bias, ape;  // ape [pool, 128]
  reference::IndexerParamsHost view;
  explicit LayerParams(std::mt19937_64& rng, int pool = kIndexerPoolSize)
      : weight(random_floats(kDim, 1.0f, 0.2f, rng)),
        bias(random_floats(kDim, 0.0f, 0.1f, rng)),
        ape(random_floats(pool * kDim, 0.0f, 0.5f, rng)),
        view{weight.data(), bias.data(), ape.data()} {}
};

// Projections of a step: random index_q, head_weights; index_k, gate given.
struct StepInputs {
  std::vector<uint16_t> index_q, index_k, gate;
  std::vector<float> head_weights;
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;
  reference::IndexerStepHost view() const {
    return {static_cast<int>(positions.size()), index_q.data(), index_k.data(), head_weights.data(), gate.data(),
            positions.data(), token_requests.data()};
  }
};

StepInputs random_step(const std::vector<int64_t>& positions, const std::vector<int32_t>& requests,
                       std::mt19937_64& rng, int heads = kHeads) {
  StepInputs s;
  const size_t m = positions.size();
  s.index_q = testing::random_bf16(m * heads * kDim, 1.0f, rng);
  s.index_k = testing::random_bf16(m * kDim, 1.0f, rng);
  s.gate = testing::random_bf16(m * kDim, 1.0f, rng);
  s.head_weights = random_floats(m * heads, 0.0f, 1.0f, rng);
  s.positions = positions;
  s.token_requests = requests;
  return s;
}

// Decode token by token (steps of 1..RING - (S - 1) tokens of each request)
// leaves the K cache and ring bytes of the bulk prefill, at every pool size
// and both rings; pool p lies at entry p % P of page p / P.
TEST(IndexerReference, DecodeTokenByTokenGivesTheBulkInsertBytes) {
  std::mt19937_64 rng(testing::test_seed());
  for (int pool_size : {4, 8, 16}) {
    for (int ring : {pool_size, 2 * pool_size}) {
      IndexerPlan plan;
      plan.pool = pool_size;
      plan.ring = ring;
      plan.heads = pool_size == 8 ? 16 : kHeads;
      plan.block_size = 128;
      plan.max_context = 4096;
      const std::string where = "pool " + std::to_string(pool_size) + " RING " + std::to_string(ring);
      const std::vector<int64_t> lengths = {1, 3, 4, 130, 517, 600};  // the last pool complete or not
      const int64_t requests = lengths.size(), width = 5;
      LayerParams params(rng, pool_size);
      std::vector<std::vector<uint16_t>> k(requests), gate(requests);  // [length, 128] per request
      for (int64_t r = 0; r < requests; ++r) {
        k[r] = testing::random_bf16(lengths[r] * kDim, 1.0f, rng);
        gate[r] = testing::random_bf16(lengths[r] * kDim, 2.0f, rng);
      }
      uint64_t state_seed = rng();
      std::mt19937_64 rng_bulk(state_seed), rng_decode(state_seed);
      HostState bulk(plan, requests, width, rng_bulk), decode(plan, requests, width, rng_decode);
      for (int64_t r = 0; r < requests; ++r) {
        int64_t errors = -1;
        DSA_ASSERT_OK(reference::indexer_prefill(plan, k[r].data(), gate[r].data(), lengths[r], r, params.view,
                                                 bulk.view, &errors));
        EXPECT_EQ(errors, 0);
      }
      // Decode: steps that interleave the requests, each taking 1..RING-(S-1) of a request's next tokens.
      std::vector<int64_t> next(requests, 0);
      std::uniform_int_distribution<int> take(1, indexer_tokens_per_request(plan));
      for (bool any = true; any;) {
        any = false;
        StepInputs step;
        for (int64_t r = 0; r < requests; ++r) {
          for (int n = take(rng); n > 0 && next[r] < lengths[r]; --n, ++next[r]) {
            if (step.positions.size() == kIndexerMaxTokens - 1) break;  // room for the padding token
            step.positions.push_back(next[r]);
            step.token_requests.push_back(static_cast<int32_t>(r));
            step.index_k.insert(step.index_k.end(), &k[r][next[r] * kDim], &k[r][(next[r] + 1) * kDim]);
            step.gate.insert(step.gate.end(), &gate[r][next[r] * kDim], &gate[r][(next[r] + 1) * kDim]);
            any = true;
          }
        }
        if (!any) break;
        step.positions.push_back(0);  // a padding token writes nothing
        step.token_requests.push_back(-1);
        step.index_k.resize(step.positions.size() * kDim, 0x3F80);
        step.gate.resize(step.positions.size() * kDim, 0x3F80);
        step.index_q.assign(step.positions.size() * plan.heads * kDim, 0);
        step.head_weights.assign(step.positions.size() * plan.heads, 1.0f);
        reference::IndexerQueryHost query;
        int64_t errors = -1;
        DSA_ASSERT_OK(reference::indexer_prepare(plan, step.view(), params.view, decode.view, &query, &errors));
        EXPECT_EQ(errors, 0);
        EXPECT_EQ(query.q_fp8.size(), step.positions.size() * plan.heads * kDim) << where;
      }
      EXPECT_TRUE(bulk.k_cache == decode.k_cache) << where;
      EXPECT_TRUE(bulk.ring == decode.ring) << where;
      // And the entries are where the layout says: pool p in page block_table[r, p / P] at entry p % P.
      const int64_t per_page = 128 / pool_size;
      const int64_t r = 4, pool = 500 / pool_size;  // request of 517 tokens: page 3
      const int64_t block = bulk.block_table[r * width + pool / per_page];
      const uint8_t* page = &bulk.k_cache[block * bulk.view.page_stride];
      uint16_t normed[kMaxPoolSize][kDim], pooled[kDim];
      const uint16_t* k_rows[kMaxPoolSize];
      const uint16_t* gate_rows[kMaxPoolSize];
      for (int j = 0; j < pool_size; ++j) {
        layernorm128(&k[r][(pool_size * pool + j) * kDim], params.weight.data(), params.bias.data(), normed[j]);
        k_rows[j] = normed[j];
        gate_rows[j] = &gate[r][(pool_size * pool + j) * kDim];
      }
      pool_softmax128(pool_size, k_rows, gate_rows, params.ape.data(), pooled);
      uint8_t codes[kDim];
      const float scale = hadamard_quantize(pooled, codes);
      EXPECT_EQ(std::memcmp(page + (pool % per_page) * kDim, codes, kDim), 0) << where;
      EXPECT_EQ(std::memcmp(page + per_page * kDim + (pool % per_page) * 4, &scale, 4), 0) << where;
    }
  }
}

TEST(IndexerReference, TopPoolsTieToTheLowerIndex) {
  // All equal: the first 512.
  std::vector<float> logits(2000, 1.5f);
  std::vector<int32_t> expected(512);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(reference::select_top_pools(logits, 512), expected);
  // -0 equals +0; NaN ranks with -inf, after every finite value, ties by index.
  logits.assign(2000, 0.0f);
  for (int p = 0; p < 2000; p += 2) logits[p] = -0.0f;
  EXPECT_EQ(reference::select_top_pools(logits, 512), expected);
  logits.assign(2000, -kInf);
  logits[5] = std::numeric_limits<float>::quiet_NaN();
  logits[1999] = -1e30f;
  std::vector<int32_t> top = reference::select_top_pools(logits, 512);
  EXPECT_EQ(top.back(), 1999);
  EXPECT_TRUE(std::binary_search(top.begin(), top.end(), 5));  // index 5 ties with -inf at the lowest indices
  // Random logits from a few values (many ties) against a stable sort.
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_int_distribution<int> level(0, 20);
  for (int trial = 0; trial < 20; ++trial) {
    logits.resize(700 + trial * 300);
    for (float& v : logits) v = static_cast<float>(level(rng)) * 0.25f;
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    order.resize(512);
    std::sort(order.begin(), order.end());
    EXPECT_EQ(reference::select_top_pools(logits, 512), order) << "trial " << trial;
  }
}

TEST(IndexerReference, RemapKeepsMinusOneAndSkipsUntrustedBlocks) {
  std::mt19937_64 rng(testing::test_seed());
  IndexerPlan plan;
  plan.block_size = 128;
  HostState state(plan, 2, 4, rng);
  state.block_table[1 * 4 + 2] = -5;                           // request 1, page 2
  state.block_table[1 * 4 + 3] = static_cast<int32_t>(state.view.blocks);  // past the cache
  const int32_t positions[8] = {-1, 0, 127, 128, 300, 400, 511, 512};
  int32_t slots[8];
  // 300, 400 and 511 on untrusted blocks, 512 past the table's width.
  EXPECT_EQ(reference::remap_row(plan, state.view, 1, positions, 8, slots), 4);
  EXPECT_EQ(slots[0], -1);
  EXPECT_EQ(slots[1], state.block_table[4] * 128);
  EXPECT_EQ(slots[2], state.block_table[4] * 128 + 127);
  EXPECT_EQ(slots[3], state.block_table[5] * 128);
  for (int c = 4; c < 8; ++c) EXPECT_EQ(slots[c], -1) << c;
}

// Float64 logits of one token, independent of the reference's order.
std::vector<double> float64_logits(const IndexerPlan& plan, const reference::IndexerStateHost& state, int64_t request,
                                   int64_t n_pools, const uint8_t* q, const float* w, std::vector<double>* magnitude) {
  std::vector<double> logits(n_pools);
  magnitude->assign(n_pools, 0.0);
  for (int64_t p = 0; p < n_pools; ++p) {
    const reference::PoolEntry entry = reference::read_pool(plan, state, request, p);
    double sum = 0;
    for (int h = 0; h < plan.heads; ++h) {
      double dot = 0;
      for (int d = 0; d < kDim; ++d) {
        dot += double(num::e4m3_to_float(q[h * kDim + d])) * num::e4m3_to_float(entry.codes[d]);
      }
      sum += double(w[h]) * std::max(dot, 0.0);
      (*magnitude)[p] += std::fabs(double(w[h]) * std::max(dot, 0.0)) * entry.scale;
    }
    logits[p] = sum * entry.scale;
  }
  return logits;
}

// Random codes (no NaN) and power-of-two scales in every page.
void fill_random_pools(HostState& state, std::mt19937_64& rng) {
  const int64_t per_page = indexer_pools_per_page(state.plan);
  std::uniform_int_distribution<int> code(0, 255), exponent(-10, -4);
  for (int64_t b = 0; b < state.view.blocks; ++b) {
    uint8_t* page = &state.k_cache[b * state.view.page_stride];
    for (int64_t i = 0; i < per_page * kDim; ++i) {
      int c = code(rng);
      page[i] = static_cast<uint8_t>((c & 0x7F) == 0x7F ? c - 1 : c);
    }
    for (int64_t e = 0; e < per_page; ++e) {
      const float scale = pow2(exponent(rng));
      std::memcpy(page + per_page * kDim + e * 4, &scale, 4);
    }
  }
}

// One request's 256 pools of random codes and scales (one page of 64 pools
// each), and one token's quantized q and folded head weights.
struct OneTokenPools {
  static constexpr int64_t n_pools = 4 * 64;
  IndexerPlan plan;
  HostState state;
  std::vector<uint8_t> q = std::vector<uint8_t>(kHeads * kDim);
  std::vector<float> w = std::vector<float>(kHeads);

  static IndexerPlan make_plan() {
    IndexerPlan p;
    p.block_size = 256;
    return p;
  }
  explicit OneTokenPools(std::mt19937_64& rng) : plan(make_plan()), state(plan, 1, 4, rng) {
    fill_random_pools(state, rng);
    const StepInputs step = random_step({0}, {0}, rng);
    for (int h = 0; h < kHeads; ++h) {
      w[h] = fold_head_weight(step.head_weights[h], hadamard_quantize(&step.index_q[h * kDim], &q[h * kDim]), kIndexerHeads);
    }
  }
};

TEST(IndexerReference, LogitsMatchFloat64) {
  std::mt19937_64 rng(testing::test_seed());
  const OneTokenPools token(rng);
  constexpr int64_t kPools = OneTokenPools::n_pools;
  const std::vector<float> logits =
      reference::indexer_logits(token.plan, token.state.view, 0, kPools, token.q.data(), token.w.data());
  std::vector<double> magnitude;
  const std::vector<double> exact =
      float64_logits(token.plan, token.state.view, 0, kPools, token.q.data(), token.w.data(), &magnitude);
  int positive = 0;
  for (int64_t p = 0; p < kPools; ++p) {
    // One rounding per head dot and per fma of 32 terms: well inside 64 FP32 ulp of the magnitude.
    EXPECT_NEAR(logits[p], exact[p], 64 * std::ldexp(magnitude[p], -24)) << "pool " << p;
    positive += logits[p] > 0;
  }
  EXPECT_GT(positive, 0);
  EXPECT_LT(positive, kPools);
}

// reference::indexer_logit_bounds, the bound the GPU's FP32-accumulated
// logits are held to (through reference::indexer_logit_deviation): FP32 sums
// of the head dots in two orders (serial, and eight blocks of 16 products as
// the MMA's k steps) stay well inside it, while the error of a wrong fragment
// layout (two dims of q swapped) does not.
TEST(IndexerReference, LogitBoundsCoverFp32AccumulationAndCatchAWrongLayout) {
  std::mt19937_64 rng(testing::test_seed());
  const OneTokenPools token(rng);
  constexpr int64_t kPools = OneTokenPools::n_pools;
  const std::vector<double> bounds =
      reference::indexer_logit_bounds(token.plan, token.state.view, 0, kPools, token.q.data(), token.w.data());
  for (int64_t p = 0; p < kPools; ++p) ASSERT_GT(bounds[p], 0.0) << "pool " << p;
  // How far `logits` lie from the exact ones, against the bounds.
  const auto deviation = [&](const std::vector<float>& logits) {
    return reference::indexer_logit_deviation(token.plan, token.state.view, 0, kPools, token.q.data(), token.w.data(),
                                              logits.data());
  };
  // The logits with each head dot summed in FP32 by `dot`, then the reference's chain.
  const auto logits_with = [&](auto dot) {
    std::vector<float> logits(kPools);
    for (int64_t p = 0; p < kPools; ++p) {
      const reference::PoolEntry entry = reference::read_pool(token.plan, token.state.view, 0, p);
      float sum = 0.0f;
      for (int h = 0; h < kHeads; ++h)
        sum = std::fma(token.w[h], std::fmax(dot(&token.q[h * kDim], entry.codes), 0.0f), sum);
      logits[p] = sum * entry.scale;
    }
    return logits;
  };
  const auto value = [](uint8_t code) { return num::e4m3_to_float(code); };
  const std::vector<float> serial = logits_with([&](const uint8_t* a, const uint8_t* b) {
    float sum = 0.0f;
    for (int i = 0; i < kDim; ++i) sum += value(a[i]) * value(b[i]);
    return sum;
  });
  const std::vector<float> blocked = logits_with([&](const uint8_t* a, const uint8_t* b) {
    float sum = 0.0f;
    for (int step = 0; step < kDim / 16; ++step) {
      double block = 0;  // 16 exact products, one rounding into the accumulator
      for (int i = 16 * step; i < 16 * step + 16; ++i) block += double(value(a[i])) * value(b[i]);
      sum = static_cast<float>(double(sum) + block);
    }
    return sum;
  });
  const std::vector<float> swapped = logits_with([&](const uint8_t* a, const uint8_t* b) {
    float sum = 0.0f;
    for (int i = 0; i < kDim; ++i) sum += value(a[i ^ 1]) * value(b[i]);
    return sum;
  });
  EXPECT_LT(deviation(serial).worst, 0.1);
  EXPECT_LT(deviation(blocked).worst, 0.1);
  EXPECT_GT(deviation(swapped).outside, kPools * 9 / 10);
}

// indexer_select_on_logits over the reference's own logits gives indexer_select's
// rows; logits of the wrong length are rejected with the token named.
TEST(IndexerReference, SelectOnLogitsFollowsTheGivenLogits) {
  std::mt19937_64 rng(testing::test_seed());
  IndexerPlan plan;
  plan.block_size = 256;
  plan.max_context = 8192 + 3;
  const std::vector<int64_t> positions = {8192 + 1, 100, 4096 + 2};
  const std::vector<int32_t> requests = {0, 1, 2};
  HostState state(plan, 3, plan.max_context / 256 + 1, rng);
  fill_random_pools(state, rng);
  const StepInputs step = random_step(positions, requests, rng);
  LayerParams params(rng);
  reference::IndexerQueryHost query;
  int64_t errors = -1;
  DSA_ASSERT_OK(reference::indexer_prepare(plan, step.view(), params.view, state.view, &query, &errors));
  reference::IndexerRowsHost expected, got;
  DSA_ASSERT_OK(reference::indexer_select(plan, step.view(), query, state.view, &expected));
  std::vector<std::vector<float>> logits(3);
  for (int t : {0, 2}) {
    logits[t] = reference::indexer_logits(plan, state.view, t, (positions[t] + 1) / 4, &query.q_fp8[t * kHeads * kDim],
                                          &query.head_weights[t * kHeads]);
  }
  DSA_ASSERT_OK(reference::indexer_select_on_logits(plan, step.view(), logits, state.view, &got));
  EXPECT_EQ(got.topk_positions, expected.topk_positions);
  EXPECT_EQ(got.slots, expected.slots);
  // Raising the logit of a pool the exact selection left out puts it in the rows.
  int32_t left_out = 0;
  while (std::binary_search(expected.topk_positions.begin(), expected.topk_positions.begin() + kIndexerPooledColumns,
                            4 * left_out)) {
    ++left_out;
  }
  logits[0][left_out] = std::numeric_limits<float>::max();
  DSA_ASSERT_OK(reference::indexer_select_on_logits(plan, step.view(), logits, state.view, &got));
  EXPECT_TRUE(
      std::binary_search(got.topk_positions.begin(), got.topk_positions.begin() + kIndexerPooledColumns, 4 * left_out));
  logits[2].pop_back();
  expect_rejected(reference::indexer_select_on_logits(plan, step.view(), logits, state.view, &got), "logits[2]",
                  "1024 pools");
  logits.pop_back();
  expect_rejected(reference::indexer_select_on_logits(plan, step.view(), logits, state.view, &got), "logits", "3 rows");
}

using testing::every_shape;
using testing::shape_name;

TEST(IndexerChecks, ShapeFunctionsFollowThePlan) {
  const IndexerPlan glm5next;
  EXPECT_EQ(indexer_row_width(glm5next), kIndexerRowWidth);
  EXPECT_EQ(indexer_top_pools(glm5next), kIndexerTopPools);
  EXPECT_EQ(indexer_page_bytes(glm5next), 64 * 132);
  EXPECT_EQ(indexer_tokens_per_request(glm5next), 1);
  for (const IndexerPlan& plan : every_shape()) {
    const std::string where = shape_name(plan);
    EXPECT_TRUE(check_indexer_plan(plan).ok()) << where << ": " << check_indexer_plan(plan).to_string();
    const int width = indexer_row_width(plan);
    EXPECT_EQ(width % 128, 0) << where;
    EXPECT_GE(width, plan.topk + plan.pool - 1) << where;  // every tail token has a column
    EXPECT_LT(width - 128, plan.topk + plan.pool - 1) << where;
    EXPECT_EQ(indexer_top_pools(plan) * plan.pool, plan.topk) << where;
    EXPECT_EQ(indexer_pools_per_page(plan), 256 / plan.pool) << where;
    EXPECT_EQ(indexer_page_bytes(plan) % 16, 0) << where;
    const IndexerWorkspaceLayout layout = indexer_workspace_layout(plan);
    EXPECT_EQ(layout.head_weights, plan.max_tokens * plan.heads * kDim) << where;
    EXPECT_EQ(layout.logits_stride, (plan.max_context + plan.pool - 1) / plan.pool) << where;
  }
  IndexerPlan pools16;
  pools16.pool = 16;
  pools16.topk = 2048;
  EXPECT_EQ(indexer_row_width(pools16), 2176);  // 2048 + 15 tail columns
  pools16.topk = 512;
  EXPECT_EQ(indexer_row_width(pools16), 640);
  EXPECT_EQ(indexer_ring_for(4, 1), 4);
  EXPECT_EQ(indexer_ring_for(4, 4), 8);  // 3 before + 4
  EXPECT_EQ(indexer_ring_for(16, 4), 32);
  EXPECT_EQ(indexer_ring_for(4, 6), 0);
  pools16.ring = indexer_ring_for(16, 4);
  EXPECT_TRUE(check_indexer_plan(pools16).ok());
  EXPECT_EQ(indexer_tokens_per_request(pools16), 17);
}

// The state as the kernels address it (make_indexer_state_params, shared by
// prepare, prefill, select and remap) follows the plan at every shape: P =
// block_size / S pools a page (the scales at byte 128 P of a page), RING
// slots, and positions below the table's reach. A P of block_size / 4 at S =
// 8 or 16 put the scales and codes past the page (and past the K cache).
TEST(IndexerChecks, KernelStateParamsFollowThePlan) {
  for (IndexerPlan plan : every_shape()) {
    for (int block_size : {128, 256, 512}) {
      for (int ring : {plan.pool, 2 * plan.pool}) {
        plan.block_size = block_size;
        plan.ring = ring;
        const std::string where = shape_name(plan) + " block " + std::to_string(block_size) + " RING " +
                                  std::to_string(ring);
        ASSERT_TRUE(check_indexer_plan(plan).ok()) << where;
        const int64_t page_bytes = indexer_page_bytes(plan);
        IndexerState state;
        state.block_table = make_tensor(fake_device_pointer(0x10000), DType::kI32, {3, 7});
        state.ring = make_tensor(fake_device_pointer(0x20000), DType::kBF16, {3, 2, ring, kDim});
        state.k_cache = make_strided(fake_device_pointer(0x30000), DType::kU8, {21, page_bytes}, {page_bytes + 16, 1});
        const IndexerStateParams s = make_indexer_state_params(plan, state);
        EXPECT_EQ(s.pools_per_page, block_size / plan.pool) << where;
        EXPECT_EQ(int64_t(s.pools_per_page) * kIndexerPoolBytes, page_bytes) << where;  // codes then scales fill the page
        EXPECT_EQ(s.block_size, block_size) << where;
        EXPECT_EQ(s.ring_size, ring) << where;
        EXPECT_EQ(s.page_stride, page_bytes + 16) << where;
        EXPECT_EQ(s.blocks, 21) << where;
        EXPECT_EQ(s.position_limit, std::min<int64_t>(plan.max_context, 7 * block_size)) << where;
      }
    }
  }
}

TEST(IndexerReference, RowsForShortContexts) {
  for (const IndexerPlan& plan : every_shape()) {
    const int width = indexer_row_width(plan);
    std::vector<int32_t> row(width);
    for (int64_t context : {int64_t(1), int64_t(5), int64_t(plan.topk) - 1, int64_t(plan.topk)}) {
      reference::expand_row(plan, context, {}, row.data());
      for (int c = 0; c < width; ++c) {
        ASSERT_EQ(row[c], c < context ? c : -1) << shape_name(plan) << " L " << context << " column " << c;
      }
    }
  }
}

// Just past top-k (L in K + 1 .. K + S - 1) every complete pool is chosen and
// the incomplete pool's tokens are the tail: the row is 0..L-1 in order, the
// pooled columns first.
TEST(IndexerReference, TailFollowsThePooledColumns) {
  for (const IndexerPlan& plan : every_shape()) {
    const int width = indexer_row_width(plan), top = indexer_top_pools(plan);
    std::vector<int32_t> all_pools(top), row(width);
    std::iota(all_pools.begin(), all_pools.end(), 0);
    for (int64_t context = plan.topk + 1; context < plan.topk + plan.pool; ++context) {
      reference::expand_row(plan, context, all_pools, row.data());
      for (int c = 0; c < width; ++c) {
        ASSERT_EQ(row[c], c < context ? c : -1) << shape_name(plan) << " L " << context << " column " << c;
      }
    }
    // Far past top-k: the tail tokens of L = S n + j start at column K.
    std::vector<int32_t> chosen(top);
    for (int i = 0; i < top; ++i) chosen[i] = 3 * i + 1;
    const int64_t n = 3 * top + 7;
    for (int j = 0; j < plan.pool; ++j) {
      const int64_t context = plan.pool * n + j;
      reference::expand_row(plan, context, chosen, row.data());
      for (int i = 0; i < top; ++i) {
        for (int e = 0; e < plan.pool; ++e) ASSERT_EQ(row[i * plan.pool + e], chosen[i] * plan.pool + e);
      }
      for (int c = plan.topk; c < width; ++c) {
        ASSERT_EQ(row[c], c - plan.topk < j ? plan.pool * n + (c - plan.topk) : -1)
            << shape_name(plan) << " L " << context << " column " << c;
      }
    }
  }
}

// A step at long contexts through prepare and select, checked against an
// independent float64 top-k: the chosen set equals it except for pools whose
// float64 logit is within the reference's rounding of the (K / S)th.
void check_long_context_rows(IndexerPlan plan, int m, int64_t context, std::mt19937_64& rng) {
  plan.block_size = 256;
  plan.max_context = context + m;
  plan.ring = indexer_ring_for(plan.pool, 1);
  const int S = plan.pool, width_columns = indexer_row_width(plan), top = indexer_top_pools(plan);
  const int64_t width = (context + m + plan.block_size - 1) / plan.block_size;
  HostState state(plan, m, width, rng);
  fill_random_pools(state, rng);
  std::vector<int64_t> positions(m);
  std::vector<int32_t> requests(m);
  for (int t = 0; t < m; ++t) {  // consecutive L, and one padding token when m > 1
    positions[t] = context - 1 + t;
    requests[t] = m > 1 && t == m / 2 ? -1 : t;
  }
  const StepInputs step = random_step(positions, requests, rng, plan.heads);
  LayerParams params(rng, S);
  reference::IndexerQueryHost query;
  int64_t errors = -1;
  DSA_ASSERT_OK(reference::indexer_prepare(plan, step.view(), params.view, state.view, &query, &errors));
  reference::IndexerRowsHost rows;
  DSA_ASSERT_OK(reference::indexer_select(plan, step.view(), query, state.view, &rows));
  EXPECT_EQ(rows.errors, 0);
  ASSERT_EQ(rows.topk_positions.size(), size_t(m) * width_columns);
  for (int t = 0; t < m; ++t) {
    const std::string where = shape_name(plan) + " m " + std::to_string(m) + " token " + std::to_string(t);
    const int32_t* row = &rows.topk_positions[t * width_columns];
    const int32_t* slots = &rows.slots[t * width_columns];
    if (requests[t] < 0) {
      for (int c = 0; c < width_columns; ++c) ASSERT_EQ(row[c], -1) << where;
      for (int c = 0; c < width_columns; ++c) ASSERT_EQ(slots[c], -1) << where;
      continue;
    }
    const int64_t L = positions[t] + 1, n_pools = L / S;
    std::vector<int32_t> chosen;
    for (int i = 0; i < top; ++i) {
      const int32_t p = row[S * i] / S;
      for (int j = 0; j < S; ++j) ASSERT_EQ(row[S * i + j], S * p + j) << where << " column " << S * i + j;
      ASSERT_TRUE(chosen.empty() || chosen.back() < p) << where << ": pools in increasing order";
      chosen.push_back(p);
    }
    for (int64_t c = plan.topk; c < width_columns; ++c) {
      const int64_t tail = S * n_pools + (c - plan.topk);
      ASSERT_EQ(row[c], tail < L ? tail : -1) << where << " column " << c;
    }
    for (int c = 0; c < width_columns; ++c) {
      const int32_t expected =
          row[c] < 0 ? -1 : state.block_table[t * width + row[c] / 256] * 256 + row[c] % 256;
      ASSERT_EQ(slots[c], expected) << where << " column " << c;
    }
    std::vector<double> magnitude;
    const std::vector<double> exact =
        float64_logits(plan, state.view, t, n_pools, &query.q_fp8[size_t(t) * plan.heads * kDim],
                       &query.head_weights[size_t(t) * plan.heads], &magnitude);
    std::vector<double> sorted = exact;
    std::nth_element(sorted.begin(), sorted.begin() + (top - 1), sorted.end(), std::greater<double>());
    const double threshold = sorted[top - 1];
    int decided = 0;
    for (int64_t p = 0; p < n_pools; ++p) {
      const bool in = std::binary_search(chosen.begin(), chosen.end(), static_cast<int32_t>(p));
      const double tolerance = 2 * plan.heads * std::ldexp(magnitude[p], -24) + 1e-30;
      if (exact[p] > threshold + tolerance) {
        ASSERT_TRUE(in) << where << " pool " << p << " missing";
        ++decided;
      } else if (exact[p] < threshold - tolerance) {
        ASSERT_FALSE(in) << where << " pool " << p << " chosen";
        ++decided;
      }
    }
    EXPECT_GT(decided, n_pools * 9 / 10) << where << ": the float64 selection decides most pools";
  }
}

TEST(IndexerReference, RowsForLongContexts) {
  std::mt19937_64 rng(testing::test_seed());
  const IndexerPlan glm5next;
  check_long_context_rows(glm5next, 16, 4096 + 3, rng);
  check_long_context_rows(glm5next, 4, 32768 + 1, rng);
  check_long_context_rows(glm5next, 1, 131072 + 2, rng);
  check_long_context_rows(glm5next, 1, 2049, rng);  // exactly 512 pools: all chosen, one tail token
}

// Every shape's pooled selection equals a brute-force float64 top K / S over
// its pools, with the tail and the row layout the plan gives.
TEST(IndexerReference, PooledSelectionMatchesFloat64AtEveryShape) {
  std::mt19937_64 rng(testing::test_seed());
  for (const IndexerPlan& plan : every_shape()) {
    // Three tokens at L = 3K + 1 .. 3K + 3: several tail lengths, n about 3 K / S pools.
    check_long_context_rows(plan, 3, 3 * int64_t(plan.topk) + 1, rng);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace dsa
