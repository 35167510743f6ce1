#include "serve_run.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <unordered_set>

#include "core/device_memory.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/stage.h"
#include "dsa_decode/stock.h"
#include "serve_check.h"
#include "serve_model.h"
#include "serve_parallel.h"
#include "serve_state.h"
#include "tools/synthetic_layer.h"

namespace dsa::serve {

void ServeReport::fail(const std::string& what) {
  ++mismatches;
  if (failures.size() < 20) failures.push_back(what);
}

namespace {

std::atomic<bool> stop_flag{false};
static_assert(std::atomic<bool>::is_always_lock_free, "request_serve_stop sets it from a signal handler");
bool stop_requested() { return stop_flag.load(std::memory_order_relaxed); }

// Device memory held for the whole run: everything is allocated at start-up.
// The library's owner (core/device_memory.h) frees it; this adds the size
// and an error that names the buffer.
class DeviceBytes {
 public:
  Status allocate(size_t bytes, const char* name) {
    void* data = nullptr;
    const cudaError_t e = cudaMalloc(&data, std::max<size_t>(bytes, 16));
    if (e != cudaSuccess) {
      memory_.reset();
      return cuda_status(e, (std::string("cudaMalloc of ") + name + " (" + std::to_string(bytes) + " bytes)").c_str());
    }
    memory_.reset(data);
    bytes_ = bytes;
    return Status();
  }
  template <class T = void>
  T* as() const {
    return static_cast<T*>(memory_.get());
  }
  size_t bytes() const { return bytes_; }

 private:
  DeviceMemory memory_;
  size_t bytes_ = 0;
};

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// About normal(0, 1) (the sum of three uniforms on [-1, 1), 10 bits each),
// as BF16: two values from one hash of the key and the pair's index.
uint16_t draw_bf16(uint64_t hash, int half) {
  const uint64_t bits = hash >> (30 * half);
  float sum = 0;
  for (int i = 0; i < 3; ++i) sum += float((bits >> (10 * i)) & 0x3FF) / float(1 << 9) - 1.0f;
  return num::float_to_bf16(sum);
}

// out[i] for i in [begin, end): a function of (key, i) alone, whatever the split.
void fill_bf16_range(uint16_t* out, size_t begin, size_t end, uint64_t key) {
  for (size_t i = begin; i < end; ++i) out[i] = draw_bf16(mix(key + (i >> 1) * 0x9E3779B97F4A7C15ull), int(i & 1));
}

void fill_bf16(uint16_t* out, size_t count, uint64_t key, int threads = 1) {
  // Parts of 4096 values: a prompt of 128k tokens fills 100M of them.
  parallel_for(int64_t(count), 4096, count >= (size_t{1} << 20) ? threads : 1,
               [&](int64_t begin, int64_t end) { fill_bf16_range(out, size_t(begin), size_t(end), key); });
}

template <class T>
Status upload(const std::vector<T>& host, void* device, cudaStream_t stream, const char* name) {
  if (host.empty()) return Status();
  DSA_CUDA_RETURN(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  (void)name;
  return Status();
}

template <class T>
Status download(const TensorView& v, std::vector<T>* out, cudaStream_t stream, const char* name) {
  if (!v.is_contiguous()) {
    return unsupported(std::string("dsa-serve reads the stage's ") + name + " as contiguous; it is " + v.describe());
  }
  out->resize(size_t(v.numel()));
  if (out->empty()) return Status();
  DSA_CUDA_RETURN(cudaMemcpyAsync(out->data(), v.data, out->size() * sizeof(T), cudaMemcpyDeviceToHost, stream));
  return Status();
}

TensorView view(const DeviceBytes& b, DType dtype, std::initializer_list<int64_t> shape) {
  return make_tensor(b.as(), dtype, shape);
}

// What the model and the sampled checks need of a clean run.
struct StepData {
  std::vector<uint16_t> kv_c, index_q, index_k, gate;  // [m, L], [m, 32, 128], [m, 128], [m, 128]
  std::vector<float> head_weights;                      // [m, 32]
  std::vector<uint8_t> q_fp8;                           // [m, H, L]
  std::vector<std::vector<float>> logits;               // per token: its logits row (sampled tokens only)
};

class Server {
 public:
  Server(const ServeOptions& o, ServeReport* report, std::chrono::steady_clock::time_point started)
      : o_(o), report_(report), started_(started) {}
  ~Server() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Status init();
  Status run();

 private:
  Status upload_weights();
  Status prefill(const ServeRequest& r);
  Status prefill_device(int64_t n, int row, unsigned int* errors);
  Status warm_up_prefill();
  void write_progress();
  Status run_once(DsaPath path, const StepInputs& in, const std::vector<int>& samples, StepResult* result,
                  StepData* data);
  Status caller_rows_prepare(int m, StepData* data);
  Status warm_up();
  Status check_state(const char* when);
  Status check_memory();
  Status finish(int64_t serial, bool served);
  std::vector<int32_t> caller_row(const StepBatch& b, int t, std::mt19937_64& rng) const;
  void check_step(const StepBatch& b, const StepInputs& in, bool caller_rows, const std::vector<int>& samples,
                  const StepResult& r, const StepData& d, const reference::IndexerStepHost& step,
                  const reference::IndexerQueryHost& query, std::mt19937_64& rng);

  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  }

  const ServeOptions o_;
  ServeReport* report_;
  const std::chrono::steady_clock::time_point started_;
  cudaStream_t stream_ = nullptr;
  cli::StepShape shape_{};
  cli::HostWeights host_;
  DsaLayerConfig config_;
  DsaStagePlan plan_;
  IndexerPlan iplan_;
  ServeGeometry g_;
  int64_t page_bytes_ = 0;
  int row_width_ = 0;  // indexer_row_width(iplan_): the top-k rows' columns
  std::unique_ptr<Scheduler> sched_;
  StateModel model_;
  std::unique_ptr<DsaAttentionStage> stage_;
  // Weights.
  std::vector<std::unique_ptr<DeviceBytes>> weight_buffers_;
  DsaLayerWeights weights_;
  // The shared state and the step's buffers.
  DeviceBytes kv_, pages_, ring_, table_, hidden_, positions_, requests_, slots_, out_, topk_, errors_;
  // Prefill staging and the caller-rows prepare.
  DeviceBytes prefill_kv_, prefill_k_, prefill_gate_, prefill_slots_;
  DeviceBytes index_q_, index_k_, head_weights_, gate_, indexer_workspace_;
  // Host mirrors of the GPU state for the whole-state check.
  std::vector<uint8_t> gpu_kv_, gpu_pages_;
  std::vector<uint16_t> gpu_ring_;
  size_t free_at_start_ = 0, least_free_ = 0;
  const int threads_ = host_threads();
};

// Draft tokens a step may carry beside a request's next token (MTP's 4):
// the ring is sized for them (indexer_ring_for).
constexpr int kMaxDraftTokens = 4;

enum ErrorWord { kStepErrors = 0, kPrepareErrors = 1, kPrefillErrors = 2, kErrorWords = 4 };

Status Server::upload_weights() {
  const auto add = [&](const void* host, size_t bytes, DType dtype, std::initializer_list<int64_t> shape,
                       TensorView* field, const char* name) -> Status {
    weight_buffers_.push_back(std::make_unique<DeviceBytes>());
    DSA_RETURN_IF_ERROR(weight_buffers_.back()->allocate(bytes, name));
    DSA_CUDA_RETURN(cudaMemcpy(weight_buffers_.back()->as(), host, bytes, cudaMemcpyHostToDevice));
    *field = make_tensor(weight_buffers_.back()->as(), dtype, shape);
    return Status();
  };
  const cli::StepShape& s = shape_;
  const cli::HostWeights& w = host_;
  const int64_t D = s.D, H = s.H, Q = s.Q, L = s.L, P = s.P, V = s.V;
  DsaLayerWeights& v = weights_;
  const auto bf16 = [](const std::vector<uint16_t>& x) { return x.size() * sizeof(uint16_t); };
  const auto f32 = [](const std::vector<float>& x) { return x.size() * sizeof(float); };
  DSA_RETURN_IF_ERROR(add(w.fused_qkv_a_proj.data(), bf16(w.fused_qkv_a_proj), DType::kBF16, {Q + L, D},
                          &v.fused_qkv_a_proj, "fused_qkv_a_proj"));
  DSA_RETURN_IF_ERROR(add(w.q_norm_gamma.data(), bf16(w.q_norm_gamma), DType::kBF16, {Q}, &v.q_a_norm, "q_a_norm"));
  DSA_RETURN_IF_ERROR(add(w.kv_norm_gamma.data(), bf16(w.kv_norm_gamma), DType::kBF16, {L}, &v.kv_a_norm, "kv_a_norm"));
  DSA_RETURN_IF_ERROR(add(w.q_b_proj.data(), bf16(w.q_b_proj), DType::kBF16, {H * P, Q}, &v.q_b_proj, "q_b_proj"));
  DSA_RETURN_IF_ERROR(add(w.w_uk_t.data(), bf16(w.w_uk_t), DType::kBF16, {H, P, L}, &v.w_uk_t, "w_uk_t"));
  DSA_RETURN_IF_ERROR(add(w.w_uv.data(), bf16(w.w_uv), DType::kBF16, {H, L, V}, &v.w_uv, "w_uv"));
  DSA_RETURN_IF_ERROR(add(w.o_proj.data(), bf16(w.o_proj), DType::kBF16, {D, H * V}, &v.o_proj, "o_proj"));
  DSA_RETURN_IF_ERROR(add(&w.q_scale, sizeof(float), DType::kF32, {1}, &v.q_scale, "q_scale"));
  DSA_RETURN_IF_ERROR(add(&w.k_scale, sizeof(float), DType::kF32, {1}, &v.k_scale, "k_scale"));
  DSA_RETURN_IF_ERROR(add(w.index_wq_b.data(), bf16(w.index_wq_b), DType::kBF16,
                          {int64_t{iplan_.heads} * kIndexerDim, Q}, &v.index_wq_b, "index_wq_b"));
  DSA_RETURN_IF_ERROR(add(w.index_wk.data(), bf16(w.index_wk), DType::kBF16, {kIndexerDim, D}, &v.index_wk, "index_wk"));
  DSA_RETURN_IF_ERROR(add(w.index_weights_proj.data(), bf16(w.index_weights_proj), DType::kBF16, {iplan_.heads, D},
                          &v.index_weights_proj, "index_weights_proj"));
  DSA_RETURN_IF_ERROR(add(w.index_compress_gate.data(), bf16(w.index_compress_gate), DType::kBF16, {kIndexerDim, D},
                          &v.index_compress_gate, "index_compress_gate"));
  DSA_RETURN_IF_ERROR(add(w.index_k_norm_weight.data(), f32(w.index_k_norm_weight), DType::kF32, {kIndexerDim},
                          &v.index_k_norm_weight, "index_k_norm_weight"));
  DSA_RETURN_IF_ERROR(add(w.index_k_norm_bias.data(), f32(w.index_k_norm_bias), DType::kF32, {kIndexerDim},
                          &v.index_k_norm_bias, "index_k_norm_bias"));
  DSA_RETURN_IF_ERROR(add(w.index_ape.data(), f32(w.index_ape), DType::kF32, {iplan_.pool, kIndexerDim},
                          &v.index_ape, "index_ape"));
  return Status();
}

Status Server::init() {
  ModelPreset preset{}, rank{};
  DSA_RETURN_IF_ERROR(find_preset("glm5next", &preset));
  DSA_RETURN_IF_ERROR(per_rank(preset, o_.tp, &rank));
  if (o_.index_heads || o_.index_pool || o_.index_topk) {
    DSA_RETURN_IF_ERROR(with_indexer_shape(rank, o_.index_heads ? o_.index_heads : rank.index_heads,
                                           o_.index_pool ? o_.index_pool : rank.pool_size,
                                           o_.index_topk ? o_.index_topk : rank.topk, &rank));
  }
  shape_ = cli::make_step_shape(rank, 1, 0);
  host_ = cli::make_weights(shape_, o_.seed);
  config_ = dsa_layer_config(rank, host_.eps);
  plan_ = dsa_stage_plan_for(rank);
  DSA_RETURN_IF_ERROR(check_dsa_stage_indexer_shape(plan_));
  plan_.max_tokens = kDsaStageMaxTokens;
  plan_.max_context = o_.max_context;
  plan_.block_size = 256;
  plan_.batch_invariant = o_.batch_invariant;
  // The drafts' RING (twice the pool): several tokens of a request per step.
  plan_.ring = indexer_ring_for(dsa_stage_indexer_plan(plan_).pool, kMaxDraftTokens + 1);
  iplan_ = dsa_stage_indexer_plan(plan_);
  DSA_RETURN_IF_ERROR(check_indexer_plan(iplan_));
  row_width_ = indexer_row_width(iplan_);
  g_.block_size = plan_.block_size;
  g_.max_context = plan_.max_context;
  g_.blocks = o_.blocks > 0 ? o_.blocks : 3 * (o_.max_context / plan_.block_size) + 64;
  g_.rows = o_.rows;
  g_.ring = plan_.ring;
  g_.tokens_per_request = indexer_tokens_per_request(iplan_);
  g_.max_tokens = plan_.max_tokens;
  DSA_RETURN_IF_ERROR(check_geometry(g_));
  page_bytes_ = indexer_page_bytes(iplan_);
  report_->blocks = g_.blocks;
  report_->heads = shape_.H;
  sched_ = std::make_unique<Scheduler>(g_, o_.seed ^ 0x5EEDull);
  IndexerParams params{host_.index_k_norm_weight, host_.index_k_norm_bias, host_.index_ape};
  DSA_RETURN_IF_ERROR(model_.init(g_, shape_.L, iplan_, host_.k_scale, std::move(params)));

  int device = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  DSA_CUDA_RETURN(cudaGetDeviceProperties(&prop, device));
  report_->gpu = prop.name;
  DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DSA_RETURN_IF_ERROR(upload_weights());

  const size_t L = size_t(shape_.L), D = size_t(shape_.D), M = size_t(plan_.max_tokens);
  DSA_RETURN_IF_ERROR(kv_.allocate(size_t(g_.blocks) * g_.block_size * L, "kv_cache"));
  DSA_RETURN_IF_ERROR(pages_.allocate(size_t(g_.blocks) * size_t(page_bytes_), "indexer k_cache"));
  DSA_RETURN_IF_ERROR(ring_.allocate(size_t(g_.rows) * size_t(model_.ring_row_elements()) * 2, "ring"));
  DSA_RETURN_IF_ERROR(table_.allocate(size_t(g_.rows) * size_t(g_.width()) * 4, "block_table"));
  DSA_RETURN_IF_ERROR(hidden_.allocate(M * D * 2, "hidden"));
  DSA_RETURN_IF_ERROR(positions_.allocate(M * 8, "positions"));
  DSA_RETURN_IF_ERROR(requests_.allocate(M * 4, "token_requests"));
  DSA_RETURN_IF_ERROR(slots_.allocate((M + size_t(g_.max_extra_slots)) * 8, "slot_mapping"));
  DSA_RETURN_IF_ERROR(out_.allocate(M * D * 2, "out"));
  DSA_RETURN_IF_ERROR(topk_.allocate(M * row_width_ * 4, "topk_positions"));
  DSA_RETURN_IF_ERROR(errors_.allocate(kErrorWords * sizeof(unsigned int), "error words"));
  const size_t n = size_t(g_.max_context);
  DSA_RETURN_IF_ERROR(prefill_kv_.allocate(n * L * 2, "prefill kv rows"));
  DSA_RETURN_IF_ERROR(prefill_k_.allocate(n * kIndexerDim * 2, "prefill index_k"));
  DSA_RETURN_IF_ERROR(prefill_gate_.allocate(n * kIndexerDim * 2, "prefill gate"));
  DSA_RETURN_IF_ERROR(prefill_slots_.allocate(n * 8, "prefill slot_mapping"));
  DSA_RETURN_IF_ERROR(index_q_.allocate(M * iplan_.heads * kIndexerDim * 2, "index_q"));
  DSA_RETURN_IF_ERROR(index_k_.allocate(M * kIndexerDim * 2, "index_k"));
  DSA_RETURN_IF_ERROR(head_weights_.allocate(M * iplan_.heads * 4, "head_weights"));
  DSA_RETURN_IF_ERROR(gate_.allocate(M * kIndexerDim * 2, "gate"));
  DSA_RETURN_IF_ERROR(indexer_workspace_.allocate(size_t(indexer_workspace_layout(iplan_).bytes), "indexer workspace"));
  // The state starts zeroed, as the model's.
  for (DeviceBytes* b : {&kv_, &pages_, &ring_, &errors_}) DSA_CUDA_RETURN(cudaMemset(b->as(), 0, b->bytes()));
  DSA_CUDA_RETURN(cudaMemset(table_.as(), 0xFF, table_.bytes()));  // -1: no block
  gpu_kv_.assign(model_.kv().size(), 0);
  gpu_pages_.assign(model_.pages().size(), 0);
  gpu_ring_.assign(model_.ring().size(), 0);

  const Status created = DsaAttentionStage::create(config_, weights_, plan_, &stage_);
  if (!created.ok()) return Status(created.code(), "creating the stage: " + created.message());
  DSA_CUDA_RETURN(cudaDeviceSynchronize());
  return Status();
}

// The prefill of r's prompt: cache entries through stock_concat_and_cache_mla
// and the indexer's prefill, on drawn rows unique to the request.
Status Server::prefill(const ServeRequest& r) {
  DSA_CUDA_RETURN(cudaMemcpyAsync(table_.as(), sched_->table().entries().data(), table_.bytes(),
                                  cudaMemcpyHostToDevice, stream_));
  if (r.prompt == 0) return Status();
  const int64_t n = r.prompt, L = shape_.L;
  std::vector<uint16_t> kv(size_t(n) * size_t(L)), k(size_t(n) * kIndexerDim), gate(size_t(n) * kIndexerDim);
  const uint64_t key = mix(o_.seed) ^ mix(uint64_t(r.serial) * 3 + 1);
  fill_bf16(kv.data(), kv.size(), key ^ 0x1, threads_);
  fill_bf16(k.data(), k.size(), key ^ 0x2, threads_);
  fill_bf16(gate.data(), gate.size(), key ^ 0x3, threads_);
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int64_t p = 0; p < n; ++p) slots[size_t(p)] = r.slot(p, g_.block_size);
  DSA_RETURN_IF_ERROR(upload(kv, prefill_kv_.as(), stream_, "prefill kv"));
  DSA_RETURN_IF_ERROR(upload(k, prefill_k_.as(), stream_, "prefill index_k"));
  DSA_RETURN_IF_ERROR(upload(gate, prefill_gate_.as(), stream_, "prefill gate"));
  DSA_RETURN_IF_ERROR(upload(slots, prefill_slots_.as(), stream_, "prefill slots"));
  unsigned int errors = 0;
  DSA_RETURN_IF_ERROR(prefill_device(n, r.row, &errors));
  if (errors != 0) report_->fail("prefill of request " + std::to_string(r.serial) + " counted " + std::to_string(errors) + " errors");
  DSA_RETURN_IF_ERROR(model_.prefill(r, sched_->table().entries(), kv.data(), k.data(), gate.data(), threads_));
  report_->prefill_tokens += n;
  report_->longest_prompt = std::max(report_->longest_prompt, n);
  return Status();
}

// The prefill's launches over the staged rows and slots: n tokens of block
// table row `row`; *errors: the error word they left.
Status Server::prefill_device(int64_t n, int row, unsigned int* errors) {
  const int64_t L = shape_.L;
  unsigned int* words = errors_.as<unsigned int>();
  DSA_CUDA_RETURN(cudaMemsetAsync(words + kPrefillErrors, 0, sizeof(unsigned int), stream_));
  KvCacheWrite write;
  write.kv = view(prefill_kv_, DType::kBF16, {n, L});
  write.cache = view(kv_, DType::kFP8E4M3, {g_.blocks, g_.block_size, L});
  write.slot_mapping = view(prefill_slots_, DType::kI64, {n});
  write.k_scale = weights_.k_scale;
  write.error_count = words + kPrefillErrors;
  DSA_RETURN_IF_ERROR(stock_concat_and_cache_mla(write, stream_));
  IndexerPrefillArgs a;
  a.plan = iplan_;
  a.index_k = view(prefill_k_, DType::kBF16, {n, kIndexerDim});
  a.gate = view(prefill_gate_, DType::kBF16, {n, kIndexerDim});
  a.k_norm_weight = weights_.index_k_norm_weight;
  a.k_norm_bias = weights_.index_k_norm_bias;
  a.ape = weights_.index_ape;
  a.request = row;
  a.state = IndexerState{view(table_, DType::kI32, {g_.rows, g_.width()}),
                         view(ring_, DType::kBF16, {g_.rows, 2, g_.ring, kIndexerDim}),
                         view(pages_, DType::kU8, {g_.blocks, page_bytes_})};
  a.error_count = words + kPrefillErrors;
  DSA_RETURN_IF_ERROR(indexer_prefill(a, stream_));
  DSA_CUDA_RETURN(cudaMemcpyAsync(errors, words + kPrefillErrors, sizeof(*errors), cudaMemcpyDeviceToHost, stream_));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status();
}

// The prefill's kernels once before the memory baseline (a kernel's first
// launch may grow the context's local memory, which cudaMemGetInfo sees): two
// blocks of tokens on row 0 while no request holds a block (its table row is
// -1) with slots of -1, so no cache entry or page is written (the pool
// writes are skipped and counted, which is checked); only row 0's ring is,
// whose rows every later owner writes before any check reads them.
Status Server::warm_up_prefill() {
  if (!sched_->live().empty()) return unsupported("the prefill's warm-up runs before any request is admitted");
  const int64_t n = 2 * int64_t{g_.block_size};
  std::vector<uint16_t> kv(size_t(n) * size_t(shape_.L)), k(size_t(n) * kIndexerDim), gate(size_t(n) * kIndexerDim);
  fill_bf16(kv.data(), kv.size(), mix(o_.seed ^ 0xF111));
  fill_bf16(k.data(), k.size(), mix(o_.seed ^ 0xF112));
  fill_bf16(gate.data(), gate.size(), mix(o_.seed ^ 0xF113));
  const std::vector<int64_t> slots(size_t(n), -1);
  DSA_CUDA_RETURN(cudaMemcpyAsync(table_.as(), sched_->table().entries().data(), table_.bytes(),
                                  cudaMemcpyHostToDevice, stream_));
  DSA_RETURN_IF_ERROR(upload(kv, prefill_kv_.as(), stream_, "prefill kv"));
  DSA_RETURN_IF_ERROR(upload(k, prefill_k_.as(), stream_, "prefill index_k"));
  DSA_RETURN_IF_ERROR(upload(gate, prefill_gate_.as(), stream_, "prefill gate"));
  DSA_RETURN_IF_ERROR(upload(slots, prefill_slots_.as(), stream_, "prefill slots"));
  unsigned int errors = 0;
  DSA_RETURN_IF_ERROR(prefill_device(n, 0, &errors));
  if (errors == 0) report_->fail("warm-up prefill over a row of -1 blocks: the error word did not count the skipped pools");
  return Status();
}

Status Server::run_once(DsaPath path, const StepInputs& in, const std::vector<int>& samples, StepResult* r,
                        StepData* d) {
  const int m = int(in.positions.size());
  const int64_t n = int64_t(in.slot_mapping.size()), D = shape_.D;
  DSA_RETURN_IF_ERROR(upload(in.hidden, hidden_.as(), stream_, "hidden"));
  DSA_RETURN_IF_ERROR(upload(in.positions, positions_.as(), stream_, "positions"));
  DSA_RETURN_IF_ERROR(upload(in.token_requests, requests_.as(), stream_, "token_requests"));
  DSA_RETURN_IF_ERROR(upload(in.slot_mapping, slots_.as(), stream_, "slot_mapping"));
  DSA_RETURN_IF_ERROR(upload(in.table, table_.as(), stream_, "block_table"));
  DSA_RETURN_IF_ERROR(upload(in.topk, topk_.as(), stream_, "topk_positions"));
  unsigned int* words = errors_.as<unsigned int>();
  DSA_CUDA_RETURN(cudaMemsetAsync(words + kStepErrors, 0, sizeof(unsigned int), stream_));
  DSA_CUDA_RETURN(cudaMemsetAsync(out_.as(), 0xFF, size_t(m) * size_t(D) * 2, stream_));  // NaN: unwritten shows
  DsaStepArgs a;
  a.hidden = view(hidden_, DType::kBF16, {m, D});
  a.positions = view(positions_, DType::kI64, {m});
  a.token_requests = view(requests_, DType::kI32, {m});
  a.slot_mapping = view(slots_, DType::kI64, {n});
  a.kv_cache = view(kv_, DType::kFP8E4M3, {g_.blocks, g_.block_size, shape_.L});
  a.indexer = IndexerState{view(table_, DType::kI32, {g_.rows, g_.width()}),
                           view(ring_, DType::kBF16, {g_.rows, 2, g_.ring, kIndexerDim}),
                           view(pages_, DType::kU8, {g_.blocks, page_bytes_})};
  if (!in.topk.empty()) a.topk_positions = view(topk_, DType::kI32, {m, row_width_});
  a.out = view(out_, DType::kBF16, {m, D});
  a.error_count = words + kStepErrors;
  const Status ran = path == DsaPath::kFused ? stage_->forward(a, stream_) : stage_->stock_forward(a, stream_);
  if (!ran.ok()) return Status(ran.code(), std::string(path == DsaPath::kFused ? "forward" : "stock_forward") + ": " + ran.message());
  const DsaStageIntermediates x = stage_->intermediates(m);
  r->m = m;
  r->D = D;
  r->H = shape_.H;
  r->latent_width = shape_.L;
  r->row_width = row_width_;
  DSA_RETURN_IF_ERROR(download(a.out, &r->out, stream_, "out"));
  DSA_RETURN_IF_ERROR(download(x.latent, &r->latent, stream_, "latent"));
  DSA_RETURN_IF_ERROR(download(x.lse, &r->lse, stream_, "lse"));
  DSA_RETURN_IF_ERROR(download(x.slots, &r->slots, stream_, "slots"));
  DSA_CUDA_RETURN(cudaMemcpyAsync(&r->errors, words + kStepErrors, sizeof(unsigned int), cudaMemcpyDeviceToHost, stream_));
  if (d != nullptr) {
    DSA_RETURN_IF_ERROR(download(x.kv_c, &d->kv_c, stream_, "kv_c"));
    DSA_RETURN_IF_ERROR(download(x.q_fp8, &d->q_fp8, stream_, "q_fp8"));
    d->logits.assign(size_t(m), {});
    if (in.topk.empty()) {
      DSA_RETURN_IF_ERROR(download(x.index_q, &d->index_q, stream_, "index_q"));
      DSA_RETURN_IF_ERROR(download(x.index_k, &d->index_k, stream_, "index_k"));
      DSA_RETURN_IF_ERROR(download(x.head_weights, &d->head_weights, stream_, "head_weights"));
      DSA_RETURN_IF_ERROR(download(x.gate, &d->gate, stream_, "gate"));
      for (int t : samples) {
        const int64_t pools = (in.positions[size_t(t)] + 1) / iplan_.pool;
        if (in.positions[size_t(t)] + 1 <= iplan_.topk) continue;
        if (pools > x.index_logits.size(1)) return unsupported("the stage's index_logits hold fewer pools than a token's");
        d->logits[size_t(t)].resize(size_t(pools));
        DSA_CUDA_RETURN(cudaMemcpyAsync(d->logits[size_t(t)].data(),
                                        x.index_logits.ptr<float>() + size_t(t) * size_t(x.index_logits.stride(0)),
                                        size_t(pools) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      }
    }
  }
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status();
}

// A caller-rows step runs no indexer: the engine's prepare of its tokens
// (projections as one GEMV launch, then indexer_prepare), as after a draft step.
Status Server::caller_rows_prepare(int m, StepData* d) {
  const DsaStageIntermediates x = stage_->intermediates(m);
  IndexerProjectArgs p;
  p.plan = iplan_;
  p.q_c = x.q_c;
  p.x = view(hidden_, DType::kBF16, {m, shape_.D});
  p.wq_b = weights_.index_wq_b;
  p.wk = weights_.index_wk;
  p.weights_proj = weights_.index_weights_proj;
  p.compress_gate = weights_.index_compress_gate;
  p.index_q = view(index_q_, DType::kBF16, {m, iplan_.heads, kIndexerDim});
  p.index_k = view(index_k_, DType::kBF16, {m, kIndexerDim});
  p.head_weights = view(head_weights_, DType::kF32, {m, iplan_.heads});
  p.gate = view(gate_, DType::kBF16, {m, kIndexerDim});
  DSA_RETURN_IF_ERROR(indexer_project_gemv(p, stream_));
  unsigned int* words = errors_.as<unsigned int>();
  DSA_CUDA_RETURN(cudaMemsetAsync(words + kPrepareErrors, 0, sizeof(unsigned int), stream_));
  IndexerPrepareArgs q;
  q.plan = iplan_;
  q.index_q = p.index_q;
  q.index_k = p.index_k;
  q.head_weights = p.head_weights;
  q.gate = p.gate;
  q.k_norm_weight = weights_.index_k_norm_weight;
  q.k_norm_bias = weights_.index_k_norm_bias;
  q.ape = weights_.index_ape;
  q.positions = view(positions_, DType::kI64, {m});
  q.token_requests = view(requests_, DType::kI32, {m});
  q.state = IndexerState{view(table_, DType::kI32, {g_.rows, g_.width()}),
                         view(ring_, DType::kBF16, {g_.rows, 2, g_.ring, kIndexerDim}),
                         view(pages_, DType::kU8, {g_.blocks, page_bytes_})};
  q.workspace = view(indexer_workspace_, DType::kU8, {int64_t(indexer_workspace_.bytes())});
  q.error_count = words + kPrepareErrors;
  DSA_RETURN_IF_ERROR(indexer_prepare(q, stream_));
  DSA_RETURN_IF_ERROR(download(p.index_q, &d->index_q, stream_, "index_q"));
  DSA_RETURN_IF_ERROR(download(p.index_k, &d->index_k, stream_, "index_k"));
  DSA_RETURN_IF_ERROR(download(p.head_weights, &d->head_weights, stream_, "head_weights"));
  DSA_RETURN_IF_ERROR(download(p.gate, &d->gate, stream_, "gate"));
  unsigned int errors = 0;
  DSA_CUDA_RETURN(cudaMemcpyAsync(&errors, words + kPrepareErrors, sizeof(errors), cudaMemcpyDeviceToHost, stream_));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_));
  if (errors != 0) report_->fail("the caller-rows step's indexer_prepare counted " + std::to_string(errors) + " errors");
  return Status();
}

// Steps of padding tokens only, every m on each path, with and without
// caller rows: every kernel runs once before the memory baseline, and
// padding tokens must come out as rows of -1 and zero output.
Status Server::warm_up() {
  std::mt19937_64 rng(o_.seed ^ 0xA11);
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    if ((path == DsaPath::kFused && o_.path == "stock") || (path == DsaPath::kStock && o_.path == "fused")) continue;
    for (int m = 1; m <= plan_.max_tokens; ++m) {
      for (bool caller : {false, true}) {
        StepInputs in;
        in.hidden.resize(size_t(m) * size_t(shape_.D));
        fill_bf16(in.hidden.data(), in.hidden.size(), rng());
        in.positions.assign(size_t(m), 0);
        in.token_requests.assign(size_t(m), -1);
        in.slot_mapping.assign(size_t(m), -1);
        in.table = sched_->table().entries();
        if (caller) in.topk.assign(size_t(m) * row_width_, -1);
        StepResult r;
        StepData d;
        DSA_RETURN_IF_ERROR(run_once(path, in, {}, &r, &d));
        if (caller) DSA_RETURN_IF_ERROR(caller_rows_prepare(m, &d));
        ++report_->warmup_steps;
        if (r.errors != 0) report_->fail("warm-up step of padding tokens counted " + std::to_string(r.errors) + " errors");
        for (int t = 0; t < m; ++t) {
          std::string why;
          if (std::count(&r.slots[size_t(t) * row_width_], &r.slots[size_t(t + 1) * row_width_], -1) !=
              row_width_) {
            why = "its row holds entries other than -1";
          }
          if (why.empty()) empty_result(r, t, &why);
          if (!why.empty()) {
            report_->fail("warm-up (m = " + std::to_string(m) + (caller ? ", caller rows" : "") + "), padding token " +
                          std::to_string(t) + ": " + why);
          }
        }
      }
    }
  }
  return Status();
}

Status Server::check_memory() {
  size_t free = 0, total = 0;
  DSA_CUDA_RETURN(cudaMemGetInfo(&free, &total));
  least_free_ = std::min(least_free_, free);
  report_->memory_delta_bytes = int64_t(free_at_start_) - int64_t(least_free_);
  return Status();
}

Status Server::check_state(const char* when) {
  const std::vector<ServeRequest>& live = sched_->live();
  const size_t block_bytes = size_t(g_.block_size) * size_t(shape_.L);
  std::set<int32_t> blocks;
  for (const ServeRequest& r : live) blocks.insert(r.blocks.begin(), r.blocks.end());
  for (int32_t b : blocks) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(&gpu_kv_[size_t(b) * block_bytes], kv_.as<uint8_t>() + size_t(b) * block_bytes,
                                    block_bytes, cudaMemcpyDeviceToHost, stream_));
  }
  DSA_CUDA_RETURN(cudaMemcpyAsync(gpu_pages_.data(), pages_.as(), pages_.bytes(), cudaMemcpyDeviceToHost, stream_));
  DSA_CUDA_RETURN(cudaMemcpyAsync(gpu_ring_.data(), ring_.as(), ring_.bytes(), cudaMemcpyDeviceToHost, stream_));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream_));
  const StateDiff d = model_.compare(live, sched_->table().entries(), gpu_kv_.data(), gpu_pages_.data(), gpu_ring_.data());
  ++report_->state_checks;
  report_->entries_compared += d.entries;
  report_->pools_compared += d.pools;
  report_->ring_rows_compared += d.ring_rows;
  if (d.mismatches() > 0) {
    report_->fail(std::string("state check ") + when + ": " + std::to_string(d.entry_mismatches) + " KV entries, " +
                  std::to_string(d.pool_mismatches) + " pools, " + std::to_string(d.ring_mismatches) +
                  " ring rows differ from the model; first: " + d.first);
  }
  return check_memory();
}

Status Server::finish(int64_t serial, bool served) {
  std::vector<ServeRequest>& live = sched_->live();
  for (int i = 0; i < int(live.size()); ++i) {
    if (live[size_t(i)].serial != serial) continue;
    model_.release(live[size_t(i)]);
    if (served) ++report_->requests_served;
    return sched_->finish(i);
  }
  return invalid_argument("serial", "a live request", std::to_string(serial));
}

// A caller's top-k row for token t (request-local positions): 0..L-1 for
// L <= 2048, else 2048 distinct positions below L in increasing order.
std::vector<int32_t> Server::caller_row(const StepBatch& b, int t, std::mt19937_64& rng) const {
  std::vector<int32_t> row(size_t(row_width_), -1);
  if (b.owner[size_t(t)] < 0) return row;
  const int64_t context = b.positions[size_t(t)] + 1;
  if (context <= iplan_.topk) {
    for (int64_t j = 0; j < context; ++j) row[size_t(j)] = int32_t(j);
    return row;
  }
  std::unordered_set<int64_t> chosen;
  for (int64_t j = context - iplan_.topk; j < context; ++j) {  // Floyd's sample of 2048 of [0, L)
    const int64_t x = std::uniform_int_distribution<int64_t>(0, j)(rng);
    chosen.insert(chosen.count(x) ? j : x);
  }
  std::vector<int64_t> sorted(chosen.begin(), chosen.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t j = 0; j < sorted.size(); ++j) row[j] = int32_t(sorted[j]);
  return row;
}

void Server::check_step(const StepBatch& b, const StepInputs& in, bool caller_rows, const std::vector<int>& samples,
                        const StepResult& r, const StepData& d, const reference::IndexerStepHost& step,
                        const reference::IndexerQueryHost& query, std::mt19937_64& rng) {
  const std::string at = "step " + std::to_string(report_->steps);
  if (r.errors != 0) report_->fail(at + ": the error word counted " + std::to_string(r.errors) + " in a step without faults");
  for (int t = 0; t < b.m(); ++t) {
    if (b.owner[size_t(t)] >= 0) continue;
    std::string why;
    if (std::count(&r.slots[size_t(t) * row_width_], &r.slots[size_t(t + 1) * row_width_], -1) !=
        row_width_) {
      why = "its row holds entries other than -1";
    }
    if (why.empty()) empty_result(r, t, &why);
    if (!why.empty()) report_->fail(at + ", padding token " + std::to_string(t) + ": " + why);
  }
  const int group = int(std::min<int64_t>(8, shape_.H));
  for (size_t i = 0; i < samples.size(); ++i) {
    const int t = samples[i];
    TokenCheckInputs c;
    c.position = b.positions[size_t(t)];
    c.row = b.token_requests[size_t(t)];
    c.step = &step;
    c.token = t;
    c.query = &query;
    c.gpu_logits = d.logits[size_t(t)].empty() ? nullptr : d.logits[size_t(t)].data();
    c.caller_positions = caller_rows ? &in.topk[size_t(t) * row_width_] : nullptr;
    c.check_logits = i == 0;  // O(L): one token per step
    c.gpu_slots = &r.slots[size_t(t) * row_width_];
    c.gpu_q_fp8 = &d.q_fp8[size_t(t) * size_t(shape_.H * shape_.L)];
    c.gpu_latent = &r.latent[size_t(t) * size_t(shape_.H * shape_.L)];
    c.gpu_lse = &r.lse[size_t(t) * size_t(shape_.H)];
    c.heads = shape_.H;
    c.head_count = group;
    c.first_head = std::uniform_int_distribution<int>(0, int(shape_.H / group) - 1)(rng) * group;
    c.q_scale = host_.q_scale;
    c.k_scale = host_.k_scale;
    c.softmax_scale = shape_.softmax_scale;
    c.threads = threads_;
    const TokenCheck k = check_token(model_, in.table, c);
    ++report_->tokens_checked;
    report_->logit_pools_checked += k.pools_scored;
    if (!k.ok) {
      report_->fail(at + ", token " + std::to_string(t) + " (position " + std::to_string(c.position) + ", row " +
                    std::to_string(c.row) + (caller_rows ? ", caller rows" : "") + "): " + k.why);
    }
  }
}

// A tool injected into the process (compute-sanitizer, Nsight: through
// CUDA_INJECTION64_PATH or an LD_PRELOAD helper) may hold device memory of
// its own as the run goes: the memory figure is then reported, not judged.
bool tool_attached() {
  const char* injection = std::getenv("CUDA_INJECTION64_PATH");
  const char* preload = std::getenv("LD_PRELOAD");
  const std::string p = preload != nullptr ? preload : "";
  return (injection != nullptr && injection[0] != '\0') || p.find("anitizer") != std::string::npos ||
         p.find("TreeLauncher") != std::string::npos;
}

// The figures so far, where --json names a file (a run cut by a harder kill
// still leaves them), and one line on stdout.
void Server::write_progress() {
  report_->seconds = seconds();
  if (!o_.json_path.empty() && !write_file_atomically(o_.json_path, report_json(*report_) + "\n")) {
    std::fprintf(stderr, "dsa-serve: could not write %s\n", o_.json_path.c_str());
  }
  std::printf("dsa-serve: %lld of %lld steps, %.1f s, %lld tokens checked, %lld mismatches\n",
              static_cast<long long>(report_->steps), static_cast<long long>(o_.steps), report_->seconds,
              static_cast<long long>(report_->tokens_checked), static_cast<long long>(report_->mismatches));
  std::fflush(stdout);
}

Status Server::run() {
  DSA_RETURN_IF_ERROR(warm_up());
  DSA_RETURN_IF_ERROR(warm_up_prefill());
  DSA_CUDA_RETURN(cudaDeviceSynchronize());
  size_t total = 0;
  DSA_CUDA_RETURN(cudaMemGetInfo(&free_at_start_, &total));
  least_free_ = free_at_start_;
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  report_->memory_strict = loading != nullptr && std::string(loading) == "EAGER" && !tool_attached();
  std::mt19937_64 rng(o_.seed ^ 0xD5A5E);
  const int64_t D = shape_.D;
  for (int64_t step = 0; step < o_.steps; ++step) {
    report_->steps = step;
    if (stop_requested()) {
      report_->stopped = "signal";
      break;
    }
    if (o_.time_limit > 0 && seconds() >= o_.time_limit) {
      report_->stopped = "time limit";
      break;
    }
    // Finished requests go; new ones arrive (one at most per step, always when none is live).
    for (int index : sched_->done()) DSA_RETURN_IF_ERROR(finish(sched_->live()[size_t(index)].serial, true));
    if (sched_->live().empty() || (int(sched_->live().size()) < g_.rows && rng() % 4 == 0)) {
      const int index = sched_->admit(sched_->draw_prompt(g_.max_context - 1));
      if (index >= 0) {
        ++report_->requests_admitted;
        DSA_RETURN_IF_ERROR(prefill(sched_->live()[size_t(index)]));
      }
    }
    std::vector<int> starved;
    const StepBatch b = sched_->build_step(&starved);
    const int m = b.m();
    const DsaPath path = o_.path == "fused" ? DsaPath::kFused
                         : o_.path == "stock" ? DsaPath::kStock
                                              : (rng() % 2 == 0 ? DsaPath::kFused : DsaPath::kStock);
    // A fault for this step, of a kind drawn among those the step can take.
    std::vector<FaultKind> kinds = o_.faults;
    const bool fault_step = o_.fault_every > 0 && !kinds.empty() && int(rng() % uint64_t(o_.fault_every)) == 0;
    std::shuffle(kinds.begin(), kinds.end(), rng);
    bool caller_rows = rng() % 8 == 0;
    // A topk fault needs caller rows: a step whose first drawn kind is topk gets them.
    if (fault_step && kinds.front() == FaultKind::kTopkOutOfRange) caller_rows = true;
    StepInputs clean;
    clean.hidden.resize(size_t(m) * size_t(D));
    fill_bf16(clean.hidden.data(), clean.hidden.size(), mix(o_.seed ^ 0xC0FFEE) ^ mix(uint64_t(step)));
    clean.positions = b.positions;
    clean.token_requests = b.token_requests;
    clean.slot_mapping = b.slot_mapping;
    clean.table = sched_->table().entries();
    if (caller_rows) {
      for (int t = 0; t < m; ++t) {
        const std::vector<int32_t> row = caller_row(b, t, rng);
        clean.topk.insert(clean.topk.end(), row.begin(), row.end());
      }
    }
    FaultPlan fault;
    bool faulted = false;
    if (fault_step) {
      for (FaultKind k : kinds) {
        if (plan_fault(k, g_, sched_->live(), b, clean, D, row_width_, rng, &fault)) {
          faulted = true;
          break;
        }
      }
    }
    // The tokens checked against the references.
    std::vector<int> real;
    for (int t = 0; t < m; ++t) {
      if (b.owner[size_t(t)] >= 0) real.push_back(t);
    }
    std::shuffle(real.begin(), real.end(), rng);
    const std::vector<int> samples(real.begin(), real.begin() + std::min<size_t>(real.size(), size_t(o_.sample_tokens)));

    StepResult r;
    StepData d;
    DSA_RETURN_IF_ERROR(run_once(path, clean, samples, &r, &d));
    if (caller_rows) DSA_RETURN_IF_ERROR(caller_rows_prepare(m, &d));
    ++(path == DsaPath::kFused ? report_->fused_steps : report_->stock_steps);
    report_->caller_rows_steps += caller_rows ? 1 : 0;
    report_->tokens += int64_t(real.size());
    report_->padding_tokens += m - int64_t(real.size());
    report_->extra_slot_entries += int64_t(b.slot_mapping.size()) - m;
    // The model takes the step: the cache entries from the GPU's kv_c, the
    // indexer's prepare from its projections.
    const int64_t skipped = model_.cache_write(d.kv_c.data(), m,
                                               std::vector<int64_t>(b.slot_mapping.begin(), b.slot_mapping.begin() + m));
    if (skipped != 0) report_->fail("step " + std::to_string(step) + ": the model skipped slots of a clean step");
    const reference::IndexerStepHost host_step{m,
                                               d.index_q.data(),
                                               d.index_k.data(),
                                               d.head_weights.data(),
                                               d.gate.data(),
                                               clean.positions.data(),
                                               clean.token_requests.data()};
    reference::IndexerQueryHost query;
    int64_t prepare_errors = 0;
    DSA_RETURN_IF_ERROR(model_.prepare(clean.table, host_step, &query, &prepare_errors));
    if (prepare_errors != 0) report_->fail("step " + std::to_string(step) + ": the model's prepare met untrusted blocks");
    check_step(b, clean, caller_rows, samples, r, d, host_step, query, rng);

    std::vector<int64_t> ended;  // serials finished after the step
    if (faulted) {
      const StepInputs bad = apply_fault(fault, clean);
      StepResult f;
      DSA_RETURN_IF_ERROR(run_once(path, bad, {}, &f, nullptr));
      std::vector<std::string> failures;
      check_isolation(fault, r, f, &failures);
      check_victim(fault, g_, r, f, &failures);
      for (const std::string& what : failures) report_->fail("step " + std::to_string(step) + ": " + what);
      ++report_->faults[static_cast<int>(fault.kind)];
      report_->isolated_tokens += m - int64_t(fault.affected.size());
      ended.push_back(sched_->live()[size_t(fault.victim)].serial);
    }
    sched_->advance(b);
    for (int index : starved) ended.push_back(sched_->live()[size_t(index)].serial);
    for (size_t i = 0; i < ended.size(); ++i) {
      if (std::find(ended.begin(), ended.begin() + i, ended[i]) != ended.begin() + i) continue;
      if (faulted && i == 0) {
        ++report_->requests_ended_by_fault;
      } else {
        ++report_->requests_starved;
      }
      DSA_RETURN_IF_ERROR(finish(ended[i], false));
    }
    if ((step + 1) % o_.check_every == 0) {
      DSA_RETURN_IF_ERROR(check_state(("after step " + std::to_string(step)).c_str()));
      report_->steps = step + 1;
      write_progress();
    }
    report_->steps = step + 1;
  }
  DSA_RETURN_IF_ERROR(check_state("at the end"));
  report_->requests_admitted = sched_->admitted();
  report_->seconds = seconds();
  if (report_->memory_strict && report_->memory_delta_bytes != 0) {
    report_->fail("device memory changed after start-up: " + std::to_string(report_->memory_delta_bytes) +
                  " bytes less free (cudaMemGetInfo)");
  }
  return Status();
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

Status run_serve(const ServeOptions& options, ServeReport* report) {
  const auto started = std::chrono::steady_clock::now();
  *report = ServeReport{};
  report->options = options;
  report->steps_planned = options.steps;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return Status(ErrorCode::kNoDevice, std::string("dsa-serve needs a GPU: ") +
                                            (e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device"));
  }
  cudaDeviceProp prop{};
  DSA_CUDA_RETURN(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    return unsupported(std::string("dsa-serve needs an sm_90a GPU (the kernels' only target); device 0 is ") +
                       prop.name);
  }
  Server server(options, report, started);
  DSA_RETURN_IF_ERROR(server.init());
  return server.run();
}

void request_serve_stop() { stop_flag.store(true, std::memory_order_relaxed); }

bool write_file_atomically(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".tmp";
  std::FILE* f = std::fopen(temporary.c_str(), "wb");
  if (f == nullptr) return false;
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    std::remove(temporary.c_str());
    return false;
  }
  return std::rename(temporary.c_str(), path.c_str()) == 0;
}

std::string report_json(const ServeReport& r) {
  std::string faults, list;
  int64_t injected = 0;
  for (int k = 0; k < static_cast<int>(FaultKind::kCount); ++k) {
    faults += std::string(faults.empty() ? "" : ", ") + quoted(fault_name(static_cast<FaultKind>(k))) + ": " +
              std::to_string(r.faults[k]);
    injected += r.faults[k];
  }
  for (const std::string& f : r.failures) list += (list.empty() ? "" : ", ") + quoted(f);
  const auto n = [](int64_t v) { return std::to_string(v); };
  return std::string("{\"program\": \"dsa-serve\", \"gpu\": ") + quoted(r.gpu) + ", \"result\": " +
         quoted(r.mismatches > 0 ? "FAIL" : r.complete() ? "PASS" : "INCOMPLETE") + ", \"tp\": " + n(r.options.tp) + ", \"heads\": " + n(r.heads) +
         ", \"path\": " + quoted(r.options.path) + ", \"batch_invariant\": " +
         (r.options.batch_invariant ? "true" : "false") + ", \"seed\": " + std::to_string(r.options.seed) +
         ", \"max_context\": " + n(r.options.max_context) + ", \"blocks\": " + n(r.blocks) +
         ", \"steps\": " + n(r.steps) + ", \"steps_planned\": " + n(r.steps_planned) + ", \"complete\": " +
         (r.complete() ? "true" : "false") + ", \"stopped\": " + quoted(r.stopped) + ", \"fused_steps\": " + n(r.fused_steps) + ", \"stock_steps\": " +
         n(r.stock_steps) + ", \"caller_rows_steps\": " + n(r.caller_rows_steps) + ", \"warmup_steps\": " +
         n(r.warmup_steps) + ", \"requests_admitted\": " + n(r.requests_admitted) + ", \"requests_served\": " +
         n(r.requests_served) + ", \"requests_ended_by_fault\": " + n(r.requests_ended_by_fault) +
         ", \"requests_starved\": " + n(r.requests_starved) + ", \"prefill_tokens\": " + n(r.prefill_tokens) +
         ", \"longest_prompt\": " + n(r.longest_prompt) + ", \"tokens\": " + n(r.tokens) + ", \"padding_tokens\": " +
         n(r.padding_tokens) + ", \"extra_slot_entries\": " + n(r.extra_slot_entries) + ", \"tokens_checked\": " +
         n(r.tokens_checked) + ", \"logit_pools_checked\": " + n(r.logit_pools_checked) + ", \"state_checks\": " +
         n(r.state_checks) + ", \"entries_compared\": " + n(r.entries_compared) + ", \"pools_compared\": " +
         n(r.pools_compared) + ", \"ring_rows_compared\": " + n(r.ring_rows_compared) + ", \"faults_injected\": " +
         n(injected) + ", \"faults\": {" + faults + "}, \"isolated_tokens\": " + n(r.isolated_tokens) +
         ", \"mismatches\": " + n(r.mismatches) + ", \"memory_delta_bytes\": " + n(r.memory_delta_bytes) +
         ", \"memory_strict\": " + (r.memory_strict ? "true" : "false") + ", \"seconds\": " +
         std::to_string(r.seconds) + ", \"failures\": [" + list + "]}";
}

std::string report_text(const ServeReport& r) {
  int64_t injected = 0;
  std::string kinds;
  for (int k = 0; k < static_cast<int>(FaultKind::kCount); ++k) {
    injected += r.faults[k];
    kinds += std::string(kinds.empty() ? "" : ", ") + fault_name(static_cast<FaultKind>(k)) + " " +
             std::to_string(r.faults[k]);
  }
  std::string text = "dsa-serve on " + r.gpu + ": " + std::to_string(r.steps) + " steps" +
                     (r.complete() ? std::string()
                                   : " of " + std::to_string(r.steps_planned) + " (stopped: " +
                                         (r.stopped.empty() ? std::string("not finished") : r.stopped) + ")") +
                     " in " + std::to_string(int64_t(r.seconds)) + " s (" +
                     std::to_string(r.fused_steps) + " fused, " + std::to_string(r.stock_steps) + " stock, " +
                     std::to_string(r.caller_rows_steps) + " with caller rows), " +
                     std::to_string(r.requests_admitted) + " requests admitted, " + std::to_string(r.requests_served) +
                     " served, " + std::to_string(r.tokens) + " tokens (+" + std::to_string(r.padding_tokens) +
                     " padding), " + std::to_string(r.tokens_checked) + " tokens checked, " +
                     std::to_string(r.state_checks) + " state checks, " + std::to_string(injected) +
                     " faults (" + kinds + "), memory delta " + std::to_string(r.memory_delta_bytes) + " bytes, " +
                     std::to_string(r.mismatches) + " mismatches\n";
  for (const std::string& f : r.failures) text += "  mismatch: " + f + "\n";
  return text;
}

}  // namespace dsa::serve
