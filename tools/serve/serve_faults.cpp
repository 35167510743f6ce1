#include "serve_faults.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

namespace dsa::serve {

namespace {

constexpr const char* kNames[] = {"block-id-out-of-range", "block-id-negative", "position-past-table",
                                  "position-negative",     "position-future",   "slot-past-cache",
                                  "topk-out-of-range",     "nan-hidden",        "inf-hidden"};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == size_t(FaultKind::kCount), "one name per fault kind");

std::string all_names() {
  std::string text;
  for (const char* name : kNames) text += (text.empty() ? "" : ", ") + std::string(name);
  return text;
}

template <class T>
T draw(std::mt19937_64& rng, T low, T high) {
  return std::uniform_int_distribution<T>(low, high)(rng);
}

constexpr uint16_t kBf16Nan = 0x7FC0, kBf16Inf = 0x7F80, kBf16NegInf = 0xFF80;

}  // namespace

const char* fault_name(FaultKind kind) {
  const int k = static_cast<int>(kind);
  return k >= 0 && k < static_cast<int>(FaultKind::kCount) ? kNames[k] : "?";
}

Status parse_faults(const std::string& text, std::vector<FaultKind>* kinds) {
  kinds->clear();
  if (text == "none") return Status();
  if (text == "all") {
    for (int k = 0; k < static_cast<int>(FaultKind::kCount); ++k) kinds->push_back(static_cast<FaultKind>(k));
    return Status();
  }
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, comma - start);
    int found = -1;
    for (int k = 0; k < static_cast<int>(FaultKind::kCount); ++k) {
      if (name == kNames[k]) found = k;
    }
    if (found < 0) {
      return invalid_argument("--faults", "all, none or a comma-separated list of " + all_names(),
                              "'" + text + "' ('" + name + "' is not a fault kind)");
    }
    if (std::find(kinds->begin(), kinds->end(), static_cast<FaultKind>(found)) == kinds->end()) {
      kinds->push_back(static_cast<FaultKind>(found));
    }
    start = comma + 1;
  }
  return Status();
}

bool plan_fault(FaultKind kind, const ServeGeometry& g, const std::vector<ServeRequest>& live, const StepBatch& batch,
                const StepInputs& clean, int64_t hidden_size, int row_width, std::mt19937_64& rng, FaultPlan* plan) {
  const bool single_token = kind == FaultKind::kPositionPastTable || kind == FaultKind::kPositionNegative ||
                            kind == FaultKind::kPositionFuture;
  if (kind == FaultKind::kTopkOutOfRange && clean.topk.empty()) return false;
  // Candidates: requests with tokens in the step (one token for position faults;
  // a page it does not hold for position-future).
  std::vector<int> candidates;
  for (int index = 0; index < int(live.size()); ++index) {
    const std::vector<int> tokens = batch.tokens_of(index);
    if (tokens.empty() || (single_token && tokens.size() != 1)) continue;
    if (kind == FaultKind::kPositionFuture &&
        int64_t(live[size_t(index)].blocks.size()) * g.block_size >= g.max_context) {
      continue;
    }
    candidates.push_back(index);
  }
  if (candidates.empty()) return false;
  FaultPlan p;
  p.kind = kind;
  p.victim = candidates[draw<size_t>(rng, 0, candidates.size() - 1)];
  const ServeRequest& r = live[size_t(p.victim)];
  p.affected = batch.tokens_of(p.victim);
  const int first = p.affected.front();
  const int64_t width = g.width();
  switch (kind) {
    case FaultKind::kBlockIdOutOfRange:
    case FaultKind::kBlockIdNegative: {
      const int64_t page = batch.positions[size_t(first)] / g.block_size;
      int32_t bad = 0;
      if (kind == FaultKind::kBlockIdOutOfRange) {
        const int pick = draw(rng, 0, 2);
        bad = pick == 0 ? int32_t(g.blocks) : pick == 1 ? int32_t(g.blocks + draw<int64_t>(rng, 1, 100000))
                                                        : std::numeric_limits<int32_t>::max();
      } else {
        const int pick = draw(rng, 0, 2);
        bad = pick == 0 ? -2 : pick == 1 ? -draw<int32_t>(rng, 3, 100000) : std::numeric_limits<int32_t>::min();
      }
      p.table_writes.emplace_back(size_t(r.row) * size_t(width) + size_t(page), bad);
      // The engine's slots from the bad id (block * block_size + offset):
      // past the capacity, or negative (not written).
      for (int t : p.affected) {
        const int64_t pos = batch.positions[size_t(t)];
        if (pos / g.block_size == page) p.slot_writes.emplace_back(size_t(t), int64_t{bad} * g.block_size + pos % g.block_size);
      }
      p.faulted = p.affected;
      // What counts it (indexer.h, head_gemv.h): with the indexer running, the
      // first token's own position lies in the page (its tail or short row
      // remaps through it, or its pool write skips it); an id past the blocks
      // also gives that token a slot past the capacity (the cache write
      // counts it). With caller rows and a negative id only a caller position
      // in the page is remapped through it: no such position, no count.
      p.expect_counted = clean.topk.empty() || kind == FaultKind::kBlockIdOutOfRange;
      for (size_t i = 0; !p.expect_counted && i < p.affected.size(); ++i) {
        const int32_t* row = &clean.topk[size_t(p.affected[i]) * size_t(row_width)];
        for (int j = 0; j < row_width && !p.expect_counted; ++j) {
          p.expect_counted = row[j] >= 0 && row[j] / g.block_size == page;
        }
      }
      for (size_t i = 0; i < r.blocks.size(); ++i) {
        if (int64_t(i) != page) p.allowed_blocks.push_back(r.blocks[i]);
      }
      break;
    }
    case FaultKind::kPositionPastTable:
    case FaultKind::kPositionNegative:
    case FaultKind::kPositionFuture: {
      int64_t position = 0;
      if (kind == FaultKind::kPositionPastTable) {
        const int pick = draw(rng, 0, 2);
        position = pick == 0 ? width * g.block_size
                             : pick == 1 ? width * g.block_size + draw<int64_t>(rng, 1, 100000)
                                         : std::numeric_limits<int64_t>::max();
      } else if (kind == FaultKind::kPositionNegative) {
        const int pick = draw(rng, 0, 2);
        position = pick == 0 ? -1 : pick == 1 ? -draw<int64_t>(rng, 2, 100000) : std::numeric_limits<int64_t>::min();
      } else {
        const int64_t unheld = int64_t(r.blocks.size()) * g.block_size;
        position = draw<int64_t>(rng, unheld, std::min(g.max_context, unheld + 3 * int64_t{g.block_size}) - 1);
        p.allowed_blocks = r.blocks;
      }
      p.position_writes.emplace_back(first, position);
      p.slot_writes.emplace_back(size_t(first), -1);  // no slot exists for it
      p.faulted = {first};
      // A position past the table or negative is an untrusted token (counted
      // by prepare, select or remap). A future one in an unheld page counts
      // only where something reads that page: the indexer's row of the new
      // context does (a short row, a scored pool, the tail or the pool write
      // all meet it); caller rows hold positions below the clean context,
      // whose pages are held, so the remap meets no untrusted entry.
      p.expect_counted = kind != FaultKind::kPositionFuture || clean.topk.empty();
      p.expect_empty = kind != FaultKind::kPositionFuture;
      break;
    }
    case FaultKind::kSlotPastCache: {
      const int t = p.affected[draw<size_t>(rng, 0, p.affected.size() - 1)];
      const int pick = draw(rng, 0, 2);
      const int64_t slot = pick == 0 ? g.capacity()
                                     : pick == 1 ? g.capacity() + draw<int64_t>(rng, 1, 1000000)
                                                 : std::numeric_limits<int64_t>::max();
      p.slot_writes.emplace_back(size_t(t), slot);
      p.faulted = {t};
      p.expect_counted = true;
      break;
    }
    case FaultKind::kTopkOutOfRange: {
      const int t = p.affected[draw<size_t>(rng, 0, p.affected.size() - 1)];
      const int64_t context = batch.positions[size_t(t)] + 1;
      std::vector<int> valid;
      for (int j = 0; j < row_width; ++j) {
        if (clean.topk[size_t(t) * row_width + j] >= 0) valid.push_back(j);
      }
      if (valid.empty()) return false;
      std::shuffle(valid.begin(), valid.end(), rng);
      const int count = draw<int>(rng, 1, std::min<int>(8, int(valid.size())));
      for (int i = 0; i < count; ++i) {
        const int pick = draw(rng, 0, 2);
        const int64_t bad = pick == 0 ? context : pick == 1 ? context + draw<int64_t>(rng, 1, 1000000)
                                                            : std::numeric_limits<int32_t>::max();
        p.topk_writes.emplace_back(size_t(t) * row_width + valid[size_t(i)],
                                   static_cast<int32_t>(std::min<int64_t>(bad, std::numeric_limits<int32_t>::max())));
        p.cleared_columns.push_back(valid[size_t(i)]);
      }
      p.affected = {t};
      p.faulted = {t};
      p.expect_counted = true;
      break;
    }
    case FaultKind::kNanHidden:
    case FaultKind::kInfHidden: {
      const int count = draw(rng, 1, 8);
      for (int i = 0; i < count; ++i) {
        const uint16_t value = kind == FaultKind::kNanHidden ? kBf16Nan : (draw(rng, 0, 1) ? kBf16Inf : kBf16NegInf);
        p.hidden_writes.emplace_back(size_t(first) * size_t(hidden_size) + draw<size_t>(rng, 0, size_t(hidden_size) - 1),
                                     value);
      }
      p.faulted = {first};
      break;
    }
    case FaultKind::kCount:
      return false;
  }
  *plan = std::move(p);
  return true;
}

StepInputs apply_fault(const FaultPlan& plan, const StepInputs& clean) {
  StepInputs in = clean;
  for (const auto& [at, block] : plan.table_writes) in.table[at] = block;
  for (const auto& [token, position] : plan.position_writes) in.positions[size_t(token)] = position;
  for (const auto& [at, slot] : plan.slot_writes) in.slot_mapping[at] = slot;
  for (const auto& [at, position] : plan.topk_writes) in.topk[at] = position;
  for (const auto& [at, bits] : plan.hidden_writes) in.hidden[at] = bits;
  return in;
}

namespace {
template <class T>
bool rows_equal(const std::vector<T>& a, const std::vector<T>& b, int token, int64_t width) {
  const size_t at = size_t(token) * size_t(width);
  if (a.size() < at + size_t(width) || b.size() < at + size_t(width)) return false;
  return std::memcmp(&a[at], &b[at], size_t(width) * sizeof(T)) == 0;
}
}  // namespace

void check_isolation(const FaultPlan& plan, const StepResult& clean, const StepResult& faulty,
                     std::vector<std::string>* failures) {
  for (int t = 0; t < clean.m; ++t) {
    if (std::find(plan.affected.begin(), plan.affected.end(), t) != plan.affected.end()) continue;
    const std::string at = std::string(fault_name(plan.kind)) + ": token " + std::to_string(t) +
                           " (not the victim's) differs from the step without the fault in ";
    if (!rows_equal(clean.slots, faulty.slots, t, clean.row_width)) failures->push_back(at + "slots");
    if (!rows_equal(clean.latent, faulty.latent, t, clean.H * clean.latent_width)) failures->push_back(at + "latent");
    if (!rows_equal(clean.lse, faulty.lse, t, clean.H)) failures->push_back(at + "lse");
    if (!rows_equal(clean.out, faulty.out, t, clean.D)) failures->push_back(at + "out");
  }
}

bool empty_result(const StepResult& r, int token, std::string* why) {
  const uint16_t* latent = &r.latent[size_t(token) * size_t(r.H * r.latent_width)];
  for (int64_t i = 0; i < r.H * r.latent_width; ++i) {
    if (latent[i] != 0) {
      *why = "latent element " + std::to_string(i) + " is not +0";
      return false;
    }
  }
  for (int64_t h = 0; h < r.H; ++h) {
    const float lse = r.lse[size_t(token) * size_t(r.H) + size_t(h)];
    if (!(std::isinf(lse) && lse < 0)) {
      *why = "lse of head " + std::to_string(h) + " is " + std::to_string(lse) + ", not -inf";
      return false;
    }
  }
  for (int64_t i = 0; i < r.D; ++i) {
    if ((r.out[size_t(token) * size_t(r.D) + size_t(i)] & 0x7FFF) != 0) {
      *why = "out element " + std::to_string(i) + " is not zero";
      return false;
    }
  }
  return true;
}

void check_victim(const FaultPlan& plan, const ServeGeometry& g, const StepResult& clean, const StepResult& faulty,
                  std::vector<std::string>* failures) {
  const std::string kind = fault_name(plan.kind);
  if (plan.expect_counted && faulty.errors == 0) {
    failures->push_back(kind + ": the error word did not count the fault");
  }
  const std::set<int32_t> allowed(plan.allowed_blocks.begin(), plan.allowed_blocks.end());
  for (int t : plan.faulted) {
    const std::string at = kind + ": faulted token " + std::to_string(t) + ": ";
    const int32_t* row = &faulty.slots[size_t(t) * size_t(faulty.row_width)];
    const int32_t* clean_row = &clean.slots[size_t(t) * size_t(clean.row_width)];
    if (plan.expect_empty) {
      for (int64_t j = 0; j < faulty.row_width; ++j) {
        if (row[j] != -1) {
          failures->push_back(at + "row entry " + std::to_string(j) + " is " + std::to_string(row[j]) + ", not -1");
          break;
        }
      }
      std::string why;
      if (!empty_result(faulty, t, &why)) failures->push_back(at + why);
    }
    if (!allowed.empty()) {
      for (int64_t j = 0; j < faulty.row_width; ++j) {
        if (row[j] >= 0 && allowed.count(static_cast<int32_t>(row[j] / g.block_size)) == 0) {
          failures->push_back(at + "row entry " + std::to_string(j) + " is slot " + std::to_string(row[j]) +
                              ", outside the victim's valid blocks");
          break;
        }
      }
    }
    if (!plan.cleared_columns.empty()) {
      for (int64_t j = 0; j < faulty.row_width; ++j) {
        const bool cleared =
            std::find(plan.cleared_columns.begin(), plan.cleared_columns.end(), int(j)) != plan.cleared_columns.end();
        const int32_t want = cleared ? -1 : clean_row[j];
        if (row[j] != want) {
          failures->push_back(at + "row entry " + std::to_string(j) + " is " + std::to_string(row[j]) + ", expected " +
                              std::to_string(want) + (cleared ? " (an out-of-range position)" : " (the clean row's)"));
          break;
        }
      }
    }
  }
}

}  // namespace dsa::serve
