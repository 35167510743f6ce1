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

// Not yet measured: first guesses from the work split (enough CTAs for 132 SMs
// at H = 8, 32 KB of weights in flight per 256-thread CTA at H = 64).
constexpr TacticEntry kTable[] = {
    {8, 256, 512, 16, {16, 8}},
    {8, 512, 256, 8, {16, 16}},
    {8, 512, 256, 16, {16, 8}},
    {0, 256, 512, 16, {64, 8}},
    {0, 512, 256, 8, {32, 16}},
    {0, 512, 256, 16, {32, 8}},
};
}  // namespace

HeadGemvTactic head_gemv_tactic(int heads, int rows, int cols, int m) {
  for (const TacticEntry& e : kTable) {
    if ((e.heads == 0 || e.heads == heads) && e.rows == rows && e.cols == cols && m <= e.max_tokens) {
      return e.tactic;
    }
  }
  // Default: the widest tile whose CTA shape is valid.
  for (int tile : {64, 32, 16, 128}) {
    for (int rows_per_thread : {8, 16}) {
      const HeadGemvTactic tactic{tile, rows_per_thread};
      if (check_head_gemv_tactic(rows, cols, m, tactic).ok()) return tactic;
    }
  }
  return HeadGemvTactic{};  // no valid tactic: head_gemv reports the shape as unsupported
}

}  // namespace dsa
