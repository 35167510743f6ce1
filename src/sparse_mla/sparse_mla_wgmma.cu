// The 64-head warpgroup-MMA sparse MLA decode kernel (sparse_mla_wgmma), what
// sparse_mla runs when H is a multiple of 64 (the served models at TP1 and
// TP2). The contract is in include/dsa_decode/sparse_mla.h; the design and
// the measurements in docs/sparse_mla.md ("The 64-head kernel", then "v10"
// to "v12").
//
// Work split (a function of K and SparseMlaArgs::splits only, never of m:
// sparse_mla_wgmma_splits of sparse_mla_wgmma_max_splits): split `split`
// of item (token, group) owns heads 64 group..64 group + 63 of one token and
// the chunks [split C / splits, (split + 1) C / splits) of the C = ceil(K /
// 64) 64-entry chunks of its index row. The splits of an item form clusters
// of cluster_size (a power of two <= 16) consecutive splits: cluster split /
// cluster_size, rank split % cluster_size. The default plan (kLatency): 16
// splits of two chunks at K = 2048 in one cluster (kThroughput: 8 of four).
//
// Launch, three instances of one kernel by Meeting, all giving the same bits
// (kWholeItem in two shapes):
//  - kClusterBarrier: when the GPU holds every item's clusters at once as
//    hardware clusters (7 clusters of 16 CTAs on a 132-SM H200: m <= 7 at
//    H = 64), grid (splits, groups, m) in hardware clusters, one item per
//    CTA, the clusters meeting at the cluster barrier;
//  - kCounter: otherwise persistent and cooperative (every CTA resident at
//    once, one per SM): as many items at once as the GPU holds all splits of
//    (8 on the H200 at 16 splits: 128 CTAs), CTA b running split b % splits
//    of items b / splits, + grid / splits, ...; a cluster's CTAs meet at a
//    counter in split_counters (meet below). Not held to the 7 hardware
//    clusters: m = 8 at H = 64 runs in one round instead of two waves.
//  - kWholeItem, taken first: with many items (at least 3/4 of the CTAs the
//    GPU holds at once), a plan of one cluster, K <= 2304 and a cache span
//    below 64 GiB, one CTA per item streams all its splits' chunks through
//    the same pipeline (one prologue), stores each split's partials at the
//    split's last chunk and resets its accumulators, and combines them
//    itself after the last (docs/sparse_mla.md, "The 64-head
//    split kernel"): no meeting, and m = 128 at H = 64 in one round instead of
//    16 rounds of 8 items. Each split's partial is computed by the same
//    instructions from the same fresh state: the same bits.
//  - kWholeItem, grouped: between the two (one CTA per split would take
//    more than one round, too few items for one CTA per item), 2 to 8 CTAs
//    per item, each streaming consecutive splits (the fewest per CTA that
//    put every item's CTAs on the GPU at once), cooperative: the item's CTAs
//    meet at its counter, then each combines its share of the units.
//
// Shared memory holds FP16 copies of the group's q and of two chunks, each as
// 8 panels of 64 dims, K-major with the 128-byte swizzle (src/core/wgmma.cuh);
// e4m3 converts to FP16 exactly, so both products see the exact codes. A
// chunk tile serves Q.K^T as a K-major operand and P.V as an N-major one.
//
// Prologue: the run's indices are read once (coalesced, the out-of-range ones
// counted) into cache-row offsets (-1 = invalid) and a valid-row mask per
// chunk; chunks without a valid entry are skipped (they would add exact
// zeros). The first chunk's rows are requested, q and that chunk are
// converted into their tiles by all threads; warpgroup 1 requests the second.
//
// Per chunk i (tile i % 2), two roles (FlashMLA's split), handing over
// through shared-memory barriers (mbarriers: P alternates between two,
// tile_ready is one; sparse_mla_handover.h says why):
//  - warpgroup 0: S [64 heads][64 entries] = Q K^T by 32 wgmma m64n64k16 (q
//    read once per chunk); scores = S * softmax_scale * q_scale * k_scale *
//    log2(e), -inf for invalid entries; the running max per head (NaN
//    propagates); p = 2^(score - max) rounded to FP16 into registers (O_left's
//    A fragments) and into p_tiles[i % 2] with the rescale factors; then
//    O_left [64 x 256] = O_left * rescale + P V[:, 0:256] by 4 wgmma m64n256k16
//    (P from registers, V the tile read N-major).
//  - warpgroup 1: once P is ready, O_right = O_right * rescale + P V[:, 256:512]
//    (P from shared memory); while those run it converts chunk i + 1 from its
//    registers into the other tile (warpgroup 0 is done with it) and loads
//    chunk i + 2. Chunk 1 goes into tile 1, free from the start, under chunk
//    0's S.
// Combine, level 1 (inside a cluster): each split stores its partial O
// divided by its sum (FP16) into its slot of split_partials (global memory,
// read back through L2) and its (max, sum) per head there too, or, with
// hardware clusters, into the shared memory of the rank that combines that
// head (distributed shared memory, before the cluster barrier); rank k of the
// cluster owns units [k U / n, (k + 1) U / n) of the group's U = 256 quarter
// heads (128 dims each), n the cluster size. After the cluster's meeting
// (release / acquire: at cluster scope by the cluster barrier, at GPU scope by
// a counter), one warp per head turns the ranks' (max, sum) into one
// coefficient per rank, 2^(max_r - max) sum_r / sum (fixed butterflies), and
// each thread adds its 8 dims over the ranks in rank order. With one cluster,
// that sum times k_scale is the output: latent (BF16) and lse = max ln 2 +
// ln(sum).
// Level 2 (more than one cluster): rank k writes its units' sums (FP32) and
// its heads' (max, sum) into the cluster's slot of split_partials, then
// counts itself in the counter of (token, group, rank k). The rank k that
// arrives last (every other cluster's rank k has written and counted) resets
// the counter to zero and combines the clusters' results for its units in
// cluster order, the same way with k_scale: latent and lse. Units of one
// rank are whole heads (n divides 64), so its heads' statistics are its own.
//
// Every sum has a fixed order that depends only on K, H, SparseMlaArgs::splits
// and the entry positions: the same inputs give the same bits, for any m.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/cluster.cuh"
#include "core/fp8.cuh"
#include "core/launch.cuh"
#include "core/mbarrier.cuh"
#include "core/shared_memory.h"
#include "core/wgmma.cuh"
#include "dsa_decode/numerics.h"
#include "sparse_mla/sparse_mla_handover.h"
#include "sparse_mla/sparse_mla_params.h"
#include "sparse_mla/sparse_mla_plan.h"
#include "sparse_mla/sparse_mla_wgmma_steps.cuh"

namespace dsa {
namespace {

using namespace sparse_mla_steps;  // what the two 64-head kernels share

constexpr int kThreads = 256;                       // two warpgroups
constexpr int kWarpgroupDims = kLatent / 2;         // output dims per warpgroup
constexpr int kMaxChunks = 16;                      // per split: K <= 16384 over 16 splits
constexpr int kMaxRowsPerSplit = kMaxChunks * kChunkRows;
// A whole item streamed by one CTA (Meeting::kWholeItem): K <= 2304.
constexpr int kMaxStreamChunks = 36;
constexpr int kMaxStreamRows = kMaxStreamChunks * kChunkRows;
constexpr int kMaxRowsPerThread = kMaxStreamRows / kThreads;  // a CTA's entries per thread (a split's fewer)
constexpr int kMaxClusterSize = 16;                 // Hopper's largest (non-portable above 8)
constexpr int kMaxClusters = 16;                    // level 2's parts: coefficient rows, lanes of a warp
// split_counters per (token, group): level 2's, one per rank, then level 1's meetings, one per cluster.
constexpr int kCountersPerGroup = kMaxClusterSize + kMaxClusters;
static_assert(kCountersPerGroup <= kHeads, "sparse_mla_split_counter_count gives H per token: 64 per group");
constexpr int kUnitDims = 128;                      // the combine's unit: a quarter of a head's output
constexpr int kUnits = kHeads * kLatent / kUnitDims;
constexpr int kUnitSlots = kUnitDims * 2 / 16;                          // 16-byte slots of a unit's FP16 values
constexpr int kClusterPartialFloats = kUnits * kUnitDims + 2 * kHeads;  // a cluster's level-2 slot of split_partials
// A split's level-1 slot: its FP16 O / sum as [unit][16-byte slot], then its (max, sum) per head.
constexpr int kSplitPartialFloats = kUnits * kUnitSlots * 4 + 2 * kHeads;
static_assert(kMaxRowsPerSplit * 16 >= kSparseMlaMaxTopK, "16 splits cover the largest K");

struct alignas(1024) SharedStorage : TileStorage {
  // The warpgroups' handover, 128 arrivals a phase (sparse_mla_handover.h):
  // P of the CTA's n-th chunk on p_ready_phase_of_chunk(n); warpgroup 1
  // converts chunk n + 1 (n >= 1) only after P of chunk n, so it is never two
  // tile_ready phases ahead (phase n: chunk n + 1).
  uint64_t p_ready[2];  // warpgroup 0 has written P and the rescale factors of the chunk
  uint64_t tile_ready;  // warpgroup 1 has converted the chunk after it into the other tile
  union {
    int64_t row_offset[kMaxRowsPerSplit];   // a split's: byte offset of each entry's cache row, -1 when invalid
    uint32_t row_offset16[kMaxStreamRows];  // a whole item's (kWholeItem): byte offset / 16, kNoRow when invalid
  };
  uint64_t valid_rows[kMaxStreamChunks];  // bit r: row r of chunk c is a valid entry
  int chunk_list[kMaxStreamChunks];       // the chunks with a valid entry, in order
  // kWholeItem: the split of chunk_list[i], whether it is its split's last
  // valid chunk, and the running (max, sum) per head after it ([i % 2]).
  int chunk_split[kMaxStreamChunks];
  int ends_split[kMaxStreamChunks];
  float split_max[2][kHeads], split_sum[2][kHeads];
  int combines_clusters;                             // level 2: this CTA arrived last for its rank
  // kClusterBarrier: the (max, sum) of the heads this CTA combines, from each
  // rank of its cluster, pushed before the meeting: [max, sum][rank r's heads
  // first_local_head.. at r * local_heads], so that the coefficients need no
  // round trip to L2 after it.
  float peer_stats[2][kHeads];
};
// After the chunk loop the combine's coefficients overlay the q tile.
static_assert(sizeof(SharedStorage::q_tile) >= sizeof(float) * kMaxClusterSize * kHeads, "coefficients");
static_assert(kMaxClusters <= kMaxClusterSize && kMaxClusters <= 32,
              "level 2's coefficients (one row per cluster) fit where level 1's were, one lane each");
constexpr int kSharedBytes = sizeof(SharedStorage) + 1024;  // + alignment of the dynamic base
static_assert(kSharedBytes <= 227 * 1024, "Hopper's largest shared memory per CTA");

// Where a unit's slot of split_partials keeps its 128 dims (FP16): 16-byte slot
// unit_slot(j, c) holds dims 8 (j + u) + 2 c, + 1 for u = 0..3, j a multiple
// of 4, so that lane c of a quad pushes 16 contiguous bytes and the quad 64.
__host__ __device__ constexpr int unit_slot(int j, int c) { return (j / 4) * 4 + c; }

// What a launch's CTAs share: the plan and the work.
struct WgmmaLaunch {
  int total_chunks;  // C = ceil(K / 64)
  int splits;        // splits per (token, group): the plan's
  int cluster_size;  // splits that combine their partials together (level 1)
  int groups;        // head groups of 64
  int items;         // (token, group) pairs: m * groups
  // kWholeItem: consecutive splits per CTA: all of them (one CTA per item,
  // no meeting), or fewer, the splits / splits_per_cta CTAs of an item
  // meeting at its counter before each combines its share.
  int splits_per_cta = 1;
};

// Level 1's meeting of `ctas` CTAs (the CTAs of one cluster, or the CTAs
// of one item in the grouped stream) through their counter in
// split_counters: each arrives (releasing its partials, which all its
// threads have stored before the barrier), waits for all to arrive, and
// departs; the last to depart finds the counter at 2 ctas - 1 and returns it
// to zero (CTAs that have departed no longer read it). The CTAs are
// resident together (a cooperative launch of at most the CTAs the GPU holds
// at once), so the wait ends. Returns (to thread 0) the counter before this
// CTA's departure, for reset_meeting after the combine: reading it here
// would put the add's round trip before the combine.
__device__ __forceinline__ int meet(int* counter, int ctas) {
  __syncthreads();  // this CTA's partials are stored
  int before_departure = 0;
  if (threadIdx.x == 0) {
    // Releases what the barrier above ordered before it (cumulative).
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
    int arrived;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(arrived) : "l"(counter) : "memory");
    } while (arrived < ctas);
    before_departure = atomicAdd(counter, 1);
  }
  __syncthreads();  // the peers' partials, acquired by thread 0, for every thread
  return before_departure;
}
__device__ __forceinline__ void reset_meeting(int* counter, int ctas, int before_departure) {
  if (threadIdx.x == 0 && before_departure == 2 * ctas - 1) atomicExch(counter, 0);
}

// The handover's counts in this CTA before the current item (they continue
// across a persistent CTA's items): p_ready counts chunks (both barriers
// together), tile_ready one phase per chunk after an item's first.
struct HandoverPhases {
  int p_ready = 0, tile_ready = 0;
};

// How the CTAs of one (token, group) item reach its combine: the hardware
// cluster's barrier, a counter in split_counters (persistent launch), or, in
// the stream (one cluster), not at all when one CTA runs every split of the
// item and combines them itself after the last, else at the item's counter
// (the grouped stream: several CTAs of consecutive splits).
enum class Meeting { kClusterBarrier, kCounter, kWholeItem };

// Work item (token, group) of split `split`, the CTAs meeting as kMeeting
// says. kWholeItem: one call streams launch.splits_per_cta splits from
// `split` (all of them from split 0 with one CTA per item), storing each
// split's partials at its last chunk; the item's CTAs meet (when there are
// several), then each combines its share.
template <Meeting kMeeting>
__device__ __forceinline__ void sparse_mla_wgmma_item(SharedStorage& s, const SparseMlaParams& p,
                                                      const WgmmaLaunch& launch, int split, int token, int group,
                                                      HandoverPhases& phases) {
  constexpr bool kPersistent = kMeeting == Meeting::kCounter;
  constexpr bool kStream = kMeeting == Meeting::kWholeItem;
  const int splits = launch.splits, total_chunks = launch.total_chunks, cluster_size = launch.cluster_size;
  const int rank = split % cluster_size, cluster_index = split / cluster_size, clusters = splits / cluster_size;
  const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
  // Accumulator coordinates (wgmma::accumulator_row / _column): element e of
  // an m64nN result is head 16 warp + g + 8 ((e / 2) % 2), column 8 (e / 4) + 2 c + e % 2.
  const int warp = thread / 32, lane = threadIdx.x % 32;  // warp of the warpgroup: accumulator rows 16 warp..
  const int g = lane / 4, c = lane % 4;                    // accumulator row group and column pair
  const int first_head = group * kHeads;
  const uint32_t q_tile = shared_address(s.q_tile), tiles = shared_address(s.tiles);

  // Needed only after the first S, but loaded after the prologue's last
  // barrier the first wgmma waited for them (the compiler computes the
  // product before it): requested here, with q, under the index reads.
  const float score_scale = p.softmax_scale * *p.q_scale * *p.k_scale * kLog2e;
  constexpr int kPieces = kChunkPieces / kThreads;  // per thread, when all threads convert
  uint4 q_codes[kPieces];  // this thread's FP8 pieces of q, in flight while the indices are read
  const int piece = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < kPieces; ++k) {
    q_codes[k] = load_streaming(p.q + token * p.q_token_stride +
                                (first_head + piece_row<kThreads>(k)) * p.q_head_stride + piece * 16);
  }

  const int32_t* index_row = p.indices + token * p.indices_token_stride;
  // This CTA's splits [split, split + splits_here): chunks from first_chunk_here.
  const int splits_here = kStream ? launch.splits_per_cta : 1;
  const int ctas_per_item = kStream ? splits / splits_here : cluster_size;  // the CTAs that meet and combine
  const int first_chunk_here = split * total_chunks / splits;
  const int row_begin = first_chunk_here * kChunkRows;
  const int rows = min(p.top_k, (split + splits_here) * total_chunks / splits * kChunkRows) - row_begin;
  const int chunks = (rows + kChunkRows - 1) / kChunkRows;
  if (threadIdx.x < kMaxStreamChunks) s.valid_rows[threadIdx.x] = 0;  // the last item's are read before its loop's end
  const uint32_t tile_ready = shared_address(&s.tile_ready);
  // The barrier and phase of P of the item's chunk i (the CTA's chunk phases.p_ready + i).
  auto p_ready = [&](int i) { return shared_address(&s.p_ready[p_ready_phase_of_chunk(phases.p_ready + i).barrier]); };
  auto p_ready_phase = [&](int i) { return p_ready_phase_of_chunk(phases.p_ready + i).phase; };
  __syncthreads();
  unsigned int out_of_range = 0;
  // Every entry of this thread requested at once: a whole item's up to 2304
  // rows are 9 per thread, which a loop would read one round trip at a time.
  int32_t slots[kMaxRowsPerThread];
#pragma unroll
  for (int k = 0; k < kMaxRowsPerThread; ++k) {
    const int j = threadIdx.x + k * kThreads;
    slots[k] = j < rows ? index_row[row_begin + j] : -1;
  }
#pragma unroll
  for (int k = 0; k < kMaxRowsPerThread; ++k) {
    const int j = threadIdx.x + k * kThreads;
    if (j >= chunks * kChunkRows) break;  // whole warps: chunks * 64 % 32 == 0
    int64_t offset = -1;
    if (j < rows) {
      offset = sparse_mla_row_offset(p, slots[k]);
      out_of_range += slots[k] >= p.capacity;
    }
    if constexpr (kStream) {
      s.row_offset16[j] = offset >= 0 ? static_cast<uint32_t>(offset >> 4) : kNoRow;  // the launch checked the span
    } else {
      s.row_offset[j] = offset;
    }
    mark_valid_rows(s.valid_rows, j, offset >= 0, lane);
  }
  if (group == 0) count_out_of_range(p, out_of_range, lane);

  __syncthreads();  // row offsets and masks
  // The chunks with a valid entry: bit n of `listed` for this CTA's chunk n,
  // from two ballots over the masks in every warp (a CTA has at most 36
  // chunks), so that every thread knows the first two (its first loads) and
  // warp 0 lists them all for the loop, one lane per chunk; a serial walk by
  // one thread took microseconds over a whole item's 32 chunks.
  // kWholeItem: each listed chunk's split (the CTA's chunk n is the item's
  // chunk first_chunk_here + n, in split ((first_chunk_here + n + 1) S - 1) / C:
  // splits take chunks [s C / S, (s + 1) C / S)) and whether it is the last
  // listed chunk of that split.
  static_assert(kMaxStreamChunks <= 64 && kMaxChunks <= 64, "a 64-bit mask of chunks");
  auto split_of = [&](int chunk) { return ((first_chunk_here + chunk + 1) * splits - 1) / total_chunks; };
  const uint64_t listed = listed_chunks(s.valid_rows, chunks, lane);
  const int chunk_count = __popcll(listed);
  const int first_chunk = chunk_count > 0 ? __ffsll(static_cast<long long>(listed)) - 1 : 0;
  const int second_chunk = chunk_count > 1 ? __ffsll(static_cast<long long>(listed & (listed - 1))) - 1 : 0;
  if (threadIdx.x < 32) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int chunk = lane + 32 * half;
      if (((listed >> chunk) & 1) == 0) continue;
      const int index = listed_before(listed, chunk);
      s.chunk_list[index] = chunk;
      if constexpr (kStream) {
        const uint64_t later = listed & ~((uint64_t(2) << chunk) - 1);  // listed after this one (2 << 63 is 0)
        s.chunk_split[index] = split_of(chunk);
        s.ends_split[index] = later == 0 || split_of(__ffsll(static_cast<long long>(later)) - 1) != split_of(chunk);
      }
    }
  }
  // This thread's pieces of `chunk` (zeros for invalid rows: a NaN code left
  // in the tile would turn p = 0 into NaN in P.V); pieces[k]: row
  // piece_row<kConverters>(k), dims 16 piece..
  auto load_chunk = [&](int chunk, auto& pieces) {
    constexpr int kConverters = kChunkPieces / (sizeof(pieces) / sizeof(pieces[0]));
#pragma unroll
    for (int k = 0; k < kChunkPieces / kConverters; ++k) {
      const int row = chunk * kChunkRows + piece_row<kConverters>(k);
      if constexpr (kStream) {
        const uint32_t offset16 = s.row_offset16[row];
        pieces[k] =
            offset16 != kNoRow ? load_streaming(p.cache + int64_t(offset16) * 16 + piece * 16) : make_uint4(0, 0, 0, 0);
      } else {
        const int64_t offset = s.row_offset[row];
        pieces[k] = offset >= 0 ? load_streaming(p.cache + offset + piece * 16) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Warpgroup 1's pieces of the next chunk, held from here to its conversion
  // (the second chunk's requested together with the first).
  constexpr int kConverters = kThreads / 2;
  uint4 codes[kChunkPieces / kConverters];
  if (chunk_count > 0) {
    uint4 first[kPieces];
    load_chunk(first_chunk, first);
    if (warpgroup == 1 && chunk_count > 1) load_chunk(second_chunk, codes);
    store_pieces_as_f16<kThreads>(q_codes, q_tile);
    store_pieces_as_f16<kThreads>(first, tiles);
  } else {
    store_pieces_as_f16<kThreads>(q_codes, q_tile);
  }
  wgmma::fence_shared_for_async_proxy();  // this thread's q and tile stores, before the wgmmas read them
  __syncthreads();                        // q, tile 0 and the chunk list

  float out[128];  // O_w [64 heads x 256 dims 256 w..]: head 16 warp + g + 8 ((e / 2) % 2), dim 256 w + 8 (e / 4) + 2 c + e % 2
#pragma unroll
  for (int e = 0; e < 128; ++e) out[e] = 0.0f;
  float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // heads 16 warp + g + 8 r

  // Level 1, the values pushed through global memory (L2): measured faster
  // than into the owners' shared memory (distributed shared memory moved ~25
  // GB/s per SM), and the CTA's tiles stay its own, so no barrier before the
  // push (only the statistics, 512 bytes, go through distributed shared
  // memory with hardware clusters, once every CTA has started). The
  // combine's unit is a quarter of a head's output (128 dims): rank k owns
  // units [k U / n, (k + 1) U / n) of the group's U = 256 (n = cluster_size,
  // a power of two). A thread's accumulators cover 4 units (2 heads x 2
  // quarters), 32 values each: divided by its sum, in FP16 (|O / sum| <= 448,
  // the largest code; relative rounding 2^-11), 4 16-byte stores per unit
  // into this split's slot of split_partials.
  // Units per CTA that combines: kUnits / ctas_per_item (one rank's share;
  // all of them when one CTA runs the whole item).
  const int share = kUnits / ctas_per_item;
  auto group_index = [&] { return int64_t(token) * launch.groups + group; };
  auto split_values = [&](int split_r) {  // [unit][slot] of split split_r of this (token, group)
    return reinterpret_cast<uint4*>(p.split_partials + (group_index() * splits + split_r) * kSplitPartialFloats);
  };
  auto split_stats = [&](int split_r) {  // [max, sum][head]
    return p.split_partials + (group_index() * splits + split_r) * kSplitPartialFloats + kUnits * kUnitSlots * 4;
  };
  float(*coefficient)[kHeads] =
      reinterpret_cast<float(*)[kHeads]>(s.q_tile);  // [rank or cluster][head - first_local_head]
  // This warpgroup's half of split split_r's partials (warpgroup 0 also its
  // statistics), from its accumulators and the split's final (max, sum).
  auto store_partials = [&](int split_r, const float(&final_max)[2], const float(&final_sum)[2]) {
    // kWholeItem calls this at split ends inside the chunk loop: there the
    // thread's coordinates are read again (asm volatile), else the 16 store
    // addresses derived from threadIdx.x are hoisted out of the loop and held,
    // or spilled, through it.
    uint32_t tid = threadIdx.x;
    if constexpr (kStream) asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    const int warp = (tid % 128) / 32, g = (tid % 32) / 4, c = tid % 4;
    uint4* const values = split_values(split_r);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float inverse_sum = final_sum[r] == 0.0f ? 0.0f : __frcp_rn(final_sum[r]);  // 0: no valid entry, O = 0
      const int head = 16 * warp + g + 8 * r;
#pragma unroll
      for (int quarter = 0; quarter < 2; ++quarter) {
        const int unit = head * (kLatent / kUnitDims) + warpgroup * 2 + quarter;
        uint4* const target = values + unit * kUnitSlots;
#pragma unroll
        for (int j = 0; j < kUnitDims / 8; j += 4) {  // 8-dim column groups j..j + 3 of the quarter
          uint32_t pairs[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int e = 4 * (quarter * (kUnitDims / 8) + j + u) + 2 * r;  // dims 8 (j + u) + 2 c, + 1 of the head
            const __half2 halves = __floats2half2_rn(out[e] * inverse_sum, out[e + 1] * inverse_sum);
            pairs[u] = *reinterpret_cast<const uint32_t*>(&halves);
          }
          target[unit_slot(j, c)] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
        }
      }
    }
    if (warpgroup == 0 && c == 0) {
      if constexpr (kMeeting == Meeting::kClusterBarrier) {  // into the shared memory of the head's combining rank
        const int heads_per_rank = kHeads / cluster_size;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int head = 16 * warp + g + 8 * r, slot = rank * heads_per_rank + head % heads_per_rank;
          cluster_store(cluster_map(shared_address(&s.peer_stats[0][slot]), head / heads_per_rank), final_max[r]);
          cluster_store(cluster_map(shared_address(&s.peer_stats[1][slot]), head / heads_per_rank), final_sum[r]);
        }
      } else {
        float* const stats = split_stats(split_r);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          stats[16 * warp + g + 8 * r] = final_max[r];
          stats[kHeads + 16 * warp + g + 8 * r] = final_sum[r];
        }
      }
    }
  };

  if (warpgroup == 0) {
    // Warpgroup 0: S, the softmax, P (registers and shared memory), O_left.
    for (int i = 0; i < chunk_count; ++i) {
      if (i > 0)
        mbarrier_wait(tile_ready, phases.tile_ready + i - 1);  // tile i converted by warpgroup 1 (tile 0: above)
      const int chunk = s.chunk_list[i];
      const uint32_t tile = tiles + (i % 2) * kTileBytes;
      // S = Q K^T over the chunk's 64 entries: 16-dim steps along the 128-byte rows of each panel.
      float score[32];  // S [64 heads x 64 entries]: head 16 warp + g + 8 ((e / 2) % 2), entry 8 (e / 4) + 2 c + e % 2
#pragma unroll
      for (int e = 0; e < 32; ++e) score[e] = 0.0f;
      wgmma::fence_operands(score);
      wgmma::fence();
#pragma unroll
      for (int step = 0; step < kLatent / 16; ++step) {
        const uint32_t k_offset = (step / 4) * kPanelBytes + (step % 4) * 32;
        wgmma::mma_m64n64k16_f16(score, wgmma::k_major_sw128_descriptor(q_tile + k_offset),
                                 wgmma::k_major_sw128_descriptor(tile + k_offset), step > 0);
      }
      wgmma::commit_group();
      wgmma::wait_group<0>();
      wgmma::fence_operands(score);

      float base[2], rescale[2];
      scale_and_fold_max(score, s.valid_rows[chunk], score_scale, c, run_max, base, rescale);
      uint32_t fragments[kChunkRows / 16][4];  // [k16 step][FP16 pair]: P as O_left's A fragments
      store_probabilities_and_sums(score, base, rescale, shared_address(s.p_tiles[i % 2]), s.rescale[i % 2], warp, g, c,
                                   fragments, run_sum);
      if (kStream && c == 0 && s.ends_split[i]) {  // the split's statistics, for warpgroup 1's stores
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          s.split_max[i % 2][16 * warp + g + 8 * r] = run_max[r];
          s.split_sum[i % 2][16 * warp + g + 8 * r] = run_sum[r];
        }
      }
      wgmma::fence_shared_for_async_proxy();  // P, before warpgroup 1's wgmmas read it
      mbarrier_arrive(p_ready(i));
#pragma unroll
      for (int e = 0; e < 128; ++e) out[e] *= rescale[(e / 2) % 2];
      // O_left += P V[:, 0:256]: V is the tile read N-major.
      wgmma::fence_operands(out);
      wgmma::fence();
#pragma unroll
      for (int t = 0; t < kChunkRows / 16; ++t) {
        wgmma::mma_m64n256k16_f16_a_in_registers_b_n_major(
            out, fragments[t], wgmma::n_major_sw128_descriptor(tile + t * 16 * 128, kPanelBytes), true);
      }
      wgmma::commit_group();
      wgmma::wait_group<0>();
      wgmma::fence_operands(out);
      if (kStream && s.ends_split[i]) {  // the split is done: its partials, then a fresh start
        store_partials(s.chunk_split[i], run_max, run_sum);
#pragma unroll
        for (int e = 0; e < 128; ++e) out[e] = 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r) run_max[r] = -INFINITY, run_sum[r] = 0.0f;
      }
    }
    if (c == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s.final_max[16 * warp + g + 8 * r] = run_max[r];
        s.final_sum[16 * warp + g + 8 * r] = run_sum[r];
      }
    }
  } else {
    // Warpgroup 1: O_right += P V[:, 256:512] with P from shared memory,
    // converting the next chunk while those wgmmas run. Tile 1 is free
    // from the start, so chunk 1 is converted under chunk 0's S; chunk i + 1
    // (i >= 1) goes into the tile of chunk i - 1 once warpgroup 0 is done
    // with it (P of chunk i ready).
    auto convert_next = [&](int i) {  // chunk i + 1, from the registers, into the other tile
      store_pieces_as_f16<kConverters>(codes, tiles + ((i + 1) % 2) * kTileBytes);
      wgmma::fence_shared_for_async_proxy();
      mbarrier_arrive(tile_ready);
    };
    auto load_ahead = [&](int i) {  // chunk i + 2 into the registers, once chunk i + 1 has left them
      if (i + 2 < chunk_count) load_chunk(s.chunk_list[i + 2], codes);
    };
    auto ends_split = [&](int i) { return kStream && i < chunk_count && s.ends_split[i] != 0; };
    if (chunk_count > 1) convert_next(0);
    load_ahead(0);
    for (int i = 0; i < chunk_count; ++i) {
      mbarrier_wait(p_ready(i), p_ready_phase(i));  // P and the rescale of chunk i; warpgroup 0 is done with tile i - 1
      const uint32_t tile = tiles + (i % 2) * kTileBytes;
      const float rescale0 = s.rescale[i % 2][16 * warp + g], rescale1 = s.rescale[i % 2][16 * warp + g + 8];
#pragma unroll
      for (int e = 0; e < 128; ++e) out[e] *= (e / 2) % 2 ? rescale1 : rescale0;
      const uint32_t p_tile = shared_address(s.p_tiles[i % 2]);
      wgmma::fence_operands(out);
      wgmma::fence();
#pragma unroll
      for (int t = 0; t < kChunkRows / 16; ++t) {
        wgmma::mma_m64n256k16_f16_b_n_major(
            out, wgmma::k_major_sw128_descriptor(p_tile + t * 32),
            wgmma::n_major_sw128_descriptor(tile + (kWarpgroupDims / 64) * kPanelBytes + t * 16 * 128, kPanelBytes),
            true);
      }
      wgmma::commit_group();
      if (i >= 1 && i + 1 < chunk_count) {  // overlaps the tensor cores
        convert_next(i);
        load_ahead(i);
      }
      wgmma::wait_group<0>();
      wgmma::fence_operands(out);
      if (ends_split(i)) {  // the split is done: its partials, then a fresh start
        float split_max[2], split_sum[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          split_max[r] = s.split_max[i % 2][16 * warp + g + 8 * r];
          split_sum[r] = s.split_sum[i % 2][16 * warp + g + 8 * r];
        }
        store_partials(s.chunk_split[i], split_max, split_sum);
#pragma unroll
        for (int e = 0; e < 128; ++e) out[e] = 0.0f;
      }
    }
  }
  phases.p_ready += chunk_count;                 // warpgroup 0 arrives once per chunk
  phases.tile_ready += max(chunk_count - 1, 0);  // warpgroup 1 once per chunk after the first
  if constexpr (!kStream) {
    __syncthreads();  // warpgroup 0's statistics
    if (warpgroup == 1) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        run_max[r] = s.final_max[16 * warp + g + 8 * r];
        run_sum[r] = s.final_sum[16 * warp + g + 8 * r];
      }
    }
    // Every CTA of the cluster has started (its arrive at the kernel's start):
    // its shared memory may receive statistics.
    if constexpr (kMeeting == Meeting::kClusterBarrier) cluster_wait();
    store_partials(split, run_max, run_sum);
  } else {
    // Splits without a valid entry: the partials their own CTA would store
    // (zeros, max -inf, sum 0).
    for (int empty = split; empty < split + splits_here; ++empty) {
      bool has_rows = false;
      for (int chunk = empty * total_chunks / splits; chunk < (empty + 1) * total_chunks / splits; ++chunk) {
        has_rows |= s.valid_rows[chunk - first_chunk_here] != 0;
      }
      if (has_rows) continue;
      uint4* const values = split_values(empty);
      for (int k = threadIdx.x; k < kUnits * kUnitSlots; k += kThreads) values[k] = make_uint4(0, 0, 0, 0);
      if (threadIdx.x < kHeads) {
        split_stats(empty)[threadIdx.x] = -INFINITY;
        split_stats(empty)[kHeads + threadIdx.x] = 0.0f;
      }
    }
  }

  // Every split of the cluster has pushed; the meeting's release / acquire
  // (the cluster barrier, or a counter; with one CTA per item a fence) makes
  // the pushes visible (the values read below through L2, ld.global.cg; with
  // hardware clusters the statistics from this CTA's shared memory).
  // Read again (in L2 since the item's start) under the meeting: held through
  // the item, it spilled in the persistent instance.
  const float k_scale = *p.k_scale;
  int* const counters = p.split_counters + group_index() * kCountersPerGroup;  // [level 2 ranks | level 1 clusters]
  int* const meeting = counters + kMaxClusterSize + cluster_index;
  int before_departure = 0;
  if constexpr (kMeeting == Meeting::kCounter) {
    before_departure = meet(meeting, cluster_size);
  } else if constexpr (kMeeting == Meeting::kClusterBarrier) {
    cluster_arrive_release();
    cluster_wait();
  } else if (ctas_per_item > 1) {
    before_departure = meet(meeting, ctas_per_item);  // the item's CTAs, resident together (cooperative launch)
  } else {
    __threadfence();  // every split's partials, stored by this CTA, in L2 (read with ld.global.cg)
    __syncthreads();
  }

  // This CTA's units are whole heads: [first_local_head, + local_heads).
  const int first_unit = (kStream ? split / splits_here : rank) * share;
  const int local_heads = share / (kLatent / kUnitDims);
  const int first_local_head = first_unit / (kLatent / kUnitDims);
  // With more than one cluster: the cluster's slot of split_partials, [unit][slot][8 dims] sums then
  // [max, sum][head] statistics.
  // Level-2 slots follow every (token, group)'s level-1 slots.
  float* const level2 = p.split_partials + int64_t(launch.items) * splits * kSplitPartialFloats;
  const int64_t group_slot = group_index() * clusters;
  float* const cluster_partials = level2 + (group_slot + cluster_index) * kClusterPartialFloats;
  float* const cluster_stats = cluster_partials + kUnits * kUnitDims;

  // Coefficients of `count` parts (ranks or clusters) whose (max, sum) of
  // head h lane r < count reads with part_stats(r, h): one warp per local
  // head; the max and the weighted sum over the parts by a fixed butterfly
  // (every lane ends with the same bits); the coefficient of part r is
  // scale 2^(max_r - max) sum_r / sum. Returns per head (lane 0 of its warp
  // calls `statistics(h, max, sum)`) the combined max and sum.
  auto coefficients = [&](int count, float scale, auto&& part_stats, auto&& statistics) {
    // A warp's heads (8 when one CTA combines the whole item) read at once:
    // one L2 round trip instead of one per head.
    constexpr int kMaxHeadsPerWarp = kHeads / (kThreads / 32);
    float part_max[kMaxHeadsPerWarp], part_sum[kMaxHeadsPerWarp];
#pragma unroll
    for (int k = 0; k < kMaxHeadsPerWarp; ++k) {
      const int local = threadIdx.x / 32 + k * (kThreads / 32);
      part_max[k] = -INFINITY, part_sum[k] = 0.0f;
      if (local < local_heads && lane < count) part_stats(lane, first_local_head + local, &part_max[k], &part_sum[k]);
    }
#pragma unroll
    for (int k = 0; k < kMaxHeadsPerWarp; ++k) {
      const int local = threadIdx.x / 32 + k * (kThreads / 32);
      if (local >= local_heads) break;
      const int h = first_local_head + local;
      float total_max = part_max[k];
#pragma unroll
      for (int offset = 16; offset >= 1; offset /= 2) {
        total_max = max_propagating_nan(total_max, __shfl_xor_sync(0xFFFFFFFFu, total_max, offset));
      }
      const float weighted = total_max == -INFINITY ? 0.0f : part_sum[k] * exp2f(part_max[k] - total_max);
      float total_sum = weighted;
#pragma unroll
      for (int offset = 16; offset >= 1; offset /= 2) total_sum += __shfl_xor_sync(0xFFFFFFFFu, total_sum, offset);
      // No valid entry: every coefficient 0, the output +0, lse -inf.
      const float factor = total_max == -INFINITY ? 0.0f : num::div_rn(scale, total_sum);
      if (lane < count) coefficient[lane][local] = weighted * factor;
      if (lane == 0) statistics(h, total_max, total_sum);
    }
  };
  // The final outputs of head h (all of this CTA's units are final when called).
  auto write_lse = [&](int h, float total_max, float total_sum) {
    p.lse[int64_t(token) * p.heads + first_head + h] =
        total_max == -INFINITY ? -INFINITY : total_max * kLn2 + logf(total_sum);
  };
  // Item i of this CTA: unit first_unit + i / kUnitSlots, 16-byte slot i % kUnitSlots, holding dims
  // 8 (4 (slot / 4) + u) + 2 (slot % 4), + 1 for u = 0..3 of the unit.
  auto write_latent = [&](int item, const float (&total)[8]) {
    const int unit = first_unit + item / kUnitSlots, slot = item % kUnitSlots, h = unit / (kLatent / kUnitDims);
    uint16_t* row = p.latent + token * p.latent_token_stride + int64_t(first_head + h) * kLatent +
                    (unit % (kLatent / kUnitDims)) * kUnitDims + 2 * (slot % 4);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      *reinterpret_cast<uint32_t*>(row + 8 * (4 * (slot / 4) + u)) =
          uint32_t(num::float_to_bf16(total[2 * u])) | (uint32_t(num::float_to_bf16(total[2 * u + 1])) << 16);
    }
  };

  // Level 1: this CTA's units over the cluster's ranks, in rank order. With
  // one cluster the coefficients carry k_scale and the sums are the output;
  // otherwise they are this cluster's O / sum, for level 2.
  const bool single_cluster = clusters == 1;
  coefficients(
      cluster_size, single_cluster ? k_scale : 1.0f,
      [&](int r, int h, float* part_max, float* part_sum) {
        if constexpr (kMeeting == Meeting::kClusterBarrier) {
          *part_max = s.peer_stats[0][r * local_heads + h - first_local_head];
          *part_sum = s.peer_stats[1][r * local_heads + h - first_local_head];
        } else {
          const float* stats = split_stats(cluster_index * cluster_size + r);
          *part_max = __ldcg(stats + h);
          *part_sum = __ldcg(stats + kHeads + h);
        }
      },
      [&](int h, float total_max, float total_sum) {
        if (single_cluster) {
          write_lse(h, total_max, total_sum);
        } else {
          cluster_stats[h] = total_max;
          cluster_stats[kHeads + h] = total_sum;
        }
      });
  __syncthreads();
  // total += weight * a rank's 16-byte slot (8 FP16 values), one fmaf each:
  // the level-1 sum's step, in rank order by both loops below.
  auto add_rank = [](float(&total)[8], float weight, const uint4& x) {
    const uint32_t pairs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float2 values = __half22float2(*reinterpret_cast<const __half2*>(&pairs[u]));
      total[2 * u] = fmaf(values.x, weight, total[2 * u]);
      total[2 * u + 1] = fmaf(values.y, weight, total[2 * u + 1]);
    }
  };
  if constexpr (kStream) {
    // This CTA's share of the item (all of it when it ran every split), 16
    // slots per thread when it is all: two at a time, every split of both
    // requested at once (the loop below keeps four reads in flight: 64 L2
    // round trips per thread here, against 8).
    constexpr int kAtOnce = 2;
    // Whole rounds while at most 8 CTAs share an item (the launch's limit).
    static_assert(kUnits / 8 * kUnitSlots % (kAtOnce * kThreads) == 0, "whole rounds");
    for (int first_item = threadIdx.x; first_item < share * kUnitSlots; first_item += kAtOnce * kThreads) {
      uint4 values[kAtOnce][kMaxClusterSize];
#pragma unroll
      for (int a = 0; a < kAtOnce; ++a) {
#pragma unroll
        for (int r = 0; r < kMaxClusterSize; ++r) {
          if (r < cluster_size) {
            values[a][r] = load_l2_last_use(split_values(r) + first_unit * kUnitSlots + first_item + a * kThreads);
          }
        }
      }
#pragma unroll
      for (int a = 0; a < kAtOnce; ++a) {
        const int item = first_item + a * kThreads;
        const int h = item / kUnitSlots / (kLatent / kUnitDims);
        float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < kMaxClusterSize; ++r) {
          if (r >= cluster_size) break;
          add_rank(total, coefficient[r][h], values[a][r]);
        }
        write_latent(item, total);
      }
    }
  } else {
    for (int item = threadIdx.x; item < share * kUnitSlots; item += kThreads) {
      const int i = item / kUnitSlots, slot = item % kUnitSlots;
      const int h = (first_unit + i) / (kLatent / kUnitDims);
      float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int r = 0; r < cluster_size; ++r) {
        add_rank(
            total, coefficient[r][h - first_local_head],
            load_l2_last_use(split_values(cluster_index * cluster_size + r) + (first_unit + i) * kUnitSlots + slot));
      }
      if (single_cluster) {
        write_latent(item, total);
      } else {
        float4* target = reinterpret_cast<float4*>(cluster_partials + ((first_unit + i) * kUnitSlots + slot) * 8);
        target[0] = make_float4(total[0], total[1], total[2], total[3]);
        target[1] = make_float4(total[4], total[5], total[6], total[7]);
      }
    }
  }
  if constexpr (kPersistent) reset_meeting(meeting, cluster_size, before_departure);
  if (kStream && ctas_per_item > 1) reset_meeting(meeting, ctas_per_item, before_departure);
  if (kStream || single_cluster) return;

  // Level 2. Count this CTA in its rank's counter once all its writes are
  // visible device-wide (each thread fences its own); the last to arrive
  // resets the counter for the next launch and combines.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = counters + rank;
    s.combines_clusters = atomicAdd(counter, 1) == clusters - 1;
    if (s.combines_clusters) *counter = 0;
    __threadfence();
  }
  __syncthreads();
  if (!s.combines_clusters) return;
  const float* const group_partials = level2 + group_slot * kClusterPartialFloats;
  coefficients(
      clusters, k_scale,
      [&](int cluster_r, int h, float* part_max, float* part_sum) {
        const float* stats = group_partials + int64_t(cluster_r) * kClusterPartialFloats + kUnits * kUnitDims;
        *part_max = __ldcg(stats + h);
        *part_sum = __ldcg(stats + kHeads + h);
      },
      write_lse);
  __syncthreads();
  for (int item = threadIdx.x; item < share * kUnitSlots; item += kThreads) {
    const int i = item / kUnitSlots, slot = item % kUnitSlots;
    const int h = (first_unit + i) / (kLatent / kUnitDims);
    float total[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int cluster_r = 0; cluster_r < clusters; ++cluster_r) {
      const float weight = coefficient[cluster_r][h - first_local_head];
      const float4* source = reinterpret_cast<const float4*>(group_partials + int64_t(cluster_r) * kClusterPartialFloats +
                                                             ((first_unit + i) * kUnitSlots + slot) * 8);
      const float4 low = __ldcg(source), high = __ldcg(source + 1);
      const float values[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
      for (int d = 0; d < 8; ++d) total[d] = fmaf(values[d], weight, total[d]);
    }
    write_latent(item, total);
  }
}

// Meeting::kCounter (cooperative launch): CTA b runs split b % splits of the
// items (token, group) = b / splits, + gridDim.x / splits, ...: a fixed
// sequence per CTA, so the cluster_size CTAs of a cluster meet on the same
// item. kClusterBarrier (grid (splits, groups, m) in hardware clusters of
// cluster_size CTAs along x): CTA (split, group, token) runs that one item.
// kWholeItem (one-cluster plans; grid: n = splits / splits_per_cta CTAs per
// item, cooperative when n > 1): CTA b streams splits_per_cta consecutive
// splits of item b / n from split (b % n) splits_per_cta, then combines its
// share.
template <Meeting kMeeting>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_mla_wgmma_kernel(const SparseMlaParams p, const WgmmaLaunch launch) {
  extern __shared__ uint8_t shared_raw[];
  // Aligned up to 1024 bytes (the swizzle atoms).
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(shared_raw + (1024 - shared_address(shared_raw) % 1024) % 1024);
  // Every input is written by a predecessor in the decode chain (absorb, cache write, indexer).
  pdl_wait();
  pdl_release_dependents();
  if (threadIdx.x == 0) {  // made visible by the item's first barrier
    mbarrier_init(shared_address(&s.p_ready[0]), kThreads / 2);
    mbarrier_init(shared_address(&s.p_ready[1]), kThreads / 2);
    mbarrier_init(shared_address(&s.tile_ready), kThreads / 2);
  }
  HandoverPhases phases;
  if constexpr (kMeeting == Meeting::kCounter) {
    const int split = blockIdx.x % launch.splits, items_at_once = gridDim.x / launch.splits;
    for (int item = blockIdx.x / launch.splits; item < launch.items; item += items_at_once) {
      sparse_mla_wgmma_item<kMeeting>(s, p, launch, split, item / launch.groups, item % launch.groups, phases);
    }
  } else if constexpr (kMeeting == Meeting::kWholeItem) {
    const int ctas_per_item = launch.splits / launch.splits_per_cta, item = blockIdx.x / ctas_per_item;
    sparse_mla_wgmma_item<kMeeting>(s, p, launch, (blockIdx.x % ctas_per_item) * launch.splits_per_cta,
                                    item / launch.groups, item % launch.groups, phases);
  } else {
    cluster_arrive_relaxed();  // this CTA has started: peers may push statistics into its shared memory
    sparse_mla_wgmma_item<kMeeting>(s, p, launch, blockIdx.x, blockIdx.z, blockIdx.y, phases);
  }
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

int largest_power_of_two_at_most(int n) {
  int power = 1;
  while (power * 2 <= n) power *= 2;
  return power;
}

bool valid_max_cluster(int max_cluster) { return max_cluster == 4 || max_cluster == 8 || max_cluster == 16; }

SparseMlaWgmmaSplits sparse_mla_wgmma_splits(int top_k, int max_splits, int max_cluster) {
  SparseMlaWgmmaSplits plan;
  const int chunks = ceil_div(std::max(top_k, 1), kChunkRows);  // K below the contract's range: one chunk
  const int splits = std::max(1, std::min(max_splits, chunks));
  // A power of two: the level-1 owners' units are whole heads.
  plan.cluster_size = largest_power_of_two_at_most(std::min(splits, std::clamp(max_cluster, 1, kMaxClusterSize)));
  plan.splits = splits - splits % plan.cluster_size;
  plan.clusters = plan.splits / plan.cluster_size;
  plan.max_chunks = ceil_div(chunks, plan.splits);
  return plan;
}

int64_t sparse_mla_wgmma_partials_count(int64_t m, int64_t heads, int top_k, int max_splits, int max_cluster) {
  if (heads % kHeads != 0) return 0;
  const SparseMlaWgmmaSplits plan = sparse_mla_wgmma_splits(top_k, max_splits, max_cluster);
  return m * (heads / kHeads) *
         (int64_t(plan.splits) * kSplitPartialFloats + (plan.clusters == 1 ? 0 : plan.clusters * kClusterPartialFloats));
}

namespace {

// The shared-memory limit of the three instances of sparse_mla_wgmma's kernel.
Status prepare_kernels() {
  DSA_RETURN_IF_ERROR(
      raise_shared_memory_limit(reinterpret_cast<const void*>(sparse_mla_wgmma_kernel<Meeting::kClusterBarrier>),
                                kSharedBytes, "sparse_mla_wgmma"));
  DSA_RETURN_IF_ERROR(
      raise_shared_memory_limit(reinterpret_cast<const void*>(sparse_mla_wgmma_kernel<Meeting::kWholeItem>),
                                kSharedBytes, "sparse_mla_wgmma (whole items)"));
  return raise_shared_memory_limit(reinterpret_cast<const void*>(sparse_mla_wgmma_kernel<Meeting::kCounter>),
                                   kSharedBytes, "sparse_mla_wgmma (persistent)");
}

// The CTAs the device holds at once, and the hardware clusters of a plan's
// cluster size it holds at once: asked on the first call with that size
// (kByBatch's sizes depend on m, so that call may come inside a graph
// capture: the occupancy queries are legal there), then kept.
Status residency(int cluster_size, int* ctas, int* clusters) {
  const auto persistent = reinterpret_cast<const void*>(sparse_mla_wgmma_kernel<Meeting::kCounter>);
  DSA_RETURN_IF_ERROR(kernel_answer_once(
      persistent, 0,
      [](int* answer) {
        DSA_RETURN_IF_ERROR(prepare_kernels());  // the clusters' question below relies on it too
        int device = 0, sms = 0, per_sm = 0;
        DSA_CUDA_RETURN(cudaGetDevice(&device));
        DSA_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        DSA_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, sparse_mla_wgmma_kernel<Meeting::kCounter>, kThreads, kSharedBytes));
        *answer = sms * per_sm;
        return Status();
      },
      ctas));
  const auto clustered = reinterpret_cast<const void*>(sparse_mla_wgmma_kernel<Meeting::kClusterBarrier>);
  return kernel_answer_once(
      clustered, cluster_size,
      [&](int* answer) {
        if (cluster_size > 8) DSA_RETURN_IF_ERROR(allow_non_portable_clusters(clustered, "sparse_mla_wgmma"));
        DSA_CUDA_RETURN(occupancy_max_active_clusters(sparse_mla_wgmma_kernel<Meeting::kClusterBarrier>,
                                                      dim3(cluster_size, 1, 1), dim3(kThreads), kSharedBytes,
                                                      unsigned(cluster_size), answer));
        return Status();
      },
      clusters);
}

}  // namespace

Status sparse_mla_wgmma_resident_ctas(int* ctas) {
  int clusters = 0;
  return residency(kSparseMlaWgmmaDefaultCluster, ctas, &clusters);
}

namespace {

// How a launch runs: when the device holds every item's hardware clusters at
// once, one CTA per (item, split) in hardware clusters (faster there: 1.2 us
// at m = 1, H = 64, docs/sparse_mla.md "v10"); otherwise persistent and
// cooperative, as many items at once as the device holds all splits of. The
// bits are the same either way. (Whole items are chosen before, in
// launch_with_plan.)
Status wgmma_launch_shape(int64_t m, int64_t groups, const SparseMlaWgmmaSplits& plan, dim3* grid,
                          bool* hardware_clusters) {
  const int64_t items = m * groups;
  int resident = 0, clusters = 0;
  DSA_RETURN_IF_ERROR(residency(plan.cluster_size, &resident, &clusters));
  *hardware_clusters = items * plan.clusters <= clusters;
  if (*hardware_clusters) {
    *grid = dim3(plan.splits, static_cast<unsigned>(groups), static_cast<unsigned>(m));
    return Status();
  }
  if (resident < plan.splits) {
    return unsupported("sparse_mla_wgmma: the device holds " + std::to_string(resident) +
                       " of its CTAs at once, fewer than the plan's " + std::to_string(plan.splits) +
                       " splits of one token, which must run together");
  }
  *grid = dim3(static_cast<unsigned>(std::min<int64_t>(items, resident / plan.splits) * plan.splits));
  return Status();
}

// Launches as wgmma_launch_shape says: `clustered` in hardware clusters or
// `persistent` cooperatively (two of sparse_mla_wgmma's three instances).
template <class... KernelArgs, class... Args>
Status launch_wgmma(void (*clustered)(KernelArgs...), void (*persistent)(KernelArgs...), dim3 grid,
                    bool hardware_clusters, int cluster_size, cudaStream_t stream, Args&&... args) {
  if (hardware_clusters) {
    return launch_pdl_clustered(clustered, grid, dim3(kThreads), kSharedBytes, stream, unsigned(cluster_size),
                                std::forward<Args>(args)...);
  }
  return launch_pdl_cooperative(persistent, grid, dim3(kThreads), kSharedBytes, stream, std::forward<Args>(args)...);
}

// When CTAs stream consecutive splits (Meeting::kWholeItem): kAuto by the
// item count (one CTA per item with many items, the grouped stream where one
// CTA per split takes more than one round); for the benchmark and tests,
// kAlways: one CTA per item at any m; kGroupedAlways: the fewest splits per
// CTA (2 or more) that put every item's CTAs on the GPU at once, where any do.
enum class WholeItems { kAuto, kAlways, kGroupedAlways };

Status launch_with_plan(const SparseMlaArgs& a, int max_splits, int max_cluster, WholeItems whole_items,
                        cudaStream_t stream) {
  if (!valid_max_cluster(max_cluster)) return invalid_argument("max_cluster", "4, 8 or 16", std::to_string(max_cluster));
  if (max_splits < 1 || max_splits > kSparseMlaWgmmaMaxSplits) {
    return invalid_argument("max_splits", "1.." + std::to_string(kSparseMlaWgmmaMaxSplits), std::to_string(max_splits));
  }
  // split_partials against this plan's count, not sparse_mla's.
  DSA_RETURN_IF_ERROR(check_sparse_mla_for_plan(a, max_splits, max_cluster));
  const int64_t m = a.q.size(0), heads = a.q.size(1);
  if (heads % kHeads != 0) {
    return invalid_argument("q", "a multiple of 64 heads in dim 1 (sparse_mla_wgmma)", a.q.describe());
  }
  const int top_k = static_cast<int>(a.indices.size(1));
  const SparseMlaWgmmaSplits plan = sparse_mla_wgmma_splits(top_k, max_splits, max_cluster);
  if (plan.max_chunks > kMaxChunks) {
    int fewest = 1;  // the smallest max_splits whose plan stages at most 16 chunks per CTA
    while (sparse_mla_wgmma_splits(top_k, fewest, max_cluster).max_chunks > kMaxChunks) ++fewest;
    return invalid_argument("max_splits",
                            "1.." + std::to_string(kSparseMlaWgmmaMaxSplits) + ", and at least " +
                                std::to_string(fewest) + " at K = " + std::to_string(top_k) +
                                " (at most 16 chunks of 64 entries per CTA)",
                            std::to_string(max_splits));
  }
  WgmmaLaunch launch{ceil_div(top_k, kChunkRows), plan.splits, plan.cluster_size, static_cast<int>(heads / kHeads),
                     static_cast<int>(m * (heads / kHeads))};
  // Many items, one cluster each: one CTA per item streams every split's
  // chunks (one prologue), stores each split's partials at its last chunk and
  // combines them itself (no meeting; about one round of CTAs at m = 128).
  // The whole item's row offsets are kept as 32-bit multiples of 16 bytes.
  const int64_t cache_bytes = a.kv_cache.span_elements();  // FP8: one byte each
  const bool streamable = launch.total_chunks <= kMaxStreamChunks && cache_bytes / 16 < int64_t(kNoRow);
  int resident = 0, clusters_at_once = 0;
  DSA_RETURN_IF_ERROR(residency(plan.cluster_size, &resident, &clusters_at_once));
  const bool many_items = int64_t(launch.items) * 4 >= int64_t(resident) * 3;
  const bool streams = plan.clusters == 1 && streamable;  // the two stream shapes below need both
  if (streams && (many_items || whole_items == WholeItems::kAlways)) {
    launch.splits_per_cta = plan.splits;
    return launch_pdl(sparse_mla_wgmma_kernel<Meeting::kWholeItem>, dim3(launch.items), dim3(kThreads), kSharedBytes,
                      stream, sparse_mla_params(a), launch);
  }
  // Between: when one CTA per split takes more than one round of the GPU,
  // each CTA streams several consecutive splits of an item (the fewest that
  // put every item's CTAs on the GPU at once: 2 to 8 CTAs per item), stores
  // each split's partials, meets the item's other CTAs at its counter
  // (cooperative launch: they are resident together) and combines its share.
  // The same bits: each split's partials come from a fresh start, the
  // combine is the same in split order.
  const bool one_round = int64_t(launch.items) * plan.splits <= resident;
  if (streams && (!one_round || whole_items == WholeItems::kGroupedAlways)) {
    for (int ctas_per_item = std::min(8, plan.splits / 2); ctas_per_item >= 2; ctas_per_item /= 2) {
      if (int64_t(launch.items) * ctas_per_item > resident) continue;
      launch.splits_per_cta = plan.splits / ctas_per_item;
      return launch_pdl_cooperative(sparse_mla_wgmma_kernel<Meeting::kWholeItem>, dim3(launch.items * ctas_per_item),
                                    dim3(kThreads), kSharedBytes, stream, sparse_mla_params(a), launch);
    }
  }
  dim3 grid;
  bool hardware_clusters = false;
  DSA_RETURN_IF_ERROR(wgmma_launch_shape(m, launch.groups, plan, &grid, &hardware_clusters));
  return launch_wgmma(sparse_mla_wgmma_kernel<Meeting::kClusterBarrier>, sparse_mla_wgmma_kernel<Meeting::kCounter>,
                      grid, hardware_clusters, plan.cluster_size, stream, sparse_mla_params(a), launch);
}

}  // namespace

Status sparse_mla_wgmma_with_plan(const SparseMlaArgs& a, int max_splits, int max_cluster, cudaStream_t stream) {
  return launch_with_plan(a, max_splits, max_cluster, WholeItems::kAuto, stream);
}

Status sparse_mla_wgmma_whole_items(const SparseMlaArgs& a, cudaStream_t stream) {
  return launch_with_plan(a, kSparseMlaWgmmaDefaultSplits, kSparseMlaWgmmaDefaultCluster, WholeItems::kAlways, stream);
}

Status sparse_mla_wgmma_grouped_splits(const SparseMlaArgs& a, cudaStream_t stream) {
  return launch_with_plan(a, kSparseMlaWgmmaDefaultSplits, kSparseMlaWgmmaDefaultCluster, WholeItems::kGroupedAlways,
                          stream);
}

int sparse_mla_wgmma_max_splits(int top_k, SparseMlaSplits splits) {
  constexpr int kHalf = kSparseMlaWgmmaDefaultSplits / 2;
  // kWholeRow beyond the producer kernel's K: kThroughput's plan.
  const bool half = (splits == SparseMlaSplits::kThroughput || splits == SparseMlaSplits::kWholeRow) &&
                    top_k <= kHalf * kMaxRowsPerSplit;
  return half ? kHalf : kSparseMlaWgmmaDefaultSplits;
}

int sparse_mla_wgmma_batch_max_splits(int top_k, int64_t items, int resident_ctas) {
  int splits = kSparseMlaWgmmaDefaultSplits;
  while (splits > 2 && items * splits > resident_ctas &&
         sparse_mla_wgmma_splits(top_k, splits / 2).max_chunks <= kMaxChunks) {
    splits /= 2;
  }
  return splits;
}

}  // namespace dsa
