// Sparse MLA decode attention over DeepSeek-V3.2's FP8 KV cache (FlashMLA's
// "FP8 with scale" format, vLLM's fp8_ds_mla), and the cache write.
//
// Cache entry, 656 bytes a token (byte offsets):
//   [0, 512)    e4m3 codes of the latent kv_c (the NoPE part)
//   [512, 528)  four FP32 scales (little endian), scale g for codes [128 g, 128 g + 128)
//   [528, 656)  64 BF16 values of k_pe (the RoPE part), verbatim
// Key k = (codes x their group's scale, rope) [576]; value = its first 512 dims.
//
// Cache write (vLLM concat_and_cache_ds_mla): per group of 128 kv_c values,
// amax = max |x| (fmaxf: NaN ignored unless all NaN), scale = max(amax / 448
// (rounded division), FLT_MIN), code = e4m3_satfinite_rne(x / scale)
// (rounded division); k_pe copied. Token t goes to slot_mapping[t]; t >=
// len(slot_mapping) or a negative slot is skipped; a slot >= capacity is
// skipped and counted once in error_count.
//
// Attention, q [m, H, 576] BF16 (512 latent-space + 64 rotated RoPE dims):
//   s_j = softmax_scale * q[t, h] . k(slot_j)   over the valid entries j of indices[t]
//   latent[t, h] = sum_j exp(s_j) v(slot_j) / sum_j exp(s_j)   BF16 (RNE)
//   lse[t, h] = ln(sum_j exp(s_j))                               f32
// Numerics: Q.K on tensor cores of exact operands (q scaled by powers of two
// per 128 dims into FP16, codes exactly in FP16, RoPE in BF16), FP32 sums,
// the scales applied in FP32; P.V with p x scale / max rounded to FP16.
// latent within 5e-3 relative Frobenius and lse within 1e-3 absolute of
// float64 on the dequantized cache, at score spreads up to 10. Deterministic
// (the same inputs and m give the same bits); the split count depends on m.
//
// Indices are untrusted: an entry is valid when 0 <= slot < blocks *
// block_size; a negative entry is padding; an entry >= capacity is skipped and
// counted once in error_count; a slot listed twice counts twice. A row with
// no valid entry gives latent +0 and lse -inf. Otherwise a non-finite value
// in q[t, h] makes latent[t, h, :] NaN (0x7FFF) and lse[t, h] NaN, and a
// valid selected entry with a NaN code, a non-finite scale or a non-finite
// RoPE value makes every head of token t NaN. Scores (softmax_scale x the
// FP32 sums of q . k) must stay below 2.3e38 in magnitude.
//
// Launches: PDL (inputs read after griddepcontrol.wait), no allocation or
// synchronization, graph capturable once a first call per device has run
// outside a capture (shared-memory, cluster limits and occupancy asked once).
// Clusters of up to 16 CTAs (at most 8 where the device schedules no cluster
// of the plan's size above 8; K > 8192 needs ceil(K / 1024) > 8); a launch
// the device cannot schedule returns the CUDA error. latent and lse may not overlap any input (checked).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kSparseMlaV32Latent = 512;      // NoPE dims, d_v
inline constexpr int kSparseMlaV32Rope = 64;         // RoPE dims
inline constexpr int kSparseMlaV32HeadDim = 576;     // d_qk
inline constexpr int kSparseMlaV32GroupSize = 128;   // codes per scale
inline constexpr int kSparseMlaV32EntryBytes = 656;  // bytes a token
inline constexpr int kSparseMlaV32ScaleOffset = 512;
inline constexpr int kSparseMlaV32RopeOffset = 528;
inline constexpr int kSparseMlaV32MaxHeads = 128;
inline constexpr int kSparseMlaV32MaxTopK = 16384;
inline constexpr int kSparseMlaV32MaxTokens = 65535;

// Strides in elements (bytes for the cache).
struct SparseMlaV32CacheWriteArgs {
  TensorView kv_c;          // [m, 512] BF16; dim 1 contiguous, token stride % 8 == 0; 16 B aligned
  TensorView k_pe;          // [m, 64] BF16; dim 1 contiguous, token stride % 8 == 0; 16 B aligned
  TensorView slot_mapping;  // [n >= 1] int64, contiguous; tokens t >= n are skipped
  TensorView kv_cache;      // [blocks, block_size, 656] u8 (or fp8_e4m3 bytes); dim 2 contiguous; entry stride
                            // >= 656, block stride >= block_size * entry stride, both % 16 == 0; 16 B aligned
  unsigned int* error_count = nullptr;  // optional: slots >= capacity
};

struct SparseMlaV32Args {
  TensorView q;             // [m, H, 576] BF16; dim 2 contiguous, head/token strides % 8 == 0; 16 B aligned
  TensorView kv_cache;      // as in SparseMlaV32CacheWriteArgs
  TensorView indices;       // [m, K] int32 slots (block * block_size + offset); dim 1 contiguous, token stride >= K
  float softmax_scale = 0;  // finite, > 0
  TensorView latent;        // [m, H, 512] BF16 out; dims 1-2 contiguous, token stride % 8 == 0 and >= H * 512;
                            // 16 B aligned (head_gemv's x layout)
  TensorView lse;           // [m, H] f32 out, contiguous
  unsigned int* error_count = nullptr;  // optional: entries >= capacity
};

// Every argument (1 <= m <= kSparseMlaV32MaxTokens, 1 <= H <=
// kSparseMlaV32MaxHeads, 1 <= K <= kSparseMlaV32MaxTopK, dtypes, shapes,
// strides, alignment, overlaps); errors name the argument, what was expected
// and what came.
Status check_sparse_mla_v32_cache_write(const SparseMlaV32CacheWriteArgs& args);
Status check_sparse_mla_v32(const SparseMlaV32Args& args);

Status sparse_mla_v32_cache_write(const SparseMlaV32CacheWriteArgs& args, cudaStream_t stream);
Status sparse_mla_v32(const SparseMlaV32Args& args, cudaStream_t stream);

}  // namespace dsa
