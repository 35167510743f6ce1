// The handover between sparse_mla_wgmma's two warpgroups, as barrier steps:
// every interleaving of the two warpgroups' steps is explored for CTAs that
// run several items of 0 to 7 chunks, checking that a parity wait for phase
// k is only ever pending while the barrier has completed k or k + 1 phases
// (with k + 2 the hardware takes the completed phase for an open one and
// waits forever; with k - 1 it takes the open phase for a completed one and
// does not wait) and that the CTA never deadlocks. The steps mirror the chunk loops of sparse_mla_wgmma_item
// (sparse_mla_wgmma.cu); the P barriers come from the kernel's own mapping.
// The steps also name the double buffers each warpgroup writes and reads
// (the chunk tiles, and P with its rescale and split statistics: slot i % 2
// for the item's chunk i; chunks are numbered over the CTA, and items are
// apart by CTA barriers): a write of chunk n must come after every read of
// chunk n - 2, which used the same slot, and a read after the chunk's write.
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

enum Buffer { kTile, kP };  // tiles[i % 2]; p_tiles, rescale, split_max / split_sum [i % 2]

struct Step {
  enum Kind { kArrive, kWait, kCtaBarrier, kWrite, kRead } kind;
  int barrier = 0;  // kArrive, kWait; kWrite, kRead: the Buffer
  int phase = 0;    // kWait: the phase it waits for; kWrite, kRead: the CTA's chunk
};
using Program = std::vector<Step>;
using PMapping = std::function<HandoverPhase(int chunk)>;
// How the CTA counts tile_ready's phases from item to item: one per chunk
// after an item's first (the kernel), or one per chunk (1532db7's bug).
enum class TilePhases { kPerChunkAfterFirst, kPerChunk };
// When warpgroup 1 converts chunk i + 1 (i >= 1): after waiting for P of
// chunk i (the kernel), or before, with no wait (a hazard the checker finds).
enum class Conversion { kAfterP, kUnguarded };

// Warpgroup 0 (S, softmax, P, O_left) and warpgroup 1 (conversion, O_right)
// over items of the given chunk counts. An item starts with both converting
// its first chunk and a CTA barrier, and ends at a CTA barrier.
std::pair<Program, Program> handover_programs(const std::vector<int>& chunks_per_item, const PMapping& p_of,
                                              TilePhases tile_phases = TilePhases::kPerChunkAfterFirst,
                                              Conversion conversion = Conversion::kAfterP) {
  Program wg0, wg1;
  int chunks_before = 0, tile_phases_before = 0;
  for (const int chunks : chunks_per_item) {
    for (Program* program : {&wg0, &wg1}) {  // the prologue: tile 0 by every thread, then a CTA barrier
      if (chunks > 0) program->push_back({Step::kWrite, kTile, chunks_before});
      program->push_back({Step::kCtaBarrier});
    }
    for (int i = 0; i < chunks; ++i) {  // warpgroup 0: tile i waited, P written and announced, tile i read
      const int n = chunks_before + i;
      if (i > 0) wg0.push_back({Step::kWait, kTileReady, tile_phases_before + i - 1});
      wg0.push_back({Step::kWrite, kP, n});
      const HandoverPhase p = p_of(n);
      wg0.push_back({Step::kArrive, p.barrier, p.phase});
      wg0.push_back({Step::kRead, kTile, n});  // S and O_left's P V, both waited for
    }
    if (chunks > 1) {  // tile 1, before the loop
      wg1.push_back({Step::kWrite, kTile, chunks_before + 1});
      wg1.push_back({Step::kArrive, kTileReady, tile_phases_before});
    }
    for (int i = 0; i < chunks; ++i) {  // warpgroup 1: P waited, chunk i + 1 converted (i >= 1), its P V waited
      const int n = chunks_before + i;
      const bool converts = i >= 1 && i + 1 < chunks;
      if (converts && conversion == Conversion::kUnguarded) {
        wg1.push_back({Step::kWrite, kTile, n + 1});
        wg1.push_back({Step::kArrive, kTileReady, tile_phases_before + i});
      }
      const HandoverPhase p = p_of(n);
      wg1.push_back({Step::kWait, p.barrier, p.phase});
      if (converts && conversion == Conversion::kAfterP) {
        wg1.push_back({Step::kWrite, kTile, n + 1});
        wg1.push_back({Step::kArrive, kTileReady, tile_phases_before + i});
      }
      wg1.push_back({Step::kRead, kTile, n});
      wg1.push_back({Step::kRead, kP, n});  // the rescale, P in its P V, the split's statistics
    }
    wg0.push_back({Step::kCtaBarrier});
    wg1.push_back({Step::kCtaBarrier});
    chunks_before += chunks;
    tile_phases_before += tile_phases == TilePhases::kPerChunk ? chunks : std::max(chunks - 1, 0);
  }
  return {wg0, wg1};
}

struct Exploration {
  std::string aliased;  // the first wait found pending outside its two phases, if any
  std::string hazard;   // the first buffer write before an earlier read of its slot, or read before its write
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
  // Whether every step of warpgroup w's program before position `at` that
  // is a `kind` access of (buffer, chunk) has run, i.e. none is at or after it.
  auto all_done = [&](int w, int at, Step::Kind kind, int buffer, int chunk) {
    for (size_t k = at; k < programs[w]->size(); ++k) {
      const Step& step = (*programs[w])[k];
      if (step.kind == kind && step.barrier == buffer && step.phase == chunk) return false;
    }
    return true;
  };
  const char* const buffer_names[] = {"tile", "P"};
  auto access_hazard = [&](int w, const Step& step, const int(&at)[2]) -> std::string {
    for (int o = 0; o < 2; ++o) {
      const std::string who = "warpgroup " + std::to_string(w) + " ";
      if (step.kind == Step::kWrite && step.phase >= 2 &&
          !all_done(o, at[o], Step::kRead, step.barrier, step.phase - 2)) {
        return who + "writes " + buffer_names[step.barrier] + " of chunk " + std::to_string(step.phase) +
               " before warpgroup " + std::to_string(o) + " has read chunk " + std::to_string(step.phase - 2) + "'s";
      }
      if (step.kind == Step::kRead && !all_done(o, at[o], Step::kWrite, step.barrier, step.phase)) {
        return who + "reads " + buffer_names[step.barrier] + " of chunk " + std::to_string(step.phase) +
               " before warpgroup " + std::to_string(o) + " has written it";
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
        const int phases = completed(step.barrier, at);
        if (phases > step.phase + 1 || phases < step.phase) {
          result.aliased = "warpgroup " + std::to_string(w) + " waits for phase " + std::to_string(step.phase) +
                           " of barrier " + std::to_string(step.barrier) + ", which has completed " +
                           std::to_string(phases);
          break;
        }
        if (phases == step.phase) continue;  // not complete yet (parity and count agree here)
      } else if (step.kind == Step::kCtaBarrier) {
        const int other = 1 - w;
        if (at[other] == int(programs[other]->size()) || (*programs[other])[at[other]].kind != Step::kCtaBarrier) {
          continue;
        }
        ++next[other];  // both pass the CTA barrier together
      } else if (step.kind == Step::kWrite || step.kind == Step::kRead) {
        result.hazard = access_hazard(w, step, at);
        if (!result.hazard.empty()) break;
      }
      moved = true;
      pending.push_back({next[0], next[1]});
    }
    if (!done && !moved && result.aliased.empty() && result.hazard.empty()) result.deadlock = true;
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
    EXPECT_TRUE(e.hazard.empty()) << "items of " << name << "chunks: " << e.hazard;
    EXPECT_FALSE(e.deadlock) << "items of " << name << "chunks";
  }
}

// The buffer checks find what they are for: converting chunk 2 without
// waiting for anything overwrites the tile of chunk 0 while warpgroup 0 may
// still read it (an item of three chunks is enough).
TEST(SparseMlaHandover, UnguardedConversionOverwritesATileInUse) {
  const auto [wg0, wg1] = handover_programs(
      {3}, [](int chunk) { return p_ready_phase_of_chunk(chunk); }, TilePhases::kPerChunkAfterFirst,
      Conversion::kUnguarded);
  const Exploration e = explore(wg0, wg1);
  EXPECT_NE(e.hazard.find("warpgroup 1 writes tile of chunk 2 before warpgroup 0 has read chunk 0's"),
            std::string::npos)
      << e.hazard;
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
