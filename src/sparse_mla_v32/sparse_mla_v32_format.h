// DeepSeek-V3.2's FP8 cache entry (include/dsa_decode/sparse_mla_v32.h): the
// rounding steps of the cache write, shared by the CPU model and the GPU
// kernel so that both produce the same bytes. Sources (docs/sparse_mla_v32.md):
// vLLM csrc/cache_kernels.cu concat_and_cache_ds_mla_kernel, FlashMLA
// README.md ("FP8 with scale") and tests/quant.py.
#pragma once

#include <cfloat>
#include <cstdint>

#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla_v32.h"

namespace dsa::v32 {

inline constexpr int kGroups = kSparseMlaV32Latent / kSparseMlaV32GroupSize;  // 4 scales a token
static_assert(kSparseMlaV32ScaleOffset == kSparseMlaV32Latent, "scales follow the codes");
static_assert(kSparseMlaV32RopeOffset == kSparseMlaV32ScaleOffset + 4 * kGroups, "RoPE follows the scales");
static_assert(kSparseMlaV32EntryBytes == kSparseMlaV32RopeOffset + 2 * kSparseMlaV32Rope, "656 bytes");
static_assert(kSparseMlaV32EntryBytes % 16 == 0, "entries of whole 16-byte units (41)");

// fmaxf: the non-NaN operand when one is NaN (C99 fmax, PTX max.f32). Only
// ever applied to magnitudes here, so the sign of a zero never matters.
DSA_HD float fmax_ignoring_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  if (a != a) return b;
  if (b != b) return a;
  return a > b ? a : b;
#endif
}

// |x| of a BF16 value as FP32 (exact; NaN stays NaN).
DSA_HD float bf16_abs(uint16_t bits) { return num::bf16_to_float(static_cast<uint16_t>(bits & 0x7FFFu)); }

// The scale of a group whose largest |x| (fmaxf over the group) is amax:
// amax / 448 rounded, at least FLT_MIN (fmaxf: a NaN amax gives FLT_MIN).
DSA_HD float group_scale(float amax) {
  return fmax_ignoring_nan(num::div_rn(amax, num::kFp8E4M3Max), FLT_MIN);
}

// One latent value's code: x / scale rounded, saturating e4m3 RNE (NaN -> 0x7F).
DSA_HD uint8_t group_code(uint16_t x_bf16, float scale) { return num::cache_fp8(x_bf16, scale); }

}  // namespace dsa::v32
