// The CPU reference of the glm5next indexer's decode path
// (include/dsa_decode/indexer.h), step by step in the contract's fixed order:
// the LayerNorm, the q quant, the pool compression, the ring and the K cache
// bytes are bitwise what the GPU kernels must produce (the arithmetic is the
// host side of src/indexer/indexer_math.h). The logits are the contract's
// FP32 order on exact head dots; GPU logits match them within a tolerance.
#pragma once

#include <cstdint>
#include <vector>

#include "dsa_decode/indexer.h"

namespace dsa::reference {

// Host copies of the paged state, contiguous except the page stride.
struct IndexerStateHost {
  const int32_t* block_table;  // [requests, block_table_width]
  int64_t requests, block_table_width;
  uint16_t* ring;     // [requests, 2, plan.ring, 128] BF16 bits
  uint8_t* k_cache;   // [blocks, page_stride] bytes; a page is block_size / 4 * 132 bytes
  int64_t blocks, page_stride;
};

struct IndexerParamsHost {
  const float* k_norm_weight;  // [128]
  const float* k_norm_bias;    // [128]
  const float* ape;            // [4, 128]
};

// One decode step's projections and token map, contiguous.
struct IndexerStepHost {
  int m;
  const uint16_t* index_q;        // [m, 32, 128] BF16 bits
  const uint16_t* index_k;        // [m, 128] BF16 bits, before the LayerNorm
  const float* head_weights;      // [m, 32]
  const uint16_t* gate;           // [m, 128] BF16 bits
  const int64_t* positions;       // [m]
  const int32_t* token_requests;  // [m], negative = padding
};

// What prepare leaves in the workspace for select.
struct IndexerQueryHost {
  std::vector<uint8_t> q_fp8;       // [m, 32, 128] e4m3 codes
  std::vector<float> head_weights;  // [m, 32] folded weights w'
};

struct IndexerRowsHost {
  std::vector<int32_t> topk_positions;  // [m, 2176] request-local positions, -1 = none
  std::vector<int32_t> slots;           // [m, 2176] global KV slots, -1 = none
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

// Steps 1-4 for every token in token order; checks the batch first
// (check_indexer_batch). Writes state.ring and state.k_cache; `errors` counts
// pool writes skipped for a block table entry outside [0, blocks).
Status indexer_prepare(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerParamsHost& params,
                       IndexerStateHost& state, IndexerQueryHost* query, int64_t* errors);

// Step 9: positions 0..n-1 of `request` at once (index_k, gate [n, 128] BF16
// bits): every complete pool, then the last min(n, RING) tokens into the ring.
Status indexer_prefill(const IndexerPlan& plan, const uint16_t* index_k, const uint16_t* gate, int64_t n,
                       int64_t request, const IndexerParamsHost& params, IndexerStateHost& state, int64_t* errors);

// Step 6 for one token: logits [n_pools] of pools 0..n_pools-1 of `request`
// (a pool on an untrusted page gets -inf). q_fp8 [32, 128]
// codes, head_weights [32] folded.
std::vector<float> indexer_logits(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request,
                                  int64_t n_pools, const uint8_t* q_fp8, const float* head_weights);

// Step 7's selection: the `count` largest logits (ties to the lower index, NaN
// as -inf, -0 equal to +0), returned in increasing index order.
std::vector<int32_t> select_top_pools(const std::vector<float>& logits, int count);

// Steps 5-7 for one token of context L: the request-local row [2176].
void expand_row(int64_t context, const std::vector<int32_t>& top_pools, int32_t* row);

// Step 8: positions [count] -> slots; -1 stays -1; a page past the table's
// width or a block outside [0, blocks) gives -1 and is counted in the result.
int64_t remap_row(const IndexerPlan& plan, const IndexerStateHost& state, int64_t request, const int32_t* positions,
                  int count, int32_t* slots);

// Steps 5-8 for every token; checks the batch first.
Status indexer_select(const IndexerPlan& plan, const IndexerStepHost& step, const IndexerQueryHost& query,
                      const IndexerStateHost& state, IndexerRowsHost* rows);

}  // namespace dsa::reference
