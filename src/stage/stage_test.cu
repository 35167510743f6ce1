// DsaAttentionStage (include/dsa_decode/stage.h). Without a GPU: the creation
// checks name every missing requirement, supports(), the value-up sets
// (DsaStageChecks.*). On the GPU (DsaStageGpu.*), a glm5next TP8 layer of
// random weights at realistic scales over a context longer than the
// indexer's 2048 tokens: the fused and the stock path against each other
// (KV cache bytes and slots equal, q_fp8 within one FP8 step) and each
// product of the fused path against a float64 CPU computation on the GPU's
// own inputs; graph capture and replay; caller top-k rows; a padded slot
// mapping; the step's argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/numerics.h"
#include "dsa_decode/stage.h"
#include "head_gemv/head_gemv_reference.h"
#include "linear/linear_reference.h"
#include "norm/norm_reference.h"
#include "sparse_mla/sparse_mla_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

// glm5next at TP8 (the shapes of presets.h, per rank).
constexpr int64_t kD = 4096, kH = 8, kQ = 1536, kL = 512, kP = 256, kV = 256;
constexpr int kBlock = 256;

DsaLayerConfig glm5next_tp8() {
  ModelPreset preset, rank;
  EXPECT_TRUE(find_preset("glm5next", &preset).ok());
  EXPECT_TRUE(per_rank(preset, 8, &rank).ok());
  const DsaLayerConfig c = dsa_layer_config(rank, 1e-6f);
  EXPECT_TRUE(c.hidden_size == kD && c.num_heads == kH && c.q_lora_rank == kQ && c.kv_lora_rank == kL &&
              c.qk_nope_head_dim == kP && c.v_head_dim == kV);
  return c;
}

// Views at made-up device addresses: the creation checks read only shapes.
// The indexer's at `index_heads` heads and pools of `pool`.
DsaLayerWeights fake_weights(int64_t index_heads = kIndexerHeads, int64_t pool = kIndexerPoolSize) {
  uintptr_t next = uintptr_t{1} << 40;
  const auto at = [&next](DType dtype, std::initializer_list<int64_t> shape) {
    next += uintptr_t{1} << 32;
    return make_tensor(reinterpret_cast<void*>(next), dtype, shape);
  };
  DsaLayerWeights w;
  w.fused_qkv_a_proj = at(DType::kBF16, {kQ + kL, kD});
  w.q_a_norm = at(DType::kBF16, {kQ});
  w.kv_a_norm = at(DType::kBF16, {kL});
  w.q_b_proj = at(DType::kBF16, {kH * kP, kQ});
  w.w_uk_t = at(DType::kBF16, {kH, kP, kL});
  w.w_uv = at(DType::kBF16, {kH, kL, kV});
  w.o_proj = at(DType::kBF16, {kD, kH * kV});
  w.q_scale = at(DType::kF32, {1});
  w.k_scale = at(DType::kF32, {1});
  w.index_wq_b = at(DType::kBF16, {index_heads * kIndexerDim, kQ});
  w.index_wk = at(DType::kBF16, {kIndexerDim, kD});
  w.index_weights_proj = at(DType::kBF16, {index_heads, kD});
  w.index_compress_gate = at(DType::kBF16, {kIndexerDim, kD});
  w.index_k_norm_weight = at(DType::kF32, {kIndexerDim});
  w.index_k_norm_bias = at(DType::kF32, {kIndexerDim});
  w.index_ape = at(DType::kF32, {pool, kIndexerDim});
  return w;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(DsaStageChecks, CreationNamesEveryMissingRequirement) {
  DsaLayerConfig c = glm5next_tp8();
  c.fuse_qkv_rmsnorm = false;
  c.rotary_embedding = true;  // without RoPE dims
  c.skip_topk = true;
  c.gate_proj = true;
  c.kv_cache_dtype = "auto";
  c.padded_heads = true;
  c.decode_context_parallel_size = 2;
  DsaLayerWeights w = fake_weights();
  w.w_uk_t = make_strided(w.w_uk_t.data, DType::kBF16, {kH, kP, kL}, {kP * kL, 1, kP});  // row-major W_UK
  w.o_proj = TensorView();
  std::unique_ptr<DsaAttentionStage> stage;
  const Status s = DsaAttentionStage::create(c, w, DsaStagePlan(), &stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);  // a view is wrong too
  for (const char* part :
       {"a fused q/kv a-norm", "NoPE", "its own indexer", "no gate or DCP query", "an FP8 KV cache", "got 'auto'",
        "no padding or PCP", "no HiSparse or DCP", "a column-major W_UK", "'o_proj'"}) {
    EXPECT_TRUE(contains(s.message(), part)) << part << " missing from: " << s.message();
  }
  EXPECT_FALSE(contains(s.message(), "'w_uk_t'")) << "named once, as a requirement: " << s.message();
  EXPECT_EQ(stage, nullptr);

  // One feature missing, every view right: that feature alone, kUnsupported.
  c = glm5next_tp8();
  c.rotary_embedding = true;
  const Status rope = DsaAttentionStage::create(c, fake_weights(), DsaStagePlan(), &stage);
  EXPECT_EQ(rope.code(), ErrorCode::kUnsupported);
  EXPECT_EQ(rope.message(),
            "DSA attention stage needs NoPE without a rotary embedding (rotary_embedding false with "
            "qk_rope_head_dim 0)");

  // Views: wrong dtype, wrong shape, and a plan out of range, all in one message.
  w = fake_weights();
  w.q_scale.dtype = DType::kBF16;
  w.index_wk = make_tensor(w.index_wk.data, DType::kBF16, {kIndexerDim, kD + 8});
  DsaStagePlan plan;
  plan.max_tokens = 17;
  plan.value_up_tokens = std::set<int>{0, 2};
  plan.projection_gemv_tokens = std::set<int>{1, 9};  // linear_gemv takes at most 8 tokens
  const Status views = DsaAttentionStage::create(glm5next_tp8(), w, plan, &stage);
  EXPECT_EQ(views.code(), ErrorCode::kInvalidArgument);
  for (const char* part : {"'q_scale'", "'index_wk'", "'plan.max_tokens'", "'plan.value_up_tokens'",
                           "'plan.projection_gemv_tokens'", "1..8, got 9"}) {
    EXPECT_TRUE(contains(views.message(), part)) << part << " missing from: " << views.message();
  }
  // Layouts head_gemv cannot take (overlapping rows, heads sharing rows) and
  // kernel choices out of range: named at creation, not by a step's first run.
  w = fake_weights();
  w.w_uv = make_strided(w.w_uv.data, DType::kBF16, {kH, kL, kV}, {kL * kV, kV / 2, 1});
  w.w_uk_t = make_strided(w.w_uk_t.data, DType::kBF16, {kH, kP, kL}, {0, kL, 1});
  plan = DsaStagePlan();
  plan.head_gemv_sums = static_cast<HeadGemvSums>(7);
  plan.attention_plan = static_cast<SparseMlaPlan>(-1);
  const Status layouts = DsaAttentionStage::create(glm5next_tp8(), w, plan, &stage);
  EXPECT_EQ(layouts.code(), ErrorCode::kInvalidArgument);
  for (const char* part : {"'w_uv'", "'w_uk_t'", "do not overlap", "'plan.head_gemv_sums'", "got 7",
                           "'plan.attention_plan'", "got -1"}) {
    EXPECT_TRUE(contains(layouts.message(), part)) << part << " missing from: " << layouts.message();
  }
  // With value-up always through cuBLAS's bmm, W_UV may take any strides.
  plan = DsaStagePlan();
  plan.value_up_tokens = std::set<int>{};
  w = fake_weights();
  w.w_uv = make_strided(w.w_uv.data, DType::kBF16, {kH, kL, kV}, {kL * kV, kV / 2, 1});
  const Status bmm_only = DsaAttentionStage::create(glm5next_tp8(), w, plan, &stage);
  EXPECT_FALSE(contains(bmm_only.message(), "'w_uv'")) << bmm_only.message();
  stage.reset();
  // A layer requirement without a view at fault: kUnsupported, named.
  c = glm5next_tp8();
  c.softmax_scale = std::nanf("");
  const Status scale = DsaAttentionStage::create(c, fake_weights(), DsaStagePlan(), &stage);
  EXPECT_EQ(scale.code(), ErrorCode::kUnsupported);
  EXPECT_EQ(scale.message(), "DSA attention stage needs a finite softmax_scale > 0");
  // Too many heads: named beside the views whose shapes follow from H.
  c = glm5next_tp8();
  c.num_heads = 129;
  const Status heads = DsaAttentionStage::create(c, fake_weights(), DsaStagePlan(), &stage);
  EXPECT_TRUE(contains(heads.message(), "1..128 heads")) << heads.message();
  plan = DsaStagePlan();
  plan.block_size = 200;  // the indexer's plan: a multiple of 128
  const Status block = DsaAttentionStage::create(glm5next_tp8(), fake_weights(), plan, &stage);
  EXPECT_TRUE(contains(block.message(), "block_size")) << block.message();
  EXPECT_FALSE(DsaAttentionStage::create(glm5next_tp8(), fake_weights(), DsaStagePlan(), nullptr).ok());
}

// A shared workspace's own checks come before any allocation (no GPU needed).
TEST(DsaStageChecks, WorkspaceCreationNamesItsArguments) {
  const DsaLayerConfig config = glm5next_tp8();
  const DsaStagePlan plan;
  std::shared_ptr<DsaStageWorkspace> workspace;
  testing::expect_rejected(DsaStageWorkspace::create(config, plan, nullptr), "workspace", "a pointer to fill");
  DsaLayerConfig no_heads = config;
  no_heads.num_heads = 0;
  testing::expect_rejected(DsaStageWorkspace::create(no_heads, plan, &workspace), "config", "num_heads 0");
  DsaLayerConfig narrow = config;
  narrow.kv_lora_rank = 256;
  testing::expect_rejected(DsaStageWorkspace::create(narrow, plan, &workspace), "config", "kv_lora_rank 256");
  DsaLayerConfig no_hidden = config;
  no_hidden.hidden_size = 0;
  testing::expect_rejected(DsaStageWorkspace::create(no_hidden, plan, &workspace), "config", "hidden_size 0");
  for (const int max_tokens : {0, kDsaStageMaxTokens + 1}) {
    DsaStagePlan bad = plan;
    bad.max_tokens = max_tokens;
    testing::expect_rejected(DsaStageWorkspace::create(config, bad, &workspace), "plan.max_tokens",
                             "1.." + std::to_string(kDsaStageMaxTokens));
  }
  EXPECT_EQ(workspace, nullptr);
}

TEST(DsaStageChecks, SupportsPureDecodeStepsUpToMaxTokens) {
  DsaStagePlan plan;
  plan.max_tokens = 8;
  EXPECT_TRUE(dsa_stage_supports(plan, 1, 1, 1));
  EXPECT_TRUE(dsa_stage_supports(plan, 8, 8, 8));
  EXPECT_FALSE(dsa_stage_supports(plan, 9, 9, 9));  // past max_tokens
  EXPECT_FALSE(dsa_stage_supports(plan, 4, 5, 4));  // the batch holds other tokens
  EXPECT_FALSE(dsa_stage_supports(plan, 4, 4, 3));  // a prefill token among them
  EXPECT_FALSE(dsa_stage_supports(plan, 0, 0, 0));
}

TEST(DsaStageChecks, MeasuredProjectionGemvTokens) {
  EXPECT_EQ(dsa_stage_measured_projection_gemv_tokens(64), (std::set<int>{1}));
  EXPECT_EQ(dsa_stage_measured_projection_gemv_tokens(8), (std::set<int>{1, 2}));
  EXPECT_EQ(dsa_stage_measured_projection_gemv_tokens(32), (std::set<int>{1}));  // not measured: 64 heads' set
}

TEST(DsaStageChecks, MeasuredValueUpTokens) {
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(64, HeadGemvSums::kSeedOrder), (std::set<int>{1, 2}));
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(8, HeadGemvSums::kSeedOrder), (std::set<int>{1, 2, 3, 4}));
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(64, HeadGemvSums::kTensorCores).size(), 8u);
  EXPECT_EQ(dsa_stage_measured_value_up_tokens(8, HeadGemvSums::kTensorCores).size(), 16u);
}

TEST(DsaStageChecks, BatchInvariantPlanRunsValueUpAsHeadGemvAndTheInvariantAttention) {
  DsaStagePlan plan;
  plan.max_tokens = 6;
  EXPECT_EQ(dsa_stage_value_up_tokens(plan, 64), dsa_stage_measured_value_up_tokens(64, plan.head_gemv_sums));
  EXPECT_EQ(dsa_stage_attention_plan(plan), SparseMlaPlan::kAuto);
  plan.value_up_tokens = std::set<int>{2};
  EXPECT_EQ(dsa_stage_value_up_tokens(plan, 64), (std::set<int>{2}));
  plan.batch_invariant = true;
  EXPECT_EQ(dsa_stage_value_up_tokens(plan, 64), (std::set<int>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(dsa_stage_attention_plan(plan), SparseMlaPlan::kBatchInvariant);
}

// The indexer's shape is the plan's: the weights' shapes, the indexer plan
// the stage passes on, and each field's range, named as the plan's field.
TEST(DsaStageChecks, IndexerShapeComesFromThePlan) {
  struct Shape {
    int heads, pool, topk, width;
  };
  for (const Shape& shape : {Shape{16, 16, 2048, 2176}, Shape{64, 8, 1024, 1152}, Shape{32, 4, 2048, 2176},
                             Shape{16, 4, 512, 640}}) {
    const std::string at = std::to_string(shape.heads) + "/" + std::to_string(shape.pool) + "/" +
                           std::to_string(shape.topk);
    DsaStagePlan plan;
    plan.indexer_heads = shape.heads;
    plan.indexer_pool = shape.pool;
    plan.indexer_topk = shape.topk;
    plan.ring = 2 * shape.pool;
    EXPECT_TRUE(check_dsa_stage_indexer_shape(plan).ok()) << at;
    const IndexerPlan indexer = dsa_stage_indexer_plan(plan);
    EXPECT_EQ(indexer.heads, shape.heads) << at;
    EXPECT_EQ(indexer.pool, shape.pool) << at;
    EXPECT_EQ(indexer.topk, shape.topk) << at;
    EXPECT_EQ(indexer.ring, 2 * shape.pool) << at;
    EXPECT_TRUE(check_indexer_plan(indexer).ok()) << at;
    EXPECT_EQ(indexer_row_width(indexer), shape.width) << at;
    // Weights of this shape: no view named (what is left is the device: the
    // workspace's allocation, or success on a GPU).
    std::unique_ptr<DsaAttentionStage> stage;
    const Status right = DsaAttentionStage::create(glm5next_tp8(), fake_weights(shape.heads, shape.pool), plan, &stage);
    EXPECT_FALSE(contains(right.message(), "index_")) << at << ": " << right.message();
    EXPECT_FALSE(contains(right.message(), "plan.")) << at << ": " << right.message();
    stage.reset();
    // The default shape's weights: each of the three shaped views named, with the shape the plan asks for.
    if (shape.heads == kIndexerHeads && shape.pool == kIndexerPoolSize) continue;
    const Status wrong = DsaAttentionStage::create(glm5next_tp8(), fake_weights(), plan, &stage);
    EXPECT_EQ(wrong.code(), ErrorCode::kInvalidArgument) << at;
    if (shape.heads != kIndexerHeads) {
      for (const std::string& part : std::vector<std::string>{
               "'index_wq_b'", std::to_string(shape.heads * kIndexerDim) + ", 1536]", "'index_weights_proj'",
               "[" + std::to_string(shape.heads) + ", 4096]"}) {
        EXPECT_TRUE(contains(wrong.message(), part)) << at << ": " << part << " missing from: " << wrong.message();
      }
    }
    if (shape.pool != kIndexerPoolSize) {
      const std::string part = "[" + std::to_string(shape.pool) + ", 128]";
      EXPECT_TRUE(contains(wrong.message(), "'index_ape'") && contains(wrong.message(), part))
          << at << ": " << wrong.message();
    }
    EXPECT_FALSE(contains(wrong.message(), "'index_wk'")) << at << ": " << wrong.message();
  }

  // Each field out of range: named as the stage plan's field, with what it must be and what it is.
  const auto rejected = [](void (*edit)(DsaStagePlan&), const char* name, const char* expected, const char* got) {
    DsaStagePlan plan;
    edit(plan);
    testing::expect_rejected(check_dsa_stage_indexer_shape(plan), name, expected);
    std::unique_ptr<DsaAttentionStage> stage;
    const Status s = DsaAttentionStage::create(glm5next_tp8(), fake_weights(), plan, &stage);
    EXPECT_TRUE(contains(s.message(), std::string("'") + name + "'") && contains(s.message(), got)) << s.message();
    EXPECT_FALSE(contains(s.message(), "'index_wq_b'")) << "the views follow the shape: " << s.message();
    std::shared_ptr<DsaStageWorkspace> workspace;
    testing::expect_rejected(DsaStageWorkspace::create(glm5next_tp8(), plan, &workspace), name, expected);
  };
  rejected([](DsaStagePlan& p) { p.indexer_heads = 24; }, "plan.indexer_heads", "16, 32 or 64", "got 24");
  rejected([](DsaStagePlan& p) { p.indexer_heads = 0; }, "plan.indexer_heads", "index_n_heads", "got 0");
  rejected([](DsaStagePlan& p) { p.indexer_pool = 2; }, "plan.indexer_pool", "4, 8 or 16", "got 2");
  rejected([](DsaStagePlan& p) { p.indexer_topk = 2050; }, "plan.indexer_topk", "a multiple of plan.indexer_pool = 4",
           "got 2050");
  rejected([](DsaStagePlan& p) { p.indexer_topk = 0; }, "plan.indexer_topk", "from 4 to 2048", "got 0");
  rejected(
      [](DsaStagePlan& p) {
        p.indexer_pool = 16;
        p.indexer_topk = 16 * 513;
      },
      "plan.indexer_topk", "from 16 to 8192", "got 8208");
  // The ring follows the pool: the default RING 4 does not fit pools of 8.
  DsaStagePlan ring;
  ring.indexer_pool = 8;
  std::unique_ptr<DsaAttentionStage> stage;
  const Status s = DsaAttentionStage::create(glm5next_tp8(), fake_weights(kIndexerHeads, 8), ring, &stage);
  EXPECT_TRUE(contains(s.message(), "'plan.ring'") && contains(s.message(), "8 (plan.pool") &&
              contains(s.message(), "got 4"))
      << s.message();
}

TEST(DsaStageChecks, PlanForAPresetTakesItsIndexerShape) {
  ModelPreset preset, rank;
  ASSERT_TRUE(find_preset("glm5next", &preset).ok());
  ASSERT_TRUE(per_rank(preset, 8, &rank).ok());
  DsaStagePlan plan = dsa_stage_plan_for(rank);
  EXPECT_EQ(plan.indexer_heads, rank.index_heads);
  EXPECT_EQ(plan.indexer_pool, rank.pool_size);
  EXPECT_EQ(plan.indexer_topk, rank.topk);
  EXPECT_EQ(plan.ring, rank.pool_size);
  rank.index_heads = 64;
  rank.pool_size = 16;
  rank.topk = 4096;
  plan = dsa_stage_plan_for(rank);
  EXPECT_EQ(plan.indexer_heads, 64);
  EXPECT_EQ(plan.indexer_pool, 16);
  EXPECT_EQ(plan.indexer_topk, 4096);
  EXPECT_EQ(plan.ring, 16);
  EXPECT_TRUE(check_indexer_plan(dsa_stage_indexer_plan(plan)).ok());
  EXPECT_EQ(indexer_row_width(dsa_stage_indexer_plan(plan)), 4096 + 128);
  // A layer with an indexer of any shape has one; an unpooled one on a NoPE
  // layer is refused at creation, naming the plan's pool.
  EXPECT_TRUE(dsa_layer_config(rank, 1e-6f).indexer);
  rank.pool_size = 1;
  rank.topk = 2048;
  EXPECT_TRUE(dsa_layer_config(rank, 1e-6f).indexer);
  plan = dsa_stage_plan_for(rank);
  EXPECT_EQ(plan.ring, 1);
  EXPECT_TRUE(check_dsa_stage_indexer_shape(plan).ok());
  std::unique_ptr<DsaAttentionStage> stage;
  const Status unpooled = DsaAttentionStage::create(glm5next_tp8(), fake_weights(64, 1), plan, &stage);
  EXPECT_TRUE(contains(unpooled.message(), "'plan.indexer_pool': expected 4, 8 or 16 for a NoPE layer"))
      << unpooled.message();
}

// ---------------------------------------------------------------- GPU

std::vector<uint16_t> bf16_normal(size_t count, float mean, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = num::float_to_bf16(normal(rng));
  return bits;
}

// Random e4m3 codes without NaN (0x7F, 0xFF).
std::vector<uint8_t> fp8_codes(size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> codes(count);
  for (uint8_t& c : codes) {
    c = static_cast<uint8_t>(byte(rng));
    if ((c & 0x7F) == 0x7F) c ^= 1;
  }
  return codes;
}

template <class T>
TensorView view(const DeviceBuffer<T>& b, DType dtype, std::initializer_list<int64_t> shape) {
  return make_tensor(b.get(), dtype, shape);
}

// The layer's weights on the GPU, with host copies for the CPU products.
struct Layer {
  int64_t HI, S;  // the indexer's heads and pool size
  std::vector<uint16_t> qkv_a, q_norm, kv_norm, q_b, w_uk_t, w_uv, o_proj, wq_b, wk, weights_proj, gate;
  std::vector<float> scales, k_norm_weight, k_norm_bias, ape;
  DeviceBuffer<uint16_t> d_qkv_a, d_q_norm, d_kv_norm, d_q_b, d_w_uk_t, d_w_uv, d_o_proj, d_wq_b, d_wk, d_weights_proj,
      d_gate;
  DeviceBuffer<float> d_scales, d_k_norm_weight, d_k_norm_bias, d_ape;

  explicit Layer(std::mt19937_64& rng, int64_t index_heads = kIndexerHeads, int64_t pool = kIndexerPoolSize)
      : HI(index_heads), S(pool) {
    // Each product's output near unit scale: weights of stddev in^-0.5.
    qkv_a = bf16_normal(size_t(kQ + kL) * kD, 0, 1 / std::sqrt(float(kD)), rng);
    q_norm = bf16_normal(kQ, 1, 0.1f, rng);
    kv_norm = bf16_normal(kL, 1, 0.1f, rng);
    q_b = bf16_normal(size_t(kH * kP) * kQ, 0, 1 / std::sqrt(float(kQ)), rng);
    w_uk_t = bf16_normal(size_t(kH) * kP * kL, 0, 1 / std::sqrt(float(kP)), rng);
    w_uv = bf16_normal(size_t(kH) * kL * kV, 0, 1 / std::sqrt(float(kL)), rng);
    o_proj = bf16_normal(size_t(kD) * kH * kV, 0, 1 / std::sqrt(float(kH * kV)), rng);
    wq_b = bf16_normal(size_t(HI * kIndexerDim) * kQ, 0, 1 / std::sqrt(float(kQ)), rng);
    wk = bf16_normal(size_t(kIndexerDim) * kD, 0, 1 / std::sqrt(float(kD)), rng);
    weights_proj = bf16_normal(size_t(HI) * kD, 0, 1 / std::sqrt(float(kD)), rng);
    gate = bf16_normal(size_t(kIndexerDim) * kD, 0, 1 / std::sqrt(float(kD)), rng);
    scales = {5.0f / 448, 5.0f / 448};  // q_scale, k_scale: |values| up to ~5 use the FP8 range
    k_norm_weight = testing::normal_floats(kIndexerDim, 1, 0.1f, rng);
    k_norm_bias = testing::normal_floats(kIndexerDim, 0, 0.1f, rng);
    ape = testing::normal_floats(int(S * kIndexerDim), 0, 0.5f, rng);
    for (float* v : {k_norm_weight.data(), k_norm_bias.data()}) {
      for (int i = 0; i < kIndexerDim; ++i) v[i] = num::round_bf16(v[i]);
    }
    d_qkv_a = DeviceBuffer<uint16_t>(qkv_a);
    d_q_norm = DeviceBuffer<uint16_t>(q_norm);
    d_kv_norm = DeviceBuffer<uint16_t>(kv_norm);
    d_q_b = DeviceBuffer<uint16_t>(q_b);
    d_w_uk_t = DeviceBuffer<uint16_t>(w_uk_t);
    d_w_uv = DeviceBuffer<uint16_t>(w_uv);
    d_o_proj = DeviceBuffer<uint16_t>(o_proj);
    d_wq_b = DeviceBuffer<uint16_t>(wq_b);
    d_wk = DeviceBuffer<uint16_t>(wk);
    d_weights_proj = DeviceBuffer<uint16_t>(weights_proj);
    d_gate = DeviceBuffer<uint16_t>(gate);
    d_scales = DeviceBuffer<float>(scales);
    d_k_norm_weight = DeviceBuffer<float>(k_norm_weight);
    d_k_norm_bias = DeviceBuffer<float>(k_norm_bias);
    d_ape = DeviceBuffer<float>(ape);
  }

  DsaLayerWeights weights() const {
    DsaLayerWeights w;
    w.fused_qkv_a_proj = view(d_qkv_a, DType::kBF16, {kQ + kL, kD});
    w.q_a_norm = view(d_q_norm, DType::kBF16, {kQ});
    w.kv_a_norm = view(d_kv_norm, DType::kBF16, {kL});
    w.q_b_proj = view(d_q_b, DType::kBF16, {kH * kP, kQ});
    w.w_uk_t = view(d_w_uk_t, DType::kBF16, {kH, kP, kL});
    w.w_uv = view(d_w_uv, DType::kBF16, {kH, kL, kV});
    w.o_proj = view(d_o_proj, DType::kBF16, {kD, kH * kV});
    w.q_scale = make_tensor(d_scales.get(), DType::kF32, {1});
    w.k_scale = make_tensor(d_scales.get() + 1, DType::kF32, {1});
    w.index_wq_b = view(d_wq_b, DType::kBF16, {HI * kIndexerDim, kQ});
    w.index_wk = view(d_wk, DType::kBF16, {kIndexerDim, kD});
    w.index_weights_proj = view(d_weights_proj, DType::kBF16, {HI, kD});
    w.index_compress_gate = view(d_gate, DType::kBF16, {kIndexerDim, kD});
    w.index_k_norm_weight = view(d_k_norm_weight, DType::kF32, {kIndexerDim});
    w.index_k_norm_bias = view(d_k_norm_bias, DType::kF32, {kIndexerDim});
    w.index_ape = view(d_ape, DType::kF32, {S, kIndexerDim});
    return w;
  }
};

// A step of m tokens, one request each (RING = the pool allows one token per
// request and step), request r at position 2300 + 517 r: every token's indexer
// scores pools (K <= 2048 < L). The KV cache holds random codes, the indexer state is prefilled on
// the GPU from random rows.
struct Step {
  int m;
  std::vector<int64_t> positions, slot_mapping;
  std::vector<int32_t> token_requests, block_table;
  int64_t width = 0, blocks = 0, page_bytes = 0, ring = 0;
  IndexerPlan plan;  // the stage's (dsa_stage_indexer_plan)
  std::vector<uint16_t> hidden;
  std::vector<uint8_t> kv_cache;  // the cache before the step
  DeviceBuffer<uint16_t> d_hidden, d_out, d_ring;
  DeviceBuffer<int64_t> d_positions, d_slot_mapping;
  DeviceBuffer<int32_t> d_token_requests, d_block_table;
  DeviceBuffer<uint8_t> d_kv_cache, d_k_cache;
  DeviceBuffer<unsigned int> d_errors;

  Step(int tokens, const Layer& layer, const DsaStagePlan& stage_plan, std::mt19937_64& rng)
      : m(tokens), ring(stage_plan.ring), plan(dsa_stage_indexer_plan(stage_plan)) {
    for (int r = 0; r < m; ++r) {
      positions.push_back(2300 + 517 * r);
      token_requests.push_back(r);
    }
    width = (positions.back() + 1 + kBlock - 1) / kBlock;
    blocks = m * width + 2;
    std::vector<int32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    block_table.assign(order.begin(), order.begin() + m * width);
    for (int t = 0; t < m; ++t) {
      const int64_t p = positions[t];
      slot_mapping.push_back(int64_t(block_table[t * width + p / kBlock]) * kBlock + p % kBlock);
    }
    hidden = bf16_normal(size_t(m) * kD, 0, 1, rng);
    kv_cache = fp8_codes(size_t(blocks) * kBlock * kL, rng);
    page_bytes = indexer_page_bytes(plan);
    d_hidden = DeviceBuffer<uint16_t>(hidden);
    d_out = DeviceBuffer<uint16_t>(size_t(m) * kD);
    d_positions = DeviceBuffer<int64_t>(positions);
    d_slot_mapping = DeviceBuffer<int64_t>(slot_mapping);
    d_token_requests = DeviceBuffer<int32_t>(token_requests);
    d_block_table = DeviceBuffer<int32_t>(block_table);
    d_kv_cache = DeviceBuffer<uint8_t>(kv_cache);
    d_ring = DeviceBuffer<uint16_t>(std::vector<uint16_t>(size_t(m) * 2 * ring * kIndexerDim, 0));
    d_k_cache = DeviceBuffer<uint8_t>(std::vector<uint8_t>(size_t(blocks) * page_bytes, 0));
    d_errors = DeviceBuffer<unsigned int>(std::vector<unsigned int>{0});
    prefill(layer, rng);
  }

  IndexerState indexer() const {
    return IndexerState{make_tensor(d_block_table.get(), DType::kI32, {m, width}),
                        make_tensor(d_ring.get(), DType::kBF16, {m, 2, ring, kIndexerDim}),
                        make_tensor(d_k_cache.get(), DType::kU8, {blocks, page_bytes})};
  }

  void prefill(const Layer& layer, std::mt19937_64& rng) {
    for (int r = 0; r < m; ++r) {
      const int64_t n = positions[r];
      DeviceBuffer<uint16_t> k(bf16_normal(size_t(n) * kIndexerDim, 0, 1, rng));
      DeviceBuffer<uint16_t> g(bf16_normal(size_t(n) * kIndexerDim, 0, 1, rng));
      IndexerPrefillArgs a;
      a.plan = plan;
      a.index_k = make_tensor(k.get(), DType::kBF16, {n, kIndexerDim});
      a.gate = make_tensor(g.get(), DType::kBF16, {n, kIndexerDim});
      a.k_norm_weight = view(layer.d_k_norm_weight, DType::kF32, {kIndexerDim});
      a.k_norm_bias = view(layer.d_k_norm_bias, DType::kF32, {kIndexerDim});
      a.ape = view(layer.d_ape, DType::kF32, {layer.S, kIndexerDim});
      a.request = r;
      a.state = indexer();
      EXPECT_TRUE(indexer_prefill(a, nullptr).ok());
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }

  DsaStepArgs args() const {
    DsaStepArgs a;
    a.hidden = view(d_hidden, DType::kBF16, {m, kD});
    a.positions = view(d_positions, DType::kI64, {m});
    a.token_requests = view(d_token_requests, DType::kI32, {m});
    a.slot_mapping = make_tensor(d_slot_mapping.get(), DType::kI64, {int64_t(d_slot_mapping.size())});
    a.kv_cache = view(d_kv_cache, DType::kFP8E4M3, {blocks, kBlock, kL});
    a.indexer = indexer();
    a.out = view(d_out, DType::kBF16, {m, kD});
    a.error_count = d_errors.get();
    return a;
  }
};

template <class T>
std::vector<T> download(const TensorView& v) {
  std::vector<T> host(size_t(v.numel()));
  EXPECT_EQ(cudaMemcpy(host.data(), v.data, host.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// What one path left: its outputs and the intermediates the checks read.
struct PathResult {
  std::vector<uint16_t> qkv, q_c, kv_c, q, latent, heads, out;
  std::vector<uint8_t> q_fp8, kv_cache;
  std::vector<int32_t> topk_positions, slots;
  std::vector<float> lse;
  unsigned int errors = 0;
};

PathResult run_path(DsaAttentionStage& stage, Step& step, DsaPath path, const DsaStepArgs& args) {
  step.d_kv_cache.upload(step.kv_cache);
  step.d_out.fill_bytes(0xFF);
  const Status s = path == DsaPath::kFused ? stage.forward(args, nullptr) : stage.stock_forward(args, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const DsaStageIntermediates v = stage.intermediates(step.m);
  PathResult r;
  r.qkv = download<uint16_t>(v.qkv);
  r.q_c = download<uint16_t>(v.q_c);
  r.kv_c = download<uint16_t>(v.kv_c);
  r.q = download<uint16_t>(v.q);
  r.q_fp8 = download<uint8_t>(v.q_fp8);
  r.topk_positions = download<int32_t>(v.topk_positions);
  r.slots = download<int32_t>(v.slots);
  r.latent = download<uint16_t>(v.latent);
  r.lse = download<float>(v.lse);
  r.heads = download<uint16_t>(v.heads);
  r.out = step.d_out.download();
  r.kv_cache = step.d_kv_cache.download();
  r.errors = step.d_errors.download()[0];
  return r;
}

// out[t, j] = sum_i in[t, i] * weight[j, i] in float64 (weight [n, k]).
std::vector<double> linear(const std::vector<uint16_t>& in, int64_t m, int64_t k, const std::vector<uint16_t>& weight,
                           int64_t n) {
  return reference::exact_product(in.data(), m, k, weight.data(), n).sum;
}

// out[t, h, j] = sum_i in[t, h, i] * weight[h, i, j] in float64.
std::vector<double> per_head(const std::vector<uint16_t>& in, int64_t m, int64_t I, const std::vector<uint16_t>& weight,
                             int64_t J) {
  std::vector<double> out(size_t(m) * kH * J, 0.0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t h = 0; h < kH; ++h) {
      double* o = &out[(size_t(t) * kH + h) * J];
      for (int64_t i = 0; i < I; ++i) {
        const double x = num::bf16_to_float(in[(size_t(t) * kH + h) * I + i]);
        const uint16_t* w = &weight[(size_t(h) * I + i) * J];
        for (int64_t j = 0; j < J; ++j) o[j] += x * num::bf16_to_float(w[j]);
      }
    }
  }
  return out;
}

// RMSNorm of float64 rows, as norm.h states it (the BF16 rounding is the checks' tolerance).
std::vector<double> rms_norm(const std::vector<double>& qkv, int64_t m, int64_t offset, int64_t size,
                             const std::vector<uint16_t>& gamma) {
  std::vector<double> out(size_t(m) * size);
  for (int64_t t = 0; t < m; ++t) {
    reference::rms_norm_exact(&qkv[size_t(t) * (kQ + kL) + offset], int(size), gamma.data(), 1e-6f,
                              &out[size_t(t) * size]);
  }
  return out;
}

class DsaStageGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    DSA_REQUIRE_GPU();
    rng_.seed(testing::test_seed());
    layer_ = std::make_unique<Layer>(rng_);
    plan_.max_context = 16384;
    const Status s = DsaAttentionStage::create(glm5next_tp8(), layer_->weights(), plan_, &stage_);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }

  std::mt19937_64 rng_;
  std::unique_ptr<Layer> layer_;
  DsaStagePlan plan_;
  std::unique_ptr<DsaAttentionStage> stage_;
};

// Both paths of one step, each against the other and the fused path's
// products against float64 on the GPU's own inputs.
void expect_paths_agree(DsaAttentionStage& stage, const Layer& layer, Step& step) {
  const int m = step.m;
  const PathResult fused = run_path(stage, step, DsaPath::kFused, step.args());
  const PathResult stock = run_path(stage, step, DsaPath::kStock, step.args());
  const std::string at = "m = " + std::to_string(m);
  EXPECT_EQ(fused.errors, 0u) << at;
  EXPECT_EQ(stock.errors, 0u) << at;

  // Cache: the step's slots written, equal in both paths; nothing else touched.
  EXPECT_TRUE(fused.kv_cache == stock.kv_cache) << at;
  size_t changed_rows = 0;
  for (size_t row = 0; row * kL < step.kv_cache.size(); ++row) {
    const bool changed =
        !std::equal(&fused.kv_cache[row * kL], &fused.kv_cache[row * kL] + kL, &step.kv_cache[row * kL]);
    const bool written = std::count(step.slot_mapping.begin(), step.slot_mapping.end(), int64_t(row)) > 0;
    if (changed) ++changed_rows;
    EXPECT_TRUE(!changed || written) << at << ": cache row " << row << " changed";
  }
  EXPECT_GE(changed_rows, size_t(m) - 1) << at;  // a random row may equal its write by chance only rarely
  for (int t = 0; t < m; ++t) {
    const float k_scale = layer.scales[1];
    const uint8_t* row = &fused.kv_cache[size_t(step.slot_mapping[t]) * kL];
    for (int i = 0; i < kL; ++i) {
      ASSERT_EQ(row[i], num::cache_fp8(fused.kv_c[size_t(t) * kL + i], k_scale))
          << at << " token " << t << " dim " << i;
    }
  }

  // q_fp8 of each path: the rounding (BF16, then the static quant) of the
  // float64 absorb of its own q, within one FP8 step (its FP32 sums are far
  // closer than a step to the float64 ones; a value near a rounding boundary
  // may take the next code).
  const auto ordered = [](int code) { return code & 0x80 ? -(code & 0x7F) : code; };
  for (const PathResult* r : {&fused, &stock}) {
    const reference::HeadGemvHost absorb{r->q.data(), kH * kP, layer.w_uk_t.data(), kP * kL, kL, m, int(kH),
                                         int(kP),     int(kL)};
    const reference::HeadGemvDeviation d =
        reference::head_gemv_deviation(absorb, r->q_fp8.data(), true, layer.scales[0]);
    EXPECT_LE(d.max_steps, 1) << at << (r == &fused ? " fused" : " stock") << ": " << d.differing << " of "
                              << d.compared << " q_fp8 codes off the float64 absorb's";
  }
  // With the same q (q_b_proj through the same kernel), head_gemv's order
  // against cuBLAS's: one FP8 step at most, few codes differ. A GEMV q_b_proj
  // in the fused path gives another q (one BF16 rounding apart), and values
  // near zero, where FP8 codes are dense, then differ by more codes.
  if (fused.q == stock.q) {
    size_t q_differ = 0;
    for (size_t i = 0; i < fused.q_fp8.size(); ++i) {
      ASSERT_LE(std::abs(ordered(fused.q_fp8[i]) - ordered(stock.q_fp8[i])), 1) << at << " q_fp8 " << i;
      q_differ += fused.q_fp8[i] != stock.q_fp8[i];
    }
    EXPECT_LT(q_differ, fused.q_fp8.size() / 20) << at;
  }

  // The indexer's rows: both paths run the same select on the same logits.
  EXPECT_TRUE(fused.slots == stock.slots) << at;
  const int W = indexer_row_width(step.plan);
  ASSERT_EQ(fused.slots.size(), size_t(m) * W) << at;
  for (int t = 0; t < m; ++t) {
    const int32_t* row = &fused.slots[size_t(t) * W];
    EXPECT_EQ(std::count(row, row + W, -1), W - step.plan.topk - int(step.positions[t] + 1) % step.plan.pool)
        << at << " token " << t;
  }

  // Each product of the fused path against float64 on its own inputs.
  const std::vector<double> qkv = linear(step.hidden, m, kD, layer.qkv_a, kQ + kL);
  EXPECT_LT(reference::relative_frobenius(fused.q_c, rms_norm(qkv, m, 0, kQ, layer.q_norm)), 1e-2) << at;
  EXPECT_LT(reference::relative_frobenius(fused.kv_c, rms_norm(qkv, m, kQ, kL, layer.kv_norm)), 1e-2) << at;
  EXPECT_LT(reference::relative_frobenius(fused.q, linear(fused.q_c, m, kQ, layer.q_b, kH * kP)), 4e-3) << at;
  reference::SparseMlaHost attention{fused.q_fp8.data(),
                                     kH * kL,
                                     kL,
                                     fused.kv_cache.data(),
                                     step.blocks,
                                     kBlock,
                                     kBlock * kL,
                                     kL,
                                     fused.slots.data(),
                                     W,
                                     m,
                                     int(kH),
                                     W,
                                     layer.scales[0],
                                     layer.scales[1],
                                     stage.config().softmax_scale};
  const reference::SparseMlaResult want = reference::sparse_mla(attention);
  std::vector<double> want_latent(want.latent.size());
  for (size_t i = 0; i < want.latent.size(); ++i) want_latent[i] = num::bf16_to_float(want.latent[i]);
  EXPECT_LT(reference::relative_frobenius(fused.latent, want_latent), 1e-2) << at;
  for (size_t i = 0; i < want.lse.size(); ++i) EXPECT_NEAR(fused.lse[i], want.lse[i], 1e-3) << at << " lse " << i;
  EXPECT_LT(reference::relative_frobenius(fused.heads, per_head(fused.latent, m, kL, layer.w_uv, kV)), 4e-3) << at;
  EXPECT_LT(reference::relative_frobenius(fused.out, linear(fused.heads, m, kH * kV, layer.o_proj, kD)), 4e-3) << at;
  // The projections that ran as linear_gemv: its fixed order, bit for bit.
  std::vector<std::string> names;
  ASSERT_TRUE(stage.step_names(DsaPath::kFused, step.args(), &names).ok());
  const bool gemv = dsa_stage_measured_projection_gemv_tokens(kH).count(m) > 0;
  EXPECT_EQ(names.front(), gemv ? "qkv_a_proj (GEMV)" : "qkv_a_proj (cuBLASLt)") << at;
  EXPECT_EQ(names.back(), gemv ? "o_proj (GEMV)" : "o_proj (cuBLASLt)") << at;
  EXPECT_TRUE(fused.qkv == stock.qkv) << at;  // one kernel for both paths
  if (gemv) {
    EXPECT_TRUE(fused.qkv == reference::linear_gemv(step.hidden, m, kD, layer.qkv_a, kQ + kL)) << at;
    EXPECT_TRUE(fused.q == reference::linear_gemv(fused.q_c, m, kQ, layer.q_b, kH * kP)) << at;
    EXPECT_TRUE(fused.out == reference::linear_gemv(fused.heads, m, kH * kV, layer.o_proj, kD)) << at;
  }

  // The stock path's output: its q_fp8 differs in a few codes, so within the attention's tolerance.
  std::vector<double> fused_out(fused.out.size());
  for (size_t i = 0; i < fused.out.size(); ++i) fused_out[i] = num::bf16_to_float(fused.out[i]);
  EXPECT_LT(reference::relative_frobenius(stock.out, fused_out), 2e-2) << at;
}

TEST_F(DsaStageGpu, FusedAndStockAgreeWithTheReferences) {
  const std::vector<int> counts = testing::quick_mode() ? std::vector<int>{1, 5} : std::vector<int>{1, 2, 5, 16};
  for (int m : counts) {
    Step step(m, *layer_, plan_, rng_);
    expect_paths_agree(*stage_, *layer_, step);
    if (HasFatalFailure()) return;
  }
}

// m = 2: the projections as linear_gemv (at 8 heads); m = 4: through cuBLASLt.
TEST_F(DsaStageGpu, StepCapturesIntoAGraphAndReplaysTheSameBits) {
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int m : {2, 4}) {
    Step step(m, *layer_, plan_, rng_);
    const DsaStepArgs args = step.args();
    for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
      const PathResult once = run_path(*stage_, step, path, args);
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const Status captured =
          path == DsaPath::kFused ? stage_->forward(args, stream) : stage_->stock_forward(args, stream);
      DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
      DSA_ASSERT_OK(captured);
      DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 3; ++replay) {
        step.d_kv_cache.upload(step.kv_cache);
        step.d_out.fill_bytes(0xFF);
        DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
        DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
        EXPECT_TRUE(step.d_out.download() == once.out)
            << (path == DsaPath::kFused ? "fused" : "stock") << " m = " << m << " replay " << replay;
        EXPECT_TRUE(step.d_kv_cache.download() == once.kv_cache);
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
  }
  cudaStreamDestroy(stream);
}

// plan.overlap_indexer only moves the indexer's launches to a second
// stream: every product, the caches and the indexer's state keep their bits.
// The stock path runs the same select: the same slots.
TEST_F(DsaStageGpu, IndexerOnItsOwnStreamGivesTheSerialBits) {
  DsaStagePlan serial_plan = plan_;
  serial_plan.overlap_indexer = false;
  std::unique_ptr<DsaAttentionStage> serial;
  DSA_ASSERT_OK(DsaAttentionStage::create(glm5next_tp8(), layer_->weights(), serial_plan, &serial));
  for (int m : {1, 5}) {
    Step step(m, *layer_, plan_, rng_);
    const std::string at = "m = " + std::to_string(m);
    std::vector<std::string> overlapped_names, serial_names;
    DSA_ASSERT_OK(stage_->step_names(DsaPath::kFused, step.args(), &overlapped_names));
    DSA_ASSERT_OK(serial->step_names(DsaPath::kFused, step.args(), &serial_names));
    ASSERT_EQ(overlapped_names.size(), serial_names.size());
    EXPECT_TRUE(contains(overlapped_names[2], "indexer projections")) << overlapped_names[2];  // issued after the norm
    EXPECT_TRUE(contains(serial_names[2], "q_b_proj")) << serial_names[2];

    const PathResult a = run_path(*stage_, step, DsaPath::kFused, step.args());
    const std::vector<uint16_t> ring_a = step.d_ring.download();
    const std::vector<uint8_t> k_cache_a = step.d_k_cache.download();
    const PathResult b = run_path(*serial, step, DsaPath::kFused, step.args());
    EXPECT_TRUE(a.q_c == b.q_c && a.kv_c == b.kv_c && a.q == b.q) << at;
    EXPECT_TRUE(a.q_fp8 == b.q_fp8 && a.kv_cache == b.kv_cache) << at;
    EXPECT_TRUE(a.slots == b.slots) << at;
    EXPECT_TRUE(a.latent == b.latent && a.lse == b.lse && a.heads == b.heads && a.out == b.out) << at;
    EXPECT_TRUE(ring_a == step.d_ring.download() && k_cache_a == step.d_k_cache.download()) << at;
    EXPECT_EQ(a.errors, 0u) << at;

    std::vector<std::string> stock_names;
    DSA_ASSERT_OK(serial->step_names(DsaPath::kStock, step.args(), &stock_names));
    EXPECT_EQ(std::count(stock_names.begin(), stock_names.end(), "indexer select (top-k positions kept)"), 1);
    const PathResult stock = run_path(*serial, step, DsaPath::kStock, step.args());
    EXPECT_TRUE(stock.slots == a.slots && stock.kv_cache == a.kv_cache) << at;
  }

  // A range that ends on the indexer's stream still returns joined: a
  // capture of it ends (an unjoined fork would fail cudaStreamEndCapture).
  // So does a range that starts inside it, and one whose lane step fails.
  Step step(2, *layer_, plan_, rng_);
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DSA_ASSERT_OK(stage_->run_steps(DsaPath::kFused, step.args(), 0, 4, stream));  // uncaptured first
  DSA_ASSERT_OK(stage_->run_steps(DsaPath::kFused, step.args(), 3, 3, stream));  // prepare, select, q_b_proj
  const DsaStepArgs good = step.args();
  DsaStepArgs bad = step.args();
  bad.positions = make_tensor(step.d_positions.get(), DType::kI32, {2});  // prepare, on the lane, refuses it
  const DsaStepArgs* const cases[] = {&good, &bad};
  for (const DsaStepArgs* args : cases) {
    cudaGraph_t graph = nullptr;
    DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status captured =
        args == &bad ? stage_->forward(bad, stream) : stage_->run_steps(DsaPath::kFused, *args, 0, 4, stream);
    DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    if (args == &bad) {
      EXPECT_FALSE(captured.ok());
      EXPECT_TRUE(contains(captured.message(), "'positions'")) << captured.message();
    } else {
      DSA_ASSERT_OK(captured);
    }
    cudaGraphDestroy(graph);
  }
  DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
  cudaStreamDestroy(stream);
}

// plan.batch_invariant: each token of a step alone (m = 1, its own rows of
// every input, the same caches and indexer state) gives the bits it gives in
// the step of m tokens, at every m up to 16: projections, value-up and
// attention take their invariant kernels.
TEST_F(DsaStageGpu, BatchInvariantPlanGivesATokenAloneItsBitsInTheBatch) {
  DsaStagePlan invariant_plan = plan_;
  invariant_plan.batch_invariant = true;
  std::unique_ptr<DsaAttentionStage> stage;
  DSA_ASSERT_OK(DsaAttentionStage::create(glm5next_tp8(), layer_->weights(), invariant_plan, &stage));
  const std::vector<int> counts = testing::quick_mode() ? std::vector<int>{5} : std::vector<int>{3, 9, 16};
  for (int m : counts) {
    Step step(m, *layer_, invariant_plan, rng_);
    const PathResult batch = run_path(*stage, step, DsaPath::kFused, step.args());
    EXPECT_EQ(batch.errors, 0u);
    for (int t = 0; t < m; ++t) {
      const std::string at = "m = " + std::to_string(m) + ", token " + std::to_string(t);
      DsaStepArgs alone = step.args();
      alone.hidden = make_tensor(step.d_hidden.get() + size_t(t) * kD, DType::kBF16, {1, kD});
      alone.positions = make_tensor(step.d_positions.get() + t, DType::kI64, {1});
      alone.token_requests = make_tensor(step.d_token_requests.get() + t, DType::kI32, {1});
      alone.slot_mapping = make_tensor(step.d_slot_mapping.get() + t, DType::kI64, {1});
      alone.out = make_tensor(step.d_out.get() + size_t(t) * kD, DType::kBF16, {1, kD});
      step.d_kv_cache.upload(step.kv_cache);
      step.d_out.fill_bytes(0xFF);
      DSA_ASSERT_OK(stage->forward(alone, nullptr));
      DSA_ASSERT_CUDA(cudaDeviceSynchronize());
      const DsaStageIntermediates v = stage->intermediates(1);
      const std::vector<uint16_t> out = step.d_out.download();
      const auto row = [&](const std::vector<uint16_t>& all, int64_t width, int64_t r) {
        return std::vector<uint16_t>(all.begin() + r * width, all.begin() + (r + 1) * width);
      };
      EXPECT_TRUE(row(out, kD, t) == row(batch.out, kD, t)) << at << ": out";
      EXPECT_TRUE(download<uint16_t>(v.latent) == row(batch.latent, kH * kL, t)) << at << ": latent";
      EXPECT_TRUE(download<int32_t>(v.slots) ==
                  std::vector<int32_t>(batch.slots.begin() + size_t(t) * indexer_row_width(step.plan),
                                       batch.slots.begin() + size_t(t + 1) * indexer_row_width(step.plan)))
          << at << ": slots";
    }
  }
}

// Stages of one configuration and plan can share one workspace (the layers
// of a model on one stream): each gives the bits it gives with its own, in
// either order; a workspace made for another plan is refused by name.
TEST_F(DsaStageGpu, StagesShareOneWorkspace) {
  std::shared_ptr<DsaStageWorkspace> shared;
  DSA_ASSERT_OK(DsaStageWorkspace::create(glm5next_tp8(), plan_, &shared));
  std::mt19937_64 other_rng(testing::test_seed() + 1);
  const Layer other(other_rng);
  std::unique_ptr<DsaAttentionStage> first, second, second_alone;
  DSA_ASSERT_OK(DsaAttentionStage::create(glm5next_tp8(), layer_->weights(), plan_, &first, shared));
  DSA_ASSERT_OK(DsaAttentionStage::create(glm5next_tp8(), other.weights(), plan_, &second, first->workspace()));
  EXPECT_EQ(second->workspace(), shared);
  DSA_ASSERT_OK(DsaAttentionStage::create(glm5next_tp8(), other.weights(), plan_, &second_alone));
  for (int m : {1, 5}) {
    Step step(m, *layer_, plan_, rng_);
    const std::string at = "m = " + std::to_string(m);
    const PathResult own_first = run_path(*stage_, step, DsaPath::kFused, step.args());
    const PathResult own_second = run_path(*second_alone, step, DsaPath::kFused, step.args());
    const PathResult shared_second = run_path(*second, step, DsaPath::kFused, step.args());
    const PathResult shared_first = run_path(*first, step, DsaPath::kFused, step.args());
    EXPECT_TRUE(shared_first.out == own_first.out && shared_first.kv_cache == own_first.kv_cache) << at;
    EXPECT_TRUE(shared_second.out == own_second.out && shared_second.slots == own_second.slots) << at;
    EXPECT_FALSE(own_first.out == own_second.out) << at << ": the two layers' weights differ";
    const PathResult shared_stock = run_path(*first, step, DsaPath::kStock, step.args());
    const PathResult own_stock = run_path(*stage_, step, DsaPath::kStock, step.args());
    EXPECT_TRUE(shared_stock.out == own_stock.out) << at;
  }
  DsaStagePlan longer = plan_;
  longer.max_tokens = 8;
  std::unique_ptr<DsaAttentionStage> refused;
  testing::expect_rejected(DsaAttentionStage::create(glm5next_tp8(), layer_->weights(), longer, &refused, shared),
                           "workspace", "max_tokens 8");
  EXPECT_EQ(refused, nullptr);
}

TEST_F(DsaStageGpu, CallerTopkRowsSkipTheIndexerAndGiveTheSameStep) {
  Step step(3, *layer_, plan_, rng_);
  const PathResult stock = run_path(*stage_, step, DsaPath::kStock, step.args());  // writes topk_positions
  const PathResult fused = run_path(*stage_, step, DsaPath::kFused, step.args());
  DeviceBuffer<int32_t> rows(stock.topk_positions);
  DsaStepArgs args = step.args();
  args.topk_positions = make_tensor(rows.get(), DType::kI32, {3, indexer_row_width(step.plan)});
  std::vector<std::string> names;
  DSA_ASSERT_OK(stage_->step_names(DsaPath::kFused, args, &names));
  EXPECT_TRUE(std::count(names.begin(), names.end(), "top-k remap") == 1);
  EXPECT_TRUE(std::count(names.begin(), names.end(), "indexer select") == 0);
  // The indexer's state is not touched by a step with caller rows (stage.h).
  const std::vector<uint16_t> ring_before = step.d_ring.download();
  const std::vector<uint8_t> k_cache_before = step.d_k_cache.download();
  const PathResult reused = run_path(*stage_, step, DsaPath::kFused, args);
  EXPECT_TRUE(step.d_ring.download() == ring_before);
  EXPECT_TRUE(step.d_k_cache.download() == k_cache_before);
  EXPECT_TRUE(reused.slots == fused.slots);
  EXPECT_TRUE(reused.out == fused.out);
  EXPECT_EQ(reused.errors, 0u);
  // A position from the future remaps to -1 and is counted.
  std::vector<int32_t> future = stock.topk_positions;
  future[5] = static_cast<int32_t>(step.positions[0] + 1);
  rows.upload(future);
  const PathResult counted = run_path(*stage_, step, DsaPath::kFused, args);
  EXPECT_EQ(counted.slots[5], -1);
  EXPECT_GT(counted.errors, 0u);
}

TEST_F(DsaStageGpu, PaddedSlotMappingWritesOnlyRealSlots) {
  Step step(4, *layer_, plan_, rng_);
  const int64_t skipped = step.slot_mapping[1];
  std::vector<int64_t> padded = step.slot_mapping;
  padded[1] = -1;                          // token 1 is a padding token of the cache write
  padded.push_back(step.slot_mapping[2]);  // CUDA-graph padding past m: never read
  step.slot_mapping = padded;
  step.d_slot_mapping = DeviceBuffer<int64_t>(padded);
  const PathResult fused = run_path(*stage_, step, DsaPath::kFused, step.args());
  const PathResult stock = run_path(*stage_, step, DsaPath::kStock, step.args());
  EXPECT_TRUE(
      std::equal(&fused.kv_cache[skipped * kL], &fused.kv_cache[skipped * kL] + kL, &step.kv_cache[skipped * kL]));
  EXPECT_TRUE(fused.kv_cache == stock.kv_cache);
  EXPECT_EQ(fused.errors, 0u);
}

TEST_F(DsaStageGpu, StepArgumentsAreCheckedByName) {
  Step step(2, *layer_, plan_, rng_);
  DsaStepArgs args = step.args();
  args.hidden = make_tensor(step.d_hidden.get(), DType::kBF16, {17, kD});
  testing::expect_rejected(stage_->forward(args, nullptr), "hidden", "max_tokens");
  args = step.args();
  args.out = args.hidden;
  testing::expect_rejected(stage_->forward(args, nullptr), "out", "disjoint");
  args = step.args();
  // Over the KV cache: refused by both paths, whatever kernel o_proj runs at this m.
  args.out = make_tensor(step.d_kv_cache.get(), DType::kBF16, {2, kD});
  testing::expect_rejected(stage_->forward(args, nullptr), "out", "memory disjoint from 'kv_cache'");
  testing::expect_rejected(stage_->stock_forward(args, nullptr), "out", "memory disjoint from 'kv_cache'");
  args = step.args();
  args.kv_cache = make_tensor(step.d_kv_cache.get(), DType::kFP8E4M3, {step.blocks * 2, kBlock / 2, kL});
  testing::expect_rejected(stage_->stock_forward(args, nullptr), "kv_cache", "block_size");
  args = step.args();
  args.positions = make_tensor(step.d_positions.get(), DType::kI32, {2});
  const Status s = stage_->forward(args, nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.message(), "'positions'")) << s.message();
  args = step.args();
  std::vector<std::string> names;
  DSA_ASSERT_OK(stage_->step_names(DsaPath::kStock, args, &names));
  // The longest path, whole: the stock order with the indexer ends at o_proj.
  ASSERT_EQ(names.size(), 13u);
  EXPECT_EQ(names.back(), "o_proj (cuBLASLt)");
  EXPECT_EQ(names[names.size() - 2], "value_up (cuBLAS bmm)");
  testing::expect_rejected(stage_->run_steps(DsaPath::kStock, args, 2, names.size(), nullptr), "first, count",
                           "within");
}

// The stage at indexer shapes other than the default, each a layer of its
// own (16 heads, pools of 16, top-2048: rows 2176; 64 heads, pools of 8,
// top-1024: rows 1152): both paths against each other and the references.
TEST(DsaStageGpuShapes, FusedAndStockAgreeAtOtherIndexerShapes) {
  DSA_REQUIRE_GPU();
  struct Shape {
    int heads, pool, topk;
  };
  for (const Shape& shape : {Shape{16, 16, 2048}, Shape{64, 8, 1024}}) {
    SCOPED_TRACE(std::to_string(shape.heads) + " heads, pools of " + std::to_string(shape.pool) + ", top-" +
                 std::to_string(shape.topk));
    std::mt19937_64 rng(testing::test_seed());
    const Layer layer(rng, shape.heads, shape.pool);
    DsaStagePlan plan;
    plan.max_context = 16384;
    plan.indexer_heads = shape.heads;
    plan.indexer_pool = shape.pool;
    plan.indexer_topk = shape.topk;
    plan.ring = shape.pool;
    std::unique_ptr<DsaAttentionStage> stage;
    DSA_ASSERT_OK(DsaAttentionStage::create(glm5next_tp8(), layer.weights(), plan, &stage));
    const DsaStageIntermediates v = stage->intermediates(2);
    EXPECT_EQ(v.index_q.size(1), shape.heads);
    EXPECT_EQ(v.head_weights.size(1), shape.heads);
    EXPECT_EQ(v.slots.size(1), indexer_row_width(dsa_stage_indexer_plan(plan)));
    EXPECT_EQ(v.index_logits.size(1), (plan.max_context + shape.pool - 1) / shape.pool);
    for (int m : testing::quick_mode() ? std::vector<int>{2} : std::vector<int>{1, 3, 16}) {
      Step step(m, layer, plan, rng);
      expect_paths_agree(*stage, layer, step);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace dsa
