#include "reference_chain.h"

#include <algorithm>
#include <cmath>

#include "dsa_decode/numerics.h"
#include "head_gemv/head_gemv_reference.h"
#include "linear/linear_reference.h"
#include "norm/norm_reference.h"

namespace dsa::cli {

reference::SparseMlaResult reference_attention(const StepShape& s, const HostWeights& w,
                                               const std::vector<uint8_t>& q_fp8, const std::vector<uint8_t>& cache,
                                               int64_t blocks, int64_t block_size, const std::vector<int32_t>& slots) {
  reference::SparseMlaHost a{};
  a.q = q_fp8.data();
  a.q_head_stride = s.L;
  a.q_token_stride = int64_t{s.H} * s.L;
  a.cache = cache.data();
  a.blocks = blocks;
  a.block_size = block_size;
  a.entry_stride = s.L;
  a.block_stride = block_size * s.L;
  a.indices = slots.data();
  a.indices_token_stride = s.top_k_width();
  a.m = s.m;
  a.heads = s.H;
  a.top_k = s.top_k_width();
  a.q_scale = w.q_scale;
  a.k_scale = w.k_scale;
  a.softmax_scale = s.softmax_scale;
  return reference::sparse_mla(a);
}

HeadGemvTactic absorb_tactic(const StepShape& s) { return head_gemv_tactic(s.H, s.P, s.L, s.m); }
HeadGemvTactic value_up_tactic(const StepShape& s) { return head_gemv_tactic(s.H, s.L, s.V, s.m); }

NormOutputs reference_norm(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& qkv) {
  NormOutputs out;
  out.q_c.resize(size_t(s.m) * s.Q);
  out.kv_c.resize(size_t(s.m) * s.L);
  reference::qkv_rmsnorm(qkv.data(), s.qkv_width(), w.q_norm_gamma.data(), w.kv_norm_gamma.data(), s.m, s.Q, s.L,
                         w.eps, out.q_c.data(), out.kv_c.data());
  return out;
}

namespace {

// out [m, n] = in [m, k] x weight [n, k]^T, FP32 sums in k order, rounded to BF16.
std::vector<uint16_t> linear_fp32(const std::vector<uint16_t>& in, int m, int k, const std::vector<uint16_t>& weight,
                                  int64_t n) {
  // `in` transposed to [k][kMaxDecodeTokens], zero-padded: the tokens' sums are
  // independent, so the innermost loop runs over them and vectorizes, while
  // each token's sum still goes through k in order.
  std::vector<float> x(size_t(k) * kMaxDecodeTokens, 0.0f);
  for (int t = 0; t < m; ++t) {
    for (int i = 0; i < k; ++i) x[size_t(i) * kMaxDecodeTokens + t] = num::bf16_to_float(in[size_t(t) * k + i]);
  }
  std::vector<uint16_t> out(size_t(m) * n);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* weight_row = &weight[size_t(j) * k];
    float acc[kMaxDecodeTokens] = {};
    for (int i = 0; i < k; ++i) {
      const float weight_value = num::bf16_to_float(weight_row[i]);
      const float* xi = &x[size_t(i) * kMaxDecodeTokens];
      // A rounded product and a rounded sum: the build keeps them apart (-ffp-contract=off).
      for (int t = 0; t < kMaxDecodeTokens; ++t) acc[t] += xi[t] * weight_value;
    }
    for (int t = 0; t < m; ++t) out[size_t(t) * n + j] = num::float_to_bf16(acc[t]);
  }
  return out;
}

}  // namespace

std::vector<uint16_t> reference_qkv_a_proj(const StepShape& s, const HostWeights& w,
                                           const std::vector<uint16_t>& hidden) {
  return linear_fp32(hidden, s.m, s.D, w.fused_qkv_a_proj, s.qkv_width());
}

std::vector<uint16_t> reference_q_b_proj(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q_c) {
  return linear_fp32(q_c, s.m, s.Q, w.q_b_proj, s.q_width());
}

std::vector<uint16_t> reference_o_proj(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& heads) {
  return linear_fp32(heads, s.m, s.H * s.V, w.o_proj, s.D);
}

ExactNormOutputs exact_qkv_a_proj_norm(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& hidden) {
  const std::vector<double> qkv =
      reference::exact_product(hidden.data(), s.m, s.D, w.fused_qkv_a_proj.data(), s.qkv_width()).sum;
  ExactNormOutputs out;
  out.q_c.resize(size_t(s.m) * s.Q);
  out.kv_c.resize(size_t(s.m) * s.L);
  for (int t = 0; t < s.m; ++t) {
    const double* row = &qkv[size_t(t) * s.qkv_width()];
    reference::rms_norm_exact(row, s.Q, w.q_norm_gamma.data(), w.eps, &out.q_c[size_t(t) * s.Q]);
    reference::rms_norm_exact(row + s.Q, s.L, w.kv_norm_gamma.data(), w.eps, &out.kv_c[size_t(t) * s.L]);
  }
  return out;
}

namespace {
// head_gemv's host arguments for x [m, H, I] and weight [H, I, J], both dense.
reference::HeadGemvHost dense_head_gemv(const std::vector<uint16_t>& x, const std::vector<uint16_t>& weight, int m,
                                        int heads, int rows, int cols) {
  return reference::HeadGemvHost{x.data(), int64_t{heads} * rows, weight.data(), int64_t{rows} * cols, cols,
                                 m,        heads,                 rows,          cols};
}
}  // namespace

std::vector<uint8_t> reference_absorb(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                                      HeadGemvTactic tactic) {
  return reference::head_gemv_fp8(dense_head_gemv(q, w.w_uk_t, s.m, s.H, s.P, s.L), tactic, w.q_scale);
}

reference::HeadGemvDeviation absorb_deviation(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                                              const std::vector<uint8_t>& q_fp8) {
  return reference::head_gemv_deviation(dense_head_gemv(q, w.w_uk_t, s.m, s.H, s.P, s.L), q_fp8.data(), true,
                                        w.q_scale);
}

reference::HeadGemvDeviation value_up_deviation(const StepShape& s, const HostWeights& w,
                                                const std::vector<uint16_t>& latent, const std::vector<uint16_t>& out) {
  return reference::head_gemv_deviation(dense_head_gemv(latent, w.w_uv, s.m, s.H, s.L, s.V), out.data(), false, 1.0f);
}

std::vector<uint16_t> reference_value_up(const StepShape& s, const HostWeights& w,
                                         const std::vector<uint16_t>& latent, HeadGemvTactic tactic) {
  return reference::head_gemv_bf16(dense_head_gemv(latent, w.w_uv, s.m, s.H, s.L, s.V), tactic);
}

int reference_cache_write(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& kv_c,
                          const std::vector<int64_t>& slots, HostCache* cache) {
  const std::vector<int64_t> local = cache->window_slots(slots);
  // A slot before the window turns negative here and would pass for padding:
  // count it with the ones past the window's end.
  int before_window = 0;
  for (size_t t = 0; t < slots.size(); ++t) before_window += slots[t] >= 0 && local[t] < 0 ? 1 : 0;
  return before_window + reference::cache_write(kv_c.data(), s.L, s.m, s.L, local.data(), static_cast<int>(local.size()),
                                                w.k_scale, cache->bytes.data(), cache->blocks, kCacheBlockSize,
                                                int64_t{kCacheBlockSize} * s.L, s.L);
}

reference::IndexerStateHost IndexerHostState::view() {
  // One page per KV block: as many blocks as the table is wide.
  return reference::IndexerStateHost{block_table.data(), requests, width, ring.data(), k_cache.data(),
                                     /*blocks=*/width, page_bytes};
}

IndexerHostState make_indexer_state(const StepShape& s) {
  IndexerHostState state;
  state.requests = s.indexer_requests();
  state.width = s.cache_blocks();
  state.page_bytes = s.indexer_page_bytes();
  state.block_table = make_indexer_block_table(s);
  state.ring.assign(size_t(state.requests) * 2 * s.indexer_ring() * kIndexerDim, 0);
  state.k_cache.assign(size_t(state.width) * state.page_bytes, 0);
  return state;
}

namespace {
reference::IndexerParamsHost indexer_params(const HostWeights& w) {
  return reference::IndexerParamsHost{w.index_k_norm_weight.data(), w.index_k_norm_bias.data(), w.index_ape.data()};
}
}  // namespace

Status reference_indexer_prefill(const StepShape& s, const HostWeights& w, const IndexerTokenRows& history,
                                 IndexerHostState* state, int64_t* errors) {
  const IndexerPlan plan = s.indexer_plan();
  reference::IndexerStateHost view = state->view();
  *errors = 0;
  for (int request = 0; request < s.indexer_requests(); ++request) {
    const int64_t tokens = s.indexer_prefill_tokens(request);
    if (tokens == 0) continue;  // no context: the state starts empty
    int64_t request_errors = 0;
    DSA_RETURN_IF_ERROR(reference::indexer_prefill(plan, history.index_k.data(), history.gate.data(), tokens, request,
                                                   indexer_params(w), view, &request_errors));
    *errors += request_errors;
  }
  return Status();
}

namespace {
reference::IndexerProjectInputsHost projection_inputs(const StepShape& s, const HostWeights& w,
                                                      const std::vector<uint16_t>& q_c,
                                                      const std::vector<uint16_t>& hidden) {
  return {s.m,
          s.Q,
          s.D,
          q_c.data(),
          hidden.data(),
          w.index_wq_b.data(),
          w.index_wk.data(),
          w.index_weights_proj.data(),
          w.index_compress_gate.empty() ? nullptr : w.index_compress_gate.data(),  // none with pool 1
          s.index_heads};
}
}  // namespace

reference::IndexerProjectionsHost reference_indexer_project(const StepShape& s, const HostWeights& w,
                                                            const std::vector<uint16_t>& q_c,
                                                            const std::vector<uint16_t>& hidden) {
  return reference::indexer_project(projection_inputs(s, w, q_c, hidden));
}

reference::IndexerProjectionBitsHost reference_indexer_project_gemv(const StepShape& s, const HostWeights& w,
                                                                    const std::vector<uint16_t>& q_c,
                                                                    const std::vector<uint16_t>& hidden) {
  return reference::indexer_project_gemv(projection_inputs(s, w, q_c, hidden));
}

namespace {
std::vector<uint16_t> stored_bf16(const reference::ExactProduct& exact) {
  std::vector<uint16_t> values(exact.sum.size());
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = num::float_to_bf16(static_cast<float>(reference::projection_expected(exact.sum[i], DType::kBF16)));
  }
  return values;
}
}  // namespace

IndexerProjections stored_projections(const reference::IndexerProjectionsHost& exact) {
  IndexerProjections p;
  p.index_q = stored_bf16(exact.index_q);
  p.index_k = stored_bf16(exact.index_k);
  p.gate = stored_bf16(exact.gate);
  p.head_weights.resize(exact.head_weights.sum.size());
  for (size_t i = 0; i < p.head_weights.size(); ++i) {
    p.head_weights[i] = static_cast<float>(reference::projection_expected(exact.head_weights.sum[i], DType::kF32));
  }
  return p;
}

Status reference_indexer_step(const StepShape& s, const HostWeights& w, const IndexerProjections& projections,
                              const HostStepInputs& in, IndexerHostState* state, reference::IndexerRowsHost* rows,
                              int64_t* errors, GpuIndexerLogits* gpu_logits) {
  const IndexerPlan plan = s.indexer_plan();
  reference::IndexerStateHost view = state->view();
  const reference::IndexerStepHost step{s.m,
                                        projections.index_q.data(),
                                        projections.index_k.data(),
                                        projections.head_weights.data(),
                                        projections.gate.data(),
                                        in.positions.data(),
                                        in.token_requests.data()};
  reference::IndexerQueryHost query;
  DSA_RETURN_IF_ERROR(reference::indexer_prepare(plan, step, indexer_params(w), view, &query, errors));
  if (plan.logits == IndexerLogits::kExact) {
    DSA_RETURN_IF_ERROR(reference::indexer_select(plan, step, query, view, rows));
  } else {
    const int64_t stride = indexer_workspace_layout(plan).logits_stride;
    if (gpu_logits == nullptr || gpu_logits->logits == nullptr ||
        gpu_logits->logits->size() < size_t(s.m) * size_t(stride)) {
      return invalid_argument("gpu_logits", "the GPU select's logits [m, stride] (FP32-accumulated logits)",
                              "none or fewer");
    }
    std::vector<std::vector<float>> logits(s.m);
    for (int t = 0; t < s.m; ++t) {
      const int64_t request = in.token_requests[t], context = in.positions[t] + 1;
      if (request < 0 || context <= plan.topk) continue;
      const int64_t pools = context / plan.pool;
      const float* row = gpu_logits->logits->data() + size_t(t) * stride;
      logits[t].assign(row, row + pools);
      const reference::LogitDeviation deviation = reference::indexer_logit_deviation(
          plan, view, request, pools, &query.q_fp8[size_t(t) * plan.heads * kIndexerDim],
          &query.head_weights[size_t(t) * plan.heads], row);
      gpu_logits->scored += pools;
      gpu_logits->outside += deviation.outside;
      gpu_logits->worst = std::max(gpu_logits->worst, deviation.worst);
    }
    DSA_RETURN_IF_ERROR(reference::indexer_select_on_logits(plan, step, logits, view, rows));
  }
  *errors += rows->errors;
  return Status();
}

}  // namespace dsa::cli
