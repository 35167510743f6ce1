// The GPU prepare and prefill (indexer_prepare, indexer_prefill) against the
// CPU reference: both start from the same random state (ring rows and K cache
// bytes left by "earlier steps"), then every byte of the ring and the K cache
// (written or not, page and request padding included), the workspace (q_fp8,
// folded weights, the rest still poisoned), guard bands around the written
// buffers and the error count are compared bit for bit.
// GPU tests: IndexerPrepareGpu.*; argument checks without a GPU: IndexerPrepareChecks.*.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "indexer/indexer_reference.h"
#include "indexer/indexer_test_state.h"
#include "support.h"

namespace dsa {
namespace {

using testing::DeviceBuffer;
using testing::pad_rows;
using testing::normal_floats;
using HostState = testing::IndexerHostState;
constexpr int kDim = kIndexerDim;
constexpr int kHeads = kIndexerHeads;
constexpr uint8_t kPoison = 0xAB;          // workspace bytes before a run
constexpr uint8_t kGuardByte = 0x5C;       // guard bands around the written buffers
constexpr uint16_t kBf16Padding = 0x7FC1;  // BF16 NaN in row and request padding
constexpr int32_t kTablePadding = -77;     // block table padding: reading it would skip a pool and count

template <class T>
std::vector<uint8_t> bytes_of(const std::vector<T>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(T));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// Equal bytes, or one failure naming how many differ and the first.
void expect_same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& expected, const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  size_t differing = 0, first = 0;
  for (size_t i = got.size(); i-- > 0;) {
    if (got[i] == expected[i]) continue;
    ++differing;
    first = i;
  }
  EXPECT_EQ(differing, 0u) << what << ": first difference at byte " << first << " (got " << int(got[first])
                           << ", expected " << int(expected[first]) << ")";
}

// Device bytes between two guard bands of kGuardByte.
class GuardedBytes {
 public:
  static constexpr size_t kGuard = 4096;  // a multiple of 256: data() keeps the allocation's alignment

  explicit GuardedBytes(size_t bytes) : bytes_(bytes), buffer_(bytes + 2 * kGuard) {}
  uint8_t* data() const { return buffer_.get() + kGuard; }
  // The guard bands poisoned, the body set to `body` [bytes].
  void upload(const std::vector<uint8_t>& body) {
    std::vector<uint8_t> all(bytes_ + 2 * kGuard, kGuardByte);
    std::copy(body.begin(), body.end(), all.begin() + kGuard);
    buffer_.upload(all);
  }
  std::vector<uint8_t> download() const {
    const std::vector<uint8_t> all = buffer_.download();
    return std::vector<uint8_t>(all.begin() + kGuard, all.end() - kGuard);
  }
  bool guards_intact() const {
    const std::vector<uint8_t> all = buffer_.download();
    const auto untouched = [](uint8_t b) { return b == kGuardByte; };
    return std::all_of(all.begin(), all.begin() + kGuard, untouched) &&
           std::all_of(all.end() - kGuard, all.end(), untouched);
  }

 private:
  size_t bytes_;
  DeviceBuffer<uint8_t> buffer_;
};

// Strides of the device views beyond the tight ones, in elements: index_q's,
// index_k's and gate's, head_weights' token strides, the ring's and the block
// table's request strides.
struct Padding {
  int64_t q_token = 0, row_token = 0, weights_token = 0, ring_request = 0, table_request = 0;
};
constexpr Padding kTight{};
constexpr Padding kPadded{8, 24, 4, 8, 3};

// What earlier steps left: random BF16 rows in the ring, random bytes in
// every K cache byte (pages, page padding, spare blocks).
void fill_random(HostState& host, std::mt19937_64& rng) {
  const std::vector<uint16_t> ring = testing::random_bf16(host.ring.size(), 1.0f, rng);
  std::copy(ring.begin(), ring.end(), host.ring.begin());  // in place: host.view points into the vectors
  for (uint8_t& b : host.k_cache) b = static_cast<uint8_t>(rng());
}

// A host state's block table, ring and K cache on the device; the ring and
// the K cache between guard bands.
struct DeviceState {
  int64_t ring_row, ring_stride, table_stride;  // ring_row: 2 * RING * 128 elements per request
  DeviceBuffer<int32_t> block_table;
  GuardedBytes ring, k_cache;
  IndexerState view;

  DeviceState(const HostState& host, const Padding& padding)
      : ring_row(2 * host.plan.ring * kDim),
        ring_stride(ring_row + padding.ring_request),
        table_stride(host.width + padding.table_request),
        block_table(pad_rows(host.block_table, host.width, table_stride, kTablePadding)),
        ring(host.requests * ring_stride * sizeof(uint16_t)),
        k_cache(host.k_cache.size()) {
    ring.upload(bytes_of(pad_rows(host.ring, ring_row, ring_stride, kBf16Padding)));
    k_cache.upload(host.k_cache);
    view.block_table = make_strided(block_table.get(), DType::kI32, {host.requests, host.width}, {table_stride, 1});
    view.ring = make_strided(ring.data(), DType::kBF16, {host.requests, 2, host.plan.ring, kDim},
                             {ring_stride, host.plan.ring * kDim, kDim, 1});
    view.k_cache = make_strided(k_cache.data(), DType::kU8,
                                {host.blocks, host.plan.block_size / 4 * kIndexerPoolBytes}, {host.page_stride, 1});
  }

  // Ring and K cache bytes equal the host state's, padding untouched, guard bands intact.
  void expect_equals(const HostState& host, const std::string& what) const {
    expect_same_bytes(ring.download(), bytes_of(pad_rows(host.ring, ring_row, ring_stride, kBf16Padding)),
                      what + " ring");
    expect_same_bytes(k_cache.download(), host.k_cache, what + " k_cache");
    EXPECT_TRUE(ring.guards_intact()) << what << " ring guard bands";
    EXPECT_TRUE(k_cache.guards_intact()) << what << " k_cache guard bands";
  }
};

struct LayerParams {
  std::vector<float> weight, bias, ape;  // [128], [128], [4, 128]
  DeviceBuffer<float> device_weight, device_bias, device_ape;

  explicit LayerParams(std::mt19937_64& rng)
      : weight(normal_floats(kDim, 1.0f, 0.2f, rng)),
        bias(normal_floats(kDim, 0.0f, 0.1f, rng)),
        ape(normal_floats(4 * kDim, 0.0f, 0.5f, rng)),
        device_weight(weight),
        device_bias(bias),
        device_ape(ape) {}
  reference::IndexerParamsHost host() const { return {weight.data(), bias.data(), ape.data()}; }
  TensorView weight_view() const { return make_tensor(device_weight.get(), DType::kF32, {kDim}); }
  TensorView bias_view() const { return make_tensor(device_bias.get(), DType::kF32, {kDim}); }
  TensorView ape_view() const { return make_tensor(device_ape.get(), DType::kF32, {4, kDim}); }
};

// One step's projections and token map on the host, tight.
struct StepInputs {
  int m = 0;
  std::vector<uint16_t> index_q, index_k, gate;  // [m, 32, 128], [m, 128], [m, 128]
  std::vector<float> head_weights;               // [m, 32]
  std::vector<int64_t> positions;                // [m]
  std::vector<int32_t> token_requests;           // [m]
};

StepInputs random_step(const std::vector<int64_t>& positions, const std::vector<int32_t>& token_requests,
                       std::mt19937_64& rng) {
  StepInputs s;
  s.m = static_cast<int>(positions.size());
  s.index_q = testing::random_bf16(size_t(s.m) * kHeads * kDim, 1.0f, rng);
  s.index_k = testing::random_bf16(size_t(s.m) * kDim, 1.0f, rng);
  s.gate = testing::random_bf16(size_t(s.m) * kDim, 2.0f, rng);
  s.head_weights = normal_floats(size_t(s.m) * kHeads, 0.0f, 1.0f, rng);
  s.positions = positions;
  s.token_requests = token_requests;
  return s;
}

// A step's inputs on the device with padded token strides.
struct DeviceStepInputs {
  int m;
  int64_t q_stride, row_stride, weights_stride;
  DeviceBuffer<uint16_t> index_q, index_k, gate;
  DeviceBuffer<float> head_weights;
  DeviceBuffer<int64_t> positions;
  DeviceBuffer<int32_t> token_requests;

  DeviceStepInputs(const StepInputs& s, const Padding& padding)
      : m(s.m),
        q_stride(kHeads * kDim + padding.q_token),
        row_stride(kDim + padding.row_token),
        weights_stride(kHeads + padding.weights_token),
        index_q(pad_rows(s.index_q, kHeads * kDim, q_stride, kBf16Padding)),
        index_k(pad_rows(s.index_k, kDim, row_stride, kBf16Padding)),
        gate(pad_rows(s.gate, kDim, row_stride, kBf16Padding)),
        head_weights(pad_rows(s.head_weights, kHeads, weights_stride, std::numeric_limits<float>::quiet_NaN())),
        positions(s.positions),
        token_requests(s.token_requests) {}

  void set_views(IndexerPrepareArgs* a) const {
    a->index_q = make_strided(index_q.get(), DType::kBF16, {m, kHeads, kDim}, {q_stride, kDim, 1});
    a->index_k = make_strided(index_k.get(), DType::kBF16, {m, kDim}, {row_stride, 1});
    a->gate = make_strided(gate.get(), DType::kBF16, {m, kDim}, {row_stride, 1});
    a->head_weights = make_strided(head_weights.get(), DType::kF32, {m, kHeads}, {weights_stride, 1});
    a->positions = make_tensor(positions.get(), DType::kI64, {m});
    a->token_requests = make_tensor(token_requests.get(), DType::kI32, {m});
  }
};

// The workspace as prepare leaves it: poison, but q_fp8 and the folded weights
// of the step's tokens.
std::vector<uint8_t> expected_workspace(const IndexerPlan& plan, const reference::IndexerQueryHost& query) {
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(plan);
  std::vector<uint8_t> bytes(layout.bytes, kPoison);
  std::copy(query.q_fp8.begin(), query.q_fp8.end(), bytes.begin() + layout.q_fp8);
  const std::vector<uint8_t> weights = bytes_of(query.head_weights);
  std::copy(weights.begin(), weights.end(), bytes.begin() + layout.head_weights);
  return bytes;
}

// Tokens the contract calls untrusted (request >= requests, position outside
// [0, min(max_context, width * block_size))) become padding for the reference,
// which rejects them; returns how many there were.
int64_t untrusted_to_padding(const IndexerPlan& plan, int64_t requests, int64_t width,
                             const std::vector<int64_t>& positions, std::vector<int32_t>* token_requests) {
  const int64_t limit = std::min(plan.max_context, width * plan.block_size);
  int64_t untrusted = 0;
  for (size_t t = 0; t < positions.size(); ++t) {
    const int32_t request = (*token_requests)[t];
    if (request >= 0 && (request >= requests || positions[t] < 0 || positions[t] >= limit)) {
      (*token_requests)[t] = -1;
      ++untrusted;
    }
  }
  return untrusted;
}

cudaStream_t new_stream() {
  cudaStream_t stream = nullptr;
  testing::expect_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return stream;
}

// Waits for the stream and fails the test on any CUDA error.
void finish(cudaStream_t stream, const char* what) {
  testing::expect_cuda(cudaStreamSynchronize(stream), what);
  testing::expect_cuda(cudaGetLastError(), what);
}

struct BlockOverride {
  int64_t request, page;
  int32_t block;
};

struct PrepareCase {
  IndexerPlan plan;
  int64_t requests = 1, width = 1;
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;  // as the GPU gets them, untrusted ones included
  std::vector<BlockOverride> overrides;  // block table entries changed before the step
  Padding padding;
};

// One GPU prepare step against the reference's from the same state. The
// expected error count: the reference's skipped pool writes plus one per
// untrusted token.
void check_prepare(const PrepareCase& c, const std::string& what) {
  std::mt19937_64 rng(testing::test_seed());
  HostState host(c.plan, c.requests, c.width, rng);
  fill_random(host, rng);
  for (const BlockOverride& o : c.overrides) host.block_table[o.request * c.width + o.page] = o.block;
  const LayerParams params(rng);
  const StepInputs step = random_step(c.positions, c.token_requests, rng);
  std::vector<int32_t> reference_requests = c.token_requests;
  const int64_t untrusted_tokens =
      untrusted_to_padding(c.plan, c.requests, c.width, c.positions, &reference_requests);

  const DeviceState device(host, c.padding);  // before the reference changes the host state
  const DeviceStepInputs inputs(step, c.padding);
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(c.plan);
  GuardedBytes workspace(layout.bytes);
  workspace.upload(std::vector<uint8_t>(layout.bytes, kPoison));
  DeviceBuffer<unsigned int> errors(1);
  errors.fill_bytes(0);  // synchronizes the device: the uploads are complete

  const reference::IndexerStepHost reference_step{step.m, step.index_q.data(), step.index_k.data(),
                                                  step.head_weights.data(), step.gate.data(), step.positions.data(),
                                                  reference_requests.data()};
  reference::IndexerQueryHost query;
  int64_t reference_errors = -1;
  DSA_ASSERT_OK(reference::indexer_prepare(c.plan, reference_step, params.host(), host.view, &query, &reference_errors));

  IndexerPrepareArgs args;
  args.plan = c.plan;
  inputs.set_views(&args);
  args.k_norm_weight = params.weight_view();
  args.k_norm_bias = params.bias_view();
  args.ape = params.ape_view();
  args.state = device.view;
  args.workspace = make_tensor(workspace.data(), DType::kU8, {layout.bytes});
  args.error_count = errors.get();
  cudaStream_t stream = new_stream();
  const Status launched = indexer_prepare(args, stream);
  finish(stream, "indexer_prepare");
  cudaStreamDestroy(stream);
  DSA_ASSERT_OK(launched);

  device.expect_equals(host, what);
  expect_same_bytes(workspace.download(), expected_workspace(c.plan, query), what + " workspace");
  EXPECT_TRUE(workspace.guards_intact()) << what << " workspace guard bands";
  EXPECT_EQ(errors.download()[0], static_cast<unsigned int>(reference_errors + untrusted_tokens))
      << what << ": reference errors " << reference_errors << ", untrusted tokens " << untrusted_tokens;
}

IndexerPlan make_plan(int max_tokens, int64_t max_context, int ring, int block_size) {
  IndexerPlan plan;
  plan.max_tokens = max_tokens;
  plan.max_context = max_context;
  plan.ring = ring;
  plan.block_size = block_size;
  return plan;
}

// m = 1 at 128k: the last position completes a pool from three ring rows.
TEST(IndexerPrepareGpu, OneTokenCompletesAPoolAt128k) {
  DSA_REQUIRE_GPU();
  PrepareCase c;
  c.plan = make_plan(1, 131072, 4, 256);
  c.requests = 1;
  c.width = 512;
  c.positions = {131071};
  c.token_requests = {0};
  check_prepare(c, "m 1 128k");
}

// m = 4, every position modulo 4 (one completes a pool), in a plan of 16
// tokens: the workspace rows of tokens 4..15 stay poisoned.
TEST(IndexerPrepareGpu, FourTokensAtEveryPositionModuloFour) {
  DSA_REQUIRE_GPU();
  PrepareCase c;
  c.plan = make_plan(16, 8192, 4, 128);
  c.requests = 4;
  c.width = 64;
  c.positions = {4000, 4001, 4002, 4003};
  c.token_requests = {2, 0, 3, 1};
  check_prepare(c, "m 4");
}

// m = 16 with padded strides: pools completing and not, padding tokens, the
// last trusted position, untrusted tokens (a request past the table, a
// negative position, positions past the block table and past max_context)
// and untrusted block table entries (past the cache, negative) under pools
// that complete.
TEST(IndexerPrepareGpu, SixteenTokensWithPaddingAndUntrustedValues) {
  DSA_REQUIRE_GPU();
  PrepareCase c;
  c.plan = make_plan(16, 32768, 4, 256);
  c.requests = 12;
  c.width = 100;  // 25600 tokens: positions 25600..32767 are past the table
  const int32_t bad_request = 12, huge_request = 1 << 30;
  c.positions = {3, 25599, 0, 1000, 1001, 1002, 7777, 11, 25600, -1, 40000, 4095, 511, 5, 15, 3};
  c.token_requests = {0, 1, -1, 2, 3, 4, 5, bad_request, 6, 7, 8, 9, 10, -1, 11, huge_request};
  const int32_t blocks = static_cast<int32_t>(c.requests * c.width + 3);
  c.overrides = {{9, 4095 / 256, blocks + 7}, {10, 511 / 256, -3}};
  c.padding = kPadded;
  check_prepare(c, "m 16 padded");
}

// RING 8 with draft tokens: up to 5 tokens of a request in one step,
// interleaved with other requests' tokens; pools complete at every offset
// within the step, reading ring rows of this step and of earlier steps.
TEST(IndexerPrepareGpu, DraftTokensWithRingEight) {
  DSA_REQUIRE_GPU();
  PrepareCase c;
  c.plan = make_plan(16, 32768, 8, 256);
  c.requests = 5;
  c.width = 128;
  // Request 0: 0..4; 1: 4097..4101; 2: 30002..30004; 3: 12347; 4: 8; one padding token.
  c.positions = {0, 4097, 30002, 1, 0, 4098, 12347, 2, 30003, 4099, 3, 8, 30004, 4100, 4, 4101};
  c.token_requests = {0, 1, 2, 0, -1, 1, 3, 0, 2, 1, 0, 4, 2, 1, 0, 1};
  c.padding = kPadded;
  check_prepare(c, "RING 8 drafts");
}

// One request's prefill of n tokens against the reference's; with
// `untrusted_pages`, the request's pages 0 and 2 hold entries past the cache
// and negative: their pools are skipped and counted as the reference does.
void check_prefill(const IndexerPlan& plan, int64_t n, const Padding& padding, bool untrusted_pages,
                   const std::string& what) {
  std::mt19937_64 rng(testing::test_seed());
  const int64_t requests = 3, request = 1, width = (n + plan.block_size - 1) / plan.block_size + 1;
  HostState host(plan, requests, width, rng);
  fill_random(host, rng);
  if (untrusted_pages) {
    host.block_table[request * width + 0] = static_cast<int32_t>(host.blocks + 9);
    if (width > 2) host.block_table[request * width + 2] = -1;
  }
  const LayerParams params(rng);
  const std::vector<uint16_t> index_k = testing::random_bf16(n * kDim, 1.0f, rng);
  const std::vector<uint16_t> gate = testing::random_bf16(n * kDim, 2.0f, rng);
  const int64_t row_stride = kDim + padding.row_token;
  const DeviceState device(host, padding);
  const DeviceBuffer<uint16_t> device_k(pad_rows(index_k, kDim, row_stride, kBf16Padding));
  const DeviceBuffer<uint16_t> device_gate(pad_rows(gate, kDim, row_stride, kBf16Padding));
  DeviceBuffer<unsigned int> errors(1);
  errors.fill_bytes(0);

  int64_t reference_errors = -1;
  DSA_ASSERT_OK(reference::indexer_prefill(plan, index_k.data(), gate.data(), n, request, params.host(), host.view,
                                           &reference_errors));
  if (untrusted_pages) EXPECT_GT(reference_errors, 0) << what;

  IndexerPrefillArgs args;
  args.plan = plan;
  args.index_k = make_strided(device_k.get(), DType::kBF16, {n, kDim}, {row_stride, 1});
  args.gate = make_strided(device_gate.get(), DType::kBF16, {n, kDim}, {row_stride, 1});
  args.k_norm_weight = params.weight_view();
  args.k_norm_bias = params.bias_view();
  args.ape = params.ape_view();
  args.request = static_cast<int>(request);
  args.state = device.view;
  args.error_count = errors.get();
  cudaStream_t stream = new_stream();
  const Status launched = indexer_prefill(args, stream);
  finish(stream, "indexer_prefill");
  cudaStreamDestroy(stream);
  DSA_ASSERT_OK(launched);

  device.expect_equals(host, what);
  EXPECT_EQ(errors.download()[0], static_cast<unsigned int>(reference_errors)) << what;
}

// A long prefill with padded strides and untrusted pages; short ones around
// the ring and pool sizes (n < RING, n = 4, 5, RING, RING + 1, ...).
TEST(IndexerPrepareGpu, PrefillMatchesReference) {
  DSA_REQUIRE_GPU();
  const int64_t long_n = testing::quick_mode() ? 1000 + 3 : 32768 + 7;
  check_prefill(make_plan(16, 65536, 4, 256), long_n, kPadded, true, "prefill n " + std::to_string(long_n));
  for (int ring : {4, 8}) {
    for (int64_t n : {1, 2, 3, 4, 5, 8, 9, 131}) {
      check_prefill(make_plan(16, 4096, ring, 128), n, kTight, false,
                    "prefill RING " + std::to_string(ring) + " n " + std::to_string(n));
      if (HasFailure()) return;
    }
  }
}

// Decode steps on the device (index_k and gate [tokens, 128] of all steps
// back to back; each step's views point at its tokens).
struct DecodeSteps {
  std::vector<int64_t> first;  // per step: its first token
  std::vector<int> m;          // per step: its token count
  std::vector<uint16_t> index_k, gate;
  std::vector<int64_t> positions;
  std::vector<int32_t> token_requests;
};

// Steps that interleave the requests, each taking 1..RING-3 of a request's
// next tokens, plus one padding token per step (as the CPU reference's test).
DecodeSteps interleaved_steps(const IndexerPlan& plan, const std::vector<int64_t>& lengths,
                              const std::vector<std::vector<uint16_t>>& k,
                              const std::vector<std::vector<uint16_t>>& gate, std::mt19937_64& rng) {
  DecodeSteps steps;
  std::vector<int64_t> next(lengths.size(), 0);
  std::uniform_int_distribution<int> take(1, plan.ring - 3);
  for (;;) {
    const int64_t first = static_cast<int64_t>(steps.positions.size());
    for (size_t r = 0; r < lengths.size(); ++r) {
      for (int n = take(rng); n > 0 && next[r] < lengths[r]; --n, ++next[r]) {
        if (int64_t(steps.positions.size()) - first == kIndexerMaxTokens - 1) break;  // room for the padding token
        steps.positions.push_back(next[r]);
        steps.token_requests.push_back(static_cast<int32_t>(r));
        steps.index_k.insert(steps.index_k.end(), &k[r][next[r] * kDim], &k[r][(next[r] + 1) * kDim]);
        steps.gate.insert(steps.gate.end(), &gate[r][next[r] * kDim], &gate[r][(next[r] + 1) * kDim]);
      }
    }
    if (int64_t(steps.positions.size()) == first) break;
    steps.positions.push_back(0);
    steps.token_requests.push_back(-1);
    steps.index_k.resize(steps.positions.size() * kDim, 0x3F80);
    steps.gate.resize(steps.positions.size() * kDim, 0x3F80);
    steps.first.push_back(first);
    steps.m.push_back(static_cast<int>(int64_t(steps.positions.size()) - first));
  }
  return steps;
}

// The contract's promise: prepare run token by token (here several steps of
// several requests, all launched back to back, PDL chaining one step's
// kernels after the previous step's) leaves the K cache and ring bytes of
// prefill; and the GPU prefill equals the reference's.
TEST(IndexerPrepareGpu, DecodeTokenByTokenEqualsPrefill) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const std::vector<int64_t> lengths = testing::quick_mode() ? std::vector<int64_t>{1, 4, 7, 130}
                                                             : std::vector<int64_t>{1, 3, 4, 5, 130, 517, 600};
  for (int ring : {4, 8}) {
    const std::string what = "RING " + std::to_string(ring);
    const IndexerPlan plan = make_plan(16, 4096, ring, 128);
    const int64_t requests = static_cast<int64_t>(lengths.size()), width = 5;
    const LayerParams params(rng);
    std::vector<std::vector<uint16_t>> k(requests), gate(requests);  // [length, 128] per request
    for (int64_t r = 0; r < requests; ++r) {
      k[r] = testing::random_bf16(lengths[r] * kDim, 1.0f, rng);
      gate[r] = testing::random_bf16(lengths[r] * kDim, 2.0f, rng);
    }
    HostState host(plan, requests, width, rng);
    fill_random(host, rng);
    const DeviceState bulk(host, kTight), decode(host, kPadded);
    for (int64_t r = 0; r < requests; ++r) {
      int64_t errors = -1;
      DSA_ASSERT_OK(reference::indexer_prefill(plan, k[r].data(), gate[r].data(), lengths[r], r, params.host(),
                                               host.view, &errors));
      ASSERT_EQ(errors, 0);
    }

    std::vector<DeviceBuffer<uint16_t>> prefill_k, prefill_gate;
    for (int64_t r = 0; r < requests; ++r) {
      prefill_k.emplace_back(k[r]);
      prefill_gate.emplace_back(gate[r]);
    }
    const DecodeSteps steps = interleaved_steps(plan, lengths, k, gate, rng);
    const int64_t row_stride = kDim + kPadded.row_token;
    const DeviceBuffer<uint16_t> step_k(pad_rows(steps.index_k, kDim, row_stride, kBf16Padding));
    const DeviceBuffer<uint16_t> step_gate(pad_rows(steps.gate, kDim, row_stride, kBf16Padding));
    const DeviceBuffer<int64_t> step_positions(steps.positions);
    const DeviceBuffer<int32_t> step_requests(steps.token_requests);
    const DeviceBuffer<uint16_t> index_q(std::vector<uint16_t>(kIndexerMaxTokens * kHeads * kDim, 0));
    const DeviceBuffer<float> head_weights(std::vector<float>(kIndexerMaxTokens * kHeads, 1.0f));
    const DeviceBuffer<uint8_t> workspace(size_t(indexer_workspace_layout(plan).bytes));
    DeviceBuffer<unsigned int> errors(2);  // bulk, decode
    errors.fill_bytes(0);

    cudaStream_t stream = new_stream();
    const auto launch_all = [&]() -> Status {
      for (int64_t r = 0; r < requests; ++r) {
        IndexerPrefillArgs a;
        a.plan = plan;
        a.index_k = make_tensor(prefill_k[r].get(), DType::kBF16, {lengths[r], kDim});
        a.gate = make_tensor(prefill_gate[r].get(), DType::kBF16, {lengths[r], kDim});
        a.k_norm_weight = params.weight_view();
        a.k_norm_bias = params.bias_view();
        a.ape = params.ape_view();
        a.request = static_cast<int>(r);
        a.state = bulk.view;
        a.error_count = errors.get();
        DSA_RETURN_IF_ERROR(indexer_prefill(a, stream));
      }
      for (size_t s = 0; s < steps.first.size(); ++s) {
        const int64_t first = steps.first[s], m = steps.m[s];
        IndexerPrepareArgs a;
        a.plan = plan;
        a.index_q = make_tensor(index_q.get(), DType::kBF16, {m, kHeads, kDim});
        a.index_k = make_strided(step_k.get() + first * row_stride, DType::kBF16, {m, kDim}, {row_stride, 1});
        a.gate = make_strided(step_gate.get() + first * row_stride, DType::kBF16, {m, kDim}, {row_stride, 1});
        a.head_weights = make_tensor(head_weights.get(), DType::kF32, {m, kHeads});
        a.k_norm_weight = params.weight_view();
        a.k_norm_bias = params.bias_view();
        a.ape = params.ape_view();
        a.positions = make_tensor(step_positions.get() + first, DType::kI64, {m});
        a.token_requests = make_tensor(step_requests.get() + first, DType::kI32, {m});
        a.state = decode.view;
        a.workspace = make_tensor(workspace.get(), DType::kU8, {indexer_workspace_layout(plan).bytes});
        a.error_count = errors.get() + 1;
        DSA_RETURN_IF_ERROR(indexer_prepare(a, stream));
      }
      return Status();
    };
    const Status launched = launch_all();
    finish(stream, "prefill and decode steps");
    cudaStreamDestroy(stream);
    DSA_ASSERT_OK(launched);
    bulk.expect_equals(host, what + " GPU prefill vs reference prefill");
    decode.expect_equals(host, what + " GPU decode vs reference prefill");
    EXPECT_EQ(errors.download(), std::vector<unsigned int>({0u, 0u})) << what;
    if (HasFailure()) return;
  }
}

// A prefill and the next decode step (RING 8, drafts) captured in one CUDA
// graph; replays give the reference's bytes (both launches are idempotent:
// a replay rewrites the same ring rows before the pools read them).
TEST(IndexerPrepareGpu, GraphCaptureAndReplay) {
  DSA_REQUIRE_GPU();
  std::mt19937_64 rng(testing::test_seed());
  const IndexerPlan plan = make_plan(16, 8192, 8, 128);
  const int64_t requests = 4, width = 64, prefill_n = 1001, prefill_request = 0;
  HostState host(plan, requests, width, rng);
  fill_random(host, rng);
  const LayerParams params(rng);
  const std::vector<uint16_t> prefill_k = testing::random_bf16(prefill_n * kDim, 1.0f, rng);
  const std::vector<uint16_t> prefill_gate = testing::random_bf16(prefill_n * kDim, 2.0f, rng);
  // Request 0 continues its prefill at 1001..1005 (pool 250 completes at 1003
  // from a prefilled row and three of this step); requests 1 (250..253, pool
  // 62 at 251) and 3 (7, pool 1) are decoding; one padding token.
  const StepInputs step = random_step({1001, 250, 1002, 1003, 7, 1004, 251, 0, 1005, 252, 253},
                                      {0, 1, 0, 0, 3, 0, 1, -1, 0, 1, 1}, rng);
  const DeviceState device(host, kTight);
  const DeviceStepInputs inputs(step, kTight);
  const DeviceBuffer<uint16_t> device_k(prefill_k), device_gate(prefill_gate);
  const IndexerWorkspaceLayout layout = indexer_workspace_layout(plan);
  GuardedBytes workspace(layout.bytes);
  workspace.upload(std::vector<uint8_t>(layout.bytes, kPoison));
  DeviceBuffer<unsigned int> errors(1);
  errors.fill_bytes(0);

  int64_t reference_errors = -1;
  DSA_ASSERT_OK(reference::indexer_prefill(plan, prefill_k.data(), prefill_gate.data(), prefill_n, prefill_request,
                                           params.host(), host.view, &reference_errors));
  ASSERT_EQ(reference_errors, 0);
  const reference::IndexerStepHost reference_step{step.m, step.index_q.data(), step.index_k.data(),
                                                  step.head_weights.data(), step.gate.data(), step.positions.data(),
                                                  step.token_requests.data()};
  reference::IndexerQueryHost query;
  DSA_ASSERT_OK(reference::indexer_prepare(plan, reference_step, params.host(), host.view, &query, &reference_errors));
  ASSERT_EQ(reference_errors, 0);

  IndexerPrefillArgs prefill;
  prefill.plan = plan;
  prefill.index_k = make_tensor(device_k.get(), DType::kBF16, {prefill_n, kDim});
  prefill.gate = make_tensor(device_gate.get(), DType::kBF16, {prefill_n, kDim});
  prefill.k_norm_weight = params.weight_view();
  prefill.k_norm_bias = params.bias_view();
  prefill.ape = params.ape_view();
  prefill.request = static_cast<int>(prefill_request);
  prefill.state = device.view;
  prefill.error_count = errors.get();
  IndexerPrepareArgs prepare;
  prepare.plan = plan;
  inputs.set_views(&prepare);
  prepare.k_norm_weight = params.weight_view();
  prepare.k_norm_bias = params.bias_view();
  prepare.ape = params.ape_view();
  prepare.state = device.view;
  prepare.workspace = make_tensor(workspace.data(), DType::kU8, {layout.bytes});
  prepare.error_count = errors.get();

  cudaStream_t stream = new_stream();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  DSA_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured_prefill = indexer_prefill(prefill, stream);
  const Status captured_prepare = indexer_prepare(prepare, stream);
  DSA_ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  DSA_ASSERT_OK(captured_prefill);
  DSA_ASSERT_OK(captured_prepare);
  DSA_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) DSA_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  finish(stream, "graph replays");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);

  device.expect_equals(host, "graph");
  expect_same_bytes(workspace.download(), expected_workspace(plan, query), "graph workspace");
  EXPECT_TRUE(workspace.guards_intact()) << "graph workspace guard bands";
  EXPECT_EQ(errors.download()[0], 0u);
}

// Without a GPU: the launchers check their arguments before launching.
TEST(IndexerPrepareChecks, LaunchersRejectBadArgumentsBeforeLaunching) {
  const auto fake = [](uintptr_t region) { return reinterpret_cast<void*>(region << 16); };
  IndexerPlan plan;
  plan.max_tokens = 4;
  IndexerState state;
  state.block_table = make_tensor(fake(0x10000), DType::kI32, {4, 512});
  state.ring = make_tensor(fake(0x20000), DType::kBF16, {4, 2, 4, kDim});
  state.k_cache = make_tensor(fake(0x30000), DType::kU8, {1000, 64 * kIndexerPoolBytes});
  const TensorView weight = make_tensor(fake(0x40000), DType::kF32, {kDim});
  const TensorView bias = make_tensor(fake(0x41000), DType::kF32, {kDim});
  const TensorView ape = make_tensor(fake(0x42000), DType::kF32, {4, kDim});

  IndexerPrepareArgs prepare;
  prepare.plan = plan;
  prepare.index_q = make_tensor(fake(0x50000), DType::kBF16, {4, kHeads, kDim});
  prepare.index_k = make_tensor(fake(0x60000), DType::kBF16, {4, kDim});
  prepare.head_weights = make_tensor(fake(0x61000), DType::kF32, {4, kHeads});
  prepare.gate = make_tensor(fake(0x62000), DType::kBF16, {3, kDim});  // wrong m
  prepare.k_norm_weight = weight;
  prepare.k_norm_bias = bias;
  prepare.ape = ape;
  prepare.positions = make_tensor(fake(0x70000), DType::kI64, {4});
  prepare.token_requests = make_tensor(fake(0x71000), DType::kI32, {4});
  prepare.state = state;
  prepare.workspace = make_tensor(fake(0x100000), DType::kU8, {indexer_workspace_layout(plan).bytes});
  const Status prepared = indexer_prepare(prepare, nullptr);
  ASSERT_FALSE(prepared.ok());
  EXPECT_NE(prepared.message().find("'gate'"), std::string::npos) << prepared.message();

  IndexerPrefillArgs prefill;
  prefill.plan = plan;
  prefill.index_k = make_tensor(fake(0x80000), DType::kBF16, {1000, kDim});
  prefill.gate = make_tensor(fake(0x90000), DType::kBF16, {1000, kDim});
  prefill.k_norm_weight = weight;
  prefill.k_norm_bias = bias;
  prefill.ape = ape;
  prefill.request = 4;  // past the block table
  prefill.state = state;
  const Status prefilled = indexer_prefill(prefill, nullptr);
  ASSERT_FALSE(prefilled.ok());
  EXPECT_NE(prefilled.message().find("'request'"), std::string::npos) << prefilled.message();
}

}  // namespace
}  // namespace dsa
