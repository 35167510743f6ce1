// The two tensor-core sparse MLA kernels behind sparse_mla, callable one by
// one for the benchmark (to measure them and their plans against each other)
// and the tests (to check both on every shape). Engines call sparse_mla,
// which runs sparse_mla_wgmma when H is a multiple of 64 and sparse_mla_mma
// otherwise.
#pragma once

#include <cuda_runtime.h>

#include "dsa_decode/sparse_mla.h"

namespace dsa {

// The 8-head kernel (src/sparse_mla/sparse_mla_mma.cu) with the default plan
// sparse_mla_split_plan(H, K): any H.
Status sparse_mla_mma(const SparseMlaArgs& args, cudaStream_t stream);

// The 8-head kernel with an explicit plan. Errors name `plan` when it does not
// cover the heads or the entries of `args`, or breaks a limit of
// SparseMlaSplitPlan.
Status sparse_mla_with_plan(const SparseMlaArgs& args, const SparseMlaSplitPlan& plan, cudaStream_t stream);

// How many clusters of the 8-head kernel's `plan` the current device can run
// at once (cudaOccupancyMaxActiveClusters); 0 means the plan cannot launch there.
Status sparse_mla_max_active_clusters(const SparseMlaSplitPlan& plan, int heads, int top_k, int* clusters);

// The 64-head warpgroup-MMA kernel (src/sparse_mla/sparse_mla_wgmma.cu):
// H a multiple of 64 (else an error naming q), each CTA owning 64 heads. Its
// split of a token's K entries (1 <= K <= kSparseMlaMaxTopK), a function of K
// only: S = min(max_splits, 16, ceil(K / 64)), rows_per_split =
// 64 ceil(ceil(K / S) / 64) (at most 1024), splits = ceil(K / rows_per_split)
// CTAs of whole 64-entry chunks, one thread-block cluster (non-portable above
// 8 CTAs). With max_splits too small for 1024 rows per CTA, splits exceeds it.
struct SparseMlaWgmmaSplits {
  int splits = 0;
  int rows_per_split = 0;  // a multiple of 64, at most 1024
};
SparseMlaWgmmaSplits sparse_mla_wgmma_splits(int top_k, int max_splits = kSparseMlaMaxSplits);
Status sparse_mla_wgmma(const SparseMlaArgs& args, cudaStream_t stream);
// The same kernel with at most `max_splits` (1..16) CTAs per (token, group),
// for the benchmark's comparison of plans; an error naming max_splits when K
// needs more CTAs than that (1024 entries per CTA at most).
Status sparse_mla_wgmma_with_max_splits(const SparseMlaArgs& args, int max_splits, cudaStream_t stream);

}  // namespace dsa
