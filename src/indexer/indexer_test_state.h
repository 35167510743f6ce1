// A host copy of the indexer's paged state for tests: the reference runs on
// it, and the GPU tests upload it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "indexer/indexer_reference.h"

namespace dsa::testing {

struct IndexerHostState {
  IndexerPlan plan;
  int64_t requests, width, blocks, page_stride;
  std::vector<int32_t> block_table;  // [requests, width]
  std::vector<uint16_t> ring;        // [requests, 2, RING, 128]
  std::vector<uint8_t> k_cache;      // [blocks, page_stride]
  reference::IndexerStateHost view;  // points into the vectors above: do not copy

  // Each request's blocks are distinct blocks in a shuffled order, with three
  // spare blocks and padded pages.
  IndexerHostState(const IndexerPlan& p, int64_t request_count, int64_t table_width, std::mt19937_64& rng)
      : plan(p),
        requests(request_count),
        width(table_width),
        blocks(request_count * table_width + 3),
        page_stride(indexer_page_bytes(p) + 16) {
    std::vector<int32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    block_table.assign(order.begin(), order.begin() + requests * width);
    ring.assign(requests * 2 * plan.ring * kIndexerDim, 0);
    k_cache.assign(blocks * page_stride, 0);
    view = {block_table.data(), requests, width, ring.data(), k_cache.data(), blocks, page_stride};
  }
  IndexerHostState(const IndexerHostState&) = delete;
  IndexerHostState& operator=(const IndexerHostState&) = delete;
};

// Every plan shape the indexer tests cover: heads 16, 32, 64 x pool 4, 8, 16
// at top-k 2048, then at top-k 512; RING = pool, other fields the defaults.
inline std::vector<IndexerPlan> every_shape() {
  std::vector<IndexerPlan> plans;
  for (int topk : {2048, 512}) {
    for (int heads : {16, 32, 64}) {
      for (int pool : {4, 8, 16}) {
        IndexerPlan plan;
        plan.heads = heads;
        plan.pool = pool;
        plan.topk = topk;
        plan.ring = pool;
        plans.push_back(plan);
      }
    }
  }
  return plans;
}

inline std::string shape_name(const IndexerPlan& plan) {
  return "H " + std::to_string(plan.heads) + " S " + std::to_string(plan.pool) + " K " + std::to_string(plan.topk);
}

}  // namespace dsa::testing
