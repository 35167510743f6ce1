// A design check, not a model of the kernel as built: the handover protocol
// of the next sparse_mla_wgmma sketched in docs/sparse_mla.md ("A design
// sketch for that step"): three chunk tiles, warpgroup 0 issuing S of chunk
// n + 1 before the softmax of chunk n, warpgroup 1 converting chunk n + 2
// into the tile of chunk n - 1 once both P V halves of n - 1 are done.
// Every interleaving of the two warpgroups' barrier and buffer steps is
// checked as sparse_mla_handover_test.cpp checks the kernel's protocol
// (sparse_mla_handover_check.h).
//
// Barriers: p_ready[3] (P of chunk n on n % 3, phase n / 3: with two tiles
// converted ahead, warpgroup 0 can finish P of three chunks before
// warpgroup 1 has read the first, so P has three slots too; the kernel's
// two P slots and barriers fail here, see the test below); tile_ready[3],
// one per tile slot (chunk n's conversion on n % 3, phase =
// the slot's earlier conversions by warpgroup 1); tile_free (warpgroup 0's
// P V of chunk n done, only for the chunks whose tile is converted into
// again within the item).
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "sparse_mla/sparse_mla_handover_check.h"

namespace dsa {
namespace {

using handover_check::Exploration;
using handover_check::kP;
using handover_check::kTile;
using handover_check::Program;
using handover_check::Step;
constexpr int kTileSlots = 3;  // chunk n's tile in slot n % 3
constexpr int kPReady0 = 0, kTileReady0 = 3, kTileFree = 6;

// The design, and the variants the checker must refute: one tile_ready
// barrier for every conversion (warpgroup 1 then runs two phases ahead), P
// in two slots (the kernel's today), a conversion that does not wait for
// tile_free.
struct Protocol {
  bool tile_ready_per_slot = true;
  int p_slots = 3;  // P with its rescale and statistics: chunk n's in slot n % p_slots
  bool conversion_waits_for_tile_free = true;
};

std::pair<Program, Program> three_tile_programs(const std::vector<int>& chunks_per_item,
                                                const Protocol& protocol = {}) {
  const int p_slots = protocol.p_slots;
  // Phases follow from the order of arrivals: precompute which chunks
  // warpgroup 1 converts (an item's chunks 1.. : chunk 0 is converted by
  // every thread before the item's CTA barrier) and which chunks' tiles
  // warpgroup 0 announces free (those converted into again in the item).
  std::vector<int> ready_phase, free_phase;
  std::array<int, 3> conversions_per_slot = {0, 0, 0};
  int conversions = 0, frees = 0, total = 0;
  for (const int chunks : chunks_per_item) {
    for (int i = 0; i < chunks; ++i, ++total) {
      const int n = total;
      ready_phase.push_back(-1);
      if (i >= 1) {
        ready_phase[n] = protocol.tile_ready_per_slot ? conversions_per_slot[n % 3]++ : conversions++;
      }
      free_phase.push_back(i + 3 < chunks ? frees++ : -1);
    }
  }
  auto ready_barrier = [&](int n) { return protocol.tile_ready_per_slot ? kTileReady0 + n % 3 : kTileReady0; };

  Program wg0, wg1;
  int n0 = 0;
  for (const int chunks : chunks_per_item) {
    for (Program* program : {&wg0, &wg1}) {  // chunk 0's tile by every thread, then a CTA barrier
      if (chunks > 0) program->push_back({Step::kWrite, kTile, n0});
      program->push_back({Step::kCtaBarrier});
    }
    // Warpgroup 1 converts chunks 1 and 2 before its loop (their slots held
    // the previous item's chunks, all read before the CTA barrier).
    for (int i = 1; i <= 2 && i < chunks; ++i) {
      wg1.push_back({Step::kWrite, kTile, n0 + i});
      wg1.push_back({Step::kArrive, ready_barrier(n0 + i), ready_phase[n0 + i]});
    }
    // Warpgroup 0: S of chunk n + 1 issued before the softmax of chunk n;
    // each wgmma's read of a tile is a step at its issue (after the write)
    // and one at its wait (the slot is in use until then).
    if (chunks > 0) {
      wg0.push_back({Step::kRead, kTile, n0});  // S(n0) issued
      wg0.push_back({Step::kRead, kTile, n0});  // and waited for
    }
    for (int i = 0; i < chunks; ++i) {
      const int n = n0 + i;
      if (i + 1 < chunks) {
        wg0.push_back({Step::kWait, ready_barrier(n + 1), ready_phase[n + 1]});
        wg0.push_back({Step::kRead, kTile, n + 1});  // S(n + 1) issued
      }
      wg0.push_back({Step::kWrite, kP, n});  // the softmax of chunk n: P and its rescale
      wg0.push_back({Step::kArrive, kPReady0 + n % p_slots, n / p_slots});
      if (i > 0) {
        wg0.push_back({Step::kRead, kTile, n - 1});  // O_left's P V of chunk n - 1 waited for
        if (free_phase[n - 1] >= 0) wg0.push_back({Step::kArrive, kTileFree, free_phase[n - 1]});
      }
      wg0.push_back({Step::kRead, kTile, n});                          // O_left's P V of chunk n issued
      if (i + 1 < chunks) wg0.push_back({Step::kRead, kTile, n + 1});  // S(n + 1) waited for
    }
    if (chunks > 0) wg0.push_back({Step::kRead, kTile, n0 + chunks - 1});  // the last P V waited for
    // Warpgroup 1: O_right's P V of chunk n, and under it chunk n + 2's
    // conversion into the tile of chunk n - 1.
    for (int i = 0; i < chunks; ++i) {
      const int n = n0 + i;
      wg1.push_back({Step::kWait, kPReady0 + n % p_slots, n / p_slots});
      wg1.push_back({Step::kRead, kP, n});
      wg1.push_back({Step::kRead, kTile, n});  // O_right's P V issued
      if (i >= 1 && i + 2 < chunks) {
        if (protocol.conversion_waits_for_tile_free) wg1.push_back({Step::kWait, kTileFree, free_phase[n - 1]});
        wg1.push_back({Step::kWrite, kTile, n + 2});
        wg1.push_back({Step::kArrive, ready_barrier(n + 2), ready_phase[n + 2]});
      }
      wg1.push_back({Step::kRead, kTile, n});  // and waited for
      wg1.push_back({Step::kRead, kP, n});
    }
    wg0.push_back({Step::kCtaBarrier});
    wg1.push_back({Step::kCtaBarrier});
    n0 += chunks;
  }
  return {wg0, wg1};
}

Exploration explore(const Program& wg0, const Program& wg1, int p_slots) {
  return handover_check::explore(wg0, wg1, {kTileSlots, p_slots});
}

std::string describe(const std::vector<int>& items) {
  std::string name;
  for (const int chunks : items) name += std::to_string(chunks) + " ";
  return "items of " + name + "chunks";
}

// Every CTA of up to three items of 0..9 chunks (the period of the steps is
// three chunks; a stream's 32 repeat it).
TEST(SparseMlaThreeTilesDesign, ParityWaitsBuffersAndProgressHoldForEveryInterleaving) {
  for (int a = 0; a <= 9; ++a) {
    for (int b = -1; b <= 9; ++b) {
      for (int c = -1; c <= (b < 0 ? -1 : 9); ++c) {
        std::vector<int> items = {a};
        if (b >= 0) items.push_back(b);
        if (c >= 0) items.push_back(c);
        const auto [wg0, wg1] = three_tile_programs(items);
        const Exploration e = explore(wg0, wg1, Protocol{}.p_slots);
        ASSERT_TRUE(e.aliased.empty()) << describe(items) << ": " << e.aliased;
        ASSERT_TRUE(e.hazard.empty()) << describe(items) << ": " << e.hazard;
        ASSERT_FALSE(e.deadlock) << describe(items);
      }
    }
  }
}

// The checker finds what per-slot barriers are for: with one tile_ready for
// every conversion, warpgroup 1 announces chunks 1 and 2 before warpgroup 0
// waits for chunk 1.
TEST(SparseMlaThreeTilesDesign, OneSharedTileReadyBarrierAliases) {
  Protocol shared;
  shared.tile_ready_per_slot = false;
  const auto [wg0, wg1] = three_tile_programs({4}, shared);
  const Exploration e = explore(wg0, wg1, shared.p_slots);
  EXPECT_NE(e.aliased.find("waits for phase 0 of barrier 3, which has completed 2"), std::string::npos) << e.aliased;
}

// And why P needs three slots here: with two (the kernel's today) warpgroup
// 0 writes P of chunk 2 into chunk 0's slot before warpgroup 1 has read it.
TEST(SparseMlaThreeTilesDesign, TwoPSlotsAreOverwrittenAhead) {
  Protocol two_p_slots;
  two_p_slots.p_slots = 2;
  const auto [wg0, wg1] = three_tile_programs({3}, two_p_slots);
  const Exploration e = explore(wg0, wg1, two_p_slots.p_slots);
  EXPECT_NE(e.hazard.find("warpgroup 0 writes P of chunk 2 before warpgroup 1 has read chunk 0's"), std::string::npos)
      << e.hazard;
}

// And the tile_free wait: without it warpgroup 1 converts chunk 3 into
// chunk 0's tile while warpgroup 0's P V may still read it.
TEST(SparseMlaThreeTilesDesign, ConversionWithoutTileFreeOverwritesATileInUse) {
  Protocol unguarded;
  unguarded.conversion_waits_for_tile_free = false;
  const auto [wg0, wg1] = three_tile_programs({4}, unguarded);
  const Exploration e = explore(wg0, wg1, unguarded.p_slots);
  EXPECT_NE(e.hazard.find("warpgroup 1 writes tile of chunk 3 before warpgroup 0 has read chunk 0's"),
            std::string::npos)
      << e.hazard;
}

}  // namespace
}  // namespace dsa
