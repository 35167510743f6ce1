// nn.Linear for decode steps of a few tokens, as one CUDA-core GEMV launch
// with PDL: out[t, n] = BF16(sum_k x[t, k] * weight[n, k]).
//
// Why not cuBLASLt at these sizes: at m = 1..4 a projection is a stream of
// its weight, so the kernel's job is to keep the memory busy from its first
// cycle. This one requests its first weight bytes before griddepcontrol.wait
// (they overlap the previous kernel under PDL) and releases its dependents
// right after the wait; cuBLASLt's kernels take no PDL, so each one costs
// the chain a full drain and launch. The stage uses it for the token counts
// where it measured faster (include/dsa_decode/stage.h).
//
// Kernel contract (src/linear/linear_gemv.cu; reference::linear_gemv,
// src/linear/linear_reference.h, reproduces every bit):
//  - Order of each sum, fixed: the warp that owns row n splits k into
//    16-byte pieces of 8 columns; lane l chains the pieces l, l + 32, l + 64,
//    ... (columns 8l..8l+7, 8l+256..) with fmaf from +0, column by column;
//    then the xor butterfly adds the 32 lane sums over lane distances 1, 2,
//    4, 8, 16; the total is rounded to BF16 to nearest even. The same order
//    as indexer_project_gemv's.
//  - Batch invariant and deterministic: a token's bits depend only on its own
//    x row and the weight (not on m, the grid, or the device).
//  - Work split: a warp owns one weight row at a time, rows dealt to the
//    grid's warps in turn (row = warp + i * warps); a CTA stages x [m, K] in
//    shared memory once, after the wait, as BF16 (rows m..T-1 zero, T = m
//    rounded up to a power of two), so every weight load feeds T sums.
//  - PDL: the first weight pieces of the warp's first row are loaded before
//    griddepcontrol.wait (weights must not be written by a kernel in flight);
//    x is read after it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kLinearGemvMaxTokens = 8;
// Rows are counted in int32 on the device, a row plus the grid's warps included.
inline constexpr int64_t kLinearGemvMaxRows = int64_t{1} << 30;

// One launch's views.
//   x       [m, K] BF16, m in 1..kLinearGemvMaxTokens; dim 1 contiguous
//   weight  [N, K] BF16, nn.Linear's [out, in], N <= kLinearGemvMaxRows; dim 1 contiguous
//   out     [m, N] BF16; dim 1 contiguous, any row stride of at least N;
//           disjoint from x and weight
// K a multiple of 8; x's and weight's row strides multiples of 8 elements
// and their bases 16-byte aligned (the kernel reads 16-byte pieces); x's T rows of K
// BF16 fit in a CTA's shared memory (T * K * 2 bytes <= 227 KiB: K <= 14528
// at T = 8, 29056 at T = 4); all on CUDA.
struct LinearGemvArgs {
  TensorView x;
  TensorView weight;
  TensorView out;
};

// The argument at fault by name, or ok.
Status check_linear_gemv(const LinearGemvArgs& args);

// Whether linear_gemv takes m tokens of K columns (the shared-memory rule above).
bool linear_gemv_supports(int64_t m, int64_t k);

// One launch on `stream` (checks first). Graph capturable after one
// uncaptured call at the same T (the first launch of each T raises its
// shared-memory limit).
Status linear_gemv(const LinearGemvArgs& args, cudaStream_t stream);

}  // namespace dsa
