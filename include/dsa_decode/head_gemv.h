// head_gemv: the per-head products of the MLA absorb (q x W_UK, FP8 out, with
// the latent's KV-cache write fused in) and value-up (latent x W_UV, BF16 out),
// for decode steps of 1..16 tokens.
//
//   out[t, h, :] = x[t, h, :] @ weight[h]        for t < m, h < H
//
//   x       [m, H, I]  BF16, dims 1-2 contiguous, token stride a multiple of 8
//   weight  [H, I, J]  BF16, J contiguous, head and row strides multiples of 8
//   out     [m, H, J]  BF16, or FP8 e4m3 statically quantized by `scale`
//
// Work split (tactic {tile, rows_per_thread}): CTA (h, c) owns the `tile`
// columns c*tile.. of head h. Thread (g, k) of a token group owns rows
// g*rows_per_thread.. of columns 8k..8k+7 of the tile; it copies them into a
// shared-memory weight slab (async copies, 8 rows per group) before
// griddepcontrol.wait, so the weight stream overlaps the predecessor kernel.
// The m tokens are split into token groups of up to 8 (the accumulators one
// thread holds); the groups run side by side in the CTA on the same slab.
//
// Summation order (fixed; the CPU reference reproduces it bit for bit):
//   1. per thread: acc = fma(x[r], w[r][j], acc) over its rows in order, from 0;
//   2. per warp: butterfly over the lanes of one column group (xor offsets
//      tile/8, 2*tile/8, .. 16), i.e. a pairwise tree of the row groups;
//   3. per token group: total = 0 + warp 0 + warp 1 + ... over its warps in order.
// Rounding: BF16 out = RNE(total). FP8 out = e4m3_satfinite(clamp(RNE_bf16(total)
// * (1 / scale), +-448)) with 1/scale a rounded division: the stock static quant.
//
// Opt-in tensor-core sums (args.sums = HeadGemvSums::kTensorCores): the
// products on the BF16 tensor cores (mma.sync m16n8k16, FP32 accumulators),
// for I a multiple of 64 up to 1024 and J a multiple of 16; no tactic. CTA
// (h, c) owns `tile` columns (64, 32 or 16, from the shape and m; the bits do
// not depend on it); out must be 8-byte aligned. Warp w owns
// rows 64w..64w+63 of every column of the tile: one accumulator per column
// and token, four chained k16 steps from 0; total = 0 + warp 0 + warp 1 + ...
// in order. The order inside one MMA is the hardware's (unspecified), so the
// totals are not the CPU reference's bits; the contract is
//   |total - exact| <= 2^-14 * sum_i |x[i] * w[i][j]|
// (reference::head_gemv_deviation checks each output against the roundings
// of the two ends of that interval). The bits still depend on nothing but the
// token's own x and the weights: the same on every run, for every m and
// every batch around the token. Why opt-in: from m = 4 on at H = 64 the seed
// order's FP32 FMAs on CUDA cores cannot keep up with the weight stream
// (docs/head_gemv.md); the tensor cores can, at the cost of bitwise equality
// with the seed.
//
// Fused KV-cache write (concat_and_cache_mla, FP8 cache): m more CTAs; CTA t
// stores kv[t, :] / k_scale (rounded division, saturating e4m3) at cache slot
// slot_mapping[t] = block * block_size + offset. Negative slots and tokens
// t >= len(slot_mapping) (CUDA-graph padding) are skipped; a slot past the
// cache's capacity is skipped too and counted in `error_count` when given.
#pragma once

#include <cuda_runtime.h>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kHeadGemvMaxTokens = 16;

// How head_gemv adds its products (see above).
enum class HeadGemvSums : int {
  kTensorCores = 0,  // the default: BF16 tensor cores, FP32 accumulators, within the contract's bound
  kSeedOrder = 1,    // opt-in: FP32 FMA chains in the seed's order, bitwise the CPU reference's
};

struct HeadGemvTactic {
  int tile = 64;            // columns per CTA: 16, 32, 64, 128 or 256
  int rows_per_thread = 8;  // 8, 16, 32 or 64
};

// The KV-cache write fused into the absorb launch.
struct KvCacheWrite {
  TensorView kv;            // [m, L] BF16, row stride a multiple of 8, 16-byte aligned
  TensorView cache;         // [blocks, block_size, L] FP8 e4m3; L contiguous; entry and block strides multiples of 8
  TensorView slot_mapping;  // [n] int64; n may be < m or > m
  TensorView k_scale;       // [1] f32
  unsigned int* error_count = nullptr;  // optional device counter of out-of-capacity slots
};

struct HeadGemvArgs {
  TensorView x;       // [m, H, I] BF16
  TensorView weight;  // [H, I, J] BF16
  TensorView out;     // [m, H, J] BF16 or FP8 e4m3, contiguous
  TensorView scale;   // [1] f32: required when out is FP8, absent otherwise
  const KvCacheWrite* cache = nullptr;  // optional
  HeadGemvSums sums = HeadGemvSums::kTensorCores;
  // PDL: let the next kernel in the stream launch before this one's wait on
  // its predecessor, not after it (kSeedOrder only; the tensor-core kernel
  // always releases after). For a chain whose next kernel has a long weight
  // prologue (the stage: o_proj after value-up): it then streams under this
  // kernel's predecessor. Not for back-to-back head_gemv launches: each
  // launch's CTAs then wait on SMs the running one needs (H200, value-up at
  // H = 8 alone: 1.2-1.5x slower, bench/results/head_gemv_2026-12-01_f9661fd.json).
  bool release_dependents_early = false;
};

// The table's tactic for these shapes and token count (src/head_gemv/tactics.cpp;
// docs/head_gemv.md has the measurements behind each entry). The summation
// order depends on the tactic only, so where the table gives one tactic for
// every m of a shape, a token's bits do not depend on the batch around it.
HeadGemvTactic head_gemv_tactic(int heads, int rows, int cols, int m);
// Whether `tactic` can run rows x cols at m tokens (divisibility, threads per
// CTA within the register budget, shared memory).
Status check_head_gemv_tactic(int rows, int cols, int m, HeadGemvTactic tactic);
// Checks every argument (dtypes, shapes, strides, 16-byte alignment of x and
// weight, 8-byte of the cache, outputs disjoint from every input); launches
// nothing. A shape no tactic can run (I not a multiple of 8 rows per thread,
// J not of a 16..256 column tile) passes here and head_gemv reports it as
// kUnsupported.
Status check_head_gemv(const HeadGemvArgs& args);
// The weight part of those checks, [heads, rows, J] BF16 under `name`: for a
// caller that holds a weight before any launch (the stage, at creation).
Status check_head_gemv_weight(const TensorView& weight, const char* name, int64_t heads, int64_t rows);
// The cache-write part of the checks, shared with stock_concat_and_cache_mla.
Status check_kv_cache_write(const KvCacheWrite& write, int64_t m);

// Launches on `stream` with PDL; `tactic` null = the table's (kSeedOrder
// only: kTensorCores takes no tactic, and a shape it cannot run, I not a
// multiple of 64 up to 1024 or J not of 16, is kUnsupported). Neither
// allocates nor synchronizes (CUDA-graph capturable: the first call with a
// tactic on a device may raise the kernel's shared-memory limit, make it
// outside a capture).
Status head_gemv(const HeadGemvArgs& args, cudaStream_t stream, const HeadGemvTactic* tactic = nullptr);

}  // namespace dsa
