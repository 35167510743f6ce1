// The simple sparse MLA decode kernel (baselines.h): FP32 on CUDA cores,
// written to be read and trusted, the GPU reference and benchmark baseline of
// the tensor-core kernels. The contract is sparse_mla's (include/dsa_decode/sparse_mla.h).
//
// Work split: one CTA per (head, token) (grid H x m), 8 warps. Warp w takes
// the entries j of the token's index row in steps of kRowsPerStep:
// j = (i * kWarps + w) * kRowsPerStep + r. Lane l owns the 16 latent
// dimensions 16l..16l+15 of q and of every cache row (one 16-byte load per row).
//
// Per warp, an online softmax over its entries (flash-decoding's recurrence):
//   score   = (sum over the lane's 16 dims as an FMA chain from 0, then a
//              butterfly over the lanes, xor 16, 8, 4, 2, 1) * score_scale
//   new_max = max(run_max, score)            (NaN propagates)
//   run_sum = run_sum * exp(run_max - new_max) + exp(score - new_max)
//   acc[d]  = acc[d]  * exp(run_max - new_max) + exp(score - new_max) * kv[d]
// with kv the e4m3 codes (k_scale is applied once at the end). Then the warps
// are merged in warp order through shared memory. The butterfly leaves the
// same bits in every lane, so every lane agrees on the running state.
//
// Every sum has a fixed order that depends only on K and the entry positions:
// the same inputs give the same bits on every run, and a token's bits do not
// depend on m or on the other tokens of the batch.

#include <cmath>
#include <cstdint>

#include "baselines.h"
#include "core/fp8.cuh"
#include "core/launch.cuh"
#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla.h"
#include "sparse_mla/sparse_mla_params.h"

namespace dsa {
namespace {

constexpr int kLatent = kSparseMlaLatent;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kDimsPerLane = kLatent / 32;  // 16 FP8 codes: one 16-byte load
constexpr int kRowsPerStep = 4;             // cache rows a warp loads before it uses the first
static_assert(kDimsPerLane == 16, "one uint4 of FP8 codes per lane");

// Sixteen e4m3 codes to FP32, exactly.
__device__ __forceinline__ void decode_e4m3x16(const uint4& codes, float (&out)[kDimsPerLane]) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2 values = e4m3x2_to_float2(words[w] >> (16 * half));
      out[4 * w + 2 * half] = values.x;
      out[4 * w + 2 * half + 1] = values.y;
    }
  }
}


__global__ void __launch_bounds__(kThreads) sparse_mla_simple_kernel(const SparseMlaParams p) {
  __shared__ float4 warp_acc[kWarps][kLatent / 4];  // [warp][latent dims] FP32, the warps' unnormalized outputs
  __shared__ float warp_max[kWarps], warp_sum[kWarps];

  const int head = blockIdx.x, heads = gridDim.x, token = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Every input is written by a predecessor in the decode chain (absorb, indexer).
  pdl_wait();
  pdl_release_dependents();

  const float score_scale = p.softmax_scale * *p.q_scale * *p.k_scale;
  float q[kDimsPerLane];  // the lane's 16 dims of q[token, head, :], as codes
  decode_e4m3x16(*reinterpret_cast<const uint4*>(p.q + token * p.q_token_stride + head * p.q_head_stride +
                                                 lane * kDimsPerLane),
                 q);

  float run_max = -INFINITY, run_sum = 0.0f;
  float acc[kDimsPerLane];  // sum of exp(score - run_max) * kv codes, the lane's 16 dims
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.0f;
  unsigned int out_of_range = 0;  // this warp's entries >= capacity

  const int32_t* index_row = p.indices + token * p.indices_token_stride;
  for (int first = warp * kRowsPerStep; first < p.top_k; first += kWarps * kRowsPerStep) {
    // Issue the step's loads before any use, so kRowsPerStep rows are in flight.
    // Every lane reads the same indices, so `valid` is uniform across the warp.
    bool valid[kRowsPerStep];
    uint4 codes[kRowsPerStep];
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
      const int j = first + r;
      const int32_t slot = j < p.top_k ? index_row[j] : -1;
      const int64_t offset = sparse_mla_row_offset(p, slot);
      valid[r] = offset >= 0;
      out_of_range += (slot >= p.capacity) ? 1u : 0u;
      codes[r] = make_uint4(0, 0, 0, 0);
      if (valid[r]) codes[r] = *reinterpret_cast<const uint4*>(p.cache + offset + lane * kDimsPerLane);
    }
#pragma unroll
    for (int r = 0; r < kRowsPerStep; ++r) {
      if (!valid[r]) continue;
      float kv[kDimsPerLane];
      decode_e4m3x16(codes[r], kv);
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) dot = fmaf(q[i], kv[i], dot);
#pragma unroll
      for (int offset = 16; offset >= 1; offset /= 2) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, offset);
      const float score = dot * score_scale;
      const float new_max = max_propagating_nan(run_max, score);
      const float rescale = expf(run_max - new_max);  // 0 for the first entry (run_max = -inf)
      const float weight = expf(score - new_max);
      run_sum = fmaf(run_sum, rescale, weight);
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) acc[i] = fmaf(acc[i], rescale, weight * kv[i]);
      run_max = new_max;
    }
  }

  if (head == 0 && lane == 0 && out_of_range != 0 && p.error_count != nullptr) {
    atomicAdd(p.error_count, out_of_range);  // head 0's CTA counts each entry of the row once
  }
#pragma unroll
  for (int i = 0; i < kDimsPerLane / 4; ++i) {
    warp_acc[warp][lane * (kDimsPerLane / 4) + i] =
        make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
  }
  if (lane == 0) {
    warp_max[warp] = run_max;
    warp_sum[warp] = run_sum;
  }
  __syncthreads();

  // Merge the warps in warp order; every thread computes the same total max and
  // sum. A warp without valid entries has max -inf and sum 0: its weight is 0.
  float total_max = -INFINITY;
  for (int w = 0; w < kWarps; ++w) total_max = max_propagating_nan(total_max, warp_max[w]);
  const int64_t row = int64_t(token) * heads + head;
  uint16_t* latent_row = p.latent + token * p.latent_token_stride + int64_t(head) * kLatent;
  if (total_max == -INFINITY) {  // no valid entry
    for (int d = threadIdx.x; d < kLatent; d += kThreads) latent_row[d] = 0;
    if (threadIdx.x == 0) p.lse[row] = -INFINITY;
    return;
  }
  float warp_weight[kWarps];
  float total_sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    warp_weight[w] = expf(warp_max[w] - total_max);
    total_sum = fmaf(warp_sum[w], warp_weight[w], total_sum);
  }
  const float output_scale = num::div_rn(*p.k_scale, total_sum);
  const float* acc_dims = reinterpret_cast<const float*>(warp_acc);  // [warp][512]
  for (int d = threadIdx.x; d < kLatent; d += kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total = fmaf(acc_dims[w * kLatent + d], warp_weight[w], total);
    latent_row[d] = num::float_to_bf16(total * output_scale);
  }
  if (threadIdx.x == 0) p.lse[row] = total_max + logf(total_sum);
}

}  // namespace

Status sparse_mla_simple(const SparseMlaArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_sparse_mla(a));
  const SparseMlaParams p = sparse_mla_params(a);
  // split_counters: this kernel does not split, so it leaves them untouched (zero).
  const dim3 grid(static_cast<unsigned>(a.q.size(1)), static_cast<unsigned>(a.q.size(0)));
  return launch_pdl(sparse_mla_simple_kernel, grid, dim3(kThreads), 0, stream, p);
}

}  // namespace dsa
