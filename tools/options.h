// dsa-decode's command line: the options, their defaults and their parsing.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/choices.h"
#include "dsa_decode/presets.h"

namespace dsa::cli {

// A link of the RoPE presets' CPU chain replaced by a wrong one (--break),
// to show that its check fails (tools/rope_chain.h).
enum class RopeChainBreak {
  kNone,
  kAttentionRopeStyle,  // "attention-rope-style": q_pe and k_pe rotated in the other style
  kIndexerRopeStyle,    // "indexer-rope-style": the indexer's q and k rotated in the other style
  kCacheScale,          // "cache-scale": one scale for all 512 latent values instead of one per 128
};
const char* rope_chain_break_name(RopeChainBreak link);  // "none", "attention-rope-style", ...
bool parse_rope_chain_break(const std::string& name, RopeChainBreak* link);

struct Options {
  std::string preset = "glm5next";
  int tp = 1;
  int tokens = 4;                // m, decode tokens of the step
  int64_t context = 32768;       // tokens already in the KV cache
  int steps = 200;               // graph replays per timing
  uint64_t seed = 1;             // of the synthetic layer (and, with --weights, of the inputs and the cache)
  // --weights: a Hugging Face checkpoint (a directory, or .safetensors files
  // separated by commas) whose layer --layer the program runs instead of the
  // synthetic weights (tools/checkpoint.h); empty: the synthetic layer.
  std::string weights;
  int layer = 0;                 // --layer: the checkpoint's layer (model.layers.N)
  // --config: a Hugging Face config.json (or a directory holding one) whose
  // shapes replace the preset's (tools/checkpoint.h's ModelConfig); empty: none.
  std::string config_path;
  // --index-heads, --index-pool, --index-topk: the indexer's shape, over the
  // preset's and the config's (resolve_model).
  std::optional<int> index_heads, index_pool, index_topk;
  std::string json_path;         // empty: no JSON report
  std::string report_path;       // --report: the HTML page (tools/html_report.h); implies --trace
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
  // Contract v2: the defaults are each kernel's fastest path within its bound
  // (dsa/choices.h names them). --batch-invariant: the stage plan's
  // batch_invariant (every kernel's invariant choice; the program then also
  // checks that a token alone gives its bits in the batch).
  bool batch_invariant = false;
  // --indexer-logits: the select's dots in both paths (IndexerPlan::logits).
  IndexerLogits indexer_logits = IndexerLogits::kFp32Accumulation;
  // --head-gemv-sums: how the fused path's head_gemv launches (absorb, and
  // value-up where it runs head_gemv) add their products.
  HeadGemvSums head_gemv_sums = HeadGemvSums::kTensorCores;
  // --attention-plan: sparse_mla's plan in both paths (SparseMlaArgs::plan).
  SparseMlaPlan attention_plan = SparseMlaPlan::kAuto;
  // --trace: CUPTI's record of each path's stages in one replay of the timed
  // chain (when each kernel of the middle stage started and ended, on which
  // stream, and its period in the chain), printed and in the JSON.
  bool trace = false;
  // --break: the RoPE presets' CPU path only (a check must then fail).
  RopeChainBreak chain_break = RopeChainBreak::kNone;
  bool force_cpu = false;
  bool help = false;
  std::set<std::string> given;  // the options on the command line ("--tokens", ...)
};

// The largest context: its KV cache (512 bytes a token at glm5next) is held
// twice on the GPU (one per path) and up to six times on the host (the
// initial cache, each run's read-back and the checks' expected cache).
inline constexpr int64_t kMaxContext = int64_t{1} << 20;
inline constexpr int kMaxSteps = 10000;
inline constexpr int kMaxTp = 1024;
inline constexpr int kMaxLayer = 9999;  // the preset's head count must also divide by it

void print_usage(FILE* to);

// The whole model's shapes (tp 1) the run takes: --preset, then --config's
// config.json fields, then --index-heads, --index-pool and --index-topk.
// `source` says where the shapes came from ("preset glm5next", "preset
// glm5next, config.json PATH, --index-pool"). False with a message naming
// the option or the config field, what was given and what is expected.
bool resolve_model(const Options& options, ModelPreset* whole, std::string* source, std::string* error);

// "1,2,4" (increasing), or "none" for an empty set: --value-up-tokens's syntax.
std::string token_list(const std::set<int>& counts);

// Which kernel the fused path's value-up runs.
enum class ValueUpKernel { kHeadGemv, kCublasBmm };

const char* value_up_kernel_name(ValueUpKernel kernel);  // "head_gemv", "cuBLAS bmm"

struct ValueUpChoice {
  ValueUpKernel kernel;
  std::string reason;  // e.g. "m=4 not in --value-up-tokens 1,2 (auto: measured at 64 heads)"
};

// The choice for a step of m tokens on `heads` heads: head_gemv at every m
// with --batch-invariant; else in --value-up-tokens, or where it is unset the
// stage's measured sets (dsa_stage_measured_value_up_tokens: where head_gemv
// beat cuBLAS's bmm on the H200, docs/head_gemv.md).
ValueUpChoice choose_value_up(const Options& options, int heads, int m);

// The stage plan's projection_gemv_tokens for --projections: auto: unset
// (the stage's measured set, dsa_stage_measured_projection_gemv_tokens);
// gemv: every token count linear_gemv takes, 1..kLinearGemvMaxTokens (the
// stage still runs cuBLASLt where the kernel refuses the shape: o_proj at TP1
// past m = 4); cublaslt: none.
std::optional<std::set<int>> projection_gemv_tokens(const Options& options);

// The options on the command line that the CPU path ignores (it runs the
// reference's fixed orders and times nothing): the kernel choices, --steps and
// --trace, the choices first. --json, the shape and the seed apply to both.
std::vector<std::string> gpu_only_options_given(const Options& options);

// Why the GPU path does not run this (whole-model) preset with these
// options, or "" when it does. The RoPE presets (dsv32, glm5) run kernel by
// kernel and then through the stage (tools/gpu_path_rope.cpp), which takes
// none of the options rope_gpu_chain_unsupported_options lists (the CPU
// chain, --cpu, takes some).
std::string gpu_path_refusal(const Options& options, const ModelPreset& preset);

// The options given that the RoPE presets' GPU path does not take: the
// checkpoint and config inputs, --break, --trace and the stage's choices it
// has no counterpart of (--projections other than gemv or auto,
// --value-up-tokens, --attention-plan, --batch-invariant, --indexer-projections
// cublaslt). --json and --report it writes.
std::vector<std::string> rope_gpu_chain_unsupported_options(const Options& options);

// Why --break does not apply to this run ("" when it does): it breaks a link
// of the RoPE presets' CPU chain only.
std::string chain_break_refusal(const Options& options, const ModelPreset& preset);

// Fills `options` from argv ("--name VALUE" or "--name=VALUE"). On a bad
// command line returns false and a message naming the option, what was given
// and what is expected.
bool parse_options(int argc, char** argv, Options* options, std::string* error);

}  // namespace dsa::cli
