// dsa-serve's per-token check against the CPU model: the token's top-k row
// (the indexer's selection over the GPU's logits, or the remap of the caller's
// row, on the model's state: bit for bit), its logits against the exact ones
// within reference::indexer_logit_bounds, and its attention (latent and lse of
// a group of heads) against the float64 reference over the model's KV cache.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "serve_model.h"

namespace dsa::serve {

// The attention's per-token tolerances: the contract's latent bound
// (5e-3 relative Frobenius, sparse_mla.h) with a margin for measuring it over
// one token's heads, and its lse bound.
inline constexpr double kLatentTolerance = 1e-2;
inline constexpr double kLseTolerance = 1e-3;

struct TokenCheckInputs {
  int64_t position = 0;
  int32_t row = 0;                          // the request's block table row
  const reference::IndexerStepHost* step = nullptr;  // the step (its token `token`)
  int token = 0;
  const reference::IndexerQueryHost* query = nullptr;  // the model's prepare of the step (indexer steps)
  const float* gpu_logits = nullptr;        // the token's row of the GPU select's logits (FP32-accumulated)
  const int32_t* caller_positions = nullptr;  // the caller's row [indexer_row_width(plan)] (caller-rows steps), else null
  bool check_logits = false;                // compare the logits with the exact ones (O(L))
  const int32_t* gpu_slots = nullptr;       // [indexer_row_width(plan)]
  const uint8_t* gpu_q_fp8 = nullptr;       // [H, L]
  const uint16_t* gpu_latent = nullptr;     // [H, L]
  const float* gpu_lse = nullptr;           // [H]
  int64_t heads = 0;
  int first_head = 0, head_count = 0;       // the heads checked
  float q_scale = 0, k_scale = 0, softmax_scale = 0;
  int threads = 1;  // host threads for the attention's heads and the logits' pages (serve_parallel.h)
};

struct TokenCheck {
  bool ok = true;
  std::string why;
  int64_t pools_scored = 0;  // logits compared
  double latent_error = 0, lse_error = 0;
};

TokenCheck check_token(StateModel& model, const std::vector<int32_t>& table, const TokenCheckInputs& in);

}  // namespace dsa::serve
