// The two tensor-core sparse MLA kernels behind sparse_mla, callable one by
// one for the benchmark (to measure them and their plans against each other)
// and the tests (to check both on every shape). Engines call sparse_mla,
// which runs sparse_mla_wgmma when H is a multiple of 64 and sparse_mla_mma
// otherwise.
#pragma once

#include <cuda_runtime.h>

#include <array>

#include "dsa_decode/sparse_mla.h"

namespace dsa {

// The split choices behind SparseMlaPlan: kAuto is kByBatch, kBatchInvariant
// is kLatency. kThroughput (half of kLatency's splits) and kWholeRow (the
// producer kernel at every m) are building blocks of kByBatch, reachable on
// their own for the tests and the benchmark only.
enum class SparseMlaSplits : int32_t {
  kLatency = 0,     // the most splits that pay at m = 1 (16 per 64 heads at K = 2048, 8 per 8 heads)
  kThroughput = 1,  // half of those (at least what the kernels' per-CTA limits need)
  kByBatch = 2,     // per launch from m and the GPU: the fastest, not batch invariant
  kWholeRow = 3,    // one CTA per (token, 64 heads), no split: batch invariant
};
SparseMlaSplits sparse_mla_splits_of(SparseMlaPlan plan);

// sparse_mla with a split choice: checks the arguments, then runs the 64-head
// kernel (H a multiple of 64) or the 8-head kernel.
Status sparse_mla_with_splits(const SparseMlaArgs& args, SparseMlaSplits splits, cudaStream_t stream);

// How the 8-head tensor-core kernel (what sparse_mla runs when H is not a
// multiple of 64) divides one token's work. It depends only on H, K and
// SparseMlaArgs::splits, never on m or the GPU: a token's bits do not change
// with the batch around it (but with kByBatch, whose launch picks one of
// three plans by m and the GPU). (When H is a multiple of 64, sparse_mla runs a
// 64-head kernel whose split, at most 16 CTAs of whole 64-entry chunks per
// (token, 64 heads) in one cluster, likewise depends on K and that choice
// only.)
//   CTA (split, group, token) owns heads [8 group, 8 group + 8) of the token
//   (one 8-wide MMA tile: H = 8 computes 8 heads, not vLLM's padded 64) and
//   the entries [split * rows_per_split, ...) of its index row; the `splits`
//   CTAs of a (token, group) form one thread-block cluster and combine their
//   partial results through distributed shared memory, in split order, in the
//   same launch.
struct SparseMlaSplitPlan {
  int head_groups = 0;     // ceil(H / 8)
  int splits = 0;          // 1..kSparseMlaMaxSplits CTAs per (token, group), each with at least one entry
  int rows_per_split = 0;  // a multiple of 64, at most kSparseMlaMaxTopK / 8 (the entries a CTA stages)
};
// Hopper's largest cluster (non-portable above 8).
inline constexpr int kSparseMlaMaxSplits = 16;

// The 8-head kernel's plan for H heads and K entries per row (H, K in the
// ranges check_sparse_mla accepts) and a split choice; for kByBatch
// kLatency's (a kByBatch launch picks among three plans by m and the GPU:
// sparse_mla_batch_split_plans).
SparseMlaSplitPlan sparse_mla_split_plan(int heads, int top_k, SparseMlaSplits splits = SparseMlaSplits::kLatency);


// The 8-head kernel (src/sparse_mla/sparse_mla_mma.cu) with the plan
// sparse_mla_split_plan(H, K, splits), or kByBatch's choice: any H.
Status sparse_mla_mma(const SparseMlaArgs& args, SparseMlaSplits splits, cudaStream_t stream);

// The 8-head kernel's launch with a plan of sparse_mla_split_plan or
// sparse_mla_batch_split_plans, for arguments that passed check_sparse_mla.
Status sparse_mla_mma_launch(const SparseMlaArgs& args, const SparseMlaSplitPlan& plan, cudaStream_t stream);

// The 8-head kernel with an explicit plan. Errors name `plan` when it does not
// cover the heads or the entries of `args`, or breaks a limit of
// SparseMlaSplitPlan.
Status sparse_mla_with_plan(const SparseMlaArgs& args, const SparseMlaSplitPlan& plan, cudaStream_t stream);

// How many clusters of the 8-head kernel's `plan` the current device can run
// at once (cudaOccupancyMaxActiveClusters); 0 means the plan cannot launch
// there, also when the device cannot set the cluster size's attributes or
// answer the query (those errors are cleared, not returned).
Status sparse_mla_max_active_clusters(const SparseMlaSplitPlan& plan, int heads, int top_k, int* clusters);

// The 8-head kernel's plans that SparseMlaSplits::kByBatch chooses from, most
// splits first: up to 16 splits (twice kLatency's cap of 8: 16 at K = 2048,
// 12 at 2176; clusters above 8 CTAs are non-portable), kLatency's,
// kThroughput's. A launch takes the first whose m * head_groups clusters the
// device runs all at once, else the last.
std::array<SparseMlaSplitPlan, 3> sparse_mla_batch_split_plans(int heads, int top_k);

// The 64-head warpgroup-MMA kernel (src/sparse_mla/sparse_mla_wgmma.cu):
// H a multiple of 64 (else an error naming q), each CTA owning 64 heads. Its
// split of a token's C = ceil(K / 64) chunks of 64 entries is a function of K
// only (and of the two limits, constants for sparse_mla): splits =
// min(max_splits, C); the cluster size is the largest power of two <=
// min(splits, max_cluster), and splits is rounded down to a multiple of it;
// split s takes chunks [s C / splits, (s + 1) C / splits) (at most 16).
// The CTAs of a cluster combine their partials through split_partials; with
// more than one cluster, the last CTA of each cluster rank to finish (a
// self-resetting counter) combines the clusters' results through
// split_partials. When the device holds every (token, group) item's clusters
// at once, they are hardware clusters; otherwise the launch is persistent and
// cooperative (as many items at once as the device holds all splits of, each
// CTA running its split of a fixed sequence of items) and a cluster's CTAs
// meet at a counter in split_counters. Both give the same bits.
struct SparseMlaWgmmaSplits {
  int splits = 0;        // CTAs per (token, 64 heads)
  int cluster_size = 0;  // 1, 2, 4, 8 or 16; splits is a multiple of it
  int clusters = 0;      // splits / cluster_size
  int max_chunks = 0;    // the most chunks one split takes
};
inline constexpr int kSparseMlaWgmmaMaxSplits = 64;
inline constexpr int kSparseMlaWgmmaDefaultSplits = 16;
// max_cluster: 4, 8 (portable) or 16 (non-portable: a whole GPC of a full
// Hopper part). At most 16 clusters, so not 2 or 1.
inline constexpr int kSparseMlaWgmmaDefaultCluster = 16;
SparseMlaWgmmaSplits sparse_mla_wgmma_splits(int top_k, int max_splits = kSparseMlaWgmmaDefaultSplits,
                                             int max_cluster = kSparseMlaWgmmaDefaultCluster);
// The FP32 values split_partials must hold for that plan: every split's
// partials (one cluster included), plus the clusters' results when there
// are several; 0 for H not a multiple of 64.
int64_t sparse_mla_wgmma_partials_count(int64_t m, int64_t heads, int top_k, int max_splits, int max_cluster);
// How many of the kernel's CTAs the current device holds at once (one per SM):
// a launch runs resident_ctas / splits items (token, group) at once.
Status sparse_mla_wgmma_resident_ctas(int* ctas);
// The max_splits sparse_mla_wgmma takes for args.splits: the default, or
// half of it for kThroughput while 8 splits cover K (K <= 8192); for
// kByBatch the default, the most that choice takes (its launch asks
// sparse_mla_wgmma_batch_max_splits).
int sparse_mla_wgmma_max_splits(int top_k, SparseMlaSplits splits);
// kByBatch's max_splits for `items` (token, 64 heads) items on a GPU that
// holds `resident_ctas` of the kernel's CTAs at once: the default halved
// while items * splits exceeds resident_ctas, down to 2, and never below what
// keeps a split within 16 chunks (K = 2048: 16 up to 8 items, 8 up to 16, 4
// up to 33, then 2 on the 132-SM H200). Non-increasing in items.
int sparse_mla_wgmma_batch_max_splits(int top_k, int64_t items, int resident_ctas);
Status sparse_mla_wgmma(const SparseMlaArgs& args, SparseMlaSplits splits, cudaStream_t stream);
// check_sparse_mla with split_partials sized for the 64-head plan of these
// limits (check_sparse_mla: sparse_mla's, the defaults).
Status check_sparse_mla_for_plan(const SparseMlaArgs& args, int max_splits, int max_cluster);
// The same kernel with another plan, for the benchmark's comparison of plans
// and the tests: max_splits 1..kSparseMlaWgmmaMaxSplits and max_cluster 4, 8
// or 16, else an error naming them; an error naming max_splits when a split
// would take more than 16 chunks (1024 entries), and one naming
// split_partials when it is smaller than the plan needs.
Status sparse_mla_wgmma_with_plan(const SparseMlaArgs& args, int max_splits, int max_cluster, cudaStream_t stream);
// The default plan with one CTA per (token, group) item streaming all its
// splits at any m (sparse_mla_wgmma takes that launch shape only with many
// items), where K <= 2304 and the cache spans less than 64 GiB; else as
// sparse_mla_wgmma. The same bits either way: for the benchmark's crossover
// and the tests.
Status sparse_mla_wgmma_whole_items(const SparseMlaArgs& args, cudaStream_t stream);
// The default plan with each CTA streaming several consecutive splits of an
// item (the fewest, 2 or more, that put every item's CTAs on the GPU at
// once; sparse_mla_wgmma takes it only where one CTA per split needs more
// than one round), the item's CTAs meeting at its counter; where no such
// count fits (many items), as sparse_mla_wgmma. The same bits.
Status sparse_mla_wgmma_grouped_splits(const SparseMlaArgs& args, cudaStream_t stream);
// Every check of check_sparse_mla except split_partials's size: for a kernel
// that needs none (it may still be given; it is then checked for overlaps).
Status check_sparse_mla_without_partials(const SparseMlaArgs& args);
// The producer kernel (src/sparse_mla/sparse_mla_producer.cu): one CTA per
// (token, 64 heads) item takes the whole index row, with a third warpgroup
// that loads and converts the rows while the other two compute (no split,
// no combine, split_counters and split_partials untouched). Deterministic
// and batch invariant (a token's bits depend on its own inputs only), not
// the bits of the split plans. H a multiple of 64 (else an error naming q),
// K <= kSparseMlaProducerMaxTopK (else naming indices), a cache span below
// 64 GiB (else naming kv_cache).
inline constexpr int kSparseMlaProducerMaxTopK = 2304;
Status sparse_mla_producer(const SparseMlaArgs& args, cudaStream_t stream);
// Whether the producer kernel takes these arguments' K and cache (the two
// limits above); kWholeRow and kByBatch take the split plans where it does not.
bool sparse_mla_producer_covers(int64_t top_k, int64_t kv_cache_span_elements);
// How many of the producer kernel's CTAs the current device holds at once (one per SM).
Status sparse_mla_producer_resident_ctas(int* ctas);
// Whether kByBatch runs the producer kernel rather than the split plan of
// max_splits (sparse_mla_wgmma_batch_max_splits) for `items` (token, 64
// heads) items of K entries (where it covers them): K <= kSparseMlaProducerMaxTopK and the
// producer's rounds of whole rows (ceil(items / producer_resident_ctas) x C
// chunks) cost less than the split plan's rounds of its longest split
// (ceil(items / (resident_ctas / splits)) x max_chunks), a producer chunk
// counted as 4/5 of a split CTA's. The ratio is measured (H200, K = 2048,
// H = 64): 2.69 against 3.33 us per chunk at m = 128, 2.49 against 3.20 at
// m = 64. On the H200 at K = 2048 this takes the producer for 67 to 132 items and from 199 on, the split plan of 2 splits for up to 66 items
// (one round) and for 133 to 198 (three rounds of 16 chunks against two of
// 32).
bool sparse_mla_batch_takes_producer(int top_k, int64_t items, int max_splits, int resident_ctas,
                                     int producer_resident_ctas);

}  // namespace dsa
