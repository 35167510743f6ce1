// dsa-decode --trace: when each kernel of a captured stage ran, read from
// CUPTI's kernel activity records (start and end on the GPU's clock), so that
// the overlap of the stage's two streams and the kernels that run slower
// inside the chain than alone can be seen rather than guessed from sums of
// timings. A kernel counts from its first resident CTA: a PDL kernel waiting
// in griddepcontrol.wait is "running" (so a PDL chain shows no gaps).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsa_decode/status.h"

namespace dsa::cli {

// One kernel execution as CUPTI saw it.
struct TracedKernel {
  std::string name;                   // kernel_short_name of CUPTI's (mangled) name
  uint32_t stream = 0;                // CUPTI's stream id: in a graph launch, a stream the graph runtime picked
  uint32_t graph = 0;                 // CUPTI's graph id: the graph (every launch of it has the same id); 0: none
  uint64_t start_ns = 0, end_ns = 0;  // GPU timestamps
  int ctas = 0, threads = 0;          // grid and block sizes (x * y * z)
};

// "void dsa::(anonymous namespace)::linear_gemv_kernel<4>(dsa::LinearGemvParams)"
// (mangled) -> "linear_gemv_kernel": demangled, template arguments, parameters
// and scopes dropped; a name that does not demangle is kept whole.
std::string kernel_short_name(const char* mangled);

// Over kernels in order of start: microseconds from the first start to the
// last end, and the part of it in which no kernel was resident.
double trace_span_us(const std::vector<TracedKernel>& kernels);
double trace_idle_us(const std::vector<TracedKernel>& kernels);

// The kernels of one graph launch that ran `stages` stages in turn, in order
// of start, cut into the stages: a stage's kernels all start before the next
// stage's first (each stage's first kernel waits in stream order on the one
// before it). An error unless every stage shows the same kernels by name.
Status split_stages(const std::vector<TracedKernel>& kernels, size_t stages,
                    std::vector<std::vector<TracedKernel>>* per_stage);

// Around stage `stage` of split_stages' result, in microseconds from that
// stage's first start: the next stage's first start (the stage's period in
// the chain) and the previous stage's last end (positive: the two overlap);
// NaN where the stage has no such neighbour.
struct StageNeighbours {
  double next_stage_start_us;
  double previous_stage_end_us;
};
StageNeighbours stage_neighbours(const std::vector<std::vector<TracedKernel>>& per_stage, size_t stage);

// Whether this build can trace (linked with a CUPTI of the version it was
// compiled against); when not, why.
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
  // over the records since start or the last collect, in order of start; an
  // error when CUPTI dropped any.
  Status collect(std::vector<TracedKernel>* kernels);
  Status stop();

 private:
  bool running_ = false;
};

}  // namespace dsa::cli
