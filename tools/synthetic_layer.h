// The synthetic DSA layer dsa-decode runs: one rank's weights at a preset's
// shapes, one decode step's inputs and the layer's FP8 KV cache, all drawn
// from a seed on the host. Every element is a hash of (seed, tensor, index),
// so any part of a tensor (a window of the cache) can be made on its own and
// the CPU and GPU paths see the same values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/presets.h"

namespace dsa::cli {

// Tokens per KV-cache block in served glm5next configurations.
inline constexpr int kCacheBlockSize = 256;

// The shapes of one decode step on one rank.
struct StepShape {
  std::string preset;
  int tp;
  int H;  // heads on this rank
  int Q;  // q_lora
  int L;  // kv_lora: latent width, KV-cache entry width
  int P;  // qk_nope: per-head query/key width
  int V;  // v_head
  int m;  // decode tokens
  int64_t context;  // tokens already cached; the new ones go to slots context..context+m-1

  int64_t q_width() const { return int64_t{H} * P; }  // q_b_proj's out features
  int qkv_width() const { return Q + L; }
  int64_t cache_blocks() const { return (context + m + kCacheBlockSize - 1) / kCacheBlockSize; }
  std::string describe() const;  // "glm5next TP1 (H=64, Q=1536, L=512, P=256, V=256), m=4, context 32768"
};

// `per_rank` is a NoPE preset already split by per_rank().
StepShape make_step_shape(const ModelPreset& per_rank, int m, int64_t context);

// BF16 values are held as their bit patterns.
struct HostWeights {
  std::vector<uint16_t> q_norm_gamma;   // [Q]
  std::vector<uint16_t> kv_norm_gamma;  // [L]
  std::vector<uint16_t> q_b_proj;       // [H*P, Q]: nn.Linear's [out, in]
  std::vector<uint16_t> w_uk_t;         // [H, P, L]
  std::vector<uint16_t> w_uv;           // [H, L, V]
  float q_scale = 0;                    // static FP8 scale of the absorbed query
  float k_scale = 0;                    // static FP8 scale of the KV cache
  float eps = 0;                        // of both RMSNorms
};

// Width of a top-k row: glm5next's 2048 pooled tokens, up to 3 tail tokens, -1 padding.
inline constexpr int kTopKWidth = kIndexerRowWidth;

struct HostStepInputs {
  std::vector<uint16_t> qkv;          // [m, Q + L]: stands in for fused_qkv_a_proj's output
  std::vector<int64_t> slot_mapping;  // [m]: context + t
  // [m, kTopKWidth] int32: the cache slots token t attends to, in the
  // indexer's row format; they stand in for the indexer's output (its GPU
  // prepare step is not wired in yet). The layer's cache holds one request
  // whose block table is the identity, so a token's position is its slot.
  // Token t (position context + t, L = context + t + 1 tokens visible): L <=
  // 2048: 0..L-1; else 512 distinct pools of the floor(L / 4) complete ones,
  // drawn from the seed, in increasing order, expanded to 4p..4p+3, then the
  // tail 4 floor(L / 4)..L-1; -1 up to the width.
  std::vector<int32_t> topk_slots;
};

// Blocks [first_block, first_block + blocks) of the layer's KV cache
// [blocks, kCacheBlockSize, L] FP8 e4m3, unpadded. Entries of slots below the
// context hold earlier tokens; the rest are zero until written.
struct HostCache {
  std::vector<uint8_t> bytes;
  int64_t first_block = 0;
  int64_t blocks = 0;
  int width = 0;  // L

  int64_t first_slot() const { return first_block * kCacheBlockSize; }
  // Slot numbers of the whole cache as slots of this window.
  std::vector<int64_t> window_slots(const std::vector<int64_t>& slots) const;
};

HostWeights make_weights(const StepShape& shape, uint64_t seed);
HostStepInputs make_step_inputs(const StepShape& shape, uint64_t seed);
HostCache make_cache(const StepShape& shape, const HostWeights& weights, uint64_t seed, int64_t first_block,
                     int64_t blocks);
// The cached entry of `slot` < context, as make_cache stores it: `entry` [L] e4m3.
void make_cached_entry(const StepShape& shape, const HostWeights& weights, uint64_t seed, int64_t slot,
                       uint8_t* entry);

}  // namespace dsa::cli
