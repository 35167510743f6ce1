// The CPU reference of the glm5next indexer's decode path
// (include/dsa_decode/indexer.h), step by step in the contract's fixed order:
// the LayerNorm, the q quant, the pool compression, the ring and the K cache
// bytes are bitwise what the GPU kernels must produce (the arithmetic is the
// host side of src/indexer/indexer_math.h). The logits are the contract's
// FP32 order on exact head dots; GPU logits match them within a tolerance.
// The projections (cuBLASLt on the GPU, no fixed order) are float64 sums,
// matched within the tolerance below; indexer_project_gemv's fixed order is
// reproduced bit for bit (reference::indexer_project_gemv).
#pragma once

#include <cstdint>
#include <vector>

#include "dsa_decode/indexer.h"
#include "linear/linear_reference.h"

namespace dsa::reference {

// Host copies of the paged state, contiguous except the page stride.
struct IndexerStateHost {
  const int32_t* block_table;  // [requests, block_table_width]
  int64_t requests, block_table_width;
  uint16_t* ring;     // [requests, 2, plan.ring, 128] BF16 bits
  uint8_t* k_cache;   // [blocks, page_stride] bytes; a page is indexer_page_bytes(plan)
  int64_t blocks, page_stride;
};

struct IndexerParamsHost {
  const float* k_norm_weight;  // [128]
  const float* k_norm_bias;    // [128]
  const float* ape;            // [plan.pool, 128] (unused with pool 1)
  // plan.rope_dims > 0: the cos/sin table [cos_sin_rows, R] (row stride
  // cos_sin_row_stride), F32 or BF16 bits.
  const void* cos_sin = nullptr;
  bool cos_sin_bf16 = false;
  int64_t cos_sin_rows = 0, cos_sin_row_stride = 0;
};

// cos and sin [R / 2] of `position` from the table, zeros for a position
// outside [0, rows).
void indexer_cos_sin(const IndexerPlan& plan, const IndexerParamsHost& params, int64_t position, float* cos,
                     float* sin);

// One decode step's projections and token map, contiguous (H = plan.heads).
struct IndexerStepHost {
  int m;
  const uint16_t* index_q;        // [m, H, 128] BF16 bits
  const uint16_t* index_k;        // [m, 128] BF16 bits, before the LayerNorm
  const float* head_weights;      // [m, H]
  const uint16_t* gate;           // [m, 128] BF16 bits
  const int64_t* positions;       // [m]
  const int32_t* token_requests;  // [m], negative = padding
};

// What prepare leaves in the workspace for select.
struct IndexerQueryHost {
  std::vector<uint8_t> q_fp8;       // [m, H, 128] e4m3 codes
  std::vector<float> head_weights;  // [m, H] folded weights w'
};

struct IndexerRowsHost {
  std::vector<int32_t> topk_positions;  // [m, indexer_row_width(plan)] request-local positions, -1 = none
  std::vector<int32_t> slots;           // [m, indexer_row_width(plan)] global KV slots, -1 = none
  int64_t errors = 0;                   // untrusted block table entries met (0 = none)
};

// One pool entry decoded from a page.
struct PoolEntry {
  const uint8_t* codes;  // [128] e4m3
  float scale;
};

// Pool p of `request`: its page's entry, or codes == nullptr when the block
// table entry is outside [0, blocks) (untrusted: skipped).
PoolEntry read_pool(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request, int64_t pool);

// Steps 1-4 for every token in token order (pool 1: LayerNorm, RoPE, the key
// written at its position; q's heads rotated before their quant); checks the batch first
// (check_indexer_batch). Writes state.ring and state.k_cache; `errors` counts
// pool writes skipped for a block table entry outside [0, blocks).
Status indexer_prepare(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerParamsHost& params,
                       IndexerStateHost& state, IndexerQueryHost* query, int64_t* errors);

// Step 9: positions 0..n-1 of `request` at once (index_k, gate [n, 128] BF16
// bits): every complete pool, then the last min(n, RING) tokens into the ring.
Status indexer_prefill(const IndexerPlan& plan, const uint16_t* index_k, const uint16_t* gate, int64_t n,
                       int64_t request, const IndexerParamsHost& params, IndexerStateHost& state, int64_t* errors);

// Step 6 for one token: logits [n_pools] of pools 0..n_pools-1 of `request`
// (a pool on an untrusted page gets -inf). q_fp8 [H, 128]
// codes, head_weights [H] folded.
std::vector<float> indexer_logits(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                  int64_t n_pools, const uint8_t* q_fp8, const float* head_weights);

// Step 6's bound under IndexerLogits::kFp32Accumulation, per pool of
// indexer_logits's arguments: |GPU logit - reference logit| <= bound[p] =
// |kscale[p]| * sum_h |w'[h]| * (2^-10 * sum_i |q[h, i] k[p, i]| + (2H + 6) * 2^-24 *
// |exact dot[h, p]|), H = plan.heads (70 at H = 32) (0 for a pool on an untrusted page: both are -inf).
// Why: a product of two e4m3 values is exact in FP32, so the FP16 MMA's
// error is its FP32 accumulation's, 8 steps of 16 products each: 2^-10 of
// the sum of |products| leaves a wide margin over the 2^-19 or so such
// accumulation can lose even when it truncates, and is still a thousand
// times below what a wrong fragment layout gives (errors of the dots' own
// size). ReLU does not grow an error; the two FP32 chains over H heads
// (the GPU's on inexact inputs, the reference's) and the final scaling add
// at most 2H + 2 roundings of at most 2^-24 of sum_h |w'[h] relu[h]| <= sum_h
// |w'[h]| |dot[h]|.
std::vector<double> indexer_logit_bounds(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                         int64_t n_pools, const uint8_t* q_fp8, const float* head_weights);

// How far a token's logits `got` [n_pools] (the GPU's FP32-accumulated ones)
// lie from indexer_logits of the same arguments, against indexer_logit_bounds:
// the largest |error| / bound, and the pools outside their bound. A pool on
// an untrusted page (exact -inf) is outside unless it is -inf too; a NaN
// where the exact logit is NaN (a NaN scale) is not outside.
struct LogitDeviation {
  double worst = 0;
  int64_t outside = 0;
};
LogitDeviation indexer_logit_deviation(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                       int64_t n_pools, const uint8_t* q_fp8, const float* head_weights,
                                       const float* got);

// Step 7's selection: the `count` largest logits (ties to the lower index, NaN
// as -inf, -0 equal to +0), returned in increasing index order.
std::vector<int32_t> select_top_pools(const std::vector<float>& logits, int count);

// Steps 5-7 for one token of context L: the request-local row
// [indexer_row_width(plan)]: L <= topk: 0..L-1; else top_pools (increasing)
// as pool tokens, then the tail tokens L / pool * pool..L-1 from column topk;
// -1 elsewhere.
void expand_row(const IndexerPlan& plan, int64_t context, const std::vector<int32_t>& top_pools, int32_t* row);

// Step 8: positions [count] -> slots; -1 stays -1; a page past the table's
// width or a block outside [0, blocks) gives -1 and is counted in the result.
int64_t remap_row(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request, const int32_t* positions,
                  int count, int32_t* slots);

// Step 8 for caller rows (indexer_remap): topk_positions [m, indexer_row_width(plan)] to
// rows->slots (rows->topk_positions is set to the input); a position at or
// past the token's context gives -1 and is counted, as remap_row's untrusted
// blocks; a padding token's row is -1. Checks the batch first.
Status indexer_remap(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerStateHost& state,
                     const std::vector<int32_t>& topk_positions, IndexerRowsHost* rows);

// Steps 5-8 for every token; checks the batch first.
Status indexer_select(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerQueryHost& query,
                      const IndexerStateHost& state, IndexerRowsHost* rows);

// Steps 5, 7 and 8 for every token over given logits: logits[t] holds token
// t's logits of pools 0..L / 4 - 1 when L > 2048 (otherwise unused; may be
// empty), e.g. the GPU's under IndexerLogits::kFp32Accumulation, whose rows
// must be this selection over its own logits. Checks the batch first.
// (L / 4 and 2048 above are L / plan.pool and plan.topk.)
Status indexer_select_on_logits(const IndexerPlan& plan, const IndexerStepHost& step,
                                const std::vector<std::vector<float>>& logits, const IndexerStateHost& state,
                                IndexerRowsHost* rows);

// The projections' inputs (indexer_project), BF16 bits, row-major and contiguous.
struct IndexerProjectInputsHost {
  int m;
  int64_t q_lora, hidden;         // Q, D
  const uint16_t* q_c;            // [m, Q]
  const uint16_t* x;              // [m, D]
  const uint16_t* wq_b;           // [H * 128, Q]
  const uint16_t* wk;             // [128, D]
  const uint16_t* weights_proj;   // [H, D]
  const uint16_t* compress_gate;  // [128, D]; null: no gate (pool 1, V3.2), the gate outputs stay empty
  int heads = kIndexerHeads;      // H
};

// The float64 products (ExactProduct, exact_product) are linear_reference.h's.

struct IndexerProjectionsHost {
  ExactProduct index_q;       // [m, H * 128]
  ExactProduct index_k;       // [m, 128]
  ExactProduct head_weights;  // [m, H]
  ExactProduct gate;          // [m, 128]
};
IndexerProjectionsHost indexer_project(const IndexerProjectInputsHost& inputs);

// indexer_project_gemv's outputs, bit for bit (the order is documented in
// include/dsa_decode/indexer.h; each output before its rounding is
// gemv_sum, linear/linear_reference.h: linear_gemv's order), row-major and
// contiguous.
struct IndexerProjectionBitsHost {
  std::vector<uint16_t> index_q;    // [m, H * 128] BF16 bits
  std::vector<uint16_t> index_k;    // [m, 128] BF16 bits
  std::vector<float> head_weights;  // [m, H]
  std::vector<uint16_t> gate;       // [m, 128] BF16 bits
};

// Q and D multiples of 8.
IndexerProjectionBitsHost indexer_project_gemv(const IndexerProjectInputsHost& inputs);

// The projections' tolerance, per output: |got - projection_expected(sum)| <=
// projection_tolerance(got, expected, magnitude).
//
// Why 1e-5 * magnitude for an FP32 sum in an order cuBLASLt does not state:
// every product of two BF16 values is exact in FP32, and each FP32 addition
// errs by at most u = 2^-24 of a partial sum no larger than the magnitude, so
// the error is at most u * magnitude times the number of roundings on the
// longest path a product takes to the output. A serial sum has k - 1 of them
// (2.4e-4 at k = 4096, a bound no order can exceed); the tensor-core kernels
// add 16 or more products per MMA step, so about k / 16 + a few (a split-k
// reduction adds log2 of its splits): <= 1.6e-5 * magnitude at k = 4096 even
// if every rounding erred fully the same way. Data of random sign keeps the
// partial sums far below the magnitude and the errors cancel in part, so the
// expected error is under u * sqrt(k / 16) * magnitude, about 1e-6. 1e-5
// leaves room above that and is still tight enough to catch a BF16 rounding
// of head_weights (2^-9 of the value, about 5e-5 * magnitude for random data
// at k = 4096, where the value is near 1.6 / sqrt(k) of the magnitude).
inline constexpr double kProjectionSumTolerance = 1e-5;

// The exact sum as the output stores it: rounded to BF16 (to nearest even,
// through float: the double rounding adds at most 2^-24 |sum|, inside the
// tolerance's magnitude term) for a BF16 output, unchanged for FP32.
double projection_expected(double sum, DType output);

// FP32: kProjectionSumTolerance * magnitude. BF16: the GPU rounds its FP32 sum
// s, within that term of the exact sum, to BF16, and expected is the exact sum
// rounded: each rounding moves half a BF16 ulp at its value's scale, so one
// ulp at the larger of |got| and |expected| plus the term.
double projection_tolerance(double got, double expected, double magnitude, DType output);

}  // namespace dsa::reference
