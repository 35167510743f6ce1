#include "cpu_path.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "checkpoint.h"
#include "compare.h"
#include "cpu_checks.h"
#include "dsa_decode/numerics.h"
#include "reference_chain.h"
#include "report.h"
#include "timing.h"

namespace dsa::cli {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// While alive, says on stderr every few seconds that `what` is still
// running (the prefill of a long context takes tens of seconds), and when it
// said so, how long it took in the end. Quiet for short steps.
class StillRunning {
 public:
  static constexpr double kEverySeconds = 3;

  explicit StillRunning(std::string what) : what_(std::move(what)), thread_([this] { watch(); }) {}
  StillRunning(const StillRunning&) = delete;
  StillRunning& operator=(const StillRunning&) = delete;
  ~StillRunning() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_.notify_one();
    thread_.join();
    if (said_) std::fprintf(stderr, "dsa-decode: %s: done in %.1f s\n", what_.c_str(), ms_since(start_) / 1e3);
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto every = std::chrono::duration<double>(kEverySeconds);
    while (!wake_.wait_for(lock, every, [this] { return done_; })) {
      std::fprintf(stderr, "dsa-decode: %s: %.0f s so far...\n", what_.c_str(), ms_since(start_) / 1e3);
      said_ = true;
    }
  }

  const std::string what_;
  const Clock::time_point start_ = Clock::now();
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  bool said_ = false;  // written by the thread, read after join
  std::thread thread_;  // last: starts once the members above exist
};

// Runs `work` and returns its wall time in milliseconds; `what` names it in
// the progress lines of a long run.
template <class Work>
double timed_ms(const std::string& what, Work&& work) {
  const StillRunning progress(what);
  const Clock::time_point start = Clock::now();
  work();
  return ms_since(start);
}

constexpr int kShownValues = 4;
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;

std::string first_bf16(const std::vector<uint16_t>& values) {
  std::string text;
  for (size_t i = 0; i < values.size() && i < kShownValues; ++i) {
    char number[24];
    std::snprintf(number, sizeof(number), "%s%.4g", i ? " " : "", num::bf16_to_float(values[i]));
    text += number;
  }
  return text;
}

std::string first_fp8(const uint8_t* codes, size_t count, float scale) {
  std::string text;
  for (size_t i = 0; i < count && i < kShownValues; ++i) {
    char number[24];
    std::snprintf(number, sizeof(number), "%s%.4g", i ? " " : "", num::e4m3_to_float(codes[i]) * scale);
    text += number;
  }
  return text;
}

std::string first_i32(const std::vector<int32_t>& values) {
  std::string text;
  for (size_t i = 0; i < values.size() && i < kShownValues; ++i) text += (i ? " " : "") + std::to_string(values[i]);
  return text;
}

std::string first_f32(const std::vector<float>& values) {
  std::string text;
  for (size_t i = 0; i < values.size() && i < kShownValues; ++i) {
    char number[24];
    std::snprintf(number, sizeof(number), "%s%.4g", i ? " " : "", values[i]);
    text += number;
  }
  return text;
}

// The attention over the cache entries the rows select, gathered into a
// compact cache (one entry per block) so that any context fits: entries below
// the context are made from the seed, the step's own from `window` (written by
// the cache write).
struct Attended {
  std::vector<uint8_t> cache;  // [entries, L] e4m3: the selected entries, in slot order
  std::vector<int32_t> slots;  // [m, top_k_width()]: indices into `cache`, -1 none
  reference::SparseMlaResult result;
};

Attended attend(const StepShape& s, const HostWeights& w, uint64_t seed, const HostCache& window,
                const std::vector<uint8_t>& q_fp8, const std::vector<int32_t>& slots) {
  std::vector<int32_t> selected;
  for (int32_t slot : slots) {
    if (slot >= 0) selected.push_back(slot);
  }
  std::sort(selected.begin(), selected.end());
  selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
  std::vector<uint8_t> compact(selected.size() * s.L);
  for (size_t i = 0; i < selected.size(); ++i) {
    uint8_t* entry = &compact[i * s.L];
    if (selected[i] < s.context) {
      make_cached_entry(s, w, seed, selected[i], entry);
    } else {
      std::copy_n(&window.bytes[size_t(selected[i] - window.first_slot()) * s.L], s.L, entry);
    }
  }
  std::vector<int32_t> compact_slots(slots.size(), -1);
  for (size_t j = 0; j < slots.size(); ++j) {
    if (slots[j] >= 0) {
      compact_slots[j] = static_cast<int32_t>(std::lower_bound(selected.begin(), selected.end(), slots[j]) -
                                              selected.begin());
    }
  }
  Attended attended;
  attended.result = reference_attention(s, w, q_fp8, compact, static_cast<int64_t>(selected.size()), 1, compact_slots);
  attended.cache = std::move(compact);
  attended.slots = std::move(compact_slots);
  return attended;
}

// ms < 0: the output comes from the previous row's kernel (no time of its own).
// Printed, and kept for --json in `rows`.
void print_row(std::vector<CpuRow>* rows, const char* kernel, const std::string& output, double ms,
               uint64_t fingerprint, const std::string& values) {
  rows->push_back(CpuRow{*kernel ? kernel : rows->back().kernel, output, ms, fingerprint});
  char time[24] = "";
  if (ms >= 0) std::snprintf(time, sizeof(time), "%.2f", ms);
  std::printf("%-12s %-30s %9s  %016llx  %s\n", kernel, output.c_str(), time,
              static_cast<unsigned long long>(fingerprint), values.c_str());
}

std::string shape_text(std::initializer_list<int64_t> dims) {
  std::string text = "[";
  for (int64_t d : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

// The first pool entry the prefill wrote, dequantized, for the printout.
std::string first_pool(const StepShape& s, IndexerHostState& state) {
  const int64_t longest_prefill = s.indexer_prefill_tokens(s.indexer_requests() - 1);
  if (longest_prefill < s.index_pool) return "no complete pool";
  const reference::PoolEntry pool = reference::read_pool(s.indexer_plan(), state.view(), 0, 0);
  return "pool 0: " + first_fp8(pool.codes, kIndexerDim, pool.scale) + " (dequantized)";
}

int failed(const Status& status) {
  std::fprintf(stderr, "dsa-decode: %s\n", status.to_string().c_str());
  return kExitFailure;
}

}  // namespace

int run_cpu_path(const StepShape& shape, const Options& options, const std::string& why_cpu) {
  if (shape.rope()) return run_cpu_path_rope(shape, options, why_cpu);
  const Clock::time_point started = Clock::now();
  // The reference's orders are fixed (exact logits, the seed's head_gemv
  // order, FP32 projections in k order, float64 attention): the kernel
  // choices and the timing options apply to the GPU path only.
  StepShape s = shape;
  s.indexer_logits = IndexerLogits::kExact;
  s.head_gemv_sums = HeadGemvSums::kSeedOrder;
  for (const std::string& gpu_only : gpu_only_options_given(options)) {
    if (gpu_only == "--trace") {
      std::printf("--trace: the CPU path runs no GPU kernels; nothing traced (--trace applies to the GPU path only)\n");
    } else {
      std::printf("%s applies to the GPU path only; the CPU reference ignores it\n", gpu_only.c_str());
    }
  }
  CpuReport report;
  report.why_cpu = why_cpu;
  report.shape = s;
  report.seed = options.seed;
  const char* commit = std::getenv("DSA_COMMIT");
  report.commit = commit != nullptr && *commit != '\0' ? commit : "unknown";
  report.date = bench::utc_date();
  const uint64_t seed = options.seed;
  HostWeights weights;
  HostStepInputs inputs;
  IndexerTokenRows indexer_history;
  // Only the blocks the new tokens land in: the context sizes the cache, the
  // reference touches just these.
  const int64_t first_block = s.context / kCacheBlockSize;
  HostCache cache;
  std::string layer_text;
  Status loaded;
  const double weights_ms = timed_ms(options.weights.empty() ? "making the synthetic weights" : "loading the checkpoint",
                                     [&] { loaded = build_layer_weights(s, options.weights, options.layer, seed, &weights,
                                                                        &layer_text); });
  if (!loaded.ok()) return failed(loaded);
  const double make_ms = weights_ms + timed_ms("making the synthetic inputs and cache", [&] {
    inputs = make_step_inputs(s, seed);
    indexer_history = make_indexer_history(s, seed);
    cache = make_cache(s, weights, seed, first_block, s.cache_blocks() - first_block);
  });
  const double weight_mb =
      2e-6 * double(weights.fused_qkv_a_proj.size() + weights.q_b_proj.size() + weights.w_uk_t.size() +
                    weights.w_uv.size() + weights.o_proj.size() + weights.index_wq_b.size() + weights.index_wk.size() +
                    weights.index_weights_proj.size() + weights.index_compress_gate.size());
  std::printf(
      "%s: %.1f MB of BF16 weights (fused_qkv_a_proj [%d, %d], q_b_proj [%lld, %d], "
      "W_UK_T [%d, %d, %d], W_UV [%d, %d, %d], o_proj [%d, %d]; the indexer's wq_b [%d, %d], wk and compress_gate "
      "[%d, %d], weights_proj [%d, %d]), q_scale = k_scale = %.6g, eps %g, softmax scale %g; weights, inputs and cache made in %.0f ms\n",
      layer_text.c_str(), weight_mb, s.qkv_width(), s.D, static_cast<long long>(s.q_width()), s.Q,
      s.H, s.P, s.L, s.H, s.L, s.V, s.D, s.H * s.V, s.index_heads * kIndexerDim, s.Q, kIndexerDim, s.D, s.index_heads,
      s.D, weights.q_scale, weights.eps, s.softmax_scale, make_ms);
  std::printf(
      "the stage's step from hidden states [%d, %d] to o_proj's output [%d, %d]; attention over the glm5next "
      "indexer's slots (its CPU reference: prefill of the context from drawn rows; the step's projections of "
      "q_c and the hidden states, float64 sums stored as the GPU stores them; prepare, select), float64 "
      "reference\n",
      s.m, s.D, s.m, s.D);
  std::printf("%s\n", s.describe_indexer().c_str());
  std::printf(
      "KV cache [%lld blocks, %d, %d] FP8 e4m3, new tokens at slots %lld..%lld; the CPU holds blocks "
      "%lld..%lld only\n\n",
      static_cast<long long>(s.cache_blocks()), kCacheBlockSize, s.L, static_cast<long long>(s.context),
      static_cast<long long>(s.context + s.m - 1), static_cast<long long>(cache.first_block),
      static_cast<long long>(cache.first_block + cache.blocks - 1));

  IndexerHostState indexer = make_indexer_state(s);
  int64_t prefill_errors = 0, step_errors = 0;
  Status status;
  const double prefill_ms =
      timed_ms("the indexer's prefill of " + std::to_string(s.context) + " context positions",
               [&] { status = reference_indexer_prefill(s, weights, indexer_history, &indexer, &prefill_errors); });
  if (!status.ok()) return failed(status);
  const uint64_t prefilled_fingerprint = fingerprint(indexer.k_cache);
  const std::string prefilled_pool = first_pool(s, indexer);

  NormOutputs normed;
  std::vector<uint16_t> qkv, q, heads, out;
  IndexerProjections projections;
  reference::IndexerRowsHost rows;
  Attended attention;
  std::vector<uint8_t> q_fp8;
  int skipped_slots = 0;
  const HeadGemvTactic absorb = absorb_tactic(s), value_up = value_up_tactic(s);
  const double qkv_a_ms = timed_ms("qkv_a_proj", [&] { qkv = reference_qkv_a_proj(s, weights, inputs.hidden); });
  const double norm_ms = timed_ms("norm", [&] { normed = reference_norm(s, weights, qkv); });
  const double q_b_ms = timed_ms("q_b_proj", [&] { q = reference_q_b_proj(s, weights, normed.q_c); });
  const double absorb_ms = timed_ms("absorb", [&] { q_fp8 = reference_absorb(s, weights, q, absorb); });
  const double cache_ms = timed_ms("cache write", [&] {
    skipped_slots = reference_cache_write(s, weights, normed.kv_c, inputs.slot_mapping, &cache);
  });
  const double project_ms = timed_ms("the indexer's projections", [&] {
    projections = stored_projections(reference_indexer_project(s, weights, normed.q_c, inputs.hidden));
  });
  const double indexer_ms = timed_ms("the indexer's prepare and select", [&] {
    status = reference_indexer_step(s, weights, projections, inputs, &indexer, &rows, &step_errors);
  });
  if (!status.ok()) return failed(status);
  const double attention_ms =
      timed_ms("attention", [&] { attention = attend(s, weights, seed, cache, q_fp8, rows.slots); });
  const double value_up_ms =
      timed_ms("value_up", [&] { heads = reference_value_up(s, weights, attention.result.latent, value_up); });
  const double o_proj_ms = timed_ms("o_proj", [&] { out = reference_o_proj(s, weights, heads); });

  std::printf("%-12s %-30s %9s  %-16s  %s\n", "kernel", "output", "CPU ms", "fingerprint", "first values (token 0)");
  print_row(&report.rows, "prefill", "indexer K cache " + shape_text({s.cache_blocks(), s.indexer_page_bytes()}), prefill_ms,
            prefilled_fingerprint, prefilled_pool);
  print_row(&report.rows, "qkv_a_proj", "qkv " + shape_text({s.m, s.qkv_width()}) + " BF16", qkv_a_ms, fingerprint(qkv),
            first_bf16(qkv));
  print_row(&report.rows, "norm", "q_c " + shape_text({s.m, s.Q}) + " BF16", norm_ms, fingerprint(normed.q_c),
            first_bf16(normed.q_c));
  print_row(&report.rows, "", "kv_c " + shape_text({s.m, s.L}) + " BF16", -1, fingerprint(normed.kv_c),
            first_bf16(normed.kv_c));
  print_row(&report.rows, "q_b_proj", "q " + shape_text({s.m, s.H, s.P}) + " BF16", q_b_ms, fingerprint(q),
            first_bf16(q));
  print_row(&report.rows, "absorb", "q_fp8 " + shape_text({s.m, s.H, s.L}) + " e4m3", absorb_ms, fingerprint(q_fp8),
            first_fp8(q_fp8.data(), q_fp8.size(), weights.q_scale) + " (dequantized)");
  const size_t first_entry = size_t(s.context - cache.first_slot()) * s.L;
  const std::vector<uint8_t> written(cache.bytes.begin() + first_entry,
                                     cache.bytes.begin() + first_entry + size_t(s.m) * s.L);
  print_row(&report.rows, "cache write", std::to_string(s.m) + " entries of " + std::to_string(s.L) + " e4m3", cache_ms,
            fingerprint(written), first_fp8(written.data(), written.size(), weights.k_scale) + " (dequantized)");
  print_row(&report.rows, "indexer proj", "index_q " + shape_text({s.m, s.index_heads, kIndexerDim}) + " BF16",
            project_ms, fingerprint(projections.index_q), first_bf16(projections.index_q));
  print_row(&report.rows, "", "index_k " + shape_text({s.m, kIndexerDim}) + " BF16", -1,
            fingerprint(projections.index_k), first_bf16(projections.index_k));
  print_row(&report.rows, "", "head_weights " + shape_text({s.m, s.index_heads}) + " f32", -1,
            fingerprint(projections.head_weights), first_f32(projections.head_weights));
  print_row(&report.rows, "", "gate " + shape_text({s.m, kIndexerDim}) + " BF16", -1, fingerprint(projections.gate),
            first_bf16(projections.gate));
  print_row(&report.rows, "indexer", "slots " + shape_text({s.m, s.top_k_width()}) + " int32", indexer_ms,
            fingerprint(rows.slots), first_i32(rows.slots));
  const reference::SparseMlaResult& attended = attention.result;
  print_row(&report.rows, "attention", "latent " + shape_text({s.m, s.H, s.L}) + " BF16", attention_ms,
            fingerprint(attended.latent), first_bf16(attended.latent));
  print_row(&report.rows, "", "lse " + shape_text({s.m, s.H}) + " f32", -1, fingerprint(attended.lse),
            first_f32(attended.lse));
  print_row(&report.rows, "value_up", "heads " + shape_text({s.m, s.H, s.V}) + " BF16", value_up_ms, fingerprint(heads),
            first_bf16(heads));
  print_row(&report.rows, "o_proj", "out " + shape_text({s.m, s.D}) + " BF16", o_proj_ms, fingerprint(out),
            first_bf16(out));
  std::printf(
      "\nhead_gemv tactics (tile/rows per thread): absorb %d/%d, value_up %d/%d; q_fp8 saturated at +-448: "
      "%zu of %zu; slots outside the cache: %d; indexer block table entries out of range: %lld\n",
      absorb.tile, absorb.rows_per_thread, value_up.tile, value_up.rows_per_thread, count_saturated_fp8(q_fp8),
      q_fp8.size(), skipped_slots, static_cast<long long>(prefill_errors + step_errors));
  const ValueUpChoice value_up_choice = choose_value_up(options, s.H, s.m);
  std::printf("value_up: the GPU's fused path would run %s; %s (the CPU sums in head_gemv's order)\n",
              value_up_kernel_name(value_up_choice.kernel), value_up_choice.reason.c_str());
  report.chain_ms = qkv_a_ms + norm_ms + q_b_ms + absorb_ms + cache_ms + project_ms + indexer_ms + attention_ms +
                    value_up_ms + o_proj_ms;
  report.prefill_ms = prefill_ms;
  std::printf("CPU reference chain: %.0f ms (the indexer's prefill, %.0f ms, not counted)\n", report.chain_ms,
              prefill_ms);

  // The verdict: the chain's products against float64 within the contract's
  // bounds (the indexer's steps are exact by construction: float64
  // projections, exact logits).
  std::printf("\nchecks: the CPU chain's products against float64 on the same inputs (DESIGN.md section 2's bounds)\n");
  std::vector<Check>& checks = report.checks;
  const auto add = [&checks](Check check) {
    print_check(check);
    checks.push_back(std::move(check));
  };
  const StillRunning progress("the float64 checks");
  add(check_product_vs_float64("qkv_a_proj", qkv, inputs.hidden, s.m, s.D, weights.fused_qkv_a_proj, s.qkv_width(),
                               "hidden"));
  add(check_norm_vs_float64(s, weights, qkv, normed.q_c, normed.kv_c));
  add(check_product_vs_float64("q_b_proj", q, normed.q_c, s.m, s.Q, weights.q_b_proj, s.q_width(), "q_c"));
  add(check_absorb_vs_float64(s, weights, q, q_fp8));
  add(check_indexer_rows_layout(s, inputs, rows.topk_positions, rows.slots));
  add(check_attention_vs_float64(s, weights, q_fp8, attention.cache, attention.slots, attended.latent, attended.lse));
  add(check_value_up_vs_float64(s, weights, attended.latent, heads));
  add(check_product_vs_float64("o_proj", out, heads, s.m, int64_t{s.H} * s.V, weights.o_proj, s.D, "heads"));

  report.elapsed_s = ms_since(started) / 1e3;
  const size_t failed = failed_checks(checks), judged = judged_checks(checks);
  if (failed > 0) {
    std::printf("FAIL: %zu of %zu checks of the CPU chain outside the contract's bounds (%.1f s)\n", failed, judged,
                report.elapsed_s);
  } else {
    std::printf("PASS: %zu of %zu checks of the CPU chain within the contract's bounds (%.1f s)\n", judged, judged,
                report.elapsed_s);
  }
  std::fflush(stdout);
  int exit_code = failed > 0 ? kExitFailure : kExitOk;
  if (!options.json_path.empty()) {
    if (const Status written = write_cpu_json(report, options.json_path); !written.ok()) {
      std::fprintf(stderr, "dsa-decode: %s\n", written.to_string().c_str());
      exit_code = kExitFailure;
    } else {
      std::printf("wrote %s\n", options.json_path.c_str());
    }
  }
  if (failed > 0) std::fprintf(stderr, "dsa-decode: %zu of %zu checks failed\n", failed, judged);
  return exit_code;
}

}  // namespace dsa::cli
