// Steps both 64-head warpgroup-MMA kernels run the same way
// (sparse_mla_wgmma.cu, sparse_mla_producer.cu): a chunk's FP8 rows (or q's)
// converted into a K-major FP16 tile, and warpgroup 0's online-softmax step
// of one 64-entry chunk for 64 heads. S [64 heads x 64 entries] is in the
// m64n64 wgmma accumulator layout (element e of thread (warp, lane): head 16
// warp + g + 8 ((e / 2) % 2), entry 8 (e / 4) + 2 c + e % 2, with g = lane /
// 4, c = lane % 4), so the quad of lanes c = 0..3 holds a head's 64 entries.
#pragma once

#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "core/async_copy.cuh"
#include "core/fp8.cuh"
#include "core/wgmma.cuh"
#include "dsa_decode/sparse_mla.h"

namespace dsa::sparse_mla_steps {

// A chunk (or q) as 16-byte FP8 pieces: 64 rows of 512 dims, 32 pieces a row.
inline constexpr int kRows = 64;
inline constexpr int kLatent = kSparseMlaLatent;
inline constexpr int kHeads = 64;       // heads per CTA: the M of every wgmma
inline constexpr int kChunkRows = kRows;  // entries per chunk
inline constexpr int kChunkPieces = kRows * 32;
inline constexpr int kPanelBytes = kRows * 128;  // 64 rows x 64 FP16 dims, one 128-byte swizzle panel
inline constexpr int kTileBytes = 8 * kPanelBytes;  // 64 rows x 512 FP16 dims
inline constexpr int kPTileBytes = kHeads * kChunkRows * 2;  // P [64 heads][64 entries] FP16, one panel
inline constexpr uint32_t kNoRow = 0xFFFFFFFFu;     // a row offset / 16 (row_offset16) of an invalid entry

// The first members of both kernels' shared storage (their SharedStorage
// derives from it, 1024-byte aligned): the tiles and warpgroup 0's hand-off
// to warpgroup 1. The n-th chunk of the CTA uses slot n % 2.
struct TileStorage {
  uint8_t q_tile[kTileBytes];       // [8 panels][64 heads][128 B]: FP16 q of the group
  uint8_t tiles[2][kTileBytes];     // [8 panels][64 entries][128 B]: FP16 rows of the chunk
  uint8_t p_tiles[2][kPTileBytes];  // [64 heads][128 B], K-major swizzled: P of the chunk
  float rescale[2][kHeads];         // [slot][head]: the chunk's rescale of the running O
  float final_max[kHeads], final_sum[kHeads];  // after the loop: warpgroup 0's running max and sum per head
};
static_assert(offsetof(TileStorage, p_tiles) % 1024 == 0, "P tiles start on swizzle atoms");
static_assert(sizeof(TileStorage) % 8 == 0, "the derived storage's members follow without padding");

// Sets bit j % 64 of valid_rows[j / 64] where entry j is valid, for the 32
// consecutive entries of a warp (j this lane's; one ballot, one atomic).
__device__ __forceinline__ void mark_valid_rows(uint64_t* valid_rows, int j, bool valid, int lane) {
  const unsigned int ballot = __ballot_sync(0xFFFFFFFFu, valid);
  if (lane == 0 && ballot != 0) {
    atomicOr(reinterpret_cast<unsigned long long*>(&valid_rows[j / kRows]), static_cast<unsigned long long>(ballot)
                                                                                << (j % kRows));
  }
}

// The chunks with a valid entry among the first `chunks` (at most 64), bit
// n for chunk n: two ballots over valid_rows (a 64-bit row mask per chunk),
// so that every lane of every warp has them.
__device__ __forceinline__ uint64_t listed_chunks(const uint64_t* valid_rows, int chunks, int lane) {
  const bool low_listed = lane < chunks && valid_rows[lane] != 0;
  const bool high_listed = lane + 32 < chunks && valid_rows[lane + 32] != 0;
  return uint64_t(__ballot_sync(0xFFFFFFFFu, low_listed)) | (uint64_t(__ballot_sync(0xFFFFFFFFu, high_listed)) << 32);
}

// Chunk `chunk`'s place in the list of `listed` (the listed chunks before it).
__device__ __forceinline__ int listed_before(uint64_t listed, int chunk) {
  return __popcll(listed & ((uint64_t(1) << chunk) - 1));
}

// The pieces thread t of `kConverters` (128 or 256) converts: piece t % 32
// (dims 16 (t % 32)..) of rows t / 32 + (kConverters / 32) k, k =
// 0..kChunkPieces / kConverters - 1.
template <int kConverters>
__device__ __forceinline__ int piece_row(int k) {
  static_assert(kConverters == 128 || kConverters == 256, "a warpgroup or the whole CTA converts");
  return (threadIdx.x % kConverters) / 32 + (kConverters / 32) * k;
}

// Writes this thread's pieces (FP8 codes) as FP16 into `tile` (8 panels of 64
// dims, K-major, 128-byte swizzle): piece j of a row is 16-byte slots 2 (j %
// 4) and 2 (j % 4) + 1 of the row's 128 bytes in panel j / 4. Odd panels
// store their second slot first: panels lie 8 KiB apart (the same banks),
// and so the 32 lanes of a store cover all 8 slot positions four times, the
// least a 512-byte warp store can take.
template <int kConverters>
__device__ __forceinline__ void store_pieces_as_f16(const uint4 (&codes)[kChunkPieces / kConverters], uint32_t tile) {
  const int piece = threadIdx.x % 32, panel = piece / 4, first_slot = (piece % 4) * 2;
  const bool swap = panel % 2 == 1;
  const uint32_t panel_base = tile + panel * kPanelBytes;
#pragma unroll
  for (int k = 0; k < kChunkPieces / kConverters; ++k) {
    const int row = piece_row<kConverters>(k);
    const uint4 low = make_uint4(e4m3x2_to_f16x2(codes[k].x), e4m3x2_to_f16x2(codes[k].x >> 16),
                                 e4m3x2_to_f16x2(codes[k].y), e4m3x2_to_f16x2(codes[k].y >> 16));
    const uint4 high = make_uint4(e4m3x2_to_f16x2(codes[k].z), e4m3x2_to_f16x2(codes[k].z >> 16),
                                  e4m3x2_to_f16x2(codes[k].w), e4m3x2_to_f16x2(codes[k].w >> 16));
    store_shared(panel_base + wgmma::k_major_sw128_offset(row, first_slot + swap), swap ? high : low);
    store_shared(panel_base + wgmma::k_major_sw128_offset(row, first_slot + !swap), swap ? low : high);
  }
}

// 2^x by the MUFU alone, results below 2^-126 flushed to zero: exp2f without
// its subnormal fix-up. The probabilities are rounded to FP16 (which has no
// values that small) and a rescale below 2^-126 multiplies a sum by a
// negligible amount either way.
__device__ __forceinline__ float exp2_flush(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The larger of a and b, NaN when either is NaN, in one instruction (a
// compare, a NaN test and a select otherwise).
__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// Scores in log2 units (S * score_scale, -inf for invalid entries: bit r of
// `valid_rows` is entry r), the chunk's max folded into `run_max` (NaN
// propagates), and per head row r = 0, 1 of the thread: `base[r]`, the
// exponent's origin (the new running max, 0 where it is -inf: every chunk
// handed here has a valid entry, so the fallback only keeps -inf - -inf out
// of exp2 for scores beyond the contract's bound), and `rescale[r]`, the
// factor of the running O and sum.
__device__ __forceinline__ void scale_and_fold_max(float (&score)[32], uint64_t valid_rows, float score_scale, int c,
                                                   float (&run_max)[2], float (&base)[2], float (&rescale)[2]) {
  const uint64_t valid = valid_rows >> (2 * c);  // bit 8 j + b: entry 8 j + 2 c + b (constant shifts below)
  float chunk_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int e = 0; e < 32; ++e) {
    score[e] = (valid >> (8 * (e / 4) + e % 2)) & 1 ? score[e] * score_scale : -INFINITY;
    chunk_max[(e / 2) % 2] = max_nan(chunk_max[(e / 2) % 2], score[e]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int offset = 1; offset <= 2; offset *= 2) {
      chunk_max[r] = max_nan(chunk_max[r], __shfl_xor_sync(0xFFFFFFFFu, chunk_max[r], offset));
    }
    const float new_max = max_nan(run_max[r], chunk_max[r]);
    base[r] = new_max == -INFINITY ? 0.0f : new_max;
    rescale[r] = exp2_flush(run_max[r] - base[r]);
    run_max[r] = new_max;
  }
}

// p = 2^(score - base) rounded to FP16: as the A fragments of O_left's four
// 16-entry steps (pair q of step t holds score elements 8 t + 2 q, + 1,
// head row q % 2) and into the K-major swizzled P tile [64 heads][64
// entries] at `p_tile` for warpgroup 1. `chunk_sum[r]`: the quad's sum of
// the rounded p of head row r (summed over the quad's lanes, in the order
// the shuffles give).
__device__ __forceinline__ void round_and_store_probabilities(const float (&score)[32], const float (&base)[2],
                                                              uint32_t p_tile, int warp, int g, int c,
                                                              uint32_t (&fragments)[4][4], float (&chunk_sum)[2]) {
  chunk_sum[0] = chunk_sum[1] = 0.0f;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
#pragma unroll
    for (int pair = 0; pair < 4; ++pair) {
      const int r = pair % 2, e = 8 * t + 2 * pair;
      const __half2 probs = __floats2half2_rn(exp2_flush(score[e] - base[r]), exp2_flush(score[e + 1] - base[r]));
      fragments[t][pair] = *reinterpret_cast<const uint32_t*>(&probs);
      const float2 rounded = __half22float2(probs);
      chunk_sum[r] += rounded.x + rounded.y;
      store_shared_b32(p_tile + wgmma::k_major_sw128_offset(16 * warp + g + 8 * r, e / 4) + 4 * c, fragments[t][pair]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int offset = 1; offset <= 2; offset *= 2) chunk_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, chunk_sum[r], offset);
  }
}

// round_and_store_probabilities, then the chunk folded into the running
// sums (run_sum[r] = run_sum[r] rescale[r] + the chunk's sum) and each head
// row's rescale stored at rescale_row[head] (by lanes c = 0) for warpgroup 1.
__device__ __forceinline__ void store_probabilities_and_sums(const float (&score)[32], const float (&base)[2],
                                                             const float (&rescale)[2], uint32_t p_tile,
                                                             float* rescale_row, int warp, int g, int c,
                                                             uint32_t (&fragments)[4][4], float (&run_sum)[2]) {
  float chunk_sum[2];
  round_and_store_probabilities(score, base, p_tile, warp, g, c, fragments, chunk_sum);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    run_sum[r] = fmaf(run_sum[r], rescale[r], chunk_sum[r]);
    if (c == 0) rescale_row[16 * warp + g + 8 * r] = rescale[r];
  }
}

}  // namespace dsa::sparse_mla_steps
