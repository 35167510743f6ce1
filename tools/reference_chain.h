// The decode step of the library's stage on the CPU, kernel by kernel, in
// the kernels' own summation orders where they have a fixed one
// (src/*/..._reference.h): qkv_a_proj -> norm -> q_b_proj -> absorb (FP8) +
// cache write -> indexer (prefill of the context; the step's projections,
// float64 sums stored as the GPU stores them; prepare and select: bit-exact)
// -> sparse attention (float64) -> value-up -> o_proj. The CPU path runs it
// whole; the GPU path runs each piece on the GPU's own inputs to check the
// kernel that made the same output.
#pragma once

#include <cstdint>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/status.h"
#include "head_gemv/head_gemv_reference.h"
#include "indexer/indexer_reference.h"
#include "sparse_mla/sparse_mla_reference.h"
#include "synthetic_layer.h"

namespace dsa::cli {

struct NormOutputs {
  std::vector<uint16_t> q_c;   // [m, Q] BF16
  std::vector<uint16_t> kv_c;  // [m, L] BF16
};

// The head_gemv tactics the table gives for this step, used by the GPU
// launches and the references alike (the summation order depends on them).
HeadGemvTactic absorb_tactic(const StepShape& s);
HeadGemvTactic value_up_tactic(const StepShape& s);

// Both RMSNorms of qkv [m, Q + L].
NormOutputs reference_norm(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& qkv);

// The stage's three cuBLASLt products, nn.Linear's out [m, n] = in [m, k] x
// weight [n, k]^T with FP32 products and sums in k order, rounded to BF16.
// cuBLASLt sums in another order, so these agree with the GPU's GEMMs to BF16
// rounding, not bitwise.
// qkv [m, Q + L] = hidden [m, D] x fused_qkv_a_proj^T.
std::vector<uint16_t> reference_qkv_a_proj(const StepShape& s, const HostWeights& w,
                                           const std::vector<uint16_t>& hidden);
// q [m, H*P] = q_c [m, Q] x q_b_proj^T.
std::vector<uint16_t> reference_q_b_proj(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q_c);
// out [m, D] = heads [m, H*V] x o_proj^T.
std::vector<uint16_t> reference_o_proj(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& heads);

// q_c [m, Q] and kv_c [m, L] in float64: qkv_a_proj of `hidden` [m, D], then
// both RMSNorms (norm.h's formula) of the BF16-rounded qkv.
struct ExactNormOutputs {
  std::vector<double> q_c, kv_c;
};
ExactNormOutputs exact_qkv_a_proj_norm(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& hidden);

// q_fp8 [m, H, L] = static FP8 quant of q [m, H, P] x W_UK_T, head_gemv's order.
std::vector<uint8_t> reference_absorb(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                                      HeadGemvTactic tactic);

// Under --head-gemv-sums tensor-cores: where the GPU's absorb q_fp8 and
// value-up out lie against the tensor-core contract's bound, on the GPU's
// inputs (reference::head_gemv_deviation).
reference::HeadGemvDeviation absorb_deviation(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& q,
                                              const std::vector<uint8_t>& q_fp8);
reference::HeadGemvDeviation value_up_deviation(const StepShape& s, const HostWeights& w,
                                                const std::vector<uint16_t>& latent, const std::vector<uint16_t>& out);

// latent [m, H, L] BF16 and lse [m, H] of q_fp8 [m, H, L] attending over
// `cache` [blocks, block_size, L] e4m3 at `slots` [m, top_k_width()] (-1 = none):
// the float64 reference every sparse MLA kernel is checked against.
reference::SparseMlaResult reference_attention(const StepShape& s, const HostWeights& w,
                                               const std::vector<uint8_t>& q_fp8, const std::vector<uint8_t>& cache,
                                               int64_t blocks, int64_t block_size, const std::vector<int32_t>& slots);

// heads [m, H, V] BF16 = latent [m, H, L] x W_UV, head_gemv's order.
std::vector<uint16_t> reference_value_up(const StepShape& s, const HostWeights& w,
                                         const std::vector<uint16_t>& latent, HeadGemvTactic tactic);

// concat_and_cache_mla of kv_c [m, L] into `cache` at the (whole-cache) slots;
// returns how many slots fell outside the cache's window (skipped).
int reference_cache_write(const StepShape& s, const HostWeights& w, const std::vector<uint16_t>& kv_c,
                          const std::vector<int64_t>& slots, HostCache* cache);

// The indexer's paged state on the host, laid out as on the GPU (StepShape
// says why there may be several requests).
struct IndexerHostState {
  int64_t requests = 0, width = 0;   // block table rows and columns
  int64_t page_bytes = 0;            // StepShape::indexer_page_bytes()
  std::vector<int32_t> block_table;  // [requests, width] int32: identity rows
  std::vector<uint16_t> ring;        // [requests, 2, indexer_ring(), 128] BF16
  std::vector<uint8_t> k_cache;      // [cache_blocks, page_bytes]
  reference::IndexerStateHost view();  // points into the vectors
};

// A zeroed state (the GPU's starts zeroed too, so whole states compare).
IndexerHostState make_indexer_state(const StepShape& s);

// indexer_prefill of every indexer request r over positions
// 0..indexer_prefill_tokens(r)-1 of `history` (make_indexer_history);
// `errors`: untrusted block table entries met (0 for this layout).
Status reference_indexer_prefill(const StepShape& s, const HostWeights& w, const IndexerTokenRows& history,
                                 IndexerHostState* state, int64_t* errors);

// The indexer's projection outputs, as indexer_prepare takes them.
struct IndexerProjections {
  std::vector<uint16_t> index_q;    // [m, HI, 128] BF16
  std::vector<uint16_t> index_k;    // [m, 128] BF16, before the LayerNorm
  std::vector<float> head_weights;  // [m, HI]
  std::vector<uint16_t> gate;       // [m, 128] BF16
};

// indexer_project's float64 reference of q_c [m, Q] and hidden [m, D]: the
// exact sums and the sums of |products| the tolerance scales with
// (src/indexer/indexer_reference.h).
reference::IndexerProjectionsHost reference_indexer_project(const StepShape& s, const HostWeights& w,
                                                            const std::vector<uint16_t>& q_c,
                                                            const std::vector<uint16_t>& hidden);

// indexer_project_gemv's outputs of q_c [m, Q] and hidden [m, D], bit for bit.
reference::IndexerProjectionBitsHost reference_indexer_project_gemv(const StepShape& s, const HostWeights& w,
                                                                    const std::vector<uint16_t>& q_c,
                                                                    const std::vector<uint16_t>& hidden);

// The exact sums stored as indexer_project stores them (BF16 rounded to
// nearest even, head_weights FP32): the CPU path's projections.
IndexerProjections stored_projections(const reference::IndexerProjectionsHost& exact);

// The GPU select's logits under IndexerLogits::kFp32Accumulation, and what
// reference_indexer_step found of them.
struct GpuIndexerLogits {
  // [m, indexer_workspace_layout(plan).logits_stride]: the stage's intermediates().index_logits
  const std::vector<float>* logits = nullptr;
  double worst = 0;     // out: the largest |GPU - exact| / bound (reference::indexer_logit_bounds)
  int64_t outside = 0;  // out: pools outside their bound
  int64_t scored = 0;   // out: pools compared
};

// indexer_prepare, then indexer_select, of the step on `state` from its
// `projections` and the positions and requests of `in`: rows [m, top_k_width()] of
// request-local positions and of KV slots. Under the plan's
// kFp32Accumulation the rows are the selection over the GPU's logits
// (`gpu_logits`, required then), which are compared with the exact ones.
Status reference_indexer_step(const StepShape& s, const HostWeights& w, const IndexerProjections& projections,
                              const HostStepInputs& in, IndexerHostState* state, reference::IndexerRowsHost* rows,
                              int64_t* errors, GpuIndexerLogits* gpu_logits = nullptr);

}  // namespace dsa::cli
