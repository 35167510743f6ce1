// dsa-serve's run on the GPU and its summary.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/status.h"
#include "serve_faults.h"
#include "serve_options.h"

namespace dsa::serve {

struct ServeReport {
  std::string gpu;
  ServeOptions options;
  int64_t blocks = 0, heads = 0;
  int64_t steps = 0, fused_steps = 0, stock_steps = 0, caller_rows_steps = 0, warmup_steps = 0;
  int64_t requests_admitted = 0, requests_served = 0, requests_ended_by_fault = 0, requests_starved = 0;
  int64_t prefill_tokens = 0, longest_prompt = 0;
  int64_t tokens = 0, padding_tokens = 0, extra_slot_entries = 0;
  int64_t tokens_checked = 0, logit_pools_checked = 0;
  int64_t state_checks = 0, entries_compared = 0, pools_compared = 0, ring_rows_compared = 0;
  int64_t faults[static_cast<int>(FaultKind::kCount)] = {};
  int64_t isolated_tokens = 0;   // other tokens of fault steps compared bitwise
  int64_t mismatches = 0;
  std::vector<std::string> failures;  // the first ones, in words
  int64_t memory_delta_bytes = 0;     // free device memory at start-up minus the least seen later
  bool memory_strict = false;         // CUDA_MODULE_LOADING=EAGER: a change counts as a mismatch
  double seconds = 0;
  int64_t steps_planned = 0;  // options.steps
  std::string stopped;        // why the run ended before steps_planned ("time limit", "signal"), else empty

  bool complete() const { return stopped.empty() && steps == steps_planned; }
  void fail(const std::string& what);
};

// The simulation; needs an sm_90a GPU (errors otherwise). A mismatch is not
// an error: it is counted in the report. It ends early, as at its last step
// (the final state check, the report), at options.time_limit or after
// request_serve_stop(); with options.json_path it rewrites that file with the
// figures so far at every state check, so a run killed harder still leaves them.
Status run_serve(const ServeOptions& options, ServeReport* report);

// Ends a running run_serve after its current step; async-signal-safe (for a
// SIGTERM handler).
void request_serve_stop();

// Writes `text` to `path` through a temporary file and a rename (no reader
// sees half a file); false when it could not.
bool write_file_atomically(const std::string& path, const std::string& text);

// One JSON object (one line) and a human summary.
std::string report_json(const ServeReport& report);
std::string report_text(const ServeReport& report);

}  // namespace dsa::serve
