// Test support: explores every interleaving of two or more warpgroups'
// handover steps (mbarrier arrivals and parity waits, CTA barriers, and
// accesses of multi-slot shared-memory buffers), for the handover tests of
// sparse_mla_wgmma (sparse_mla_handover_test.cpp: the kernel's protocol;
// sparse_mla_producer_model_test.cpp: the next version's design). It
// reports the first parity wait pending while its barrier has completed
// other than k or k + 1 phases (with k + 2 the hardware takes the completed
// phase for an open one and waits forever; with k - 1 it takes the open
// phase for a completed one and does not wait), the first buffer write
// before every read of the chunk that used its slot before (or read before
// its chunk's write), the first arrival on a barrier whose completed phase
// no warpgroup has waited for yet (compute-sanitizer's synccheck reports it
// as a missing wait; a barrier's last phases, with no arrival after them,
// need no waiter), and a deadlock.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

namespace dsa::handover_check {

// The chunk tiles; P with its rescale and statistics; sparse_mla_producer's
// q tile, its contents numbered per item i as chunks are: q is 2 i, the
// epilogue's staged latent 2 i + 1 (one slot).
enum Buffer { kTile, kP, kQ };

struct Step {
  enum Kind { kArrive, kWait, kCtaBarrier, kWrite, kRead } kind;
  int index = 0;  // kArrive, kWait: the barrier; kWrite, kRead: the Buffer
  int value = 0;  // kWait: the phase it waits for; kWrite, kRead: the CTA's chunk
};
using Program = std::vector<Step>;

struct Exploration {
  std::string aliased;  // the first wait found pending outside its two phases, if any
  std::string hazard;   // the first buffer write before an earlier read of its slot, or read before its write
  std::string missing_wait;  // the first arrival found on a barrier whose last completed phase nobody waited for
                             // (recorded; the exploration goes on)
  bool deadlock = false;
};

// Depth-first over the states (position of each warpgroup); the completed
// phases of each barrier follow from the arrivals before the positions.
// slots[b]: buffer b's slot count (chunk n in slot n % slots[b]), for the
// buffers the programs access.
// arrivals_per_phase[b]: the warpgroup arrivals that complete one phase of
// barrier b (1 where not given: one warpgroup's 128 threads).
inline Exploration explore(const std::vector<Program>& programs, const std::vector<int>& slots,
                           std::vector<int> arrivals_per_phase = {}) {
  const int count = int(programs.size());  // at most 4: positions are packed 16 bits each into the state key
  int barriers = 0;
  for (const Program& program : programs) {
    for (const Step& step : program) {
      if (step.kind == Step::kArrive || step.kind == Step::kWait) barriers = std::max(barriers, step.index + 1);
    }
  }
  arrivals_per_phase.resize(std::max<size_t>(arrivals_per_phase.size(), barriers), 1);
  // arrivals[w][k][b]: warpgroup w's arrivals on barrier b in its first k steps.
  std::vector<std::vector<std::vector<int>>> arrivals(count);
  for (int w = 0; w < count; ++w) {
    arrivals[w].assign(programs[w].size() + 1, std::vector<int>(barriers, 0));
    for (size_t k = 0; k < programs[w].size(); ++k) {
      arrivals[w][k + 1] = arrivals[w][k];
      if (programs[w][k].kind == Step::kArrive) ++arrivals[w][k + 1][programs[w][k].index];
    }
  }
  using Positions = std::vector<int>;
  auto completed = [&](int barrier, const Positions& at) {
    int total = 0;
    for (int w = 0; w < count; ++w) total += arrivals[w][at[w]][barrier];
    return total / arrivals_per_phase[barrier];
  };
  auto finished = [&](int w, const Positions& at) { return at[w] == int(programs[w].size()); };
  // Whether warpgroup w has no `kind` access of (buffer, chunk) at or after `at`.
  auto all_done = [&](int w, int at, Step::Kind kind, int buffer, int chunk) {
    for (size_t k = at; k < programs[w].size(); ++k) {
      const Step& s = programs[w][k];
      if (s.kind == kind && s.index == buffer && s.value == chunk) return false;
    }
    return true;
  };
  const char* const names[] = {"tile", "P", "q's tile"};
  auto hazard_of = [&](int w, const Step& step, const Positions& at) -> std::string {
    for (int o = 0; o < count; ++o) {
      const int before = step.value - slots[step.index];
      if (step.kind == Step::kWrite && before >= 0 && !all_done(o, at[o], Step::kRead, step.index, before)) {
        return "warpgroup " + std::to_string(w) + " writes " + names[step.index] + " of chunk " +
               std::to_string(step.value) + " before warpgroup " + std::to_string(o) + " has read chunk " +
               std::to_string(before) + "'s";
      }
      if (step.kind == Step::kRead && !all_done(o, at[o], Step::kWrite, step.index, step.value)) {
        return "warpgroup " + std::to_string(w) + " reads " + names[step.index] + " of chunk " +
               std::to_string(step.value) + " before warpgroup " + std::to_string(o) + " has written it";
      }
    }
    return "";
  };
  // Whether a warpgroup has passed a wait for phase `phase` of `barrier`.
  auto waited = [&](int barrier, int phase, const Positions& at) {
    for (int o = 0; o < count; ++o) {
      for (int k = 0; k < at[o]; ++k) {
        const Step& s = programs[o][k];
        if (s.kind == Step::kWait && s.index == barrier && s.value == phase) return true;
      }
    }
    return false;
  };
  auto key = [&](const Positions& at) {
    uint64_t packed = 0;
    for (int w = 0; w < count; ++w) packed |= uint64_t(at[w]) << (16 * w);
    return packed;
  };
  Exploration result;
  std::unordered_set<uint64_t> seen;
  std::vector<Positions> pending = {Positions(count, 0)};
  while (!pending.empty() && result.aliased.empty() && result.hazard.empty()) {
    const Positions at = pending.back();
    pending.pop_back();
    if (!seen.insert(key(at)).second) continue;
    bool moved = false, done = true;
    for (int w = 0; w < count; ++w) {
      if (finished(w, at)) continue;
      done = false;
      const Step& step = programs[w][at[w]];
      Positions next = at;
      ++next[w];
      if (step.kind == Step::kWait) {
        const int phases = completed(step.index, at);
        if (phases > step.value + 1 || phases < step.value) {
          result.aliased = "warpgroup " + std::to_string(w) + " waits for phase " + std::to_string(step.value) +
                           " of barrier " + std::to_string(step.index) + ", which has completed " +
                           std::to_string(phases);
          break;
        }
        if (phases == step.value) continue;  // not complete yet (parity and count agree here)
      } else if (step.kind == Step::kCtaBarrier) {
        // Every warpgroup passes the CTA barrier together, once all are at one.
        bool all_there = true;
        for (int o = 0; o < count; ++o) {
          all_there = all_there && !finished(o, at) && programs[o][at[o]].kind == Step::kCtaBarrier;
        }
        if (!all_there) continue;
        for (int o = 0; o < count; ++o) next[o] = at[o] + 1;
      } else if (step.kind == Step::kWrite || step.kind == Step::kRead) {
        result.hazard = hazard_of(w, step, at);
        if (!result.hazard.empty()) break;
      } else if (step.kind == Step::kArrive) {
        const int phases = completed(step.index, at);
        if (result.missing_wait.empty() && phases >= 1 && !waited(step.index, phases - 1, at)) {
          result.missing_wait = "warpgroup " + std::to_string(w) + " arrives on barrier " + std::to_string(step.index) +
                                " before anyone waited for its phase " + std::to_string(phases - 1);
        }
      }
      moved = true;
      pending.push_back(next);
    }
    if (!done && !moved && result.aliased.empty() && result.hazard.empty()) result.deadlock = true;
  }
  return result;
}

}  // namespace dsa::handover_check
