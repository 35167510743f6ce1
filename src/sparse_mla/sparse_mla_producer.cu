// The producer sparse MLA decode kernel (sparse_mla_producer): one CTA per
// (token, 64 heads) item runs the item's whole index row, with the FP8 ->
// FP16 conversion of the rows taken off the warpgroups that compute. The
// contract is in include/dsa_decode/sparse_mla.h (SparseMlaSplits::kWholeRow,
// less the split buffers, which it does not use); why it exists and each
// measured version are in docs/sparse_mla.md ("v13": in sparse_mla_wgmma's
// stream the conversion in warpgroup 1 cost about as much as a chunk's S,
// softmax and P V together).
//
// Work split: item b = (token b / groups, heads 64 (b % groups)..+63) per
// CTA, its C = ceil(K / 64) chunks of 64 entries in order (chunks without a
// valid entry skipped). Nothing depends on m or on the GPU: every output
// bit of a token follows from its own q, index row and cache rows.
//
// Shared memory: FP16 q of the group and two chunk tiles (8 panels of 64
// dims, K-major, 128-byte swizzle: src/core/wgmma.cuh), P of two chunks, the
// row offsets and valid-row masks of the whole row (K <= 2304).
//
// Prologue (every thread): the index row into cache-row offsets (as 32-bit
// multiples of 16 bytes) and a valid-row mask per chunk, out-of-range
// entries counted once (by group 0's CTA); the list of chunks with a valid
// entry. Warpgroup 1 requests q's rows before that and converts them after.
//
// Roles, 384 threads (setmaxnreg: 232 / 168 / 104 registers, summing to the
// 504 a thread of each warpgroup gets at launch):
//  - warpgroup 2, the producer: the CTA's n-th listed chunk's rows from
//    global memory into registers (invalid rows as zeros: a NaN code left in
//    a tile would turn p = 0 into NaN), converted into tile n % 2 once both
//    other warpgroups are done with chunk n - 2 there (tile_free), announced
//    by tile_ready; chunk n + 1's rows are requested right after.
//  - warpgroup 0: S [64 heads][64 entries] = Q K^T by 32 wgmma m64n64k16;
//    scores = S * softmax_scale * q_scale * k_scale * log2(e), -inf for
//    invalid entries; the running max per head (NaN propagates); p = 2^(score
//    - max) rounded to FP16 into registers (O_left's A fragments) and, once
//    warpgroup 1 is done with chunk n - 2's (p_free), into p_tiles[n % 2]
//    with the rescale factors (p_ready); the running sum of the rounded p;
//    O_left [64 x 256] = O_left * rescale + P V[:, 0:256] by 4 wgmma
//    m64n256k16 (P from registers, V the tile read N-major). Each S done is
//    announced (scores_done).
//  - warpgroup 1: O_right = O_right * rescale + P V[:, 256:512] (P from
//    shared memory), chunk n's once warpgroup 0 has S of chunk n + 1: so it
//    runs under warpgroup 0's softmax, when the tensor cores would idle
//    (H200: 82.00 against 84.67 us at m = 128, 73.43 against 81.70 at
//    m = 1, H = 64, K = 2048).
// A rescale factor of exactly 1 is skipped warp by warp (no bit changes).
// Warpgroup 0's chain bounds the chunk (ncu, H200: its ~650 instructions
// a chunk, and warpgroup 1 idle half the time), not
// the loads: an L2 prefetch two chunks ahead and S of chunk n + 1 issued
// behind chunk n's P V were both slower (docs/sparse_mla.md, "v13").
// The handover protocol (barriers per slot, tile_free completed by both
// consumers) is modelled step by step in sparse_mla_producer_model_test.cpp
// and checked there over every interleaving; the model is written from this
// code, so a change to one is a change to the other.
//
// Epilogue: latent = O * (k_scale / sum) as BF16, lse = max ln 2 + ln(sum);
// a head with no valid entry gets latent +0 and lse -inf.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/fp8.cuh"
#include "core/launch.cuh"
#include "core/mbarrier.cuh"
#include "core/shared_memory.h"
#include "core/wgmma.cuh"
#include "dsa_decode/numerics.h"
#include "sparse_mla/sparse_mla_params.h"
#include "sparse_mla/sparse_mla_plan.h"
#include "sparse_mla/sparse_mla_wgmma_steps.cuh"

namespace dsa {
namespace {

using namespace sparse_mla_steps;  // what the two 64-head kernels share

constexpr int kThreads = 384;          // three warpgroups
constexpr int kStagingBytesPerWarp = 16 * 256 * 2;    // a consumer warp's 16 heads x 256 dims of BF16 latent
static_assert(8 * kStagingBytesPerWarp == kTileBytes, "the eight consumer warps' latent fills q's tile");
constexpr int kMaxChunks = kSparseMlaProducerMaxTopK / kChunkRows;
constexpr int kMaxRows = kMaxChunks * kChunkRows;
constexpr int kRowsPerThread = kChunkRows / 4;  // a converting warpgroup: warp w takes rows w, w + 4, ..
constexpr int kMaxRowsPerThread = (kMaxRows + kThreads - 1) / kThreads;  // the prologue's index entries per thread
// Registers per thread: 168 at launch (65536 / 384, rounded down to 8), then
// moved between the warpgroups by setmaxnreg; the three sum to 3 x 168.
constexpr int kLaunchRegisters = 168;
constexpr int kSoftmaxRegisters = 232, kProducerRegisters = 104;  // warpgroup 1 keeps 168
static_assert(kSoftmaxRegisters + kLaunchRegisters + kProducerRegisters == 3 * kLaunchRegisters, "the CTA's pool");
static_assert(kMaxChunks <= 64, "two ballots list the chunks");

struct alignas(1024) SharedStorage : TileStorage {
  uint32_t row_offset16[kMaxRows];             // byte offset / 16 of each entry's cache row, kNoRow when invalid
  uint64_t valid_rows[kMaxChunks];             // bit r: row r of chunk c is a valid entry
  int chunk_list[kMaxChunks];                  // the chunks with a valid entry, in order
  // Handover (sparse_mla_producer_model_test.cpp): phase n / 2 for the n-th
  // listed chunk on the barrier of slot n % 2; q_ready once.
  uint64_t q_ready;        // warpgroup 1 has converted q (128 arrivals)
  uint64_t tile_ready[2];  // the producer has converted the chunk (128)
  uint64_t tile_free[2];   // warpgroups 0 and 1 are done with the chunk's tile (256)
  uint64_t p_ready[2];     // warpgroup 0 has written P and the rescale factors (128)
  uint64_t p_free[2];      // warpgroup 1 is done with them (128)
  uint64_t scores_done[2];  // warpgroup 0 has the chunk's S (128): warpgroup 1's P V of the one before waits for it
  uint64_t stats_ready;    // warpgroup 0 has written final_max and final_sum (128)
};
constexpr int kSharedBytes = sizeof(SharedStorage) + 1024;  // + alignment of the dynamic base
static_assert(kSharedBytes <= 227 * 1024, "Hopper's largest shared memory per CTA");

template <int kRegisters>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (kRegisters > kLaunchRegisters) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
  } else if constexpr (kRegisters < kLaunchRegisters) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
  }
}

// 64 rows of FP8 codes held by a converting warpgroup: thread (warp w, lane
// l) holds the 16 bytes at dims 16 l.. of rows w + 4 k, k = 0..15
// (piece_row<128>), converted by store_pieces_as_f16<128>.
using RowCodes = uint4[kRowsPerThread];
static_assert(kRowsPerThread == kChunkPieces / 128, "one warpgroup's pieces");

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_producer_kernel(const SparseMlaParams p) {
  extern __shared__ uint8_t shared_raw[];
  // Aligned up to 1024 bytes (the swizzle atoms).
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(shared_raw + (1024 - shared_address(shared_raw) % 1024) % 1024);
  const int groups = p.heads / kHeads, token = blockIdx.x / groups, group = blockIdx.x % groups;
  const int first_head = group * kHeads;
  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  // Accumulator coordinates (wgmma::accumulator_row / _column): element e of
  // an m64nN result is head 16 warp + g + 8 ((e / 2) % 2), column 8 (e / 4) + 2 c + e % 2.
  const int g = lane / 4, c = lane % 4;
  const uint32_t q_tile = shared_address(s.q_tile);
  auto tile_of = [&](int n) { return shared_address(s.tiles[n % 2]); };
  auto barrier = [](uint64_t& b) { return shared_address(&b); };

  // Every input is written by a predecessor in the decode chain (absorb, cache write, indexer).
  pdl_wait();
  pdl_release_dependents();
  if (threadIdx.x == 0) {  // made visible by the barrier below
    mbarrier_init(barrier(s.q_ready), 128);
    mbarrier_init(barrier(s.stats_ready), 128);
    for (int slot = 0; slot < 2; ++slot) {
      mbarrier_init(barrier(s.tile_ready[slot]), 128);
      mbarrier_init(barrier(s.tile_free[slot]), 256);
      mbarrier_init(barrier(s.p_ready[slot]), 128);
      mbarrier_init(barrier(s.p_free[slot]), 128);
      mbarrier_init(barrier(s.scores_done[slot]), 128);
    }
  }
  if (threadIdx.x < kMaxChunks) s.valid_rows[threadIdx.x] = 0;
  // Warpgroup 1's rows of q (64 heads, converted after the prologue), in
  // flight while the indices are read.
  RowCodes q_codes;
  if (warpgroup == 1) {
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      q_codes[k] =
          load_streaming(p.q + token * p.q_token_stride + (first_head + warp + 4 * k) * p.q_head_stride + lane * 16);
    }
  }
  __syncthreads();

  // The index row: cache-row offsets and valid masks. A warp's 32 entries lie
  // in one chunk (chunks * 64 is a multiple of 32), so a ballot per warp.
  // Every entry of this thread requested at once (a loop would read one
  // round trip at a time).
  const int chunks = (p.top_k + kChunkRows - 1) / kChunkRows;
  const int32_t* index_row = p.indices + token * p.indices_token_stride;
  int32_t slots[kMaxRowsPerThread];
#pragma unroll
  for (int k = 0; k < kMaxRowsPerThread; ++k) {
    const int j = threadIdx.x + k * kThreads;
    slots[k] = j < p.top_k ? index_row[j] : -1;
  }
  unsigned int out_of_range = 0;
#pragma unroll
  for (int k = 0; k < kMaxRowsPerThread; ++k) {
    const int j = threadIdx.x + k * kThreads;
    if (j >= chunks * kChunkRows) break;  // whole warps: chunks * 64 % 32 == 0
    int64_t offset = -1;
    if (j < p.top_k) {
      offset = sparse_mla_row_offset(p, slots[k]);
      out_of_range += slots[k] >= p.capacity;
    }
    s.row_offset16[j] = offset >= 0 ? static_cast<uint32_t>(offset >> 4) : kNoRow;  // the launch checked the span
    mark_valid_rows(s.valid_rows, j, offset >= 0, lane);
  }
  if (group == 0) count_out_of_range(p, out_of_range, lane);
  __syncthreads();  // offsets and masks
  // The chunks with a valid entry, in order: every warp counts them (two
  // ballots), warp 0 lists them.
  const uint64_t listed = listed_chunks(s.valid_rows, chunks, lane);
  const int chunk_count = __popcll(listed);
  if (threadIdx.x < 32) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int chunk = lane + 32 * half;
      if ((listed >> chunk) & 1) s.chunk_list[listed_before(listed, chunk)] = chunk;
    }
  }
  __syncthreads();  // the chunk list

  // The consumers' end: latent = O * (k_scale / sum) per head (0 with no
  // valid entry) as BF16, lse by warpgroup 0's quad leaders. Each warpgroup
  // runs it in its own branch (its own registers). A warp's 16 heads x 256
  // dims go through its 8 KiB of q's tile (free: warpgroup 0 gets here after
  // its last S, warpgroup 1 after stats_ready, which follows that S), so
  // that each global store is one head's
  // 512 contiguous bytes: stored from the accumulator layout directly (16
  // bytes of 8 heads a store) the epilogue took ~5 us (H200 trace, 2026-12-01).
  auto write_outputs = [&](const float(&out)[128], const float(&total_max)[2], const float(&total_sum)[2]) {
    const float k_scale = *p.k_scale;
    float factor[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      factor[r] = total_max[r] == -INFINITY ? 0.0f : num::div_rn(k_scale, total_sum[r]);
      if (warpgroup == 0 && c == 0) {
        p.lse[int64_t(token) * p.heads + first_head + 16 * warp + g + 8 * r] =
            total_max[r] == -INFINITY ? -INFINITY : total_max[r] * kLn2 + logf(total_sum[r]);
      }
    }
    // [16 heads][32 units of 8 dims], 512 B a head, unit u of head h at u ^ (h % 8): the stores' 8 heads of
    // one unit fall on 8 different bank groups.
    const uint32_t staging = q_tile + (4 * warpgroup + warp) * kStagingBytesPerWarp;
#pragma unroll
    for (int e = 0; e < 128; e += 2) {
      const int r = (e / 2) % 2, unit = e / 4;
      store_shared_b32(staging + (g + 8 * r) * 512 + ((unit ^ g) * 16) + 4 * c,
                       uint32_t(num::float_to_bf16(out[e] * factor[r])) |
                           (uint32_t(num::float_to_bf16(out[e + 1] * factor[r])) << 16));
    }
    __syncwarp();
    uint16_t* const latent =
        p.latent + token * p.latent_token_stride + int64_t(first_head + 16 * warp) * kLatent + 256 * warpgroup;
#pragma unroll
    for (int h = 0; h < 16; ++h) {
      *reinterpret_cast<uint4*>(latent + h * kLatent + 8 * lane) =
          load_shared_v4(staging + h * 512 + ((lane ^ (h % 8)) * 16));
    }
  };

  if (warpgroup == 2) {
    set_max_registers<kProducerRegisters>();
    // This thread's 16 bytes of the rows of the n-th listed chunk.
    auto load_rows = [&](int n, RowCodes& codes) {
      const int chunk = s.chunk_list[n];
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k) {
        const uint32_t offset16 = s.row_offset16[chunk * kChunkRows + warp + 4 * k];
        codes[k] =
            offset16 != kNoRow ? load_streaming(p.cache + int64_t(offset16) * 16 + lane * 16) : make_uint4(0, 0, 0, 0);
      }
    };
    RowCodes codes;
    if (chunk_count > 0) load_rows(0, codes);
    for (int n = 0; n < chunk_count; ++n) {
      if (n >= 2) mbarrier_wait(barrier(s.tile_free[n % 2]), n / 2 - 1);  // both consumers done with chunk n - 2
      store_pieces_as_f16<128>(codes, tile_of(n));
      wgmma::fence_shared_for_async_proxy();  // before the consumers' wgmmas read the tile
      mbarrier_arrive(barrier(s.tile_ready[n % 2]));
      if (n + 1 < chunk_count) load_rows(n + 1, codes);
    }
  } else if (warpgroup == 0) {
    set_max_registers<kSoftmaxRegisters>();
    const float score_scale = p.softmax_scale * *p.q_scale * *p.k_scale * kLog2e;
    float out[128];  // O_left [64 heads x 256 dims]: head 16 warp + g + 8 ((e / 2) % 2), dim 8 (e / 4) + 2 c + e % 2
#pragma unroll
    for (int e = 0; e < 128; ++e) out[e] = 0.0f;
    float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};  // heads 16 warp + g + 8 r
    // Descriptors advance by adding (offset >> 4) to their start-address
    // field, which cannot carry out of it (shared addresses stay below
    // 2^18): two adds per wgmma instead of rebuilding each descriptor.
    const uint64_t q_descriptor = wgmma::k_major_sw128_descriptor(q_tile);
    mbarrier_wait(barrier(s.q_ready), 0);
    for (int n = 0; n < chunk_count; ++n) {
      const int chunk = s.chunk_list[n];
      const uint32_t tile = tile_of(n);
      mbarrier_wait(barrier(s.tile_ready[n % 2]), n / 2);
      // S = Q K^T over the chunk's 64 entries: 16-dim steps along the 128-byte rows of each panel.
      float score[32];  // S [64 heads x 64 entries]: head 16 warp + g + 8 ((e / 2) % 2), entry 8 (e / 4) + 2 c + e % 2
#pragma unroll
      for (int e = 0; e < 32; ++e) score[e] = 0.0f;
      wgmma::fence_operands(score);
      wgmma::fence();
      const uint64_t tile_descriptor = wgmma::k_major_sw128_descriptor(tile);
#pragma unroll
      for (int step = 0; step < kLatent / 16; ++step) {
        const uint64_t advance = ((step / 4) * kPanelBytes + (step % 4) * 32) >> 4;
        wgmma::mma_m64n64k16_f16(score, q_descriptor + advance, tile_descriptor + advance, step > 0);
      }
      wgmma::commit_group();
      wgmma::wait_group<0>();
      wgmma::fence_operands(score);
      // Warpgroup 1's P V of chunk n - 1 now runs under this softmax (the
      // tensor cores idle through it otherwise).
      mbarrier_arrive(barrier(s.scores_done[n % 2]));

      float base[2], rescale[2];
      scale_and_fold_max(score, s.valid_rows[chunk], score_scale, c, run_max, base, rescale);
      if (n >= 2) mbarrier_wait(barrier(s.p_free[n % 2]), n / 2 - 1);  // warpgroup 1 done with chunk n - 2's
      uint32_t fragments[kChunkRows / 16][4];  // [k16 step][FP16 pair]: P as O_left's A fragments
      store_probabilities_and_sums(score, base, rescale, shared_address(s.p_tiles[n % 2]), s.rescale[n % 2], warp, g, c,
                                   fragments, run_sum);
      wgmma::fence_shared_for_async_proxy();  // P, before warpgroup 1's wgmmas read it
      mbarrier_arrive(barrier(s.p_ready[n % 2]));
      // A factor of exactly 1 (the running max unchanged) changes no bit: the
      // multiplies are skipped when every factor of the warp is 1.
      if (!__all_sync(0xFFFFFFFFu, rescale[0] == 1.0f && rescale[1] == 1.0f)) {
#pragma unroll
        for (int e = 0; e < 128; ++e) out[e] *= rescale[(e / 2) % 2];
      }
      // O_left += P V[:, 0:256]: V is the tile read N-major.
      wgmma::fence_operands(out);
      wgmma::fence();
      const uint64_t v_left_descriptor = wgmma::n_major_sw128_descriptor(tile, kPanelBytes);
#pragma unroll
      for (int t = 0; t < kChunkRows / 16; ++t) {
        wgmma::mma_m64n256k16_f16_a_in_registers_b_n_major(out, fragments[t], v_left_descriptor + ((t * 16 * 128) >> 4),
                                                           true);
      }
      wgmma::commit_group();
      wgmma::wait_group<0>();
      wgmma::fence_operands(out);
      mbarrier_arrive(barrier(s.tile_free[n % 2]));
    }
    if (c == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        s.final_max[16 * warp + g + 8 * r] = run_max[r];
        s.final_sum[16 * warp + g + 8 * r] = run_sum[r];
      }
    }
    mbarrier_arrive(barrier(s.stats_ready));
    write_outputs(out, run_max, run_sum);
  } else {
    // Warpgroup 1: q first (warpgroup 0 waits for it), then O_right += P V[:, 256:512].
    store_pieces_as_f16<128>(q_codes, q_tile);
    wgmma::fence_shared_for_async_proxy();
    mbarrier_arrive(barrier(s.q_ready));
    // O_right [64 heads x 256 dims]: head 16 warp + g + 8 ((e / 2) % 2), dim 256 + 8 (e / 4) + 2 c + e % 2.
    float out[128];
#pragma unroll
    for (int e = 0; e < 128; ++e) out[e] = 0.0f;
    // The first chunk's S too, so that every phase of scores_done has a
    // waiter: compute-sanitizer's synccheck reports an arrival on a barrier
    // whose completed phase nobody waited for (P of chunk 0 comes after it).
    if (chunk_count > 0) mbarrier_wait(barrier(s.scores_done[0]), 0);
    for (int n = 0; n < chunk_count; ++n) {
      // The tile too, directly: its writer is the producer, not warpgroup 0
      // (complete by now: warpgroup 0 waited for it before P).
      mbarrier_wait(barrier(s.tile_ready[n % 2]), n / 2);
      mbarrier_wait(barrier(s.p_ready[n % 2]), n / 2);  // P and the rescale of chunk n
      if (n + 1 < chunk_count) mbarrier_wait(barrier(s.scores_done[(n + 1) % 2]), (n + 1) / 2);
      const float rescale0 = s.rescale[n % 2][16 * warp + g], rescale1 = s.rescale[n % 2][16 * warp + g + 8];
      // Skipped as warpgroup 0's. O_right pinned ahead of the branch: left
      // free, the compiler's placement of it around the branch makes the
      // kernel spill at its 168 registers.
      wgmma::fence_operands(out);
      if (!__all_sync(0xFFFFFFFFu, rescale0 == 1.0f && rescale1 == 1.0f)) {
#pragma unroll
        for (int e = 0; e < 128; ++e) out[e] *= (e / 2) % 2 ? rescale1 : rescale0;
      }
      const uint32_t p_tile = shared_address(s.p_tiles[n % 2]);
      wgmma::fence_operands(out);
      wgmma::fence();
      const uint64_t p_descriptor = wgmma::k_major_sw128_descriptor(p_tile);
      const uint64_t v_right_descriptor = wgmma::n_major_sw128_descriptor(tile_of(n) + 4 * kPanelBytes, kPanelBytes);
#pragma unroll
      for (int t = 0; t < kChunkRows / 16; ++t) {
        wgmma::mma_m64n256k16_f16_b_n_major(out, p_descriptor + ((t * 32) >> 4),
                                            v_right_descriptor + ((t * 16 * 128) >> 4), true);
      }
      wgmma::commit_group();
      wgmma::wait_group<0>();
      wgmma::fence_operands(out);
      mbarrier_arrive(barrier(s.p_free[n % 2]));
      mbarrier_arrive(barrier(s.tile_free[n % 2]));
    }
    mbarrier_wait(barrier(s.stats_ready), 0);
    float total_max[2], total_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      total_max[r] = s.final_max[16 * warp + g + 8 * r];
      total_sum[r] = s.final_sum[16 * warp + g + 8 * r];
    }
    write_outputs(out, total_max, total_sum);
  }
}

// The kernel's shared memory limit raised, and its register count checked:
// setmaxnreg moves registers within the CTA's launch allocation, so with
// fewer than 168 per thread warpgroup 0's increase would wait forever.
Status prepare_producer_kernel() {
  const auto kernel = reinterpret_cast<const void*>(sparse_mla_producer_kernel);
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(kernel, kSharedBytes, "sparse_mla_producer"));
  int registers = 0;
  DSA_RETURN_IF_ERROR(kernel_answer_once(
      kernel, 0,
      [](int* answer) {
        cudaFuncAttributes attributes = {};
        DSA_CUDA_RETURN(cudaFuncGetAttributes(&attributes, sparse_mla_producer_kernel));
        *answer = attributes.numRegs;
        return Status();
      },
      &registers));
  if (registers != kLaunchRegisters) {
    return unsupported("sparse_mla_producer: built with " + std::to_string(registers) +
                       " registers per thread; its setmaxnreg budget needs " + std::to_string(kLaunchRegisters));
  }
  return Status();
}

}  // namespace

bool sparse_mla_producer_covers(int64_t top_k, int64_t kv_cache_span_elements) {
  return top_k <= kSparseMlaProducerMaxTopK && kv_cache_span_elements / 16 < int64_t(kNoRow);
}

Status sparse_mla_producer_resident_ctas(int* ctas) {
  DSA_RETURN_IF_ERROR(prepare_producer_kernel());
  return kernel_answer_once(
      reinterpret_cast<const void*>(sparse_mla_producer_kernel), 1,
      [](int* answer) {
        int device = 0, sms = 0, per_sm = 0;
        DSA_CUDA_RETURN(cudaGetDevice(&device));
        DSA_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        DSA_CUDA_RETURN(
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sparse_mla_producer_kernel, kThreads, kSharedBytes));
        *answer = sms * per_sm;
        return Status();
      },
      ctas);
}

bool sparse_mla_batch_takes_producer(int top_k, int64_t items, int max_splits, int resident_ctas,
                                     int producer_resident_ctas) {
  if (top_k > kSparseMlaProducerMaxTopK || resident_ctas < 1 || producer_resident_ctas < 1) return false;
  const SparseMlaWgmmaSplits plan = sparse_mla_wgmma_splits(top_k, max_splits);
  const int64_t items_at_once = std::max<int64_t>(1, resident_ctas / plan.splits);
  const int64_t split_chunk_rounds = (items + items_at_once - 1) / items_at_once * plan.max_chunks;
  const int64_t producer_chunk_rounds =
      (items + producer_resident_ctas - 1) / producer_resident_ctas * ((top_k + kChunkRows - 1) / kChunkRows);
  return 4 * producer_chunk_rounds < 5 * split_chunk_rounds;
}

Status sparse_mla_producer(const SparseMlaArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sparse_mla_without_partials(a));
  const int64_t m = a.q.size(0), heads = a.q.size(1);
  if (heads % kHeads != 0) {
    return invalid_argument("q", "a multiple of 64 heads in dim 1 (sparse_mla_producer)", a.q.describe());
  }
  if (a.indices.size(1) > kSparseMlaProducerMaxTopK) {
    return invalid_argument(
        "indices",
        "at most " + std::to_string(kSparseMlaProducerMaxTopK) + " entries per token in dim 1 (sparse_mla_producer)",
        a.indices.describe());
  }
  // Row offsets are kept as 32-bit multiples of 16 bytes.
  if (!sparse_mla_producer_covers(a.indices.size(1), a.kv_cache.span_elements())) {
    return invalid_argument("kv_cache", "a span below 64 GiB (sparse_mla_producer)", a.kv_cache.describe());
  }
  DSA_RETURN_IF_ERROR(prepare_producer_kernel());
  return launch_pdl(sparse_mla_producer_kernel, dim3(static_cast<unsigned>(m * (heads / kHeads))), dim3(kThreads),
                    kSharedBytes, stream, sparse_mla_params(a));
}

}  // namespace dsa
