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

// Not yet measured for this kernel version: picked from the previous
// version's sweep (bench/results/head_gemv_2026-11-30_4dcc71a.json). One tactic
// for every m of a shape: the summation order, and so a token's bits, do not
// depend on m.
constexpr TacticEntry kTable[] = {
    {8, 256, 512, 16, {64, 16}},
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
  // Default: the widest tile whose CTA shape is valid.
  for (int tile : {64, 32, 16, 128, 256}) {
    for (int rows_per_thread : {16, 32, 8, 64}) {
      const HeadGemvTactic tactic{tile, rows_per_thread};
      if (check_head_gemv_tactic(rows, cols, m, tactic).ok()) return tactic;
    }
  }
  return HeadGemvTactic{};  // no valid tactic: head_gemv reports the shape as unsupported
}

}  // namespace dsa
