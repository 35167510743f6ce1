#include "timing.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/numerics.h"

namespace dsa::bench {

namespace {

constexpr int kMaxColdCopies = 64;   // beyond this the input set is tiny and the rotation only costs memory
constexpr int kWarmupReplays = 3;    // first replay uploads the graph; the next ones settle clocks
constexpr int kQuickReplays = 5;
constexpr int kCopyWarmups = 2;
constexpr int kCopySamples = 9;

// Owner of CUDA events, so that every early error return releases them.
struct EventSequence {
  std::vector<cudaEvent_t> events;
  ~EventSequence() {
    for (cudaEvent_t event : events) cudaEventDestroy(event);
  }
  Status create(int count) {
    for (int i = 0; i < count; ++i) {
      cudaEvent_t event = nullptr;
      DSA_CUDA_RETURN(cudaEventCreate(&event));
      events.push_back(event);
    }
    return Status();
  }
  // Milliseconds between consecutive events, once all have completed.
  Status intervals_ms(std::vector<float>* out) const {
    out->clear();
    for (size_t i = 0; i + 1 < events.size(); ++i) {
      float ms = 0;
      DSA_CUDA_RETURN(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
      out->push_back(ms);
    }
    return Status();
  }
};

double median(std::vector<float> samples) {
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  if (n % 2 == 1) return samples[n / 2];
  return 0.5 * (static_cast<double>(samples[n / 2 - 1]) + samples[n / 2]);
}

// splitmix64's output function: a well-mixed 64-bit hash of the index.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random e4m3 codes from a hash of (seed, index), never NaN (0x7F / 0xFF
// become +-448): NaN would turn every output into NaN.
__global__ void fill_random_e4m3_kernel(uint8_t* data, size_t count, uint64_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint8_t code = static_cast<uint8_t>(mix64(seed + (i + 1) * 0x9E3779B97F4A7C15ull));
    data[i] = (code & 0x7F) == 0x7F ? code - 1 : code;
  }
}

__global__ void fill_random_bf16_kernel(uint16_t* data, size_t count, uint64_t seed, float scale) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t bits = mix64(seed + (i + 1) * 0x9E3779B97F4A7C15ull);
    const float unit = static_cast<float>(bits >> 40) * 0x1p-24f;  // [0, 1)
    data[i] = num::float_to_bf16((2.0f * unit - 1.0f) * scale);
  }
}


}  // namespace

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// Integers as integers (params such as H, m, bytes); others to 6 significant
// digits, well past the run-to-run spread; JSON has no NaN or infinity.
std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(text, sizeof(text), "%.0f", value);
  } else {
    std::snprintf(text, sizeof(text), "%.6g", value);
  }
  return text;
}

std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[16];
  std::strftime(text, sizeof(text), "%Y-%m-%d", &utc);
  return text;
}

Status open_context(cudaStream_t stream, bool quick, Context* ctx) {
  DSA_CUDA_RETURN(cudaSetDevice(0));
  cudaDeviceProp prop{};
  DSA_CUDA_RETURN(cudaGetDeviceProperties(&prop, 0));
  ctx->stream = stream;
  ctx->gpu_name = prop.name;
  ctx->sm_count = prop.multiProcessorCount;
  ctx->l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  const char* commit = std::getenv("DSA_COMMIT");
  ctx->commit = commit != nullptr && commit[0] != '\0' ? commit : "unknown";
  ctx->date = utc_date();
  ctx->quick = quick;
  return measure_copy_GBps(stream, kCopyProbeBytes, &ctx->copy_GBps);
}

// ---------------------------------------------------------------- memory

DeviceMemory::DeviceMemory(DeviceMemory&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

DeviceMemory& DeviceMemory::operator=(DeviceMemory&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

DeviceMemory::~DeviceMemory() {
  if (data_ != nullptr) cudaFree(data_);
}

Status DeviceMemory::allocate(size_t bytes) {
  void* held = std::exchange(data_, nullptr);
  bytes_ = 0;
  if (held != nullptr) DSA_CUDA_RETURN(cudaFree(held));
  DSA_CUDA_RETURN(cudaMalloc(&data_, bytes));
  bytes_ = bytes;
  return Status();
}

Status fill_random_bf16(void* data, size_t count, uint64_t seed, float scale, cudaStream_t stream) {
  if (count == 0) return Status();
  if (data == nullptr) return invalid_argument("data", "a device pointer", "null");
  constexpr int kThreads = 256;
  const size_t blocks = std::min<size_t>((count + kThreads - 1) / kThreads, 4096);
  fill_random_bf16_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<uint16_t*>(data),
                                                                                  count, seed, scale);
  DSA_CUDA_RETURN(cudaGetLastError());
  return Status();
}

Status fill_random_e4m3(void* data, size_t count, uint64_t seed, cudaStream_t stream) {
  if (count == 0) return Status();
  if (data == nullptr) return invalid_argument("data", "a device pointer", "null");
  fill_random_e4m3_kernel<<<4096, 256, 0, stream>>>(static_cast<uint8_t*>(data), count, seed);
  DSA_CUDA_RETURN(cudaGetLastError());
  return Status();
}

// ---------------------------------------------------------------- timing

int cold_copies(const Context& ctx, size_t bytes) {
  if (bytes == 0) return 1;
  const size_t copies = (2 * ctx.l2_bytes + bytes - 1) / bytes;
  return static_cast<int>(std::clamp<size_t>(copies, 1, kMaxColdCopies));
}

CapturedGraph::~CapturedGraph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
}

Status CapturedGraph::capture(cudaStream_t stream, const std::function<Status()>& enqueue) {
  if (graph_ != nullptr) return invalid_argument("CapturedGraph", "a graph not yet captured", "one captured before");
  DSA_CUDA_RETURN(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status enqueued = enqueue();
  // End the capture even after a failed enqueue, so the stream stays usable.
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph_);
  DSA_RETURN_IF_ERROR(enqueued);
  DSA_RETURN_IF_ERROR(cuda_status(ended, "cudaStreamEndCapture"));
  DSA_CUDA_RETURN(cudaGetLastError());
  DSA_CUDA_RETURN(cudaGraphInstantiate(&exec_, graph_, 0));
  return Status();
}

Status CapturedGraph::launch(cudaStream_t stream) const {
  if (exec_ == nullptr) return invalid_argument("CapturedGraph", "a captured graph", "none captured");
  DSA_CUDA_RETURN(cudaGraphLaunch(exec_, stream));
  return Status();
}

Status time_graph(const Context& ctx, const Enqueue& enqueue, double* median_us, int per_graph, int replays) {
  if (median_us == nullptr) return invalid_argument("median_us", "a result pointer", "null");
  if (!enqueue) return invalid_argument("enqueue", "a function", "empty");
  if (per_graph < 1) return invalid_argument("per_graph", ">= 1", std::to_string(per_graph));
  if (replays < 1) return invalid_argument("replays", ">= 1", std::to_string(replays));
  if (ctx.stream == nullptr) {
    return invalid_argument("ctx.stream", "a created stream (the legacy default stream cannot be captured)", "null");
  }
  if (ctx.quick) replays = std::min(replays, kQuickReplays);
  const cudaStream_t stream = ctx.stream;
  // An error left by earlier code would otherwise be blamed on this capture.
  DSA_CUDA_RETURN(cudaGetLastError());
  auto enqueue_all = [&]() -> Status {
    for (int i = 0; i < per_graph; ++i) DSA_RETURN_IF_ERROR(enqueue(stream, i));
    return Status();
  };

  // One eager pass outside capture: loads modules, lets cuBLAS settle its
  // heuristics, and reports a bad launch with its own error, not as a
  // spoiled capture.
  DSA_RETURN_IF_ERROR(enqueue_all());
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaGetLastError());

  // Thread-local mode: a benchmark that allocates or synchronizes inside
  // enqueue fails loudly instead of being timed wrong; cuBLAS with an explicit
  // workspace (cublas_bmm.h) does neither.
  CapturedGraph graph;
  DSA_RETURN_IF_ERROR(graph.capture(stream, enqueue_all));
  for (int i = 0; i < kWarmupReplays; ++i) DSA_RETURN_IF_ERROR(graph.launch(stream));

  // Replays back to back, an event between each two: the device never idles
  // between samples, and one synchronization ends the run.
  EventSequence events;
  DSA_RETURN_IF_ERROR(events.create(replays + 1));
  DSA_CUDA_RETURN(cudaEventRecord(events.events[0], stream));
  for (int r = 0; r < replays; ++r) {
    DSA_RETURN_IF_ERROR(graph.launch(stream));
    DSA_CUDA_RETURN(cudaEventRecord(events.events[r + 1], stream));
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaGetLastError());

  std::vector<float> replay_ms;
  DSA_RETURN_IF_ERROR(events.intervals_ms(&replay_ms));
  *median_us = median(replay_ms) * 1e3 / per_graph;
  return Status();
}

Status measure_copy_GBps(cudaStream_t stream, size_t bytes, double* GBps) {
  if (GBps == nullptr) return invalid_argument("GBps", "a result pointer", "null");
  if (bytes == 0) return invalid_argument("bytes", ">= 1", "0");
  DeviceMemory source;
  DeviceMemory destination;
  DSA_RETURN_IF_ERROR(source.allocate(bytes));
  DSA_RETURN_IF_ERROR(destination.allocate(bytes));
  // Defined contents, so that memory checkers see no read of uninitialized memory.
  DSA_CUDA_RETURN(cudaMemsetAsync(source.get(), 0x5A, bytes, stream));
  for (int i = 0; i < kCopyWarmups; ++i) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(destination.get(), source.get(), bytes, cudaMemcpyDeviceToDevice, stream));
  }
  EventSequence events;
  DSA_RETURN_IF_ERROR(events.create(kCopySamples + 1));
  DSA_CUDA_RETURN(cudaEventRecord(events.events[0], stream));
  for (int i = 0; i < kCopySamples; ++i) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(destination.get(), source.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    DSA_CUDA_RETURN(cudaEventRecord(events.events[i + 1], stream));
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  std::vector<float> copy_ms;
  DSA_RETURN_IF_ERROR(events.intervals_ms(&copy_ms));
  // Every byte is read once and written once.
  *GBps = 2.0 * static_cast<double>(bytes) / (median(copy_ms) * 1e-3) / 1e9;
  return Status();
}

}  // namespace dsa::bench
