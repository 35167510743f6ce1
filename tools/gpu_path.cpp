#include "gpu_path.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <utility>
#include <vector>

#include "compare.h"
#include "cublas_bmm.h"
#include "device_step.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla.h"
#include "harness.h"
#include "reference_chain.h"
#include "report.h"

namespace dsa::cli {

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
// Launches per graph at the least: the graph launch's own overhead is spread
// over them (as in dsa-bench).
constexpr int kMinLaunchesPerGraph = 20;

// A stream of our own: graph capture cannot use the legacy default stream.
class OwnedStream {
 public:
  OwnedStream() = default;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  ~OwnedStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Status create() {
    DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return Status();
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

std::string format(const char* pattern, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* pattern, ...) {
  char text[512];
  va_list args;
  va_start(args, pattern);
  std::vsnprintf(text, sizeof(text), pattern, args);
  va_end(args);
  return text;
}

// ---------------------------------------------------------------- kernels and chains

using Launch = Status (DeviceStep::*)(cudaStream_t stream, int copy) const;

struct Kernel {
  const char* name;   // JSON row name
  const char* label;  // table text
  const char* path;   // "shared", "fused", "stock"
  double bytes;       // what it must move at the least
  Launch launch;
};

enum KernelId {
  kNorm,
  kQBProj,
  kFusedAbsorb,
  kFusedAttention,
  kFusedValueUp,
  kStockCacheWrite,
  kStockAbsorbBmm,
  kStockFp8Quant,
  kStockCounterMemset,
  kStockAttention,
  kStockValueUpBmm,
};

// Every kernel of the two chains, indexed by KernelId.
std::vector<Kernel> make_kernels(const StepShape& s) {
  const double m = s.m, H = s.H, Q = s.Q, L = s.L, P = s.P, V = s.V;
  const double bf16 = 2, fp8 = 1;
  const double w_uk = bf16 * H * P * L, w_uv = bf16 * H * L * V, q = bf16 * m * H * P;
  const double cache_write = bf16 * m * L + fp8 * m * L;  // kv_c read, the new entries written
  // q, the index rows, every token's own cache rows (no sharing assumed), latent and lse.
  const double attention = fp8 * m * H * L + 4.0 * m * kTopKWidth + fp8 * m * kIndexerPooledColumns * L +
                           bf16 * m * H * L + 4.0 * m * H;
  const double counters = 4.0 * sparse_mla_split_counter_count(s.m, s.H, kTopKWidth);
  return {
      {"norm", "norm (q and kv RMSNorm, one launch)", "shared", bf16 * (2 * m * (Q + L) + (Q + L)),
       &DeviceStep::norm},
      {"q_b_proj", "q_b_proj (cuBLAS GEMM)", "shared", bf16 * H * P * Q + bf16 * m * Q + q, &DeviceStep::q_b_proj},
      {"absorb", "absorb + FP8 quant + cache write (head_gemv)", "fused", w_uk + q + fp8 * m * H * L + cache_write,
       &DeviceStep::fused_absorb},
      {"attention", "sparse attention (sparse_mla)", "fused", attention, &DeviceStep::fused_attention},
      {"value_up", "value_up (head_gemv)", "fused", w_uv + bf16 * m * H * L + bf16 * m * H * V,
       &DeviceStep::fused_value_up},
      {"stock_cache_write", "concat_and_cache_mla", "stock", cache_write, &DeviceStep::stock_cache_write},
      {"stock_absorb_bmm", "absorb bmm (cuBLAS)", "stock", w_uk + q + bf16 * m * H * L, &DeviceStep::stock_absorb_bmm},
      {"stock_fp8_quant", "static FP8 quant", "stock", bf16 * m * H * L + fp8 * m * H * L, &DeviceStep::stock_fp8_quant},
      {"stock_counter_memset", "split counters memset", "stock", counters, &DeviceStep::stock_counter_memset},
      {"stock_attention", "sparse attention (sparse_mla, stock inputs)", "stock", attention,
       &DeviceStep::stock_attention},
      {"stock_value_up_bmm", "value_up bmm (cuBLAS)", "stock", w_uv + bf16 * m * H * L + bf16 * m * H * V,
       &DeviceStep::stock_value_up_bmm},
  };
}

const std::vector<KernelId> kFusedChain = {kNorm, kQBProj, kFusedAbsorb, kFusedAttention, kFusedValueUp};
// vLLM's order: the cache write, the absorb bmm and its quant run after the top-k.
const std::vector<KernelId> kStockChain = {kNorm,          kQBProj,         kStockCacheWrite,
                                           kStockAbsorbBmm, kStockFp8Quant, kStockCounterMemset,
                                           kStockAttention, kStockValueUpBmm};
const std::vector<KernelId> kStockAbsorb = {kStockCacheWrite, kStockAbsorbBmm, kStockFp8Quant};

Status run_chain(const DeviceStep& step, const std::vector<Kernel>& kernels, const std::vector<KernelId>& chain,
                 cudaStream_t stream, int copy) {
  for (KernelId id : chain) DSA_RETURN_IF_ERROR((step.*kernels[id].launch)(stream, copy));
  return Status();
}

// ---------------------------------------------------------------- checks

Check judged(std::string name, bool pass, std::string detail) {
  return Check{std::move(name), pass ? Check::Verdict::kPass : Check::Verdict::kFail, std::move(detail)};
}

Check reported(std::string name, std::string detail) {
  return Check{std::move(name), Check::Verdict::kInfo, std::move(detail)};
}

Check check_norm(const StepShape& s, const HostWeights& w, const HostStepInputs& in, const StepOutputs& gpu) {
  const NormOutputs cpu = reference_norm(s, w, in.qkv);
  const Difference q = bf16_difference(gpu.q_c, cpu.q_c), kv = bf16_difference(gpu.kv_c, cpu.kv_c);
  const int64_t worst = std::max(q.max_steps, kv.max_steps);
  return judged("norm vs CPU reference", worst <= 1,
                format("max %lld BF16 ulp (tolerance 1: rsqrt.approx); q_c %zu of %zu values differ, kv_c %zu of %zu",
                       static_cast<long long>(worst), q.differing, cpu.q_c.size(), kv.differing, cpu.kv_c.size()));
}

// cuBLAS sums in its own order, so this is no bitwise check; it is what
// catches a wrong GEMM mapping (transposed operands give errors of the
// values' own size, hundreds of ulps), which the later checks, fed with the
// GPU's own q, would not see.
Check check_q_b_proj(const StepShape& s, const HostWeights& w, const StepOutputs& gpu) {
  constexpr double kTolerance = 2;
  const double error = bf16_error_in_scale_ulps(gpu.q, reference_q_b_proj(s, w, gpu.q_c));
  return judged("q_b_proj (cuBLAS) vs CPU FP32 loop", error <= kTolerance,
                format("max error %.2f BF16 ulp at the values' scale (tolerance %.0f; summation order differs), on "
                       "the GPU's q_c",
                       error, kTolerance));
}

Check check_shared_repeat(const StepOutputs& first, const StepOutputs& second) {
  const bool same = first.q_c == second.q_c && first.kv_c == second.kv_c && first.q == second.q;
  return judged("norm and q_b_proj repeat", same,
                same ? "the fused and the stock run got the same q_c, kv_c and q bits"
                     : "q_c, kv_c or q differ between the fused and the stock run: the comparisons below are void");
}

Check check_absorb(const StepShape& s, const HostWeights& w, const StepOutputs& gpu) {
  const HeadGemvTactic tactic = absorb_tactic(s);
  const std::vector<uint8_t> cpu = reference_absorb(s, w, gpu.q, tactic);
  const Difference d = fp8_difference(gpu.q_fp8_fused, cpu);
  return judged("absorb q_fp8 vs CPU reference", d.differing == 0,
                format("bitwise: %zu of %zu FP8 values differ (first at %zu, max %lld steps); tactic %d/%d, on the "
                       "GPU's q",
                       d.differing, cpu.size(), d.first_index, static_cast<long long>(d.max_steps), tactic.tile,
                       tactic.rows_per_thread));
}

Check check_value_up(const StepShape& s, const HostWeights& w, const StepOutputs& gpu) {
  const HeadGemvTactic tactic = value_up_tactic(s);
  const std::vector<uint16_t> cpu = reference_value_up(s, w, gpu.latent_fused, tactic);
  const Difference d = bf16_difference(gpu.out_fused, cpu);
  return judged("value_up out vs CPU reference", d.differing == 0,
                format("bitwise: %zu of %zu BF16 values differ (first at %zu, max %lld ulp); tactic %d/%d, on the "
                       "GPU's latent",
                       d.differing, cpu.size(), d.first_index, static_cast<long long>(d.max_steps), tactic.tile,
                       tactic.rows_per_thread));
}

// The attention against the float64 reference on the GPU's own q_fp8 and
// cache, with the tolerances of its tests (docs/sparse_mla.md).
Check check_attention(const StepShape& s, const HostWeights& w, const HostStepInputs& in, const StepOutputs& gpu) {
  constexpr double kMaxRelativeFrobenius = 1e-2, kMaxLseError = 1e-3;
  const reference::SparseMlaResult cpu = reference_attention(s, w, gpu.q_fp8_fused, gpu.cache_fused, s.cache_blocks(),
                                                             kCacheBlockSize, in.topk_slots);
  double error_squares = 0, reference_squares = 0, worst_lse = 0;
  for (size_t i = 0; i < cpu.latent.size(); ++i) {
    const double got = num::bf16_to_float(gpu.latent_fused[i]), want = num::bf16_to_float(cpu.latent[i]);
    error_squares += (got - want) * (got - want);  // NaN from the GPU fails the check
    reference_squares += want * want;
  }
  for (size_t i = 0; i < cpu.lse.size(); ++i) {
    const double error = std::fabs(double(gpu.lse_fused[i]) - cpu.lse[i]);
    worst_lse = std::isnan(error) ? error : std::max(worst_lse, error);
  }
  const double relative = std::sqrt(error_squares / reference_squares);
  const bool pass = relative <= kMaxRelativeFrobenius && worst_lse <= kMaxLseError && gpu.bad_indices_fused == 0 &&
                    cpu.out_of_range == 0 && gpu.counters_zero;
  return judged("sparse attention vs float64 reference", pass,
                format("latent relative Frobenius error %.2e (tolerance %.0e), lse max error %.2e (tolerance %.0e); "
                       "out-of-range slots GPU %u, CPU %lld; split counters %s after the run",
                       relative, kMaxRelativeFrobenius, worst_lse, kMaxLseError, gpu.bad_indices_fused,
                       static_cast<long long>(cpu.out_of_range), gpu.counters_zero ? "zero" : "NOT zero"));
}

Check report_attention_fused_vs_stock(const StepOutputs& gpu) {
  return reported("attention fused vs stock",
                  format("latent max %.2f BF16 ulp at the values' scale (the inputs differ: q_fp8 by up to one "
                         "step); %zu of %zu values differ",
                         bf16_error_in_scale_ulps(gpu.latent_fused, gpu.latent_stock),
                         bf16_difference(gpu.latent_fused, gpu.latent_stock).differing, gpu.latent_stock.size()));
}

// The whole cache, not only the new entries: a stray write anywhere fails it.
Check check_cache_reference(const StepShape& s, const HostWeights& w, const HostStepInputs& in,
                            const HostCache& initial, const StepOutputs& gpu) {
  HostCache expected = initial;
  const int skipped = reference_cache_write(s, w, gpu.kv_c, in.slot_mapping, &expected);
  const Difference d = fp8_difference(gpu.cache_fused, expected.bytes);
  const bool pass = d.differing == 0 && skipped == 0 && gpu.skipped_slots_fused == 0;
  return judged("KV cache (fused write) vs CPU reference", pass,
                format("bitwise over %zu bytes: %zu differ (first in slot %zu); slots skipped: GPU %u, CPU %d",
                       expected.bytes.size(), d.differing, d.first_index / s.L, gpu.skipped_slots_fused, skipped));
}

Check check_cache_fused_vs_stock(const StepShape& s, const StepOutputs& gpu) {
  const Difference d = fp8_difference(gpu.cache_fused, gpu.cache_stock);
  const bool pass = d.differing == 0 && gpu.skipped_slots_stock == 0;
  return judged("KV cache fused vs stock", pass,
                format("bitwise over %zu bytes: %zu differ (first in slot %zu); slots skipped by the stock write: %u",
                       gpu.cache_stock.size(), d.differing, d.first_index / s.L, gpu.skipped_slots_stock));
}

// Other summation orders (cuBLAS), same roundings: the BF16 products differ by
// rounding noise, which moves an FP8 code by at most one step.
Check check_q_fp8_fused_vs_stock(const StepOutputs& gpu) {
  const Difference d = fp8_difference(gpu.q_fp8_fused, gpu.q_fp8_stock);
  return judged("q_fp8 fused vs stock", d.max_steps <= 1,
                format("max %lld FP8 steps (tolerance 1); %zu of %zu values differ",
                       static_cast<long long>(d.max_steps), d.differing, gpu.q_fp8_stock.size()));
}

Check report_value_up_fused_vs_stock(const StepOutputs& gpu) {
  const Difference d = bf16_difference(gpu.out_fused, gpu.out_stock);
  return reported("value_up fused vs stock",
                  format("max %lld BF16 ulp (%.2f ulp at the values' scale); %zu of %zu values differ",
                         static_cast<long long>(d.max_steps), bf16_error_in_scale_ulps(gpu.out_fused, gpu.out_stock),
                         d.differing, gpu.out_stock.size()));
}

Check report_saturation(const StepShape& s, const StepOutputs& gpu) {
  const auto first = gpu.cache_fused.begin() + s.context * s.L;
  const std::vector<uint8_t> new_entries(first, first + int64_t{s.m} * s.L);
  return reported("FP8 range use", format("values at +-448: q_fp8 %zu of %zu, new cache entries %zu of %zu",
                                          count_saturated_fp8(gpu.q_fp8_fused), gpu.q_fp8_fused.size(),
                                          count_saturated_fp8(new_entries), new_entries.size()));
}

// Runs the fused chain, then the stock chain, once each on weight copy 0, and
// checks what they wrote. Each check is printed as soon as it is known.
Status run_checks(const StepShape& s, const HostWeights& w, const HostStepInputs& in, const HostCache& initial_cache,
                  const DeviceStep& step, const std::vector<Kernel>& kernels, cudaStream_t stream,
                  std::vector<Check>* checks) {
  StepOutputs after_fused, after_both;
  DSA_RETURN_IF_ERROR(run_chain(step, kernels, kFusedChain, stream, 0));
  DSA_RETURN_IF_ERROR(step.download(stream, &after_fused));
  DSA_RETURN_IF_ERROR(run_chain(step, kernels, kStockChain, stream, 0));
  DSA_RETURN_IF_ERROR(step.download(stream, &after_both));

  std::printf("\nchecks (fused chain, then stock chain, once each):\n");
  auto add = [&](Check check) {
    print_check(check);
    checks->push_back(std::move(check));
  };
  add(check_norm(s, w, in, after_fused));
  add(check_q_b_proj(s, w, after_fused));
  add(check_shared_repeat(after_fused, after_both));
  add(check_absorb(s, w, after_fused));
  add(check_cache_reference(s, w, in, initial_cache, after_fused));
  add(check_attention(s, w, in, after_fused));
  add(check_value_up(s, w, after_fused));
  add(check_cache_fused_vs_stock(s, after_both));
  add(check_q_fp8_fused_vs_stock(after_both));
  add(report_attention_fused_vs_stock(after_both));
  add(report_value_up_fused_vs_stock(after_both));
  add(report_saturation(s, after_both));
  return Status();
}

// ---------------------------------------------------------------- timing

// Copies of every weight: enough that the smallest of the large ones (W_UK_T
// or W_UV; q_b_proj is larger) rotates through more than twice the L2. The
// norm's 4 KB of gammas rotate with them; alone, the norm still finds them in
// L2, in the chains the other weights' traffic evicts them.
int weight_copies(const bench::Context& ctx, const StepShape& s) {
  const size_t smallest = 2 * std::min({size_t(s.q_width()) * s.Q, size_t(s.H) * s.P * s.L, size_t(s.H) * s.L * s.V});
  return bench::cold_copies(ctx, smallest);
}

// Times each kernel alone, the stock absorb launches together, and both chains.
Status time_all(const bench::Context& ctx, const DeviceStep& step, const std::vector<Kernel>& kernels, int copies,
                int replays, std::vector<Timing>* timings) {
  // A whole number of rotations per graph: no copy is reused sooner than
  // `copies` launches later, across replays too.
  const int per_graph = copies * ((kMinLaunchesPerGraph + copies - 1) / copies);
  const int first = static_cast<int>(timings->size());  // the kernels alone follow, in KernelId order
  auto measure = [&](const char* name, const char* label, const char* path, const std::vector<KernelId>& chain) {
    Timing t{name, label, path, chain.size() == 1};
    for (KernelId id : chain) t.bytes += kernels[id].bytes;
    DSA_RETURN_IF_ERROR(bench::time_graph(
        ctx, [&](cudaStream_t stream, int i) { return run_chain(step, kernels, chain, stream, i); }, &t.us, per_graph,
        replays));
    timings->push_back(t);
    return Status();
  };
  for (size_t id = 0; id < kernels.size(); ++id) {
    const Kernel& k = kernels[id];
    DSA_RETURN_IF_ERROR(measure(k.name, k.label, k.path, {static_cast<KernelId>(id)}));
  }
  const int stock_absorb = static_cast<int>(timings->size());
  DSA_RETURN_IF_ERROR(measure("stock_absorb", "cache write + absorb bmm + FP8 quant", "stock", kStockAbsorb));
  const int stock_chain = static_cast<int>(timings->size());
  DSA_RETURN_IF_ERROR(measure("stock_chain", "stock chain norm .. value_up", "stock", kStockChain));
  DSA_RETURN_IF_ERROR(measure("chain", "chain norm .. value_up", "fused", kFusedChain));
  (*timings)[first + kFusedAbsorb].baseline = stock_absorb;
  (*timings)[first + kFusedAttention].baseline = first + kStockAttention;
  (*timings)[first + kFusedValueUp].baseline = first + kStockValueUpBmm;
  timings->back().baseline = stock_chain;
  return Status();
}

// ---------------------------------------------------------------- setup

Status run_gpu(const StepShape& s, const Options& options, RunReport* report) {
  OwnedStream stream;
  DSA_RETURN_IF_ERROR(stream.create());
  bench::Context ctx;
  DSA_RETURN_IF_ERROR(bench::open_context(stream.get(), /*quick=*/false, &ctx));
  std::printf("dsa-decode on %s (%d SMs, L2 %.0f MB, copy %.0f GB/s), commit %s: %s\n", ctx.gpu_name.c_str(),
              ctx.sm_count, ctx.l2_bytes / 1e6, ctx.copy_GBps, ctx.commit.c_str(), s.describe().c_str());
  std::printf("attention: sparse_mla over synthetic top-k rows (512 pools drawn from the seed + the tail per token: "
              "the indexer's GPU prepare step is not wired in yet); no stock Hopper kernel takes this cache format, "
              "so the stock chain runs the same sparse_mla after its counter memset\n");
  bench::CublasHandle cublas;
  DSA_RETURN_IF_ERROR(cublas.create(ctx.stream));

  const HostWeights weights = make_weights(s, options.seed);
  const HostStepInputs inputs = make_step_inputs(s, options.seed);
  const HostCache cache = make_cache(s, weights, options.seed, 0, s.cache_blocks());
  const int copies = weight_copies(ctx, s);
  DeviceStep step;
  DSA_RETURN_IF_ERROR(step.init(s, weights, inputs, cache, copies, cublas.get(), ctx.stream));
  std::printf("synthetic layer (seed %llu), %d weight copies; KV cache [%lld, %d, %d] FP8 e4m3, new tokens at slots "
              "%lld..%lld\n",
              static_cast<unsigned long long>(options.seed), copies, static_cast<long long>(s.cache_blocks()),
              kCacheBlockSize, s.L, static_cast<long long>(s.context), static_cast<long long>(s.context + s.m - 1));

  const std::vector<Kernel> kernels = make_kernels(s);
  report->gpu = ctx.gpu_name;
  report->commit = ctx.commit;
  report->date = ctx.date;
  report->copy_GBps = ctx.copy_GBps;
  report->shape = s;
  report->steps = options.steps;
  report->weight_copies = copies;
  DSA_RETURN_IF_ERROR(run_checks(s, weights, inputs, cache, step, kernels, ctx.stream, &report->checks));
  DSA_RETURN_IF_ERROR(time_all(ctx, step, kernels, copies, options.steps, &report->timings));
  print_timings(*report);
  return Status();
}

}  // namespace

std::string unusable_gpu_reason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it: the CPU path makes no CUDA call, but leave no sticky state behind
    return std::string("cudaGetDeviceCount: ") + cudaGetErrorString(error);
  }
  if (count == 0) return "cudaGetDeviceCount: 0 devices";
  cudaDeviceProp prop{};
  if (const cudaError_t props = cudaGetDeviceProperties(&prop, 0); props != cudaSuccess) {
    return std::string("cudaGetDeviceProperties(0): ") + cudaGetErrorString(props);
  }
  if (prop.major != 9 || prop.minor != 0) {
    return std::string("device 0 (") + prop.name + ") is sm_" + std::to_string(prop.major * 10 + prop.minor) +
           "; the kernels are built for sm_90a only";
  }
  return "";
}

int run_gpu_path(const StepShape& shape, const Options& options) {
  RunReport report;
  if (const Status status = run_gpu(shape, options, &report); !status.ok()) {
    std::fprintf(stderr, "dsa-decode: %s\n", status.to_string().c_str());
    return kExitFailure;
  }
  if (!options.json_path.empty()) {
    if (const Status status = write_json(report, options.json_path); !status.ok()) {
      std::fprintf(stderr, "dsa-decode: %s\n", status.to_string().c_str());
      return kExitFailure;
    }
    std::printf("wrote %s\n", options.json_path.c_str());
  }
  const auto failed = std::count_if(report.checks.begin(), report.checks.end(),
                                    [](const Check& c) { return c.verdict == Check::Verdict::kFail; });
  if (failed > 0) {
    std::fprintf(stderr, "dsa-decode: %ld of %zu checks failed\n", static_cast<long>(failed), report.checks.size());
    return kExitFailure;
  }
  return kExitOk;
}

}  // namespace dsa::cli
