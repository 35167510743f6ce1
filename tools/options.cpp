#include "options.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <system_error>

#include "checkpoint.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/stage.h"

namespace dsa::cli {

namespace {
// The head counts bench/results/head_gemv_2026-11-30_54c2121.json has value-up rows of.
bool value_up_measured(int heads) { return heads == 64 || heads == 8; }

// The stage's own sets (its plan's default value_up_tokens), so that what the
// program says and what the stage runs cannot drift apart.
std::string measured_list(int heads, HeadGemvSums sums) {
  return token_list(dsa_stage_measured_value_up_tokens(heads, sums));
}
}  // namespace

const char* rope_chain_break_name(RopeChainBreak link) {
  switch (link) {
    case RopeChainBreak::kAttentionRopeStyle: return "attention-rope-style";
    case RopeChainBreak::kIndexerRopeStyle: return "indexer-rope-style";
    case RopeChainBreak::kCacheScale: return "cache-scale";
    case RopeChainBreak::kNone: break;
  }
  return "none";
}

bool parse_rope_chain_break(const std::string& name, RopeChainBreak* link) {
  for (RopeChainBreak l : {RopeChainBreak::kNone, RopeChainBreak::kAttentionRopeStyle,
                           RopeChainBreak::kIndexerRopeStyle, RopeChainBreak::kCacheScale}) {
    if (name == rope_chain_break_name(l)) {
      *link = l;
      return true;
    }
  }
  return false;
}

std::vector<std::string> rope_gpu_chain_unsupported_options(const Options& options) {
  std::vector<std::string> given;
  // --json and --report: the chain's and the stage's checks and timings (rope_run_report, report.h).
  for (const char* name : {"--weights", "--layer", "--config", "--break", "--trace", "--value-up-tokens",
                           "--attention-plan", "--batch-invariant"}) {
    if (options.given.count(name) > 0) given.push_back(name);
  }
  if (options.given.count("--projections") > 0 && options.projections != "gemv" && options.projections != "auto") {
    given.push_back("--projections " + options.projections);
  }
  if (options.indexer_projections_cublaslt) given.push_back("--indexer-projections cublaslt");
  return given;
}

std::string gpu_path_refusal(const Options& options, const ModelPreset& preset) {
  if (preset.qk_rope == 0) return "";
  const std::vector<std::string> unsupported = rope_gpu_chain_unsupported_options(options);
  if (unsupported.empty()) return "";
  std::string names;
  for (const std::string& name : unsupported) names += (names.empty() ? "" : ", ") + name;
  return names + ": preset '" + preset.name + "' uses RoPE (" + std::to_string(preset.qk_rope) +
         " rope dims per head); its GPU path runs the step kernel by kernel and then through the stage, and does not "
         "take " + (unsupported.size() > 1 ? "these" : "this") +
         "; drop " + (unsupported.size() > 1 ? "them" : "it") + ", or add --cpu for its CPU reference chain";
}

std::string chain_break_refusal(const Options& options, const ModelPreset& preset) {
  if (options.chain_break == RopeChainBreak::kNone || preset.qk_rope > 0) return "";
  return std::string("--break: breaks a link of the RoPE presets' CPU chain (dsv32, glm5); preset '") + preset.name +
         "' has no RoPE";
}

std::string token_list(const std::set<int>& counts) {
  if (counts.empty()) return "none";
  std::string text;
  for (int m : counts) text += (text.empty() ? "" : ",") + std::to_string(m);
  return text;
}

const char* value_up_kernel_name(ValueUpKernel kernel) {
  return kernel == ValueUpKernel::kHeadGemv ? "head_gemv" : "cuBLAS bmm";
}

ValueUpChoice choose_value_up(const Options& options, int heads, int m) {
  if (options.batch_invariant) return ValueUpChoice{ValueUpKernel::kHeadGemv, "--batch-invariant: at every m"};
  const bool automatic = !options.value_up_tokens.has_value();
  const std::set<int> counts =
      automatic ? dsa_stage_measured_value_up_tokens(heads, options.head_gemv_sums) : *options.value_up_tokens;
  const bool head_gemv = counts.count(m) > 0;
  std::string reason =
      "m=" + std::to_string(m) + (head_gemv ? " in" : " not in") + " --value-up-tokens " + token_list(counts);
  if (automatic) {
    reason += std::string(" (auto: ") + choice_name(kHeadGemvSumsChoices, options.head_gemv_sums) + " sums, " +
              (value_up_measured(heads) ? "measured" : "not measured") + " at " + std::to_string(heads) + " heads)";
  }
  return ValueUpChoice{head_gemv ? ValueUpKernel::kHeadGemv : ValueUpKernel::kCublasBmm, reason};
}

std::optional<std::set<int>> projection_gemv_tokens(const Options& options) {
  if (options.projections == "auto") return std::nullopt;
  std::set<int> counts;
  if (options.projections == "gemv") {
    for (int m = 1; m <= kLinearGemvMaxTokens; ++m) counts.insert(m);
  }
  return counts;
}

std::vector<std::string> gpu_only_options_given(const Options& options) {
  std::vector<std::string> given;
  for (const char* gpu_only : {"--indexer-logits", "--head-gemv-sums", "--projections", "--attention-plan",
                               "--batch-invariant", "--steps", "--indexer-projections", "--value-up-tokens",
                               "--trace", "--report"}) {
    if (options.given.count(gpu_only) > 0) given.push_back(gpu_only);
  }
  return given;
}

void print_usage(FILE* to) {
  std::fprintf(to,
               "usage: dsa-decode [--preset NAME] [--tp N] [--tokens M] [--context N] [--steps N] [--seed N]\n"
               "                  [--projections KERNEL] [--value-up-tokens LIST] [--head-gemv-sums SUMS]\n"
               "                  [--indexer-projections KERNEL] [--indexer-logits DOTS] [--attention-plan PLAN]\n"
               "                  [--batch-invariant] [--weights PATH --layer N] [--config PATH]\n"
               "                  [--index-heads N] [--index-pool N] [--index-topk N] [--json FILE] [--trace] [--cpu]\n"
               "                  [--report FILE.html] [--break LINK] [--help]\n"
               "Runs one decode step of a DSA layer's attention half (hidden states in, o_proj's output\n"
               "out) on a synthetic layer (or a checkpoint's, --weights) through the library's stage\n"
               "(DsaAttentionStage), its fused\n"
               "path and its stock path, checks they agree with each other and with the CPU reference,\n"
               "and times each step, the attention half and the whole stage (CUDA-graph replay, cold L2:\n"
               "one stage per weight copy, rotated).\n"
               "Without an sm_90 GPU (or with --cpu) it runs the CPU reference of the same step instead and\n"
               "checks its products against float64 within the numerics contract's bounds.\n"
               "  --preset NAME  model preset: %s (default glm5next). The RoPE presets dsv32\n"
               "                 and glm5: with --cpu their CPU reference chain (rope_absorb, the 656-byte\n"
               "                 cache write, the V3.2 indexer, sparse_mla_v32), checked against float64; on\n"
               "                 the GPU the step kernel by kernel and the stage, checked against that chain\n"
               "  --tp N         tensor-parallel degree: the layer of one rank has heads / N heads (default 1)\n"
               "  --tokens M     decode tokens in the step, 1..%d (default 4)\n"
               "  --context N    tokens already in the KV cache, 0..%lld; the new tokens go to slots\n"
               "                 N..N+M-1 (default 32768)\n"
               "  --steps N      graph replays per timing, 1..%d (default 200)\n"
               "  --seed N       seed of the synthetic weights and inputs (default 1)\n"
               "  --weights PATH a Hugging Face checkpoint to take the layer's weights from instead of the\n"
               "                 synthetic ones: a directory (model.safetensors.index.json, or every\n"
               "                 .safetensors file in it) or .safetensors files separated by commas; BF16, F32,\n"
               "                 or F8_E4M3 with 128 x 128 block scales (weight_scale_inv), dequantized to BF16;\n"
               "                 the heads of rank 0 of --tp, split as vLLM splits them. The inputs and the\n"
               "                 cache stay the synthetic ones of --seed; prints the load's GB/s\n"
               "  --layer N      the checkpoint's layer to run (model.layers.N.self_attn.*; default 0; with\n"
               "                 --weights only)\n"
               "  --config PATH  a Hugging Face config.json (or a directory holding one) whose shapes replace the\n"
               "                 preset's: index_n_heads, index_kpool, index_topk and index_head_dim (128) are\n"
               "                 required; hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank,\n"
               "                 qk_nope_head_dim, qk_rope_head_dim and v_head_dim replace the preset's where present\n"
               "                 (every missing, mistyped or unsupported field named in one error). --weights does\n"
               "                 not read its config.json's shapes: pass --config for them\n"
               "  --index-heads N\n"
               "                 the indexer's heads, 16, 32 or 64 (index_n_heads; default: the config's, else the\n"
               "                 preset's, 32 for glm5next)\n"
               "  --index-pool N the indexer's tokens per pool, 4, 8 or 16 (index_kpool; default: the config's,\n"
               "                 else the preset's, 4 for glm5next)\n"
               "  --index-topk N the indexer's selected tokens, a multiple of the pool size, at most 512 pools\n"
               "                 (index_topk; default: the config's, else the preset's, 2048 for glm5next)\n"
               "  --projections KERNEL\n"
               "                 the stage's projections: qkv_a_proj (both paths) and the fused path's q_b_proj\n"
               "                 and o_proj (the stock path's stay cuBLASLt): auto (default; linear_gemv, one\n"
               "                 launch with PDL, at the token counts where the stage measured it faster,\n"
               "                 cuBLASLt otherwise), gemv (linear_gemv at every m it takes, 1..%d, cuBLASLt\n"
               "                 past it; at TP1 it refuses o_proj past m = 4, whose 16384 input columns do not\n"
               "                 fit its shared memory, and the stage falls back to cuBLASLt there) or cublaslt\n"
               "                 (cuBLASLt at every m)\n"
               "  --value-up-tokens LIST\n"
               "                 token counts whose value-up the fused path runs as head_gemv (the stage plan's\n"
               "                 value_up_tokens), cuBLAS bmm\n"
               "                 otherwise: comma-separated counts 1..%d (e.g. 1,2), none, or auto (default):\n"
               "                 where head_gemv was faster on the H200, %s at 64 heads, %s at 8 heads,\n"
               "                 %s at other head counts (not measured); with --head-gemv-sums\n"
               "                 seed-order %s at 64 heads, %s at 8 heads\n"
               "  --batch-invariant\n"
               "                 a token's bits do not depend on the other tokens of its step: every kernel's\n"
               "                 invariant choice (the attention's batch-invariant plan, value-up on head_gemv\n"
               "                 and the projections on linear_gemv at every m); the program also runs each\n"
               "                 token alone and checks it gives its bits in the batch (GPU path)\n"
               "  --head-gemv-sums SUMS\n"
               "                 how the fused path's head_gemv (absorb, value-up) adds its products:\n"
               "                 tensor-cores (default; BF16 tensor cores, FP32 accumulators, within the\n"
               "                 contract's bound) or seed-order (FP32 FMAs in the seed's order, bitwise the\n"
               "                 CPU reference's)\n"
               "  --indexer-projections KERNEL\n"
               "                 the indexer's four projections (a step both paths share): gemv (default;\n"
               "                 indexer_project_gemv, one launch) or cublaslt (indexer_project, four GEMMs)\n"
               "  --indexer-logits DOTS\n"
               "                 the indexer select's head dots (both paths): fp32-accumulation (default; FP16\n"
               "                 tensor cores, logits within a stated bound, rows the selection over the GPU's\n"
               "                 logits) or exact (FP64 tensor cores, rows bitwise the reference's)\n"
               "  --attention-plan PLAN\n"
               "                 sparse attention's split plan (both paths): auto (default; per step the\n"
               "                 fastest plan for m on this GPU) or batch-invariant (split points from H and K\n"
               "                 only)\n"
               "  --json FILE    write the checks and timings as JSON (the CPU path: its checks and CPU times)\n"
               "  --trace        also print when each kernel of one whole stage ran, both paths (CUPTI's kernel\n"
               "                 records of the middle stage in one replay of the timed chain: start, end, stream),\n"
               "                 the time no kernel was resident, the stage's period in the chain and the\n"
               "                 previous stage's end, and write them to the JSON report\n"
               "  --report FILE.html\n"
               "                 write the run as one self-contained page (implies --trace): the checks, fused\n"
               "                 against stock, each timing beside its memory floor, a timeline per path\n"
               "  --break LINK   the RoPE presets' CPU chain with one link replaced by a wrong one, to see its\n"
               "                 check fail: attention-rope-style (q_pe, k_pe in the other rotary style),\n"
               "                 indexer-rope-style, cache-scale (one scale per entry instead of one per 128\n"
               "                 values); none (default)\n"
               "  --cpu          run the CPU reference even when a GPU is present\n"
               "  --help         this text\n"
               "  env DSA_COMMIT names the commit in the JSON report (default: unknown)\n"
               "Both paths end with PASS or FAIL. Exit status: 0 success, 1 a check failed, a CUDA/cuBLAS\n"
               "call failed or the checkpoint of --weights could not be loaded, 2 bad command line.\n",
               preset_names().c_str(), kMaxDecodeTokens, static_cast<long long>(kMaxContext), kMaxSteps,
               kLinearGemvMaxTokens, kMaxDecodeTokens, measured_list(64, HeadGemvSums::kTensorCores).c_str(),
               measured_list(8, HeadGemvSums::kTensorCores).c_str(),
               measured_list(1, HeadGemvSums::kTensorCores).c_str(), measured_list(64, HeadGemvSums::kSeedOrder).c_str(),
               measured_list(8, HeadGemvSums::kSeedOrder).c_str());
}

namespace {

std::string range_text(long long low, long long high) {
  return "an integer from " + std::to_string(low) + " to " + std::to_string(high);
}

// What each option that takes a value expects, for the error messages.
std::string expected_value(const std::string& option) {
  if (option == "--preset") return "one of " + preset_names();
  if (option == "--tp") return range_text(1, kMaxTp);
  if (option == "--tokens") return range_text(1, kMaxDecodeTokens);
  if (option == "--context") return range_text(0, kMaxContext);
  if (option == "--steps") return range_text(1, kMaxSteps);
  if (option == "--seed") return "an integer from 0 to " + std::to_string(std::numeric_limits<uint64_t>::max());
  if (option == "--json") return "a file name";
  if (option == "--report") return "a file name ending in .html";
  if (option == "--weights") return "a checkpoint directory or .safetensors files separated by commas";
  if (option == "--layer") return range_text(0, kMaxLayer);
  if (option == "--config") return "a config.json file or a directory holding one";
  if (option == "--index-heads") return "16, 32 or 64";
  if (option == "--index-pool") return "4, 8 or 16";
  if (option == "--index-topk") {
    return "a multiple of the pool size from the pool size to " + std::to_string(kIndexerMaxTopPools * 16) +
           " (at most " + std::to_string(kIndexerMaxTopPools) + " pools)";
  }
  if (option == "--projections") return "auto, gemv or cublaslt";
  if (option == "--break") return "none, attention-rope-style, indexer-rope-style or cache-scale";
  if (option == "--indexer-projections") return "gemv or cublaslt";
  if (option == "--indexer-logits") return choice_list(kIndexerLogitsChoices);
  if (option == "--head-gemv-sums") return choice_list(kHeadGemvSumsChoices);
  if (option == "--attention-plan") return choice_list(kSparseMlaPlanChoices);
  if (option == "--value-up-tokens") {
    return "a comma-separated list of token counts from 1 to " + std::to_string(kMaxDecodeTokens) +
           " (e.g. 1,2), none or auto";
  }
  return "";  // a flag
}

bool takes_value(const std::string& option) { return !expected_value(option).empty(); }

std::string bad_value(const std::string& option, const std::string& given) {
  return option + ": got '" + given + "', expected " + expected_value(option);
}

// The whole of `text` as an integer in [low, high]; nothing else accepted.
template <class Int>
bool parse_integer(const std::string& option, const std::string& text, Int low, Int high, Int* value,
                   std::string* error) {
  Int parsed{};
  const char* end = text.data() + text.size();
  const auto [stop, code] = std::from_chars(text.data(), end, parsed);
  if (text.empty() || code != std::errc() || stop != end || parsed < low || parsed > high) {
    *error = bad_value(option, text);
    return false;
  }
  *value = parsed;
  return true;
}

// --value-up-tokens: "auto" (unset), "none" (empty) or distinct counts
// separated by commas.
bool parse_token_set(const std::string& option, const std::string& text, std::optional<std::set<int>>* tokens,
                     std::string* error) {
  if (text == "auto") {
    tokens->reset();
    return true;
  }
  std::set<int> counts;
  if (text != "none") {
    for (size_t start = 0; start <= text.size();) {
      const size_t comma = std::min(text.find(',', start), text.size());
      const std::string item = text.substr(start, comma - start);
      int count = 0;
      if (!parse_integer(option, item, 1, kMaxDecodeTokens, &count, error)) {
        *error = bad_value(option, text) + " ('" + item + "' is not a token count from 1 to " +
                 std::to_string(kMaxDecodeTokens) + ")";
        return false;
      }
      if (!counts.insert(count).second) {
        *error = bad_value(option, text) + " (" + item + " is listed twice)";
        return false;
      }
      start = comma + 1;
    }
  }
  *tokens = counts;
  return true;
}

// Stores `value` into the option's field; false with a message when it is not
// a valid value of that option.
bool apply_value(const std::string& option, const std::string& value, Options* o, std::string* error) {
  if (option == "--tp") return parse_integer(option, value, 1, kMaxTp, &o->tp, error);
  if (option == "--tokens") return parse_integer(option, value, 1, kMaxDecodeTokens, &o->tokens, error);
  if (option == "--context") return parse_integer<int64_t>(option, value, 0, kMaxContext, &o->context, error);
  if (option == "--steps") return parse_integer(option, value, 1, kMaxSteps, &o->steps, error);
  if (option == "--layer") return parse_integer(option, value, 0, kMaxLayer, &o->layer, error);
  if (option == "--index-heads" || option == "--index-pool" || option == "--index-topk") {
    int parsed = 0;
    if (!parse_integer(option, value, 1, kIndexerMaxTopPools * 16, &parsed, error)) return false;
    const bool ok = option == "--index-heads"  ? parsed == 16 || parsed == 32 || parsed == 64
                    : option == "--index-pool" ? parsed == 4 || parsed == 8 || parsed == 16
                                               : true;  // --index-topk: checked against the pool in resolve_model
    if (!ok) {
      *error = bad_value(option, value);
      return false;
    }
    (option == "--index-heads" ? o->index_heads : option == "--index-pool" ? o->index_pool : o->index_topk) = parsed;
    return true;
  }
  if (option == "--config") {
    if (value.empty()) {
      *error = bad_value(option, value);
      return false;
    }
    o->config_path = value;
    return true;
  }
  if (option == "--weights") {
    if (value.empty() || value.find_first_not_of(',') == std::string::npos) {
      *error = bad_value(option, value);
      return false;
    }
    o->weights = value;
    return true;
  }
  if (option == "--seed") {
    return parse_integer<uint64_t>(option, value, 0, std::numeric_limits<uint64_t>::max(), &o->seed, error);
  }
  if (option == "--value-up-tokens") return parse_token_set(option, value, &o->value_up_tokens, error);
  if (option == "--projections") {
    if (value != "auto" && value != "gemv" && value != "cublaslt") {
      *error = bad_value(option, value);
      return false;
    }
    o->projections = value;
    return true;
  }
  if (option == "--break") {
    if (!parse_rope_chain_break(value, &o->chain_break)) {
      *error = bad_value(option, value);
      return false;
    }
    return true;
  }
  if (option == "--indexer-projections") {
    if (value != "gemv" && value != "cublaslt") {
      *error = bad_value(option, value);
      return false;
    }
    o->indexer_projections_cublaslt = value == "cublaslt";
    return true;
  }
  const auto choose = [&](const auto& choices, auto* field) {
    if (!parse_choice(choices, value, field)) {
      *error = bad_value(option, value);
      return false;
    }
    return true;
  };
  if (option == "--indexer-logits") return choose(kIndexerLogitsChoices, &o->indexer_logits);
  if (option == "--head-gemv-sums") return choose(kHeadGemvSumsChoices, &o->head_gemv_sums);
  if (option == "--attention-plan") return choose(kSparseMlaPlanChoices, &o->attention_plan);
  if (option == "--report") {
    if (value.size() < 6 || value.compare(value.size() - 5, 5, ".html") != 0) {
      *error = bad_value(option, value);
      return false;
    }
    o->report_path = value;
    o->trace = true;
    return true;
  }
  if (value.empty()) {  // --preset (resolved against the preset table by the caller), --json
    *error = bad_value(option, value);
    return false;
  }
  (option == "--preset" ? o->preset : o->json_path) = value;
  return true;
}

}  // namespace

bool parse_options(int argc, char** argv, Options* options, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string option = argv[i];
    std::string value;
    bool has_value = false;
    if (const size_t equals = option.find('='); option.rfind("--", 0) == 0 && equals != std::string::npos) {
      value = option.substr(equals + 1);
      option = option.substr(0, equals);
      has_value = true;
    }
    options->given.insert(option);
    if (takes_value(option)) {
      if (!has_value) {
        if (i + 1 >= argc) {
          *error = option + ": missing value, expected " + expected_value(option);
          return false;
        }
        value = argv[++i];
      }
      if (!apply_value(option, value, options, error)) return false;
    } else if (option == "--cpu" || option == "--trace" || option == "--batch-invariant" || option == "--help" ||
               option == "-h") {
      if (has_value) {
        *error = option + ": takes no value, got '" + value + "'";
        return false;
      }
      if (option == "--cpu") {
        options->force_cpu = true;
      } else if (option == "--trace") {
        options->trace = true;
      } else if (option == "--batch-invariant") {
        options->batch_invariant = true;
      } else {
        options->help = true;
      }
    } else if (option.rfind("-", 0) == 0) {
      *error = "unknown option '" + option + "'";
      return false;
    } else {
      *error = "unexpected argument '" + option + "' (every option is --name VALUE)";
      return false;
    }
  }
  if (options->given.count("--layer") > 0 && options->weights.empty()) {
    *error = "--layer: names a layer of the checkpoint of --weights, and no --weights was given";
    return false;
  }
  return true;
}

bool resolve_model(const Options& options, ModelPreset* whole, std::string* source, std::string* error) {
  ModelPreset preset{};
  if (!find_preset(options.preset, &preset).ok()) {
    *error = "--preset: got '" + options.preset + "', expected one of " + preset_names();
    return false;
  }
  std::string from = "preset " + options.preset;
  // Where each indexer field came from, for the messages.
  std::string pool_from = from, topk_from = from;
  if (!options.config_path.empty()) {
    ModelConfig config;
    const Status read = read_model_config(options.config_path, &config);
    ModelPreset configured{};
    const Status applied = read.ok() ? apply_model_config(preset, config, &configured) : read;
    if (!applied.ok()) {
      *error = "--config: " + applied.message();
      return false;
    }
    preset = configured;
    from += ", config.json " + config.path;
    pool_from = topk_from = config.path;
  }
  int heads = preset.index_heads, pool = preset.pool_size, topk = preset.topk;
  std::vector<std::string> options_given;
  if (options.index_heads) heads = *options.index_heads, options_given.push_back("--index-heads");
  if (options.index_pool) pool = *options.index_pool, pool_from = "--index-pool", options_given.push_back("--index-pool");
  if (options.index_topk) topk = *options.index_topk, topk_from = "--index-topk", options_given.push_back("--index-topk");
  if (!options_given.empty()) {
    if (preset.pool_size <= 1) {
      *error = options_given.front() + ": preset '" + options.preset +
               "' has no pooled indexer (pool_size " + std::to_string(preset.pool_size) +
               "); the indexer's shape applies to glm5next";
      return false;
    }
    if (topk < pool || topk % pool != 0 || topk / pool > kIndexerMaxTopPools) {
      const std::string option = options.index_topk ? "--index-topk" : options_given.front();
      *error = option + ": top-k " + std::to_string(topk) + " (" + topk_from + ") and pool size " +
               std::to_string(pool) + " (" + pool_from + "): expected a top-k that is a multiple of the pool size " +
               "from " + std::to_string(pool) + " to " + std::to_string(kIndexerMaxTopPools * pool);
      return false;
    }
    ModelPreset shaped{};
    const Status s = with_indexer_shape(preset, heads, pool, topk, &shaped);
    if (!s.ok()) {  // the checks above and the options' own leave nothing for it to refuse
      *error = options_given.front() + ": " + s.message();
      return false;
    }
    preset = shaped;
    for (const std::string& option : options_given) from += ", " + option;
  }
  *whole = preset;
  *source = from;
  return true;
}

}  // namespace dsa::cli
