// Sparse MLA decode attention (DSA, NoPE, FP8): each decode token attends to
// the K cache entries its indexer selected. The latent row of a cache entry is
// both key and value (MLA with the absorbed W_UK; no RoPE part).
//
//   q        [m, H, 512]                 FP8 e4m3, times q_scale
//   kv_cache [blocks, block_size, 512]   FP8 e4m3, times k_scale
//   indices  [m, K]                      int32 global slots, slot = block * block_size + offset
//
//   for token t, head h, over the valid entries j of indices[t, :]:
//     s_j = softmax_scale * sum_d (q_scale * q[t, h, d]) * (k_scale * kv[slot_j, d])
//     latent[t, h, :] = sum_j exp(s_j) * (k_scale * kv[slot_j, :]) / sum_j exp(s_j)   BF16 (RNE)
//     lse[t, h]       = ln(sum_j exp(s_j))                                              f32
//
// Untrusted indices (DESIGN.md section 2): an entry is valid when
// 0 <= slot < capacity (= blocks * block_size). A negative entry is "none" (the
// -1 padding of a top-k row); an entry >= capacity is skipped the same way and
// counted in `error_count` when one is given (each entry of indices once, not
// once per head). No kernel reads outside the buffers it was given, whatever
// the indices hold. A slot listed twice counts twice (as the stock kernels do).
//
// Special values:
// - A row with no valid entry: latent[t, h, :] = 0 (+0.0 bits) and lse[t, h] = -inf.
// - In a row with at least one valid entry (the rule above comes first), NaN
//   (e4m3 codes 0x7F / 0xFF) in q[t, h, :] or in any dimension of a valid
//   selected cache entry of token t makes every value of latent[t, h, :] NaN
//   (BF16 0x7FFF) and lse[t, h] NaN: the score of that entry is NaN and the
//   softmax maximum propagates it. NaN in entries that are not selected, or
//   in other tokens' rows, has no effect. e4m3 has no infinities.
// - Scales are read on the device and cannot be checked: q_scale and k_scale
//   must be finite and > 0, and scores must stay below 2.3e38 in magnitude
//   (FLT_MAX / log2(e): the fast kernels work in log2 units), which they do
//   whenever softmax_scale * q_scale * k_scale * 448^2 * 512 < 2.3e38.
//
// Buffers: latent, lse and the split counters share no memory with each other
// or with any input (checked; error_count is a raw pointer: only its
// alignment is checked).
// Scalars and counters are 4-byte aligned. Nothing is allocated or
// synchronized on the run path (CUDA-graph capturable: the first call of a
// kernel and plan on a device raises its shared-memory and cluster limits
// and asks the device how many CTAs and clusters it holds at once,
// make it outside a capture, as the tests and dsa-decode do); every launch uses
// programmatic dependent launch and waits (griddepcontrol.wait) before reading
// q, the cache, the indices or the scales, all of which its predecessors write.
//
// Split-K buffers, both caller-owned and planned once for the largest m:
// - split_counters: int32, sparse_mla_split_counter_count(m, H, K) of them,
//   zeroed once at allocation; every launch that completes leaves them zero,
//   so no per-call memset is needed. The 64-head kernel (H a multiple of 64)
//   splits a token's entries over clusters of CTAs: the CTAs of a cluster
//   meet at one of these counters, then combine their partials (handed over
//   through split_partials); with several clusters (not the default plan),
//   the last CTA to finish each cluster rank, found by these counters,
//   combines the clusters' results in cluster order (docs/sparse_mla.md has
//   the measured plans). When the device cannot hold all the launch's
//   clusters at once, it runs persistent and cooperative (all CTAs resident
//   at once, one per SM), so it must be able to hold one token's splits (16
//   CTAs at K = 2048) at once (else an error, kUnsupported).
// - split_partials: f32, sparse_mla_split_partials_count(m, H, K) values:
//   the 64-head kernel's CTAs hand their partial results to the CTAs that
//   combine them through it (0 for other H; the view may then be empty). Its
//   contents on entry do not matter and are undefined after a launch.
// One pair of buffers serves any number of launches in stream order, not two
// launches that may run concurrently; after a launch that failed mid-way (a
// CUDA error), zero the counters again. Both counts are non-decreasing in m.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kSparseMlaLatent = 512;    // L: kv_lora_rank of every supported preset
inline constexpr int kSparseMlaMaxHeads = 128;  // dsv32 at TP1
// 8 x 2048, over seven times the widest served top-k row (glm5next: 2176 =
// 2048 pooled + tail + -1 padding). The bound keeps index arithmetic in int32
// and gives the fast kernel's split plan a finite range; raising it later
// breaks no caller.
inline constexpr int kSparseMlaMaxTopK = 16384;
// Tokens run on a grid dimension of at most 65535 CTAs; decode steps are far smaller.
inline constexpr int kSparseMlaMaxTokens = 65535;

// The split plan (contract v2, DESIGN.md section 2). Both give results within
// the same bound and the same bits on every run; they differ in what a
// token's bits may depend on.
//   kAuto (default): per launch the fastest plan for m, H, K on this GPU
//     (how many CTAs split a token's entries, or one CTA per token and 64
//     heads over its whole row for large batches). A token's bits may change
//     with the size of its batch and with the GPU, as FlashMLA's and vLLM's
//     split schedules do.
//   kBatchInvariant: the split points depend only on H and K, so a token's
//     bits depend on its own inputs only, whatever the batch around it.
enum class SparseMlaPlan : int32_t {
  kAuto = 0,
  kBatchInvariant = 1,
};

struct SparseMlaArgs {
  // [m, H, 512] FP8 e4m3; dim 2 contiguous, head and token strides multiples
  // of 16 (16-byte rows, for vector and TMA loads), data 16-byte aligned.
  TensorView q;
  TensorView q_scale;  // [1] f32
  // [blocks, block_size, 512] FP8 e4m3; dim 2 contiguous; entry stride >= 512
  // and block stride >= block_size * entry stride, both multiples of 16 (the
  // block stride may be padded); data 16-byte aligned.
  TensorView kv_cache;
  TensorView k_scale;  // [1] f32
  // [m, K] int32 global slots; dim 1 contiguous, token stride >= K.
  TensorView indices;
  float softmax_scale = 0.0f;  // finite, > 0 (glm5next: 256^-0.5)
  // [m, H, 512] BF16 out; dims 1-2 contiguous, token stride a multiple of 8
  // and >= H * 512, data 16-byte aligned (head_gemv's x layout: it feeds W_UV).
  TensorView latent;
  TensorView lse;  // [m, H] f32 out, contiguous
  // [n] int32, n >= sparse_mla_split_counter_count(m, H, K), contiguous, all
  // zero before the first launch (see the split-K contract above).
  TensorView split_counters;
  // [n] f32, n >= sparse_mla_split_partials_count(m, H, K), contiguous, data
  // 16-byte aligned; may be empty (null) when that count is 0.
  TensorView split_partials;
  unsigned int* error_count = nullptr;  // optional device counter of entries >= capacity
  SparseMlaPlan plan = SparseMlaPlan::kAuto;  // see SparseMlaPlan
};

// Counters the split-K combine needs for m tokens, H heads, K entries per row:
// one per (token, head), an upper bound for any grouping of heads and any K.
// Non-decreasing in m. Callers must use this function, not the formula: the
// fast kernel may need fewer (it returns a value >= what any kernel uses).
int64_t sparse_mla_split_counter_count(int64_t m, int64_t heads, int64_t top_k);

// FP32 values of split_partials for m tokens, H heads, K entries per row: for H
// a multiple of 64, m * H / 64 * (splits * (64 * 512 / 2 + 128) + (clusters
// > 1 ? clusters * (64 * 512 + 128) : 0)) with the 64-head kernel's plan (16
// splits in one cluster from K = 961 on: 1032 KiB per token and 64 heads);
// 0 for other H. Enough for every SparseMlaSplits choice. Non-decreasing in
// m; callers must use this function, not the formula.
int64_t sparse_mla_split_partials_count(int64_t m, int64_t heads, int64_t top_k);

// Checks every argument (dtypes, shapes, strides, alignment, ranges:
// 1 <= m <= kSparseMlaMaxTokens, 1 <= H <= kSparseMlaMaxHeads,
// 1 <= K <= kSparseMlaMaxTopK, softmax_scale finite and > 0); launches nothing.
// Errors name the argument, what was expected and what was given.
Status check_sparse_mla(const SparseMlaArgs& args);

// The fast path: FP8 codes converted exactly to FP16, both products on
// tensor cores with FP32 accumulation, online softmax per 64-entry chunk,
// split-K combined in the same launch (H a multiple of 64: 64 heads per CTA
// on warpgroup MMA; other H: 8 heads per CTA on mma.sync). Deterministic;
// batch invariant under SparseMlaPlan::kBatchInvariant. Launches on `stream`
// with PDL; neither allocates nor synchronizes. The kernels run clusters of
// up to 16 CTAs (non-portable above 8): where the GPU cannot schedule them (a
// MIG slice), the launch returns the CUDA error.
Status sparse_mla(const SparseMlaArgs& args, cudaStream_t stream);

// The simple GPU kernel: FP32 on CUDA cores, one CTA per (token, head), a
// fixed summation order (deterministic, batch invariant). It is the GPU
// reference and the benchmark baseline of the tensor-core kernel
// (sparse_mla), not the fast path. It sums in FP32, so its distance to the float64 CPU
// reference is mostly the BF16 rounding of the output.
// Launches on `stream` with PDL; neither allocates nor synchronizes.
Status sparse_mla_simple(const SparseMlaArgs& args, cudaStream_t stream);

}  // namespace dsa
