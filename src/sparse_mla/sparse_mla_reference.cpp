#include "sparse_mla/sparse_mla_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla.h"

namespace dsa::reference {

namespace {

constexpr int kLatent = kSparseMlaLatent;

// A dot product of two rows of decoded e4m3 codes. Each product is exact in
// double (4 + 4 significant bits) and is a multiple of 2^-18 below 2^18, so
// every partial sum of 512 of them is a multiple of 2^-18 below 2^27: exact in
// double's 53 bits whatever the order. Four accumulators only make it faster.
double exact_dot(const float* q, const float* kv) {
  double partial[4] = {0, 0, 0, 0};
  for (int d = 0; d < kLatent; d += 4) {
    for (int i = 0; i < 4; ++i) partial[i] += double(q[d + i]) * double(kv[d + i]);
  }
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

}  // namespace

SparseMlaResult sparse_mla(const SparseMlaHost& a) {
  float decoded_code[256];  // e4m3 code -> value (exact)
  for (int c = 0; c < 256; ++c) decoded_code[c] = num::e4m3_to_float(static_cast<uint8_t>(c));

  SparseMlaResult result;
  result.latent.assign(size_t(a.m) * a.heads * kLatent, 0);
  result.lse.assign(size_t(a.m) * a.heads, -std::numeric_limits<float>::infinity());
  const int64_t capacity = a.blocks * a.block_size;
  const double score_scale = double(a.softmax_scale) * double(a.q_scale) * double(a.k_scale);

  std::vector<float> rows;  // [valid entries of the token, 512] decoded cache codes, in index order
  std::vector<float> q(kLatent);
  std::vector<double> scores, out(kLatent);
  for (int t = 0; t < a.m; ++t) {
    rows.clear();
    for (int j = 0; j < a.top_k; ++j) {
      const int64_t slot = a.indices[t * a.indices_token_stride + j];
      if (slot >= capacity) ++result.out_of_range;
      if (slot < 0 || slot >= capacity) continue;
      const uint8_t* entry = a.cache + slot / a.block_size * a.block_stride + slot % a.block_size * a.entry_stride;
      for (int d = 0; d < kLatent; ++d) rows.push_back(decoded_code[entry[d]]);
    }
    const size_t valid = rows.size() / kLatent;
    if (valid == 0) continue;  // zeros and -inf, as initialized

    for (int h = 0; h < a.heads; ++h) {
      const uint8_t* q_codes = a.q + t * a.q_token_stride + h * a.q_head_stride;
      for (int d = 0; d < kLatent; ++d) q[d] = decoded_code[q_codes[d]];
      scores.resize(valid);
      bool any_nan = false;
      double max_score = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < valid; ++j) {
        scores[j] = score_scale * exact_dot(q.data(), &rows[j * kLatent]);
        if (std::isnan(scores[j])) any_nan = true;
        else max_score = std::max(max_score, scores[j]);
      }
      uint16_t* latent = &result.latent[(size_t(t) * a.heads + h) * kLatent];
      float& lse = result.lse[size_t(t) * a.heads + h];
      if (any_nan) {  // the contract: NaN in a score makes the whole row NaN
        std::fill(latent, latent + kLatent, num::float_to_bf16(std::numeric_limits<float>::quiet_NaN()));
        lse = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      double sum = 0;
      std::fill(out.begin(), out.end(), 0.0);
      for (size_t j = 0; j < valid; ++j) {
        const double weight = std::exp(scores[j] - max_score);
        sum += weight;
        const float* kv = &rows[j * kLatent];
        for (int d = 0; d < kLatent; ++d) out[d] += weight * double(kv[d]);
      }
      const double output_scale = double(a.k_scale) / sum;
      for (int d = 0; d < kLatent; ++d) latent[d] = num::float_to_bf16(static_cast<float>(out[d] * output_scale));
      lse = static_cast<float>(max_score + std::log(sum));
    }
  }
  return result;
}

}  // namespace dsa::reference
