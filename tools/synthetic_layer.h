// The synthetic DSA layer dsa-decode runs: one rank's weights at a preset's
// shapes (every weight the library's stage takes, include/dsa_decode/stage.h),
// one decode step's inputs (the hidden states and where the step's tokens
// go), the layer's FP8 KV cache and the indexer's rows of the cached tokens,
// all drawn from a seed on the host.
// Every element is a hash of (seed, tensor, index), so any part of a tensor (a
// window of the cache) can be made on its own and the CPU and GPU paths see
// the same values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/stage.h"

namespace dsa::cli {

// Tokens per KV-cache block in served glm5next configurations; also the
// indexer's block size (a multiple of 128, as its pages need).
inline constexpr int kCacheBlockSize = 256;

// The shapes of one decode step on one rank.
//
// The indexer's shape is the preset's (index_heads, pool_size S, topk K: the
// model config's index_n_heads, index_kpool, index_topk). Its ring holds 2 S
// rows, its size with draft tokens (include/dsa_decode/indexer.h, "Ring"), so
// a step may carry up to 2 S - (S - 1) = S + 1 tokens of one request (5 at
// S = 4; RING = S would allow one).
//
// The step's m tokens are one request's consecutive positions
// context..context+m-1 (a token and its drafts), in the main KV cache at the
// slots of the same numbers. The indexer takes at most
// indexer_tokens_per_request() tokens of one request per step, so token t goes
// to indexer request t / indexer_tokens_per_request(), and request r's state starts from positions
// 0..indexer_prefill_tokens(r) - 1, those before its first token (for r >= 1
// that includes the step's earlier tokens: a fork of request 0). Every
// request's block table row is the identity, so all of them read and write the
// same pages. The prefill's rows are a synthetic draw per position
// (make_indexer_history), the step's own rows come from its projections
// (indexer_project), so for m > 5 a fork's prefill pools and stashes the
// drawn rows of the step's earlier positions: request 0's prepare then
// rewrites those pools from the projected rows, but request r >= 1 keeps the
// drawn rows in its ring, and the first pool its tokens complete may mix the
// two. The GPU and the CPU reference do the same, so the checks hold. For
// m <= S + 1 there is exactly one request and every pool of the step's
// positions is what one request decoded token by token would give.
struct StepShape {
  std::string preset;
  int tp;
  int D;  // hidden: the width of the hidden states (the stage's input and output rows)
  int H;  // heads on this rank
  int Q;  // q_lora
  int L;  // kv_lora: latent width, KV-cache entry width
  int P;  // qk_nope: per-head query/key width
  int V;  // v_head
  int m;  // decode tokens
  int64_t context;  // tokens already cached; the new ones go to slots context..context+m-1
  float softmax_scale;                                   // the attention's, the preset's (glm5next: 256^-0.5)
  IndexerLogits indexer_logits = IndexerLogits::kFp32Accumulation;  // the select's dots (--indexer-logits)
  HeadGemvSums head_gemv_sums = HeadGemvSums::kTensorCores;  // the fused path's head_gemv sums (--head-gemv-sums)
  SparseMlaPlan attention_plan = SparseMlaPlan::kAuto;       // both paths' sparse_mla plan (--attention-plan)
  bool batch_invariant = false;                              // --batch-invariant
  ModelPreset per_rank{};  // the preset on one rank, which the fields above come from (the stage's configuration)
  // The indexer's shape (the preset's index_heads, pool_size, topk).
  int index_heads = kIndexerHeads;    // HI
  int index_pool = kIndexerPoolSize;  // S
  int index_topk = kIndexerTopK;      // K
  // Where the shapes came from: "preset glm5next", or the config.json and
  // options that overrode it (dsa-decode --config, --index-*).
  std::string shape_source = "the preset";
  // RoPE dims per head (the preset's qk_rope: 64 for dsv32 and glm5, 0 for
  // glm5next). With R > 0, qkv_a_proj also yields k_pe [m, R], each query head
  // is [P nope | R rope], and the indexer is DeepSeek-V3.2's: pool 1, its first
  // R dims of q and k rotated (rope_dims), no ring, gate or ape.
  int R = 0;

  bool rope() const { return R > 0; }
  int64_t q_width() const { return int64_t{H} * (P + R); }  // q_b_proj's out features
  int qkv_width() const { return Q + L + R; }               // q_c | kv_c | k_pe
  int64_t cache_blocks() const { return (context + m + kCacheBlockSize - 1) / kCacheBlockSize; }
  // RING with draft tokens (1: no ring, pool 1).
  int indexer_ring() const { return index_pool == 1 ? 1 : 2 * index_pool; }
  int indexer_tokens_per_request() const {
    return index_pool == 1 ? kIndexerMaxTokens : indexer_ring() - (index_pool - 1);
  }
  // One indexer page: the pooled keys of one KV block (kCacheBlockSize / S pools of 132 bytes).
  int64_t indexer_page_bytes() const { return int64_t{kCacheBlockSize} / index_pool * kIndexerPoolBytes; }
  // Columns of a top-k row: K + S - 1 rounded up to 128 (indexer_row_width).
  int top_k_width() const { return indexer_row_width(indexer_plan()); }
  int indexer_requests() const { return (m + indexer_tokens_per_request() - 1) / indexer_tokens_per_request(); }
  int64_t indexer_prefill_tokens(int request) const {
    return context + int64_t{request} * indexer_tokens_per_request();
  }
  // The stage's plan of this step: max_tokens m, max_context context + m, RING indexer_ring(), block size
  // kCacheBlockSize, the indexer's shape and the three numeric choices above (value_up_tokens and the indexer's
  // projection kernel are the caller's).
  DsaStagePlan stage_plan() const;
  // dsa_stage_indexer_plan(stage_plan()): what the indexer's state, its prefill and its CPU reference use;
  // with R > 0 also rope_dims = R and the preset's indexer rope style (rope_preset_config, kIndexer).
  IndexerPlan indexer_plan() const;
  std::string describe() const;  // "glm5next TP1 (D=4096, H=64, Q=1536, L=512, P=256, V=256), m=4, context 32768"
  // "32 heads, pools of 4, top-2048 (rows 2176)"
  std::string describe_indexer_shape() const;
  // "indexer: 32 heads, pools of 4, top-2048 (rows 2176), RING 8, one request prefilled with the 32768 context
  // positions; block table [1, 129] ..."
  std::string describe_indexer() const;
};

// `per_rank` is a preset already split by per_rank(); the indexer's shape is
// its index_heads, pool_size and topk. A RoPE preset (qk_rope > 0) takes the
// attention's softmax scale of its rotary (rope_softmax_scale: 0.1352338 for
// dsv32) rather than the table's rounded one.
StepShape make_step_shape(const ModelPreset& per_rank, int m, int64_t context);

// BF16 values are held as their bit patterns.
struct HostWeights {
  std::vector<uint16_t> fused_qkv_a_proj;  // [Q + L, D]: nn.Linear's [out, in]
  std::vector<uint16_t> q_norm_gamma;      // [Q]: q_a_norm
  std::vector<uint16_t> kv_norm_gamma;     // [L]: kv_a_norm
  std::vector<uint16_t> q_b_proj;          // [H*P, Q]: nn.Linear's [out, in]
  std::vector<uint16_t> w_uk_t;            // [H, P, L]
  std::vector<uint16_t> w_uv;              // [H, L, V]
  std::vector<uint16_t> o_proj;            // [D, H*V]: nn.Linear's [out, in]
  float q_scale = 0;                    // static FP8 scale of the absorbed query
  float k_scale = 0;                    // static FP8 scale of the KV cache
  float eps = 0;                        // of both RMSNorms
  // The indexer's parameters, FP32 as the indexer takes them, with BF16
  // values (what a BF16 checkpoint converts to exactly).
  std::vector<float> index_k_norm_weight;  // [128]
  std::vector<float> index_k_norm_bias;    // [128]
  std::vector<float> index_ape;            // [S, 128]
  // The indexer's projections (indexer_project), nn.Linear's [out, in].
  std::vector<uint16_t> index_wq_b;           // [HI * 128, Q]
  std::vector<uint16_t> index_wk;             // [128, D]
  std::vector<uint16_t> index_weights_proj;   // [HI, D]
  std::vector<uint16_t> index_compress_gate;  // [128, D]; empty with pool 1 (V3.2's indexer has none)
};

// index_k and gate rows of consecutive positions, the indexer prefill's
// stand-ins for the projections of the context's tokens. Each row is a
// function of its position alone, so every request's prefill of a position
// reads the same row.
struct IndexerTokenRows {
  std::vector<uint16_t> index_k;  // [count, 128] BF16, before the indexer's LayerNorm
  std::vector<uint16_t> gate;     // [count, 128] BF16
};

// The step's inputs: the hidden states (fused_qkv_a_proj's and the indexer's
// projections' input) and where the step's tokens go.
struct HostStepInputs {
  std::vector<uint16_t> hidden;        // [m, D] BF16: x, as the attention takes it (after the input RMSNorm)
  std::vector<int64_t> slot_mapping;   // [m]: context + t
  std::vector<int64_t> positions;      // [m]: context + t (the indexer's; the block table is the identity)
  std::vector<int32_t> token_requests; // [m]: t / indexer_tokens_per_request() (see StepShape)
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
// The index_k and gate rows of positions first..first+count-1.
IndexerTokenRows make_indexer_token_rows(uint64_t seed, int64_t first, int64_t count);
// The rows the prefill reads: positions 0 up to the last indexer request's first token.
IndexerTokenRows make_indexer_history(const StepShape& shape, uint64_t seed);
// The indexer's block table [indexer_requests(), cache_blocks()] int32: every row the identity.
std::vector<int32_t> make_indexer_block_table(const StepShape& shape);
HostCache make_cache(const StepShape& shape, const HostWeights& weights, uint64_t seed, int64_t first_block,
                     int64_t blocks);
// A RoPE preset's cached token of `slot` < context: its kv_c [L] (uniform in
// [-2, 2)) and rotated k_pe [R] (unit variance) BF16 rows, drawn from the seed;
// the 656-byte entry is their cache write (reference::v32_quantize_token).
void make_cached_rope_token(const StepShape& shape, uint64_t seed, int64_t slot, uint16_t* kv_c, uint16_t* k_pe);
// The cached entry of `slot` < context, as make_cache stores it: `entry` [L] e4m3.
void make_cached_entry(const StepShape& shape, const HostWeights& weights, uint64_t seed, int64_t slot,
                       uint8_t* entry);

}  // namespace dsa::cli
