// head_gemv's tactic table. Entries are measured on an H200 (cold L2, graph
// replay) by the head_gemv benchmark's tactic sweep; docs/head_gemv.md keeps
// the numbers. Shapes without an entry take the default.
#include "dsa_decode/head_gemv.h"

namespace dsa {

namespace {
struct TacticEntry {
  int heads, rows, cols;  // heads 0: any
  int max_tokens;         // the entry covers m <= max_tokens (first match wins)
  HeadGemvTactic tactic;
};

// Measured on an H200 (bench/results/head_gemv.json, cold
// L2, graph replay). Each shape takes the tactic with the best times over
// m = 1..8 among those valid for every m (one tactic for every m: the summation
// order, and so a token's bits, do not depend on m). Times in us for
// m = 1, 2, 4, 8, 16:
//   H = 8,  absorb   (256 x 512): {64, 8}    2.12 2.42 2.71 4.07 5.98
//   H = 8,  value-up (512 x 256): {32, 8}    2.15 2.25 2.81 4.10 6.42
//   H = 64, absorb   (256 x 512): {128, 16}  5.54 5.73 7.02 10.78 18.94
//   H = 64, value-up (512 x 256): {64, 16}   5.64 5.51 6.95 10.81 19.62
// ({128, 32} is faster at m = 16, 15.7 us, and slower below; see docs/head_gemv.md.)
constexpr TacticEntry kTable[] = {
    {8, 256, 512, 16, {64, 8}},
    {8, 512, 256, 16, {32, 8}},
    {0, 256, 512, 16, {128, 16}},
    {0, 512, 256, 16, {64, 16}},
};
}  // namespace

HeadGemvTactic head_gemv_tactic(int heads, int rows, int cols, int m) {
  for (const TacticEntry& e : kTable) {
    if ((e.heads == 0 || e.heads == heads) && e.rows == rows && e.cols == cols && m <= e.max_tokens) {
      return e.tactic;
    }
  }
  // Default: a tactic valid at m = 16 is valid at every m (the limits only
  // tighten with m), so trying that first keeps the order independent of m.
  constexpr HeadGemvTactic kCandidates[] = {{64, 16}, {32, 8}, {64, 8}, {128, 16}, {32, 16},
                                            {16, 8},  {64, 32}, {128, 32}, {16, 16}, {256, 32}};
  for (int tokens : {kHeadGemvMaxTokens, m}) {
    for (const HeadGemvTactic& tactic : kCandidates) {
      if (check_head_gemv_tactic(rows, cols, tokens, tactic).ok()) return tactic;
    }
  }
  return HeadGemvTactic{};  // no valid tactic: head_gemv reports the shape as kUnsupported
}

}  // namespace dsa
