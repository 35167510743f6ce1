// The indexer's plan, workspace layout and argument checks
// (include/dsa_decode/indexer.h), shared by every indexer kernel.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "dsa_decode/indexer.h"
#include "indexer/indexer_project_gate.h"

namespace dsa {

namespace {

std::string range(int64_t low, int64_t high) { return std::to_string(low) + ".." + std::to_string(high); }

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Tokens a block table of `width` blocks holds, saturating: a width near
// 2^62 (one request's row may be that wide) must not overflow.
int64_t table_token_limit(int64_t width, int64_t block_size) {
  int64_t tokens;
  if (width < 0) return 0;
  return __builtin_mul_overflow(width, block_size, &tokens) ? INT64_MAX : tokens;
}

// A contiguous FP32 parameter of the given shape on the device.
Status check_parameter(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, DType::kF32));
  DSA_RETURN_IF_ERROR(check_shape(t, name, shape));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  if (!t.is_contiguous()) return invalid_argument(name, "a contiguous tensor", t.describe());
  return check_aligned(t, name, 4);
}

// [m, width] rows of `dtype`, dim 1 contiguous, the stride of dim 0 (a
// `row_kind` stride in the message) a multiple of `stride_multiple` and
// >= width (any for a single row), data 16-byte aligned.
Status check_rows(const TensorView& t, const char* name, DType dtype, int64_t m, int64_t width,
                  int64_t stride_multiple, const char* row_kind = "token") {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, dtype));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {m, width}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 1, 1));
  if (m > 1 && (t.stride(0) % stride_multiple != 0 || t.stride(0) < width)) {
    return invalid_argument(name, std::string("a ") + row_kind + " stride that is a multiple of " +
                                      std::to_string(stride_multiple) + " and at least " + std::to_string(width),
                            t.describe());
  }
  return check_aligned(t, name, 16);
}

// A contiguous [m] vector of `dtype` on the device.
Status check_token_vector(const TensorView& t, const char* name, DType dtype, int64_t m) {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, dtype));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {m}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_aligned(t, name, dtype_size(dtype)));
  return check_stride(t, name, 0, 1);
}

using NamedView = std::pair<const TensorView*, const char*>;

// Each written view shares no memory with any other argument of the launch.
Status check_written_apart(std::initializer_list<NamedView> written, std::initializer_list<NamedView> arguments) {
  for (const auto& [out, out_name] : written) {
    if (out->data == nullptr) continue;  // an absent optional output
    for (const auto& [other, other_name] : arguments) {
      if (other != out) DSA_RETURN_IF_ERROR(check_no_overlap(*out, out_name, *other, other_name));
    }
  }
  return Status();
}

// The token count of a step: dim 0 of `t`, within the plan.
Status check_token_count(const TensorView& t, const char* name, const IndexerPlan& plan) {
  if (t.ndim < 1 || t.size(0) < 1 || t.size(0) > plan.max_tokens) {
    return invalid_argument(name, "1.." + std::to_string(plan.max_tokens) + " tokens (the plan's max_tokens) in dim 0",
                            t.describe());
  }
  return Status();
}

Status check_k_cache(const IndexerState& s, const IndexerPlan& plan);

Status check_state(const IndexerState& s, const IndexerPlan& plan) {
  DSA_RETURN_IF_ERROR(check_dtype(s.block_table, "block_table", DType::kI32));
  DSA_RETURN_IF_ERROR(check_shape(s.block_table, "block_table", {-1, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(s.block_table, "block_table"));
  const int64_t requests = s.block_table.size(0);
  if (requests < 1 || s.block_table.size(1) < 1) {
    return invalid_argument("block_table", "at least one request of at least one block", s.block_table.describe());
  }
  DSA_RETURN_IF_ERROR(check_stride(s.block_table, "block_table", 1, 1));
  DSA_RETURN_IF_ERROR(check_aligned(s.block_table, "block_table", 4));
  if (requests > 1 && s.block_table.stride(0) < s.block_table.size(1)) {
    return invalid_argument("block_table", "a request stride of at least its width", s.block_table.describe());
  }

  const int64_t ring = plan.ring, dim = kIndexerDim;
  if (plan.pool == 1) return check_k_cache(s, plan);  // no ring
  DSA_RETURN_IF_ERROR(check_dtype(s.ring, "ring", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(s.ring, "ring", {requests, 2, ring, dim}));
  DSA_RETURN_IF_ERROR(check_on_cuda(s.ring, "ring"));
  DSA_RETURN_IF_ERROR(check_stride(s.ring, "ring", 3, 1));
  DSA_RETURN_IF_ERROR(check_stride(s.ring, "ring", 2, dim));
  DSA_RETURN_IF_ERROR(check_stride(s.ring, "ring", 1, ring * dim));
  if (requests > 1 && (s.ring.stride(0) % 8 != 0 || s.ring.stride(0) < 2 * ring * dim)) {
    return invalid_argument("ring", "a request stride that is a multiple of 8 and at least 2*RING*128",
                            s.ring.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(s.ring, "ring", 16));
  return check_k_cache(s, plan);
}

Status check_k_cache(const IndexerState& s, const IndexerPlan& plan) {
  const int64_t page_bytes = indexer_page_bytes(plan);
  DSA_RETURN_IF_ERROR(check_dtype(s.k_cache, "k_cache", DType::kU8));
  DSA_RETURN_IF_ERROR(check_shape(s.k_cache, "k_cache", {-1, page_bytes}));
  DSA_RETURN_IF_ERROR(check_on_cuda(s.k_cache, "k_cache"));
  const int64_t max_blocks = (int64_t(1) << 31) / plan.block_size;  // slots are int32
  if (s.k_cache.size(0) < 1 || s.k_cache.size(0) > max_blocks) {
    return invalid_argument("k_cache", range(1, max_blocks) + " blocks (int32 slots)", s.k_cache.describe());
  }
  DSA_RETURN_IF_ERROR(check_stride(s.k_cache, "k_cache", 1, 1));
  if (s.k_cache.size(0) > 1 && (s.k_cache.stride(0) % 16 != 0 || s.k_cache.stride(0) < page_bytes)) {
    return invalid_argument("k_cache", "a page stride that is a multiple of 16 and at least block_size/pool*132 = " +
                                           std::to_string(page_bytes),
                            s.k_cache.describe());
  }
  return check_aligned(s.k_cache, "k_cache", 16);
}

Status check_workspace(const TensorView& t, const IndexerPlan& plan) {
  DSA_RETURN_IF_ERROR(check_dtype(t, "workspace", DType::kU8));
  DSA_RETURN_IF_ERROR(check_shape(t, "workspace", {-1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, "workspace"));
  const int64_t bytes = indexer_workspace_layout(plan).bytes;
  if (t.size(0) < bytes || t.stride(0) != 1) {
    return invalid_argument("workspace",
                            "a contiguous buffer of at least indexer_workspace_layout(plan).bytes = " +
                                std::to_string(bytes) + " bytes",
                            t.describe());
  }
  return check_aligned(t, "workspace", 256);
}

Status check_norm_parameters(const TensorView& weight, const TensorView& bias, const TensorView& ape,
                             const IndexerPlan& plan) {
  DSA_RETURN_IF_ERROR(check_parameter(weight, "k_norm_weight", {kIndexerDim}));
  DSA_RETURN_IF_ERROR(check_parameter(bias, "k_norm_bias", {kIndexerDim}));
  if (plan.pool == 1) return Status();  // no pooling: no ape
  return check_parameter(ape, "ape", {plan.pool, kIndexerDim});
}

// The RoPE table of a plan with rotated dims: [rows >= max_context, R] F32 or
// BF16, dim 1 contiguous, element-aligned.
Status check_cos_sin(const TensorView& t, const IndexerPlan& plan) {
  if (plan.rope_dims == 0) return Status();
  const char* name = "cos_sin";
  DSA_RETURN_IF_ERROR(check_present(t, name));
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16) {
    return invalid_argument(name, "dtype f32 or bf16 (the RoPE cos/sin table)", t.describe());
  }
  DSA_RETURN_IF_ERROR(check_shape(t, name, {-1, plan.rope_dims}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 1, 1));
  if (t.size(0) < plan.max_context) {
    return invalid_argument(name, "at least plan.max_context = " + std::to_string(plan.max_context) +
                                      " rows (a row per position)",
                            t.describe());
  }
  if (t.size(0) > 1 && t.stride(0) < plan.rope_dims) {
    return invalid_argument(name, "a row stride of at least " + std::to_string(plan.rope_dims), t.describe());
  }
  return check_aligned(t, name, t.dtype == DType::kF32 ? 4 : 2);
}

}  // namespace

Status check_indexer_plan(const IndexerPlan& plan) {
  if (plan.max_tokens < 1 || plan.max_tokens > kIndexerMaxTokens) {
    return invalid_argument("plan.max_tokens", range(1, kIndexerMaxTokens), std::to_string(plan.max_tokens));
  }
  if (plan.max_context < 1 || plan.max_context > kIndexerMaxContext) {
    return invalid_argument("plan.max_context", range(1, kIndexerMaxContext), std::to_string(plan.max_context));
  }
  if (plan.heads != 16 && plan.heads != 32 && plan.heads != 64) {
    return invalid_argument("plan.heads", "16, 32 or 64 index heads", std::to_string(plan.heads));
  }
  if (plan.pool != 1 && plan.pool != 4 && plan.pool != 8 && plan.pool != 16) {
    return invalid_argument("plan.pool", "4, 8 or 16 tokens per pool, or 1 (no pooling)", std::to_string(plan.pool));
  }
  if (plan.rope_dims != 0 && plan.rope_dims != 16 && plan.rope_dims != 32 && plan.rope_dims != 64 &&
      plan.rope_dims != 128) {
    return invalid_argument("plan.rope_dims", "0 (no RoPE), 16, 32, 64 or 128 rotated dims",
                            std::to_string(plan.rope_dims));
  }
  if (plan.rope_dims != 0 && plan.pool != 1) {
    return invalid_argument("plan.rope_dims", "0 with pools of " + std::to_string(plan.pool) +
                                                  " (RoPE applies to per-token keys: plan.pool 1)",
                            std::to_string(plan.rope_dims));
  }
  if (plan.rope_style != RopeStyle::kInterleaved && plan.rope_style != RopeStyle::kHalfSplit) {
    return invalid_argument("plan.rope_style", "RopeStyle::kInterleaved (0) or RopeStyle::kHalfSplit (1)",
                            std::to_string(static_cast<int>(plan.rope_style)));
  }
  if (plan.pool == 1) {
    if (plan.topk < 1 || plan.topk > kIndexerMaxTopTokens) {
      return invalid_argument("plan.topk", range(1, kIndexerMaxTopTokens) + " tokens (plan.pool 1)",
                              std::to_string(plan.topk));
    }
    if (plan.ring != 1) {
      return invalid_argument("plan.ring", "1 (plan.pool 1 keeps no ring)", std::to_string(plan.ring));
    }
    if (plan.block_size < kIndexerTokenBlockMultiple || plan.block_size % kIndexerTokenBlockMultiple != 0) {
      return invalid_argument("plan.block_size", "a positive multiple of 64 tokens (plan.pool 1: a key per token)",
                              std::to_string(plan.block_size));
    }
  } else if (plan.topk < plan.pool || plan.topk % plan.pool != 0 || plan.topk / plan.pool > kIndexerMaxTopPools) {
    return invalid_argument("plan.topk",
                            "a multiple of plan.pool = " + std::to_string(plan.pool) + " in " +
                                range(plan.pool, int64_t(kIndexerMaxTopPools) * plan.pool) + " (at most " +
                                std::to_string(kIndexerMaxTopPools) + " pools)",
                            std::to_string(plan.topk));
  }
  if (plan.pool > 1 && plan.ring != plan.pool && plan.ring != 2 * plan.pool) {
    return invalid_argument("plan.ring",
                            std::to_string(plan.pool) + " (plan.pool: one token per request and step) or " +
                                std::to_string(2 * plan.pool) + " (2 * plan.pool: up to " +
                                std::to_string(plan.pool + 1) + " tokens per request)",
                            std::to_string(plan.ring));
  }
  if (plan.pool > 1 && (plan.block_size < kIndexerBlockMultiple || plan.block_size % kIndexerBlockMultiple != 0)) {
    return invalid_argument("plan.block_size",
                            "a positive multiple of 128 tokens (pages of a multiple of " +
                                std::to_string(128 / plan.pool) + " pools of " + std::to_string(plan.pool) + ")",
                            std::to_string(plan.block_size));
  }
  if (plan.logits != IndexerLogits::kExact && plan.logits != IndexerLogits::kFp32Accumulation) {
    return invalid_argument("plan.logits", "IndexerLogits::kFp32Accumulation (0) or IndexerLogits::kExact (1)",
                            std::to_string(static_cast<int>(plan.logits)));
  }
  return Status();
}

IndexerWorkspaceLayout indexer_workspace_layout(const IndexerPlan& plan) {
  constexpr int64_t kAlign = 256;
  const int64_t m = plan.max_tokens;
  const int64_t pools = (plan.max_context + plan.pool - 1) / plan.pool;
  IndexerWorkspaceLayout layout;
  int64_t offset = 0;
  const auto take = [&](int64_t bytes) {
    const int64_t at = offset;
    offset = round_up(offset + bytes, kAlign);
    return at;
  };
  layout.q_fp8 = take(m * plan.heads * kIndexerDim);
  layout.head_weights = take(m * plan.heads * 4);
  layout.logits = take(m * pools * 4);
  layout.logits_stride = pools;
  layout.bytes = offset;
  return layout;
}

Status check_indexer_prepare(const IndexerPrepareArgs& a) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(a.plan));
  DSA_RETURN_IF_ERROR(check_dtype(a.index_q, "index_q", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_token_count(a.index_q, "index_q", a.plan));
  const int64_t m = a.index_q.size(0);
  DSA_RETURN_IF_ERROR(check_head_rows(a.index_q, "index_q", DType::kBF16, m, a.plan.heads, kIndexerDim));
  DSA_RETURN_IF_ERROR(check_rows(a.index_k, "index_k", DType::kBF16, m, kIndexerDim, 8));
  DSA_RETURN_IF_ERROR(check_rows(a.head_weights, "head_weights", DType::kF32, m, a.plan.heads, 4));
  const bool pooled = a.plan.pool > 1;  // pool 1 reads no gate, ape or ring
  if (pooled) DSA_RETURN_IF_ERROR(check_rows(a.gate, "gate", DType::kBF16, m, kIndexerDim, 8));
  DSA_RETURN_IF_ERROR(check_norm_parameters(a.k_norm_weight, a.k_norm_bias, a.ape, a.plan));
  DSA_RETURN_IF_ERROR(check_token_vector(a.positions, "positions", DType::kI64, m));
  DSA_RETURN_IF_ERROR(check_token_vector(a.token_requests, "token_requests", DType::kI32, m));
  DSA_RETURN_IF_ERROR(check_state(a.state, a.plan));
  DSA_RETURN_IF_ERROR(check_workspace(a.workspace, a.plan));
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));
  DSA_RETURN_IF_ERROR(check_cos_sin(a.cos_sin, a.plan));
  const TensorView none;
  const TensorView& ring = pooled ? a.state.ring : none;
  const TensorView& gate = pooled ? a.gate : none;
  const TensorView& ape = pooled ? a.ape : none;
  const TensorView& cos_sin = a.plan.rope_dims > 0 ? a.cos_sin : none;
  return check_written_apart(
      {{&ring, "ring"}, {&a.state.k_cache, "k_cache"}, {&a.workspace, "workspace"}},
      {{&a.index_q, "index_q"}, {&a.index_k, "index_k"}, {&a.head_weights, "head_weights"}, {&gate, "gate"},
       {&a.k_norm_weight, "k_norm_weight"}, {&a.k_norm_bias, "k_norm_bias"}, {&ape, "ape"},
       {&a.positions, "positions"}, {&a.token_requests, "token_requests"}, {&a.state.block_table, "block_table"},
       {&ring, "ring"}, {&a.state.k_cache, "k_cache"}, {&a.workspace, "workspace"}, {&cos_sin, "cos_sin"}});
}

// The step's tokens and the state, as select and remap read them.
Status check_select_tokens(const IndexerPlan& plan, const TensorView& positions, const TensorView& token_requests,
                           const IndexerState& state) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  DSA_RETURN_IF_ERROR(check_dtype(positions, "positions", DType::kI64));
  DSA_RETURN_IF_ERROR(check_token_count(positions, "positions", plan));
  const int64_t m = positions.size(0);
  DSA_RETURN_IF_ERROR(check_token_vector(positions, "positions", DType::kI64, m));
  DSA_RETURN_IF_ERROR(check_token_vector(token_requests, "token_requests", DType::kI32, m));
  return check_state(state, plan);
}

Status check_indexer_select(const IndexerSelectArgs& a) {
  DSA_RETURN_IF_ERROR(check_select_tokens(a.plan, a.positions, a.token_requests, a.state));
  const int64_t m = a.positions.size(0);
  DSA_RETURN_IF_ERROR(check_workspace(a.workspace, a.plan));
  if (a.topk_positions.data != nullptr) {
    DSA_RETURN_IF_ERROR(check_rows(a.topk_positions, "topk_positions", DType::kI32, m, indexer_row_width(a.plan), 4));
  }
  DSA_RETURN_IF_ERROR(check_rows(a.slots, "slots", DType::kI32, m, indexer_row_width(a.plan), 4));
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));
  // The rows are written while the logits in the workspace are still read.
  return check_written_apart(
      {{&a.slots, "slots"}, {&a.topk_positions, "topk_positions"}, {&a.workspace, "workspace"}},
      {{&a.positions, "positions"}, {&a.token_requests, "token_requests"}, {&a.state.block_table, "block_table"},
       {&a.state.ring, "ring"}, {&a.state.k_cache, "k_cache"}, {&a.workspace, "workspace"}, {&a.slots, "slots"},
       {&a.topk_positions, "topk_positions"}});
}

Status check_indexer_remap(const IndexerRemapArgs& a) {
  DSA_RETURN_IF_ERROR(check_select_tokens(a.plan, a.positions, a.token_requests, a.state));
  const int64_t m = a.positions.size(0);
  DSA_RETURN_IF_ERROR(check_rows(a.topk_positions, "topk_positions", DType::kI32, m, indexer_row_width(a.plan), 4));
  DSA_RETURN_IF_ERROR(check_rows(a.slots, "slots", DType::kI32, m, indexer_row_width(a.plan), 4));
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));
  return check_written_apart({{&a.slots, "slots"}}, {{&a.positions, "positions"},
                                                     {&a.token_requests, "token_requests"},
                                                     {&a.state.block_table, "block_table"},
                                                     {&a.state.k_cache, "k_cache"},
                                                     {&a.topk_positions, "topk_positions"}});
}

Status check_indexer_prefill(const IndexerPrefillArgs& a) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(a.plan));
  DSA_RETURN_IF_ERROR(check_dtype(a.index_k, "index_k", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.index_k, "index_k", {-1, kIndexerDim}));
  const int64_t n = a.index_k.size(0);
  if (n < 1 || n > a.plan.max_context) {
    return invalid_argument("index_k", "1.." + std::to_string(a.plan.max_context) +
                                           " tokens (the plan's max_context) in dim 0",
                            a.index_k.describe());
  }
  DSA_RETURN_IF_ERROR(check_rows(a.index_k, "index_k", DType::kBF16, n, kIndexerDim, 8));
  const bool pooled = a.plan.pool > 1;  // pool 1 reads no gate, ape or ring
  if (pooled) DSA_RETURN_IF_ERROR(check_rows(a.gate, "gate", DType::kBF16, n, kIndexerDim, 8));
  DSA_RETURN_IF_ERROR(check_norm_parameters(a.k_norm_weight, a.k_norm_bias, a.ape, a.plan));
  DSA_RETURN_IF_ERROR(check_state(a.state, a.plan));
  DSA_RETURN_IF_ERROR(check_cos_sin(a.cos_sin, a.plan));
  const int64_t requests = a.state.block_table.size(0);
  if (a.request < 0 || a.request >= requests) {
    return invalid_argument("request", range(0, requests - 1) + " (a row of block_table)", std::to_string(a.request));
  }
  const int64_t table_tokens = table_token_limit(a.state.block_table.size(1), a.plan.block_size);
  if (n > table_tokens) {
    return invalid_argument("index_k", "at most block_table width * block_size = " + std::to_string(table_tokens) +
                                           " tokens",
                            a.index_k.describe());
  }
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));
  const TensorView none;
  const TensorView& ring = pooled ? a.state.ring : none;
  const TensorView& gate = pooled ? a.gate : none;
  const TensorView& ape = pooled ? a.ape : none;
  const TensorView& cos_sin = a.plan.rope_dims > 0 ? a.cos_sin : none;
  return check_written_apart({{&ring, "ring"}, {&a.state.k_cache, "k_cache"}},
                             {{&a.index_k, "index_k"}, {&gate, "gate"}, {&a.k_norm_weight, "k_norm_weight"},
                              {&a.k_norm_bias, "k_norm_bias"}, {&ape, "ape"}, {&a.state.block_table, "block_table"},
                              {&ring, "ring"}, {&a.state.k_cache, "k_cache"}, {&cos_sin, "cos_sin"}});
}

Status check_indexer_project(const IndexerProjectArgs& a) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(a.plan));
  DSA_RETURN_IF_ERROR(check_dtype(a.q_c, "q_c", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.q_c, "q_c", {-1, -1}));
  DSA_RETURN_IF_ERROR(check_token_count(a.q_c, "q_c", a.plan));
  const int64_t m = a.q_c.size(0), q_lora = a.q_c.size(1);
  if (q_lora < 1) return invalid_argument("q_c", "at least one column (Q = q_lora_rank)", a.q_c.describe());
  DSA_RETURN_IF_ERROR(check_rows(a.q_c, "q_c", DType::kBF16, m, q_lora, 8));
  DSA_RETURN_IF_ERROR(check_dtype(a.x, "x", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.x, "x", {m, -1}));
  const int64_t hidden = a.x.size(1);
  if (hidden < 1) return invalid_argument("x", "at least one column (D = hidden)", a.x.describe());
  DSA_RETURN_IF_ERROR(check_rows(a.x, "x", DType::kBF16, m, hidden, 8));
  // 16-byte row strides: cuBLASLt is asked for algorithms that need no more
  // than 16-byte alignment of every column it reads or writes.
  const int64_t heads = a.plan.heads;
  DSA_RETURN_IF_ERROR(check_rows(a.wq_b, "wq_b", DType::kBF16, heads * kIndexerDim, q_lora, 8, "row"));
  DSA_RETURN_IF_ERROR(check_rows(a.wk, "wk", DType::kBF16, kIndexerDim, hidden, 8, "row"));
  DSA_RETURN_IF_ERROR(check_rows(a.weights_proj, "weights_proj", DType::kBF16, heads, hidden, 8, "row"));
  // Pool 1 (DeepSeek-V3.2) has no compress gate: compress_gate and gate may
  // both be empty there, and then no gate is computed.
  const bool with_gate = indexer_project_computes_gate(a);
  if (with_gate) {
    DSA_RETURN_IF_ERROR(check_rows(a.compress_gate, "compress_gate", DType::kBF16, kIndexerDim, hidden, 8, "row"));
  }
  DSA_RETURN_IF_ERROR(check_head_rows(a.index_q, "index_q", DType::kBF16, m, heads, kIndexerDim));
  DSA_RETURN_IF_ERROR(check_rows(a.index_k, "index_k", DType::kBF16, m, kIndexerDim, 8));
  DSA_RETURN_IF_ERROR(check_rows(a.head_weights, "head_weights", DType::kF32, m, heads, 4));
  if (with_gate) DSA_RETURN_IF_ERROR(check_rows(a.gate, "gate", DType::kBF16, m, kIndexerDim, 8));
  const TensorView none;
  const TensorView& compress_gate = with_gate ? a.compress_gate : none;
  const TensorView& gate = with_gate ? a.gate : none;
  return check_written_apart(
      {{&a.index_q, "index_q"}, {&a.index_k, "index_k"}, {&a.head_weights, "head_weights"}, {&gate, "gate"}},
      {{&a.q_c, "q_c"}, {&a.x, "x"}, {&a.wq_b, "wq_b"}, {&a.wk, "wk"}, {&a.weights_proj, "weights_proj"},
       {&compress_gate, "compress_gate"}, {&a.index_q, "index_q"}, {&a.index_k, "index_k"},
       {&a.head_weights, "head_weights"}, {&gate, "gate"}});
}

Status check_indexer_batch(const IndexerPlan& plan, int m, const int64_t* positions, const int32_t* token_requests,
                           int64_t requests, int64_t block_table_width) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  if (m < 1 || m > plan.max_tokens) return invalid_argument("m", range(1, plan.max_tokens), std::to_string(m));
  const int64_t position_limit = std::min(plan.max_context, table_token_limit(block_table_width, plan.block_size));
  for (int t = 0; t < m; ++t) {
    const std::string token = "token_requests[" + std::to_string(t) + "]";
    const int32_t request = token_requests[t];
    if (request < 0) continue;  // padding
    if (request >= requests) {
      return invalid_argument(token, "a request in " + range(0, requests - 1) + " or negative (padding)",
                              std::to_string(request));
    }
    const int64_t position = positions[t];
    if (position < 0 || position >= position_limit) {
      return invalid_argument("positions[" + std::to_string(t) + "]",
                              range(0, position_limit - 1) + " (within max_context and the block table)",
                              std::to_string(position));
    }
    // The request's earlier tokens in this step: the last must be position - 1.
    int earlier = 0;
    int64_t previous = -1;
    for (int u = 0; u < t; ++u) {
      if (token_requests[u] != request) continue;
      ++earlier;
      previous = positions[u];
    }
    if (earlier > 0 && previous != position - 1) {
      return invalid_argument("positions[" + std::to_string(t) + "]",
                              "position " + std::to_string(previous + 1) + " (one after the request's previous token)",
                              std::to_string(position));
    }
    if (earlier + 1 > indexer_tokens_per_request(plan)) {
      return invalid_argument(token, "at most RING - (pool - 1) = " + std::to_string(indexer_tokens_per_request(plan)) +
                                         " tokens of one request per step",
                              std::to_string(earlier + 1) + " tokens of request " + std::to_string(request));
    }
  }
  return Status();
}

}  // namespace dsa
