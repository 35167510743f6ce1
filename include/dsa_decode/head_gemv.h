// head_gemv: the per-head products of the MLA absorb (q x W_UK, FP8 out, with
// the KV-cache write fused in) and value-up (latent x W_UV, BF16 out), m = 1..16.
//
//   out[t, h, :] = x[t, h, :] @ weight[h]      x [m, H, I] BF16, weight [H, I, J] BF16
//   BF16 out = RNE(total); FP8 out = e4m3_satfinite(clamp(RNE_bf16(total) * (1 / scale),
//   +-448)), 1 / scale a rounded division (the stock static quant).
//
// Sums: kTensorCores (default; I % 64 == 0 up to 1024, J % 16 == 0, out 8 B
// aligned): |total - exact| <= 2^-14 * sum_i |x[i] w[i][j]|. kSeedOrder: FP32
// FMA chains per thread, a lane butterfly, warps in order; bitwise the CPU
// reference (reference::head_gemv). Both depend only on the token's own x and
// the weights (deterministic, batch invariant); kSeedOrder's order depends on
// the tactic, so it is batch invariant where the table gives one tactic per shape.
//
// Fused KV-cache write: kv[t] / k_scale (rounded, saturating e4m3) to slot
// slot_mapping[t]; negative slots and t >= len(slot_mapping) are skipped; a
// slot past capacity is skipped and counted in error_count.
// Weights are read before griddepcontrol.wait (PDL): no kernel in flight may write them.
#pragma once

#include <cuda_runtime.h>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kHeadGemvMaxTokens = 16;

enum class HeadGemvSums : int {
  kTensorCores = 0,  // default: BF16 tensor cores, FP32 accumulators, within the bound
  kSeedOrder = 1,    // FP32 FMA chains in a fixed order, bitwise the CPU reference's
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
  TensorView x;       // [m, H, I] BF16, dims 1-2 contiguous, token stride % 8 == 0
  TensorView weight;  // [H, I, J] BF16, J contiguous, head and row strides % 8 == 0
  TensorView out;     // [m, H, J] BF16 or FP8 e4m3, contiguous
  TensorView scale;   // [1] f32: required when out is FP8, absent otherwise
  const KvCacheWrite* cache = nullptr;  // optional
  HeadGemvSums sums = HeadGemvSums::kTensorCores;
  // kSeedOrder: release the next kernel before waiting on the predecessor, so
  // a long weight prologue after it (o_proj) streams early; not for
  // back-to-back head_gemv launches, whose CTAs would then wait on SMs.
  bool release_dependents_early = false;
};

// The tactic table's entry (kSeedOrder).
HeadGemvTactic head_gemv_tactic(int heads, int rows, int cols, int m);
Status check_head_gemv_tactic(int rows, int cols, int m, HeadGemvTactic tactic);
// Argument checks (x and weight 16 B aligned, cache 8 B, outputs overlap no
// input). A shape no tactic runs passes here; head_gemv returns kUnsupported.
Status check_head_gemv(const HeadGemvArgs& args);
// Parts of check_head_gemv: one weight [heads, rows, J] BF16, the cache write.
Status check_head_gemv_weight(const TensorView& weight, const char* name, int64_t heads, int64_t rows);
Status check_kv_cache_write(const KvCacheWrite& write, int64_t m);

// PDL launch; `tactic` (kSeedOrder only) null = the table's. Graph capturable
// after a first uncaptured call per tactic and device.
Status head_gemv(const HeadGemvArgs& args, cudaStream_t stream, const HeadGemvTactic* tactic = nullptr);

}  // namespace dsa
