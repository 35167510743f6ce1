// dsa-decode's CPU path at a RoPE preset (dsv32, glm5): the reference chain
// of tools/rope_chain.h, printed row by row, its checks, PASS or FAIL.
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "cpu_path.h"
#include "report.h"
#include "rope_chain.h"
#include "timing.h"

namespace dsa::cli {

int run_cpu_path_rope(const StepShape& s, const Options& options, const std::string& why_cpu) {
  const auto started = std::chrono::steady_clock::now();
  for (const std::string& gpu_only : gpu_only_options_given(options)) {
    std::printf("%s applies to the GPU path only; the CPU reference ignores it\n", gpu_only.c_str());
  }
  if (!options.weights.empty() || !options.config_path.empty()) {
    std::fprintf(stderr, "dsa-decode: %s: the RoPE presets' CPU chain runs the synthetic layer at the preset's shapes "
                         "only\n", options.weights.empty() ? "--config" : "--weights");
    return 2;
  }
  std::printf(
      "the %s step from hidden states [%d, %d] to o_proj's output [%d, %d] (D=%d, H=%d, Q=%d, L=%d, P=%d, R=%d, V=%d): "
      "qkv_a_proj (q_c | kv_c | k_pe), both RMSNorms, q_b_proj [H x %d], rope_absorb, the 656-byte cache write, the "
      "V3.2 indexer (%d heads, no pooling, top-%d; prefill of the %lld context keys, projections, prepare, select), "
      "sparse_mla_v32, value-up, o_proj; synthetic layer of seed %llu\n",
      s.preset.c_str(), s.m, s.D, s.m, s.D, s.D, s.H, s.Q, s.L, s.P, s.R, s.V, s.P + s.R, s.index_heads, s.index_topk,
      static_cast<long long>(s.context), static_cast<unsigned long long>(options.seed));
  RopeChainResult result;
  if (const Status run = run_rope_chain(s, options.seed, options.chain_break, &result); !run.ok()) {
    std::fprintf(stderr, "dsa-decode: %s\n", run.to_string().c_str());
    return 1;
  }
  for (const std::string& note : result.notes) std::printf("%s\n", note.c_str());
  std::printf("\n%-12s %-32s %9s  %-16s  %s\n", "kernel", "output", "CPU ms", "fingerprint", "first values (token 0)");
  CpuReport report;
  report.why_cpu = why_cpu;
  report.shape = s;
  report.seed = options.seed;
  const char* commit = std::getenv("DSA_COMMIT");
  report.commit = commit != nullptr && *commit != '\0' ? commit : "unknown";
  report.date = bench::utc_date();
  for (const RopeChainRow& row : result.rows) {
    char time[24] = "";
    if (row.ms >= 0) std::snprintf(time, sizeof(time), "%.2f", row.ms);
    std::printf("%-12s %-32s %9s  %016llx  %s\n", row.kernel.c_str(), row.output.c_str(), time,
                static_cast<unsigned long long>(row.fingerprint), row.values.c_str());
    report.rows.push_back(
        CpuRow{row.kernel.empty() ? report.rows.back().kernel : row.kernel, row.output, row.ms, row.fingerprint});
  }
  report.chain_ms = result.chain_ms;
  report.prefill_ms = result.prefill_ms;
  std::printf("CPU reference chain: %.0f ms (the indexer's prefill, %.0f ms, not counted)\n", result.chain_ms,
              result.prefill_ms);
  std::printf("\nchecks: the CPU chain's products against float64 on the same inputs (DESIGN.md section 2's bounds)\n");
  for (const Check& check : result.checks) print_check(check);
  report.checks = result.checks;
  report.elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const size_t failed = failed_checks(report.checks), judged = judged_checks(report.checks);
  if (failed > 0) {
    std::printf("FAIL: %zu of %zu checks of the CPU chain outside the contract's bounds (%.1f s)\n", failed, judged,
                report.elapsed_s);
  } else {
    std::printf("PASS: %zu of %zu checks of the CPU chain within the contract's bounds (%.1f s)\n", judged, judged,
                report.elapsed_s);
  }
  std::printf("the GPU path (an sm_90 GPU, without --cpu) runs this step kernel by kernel through the library's "
              "functions and through the stage, and checks each product against this chain's reference of its "
              "kernel\n");
  std::fflush(stdout);
  int exit_code = failed > 0 ? 1 : 0;
  if (!options.json_path.empty()) {
    if (const Status written = write_cpu_json(report, options.json_path); !written.ok()) {
      std::fprintf(stderr, "dsa-decode: %s\n", written.to_string().c_str());
      exit_code = 1;
    } else {
      std::printf("wrote %s\n", options.json_path.c_str());
    }
  }
  if (failed > 0) std::fprintf(stderr, "dsa-decode: %zu of %zu checks failed\n", failed, judged);
  return exit_code;
}

}  // namespace dsa::cli
