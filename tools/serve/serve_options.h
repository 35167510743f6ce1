// dsa-serve's command line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/status.h"
#include "serve_faults.h"

namespace dsa::serve {

struct ServeOptions {
  int64_t steps = 1000;
  uint64_t seed = 1;
  int64_t max_context = 131072;  // the stage plan's; prompts reach max_context - 1
  int tp = 8;                    // glm5next per rank: 1 (64 heads) or 8 (8 heads)
  std::string path = "both";     // fused, stock, or both (drawn per step)
  bool batch_invariant = false;
  std::vector<FaultKind> faults;  // default: all kinds
  int fault_every = 8;            // about one fault step in this many (0: none)
  int check_every = 100;          // the whole-state check's period in steps
  int sample_tokens = 2;          // tokens checked against the references per step
  int64_t blocks = 0;             // pool blocks; 0: 3 * max_context / 256 + 64
  int rows = 16;                  // block table rows (the most live requests)
  std::string json_path;          // --json: the summary as a file too (rewritten at every state check)
  double time_limit = 0;          // --time-limit: seconds from the start after which no step begins (0: none)
  // --index-heads/--index-pool/--index-topk: the indexer's shape (0: the preset's)
  int index_heads = 0, index_pool = 0, index_topk = 0;
};

std::string serve_usage();
// Parses argv; *help set for --help. Errors name the option, what was expected and got.
Status parse_serve_options(int argc, const char* const* argv, ServeOptions* options, bool* help);

}  // namespace dsa::serve
