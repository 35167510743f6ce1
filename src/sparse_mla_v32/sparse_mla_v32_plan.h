// sparse_mla_v32's work split (host side, shared by the API file, the kernel
// file, the tests and the benchmark): CTA (split, 16-head group, token); the
// splits of a (token, group) form one cluster and combine through distributed
// shared memory.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dsa_decode/sparse_mla_v32.h"
#include "dsa_decode/status.h"

namespace dsa {

inline constexpr int kSparseMlaV32CtaHeads = 16;        // heads per CTA (two 8-wide MMA tiles)
inline constexpr int kSparseMlaV32ChunkRows = 64;       // entries per chunk
inline constexpr int kSparseMlaV32MaxRowsPerSplit = 1024;  // entries a CTA stages
inline constexpr int kSparseMlaV32MaxSplits = 16;       // the largest cluster on Hopper (non-portable above 8)

struct SparseMlaV32Plan {
  int head_groups = 1;     // ceil(H / 16)
  int splits = 1;          // CTAs per (token, group), one cluster
  int rows_per_split = 64;  // a multiple of 64, <= 1024; splits = ceil(K / rows_per_split)
};

inline int sparse_mla_v32_ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// The most splits whose CTAs the GPU's `sm_count` SMs run in one wave (at most
// max_splits, at most one per 64-entry chunk, at least as many as keep a
// split's entries within 1024), balanced into whole chunks. m, H, K within
// the checked ranges; max_splits in 1..16.
inline SparseMlaV32Plan sparse_mla_v32_plan(int64_t m, int heads, int top_k, int sm_count, int max_splits) {
  SparseMlaV32Plan plan;
  plan.head_groups = sparse_mla_v32_ceil_div(heads, kSparseMlaV32CtaHeads);
  const int chunks = sparse_mla_v32_ceil_div(top_k, kSparseMlaV32ChunkRows);
  const int least = sparse_mla_v32_ceil_div(top_k, kSparseMlaV32MaxRowsPerSplit);
  const int64_t items = m * plan.head_groups;
  const int fill = static_cast<int>(std::min<int64_t>(kSparseMlaV32MaxSplits, std::max<int64_t>(1, sm_count / items)));
  const int wanted = std::max(least, std::min({fill, max_splits, chunks}));
  const int chunks_per_split = sparse_mla_v32_ceil_div(chunks, wanted);
  plan.rows_per_split = chunks_per_split * kSparseMlaV32ChunkRows;
  plan.splits = sparse_mla_v32_ceil_div(top_k, plan.rows_per_split);
  return plan;
}

// Kernel file (sparse_mla_v32_kernel.cu). `args` passed check_sparse_mla_v32
// and `plan` is one of sparse_mla_v32_plan's for its m, H and K.
Status sparse_mla_v32_launch(const SparseMlaV32Args& args, const SparseMlaV32Plan& plan, cudaStream_t stream);
// `args` passed check_sparse_mla_v32_cache_write.
Status sparse_mla_v32_cache_write_launch(const SparseMlaV32CacheWriteArgs& args, cudaStream_t stream);
// How many clusters of `splits` CTAs the device runs at once (0: it cannot
// schedule them), asked once per cluster size and device.
Status sparse_mla_v32_max_active_clusters(int splits, int* clusters);

// API file: sparse_mla_v32 with at most `max_splits` splits (tests force
// every plan shape with it); the default is kSparseMlaV32MaxSplits, or 8
// where the device schedules no cluster of 16.
Status sparse_mla_v32_with_max_splits(const SparseMlaV32Args& args, int max_splits, cudaStream_t stream);

}  // namespace dsa
