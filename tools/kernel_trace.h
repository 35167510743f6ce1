// dsa-decode --trace: when each kernel of a captured stage ran, read from
// CUPTI's kernel activity records (start and end on the GPU's clock), so the
// overlap of the indexer's lane with the main stream, and the gaps between
// dependent launches, can be seen rather than guessed from sums of timings.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/status.h"

namespace dsa::cli {

// One kernel execution as CUPTI saw it.
struct TracedKernel {
  std::string name;                   // demangled, namespaces and template arguments dropped
  uint32_t stream = 0;                // CUPTI's stream id
  uint32_t graph = 0;                 // CUPTI's graph id: which graph launch ran it
  uint64_t start_ns = 0, end_ns = 0;  // GPU timestamps
  int ctas = 0, threads = 0;          // grid and block sizes (x * y * z)
};

// Whether this build can trace (linked with CUPTI); when not, why.
bool kernel_trace_available(std::string* why_not);

// Records every kernel that runs between start and stop, from any stream.
// One trace at a time in the process.
class KernelTrace {
 public:
  KernelTrace() = default;
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;
  ~KernelTrace();  // stops a trace left running, dropping its records

  Status start();
  // Flushes CUPTI's buffers (the caller has synchronized the work) and hands
  // over the records since start or the last collect, in order of start.
  Status collect(std::vector<TracedKernel>* kernels);
  Status stop();

 private:
  bool running_ = false;
};

}  // namespace dsa::cli
