// The select step's kernels and their launches (indexer.h, steps 5-8),
// shared by indexer_select.cu and the benchmark's probes and baseline
// (bench/indexer_select_baseline.cu). Internal linkage: each including
// translation unit gets its own copy.
//
// The indexer's select step on the GPU (include/dsa_decode/indexer.h, steps
// 5-8): logits over the request's complete pools, top K / S pools, expansion
// to token columns plus the tail and -1 padding, remap through the block
// table. The logits kernel is instantiated per head count H (its MMA tiles and
// shared memory); the pool size S and top-k K are run-time values.
//
// Fused path (indexer_select), two PDL launches:
//   1. logits_kernel: CTA (chunk, t) scores pools 64 chunk .. 64 chunk + 63 of
//      token t into workspace.logits[t, :]. Each head's dot is exact (FP64
//      tensor-core MMA of decoded e4m3 values: every partial sum is a multiple
//      of 2^-18 below 2^25, exact in double in any order), rounded to FP32
//      once, then the reference's FP32 order: ReLU, acc = fma(w'[h], relu,
//      acc) for h = 0..H-1 from +0, times the pool's scale. So the logits equal
//      the reference's. With plan.logits = kFp32Accumulation the dots run on
//      the FP16 tensor cores instead (e4m3 -> FP16 exactly, FP32
//      accumulators), the rest unchanged.
//   2. select_rows_kernel: one CTA per token. Radix select on the order key of
//      the logits (NaN -> -inf, -0 -> +0, order-preserving bits), digits of
//      12, 10 and 10 bits (the digit found by one block scan over the
//      histogram; the first digit's pass stages the keys in shared memory for
//      the others), gives the (K / S)th largest key T and how many pools of
//      key T are taken (the lowest-indexed ones); then one pass in pool order
//      with block scans lists the chosen pools in increasing pool index, and
//      one thread per listed pool writes its S positions and slots; then the
//      tail and the -1 padding.
#pragma once

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/fp8.cuh"
#include "core/launch.cuh"
#include "core/shared_memory.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "indexer/indexer_state_params.h"

namespace dsa {
namespace {

constexpr int kDim = kIndexerDim;

// Logits kernel shape: CTA (chunk, t) scores 64 pools of token t on the FP64
// tensor cores (mma.m16n8k16.f64: M = 16 pools, N = 8 heads, K = 16 dims), or
// with the same M, N and K on the FP16 ones (mma.m16n8k16.f16, FP32 accumulators).
constexpr int kLogitPools = 64;                                 // pools per CTA
constexpr int kPoolTile = 16;                                   // MMA M: pools
constexpr int kHeadTile = 8;                                    // MMA N: heads
constexpr int kLogitWarps = kLogitPools / kPoolTile;            // one M tile (and every head tile) per warp
constexpr int kLogitThreads = kLogitWarps * 32;
constexpr int kDimsPerLane = kDim / 4;                          // dims a lane feeds the MMAs: 32c .. 32c + 31
constexpr int kDimSteps = kDim / 16;                            // MMA k steps per tile: 4 dims per lane each
static_assert(kDimsPerLane == 32 && kDimSteps * 4 == kDimsPerLane, "a lane's dims are two uint4 of codes");

// q as the MMAs' B fragments (kHeads / 8 head tiles), decoded once per CTA.
template <IndexerLogits kDots, int kHeads>
struct QFragments {
  // [head tile][k step][half][lane]: b[2 half] and b[2 half + 1] of the lane;
  // each half is one 16-byte load per lane over 512 contiguous bytes (a
  // lane's 32 bytes together would meet twice in half of the banks).
  double2 b[kHeads / kHeadTile][kDimSteps][2][32];
};
template <int kHeads>
struct QFragments<IndexerLogits::kFp32Accumulation, kHeads> {
  uint2 b[kHeads / kHeadTile][kDimSteps][32];  // [head tile][k step][lane]: b0, b1 as FP16x2
};

// Static shared memory a kernel may declare (more must be dynamic, with the
// kernel's MaxDynamicSharedMemorySize raised).
constexpr size_t kStaticSharedLimit = 48 * 1024;

template <IndexerLogits kDots, int kHeads>
struct LogitsShared {
  static constexpr int kReluFloats = kLogitPools * (kHeads + 1);  // [pool][head]; + 1: no bank conflicts
  // Where q and the ReLUs together pass 44 KiB (exact dots at 64 heads: q's
  // fragments alone are 64 KiB), the ReLUs reuse q's bytes after a barrier.
  static constexpr bool kReluOverQ = sizeof(QFragments<kDots, kHeads>) + kReluFloats * 4 > 44 * 1024;
  union {
    QFragments<kDots, kHeads> q;
    float relu_over_q[kReluOverQ ? kReluFloats : 1];
  };
  float relu_own[kReluOverQ ? 1 : kReluFloats];
  float weight[kHeads];        // folded head weights w'
  int64_t block[kLogitPools];  // page of the pool, -1: untrusted, -2: past n
  // ReLU(dot) rounded to FP32, [pool][head] at a pool stride of kHeads + 1.
  __device__ float* relu() { return kReluOverQ ? relu_over_q : relu_own; }
};

// Dynamic shared-memory bytes of a logits instance: 0 where LogitsShared fits
// the static limit, else its size (exact dots at 64 heads, 66 KiB: the
// launcher raises the kernel's limit; sm_90a's ptxas accepts static shared
// memory past 48 KiB, but the CUDA contract is that only dynamic shared
// memory may pass it).
template <IndexerLogits kDots, int kHeads>
constexpr int logits_dynamic_shared_bytes() {
  return sizeof(LogitsShared<kDots, kHeads>) > kStaticSharedLimit ? int(sizeof(LogitsShared<kDots, kHeads>)) : 0;
}

static_assert(logits_dynamic_shared_bytes<IndexerLogits::kExact, 32>() == 0 &&
                  logits_dynamic_shared_bytes<IndexerLogits::kFp32Accumulation, 32>() == 0,
              "the default shape's logits kernels keep their static shared memory");
static_assert(sizeof(LogitsShared<IndexerLogits::kExact, 64>) <= 227 * 1024, "within Hopper's 227 KiB per CTA");

// A logits CTA's LogitsShared: static, or at the start of the dynamic shared
// memory (logits_dynamic_shared_bytes).
template <IndexerLogits kDots, int kHeads>
__device__ __forceinline__ LogitsShared<kDots, kHeads>& logits_shared() {
  if constexpr (logits_dynamic_shared_bytes<kDots, kHeads>() > 0) {
    extern __shared__ __align__(16) unsigned char logits_dynamic_shared[];
    return *reinterpret_cast<LogitsShared<kDots, kHeads>*>(logits_dynamic_shared);
  } else {
    __shared__ LogitsShared<kDots, kHeads> s;
    return s;
  }
}

constexpr int kSelectThreads = 1024;

struct Params {
  int m;
  int heads;      // H (the logits kernel's template argument)
  int pool;       // S
  int topk;       // K: pooled columns
  int top_pools;  // K / S
  int row_width;  // indexer_row_width(plan)
  const int64_t* positions;        // [m]
  const int32_t* token_requests;   // [m]
  IndexerStateParams state;        // read only: block table and K cache
  const uint8_t* q_fp8;        // workspace [max_tokens, H, 128]
  const float* head_weights;   // workspace [max_tokens, H]
  float* logits;               // workspace [max_tokens, logits_stride]
  int64_t logits_stride;       // ceil(max_context / S)
  int32_t* topk_positions;     // [m, stride] or null
  int64_t topk_stride;
  int32_t* slots;              // [m, stride]
  int64_t slots_stride;
  unsigned int* error_count;  // optional
  bool count_untrusted_tokens;  // remap_rows_kernel: whether it counts them (the baseline's expand kernel already has)
  // Baseline only.
  uint32_t* keys_in;
  int32_t* values_in;
  int32_t* values_out;  // sorted pool indices, [m, logits_stride]
  int* segment_begin;   // [m]
  int* segment_end;     // [m]
};

__device__ __forceinline__ void count_error(const Params& p) {
  if (p.error_count != nullptr) atomicAdd(p.error_count, 1u);
}

// Token t's request and context L = pos + 1, or 0 for a padding token and
// for an untrusted one (counted once, by thread 0, when `count` is set).
__device__ int64_t token_context(const Params& p, int t, int64_t* request, bool count) {
  const int32_t r = p.token_requests[t];
  *request = r;
  if (r < 0) return 0;
  const int64_t position = p.positions[t];
  if (r >= p.state.requests || position < 0 || position >= p.state.position_limit) {
    if (count && threadIdx.x == 0) count_error(p);
    return 0;
  }
  return position + 1;
}

// The pools of `request` that no token of the step completes, so that no
// kernel of the step writes them (include/dsa_decode/indexer.h, PDL): those
// below floor(p_min / S), p_min the smallest position of the step's tokens of
// the request. Every lane of the warp computes it (m <= 32: one token per
// lane, then a warp minimum); the step's inputs may be read before the wait.
__device__ int64_t pools_before_step(const Params& p, int64_t request) {
  const int lane = threadIdx.x % 32;
  int64_t position = INT64_MAX;
  if (lane < p.m && p.token_requests[lane] == request) position = p.positions[lane];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    position = min(position, __shfl_xor_sync(0xFFFFFFFFu, position, offset));
  }
  return position == INT64_MAX ? 0 : position / p.pool;
}

// The pools whose logits the step computes for context L: none for L <= K.
__device__ __forceinline__ int64_t scored_pools(const Params& p, int64_t context) {
  return context > p.topk ? context / p.pool : 0;
}

// The first pages of a token's block table row, copied to shared memory by
// the select CTA before its PDL wait (the step's inputs may be read then), so
// that the row writes after the selection read no global memory.
struct StagedBlocks {
  const int32_t* blocks = nullptr;  // [pages] or null
  int pages = 0;
};

// Global slot of a request-local position; -1 stays -1, an untrusted block
// gives -1 and is counted. Pages below table.pages come from shared memory.
__device__ int32_t slot_of(const Params& p, int64_t request, int32_t position, StagedBlocks table = {}) {
  if (position < 0) return -1;
  const IndexerStateParams& s = p.state;
  const int64_t page = position / s.block_size;
  if (page >= s.block_table_width) {
    count_error(p);
    return -1;
  }
  const int64_t block =
      page < table.pages ? table.blocks[page] : s.block_table[request * s.block_table_stride + page];
  if (block < 0 || block >= s.blocks) {
    count_error(p);
    return -1;
  }
  return static_cast<int32_t>(block * s.block_size + position % s.block_size);
}

// The selection's order as unsigned integers: larger logit -> larger key;
// NaN ranks as -inf, -0 as +0.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (x != x) x = -INFINITY;
  x = __fadd_rn(x, 0.0f);  // -0 + 0 = +0
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Row of a token with no logits: padding (context 0) or L <= K.
__device__ void write_short_row(const Params& p, int t, int64_t request, int64_t context, StagedBlocks table) {
  for (int c = threadIdx.x; c < p.row_width; c += blockDim.x) {
    const int32_t position = c < context ? c : -1;
    if (p.topk_positions != nullptr) p.topk_positions[t * p.topk_stride + c] = position;
    p.slots[t * p.slots_stride + c] = context > 0 ? slot_of(p, request, position, table) : -1;
  }
}

// Columns [K, row_width): the tail tokens S n..L-1, then -1.
__device__ void write_tail(const Params& p, int t, int64_t request, int64_t context, StagedBlocks table) {
  const int64_t tail_start = context / p.pool * p.pool;
  for (int c = p.topk + threadIdx.x; c < p.row_width; c += blockDim.x) {
    const int64_t position = tail_start + (c - p.topk);
    const int32_t value = position < context ? static_cast<int32_t>(position) : -1;
    if (p.topk_positions != nullptr) p.topk_positions[t * p.topk_stride + c] = value;
    p.slots[t * p.slots_stride + c] = slot_of(p, request, value, table);
  }
}

// Pool `pool` of the row at output index `index`: columns S index .. S index
// + S - 1, as S / 4 16-byte stores (S and the row strides are multiples of 4).
// Pool 1: one position and slot (column `index`).
__device__ void write_pool(const Params& p, int t, int64_t request, int32_t pool, int index, StagedBlocks table) {
  if (p.pool == 1) {
    if (p.topk_positions != nullptr) p.topk_positions[t * p.topk_stride + index] = pool;
    p.slots[t * p.slots_stride + index] = slot_of(p, request, pool, table);
    return;
  }
  const int32_t first = pool * p.pool;
  const int32_t slot = slot_of(p, request, first, table);  // a pool never straddles a block
  for (int j = 0; j < p.pool; j += 4) {
    const int4 positions = make_int4(first + j, first + j + 1, first + j + 2, first + j + 3);
    const int4 slots =
        slot < 0 ? make_int4(-1, -1, -1, -1) : make_int4(slot + j, slot + j + 1, slot + j + 2, slot + j + 3);
    if (p.topk_positions != nullptr) {
      *reinterpret_cast<int4*>(p.topk_positions + t * p.topk_stride + index * p.pool + j) = positions;
    }
    *reinterpret_cast<int4*>(p.slots + t * p.slots_stride + index * p.pool + j) = slots;
  }
}

// ---------------------------------------------------------------------------
// Step 6: logits.

// d += a * b on the FP64 tensor cores: D [16 x 8] += A [16 x 16] B [16 x 8].
// Lane (g, c) = (lane / 4, lane % 4) supplies A[g][c + 4j] (a[2j]) and
// A[g + 8][c + 4j] (a[2j + 1]) and B[c + 4j][g] (b[j]) for j = 0..3, and holds
// D[g][2c], D[g][2c + 1], D[g + 8][2c], D[g + 8][2c + 1].
__device__ __forceinline__ void mma_f64(double (&d)[4], const double (&a)[8], const double (&b)[4]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, {%4, %5, %6, %7, %8, %9, %10, %11}, "
      "{%12, %13, %14, %15}, {%0, %1, %2, %3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]), "d"(b[0]), "d"(b[1]),
        "d"(b[2]), "d"(b[3]));
}

// d += a * b on the FP16 tensor cores, FP32 accumulators: the same shape and
// lanes as mma_f64, two k values per register: lane (g, c) supplies
// A[g][2c, 2c + 1] (a[0]), A[g + 8][2c, 2c + 1] (a[1]), A[g][2c + 8, 2c + 9]
// (a[2]), A[g + 8][2c + 8, 2c + 9] (a[3]), B[2c, 2c + 1][g] (b[0]) and
// B[2c + 8, 2c + 9][g] (b[1]); D as mma_f64's.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint2 b) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// Four e4m3 codes (lowest byte first) as doubles, exactly; NaN stays NaN.
__device__ __forceinline__ void decode_e4m3x4(uint32_t codes, double (&out)[4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float2 values = e4m3x2_to_float2(codes >> (16 * half));
    out[2 * half] = values.x;
    out[2 * half + 1] = values.y;
  }
}

// Dims 32 quarter .. 32 quarter + 31 of pool `pool`'s codes in page `block`.
__device__ __forceinline__ void load_pool_codes(const IndexerStateParams& s, int64_t block, int64_t pool, int quarter,
                                                uint4 (&codes)[2]) {
  const int64_t entry = pool % s.pools_per_page;
  const uint4* row = reinterpret_cast<const uint4*>(s.k_cache + block * s.page_stride + entry * kDim +
                                                    kDimsPerLane * quarter);
  codes[0] = row[0];
  codes[1] = row[1];
}

// Pool `pool`'s scale in page `block` (after the page's codes).
__device__ __forceinline__ float pool_scale(const IndexerStateParams& s, int64_t block, int64_t pool) {
  const int64_t entry = pool % s.pools_per_page;
  return *reinterpret_cast<const float*>(s.k_cache + block * s.page_stride + int64_t(s.pools_per_page) * kDim +
                                         entry * 4);
}

// Word `w` (0..7) of a lane's 32 codes.
__device__ __forceinline__ uint32_t code_word(const uint4 (&codes)[2], int w) {
  const uint4 v = codes[w / 4];
  return w % 4 == 0 ? v.x : w % 4 == 1 ? v.y : w % 4 == 2 ? v.z : v.w;
}

// Lane (g, c)'s q fragments, decoded by thread (head, quarter) = (8 tile + g,
// c) from its 32 codes of dims 32c .. 32c + 31: k step s takes dims 32c + 4s ..
// 32c + 4s + 3 (the permutation of the dims that A shares, see logits_kernel).
template <IndexerLogits kDots, int kHeads>
__device__ __forceinline__ void store_q_fragments(QFragments<kDots, kHeads>& q, const uint4 (&codes)[2], int head,
                                                  int quarter) {
  const int tile = head / kHeadTile, lane_of_fragment = 4 * (head % kHeadTile) + quarter;
#pragma unroll
  for (int step = 0; step < kDimSteps; ++step) {
    const uint32_t word = code_word(codes, step);
    if constexpr (kDots == IndexerLogits::kExact) {
      double values[4];
      decode_e4m3x4(word, values);
      q.b[tile][step][0][lane_of_fragment] = make_double2(values[0], values[1]);
      q.b[tile][step][1][lane_of_fragment] = make_double2(values[2], values[3]);
    } else {
      q.b[tile][step][lane_of_fragment] = make_uint2(e4m3x2_to_f16x2(word), e4m3x2_to_f16x2(word >> 16));
    }
  }
}

// The lane's D fragments of its M tile against the H / 8 head tiles, rounded
// to FP32: dot[tile][e] is pool 8 (e / 2) + g of the tile, head 8 tile + 2c +
// e % 2. rows[r] are the lane's 32 codes of pools g (r = 0) and g + 8.
template <IndexerLogits kDots, int kHeads, int kHeadTiles = kHeads / kHeadTile>
__device__ __forceinline__ void head_dots(const QFragments<kDots, kHeads>& q, const uint4 (&rows)[2][2], int lane,
                                          float (&dot)[kHeadTiles][4]) {
  if constexpr (kDots == IndexerLogits::kExact) {
    double sums[kHeadTiles][4] = {};  // +0: an all -0 sum stays +0, as in the reference's chain
#pragma unroll
    for (int step = 0; step < kDimSteps; ++step) {
      double values[2][4], a[8];
      decode_e4m3x4(code_word(rows[0], step), values[0]);
      decode_e4m3x4(code_word(rows[1], step), values[1]);
#pragma unroll
      for (int slot = 0; slot < 4; ++slot) {
        a[2 * slot] = values[0][slot];
        a[2 * slot + 1] = values[1][slot];
      }
#pragma unroll
      for (int tile = 0; tile < kHeadTiles; ++tile) {
        const double2 low = q.b[tile][step][0][lane], high = q.b[tile][step][1][lane];
        const double b[4] = {low.x, low.y, high.x, high.y};
        mma_f64(sums[tile], a, b);
      }
    }
#pragma unroll
    for (int tile = 0; tile < kHeadTiles; ++tile) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dot[tile][e] = static_cast<float>(sums[tile][e]);
    }
  } else {
#pragma unroll
    for (int tile = 0; tile < kHeadTiles; ++tile) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dot[tile][e] = 0.0f;
    }
#pragma unroll
    for (int step = 0; step < kDimSteps; ++step) {
      const uint32_t pool_g = code_word(rows[0], step), pool_g8 = code_word(rows[1], step);
      const uint32_t a[4] = {e4m3x2_to_f16x2(pool_g), e4m3x2_to_f16x2(pool_g8), e4m3x2_to_f16x2(pool_g >> 16),
                             e4m3x2_to_f16x2(pool_g8 >> 16)};
#pragma unroll
      for (int tile = 0; tile < kHeadTiles; ++tile) mma_f16(dot[tile], a, q.b[tile][step][lane]);
    }
  }
}

// Logits of pools 64 chunk .. 64 chunk + 63 of token t (CTA (chunk, t)).
//
// Warp w owns pools 16 w .. + 15 (one MMA M tile) and all H heads (H / 8 N
// tiles): each K code is decoded to a double once (v3 decoded it once per
// head tile, and the conversions to FP64 - 16 per clock and SM - cost as
// much as the MMAs). Lane (g, c) feeds dims 32c .. 32c + 31: k step s takes
// dims 32c + 4s .. 32c + 4s + 3 into its k slots c, c + 4, c + 8, c + 12 (a
// permutation of the dims that A and B share). It loads its 32 dims of pools
// g and g + 8 straight from the K cache page (one 32-byte sector per lane and
// pool); q is decoded once per CTA into shared memory in fragment order
// while those loads are in flight.
// kExact: every product of two e4m3 values is a multiple of 2^-18 and every
// partial sum of 128 of them lies below 2^25, so each is exact in double: the
// MMA's result is the exact dot whatever order the tensor core adds in,
// rounded to FP32 once. kFp32Accumulation: the FP16 MMA's FP32 sums, in the
// hardware's order. ReLU'd into shared memory; then one thread per pool runs
// the reference's FP32 chain over the heads.
// kPreload: the settled pools' K codes and scales are read before the PDL
// wait (launch_logits: grids of at most kPreloadMaxCtas CTAs).
template <IndexerLogits kDots, bool kPreload, int kHeads>
__global__ void __launch_bounds__(kLogitThreads) logits_kernel(const __grid_constant__ Params p) {
  constexpr int kHeadTiles = kHeads / kHeadTile;
  LogitsShared<kDots, kHeads>& s = logits_shared<kDots, kHeads>();
  // The step's inputs (positions, token_requests, the block table) are
  // complete before the step's first kernel starts (include/dsa_decode/
  // indexer.h): the token's context, its pools' pages and (kPreload) the K
  // codes and scales of the pools no token of the step completes are read
  // while the previous kernel still runs. Thread i < 64 holds pool
  // first_pool + i's page (-1 untrusted, -2 past n).
  const int t = blockIdx.y;
  int64_t request = 0;
  const int64_t n = scored_pools(p, token_context(p, t, &request, false));
  const int64_t first_pool = int64_t(blockIdx.x) * kLogitPools;
  int64_t block = -2;
  float scale = 0.0f;
  if (threadIdx.x < kLogitPools && first_pool + threadIdx.x < n) {
    block = indexer_pool_block(p.state, request, first_pool + threadIdx.x);
  }
  // The lane's 32 dims of pools g and g + 8 of its M tile (zeros for absent pools).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int first_tile_pool = kPoolTile * warp;
  uint4 k_codes[2][2] = {};  // [row g, g + 8][16-byte half]
  int64_t settled = 0;       // kPreload: pools < settled are not written by this step
  if constexpr (kPreload) {
    settled = first_pool < n ? pools_before_step(p, request) : 0;
    if (threadIdx.x < kLogitPools) s.block[threadIdx.x] = block;
    // This thread's pool scale (loaded by the thread that uses it last).
    if (block >= 0 && first_pool + threadIdx.x < settled) scale = pool_scale(p.state, block, first_pool + threadIdx.x);
    __syncthreads();  // the pages
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = first_tile_pool + 8 * r + g;
      if (s.block[i] >= 0 && first_pool + i < settled) {
        load_pool_codes(p.state, s.block[i], first_pool + i, c, k_codes[r]);
      }
    }
  }

  pdl_wait();  // q_fp8, head weights and the pools this step completes come from the prepare step
  pdl_release_dependents();
  if (first_pool >= n) return;  // uniform over the CTA

  // Thread i decodes (head, quarter) = (j / 4, j % 4) for j = i, i + 128, ...
  // below H * 4: dims 32 quarter .. + 31 of the head into the fragment of
  // lane (head % 8, quarter) of head tile head / 8 (below, while the K codes
  // are in flight).
  constexpr int kQRounds = (kHeads * 4 + kLogitThreads - 1) / kLogitThreads;
  uint4 q_codes[kQRounds][2];
#pragma unroll
  for (int r = 0; r < kQRounds; ++r) {
    const int j = static_cast<int>(threadIdx.x) + r * kLogitThreads;
    if (j < kHeads * 4) {
      const uint4* q_row = reinterpret_cast<const uint4*>(p.q_fp8 + (int64_t(t) * kHeads + j / 4) * kDim +
                                                          kDimsPerLane * (j % 4));
      q_codes[r][0] = q_row[0];
      q_codes[r][1] = q_row[1];
    }
  }
  // The scales and codes of the pools this step may have just completed
  // (every pool without kPreload).
  if (threadIdx.x < kLogitPools) {
    if (block >= 0 && first_pool + threadIdx.x >= settled) {
      scale = pool_scale(p.state, block, first_pool + threadIdx.x);
    }
    if constexpr (!kPreload) s.block[threadIdx.x] = block;
  }
  for (int h = threadIdx.x; h < kHeads; h += kLogitThreads) s.weight[h] = p.head_weights[t * kHeads + h];
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = first_tile_pool + 8 * r + g;
    if (s.block[i] >= 0 && first_pool + i >= settled) {
      load_pool_codes(p.state, s.block[i], first_pool + i, c, k_codes[r]);
    }
  }

#pragma unroll
  for (int r = 0; r < kQRounds; ++r) {
    const int j = static_cast<int>(threadIdx.x) + r * kLogitThreads;
    if (j < kHeads * 4) store_q_fragments<kDots, kHeads>(s.q, q_codes[r], j / 4, j % 4);
  }
  __syncthreads();

  float dot[kHeadTiles][4];
  head_dots<kDots, kHeads>(s.q, k_codes, lane, dot);
  if constexpr (LogitsShared<kDots, kHeads>::kReluOverQ) __syncthreads();  // every warp is done with q
  float* relu = s.relu();
#pragma unroll
  for (int tile = 0; tile < kHeadTiles; ++tile) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = first_tile_pool + 8 * (e / 2) + g, head = kHeadTile * tile + 2 * c + e % 2;
      // fmaxf(x, 0) as the reference's std::fmax: NaN gives 0.
      relu[i * (kHeads + 1) + head] = fmaxf(dot[tile][e], 0.0f);
    }
  }
  __syncthreads();

  if (threadIdx.x < kLogitPools) {
    const int i = threadIdx.x;
    const int64_t block = s.block[i];
    if (block == -2) return;  // past n
    float logit = -INFINITY;
    if (block >= 0) {
      float sum = 0.0f;
      for (int h = 0; h < kHeads; ++h) sum = __fmaf_rn(s.weight[h], relu[i * (kHeads + 1) + h], sum);
      logit = __fmul_rn(sum, scale);
    } else {
      count_error(p);
    }
    p.logits[t * p.logits_stride + first_pool + i] = logit;
  }
}

// ---------------------------------------------------------------------------
// Steps 7-8 fused: top K / S pools by radix select, compaction in pool order,
// expansion and remap.

// Radix select digits, most significant first: 12 + 10 + 10 bits of the key.
constexpr int kDigitCount = 3;
__device__ __forceinline__ constexpr int digit_bits(int d) { return d == 0 ? 12 : 10; }
__device__ __forceinline__ constexpr int digit_shift(int d) { return d == 0 ? 20 : d == 1 ? 10 : 0; }
constexpr int kMaxBins = 1 << 12;
constexpr int kMaxBinsPerThread = kMaxBins / kSelectThreads;
static_assert(kMaxBins % kSelectThreads == 0 && (1 << 10) % kSelectThreads == 0, "whole bins per thread");
constexpr int kPassItems = 8;          // pools per thread and round of a histogram pass
constexpr int kCompactItems = 8;       // consecutive pools per thread and round of the compaction (two uint4)
constexpr int kStagedKeys = 1 << 15;   // keys in shared memory: 128k context at pool 4, 32k at pool 1
constexpr int kStagedPages = 1024;     // block table entries kept in shared memory: 128k context at 128 tokens a block

struct SelectShared {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  typename Scan::TempStorage scan;
  unsigned int histogram[kMaxBins];
  int32_t chosen[kIndexerMaxTopTokens];  // the taken pools in column order (up to 512 pools, 2048 tokens at pool 1)
  uint32_t prefix;  // the key digits chosen so far
  int remaining;    // pools still to take among those whose key starts with `prefix`
  int digit_count;  // pools whose key starts with `prefix` (after the last digit: equal to the threshold)
};

// The select's view of a token's keys: the first `staged` live in shared
// memory (written by the first digit's pass), the rest are recomputed from the
// logits (contexts above 128k).
struct TokenKeys {
  const float* logits;
  uint32_t* staged_keys;
  int staged;
  __device__ uint32_t operator()(int pool) const {
    return pool < staged ? staged_keys[pool] : order_key(logits[pool]);
  }
};

// One radix digit: the histogram of digit `d` over the keys that start with
// s.prefix, then the largest digit value v such that at least s.remaining of
// them have a digit >= v. Thread i sums bins in descending order, so one block
// scan gives every thread the count above its bins and exactly one bin
// crosses s.remaining (the invariant: at least s.remaining keys match). The
// first digit's pass reads the logits (kPassItems independent loads per
// thread before any use) and stages the keys.
__device__ void select_digit(SelectShared& s, const TokenKeys& keys, int n, int d) {
  const int shift = digit_shift(d), bins = 1 << digit_bits(d), bins_per_thread = bins / kSelectThreads;
  for (int b = threadIdx.x; b < bins; b += kSelectThreads) s.histogram[b] = 0;
  __syncthreads();
  const uint32_t prefix = s.prefix;
  const int remaining = s.remaining;
  const uint32_t mask = d == 0 ? 0u : ~0u << (shift + digit_bits(d));  // the digits above this one
  for (int base = 0; base < n; base += kSelectThreads * kPassItems) {
    uint32_t key[kPassItems];
    if (d == 0) {
      float values[kPassItems];
#pragma unroll
      for (int k = 0; k < kPassItems; ++k) {
        const int pool = base + k * kSelectThreads + threadIdx.x;
        values[k] = pool < n ? keys.logits[pool] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kPassItems; ++k) {
        const int pool = base + k * kSelectThreads + threadIdx.x;
        key[k] = order_key(values[k]);
        if (pool < keys.staged) keys.staged_keys[pool] = key[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < kPassItems; ++k) {
        const int pool = base + k * kSelectThreads + threadIdx.x;
        key[k] = pool < n ? keys(pool) : 0u;
      }
    }
#pragma unroll
    for (int k = 0; k < kPassItems; ++k) {
      if (base + k * kSelectThreads + static_cast<int>(threadIdx.x) < n && (key[k] & mask) == prefix) {
        atomicAdd(&s.histogram[(key[k] >> shift) & (bins - 1)], 1u);
      }
    }
  }
  __syncthreads();
  const int top = bins - 1 - threadIdx.x * bins_per_thread;  // this thread's bins: top, top - 1, ...
  int counts[kMaxBinsPerThread] = {}, mine = 0;
#pragma unroll
  for (int k = 0; k < kMaxBinsPerThread; ++k) {
    if (k < bins_per_thread) counts[k] = static_cast<int>(s.histogram[top - k]);
    mine += counts[k];
  }
  int above = 0;
  SelectShared::Scan(s.scan).ExclusiveSum(mine, above);
#pragma unroll
  for (int k = 0; k < kMaxBinsPerThread; ++k) {
    if (k < bins_per_thread && above < remaining && above + counts[k] >= remaining) {
      s.prefix = prefix | (static_cast<uint32_t>(top - k) << shift);
      s.remaining = remaining - above;
      s.digit_count = counts[k];
    }
    above += counts[k];
  }
  __syncthreads();
}

// Rows of token blockIdx.x, one CTA; `staged` keys fit the dynamic shared memory.
__global__ void __launch_bounds__(kSelectThreads) select_rows_kernel(const __grid_constant__ Params p, int staged) {
  __shared__ SelectShared s;
  extern __shared__ __align__(16) uint32_t staged_keys[];  // 16-byte aligned: the compaction reads uint4
  // The token's context from the step's inputs, complete before the step's
  // first kernel (as in logits_kernel), while the logits are still computed.
  const int t = blockIdx.x;
  int64_t request = 0;
  const int64_t context = token_context(p, t, &request, false);
  __shared__ int32_t table_pages[kStagedPages];
  StagedBlocks table{table_pages, 0};
  if (context > 0) {
    int64_t pages = (context + p.state.block_size - 1) / p.state.block_size;
    if (pages > p.state.block_table_width) pages = p.state.block_table_width;
    table.pages = static_cast<int>(pages < kStagedPages ? pages : kStagedPages);
    for (int i = threadIdx.x; i < table.pages; i += kSelectThreads) {
      table_pages[i] = p.state.block_table[request * p.state.block_table_stride + i];
    }
  }
  pdl_wait();  // the logits
  pdl_release_dependents();
  if (threadIdx.x == 0 && context == 0 && request >= 0) count_error(p);  // an untrusted token
  const int n = static_cast<int>(scored_pools(p, context));  // < 2^20: max_context <= 2^22
  if (n == 0) {
    __syncthreads();  // the staged pages
    write_short_row(p, t, request, context, table);
    return;
  }
  const TokenKeys keys{p.logits + t * p.logits_stride, staged_keys, staged};

  // The (K / S)th largest key T, and how many of the pools of key T to take
  // (the lowest-indexed ones). n >= K / S here (L > K).
  const int top_pools = p.top_pools;
  if (threadIdx.x == 0) {
    s.prefix = 0;
    s.remaining = n < top_pools ? n : top_pools;
  }
  __syncthreads();
  // Digits until the bin of the (K / S)th key is taken whole (then the lower
  // digits cannot change the set) or the key is resolved. After an early
  // stop T's lower digits are 0 and no tie is split, so "key > T or key == T"
  // takes exactly the keys of the bin and above.
#pragma unroll
  for (int d = 0; d < kDigitCount; ++d) {
    select_digit(s, keys, n, d);
    if (s.remaining == s.digit_count) break;  // uniform: shared values after select_digit's barrier
  }
  const uint32_t threshold = s.prefix;
  const int take_equal = s.remaining;
  const bool split_ties = take_equal < s.digit_count;  // some pools of key T are left out

  // Compaction in pool order (pool index order is the column order): thread i
  // owns pools base + 8i .. base + 8i + 7; running totals stay in registers.
  // The taken pools go to s.chosen at their column; the rows are written
  // after the pass, one pool per thread, so the block-table reads overlap.
  int taken = 0, equal_seen = 0;
  for (int base = 0; base < n && taken < top_pools; base += kSelectThreads * kCompactItems) {
    const int first = base + static_cast<int>(threadIdx.x) * kCompactItems;
    uint32_t key[kCompactItems];
    if (first + kCompactItems <= n && first + kCompactItems <= keys.staged) {
      // Two 16-byte reads: eight scalar reads at a stride of 8 words would
      // meet 8 times in each bank.
      const uint4* pair = reinterpret_cast<const uint4*>(keys.staged_keys + first);
      const uint4 low = pair[0], high = pair[1];
      key[0] = low.x, key[1] = low.y, key[2] = low.z, key[3] = low.w;
      key[4] = high.x, key[5] = high.y, key[6] = high.z, key[7] = high.w;
    } else {
#pragma unroll
      for (int k = 0; k < kCompactItems; ++k) {
        key[k] = first + k < n ? keys(first + k) : 0u;  // key 0: below every real key (NaN ranks as -inf)
      }
    }
    int equal_mine = 0;
#pragma unroll
    for (int k = 0; k < kCompactItems; ++k) equal_mine += first + k < n && key[k] == threshold;
    int equal_before = 0, equal_total = 0;
    if (split_ties) {
      SelectShared::Scan(s.scan).ExclusiveSum(equal_mine, equal_before, equal_total);
      __syncthreads();  // scan storage reused
    }
    bool take[kCompactItems];
    int take_mine = 0;
#pragma unroll
    for (int k = 0; k < kCompactItems; ++k) {
      const bool equal = key[k] == threshold && first + k < n;
      take[k] = key[k] > threshold || (equal && (!split_ties || equal_seen + equal_before < take_equal));
      equal_before += equal;
      take_mine += take[k];
    }
    int take_before = 0, take_total = 0;
    SelectShared::Scan(s.scan).ExclusiveSum(take_mine, take_before, take_total);
    __syncthreads();  // scan storage reused
#pragma unroll
    for (int k = 0; k < kCompactItems; ++k) {
      if (take[k]) {
        const int index = taken + take_before++;
        if (index < top_pools) s.chosen[index] = first + k;
      }
    }
    taken += take_total;  // block totals: the loop condition is uniform
    equal_seen += equal_total;
  }
  __syncthreads();
  // Exactly K / S pools are taken (n >= K / S here).
  for (int i = threadIdx.x; i < top_pools; i += kSelectThreads) {
    write_pool(p, t, request, s.chosen[i], i, table);
  }
  write_tail(p, t, request, context, table);
}

// Step 8 over rows of request-local positions (the baseline's expanded rows,
// or a caller's through indexer_remap): a position at or past the token's
// context is a row from the future, -1 and counted (the baseline's never are).
__global__ void __launch_bounds__(256) remap_rows_kernel(const __grid_constant__ Params p) {
  pdl_wait();
  pdl_release_dependents();
  const int t = blockIdx.x;
  int64_t request = 0;
  const int64_t context = token_context(p, t, &request, p.count_untrusted_tokens);
  for (int c = threadIdx.x; c < p.row_width; c += blockDim.x) {
    const int32_t position = p.topk_positions[t * p.topk_stride + c];
    if (context > 0 && position >= context) {
      count_error(p);
      p.slots[t * p.slots_stride + c] = -1;
    } else {
      p.slots[t * p.slots_stride + c] = context > 0 ? slot_of(p, request, position) : -1;
    }
  }
}

// ---------------------------------------------------------------------------
// Launchers.

// The fields select and remap share: the plan's shape, the tokens and the
// state; the rest zero.
Params make_row_params(const IndexerPlan& plan, const TensorView& positions, const TensorView& token_requests,
                       const IndexerState& state) {
  Params p = {};
  p.heads = plan.heads;
  p.pool = plan.pool;
  p.topk = plan.topk;
  p.top_pools = indexer_top_pools(plan);
  p.row_width = indexer_row_width(plan);
  p.m = static_cast<int>(positions.size(0));
  p.positions = positions.ptr<const int64_t>();
  p.token_requests = token_requests.ptr<const int32_t>();
  p.state = make_indexer_state_params(plan, state);
  return p;
}

Params make_params(const IndexerSelectArgs& a) {
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(a.plan);
  uint8_t* workspace = a.workspace.ptr<uint8_t>();
  Params p = make_row_params(a.plan, a.positions, a.token_requests, a.state);
  p.q_fp8 = workspace + layout.q_fp8;
  p.head_weights = reinterpret_cast<const float*>(workspace + layout.head_weights);
  p.logits = reinterpret_cast<float*>(workspace + layout.logits);
  p.logits_stride = layout.logits_stride;
  p.topk_positions = a.topk_positions.ptr<int32_t>();
  p.topk_stride = a.topk_positions.data != nullptr ? a.topk_positions.stride(0) : 0;
  p.slots = a.slots.ptr<int32_t>();
  p.slots_stride = a.slots.stride(0);
  p.error_count = a.error_count;
  return p;
}

// The logits kernel's grid: one CTA per 64 pools of a token row, per token.
dim3 logits_grid(const Params& p) {
  const int64_t chunks = (p.logits_stride + kLogitPools - 1) / kLogitPools;
  return dim3(static_cast<unsigned>(chunks), p.m);
}

// Largest logits grid that reads the settled pools' K codes before the PDL
// wait. H200, both logits variants: 0.6-1.5 us faster up to 2048 CTAs (32k
// context m <= 16, 128k m <= 4), 0.9-5.4 us slower at 4096 and 8192 (128k m
// = 8, 16), where most CTAs start after the wait anyway (docs/indexer.md).
constexpr int64_t kPreloadMaxCtas = 2048;

// One (dots, heads) instance pair: the preload variant the grid asks for,
// with the dynamic shared memory the instance needs (the limit raised for
// both variants at once, so that a later grid size needs no attribute change).
template <IndexerLogits kDots, int kHeads>
Status launch_logits_for(const Params& p, dim3 grid, bool preload, cudaStream_t stream) {
  constexpr int kBytes = logits_dynamic_shared_bytes<kDots, kHeads>();
  if constexpr (kBytes > 0) {
    using Kernel = void (*)(Params);
    const Kernel variants[] = {logits_kernel<kDots, true, kHeads>, logits_kernel<kDots, false, kHeads>};
    for (const Kernel kernel : variants) {
      DSA_RETURN_IF_ERROR(
          raise_shared_memory_limit(reinterpret_cast<const void*>(kernel), kBytes, "indexer select logits"));
    }
  }
  return launch_pdl(preload ? logits_kernel<kDots, true, kHeads> : logits_kernel<kDots, false, kHeads>, grid,
                    dim3(kLogitThreads), kBytes, stream, p);
}

template <int kHeads>
Status launch_logits_for_heads(const Params& p, dim3 grid, bool preload, bool exact, cudaStream_t stream) {
  return exact ? launch_logits_for<IndexerLogits::kExact, kHeads>(p, grid, preload, stream)
               : launch_logits_for<IndexerLogits::kFp32Accumulation, kHeads>(p, grid, preload, stream);
}

// The one dispatch of the logits kernel: dots, preload and p.heads (16, 32 or 64).
Status launch_logits(const Params& p, IndexerLogits dots, cudaStream_t stream) {
  const dim3 grid = logits_grid(p);
  const bool preload = int64_t(grid.x) * grid.y <= kPreloadMaxCtas;
  const bool exact = dots == IndexerLogits::kExact;
  return p.heads == 16   ? launch_logits_for_heads<16>(p, grid, preload, exact, stream)
         : p.heads == 64 ? launch_logits_for_heads<64>(p, grid, preload, exact, stream)
                         : launch_logits_for_heads<32>(p, grid, preload, exact, stream);
}

}  // namespace
}  // namespace dsa
