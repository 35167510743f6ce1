#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "dsa_decode/sparse_mla_v32.h"
#include "html_report.h"
#include "options.h"
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

// The file, or a Status naming --json when it cannot be written; recorded as written (report_written).
Status write_text(const std::string& text, const std::string& path) {
  std::ofstream file(path, std::ios::trunc);
  file << text;
  file.close();
  if (!file) return invalid_argument("--json", "a writable file", "'" + path + "' (could not be written)");
  note_report_written(path);
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
       << ",\n \"batch_invariant\": " << (r.batch_invariant ? "true" : "false");
  if (s.rope()) {
    json << ",\n \"rope\": {\"dims\": " << s.R << ", \"kv_cache\": \"fp8_ds_mla\", \"entry_bytes\": "
         << kSparseMlaV32EntryBytes << "}";
  }
  json << ",\n \"note\": "
       << json_string(!r.note.empty()
                          ? r.note
                          : "the library's stage (DsaAttentionStage): forward and stock_forward from hidden states to "
                            "o_proj's output, one stage per weight copy; chain and stock_chain: the attention half "
                            "(norm .. value_up), whole_stage and stock_whole_stage: every step; attention over the "
                            "glm5next indexer's slots (projections of q_c and the hidden states, prepare, select; "
                            "stock: the same indexer_select), its state prefilled with drawn rows of the context; the "
                            "stock path runs the same sparse_mla after a counter memset (no stock Hopper kernel takes "
                            "this cache format)")
       << ",\n \"checks\": " << json_checks(r.checks) << ",\n \"rows\": [";
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

namespace {

// A RoPE stage step's row: its name, its label and the bytes its kernel must
// move at the least (weights once, the activations it reads and writes, the
// cache rows and keys it reads), from the step's shape.
struct RopeStepRow {
  const char* step;  // DsaAttentionStage::step_names
  const char* name;
  const char* label;
};

constexpr RopeStepRow kRopeStepRows[] = {
    {"qkv_a_proj (GEMV)", "qkv_a_proj_gemv", "qkv_a_proj q_c | kv_c | k_pe (GEMV, per token group)"},
    {"qkv_a_proj (cuBLASLt)", "qkv_a_proj", "qkv_a_proj q_c | kv_c | k_pe (cuBLASLt GEMM)"},
    {"norm", "norm", "norm (q and kv RMSNorm, one launch; k_pe not normed)"},
    {"q_b_proj (GEMV)", "q_b_proj_gemv", "q_b_proj [H (P + R)] (GEMV, one launch)"},
    {"q_b_proj (cuBLASLt)", "q_b_proj", "q_b_proj [H (P + R)] (cuBLASLt GEMM)"},
    {"rope_absorb (absorb + RoPE)", "rope_absorb", "rope_absorb (absorb + q_pe and k_pe RoPE, one launch)"},
    {"cache write (656-byte, sparse_mla_v32)", "cache_write_v32", "cache write (656-byte FP8 entries)"},
    {"indexer projections (GEMV)", "indexer_project_gemv", "indexer projections (GEMV, no gate)"},
    {"indexer projections (cuBLASLt)", "indexer_project", "indexer projections (cuBLASLt)"},
    {"indexer prepare", "indexer_prepare", "indexer prepare (k norm + RoPE, q quant, keys)"},
    {"indexer select", "indexer_select", "indexer select (logits over every key, top-k, slots)"},
    {"indexer select (top-k positions kept)", "indexer_select", "indexer select (top-k positions kept)"},
    {"top-k remap", "indexer_remap", "top-k remap (caller rows to slots)"},
    {"attention (sparse_mla_v32)", "attention", "attention (sparse_mla_v32 over 656-byte entries)"},
    {"value_up (head_gemv)", "value_up", "value_up (head_gemv)"},
    {"value_up (cuBLAS bmm)", "value_up_bmm", "value_up (cuBLAS bmm)"},
    {"o_proj (GEMV)", "o_proj_gemv", "o_proj (GEMV, one launch)"},
    {"o_proj (cuBLASLt)", "o_proj", "o_proj (cuBLASLt GEMM)"},
};

// The bytes of a RoPE stage step (kRopeStepRows' step names); -1: unknown.
double rope_step_bytes(const StepShape& s, const std::string& step) {
  const double m = s.m, D = s.D, H = s.H, Q = s.Q, L = s.L, P = s.P, R = s.R, V = s.V, HI = s.index_heads;
  const double W = s.top_k_width(), keys = double(s.context) + 1;
  const double entry = kSparseMlaV32EntryBytes, key = kIndexerPoolBytes, bf16 = 2, f32 = 4, i32 = 4;
  const auto starts = [&](const char* prefix) { return step.rfind(prefix, 0) == 0; };
  if (starts("qkv_a_proj")) return ((Q + L + R) * D + m * D + m * (Q + L + R)) * bf16;
  if (step == "norm") return (m * (Q + L) * 2 + Q + L) * bf16;
  if (starts("q_b_proj")) return (H * (P + R) * Q + m * Q + m * H * (P + R)) * bf16;
  if (step == "rope_absorb (absorb + RoPE)") {
    return (H * P * L + m * H * (P + R) + m * H * (L + R) + 2 * m * R) * bf16 + m * R * f32;
  }
  if (step == "cache write (656-byte, sparse_mla_v32)") return m * (L + R) * bf16 + m * entry;
  if (starts("indexer projections")) {
    return (HI * kIndexerDim * Q + kIndexerDim * D + HI * D + m * (Q + D) + m * (HI + 1) * kIndexerDim) * bf16 +
           m * HI * f32;
  }
  if (step == "indexer prepare") {
    return m * ((HI + 1) * kIndexerDim * bf16 + HI * f32 + R * f32) + m * (HI * kIndexerDim + HI * f32 + key);
  }
  if (step == "indexer select") return m * (keys * key + W * i32);
  if (step == "indexer select (top-k positions kept)") return m * (keys * key + 2 * W * i32);
  if (step == "top-k remap") return m * 2 * W * i32;
  if (step == "attention (sparse_mla_v32)") return m * W * (entry + i32) + m * H * (L + R + L) * bf16 + m * H * f32;
  if (starts("value_up")) return (H * L * V + m * H * L + m * H * V) * bf16;
  if (starts("o_proj")) return (D * H * V + m * H * V + m * D) * bf16;
  return -1;
}

const RopeStepRow* rope_step_row(const std::string& step) {
  for (const RopeStepRow& row : kRopeStepRows) {
    if (step == row.step) return &row;
  }
  return nullptr;
}

}  // namespace

void set_baselines(std::vector<Timing>& timings, const std::vector<std::pair<const char*, const char*>>& pairs) {
  const auto index_of = [&](const char* name) {
    for (size_t i = 0; i < timings.size(); ++i) {
      if (timings[i].name == name) return static_cast<int>(i);
    }
    return -1;
  };
  for (const auto& [fused, stock] : pairs) {
    const int f = index_of(fused), b = index_of(stock);
    if (f >= 0 && b >= 0 && f != b) timings[f].baseline = b;
  }
}

Status rope_run_report(const StepShape& s, const Options& options, const std::string& gpu, double copy_GBps,
                       int weight_copies, const std::vector<Check>& checks, const std::vector<StageStepTime>& times,
                       double gpu_chain_us, RunReport* report) {
  RunReport& r = *report;
  r = RunReport();
  r.gpu = gpu;
  const char* commit = std::getenv("DSA_COMMIT");
  r.commit = commit != nullptr && *commit != '\0' ? commit : "unknown";
  r.date = bench::utc_date();
  r.copy_GBps = copy_GBps;
  r.shape = s;
  r.steps = options.steps;
  r.weight_copies = weight_copies;
  r.checks = checks;
  r.projections_option = options.projections;
  r.indexer_projections_kernel = "indexer_project_gemv";
  r.indexer_logits = choice_name(kIndexerLogitsChoices, s.indexer_logits);
  r.head_gemv_sums = choice_name(kHeadGemvSumsChoices, s.head_gemv_sums);
  r.attention_plan = choice_name(kSparseMlaPlanChoices, dsa_stage_attention_plan(s.stage_plan()));
  r.batch_invariant = s.batch_invariant;
  r.note = "the RoPE layer's step (" + s.preset +
           ": rope_absorb, the 656-byte FP8 cache, DeepSeek-V3.2's unpooled indexer) kernel by kernel through "
           "the library's functions (gpu_chain: one stream, one weight copy, not rotated), then through the "
           "library's stage (DsaAttentionStage): forward and stock_forward, one stage per weight copy; chain and "
           "stock_chain: the attention half (norm .. value_up), whole_stage and stock_whole_stage: every step; the "
           "stock path runs the engine's order with rope_absorb at the rotary's place and the same cache write, "
           "select and attention; checks: the chain's products, then each stage path's, against the CPU chain's "
           "reference of each kernel on the path's own inputs";
  if (options.trace) r.trace_problem = "not traced: the RoPE presets' GPU path takes no trace";

  // The stage's whole steps: the bytes of the whole stage and of its attention half, from the fused path's steps.
  std::vector<std::string> fused_steps;
  for (const StageStepTime& t : times) {
    if (t.path == "fused" && rope_step_row(t.step) != nullptr) fused_steps.push_back(t.step);
  }
  double whole_bytes = 0, half_bytes = 0;
  for (size_t i = 0; i < fused_steps.size(); ++i) {
    const double bytes = rope_step_bytes(s, fused_steps[i]);
    whole_bytes += bytes;
    if (i > 0 && i + 1 < fused_steps.size()) half_bytes += bytes;
  }
  for (const std::string& step : fused_steps) {
    const bool gemv = step.find("(GEMV)") != std::string::npos;
    if (step.rfind("qkv_a_proj", 0) == 0) r.fused_projection_kernels.emplace_back("qkv_a_proj", gemv ? "GEMV" : "cuBLASLt");
    if (step.rfind("q_b_proj", 0) == 0) r.fused_projection_kernels.emplace_back("q_b_proj", gemv ? "GEMV" : "cuBLASLt");
    if (step.rfind("o_proj", 0) == 0) r.fused_projection_kernels.emplace_back("o_proj", gemv ? "GEMV" : "cuBLASLt");
    if (step.rfind("value_up", 0) == 0) {
      r.value_up_kernel = step == "value_up (head_gemv)" ? "head_gemv" : "cuBLAS bmm";
    }
  }
  r.value_up_reason = choose_value_up(options, s.H, s.m).reason;

  for (const StageStepTime& t : times) {
    if (t.path != "fused" && t.path != "stock") {
      return invalid_argument("times", "the paths fused and stock", "'" + t.path + "' (step '" + t.step + "')");
    }
    const bool stock = t.path == "stock";
    Timing row;
    row.path = t.path;
    row.us = t.us;
    if (t.step.rfind("whole stage", 0) == 0) {
      row.name = stock ? "stock_whole_stage" : "whole_stage";
      row.label = stock ? "stock stage qkv_a_proj .. o_proj" : "stage qkv_a_proj .. o_proj";
      row.single_kernel = false;
      row.bytes = whole_bytes;
    } else if (t.step.rfind("attention half", 0) == 0) {
      row.name = stock ? "stock_chain" : "chain";
      row.label = stock ? "stock chain norm .. value_up" : "chain norm .. value_up";
      row.single_kernel = false;
      row.bytes = half_bytes;
    } else if (const RopeStepRow* known = rope_step_row(t.step)) {
      row.name = std::string(stock ? "stock_" : "") + known->name;
      row.label = known->label;
      row.bytes = rope_step_bytes(s, t.step);
    } else {
      return unsupported("dsa-decode's report does not know the RoPE stage's step '" + t.step + "' (" + t.path +
                         " path): the stage changed, and its row would be mislabelled (tools/report.cpp, "
                         "kRopeStepRows)");
    }
    r.timings.push_back(row);
  }
  if (gpu_chain_us > 0) {
    Timing chain{"gpu_chain", "the step kernel by kernel (one stream, one weight copy)", "chain", false};
    chain.us = gpu_chain_us;
    chain.bytes = whole_bytes;
    r.timings.push_back(chain);
  }
  set_baselines(r.timings, {{"q_b_proj_gemv", "stock_q_b_proj"},
                            {"value_up", "stock_value_up_bmm"},
                            {"value_up_bmm", "stock_value_up_bmm"},
                            {"o_proj_gemv", "stock_o_proj"},
                            {"chain", "stock_chain"},
                            {"whole_stage", "stock_whole_stage"}});
  return Status();
}

Status write_run_reports(const RunReport& report, const Options& options) {
  if (!options.json_path.empty()) {
    DSA_RETURN_IF_ERROR(write_json(report, options.json_path));
    std::printf("wrote %s\n", options.json_path.c_str());
  }
  if (!options.report_path.empty()) {
    DSA_RETURN_IF_ERROR(write_html_report(report, options.report_path));
    std::printf("wrote %s\n", options.report_path.c_str());
  }
  std::fflush(stdout);
  return Status();
}

}  // namespace dsa::cli
