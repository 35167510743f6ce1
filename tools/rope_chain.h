// The CPU reference chain of a RoPE preset's decode step (dsv32; glm5 the
// same way), in the order a served DeepSeek-V3.2 step runs (docs/rope.md,
// "dsa-decode --preset": the chains): hidden [m, D] -> qkv_a_proj (q_c | kv_c |
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

#include "dsa_decode/indexer.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/status.h"
#include "indexer/indexer_reference.h"
#include "options.h"
#include "reference_chain.h"
#include "report.h"
#include "rope/rope_reference.h"
#include "sparse_mla_v32/sparse_mla_v32_reference.h"
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

// The preset's rotary of the attention and of the indexer, and their F32
// tables (rope.h's layout) for positions 0..rows-1 (rows = context + m).
struct RopeTables {
  RopeConfig attention, indexer;
  std::vector<float> attention_table, indexer_table;  // [rows, R]
  int64_t rows = 0;
};
Status make_rope_tables(const StepShape& s, RopeTables* t);

// rope_absorb's host arguments over q [m, H, P + R] (q_nope and q_pe views)
// and qkv [m, Q + L + R] (k_pe's view), the attention's table of `t`.
reference::RopeAbsorbHost rope_absorb_host(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                                           const std::vector<uint16_t>& qkv, const std::vector<int64_t>& positions,
                                           const RopeTables& t, RopeStyle style);

// sparse_mla_v32's latent and lse (`got`) of the arguments `a` against a
// float64 attention on the dequantized entries (one pass, running maximum):
// contract v2's 5e-3 relative Frobenius and 1e-3 lse bounds.
Check check_sparse_mla_v32_vs_float64(const StepShape& s, const reference::SparseMlaV32Host& a,
                                      const reference::SparseMlaV32Result& got, const char* name);

// What the chain made, for the GPU chain (tools/gpu_path_rope.cpp) to run on
// the same layer and compare with: its inputs and every product.
struct RopeChainProducts {
  RopeTables tables;
  IndexerPlan plan;  // the served indexer plan (pool 1, rope)
  HostWeights weights;
  HostStepInputs inputs;
  IndexerTokenRows history;                          // the context's index_k rows the prefill took
  std::vector<uint8_t> indexer_k_cache_after_prefill;  // [cache_blocks, page bytes]
  std::vector<uint16_t> qkv, q_c, kv_c, q, q_absorbed, k_pe;
  std::vector<uint8_t> entries;  // [m, 656]: the step's cache write
  IndexerProjections projections;
  reference::IndexerQueryHost query;
  reference::IndexerRowsHost rows;
  std::vector<uint16_t> latent;  // [m, H, 512]
  std::vector<float> lse;        // [m, H]
  std::vector<uint16_t> heads, out;
};

// Runs the chain on the synthetic layer of `seed` at shape `s` (s.R > 0) with
// `link` broken (kNone: the served chain); `products` (optional) receives its
// inputs and products. Fails only for an argument error of a reference
// (which names it).
Status run_rope_chain(const StepShape& s, uint64_t seed, RopeChainBreak link, RopeChainResult* result,
                      RopeChainProducts* products = nullptr);

}  // namespace dsa::cli
