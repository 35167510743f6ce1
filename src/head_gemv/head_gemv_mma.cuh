// head_gemv's tensor-core kernel (HeadGemvSums::kTensorCores) as a template
// over its tail CTAs, and its launcher: head_gemv_mma.cu instantiates it with
// the fused KV-cache write; src/rope/ with the RoPE rows of the RoPE presets'
// absorb. Contract and bound: include/dsa_decode/head_gemv.h; design and
// measurements: docs/head_gemv.md, "Tensor-core sums".
//
// Per CTA (head h, column tile c of `tile` columns; warps = I / 64):
//   slab     [I][tile + 8] BF16 in shared memory: the weight rows of the tile,
//            each row padded by 16 bytes so that the eight rows one ldmatrix
//            reads fall in eight different bank groups
//   warp w   rows 64w..64w+63 of the slab; it copies them itself (cp.async,
//            one group per 16 rows, before griddepcontrol.wait) and is the
//            only reader, so it waits for its own copies with a __syncwarp
//            instead of a CTA barrier
//   product  D[j][t] = sum_i W[i][j] * x[t][i] as mma.m16n8k16: A = W^T
//            (16 columns x 16 rows, ldmatrix.trans from the slab), B = x^T
//            (16 rows x 8 tokens, straight from global memory), D in FP32
//            accumulators: [tile / 16 column tiles][token tiles][4]
//   partials [16 tokens][tile] FP32 per warp, in the warp's own slab rows
//            once it is done with them; then each thread takes four adjacent
//            columns of one token and adds 0 + warp 0 + warp 1 + ... in order
#pragma once

#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/launch.cuh"
#include "core/mma.cuh"
#include "core/shared_memory.h"
#include "head_gemv/head_gemv_kernels.h"

namespace dsa {
namespace head_gemv_mma_detail {

constexpr int kRowsPerWarp = 64;  // four k16 steps
constexpr int kStepRows = 16;     // rows of one MMA k step, and of one async-copy group
constexpr int kSteps = kRowsPerWarp / kStepRows;
constexpr int kMaxRows = 1024;  // 32 warps
constexpr size_t kMaxSharedBytes = 227 * 1024;

// Bytes of one slab row: the tile's BF16 columns plus 16 bytes of padding.
__host__ __device__ constexpr int slab_pitch_bytes(int tile) { return tile * 2 + 16; }

// kTile: columns per CTA (16, 32, 64 or 128); kTokenTiles: 8-token MMA columns (1 for m <= 8, 2 up to 16).
// Tail: the CTAs after the product CTAs (blockIdx.x >= heads * tiles) run
// Tail::run(p, tail, blockIdx.x - heads * tiles): head_gemv's cache write
// (CacheWriteTail) or another family's work on the same launch (rope.h).
// Tail::kHeadStrides: x and out indexed with p.x_head_stride and
// p.out_head_stride; false: packed, with I and J, head_gemv's own indexing
// (the same expressions as before the template, so the same code).
template <int kTile, int kTokenTiles, class Tail>
__global__ void __launch_bounds__(kMaxRows / kRowsPerWarp * 32)
    head_gemv_mma_kernel(const __grid_constant__ HeadGemvParams p, const __grid_constant__ typename Tail::Params tail) {
  extern __shared__ __align__(16) unsigned char shared[];
  constexpr int kColumnTiles = kTile / 16;
  constexpr int kPitch = slab_pitch_bytes(kTile);
  constexpr int kChunksPerRow = kTile / 8;                        // 16-byte async copies per slab row
  constexpr int kCopiesPerLane = kStepRows * kChunksPerRow / 32;  // per k step
  const int tiles = p.cols / kTile;
  if (static_cast<int>(blockIdx.x) >= p.heads * tiles) {
    Tail::run(p, tail, blockIdx.x - p.heads * tiles);
    return;
  }
  const int head = blockIdx.x / tiles;
  const int first_col = blockIdx.x % tiles * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first_row = warp * kRowsPerWarp;
  unsigned char* warp_slab = shared + first_row * kPitch;  // [64][kPitch] bytes

  // The warp's 64 weight rows, one async-copy group per k step; the weights do
  // not depend on the predecessor kernel, so they stream before the wait.
  const uint16_t* weight =
      p.weight + head * p.weight_head_stride + int64_t(first_row) * p.weight_row_stride + first_col;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int i = 0; i < kCopiesPerLane; ++i) {
      const int chunk = i * 32 + lane;
      const int row = s * kStepRows + chunk / kChunksPerRow, column = chunk % kChunksPerRow * 8;
      async_copy_16(shared_address(warp_slab + row * kPitch + column * 2), weight + row * p.weight_row_stride + column);
    }
    async_copy_commit();
  }

  pdl_wait();
  pdl_release_dependents();

  // B fragments of x^T: lane (g, c) = (lane / 4, lane % 4) holds token 8n + g's
  // rows 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1) of each k step; zero past m.
  const int g = lane / 4, c = lane % 4;
  uint32_t b[kSteps][kTokenTiles][2];
#pragma unroll
  for (int n = 0; n < kTokenTiles; ++n) {
    const int token = n * 8 + g;
    const uint16_t* x;
    if constexpr (Tail::kHeadStrides) {
      x = p.x + token * p.x_token_stride + head * p.x_head_stride + first_row + 2 * c;
    } else {
      x = p.x + token * p.x_token_stride + head * p.rows + first_row + 2 * c;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      b[s][n][0] = token < p.m ? *reinterpret_cast<const uint32_t*>(x + s * kStepRows) : 0u;
      b[s][n][1] = token < p.m ? *reinterpret_cast<const uint32_t*>(x + s * kStepRows + 8) : 0u;
    }
  }

  float acc[kColumnTiles][kTokenTiles][4] = {};
  // ldmatrix rows: lane l reads row l % 8 (+ 8 for matrices 2 and 3) at column 8 * (matrix 1 and 3).
  const int matrix = lane / 8;
  const uint32_t lane_address = shared_address(warp_slab + (lane % 8 + matrix / 2 * 8) * kPitch + (matrix % 2) * 8 * 2);
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    async_copy_wait(kSteps - 1 - s);
    __syncwarp();  // every lane's copies of step s are in the slab
#pragma unroll
    for (int t = 0; t < kColumnTiles; ++t) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, lane_address + s * kStepRows * kPitch + t * 16 * 2);
#pragma unroll
      for (int n = 0; n < kTokenTiles; ++n) mma_bf16(acc[t][n], a, b[s][n][0], b[s][n][1]);
    }
  }

  // D fragment: acc[t][n] = D[16t + g][8n + 2c], D[16t + g][8n + 2c + 1],
  // D[16t + g + 8][8n + 2c], D[16t + g + 8][8n + 2c + 1] (column, token).
  __syncwarp();  // the warp's ldmatrix reads are done: its slab rows become its partials
  float* partial = reinterpret_cast<float*>(warp_slab);  // [16 tokens][kTile]
#pragma unroll
  for (int t = 0; t < kColumnTiles; ++t) {
#pragma unroll
    for (int n = 0; n < kTokenTiles; ++n) {
      const int token = n * 8 + 2 * c, column = t * 16 + g;
      partial[token * kTile + column] = acc[t][n][0];
      partial[(token + 1) * kTile + column] = acc[t][n][1];
      partial[token * kTile + column + 8] = acc[t][n][2];
      partial[(token + 1) * kTile + column + 8] = acc[t][n][3];
    }
  }
  __syncthreads();

  // Four adjacent columns per thread and pass: the epilogue runs after the
  // last weights arrive, so its instruction count is on the critical path
  // (one column per thread cost about 1 us at m = 16).
  const int warps = p.rows / kRowsPerWarp;
  const bool fp8_out = p.scale != nullptr;
  const float inverse_scale = fp8_out ? num::div_rn(1.0f, *p.scale) : 1.0f;
  for (int e = threadIdx.x; e < p.m * kTile / 4; e += blockDim.x) {
    const int token = e / (kTile / 4), column = e % (kTile / 4) * 4;
    float total[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int w = 0; w < warps; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(
          reinterpret_cast<const float*>(shared + w * kRowsPerWarp * kPitch) + token * kTile + column);
      total[0] += v.x, total[1] += v.y, total[2] += v.z, total[3] += v.w;
    }
    int64_t index;
    if constexpr (Tail::kHeadStrides) {
      index = (static_cast<int64_t>(token) * p.heads + head) * p.out_head_stride + first_col + column;
    } else {
      index = (static_cast<int64_t>(token) * p.heads + head) * p.cols + first_col + column;
    }
    if (fp8_out) {
      uint32_t packed = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        packed |= uint32_t(num::quant_fp8_static(num::round_bf16(total[k]), inverse_scale)) << (8 * k);
      }
      *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(p.out) + index) = packed;
    } else {
      const uint32_t low = num::float_to_bf16(total[0]) | uint32_t(num::float_to_bf16(total[1])) << 16;
      const uint32_t high = num::float_to_bf16(total[2]) | uint32_t(num::float_to_bf16(total[3])) << 16;
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + index) = make_uint2(low, high);
    }
  }
}

// head_gemv's own tail: the fused KV-cache write, one CTA per token; x and
// out packed.
struct CacheWriteTail {
  static constexpr bool kHeadStrides = false;
  struct Params {};
  __device__ static void run(const HeadGemvParams& p, const Params&, int cta) { write_cache_row(p, cta); }
};

}  // namespace head_gemv_mma_detail

// Launches the tensor-core kernel on `p` (checked arguments of a shape
// head_gemv_mma_supports; p.tile = the column tile; x_head_stride and
// out_head_stride set, 0 meaning packed: I and J) with `tail_ctas` CTAs of
// Tail after the product CTAs (x_head_stride and out_head_stride read only
// when Tail::kHeadStrides). Graph capturable after a first uncaptured call
// per (tile, m capacity, Tail) and device.
template <class Tail>
Status launch_head_gemv_mma_with_tail(const HeadGemvParams& params, const typename Tail::Params& tail, int tail_ctas,
                                      cudaStream_t stream) {
  using namespace head_gemv_mma_detail;
  HeadGemvParams p = params;
  if (p.x_head_stride == 0) p.x_head_stride = p.rows;
  if (p.out_head_stride == 0) p.out_head_stride = p.cols;
  if ((p.tile != 16 && p.tile != 32 && p.tile != 64 && p.tile != 128) || p.cols % p.tile != 0) {
    return invalid_argument("tile", "16, 32, 64 or 128 dividing J",
                            "tile " + std::to_string(p.tile) + " for J = " + std::to_string(p.cols));
  }
  const size_t shared_bytes = size_t(p.rows) * slab_pitch_bytes(p.tile);
  if (shared_bytes > kMaxSharedBytes) {
    return invalid_argument("tile", "a slab of I x (2 tile + 16) bytes within 227 KiB of shared memory",
                            "tile " + std::to_string(p.tile) + " for I = " + std::to_string(p.rows));
  }
  using KernelFn = void (*)(HeadGemvParams, typename Tail::Params);
  const bool two = p.m > 8;  // a second 8-token MMA column
  const KernelFn kernel = p.tile == 128  ? (two ? head_gemv_mma_kernel<128, 2, Tail> : head_gemv_mma_kernel<128, 1, Tail>)
                          : p.tile == 64 ? (two ? head_gemv_mma_kernel<64, 2, Tail> : head_gemv_mma_kernel<64, 1, Tail>)
                          : p.tile == 32 ? (two ? head_gemv_mma_kernel<32, 2, Tail> : head_gemv_mma_kernel<32, 1, Tail>)
                                         : (two ? head_gemv_mma_kernel<16, 2, Tail> : head_gemv_mma_kernel<16, 1, Tail>);
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(reinterpret_cast<const void*>(kernel),
                                                static_cast<int>(kMaxSharedBytes), "head_gemv (tensor cores)"));
  const dim3 grid(p.heads * (p.cols / p.tile) + tail_ctas);
  const dim3 block(p.rows / kRowsPerWarp * 32);
  return launch_pdl(kernel, grid, block, shared_bytes, stream, p, tail);
}

}  // namespace dsa
