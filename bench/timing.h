// Measuring on the GPU: the device facts (Context), cold-L2 input rotation,
// CUDA-graph replay timing with medians, the copy rate and device buffers.
// Shared by the benchmarks (harness.h) and dsa-decode's timings.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/cuda_check.h"  // DSA_CUDA_RETURN / DSA_CUBLAS_RETURN
#include "dsa_decode/status.h"

namespace dsa::bench {

// The device facts and where to write.
struct Context {
  cudaStream_t stream = nullptr;
  std::string gpu_name;
  int sm_count = 0;
  size_t l2_bytes = 0;
  double copy_GBps = 0;  // measured device copy rate, bytes read + written per second / 1e9
  std::string commit;    // DSA_COMMIT or "unknown"
  std::string date;      // YYYY-MM-DD (UTC)
  bool quick = false;    // --quick: fewer replays (smoke runs)
};

// Fills `ctx` for device 0 on `stream` (a non-default stream: graph capture
// cannot use the legacy one): GPU facts, DSA_COMMIT (or "unknown"), today's UTC
// date, and the copy rate, measured once here.
Status open_context(cudaStream_t stream, bool quick, Context* ctx);

// JSON helpers shared by the reports: a quoted, escaped string; a number
// (integers as integers, others to 6 significant digits, null when not finite).
std::string json_string(const std::string& text);
std::string json_number(double value);
std::string utc_date();  // YYYY-MM-DD

// How many copies of a `bytes`-sized input set make the rotation at least
// twice the L2 size (so every launch reads its inputs from device memory).
int cold_copies(const Context& ctx, size_t bytes);

// Median microseconds of one launch. `enqueue(stream, i)` issues launch
// number i (use i % copies to pick the input copy) on `stream` and returns its
// status. The launches are captured `per_graph` at a time into one CUDA graph
// that is replayed (after a warm-up) `replays` times; each replay's time over
// per_graph is a sample. Errors from capture or launch come back as Status.
// Details callers rely on:
// - `stream` is ctx.stream (created by dsa-bench, never the legacy default
//   stream); a cuBLAS handle must be bound to it with an explicit workspace
//   (bench/cublas_bmm.h: CublasHandle) so that capture allocates nothing.
// - The per_graph launches run once eagerly before capture (module loading,
//   cuBLAS heuristics, clear launch errors); capture is thread-local.
// - Pass per_graph >= the number of input copies, so that each replay walks
//   the whole rotation and no copy is reused from L2.
// - PDL launches (src/core/launch.cuh) capture as programmatic graph edges.
// - ctx.quick caps replays at 5.
using Enqueue = std::function<Status(cudaStream_t stream, int i)>;
Status time_graph(const Context& ctx, const Enqueue& enqueue, double* median_us, int per_graph = 20,
                  int replays = 50);

// A CUDA graph captured from `enqueue` on `stream` (thread-local mode; the
// capture ends even when enqueue fails, so the stream stays usable), and its
// executable instance; both released with the object.
class CapturedGraph {
 public:
  CapturedGraph() = default;
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph();

  Status capture(cudaStream_t stream, const std::function<Status()>& enqueue);
  Status launch(cudaStream_t stream) const;

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Device-to-device copy rate over `bytes` (read + written), median of several copies.
Status measure_copy_GBps(cudaStream_t stream, size_t bytes, double* GBps);
// The copy size dsa-bench measures Context::copy_GBps with (1 GiB copied, 2 GiB moved).
inline constexpr size_t kCopyProbeBytes = size_t{1} << 30;

// Device memory a benchmark owns: allocated at setup, freed on scope exit.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept;
  DeviceMemory& operator=(DeviceMemory&& other) noexcept;
  ~DeviceMemory();

  // Frees what was held, then cudaMalloc(bytes).
  Status allocate(size_t bytes);
  void* get() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Fills `count` BF16 values with uniform random values in [-scale, scale),
// a hash of (seed, index): benchmarks never run on zeros (METHOD.md: zeros
// can run faster than real data and hide unwritten outputs).
Status fill_random_bf16(void* data, size_t count, uint64_t seed, float scale, cudaStream_t stream);
// Fills `count` bytes with random e4m3 codes, a hash of (seed, index), never NaN.
Status fill_random_e4m3(void* data, size_t count, uint64_t seed, cudaStream_t stream);

// Bytes over the measured copy rate, in microseconds.
inline double floor_us(const Context& ctx, double bytes) { return bytes / (ctx.copy_GBps * 1e3); }

}  // namespace dsa::bench
