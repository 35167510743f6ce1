// dsa-serve's host-side serving state: the geometry of the shared pool, the
// block allocator, the live requests and the scheduler that builds each
// decode step from them (no GPU here; tests/serve_test.cpp covers it).
//
// The pool: `blocks` KV blocks of block_size tokens, each with its indexer
// page (the same block id indexes both, indexer.h). A request holds a row of
// the block table (its pages in order; entries past its last page are -1, so a
// position past its allocation reads an untrusted block, never another
// request's), grows page by page as it decodes and gives its blocks and row
// back when it finishes; freed blocks are reused first (LIFO), so stale bytes
// of a finished request sit under every new one.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/status.h"

namespace dsa::serve {

struct ServeGeometry {
  int64_t blocks = 0;        // KV blocks in the pool (and indexer pages)
  int block_size = 256;      // tokens per block (DsaStagePlan::block_size)
  int64_t max_context = 0;   // the plan's max_context: a multiple of block_size
  int rows = 0;              // block table rows: the most live requests
  int ring = 8;              // the indexer's RING
  int tokens_per_request = 5;  // indexer_tokens_per_request(plan): a request's tokens in one step, at most
  int max_tokens = 16;       // the largest step m
  int max_extra_slots = 4;   // slot_mapping entries past m, at most

  int64_t width() const { return max_context / block_size; }  // block table columns
  int64_t capacity() const { return blocks * block_size; }    // KV cache slots
};

// Checks the geometry's fields; errors name the field.
Status check_geometry(const ServeGeometry& g);

// A free list of ids [0, capacity): allocation takes the most recently freed
// first. All-or-nothing allocation; a release of an id not held is an error.
class IdPool {
 public:
  explicit IdPool(int64_t capacity = 0);
  int64_t capacity() const { return capacity_; }
  int64_t free_count() const { return static_cast<int64_t>(free_.size()); }
  bool held(int64_t id) const { return id >= 0 && id < capacity_ && held_[size_t(id)]; }
  // Appends `count` ids to *out, or returns false and takes none.
  bool allocate(int64_t count, std::vector<int32_t>* out);
  Status release(const std::vector<int32_t>& ids);

 private:
  int64_t capacity_ = 0;
  std::vector<int32_t> free_;  // taken from the back
  std::vector<bool> held_;
};

struct ServeRequest {
  int64_t serial = 0;   // arrival number (its rows' and cache values' seed)
  int row = -1;         // block table row
  int64_t prompt = 0;   // prefilled tokens
  int64_t length = 0;   // positions 0..length-1 are cached
  int64_t finish_at = 0;  // it finishes when length reaches this (<= max_context)
  std::vector<int32_t> blocks;  // page i -> block id

  int64_t slot(int64_t position, int block_size) const {
    return int64_t{blocks[size_t(position / block_size)]} * block_size + position % block_size;
  }
};

// The host block table [rows, width] int32, -1 where a row holds no block.
class BlockTable {
 public:
  explicit BlockTable(const ServeGeometry& g = ServeGeometry{});
  void assign(const ServeRequest& r);  // the row: r.blocks, then -1
  void clear(int row);
  const std::vector<int32_t>& entries() const { return entries_; }
  int64_t width() const { return width_; }

 private:
  int64_t width_ = 0;
  std::vector<int32_t> entries_;
};

// One decode step's token map, as the stage takes it.
struct StepBatch {
  std::vector<int> owner;               // per token: index into the live requests, -1 = padding
  std::vector<int64_t> positions;       // [m] (padding: 0)
  std::vector<int32_t> token_requests;  // [m] block table row, -1 = padding
  std::vector<int64_t> slot_mapping;    // [n >= m]: entries past m are never written (checked)
  int m() const { return static_cast<int>(positions.size()); }
  // Tokens of live request `index` in the step.
  std::vector<int> tokens_of(int index) const;
};

// Requests and blocks: admission (prefill sizes), steps, finishing.
class Scheduler {
 public:
  Scheduler(const ServeGeometry& g, uint64_t seed);
  const ServeGeometry& geometry() const { return g_; }
  std::vector<ServeRequest>& live() { return live_; }
  const std::vector<ServeRequest>& live() const { return live_; }
  const BlockTable& table() const { return table_; }
  const IdPool& blocks() const { return blocks_; }
  int64_t admitted() const { return next_serial_; }

  // A prompt length for a new request: 0..max_prompt, about half short
  // (under 4096, around the indexer's 2048 boundary) and half log-uniform up
  // to max_prompt.
  int64_t draw_prompt(int64_t max_prompt);
  // Admits a request of `prompt` tokens (its pages allocated, row assigned,
  // finish point drawn) if a row and the pages (plus one spare page per live
  // request) are free; returns its index in live() or -1.
  int admit(int64_t prompt);
  // The next step: m in 1..max_tokens drawn, up to tokens_per_request tokens
  // of each chosen request (pages allocated as needed; a request that needs a
  // page the pool cannot give is marked in *starved), padding tokens, and
  // sometimes slot_mapping entries past m pointing at live cached entries.
  StepBatch build_step(std::vector<int>* starved);
  // After the step ran: each token's request grows by its tokens.
  void advance(const StepBatch& batch);
  // Finishes live request `index`: frees its blocks and row. Indices after
  // it shift down by one.
  Status finish(int index);
  // Indices of requests whose length reached finish_at (descending, so that
  // finishing them in order keeps the others' indices valid).
  std::vector<int> done() const;
  std::mt19937_64& rng() { return rng_; }

 private:
  bool ensure_pages(ServeRequest& r, int64_t last_position);

  ServeGeometry g_;
  std::mt19937_64 rng_;
  IdPool blocks_, rows_;
  BlockTable table_;
  std::vector<ServeRequest> live_;
  int64_t next_serial_ = 0;
};

}  // namespace dsa::serve
