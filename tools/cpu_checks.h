// The CPU path's verdict: the products of the CPU reference chain (the
// kernels' fixed FP32 orders) against float64 on the same BF16/FP8 inputs,
// within the numerics contract's bounds (DESIGN.md section 2): the
// projections' and head_gemv's BF16 outputs within 1 BF16 ulp of the rounded
// exact sum at the values' scale, absorb's FP8 within 1 e4m3 step, the norm
// within 1 BF16 ulp, the attention's latent within 5e-3 relative Frobenius
// and lse within 1e-3 absolute of a second float64 computation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "report.h"
#include "synthetic_layer.h"

namespace dsa::cli {

// A BF16 product out [m, n] = x [m, k] x weight [n, k]^T against float64.
Check check_product_vs_float64(const std::string& name, const std::vector<uint16_t>& out,
                               const std::vector<uint16_t>& x, int m, int64_t k, const std::vector<uint16_t>& weight,
                               int64_t n, const char* input);

// Both RMSNorms of qkv [m, Q + L] against the float64 norm of the same qkv.
Check check_norm_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& qkv,
                            const std::vector<uint16_t>& q_c, const std::vector<uint16_t>& kv_c);

// absorb's q_fp8 [m, H, L] of q [m, H, P] against the float64 absorb,
// quantized as the kernel quantizes.
Check check_absorb_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                              const std::vector<uint8_t>& q_fp8);

// value-up's heads [m, H, V] of latent [m, H, L] against float64.
Check check_value_up_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& latent,
                                const std::vector<uint16_t>& heads);

// The attention's latent [m, H, L] BF16 and lse [m, H] over `cache`
// [entries, L] e4m3 at `slots` [m, top_k_width()] (-1: none) against a
// second float64 computation (one pass, running maximum).
Check check_attention_vs_float64(const StepShape& s, const HostWeights& w, const std::vector<uint8_t>& q_fp8,
                                 const std::vector<uint8_t>& cache, const std::vector<int32_t>& slots,
                                 const std::vector<uint16_t>& latent, const std::vector<float>& lse);

// The indexer's rows [m, top_k_width()] of request-local positions
// (`positions`) and KV slots (`slots`) against the layout the indexer's
// shape gives (indexer.h, steps 5-8): for L = pos + 1 <= K the positions
// 0..L-1; else K / S distinct complete pools (S consecutive positions each,
// S | the first, first + S <= S (L / S), increasing) in columns 0..K-1, the
// tail S (L / S)..L-1 from column K; -1 after; a slot where the identity
// block table puts its position. Padding tokens: rows of -1.
Check check_indexer_rows_layout(const StepShape& s, const HostStepInputs& in, const std::vector<int32_t>& positions,
                                const std::vector<int32_t>& slots);

}  // namespace dsa::cli
