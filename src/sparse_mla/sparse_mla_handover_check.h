// Test support: explores every interleaving of two warpgroups' handover
// steps (mbarrier arrivals and parity waits, CTA barriers, and accesses of
// multi-slot shared-memory buffers), for the handover tests of
// sparse_mla_wgmma (sparse_mla_handover_test.cpp: the kernel's protocol;
// sparse_mla_three_tiles_model_test.cpp: the next version's design). It
// reports the first parity wait pending while its barrier has completed
// other than k or k + 1 phases (with k + 2 the hardware takes the completed
// phase for an open one and waits forever; with k - 1 it takes the open
// phase for a completed one and does not wait), the first buffer write
// before every read of the chunk that used its slot before (or read before
// its chunk's write), and a deadlock.
#pragma once

#include <algorithm>
#include <array>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dsa::handover_check {

enum Buffer { kTile, kP };  // the chunk tiles; P with its rescale and statistics

struct Step {
  enum Kind { kArrive, kWait, kCtaBarrier, kWrite, kRead } kind;
  int index = 0;  // kArrive, kWait: the barrier; kWrite, kRead: the Buffer
  int value = 0;  // kWait: the phase it waits for; kWrite, kRead: the CTA's chunk
};
using Program = std::vector<Step>;

struct Exploration {
  std::string aliased;  // the first wait found pending outside its two phases, if any
  std::string hazard;   // the first buffer write before an earlier read of its slot, or read before its write
  bool deadlock = false;
};

// Depth-first over the states (position of each warpgroup); the completed
// phases of each barrier follow from the arrivals before the positions.
// slots[b]: buffer b's slot count (chunk n in slot n % slots[b]).
inline Exploration explore(const Program& wg0, const Program& wg1, std::array<int, 2> slots) {
  const Program* programs[2] = {&wg0, &wg1};
  int barriers = 0;
  for (const Program* program : programs) {
    for (const Step& step : *program) {
      if (step.kind == Step::kArrive || step.kind == Step::kWait) barriers = std::max(barriers, step.index + 1);
    }
  }
  // arrivals[w][k][b]: warpgroup w's arrivals on barrier b in its first k steps.
  std::vector<std::vector<std::vector<int>>> arrivals(2);
  for (int w = 0; w < 2; ++w) {
    arrivals[w].assign(programs[w]->size() + 1, std::vector<int>(barriers, 0));
    for (size_t k = 0; k < programs[w]->size(); ++k) {
      arrivals[w][k + 1] = arrivals[w][k];
      if ((*programs[w])[k].kind == Step::kArrive) ++arrivals[w][k + 1][(*programs[w])[k].index];
    }
  }
  auto completed = [&](int barrier, const int(&at)[2]) {
    return arrivals[0][at[0]][barrier] + arrivals[1][at[1]][barrier];
  };
  // Whether warpgroup w has no `kind` access of (buffer, chunk) at or after `at`.
  auto all_done = [&](int w, int at, Step::Kind kind, int buffer, int chunk) {
    for (size_t k = at; k < programs[w]->size(); ++k) {
      const Step& s = (*programs[w])[k];
      if (s.kind == kind && s.index == buffer && s.value == chunk) return false;
    }
    return true;
  };
  const char* const names[] = {"tile", "P"};
  auto hazard_of = [&](int w, const Step& step, const int(&at)[2]) -> std::string {
    for (int o = 0; o < 2; ++o) {
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
  Exploration result;
  std::set<std::pair<int, int>> seen;
  std::vector<std::pair<int, int>> pending = {{0, 0}};
  while (!pending.empty() && result.aliased.empty() && result.hazard.empty()) {
    const auto [a, b] = pending.back();
    pending.pop_back();
    if (!seen.insert({a, b}).second) continue;
    const int at[2] = {a, b};
    bool moved = false, done = true;
    for (int w = 0; w < 2; ++w) {
      if (at[w] == int(programs[w]->size())) continue;
      done = false;
      const Step& step = (*programs[w])[at[w]];
      int next[2] = {at[0], at[1]};
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
        const int other = 1 - w;
        if (at[other] == int(programs[other]->size()) || (*programs[other])[at[other]].kind != Step::kCtaBarrier) {
          continue;
        }
        ++next[other];  // both pass the CTA barrier together
      } else if (step.kind == Step::kWrite || step.kind == Step::kRead) {
        result.hazard = hazard_of(w, step, at);
        if (!result.hazard.empty()) break;
      }
      moved = true;
      pending.push_back({next[0], next[1]});
    }
    if (!done && !moved && result.aliased.empty() && result.hazard.empty()) result.deadlock = true;
  }
  return result;
}

}  // namespace dsa::handover_check
