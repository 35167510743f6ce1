// sparse_mla_v32's API (include/dsa_decode/sparse_mla_v32.h): the argument
// checks of the cache write and the attention, and the plan choice; the
// kernels and their launches are in sparse_mla_v32_kernel.cu.
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "sparse_mla/sparse_mla_checks.h"
#include "sparse_mla_v32/sparse_mla_v32_plan.h"

namespace dsa {

namespace {

constexpr int64_t kEntry = kSparseMlaV32EntryBytes;

// The cache as both launches read and write it: [blocks, block_size, 656]
// bytes (u8 or fp8_e4m3), 16-byte units.
Status check_cache(const TensorView& c) {
  DSA_RETURN_IF_ERROR(check_present(c, "kv_cache"));
  if (c.dtype != DType::kU8 && c.dtype != DType::kFP8E4M3) {
    return invalid_argument("kv_cache", "dtype u8 or fp8_e4m3 (656-byte entries)", c.describe());
  }
  DSA_RETURN_IF_ERROR(check_shape(c, "kv_cache", {-1, -1, kEntry}));
  DSA_RETURN_IF_ERROR(check_on_cuda(c, "kv_cache"));
  return check_paged_cache_layout(c, kEntry);
}

// BF16 rows [m, width] read 16 bytes at a time.
Status check_rows(const TensorView& t, const char* name, int64_t m, int64_t width) {
  DSA_RETURN_IF_ERROR(check_present(t, name));
  DSA_RETURN_IF_ERROR(check_dtype(t, name, DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {m, width}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 1, 1));
  if (m > 1 && (t.stride(0) % 8 != 0 || t.stride(0) < width)) {
    return invalid_argument(name, "a token stride that is a multiple of 8 and at least " + std::to_string(width),
                            t.describe());
  }
  return check_aligned(t, name, 16);
}

// Streaming multiprocessors of the current device, asked once per device.
Status sm_count(int* count) {
  static int answers[64] = {};
  int device = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  if (device < 0 || device >= 64) return unsupported("sparse_mla_v32: device index " + std::to_string(device));
  if (answers[device] == 0) {
    int value = 0;
    DSA_CUDA_RETURN(cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device));
    answers[device] = value;
  }
  *count = answers[device];
  return Status();
}

}  // namespace

Status check_sparse_mla_v32_cache_write(const SparseMlaV32CacheWriteArgs& a) {
  DSA_RETURN_IF_ERROR(check_present(a.kv_c, "kv_c"));
  DSA_RETURN_IF_ERROR(check_shape(a.kv_c, "kv_c", {-1, kSparseMlaV32Latent}));
  const int64_t m = a.kv_c.size(0);
  if (m < 1 || m > kSparseMlaV32MaxTokens) {
    return invalid_argument("kv_c", check_range_text(1, kSparseMlaV32MaxTokens) + " tokens in dim 0", a.kv_c.describe());
  }
  DSA_RETURN_IF_ERROR(check_rows(a.kv_c, "kv_c", m, kSparseMlaV32Latent));
  DSA_RETURN_IF_ERROR(check_rows(a.k_pe, "k_pe", m, kSparseMlaV32Rope));
  DSA_RETURN_IF_ERROR(check_present(a.slot_mapping, "slot_mapping"));
  DSA_RETURN_IF_ERROR(check_dtype(a.slot_mapping, "slot_mapping", DType::kI64));
  DSA_RETURN_IF_ERROR(check_shape(a.slot_mapping, "slot_mapping", {-1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.slot_mapping, "slot_mapping"));
  if (a.slot_mapping.size(0) < 1 || (a.slot_mapping.size(0) > 1 && a.slot_mapping.stride(0) != 1)) {
    return invalid_argument("slot_mapping", "a contiguous vector of at least one slot", a.slot_mapping.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(a.slot_mapping, "slot_mapping", 8));
  DSA_RETURN_IF_ERROR(check_cache(a.kv_cache));
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));
  return check_written_disjoint({{&a.kv_cache, "kv_cache"}}, {{&a.kv_c, "kv_c"},
                                                       {&a.k_pe, "k_pe"},
                                                       {&a.slot_mapping, "slot_mapping"},
                                                       {&a.kv_cache, "kv_cache"}});
}

Status check_sparse_mla_v32(const SparseMlaV32Args& a) {
  constexpr int64_t D = kSparseMlaV32HeadDim, L = kSparseMlaV32Latent;
  DSA_RETURN_IF_ERROR(check_present(a.q, "q"));
  DSA_RETURN_IF_ERROR(check_dtype(a.q, "q", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.q, "q", {-1, -1, D}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.q, "q"));
  const int64_t m = a.q.size(0), heads = a.q.size(1);
  DSA_RETURN_IF_ERROR(check_query_layout(a.q, D, kSparseMlaV32MaxTokens, kSparseMlaV32MaxHeads, 8));  // BF16: 16 bytes

  DSA_RETURN_IF_ERROR(check_cache(a.kv_cache));

  DSA_RETURN_IF_ERROR(check_present(a.indices, "indices"));
  DSA_RETURN_IF_ERROR(check_index_rows(a.indices, m, kSparseMlaV32MaxTopK));
  DSA_RETURN_IF_ERROR(check_softmax_scale(a.softmax_scale));

  DSA_RETURN_IF_ERROR(check_present(a.latent, "latent"));
  DSA_RETURN_IF_ERROR(check_head_rows(a.latent, "latent", DType::kBF16, m, heads, L));
  DSA_RETURN_IF_ERROR(check_present(a.lse, "lse"));
  DSA_RETURN_IF_ERROR(check_lse(a.lse, m, heads));
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));

  return check_written_disjoint({{&a.latent, "latent"}, {&a.lse, "lse"}}, {{&a.q, "q"},
                                                                  {&a.kv_cache, "kv_cache"},
                                                                  {&a.indices, "indices"},
                                                                  {&a.latent, "latent"},
                                                                  {&a.lse, "lse"}});
}

Status sparse_mla_v32_cache_write(const SparseMlaV32CacheWriteArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sparse_mla_v32_cache_write(a));
  return sparse_mla_v32_cache_write_launch(a, stream);
}

Status sparse_mla_v32_with_max_splits(const SparseMlaV32Args& a, int max_splits, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sparse_mla_v32(a));
  if (max_splits < 1 || max_splits > kSparseMlaV32MaxSplits) {
    return invalid_argument("max_splits", check_range_text(1, kSparseMlaV32MaxSplits), std::to_string(max_splits));
  }
  int sms = 0;
  DSA_RETURN_IF_ERROR(sm_count(&sms));
  const int64_t m = a.q.size(0);
  const int heads = static_cast<int>(a.q.size(1)), top_k = static_cast<int>(a.indices.size(1));
  SparseMlaV32Plan plan = sparse_mla_v32_plan(m, heads, top_k, sms, max_splits);
  if (plan.splits > 8) {
    // Clusters above the portable 8 where the part schedules them (a MIG
    // slice or a smaller GPC may not): else the plan of at most 8.
    int clusters = 0;
    DSA_RETURN_IF_ERROR(sparse_mla_v32_max_active_clusters(plan.splits, &clusters));
    if (clusters == 0) plan = sparse_mla_v32_plan(m, heads, top_k, sms, 8);
  }
  return sparse_mla_v32_launch(a, plan, stream);
}

Status sparse_mla_v32(const SparseMlaV32Args& a, cudaStream_t stream) {
  return sparse_mla_v32_with_max_splits(a, kSparseMlaV32MaxSplits, stream);
}

}  // namespace dsa
