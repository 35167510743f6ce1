// Device pieces shared by the sparse MLA decode kernels of both cache
// formats: the 512-dim FP8 kernels (sparse_mla_mma, sparse_mla_wgmma,
// sparse_mla_producer, through sparse_mla_params.h) and DeepSeek-V3.2's
// 656-byte-entry kernel (sparse_mla_v32). Each piece is the one copy of a
// step both kernel families take in the same way; what depends on a kernel's
// layout comes in as a template argument or through its shared storage.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>


namespace dsa {

// The softmax runs in base 2: scores scaled by log2(e), the lse back by ln(2).
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// The cache block of slot (0 <= slot) in a paged cache of blocks of
// block_size entries: by shift when block_shift >= 0 (log2 of a power-of-two
// block_size; 31 for sizes past int32), else by division.
__host__ __device__ inline int32_t paged_block_of(int32_t slot, int32_t block_shift, int32_t block_size) {
  return block_shift >= 0 ? int32_t(uint32_t(slot) >> block_shift) : slot / block_size;
}

// The kernels' view of a paged cache's block size: clamped to int32, and its
// shift for paged_block_of (-1 where it is no power of two, 31 past int32).
struct PagedBlockGeometry {
  int32_t size;
  int32_t shift;
};
inline PagedBlockGeometry paged_block_geometry(int64_t block_size) {
  PagedBlockGeometry g{static_cast<int32_t>(block_size > INT32_MAX ? INT32_MAX : block_size), -1};
  if (block_size > INT32_MAX) {
    g.shift = 31;  // every int32 slot lies in block 0
  } else {
    for (int shift = 0; shift < 31; ++shift) {
      if (block_size == (int64_t(1) << shift)) g.shift = shift;
    }
  }
  return g;
}

// The fields every sparse MLA kernel's Params fills alike from its checked
// arguments (SparseMlaArgs or SparseMlaV32Args): q's strides, the paged
// cache, the indices and the outputs. The caller sets q's pointer (its code
// type differs) and whatever else its kernel takes.
template <class Params, class Args>
inline void fill_paged_attention_params(Params& p, const Args& a) {
  p.q_token_stride = a.q.stride(0);
  p.q_head_stride = a.q.stride(1);
  p.cache = static_cast<const uint8_t*>(a.kv_cache.data);
  p.cache_block_stride = a.kv_cache.stride(0);
  p.cache_entry_stride = a.kv_cache.stride(1);
  p.capacity = a.kv_cache.size(0) * a.kv_cache.size(1);
  const PagedBlockGeometry geometry = paged_block_geometry(a.kv_cache.size(1));
  p.block_size = geometry.size;
  p.block_shift = geometry.shift;
  p.indices = static_cast<const int32_t*>(a.indices.data);
  p.indices_token_stride = a.indices.stride(0);
  p.top_k = static_cast<int>(a.indices.size(1));
  p.heads = static_cast<int>(a.q.size(1));
  p.softmax_scale = a.softmax_scale;
  p.latent = static_cast<uint16_t*>(a.latent.data);
  p.latent_token_stride = a.latent.stride(0);
  p.lse = static_cast<float*>(a.lse.data);
  p.error_count = a.error_count;
}

#ifdef __CUDACC__
// max that returns NaN when either operand is NaN (fmaxf would drop it): the
// softmax maximum that carries NaN scores through, as the contract says.
__device__ __forceinline__ float max_propagating_nan(float a, float b) { return (a > b || a != a) ? a : b; }

// Adds a warp's count of index entries past the cache to p.error_count (lane
// 0, one atomic; nothing when it is null). Only the CTAs of head group 0
// call it, so each entry of a row counts once, not once per head group.
template <class Params>
__device__ __forceinline__ void count_out_of_range(const Params& p, unsigned int out_of_range, int lane) {
  if (p.error_count == nullptr) return;
  out_of_range = __reduce_add_sync(0xFFFFFFFFu, out_of_range);
  if (lane == 0 && out_of_range != 0) atomicAdd(p.error_count, out_of_range);
}

// Byte address of 16-byte unit `unit` of row `row` of a tile of kRowBytes
// rows in shared memory whose units are stored at unit ^ (row % 8), so that
// ldmatrix (8 rows at one unit, or one row's 8 units) touches all 32 banks
// once.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzled_tile_unit(uint32_t tile, int row, int unit) {
  return tile + row * kRowBytes + ((unit ^ (row % 8)) * 16);
}

// One chunk's step of the online softmax of a head whose chunk scores lie
// two per lane (lanes of one warp, all 32 present): the chunk's maximum over
// the warp (NaN propagates), the new running maximum from *run_max (read
// after the lanes' maximum), the rescale of what came before and the chunk's
// weights p = 2^(score - new maximum). Nothing to weigh until a valid entry
// came (new maximum -inf): rescale 1, weights 0.
struct OnlineSoftmaxStep {
  float new_max, rescale, p0, p1;
};
__device__ __forceinline__ OnlineSoftmaxStep online_softmax_step(float score0, float score1, const float* run_max) {
  float chunk_max = max_propagating_nan(score0, score1);
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) {
    chunk_max = max_propagating_nan(chunk_max, __shfl_xor_sync(0xFFFFFFFFu, chunk_max, offset));
  }
  const float old_max = *run_max;
  OnlineSoftmaxStep step;
  step.new_max = max_propagating_nan(old_max, chunk_max);
  step.rescale = 1.0f;
  step.p0 = 0.0f;
  step.p1 = 0.0f;
  if (step.new_max != -INFINITY) {
    step.rescale = exp2f(old_max - step.new_max);  // 0 when old_max = -inf
    step.p0 = exp2f(score0 - step.new_max);
    step.p1 = exp2f(score1 - step.new_max);
  }
  return step;
}

// The sum of v over the warp's 32 lanes, by butterfly (every lane gets it).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// Head h's running state after a chunk: (max, sum, rescale) into shared
// storage `s` by lane 0, once every lane has read s.run_max[h].
template <class Shared>
__device__ __forceinline__ void online_softmax_commit(Shared& s, int h, int lane, const OnlineSoftmaxStep& step,
                                                      float chunk_sum) {
  __syncwarp();  // every lane has read run_max[h]
  if (lane == 0) {
    s.run_max[h] = step.new_max;
    s.run_sum[h] = fmaf(s.run_sum[h], step.rescale, chunk_sum);
    s.rescale[h] = step.rescale;
  }
}

#endif  // __CUDACC__

}  // namespace dsa
