// sparse_mla_wgmma's handover between its two warpgroups (sparse_mla_wgmma.cu):
// warpgroup 0 computes P of each chunk and arrives on a p_ready mbarrier;
// warpgroup 1 waits for it, converts the next chunk into the free tile and
// arrives on tile_ready, which warpgroup 0 waits for before that chunk's S.
// Waits are by phase parity, which names one phase only while the waiter is
// at most one phase behind the barrier. Warpgroup 1 converts tile 1 before
// its loop (under chunk 0's S), so warpgroup 0 can finish P of two chunks
// before warpgroup 1 waits for the first: P alternates between two barriers.
// tests: sparse_mla_handover_test.cpp explores every interleaving of the
// loops' barrier steps with this mapping.
#pragma once

#include "dsa_decode/numerics.h"  // DSA_HD

namespace dsa {

struct HandoverPhase {
  int barrier;  // which p_ready barrier
  int phase;    // its phase, counted from the CTA's start
};

// P of the CTA's n-th chunk (counted over all its items, from 0).
DSA_HD constexpr HandoverPhase p_ready_phase_of_chunk(int chunk) { return {chunk % 2, chunk / 2}; }

}  // namespace dsa
