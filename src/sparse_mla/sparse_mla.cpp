// sparse_mla's API (include/dsa_decode/sparse_mla.h): the argument checks
// shared by every sparse MLA kernel, the buffer sizes, and the plan choice
// that calls the kernels (the 64-head split kernel, the producer kernel, the
// 8-head kernel); the kernel files hold the kernels and their launches.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/sparse_mla.h"
#include "core/shared_memory.h"
#include "sparse_mla/sparse_mla_checks.h"
#include "sparse_mla/sparse_mla_plan.h"

namespace dsa {

std::string check_range_text(int64_t low, int64_t high) {
  return std::to_string(low) + ".." + std::to_string(high);
}

Status check_query_layout(const TensorView& q, int64_t width, int64_t max_tokens, int64_t max_heads,
                          int64_t multiple) {
  const int64_t m = q.size(0), heads = q.size(1);
  if (m < 1 || m > max_tokens) {
    return invalid_argument("q", check_range_text(1, max_tokens) + " tokens in dim 0", q.describe());
  }
  if (heads < 1 || heads > max_heads) {
    return invalid_argument("q", check_range_text(1, max_heads) + " heads in dim 1", q.describe());
  }
  DSA_RETURN_IF_ERROR(check_stride(q, "q", 2, 1));
  // A size-1 dimension's stride is never used (tensor.h): one token's goes
  // unchecked, and a token of one head spans just the head's width.
  const int64_t q_head_stride = heads > 1 ? q.stride(1) : width;
  if ((heads > 1 && (q_head_stride % multiple != 0 || q_head_stride < width)) ||
      (m > 1 && (q.stride(0) % multiple != 0 || q.stride(0) < heads * q_head_stride))) {
    return invalid_argument(
        "q", "head and token strides that are multiples of " + std::to_string(multiple) + " and do not overlap",
        q.describe());
  }
  return check_aligned(q, "q", 16);
}

Status check_paged_cache_layout(const TensorView& c, int64_t width) {
  if (c.size(0) < 1 || c.size(1) < 1) {
    return invalid_argument("kv_cache", "at least one block of at least one entry", c.describe());
  }
  DSA_RETURN_IF_ERROR(check_stride(c, "kv_cache", 2, 1));
  // Likewise one block's stride, and a block of one entry spans just the entry's width.
  const int64_t blocks = c.size(0), block_size = c.size(1);
  const int64_t entry_stride = block_size > 1 ? c.stride(1) : width;
  // The products may not wrap: a wrapped block span would pass the overlap test.
  int64_t block_span = 0, cache_span = 0;
  const bool wraps = __builtin_mul_overflow(block_size, entry_stride, &block_span) ||
                     __builtin_mul_overflow(blocks - 1, blocks > 1 ? c.stride(0) : 0, &cache_span) ||
                     __builtin_add_overflow(cache_span, block_span, &cache_span);
  if (wraps || (block_size > 1 && (entry_stride % 16 != 0 || entry_stride < width)) ||
      (blocks > 1 && (c.stride(0) % 16 != 0 || c.stride(0) < block_span))) {
    return invalid_argument("kv_cache", "entry and block strides that are multiples of 16 and do not overlap",
                            c.describe());
  }
  return check_aligned(c, "kv_cache", 16);
}

Status check_index_rows(const TensorView& indices, int64_t m, int64_t max_top_k) {
  DSA_RETURN_IF_ERROR(check_dtype(indices, "indices", DType::kI32));
  DSA_RETURN_IF_ERROR(check_shape(indices, "indices", {m, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(indices, "indices"));
  const int64_t top_k = indices.size(1);
  if (top_k < 1 || top_k > max_top_k) {
    return invalid_argument("indices", check_range_text(1, max_top_k) + " entries per token in dim 1",
                            indices.describe());
  }
  DSA_RETURN_IF_ERROR(check_stride(indices, "indices", 1, 1));
  if (m > 1 && indices.stride(0) < top_k) {
    return invalid_argument("indices", "a token stride of at least K (rows do not overlap)", indices.describe());
  }
  return check_aligned(indices, "indices", 4);
}

Status check_softmax_scale(float softmax_scale) {
  if (!std::isfinite(softmax_scale) || !(softmax_scale > 0.0f)) {
    return invalid_argument("softmax_scale", "a finite value > 0", std::to_string(softmax_scale));
  }
  return Status();
}

Status check_lse(const TensorView& lse, int64_t m, int64_t heads) {
  DSA_RETURN_IF_ERROR(check_dtype(lse, "lse", DType::kF32));
  DSA_RETURN_IF_ERROR(check_shape(lse, "lse", {m, heads}));
  DSA_RETURN_IF_ERROR(check_on_cuda(lse, "lse"));
  DSA_RETURN_IF_ERROR(check_aligned(lse, "lse", 4));
  if (!lse.is_contiguous()) return invalid_argument("lse", "a contiguous tensor", lse.describe());
  return Status();
}

Status check_written_disjoint(const std::vector<std::pair<const TensorView*, const char*>>& written,
                              const std::vector<std::pair<const TensorView*, const char*>>& arguments) {
  for (const auto& [out, out_name] : written) {
    for (const auto& [other, other_name] : arguments) {
      if (other != out) DSA_RETURN_IF_ERROR(check_no_overlap(*out, out_name, *other, other_name));
    }
  }
  return Status();
}

int64_t sparse_mla_split_counter_count(int64_t m, int64_t heads, int64_t /*top_k*/) { return m * heads; }

int64_t sparse_mla_split_partials_count(int64_t m, int64_t heads, int64_t top_k) {
  const int k = static_cast<int>(std::clamp<int64_t>(top_k, 1, kSparseMlaMaxTopK));
  return sparse_mla_wgmma_partials_count(m, heads, k, kSparseMlaWgmmaDefaultSplits, kSparseMlaWgmmaDefaultCluster);
}

namespace {

Status check_scale(const TensorView& scale, const char* name) {
  DSA_RETURN_IF_ERROR(check_dtype(scale, name, DType::kF32));
  DSA_RETURN_IF_ERROR(check_shape(scale, name, {1}));
  DSA_RETURN_IF_ERROR(check_aligned(scale, name, 4));
  return check_on_cuda(scale, name);
}

// split_partials for a plan that needs `count` values (none: it may be empty).
Status check_split_partials(const TensorView& partials, int64_t count) {
  DSA_RETURN_IF_ERROR(check_dtype(partials, "split_partials", DType::kF32));
  DSA_RETURN_IF_ERROR(check_shape(partials, "split_partials", {-1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(partials, "split_partials"));
  if (partials.size(0) < count || (partials.size(0) > 1 && partials.stride(0) != 1)) {
    return invalid_argument("split_partials",
                            "a contiguous vector of at least " + std::to_string(count) +
                                " values (sparse_mla_split_partials_count(m, H, K) for sparse_mla)",
                            partials.describe());
  }
  return check_aligned(partials, "split_partials", 16);
}

constexpr int64_t kWgmmaHeads = 64;  // heads per CTA of the 64-head kernels

// The key under which the 8-head kernel's cluster occupancy is kept per
// cluster size (kernel_answer_once).
constexpr char kMmaClustersQuestion = 0;

}  // namespace

namespace {

// Every check; split_partials against partials_for(m, H, K) values, asked
// once q and indices have passed.
Status check_sparse_mla_against(const SparseMlaArgs& a,
                                const std::function<int64_t(int64_t m, int64_t heads, int top_k)>& partials_for) {
  constexpr int64_t L = kSparseMlaLatent;

  DSA_RETURN_IF_ERROR(check_dtype(a.q, "q", DType::kFP8E4M3));
  DSA_RETURN_IF_ERROR(check_shape(a.q, "q", {-1, -1, L}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.q, "q"));
  const int64_t m = a.q.size(0), heads = a.q.size(1);
  DSA_RETURN_IF_ERROR(check_query_layout(a.q, L, kSparseMlaMaxTokens, kSparseMlaMaxHeads, 16));  // e4m3: 16 bytes
  DSA_RETURN_IF_ERROR(check_scale(a.q_scale, "q_scale"));

  DSA_RETURN_IF_ERROR(check_dtype(a.kv_cache, "kv_cache", DType::kFP8E4M3));
  DSA_RETURN_IF_ERROR(check_shape(a.kv_cache, "kv_cache", {-1, -1, L}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.kv_cache, "kv_cache"));
  DSA_RETURN_IF_ERROR(check_paged_cache_layout(a.kv_cache, L));
  DSA_RETURN_IF_ERROR(check_scale(a.k_scale, "k_scale"));

  DSA_RETURN_IF_ERROR(check_index_rows(a.indices, m, kSparseMlaMaxTopK));
  const int64_t top_k = a.indices.size(1);
  DSA_RETURN_IF_ERROR(check_softmax_scale(a.softmax_scale));

  if (a.plan != SparseMlaPlan::kAuto && a.plan != SparseMlaPlan::kBatchInvariant) {
    return invalid_argument("plan", "SparseMlaPlan::kAuto (0) or kBatchInvariant (1)",
                            std::to_string(static_cast<int32_t>(a.plan)));
  }

  // The layout head_gemv's x takes, so that the latent feeds W_UV directly.
  DSA_RETURN_IF_ERROR(check_head_rows(a.latent, "latent", DType::kBF16, m, heads, L));

  DSA_RETURN_IF_ERROR(check_lse(a.lse, m, heads));

  DSA_RETURN_IF_ERROR(check_dtype(a.split_counters, "split_counters", DType::kI32));
  DSA_RETURN_IF_ERROR(check_shape(a.split_counters, "split_counters", {-1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.split_counters, "split_counters"));
  const int64_t counters = sparse_mla_split_counter_count(m, heads, top_k);
  if (a.split_counters.size(0) < counters || (a.split_counters.size(0) > 1 && a.split_counters.stride(0) != 1)) {
    return invalid_argument("split_counters",
                            "a contiguous vector of at least sparse_mla_split_counter_count(m, H, K) = " +
                                std::to_string(counters) + " counters",
                            a.split_counters.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(a.split_counters, "split_counters", 4));

  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));

  const int64_t partials = partials_for(m, heads, static_cast<int>(top_k));
  const bool has_partials = a.split_partials.data != nullptr;
  if (partials > 0 || has_partials) {
    DSA_RETURN_IF_ERROR(check_split_partials(a.split_partials, partials));
  }

  // What a launch writes (latent, lse, the split buffers) shares no memory
  // with anything else it is given.
  std::vector<std::pair<const TensorView*, const char*>> written = {
      {&a.latent, "latent"}, {&a.lse, "lse"}, {&a.split_counters, "split_counters"}};
  if (has_partials) written.push_back({&a.split_partials, "split_partials"});
  std::vector<std::pair<const TensorView*, const char*>> arguments = {
      {&a.q, "q"},           {&a.q_scale, "q_scale"}, {&a.kv_cache, "kv_cache"},
      {&a.k_scale, "k_scale"}, {&a.indices, "indices"}, {&a.latent, "latent"},
      {&a.lse, "lse"},       {&a.split_counters, "split_counters"}};
  if (has_partials) arguments.push_back({&a.split_partials, "split_partials"});
  return check_written_disjoint(written, arguments);
}

}  // namespace

Status check_sparse_mla(const SparseMlaArgs& a) {
  return check_sparse_mla_for_plan(a, kSparseMlaWgmmaDefaultSplits, kSparseMlaWgmmaDefaultCluster);
}

Status check_sparse_mla_for_plan(const SparseMlaArgs& a, int max_splits, int max_cluster) {
  return check_sparse_mla_against(a, [&](int64_t m, int64_t heads, int top_k) {
    return sparse_mla_wgmma_partials_count(m, heads, top_k, max_splits, max_cluster);
  });
}

Status check_sparse_mla_without_partials(const SparseMlaArgs& a) {
  return check_sparse_mla_against(a, [](int64_t, int64_t, int) { return int64_t(0); });
}

SparseMlaSplits sparse_mla_splits_of(SparseMlaPlan plan) {
  return plan == SparseMlaPlan::kBatchInvariant ? SparseMlaSplits::kLatency : SparseMlaSplits::kByBatch;
}

Status sparse_mla_wgmma(const SparseMlaArgs& a, SparseMlaSplits splits, cudaStream_t stream) {
  const int top_k = a.indices.ndim == 2 ? static_cast<int>(a.indices.size(1)) : 0;  // checked by the launch
  int max_splits = sparse_mla_wgmma_max_splits(top_k, splits);
  if (splits == SparseMlaSplits::kWholeRow || splits == SparseMlaSplits::kByBatch) {
    DSA_RETURN_IF_ERROR(check_sparse_mla(a));  // the caller's buffers as for every choice, before any device question
    const bool producer_covers = sparse_mla_producer_covers(top_k, a.kv_cache.span_elements());
    if (splits == SparseMlaSplits::kWholeRow) {
      if (producer_covers) return sparse_mla_producer(a, stream);
    } else {
      const int64_t items = a.q.size(0) * (a.q.size(1) / kWgmmaHeads);
      int resident = 0, producer_resident = 0;
      DSA_RETURN_IF_ERROR(sparse_mla_wgmma_resident_ctas(&resident));
      max_splits = sparse_mla_wgmma_batch_max_splits(top_k, items, resident);
      if (producer_covers) {
        DSA_RETURN_IF_ERROR(sparse_mla_producer_resident_ctas(&producer_resident));
        if (sparse_mla_batch_takes_producer(top_k, items, max_splits, resident, producer_resident)) {
          return sparse_mla_producer(a, stream);
        }
      }
    }
  }
  return sparse_mla_wgmma_with_plan(a, max_splits, kSparseMlaWgmmaDefaultCluster, stream);
}

Status sparse_mla_mma(const SparseMlaArgs& a, SparseMlaSplits splits, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sparse_mla(a));
  const int heads = static_cast<int>(a.q.size(1)), top_k = static_cast<int>(a.indices.size(1));
  if (splits != SparseMlaSplits::kByBatch) {
    return sparse_mla_mma_launch(a, sparse_mla_split_plan(heads, top_k, splits), stream);
  }
  // The plan with the most splits whose (token, group) clusters the GPU runs
  // all at once, else the fewest; the occupancy answer is asked once per
  // cluster size. A part that cannot answer for a cluster size (or schedule
  // it) answers 0 and gets the next plan: the last one always launches.
  const std::array<SparseMlaSplitPlan, 3> plans = sparse_mla_batch_split_plans(heads, top_k);
  SparseMlaSplitPlan plan = plans.back();
  for (size_t i = 0; i + 1 < plans.size(); ++i) {
    int clusters = 0;
    DSA_RETURN_IF_ERROR(kernel_answer_once(
        &kMmaClustersQuestion, plans[i].splits,
        [&](int* answer) { return sparse_mla_max_active_clusters(plans[i], heads, top_k, answer); }, &clusters));
    if (a.q.size(0) * plans[i].head_groups <= clusters) {
      plan = plans[i];
      break;
    }
  }
  return sparse_mla_mma_launch(a, plan, stream);
}

Status sparse_mla_with_splits(const SparseMlaArgs& a, SparseMlaSplits splits, cudaStream_t stream) {
  // Each kernel's entry checks the arguments (once); here only q's head count is read.
  const bool heads_in_64s = a.q.ndim == 3 && a.q.size(1) > 0 && a.q.size(1) % 64 == 0;
  return heads_in_64s ? sparse_mla_wgmma(a, splits, stream) : sparse_mla_mma(a, splits, stream);
}

Status sparse_mla(const SparseMlaArgs& a, cudaStream_t stream) {
  return sparse_mla_with_splits(a, sparse_mla_splits_of(a.plan), stream);
}

}  // namespace dsa
