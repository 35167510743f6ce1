#include "serve_state.h"

#include <algorithm>
#include <cmath>

namespace dsa::serve {

Status check_geometry(const ServeGeometry& g) {
  if (g.block_size < 1) return invalid_argument("block_size", ">= 1", std::to_string(g.block_size));
  if (g.max_context < g.block_size || g.max_context % g.block_size != 0) {
    return invalid_argument("max_context", "a positive multiple of block_size " + std::to_string(g.block_size),
                            std::to_string(g.max_context));
  }
  if (g.blocks < 1 || g.blocks > (int64_t{1} << 31) / g.block_size) {
    return invalid_argument("blocks", "1.." + std::to_string((int64_t{1} << 31) / g.block_size) +
                                          " (slots must fit int32 rows)",
                            std::to_string(g.blocks));
  }
  if (g.rows < 1) return invalid_argument("rows", ">= 1", std::to_string(g.rows));
  if (g.ring < 1) return invalid_argument("ring", ">= 1", std::to_string(g.ring));
  if (g.tokens_per_request < 1 || g.tokens_per_request > g.ring) {
    return invalid_argument("tokens_per_request", "1..ring (" + std::to_string(g.ring) + ")",
                            std::to_string(g.tokens_per_request));
  }
  if (g.max_tokens < 1) return invalid_argument("max_tokens", ">= 1", std::to_string(g.max_tokens));
  if (g.max_extra_slots < 0) return invalid_argument("max_extra_slots", ">= 0", std::to_string(g.max_extra_slots));
  return Status();
}

IdPool::IdPool(int64_t capacity) : capacity_(capacity), held_(size_t(capacity), false) {
  free_.reserve(size_t(capacity));
  // Taken from the back: the lowest ids first at the start.
  for (int64_t id = capacity - 1; id >= 0; --id) free_.push_back(static_cast<int32_t>(id));
}

bool IdPool::allocate(int64_t count, std::vector<int32_t>* out) {
  if (count < 0 || count > free_count()) return false;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t id = free_.back();
    free_.pop_back();
    held_[size_t(id)] = true;
    out->push_back(id);
  }
  return true;
}

Status IdPool::release(const std::vector<int32_t>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!held(ids[i])) {
      return invalid_argument("ids", "ids held by the pool", "id " + std::to_string(ids[i]) + " at " +
                                                                 std::to_string(i) + " (not held, or out of range)");
    }
    // A duplicate within `ids` is caught by the flag cleared below.
    held_[size_t(ids[i])] = false;
    free_.push_back(ids[i]);
  }
  return Status();
}

BlockTable::BlockTable(const ServeGeometry& g) : width_(g.width()), entries_(size_t(g.rows) * size_t(g.width()), -1) {}

void BlockTable::assign(const ServeRequest& r) {
  int32_t* row = &entries_[size_t(r.row) * size_t(width_)];
  std::fill(row, row + width_, -1);
  std::copy(r.blocks.begin(), r.blocks.end(), row);
}

void BlockTable::clear(int row) {
  std::fill_n(&entries_[size_t(row) * size_t(width_)], width_, -1);
}

std::vector<int> StepBatch::tokens_of(int index) const {
  std::vector<int> tokens;
  for (int t = 0; t < m(); ++t) {
    if (owner[t] == index) tokens.push_back(t);
  }
  return tokens;
}

Scheduler::Scheduler(const ServeGeometry& g, uint64_t seed)
    : g_(g), rng_(seed), blocks_(g.blocks), rows_(g.rows), table_(g) {}

int64_t Scheduler::draw_prompt(int64_t max_prompt) {
  if (max_prompt <= 0) return 0;
  std::uniform_int_distribution<int> kind(0, 7);
  const int k = kind(rng_);
  if (k == 0) return std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(16, max_prompt))(rng_);
  if (k <= 3) return std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(4096, max_prompt))(rng_);
  const double top = std::log(double(max_prompt) + 1);
  const double x = std::exp(std::uniform_real_distribution<double>(0, top)(rng_)) - 1;
  return std::clamp<int64_t>(static_cast<int64_t>(x), 0, max_prompt);
}

int Scheduler::admit(int64_t prompt) {
  if (prompt < 0 || prompt >= g_.max_context) return -1;
  const int64_t pages = (prompt + g_.block_size - 1) / g_.block_size;
  // One spare page per live request (and the new one) keeps decoding going.
  if (rows_.free_count() == 0 || blocks_.free_count() < pages + int64_t(live_.size()) + 1) return -1;
  ServeRequest r;
  std::vector<int32_t> row;
  if (!rows_.allocate(1, &row) || !blocks_.allocate(pages, &r.blocks)) return -1;
  r.serial = next_serial_++;
  r.row = row[0];
  r.prompt = r.length = prompt;
  // Decode lengths: mostly short, some long; never past max_context.
  std::uniform_int_distribution<int> kind(0, 3);
  const int64_t decode = kind(rng_) == 0 ? std::uniform_int_distribution<int64_t>(64, 1024)(rng_)
                                         : std::uniform_int_distribution<int64_t>(1, 96)(rng_);
  r.finish_at = std::min(g_.max_context, prompt + decode);
  table_.assign(r);
  live_.push_back(std::move(r));
  return int(live_.size()) - 1;
}

bool Scheduler::ensure_pages(ServeRequest& r, int64_t last_position) {
  const int64_t needed = last_position / g_.block_size + 1;
  if (needed <= int64_t(r.blocks.size())) return true;
  if (!blocks_.allocate(needed - int64_t(r.blocks.size()), &r.blocks)) return false;
  table_.assign(r);
  return true;
}

StepBatch Scheduler::build_step(std::vector<int>* starved) {
  starved->clear();
  const int m_target = std::uniform_int_distribution<int>(1, g_.max_tokens)(rng_);
  std::vector<int> order(live_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int(i);
  std::shuffle(order.begin(), order.end(), rng_);
  // Groups of consecutive tokens, one per chosen request; padding groups of one.
  std::vector<std::vector<int>> groups;  // live index per token, -1 padding
  std::vector<int64_t> first_position;
  int room = m_target;
  for (int index : order) {
    if (room == 0) break;
    ServeRequest& r = live_[size_t(index)];
    const int64_t left = r.finish_at - r.length;
    if (left <= 0) continue;
    int k = std::uniform_int_distribution<int>(1, std::min<int>(g_.tokens_per_request, room))(rng_);
    k = int(std::min<int64_t>(k, left));
    while (k > 0 && !ensure_pages(r, r.length + k - 1)) --k;
    if (k == 0) {
      starved->push_back(index);
      continue;
    }
    groups.emplace_back(size_t(k), index);
    first_position.push_back(r.length);
    room -= k;
  }
  // Padding: sometimes, and always when no request took a token.
  int padding = 0;
  if (room > 0 && (groups.empty() || std::uniform_int_distribution<int>(0, 3)(rng_) == 0)) {
    padding = std::uniform_int_distribution<int>(1, room)(rng_);
  }
  for (int i = 0; i < padding; ++i) {
    groups.emplace_back(size_t(1), -1);
    first_position.push_back(0);
  }
  std::vector<size_t> group_order(groups.size());
  for (size_t i = 0; i < group_order.size(); ++i) group_order[i] = i;
  std::shuffle(group_order.begin(), group_order.end(), rng_);
  StepBatch b;
  for (size_t gi : group_order) {
    for (size_t j = 0; j < groups[gi].size(); ++j) {
      const int index = groups[gi][j];
      b.owner.push_back(index);
      if (index < 0) {
        b.positions.push_back(0);
        b.token_requests.push_back(-1);
        b.slot_mapping.push_back(-1);
        continue;
      }
      const ServeRequest& r = live_[size_t(index)];
      const int64_t p = first_position[gi] + int64_t(j);
      b.positions.push_back(p);
      b.token_requests.push_back(r.row);
      b.slot_mapping.push_back(r.slot(p, g_.block_size));
    }
  }
  // Entries past m: the live cached entries they would overwrite (the state
  // check sees any such write), or any slot of the cache.
  if (g_.max_extra_slots > 0 && std::uniform_int_distribution<int>(0, 1)(rng_) == 1) {
    const int extra = std::uniform_int_distribution<int>(1, g_.max_extra_slots)(rng_);
    for (int i = 0; i < extra; ++i) {
      int64_t slot = std::uniform_int_distribution<int64_t>(0, g_.capacity() - 1)(rng_);
      if (!live_.empty()) {
        const ServeRequest& r = live_[std::uniform_int_distribution<size_t>(0, live_.size() - 1)(rng_)];
        if (r.length > 0) slot = r.slot(std::uniform_int_distribution<int64_t>(0, r.length - 1)(rng_), g_.block_size);
      }
      b.slot_mapping.push_back(slot);
    }
  }
  return b;
}

void Scheduler::advance(const StepBatch& batch) {
  for (int t = 0; t < batch.m(); ++t) {
    if (batch.owner[t] < 0) continue;
    ServeRequest& r = live_[size_t(batch.owner[t])];
    r.length = std::max(r.length, batch.positions[t] + 1);
  }
}

Status Scheduler::finish(int index) {
  if (index < 0 || index >= int(live_.size())) {
    return invalid_argument("index", "0.." + std::to_string(int(live_.size()) - 1), std::to_string(index));
  }
  ServeRequest& r = live_[size_t(index)];
  DSA_RETURN_IF_ERROR(blocks_.release(r.blocks));
  DSA_RETURN_IF_ERROR(rows_.release({r.row}));
  table_.clear(r.row);
  live_.erase(live_.begin() + index);
  return Status();
}

std::vector<int> Scheduler::done() const {
  std::vector<int> indices;
  for (int i = int(live_.size()) - 1; i >= 0; --i) {
    if (live_[size_t(i)].length >= live_[size_t(i)].finish_at) indices.push_back(i);
  }
  return indices;
}

}  // namespace dsa::serve
