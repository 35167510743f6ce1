// The glm5next DSA indexer, decode path (issue 5): pooled FP8 keys, logits,
// top-512 pools, expansion to token positions and remap to KV-cache slots.
//
// STATE: contract, plan, argument checks, the bit-exact CPU reference
// (src/indexer/indexer_reference.h), the GPU select step (steps 5-8:
// indexer_select, and the benchmark's baseline indexer_select_baseline), the
// GPU prepare and prefill (steps 1-4 and 9: indexer_prepare,
// indexer_prefill) and the projections (indexer_project_gemv, bitwise
// reproducible; indexer_project, cuBLASLt, within a float64 tolerance): all
// measured on the H200 (docs/indexer.md).
//
// Per DSA layer and decode step, m tokens (1..16), 32 index heads of 128,
// pools of 4 tokens. The projections (indexer_project_gemv, one GEMV launch,
// or indexer_project through cuBLASLt) give:
//
//   index_q       [m, 32, 128] BF16   wq_b(q_c)
//   index_k       [m, 128]     BF16   wk(x), before its LayerNorm
//   head_weights  [m, 32]      FP32   x @ weights_proj^T
//   gate          [m, 128]     BF16   x @ compress_gate^T
//
// Layer parameters: k_norm_weight [128] FP32, k_norm_bias [128] FP32 (a BF16
// checkpoint's values convert to FP32 exactly), ape [4, 128] FP32 (row j pairs
// with the pool's token 4p + j).
//
// Per-request state, paged with the main KV cache's block table:
//
//   block_table [requests, width] int32: block_table[r, i] = block holding the
//               request's tokens [i * block_size, (i + 1) * block_size).
//   ring        [requests, 2, RING, 128] BF16: [r, 0, s] the LayerNormed k and
//               [r, 1, s] the gate of the request's token at position pos with
//               s = pos % RING. RING = 4 without draft tokens, 8 with drafts.
//   k_cache     [blocks, block_size / 4 * 132] bytes: the indexer page of each
//               block holds its P = block_size / 4 pools; in a page, P x 128
//               e4m3 codes (pool entry e at byte 128 e) then P FP32 scales (at
//               byte 128 P + 4 e). Pool p of request r lives in page
//               block_table[r, p / P], entry p % P (pool slot = block * P + e).
//               block_size is a multiple of 128, so P is a multiple of 32.
//
// Step inputs: positions [m] int64 (vLLM's layout), token_requests [m] int32
// (the row of block_table and ring of each token; negative = a padding token:
// nothing is written and its rows are all -1). L = pos + 1 is the token's
// context. Tokens of one request appear in increasing, consecutive positions,
// at most RING - 3 of them per step (see "ring" below).
//
// The steps, in this order (every rounding named; "fma" is one fused
// multiply-add; the fixed orders are in src/indexer/indexer_math.h):
//
//  prepare (one token after another in token order; per token):
//   1. k = LayerNorm(index_k) over 128, eps 1e-6, FP32, stored BF16. Order:
//      as a warp holding elements 4l..4l+3 in lane l: lane sums
//      ((x0 + x1) + x2) + x3, then a butterfly over lanes (xor 16, 8, 4, 2, 1);
//      mean = sum * 2^-7; d = x - mean; lane sums of squares
//      fma(d3, d3, fma(d2, d2, fma(d1, d1, d0 * d0))), the same butterfly;
//      var = sum * 2^-7; rstd = 1 / sqrt(var + 1e-6) (both correctly
//      rounded); y = BF16(fma(d * rstd, weight, bias)).
//   2. q, per head: Hadamard-128 of the BF16 row in FP32 (butterfly stages
//      h = 1, 2, ..., 64, pairs (i, i + h) with i & h == 0 become a + b and
//      a - b), times the FP32 constant 128^-0.5, rounded to BF16. Then the
//      power-of-two scale s = 2^ceil(log2(max(absmax, 1e-4) / 448)), exact
//      (from the exponent and mantissa bits, no log2f), and the codes
//      e4m3(clamp(x * (1 / s), +-448)) (multiplying by the exact 1 / s is the
//      correctly rounded x / s). Head weight: w' = (w * s) * 2^-6: the
//      issue's 128^-0.5 * 32^-0.5 is exactly 2^-6, so the fold is exact unless
//      it over- or underflows.
//   3. When pos % 4 == 3, the pool p = pos / 4 is compressed from tokens
//      4p..4p+3 (the first three read from the ring before this token is
//      stashed, the last this token's own k and gate): per dim i, FP32,
//      s_j = gate_j + ape[j]; m = max_j s_j; e_j = exp(s_j - m) with the
//      library's own exp (indexer_math.h: basic operations only, so host and
//      device give the same bits; error < 2 ulp); sum = ((e0 + e1) + e2) + e3;
//      w_j = e_j / sum (rounded division); pooled = fma(w3, k3, fma(w2, k2,
//      fma(w1, k1, w0 * k0))), rounded to BF16; then Hadamard, BF16 and FP8
//      with one scale per pool exactly as step 2; written to k_cache.
//   4. The token's k and gate are stashed in ring slot pos % RING.
//  select (after prepare; per token, L = pos + 1, n = floor(L / 4)):
//   5. L <= 2048: row = 0, 1, ..., L - 1, then -1 (no logits).
//   6. L > 2048: logit[p] = kscale[p] * sum_h w'[h] * ReLU(q_fp8[h] . k_fp8[p])
//      for pools p < n, FP32 (the reference: each head's dot exactly, rounded
//      to FP32 once; acc = fma(w'[h], relu, acc) for h = 0..31 from +0; times
//      kscale). The GPU select computes each head's dot exactly too (FP64
//      tensor-core MMA: every partial sum of e4m3 products is a multiple of
//      2^-18 below 2^25, exact in double in any order), so its logits, and
//      hence its rows, equal the reference's bit for bit. Opt-in
//      (plan.logits = IndexerLogits::kFp32Accumulation, as stock engines
//      score with FP8 tensor cores): each dot on the FP16 tensor cores (every
//      e4m3 value is an FP16 value) with FP32 accumulation in the hardware's
//      order, then the same FP32 chain; each logit within
//      kscale[p] * sum_h |w'[h]| * (2^-10 * sum_i |q[h, i] k[p, i]| +
//      70 * 2^-24 * |exact dot|) of the reference's
//      (reference::indexer_logit_bounds), and the rows are step 7's
//      selection over the logits the GPU computed (the same bits on every
//      run; a near-tie may pick another pool than the exact logits would).
//   7. The 512 pools of largest logit; ties go to the lower pool index; NaN
//      counts as -inf and -0 equals +0. Columns [0, 2048): the chosen pools in
//      increasing pool index, pool p as tokens 4p, 4p+1, 4p+2, 4p+3. Then the
//      tail tokens 4n..L-1 (0 to 3 of them) from column 2048, then -1 to 2176.
//   8. Remap: slot = block_table[r, pos / block_size] * block_size +
//      pos % block_size; -1 stays -1.
//
// Ring: the tokens a step writes for one request, plus the three before the
// first of them that its pools may read, must fit the ring without wrapping:
// hence at most RING - 3 tokens per request per step (1 for RING 4, 5 for
// RING 8). Under that rule reading every pool's tokens before any stash gives
// the same result as the token-by-token order above.
//
// Untrusted device values (DESIGN.md section 2): a token whose request is
// >= requests, whose position is negative, >= the plan's max_context or past
// the block table's width writes nothing and gets rows of -1; a block table
// entry outside [0, blocks) makes the writes to that page skipped, the logits
// of its pools -inf and its positions remap to -1. Each such case increments the
// optional error counter at least once (the exact count is unspecified: test
// it for zero). No kernel reads or writes outside the buffers it was given.
//
// Nothing on the run path allocates or synchronizes (CUDA-graph capturable):
// the caller sizes the workspace with indexer_workspace_layout().
//
// PDL: indexer_prepare's and indexer_select's kernels read the step's inputs
// (positions, token_requests and the block table) before
// griddepcontrol.wait, while the kernel before them may still run. Those inputs must be complete when the
// step's first kernel starts: written by host copies or by kernels that
// finish before it (any kernel that does not trigger its dependents early,
// which is every kernel not written for PDL), never by a kernel of the same
// PDL chain. The logits kernel also reads, before the wait, the K cache
// entries of the pools no token of the step completes: pool q of request r
// with 4q + 3 below the smallest position of the step's tokens of r (the
// prepare step writes only the pools its tokens complete; an earlier step's
// entries are complete). So no kernel of the chain may write those entries:
// the pages of a request's complete pools are not written by a step of
// another request (a page shared between requests, as prefix caching shares
// them, is complete and read-only). Everything else the prepare step writes
// (q_fp8, folded weights, ring, the pools it completes) is read after the
// wait.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

inline constexpr int kIndexerHeads = 32;
inline constexpr int kIndexerDim = 128;
inline constexpr int kIndexerPoolSize = 4;
inline constexpr int kIndexerTopPools = 512;
inline constexpr int kIndexerPooledColumns = kIndexerTopPools * kIndexerPoolSize;  // 2048
inline constexpr int kIndexerRowWidth = 2176;  // 2048 pooled + up to 3 tail tokens + -1 padding
inline constexpr int kIndexerPoolBytes = kIndexerDim + 4;  // 128 e4m3 codes + one FP32 scale
inline constexpr int kIndexerBlockMultiple = kIndexerPoolSize * 32;  // pages of a multiple of 32 pools
inline constexpr int kIndexerMaxTokens = 16;
// Positions stay in int32 in the rows; the baseline's logits workspace is
// 4 * max_context bytes per token (16 MiB per token at the bound).
inline constexpr int64_t kIndexerMaxContext = int64_t(1) << 22;
inline constexpr float kIndexerNormEps = 1e-6f;

// How step 6 computes each head's dot (see step 6 above).
enum class IndexerLogits : int {
  kFp32Accumulation = 0,  // the default: FP16 tensor cores, FP32 accumulation, logits within a bound
  kExact = 1,             // opt-in: FP64 tensor cores, exact; logits and rows bitwise the reference's
};

// Shapes fixed once per layer configuration; the workspace is sized from them.
struct IndexerPlan {
  int max_tokens = kIndexerMaxTokens;  // largest m of a step, 1..16
  int64_t max_context = 131072;        // largest L = pos + 1, 1..kIndexerMaxContext
  int ring = 4;                        // RING: 4, or 8 with draft tokens
  int block_size = 256;                // tokens per KV block: a positive multiple of 128
  IndexerLogits logits = IndexerLogits::kFp32Accumulation;  // select's dots (indexer_select and its baseline)
};

// Byte offsets into the caller's workspace (each 256-byte aligned) and its size.
// The workspace carries the prepare step's outputs to the select step.
struct IndexerWorkspaceLayout {
  int64_t q_fp8 = 0;         // [max_tokens, 32, 128] e4m3 codes
  int64_t head_weights = 0;  // [max_tokens, 32] FP32: folded weights w'
  int64_t logits = 0;        // [max_tokens, logits_stride] FP32, written by indexer_select and its baseline
  int64_t logits_stride = 0; // pools per token row: ceil(max_context / 4)
  int64_t bytes = 0;         // total
};

Status check_indexer_plan(const IndexerPlan& plan);
// For a plan that passes check_indexer_plan.
IndexerWorkspaceLayout indexer_workspace_layout(const IndexerPlan& plan);

// The paged indexer state shared by every step.
struct IndexerState {
  TensorView block_table;  // [requests, width] int32, dim 1 contiguous
  // [requests, 2, RING, 128] BF16, dims 1-3 contiguous, request stride a
  // multiple of 8, data 16-byte aligned.
  TensorView ring;
  // [blocks, block_size / 4 * 132] u8, dim 1 contiguous, page stride a
  // multiple of 16 (may be padded), data 16-byte aligned.
  TensorView k_cache;
};

// The projections before prepare (issue 5's step 1): four products
// out[t, j] = sum_i in[t, i] * weight[j, i] of BF16 inputs, on the GPU through
// cuBLASLt. Every view: dim 1 (dims 1-2 for index_q) contiguous, a row stride
// of a multiple of 16 bytes (8 BF16 or 4 FP32 elements) and at least the row's
// width, data 16-byte aligned, on CUDA; outputs share no memory with the
// inputs or with each other. Q (q_lora_rank) and D (hidden) are any sizes >= 1
// (glm5next: 1536 and 4096).
struct IndexerProjectArgs {
  IndexerPlan plan;          // m = q_c's rows must be in 1..plan.max_tokens
  TensorView q_c;            // [m, Q] BF16, the normed query latent
  TensorView x;              // [m, D] BF16, the hidden states the attention takes
  TensorView wq_b;           // [32 * 128, Q] BF16, nn.Linear layout [out, in]
  TensorView wk;             // [128, D] BF16
  TensorView weights_proj;   // [32, D] BF16
  TensorView compress_gate;  // [128, D] BF16
  // Outputs, in the layouts indexer_prepare takes:
  TensorView index_q;       // [m, 32, 128] BF16: q_c @ wq_b^T, head h = columns 128 h .. 128 h + 127
  TensorView index_k;       // [m, 128] BF16: x @ wk^T, before its LayerNorm
  TensorView head_weights;  // [m, 32] FP32: x @ weights_proj^T, the FP32 sum itself (no BF16 rounding)
  TensorView gate;          // [m, 128] BF16: x @ compress_gate^T
};

// The caller-owned resources of indexer_project: a cuBLASLt handle and a
// workspace allocated once by create() on the device current then (use it
// on that device), and the matmul descriptors and algorithm of each shape
// (m, Q, D, row strides), chosen by cuBLASLt's heuristic on the first call of
// that shape and reused after (host memory). One stream at a time: every
// call uses the same workspace. Not thread-safe.
class IndexerProjectContext {
 public:
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;  // cuBLAS's advice for Hopper

  // A context that holds nothing: create() makes a usable one.
  IndexerProjectContext();
  ~IndexerProjectContext();
  IndexerProjectContext(IndexerProjectContext&&) noexcept;
  IndexerProjectContext& operator=(IndexerProjectContext&&) noexcept;

  // Replaces *context with a new handle and a workspace of workspace_bytes
  // (cudaMalloc: call it outside a graph capture).
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
  // [m, 32, 128] BF16, dims 1-2 contiguous, token stride a multiple of 8, 16-byte aligned.
  TensorView index_q;
  TensorView index_k;        // [m, 128] BF16, dim 1 contiguous, token stride a multiple of 8, 16-byte aligned
  TensorView head_weights;   // [m, 32] FP32, dim 1 contiguous, token stride a multiple of 4, 16-byte aligned
  TensorView gate;           // [m, 128] BF16, as index_k
  TensorView k_norm_weight;  // [128] FP32, contiguous
  TensorView k_norm_bias;    // [128] FP32, contiguous
  TensorView ape;            // [4, 128] FP32, contiguous
  TensorView positions;      // [m] int64, contiguous
  TensorView token_requests; // [m] int32, contiguous
  IndexerState state;        // ring and k_cache are written
  TensorView workspace;      // [>= indexer_workspace_layout(plan).bytes] u8, 256-byte aligned; q_fp8, head_weights written
  unsigned int* error_count = nullptr;  // optional device counter of untrusted values out of range
};

// Steps 5-8: logits, top-512, expansion, remap.
struct IndexerSelectArgs {
  IndexerPlan plan;
  TensorView positions;       // [m] int64, contiguous
  TensorView token_requests;  // [m] int32, contiguous
  IndexerState state;         // read only
  TensorView workspace;       // as prepare wrote it
  // [m, 2176] int32 out, request-local token positions; dim 1 contiguous,
  // token stride a multiple of 4 and >= 2176, data 16-byte aligned.
  // Optional: absent (null data) = not written.
  TensorView topk_positions;
  TensorView slots;  // [m, 2176] int32 out, global KV slots; as topk_positions, required
  unsigned int* error_count = nullptr;
};

// Step 8 alone, for rows the caller brings (MTP draft steps 1+ reuse step
// 0's selection instead of running the indexer): request-local positions to
// global KV slots through the block table. A negative position stays -1; a
// position at or past the token's context L = pos + 1 (a row from the
// future), a page past the table's width or a block outside [0, blocks)
// gives -1 and is counted. A padding token (request < 0) gets a row of -1;
// an untrusted token (as in select) a row of -1 and one count.
struct IndexerRemapArgs {
  IndexerPlan plan;
  TensorView positions;       // [m] int64, contiguous
  TensorView token_requests;  // [m] int32, contiguous
  IndexerState state;         // read only: block_table, and k_cache's blocks for the bound
  TensorView topk_positions;  // [m, 2176] int32 in, request-local positions; as IndexerSelectArgs' rows
  TensorView slots;           // [m, 2176] int32 out, global KV slots; as topk_positions
  unsigned int* error_count = nullptr;
};

// Step 9, prefill: the tokens at positions 0..n-1 of one request (LayerNorm,
// every complete pool compressed into k_cache, the last min(n, RING) tokens
// stashed in the ring), so that decode continues at position n. Gives the
// same k_cache and ring bytes as prepare run token by token.
struct IndexerPrefillArgs {
  IndexerPlan plan;
  TensorView index_k;        // [n, 128] BF16, as in prepare; n >= 1
  TensorView gate;           // [n, 128] BF16
  TensorView k_norm_weight;  // [128] FP32
  TensorView k_norm_bias;    // [128] FP32
  TensorView ape;            // [4, 128] FP32
  int request = 0;           // row of block_table and ring
  IndexerState state;        // ring and k_cache are written
  unsigned int* error_count = nullptr;
};

// Argument checks (dtypes, shapes, strides, alignment, the plan, host-side
// ranges); launch nothing. Errors name the argument, what was expected and
// what was given. Device-side values (positions, block table) cannot be
// checked here: see "Untrusted device values" above.
Status check_indexer_prepare(const IndexerPrepareArgs& args);
Status check_indexer_select(const IndexerSelectArgs& args);
Status check_indexer_prefill(const IndexerPrefillArgs& args);
Status check_indexer_remap(const IndexerRemapArgs& args);
Status check_indexer_project(const IndexerProjectArgs& args);

// Host copies of a step's token-to-request map, checked against the
// contract's rules for trusted callers (the CPU reference, the main job):
// real tokens (request >= 0) have request < requests, 0 <= position <
// min(max_context, width * block_size), and per request increasing
// consecutive positions, at most RING - 3 of them. Errors name the token.
Status check_indexer_batch(const IndexerPlan& plan, int m, const int64_t* positions, const int32_t* token_requests,
                           int64_t requests, int64_t block_table_width);

// The projections on the GPU (src/indexer/indexer_project.cpp): four
// cublasLtMatmul calls, BF16 inputs, FP32 compute and scale
// (CUBLAS_COMPUTE_32F), each output written once from its FP32 sum (index_q,
// index_k and gate rounded to BF16 to nearest even, head_weights stored as
// FP32). The sums are cuBLASLt's: FP32 accumulation in an order it does not
// specify (tensor-core blocks, maybe split over k), so the outputs match a
// float64 reference within a tolerance, not bit for bit. The tests' bound
// (src/indexer/indexer_reference.h says why): head_weights within 1e-5 *
// sum_i |in[t, i] * weight[j, i]| of the exact sum; a BF16 output within one
// BF16 ulp of the exact sum rounded to BF16, plus that term.
// The same shape on the same device and library version gives the same bits
// on every call (the algorithm is chosen once per shape and the workspace is
// the context's own); a token's outputs may change with m (each m may get
// another algorithm). No allocation, no synchronization, CUDA-graph
// capturable once the shape has had a call outside the capture (the first
// call of a shape builds its descriptors and asks the heuristic: host work
// only, kept out of the capture as the other steps' first calls are). No PDL
// attribute is set on cuBLASLt's launches, so the kernel after this call must
// not count on overlapping it; launched with PDL, it must still wait
// (griddepcontrol.wait) before reading the outputs, as indexer_prepare does.
Status indexer_project(const IndexerProjectArgs& args, IndexerProjectContext& context, cudaStream_t stream);

// The same four projections as one CUDA-core GEMV launch
// (src/indexer/indexer_project_gemv.cu): same arguments, contract and checks
// as indexer_project (check_indexer_project), plus Q and D multiples of 8,
// at most 16384 (64 steps of 256 columns) and a shared-memory bound
// (check_indexer_project_gemv); no context. m is
// 1..16: kIndexerMaxTokens, which the plan already bounds (a larger m fails
// check_indexer_project, naming plan.max_tokens or q_c).
//
// Fixed order, bit for bit the CPU reference's
// (reference::indexer_project_gemv): every output
// out[t, j] = sum_i in[t, i] * weight[j, i] is summed by the 32 lanes of one
// warp. Lane l takes columns 8l..8l+7, then 8l+256..8l+263, and so on below
// K (Q for index_q, D for the others), and chains them with fmaf in
// ascending column order from +0 (each BF16 value converted to FP32
// exactly). The 32 lane sums are then added by an xor butterfly over the
// lane distances 1, 2, 4, 8, 16 in that order (s[l] <- s[l] + s[l ^ d]);
// lane 0's final sum is the output: rounded to BF16 to nearest even for
// index_q, index_k and gate, stored as FP32 for head_weights. A token's
// outputs depend only on its own row of q_c or x: the same bits alone or in
// any batch, at any m and row strides, on every call (for finite sums; a
// NaN's payload is not specified).
//
// Error: a product passes at most K / 32 + 4 FP32 roundings on its way to
// the output (132 at K = 4096), each of at most 2^-24 of the sum of
// |products|: under the 1e-5 of indexer_project's tolerance
// (reference::projection_tolerance) for K <= 5200.
//
// One launch with PDL (its weight stream starts before griddepcontrol.wait;
// q_c and x are read after it), no allocation, no synchronization, CUDA-graph
// capturable: the kernel has one instantiation per m rounded up to a power of
// two (1, 2, 4, 8, 16), and the first call of each on a device raises its
// shared-memory limit, so capture only after an uncaptured call at the same
// m rounded up to a power of two on that device.
Status check_indexer_project_gemv(const IndexerProjectArgs& args);
Status indexer_project_gemv(const IndexerProjectArgs& args, cudaStream_t stream);

// Steps 1-4 on the GPU (src/indexer/indexer_prepare.cu), one PDL launch:
// one warp per 128-value row of the step (each token's 32 q heads: Hadamard,
// FP8 quant and folded weight into the workspace, for padding tokens too;
// each token's k: LayerNorm, then k and gate stashed in the ring) and one
// warp per token, which compresses its pool into the K cache when pos % 4 ==
// 3, taking the k and gate of the step's own tokens from their inputs and
// the earlier ones from the ring. Under the ring rule this gives the
// token-by-token order's result. The error counter
// gets one count per untrusted token and one per pool whose page is
// untrusted. No allocation, no synchronization, CUDA-graph capturable. Ring,
// K cache, q_fp8 and folded weights equal indexer_prepare of the CPU
// reference bit for bit.
Status indexer_prepare(const IndexerPrepareArgs& args, cudaStream_t stream);

// Steps 5-8 on the GPU (src/indexer/indexer_select.cu): a logits kernel (one
// CTA per token and 64 pools, exact per-head dots, or FP32-accumulated ones
// under plan.logits, then the reference's FP32 order) writing the
// workspace's logits, then one CTA per token that finds the
// 512th key by a 3-digit radix select, compacts the chosen pools in pool-index
// order and writes the expanded, remapped rows (tail, -1 padding). Two PDL
// launches; no allocation, no synchronization, CUDA-graph capturable (the
// first call on a device raises the select kernel's shared-memory limit: make
// it outside a capture). Rows equal indexer_select of the CPU reference bit
// for bit (under kFp32Accumulation: its selection over the GPU's logits, step 6).
Status indexer_select(const IndexerSelectArgs& args, cudaStream_t stream);

// Step 8 on the GPU for caller rows (IndexerRemapArgs): one PDL launch, one
// CTA per token; every input is read after griddepcontrol.wait. Slots equal
// reference::indexer_remap bit for bit. No allocation, no synchronization,
// CUDA-graph capturable.
Status indexer_remap(const IndexerRemapArgs& args, cudaStream_t stream);

// The benchmark's straightforward baseline of the same step, same rows: the
// same logits kernel, a key kernel, cub::DeviceSegmentedRadixSort (pairs,
// descending, one segment per token), then separate expand and remap kernels.
// It needs topk_positions (the remap reads it) and a second caller-owned
// workspace of indexer_select_baseline_workspace_bytes(plan) bytes, 256-byte
// aligned (asks CUB for its temporary storage: needs the CUDA device).
Status indexer_select_baseline_workspace_bytes(const IndexerPlan& plan, int64_t* bytes);
Status indexer_select_baseline(const IndexerSelectArgs& args, void* baseline_workspace, int64_t baseline_workspace_bytes,
                               cudaStream_t stream);

// Step 9 on the GPU (src/indexer/indexer_prepare.cu), one PDL launch: one
// warp per complete pool (LayerNorm of its 4 tokens from index_k, then the
// compression into the K cache) and one warp per token of the last
// min(n, RING) (LayerNorm, stashed in the ring with its gate). The error
// counter gets one count per pool whose page is untrusted. No allocation, no
// synchronization, CUDA-graph capturable. K cache and ring bytes equal
// indexer_prefill of the CPU reference bit for bit.
Status indexer_prefill(const IndexerPrefillArgs& args, cudaStream_t stream);

}  // namespace dsa
