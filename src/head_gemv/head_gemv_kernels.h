// What head_gemv's two kernels share: the launch parameters, the fused
// KV-cache write of the extra CTAs, and the tensor-core kernel's launcher
// (head_gemv_mma.cu), which head_gemv() calls for HeadGemvSums::kTensorCores.
// The contracts are in include/dsa_decode/head_gemv.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/launch.cuh"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/numerics.h"

namespace dsa {

struct HeadGemvParams {
  int release_early;  // HeadGemvArgs::release_dependents_early
  const uint16_t* x;  // [m, H, I] BF16 bits
  int64_t x_token_stride;
  const uint16_t* weight;  // [H, I, J] BF16 bits
  int64_t weight_head_stride;
  int64_t weight_row_stride;
  void* out;           // [m, H, J] BF16 or FP8, contiguous
  const float* scale;  // [1]; null: BF16 out
  int m, heads, rows, cols;
  int tile, rows_per_thread;  // the tactic (the tensor-core kernel: its column tile; rows_per_thread unused)

  // Fused cache write; cache == null: none.
  const uint16_t* kv;  // [m, L] BF16
  int64_t kv_token_stride;
  uint8_t* cache;  // [blocks, block_size, L] FP8
  int64_t cache_block_stride;
  int64_t cache_entry_stride;
  int64_t cache_capacity;  // blocks * block_size
  int block_size;
  int cache_width;       // L
  const int64_t* slots;  // [n_slots]
  int tokens_with_slot;  // min(n_slots, m)
  const float* k_scale;  // [1]
  unsigned int* error_count;

  // The tensor-core kernel with a tail whose kHeadStrides is true (the RoPE
  // absorb, head_gemv_mma.cuh) only: elements between two heads of x (a view
  // into a wider per-head row, e.g. q_nope of [q_nope | q_pe]) and of out
  // (rows wider than J, e.g. [latent | rope]); 0 = packed (I, J). head_gemv's
  // own kernels never read them: they index x and out packed, as before these
  // fields existed, which is why the fields come last (every other field keeps
  // its offset, so head_gemv's kernels compile to the same code).
  int64_t x_head_stride;
  int64_t out_head_stride;
};
static_assert(offsetof(HeadGemvParams, out_head_stride) + sizeof(int64_t) == sizeof(HeadGemvParams),
              "the head strides stay the last fields: head_gemv's kernels keep their parameter offsets");

// concat_and_cache_mla for token t: CTA t of the cache part.
__device__ inline void write_cache_row(const HeadGemvParams& p, int t) {
  if (p.release_early) pdl_release_dependents();  // as the product CTAs (head_gemv.cu)
  pdl_wait();
  if (!p.release_early) pdl_release_dependents();
  if (t >= p.tokens_with_slot) return;  // CUDA-graph padding rows
  const int64_t slot = p.slots[t];
  if (slot < 0) return;  // padding slot
  if (slot >= p.cache_capacity) {
    if (threadIdx.x == 0 && p.error_count != nullptr) atomicAdd(p.error_count, 1u);
    return;
  }
  const float k_scale = *p.k_scale;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  uint8_t* entry = p.cache + block * p.cache_block_stride + offset * p.cache_entry_stride;
  const uint16_t* kv = p.kv + t * p.kv_token_stride;
  for (int i = threadIdx.x; i < p.cache_width / 8; i += blockDim.x) {
    const uint4 v = *reinterpret_cast<const uint4*>(kv + i * 8);
    const uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint16_t value = static_cast<uint16_t>(pairs[k / 2] >> (16 * (k & 1)));
      packed[k / 4] |= static_cast<uint32_t>(num::cache_fp8(value, k_scale)) << (8 * (k % 4));
    }
    *reinterpret_cast<uint2*>(entry + i * 8) = make_uint2(packed[0], packed[1]);
  }
}

// The tensor-core kernel (kTensorCores). Its column tile: 64, 32 or 16 columns
// per CTA, the widest that still gives the warps in flight the H200 needed
// at m tokens (the bits do not depend on the tile, so it may follow m).
int head_gemv_mma_tile(int heads, int rows, int cols, int m);
// Whether the tensor-core kernel runs rows x cols (I a multiple of 64 up to
// 1024, J a multiple of 16).
bool head_gemv_mma_supports(int rows, int cols);
// Launches it on `p` (checked arguments of a shape it supports; p.tile = the
// column tile, p.rows_per_thread unused) with `cache_ctas` cache-write CTAs
// after the product CTAs.
Status launch_head_gemv_mma(const HeadGemvParams& p, int cache_ctas, cudaStream_t stream);

// head_gemv under kTensorCores with the column tile forced to `tile` (16, 32,
// 64 or 128; 1024 rows at 128 exceed the shared memory): the benchmark's sweep
// behind head_gemv_mma_tile.
Status head_gemv_tensor_cores_with_tile(const HeadGemvArgs& args, int tile, cudaStream_t stream);

}  // namespace dsa
