// CPU side of sparse_mla_v32 (include/dsa_decode/sparse_mla_v32.h): the
// model of the 656-byte cache entry as vLLM writes it (bit for bit what the
// cache-write kernel must store), its dequantization, the float64 attention
// reference every kernel is checked against, and a model of the GPU kernel's
// roundings (FP16 scaled q, FP32 group partials, FP16 p x scale / max, the
// split combine) that shows on the CPU that the design keeps the contract.
#pragma once

#include <cstdint>
#include <vector>

namespace dsa::reference {

// Token (kv_c [512] BF16 bits, k_pe [64] BF16 bits) -> entry [656] bytes.
void v32_quantize_token(const uint16_t* kv_c, const uint16_t* k_pe, uint8_t* entry);

// entry [656] -> key [576]: code x its group's scale (exact in double), then the RoPE values.
void v32_dequantize_token(const uint8_t* entry, double* key);

// Whether a dequantized key has a NaN or an infinity (a NaN code, a non-finite
// scale, a non-finite RoPE value): such a selected entry makes its token NaN.
bool v32_key_is_finite(const double* key);

// Host copies in the kernel's layouts; strides in elements (bytes for the cache).
struct SparseMlaV32Host {
  const uint16_t* q;  // [m, H, 576] BF16 bits
  int64_t q_token_stride, q_head_stride;
  const uint8_t* cache;  // [blocks, block_size, 656-byte entries]
  int64_t blocks, block_size, block_stride, entry_stride;
  const int32_t* indices;  // [m, K]
  int64_t indices_token_stride;
  int m, heads, top_k;
  float softmax_scale;
};

struct SparseMlaV32Result {
  std::vector<uint16_t> latent;  // [m, H, 512] BF16 bits, contiguous
  std::vector<float> lse;        // [m, H]
  int64_t out_of_range = 0;      // index entries >= capacity, each counted once
};

// float64: exact scores up to double rounding, a two-pass softmax, the latent
// rounded to BF16 once, lse to FP32.
SparseMlaV32Result sparse_mla_v32(const SparseMlaV32Host& a);

// The GPU kernel's arithmetic in the same order per row and chunk, with
// `rows_per_split` entries per split (a multiple of 64) combined as the
// kernel combines them: the score's two NoPE accumulators (even and odd
// 16-dim k-steps), the chunk sum's lane pairs and xor butterfly, the
// combine's split order. Within one MMA k-step (16 products, or the P.V's 16
// rows) the hardware's order is not modelled: the products are added in
// order, so the model matches the kernel to FP32 rounding, not bit for bit.
SparseMlaV32Result sparse_mla_v32_kernel_model(const SparseMlaV32Host& a, int rows_per_split);

// The power of two the kernel scales a 128-value group of q by before FP16:
// 2^(14 - floor(log2 amax)) as an exponent (0 for amax 0 or not finite).
int v32_q_group_exponent(float amax);

}  // namespace dsa::reference
