// What the RoPE absorb's API file (rope.cpp) and its kernel (rope_absorb.cu)
// share: the parameters of the RoPE rows that run as the tail CTAs of
// head_gemv's tensor-core kernel, and the launcher. Contract:
// include/dsa_decode/rope.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "dsa_decode/rope.h"

namespace dsa {

// Rows of the tail: token t's H query rows (j < H) and its k_pe row (j == H),
// r = t * (H + 1) + j; one row is R / 8 threads of 8 values each.
struct RopeRowsParams {
  const uint16_t* q_pe;  // [m, H, R] BF16 bits
  int64_t q_pe_token_stride, q_pe_head_stride;
  const uint16_t* k_pe;  // [m, R]
  int64_t k_pe_token_stride;
  const int64_t* positions;  // [>= m]
  const void* cos_sin;       // [rows, R] F32 or BF16
  int64_t cos_sin_row_stride;
  int64_t cos_sin_rows;
  int table_bf16;        // 1: BF16 table
  uint16_t* out;         // [m, H, L + R]: the rotated q_pe goes to column L
  int64_t out_head_stride;  // L + R
  int out_rope_column;      // L
  uint16_t* k_out;          // [m, R]
  int64_t k_out_token_stride;
  unsigned int* error_count;
  int m, heads, rope_dim;
  int half_split;     // RopeStyle::kHalfSplit
  int rows_per_cta;   // rows one tail CTA handles
};

// Threads of one row (8 values each), and the tail CTAs for `block_threads`
// threads per CTA (head_gemv's I / 64 warps).
inline int rope_threads_per_row(int rope_dim) { return rope_dim / 8; }
int rope_rows_per_cta(int rope_dim, int block_threads);
int rope_tail_ctas(int m, int heads, int rope_dim, int block_threads);

// The product part: q_nope x W_UK_T into columns 0..L-1 of out (BF16).
struct RopeGemvPart {
  const uint16_t* x;  // q_nope [m, H, P]
  int64_t x_token_stride, x_head_stride;
  const uint16_t* weight;  // [H, P, L]
  int64_t weight_head_stride, weight_row_stride;
  uint16_t* out;  // [m, H, L + R]
  int64_t out_head_stride;
  int m, heads, rows, cols;  // m, H, P, L
};

// The launch: head_gemv's tensor-core kernel on `gemv` (its column tile rule,
// BF16 out, no cache write) with the RoPE rows of `rows` as its tail.
Status launch_rope_absorb(const RopeGemvPart& gemv, const RopeRowsParams& rows, cudaStream_t stream);

}  // namespace dsa
