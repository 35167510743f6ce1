// RoPE for the MLA presets with rotary dims (dsv32, glm5): the rotary
// configuration (DeepSeek's YaRN or plain RoPE), the cos/sin table, and the
// RoPE absorb, which builds the absorbed query and rotates k_pe, m = 1..16:
//
//   out[t, h, 0:L]   = q_nope[t, h, :] @ weight[h]             (head_gemv's tensor-core sums)
//   out[t, h, L:L+R] = rotate(q_pe[t, h, :], cos_sin[positions[t]])
//   k_pe_out[t, :]   = rotate(k_pe[t, :],    cos_sin[positions[t]])
//
// Table: cos_sin [rows, R], row p = cos(p f_0..f_{R/2-1}) * s | sin(...) * s
// (vLLM's cos_sin_cache layout), F32 or BF16; rope_cos_sin_table fills it.
// Rotation of pair i (kInterleaved: x[2i], x[2i+1]; kHalfSplit: x[i], x[i+R/2])
// with c = cos[i], s = sin[i], in FP32 in this order, then BF16 RNE:
//   a' = fma(a, c, -(b * s)),  b' = fma(b, c, a * s)
// Bounds, |total - exact| before the BF16 rounding (a, b the BF16 inputs):
//   - against the float64 rotation by the table's own values: 2^-22 (|a| + |b|) max(|c|, |s|);
//   - rope_cos_sin_table's F32 entries within 2^-24 * scale of the float64 closed form,
//     so against the exact rotation with that table: 2^-21 (|a| + |b|) * scale.
// The L columns keep head_gemv's bound (head_gemv.h, kTensorCores), BF16 out.
// Untrusted positions: a token whose position is negative (padding) or >=
// rows gets zeros in its L..L+R columns and k_pe_out row; those >= rows are
// counted in error_count. Deterministic and batch invariant: a token's bits
// depend only on its own inputs, the weights and the table.
// The weights are read before griddepcontrol.wait (PDL): no kernel in flight
// may write them; everything else after it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string_view>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

enum class RopeStyle : int {
  kInterleaved = 0,  // GPT-J: pairs (x[2i], x[2i+1]); vLLM is_neox_style=False
  kHalfSplit = 1,    // GPT-NeoX: pairs (x[i], x[i + R/2]); vLLM is_neox_style=True
};

// DeepSeek's YaRN when factor > 1 (vLLM DeepseekScalingRotaryEmbedding), plain
// RoPE when factor == 1. Frequencies f_i = theta^(-2i/R) blended with f_i / factor
// by the ramp between the correction dims of beta_fast and beta_slow.
struct RopeConfig {
  int rope_dim = 64;      // R: 16, 32, 64, 128 or 256
  double theta = 10000.0;
  double factor = 1.0;                   // YaRN scaling factor
  int64_t original_max_position = 4096;  // YaRN: original_max_position_embeddings
  double beta_fast = 32.0, beta_slow = 1.0;
  double mscale = 1.0, mscale_all_dim = 0.0;  // YaRN magnitude terms (cos/sin and softmax scale)
  int64_t max_position = 4096;                // table rows the engine holds
  RopeStyle style = RopeStyle::kInterleaved;
};

enum class RopeTarget : int {
  kAttention = 0,  // q_pe [H, R] and k_pe [R] of the MLA attention
  kIndexer = 1,    // the rope part (the first R dims) of the indexer's q and k
};

// The served configuration of a preset ("dsv32", "glm5"); others are invalid.
Status rope_preset_config(std::string_view preset, RopeTarget target, RopeConfig* out);
Status check_rope_config(const RopeConfig& config);
// f_i in float64 (YaRN blend included), i < R / 2.
double rope_frequency(const RopeConfig& config, int pair);
// The factor multiplied into cos and sin: yarn_mscale(factor, mscale) /
// yarn_mscale(factor, mscale_all_dim), yarn_mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1).
double rope_table_scale(const RopeConfig& config);
// Attention softmax scale: qk_head_dim^-0.5 * yarn_mscale(factor, mscale_all_dim)^2.
double rope_softmax_scale(const RopeConfig& config, int qk_head_dim);
// Host table [rows, R] F32 for positions first_position..: each entry the
// float64 value rounded to F32. `out` holds rows * R floats.
Status rope_cos_sin_table(const RopeConfig& config, int64_t first_position, int64_t rows, float* out);

struct RopeAbsorbArgs {
  TensorView q_nope;     // [m, H, P] BF16, dim 2 contiguous, head and token strides % 8 == 0, 16 B aligned
  TensorView q_pe;       // [m, H, R] BF16, same rules (e.g. views into q [m, H, P + R])
  TensorView k_pe;       // [m, R] BF16, dim 1 contiguous, token stride % 8 == 0, 16 B aligned
  TensorView positions;  // [n >= m] int64, contiguous
  TensorView cos_sin;    // [rows, R] F32 or BF16, dim 1 contiguous, row stride % 8 == 0, 16 B aligned
  TensorView weight;     // W_UK_T [H, P, L] BF16 (head_gemv.h's weight rules)
  TensorView out;        // [m, H, L + R] BF16, contiguous, 16 B aligned
  TensorView k_pe_out;   // [m, R] BF16, dim 1 contiguous, token stride % 8 == 0, 16 B aligned
  RopeStyle style = RopeStyle::kInterleaved;
  unsigned int* error_count = nullptr;  // optional: positions >= rows
};

// P a multiple of 64 up to 1024, L a multiple of 16, R in {16, 32, 64, 128,
// 256}; outputs overlap no input nor each other. Errors name the argument.
Status check_rope_absorb(const RopeAbsorbArgs& args);
// One PDL launch; no allocation. Graph capturable after a first uncaptured
// call per (m <= 8 or not, column tile) and device.
Status rope_absorb(const RopeAbsorbArgs& args, cudaStream_t stream);

}  // namespace dsa
