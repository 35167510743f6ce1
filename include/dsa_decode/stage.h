// The DSA attention stage: one decode step of a DSA layer's attention half,
// hidden [m, D] in, o_proj's output [m, D] out, as vLLM's
// MultiHeadLatentAttentionWrapper.forward computes it, for two kinds of layer:
//   - NoPE (glm5next): no rotary embedding, a pooled indexer (pools of 4, 8
//     or 16), the FP8 e4m3 KV cache of L bytes a token;
//   - RoPE (dsv32, glm5): qk_rope_head_dim = R = 64 rotated dims per head
//     (config.rope), DeepSeek-V3.2's unpooled indexer (pool 1, its first R
//     dims rotated by config.indexer_rope), the 656-byte FP8 cache
//     (sparse_mla_v32.h).
// Built once per layer from its configuration and weight views (used in
// place), it allocates its workspace for the largest step; steps of m <=
// max_tokens tokens run on either path:
//   forward (fused): qkv_a_proj, both RMSNorms (one launch), q_b_proj, then
//     NoPE: the absorb with the KV cache write (head_gemv, FP8 query);
//     RoPE: rope_absorb (the absorbed latent and the rotated q_pe into one
//       BF16 query [m, H, L + R], k_pe rotated), then the 656-byte cache
//       write (sparse_mla_v32_cache_write);
//     the indexer (or, given topk_positions, only their remap), the attention
//     (NoPE sparse_mla, RoPE sparse_mla_v32), value-up (head_gemv or cuBLAS
//     bmm), o_proj. Projections run as linear_gemv for the token counts in
//     plan.projection_gemv_tokens, cuBLASLt otherwise. With
//     plan.overlap_indexer the indexer runs on the stage's second stream
//     between the norm and the attention (same kernels, same bits).
//   stock_forward: the stock engine's order with the fused path's
//     qkv_a_proj, indexer and attention: the fallback. NoPE: its own kernels
//     (concat_and_cache_mla, cuBLAS bmm absorb, static FP8 quant, a memset of
//     the split counters). RoPE: the engine's order (q_b_proj, the rotary,
//     the indexer, the cache write, the attention), where no stock kernel of
//     the library exists the fused one: rope_absorb stands for the engine's
//     rotary and absorb bmm (one launch, at the rotary's place, before the
//     indexer), the same 656-byte cache write; value-up cuBLAS bmm and
//     cuBLASLt projections as for NoPE.
// Numerics: the same roundings on both paths; they differ in FP32 summation
// order only, so KV cache bytes and selected slots are equal, the query
// agrees within one FP8 step (NoPE) or within the projections' bounds
// (RoPE), and latent and out within the attention's and GEMMs' bounds. The
// fused path is deterministic; with plan.batch_invariant a token's bits do
// not depend on the other tokens of its step.
// Run path: no allocation or synchronization; a step captures into a CUDA
// graph once each path has run uncaptured at the same m. One stream at a
// time per workspace. positions, token_requests and the block table must be
// complete when the step's first kernel starts (indexer.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kDsaStageMaxTokens = 16;  // MAX_TOKENS: larger steps run the engine's stock forward

// One DSA layer on this rank (vLLM's attribute names). A layer the stage
// cannot run is refused at creation, every missing requirement named.
struct DsaLayerConfig {
  int64_t hidden_size = 0;       // D
  int64_t num_heads = 0;         // H on this rank: 1..128
  int64_t q_lora_rank = 0;       // Q (q_lora_rank; 0 = the layer has none)
  int64_t kv_lora_rank = 0;      // L: the latent, one KV cache entry (512)
  int64_t qk_nope_head_dim = 0;  // P
  int64_t qk_rope_head_dim = 0;  // R: 0 (NoPE) or 64 (RoPE: the 656-byte cache entry's 64 RoPE values)
  int64_t v_head_dim = 0;        // V
  float softmax_scale = 0;       // of the attention's scores (glm5next: 256^-0.5)
  float rms_norm_eps = 0;        // of the q and kv a-norms (variance_epsilon)

  bool fuse_qkv_rmsnorm = false;          // fuse_qkv_rmsnorm: one fused_qkv_a_proj, then both a-norms
  bool rotary_embedding = false;          // rotary_emb is not None: true exactly when qk_rope_head_dim > 0
  bool indexer = false;                   // indexer is not None: the layer's own indexer (pooled for NoPE,
                                          // DeepSeek-V3.2's unpooled one for RoPE; its shape is the plan's)
  bool skip_topk = false;                 // skip_topk: the layer reuses another layer's selection
  bool gate_proj = false;                 // g_proj is not None
  bool dcp_query_replicate = false;       // dcp_q_replicate
  std::string kv_cache_dtype = "auto";    // "fp8" or "fp8_e4m3" needed; a RoPE layer also takes "fp8_ds_mla"
                                          // (vLLM's name of the 656-byte format)
  bool padded_heads = false;              // q_pad_num_heads is not None
  bool prefill_context_parallel = false;  // use_pcp
  bool hisparse_cache = false;            // hisparse_cache is not None
  int decode_context_parallel_size = 1;   // impl.dcp_world_size
  // The two rotaries of a RoPE layer (required at R > 0, not read at R = 0),
  // each with rope_dim = R (rope.h; check_rope_config's rules): the
  // attention's rotary of q_pe and k_pe (vLLM's rotary_emb), and the
  // indexer's of the first R dims of its q and k (the same frequencies,
  // its own style: DeepSeek-V3.2's is half-split). The workspace holds
  // both cos/sin tables (F32, rope_cos_sin_table) for positions
  // 0..plan.max_context - 1, filled at its creation; plan.max_context may not
  // pass rope.max_position. rope_preset_config gives a preset's.
  std::optional<RopeConfig> rope;
  std::optional<RopeConfig> indexer_rope;
};

// vLLM's configuration of a preset's layer (one rank). A RoPE preset (dsv32,
// glm5) gets its rotaries (rope_preset_config), kv_cache_dtype "fp8_ds_mla"
// and the softmax scale of its rotary (rope_softmax_scale at P + R: 0.1352338
// for dsv32, the preset table's 0.13523 rounded).
DsaLayerConfig dsa_layer_config(const ModelPreset& per_rank, float rms_norm_eps);

// Weight views (outliving the stage), BF16 unless noted, projections [out, in]:
// last dim contiguous, row stride % 8 == 0, 16 B aligned, on CUDA.
// R = qk_rope_head_dim (0 for NoPE).
struct DsaLayerWeights {
  TensorView fused_qkv_a_proj;  // [Q + L + R, D]: q_c | kv_c | k_pe (vLLM's fused wq_a | wkv_a)
  TensorView q_a_norm;          // [Q], contiguous
  TensorView kv_a_norm;         // [L], contiguous
  TensorView q_b_proj;          // [H * (P + R), Q]: head h's rows [P nope | R rope]
  TensorView w_uk_t;            // [H, P, L] (W_UK_T; L contiguous: "a column-major W_UK"; rows, heads not overlapping)
  TensorView w_uv;              // [H, L, V] (W_UV; V contiguous, head/row strides % 8 == 0, not overlapping)
  TensorView o_proj;            // [D, H * V]
  // NoPE only (a RoPE layer's query stays BF16 and its cache entries hold their own scales: not read, may be empty):
  TensorView q_scale;           // [1] f32: the absorbed query's static FP8 scale (_q_scale)
  TensorView k_scale;           // [1] f32: the KV cache's (_k_scale)
  // The indexer's (indexer.h), at the plan's shape: HI = plan.indexer_heads, S = plan.indexer_pool;
  // index_compress_gate and index_ape are the pooled indexer's only (S = 1, DeepSeek-V3.2's: not read,
  // may be empty):
  TensorView index_wq_b;           // [HI * 128, Q]
  TensorView index_wk;             // [128, D]
  TensorView index_weights_proj;   // [HI, D]
  TensorView index_compress_gate;  // [128, D]
  TensorView index_k_norm_weight;  // [128] f32
  TensorView index_k_norm_bias;    // [128] f32
  TensorView index_ape;            // [S, 128] f32
};

// Choices fixed at creation; the workspace is sized from them.
struct DsaStagePlan {
  int max_tokens = kDsaStageMaxTokens;  // largest m, 1..16
  int64_t max_context = 131072;         // largest L = pos + 1 a step may hold
  int ring = 4;                         // the indexer's RING: indexer_pool, or 2 * indexer_pool with draft
                                        // tokens (indexer_ring_for); 1 at pool 1 (no ring)
  int block_size = 256;                 // tokens per KV block: a positive multiple of 128 (of 64 at pool 1)
  // The layer's indexer shape, from the model config as vLLM reads it
  // (IndexerPlan's heads, pool, topk); the defaults are glm5next's first shape.
  int indexer_heads = kIndexerHeads;    // HI, index heads: 16, 32 or 64 (HF index_n_heads)
  int indexer_pool = kIndexerPoolSize;  // S, tokens per pool: 4, 8 or 16 (HF index_kpool) for a NoPE
                                        // layer; 1 (no pooling: DeepSeek-V3.2's indexer) for a RoPE layer
  int indexer_topk = kIndexerTopK;      // K, tokens of the selected pools: a multiple of S, at most
                                        // kIndexerMaxTopPools pools (HF index_topk); 1..2048 at pool 1
  // Defaults are the fastest path within each bound. batch_invariant: a
  // token's bits independent of its step's other tokens (SparseMlaPlan::
  // kBatchInvariant, value-up on head_gemv and projections on linear_gemv at
  // every m), overriding the three choices below; the stock path keeps its kernels.
  // A RoPE layer's attention (sparse_mla_v32) under kBatchInvariant runs the
  // fewest splits its row width allows (ceil(W / 1024)), a split that does not
  // depend on m; kAuto takes the kernel's own split, which does.
  bool batch_invariant = false;
  // m whose value-up runs as head_gemv (else cuBLAS bmm); unset:
  // dsa_stage_measured_value_up_tokens(H, head_gemv_sums).
  std::optional<std::set<int>> value_up_tokens;
  HeadGemvSums head_gemv_sums = HeadGemvSums::kTensorCores;      // the fused path's absorb and value-up
  IndexerLogits indexer_logits = IndexerLogits::kFp32Accumulation;  // both paths' select
  SparseMlaPlan attention_plan = SparseMlaPlan::kAuto;           // both paths' attention (see above for RoPE)
  bool indexer_projections_cublaslt = false;  // both paths' indexer projections: GEMV launch or cuBLASLt
  // m (1..kLinearGemvMaxTokens) whose projections run as linear_gemv where it
  // takes the shape (else cuBLASLt); unset: dsa_stage_measured_projection_gemv_tokens(H).
  std::optional<std::set<int>> projection_gemv_tokens;
  // The fused path's indexer on a second stream.
  bool overlap_indexer = true;
};

// The indexer plan of a stage plan (its shape, ring, block size, logits), for
// the caller's indexer state: rows of W = indexer_row_width(it) columns,
// k_cache pages of indexer_page_bytes(it), ring [requests, 2, ring, 128].
IndexerPlan dsa_stage_indexer_plan(const DsaStagePlan& plan);
// The indexer plan the stage runs for a layer: the above, and for a RoPE
// layer rope_dims = R and rope_style = config.indexer_rope's style: the plan
// the caller's indexer_prefill takes (with the table of config.indexer_rope).
IndexerPlan dsa_stage_indexer_plan(const DsaLayerConfig& config, const DsaStagePlan& plan);

// The default plan of a preset's layer: its indexer shape (index_heads,
// pool_size, topk) and RING = the pool size (no draft tokens; 1 at pool 1);
// every other field the struct's default.
DsaStagePlan dsa_stage_plan_for(const ModelPreset& per_rank);

// The indexer shape fields of a plan (indexer_heads, indexer_pool,
// indexer_topk): pooled (4, 8, 16) or pool 1; errors name the field, what it
// must be and what it is. Which pool a layer takes (pooled for NoPE, 1 for
// RoPE) is the stage's creation check.
Status check_dsa_stage_indexer_shape(const DsaStagePlan& plan);

// Default value-up head_gemv token counts: seed order {1, 2} at 64 heads and
// {1..4} at 8; tensor cores {1..8} at 64 and {1..16} at 8; others as 64.
std::set<int> dsa_stage_measured_value_up_tokens(int64_t heads, HeadGemvSums sums);

// The token counts whose value-up the stage runs as head_gemv on `heads`
// heads: 1..max_tokens under batch_invariant, else plan.value_up_tokens or
// the measured set of its sums.
std::set<int> dsa_stage_value_up_tokens(const DsaStagePlan& plan, int64_t heads);

// The attention's plan: kBatchInvariant under batch_invariant, else attention_plan.
SparseMlaPlan dsa_stage_attention_plan(const DsaStagePlan& plan);

// Default linear_gemv token counts: {1} at 64 heads, {1, 2} at 8; others as 64.
std::set<int> dsa_stage_measured_projection_gemv_tokens(int64_t heads);

// A pure decode step of 1..plan.max_tokens tokens.
bool dsa_stage_supports(const DsaStagePlan& plan, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens);

// One step's arguments. m = hidden.size(0), 1..plan.max_tokens.
struct DsaStepArgs {
  TensorView hidden;          // [m, D] BF16, dim 1 contiguous, row stride a multiple of 8, 16-byte aligned
  TensorView positions;       // [m] int64: the tokens' positions (L = pos + 1)
  TensorView token_requests;  // [m] int32: each token's row of the block table; negative = a padding token
  TensorView slot_mapping;    // [n] int64: the step's KV cache slots (negative, or t >= n: not written)
  // NoPE: [blocks, block_size, L] FP8 e4m3 (head_gemv.h's KvCacheWrite).
  // RoPE: [blocks, block_size, 656] bytes (u8, or fp8_e4m3 viewed as bytes): DeepSeek-V3.2's entries
  // (sparse_mla_v32.h: 512 e4m3 codes, four FP32 scales, 64 BF16 rotated k_pe values).
  TensorView kv_cache;
  IndexerState indexer;       // block table (the KV cache's too), ring, indexer K cache
  // Optional [m, W] int32 request-local positions (-1 = none; W = indexer_row_width of
  // dsa_stage_indexer_plan(plan), 2176 at the default shape, 2048 at pool 1 top-2048), the layout of
  // IndexerSelectArgs::topk_positions: the indexer does not run, these rows are remapped.
  TensorView topk_positions;
  TensorView out;                       // [m, D] BF16 out, as hidden
  unsigned int* error_count = nullptr;  // optional: untrusted device values met (slots, indices, positions)
};

// The stage's buffers as the last step on its stream left them; R =
// qk_rope_head_dim. A view the layer's kind does not use is empty.
struct DsaStageIntermediates {
  TensorView qkv;             // [m, Q + L + R] BF16: qkv_a_proj's output
  TensorView q_c;             // [m, Q] BF16
  TensorView kv_c;            // [m, L] BF16
  TensorView q;               // [m, H, P + R] BF16
  TensorView q_fp8;           // NoPE: [m, H, L] e4m3
  TensorView q_absorbed;      // RoPE: [m, H, L + R] BF16, rope_absorb's (the attention's query)
  TensorView k_pe;            // RoPE: [m, R] BF16, rotated (the cache entries' RoPE part)
  // HI, S, K: the plan's indexer_heads, indexer_pool, indexer_topk; W = indexer_row_width.
  TensorView index_q;         // [m, HI, 128] BF16: the indexer's projections (not written with caller rows)
  TensorView index_k;         // [m, 128] BF16
  TensorView head_weights;    // [m, HI] f32
  TensorView gate;            // pooled indexer: [m, 128] BF16
  TensorView index_logits;    // [m, ceil(max_context / S)] f32, valid at pools p < L / S when L > K
  TensorView indexer_workspace;  // [bytes] u8: the indexer's workspace (indexer_workspace_layout of the
                                 // stage's indexer plan: q codes, folded weights, logits)
  TensorView topk_positions;  // [m, W] int32: written by the stock select only
  TensorView slots;           // [m, W] int32 global KV slots
  TensorView latent;          // [m, H, L] BF16 (L = 512)
  TensorView lse;             // [m, H] f32
  TensorView heads;           // [m, H, V] BF16: value-up's output
};

enum class DsaPath { kFused, kStock };

// Device buffers, cuBLAS/cuBLASLt handles and the indexer's stream (about
// 100 MiB at TP1, max_tokens 16; a RoPE layer's also its two cos/sin tables,
// max_context x R floats each). Layers of one configuration and plan that
// run one after another on one stream can share one; such stages are created,
// run and captured one at a time on one thread, and two captures in flight
// may not both hold them. Bound to the device it was made on.
class DsaStageWorkspace {
 public:
  // cudaMalloc on the current device: call it outside a capture.
  static Status create(const DsaLayerConfig& config, const DsaStagePlan& plan,
                       std::shared_ptr<DsaStageWorkspace>* workspace);
  ~DsaStageWorkspace();
  DsaStageWorkspace(const DsaStageWorkspace&) = delete;
  DsaStageWorkspace& operator=(const DsaStageWorkspace&) = delete;

  struct Buffers;  // src/stage/stage.cpp

 private:
  friend class DsaAttentionStage;
  DsaStageWorkspace();
  std::unique_ptr<Buffers> buffers_;
};

class DsaAttentionStage {
 public:
  // Checks configuration and weights, one error naming every missing
  // requirement (kUnsupported for layer features, kInvalidArgument for
  // views); takes `workspace` (same configuration and plan, else an error
  // naming it) or allocates one (outside a capture).
  static Status create(const DsaLayerConfig& config, const DsaLayerWeights& weights, const DsaStagePlan& plan,
                       std::unique_ptr<DsaAttentionStage>* stage,
                       std::shared_ptr<DsaStageWorkspace> workspace = nullptr);
  ~DsaAttentionStage();
  DsaAttentionStage(const DsaAttentionStage&) = delete;
  DsaAttentionStage& operator=(const DsaAttentionStage&) = delete;

  // dsa_stage_supports with this stage's plan.
  bool supports(int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) const;

  Status forward(const DsaStepArgs& args, cudaStream_t stream);
  Status stock_forward(const DsaStepArgs& args, cudaStream_t stream);

  // A path's launches one by one: its step names for these arguments, in
  // issue order, and a run of `count` of them from `first` (kAllSteps: to the
  // end). A range holding indexer steps of an overlapped forward joins the
  // indexer's stream before the attention or at the range's end.
  static constexpr size_t kAllSteps = ~size_t{0};
  Status step_names(DsaPath path, const DsaStepArgs& args, std::vector<std::string>* names) const;
  Status run_steps(DsaPath path, const DsaStepArgs& args, size_t first, size_t count, cudaStream_t stream);

  DsaStageIntermediates intermediates(int64_t m) const;
  // Pass it to the next layer's create to share it.
  std::shared_ptr<DsaStageWorkspace> workspace() const;
  const DsaLayerConfig& config() const;
  const DsaStagePlan& plan() const;

 private:
  DsaAttentionStage();
  struct State;  // src/stage/stage.cpp
  std::unique_ptr<State> state_;
};

}  // namespace dsa
