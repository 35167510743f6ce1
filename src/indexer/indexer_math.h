// The indexer's fixed-order arithmetic (include/dsa_decode/indexer.h), usable
// from host and device so the GPU kernels and the CPU reference compute the
// same bits. Every multiply whose result feeds an add is written with mul_rn /
// add_rn / fmaf: nvcc contracts a * b + c into one fma by default, which would
// change the bits on the device only.
#pragma once

#include <cfloat>
#include <cstdint>

#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"

namespace dsa::indexer_math {

DSA_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DSA_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// 128^-0.5 rounded to FP32 (0x3DB504F3): the Hadamard transform's scale.
inline constexpr float kHadamardScale = 0.0883883476483184405f;
// The head-weight fold's constant fl32((128 H)^-0.5): 2^-6 exactly at H = 32,
// 2^-5.5 and 2^-6.5 rounded to FP32 at H = 16 and 64.
DSA_HD float head_weight_scale(int heads) {
  return heads == 16 ? 0.0220970869120796104f : heads == 64 ? 0.0110485434560398052f : 0.015625f;
}
// Below this the quant's scale would be 2^-22 anyway: absmax's floor.
inline constexpr float kAbsmaxFloor = 1e-4f;

// Unscaled Walsh-Hadamard transform of 128 values in Sylvester order
// (out[i] = sum_j (-1)^popcount(i & j) x[j]), in place: stages h = 1, 2, 4,
// ..., 64; in each, every pair (i, i + h) with i & h == 0 becomes (a + b, a - b).
// A GPU kernel may spread the pairs over lanes; each value must see the same
// operations in the same stage order.
DSA_HD void hadamard128(float* x) {
  for (int h = 1; h < kIndexerDim; h *= 2) {
    for (int i = 0; i < kIndexerDim; ++i) {
      if (i & h) continue;
      const float a = x[i], b = x[i + h];
      x[i] = add_rn(a, b);
      x[i + h] = a - b;
    }
  }
}

// k with s = 2^k the smallest power of two for which absmax / s <= 448, with
// absmax first raised to 1e-4 and lowered to the largest finite FP32 (so an
// infinity gives a finite scale). Read from the bits, exactly: absmax =
// (1 + M / 2^23) 2^e and 448 = 1.75 * 2^8, so k = e - 8 when the significand
// is <= 1.75 and e - 7 otherwise. Range -22..120. This equals the stock
// formula ceil(log2(absmax / 448)) on the FP32 quotient: with the 1e-4 floor
// the quotient stays normal, and no float is close enough above 448 * 2^k for
// the rounded quotient to fall back onto 2^k.
DSA_HD int fp8_scale_exponent(float absmax) {
  const float clamped = fminf(fmaxf(absmax, kAbsmaxFloor), FLT_MAX);
  const uint32_t bits = num::float_bits(clamped);
  const int exponent = static_cast<int>(bits >> 23) - 127;
  const uint32_t significand = bits & 0x7FFFFFu;
  return significand <= 0x600000u ? exponent - 8 : exponent - 7;  // 0x600000: significand 1.75
}

DSA_HD float pow2(int k) { return num::bits_float(static_cast<uint32_t>(k + 127) << 23); }  // k in -126..127

// A Hadamard output value (unscaled transform) scaled by 128^-0.5 and rounded to BF16.
DSA_HD float hadamard_output(float x) { return num::round_bf16(mul_rn(x, kHadamardScale)); }

// Hadamard, BF16 and FP8 quant of one 128-value row (a q head or a pooled k):
// codes [128] e4m3 and the power-of-two scale; returns the scale.
DSA_HD float hadamard_quantize(const uint16_t* row_bf16, uint8_t* codes) {
  float x[kIndexerDim];
  for (int i = 0; i < kIndexerDim; ++i) x[i] = num::bf16_to_float(row_bf16[i]);
  hadamard128(x);
  float absmax = 0.0f;  // max is exact, so its order is free; fmaxf skips NaN
  for (int i = 0; i < kIndexerDim; ++i) {
    x[i] = hadamard_output(x[i]);
    absmax = fmaxf(absmax, fabsf(x[i]));
  }
  const int k = fp8_scale_exponent(absmax);
  const float inverse_scale = pow2(-k);  // exact, so x * (1 / s) is the rounded x / s
  for (int i = 0; i < kIndexerDim; ++i) codes[i] = num::quant_fp8_static(x[i], inverse_scale);
  return pow2(k);
}

// The folded head weight w' = (w * s) * head_weight_scale(heads).
DSA_HD float fold_head_weight(float weight, float scale, int heads) {
  return mul_rn(mul_rn(weight, scale), head_weight_scale(heads));
}

// exp(x) for x <= 0 (a softmax's x - max), from basic operations only, so the
// host and the device agree bit for bit (expf differs between them): x = n ln2
// + r with n = rint(x log2 e) and r = x - n ln2 in two fma steps (Cody-Waite;
// n * ln2_hi is exact), |r| <= 0.35; exp(r) by its degree-7 Taylor polynomial
// in Horner form with fma (truncation < 2^-27); times 2^n, in two exact steps
// when 2^n is subnormal so the result rounds once. Error < 2 ulp. NaN gives NaN,
// x < -104 gives +0 (exp(x) is below half the smallest subnormal).
DSA_HD float exp_nonpositive(float x) {
  if (x != x) return x;
  if (x < -104.0f) return 0.0f;
  constexpr float kLog2E = 1.44269502f;
  constexpr float kLn2High = 0.693145751953125f;       // 0x3F317200: 15 significant bits
  constexpr float kLn2Low = 1.42860677e-06f;           // ln 2 - kLn2High
  const float n = rintf(mul_rn(x, kLog2E));            // -150..0
  float r = fmaf(n, -kLn2High, x);
  r = fmaf(n, -kLn2Low, r);
  float p = 1.0f / 5040.0f;
  p = fmaf(p, r, 1.0f / 720.0f);
  p = fmaf(p, r, 1.0f / 120.0f);
  p = fmaf(p, r, 1.0f / 24.0f);
  p = fmaf(p, r, 1.0f / 6.0f);
  p = fmaf(p, r, 0.5f);
  p = fmaf(p, r, 1.0f);
  p = fmaf(p, r, 1.0f);
  const int k = static_cast<int>(n);
  if (k >= -126) return mul_rn(p, pow2(k));
  return mul_rn(mul_rn(p, pow2(k + 64)), pow2(-64));
}

// The sum a warp's butterfly (xor 16, 8, 4, 2, 1) gives over 32 lane partials;
// FP32 addition commutes, so every lane ends with this value.
DSA_HD float butterfly_sum32(float* lanes) {
  for (int offset = 16; offset >= 1; offset /= 2) {
    float next[32];
    for (int lane = 0; lane < 32; ++lane) next[lane] = add_rn(lanes[lane], lanes[lane ^ offset]);
    for (int lane = 0; lane < 32; ++lane) lanes[lane] = next[lane];
  }
  return lanes[0];
}

// Step 1's pieces, as lane l of a warp holding elements 4l..4l+3 computes
// them: layernorm128 below and the GPU kernels' warp version share them.
DSA_HD float layernorm_lane_sum(const float* v) { return add_rn(add_rn(add_rn(v[0], v[1]), v[2]), v[3]); }

DSA_HD float layernorm_lane_squares(const float* d) {
  float squares = mul_rn(d[0], d[0]);
  for (int j = 1; j < 4; ++j) squares = fmaf(d[j], d[j], squares);
  return squares;
}

// The mean from the butterfly's sum of the lane sums.
DSA_HD float layernorm_mean(float sum) { return mul_rn(sum, 1.0f / kIndexerDim); }

// 1 / sqrt(variance + eps) from the butterfly's sum of the lane squares.
DSA_HD float layernorm_rstd(float square_sum) {
  const float variance = mul_rn(square_sum, 1.0f / kIndexerDim);
  return num::div_rn(1.0f, sqrtf(add_rn(variance, kIndexerNormEps)));
}

// One output element from its deviation d = x - mean.
DSA_HD uint16_t layernorm_output(float d, float rstd, float weight, float bias) {
  return num::float_to_bf16(fmaf(mul_rn(d, rstd), weight, bias));
}

// Step 1: LayerNorm of one index k row (BF16 [128]) to BF16 [128].
DSA_HD void layernorm128(const uint16_t* k_bf16, const float* weight, const float* bias, uint16_t* out_bf16) {
  float x[kIndexerDim], lanes[32];
  for (int i = 0; i < kIndexerDim; ++i) x[i] = num::bf16_to_float(k_bf16[i]);
  for (int lane = 0; lane < 32; ++lane) lanes[lane] = layernorm_lane_sum(&x[4 * lane]);
  const float mean = layernorm_mean(butterfly_sum32(lanes));
  float d[kIndexerDim];
  for (int i = 0; i < kIndexerDim; ++i) d[i] = x[i] - mean;
  for (int lane = 0; lane < 32; ++lane) lanes[lane] = layernorm_lane_squares(&d[4 * lane]);
  const float rstd = layernorm_rstd(butterfly_sum32(lanes));
  for (int i = 0; i < kIndexerDim; ++i) out_bf16[i] = layernorm_output(d[i], rstd, weight[i], bias[i]);
}

// RoPE of one pair (a, b) by the table's cos c and sin s, in rope.h's FP32
// order: a' = fma(a, c, -(b s)), b' = fma(b, c, a s) (then BF16 RNE).
DSA_HD float rope_first(float a, float b, float c, float s) { return fmaf(a, c, -mul_rn(b, s)); }
DSA_HD float rope_second(float a, float b, float c, float s) { return fmaf(b, c, mul_rn(a, s)); }

// Value k (< R) of a rotated row: its pair's index (the cos/sin entry) and
// whether it is the pair's first value; interleaved pairs (2i, 2i + 1),
// half-split pairs (i, i + R / 2).
DSA_HD int rope_pair_of(int k, int rope_dims, bool half_split) { return half_split ? k % (rope_dims / 2) : k / 2; }
DSA_HD bool rope_is_first(int k, int rope_dims, bool half_split) { return half_split ? k < rope_dims / 2 : k % 2 == 0; }

// The first R values of a BF16 row rotated in place (cos, sin [R / 2]).
DSA_HD void rope_row(uint16_t* row, int rope_dims, bool half_split, const float* cos, const float* sin) {
  for (int i = 0; i < rope_dims / 2; ++i) {
    const int first = half_split ? i : 2 * i, second = half_split ? i + rope_dims / 2 : 2 * i + 1;
    const float a = num::bf16_to_float(row[first]), b = num::bf16_to_float(row[second]);
    row[first] = num::float_to_bf16(rope_first(a, b, cos[i], sin[i]));
    row[second] = num::float_to_bf16(rope_second(a, b, cos[i], sin[i]));
  }
}

// The largest pool size a plan takes.
inline constexpr int kMaxPoolSize = 16;

// Step 3's softmax pooling of one dim over a pool of kPool tokens: k [kPool]
// and gate [kPool] are the dim's values of the pool's tokens kPool p + j (from
// BF16), ape [kPool] the dim's column of ape; returns the pooled value as
// BF16. Order: s_j = gate_j + ape_j; max by a chain from s_0; e_j =
// exp_nonpositive(s_j - max); sum by a chain from e_0; pooled by an fma chain
// of e_j / sum times k_j from (e_0 / sum) k_0.
template <int kPool>
DSA_HD uint16_t pool_softmax_dim(const float* k, const float* gate, const float* ape) {
  float s[kPool], e[kPool];
  for (int j = 0; j < kPool; ++j) s[j] = add_rn(gate[j], ape[j]);
  float max_s = s[0];
  for (int j = 1; j < kPool; ++j) max_s = fmaxf(max_s, s[j]);
  for (int j = 0; j < kPool; ++j) e[j] = exp_nonpositive(s[j] - max_s);
  float sum = e[0];
  for (int j = 1; j < kPool; ++j) sum = add_rn(sum, e[j]);
  float pooled = mul_rn(num::div_rn(e[0], sum), k[0]);
  for (int j = 1; j < kPool; ++j) pooled = fmaf(num::div_rn(e[j], sum), k[j], pooled);
  return num::float_to_bf16(pooled);
}

// Step 3's softmax pooling of one pool: k and gate rows of its kPool tokens
// (BF16 [128] each, token kPool p + j in entry j), ape [kPool, 128]; pooled
// BF16 [128].
template <int kPool>
DSA_HD void pool_softmax128(const uint16_t* const* k_rows, const uint16_t* const* gate_rows, const float* ape,
                            uint16_t* pooled_bf16) {
  for (int i = 0; i < kIndexerDim; ++i) {
    float k[kPool], gate[kPool], ape_column[kPool];
    for (int j = 0; j < kPool; ++j) {
      k[j] = num::bf16_to_float(k_rows[j][i]);
      gate[j] = num::bf16_to_float(gate_rows[j][i]);
      ape_column[j] = ape[j * kIndexerDim + i];
    }
    pooled_bf16[i] = pool_softmax_dim<kPool>(k, gate, ape_column);
  }
}

// pool_softmax128 for a pool size of 4, 8 or 16 given at run time (host).
inline void pool_softmax128(int pool, const uint16_t* const* k_rows, const uint16_t* const* gate_rows,
                            const float* ape, uint16_t* pooled_bf16) {
  switch (pool) {
    case 8:
      return pool_softmax128<8>(k_rows, gate_rows, ape, pooled_bf16);
    case 16:
      return pool_softmax128<16>(k_rows, gate_rows, ape, pooled_bf16);
    default:
      return pool_softmax128<4>(k_rows, gate_rows, ape, pooled_bf16);
  }
}

}  // namespace dsa::indexer_math
