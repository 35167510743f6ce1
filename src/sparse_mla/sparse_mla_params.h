// What every sparse MLA kernel shares (CUDA sources only): the raw-pointer
// parameters, filled from the checked SparseMlaArgs
// (include/dsa_decode/sparse_mla.h) by one function, so the kernels agree on
// how a view becomes addresses, and the device helpers both use (those that
// sparse_mla_v32 shares too are in sparse_mla_common.cuh).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "dsa_decode/sparse_mla.h"
#include "sparse_mla/sparse_mla_common.cuh"

namespace dsa {

struct SparseMlaParams {
  const uint8_t* q;  // [m, H, 512] e4m3 codes
  int64_t q_token_stride, q_head_stride;
  const float* q_scale;  // [1]
  const uint8_t* cache;  // [blocks, block_size, 512] e4m3 codes
  int64_t cache_block_stride, cache_entry_stride;
  int64_t capacity;        // blocks * block_size
  int32_t block_size;      // block_size when it fits int32 (else unused: block_shift is 31)
  int32_t block_shift;     // log2(block_size) for a power of two (served sizes are; 31 for sizes > 2^31 - 1), else -1
  const float* k_scale;    // [1]
  const int32_t* indices;  // [m, K]
  int64_t indices_token_stride;
  int top_k;
  int heads;
  float softmax_scale;
  uint16_t* latent;  // [m, H, 512] BF16 bits, dims 1-2 contiguous
  int64_t latent_token_stride;
  float* lse;                 // [m, H]
  unsigned int* error_count;  // may be null
  int32_t* split_counters;    // zero between launches; each kernel that uses some returns them to zero
  float* split_partials;      // what the 64-head kernel's clusters hand to the last one (null when unused)
};

// `a` must have passed check_sparse_mla.
inline SparseMlaParams sparse_mla_params(const SparseMlaArgs &a) {
  SparseMlaParams p = {};
  p.q = static_cast<const uint8_t*>(a.q.data);
  p.q_scale = static_cast<const float*>(a.q_scale.data);
  p.k_scale = static_cast<const float*>(a.k_scale.data);
  p.split_counters = static_cast<int32_t*>(a.split_counters.data);
  p.split_partials = static_cast<float*>(a.split_partials.data);
  fill_paged_attention_params(p, a);
  return p;
}

// The cache block of slot (0 <= slot), by shift or by division.
__host__ __device__ inline int32_t sparse_mla_block_of(const SparseMlaParams& p, int32_t slot) {
  return paged_block_of(slot, p.block_shift, p.block_size);
}

// The byte offset of slot's cache row from p.cache, -1 for a slot outside
// [0, capacity) (negative: no entry; past the cache: counted by the caller).
__host__ __device__ inline int64_t sparse_mla_row_offset(const SparseMlaParams& p, int32_t slot) {
  if (slot < 0 || slot >= p.capacity) return -1;
  const int32_t block = sparse_mla_block_of(p, slot);
  return block * p.cache_block_stride + int64_t(slot - block * p.block_size) * p.cache_entry_stride;
}


}  // namespace dsa
