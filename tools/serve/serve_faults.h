// dsa-serve's faults: untrusted values injected into one request's part of a
// step (the victim), what the headers' contracts say the affected tokens get,
// and the isolation rule (every other token's results bitwise those of the
// same step without the fault). Host logic only; tests/serve_test.cpp covers it.
//
// Kinds (--faults names):
//   block-id-out-of-range  the victim's block table entry of its current page >= blocks
//   block-id-negative      that entry < 0 (other than -1, the unallocated marker)
//   position-past-table    one victim token at a position >= width * block_size (= max_context)
//   position-negative      one victim token at a negative position
//   position-future        one victim token at a position in a page the victim holds no block for
//   slot-past-cache        one victim token's slot_mapping entry >= blocks * block_size
//   topk-out-of-range      caller top-k rows: entries of one token's row at or past its L (and huge)
//   nan-hidden, inf-hidden one victim token's hidden row holds NaN / +-inf
// The victim request is finished after the step (its state is the fault's).
// The error word must count a fault only where a kernel meets the untrusted
// value: with caller rows the stage runs no indexer, so a negative block id
// counts only when a caller position lies in its page, and a future position
// not at all (FaultPlan::expect_counted).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/status.h"
#include "serve_state.h"

namespace dsa::serve {

enum class FaultKind : int {
  kBlockIdOutOfRange = 0,
  kBlockIdNegative,
  kPositionPastTable,
  kPositionNegative,
  kPositionFuture,
  kSlotPastCache,
  kTopkOutOfRange,
  kNanHidden,
  kInfHidden,
  kCount
};

const char* fault_name(FaultKind kind);
// "all", "none" or a comma-separated list of names; errors name --faults.
Status parse_faults(const std::string& text, std::vector<FaultKind>* kinds);

// One step's inputs on the host, uploaded before each run.
struct StepInputs {
  std::vector<uint16_t> hidden;         // [m, D] BF16
  std::vector<int64_t> positions;       // [m]
  std::vector<int32_t> token_requests;  // [m]
  std::vector<int64_t> slot_mapping;    // [n]
  std::vector<int32_t> table;           // [rows, width]
  std::vector<int32_t> topk;            // [m, row_width] request-local positions, or empty (the indexer runs)
};

// What a run of the stage left, read back (the isolation and victim checks' inputs).
struct StepResult {
  int m = 0;
  int64_t D = 0, H = 0, latent_width = 0, row_width = 0;
  std::vector<uint16_t> out;     // [m, D] BF16
  std::vector<uint16_t> latent;  // [m, H, latent_width] BF16
  std::vector<float> lse;        // [m, H]
  std::vector<int32_t> slots;    // [m, row_width]
  unsigned int errors = 0;       // the step's error word
};

struct FaultPlan {
  FaultKind kind = FaultKind::kCount;
  int victim = -1;             // index of the victim in the live requests
  std::vector<int> affected;   // tokens whose results may differ from the clean run (the victim's)
  std::vector<int> faulted;    // tokens the fault touched directly
  bool expect_counted = false;  // the error word must count it
  bool expect_empty = false;    // faulted tokens: rows of -1, latent +0, lse -inf, out zero
  // Faulted tokens' rows may hold only slots in these blocks (empty: no rule).
  std::vector<int32_t> allowed_blocks;
  // Columns of the faulted token's row that must be -1 (topk faults).
  std::vector<int> cleared_columns;
  // The edits.
  std::vector<std::pair<size_t, int32_t>> table_writes;     // (entry of table, block)
  std::vector<std::pair<int, int64_t>> position_writes;     // (token, position)
  std::vector<std::pair<size_t, int64_t>> slot_writes;      // (entry of slot_mapping, slot)
  std::vector<std::pair<size_t, int32_t>> topk_writes;      // (entry of topk, position)
  std::vector<std::pair<size_t, uint16_t>> hidden_writes;   // (element of hidden, BF16 bits)
};

// A fault of `kind` for this step, or false where the step offers none (no
// request fits the kind). topk faults need a step with caller rows.
bool plan_fault(FaultKind kind, const ServeGeometry& g, const std::vector<ServeRequest>& live, const StepBatch& batch,
                const StepInputs& clean, int64_t hidden_size, int row_width, std::mt19937_64& rng, FaultPlan* plan);
StepInputs apply_fault(const FaultPlan& plan, const StepInputs& clean);

// The checks of a fault step; each failure appended in words.
// Every token not in plan.affected: out, latent, lse and slots bitwise the clean run's.
void check_isolation(const FaultPlan& plan, const StepResult& clean, const StepResult& faulty,
                     std::vector<std::string>* failures);
// The faulted tokens against the contracts, and the error word.
void check_victim(const FaultPlan& plan, const ServeGeometry& g, const StepResult& clean, const StepResult& faulty,
                  std::vector<std::string>* failures);
// A padding token or a token whose row is all -1: latent +0, lse -inf, out zero.
bool empty_result(const StepResult& r, int token, std::string* why);

}  // namespace dsa::serve
