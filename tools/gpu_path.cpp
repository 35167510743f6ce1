#include "gpu_path.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
  kIndexerProject,
  kIndexerPrepare,
  kFusedAbsorb,
  kFusedIndexerSelect,
  kFusedAttention,
  kFusedValueUp,
  kStockIndexerSelect,
  kStockCacheWrite,
  kStockAbsorbBmm,
  kStockFp8Quant,
  kStockCounterMemset,
  kStockAttention,
  kStockValueUpBmm,
};

// Every kernel of the two chains, indexed by KernelId; the fused value-up
// named after the kernel it runs.
std::vector<Kernel> make_kernels(const StepShape& s, ValueUpKernel value_up, bool projections_cublaslt) {
  const double m = s.m, D = s.D, H = s.H, Q = s.Q, L = s.L, P = s.P, V = s.V;
  const double bf16 = 2, fp8 = 1;
  const double w_uk = bf16 * H * P * L, w_uv = bf16 * H * L * V, q = bf16 * m * H * P;
  const double cache_write = bf16 * m * L + fp8 * m * L;  // kv_c read, the new entries written
  // q, the index rows, every token's own cache rows (no sharing assumed), latent and lse.
  const double attention = fp8 * m * H * L + 4.0 * m * kTopKWidth + fp8 * m * kIndexerPooledColumns * L +
                           bf16 * m * H * L + 4.0 * m * H;
  const double counters = 4.0 * sparse_mla_split_counter_count(s.m, s.H, kTopKWidth);
  // The indexer. A token at position p % 4 == 3 completes pool p / 4; a token
  // of L > 2048 scores pools 0..L/4-1, all tokens on the same pages, so at the
  // least each pool up to the last token's is read once. Its K cache is not
  // rotated (prepare writes it; every copy would need the same writes): alone,
  // the select finds it in L2, as the attention finds its cache rows; in the
  // chains the rotated weights stream through L2 between two selects.
  const double index_row = bf16 * m * kIndexerDim;  // index_k or gate [m, 128], or their ring rows
  // The projections: their weights (wq_b [4096, Q]; wk, compress_gate [128, D]; weights_proj [32, D]), q_c and
  // x read once, index_q, index_k, gate and head_weights written.
  const double index_q = bf16 * m * kIndexerHeads * kIndexerDim;
  const double project = bf16 * (double(kIndexerHeads) * kIndexerDim * Q + (2.0 * kIndexerDim + kIndexerHeads) * D) +
                         bf16 * m * (Q + D) + index_q + 2 * index_row + 4.0 * m * kIndexerHeads;
  const double q_fp8_and_weights = fp8 * m * kIndexerHeads * kIndexerDim + 4.0 * m * kIndexerHeads;
  const int64_t last_context = s.context + s.m;
  const double pools_completed = double(last_context / kIndexerPoolSize - s.context / kIndexerPoolSize);
  const double pools_scored = last_context > kIndexerPooledColumns ? double(last_context / kIndexerPoolSize) : 0;
  // index_q, index_k, gate, head_weights, the parameters, positions and
  // requests; q_fp8, folded weights and ring rows written; per completed pool
  // the three earlier tokens' ring rows read and the pool written.
  const double prepare = index_q + 2 * index_row + 4.0 * m * kIndexerHeads +
                         4.0 * (2 + kIndexerPoolSize) * kIndexerDim + 12.0 * m + q_fp8_and_weights + 2 * index_row +
                         pools_completed * (3 * 2 * bf16 * kIndexerDim + kIndexerPoolBytes);
  // q_fp8 and folded weights, positions and requests, the pools scored, the rows of slots written.
  const double top_k_rows = 4.0 * m * kTopKWidth;
  const double select = q_fp8_and_weights + 12.0 * m + pools_scored * kIndexerPoolBytes + top_k_rows;
  const bool value_up_bmm = value_up == ValueUpKernel::kCublasBmm;
  const bool tensor_cores = s.head_gemv_sums == HeadGemvSums::kTensorCores;
  return {
      {"norm", "norm (q and kv RMSNorm, one launch)", "shared", bf16 * (2 * m * (Q + L) + (Q + L)), &DeviceStep::norm},
      {"q_b_proj", "q_b_proj (cuBLAS GEMM)", "shared", bf16 * H * P * Q + bf16 * m * Q + q, &DeviceStep::q_b_proj},
      {projections_cublaslt ? "indexer_project" : "indexer_project_gemv",
       projections_cublaslt ? "indexer projections (cuBLASLt, 4 GEMMs)" : "indexer projections (GEMV, one launch)",
       "shared", project, &DeviceStep::indexer_project},
      {"indexer_prepare", "indexer prepare (k norm, q quant, pools)", "shared", prepare, &DeviceStep::indexer_prepare},
      {"absorb",
       tensor_cores ? "absorb + FP8 quant + cache write (head_gemv TC)"
                    : "absorb + FP8 quant + cache write (head_gemv)",
       "fused", w_uk + q + fp8 * m * H * L + cache_write, &DeviceStep::fused_absorb},
      {"indexer_select",
       s.indexer_logits == IndexerLogits::kExact ? "indexer select (logits, top-512, slots)"
                                                 : "indexer select (FP32-acc. logits, top-512, slots)",
       "fused", select, &DeviceStep::fused_indexer_select},
      {"attention", "sparse attention (sparse_mla)", "fused", attention, &DeviceStep::fused_attention},
      {value_up_bmm ? "value_up_bmm" : "value_up",
       value_up_bmm   ? "value_up (cuBLAS bmm, m not in --value-up-tokens)"
       : tensor_cores ? "value_up (head_gemv TC)"
                      : "value_up (head_gemv)",
       "fused", w_uv + bf16 * m * H * L + bf16 * m * H * V, &DeviceStep::fused_value_up},
      {"stock_indexer_select", "indexer select baseline (CUB sort)", "stock", select + top_k_rows,
       &DeviceStep::stock_indexer_select},
      {"stock_cache_write", "concat_and_cache_mla", "stock", cache_write, &DeviceStep::stock_cache_write},
      {"stock_absorb_bmm", "absorb bmm (cuBLAS)", "stock", w_uk + q + bf16 * m * H * L, &DeviceStep::stock_absorb_bmm},
      {"stock_fp8_quant", "static FP8 quant", "stock", bf16 * m * H * L + fp8 * m * H * L,
       &DeviceStep::stock_fp8_quant},
      {"stock_counter_memset", "split counters memset", "stock", counters, &DeviceStep::stock_counter_memset},
      {"stock_attention", "sparse attention (sparse_mla, stock inputs)", "stock", attention,
       &DeviceStep::stock_attention},
      {"stock_value_up_bmm", "value_up bmm (cuBLAS)", "stock", w_uv + bf16 * m * H * L + bf16 * m * H * V,
       &DeviceStep::stock_value_up_bmm},
  };
}

// The seed's order: the indexer (projections, prepare, select) after the absorb.
const std::vector<KernelId> kFusedChain = {kNorm,           kQBProj,         kFusedAbsorb,
                                           kIndexerProject, kIndexerPrepare, kFusedIndexerSelect,
                                           kFusedAttention, kFusedValueUp};
// vLLM's order: the indexer right after q_b_proj; the cache write, the absorb
// bmm and its quant after its top-k.
const std::vector<KernelId> kStockChain = {
    kNorm,           kQBProj,        kIndexerProject,     kIndexerPrepare, kStockIndexerSelect, kStockCacheWrite,
    kStockAbsorbBmm, kStockFp8Quant, kStockCounterMemset, kStockAttention, kStockValueUpBmm};
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

// A cuBLAS product against a CPU reference that sums in another order: BF16
// outputs within this many BF16 ulps at the values' scale
// (bf16_error_in_scale_ulps). Not bitwise, but it catches a wrong GEMM
// mapping (transposed operands give errors of the values' own size, hundreds
// of ulps), which the later checks, fed with the GPU's own outputs, would not see.
constexpr double kCublasToleranceUlps = 2;

// `error` in BF16 ulps at the values' scale of a cuBLAS output fed with the GPU's `input`.
Check cublas_check(const char* name, double error, const char* input) {
  return judged(name, error <= kCublasToleranceUlps,
                format("max error %.2f BF16 ulp at the values' scale (tolerance %.0f; summation order differs), on "
                       "the GPU's %s",
                       error, kCublasToleranceUlps, input));
}

Check check_q_b_proj(const StepShape& s, const HostWeights& w, const StepOutputs& gpu) {
  return cublas_check("q_b_proj (cuBLAS) vs CPU FP32 loop",
                      bf16_error_in_scale_ulps(gpu.q, reference_q_b_proj(s, w, gpu.q_c)), "q_c");
}

// The indexer's state too: the stock run's prepare ran again at the fused
// run's positions, which must leave the same bytes
// (DeviceStep::indexer_prepare), or the fused and the stock rows would come
// from different states (and every timed replay from yet another).
Check check_shared_repeat(const StepOutputs& first, const StepOutputs& second) {
  const IndexerProjections &a = first.indexer_projections, &b = second.indexer_projections;
  const bool same_projections =
      a.index_q == b.index_q && a.index_k == b.index_k && a.head_weights == b.head_weights && a.gate == b.gate;
  const bool same = first.q_c == second.q_c && first.kv_c == second.kv_c && first.q == second.q && same_projections &&
                    first.indexer_ring == second.indexer_ring && first.indexer_k_cache == second.indexer_k_cache;
  return judged("norm, q_b_proj, indexer projections and prepare repeat", same,
                same ? "the fused and the stock run got the same q_c, kv_c, q and indexer projection bits and left the "
                       "same indexer ring and K cache bytes (prepare run again at the same positions)"
                     : "q_c, kv_c, q, the indexer projections or the indexer state differ between the fused and the "
                       "stock run: the comparisons below are void");
}

double projection_value(uint16_t bf16) { return num::bf16_to_float(bf16); }
double projection_value(float value) { return value; }

// The worst |error| / tolerance of one projection output against the exact
// sums, and how many values are outside the tolerance (NaN: outside, infinite).
struct ProjectionError {
  double worst = 0;
  size_t outside = 0;
};

template <class T>
ProjectionError projection_error(const std::vector<T>& got, const reference::ExactProduct& exact, DType dtype) {
  if (got.size() != exact.sum.size()) return ProjectionError{INFINITY, std::max(got.size(), exact.sum.size())};
  ProjectionError e;
  for (size_t i = 0; i < got.size(); ++i) {
    const double value = projection_value(got[i]);
    const double expected = reference::projection_expected(exact.sum[i], dtype);
    const double tolerance = reference::projection_tolerance(value, expected, exact.magnitude[i], dtype);
    const double error = std::fabs(value - expected);
    if (error <= tolerance) {  // false for a NaN error
      e.worst = std::max(e.worst, error / tolerance);
    } else {
      e.worst = INFINITY;
      ++e.outside;
    }
  }
  return e;
}

// Either kernel's sums against the float64 reference with indexer_project's
// tolerance (src/indexer/indexer_reference.h): cuBLASLt sums in an order it
// does not state, the GEMV is also checked bit for bit below.
Check check_indexer_projections(const StepShape& s, const HostWeights& w, const HostStepInputs& in, const char* kernel,
                                const StepOutputs& gpu) {
  const reference::IndexerProjectionsHost exact = reference_indexer_project(s, w, gpu.q_c, in.hidden);
  const IndexerProjections& p = gpu.indexer_projections;
  const ProjectionError q = projection_error(p.index_q, exact.index_q, DType::kBF16);
  const ProjectionError k = projection_error(p.index_k, exact.index_k, DType::kBF16);
  const ProjectionError weights = projection_error(p.head_weights, exact.head_weights, DType::kF32);
  const ProjectionError gate = projection_error(p.gate, exact.gate, DType::kBF16);
  const size_t outside = q.outside + k.outside + weights.outside + gate.outside;
  return judged(std::string("indexer projections (") + kernel + ") vs float64 reference", outside == 0,
                format("worst |error| / tolerance: index_q %.3g, index_k %.3g, head_weights %.3g, gate %.3g (%zu "
                       "values outside; tolerance %.0e x sum |products|, + 1 BF16 ulp for the BF16 outputs), on the "
                       "GPU's q_c",
                       q.worst, k.worst, weights.worst, gate.worst, outside, reference::kProjectionSumTolerance));
}

// indexer_project_gemv's fixed order, reproduced bit for bit by its CPU reference.
Check check_indexer_projections_gemv(const StepShape& s, const HostWeights& w, const HostStepInputs& in,
                                     const StepOutputs& gpu) {
  const reference::IndexerProjectionBitsHost cpu = reference_indexer_project_gemv(s, w, gpu.q_c, in.hidden);
  const IndexerProjections& p = gpu.indexer_projections;
  const size_t bf16_differing = bf16_difference(p.index_q, cpu.index_q).differing +
                                bf16_difference(p.index_k, cpu.index_k).differing +
                                bf16_difference(p.gate, cpu.gate).differing;
  const bool weights_equal =
      p.head_weights.size() == cpu.head_weights.size() &&
      std::memcmp(p.head_weights.data(), cpu.head_weights.data(), sizeof(float) * cpu.head_weights.size()) == 0;
  return judged(
      "indexer projections (GEMV) vs CPU reference", bf16_differing == 0 && weights_equal,
      format("bitwise: %zu BF16 values of index_q, index_k and gate differ; head_weights %s; on the GPU's q_c",
             bf16_differing, weights_equal ? "equal" : "differ"));
}

// A head_gemv output against its CPU reference, bitwise; `values` and `step`
// name the output's type and its unit of difference, `input` what it was fed.
Check head_gemv_check(const char* name, const Difference& d, size_t count, const char* values, const char* step,
                      HeadGemvTactic tactic, const char* input) {
  return judged(name, d.differing == 0,
                format("bitwise: %zu of %zu %s values differ (first at %zu, max %lld %s); tactic %d/%d, on the GPU's %s",
                       d.differing, count, values, d.first_index, static_cast<long long>(d.max_steps), step,
                       tactic.tile, tactic.rows_per_thread, input));
}

// A head_gemv output under the tensor-core sums against the contract's bound.
Check head_gemv_bound_check(const char* name, const reference::HeadGemvDeviation& d, const char* values,
                            const char* step, const char* input) {
  return judged(name, d.outside == 0,
                format("tensor-core sums: %lld of %lld %s values outside the bound (2^-14 x sum |products|); %lld "
                       "differ from the rounding of the exact sum, by at most %d %s; on the GPU's %s",
                       static_cast<long long>(d.outside), static_cast<long long>(d.compared), values,
                       static_cast<long long>(d.differing), d.max_steps, step, input));
}

Check check_absorb(const StepShape& s, const HostWeights& w, const StepOutputs& gpu) {
  if (s.head_gemv_sums == HeadGemvSums::kTensorCores) {
    return head_gemv_bound_check("absorb q_fp8 (tensor cores) vs float64 reference",
                                 absorb_deviation(s, w, gpu.q, gpu.q_fp8_fused), "FP8", "steps", "q");
  }
  const HeadGemvTactic tactic = absorb_tactic(s);
  const std::vector<uint8_t> cpu = reference_absorb(s, w, gpu.q, tactic);
  return head_gemv_check("absorb q_fp8 vs CPU reference", fp8_difference(gpu.q_fp8_fused, cpu), cpu.size(), "FP8",
                         "steps", tactic, "q");
}

// Bitwise when the fused path ran head_gemv; cuBLAS's bmm sums in another
// order than the reference (head_gemv's), so it is held to the tolerance.
Check check_value_up(const StepShape& s, const HostWeights& w, ValueUpKernel kernel, const StepOutputs& gpu) {
  const HeadGemvTactic tactic = value_up_tactic(s);
  const std::vector<uint16_t> cpu = reference_value_up(s, w, gpu.latent_fused, tactic);
  if (kernel == ValueUpKernel::kCublasBmm) {
    return cublas_check("value_up out (cuBLAS bmm, m not in --value-up-tokens) vs CPU reference",
                        bf16_error_in_scale_ulps(gpu.out_fused, cpu), "latent");
  }
  if (s.head_gemv_sums == HeadGemvSums::kTensorCores) {
    return head_gemv_bound_check("value_up out (head_gemv, tensor cores) vs float64 reference",
                                 value_up_deviation(s, w, gpu.latent_fused, gpu.out_fused), "BF16", "ulp", "latent");
  }
  return head_gemv_check("value_up out (head_gemv) vs CPU reference", bf16_difference(gpu.out_fused, cpu), cpu.size(),
                         "BF16", "ulp", tactic, "latent");
}

// Elements that differ between two outputs of the same shape (a size
// mismatch counts every element), and the first that does.
struct Mismatches {
  size_t count = 0, first = 0;
};

template <class T>
Mismatches count_mismatches(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return Mismatches{std::max(got.size(), want.size()), 0};
  Mismatches d;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    if (d.count == 0) d.first = i;
    ++d.count;
  }
  return d;
}

// The indexer on the CPU from the same history, the GPU's projections and
// the step's positions: the state after the prefill and the step, and the
// step's rows.
struct IndexerReference {
  IndexerHostState state;
  reference::IndexerRowsHost rows;
  GpuIndexerLogits logits;  // under FP32-accumulated logits: the GPU's, judged against the exact ones
  int64_t errors = 0;  // untrusted block table entries met by the prefill and the step
  double ms = 0;       // CPU time
};

Status run_indexer_reference(const StepShape& s, const HostWeights& w, const IndexerProjections& projections,
                             const HostStepInputs& in, const IndexerTokenRows& history,
                             const std::vector<float>& gpu_logits, IndexerReference* cpu) {
  const auto start = std::chrono::steady_clock::now();
  cpu->state = make_indexer_state(s);
  int64_t prefill_errors = 0;
  DSA_RETURN_IF_ERROR(reference_indexer_prefill(s, w, history, &cpu->state, &prefill_errors));
  cpu->logits.logits = &gpu_logits;
  DSA_RETURN_IF_ERROR(
      reference_indexer_step(s, w, projections, in, &cpu->state, &cpu->rows, &cpu->errors, &cpu->logits));
  cpu->errors += prefill_errors;
  cpu->ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return Status();
}

// Every step of the indexer is bit-exact (the select's head dots are exact),
// so the slots must be equal bit for bit.
Check check_indexer_rows(const StepShape& s, const IndexerReference& cpu, const StepOutputs& gpu) {
  const Mismatches d = count_mismatches(gpu.topk_slots_fused, cpu.rows.slots);
  const bool pass = d.count == 0 && gpu.indexer_state_errors == 0 && gpu.indexer_select_errors_fused == 0 &&
                    cpu.errors == 0;
  const int64_t last_context = s.context + s.m;
  const bool own_logits = s.indexer_logits == IndexerLogits::kFp32Accumulation;
  return judged(
      own_logits ? "indexer slots (select) vs CPU selection over the GPU's logits"
                 : "indexer slots (select) vs CPU reference",
      pass,
      format("bitwise: %zu of %zu slots differ (first: token %zu, column %zu); %d indexer request(s), up "
             "to %lld pools scored; error counters: prefill and prepare %u, select %u, CPU %lld; CPU "
             "prefill and step %.0f ms",
             d.count, cpu.rows.slots.size(), d.first / kTopKWidth, d.first % kTopKWidth, s.indexer_requests(),
             static_cast<long long>(last_context > kIndexerPooledColumns ? last_context / kIndexerPoolSize : 0),
             gpu.indexer_state_errors, gpu.indexer_select_errors_fused, static_cast<long long>(cpu.errors), cpu.ms));
}

// What the GPU prefill and prepare left: the whole ring and every K cache
// page, unwritten entries included.
// Under FP32-accumulated logits, the GPU's logits of every scored pool
// against the exact ones, within reference::indexer_logit_bounds.
Check check_indexer_logits(const IndexerReference& cpu) {
  const GpuIndexerLogits& l = cpu.logits;
  return judged("indexer logits (FP32 accumulation) vs exact", l.outside == 0,
                format("%lld of %lld pools outside their bound (reference::indexer_logit_bounds); worst |error| / "
                       "bound %.3g",
                       static_cast<long long>(l.outside), static_cast<long long>(l.scored), l.worst));
}

Check check_indexer_state(const IndexerReference& cpu, const StepOutputs& gpu) {
  const Mismatches ring = count_mismatches(gpu.indexer_ring, cpu.state.ring);
  const Mismatches pages = count_mismatches(gpu.indexer_k_cache, cpu.state.k_cache);
  return judged("indexer state (prefill + prepare) vs CPU reference", ring.count == 0 && pages.count == 0,
                format("bitwise: ring %zu of %zu BF16 values differ, K cache %zu of %zu bytes differ (first in page "
                       "%lld)",
                       ring.count, cpu.state.ring.size(), pages.count, cpu.state.k_cache.size(),
                       static_cast<long long>(pages.first / kIndexerPageBytes)));
}

// The baseline's CUB sort must select the same pools as the radix select.
Check check_indexer_fused_vs_stock(const StepOutputs& gpu) {
  const Mismatches d = count_mismatches(gpu.topk_slots_stock, gpu.topk_slots_fused);
  return judged("indexer slots fused vs stock (select baseline)", d.count == 0 && gpu.indexer_select_errors_stock == 0,
                format("bitwise: %zu of %zu slots differ (first: token %zu, column %zu); the baseline's error counter "
                       "%u",
                       d.count, gpu.topk_slots_fused.size(), d.first / kTopKWidth, d.first % kTopKWidth,
                       gpu.indexer_select_errors_stock));
}

// The attention against the float64 reference on the GPU's own q_fp8, cache
// and slots, with the tolerances of its tests (docs/sparse_mla.md).
Check check_attention(const StepShape& s, const HostWeights& w, const StepOutputs& gpu) {
  constexpr double kMaxRelativeFrobenius = 1e-2, kMaxLseError = 1e-3;
  const reference::SparseMlaResult cpu = reference_attention(s, w, gpu.q_fp8_fused, gpu.cache_fused, s.cache_blocks(),
                                                             kCacheBlockSize, gpu.topk_slots_fused);
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
// checks what they wrote; the indexer's CPU reference prefills from the same
// `indexer_history`. Each check is printed as soon as it is known.
Status run_checks(const StepShape& s, const HostWeights& w, const HostStepInputs& in,
                  const IndexerTokenRows& indexer_history, const HostCache& initial_cache, ValueUpKernel value_up,
                  bool projections_cublaslt, const DeviceStep& step, const std::vector<Kernel>& kernels,
                  cudaStream_t stream, std::vector<Check>* checks) {
  StepOutputs after_fused, after_both;
  DSA_RETURN_IF_ERROR(run_chain(step, kernels, kFusedChain, stream, 0));
  DSA_RETURN_IF_ERROR(step.download(stream, &after_fused));
  DSA_RETURN_IF_ERROR(run_chain(step, kernels, kStockChain, stream, 0));
  DSA_RETURN_IF_ERROR(step.download(stream, &after_both));
  IndexerReference indexer;
  DSA_RETURN_IF_ERROR(run_indexer_reference(s, w, after_fused.indexer_projections, in, indexer_history,
                                            after_fused.indexer_logits, &indexer));

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
  add(check_indexer_projections(s, w, in, projections_cublaslt ? "cuBLASLt" : "GEMV", after_fused));
  if (!projections_cublaslt) add(check_indexer_projections_gemv(s, w, in, after_fused));
  add(check_indexer_state(indexer, after_fused));
  if (s.indexer_logits == IndexerLogits::kFp32Accumulation) add(check_indexer_logits(indexer));
  add(check_indexer_rows(s, indexer, after_fused));
  add(check_attention(s, w, after_fused));
  add(check_value_up(s, w, value_up, after_fused));
  add(check_cache_fused_vs_stock(s, after_both));
  add(check_q_fp8_fused_vs_stock(after_both));
  add(check_indexer_fused_vs_stock(after_both));
  add(report_attention_fused_vs_stock(after_both));
  add(report_value_up_fused_vs_stock(after_both));
  add(report_saturation(s, after_both));
  return Status();
}

// ---------------------------------------------------------------- timing

// Copies of every weight: enough that the smallest of the large ones (W_UK_T,
// W_UV or the indexer's wq_b, not split by TP; q_b_proj is larger) rotates
// through more than twice the L2. The small ones rotate with them: the
// norm's 4 KB of gammas (alone, the norm still finds them in L2, in the
// chains the other weights' traffic evicts them) and the indexer's wk,
// weights_proj and compress_gate (2.3 MB a copy at D = 4096, read in the same
// launch as wq_b).
int weight_copies(const bench::Context& ctx, const StepShape& s) {
  const size_t smallest = 2 * std::min({size_t(s.q_width()) * s.Q, size_t(s.H) * s.P * s.L, size_t(s.H) * s.L * s.V,
                                        size_t(kIndexerHeads) * kIndexerDim * s.Q});
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
  (*timings)[first + kFusedIndexerSelect].baseline = first + kStockIndexerSelect;
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
  std::printf(
      "attention: sparse_mla over the glm5next indexer's slots (indexer_project of q_c and synthetic hidden "
      "states, indexer_prepare, indexer_select; stock: indexer_select_baseline, a CUB sort), its state "
      "prefilled with drawn rows of the context; no stock Hopper kernel takes this cache format, so the "
      "stock chain runs the same sparse_mla after its counter memset\n");
  bench::CublasHandle cublas;
  DSA_RETURN_IF_ERROR(cublas.create(ctx.stream));

  const HostWeights weights = make_weights(s, options.seed);
  const HostStepInputs inputs = make_step_inputs(s, options.seed);
  const IndexerTokenRows indexer_history = make_indexer_history(s, options.seed);
  const HostCache cache = make_cache(s, weights, options.seed, 0, s.cache_blocks());
  const int copies = weight_copies(ctx, s);
  const ValueUpChoice value_up = choose_value_up(options, s.H, s.m);
  DeviceStep step;
  DSA_RETURN_IF_ERROR(step.init(s, weights, inputs, indexer_history, cache, copies, value_up.kernel,
                                options.projections_cublaslt, cublas.get(), ctx.stream));
  std::printf("synthetic layer (seed %llu), %d weight copies; KV cache [%lld, %d, %d] FP8 e4m3, new tokens at slots "
              "%lld..%lld\n",
              static_cast<unsigned long long>(options.seed), copies, static_cast<long long>(s.cache_blocks()),
              kCacheBlockSize, s.L, static_cast<long long>(s.context), static_cast<long long>(s.context + s.m - 1));
  std::printf("%s\n", s.describe_indexer().c_str());
  std::printf("value_up in the fused path: %s; %s\n", value_up_kernel_name(value_up.kernel), value_up.reason.c_str());
  std::printf("head_gemv sums in the fused path: %s\n",
              s.head_gemv_sums == HeadGemvSums::kTensorCores ? "tensor cores (opt-in)" : "seed order");
  std::printf("sparse attention's split plan (both paths): %s\n", options.attention_splits.c_str());
  std::printf("indexer logits (both paths' selects): %s\n",
              s.indexer_logits == IndexerLogits::kExact ? "exact" : "FP32 accumulation");
  std::printf("indexer projections (both paths): %s\n",
              options.projections_cublaslt ? "indexer_project (cuBLASLt)" : "indexer_project_gemv");

  const std::vector<Kernel> kernels = make_kernels(s, value_up.kernel, options.projections_cublaslt);
  report->gpu = ctx.gpu_name;
  report->commit = ctx.commit;
  report->date = ctx.date;
  report->copy_GBps = ctx.copy_GBps;
  report->shape = s;
  report->steps = options.steps;
  report->weight_copies = copies;
  report->value_up_kernel = value_up_kernel_name(value_up.kernel);
  report->value_up_reason = value_up.reason;
  report->indexer_projections_kernel = options.projections_cublaslt ? "indexer_project" : "indexer_project_gemv";
  report->indexer_logits = s.indexer_logits == IndexerLogits::kExact ? "exact" : "fp32_accumulation";
  report->head_gemv_sums = s.head_gemv_sums == HeadGemvSums::kTensorCores ? "tensor_cores" : "seed_order";
  report->attention_splits = options.attention_splits;
  DSA_RETURN_IF_ERROR(run_checks(s, weights, inputs, indexer_history, cache, value_up.kernel,
                                 options.projections_cublaslt, step, kernels, ctx.stream, &report->checks));
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
