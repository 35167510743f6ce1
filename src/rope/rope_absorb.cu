// The RoPE absorb's launch: head_gemv's tensor-core kernel (head_gemv_mma.cuh)
// instantiated with the RoPE rows as its tail CTAs. The product CTAs write
// columns 0..L-1 of out [m, H, L + R]; the tail CTAs rotate q_pe into columns
// L..L+R-1 and k_pe into k_pe_out. Contract: include/dsa_decode/rope.h.
//
// Tail CTA: rows r = t * (H + 1) + j (j < H: query head j of token t; j == H:
// token t's k_pe), R / 8 threads a row, each thread 8 values: kInterleaved,
// the pairs (8c, 8c+1) .. (8c+6, 8c+7) of one 16-byte load; kHalfSplit, the
// pairs (4c + k, 4c + k + R/2), k < 4, of two 8-byte loads. Either way its
// cos/sin are entries 4c..4c+3 of each half of the table row.
#include <cstdint>

#include "core/bf16.cuh"
#include "core/launch.cuh"
#include "dsa_decode/numerics.h"
#include "head_gemv/head_gemv_mma.cuh"
#include "rope/rope_kernels.h"

namespace dsa {
namespace {

constexpr int kPassesPerCta = 4;  // rows per tail CTA = rows of one pass x 4

// a' = fma(a, c, -(b s)), b' = fma(b, c, a s): the contract's order.
__device__ __forceinline__ void rotate_pair(float a, float b, float c, float s, float* a_out, float* b_out) {
  *a_out = __fmaf_rn(a, c, -__fmul_rn(b, s));
  *b_out = __fmaf_rn(b, c, __fmul_rn(a, s));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float low, float high) {
  return uint32_t(num::float_to_bf16(low)) | uint32_t(num::float_to_bf16(high)) << 16;
}

// Four table entries from `index` of a row (F32: one 16-byte load, BF16: 8 bytes).
__device__ __forceinline__ void load_table4(const RopeRowsParams& t, int64_t row, int index, float (&v)[4]) {
  if (t.table_bf16) {
    const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(t.cos_sin) +
                                                    row * t.cos_sin_row_stride + index);
    v[0] = __uint_as_float(w.x << 16);
    v[1] = __uint_as_float(w.x & 0xFFFF0000u);
    v[2] = __uint_as_float(w.y << 16);
    v[3] = __uint_as_float(w.y & 0xFFFF0000u);
  } else {
    const float4 w =
        *reinterpret_cast<const float4*>(static_cast<const float*>(t.cos_sin) + row * t.cos_sin_row_stride + index);
    v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
  }
}

__device__ __forceinline__ void unpack_bf16x4(const uint2& v, float (&out)[4]) {
  out[0] = __uint_as_float(v.x << 16);
  out[1] = __uint_as_float(v.x & 0xFFFF0000u);
  out[2] = __uint_as_float(v.y << 16);
  out[3] = __uint_as_float(v.y & 0xFFFF0000u);
}

struct RopeTail {
  static constexpr bool kHeadStrides = true;  // q_nope a view into q [m, H, P + R], out rows of L + R
  using Params = RopeRowsParams;

  __device__ static void run(const HeadGemvParams& gemv, const Params& t, int cta) {
    // q_pe, k_pe and the positions come from earlier kernels of the step.
    pdl_wait();
    pdl_release_dependents();
    const int threads_per_row = t.rope_dim / 8;
    const int rows_per_pass = blockDim.x / threads_per_row;
    const int chunk = threadIdx.x % threads_per_row;
    const int half = t.rope_dim / 2;
    const int total_rows = t.m * (t.heads + 1);
    (void)gemv;
    for (int r = cta * t.rows_per_cta + threadIdx.x / threads_per_row;
         r < min(total_rows, (cta + 1) * t.rows_per_cta); r += rows_per_pass) {
      const int token = r / (t.heads + 1), j = r % (t.heads + 1);
      const bool is_key = j == t.heads;
      const int64_t position = t.positions[token];
      const bool valid = position >= 0 && position < t.cos_sin_rows;
      if (is_key && chunk == 0 && position >= t.cos_sin_rows && t.error_count != nullptr) {
        atomicAdd(t.error_count, 1u);
      }
      const uint16_t* in = is_key ? t.k_pe + token * t.k_pe_token_stride
                                  : t.q_pe + token * t.q_pe_token_stride + j * t.q_pe_head_stride;
      uint16_t* out = is_key ? t.k_out + token * t.k_out_token_stride
                             : t.out + (int64_t(token) * t.heads + j) * t.out_head_stride + t.out_rope_column;
      float cosines[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sines[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (valid) {
        load_table4(t, position, 4 * chunk, cosines);
        load_table4(t, position, half + 4 * chunk, sines);
      }
      float x[8], y[8];
      if (!t.half_split) {
        unpack_bf16x8(*reinterpret_cast<const uint4*>(in + 8 * chunk), x);
#pragma unroll
        for (int k = 0; k < 4; ++k) rotate_pair(x[2 * k], x[2 * k + 1], cosines[k], sines[k], &y[2 * k], &y[2 * k + 1]);
        if (!valid) {
#pragma unroll
          for (int k = 0; k < 8; ++k) y[k] = 0.0f;
        }
        *reinterpret_cast<uint4*>(out + 8 * chunk) =
            make_uint4(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]), pack_bf16x2(y[4], y[5]), pack_bf16x2(y[6], y[7]));
      } else {
        float a[4], b[4];
        unpack_bf16x4(*reinterpret_cast<const uint2*>(in + 4 * chunk), a);
        unpack_bf16x4(*reinterpret_cast<const uint2*>(in + half + 4 * chunk), b);
#pragma unroll
        for (int k = 0; k < 4; ++k) rotate_pair(a[k], b[k], cosines[k], sines[k], &y[k], &y[4 + k]);
        if (!valid) {
#pragma unroll
          for (int k = 0; k < 8; ++k) y[k] = 0.0f;
        }
        *reinterpret_cast<uint2*>(out + 4 * chunk) = make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
        *reinterpret_cast<uint2*>(out + half + 4 * chunk) = make_uint2(pack_bf16x2(y[4], y[5]), pack_bf16x2(y[6], y[7]));
      }
    }
  }
};

}  // namespace

int rope_rows_per_cta(int rope_dim, int block_threads) {
  return block_threads / rope_threads_per_row(rope_dim) * kPassesPerCta;
}

int rope_tail_ctas(int m, int heads, int rope_dim, int block_threads) {
  const int rows = m * (heads + 1), per_cta = rope_rows_per_cta(rope_dim, block_threads);
  return (rows + per_cta - 1) / per_cta;
}

Status launch_rope_absorb(const RopeGemvPart& part, const RopeRowsParams& rows, cudaStream_t stream) {
  HeadGemvParams g = {};
  g.x = part.x;
  g.x_token_stride = part.x_token_stride;
  g.x_head_stride = part.x_head_stride;
  g.weight = part.weight;
  g.weight_head_stride = part.weight_head_stride;
  g.weight_row_stride = part.weight_row_stride;
  g.out = part.out;
  g.out_head_stride = part.out_head_stride;
  g.scale = nullptr;  // BF16 out
  g.m = part.m;
  g.heads = part.heads;
  g.rows = part.rows;
  g.cols = part.cols;
  g.tile = head_gemv_mma_tile(part.heads, part.rows, part.cols, part.m);
  const int block_threads = part.rows / head_gemv_mma_detail::kRowsPerWarp * 32;
  return launch_head_gemv_mma_with_tail<RopeTail>(
      g, rows, rope_tail_ctas(rows.m, rows.heads, rows.rope_dim, block_threads), stream);
}

}  // namespace dsa
