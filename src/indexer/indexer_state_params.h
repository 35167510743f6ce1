// The paged indexer state (include/dsa_decode/indexer.h, IndexerState) as the
// kernels address it: shared by the prepare and prefill kernels, which write
// it, and the select kernels, which read it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dsa_decode/indexer.h"

namespace dsa {

struct IndexerStateParams {
  const int32_t* block_table;  // [requests, width], request stride block_table_stride
  int64_t block_table_stride;
  int64_t block_table_width;
  int64_t requests;
  uint16_t* ring;  // [requests, 2, ring_size, 128] BF16, request stride ring_request_stride
  int64_t ring_request_stride;
  int ring_size;
  uint8_t* k_cache;  // [blocks, page_stride] bytes
  int64_t page_stride;
  int64_t blocks;
  int block_size;
  int pools_per_page;  // P = block_size / S: a page's codes, then its P scales at byte 128 P
  int64_t position_limit;  // min(max_context, width * block_size): trusted positions are below it
};

// For a plan and state that passed the launchers' checks.
inline IndexerStateParams make_indexer_state_params(const IndexerPlan& plan, const IndexerState& state) {
  IndexerStateParams s = {};
  s.block_table = state.block_table.ptr<const int32_t>();
  s.block_table_stride = state.block_table.stride(0);
  s.block_table_width = state.block_table.size(1);
  s.requests = state.block_table.size(0);
  s.ring = state.ring.ptr<uint16_t>();
  s.ring_request_stride = state.ring.stride(0);
  s.ring_size = plan.ring;
  s.k_cache = state.k_cache.ptr<uint8_t>();
  s.page_stride = state.k_cache.stride(0);
  s.blocks = state.k_cache.size(0);
  s.block_size = plan.block_size;
  s.pools_per_page = static_cast<int>(indexer_pools_per_page(plan));  // P = block_size / S
  s.position_limit = std::min(plan.max_context, s.block_table_width * plan.block_size);
  return s;
}

#ifdef __CUDACC__
// The block holding `pool` of `request`, or -1 when its page is past the
// table's width or its entry outside [0, blocks) (the reference's pool_block).
__device__ __forceinline__ int64_t indexer_pool_block(const IndexerStateParams& s, int64_t request, int64_t pool) {
  const int64_t page = pool / s.pools_per_page;
  if (page >= s.block_table_width) return -1;
  const int64_t block = s.block_table[request * s.block_table_stride + page];
  return block >= 0 && block < s.blocks ? block : -1;
}
#endif

}  // namespace dsa
