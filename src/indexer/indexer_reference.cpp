#include "indexer/indexer_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "dsa_decode/numerics.h"
#include "indexer/indexer_math.h"

namespace dsa::reference {

namespace {

constexpr int kDim = kIndexerDim;
constexpr int kMaxPool = indexer_math::kMaxPoolSize;

int64_t pools_per_page(const IndexerPlan& plan) { return indexer_pools_per_page(plan); }

// The page (block) holding `pool` of `request`, or -1 when the block table
// entry is outside [0, blocks) or the pool is past the table's width.
int64_t pool_block(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request, int64_t pool) {
  const int64_t page = pool / pools_per_page(plan);
  if (page >= state.block_table_width) return -1;
  const int64_t block = state.block_table[request * state.block_table_width + page];
  return block >= 0 && block < state.blocks ? block : -1;
}

uint16_t* ring_row(const IndexerPlan& plan, IndexerStateHost& state, int64_t request, int which, int64_t position) {
  return state.ring + ((request * 2 + which) * plan.ring + position % plan.ring) * kDim;
}

// Step 3's compression of one pool from its plan.pool tokens' LayerNormed k and gate
// rows, written to the pool's page entry; false when the page is untrusted.
bool compress_and_write(const IndexerPlan& plan, IndexerStateHost& state, const IndexerParamsHost& params,
                        int64_t request, int64_t pool, const uint16_t* const* k_rows,
                        const uint16_t* const* gate_rows) {
  const int64_t block = pool_block(plan, state, request, pool);
  if (block < 0) return false;
  uint16_t pooled[kDim];
  indexer_math::pool_softmax128(plan.pool, k_rows, gate_rows, params.ape, pooled);
  const int64_t entry = pool % pools_per_page(plan);
  uint8_t* page = state.k_cache + block * state.page_stride;
  const float scale = indexer_math::hadamard_quantize(pooled, page + entry * kDim);
  std::memcpy(page + pools_per_page(plan) * kDim + entry * 4, &scale, 4);
  return true;
}

// Pool 1: `position`'s key from its LayerNormed k (BF16 [128]): RoPE of the
// first R dims, Hadamard, quant, written at entry pos % block_size of its
// page; false when the page is untrusted.
bool write_token_key(const IndexerPlan& plan, IndexerStateHost& state, const IndexerParamsHost& params,
                     int64_t request, int64_t position, const uint16_t* k_normed) {
  const int64_t block = pool_block(plan, state, request, position);
  if (block < 0) return false;
  uint16_t k[kDim];
  std::memcpy(k, k_normed, sizeof(k));
  if (plan.rope_dims > 0) {
    float cos[kDim / 2], sin[kDim / 2];
    indexer_cos_sin(plan, params, position, cos, sin);
    indexer_math::rope_row(k, plan.rope_dims, plan.rope_style == RopeStyle::kHalfSplit, cos, sin);
  }
  const int64_t entry = position % pools_per_page(plan);
  uint8_t* page = state.k_cache + block * state.page_stride;
  const float scale = indexer_math::hadamard_quantize(k, page + entry * kDim);
  std::memcpy(page + pools_per_page(plan) * kDim + entry * 4, &scale, 4);
  return true;
}

// e4m3 code -> value, exact.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) value[c] = num::e4m3_to_float(static_cast<uint8_t>(c));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

// A dot product of two rows of decoded e4m3 codes, exact: every product is a
// multiple of 2^-18 below 2^18, so every partial sum of 128 of them is a
// multiple of 2^-18 below 2^25, exact in double's 53 bits in any order (the
// four accumulators only make it faster).
double exact_dot(const float* a, const float* b) {
  double partial[4] = {0, 0, 0, 0};
  for (int d = 0; d < kDim; d += 4) {
    for (int i = 0; i < 4; ++i) partial[i] += double(a[d + i]) * double(b[d + i]);
  }
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

// The selection's order: NaN ranks as -inf; -0 and +0 compare equal.
float rank_value(float logit) { return std::isnan(logit) ? -std::numeric_limits<float>::infinity() : logit; }

}  // namespace

void indexer_cos_sin(const IndexerPlan& plan, const IndexerParamsHost& params, int64_t position, float* cos,
                     float* sin) {
  const int half = plan.rope_dims / 2;
  const bool valid = position >= 0 && position < params.cos_sin_rows;
  for (int i = 0; i < half; ++i) {
    cos[i] = sin[i] = 0.0f;
    if (!valid) continue;
    const int64_t at = position * params.cos_sin_row_stride;
    if (params.cos_sin_bf16) {
      const uint16_t* row = static_cast<const uint16_t*>(params.cos_sin) + at;
      cos[i] = num::bf16_to_float(row[i]);
      sin[i] = num::bf16_to_float(row[half + i]);
    } else {
      const float* row = static_cast<const float*>(params.cos_sin) + at;
      cos[i] = row[i];
      sin[i] = row[half + i];
    }
  }
}

PoolEntry read_pool(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request, int64_t pool) {
  const int64_t block = pool_block(plan, state, request, pool);
  if (block < 0) return PoolEntry{nullptr, 0.0f};
  const int64_t entry = pool % pools_per_page(plan);
  const uint8_t* page = state.k_cache + block * state.page_stride;
  PoolEntry result{page + entry * kDim, 0.0f};
  std::memcpy(&result.scale, page + pools_per_page(plan) * kDim + entry * 4, 4);
  return result;
}

Status indexer_prepare(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerParamsHost& params,
                       IndexerStateHost& state, IndexerQueryHost* query, int64_t* errors) {
  DSA_RETURN_IF_ERROR(check_indexer_batch(plan, step.m, step.positions, step.token_requests, state.requests,
                                          state.block_table_width));
  const int heads = plan.heads, pool_size = plan.pool;
  query->q_fp8.assign(size_t(step.m) * heads * kDim, 0);
  query->head_weights.assign(size_t(step.m) * heads, 0.0f);
  *errors = 0;
  for (int t = 0; t < step.m; ++t) {
    // Step 2 for every token, padding too: it reads nothing but the token's own
    // rows (and its position's table row: zeros outside the table).
    float cos[kDim / 2], sin[kDim / 2];
    if (plan.rope_dims > 0) indexer_cos_sin(plan, params, step.positions[t], cos, sin);
    for (int h = 0; h < heads; ++h) {
      const size_t row = size_t(t) * heads + h;
      uint16_t q[kDim];
      std::memcpy(q, step.index_q + row * kDim, sizeof(q));
      if (plan.rope_dims > 0) {
        indexer_math::rope_row(q, plan.rope_dims, plan.rope_style == RopeStyle::kHalfSplit, cos, sin);
      }
      const float scale = indexer_math::hadamard_quantize(q, &query->q_fp8[row * kDim]);
      query->head_weights[row] = indexer_math::fold_head_weight(step.head_weights[row], scale, heads);
    }
    const int64_t request = step.token_requests[t];
    if (request < 0) continue;
    const int64_t position = step.positions[t];
    uint16_t k[kDim];
    indexer_math::layernorm128(step.index_k + size_t(t) * kDim, params.k_norm_weight, params.k_norm_bias, k);
    if (pool_size == 1) {  // no pooling: the token's own key, no ring
      if (!write_token_key(plan, state, params, request, position, k)) ++*errors;
      continue;
    }
    const uint16_t* gate = step.gate + size_t(t) * kDim;
    if (position % pool_size == pool_size - 1) {
      const uint16_t* k_rows[kMaxPool];
      const uint16_t* gate_rows[kMaxPool];
      for (int j = 0; j < pool_size - 1; ++j) {  // the ring, before this token is stashed
        const int64_t earlier = position - (pool_size - 1) + j;
        k_rows[j] = ring_row(plan, state, request, 0, earlier);
        gate_rows[j] = ring_row(plan, state, request, 1, earlier);
      }
      k_rows[pool_size - 1] = k;
      gate_rows[pool_size - 1] = gate;
      if (!compress_and_write(plan, state, params, request, position / pool_size, k_rows, gate_rows)) ++*errors;
    }
    std::memcpy(ring_row(plan, state, request, 0, position), k, sizeof(k));
    std::memcpy(ring_row(plan, state, request, 1, position), gate, kDim * sizeof(uint16_t));
  }
  return Status();
}

Status indexer_prefill(const IndexerPlan& plan, const uint16_t* index_k, const uint16_t* gate, int64_t n,
                       int64_t request, const IndexerParamsHost& params, IndexerStateHost& state, int64_t* errors) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  const int64_t limit = std::min(plan.max_context, state.block_table_width * plan.block_size);
  if (n < 1 || n > limit) {
    return invalid_argument("n", "1.." + std::to_string(limit) + " (within max_context and the block table)",
                            std::to_string(n));
  }
  if (request < 0 || request >= state.requests) {
    return invalid_argument("request", "0.." + std::to_string(state.requests - 1), std::to_string(request));
  }
  std::vector<uint16_t> k(size_t(n) * kDim);  // [n, 128] LayerNormed
  for (int64_t i = 0; i < n; ++i) {
    indexer_math::layernorm128(index_k + i * kDim, params.k_norm_weight, params.k_norm_bias, &k[i * kDim]);
  }
  *errors = 0;
  if (plan.pool == 1) {  // every token's key, no ring
    for (int64_t position = 0; position < n; ++position) {
      if (!write_token_key(plan, state, params, request, position, &k[position * kDim])) ++*errors;
    }
    return Status();
  }
  for (int64_t pool = 0; pool < n / plan.pool; ++pool) {
    const uint16_t* k_rows[kMaxPool];
    const uint16_t* gate_rows[kMaxPool];
    for (int j = 0; j < plan.pool; ++j) {
      k_rows[j] = &k[(pool * plan.pool + j) * kDim];
      gate_rows[j] = gate + (pool * plan.pool + j) * kDim;
    }
    if (!compress_and_write(plan, state, params, request, pool, k_rows, gate_rows)) ++*errors;
  }
  for (int64_t position = std::max<int64_t>(0, n - plan.ring); position < n; ++position) {
    std::memcpy(ring_row(plan, state, request, 0, position), &k[position * kDim], kDim * sizeof(uint16_t));
    std::memcpy(ring_row(plan, state, request, 1, position), gate + position * kDim, kDim * sizeof(uint16_t));
  }
  return Status();
}

std::vector<float> indexer_logits(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                  int64_t n_pools, const uint8_t* q_fp8, const float* head_weights) {
  const Fp8Table& table = fp8_table();
  const int heads = plan.heads;
  std::vector<float> q(heads * kDim);  // [H, 128] decoded
  for (int i = 0; i < heads * kDim; ++i) q[i] = table.value[q_fp8[i]];
  std::vector<float> logits(n_pools);
  float k[kDim];
  for (int64_t pool = 0; pool < n_pools; ++pool) {
    const PoolEntry entry = read_pool(plan, state, request, pool);
    if (entry.codes == nullptr) {
      logits[pool] = -std::numeric_limits<float>::infinity();
      continue;
    }
    for (int d = 0; d < kDim; ++d) k[d] = table.value[entry.codes[d]];
    float sum = 0.0f;
    for (int h = 0; h < heads; ++h) {
      const float relu = std::fmax(static_cast<float>(exact_dot(&q[h * kDim], k)), 0.0f);
      sum = std::fma(head_weights[h], relu, sum);
    }
    logits[pool] = sum * entry.scale;
  }
  return logits;
}

std::vector<double> indexer_logit_bounds(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                         int64_t n_pools, const uint8_t* q_fp8, const float* head_weights) {
  const Fp8Table& table = fp8_table();
  const int heads = plan.heads;
  std::vector<float> q(heads * kDim), q_magnitude(heads * kDim);  // [H, 128] decoded, and |q|
  for (int i = 0; i < heads * kDim; ++i) {
    q[i] = table.value[q_fp8[i]];
    q_magnitude[i] = std::fabs(q[i]);
  }
  std::vector<double> bounds(n_pools, 0.0);
  float k[kDim], k_magnitude[kDim];
  for (int64_t pool = 0; pool < n_pools; ++pool) {
    const PoolEntry entry = read_pool(plan, state, request, pool);
    if (entry.codes == nullptr) continue;
    for (int d = 0; d < kDim; ++d) {
      k[d] = table.value[entry.codes[d]];
      k_magnitude[d] = std::fabs(k[d]);
    }
    double bound = 0;
    const double chain_roundings = 2.0 * heads + 6;
    for (int h = 0; h < heads; ++h) {
      const double magnitude = exact_dot(&q_magnitude[h * kDim], k_magnitude);
      const double dot = std::fabs(exact_dot(&q[h * kDim], k));
      bound += std::fabs(double(head_weights[h])) * (std::ldexp(magnitude, -10) + chain_roundings * std::ldexp(dot, -24));
    }
    bounds[pool] = std::fabs(double(entry.scale)) * bound;
  }
  return bounds;
}

LogitDeviation indexer_logit_deviation(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                       int64_t n_pools, const uint8_t* q_fp8, const float* head_weights,
                                       const float* got) {
  const std::vector<float> exact = indexer_logits(plan, state, request, n_pools, q_fp8, head_weights);
  const std::vector<double> bounds = indexer_logit_bounds(plan, state, request, n_pools, q_fp8, head_weights);
  LogitDeviation deviation;
  for (int64_t p = 0; p < n_pools; ++p) {
    if (std::isnan(got[p]) && std::isnan(exact[p])) continue;
    if (std::isinf(exact[p])) {
      deviation.outside += got[p] != exact[p];
      continue;
    }
    const double error = std::fabs(double(got[p]) - double(exact[p]));
    deviation.outside += !(error <= bounds[p]);
    if (bounds[p] > 0) deviation.worst = std::max(deviation.worst, error / bounds[p]);
  }
  return deviation;
}

std::vector<int32_t> select_top_pools(const std::vector<float>& logits, int count) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto ranks_before = [&](int32_t a, int32_t b) {
    const float va = rank_value(logits[a]), vb = rank_value(logits[b]);
    return va != vb ? va > vb : a < b;
  };
  if (order.size() > size_t(count)) {
    std::nth_element(order.begin(), order.begin() + count, order.end(), ranks_before);
    order.resize(count);
  }
  std::sort(order.begin(), order.end());
  return order;
}

void expand_row(const IndexerPlan& plan, int64_t context, const std::vector<int32_t>& top_pools, int32_t* row) {
  std::fill(row, row + indexer_row_width(plan), -1);
  if (context <= plan.topk) {
    for (int64_t c = 0; c < context; ++c) row[c] = static_cast<int32_t>(c);
    return;
  }
  for (size_t i = 0; i < top_pools.size(); ++i) {
    for (int j = 0; j < plan.pool; ++j) row[i * plan.pool + j] = top_pools[i] * plan.pool + j;
  }
  const int64_t tail_start = context / plan.pool * plan.pool;
  for (int64_t position = tail_start; position < context; ++position) {
    row[plan.topk + (position - tail_start)] = static_cast<int32_t>(position);
  }
}

int64_t remap_row(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request, const int32_t* positions,
                  int count, int32_t* slots) {
  int64_t errors = 0;
  for (int c = 0; c < count; ++c) {
    const int32_t position = positions[c];
    slots[c] = -1;
    if (position < 0) continue;
    const int64_t page = position / plan.block_size;
    const int64_t block =
        page < state.block_table_width ? state.block_table[request * state.block_table_width + page] : -1;
    if (block < 0 || block >= state.blocks) {
      ++errors;
      continue;
    }
    slots[c] = static_cast<int32_t>(block * plan.block_size + position % plan.block_size);
  }
  return errors;
}

Status indexer_remap(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerStateHost& state,
                     const std::vector<int32_t>& topk_positions, IndexerRowsHost* rows) {
  DSA_RETURN_IF_ERROR(
      check_indexer_batch(plan, step.m, step.positions, step.token_requests, state.requests, state.block_table_width));
  const int width = indexer_row_width(plan);
  if (topk_positions.size() != size_t(step.m) * width) {
    return invalid_argument("topk_positions", std::to_string(step.m) + " rows of " + std::to_string(width),
                            std::to_string(topk_positions.size()) + " values");
  }
  rows->topk_positions = topk_positions;
  rows->slots.assign(topk_positions.size(), -1);
  rows->errors = 0;
  for (int t = 0; t < step.m; ++t) {
    const int64_t request = step.token_requests[t];
    if (request < 0) continue;
    const int64_t context = step.positions[t] + 1;
    const size_t row = size_t(t) * width;
    std::vector<int32_t> known(topk_positions.begin() + row, topk_positions.begin() + row + width);
    for (int32_t& position : known) {
      if (position >= context) {
        position = -1;
        ++rows->errors;
      }
    }
    rows->errors += remap_row(plan, state, request, known.data(), width, &rows->slots[row]);
  }
  return Status();
}

namespace {

// Steps 5, 7 and 8 with token t's logits from logits_of(t, request, n_pools).
template <class LogitsOf>
Status select_rows(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerStateHost& state,
                   const LogitsOf& logits_of, IndexerRowsHost* rows) {
  DSA_RETURN_IF_ERROR(check_indexer_batch(plan, step.m, step.positions, step.token_requests, state.requests,
                                          state.block_table_width));
  const int width = indexer_row_width(plan);
  rows->topk_positions.assign(size_t(step.m) * width, -1);
  rows->slots.assign(size_t(step.m) * width, -1);
  rows->errors = 0;
  for (int t = 0; t < step.m; ++t) {
    const int64_t request = step.token_requests[t];
    if (request < 0) continue;  // padding: rows of -1
    const int64_t context = step.positions[t] + 1;
    std::vector<int32_t> top_pools;
    if (context > plan.topk) {
      top_pools = select_top_pools(logits_of(t, request, context / plan.pool), indexer_top_pools(plan));
    }
    int32_t* positions = &rows->topk_positions[size_t(t) * width];
    expand_row(plan, context, top_pools, positions);
    rows->errors += remap_row(plan, state, request, positions, width, &rows->slots[size_t(t) * width]);
  }
  return Status();
}

}  // namespace

Status indexer_select(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerQueryHost& query,
                      const IndexerStateHost& state, IndexerRowsHost* rows) {
  return select_rows(
      plan, step, state,
      [&](int t, int64_t request, int64_t n_pools) {
        const size_t row = size_t(t) * plan.heads;
        return indexer_logits(plan, state, request, n_pools, &query.q_fp8[row * kDim], &query.head_weights[row]);
      },
      rows);
}

Status indexer_select_on_logits(const IndexerPlan& plan, const IndexerStepHost& step,
                                const std::vector<std::vector<float>>& logits, const IndexerStateHost& state,
                                IndexerRowsHost* rows) {
  if (logits.size() != size_t(step.m)) {
    return invalid_argument("logits", std::to_string(step.m) + " rows (one per token)", std::to_string(logits.size()));
  }
  for (int t = 0; t < step.m; ++t) {
    const int64_t context = step.token_requests[t] < 0 ? 0 : step.positions[t] + 1;
    if (context > plan.topk && logits[t].size() != size_t(context / plan.pool)) {
      return invalid_argument("logits[" + std::to_string(t) + "]",
                              std::to_string(context / plan.pool) + " pools (L / pool)",
                              std::to_string(logits[t].size()));
    }
  }
  return select_rows(
      plan, step, state, [&](int t, int64_t, int64_t) { return logits[t]; }, rows);
}

IndexerProjectionsHost indexer_project(const IndexerProjectInputsHost& in) {
  IndexerProjectionsHost out;
  out.index_q = exact_product(in.q_c, in.m, in.q_lora, in.wq_b, int64_t(in.heads) * kDim);
  out.index_k = exact_product(in.x, in.m, in.hidden, in.wk, kDim);
  out.head_weights = exact_product(in.x, in.m, in.hidden, in.weights_proj, in.heads);
  if (in.compress_gate != nullptr) out.gate = exact_product(in.x, in.m, in.hidden, in.compress_gate, kDim);
  return out;
}

IndexerProjectionBitsHost indexer_project_gemv(const IndexerProjectInputsHost& in) {
  const auto bf16 = [](const std::vector<float>& sums) {
    std::vector<uint16_t> bits(sums.size());
    std::transform(sums.begin(), sums.end(), bits.begin(), [](float sum) { return num::float_to_bf16(sum); });
    return bits;
  };
  IndexerProjectionBitsHost out;
  out.index_q = bf16(gemv_sums(in.q_c, in.m, in.q_lora, in.wq_b, int64_t(in.heads) * kDim));
  out.index_k = bf16(gemv_sums(in.x, in.m, in.hidden, in.wk, kDim));
  out.head_weights = gemv_sums(in.x, in.m, in.hidden, in.weights_proj, in.heads);
  if (in.compress_gate != nullptr) out.gate = bf16(gemv_sums(in.x, in.m, in.hidden, in.compress_gate, kDim));
  return out;
}

double projection_expected(double sum, DType output) {
  return output == DType::kBF16 ? num::round_bf16(static_cast<float>(sum)) : sum;
}

double projection_tolerance(double got, double expected, double magnitude, DType output) {
  const double sum_term = kProjectionSumTolerance * magnitude;
  if (output != DType::kBF16) return sum_term;
  // A BF16 value in [2^(e-1), 2^e) has an ulp of 2^(e-8); zero and the subnormals have 2^-133.
  constexpr int kSmallestUlpExponent = -133;
  const double larger = std::max(std::fabs(got), std::fabs(expected));
  int exponent = kSmallestUlpExponent + 8;
  if (larger != 0.0) std::frexp(larger, &exponent);
  return std::ldexp(1.0, std::max(exponent - 8, kSmallestUlpExponent)) + sum_term;
}

}  // namespace dsa::reference
