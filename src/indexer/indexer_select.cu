// The indexer's select step on the GPU (include/dsa_decode/indexer.h, steps
// 5-8): logits over the request's complete pools, top-512 pools, expansion to
// token columns plus the tail and -1 padding, remap through the block table.
//
// Fused path (indexer_select), two PDL launches:
//   1. logits_kernel: CTA (chunk, t) scores pools 64 chunk .. 64 chunk + 63 of
//      token t into workspace.logits[t, :]. Each head's dot is exact (FP64 fma
//      of decoded e4m3 values: every partial sum is a multiple of 2^-18 below
//      2^25, exact in double in any order), rounded to FP32 once, then the
//      reference's FP32 order: ReLU, acc = fma(w'[h], relu, acc) for h = 0..31
//      from +0, times the pool's scale. So the logits equal the reference's.
//   2. select_rows_kernel: one CTA per token. Radix select on the order key of
//      the logits (NaN -> -inf, -0 -> +0, order-preserving bits), 4 passes of
//      8 bits, gives the 512th largest key T and how many pools of key T are
//      taken (the lowest-indexed ones); then one pass in pool order with block
//      scans compacts the chosen pools in increasing pool index and writes
//      their 4 positions and slots each; then the tail and the -1 padding.
//
// Baseline (indexer_select_baseline): the same logits kernel, a key kernel,
// cub::DeviceSegmentedRadixSort::SortPairsDescending (stable, so equal keys
// keep the lower pool first), an expand kernel (sorts the 512 chosen pools
// by index through ranks) and a remap kernel.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include <cstdint>
#include <string>

#include "core/launch.cuh"
#include "core/shared_memory.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/numerics.h"

namespace dsa {
namespace {

constexpr int kDim = kIndexerDim;
constexpr int kHeads = kIndexerHeads;

// Logits kernel shape.
constexpr int kLogitPools = 64;      // pools per CTA
constexpr int kLogitThreads = 256;   // 32 pool lanes x 8 head groups of 4 heads
constexpr int kRowStride = kDim + 1; // doubles per shared row: consecutive rows start one 8-byte bank apart

struct LogitsShared {
  double q[kHeads * kRowStride];           // token's q, decoded
  double k[kLogitPools * kRowStride];      // the CTA's pools, decoded (0 where absent)
  float relu[kLogitPools * (kHeads + 1)];  // [pool][head] ReLU(dot) rounded to FP32
  float weight[kHeads];                    // folded head weights w'
  float scale[kLogitPools];
  long long block[kLogitPools];            // page of the pool, -1: untrusted, -2: past n
};

constexpr int kSelectThreads = 1024;

struct Params {
  int m;
  const int64_t* positions;        // [m]
  const int32_t* token_requests;   // [m]
  const int32_t* block_table;      // [requests, width]
  int64_t block_table_stride;
  int64_t block_table_width;
  int64_t requests;
  const uint8_t* k_cache;  // [blocks, page_stride]
  int64_t page_stride;
  int64_t blocks;
  int block_size;
  int pools_per_page;
  int64_t max_context;
  const uint8_t* q_fp8;        // workspace [max_tokens, 32, 128]
  const float* head_weights;   // workspace [max_tokens, 32]
  float* logits;               // workspace [max_tokens, logits_stride]
  int64_t logits_stride;       // ceil(max_context / 4)
  int32_t* topk_positions;     // [m, stride] or null
  int64_t topk_stride;
  int32_t* slots;              // [m, stride]
  int64_t slots_stride;
  unsigned int* error_count;   // optional
  // Baseline only.
  uint32_t* keys_in;
  int32_t* values_in;
  int32_t* values_out;  // sorted pool indices, [m, logits_stride]
  int* segment_begin;   // [m]
  int* segment_end;     // [m]
};

__device__ __forceinline__ void count_error(const Params& p) {
  if (p.error_count != nullptr) atomicAdd(p.error_count, 1u);
}

// Token t's request and context L = pos + 1, or 0 for a padding token and
// for an untrusted one (counted once, by thread 0, when `count` is set).
__device__ int64_t token_context(const Params& p, int t, int64_t* request, bool count) {
  const int32_t r = p.token_requests[t];
  *request = r;
  if (r < 0) return 0;
  const int64_t position = p.positions[t];
  if (r >= p.requests || position < 0 || position >= p.max_context ||
      position >= p.block_table_width * p.block_size) {
    if (count && threadIdx.x == 0) count_error(p);
    return 0;
  }
  return position + 1;
}

// The pools whose logits the step computes for context L: none for L <= 2048.
__device__ __forceinline__ int64_t scored_pools(int64_t context) {
  return context > kIndexerPooledColumns ? context / kIndexerPoolSize : 0;
}

// Global slot of a request-local position; -1 stays -1, an untrusted block
// gives -1 and is counted.
__device__ int32_t slot_of(const Params& p, int64_t request, int32_t position) {
  if (position < 0) return -1;
  const int64_t page = position / p.block_size;
  if (page >= p.block_table_width) {
    count_error(p);
    return -1;
  }
  const int64_t block = p.block_table[request * p.block_table_stride + page];
  if (block < 0 || block >= p.blocks) {
    count_error(p);
    return -1;
  }
  return static_cast<int32_t>(block * p.block_size + position % p.block_size);
}

// The selection's order as unsigned integers: larger logit -> larger key;
// NaN ranks as -inf, -0 as +0.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (x != x) x = -INFINITY;
  x = __fadd_rn(x, 0.0f);  // -0 + 0 = +0
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Row of a token with no logits: padding (context 0) or L <= 2048.
__device__ void write_short_row(const Params& p, int t, int64_t request, int64_t context) {
  for (int c = threadIdx.x; c < kIndexerRowWidth; c += blockDim.x) {
    const int32_t position = c < context ? c : -1;
    if (p.topk_positions != nullptr) p.topk_positions[t * p.topk_stride + c] = position;
    p.slots[t * p.slots_stride + c] = context > 0 ? slot_of(p, request, position) : -1;
  }
}

// Columns [2048, 2176): the tail tokens 4n..L-1, then -1.
__device__ void write_tail(const Params& p, int t, int64_t request, int64_t context) {
  const int64_t tail_start = context / kIndexerPoolSize * kIndexerPoolSize;
  for (int c = kIndexerPooledColumns + threadIdx.x; c < kIndexerRowWidth; c += blockDim.x) {
    const int64_t position = tail_start + (c - kIndexerPooledColumns);
    const int32_t value = position < context ? static_cast<int32_t>(position) : -1;
    if (p.topk_positions != nullptr) p.topk_positions[t * p.topk_stride + c] = value;
    p.slots[t * p.slots_stride + c] = slot_of(p, request, value);
  }
}

// Pool `pool` of the row at output index `index`: columns 4 index .. 4 index + 3.
__device__ void write_pool(const Params& p, int t, int64_t request, int32_t pool, int index) {
  const int32_t first = pool * kIndexerPoolSize;
  const int32_t slot = slot_of(p, request, first);  // a pool never straddles a block
  const int4 positions = make_int4(first, first + 1, first + 2, first + 3);
  const int4 slots = slot < 0 ? make_int4(-1, -1, -1, -1) : make_int4(slot, slot + 1, slot + 2, slot + 3);
  if (p.topk_positions != nullptr) {
    *reinterpret_cast<int4*>(p.topk_positions + t * p.topk_stride + index * kIndexerPoolSize) = positions;
  }
  *reinterpret_cast<int4*>(p.slots + t * p.slots_stride + index * kIndexerPoolSize) = slots;
}

// ---------------------------------------------------------------------------
// Step 6: logits.

__global__ void __launch_bounds__(kLogitThreads) logits_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  LogitsShared& s = *reinterpret_cast<LogitsShared*>(shared_bytes);
  pdl_wait();  // q_fp8, head weights and the K cache come from the prepare step
  pdl_release_dependents();
  const int t = blockIdx.y;
  int64_t request = 0;
  const int64_t n = scored_pools(token_context(p, t, &request, false));
  const int64_t first_pool = int64_t(blockIdx.x) * kLogitPools;
  if (first_pool >= n) return;  // uniform over the CTA

  // Pool pages and scales; q and the weights.
  if (threadIdx.x < kLogitPools) {
    const int i = threadIdx.x;
    const int64_t pool = first_pool + i;
    long long block = -2;
    float scale = 0.0f;
    if (pool < n) {
      const int64_t page = pool / p.pools_per_page;
      block = -1;
      if (page < p.block_table_width) {
        const int64_t b = p.block_table[request * p.block_table_stride + page];
        if (b >= 0 && b < p.blocks) block = b;
      }
      if (block >= 0) {
        const int64_t entry = pool % p.pools_per_page;
        scale = *reinterpret_cast<const float*>(p.k_cache + block * p.page_stride +
                                                int64_t(p.pools_per_page) * kDim + entry * 4);
      }
    }
    s.block[i] = block;
    s.scale[i] = scale;
  }
  if (threadIdx.x < kHeads) s.weight[threadIdx.x] = p.head_weights[t * kHeads + threadIdx.x];
  const uint8_t* q = p.q_fp8 + int64_t(t) * kHeads * kDim;
  for (int i = threadIdx.x; i < kHeads * kDim; i += kLogitThreads) {
    s.q[i / kDim * kRowStride + i % kDim] = num::e4m3_to_float(q[i]);
  }
  __syncthreads();

  // The codes, 4 per load: pool i's 32 words.
  for (int w = threadIdx.x; w < kLogitPools * (kDim / 4); w += kLogitThreads) {
    const int i = w / (kDim / 4), d = w % (kDim / 4) * 4;
    const long long block = s.block[i];
    uint32_t codes = 0;  // absent pools decode to zeros
    if (block >= 0) {
      const int64_t entry = (first_pool + i) % p.pools_per_page;
      codes = *reinterpret_cast<const uint32_t*>(p.k_cache + block * p.page_stride + entry * kDim + d);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s.k[i * kRowStride + d + j] = num::e4m3_to_float(static_cast<uint8_t>(codes >> (8 * j)));
    }
  }
  __syncthreads();

  // Exact dots: thread (lane, group) owns pools lane and lane + 32, heads
  // 4 group .. 4 group + 3.
  {
    const int lane = threadIdx.x % 32, group = threadIdx.x / 32;
    double acc[2][4] = {};
    const double* k0 = &s.k[lane * kRowStride];
    const double* k1 = &s.k[(lane + 32) * kRowStride];
    const double* q0 = &s.q[(4 * group) * kRowStride];
#pragma unroll 4
    for (int d = 0; d < kDim; ++d) {
      const double a0 = k0[d], a1 = k1[d];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const double b = q0[j * kRowStride + d];
        acc[0][j] = fma(a0, b, acc[0][j]);
        acc[1][j] = fma(a1, b, acc[1][j]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // fmaxf(x, 0) as the reference's std::fmax: NaN gives 0; the exact sum is never -0.
      s.relu[lane * (kHeads + 1) + 4 * group + j] = fmaxf(static_cast<float>(acc[0][j]), 0.0f);
      s.relu[(lane + 32) * (kHeads + 1) + 4 * group + j] = fmaxf(static_cast<float>(acc[1][j]), 0.0f);
    }
  }
  __syncthreads();

  if (threadIdx.x < kLogitPools) {
    const int i = threadIdx.x;
    const long long block = s.block[i];
    if (block == -2) return;  // past n
    float logit = -INFINITY;
    if (block >= 0) {
      float sum = 0.0f;
      for (int h = 0; h < kHeads; ++h) sum = __fmaf_rn(s.weight[h], s.relu[i * (kHeads + 1) + h], sum);
      logit = __fmul_rn(sum, s.scale[i]);
    } else {
      count_error(p);
    }
    p.logits[t * p.logits_stride + first_pool + i] = logit;
  }
}

// ---------------------------------------------------------------------------
// Steps 7-8 fused: top-512 by radix select, compaction in pool order,
// expansion and remap.

struct SelectShared {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  typename Scan::TempStorage scan;
  unsigned int histogram[256];
  uint32_t prefix;      // the key bits chosen so far
  int remaining;        // pools still to take among those matching `prefix`
  int taken, equal_seen;  // running totals of the compaction
};

__global__ void __launch_bounds__(kSelectThreads) select_rows_kernel(const __grid_constant__ Params p) {
  __shared__ SelectShared s;
  pdl_wait();  // the logits
  pdl_release_dependents();
  const int t = blockIdx.x;
  int64_t request = 0;
  const int64_t context = token_context(p, t, &request, true);
  const int64_t n = scored_pools(context);
  if (n == 0) {
    write_short_row(p, t, request, context);
    return;
  }
  const float* logits = p.logits + t * p.logits_stride;

  // The 512th largest key T and how many pools of key T to take; with n <= 512
  // every pool is taken (T = 0 <= every key, and all of them).
  if (threadIdx.x == 0) {
    s.prefix = 0;
    s.remaining = n <= kIndexerTopPools ? static_cast<int>(n) : kIndexerTopPools;
  }
  __syncthreads();
  if (n > kIndexerTopPools) {
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += kSelectThreads) s.histogram[b] = 0;
      __syncthreads();
      const uint32_t prefix = s.prefix;
      const uint32_t mask = shift == 24 ? 0u : ~0u << (shift + 8);  // bits above this digit
      for (int64_t pool = threadIdx.x; pool < n; pool += kSelectThreads) {
        const uint32_t key = order_key(logits[pool]);
        if ((key & mask) == prefix) atomicAdd(&s.histogram[(key >> shift) & 0xFFu], 1u);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        // From the top digit down: the digit where the running count reaches `remaining`.
        int above = 0, digit = 0;
        for (digit = 255; digit > 0; --digit) {
          const int count = static_cast<int>(s.histogram[digit]);
          if (above + count >= s.remaining) break;
          above += count;
        }
        s.remaining -= above;
        s.prefix = prefix | (static_cast<uint32_t>(digit) << shift);
      }
      __syncthreads();
    }
  }
  const uint32_t threshold = s.prefix;
  const int take_equal = s.remaining;  // pools of key == threshold to take, lowest index first
  if (threadIdx.x == 0) {
    s.taken = 0;
    s.equal_seen = 0;
  }
  __syncthreads();

  // Compaction in pool order: pool index order is the column order.
  for (int64_t base = 0; base < n; base += kSelectThreads) {
    const int64_t pool = base + threadIdx.x;
    uint32_t key = 0;
    if (pool < n) key = order_key(logits[pool]);
    const int greater = pool < n && key > threshold;
    const int equal = pool < n && key == threshold;
    int equal_before = 0, equal_total = 0;
    SelectShared::Scan(s.scan).ExclusiveSum(equal, equal_before, equal_total);
    __syncthreads();  // scan storage reused
    const int take = greater || (equal && s.equal_seen + equal_before < take_equal);
    int take_before = 0, take_total = 0;
    SelectShared::Scan(s.scan).ExclusiveSum(take, take_before, take_total);
    const int index = s.taken + take_before;
    if (take && index < kIndexerTopPools) write_pool(p, t, request, static_cast<int32_t>(pool), index);
    __syncthreads();  // every thread has read the totals
    if (threadIdx.x == 0) {
      s.taken += take_total;
      s.equal_seen += equal_total;
    }
    __syncthreads();
  }
  // Exactly 512 pools are taken when n >= 512 (min(n, 512) in general; n >= 512 here).
  write_tail(p, t, request, context);
}

// ---------------------------------------------------------------------------
// Baseline kernels.

// Keys, values and segment bounds for the segmented sort: token t's segment is
// [t * stride, t * stride + n).
__global__ void __launch_bounds__(256) baseline_keys_kernel(const __grid_constant__ Params p) {
  pdl_wait();
  pdl_release_dependents();
  const int t = blockIdx.y;
  int64_t request = 0;
  const int64_t n = scored_pools(token_context(p, t, &request, false));
  const int64_t begin = t * p.logits_stride;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.segment_begin[t] = static_cast<int>(begin);
    p.segment_end[t] = static_cast<int>(begin + n);
  }
  for (int64_t pool = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; pool < n; pool += int64_t(gridDim.x) * blockDim.x) {
    p.keys_in[begin + pool] = order_key(p.logits[begin + pool]);
    p.values_in[begin + pool] = static_cast<int32_t>(pool);
  }
}

// Positions from the sorted pools: the first 512 in (key desc, index asc)
// order, placed by their rank in pool index order.
__global__ void __launch_bounds__(kIndexerTopPools) baseline_expand_kernel(const __grid_constant__ Params p) {
  __shared__ int32_t chosen[kIndexerTopPools];
  pdl_wait();
  pdl_release_dependents();
  const int t = blockIdx.x;
  int64_t request = 0;
  const int64_t context = token_context(p, t, &request, true);
  const int64_t n = scored_pools(context);
  int32_t* row = p.topk_positions + t * p.topk_stride;
  if (n == 0) {
    for (int c = threadIdx.x; c < kIndexerRowWidth; c += blockDim.x) row[c] = c < context ? c : -1;
    return;
  }
  const int count = n < kIndexerTopPools ? static_cast<int>(n) : kIndexerTopPools;  // n >= 512 here
  const int i = threadIdx.x;
  if (i < count) chosen[i] = p.values_out[t * p.logits_stride + i];
  __syncthreads();
  if (i < count) {
    const int32_t pool = chosen[i];
    int rank = 0;
    for (int j = 0; j < count; ++j) rank += chosen[j] < pool;
    for (int j = 0; j < kIndexerPoolSize; ++j) row[rank * kIndexerPoolSize + j] = pool * kIndexerPoolSize + j;
  }
  const int64_t tail_start = context / kIndexerPoolSize * kIndexerPoolSize;
  for (int c = kIndexerPooledColumns + threadIdx.x; c < kIndexerRowWidth; c += blockDim.x) {
    const int64_t position = tail_start + (c - kIndexerPooledColumns);
    row[c] = position < context ? static_cast<int32_t>(position) : -1;
  }
}

__global__ void __launch_bounds__(256) baseline_remap_kernel(const __grid_constant__ Params p) {
  pdl_wait();
  pdl_release_dependents();
  const int t = blockIdx.x;
  int64_t request = 0;
  const int64_t context = token_context(p, t, &request, false);
  for (int c = threadIdx.x; c < kIndexerRowWidth; c += blockDim.x) {
    const int32_t position = p.topk_positions[t * p.topk_stride + c];
    p.slots[t * p.slots_stride + c] = context > 0 ? slot_of(p, request, position) : -1;
  }
}

// ---------------------------------------------------------------------------
// Launchers.

Params make_params(const IndexerSelectArgs& a) {
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(a.plan);
  uint8_t* workspace = a.workspace.ptr<uint8_t>();
  Params p = {};
  p.m = static_cast<int>(a.positions.size(0));
  p.positions = a.positions.ptr<const int64_t>();
  p.token_requests = a.token_requests.ptr<const int32_t>();
  p.block_table = a.state.block_table.ptr<const int32_t>();
  p.block_table_stride = a.state.block_table.stride(0);
  p.block_table_width = a.state.block_table.size(1);
  p.requests = a.state.block_table.size(0);
  p.k_cache = a.state.k_cache.ptr<const uint8_t>();
  p.page_stride = a.state.k_cache.stride(0);
  p.blocks = a.state.k_cache.size(0);
  p.block_size = a.plan.block_size;
  p.pools_per_page = a.plan.block_size / kIndexerPoolSize;
  p.max_context = a.plan.max_context;
  p.q_fp8 = workspace + layout.q_fp8;
  p.head_weights = reinterpret_cast<const float*>(workspace + layout.head_weights);
  p.logits = reinterpret_cast<float*>(workspace + layout.logits);
  p.logits_stride = layout.logits_stride;
  p.topk_positions = a.topk_positions.ptr<int32_t>();
  p.topk_stride = a.topk_positions.data != nullptr ? a.topk_positions.stride(0) : 0;
  p.slots = a.slots.ptr<int32_t>();
  p.slots_stride = a.slots.stride(0);
  p.error_count = a.error_count;
  return p;
}

Status launch_logits(const Params& p, cudaStream_t stream) {
  // Over the 48 KiB default.
  DSA_RETURN_IF_ERROR(raise_shared_memory_limit(reinterpret_cast<const void*>(logits_kernel),
                                                static_cast<int>(sizeof(LogitsShared)), "indexer logits"));
  const int64_t chunks = (p.logits_stride + kLogitPools - 1) / kLogitPools;
  return launch_pdl(logits_kernel, dim3(static_cast<unsigned>(chunks), p.m), dim3(kLogitThreads),
                    sizeof(LogitsShared), stream, p);
}

// Baseline workspace: keys in/out, values in/out [max_tokens, stride] each,
// segment begin/end [max_tokens] each, then CUB's temporary storage.
struct BaselineLayout {
  int64_t keys_in, keys_out, values_in, values_out, begin, end, temp, bytes;
  size_t temp_bytes;
};

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

Status baseline_layout(const IndexerPlan& plan, BaselineLayout* layout) {
  DSA_RETURN_IF_ERROR(check_indexer_plan(plan));
  const int64_t items = int64_t(plan.max_tokens) * indexer_workspace_layout(plan).logits_stride;
  const int64_t array = align256(items * 4);
  layout->keys_in = 0;
  layout->keys_out = layout->keys_in + array;
  layout->values_in = layout->keys_out + array;
  layout->values_out = layout->values_in + array;
  layout->begin = layout->values_out + array;
  layout->end = layout->begin + align256(plan.max_tokens * 4);
  layout->temp = layout->end + align256(plan.max_tokens * 4);
  layout->temp_bytes = 0;
  DSA_CUDA_RETURN(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, layout->temp_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(items),
      plan.max_tokens, static_cast<const int*>(nullptr), static_cast<const int*>(nullptr), 0, 32, nullptr));
  layout->bytes = layout->temp + align256(static_cast<int64_t>(layout->temp_bytes));
  return Status();
}

}  // namespace

Status indexer_select(const IndexerSelectArgs& args, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_select(args));
  const Params p = make_params(args);
  DSA_RETURN_IF_ERROR(launch_logits(p, stream));
  return launch_pdl(select_rows_kernel, dim3(p.m), dim3(kSelectThreads), 0, stream, p);
}

Status indexer_select_baseline_workspace_bytes(const IndexerPlan& plan, int64_t* bytes) {
  BaselineLayout layout;
  DSA_RETURN_IF_ERROR(baseline_layout(plan, &layout));
  *bytes = layout.bytes;
  return Status();
}

Status indexer_select_baseline(const IndexerSelectArgs& args, void* baseline_workspace,
                               int64_t baseline_workspace_bytes, cudaStream_t stream) {
  DSA_RETURN_IF_ERROR(check_indexer_select(args));
  if (args.topk_positions.data == nullptr) {
    return invalid_argument("topk_positions", "present (the baseline's remap reads it)", "absent");
  }
  BaselineLayout layout;
  DSA_RETURN_IF_ERROR(baseline_layout(args.plan, &layout));
  const TensorView baseline =
      make_tensor(baseline_workspace, DType::kU8, {std::max<int64_t>(baseline_workspace_bytes, 0)});
  DSA_RETURN_IF_ERROR(check_present(baseline, "baseline_workspace"));
  if (baseline_workspace_bytes < layout.bytes) {
    return invalid_argument("baseline_workspace",
                            "at least indexer_select_baseline_workspace_bytes(plan) = " + std::to_string(layout.bytes) +
                                " bytes",
                            std::to_string(baseline_workspace_bytes) + " bytes");
  }
  DSA_RETURN_IF_ERROR(check_aligned(baseline, "baseline_workspace", 256));
  for (const auto& [other, name] : {std::pair{&args.workspace, "workspace"}, {&args.slots, "slots"},
                                    {&args.topk_positions, "topk_positions"}, {&args.state.k_cache, "k_cache"}}) {
    DSA_RETURN_IF_ERROR(check_no_overlap(baseline, "baseline_workspace", *other, name));
  }
  uint8_t* w = static_cast<uint8_t*>(baseline_workspace);
  Params p = make_params(args);
  p.keys_in = reinterpret_cast<uint32_t*>(w + layout.keys_in);
  p.values_in = reinterpret_cast<int32_t*>(w + layout.values_in);
  p.values_out = reinterpret_cast<int32_t*>(w + layout.values_out);
  p.segment_begin = reinterpret_cast<int*>(w + layout.begin);
  p.segment_end = reinterpret_cast<int*>(w + layout.end);
  DSA_RETURN_IF_ERROR(launch_logits(p, stream));
  const unsigned key_blocks = static_cast<unsigned>((p.logits_stride + 255) / 256);
  DSA_RETURN_IF_ERROR(launch_pdl(baseline_keys_kernel, dim3(key_blocks, p.m), dim3(256), 0, stream, p));
  size_t temp_bytes = layout.temp_bytes;
  DSA_CUDA_RETURN(cub::DeviceSegmentedRadixSort::SortPairsDescending(
      w + layout.temp, temp_bytes, p.keys_in, reinterpret_cast<uint32_t*>(w + layout.keys_out), p.values_in,
      p.values_out, static_cast<int>(int64_t(p.m) * p.logits_stride), p.m, p.segment_begin, p.segment_end, 0, 32,
      stream));
  DSA_RETURN_IF_ERROR(launch_pdl(baseline_expand_kernel, dim3(p.m), dim3(kIndexerTopPools), 0, stream, p));
  return launch_pdl(baseline_remap_kernel, dim3(p.m), dim3(256), 0, stream, p);
}

}  // namespace dsa
