// head_gemv kernel, its launcher and its argument checks. The contract and the
// summation order are documented in include/dsa_decode/head_gemv.h.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/launch.cuh"
#include "core/shared_memory.h"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/numerics.h"
#include "head_gemv/head_gemv_kernels.h"

namespace dsa {
namespace {

__device__ __forceinline__ float low_bf16(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_bf16(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

// Element k (0..7) of eight BF16 values packed in a uint4.
__device__ __forceinline__ float bf16_element(const uint4& v, int k) {
  const uint32_t pair = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
  return (k & 1) ? high_bf16(pair) : low_bf16(pair);
}

constexpr int kRowsPerChunk = 8;  // rows of each thread in one async-copy group

// Tokens per thread (1, 2, 4 or 8): the accumulators a thread keeps in
// registers. A step of m tokens runs ceil(m / tokens_per_thread) token groups
// of the base CTA shape side by side in one CTA; they share the weight slab.
int tokens_per_thread_for(int m) { return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : 8; }
int token_groups_for(int m) { return (m + tokens_per_thread_for(m) - 1) / tokens_per_thread_for(m); }

// Threads per CTA that the registers allow (accumulators + ~64 others).
constexpr int max_threads_for(int tokens_per_thread) {
  return tokens_per_thread >= 8 ? 512 : tokens_per_thread == 4 ? 768 : 1024;
}

// Dynamic shared memory of a CTA, in this order (each part 16-byte aligned):
//   slab     [rows][tile] BF16 weights; after the products, reused as the
//            partial sums [warps of a group][m][tile] FP32
//   x        [rows][groups * tokens_per_thread] FP32, the head's x transposed,
//            zero past m
struct SharedLayout {
  size_t slab_bytes, x_offset, total;
};

__host__ __device__ inline size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

__host__ __device__ inline SharedLayout shared_layout(int rows, int tile, int rows_per_thread, int m,
                                                      int padded_tokens) {
  const int group_threads = tile / 8 * (rows / rows_per_thread);
  const size_t weights = size_t(rows) * tile * 2;
  const size_t partials = size_t(group_threads / 32) * m * tile * 4;
  SharedLayout layout;
  layout.slab_bytes = align16(weights > partials ? weights : partials);
  layout.x_offset = layout.slab_bytes;
  layout.total = layout.x_offset + align16(size_t(rows) * padded_tokens * 4);
  return layout;
}

// kTokensPerThread: tokens of one token group. The tactic (tile, rows per
// thread) is a run-time parameter: it sets the CTA shape and the summation
// order, not the registers. Thread i of the CTA is thread i % group_threads of
// token group i / group_threads; every group sums in the same order, so a
// token's bits do not depend on which group, or which m, it runs in.
template <int kTokensPerThread>
__global__ void __launch_bounds__(max_threads_for(kTokensPerThread))
    head_gemv_kernel(const __grid_constant__ HeadGemvParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int tile = p.tile, rows_per_thread = p.rows_per_thread;
  const int tiles = p.cols / tile;
  if (static_cast<int>(blockIdx.x) >= p.heads * tiles) {
    write_cache_row(p, blockIdx.x - p.heads * tiles);
    return;
  }
  const int col_threads = tile / 8;  // threads sharing one row group
  const int group_threads = col_threads * (p.rows / rows_per_thread);
  const int padded_tokens = blockDim.x / group_threads * kTokensPerThread;
  const SharedLayout layout = shared_layout(p.rows, tile, rows_per_thread, p.m, padded_tokens);
  uint16_t* slab = reinterpret_cast<uint16_t*>(shared);                // [rows][tile] BF16
  float* partial = reinterpret_cast<float*>(shared);                   // [group warps][m][tile], after the products
  float* x_rows = reinterpret_cast<float*>(shared + layout.x_offset);  // [rows][padded_tokens]

  const int chunks = rows_per_thread / kRowsPerChunk;
  const int head = blockIdx.x / tiles;
  const int tile_index = blockIdx.x % tiles;
  const int lane = threadIdx.x % 32;
  const int group = threadIdx.x / group_threads;
  const int group_thread = threadIdx.x % group_threads;
  const int group_warp = group_thread / 32;
  const int first_row = group_thread / col_threads * rows_per_thread;
  const int col_in_tile = group_thread % col_threads * 8;
  const int first_token = group * kTokensPerThread;

  // Token group 0 streams the weight slab into shared memory before the PDL
  // wait (the weights do not depend on the predecessor): each of its threads
  // copies its own rows x 8 columns, one async-copy group per 8 rows, so the
  // products of the first rows start while later rows still arrive.
  if (group == 0) {
    const uint16_t* source = p.weight + head * p.weight_head_stride + int64_t(first_row) * p.weight_row_stride +
                             tile_index * tile + col_in_tile;
    uint16_t* destination = slab + first_row * tile + col_in_tile;
    for (int c = 0; c < chunks; ++c) {
#pragma unroll
      for (int i = 0; i < kRowsPerChunk; ++i) {
        const int r = c * kRowsPerChunk + i;
        async_copy_16(shared_address(destination + r * tile), source + r * p.weight_row_stride);
      }
      async_copy_commit();
    }
  }

  // HeadGemvArgs::release_dependents_early says when to release.
  if (p.release_early) pdl_release_dependents();
  pdl_wait();
  if (!p.release_early) pdl_release_dependents();

  // x of this head, transposed so that one row's values for every token are
  // adjacent; neighbouring threads take neighbouring tokens, so their stores
  // fall in different banks. Tokens m.. of the last group read zeros.
  const int row_vectors = p.rows / 8;
  for (int e = threadIdx.x; e < padded_tokens * row_vectors; e += blockDim.x) {
    const int t = e % padded_tokens, q = e / padded_tokens;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (t < p.m) v = *reinterpret_cast<const uint4*>(p.x + t * p.x_token_stride + head * p.rows + q * 8);
#pragma unroll
    for (int k = 0; k < 8; ++k) x_rows[(q * 8 + k) * padded_tokens + t] = bf16_element(v, k);
  }

  float acc[kTokensPerThread][8];  // [token of the group][column]
#pragma unroll
  for (int t = 0; t < kTokensPerThread; ++t) {
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[t][k] = 0.0f;
  }
  for (int c = 0; c < chunks; ++c) {
    if (group == 0) async_copy_wait(chunks - 1 - c);
    __syncthreads();  // chunk c of the slab (and, the first time, x) is visible to every group
#pragma unroll
    for (int i = 0; i < kRowsPerChunk; ++i) {
      const int row = first_row + c * kRowsPerChunk + i;
      const uint4 packed = *reinterpret_cast<const uint4*>(slab + row * tile + col_in_tile);
      float w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = bf16_element(packed, k);
      const float* x_row = x_rows + row * padded_tokens + first_token;
      float a[kTokensPerThread];
      if constexpr (kTokensPerThread >= 4) {
#pragma unroll
        for (int q = 0; q < kTokensPerThread / 4; ++q) {
          const float4 v = reinterpret_cast<const float4*>(x_row)[q];
          a[4 * q] = v.x, a[4 * q + 1] = v.y, a[4 * q + 2] = v.z, a[4 * q + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int t = 0; t < kTokensPerThread; ++t) a[t] = x_row[t];
      }
#pragma unroll
      for (int t = 0; t < kTokensPerThread; ++t) {
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[t][k] = fmaf(a[t], w[k], acc[t][k]);
      }
    }
  }

  // Row groups of one warp: lanes c, c + col_threads, ... hold column group c.
  for (int offset = col_threads; offset < 32; offset *= 2) {
#pragma unroll
    for (int t = 0; t < kTokensPerThread; ++t) {
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[t][k] += __shfl_xor_sync(0xFFFFFFFFu, acc[t][k], offset);
    }
  }
  __syncthreads();  // every thread is done with the slab: it becomes the partials
  if (lane < col_threads) {
#pragma unroll
    for (int j = 0; j < kTokensPerThread; ++j) {
      const int t = first_token + j;
      if (t < p.m) {
        float4* dst = reinterpret_cast<float4*>(partial + (group_warp * p.m + t) * tile + lane * 8);
        dst[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
        dst[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
      }
    }
  }
  __syncthreads();

  const int group_warps = group_threads / 32;
  const bool fp8_out = p.scale != nullptr;
  const float inverse_scale = fp8_out ? num::div_rn(1.0f, *p.scale) : 1.0f;
  for (int e = threadIdx.x; e < p.m * tile; e += blockDim.x) {
    const int t = e / tile;
    const int c = e % tile;
    float total = 0.0f;
    for (int w = 0; w < group_warps; ++w) total += partial[(w * p.m + t) * tile + c];
    const int64_t index = (static_cast<int64_t>(t) * p.heads + head) * p.cols + tile_index * tile + c;
    if (fp8_out) {
      static_cast<uint8_t*>(p.out)[index] = num::quant_fp8_static(num::round_bf16(total), inverse_scale);
    } else {
      static_cast<uint16_t*>(p.out)[index] = num::float_to_bf16(total);
    }
  }
}

using KernelFn = void (*)(HeadGemvParams);

KernelFn kernel_for(int m) {
  switch (tokens_per_thread_for(m)) {
    case 1: return head_gemv_kernel<1>;
    case 2: return head_gemv_kernel<2>;
    case 4: return head_gemv_kernel<4>;
    default: return head_gemv_kernel<8>;
  }
}

constexpr size_t kMaxSharedBytes = 227 * 1024;
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;  // the kernel's int index math

// Threads of one token group; a CTA runs token_groups_for(m) of them.
int group_threads_for(int rows, HeadGemvTactic tactic) { return tactic.tile / 8 * (rows / tactic.rows_per_thread); }

size_t shared_bytes_for(int rows, int m, HeadGemvTactic tactic) {
  return shared_layout(rows, tactic.tile, tactic.rows_per_thread, m, token_groups_for(m) * tokens_per_thread_for(m))
      .total;
}

std::string tactic_string(HeadGemvTactic tactic) {
  return "{tile " + std::to_string(tactic.tile) + ", rows_per_thread " + std::to_string(tactic.rows_per_thread) + "}";
}

bool is_power_of_two(int v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

Status check_head_gemv_tactic(int rows, int cols, int m, HeadGemvTactic tactic) {
  if (!is_power_of_two(tactic.tile) || tactic.tile < 16 || tactic.tile > 256 ||
      !is_power_of_two(tactic.rows_per_thread) || tactic.rows_per_thread < 8 || tactic.rows_per_thread > 64) {
    return invalid_argument("tactic", "tile in {16, 32, 64, 128, 256} and rows_per_thread in {8, 16, 32, 64}",
                            tactic_string(tactic));
  }
  auto shape = [&] { return "rows " + std::to_string(rows) + ", cols " + std::to_string(cols); };
  if (rows <= 0 || cols <= 0 || rows % tactic.rows_per_thread != 0 || cols % tactic.tile != 0) {
    return invalid_argument("tactic", "tile dividing cols and rows_per_thread dividing rows",
                            tactic_string(tactic) + " for " + shape());
  }
  m = std::max(m, 1);
  const int group_threads = group_threads_for(rows, tactic);
  const int threads = group_threads * token_groups_for(m);
  const int max_threads = max_threads_for(tokens_per_thread_for(m));
  if (group_threads % 32 != 0 || threads > max_threads) {
    return invalid_argument("tactic",
                            "(tile / 8) * (rows / rows_per_thread) threads per token group, a multiple of 32, and at "
                            "most " + std::to_string(max_threads) + " threads for the " +
                                std::to_string(token_groups_for(m)) + " token groups of m = " + std::to_string(m) +
                                " (registers)",
                            std::to_string(group_threads) + " threads per group with " + tactic_string(tactic) +
                                " for " + shape());
  }
  if (shared_bytes_for(rows, m, tactic) > kMaxSharedBytes) {
    return invalid_argument("tactic", "at most 227 KiB of shared memory (weight slab rows * tile * 2 bytes)",
                            std::to_string(shared_bytes_for(rows, m, tactic)) + " bytes with " + tactic_string(tactic) +
                                " for " + shape());
  }
  return Status();
}

Status check_kv_cache_write(const KvCacheWrite& c, int64_t m) {
  DSA_RETURN_IF_ERROR(check_dtype(c.kv, "cache.kv", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(c.kv, "cache.kv", {m, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(c.kv, "cache.kv"));
  const int64_t width = c.kv.size(1);
  if (width < 8 || width % 8 != 0 || width > kMaxDim || c.kv.stride(1) != 1 ||
      (m > 1 && (c.kv.stride(0) % 8 != 0 || c.kv.stride(0) < width))) {
    return invalid_argument("cache.kv",
                            "a latent width that is a multiple of 8, contiguous rows, row stride a multiple of 8",
                            c.kv.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(c.kv, "cache.kv", 16));
  DSA_RETURN_IF_ERROR(check_dtype(c.cache, "cache.cache", DType::kFP8E4M3));
  DSA_RETURN_IF_ERROR(check_shape(c.cache, "cache.cache", {-1, -1, width}));
  DSA_RETURN_IF_ERROR(check_on_cuda(c.cache, "cache.cache"));
  // A size-1 dimension's stride is never used (tensor.h): one block's goes
  // unchecked, and a block of one entry spans just the entry's width.
  const int64_t blocks = c.cache.size(0), block_size = c.cache.size(1);
  const int64_t entry_stride = block_size > 1 ? c.cache.stride(1) : width;
  if (blocks < 1 || block_size < 1 || block_size > kMaxDim || c.cache.stride(2) != 1 ||
      (block_size > 1 && (entry_stride % 8 != 0 || entry_stride < width)) ||
      (blocks > 1 && (c.cache.stride(0) % 8 != 0 || c.cache.stride(0) < block_size * entry_stride))) {
    return invalid_argument("cache.cache",
                            "[blocks, block_size, L] with L contiguous and entry and block strides that are "
                            "multiples of 8 and do not overlap",
                            c.cache.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(c.cache, "cache.cache", 8));
  DSA_RETURN_IF_ERROR(check_dtype(c.slot_mapping, "cache.slot_mapping", DType::kI64));
  DSA_RETURN_IF_ERROR(check_shape(c.slot_mapping, "cache.slot_mapping", {-1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(c.slot_mapping, "cache.slot_mapping"));
  if (c.slot_mapping.stride(0) != 1 && c.slot_mapping.size(0) > 1) {
    return invalid_argument("cache.slot_mapping", "a contiguous vector", c.slot_mapping.describe());
  }
  DSA_RETURN_IF_ERROR(check_aligned(c.slot_mapping, "cache.slot_mapping", 8));
  DSA_RETURN_IF_ERROR(check_dtype(c.k_scale, "cache.k_scale", DType::kF32));
  DSA_RETURN_IF_ERROR(check_shape(c.k_scale, "cache.k_scale", {1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(c.k_scale, "cache.k_scale"));
  DSA_RETURN_IF_ERROR(check_aligned(c.k_scale, "cache.k_scale", 4));
  DSA_RETURN_IF_ERROR(check_error_counter(c.error_count, "cache.error_count"));
  for (const auto& [other, name] : {std::pair{&c.kv, "cache.kv"}, {&c.slot_mapping, "cache.slot_mapping"},
                                    {&c.k_scale, "cache.k_scale"}}) {
    DSA_RETURN_IF_ERROR(check_no_overlap(c.cache, "cache.cache", *other, name));
  }
  return Status();
}

Status check_head_gemv_weight(const TensorView& w, const char* name, int64_t heads, int64_t rows) {
  DSA_RETURN_IF_ERROR(check_dtype(w, name, DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(w, name, {heads, rows, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(w, name));
  const int64_t cols = w.size(2);
  DSA_RETURN_IF_ERROR(check_stride(w, name, 2, 1));
  if (cols < 1 || heads * cols > kMaxDim || w.stride(1) % 8 != 0 || w.stride(1) < cols ||
      (heads > 1 && (w.stride(0) % 8 != 0 || w.stride(0) < rows * w.stride(1)))) {
    return invalid_argument(
        name, "J >= 1, H*J < 2^31, and row and head strides that are multiples of 8 and do not overlap", w.describe());
  }
  return check_aligned(w, name, 16);
}

Status check_head_gemv(const HeadGemvArgs& a) {
  if (a.sums != HeadGemvSums::kTensorCores && a.sums != HeadGemvSums::kSeedOrder) {
    return invalid_argument("sums", "HeadGemvSums::kTensorCores (0) or kSeedOrder (1)",
                            std::to_string(static_cast<int>(a.sums)));
  }
  DSA_RETURN_IF_ERROR(check_dtype(a.x, "x", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.x, "x", {-1, -1, -1}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.x, "x"));
  const int64_t m = a.x.size(0), heads = a.x.size(1), rows = a.x.size(2);
  if (m < 1 || m > kHeadGemvMaxTokens) {
    return invalid_argument("x", "1.." + std::to_string(kHeadGemvMaxTokens) + " tokens in dim 0", a.x.describe());
  }
  if (heads < 1 || rows < 8 || rows % 8 != 0 || heads * rows > kMaxDim) {
    return invalid_argument("x", "at least one head, a row count I that is a multiple of 8, and H*I < 2^31",
                            a.x.describe());
  }
  DSA_RETURN_IF_ERROR(check_head_rows(a.x, "x", DType::kBF16, m, heads, rows));

  DSA_RETURN_IF_ERROR(check_head_gemv_weight(a.weight, "weight", heads, rows));
  const int64_t cols = a.weight.size(2);

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
    DSA_RETURN_IF_ERROR(check_aligned(a.scale, "scale", 4));
  } else if (a.scale.data != nullptr) {
    return invalid_argument("scale", "no scale with a BF16 out (a scale means FP8 out)", a.scale.describe());
  }
  if (a.sums == HeadGemvSums::kTensorCores) {
    DSA_RETURN_IF_ERROR(check_aligned(a.out, "out", 8));  // its epilogue stores four columns at once
  } else {
    DSA_RETURN_IF_ERROR(check_aligned(a.out, "out", dtype_size(a.out.dtype)));  // one value per store
  }
  DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", a.x, "x"));
  DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", a.weight, "weight"));
  DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", a.scale, "scale"));

  if (a.cache != nullptr) {
    const KvCacheWrite& c = *a.cache;
    DSA_RETURN_IF_ERROR(check_kv_cache_write(c, m));
    for (const auto& [other, name] : {std::pair{&a.x, "x"}, {&a.weight, "weight"}, {&a.scale, "scale"}}) {
      DSA_RETURN_IF_ERROR(check_no_overlap(c.cache, "cache.cache", *other, name));
    }
    for (const auto& [other, name] : {std::pair{&c.kv, "cache.kv"}, {&c.cache, "cache.cache"},
                                      {&c.slot_mapping, "cache.slot_mapping"}, {&c.k_scale, "cache.k_scale"}}) {
      DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", *other, name));
    }
  }
  return Status();
}

namespace {

// The launch parameters of checked arguments, but the work split (tile,
// rows_per_thread); the cache-write CTAs the launch adds in *cache_ctas.
HeadGemvParams make_params(const HeadGemvArgs& a, int* cache_ctas) {
  HeadGemvParams p = {};
  p.x = static_cast<const uint16_t*>(a.x.data);
  p.x_token_stride = a.x.stride(0);
  p.weight = static_cast<const uint16_t*>(a.weight.data);
  p.weight_head_stride = a.weight.stride(0);
  p.weight_row_stride = a.weight.stride(1);
  p.out = a.out.data;
  p.scale = a.out.dtype == DType::kFP8E4M3 ? static_cast<const float*>(a.scale.data) : nullptr;
  p.m = static_cast<int>(a.x.size(0));
  p.heads = static_cast<int>(a.x.size(1));
  p.rows = static_cast<int>(a.x.size(2));
  p.cols = static_cast<int>(a.weight.size(2));
  p.release_early = a.release_dependents_early ? 1 : 0;
  *cache_ctas = 0;
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
    p.tokens_with_slot = static_cast<int>(std::min<int64_t>(c.slot_mapping.size(0), p.m));
    p.k_scale = static_cast<const float*>(c.k_scale.data);
    p.error_count = c.error_count;
    *cache_ctas = p.m;
  }
  return p;
}

// The tensor-core kernel with column tile `tile` (0: head_gemv_mma_tile's).
Status run_tensor_cores(const HeadGemvArgs& a, int tile, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_head_gemv(a));
  int cache_ctas = 0;
  HeadGemvParams p = make_params(a, &cache_ctas);
  if (!head_gemv_mma_supports(p.rows, p.cols)) {
    return unsupported("head_gemv (tensor cores): I = " + std::to_string(p.rows) + ", J = " + std::to_string(p.cols) +
                       " (it runs I a multiple of 64 up to 1024 and J a multiple of 16)");
  }
  p.tile = tile != 0 ? tile : head_gemv_mma_tile(p.heads, p.rows, p.cols, p.m);
  return launch_head_gemv_mma(p, cache_ctas, stream);
}

}  // namespace

Status head_gemv(const HeadGemvArgs& a, cudaStream_t stream, const HeadGemvTactic* requested) {
  if (a.sums == HeadGemvSums::kTensorCores) {
    if (requested != nullptr) {
      return invalid_argument("tactic", "none with sums = kTensorCores (its work split is fixed)",
                              tactic_string(*requested));
    }
    return run_tensor_cores(a, 0, stream);
  }
  DSA_RETURN_IF_ERROR(check_head_gemv(a));
  int cache_ctas = 0;
  HeadGemvParams p = make_params(a, &cache_ctas);
  const HeadGemvTactic tactic = requested ? *requested : head_gemv_tactic(p.heads, p.rows, p.cols, p.m);
  const Status runnable = check_head_gemv_tactic(p.rows, p.cols, p.m, tactic);
  if (!runnable.ok() && requested == nullptr) {
    return unsupported("head_gemv: no tactic runs H = " + std::to_string(p.heads) + ", I = " + std::to_string(p.rows) +
                       ", J = " + std::to_string(p.cols) + " at m = " + std::to_string(p.m) +
                       " (I a multiple of 8 rows per thread, J of a 16..256 column tile)");
  }
  DSA_RETURN_IF_ERROR(runnable);
  p.tile = tactic.tile;
  p.rows_per_thread = tactic.rows_per_thread;
  const KernelFn kernel = kernel_for(p.m);
  DSA_RETURN_IF_ERROR(
      raise_shared_memory_limit(reinterpret_cast<const void*>(kernel), static_cast<int>(kMaxSharedBytes), "head_gemv"));
  const dim3 grid(p.heads * (p.cols / tactic.tile) + cache_ctas);
  const dim3 block(group_threads_for(p.rows, tactic) * token_groups_for(p.m));
  return launch_pdl(kernel, grid, block, shared_bytes_for(p.rows, p.m, tactic), stream, p);
}

Status head_gemv_tensor_cores_with_tile(const HeadGemvArgs& a, int tile, cudaStream_t stream) {
  if (a.sums != HeadGemvSums::kTensorCores) {
    return invalid_argument("sums", "kTensorCores (the tile is the tensor-core kernel's)", "kSeedOrder");
  }
  return run_tensor_cores(a, tile, stream);
}

}  // namespace dsa
