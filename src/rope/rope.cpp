// RoPE: the presets' rotary configurations, the float64 frequencies and the
// cos/sin table, and the RoPE absorb's argument checks and dispatch. Contract:
// include/dsa_decode/rope.h; the facts behind the presets: docs/rope.md.
#include "dsa_decode/rope.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "rope/rope_kernels.h"

namespace dsa {
namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

bool valid_rope_dim(int64_t r) { return r == 16 || r == 32 || r == 64 || r == 128 || r == 256; }

// 0.1 m ln(s) + 1, or 1 for s <= 1 (vLLM's yarn_get_mscale).
double yarn_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// The dim whose wavelength makes `rotations` turns over the original context.
double correction_dim(double rotations, int dim, double base, double original) {
  return dim * std::log(original / (rotations * 2.0 * kPi)) / (2.0 * std::log(base));
}

std::string number(double v) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", v);
  return text;
}

}  // namespace

Status rope_preset_config(std::string_view preset, RopeTarget target, RopeConfig* out) {
  if (target != RopeTarget::kAttention && target != RopeTarget::kIndexer) {
    return invalid_argument("target", "RopeTarget::kAttention (0) or kIndexer (1)",
                            std::to_string(static_cast<int>(target)));
  }
  RopeConfig c;
  c.rope_dim = 64;
  if (preset == "dsv32") {
    // DeepSeek-V3.2: YaRN, theta 1e4, factor 40 over 4096 positions (163840 rows).
    c.theta = 10000.0;
    c.factor = 40.0;
    c.original_max_position = 4096;
    c.beta_fast = 32.0;
    c.beta_slow = 1.0;
    c.mscale = 1.0;
    c.mscale_all_dim = 1.0;
    c.max_position = 163840;
    // The MLA rotary is interleaved, the indexer's half-split (indexer_rope_interleave absent).
    c.style = target == RopeTarget::kAttention ? RopeStyle::kInterleaved : RopeStyle::kHalfSplit;
  } else if (preset == "glm5") {
    // GLM-5: plain RoPE, theta 1e6, 202752 positions; both rotaries interleaved
    // (rope_interleave and indexer_rope_interleave true).
    c.theta = 1000000.0;
    c.factor = 1.0;
    c.original_max_position = 202752;
    c.mscale = 1.0;
    c.mscale_all_dim = 0.0;
    c.max_position = 202752;
    c.style = RopeStyle::kInterleaved;
  } else {
    return invalid_argument("preset", "dsv32 or glm5 (the presets with rotary dims)", std::string(preset));
  }
  *out = c;
  return Status();
}

Status check_rope_config(const RopeConfig& c) {
  if (!valid_rope_dim(c.rope_dim)) {
    return invalid_argument("rope_dim", "16, 32, 64, 128 or 256", std::to_string(c.rope_dim));
  }
  if (!std::isfinite(c.theta) || c.theta <= 1.0) return invalid_argument("theta", "a finite value > 1", number(c.theta));
  if (!std::isfinite(c.factor) || c.factor < 1.0) {
    return invalid_argument("factor", "a finite value >= 1 (1 = no YaRN)", number(c.factor));
  }
  if (c.factor > 1.0) {
    if (c.original_max_position < 1) {
      return invalid_argument("original_max_position", "at least 1 with factor > 1",
                              std::to_string(c.original_max_position));
    }
    if (!std::isfinite(c.beta_fast) || !std::isfinite(c.beta_slow) || c.beta_fast <= 0.0 || c.beta_slow <= 0.0) {
      return invalid_argument("beta_fast", "beta_fast and beta_slow finite and > 0",
                              number(c.beta_fast) + ", " + number(c.beta_slow));
    }
  }
  if (!std::isfinite(c.mscale) || !std::isfinite(c.mscale_all_dim) || yarn_mscale(c.factor, c.mscale) <= 0.0 ||
      yarn_mscale(c.factor, c.mscale_all_dim) <= 0.0) {
    return invalid_argument("mscale", "mscale and mscale_all_dim finite, with positive magnitude factors",
                            number(c.mscale) + ", " + number(c.mscale_all_dim));
  }
  if (c.max_position < 1) return invalid_argument("max_position", "at least 1", std::to_string(c.max_position));
  if (c.style != RopeStyle::kInterleaved && c.style != RopeStyle::kHalfSplit) {
    return invalid_argument("style", "RopeStyle::kInterleaved (0) or kHalfSplit (1)",
                            std::to_string(static_cast<int>(c.style)));
  }
  return Status();
}

double rope_frequency(const RopeConfig& c, int pair) {
  const int dim = c.rope_dim;
  const double extrapolation = 1.0 / std::pow(c.theta, 2.0 * pair / dim);
  if (c.factor <= 1.0) return extrapolation;
  const double interpolation = extrapolation / c.factor;
  const double original = static_cast<double>(c.original_max_position);
  const double low = std::max(std::floor(correction_dim(c.beta_fast, dim, c.theta, original)), 0.0);
  double high = std::min(std::ceil(correction_dim(c.beta_slow, dim, c.theta, original)), dim - 1.0);
  if (low == high) high += 0.001;
  const double ramp = std::min(std::max((pair - low) / (high - low), 0.0), 1.0);
  const double extrapolated = 1.0 - ramp;  // 1: the original frequency; 0: the interpolated one
  return interpolation * (1.0 - extrapolated) + extrapolation * extrapolated;
}

double rope_table_scale(const RopeConfig& c) {
  return yarn_mscale(c.factor, c.mscale) / yarn_mscale(c.factor, c.mscale_all_dim);
}

double rope_softmax_scale(const RopeConfig& c, int qk_head_dim) {
  const double m = yarn_mscale(c.factor, c.mscale_all_dim);
  return m * m / std::sqrt(static_cast<double>(qk_head_dim));
}

Status rope_cos_sin_table(const RopeConfig& c, int64_t first_position, int64_t rows, float* out) {
  DSA_RETURN_IF_ERROR(check_rope_config(c));
  if (first_position < 0 || rows < 0 || first_position > (int64_t{1} << 40)) {
    return invalid_argument("first_position", "positions from 0 (and rows >= 0)",
                            std::to_string(first_position) + ", rows " + std::to_string(rows));
  }
  if (rows > 0 && out == nullptr) return invalid_argument("out", "a host buffer of rows * rope_dim floats", "null");
  const int half = c.rope_dim / 2;
  const double scale = rope_table_scale(c);
  std::vector<double> frequency(half);
  for (int i = 0; i < half; ++i) frequency[i] = rope_frequency(c, i);
  for (int64_t r = 0; r < rows; ++r) {
    const double position = static_cast<double>(first_position + r);
    float* row = out + r * c.rope_dim;
    for (int i = 0; i < half; ++i) {
      const double angle = position * frequency[i];
      row[i] = static_cast<float>(std::cos(angle) * scale);
      row[half + i] = static_cast<float>(std::sin(angle) * scale);
    }
  }
  return Status();
}

namespace {

// Per-head rows [m, heads, dim] BF16 read 16 bytes at a time, with any head
// and token strides that are multiples of 8 and do not overlap.
Status check_head_rows_strided(const TensorView& t, const char* name, int64_t m, int64_t heads, int64_t dim) {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {m, heads, dim}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 2, 1));
  const int64_t head_stride = heads > 1 ? t.stride(1) : dim;
  if ((heads > 1 && (head_stride % 8 != 0 || head_stride < dim)) ||
      (m > 1 && (t.stride(0) % 8 != 0 || t.stride(0) < (heads - 1) * head_stride + dim))) {
    return invalid_argument(name, "head and token strides that are multiples of 8 and do not overlap", t.describe());
  }
  return check_aligned(t, name, 16);
}

// Rows [m, dim] BF16, 16 bytes at a time.
Status check_token_rows(const TensorView& t, const char* name, int64_t m, int64_t dim) {
  DSA_RETURN_IF_ERROR(check_dtype(t, name, DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(t, name, {m, dim}));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_stride(t, name, 1, 1));
  if (m > 1 && (t.stride(0) % 8 != 0 || t.stride(0) < dim)) {
    return invalid_argument(name, "a token stride that is a multiple of 8 and at least R", t.describe());
  }
  return check_aligned(t, name, 16);
}

}  // namespace

Status check_rope_absorb(const RopeAbsorbArgs& a) {
  if (a.style != RopeStyle::kInterleaved && a.style != RopeStyle::kHalfSplit) {
    return invalid_argument("style", "RopeStyle::kInterleaved (0) or kHalfSplit (1)",
                            std::to_string(static_cast<int>(a.style)));
  }
  DSA_RETURN_IF_ERROR(check_dtype(a.q_nope, "q_nope", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.q_nope, "q_nope", {-1, -1, -1}));
  const int64_t m = a.q_nope.size(0), heads = a.q_nope.size(1), rows = a.q_nope.size(2);
  if (m < 1 || m > kHeadGemvMaxTokens) {
    return invalid_argument("q_nope", "1.." + std::to_string(kHeadGemvMaxTokens) + " tokens in dim 0",
                            a.q_nope.describe());
  }
  if (heads < 1 || rows < 64 || rows > 1024 || rows % 64 != 0 || heads * rows > kMaxDim) {
    return invalid_argument("q_nope", "at least one head and P a multiple of 64 up to 1024", a.q_nope.describe());
  }
  DSA_RETURN_IF_ERROR(check_head_rows_strided(a.q_nope, "q_nope", m, heads, rows));

  DSA_RETURN_IF_ERROR(check_dtype(a.q_pe, "q_pe", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.q_pe, "q_pe", {m, heads, -1}));
  const int64_t rope = a.q_pe.size(2);
  if (!valid_rope_dim(rope)) return invalid_argument("q_pe", "R of 16, 32, 64, 128 or 256", a.q_pe.describe());
  DSA_RETURN_IF_ERROR(check_head_rows_strided(a.q_pe, "q_pe", m, heads, rope));
  DSA_RETURN_IF_ERROR(check_token_rows(a.k_pe, "k_pe", m, rope));

  DSA_RETURN_IF_ERROR(check_dtype(a.positions, "positions", DType::kI64));
  DSA_RETURN_IF_ERROR(check_shape(a.positions, "positions", {-1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.positions, "positions"));
  if (a.positions.size(0) < m) {
    return invalid_argument("positions", "one position per token (at least " + std::to_string(m) + ")",
                            a.positions.describe());
  }
  if (a.positions.size(0) > 1 && a.positions.stride(0) != 1) {
    return invalid_argument("positions", "a contiguous vector", a.positions.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(a.positions, "positions", 8));

  if (a.cos_sin.dtype != DType::kF32 && a.cos_sin.dtype != DType::kBF16) {
    DSA_RETURN_IF_ERROR(check_present(a.cos_sin, "cos_sin"));
    return invalid_argument("cos_sin", "dtype f32 or bf16", a.cos_sin.describe());
  }
  DSA_RETURN_IF_ERROR(check_shape(a.cos_sin, "cos_sin", {-1, rope}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.cos_sin, "cos_sin"));
  DSA_RETURN_IF_ERROR(check_stride(a.cos_sin, "cos_sin", 1, 1));
  const int64_t table_rows = a.cos_sin.size(0);
  if (table_rows < 1 || (table_rows > 1 && (a.cos_sin.stride(0) % 8 != 0 || a.cos_sin.stride(0) < rope))) {
    return invalid_argument("cos_sin", "at least one row, a row stride that is a multiple of 8 and at least R",
                            a.cos_sin.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(a.cos_sin, "cos_sin", 16));

  DSA_RETURN_IF_ERROR(check_head_gemv_weight(a.weight, "weight", heads, rows));
  const int64_t latent = a.weight.size(2);
  if (latent % 16 != 0) return invalid_argument("weight", "L a multiple of 16", a.weight.describe());

  DSA_RETURN_IF_ERROR(check_dtype(a.out, "out", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.out, "out", {m, heads, latent + rope}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.out, "out"));
  if (!a.out.is_contiguous()) return invalid_argument("out", "a contiguous tensor", a.out.describe());
  DSA_RETURN_IF_ERROR(check_aligned(a.out, "out", 16));
  DSA_RETURN_IF_ERROR(check_token_rows(a.k_pe_out, "k_pe_out", m, rope));
  DSA_RETURN_IF_ERROR(check_error_counter(a.error_count, "error_count"));

  const std::pair<const TensorView*, const char*> inputs[] = {{&a.q_nope, "q_nope"},       {&a.q_pe, "q_pe"},
                                                               {&a.k_pe, "k_pe"},           {&a.positions, "positions"},
                                                               {&a.cos_sin, "cos_sin"},     {&a.weight, "weight"}};
  for (const auto& [input, name] : inputs) {
    DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", *input, name));
    DSA_RETURN_IF_ERROR(check_no_overlap(a.k_pe_out, "k_pe_out", *input, name));
  }
  DSA_RETURN_IF_ERROR(check_no_overlap(a.k_pe_out, "k_pe_out", a.out, "out"));
  return Status();
}

Status rope_absorb(const RopeAbsorbArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_rope_absorb(a));
  const int m = static_cast<int>(a.q_nope.size(0)), heads = static_cast<int>(a.q_nope.size(1));
  const int rows = static_cast<int>(a.q_nope.size(2)), latent = static_cast<int>(a.weight.size(2));
  const int rope = static_cast<int>(a.q_pe.size(2));

  RopeGemvPart g = {};
  g.x = static_cast<const uint16_t*>(a.q_nope.data);
  g.x_token_stride = a.q_nope.stride(0);
  g.x_head_stride = heads > 1 ? a.q_nope.stride(1) : rows;
  g.weight = static_cast<const uint16_t*>(a.weight.data);
  g.weight_head_stride = a.weight.stride(0);
  g.weight_row_stride = a.weight.stride(1);
  g.out = static_cast<uint16_t*>(a.out.data);
  g.out_head_stride = latent + rope;
  g.m = m;
  g.heads = heads;
  g.rows = rows;
  g.cols = latent;

  RopeRowsParams t = {};
  t.q_pe = static_cast<const uint16_t*>(a.q_pe.data);
  t.q_pe_token_stride = a.q_pe.stride(0);
  t.q_pe_head_stride = heads > 1 ? a.q_pe.stride(1) : rope;
  t.k_pe = static_cast<const uint16_t*>(a.k_pe.data);
  t.k_pe_token_stride = a.k_pe.stride(0);
  t.positions = static_cast<const int64_t*>(a.positions.data);
  t.cos_sin = a.cos_sin.data;
  t.cos_sin_row_stride = a.cos_sin.size(0) > 1 ? a.cos_sin.stride(0) : rope;
  t.cos_sin_rows = a.cos_sin.size(0);
  t.table_bf16 = a.cos_sin.dtype == DType::kBF16 ? 1 : 0;
  t.out = static_cast<uint16_t*>(a.out.data);
  t.out_head_stride = latent + rope;
  t.out_rope_column = latent;
  t.k_out = static_cast<uint16_t*>(a.k_pe_out.data);
  t.k_out_token_stride = a.k_pe_out.stride(0);
  t.error_count = a.error_count;
  t.m = m;
  t.heads = heads;
  t.rope_dim = rope;
  t.half_split = a.style == RopeStyle::kHalfSplit ? 1 : 0;
  t.rows_per_cta = rope_rows_per_cta(rope, rows / 64 * 32);
  return launch_rope_absorb(g, t, stream);
}

}  // namespace dsa
