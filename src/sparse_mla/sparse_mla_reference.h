// The float64 CPU reference of sparse MLA decode attention
// (include/dsa_decode/sparse_mla.h): exact dot products, a two-pass softmax in
// double, the output rounded to BF16 once (RNE) and lse rounded to FP32. Every
// kernel is checked against it within a stated tolerance.
#pragma once

#include <cstdint>
#include <vector>

namespace dsa::reference {

// Host copies in the kernels' layouts; strides in elements (bytes for FP8).
struct SparseMlaHost {
  const uint8_t* q;  // [m, H, 512] e4m3 codes
  int64_t q_token_stride, q_head_stride;
  const uint8_t* cache;  // [blocks, block_size, 512] e4m3 codes
  int64_t blocks, block_size, block_stride, entry_stride;
  const int32_t* indices;  // [m, K] global slots
  int64_t indices_token_stride;
  int m, heads, top_k;
  float q_scale, k_scale, softmax_scale;
};

struct SparseMlaResult {
  std::vector<uint16_t> latent;  // [m, H, 512] BF16 bits, contiguous
  std::vector<float> lse;        // [m, H]
  int64_t out_of_range = 0;      // entries of indices >= capacity, each counted once (not per head)
};

SparseMlaResult sparse_mla(const SparseMlaHost& a);

}  // namespace dsa::reference
