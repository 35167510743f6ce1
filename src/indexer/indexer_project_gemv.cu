// The indexer's projections as one CUDA-core GEMV launch
// (include/dsa_decode/indexer.h, indexer_project_gemv; the order of every
// sum is documented there and reproduced by reference::indexer_project_gemv).
//
// Work split. The output rows of the four weights form one list: wq_b's H * 128
// rows (K = Q, reading q_c; 4096 at H = 32), then the 256 + H rows of wk,
// weights_proj and compress_gate (K = D, reading x). A warp owns one item: 4 consecutive rows
// of wq_b (a "q item": each q_c load feeds 4 rows) or 1 row of the other
// three (an "x item": at K = D = 4096 one row costs about what 4 rows of wq_b
// at K = 1536 do, so the items are even). A CTA of W warps owns W items of
// one kind and keeps only that kind's input in shared memory; W is chosen so
// that the grid is one CTA per SM (glm5next on 132 SMs: W = 10, 103 q CTAs and
// 29 x CTAs).
//
// Weights: each lane copies exactly the 16-byte pieces it will read itself
// (cp.async, one commit group per 256-column step, at most kMaxSteps = 64)
// into its warp's slab, before griddepcontrol.wait, so the whole weight
// stream (14.9 MB at glm5next) is requested at once and overlaps the
// previous kernel under PDL; no barrier orders the slab, as a thread sees
// its own async copies after cp.async.wait_group. Direct ld.global.nc would
// have to hold the same bytes in registers (96 registers per lane for a q
// item's 12 KB at Q = 1536) to keep as many loads in flight, which the
// accumulators leave no room for.
//
// Inputs: after the wait, the CTA copies rows 0..m-1 of q_c or x into shared
// memory as BF16 (rows m..T-1 zero, T = m rounded up to a power of two). BF16,
// not FP32: x as FP32 would take 256 KiB at m = 16; each use converts 8
// values with 8 integer operations, shared by the item's rows.
//
// Budgets, glm5next (Q = 1536, D = 4096), W = 10:
//   shared memory: q CTA (T * Q + 4 * W * Q) * 2 bytes = 168 KiB at T = 16;
//                  x CTA (T * D + W * D) * 2 bytes = 208 KiB at T = 16
//                  (the launch takes the larger; at most 227 KiB, 1 CTA/SM)
//   registers: a q lane holds 4 * T accumulators (64 at T = 16), 32 weights
//              and 8 inputs in FP32; __launch_bounds__(384, 1) allows 168.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/async_copy.cuh"
#include "core/bf16.cuh"
#include "core/launch.cuh"
#include "core/shared_memory.h"
#include "core/tensor_rows.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"
#include "indexer/indexer_project_gate.h"

namespace dsa {
namespace {

constexpr int kLanes = 32;
constexpr int kLaneColumns = 8;                      // one 16-byte load of BF16 per lane and step
constexpr int kStepColumns = kLanes * kLaneColumns;  // 256 columns per warp step
constexpr int kQRowsPerItem = 4;
// Items of a plan's head count H: H * 128 / 4 rows of wq_b in fours, then
// 128 + H + 128 rows of wk, weights_proj and compress_gate.
int q_items(int heads) { return heads * kIndexerDim / kQRowsPerItem; }
int x_items(int heads) { return kIndexerDim + heads + kIndexerDim; }
constexpr int kMaxWarps = 12;  // 384 threads: 168 registers per thread at one CTA per SM
constexpr size_t kMaxSharedBytes = 227 * 1024;
// 16-byte input loads in flight per thread while staging q_c or x (the
// accumulators are not live yet): x at m = 16 is 128 KiB, under two rounds
// of L2 latency for 320 threads.
constexpr int kStageBatch = 16;
constexpr int kMaxTokens = 16;
// At most 64 steps of 256 columns (Q, D <= 16384): each step is one cp.async
// commit group, all committed before the first wait, so this bounds a
// thread's outstanding groups.
constexpr int kMaxSteps = 64;
constexpr int64_t kMaxColumns = int64_t(kMaxSteps) * kStepColumns;
static_assert(kIndexerMaxTokens <= kMaxTokens, "tokens_for covers every m the plan allows");

struct GemvParams {
  const uint16_t* q_c;  // [m, Q] BF16 bits
  int64_t q_c_stride;
  const uint16_t* x;  // [m, D] BF16 bits
  int64_t x_stride;
  const uint16_t* wq_b;  // [H * 128, Q] BF16 bits
  int64_t wq_b_stride;
  const uint16_t* wk;  // [128, D] BF16 bits
  int64_t wk_stride;
  const uint16_t* weights_proj;  // [H, D] BF16 bits
  int64_t weights_proj_stride;
  const uint16_t* compress_gate;  // [128, D] BF16 bits
  int64_t compress_gate_stride;
  uint16_t* index_q;  // [m, H * 128] BF16 bits (the [m, H, 128] view's dims 1-2)
  int64_t index_q_stride;
  uint16_t* index_k;  // [m, 128] BF16 bits
  int64_t index_k_stride;
  float* head_weights;  // [m, H] FP32
  int64_t head_weights_stride;
  uint16_t* gate;  // [m, 128] BF16 bits
  int64_t gate_stride;
  int m, q_lora, hidden;
  int heads;   // H
  int q_items, x_items;
  int warps;   // warps of a CTA, one item each
  int q_ctas;  // CTAs [0, q_ctas) take the q items, the others the x items
};

// What one warp sums: kRows weight rows (row r at weight + r * weight_stride)
// into the outputs (row r, token t) at out + t * out_stride + r, FP32 or BF16.
struct Item {
  const uint16_t* weight;
  int64_t weight_stride;
  void* out;
  int64_t out_stride;
  bool fp32_out;
};

__device__ Item q_item(const GemvParams& p, int item) {
  const int row = item * kQRowsPerItem;
  return {p.wq_b + row * p.wq_b_stride, p.wq_b_stride, p.index_q + row, p.index_q_stride, false};
}

__device__ Item x_item(const GemvParams& p, int row) {
  if (row < kIndexerDim) return {p.wk + row * p.wk_stride, p.wk_stride, p.index_k + row, p.index_k_stride, false};
  row -= kIndexerDim;
  if (row < p.heads) {
    return {p.weights_proj + row * p.weights_proj_stride, p.weights_proj_stride, p.head_weights + row,
            p.head_weights_stride, true};
  }
  row -= p.heads;
  return {p.compress_gate + row * p.compress_gate_stride, p.compress_gate_stride, p.gate + row, p.gate_stride, false};
}

// Lane l's part of kRows rows: columns l * 8 + 256 s (s = 0, 1, ...) below
// `columns`, into its warp's slab [kRows][columns]; one commit group per step
// s, so that step s can be used once its group has landed.
template <int kRows>
__device__ void copy_weight_rows(const Item& item, int columns, uint16_t* slab, int lane) {
  const int steps = (columns + kStepColumns - 1) / kStepColumns;
  for (int s = 0; s < steps; ++s) {
    const int column = s * kStepColumns + lane * kLaneColumns;
    if (column < columns) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        async_copy_16(shared_address(slab + r * columns + column), item.weight + r * item.weight_stride + column);
      }
    }
    async_copy_commit();
  }
}

// Rows 0..m-1 of `input` ([m, columns] BF16 at a row stride of `stride`) into
// `staged` [kTokens][columns], rows m.. zero. L2 loads (ld.global.cg): the
// previous kernel of the step wrote q_c and x, and each CTA reads them once.
template <int kTokens>
__device__ void stage_input(const uint16_t* input, int64_t stride, int columns, int m, uint16_t* staged) {
  const int row_vectors = columns / kLaneColumns;
  const int vectors = kTokens * row_vectors;
  for (int first = threadIdx.x; first < vectors; first += kStageBatch * blockDim.x) {
    uint4 v[kStageBatch];
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int e = first + b * blockDim.x;
      const int t = e / row_vectors;
      v[b] = make_uint4(0, 0, 0, 0);
      if (e < vectors && t < m) {
        v[b] = __ldcg(reinterpret_cast<const uint4*>(input + t * stride + (e % row_vectors) * kLaneColumns));
      }
    }
#pragma unroll
    for (int b = 0; b < kStageBatch; ++b) {
      const int e = first + b * blockDim.x;
      if (e < vectors) reinterpret_cast<uint4*>(staged)[e] = v[b];
    }
  }
}

// The xor butterfly over lane distances 1, 2, 4, 8, 16 for kValues sums per
// lane at once, by recursive halving: at distance d a lane keeps one value of
// each pair (2i, 2i + 1), the odd one when its bit d is set, and adds the
// partner lane's copy of it, so each shuffle serves two values. Each kept sum
// is s[l] + s[l ^ d] of the full butterfly (the same two operands, and FP32
// addition commutes), so the bits are the butterfly's. After the five
// distances, value i of lane l is the total of original value
// 32 i + l when kValues >= 32; else v[0] is the total of value l % kValues.
template <int kValues, int kCount, int kDistance>
__device__ __forceinline__ void add_across_lanes(float (&v)[kValues], int lane) {
  if constexpr (kDistance < kLanes) {
    if constexpr (kCount >= 2) {
      const bool odd = (lane & kDistance) != 0;
#pragma unroll
      for (int i = 0; i < kCount / 2; ++i) {  // v[i] is written after v[2i] and v[2i + 1] are read
        const float keep = odd ? v[2 * i + 1] : v[2 * i];
        const float give = odd ? v[2 * i] : v[2 * i + 1];
        v[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, give, kDistance);
      }
      add_across_lanes<kValues, kCount / 2, kDistance * 2>(v, lane);
    } else {
      v[0] = v[0] + __shfl_xor_sync(0xFFFFFFFFu, v[0], kDistance);
      add_across_lanes<kValues, 1, kDistance * 2>(v, lane);
    }
  }
}

// Value index = r * kTokens + t, as the accumulators are laid out.
template <int kTokens>
__device__ __forceinline__ void store_value(const Item& item, int value, float sum, int m) {
  const int r = value / kTokens, t = value % kTokens;
  if (t >= m) return;  // a padding token of the last power of two
  const int64_t index = t * item.out_stride + r;
  if (item.fp32_out) {
    static_cast<float*>(item.out)[index] = sum;
  } else {
    static_cast<uint16_t*>(item.out)[index] = num::float_to_bf16(sum);
  }
}

// One warp's item: kRows rows of `columns` against the kTokens staged input
// rows, in the header's order, then the outputs of the m real tokens.
template <int kTokens, int kRows>
__device__ void sum_item(const Item& item, const uint16_t* staged, const uint16_t* slab, int columns, int m, int lane) {
  constexpr int kValues = kRows * kTokens;
  float acc[kValues];  // [row][token]
#pragma unroll
  for (int i = 0; i < kValues; ++i) acc[i] = 0.0f;
  const int steps = (columns + kStepColumns - 1) / kStepColumns;
  for (int s = 0; s < steps; ++s) {
    async_copy_wait(steps - 1 - s);  // step s's group has landed (above 7 pending it waits for more)
    const int column = s * kStepColumns + lane * kLaneColumns;
    if (column >= columns) continue;  // this lane has no columns in the last step
    float w[kRows][kLaneColumns];
#pragma unroll
    for (int r = 0; r < kRows; ++r) unpack_bf16x8(*reinterpret_cast<const uint4*>(slab + r * columns + column), w[r]);
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      float in[kLaneColumns];
      unpack_bf16x8(*reinterpret_cast<const uint4*>(staged + t * columns + column), in);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int i = 0; i < kLaneColumns; ++i) acc[r * kTokens + t] = fmaf(in[i], w[r][i], acc[r * kTokens + t]);
      }
    }
  }
  add_across_lanes<kValues, kValues, 1>(acc, lane);
  if constexpr (kValues >= kLanes) {
#pragma unroll
    for (int i = 0; i < kValues / kLanes; ++i) store_value<kTokens>(item, i * kLanes + lane, acc[i], m);
  } else {
    if (lane < kValues) store_value<kTokens>(item, lane, acc[0], m);
  }
}

// kTokens: m rounded up to a power of two (the accumulators per row).
template <int kTokens>
__global__ void __launch_bounds__(kMaxWarps* kLanes, 1)
    indexer_project_gemv_kernel(const __grid_constant__ GemvParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
  const bool q_part = static_cast<int>(blockIdx.x) < p.q_ctas;
  const int columns = q_part ? p.q_lora : p.hidden;
  const int rows = q_part ? kQRowsPerItem : 1;
  const int index = (q_part ? static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x) - p.q_ctas) * p.warps + warp;
  const bool has_item = index < (q_part ? p.q_items : p.x_items);           // the last CTA of a part may have idle warps
  uint16_t* staged = reinterpret_cast<uint16_t*>(shared);               // [kTokens][columns]
  uint16_t* slab = staged + kTokens * columns + warp * rows * columns;  // this warp's [rows][columns]

  Item item = {};
  if (has_item) {
    item = q_part ? q_item(p, index) : x_item(p, index);
    if (q_part) {
      copy_weight_rows<kQRowsPerItem>(item, columns, slab, lane);
    } else {
      copy_weight_rows<1>(item, columns, slab, lane);
    }
  }

  pdl_wait();
  pdl_release_dependents();

  stage_input<kTokens>(q_part ? p.q_c : p.x, q_part ? p.q_c_stride : p.x_stride, columns, p.m, staged);
  __syncthreads();
  if (!has_item) return;
  if (q_part) {
    sum_item<kTokens, kQRowsPerItem>(item, staged, slab, columns, p.m, lane);
  } else {
    sum_item<kTokens, 1>(item, staged, slab, columns, p.m, lane);
  }
}

using KernelFn = void (*)(GemvParams);

int tokens_for(int64_t m) { return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : m <= 8 ? 8 : kMaxTokens; }

KernelFn kernel_for(int tokens) {
  switch (tokens) {
    case 1:
      return indexer_project_gemv_kernel<1>;
    case 2:
      return indexer_project_gemv_kernel<2>;
    case 4:
      return indexer_project_gemv_kernel<4>;
    case 8:
      return indexer_project_gemv_kernel<8>;
    default:
      return indexer_project_gemv_kernel<kMaxTokens>;
  }
}

// Shared memory of a CTA of `warps` items: the larger of a q CTA (q_c rows and
// 4 wq_b rows per warp) and an x CTA (x rows and 1 weight row per warp).
size_t q_shared_bytes(int tokens, int warps, int64_t q_lora) {
  return size_t(tokens + warps * kQRowsPerItem) * size_t(q_lora) * 2;
}
size_t x_shared_bytes(int tokens, int warps, int64_t hidden) { return size_t(tokens + warps) * size_t(hidden) * 2; }

// The most columns a part can have at `tokens` and `rows_per_warp` with one
// warp per CTA, a multiple of 8.
int64_t max_columns(int tokens, int rows_per_warp) {
  return int64_t(kMaxSharedBytes / (size_t(tokens + rows_per_warp) * 2)) / kLaneColumns * kLaneColumns;
}

// The column limit of a part and its reason: the shared memory at `tokens`,
// or kMaxColumns (kMaxSteps commit groups), whichever is lower.
std::string column_limit(int tokens, int rows_per_warp, int64_t m, int64_t* limit) {
  const int64_t by_shared = max_columns(tokens, rows_per_warp);
  *limit = std::min(by_shared, kMaxColumns);
  if (by_shared < kMaxColumns) {
    return std::to_string(*limit) + " at m = " + std::to_string(m) +
           " (staged in shared memory with one warp's weight rows)";
  }
  return std::to_string(*limit) + " (" + std::to_string(kMaxSteps) + " steps of " + std::to_string(kStepColumns) +
         " columns, one cp.async commit group each)";
}

}  // namespace

Status check_indexer_project_gemv(const IndexerProjectArgs& a) {
  DSA_RETURN_IF_ERROR(check_indexer_project(a));
  const int64_t m = a.q_c.size(0), q_lora = a.q_c.size(1), hidden = a.x.size(1);
  const int tokens = tokens_for(m);
  int64_t q_limit = 0, x_limit = 0;
  const std::string q_reason = column_limit(tokens, kQRowsPerItem, m, &q_limit);
  const std::string x_reason = column_limit(tokens, 1, m, &x_limit);
  if (q_lora % kLaneColumns != 0 || q_lora > q_limit) {
    return invalid_argument("q_c", "a column count Q that is a multiple of 8 and at most " + q_reason,
                            a.q_c.describe());
  }
  if (hidden % kLaneColumns != 0 || hidden > x_limit) {
    return invalid_argument("x", "a column count D that is a multiple of 8 and at most " + x_reason, a.x.describe());
  }
  return Status();
}

Status indexer_project_gemv(const IndexerProjectArgs& a, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_project_gemv(a));
  int device = 0, sms = 0;
  DSA_CUDA_RETURN(cudaGetDevice(&device));
  DSA_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int m = static_cast<int>(a.q_c.size(0));
  const int tokens = tokens_for(m);
  const int64_t q_lora = a.q_c.size(1), hidden = a.x.size(1);
  // As many warps per CTA as make one CTA per SM, within the registers'
  // kMaxWarps and the shared memory (check_indexer_project_gemv made sure one
  // warp fits). The split does not change a single bit: every output is one
  // warp's sum in the header's order wherever that warp runs.
  const int heads = a.plan.heads;
  // Without the gate (pool 1 with an empty compress_gate) the x items stop
  // before compress_gate's rows, which are the last ones (x_item).
  const int x_count = x_items(heads) - (indexer_project_computes_gate(a) ? 0 : kIndexerDim);
  int warps = std::clamp((q_items(heads) + x_count + sms - 1) / std::max(sms, 1), 1, kMaxWarps);
  const auto shared_bytes = [&](int w) {
    return std::max(q_shared_bytes(tokens, w, q_lora), x_shared_bytes(tokens, w, hidden));
  };
  while (warps > 1 && shared_bytes(warps) > kMaxSharedBytes) --warps;

  GemvParams p = {};
  set_rows(p.q_c, p.q_c_stride, a.q_c);
  set_rows(p.x, p.x_stride, a.x);
  set_rows(p.wq_b, p.wq_b_stride, a.wq_b);
  set_rows(p.wk, p.wk_stride, a.wk);
  set_rows(p.weights_proj, p.weights_proj_stride, a.weights_proj);
  set_rows(p.compress_gate, p.compress_gate_stride, a.compress_gate);
  set_rows(p.index_q, p.index_q_stride, a.index_q);  // only used for tokens t >= 1, so any when m == 1
  set_rows(p.index_k, p.index_k_stride, a.index_k);
  set_rows(p.head_weights, p.head_weights_stride, a.head_weights);
  set_rows(p.gate, p.gate_stride, a.gate);
  p.m = m;
  p.q_lora = static_cast<int>(q_lora);
  p.hidden = static_cast<int>(hidden);
  p.heads = heads;
  p.q_items = q_items(heads);
  p.x_items = x_count;
  p.warps = warps;
  p.q_ctas = (p.q_items + warps - 1) / warps;
  const int x_ctas = (p.x_items + warps - 1) / warps;

  const KernelFn kernel = kernel_for(tokens);
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(reinterpret_cast<const void*>(kernel),
                                                static_cast<int>(kMaxSharedBytes), "indexer_project_gemv"));
  return launch_pdl(kernel, dim3(p.q_ctas + x_ctas), dim3(warps * kLanes), shared_bytes(warps), stream, p);
}

}  // namespace dsa
