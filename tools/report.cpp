#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "timing.h"

namespace dsa::cli {

namespace {

using bench::json_number;
using bench::json_string;

const char* verdict_text(Check::Verdict verdict) {
  switch (verdict) {
    case Check::Verdict::kPass: return "PASS";
    case Check::Verdict::kFail: return "FAIL";
    case Check::Verdict::kInfo: return "info";
  }
  return "?";
}

double floor_us(const RunReport& r, double bytes) { return bytes / (r.copy_GBps * 1e3); }
double percent_of_floor(const RunReport& r, const Timing& t) { return 100 * floor_us(r, t.bytes) / t.us; }
double GBps(const Timing& t) { return t.bytes / (t.us * 1e3); }

std::string json_row(const RunReport& r, const Timing& t) {
  const StepShape& s = r.shape;
  std::ostringstream row;
  row << "{\"name\": " << json_string(t.name) << ", \"label\": " << json_string(t.label)
      << ", \"params\": {\"H\": " << s.H << ", \"m\": " << s.m << ", \"context\": " << s.context
      << "}, \"path\": " << json_string(t.path) << ", \"us\": " << json_number(t.us);
  if (t.baseline >= 0) {
    const Timing& stock = r.timings[t.baseline];
    row << ", \"baseline\": " << json_string(stock.label) << ", \"baseline_us\": " << json_number(stock.us)
        << ", \"speedup\": " << json_number(stock.us / t.us);
  }
  row << ", \"floor_us\": " << json_number(floor_us(r, t.bytes))
      << ", \"bw_fraction\": " << json_number(floor_us(r, t.bytes) / t.us) << ", \"GBps\": " << json_number(GBps(t))
      << "}";
  return row.str();
}

// "12.34", or "none" for NaN (a stage without that neighbour).
std::string us_or_none(double us) {
  if (std::isnan(us)) return "none";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", us);
  return text;
}

// "s0", "s1", ...: the stream's place in the trace's order of first appearance.
std::string stream_label(const StageTrace& trace, uint32_t stream) {
  const auto at = std::find(trace.streams.begin(), trace.streams.end(), stream);
  return "s" + std::to_string(at - trace.streams.begin());
}

std::string json_trace(const StageTrace& trace) {
  std::ostringstream json;
  json << "{\"path\": " << json_string(trace.path) << ", \"span_us\": " << json_number(trace_span_us(trace.kernels))
       << ", \"no_kernel_resident_us\": " << json_number(trace_idle_us(trace.kernels))
       << ", \"next_stage_start_us\": " << json_number(trace.neighbours.next_stage_start_us)
       << ", \"previous_stage_end_us\": " << json_number(trace.neighbours.previous_stage_end_us) << ", \"kernels\": [";
  for (size_t i = 0; i < trace.kernels.size(); ++i) {
    const TracedKernel& k = trace.kernels[i];
    json << (i ? ",\n   " : "\n   ") << "{\"name\": " << json_string(k.name)
         << ", \"stream\": " << json_string(stream_label(trace, k.stream))
         << ", \"start_us\": " << json_number(k.start_ns / 1e3) << ", \"end_us\": " << json_number(k.end_ns / 1e3)
         << ", \"ctas\": " << k.ctas << ", \"threads\": " << k.threads << "}";
  }
  json << "]}";
  return json.str();
}

// The file, or a Status naming --json when it cannot be written.
Status write_text(const std::string& text, const std::string& path) {
  std::ofstream file(path, std::ios::trunc);
  file << text;
  file.close();
  if (!file) return invalid_argument("--json", "a writable file", "'" + path + "' (could not be written)");
  return Status();
}

std::string json_checks(const std::vector<Check>& checks) {
  std::ostringstream json;
  json << "[";
  for (size_t i = 0; i < checks.size(); ++i) {
    const Check& c = checks[i];
    json << (i ? ",\n  " : "\n  ") << "{\"name\": " << json_string(c.name)
         << ", \"result\": " << json_string(verdict_text(c.verdict)) << ", \"detail\": " << json_string(c.detail)
         << "}";
  }
  json << "\n ]";
  return json.str();
}

}  // namespace

std::string format(const char* pattern, ...) {
  char text[512];
  va_list args;
  va_start(args, pattern);
  std::vsnprintf(text, sizeof(text), pattern, args);
  va_end(args);
  return text;
}

Check judged(std::string name, bool pass, std::string detail) {
  return Check{std::move(name), pass ? Check::Verdict::kPass : Check::Verdict::kFail, std::move(detail)};
}

Check reported(std::string name, std::string detail) {
  return Check{std::move(name), Check::Verdict::kInfo, std::move(detail)};
}

size_t failed_checks(const std::vector<Check>& checks) {
  return static_cast<size_t>(
      std::count_if(checks.begin(), checks.end(), [](const Check& c) { return c.verdict == Check::Verdict::kFail; }));
}

size_t judged_checks(const std::vector<Check>& checks) {
  return static_cast<size_t>(
      std::count_if(checks.begin(), checks.end(), [](const Check& c) { return c.verdict != Check::Verdict::kInfo; }));
}

void print_check(const Check& check) {
  std::printf("%s  %s: %s\n", verdict_text(check.verdict), check.name.c_str(), check.detail.c_str());
  std::fflush(stdout);
}

void print_timings(const RunReport& r) {
  std::printf("\ntimings: CUDA-graph replay, median of %d replays; weights rotated through %d copies (cold L2); "
              "floor = bytes / measured copy rate %.0f GB/s\n",
              r.steps, r.weight_copies, r.copy_GBps);
  std::printf("%-50s %-6s %9s %9s %8s\n", "kernel, alone", "path", "us", "GB/s", "% floor");
  double fused_sum = 0, stock_sum = 0;
  for (const Timing& t : r.timings) {
    if (!t.single_kernel) continue;
    std::printf("%-50s %-6s %9.2f %9.0f %7.0f%%\n", t.label.c_str(), t.path.c_str(), t.us, GBps(t),
                percent_of_floor(r, t));
    if (t.path != "stock") fused_sum += t.us;
    if (t.path != "fused") stock_sum += t.us;
  }
  std::printf("\n%-50s %9s %8s %9s %8s %8s\n", "fused vs stock", "fused us", "% floor", "stock us", "% floor",
              "speedup");
  for (const Timing& t : r.timings) {
    if (t.baseline < 0) continue;
    const Timing& stock = r.timings[t.baseline];
    std::printf("%-50s %9.2f %7.0f%% %9.2f %7.0f%% %7.2fx\n", t.label.c_str(), t.us, percent_of_floor(r, t), stock.us,
                percent_of_floor(r, stock), stock.us / t.us);
  }
  std::printf("kernels alone, summed: fused path %.2f us, stock path %.2f us (a chain runs them back to back, "
              "with PDL on the fused kernels)\n",
              fused_sum, stock_sum);
  std::fflush(stdout);
}

void print_trace(const StageTrace& t, int weight_copies) {
  std::printf(
      "\ntrace, %s path: the middle stage of a graph replay of the %d stages in turn (as timed), CUPTI's "
      "kernel records; %zu kernels, %.2f us from the first start to the last end, %.2f us of it with no kernel "
      "resident (a PDL kernel counts from its first CTA, waiting or not); the next stage starts at %s us (the "
      "stage's period in the chain), the previous one ended at %s us (positive: overlapping this one); streams "
      "s0, s1 in order of first use\n",
      t.path.c_str(), weight_copies, t.kernels.size(), trace_span_us(t.kernels), trace_idle_us(t.kernels),
      us_or_none(t.neighbours.next_stage_start_us).c_str(), us_or_none(t.neighbours.previous_stage_end_us).c_str());
  std::printf("%9s %9s %8s %8s  %-6s %6s x %-5s %s\n", "start us", "end us", "us", "gap us", "stream", "ctas", "thr",
              "kernel");
  uint64_t covered_until = 0;
  for (const TracedKernel& k : t.kernels) {
    // gap: since every kernel that started earlier ended (negative: it overlaps one).
    const double gap = (static_cast<double>(k.start_ns) - static_cast<double>(covered_until)) / 1e3;
    std::printf("%9.2f %9.2f %8.2f %8.2f  %-6s %6d x %-5d %s\n", k.start_ns / 1e3, k.end_ns / 1e3,
                (k.end_ns - k.start_ns) / 1e3, &k == &t.kernels.front() ? 0.0 : gap, stream_label(t, k.stream).c_str(),
                k.ctas, k.threads, k.name.c_str());
    covered_until = std::max(covered_until, k.end_ns);
  }
  std::fflush(stdout);
}

// The indexer's shape of the step and where the shapes came from.
static std::string json_indexer(const StepShape& s) {
  std::ostringstream json;
  json << "{\"heads\": " << s.index_heads << ", \"pool\": " << s.index_pool << ", \"topk\": " << s.index_topk
       << ", \"row_width\": " << s.top_k_width() << ", \"ring\": " << s.indexer_ring()
       << ", \"shape_source\": " << json_string(s.shape_source) << "}";
  return json.str();
}

Status write_json(const RunReport& r, const std::string& path) {
  std::ostringstream json;
  const StepShape& s = r.shape;
  json << "{\"bench\": \"dsa-decode\", \"gpu\": " << json_string(r.gpu) << ", \"commit\": " << json_string(r.commit)
       << ",\n \"date\": " << json_string(r.date) << ", \"copy_GBps\": " << json_number(r.copy_GBps)
       << ",\n \"preset\": " << json_string(s.preset) << ", \"tp\": " << s.tp << ", \"params\": {\"H\": " << s.H
       << ", \"m\": " << s.m << ", \"context\": " << s.context << "}, \"indexer\": " << json_indexer(s)
       << ", \"steps\": " << r.steps
       << ", \"weight_copies\": " << r.weight_copies
       << ",\n \"value_up\": {\"fused_kernel\": " << json_string(r.value_up_kernel)
       << ", \"reason\": " << json_string(r.value_up_reason) << "}"
       << ",\n \"projections\": {\"option\": " << json_string(r.projections_option) << ", \"fused_kernels\": {";
  for (size_t i = 0; i < r.fused_projection_kernels.size(); ++i) {
    const auto& [projection, kernel] = r.fused_projection_kernels[i];
    json << (i ? ", " : "") << json_string(projection) << ": " << json_string(kernel);
  }
  json << "}}"
       << ",\n \"indexer_projections\": " << json_string(r.indexer_projections_kernel)
       << ",\n \"indexer_logits\": " << json_string(r.indexer_logits)
       << ",\n \"head_gemv_sums\": " << json_string(r.head_gemv_sums)
       << ",\n \"attention_plan\": " << json_string(r.attention_plan)
       << ",\n \"batch_invariant\": " << (r.batch_invariant ? "true" : "false")
       << ",\n \"note\": \"the library's stage (DsaAttentionStage): forward and stock_forward from hidden states to "
          "o_proj's output, one stage per weight copy; chain and stock_chain: the attention half (norm .. value_up), "
          "whole_stage and stock_whole_stage: every step; attention over the glm5next indexer's slots (projections "
          "of q_c and the hidden states, prepare, select; stock: the same indexer_select), its state "
          "prefilled with drawn rows of the context; the stock path runs the same sparse_mla after a counter memset "
          "(no stock Hopper kernel takes this cache format)\",\n \"checks\": "
       << json_checks(r.checks) << ",\n \"rows\": [";
  for (size_t i = 0; i < r.timings.size(); ++i) json << (i ? ",\n  " : "\n  ") << json_row(r, r.timings[i]);
  json << "\n ]";
  if (!r.trace_problem.empty()) json << ",\n \"trace_problem\": " << json_string(r.trace_problem);
  if (!r.traces.empty()) {
    json << ",\n \"traces\": [";
    for (size_t i = 0; i < r.traces.size(); ++i) json << (i ? ",\n  " : "\n  ") << json_trace(r.traces[i]);
    json << "\n ]";
  }
  json << "}\n";
  return write_text(json.str(), path);
}

Status write_cpu_json(const CpuReport& r, const std::string& path) {
  std::ostringstream json;
  const StepShape& s = r.shape;
  const size_t failed = failed_checks(r.checks);
  json << "{\"bench\": \"dsa-decode\", \"path\": \"cpu\", \"why_cpu\": " << json_string(r.why_cpu)
       << ", \"commit\": " << json_string(r.commit) << ",\n \"date\": " << json_string(r.date)
       << ",\n \"preset\": " << json_string(s.preset) << ", \"tp\": " << s.tp << ", \"params\": {\"H\": " << s.H
       << ", \"m\": " << s.m << ", \"context\": " << s.context << "}, \"indexer\": " << json_indexer(s)
       << ", \"seed\": " << r.seed
       << ",\n \"result\": " << json_string(failed == 0 ? "PASS" : "FAIL") << ", \"failed\": " << failed
       << ", \"elapsed_s\": " << json_number(r.elapsed_s) << ", \"chain_ms\": " << json_number(r.chain_ms)
       << ", \"prefill_ms\": " << json_number(r.prefill_ms)
       << ",\n \"note\": \"the CPU reference chain of the stage's step (hidden states to o_proj's output) in the "
          "kernels' fixed orders, its products checked against float64 within the numerics contract's bounds; no "
          "GPU kernel ran, nothing is timed but the CPU\",\n \"checks\": "
       << json_checks(r.checks) << ",\n \"rows\": [";
  for (size_t i = 0; i < r.rows.size(); ++i) {
    const CpuRow& row = r.rows[i];
    char fingerprint[24];
    std::snprintf(fingerprint, sizeof(fingerprint), "%016llx", static_cast<unsigned long long>(row.fingerprint));
    json << (i ? ",\n  " : "\n  ") << "{\"kernel\": " << json_string(row.kernel)
         << ", \"output\": " << json_string(row.output) << ", \"cpu_ms\": ";
    if (row.ms >= 0) {
      json << json_number(row.ms);
    } else {
      json << "null";
    }
    json << ", \"fingerprint\": " << json_string(fingerprint) << "}";
  }
  json << "\n ]}\n";
  return write_text(json.str(), path);
}

}  // namespace dsa::cli
