#include "serve_model.h"

#include <algorithm>
#include <cstring>

#include "head_gemv/head_gemv_reference.h"
#include "serve_parallel.h"

namespace dsa::serve {

Status StateModel::init(const ServeGeometry& g, int64_t latent, const IndexerPlan& plan, float k_scale,
                        IndexerParams params) {
  DSA_RETURN_IF_ERROR(check_geometry(g));
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  if (plan.block_size != g.block_size || plan.ring != g.ring || plan.max_context != g.max_context ||
      indexer_tokens_per_request(plan) != g.tokens_per_request) {
    return invalid_argument("plan", "block_size, ring, max_context and tokens per request of the geometry",
                            "block_size " + std::to_string(plan.block_size) + ", ring " + std::to_string(plan.ring) +
                                ", max_context " + std::to_string(plan.max_context) + ", tokens per request " +
                                std::to_string(indexer_tokens_per_request(plan)));
  }
  if (latent < 8 || latent % 8 != 0) return invalid_argument("latent", "a positive multiple of 8", std::to_string(latent));
  if (params.k_norm_weight.size() != size_t(kIndexerDim) || params.k_norm_bias.size() != size_t(kIndexerDim) ||
      params.ape.size() != size_t(plan.pool) * kIndexerDim) {
    return invalid_argument("params", "k_norm_weight and k_norm_bias [128], ape [plan.pool, 128]", "other sizes");
  }
  g_ = g;
  plan_ = plan;
  latent_ = latent;
  k_scale_ = k_scale;
  params_ = std::move(params);
  page_bytes_ = indexer_page_bytes(plan);
  kv_.assign(size_t(g.blocks) * g.block_size * latent, 0);
  pages_.assign(size_t(g.blocks) * page_bytes_, 0);
  ring_.assign(size_t(g.rows) * ring_row_elements(), 0);
  return Status();
}

reference::IndexerStateHost StateModel::view(const std::vector<int32_t>& table) {
  return reference::IndexerStateHost{table.data(), g_.rows, g_.width(), ring_.data(), pages_.data(), g_.blocks,
                                     page_bytes_};
}

Status StateModel::prefill(const ServeRequest& r, const std::vector<int32_t>& table, const uint16_t* kv_rows,
                           const uint16_t* index_k, const uint16_t* gate, int threads) {
  const int64_t n = r.prompt;
  if (n == 0) return Status();
  if (int64_t(r.blocks.size()) * g_.block_size < n || size_t(r.row + 1) * size_t(g_.width()) > table.size()) {
    return invalid_argument("r", "a request whose pages hold its prompt", std::to_string(n) + " tokens");
  }
  // Parts of whole blocks, each through the references on its own tokens:
  // the cache entries of its positions; the indexer's prefill of its
  // positions as a prompt of its own over the table row from its first page
  // (pools and ring slots repeat every block: RING and S divide block_size),
  // ring rows into scratch but for the last part, which holds the prompt's
  // last RING tokens (it starts at or before n - RING).
  const int64_t bs = g_.block_size;
  const int64_t last_start = n > g_.ring ? (n - g_.ring) / bs * bs : 0;
  const int64_t parts = last_start / bs + 1;  // parts of one block before the last one
  std::vector<int64_t> errors(static_cast<size_t>(parts), 0), skipped(static_cast<size_t>(parts), 0);
  std::vector<Status> results(static_cast<size_t>(parts));
  parallel_for(parts, 1, threads, [&](int64_t first, int64_t end) {
    std::vector<uint16_t> scratch;
    std::vector<int64_t> slots;
    for (int64_t part = first; part < end; ++part) {
      const int64_t begin = part * bs, stop = part + 1 == parts ? n : begin + bs;
      slots.resize(size_t(stop - begin));
      for (int64_t p = begin; p < stop; ++p) slots[size_t(p - begin)] = r.slot(p, g_.block_size);
      skipped[size_t(part)] = cache_write(kv_rows + begin * latent_, int(stop - begin), slots);
      reference::IndexerStateHost state = view(table);
      state.block_table = table.data() + begin / bs;  // row r's entries from page begin / bs on
      if (part + 1 != parts) {
        if (scratch.size() != ring_.size()) scratch.resize(ring_.size());  // contents unused
        state.ring = scratch.data();
      }
      results[size_t(part)] = reference::indexer_prefill(plan_, index_k + begin * kIndexerDim, gate + begin * kIndexerDim,
                                                        stop - begin, r.row, params_.host(), state, &errors[size_t(part)]);
    }
  });
  for (int64_t part = 0; part < parts; ++part) {
    DSA_RETURN_IF_ERROR(results[size_t(part)]);
    if (skipped[size_t(part)] != 0) {
      return invalid_argument("r", "a request whose pages lie in the pool", "slots past the cache");
    }
    if (errors[size_t(part)] != 0) return invalid_argument("r", "a request whose pages lie in the pool", "untrusted blocks met");
  }
  return Status();
}

int64_t StateModel::cache_write(const uint16_t* kv_c, int m, const std::vector<int64_t>& slots) {
  return reference::cache_write(kv_c, latent_, m, int(latent_), slots.data(), int(slots.size()), k_scale_, kv_.data(),
                                g_.blocks, g_.block_size, int64_t{g_.block_size} * latent_, latent_);
}

Status StateModel::prepare(const std::vector<int32_t>& table, const reference::IndexerStepHost& step,
                           reference::IndexerQueryHost* query, int64_t* errors) {
  reference::IndexerStateHost state = view(table);
  return reference::indexer_prepare(plan_, step, params_.host(), state, query, errors);
}

void StateModel::release(const ServeRequest& r) {
  const size_t entry_block = size_t(g_.block_size) * size_t(latent_);
  for (int32_t b : r.blocks) {
    std::memset(&kv_[size_t(b) * entry_block], kPoisonByte, entry_block);
    std::memset(&pages_[size_t(b) * size_t(page_bytes_)], kPoisonByte, size_t(page_bytes_));
  }
  std::fill_n(&ring_[size_t(r.row) * size_t(ring_row_elements())], ring_row_elements(), uint16_t{0xFFFF});
}

StateDiff StateModel::compare(const std::vector<ServeRequest>& live, const std::vector<int32_t>& table,
                              const uint8_t* kv, const uint8_t* pages, const uint16_t* ring) {
  StateDiff d;
  const auto note = [&d](const std::string& what) {
    if (d.first.empty()) d.first = what;
  };
  reference::IndexerStateHost mine = view(table);
  reference::IndexerStateHost theirs = mine;
  theirs.k_cache = const_cast<uint8_t*>(pages);
  theirs.ring = const_cast<uint16_t*>(ring);
  for (const ServeRequest& r : live) {
    const std::string who = "request " + std::to_string(r.serial) + " (row " + std::to_string(r.row) + ")";
    for (int64_t p = 0; p < r.length; ++p) {
      const size_t at = size_t(r.slot(p, g_.block_size)) * size_t(latent_);
      ++d.entries;
      if (std::memcmp(&kv_[at], kv + at, size_t(latent_)) != 0) {
        ++d.entry_mismatches;
        note(who + ": KV cache entry of position " + std::to_string(p) + " (slot " +
             std::to_string(r.slot(p, g_.block_size)) + ")");
      }
    }
    for (int64_t pool = 0; pool < r.length / plan_.pool; ++pool) {
      const reference::PoolEntry a = reference::read_pool(plan_, mine, r.row, pool);
      const reference::PoolEntry b = reference::read_pool(plan_, theirs, r.row, pool);
      ++d.pools;
      if (a.codes == nullptr || b.codes == nullptr || std::memcmp(a.codes, b.codes, kIndexerDim) != 0 ||
          std::memcmp(&a.scale, &b.scale, sizeof(float)) != 0) {
        ++d.pool_mismatches;
        note(who + ": indexer pool " + std::to_string(pool));
      }
    }
    for (int64_t p = std::max<int64_t>(0, r.length - g_.ring); p < r.length; ++p) {
      for (int half = 0; half < 2; ++half) {
        const size_t at = size_t(r.row) * size_t(ring_row_elements()) +
                          (size_t(half) * size_t(g_.ring) + size_t(p % g_.ring)) * kIndexerDim;
        ++d.ring_rows;
        if (std::memcmp(&ring_[at], ring + at, kIndexerDim * sizeof(uint16_t)) != 0) {
          ++d.ring_mismatches;
          note(who + ": ring " + (half == 0 ? "k" : "gate") + " row of position " + std::to_string(p));
        }
      }
    }
  }
  return d;
}

}  // namespace dsa::serve
