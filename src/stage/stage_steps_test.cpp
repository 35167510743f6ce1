// The stage's step lists (stage_steps.h) for the plans the stage takes,
// without a GPU: which kernel each projection and the value-up run at m,
// where the indexer's lane sits, the caller rows' remap, the stock path's
// 13 steps; a RoPE layer's lists (rope_absorb, the 656-byte cache write,
// sparse_mla_v32). CPU tests: StageSteps.*.
#include "stage/stage_steps.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace dsa {
namespace {

// glm5next at TP1 (64 heads) with the measured sets.
StepChoices tp1() {
  StepChoices c;
  c.value_up_tokens = dsa_stage_measured_value_up_tokens(64, HeadGemvSums::kSeedOrder);
  c.projection_gemv_tokens = dsa_stage_measured_projection_gemv_tokens(64);
  c.hidden = 4096;
  c.q_lora = 1536;
  c.heads_v = 64 * 256;
  return c;
}

std::vector<std::string> names(DsaPath path, const StepChoices& c, int64_t m, bool caller_rows = false) {
  const StepList list = stage_steps(path, c, m, caller_rows);
  std::vector<std::string> out;
  for (int i = 0; i < list.count; ++i) out.push_back(step_name(list.steps[i], false));
  return out;
}

using Names = std::vector<std::string>;

TEST(StageSteps, FusedPathIssuesTheIndexerLaneAfterTheNorm) {
  EXPECT_EQ(names(DsaPath::kFused, tp1(), 1),
            (Names{"qkv_a_proj (GEMV)", "norm", "indexer projections (GEMV)", "indexer prepare", "indexer select",
                   "q_b_proj (GEMV)", "absorb + cache write (head_gemv)", "attention (sparse_mla)",
                   "value_up (head_gemv)", "o_proj (GEMV)"}));
  EXPECT_EQ(names(DsaPath::kFused, tp1(), 4),
            (Names{"qkv_a_proj (cuBLASLt)", "norm", "indexer projections (GEMV)", "indexer prepare", "indexer select",
                   "q_b_proj (cuBLASLt)", "absorb + cache write (head_gemv)", "attention (sparse_mla)",
                   "value_up (cuBLAS bmm)", "o_proj (cuBLASLt)"}));
  const StepList list = stage_steps(DsaPath::kFused, tp1(), 1, false);
  for (int i = 0; i < list.count; ++i) EXPECT_EQ(on_indexer_lane(list.steps[i]), i >= 2 && i <= 4) << i;
}

TEST(StageSteps, WithoutTheOverlapTheIndexerFollowsTheAbsorb) {
  StepChoices c = tp1();
  c.overlap_indexer = false;
  const Names n = names(DsaPath::kFused, c, 1);
  ASSERT_EQ(n.size(), 10u);
  EXPECT_EQ(n[2], "q_b_proj (GEMV)");
  EXPECT_EQ(n[3], "absorb + cache write (head_gemv)");
  EXPECT_EQ(n[4], "indexer projections (GEMV)");
  EXPECT_EQ(n[6], "indexer select");
}

TEST(StageSteps, ProjectionsRunAsGemvWhereTheKernelTakesThem) {
  StepChoices c = tp1();
  c.projection_gemv_tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  const Names four = names(DsaPath::kFused, c, 4);
  EXPECT_EQ(four.front(), "qkv_a_proj (GEMV)");
  EXPECT_EQ(four[5], "q_b_proj (GEMV)");
  EXPECT_EQ(four.back(), "o_proj (GEMV)");
  // o_proj at TP1 reads K = 16384: past m = 4 its rows no longer fit in shared memory.
  const Names five = names(DsaPath::kFused, c, 5);
  EXPECT_EQ(five.front(), "qkv_a_proj (GEMV)");
  EXPECT_EQ(five[5], "q_b_proj (GEMV)");
  EXPECT_EQ(five.back(), "o_proj (cuBLASLt)");
  c.projection_gemv_tokens.clear();
  EXPECT_EQ(names(DsaPath::kFused, c, 1).front(), "qkv_a_proj (cuBLASLt)");
}

TEST(StageSteps, CallerRowsReplaceTheIndexerByTheRemap) {
  const Names fused = names(DsaPath::kFused, tp1(), 2, true);
  EXPECT_EQ(fused.size(), 8u);
  EXPECT_EQ(fused[2], "top-k remap");
  EXPECT_TRUE(on_indexer_lane(Step::kTopkRemap));
  const Names stock = names(DsaPath::kStock, tp1(), 2, true);
  EXPECT_EQ(stock.size(), 11u);
  EXPECT_EQ(stock[3], "top-k remap");
}

TEST(StageSteps, StockPathKeepsTheStockKernels) {
  const Names stock = names(DsaPath::kStock, tp1(), 1);
  EXPECT_EQ(stock, (Names{"qkv_a_proj (GEMV)", "norm", "q_b_proj (cuBLASLt)", "indexer projections (GEMV)",
                          "indexer prepare", "indexer select (top-k positions kept)", "cache write (concat_and_cache_mla)",
                          "absorb (cuBLAS bmm)", "static FP8 quant", "split counter memset", "attention (sparse_mla)",
                          "value_up (cuBLAS bmm)", "o_proj (cuBLASLt)"}));
  EXPECT_EQ(stock.size(), size_t(kMaxSteps));  // the longest list
}

TEST(StageSteps, BatchInvariantRunsEveryProjectionAndValueUpAsGemvAtEveryM) {
  StepChoices c = tp1();
  c.batch_invariant = true;
  c.value_up_tokens = {};
  c.projection_gemv_tokens = {};
  for (int64_t m : {1, 5, 16}) {
    const Names fused = names(DsaPath::kFused, c, m);
    EXPECT_EQ(fused.front(), "qkv_a_proj (GEMV)") << m;
    EXPECT_EQ(std::count(fused.begin(), fused.end(), "q_b_proj (GEMV)"), 1) << m;
    EXPECT_EQ(std::count(fused.begin(), fused.end(), "value_up (head_gemv)"), 1) << m;
    EXPECT_EQ(fused.back(), "o_proj (GEMV)") << m;
  }
  const Names stock = names(DsaPath::kStock, c, 16);
  EXPECT_EQ(stock.front(), "qkv_a_proj (GEMV)") << "one qkv_a_proj kernel for both paths";
  EXPECT_EQ(stock.back(), "o_proj (cuBLASLt)") << "the stock path keeps the stock kernels";
}

// dsv32 at TP8 (16 heads, D = 7168, V = 128): a RoPE layer.
StepChoices dsv32_tp8() {
  StepChoices c;
  c.rope = true;
  c.value_up_tokens = dsa_stage_measured_value_up_tokens(16, HeadGemvSums::kTensorCores);
  c.projection_gemv_tokens = dsa_stage_measured_projection_gemv_tokens(16);
  c.hidden = 7168;
  c.q_lora = 1536;
  c.heads_v = 16 * 128;
  return c;
}

TEST(StageSteps, RopeFusedPathRunsRopeAbsorbTheV32CacheWriteAndAttention) {
  EXPECT_EQ(names(DsaPath::kFused, dsv32_tp8(), 1),
            (Names{"qkv_a_proj (GEMV)", "norm", "indexer projections (GEMV)", "indexer prepare", "indexer select",
                   "q_b_proj (GEMV)", "rope_absorb (absorb + RoPE)", "cache write (656-byte, sparse_mla_v32)",
                   "attention (sparse_mla_v32)", "value_up (head_gemv)", "o_proj (GEMV)"}));
  const StepList list = stage_steps(DsaPath::kFused, dsv32_tp8(), 1, false);
  for (int i = 0; i < list.count; ++i) EXPECT_EQ(on_indexer_lane(list.steps[i]), i >= 2 && i <= 4) << i;
  // Without the overlap the indexer follows the cache write, before the attention.
  StepChoices serial = dsv32_tp8();
  serial.overlap_indexer = false;
  const Names n = names(DsaPath::kFused, serial, 4);
  ASSERT_EQ(n.size(), 11u);
  EXPECT_EQ(n[2], "q_b_proj (cuBLASLt)");
  EXPECT_EQ(n[4], "cache write (656-byte, sparse_mla_v32)");
  EXPECT_EQ(n[5], "indexer projections (GEMV)");
  EXPECT_EQ(n[8], "attention (sparse_mla_v32)");
  // Caller rows: the remap in the indexer's place.
  const Names rows = names(DsaPath::kFused, dsv32_tp8(), 2, true);
  EXPECT_EQ(rows.size(), 9u);
  EXPECT_EQ(rows[2], "top-k remap");
}

TEST(StageSteps, RopeStockPathRunsTheEnginesOrder) {
  EXPECT_EQ(names(DsaPath::kStock, dsv32_tp8(), 1),
            (Names{"qkv_a_proj (GEMV)", "norm", "q_b_proj (cuBLASLt)", "rope_absorb (absorb + RoPE)",
                   "indexer projections (GEMV)", "indexer prepare", "indexer select (top-k positions kept)",
                   "cache write (656-byte, sparse_mla_v32)", "attention (sparse_mla_v32)", "value_up (cuBLAS bmm)",
                   "o_proj (cuBLASLt)"}));
  EXPECT_EQ(names(DsaPath::kStock, dsv32_tp8(), 3, true)[4], "top-k remap");
  // No NoPE step on either path.
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    for (const std::string& name : names(path, dsv32_tp8(), 5)) {
      EXPECT_TRUE(name.find("head_gemv)") == std::string::npos || name == "value_up (head_gemv)") << name;
      EXPECT_NE(name, "attention (sparse_mla)");
      EXPECT_NE(name, "static FP8 quant");
      EXPECT_NE(name, "split counter memset");
    }
  }
}

TEST(StageSteps, RopeBatchInvariantRunsGemvAtEveryM) {
  StepChoices c = dsv32_tp8();
  c.batch_invariant = true;
  c.value_up_tokens = {};
  c.projection_gemv_tokens = {};
  for (int64_t m : {1, 9, 16}) {
    const Names fused = names(DsaPath::kFused, c, m);
    EXPECT_EQ(fused.front(), "qkv_a_proj (GEMV)") << m;
    EXPECT_EQ(fused[5], "q_b_proj (GEMV)") << m;
    EXPECT_EQ(fused[9], "value_up (head_gemv)") << m;
    EXPECT_EQ(fused.back(), "o_proj (GEMV)") << m;
  }
}

}  // namespace
}  // namespace dsa
