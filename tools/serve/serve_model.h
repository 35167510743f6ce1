// dsa-serve's CPU model of the shared state: the KV cache, the indexer's K
// pages and rings, in the GPU's layouts, driven through the kernels' CPU
// references (reference::cache_write, reference::indexer_prefill,
// reference::indexer_prepare) with the same inputs the GPU got. Freed blocks
// and rows are poisoned (0xFF: e4m3 and BF16 NaN), so a reference that read
// stale bytes would say so; the GPU keeps its stale bytes, as a server does.
// compare() checks a GPU copy of the state against the model over what the
// live requests own: every cached entry, every complete pool, the ring slots
// of their last RING positions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/status.h"
#include "indexer/indexer_reference.h"
#include "serve_state.h"

namespace dsa::serve {

inline constexpr uint8_t kPoisonByte = 0xFF;

struct StateDiff {
  int64_t entries = 0, entry_mismatches = 0;  // KV cache entries of live positions
  int64_t pools = 0, pool_mismatches = 0;     // complete pools (codes and scale)
  int64_t ring_rows = 0, ring_mismatches = 0;  // k and gate rows of the last RING positions
  std::string first;                          // the first mismatch, in words
  int64_t mismatches() const { return entry_mismatches + pool_mismatches + ring_mismatches; }
};

// The indexer's parameters (k LayerNorm, ape), FP32 on the host.
struct IndexerParams {
  std::vector<float> k_norm_weight, k_norm_bias, ape;
  reference::IndexerParamsHost host() const { return {k_norm_weight.data(), k_norm_bias.data(), ape.data()}; }
};

class StateModel {
 public:
  // latent: L, the KV entry width; the state starts zeroed, as the GPU's.
  Status init(const ServeGeometry& g, int64_t latent, const IndexerPlan& plan, float k_scale, IndexerParams params);

  const ServeGeometry& geometry() const { return g_; }
  const IndexerPlan& plan() const { return plan_; }
  int64_t latent() const { return latent_; }
  int64_t page_bytes() const { return page_bytes_; }
  int64_t ring_row_elements() const { return int64_t{2} * g_.ring * kIndexerDim; }  // one request's ring

  std::vector<uint8_t>& kv() { return kv_; }        // [blocks, block_size, L] e4m3
  std::vector<uint8_t>& pages() { return pages_; }  // [blocks, page_bytes]
  std::vector<uint16_t>& ring() { return ring_; }   // [rows, 2, RING, 128] BF16
  const std::vector<uint8_t>& kv() const { return kv_; }
  const std::vector<uint8_t>& pages() const { return pages_; }
  const std::vector<uint16_t>& ring() const { return ring_; }

  // The state's view over `table` ([rows, width], the scheduler's or a copy).
  reference::IndexerStateHost view(const std::vector<int32_t>& table);

  // Prefill of request r (rows [r.prompt, L] / [r.prompt, 128] BF16):
  // the cache entries of positions 0..prompt-1 and the indexer's prefill,
  // in parts of whole blocks on up to `threads` threads (the same bytes as
  // one sequential reference::indexer_prefill and cache_write).
  Status prefill(const ServeRequest& r, const std::vector<int32_t>& table, const uint16_t* kv_rows,
                 const uint16_t* index_k, const uint16_t* gate, int threads = 1);
  // concat_and_cache_mla of kv_c [m, L] at slots (n entries, n may differ
  // from m); returns the slots past the capacity.
  int64_t cache_write(const uint16_t* kv_c, int m, const std::vector<int64_t>& slots);
  // indexer_prepare of a step; `query` gets the q codes and folded weights.
  Status prepare(const std::vector<int32_t>& table, const reference::IndexerStepHost& step,
                 reference::IndexerQueryHost* query, int64_t* errors);
  // A finished request's blocks and ring row, poisoned.
  void release(const ServeRequest& r);

  // A GPU copy in the same layouts against the model, over the live requests.
  StateDiff compare(const std::vector<ServeRequest>& live, const std::vector<int32_t>& table, const uint8_t* kv,
                    const uint8_t* pages, const uint16_t* ring);

 private:
  ServeGeometry g_;
  IndexerPlan plan_;
  int64_t latent_ = 0, page_bytes_ = 0;
  float k_scale_ = 0;
  IndexerParams params_;
  std::vector<uint8_t> kv_, pages_;
  std::vector<uint16_t> ring_;
};

}  // namespace dsa::serve
