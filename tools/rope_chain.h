// The CPU reference chain of a RoPE preset's decode step (dsv32; glm5 the
// same way), in the order a served DeepSeek-V3.2 step runs (docs/stage.md,
// "The RoPE presets' CPU chain"): hidden [m, D] -> qkv_a_proj (q_c | kv_c |
// k_pe) -> both RMSNorms (not k_pe) -> q_b_proj [m, H, P + R] -> rope_absorb
// (q_nope x W_UK_T | rotated q_pe into q [m, H, L + R], rotated k_pe) -> the
// 656-byte cache write -> the V3.2 indexer (projections of q_c and x, no
// gate; prefill of the context, prepare, select: pool 1, RoPE on the first R
// dims) -> sparse_mla_v32 (the kernel's roundings model) -> value-up ->
// o_proj. Each product is checked against float64 within contract v2's
// bounds. A link can be broken on purpose (RopeChainBreak) to show that its
// check fails.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/rope.h"
#include "dsa_decode/status.h"
#include "options.h"
#include "report.h"
#include "synthetic_layer.h"

namespace dsa::cli {

struct RopeChainRow {
  std::string kernel, output;
  double ms = -1;  // < 0: the previous row's kernel
  uint64_t fingerprint = 0;
  std::string values;  // first values of token 0
};

struct RopeChainResult {
  std::vector<RopeChainRow> rows;
  std::vector<Check> checks;
  std::vector<std::string> notes;  // printed before the checks
  double chain_ms = 0, prefill_ms = 0;
};

// Runs the chain on the synthetic layer of `seed` at shape `s` (s.R > 0) with
// `link` broken (kNone: the served chain). Fails only for an argument error of
// a reference (which names it).
Status run_rope_chain(const StepShape& s, uint64_t seed, RopeChainBreak link, RopeChainResult* result);

}  // namespace dsa::cli
