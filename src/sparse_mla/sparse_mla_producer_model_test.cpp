// The handover of sparse_mla_producer (src/sparse_mla/sparse_mla_producer.cu),
// written from its code step by step: a change to one is a change to the
// other. A third, producer warpgroup loads and converts the chunks
// (docs/sparse_mla.md, "v13"). Every interleaving of the three warpgroups'
// barrier and buffer steps is checked as sparse_mla_handover_test.cpp checks
// sparse_mla_wgmma's protocol (sparse_mla_handover_check.h). The kernel
// runs one item per CTA; several items per CTA (the phases running on
// across them) are checked too, as a stricter case.
//
// Chunks are numbered over the CTA (n), across its items; chunk n's tile
// and P are in slot n % 2. Barriers, each a pair indexed by slot:
//   tile_ready  the producer's conversion of chunk n, phase n / 2
//   tile_free   warpgroups 0 and 1 done with tile n (two arrivals a phase),
//               phase n / 2; the producer waits for chunk n - 2's
//   p_ready     warpgroup 0's P of chunk n, phase n / 2
//   p_free      warpgroup 1 done with P of chunk n; warpgroup 0 waits for
//               chunk n - 2's before writing P of chunk n
//   scores_done warpgroup 0 has S of chunk n, phase n / 2; warpgroup 1's
//               P V of chunk n - 1 waits for it (so that it runs under
//               warpgroup 0's softmax of chunk n)
// Also q's tile: written by warpgroup 1 (q_ready), read by every S, then
// written again by both consumers' epilogues (the staged latent;
// stats_ready). Items are apart by CTA barriers (each item's chunk list is
// built by every thread), and the phases run on across them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sparse_mla/sparse_mla_handover_check.h"

namespace dsa {
namespace {

using handover_check::Exploration;
using handover_check::kP;
using handover_check::kQ;
using handover_check::kTile;
using handover_check::Program;
using handover_check::Step;
constexpr int kTileReady0 = 0, kTileFree0 = 2, kPReady0 = 4, kPFree0 = 6, kScoresDone0 = 8, kQReady = 10,
              kStatsReady = 11, kBarriers = 12;

// The design, and the variants the checker must refute.
struct Protocol {
  bool tile_ready_per_slot = true;      // else one tile_ready barrier for every conversion, phase n
  bool warpgroup_1_frees_tiles = true;  // else tile_free counts warpgroup 0's arrival alone
  int tile_free_arrivals = 2;           // warpgroup arrivals that complete a tile_free phase
  int p_v_lag = 1;                      // warpgroup 1's P V of chunk n waits for S of chunk n + p_v_lag (0: none)
  bool first_scores_waited = true;      // else warpgroup 1 does not wait for the item's first S (with p_v_lag > 0)
  bool q_waited = true;                 // else warpgroup 0 starts without waiting for q_ready
};

std::vector<Program> producer_programs(const std::vector<int>& chunks_per_item, const Protocol& protocol = {}) {
  // An arrival or a wait on the tile_ready barrier of chunk n.
  auto tile_ready = [&](Step::Kind kind, int n) {
    return protocol.tile_ready_per_slot ? Step{kind, kTileReady0 + n % 2, n / 2} : Step{kind, kTileReady0, n};
  };
  Program wg0, wg1, producer;
  int n0 = 0, item = 0;
  for (const int chunks : chunks_per_item) {
    for (Program* program : {&wg0, &wg1, &producer}) program->push_back({Step::kCtaBarrier});  // the chunk list
    // Warpgroup 1 converts q; warpgroup 0 waits for it before its loop.
    wg1.push_back({Step::kWrite, kQ, 2 * item});
    wg1.push_back({Step::kArrive, kQReady, item});
    if (protocol.q_waited) wg0.push_back({Step::kWait, kQReady, item});
    for (int n = n0; n < n0 + chunks; ++n) {
      // The producer: the tile of chunk n - 2 released by both consumers,
      // chunk n converted into it and announced.
      if (n >= 2) producer.push_back({Step::kWait, kTileFree0 + n % 2, n / 2 - 1});
      producer.push_back({Step::kWrite, kTile, n});
      producer.push_back(tile_ready(Step::kArrive, n));
      // Warpgroup 0: S of chunk n (a read at its issue and at its wait),
      // P written once warpgroup 1 is done with chunk n - 2's, O_left's P V.
      wg0.push_back(tile_ready(Step::kWait, n));
      wg0.push_back({Step::kRead, kTile, n});
      wg0.push_back({Step::kRead, kQ, 2 * item});
      wg0.push_back({Step::kRead, kTile, n});
      wg0.push_back({Step::kRead, kQ, 2 * item});
      wg0.push_back({Step::kArrive, kScoresDone0 + n % 2, n / 2});
      if (n >= 2) wg0.push_back({Step::kWait, kPFree0 + n % 2, n / 2 - 1});
      wg0.push_back({Step::kWrite, kP, n});
      wg0.push_back({Step::kArrive, kPReady0 + n % 2, n / 2});
      wg0.push_back({Step::kRead, kTile, n});  // O_left's P V, waited for
      wg0.push_back({Step::kArrive, kTileFree0 + n % 2, n / 2});
      // Warpgroup 1: the tile announced (a direct wait on the producer, the
      // tile's writer) and P, O_right's P V of chunk n (P and the tile read
      // at its issue and at its wait), then both released.
      // The item's first S waited for before the loop (every phase has a waiter).
      if (protocol.p_v_lag > 0 && n == n0 && protocol.first_scores_waited) {
        wg1.push_back({Step::kWait, kScoresDone0 + n % 2, n / 2});
      }
      wg1.push_back(tile_ready(Step::kWait, n));
      wg1.push_back({Step::kWait, kPReady0 + n % 2, n / 2});
      const int lagged = n + protocol.p_v_lag;
      if (protocol.p_v_lag > 0 && lagged < n0 + chunks) {
        wg1.push_back({Step::kWait, kScoresDone0 + lagged % 2, lagged / 2});
      }
      wg1.push_back({Step::kRead, kP, n});
      wg1.push_back({Step::kRead, kTile, n});
      wg1.push_back({Step::kRead, kP, n});
      wg1.push_back({Step::kRead, kTile, n});
      wg1.push_back({Step::kArrive, kPFree0 + n % 2, n / 2});
      if (protocol.warpgroup_1_frees_tiles) wg1.push_back({Step::kArrive, kTileFree0 + n % 2, n / 2});
    }
    // The epilogue: warpgroup 0's statistics, then each warpgroup's latent
    // staged in q's tile (warpgroup 1's after the statistics; its wait for
    // the last chunk's P already orders it after every S's read of q).
    wg0.push_back({Step::kArrive, kStatsReady, item});
    wg0.push_back({Step::kWrite, kQ, 2 * item + 1});
    wg1.push_back({Step::kWait, kStatsReady, item});
    wg1.push_back({Step::kWrite, kQ, 2 * item + 1});
    n0 += chunks;
    ++item;
  }
  for (Program* program : {&wg0, &wg1, &producer}) program->push_back({Step::kCtaBarrier});  // the end
  return {wg0, wg1, producer};
}

Exploration explore(const std::vector<Program>& programs, const Protocol& protocol = {}) {
  std::vector<int> arrivals_per_phase(kBarriers, 1);
  arrivals_per_phase[kTileFree0] = arrivals_per_phase[kTileFree0 + 1] = protocol.tile_free_arrivals;
  return handover_check::explore(programs, {2, 2, 1}, arrivals_per_phase);
}

// One item of `chunks` chunks under `protocol`: its programs and the checker
// built from the same protocol.
Exploration explore_item(int chunks, const Protocol& protocol = {}) {
  return explore(producer_programs({chunks}, protocol), protocol);
}

std::string describe(const std::vector<int>& items) {
  std::string name;
  for (const int chunks : items) name += std::to_string(chunks) + " ";
  return "items of " + name + "chunks";
}

// Every CTA of one or two items of 0..9 chunks and three of 0..5 (the steps
// repeat every two chunks; a stream's 32 chunks repeat them).
TEST(SparseMlaProducerDesign, ParityWaitsBuffersAndProgressHoldForEveryInterleaving) {
  std::vector<std::vector<int>> sequences;
  for (int a = 0; a <= 9; ++a) {
    sequences.push_back({a});
    for (int b = 0; b <= 9; ++b) sequences.push_back({a, b});
  }
  for (int a = 0; a <= 5; ++a) {
    for (int b = 0; b <= 5; ++b) {
      for (int c = 0; c <= 5; ++c) sequences.push_back({a, b, c});
    }
  }
  for (const std::vector<int>& items : sequences) {
    const Exploration e = explore(producer_programs(items));
    ASSERT_TRUE(e.aliased.empty()) << describe(items) << ": " << e.aliased;
    ASSERT_TRUE(e.hazard.empty()) << describe(items) << ": " << e.hazard;
    ASSERT_TRUE(e.missing_wait.empty()) << describe(items) << ": " << e.missing_wait;
    ASSERT_FALSE(e.deadlock) << describe(items);
  }
}

// The checker finds what per-slot barriers are for: with one tile_ready for
// every conversion the producer announces chunks 0 and 1 before warpgroup 0
// waits for chunk 0.
TEST(SparseMlaProducerDesign, OneSharedTileReadyBarrierAliases) {
  Protocol shared;
  shared.tile_ready_per_slot = false;
  const Exploration e = explore_item(3, shared);
  EXPECT_NE(e.aliased.find("warpgroup 0 waits for phase 0 of barrier 0, which has completed 2"), std::string::npos)
      << e.aliased;
}

// Why tile_free needs both consumers: released by warpgroup 0 alone, the
// producer converts chunk 2 into chunk 0's tile while warpgroup 1's P V may
// still read it.
TEST(SparseMlaProducerDesign, TilesFreedByWarpgroup0AloneAreOverwrittenInUse) {
  Protocol alone;
  alone.warpgroup_1_frees_tiles = false;
  alone.tile_free_arrivals = 1;
  const Exploration e = explore_item(3, alone);
  EXPECT_NE(e.hazard.find("warpgroup 2 writes tile of chunk 2 before warpgroup 1 has read chunk 0's"),
            std::string::npos)
      << e.hazard;
}

// And its arrival count: with tile_free initialized for one warpgroup's
// threads while both consumers arrive, the first consumer done completes
// the phase, and the producer converts chunk 2 while the other still reads
// chunk 0's tile.
TEST(SparseMlaProducerDesign, TileFreeInitializedForOneWarpgroupReleasesEarly) {
  Protocol miscounted;
  miscounted.tile_free_arrivals = 1;
  const Exploration e = explore_item(3, miscounted);
  EXPECT_NE(e.hazard.find("warpgroup 2 writes tile of chunk 2 before warpgroup "), std::string::npos) << e.hazard;
  EXPECT_NE(e.hazard.find(" has read chunk 0's"), std::string::npos) << e.hazard;
}

// Why warpgroup 1 lags one chunk and no more: waiting for S of chunk n + 2
// before its P V of chunk n, it waits for a tile the producer converts only
// once that P V has freed chunk n's.
TEST(SparseMlaProducerDesign, PVLaggingTwoChunksDeadlocks) {
  Protocol two;
  two.p_v_lag = 2;
  EXPECT_TRUE(explore_item(3, two).deadlock);
  EXPECT_FALSE(explore_item(3).deadlock);
}

// What compute-sanitizer's synccheck found on the H200: without
// warpgroup 1's wait for the item's first S, nobody waits for phase 0 of
// scores_done's slot 0 before warpgroup 0 arrives there for chunk 2.
TEST(SparseMlaProducerDesign, UnwaitedFirstScoresDoneIsAMissingWait) {
  Protocol unwaited;
  unwaited.first_scores_waited = false;
  const Exploration e = explore_item(3, unwaited);
  EXPECT_NE(e.missing_wait.find("arrives on barrier 8 before anyone waited for its phase 0"), std::string::npos)
      << e.missing_wait;
  EXPECT_TRUE(explore_item(3).missing_wait.empty());
}

// q's tile is in the model: without the wait for q_ready, S reads it before
// warpgroup 1 has converted q.
TEST(SparseMlaProducerDesign, SWithoutQReadyReadsQBeforeItIsWritten) {
  Protocol eager;
  eager.q_waited = false;
  const Exploration e = explore_item(2, eager);
  EXPECT_NE(e.hazard.find("warpgroup 0 reads q's tile of chunk 0 before warpgroup 1 has written it"), std::string::npos)
      << e.hazard;
}

}  // namespace
}  // namespace dsa
