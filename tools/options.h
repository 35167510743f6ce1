// dsa-decode's command line: the options, their defaults and their parsing.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <string>

namespace dsa::cli {

struct Options {
  std::string preset = "glm5next";
  int tp = 1;
  int tokens = 4;                // m, decode tokens of the step
  int64_t context = 32768;       // tokens already in the KV cache
  int steps = 200;               // graph replays per timing
  uint64_t seed = 1;             // of the synthetic layer
  std::string json_path;         // empty: no JSON report
  // --value-up-tokens: the token counts whose value-up the fused path runs as
  // head_gemv, cuBLAS's bmm otherwise (the stage plan's value_up_tokens, as
  // the seed's). Unset: auto, the stage's measured sets
  // (dsa_stage_measured_value_up_tokens of the step's head count and sums).
  std::optional<std::set<int>> value_up_tokens;
  // --indexer-projections: the kernel of the indexer's four projections, a
  // step both paths share ("gemv": indexer_project_gemv; "cublaslt":
  // indexer_project).
  bool indexer_projections_cublaslt = false;
  // --projections: the kernel of the stage's own projections (qkv_a_proj in
  // both paths, q_b_proj and o_proj in the fused path), i.e. the plan's
  // projection_gemv_tokens: "auto" (default), "gemv" or "cublaslt"
  // (projection_gemv_tokens() below).
  std::string projections = "auto";
  // --indexer-logits: the select's dots in both paths (IndexerPlan::logits):
  // exact (default) or fp32-accumulation.
  bool indexer_logits_fp32 = false;
  // --head-gemv-sums: how the fused path's head_gemv launches (absorb, and
  // value-up where it runs head_gemv) add their products: seed-order
  // (default; bitwise the CPU reference's) or tensor-cores (opt-in
  // HeadGemvSums::kTensorCores, within its stated bound).
  bool head_gemv_tensor_cores = false;
  // --attention-splits: sparse_mla's split plan in both paths
  // (SparseMlaArgs::splits): "latency" (default), "throughput", "by-batch" or "whole-row".
  std::string attention_splits = "latency";
  // --trace: CUPTI's record of each path's stages in one replay of the timed
  // chain (when each kernel of the middle stage started and ended, on which
  // stream, and its period in the chain), printed and in the JSON.
  bool trace = false;
  bool force_cpu = false;
  bool help = false;
};

// The largest context: its KV cache (512 bytes a token at glm5next) is held
// twice on the GPU (one per path) and up to six times on the host (the
// initial cache, each run's read-back and the checks' expected cache).
inline constexpr int64_t kMaxContext = int64_t{1} << 20;
inline constexpr int kMaxSteps = 10000;
inline constexpr int kMaxTp = 1024;  // the preset's head count must also divide by it

void print_usage(FILE* to);

// "1,2,4" (increasing), or "none" for an empty set: --value-up-tokens's syntax.
std::string token_list(const std::set<int>& counts);

// Which kernel the fused path's value-up runs.
enum class ValueUpKernel { kHeadGemv, kCublasBmm };

const char* value_up_kernel_name(ValueUpKernel kernel);  // "head_gemv", "cuBLAS bmm"

struct ValueUpChoice {
  ValueUpKernel kernel;
  std::string reason;  // e.g. "m=4 not in --value-up-tokens 1,2 (auto: measured at 64 heads)"
};

// The choice for a step of m tokens on `heads` heads: in --value-up-tokens,
// or where it is unset the stage's measured sets
// (dsa_stage_measured_value_up_tokens), which are: the token counts at which
// value-up's head_gemv (seed order) beat the cuBLAS bmm on the H200
// (bench/results/head_gemv_2026-11-30_54c2121.json, measured at m = 1, 2, 4,
// 8, 16): at 64 heads m = 1, 2 (1.10x, 1.12x; 0.90x at m = 4); at 8 heads
// m = 1, 2, 4 (1.54x, 1.47x, 1.18x; 0.81x at m = 8) and m = 3 between them
// (head_gemv's time grows with m, cuBLAS's is flat: 3.3 us). Other head counts
// were not measured: m = 1, 2, where head_gemv won at both. With tensor-core
// sums (--head-gemv-sums tensor-cores;
// bench/results/head_gemv_2026-12-01_c2fd745.json): at 64 heads m = 1..8
// (1.17x / 1.13x / 1.08x / 1.09x at m = 1, 2, 4, 8; 0.97x at m = 16), at 8
// heads every m (1.81x at m = 1 .. 1.44x at m = 16); other head counts, not
// measured: m = 1..8.
ValueUpChoice choose_value_up(const Options& options, int heads, int m);

// The stage plan's projection_gemv_tokens for --projections: auto: unset
// (the stage's measured set, dsa_stage_measured_projection_gemv_tokens);
// gemv: every token count linear_gemv takes, 1..kLinearGemvMaxTokens (the
// stage still runs cuBLASLt where the kernel refuses the shape: o_proj at TP1
// past m = 4); cublaslt: none.
std::optional<std::set<int>> projection_gemv_tokens(const Options& options);

// Fills `options` from argv ("--name VALUE" or "--name=VALUE"). On a bad
// command line returns false and a message naming the option, what was given
// and what is expected.
bool parse_options(int argc, char** argv, Options* options, std::string* error);

}  // namespace dsa::cli
