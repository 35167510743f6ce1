// The DSA attention stage (issue 6): one decode step of a DSA layer's
// attention half, hidden states in and o_proj's output out, as vLLM's
// MultiHeadLatentAttentionWrapper.forward of a glm5next (NoPE) DSA layer
// computes it; the C++ form of the seed's DsaAttentionStage.
//
// Built once per layer from its configuration and device views of its
// weights (used in place, never copied), it plans and allocates its
// workspace for the largest step, then runs steps of m <= max_tokens decode
// tokens through either path:
//
//   fused (forward):
//     qkv_a_proj  qkv [m, Q + L] = hidden [m, D] x fused_qkv_a_proj^T     linear_gemv or cuBLASLt
//     norm        q_c [m, Q], kv_c [m, L]: both RMSNorms, one launch      qkv_rmsnorm (norm.h)
//     q_b_proj    q [m, H * P] = q_c x q_b_proj^T                         linear_gemv or cuBLASLt
//     absorb      q_fp8 [m, H, L] = FP8(q x W_UK_T) and kv_c into the
//                 KV cache at slot_mapping, one launch                    head_gemv (head_gemv.h)
//     indexer     projections, prepare, select: top-k rows remapped to
//                 global KV slots [m, 2176]                               indexer.h
//       or, when the caller gives topk_positions (MTP draft steps 1+
//       reuse step 0's selection), only their remap                       indexer_remap
//     attention   latent [m, H, L] BF16, lse [m, H]                       sparse_mla (sparse_mla.h)
//     value_up    heads [m, H, V] = latent x W_UV: head_gemv for the token
//                 counts in plan.value_up_tokens, cuBLAS's bmm otherwise
//     o_proj      out [m, D] = heads x o_proj^T                           linear_gemv or cuBLASLt
//   The three projections run as linear_gemv (linear.h: one launch with PDL,
//   a fixed order) for the token counts in plan.projection_gemv_tokens that
//   the kernel takes, cuBLASLt otherwise.
//   Every kernel of ours launches with programmatic dependent launch (PDL)
//   and loads its weights before waiting for its predecessor; cuBLAS and
//   cuBLASLt launches carry no PDL attribute. With plan.overlap_indexer (the
//   default) the indexer's launches (or the remap) run on a stream of the
//   stage's own, beside q_b_proj and the absorb: forked from the caller's
//   stream after the norm, joined before the attention (in a capture, a
//   fork and a join of the graph). Nothing else changes: the same kernels
//   on the same inputs, the same bits.
//
//   stock (stock_forward): the same step in the stock engine's order with
//   unfused kernels, the fallback and the baseline every speedup is measured
//   against: qkv_a_proj (the fused path's kernel: the two paths' KV cache
//   bytes and indexer inputs must agree), norm, q_b_proj, the indexer (the
//   fused path's select: the paths differ in what the fusion changes only),
//   concat_and_cache_mla, cuBLAS absorb bmm, static FP8 quant, a
//   cudaMemsetAsync of the attention's split counters, the same attention
//   (no stock Hopper kernel reads this cache format), cuBLAS W_UV bmm,
//   o_proj. The indexer's projections and prepare are the fused path's
//   (plan.indexer_projections_cublaslt picks the projections' kernel for
//   both): with other projections' sums a near-tie could select another
//   pool, and the paths could not be compared row for row.
//
// Numerics: both paths apply the same roundings (BF16 round to nearest even,
// the stock static FP8 quant, the cache write's rounded division); they
// differ in FP32 summation order only (head_gemv's and linear_gemv's fixed
// orders against cuBLAS's), so the KV cache bytes and the selected slots are
// equal (qkv_a_proj is one kernel for both; both selects are exact over the
// same logits), q_fp8 agrees within one FP8 step when q_b_proj ran through
// the same kernel (else each path's q_fp8 is within one step of the float64
// absorb of its own q), and latent and out agree within the attention's and
// the GEMMs' tolerances (docs/stage.md). The fused path is deterministic; a
// token's bits do not depend on the batch around it when
// plan.attention_splits is batch invariant (the default), value_up_tokens
// holds every m or none (the two value-up kernels add in different orders)
// and every m the stage runs takes all three projections as linear_gemv (in
// projection_gemv_tokens and within linear_gemv_supports: cuBLASLt picks its
// algorithm, hence its order, per m).
//
// Run path: no allocation, no synchronization; a step captures into a CUDA
// graph once each path has run uncaptured at the same m (the first launch
// of a kernel on a device sets its shared-memory and cluster limits, and the
// first cuBLASLt call of a shape asks the heuristic: host work kept out of a
// capture). One stream at a time: the workspace and the indexer's stream
// are the stage's own (or shared, DsaStageWorkspace, with stages that run
// on the same stream), and each call returns with all its work ordered
// before the caller's next work on `stream`. Inputs
// the indexer reads before its PDL wait (positions, token_requests, the
// block table) must be complete when the step's first kernel starts (written
// by host copies or by kernels outside this chain; indexer.h says why).
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
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kDsaStageMaxTokens = 16;  // MAX_TOKENS: larger steps run the engine's stock forward

// What the engine knows of one DSA layer on this rank (vLLM's MLA wrapper
// and its attention's attribute names in the comments). The flags are the
// seed's checks: a layer this stage cannot run is refused at creation with
// every missing requirement named.
struct DsaLayerConfig {
  int64_t hidden_size = 0;       // D
  int64_t num_heads = 0;         // H on this rank: 1..128
  int64_t q_lora_rank = 0;       // Q (q_lora_rank; 0 = the layer has none)
  int64_t kv_lora_rank = 0;      // L: the latent, one KV cache entry (512)
  int64_t qk_nope_head_dim = 0;  // P
  int64_t qk_rope_head_dim = 0;  // must be 0: NoPE
  int64_t v_head_dim = 0;        // V
  float softmax_scale = 0;       // of the attention's scores (glm5next: 256^-0.5)
  float rms_norm_eps = 0;        // of the q and kv a-norms (variance_epsilon)

  bool fuse_qkv_rmsnorm = false;          // fuse_qkv_rmsnorm: one fused_qkv_a_proj, then both a-norms
  bool rotary_embedding = false;          // rotary_emb is not None
  bool indexer = false;                   // indexer is not None: the layer's own glm5next indexer
  bool skip_topk = false;                 // skip_topk: the layer reuses another layer's selection
  bool gate_proj = false;                 // g_proj is not None
  bool dcp_query_replicate = false;       // dcp_q_replicate
  std::string kv_cache_dtype = "auto";    // "fp8" or "fp8_e4m3" needed
  bool padded_heads = false;              // q_pad_num_heads is not None
  bool prefill_context_parallel = false;  // use_pcp
  bool hisparse_cache = false;            // hisparse_cache is not None
  int decode_context_parallel_size = 1;   // impl.dcp_world_size
};

// The configuration vLLM builds for a preset's layer (presets.h, one rank):
// its shapes and softmax scale, a fused q/kv a-norm, an FP8 KV cache, a
// rotary embedding where the preset has rope dims, and the indexer flag
// where its indexer is glm5next's (32 heads of 128, pools of 4). glm5next
// passes the creation checks; the RoPE presets are refused, naming why.
DsaLayerConfig dsa_layer_config(const ModelPreset& per_rank, float rms_norm_eps);

// Device views of the layer's weights, BF16 unless noted, nn.Linear's
// [out, in] layout for the projections (each view: last dim contiguous, row
// stride a multiple of 8 elements, data 16-byte aligned, on CUDA). Views,
// not copies: the weights must outlive the stage and stay where they are.
struct DsaLayerWeights {
  TensorView fused_qkv_a_proj;  // [Q + L, D]
  TensorView q_a_norm;          // [Q], contiguous
  TensorView kv_a_norm;         // [L], contiguous
  TensorView q_b_proj;          // [H * P, Q]
  TensorView w_uk_t;            // [H, P, L] (W_UK_T; L contiguous: "a column-major W_UK"; rows, heads not overlapping)
  // [H, L, V] (W_UV; V contiguous, head and row strides of a multiple of 8;
  // where value-up runs as head_gemv, rows and heads that do not overlap)
  TensorView w_uv;
  TensorView o_proj;            // [D, H * V]
  TensorView q_scale;           // [1] f32: the absorbed query's static FP8 scale (_q_scale)
  TensorView k_scale;           // [1] f32: the KV cache's (_k_scale)
  // The indexer (indexer.h): its projections, then its LayerNorm and pool parameters in FP32.
  TensorView index_wq_b;           // [32 * 128, Q]
  TensorView index_wk;             // [128, D]
  TensorView index_weights_proj;   // [32, D]
  TensorView index_compress_gate;  // [128, D]
  TensorView index_k_norm_weight;  // [128] f32
  TensorView index_k_norm_bias;    // [128] f32
  TensorView index_ape;            // [4, 128] f32
};

// Choices fixed at creation; the workspace is sized from them.
struct DsaStagePlan {
  int max_tokens = kDsaStageMaxTokens;  // largest m, 1..16
  int64_t max_context = 131072;         // largest L = pos + 1 a step may hold
  int ring = 4;                         // the indexer's RING: 4, or 8 with draft tokens
  int block_size = 256;                 // tokens per KV block: a positive multiple of 128
  // Contract v2 (DESIGN.md section 2): every default is the fastest path
  // within its bound. batch_invariant (vLLM's VLLM_BATCH_INVARIANT) makes a
  // token's output bits independent of the other tokens of its step: the
  // attention's SparseMlaPlan::kBatchInvariant, value-up on head_gemv and
  // the three projections on linear_gemv at every m (in launches of as many
  // tokens as linear_gemv takes), overriding attention_plan, value_up_tokens
  // and projection_gemv_tokens. It governs the fused path; the stock path
  // keeps the stock engine's kernels (and takes the same attention plan).
  bool batch_invariant = false;
  // Token counts whose value-up runs as head_gemv (cuBLAS's bmm otherwise);
  // unset: dsa_stage_measured_value_up_tokens(H, head_gemv_sums).
  std::optional<std::set<int>> value_up_tokens;
  HeadGemvSums head_gemv_sums = HeadGemvSums::kTensorCores;      // the fused path's absorb and value-up
  IndexerLogits indexer_logits = IndexerLogits::kFp32Accumulation;  // both paths' select
  SparseMlaPlan attention_plan = SparseMlaPlan::kAuto;           // both paths' attention
  bool indexer_projections_cublaslt = false;  // both paths' indexer projections: GEMV launch or cuBLASLt
  // Token counts (1..kLinearGemvMaxTokens) whose projections run as
  // linear_gemv (the fused path's three; qkv_a_proj in both paths),
  // cuBLASLt otherwise and where the kernel's shared-memory rule refuses the
  // shape (o_proj at TP1 past m = 4); unset:
  // dsa_stage_measured_projection_gemv_tokens(H).
  std::optional<std::set<int>> projection_gemv_tokens;
  // The fused path's indexer on a second stream beside q_b_proj and the
  // absorb (the stock path stays in the stock engine's single-stream order).
  bool overlap_indexer = true;
};

// The indexer's plan of a stage plan (its max_tokens, max_context, ring,
// block_size and logits): what the caller's indexer state and prefill use.
IndexerPlan dsa_stage_indexer_plan(const DsaStagePlan& plan);

// The token counts at which value-up's head_gemv beat cuBLAS's bmm on the
// H200 (docs/head_gemv.md): seed order 1, 2 at 64 heads and 1..4 at 8 heads;
// tensor-core sums 1..8 at 64 heads and 1..16 at 8 heads; head counts not
// measured take 64 heads' set.
std::set<int> dsa_stage_measured_value_up_tokens(int64_t heads, HeadGemvSums sums);

// The token counts at which the stage's whole step was faster with
// linear_gemv projections than with cuBLASLt's on the H200 (docs/linear.md):
// m = 1 at 64 heads, 1 and 2 at 8 heads; head counts not measured take 64
// heads' set.
std::set<int> dsa_stage_measured_projection_gemv_tokens(int64_t heads);

// The seed's supports(): a pure decode step of 1..plan.max_tokens tokens
// (every token of the batch is one of the step's decode tokens).
bool dsa_stage_supports(const DsaStagePlan& plan, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens);

// One step's arguments. m = hidden.size(0), 1..plan.max_tokens.
struct DsaStepArgs {
  TensorView hidden;          // [m, D] BF16, dim 1 contiguous, row stride a multiple of 8, 16-byte aligned
  TensorView positions;       // [m] int64: the tokens' positions (L = pos + 1)
  TensorView token_requests;  // [m] int32: each token's row of the block table; negative = a padding token
  TensorView slot_mapping;    // [n] int64: the step's KV cache slots (negative, or t >= n: not written)
  TensorView kv_cache;        // [blocks, block_size, L] FP8 e4m3 (head_gemv.h's KvCacheWrite)
  IndexerState indexer;       // block table (the KV cache's too), ring, indexer K cache
  // Optional [m, 2176] int32 request-local positions, -1 = none (the layout of
  // IndexerSelectArgs::topk_positions: dim 1 contiguous, token stride a
  // multiple of 4 and >= 2176, 16-byte aligned): when given,
  // the indexer does not run (its state is not updated for these tokens, as
  // the seed skips it) and these rows are remapped to slots instead.
  TensorView topk_positions;
  TensorView out;                       // [m, D] BF16 out, as hidden
  unsigned int* error_count = nullptr;  // optional: untrusted device values met (slots, indices, positions)
};

// Views of the stage's own buffers as the last step on its stream left
// them (read them after that step; the next step overwrites them).
struct DsaStageIntermediates {
  TensorView qkv;             // [m, Q + L] BF16: qkv_a_proj's output
  TensorView q_c;             // [m, Q] BF16
  TensorView kv_c;            // [m, L] BF16
  TensorView q;               // [m, H, P] BF16
  TensorView q_fp8;           // [m, H, L] e4m3
  TensorView index_q;         // [m, 32, 128] BF16: the indexer's projections (not written with caller rows)
  TensorView index_k;         // [m, 128] BF16
  TensorView head_weights;    // [m, 32] f32
  TensorView gate;            // [m, 128] BF16
  // [m, ceil(max_context / 4)] f32: the last select's logits, valid at pools
  // p < L / 4 of a token with L > 2048 (indexer.h, step 6)
  TensorView index_logits;
  TensorView topk_positions;  // [m, 2176] int32: written by the stock select only
  TensorView slots;           // [m, 2176] int32 global KV slots
  TensorView latent;          // [m, H, L] BF16
  TensorView lse;             // [m, H] f32
  TensorView heads;           // [m, H, V] BF16: value-up's output
};

enum class DsaPath { kFused, kStock };

// The device buffers, library handles (cuBLAS, cuBLASLt) and the indexer's
// stream a stage runs with: about 100 MiB at TP1, max_tokens 16 (two 32 MiB
// cuBLAS workspaces, the attention's 16.1 MiB of split partials, the
// indexer's). A model's layers have one configuration and plan and run one
// after another on one stream, so they can share one: create it once and
// pass it to every layer's DsaAttentionStage::create. Stages that share a
// workspace must be created, run and captured one at a time, on one thread
// (they share buffers, the indexer's stream, its fork and join events and
// the cuBLAS handle, which create unbinds); two captures in flight at once
// must not both hold such stages. intermediates() shows whichever of them
// ran last. A workspace belongs to the device it was made on.
class DsaStageWorkspace {
 public:
  // Allocates for this configuration and plan (cudaMalloc on the current
  // device: call it outside a capture). The stage checks the rest.
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
  // Checks the configuration and the weights against every requirement and
  // returns one error naming all that are missing (kUnsupported when only
  // the layer's features are, kInvalidArgument when a view is wrong), as the
  // seed's checks; then takes `workspace` (one made for the same
  // configuration and plan: else an error naming 'workspace') or, when it
  // is null, allocates its own (cudaMalloc, on the current device: call it
  // outside a capture), and prepares the cuBLASLt plans of every m up to
  // plan.max_tokens.
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

  // A path's launches one by one, for per-kernel timing: the names of its
  // steps for these arguments (value-up's kernel and the indexer's part
  // depend on m and topk_positions), in the order they are issued, and a
  // run of `count` of them from `first` (kAllSteps: to the end; forward is
  // run_steps(kFused, args, 0, kAllSteps)). With plan.overlap_indexer the
  // fused path lists the indexer's steps right after the norm; a range that
  // holds some of them runs them on the indexer's stream and joins it before
  // the attention or at the range's end.
  static constexpr size_t kAllSteps = ~size_t{0};
  Status step_names(DsaPath path, const DsaStepArgs& args, std::vector<std::string>* names) const;
  Status run_steps(DsaPath path, const DsaStepArgs& args, size_t first, size_t count, cudaStream_t stream);

  DsaStageIntermediates intermediates(int64_t m) const;
  // The workspace this stage runs with (its own or the one passed to
  // create): pass it to the next layer's create to share it.
  std::shared_ptr<DsaStageWorkspace> workspace() const;
  const DsaLayerConfig& config() const;
  const DsaStagePlan& plan() const;

 private:
  DsaAttentionStage();
  struct State;  // src/stage/stage.cpp
  std::unique_ptr<State> state_;
};

}  // namespace dsa
