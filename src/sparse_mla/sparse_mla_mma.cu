// The 8-head tensor-core sparse MLA decode kernel (sparse_mla_mma), what
// sparse_mla runs when H is not a multiple of 64 (TP8: H = 8), and the
// dispatch between it and the 64-head kernel (sparse_mla_wgmma.cu). The
// contract is in include/dsa_decode/sparse_mla.h; the design and the
// measurements in docs/sparse_mla.md.
//
// Work split (SparseMlaSplitPlan): CTA (split, group, token) of 16 warps
// owns the 8 heads 8 group.. of one token (one 8-wide MMA tile) and one run
// of rows_per_split (<= 2048) entries of its index row, taken in chunks of 64
// entries. The `splits` CTAs of a (token, group) form one thread-block
// cluster.
//
// Prologue: the run's indices are read once (coalesced, the out-of-range ones
// counted) and their cache row offsets go to shared memory (-1 for invalid
// entries), then the cache rows of the first kStages - 1 chunks are requested
// (cp.async, 16 bytes per thread and request, zeros for invalid entries) into
// a ring of kStages FP8 chunk buffers.
//
// Per chunk, four phases separated by CTA barriers:
//  1. convert: once the chunk's copies have landed, warp w converts rows w,
//     w + 16, w + 32, w + 48 of the chunk buffer to FP16 (e4m3 converts to
//     f16 exactly) into `tile` [64 rows][512]; then the rows of the chunk
//     kStages - 1 ahead are requested into the buffer just freed.
//  2. scores: warp w computes the partial S^T[16 rows][8 heads] of rows
//     16 (w % 4).. over dims quarter w / 4 (128 dims, 8 MMA steps): mma
//     m16n8k16, A = tile rows through ldmatrix, B = q from registers, FP32
//     accumulators, four of them (step s goes to s % 4) so that four MMAs are
//     in flight; part = (acc0 + acc1) + (acc2 + acc3).
//  3. softmax: warp h < 8 owns head h; lane l rows 2l, 2l + 1. Score =
//     ((part0 + part1) + (part2 + part3)) * softmax_scale * q_scale * k_scale
//     * log2(e) (-inf for invalid entries); chunk max over the lanes (NaN
//     propagates), running max, p = 2^(score - max) rounded to FP16 into
//     `probs`, the sum of the rounded p (butterfly over the lanes) into the
//     running sum.
//  4. P.V: warp w owns dims 32 w..32 w + 31 of the 8 heads: rescales its
//     accumulators, then O^T[dims][heads] += V^T[dims][rows] P^T[rows][heads]
//     (A = tile through ldmatrix.trans, B = probs), FP32 accumulators.
// After the last chunk, CTA r of the cluster pushes its unnormalized partial
// O [8][512] f32 and its (max, sum) per head to the CTAs that combine them:
// CTA k combines vectors [k V / splits, (k + 1) V / splits) of the V = 8 * 64
// eight-dim vectors of the group, so CTA r stores each of its partial vectors
// into the shared memory of the vector's CTA (distributed shared memory,
// stores only). After one cluster barrier, each CTA weighs every split's
// partial by 2^(split max - max), adds them in split order from its own
// shared memory, and writes latent (times k_scale / sum) and lse.
//
// Every sum has a fixed order that depends only on K, H and the entry
// positions: the same inputs give the same bits, for any m.
#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/cluster.cuh"
#include "core/fp8.cuh"
#include "core/launch.cuh"
#include "core/mma.cuh"
#include "core/shared_memory.h"
#include "dsa_decode/numerics.h"
#include "sparse_mla/sparse_mla_params.h"
#include "sparse_mla/sparse_mla_plan.h"

namespace dsa {
namespace {

namespace cg = cooperative_groups;

constexpr int kLatent = kSparseMlaLatent;
constexpr int kHeads = 8;  // heads per CTA: one MMA tile
constexpr int kChunkRows = 64;
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;                         // FP8 chunk buffers: two chunks in flight while one is used
constexpr int kMaxRowsPerSplit = kSparseMlaMaxTopK / 8;  // indices staged per CTA
constexpr int kRowsPerWarp = kChunkRows / kWarps;  // converted rows per warp and chunk
constexpr int kScoreParts = kWarps / 4;            // dims quarters: four warps per 16-row MMA tile
constexpr int kScoreSteps = kLatent / 16 / kScoreParts;  // 16-dim MMA steps per score warp
constexpr int kDimsPerWarp = kLatent / kWarps;     // P.V dims per warp
constexpr int kDimTiles = kDimsPerWarp / 16;       // P.V MMA tiles per warp
constexpr int kRowSteps = kChunkRows / 16;         // P.V MMA steps per chunk
constexpr int kScoreStride = kChunkRows + 4;       // floats: conflict-free score stores
constexpr int kProbStride = kChunkRows + 8;        // halves: 144-byte rows, 16-byte aligned, conflict-free ldmatrix
static_assert(kScoreSteps % 4 == 0 && kDimTiles == 2, "the work split below");

struct SharedStorage {
  // [64 rows][512 dims] FP16 of the chunk; 16-byte unit u of row r is stored
  // at unit u ^ (r % 8), so that ldmatrix (8 rows at one unit, or one row's
  // 8 units) touches all 32 banks once. After the last chunk: the CTA's
  // partial O [8][512] f32.
  uint4 tile[kChunkRows * kLatent * 2 / 16];
  float scores[kScoreParts][kHeads][kScoreStride];  // [dims quarter][head][chunk row], raw partial S
  __half probs[kHeads][kProbStride];                // [head][chunk row], 2^(score - running max)
  float run_max[kHeads], run_sum[kHeads], rescale[kHeads];
  // What the cluster's CTAs push for this CTA's combine: per split, (max,
  // sum) per head and the partial O of this CTA's share of the group's 512
  // eight-dim vectors. Peers write here once they leave their chunk loop,
  // while this CTA may still be in its own, so nothing else lives here.
  float peer_max[kSparseMlaMaxSplits][kHeads], peer_sum[kSparseMlaMaxSplits][kHeads];
  // incoming[r * share + i]: split r's partial of this CTA's vector i (share = this CTA's vector count).
  alignas(16) float incoming[kHeads * kLatent / 8 + kSparseMlaMaxSplits][8];
  alignas(16) uint8_t q[kHeads][kLatent];  // the group's q codes, zero for heads >= H
  uint4 stage[kStages][kChunkRows * kLatent / 16];  // FP8 codes of chunk c in stage c % kStages, rows in order
  int64_t row_offset[kMaxRowsPerSplit];             // byte offset of each entry's cache row, -1 when invalid
};
static_assert(sizeof(float) * kHeads * kLatent <= sizeof(SharedStorage::tile), "the partial O fits in the tile");

// Byte address of 16-byte unit `unit` (0..63) of tile row `row`.
__device__ __forceinline__ uint32_t tile_unit(uint32_t tile, int row, int unit) {
  return swizzled_tile_unit<kLatent * 2>(tile, row, unit);
}

__global__ void __launch_bounds__(kThreads) sparse_mla_mma_kernel(const SparseMlaParams p, const int rows_per_split) {
  extern __shared__ uint4 shared_raw[];
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(shared_raw);
  const cg::cluster_group cluster = cg::this_cluster();

  const int split = blockIdx.x, splits = gridDim.x, group = blockIdx.y, token = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;  // MMA fragment coordinates: row group, column pair
  const int first_head = group * kHeads;
  const uint32_t tile = shared_address(s.tile);
  cluster_arrive_relaxed();  // this CTA has started (see the push below)

  // Every input is written by a predecessor in the decode chain (absorb, cache write, indexer).
  pdl_wait();
  pdl_release_dependents();

  const int32_t* index_row = p.indices + token * p.indices_token_stride;
  const int row_begin = split * rows_per_split;
  const int row_end = min(p.top_k, row_begin + rows_per_split);
  const int chunks = (row_end - row_begin + kChunkRows - 1) / kChunkRows;

  const int rows = row_end - row_begin;
  unsigned int out_of_range = 0;
  for (int j = threadIdx.x; j < rows; j += kThreads) {
    const int32_t slot = index_row[row_begin + j];
    s.row_offset[j] = sparse_mla_row_offset(p, slot);
    out_of_range += slot >= p.capacity;
  }
  if (group == 0) count_out_of_range(p, out_of_range, lane);
  if (threadIdx.x < kHeads * (kLatent / 16)) {
    const int h = threadIdx.x / (kLatent / 16), unit = threadIdx.x % (kLatent / 16);
    uint4 codes = make_uint4(0, 0, 0, 0);
    if (first_head + h < p.heads) {
      codes = *reinterpret_cast<const uint4*>(p.q + token * p.q_token_stride + (first_head + h) * p.q_head_stride +
                                              unit * 16);
    }
    reinterpret_cast<uint4*>(s.q[h])[unit] = codes;
  }
  if (threadIdx.x < kHeads) {
    s.run_max[threadIdx.x] = -INFINITY;
    s.run_sum[threadIdx.x] = 0.0f;
  }
  __syncthreads();  // indices and q staged

  // Requests chunk `chunk`'s rows into its stage (an empty group past the last
  // chunk keeps the group count uniform): thread t copies 16-byte unit t % 32
  // of rows t / 32 + 16 i.
  auto request = [&](int chunk) {
    if (chunk < chunks) {
      const uint32_t stage = shared_address(s.stage[chunk % kStages]);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp + kWarps * i, j = chunk * kChunkRows + row;
        const int64_t offset = j < rows ? s.row_offset[j] : -1;
        async_copy_16_or_zero(stage + row * kLatent + lane * 16, p.cache + (offset >= 0 ? offset + lane * 16 : 0), offset >= 0);
      }
    }
    async_copy_commit();
  };
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) request(c);

  // Score role (phase 2): rows 16 (warp % 4).., dims quarter warp / 4.
  const int score_part = warp / 4, score_row = (warp % 4) * 16, first_step = score_part * kScoreSteps;
  uint32_t q_fragment[kScoreSteps];  // per 16-dim step, the B fragment's e4m3 pairs: low dims 2c.., high 8 + 2c..
#pragma unroll
  for (int step = 0; step < kScoreSteps; ++step) {
    const uint8_t* q_row = s.q[g] + (first_step + step) * 16 + 2 * c;
    q_fragment[step] = *reinterpret_cast<const uint16_t*>(q_row) |
                       (uint32_t(*reinterpret_cast<const uint16_t*>(q_row + 8)) << 16);
  }
  const float score_scale = p.softmax_scale * *p.q_scale * *p.k_scale * kLog2e;

  float out[kDimTiles][4];  // O^T: dims 32 warp + 16 t + (g, g + 8), heads 2c (+1)
#pragma unroll
  for (int t = 0; t < kDimTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[t][e] = 0.0f;

  for (int chunk = 0; chunk < chunks; ++chunk) {
    // 1. Convert (the previous chunk's readers of `tile` passed the barrier below).
    async_copy_wait(kStages - 2);
    __syncthreads();
    // Lane l converts dims 8l.. and 256 + 8l.. of each row: whole 512-byte
    // spans of the tile per store, no bank conflicts.
    const uint2* stage = reinterpret_cast<const uint2*>(s.stage[chunk % kStages]);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int row = warp + kWarps * i;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint2 codes = stage[row * (kLatent / 8) + half * 32 + lane];
        store_shared(tile_unit(tile, row, half * 32 + lane),
                     make_uint4(e4m3x2_to_f16x2(codes.x), e4m3x2_to_f16x2(codes.x >> 16), e4m3x2_to_f16x2(codes.y),
                                e4m3x2_to_f16x2(codes.y >> 16)));
      }
    }
    __syncthreads();
    request(chunk + kStages - 1);  // into the stage converted one chunk ago

    // 2. Partial scores of 16 rows x 8 heads over one dims quarter per warp.
    {
      float acc[4][4] = {};
      const int a_row = score_row + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int step = 0; step < kScoreSteps; step += 4) {
        uint32_t a[4][4];
#pragma unroll
        for (int u = 0; u < 4; ++u) ldmatrix_x4(a[u], tile_unit(tile, a_row, 2 * (first_step + step + u) + lane / 16));
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          mma_f16(acc[u], a[u], e4m3x2_to_f16x2(q_fragment[step + u]), e4m3x2_to_f16x2(q_fragment[step + u] >> 16));
        }
      }
      const int row0 = score_row + g;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s.scores[score_part][2 * c + e % 2][row0 + (e / 2) * 8] = (acc[0][e] + acc[1][e]) + (acc[2][e] + acc[3][e]);
      }
    }
    __syncthreads();

    // 3. Online softmax, warp h < 8 for head h; lane l holds rows 2l, 2l + 1.
    if (warp < kHeads) {
      const int h = warp;
      float2 part[kScoreParts];
#pragma unroll
      for (int q = 0; q < kScoreParts; ++q) part[q] = *reinterpret_cast<const float2*>(&s.scores[q][h][2 * lane]);
      const float raw0 = (part[0].x + part[1].x) + (part[2].x + part[3].x);
      const float raw1 = (part[0].y + part[1].y) + (part[2].y + part[3].y);
      auto valid = [&](int row) {
        const int j = chunk * kChunkRows + row;
        return j < rows && s.row_offset[j] >= 0;
      };
      const float score0 = valid(2 * lane) ? raw0 * score_scale : -INFINITY;
      const float score1 = valid(2 * lane + 1) ? raw1 * score_scale : -INFINITY;
      const OnlineSoftmaxStep step = online_softmax_step(score0, score1, &s.run_max[h]);
      const __half2 probs = __floats2half2_rn(step.p0, step.p1);
      *reinterpret_cast<__half2*>(&s.probs[h][2 * lane]) = probs;
      const float2 rounded = __half22float2(probs);
      online_softmax_commit(s, h, lane, step, warp_sum(rounded.x + rounded.y));  // the sum of the rounded p
    }
    __syncthreads();

    // 4. P.V for dims 32 warp.. of the 8 heads.
    {
      const float rescale0 = s.rescale[2 * c], rescale1 = s.rescale[2 * c + 1];
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        out[t][0] *= rescale0;
        out[t][1] *= rescale1;
        out[t][2] *= rescale0;
        out[t][3] *= rescale1;
      }
    }
#pragma unroll
    for (int step = 0; step < kRowSteps; ++step) {
      uint32_t b[2], a[kDimTiles][4];
      ldmatrix_x2(b, shared_address(&s.probs[lane % 8][step * 16 + ((lane / 8) % 2) * 8]));
      const int v_row = step * 16 + lane % 8 + (lane / 16) * 8;
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) {
        ldmatrix_x4_trans(a[t], tile_unit(tile, v_row, (warp * kDimsPerWarp + t * 16) / 8 + (lane / 8) % 2));
      }
#pragma unroll
      for (int t = 0; t < kDimTiles; ++t) mma_f16(out[t], a[t], b[0], b[1]);
    }
  }
  async_copy_wait(0);  // only empty groups remain
  __syncthreads();       // every warp's P.V is done with the tile

  // This CTA's partial O [8][512] f32, relative to its run_max, over the tile.
  float(*partial)[kLatent] = reinterpret_cast<float(*)[kLatent]>(s.tile);
#pragma unroll
  for (int t = 0; t < kDimTiles; ++t) {
    const int d = warp * kDimsPerWarp + t * 16 + g;
    partial[2 * c][d] = out[t][0];
    partial[2 * c + 1][d] = out[t][1];
    partial[2 * c][d + 8] = out[t][2];
    partial[2 * c + 1][d + 8] = out[t][3];
  }
  __syncthreads();

  // Push: CTA k of the cluster combines the eight-dim vectors [k V / splits,
  // (k + 1) V / splits) of the group's V = 8 * 64; this CTA stores its partial
  // of those vectors and its (max, sum) per head into CTA k's `incoming` and
  // `peer_*` rows for split `split` (distributed shared memory, stores only).
  // After one cluster barrier every CTA combines from its own shared memory,
  // and no CTA reads another's memory after the barrier.
  constexpr int kVectorsPerHead = kLatent / 8, kVectors = kHeads * kVectorsPerHead;
  auto first_vector_of = [&](int k) { return k * kVectors / splits; };
  cluster_wait();  // every peer has started
  for (int v = threadIdx.x; v < kVectors; v += kThreads) {
    int k = (v * splits) / kVectors;  // the combining CTA of vector v
    while (first_vector_of(k + 1) <= v) ++k;
    while (first_vector_of(k) > v) --k;
    const float4* source = reinterpret_cast<const float4*>(&partial[v / kVectorsPerHead][(v % kVectorsPerHead) * 8]);
    const int share_k = first_vector_of(k + 1) - first_vector_of(k);
    float4* target = reinterpret_cast<float4*>(
        cluster.map_shared_rank(s.incoming[split * share_k + v - first_vector_of(k)], k));
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
  if (threadIdx.x < share) {
    const int v = first_vector + threadIdx.x;
    const int h = v / kVectorsPerHead, d0 = (v % kVectorsPerHead) * 8, head = first_head + h;
    if (head < p.heads) {
      float total_max = -INFINITY;
      for (int r = 0; r < splits; ++r) total_max = max_propagating_nan(total_max, s.peer_max[r][h]);
      float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      float total_sum = 0.0f;
      if (total_max != -INFINITY) {
        for (int r = 0; r < splits; ++r) {
          const float weight = exp2f(s.peer_max[r][h] - total_max);  // 0 for a split without valid entries
          total_sum = fmaf(s.peer_sum[r][h], weight, total_sum);
          const float* values = s.incoming[r * share + threadIdx.x];
#pragma unroll
          for (int e = 0; e < 8; ++e) total[e] = fmaf(values[e], weight, total[e]);
        }
      }
      // No valid entry: total_sum = 0 and the output is +0 (scale is never used).
      const float scale = total_max != -INFINITY ? num::div_rn(*p.k_scale, total_sum) : 0.0f;
      uint32_t packed[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        packed[e] = uint32_t(num::float_to_bf16(total[2 * e] * scale)) |
                    (uint32_t(num::float_to_bf16(total[2 * e + 1] * scale)) << 16);
      }
      *reinterpret_cast<uint4*>(p.latent + token * p.latent_token_stride + int64_t(head) * kLatent + d0) =
          make_uint4(packed[0], packed[1], packed[2], packed[3]);
      if (d0 == 0) {
        p.lse[int64_t(token) * p.heads + head] =
            total_max != -INFINITY ? total_max * kLn2 + logf(total_sum) : -INFINITY;
      }
    }
  }
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

Status prepare_kernel(unsigned cluster) {
  const void* kernel = reinterpret_cast<const void*>(sparse_mla_mma_kernel);
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(kernel, sizeof(SharedStorage), "sparse_mla"));
  if (cluster > 8) DSA_RETURN_IF_ERROR(allow_non_portable_clusters(kernel, "sparse_mla"));
  return Status();
}

// H and K within check_sparse_mla's ranges. The message is only built on an error.
Status check_plan(const SparseMlaSplitPlan& plan, int heads, int top_k) {
  const bool groups_ok = plan.head_groups == ceil_div(heads, kHeads);
  const bool rows_ok = plan.rows_per_split >= kChunkRows && plan.rows_per_split % kChunkRows == 0 &&
                       plan.rows_per_split <= kMaxRowsPerSplit;
  const bool splits_ok = rows_ok && plan.splits >= 1 && plan.splits <= kSparseMlaMaxSplits &&
                         plan.splits == ceil_div(top_k, plan.rows_per_split);
  if (groups_ok && rows_ok && splits_ok) return Status();
  const std::string given = "head_groups " + std::to_string(plan.head_groups) + ", splits " +
                            std::to_string(plan.splits) + ", rows_per_split " + std::to_string(plan.rows_per_split);
  if (!groups_ok) {
    return invalid_argument("plan", "head_groups = ceil(H / 8) = " + std::to_string(ceil_div(heads, kHeads)), given);
  }
  if (!rows_ok) {
    return invalid_argument("plan", "rows_per_split a multiple of 64 in 64.." + std::to_string(kMaxRowsPerSplit),
                            given);
  }
  return invalid_argument("plan",
                          "1.." + std::to_string(kSparseMlaMaxSplits) +
                              " splits, each with at least one of the K = " + std::to_string(top_k) + " entries",
                          given);
}

// `a` passed check_sparse_mla and `plan` check_plan.
Status launch(const SparseMlaArgs& a, const SparseMlaSplitPlan& plan, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(prepare_kernel(plan.splits));
  const dim3 grid(plan.splits, plan.head_groups, static_cast<unsigned>(a.q.size(0)));
  return launch_pdl_clustered(sparse_mla_mma_kernel, grid, dim3(kThreads), sizeof(SharedStorage), stream,
                              unsigned(plan.splits), sparse_mla_params(a), plan.rows_per_split);
}

// At most `max_splits` CTAs per (token, group) of whole 64-entry chunks, or
// as many as keep a CTA's entries within what it stages.
SparseMlaSplitPlan plan_with_max_splits(int heads, int top_k, int max_splits) {
  SparseMlaSplitPlan plan;
  plan.head_groups = ceil_div(heads, kHeads);
  const int splits = std::max(std::min(max_splits, ceil_div(top_k, kChunkRows)), ceil_div(top_k, kMaxRowsPerSplit));
  plan.rows_per_split = ceil_div(ceil_div(top_k, splits), kChunkRows) * kChunkRows;
  plan.splits = ceil_div(top_k, plan.rows_per_split);
  return plan;
}

// kLatency's cap: eight splits, the portable cluster size (any Hopper part
// schedules it). kByBatch's first plan takes up to twice as many.
constexpr int kPlanMaxSplits = 8;
static_assert(2 * kPlanMaxSplits <= kSparseMlaMaxSplits, "kByBatch's first plan within the largest cluster");

}  // namespace

SparseMlaSplitPlan sparse_mla_split_plan(int heads, int top_k, SparseMlaSplits choice) {
  // kThroughput: half of kLatency's splits. kByBatch: kLatency's here; its
  // launch picks among sparse_mla_batch_split_plans. kWholeRow (whose
  // producer kernel needs 64 heads): kThroughput's.
  const bool half = choice == SparseMlaSplits::kThroughput || choice == SparseMlaSplits::kWholeRow;
  return plan_with_max_splits(heads, top_k, half ? kPlanMaxSplits / 2 : kPlanMaxSplits);
}

std::array<SparseMlaSplitPlan, 3> sparse_mla_batch_split_plans(int heads, int top_k) {
  return {plan_with_max_splits(heads, top_k, 2 * kPlanMaxSplits), sparse_mla_split_plan(heads, top_k),
          sparse_mla_split_plan(heads, top_k, SparseMlaSplits::kThroughput)};
}

Status sparse_mla_with_plan(const SparseMlaArgs& a, const SparseMlaSplitPlan& plan, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sparse_mla(a));
  DSA_RETURN_IF_ERROR(check_plan(plan, static_cast<int>(a.q.size(1)), static_cast<int>(a.indices.size(1))));
  return launch(a, plan, stream);
}

Status sparse_mla_max_active_clusters(const SparseMlaSplitPlan& plan, int heads, int top_k, int* clusters) {
  if (heads < 1 || heads > kSparseMlaMaxHeads || top_k < 1 || top_k > kSparseMlaMaxTopK) {
    return invalid_argument("heads, top_k",
                            "1.." + std::to_string(kSparseMlaMaxHeads) + " and 1.." + std::to_string(kSparseMlaMaxTopK),
                            std::to_string(heads) + ", " + std::to_string(top_k));
  }
  DSA_RETURN_IF_ERROR(check_plan(plan, heads, top_k));
  // A part that cannot set this cluster size's attributes or answer for it
  // cannot launch the plan: 0, an answer like any other (kernel_answer_once
  // keeps it, so it is not asked again on every launch).
  *clusters = 0;
  if (!prepare_kernel(plan.splits).ok()) {
    (void)cudaGetLastError();
    return Status();
  }
  if (occupancy_max_active_clusters(sparse_mla_mma_kernel, dim3(plan.splits, plan.head_groups, 1), dim3(kThreads),
                                    sizeof(SharedStorage), unsigned(plan.splits), clusters) != cudaSuccess) {
    (void)cudaGetLastError();
    *clusters = 0;
  }
  return Status();
}

// `a` passed check_sparse_mla and `plan` is sparse_mla_split_plan's or one of
// sparse_mla_batch_split_plans (sparse_mla.cpp's choice).
Status sparse_mla_mma_launch(const SparseMlaArgs& a, const SparseMlaSplitPlan& plan, cudaStream_t stream) {
  return launch(a, plan, stream);
}

}  // namespace dsa
