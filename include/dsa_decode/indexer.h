// The glm5next DSA indexer, decode path: per layer and step, m tokens
// (1..16), H index heads of 128 (plan.heads: 16, 32 or 64), pools of S tokens
// (plan.pool: 4, 8 or 16; or 1, below), the top K tokens (plan.topk) as K / S pools.
//   project  index_q [m,H,128] BF16 = q_c wq_b^T; index_k [m,128] BF16 = x wk^T;
//            head_weights [m,H] f32 = x weights_proj^T; gate [m,128] BF16 = x compress_gate^T
//   prepare  1. k = LayerNorm(index_k), eps 1e-6, BF16  2. q: Hadamard-128 x 128^-0.5,
//            BF16, e4m3 with a power-of-two scale s per head; w' = (w s) c with
//            c = fl32((128 H)^-0.5) (2^-6 at H = 32)
//            3. at pos % S == S - 1, pool pos / S = the softmax(gate + ape)-weighted sum of
//            its S k rows, Hadamard, e4m3 with one scale, into k_cache  4. k, gate -> ring
//   select   (L = pos + 1, n = L / S) 5. L <= K: row 0..L-1, then -1
//            6. logit[p] = kscale[p] sum_h w'[h] ReLU(q[h] . k[p]) for p < n
//            7. the K / S largest (ties to the lower pool, NaN as -inf, -0 == +0) in
//            increasing pool order as S p..S p + S - 1, then the tail tokens S n..L-1
//            from column K, then -1 up to indexer_row_width(plan)
//            8. slot = block_table[r, pos / block_size] * block_size + pos % block_size
// Pool 1 (no pooling, DeepSeek-V3.2's indexer: 64 heads, top-2048 tokens): no gate, ape
// or ring; step 1 is followed by RoPE of k's first R = plan.rope_dims dims (plan.rope_style,
// the cos/sin row of the token's position; BF16), step 2's Hadamard starts from q
// with its first R dims of every head rotated the same way; step 3 writes every
// token's key (k's Hadamard, e4m3 with one scale) at entry pos % block_size of its
// page; the logits run over every token (n = L), no tail (W = K rounded up to 128).
// Rotation: a' = fma(a, c, -(b s)), b' = fma(b, c, a s) in FP32 (rope.h's order),
// c, s the table's entries of the pair; a position outside the table's rows
// rotates to zeros (q of padding tokens; trusted positions are < max_context <= rows).
// The tail (tokens of the incomplete pool) is always selected, as vLLM's
// index_kpool_always_select_tail. The default plan is glm5next's first shape: H = 32, S = 4, K = 2048 (512
// pools), rows 2176 wide.
// Roundings and fixed orders are the CPU reference's (src/indexer/indexer_math.h,
// docs/indexer.md): prepare, prefill, remap and the GEMV projections equal it
// bit for bit, select too under kExact; under kFp32Accumulation each logit is
// within reference::indexer_logit_bounds and the rows are the exact selection
// over the GPU's logits (deterministic).
//
// State, paged with the KV cache's block table (P = block_size / S pools a page):
//   block_table [requests, width] int32; ring [requests, 2, RING, 128] BF16 (k and
//   gate at slot pos % RING; RING = S, or 2 S with drafts); k_cache [blocks, P * 132] u8:
//   a page holds P x 128 e4m3 codes, then P f32 scales; pool p of request r is
//   entry p % P of page block_table[r, p / P].
// Step inputs: positions [m] int64, token_requests [m] int32 (< 0: padding,
// rows of -1). A request's tokens have increasing consecutive positions, at
// most RING - (S - 1) per step (indexer_tokens_per_request).
//
// Untrusted device values: a token whose request >= requests or whose position
// is < 0, >= max_context or past the table's width gets rows of -1 and writes
// nothing; a block outside [0, blocks) skips its page's writes, gives its
// pools logit -inf and remaps to -1. Each case counts at least once in
// error_count (test it for zero). No kernel touches memory outside its buffers.
//
// Launches: PDL, no allocation or synchronization, graph capturable after a
// first uncaptured call per device (indexer_project_gemv: per m rounded up to
// a power of two; indexer_project: per shape; indexer_select: per H and
// logits, which pick the logits kernel). prepare and select read
// positions, token_requests and the block table before griddepcontrol.wait:
// they must be complete when the step's first kernel starts (host copies or
// non-PDL kernels). select also reads early the K-cache pools no token of the
// step completes: no kernel of the chain may write them (pages shared between
// requests are complete and read-only). indexer_project (cuBLASLt) sets no PDL
// attribute; a PDL kernel after it must still wait before reading its outputs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "dsa_decode/rope.h"
#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kIndexerDim = 128;
inline constexpr int kIndexerPoolBytes = kIndexerDim + 4;  // 128 e4m3 codes + one FP32 scale
inline constexpr int kIndexerBlockMultiple = 128;           // block_size: pages of a multiple of 8 pools of 16
inline constexpr int kIndexerMaxTokens = 16;
inline constexpr int64_t kIndexerMaxContext = int64_t(1) << 22;
inline constexpr int kIndexerMaxTopPools = 512;  // plan.topk / plan.pool at most (pools of 4, 8, 16)
inline constexpr int kIndexerMaxTopTokens = 2048;  // plan.topk at most with pool 1 (no pooling)
inline constexpr int kIndexerTokenBlockMultiple = 64;  // block_size with pool 1: pages of a multiple of 64 keys
inline constexpr float kIndexerNormEps = 1e-6f;

// The default plan's shape (glm5next's first configuration); any other comes
// from the plan through the functions below.
inline constexpr int kIndexerHeads = 32;
inline constexpr int kIndexerPoolSize = 4;
inline constexpr int kIndexerTopK = 2048;
inline constexpr int kIndexerTopPools = kIndexerTopK / kIndexerPoolSize;  // 512
inline constexpr int kIndexerPooledColumns = kIndexerTopK;               // 2048
inline constexpr int kIndexerRowWidth = 2176;  // 2048 pooled + up to 3 tail tokens + -1 padding

enum class IndexerLogits : int {
  kFp32Accumulation = 0,  // default: FP16 tensor cores, FP32 accumulation, within the bound
  kExact = 1,             // FP64 tensor cores: logits and rows bitwise the reference's
};

// Shapes fixed once per layer configuration; the workspace is sized from them.
struct IndexerPlan {
  int max_tokens = kIndexerMaxTokens;  // largest m of a step, 1..16
  int64_t max_context = 131072;        // largest L = pos + 1, 1..kIndexerMaxContext
  int ring = 4;                        // RING: pool (no draft tokens) or 2 * pool
  int block_size = 256;                // tokens per KV block: a positive multiple of 128 (of 64 with pool 1)
  IndexerLogits logits = IndexerLogits::kFp32Accumulation;  // step 6's dots
  int heads = kIndexerHeads;           // H, index heads: 16, 32 or 64 (HF index_n_heads)
  int pool = kIndexerPoolSize;         // S, tokens per pool: 4, 8 or 16 (HF index_kpool), or 1:
                                       // no pooling (DeepSeek-V3.2), each token its own key
  int topk = kIndexerTopK;             // K, tokens of the selected pools: a multiple of S,
                                       // S..kIndexerMaxTopPools * S (HF index_topk); 1..2048 at S = 1
  int rope_dims = 0;                   // R, rotated dims at the start of every q head and of k:
                                       // 0 (none), or 16, 32, 64, 128 with pool 1 (V3.2: 64)
  RopeStyle rope_style = RopeStyle::kHalfSplit;  // the pairs rotated (V3.2's indexer: half-split)
};

// Byte offsets (256-byte aligned) into the caller's workspace.
struct IndexerWorkspaceLayout {
  int64_t q_fp8 = 0;         // [max_tokens, H, 128] e4m3 codes
  int64_t head_weights = 0;  // [max_tokens, H] FP32: folded weights w'
  int64_t logits = 0;        // [max_tokens, logits_stride] FP32, written by indexer_select
  int64_t logits_stride = 0; // pools per token row: ceil(max_context / S)
  int64_t bytes = 0;         // total
};

// Errors name the plan's field, what it must be and what it is.
Status check_indexer_plan(const IndexerPlan& plan);
// For a plan that passes check_indexer_plan.
IndexerWorkspaceLayout indexer_workspace_layout(const IndexerPlan& plan);

// The shapes derived from a plan (any field values; meaningful for a plan
// that passes check_indexer_plan).
// Selected pools K / S.
inline int indexer_top_pools(const IndexerPlan& plan) { return plan.topk / plan.pool; }
// Columns of a row (topk_positions, slots): K + S - 1 rounded up to 128.
inline int indexer_row_width(const IndexerPlan& plan) { return (plan.topk + plan.pool - 1 + 127) / 128 * 128; }
// Pools of one K-cache page, P = block_size / S.
inline int64_t indexer_pools_per_page(const IndexerPlan& plan) { return plan.block_size / plan.pool; }
// Bytes of one K-cache page, P * 132 (k_cache's dim 1).
inline int64_t indexer_page_bytes(const IndexerPlan& plan) { return indexer_pools_per_page(plan) * kIndexerPoolBytes; }
// Tokens of one request a step may hold: RING - (S - 1); any (max_tokens) with pool 1 (no ring).
inline int indexer_tokens_per_request(const IndexerPlan& plan) {
  return plan.pool == 1 ? kIndexerMaxTokens : plan.ring - (plan.pool - 1);
}
// The smallest RING for a pool size and tokens of one request per step (1 +
// draft tokens): S, or 2 S when S - 1 + tokens exceeds S; 0 when even 2 S is
// too small; 1 (no ring) for pool 1.
inline int indexer_ring_for(int pool, int tokens_per_request) {
  if (pool == 1) return 1;
  const int needed = pool - 1 + tokens_per_request;
  return needed <= pool ? pool : needed <= 2 * pool ? 2 * pool : 0;
}

// The paged indexer state shared by every step.
struct IndexerState {
  TensorView block_table;  // [requests, width] int32, dim 1 contiguous
  TensorView ring;         // [requests, 2, RING, 128] BF16, dims 1-3 contiguous, request stride % 8 == 0, 16 B aligned;
                           // not read with pool 1 (may be empty)
  TensorView k_cache;      // [blocks, P * 132] u8, dim 1 contiguous, page stride % 16 == 0, 16 B aligned
};

// Projections: every view has dim 1 (dims 1-2 for index_q) contiguous, a row
// stride that is a multiple of 16 bytes and >= the row, 16 B alignment;
// outputs overlap nothing. Q, D >= 1.
struct IndexerProjectArgs {
  IndexerPlan plan;          // m = q_c's rows must be in 1..plan.max_tokens
  TensorView q_c;            // [m, Q] BF16, the normed query latent
  TensorView x;              // [m, D] BF16, the hidden states the attention takes
  TensorView wq_b;           // [H * 128, Q] BF16, nn.Linear layout [out, in]
  TensorView wk;             // [128, D] BF16
  TensorView weights_proj;   // [H, D] BF16
  TensorView compress_gate;  // [128, D] BF16; at plan.pool == 1 empty (with gate), no gate is computed
  // Outputs, in the layouts indexer_prepare takes:
  TensorView index_q;       // [m, H, 128] BF16: q_c @ wq_b^T, head h = columns 128 h .. 128 h + 127
  TensorView index_k;       // [m, 128] BF16: x @ wk^T, before its LayerNorm
  TensorView head_weights;  // [m, H] FP32: x @ weights_proj^T, the FP32 sum itself (no BF16 rounding)
  TensorView gate;          // [m, 128] BF16: x @ compress_gate^T
};

// indexer_project's cuBLASLt handle, workspace (on the device current at
// create()) and per-shape algorithms. One stream at a time; not thread-safe.
class IndexerProjectContext {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;  // cuBLAS's advice for Hopper

  // A context that holds nothing: create() makes a usable one.
  IndexerProjectContext();
  ~IndexerProjectContext();
  IndexerProjectContext(IndexerProjectContext&&) noexcept;
  IndexerProjectContext& operator=(IndexerProjectContext&&) noexcept;

  // cudaMalloc: call it outside a graph capture.
  static Status create(IndexerProjectContext* context, size_t workspace_bytes = kDefaultWorkspaceBytes);
  bool created() const { return state_ != nullptr; }

 private:
  friend Status indexer_project(const IndexerProjectArgs& args, IndexerProjectContext& context,
                                cudaStream_t stream);
  struct State;  // src/indexer/indexer_project.cpp
  std::unique_ptr<State> state_;
};

// Steps 1-4: LayerNorm, q quant and weight fold, pool compression, ring.
struct IndexerPrepareArgs {
  IndexerPlan plan;
  TensorView index_q;        // [m, H, 128] BF16, dims 1-2 contiguous, token stride % 8 == 0, 16 B aligned
  TensorView index_k;        // [m, 128] BF16, dim 1 contiguous, token stride a multiple of 8, 16-byte aligned
  TensorView head_weights;   // [m, H] FP32, dim 1 contiguous, token stride a multiple of 4, 16-byte aligned
  TensorView gate;           // [m, 128] BF16, as index_k; not read with pool 1 (may be empty)
  TensorView k_norm_weight;  // [128] FP32, contiguous
  TensorView k_norm_bias;    // [128] FP32, contiguous
  TensorView ape;            // [S, 128] FP32, contiguous; not read with pool 1 (may be empty)
  TensorView positions;      // [m] int64, contiguous
  TensorView token_requests; // [m] int32, contiguous
  IndexerState state;        // ring and k_cache are written
  TensorView workspace;      // [>= indexer_workspace_layout(plan).bytes] u8, 256-byte aligned; q_fp8, head_weights written
  unsigned int* error_count = nullptr;  // optional device counter of untrusted values out of range
  TensorView cos_sin;  // plan.rope_dims = R > 0: [rows >= plan.max_context, R] F32 or BF16 (rope.h's
                       // table: row p = cos | sin of position p), dim 1 contiguous; else not read
};

// Steps 5-8: logits, top K / S pools, expansion, remap. W = indexer_row_width(plan).
struct IndexerSelectArgs {
  IndexerPlan plan;
  TensorView positions;       // [m] int64, contiguous
  TensorView token_requests;  // [m] int32, contiguous
  IndexerState state;         // read only
  TensorView workspace;       // as prepare wrote it
  TensorView topk_positions;  // optional [m, W] int32 out, request-local positions; dim 1
                              // contiguous, token stride % 4 == 0 and >= W, 16 B aligned
  TensorView slots;  // [m, W] int32 out, global KV slots; as topk_positions, required
  unsigned int* error_count = nullptr;
};

// Step 8 for caller rows (MTP drafts reuse step 0's selection): a negative
// position stays -1; a position >= L, a page past the width or a block
// outside [0, blocks) gives -1 and counts; padding tokens get rows of -1.
struct IndexerRemapArgs {
  IndexerPlan plan;
  TensorView positions;       // [m] int64, contiguous
  TensorView token_requests;  // [m] int32, contiguous
  IndexerState state;         // read only: block_table, and k_cache's blocks for the bound
  TensorView topk_positions;  // [m, W] int32 in, request-local positions; as IndexerSelectArgs' rows
  TensorView slots;           // [m, W] int32 out, global KV slots; as topk_positions
  unsigned int* error_count = nullptr;
};

// Step 9, prefill of positions 0..n-1 of one request: the k_cache and ring
// bytes of prepare run token by token; decode continues at position n.
struct IndexerPrefillArgs {
  IndexerPlan plan;
  TensorView index_k;        // [n, 128] BF16, as in prepare; n >= 1
  TensorView gate;           // [n, 128] BF16; not read with pool 1 (may be empty)
  TensorView k_norm_weight;  // [128] FP32
  TensorView k_norm_bias;    // [128] FP32
  TensorView ape;            // [S, 128] FP32; not read with pool 1 (may be empty)
  int request = 0;           // row of block_table and ring
  IndexerState state;        // ring and k_cache are written
  unsigned int* error_count = nullptr;
  TensorView cos_sin;        // as IndexerPrepareArgs::cos_sin (prefill rotates positions 0..n-1)
};

// Argument checks; errors name the argument, what was expected and got.
Status check_indexer_prepare(const IndexerPrepareArgs& args);
Status check_indexer_select(const IndexerSelectArgs& args);
Status check_indexer_prefill(const IndexerPrefillArgs& args);
Status check_indexer_remap(const IndexerRemapArgs& args);
Status check_indexer_project(const IndexerProjectArgs& args);

// Host-side check of a step's positions and requests against the rules above
// (for trusted callers); errors name the token.
Status check_indexer_batch(const IndexerPlan& plan, int m, const int64_t* positions, const int32_t* token_requests,
                           int64_t requests, int64_t block_table_width);

// cuBLASLt, FP32 accumulation in its order: head_weights within 1e-5 *
// sum |products| of the exact sum, BF16 outputs within one ulp plus that
// term. The same bits per shape on every call; a token's may change with m.
Status indexer_project(const IndexerProjectArgs& args, IndexerProjectContext& context, cudaStream_t stream);

// The same as one GEMV launch in a fixed order, bit for bit
// reference::indexer_project_gemv and independent of m and the batch; Q and D
// multiples of 8, at most 16384 and at most what m's rows staged in shared
// memory allow (D = 7168 takes at most 8 tokens a launch: launch token groups,
// the error names the limit); no context.
Status check_indexer_project_gemv(const IndexerProjectArgs& args);
Status indexer_project_gemv(const IndexerProjectArgs& args, cudaStream_t stream);

Status indexer_prepare(const IndexerPrepareArgs& args, cudaStream_t stream);

Status indexer_select(const IndexerSelectArgs& args, cudaStream_t stream);

Status indexer_remap(const IndexerRemapArgs& args, cudaStream_t stream);

Status indexer_prefill(const IndexerPrefillArgs& args, cudaStream_t stream);

}  // namespace dsa
