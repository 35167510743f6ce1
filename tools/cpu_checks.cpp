#include "cpu_checks.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "compare.h"
#include "dsa_decode/numerics.h"
#include "linear/linear_reference.h"
#include "norm/norm_reference.h"
#include "reference_chain.h"
#include "report.h"

namespace dsa::cli {

namespace {

// The contract's bounds (DESIGN.md section 2).
constexpr double kBf16Ulps = 1;            // projections, head_gemv's BF16 out (at the values' scale), norm
constexpr int kFp8Steps = 1;               // absorb's FP8 out
constexpr double kLatentFrobenius = 5e-3;  // attention latent, relative Frobenius
constexpr double kLseError = 1e-3;         // attention lse, absolute

// float64 values rounded to BF16 (round to nearest even, through FP32).
std::vector<uint16_t> rounded_bf16(const std::vector<double>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = num::float_to_bf16(static_cast<float>(values[i]));
  return bits;
}

Check bf16_vs_exact(const std::string& name, const std::vector<uint16_t>& out, const std::vector<double>& exact,
                    const char* input) {
  const double ulps = bf16_error_in_scale_ulps(out, rounded_bf16(exact));
  return judged(name, out.size() == exact.size() && ulps <= kBf16Ulps,
                format("max %.2f BF16 ulp at the values' scale from the rounded float64 sum (bound %.0f); on the CPU "
                       "chain's %s",
                       ulps, kBf16Ulps, input));
}

}  // namespace

Check check_product_vs_float64(const std::string& name, const std::vector<uint16_t>& out,
                               const std::vector<uint16_t>& x, int m, int64_t k, const std::vector<uint16_t>& weight,
                               int64_t n, const char* input) {
  return bf16_vs_exact(name + " (FP32, k order) vs float64", out,
                       reference::exact_product(x.data(), m, k, weight.data(), n).sum, input);
}

Check check_norm_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& qkv,
                            const std::vector<uint16_t>& q_c, const std::vector<uint16_t>& kv_c) {
  std::vector<double> row(s.qkv_width()), q(size_t(s.m) * s.Q), kv(size_t(s.m) * s.L);
  for (int t = 0; t < s.m; ++t) {
    for (int i = 0; i < s.qkv_width(); ++i) row[i] = num::bf16_to_float(qkv[size_t(t) * s.qkv_width() + i]);
    reference::rms_norm_exact(row.data(), s.Q, w.q_norm_gamma.data(), w.eps, &q[size_t(t) * s.Q]);
    reference::rms_norm_exact(row.data() + s.Q, s.L, w.kv_norm_gamma.data(), w.eps, &kv[size_t(t) * s.L]);
  }
  const Difference dq = bf16_difference(q_c, rounded_bf16(q)), dkv = bf16_difference(kv_c, rounded_bf16(kv));
  const int64_t worst = std::max(dq.max_steps, dkv.max_steps);
  return judged("norm (rsqrt.approx order) vs float64", worst <= kBf16Ulps,
                format("max %lld BF16 ulp from the rounded float64 norm (bound %.0f); q_c %zu of %zu values differ, "
                       "kv_c %zu of %zu; on the CPU chain's qkv",
                       static_cast<long long>(worst), kBf16Ulps, dq.differing, q_c.size(), dkv.differing, kv_c.size()));
}

Check check_absorb_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                              const std::vector<uint8_t>& q_fp8) {
  const reference::HeadGemvDeviation d = absorb_deviation(s, w, q, q_fp8);
  return judged("absorb q_fp8 (head_gemv, seed order) vs float64", d.max_steps <= kFp8Steps && d.outside == 0,
                format("%lld of %lld FP8 values differ from the float64 absorb's quantization, by at most %d e4m3 "
                       "step (bound %d); %lld outside 2^-14 x sum |products|; on the CPU chain's q",
                       static_cast<long long>(d.differing), static_cast<long long>(d.compared), d.max_steps, kFp8Steps,
                       static_cast<long long>(d.outside)));
}

Check check_value_up_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& latent,
                                const std::vector<uint16_t>& heads) {
  // heads[t, h, j] = sum_i latent[t, h, i] W_UV[h, i, j], each product exact in double.
  std::vector<double> exact(size_t(s.m) * s.H * s.V, 0.0);
  for (int t = 0; t < s.m; ++t) {
    for (int h = 0; h < s.H; ++h) {
      double* sum = &exact[(size_t(t) * s.H + h) * s.V];
      const uint16_t* x = &latent[(size_t(t) * s.H + h) * s.L];
      const uint16_t* weight = &w.w_uv[size_t(h) * s.L * s.V];
      for (int i = 0; i < s.L; ++i) {
        const double xi = num::bf16_to_float(x[i]);
        for (int j = 0; j < s.V; ++j) sum[j] += xi * num::bf16_to_float(weight[size_t(i) * s.V + j]);
      }
    }
  }
  return bf16_vs_exact("value_up heads (head_gemv, seed order) vs float64", heads, exact, "latent");
}

Check check_attention_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint8_t>& q_fp8,
                                 const std::vector<uint8_t>& cache, const std::vector<int32_t>& slots,
                                 const std::vector<uint16_t>& latent, const std::vector<float>& lse) {
  const int64_t entries = static_cast<int64_t>(cache.size() / s.L);
  const double score_scale = double(s.softmax_scale) * w.q_scale * w.k_scale;
  std::vector<double> exact_latent(size_t(s.m) * s.H * s.L, 0.0), q(s.L), out(s.L);
  double decoded[256];  // e4m3 code -> value
  for (int c = 0; c < 256; ++c) decoded[c] = num::e4m3_to_float(static_cast<uint8_t>(c));
  double worst_lse = 0;
  std::vector<double> rows;  // [valid entries of the token, L] decoded
  for (int t = 0; t < s.m; ++t) {
    rows.clear();
    const int width = s.top_k_width();
    for (int j = 0; j < width; ++j) {
      const int32_t slot = slots[size_t(t) * width + j];
      if (slot < 0 || slot >= entries) continue;
      for (int d = 0; d < s.L; ++d) rows.push_back(decoded[cache[size_t(slot) * s.L + d]]);
    }
    const size_t valid = rows.size() / s.L;
    for (int h = 0; h < s.H; ++h) {
      const uint8_t* q_codes = &q_fp8[(size_t(t) * s.H + h) * s.L];
      for (int d = 0; d < s.L; ++d) q[d] = decoded[q_codes[d]];
      // One pass with a running maximum (the reference takes two).
      double running_max = -std::numeric_limits<double>::infinity(), sum = 0;
      std::fill(out.begin(), out.end(), 0.0);
      for (size_t e = 0; e < valid; ++e) {
        const double* row = &rows[e * s.L];
        double dot = 0;
        for (int d = 0; d < s.L; ++d) dot += q[d] * row[d];
        const double score = score_scale * dot;
        if (score > running_max) {
          const double rescale = std::exp(running_max - score);  // 0 at the first entry
          sum *= rescale;
          for (double& o : out) o *= rescale;
          running_max = score;
        }
        const double weight = std::exp(score - running_max);
        sum += weight;
        for (int d = 0; d < s.L; ++d) out[d] += weight * row[d];
      }
      if (valid == 0) continue;  // zeros and -inf, as the reference's
      double* exact = &exact_latent[(size_t(t) * s.H + h) * s.L];
      for (int d = 0; d < s.L; ++d) exact[d] = out[d] * w.k_scale / sum;
      const double error = std::fabs(double(lse[size_t(t) * s.H + h]) - (running_max + std::log(sum)));
      worst_lse = std::isnan(error) ? error : std::max(worst_lse, error);
    }
  }
  const double relative = reference::relative_frobenius(latent, exact_latent);
  return judged("sparse attention (float64, BF16 latent) vs float64 (one pass)",
                relative <= kLatentFrobenius && worst_lse <= kLseError,
                format("latent relative Frobenius error %.2e (bound %.0e), lse max error %.2e (bound %.0e); on the "
                       "CPU chain's q_fp8, KV cache and slots",
                       relative, kLatentFrobenius, worst_lse, kLseError));
}

Check check_indexer_rows_layout(const StepShape& s, const HostStepInputs& in, const std::vector<int32_t>& positions,
                                const std::vector<int32_t>& slots) {
  const int64_t W = s.top_k_width(), K = s.index_topk, S = s.index_pool;
  std::string first_problem;
  int64_t bad_rows = 0, pools_checked = 0;
  const auto problem = [&](int t, const std::string& what) {
    if (bad_rows++ == 0) first_problem = "token " + std::to_string(t) + ": " + what;
  };
  if (positions.size() != size_t(s.m) * W || slots.size() != size_t(s.m) * W) {
    return judged("indexer rows (layout of the shape)", false,
                  format("rows of %zu and %zu values, expected [%d, %lld]", positions.size(), slots.size(), s.m,
                         static_cast<long long>(W)));
  }
  for (int t = 0; t < s.m; ++t) {
    const int32_t* row = &positions[size_t(t) * W];
    const int32_t* slot = &slots[size_t(t) * W];
    const int64_t L = in.positions[size_t(t)] + 1;
    std::vector<int64_t> want(size_t(W), -1);
    if (in.token_requests[size_t(t)] >= 0) {
      if (L <= K) {
        for (int64_t j = 0; j < L; ++j) want[size_t(j)] = j;
      } else {
        const int64_t pools = L / S;
        int64_t previous = -1;
        for (int64_t p = 0; p < K / S; ++p) {  // the pools as the row holds them, checked one by one
          const int64_t start = row[p * S];
          if (start < 0 || start % S != 0 || start / S >= pools || start / S <= previous) {
            problem(t, "column " + std::to_string(p * S) + " holds " + std::to_string(start) +
                           ", expected the start of a complete pool after pool " + std::to_string(previous));
            break;
          }
          previous = start / S;
          for (int64_t i = 0; i < S; ++i) want[size_t(p * S + i)] = start + i;
          ++pools_checked;
        }
        for (int64_t j = S * pools; j < L; ++j) want[size_t(K + j - S * pools)] = j;
      }
    }
    for (int64_t j = 0; j < W; ++j) {
      // The identity block table: a position's slot is the position.
      if (row[j] != want[size_t(j)] || slot[j] != want[size_t(j)]) {
        problem(t, "column " + std::to_string(j) + " holds position " + std::to_string(row[j]) + " and slot " +
                       std::to_string(slot[j]) + ", expected " + std::to_string(want[size_t(j)]));
        break;
      }
    }
  }
  return judged("indexer rows (layout of the shape)", bad_rows == 0,
                format("%lld heads, pools of %lld, top-%lld, rows %lld wide: %lld of %d rows off the layout%s%s; "
                       "%lld pools checked",
                       static_cast<long long>(s.index_heads), static_cast<long long>(S), static_cast<long long>(K),
                       static_cast<long long>(W), static_cast<long long>(bad_rows), s.m,
                       bad_rows > 0 ? " (first: " : "", bad_rows > 0 ? (first_problem + ")").c_str() : "",
                       static_cast<long long>(pools_checked)));
}

}  // namespace dsa::cli
