// dsa-decode: the project's main job. Builds a synthetic DSA layer at a model
// preset and the library's stage over it (DsaAttentionStage,
// include/dsa_decode/stage.h), runs one decode step, hidden states in and
// o_proj's output out, through the stage's fused and stock path on the GPU,
// checks them against each other and the CPU reference, and times every step,
// the attention half and the whole stage. Without a usable GPU (or with
// --cpu) it runs the CPU reference of the same step at the preset and checks
// its products against float64 (cpu_checks.h). Both paths end with PASS or FAIL.
#include <cstdio>
#include <string>

#include "cpu_path.h"
#include "dsa_decode/presets.h"
#include "gpu_path.h"
#include "options.h"
#include "report.h"
#include "synthetic_layer.h"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitUsage = 2;

// The preset's shapes on one rank; false with a message for an unknown
// preset, a TP degree that does not divide its heads, or --break at a NoPE preset.
bool resolve_shape(const dsa::cli::Options& options, dsa::cli::StepShape* shape, std::string* error) {
  dsa::ModelPreset preset{};
  std::string source;
  if (!dsa::cli::resolve_model(options, &preset, &source, error)) return false;
  if (const std::string refusal = dsa::cli::chain_break_refusal(options, preset); !refusal.empty()) {
    *error = refusal;
    return false;
  }
  dsa::ModelPreset rank{};
  if (!dsa::per_rank(preset, options.tp, &rank).ok()) {
    *error = "--tp: got '" + std::to_string(options.tp) + "', expected a divisor of " + preset.name + "'s " +
             std::to_string(preset.heads) + " heads";
    return false;
  }
  *shape = dsa::cli::make_step_shape(rank, options.tokens, options.context);
  shape->shape_source = source;
  shape->indexer_logits = options.indexer_logits;
  shape->head_gemv_sums = options.head_gemv_sums;
  shape->attention_plan = options.attention_plan;
  shape->batch_invariant = options.batch_invariant;
  return true;
}

// A GPU run that ended without writing a --json or --report it was given
// fails, naming them: a report asked for is never silently dropped.
int reports_written_or_failure(const dsa::cli::Options& options, int exit_code) {
  std::string missing;
  for (const std::string* path : {&options.json_path, &options.report_path}) {
    if (!path->empty() && !dsa::cli::report_written(*path)) missing += (missing.empty() ? "" : ", ") + *path;
  }
  if (missing.empty() || exit_code != kExitOk) return exit_code;
  std::fprintf(stderr, "dsa-decode: the GPU path ended without writing %s\n", missing.c_str());
  return 1;
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "dsa-decode: %s\n", message.c_str());
  std::fprintf(stderr, "(dsa-decode --help lists the options)\n");
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  dsa::cli::Options options;
  std::string error;
  if (!dsa::cli::parse_options(argc, argv, &options, &error)) return usage_error(error);
  if (options.help) {
    dsa::cli::print_usage(stdout);
    return kExitOk;
  }
  dsa::cli::StepShape shape{};
  if (!resolve_shape(options, &shape, &error)) return usage_error(error);
  std::printf("shapes from %s; indexer %s\n", shape.shape_source.c_str(), shape.describe_indexer_shape().c_str());

  std::string why_cpu = "--cpu";
  if (options.force_cpu) {
    std::printf("--cpu: running the CPU reference at %s\n", shape.describe().c_str());
  } else if (const dsa::cli::GpuAvailability gpu = dsa::cli::probe_gpu(); gpu.problem != dsa::cli::GpuProblem::kNone) {
    why_cpu = gpu.text();
    std::printf("%s: running the CPU reference at %s\n", why_cpu.c_str(), shape.describe().c_str());
  } else if (const std::string refusal = dsa::cli::gpu_path_refusal(options, shape.per_rank); !refusal.empty()) {
    return usage_error(refusal);  // a RoPE preset with an option only the stage's path or the CPU chain takes
  } else {
    return reports_written_or_failure(options, dsa::cli::run_gpu_path(shape, options));
  }
  return dsa::cli::run_cpu_path(shape, options, why_cpu);
}
