// Sparse MLA decode attention: argument checks, the split plans and the float64
// reference's edge cases (CPU), and the kernels (sparse_mla_simple, sparse_mla
// - the 64-head wgmma kernel when H is a multiple of 64 - and the 8-head
// sparse_mla_mma) against the reference, guard bands, determinism, batch
// invariance and graph capture (SparseMlaGpu).
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "baselines.h"
#include "core/async_copy.cuh"
#include "core/wgmma.cuh"
#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla.h"
#include "sparse_mla/sparse_mla_plan.h"
#include "sparse_mla/sparse_mla_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

constexpr int L = kSparseMlaLatent;
constexpr uint8_t kCodeOne = 0x38;  // e4m3 1.0
constexpr uint8_t kCodeNaN = 0x7F;
const float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------
// Argument checks (no GPU needed: the views' pointers are never dereferenced).

// Region r of a fake address space (regions 4 GiB apart, so no views overlap);
// the checks never dereference these.
void* fake_device_pointer(uintptr_t region) { return reinterpret_cast<void*>(region << 16); }

// Valid views of glm5next at TP1 (H = 64, K = 2176), m = 4; each test breaks one thing.
struct FakeArgs {
  int64_t m = 4, heads = 64, top_k = 2176;
  SparseMlaArgs args;
  FakeArgs() {
    args.q = make_tensor(fake_device_pointer(0x10000), DType::kFP8E4M3, {m, heads, L});
    args.q_scale = make_tensor(fake_device_pointer(0x20000), DType::kF32, {1});
    args.kv_cache = make_tensor(fake_device_pointer(0x30000), DType::kFP8E4M3, {100, 256, L});
    args.k_scale = make_tensor(fake_device_pointer(0x40000), DType::kF32, {1});
    args.indices = make_tensor(fake_device_pointer(0x50000), DType::kI32, {m, top_k});
    args.softmax_scale = 0.0625f;
    args.latent = make_tensor(fake_device_pointer(0x60000), DType::kBF16, {m, heads, L});
    args.lse = make_tensor(fake_device_pointer(0x70000), DType::kF32, {m, heads});
    args.split_counters = make_tensor(fake_device_pointer(0x80000), DType::kI32,
                                      {sparse_mla_split_counter_count(m, heads, top_k)});
    // At least one value, so that a view given when none is needed is still checked.
    args.split_partials = make_tensor(fake_device_pointer(0x1000000), DType::kF32,
                                      {std::max<int64_t>(1024, sparse_mla_split_partials_count(m, heads, top_k))});
  }
};

// check_sparse_mla(a) is an invalid-argument error naming `argument` and holding `words`.
void expect_rejected(const SparseMlaArgs& a, const std::string& argument, const std::string& words) {
  testing::expect_rejected(check_sparse_mla(a), argument, words);
}

TEST(SparseMlaChecks, AcceptsGlm5NextShapesAndTheLimits) {
  FakeArgs f;
  EXPECT_TRUE(check_sparse_mla(f.args).ok()) << check_sparse_mla(f.args).to_string();
  // Limits: one token, one head, one entry; 128 heads; the widest K; a padded cache block.
  FakeArgs small;
  small.args.q = make_tensor(fake_device_pointer(0x10000), DType::kFP8E4M3, {1, 1, L});
  small.args.indices = make_tensor(fake_device_pointer(0x50000), DType::kI32, {1, 1});
  small.args.latent = make_tensor(fake_device_pointer(0x60000), DType::kBF16, {1, 1, L});
  small.args.lse = make_tensor(fake_device_pointer(0x70000), DType::kF32, {1, 1});
  EXPECT_TRUE(check_sparse_mla(small.args).ok()) << check_sparse_mla(small.args).to_string();
  FakeArgs wide;
  wide.args.q.shape[1] = kSparseMlaMaxHeads;
  wide.args.q.strides[0] = kSparseMlaMaxHeads * L;
  wide.args.latent = make_tensor(fake_device_pointer(0x60000), DType::kBF16, {4, kSparseMlaMaxHeads, L});
  wide.args.lse = make_tensor(fake_device_pointer(0x70000), DType::kF32, {4, kSparseMlaMaxHeads});
  wide.args.indices = make_tensor(fake_device_pointer(0x50000), DType::kI32, {4, kSparseMlaMaxTopK});
  wide.args.split_counters.shape[0] = sparse_mla_split_counter_count(4, kSparseMlaMaxHeads, kSparseMlaMaxTopK);
  wide.args.split_partials.shape[0] = sparse_mla_split_partials_count(4, kSparseMlaMaxHeads, kSparseMlaMaxTopK);
  wide.args.kv_cache = make_strided(fake_device_pointer(0x30000), DType::kFP8E4M3, {100, 256, L},
                                    {256 * 528 + 64, 528, 1});
  EXPECT_TRUE(check_sparse_mla(wide.args).ok()) << check_sparse_mla(wide.args).to_string();
}

TEST(SparseMlaChecks, NamesEachBadArgument) {
  auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f.args);
    expect_rejected(f.args, argument, words);
  };
  rejected([](SparseMlaArgs& a) { a.q.dtype = DType::kBF16; }, "q", "fp8_e4m3");
  rejected([](SparseMlaArgs& a) { a.q.shape[2] = 576; }, "q", "shape [*, *, 512]");
  rejected([](SparseMlaArgs& a) { a.q.shape[1] = 129; }, "q", "1..128 heads");
  rejected([](SparseMlaArgs& a) { a.q.shape[1] = 0; }, "q", "1..128 heads");
  rejected([](SparseMlaArgs& a) { a.q.shape[0] = 0; }, "q", "1..65535 tokens");
  rejected([](SparseMlaArgs& a) { a.q.strides[1] = 520; }, "q", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.q.strides[2] = 2; }, "q", "stride 1 in dim 2");
  rejected([](SparseMlaArgs& a) { a.q.data = static_cast<char*>(fake_device_pointer(0x10000)) + 0x0008; }, "q", "aligned to 16");
  rejected([](SparseMlaArgs& a) { a.q.device.kind = DeviceKind::kCPU; }, "q", "a CUDA tensor");
  rejected([](SparseMlaArgs& a) { a.q_scale = TensorView{}; }, "q_scale", "null");
  rejected([](SparseMlaArgs& a) { a.q_scale.shape[0] = 2; }, "q_scale", "shape [1]");
  rejected([](SparseMlaArgs& a) { a.kv_cache.dtype = DType::kU8; }, "kv_cache", "fp8_e4m3");
  rejected([](SparseMlaArgs& a) { a.kv_cache.shape[2] = 576; }, "kv_cache", "shape [*, *, 512]");
  rejected([](SparseMlaArgs& a) { a.kv_cache.strides[1] = 520; }, "kv_cache", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.kv_cache.strides[0] = 255 * 512; }, "kv_cache", "do not overlap");
  rejected([](SparseMlaArgs& a) { a.kv_cache.shape[1] = 2; a.kv_cache.strides[1] = int64_t{1} << 62; }, "kv_cache",
           "do not overlap");  // 2 x 2^62 wrapped past the overlap test
  rejected([](SparseMlaArgs& a) { a.kv_cache.shape[1] = 0; }, "kv_cache", "at least one block");
  rejected([](SparseMlaArgs& a) { a.kv_cache.data = static_cast<char*>(fake_device_pointer(0x30000)) + 0x0008; }, "kv_cache", "aligned to 16");
  rejected([](SparseMlaArgs& a) { a.k_scale.dtype = DType::kBF16; }, "k_scale", "f32");
  rejected([](SparseMlaArgs& a) { a.indices.dtype = DType::kI64; }, "indices", "i32");
  rejected([](SparseMlaArgs& a) { a.indices.shape[0] = 3; }, "indices", "shape [4, *]");
  rejected([](SparseMlaArgs& a) { a.indices.shape[1] = kSparseMlaMaxTopK + 1; }, "indices", "1..16384 entries");
  rejected([](SparseMlaArgs& a) { a.indices.strides[1] = 2; }, "indices", "stride 1 in dim 1");
  rejected([](SparseMlaArgs& a) { a.indices.strides[0] = 2000; }, "indices", "token stride of at least K");
  rejected([](SparseMlaArgs& a) { a.softmax_scale = 0.0f; }, "softmax_scale", "finite value > 0");
  rejected([](SparseMlaArgs& a) { a.softmax_scale = -1.0f; }, "softmax_scale", "finite value > 0");
  rejected([](SparseMlaArgs& a) { a.softmax_scale = kInf; }, "softmax_scale", "finite value > 0");
  rejected([](SparseMlaArgs& a) { a.softmax_scale = std::nanf(""); }, "softmax_scale", "finite value > 0");
  rejected([](SparseMlaArgs& a) { a.latent.dtype = DType::kF32; }, "latent", "bf16");
  rejected([](SparseMlaArgs& a) { a.latent.shape[1] = 8; }, "latent", "shape [4, 64, 512]");
  rejected([](SparseMlaArgs& a) { a.latent.strides[1] = 520; }, "latent", "stride 512 in dim 1");
  rejected([](SparseMlaArgs& a) { a.latent.strides[0] = 64 * 512 + 4; }, "latent", "multiple of 8");
  rejected([](SparseMlaArgs& a) { a.latent.data = static_cast<char*>(fake_device_pointer(0x60000)) + 0x0008; }, "latent", "aligned to 16");
  rejected([](SparseMlaArgs& a) { a.latent.data = a.kv_cache.data; }, "latent", "disjoint from 'kv_cache'");
  rejected([](SparseMlaArgs& a) { a.lse.data = a.indices.data; }, "lse", "disjoint from 'indices'");
  rejected([](SparseMlaArgs& a) { a.split_counters.data = a.lse.data; }, "lse", "disjoint from 'split_counters'");
  rejected([](SparseMlaArgs& a) { a.q_scale.data = static_cast<char*>(a.q_scale.data) + 2; }, "q_scale", "aligned to 4");
  rejected([](SparseMlaArgs& a) { a.lse.shape[1] = 63; }, "lse", "shape [4, 64]");
  rejected([](SparseMlaArgs& a) { a.lse.strides[0] = 65; }, "lse", "contiguous");
  rejected([](SparseMlaArgs& a) { a.split_counters = TensorView{}; }, "split_counters", "null");
  rejected([](SparseMlaArgs& a) { a.split_counters.dtype = DType::kU8; }, "split_counters", "i32");
  rejected([](SparseMlaArgs& a) { a.split_counters.shape[0] -= 1; }, "split_counters", "at least");
  rejected([](SparseMlaArgs& a) { a.split_partials.dtype = DType::kBF16; }, "split_partials", "f32");
  rejected([](SparseMlaArgs& a) { a.split_partials.data = static_cast<char*>(a.split_partials.data) + 4; },
           "split_partials", "aligned to 16");
  rejected([](SparseMlaArgs& a) { a.split_partials.data = a.latent.data; }, "latent", "disjoint from 'split_partials'");
  rejected(
      [](SparseMlaArgs& a) {
        a.error_count = reinterpret_cast<unsigned int*>(static_cast<char*>(fake_device_pointer(0x90000)) + 2);
      },
      "error_count", "4-byte aligned");
  rejected([](SparseMlaArgs& a) { a.plan = static_cast<SparseMlaPlan>(2); }, "plan", "kBatchInvariant (1)");
  // Strides that overlap rows or heads although multiples of 16, views off the
  // device, and the counters' layout.
  rejected([](SparseMlaArgs& a) { a.q.strides[1] = 496; }, "q", "do not overlap");
  rejected([](SparseMlaArgs& a) { a.q.strides[0] = 63 * 512; }, "q", "do not overlap");
  rejected([](SparseMlaArgs& a) { a.q.strides[0] = 64 * 512 + 8; }, "q", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.kv_cache.strides[1] = 496; }, "kv_cache", "do not overlap");
  rejected([](SparseMlaArgs& a) { a.kv_cache.device.kind = DeviceKind::kCPU; }, "kv_cache", "a CUDA tensor");
  rejected([](SparseMlaArgs& a) { a.q_scale.device.kind = DeviceKind::kCPU; }, "q_scale", "a CUDA tensor");
  rejected([](SparseMlaArgs& a) { a.k_scale.shape[0] = 2; }, "k_scale", "shape [1]");
  rejected([](SparseMlaArgs& a) { a.indices.device.kind = DeviceKind::kCPU; }, "indices", "a CUDA tensor");
  rejected([](SparseMlaArgs& a) { a.indices.shape[1] = 0; }, "indices", "1..16384 entries");
  rejected([](SparseMlaArgs& a) { a.indices.data = static_cast<char*>(a.indices.data) + 2; }, "indices",
           "aligned to 4");
  rejected([](SparseMlaArgs& a) { a.lse.dtype = DType::kBF16; }, "lse", "f32");
  rejected([](SparseMlaArgs& a) { a.lse.device.kind = DeviceKind::kCPU; }, "lse", "a CUDA tensor");
  rejected([](SparseMlaArgs& a) { a.split_counters.strides[0] = 2; }, "split_counters", "a contiguous vector");
  rejected([](SparseMlaArgs& a) { a.split_counters.data = static_cast<char*>(a.split_counters.data) + 2; },
           "split_counters", "aligned to 4");
}

// A size-1 dimension's stride is never used (tensor.h): one token, one head,
// one entry, one cache block or blocks of one entry take any; where the
// dimension is stepped, the same stride is refused.
TEST(SparseMlaChecks, SizeOneDimensionsTakeAnyStride) {
  FakeArgs small;
  small.args.q = make_strided(fake_device_pointer(0x10000), DType::kFP8E4M3, {1, 1, L}, {3, 3, 1});
  small.args.indices = make_strided(fake_device_pointer(0x50000), DType::kI32, {1, 1}, {3, 3});
  small.args.latent = make_strided(fake_device_pointer(0x60000), DType::kBF16, {1, 1, L}, {3, 3, 1});
  small.args.lse = make_strided(fake_device_pointer(0x70000), DType::kF32, {1, 1}, {3, 3});
  small.args.split_counters = make_strided(fake_device_pointer(0x80000), DType::kI32, {1}, {3});
  small.args.kv_cache = make_strided(fake_device_pointer(0x30000), DType::kFP8E4M3, {1, 256, L}, {3, L, 1});
  EXPECT_TRUE(check_sparse_mla(small.args).ok()) << check_sparse_mla(small.args).to_string();
  small.args.kv_cache = make_strided(fake_device_pointer(0x30000), DType::kFP8E4M3, {100, 1, L}, {L, 3, 1});
  EXPECT_TRUE(check_sparse_mla(small.args).ok()) << check_sparse_mla(small.args).to_string();

  const auto rejected = [](auto&& breaks, const std::string& argument, const std::string& words) {
    FakeArgs f;
    breaks(f.args);
    expect_rejected(f.args, argument, words);
  };
  rejected([](SparseMlaArgs& a) { a.q.strides[0] = 3; }, "q", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.q.strides[1] = 3; }, "q", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.kv_cache.strides[0] = 3; }, "kv_cache", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.kv_cache.strides[1] = 3; }, "kv_cache", "multiples of 16");
  rejected([](SparseMlaArgs& a) { a.split_counters.strides[0] = 3; }, "split_counters", "a contiguous vector");
}

// The 64-head kernel needs split_partials (a short or missing view is
// refused); the 8-head kernel does not (the view may be empty), but a view
// that is given is still checked.
TEST(SparseMlaChecks, SplitPartialsAreCheckedWhereTheKernelNeedsThem) {
  const int64_t needed = sparse_mla_split_partials_count(4, 64, 2176);
  ASSERT_GT(needed, 0);
  FakeArgs short_view;
  short_view.args.split_partials.shape[0] = needed - 1;
  testing::expect_rejected(check_sparse_mla(short_view.args), "split_partials", "at least");
  short_view.args.split_partials = TensorView{};
  testing::expect_rejected(check_sparse_mla(short_view.args), "split_partials", "null");

  FakeArgs eight;  // H = 8
  eight.args.q = make_tensor(eight.args.q.data, DType::kFP8E4M3, {4, 8, L});
  eight.args.latent = make_tensor(eight.args.latent.data, DType::kBF16, {4, 8, L});
  eight.args.lse = make_tensor(eight.args.lse.data, DType::kF32, {4, 8});
  ASSERT_EQ(sparse_mla_split_partials_count(4, 8, 2176), 0);
  EXPECT_TRUE(check_sparse_mla(eight.args).ok()) << check_sparse_mla(eight.args).to_string();
  eight.args.split_partials = TensorView{};
  EXPECT_TRUE(check_sparse_mla(eight.args).ok()) << check_sparse_mla(eight.args).to_string();
  eight.args.split_partials = make_tensor(fake_device_pointer(0x1000000), DType::kI32, {16});
  testing::expect_rejected(check_sparse_mla(eight.args), "split_partials", "f32");
}

TEST(SparseMlaChecks, SplitCounterCountGrowsWithTokens) {
  for (int heads : {1, 8, 64, 128}) {
    for (int top_k : {1, 100, 2048, 2176, kSparseMlaMaxTopK}) {
      int64_t previous = 0;
      for (int m = 1; m <= 512; ++m) {
        const int64_t count = sparse_mla_split_counter_count(m, heads, top_k);
        EXPECT_GE(count, previous) << "H " << heads << " K " << top_k << " m " << m;
        EXPECT_GE(count, 1);
        previous = count;
      }
    }
  }
}

TEST(SparseMlaChecks, SplitPartialsCountGrowsWithTokens) {
  for (int heads : {1, 8, 64, 128}) {
    for (int top_k : {1, 100, 512, 513, 2048, 2176, kSparseMlaMaxTopK}) {
      int64_t previous = 0;
      for (int m = 1; m <= 512; ++m) {
        const int64_t count = sparse_mla_split_partials_count(m, heads, top_k);
        EXPECT_GE(count, previous) << "H " << heads << " K " << top_k << " m " << m;
        previous = count;
      }
    }
  }
  // glm5next TP1: per split 64 x 512 FP16 values and 2 x 64 statistics, per
  // cluster beyond one 64 x 512 FP32 sums and 2 x 64 statistics, per token.
  const SparseMlaWgmmaSplits plan = sparse_mla_wgmma_splits(2176);
  EXPECT_EQ(sparse_mla_split_partials_count(1, 64, 2176),
            plan.splits * (64 * 512 / 2 + 128) + (plan.clusters == 1 ? 0 : plan.clusters * (64 * 512 + 128)));
  EXPECT_EQ(sparse_mla_split_partials_count(3, 128, 2176), 6 * sparse_mla_split_partials_count(1, 64, 2176));
  EXPECT_EQ(sparse_mla_split_partials_count(1, 8, 2176), 0) << "the 8-head kernel combines in one cluster";
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

TEST(SparseMlaSplitPlan, CoversHeadsAndEntriesWithoutPaddingHeadsTo64) {
  for (int heads = 1; heads <= kSparseMlaMaxHeads; ++heads) {
    for (int top_k : {1, 63, 64, 65, 100, 511, 2048, 2176, 5000, kSparseMlaMaxTopK}) {
      const SparseMlaSplitPlan plan = sparse_mla_split_plan(heads, top_k);
      const SparseMlaSplitPlan throughput = sparse_mla_split_plan(heads, top_k, SparseMlaSplits::kThroughput);
      SCOPED_TRACE("H " + std::to_string(heads) + " K " + std::to_string(top_k));
      // kThroughput: half the splits, rounded up, where a CTA's entries allow it (K <= 8192); never more.
      EXPECT_LE(throughput.splits, plan.splits);
      EXPECT_LE(throughput.splits, std::max(4, ceil_div(top_k, kSparseMlaMaxTopK / 8)));
      if (top_k >= 449 && top_k <= 8192) EXPECT_EQ(throughput.splits, (plan.splits + 1) / 2);
      EXPECT_EQ(throughput.head_groups, plan.head_groups);
      EXPECT_EQ(throughput.rows_per_split % 64, 0);
      EXPECT_LE(throughput.rows_per_split, kSparseMlaMaxTopK / 8);
      EXPECT_GE(int64_t(throughput.splits) * throughput.rows_per_split, top_k);
      EXPECT_LT(int64_t(throughput.splits - 1) * throughput.rows_per_split, top_k);
      EXPECT_EQ(plan.head_groups, ceil_div(heads, 8));  // TP8 computes 8 heads, not vLLM's padded 64
      EXPECT_GE(plan.splits, 1);
      EXPECT_LE(plan.splits, kSparseMlaMaxSplits);
      EXPECT_EQ(plan.rows_per_split % 64, 0);
      EXPECT_LE(plan.rows_per_split, kSparseMlaMaxTopK / 8) << "more entries than a CTA stages";
      EXPECT_GE(int64_t(plan.splits) * plan.rows_per_split, top_k) << "entries left out";
      EXPECT_LT(int64_t(plan.splits - 1) * plan.rows_per_split, top_k) << "an empty split";
    }
  }
}

// kByBatch's plans for the 8-head kernel: most splits first, each a plan the
// launcher accepts (clusters of 9 at K = 576 and 1088, 12 at 2176).
TEST(SparseMlaSplitPlan, BatchPlansOfTheEightHeadKernelGoFromMostSplitsToFewest) {
  for (const int heads : {1, 8, 24, 120}) {
    for (int top_k : {1, 64, 65, 100, 576, 1024, 1088, 2048, 2176, 5000, kSparseMlaMaxTopK}) {
      SCOPED_TRACE("H " + std::to_string(heads) + " K " + std::to_string(top_k));
      const auto plans = sparse_mla_batch_split_plans(heads, top_k);
      const SparseMlaSplitPlan latency = sparse_mla_split_plan(heads, top_k);
      const SparseMlaSplitPlan throughput = sparse_mla_split_plan(heads, top_k, SparseMlaSplits::kThroughput);
      EXPECT_EQ(plans[1].splits, latency.splits);
      EXPECT_EQ(plans[1].rows_per_split, latency.rows_per_split);
      EXPECT_EQ(plans[2].splits, throughput.splits);
      EXPECT_EQ(plans[2].rows_per_split, throughput.rows_per_split);
      EXPECT_GE(plans[0].splits, plans[1].splits);
      EXPECT_GE(plans[1].splits, plans[2].splits);
      if (top_k == 2048) EXPECT_EQ(plans[0].splits, 16) << "two 64-entry chunks per CTA";
      for (const SparseMlaSplitPlan& plan : plans) {
        EXPECT_EQ(plan.head_groups, ceil_div(heads, 8));
        EXPECT_LE(plan.splits, kSparseMlaMaxSplits);
        EXPECT_EQ(plan.rows_per_split % 64, 0);
        EXPECT_LE(plan.rows_per_split, kSparseMlaMaxTopK / 8);
        EXPECT_GE(int64_t(plan.splits) * plan.rows_per_split, top_k) << "entries left out";
        EXPECT_LT(int64_t(plan.splits - 1) * plan.rows_per_split, top_k) << "an empty split";
      }
    }
  }
}

// Split s takes chunks [s C / splits, (s + 1) C / splits): every split has
// at least one chunk and at most max_chunks <= 16 when splits >= 16; the
// clusters have a power-of-two size <= max_cluster (their owners' units are
// whole heads) and there are at most 16 of them.
TEST(SparseMlaSplitPlan, WgmmaSplitsCoverEveryChunkInWholeHeadClusters) {
  for (const int max_cluster : {4, 8, 16}) {
    for (const int max_splits : {kSparseMlaWgmmaDefaultSplits, 8, 24, 32, kSparseMlaWgmmaMaxSplits}) {
      for (int top_k = 1; top_k <= kSparseMlaMaxTopK; top_k += top_k < 2200 ? 1 : 61) {
        const SparseMlaWgmmaSplits plan = sparse_mla_wgmma_splits(top_k, max_splits, max_cluster);
        SCOPED_TRACE("K " + std::to_string(top_k) + " max_splits " + std::to_string(max_splits) + " max_cluster " +
                     std::to_string(max_cluster));
        const int chunks = ceil_div(top_k, 64);
        ASSERT_GE(plan.splits, 1);
        ASSERT_LE(plan.splits, std::min(max_splits, chunks));
        ASSERT_LE(plan.cluster_size, max_cluster);
        ASSERT_EQ(plan.cluster_size & (plan.cluster_size - 1), 0) << "a power of two";
        ASSERT_EQ(plan.splits, plan.cluster_size * plan.clusters);
        ASSERT_LE(plan.clusters, 16);
        ASSERT_TRUE(plan.clusters == 1 || plan.cluster_size == max_cluster);
        ASSERT_EQ(plan.max_chunks, ceil_div(chunks, plan.splits));
        if (max_splits >= 16) ASSERT_LE(plan.max_chunks, 16) << "more entries than a CTA stages";
        for (int split = 0; split < plan.splits; ++split) {
          ASSERT_GT((split + 1) * chunks / plan.splits, split * chunks / plan.splits) << "an empty split";
        }
      }
    }
  }
  EXPECT_EQ(sparse_mla_wgmma_splits(2048, 16, 16).splits, 16);  // two chunks per CTA at the served K
  EXPECT_EQ(sparse_mla_wgmma_splits(2048, 16, 16).clusters, 1);
  EXPECT_EQ(sparse_mla_wgmma_splits(2048, 16, 8).clusters, 2);
  EXPECT_EQ(sparse_mla_wgmma_splits(2176, 16, 16).max_chunks, 3);  // 34 chunks: two or three per CTA
  EXPECT_EQ(sparse_mla_wgmma_splits(2048, 32, 8).clusters, 4);
  EXPECT_EQ(sparse_mla_wgmma_splits(300, 16, 16).splits, 4) << "5 chunks: the largest power of two below";
  EXPECT_EQ(sparse_mla_wgmma_splits(300, 16, 16).clusters, 1);
}

// kThroughput: half the 64-head kernel's splits while 8 cover K, and a plan
// the launcher accepts (at most 16 chunks per split) at every K.
TEST(SparseMlaSplitPlan, WgmmaThroughputSplitsHalveTheDefaultWhereTheyCoverK) {
  for (int top_k = 1; top_k <= kSparseMlaMaxTopK; top_k += top_k < 2200 ? 1 : 61) {
    SCOPED_TRACE("K " + std::to_string(top_k));
    EXPECT_EQ(sparse_mla_wgmma_max_splits(top_k, SparseMlaSplits::kLatency), kSparseMlaWgmmaDefaultSplits);
    const int max_splits = sparse_mla_wgmma_max_splits(top_k, SparseMlaSplits::kThroughput);
    EXPECT_EQ(max_splits, top_k <= 8192 ? kSparseMlaWgmmaDefaultSplits / 2 : kSparseMlaWgmmaDefaultSplits);
    EXPECT_LE(sparse_mla_wgmma_splits(top_k, max_splits).max_chunks, 16);
  }
}

// kByBatch: the most splits (from the default down) whose CTAs fit the GPU
// at once, never fewer than 2 nor than a CTA's 16 chunks allow.
TEST(SparseMlaSplitPlan, WgmmaBatchSplitsFitTheGpuAtOnce) {
  constexpr int kH200 = 132;  // resident CTAs: one per SM
  const int expected_k2048[][2] = {{1, 16}, {8, 16}, {9, 8}, {16, 8}, {17, 4}, {33, 4}, {34, 2}, {128, 2}, {4096, 2}};
  for (const auto& [items, splits] : expected_k2048) {
    EXPECT_EQ(sparse_mla_wgmma_batch_max_splits(2048, items, kH200), splits) << items << " items";
  }
  EXPECT_EQ(sparse_mla_wgmma_batch_max_splits(2176, 128, kH200), 4) << "34 chunks: 2 splits would take 17";
  EXPECT_EQ(sparse_mla_wgmma_batch_max_splits(kSparseMlaMaxTopK, 128, kH200), 16) << "256 chunks need 16";
  for (const int resident : {1, 66, kH200, 1000}) {
    for (int top_k = 1; top_k <= kSparseMlaMaxTopK; top_k += top_k < 2200 ? 7 : 509) {
      int previous = kSparseMlaWgmmaDefaultSplits;
      for (int64_t items = 1; items <= 300; ++items) {
        const int max_splits = sparse_mla_wgmma_batch_max_splits(top_k, items, resident);
        SCOPED_TRACE("K " + std::to_string(top_k) + " items " + std::to_string(items) + " resident " +
                     std::to_string(resident));
        ASSERT_LE(max_splits, previous) << "more splits for a larger batch";
        ASSERT_GE(max_splits, 2);
        ASSERT_LE(sparse_mla_wgmma_splits(top_k, max_splits).max_chunks, 16) << "a plan the launcher refuses";
        const bool fits = items * max_splits <= resident;
        const bool floor = max_splits == 2 || sparse_mla_wgmma_splits(top_k, max_splits / 2).max_chunks > 16;
        ASSERT_TRUE(fits || floor) << "could halve further";
        ASSERT_TRUE(max_splits == kSparseMlaWgmmaDefaultSplits || items * max_splits * 2 > resident)
            << "halved although twice the splits fit";
        previous = max_splits;
      }
    }
  }
}

// kByBatch takes the producer kernel where its rounds of whole rows cost
// less than the split plan's (a producer chunk 4/5 of a split CTA's).
TEST(SparseMlaSplitPlan, BatchTakesTheProducerWhereItsRoundsCostLess) {
  constexpr int kH200 = 132;  // both kernels: one CTA per SM
  auto takes = [](int top_k, int64_t items) {
    return sparse_mla_batch_takes_producer(top_k, items, sparse_mla_wgmma_batch_max_splits(top_k, items, kH200), kH200,
                                           kH200);
  };
  // K = 2048, 2 splits from 34 items: one round of 16 chunks up to 66 items,
  // two from 67 (against one of 32), three from 133 (two of 32), four from 199.
  const std::pair<int64_t, bool> expected_k2048[] = {{1, false},  {66, false},  {67, true},   {128, true},
                                                     {132, true}, {133, false}, {198, false}, {199, true},
                                                     {256, true}, {4096, true}};
  for (const auto& [items, producer] : expected_k2048) EXPECT_EQ(takes(2048, items), producer) << items << " items";
  EXPECT_TRUE(takes(128, 70)) << "2 chunks: two rounds of 1 chunk against one of 2";
  EXPECT_FALSE(takes(kSparseMlaProducerMaxTopK + 1, 4096)) << "beyond the producer's K";
  EXPECT_FALSE(sparse_mla_batch_takes_producer(2048, 128, 2, kH200, 0)) << "no producer CTA fits";
  // Row offsets are 32-bit multiples of 16 bytes, all ones meaning none.
  EXPECT_TRUE(sparse_mla_producer_covers(kSparseMlaProducerMaxTopK, (int64_t(1) << 36) - 17));
  EXPECT_FALSE(sparse_mla_producer_covers(2048, (int64_t(1) << 36) - 16));
  EXPECT_FALSE(sparse_mla_producer_covers(kSparseMlaProducerMaxTopK + 1, 1024));
}

TEST(SparseMlaChecks, WgmmaKernelTakesHeadsInSixtyFours) {
  FakeArgs f;  // H = 64
  f.args.q.shape[1] = 32;
  f.args.latent.shape[1] = 32;
  f.args.lse = make_tensor(f.args.lse.data, DType::kF32, {4, 32});
  ASSERT_TRUE(check_sparse_mla(f.args).ok()) << check_sparse_mla(f.args).to_string();
  testing::expect_rejected(sparse_mla_wgmma(f.args, SparseMlaSplits::kLatency, nullptr), "q", "a multiple of 64 heads");
}

TEST(SparseMlaChecks, ProducerKernelNamesWhatItCannotTake) {
  FakeArgs heads;  // H = 32
  heads.args.q.shape[1] = 32;
  heads.args.latent.shape[1] = 32;
  heads.args.lse = make_tensor(heads.args.lse.data, DType::kF32, {4, 32});
  testing::expect_rejected(sparse_mla_producer(heads.args, nullptr), "q", "a multiple of 64 heads");
  FakeArgs wide;  // K = 2305
  wide.args.indices = make_tensor(wide.args.indices.data, DType::kI32, {4, kSparseMlaProducerMaxTopK + 1});
  wide.args.split_counters.shape[0] = sparse_mla_split_counter_count(4, 64, kSparseMlaProducerMaxTopK + 1);
  testing::expect_rejected(sparse_mla_producer(wide.args, nullptr), "indices", "at most 2304 entries");
  // It needs no split_partials, but a view given is still checked.
  FakeArgs none;
  none.args.split_partials = TensorView();
  EXPECT_TRUE(check_sparse_mla_without_partials(none.args).ok())
      << check_sparse_mla_without_partials(none.args).to_string();
  EXPECT_FALSE(check_sparse_mla(none.args).ok()) << "sparse_mla needs split_partials";
  FakeArgs overlapping;
  overlapping.args.split_partials = make_tensor(overlapping.args.latent.data, DType::kF32, {1024});
  testing::expect_rejected(check_sparse_mla_without_partials(overlapping.args), "latent",
                           "memory disjoint from 'split_partials'");
}

TEST(SparseMlaChecks, WgmmaMaxSplitsIsCheckedAgainstK) {
  FakeArgs f;  // K = 2176: 34 chunks, 16 at most per CTA: 3 CTAs, in a plan of 4
  testing::expect_rejected(sparse_mla_wgmma_with_plan(f.args, 3, 16, nullptr), "max_splits", "at least 4");
  testing::expect_rejected(sparse_mla_wgmma_with_plan(f.args, 0, 16, nullptr), "max_splits", "1..64");
  testing::expect_rejected(sparse_mla_wgmma_with_plan(f.args, 65, 16, nullptr), "max_splits", "1..64");
  testing::expect_rejected(sparse_mla_wgmma_with_plan(f.args, 16, 2, nullptr), "max_cluster", "4, 8 or 16");
  EXPECT_EQ(sparse_mla_wgmma_splits(2176, 3).max_chunks, 17) << "the plan itself exceeds 16 chunks; the launcher refuses it";
  EXPECT_EQ(sparse_mla_wgmma_splits(0).splits, 1) << "K below the contract's range: one split, no division by zero";
  // A plan with more clusters than the default needs more partials than sparse_mla_split_partials_count.
  ASSERT_GT(sparse_mla_wgmma_partials_count(4, 64, 2176, 64, 4), sparse_mla_split_partials_count(4, 64, 2176));
  testing::expect_rejected(sparse_mla_wgmma_with_plan(f.args, 64, 4, nullptr), "split_partials", "at least");
  // A plan with fewer splits than the default needs fewer: its own count is
  // enough. Checked without launching: the views point at no memory, and on a
  // GPU a launch would fault (it once did, poisoning the later tests).
  const int64_t fewer = sparse_mla_wgmma_partials_count(4, 64, 2176, 8, 16);
  ASSERT_LT(fewer, sparse_mla_split_partials_count(4, 64, 2176));
  FakeArgs exact;
  exact.args.split_partials.shape[0] = fewer;
  EXPECT_TRUE(check_sparse_mla_for_plan(exact.args, 8, 16).ok()) << check_sparse_mla_for_plan(exact.args, 8, 16).to_string();
  testing::expect_rejected(check_sparse_mla(exact.args), "split_partials", "at least");
  exact.args.split_partials.shape[0] = fewer - 1;
  testing::expect_rejected(sparse_mla_wgmma_with_plan(exact.args, 8, 16, nullptr), "split_partials", "at least");
}

TEST(SparseMlaSplitPlan, BadPlansAreRejectedByName) {
  const FakeArgs f;  // H = 64, K = 2176
  const SparseMlaSplitPlan good = sparse_mla_split_plan(64, 2176);
  auto rejected = [&](auto&& breaks, const std::string& words) {
    SparseMlaSplitPlan plan = good;
    breaks(plan);
    testing::expect_rejected(sparse_mla_with_plan(f.args, plan, nullptr), "plan", words);
  };
  rejected([](SparseMlaSplitPlan& p) { p.head_groups -= 1; }, "head_groups = ceil(H / 8) = 8");
  rejected([](SparseMlaSplitPlan& p) { p.rows_per_split = 100; }, "multiple of 64 in 64..2048");
  rejected([](SparseMlaSplitPlan& p) { p.rows_per_split = 2176, p.splits = 1; }, "multiple of 64 in 64..2048");
  rejected([](SparseMlaSplitPlan& p) { p.splits += 1; }, "at least one of the K = 2176");
  rejected([](SparseMlaSplitPlan& p) { p.rows_per_split = 64, p.splits = 34; }, "1..16 splits");
}

// ---------------------------------------------------------------------------
// Problems: host inputs in the kernel's layouts.

struct Problem {
  int m = 1, heads = 1, top_k = 1;
  int64_t blocks = 1, block_size = 1, entry_stride = L, block_stride = L;
  int64_t q_head_stride = L, q_token_stride = L, indices_token_stride = 1, latent_token_stride = L;
  float q_scale = 1, k_scale = 1, softmax_scale = 1;
  std::vector<uint8_t> q;        // [m, H, 512] e4m3 codes with the strides above
  std::vector<uint8_t> cache;    // [blocks, block_size, 512] e4m3 codes
  std::vector<int32_t> indices;  // [m, K]

  int64_t capacity() const { return blocks * block_size; }
  uint8_t* entry(int64_t slot) { return &cache[slot / block_size * block_stride + slot % block_size * entry_stride]; }
  uint8_t* q_row(int t, int h) { return &q[t * q_token_stride + h * q_head_stride]; }
  int32_t& index(int t, int j) { return indices[t * indices_token_stride + j]; }
  reference::SparseMlaHost host() const {
    return {q.data(),       q_token_stride, q_head_stride,        cache.data(), blocks,  block_size, block_stride,
            entry_stride,   indices.data(), indices_token_stride, m,            heads,   top_k,      q_scale,
            k_scale,        softmax_scale};
  }
};

// Contiguous buffers of the given sizes, zero codes, every index -1.
Problem make_problem(int m, int heads, int top_k, int64_t blocks, int64_t block_size) {
  Problem p;
  p.m = m, p.heads = heads, p.top_k = top_k, p.blocks = blocks, p.block_size = block_size;
  p.block_stride = block_size * L;
  p.q_token_stride = int64_t(heads) * L;
  p.indices_token_stride = top_k;
  p.latent_token_stride = int64_t(heads) * L;
  p.q.assign(size_t(m) * heads * L, 0);
  p.cache.assign(size_t(blocks) * p.block_stride, 0);
  p.indices.assign(size_t(m) * top_k, -1);
  return p;
}

// e4m3 codes of normal(0, sigma) samples, saturated to +-448 (never NaN).
void fill_codes(uint8_t* codes, size_t count, float sigma, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, sigma);
  for (size_t i = 0; i < count; ++i) codes[i] = num::float_to_e4m3(normal(rng));
}

// ---------------------------------------------------------------------------
// The reference's edge cases, by hand.

float bf16(uint16_t bits) { return num::bf16_to_float(bits); }

// Keys e0 at slot 5 and e1 at slot 2 (code 1.0 in one dim each) and q = 1.0
// in dim 0: the scores of slots 5 and 2 are softmax_scale * q_scale * k_scale
// * (1, 0) = (ln 3, 0). `entries` is the token's index row.
Problem hand_problem(const std::vector<int32_t>& entries) {
  Problem p = make_problem(1, 1, static_cast<int>(entries.size()), 2, 4);
  p.q_scale = 0.5f, p.k_scale = 2.0f, p.softmax_scale = static_cast<float>(std::log(3.0));
  p.q[0] = kCodeOne;
  p.entry(5)[0] = kCodeOne;
  p.entry(2)[1] = kCodeOne;
  p.indices = entries;
  return p;
}

// Weights 3/4 and 1/4: output k_scale * (3/4, 1/4, 0, ...), lse ln 4.
TEST(SparseMlaReference, HandComputedTwoEntries) {
  const reference::SparseMlaResult r = reference::sparse_mla(hand_problem({5, 2}).host());
  EXPECT_EQ(bf16(r.latent[0]), 1.5f);  // 2 * 3/4
  EXPECT_EQ(bf16(r.latent[1]), 0.5f);  // 2 * 1/4
  for (int d = 2; d < L; ++d) ASSERT_EQ(r.latent[d], 0) << "dim " << d;
  EXPECT_NEAR(r.lse[0], std::log(4.0), 1e-6);
  EXPECT_EQ(r.out_of_range, 0);
}

// Entries (5, 5, 2): weights 3, 3, 1 -> output 2 * (6/7, 1/7), lse ln 7.
TEST(SparseMlaReference, DuplicatesCountEachTime) {
  const reference::SparseMlaResult r = reference::sparse_mla(hand_problem({5, 5, 2}).host());
  EXPECT_EQ(r.latent[0], num::float_to_bf16(12.0f / 7.0f));
  EXPECT_EQ(r.latent[1], num::float_to_bf16(2.0f / 7.0f));
  EXPECT_NEAR(r.lse[0], std::log(7.0), 1e-6);
}

TEST(SparseMlaReference, RowWithoutValidEntriesGivesZerosAndMinusInfinity) {
  Problem p = make_problem(2, 3, 5, 2, 4);
  std::mt19937_64 rng(testing::test_seed());
  fill_codes(p.q.data(), p.q.size(), 64.0f, rng);
  fill_codes(p.cache.data(), p.cache.size(), 64.0f, rng);
  // Token 0: every entry -1; token 1: negative or past the capacity (8).
  const int32_t token1[5] = {-7, 8, 1000, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  for (int j = 0; j < 5; ++j) p.index(1, j) = token1[j];
  const reference::SparseMlaResult r = reference::sparse_mla(p.host());
  for (uint16_t v : r.latent) ASSERT_EQ(v, 0);
  for (float v : r.lse) EXPECT_EQ(v, -kInf);
  EXPECT_EQ(r.out_of_range, 3);  // once per entry, not per head
}

// Capacity 8: entries 8, 9 and 2^30 are skipped (and counted), -1 is none,
// so the result is that of (5, 2) alone.
TEST(SparseMlaReference, OutOfRangeEntriesAreSkippedAndCounted) {
  const reference::SparseMlaResult r = reference::sparse_mla(hand_problem({8, 5, -1, 9, 2, 1 << 30}).host());
  const reference::SparseMlaResult clean = reference::sparse_mla(hand_problem({5, 2}).host());
  EXPECT_TRUE(r.latent == clean.latent);
  EXPECT_EQ(r.lse[0], clean.lse[0]);
  EXPECT_EQ(r.out_of_range, 3);
}

TEST(SparseMlaReference, NanMakesItsRowNanAndNothingElse) {
  Problem p = make_problem(3, 2, 4, 4, 4);
  std::mt19937_64 rng(testing::test_seed() + 1);
  fill_codes(p.q.data(), p.q.size(), 32.0f, rng);
  fill_codes(p.cache.data(), p.cache.size(), 32.0f, rng);
  for (int t = 0; t < 3; ++t) {
    for (int j = 0; j < 4; ++j) p.index(t, j) = 4 * t + j;
  }
  p.q_row(0, 1)[100] = kCodeNaN;    // token 0, head 1
  p.entry(6)[511] = kCodeNaN;       // selected by token 1 only
  p.entry(15)[0] = kCodeNaN | 0x80;  // not selected by anyone
  const reference::SparseMlaResult r = reference::sparse_mla(p.host());
  auto row_is_nan = [&](int t, int h) {
    for (int d = 0; d < L; ++d) {
      if (!std::isnan(bf16(r.latent[(t * 2 + h) * L + d]))) return false;
    }
    return std::isnan(r.lse[t * 2 + h]);
  };
  auto row_is_finite = [&](int t, int h) {
    for (int d = 0; d < L; ++d) {
      if (!std::isfinite(bf16(r.latent[(t * 2 + h) * L + d]))) return false;
    }
    return std::isfinite(r.lse[t * 2 + h]);
  };
  EXPECT_TRUE(row_is_finite(0, 0));
  EXPECT_TRUE(row_is_nan(0, 1));
  EXPECT_TRUE(row_is_nan(1, 0));
  EXPECT_TRUE(row_is_nan(1, 1));
  EXPECT_TRUE(row_is_finite(2, 0));
  EXPECT_TRUE(row_is_finite(2, 1));
}

// The reference's exact-dot shortcut against the formula as written in the
// contract (dequantized values, double throughout).
TEST(SparseMlaReference, AgreesWithTheContractFormula) {
  std::mt19937_64 rng(testing::test_seed() + 2);
  Problem p = make_problem(2, 3, 40, 8, 16);
  p.q_scale = 0.03f, p.k_scale = 0.07f, p.softmax_scale = 0.0625f;
  fill_codes(p.q.data(), p.q.size(), 40.0f, rng);
  fill_codes(p.cache.data(), p.cache.size(), 40.0f, rng);
  std::uniform_int_distribution<int32_t> slot(-2, int32_t(p.capacity()) + 2);
  for (int32_t& index : p.indices) index = slot(rng);
  const reference::SparseMlaResult r = reference::sparse_mla(p.host());
  for (int t = 0; t < p.m; ++t) {
    for (int h = 0; h < p.heads; ++h) {
      std::vector<double> scores;
      std::vector<const uint8_t*> rows;
      for (int j = 0; j < p.top_k; ++j) {
        const int32_t s = p.index(t, j);
        if (s < 0 || s >= p.capacity()) continue;
        rows.push_back(p.entry(s));
        double dot = 0;
        for (int d = 0; d < L; ++d) {
          dot += double(p.q_scale) * num::e4m3_to_float(p.q_row(t, h)[d]) * double(p.k_scale) *
                 num::e4m3_to_float(rows.back()[d]);
        }
        scores.push_back(p.softmax_scale * dot);
      }
      double sum = 0;
      for (double s : scores) sum += std::exp(s);
      EXPECT_NEAR(r.lse[t * p.heads + h], std::log(sum), 1e-5);
      for (int d = 0; d < L; ++d) {
        double value = 0;
        for (size_t j = 0; j < rows.size(); ++j) {
          value += std::exp(scores[j]) / sum * double(p.k_scale) * num::e4m3_to_float(rows[j][d]);
        }
        const float got = bf16(r.latent[(t * p.heads + h) * L + d]);
        ASSERT_NEAR(got, value, std::fabs(value) * (1.0 / 128) + 1e-30) << "t " << t << " h " << h << " d " << d;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// GPU: the kernels against the reference.

using Kernel = std::function<Status(const SparseMlaArgs&, cudaStream_t)>;
using PartialsCount = std::function<int64_t(int64_t m, int64_t heads, int top_k)>;
struct NamedKernel {
  std::string name;
  Kernel run;
  // The split_partials the kernel needs: run_gpu passes exactly that many
  // values between poisoned guard bands.
  PartialsCount partials = [](int64_t m, int64_t heads, int top_k) {
    return sparse_mla_split_partials_count(m, heads, top_k);
  };
};
// sparse_mla with a split choice: kLatency is SparseMlaPlan::kBatchInvariant's,
// kThroughput (half the splits) has the same contract and other bits.
template <SparseMlaSplits kChoice>
Status sparse_mla_with(const SparseMlaArgs& a, cudaStream_t stream) {
  return sparse_mla_with_splits(a, kChoice, stream);
}
Status sparse_mla_batch_invariant(const SparseMlaArgs& a, cudaStream_t stream) {
  SparseMlaArgs invariant = a;
  invariant.plan = SparseMlaPlan::kBatchInvariant;
  return sparse_mla(invariant, stream);
}
// sparse_mla runs sparse_mla_wgmma when H is a multiple of 64 and sparse_mla_mma
// otherwise; the 8-head kernel is also run on its own, so that both fast
// kernels meet every shape of every test, and sparse_mla with the other
// split plan too.
const NamedKernel kKernels[] = {{"sparse_mla_simple", sparse_mla_simple},
                                {"sparse_mla, batch-invariant plan", sparse_mla_batch_invariant},
                                {"sparse_mla_mma", [](const SparseMlaArgs& a, cudaStream_t stream) {
                                   return sparse_mla_mma(a, SparseMlaSplits::kLatency, stream);
                                 }},
                                {"sparse_mla, throughput splits", sparse_mla_with<SparseMlaSplits::kThroughput>}};

// The 64-head kernel with an explicit plan.
NamedKernel wgmma_plan(int max_splits, int max_cluster) {
  return {"sparse_mla_wgmma, at most " + std::to_string(max_splits) + " splits in clusters of at most " +
              std::to_string(max_cluster),
          [max_splits, max_cluster](const SparseMlaArgs& a, cudaStream_t stream) {
            return sparse_mla_wgmma_with_plan(a, max_splits, max_cluster, stream);
          },
          [max_splits, max_cluster](int64_t m, int64_t heads, int top_k) {
            return sparse_mla_wgmma_partials_count(m, heads, top_k, max_splits, max_cluster);
          }};
}
// The 64-head kernel's default plan (sparse_mla's partials) with one CTA per item at every m.
NamedKernel wgmma_whole_items() { return {"sparse_mla_wgmma, one CTA per item", sparse_mla_wgmma_whole_items}; }
// The same plan with several consecutive splits per CTA wherever that fits
// on the GPU at once (the default launch elsewhere).
NamedKernel wgmma_grouped_splits() {
  return {"sparse_mla_wgmma, consecutive splits per CTA", sparse_mla_wgmma_grouped_splits};
}
// H a multiple of 64: the 64-head kernel with a two-level plan too (16
// splits in two clusters of 8), so that the combine through split_partials
// and the counters meets every case whatever the default plan is, the
// default plan with one CTA per item and with consecutive splits per CTA at
// every m, and kWholeRow (the producer kernel through sparse_mla).
// The producer kernel (K <= 2304, no split_partials).
NamedKernel producer_kernel() {
  return {"sparse_mla_producer", sparse_mla_producer, [](int64_t, int64_t, int) { return int64_t(0); }};
}
const NamedKernel kWholeRowKernel{"sparse_mla, whole rows", sparse_mla_with<SparseMlaSplits::kWholeRow>};
std::vector<NamedKernel> kernels_for(int heads) {
  std::vector<NamedKernel> kernels(std::begin(kKernels), std::end(kKernels));
  if (heads % 64 == 0) {
    kernels.push_back(wgmma_plan(16, 8));
    kernels.push_back(wgmma_whole_items());
    kernels.push_back(wgmma_grouped_splits());
    kernels.push_back(kWholeRowKernel);  // every caller's K is within the producer's 2304
  }
  return kernels;
}

constexpr int64_t kGuard = 64;  // poisoned elements on each side of each output (keeps 16-byte alignment)
constexpr uint8_t kPoison = 0xFF;

// split_partials for every plan of the 64-head kernel (the most clusters).
int64_t largest_partials_count(int64_t m, int64_t heads, int top_k) {
  return sparse_mla_wgmma_partials_count(m, heads, top_k, kSparseMlaWgmmaMaxSplits, 4);
}

struct GpuResult {
  std::vector<uint16_t> latent;  // [m, H, 512] contiguous
  std::vector<float> lse;        // [m, H]
  unsigned int out_of_range = 0;
};

// Runs `kernel` on `p` with poisoned outputs and guard bands (split_partials
// too, at exactly the size the kernel asks for); checks the guards, the
// latent's token padding and the split counters (all zero after).
GpuResult run_gpu(const Problem& p, const NamedKernel& kernel) {
  SCOPED_TRACE(kernel.name);
  GpuResult result;
  DeviceBuffer<uint8_t> q_dev(p.q), cache_dev(p.cache);
  DeviceBuffer<int32_t> indices_dev(p.indices);
  DeviceBuffer<float> q_scale_dev(std::vector<float>{p.q_scale}), k_scale_dev(std::vector<float>{p.k_scale});
  const int64_t latent_elems = (p.m - 1) * p.latent_token_stride + int64_t(p.heads) * L;
  DeviceBuffer<uint16_t> latent_dev(latent_elems + 2 * kGuard);
  DeviceBuffer<float> lse_dev(int64_t(p.m) * p.heads + 2 * kGuard);
  latent_dev.fill_bytes(kPoison);
  lse_dev.fill_bytes(kPoison);
  const int64_t counters = sparse_mla_split_counter_count(p.m, p.heads, p.top_k);
  DeviceBuffer<int32_t> counters_dev(std::vector<int32_t>(counters, 0));
  const int64_t partials = kernel.partials(p.m, p.heads, p.top_k);
  DeviceBuffer<float> partials_dev(partials + 2 * kGuard);
  partials_dev.fill_bytes(kPoison);
  DeviceBuffer<unsigned int> errors_dev(std::vector<unsigned int>{0});

  SparseMlaArgs a;
  a.q = make_strided(q_dev.get(), DType::kFP8E4M3, {p.m, p.heads, L}, {p.q_token_stride, p.q_head_stride, 1});
  a.q_scale = make_tensor(q_scale_dev.get(), DType::kF32, {1});
  a.kv_cache = make_strided(cache_dev.get(), DType::kFP8E4M3, {p.blocks, p.block_size, L},
                            {p.block_stride, p.entry_stride, 1});
  a.k_scale = make_tensor(k_scale_dev.get(), DType::kF32, {1});
  a.indices = make_strided(indices_dev.get(), DType::kI32, {p.m, p.top_k}, {p.indices_token_stride, 1});
  a.softmax_scale = p.softmax_scale;
  a.latent = make_strided(latent_dev.get() + kGuard, DType::kBF16, {p.m, p.heads, L}, {p.latent_token_stride, L, 1});
  a.lse = make_tensor(lse_dev.get() + kGuard, DType::kF32, {p.m, p.heads});
  a.split_counters = make_tensor(counters_dev.get(), DType::kI32, {counters});
  if (partials > 0) a.split_partials = make_tensor(partials_dev.get() + kGuard, DType::kF32, {partials});
  a.error_count = errors_dev.get();
  const Status s = kernel.run(a, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (!s.ok()) return result;

  const std::vector<uint16_t> latent = latent_dev.download();
  const std::vector<float> lse_all = lse_dev.download();
  auto poisoned = [](const void* data, size_t bytes) {
    const uint8_t* b = static_cast<const uint8_t*>(data);
    return std::all_of(b, b + bytes, [](uint8_t v) { return v == kPoison; });
  };
  EXPECT_TRUE(poisoned(latent.data(), kGuard * 2)) << "write before latent";
  EXPECT_TRUE(poisoned(latent.data() + kGuard + latent_elems, kGuard * 2)) << "write past latent";
  EXPECT_TRUE(poisoned(lse_all.data(), kGuard * 4)) << "write before lse";
  EXPECT_TRUE(poisoned(lse_all.data() + kGuard + p.m * p.heads, kGuard * 4)) << "write past lse";
  for (int t = 0; t < p.m; ++t) {
    const uint16_t* row = latent.data() + kGuard + t * p.latent_token_stride;
    result.latent.insert(result.latent.end(), row, row + p.heads * L);
    if (t + 1 < p.m) {
      const int64_t padding = p.latent_token_stride - int64_t(p.heads) * L;
      EXPECT_TRUE(poisoned(row + p.heads * L, padding * 2)) << "write into latent's token padding after token " << t;
    }
  }
  result.lse.assign(lse_all.begin() + kGuard, lse_all.begin() + kGuard + p.m * p.heads);
  result.out_of_range = errors_dev.download()[0];
  const std::vector<float> partials_all = partials_dev.download();
  EXPECT_TRUE(poisoned(partials_all.data(), kGuard * 4)) << "write before split_partials";
  EXPECT_TRUE(poisoned(partials_all.data() + kGuard + partials, kGuard * 4)) << "write past split_partials";
  const std::vector<int32_t> counters_after = counters_dev.download();
  EXPECT_TRUE(std::all_of(counters_after.begin(), counters_after.end(), [](int32_t c) { return c == 0; }))
      << "split counters not zero after the launch";
  return result;
}

// GPU output against the reference: rows with no valid entry are exactly zero
// with lse -inf, NaN rows are NaN throughout, the rest within the tolerances.
// Returns the relative Frobenius error of the finite rows.
double expect_close_to_reference(const Problem& p, const GpuResult& got, const reference::SparseMlaResult& want) {
  constexpr double kMaxRelativeFrobenius = 1e-2, kMaxLseError = 1e-3;
  EXPECT_EQ(got.out_of_range, static_cast<unsigned>(want.out_of_range)) << "error counter";
  if (got.latent.size() != want.latent.size() || got.lse.size() != want.lse.size()) {
    ADD_FAILURE() << "no GPU result";
    return 0;
  }
  double error_squares = 0, reference_squares = 0;
  int bad_rows = 0;
  for (int row = 0; row < p.m * p.heads; ++row) {
    const uint16_t* g = &got.latent[size_t(row) * L];
    const uint16_t* w = &want.latent[size_t(row) * L];
    const float want_lse = want.lse[row], got_lse = got.lse[row];
    bool ok = true;
    if (std::isnan(want_lse)) {
      ok = std::isnan(got_lse) && std::all_of(g, g + L, [](uint16_t v) { return std::isnan(bf16(v)); });
    } else if (want_lse == -kInf) {
      ok = got_lse == -kInf && std::all_of(g, g + L, [](uint16_t v) { return v == 0; });
    } else {
      ok = std::fabs(got_lse - want_lse) <= kMaxLseError;
      for (int d = 0; d < L; ++d) {
        const double difference = double(bf16(g[d])) - bf16(w[d]);
        error_squares += difference * difference;  // NaN or inf from the GPU makes the total fail
        reference_squares += double(bf16(w[d])) * bf16(w[d]);
      }
    }
    if (!ok && bad_rows++ < 5) {
      ADD_FAILURE() << "token " << row / p.heads << " head " << row % p.heads << ": lse " << got_lse
                    << ", reference " << want_lse << ", latent[0] " << bf16(g[0]) << ", reference " << bf16(w[0]);
    }
  }
  const double relative = reference_squares > 0 ? std::sqrt(error_squares / reference_squares) : std::sqrt(error_squares);
  EXPECT_LE(relative, kMaxRelativeFrobenius) << "relative Frobenius error of the latent";
  return relative;
}

struct Case {
  int heads, m, top_k;
  int padding = 0;  // trailing -1 entries of each index row (glm5next rows: 2048 + 3 tail + 125 padding)
};

std::string describe(const Case& c) {
  return "H " + std::to_string(c.heads) + " m " + std::to_string(c.m) + " K " + std::to_string(c.top_k) +
         (c.padding ? " (" + std::to_string(c.padding) + " padding)" : "");
}

// Random inputs at realistic scales: q_scale and k_scale in [0.01, 0.1]; the
// codes are normal samples spread over the e4m3 range (sigma about 8..270:
// subnormals to a few hundred) with sigma set so that the scores have a
// standard deviation of `score_spread` (flat to peaked softmax). Cache of 4096 slots; `padded`
// pads every stride (cache blocks, q heads and tokens, index rows, latent tokens).
Problem random_problem(const Case& c, bool padded, float score_spread, std::mt19937_64& rng) {
  const int64_t block_size = padded ? 64 : 256;
  Problem p = make_problem(c.m, c.heads, c.top_k, 4096 / block_size, block_size);
  if (padded) {
    p.entry_stride = L + 16;
    p.block_stride = block_size * p.entry_stride + 64;
    p.q_head_stride = L + 32;
    p.q_token_stride = c.heads * p.q_head_stride + 16;
    p.indices_token_stride = c.top_k + 3;
    p.latent_token_stride = int64_t(c.heads) * L + 8;
    p.q.assign(size_t(c.m) * p.q_token_stride, 0);
    p.cache.assign(size_t(p.blocks) * p.block_stride, 0);
    p.indices.assign(size_t(c.m) * p.indices_token_stride, -1);
  }
  std::uniform_real_distribution<float> scale(0.01f, 0.1f);
  p.q_scale = scale(rng), p.k_scale = scale(rng), p.softmax_scale = 0.0625f;  // glm5next: 256^-0.5
  // score std = softmax_scale * q_scale * k_scale * sigma^2 * sqrt(512) with one sigma for q and k
  const double sigma = std::sqrt(score_spread / (p.softmax_scale * p.q_scale * p.k_scale * std::sqrt(double(L))));
  const float code_sigma = static_cast<float>(std::min(450.0, sigma));
  fill_codes(p.q.data(), p.q.size(), code_sigma, rng);
  fill_codes(p.cache.data(), p.cache.size(), code_sigma, rng);
  std::uniform_int_distribution<int32_t> slot(0, int32_t(p.capacity()) - 1);
  for (int t = 0; t < c.m; ++t) {
    for (int j = 0; j < c.top_k - c.padding; ++j) p.index(t, j) = slot(rng);
  }
  return p;
}

// Issue 4 asks to choose P.V's operand type by measurement: FP16 P with V
// converted from e4m3 (exact), or FP8 P with V transposed in shared memory.
// Rounding p to the operand type is the only difference in the products (both
// accumulate in FP32), so this measures that rounding alone, in float64,
// over the GPU sweep's inputs (K = 2048, score spreads 1, 3 and 10): the
// relative Frobenius error of O = sum p_j v_j / sum p_j with p_j = exp(s_j -
// max) rounded to FP16, or scaled by 448 (the max lands on the largest e4m3
// value) and rounded to e4m3, against p unrounded; the sum is unrounded in
// all three (the kernels keep it in FP32). The contract's bound for the
// whole kernel is 1e-2. Measured here: FP16 ~1e-4 at every spread; e4m3
// ~1.8e-2 for the flat softmax (spread 1), 0.5-1.5e-2 for the others, so FP8
// P misses the bound by itself, whatever its speed: P.V stays on FP16.
TEST(SparseMlaNumerics, RoundingPToFp8AloneExceedsTheErrorBound) {
  std::mt19937_64 rng(testing::test_seed() + 11);
  constexpr int kHeads = 8, kTokens = 2, kTopK = 2048;
  double worst_fp8 = 0;
  for (const float spread : {1.0f, 3.0f, 10.0f}) {
    Problem p = random_problem({kHeads, kTokens, kTopK}, false, spread, rng);
    std::uniform_int_distribution<int32_t> slot(0, int32_t(p.capacity()) - 1);
    for (int t = 0; t < kTokens; ++t) {
      for (int j = 0; j < kTopK; ++j) p.index(t, j) = slot(rng);
    }
    double squares[3] = {0, 0, 0};  // exact O, FP16-p error, FP8-p error
    std::vector<double> scores(kTopK);
    for (int t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kHeads; ++h) {
        double max_score = -INFINITY;
        for (int j = 0; j < kTopK; ++j) {
          const uint8_t* k = p.entry(p.index(t, j));
          double dot = 0;
          for (int d = 0; d < L; ++d) dot += double(num::e4m3_to_float(p.q_row(t, h)[d])) * num::e4m3_to_float(k[d]);
          scores[j] = dot * p.q_scale * p.k_scale * p.softmax_scale;
          max_score = std::max(max_score, scores[j]);
        }
        std::vector<double> exact(L, 0.0), fp16(L, 0.0), fp8(L, 0.0);
        double sum = 0;
        for (int j = 0; j < kTopK; ++j) {
          const double weight = std::exp(scores[j] - max_score);
          const double weight_fp16 = __half2float(__double2half(weight));
          const double weight_fp8 = num::e4m3_to_float(num::float_to_e4m3(float(weight * 448.0))) / 448.0;
          const uint8_t* v = p.entry(p.index(t, j));
          for (int d = 0; d < L; ++d) {
            const double value = num::e4m3_to_float(v[d]);
            exact[d] += weight * value, fp16[d] += weight_fp16 * value, fp8[d] += weight_fp8 * value;
          }
          sum += weight;
        }
        for (int d = 0; d < L; ++d) {
          squares[0] += (exact[d] / sum) * (exact[d] / sum);
          squares[1] += ((fp16[d] - exact[d]) / sum) * ((fp16[d] - exact[d]) / sum);
          squares[2] += ((fp8[d] - exact[d]) / sum) * ((fp8[d] - exact[d]) / sum);
        }
      }
    }
    const double fp16_error = std::sqrt(squares[1] / squares[0]), fp8_error = std::sqrt(squares[2] / squares[0]);
    std::printf("[P.V operand, score spread %.0f] relative Frobenius error of O from rounding p alone: FP16 %.3g, e4m3 %.3g\n",
                spread, fp16_error, fp8_error);
    EXPECT_LT(fp16_error, 1e-3);
    worst_fp8 = std::max(worst_fp8, fp8_error);
  }
  EXPECT_GT(worst_fp8, 1e-2) << "FP8 P stays within the bound here: time FP8 P.V before keeping FP16";
}

// S in FP8: the one design left that takes the e4m3 -> FP16 conversion off
// the whole-row kernel's loop (docs/sparse_mla.md, "FP8 scores") computes
// Q K^T by e4m3 wgmma straight from the codes. Its products are exact, but
// the tensor cores add them with a narrower accumulator than FP32. This
// kernel computes S [64 heads x 64 rows] (tile blockIdx.x of the rows) over
// the 512 dims as 16 k32 steps three ways: one wgmma chain of 16 steps;
// chains of 4 steps (128 dims) added in FP32 in order (DeepGEMM's
// promotion); each step alone, the 16 results added in FP32 in order.
// q [64, 512] and rows [K, 512] e4m3, contiguous; scores [3][64][K] f32.
// total[i] = S by chains of kChain k32 steps, added in FP32 in chain order.
template <int kChain>
__device__ void fp8_scores(const uint8_t* q_tile, const uint8_t* row_tile, uint32_t panel_bytes, float (&total)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) total[i] = 0.0f;
#pragma unroll
  for (int first = 0; first < 16; first += kChain) {
    float d[32];
    wgmma::fence();
#pragma unroll
    for (int step = first; step < first + kChain; ++step) {
      const uint32_t offset = step / 4 * panel_bytes + 32 * (step % 4);
      wgmma::mma_m64n64k32_e4m3(d, wgmma::k_major_sw128_descriptor(shared_address(q_tile) + offset),
                                wgmma::k_major_sw128_descriptor(shared_address(row_tile) + offset), step > first);
    }
    wgmma::commit_group();
    wgmma::wait_group<0>();
    wgmma::fence_operands(d);
#pragma unroll
    for (int i = 0; i < 32; ++i) total[i] += d[i];
  }
}

__global__ void __launch_bounds__(128) fp8_scores_kernel(const uint8_t* q, const uint8_t* rows, int top_k,
                                                           float* scores) {
  constexpr int kPanelRows = 64, kPanelBytes = kPanelRows * 128, kPanels = L / 128;
  extern __shared__ uint8_t raw[];
  const uint32_t raw_address = shared_address(raw);
  uint8_t* q_tile = raw + (1024 - raw_address % 1024) % 1024;  // [4 panels][64 heads][128 dims], 128B swizzle
  uint8_t* row_tile = q_tile + kPanels * kPanelBytes;            // [4 panels][64 rows][128 dims]
  const uint8_t* tile_rows = rows + size_t(blockIdx.x) * kPanelRows * L;
  for (int u = threadIdx.x; u < kPanelRows * L / 16; u += blockDim.x) {
    const int row = u / (L / 16), panel = u % (L / 16) / 8, chunk = u % 8;
    const uint32_t offset = panel * kPanelBytes + wgmma::k_major_sw128_offset(row, chunk);
    *reinterpret_cast<uint4*>(q_tile + offset) = *reinterpret_cast<const uint4*>(q + size_t(u) * 16);
    *reinterpret_cast<uint4*>(row_tile + offset) = *reinterpret_cast<const uint4*>(tile_rows + size_t(u) * 16);
  }
  wgmma::fence_shared_for_async_proxy();
  __syncthreads();
  for (int variant = 0; variant < 3; ++variant) {
    float total[32];
    if (variant == 0) fp8_scores<16>(q_tile, row_tile, kPanelBytes, total);
    if (variant == 1) fp8_scores<4>(q_tile, row_tile, kPanelBytes, total);
    if (variant == 2) fp8_scores<1>(q_tile, row_tile, kPanelBytes, total);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int head = wgmma::accumulator_row(threadIdx.x, i);
      const int row = blockIdx.x * kPanelRows + wgmma::accumulator_column(threadIdx.x, i);
      scores[(size_t(variant) * 64 + head) * top_k + row] = total[i];
    }
  }
}

// The contract bounds lse within 1e-3 of float64. Over the GPU sweep's
// inputs (H = 64, K = 2048, score spreads 1, 3 and 10) this measures how far
// each FP8-S variant's lse lies from the exact one, everything after S in
// float64, so the FP8 accumulation alone is measured. On the H200
// (2026-12-01, this seed): at spread 10 the chain of 16 errs by 2.6e-2,
// chains of 4 by 6.8e-3 and even each step alone by 2.3e-3 (spread 3:
// 6.4e-3, 1.4e-3, 6.3e-4), so S stays on FP16 operands, whose products and
// sums are exact to FP32.
TEST(SparseMlaGpu, Fp8ScoresAloneMissTheLseBound) {
  DSA_REQUIRE_GPU();
  // A fixed seed: the test records a measurement (the H200's numbers above),
  // so every run takes the same inputs.
  std::mt19937_64 rng(12);
  constexpr int kHeads = 64, kTopK = 2048;
  constexpr size_t kShared = 2 * 64 * L + 1024;
  DSA_ASSERT_CUDA(cudaFuncSetAttribute(fp8_scores_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kShared));
  double worst_lse[3] = {0, 0, 0}, worst_relative[3] = {0, 0, 0};  // |lse error|; |S error| / sum |products|
  for (const float spread : {1.0f, 3.0f, 10.0f}) {
    Problem p = random_problem({kHeads, 1, kTopK}, false, spread, rng);
    std::vector<uint8_t> q(size_t(kHeads) * L), rows(size_t(kTopK) * L);
    for (int h = 0; h < kHeads; ++h) std::memcpy(&q[size_t(h) * L], p.q_row(0, h), L);
    for (int j = 0; j < kTopK; ++j) std::memcpy(&rows[size_t(j) * L], p.entry(p.index(0, j)), L);
    DeviceBuffer<uint8_t> q_device(q.size()), rows_device(rows.size());
    DeviceBuffer<float> scores_device(size_t(3) * kHeads * kTopK);
    q_device.upload(q);
    rows_device.upload(rows);
    fp8_scores_kernel<<<kTopK / 64, 128, kShared>>>(q_device.get(), rows_device.get(), kTopK, scores_device.get());
    DSA_ASSERT_CUDA(cudaGetLastError());
    DSA_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> gpu = scores_device.download();
    const double scale = double(p.q_scale) * p.k_scale * p.softmax_scale;
    double spread_lse[3] = {0, 0, 0};
    for (int h = 0; h < kHeads; ++h) {
      std::vector<double> exact(kTopK), magnitude(kTopK, 0.0);
      for (int j = 0; j < kTopK; ++j) {
        double dot = 0;
        for (int d = 0; d < L; ++d) {
          const double product = double(num::e4m3_to_float(q[size_t(h) * L + d])) * num::e4m3_to_float(rows[size_t(j) * L + d]);
          dot += product, magnitude[j] += std::fabs(product);
        }
        exact[j] = dot;
      }
      const auto lse = [&](auto score) {
        double max_score = -INFINITY, sum = 0;
        for (int j = 0; j < kTopK; ++j) max_score = std::max(max_score, score(j));
        for (int j = 0; j < kTopK; ++j) sum += std::exp(score(j) - max_score);
        return max_score + std::log(sum);
      };
      const double exact_lse = lse([&](int j) { return scale * exact[j]; });
      for (int v = 0; v < 3; ++v) {
        const float* s = &gpu[(size_t(v) * kHeads + h) * kTopK];
        for (int j = 0; j < kTopK; ++j) {
          worst_relative[v] = std::max(worst_relative[v], std::fabs(s[j] - exact[j]) / magnitude[j]);
        }
        spread_lse[v] = std::max(spread_lse[v], std::fabs(lse([&](int j) { return scale * s[j]; }) - exact_lse));
      }
    }
    std::printf("[FP8 scores, score spread %.0f] worst |lse error| over %d heads: chain of 16 k32 steps %.3g, "
                "chains of 4 %.3g, each step alone %.3g\n",
                spread, kHeads, spread_lse[0], spread_lse[1], spread_lse[2]);
    for (int v = 0; v < 3; ++v) worst_lse[v] = std::max(worst_lse[v], spread_lse[v]);
  }
  std::printf("[FP8 scores] worst |S error| / sum |products|: chain of 16 %.3g, chains of 4 %.3g, each step %.3g\n",
              worst_relative[0], worst_relative[1], worst_relative[2]);
  // The kernel computes the right products (a wrong layout errs by O(1)):
  // measured 2.1e-5 for the steps alone and 3.6e-4 for one chain.
  EXPECT_LT(worst_relative[2], 1e-4);
  EXPECT_LT(worst_relative[0], 1e-2);
  EXPECT_GT(worst_lse[0], worst_lse[2]) << "a longer chain should add more error than the steps alone";
  EXPECT_GT(worst_lse[2], 1e-3) << "FP8 S with every step promoted stays within the lse bound here: "
                                   "time the FP8-S design (docs/sparse_mla.md, \"FP8 scores\")";
}

// Each case against the float64 reference for each kernel, every other case
// with padded strides and the score spreads 1, 3, 10 in turn; prints each
// kernel's worst relative Frobenius error (the checks themselves fail inside).
void sweep_against_reference(const std::vector<Case>& cases, const std::vector<NamedKernel>& kernels,
                             std::mt19937_64& rng) {
  const float spreads[] = {1.0f, 3.0f, 10.0f};
  std::vector<double> worst(kernels.size(), 0.0);
  int index = 0;
  for (const Case& c : cases) {
    const bool padded = index % 2 == 1;
    const float spread = spreads[index % 3];
    SCOPED_TRACE(describe(c) + (padded ? " padded strides" : "") + " score spread " + std::to_string(spread));
    const Problem p = random_problem(c, padded, spread, rng);
    const reference::SparseMlaResult want = reference::sparse_mla(p.host());
    for (size_t k = 0; k < kernels.size(); ++k) {
      worst[k] = std::max(worst[k], expect_close_to_reference(p, run_gpu(p, kernels[k]), want));
    }
    ++index;
  }
  for (size_t k = 0; k < kernels.size(); ++k) {
    std::printf("[%s vs float64] worst relative Frobenius error %.3g over %d cases\n", kernels[k].name.c_str(),
                worst[k], index);
  }
}

TEST(SparseMlaGpu, MatchesFloat64ReferenceOverHeadsTokensAndTopK) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  // Every H meets every K and every m meets every K, with the big products
  // (m * H * K) kept small enough for the float64 reference on one core.
  const std::vector<Case> full = {
      {128, 1, 2176, 125}, {128, 2, 2048}, {128, 7, 100}, {128, 16, 1},
      {64, 1, 2048},       {64, 2, 2176, 125}, {64, 7, 1},   {64, 16, 100},
      {16, 1, 1},          {16, 2, 100},   {16, 7, 2048},  {16, 16, 2176, 125},
      {8, 1, 100},         {8, 2, 1},      {8, 7, 2176, 125}, {8, 16, 2048}, {8, 64, 100}, {8, 256, 100},
      {64, 64, 100},       {64, 128, 1024}, {128, 256, 1},  // the 64-head kernel above m = 16 (m = 128: many waves)
      {1, 1, 2048},        {1, 2, 2176, 125}, {1, 7, 100}, {1, 16, 1},   {1, 64, 2176, 125}, {1, 256, 2048},
  };
  const std::vector<Case> quick = {{4, 2, 100}, {8, 1, 2176, 125}};
  // The simple kernel and both split plans.
  sweep_against_reference(testing::quick_mode() ? quick : full, {kKernels[0], kKernels[1], kKernels[3]}, rng);
}

// A random problem whose cache entry `nan_slot` holds a NaN code at dim
// `nan_dim`, with every index drawn from the slots above it: a row selects the
// NaN entry only where a test sets it on purpose.
Problem problem_with_nan_entry(const Case& c, bool padded, int32_t nan_slot, int nan_dim, std::mt19937_64& rng) {
  Problem p = random_problem(c, padded, 3.0f, rng);
  p.entry(nan_slot)[nan_dim] = kCodeNaN;
  std::uniform_int_distribution<int32_t> slot(nan_slot + 1, static_cast<int32_t>(p.capacity()) - 1);
  for (int t = 0; t < p.m; ++t) {
    for (int j = 0; j < c.top_k; ++j) p.index(t, j) = slot(rng);
  }
  return p;
}

// H = 8 runs the 8-head kernel, H = 64 the 64-head one (through sparse_mla).
TEST(SparseMlaGpu, EdgeCasesMatchTheReference) {
  DSA_REQUIRE_GPU();
  for (const int heads : {8, 64}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    std::mt19937_64 rng(testing::test_seed() + 10);
    const int top_k = 64;
    const int32_t nan_slot = 77;
    Problem p = problem_with_nan_entry(Case{heads, 6, top_k}, /*padded=*/true, nan_slot, 300, rng);
    const int32_t capacity = static_cast<int32_t>(p.capacity());
    for (int j = 0; j < top_k; ++j) p.index(0, j) = -1 - j;                                     // all negative
    for (int j = 0; j < top_k; ++j) p.index(1, j) = p.index(1, j % 3);                          // three slots, repeated
    for (int j = 0; j < top_k; j += 3) p.index(2, j) = capacity + j * 1000;                     // a third out of range
    p.index(2, 1) = std::numeric_limits<int32_t>::max();
    for (int j = 0; j < top_k; ++j) p.index(3, j) = j % 2 ? capacity : -1;                      // none valid
    p.index(4, 17) = nan_slot;                                                                  // a NaN in a selected row
    p.q_row(5, 3)[0] = kCodeNaN | 0x80;                                                         // a NaN in one head's q
    const reference::SparseMlaResult want = reference::sparse_mla(p.host());
    ASSERT_GT(want.out_of_range, top_k / 2);
    for (const NamedKernel& kernel : kKernels) expect_close_to_reference(p, run_gpu(p, kernel), want);
    if (heads == 64) expect_close_to_reference(p, run_gpu(p, producer_kernel()), want);
  }
}

// The producer kernel over the 64-head shapes of the sweep above (K up to
// 2176, m up to 256, padded strides, three score spreads).
TEST(SparseMlaGpu, ProducerKernelMatchesFloat64Reference) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 60);
  const std::vector<Case> full = {{64, 1, 2048}, {64, 2, 2176, 125}, {64, 7, 1},          {64, 16, 100},
                                  {64, 64, 100}, {64, 128, 1024},    {128, 1, 2176, 125}, {128, 2, 2048},
                                  {128, 7, 100}, {128, 16, 1},       {128, 256, 1},       {64, 256, 2176, 125}};
  const std::vector<Case> quick = {{64, 2, 100}};
  sweep_against_reference(testing::quick_mode() ? quick : full, {producer_kernel()}, rng);
}

// Listed chunks apart from their positions (the CTA's n-th listed chunk is
// not chunk n), at the widest K the producer kernel takes: token 0 has valid
// entries in chunks 0, 5 and 31 only, token 1 in the last chunk (35) only,
// token 2 in its last entry only, token 3 none (out of range: counted),
// token 4 a random row.
TEST(SparseMlaGpu, ProducerKernelListsChunksApartAtTheWidestRow) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 70);
  const int top_k = kSparseMlaProducerMaxTopK;
  for (const int heads : {64, 128}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    Problem p = random_problem(Case{heads, 5, top_k}, /*padded=*/false, 3.0f, rng);
    const int32_t capacity = static_cast<int32_t>(p.capacity());
    for (int j = 0; j < top_k; ++j) {
      const int chunk = j / 64;
      if (chunk != 0 && chunk != 5 && chunk != 31) p.index(0, j) = -1;
      if (chunk != 35) p.index(1, j) = -1;
      if (j != top_k - 1) p.index(2, j) = -1 - j;
      p.index(3, j) = capacity + j;
    }
    const reference::SparseMlaResult want = reference::sparse_mla(p.host());
    ASSERT_GE(want.out_of_range, top_k);
    expect_close_to_reference(p, run_gpu(p, producer_kernel()), want);
  }
}

// Two runs of `batch` give the same bits, and so do tokens 0, m / 2 and m - 1
// run alone.
void expect_same_bits_alone_and_in_batch(const Problem& batch, const Case& c, const NamedKernel& kernel) {
  const GpuResult first = run_gpu(batch, kernel);
  const GpuResult again = run_gpu(batch, kernel);
  EXPECT_TRUE(first.latent == again.latent) << "latent bits differ between two runs";
  EXPECT_EQ(std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * 4), 0) << "lse bits differ";
  ASSERT_EQ(first.latent.size(), size_t(c.m) * c.heads * L);
  for (int t : {0, c.m / 2, c.m - 1}) {
    Problem alone = make_problem(1, c.heads, c.top_k, batch.blocks, batch.block_size);
    alone.q_scale = batch.q_scale, alone.k_scale = batch.k_scale, alone.softmax_scale = batch.softmax_scale;
    alone.cache = batch.cache;
    std::copy_n(batch.q.begin() + t * batch.q_token_stride, c.heads * L, alone.q.begin());
    std::copy_n(batch.indices.begin() + t * batch.indices_token_stride, c.top_k, alone.indices.begin());
    const GpuResult single = run_gpu(alone, kernel);
    ASSERT_EQ(single.latent.size(), size_t(c.heads) * L);
    EXPECT_TRUE(std::equal(single.latent.begin(), single.latent.end(), first.latent.begin() + size_t(t) * c.heads * L))
        << "token " << t << " alone differs from the same token in a batch of " << c.m;
    EXPECT_EQ(std::memcmp(single.lse.data(), first.lse.data() + t * c.heads, c.heads * 4), 0) << "lse of token " << t;
  }
}

TEST(SparseMlaGpu, RepeatedRunsAndBatchesGiveTheSameBits) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 20);
  // H = 8 (one head group), 64 and 128 (several groups, split clusters).
  // On a 132-SM H200 the 64-head kernel runs H = 64 at m = 8 and H = 128 at
  // m = 4 (8 items) persistent, meeting at counters, and the tokens alone in
  // hardware clusters: the bits must not depend on which. H = 64 at m = 20
  // and 40 runs 4 and 2 CTAs per item, each streaming 4 and 8 consecutive
  // splits of 2 or 3 chunks (K = 2176); at m = 80, 10 items per
  // persistent CTA: the handover barriers' phases carry from item to item.
  // H = 128 at m = 64 (128 items) runs one CTA per item, every split in turn.
  const std::vector<Case> cases =
      testing::quick_mode()
          ? std::vector<Case>{{4, 4, 300}}
          : std::vector<Case>{{8, 16, 2176, 125},  {64, 8, 2176, 125},  {128, 4, 2048},      {64, 20, 2176, 125},
                              {64, 40, 2176, 125}, {64, 80, 2176, 125}, {128, 64, 2176, 125}};
  for (const Case& c : cases) {
    const Problem batch = random_problem(c, /*padded=*/false, 3.0f, rng);
    for (const NamedKernel& kernel : kernels_for(c.heads)) {
      SCOPED_TRACE(kernel.name + " " + describe(c));
      expect_same_bits_alone_and_in_batch(batch, c, kernel);
    }
  }
}

// The tensor-core kernel with a given plan (the default one is tested above).
NamedKernel with_plan(const SparseMlaSplitPlan& plan) {
  return {"sparse_mla splits " + std::to_string(plan.splits) + " x " + std::to_string(plan.rows_per_split),
          [plan](const SparseMlaArgs& a, cudaStream_t stream) { return sparse_mla_with_plan(a, plan, stream); }};
}

SparseMlaSplitPlan plan_with_rows(int heads, int top_k, int rows_per_split) {
  SparseMlaSplitPlan plan;
  plan.head_groups = (heads + 7) / 8;
  plan.rows_per_split = rows_per_split;
  plan.splits = (top_k + rows_per_split - 1) / rows_per_split;
  return plan;
}

// Plans other than the default (splits that do not divide the 512 combine
// vectors, 16-CTA non-portable clusters), K beyond the served 2176 (many
// chunks per CTA, the largest run a CTA stages), head counts that are not a
// multiple of 8 over several groups, and block sizes that are not powers of
// two (the division path), against the float64 reference.
TEST(SparseMlaGpu, OtherPlansLongRowsOddHeadsAndBlockSizes) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 40);
  struct PlanCase {
    Case shape;
    int rows_per_split;  // 0: the default plan
    int64_t block_size;
  };
  const std::vector<PlanCase> cases = {
      {{16, 2, 2176, 125}, 768, 256},  // 3 splits
      {{16, 2, 2176, 125}, 448, 256},  // 5 splits
      {{8, 3, 2048}, 128, 256},        // 16 splits: a non-portable cluster
      {{12, 3, 700}, 0, 48},           // two groups, the second half empty; block size 48
      {{100, 1, 300}, 0, 100},         // 13 groups; block size 100
      {{8, 1, 5000}, 0, 256},          // 8 splits of 640 rows
      {{8, 1, kSparseMlaMaxTopK}, 0, 256},  // 8 splits of 2048 rows, 32 chunks each
  };
  // Quick mode (the sanitizer runs) leaves out the two long rows: under
  // racecheck they take a minute and add no new code path.
  const size_t count = testing::quick_mode() ? cases.size() - 2 : cases.size();
  for (size_t i = 0; i < count; ++i) {
    const PlanCase& pc = cases[i];
    const Case& c = pc.shape;
    SCOPED_TRACE(describe(c) + " block size " + std::to_string(pc.block_size));
    Problem p = random_problem(c, /*padded=*/false, 3.0f, rng);
    if (pc.block_size != p.block_size) {  // the same cache bytes, regrouped into blocks of another size
      const int64_t slots = p.capacity();
      p.block_size = pc.block_size;
      p.blocks = slots / pc.block_size;
      p.block_stride = pc.block_size * L;
      p.cache.resize(size_t(p.blocks) * p.block_stride);
      std::uniform_int_distribution<int32_t> slot(0, int32_t(p.capacity()) - 1);
      for (int t = 0; t < c.m; ++t) {
        for (int j = 0; j < c.top_k - c.padding; ++j) p.index(t, j) = slot(rng);
      }
    }
    const NamedKernel kernel =
        pc.rows_per_split ? with_plan(plan_with_rows(c.heads, c.top_k, pc.rows_per_split)) : kKernels[1];
    expect_close_to_reference(p, run_gpu(p, kernel), reference::sparse_mla(p.host()));
  }
}

// The 64-head kernel with other plans, at K = 2176 (34 chunks): 32 splits
// in 2 clusters of 16 and in 4 of 8 (1-2 chunks each), 24 in 3 of 8, 16 in 4
// of 4, 64 (34) in 8 of 4, 8 in one cluster (no level 2, 4-5 chunks each)
// and 4 (a cluster of 4, 8-9 chunks, the padding's chunks skipped), against
// the float64 reference.
TEST(SparseMlaGpu, WgmmaKernelWithOtherPlans) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 45);
  const Problem p = random_problem(Case{128, 2, 2176, 125}, /*padded=*/true, 3.0f, rng);
  const reference::SparseMlaResult want = reference::sparse_mla(p.host());
  for (const auto& [max_splits, max_cluster] :
       {std::pair{32, 16}, {32, 8}, {24, 8}, {16, 4}, {64, 4}, {8, 16}, {4, 16}}) {
    expect_close_to_reference(p, run_gpu(p, wgmma_plan(max_splits, max_cluster)), want);
  }
}

// Special values spread over splits and chunks: NaN in a late chunk of a late
// split (after finite chunks), a row whose valid entries all lie in the first
// split (the other splits have none), a row with no valid entry over all
// splits, and out-of-range entries counted once with two head groups.
// H = 16 runs the 8-head kernel (two groups, 8 splits of 256 rows); H = 128 the
// 64-head one (two groups, 16 splits of 128 rows in two clusters of 8: entry
// 1900 is split 14's second chunk, in the second cluster, and row 1 leaves 14
// of 16 splits and the whole second cluster without a valid entry).
TEST(SparseMlaGpu, SpecialValuesAcrossSplitsAndChunks) {
  DSA_REQUIRE_GPU();
  for (const int heads : {16, 128}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    std::mt19937_64 rng(testing::test_seed() + 50);
    const int top_k = 2048;
    const int32_t nan_slot = 5;
    Problem p = problem_with_nan_entry(Case{heads, 4, top_k}, /*padded=*/false, nan_slot, 100, rng);
    const int32_t capacity = static_cast<int32_t>(p.capacity());
    p.index(0, 1900) = nan_slot;                                        // a late chunk of a late split
    for (int j = 200; j < top_k; ++j) p.index(1, j) = -1;               // only the first splits have entries
    for (int j = 0; j < top_k; ++j) p.index(2, j) = j % 3 ? -1 : capacity + j;  // none valid, a third out of range
    for (int j = 0; j < top_k; j += 7) p.index(3, j) = capacity;        // out of range, counted once (not per group)
    const reference::SparseMlaResult want = reference::sparse_mla(p.host());
    ASSERT_GT(want.out_of_range, top_k / 3);
    for (const NamedKernel& kernel : kernels_for(heads)) expect_close_to_reference(p, run_gpu(p, kernel), want);
  }
}

// sparse_mla with SparseMlaSplits::kByBatch: not batch invariant by design,
// so not among kKernels (whose tests run tokens alone and in batches).
const NamedKernel kByBatchKernel{"sparse_mla, splits by batch", sparse_mla_with<SparseMlaSplits::kByBatch>};

// kByBatch against float64 at batches where it picks different plans (on
// the H200, H = 64: 16 splits at m = 1, 8 at m = 12 (K = 2176), 4 at 18
// items (H = 128, m = 9) and at m = 36 (K = 2176: 2 would take 17 chunks),
// 2 at m = 40 (K = 2048), the producer kernel at m = 70 (K = 1024 and 128:
// the 2-split plan would take two rounds); H = 8: the first of
// sparse_mla_batch_split_plans (12 splits at K = 2176) at m = 4, kLatency's
// at m = 8, kThroughput's at m = 40), each with the bits of
// the plan it should pick, run explicitly, and the counters zero after.
TEST(SparseMlaGpu, SplitsByBatchTakeThePlanThatFitsTheGpu) {
  DSA_REQUIRE_GPU();
  int resident = 0, producer_resident = 0;
  DSA_ASSERT_OK(sparse_mla_wgmma_resident_ctas(&resident));
  DSA_ASSERT_OK(sparse_mla_producer_resident_ctas(&producer_resident));
  std::mt19937_64 rng(testing::test_seed() + 60);
  const std::vector<Case> cases =
      testing::quick_mode()
          ? std::vector<Case>{{64, 3, 300}, {64, 9, 1024}, {64, 70, 128}, {8, 2, 100}}
          : std::vector<Case>{{64, 1, 2048},  {64, 12, 2176, 125}, {128, 9, 2048}, {64, 36, 2176, 125},
                              {64, 40, 2048}, {64, 70, 1024},      {64, 70, 128},  {8, 4, 2176, 125},
                              {8, 8, 2048},   {8, 40, 2048}};
  // The max_splits kByBatch takes, case by case (64-head cases), 0 for the producer kernel.
  std::vector<int> wgmma_splits;
  std::vector<int> mma_plans;  // which of sparse_mla_batch_split_plans it takes (8-head cases)
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    const Problem p = random_problem(c, /*padded=*/false, 3.0f, rng);
    const reference::SparseMlaResult want = reference::sparse_mla(p.host());
    const GpuResult got = run_gpu(p, kByBatchKernel);
    expect_close_to_reference(p, got, want);
    NamedKernel expected;
    if (c.heads % 64 == 0) {
      const int64_t items = int64_t(c.m) * (c.heads / 64);
      const int max_splits = sparse_mla_wgmma_batch_max_splits(c.top_k, items, resident);
      const bool producer = sparse_mla_batch_takes_producer(c.top_k, items, max_splits, resident, producer_resident);
      wgmma_splits.push_back(producer ? 0 : max_splits);
      expected = producer ? producer_kernel() : wgmma_plan(max_splits, kSparseMlaWgmmaDefaultCluster);
    } else {
      const auto plans = sparse_mla_batch_split_plans(c.heads, c.top_k);
      int chosen = static_cast<int>(plans.size()) - 1;
      for (int i = 0; i < chosen; ++i) {
        int clusters = 0;
        DSA_ASSERT_OK(sparse_mla_max_active_clusters(plans[i], c.heads, c.top_k, &clusters));
        if (int64_t(c.m) * plans[i].head_groups <= clusters) {
          chosen = i;
          break;
        }
      }
      mma_plans.push_back(chosen);
      expected = with_plan(plans[chosen]);
    }
    SCOPED_TRACE("expected: " + expected.name);
    const GpuResult same = run_gpu(p, expected);
    EXPECT_TRUE(got.latent == same.latent) << "latent bits differ from the plan kByBatch should take";
    EXPECT_EQ(std::memcmp(got.lse.data(), same.lse.data(), got.lse.size() * 4), 0) << "lse bits differ";
  }
  if (resident == 132 && !testing::quick_mode()) {  // the H200: the cases reach every plan the comment names
    EXPECT_EQ(wgmma_splits, (std::vector<int>{16, 8, 4, 4, 2, 0, 0}));
  }
  // The 8-head cases reach all three plans where 4 but not 8 clusters of 16
  // and 8 but not 40 of 8 fit (the H200: 7 and 15); other parts differ by
  // how their SMs spread over GPCs.
  const auto plans_2048 = sparse_mla_batch_split_plans(8, 2048);
  int clusters_of_16 = 0, clusters_of_8 = 0;
  DSA_ASSERT_OK(sparse_mla_max_active_clusters(plans_2048[0], 8, 2048, &clusters_of_16));
  DSA_ASSERT_OK(sparse_mla_max_active_clusters(plans_2048[1], 8, 2048, &clusters_of_8));
  if (!testing::quick_mode() && clusters_of_16 >= 4 && clusters_of_16 < 8 && clusters_of_8 >= 8 && clusters_of_8 < 40) {
    EXPECT_EQ(mma_plans, (std::vector<int>{0, 1, 2}));
  }
}

// kWholeRow runs the producer kernel where it covers H and K (the same
// bits as the kernel run directly) and kThroughput's plan elsewhere (H = 8;
// K above 2304), batch invariant either way (RepeatedRunsAndBatchesGiveTheSameBits).
TEST(SparseMlaGpu, WholeRowsTakeTheProducerWhereItCoversTheShape) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 80);
  const NamedKernel throughput = kKernels[3];
  const std::vector<std::pair<Case, const NamedKernel*>> cases = {
      {{64, 3, 2048}, nullptr}, {{128, 2, 300}, nullptr}, {{64, 2, 2500}, &throughput}, {{8, 3, 300}, &throughput}};
  const NamedKernel producer = producer_kernel();
  for (const auto& [c, other] : cases) {
    SCOPED_TRACE(describe(c));
    const Problem p = random_problem(c, /*padded=*/false, 3.0f, rng);
    const GpuResult got = run_gpu(p, kWholeRowKernel);
    expect_close_to_reference(p, got, reference::sparse_mla(p.host()));
    const NamedKernel& expected = other != nullptr ? *other : producer;
    SCOPED_TRACE("expected: " + expected.name);
    const GpuResult same = run_gpu(p, expected);
    EXPECT_TRUE(got.latent == same.latent) << "latent bits differ from the kernel kWholeRow should run";
    EXPECT_EQ(std::memcmp(got.lse.data(), same.lse.data(), got.lse.size() * 4), 0) << "lse bits differ";
  }
}

// A launch captured into a graph and replayed three times over poisoned
// outputs gives the direct launch's bits and leaves the counters zero.
void expect_graph_replays_direct_launch(const NamedKernel& kernel, const SparseMlaArgs& a, cudaStream_t stream,
                                        DeviceBuffer<uint16_t>& latent_dev, DeviceBuffer<float>& lse_dev,
                                        DeviceBuffer<int32_t>& counters_dev) {
  DSA_ASSERT_OK(kernel.run(a, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> direct_latent = latent_dev.download();
  const std::vector<float> direct_lse = lse_dev.download();

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = kernel.run(a, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  latent_dev.fill_bytes(kPoison);
  lse_dev.fill_bytes(kPoison);
  for (int i = 0; i < 3; ++i) DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_TRUE(latent_dev.download() == direct_latent);
  const std::vector<float> replay_lse = lse_dev.download();
  EXPECT_EQ(std::memcmp(replay_lse.data(), direct_lse.data(), direct_lse.size() * 4), 0);
  const std::vector<int32_t> counters = counters_dev.download();
  EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](int32_t v) { return v == 0; }));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// A problem's contiguous device copies and the args over them, with
// split_partials for every plan of the 64-head kernel (at least one value).
struct DeviceProblem {
  DeviceBuffer<uint8_t> q, cache;
  DeviceBuffer<int32_t> indices;
  DeviceBuffer<float> scales;  // q_scale, k_scale
  DeviceBuffer<uint16_t> latent;
  DeviceBuffer<float> lse;
  DeviceBuffer<int32_t> counters;
  DeviceBuffer<float> partials;
  SparseMlaArgs args;

  explicit DeviceProblem(const Problem& p)
      : q(p.q),
        cache(p.cache),
        indices(p.indices),
        scales(std::vector<float>{p.q_scale, p.k_scale}),
        latent(size_t(p.m) * p.heads * L),
        lse(size_t(p.m) * p.heads),
        counters(std::vector<int32_t>(sparse_mla_split_counter_count(p.m, p.heads, p.top_k), 0)),
        partials(std::max<int64_t>(1, largest_partials_count(p.m, p.heads, p.top_k))) {
    args.q = make_tensor(q.get(), DType::kFP8E4M3, {p.m, p.heads, L});
    args.q_scale = make_tensor(scales.get(), DType::kF32, {1});
    args.kv_cache = make_tensor(cache.get(), DType::kFP8E4M3, {p.blocks, p.block_size, L});
    args.k_scale = make_tensor(scales.get() + 1, DType::kF32, {1});
    args.indices = make_tensor(indices.get(), DType::kI32, {p.m, p.top_k});
    args.softmax_scale = p.softmax_scale;
    args.latent = make_tensor(latent.get(), DType::kBF16, {p.m, p.heads, L});
    args.lse = make_tensor(lse.get(), DType::kF32, {p.m, p.heads});
    args.split_counters = make_tensor(counters.get(), DType::kI32, {int64_t(counters.size())});
    args.split_partials = make_tensor(partials.get(), DType::kF32, {int64_t(partials.size())});
  }
};

// PDL: launched right after a kernel that writes q and the index rows late
// (what the absorb and the indexer do in the stage), every kernel reads the
// new values: its bits equal a run on them alone. Two rounds: the first
// launch of each kernel loads its module, which synchronizes.
TEST(SparseMlaGpu, ReadsInputsThatThePreviousKernelWrites) {
  DSA_REQUIRE_GPU();
  constexpr long long kSpinCycles = 200000;  // about 100 us at the H200's clocks
  std::mt19937_64 rng(testing::test_seed() + 40);
  // Quick mode (the sanitizers): K = 1024, as CapturedGraphReplaysTheSameResult below.
  const std::vector<Case> cases = testing::quick_mode() ? std::vector<Case>{{64, 2, 1024}, {8, 2, 1024}}
                                                        : std::vector<Case>{{64, 2, 2048, 125}, {8, 2, 2048, 125}};
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    const Problem p = random_problem(c, /*padded=*/false, 3.0f, rng);
    const Problem old = random_problem(c, /*padded=*/false, 3.0f, rng);  // what the late writer overwrites
    DeviceProblem d(p);
    DeviceBuffer<uint8_t> new_q(p.q);
    DeviceBuffer<int32_t> new_indices(p.indices);
    cudaStream_t stream = nullptr;  // blocking: it orders after the uploads on the legacy stream
    DSA_ASSERT_CUDA(cudaStreamCreate(&stream));
    for (const NamedKernel& kernel : kernels_for(p.heads)) {
      SCOPED_TRACE(kernel.name);
      const GpuResult alone = run_gpu(p, kernel);
      for (int round = 0; round < 2; ++round) {
        d.q.upload(old.q);
        d.indices.upload(old.indices);
        d.latent.fill_bytes(kPoison);
        DSA_ASSERT_CUDA(testing::launch_late_writer(new_q.get(), d.q.get(), int(p.q.size() / 16), new_indices.get(),
                                                    d.indices.get(), int(p.indices.size() * 4 / 16), kSpinCycles, 8,
                                                    256, stream));
        DSA_ASSERT_OK(kernel.run(d.args, stream));
        DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
        EXPECT_TRUE(d.latent.download() == alone.latent) << "round " << round;
        EXPECT_TRUE(d.lse.download() == alone.lse) << "round " << round;
      }
    }
    cudaStreamDestroy(stream);
  }
}

// H = 64 runs the 64-head kernel, H = 8 the 8-head one, each with every
// split choice, at m = 4 and 40.
TEST(SparseMlaGpu, CapturedGraphReplaysTheSameResult) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed() + 30);
  cudaStream_t stream;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // m = 40: kByBatch takes another plan than kLatency (H200: 2 splits at
  // H = 64, the 8-head kernel's throughput plan at H = 8). Quick mode (the
  // sanitizers) keeps m = 4 at K = 1024 (still 16 splits): racecheck over
  // every kernel at m = 40, or at K = 2048 with the whole-row kernel's 32
  // chunks per CTA, outlasts gpu-check's budget, and
  // SplitsByBatchTakeThePlanThatFitsTheGpu already runs those plans under it.
  std::vector<Case> cases = testing::quick_mode() ? std::vector<Case>{{64, 4, 1024}, {8, 4, 1024}}
                                                  : std::vector<Case>{{64, 4, 2048}, {8, 4, 2048}};
  if (!testing::quick_mode()) cases.insert(cases.end(), {Case{64, 40, 2048}, Case{8, 40, 2048}});
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    const Problem p = random_problem(c, /*padded=*/false, 3.0f, rng);
    DeviceProblem d(p);
    std::vector<NamedKernel> kernels = kernels_for(p.heads);
    kernels.push_back(kByBatchKernel);
    for (const NamedKernel& kernel : kernels) {
      SCOPED_TRACE(kernel.name);
      expect_graph_replays_direct_launch(kernel, d.args, stream, d.latent, d.lse, d.counters);
    }
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace dsa
