#include "rope_chain.h"

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>

#include "compare.h"
#include "cpu_checks.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "head_gemv/head_gemv_reference.h"
#include "indexer/indexer_reference.h"
#include "linear/linear_reference.h"
#include "reference_chain.h"
#include "rope/rope_reference.h"
#include "sparse_mla_v32/sparse_mla_v32_plan.h"
#include "sparse_mla_v32/sparse_mla_v32_reference.h"

namespace dsa::cli {

namespace {

constexpr int kEntryBytes = kSparseMlaV32EntryBytes;
constexpr int kGroup = kSparseMlaV32GroupSize;
// The attention model's split: the plan sparse_mla_v32 takes on a 132-SM
// Hopper part (H100 SXM, H200) with clusters of up to 16.
constexpr int kHopperSms = 132;
// Contract v2's attention bounds (DESIGN.md section 2).
constexpr double kLatentFrobenius = 5e-3;
constexpr double kLseError = 1e-3;
// Every 37th context position's indexer key is checked against float64 (all
// of the step's own).
constexpr int64_t kKeyStride = 37;

using Clock = std::chrono::steady_clock;

template <class Work>
double timed_ms(Work&& work) {
  const Clock::time_point start = Clock::now();
  work();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::string first_bf16(const uint16_t* values, size_t count) {
  std::string text;
  for (size_t i = 0; i < count && i < 4; ++i) text += format("%s%.4g", i ? " " : "", num::bf16_to_float(values[i]));
  return text;
}
std::string first_bf16(const std::vector<uint16_t>& values) { return first_bf16(values.data(), values.size()); }

std::string first_i32(const std::vector<int32_t>& values) {
  std::string text;
  for (size_t i = 0; i < values.size() && i < 4; ++i) text += (i ? " " : "") + std::to_string(values[i]);
  return text;
}

std::string shape_text(std::initializer_list<int64_t> dims) {
  std::string text = "[";
  for (int64_t d : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

RopeStyle other_style(RopeStyle style) {
  return style == RopeStyle::kInterleaved ? RopeStyle::kHalfSplit : RopeStyle::kInterleaved;
}

const char* style_name(RopeStyle style) {
  return style == RopeStyle::kInterleaved ? "interleaved" : "half-split";
}

}  // namespace

Status make_rope_tables(const StepShape& s, RopeTables* t) {
  DSA_RETURN_IF_ERROR(rope_preset_config(s.preset, RopeTarget::kAttention, &t->attention));
  DSA_RETURN_IF_ERROR(rope_preset_config(s.preset, RopeTarget::kIndexer, &t->indexer));
  if (t->attention.rope_dim != s.R || t->indexer.rope_dim != s.R) {
    return invalid_argument("preset", "rope dims " + std::to_string(s.R) + " in its rotary configurations",
                            std::to_string(t->attention.rope_dim) + " / " + std::to_string(t->indexer.rope_dim));
  }
  t->rows = s.context + s.m;
  t->attention_table.resize(size_t(t->rows) * s.R);
  t->indexer_table.resize(size_t(t->rows) * s.R);
  DSA_RETURN_IF_ERROR(rope_cos_sin_table(t->attention, 0, t->rows, t->attention_table.data()));
  return rope_cos_sin_table(t->indexer, 0, t->rows, t->indexer_table.data());
}

// rope_absorb's host arguments over q [m, H, P + R] (q_nope and q_pe views)
// and qkv [m, Q + L + R] (k_pe's view).
reference::RopeAbsorbHost rope_absorb_host(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                                      const std::vector<uint16_t>& qkv, const std::vector<int64_t>& positions,
                                      const RopeTables& t, RopeStyle style) {
  reference::RopeAbsorbHost a{};
  a.q_nope = q.data();
  a.q_nope_token_stride = int64_t{s.H} * (s.P + s.R);
  a.q_nope_head_stride = s.P + s.R;
  a.q_pe = q.data() + s.P;
  a.q_pe_token_stride = a.q_nope_token_stride;
  a.q_pe_head_stride = a.q_nope_head_stride;
  a.k_pe = qkv.data() + s.Q + s.L;
  a.k_pe_token_stride = s.qkv_width();
  a.positions = positions.data();
  a.cos_sin = t.attention_table.data();
  a.table_bf16 = false;
  a.cos_sin_row_stride = s.R;
  a.cos_sin_rows = t.rows;
  a.weight = w.w_uk_t.data();
  a.weight_head_stride = int64_t{s.P} * s.L;
  a.weight_row_stride = s.L;
  a.m = s.m;
  a.heads = s.H;
  a.rows = s.P;
  a.latent = s.L;
  a.rope_dim = s.R;
  a.style = style;
  return a;
}

namespace {

struct AbsorbOutputs {
  std::vector<uint16_t> q;     // [m, H, L + R] BF16: absorbed latent | rotated q_pe
  std::vector<uint16_t> k_pe;  // [m, R] BF16, rotated
};

// rope_absorb on the CPU: the latent columns in head_gemv's seed order (BF16
// out), the rotations in the kernel's FP32 order (reference::rope_rows, bitwise).
AbsorbOutputs rope_absorb(const StepShape& s, const HostWeights& w, const reference::RopeAbsorbHost& a) {
  std::vector<uint16_t> q_nope(size_t(s.m) * s.H * s.P);
  for (int t = 0; t < s.m; ++t) {
    for (int h = 0; h < s.H; ++h) {
      std::copy_n(a.q_nope + t * a.q_nope_token_stride + h * a.q_nope_head_stride, s.P,
                  &q_nope[(size_t(t) * s.H + h) * s.P]);
    }
  }
  const reference::HeadGemvHost product{q_nope.data(), int64_t{s.H} * s.P, w.w_uk_t.data(), int64_t{s.P} * s.L, s.L,
                                        s.m,           s.H,                s.P,             s.L};
  const std::vector<uint16_t> latent = reference::head_gemv_bf16(product, head_gemv_tactic(s.H, s.P, s.L, s.m));
  const reference::RopeRows rotated = reference::rope_rows(a);
  AbsorbOutputs out;
  const int width = s.L + s.R;
  out.q.resize(size_t(s.m) * s.H * width);
  for (size_t row = 0; row < size_t(s.m) * s.H; ++row) {
    std::copy_n(&latent[row * s.L], s.L, &out.q[row * width]);
    std::copy_n(&rotated.q[row * s.R], s.R, &out.q[row * width + s.L]);
  }
  out.k_pe = rotated.k;
  return out;
}

Check check_rope_absorb(const StepShape& s, const reference::RopeAbsorbHost& served, const RopeConfig& config,
                        const AbsorbOutputs& out) {
  const reference::RopeAbsorbDeviation d =
      reference::rope_absorb_deviation(served, out.q.data(), out.k_pe.data(), &config);
  return judged(
      "rope_absorb (latent seed order, rotation FP32) vs float64",
      d.latent.outside == 0 && d.rope_outside == 0 && d.latent.compared > 0 && d.rope_compared > 0,
      format("latent: %lld of %lld values differ from the rounded float64 sum, by at most %d BF16 steps, %lld outside "
             "2^-14 x sum |products|; rotated q_pe and k_pe (%s, %s YaRN/RoPE at the tokens' positions): %lld of %lld "
             "differ from the rounded exact rotation, by at most %d BF16 steps, %lld outside 2^-21 (|a| + |b|) x scale; "
             "on the CPU chain's q and k_pe",
             static_cast<long long>(d.latent.differing), static_cast<long long>(d.latent.compared), d.latent.max_steps,
             static_cast<long long>(d.latent.outside), style_name(config.style), s.preset.c_str(),
             static_cast<long long>(d.rope_differing), static_cast<long long>(d.rope_compared), d.rope_max_steps,
             static_cast<long long>(d.rope_outside)));
}

// The cache write of one token: vLLM's rule (reference::v32_quantize_token),
// or the broken one (one scale for all 512 values).
void write_entry(const uint16_t* kv_c, const uint16_t* k_pe, bool broken_scale, uint8_t* entry) {
  reference::v32_quantize_token(kv_c, k_pe, entry);
  if (!broken_scale) return;
  float amax = 0;
  for (int i = 0; i < kSparseMlaV32Latent; ++i) amax = std::fmax(amax, std::fabs(num::bf16_to_float(kv_c[i])));
  const float scale = std::fmax(amax / num::kFp8E4M3Max, FLT_MIN);
  for (int i = 0; i < kSparseMlaV32Latent; ++i) entry[i] = num::float_to_e4m3(num::bf16_to_float(kv_c[i]) / scale);
  for (int g = 0; g < 4; ++g) std::memcpy(entry + kSparseMlaV32ScaleOffset + 4 * g, &scale, 4);
}

// The step's entries against float64: each group's scale is its amax / 448
// (FP32 division, at least FLT_MIN), each code dequantized within half an e4m3
// step of kv_c / scale (2^-4 relative; 2^-10 in the subnormal range), k_pe's
// 128 bytes the rotated k_pe verbatim.
Check check_cache_write(const StepShape& s, const std::vector<uint16_t>& kv_c, const std::vector<uint16_t>& k_pe,
                        const std::vector<uint8_t>& entries) {
  int64_t bad_scales = 0, bad_codes = 0, bad_rope = 0;
  double worst = 0;  // |dequantized - x| / half step
  for (int t = 0; t < s.m; ++t) {
    const uint16_t* x = &kv_c[size_t(t) * s.L];
    const uint8_t* entry = &entries[size_t(t) * kEntryBytes];
    for (int g = 0; g < s.L / kGroup; ++g) {
      double amax = 0;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(double(num::bf16_to_float(x[g * kGroup + i]))));
      const float want_scale = std::fmax(static_cast<float>(amax) / num::kFp8E4M3Max, FLT_MIN);
      float scale;
      std::memcpy(&scale, entry + kSparseMlaV32ScaleOffset + 4 * g, 4);
      bad_scales += scale != want_scale;
      for (int i = 0; i < kGroup; ++i) {
        const double value = num::bf16_to_float(x[g * kGroup + i]) / double(scale);
        const double got = num::e4m3_to_float(entry[g * kGroup + i]);
        const double half_step = std::max(std::ldexp(std::fabs(value), -4), std::ldexp(1.0, -10)) * (1 + 0x1p-20);
        const double error = std::fabs(got - value) / half_step;
        bad_codes += !(error <= 1.0);
        worst = std::max(worst, error);
      }
    }
    bad_rope += std::memcmp(entry + kSparseMlaV32RopeOffset, &k_pe[size_t(t) * s.R], size_t(s.R) * 2) != 0;
  }
  return judged("cache write (656-byte entries) vs float64", bad_scales == 0 && bad_codes == 0 && bad_rope == 0,
                format("%d entries: %lld of %d group scales differ from amax / 448, %lld codes farther than half an "
                       "e4m3 step from kv_c / scale (worst %.2f of the half step), %lld k_pe rows not verbatim; on the "
                       "CPU chain's kv_c and rotated k_pe",
                       s.m, static_cast<long long>(bad_scales), s.m * (s.L / kGroup), static_cast<long long>(bad_codes),
                       worst, static_cast<long long>(bad_rope)));
}

// The orthonormal Hadamard-128 of `in` in float64.
void hadamard128(const double* in, double* out) {
  const double scale = 1.0 / std::sqrt(double(kIndexerDim));
  for (int i = 0; i < kIndexerDim; ++i) {
    double sum = 0;
    for (int j = 0; j < kIndexerDim; ++j) sum += (__builtin_popcount(i & j) % 2 ? -in[j] : in[j]);
    out[i] = sum * scale;
  }
}

// Indexer keys against float64: LayerNorm (eps 1e-6), the rotation of the
// first R dims in the preset's style by the closed-form angles of the key's
// position, the orthonormal Hadamard; the cached key (codes x its scale)
// within its e4m3 rounding (2^-4 relative, 2^-10 scale near zero) plus four
// BF16 roundings of the row's magnitude on the way (as the indexer's own test).
Check check_indexer_keys(const StepShape& s, const HostWeights& w, const RopeConfig& config, const IndexerPlan& plan,
                         IndexerHostState& state, const IndexerTokenRows& history,
                         const std::vector<uint16_t>& step_index_k) {
  const reference::IndexerStateHost view = state.view();
  std::vector<int64_t> positions;
  for (int64_t p = 0; p < s.context; p += kKeyStride) positions.push_back(p);
  for (int t = 0; t < s.m; ++t) positions.push_back(s.context + t);
  int64_t outside = 0;
  double worst = 0;
  std::string first;
  std::vector<double> cos(s.R / 2), sin(s.R / 2);
  for (const int64_t p : positions) {
    const uint16_t* x = p < s.context ? &history.index_k[size_t(p) * kIndexerDim]
                                      : &step_index_k[size_t(p - s.context) * kIndexerDim];
    double v[kIndexerDim], r[kIndexerDim], h[kIndexerDim], mean = 0, var = 0, magnitude = 0;
    for (int i = 0; i < kIndexerDim; ++i) mean += num::bf16_to_float(x[i]) / double(kIndexerDim);
    for (int i = 0; i < kIndexerDim; ++i) var += std::pow(num::bf16_to_float(x[i]) - mean, 2) / kIndexerDim;
    for (int i = 0; i < kIndexerDim; ++i) {
      v[i] = (num::bf16_to_float(x[i]) - mean) / std::sqrt(var + 1e-6) * w.index_k_norm_weight[i] +
             w.index_k_norm_bias[i];
    }
    reference::rope_cos_sin64(config, p, cos.data(), sin.data());
    std::copy(v, v + kIndexerDim, r);
    for (int k = 0; k < s.R; ++k) {
      const int partner = reference::rope_partner(k, s.R, config.style), pair = reference::rope_pair(k, s.R, config.style);
      const bool first_of_pair = k < partner;  // a' = a c - b s, b' = b c + a s
      r[k] = first_of_pair ? v[k] * cos[pair] - v[partner] * sin[pair] : v[k] * cos[pair] + v[partner] * sin[pair];
    }
    hadamard128(r, h);
    for (double value : h) magnitude = std::max(magnitude, std::fabs(value));
    const reference::PoolEntry entry = reference::read_pool(plan, view, 0, p);
    if (entry.codes == nullptr) {
      ++outside;
      continue;
    }
    for (int i = 0; i < kIndexerDim; ++i) {
      const double got = double(num::e4m3_to_float(entry.codes[i])) * entry.scale;
      const double bound = std::ldexp(std::fabs(h[i]), -4) + std::ldexp(double(entry.scale), -10) +
                           4 * std::ldexp(magnitude, -9);
      const double error = std::fabs(got - h[i]) / bound;
      if (!(error <= 1.0) && outside++ == 0) first = format(" (first: position %lld dim %d)", static_cast<long long>(p), i);
      worst = std::max(worst, error);
    }
  }
  return judged("indexer keys (LayerNorm, RoPE, Hadamard, e4m3) vs float64", outside == 0,
                format("%zu keys (every %lldth context position and the step's %d): %lld values outside their e4m3 + "
                       "BF16 rounding bound%s, worst %.2f of it; float64 chain with the %s rotation",
                       positions.size(), static_cast<long long>(kKeyStride), s.m, static_cast<long long>(outside),
                       first.c_str(), worst, style_name(config.style)));
}

// The rows against the layout (L <= K: 0..L-1; else K increasing distinct
// positions below L; -1 after; each slot its position under the identity
// block table) and against a float64 top-K of the same dequantized q and
// keys: every selected key at least the K-th largest float64 logit, every key
// clearly above it selected (logits within the FP32 chain's error of the K-th
// may swap).
Check check_indexer_rows(const StepShape& s, const IndexerPlan& plan, IndexerHostState& state,
                         const HostStepInputs& in, const reference::IndexerQueryHost& query,
                         const reference::IndexerRowsHost& rows) {
  const reference::IndexerStateHost view = state.view();
  const int W = indexer_row_width(plan), K = plan.topk, HI = plan.heads;
  int64_t bad = 0, selections = 0;
  std::string first;
  const auto problem = [&](int t, const std::string& what) {
    if (bad++ == 0) first = format(" (first: token %d: %s)", t, what.c_str());
  };
  for (int t = 0; t < s.m; ++t) {
    const int32_t* row = &rows.topk_positions[size_t(t) * W];
    const int32_t* slot = &rows.slots[size_t(t) * W];
    const int64_t L = in.positions[t] + 1;
    const int64_t taken = std::min<int64_t>(L, K);
    bool ok = true;
    for (int j = 0; j < W && ok; ++j) {
      const bool valid = j < taken;
      if (valid ? row[j] < 0 || row[j] >= L || (j > 0 && row[j] <= row[j - 1]) : row[j] != -1) {
        problem(t, format("column %d holds %d", j, row[j]));
        ok = false;
      } else if (slot[j] != row[j]) {
        problem(t, format("column %d: slot %d for position %d", j, slot[j], row[j]));
        ok = false;
      }
    }
    if (!ok || L <= K) continue;
    ++selections;
    std::vector<double> logits(L), slack(L);
    for (int64_t p = 0; p < L; ++p) {
      const reference::PoolEntry entry = reference::read_pool(plan, view, 0, p);
      double sum = 0, magnitude = 0;
      for (int h = 0; h < HI; ++h) {
        double dot = 0;
        const uint8_t* q = &query.q_fp8[(size_t(t) * HI + h) * kIndexerDim];
        for (int i = 0; i < kIndexerDim; ++i) dot += double(num::e4m3_to_float(q[i])) * num::e4m3_to_float(entry.codes[i]);
        const double term = double(query.head_weights[size_t(t) * HI + h]) * std::max(dot, 0.0);
        sum += term;
        magnitude += std::fabs(term);
      }
      logits[p] = sum * entry.scale;
      slack[p] = std::ldexp(magnitude * std::fabs(entry.scale), -24) * (HI + 4);
    }
    std::vector<int64_t> order(L);
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + (K - 1), order.end(),
                     [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
    const int64_t kth = order[K - 1];
    const double threshold = logits[kth];
    for (int c = 0; c < K; ++c) {
      if (logits[row[c]] + slack[row[c]] < threshold - slack[kth]) {
        problem(t, format("position %d selected below the float64 top-%d", row[c], K));
        break;
      }
    }
    for (int64_t p = 0; p < L; ++p) {
      if (logits[p] - slack[p] > threshold + slack[kth] && !std::binary_search(row, row + K, int32_t(p))) {
        problem(t, format("position %lld above the float64 threshold not selected", static_cast<long long>(p)));
        break;
      }
    }
  }
  return judged("indexer rows (layout, float64 top-k)", bad == 0,
                format("%d heads, top-%d, rows %d wide: %lld of %d rows wrong%s; %lld selections checked against a "
                       "float64 top-%d of the dequantized q and keys",
                       HI, K, W, static_cast<long long>(bad), s.m, first.c_str(), static_cast<long long>(selections), K));
}

}  // namespace

// The attention's latent and lse against float64 on the dequantized entries
// (one pass, running maximum).
Check check_sparse_mla_v32_vs_float64(const StepShape& s, const reference::SparseMlaV32Host& a,
                      const reference::SparseMlaV32Result& got, const char* name) {
  std::vector<double> exact(size_t(s.m) * s.H * kSparseMlaV32Latent, 0.0), key(kSparseMlaV32HeadDim),
      out(kSparseMlaV32Latent), q(kSparseMlaV32HeadDim);
  std::vector<double> keys;
  double worst_lse = 0;
  for (int t = 0; t < s.m; ++t) {
    keys.clear();
    for (int j = 0; j < a.top_k; ++j) {
      const int32_t slot = a.indices[t * a.indices_token_stride + j];
      if (slot < 0 || slot >= a.blocks * a.block_size) continue;
      reference::v32_dequantize_token(a.cache + (slot / a.block_size) * a.block_stride + (slot % a.block_size) * a.entry_stride,
                                      key.data());
      keys.insert(keys.end(), key.begin(), key.end());
    }
    const size_t valid = keys.size() / kSparseMlaV32HeadDim;
    for (int h = 0; h < s.H; ++h) {
      for (int d = 0; d < kSparseMlaV32HeadDim; ++d) q[d] = num::bf16_to_float(a.q[t * a.q_token_stride + h * a.q_head_stride + d]);
      double running_max = -std::numeric_limits<double>::infinity(), sum = 0;
      std::fill(out.begin(), out.end(), 0.0);
      for (size_t e = 0; e < valid; ++e) {
        const double* k = &keys[e * kSparseMlaV32HeadDim];
        double dot = 0;
        for (int d = 0; d < kSparseMlaV32HeadDim; ++d) dot += q[d] * k[d];
        const double score = double(a.softmax_scale) * dot;
        if (score > running_max) {
          const double rescale = std::exp(running_max - score);
          sum *= rescale;
          for (double& o : out) o *= rescale;
          running_max = score;
        }
        const double weight = std::exp(score - running_max);
        sum += weight;
        for (int d = 0; d < kSparseMlaV32Latent; ++d) out[d] += weight * k[d];
      }
      if (valid == 0) continue;
      double* e = &exact[(size_t(t) * s.H + h) * kSparseMlaV32Latent];
      for (int d = 0; d < kSparseMlaV32Latent; ++d) e[d] = out[d] / sum;
      const double error = std::fabs(double(got.lse[size_t(t) * s.H + h]) - (running_max + std::log(sum)));
      worst_lse = std::isnan(error) ? error : std::max(worst_lse, error);
    }
  }
  const double relative = reference::relative_frobenius(got.latent, exact);
  return judged(name, relative <= kLatentFrobenius && worst_lse <= kLseError,
                format("latent relative Frobenius error %.2e (bound %.0e), lse max error %.2e (bound %.0e); on the q, cache "
                       "entries and slots it ran on",
                       relative, kLatentFrobenius, worst_lse, kLseError));
}

namespace {

reference::IndexerParamsHost indexer_params(const StepShape& s, const HostWeights& w, const RopeTables& t) {
  reference::IndexerParamsHost params{w.index_k_norm_weight.data(), w.index_k_norm_bias.data(), w.index_ape.data()};
  params.cos_sin = t.indexer_table.data();
  params.cos_sin_bf16 = false;
  params.cos_sin_rows = t.rows;
  params.cos_sin_row_stride = s.R;
  return params;
}

}  // namespace

Status run_rope_chain(const StepShape& s, uint64_t seed, RopeChainBreak link, RopeChainResult* result,
                      RopeChainProducts* products) {
  if (!s.rope()) return invalid_argument("shape", "a RoPE preset's step (R > 0)", s.describe());
  if (s.L != kSparseMlaV32Latent || s.R != kSparseMlaV32Rope) {
    return invalid_argument("shape", "kv_lora 512 and rope 64 (the 656-byte cache format)",
                            "L " + std::to_string(s.L) + ", R " + std::to_string(s.R));
  }
  RopeChainResult& r = *result;
  RopeTables tables;
  DSA_RETURN_IF_ERROR(make_rope_tables(s, &tables));
  const RopeStyle attention_style = link == RopeChainBreak::kAttentionRopeStyle ? other_style(tables.attention.style)
                                                                                : tables.attention.style;
  IndexerPlan plan = s.indexer_plan();
  const IndexerPlan served_plan = plan;
  if (link == RopeChainBreak::kIndexerRopeStyle) plan.rope_style = other_style(plan.rope_style);
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));

  const HostWeights w = make_weights(s, seed);
  const HostStepInputs in = make_step_inputs(s, seed);
  const IndexerTokenRows history = make_indexer_token_rows(seed, 0, s.context);
  IndexerHostState indexer = make_indexer_state(s);
  const reference::IndexerParamsHost params = indexer_params(s, w, tables);
  if (link != RopeChainBreak::kNone) r.notes.push_back(format("--break %s: this run's chain is wrong on purpose",
                                                              rope_chain_break_name(link)));
  r.notes.push_back(format("rotary: attention %s (%s table, scale %.6g), indexer %s on the first %d dims of each head; "
                           "softmax scale %.7g",
                           style_name(tables.attention.style), s.preset.c_str(), rope_table_scale(tables.attention),
                           style_name(tables.indexer.style), s.R, s.softmax_scale));

  int64_t errors = 0;
  r.prefill_ms = timed_ms([&] {
    reference::IndexerStateHost view = indexer.view();
    if (s.context > 0) {
      const Status st = reference::indexer_prefill(plan, history.index_k.data(), nullptr, s.context, 0, params, view,
                                                   &errors);
      if (!st.ok()) errors = -1;
    }
  });
  if (errors != 0) return invalid_argument("indexer prefill", "no error", std::to_string(errors));
  if (products != nullptr) products->indexer_k_cache_after_prefill = indexer.k_cache;
  r.rows.push_back({"prefill", "indexer K cache " + shape_text({s.cache_blocks(), s.indexer_page_bytes()}),
                    r.prefill_ms, fingerprint(indexer.k_cache), format("%lld keys", static_cast<long long>(s.context))});

  std::vector<uint16_t> qkv, q, heads, out;
  NormOutputs normed;
  AbsorbOutputs absorbed;
  std::vector<uint8_t> written(size_t(s.m) * kEntryBytes);
  IndexerProjections projections;
  reference::IndexerQueryHost query;
  reference::IndexerRowsHost rows;
  reference::SparseMlaV32Result attended;
  Status status;
  const double qkv_ms = timed_ms([&] { qkv = reference_qkv_a_proj(s, w, in.hidden); });
  const double norm_ms = timed_ms([&] { normed = reference_norm(s, w, qkv); });
  const double q_b_ms = timed_ms([&] { q = reference_q_b_proj(s, w, normed.q_c); });
  const reference::RopeAbsorbHost chain_absorb = rope_absorb_host(s, w, q, qkv, in.positions, tables, attention_style);
  const double absorb_ms = timed_ms([&] { absorbed = rope_absorb(s, w, chain_absorb); });
  const double cache_ms = timed_ms([&] {
    for (int t = 0; t < s.m; ++t) {
      write_entry(&normed.kv_c[size_t(t) * s.L], &absorbed.k_pe[size_t(t) * s.R], link == RopeChainBreak::kCacheScale,
                  &written[size_t(t) * kEntryBytes]);
    }
  });
  const double project_ms = timed_ms(
      [&] { projections = stored_projections(reference_indexer_project(s, w, normed.q_c, in.hidden)); });
  const reference::IndexerStepHost step{s.m,      projections.index_q.data(), projections.index_k.data(),
                                        projections.head_weights.data(), nullptr, in.positions.data(),
                                        in.token_requests.data()};
  const double indexer_ms = timed_ms([&] {
    reference::IndexerStateHost view = indexer.view();
    status = reference::indexer_prepare(plan, step, params, view, &query, &errors);
    if (status.ok()) status = reference::indexer_select(plan, step, query, view, &rows);
  });
  DSA_RETURN_IF_ERROR(status);

  // The attention over the selected entries, gathered into a compact cache
  // (blocks of one entry): the context's from the seed, the step's from the write.
  std::vector<int32_t> selected;
  for (int32_t slot : rows.slots) {
    if (slot >= 0) selected.push_back(slot);
  }
  std::sort(selected.begin(), selected.end());
  selected.erase(std::unique(selected.begin(), selected.end()), selected.end());
  std::vector<uint8_t> compact(selected.size() * kEntryBytes);
  std::vector<uint16_t> kv_row(s.L), k_pe_row(s.R);
  for (size_t i = 0; i < selected.size(); ++i) {
    if (selected[i] < s.context) {
      make_cached_rope_token(s, seed, selected[i], kv_row.data(), k_pe_row.data());
      write_entry(kv_row.data(), k_pe_row.data(), link == RopeChainBreak::kCacheScale, &compact[i * kEntryBytes]);
    } else {
      std::copy_n(&written[size_t(selected[i] - s.context) * kEntryBytes], kEntryBytes, &compact[i * kEntryBytes]);
    }
  }
  const int W = indexer_row_width(plan);
  std::vector<int32_t> indices(rows.slots.size(), -1);
  for (size_t j = 0; j < rows.slots.size(); ++j) {
    if (rows.slots[j] >= 0) {
      indices[j] = int32_t(std::lower_bound(selected.begin(), selected.end(), rows.slots[j]) - selected.begin());
    }
  }
  reference::SparseMlaV32Host attention{};
  attention.q = absorbed.q.data();
  attention.q_token_stride = int64_t{s.H} * (s.L + s.R);
  attention.q_head_stride = s.L + s.R;
  attention.cache = compact.data();
  attention.blocks = int64_t(selected.size());
  attention.block_size = 1;
  attention.block_stride = kEntryBytes;
  attention.entry_stride = kEntryBytes;
  attention.indices = indices.data();
  attention.indices_token_stride = W;
  attention.m = s.m;
  attention.heads = s.H;
  attention.top_k = W;
  attention.softmax_scale = s.softmax_scale;
  const SparseMlaV32Plan split = sparse_mla_v32_plan(s.m, s.H, W, kHopperSms, kSparseMlaV32MaxSplits);
  const double attention_ms =
      timed_ms([&] { attended = reference::sparse_mla_v32_kernel_model(attention, split.rows_per_split); });
  const double value_up_ms = timed_ms([&] { heads = reference_value_up(s, w, attended.latent, value_up_tactic(s)); });
  const double o_proj_ms = timed_ms([&] { out = reference_o_proj(s, w, heads); });
  r.chain_ms = qkv_ms + norm_ms + q_b_ms + absorb_ms + cache_ms + project_ms + indexer_ms + attention_ms + value_up_ms +
               o_proj_ms;
  r.notes.push_back(format("attention: the sparse_mla_v32 kernel's roundings model, %d splits of %d entries (its plan "
                           "on a %d-SM Hopper part), over %zu distinct selected entries",
                           split.splits, split.rows_per_split, kHopperSms, selected.size()));

  const auto row = [&](const char* kernel, std::string output, double ms, uint64_t print, std::string values) {
    r.rows.push_back({kernel, std::move(output), ms, print, std::move(values)});
  };
  row("qkv_a_proj", "qkv " + shape_text({s.m, s.qkv_width()}) + " BF16", qkv_ms, fingerprint(qkv), first_bf16(qkv));
  row("norm", "q_c " + shape_text({s.m, s.Q}) + " BF16", norm_ms, fingerprint(normed.q_c), first_bf16(normed.q_c));
  row("", "kv_c " + shape_text({s.m, s.L}) + " BF16", -1, fingerprint(normed.kv_c), first_bf16(normed.kv_c));
  row("q_b_proj", "q " + shape_text({s.m, s.H, s.P + s.R}) + " BF16", q_b_ms, fingerprint(q), first_bf16(q));
  row("rope_absorb", "q " + shape_text({s.m, s.H, s.L + s.R}) + " BF16", absorb_ms, fingerprint(absorbed.q),
      first_bf16(absorbed.q) + " | rope " + first_bf16(absorbed.q.data() + s.L, s.R));
  row("", "k_pe " + shape_text({s.m, s.R}) + " BF16 (rotated)", -1, fingerprint(absorbed.k_pe),
      first_bf16(absorbed.k_pe));
  row("cache write", "entries " + shape_text({s.m, kEntryBytes}) + " bytes", cache_ms, fingerprint(written),
      format("scales %.4g ...", [&] {
        float scale;
        std::memcpy(&scale, &written[kSparseMlaV32ScaleOffset], 4);
        return double(scale);
      }()));
  row("indexer proj", "index_q " + shape_text({s.m, plan.heads, kIndexerDim}) + " BF16", project_ms,
      fingerprint(projections.index_q), first_bf16(projections.index_q));
  row("indexer", "slots " + shape_text({s.m, W}) + " int32", indexer_ms, fingerprint(rows.slots),
      first_i32(rows.slots));
  row("attention", "latent " + shape_text({s.m, s.H, s.L}) + " BF16", attention_ms, fingerprint(attended.latent),
      first_bf16(attended.latent));
  row("value_up", "heads " + shape_text({s.m, s.H, s.V}) + " BF16", value_up_ms, fingerprint(heads), first_bf16(heads));
  row("o_proj", "out " + shape_text({s.m, s.D}) + " BF16", o_proj_ms, fingerprint(out), first_bf16(out));

  // The checks: each product of the chain against float64 on its own inputs;
  // the references take the served configuration (the preset's styles).
  std::vector<Check>& checks = r.checks;
  checks.push_back(check_product_vs_float64("qkv_a_proj", qkv, in.hidden, s.m, s.D, w.fused_qkv_a_proj, s.qkv_width(),
                                            "hidden"));
  checks.push_back(check_norm_vs_float64(s, w, qkv, normed.q_c, normed.kv_c));
  checks.push_back(check_product_vs_float64("q_b_proj", q, normed.q_c, s.m, s.Q, w.q_b_proj, s.q_width(), "q_c"));
  checks.push_back(check_rope_absorb(s, rope_absorb_host(s, w, q, qkv, in.positions, tables, tables.attention.style),
                                     tables.attention, absorbed));
  checks.push_back(check_cache_write(s, normed.kv_c, absorbed.k_pe, written));
  checks.push_back(check_indexer_keys(s, w, tables.indexer, served_plan, indexer, history, projections.index_k));
  checks.push_back(check_indexer_rows(s, served_plan, indexer, in, query, rows));
  checks.push_back(check_sparse_mla_v32_vs_float64(s, attention, attended, "sparse_mla_v32 (kernel model) vs float64 (one pass)"));
  checks.push_back(check_value_up_vs_float64(s, w, attended.latent, heads));
  checks.push_back(check_product_vs_float64("o_proj", out, heads, s.m, int64_t{s.H} * s.V, w.o_proj, s.D, "heads"));
  if (products != nullptr) {
    RopeChainProducts& p = *products;
    p.tables = std::move(tables);
    p.plan = served_plan;
    p.weights = w;
    p.inputs = in;
    p.history = history;
    p.qkv = std::move(qkv);
    p.q_c = std::move(normed.q_c);
    p.kv_c = std::move(normed.kv_c);
    p.q = std::move(q);
    p.q_absorbed = std::move(absorbed.q);
    p.k_pe = std::move(absorbed.k_pe);
    p.entries = std::move(written);
    p.projections = std::move(projections);
    p.query = std::move(query);
    p.rows = std::move(rows);
    p.latent = std::move(attended.latent);
    p.lse = std::move(attended.lse);
    p.heads = std::move(heads);
    p.out = std::move(out);
  }
  return Status();
}

}  // namespace dsa::cli
