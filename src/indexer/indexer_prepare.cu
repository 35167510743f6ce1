// The indexer's prepare step (steps 1-4) and prefill (step 9) on the GPU
// (include/dsa_decode/indexer.h), bitwise equal to the CPU reference
// (src/indexer/indexer_reference.cpp): every value goes through the
// operations of src/indexer/indexer_math.h in the reference's order.
//
// Every 128-value row (a q head, a k row, a pooled k) is one warp's, lane l
// holding elements 4l..4l+3, the lane layout the fixed orders are written for
// (docs/indexer.md):
//  - LayerNorm: lane sums, then butterflies over lanes xor 16, 8, 4, 2, 1
//    (indexer_math::butterfly_sum32's order);
//  - Hadamard: stages h = 1, 2 pair registers of one lane, stages h = 4..64
//    pair lane l with lane l ^ (h / 4); then the scale and BF16 rounding, a
//    warp max for the absmax (max is exact: any order), and the lane's 4 FP8
//    codes stored as one 32-bit word;
//  - pool softmax: each dim in the lane that holds it.
//
// Both kernels are instantiated per pool size S (kPool: the pool's rows live
// in registers); H, the index heads, is a run-time value.
//
// indexer_prepare, one PDL launch (prepare_kernel), one warp per row of the
// step:
//  - rows [0, H m): head h of token t (row H t + h) is quantized into the
//    workspace's q_fp8 and its folded weight written, for every token
//    (padding and untrusted too: they read only the token's own rows, as the
//    reference does for padding);
//  - rows [H m, (H + 1) m): token t's k is LayerNormed and stashed with its
//    gate in ring slot pos % RING;
//  - rows [(H + 1) m, (H + 2) m): token t, when at pos % S == S - 1,
//    compresses pool pos / S from the k and gate of positions
//    pos - S + 1..pos: a position that
//    a token of this step holds (same request) is LayerNormed from that
//    token's index_k by the warp itself (the LayerNorm is deterministic: the
//    same bits as the stashed row), any other from the ring, where an
//    earlier step's launch stashed it.
//  The ring rule (a step's tokens of one request plus the S - 1 before the
//  first of them occupy distinct ring slots) keeps the slots the pool warps
//  read apart from the slots this launch writes, so the result is the
//  reference's token-by-token order's, bit for bit. (Until 2026-12-01 the
//  pools were a second launch reading the ring after the stash; one launch
//  is one dependent launch less in the chain.)
//
// indexer_prefill, one PDL launch: prefill_kernel, one warp per item. Items
// [0, n / S) are the complete pools: the warp LayerNorms the pool's S tokens
// from index_k itself (prefill has no workspace to hold normalized rows; the
// LayerNorm is deterministic, so recomputing it gives the reference's bits)
// and compresses the pool. The next min(n, RING) items stash the last tokens
// in the ring.
//
// Pool 1 (DeepSeek-V3.2: no pooling): prepare_kernel<1, rope> has (H + 1) m
// rows, the k row LayerNorms the token's k, rotates its first R dims by the
// table row of its position, and writes its key (Hadamard, quant) at entry
// pos % block_size of its page; q heads are rotated before their Hadamard.
// prefill_kernel<1>: one warp per position. No ring, gate or ape.
//
// Untrusted device values: a token whose request is >= requests or whose
// position is outside [0, min(max_context, width * block_size)) writes neither
// ring nor K cache and is counted once (by kernel 1); a pool whose block
// table entry is outside [0, blocks) is not written and is counted once.
#include <algorithm>
#include <cstdint>

#include "core/launch.cuh"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "indexer/indexer_math.h"
#include "indexer/indexer_state_params.h"

namespace dsa {
namespace {

namespace im = indexer_math;

constexpr int kDim = kIndexerDim;
constexpr int kLaneValues = kDim / 32;  // 4: elements 4l..4l+3 in lane l
constexpr int kWarpsPerCta = 8;
constexpr int kThreads = 32 * kWarpsPerCta;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// What the pooled keys are made of, for the prepare (m tokens) and prefill
// (n tokens) kernels alike: each token's k and gate rows and the layer's
// LayerNorm and ape parameters.
struct KeyInputs {
  const uint16_t* index_k;  // [tokens, 128] BF16, token stride k_token_stride
  int64_t k_token_stride;
  const uint16_t* gate;  // [tokens, 128] BF16, token stride gate_token_stride
  int64_t gate_token_stride;
  const float* k_norm_weight;  // [128]
  const float* k_norm_bias;    // [128]
  const float* ape;            // [S, 128]
};

KeyInputs make_key_inputs(const TensorView& index_k, const TensorView& gate, const TensorView& k_norm_weight,
                          const TensorView& k_norm_bias, const TensorView& ape) {
  KeyInputs k = {};
  k.index_k = index_k.ptr<const uint16_t>();
  k.k_token_stride = index_k.stride(0);
  k.gate = gate.ptr<const uint16_t>();
  k.gate_token_stride = gate.stride(0);
  k.k_norm_weight = k_norm_weight.ptr<const float>();
  k.k_norm_bias = k_norm_bias.ptr<const float>();
  k.ape = ape.ptr<const float>();
  return k;
}

// Pool 1's RoPE table (plan.rope_dims = R > 0): [rows, R] F32 or BF16, row p
// = cos | sin of position p.
struct RopeTable {
  const void* cos_sin;
  int64_t rows, row_stride;
  int dims;  // R; 0: no rotation
  bool bf16, half_split;
};

RopeTable make_rope_table(const IndexerPlan& plan, const TensorView& cos_sin) {
  RopeTable r = {};
  r.dims = plan.rope_dims;
  if (r.dims == 0) return r;
  r.cos_sin = cos_sin.data;
  r.rows = cos_sin.size(0);
  r.row_stride = cos_sin.stride(0);
  r.bf16 = cos_sin.dtype == DType::kBF16;
  r.half_split = plan.rope_style == RopeStyle::kHalfSplit;
  return r;
}

struct PrepareParams {
  int m;
  int heads;                // H
  const uint16_t* index_q;  // [m, H, 128] BF16, token stride q_token_stride
  int64_t q_token_stride;
  const float* head_weights;  // [m, H], token stride weights_token_stride
  int64_t weights_token_stride;
  KeyInputs keys;             // m tokens
  const int64_t* positions;       // [m]
  const int32_t* token_requests;  // [m]
  IndexerStateParams state;
  uint8_t* q_fp8;         // workspace [max_tokens, H, 128] e4m3 codes
  float* folded_weights;  // workspace [max_tokens, H]
  unsigned int* error_count;  // optional
  RopeTable rope;             // pool 1 only
};

struct PrefillParams {
  int64_t n;      // tokens at positions 0..n-1
  KeyInputs keys;  // n tokens
  int64_t request;
  int64_t first_stashed;  // max(0, n - RING): the first position stashed in the ring
  IndexerStateParams state;
  unsigned int* error_count;  // optional
  RopeTable rope;             // pool 1 only
};

__device__ __forceinline__ void count_error(unsigned int* error_count) {
  if (error_count != nullptr) atomicAdd(error_count, 1u);
}

// ---------------------------------------------------------------------------
// One lane's 4 elements of a 128-value row.

// BF16 elements 4 lane..4 lane + 3 of `row` [128] as one 8-byte word (rows
// are 8-byte aligned: 16-byte aligned data, token strides multiples of 8).
__device__ __forceinline__ uint2 load_lane_bf16(const uint16_t* row, int lane) {
  return *reinterpret_cast<const uint2*>(row + kLaneValues * lane);
}

__device__ __forceinline__ void store_lane_bf16(uint16_t* row, int lane, uint2 bits) {
  *reinterpret_cast<uint2*>(row + kLaneValues * lane) = bits;
}

__device__ __forceinline__ void unpack_bf16(uint2 bits, float (&x)[kLaneValues]) {
  x[0] = num::bf16_to_float(static_cast<uint16_t>(bits.x));
  x[1] = num::bf16_to_float(static_cast<uint16_t>(bits.x >> 16));
  x[2] = num::bf16_to_float(static_cast<uint16_t>(bits.y));
  x[3] = num::bf16_to_float(static_cast<uint16_t>(bits.y >> 16));
}

__device__ __forceinline__ uint2 pack_bf16(const uint16_t (&b)[kLaneValues]) {
  return make_uint2(b[0] | (static_cast<uint32_t>(b[1]) << 16), b[2] | (static_cast<uint32_t>(b[3]) << 16));
}

// The lane's 4 elements of a contiguous FP32 parameter row [128]. The
// parameters are only 4-byte aligned: scalar loads.
__device__ __forceinline__ void load_lane_floats(const float* row, int lane, float (&x)[kLaneValues]) {
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) x[i] = row[kLaneValues * lane + i];
}

// ape [S, 128] as the lane's columns: ape_columns[i][j] = ape[j, 4 lane + i].
template <int kPool>
__device__ __forceinline__ void load_ape_columns(const float* ape, int lane, float (&ape_columns)[kLaneValues][kPool]) {
#pragma unroll
  for (int j = 0; j < kPool; ++j) {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i) ape_columns[i][j] = ape[j * kDim + kLaneValues * lane + i];
  }
}

// indexer_math::butterfly_sum32 over the warp: every lane ends with the sum.
__device__ __forceinline__ float warp_butterfly_sum(float v) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) v = im::add_rn(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// ---------------------------------------------------------------------------
// The row operations, one warp per row.

// Step 1 (indexer_math::layernorm128) on the row whose BF16 elements
// 4 lane..4 lane + 3 are `k_bits`; returns the lane's 4 outputs as BF16.
// weight and bias: the lane's 4 elements of k_norm_weight and k_norm_bias.
__device__ uint2 layernorm_lane(uint2 k_bits, const float (&weight)[kLaneValues], const float (&bias)[kLaneValues]) {
  float x[kLaneValues], d[kLaneValues];
  unpack_bf16(k_bits, x);
  const float mean = im::layernorm_mean(warp_butterfly_sum(im::layernorm_lane_sum(x)));
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) d[i] = x[i] - mean;
  const float rstd = im::layernorm_rstd(warp_butterfly_sum(im::layernorm_lane_squares(d)));
  uint16_t y[kLaneValues];
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) y[i] = im::layernorm_output(d[i], rstd, weight[i], bias[i]);
  return pack_bf16(y);
}

// indexer_math::hadamard_quantize on the row whose elements 4 lane..4 lane + 3
// are x (overwritten): the lane's codes go to codes[4 lane..4 lane + 3];
// returns the row's scale (every lane).
__device__ float hadamard_quantize_lane(float (&x)[kLaneValues], uint8_t* codes, int lane) {
  // Stages h = 1, 2: pairs (i, i + h) inside the lane.
#pragma unroll
  for (int h = 1; h < kLaneValues; h *= 2) {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i) {
      if (i & h) continue;
      const float a = x[i], b = x[i + h];
      x[i] = im::add_rn(a, b);
      x[i + h] = a - b;
    }
  }
  // Stages h = 4..64: element 4 lane + i pairs with the same register of lane
  // lane ^ (h / 4); the lower lane holds a and keeps a + b, the upper keeps a - b.
#pragma unroll
  for (int lane_bit = 1; lane_bit < 32; lane_bit *= 2) {
    const bool upper = (lane & lane_bit) != 0;
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], lane_bit);
      x[i] = upper ? other - x[i] : im::add_rn(x[i], other);
    }
  }
  float absmax = 0.0f;  // fmaxf skips NaN, as the reference's loop
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) {
    x[i] = im::hadamard_output(x[i]);
    absmax = fmaxf(absmax, fabsf(x[i]));
  }
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) absmax = fmaxf(absmax, __shfl_xor_sync(kFullMask, absmax, offset));
  const int k = im::fp8_scale_exponent(absmax);
  const float inverse_scale = im::pow2(-k);
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) word |= static_cast<uint32_t>(num::quant_fp8_static(x[i], inverse_scale)) << (8 * i);
  *reinterpret_cast<uint32_t*>(codes + kLaneValues * lane) = word;
  return im::pow2(k);
}

// Pool 1's RoPE (indexer_math::rope_row) on the row whose BF16 values
// 4 lane..4 lane + 3 are x: the rotated ones (element < R) are replaced by
// their BF16-rounded rotation by the table row of `position` (zeros outside
// the table). Half-split pairs (k, k + R / 2) sit in lanes l and l + R / 8,
// register i both: one shuffle (xor R / 8) brings the partner.
__device__ void rope_lane(float (&x)[kLaneValues], const RopeTable& r, int64_t position, int lane) {
  float partner[kLaneValues];
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) partner[i] = r.half_split ? __shfl_xor_sync(kFullMask, x[i], r.dims / 8) : 0.0f;
  if (kLaneValues * lane >= r.dims) return;
  const bool valid = position >= 0 && position < r.rows;
  const int half = r.dims / 2;
  float y[kLaneValues];
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) {
    const int k = kLaneValues * lane + i;
    const int pair = im::rope_pair_of(k, r.dims, r.half_split);
    const bool first = im::rope_is_first(k, r.dims, r.half_split);
    const float a = r.half_split ? (first ? x[i] : partner[i]) : x[i & ~1];
    const float b = r.half_split ? (first ? partner[i] : x[i]) : x[i | 1];
    float c = 0.0f, s = 0.0f;
    if (valid) {
      if (r.bf16) {
        const uint16_t* row = static_cast<const uint16_t*>(r.cos_sin) + position * r.row_stride;
        c = num::bf16_to_float(row[pair]);
        s = num::bf16_to_float(row[half + pair]);
      } else {
        const float* row = static_cast<const float*>(r.cos_sin) + position * r.row_stride;
        c = row[pair];
        s = row[half + pair];
      }
    }
    y[i] = first ? im::rope_first(a, b, c, s) : im::rope_second(a, b, c, s);
  }
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) x[i] = num::round_bf16(y[i]);
}

// Pool 1: the key of `position` from its LayerNormed k (the lane's BF16 bits):
// RoPE, Hadamard and quant into entry pos % block_size of page `block` (codes
// at byte 128 e, scale at byte 128 P + 4 e). An untrusted page is skipped and
// counted once.
__device__ void write_token_key(const IndexerStateParams& s, const RopeTable& rope, int64_t block, int64_t position,
                                uint2 k_normed, unsigned int* error_count, int lane) {
  if (block < 0) {
    if (lane == 0) count_error(error_count);
    return;
  }
  float x[kLaneValues];
  unpack_bf16(k_normed, x);
  if (rope.dims > 0) rope_lane(x, rope, position, lane);
  const int64_t entry = position % s.pools_per_page;
  uint8_t* page = s.k_cache + block * s.page_stride;
  const float scale = hadamard_quantize_lane(x, page + entry * kDim, lane);
  if (lane == 0) *reinterpret_cast<float*>(page + int64_t(s.pools_per_page) * kDim + entry * 4) = scale;
}

// The BF16 row [128] of ring half `which` (0: k, 1: gate) holding `position` of `request`.
__device__ __forceinline__ uint16_t* ring_row(const IndexerStateParams& s, int64_t request, int which, int64_t position) {
  return s.ring + request * s.ring_request_stride + (int64_t(which) * s.ring_size + position % s.ring_size) * kDim;
}

// Step 3: pool `pool` of `request` from its S tokens' LayerNormed k and gate
// (k[j], gate[j]: the lane's elements of token S pool + j) into its page
// entry: codes at byte 128 e, scale at byte 128 P + 4 e. An untrusted page is
// skipped and counted once. ape_columns: load_ape_columns.
template <int kPool>
__device__ void compress_pool(const IndexerStateParams& s, int64_t block, int64_t pool, const uint2 (&k)[kPool],
                              const uint2 (&gate)[kPool], const float (&ape_columns)[kLaneValues][kPool],
                              unsigned int* error_count, int lane) {
  if (block < 0) {
    if (lane == 0) count_error(error_count);
    return;
  }
  float k_values[kPool][kLaneValues], gate_values[kPool][kLaneValues];
#pragma unroll
  for (int j = 0; j < kPool; ++j) {
    unpack_bf16(k[j], k_values[j]);
    unpack_bf16(gate[j], gate_values[j]);
  }
  float pooled[kLaneValues];
#pragma unroll
  for (int i = 0; i < kLaneValues; ++i) {
    float k_column[kPool], gate_column[kPool];
#pragma unroll
    for (int j = 0; j < kPool; ++j) {
      k_column[j] = k_values[j][i];
      gate_column[j] = gate_values[j][i];
    }
    pooled[i] = num::bf16_to_float(im::pool_softmax_dim<kPool>(k_column, gate_column, ape_columns[i]));
  }
  const int64_t entry = pool % s.pools_per_page;
  uint8_t* page = s.k_cache + block * s.page_stride;
  const float scale = hadamard_quantize_lane(pooled, page + entry * kDim, lane);
  if (lane == 0) *reinterpret_cast<float*>(page + int64_t(s.pools_per_page) * kDim + entry * 4) = scale;
}

// ---------------------------------------------------------------------------
// prepare.

// Where token t writes the state: request -1 for a padding token and for an
// untrusted one (request >= requests, position outside [0, position_limit)).
struct TokenTarget {
  int64_t request;
  int64_t position;
  bool untrusted;
};

__device__ TokenTarget token_target(const PrepareParams& p, int t) {
  const int32_t request = p.token_requests[t];
  if (request < 0) return {-1, 0, false};
  const int64_t position = p.positions[t];
  if (request >= p.state.requests || position < 0 || position >= p.state.position_limit) return {-1, 0, true};
  return {request, position, false};
}

// Step 2 for head h of token t: codes into q_fp8 [t, h], w' into folded_weights [t, h].
// kRope (pool 1 with rotated dims): the head's first R dims rotated first.
template <bool kRope>
__device__ void quantize_head(const PrepareParams& p, int t, int h, int lane) {
  float x[kLaneValues];
  unpack_bf16(load_lane_bf16(p.index_q + t * p.q_token_stride + h * kDim, lane), x);
  if constexpr (kRope) rope_lane(x, p.rope, p.positions[t], lane);
  const int64_t row = int64_t(t) * p.heads + h;
  const float scale = hadamard_quantize_lane(x, p.q_fp8 + row * kDim, lane);
  if (lane == 0) {
    p.folded_weights[row] = im::fold_head_weight(p.head_weights[t * p.weights_token_stride + h], scale, p.heads);
  }
}

// What a k row or pool row reads of the step's inputs (positions, requests,
// block table) before the PDL wait: they are complete before the step's
// first kernel starts (include/dsa_decode/indexer.h).
struct RowInputs {
  TokenTarget target;
  int32_t lane_request = -1;  // pool rows: token `lane`'s request and position (m <= 32), -1 past m
  int64_t lane_position = -1;
  int64_t block = -1;  // pool rows completing a pool: its page (-1 untrusted)
};

template <int kPool>
__device__ RowInputs read_row_inputs(const PrepareParams& p, int t, bool pool_row, int lane) {
  RowInputs in;
  in.target = token_target(p, t);
  if (!pool_row) return in;
  // All the step's tokens at once: a search token by token would chain m
  // dependent loads per position.
  if (lane < p.m) {
    in.lane_request = p.token_requests[lane];
    in.lane_position = p.positions[lane];
  }
  if (in.target.request >= 0 && in.target.position % kPool == kPool - 1) {
    in.block = indexer_pool_block(p.state, in.target.request, in.target.position / kPool);
  }
  return in;
}

// Pool 1's k row: the token's target and its key's page (before the PDL wait).
__device__ RowInputs read_token_key_inputs(const PrepareParams& p, int t) {
  RowInputs in;
  in.target = token_target(p, t);
  if (in.target.request >= 0) in.block = indexer_pool_block(p.state, in.target.request, in.target.position);
  return in;
}

// Steps 1 and 4 for a token: LayerNorm, then k and gate into the ring.
__device__ void normalize_and_stash(const PrepareParams& p, int t, const TokenTarget& target,
                                    const float (&weight)[kLaneValues], const float (&bias)[kLaneValues], int lane) {
  if (target.untrusted && lane == 0) count_error(p.error_count);
  if (target.request < 0) return;
  const uint2 k = layernorm_lane(load_lane_bf16(p.keys.index_k + t * p.keys.k_token_stride, lane), weight, bias);
  const uint2 gate = load_lane_bf16(p.keys.gate + t * p.keys.gate_token_stride, lane);
  store_lane_bf16(ring_row(p.state, target.request, 0, target.position), lane, k);
  store_lane_bf16(ring_row(p.state, target.request, 1, target.position), lane, gate);
}

// Step 3 for a token (a pool row of prepare_kernel): pool pos / S when the
// token is trusted and at pos % S == S - 1. Its S tokens' k and gate come from
// the step's own tokens where one holds the position (the first such token),
// from the ring otherwise. An untrusted token is counted by its k row.
template <int kPool>
__device__ void compress_token_pool(const PrepareParams& p, const RowInputs& in, const float (&weight)[kLaneValues],
                                    const float (&bias)[kLaneValues], const float (&ape_columns)[kLaneValues][kPool],
                                    int lane) {
  const TokenTarget& target = in.target;
  if (target.request < 0 || target.position % kPool != kPool - 1) return;
  // All 2 S loads are issued before any is used (one memory round trip,
  // not one per token), then every k is LayerNormed, the S butterflies
  // side by side; a ring row keeps its loaded bits (LayerNormed when stashed).
  uint2 k[kPool], gate[kPool];
  bool from_step[kPool];
#pragma unroll
  for (int j = 0; j < kPool; ++j) {
    const int64_t position = target.position - (kPool - 1) + j;
    const unsigned holders =
        __ballot_sync(kFullMask, in.lane_request == target.request && in.lane_position == position);
    const int holder = holders != 0 ? __ffs(holders) - 1 : -1;  // the step's first token at (request, position)
    from_step[j] = holder >= 0;
    const uint16_t* k_row = from_step[j] ? p.keys.index_k + holder * p.keys.k_token_stride
                                         : ring_row(p.state, target.request, 0, position);
    const uint16_t* gate_row = from_step[j] ? p.keys.gate + holder * p.keys.gate_token_stride
                                            : ring_row(p.state, target.request, 1, position);
    k[j] = load_lane_bf16(k_row, lane);
    gate[j] = load_lane_bf16(gate_row, lane);
  }
#pragma unroll
  for (int j = 0; j < kPool; ++j) {
    const uint2 normalized = layernorm_lane(k[j], weight, bias);
    if (from_step[j]) k[j] = normalized;
  }
  compress_pool<kPool>(p.state, in.block, target.position / kPool, k, gate, ape_columns, p.error_count, lane);
}

// Steps 1-4: warp w of CTA c takes row 8 c + w of the (H + 2) m rows (H m q
// heads, m k rows, m pool rows); grid ceil((H + 2) m / 8), kThreads threads.
// kPool 1 (no pooling): (H + 1) m rows, a k row writes the token's key
// (LayerNorm, RoPE, Hadamard, quant) instead of stashing it; kRope: q heads
// and keys rotated first.
template <int kPool, bool kRope = false>
__global__ void __launch_bounds__(kThreads) prepare_kernel(const __grid_constant__ PrepareParams p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarpsPerCta + threadIdx.x / 32;
  const int q_rows = p.m * p.heads;
  const bool k_row = row >= q_rows && row < q_rows + p.m;
  const bool pool_row = kPool > 1 && row >= q_rows + p.m && row < q_rows + 2 * p.m;
  float weight[kLaneValues] = {}, bias[kLaneValues] = {}, ape_columns[kLaneValues][kPool] = {};
  if (k_row || pool_row) {  // layer parameters: no kernel in flight writes them
    load_lane_floats(p.keys.k_norm_weight, lane, weight);
    load_lane_floats(p.keys.k_norm_bias, lane, bias);
  }
  if (pool_row) load_ape_columns<kPool>(p.keys.ape, lane, ape_columns);
  const int t = k_row ? row - q_rows : row - q_rows - p.m;
  RowInputs in;
  if constexpr (kPool == 1) {
    if (k_row) in = read_token_key_inputs(p, t);
  } else {
    if (k_row || pool_row) in = read_row_inputs<kPool>(p, t, pool_row, lane);
  }
  pdl_wait();  // the projections, the ring and the K cache come from earlier kernels
  pdl_release_dependents();
  if (row < q_rows) {
    quantize_head<kRope>(p, row / p.heads, row % p.heads, lane);
  } else if (k_row) {
    if constexpr (kPool == 1) {
      if (in.target.untrusted && lane == 0) count_error(p.error_count);
      if (in.target.request < 0) return;
      const uint2 k = layernorm_lane(load_lane_bf16(p.keys.index_k + t * p.keys.k_token_stride, lane), weight, bias);
      write_token_key(p.state, p.rope, in.block, in.target.position, k, p.error_count, lane);
    } else {
      normalize_and_stash(p, t, in.target, weight, bias, lane);
    }
  } else if constexpr (kPool > 1) {
    if (pool_row) compress_token_pool<kPool>(p, in, weight, bias, ape_columns, lane);
  }
}

// ---------------------------------------------------------------------------
// prefill.

// Step 9: warp w of CTA c takes item 8 c + w: items [0, n / S) are the
// complete pools, the next n - first_stashed the stashed tokens. Grid
// ceil((n / S + n - first_stashed) / 8).
// kPool 1: item i < n writes position i's key (no ring). Grid ceil(n / 8).
template <int kPool>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const __grid_constant__ PrefillParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  float weight[kLaneValues], bias[kLaneValues], ape_columns[kLaneValues][kPool];
  load_lane_floats(p.keys.k_norm_weight, lane, weight);  // layer parameters: before the wait
  load_lane_floats(p.keys.k_norm_bias, lane, bias);
  if constexpr (kPool == 1) {
    pdl_wait();
    pdl_release_dependents();
    if (item >= p.n) return;
    const uint2 k = layernorm_lane(load_lane_bf16(p.keys.index_k + item * p.keys.k_token_stride, lane), weight, bias);
    write_token_key(p.state, p.rope, indexer_pool_block(p.state, p.request, item), item, k, p.error_count, lane);
    return;
  }
  load_ape_columns<kPool>(p.keys.ape, lane, ape_columns);
  pdl_wait();
  pdl_release_dependents();
  const int64_t pools = p.n / kPool;
  if (item < pools) {
    uint2 k[kPool], gate[kPool];
#pragma unroll
    for (int j = 0; j < kPool; ++j) {
      const int64_t token = item * kPool + j;
      k[j] = layernorm_lane(load_lane_bf16(p.keys.index_k + token * p.keys.k_token_stride, lane), weight, bias);
      gate[j] = load_lane_bf16(p.keys.gate + token * p.keys.gate_token_stride, lane);
    }
    compress_pool<kPool>(p.state, indexer_pool_block(p.state, p.request, item), item, k, gate, ape_columns,
                         p.error_count, lane);
    return;
  }
  const int64_t position = p.first_stashed + (item - pools);
  if (position >= p.n) return;
  const uint2 k = layernorm_lane(load_lane_bf16(p.keys.index_k + position * p.keys.k_token_stride, lane), weight, bias);
  store_lane_bf16(ring_row(p.state, p.request, 0, position), lane, k);
  store_lane_bf16(ring_row(p.state, p.request, 1, position), lane,
                  load_lane_bf16(p.keys.gate + position * p.keys.gate_token_stride, lane));
}

// ---------------------------------------------------------------------------
// Launchers.

PrepareParams make_prepare_params(const IndexerPrepareArgs& a) {
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(a.plan);
  uint8_t* workspace = a.workspace.ptr<uint8_t>();
  PrepareParams p = {};
  p.m = static_cast<int>(a.index_q.size(0));
  p.heads = a.plan.heads;
  p.index_q = a.index_q.ptr<const uint16_t>();
  p.q_token_stride = a.index_q.stride(0);
  p.head_weights = a.head_weights.ptr<const float>();
  p.weights_token_stride = a.head_weights.stride(0);
  p.keys = make_key_inputs(a.index_k, a.gate, a.k_norm_weight, a.k_norm_bias, a.ape);
  p.positions = a.positions.ptr<const int64_t>();
  p.token_requests = a.token_requests.ptr<const int32_t>();
  p.state = make_indexer_state_params(a.plan, a.state);
  p.q_fp8 = workspace + layout.q_fp8;
  p.folded_weights = reinterpret_cast<float*>(workspace + layout.head_weights);
  p.error_count = a.error_count;
  p.rope = make_rope_table(a.plan, a.cos_sin);
  return p;
}

unsigned ctas_for_warps(int64_t warps) { return static_cast<unsigned>((warps + kWarpsPerCta - 1) / kWarpsPerCta); }

// The kernels' instances for a plan's pool size (4, 8 or 16: check_indexer_plan).
using PrepareKernel = void (*)(PrepareParams);
PrepareKernel prepare_kernel_for(int pool, bool rope) {
  if (pool == 1) return rope ? prepare_kernel<1, true> : prepare_kernel<1, false>;
  return pool == 16 ? prepare_kernel<16> : pool == 8 ? prepare_kernel<8> : prepare_kernel<4>;
}
using PrefillKernel = void (*)(PrefillParams);
PrefillKernel prefill_kernel_for(int pool) {
  return pool == 16 ? prefill_kernel<16> : pool == 8 ? prefill_kernel<8> : pool == 1 ? prefill_kernel<1> : prefill_kernel<4>;
}

// Rows of a prepare launch: H q heads, a k row and (pooled) a pool row per token.
int64_t prepare_rows(const PrepareParams& p, int pool) { return int64_t(p.m) * (p.heads + (pool == 1 ? 1 : 2)); }

}  // namespace

Status indexer_prepare(const IndexerPrepareArgs& args, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_prepare(args));
  const PrepareParams p = make_prepare_params(args);
  return launch_pdl(prepare_kernel_for(args.plan.pool, args.plan.rope_dims > 0),
                    dim3(ctas_for_warps(prepare_rows(p, args.plan.pool))), dim3(kThreads), 0, stream, p);
}

Status indexer_prefill(const IndexerPrefillArgs& args, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_prefill(args));
  PrefillParams p = {};
  p.n = args.index_k.size(0);
  p.keys = make_key_inputs(args.index_k, args.gate, args.k_norm_weight, args.k_norm_bias, args.ape);
  p.request = args.request;
  p.first_stashed = std::max<int64_t>(0, p.n - args.plan.ring);
  p.state = make_indexer_state_params(args.plan, args.state);
  p.error_count = args.error_count;
  p.rope = make_rope_table(args.plan, args.cos_sin);
  const int64_t items = args.plan.pool == 1 ? p.n : p.n / args.plan.pool + (p.n - p.first_stashed);
  return launch_pdl(prefill_kernel_for(args.plan.pool), dim3(ctas_for_warps(items)), dim3(kThreads), 0, stream,
                    p);
}

}  // namespace dsa
