#include "synthetic_layer.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "dsa_decode/numerics.h"
#include "dsa_decode/rope.h"

namespace dsa::cli {

namespace {

// Static FP8 scales are amax / 448, as a calibration sets them. The
// activations here have unit variance by construction (RMS-normed q_c and
// kv_c, weights of std 1/sqrt(fan-in)), so an amax of 6 sigma uses most of the
// e4m3 range and leaves the largest of ~10^5 samples (about 4.5 sigma) unsaturated.
constexpr float kCalibratedAmax = 6.0f;
// RMSNorm epsilon of the order model configs use (1e-5 .. 1e-6); next to
// unit-variance rows it hardly moves the result.
constexpr float kNormEps = 1e-5f;

// Hash keys of the layer's tensors; fixed numbers, so a tensor's values do not
// change when others are added or removed.
enum class Tensor : uint64_t {
  kQNormGamma = 1,
  kKvNormGamma = 2,
  kQBProj = 3,
  kWUkT = 4,
  kWUv = 5,
  kCachedLatent = 8,
  kIndexK = 11,
  kIndexGate = 13,
  kIndexKNormWeight = 14,
  kIndexKNormBias = 15,
  kIndexApe = 16,
  kHidden = 17,
  kHiddenOutlierChannels = 18,
  kIndexWqB = 19,
  kIndexWk = 20,
  kIndexWeightsProj = 21,
  kIndexCompressGate = 22,
  kFusedQkvAProj = 23,
  kOProj = 24,
  kCachedRopeLatent = 25,
  kCachedRopeKPe = 26,
};

// Hidden states after a layer's input RMSNorm have unit scale but a few
// channels far larger (the outlier channels of trained models); the
// projection test's choice of 8 channels 20 times larger.
constexpr int kHiddenOutliers = 8;
constexpr float kHiddenOutlierScale = 20.0f;

// splitmix64's output function: a well-mixed 64-bit hash.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The random bits of element `index` of one tensor of the layer drawn from `seed`.
class ElementHash {
 public:
  ElementHash(uint64_t seed, Tensor tensor) : key_(mix64(seed ^ mix64(static_cast<uint64_t>(tensor)))) {}
  uint64_t operator()(uint64_t index) const { return mix64(key_ + (index + 1) * 0x9E3779B97F4A7C15ull); }

 private:
  uint64_t key_;
};

// Uniform in [-1, 1).
float signed_uniform(uint64_t bits) { return static_cast<float>(bits >> 40) * 0x1p-23f - 1.0f; }

// Standard normal by Box-Muller from two 24-bit parts of the hash.
float standard_normal(uint64_t bits) {
  const float u1 = (static_cast<float>(bits >> 40) + 0.5f) * 0x1p-24f;  // (0, 1): the log stays finite
  const float u2 = static_cast<float>(bits & 0xFFFFFFu) * 0x1p-24f;
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.28318530718f * u2);
}

std::vector<uint16_t> normal_bf16(size_t count, float mean, float stddev, const ElementHash& hash) {
  std::vector<uint16_t> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = num::float_to_bf16(mean + stddev * standard_normal(hash(i)));
  return values;
}

// FP32 values a BF16 checkpoint gives (BF16 values, exact in FP32).
std::vector<float> normal_bf16_as_float(size_t count, float mean, float stddev, const ElementHash& hash) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    values[i] = num::bf16_to_float(num::float_to_bf16(mean + stddev * standard_normal(hash(i))));
  }
  return values;
}

float inverse_sqrt(int fan_in) { return 1.0f / std::sqrt(static_cast<float>(fan_in)); }

// Uniform in [-sqrt(3), sqrt(3)): unit variance, and cheap enough for the rows
// of every cached token.
uint16_t unit_uniform_bf16(uint64_t bits) { return num::float_to_bf16(1.7320508f * signed_uniform(bits)); }

}  // namespace

std::string StepShape::describe() const {
  return preset + " TP" + std::to_string(tp) + " (D=" + std::to_string(D) + ", H=" + std::to_string(H) +
         ", Q=" + std::to_string(Q) + ", L=" + std::to_string(L) + ", P=" + std::to_string(P) +
         ", V=" + std::to_string(V) + "), m=" + std::to_string(m) + ", context " + std::to_string(context);
}

std::string StepShape::describe_indexer_shape() const {
  return std::to_string(index_heads) + " heads, pools of " + std::to_string(index_pool) + ", top-" +
         std::to_string(index_topk) + " (rows " + std::to_string(top_k_width()) + ")";
}

std::string StepShape::describe_indexer() const {
  const int requests = indexer_requests();
  std::string text = "indexer: " + describe_indexer_shape() + ", RING " + std::to_string(indexer_ring()) + ", ";
  if (requests == 1) {
    text += context > 0 ? "one request prefilled with the " + std::to_string(context) + " context positions"
                        : "one request, empty before the step (no context)";
  } else {
    text += std::to_string(requests) + " requests of up to " + std::to_string(indexer_tokens_per_request()) +
            " tokens, request r prefilled with the " + std::to_string(context) + " + " +
            std::to_string(indexer_tokens_per_request()) +
            "r positions before its first token (forks sharing the pages)";
  }
  return text + "; block table [" + std::to_string(requests) + ", " + std::to_string(cache_blocks()) +
         "] (identity rows), K cache [" + std::to_string(cache_blocks()) + ", " + std::to_string(indexer_page_bytes()) +
         "] bytes";
}

DsaStagePlan StepShape::stage_plan() const {
  DsaStagePlan plan;
  plan.max_tokens = m;
  plan.max_context = context + m;
  plan.ring = indexer_ring();
  plan.block_size = kCacheBlockSize;
  plan.indexer_heads = index_heads;
  plan.indexer_pool = index_pool;
  plan.indexer_topk = index_topk;
  plan.head_gemv_sums = head_gemv_sums;
  plan.indexer_logits = indexer_logits;
  plan.attention_plan = attention_plan;
  plan.batch_invariant = batch_invariant;
  return plan;
}

IndexerPlan StepShape::indexer_plan() const {
  IndexerPlan plan = dsa_stage_indexer_plan(stage_plan());
  if (rope()) {
    plan.rope_dims = R;
    RopeConfig config;
    if (rope_preset_config(preset, RopeTarget::kIndexer, &config).ok()) plan.rope_style = config.style;
  }
  return plan;
}

StepShape make_step_shape(const ModelPreset& per_rank, int m, int64_t context) {
  StepShape s{per_rank.name,    per_rank.tp,           per_rank.hidden,
              per_rank.heads,   per_rank.q_lora,       per_rank.kv_lora,
              per_rank.qk_nope, per_rank.v_head,       m,
              context,          per_rank.softmax_scale};
  s.per_rank = per_rank;
  s.index_heads = per_rank.index_heads;
  s.index_pool = per_rank.pool_size;
  s.index_topk = per_rank.topk;
  s.R = per_rank.qk_rope;
  RopeConfig rope;
  if (s.rope() && rope_preset_config(s.preset, RopeTarget::kAttention, &rope).ok()) {
    s.softmax_scale = static_cast<float>(rope_softmax_scale(rope, s.P + s.R));
  }
  return s;
}

std::vector<int64_t> HostCache::window_slots(const std::vector<int64_t>& slots) const {
  std::vector<int64_t> local(slots.size());
  for (size_t t = 0; t < slots.size(); ++t) local[t] = slots[t] - first_slot();
  return local;
}

HostWeights make_weights(const StepShape& s, uint64_t seed) {
  HostWeights w;
  // std 1/sqrt(fan-in): each product keeps its input's unit scale.
  w.fused_qkv_a_proj =
      normal_bf16(size_t(s.qkv_width()) * s.D, 0.0f, inverse_sqrt(s.D), ElementHash(seed, Tensor::kFusedQkvAProj));
  // Norm gammas near 1, as trained RMSNorm weights mostly are.
  w.q_norm_gamma = normal_bf16(s.Q, 1.0f, 0.05f, ElementHash(seed, Tensor::kQNormGamma));
  w.kv_norm_gamma = normal_bf16(s.L, 1.0f, 0.05f, ElementHash(seed, Tensor::kKvNormGamma));
  w.q_b_proj = normal_bf16(size_t(s.q_width()) * s.Q, 0.0f, inverse_sqrt(s.Q), ElementHash(seed, Tensor::kQBProj));
  w.w_uk_t = normal_bf16(size_t(s.H) * s.P * s.L, 0.0f, inverse_sqrt(s.P), ElementHash(seed, Tensor::kWUkT));
  w.w_uv = normal_bf16(size_t(s.H) * s.L * s.V, 0.0f, inverse_sqrt(s.L), ElementHash(seed, Tensor::kWUv));
  w.o_proj = normal_bf16(size_t(s.D) * s.H * s.V, 0.0f, inverse_sqrt(s.H * s.V), ElementHash(seed, Tensor::kOProj));
  w.q_scale = kCalibratedAmax / num::kFp8E4M3Max;
  w.k_scale = kCalibratedAmax / num::kFp8E4M3Max;
  w.eps = kNormEps;
  // The key LayerNorm's affine parameters near identity, as trained ones
  // mostly are; the positional bias of the pool softmax small next to the
  // unit-scale gates it is added to.
  w.index_k_norm_weight = normal_bf16_as_float(kIndexerDim, 1.0f, 0.05f, ElementHash(seed, Tensor::kIndexKNormWeight));
  w.index_k_norm_bias = normal_bf16_as_float(kIndexerDim, 0.0f, 0.02f, ElementHash(seed, Tensor::kIndexKNormBias));
  w.index_ape = normal_bf16_as_float(size_t(s.index_pool) * kIndexerDim, 0.0f, 0.1f,
                                     ElementHash(seed, Tensor::kIndexApe));
  // std 1/sqrt(fan-in), as the other projections: index_q, index_k, gate and
  // the head weights come out near unit scale, as the prefill's drawn rows.
  w.index_wq_b = normal_bf16(size_t(s.index_heads) * kIndexerDim * s.Q, 0.0f, inverse_sqrt(s.Q),
                             ElementHash(seed, Tensor::kIndexWqB));
  w.index_wk = normal_bf16(size_t(kIndexerDim) * s.D, 0.0f, inverse_sqrt(s.D), ElementHash(seed, Tensor::kIndexWk));
  w.index_weights_proj =
      normal_bf16(size_t(s.index_heads) * s.D, 0.0f, inverse_sqrt(s.D), ElementHash(seed, Tensor::kIndexWeightsProj));
  if (s.index_pool > 1) {
    w.index_compress_gate =
        normal_bf16(size_t(kIndexerDim) * s.D, 0.0f, inverse_sqrt(s.D), ElementHash(seed, Tensor::kIndexCompressGate));
  }
  return w;
}

HostStepInputs make_step_inputs(const StepShape& s, uint64_t seed) {
  HostStepInputs in;
  in.hidden = normal_bf16(size_t(s.m) * s.D, 0.0f, 1.0f, ElementHash(seed, Tensor::kHidden));
  const ElementHash outlier_hash(seed, Tensor::kHiddenOutlierChannels);
  std::set<size_t> outliers;  // distinct: no channel scaled twice
  for (uint64_t i = 0; outliers.size() < size_t(std::min(kHiddenOutliers, s.D)); ++i) {
    outliers.insert(outlier_hash(i) % size_t(s.D));
  }
  for (const size_t channel : outliers) {
    for (int t = 0; t < s.m; ++t) {
      uint16_t& x = in.hidden[size_t(t) * s.D + channel];
      x = num::float_to_bf16(kHiddenOutlierScale * num::bf16_to_float(x));
    }
  }
  in.slot_mapping.resize(s.m);
  for (int t = 0; t < s.m; ++t) in.slot_mapping[t] = s.context + t;
  in.positions = in.slot_mapping;
  in.token_requests.resize(s.m);
  for (int t = 0; t < s.m; ++t) in.token_requests[t] = t / s.indexer_tokens_per_request();
  return in;
}

IndexerTokenRows make_indexer_token_rows(uint64_t seed, int64_t first, int64_t count) {
  IndexerTokenRows rows;
  rows.index_k.resize(size_t(count) * kIndexerDim);
  rows.gate.resize(size_t(count) * kIndexerDim);
  const ElementHash k_hash(seed, Tensor::kIndexK), gate_hash(seed, Tensor::kIndexGate);
  for (size_t i = 0; i < rows.index_k.size(); ++i) {
    const uint64_t element = uint64_t(first) * kIndexerDim + i;
    rows.index_k[i] = unit_uniform_bf16(k_hash(element));
    rows.gate[i] = unit_uniform_bf16(gate_hash(element));
  }
  return rows;
}

IndexerTokenRows make_indexer_history(const StepShape& s, uint64_t seed) {
  return make_indexer_token_rows(seed, 0, s.indexer_prefill_tokens(s.indexer_requests() - 1));
}

std::vector<int32_t> make_indexer_block_table(const StepShape& s) {
  const int64_t width = s.cache_blocks();
  std::vector<int32_t> table(size_t(s.indexer_requests()) * width);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i % width);
  return table;
}

HostCache make_cache(const StepShape& s, const HostWeights& weights, uint64_t seed, int64_t first_block,
                     int64_t blocks) {
  HostCache cache;
  cache.first_block = first_block;
  cache.blocks = blocks;
  cache.width = s.L;
  cache.bytes.assign(size_t(blocks) * kCacheBlockSize * s.L, 0);
  const int64_t cached_end = std::min<int64_t>(s.context, (first_block + blocks) * kCacheBlockSize);
  for (int64_t slot = cache.first_slot(); slot < cached_end; ++slot) {
    make_cached_entry(s, weights, seed, slot, &cache.bytes[size_t(slot - cache.first_slot()) * s.L]);
  }
  return cache;
}

void make_cached_entry(const StepShape& s, const HostWeights& weights, uint64_t seed, int64_t slot, uint8_t* entry) {
  // Earlier tokens' latents (uniform in [-2, 2): cheap for long contexts),
  // stored as the cache write stores them.
  const ElementHash hash(seed, Tensor::kCachedLatent);
  for (int i = 0; i < s.L; ++i) {
    const uint16_t latent = num::float_to_bf16(2.0f * signed_uniform(hash(uint64_t(slot) * s.L + i)));
    entry[i] = num::cache_fp8(latent, weights.k_scale);
  }
}

void make_cached_rope_token(const StepShape& s, uint64_t seed, int64_t slot, uint16_t* kv_c, uint16_t* k_pe) {
  const ElementHash latent(seed, Tensor::kCachedRopeLatent), rope(seed, Tensor::kCachedRopeKPe);
  for (int i = 0; i < s.L; ++i) kv_c[i] = num::float_to_bf16(2.0f * signed_uniform(latent(uint64_t(slot) * s.L + i)));
  for (int i = 0; i < s.R; ++i) k_pe[i] = unit_uniform_bf16(rope(uint64_t(slot) * s.R + i));
}

}  // namespace dsa::cli
