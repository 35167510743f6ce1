// The handover between sparse_mla_wgmma's two warpgroups, as barrier steps:
// every interleaving of the two warpgroups' steps is explored for CTAs that
// run several items of 0 to 7 chunks, checking that a parity wait for phase
// k is only ever pending while the barrier has completed k or k + 1 phases
// (with k + 2 the hardware takes the completed phase for an open one and
// waits forever; with k - 1 it takes the open phase for a completed one and
// does not wait) and that the CTA never deadlocks. The steps mirror the chunk loops of sparse_mla_wgmma_item
// (sparse_mla_wgmma.cu); the P barriers come from the kernel's own mapping.
#include "sparse_mla/sparse_mla_handover.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace dsa {
namespace {

constexpr int kTileReady = 2;  // barriers 0 and 1: p_ready

struct Step {
  enum Kind { kArrive, kWait, kItemEnd } kind;
  int barrier = 0;
  int phase = 0;  // kWait: the phase it waits for
};
using Program = std::vector<Step>;
using PMapping = std::function<HandoverPhase(int chunk)>;
// How the CTA counts tile_ready's phases from item to item: one per chunk
// after an item's first (the kernel), or one per chunk (1532db7's bug).
enum class TilePhases { kPerChunkAfterFirst, kPerChunk };

// Warpgroup 0 (S, softmax, P, O_left) and warpgroup 1 (conversion, O_right)
// over items of the given chunk counts; items end at a CTA barrier.
std::pair<Program, Program> handover_programs(const std::vector<int>& chunks_per_item, const PMapping& p_of,
                                              TilePhases tile_phases = TilePhases::kPerChunkAfterFirst) {
  Program wg0, wg1;
  int chunks_before = 0, tile_phases_before = 0;
  for (const int chunks : chunks_per_item) {
    for (int i = 0; i < chunks; ++i) {  // warpgroup 0: tile i waited (tile 0 by the prologue), then P arrives
      if (i > 0) wg0.push_back({Step::kWait, kTileReady, tile_phases_before + i - 1});
      const HandoverPhase p = p_of(chunks_before + i);
      wg0.push_back({Step::kArrive, p.barrier, p.phase});
    }
    if (chunks > 1) wg1.push_back({Step::kArrive, kTileReady, tile_phases_before});  // tile 1, before the loop
    for (int i = 0; i < chunks; ++i) {  // warpgroup 1: P waited, then chunk i + 1 converted (i >= 1)
      const HandoverPhase p = p_of(chunks_before + i);
      wg1.push_back({Step::kWait, p.barrier, p.phase});
      if (i >= 1 && i + 1 < chunks) wg1.push_back({Step::kArrive, kTileReady, tile_phases_before + i});
    }
    wg0.push_back({Step::kItemEnd});
    wg1.push_back({Step::kItemEnd});
    chunks_before += chunks;
    tile_phases_before += tile_phases == TilePhases::kPerChunk ? chunks : std::max(chunks - 1, 0);
  }
  return {wg0, wg1};
}

struct Exploration {
  std::string aliased;  // the first wait found pending outside its two phases, if any
  bool deadlock = false;
};

// Depth-first over the states (position of each warpgroup); the completed
// phases of each barrier follow from the arrivals before the positions.
Exploration explore(const Program& wg0, const Program& wg1) {
  const Program* programs[2] = {&wg0, &wg1};
  // arrivals[w][k][b]: warpgroup w's arrivals on barrier b in its first k steps.
  std::vector<std::vector<std::array<int, 3>>> arrivals(2);
  for (int w = 0; w < 2; ++w) {
    arrivals[w].assign(programs[w]->size() + 1, {0, 0, 0});
    for (size_t k = 0; k < programs[w]->size(); ++k) {
      arrivals[w][k + 1] = arrivals[w][k];
      if ((*programs[w])[k].kind == Step::kArrive) ++arrivals[w][k + 1][(*programs[w])[k].barrier];
    }
  }
  auto completed = [&](int barrier, const int(&at)[2]) {
    return arrivals[0][at[0]][barrier] + arrivals[1][at[1]][barrier];
  };
  Exploration result;
  std::set<std::pair<int, int>> seen;
  std::vector<std::pair<int, int>> pending = {{0, 0}};
  while (!pending.empty() && result.aliased.empty()) {
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
        const int phases = completed(step.barrier, at);
        if (phases > step.phase + 1 || phases < step.phase) {
          result.aliased = "warpgroup " + std::to_string(w) + " waits for phase " + std::to_string(step.phase) +
                           " of barrier " + std::to_string(step.barrier) + ", which has completed " +
                           std::to_string(phases);
          break;
        }
        if (phases == step.phase) continue;  // not complete yet (parity and count agree here)
      } else if (step.kind == Step::kItemEnd) {
        const int other = 1 - w;
        if (at[other] == int(programs[other]->size()) || (*programs[other])[at[other]].kind != Step::kItemEnd) continue;
        ++next[other];  // both pass the CTA barrier together
      }
      moved = true;
      pending.push_back({next[0], next[1]});
    }
    if (!done && !moved && result.aliased.empty()) result.deadlock = true;
  }
  return result;
}

// Every CTA of up to three items of 0..7 chunks each (2 chunks: the default
// split CTA; more: the throughput plan's 4 and the whole-item stream's 32,
// whose steps repeat with the same period).
std::vector<std::vector<int>> item_sequences() {
  std::vector<std::vector<int>> sequences;
  for (int a = 0; a <= 7; ++a) {
    sequences.push_back({a});
    for (int b = 0; b <= 7; ++b) {
      sequences.push_back({a, b});
      for (int c = 0; c <= 7; ++c) sequences.push_back({a, b, c});
    }
  }
  return sequences;
}

TEST(SparseMlaHandover, ParityWaitsStayWithinOnePhaseOfTheBarrierAndNeverDeadlock) {
  for (const std::vector<int>& items : item_sequences()) {
    const auto [wg0, wg1] = handover_programs(items, [](int chunk) { return p_ready_phase_of_chunk(chunk); });
    const Exploration e = explore(wg0, wg1);
    std::string name;
    for (int chunks : items) name += std::to_string(chunks) + " ";
    EXPECT_TRUE(e.aliased.empty()) << "items of " << name << "chunks: " << e.aliased;
    EXPECT_FALSE(e.deadlock) << "items of " << name << "chunks";
  }
}

// The checker finds the hazard it is for: with one p_ready barrier (v10.1 to
// v11) warpgroup 0 can complete chunks 0 and 1 while warpgroup 1 still waits
// for chunk 0, and an item of two chunks is enough.
TEST(SparseMlaHandover, OneSharedPBarrierAliasesAsInV10_1) {
  const PMapping one_barrier = [](int chunk) { return HandoverPhase{0, chunk}; };
  const auto [wg0, wg1] = handover_programs({2}, one_barrier);
  const Exploration e = explore(wg0, wg1);
  EXPECT_NE(e.aliased.find("warpgroup 1 waits for phase 0 of barrier 0, which has completed 2"), std::string::npos)
      << e.aliased;
}

// And the other way: 1532db7 counted tile_ready's phases by chunks, so from
// a persistent CTA's second item on warpgroup 0 waited for a phase the
// barrier had not reached, whose parity was that of a completed one.
TEST(SparseMlaHandover, TilePhasesCountedByChunksRunAheadAsIn1532db7) {
  const auto [wg0, wg1] = handover_programs(
      {2, 2}, [](int chunk) { return p_ready_phase_of_chunk(chunk); }, TilePhases::kPerChunk);
  const Exploration e = explore(wg0, wg1);
  EXPECT_NE(e.aliased.find("warpgroup 0 waits for phase 2 of barrier 2, which has completed 1"), std::string::npos)
      << e.aliased;
}

}  // namespace
}  // namespace dsa
