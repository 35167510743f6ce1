// The handover between sparse_mla_wgmma's two warpgroups, as barrier and
// buffer steps, checked over every interleaving for CTAs that run several
// items of 0 to 7 chunks (sparse_mla_handover_check.h: parity waits within
// one phase, no buffer hazard, no deadlock). The steps mirror the chunk
// loops of sparse_mla_wgmma_item (sparse_mla_wgmma.cu); the P barriers come
// from the kernel's own mapping. The buffers are double: the chunk tiles,
// and P with its rescale and split statistics, slot i % 2 for the item's
// chunk i (chunks are numbered over the CTA, and items are apart by CTA
// barriers).
#include "sparse_mla/sparse_mla_handover.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "sparse_mla/sparse_mla_handover_check.h"

namespace dsa {
namespace {

constexpr int kTileReady = 2;  // barriers 0 and 1: p_ready

using handover_check::Exploration;
using handover_check::kP;
using handover_check::kTile;
using handover_check::Program;
using handover_check::Step;
using PMapping = std::function<HandoverPhase(int chunk)>;
// How the CTA counts tile_ready's phases from item to item: one per chunk
// after an item's first (the kernel), or one per chunk (an earlier kernel's bug).
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

// The kernel's double buffers: chunk tiles and P, chunk n in slot n % 2.
Exploration explore(const Program& wg0, const Program& wg1) { return handover_check::explore({wg0, wg1}, {2, 2}); }

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
    EXPECT_TRUE(e.missing_wait.empty()) << "items of " << name << "chunks: " << e.missing_wait;
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

// And the other way: an earlier kernel counted tile_ready's phases by chunks, so from
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
