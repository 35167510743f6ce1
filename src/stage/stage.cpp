// DsaAttentionStage (include/dsa_decode/stage.h): the creation checks, the
// workspace, and each path as a list of steps, every step one library call.
#include "dsa_decode/stage.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "core/device_memory.h"
#include "core/linear.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "dsa_decode/stock.h"
#include "sparse_mla_v32/sparse_mla_v32_plan.h"
#include "stage/stage_steps.h"

namespace dsa {

namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // cuBLAS's advice for Hopper
constexpr int64_t kLatentWidth = 512;                       // the attention kernels' row (sparse_mla.h)
constexpr int kMaxHeads = 128;

// A weight view: present, dtype, shape, on CUDA, last dim contiguous, other
// strides multiples of 8 elements, data aligned (16 bytes; a scale, 4).
Status check_weight(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                    size_t alignment = 16, bool any_outer_strides = false) {
  DSA_RETURN_IF_ERROR(check_present(t, name));
  DSA_RETURN_IF_ERROR(check_dtype(t, name, dtype));
  DSA_RETURN_IF_ERROR(check_shape(t, name, shape));
  DSA_RETURN_IF_ERROR(check_on_cuda(t, name));
  DSA_RETURN_IF_ERROR(check_aligned(t, name, alignment));
  if (t.ndim >= 1) DSA_RETURN_IF_ERROR(check_stride(t, name, t.ndim - 1, 1));
  // Elements spanned by dims d+1..: each outer stride must step past them
  // (positive, rows and heads not overlapping), as every kernel reads them.
  int64_t inner = t.ndim >= 1 ? t.size(t.ndim - 1) : 1;
  for (int d = t.ndim - 2; d >= 0; --d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) {
      return invalid_argument(name, "strides of a multiple of 8 elements but the last (which is 1)", t.describe());
    }
    if (!any_outer_strides && t.size(d) > 1 && t.stride(d) < inner) {
      return invalid_argument(name,
                              "rows and heads that do not overlap: each stride at least the elements its inner "
                              "dims span (" + std::to_string(inner) + ")",
                              t.describe());
    }
    inner = t.size(d) > 1 ? (t.size(d) - 1) * t.stride(d) + inner : inner;  // check_present bounded the span
  }
  return Status();
}

// An FP32 parameter the indexer reads as one contiguous block (indexer.h's k_norm_*, ape).
Status check_parameter_weight(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  DSA_RETURN_IF_ERROR(check_weight(t, name, DType::kF32, shape, 4));
  if (!t.is_contiguous()) return invalid_argument(name, "a contiguous tensor", t.describe());
  return Status();
}

// The indexer's projections as GEMV launches of as many tokens as one takes
// (its x rows are staged in shared memory: D = 7168 fits 8 tokens, not 16);
// its bits do not depend on the split. `at(first, tokens)` gives a group's
// arguments. An argument error fails at one token too, which then names it.
template <class ArgsOf>
Status indexer_project_gemv_rows(int64_t m, ArgsOf&& at, cudaStream_t stream) {
  int64_t group = m;
  while (group > 1 && !check_indexer_project_gemv(at(0, group)).ok()) group = (group + 1) / 2;
  for (int64_t first = 0; first < m; first += group) {
    DSA_RETURN_IF_ERROR(indexer_project_gemv(at(first, std::min(group, m - first)), stream));
  }
  return Status();
}

bool same_rope(const std::optional<RopeConfig>& a, const std::optional<RopeConfig>& b) {
  if (a.has_value() != b.has_value()) return false;
  if (!a) return true;
  return a->rope_dim == b->rope_dim && a->theta == b->theta && a->factor == b->factor &&
         a->original_max_position == b->original_max_position && a->beta_fast == b->beta_fast &&
         a->beta_slow == b->beta_slow && a->mscale == b->mscale && a->mscale_all_dim == b->mscale_all_dim &&
         a->max_position == b->max_position && a->style == b->style;
}

std::string describe_rope(const std::optional<RopeConfig>& r) {
  if (!r) return "none";
  return "R " + std::to_string(r->rope_dim) + " theta " + std::to_string(r->theta) + " factor " +
         std::to_string(r->factor) + " max_position " + std::to_string(r->max_position) + " style " +
         std::to_string(static_cast<int>(r->style));
}

// A RoPE layer's two rotaries (R = qk_rope_head_dim > 0): each present,
// valid (check_rope_config), of rope_dim R, and the plan's positions within
// the attention rotary's max_position. The message of each problem.
std::vector<std::string> rotary_problems(const DsaLayerConfig& c, const DsaStagePlan& plan) {
  std::vector<std::string> problems;
  const int64_t R = c.qk_rope_head_dim;
  if (R <= 0) return problems;
  bool attention_valid = false;
  for (const auto& [rope, name] : {std::pair{&c.rope, "config.rope"}, std::pair{&c.indexer_rope, "config.indexer_rope"}}) {
    if (!rope->has_value()) {
      problems.push_back(invalid_argument(name,
                                          "the layer's rotary: a RopeConfig with rope_dim qk_rope_head_dim = " +
                                              std::to_string(R) + " (rope_preset_config gives a preset's)",
                                          "none")
                             .message());
      continue;
    }
    if (const Status valid = check_rope_config(**rope); !valid.ok()) {
      problems.push_back(std::string(name) + ": " + valid.message());
      continue;
    }
    if ((*rope)->rope_dim != R) {
      problems.push_back(invalid_argument(std::string(name) + ".rope_dim",
                                          "qk_rope_head_dim = " + std::to_string(R) + " rotated dims",
                                          std::to_string((*rope)->rope_dim))
                             .message());
      continue;
    }
    if (rope == &c.rope) attention_valid = true;
  }
  if (attention_valid && plan.max_context > c.rope->max_position) {
    problems.push_back(invalid_argument("plan.max_context",
                                        "at most config.rope.max_position = " + std::to_string(c.rope->max_position) +
                                            " (the positions the layer's rotary serves)",
                                        std::to_string(plan.max_context))
                           .message());
  }
  return problems;
}

// out = x weight^T through linear_gemv for any m: in launches of the most
// tokens the kernel takes at this width (it is batch invariant, so the bits
// do not depend on the split).
Status linear_gemv_rows(const TensorView& x, const TensorView& weight, const TensorView& out, cudaStream_t stream) {
  const int64_t m = x.size(0), k = x.size(1);
  for (int64_t first = 0; first < m;) {
    int64_t rows = std::min<int64_t>(m - first, kLinearGemvMaxTokens);
    while (rows > 1 && !linear_gemv_supports(rows, k)) --rows;
    DSA_RETURN_IF_ERROR(
        linear_gemv(LinearGemvArgs{slice_rows(x, first, rows), weight, slice_rows(out, first, rows)}, stream));
    first += rows;
  }
  return Status();
}

}  // namespace

DsaLayerConfig dsa_layer_config(const ModelPreset& p, float rms_norm_eps) {
  DsaLayerConfig c;
  c.hidden_size = p.hidden;
  c.num_heads = p.heads;
  c.q_lora_rank = p.q_lora;
  c.kv_lora_rank = p.kv_lora;
  c.qk_nope_head_dim = p.qk_nope;
  c.qk_rope_head_dim = p.qk_rope;
  c.v_head_dim = p.v_head;
  c.softmax_scale = p.softmax_scale;
  c.rms_norm_eps = rms_norm_eps;
  c.fuse_qkv_rmsnorm = true;
  c.rotary_embedding = p.qk_rope > 0;
  // Every preset's layer has its own indexer; its shape is the plan's (dsa_stage_plan_for).
  c.indexer = p.index_dim == kIndexerDim;
  c.kv_cache_dtype = "fp8_e4m3";
  if (p.qk_rope > 0) {
    c.kv_cache_dtype = "fp8_ds_mla";
    RopeConfig attention, indexer;
    if (rope_preset_config(p.name, RopeTarget::kAttention, &attention).ok() &&
        rope_preset_config(p.name, RopeTarget::kIndexer, &indexer).ok()) {
      c.rope = attention;
      c.indexer_rope = indexer;
      c.softmax_scale = static_cast<float>(rope_softmax_scale(attention, p.qk_nope + p.qk_rope));
    }  // else: no rotary known for the preset, which creation names
  }
  return c;
}

IndexerPlan dsa_stage_indexer_plan(const DsaLayerConfig& config, const DsaStagePlan& plan) {
  IndexerPlan p = dsa_stage_indexer_plan(plan);
  if (config.qk_rope_head_dim > 0 && config.indexer_rope) {
    p.rope_dims = static_cast<int>(config.qk_rope_head_dim);
    p.rope_style = config.indexer_rope->style;
  }
  return p;
}

IndexerPlan dsa_stage_indexer_plan(const DsaStagePlan& plan) {
  IndexerPlan p;
  p.max_tokens = plan.max_tokens;
  p.max_context = plan.max_context;
  p.ring = plan.ring;
  p.block_size = plan.block_size;
  p.logits = plan.indexer_logits;
  p.heads = plan.indexer_heads;
  p.pool = plan.indexer_pool;
  p.topk = plan.indexer_topk;
  return p;
}

DsaStagePlan dsa_stage_plan_for(const ModelPreset& per_rank) {
  DsaStagePlan plan;
  plan.indexer_heads = per_rank.index_heads;
  plan.indexer_pool = per_rank.pool_size;
  plan.indexer_topk = per_rank.topk;
  plan.ring = indexer_ring_for(per_rank.pool_size, 1);  // the pool; 1 at pool 1 (no ring)
  return plan;
}

Status check_dsa_stage_indexer_shape(const DsaStagePlan& plan) {
  if (plan.indexer_heads != 16 && plan.indexer_heads != 32 && plan.indexer_heads != 64) {
    return invalid_argument("plan.indexer_heads", "16, 32 or 64 index heads (index_n_heads)",
                            std::to_string(plan.indexer_heads));
  }
  if (plan.indexer_pool == 1) {
    if (plan.indexer_topk < 1 || plan.indexer_topk > kIndexerMaxTopTokens) {
      return invalid_argument("plan.indexer_topk",
                              "1.." + std::to_string(kIndexerMaxTopTokens) +
                                  " tokens (index_topk at plan.indexer_pool 1)",
                              std::to_string(plan.indexer_topk));
    }
    return Status();
  }
  if (plan.indexer_pool != 4 && plan.indexer_pool != 8 && plan.indexer_pool != 16) {
    return invalid_argument("plan.indexer_pool",
                            "4, 8 or 16 tokens per pool (index_kpool), or 1 (no pooling: a RoPE layer's indexer)",
                            std::to_string(plan.indexer_pool));
  }
  const int64_t most = int64_t{kIndexerMaxTopPools} * plan.indexer_pool;
  if (plan.indexer_topk < plan.indexer_pool || plan.indexer_topk % plan.indexer_pool != 0 ||
      plan.indexer_topk > most) {
    return invalid_argument("plan.indexer_topk",
                            "a multiple of plan.indexer_pool = " + std::to_string(plan.indexer_pool) + " from " +
                                std::to_string(plan.indexer_pool) + " to " + std::to_string(most) + " (index_topk; " +
                                std::to_string(kIndexerMaxTopPools) + " pools at most)",
                            std::to_string(plan.indexer_topk));
  }
  return Status();
}

std::set<int> dsa_stage_measured_value_up_tokens(int64_t heads, HeadGemvSums sums) {
  std::set<int> counts;
  const int last = sums == HeadGemvSums::kTensorCores ? (heads == 8 ? kDsaStageMaxTokens : 8) : (heads == 8 ? 4 : 2);
  for (int m = 1; m <= last; ++m) counts.insert(m);
  return counts;
}

std::set<int> dsa_stage_value_up_tokens(const DsaStagePlan& plan, int64_t heads) {
  if (plan.batch_invariant) {
    std::set<int> every;
    // max_tokens past the stage's range is refused by the checks; never loop over it.
    for (int m = 1; m <= std::min(plan.max_tokens, kDsaStageMaxTokens); ++m) every.insert(m);
    return every;
  }
  return plan.value_up_tokens ? *plan.value_up_tokens : dsa_stage_measured_value_up_tokens(heads, plan.head_gemv_sums);
}

SparseMlaPlan dsa_stage_attention_plan(const DsaStagePlan& plan) {
  return plan.batch_invariant ? SparseMlaPlan::kBatchInvariant : plan.attention_plan;
}

std::set<int> dsa_stage_measured_projection_gemv_tokens(int64_t heads) {
  return heads == 8 ? std::set<int>{1, 2} : std::set<int>{1};
}

// What a workspace was made for: stages share it only when these agree.
struct WorkspaceShape {
  int device = -1;  // where its memory, handles and stream live
  int64_t H = 0, D = 0, Q = 0, L = 0, P = 0, V = 0;
  int64_t R = 0;  // qk_rope_head_dim: a RoPE layer's buffers and tables
  int max_tokens = 0, ring = 0, block_size = 0;
  int indexer_heads = 0, indexer_pool = 0, indexer_topk = 0;
  int64_t max_context = 0;
  IndexerLogits indexer_logits = IndexerLogits::kFp32Accumulation;
  bool indexer_projections_cublaslt = false;
  std::optional<RopeConfig> rope, indexer_rope;  // the tables' (R > 0 only)

  static WorkspaceShape of(int device, const DsaLayerConfig& c, const DsaStagePlan& p) {
    WorkspaceShape w;
    w.device = device;
    w.H = c.num_heads;
    w.D = c.hidden_size;
    w.Q = c.q_lora_rank;
    w.L = c.kv_lora_rank;
    w.P = c.qk_nope_head_dim;
    w.V = c.v_head_dim;
    w.R = c.qk_rope_head_dim;
    w.max_tokens = p.max_tokens;
    w.ring = p.ring;
    w.block_size = p.block_size;
    w.indexer_heads = p.indexer_heads;
    w.indexer_pool = p.indexer_pool;
    w.indexer_topk = p.indexer_topk;
    w.max_context = p.max_context;
    w.indexer_logits = p.indexer_logits;
    w.indexer_projections_cublaslt = p.indexer_projections_cublaslt;
    if (w.R > 0) {
      w.rope = c.rope;
      w.indexer_rope = c.indexer_rope;
    }
    return w;
  }
  bool operator==(const WorkspaceShape& o) const {
    return device == o.device && H == o.H && D == o.D && Q == o.Q && L == o.L && P == o.P && V == o.V && R == o.R &&
           max_tokens == o.max_tokens && ring == o.ring && block_size == o.block_size &&
           indexer_heads == o.indexer_heads && indexer_pool == o.indexer_pool && indexer_topk == o.indexer_topk &&
           max_context == o.max_context &&
           indexer_logits == o.indexer_logits && indexer_projections_cublaslt == o.indexer_projections_cublaslt &&
           same_rope(rope, o.rope) && same_rope(indexer_rope, o.indexer_rope);
  }
  std::string describe() const {
    std::string text =
        "device " + std::to_string(device) + ", H " + std::to_string(H) + ", D " + std::to_string(D) + ", Q " +
        std::to_string(Q) + ", L " + std::to_string(L) + ", P " + std::to_string(P) + ", V " + std::to_string(V) +
        ", R " + std::to_string(R) + ", max_tokens " + std::to_string(max_tokens) + ", max_context " +
        std::to_string(max_context) + ", ring " + std::to_string(ring) + ", block_size " + std::to_string(block_size) +
        ", indexer_heads " + std::to_string(indexer_heads) + ", indexer_pool " + std::to_string(indexer_pool) +
        ", indexer_topk " + std::to_string(indexer_topk) + ", indexer_logits " + std::to_string(int(indexer_logits)) +
        ", indexer_projections_cublaslt " + std::to_string(int(indexer_projections_cublaslt));
    if (R > 0) text += ", rope (" + describe_rope(rope) + "), indexer_rope (" + describe_rope(indexer_rope) + ")";
    return text;
  }
};

struct DsaStageWorkspace::Buffers {
  WorkspaceShape shape;
  LinearContext linear;                       // qkv_a_proj, q_b_proj, o_proj
  IndexerProjectContext indexer_projections;  // made only with indexer_projections_cublaslt
  cublasHandle_t cublas = nullptr;            // the absorb and value-up bmm
  bool cublas_bound = false;
  cudaStream_t cublas_stream = nullptr;  // the stream cublas is bound to, once bound
  DeviceMemory cublas_workspace;
  // The indexer's lane (plan.overlap_indexer): a stream of the workspace's
  // own, forked from the caller's stream after the norm and joined before
  // the attention through the two events (a fork and a join in a capture).
  cudaStream_t indexer_stream = nullptr;
  cudaEvent_t indexer_fork = nullptr, indexer_join = nullptr;

  // Each [max_tokens, ...] (intermediates() has the shapes). NoPE only:
  // q_bf16, q_fp8, split_counters, split_partials; RoPE only: q_absorbed,
  // k_pe and the two cos/sin tables [max_context, R] F32; the pooled
  // indexer's only: gate.
  DeviceMemory qkv, q_c, kv_c, q, q_bf16, q_fp8, q_absorbed, k_pe, index_q, index_k, head_weights, gate,
      indexer_workspace, topk_positions, slots, latent, lse, heads, split_counters, split_partials, attention_table,
      indexer_table;
  int64_t indexer_workspace_bytes = 0, counter_count = 0, partial_count = 0;

  ~Buffers() {
    if (cublas != nullptr) cublasDestroy(cublas);
    if (indexer_fork != nullptr) cudaEventDestroy(indexer_fork);
    if (indexer_join != nullptr) cudaEventDestroy(indexer_join);
    if (indexer_stream != nullptr) cudaStreamDestroy(indexer_stream);
  }

  Status allocate(const WorkspaceShape& s, const IndexerPlan& indexer_plan);
  // A RoPE layer's cos/sin table of `config` for positions 0..max_context - 1 (host work and one copy).
  static Status fill_table(const RopeConfig& config, int64_t rows, DeviceMemory* table);
};

struct DsaAttentionStage::State {
  DsaLayerConfig config;
  DsaLayerWeights w;
  DsaStagePlan plan;
  StepChoices step_choices;  // the plan's choices with its sets resolved
  IndexerPlan indexer_plan;  // dsa_stage_indexer_plan(config, plan): with the rotary of a RoPE layer's indexer
  int64_t H = 0, D = 0, Q = 0, L = 0, P = 0, V = 0;
  int64_t R = 0;   // qk_rope_head_dim: 0 (NoPE) or 64 (RoPE)
  int64_t HI = 0;  // index heads (indexer_plan.heads)
  int64_t W = 0;   // columns of a top-k row: indexer_row_width(indexer_plan)

  // The buffers, handles and the indexer's stream: the stage's own, or shared
  // with other stages (DsaStageWorkspace).
  std::shared_ptr<DsaStageWorkspace> workspace;
  DsaStageWorkspace::Buffers* b = nullptr;

  TensorView bf16(const DeviceMemory& memory, std::initializer_list<int64_t> shape) const {
    return make_tensor(memory.get(), DType::kBF16, shape);
  }

  bool rope() const { return R > 0; }
  int64_t qkv_width() const { return Q + L + R; }  // q_c | kv_c | k_pe
  int64_t q_width() const { return H * (P + R); }  // q_b_proj's out features

  StepList steps_of(DsaPath path, const DsaStepArgs& a) const {
    return stage_steps(path, step_choices, a.hidden.size(0), a.topk_positions.data != nullptr);
  }

  Status check_step(const DsaStepArgs& a) const {
    DSA_RETURN_IF_ERROR(check_present(a.hidden, "hidden"));
    const int64_t m = a.hidden.ndim == 2 ? a.hidden.size(0) : 0;
    if (m < 1 || m > plan.max_tokens) {
      return invalid_argument(
          "hidden",
          "[m, " + std::to_string(D) + "] with m in 1.." + std::to_string(plan.max_tokens) + " (the plan's max_tokens)",
          a.hidden.describe());
    }
    DSA_RETURN_IF_ERROR(check_bf16_rows(a.hidden, "hidden", m, D));
    DSA_RETURN_IF_ERROR(check_bf16_rows(a.out, "out", m, D));
    // o_proj writes out last, through linear_gemv or cuBLASLt by m: checked
    // here, so that a step's m never decides whether an overlap is refused.
    DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", a.hidden, "hidden"));
    DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", w.o_proj, "o_proj"));
    for (const auto& [other, name] : {std::pair{&a.positions, "positions"},
                                      {&a.token_requests, "token_requests"},
                                      {&a.slot_mapping, "slot_mapping"},
                                      {&a.kv_cache, "kv_cache"},
                                      {&a.indexer.block_table, "block_table"},
                                      {&a.indexer.ring, "ring"},
                                      {&a.indexer.k_cache, "k_cache"},
                                      {&a.topk_positions, "topk_positions"}}) {
      DSA_RETURN_IF_ERROR(check_no_overlap(a.out, "out", *other, name));
    }
    DSA_RETURN_IF_ERROR(check_present(a.kv_cache, "kv_cache"));
    DSA_RETURN_IF_ERROR(check_present(a.indexer.k_cache, "k_cache"));
    // An entry: L e4m3 codes (NoPE), or the 656 bytes of DeepSeek-V3.2's format (RoPE).
    const int64_t entry = rope() ? kSparseMlaV32EntryBytes : L;
    if (a.kv_cache.ndim != 3 || a.kv_cache.size(1) != plan.block_size || a.kv_cache.size(2) != entry ||
        a.kv_cache.size(0) != a.indexer.k_cache.size(0)) {
      return invalid_argument("kv_cache",
                              "[blocks, plan.block_size = " + std::to_string(plan.block_size) + ", " +
                                  std::to_string(entry) + (rope() ? " bytes" : "") + "] with the indexer k_cache's " +
                                  std::to_string(a.indexer.k_cache.size(0)) + " blocks",
                              a.kv_cache.describe());
    }
    if (a.topk_positions.data != nullptr) {
      DSA_RETURN_IF_ERROR(check_dtype(a.topk_positions, "topk_positions", DType::kI32));
      DSA_RETURN_IF_ERROR(check_shape(a.topk_positions, "topk_positions", {m, W}));
    }
    // Every other argument is checked by the launch that takes it, under its own name.
    return Status();
  }

  Status bind_cublas(cudaStream_t stream) {
    if (b->cublas_bound && stream == b->cublas_stream) return Status();
    // cublasSetStream resets the workspace to cuBLAS's own pool, which a capture cannot hold: set ours again.
    DSA_CUBLAS_RETURN(cublasSetStream(b->cublas, stream));
    DSA_CUBLAS_RETURN(cublasSetWorkspace(b->cublas, b->cublas_workspace.get(), kCublasWorkspaceBytes));
    b->cublas_stream = stream;
    b->cublas_bound = true;
    return Status();
  }

  KvCacheWrite cache_write(const DsaStepArgs& a, int64_t m) const {
    return KvCacheWrite{bf16(b->kv_c, {m, L}), a.kv_cache, a.slot_mapping, w.k_scale, a.error_count};
  }

  bool pooled() const { return indexer_plan.pool > 1; }

  // The projections of tokens first..first + tokens - 1 (pool 1: no compress gate, no gate).
  IndexerProjectArgs indexer_project_args(const DsaStepArgs& a, int64_t first, int64_t tokens) const {
    IndexerProjectArgs p;
    p.plan = indexer_plan;
    const int64_t m = first + tokens;
    p.q_c = slice_rows(bf16(b->q_c, {m, Q}), first, tokens);
    p.x = slice_rows(a.hidden, first, tokens);
    p.wq_b = w.index_wq_b;
    p.wk = w.index_wk;
    p.weights_proj = w.index_weights_proj;
    p.index_q = slice_rows(bf16(b->index_q, {m, HI, kIndexerDim}), first, tokens);
    p.index_k = slice_rows(bf16(b->index_k, {m, kIndexerDim}), first, tokens);
    p.head_weights = slice_rows(make_tensor(b->head_weights.get(), DType::kF32, {m, HI}), first, tokens);
    if (pooled()) {
      p.compress_gate = w.index_compress_gate;
      p.gate = slice_rows(bf16(b->gate, {m, kIndexerDim}), first, tokens);
    }
    return p;
  }

  TensorView table_view(const DeviceMemory& table) const {
    return make_tensor(table.get(), DType::kF32, {plan.max_context, R});
  }

  TensorView indexer_workspace_view() const {
    return make_tensor(b->indexer_workspace.get(), DType::kU8, {b->indexer_workspace_bytes});
  }

  IndexerSelectArgs indexer_select_args(const DsaStepArgs& a, int64_t m, bool with_positions) const {
    IndexerSelectArgs s;
    s.plan = indexer_plan;
    s.positions = a.positions;
    s.token_requests = a.token_requests;
    s.state = a.indexer;
    s.workspace = indexer_workspace_view();
    if (with_positions) s.topk_positions = make_tensor(b->topk_positions.get(), DType::kI32, {m, W});
    s.slots = make_tensor(b->slots.get(), DType::kI32, {m, W});
    s.error_count = a.error_count;
    return s;
  }

  Status run_step(Step step, const DsaStepArgs& a, cudaStream_t stream) {
    const int64_t m = a.hidden.size(0);
    switch (step) {
      case Step::kQkvAProj:
        return b->linear.run("qkv_a_proj", a.hidden, w.fused_qkv_a_proj, b->qkv.get(), qkv_width(), CUDA_R_16BF,
                             stream);
      case Step::kNorm:
        // Over q_c | kv_c of each qkv row (a RoPE layer's k_pe, after them, is not normed).
        return qkv_rmsnorm(make_strided(b->qkv.get(), DType::kBF16, {m, Q + L}, {qkv_width(), 1}), w.q_a_norm,
                           w.kv_a_norm, config.rms_norm_eps, bf16(b->q_c, {m, Q}), bf16(b->kv_c, {m, L}), stream);
      case Step::kQkvAProjGemv:
        return linear_gemv_rows(a.hidden, w.fused_qkv_a_proj, bf16(b->qkv, {m, qkv_width()}), stream);
      case Step::kQbProj:
        return b->linear.run("q_b_proj", bf16(b->q_c, {m, Q}), w.q_b_proj, b->q.get(), q_width(), CUDA_R_16BF, stream);
      case Step::kQbProjGemv:
        return linear_gemv_rows(bf16(b->q_c, {m, Q}), w.q_b_proj, bf16(b->q, {m, q_width()}), stream);
      case Step::kAbsorb: {
        const KvCacheWrite write = cache_write(a, m);
        HeadGemvArgs g;
        g.x = bf16(b->q, {m, H, P});
        g.weight = w.w_uk_t;
        g.out = make_tensor(b->q_fp8.get(), DType::kFP8E4M3, {m, H, L});
        g.scale = w.q_scale;
        g.cache = &write;
        g.sums = plan.head_gemv_sums;
        return head_gemv(g, stream);
      }
      case Step::kIndexerProject:
        if (plan.indexer_projections_cublaslt)
          return indexer_project(indexer_project_args(a, 0, m), b->indexer_projections, stream);
        return indexer_project_gemv_rows(
            m, [&](int64_t first, int64_t tokens) { return indexer_project_args(a, first, tokens); }, stream);
      case Step::kIndexerPrepare: {
        IndexerPrepareArgs p;
        p.plan = indexer_plan;
        p.index_q = bf16(b->index_q, {m, HI, kIndexerDim});
        p.index_k = bf16(b->index_k, {m, kIndexerDim});
        p.head_weights = make_tensor(b->head_weights.get(), DType::kF32, {m, HI});
        p.k_norm_weight = w.index_k_norm_weight;
        p.k_norm_bias = w.index_k_norm_bias;
        if (pooled()) {
          p.gate = bf16(b->gate, {m, kIndexerDim});
          p.ape = w.index_ape;
        }
        if (indexer_plan.rope_dims > 0) p.cos_sin = table_view(b->indexer_table);
        p.positions = a.positions;
        p.token_requests = a.token_requests;
        p.state = a.indexer;
        p.workspace = indexer_workspace_view();
        p.error_count = a.error_count;
        return indexer_prepare(p, stream);
      }
      case Step::kIndexerSelect:
        return indexer_select(indexer_select_args(a, m, false), stream);
      case Step::kStockIndexerSelect:
        return indexer_select(indexer_select_args(a, m, true), stream);
      case Step::kTopkRemap: {
        IndexerRemapArgs r;
        r.plan = indexer_plan;
        r.positions = a.positions;
        r.token_requests = a.token_requests;
        r.state = a.indexer;
        r.topk_positions = a.topk_positions;
        r.slots = make_tensor(b->slots.get(), DType::kI32, {m, W});
        r.error_count = a.error_count;
        return indexer_remap(r, stream);
      }
      case Step::kAttention: {
        SparseMlaArgs s;
        s.q = make_tensor(b->q_fp8.get(), DType::kFP8E4M3, {m, H, L});
        s.q_scale = w.q_scale;
        s.kv_cache = a.kv_cache;
        s.k_scale = w.k_scale;
        s.indices = make_tensor(b->slots.get(), DType::kI32, {m, W});
        s.softmax_scale = config.softmax_scale;
        s.latent = bf16(b->latent, {m, H, L});
        s.lse = make_tensor(b->lse.get(), DType::kF32, {m, H});
        s.split_counters = make_tensor(b->split_counters.get(), DType::kI32, {b->counter_count});
        if (b->partial_count > 0)
          s.split_partials = make_tensor(b->split_partials.get(), DType::kF32, {b->partial_count});
        s.error_count = a.error_count;
        s.plan = dsa_stage_attention_plan(plan);
        return sparse_mla(s, stream);
      }
      case Step::kValueUpGemv: {
        HeadGemvArgs g;
        g.x = bf16(b->latent, {m, H, L});
        g.weight = w.w_uv;
        g.out = bf16(b->heads, {m, H, V});
        g.sums = plan.head_gemv_sums;
        // o_proj's weight prologue then runs under the attention (seed-order
        // sums; the tensor-core kernel ignores the flag). Not for the absorb:
        // measured slower with its cache CTAs releasing after their wait.
        g.release_dependents_early = true;
        return head_gemv(g, stream);
      }
      case Step::kValueUpBmm:
        DSA_RETURN_IF_ERROR(bind_cublas(stream));
        return cublas_head_bmm(b->cublas, bf16(b->latent, {m, H, L}), w.w_uv, bf16(b->heads, {m, H, V}));
      case Step::kOProj:
        return b->linear.run("o_proj", bf16(b->heads, {m, H * V}), w.o_proj, a.out.data, a.out.stride(0), CUDA_R_16BF,
                             stream);
      case Step::kOProjGemv:
        return linear_gemv_rows(bf16(b->heads, {m, H * V}), w.o_proj, a.out, stream);
      case Step::kStockCacheWrite:
        return stock_concat_and_cache_mla(cache_write(a, m), stream);
      case Step::kStockAbsorbBmm:
        DSA_RETURN_IF_ERROR(bind_cublas(stream));
        return cublas_head_bmm(b->cublas, bf16(b->q, {m, H, P}), w.w_uk_t, bf16(b->q_bf16, {m, H, L}));
      case Step::kStockFp8Quant:
        return stock_static_fp8_quant(bf16(b->q_bf16, {m, H, L}),
                                      make_tensor(b->q_fp8.get(), DType::kFP8E4M3, {m, H, L}), w.q_scale, stream);
      case Step::kStockCounterMemset:
        DSA_CUDA_RETURN(
            cudaMemsetAsync(b->split_counters.get(), 0, size_t(b->counter_count) * sizeof(int32_t), stream));
        return Status();
      case Step::kRopeAbsorb: {
        // q [m, H, P + R]: each head's first P values absorbed, its last R rotated; k_pe the last R of qkv.
        RopeAbsorbArgs r;
        r.q_nope = make_strided(b->q.get(), DType::kBF16, {m, H, P}, {q_width(), P + R, 1});
        r.q_pe = make_strided(static_cast<uint16_t*>(b->q.get()) + P, DType::kBF16, {m, H, R}, {q_width(), P + R, 1});
        r.k_pe = make_strided(static_cast<uint16_t*>(b->qkv.get()) + Q + L, DType::kBF16, {m, R}, {qkv_width(), 1});
        r.positions = a.positions;
        r.cos_sin = table_view(b->attention_table);
        r.weight = w.w_uk_t;
        r.out = bf16(b->q_absorbed, {m, H, L + R});
        r.k_pe_out = bf16(b->k_pe, {m, R});
        r.style = config.rope->style;
        r.error_count = a.error_count;
        return rope_absorb(r, stream);
      }
      case Step::kV32CacheWrite: {
        SparseMlaV32CacheWriteArgs c;
        c.kv_c = bf16(b->kv_c, {m, L});
        c.k_pe = bf16(b->k_pe, {m, R});
        c.slot_mapping = a.slot_mapping;
        c.kv_cache = a.kv_cache;
        c.error_count = a.error_count;
        return sparse_mla_v32_cache_write(c, stream);
      }
      case Step::kV32Attention: {
        SparseMlaV32Args s;
        s.q = bf16(b->q_absorbed, {m, H, L + R});
        s.kv_cache = a.kv_cache;
        s.indices = make_tensor(b->slots.get(), DType::kI32, {m, W});
        s.softmax_scale = config.softmax_scale;
        s.latent = bf16(b->latent, {m, H, L});
        s.lse = make_tensor(b->lse.get(), DType::kF32, {m, H});
        s.error_count = a.error_count;
        if (dsa_stage_attention_plan(plan) == SparseMlaPlan::kBatchInvariant) {
          // The fewest splits the row allows: the same split, so the same
          // order of every sum, at every m (sparse_mla_v32_plan).
          const int splits = sparse_mla_v32_ceil_div(W, kSparseMlaV32MaxRowsPerSplit);
          return sparse_mla_v32_with_max_splits(s, splits, stream);
        }
        return sparse_mla_v32(s, stream);
      }
    }
    return unsupported("unknown stage step");
  }

  // Every requirement the seed checks, and each weight view; the messages of all that fail.
  static void check_layer(const DsaLayerConfig& c, const DsaLayerWeights& w, const DsaStagePlan& plan,
                          std::vector<std::string>* features, std::vector<std::string>* views);
};

void DsaAttentionStage::State::check_layer(const DsaLayerConfig& c, const DsaLayerWeights& w, const DsaStagePlan& plan,
                                           std::vector<std::string>* features, std::vector<std::string>* views) {
  const auto need = [&](bool ok, const std::string& what) {
    if (!ok) features->push_back(what);
  };
  // A RoPE layer: R = 64 rotated dims (the 656-byte entry's RoPE part), with its rotary.
  const bool rope = c.qk_rope_head_dim > 0;
  need(c.q_lora_rank > 0 && c.fuse_qkv_rmsnorm, "a fused q/kv a-norm (q_lora_rank > 0, fuse_qkv_rmsnorm)");
  need(c.qk_rope_head_dim == 0 || c.qk_rope_head_dim == kSparseMlaV32Rope,
       "qk_rope_head_dim 0 (NoPE) or 64 (RoPE: the 656-byte cache's RoPE part), got " +
           std::to_string(c.qk_rope_head_dim));
  if (rope) {
    need(c.rotary_embedding, "a rotary embedding for the RoPE dims (rotary_embedding true with qk_rope_head_dim " +
                                 std::to_string(c.qk_rope_head_dim) + ")");
    need(c.qk_nope_head_dim % 64 == 0 && c.qk_nope_head_dim <= 1024,
         "qk_nope_head_dim a multiple of 64 up to 1024 (rope_absorb), got " + std::to_string(c.qk_nope_head_dim));
  } else {
    need(!c.rotary_embedding, "NoPE without a rotary embedding (rotary_embedding false with qk_rope_head_dim 0)");
  }
  need(c.indexer && !c.skip_topk, "its own indexer (indexer present, skip_topk false)");
  need(!c.gate_proj && !c.dcp_query_replicate, "no gate or DCP query");
  if (rope) {
    need(c.kv_cache_dtype == "fp8" || c.kv_cache_dtype == "fp8_e4m3" || c.kv_cache_dtype == "fp8_ds_mla",
         "an FP8 KV cache (kv_cache_dtype fp8, fp8_e4m3 or fp8_ds_mla: the 656-byte entries, got '" +
             c.kv_cache_dtype + "')");
  } else {
    need(c.kv_cache_dtype == "fp8" || c.kv_cache_dtype == "fp8_e4m3",
         "an FP8 KV cache (kv_cache_dtype fp8 or fp8_e4m3, got '" + c.kv_cache_dtype + "')");
  }
  need(!c.padded_heads && !c.prefill_context_parallel, "no padding or PCP");
  need(!c.hisparse_cache && c.decode_context_parallel_size == 1, "no HiSparse or DCP");
  need(w.w_uk_t.data == nullptr || w.w_uk_t.ndim != 3 || w.w_uk_t.stride(2) == 1,
       "a column-major W_UK (W_UK_T's last dim contiguous)");
  need(c.kv_lora_rank == kLatentWidth, "a 512-wide latent (kv_lora_rank 512, the attention's KV row)");
  need(c.num_heads >= 1 && c.num_heads <= kMaxHeads, "1..128 heads on the rank");
  need(c.hidden_size >= 8 && c.hidden_size % 8 == 0, "a hidden size of a multiple of 8");
  need(c.q_lora_rank % 8 == 0 && c.q_lora_rank >= c.kv_lora_rank, "q_lora_rank a multiple of 8, >= kv_lora_rank");
  need(c.qk_nope_head_dim > 0 && c.v_head_dim > 0, "qk_nope_head_dim and v_head_dim > 0");
  need(std::isfinite(c.softmax_scale) && c.softmax_scale > 0, "a finite softmax_scale > 0");

  const auto view = [&](const Status& s) {
    if (!s.ok()) views->push_back(s.message());
  };
  const int64_t H = c.num_heads, D = c.hidden_size, Q = c.q_lora_rank, L = c.kv_lora_rank, P = c.qk_nope_head_dim,
                V = c.v_head_dim, R = std::max<int64_t>(c.qk_rope_head_dim, 0);
  for (const std::string& problem : rotary_problems(c, plan)) views->push_back(problem);
  view(check_weight(w.fused_qkv_a_proj, "fused_qkv_a_proj", DType::kBF16, {Q + L + R, D}));
  view(check_weight(w.q_a_norm, "q_a_norm", DType::kBF16, {Q}));
  view(check_weight(w.kv_a_norm, "kv_a_norm", DType::kBF16, {L}));
  view(check_weight(w.q_b_proj, "q_b_proj", DType::kBF16, {H * (P + R), Q}));
  if (w.w_uk_t.data == nullptr || w.w_uk_t.ndim != 3 || w.w_uk_t.stride(2) == 1) {  // else named above
    const Status uk = check_weight(w.w_uk_t, "w_uk_t", DType::kBF16, {H, P, L});
    // head_gemv's layout (the absorb and rope_absorb), so that a view creation accepts is one every step takes.
    view(uk.ok() ? check_head_gemv_weight(w.w_uk_t, "w_uk_t", H, P) : uk);
  }
  // W_UV meets head_gemv's layout only where value-up runs as head_gemv (cuBLAS's bmm takes any strides).
  const std::set<int> value_up_tokens = dsa_stage_value_up_tokens(plan, H);
  const bool value_up_gemv = std::any_of(value_up_tokens.begin(), value_up_tokens.end(),
                                         [&](int m) { return m >= 1 && m <= plan.max_tokens; });
  // (cuBLAS's bmm alone: any strides, as before; its own checks answer at the step.)
  const Status uv = check_weight(w.w_uv, "w_uv", DType::kBF16, {H, L, V}, 16, !value_up_gemv);
  view(uv.ok() && value_up_gemv ? check_head_gemv_weight(w.w_uv, "w_uv", H, L) : uv);
  view(check_weight(w.o_proj, "o_proj", DType::kBF16, {D, H * V}));
  if (!rope) {  // a RoPE layer's query stays BF16 and its entries hold their own scales
    view(check_weight(w.q_scale, "q_scale", DType::kF32, {1}, 4));
    view(check_weight(w.k_scale, "k_scale", DType::kF32, {1}, 4));
  }
  // The indexer's weights at the plan's shape; an unsupported shape is named
  // instead (the views' shapes would follow from it).
  const Status shape = check_dsa_stage_indexer_shape(plan);
  view(shape);
  const bool pooled = plan.indexer_pool != 1;
  if (shape.ok()) {
    // The layer's kind of indexer: pooled for NoPE, DeepSeek-V3.2's unpooled one for RoPE.
    if (rope && pooled) {
      view(invalid_argument("plan.indexer_pool", "1 for a RoPE layer (DeepSeek-V3.2's unpooled indexer)",
                            std::to_string(plan.indexer_pool)));
    } else if (!rope && !pooled) {
      view(invalid_argument("plan.indexer_pool", "4, 8 or 16 for a NoPE layer (the pooled indexer)",
                            std::to_string(plan.indexer_pool)));
    }
    const int64_t HI = plan.indexer_heads, S = plan.indexer_pool;
    view(check_weight(w.index_wq_b, "index_wq_b", DType::kBF16, {HI * kIndexerDim, Q}));
    view(check_weight(w.index_weights_proj, "index_weights_proj", DType::kBF16, {HI, D}));
    if (pooled) view(check_parameter_weight(w.index_ape, "index_ape", {S, kIndexerDim}));
  }
  view(check_weight(w.index_wk, "index_wk", DType::kBF16, {kIndexerDim, D}));
  if (pooled) view(check_weight(w.index_compress_gate, "index_compress_gate", DType::kBF16, {kIndexerDim, D}));
  view(check_parameter_weight(w.index_k_norm_weight, "index_k_norm_weight", {kIndexerDim}));
  view(check_parameter_weight(w.index_k_norm_bias, "index_k_norm_bias", {kIndexerDim}));
  // The plan's kernel choices, named here rather than by a step's first run.
  if (plan.head_gemv_sums != HeadGemvSums::kTensorCores && plan.head_gemv_sums != HeadGemvSums::kSeedOrder) {
    views->push_back(invalid_argument("plan.head_gemv_sums", "HeadGemvSums::kTensorCores (0) or kSeedOrder (1)",
                                      std::to_string(static_cast<int>(plan.head_gemv_sums)))
                         .message());
  }
  if (plan.attention_plan != SparseMlaPlan::kAuto && plan.attention_plan != SparseMlaPlan::kBatchInvariant) {
    views->push_back(invalid_argument("plan.attention_plan", "SparseMlaPlan::kAuto (0) or kBatchInvariant (1)",
                                      std::to_string(static_cast<int32_t>(plan.attention_plan)))
                         .message());
  }
  if (plan.max_tokens < 1 || plan.max_tokens > kDsaStageMaxTokens) {
    views->push_back(
        invalid_argument("plan.max_tokens", "1.." + std::to_string(kDsaStageMaxTokens), std::to_string(plan.max_tokens))
            .message());
  }
  // linear_gemv takes at most kLinearGemvMaxTokens tokens: a larger count in
  // its set could never run as GEMV, so it is refused rather than ignored.
  for (const auto& [set, name, most] :
       {std::tuple{&plan.value_up_tokens, "plan.value_up_tokens", kDsaStageMaxTokens},
        std::tuple{&plan.projection_gemv_tokens, "plan.projection_gemv_tokens", kLinearGemvMaxTokens}}) {
    if (!*set) continue;
    for (int m : **set) {
      if (m < 1 || m > most) {
        views->push_back(
            invalid_argument(name, "token counts in 1.." + std::to_string(most), std::to_string(m)).message());
      }
    }
  }
}

Status DsaStageWorkspace::Buffers::fill_table(const RopeConfig& config, int64_t rows, DeviceMemory* table) {
  std::vector<float> host(size_t(rows) * config.rope_dim);
  DSA_RETURN_IF_ERROR(rope_cos_sin_table(config, 0, rows, host.data()));
  DSA_RETURN_IF_ERROR(allocate_device(host.size() * sizeof(float), table));
  DSA_CUDA_RETURN(cudaMemcpy(table->get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return Status();
}

Status DsaStageWorkspace::Buffers::allocate(const WorkspaceShape& s, const IndexerPlan& indexer_plan) {
  shape = s;
  const int64_t T = s.max_tokens, H = s.H, Q = s.Q, L = s.L, P = s.P, V = s.V, R = s.R;
  const int64_t HI = indexer_plan.heads, W = indexer_row_width(indexer_plan);
  const bool rope = R > 0;
  const auto buffer = [](int64_t values, size_t value_bytes, DeviceMemory* memory) {
    return allocate_device(size_t(values) * value_bytes, memory);
  };
  DSA_RETURN_IF_ERROR(buffer(T * (Q + L + R), 2, &qkv));
  DSA_RETURN_IF_ERROR(buffer(T * Q, 2, &q_c));
  DSA_RETURN_IF_ERROR(buffer(T * L, 2, &kv_c));
  DSA_RETURN_IF_ERROR(buffer(T * H * (P + R), 2, &q));
  if (rope) {
    DSA_RETURN_IF_ERROR(buffer(T * H * (L + R), 2, &q_absorbed));
    DSA_RETURN_IF_ERROR(buffer(T * R, 2, &k_pe));
    DSA_RETURN_IF_ERROR(fill_table(*s.rope, s.max_context, &attention_table));
    DSA_RETURN_IF_ERROR(fill_table(*s.indexer_rope, s.max_context, &indexer_table));
  } else {
    DSA_RETURN_IF_ERROR(buffer(T * H * L, 2, &q_bf16));
    DSA_RETURN_IF_ERROR(buffer(T * H * L, 1, &q_fp8));
  }
  DSA_RETURN_IF_ERROR(buffer(T * HI * kIndexerDim, 2, &index_q));
  DSA_RETURN_IF_ERROR(buffer(T * kIndexerDim, 2, &index_k));
  DSA_RETURN_IF_ERROR(buffer(T * HI, 4, &head_weights));
  if (indexer_plan.pool > 1) DSA_RETURN_IF_ERROR(buffer(T * kIndexerDim, 2, &gate));
  indexer_workspace_bytes = indexer_workspace_layout(indexer_plan).bytes;
  DSA_RETURN_IF_ERROR(buffer(indexer_workspace_bytes, 1, &indexer_workspace));
  DSA_RETURN_IF_ERROR(buffer(T * W, 4, &topk_positions));
  DSA_RETURN_IF_ERROR(buffer(T * W, 4, &slots));
  DSA_RETURN_IF_ERROR(buffer(T * H * L, 2, &latent));
  DSA_RETURN_IF_ERROR(buffer(T * H, 4, &lse));
  DSA_RETURN_IF_ERROR(buffer(T * H * V, 2, &heads));
  if (!rope) {
    counter_count = sparse_mla_split_counter_count(T, H, W);
    DSA_RETURN_IF_ERROR(buffer(counter_count, 4, &split_counters));
    // Zeroed once: every completed launch leaves them zero (sparse_mla.h).
    DSA_CUDA_RETURN(cudaMemset(split_counters.get(), 0, size_t(counter_count) * sizeof(int32_t)));
    partial_count = sparse_mla_split_partials_count(T, H, W);
    if (partial_count > 0) DSA_RETURN_IF_ERROR(buffer(partial_count, 4, &split_partials));
  }
  DSA_RETURN_IF_ERROR(allocate_device(kCublasWorkspaceBytes, &cublas_workspace));
  DSA_CUBLAS_RETURN(cublasCreate(&cublas));
  DSA_RETURN_IF_ERROR(LinearContext::create(&linear));
  if (s.indexer_projections_cublaslt) DSA_RETURN_IF_ERROR(IndexerProjectContext::create(&indexer_projections));
  // The lane's stream and events are made whatever the plan: a stage with
  // plan.overlap_indexer may share a workspace made for one without.
  DSA_CUDA_RETURN(cudaStreamCreateWithFlags(&indexer_stream, cudaStreamNonBlocking));
  DSA_CUDA_RETURN(cudaEventCreateWithFlags(&indexer_fork, cudaEventDisableTiming));
  DSA_CUDA_RETURN(cudaEventCreateWithFlags(&indexer_join, cudaEventDisableTiming));
  DSA_CUDA_RETURN(cudaDeviceSynchronize());  // the counters' memset
  return Status();
}

DsaStageWorkspace::DsaStageWorkspace() : buffers_(std::make_unique<Buffers>()) {}
DsaStageWorkspace::~DsaStageWorkspace() = default;

Status DsaStageWorkspace::create(const DsaLayerConfig& config, const DsaStagePlan& plan,
                                 std::shared_ptr<DsaStageWorkspace>* workspace) {
  if (workspace == nullptr) return invalid_argument("workspace", "a pointer to fill", "a null pointer");
  // The sizes the buffers follow; every other requirement is the stage's to check at its creation.
  const bool sized = config.num_heads >= 1 && config.num_heads <= kMaxHeads && config.kv_lora_rank == kLatentWidth &&
                     config.hidden_size > 0 && config.q_lora_rank > 0 && config.qk_nope_head_dim > 0 &&
                     config.v_head_dim > 0 &&
                     (config.qk_rope_head_dim == 0 || config.qk_rope_head_dim == kSparseMlaV32Rope);
  if (!sized) {
    return invalid_argument(
        "config", "1..128 heads, a 512-wide latent, 0 or 64 RoPE dims and positive sizes",
        "num_heads " + std::to_string(config.num_heads) + ", kv_lora_rank " + std::to_string(config.kv_lora_rank) +
            ", hidden_size " + std::to_string(config.hidden_size) + ", q_lora_rank " +
            std::to_string(config.q_lora_rank) + ", qk_nope_head_dim " + std::to_string(config.qk_nope_head_dim) +
            ", qk_rope_head_dim " + std::to_string(config.qk_rope_head_dim) + ", v_head_dim " +
            std::to_string(config.v_head_dim));
  }
  if (plan.max_tokens < 1 || plan.max_tokens > kDsaStageMaxTokens) {
    return invalid_argument("plan.max_tokens", "1.." + std::to_string(kDsaStageMaxTokens),
                            std::to_string(plan.max_tokens));
  }
  DSA_RETURN_IF_ERROR(check_dsa_stage_indexer_shape(plan));
  // The tables' rotaries (a RoPE layer's): the first problem, named.
  if (const std::vector<std::string> rotary = rotary_problems(config, plan); !rotary.empty()) {
    return Status(ErrorCode::kInvalidArgument, rotary.front());
  }
  const IndexerPlan indexer_plan = dsa_stage_indexer_plan(config, plan);
  DSA_RETURN_IF_ERROR(check_indexer_plan(indexer_plan));
  int device = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  std::shared_ptr<DsaStageWorkspace> made(new DsaStageWorkspace());
  DSA_RETURN_IF_ERROR(made->buffers_->allocate(WorkspaceShape::of(device, config, plan), indexer_plan));
  *workspace = std::move(made);
  return Status();
}

DsaAttentionStage::DsaAttentionStage() : state_(std::make_unique<State>()) {}
DsaAttentionStage::~DsaAttentionStage() = default;

Status DsaAttentionStage::create(const DsaLayerConfig& config, const DsaLayerWeights& weights, const DsaStagePlan& plan,
                                 std::unique_ptr<DsaAttentionStage>* stage,
                                 std::shared_ptr<DsaStageWorkspace> workspace) {
  if (stage == nullptr) return invalid_argument("stage", "a pointer to fill", "a null pointer");
  std::vector<std::string> features, views;
  State::check_layer(config, weights, plan, &features, &views);
  const IndexerPlan indexer_plan = dsa_stage_indexer_plan(config, plan);
  // (check_layer named a bad max_tokens or indexer shape, or a pool the layer's kind does not take; the
  // indexer plan's other fields here.)
  const bool pool_fits = (config.qk_rope_head_dim > 0) == (plan.indexer_pool == 1);
  if (plan.max_tokens >= 1 && plan.max_tokens <= kDsaStageMaxTokens && check_dsa_stage_indexer_shape(plan).ok() &&
      pool_fits) {
    const Status indexer_ok = check_indexer_plan(indexer_plan);
    if (!indexer_ok.ok()) views.push_back(indexer_ok.message());
  }
  if (!features.empty() || !views.empty()) {
    std::string message = "DSA attention stage needs ";
    for (size_t i = 0; i < features.size(); ++i) message += (i > 0 ? ", " : "") + features[i];
    if (!views.empty()) {
      message += std::string(features.empty() ? "" : "; ") + "valid weights and plan: ";
      for (size_t i = 0; i < views.size(); ++i) message += (i > 0 ? "; " : "") + views[i];
    }
    return Status(views.empty() ? ErrorCode::kUnsupported : ErrorCode::kInvalidArgument, message);
  }

  std::unique_ptr<DsaAttentionStage> made(new DsaAttentionStage());
  State& s = *made->state_;
  s.config = config;
  s.w = weights;
  s.plan = plan;
  StepChoices& choices = s.step_choices;
  choices.rope = config.qk_rope_head_dim > 0;
  choices.overlap_indexer = plan.overlap_indexer;
  choices.batch_invariant = plan.batch_invariant;
  choices.value_up_tokens = dsa_stage_value_up_tokens(plan, config.num_heads);
  choices.projection_gemv_tokens = plan.projection_gemv_tokens
                                       ? *plan.projection_gemv_tokens
                                       : dsa_stage_measured_projection_gemv_tokens(config.num_heads);
  choices.hidden = config.hidden_size;
  choices.q_lora = config.q_lora_rank;
  choices.heads_v = config.num_heads * config.v_head_dim;
  s.indexer_plan = indexer_plan;
  s.HI = indexer_plan.heads;
  s.W = indexer_row_width(indexer_plan);
  s.H = config.num_heads;
  s.D = config.hidden_size;
  s.Q = config.q_lora_rank;
  s.L = config.kv_lora_rank;
  s.P = config.qk_nope_head_dim;
  s.V = config.v_head_dim;
  s.R = config.qk_rope_head_dim;
  if (workspace == nullptr) {
    DSA_RETURN_IF_ERROR(DsaStageWorkspace::create(config, plan, &workspace));
  } else {
    int device = 0;
    DSA_CUDA_RETURN(cudaGetDevice(&device));
    const WorkspaceShape wanted = WorkspaceShape::of(device, config, plan);
    if (!(workspace->buffers_->shape == wanted)) {
      return invalid_argument("workspace",
                              "one made on this device for this configuration and plan (" + wanted.describe() + ")",
                              "one made for " + workspace->buffers_->shape.describe());
    }
  }
  s.workspace = workspace;
  s.b = workspace->buffers_.get();
  DSA_RETURN_IF_ERROR(s.bind_cublas(nullptr));
  // The cuBLASLt plans of every m (host work), so that any step may be captured.
  for (int64_t m = 1; m <= plan.max_tokens; ++m) {
    const TensorView hidden_rows = make_tensor(nullptr, DType::kBF16, {m, s.D});
    DSA_RETURN_IF_ERROR(
        s.b->linear.prepare("qkv_a_proj", hidden_rows, weights.fused_qkv_a_proj, s.qkv_width(), CUDA_R_16BF));
    DSA_RETURN_IF_ERROR(
        s.b->linear.prepare("q_b_proj", s.bf16(s.b->q_c, {m, s.Q}), weights.q_b_proj, s.q_width(), CUDA_R_16BF));
    // An out with a padded row stride gets its plan on its first run instead.
    DSA_RETURN_IF_ERROR(
        s.b->linear.prepare("o_proj", s.bf16(s.b->heads, {m, s.H * s.V}), weights.o_proj, s.D, CUDA_R_16BF));
  }
  *stage = std::move(made);
  return Status();
}

bool dsa_stage_supports(const DsaStagePlan& plan, int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) {
  return m >= 1 && m <= plan.max_tokens && num_actual_tokens == m && num_decode_tokens == m;
}

bool DsaAttentionStage::supports(int64_t m, int64_t num_actual_tokens, int64_t num_decode_tokens) const {
  return dsa_stage_supports(state_->plan, m, num_actual_tokens, num_decode_tokens);
}

Status DsaAttentionStage::forward(const DsaStepArgs& args, cudaStream_t stream) {
  return run_steps(DsaPath::kFused, args, 0, kAllSteps, stream);
}

Status DsaAttentionStage::stock_forward(const DsaStepArgs& args, cudaStream_t stream) {
  return run_steps(DsaPath::kStock, args, 0, kAllSteps, stream);
}

Status DsaAttentionStage::step_names(DsaPath path, const DsaStepArgs& args, std::vector<std::string>* names) const {
  DSA_RETURN_IF_ERROR(state_->check_step(args));
  const StepList list = state_->steps_of(path, args);
  names->clear();
  for (int i = 0; i < list.count; ++i) {
    names->push_back(step_name(list.steps[i], state_->plan.indexer_projections_cublaslt));
  }
  return Status();
}

Status DsaAttentionStage::run_steps(DsaPath path, const DsaStepArgs& args, size_t first, size_t count,
                                    cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(state_->check_step(args));
  const StepList list = state_->steps_of(path, args);
  if (count == kAllSteps && first <= size_t(list.count)) count = size_t(list.count) - first;
  if (first > size_t(list.count) || count > size_t(list.count) - first) {
    return invalid_argument("first, count", "steps within the path's " + std::to_string(list.count),
                            std::to_string(first) + ", " + std::to_string(count));
  }
  State& st = *state_;
  const bool overlap = path == DsaPath::kFused && st.plan.overlap_indexer;
  // The indexer's lane forks at its first step and joins before the
  // attention, or at the end of the range, so that every step of the range
  // is ordered before the caller's next work on `stream` (and a capture
  // ends joined).
  bool forked = false;
  const auto join = [&]() -> Status {
    forked = false;
    DSA_CUDA_RETURN(cudaEventRecord(st.b->indexer_join, st.b->indexer_stream));
    DSA_CUDA_RETURN(cudaStreamWaitEvent(stream, st.b->indexer_join, 0));
    return Status();
  };
  Status failed;
  for (size_t i = first; i < first + count && failed.ok(); ++i) {
    const Step step = list.steps[i];
    const bool indexer_lane = overlap && on_indexer_lane(step);
    if (indexer_lane && !forked) {
      DSA_CUDA_RETURN(cudaEventRecord(st.b->indexer_fork, stream));
      DSA_CUDA_RETURN(cudaStreamWaitEvent(st.b->indexer_stream, st.b->indexer_fork, 0));
      forked = true;
    }
    if (forked && step == Step::kAttention) DSA_RETURN_IF_ERROR(join());
    const Status s = st.run_step(step, args, indexer_lane ? st.b->indexer_stream : stream);
    if (!s.ok()) {
      const char* name = step_name(step, st.plan.indexer_projections_cublaslt);
      failed = Status(s.code(), std::string("stage step '") + name + "': " + s.message());
    }
  }
  if (forked) {
    const Status joined = join();
    if (failed.ok()) return joined;  // else the step's error is the one to report
  }
  return failed;
}

DsaStageIntermediates DsaAttentionStage::intermediates(int64_t m) const {
  const State& s = *state_;
  DsaStageIntermediates v;
  v.qkv = s.bf16(s.b->qkv, {m, s.qkv_width()});
  v.q_c = s.bf16(s.b->q_c, {m, s.Q});
  v.kv_c = s.bf16(s.b->kv_c, {m, s.L});
  v.q = s.bf16(s.b->q, {m, s.H, s.P + s.R});
  if (s.rope()) {
    v.q_absorbed = s.bf16(s.b->q_absorbed, {m, s.H, s.L + s.R});
    v.k_pe = s.bf16(s.b->k_pe, {m, s.R});
  } else {
    v.q_fp8 = make_tensor(s.b->q_fp8.get(), DType::kFP8E4M3, {m, s.H, s.L});
  }
  v.index_q = s.bf16(s.b->index_q, {m, s.HI, kIndexerDim});
  v.index_k = s.bf16(s.b->index_k, {m, kIndexerDim});
  v.head_weights = make_tensor(s.b->head_weights.get(), DType::kF32, {m, s.HI});
  if (s.pooled()) v.gate = s.bf16(s.b->gate, {m, kIndexerDim});
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(s.indexer_plan);
  v.index_logits = make_strided(static_cast<char*>(s.b->indexer_workspace.get()) + layout.logits, DType::kF32,
                                {m, layout.logits_stride}, {layout.logits_stride, 1});
  v.indexer_workspace = s.indexer_workspace_view();
  v.topk_positions = make_tensor(s.b->topk_positions.get(), DType::kI32, {m, s.W});
  v.slots = make_tensor(s.b->slots.get(), DType::kI32, {m, s.W});
  v.latent = s.bf16(s.b->latent, {m, s.H, s.L});
  v.lse = make_tensor(s.b->lse.get(), DType::kF32, {m, s.H});
  v.heads = s.bf16(s.b->heads, {m, s.H, s.V});
  return v;
}

std::shared_ptr<DsaStageWorkspace> DsaAttentionStage::workspace() const { return state_->workspace; }
const DsaLayerConfig& DsaAttentionStage::config() const { return state_->config; }
const DsaStagePlan& DsaAttentionStage::plan() const { return state_->plan; }

}  // namespace dsa
