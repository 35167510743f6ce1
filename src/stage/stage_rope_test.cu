// DsaAttentionStage at the RoPE presets (include/dsa_decode/stage.h: dsv32,
// glm5). Without a GPU (DsaStageRopeChecks.*): the presets' configurations
// and plans, creation accepting their weights and naming every RoPE
// requirement that fails (the rotaries, R, the indexer's pool, the weights'
// shapes at R > 0), the workspace's checks. On the GPU (DsaStageRopeGpu.*), a
// dsv32 TP8 layer of random weights over contexts longer than the indexer's
// 2048 tokens: the fused path against the same kernels chained one by one
// (bit for bit), each product of both paths against its CPU reference on the
// path's own inputs (the bounds dsa-decode's RoPE chain uses), fused against
// stock, graph capture, batch invariance, caller rows; glm5 TP8 the same way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "dsa_decode/stage.h"
#include "linear/linear_reference.h"
#include "norm/norm_reference.h"
#include "rope/rope_reference.h"
#include "sparse_mla_v32/sparse_mla_v32_reference.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;

constexpr int kBlock = 256;
constexpr int64_t kEntry = kSparseMlaV32EntryBytes;
constexpr int64_t kMaxContext = 8192;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A RoPE preset's layer on one rank: vLLM's configuration of it, the default
// plan of its indexer shape (max_context kMaxContext) and its sizes.
struct Shape {
  DsaLayerConfig config;
  DsaStagePlan plan;
  int64_t D = 0, H = 0, Q = 0, L = 0, P = 0, R = 0, V = 0, HI = 0;
};

Shape rope_shape(const char* preset, int tp) {
  ModelPreset whole{}, rank{};
  EXPECT_TRUE(find_preset(preset, &whole).ok()) << preset;
  EXPECT_TRUE(per_rank(whole, tp, &rank).ok()) << preset;
  Shape s;
  s.config = dsa_layer_config(rank, 1e-6f);
  s.plan = dsa_stage_plan_for(rank);
  s.plan.max_context = kMaxContext;
  s.D = s.config.hidden_size;
  s.H = s.config.num_heads;
  s.Q = s.config.q_lora_rank;
  s.L = s.config.kv_lora_rank;
  s.P = s.config.qk_nope_head_dim;
  s.R = s.config.qk_rope_head_dim;
  s.V = s.config.v_head_dim;
  s.HI = s.plan.indexer_heads;
  return s;
}

// Views at made-up device addresses (creation reads shapes only); the
// views a RoPE layer does not read (q_scale, k_scale, compress gate, ape) empty.
DsaLayerWeights fake_rope_weights(const Shape& s) {
  uintptr_t next = uintptr_t{1} << 40;
  const auto at = [&next](DType dtype, std::initializer_list<int64_t> shape) {
    next += uintptr_t{1} << 32;
    return make_tensor(reinterpret_cast<void*>(next), dtype, shape);
  };
  DsaLayerWeights w;
  w.fused_qkv_a_proj = at(DType::kBF16, {s.Q + s.L + s.R, s.D});
  w.q_a_norm = at(DType::kBF16, {s.Q});
  w.kv_a_norm = at(DType::kBF16, {s.L});
  w.q_b_proj = at(DType::kBF16, {s.H * (s.P + s.R), s.Q});
  w.w_uk_t = at(DType::kBF16, {s.H, s.P, s.L});
  w.w_uv = at(DType::kBF16, {s.H, s.L, s.V});
  w.o_proj = at(DType::kBF16, {s.D, s.H * s.V});
  w.index_wq_b = at(DType::kBF16, {s.HI * kIndexerDim, s.Q});
  w.index_wk = at(DType::kBF16, {kIndexerDim, s.D});
  w.index_weights_proj = at(DType::kBF16, {s.HI, s.D});
  w.index_k_norm_weight = at(DType::kF32, {kIndexerDim});
  w.index_k_norm_bias = at(DType::kF32, {kIndexerDim});
  return w;
}

// Creation got past every check of the layer: what is left is the device
// (the workspace's allocation here, success on a GPU).
void expect_checks_pass(const Status& s, const std::string& at) {
  EXPECT_FALSE(contains(s.message(), "DSA attention stage needs")) << at << ": " << s.message();
  EXPECT_NE(s.code(), ErrorCode::kInvalidArgument) << at << ": " << s.message();
}

// ---------------------------------------------------------------- CPU

// Creation's status (the stage, if one was made, dropped).
Status create_status(const DsaLayerConfig& config, const DsaLayerWeights& weights, const DsaStagePlan& plan) {
  std::unique_ptr<DsaAttentionStage> stage;
  Status s = DsaAttentionStage::create(config, weights, plan, &stage);
  EXPECT_TRUE(s.ok() || stage == nullptr) << "no stage on an error";
  return s;
}

TEST(DsaStageRopeChecks, PresetConfigurationsAreRopeLayers) {
  struct Want {
    const char* preset;
    int tp;
    int64_t heads, index_heads;
    RopeStyle indexer_style;
    double softmax_scale;
  };
  for (const Want& want : {Want{"dsv32", 1, 128, 64, RopeStyle::kHalfSplit, 0.1352338},
                           Want{"dsv32", 8, 16, 64, RopeStyle::kHalfSplit, 0.1352338},
                           Want{"glm5", 1, 64, 32, RopeStyle::kInterleaved, 0.0625},
                           Want{"glm5", 8, 8, 32, RopeStyle::kInterleaved, 0.0625}}) {
    const std::string at = std::string(want.preset) + " TP" + std::to_string(want.tp);
    const Shape s = rope_shape(want.preset, want.tp);
    const DsaLayerConfig& c = s.config;
    EXPECT_EQ(c.num_heads, want.heads) << at;
    EXPECT_EQ(c.qk_rope_head_dim, 64) << at;
    EXPECT_TRUE(c.rotary_embedding) << at;
    EXPECT_TRUE(c.indexer) << at;
    EXPECT_EQ(c.kv_cache_dtype, "fp8_ds_mla") << at;
    ASSERT_TRUE(c.rope.has_value() && c.indexer_rope.has_value()) << at;
    RopeConfig attention, indexer;
    ASSERT_TRUE(rope_preset_config(want.preset, RopeTarget::kAttention, &attention).ok());
    ASSERT_TRUE(rope_preset_config(want.preset, RopeTarget::kIndexer, &indexer).ok());
    EXPECT_EQ(c.rope->style, RopeStyle::kInterleaved) << at;
    EXPECT_EQ(c.indexer_rope->style, want.indexer_style) << at;
    EXPECT_EQ(c.rope->theta, attention.theta) << at;
    EXPECT_EQ(c.rope->factor, attention.factor) << at;
    EXPECT_EQ(c.indexer_rope->factor, indexer.factor) << at;
    EXPECT_NEAR(c.softmax_scale, want.softmax_scale, 5e-8) << at;
    // The plan: the unpooled indexer, top-2048 tokens, no ring.
    const DsaStagePlan plan = s.plan;
    EXPECT_EQ(plan.indexer_heads, want.index_heads) << at;
    EXPECT_EQ(plan.indexer_pool, 1) << at;
    EXPECT_EQ(plan.indexer_topk, 2048) << at;
    EXPECT_EQ(plan.ring, 1) << at;
    EXPECT_TRUE(check_dsa_stage_indexer_shape(plan).ok()) << at;
    const IndexerPlan indexer_plan = dsa_stage_indexer_plan(c, plan);
    EXPECT_EQ(indexer_plan.rope_dims, 64) << at;
    EXPECT_EQ(indexer_plan.rope_style, want.indexer_style) << at;
    EXPECT_EQ(dsa_stage_indexer_plan(plan).rope_dims, 0) << at << ": the plan alone has the shapes only";
    EXPECT_TRUE(check_indexer_plan(indexer_plan).ok()) << at;
    EXPECT_EQ(indexer_row_width(indexer_plan), 2048) << at;
    // The NoPE preset keeps no rotary.
    ModelPreset nope{};
    ASSERT_TRUE(find_preset("glm5next", &nope).ok());
    EXPECT_FALSE(dsa_layer_config(nope, 1e-6f).rope.has_value());
  }
}

TEST(DsaStageRopeChecks, CreationAcceptsTheRopePresetsWeights) {
  for (const auto& [preset, tp] : {std::pair{"dsv32", 1}, std::pair{"dsv32", 8}, std::pair{"glm5", 1},
                                   std::pair{"glm5", 8}}) {
    const std::string at = std::string(preset) + " TP" + std::to_string(tp);
    const Shape s = rope_shape(preset, tp);
    std::unique_ptr<DsaAttentionStage> stage;
    expect_checks_pass(DsaAttentionStage::create(s.config, fake_rope_weights(s), s.plan, &stage), at);
    stage.reset();
    // The views a RoPE layer does not read may be given too.
    DsaLayerWeights w = fake_rope_weights(s);
    w.q_scale = make_tensor(reinterpret_cast<void*>(uintptr_t{1} << 39), DType::kF32, {1});
    w.index_compress_gate = make_tensor(reinterpret_cast<void*>(uintptr_t{3} << 39), DType::kBF16, {128, 8});
    expect_checks_pass(DsaAttentionStage::create(s.config, w, s.plan, &stage), at + ", unread views given");
    stage.reset();
    // Batch invariant, the serial indexer, exact logits, the top-1024 shape: all taken.
    DsaStagePlan plan = s.plan;
    plan.batch_invariant = true;
    plan.overlap_indexer = false;
    plan.indexer_logits = IndexerLogits::kExact;
    plan.indexer_topk = 1024;
    plan.block_size = 64;  // FlashMLA's V3.2 block: a multiple of 64 is enough at pool 1
    expect_checks_pass(DsaAttentionStage::create(s.config, fake_rope_weights(s), plan, &stage), at + ", other plan");
  }
}

TEST(DsaStageRopeChecks, CreationNamesEveryRopeRequirement) {
  const Shape s = rope_shape("dsv32", 8);
  std::unique_ptr<DsaAttentionStage> stage;
  // Features: one missing alone is kUnsupported, named.
  DsaLayerConfig c = s.config;
  c.rotary_embedding = false;
  const Status st1 = create_status(c, fake_rope_weights(s), s.plan);
  EXPECT_EQ(st1.code(), ErrorCode::kUnsupported) << st1.message();
  EXPECT_EQ(st1.message(),
            "DSA attention stage needs a rotary embedding for the RoPE dims (rotary_embedding true with "
            "qk_rope_head_dim 64)");
  c = s.config;
  c.kv_cache_dtype = "auto";
  const Status st2 = create_status(c, fake_rope_weights(s), s.plan);
  EXPECT_TRUE(contains(st2.message(), "fp8_ds_mla") && contains(st2.message(), "got 'auto'")) << st2.message();
  c = s.config;
  c.qk_nope_head_dim = 96;
  const Status st3 = create_status(c, fake_rope_weights(s), s.plan);
  EXPECT_TRUE(contains(st3.message(), "qk_nope_head_dim a multiple of 64 up to 1024 (rope_absorb), got 96"))
      << st3.message();
  // R other than 64: named as a feature (the views' shapes then follow the given R).
  c = s.config;
  c.qk_rope_head_dim = 32;
  const Status st4 = create_status(c, fake_rope_weights(s), s.plan);
  EXPECT_TRUE(contains(st4.message(), "qk_rope_head_dim 0 (NoPE) or 64 (RoPE: the 656-byte cache's RoPE part), got 32"))
      << st4.message();
  EXPECT_TRUE(contains(st4.message(), "'config.rope.rope_dim'")) << st4.message();

  // The rotaries, the pool, the weights: all in one kInvalidArgument message.
  c = s.config;
  c.rope.reset();
  c.indexer_rope->theta = 0;
  DsaLayerWeights w = fake_rope_weights(s);
  w.fused_qkv_a_proj = make_tensor(w.fused_qkv_a_proj.data, DType::kBF16, {s.Q + s.L, s.D});  // no k_pe rows
  w.q_b_proj = make_tensor(w.q_b_proj.data, DType::kBF16, {s.H * s.P, s.Q});                   // no rope rows
  DsaStagePlan plan = s.plan;
  plan.indexer_pool = 4;
  plan.ring = 4;
  const Status st5 = create_status(c, w, plan);
  EXPECT_EQ(st5.code(), ErrorCode::kInvalidArgument);
  for (const std::string& part :
       {std::string("'config.rope'"), std::string("the layer's rotary"), std::string("config.indexer_rope: "),
        std::string("'theta'"), std::string("'fused_qkv_a_proj'"),
        std::to_string(s.Q + s.L + s.R) + ", " + std::to_string(s.D), std::string("'q_b_proj'"),
        std::to_string(s.H * (s.P + s.R)) + ", " + std::to_string(s.Q),
        std::string("'plan.indexer_pool': expected 1 for a RoPE layer"), std::string("'index_ape'")}) {
    EXPECT_TRUE(contains(st5.message(), part)) << part << " missing from: " << st5.message();
  }
  EXPECT_EQ(stage, nullptr);

  // Positions past the rotary's.
  plan = s.plan;
  plan.max_context = s.config.rope->max_position + 1;
  const Status st6 = create_status(s.config, fake_rope_weights(s), plan);
  EXPECT_TRUE(contains(st6.message(), "'plan.max_context': expected at most config.rope.max_position = " +
                                         std::to_string(s.config.rope->max_position)))
      << st6.message();
  // The indexer's rotary of another width.
  c = s.config;
  c.indexer_rope->rope_dim = 128;
  const Status st7 = create_status(c, fake_rope_weights(s), s.plan);
  EXPECT_TRUE(contains(st7.message(), "'config.indexer_rope.rope_dim': expected qk_rope_head_dim = 64")) << st7.message();
  // The unpooled indexer's plan rules: its top-k, its ring, its block size.
  plan = s.plan;
  plan.indexer_topk = 4096;
  testing::expect_rejected(check_dsa_stage_indexer_shape(plan), "plan.indexer_topk", "1..2048");
  const Status st8 = create_status(s.config, fake_rope_weights(s), plan);
  EXPECT_TRUE(contains(st8.message(), "'plan.indexer_topk'")) << st8.message();
  plan = s.plan;
  plan.ring = 4;
  const Status st9 = create_status(s.config, fake_rope_weights(s), plan);
  EXPECT_TRUE(contains(st9.message(), "'plan.ring'") && contains(st9.message(), "got 4")) << st9.message();
  plan = s.plan;
  plan.block_size = 96;
  const Status st10 = create_status(s.config, fake_rope_weights(s), plan);
  EXPECT_TRUE(contains(st10.message(), "'plan.block_size'") && contains(st10.message(), "64")) << st10.message();
  // A weight of the right shape but the wrong dtype, and the indexer's heads.
  w = fake_rope_weights(s);
  w.w_uk_t.dtype = DType::kF32;
  w.index_wq_b = make_tensor(w.index_wq_b.data, DType::kBF16, {32 * kIndexerDim, s.Q});
  const Status st11 = create_status(s.config, w, s.plan);
  EXPECT_TRUE(contains(st11.message(), "'w_uk_t'") && contains(st11.message(), "'index_wq_b'") &&
              contains(st11.message(), std::to_string(64 * kIndexerDim) + ", " + std::to_string(s.Q)))
      << st11.message();
  EXPECT_FALSE(contains(st11.message(), "'q_scale'")) << "not read at R > 0: " << st11.message();
}

// The workspace sizes its tables from the rotaries: checked before any allocation.
TEST(DsaStageRopeChecks, WorkspaceCreationNamesTheRotaries) {
  const Shape s = rope_shape("dsv32", 8);
  std::shared_ptr<DsaStageWorkspace> workspace;
  DsaLayerConfig c = s.config;
  c.rope.reset();
  testing::expect_rejected(DsaStageWorkspace::create(c, s.plan, &workspace), "config.rope", "the layer's rotary");
  c = s.config;
  c.qk_rope_head_dim = 32;
  testing::expect_rejected(DsaStageWorkspace::create(c, s.plan, &workspace), "config", "qk_rope_head_dim 32");
  DsaStagePlan plan = s.plan;
  plan.max_context = s.config.rope->max_position + 64;
  testing::expect_rejected(DsaStageWorkspace::create(s.config, plan, &workspace), "plan.max_context",
                           "config.rope.max_position");
  plan = s.plan;
  plan.indexer_pool = 3;
  testing::expect_rejected(DsaStageWorkspace::create(s.config, plan, &workspace), "plan.indexer_pool",
                           "or 1 (no pooling");
  EXPECT_EQ(workspace, nullptr);
}

// ---------------------------------------------------------------- GPU

std::vector<uint16_t> bf16_normal(size_t count, float mean, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<uint16_t> bits(count);
  for (uint16_t& b : bits) b = num::float_to_bf16(normal(rng));
  return bits;
}

template <class T>
TensorView view(const DeviceBuffer<T>& b, DType dtype, std::initializer_list<int64_t> shape) {
  return make_tensor(b.get(), dtype, shape);
}

template <class T>
std::vector<T> download(const TensorView& v) {
  std::vector<T> host(size_t(v.numel()));
  EXPECT_EQ(cudaMemcpy(host.data(), v.data, host.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// The layer's weights on the GPU with host copies, and both rotaries' tables
// [kMaxContext, R] (the values the stage makes for itself) for the chain.
struct RopeLayer {
  Shape s;
  std::vector<uint16_t> qkv_a, q_norm, kv_norm, q_b, w_uk_t, w_uv, o_proj, wq_b, wk, weights_proj;
  std::vector<float> k_norm_weight, k_norm_bias, attention_table, indexer_table;
  DeviceBuffer<uint16_t> d_qkv_a, d_q_norm, d_kv_norm, d_q_b, d_w_uk_t, d_w_uv, d_o_proj, d_wq_b, d_wk,
      d_weights_proj;
  DeviceBuffer<float> d_k_norm_weight, d_k_norm_bias, d_attention_table, d_indexer_table;

  RopeLayer(const Shape& shape, std::mt19937_64& rng) : s(shape) {
    const int64_t D = s.D, H = s.H, Q = s.Q, L = s.L, P = s.P, R = s.R, V = s.V, HI = s.HI;
    // Each product's output near unit scale: weights of stddev in^-0.5.
    qkv_a = bf16_normal(size_t(Q + L + R) * D, 0, 1 / std::sqrt(float(D)), rng);
    q_norm = bf16_normal(Q, 1, 0.1f, rng);
    kv_norm = bf16_normal(L, 1, 0.1f, rng);
    q_b = bf16_normal(size_t(H * (P + R)) * Q, 0, 1 / std::sqrt(float(Q)), rng);
    w_uk_t = bf16_normal(size_t(H) * P * L, 0, 1 / std::sqrt(float(P)), rng);
    w_uv = bf16_normal(size_t(H) * L * V, 0, 1 / std::sqrt(float(L)), rng);
    o_proj = bf16_normal(size_t(D) * H * V, 0, 1 / std::sqrt(float(H * V)), rng);
    wq_b = bf16_normal(size_t(HI * kIndexerDim) * Q, 0, 1 / std::sqrt(float(Q)), rng);
    wk = bf16_normal(size_t(kIndexerDim) * D, 0, 1 / std::sqrt(float(D)), rng);
    weights_proj = bf16_normal(size_t(HI) * D, 0, 1 / std::sqrt(float(D)), rng);
    k_norm_weight = testing::normal_floats(kIndexerDim, 1, 0.1f, rng);
    k_norm_bias = testing::normal_floats(kIndexerDim, 0, 0.1f, rng);
    for (float* v : {k_norm_weight.data(), k_norm_bias.data()}) {
      for (int i = 0; i < kIndexerDim; ++i) v[i] = num::round_bf16(v[i]);
    }
    attention_table.resize(size_t(kMaxContext) * R);
    indexer_table.resize(size_t(kMaxContext) * R);
    EXPECT_TRUE(rope_cos_sin_table(*s.config.rope, 0, kMaxContext, attention_table.data()).ok());
    EXPECT_TRUE(rope_cos_sin_table(*s.config.indexer_rope, 0, kMaxContext, indexer_table.data()).ok());
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
    d_k_norm_weight = DeviceBuffer<float>(k_norm_weight);
    d_k_norm_bias = DeviceBuffer<float>(k_norm_bias);
    d_attention_table = DeviceBuffer<float>(attention_table);
    d_indexer_table = DeviceBuffer<float>(indexer_table);
  }

  DsaLayerWeights weights() const {
    DsaLayerWeights w;
    w.fused_qkv_a_proj = view(d_qkv_a, DType::kBF16, {s.Q + s.L + s.R, s.D});
    w.q_a_norm = view(d_q_norm, DType::kBF16, {s.Q});
    w.kv_a_norm = view(d_kv_norm, DType::kBF16, {s.L});
    w.q_b_proj = view(d_q_b, DType::kBF16, {s.H * (s.P + s.R), s.Q});
    w.w_uk_t = view(d_w_uk_t, DType::kBF16, {s.H, s.P, s.L});
    w.w_uv = view(d_w_uv, DType::kBF16, {s.H, s.L, s.V});
    w.o_proj = view(d_o_proj, DType::kBF16, {s.D, s.H * s.V});
    w.index_wq_b = view(d_wq_b, DType::kBF16, {s.HI * kIndexerDim, s.Q});
    w.index_wk = view(d_wk, DType::kBF16, {kIndexerDim, s.D});
    w.index_weights_proj = view(d_weights_proj, DType::kBF16, {s.HI, s.D});
    w.index_k_norm_weight = view(d_k_norm_weight, DType::kF32, {kIndexerDim});
    w.index_k_norm_bias = view(d_k_norm_bias, DType::kF32, {kIndexerDim});
    return w;
  }
  TensorView table(const DeviceBuffer<float>& t) const { return view(t, DType::kF32, {kMaxContext, s.R}); }
};

// A step of m tokens over min(m, 3) requests: token t is request t % r's
// next position (request r decodes from 2300 + 700 r), so a request holds
// several consecutive tokens of the step (pool 1 takes any number). Every
// token's indexer selects (L > 2048). The KV cache holds 656-byte entries of
// random latents; the indexer's K cache is prefilled on the GPU from random
// rows of each request's context.
struct RopeStep {
  int m = 0, requests = 0;
  std::vector<int64_t> positions, slot_mapping;
  std::vector<int32_t> token_requests, block_table;
  int64_t width = 0, blocks = 0, page_bytes = 0;
  IndexerPlan plan;  // the stage's (dsa_stage_indexer_plan(config, plan))
  std::vector<uint16_t> hidden;
  std::vector<uint8_t> kv_cache, k_cache;  // before the step (the K cache after its prefill)
  DeviceBuffer<uint16_t> d_hidden, d_out;
  DeviceBuffer<int64_t> d_positions, d_slot_mapping;
  DeviceBuffer<int32_t> d_token_requests, d_block_table;
  DeviceBuffer<uint8_t> d_kv_cache, d_k_cache;
  DeviceBuffer<unsigned int> d_errors;

  RopeStep(int tokens, const RopeLayer& layer, const DsaStagePlan& stage_plan, std::mt19937_64& rng)
      : m(tokens), requests(std::min(tokens, 3)), plan(dsa_stage_indexer_plan(layer.s.config, stage_plan)) {
    const Shape& s = layer.s;
    std::vector<int64_t> next(requests);
    for (int r = 0; r < requests; ++r) next[r] = 2300 + 700 * r;
    for (int t = 0; t < m; ++t) {
      token_requests.push_back(t % requests);
      positions.push_back(next[t % requests]++);
    }
    const int64_t last = *std::max_element(positions.begin(), positions.end());
    width = (last + 1 + kBlock - 1) / kBlock;
    blocks = requests * width + 2;
    std::vector<int32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    block_table.assign(order.begin(), order.begin() + requests * width);
    for (int t = 0; t < m; ++t) slot_mapping.push_back(slot_of(token_requests[t], positions[t]));
    hidden = bf16_normal(size_t(m) * s.D, 0, 1, rng);
    // Entries of latents and RoPE values of stddev 0.3: scores (softmax_scale x
    // q . k over 576 dims, q near unit scale) of stddev ~1, within the spread
    // the attention's bound is stated for.
    kv_cache.assign(size_t(blocks) * kBlock * kEntry, 0);
    for (int64_t slot = 0; slot < blocks * kBlock; ++slot) {
      const std::vector<uint16_t> kv = bf16_normal(size_t(s.L), 0, 0.3f, rng);
      const std::vector<uint16_t> pe = bf16_normal(size_t(s.R), 0, 0.3f, rng);
      reference::v32_quantize_token(kv.data(), pe.data(), &kv_cache[size_t(slot) * kEntry]);
    }
    page_bytes = indexer_page_bytes(plan);
    d_hidden = DeviceBuffer<uint16_t>(hidden);
    d_out = DeviceBuffer<uint16_t>(size_t(m) * s.D);
    d_positions = DeviceBuffer<int64_t>(positions);
    d_slot_mapping = DeviceBuffer<int64_t>(slot_mapping);
    d_token_requests = DeviceBuffer<int32_t>(token_requests);
    d_block_table = DeviceBuffer<int32_t>(block_table);
    d_kv_cache = DeviceBuffer<uint8_t>(kv_cache);
    d_k_cache = DeviceBuffer<uint8_t>(std::vector<uint8_t>(size_t(blocks) * page_bytes, 0));
    d_errors = DeviceBuffer<unsigned int>(std::vector<unsigned int>{0});
    prefill(layer, rng);
    k_cache = d_k_cache.download();
  }

  int64_t slot_of(int request, int64_t position) const {
    return int64_t(block_table[size_t(request) * width + position / kBlock]) * kBlock + position % kBlock;
  }

  IndexerState indexer() const {
    return IndexerState{make_tensor(d_block_table.get(), DType::kI32, {requests, width}), TensorView(),
                        make_tensor(d_k_cache.get(), DType::kU8, {blocks, page_bytes})};
  }

  // Each request's context keys 0..first position - 1, rotated by the indexer's table.
  void prefill(const RopeLayer& layer, std::mt19937_64& rng) {
    for (int r = 0; r < requests; ++r) {
      const int64_t n = positions[r];  // token r is request r's first
      DeviceBuffer<uint16_t> k(bf16_normal(size_t(n) * kIndexerDim, 0, 1, rng));
      IndexerPrefillArgs a;
      a.plan = plan;
      a.index_k = make_tensor(k.get(), DType::kBF16, {n, kIndexerDim});
      a.k_norm_weight = view(layer.d_k_norm_weight, DType::kF32, {kIndexerDim});
      a.k_norm_bias = view(layer.d_k_norm_bias, DType::kF32, {kIndexerDim});
      a.request = r;
      a.state = indexer();
      a.cos_sin = layer.table(layer.d_indexer_table);
      const Status s = indexer_prefill(a, nullptr);
      EXPECT_TRUE(s.ok()) << s.to_string();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }

  // The caches as before the step, out poisoned, no errors counted.
  void reset() {
    d_kv_cache.upload(kv_cache);
    d_k_cache.upload(k_cache);
    d_errors.upload({0});
    d_out.fill_bytes(0xFF);
  }

  DsaStepArgs args(const Shape& s) const {
    DsaStepArgs a;
    a.hidden = view(d_hidden, DType::kBF16, {m, s.D});
    a.positions = view(d_positions, DType::kI64, {m});
    a.token_requests = view(d_token_requests, DType::kI32, {m});
    a.slot_mapping = view(d_slot_mapping, DType::kI64, {m});
    a.kv_cache = view(d_kv_cache, DType::kU8, {blocks, kBlock, kEntry});
    a.indexer = indexer();
    a.out = view(d_out, DType::kBF16, {m, s.D});
    a.error_count = d_errors.get();
    return a;
  }
};

// What a run left: the products the checks read, the caches, the error count.
struct RopeResult {
  std::vector<uint16_t> qkv, q_c, kv_c, q, q_absorbed, k_pe, index_q, index_k, latent, heads, out;
  std::vector<float> head_weights, lse;
  std::vector<int32_t> slots;
  std::vector<uint8_t> kv_cache, k_cache;
  unsigned int errors = 0;
};

// One path of the stage, from the caches before the step (or, with `reset`
// false, from what they hold).
RopeResult run_stage(DsaAttentionStage& stage, RopeStep& step, DsaPath path, const DsaStepArgs& args,
                     bool reset = true) {
  if (reset) step.reset();
  const Status s = path == DsaPath::kFused ? stage.forward(args, nullptr) : stage.stock_forward(args, nullptr);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const int64_t m = args.hidden.size(0);
  const DsaStageIntermediates v = stage.intermediates(m);
  RopeResult r;
  r.qkv = download<uint16_t>(v.qkv);
  r.q_c = download<uint16_t>(v.q_c);
  r.kv_c = download<uint16_t>(v.kv_c);
  r.q = download<uint16_t>(v.q);
  r.q_absorbed = download<uint16_t>(v.q_absorbed);
  r.k_pe = download<uint16_t>(v.k_pe);
  if (args.topk_positions.data == nullptr) {
    r.index_q = download<uint16_t>(v.index_q);
    r.index_k = download<uint16_t>(v.index_k);
    r.head_weights = download<float>(v.head_weights);
  }
  r.slots = download<int32_t>(v.slots);
  r.latent = download<uint16_t>(v.latent);
  r.lse = download<float>(v.lse);
  r.heads = download<uint16_t>(v.heads);
  r.out = download<uint16_t>(args.out);
  r.kv_cache = step.d_kv_cache.download();
  r.k_cache = step.d_k_cache.download();
  r.errors = step.d_errors.download()[0];
  return r;
}

// The step kernel by kernel through the library's public functions, one
// stream, the kernels the stage's fused path runs when every projection is a
// linear_gemv and value-up a head_gemv: linear_gemv qkv_a_proj, qkv_rmsnorm
// (k_pe left out), linear_gemv q_b_proj, rope_absorb, sparse_mla_v32_cache_write,
// indexer_project_gemv (no gate), indexer_prepare, indexer_select,
// sparse_mla_v32, head_gemv value-up, linear_gemv o_proj.
struct KernelChain {
  DeviceBuffer<uint16_t> qkv, q_c, kv_c, q, q_absorbed, k_pe, index_q, index_k, latent, heads;
  DeviceBuffer<float> head_weights, lse;
  DeviceBuffer<int32_t> slots;
  DeviceBuffer<uint8_t> workspace;

  KernelChain(const Shape& s, const IndexerPlan& plan, int64_t m)
      : qkv(size_t(m) * (s.Q + s.L + s.R)),
        q_c(size_t(m) * s.Q),
        kv_c(size_t(m) * s.L),
        q(size_t(m) * s.H * (s.P + s.R)),
        q_absorbed(size_t(m) * s.H * (s.L + s.R)),
        k_pe(size_t(m) * s.R),
        index_q(size_t(m) * s.HI * kIndexerDim),
        index_k(size_t(m) * kIndexerDim),
        latent(size_t(m) * s.H * s.L),
        heads(size_t(m) * s.H * s.V),
        head_weights(size_t(m) * s.HI),
        lse(size_t(m) * s.H),
        slots(size_t(m) * indexer_row_width(plan)),
        workspace(size_t(indexer_workspace_layout(plan).bytes)) {}

  // linear_gemv of x [m, k] by weight [n, k] into out [m, n], per group of tokens that fits.
  static Status linear(const TensorView& x, const TensorView& weight, const TensorView& out) {
    const int64_t m = x.size(0), k = x.size(1);
    int64_t group = kLinearGemvMaxTokens;
    while (group > 1 && !linear_gemv_supports(group, k)) --group;
    for (int64_t first = 0; first < m; first += group) {
      const int64_t rows = std::min(group, m - first);
      DSA_RETURN_IF_ERROR(linear_gemv(LinearGemvArgs{slice_rows(x, first, rows), weight, slice_rows(out, first, rows)},
                                      nullptr));
    }
    return Status();
  }

  Status run(const RopeLayer& layer, const RopeStep& step, const IndexerPlan& plan) {
    const Shape& s = layer.s;
    const DsaLayerWeights w = layer.weights();
    const int64_t m = step.m, H = s.H, P = s.P, R = s.R, L = s.L, Q = s.Q, HI = s.HI, width = Q + L + R;
    const int64_t W = indexer_row_width(plan);
    const DsaStepArgs a = step.args(s);
    DSA_RETURN_IF_ERROR(linear(a.hidden, w.fused_qkv_a_proj, view(qkv, DType::kBF16, {m, width})));
    DSA_RETURN_IF_ERROR(qkv_rmsnorm(make_strided(qkv.get(), DType::kBF16, {m, Q + L}, {width, 1}), w.q_a_norm,
                                    w.kv_a_norm, s.config.rms_norm_eps, view(q_c, DType::kBF16, {m, Q}),
                                    view(kv_c, DType::kBF16, {m, L}), nullptr));
    DSA_RETURN_IF_ERROR(linear(view(q_c, DType::kBF16, {m, Q}), w.q_b_proj, view(q, DType::kBF16, {m, H * (P + R)})));
    RopeAbsorbArgs absorb;
    absorb.q_nope = make_strided(q.get(), DType::kBF16, {m, H, P}, {H * (P + R), P + R, 1});
    absorb.q_pe = make_strided(q.get() + P, DType::kBF16, {m, H, R}, {H * (P + R), P + R, 1});
    absorb.k_pe = make_strided(qkv.get() + Q + L, DType::kBF16, {m, R}, {width, 1});
    absorb.positions = a.positions;
    absorb.cos_sin = layer.table(layer.d_attention_table);
    absorb.weight = w.w_uk_t;
    absorb.out = view(q_absorbed, DType::kBF16, {m, H, L + R});
    absorb.k_pe_out = view(k_pe, DType::kBF16, {m, R});
    absorb.style = s.config.rope->style;
    absorb.error_count = a.error_count;
    DSA_RETURN_IF_ERROR(rope_absorb(absorb, nullptr));
    SparseMlaV32CacheWriteArgs write;
    write.kv_c = view(kv_c, DType::kBF16, {m, L});
    write.k_pe = absorb.k_pe_out;
    write.slot_mapping = a.slot_mapping;
    write.kv_cache = a.kv_cache;
    write.error_count = a.error_count;
    DSA_RETURN_IF_ERROR(sparse_mla_v32_cache_write(write, nullptr));
    // The indexer's projections per group of tokens whose x rows fit (its bits do not depend on the group).
    const auto project = [&](int64_t first, int64_t tokens) {
      IndexerProjectArgs p;
      p.plan = plan;
      p.q_c = slice_rows(view(q_c, DType::kBF16, {m, Q}), first, tokens);
      p.x = slice_rows(a.hidden, first, tokens);
      p.wq_b = w.index_wq_b;
      p.wk = w.index_wk;
      p.weights_proj = w.index_weights_proj;
      p.index_q = slice_rows(view(index_q, DType::kBF16, {m, HI, kIndexerDim}), first, tokens);
      p.index_k = slice_rows(view(index_k, DType::kBF16, {m, kIndexerDim}), first, tokens);
      p.head_weights = slice_rows(view(head_weights, DType::kF32, {m, HI}), first, tokens);
      return p;
    };
    int64_t group = m;
    while (group > 1 && !check_indexer_project_gemv(project(0, group)).ok()) group = (group + 1) / 2;
    for (int64_t first = 0; first < m; first += group) {
      DSA_RETURN_IF_ERROR(indexer_project_gemv(project(first, std::min(group, m - first)), nullptr));
    }
    const TensorView workspace_view = view(workspace, DType::kU8, {int64_t(workspace.size())});
    IndexerPrepareArgs prepare;
    prepare.plan = plan;
    prepare.index_q = view(index_q, DType::kBF16, {m, HI, kIndexerDim});
    prepare.index_k = view(index_k, DType::kBF16, {m, kIndexerDim});
    prepare.head_weights = view(head_weights, DType::kF32, {m, HI});
    prepare.k_norm_weight = w.index_k_norm_weight;
    prepare.k_norm_bias = w.index_k_norm_bias;
    prepare.positions = a.positions;
    prepare.token_requests = a.token_requests;
    prepare.state = a.indexer;
    prepare.workspace = workspace_view;
    prepare.error_count = a.error_count;
    prepare.cos_sin = layer.table(layer.d_indexer_table);
    DSA_RETURN_IF_ERROR(indexer_prepare(prepare, nullptr));
    IndexerSelectArgs select;
    select.plan = plan;
    select.positions = a.positions;
    select.token_requests = a.token_requests;
    select.state = a.indexer;
    select.workspace = workspace_view;
    select.slots = view(slots, DType::kI32, {m, W});
    select.error_count = a.error_count;
    DSA_RETURN_IF_ERROR(indexer_select(select, nullptr));
    SparseMlaV32Args attention;
    attention.q = absorb.out;
    attention.kv_cache = a.kv_cache;
    attention.indices = select.slots;
    attention.softmax_scale = s.config.softmax_scale;
    attention.latent = view(latent, DType::kBF16, {m, H, L});
    attention.lse = view(lse, DType::kF32, {m, H});
    attention.error_count = a.error_count;
    DSA_RETURN_IF_ERROR(sparse_mla_v32(attention, nullptr));
    HeadGemvArgs value_up;
    value_up.x = attention.latent;
    value_up.weight = w.w_uv;
    value_up.out = view(heads, DType::kBF16, {m, H, s.V});
    value_up.sums = HeadGemvSums::kTensorCores;
    value_up.release_dependents_early = true;
    DSA_RETURN_IF_ERROR(head_gemv(value_up, nullptr));
    DSA_RETURN_IF_ERROR(linear(view(heads, DType::kBF16, {m, H * s.V}), w.o_proj, a.out));
    DSA_CUDA_RETURN(cudaDeviceSynchronize());
    return Status();
  }
};

// out[t, j] = sum_i in[t, i] * weight[j, i] in float64 (weight [n, k]).
std::vector<double> linear(const std::vector<uint16_t>& in, int64_t m, int64_t k, const std::vector<uint16_t>& weight,
                           int64_t n) {
  return reference::exact_product(in.data(), m, k, weight.data(), n).sum;
}

// out[t, h, j] = sum_i in[t, h, i] * weight[h, i, j] in float64.
std::vector<double> per_head(const std::vector<uint16_t>& in, int64_t m, int64_t H, int64_t I,
                             const std::vector<uint16_t>& weight, int64_t J) {
  std::vector<double> out(size_t(m) * H * J, 0.0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      double* o = &out[(size_t(t) * H + h) * J];
      for (int64_t i = 0; i < I; ++i) {
        const double x = num::bf16_to_float(in[(size_t(t) * H + h) * I + i]);
        const uint16_t* w = &weight[(size_t(h) * I + i) * J];
        for (int64_t j = 0; j < J; ++j) o[j] += x * num::bf16_to_float(w[j]);
      }
    }
  }
  return out;
}

std::vector<double> widened(const std::vector<uint16_t>& bf16) {
  std::vector<double> out(bf16.size());
  for (size_t i = 0; i < bf16.size(); ++i) out[i] = num::bf16_to_float(bf16[i]);
  return out;
}

// rope_absorb's host arguments over a run's q [m, H, P + R] and qkv [m, Q + L + R].
reference::RopeAbsorbHost absorb_host(const RopeLayer& layer, const RopeStep& step, const RopeResult& r) {
  const Shape& s = layer.s;
  reference::RopeAbsorbHost a{};
  a.q_nope = r.q.data();
  a.q_nope_token_stride = s.H * (s.P + s.R);
  a.q_nope_head_stride = s.P + s.R;
  a.q_pe = r.q.data() + s.P;
  a.q_pe_token_stride = a.q_nope_token_stride;
  a.q_pe_head_stride = a.q_nope_head_stride;
  a.k_pe = r.qkv.data() + s.Q + s.L;
  a.k_pe_token_stride = s.Q + s.L + s.R;
  a.positions = step.positions.data();
  a.cos_sin = layer.attention_table.data();
  a.table_bf16 = false;
  a.cos_sin_row_stride = s.R;
  a.cos_sin_rows = kMaxContext;
  a.weight = layer.w_uk_t.data();
  a.weight_head_stride = s.P * s.L;
  a.weight_row_stride = s.L;
  a.m = step.m;
  a.heads = int(s.H);
  a.rows = int(s.P);
  a.latent = int(s.L);
  a.rope_dim = int(s.R);
  a.style = s.config.rope->style;
  return a;
}

// Each product of one path against its CPU reference on the path's own
// inputs, the bounds of dsa-decode's RoPE chain: linear_gemv products bit for
// bit (cuBLASLt's within 4e-3 relative of float64), the norms within 1e-2 of
// float64, rope_absorb's rotations bit for bit and its latent within
// head_gemv's bound, the cache entries bit for bit, the rows' layout, the
// attention within 5e-3 relative Frobenius and lse within 1e-3 of float64,
// value-up and o_proj within 4e-3.
void expect_products_right(const RopeLayer& layer, const RopeStep& step, DsaAttentionStage& stage, DsaPath path,
                           const RopeResult& r, const std::string& at) {
  const Shape& s = layer.s;
  const int64_t m = step.m, width = s.Q + s.L + s.R, W = indexer_row_width(step.plan);
  std::vector<std::string> names;
  ASSERT_TRUE(stage.step_names(path, step.args(s), &names).ok());
  const auto ran = [&](const std::string& name) { return std::count(names.begin(), names.end(), name) > 0; };
  EXPECT_EQ(r.errors, 0u) << at;

  const std::vector<double> qkv = linear(step.hidden, m, s.D, layer.qkv_a, width);
  if (ran("qkv_a_proj (GEMV)")) {
    EXPECT_TRUE(r.qkv == reference::linear_gemv(step.hidden, m, s.D, layer.qkv_a, width)) << at;
  }
  EXPECT_LT(reference::relative_frobenius(r.qkv, qkv), 4e-3) << at;
  std::vector<double> q_c(size_t(m) * s.Q), kv_c(size_t(m) * s.L);
  for (int64_t t = 0; t < m; ++t) {
    reference::rms_norm_exact(&qkv[size_t(t) * width], int(s.Q), layer.q_norm.data(), s.config.rms_norm_eps,
                              &q_c[size_t(t) * s.Q]);
    reference::rms_norm_exact(&qkv[size_t(t) * width + s.Q], int(s.L), layer.kv_norm.data(), s.config.rms_norm_eps,
                              &kv_c[size_t(t) * s.L]);
  }
  EXPECT_LT(reference::relative_frobenius(r.q_c, q_c), 1e-2) << at;
  EXPECT_LT(reference::relative_frobenius(r.kv_c, kv_c), 1e-2) << at;
  const int64_t q_width = s.H * (s.P + s.R);
  if (ran("q_b_proj (GEMV)")) EXPECT_TRUE(r.q == reference::linear_gemv(r.q_c, m, s.Q, layer.q_b, q_width)) << at;
  EXPECT_LT(reference::relative_frobenius(r.q, linear(r.q_c, m, s.Q, layer.q_b, q_width)), 4e-3) << at;

  // rope_absorb on the run's q and qkv.
  const reference::RopeAbsorbHost a = absorb_host(layer, step, r);
  const reference::RopeRows rotated = reference::rope_rows(a);
  size_t bad_rows = 0;
  for (size_t row = 0; row < size_t(m * s.H); ++row) {
    bad_rows += !std::equal(rotated.q.begin() + row * s.R, rotated.q.begin() + (row + 1) * s.R,
                            r.q_absorbed.begin() + row * (s.L + s.R) + s.L);
  }
  EXPECT_EQ(bad_rows, 0u) << at << ": rotated q_pe rows differ from reference::rope_rows";
  EXPECT_TRUE(r.k_pe == rotated.k) << at;
  const reference::RopeAbsorbDeviation d =
      reference::rope_absorb_deviation(a, r.q_absorbed.data(), r.k_pe.data(), &*s.config.rope);
  EXPECT_EQ(d.latent.outside, 0) << at << " of " << d.latent.compared;
  EXPECT_EQ(d.rope_outside, 0) << at << " of " << d.rope_compared;
  EXPECT_GT(d.latent.compared, 0) << at;

  // The cache: each token's entry vLLM's rule of its kv_c and rotated k_pe; nothing else touched.
  std::vector<uint8_t> entry(kEntry);
  std::vector<bool> written(size_t(step.blocks) * kBlock, false);
  for (int64_t t = 0; t < m; ++t) {
    reference::v32_quantize_token(&r.kv_c[size_t(t) * s.L], &r.k_pe[size_t(t) * s.R], entry.data());
    const int64_t slot = step.slot_mapping[t];
    written[size_t(slot)] = true;
    EXPECT_TRUE(std::equal(entry.begin(), entry.end(), r.kv_cache.begin() + slot * kEntry)) << at << " token " << t;
  }
  size_t stray = 0;
  for (size_t slot = 0; slot < written.size(); ++slot) {
    if (!written[slot]) {
      stray += !std::equal(r.kv_cache.begin() + slot * kEntry, r.kv_cache.begin() + (slot + 1) * kEntry,
                           step.kv_cache.begin() + slot * kEntry);
    }
  }
  EXPECT_EQ(stray, 0u) << at << ": entries outside the step's slots changed";

  // The rows: top-2048 of L > 2048 tokens, each slot one of the token's request's positions below L.
  for (int64_t t = 0; t < m; ++t) {
    const int32_t* row = &r.slots[size_t(t) * W];
    const int64_t L = step.positions[t] + 1;
    std::set<int32_t> valid;
    for (int64_t j = 0; j < W; ++j) {
      if (row[j] < 0) continue;
      valid.insert(row[j]);
    }
    EXPECT_EQ(int64_t(valid.size()), std::min<int64_t>(L, step.plan.topk)) << at << " token " << t;
    std::set<int32_t> own;
    for (int64_t p = 0; p < L; ++p) own.insert(int32_t(step.slot_of(step.token_requests[t], p)));
    EXPECT_TRUE(std::includes(own.begin(), own.end(), valid.begin(), valid.end())) << at << " token " << t;
  }

  // The attention against float64 on the run's q, cache and slots.
  reference::SparseMlaV32Host attention{};
  attention.q = r.q_absorbed.data();
  attention.q_token_stride = s.H * (s.L + s.R);
  attention.q_head_stride = s.L + s.R;
  attention.cache = r.kv_cache.data();
  attention.blocks = step.blocks;
  attention.block_size = kBlock;
  attention.block_stride = kBlock * kEntry;
  attention.entry_stride = kEntry;
  attention.indices = r.slots.data();
  attention.indices_token_stride = W;
  attention.m = int(m);
  attention.heads = int(s.H);
  attention.top_k = int(W);
  attention.softmax_scale = s.config.softmax_scale;
  const reference::SparseMlaV32Result want = reference::sparse_mla_v32(attention);
  EXPECT_LT(reference::relative_frobenius(r.latent, widened(want.latent)), 5e-3) << at;
  for (size_t i = 0; i < want.lse.size(); ++i) ASSERT_NEAR(r.lse[i], want.lse[i], 1e-3) << at << " lse " << i;

  EXPECT_LT(reference::relative_frobenius(r.heads, per_head(r.latent, m, s.H, s.L, layer.w_uv, s.V)), 4e-3) << at;
  if (ran("o_proj (GEMV)")) {
    EXPECT_TRUE(r.out == reference::linear_gemv(r.heads, m, s.H * s.V, layer.o_proj, s.D)) << at;
  }
  EXPECT_LT(reference::relative_frobenius(r.out, linear(r.heads, m, s.H * s.V, layer.o_proj, s.D)), 4e-3) << at;
}

// Both paths of one step: each against the references, and against each
// other where they share kernels (qkv_a_proj, the norm, the cache write of
// the same kv_c and k_pe, the indexer): caches and slots equal.
void expect_paths_agree(DsaAttentionStage& stage, const RopeLayer& layer, RopeStep& step) {
  const std::string at = "m = " + std::to_string(step.m);
  const RopeResult fused = run_stage(stage, step, DsaPath::kFused, step.args(layer.s));
  const RopeResult stock = run_stage(stage, step, DsaPath::kStock, step.args(layer.s));
  expect_products_right(layer, step, stage, DsaPath::kFused, fused, at + " fused");
  expect_products_right(layer, step, stage, DsaPath::kStock, stock, at + " stock");
  EXPECT_TRUE(fused.qkv == stock.qkv && fused.kv_c == stock.kv_c && fused.k_pe == stock.k_pe) << at;
  EXPECT_TRUE(fused.kv_cache == stock.kv_cache) << at;
  EXPECT_TRUE(fused.k_cache == stock.k_cache) << at;
  EXPECT_TRUE(fused.slots == stock.slots) << at;
  EXPECT_LT(reference::relative_frobenius(stock.out, widened(fused.out)), 2e-2) << at;
}

class DsaStageRopeGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!testing::gpu_available()) return;
    std::mt19937_64 rng(testing::test_seed());
    layer_ = new RopeLayer(rope_shape("dsv32", 8), rng);
  }
  static void TearDownTestSuite() {
    delete layer_;
    layer_ = nullptr;
  }
  void SetUp() override {
    DSA_REQUIRE_GPU();
    ASSERT_NE(layer_, nullptr);
    rng_.seed(testing::test_seed() + 1);
    const Status s = DsaAttentionStage::create(layer_->s.config, layer_->weights(), layer_->s.plan, &stage_);
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  const Shape& shape() const { return layer_->s; }

  static RopeLayer* layer_;
  std::mt19937_64 rng_;
  std::unique_ptr<DsaAttentionStage> stage_;
};

RopeLayer* DsaStageRopeGpu::layer_ = nullptr;

// With every projection on linear_gemv and value-up on head_gemv, the fused
// path runs the chain's kernels: every product, both caches and the rows
// bit for bit, the indexer on its lane or after the cache write.
TEST_F(DsaStageRopeGpu, FusedPathIsTheKernelChainBitForBit) {
  for (const bool overlap : {true, false}) {
    DsaStagePlan plan = shape().plan;
    plan.projection_gemv_tokens = std::set<int>{1, 2, 3, 4, 5, 6, 7, 8};
    plan.value_up_tokens = std::set<int>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    plan.overlap_indexer = overlap;
    std::unique_ptr<DsaAttentionStage> stage;
    DSA_ASSERT_OK(DsaAttentionStage::create(shape().config, layer_->weights(), plan, &stage));
    for (int m : testing::quick_mode() ? std::vector<int>{3} : std::vector<int>{1, 3, 8}) {
      const std::string at = "m = " + std::to_string(m) + (overlap ? ", overlapped" : ", serial");
      RopeStep step(m, *layer_, plan, rng_);
      std::vector<std::string> names;
      DSA_ASSERT_OK(stage->step_names(DsaPath::kFused, step.args(shape()), &names));
      ASSERT_EQ(names.size(), 11u);
      EXPECT_EQ(names.front(), "qkv_a_proj (GEMV)") << at;
      EXPECT_EQ(std::count(names.begin(), names.end(), "q_b_proj (GEMV)"), 1) << at;
      EXPECT_EQ(names[names.size() - 2], "value_up (head_gemv)") << at;
      EXPECT_EQ(names.back(), "o_proj (GEMV)") << at;
      const RopeResult got = run_stage(*stage, step, DsaPath::kFused, step.args(shape()));

      step.reset();
      KernelChain chain(shape(), step.plan, m);
      DSA_ASSERT_OK(chain.run(*layer_, step, step.plan));
      EXPECT_TRUE(got.qkv == chain.qkv.download()) << at;
      EXPECT_TRUE(got.q_c == chain.q_c.download() && got.kv_c == chain.kv_c.download()) << at;
      EXPECT_TRUE(got.q == chain.q.download()) << at;
      EXPECT_TRUE(got.q_absorbed == chain.q_absorbed.download() && got.k_pe == chain.k_pe.download()) << at;
      EXPECT_TRUE(got.index_q == chain.index_q.download() && got.index_k == chain.index_k.download() &&
                  got.head_weights == chain.head_weights.download())
          << at;
      EXPECT_TRUE(got.slots == chain.slots.download()) << at;
      EXPECT_TRUE(got.latent == chain.latent.download() && got.lse == chain.lse.download()) << at;
      EXPECT_TRUE(got.heads == chain.heads.download()) << at;
      EXPECT_TRUE(got.out == step.d_out.download()) << at;
      EXPECT_TRUE(got.kv_cache == step.d_kv_cache.download()) << at;
      EXPECT_TRUE(got.k_cache == step.d_k_cache.download()) << at;
      EXPECT_EQ(got.errors, 0u) << at;
      EXPECT_EQ(step.d_errors.download()[0], 0u) << at;
    }
  }
}

TEST_F(DsaStageRopeGpu, FusedAndStockAgreeWithTheReferences) {
  for (int m : testing::quick_mode() ? std::vector<int>{1, 5} : std::vector<int>{1, 2, 5, 16}) {
    RopeStep step(m, *layer_, shape().plan, rng_);
    expect_paths_agree(*stage_, *layer_, step);
    if (HasFatalFailure()) return;
  }
}

// m = 1: the projections as linear_gemv; m = 9: cuBLASLt, and the indexer's
// projections in two launches (D = 7168 stages 8 tokens of x).
TEST_F(DsaStageRopeGpu, StepCapturesIntoAGraphAndReplaysTheSameBits) {
  cudaStream_t stream = nullptr;
  DSA_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int m : {1, 9}) {
    RopeStep step(m, *layer_, shape().plan, rng_);
    const DsaStepArgs args = step.args(shape());
    for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
      const RopeResult once = run_stage(*stage_, step, path, args);
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const Status captured =
          path == DsaPath::kFused ? stage_->forward(args, stream) : stage_->stock_forward(args, stream);
      DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
      DSA_ASSERT_OK(captured);
      DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 3; ++replay) {
        step.reset();
        DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
        DSA_ASSERT_CUDA(cudaStreamSynchronize(stream));
        const std::string at =
            std::string(path == DsaPath::kFused ? "fused" : "stock") + " m = " + std::to_string(m) + " replay " +
            std::to_string(replay);
        EXPECT_TRUE(step.d_out.download() == once.out) << at;
        EXPECT_TRUE(step.d_kv_cache.download() == once.kv_cache) << at;
        EXPECT_TRUE(step.d_k_cache.download() == once.k_cache) << at;
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
  }
  cudaStreamDestroy(stream);
}

// plan.batch_invariant: each token of a step alone (m = 1, its own rows of
// every input, the caches as the step left them: its own entry and key are
// rewritten with the same bytes) gives the bits it gives in the step of m
// tokens: projections and value-up on their GEMV kernels, the attention on
// the split that does not depend on m.
TEST_F(DsaStageRopeGpu, BatchInvariantPlanGivesATokenAloneItsBitsInTheBatch) {
  DsaStagePlan plan = shape().plan;
  plan.batch_invariant = true;
  std::unique_ptr<DsaAttentionStage> stage;
  DSA_ASSERT_OK(DsaAttentionStage::create(shape().config, layer_->weights(), plan, &stage));
  const int64_t D = shape().D, H = shape().H, L = shape().L, R = shape().R;
  for (int m : testing::quick_mode() ? std::vector<int>{5} : std::vector<int>{3, 9, 16}) {
    RopeStep step(m, *layer_, plan, rng_);
    const RopeResult batch = run_stage(*stage, step, DsaPath::kFused, step.args(shape()));
    EXPECT_EQ(batch.errors, 0u);
    const int W = indexer_row_width(step.plan);
    const auto row = [](const auto& all, int64_t width, int64_t r) {
      return std::vector<typename std::decay_t<decltype(all)>::value_type>(all.begin() + r * width,
                                                                            all.begin() + (r + 1) * width);
    };
    for (int t = 0; t < m; ++t) {
      const std::string at = "m = " + std::to_string(m) + ", token " + std::to_string(t);
      DsaStepArgs alone = step.args(shape());
      alone.hidden = make_tensor(step.d_hidden.get() + size_t(t) * D, DType::kBF16, {1, D});
      alone.positions = make_tensor(step.d_positions.get() + t, DType::kI64, {1});
      alone.token_requests = make_tensor(step.d_token_requests.get() + t, DType::kI32, {1});
      alone.slot_mapping = make_tensor(step.d_slot_mapping.get() + t, DType::kI64, {1});
      alone.out = make_tensor(step.d_out.get() + size_t(t) * D, DType::kBF16, {1, D});
      const RopeResult one = run_stage(*stage, step, DsaPath::kFused, alone, /*reset=*/false);
      EXPECT_TRUE(one.out == row(batch.out, D, t)) << at << ": out";
      EXPECT_TRUE(one.q_absorbed == row(batch.q_absorbed, H * (L + R), t)) << at << ": q_absorbed";
      EXPECT_TRUE(one.slots == row(batch.slots, W, t)) << at << ": slots";
      EXPECT_TRUE(one.latent == row(batch.latent, H * L, t)) << at << ": latent";
      EXPECT_TRUE(one.kv_cache == batch.kv_cache) << at << ": the token's entry rewritten with its bytes";
    }
  }
}

// Caller rows (an MTP step reusing a selection): the remap replaces the
// indexer, the indexer's K cache is not touched, the same slots and output.
TEST_F(DsaStageRopeGpu, CallerTopkRowsSkipTheIndexerAndGiveTheSameStep) {
  RopeStep step(3, *layer_, shape().plan, rng_);
  const DsaStepArgs args = step.args(shape());
  const RopeResult fused = run_stage(*stage_, step, DsaPath::kFused, args);
  DSA_ASSERT_OK(stage_->stock_forward(args, nullptr));  // keeps the request-local positions
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<int32_t> positions = download<int32_t>(stage_->intermediates(3).topk_positions);
  DeviceBuffer<int32_t> rows(positions);
  DsaStepArgs with_rows = args;
  with_rows.topk_positions = make_tensor(rows.get(), DType::kI32, {3, indexer_row_width(step.plan)});
  std::vector<std::string> names;
  DSA_ASSERT_OK(stage_->step_names(DsaPath::kFused, with_rows, &names));
  EXPECT_EQ(std::count(names.begin(), names.end(), "top-k remap"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "indexer select"), 0);
  step.reset();
  const RopeResult reused = run_stage(*stage_, step, DsaPath::kFused, with_rows, /*reset=*/false);
  EXPECT_TRUE(reused.k_cache == step.k_cache) << "the indexer's state is not touched";
  EXPECT_TRUE(reused.slots == fused.slots);
  EXPECT_TRUE(reused.out == fused.out);
  EXPECT_EQ(reused.errors, 0u);
}

TEST_F(DsaStageRopeGpu, StepArgumentsAndWorkspacesAreCheckedByName) {
  RopeStep step(2, *layer_, shape().plan, rng_);
  DsaStepArgs args = step.args(shape());
  // A NoPE cache's shape: [blocks, block_size, 512].
  args.kv_cache = make_tensor(step.d_kv_cache.get(), DType::kFP8E4M3, {step.blocks, kBlock, shape().L});
  testing::expect_rejected(stage_->forward(args, nullptr), "kv_cache", "656 bytes");
  testing::expect_rejected(stage_->stock_forward(args, nullptr), "kv_cache", "656 bytes");
  // The 656-byte entries as FP8 bytes are taken too.
  args = step.args(shape());
  args.kv_cache.dtype = DType::kFP8E4M3;
  step.reset();
  DSA_ASSERT_OK(stage_->forward(args, nullptr));
  DSA_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<std::string> names;
  DSA_ASSERT_OK(stage_->step_names(DsaPath::kStock, step.args(shape()), &names));
  ASSERT_EQ(names.size(), 11u);
  EXPECT_EQ(names[3], "rope_absorb (absorb + RoPE)");
  EXPECT_EQ(names.back(), "o_proj (cuBLASLt)");

  // A workspace is shared only by a layer of the same rotaries.
  std::unique_ptr<DsaAttentionStage> second;
  DSA_ASSERT_OK(DsaAttentionStage::create(shape().config, layer_->weights(), shape().plan, &second,
                                          stage_->workspace()));
  EXPECT_EQ(second->workspace(), stage_->workspace());
  DsaLayerConfig other = shape().config;
  other.rope->theta = 20000.0;
  std::unique_ptr<DsaAttentionStage> refused;
  testing::expect_rejected(
      DsaAttentionStage::create(other, layer_->weights(), shape().plan, &refused, stage_->workspace()), "workspace",
      "theta");
  EXPECT_EQ(refused, nullptr);
}

// glm5 at TP8 (D = 6144, 8 heads, P = 192, V = 256, 32 index heads, both
// rotaries interleaved): both paths against the references and each other.
TEST(DsaStageRopeGpuShapes, Glm5FusedAndStockAgreeWithTheReferences) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const RopeLayer layer(rope_shape("glm5", 8), rng);
  std::unique_ptr<DsaAttentionStage> stage;
  DSA_ASSERT_OK(DsaAttentionStage::create(layer.s.config, layer.weights(), layer.s.plan, &stage));
  for (int m : testing::quick_mode() ? std::vector<int>{2} : std::vector<int>{1, 4, 16}) {
    RopeStep step(m, layer, layer.s.plan, rng);
    expect_paths_agree(*stage, layer, step);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace dsa
