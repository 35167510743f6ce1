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

// Not yet measured for the persistent kernel (v6): tactics with 128 threads per
// token group, the most that m = 16 (two groups of 8 tokens, 384 threads at
// most) allows; one tactic for every m of a shape, so the summation order, and
// so a token's bits, do not depend on m.
constexpr TacticEntry kTable[] = {
    {8, 256, 512, 16, {64, 16}},
    {8, 512, 256, 16, {32, 16}},
    {0, 256, 512, 16, {128, 32}},
    {0, 512, 256, 16, {64, 32}},
};
}  // namespace

HeadGemvTactic head_gemv_tactic(int heads, int rows, int cols, int m) {
  for (const TacticEntry& e : kTable) {
    if ((e.heads == 0 || e.heads == heads) && e.rows == rows && e.cols == cols && m <= e.max_tokens) {
      return e.tactic;
    }
  }
  // Default: the first candidate valid for every m, so that the order does not
  // depend on m; failing that, the first valid for this m.
  constexpr HeadGemvTactic kCandidates[] = {{64, 16}, {128, 32}, {32, 8}, {64, 32}, {32, 16},
                                            {16, 8},  {64, 8},   {16, 16}, {128, 16}, {256, 64}};
  for (const HeadGemvTactic& tactic : kCandidates) {
    bool every_m = true;
    for (int tokens = 1; tokens <= kHeadGemvMaxTokens && every_m; ++tokens) {
      every_m = check_head_gemv_tactic(rows, cols, tokens, tactic).ok();
    }
    if (every_m) return tactic;
  }
  for (const HeadGemvTactic& tactic : kCandidates) {
    if (check_head_gemv_tactic(rows, cols, m, tactic).ok()) return tactic;
  }
  return HeadGemvTactic{};  // no valid tactic: head_gemv reports the shape as unsupported
}

}  // namespace dsa
