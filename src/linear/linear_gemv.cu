// linear_gemv (include/dsa_decode/linear.h): nn.Linear for a few decode
// tokens as one CUDA-core GEMV launch with PDL; the order of every sum is the
// header's, reproduced by reference::linear_gemv.
//
// The kernel is a stream of the weight. Each lane keeps two groups of
// kGroupPieces 16-byte weight pieces in registers: it issues the loads of the
// next group (of its row, or of its next row) before it adds the current
// one, so a warp never waits on a load it could have issued earlier. With
// kWarps = 16 warps per CTA and one CTA per SM that is 16 x 32 x 8 x 16 B =
// 64 KiB of loads in flight per SM, about twice what the H200's bandwidth
// times its load latency needs. The weight is read once, so its loads do not
// allocate in L1: under the largest shared-memory carveout, which every PDL
// launch asks for (core/launch.cuh), L1 keeps ~28 KiB per SM, and loads that
// allocate there capped the bytes in flight (H200, docs/linear.md v1.1:
// o_proj TP1 at m = 1 / 4 took 34.4 / 49.0 us that way, 32.6 / 44.0 without).
//
// Budgets (ptxas, sm_90a): kGroupPieces = 8 keeps 2 x 32 registers of pieces,
// T accumulators and 16 unpacked values per lane, under the 128 registers
// that __launch_bounds__(512, 1) allows.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/bf16.cuh"
#include "core/launch.cuh"
#include "core/shared_memory.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/numerics.h"

namespace dsa {
namespace {

constexpr int kLanes = 32;
constexpr int kPieceColumns = 8;  // one 16-byte piece of BF16
constexpr int kGroupPieces = 8;   // pieces per lane in one group of loads
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * kLanes;
constexpr size_t kMaxSharedBytes = 227 * 1024;

struct LinearGemvParams {
  const uint16_t* x;       // [m, k] BF16, row stride x_stride
  const uint16_t* weight;  // [n, k] BF16, row stride weight_stride
  uint16_t* out;           // [m, n] BF16, row stride out_stride
  int64_t x_stride, weight_stride, out_stride;
  int m, n, k;
};

// Group g of a row: this lane's pieces (g * kGroupPieces + j) * 32 + lane,
// j < kGroupPieces, those below `pieces` (the others are never read).
__device__ __forceinline__ void load_group(const uint16_t* row, int g, int pieces, int lane,
                                           uint4 (&group)[kGroupPieces]) {
#pragma unroll
  for (int j = 0; j < kGroupPieces; ++j) {
    const int piece = (g * kGroupPieces + j) * kLanes + lane;
    if (piece < pieces) group[j] = load_streaming(reinterpret_cast<const uint4*>(row) + piece);
  }
}

// Adds group g into the T sums in the header's order: pieces in increasing
// index, each piece's 8 columns in increasing column.
template <int kTokens>
__device__ __forceinline__ void add_group(const uint4 (&group)[kGroupPieces], int g, int pieces, int lane,
                                          const uint16_t* staged, int k, float (&acc)[kTokens]) {
#pragma unroll
  for (int j = 0; j < kGroupPieces; ++j) {
    const int piece = (g * kGroupPieces + j) * kLanes + lane;
    if (piece >= pieces) break;  // later pieces of the group are further still
    float w[kPieceColumns];
    unpack_bf16x8(group[j], w);
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      float in[kPieceColumns];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(staged + t * k + piece * kPieceColumns), in);
#pragma unroll
      for (int i = 0; i < kPieceColumns; ++i) acc[t] = fmaf(in[i], w[i], acc[t]);
    }
  }
}

// kTokens: m rounded up to a power of two (one accumulator each).
template <int kTokens>
__global__ void __launch_bounds__(kThreads, 1) linear_gemv_kernel(const __grid_constant__ LinearGemvParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  uint16_t* staged = reinterpret_cast<uint16_t*>(shared);  // [kTokens][k] BF16: x, rows m.. zero
  const int lane = threadIdx.x % kLanes;
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int pieces = p.k / kPieceColumns;
  const int groups = (pieces + kLanes * kGroupPieces - 1) / (kLanes * kGroupPieces);
  int row = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x) / kLanes;

  // The first group of the first row before the wait: weights only.
  uint4 current[kGroupPieces], next[kGroupPieces];
  if (row < p.n) load_group(p.weight + int64_t(row) * p.weight_stride, 0, pieces, lane, current);

  pdl_wait();
  pdl_release_dependents();

  // x after the wait (the previous kernel may have written it), past L1.
  for (int e = threadIdx.x; e < kTokens * pieces; e += kThreads) {
    const int t = e / pieces, v = e % pieces;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (t < p.m) value = __ldcg(reinterpret_cast<const uint4*>(p.x + int64_t(t) * p.x_stride) + v);
    reinterpret_cast<uint4*>(staged)[e] = value;
  }
  __syncthreads();

  int g = 0;
  float acc[kTokens];
#pragma unroll
  for (int t = 0; t < kTokens; ++t) acc[t] = 0.0f;
  while (row < p.n) {
    // The next group in this warp's sequence: the rest of this row, then the next row's first.
    const bool row_ends = g + 1 == groups;
    const int next_row = row_ends ? row + warps : row;
    const int next_g = row_ends ? 0 : g + 1;
    if (next_row < p.n) load_group(p.weight + int64_t(next_row) * p.weight_stride, next_g, pieces, lane, next);
    add_group<kTokens>(current, g, pieces, lane, staged, p.k, acc);
    if (row_ends) {
#pragma unroll
      for (int distance = 1; distance < kLanes; distance *= 2) {
#pragma unroll
        for (int t = 0; t < kTokens; ++t) acc[t] += __shfl_xor_sync(0xFFFFFFFFu, acc[t], distance);
      }
      float mine = acc[0];
#pragma unroll
      for (int t = 1; t < kTokens; ++t) mine = lane == t ? acc[t] : mine;
      if (lane < p.m) p.out[int64_t(lane) * p.out_stride + row] = num::float_to_bf16(mine);
#pragma unroll
      for (int t = 0; t < kTokens; ++t) acc[t] = 0.0f;
    }
    row = next_row;
    g = next_g;
#pragma unroll
    for (int j = 0; j < kGroupPieces; ++j) current[j] = next[j];
  }
}

using KernelFn = void (*)(LinearGemvParams);

int tokens_for(int64_t m) { return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : 8; }

KernelFn kernel_for(int tokens) {
  switch (tokens) {
    case 1:
      return linear_gemv_kernel<1>;
    case 2:
      return linear_gemv_kernel<2>;
    case 4:
      return linear_gemv_kernel<4>;
    default:
      return linear_gemv_kernel<8>;
  }
}

size_t shared_bytes(int tokens, int64_t k) { return size_t(tokens) * size_t(k) * 2; }

}  // namespace

bool linear_gemv_supports(int64_t m, int64_t k) {
  return m >= 1 && m <= kLinearGemvMaxTokens && k >= kPieceColumns && k % kPieceColumns == 0 &&
         shared_bytes(tokens_for(m), k) <= kMaxSharedBytes;
}

Status check_linear_gemv(const LinearGemvArgs& a) {
  DSA_RETURN_IF_ERROR(check_present(a.x, "x"));
  DSA_RETURN_IF_ERROR(check_present(a.weight, "weight"));
  if (a.x.ndim != 2 || a.weight.ndim != 2) {
    return invalid_argument(a.x.ndim != 2 ? "x" : "weight", "a 2-D tensor",
                            a.x.ndim != 2 ? a.x.describe() : a.weight.describe());
  }
  const int64_t m = a.x.size(0), k = a.x.size(1), n = a.weight.size(0);
  if (m < 1 || m > kLinearGemvMaxTokens) {
    return invalid_argument("x", "[m, K] with m in 1.." + std::to_string(kLinearGemvMaxTokens), a.x.describe());
  }
  if (!linear_gemv_supports(m, k)) {
    return invalid_argument("x",
                            "K a positive multiple of 8 with m rounded up to a power of two times K BF16 within " +
                                std::to_string(kMaxSharedBytes / 1024) + " KiB of shared memory (K <= " +
                                std::to_string(kMaxSharedBytes / 2 / tokens_for(m) / 8 * 8) +
                                " at m = " + std::to_string(m) + ")",
                            a.x.describe());
  }
  if (n < 1 || n > kLinearGemvMaxRows) {
    return invalid_argument("weight", "[N, K] with N in 1..2^30", a.weight.describe());
  }
  DSA_RETURN_IF_ERROR(check_bf16_rows(a.x, "x", m, k));
  DSA_RETURN_IF_ERROR(check_bf16_rows(a.weight, "weight", n, k));
  // out is written one value at a time: any row stride of at least N.
  DSA_RETURN_IF_ERROR(check_present(a.out, "out"));
  DSA_RETURN_IF_ERROR(check_dtype(a.out, "out", DType::kBF16));
  DSA_RETURN_IF_ERROR(check_shape(a.out, "out", {m, n}));
  DSA_RETURN_IF_ERROR(check_on_cuda(a.out, "out"));
  DSA_RETURN_IF_ERROR(check_aligned(a.out, "out", 2));
  DSA_RETURN_IF_ERROR(check_stride(a.out, "out", 1, 1));
  if (m > 1 && a.out.stride(0) < n)
    return invalid_argument("out", "a row stride of at least the row", a.out.describe());
  DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", a.x, "x"));
  return check_no_overlap(a.out, "out", a.weight, "weight");
}

Status linear_gemv(const LinearGemvArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_linear_gemv(a));
  LinearGemvParams p = {};
  p.x = static_cast<const uint16_t*>(a.x.data);
  p.weight = static_cast<const uint16_t*>(a.weight.data);
  p.out = static_cast<uint16_t*>(a.out.data);
  p.x_stride = a.x.stride(0);  // only used for rows t >= 1, so any when m == 1
  p.weight_stride = a.weight.stride(0);
  p.out_stride = a.out.stride(0);
  p.m = static_cast<int>(a.x.size(0));
  p.n = static_cast<int>(a.weight.size(0));
  p.k = static_cast<int>(a.x.size(1));

  const int tokens = tokens_for(p.m);
  const KernelFn kernel = kernel_for(tokens);
  const size_t shared = shared_bytes(tokens, p.k);
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(reinterpret_cast<const void*>(kernel),
                                                static_cast<int>(kMaxSharedBytes), "linear_gemv"));
  // As many CTAs as are resident at once (every warp then streams rows from
  // the start), at most one warp per row; the split changes no bit.
  int device = 0, sms = 0, per_sm = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  DSA_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DSA_RETURN_IF_ERROR(kernel_answer_once(
      reinterpret_cast<const void*>(kernel), static_cast<int>(shared),
      [&](int* answer) {
        DSA_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(answer, kernel, kThreads, shared));
        return Status();
      },
      &per_sm));
  const int ctas = std::max(1, std::min(sms * std::max(per_sm, 1), (p.n + kWarps - 1) / kWarps));
  return launch_pdl(kernel, dim3(ctas), dim3(kThreads), shared, stream, p);
}

}  // namespace dsa
