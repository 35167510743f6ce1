// The kernels of sparse_mla_v32 (include/dsa_decode/sparse_mla_v32.h): the
// cache write of DeepSeek-V3.2's 656-byte FP8 entries and the sparse MLA
// decode attention over them. Design and floor: docs/sparse_mla_v32.md.
//
// Attention. CTA (split, group, token) of 16 warps owns the 16 heads 16
// group.. of one token (two 8-wide mma.sync tiles) and one run of
// rows_per_split (<= 1024) entries of its index row, taken in chunks of 64
// entries; the splits of a (token, group) are one cluster.
//
// Prologue: the run's slots are read once (coalesced, the out-of-range ones
// counted by group 0) into shared memory (-1 for invalid entries); chunk 0's
// entries are requested (cp.async, 41 units of 16 bytes an entry, zeros for
// invalid ones) into one of two stage buffers; q of the 16 heads is staged,
// warp h finds head h's largest |q| per 128-dim group (the power of two 2^e
// that takes it to [2^14, 2^15)) and whether q holds a NaN or an infinity;
// then every warp builds its B fragments: q x 2^e rounded to FP16 (exact but
// for values below 2^-29 of the group's largest) and the RoPE q as BF16.
//
// Per chunk, four phases separated by CTA barriers:
//  1. convert: the next chunk is requested into the other stage, then warp w
//     converts entries w, w + 16, w + 32, w + 48: codes -> FP16 (exact) into
//     tile units 0..63 of the row, RoPE copied as BF16 into units 64..71, the
//     four scales into row_scale, and row_bad set when a scale or a RoPE
//     value is not finite. Tile rows are 1152 bytes; unit u of row r is
//     stored at u ^ (r % 8) (ldmatrix conflict-free).
//  2. scores: warp w = (rows 16 (w % 4).., group w / 4) computes S^T[16
//     rows][16 heads] over its group's 128 dims (8 k-steps of mma.m16n8k16
//     FP16, A = tile rows by ldmatrix, B = q from registers) and over RoPE
//     dims 512 + 16 (w / 4).. (one BF16 k-step); its partial is
//     nope x 2^-e x scale(row, group) + rope, stored per group.
//  3. softmax: warp h owns head h, lane l rows 2l, 2l + 1: the four partials
//     summed, x softmax_scale x log2(e); -inf for invalid entries, NaN for a
//     bad row or a bad q; the running max, p = 2^(s - max); per group g the
//     weights p x scale(row, g) divided by their chunk maximum S_g (so that
//     the largest is 1) rounded to FP16 into probs[g]; S_g kept per head.
//  4. P.V: warp w owns dims 32 w..32 w + 31 (group w / 4) of the 16 heads:
//     chunk_O^T[dims][heads] = V^T P_g^T (A = tile by ldmatrix.trans, B =
//     probs[g] by ldmatrix), then O = O x rescale + chunk_O x S_g (FP32).
// Combine (as sparse_mla_mma): each CTA pushes its unnormalized O [16][512]
// f32 and (max, sum) per head into the shared memory of the cluster CTA that
// combines each 8-dim vector, one cluster barrier, then each CTA adds its
// vectors over the splits in split order and writes latent and lse.
//
// Every sum has a fixed order that depends only on K, H and the plan: the
// same inputs and plan give the same bits.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/async_copy.cuh"
#include "core/cluster.cuh"
#include "core/fp8.cuh"
#include "core/launch.cuh"
#include "core/mma.cuh"
#include "core/shared_memory.h"
#include "core/tensor_rows.h"
#include "dsa_decode/numerics.h"
#include "sparse_mla/sparse_mla_common.cuh"
#include "sparse_mla_v32/sparse_mla_v32_format.h"
#include "sparse_mla_v32/sparse_mla_v32_plan.h"

namespace dsa {
namespace {

namespace cg = cooperative_groups;

constexpr int kLatent = kSparseMlaV32Latent;
constexpr int kDim = kSparseMlaV32HeadDim;
constexpr int kEntry = kSparseMlaV32EntryBytes;
constexpr int kGroupSize = kSparseMlaV32GroupSize;
constexpr int kGroups = v32::kGroups;
constexpr int kHeads = kSparseMlaV32CtaHeads;
constexpr int kHeadTiles = kHeads / 8;
constexpr int kChunkRows = kSparseMlaV32ChunkRows;
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 2;
constexpr int kMaxRows = kSparseMlaV32MaxRowsPerSplit;
constexpr int kMaxSplits = kSparseMlaV32MaxSplits;
constexpr int kTileUnits = kDim * 2 / 16;    // 72 16-byte units a tile row: 64 FP16 NoPE, 8 BF16 RoPE
constexpr int kRopeUnit = kLatent * 2 / 16;  // 64
constexpr int kEntryUnits = kEntry / 16;     // 41
constexpr int kRowsPerWarp = kChunkRows / kWarps;
constexpr int kGroupSteps = kGroupSize / 16;  // NoPE k-steps per group
constexpr int kRowSteps = kChunkRows / 16;    // P.V k-steps per chunk
constexpr int kDimsPerWarp = kLatent / kWarps;
constexpr int kDimTiles = kDimsPerWarp / 16;
constexpr int kScoreStride = kChunkRows + 4;  // floats
constexpr int kProbStride = kChunkRows + 8;   // halves: 144-byte rows, conflict-free ldmatrix
constexpr int kVectorsPerHead = kLatent / 8;
constexpr int kVectors = kHeads * kVectorsPerHead;
static_assert(kWarps == kHeads && kWarps == 4 * kGroups, "warp h softmaxes head h; 4 row tiles x 4 groups score");
static_assert(kDimTiles == 2 && kGroupSize % kDimsPerWarp == 0, "a P.V warp's dims lie in one group");
static_assert(kEntryUnits - 32 <= 32 && kEntryUnits > 32, "an entry's units: lane l and 32 + l");

struct Params {
  const uint16_t* q;  // [m, H, 576] BF16 bits
  int64_t q_token_stride, q_head_stride;
  const uint8_t* cache;  // entries of 656 bytes
  int64_t cache_block_stride, cache_entry_stride;  // bytes
  int64_t capacity;
  int32_t block_size;   // when it fits int32 (else block_shift is 31)
  int32_t block_shift;  // log2(block_size) for a power of two, else -1
  const int32_t* indices;
  int64_t indices_token_stride;
  int top_k, heads;
  float softmax_scale;
  uint16_t* latent;
  int64_t latent_token_stride;
  float* lse;
  unsigned int* error_count;
};

struct CacheWriteParams {
  const uint16_t* kv_c;
  int64_t kv_c_stride;
  const uint16_t* k_pe;
  int64_t k_pe_stride;
  const int64_t* slot_mapping;
  int64_t slots;  // len(slot_mapping)
  uint8_t* cache;
  int64_t cache_block_stride, cache_entry_stride, capacity, block_size;
  unsigned int* error_count;
};

struct SharedStorage {
  // [64 rows][72 units]; after the last chunk: the CTA's partial O [16][512] f32.
  uint4 tile[kChunkRows * kTileUnits];
  uint4 stage[kStages][kChunkRows * kEntryUnits];  // raw entries of chunk c in stage c % 2, 656 bytes a row
  union alignas(16) {
    uint16_t q[kHeads][kDim];                     // prologue: the group's q, BF16 bits (zero for heads >= H)
    float scores[kGroups][kHeads][kScoreStride];  // chunk loop: [group][head][chunk row] partial scores
  } u;
  alignas(16) __half probs[kGroups][kHeads][kProbStride];  // [group][head][chunk row] p x scale / S
  float group_max[kGroups][kHeads];                         // S per group and head of the chunk
  float row_scale[kChunkRows][kGroups];
  int32_t row_bad[kChunkRows];
  float run_max[kHeads], run_sum[kHeads], rescale[kHeads];
  int32_t q_exponent[kHeads][kGroups];
  int32_t q_bad[kHeads];
  // Pushed by the cluster's CTAs once they leave their chunk loop, while this
  // CTA may still be in its own: nothing else lives here.
  float peer_max[kMaxSplits][kHeads], peer_sum[kMaxSplits][kHeads];
  alignas(16) float incoming[kVectors + kMaxSplits][8];  // incoming[r * share + i]: split r's vector i
  int32_t row_slot[kMaxRows];                            // the split's slots, -1 when invalid
};
static_assert(sizeof(float) * kHeads * kLatent <= sizeof(SharedStorage::tile), "the partial O fits in the tile");
static_assert(sizeof(SharedStorage) <= 227 * 1024, "one CTA per SM within Hopper's 227 KiB");

__device__ __forceinline__ uint32_t tile_unit(uint32_t tile, int row, int unit) {
  return swizzled_tile_unit<kTileUnits * 16>(tile, row, unit);
}

__device__ __forceinline__ bool bf16_pair_finite(uint32_t pair) {
  return (pair & 0x7F80u) != 0x7F80u && (pair & 0x7F800000u) != 0x7F800000u;
}

__device__ __forceinline__ int32_t block_of(const Params& p, int32_t slot) {
  return paged_block_of(slot, p.block_shift, p.block_size);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_v32_kernel(const Params p, const int rows_per_split) {
  extern __shared__ uint4 shared_raw[];
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(shared_raw);
  const cg::cluster_group cluster = cg::this_cluster();

  const int split = blockIdx.x, splits = gridDim.x, group = blockIdx.y, token = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;  // MMA fragment coordinates
  const int first_head = group * kHeads;
  const uint32_t tile = shared_address(s.tile);
  cluster_arrive_relaxed();  // this CTA has started (peers push into it after the loop)

  // Every input is written by a predecessor in the decode chain (absorb + cache write, indexer).
  pdl_wait();
  pdl_release_dependents();

  const int32_t* index_row = p.indices + token * p.indices_token_stride;
  const int row_begin = split * rows_per_split;
  const int rows = min(p.top_k, row_begin + rows_per_split) - row_begin;
  const int chunks = (rows + kChunkRows - 1) / kChunkRows;

  unsigned int out_of_range = 0;
  for (int j = threadIdx.x; j < rows; j += kThreads) {
    const int32_t slot = index_row[row_begin + j];
    s.row_slot[j] = (slot >= 0 && slot < p.capacity) ? slot : -1;
    out_of_range += slot >= p.capacity;
  }
  if (group == 0) count_out_of_range(p, out_of_range, lane);
  for (int i = threadIdx.x; i < kHeads * kTileUnits; i += kThreads) {
    const int h = i / kTileUnits, unit = i % kTileUnits;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (first_head + h < p.heads) {
      v = *reinterpret_cast<const uint4*>(p.q + token * p.q_token_stride + (first_head + h) * p.q_head_stride +
                                          unit * 8);
    }
    reinterpret_cast<uint4*>(s.u.q[h])[unit] = v;
  }
  if (threadIdx.x < kHeads) {
    s.run_max[threadIdx.x] = -INFINITY;
    s.run_sum[threadIdx.x] = 0.0f;
  }
  __syncthreads();  // slots and q staged

  // Requests chunk `chunk`'s entries into stage chunk % 2 (an empty group
  // past the last chunk keeps the group count uniform): warp w copies
  // entries w + 16 i, lane l units l and 32 + l of each.
  auto request = [&](int chunk) {
    if (chunk < chunks) {
      const uint32_t stage = shared_address(s.stage[chunk % kStages]);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp + kWarps * i, j = chunk * kChunkRows + row;
        const int32_t slot = j < rows ? s.row_slot[j] : -1;
        const uint8_t* source = p.cache;
        if (slot >= 0) {
          const int32_t block = block_of(p, slot);
          source += block * p.cache_block_stride + int64_t(slot - block * p.block_size) * p.cache_entry_stride;
        }
        const uint32_t target = stage + row * kEntry;
        async_copy_16_or_zero(target + lane * 16, source + lane * 16, slot >= 0);
        if (lane < kEntryUnits - 32) {
          async_copy_16_or_zero(target + (32 + lane) * 16, source + (32 + lane) * 16, slot >= 0);
        }
      }
    }
    async_copy_commit();
  };
  request(0);

  // Head `warp`'s q: the FP16 exponent of each group, and whether it is finite.
  {
    const int h = warp;
    bool bad = false;
#pragma unroll
    for (int gq = 0; gq < kGroups; ++gq) {
      const uint2 v = *reinterpret_cast<const uint2*>(&s.u.q[h][gq * kGroupSize + 4 * lane]);
      bad = bad || !bf16_pair_finite(v.x) || !bf16_pair_finite(v.y);
      float amax = fmaxf(fmaxf(v32::bf16_abs(uint16_t(v.x)), v32::bf16_abs(uint16_t(v.x >> 16))),
                         fmaxf(v32::bf16_abs(uint16_t(v.y)), v32::bf16_abs(uint16_t(v.y >> 16))));
#pragma unroll
      for (int offset = 16; offset >= 1; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
      if (lane == 0) s.q_exponent[h][gq] = (amax > 0.0f && isfinite(amax)) ? 14 - ilogbf(amax) : 0;
    }
    const uint32_t rope = *reinterpret_cast<const uint32_t*>(&s.u.q[h][kLatent + 2 * lane]);
    bad = __any_sync(0xFFFFFFFFu, bad || !bf16_pair_finite(rope));
    if (lane == 0) s.q_bad[h] = bad;
  }
  __syncthreads();

  // Score role (phase 2): rows 16 (warp % 4).., group warp / 4.
  const int score_row = (warp % 4) * 16, score_group = warp / 4;
  uint32_t q_fragment[kGroupSteps][kHeadTiles][2];  // FP16 pairs of q x 2^e: dims 2c.. and 8 + 2c.. of each step
  uint32_t rope_fragment[kHeadTiles][2];            // BF16 pairs of the RoPE q
  float q_unscale[kHeadTiles][2];                   // 2^-e of heads 8 t + 2c, 8 t + 2c + 1
#pragma unroll
  for (int t = 0; t < kHeadTiles; ++t) {
    const int head = t * 8 + g;
    const int exponent = s.q_exponent[head][score_group];
#pragma unroll
    for (int step = 0; step < kGroupSteps; ++step) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = score_group * kGroupSize + step * 16 + half * 8 + 2 * c;
        const uint32_t pair = *reinterpret_cast<const uint32_t*>(&s.u.q[head][d]);
        q_fragment[step][t][half] = pack_half2(ldexpf(num::bf16_to_float(uint16_t(pair)), exponent),
                                               ldexpf(num::bf16_to_float(uint16_t(pair >> 16)), exponent));
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rope_fragment[t][half] =
          *reinterpret_cast<const uint32_t*>(&s.u.q[head][kLatent + score_group * 16 + half * 8 + 2 * c]);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) q_unscale[t][e] = ldexpf(1.0f, -s.q_exponent[t * 8 + 2 * c + e][score_group]);
  }
  const float score_scale = p.softmax_scale * kLog2e;
  const int pv_group = warp / (kGroupSize / kDimsPerWarp);

  float out[kDimTiles][kHeadTiles][4];  // O^T: dims 32 warp + 16 d + (g, g + 8), heads 8 t + 2c (+1)
#pragma unroll
  for (int d = 0; d < kDimTiles; ++d)
#pragma unroll
    for (int t = 0; t < kHeadTiles; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) out[d][t][e] = 0.0f;

  for (int chunk = 0; chunk < chunks; ++chunk) {
    // 1. Convert. After this barrier chunk's entries are visible to every
    // thread, and the previous chunk's readers of the tile, row_scale,
    // row_bad and the other stage are done.
    async_copy_wait(0);
    __syncthreads();
    request(chunk + 1);
    const uint8_t* stage = reinterpret_cast<const uint8_t*>(s.stage[chunk % kStages]);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int row = warp + kWarps * i;
      const uint8_t* entry = stage + row * kEntry;
      // Lane l converts codes 8l.. and 256 + 8l..: whole 512-byte spans of the tile per store.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint2 codes = *reinterpret_cast<const uint2*>(entry + half * 256 + 8 * lane);
        store_shared(tile_unit(tile, row, half * 32 + lane),
                     make_uint4(e4m3x2_to_f16x2(codes.x), e4m3x2_to_f16x2(codes.x >> 16), e4m3x2_to_f16x2(codes.y),
                                e4m3x2_to_f16x2(codes.y >> 16)));
      }
      bool bad = false;
      if (lane < 8) {
        const uint4 rope = *reinterpret_cast<const uint4*>(entry + kSparseMlaV32RopeOffset + 16 * lane);
        bad = !bf16_pair_finite(rope.x) || !bf16_pair_finite(rope.y) || !bf16_pair_finite(rope.z) ||
              !bf16_pair_finite(rope.w);
        store_shared(tile_unit(tile, row, kRopeUnit + lane), rope);
      } else if (lane < 8 + kGroups) {
        const float scale = *reinterpret_cast<const float*>(entry + kSparseMlaV32ScaleOffset + 4 * (lane - 8));
        bad = !isfinite(scale);
        s.row_scale[row][lane - 8] = scale;
      }
      bad = __any_sync(0xFFFFFFFFu, bad);
      if (lane == 0) s.row_bad[row] = bad;
    }
    __syncthreads();

    // 2. Partial scores of 16 rows x 16 heads over one group's dims and a 16-dim RoPE slice.
    {
      float acc[kHeadTiles][2][4], rope_acc[kHeadTiles][4];
#pragma unroll
      for (int t = 0; t < kHeadTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][0][e] = acc[t][1][e] = rope_acc[t][e] = 0.0f;
      const int a_row = score_row + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int step = 0; step < kGroupSteps; ++step) {
        uint32_t a[4];
        ldmatrix_x4(a, tile_unit(tile, a_row, 2 * (score_group * kGroupSteps + step) + lane / 16));
#pragma unroll
        for (int t = 0; t < kHeadTiles; ++t) mma_f16(acc[t][step % 2], a, q_fragment[step][t][0], q_fragment[step][t][1]);
      }
      {
        uint32_t a[4];
        ldmatrix_x4(a, tile_unit(tile, a_row, kRopeUnit + 2 * score_group + lane / 16));
#pragma unroll
        for (int t = 0; t < kHeadTiles; ++t) mma_bf16(rope_acc[t], a, rope_fragment[t][0], rope_fragment[t][1]);
      }
      const int row0 = score_row + g;
      const float scale_low = s.row_scale[row0][score_group], scale_high = s.row_scale[row0 + 8][score_group];
#pragma unroll
      for (int t = 0; t < kHeadTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float nope = (acc[t][0][e] + acc[t][1][e]) * q_unscale[t][e % 2];
          s.u.scores[score_group][t * 8 + 2 * c + e % 2][row0 + (e / 2) * 8] =
              fmaf(nope, e < 2 ? scale_low : scale_high, rope_acc[t][e]);
        }
      }
    }
    __syncthreads();

    // 3. Online softmax, warp h for head h; lane l holds rows 2l, 2l + 1.
    {
      const int h = warp;
      float2 part[kGroups];
#pragma unroll
      for (int q = 0; q < kGroups; ++q) part[q] = *reinterpret_cast<const float2*>(&s.u.scores[q][h][2 * lane]);
      const float raw0 = (part[0].x + part[1].x) + (part[2].x + part[3].x);
      const float raw1 = (part[0].y + part[1].y) + (part[2].y + part[3].y);
      const int j0 = chunk * kChunkRows + 2 * lane;
      const bool valid0 = j0 < rows && s.row_slot[j0] >= 0, valid1 = j0 + 1 < rows && s.row_slot[j0 + 1] >= 0;
      const bool q_bad = s.q_bad[h] != 0;
      const float score0 = !valid0 ? -INFINITY : (q_bad || s.row_bad[2 * lane]) ? NAN : raw0 * score_scale;
      const float score1 = !valid1 ? -INFINITY : (q_bad || s.row_bad[2 * lane + 1]) ? NAN : raw1 * score_scale;
      const OnlineSoftmaxStep step = online_softmax_step(score0, score1, &s.run_max[h]);
      const float p0 = step.p0, p1 = step.p1;
      const float chunk_sum = warp_sum(p0 + p1);
#pragma unroll
      for (int q = 0; q < kGroups; ++q) {
        const float w0 = p0 * s.row_scale[2 * lane][q], w1 = p1 * s.row_scale[2 * lane + 1][q];
        float top = max_propagating_nan(fabsf(w0), fabsf(w1));
#pragma unroll
        for (int offset = 16; offset >= 1; offset /= 2) {
          top = max_propagating_nan(top, __shfl_xor_sync(0xFFFFFFFFu, top, offset));
        }
        // No weight (or NaN, which w carries anyway): 1. At least FLT_MIN, so
        // that the inverse stays finite (0 x inf would make NaN weights).
        const float group_max = top > 0.0f ? fmaxf(top, FLT_MIN) : 1.0f;
        const float inverse = num::div_rn(1.0f, group_max);
        *reinterpret_cast<__half2*>(&s.probs[q][h][2 * lane]) = __floats2half2_rn(w0 * inverse, w1 * inverse);
        if (lane == 0) s.group_max[q][h] = group_max;
      }
      online_softmax_commit(s, h, lane, step, chunk_sum);
    }
    __syncthreads();

    // 4. P.V for dims 32 warp.. (group pv_group) of the 16 heads.
    {
      float chunk_out[kDimTiles][kHeadTiles][4];
#pragma unroll
      for (int d = 0; d < kDimTiles; ++d)
#pragma unroll
        for (int t = 0; t < kHeadTiles; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) chunk_out[d][t][e] = 0.0f;
#pragma unroll
      for (int step = 0; step < kRowSteps; ++step) {
        uint32_t b[4], a[kDimTiles][4];
        ldmatrix_x4(b, shared_address(&s.probs[pv_group][(lane / 16) * 8 + lane % 8][step * 16 + ((lane / 8) % 2) * 8]));
        const int v_row = step * 16 + lane % 8 + (lane / 16) * 8;
#pragma unroll
        for (int d = 0; d < kDimTiles; ++d) {
          ldmatrix_x4_trans(a[d], tile_unit(tile, v_row, (warp * kDimsPerWarp + d * 16) / 8 + (lane / 8) % 2));
        }
#pragma unroll
        for (int d = 0; d < kDimTiles; ++d)
#pragma unroll
          for (int t = 0; t < kHeadTiles; ++t) mma_f16(chunk_out[d][t], a[d], b[2 * t], b[2 * t + 1]);
      }
#pragma unroll
      for (int t = 0; t < kHeadTiles; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int head = t * 8 + 2 * c + e;
          const float rescale = s.rescale[head], group_max = s.group_max[pv_group][head];
#pragma unroll
          for (int d = 0; d < kDimTiles; ++d) {
            out[d][t][e] = fmaf(chunk_out[d][t][e], group_max, out[d][t][e] * rescale);
            out[d][t][e + 2] = fmaf(chunk_out[d][t][e + 2], group_max, out[d][t][e + 2] * rescale);
          }
        }
      }
    }
  }
  async_copy_wait(0);  // only empty groups remain
  __syncthreads();     // every warp's P.V is done with the tile

  // This CTA's partial O [16][512] f32, relative to its run_max, over the tile.
  float(*partial)[kLatent] = reinterpret_cast<float(*)[kLatent]>(s.tile);
#pragma unroll
  for (int d = 0; d < kDimTiles; ++d) {
#pragma unroll
    for (int t = 0; t < kHeadTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        partial[t * 8 + 2 * c + e % 2][warp * kDimsPerWarp + d * 16 + g + (e / 2) * 8] = out[d][t][e];
      }
    }
  }
  __syncthreads();

  // Push: CTA k of the cluster combines the eight-dim vectors [k V / splits,
  // (k + 1) V / splits) of the group's V = 16 * 64; this CTA stores its
  // partial of those and its (max, sum) per head into CTA k's `incoming` and
  // `peer_*` rows for split `split`. After one cluster barrier every CTA
  // combines from its own shared memory only.
  auto first_vector_of = [&](int k) { return k * kVectors / splits; };
  cluster_wait();  // every peer has started
  for (int v = threadIdx.x; v < kVectors; v += kThreads) {
    int k = (v * splits) / kVectors;  // the combining CTA of vector v
    while (first_vector_of(k + 1) <= v) ++k;
    while (first_vector_of(k) > v) --k;
    const float4* source = reinterpret_cast<const float4*>(&partial[v / kVectorsPerHead][(v % kVectorsPerHead) * 8]);
    const int share_k = first_vector_of(k + 1) - first_vector_of(k);
    float4* target =
        reinterpret_cast<float4*>(cluster.map_shared_rank(s.incoming[split * share_k + v - first_vector_of(k)], k));
    target[0] = source[0];
    target[1] = source[1];
  }
  if (threadIdx.x < kHeads * splits) {
    const int k = threadIdx.x / kHeads, h = threadIdx.x % kHeads;
    *cluster.map_shared_rank(&s.peer_max[split][h], k) = s.run_max[h];
    *cluster.map_shared_rank(&s.peer_sum[split][h], k) = s.run_sum[h];
  }
  cluster_arrive_release();
  cluster_wait();

  // Combine this CTA's vectors over the splits, in split order.
  const int first_vector = first_vector_of(split), share = first_vector_of(split + 1) - first_vector;
  for (int i = threadIdx.x; i < share; i += kThreads) {
    const int v = first_vector + i;
    const int h = v / kVectorsPerHead, d0 = (v % kVectorsPerHead) * 8, head = first_head + h;
    if (head >= p.heads) continue;
    float total_max = -INFINITY;
    for (int r = 0; r < splits; ++r) total_max = max_propagating_nan(total_max, s.peer_max[r][h]);
    float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float total_sum = 0.0f;
    if (total_max != -INFINITY) {
      for (int r = 0; r < splits; ++r) {
        const float weight = exp2f(s.peer_max[r][h] - total_max);  // 0 for a split without valid entries
        total_sum = fmaf(s.peer_sum[r][h], weight, total_sum);
        const float* values = s.incoming[r * share + i];
#pragma unroll
        for (int e = 0; e < 8; ++e) total[e] = fmaf(values[e], weight, total[e]);
      }
    }
    // No valid entry: total_sum = 0 and the output is +0 (scale is never used).
    const float scale = total_max != -INFINITY ? num::div_rn(1.0f, total_sum) : 0.0f;
    uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      packed[e] = uint32_t(num::float_to_bf16(total[2 * e] * scale)) |
                  (uint32_t(num::float_to_bf16(total[2 * e + 1] * scale)) << 16);
    }
    *reinterpret_cast<uint4*>(p.latent + token * p.latent_token_stride + int64_t(head) * kLatent + d0) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
    if (d0 == 0) {
      p.lse[int64_t(token) * p.heads + head] = total_max != -INFINITY ? total_max * kLn2 + logf(total_sum) : -INFINITY;
    }
  }
}

// One CTA of 64 threads per token: thread i quantizes kv_c values 8i..8i + 7
// (group i / 16; the group's amax by four shuffles within its 16 lanes),
// threads 0..7 copy 16 bytes of k_pe each.
constexpr int kWriteThreads = kLatent / 8;
static_assert(kWriteThreads == 4 * 16, "16 lanes a group");

__global__ void __launch_bounds__(kWriteThreads) sparse_mla_v32_cache_write_kernel(const CacheWriteParams p) {
  pdl_wait();  // kv_c and k_pe come from the predecessor
  pdl_release_dependents();
  const int64_t token = blockIdx.x;
  if (token >= p.slots) return;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  if (slot >= p.capacity) {
    if (threadIdx.x == 0 && p.error_count != nullptr) atomicAdd(p.error_count, 1u);
    return;
  }
  const int64_t block = slot / p.block_size;
  uint8_t* entry = p.cache + block * p.cache_block_stride + (slot - block * p.block_size) * p.cache_entry_stride;
  const int i = threadIdx.x;
  const uint4 v = *reinterpret_cast<const uint4*>(p.kv_c + token * p.kv_c_stride + 8 * i);
  const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
  float amax = v32::bf16_abs(uint16_t(pairs[0]));
#pragma unroll
  for (int k = 1; k < 8; ++k) amax = fmaxf(amax, v32::bf16_abs(uint16_t(pairs[k / 2] >> (16 * (k % 2)))));
#pragma unroll
  for (int offset = 8; offset >= 1; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  const float scale = v32::group_scale(amax);
  uint32_t codes[2] = {0, 0};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    codes[k / 4] |= uint32_t(v32::group_code(uint16_t(pairs[k / 2] >> (16 * (k % 2))), scale)) << (8 * (k % 4));
  }
  *reinterpret_cast<uint2*>(entry + 8 * i) = make_uint2(codes[0], codes[1]);
  if (i % 16 == 0) *reinterpret_cast<float*>(entry + kSparseMlaV32ScaleOffset + 4 * (i / 16)) = scale;
  if (i < kSparseMlaV32Rope / 8) {
    *reinterpret_cast<uint4*>(entry + kSparseMlaV32RopeOffset + 16 * i) =
        *reinterpret_cast<const uint4*>(p.k_pe + token * p.k_pe_stride + 8 * i);
  }
}

Params make_params(const SparseMlaV32Args& a) {
  Params p = {};
  p.q = static_cast<const uint16_t*>(a.q.data);
  fill_paged_attention_params(p, a);
  return p;
}

Status prepare_kernel(int splits) {
  const void* kernel = reinterpret_cast<const void*>(sparse_mla_v32_kernel);
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(kernel, sizeof(SharedStorage), "sparse_mla_v32"));
  if (splits > 8) DSA_RETURN_IF_ERROR(allow_non_portable_clusters(kernel, "sparse_mla_v32"));
  return Status();
}

}  // namespace

Status sparse_mla_v32_launch(const SparseMlaV32Args& a, const SparseMlaV32Plan& plan, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(prepare_kernel(plan.splits));
  const dim3 grid(plan.splits, plan.head_groups, static_cast<unsigned>(a.q.size(0)));
  return launch_pdl_clustered(sparse_mla_v32_kernel, grid, dim3(kThreads), sizeof(SharedStorage), stream,
                              unsigned(plan.splits), make_params(a), plan.rows_per_split);
}

Status sparse_mla_v32_max_active_clusters(int splits, int* clusters) {
  const void* kernel = reinterpret_cast<const void*>(sparse_mla_v32_kernel);
  return kernel_answer_once(kernel, splits, [splits](int* answer) {
    // A part that cannot set this cluster size's attributes or answer for it
    // cannot launch it: 0, kept like any other answer.
    *answer = 0;
    if (!prepare_kernel(splits).ok()) {
      (void)cudaGetLastError();
      return Status();
    }
    if (occupancy_max_active_clusters(sparse_mla_v32_kernel, dim3(splits, 1, 1), dim3(kThreads), sizeof(SharedStorage),
                                      unsigned(splits), answer) != cudaSuccess) {
      (void)cudaGetLastError();
      *answer = 0;
    }
    return Status();
  }, clusters);
}

Status sparse_mla_v32_cache_write_launch(const SparseMlaV32CacheWriteArgs& a, cudaStream_t stream) {
  CacheWriteParams p = {};
  set_rows(p.kv_c, p.kv_c_stride, a.kv_c);
  set_rows(p.k_pe, p.k_pe_stride, a.k_pe);
  p.slot_mapping = static_cast<const int64_t*>(a.slot_mapping.data);
  p.slots = a.slot_mapping.size(0);
  p.cache = static_cast<uint8_t*>(a.kv_cache.data);
  p.cache_block_stride = a.kv_cache.stride(0);
  p.cache_entry_stride = a.kv_cache.stride(1);
  p.block_size = a.kv_cache.size(1);
  p.capacity = a.kv_cache.size(0) * p.block_size;
  p.error_count = a.error_count;
  return launch_pdl(sparse_mla_v32_cache_write_kernel, dim3(static_cast<unsigned>(a.kv_c.size(0))),
                    dim3(kWriteThreads), 0, stream, p);
}

}  // namespace dsa
