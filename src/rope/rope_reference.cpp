#include "rope/rope_reference.h"

#include <algorithm>
#include <cmath>

#include "core/reference_bounds.h"
#include "dsa_decode/numerics.h"

namespace dsa::reference {
namespace {

// Table entry `index` of row `row` as float.
float table_value(const RopeAbsorbHost& a, int64_t row, int index) {
  const int64_t offset = row * a.cos_sin_row_stride + index;
  return a.table_bf16 ? num::bf16_to_float(static_cast<const uint16_t*>(a.cos_sin)[offset])
                      : static_cast<const float*>(a.cos_sin)[offset];
}

bool valid_position(const RopeAbsorbHost& a, int t) { return a.positions[t] >= 0 && a.positions[t] < a.cos_sin_rows; }

// Input row of token t: head j < H of q_pe, or k_pe for j == H.
const uint16_t* input_row(const RopeAbsorbHost& a, int t, int j) {
  return j == a.heads ? a.k_pe + t * a.k_pe_token_stride : a.q_pe + t * a.q_pe_token_stride + j * a.q_pe_head_stride;
}

}  // namespace

void rope_cos_sin64(const RopeConfig& config, int64_t position, double* cos, double* sin) {
  const double scale = rope_table_scale(config);
  for (int i = 0; i < config.rope_dim / 2; ++i) {
    const double angle = static_cast<double>(position) * rope_frequency(config, i);
    cos[i] = std::cos(angle) * scale;
    sin[i] = std::sin(angle) * scale;
  }
}

int rope_partner(int k, int rope_dim, RopeStyle style) {
  return style == RopeStyle::kInterleaved ? (k ^ 1) : (k < rope_dim / 2 ? k + rope_dim / 2 : k - rope_dim / 2);
}

int rope_pair(int k, int rope_dim, RopeStyle style) {
  return style == RopeStyle::kInterleaved ? k / 2 : k % (rope_dim / 2);
}

void rope_rotate_f32(const uint16_t* x, const float* cos, const float* sin, int rope_dim, RopeStyle style, float* out) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    const int first = style == RopeStyle::kInterleaved ? 2 * i : i;
    const int second = style == RopeStyle::kInterleaved ? 2 * i + 1 : i + rope_dim / 2;
    const float a = num::bf16_to_float(x[first]), b = num::bf16_to_float(x[second]);
    const float bs = b * sin[i], as = a * sin[i];  // rounded products (no contraction: -ffp-contract=off)
    out[first] = std::fma(a, cos[i], -bs);
    out[second] = std::fma(b, cos[i], as);
  }
}

void rope_rotate_f64(const uint16_t* x, const double* cos, const double* sin, int rope_dim, RopeStyle style,
                     double* out) {
  for (int i = 0; i < rope_dim / 2; ++i) {
    const int first = style == RopeStyle::kInterleaved ? 2 * i : i;
    const int second = style == RopeStyle::kInterleaved ? 2 * i + 1 : i + rope_dim / 2;
    const double a = num::bf16_to_float(x[first]), b = num::bf16_to_float(x[second]);
    out[first] = a * cos[i] - b * sin[i];
    out[second] = b * cos[i] + a * sin[i];
  }
}

RopeRows rope_rows(const RopeAbsorbHost& a) {
  const int r = a.rope_dim, half = r / 2;
  RopeRows rows;
  rows.q.assign(size_t(a.m) * a.heads * r, 0);
  rows.k.assign(size_t(a.m) * r, 0);
  std::vector<float> cos(half), sin(half), rotated(r);
  for (int t = 0; t < a.m; ++t) {
    if (a.positions[t] >= a.cos_sin_rows) ++rows.out_of_range;
    if (!valid_position(a, t)) continue;  // zeros
    for (int i = 0; i < half; ++i) {
      cos[i] = table_value(a, a.positions[t], i);
      sin[i] = table_value(a, a.positions[t], half + i);
    }
    for (int j = 0; j <= a.heads; ++j) {
      rope_rotate_f32(input_row(a, t, j), cos.data(), sin.data(), r, a.style, rotated.data());
      uint16_t* out = j == a.heads ? &rows.k[size_t(t) * r] : &rows.q[(size_t(t) * a.heads + j) * r];
      for (int k = 0; k < r; ++k) out[k] = num::float_to_bf16(rotated[k]);
    }
  }
  return rows;
}

namespace {

// cos / sin of token t in float64: the closed form, or the table's values.
void exact_cos_sin(const RopeAbsorbHost& a, const RopeConfig* exact, int t, double* cos, double* sin) {
  const int half = a.rope_dim / 2;
  if (exact != nullptr) {
    rope_cos_sin64(*exact, a.positions[t], cos, sin);
    return;
  }
  for (int i = 0; i < half; ++i) {
    cos[i] = table_value(a, a.positions[t], i);
    sin[i] = table_value(a, a.positions[t], half + i);
  }
}

}  // namespace

RopeAbsorbExact rope_absorb_f64(const RopeAbsorbHost& a, const RopeConfig* exact) {
  const int width = a.latent + a.rope_dim, half = a.rope_dim / 2;
  RopeAbsorbExact e;
  e.q.assign(size_t(a.m) * a.heads * width, 0.0);
  e.k.assign(size_t(a.m) * a.rope_dim, 0.0);
  std::vector<double> cos(half), sin(half);
  for (int t = 0; t < a.m; ++t) {
    for (int h = 0; h < a.heads; ++h) {
      double* row = &e.q[(size_t(t) * a.heads + h) * width];
      const uint16_t* x = a.q_nope + t * a.q_nope_token_stride + h * a.q_nope_head_stride;
      const uint16_t* w = a.weight + h * a.weight_head_stride;
      for (int i = 0; i < a.rows; ++i) {
        const double xi = num::bf16_to_float(x[i]);
        for (int j = 0; j < a.latent; ++j) row[j] += xi * num::bf16_to_float(w[i * a.weight_row_stride + j]);
      }
    }
    if (!valid_position(a, t)) continue;
    exact_cos_sin(a, exact, t, cos.data(), sin.data());
    for (int j = 0; j <= a.heads; ++j) {
      double* out = j == a.heads ? &e.k[size_t(t) * a.rope_dim] : &e.q[(size_t(t) * a.heads + j) * width + a.latent];
      rope_rotate_f64(input_row(a, t, j), cos.data(), sin.data(), a.rope_dim, a.style, out);
    }
  }
  return e;
}

RopeAbsorbDeviation rope_absorb_deviation(const RopeAbsorbHost& a, const uint16_t* out, const uint16_t* k_out,
                                          const RopeConfig* exact) {
  RopeAbsorbDeviation d;
  const int width = a.latent + a.rope_dim, r = a.rope_dim, half = r / 2;

  // The latent columns: head_gemv's bound on packed copies of q_nope and out[..., :L].
  std::vector<uint16_t> x(size_t(a.m) * a.heads * a.rows), latent(size_t(a.m) * a.heads * a.latent);
  for (int t = 0; t < a.m; ++t) {
    for (int h = 0; h < a.heads; ++h) {
      std::copy_n(a.q_nope + t * a.q_nope_token_stride + h * a.q_nope_head_stride, a.rows,
                  &x[(size_t(t) * a.heads + h) * a.rows]);
      std::copy_n(out + (size_t(t) * a.heads + h) * width, a.latent, &latent[(size_t(t) * a.heads + h) * a.latent]);
    }
  }
  const HeadGemvHost gemv{x.data(),           int64_t(a.heads) * a.rows, a.weight, a.weight_head_stride,
                          a.weight_row_stride, a.m,                      a.heads,  a.rows,
                          a.latent};
  d.latent = head_gemv_deviation(gemv, latent.data(), /*fp8=*/false, 1.0f);

  const double scale = exact != nullptr ? rope_table_scale(*exact) : 1.0;
  std::vector<double> cos(half), sin(half), rotated(r);
  for (int t = 0; t < a.m; ++t) {
    const bool valid = valid_position(a, t);
    if (valid) exact_cos_sin(a, exact, t, cos.data(), sin.data());
    for (int j = 0; j <= a.heads; ++j) {
      const uint16_t* in = input_row(a, t, j);
      const uint16_t* got = j == a.heads ? k_out + size_t(t) * r : out + (size_t(t) * a.heads + j) * width + a.latent;
      if (valid) rope_rotate_f64(in, cos.data(), sin.data(), r, a.style, rotated.data());
      for (int k = 0; k < r; ++k) {
        ++d.rope_compared;
        if (!valid) {
          d.rope_outside += got[k] != 0;
          continue;
        }
        const int i = rope_pair(k, r, a.style), partner = rope_partner(k, r, a.style);
        const double magnitude =
            std::fabs(num::bf16_to_float(in[k])) + std::fabs(num::bf16_to_float(in[partner]));
        const double bound = exact != nullptr ? std::ldexp(magnitude * scale, -21)
                                              : std::ldexp(magnitude * std::max(std::fabs(cos[i]), std::fabs(sin[i])), -22);
        const int low = ordered_bf16(num::float_to_bf16(float_below(rotated[k] - bound)));
        const int high = ordered_bf16(num::float_to_bf16(float_above(rotated[k] + bound)));
        const int value = ordered_bf16(got[k]);
        const int nearest = ordered_bf16(num::float_to_bf16(static_cast<float>(rotated[k])));
        d.rope_outside += value < low || value > high;
        if (value != nearest) {
          ++d.rope_differing;
          d.rope_max_steps = std::max(d.rope_max_steps, std::abs(value - nearest));
        }
      }
    }
  }
  return d;
}

}  // namespace dsa::reference
