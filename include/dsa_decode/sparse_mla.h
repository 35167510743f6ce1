// Sparse MLA decode attention (DSA, NoPE, FP8): each token attends to the
// cache entries its indexer selected; an entry's latent row is key and value.
//
//   q [m, H, 512] e4m3 x q_scale    kv_cache [blocks, block_size, 512] e4m3 x k_scale
//   indices [m, K] int32 slots (block * block_size + offset)
//   s_j = softmax_scale * (q_scale q[t, h]) . (k_scale kv[slot_j])   over valid j
//   latent[t, h] = sum_j exp(s_j) k_scale kv[slot_j] / sum_j exp(s_j)   BF16 (RNE)
//   lse[t, h] = ln(sum_j exp(s_j))                                      f32
//
// Numerics: both products on FP16/BF16 tensor cores (exact FP16 copies of the
// e4m3 codes), FP32 accumulation; latent within 5e-3 relative Frobenius and
// lse within 1e-3 absolute of float64 at score spreads up to 10.
// Deterministic; batch invariant under SparseMlaPlan::kBatchInvariant.
//
// Indices are untrusted: an entry is valid when 0 <= slot < blocks *
// block_size; a negative entry is padding; an entry >= capacity is skipped
// and counted once in error_count. A slot listed twice counts twice.
// A row with no valid entry gives latent = +0 and lse = -inf. NaN in q[t, h]
// or in a selected valid entry makes latent[t, h, :] NaN (0x7FFF) and lse NaN.
// q_scale, k_scale are read on the device: they must be finite and > 0, and
// softmax_scale * q_scale * k_scale * 448^2 * 512 < 2.3e38.
//
// Launches: PDL (inputs read after griddepcontrol.wait), no allocation or
// synchronization, graph capturable once a first call per device and plan has
// run outside a capture (it raises shared-memory and cluster limits and asks
// the occupancy). Clusters of up to 16 CTAs (non-portable above 8): where the
// GPU cannot schedule them (a MIG slice) the launch returns the CUDA error; a
// device that cannot hold one token's splits at once gives kUnsupported.
//
// Split-K buffers, caller-owned, sized by the functions below (for the largest
// m; both counts are non-decreasing in m):
// - split_counters: zeroed once at allocation; every completed launch leaves
//   them zero. Zero them again after a launch that failed mid-way.
// - split_partials: scratch (contents undefined in and out); empty when its
//   count is 0 (H not a multiple of 64).
// One pair serves launches in stream order, not concurrent ones. latent, lse
// and the split buffers may not overlap each other or any input (checked).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kSparseMlaLatent = 512;
inline constexpr int kSparseMlaMaxHeads = 128;
inline constexpr int kSparseMlaMaxTopK = 16384;
inline constexpr int kSparseMlaMaxTokens = 65535;

// kAuto: the fastest plan per launch for m, H, K and the GPU; a token's bits
// may change with its batch size and the GPU. kBatchInvariant: split points
// depend on H and K only, so a token's bits depend on its own inputs only.
enum class SparseMlaPlan : int32_t {
  kAuto = 0,
  kBatchInvariant = 1,
};

// Strides in elements; "rows" are 16-byte aligned (multiples of 16 bytes).
struct SparseMlaArgs {
  TensorView q;                // [m, H, 512] e4m3; dim 2 contiguous, head/token strides % 16 == 0; 16 B aligned
  TensorView q_scale;          // [1] f32
  TensorView kv_cache;         // [blocks, block_size, 512] e4m3; dim 2 contiguous; entry stride >= 512, block
                               // stride >= block_size * entry stride, both % 16 == 0; 16 B aligned
  TensorView k_scale;          // [1] f32
  TensorView indices;          // [m, K] int32; dim 1 contiguous, token stride >= K
  float softmax_scale = 0.0f;  // finite, > 0
  TensorView latent;           // [m, H, 512] BF16 out; dims 1-2 contiguous, token stride % 8 == 0 and >= H * 512;
                               // 16 B aligned (head_gemv's x layout)
  TensorView lse;              // [m, H] f32 out, contiguous
  TensorView split_counters;   // [>= sparse_mla_split_counter_count] int32, contiguous, zero before first use
  TensorView split_partials;   // [>= sparse_mla_split_partials_count] f32, contiguous, 16 B aligned; may be empty
  unsigned int* error_count = nullptr;  // optional: entries >= capacity
  SparseMlaPlan plan = SparseMlaPlan::kAuto;
};

// Buffer sizes for m tokens, H heads, K entries per row (use these, not a formula).
int64_t sparse_mla_split_counter_count(int64_t m, int64_t heads, int64_t top_k);
int64_t sparse_mla_split_partials_count(int64_t m, int64_t heads, int64_t top_k);

// Checks every argument (1 <= m <= kSparseMlaMaxTokens, 1 <= H <=
// kSparseMlaMaxHeads, 1 <= K <= kSparseMlaMaxTopK, dtypes, shapes, strides,
// alignment, overlaps); errors name the argument, what was expected and got.
Status check_sparse_mla(const SparseMlaArgs& args);

Status sparse_mla(const SparseMlaArgs& args, cudaStream_t stream);

}  // namespace dsa
