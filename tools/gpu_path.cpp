#include "gpu_path.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "checkpoint.h"
#include "compare.h"
#include "device_layer.h"
#include "dsa_decode/choices.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/stage.h"
#include "timing.h"
#include "device_buffers.h"
#include "html_report.h"
#include "kernel_trace.h"
#include "linear/linear_reference.h"
#include "reference_chain.h"
#include "report.h"

namespace dsa::cli {

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
// Launches per graph at the least: the graph launch's own overhead is spread
// over them (as in dsa-bench).
constexpr int kMinLaunchesPerGraph = 20;
constexpr int kPoisonByte = 0xFF;  // BF16 0xFFFF, e4m3 0xFF and FP32 0xFFFFFFFF are NaN: an unwritten output fails
// Top-k rows: 0x7F7F7F7F is a slot past any cache (0xFF.. would read as -1,
// a valid "none"), so an unwritten row fails its check and the attention's.
constexpr int kPoisonSlotByte = 0x7F;

// The stage's first and last step in both paths (include/dsa_decode/stage.h),
// each as linear_gemv or cuBLASLt: the attention half is every step between them.
constexpr const char* kFirstProjection = "qkv_a_proj";
constexpr const char* kLastProjection = "o_proj";

using Stages = std::vector<std::unique_ptr<DsaAttentionStage>>;

// The stage's name of a projection's step ("qkv_a_proj", "q_b_proj" or
// "o_proj") run as linear_gemv or through cuBLASLt (plan.projection_gemv_tokens).
std::string projection_step(const char* projection, bool gemv) {
  return std::string(projection) + (gemv ? " (GEMV)" : " (cuBLASLt)");
}

// Whether a path's steps `names` run `projection` as linear_gemv.
bool runs_gemv(const std::vector<std::string>& names, const char* projection) {
  return std::count(names.begin(), names.end(), projection_step(projection, true)) > 0;
}

const char* kernel_name(bool gemv) { return gemv ? "GEMV" : "cuBLASLt"; }

// ---------------------------------------------------------------- the stage's steps

// What each step must move at the least (the memory floor's bytes), from the
// step's shapes.
struct StepBytes {
  double qkv_a_proj, norm, q_b_proj, absorb, project, prepare, select, stock_select, attention, value_up, o_proj,
      cache_write, absorb_bmm, fp8_quant, counters;
};

StepBytes step_bytes(const StepShape& s) {
  const double m = s.m, D = s.D, H = s.H, Q = s.Q, L = s.L, P = s.P, V = s.V;
  const double bf16 = 2, fp8 = 1;
  const double w_uk = bf16 * H * P * L, q = bf16 * m * H * P;
  StepBytes b{};
  b.cache_write = bf16 * m * L + fp8 * m * L;  // kv_c read, the new entries written
  // The projections, linear_gemv or cuBLASLt alike: weights, input read, output written.
  // qkv_a_proj: hidden read, qkv written.
  b.qkv_a_proj = bf16 * (Q + L) * D + bf16 * m * D + bf16 * m * (Q + L);
  b.norm = bf16 * (2 * m * (Q + L) + (Q + L));
  b.q_b_proj = bf16 * H * P * Q + bf16 * m * Q + q;
  b.absorb = w_uk + q + fp8 * m * H * L + b.cache_write;
  // q, the index rows, every token's own cache rows (no sharing assumed), latent and lse.
  const double W = s.top_k_width(), HI = s.index_heads, S = s.index_pool, K = s.index_topk;
  b.attention = fp8 * m * H * L + 4.0 * m * W + fp8 * m * K * L + bf16 * m * H * L + 4.0 * m * H;
  b.counters = 4.0 * sparse_mla_split_counter_count(s.m, s.H, s.top_k_width());
  // The indexer. A token at position p % S == S - 1 completes pool p / S; a token
  // of L > K scores pools 0..L/S-1, all tokens on the same pages, so at the
  // least each pool up to the last token's is read once. Its K cache is not
  // rotated (prepare writes it; every copy would need the same writes): alone,
  // the select finds it in L2, as the attention finds its cache rows; in the
  // chains the rotated weights stream through L2 between two selects.
  const double index_row = bf16 * m * kIndexerDim;  // index_k or gate [m, 128], or their ring rows
  // The projections: their weights (wq_b [HI * 128, Q]; wk, compress_gate [128, D]; weights_proj [HI, D]), q_c
  // and x read once, index_q, index_k, gate and head_weights written.
  const double index_q = bf16 * m * HI * kIndexerDim;
  b.project = bf16 * (HI * kIndexerDim * Q + (2.0 * kIndexerDim + HI) * D) + bf16 * m * (Q + D) + index_q +
              2 * index_row + 4.0 * m * HI;
  const double q_fp8_and_weights = fp8 * m * HI * kIndexerDim + 4.0 * m * HI;
  const int64_t last_context = s.context + s.m;
  const double pools_completed = double(last_context / s.index_pool - s.context / s.index_pool);
  const double pools_scored = last_context > s.index_topk ? double(last_context / s.index_pool) : 0;
  // index_q, index_k, gate, head_weights, the parameters, positions and
  // requests; q_fp8, folded weights and ring rows written; per completed pool
  // the S - 1 earlier tokens' ring rows read and the pool written.
  b.prepare = index_q + 2 * index_row + 4.0 * m * HI + 4.0 * (2 + S) * kIndexerDim + 12.0 * m + q_fp8_and_weights +
              2 * index_row + pools_completed * ((S - 1) * 2 * bf16 * kIndexerDim + kIndexerPoolBytes);
  // q_fp8 and folded weights, positions and requests, the pools scored, the rows of slots written.
  const double top_k_rows = 4.0 * m * W;
  b.select = q_fp8_and_weights + 12.0 * m + pools_scored * kIndexerPoolBytes + top_k_rows;
  b.stock_select = b.select + top_k_rows;  // the request-local positions too
  b.value_up = bf16 * H * L * V + bf16 * m * H * L + bf16 * m * H * V;
  b.o_proj = bf16 * D * H * V + bf16 * m * H * V + bf16 * m * D;
  b.absorb_bmm = w_uk + q + bf16 * m * H * L;
  b.fp8_quant = bf16 * m * H * L + fp8 * m * H * L;
  return b;
}

// One step of a path as the report shows it: its JSON row name, its label,
// "shared" (both paths run it on the same inputs: timed once), "fused" or
// "stock", and its bytes.
struct StepRow {
  std::string name, label, path;
  double bytes = 0;
};

// Each path's steps for the step's arguments (DsaAttentionStage::step_names)
// and their rows (describe_step), one per step.
struct PathSteps {
  std::vector<std::string> fused, stock;
  std::vector<StepRow> fused_rows, stock_rows;

  const std::vector<std::string>& names(DsaPath path) const { return path == DsaPath::kFused ? fused : stock; }
  const std::vector<StepRow>& rows(DsaPath path) const { return path == DsaPath::kFused ? fused_rows : stock_rows; }
};

// The row of the stage's step `step` (a name from step_names) in `path` of
// `steps`. A step this program does not know is an error: the stage changed,
// and the table would otherwise mislabel it.
Status describe_step(const StepShape& s, const PathSteps& steps, DsaPath path, const std::string& step, StepRow* row) {
  const StepBytes b = step_bytes(s);
  const bool fused = path == DsaPath::kFused;
  const bool tensor_cores = s.head_gemv_sums == HeadGemvSums::kTensorCores;
  const auto set = [&](std::string name, std::string label, const char* where, double bytes) {
    *row = StepRow{std::move(name), std::move(label), where, bytes};
    return Status();
  };
  // The projections: one row where both paths run the same kernel (qkv_a_proj
  // always; q_b_proj and o_proj where the fused path's are cuBLASLt's too),
  // else one per path, the fused one's measured against the stock one's.
  const std::vector<std::string>& other_path = fused ? steps.stock : steps.fused;
  for (const auto& [projection, bytes] : {std::pair{kFirstProjection, b.qkv_a_proj}, std::pair{"q_b_proj", b.q_b_proj},
                                          std::pair{kLastProjection, b.o_proj}}) {
    for (const bool gemv : {true, false}) {
      if (step != projection_step(projection, gemv)) continue;
      const std::string name = std::string(projection) + (gemv ? "_gemv" : "");
      const std::string label = std::string(projection) + (gemv ? " (GEMV, one launch)" : " (cuBLASLt GEMM)");
      if (std::count(other_path.begin(), other_path.end(), step) > 0) return set(name, label, "shared", bytes);
      return fused ? set(name, label, "fused", bytes) : set("stock_" + name, label, "stock", bytes);
    }
  }
  if (step == "norm") return set("norm", "norm (q and kv RMSNorm, one launch)", "shared", b.norm);
  if (step == "indexer projections (GEMV)") {
    return set("indexer_project_gemv", "indexer projections (GEMV, one launch)", "shared", b.project);
  }
  if (step == "indexer projections (cuBLASLt)") {
    return set("indexer_project", "indexer projections (cuBLASLt, 4 GEMMs)", "shared", b.project);
  }
  if (step == "indexer prepare") {
    return set("indexer_prepare", "indexer prepare (k norm, q quant, pools)", "shared", b.prepare);
  }
  if (fused && step == "absorb + cache write (head_gemv)") {
    return set("absorb",
               tensor_cores ? "absorb + FP8 quant + cache write (head_gemv TC)"
                            : "absorb + FP8 quant + cache write (head_gemv)",
               "fused", b.absorb);
  }
  if (fused && step == "indexer select") {
    return set("indexer_select",
               s.indexer_logits == IndexerLogits::kExact ? "indexer select (logits, top-512, slots)"
                                                         : "indexer select (FP32-acc. logits, top-512, slots)",
               "fused", b.select);
  }
  if (step == "attention (sparse_mla)") {
    return fused ? set("attention", "sparse attention (sparse_mla)", "fused", b.attention)
                 : set("stock_attention", "sparse attention (sparse_mla, stock inputs)", "stock", b.attention);
  }
  if (fused && step == "value_up (head_gemv)") {
    return set("value_up", tensor_cores ? "value_up (head_gemv TC)" : "value_up (head_gemv)", "fused", b.value_up);
  }
  if (step == "value_up (cuBLAS bmm)") {
    return fused ? set("value_up_bmm", "value_up (cuBLAS bmm, m not in --value-up-tokens)", "fused", b.value_up)
                 : set("stock_value_up_bmm", "value_up bmm (cuBLAS)", "stock", b.value_up);
  }
  if (!fused && step == "indexer select (top-k positions kept)") {
    return set("stock_indexer_select", "indexer select (top-k positions kept)", "stock", b.stock_select);
  }
  if (!fused && step == "cache write (concat_and_cache_mla)") {
    return set("stock_cache_write", "concat_and_cache_mla", "stock", b.cache_write);
  }
  if (!fused && step == "absorb (cuBLAS bmm)")
    return set("stock_absorb_bmm", "absorb bmm (cuBLAS)", "stock", b.absorb_bmm);
  if (!fused && step == "static FP8 quant") return set("stock_fp8_quant", "static FP8 quant", "stock", b.fp8_quant);
  if (!fused && step == "split counter memset") {
    return set("stock_counter_memset", "split counters memset", "stock", b.counters);
  }
  return unsupported(std::string("dsa-decode does not know the stage's ") + (fused ? "fused" : "stock") + " step '" +
                     step + "' (the stage changed: tools/gpu_path.cpp describe_step)");
}

// Each path's steps, checked to begin with qkv_a_proj and end with o_proj
// (either kernel), as the attention half's range assumes, and described
// (each a step this program knows: before the checks, which take minutes,
// rather than at the timings).
Status path_steps(const StepShape& s, const DsaAttentionStage& stage, const DeviceLayer& layer, PathSteps* steps) {
  const auto starts_with = [](const std::string& name, const char* projection) {
    return name.rfind(std::string(projection) + " (", 0) == 0;
  };
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    std::vector<std::string>& names = path == DsaPath::kFused ? steps->fused : steps->stock;
    DSA_RETURN_IF_ERROR(stage.step_names(path, layer.step_args(path), &names));
    if (names.size() < 3 || !starts_with(names.front(), kFirstProjection) ||
        !starts_with(names.back(), kLastProjection)) {
      return unsupported(std::string("the stage's ") + (path == DsaPath::kFused ? "fused" : "stock") +
                         " path should run " + kFirstProjection + " first and " + kLastProjection + " last; it runs '" +
                         (names.empty() ? "" : names.front()) + "' .. '" + (names.empty() ? "" : names.back()) + "'");
    }
  }
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    std::vector<StepRow>& rows = path == DsaPath::kFused ? steps->fused_rows : steps->stock_rows;
    for (const std::string& name : steps->names(path)) {
      rows.emplace_back();
      DSA_RETURN_IF_ERROR(describe_step(s, *steps, path, name, &rows.back()));
    }
  }
  return Status();
}

// Which value-up the fused path runs (its step before o_proj).
ValueUpKernel fused_value_up_kernel(const PathSteps& steps) {
  return steps.fused[steps.fused.size() - 2] == "value_up (head_gemv)" ? ValueUpKernel::kHeadGemv
                                                                       : ValueUpKernel::kCublasBmm;
}

// ---------------------------------------------------------------- one run of a path

// What one path's run left, read back: the stage's intermediates
// (DsaStageIntermediates) and the caller's buffers.
struct PathOutputs {
  std::vector<uint16_t> qkv;             // [m, Q + L] BF16: qkv_a_proj's output
  std::vector<uint16_t> q_c;             // [m, Q] BF16
  std::vector<uint16_t> kv_c;            // [m, L] BF16
  std::vector<uint16_t> q;               // [m, H, P] BF16
  std::vector<uint8_t> q_fp8;            // [m, H, L] e4m3
  IndexerProjections indexer_projections;  // the stage's index_q, index_k, head_weights and gate
  std::vector<float> index_logits;         // [m, ceil(max_context / 4)] f32: the fused select's, FP32-accumulated only
  std::vector<int32_t> slots;            // [m, top_k_width()] int32 global KV slots
  std::vector<uint16_t> latent;          // [m, H, L] BF16
  std::vector<float> lse;                // [m, H] f32
  std::vector<uint16_t> heads;           // [m, H, V] BF16: value-up's output
  std::vector<uint16_t> out;             // [m, D] BF16: o_proj's output, the step's
  std::vector<uint8_t> cache;            // [blocks, 256, L] e4m3: the path's whole KV cache
  std::vector<uint16_t> indexer_ring;    // [indexer requests, 2, indexer_ring(), 128] BF16
  std::vector<uint8_t> indexer_k_cache;  // [cache blocks, indexer_page_bytes()]
  unsigned int errors = 0;               // the path's error counter: untrusted values this run met
};

size_t view_bytes(const TensorView& v) { return size_t(v.numel()) * dtype_size(v.dtype); }

template <class T>
Status download_view(const TensorView& v, cudaStream_t stream, std::vector<T>* host) {
  host->resize(view_bytes(v) / sizeof(T));
  DSA_CUDA_RETURN(cudaMemcpyAsync(host->data(), v.data, view_bytes(v), cudaMemcpyDeviceToHost, stream));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  return Status();
}

Status poison(const TensorView& v, int byte, cudaStream_t stream) {
  DSA_CUDA_RETURN(cudaMemsetAsync(v.data, byte, view_bytes(v), stream));
  return Status();
}

// An error counter (DsaStepArgs::error_count) as a one-element view: 4 bytes, as an unsigned int.
TensorView counter_view(unsigned int* counter) { return make_tensor(counter, DType::kI32, {1}); }

Status download_count(unsigned int* counter, cudaStream_t stream, unsigned int* count) {
  std::vector<unsigned int> host;
  DSA_RETURN_IF_ERROR(download_view(counter_view(counter), stream, &host));
  *count = host[0];
  return Status();
}

// Poisons the stage's intermediates and the output (an output the path does
// not write fails its check), zeroes the path's error counter (its count is
// this run's), runs the path once on stage 0, reads back; the fused select's
// logits under FP32-accumulated logits only (the one case whose check reads
// them).
Status run_path(DsaAttentionStage& stage, const DeviceLayer& layer, DsaPath path, int m, cudaStream_t stream,
                PathOutputs* out) {
  const DsaStageIntermediates v = stage.intermediates(m);
  const DsaStepArgs args = layer.step_args(path);
  for (const TensorView* view : {&v.qkv, &v.q_c, &v.kv_c, &v.q, &v.q_fp8, &v.index_q, &v.index_k, &v.head_weights,
                                 &v.gate, &v.index_logits, &v.latent, &v.lse, &v.heads, &args.out}) {
    DSA_RETURN_IF_ERROR(poison(*view, kPoisonByte, stream));
  }
  DSA_RETURN_IF_ERROR(poison(v.slots, kPoisonSlotByte, stream));
  DSA_RETURN_IF_ERROR(poison(counter_view(args.error_count), 0, stream));
  DSA_RETURN_IF_ERROR(path == DsaPath::kFused ? stage.forward(args, stream) : stage.stock_forward(args, stream));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaGetLastError());
  DSA_RETURN_IF_ERROR(download_view(v.qkv, stream, &out->qkv));
  DSA_RETURN_IF_ERROR(download_view(v.q_c, stream, &out->q_c));
  DSA_RETURN_IF_ERROR(download_view(v.kv_c, stream, &out->kv_c));
  DSA_RETURN_IF_ERROR(download_view(v.q, stream, &out->q));
  DSA_RETURN_IF_ERROR(download_view(v.q_fp8, stream, &out->q_fp8));
  DSA_RETURN_IF_ERROR(download_view(v.index_q, stream, &out->indexer_projections.index_q));
  DSA_RETURN_IF_ERROR(download_view(v.index_k, stream, &out->indexer_projections.index_k));
  DSA_RETURN_IF_ERROR(download_view(v.head_weights, stream, &out->indexer_projections.head_weights));
  DSA_RETURN_IF_ERROR(download_view(v.gate, stream, &out->indexer_projections.gate));
  if (path == DsaPath::kFused && stage.plan().indexer_logits == IndexerLogits::kFp32Accumulation) {
    DSA_RETURN_IF_ERROR(download_view(v.index_logits, stream, &out->index_logits));
  }
  DSA_RETURN_IF_ERROR(download_view(v.slots, stream, &out->slots));
  DSA_RETURN_IF_ERROR(download_view(v.latent, stream, &out->latent));
  DSA_RETURN_IF_ERROR(download_view(v.lse, stream, &out->lse));
  DSA_RETURN_IF_ERROR(download_view(v.heads, stream, &out->heads));
  DSA_RETURN_IF_ERROR(download_view(args.out, stream, &out->out));
  DSA_RETURN_IF_ERROR(download_view(args.kv_cache, stream, &out->cache));
  DSA_RETURN_IF_ERROR(download_view(args.indexer.ring, stream, &out->indexer_ring));
  DSA_RETURN_IF_ERROR(download_view(args.indexer.k_cache, stream, &out->indexer_k_cache));
  return download_count(args.error_count, stream, &out->errors);
}

// ---------------------------------------------------------------- checks

std::vector<double> bf16_values(const std::vector<uint16_t>& bits) {
  std::vector<double> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = num::bf16_to_float(bits[i]);
  return values;
}

// Whether `error` is within `bound` (false for NaN).
bool within(double error, double bound) { return error <= bound; }

// The tolerances of the stage's own test (src/stage/stage_test.cu): a
// projection (either kernel) and the norm after it against float64 on the
// GPU's input. They hold the GEMV too, whose bitwise reference shares its
// mapping of the operands: a wrong mapping fails these.
constexpr double kQkvNormTolerance = 1e-2;  // q_c, kv_c: qkv_a_proj's BF16 output, then the norm's
constexpr double kProductTolerance = 4e-3;  // o_proj's output
// The stock path's outputs against the fused path's: its q_fp8 differs in a
// few codes by one step, which the attention carries into latent and out.
constexpr double kFusedVsStockTolerance = 2e-2;

Check check_qkv_a_proj_norm(const StepShape& s, const HostWeights& w, const HostStepInputs& in, bool gemv,
                            const PathOutputs& gpu) {
  const ExactNormOutputs exact = exact_qkv_a_proj_norm(s, w, in.hidden);
  const double q = reference::relative_frobenius(gpu.q_c, exact.q_c),
               kv = reference::relative_frobenius(gpu.kv_c, exact.kv_c);
  return judged(std::string("qkv_a_proj (") + kernel_name(gemv) + ") + norm vs float64",
                within(q, kQkvNormTolerance) && within(kv, kQkvNormTolerance),
                format("relative Frobenius error q_c %.2e, kv_c %.2e (tolerance %.0e): float64 hidden x "
                       "fused_qkv_a_proj^T, BF16-rounded, RMSNorm",
                       q, kv, kQkvNormTolerance));
}

Check check_norm(const StepShape& s, const HostWeights& w, const PathOutputs& gpu) {
  const NormOutputs cpu = reference_norm(s, w, gpu.qkv);
  const Difference q = bf16_difference(gpu.q_c, cpu.q_c), kv = bf16_difference(gpu.kv_c, cpu.kv_c);
  const int64_t worst = std::max(q.max_steps, kv.max_steps);
  return judged("norm vs CPU reference", worst <= 1,
                format("max %lld BF16 ulp (tolerance 1: rsqrt.approx); q_c %zu of %zu values differ, kv_c %zu of %zu; "
                       "on the GPU's qkv",
                       static_cast<long long>(worst), q.differing, cpu.q_c.size(), kv.differing, cpu.kv_c.size()));
}

// A product (cuBLAS's, or the GEMV's lanes) against a CPU reference that sums
// in another order: BF16 outputs within this many BF16 ulps at the values'
// scale (bf16_error_in_scale_ulps). Not bitwise, but it catches a wrong GEMM
// mapping (transposed operands give errors of the values' own size, hundreds
// of ulps), which the later checks, fed with the GPU's own outputs, would not see.
constexpr double kReorderedToleranceUlps = 2;

// `error` in BF16 ulps at the values' scale of a product fed with the GPU's `input`.
Check reordered_check(const std::string& name, double error, const char* input) {
  return judged(name, error <= kReorderedToleranceUlps,
                format("max error %.2f BF16 ulp at the values' scale (tolerance %.0f; summation order differs), on "
                       "the GPU's %s",
                       error, kReorderedToleranceUlps, input));
}

// `kernel`: "GEMV", "cuBLASLt" or "cuBLASLt, stock path".
Check check_q_b_proj(const StepShape& s, const HostWeights& w, const std::string& kernel, const PathOutputs& gpu) {
  return reordered_check("q_b_proj (" + kernel + ") vs CPU FP32 loop",
                         bf16_error_in_scale_ulps(gpu.q, reference_q_b_proj(s, w, gpu.q_c)), "q_c");
}

// linear_gemv's output `got` [m, n] against reference::linear_gemv of the
// GPU's own input `x` [m, k] and `weight` [n, k], bit for bit: the kernel's
// contract (include/dsa_decode/linear.h) fixes the order of every sum.
Check check_linear_gemv(const char* projection, const std::vector<uint16_t>& got, const std::vector<uint16_t>& x, int m,
                        int64_t k, const std::vector<uint16_t>& weight, int64_t n, const char* input) {
  const std::vector<uint16_t> cpu = reference::linear_gemv(x, m, k, weight, n);
  const Difference d = bf16_difference(got, cpu);
  return judged(std::string(projection) + " (GEMV) vs CPU reference", got.size() == cpu.size() && d.differing == 0,
                format("bitwise: %zu of %zu BF16 values differ (first: token %lld, column %lld; max %lld ulp); on the "
                       "GPU's %s",
                       d.differing, cpu.size(), static_cast<long long>(d.first_index / n),
                       static_cast<long long>(d.first_index % n), static_cast<long long>(d.max_steps), input));
}

// The steps both paths share left the same bits: the stock run's qkv_a_proj,
// norm, the indexer's projections, q_b_proj where both paths run it through
// the same kernel (`same_q_b_proj`), and its indexer prepare run again at the
// fused run's positions (DeviceLayer::step_args says why that leaves the same
// state), or the fused and the stock rows would come from different states
// (and every timed replay from yet another).
Check check_shared_repeat(const PathOutputs& fused, const PathOutputs& stock, bool same_q_b_proj) {
  const IndexerProjections &f = fused.indexer_projections, &b = stock.indexer_projections;
  const bool same_projections =
      f.index_q == b.index_q && f.index_k == b.index_k && f.head_weights == b.head_weights && f.gate == b.gate;
  const bool same = fused.qkv == stock.qkv && fused.q_c == stock.q_c && fused.kv_c == stock.kv_c &&
                    (!same_q_b_proj || fused.q == stock.q) && same_projections &&
                    fused.indexer_ring == stock.indexer_ring && fused.indexer_k_cache == stock.indexer_k_cache;
  const char* q = same_q_b_proj ? ", q" : "";
  return judged(same_q_b_proj ? "qkv_a_proj, norm, q_b_proj and the indexer's projections and prepare repeat"
                              : "qkv_a_proj, norm and the indexer's projections and prepare repeat",
                same,
                same ? format("the fused and the stock run got the same qkv, q_c, kv_c%s and indexer projection bits "
                              "and left the same indexer ring and K cache bytes (prepare run again at the same "
                              "positions)%s",
                              q, same_q_b_proj ? "" : "; q_b_proj runs another kernel in each path")
                     : format("qkv, q_c, kv_c%s, the indexer's projections or its state differ between the fused and "
                              "the stock run: the comparisons below are void",
                              q));
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
// does not state, the GEMV is also checked bit for bit below. On the stage's
// projections.
Check check_indexer_projections(const StepShape& s, const HostWeights& w, const HostStepInputs& in, const char* kernel,
                                const std::vector<uint16_t>& q_c, const IndexerProjections& p) {
  const reference::IndexerProjectionsHost exact = reference_indexer_project(s, w, q_c, in.hidden);
  const ProjectionError q = projection_error(p.index_q, exact.index_q, DType::kBF16);
  const ProjectionError k = projection_error(p.index_k, exact.index_k, DType::kBF16);
  const ProjectionError weights = projection_error(p.head_weights, exact.head_weights, DType::kF32);
  const ProjectionError gate = projection_error(p.gate, exact.gate, DType::kBF16);
  const size_t outside = q.outside + k.outside + weights.outside + gate.outside;
  return judged(std::string("indexer projections (") + kernel + ") vs float64 reference", outside == 0,
                format("worst |error| / tolerance: index_q %.3g, index_k %.3g, head_weights %.3g, gate %.3g; %zu "
                       "values outside (tolerance %.0e x sum |products|, + 1 BF16 ulp for BF16); on the GPU's q_c",
                       q.worst, k.worst, weights.worst, gate.worst, outside, reference::kProjectionSumTolerance));
}

Check check_indexer_projections_gemv(const StepShape& s, const HostWeights& w, const HostStepInputs& in,
                                     const std::vector<uint16_t>& q_c, const IndexerProjections& p) {
  const reference::IndexerProjectionBitsHost cpu = reference_indexer_project_gemv(s, w, q_c, in.hidden);
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

Check check_absorb(const StepShape& s, const HostWeights& w, const PathOutputs& gpu) {
  if (s.head_gemv_sums == HeadGemvSums::kTensorCores) {
    return head_gemv_bound_check("absorb q_fp8 (tensor cores) vs float64 reference",
                                 absorb_deviation(s, w, gpu.q, gpu.q_fp8), "FP8", "steps", "q");
  }
  const HeadGemvTactic tactic = absorb_tactic(s);
  const std::vector<uint8_t> cpu = reference_absorb(s, w, gpu.q, tactic);
  return head_gemv_check("absorb q_fp8 vs CPU reference", fp8_difference(gpu.q_fp8, cpu), cpu.size(), "FP8", "steps",
                         tactic, "q");
}

// Bitwise when the fused path ran head_gemv; cuBLAS's bmm sums in another
// order than the reference (head_gemv's), so it is held to the tolerance.
Check check_value_up(const StepShape& s, const HostWeights& w, ValueUpKernel kernel, const PathOutputs& gpu) {
  const HeadGemvTactic tactic = value_up_tactic(s);
  const std::vector<uint16_t> cpu = reference_value_up(s, w, gpu.latent, tactic);
  if (kernel == ValueUpKernel::kCublasBmm) {
    return reordered_check("value_up heads (cuBLAS bmm, m not in --value-up-tokens) vs CPU reference",
                           bf16_error_in_scale_ulps(gpu.heads, cpu), "latent");
  }
  if (s.head_gemv_sums == HeadGemvSums::kTensorCores) {
    return head_gemv_bound_check("value_up heads (head_gemv, tensor cores) vs float64 reference",
                                 value_up_deviation(s, w, gpu.latent, gpu.heads), "BF16", "ulp", "latent");
  }
  return head_gemv_check("value_up heads (head_gemv) vs CPU reference", bf16_difference(gpu.heads, cpu), cpu.size(),
                         "BF16", "ulp", tactic, "latent");
}

// `kernel`: "GEMV", "cuBLASLt" or "cuBLASLt, stock path".
Check check_o_proj(const StepShape& s, const HostWeights& w, const std::string& kernel, const PathOutputs& gpu) {
  const double error = reference::relative_frobenius(
      gpu.out, reference::exact_product(gpu.heads.data(), s.m, s.H * s.V, w.o_proj.data(), s.D).sum);
  return judged(
      "o_proj (" + kernel + ") vs float64", within(error, kProductTolerance),
      format("out relative Frobenius error %.2e (tolerance %.0e), on the GPU's heads", error, kProductTolerance));
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
  int64_t errors = 0;       // untrusted block table entries met by the prefill and the step
  double ms = 0;            // CPU time
};

// `gpu_logits`: the GPU select's logits under FP32-accumulated logits, else null.
Status run_indexer_reference(const StepShape& s, const HostWeights& w, const IndexerProjections& projections,
                             const HostStepInputs& in, const IndexerTokenRows& history,
                             const std::vector<float>* gpu_logits, IndexerReference* cpu) {
  const auto start = std::chrono::steady_clock::now();
  cpu->state = make_indexer_state(s);
  int64_t prefill_errors = 0;
  DSA_RETURN_IF_ERROR(reference_indexer_prefill(s, w, history, &cpu->state, &prefill_errors));
  cpu->logits.logits = gpu_logits;
  DSA_RETURN_IF_ERROR(
      reference_indexer_step(s, w, projections, in, &cpu->state, &cpu->rows, &cpu->errors, &cpu->logits));
  cpu->errors += prefill_errors;
  cpu->ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return Status();
}

// Every step of the indexer is bit-exact (the select's head dots are exact),
// so the slots must be equal bit for bit.
Check check_indexer_rows(const StepShape& s, const IndexerReference& cpu, const PathOutputs& gpu) {
  const Mismatches d = count_mismatches(gpu.slots, cpu.rows.slots);
  const int64_t last_context = s.context + s.m;
  const bool own_logits = s.indexer_logits == IndexerLogits::kFp32Accumulation;
  return judged(
      own_logits ? "indexer slots (select) vs CPU selection over the GPU's logits"
                 : "indexer slots (select) vs CPU reference",
      d.count == 0 && cpu.errors == 0,
      format("bitwise: %zu of %zu slots differ (first: token %zu, column %zu); %d indexer request(s), up "
             "to %lld pools scored; CPU error count %lld; CPU prefill and step %.0f ms",
             d.count, cpu.rows.slots.size(), d.first / s.top_k_width(), d.first % s.top_k_width(),
             s.indexer_requests(),
             static_cast<long long>(last_context > s.index_topk ? last_context / s.index_pool : 0),
             static_cast<long long>(cpu.errors), cpu.ms));
}

// Under FP32-accumulated logits, the GPU's logits of every scored pool
// against the exact ones, within reference::indexer_logit_bounds.
Check check_indexer_logits(const IndexerReference& cpu) {
  const GpuIndexerLogits& l = cpu.logits;
  return judged("indexer logits (FP32 accumulation) vs exact", l.outside == 0,
                format("%lld of %lld pools outside their bound (reference::indexer_logit_bounds); worst |error| / "
                       "bound %.3g; the stage's select's logits",
                       static_cast<long long>(l.outside), static_cast<long long>(l.scored), l.worst));
}

// What the GPU prefill and prepare left: the whole ring and every K cache
// page, unwritten entries included.
Check check_indexer_state(const StepShape& s, const IndexerReference& cpu, const PathOutputs& gpu) {
  const Mismatches ring = count_mismatches(gpu.indexer_ring, cpu.state.ring);
  const Mismatches pages = count_mismatches(gpu.indexer_k_cache, cpu.state.k_cache);
  return judged("indexer state (prefill + prepare) vs CPU reference", ring.count == 0 && pages.count == 0,
                format("bitwise: ring %zu of %zu BF16 values differ, K cache %zu of %zu bytes differ (first in page "
                       "%lld)",
                       ring.count, cpu.state.ring.size(), pages.count, cpu.state.k_cache.size(),
                       static_cast<long long>(pages.first / s.indexer_page_bytes())));
}

// Both paths run the same select on the same logits: the same slots.
Check check_indexer_fused_vs_stock(const StepShape& s, const PathOutputs& fused, const PathOutputs& stock) {
  const Mismatches d = count_mismatches(stock.slots, fused.slots);
  return judged("indexer slots fused vs stock", d.count == 0,
                format("bitwise: %zu of %zu slots differ (first: token %zu, column %zu)", d.count, fused.slots.size(),
                       d.first / s.top_k_width(), d.first % s.top_k_width()));
}

// The attention against the float64 reference on the GPU's own q_fp8, cache
// and slots, with the tolerances of its tests (docs/sparse_mla.md).
Check check_attention(const StepShape& s, const HostWeights& w, const PathOutputs& gpu) {
  constexpr double kMaxRelativeFrobenius = 1e-2, kMaxLseError = 1e-3;
  const reference::SparseMlaResult cpu =
      reference_attention(s, w, gpu.q_fp8, gpu.cache, s.cache_blocks(), kCacheBlockSize, gpu.slots);
  const double relative = reference::relative_frobenius(gpu.latent, bf16_values(cpu.latent));
  double worst_lse = 0;
  for (size_t i = 0; i < cpu.lse.size(); ++i) {
    const double error = std::fabs(double(gpu.lse[i]) - cpu.lse[i]);
    worst_lse = std::isnan(error) ? error : std::max(worst_lse, error);
  }
  const bool pass = within(relative, kMaxRelativeFrobenius) && within(worst_lse, kMaxLseError) && cpu.out_of_range == 0;
  return judged(
      "sparse attention vs float64 reference", pass,
      format("latent relative Frobenius error %.2e (tolerance %.0e), lse max error %.2e (tolerance %.0e); "
             "out-of-range slots (CPU) %lld",
             relative, kMaxRelativeFrobenius, worst_lse, kMaxLseError, static_cast<long long>(cpu.out_of_range)));
}

// The fused path run twice gives the same bits: it is deterministic, and the
// attention's split counters, which its launches reset themselves (the stock
// path's memset does not run in between), were left zero by the first run.
Check check_fused_repeat(const PathOutputs& first, const PathOutputs& second) {
  const bool same = first.q_fp8 == second.q_fp8 && first.slots == second.slots && first.latent == second.latent &&
                    first.lse == second.lse && first.heads == second.heads && first.out == second.out &&
                    first.cache == second.cache;
  return judged("fused path run twice", same,
                same ? "the same q_fp8, slots, latent, lse, heads, out and KV cache bits (deterministic; the "
                       "attention's self-resetting split counters were left zero)"
                     : "the second run's bits differ: nondeterminism, or split counters left nonzero");
}

// The whole cache, not only the new entries: a stray write anywhere fails it.
Check check_cache_reference(const StepShape& s, const HostWeights& w, const HostStepInputs& in,
                            const HostCache& initial, const PathOutputs& gpu) {
  HostCache expected = initial;
  const int skipped = reference_cache_write(s, w, gpu.kv_c, in.slot_mapping, &expected);
  const Difference d = fp8_difference(gpu.cache, expected.bytes);
  return judged("KV cache (fused write) vs CPU reference", d.differing == 0 && skipped == 0,
                format("bitwise over %zu bytes: %zu differ (first in slot %zu); slots skipped by the CPU write: %d",
                       expected.bytes.size(), d.differing, d.first_index / s.L, skipped));
}

Check check_cache_fused_vs_stock(const StepShape& s, const PathOutputs& fused, const PathOutputs& stock) {
  const Difference d = fp8_difference(fused.cache, stock.cache);
  return judged("KV cache fused vs stock", d.differing == 0,
                format("bitwise over %zu bytes: %zu differ (first in slot %zu)", stock.cache.size(), d.differing,
                       d.first_index / s.L));
}

// With the same q: other summation orders (cuBLAS), same roundings; the
// products differ by rounding noise, which moves an FP8 code by at most one
// step, and only a few (the stage's test: under 5% of the codes). With
// another q (the fused path's q_b_proj ran as GEMV, the stock path's through
// cuBLASLt: one BF16 rounding apart) values near zero, where FP8 codes are
// dense, move by more codes: then the stock path's q_fp8 is held to the
// float64 absorb of its own q instead, within one step, as the fused path's
// is held bit for bit to its CPU reference above.
Check check_q_fp8_fused_vs_stock(const StepShape& s, const HostWeights& w, const PathOutputs& fused,
                                 const PathOutputs& stock) {
  const Difference d = fp8_difference(fused.q_fp8, stock.q_fp8);
  if (fused.q != stock.q) {
    const reference::HeadGemvDeviation e = absorb_deviation(s, w, stock.q, stock.q_fp8);
    return judged("q_fp8 stock vs float64 absorb of its own q", e.max_steps <= 1,
                  format("the paths' q differ (q_b_proj: GEMV vs cuBLASLt): the stock path's q_fp8 within %d FP8 step "
                         "of the float64 absorb's quant (tolerance 1; %lld of %lld differ); fused vs stock: max %lld "
                         "steps, %zu of %zu differ (not judged)",
                         e.max_steps, static_cast<long long>(e.differing), static_cast<long long>(e.compared),
                         static_cast<long long>(d.max_steps), d.differing, stock.q_fp8.size()));
  }
  const size_t most = stock.q_fp8.size() / 20;
  return judged("q_fp8 fused vs stock", d.max_steps <= 1 && d.differing < most,
                format("max %lld FP8 steps (tolerance 1); %zu of %zu values differ (tolerance: under %zu)",
                       static_cast<long long>(d.max_steps), d.differing, stock.q_fp8.size(), most));
}

// latent or out of the stock path against the fused path's.
Check check_fused_vs_stock(const char* name, const char* output, const std::vector<uint16_t>& fused,
                           const std::vector<uint16_t>& stock) {
  const double error = reference::relative_frobenius(stock, bf16_values(fused));
  return judged(name, within(error, kFusedVsStockTolerance),
                format("%s relative Frobenius difference %.2e (tolerance %.0e: the inputs differ, q_fp8 by up to one "
                       "step); max %.2f BF16 ulp at the values' scale; %zu of %zu values differ",
                       output, error, kFusedVsStockTolerance, bf16_error_in_scale_ulps(fused, stock),
                       bf16_difference(fused, stock).differing, stock.size()));
}

Check report_value_up_fused_vs_stock(const PathOutputs& fused, const PathOutputs& stock) {
  const Difference d = bf16_difference(fused.heads, stock.heads);
  return reported("value_up fused vs stock",
                  format("heads max %lld BF16 ulp (%.2f ulp at the values' scale); %zu of %zu values differ",
                         static_cast<long long>(d.max_steps), bf16_error_in_scale_ulps(fused.heads, stock.heads),
                         d.differing, stock.heads.size()));
}

Check report_saturation(const StepShape& s, const PathOutputs& gpu) {
  const auto first = gpu.cache.begin() + s.context * s.L;
  const std::vector<uint8_t> new_entries(first, first + int64_t{s.m} * s.L);
  return reported("FP8 range use", format("values at +-448: q_fp8 %zu of %zu, new cache entries %zu of %zu",
                                          count_saturated_fp8(gpu.q_fp8), gpu.q_fp8.size(),
                                          count_saturated_fp8(new_entries), new_entries.size()));
}

// The untrusted-value counters (DsaStepArgs::error_count, the prefill's):
// this layout holds no bad slot, index, position or page, so all zero.
Check check_error_counts(const PathOutputs& fused, const PathOutputs& fused_again, const PathOutputs& stock,
                         unsigned int prefill) {
  const bool zero = fused.errors == 0 && fused_again.errors == 0 && stock.errors == 0 && prefill == 0;
  return judged("error counters", zero,
                format("untrusted values met (cache slots, indexer pages, attention indices): fused step %u, again %u, "
                       "stock step %u, prefill %u",
                       fused.errors, fused_again.errors, stock.errors, prefill));
}

// --batch-invariant: each token of the step alone (m = 1: its rows of every
// input, the same caches and indexer state, whose writes repeat the batch's)
// through the fused path gives the out, latent and slots bits it had in the
// batch of m.
Status check_tokens_alone(const StepShape& s, DsaAttentionStage& stage, const DeviceLayer& layer,
                          const PathOutputs& batch, cudaStream_t stream, Check* check) {
  const DsaStepArgs args = layer.step_args(DsaPath::kFused);
  const size_t out_row = size_t(s.D), latent_row = size_t(s.H) * s.L, slot_row = size_t(s.top_k_width());
  int differing = 0;
  std::string first;
  for (int t = 0; t < s.m; ++t) {
    DsaStepArgs alone = args;
    alone.hidden = slice_rows(args.hidden, t, 1);
    alone.positions = slice_rows(args.positions, t, 1);
    alone.token_requests = slice_rows(args.token_requests, t, 1);
    if (t < args.slot_mapping.size(0)) {
      alone.slot_mapping = slice_rows(args.slot_mapping, t, 1);
    } else {
      alone.slot_mapping.shape[0] = 0;
    }
    alone.out = slice_rows(args.out, t, 1);
    DSA_RETURN_IF_ERROR(stage.forward(alone, stream));
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    const DsaStageIntermediates v = stage.intermediates(1);
    std::vector<uint16_t> out, latent;
    std::vector<int32_t> slots;
    DSA_RETURN_IF_ERROR(download_view(alone.out, stream, &out));
    DSA_RETURN_IF_ERROR(download_view(v.latent, stream, &latent));
    DSA_RETURN_IF_ERROR(download_view(v.slots, stream, &slots));
    const bool same = std::equal(out.begin(), out.end(), batch.out.begin() + t * out_row) &&
                      std::equal(latent.begin(), latent.end(), batch.latent.begin() + t * latent_row) &&
                      std::equal(slots.begin(), slots.end(), batch.slots.begin() + t * slot_row);
    if (!same && differing++ == 0) first = "token " + std::to_string(t);
  }
  *check = judged("batch invariance", differing == 0,
                  differing == 0 ? format("each of the %d tokens alone gives its out, latent and slots bits in the batch",
                                          s.m)
                                 : format("%d of %d tokens alone differ from the batch (first: %s)", differing, s.m,
                                          first.c_str()));
  return Status();
}

// Runs the fused path, the fused path again, then the stock path, all on
// stage 0, and checks what they wrote; the indexer's CPU reference prefills
// from the same `indexer_history`. Each check is printed as soon as it is
// known.
Status run_checks(const StepShape& s, const HostWeights& w, const HostStepInputs& in,
                  const IndexerTokenRows& indexer_history, const HostCache& initial_cache, const PathSteps& steps,
                  ValueUpKernel value_up, bool indexer_projections_cublaslt, DsaAttentionStage& stage,
                  const DeviceLayer& layer, cudaStream_t stream, std::vector<Check>* checks) {
  const bool fp32_logits = s.indexer_logits == IndexerLogits::kFp32Accumulation;
  // The prefill ran in DeviceLayer::init.
  unsigned int prefill_errors = 0;
  DSA_RETURN_IF_ERROR(download_count(layer.prefill_error_count(), stream, &prefill_errors));
  PathOutputs fused, fused_again, stock;
  DSA_RETURN_IF_ERROR(run_path(stage, layer, DsaPath::kFused, s.m, stream, &fused));
  DSA_RETURN_IF_ERROR(run_path(stage, layer, DsaPath::kFused, s.m, stream, &fused_again));
  // The stage's buffers serve both paths: the fused results are on the host already.
  DSA_RETURN_IF_ERROR(run_path(stage, layer, DsaPath::kStock, s.m, stream, &stock));
  IndexerReference indexer;
  DSA_RETURN_IF_ERROR(run_indexer_reference(s, w, fused.indexer_projections, in, indexer_history,
                                            fp32_logits ? &fused.index_logits : nullptr, &indexer));

  // Each projection's kernel per path. The stock path runs q_b_proj and
  // o_proj through cuBLASLt at every m: where the fused path runs them as
  // linear_gemv, the stock ones are checked on their own.
  const bool qkv_gemv = runs_gemv(steps.fused, kFirstProjection);
  const bool q_b_gemv = runs_gemv(steps.fused, "q_b_proj"), stock_q_b_gemv = runs_gemv(steps.stock, "q_b_proj");
  const bool o_gemv = runs_gemv(steps.fused, kLastProjection), stock_o_gemv = runs_gemv(steps.stock, kLastProjection);
  const std::string stock_q_b_kernel = std::string(kernel_name(stock_q_b_gemv)) + ", stock path";
  const std::string stock_o_kernel = std::string(kernel_name(stock_o_gemv)) + ", stock path";

  std::printf("\nchecks (stage 0: fused path, fused path again, stock path):\n");
  auto add = [&](Check check) {
    print_check(check);
    checks->push_back(std::move(check));
  };
  if (qkv_gemv) {
    add(check_linear_gemv(kFirstProjection, fused.qkv, in.hidden, s.m, s.D, w.fused_qkv_a_proj, s.qkv_width(),
                          "hidden states"));
  }
  add(check_qkv_a_proj_norm(s, w, in, qkv_gemv, fused));
  add(check_norm(s, w, fused));
  if (q_b_gemv) add(check_linear_gemv("q_b_proj", fused.q, fused.q_c, s.m, s.Q, w.q_b_proj, s.q_width(), "q_c"));
  add(check_q_b_proj(s, w, kernel_name(q_b_gemv), fused));
  if (stock_q_b_gemv != q_b_gemv) add(check_q_b_proj(s, w, stock_q_b_kernel, stock));
  add(check_shared_repeat(fused, stock, stock_q_b_gemv == q_b_gemv));
  add(check_absorb(s, w, fused));
  add(check_cache_reference(s, w, in, initial_cache, fused));
  add(check_indexer_projections(s, w, in, indexer_projections_cublaslt ? "cuBLASLt" : "GEMV", fused.q_c,
                                fused.indexer_projections));
  if (!indexer_projections_cublaslt) {
    add(check_indexer_projections_gemv(s, w, in, fused.q_c, fused.indexer_projections));
  }
  add(check_indexer_state(s, indexer, fused));
  if (fp32_logits) add(check_indexer_logits(indexer));
  add(check_indexer_rows(s, indexer, fused));
  add(check_attention(s, w, fused));
  add(check_value_up(s, w, value_up, fused));
  if (o_gemv) add(check_linear_gemv(kLastProjection, fused.out, fused.heads, s.m, s.H * s.V, w.o_proj, s.D, "heads"));
  add(check_o_proj(s, w, kernel_name(o_gemv), fused));
  if (stock_o_gemv != o_gemv) add(check_o_proj(s, w, stock_o_kernel, stock));
  add(check_fused_repeat(fused, fused_again));
  add(check_cache_fused_vs_stock(s, fused, stock));
  add(check_q_fp8_fused_vs_stock(s, w, fused, stock));
  add(check_indexer_fused_vs_stock(s, fused, stock));
  add(check_fused_vs_stock("attention fused vs stock", "latent", fused.latent, stock.latent));
  add(report_value_up_fused_vs_stock(fused, stock));
  add(check_fused_vs_stock("output fused vs stock", "out", fused.out, stock.out));
  add(check_error_counts(fused, fused_again, stock, prefill_errors));
  add(report_saturation(s, fused));
  if (s.batch_invariant) {
    Check alone;
    DSA_RETURN_IF_ERROR(check_tokens_alone(s, stage, layer, fused, stream, &alone));
    add(alone);
  }
  return Status();
}

// ---------------------------------------------------------------- timing

// Copies of the weights, one stage each: enough that the smallest weight one
// step reads alone (W_UK_T, W_UV, q_b_proj, the indexer's wq_b, qkv_a_proj
// or o_proj) rotates through more than twice the L2, so that each step
// timed alone reads its weights from memory too. The small ones rotate with
// them: the norm's 4 KB of gammas (alone, the norm still finds them in L2, in
// the chains the other weights' traffic evicts them) and the indexer's wk,
// weights_proj and compress_gate (2.3 MB a copy at D = 4096, read in the same
// launch as wq_b).
int weight_copies(const bench::Context& ctx, const StepShape& s) {
  const size_t smallest =
      2 * std::min({size_t(s.q_width()) * s.Q, size_t(s.H) * s.P * s.L, size_t(s.H) * s.L * s.V,
                    size_t(s.index_heads) * kIndexerDim * s.Q, size_t(s.qkv_width()) * s.D, size_t(s.D) * s.H * s.V});
  return bench::cold_copies(ctx, smallest);
}

// Each stage runs both paths once uncaptured at the step's m: the stage's
// rule before a capture (the first launch of a kernel sets its limits, the
// first bmm binds the stage's cuBLAS handle to the stream), and every
// stage's workspace then holds what a step timed alone reads.
Status warm_up(Stages& stages, const DeviceLayer& layer, cudaStream_t stream) {
  for (auto& stage : stages) {
    DSA_RETURN_IF_ERROR(stage->forward(layer.step_args(DsaPath::kFused), stream));
    DSA_RETURN_IF_ERROR(stage->stock_forward(layer.step_args(DsaPath::kStock), stream));
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaGetLastError());
  return Status();
}

// Times each step alone, the stock absorb's three launches together, both
// paths' attention halves (every step between qkv_a_proj and o_proj) and
// both whole stages, each as CUDA-graph replays that walk the stages in
// turn (cold weights).
Status time_all(const bench::Context& ctx, Stages& stages, const DeviceLayer& layer, const PathSteps& steps,
                int replays, std::vector<Timing>* timings) {
  const int copies = static_cast<int>(stages.size());
  // A whole number of rotations per graph: no stage's weights are read again
  // sooner than `copies` launches later, across replays too.
  const int per_graph = copies * ((kMinLaunchesPerGraph + copies - 1) / copies);
  // [first, first + count) of the path's steps; count kAllSteps: the whole stage, as forward runs it.
  const auto time_steps = [&](DsaPath path, size_t first, size_t count, double* us) {
    const DsaStepArgs args = layer.step_args(path);
    return bench::time_graph(
        ctx,
        [&](cudaStream_t stream, int i) {
          DsaAttentionStage& stage = *stages[i % copies];
          if (count != DsaAttentionStage::kAllSteps) return stage.run_steps(path, args, first, count, stream);
          return path == DsaPath::kFused ? stage.forward(args, stream) : stage.stock_forward(args, stream);
        },
        us, per_graph, replays);
  };
  // The bytes of steps [first, last] of a path.
  const auto bytes_of = [&](DsaPath path, size_t first, size_t last) {
    double bytes = 0;
    for (size_t i = first; i <= last; ++i) bytes += steps.rows(path)[i].bytes;
    return bytes;
  };
  // Each step alone; the steps both paths share, once (from the fused path).
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    const std::vector<StepRow>& rows = steps.rows(path);
    for (size_t i = 0; i < rows.size(); ++i) {
      const StepRow& row = rows[i];
      if (path == DsaPath::kStock && row.path == "shared") continue;
      Timing t{row.name, row.label, row.path, true};
      t.bytes = row.bytes;
      DSA_RETURN_IF_ERROR(time_steps(path, i, 1, &t.us));
      timings->push_back(t);
    }
  }
  // The stock path's cache write, absorb bmm and quant: what the fused absorb replaces.
  const auto cache_write = std::find(steps.stock.begin(), steps.stock.end(), "cache write (concat_and_cache_mla)");
  if (steps.stock.end() - cache_write < 3 || cache_write[1] != "absorb (cuBLAS bmm)" ||
      cache_write[2] != "static FP8 quant") {
    return unsupported("the stage's stock path should run its cache write, absorb bmm and FP8 quant in a row");
  }
  const size_t stock_absorb_first = size_t(cache_write - steps.stock.begin());
  Timing stock_absorb{"stock_absorb", "cache write + absorb bmm + FP8 quant", "stock", false};
  stock_absorb.bytes = bytes_of(DsaPath::kStock, stock_absorb_first, stock_absorb_first + 2);
  DSA_RETURN_IF_ERROR(time_steps(DsaPath::kStock, stock_absorb_first, 3, &stock_absorb.us));
  timings->push_back(stock_absorb);
  // The attention halves (norm .. value-up) and the whole stages. The row
  // names "chain" and "stock_chain" are the attention halves' since before
  // the stage (scripts/program_grid_table.py reads them).
  struct Chain {
    const char* name;
    const char* label;
    DsaPath path;
    bool whole;
  };
  for (const Chain& chain : {Chain{"stock_chain", "stock chain norm .. value_up", DsaPath::kStock, false},
                             Chain{"chain", "chain norm .. value_up", DsaPath::kFused, false},
                             Chain{"stock_whole_stage", "stock stage qkv_a_proj .. o_proj", DsaPath::kStock, true},
                             Chain{"whole_stage", "stage qkv_a_proj .. o_proj", DsaPath::kFused, true}}) {
    const size_t count = steps.names(chain.path).size();
    Timing t{chain.name, chain.label, chain.path == DsaPath::kFused ? "fused" : "stock", false};
    t.bytes = bytes_of(chain.path, chain.whole ? 0 : 1, chain.whole ? count - 1 : count - 2);
    DSA_RETURN_IF_ERROR(
        time_steps(chain.path, chain.whole ? 0 : 1, chain.whole ? DsaAttentionStage::kAllSteps : count - 2, &t.us));
    timings->push_back(t);
  }
  // Each fused timing against the stock one it replaces.
  set_baselines(*timings, {{"absorb", "stock_absorb"},
                           {"q_b_proj_gemv", "stock_q_b_proj"},
                           {"indexer_select", "stock_indexer_select"},
                           {"attention", "stock_attention"},
                           {"value_up", "stock_value_up_bmm"},
                           {"value_up_bmm", "stock_value_up_bmm"},
                           {"o_proj_gemv", "stock_o_proj"},
                           {"chain", "stock_chain"},
                           {"whole_stage", "stock_whole_stage"}});
  return Status();
}

// ---------------------------------------------------------------- setup

// The stages' plan: the step's (StepShape::stage_plan) with the options'
// value-up and projection token counts (unset: the stage's measured sets)
// and indexer projection kernel.
DsaStagePlan stage_plan(const StepShape& s, const Options& options) {
  DsaStagePlan plan = s.stage_plan();
  plan.value_up_tokens = options.value_up_tokens;
  plan.projection_gemv_tokens = projection_gemv_tokens(options);
  plan.indexer_projections_cublaslt = options.indexer_projections_cublaslt;
  return plan;
}

// --trace: per path, one rotation of the stages (each stage once, in turn,
// on its weight copy), chained as time_all's graph chains them, launched once
// to upload and settle, then again under CUPTI; the middle stage of that
// second launch is the trace, with its neighbours (stage_neighbours): the
// next stage's start gives its period in the chain, what time_all's
// per-stage median measures.
Status trace_stages(Stages& stages, const DeviceLayer& layer, cudaStream_t stream, std::vector<StageTrace>* traces) {
  KernelTrace trace;
  DSA_RETURN_IF_ERROR(trace.start());
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    const DsaStepArgs args = layer.step_args(path);
    bench::CapturedGraph graph;
    DSA_RETURN_IF_ERROR(graph.capture(stream, [&]() -> Status {
      for (const auto& stage : stages) {
        DSA_RETURN_IF_ERROR(path == DsaPath::kFused ? stage->forward(args, stream)
                                                    : stage->stock_forward(args, stream));
      }
      return Status();
    }));
    std::vector<TracedKernel> kernels;
    for (int round = 0; round < 2; ++round) {
      DSA_RETURN_IF_ERROR(trace.collect(&kernels));  // drops the first round's (and earlier) records
      DSA_RETURN_IF_ERROR(graph.launch(stream));
      DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    }
    DSA_RETURN_IF_ERROR(trace.collect(&kernels));
    // Only the graph's kernels are the stages' (a kernel outside it would spoil the cut).
    for (const TracedKernel& k : kernels) {
      if (k.graph == 0 || k.graph != kernels.front().graph) {
        return unsupported("CUPTI reported kernel " + k.name + " outside the traced graph");
      }
    }
    std::vector<std::vector<TracedKernel>> per_stage;
    DSA_RETURN_IF_ERROR(split_stages(kernels, stages.size(), &per_stage));
    // (size - 1) / 2: two stages still show a next one.
    const size_t middle = (per_stage.size() - 1) / 2;
    StageTrace t;
    t.path = path == DsaPath::kFused ? "fused" : "stock";
    t.kernels = per_stage[middle];
    t.neighbours = stage_neighbours(per_stage, middle);
    const uint64_t origin = t.kernels.front().start_ns;
    for (TracedKernel& k : t.kernels) {
      k.start_ns -= origin;
      k.end_ns -= origin;
      if (std::find(t.streams.begin(), t.streams.end(), k.stream) == t.streams.end()) t.streams.push_back(k.stream);
    }
    traces->push_back(std::move(t));
  }
  return trace.stop();
}

Status run_gpu(const StepShape& s, const Options& options, RunReport* report) {
  OwnedStream stream;
  DSA_RETURN_IF_ERROR(stream.create());
  bench::Context ctx;
  DSA_RETURN_IF_ERROR(bench::open_context(stream.get(), /*quick=*/false, &ctx));
  std::printf("dsa-decode on %s (%d SMs, L2 %.0f MB, copy %.0f GB/s), commit %s: %s\n", ctx.gpu_name.c_str(),
              ctx.sm_count, ctx.l2_bytes / 1e6, ctx.copy_GBps, ctx.commit.c_str(), s.describe().c_str());
  std::printf(
      "the library's stage (DsaAttentionStage): forward and stock_forward from hidden states to o_proj's output; "
      "attention over the glm5next indexer's slots (projections of q_c and the hidden states, prepare, select; "
      "stock: the same indexer_select), its state prefilled with drawn rows of the context; no stock "
      "Hopper kernel takes this cache format, so the stock path runs the same sparse_mla after its counter "
      "memset\n");

  HostWeights weights;
  std::string layer_text;
  DSA_RETURN_IF_ERROR(build_layer_weights(s, options.weights, options.layer, options.seed, &weights, &layer_text));
  std::printf("%s\n", layer_text.c_str());
  const HostStepInputs inputs = make_step_inputs(s, options.seed);
  const IndexerTokenRows indexer_history = make_indexer_history(s, options.seed);
  const HostCache cache = make_cache(s, weights, options.seed, 0, s.cache_blocks());
  const int copies = weight_copies(ctx, s);
  const DsaStagePlan plan = stage_plan(s, options);
  DeviceLayer layer;
  DSA_RETURN_IF_ERROR(layer.init(s, weights, inputs, indexer_history, cache, copies, ctx.stream));

  // The configuration vLLM builds for the preset's layer, one stage per weight copy (as layers of a model).
  const DsaLayerConfig config = dsa_layer_config(s.per_rank, weights.eps);
  Stages stages(copies);
  // One workspace for every copy's stage, as a model's layers on one stream
  // share one (at TP8 the 60 copies would otherwise hold 4 GB of workspaces).
  std::shared_ptr<DsaStageWorkspace> workspace;
  for (int c = 0; c < copies; ++c) {
    const Status created = DsaAttentionStage::create(config, layer.weights(c), plan, &stages[c], workspace);
    if (!created.ok()) return Status(created.code(), "creating the stage: " + created.message());
    if (c == 0) workspace = stages[0]->workspace();
  }
  PathSteps steps;
  DSA_RETURN_IF_ERROR(path_steps(s, *stages[0], layer, &steps));
  // The stage's kernel; dsa-decode's choice (from the same options and sets) says why.
  const ValueUpKernel value_up = fused_value_up_kernel(steps);
  const std::string value_up_reason = choose_value_up(options, s.H, s.m).reason;

  std::printf(
      "%s: %d weight copies of %.1f MB, one stage each; KV cache [%lld, %d, %d] FP8 "
      "e4m3 per path, new tokens at slots %lld..%lld\n",
      options.weights.empty() ? "synthetic layer" : "checkpoint layer", copies, layer.weight_bytes() / 1e6,
      static_cast<long long>(s.cache_blocks()), kCacheBlockSize, s.L, static_cast<long long>(s.context),
      static_cast<long long>(s.context + s.m - 1));
  std::printf("%s\n", s.describe_indexer().c_str());
  std::printf("value_up in the fused path: %s; %s\n", value_up_kernel_name(value_up), value_up_reason.c_str());
  std::printf("batch invariant: %s\n", s.batch_invariant ? "yes (--batch-invariant)" : "no (default)");
  std::printf("head_gemv sums in the fused path: %s\n", choice_name(kHeadGemvSumsChoices, s.head_gemv_sums));
  std::printf("sparse attention's plan (both paths): %s\n",
              choice_name(kSparseMlaPlanChoices, dsa_stage_attention_plan(s.stage_plan())));
  std::printf("indexer logits (both paths' selects): %s\n", choice_name(kIndexerLogitsChoices, s.indexer_logits));
  std::printf(
      "projections (--projections %s): qkv_a_proj %s (both paths); q_b_proj %s, o_proj %s (fused path; "
      "the stock path's: cuBLASLt)\n",
      options.projections.c_str(), kernel_name(runs_gemv(steps.fused, kFirstProjection)),
      kernel_name(runs_gemv(steps.fused, "q_b_proj")), kernel_name(runs_gemv(steps.fused, kLastProjection)));
  std::printf("indexer projections (both paths): %s\n",
              options.indexer_projections_cublaslt ? "indexer_project (cuBLASLt)" : "indexer_project_gemv");
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    const std::vector<std::string>& names = steps.names(path);
    std::string list;
    for (const std::string& name : names) list += (list.empty() ? "" : ", ") + name;
    std::printf("%s path, %zu steps: %s\n", path == DsaPath::kFused ? "fused" : "stock", names.size(), list.c_str());
  }

  report->gpu = ctx.gpu_name;
  report->commit = ctx.commit;
  report->date = ctx.date;
  report->copy_GBps = ctx.copy_GBps;
  report->shape = s;
  report->steps = options.steps;
  report->weight_copies = copies;
  report->value_up_kernel = value_up_kernel_name(value_up);
  report->value_up_reason = value_up_reason;
  report->projections_option = options.projections;
  for (const char* projection : {kFirstProjection, "q_b_proj", kLastProjection}) {
    report->fused_projection_kernels.emplace_back(projection, kernel_name(runs_gemv(steps.fused, projection)));
  }
  report->indexer_projections_kernel =
      options.indexer_projections_cublaslt ? "indexer_project" : "indexer_project_gemv";
  report->indexer_logits = choice_name(kIndexerLogitsChoices, s.indexer_logits);
  report->head_gemv_sums = choice_name(kHeadGemvSumsChoices, s.head_gemv_sums);
  report->attention_plan = choice_name(kSparseMlaPlanChoices, dsa_stage_attention_plan(s.stage_plan()));
  report->batch_invariant = s.batch_invariant;
  DSA_RETURN_IF_ERROR(run_checks(s, weights, inputs, indexer_history, cache, steps, value_up,
                                 options.indexer_projections_cublaslt, *stages[0], layer, ctx.stream, &report->checks));
  DSA_RETURN_IF_ERROR(warm_up(stages, layer, ctx.stream));
  DSA_RETURN_IF_ERROR(time_all(ctx, stages, layer, steps, options.steps, &report->timings));
  print_timings(*report);
  // The trace is a view of the timings: a trace that cannot be taken is
  // reported (and in the JSON), the checks and timings above stand.
  if (std::string why_not; options.trace && !kernel_trace_available(&why_not)) {
    report->trace_problem = "not traced: " + why_not;
  } else if (options.trace) {
    if (const Status traced = trace_stages(stages, layer, ctx.stream, &report->traces); !traced.ok()) {
      report->traces.clear();
      report->trace_problem = "the trace failed: " + traced.to_string();
    }
    for (const StageTrace& trace : report->traces) print_trace(trace, copies);
  }
  if (!report->trace_problem.empty()) std::printf("\n--trace: %s\n", report->trace_problem.c_str());
  return Status();
}

}  // namespace

GpuAvailability probe_gpu() {
  GpuAvailability gpu;
  const auto problem = [&](GpuProblem kind, std::string raw, int driver = 0, int runtime = 0) {
    gpu.problem = kind;
    gpu.summary = gpu_problem_summary(kind, driver, runtime);
    gpu.raw = std::move(raw);
    return gpu;
  };
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it: the CPU path makes no CUDA call, but leave no sticky state behind
    int driver = 0, runtime = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = CUDART_VERSION;
    cudaGetLastError();
    return problem(device_count_problem(error == cudaErrorNoDevice, driver, runtime),
                   std::string("cudaGetDeviceCount: ") + cudaGetErrorString(error), driver, runtime);
  }
  if (count == 0) return problem(GpuProblem::kNoDevice, "cudaGetDeviceCount: 0 devices");
  cudaDeviceProp prop{};
  if (const cudaError_t props = cudaGetDeviceProperties(&prop, 0); props != cudaSuccess) {
    cudaGetLastError();
    return problem(GpuProblem::kOther, std::string("cudaGetDeviceProperties(0): ") + cudaGetErrorString(props));
  }
  if (prop.major != 9 || prop.minor != 0) {
    return problem(GpuProblem::kNotSm90, std::string("device 0, ") + prop.name + ", is sm_" +
                                             std::to_string(prop.major * 10 + prop.minor) +
                                             "; the kernels are built for sm_90a only");
  }
  return gpu;
}

int run_gpu_path(const StepShape& shape, const Options& options) {
  if (shape.rope()) return run_gpu_path_rope(shape, options);
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
  if (!options.report_path.empty()) {
    if (const Status status = write_html_report(report, options.report_path); !status.ok()) {
      std::fprintf(stderr, "dsa-decode: %s\n", status.to_string().c_str());
      return kExitFailure;
    }
    std::printf("wrote %s\n", options.report_path.c_str());
  }
  const size_t failed = failed_checks(report.checks);
  if (failed > 0) {
    std::printf("FAIL: %zu of %zu checks failed\n", failed, judged_checks(report.checks));
    std::fprintf(stderr, "dsa-decode: %zu of %zu checks failed\n", failed, judged_checks(report.checks));
    return kExitFailure;
  }
  std::printf("PASS: %zu of %zu checks passed\n", judged_checks(report.checks), judged_checks(report.checks));
  return kExitOk;
}

}  // namespace dsa::cli
