// head_gemv kernel, its launcher and its argument checks. The contract and the
// summation order are documented in include/dsa_decode/head_gemv.h.
#include <cstdint>
#include <mutex>

#include "core/launch.cuh"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/numerics.h"

namespace dsa {
namespace {

struct HeadGemvParams {
  const uint16_t* x;  // [m, H, I] BF16 bits
  int64_t x_token_stride;
  const uint16_t* weight;  // [H, I, J] BF16 bits
  int64_t weight_head_stride;
  int64_t weight_row_stride;
  void* out;           // [m, H, J] BF16 or FP8, contiguous
  const float* scale;  // [1]; null: BF16 out
  int m, heads, rows, cols;

  // Fused cache write; cache == null: none.
  const uint16_t* kv;  // [m, L] BF16
  int64_t kv_token_stride;
  uint8_t* cache;  // [blocks, block_size, L] FP8
  int64_t cache_block_stride;
  int64_t cache_entry_stride;
  int64_t cache_capacity;  // blocks * block_size
  int block_size;
  int cache_width;        // L
  const int64_t* slots;   // [n_slots]
  int tokens_with_slot;   // min(n_slots, m)
  const float* k_scale;   // [1]
  unsigned int* error_count;
};

// Streamed once per call: skip L1, keep the read-only path.
__device__ __forceinline__ uint4 load_streamed(const uint16_t* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

__device__ __forceinline__ float low_bf16(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_bf16(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

// Element k (0..7) of eight BF16 values packed in a uint4.
__device__ __forceinline__ float bf16_element(const uint4& v, int k) {
  const uint32_t pair = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
  return (k & 1) ? high_bf16(pair) : low_bf16(pair);
}

// concat_and_cache_mla for token t: CTA t of the cache part.
__device__ void write_cache_row(const HeadGemvParams& p, int t) {
  pdl_wait();
  pdl_release_dependents();
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

// Registers a thread needs: its FP32 weights, its accumulators, and room for
// addresses and the x values. The launch bound caps threads per CTA so that
// this fits without spills; tactics that would need more threads are refused.
constexpr int max_threads_for(int max_tokens, int rows_per_thread) {
  const int registers = 8 * rows_per_thread + 8 * max_tokens + 40;
  const int threads = 65536 / (registers > 255 ? 255 : registers) / 32 * 32;
  return threads > 1024 ? 1024 : threads;
}
constexpr bool fits_registers(int max_tokens, int rows_per_thread) {
  return 8 * rows_per_thread + 8 * max_tokens + 40 <= 255;
}

// kMaxTokens: register capacity (1, 2, 4, 8, 16 >= m); kTile, kRowsPerThread: the tactic.
template <int kMaxTokens, int kTile, int kRowsPerThread>
__global__ void __launch_bounds__(max_threads_for(kMaxTokens, kRowsPerThread))
    head_gemv_kernel(const HeadGemvParams p) {
  constexpr int kColThreads = kTile / 8;  // threads sharing one row group
  extern __shared__ float4 shared_partial[];
  float* partial = reinterpret_cast<float*>(shared_partial);  // [warps][m][kTile]

  const int tiles = p.cols / kTile;
  if (static_cast<int>(blockIdx.x) >= p.heads * tiles) {
    write_cache_row(p, blockIdx.x - p.heads * tiles);
    return;
  }
  const int head = blockIdx.x / tiles;
  const int tile = blockIdx.x % tiles;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int first_row = threadIdx.x / kColThreads * kRowsPerThread;
  const int first_col = tile * kTile + threadIdx.x % kColThreads * 8;

  uint4 packed_weights[kRowsPerThread];  // [rows_per_thread] x 8 BF16
  const uint16_t* weight = p.weight + head * p.weight_head_stride + first_row * p.weight_row_stride + first_col;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) packed_weights[r] = load_streamed(weight + r * p.weight_row_stride);

  pdl_wait();
  pdl_release_dependents();

  // Unpacked once: at m = 16 the FMAs alone take about as long as the weight
  // stream, so no conversion may sit in the inner loop.
  float weights[kRowsPerThread][8];  // [row][column]
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
#pragma unroll
    for (int k = 0; k < 8; ++k) weights[r][k] = bf16_element(packed_weights[r], k);
  }
  float acc[kMaxTokens][8];  // [token][column]
  const uint16_t* x = p.x + head * p.rows + first_row;
#pragma unroll
  for (int t = 0; t < kMaxTokens; ++t) {
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[t][k] = 0.0f;
    if (t < p.m) {
      uint4 x_words[kRowsPerThread / 8];
#pragma unroll
      for (int q = 0; q < kRowsPerThread / 8; ++q) {
        x_words[q] = *reinterpret_cast<const uint4*>(x + t * p.x_token_stride + q * 8);
      }
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const float a = bf16_element(x_words[r / 8], r % 8);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[t][k] = fmaf(a, weights[r][k], acc[t][k]);
      }
    }
  }

  // Row groups of one warp: lanes c, c + kColThreads, ... hold column group c.
#pragma unroll
  for (int offset = kColThreads; offset < 32; offset *= 2) {
#pragma unroll
    for (int t = 0; t < kMaxTokens; ++t) {
      if (t < p.m) {
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[t][k] += __shfl_xor_sync(0xFFFFFFFFu, acc[t][k], offset);
      }
    }
  }
  if (lane < kColThreads) {
#pragma unroll
    for (int t = 0; t < kMaxTokens; ++t) {
      if (t < p.m) {
        float4* dst = reinterpret_cast<float4*>(partial + (warp * p.m + t) * kTile + lane * 8);
        dst[0] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        dst[1] = make_float4(acc[t][4], acc[t][5], acc[t][6], acc[t][7]);
      }
    }
  }
  __syncthreads();

  const int warps = blockDim.x / 32;
  const bool fp8_out = p.scale != nullptr;
  const float inverse_scale = fp8_out ? num::div_rn(1.0f, *p.scale) : 1.0f;
  for (int e = threadIdx.x; e < p.m * kTile; e += blockDim.x) {
    const int t = e / kTile;
    const int c = e % kTile;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += partial[(w * p.m + t) * kTile + c];
    const int64_t index = (static_cast<int64_t>(t) * p.heads + head) * p.cols + tile * kTile + c;
    if (fp8_out) {
      static_cast<uint8_t*>(p.out)[index] = num::quant_fp8_static(num::round_bf16(total), inverse_scale);
    } else {
      static_cast<uint16_t*>(p.out)[index] = num::float_to_bf16(total);
    }
  }
}

using KernelFn = void (*)(HeadGemvParams);

int token_capacity(int m) { return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : m <= 8 ? 8 : 16; }

template <int kTile, int kRowsPerThread>
KernelFn kernel_for_tokens(int m) {
  switch (token_capacity(m)) {
    case 1: return head_gemv_kernel<1, kTile, kRowsPerThread>;
    case 2: return head_gemv_kernel<2, kTile, kRowsPerThread>;
    case 4: return head_gemv_kernel<4, kTile, kRowsPerThread>;
    case 8: return head_gemv_kernel<8, kTile, kRowsPerThread>;
    default:
      if constexpr (fits_registers(16, kRowsPerThread)) return head_gemv_kernel<16, kTile, kRowsPerThread>;
      return nullptr;
  }
}

// The instantiated tactics; check_head_gemv_tactic accepts only these.
KernelFn kernel_for(HeadGemvTactic tactic, int m) {
  switch (tactic.tile * 100 + tactic.rows_per_thread) {
    case 1608: return kernel_for_tokens<16, 8>(m);
    case 1616: return kernel_for_tokens<16, 16>(m);
    case 3208: return kernel_for_tokens<32, 8>(m);
    case 3216: return kernel_for_tokens<32, 16>(m);
    case 6408: return kernel_for_tokens<64, 8>(m);
    case 6416: return kernel_for_tokens<64, 16>(m);
    case 12808: return kernel_for_tokens<128, 8>(m);
    case 12816: return kernel_for_tokens<128, 16>(m);
    default: return nullptr;
  }
}

constexpr size_t kMaxSharedBytes = 227 * 1024;

int threads_for(int rows, HeadGemvTactic tactic) { return tactic.tile / 8 * (rows / tactic.rows_per_thread); }

size_t shared_bytes_for(int rows, int m, HeadGemvTactic tactic) {
  return static_cast<size_t>(threads_for(rows, tactic) / 32) * m * tactic.tile * sizeof(float);
}

std::string tactic_string(HeadGemvTactic tactic) {
  return "{tile " + std::to_string(tactic.tile) + ", rows_per_thread " + std::to_string(tactic.rows_per_thread) + "}";
}

}  // namespace

Status check_head_gemv_tactic(int rows, int cols, int m, HeadGemvTactic tactic) {
  if (kernel_for(tactic, 1) == nullptr) {
    return invalid_argument("tactic", "tile in {16, 32, 64, 128} and rows_per_thread in {8, 16}",
                            tactic_string(tactic));
  }
  const std::string shape = "rows " + std::to_string(rows) + ", cols " + std::to_string(cols);
  if (rows <= 0 || cols <= 0 || rows % tactic.rows_per_thread != 0 || cols % tactic.tile != 0) {
    return invalid_argument("tactic", "tile dividing cols and rows_per_thread dividing rows",
                            tactic_string(tactic) + " for " + shape);
  }
  const int threads = threads_for(rows, tactic);
  const int max_threads = max_threads_for(token_capacity(m), tactic.rows_per_thread);
  if (kernel_for(tactic, m) == nullptr || threads % 32 != 0 || threads > max_threads) {
    return invalid_argument("tactic",
                            "(tile / 8) * (rows / rows_per_thread) threads, a multiple of 32 and at most " +
                                std::to_string(max_threads) + " at m = " + std::to_string(m) +
                                " (registers; rows_per_thread 16 needs m <= 8)",
                            std::to_string(threads) + " threads with " + tactic_string(tactic) + " for " + shape);
  }
  if (shared_bytes_for(rows, m, tactic) > kMaxSharedBytes) {
    return invalid_argument("tactic", "warps * m * tile * 4 bytes of shared memory at most 227 KiB",
                            std::to_string(shared_bytes_for(rows, m, tactic)) + " bytes with " + tactic_string(tactic));
  }
  return Status();
}

Status check_head_gemv(const HeadGemvArgs& a) {
  DSA_RETURN_IF_ERROR(check_dtype(a.x, "x", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.x, "x", {-1, -1, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.x, "x"));
  const int64_t m = a.x.size(0), heads = a.x.size(1), rows = a.x.size(2);
  if (m < 1 || m > kHeadGemvMaxTokens) {
    return invalid_argument("x", "1.." + std::to_string(kHeadGemvMaxTokens) + " tokens in dim 0", a.x.describe());
  }
  if (heads < 1 || rows < 8 || rows % 8 != 0) {
    return invalid_argument("x", "at least one head and a row count I that is a multiple of 8", a.x.describe());
  }
  DSA_RETURN_IF_ERROR(check_stride(a.x, "x", 2, 1));
  DSA_RETURN_IF_ERROR(check_stride(a.x, "x", 1, rows));
  if (a.x.stride(0) % 8 != 0 || a.x.stride(0) < heads * rows) {
    return invalid_argument("x", "a token stride that is a multiple of 8 and at least H*I", a.x.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(a.x, "x", 16));

  DSA_RETURN_IF_ERROR(check_dtype(a.weight, "weight", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.weight, "weight", {heads, rows, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.weight, "weight"));
  const int64_t cols = a.weight.size(2);
  DSA_RETURN_IF_ERROR(check_stride(a.weight, "weight", 2, 1));
  if (a.weight.stride(1) % 8 != 0 || a.weight.stride(1) < cols || a.weight.stride(0) % 8 != 0 ||
      a.weight.stride(0) < rows * a.weight.stride(1)) {
    return invalid_argument("weight", "row and head strides that are multiples of 8 and do not overlap",
                            a.weight.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(a.weight, "weight", 16));

  if (a.out.dtype != DType::kBF16 && a.out.dtype != DType::kFP8E4M3) {
    DSA_RETURN_IF_ERROR(check_present(a.out, "out"));
    return invalid_argument("out", "dtype bf16 or fp8_e4m3", a.out.describe());
  }
  DSA_RETURN_IF_ERROR(check_shape(a.out, "out", {m, heads, cols}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.out, "out"));
  if (!a.out.is_contiguous()) return invalid_argument("out", "a contiguous tensor", a.out.describe());
  if (a.out.dtype == DType::kFP8E4M3) {
    DSA_RETURN_IF_ERROR(check_dtype(a.scale, "scale", DType::kF32));
    DSA_RETURN_IF_ERROR(check_shape(a.scale, "scale", {1}));
    DSA_RETURN_IF_ERROR(check_on_cuda(a.scale, "scale"));
  } else if (a.scale.data != nullptr) {
    return invalid_argument("scale", "no scale with a BF16 out (a scale means FP8 out)", a.scale.describe());
  }

  if (a.cache != nullptr) {
    const KvCacheWrite& c = *a.cache;
    DSA_RETURN_IF_ERROR(check_dtype(c.kv, "cache.kv", DType::kBF16));
    DSA_RETURN_IF_ERROR(check_shape(c.kv, "cache.kv", {m, -1}));
    DSA_RETURN_IF_ERROR(check_on_cuda(c.kv, "cache.kv"));
    const int64_t width = c.kv.size(1);
    if (width < 8 || width % 8 != 0 || c.kv.stride(1) != 1 || c.kv.stride(0) % 8 != 0) {
      return invalid_argument("cache.kv", "a latent width that is a multiple of 8, contiguous rows, row stride a multiple of 8",
                              c.kv.describe());
    }
    DSA_RETURN_IF_ERROR(check_aligned(c.kv, "cache.kv", 16));
    DSA_RETURN_IF_ERROR(check_dtype(c.cache, "cache.cache", DType::kFP8E4M3));
    DSA_RETURN_IF_ERROR(check_shape(c.cache, "cache.cache", {-1, -1, width}));
    DSA_RETURN_IF_ERROR(check_on_cuda(c.cache, "cache.cache"));
    if (c.cache.size(0) < 1 || c.cache.size(1) < 1 || c.cache.stride(2) != 1 || c.cache.stride(1) % 8 != 0 ||
        c.cache.stride(1) < width || c.cache.stride(0) % 8 != 0 || c.cache.stride(0) < c.cache.size(1) * c.cache.stride(1)) {
      return invalid_argument("cache.cache",
                              "[blocks, block_size, L] with L contiguous and entry and block strides that are multiples of 8 "
                              "and do not overlap",
                              c.cache.describe());
    }
    DSA_RETURN_IF_ERROR(check_aligned(c.cache, "cache.cache", 8));
    DSA_RETURN_IF_ERROR(check_dtype(c.slot_mapping, "cache.slot_mapping", DType::kI64));
    DSA_RETURN_IF_ERROR(check_shape(c.slot_mapping, "cache.slot_mapping", {-1}));
    DSA_RETURN_IF_ERROR(check_on_cuda(c.slot_mapping, "cache.slot_mapping"));
    if (c.slot_mapping.stride(0) != 1) {
      return invalid_argument("cache.slot_mapping", "a contiguous vector", c.slot_mapping.describe());
    }
    DSA_RETURN_IF_ERROR(check_dtype(c.k_scale, "cache.k_scale", DType::kF32));
    DSA_RETURN_IF_ERROR(check_shape(c.k_scale, "cache.k_scale", {1}));
    DSA_RETURN_IF_ERROR(check_on_cuda(c.k_scale, "cache.k_scale"));
  }
  return Status();
}

Status head_gemv(const HeadGemvArgs& a, cudaStream_t stream, const HeadGemvTactic* requested) {
  DSA_RETURN_IF_ERROR(check_head_gemv(a));
  const int m = static_cast<int>(a.x.size(0)), heads = static_cast<int>(a.x.size(1));
  const int rows = static_cast<int>(a.x.size(2)), cols = static_cast<int>(a.weight.size(2));
  const HeadGemvTactic tactic = requested ? *requested : head_gemv_tactic(heads, rows, cols, m);
  DSA_RETURN_IF_ERROR(check_head_gemv_tactic(rows, cols, m, tactic));
  const size_t shared_bytes = shared_bytes_for(rows, m, tactic);

  HeadGemvParams p = {};
  p.x = static_cast<const uint16_t*>(a.x.data);
  p.x_token_stride = a.x.stride(0);
  p.weight = static_cast<const uint16_t*>(a.weight.data);
  p.weight_head_stride = a.weight.stride(0);
  p.weight_row_stride = a.weight.stride(1);
  p.out = a.out.data;
  p.scale = a.out.dtype == DType::kFP8E4M3 ? static_cast<const float*>(a.scale.data) : nullptr;
  p.m = m;
  p.heads = heads;
  p.rows = rows;
  p.cols = cols;
  int cache_ctas = 0;
  if (a.cache != nullptr) {
    const KvCacheWrite& c = *a.cache;
    p.kv = static_cast<const uint16_t*>(c.kv.data);
    p.kv_token_stride = c.kv.stride(0);
    p.cache = static_cast<uint8_t*>(c.cache.data);
    p.cache_block_stride = c.cache.stride(0);
    p.cache_entry_stride = c.cache.stride(1);
    p.cache_capacity = c.cache.size(0) * c.cache.size(1);
    p.block_size = static_cast<int>(c.cache.size(1));
    p.cache_width = static_cast<int>(c.cache.size(2));
    p.slots = static_cast<const int64_t*>(c.slot_mapping.data);
    p.tokens_with_slot = static_cast<int>(std::min<int64_t>(c.slot_mapping.size(0), m));
    p.k_scale = static_cast<const float*>(c.k_scale.data);
    p.error_count = c.error_count;
    cache_ctas = m;
  }

  const KernelFn kernel = kernel_for(tactic, m);
  if (shared_bytes > 48 * 1024) {
    // Raising the opt-in limit is not stream-ordered; doing it for the full
    // budget once per kernel keeps graph capture free of attribute changes.
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    DSA_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kMaxSharedBytes)));
  }
  const dim3 grid(heads * (cols / tactic.tile) + cache_ctas);
  const dim3 block(threads_for(rows, tactic));
  return launch_pdl(kernel, grid, block, shared_bytes, stream, p);
}

}  // namespace dsa
