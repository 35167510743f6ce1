#include "kernel_trace.h"

#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "dsa_decode/cuda_check.h"

#if DSA_HAVE_CUPTI
#include <cupti.h>
// The record layout read below (CUpti_ActivityKernel10) is CUPTI 13's.
#if !defined(CUPTI_API_VERSION) || CUPTI_API_VERSION < 130000
#error "dsa-decode --trace reads CUpti_ActivityKernel10 records: CUPTI 13 or later (configure without CUPTI otherwise)"
#endif
#endif

namespace dsa::cli {

std::string kernel_short_name(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  if (status != 0 || demangled == nullptr) {
    std::free(demangled);
    return mangled;  // a C name (nvjet_..., cuBLAS's) or one the demangler does not take
  }
  std::string name = demangled;
  std::free(demangled);
  // Cut at the first '<' or '(' outside "(anonymous namespace)", then drop the
  // return type and the scopes.
  static const std::string anonymous = "(anonymous namespace)";
  size_t end = 0;
  while (end < name.size()) {
    if (name.compare(end, anonymous.size(), anonymous) == 0) {
      end += anonymous.size();
      continue;
    }
    if (name[end] == '<' || name[end] == '(') break;
    ++end;
  }
  name.resize(end);
  if (const size_t scope = name.rfind("::"); scope != std::string::npos) name.erase(0, scope + 2);
  if (const size_t space = name.rfind(' '); space != std::string::npos) name.erase(0, space + 1);
  return name;
}

double trace_span_us(const std::vector<TracedKernel>& kernels) {
  if (kernels.empty()) return 0;
  uint64_t end = 0;
  for (const TracedKernel& k : kernels) end = std::max(end, k.end_ns);
  return (end - kernels.front().start_ns) / 1e3;
}

double trace_idle_us(const std::vector<TracedKernel>& kernels) {
  if (kernels.empty()) return 0;
  uint64_t covered_until = kernels.front().start_ns, idle_ns = 0;
  for (const TracedKernel& k : kernels) {  // in order of start
    if (k.start_ns > covered_until) idle_ns += k.start_ns - covered_until;
    covered_until = std::max(covered_until, k.end_ns);
  }
  return idle_ns / 1e3;
}

Status split_stages(const std::vector<TracedKernel>& kernels, size_t stages,
                    std::vector<std::vector<TracedKernel>>* per_stage) {
  if (stages == 0 || kernels.empty() || kernels.size() % stages != 0) {
    return unsupported("CUPTI reported " + std::to_string(kernels.size()) + " kernels for " + std::to_string(stages) +
                       " stages (expected a whole number per stage)");
  }
  const size_t per = kernels.size() / stages;
  const auto sorted_names = [](std::vector<TracedKernel>::const_iterator first, size_t count) {
    std::vector<std::string> names;
    for (size_t i = 0; i < count; ++i) names.push_back(first[i].name);
    std::sort(names.begin(), names.end());
    return names;
  };
  const std::vector<std::string> first_stage = sorted_names(kernels.begin(), per);
  per_stage->clear();
  for (size_t stage = 0; stage < stages; ++stage) {
    const auto first = kernels.begin() + static_cast<std::ptrdiff_t>(stage * per);
    if (sorted_names(first, per) != first_stage) {
      return unsupported("traced stage " + std::to_string(stage) + " ran other kernels than stage 0 (" +
                         std::to_string(per) + " kernels each, cut in order of start)");
    }
    per_stage->emplace_back(first, first + static_cast<std::ptrdiff_t>(per));
  }
  return Status();
}

StageNeighbours stage_neighbours(const std::vector<std::vector<TracedKernel>>& per_stage, size_t stage) {
  StageNeighbours n = {std::nan(""), std::nan("")};
  if (stage >= per_stage.size() || per_stage[stage].empty()) return n;
  const double origin = static_cast<double>(per_stage[stage].front().start_ns);
  if (stage + 1 < per_stage.size() && !per_stage[stage + 1].empty()) {
    n.next_stage_start_us = (static_cast<double>(per_stage[stage + 1].front().start_ns) - origin) / 1e3;
  }
  if (stage > 0 && !per_stage[stage - 1].empty()) {
    uint64_t previous_end = 0;
    for (const TracedKernel& k : per_stage[stage - 1]) previous_end = std::max(previous_end, k.end_ns);
    n.previous_stage_end_us = (static_cast<double>(previous_end) - origin) / 1e3;
  }
  return n;
}

#if DSA_HAVE_CUPTI
namespace {

// CUPTI hands records over from its own thread, buffer by buffer.
std::mutex records_mutex;
std::vector<TracedKernel>* records = nullptr;  // set while a trace runs
size_t lost_records = 0;                       // dropped by CUPTI, or no buffer to put them in

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kBufferAlignment = 8;  // CUPTI's requirement for activity buffers

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
  if (*buffer == nullptr) {
    std::lock_guard<std::mutex> lock(records_mutex);
    ++lost_records;  // CUPTI drops what it cannot store; counted so that collect fails
  }
}

void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(records_mutex);
    CUpti_Activity* record = nullptr;
    while (records != nullptr && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
      if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      TracedKernel t;
      t.name = kernel_short_name(k->name);
      t.stream = k->streamId;
      t.graph = k->graphId;
      t.start_ns = k->start;
      t.end_ns = k->end;
      t.ctas = k->gridX * k->gridY * k->gridZ;
      t.threads = k->blockX * k->blockY * k->blockZ;
      records->push_back(std::move(t));
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(context, stream, &dropped) == CUPTI_SUCCESS) lost_records += dropped;
  }
  std::free(buffer);
}

Status cupti_status(CUptiResult result, const char* call) {
  if (result == CUPTI_SUCCESS) return Status();
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  return Status(ErrorCode::kCudaError, std::string(call) + ": " + (text != nullptr ? text : "unknown CUPTI error"));
}

}  // namespace

bool kernel_trace_available(std::string* why_not) {
  uint32_t version = 0;
  if (cuptiGetVersion(&version) != CUPTI_SUCCESS) {
    *why_not = "cuptiGetVersion failed (no usable libcupti)";
    return false;
  }
  if (version / 10000 != CUPTI_API_VERSION / 10000) {
    *why_not = "libcupti API version " + std::to_string(version) + ", built against " +
               std::to_string(CUPTI_API_VERSION) + " (the kernel records' layout may differ)";
    return false;
  }
  return true;
}

KernelTrace::~KernelTrace() {
  if (!running_) return;
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  std::lock_guard<std::mutex> lock(records_mutex);
  delete records;
  records = nullptr;
}

Status KernelTrace::start() {
  if (running_) return Status(ErrorCode::kInvalidArgument, "KernelTrace::start: a trace is already running");
  {
    std::lock_guard<std::mutex> lock(records_mutex);
    if (records != nullptr) {
      return Status(ErrorCode::kInvalidArgument, "KernelTrace::start: another trace is running in the process");
    }
    records = new std::vector<TracedKernel>();
    lost_records = 0;
  }
  Status s = cupti_status(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
                          "cuptiActivityRegisterCallbacks");
  if (s.ok()) {
    s = cupti_status(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                     "cuptiActivityEnable(CONCURRENT_KERNEL)");
  }
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(records_mutex);
    delete records;
    records = nullptr;
    return s;
  }
  running_ = true;
  return Status();
}

Status KernelTrace::collect(std::vector<TracedKernel>* kernels) {
  if (!running_) return Status(ErrorCode::kInvalidArgument, "KernelTrace::collect: no trace is running");
  DSA_RETURN_IF_ERROR(cupti_status(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll"));
  std::lock_guard<std::mutex> lock(records_mutex);
  kernels->clear();
  kernels->swap(*records);
  std::sort(kernels->begin(), kernels->end(),
            [](const TracedKernel& a, const TracedKernel& b) { return a.start_ns < b.start_ns; });
  if (lost_records > 0) {
    const size_t lost = lost_records;
    lost_records = 0;
    return Status(ErrorCode::kCudaError,
                  "CUPTI dropped " + std::to_string(lost) + " kernel records (or had no buffer for them)");
  }
  return Status();
}

Status KernelTrace::stop() {
  if (!running_) return Status(ErrorCode::kInvalidArgument, "KernelTrace::stop: no trace is running");
  running_ = false;
  const Status flushed = cupti_status(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  const Status disabled = cupti_status(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
                                       "cuptiActivityDisable(CONCURRENT_KERNEL)");
  std::lock_guard<std::mutex> lock(records_mutex);
  delete records;
  records = nullptr;
  return flushed.ok() ? disabled : flushed;
}

#else  // built without CUPTI

bool kernel_trace_available(std::string* why_not) {
  *why_not = "this dsa-decode was built without CUPTI (CMake found no CUDA::cupti)";
  return false;
}

KernelTrace::~KernelTrace() = default;

Status KernelTrace::start() {
  std::string why;
  kernel_trace_available(&why);
  return unsupported(why);
}

Status KernelTrace::collect(std::vector<TracedKernel>*) {
  return Status(ErrorCode::kInvalidArgument, "KernelTrace::collect: no trace is running");
}

Status KernelTrace::stop() { return Status(ErrorCode::kInvalidArgument, "KernelTrace::stop: no trace is running"); }

#endif

}  // namespace dsa::cli
