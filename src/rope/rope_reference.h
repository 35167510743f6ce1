// CPU references of RoPE and the RoPE absorb (include/dsa_decode/rope.h):
// float64 (the exact rotation and absorbed query) and the kernel's FP32
// order (bitwise what the GPU writes for the same table), and where the
// GPU's outputs lie against the contract's bounds.
#pragma once

#include <cstdint>
#include <vector>

#include "dsa_decode/rope.h"
#include "head_gemv/head_gemv_reference.h"

namespace dsa::reference {

// cos and sin [R / 2] of `position` in float64 (rope_frequency, rope_table_scale).
void rope_cos_sin64(const RopeConfig& config, int64_t position, double* cos, double* sin);

// One row x [R] (BF16 bits) rotated by cos / sin [R / 2]: the kernel's FP32 order
// (a' = fma(a, c, -(b s)), b' = fma(b, c, a s)) and float64.
void rope_rotate_f32(const uint16_t* x, const float* cos, const float* sin, int rope_dim, RopeStyle style, float* out);
void rope_rotate_f64(const uint16_t* x, const double* cos, const double* sin, int rope_dim, RopeStyle style,
                     double* out);
// Index of the partner of value k in its pair, and the pair's index (its cos / sin entry).
int rope_partner(int k, int rope_dim, RopeStyle style);
int rope_pair(int k, int rope_dim, RopeStyle style);

// Host copies of the RoPE absorb's inputs; strides in elements.
struct RopeAbsorbHost {
  const uint16_t* q_nope;  // [m, H, P]
  int64_t q_nope_token_stride, q_nope_head_stride;
  const uint16_t* q_pe;  // [m, H, R]
  int64_t q_pe_token_stride, q_pe_head_stride;
  const uint16_t* k_pe;  // [m, R]
  int64_t k_pe_token_stride;
  const int64_t* positions;  // [m]
  const void* cos_sin;       // [rows, R] F32 or BF16 bits
  bool table_bf16;
  int64_t cos_sin_row_stride, cos_sin_rows;
  const uint16_t* weight;  // W_UK_T [H, P, L]
  int64_t weight_head_stride, weight_row_stride;
  int m, heads, rows, latent, rope_dim;
  RopeStyle style;
};

// The rotated rows the kernel writes, bitwise (FP32 order on the table's
// values, BF16 RNE; zeros for positions outside [0, rows)): q [m, H, R], k [m, R];
// out_of_range: the positions >= rows (the error count).
struct RopeRows {
  std::vector<uint16_t> q, k;
  int out_of_range = 0;
};
RopeRows rope_rows(const RopeAbsorbHost& a);

// The absorbed query [m, H, L + R] and k_pe rotated [m, R] in float64: the
// exact product sums, and the rotation by `exact` cos / sin (the config's
// closed form) or, when `exact` is null, by the table's own values.
struct RopeAbsorbExact {
  std::vector<double> q, k;
};
RopeAbsorbExact rope_absorb_f64(const RopeAbsorbHost& a, const RopeConfig* exact);

// Where the GPU's out [m, H, L + R] and k_pe_out [m, R] (packed host copies,
// BF16 bits) lie: the L columns against head_gemv's tensor-core bound; the
// rotated values against float64 with rope.h's bound, 2^-21 (|a| + |b|) scale
// with `exact` (the library's F32 table), 2^-22 (|a| + |b|) max(|c|, |s|)
// against the table's own values when null. A value passes when it lies between
// the BF16 roundings of exact - bound and exact + bound. Positions outside
// the table must give zeros.
struct RopeAbsorbDeviation {
  HeadGemvDeviation latent;
  int64_t rope_outside = 0;    // rotated values outside their interval (or not zero where they must be)
  int64_t rope_differing = 0;  // differing from the BF16 rounding of the exact value
  int rope_max_steps = 0;      // their largest distance from it, in BF16 ulps
  int64_t rope_compared = 0;
};
RopeAbsorbDeviation rope_absorb_deviation(const RopeAbsorbHost& a, const uint16_t* out, const uint16_t* k_out,
                                          const RopeConfig* exact);

}  // namespace dsa::reference
