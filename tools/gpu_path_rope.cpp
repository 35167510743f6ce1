// dsa-decode's GPU path at a RoPE preset (dsv32; glm5 the same way): the
// step kernel by kernel through the library's public functions, then through
// the library's stage (DsaAttentionStage), on the synthetic layer and inputs
// of the CPU chain (tools/rope_chain.h). The chain runs on one stream with
// the kernels' own PDL launches:
//   linear_gemv qkv_a_proj -> qkv_rmsnorm (a strided view of q_c | kv_c, k_pe
//   left out) -> linear_gemv q_b_proj -> rope_absorb -> sparse_mla_v32_cache_write
//   -> indexer_project_gemv -> indexer_prepare -> indexer_select -> indexer_remap
//   -> sparse_mla_v32 -> head_gemv value-up -> linear_gemv o_proj
// (linear_gemv takes up to 8 tokens, fewer where K is large: a larger step
// runs it per group of tokens that fits, which gives the same bits, a token's
// depending only on its own row; linear.h has no other kernel; the same for
// indexer_project_gemv, whose x rows fit 8 tokens, not 16, at D = 7168). The
// indexer's K cache is prefilled with the context (indexer_prefill) before.
// Each product is checked on the GPU's own inputs (downloaded) against the
// CPU chain's reference of the same kernel: bit for bit where the kernel
// promises bits (the linear_gemv products, rope's rotated values, the cache
// bytes, the indexer's projections, prefill, prepare, the rows under exact
// logits, remap), within the contract's bounds elsewhere (the norm, the
// absorbed latent, the attention, value-up on tensor cores, the indexer's
// FP32-accumulated logits). The whole chain is timed by CUDA-graph replay.
//
// The stage: one per weight copy (rotated between timed steps, so that
// weights come from memory), sharing one workspace, at the step's plan
// (StepShape::stage_plan, --projections), with its own KV cache and indexer
// K cache from the chain's state before the step. Each path's products are
// checked as the chain's are (bit for bit where its kernel promises bits;
// its cuBLASLt projections and cuBLAS value-up within 2 BF16 ulps at the
// values' scale of the reference's order); the fused path equals the chain
// bit for bit where it runs the chain's kernels (every projection a GEMV,
// value-up a head_gemv), and the stock path shares the caches and slots of
// the fused one, its out within 2e-2. Then each step alone, the attention
// halves and the whole stages of both paths are timed as the NoPE path's.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "compare.h"
#include "device_buffers.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/numerics.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "dsa_decode/stage.h"
#include "gpu_path.h"
#include "head_gemv/head_gemv_reference.h"
#include "indexer/indexer_reference.h"
#include "linear/linear_reference.h"
#include "reference_chain.h"
#include "report.h"
#include "rope/rope_reference.h"
#include "rope_chain.h"
#include "sparse_mla_v32/sparse_mla_v32_reference.h"
#include "timing.h"

namespace dsa::cli {

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kEntryBytes = kSparseMlaV32EntryBytes;
// BF16 0xFFFF, e4m3 0xFF and FP32 0xFFFFFFFF are NaN: an unwritten output fails its check.
constexpr int kPoisonByte = 0xFF;
// Chains per graph in the timing (the graph launch's overhead spread over them).
constexpr int kChainsPerGraph = 10;

enum ErrorCounter { kPrefillErrors, kAbsorbErrors, kCacheWriteErrors, kPrepareErrors, kSelectErrors,
                    kRemapErrors, kAttentionErrors, kErrorCounters };
constexpr const char* kErrorCounterNames[kErrorCounters] = {"prefill", "rope_absorb", "cache write", "prepare",
                                                            "select",  "remap",       "attention"};

// `count` elements of `device` into `host` (the stream synchronized first).
template <class T>
Status download(const bench::DeviceMemory& device, size_t count, std::vector<T>* host, cudaStream_t stream) {
  host->resize(count);
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
  DSA_CUDA_RETURN(cudaMemcpy(host->data(), device.get(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return Status();
}

TensorView bf16(const bench::DeviceMemory& d, std::initializer_list<int64_t> shape) {
  return make_tensor(d.get(), DType::kBF16, shape);
}

std::string shape_text(std::initializer_list<int64_t> dims) {
  std::string text = "[";
  for (int64_t d : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

// The layer, the step's inputs and outputs, the KV cache and the indexer's
// state on the device, and the chain's launches.
class RopeGpuChain {
 public:
  Status init(const StepShape& s, const RopeChainProducts& p, const std::vector<uint8_t>& cache, cudaStream_t stream);
  Status prefill(const RopeChainProducts& p, cudaStream_t stream);
  // The step, kernel by kernel.
  Status enqueue(cudaStream_t stream) const;

  StepShape s_{};
  IndexerPlan plan_{};
  RopeStyle attention_style_ = RopeStyle::kInterleaved;
  float eps_ = 0;  // of both RMSNorms
  int W = 0;  // row width
  // weights
  bench::DeviceMemory w_qkv, q_gamma, kv_gamma, w_q_b, w_uk_t, w_uv, w_o, wq_b, wk, weights_proj, k_norm_weight,
      k_norm_bias, ape, attention_table, indexer_table;
  // inputs and the state
  bench::DeviceMemory hidden, positions, token_requests, slot_mapping, cache, block_table, k_cache, workspace, errors;
  // products
  bench::DeviceMemory qkv, q_c, kv_c, q, q_absorbed, k_pe, index_q, index_k, head_weights, topk_positions, slots,
      remapped, latent, lse, heads, out;

 private:
  IndexerState state() const {
    return IndexerState{make_tensor(block_table.get(), DType::kI32, {s_.indexer_requests(), s_.cache_blocks()}),
                        TensorView(),  // no ring with pool 1
                        make_tensor(k_cache.get(), DType::kU8, {s_.cache_blocks(), s_.indexer_page_bytes()})};
  }
  unsigned int* counter(ErrorCounter c) const { return errors.as<unsigned int>() + c; }
  // linear_gemv of x [m, k] by weight [n, k] into out [m, n], per group of tokens that fits it.
  Status linear(const bench::DeviceMemory& x, int64_t k, const bench::DeviceMemory& weight, int64_t n,
                const bench::DeviceMemory& y, cudaStream_t stream) const;
  // indexer_project_gemv (no gate at pool 1) of tokens first..first+tokens-1, and of the step per group of
  // tokens that fits it.
  IndexerProjectArgs project_args(int first, int tokens) const;
  Status project(cudaStream_t stream) const;
};

Status RopeGpuChain::init(const StepShape& s, const RopeChainProducts& p, const std::vector<uint8_t>& cache_bytes,
                          cudaStream_t stream) {
  s_ = s;
  plan_ = p.plan;
  attention_style_ = p.tables.attention.style;
  eps_ = p.weights.eps;
  W = indexer_row_width(plan_);
  const HostWeights& w = p.weights;
  DSA_RETURN_IF_ERROR(upload(w.fused_qkv_a_proj, &w_qkv, stream));
  DSA_RETURN_IF_ERROR(upload(w.q_norm_gamma, &q_gamma, stream));
  DSA_RETURN_IF_ERROR(upload(w.kv_norm_gamma, &kv_gamma, stream));
  DSA_RETURN_IF_ERROR(upload(w.q_b_proj, &w_q_b, stream));
  DSA_RETURN_IF_ERROR(upload(w.w_uk_t, &w_uk_t, stream));
  DSA_RETURN_IF_ERROR(upload(w.w_uv, &w_uv, stream));
  DSA_RETURN_IF_ERROR(upload(w.o_proj, &w_o, stream));
  DSA_RETURN_IF_ERROR(upload(w.index_wq_b, &wq_b, stream));
  DSA_RETURN_IF_ERROR(upload(w.index_wk, &wk, stream));
  DSA_RETURN_IF_ERROR(upload(w.index_weights_proj, &weights_proj, stream));
  DSA_RETURN_IF_ERROR(upload(w.index_k_norm_weight, &k_norm_weight, stream));
  DSA_RETURN_IF_ERROR(upload(w.index_k_norm_bias, &k_norm_bias, stream));
  DSA_RETURN_IF_ERROR(upload(w.index_ape, &ape, stream));
  DSA_RETURN_IF_ERROR(upload(p.tables.attention_table, &attention_table, stream));
  DSA_RETURN_IF_ERROR(upload(p.tables.indexer_table, &indexer_table, stream));

  DSA_RETURN_IF_ERROR(upload(p.inputs.hidden, &hidden, stream));
  DSA_RETURN_IF_ERROR(upload(p.inputs.positions, &positions, stream));
  DSA_RETURN_IF_ERROR(upload(p.inputs.token_requests, &token_requests, stream));
  DSA_RETURN_IF_ERROR(upload(p.inputs.slot_mapping, &slot_mapping, stream));
  DSA_RETURN_IF_ERROR(upload(cache_bytes, &cache, stream));
  DSA_RETURN_IF_ERROR(upload(make_indexer_block_table(s), &block_table, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(size_t(s.cache_blocks()) * s.indexer_page_bytes(), 0, &k_cache, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(size_t(indexer_workspace_layout(plan_).bytes), 0, &workspace, stream));
  DSA_RETURN_IF_ERROR(allocate_filled(kErrorCounters * sizeof(unsigned int), 0, &errors, stream));

  const size_t m = size_t(s.m), H = size_t(s.H), HI = size_t(plan_.heads);
  const auto poisoned = [&](size_t bytes, bench::DeviceMemory* d) { return allocate_filled(bytes, kPoisonByte, d, stream); };
  DSA_RETURN_IF_ERROR(poisoned(m * s.qkv_width() * 2, &qkv));
  DSA_RETURN_IF_ERROR(poisoned(m * s.Q * 2, &q_c));
  DSA_RETURN_IF_ERROR(poisoned(m * s.L * 2, &kv_c));
  DSA_RETURN_IF_ERROR(poisoned(m * size_t(s.q_width()) * 2, &q));
  DSA_RETURN_IF_ERROR(poisoned(m * H * (s.L + s.R) * 2, &q_absorbed));
  DSA_RETURN_IF_ERROR(poisoned(m * s.R * 2, &k_pe));
  DSA_RETURN_IF_ERROR(poisoned(m * HI * kIndexerDim * 2, &index_q));
  DSA_RETURN_IF_ERROR(poisoned(m * kIndexerDim * 2, &index_k));
  DSA_RETURN_IF_ERROR(poisoned(m * HI * 4, &head_weights));
  DSA_RETURN_IF_ERROR(poisoned(m * W * 4, &topk_positions));
  DSA_RETURN_IF_ERROR(poisoned(m * W * 4, &slots));
  DSA_RETURN_IF_ERROR(poisoned(m * W * 4, &remapped));
  DSA_RETURN_IF_ERROR(poisoned(m * H * s.L * 2, &latent));
  DSA_RETURN_IF_ERROR(poisoned(m * H * 4, &lse));
  DSA_RETURN_IF_ERROR(poisoned(m * H * s.V * 2, &heads));
  DSA_RETURN_IF_ERROR(poisoned(m * s.D * 2, &out));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));  // the host vectors of the uploads may go now
  return Status();
}

// indexer_prefill of request 0 over the context (pool 1: one request holds
// every token of the step), from the rows the CPU chain's prefill took.
Status RopeGpuChain::prefill(const RopeChainProducts& p, cudaStream_t stream) {
  if (s_.context == 0) return Status();
  bench::DeviceMemory history;
  DSA_RETURN_IF_ERROR(upload(p.history.index_k, &history, stream));
  IndexerPrefillArgs a;
  a.plan = plan_;
  a.index_k = bf16(history, {s_.context, kIndexerDim});
  a.k_norm_weight = make_tensor(k_norm_weight.get(), DType::kF32, {kIndexerDim});
  a.k_norm_bias = make_tensor(k_norm_bias.get(), DType::kF32, {kIndexerDim});
  a.ape = make_tensor(ape.get(), DType::kF32, {int64_t{plan_.pool}, kIndexerDim});
  a.request = 0;
  a.state = state();
  a.error_count = counter(kPrefillErrors);
  a.cos_sin = make_tensor(indexer_table.get(), DType::kF32, {int64_t(p.tables.rows), int64_t{s_.R}});
  DSA_RETURN_IF_ERROR(indexer_prefill(a, stream));
  DSA_CUDA_RETURN(cudaStreamSynchronize(stream));  // `history` is freed on return
  return Status();
}

Status RopeGpuChain::linear(const bench::DeviceMemory& x, int64_t k, const bench::DeviceMemory& weight, int64_t n,
                            const bench::DeviceMemory& y, cudaStream_t stream) const {
  // The largest power-of-two token count whose rows fit linear_gemv's shared
  // memory (T * K * 2 bytes): 8 below K = 14.5 K, 4 at dsv32 and glm5's TP1 o_proj (K = 16384).
  int chunk = kLinearGemvMaxTokens;
  while (chunk > 1 && !linear_gemv_supports(chunk, k)) chunk /= 2;
  for (int first = 0; first < s_.m; first += chunk) {
    const int tokens = std::min(chunk, s_.m - first);
    LinearGemvArgs a;
    a.x = make_tensor(x.as<uint16_t>() + size_t(first) * k, DType::kBF16, {tokens, k});
    a.weight = make_tensor(weight.get(), DType::kBF16, {n, k});
    a.out = make_tensor(y.as<uint16_t>() + size_t(first) * n, DType::kBF16, {tokens, n});
    DSA_RETURN_IF_ERROR(linear_gemv(a, stream));
  }
  return Status();
}

IndexerProjectArgs RopeGpuChain::project_args(int first, int tokens) const {
  const int64_t HI = plan_.heads;
  IndexerProjectArgs a;
  a.plan = plan_;
  a.q_c = make_tensor(q_c.as<uint16_t>() + size_t(first) * s_.Q, DType::kBF16, {tokens, s_.Q});
  a.x = make_tensor(hidden.as<uint16_t>() + size_t(first) * s_.D, DType::kBF16, {tokens, s_.D});
  a.wq_b = bf16(wq_b, {HI * kIndexerDim, s_.Q});
  a.wk = bf16(wk, {kIndexerDim, s_.D});
  a.weights_proj = bf16(weights_proj, {HI, s_.D});
  a.index_q = make_tensor(index_q.as<uint16_t>() + size_t(first) * HI * kIndexerDim, DType::kBF16,
                          {tokens, HI, kIndexerDim});
  a.index_k = make_tensor(index_k.as<uint16_t>() + size_t(first) * kIndexerDim, DType::kBF16, {tokens, kIndexerDim});
  a.head_weights = make_tensor(head_weights.as<float>() + size_t(first) * HI, DType::kF32, {tokens, HI});
  return a;
}

Status RopeGpuChain::project(cudaStream_t stream) const {
  // indexer_project_gemv stages x in shared memory per power-of-two token
  // count: D = 7168 (dsv32) fits 8 tokens, not 16 (its check names the limit).
  // Its bits are independent of m, so a step runs per group of tokens that fits.
  // (An argument error fails at every size: the launch of one token then names it.)
  int chunk = s_.m;
  while (chunk > 1 && !check_indexer_project_gemv(project_args(0, chunk)).ok()) chunk = (chunk + 1) / 2;
  for (int first = 0; first < s_.m; first += chunk) {
    DSA_RETURN_IF_ERROR(indexer_project_gemv(project_args(first, std::min(chunk, s_.m - first)), stream));
  }
  return Status();
}

Status RopeGpuChain::enqueue(cudaStream_t stream) const {
  const StepShape& s = s_;
  const int64_t m = s.m, H = s.H, P = s.P, R = s.R, L = s.L, HI = plan_.heads, qkv_width = s.qkv_width();
  const int64_t table_rows = s.context + s.m;
  const TensorView positions_view = make_tensor(positions.get(), DType::kI64, {m});
  const TensorView requests_view = make_tensor(token_requests.get(), DType::kI32, {m});
  const TensorView cache_view = make_tensor(cache.get(), DType::kU8, {s.cache_blocks(), kCacheBlockSize, kEntryBytes});
  const TensorView workspace_view = make_tensor(workspace.get(), DType::kU8, {indexer_workspace_layout(plan_).bytes});

  // qkv [m, Q + L + R] = hidden x fused_qkv_a_proj^T
  DSA_RETURN_IF_ERROR(linear(hidden, s.D, w_qkv, qkv_width, qkv, stream));
  // Both RMSNorms over the first Q + L columns of each row (k_pe left out).
  DSA_RETURN_IF_ERROR(qkv_rmsnorm(make_strided(qkv.get(), DType::kBF16, {m, int64_t{s.Q} + L}, {qkv_width, 1}),
                                  bf16(q_gamma, {s.Q}), bf16(kv_gamma, {L}), eps_, bf16(q_c, {m, s.Q}),
                                  bf16(kv_c, {m, L}), stream));
  // q [m, H, P + R] = q_c x q_b_proj^T
  DSA_RETURN_IF_ERROR(linear(q_c, s.Q, w_q_b, s.q_width(), q, stream));
  RopeAbsorbArgs absorb;
  absorb.q_nope = make_strided(q.get(), DType::kBF16, {m, H, P}, {H * (P + R), P + R, 1});
  absorb.q_pe = make_strided(q.as<uint16_t>() + P, DType::kBF16, {m, H, R}, {H * (P + R), P + R, 1});
  absorb.k_pe = make_strided(qkv.as<uint16_t>() + s.Q + L, DType::kBF16, {m, R}, {qkv_width, 1});
  absorb.positions = positions_view;
  absorb.cos_sin = make_tensor(attention_table.get(), DType::kF32, {table_rows, R});
  absorb.weight = bf16(w_uk_t, {H, P, L});
  absorb.out = bf16(q_absorbed, {m, H, L + R});
  absorb.k_pe_out = bf16(k_pe, {m, R});
  absorb.style = attention_style_;
  absorb.error_count = counter(kAbsorbErrors);
  DSA_RETURN_IF_ERROR(rope_absorb(absorb, stream));
  SparseMlaV32CacheWriteArgs write;
  write.kv_c = bf16(kv_c, {m, L});
  write.k_pe = bf16(k_pe, {m, R});
  write.slot_mapping = make_tensor(slot_mapping.get(), DType::kI64, {m});
  write.kv_cache = cache_view;
  write.error_count = counter(kCacheWriteErrors);
  DSA_RETURN_IF_ERROR(sparse_mla_v32_cache_write(write, stream));

  // The indexer: projections (no gate at pool 1), prepare, select, remap.
  DSA_RETURN_IF_ERROR(project(stream));
  IndexerPrepareArgs prepare;
  prepare.plan = plan_;
  prepare.index_q = bf16(index_q, {m, HI, kIndexerDim});
  prepare.index_k = bf16(index_k, {m, kIndexerDim});
  prepare.head_weights = make_tensor(head_weights.get(), DType::kF32, {m, HI});
  prepare.k_norm_weight = make_tensor(k_norm_weight.get(), DType::kF32, {kIndexerDim});
  prepare.k_norm_bias = make_tensor(k_norm_bias.get(), DType::kF32, {kIndexerDim});
  prepare.ape = make_tensor(ape.get(), DType::kF32, {int64_t{plan_.pool}, kIndexerDim});
  prepare.positions = positions_view;
  prepare.token_requests = requests_view;
  prepare.state = state();
  prepare.workspace = workspace_view;
  prepare.error_count = counter(kPrepareErrors);
  prepare.cos_sin = make_tensor(indexer_table.get(), DType::kF32, {table_rows, R});
  DSA_RETURN_IF_ERROR(indexer_prepare(prepare, stream));
  IndexerSelectArgs select;
  select.plan = plan_;
  select.positions = positions_view;
  select.token_requests = requests_view;
  select.state = state();
  select.workspace = workspace_view;
  select.topk_positions = make_tensor(topk_positions.get(), DType::kI32, {m, int64_t{W}});
  select.slots = make_tensor(slots.get(), DType::kI32, {m, int64_t{W}});
  select.error_count = counter(kSelectErrors);
  DSA_RETURN_IF_ERROR(indexer_select(select, stream));
  IndexerRemapArgs remap;
  remap.plan = plan_;
  remap.positions = positions_view;
  remap.token_requests = requests_view;
  remap.state = state();
  remap.topk_positions = select.topk_positions;
  remap.slots = make_tensor(remapped.get(), DType::kI32, {m, int64_t{W}});
  remap.error_count = counter(kRemapErrors);
  DSA_RETURN_IF_ERROR(indexer_remap(remap, stream));

  // The attention over the remapped slots, value-up, o_proj.
  SparseMlaV32Args attention;
  attention.q = bf16(q_absorbed, {m, H, L + R});
  attention.kv_cache = cache_view;
  attention.indices = remap.slots;
  attention.softmax_scale = s.softmax_scale;
  attention.latent = bf16(latent, {m, H, L});
  attention.lse = make_tensor(lse.get(), DType::kF32, {m, H});
  attention.error_count = counter(kAttentionErrors);
  DSA_RETURN_IF_ERROR(sparse_mla_v32(attention, stream));
  HeadGemvArgs value_up;
  value_up.x = attention.latent;
  value_up.weight = bf16(w_uv, {H, L, s.V});
  value_up.out = bf16(heads, {m, H, s.V});
  value_up.sums = s.head_gemv_sums;
  const HeadGemvTactic tactic = value_up_tactic(s);
  DSA_RETURN_IF_ERROR(
      head_gemv(value_up, stream, s.head_gemv_sums == HeadGemvSums::kSeedOrder ? &tactic : nullptr));
  return linear(heads, H * s.V, w_o, s.D, out, stream);
}

// The whole paged cache [cache_blocks, 256, 656] bytes: the context's
// entries as the CPU chain makes them (make_cached_rope_token, then vLLM's
// cache write), zeros after.
std::vector<uint8_t> make_rope_cache(const StepShape& s, uint64_t seed) {
  std::vector<uint8_t> bytes(size_t(s.cache_blocks()) * kCacheBlockSize * kEntryBytes, 0);
  std::vector<uint16_t> kv_row(s.L), k_pe_row(s.R);
  for (int64_t slot = 0; slot < s.context; ++slot) {
    make_cached_rope_token(s, seed, slot, kv_row.data(), k_pe_row.data());
    reference::v32_quantize_token(kv_row.data(), k_pe_row.data(), &bytes[size_t(slot) * kEntryBytes]);
  }
  return bytes;
}

template <class T>
std::vector<T> slice(const std::vector<T>& v, size_t first, size_t count) {
  return std::vector<T>(v.begin() + first, v.begin() + first + count);
}

// A product the kernel promises bit for bit: `got` against the reference's
// `want` on the GPU's own inputs.
template <class T>
Check bitwise(const std::string& name, const std::vector<T>& got, const std::vector<T>& want, const std::string& more) {
  const size_t bad = differing(got, want);
  return judged(name, bad == 0 && !got.empty(),
                format("%zu of %zu values differ from the reference on the GPU's inputs%s", bad, want.size(),
                       more.c_str()));
}

// What the GPU left, downloaded. `remapped`: the slots the attention read
// (the chain's remap of the select's positions; the stage's select slots).
struct GpuProducts {
  std::vector<uint16_t> qkv, q_c, kv_c, q, q_absorbed, k_pe, index_q, index_k, latent, heads, out;
  std::vector<float> head_weights, lse, q_weights, logits;
  std::vector<uint8_t> cache, k_cache, q_fp8;
  std::vector<int32_t> topk_positions, slots, remapped;
  std::vector<unsigned int> errors;
  std::vector<std::string> error_names;  // one per counter
};

// Which kernel made each product: the chain's (every projection a
// linear_gemv, value-up a head_gemv, the select keeping its positions, a
// remap after it), or a stage path's (its step list).
struct ProductKernels {
  bool qkv_a_proj_gemv = true, q_b_proj_gemv = true, o_proj_gemv = true, value_up_head_gemv = true;
  bool positions_kept = true;  // the select wrote the request-local positions too
  bool remap = true;           // indexer_remap ran after the select
};

Status download_products(const RopeGpuChain& c, const StepShape& s, cudaStream_t stream, GpuProducts* g) {
  const size_t m = size_t(s.m), H = size_t(s.H), HI = size_t(c.plan_.heads), W = size_t(c.W);
  DSA_RETURN_IF_ERROR(download(c.qkv, m * s.qkv_width(), &g->qkv, stream));
  DSA_RETURN_IF_ERROR(download(c.q_c, m * s.Q, &g->q_c, stream));
  DSA_RETURN_IF_ERROR(download(c.kv_c, m * s.L, &g->kv_c, stream));
  DSA_RETURN_IF_ERROR(download(c.q, m * size_t(s.q_width()), &g->q, stream));
  DSA_RETURN_IF_ERROR(download(c.q_absorbed, m * H * (s.L + s.R), &g->q_absorbed, stream));
  DSA_RETURN_IF_ERROR(download(c.k_pe, m * s.R, &g->k_pe, stream));
  DSA_RETURN_IF_ERROR(download(c.index_q, m * HI * kIndexerDim, &g->index_q, stream));
  DSA_RETURN_IF_ERROR(download(c.index_k, m * kIndexerDim, &g->index_k, stream));
  DSA_RETURN_IF_ERROR(download(c.head_weights, m * HI, &g->head_weights, stream));
  DSA_RETURN_IF_ERROR(download(c.latent, m * H * s.L, &g->latent, stream));
  DSA_RETURN_IF_ERROR(download(c.lse, m * H, &g->lse, stream));
  DSA_RETURN_IF_ERROR(download(c.heads, m * H * s.V, &g->heads, stream));
  DSA_RETURN_IF_ERROR(download(c.out, m * s.D, &g->out, stream));
  DSA_RETURN_IF_ERROR(download(c.cache, c.cache.bytes(), &g->cache, stream));
  DSA_RETURN_IF_ERROR(download(c.k_cache, c.k_cache.bytes(), &g->k_cache, stream));
  DSA_RETURN_IF_ERROR(download(c.topk_positions, m * W, &g->topk_positions, stream));
  DSA_RETURN_IF_ERROR(download(c.slots, m * W, &g->slots, stream));
  DSA_RETURN_IF_ERROR(download(c.remapped, m * W, &g->remapped, stream));
  DSA_RETURN_IF_ERROR(download(c.errors, kErrorCounters, &g->errors, stream));
  g->error_names.assign(kErrorCounterNames, kErrorCounterNames + kErrorCounters);
  std::vector<uint8_t> workspace;
  DSA_RETURN_IF_ERROR(download(c.workspace, c.workspace.bytes(), &workspace, stream));
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(c.plan_);
  g->q_fp8.assign(workspace.begin() + layout.q_fp8, workspace.begin() + layout.q_fp8 + m * HI * kIndexerDim);
  g->q_weights.resize(m * HI);
  std::memcpy(g->q_weights.data(), workspace.data() + layout.head_weights, m * HI * sizeof(float));
  g->logits.resize(m * size_t(layout.logits_stride));
  std::memcpy(g->logits.data(), workspace.data() + layout.logits, g->logits.size() * sizeof(float));
  return Status();
}

// A product of cuBLASLt's or cuBLAS's (an order of sums it does not state)
// against the CPU reference's fixed order on the GPU's own input: within 2
// BF16 ulps at the values' scale (dsa-decode's NoPE path's tolerance; a wrong
// operand mapping gives errors of the values' own size).
constexpr double kReorderedToleranceUlps = 2;

Check reordered(const std::string& name, const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                const char* input) {
  const double error = bf16_error_in_scale_ulps(got, want);
  return judged(name, got.size() == want.size() && error <= kReorderedToleranceUlps,
                format("max error %.2f BF16 ulp at the values' scale (tolerance %.0f; the summation order differs), on "
                       "the GPU's %s",
                       error, kReorderedToleranceUlps, input));
}

// A projection's check: linear_gemv's bits, or cuBLASLt's within the reordered tolerance.
Check projection_check(const char* name, bool gemv, const std::vector<uint16_t>& got, const std::vector<uint16_t>& x,
                       int m, int64_t k, const std::vector<uint16_t>& weight, int64_t n, const char* input,
                       const std::string& more) {
  const std::vector<uint16_t> want = reference::linear_gemv(x, m, k, weight, n);
  if (gemv) return bitwise(std::string(name) + " (linear_gemv) bit for bit", got, want, more);
  return reordered(std::string(name) + " (cuBLASLt) vs the CPU reference", got, want, input);
}

// Every product of the GPU chain (or of a stage path: `kernels`) against the
// CPU chain's reference of its kernel on the GPU's own inputs.
std::vector<Check> check_gpu_chain(const StepShape& s, const RopeChainProducts& p, const std::vector<uint8_t>& cache0,
                                   const std::vector<uint8_t>& k_cache_after_prefill, const GpuProducts& g,
                                   const ProductKernels& kernels = ProductKernels()) {
  std::vector<Check> checks;
  const HostWeights& w = p.weights;
  const int m = s.m, H = s.H, L = s.L, R = s.R, HI = p.plan.heads;
  const int W = indexer_row_width(p.plan);
  const auto chain_ulps = [](const std::vector<uint16_t>& gpu, const std::vector<uint16_t>& chain) {
    return format("; %.2f BF16 ulps (at the values' scale) from the CPU chain's", bf16_error_in_scale_ulps(gpu, chain));
  };

  checks.push_back(projection_check("qkv_a_proj", kernels.qkv_a_proj_gemv, g.qkv, p.inputs.hidden, m, s.D,
                                    w.fused_qkv_a_proj, s.qkv_width(), "hidden", chain_ulps(g.qkv, p.qkv)));
  {
    const NormOutputs want = reference_norm(s, w, g.qkv);
    const Difference dq = bf16_difference(g.q_c, want.q_c), dkv = bf16_difference(g.kv_c, want.kv_c);
    checks.push_back(judged("qkv_rmsnorm (k_pe left out) within 1 BF16 ulp", dq.max_steps <= 1 && dkv.max_steps <= 1,
                            format("q_c: %zu values differ, by at most %lld ulps; kv_c: %zu, at most %lld ulps; from the "
                                   "reference on the GPU's qkv",
                                   dq.differing, static_cast<long long>(dq.max_steps), dkv.differing,
                                   static_cast<long long>(dkv.max_steps))));
  }
  checks.push_back(projection_check("q_b_proj", kernels.q_b_proj_gemv, g.q, g.q_c, m, s.Q, w.q_b_proj, s.q_width(),
                                    "q_c", chain_ulps(g.q, p.q)));
  {
    const reference::RopeAbsorbHost a =
        rope_absorb_host(s, w, g.q, g.qkv, p.inputs.positions, p.tables, p.tables.attention.style);
    const reference::RopeRows rotated = reference::rope_rows(a);
    const size_t bad_k = differing(g.k_pe, rotated.k);
    size_t bad_q = 0;
    for (size_t row = 0; row < size_t(m) * H; ++row) {
      bad_q += std::memcmp(&g.q_absorbed[row * (L + R) + L], &rotated.q[row * R], size_t(R) * 2) != 0;
    }
    const reference::RopeAbsorbDeviation d =
        reference::rope_absorb_deviation(a, g.q_absorbed.data(), g.k_pe.data(), &p.tables.attention);
    checks.push_back(judged(
        "rope_absorb: rotations bit for bit, latent within head_gemv's bound",
        bad_q == 0 && bad_k == 0 && d.latent.outside == 0 && d.rope_outside == 0 && d.latent.compared > 0,
        format("%zu of %d rotated q_pe rows and %zu of %d k_pe values differ from reference::rope_rows; latent: %lld of "
               "%lld outside 2^-14 x sum |products|; %lld rotated values outside the exact rotation's bound; on the "
               "GPU's q and qkv",
               bad_q, m * H, bad_k, m * R, static_cast<long long>(d.latent.outside),
               static_cast<long long>(d.latent.compared), static_cast<long long>(d.rope_outside))));
  }
  {
    size_t bad_entries = 0, stray = 0;
    std::vector<uint8_t> want(kEntryBytes);
    std::vector<bool> step_slot(cache0.size() / kEntryBytes, false);
    for (int t = 0; t < m; ++t) {
      const int64_t slot = p.inputs.slot_mapping[t];
      step_slot[size_t(slot)] = true;
      reference::v32_quantize_token(&g.kv_c[size_t(t) * L], &g.k_pe[size_t(t) * R], want.data());
      bad_entries += std::memcmp(&g.cache[size_t(slot) * kEntryBytes], want.data(), kEntryBytes) != 0;
    }
    for (size_t slot = 0; slot < step_slot.size(); ++slot) {
      if (!step_slot[slot]) {
        stray += std::memcmp(&g.cache[slot * kEntryBytes], &cache0[slot * kEntryBytes], kEntryBytes) != 0;
      }
    }
    checks.push_back(judged("sparse_mla_v32_cache_write: 656-byte entries bit for bit", bad_entries == 0 && stray == 0,
                            format("%zu of %d step entries differ from vLLM's rule on the GPU's kv_c and rotated k_pe; "
                                   "%zu other entries changed",
                                   bad_entries, m, stray)));
  }
  {
    const reference::IndexerProjectionBitsHost want = reference_indexer_project_gemv(s, w, g.q_c, p.inputs.hidden);
    const size_t bad = differing(g.index_q, want.index_q) + differing(g.index_k, want.index_k) +
                       differing(g.head_weights, want.head_weights);
    checks.push_back(judged("indexer_project_gemv (no gate) bit for bit", bad == 0,
                            format("%zu of %zu index_q, index_k and head_weights values differ from the reference on "
                                   "the GPU's q_c%s",
                                   bad, want.index_q.size() + want.index_k.size() + want.head_weights.size(),
                                   chain_ulps(g.index_q, p.projections.index_q).c_str())));
  }
  checks.push_back(bitwise("indexer_prefill: the K cache bit for bit", k_cache_after_prefill,
                           p.indexer_k_cache_after_prefill,
                           format(" (%lld context keys, RoPE on the first %d dims)",
                                  static_cast<long long>(s.context), R)));

  // prepare, select and remap on the GPU's state after its prefill (checked above).
  IndexerHostState state = make_indexer_state(s);
  state.k_cache = k_cache_after_prefill;
  reference::IndexerStateHost view = state.view();
  reference::IndexerParamsHost params{w.index_k_norm_weight.data(), w.index_k_norm_bias.data(), w.index_ape.data()};
  params.cos_sin = p.tables.indexer_table.data();
  params.cos_sin_rows = p.tables.rows;
  params.cos_sin_row_stride = R;
  const reference::IndexerStepHost step{m,       g.index_q.data(),           g.index_k.data(),
                                        g.head_weights.data(), nullptr, p.inputs.positions.data(),
                                        p.inputs.token_requests.data()};
  reference::IndexerQueryHost query;
  int64_t errors = 0;
  if (const Status st = reference::indexer_prepare(p.plan, step, params, view, &query, &errors); !st.ok()) {
    checks.push_back(judged("indexer_prepare", false, "the reference failed: " + st.to_string()));
    return checks;
  }
  checks.push_back(judged("indexer_prepare: q codes, folded weights, K cache bit for bit",
                          differing(g.q_fp8, query.q_fp8) == 0 && differing(g.q_weights, query.head_weights) == 0 &&
                              differing(g.k_cache, state.k_cache) == 0,
                          format("%zu of %zu q codes, %zu of %zu folded weights, %zu of %zu K-cache bytes differ from "
                                 "the reference on the GPU's projections",
                                 differing(g.q_fp8, query.q_fp8), query.q_fp8.size(),
                                 differing(g.q_weights, query.head_weights), query.head_weights.size(),
                                 differing(g.k_cache, state.k_cache), state.k_cache.size())));
  reference::IndexerRowsHost rows;
  Status selected;
  std::string logit_text;
  if (p.plan.logits == IndexerLogits::kExact) {
    selected = reference::indexer_select(p.plan, step, query, view, &rows);
    logit_text = "exact logits: the reference's selection";
  } else {
    const IndexerWorkspaceLayout layout = indexer_workspace_layout(p.plan);
    std::vector<std::vector<float>> logits(m);
    int64_t outside = 0, scored = 0;
    double worst = 0;
    for (int t = 0; t < m; ++t) {
      const int64_t n = p.inputs.positions[t] + 1;  // pool 1: a logit per token
      const float* row = &g.logits[size_t(t) * layout.logits_stride];
      if (n > p.plan.topk) {
        logits[t].assign(row, row + n);
        const reference::LogitDeviation d = reference::indexer_logit_deviation(
            p.plan, view, p.inputs.token_requests[t], n, &query.q_fp8[size_t(t) * HI * kIndexerDim],
            &query.head_weights[size_t(t) * HI], row);
        outside += d.outside;
        worst = std::max(worst, d.worst);
        scored += n;
      }
    }
    selected = reference::indexer_select_on_logits(p.plan, step, logits, view, &rows);
    logit_text = format("FP32-accumulated logits: %lld of %lld outside their bound (worst %.2f of it); the selection "
                        "over the GPU's logits",
                        static_cast<long long>(outside), static_cast<long long>(scored), worst);
    if (outside > 0) selected = invalid_argument("logits", "within indexer_logit_bounds", std::to_string(outside));
  }
  // (The fused path's select writes the slots only.)
  const size_t positions_differing =
      kernels.positions_kept ? differing(g.topk_positions, rows.topk_positions) : size_t{0};
  checks.push_back(judged("indexer_select: rows bit for bit",
                          selected.ok() && positions_differing == 0 && differing(g.slots, rows.slots) == 0,
                          format("%s; %s%zu slots differ%s", logit_text.c_str(),
                                 kernels.positions_kept
                                     ? format("%zu of %zu positions and ", positions_differing,
                                              rows.topk_positions.size())
                                           .c_str()
                                     : "",
                                 differing(g.slots, rows.slots),
                                 selected.ok() ? "" : ("; " + selected.to_string()).c_str())));
  if (kernels.remap) {
    reference::IndexerRowsHost remapped;
    const Status st = reference::indexer_remap(p.plan, step, view, g.topk_positions, &remapped);
    checks.push_back(judged("indexer_remap bit for bit", st.ok() && differing(g.remapped, remapped.slots) == 0 &&
                                                             differing(g.remapped, g.slots) == 0,
                            format("%zu of %zu slots differ from the reference's remap of the GPU's positions, %zu "
                                   "from the select's own slots",
                                   differing(g.remapped, remapped.slots), remapped.slots.size(),
                                   differing(g.remapped, g.slots))));
  }
  {
    reference::SparseMlaV32Host a{};
    a.q = g.q_absorbed.data();
    a.q_token_stride = int64_t{H} * (L + R);
    a.q_head_stride = L + R;
    a.cache = g.cache.data();
    a.blocks = s.cache_blocks();
    a.block_size = kCacheBlockSize;
    a.block_stride = int64_t{kCacheBlockSize} * kEntryBytes;
    a.entry_stride = kEntryBytes;
    a.indices = g.remapped.data();
    a.indices_token_stride = W;
    a.m = m;
    a.heads = H;
    a.top_k = W;
    a.softmax_scale = s.softmax_scale;
    reference::SparseMlaV32Result got;
    got.latent = g.latent;
    got.lse = g.lse;
    checks.push_back(check_sparse_mla_v32_vs_float64(s, a, got, "sparse_mla_v32 vs float64 (one pass)"));
  }
  if (!kernels.value_up_head_gemv) {
    checks.push_back(reordered("value-up (cuBLAS bmm) vs the CPU reference", g.heads,
                               reference_value_up(s, w, g.latent, value_up_tactic(s)), "latent"));
  } else if (s.head_gemv_sums == HeadGemvSums::kSeedOrder) {
    checks.push_back(bitwise("value-up (head_gemv, seed order) bit for bit", g.heads,
                             reference_value_up(s, w, g.latent, value_up_tactic(s)), ""));
  } else {
    const reference::HeadGemvDeviation d = value_up_deviation(s, w, g.latent, g.heads);
    checks.push_back(judged("value-up (head_gemv, tensor cores) within its bound", d.outside == 0 && d.compared > 0,
                            format("%lld of %lld outside 2^-14 x sum |products|, %lld differ from the rounded exact "
                                   "sum (by at most %d ulps); on the GPU's latent",
                                   static_cast<long long>(d.outside), static_cast<long long>(d.compared),
                                   static_cast<long long>(d.differing), d.max_steps)));
  }
  checks.push_back(projection_check("o_proj", kernels.o_proj_gemv, g.out, g.heads, m, int64_t{H} * s.V, w.o_proj,
                                    s.D, "heads", chain_ulps(g.out, p.out)));
  {
    std::string counts;
    unsigned int total = 0;
    for (size_t c = 0; c < g.errors.size(); ++c) {
      counts += format("%s%s %u", c ? ", " : "", c < g.error_names.size() ? g.error_names[c].c_str() : "?",
                       g.errors[c]);
      total += g.errors[c];
    }
    checks.push_back(judged("error counters zero", total == 0, counts));
  }
  size_t shared = 0;
  for (int t = 0; t < m; ++t) {
    std::vector<int32_t> a = slice(g.remapped, size_t(t) * W, W), b = slice(p.rows.slots, size_t(t) * W, W);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    std::vector<int32_t> both;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
    shared += size_t(std::count_if(both.begin(), both.end(), [](int32_t v) { return v >= 0; }));
  }
  checks.push_back(reported("the GPU chain against the CPU chain (end to end)",
                            format("out: %.2f BF16 ulps (at the values' scale) from the CPU chain's (fingerprints "
                                   "%016llx, %016llx); %zu selected slots shared with the CPU chain's rows",
                                   bf16_error_in_scale_ulps(g.out, p.out),
                                   static_cast<unsigned long long>(fingerprint(g.out)),
                                   static_cast<unsigned long long>(fingerprint(p.out)), shared)));
  return checks;
}

// ---------------------------------------------------------------- the stage

// Launches per timed graph at the least (the graph launch's overhead spread
// over them), a whole number of rotations of the stages.
constexpr int kMinLaunchesPerGraph = 20;
// The stock path's output against the fused path's: they differ in the
// projections' and value-up's summation orders only, which the attention
// carries into out (the NoPE path's tolerance).
constexpr double kFusedVsStockTolerance = 2e-2;

// One copy of the layer's weights, copied on the device from the chain's.
struct WeightCopy {
  bench::DeviceMemory qkv, q_gamma, kv_gamma, q_b, w_uk_t, w_uv, o, wq_b, wk, weights_proj, k_norm_weight,
      k_norm_bias;
};

Status copy_on_device(const bench::DeviceMemory& from, bench::DeviceMemory* to, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(to->allocate(from.bytes()));
  DSA_CUDA_RETURN(cudaMemcpyAsync(to->get(), from.get(), from.bytes(), cudaMemcpyDeviceToDevice, stream));
  return Status();
}

// The library's stage on the chain's layer and step: one stage per weight
// copy (rotated between timed steps, so that weights come from memory, as
// the layers of a model), all sharing one workspace; its own KV cache and
// indexer K cache (the chain's state before the step: the context's entries
// and the prefilled keys), the chain's step inputs.
class RopeStageRun {
 public:
  Status init(const StepShape& s, const RopeGpuChain& chain, const std::vector<uint8_t>& cache0,
              const std::vector<uint8_t>& k_cache_after_prefill, const DsaLayerConfig& config, const DsaStagePlan& plan,
              int copies, cudaStream_t stream) {
    s_ = s;
    chain_ = &chain;
    cache0_ = &cache0;
    k_cache0_ = &k_cache_after_prefill;
    copies_.resize(size_t(copies));
    for (WeightCopy& c : copies_) {
      DSA_RETURN_IF_ERROR(copy_on_device(chain.w_qkv, &c.qkv, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.q_gamma, &c.q_gamma, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.kv_gamma, &c.kv_gamma, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.w_q_b, &c.q_b, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.w_uk_t, &c.w_uk_t, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.w_uv, &c.w_uv, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.w_o, &c.o, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.wq_b, &c.wq_b, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.wk, &c.wk, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.weights_proj, &c.weights_proj, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.k_norm_weight, &c.k_norm_weight, stream));
      DSA_RETURN_IF_ERROR(copy_on_device(chain.k_norm_bias, &c.k_norm_bias, stream));
    }
    DSA_RETURN_IF_ERROR(upload(cache0, &cache_, stream));
    DSA_RETURN_IF_ERROR(upload(k_cache_after_prefill, &k_cache_, stream));
    DSA_RETURN_IF_ERROR(allocate_filled(size_t(s.m) * s.D * 2, kPoisonByte, &out_, stream));
    DSA_RETURN_IF_ERROR(allocate_filled(sizeof(unsigned int), 0, &errors_, stream));
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    stages_.resize(copies_.size());
    std::shared_ptr<DsaStageWorkspace> workspace;
    for (size_t c = 0; c < copies_.size(); ++c) {
      const Status created = DsaAttentionStage::create(config, weights(copies_[c]), plan, &stages_[c], workspace);
      if (!created.ok()) return Status(created.code(), "creating the stage: " + created.message());
      if (c == 0) workspace = stages_[0]->workspace();
    }
    return Status();
  }

  DsaAttentionStage& stage(size_t i) { return *stages_[i % stages_.size()]; }
  size_t copies() const { return stages_.size(); }

  DsaStepArgs args() const {
    const int64_t m = s_.m;
    DsaStepArgs a;
    a.hidden = bf16(chain_->hidden, {m, s_.D});
    a.positions = make_tensor(chain_->positions.get(), DType::kI64, {m});
    a.token_requests = make_tensor(chain_->token_requests.get(), DType::kI32, {m});
    a.slot_mapping = make_tensor(chain_->slot_mapping.get(), DType::kI64, {m});
    a.kv_cache = make_tensor(cache_.get(), DType::kU8, {s_.cache_blocks(), kCacheBlockSize, kEntryBytes});
    a.indexer = IndexerState{
        make_tensor(chain_->block_table.get(), DType::kI32, {s_.indexer_requests(), s_.cache_blocks()}), TensorView(),
        make_tensor(k_cache_.get(), DType::kU8, {s_.cache_blocks(), s_.indexer_page_bytes()})};
    a.out = bf16(out_, {m, s_.D});
    a.error_count = errors_.as<unsigned int>();
    return a;
  }

  // One path of stage 0 from the state before the step (caches as the
  // chain found them, out poisoned, no errors counted), its products downloaded.
  Status run(DsaPath path, cudaStream_t stream, GpuProducts* g) {
    DSA_CUDA_RETURN(cudaMemcpyAsync(cache_.get(), cache0_->data(), cache0_->size(), cudaMemcpyHostToDevice, stream));
    DSA_CUDA_RETURN(
        cudaMemcpyAsync(k_cache_.get(), k_cache0_->data(), k_cache0_->size(), cudaMemcpyHostToDevice, stream));
    DSA_CUDA_RETURN(cudaMemsetAsync(out_.get(), kPoisonByte, out_.bytes(), stream));
    DSA_CUDA_RETURN(cudaMemsetAsync(errors_.get(), 0, errors_.bytes(), stream));
    DsaAttentionStage& st = stage(0);
    DSA_RETURN_IF_ERROR(path == DsaPath::kFused ? st.forward(args(), stream) : st.stock_forward(args(), stream));
    DSA_CUDA_RETURN(cudaStreamSynchronize(stream));
    const DsaStageIntermediates v = st.intermediates(s_.m);
    DSA_RETURN_IF_ERROR(download_view(v.qkv, &g->qkv));
    DSA_RETURN_IF_ERROR(download_view(v.q_c, &g->q_c));
    DSA_RETURN_IF_ERROR(download_view(v.kv_c, &g->kv_c));
    DSA_RETURN_IF_ERROR(download_view(v.q, &g->q));
    DSA_RETURN_IF_ERROR(download_view(v.q_absorbed, &g->q_absorbed));
    DSA_RETURN_IF_ERROR(download_view(v.k_pe, &g->k_pe));
    DSA_RETURN_IF_ERROR(download_view(v.index_q, &g->index_q));
    DSA_RETURN_IF_ERROR(download_view(v.index_k, &g->index_k));
    DSA_RETURN_IF_ERROR(download_view(v.head_weights, &g->head_weights));
    DSA_RETURN_IF_ERROR(download_view(v.latent, &g->latent));
    DSA_RETURN_IF_ERROR(download_view(v.lse, &g->lse));
    DSA_RETURN_IF_ERROR(download_view(v.heads, &g->heads));
    DSA_RETURN_IF_ERROR(download_view(v.slots, &g->slots));
    g->remapped = g->slots;  // the attention read the select's slots
    if (path == DsaPath::kStock) {
      DSA_RETURN_IF_ERROR(download_view(v.topk_positions, &g->topk_positions));
    } else {
      g->topk_positions.clear();
    }
    DSA_RETURN_IF_ERROR(download_view(bf16(out_, {s_.m, s_.D}), &g->out));
    DSA_RETURN_IF_ERROR(download(cache_, cache_.bytes(), &g->cache, stream));
    DSA_RETURN_IF_ERROR(download(k_cache_, k_cache_.bytes(), &g->k_cache, stream));
    DSA_RETURN_IF_ERROR(download(errors_, 1, &g->errors, stream));
    g->error_names = {"stage"};
    std::vector<uint8_t> workspace;
    DSA_RETURN_IF_ERROR(download_view(v.indexer_workspace, &workspace));
    const IndexerWorkspaceLayout layout = indexer_workspace_layout(chain_->plan_);
    const size_t m = size_t(s_.m), HI = size_t(chain_->plan_.heads);
    g->q_fp8.assign(workspace.begin() + layout.q_fp8, workspace.begin() + layout.q_fp8 + m * HI * kIndexerDim);
    g->q_weights.resize(m * HI);
    std::memcpy(g->q_weights.data(), workspace.data() + layout.head_weights, m * HI * sizeof(float));
    g->logits.resize(m * size_t(layout.logits_stride));
    std::memcpy(g->logits.data(), workspace.data() + layout.logits, g->logits.size() * sizeof(float));
    return Status();
  }

 private:
  DsaLayerWeights weights(const WeightCopy& c) const {
    const int64_t H = s_.H, P = s_.P, L = s_.L, HI = chain_->plan_.heads;
    DsaLayerWeights w;
    w.fused_qkv_a_proj = bf16(c.qkv, {s_.qkv_width(), s_.D});
    w.q_a_norm = bf16(c.q_gamma, {s_.Q});
    w.kv_a_norm = bf16(c.kv_gamma, {L});
    w.q_b_proj = bf16(c.q_b, {s_.q_width(), s_.Q});
    w.w_uk_t = bf16(c.w_uk_t, {H, P, L});
    w.w_uv = bf16(c.w_uv, {H, L, s_.V});
    w.o_proj = bf16(c.o, {s_.D, H * s_.V});
    w.index_wq_b = bf16(c.wq_b, {HI * kIndexerDim, s_.Q});
    w.index_wk = bf16(c.wk, {kIndexerDim, s_.D});
    w.index_weights_proj = bf16(c.weights_proj, {HI, s_.D});
    w.index_k_norm_weight = make_tensor(c.k_norm_weight.get(), DType::kF32, {kIndexerDim});
    w.index_k_norm_bias = make_tensor(c.k_norm_bias.get(), DType::kF32, {kIndexerDim});
    return w;
  }

  // A view's elements into `host` (the device synchronized by the caller).
  template <class T>
  static Status download_view(const TensorView& v, std::vector<T>* host) {
    host->resize(size_t(v.numel()));
    if (host->empty()) return Status();
    DSA_CUDA_RETURN(cudaMemcpy(host->data(), v.data, host->size() * sizeof(T), cudaMemcpyDeviceToHost));
    return Status();
  }

  StepShape s_{};
  const RopeGpuChain* chain_ = nullptr;
  const std::vector<uint8_t>* cache0_ = nullptr;
  const std::vector<uint8_t>* k_cache0_ = nullptr;
  std::vector<WeightCopy> copies_;
  std::vector<std::unique_ptr<DsaAttentionStage>> stages_;
  bench::DeviceMemory cache_, k_cache_, out_, errors_;
};

// Weight copies whose rotation keeps the smallest weight out of L2 between
// two reads (dsa-decode's NoPE rule, at the RoPE widths).
int rope_weight_copies(const bench::Context& ctx, const StepShape& s) {
  const size_t smallest =
      2 * std::min({size_t(s.q_width()) * s.Q, size_t(s.H) * s.P * s.L, size_t(s.H) * s.L * s.V,
                    size_t(s.index_heads) * kIndexerDim * s.Q, size_t(s.qkv_width()) * s.D, size_t(s.D) * s.H * s.V});
  return bench::cold_copies(ctx, smallest);
}

// Which kernel each product of a path ran, from its step names.
ProductKernels path_kernels(const std::vector<std::string>& names, DsaPath path) {
  const auto ran = [&](const char* name) { return std::count(names.begin(), names.end(), name) > 0; };
  ProductKernels k;
  k.qkv_a_proj_gemv = ran("qkv_a_proj (GEMV)");
  k.q_b_proj_gemv = ran("q_b_proj (GEMV)");
  k.o_proj_gemv = ran("o_proj (GEMV)");
  k.value_up_head_gemv = ran("value_up (head_gemv)");
  k.positions_kept = path == DsaPath::kStock;
  k.remap = false;
  return k;
}

// The stage's checks: each path's products against the CPU chain's reference
// of its kernel (the chain's checks, on the path's own inputs), the fused
// path against the GPU chain (bit for bit where it ran the chain's kernels),
// the stock path against the fused one.
std::vector<Check> check_stage(const StepShape& s, const RopeChainProducts& p, const std::vector<uint8_t>& cache0,
                               const std::vector<uint8_t>& k_cache_after_prefill, const GpuProducts& chain,
                               const GpuProducts& fused, const ProductKernels& fused_kernels,
                               const GpuProducts& stock, const ProductKernels& stock_kernels) {
  std::vector<Check> checks;
  for (const auto& [g, kernels, path] : {std::tuple{&fused, &fused_kernels, "fused"},
                                          std::tuple{&stock, &stock_kernels, "stock"}}) {
    for (Check c : check_gpu_chain(s, p, cache0, k_cache_after_prefill, *g, *kernels)) {
      c.name = std::string("stage ") + path + ": " + c.name;
      checks.push_back(std::move(c));
    }
  }
  const bool chain_kernels_ran = fused_kernels.qkv_a_proj_gemv && fused_kernels.q_b_proj_gemv &&
                                 fused_kernels.o_proj_gemv && fused_kernels.value_up_head_gemv;
  const std::string fused_vs_chain = format(
      "out %.2f BF16 ulps from the GPU chain's; KV cache %zu and indexer K cache %zu bytes differ; %zu slots differ",
      bf16_error_in_scale_ulps(fused.out, chain.out), differing(fused.cache, chain.cache),
      differing(fused.k_cache, chain.k_cache), differing(fused.slots, chain.remapped));
  if (chain_kernels_ran) {
    checks.push_back(judged("stage fused == the GPU chain bit for bit (the same kernels)",
                            fused.out == chain.out && fused.cache == chain.cache && fused.k_cache == chain.k_cache &&
                                fused.slots == chain.remapped && fused.latent == chain.latent,
                            fused_vs_chain));
  } else {
    checks.push_back(reported("stage fused vs the GPU chain (cuBLASLt or cuBLAS bmm at this m)", fused_vs_chain));
  }
  checks.push_back(judged("stage stock vs fused: KV cache, indexer K cache and slots bit for bit",
                          stock.cache == fused.cache && stock.k_cache == fused.k_cache && stock.slots == fused.slots,
                          format("%zu KV cache bytes, %zu K cache bytes, %zu slots differ (the same qkv_a_proj, norm, "
                                 "rotation, cache write and indexer)",
                                 differing(stock.cache, fused.cache), differing(stock.k_cache, fused.k_cache),
                                 differing(stock.slots, fused.slots))));
  std::vector<double> fused_out(fused.out.size());
  for (size_t i = 0; i < fused.out.size(); ++i) fused_out[i] = num::bf16_to_float(fused.out[i]);
  const double stock_error = reference::relative_frobenius(stock.out, fused_out);
  checks.push_back(judged("stage stock vs fused: out", stock_error <= kFusedVsStockTolerance,
                          format("relative Frobenius error %.2e (tolerance %.0e): the projections' and value-up's "
                                 "orders differ",
                                 stock_error, kFusedVsStockTolerance)));
  return checks;
}

struct StageTiming {
  std::string path, step;
  double us = 0;
};

// Each step of each path alone, both paths' attention halves (every step
// between qkv_a_proj and o_proj) and whole stages, as CUDA-graph replays
// that walk the stages in turn (cold weights).
Status time_stage(const bench::Context& ctx, RopeStageRun& run, int replays, std::vector<StageTiming>* timings) {
  const int copies = static_cast<int>(run.copies());
  const int per_graph = copies * ((kMinLaunchesPerGraph + copies - 1) / copies);
  const DsaStepArgs args = run.args();
  const auto time_steps = [&](DsaPath path, size_t first, size_t count, double* us) {
    return bench::time_graph(
        ctx,
        [&](cudaStream_t stream, int i) {
          DsaAttentionStage& stage = run.stage(size_t(i));
          if (count != DsaAttentionStage::kAllSteps) return stage.run_steps(path, args, first, count, stream);
          return path == DsaPath::kFused ? stage.forward(args, stream) : stage.stock_forward(args, stream);
        },
        us, per_graph, replays);
  };
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    const char* name = path == DsaPath::kFused ? "fused" : "stock";
    std::vector<std::string> steps;
    DSA_RETURN_IF_ERROR(run.stage(0).step_names(path, args, &steps));
    for (size_t i = 0; i < steps.size(); ++i) {
      StageTiming t{name, steps[i]};
      DSA_RETURN_IF_ERROR(time_steps(path, i, 1, &t.us));
      timings->push_back(t);
    }
    StageTiming half{name, "attention half (norm .. value_up)"};
    DSA_RETURN_IF_ERROR(time_steps(path, 1, steps.size() - 2, &half.us));
    timings->push_back(half);
    StageTiming whole{name, "whole stage (qkv_a_proj .. o_proj)"};
    DSA_RETURN_IF_ERROR(time_steps(path, 0, DsaAttentionStage::kAllSteps, &whole.us));
    timings->push_back(whole);
  }
  return Status();
}

// The stage at the preset: created on the chain's layer, both paths run and
// checked, then timed. Returns the checks (appended to `checks`).
Status run_stage(const StepShape& s, const Options& options, const RopeChainProducts& p, const RopeGpuChain& chain,
                 const std::vector<uint8_t>& cache0, const std::vector<uint8_t>& k_cache_after_prefill,
                 const GpuProducts& chain_products, const bench::Context& ctx, std::vector<Check>* checks,
                 std::vector<StageStepTime>* times, int* weight_copies) {
  const DsaLayerConfig config = dsa_layer_config(s.per_rank, p.weights.eps);
  DsaStagePlan plan = s.stage_plan();
  plan.projection_gemv_tokens = projection_gemv_tokens(options);
  const int copies = rope_weight_copies(ctx, s);
  *weight_copies = copies;
  RopeStageRun run;
  DSA_RETURN_IF_ERROR(run.init(s, chain, cache0, k_cache_after_prefill, config, plan, copies, ctx.stream));
  std::printf("\nthe library's stage (DsaAttentionStage) on the same layer and step: %d weight copies, one stage "
              "each (one workspace), its own KV cache and indexer K cache from the chain's state before the step; "
              "rotaries from rope_preset_config, softmax scale %.7g\n",
              copies, config.softmax_scale);
  std::vector<std::string> names[2];
  for (DsaPath path : {DsaPath::kFused, DsaPath::kStock}) {
    std::vector<std::string>& list = names[path == DsaPath::kFused ? 0 : 1];
    DSA_RETURN_IF_ERROR(run.stage(0).step_names(path, run.args(), &list));
    std::string text;
    for (const std::string& name : list) text += (text.empty() ? "" : ", ") + name;
    std::printf("%s path, %zu steps: %s\n", path == DsaPath::kFused ? "fused" : "stock", list.size(), text.c_str());
  }
  GpuProducts fused, stock;
  DSA_RETURN_IF_ERROR(run.run(DsaPath::kFused, ctx.stream, &fused));
  DSA_RETURN_IF_ERROR(run.run(DsaPath::kStock, ctx.stream, &stock));
  const std::vector<Check> stage_checks =
      check_stage(s, p, cache0, k_cache_after_prefill, chain_products, fused, path_kernels(names[0], DsaPath::kFused),
                  stock, path_kernels(names[1], DsaPath::kStock));
  std::printf("\nchecks of the stage: each product of each path against the CPU chain's reference of its kernel, on "
              "the path's own inputs; fused against the GPU chain, stock against fused\n");
  for (const Check& check : stage_checks) print_check(check);
  checks->insert(checks->end(), stage_checks.begin(), stage_checks.end());

  std::vector<StageTiming> timings;
  DSA_RETURN_IF_ERROR(time_stage(ctx, run, options.steps, &timings));
  std::printf("\nstage on %s: CUDA-graph replay, %d weight copies rotated, median of %d replays (us)\n",
              ctx.gpu_name.c_str(), copies, options.steps);
  double whole[2] = {0, 0}, half[2] = {0, 0};
  for (const StageTiming& t : timings) {
    times->push_back(StageStepTime{t.path, t.step, t.us});
    std::printf("  %-6s %-44s %8.1f\n", t.path.c_str(), t.step.c_str(), t.us);
    const int i = t.path == "fused" ? 0 : 1;
    if (t.step.rfind("whole stage", 0) == 0) whole[i] = t.us;
    if (t.step.rfind("attention half", 0) == 0) half[i] = t.us;
  }
  std::printf("fused vs stock: attention half %.1f / %.1f us (%.2fx), whole stage %.1f / %.1f us (%.2fx)\n", half[0],
              half[1], half[0] > 0 ? half[1] / half[0] : 0.0, whole[0], whole[1],
              whole[0] > 0 ? whole[1] / whole[0] : 0.0);
  return Status();
}

}  // namespace

int run_gpu_path_rope(const StepShape& s, const Options& options) {
  const auto started = std::chrono::steady_clock::now();
  std::printf("the %s step kernel by kernel through the library's public functions (then through the stage, "
              "checked against it): linear_gemv qkv_a_proj, qkv_rmsnorm, linear_gemv q_b_proj, rope_absorb, "
              "sparse_mla_v32_cache_write, indexer_project_gemv, indexer_prepare, indexer_select, indexer_remap "
              "(%d heads, top-%d, %s logits; K cache prefilled with the %lld context keys), sparse_mla_v32, "
              "head_gemv value-up (%s), linear_gemv o_proj; one stream, PDL; synthetic layer of seed %llu at %s\n",
              s.preset.c_str(), s.index_heads, s.index_topk,
              s.indexer_logits == IndexerLogits::kExact ? "exact" : "FP32-accumulated",
              static_cast<long long>(s.context),
              s.head_gemv_sums == HeadGemvSums::kSeedOrder ? "seed order" : "tensor cores",
              static_cast<unsigned long long>(options.seed), s.describe().c_str());
  RopeChainResult chain;
  RopeChainProducts p;
  if (const Status st = run_rope_chain(s, options.seed, RopeChainBreak::kNone, &chain, &p); !st.ok()) {
    std::fprintf(stderr, "dsa-decode: the CPU chain: %s\n", st.to_string().c_str());
    return kExitFailure;
  }
  p.plan.logits = s.indexer_logits;
  const size_t cpu_failed = failed_checks(chain.checks);
  std::printf("the CPU chain (tools/rope_chain.h): %zu of %zu checks against float64 failed (%.0f ms)\n", cpu_failed,
              judged_checks(chain.checks), chain.chain_ms);
  const std::vector<uint8_t> cache0 = make_rope_cache(s, options.seed);

  OwnedStream stream;
  RopeGpuChain gpu;
  GpuProducts g;
  std::vector<uint8_t> k_cache_after_prefill;
  double step_us = 0;
  const auto fail = [&](const Status& st) {
    std::fprintf(stderr, "dsa-decode: %s\n", st.to_string().c_str());
    return kExitFailure;
  };
  if (const Status st = stream.create(); !st.ok()) return fail(st);
  if (const Status st = gpu.init(s, p, cache0, stream.get()); !st.ok()) return fail(st);
  if (const Status st = gpu.prefill(p, stream.get()); !st.ok()) return fail(st);
  if (const Status st = download(gpu.k_cache, gpu.k_cache.bytes(), &k_cache_after_prefill, stream.get()); !st.ok()) {
    return fail(st);
  }
  if (const Status st = gpu.enqueue(stream.get()); !st.ok()) return fail(st);
  if (const Status st = download_products(gpu, s, stream.get(), &g); !st.ok()) return fail(st);

  std::printf("\n%-12s %-34s  %-16s  %-16s  %s\n", "kernel", "output", "GPU fingerprint", "CPU chain's",
              "first values (token 0, GPU)");
  const auto row = [&](const char* kernel, const std::string& output, uint64_t gpu_print, uint64_t cpu_print,
                       const std::string& values) {
    std::printf("%-12s %-34s  %016llx  %016llx  %s\n", kernel, output.c_str(),
                static_cast<unsigned long long>(gpu_print), static_cast<unsigned long long>(cpu_print), values.c_str());
  };
  const auto first = [](const std::vector<uint16_t>& v, size_t offset = 0) {
    std::string text;
    for (size_t i = offset; i < v.size() && i < offset + 4; ++i) {
      text += format("%s%.4g", i > offset ? " " : "", num::bf16_to_float(v[i]));
    }
    return text;
  };
  std::vector<uint8_t> step_entries;
  for (int t = 0; t < s.m; ++t) {
    const size_t slot = size_t(p.inputs.slot_mapping[t]);
    step_entries.insert(step_entries.end(), g.cache.begin() + slot * kEntryBytes,
                        g.cache.begin() + (slot + 1) * kEntryBytes);
  }
  row("qkv_a_proj", "qkv " + shape_text({s.m, s.qkv_width()}), fingerprint(g.qkv), fingerprint(p.qkv), first(g.qkv));
  row("norm", "q_c " + shape_text({s.m, s.Q}), fingerprint(g.q_c), fingerprint(p.q_c), first(g.q_c));
  row("", "kv_c " + shape_text({s.m, s.L}), fingerprint(g.kv_c), fingerprint(p.kv_c), first(g.kv_c));
  row("q_b_proj", "q " + shape_text({s.m, s.H, s.P + s.R}), fingerprint(g.q), fingerprint(p.q), first(g.q));
  row("rope_absorb", "q " + shape_text({s.m, s.H, s.L + s.R}), fingerprint(g.q_absorbed), fingerprint(p.q_absorbed),
      first(g.q_absorbed) + " | rope " + first(g.q_absorbed, size_t(s.L)));
  row("", "k_pe " + shape_text({s.m, s.R}) + " (rotated)", fingerprint(g.k_pe), fingerprint(p.k_pe), first(g.k_pe));
  row("cache write", "entries " + shape_text({s.m, kEntryBytes}) + " bytes", fingerprint(step_entries),
      fingerprint(p.entries), "");
  row("indexer proj", "index_q " + shape_text({s.m, s.index_heads, kIndexerDim}), fingerprint(g.index_q),
      fingerprint(p.projections.index_q), first(g.index_q));
  row("indexer", "slots " + shape_text({s.m, gpu.W}) + " int32", fingerprint(g.remapped), fingerprint(p.rows.slots),
      format("%d %d %d %d", g.remapped[0], g.remapped[1], g.remapped[2], g.remapped[3]));
  row("attention", "latent " + shape_text({s.m, s.H, s.L}), fingerprint(g.latent), fingerprint(p.latent),
      first(g.latent));
  row("value_up", "heads " + shape_text({s.m, s.H, s.V}), fingerprint(g.heads), fingerprint(p.heads), first(g.heads));
  row("o_proj", "out " + shape_text({s.m, s.D}), fingerprint(g.out), fingerprint(p.out), first(g.out));

  const std::vector<Check> checks = check_gpu_chain(s, p, cache0, k_cache_after_prefill, g);
  std::printf("\nchecks: each GPU product against the CPU chain's reference of its kernel, on the GPU's own inputs\n");
  for (const Check& check : checks) print_check(check);

  // The whole chain by CUDA-graph replay. Replays rewrite the same bytes: the
  // cache write and prepare write the step's own slots and keys, from the same
  // inputs, and select only reads the state (DeviceLayer::step_args says why).
  bench::Context ctx;
  Status timed = bench::open_context(stream.get(), /*quick=*/false, &ctx);
  if (timed.ok()) {
    timed = bench::time_graph(
        ctx, [&](cudaStream_t st, int) { return gpu.enqueue(st); }, &step_us, kChainsPerGraph, options.steps);
  }
  if (!timed.ok()) return fail(timed);
  std::printf("\nGPU chain on %s: %.1f us a step (CUDA-graph replay, %d steps a graph, median of %d replays; one "
              "copy of the weights, not rotated)\n",
              ctx.gpu_name.c_str(), step_us, kChainsPerGraph, options.steps);

  // The stage on the same layer and step: both paths checked, then timed.
  std::vector<Check> stage_checks;
  std::vector<StageStepTime> stage_times;
  int copies = 0;
  if (const Status st = run_stage(s, options, p, gpu, cache0, k_cache_after_prefill, g, ctx, &stage_checks,
                                  &stage_times, &copies);
      !st.ok()) {
    return fail(st);
  }
  // --json and --report: the chain's and the stage's checks and the stage's timings (report.h).
  if (!options.json_path.empty() || !options.report_path.empty()) {
    std::vector<Check> all = checks;
    all.insert(all.end(), stage_checks.begin(), stage_checks.end());
    RunReport report;
    Status written =
        rope_run_report(s, options, ctx.gpu_name, ctx.copy_GBps, copies, all, stage_times, step_us, &report);
    if (written.ok()) written = write_run_reports(report, options);
    if (!written.ok()) return fail(written);
  }

  const size_t failed = failed_checks(checks) + cpu_failed, judged_count = judged_checks(checks);
  const size_t stage_failed = failed_checks(stage_checks), stage_judged = judged_checks(stage_checks);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("\n");
  if (failed > 0) {
    std::printf("FAIL: %zu of %zu checks of the GPU chain failed (%zu of the CPU chain's) (%.1f s)\n",
                failed - cpu_failed, judged_count, cpu_failed, elapsed);
  } else {
    std::printf("PASS: %zu of %zu checks of the GPU chain (and the CPU chain's %zu) (%.1f s)\n", judged_count,
                judged_count, judged_checks(chain.checks), elapsed);
  }
  if (stage_failed > 0) {
    std::printf("FAIL: %zu of %zu checks of the stage failed\n", stage_failed, stage_judged);
  } else {
    std::printf("PASS: %zu of %zu checks of the stage\n", stage_judged, stage_judged);
  }
  std::fflush(stdout);
  return failed > 0 || stage_failed > 0 ? kExitFailure : kExitOk;
}

}  // namespace dsa::cli
