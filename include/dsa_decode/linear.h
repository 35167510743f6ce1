// nn.Linear for decode steps of a few tokens, as one GEMV launch with PDL:
//   out[t, n] = BF16(sum_k x[t, k] * weight[n, k])
// Fixed order, bitwise reference::linear_gemv: lane l of row n's warp chains
// columns 8l..8l+7, 8l+256.. with fmaf from +0; a xor butterfly adds the 32
// lane sums (distances 1, 2, 4, 8, 16); BF16 round to nearest even. A token's
// bits depend only on its x row and the weight (deterministic, batch invariant).
// Weights are read before griddepcontrol.wait: no kernel in flight may write them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kLinearGemvMaxTokens = 8;
inline constexpr int64_t kLinearGemvMaxRows = int64_t{1} << 30;

// x [m, K] BF16 (m <= kLinearGemvMaxTokens), weight [N, K] BF16, out [m, N]
// BF16 (row stride >= N, disjoint from x and weight); dim 1 contiguous; K,
// x's and weight's row strides multiples of 8, bases 16 B aligned; T * K * 2
// bytes <= 227 KiB, T = m rounded up to a power of two.
struct LinearGemvArgs {
  TensorView x;
  TensorView weight;
  TensorView out;
};

Status check_linear_gemv(const LinearGemvArgs& args);

// Whether m tokens of K columns fit the shared-memory rule.
bool linear_gemv_supports(int64_t m, int64_t k);

// Graph capturable after one uncaptured call at the same T.
Status linear_gemv(const LinearGemvArgs& args, cudaStream_t stream);

}  // namespace dsa
