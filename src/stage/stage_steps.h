// The stage's two paths as lists of steps, one library call each
// (include/dsa_decode/stage.h says what each path runs and why). Pure host
// logic: the lists for a step of m tokens follow from the plan's choices
// alone, so they are tested without a GPU (stage_steps_test.cpp).
#pragma once

#include <cassert>
#include <cstdint>
#include <set>

#include "dsa_decode/stage.h"

namespace dsa {

enum class Step {
  kQkvAProj,  // cuBLASLt; the *Gemv steps: linear_gemv (plan.projection_gemv_tokens)
  kQkvAProjGemv,
  kNorm,
  kQbProj,
  kQbProjGemv,
  kAbsorb,          // head_gemv: FP8 q and the cache write
  kIndexerProject,  // both paths': GEMV launch (or cuBLASLt, plan.indexer_projections_cublaslt)
  kIndexerPrepare,
  kIndexerSelect,
  kTopkRemap,  // caller rows instead of the indexer
  kAttention,
  kValueUpGemv,
  kValueUpBmm,
  kOProj,
  kOProjGemv,
  kStockIndexerSelect,  // the same select, keeping the top-k positions (the stock engine's topk buffer)
  kStockCacheWrite,
  kStockAbsorbBmm,
  kStockFp8Quant,
  kStockCounterMemset,
  // A RoPE layer's (both paths):
  kRopeAbsorb,      // rope_absorb: the absorbed latent | rotated q_pe (BF16), rotated k_pe
  kV32CacheWrite,   // sparse_mla_v32_cache_write: the 656-byte entries of kv_c and the rotated k_pe
  kV32Attention,    // sparse_mla_v32
};

// step_names' text of a step.
const char* step_name(Step step, bool projections_cublaslt);

// The fused path's steps that run on the indexer's lane when
// plan.overlap_indexer, beside q_b_proj and the absorb. Race-free because the
// two lanes share only inputs: the indexer reads hidden, q_c (both written
// before the fork), positions, token_requests, the indexer state and the
// caller's rows, and writes its workspace, ring, K cache and slots (and
// bumps error_count atomically); q_b_proj and the absorb touch none of
// these, and only the attention, after the join, reads the slots. A RoPE
// layer's rope_absorb and cache write likewise touch none of the lane's
// buffers (its indexer reads its own cos/sin table, the K cache is not the
// KV cache).
bool on_indexer_lane(Step step);

// The longest path: the NoPE stock one with the indexer, 13 steps (RoPE: 11 on either path).
inline constexpr int kMaxSteps = 13;

struct StepList {
  Step steps[kMaxSteps];
  int count = 0;
  void add(Step step) {
    assert(count < kMaxSteps);
    steps[count++] = step;
  }
};

// What the lists depend on: the plan's choices, its token sets resolved
// (the measured defaults filled in), and the widths the projections read.
struct StepChoices {
  bool rope = false;  // a RoPE layer (qk_rope_head_dim > 0): rope_absorb, the 656-byte cache, sparse_mla_v32
  bool overlap_indexer = true;
  // Value-up on head_gemv and the projections on linear_gemv at every m
  // (plan.batch_invariant): the token sets below are then not read.
  bool batch_invariant = false;
  std::set<int> value_up_tokens;
  std::set<int> projection_gemv_tokens;
  int64_t hidden = 0;   // D: qkv_a_proj's K
  int64_t q_lora = 0;   // Q: q_b_proj's K
  int64_t heads_v = 0;  // H * V: o_proj's K
};

// The steps of `path` for m tokens, in the order they are issued; with
// `caller_rows` the indexer's three steps become the remap.
StepList stage_steps(DsaPath path, const StepChoices& c, int64_t m, bool caller_rows);

}  // namespace dsa
