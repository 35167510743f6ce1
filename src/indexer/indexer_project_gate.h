// Whether indexer_project / indexer_project_gemv compute the gate output.
// The pooled indexer (plan.pool > 1) always does. DeepSeek-V3.2's (pool 1)
// has no compress gate: there compress_gate and gate may both be empty
// (data null), and then neither is read nor written; if either is given, both
// are checked and the gate is computed as for a pooled plan.
#pragma once

#include "dsa_decode/indexer.h"

namespace dsa {

inline bool indexer_project_computes_gate(const IndexerProjectArgs& a) {
  return a.plan.pool > 1 || a.compress_gate.data != nullptr || a.gate.data != nullptr;
}

}  // namespace dsa
