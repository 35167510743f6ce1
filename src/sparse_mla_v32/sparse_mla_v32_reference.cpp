#include "sparse_mla_v32/sparse_mla_v32_reference.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "sparse_mla_v32/sparse_mla_v32_format.h"

namespace dsa::reference {

namespace {

constexpr int kLatent = kSparseMlaV32Latent;
constexpr int kRope = kSparseMlaV32Rope;
constexpr int kDim = kSparseMlaV32HeadDim;
constexpr int kGroupSize = kSparseMlaV32GroupSize;
constexpr int kGroups = v32::kGroups;
constexpr int kChunkRows = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

float entry_scale(const uint8_t* entry, int group) {
  float scale;
  std::memcpy(&scale, entry + kSparseMlaV32ScaleOffset + 4 * group, 4);
  return scale;
}

uint16_t entry_rope(const uint8_t* entry, int i) {
  uint16_t bits;
  std::memcpy(&bits, entry + kSparseMlaV32RopeOffset + 2 * i, 2);
  return bits;
}

const uint8_t* entry_of(const SparseMlaV32Host& a, int64_t slot) {
  return a.cache + slot / a.block_size * a.block_stride + slot % a.block_size * a.entry_stride;
}

bool q_is_finite(const uint16_t* q) {
  for (int d = 0; d < kDim; ++d) {
    if (!std::isfinite(num::bf16_to_float(q[d]))) return false;
  }
  return true;
}

float max_propagating_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// x rounded to FP16 (nearest even, subnormals, overflow to infinity) and back.
float round_fp16(float x) {
  if (x != x) return x;
  const float magnitude = std::fabs(x);
  if (magnitude >= 65520.0f) return std::copysign(kInf, x);
  const int quantum_exponent = magnitude < 0x1p-14f ? -24 : std::ilogb(magnitude) - 10;
  const float rounded = std::ldexp(std::nearbyint(std::ldexp(magnitude, -quantum_exponent)), quantum_exponent);
  return std::copysign(rounded, x);
}

}  // namespace

void v32_quantize_token(const uint16_t* kv_c, const uint16_t* k_pe, uint8_t* entry) {
  for (int g = 0; g < kGroups; ++g) {
    float amax = v32::bf16_abs(kv_c[g * kGroupSize]);
    for (int i = 1; i < kGroupSize; ++i) amax = v32::fmax_ignoring_nan(amax, v32::bf16_abs(kv_c[g * kGroupSize + i]));
    const float scale = v32::group_scale(amax);
    for (int i = 0; i < kGroupSize; ++i) entry[g * kGroupSize + i] = v32::group_code(kv_c[g * kGroupSize + i], scale);
    std::memcpy(entry + kSparseMlaV32ScaleOffset + 4 * g, &scale, 4);
  }
  std::memcpy(entry + kSparseMlaV32RopeOffset, k_pe, 2 * kRope);
}

void v32_dequantize_token(const uint8_t* entry, double* key) {
  for (int d = 0; d < kLatent; ++d) {
    key[d] = double(num::e4m3_to_float(entry[d])) * double(entry_scale(entry, d / kGroupSize));
  }
  for (int i = 0; i < kRope; ++i) key[kLatent + i] = num::bf16_to_float(entry_rope(entry, i));
}

bool v32_key_is_finite(const double* key) {
  for (int d = 0; d < kDim; ++d) {
    if (!std::isfinite(key[d])) return false;
  }
  return true;
}

int v32_q_group_exponent(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 0;
  return 14 - std::ilogb(amax);
}

SparseMlaV32Result sparse_mla_v32(const SparseMlaV32Host& a) {
  SparseMlaV32Result result;
  result.latent.assign(size_t(a.m) * a.heads * kLatent, 0);
  result.lse.assign(size_t(a.m) * a.heads, -kInf);
  const int64_t capacity = a.blocks * a.block_size;

  std::vector<double> keys;  // [valid entries, 576] in index order
  std::vector<double> scores, out(kLatent), q(kDim);
  for (int t = 0; t < a.m; ++t) {
    keys.clear();
    bool token_finite = true;
    for (int j = 0; j < a.top_k; ++j) {
      const int64_t slot = a.indices[t * a.indices_token_stride + j];
      if (slot >= capacity) ++result.out_of_range;
      if (slot < 0 || slot >= capacity) continue;
      keys.resize(keys.size() + kDim);
      double* key = &keys[keys.size() - kDim];
      v32_dequantize_token(entry_of(a, slot), key);
      token_finite = token_finite && v32_key_is_finite(key);
    }
    const size_t valid = keys.size() / kDim;
    if (valid == 0) continue;  // zeros and -inf, as initialized

    for (int h = 0; h < a.heads; ++h) {
      const uint16_t* q_bits = a.q + t * a.q_token_stride + h * a.q_head_stride;
      uint16_t* latent = &result.latent[(size_t(t) * a.heads + h) * kLatent];
      float& lse = result.lse[size_t(t) * a.heads + h];
      if (!token_finite || !q_is_finite(q_bits)) {  // the contract's NaN rules
        std::fill(latent, latent + kLatent, num::kBF16CanonicalNaN);
        lse = kNaN;
        continue;
      }
      for (int d = 0; d < kDim; ++d) q[d] = num::bf16_to_float(q_bits[d]);
      scores.resize(valid);
      double max_score = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < valid; ++j) {
        const double* key = &keys[j * kDim];
        double dot = 0;
        for (int d = 0; d < kDim; ++d) dot += q[d] * key[d];
        scores[j] = double(a.softmax_scale) * dot;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      std::fill(out.begin(), out.end(), 0.0);
      for (size_t j = 0; j < valid; ++j) {
        const double weight = std::exp(scores[j] - max_score);
        sum += weight;
        const double* key = &keys[j * kDim];
        for (int d = 0; d < kLatent; ++d) out[d] += weight * key[d];
      }
      for (int d = 0; d < kLatent; ++d) latent[d] = num::float_to_bf16(static_cast<float>(out[d] / sum));
      lse = static_cast<float>(max_score + std::log(sum));
    }
  }
  return result;
}

SparseMlaV32Result sparse_mla_v32_kernel_model(const SparseMlaV32Host& a, int rows_per_split) {
  SparseMlaV32Result result;
  result.latent.assign(size_t(a.m) * a.heads * kLatent, 0);
  result.lse.assign(size_t(a.m) * a.heads, -kInf);
  const int64_t capacity = a.blocks * a.block_size;
  const int splits = (a.top_k + rows_per_split - 1) / rows_per_split;
  const float score_scale = a.softmax_scale * kLog2e;

  struct Partial {
    float max, sum;
    std::vector<float> out;
  };
  std::vector<Partial> partials(splits);
  for (int64_t t = 0; t < a.m; ++t) {
    for (int j = 0; j < a.top_k; ++j) result.out_of_range += a.indices[t * a.indices_token_stride + j] >= capacity;
    for (int h = 0; h < a.heads; ++h) {
      const uint16_t* q_bits = a.q + t * a.q_token_stride + h * a.q_head_stride;
      const bool q_bad = !q_is_finite(q_bits);
      // q as the kernel holds it: each NoPE group scaled by 2^e into FP16, RoPE as BF16.
      float q16[kLatent], q_rope[kRope];
      int exponent[kGroups];
      for (int g = 0; g < kGroups; ++g) {
        float amax = 0.0f;
        for (int i = 0; i < kGroupSize; ++i) amax = std::max(amax, v32::bf16_abs(q_bits[g * kGroupSize + i]));
        exponent[g] = v32_q_group_exponent(amax);
        for (int i = 0; i < kGroupSize; ++i) {
          const float x = std::ldexp(num::bf16_to_float(q_bits[g * kGroupSize + i]), exponent[g]);
          q16[g * kGroupSize + i] = round_fp16(x);
        }
      }
      for (int i = 0; i < kRope; ++i) q_rope[i] = num::bf16_to_float(q_bits[kLatent + i]);

      for (int r = 0; r < splits; ++r) {
        Partial& part = partials[r];
        part.max = -kInf;
        part.sum = 0.0f;
        part.out.assign(kLatent, 0.0f);
        const int row_begin = r * rows_per_split, row_end = std::min(a.top_k, row_begin + rows_per_split);
        for (int c0 = row_begin; c0 < row_end; c0 += kChunkRows) {
          const int rows = std::min(kChunkRows, row_end - c0);
          float score[kChunkRows], scale[kChunkRows][kGroups], p[kChunkRows];
          const uint8_t* entry[kChunkRows];
          for (int i = 0; i < rows; ++i) {
            const int32_t slot = a.indices[t * a.indices_token_stride + c0 + i];
            const bool valid = slot >= 0 && slot < capacity;
            entry[i] = valid ? entry_of(a, slot) : nullptr;
            bool bad = false;
            float part_score[kGroups];
            for (int g = 0; g < kGroups; ++g) {
              scale[i][g] = valid ? entry_scale(entry[i], g) : 0.0f;
              // Two accumulators, as the kernel's score warp: 16-dim k-steps 0, 2, 4, 6
              // into one and 1, 3, 5, 7 into the other (each k-step an MMA, here
              // its products added in order), summed at the end.
              float nope_steps[2] = {0.0f, 0.0f}, rope = 0.0f;
              for (int d = g * kGroupSize; valid && d < (g + 1) * kGroupSize; ++d) {
                float& acc = nope_steps[((d - g * kGroupSize) / 16) % 2];
                acc = std::fma(q16[d], num::e4m3_to_float(entry[i][d]), acc);
              }
              const float nope = nope_steps[0] + nope_steps[1];
              for (int d = 16 * g; valid && d < 16 * g + 16; ++d) {
                const float k = num::bf16_to_float(entry_rope(entry[i], d));
                bad = bad || !std::isfinite(k);
                rope = std::fma(q_rope[d], k, rope);
              }
              bad = bad || !std::isfinite(scale[i][g]);
              part_score[g] = std::fma(std::ldexp(nope, -exponent[g]), scale[i][g], rope);
            }
            const float raw = (part_score[0] + part_score[1]) + (part_score[2] + part_score[3]);
            score[i] = !valid ? -kInf : (bad || q_bad) ? kNaN : raw * score_scale;
          }
          float chunk_max = -kInf;
          for (int i = 0; i < rows; ++i) chunk_max = max_propagating_nan(chunk_max, score[i]);
          const float new_max = max_propagating_nan(part.max, chunk_max);
          float rescale = 1.0f;
          for (int i = 0; i < rows; ++i) p[i] = 0.0f;
          if (new_max != -kInf) {
            rescale = std::exp2(part.max - new_max);
            for (int i = 0; i < rows; ++i) p[i] = std::exp2(score[i] - new_max);
          }
          // The kernel's sum: lane l adds rows 2l and 2l + 1, then an xor butterfly
          // over the 32 lanes (offsets 16..1; lanes l and l ^ o add the same two
          // values, so every lane ends with lane 0's sum).
          float lane_sum[kChunkRows / 2];
          for (int l = 0; l < kChunkRows / 2; ++l) {
            lane_sum[l] = (2 * l < rows ? p[2 * l] : 0.0f) + (2 * l + 1 < rows ? p[2 * l + 1] : 0.0f);
          }
          for (int offset = kChunkRows / 4; offset >= 1; offset /= 2) {
            float next[kChunkRows / 2];
            for (int l = 0; l < kChunkRows / 2; ++l) next[l] = lane_sum[l] + lane_sum[l ^ offset];
            std::copy(next, next + kChunkRows / 2, lane_sum);
          }
          const float chunk_sum = lane_sum[0];
          for (int g = 0; g < kGroups; ++g) {
            float top = 0.0f;
            for (int i = 0; i < rows; ++i) top = max_propagating_nan(top, std::fabs(p[i] * scale[i][g]));
            const float group_max = top > 0.0f ? std::max(top, FLT_MIN) : 1.0f;
            const float inverse = 1.0f / group_max;
            float chunk_out[kGroupSize] = {};
            for (int i = 0; i < rows; ++i) {
              if (entry[i] == nullptr) continue;  // zero codes in the kernel's tile
              const float w = round_fp16((p[i] * scale[i][g]) * inverse);
              for (int d = 0; d < kGroupSize; ++d) {
                chunk_out[d] = std::fma(w, num::e4m3_to_float(entry[i][g * kGroupSize + d]), chunk_out[d]);
              }
            }
            for (int d = 0; d < kGroupSize; ++d) {
              float& o = part.out[g * kGroupSize + d];
              o = std::fma(chunk_out[d], group_max, o * rescale);
            }
          }
          part.sum = std::fma(part.sum, rescale, chunk_sum);
          part.max = new_max;
        }
      }
      float total_max = -kInf;
      for (const Partial& part : partials) total_max = max_propagating_nan(total_max, part.max);
      if (total_max == -kInf) continue;  // zeros and -inf
      float total_sum = 0.0f;
      std::vector<float> total(kLatent, 0.0f);
      for (const Partial& part : partials) {
        const float weight = std::exp2(part.max - total_max);
        total_sum = std::fma(part.sum, weight, total_sum);
        for (int d = 0; d < kLatent; ++d) total[d] = std::fma(part.out[d], weight, total[d]);
      }
      const float inverse = 1.0f / total_sum;
      uint16_t* latent = &result.latent[(size_t(t) * a.heads + h) * kLatent];
      for (int d = 0; d < kLatent; ++d) latent[d] = num::float_to_bf16(total[d] * inverse);
      result.lse[size_t(t) * a.heads + h] = total_max * kLn2 + std::log(total_sum);
    }
  }
  return result;
}

}  // namespace dsa::reference
