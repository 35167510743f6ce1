// dsa-serve (tools/serve/, docs/reliability.md). Without a GPU: the block
// allocator, the scheduler's steps over a long churn, the CPU state model
// (through the kernels' references) and its comparison, the fault planner and
// the isolation and victim checks, the options (ServeState.*, ServeModel.*,
// ServeFaults.*, ServeOptions.*). On the GPU (ServeGpu.*): a few hundred
// steps of the simulation on both paths, the default plan and batch_invariant.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dsa_decode/indexer.h"
#include "dsa_decode/sparse_mla.h"
#include "sparse_mla/sparse_mla_reference.h"
#include "support.h"
#include "tools/serve/serve_check.h"
#include "tools/serve/serve_faults.h"
#include "tools/serve/serve_model.h"
#include "tools/serve/serve_options.h"
#include "tools/serve/serve_run.h"
#include "tools/serve/serve_state.h"

namespace dsa::serve {
namespace {

IndexerPlan small_plan() {
  IndexerPlan p;
  p.max_context = 4096;
  p.block_size = 256;
  p.ring = indexer_ring_for(p.pool, 5);
  return p;
}

ServeGeometry small_geometry(const IndexerPlan& p) {
  ServeGeometry g;
  g.blocks = 40;
  g.block_size = p.block_size;
  g.max_context = p.max_context;
  g.rows = 6;
  g.ring = p.ring;
  g.tokens_per_request = indexer_tokens_per_request(p);
  g.max_tokens = 16;
  return g;
}

TEST(ServeState, GeometryChecksNameTheField) {
  ServeGeometry g = small_geometry(small_plan());
  EXPECT_TRUE(check_geometry(g).ok());
  ServeGeometry bad = g;
  bad.max_context = 1000;
  testing::expect_rejected(check_geometry(bad), "max_context", "multiple of block_size");
  bad = g;
  bad.blocks = 0;
  testing::expect_rejected(check_geometry(bad), "blocks", "got 0");
  bad = g;
  bad.tokens_per_request = g.ring + 1;
  testing::expect_rejected(check_geometry(bad), "tokens_per_request", "1..ring");
}

TEST(ServeState, IdPoolReusesTheLastFreedFirstAndRefusesForeignIds) {
  IdPool pool(5);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(3, &a));
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2}));
  std::vector<int32_t> none;
  EXPECT_FALSE(pool.allocate(3, &none));  // all or nothing
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(pool.free_count(), 2);
  ASSERT_TRUE(pool.release({1}).ok());
  std::vector<int32_t> b;
  ASSERT_TRUE(pool.allocate(1, &b));
  EXPECT_EQ(b, std::vector<int32_t>{1});  // the freed block comes back first
  testing::expect_rejected(pool.release({4}), "ids", "id 4");      // never held
  testing::expect_rejected(pool.release({0, 0}), "ids", "id 0 at 1");  // a double release
  testing::expect_rejected(pool.release({-1}), "ids", "out of range");
}

// A long churn: every step's batch obeys the indexer's batch rules, the
// tokens' slots lie in their own request's blocks, entries past m point at
// cached entries, no block is held twice, freed blocks are reused.
TEST(ServeState, SchedulerStepsKeepTheRulesOverALongChurn) {
  const IndexerPlan plan = small_plan();
  const ServeGeometry g = small_geometry(plan);
  Scheduler s(g, 7);
  std::mt19937_64 rng(3);
  std::set<int32_t> ever_freed;
  int64_t reused = 0, padding = 0, extra = 0, multi = 0, steps_with_two_requests = 0;
  for (int step = 0; step < 3000; ++step) {
    for (int index : s.done()) {
      for (int32_t b : s.live()[size_t(index)].blocks) ever_freed.insert(b);
      ASSERT_TRUE(s.finish(index).ok());
    }
    if (s.live().empty() || rng() % 3 == 0) {
      const int index = s.admit(s.draw_prompt(g.max_context - 1));
      if (index >= 0) {
        for (int32_t b : s.live()[size_t(index)].blocks) reused += ever_freed.count(b);
      }
    }
    std::vector<int> starved;
    const StepBatch b = s.build_step(&starved);
    ASSERT_GE(b.m(), 1);
    ASSERT_LE(b.m(), g.max_tokens);
    ASSERT_GE(int(b.slot_mapping.size()), b.m());
    ASSERT_LE(int(b.slot_mapping.size()), b.m() + g.max_extra_slots);
    const Status ok = check_indexer_batch(plan, b.m(), b.positions.data(), b.token_requests.data(), g.rows, g.width());
    ASSERT_TRUE(ok.ok()) << "step " << step << ": " << ok.to_string();
    std::map<int, int> per_request;
    for (int t = 0; t < b.m(); ++t) {
      if (b.owner[size_t(t)] < 0) {
        ++padding;
        EXPECT_EQ(b.token_requests[size_t(t)], -1);
        EXPECT_EQ(b.slot_mapping[size_t(t)], -1);
        continue;
      }
      const ServeRequest& r = s.live()[size_t(b.owner[size_t(t)])];
      ++per_request[r.row];
      EXPECT_EQ(b.token_requests[size_t(t)], r.row);
      EXPECT_GE(b.positions[size_t(t)], r.length);
      EXPECT_LT(b.positions[size_t(t)], r.finish_at);
      const int64_t slot = b.slot_mapping[size_t(t)];
      EXPECT_TRUE(std::count(r.blocks.begin(), r.blocks.end(), int32_t(slot / g.block_size)) == 1);
      EXPECT_EQ(s.table().entries()[size_t(r.row) * size_t(g.width()) + size_t(b.positions[size_t(t)] / g.block_size)],
                int32_t(slot / g.block_size));
    }
    for (const auto& [row, count] : per_request) {
      EXPECT_LE(count, g.tokens_per_request);
      multi += count > 1;
    }
    steps_with_two_requests += per_request.size() > 1;
    for (size_t e = size_t(b.m()); e < b.slot_mapping.size(); ++e) {
      ++extra;
      EXPECT_GE(b.slot_mapping[e], 0);
      EXPECT_LT(b.slot_mapping[e], g.capacity());
    }
    // No block is held by two live requests; the table row is the request's pages then -1.
    std::set<int32_t> held;
    for (const ServeRequest& r : s.live()) {
      for (int32_t blk : r.blocks) EXPECT_TRUE(held.insert(blk).second) << "block " << blk << " held twice";
      const int32_t* row = &s.table().entries()[size_t(r.row) * size_t(g.width())];
      for (int64_t c = 0; c < g.width(); ++c) {
        EXPECT_EQ(row[c], c < int64_t(r.blocks.size()) ? r.blocks[size_t(c)] : -1);
      }
    }
    s.advance(b);
    for (auto it = starved.rbegin(); it != starved.rend(); ++it) ASSERT_TRUE(s.finish(*it).ok());
    if (HasFailure()) return;
  }
  EXPECT_GT(reused, 0) << "no freed block was ever handed to a new request";
  EXPECT_GT(padding, 0);
  EXPECT_GT(extra, 0);
  EXPECT_GT(multi, 0) << "no step held several tokens of one request";
  EXPECT_GT(steps_with_two_requests, 0);
  EXPECT_GT(s.admitted(), 20);
}

TEST(ServeState, PromptsSpanShortAndLong) {
  Scheduler s(small_geometry(small_plan()), 11);
  int64_t zero = 0, short_ = 0, long_ = 0;
  for (int i = 0; i < 2000; ++i) {
    const int64_t p = s.draw_prompt(131071);
    ASSERT_GE(p, 0);
    ASSERT_LE(p, 131071);
    zero += p == 0;
    short_ += p > 0 && p <= 2048;
    long_ += p > 32768;
  }
  EXPECT_GT(zero, 0);
  EXPECT_GT(short_, 200);
  EXPECT_GT(long_, 100);
}

// ---------------------------------------------------------------- the model

std::vector<uint16_t> rows(size_t count, std::mt19937_64& rng) {
  return testing::random_bf16(count, 1.0f, rng);
}

IndexerParams params(const IndexerPlan& plan, std::mt19937_64& rng) {
  IndexerParams p;
  p.k_norm_weight = testing::normal_floats(kIndexerDim, 1, 0.1f, rng);
  p.k_norm_bias = testing::normal_floats(kIndexerDim, 0, 0.1f, rng);
  p.ape = testing::normal_floats(size_t(plan.pool) * kIndexerDim, 0, 0.5f, rng);
  return p;
}

constexpr int64_t kLatent = kSparseMlaLatent;  // the attention's reference reads 512-wide entries

struct ModelFixture {
  IndexerPlan plan = small_plan();
  ServeGeometry g = small_geometry(plan);
  Scheduler sched{g, 5};
  StateModel model;
  std::mt19937_64 rng{9};

  ModelFixture() { EXPECT_TRUE(model.init(g, kLatent, plan, 0.02f, params(plan, rng)).ok()); }

  int admit(int64_t prompt) {
    const int index = sched.admit(prompt);
    EXPECT_GE(index, 0);
    const ServeRequest& r = sched.live()[size_t(index)];
    const std::vector<uint16_t> kv = rows(size_t(prompt) * kLatent, rng), k = rows(size_t(prompt) * kIndexerDim, rng),
                                g = rows(size_t(prompt) * kIndexerDim, rng);
    EXPECT_TRUE(model.prefill(r, sched.table().entries(), kv.data(), k.data(), g.data()).ok());
    return index;
  }

  // One step through the model (the GPU's part played by drawn projections).
  void step() {
    std::vector<int> starved;
    const StepBatch b = sched.build_step(&starved);
    const int m = b.m();
    const std::vector<uint16_t> kv = rows(size_t(m) * kLatent, rng), q = rows(size_t(m) * plan.heads * kIndexerDim, rng),
                                k = rows(size_t(m) * kIndexerDim, rng), gate = rows(size_t(m) * kIndexerDim, rng);
    const std::vector<float> w = testing::normal_floats(size_t(m) * plan.heads, 0, 1, rng);
    EXPECT_EQ(model.cache_write(kv.data(), m, std::vector<int64_t>(b.slot_mapping.begin(), b.slot_mapping.begin() + m)), 0);
    const reference::IndexerStepHost host{m, q.data(), k.data(), w.data(), gate.data(), b.positions.data(),
                                          b.token_requests.data()};
    reference::IndexerQueryHost query;
    int64_t errors = 0;
    EXPECT_TRUE(model.prepare(sched.table().entries(), host, &query, &errors).ok());
    EXPECT_EQ(errors, 0);
    sched.advance(b);
    for (auto it = starved.rbegin(); it != starved.rend(); ++it) finish(*it);
  }

  void finish(int index) {
    model.release(sched.live()[size_t(index)]);
    ASSERT_TRUE(sched.finish(index).ok());
  }
};

TEST(ServeModel, InitNamesWhatDisagreesWithTheGeometry) {
  ModelFixture f;
  StateModel m;
  IndexerPlan other = f.plan;
  other.ring = f.plan.pool;  // a valid plan with another RING than the geometry's
  std::mt19937_64 rng(1);
  testing::expect_rejected(m.init(f.g, kLatent, other, 0.02f, params(other, rng)), "plan", "ring");
  testing::expect_rejected(m.init(f.g, 12, f.plan, 0.02f, params(f.plan, rng)), "latent", "multiple of 8");
  IndexerParams short_ape = params(f.plan, rng);
  short_ape.ape.pop_back();
  testing::expect_rejected(m.init(f.g, kLatent, f.plan, 0.02f, short_ape), "params", "ape");
}

// A copy of the model's state compares equal; a changed byte of a live
// entry, pool or ring row is found; a change in a freed block is not a
// mismatch (stale bytes are allowed to differ; only live state is compared).
TEST(ServeModel, CompareFindsChangedLiveBytesAndIgnoresFreedBlocks) {
  ModelFixture f;
  f.admit(700);
  f.admit(3);
  f.admit(1500);
  for (int i = 0; i < 40; ++i) f.step();
  const int victim = 0;
  const std::vector<int32_t> freed = f.sched.live()[victim].blocks;
  f.finish(victim);
  ASSERT_FALSE(f.sched.live().empty());
  std::vector<uint8_t> kv = f.model.kv(), pages = f.model.pages();
  std::vector<uint16_t> ring = f.model.ring();
  const auto diff = [&] { return f.model.compare(f.sched.live(), f.sched.table().entries(), kv.data(), pages.data(), ring.data()); };
  StateDiff d = diff();
  EXPECT_EQ(d.mismatches(), 0) << d.first;
  EXPECT_GT(d.entries, 700);
  EXPECT_GT(d.pools, 100);
  EXPECT_GT(d.ring_rows, 0);
  // The freed blocks hold poison in the model.
  const size_t block_bytes = size_t(f.g.block_size) * kLatent;
  EXPECT_EQ(f.model.kv()[size_t(freed[0]) * block_bytes], kPoisonByte);
  // Changes under freed blocks: no mismatch.
  kv[size_t(freed[0]) * block_bytes + 5] ^= 1;
  pages[size_t(freed[0]) * size_t(f.model.page_bytes()) + 3] ^= 1;
  EXPECT_EQ(diff().mismatches(), 0);
  // A live entry.
  const ServeRequest& r = f.sched.live().front();
  ASSERT_GT(r.length, 8);
  kv[size_t(r.slot(r.length - 1, f.g.block_size)) * kLatent + 7] ^= 0x10;
  d = diff();
  EXPECT_EQ(d.entry_mismatches, 1);
  EXPECT_NE(d.first.find("position " + std::to_string(r.length - 1)), std::string::npos) << d.first;
  kv = f.model.kv();
  // A live pool's scale.
  const int64_t P = indexer_pools_per_page(f.plan);
  const size_t page = size_t(r.blocks[0]) * size_t(f.model.page_bytes());
  pages[page + size_t(P) * kIndexerDim + 1] ^= 0x40;  // pool 0's scale
  d = diff();
  EXPECT_EQ(d.pool_mismatches, 1);
  EXPECT_NE(d.first.find("indexer pool 0"), std::string::npos) << d.first;
  pages = f.model.pages();
  // A live ring row (the last position's gate).
  const size_t at = size_t(r.row) * size_t(f.model.ring_row_elements()) +
                    (size_t(f.g.ring) + size_t((r.length - 1) % f.g.ring)) * kIndexerDim;
  ring[at + 2] ^= 1;
  d = diff();
  EXPECT_EQ(d.ring_mismatches, 1);
  EXPECT_NE(d.first.find("gate row of position " + std::to_string(r.length - 1)), std::string::npos) << d.first;
}

// check_token on the model's own state: the row the model gives passes, a
// changed slot, a changed latent or a wrong lse fails with the reason.
TEST(ServeModel, TokenCheckPassesTheModelsRowAndFindsChanges) {
  ModelFixture f;
  f.admit(900);
  for (int i = 0; i < 3; ++i) f.step();
  const ServeRequest& r = f.sched.live().front();
  const int row_width = indexer_row_width(f.plan);
  // A caller row of every position (L <= topk): its remap is the slots.
  const int64_t position = r.length - 1;
  std::vector<int32_t> caller(size_t(row_width), -1), slots(size_t(row_width), -1);
  for (int64_t j = 0; j <= position; ++j) {
    caller[size_t(j)] = int32_t(j);
    slots[size_t(j)] = int32_t(r.slot(j, f.g.block_size));
  }
  const int heads = 2;
  std::vector<uint8_t> q(size_t(heads) * kLatent);
  for (auto& c : q) c = uint8_t(f.rng() % 0x70);  // positive, no NaN
  reference::SparseMlaHost a{};
  a.q = q.data();
  a.q_token_stride = heads * kLatent;
  a.q_head_stride = kLatent;
  a.cache = f.model.kv().data();
  a.blocks = f.g.blocks;
  a.block_size = f.g.block_size;
  a.block_stride = int64_t{f.g.block_size} * kLatent;
  a.entry_stride = kLatent;
  a.indices = slots.data();
  a.indices_token_stride = row_width;
  a.m = 1;
  a.heads = heads;
  a.top_k = row_width;
  a.q_scale = a.k_scale = 0.02f;
  a.softmax_scale = 0.125f;
  const reference::SparseMlaResult want = reference::sparse_mla(a);
  TokenCheckInputs in;
  in.position = position;
  in.row = r.row;
  in.caller_positions = caller.data();
  in.gpu_slots = slots.data();
  in.gpu_q_fp8 = q.data();
  in.gpu_latent = want.latent.data();
  in.gpu_lse = want.lse.data();
  in.heads = heads;
  in.first_head = 0;
  in.head_count = heads;
  in.q_scale = in.k_scale = 0.02f;
  in.softmax_scale = 0.125f;
  TokenCheck c = check_token(f.model, f.sched.table().entries(), in);
  EXPECT_TRUE(c.ok) << c.why;
  in.threads = 2;  // a head per thread: the same latent and lse
  c = check_token(f.model, f.sched.table().entries(), in);
  EXPECT_TRUE(c.ok) << c.why;
  EXPECT_EQ(c.latent_error, 0);
  EXPECT_EQ(c.lse_error, 0);
  std::vector<int32_t> other = slots;
  other[5] = other[6];
  in.gpu_slots = other.data();
  c = check_token(f.model, f.sched.table().entries(), in);
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.why.find("slot 5 of the row"), std::string::npos) << c.why;
  in.gpu_slots = slots.data();
  std::vector<uint16_t> latent = want.latent;
  for (size_t i = 0; i < latent.size(); i += 2) latent[i] ^= 0x0040;  // a change far above the bound
  in.gpu_latent = latent.data();
  c = check_token(f.model, f.sched.table().entries(), in);
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.why.find("latent of heads 0..1"), std::string::npos) << c.why;
  in.gpu_latent = want.latent.data();
  std::vector<float> lse = want.lse;
  lse[1] += 0.01f;
  in.gpu_lse = lse.data();
  c = check_token(f.model, f.sched.table().entries(), in);
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.why.find("lse off by"), std::string::npos) << c.why;
}

// The model's prefill in parts of whole blocks on threads writes the bytes of
// one sequential reference prefill and cache write: prompts within one part,
// a last part of exactly RING tokens, parts ending past a block.
TEST(ServeModel, PrefillInPartsEqualsOneSequentialPrefill) {
  const IndexerPlan plan = small_plan();
  const ServeGeometry g = small_geometry(plan);
  ASSERT_EQ(g.ring, 8);
  for (int64_t prompt : {int64_t{3}, int64_t{263}, int64_t{264}, int64_t{300}, int64_t{773}, int64_t{1025}, int64_t{3000}}) {
    SCOPED_TRACE("prompt " + std::to_string(prompt));
    std::mt19937_64 rng{static_cast<uint64_t>(prompt)};
    const IndexerParams p = params(plan, rng);
    StateModel parts, one;
    ASSERT_TRUE(parts.init(g, kLatent, plan, 0.02f, p).ok());
    ASSERT_TRUE(one.init(g, kLatent, plan, 0.02f, p).ok());
    Scheduler sched(g, 1);
    ASSERT_EQ(sched.admit(200), 0);  // another request first: the prompt's blocks do not start at 0
    const int index = sched.admit(prompt);
    ASSERT_EQ(index, 1);
    const ServeRequest& r = sched.live()[size_t(index)];
    const std::vector<uint16_t> kv = rows(size_t(prompt) * kLatent, rng), k = rows(size_t(prompt) * kIndexerDim, rng),
                                gate = rows(size_t(prompt) * kIndexerDim, rng);
    ASSERT_TRUE(parts.prefill(r, sched.table().entries(), kv.data(), k.data(), gate.data(), 4).ok());
    std::vector<int64_t> slots(static_cast<size_t>(prompt));
    for (int64_t i = 0; i < prompt; ++i) slots[size_t(i)] = r.slot(i, g.block_size);
    ASSERT_EQ(one.cache_write(kv.data(), int(prompt), slots), 0);
    reference::IndexerStateHost state = one.view(sched.table().entries());
    int64_t errors = 0;
    ASSERT_TRUE(reference::indexer_prefill(plan, k.data(), gate.data(), prompt, r.row, p.host(), state, &errors).ok());
    EXPECT_EQ(errors, 0);
    EXPECT_TRUE(parts.kv() == one.kv());
    EXPECT_TRUE(parts.pages() == one.pages());
    EXPECT_TRUE(parts.ring() == one.ring());
    EXPECT_GT(std::count(one.ring().begin(), one.ring().end(), uint16_t{0}), 0);  // other rows stay zero
    const StateDiff d = parts.compare(sched.live(), sched.table().entries(), one.kv().data(), one.pages().data(),
                                      one.ring().data());
    EXPECT_EQ(d.mismatches(), 0) << d.first;
    EXPECT_EQ(d.entries, 200 + prompt);  // the first request (not prefilled) compares zeros with zeros
  }
}

// The logits check in parts of pages on threads finds one logit outside its
// bound wherever it lies (a part's pools are numbered from its first page),
// and passes the exact logits; the heads of the attention on threads too.
TEST(ServeModel, TokenCheckOnThreadsFindsOneLogitOutsideItsBound) {
  ModelFixture f;
  f.admit(3000);
  const ServeRequest& r = f.sched.live().front();
  const int64_t position = r.length - 1, context = position + 1, pools = context / f.plan.pool;
  ASSERT_GT(context, f.plan.topk);
  const int heads = f.plan.heads;
  std::vector<uint8_t> q_codes(size_t(heads) * kIndexerDim);
  for (auto& c : q_codes) c = uint8_t(f.rng() % 0x70);
  const std::vector<float> weights = testing::normal_floats(size_t(heads), 0, 1, f.rng);
  reference::IndexerStateHost state = f.model.view(f.sched.table().entries());
  const std::vector<float> exact = reference::indexer_logits(f.plan, state, r.row, pools, q_codes.data(), weights.data());
  const std::vector<uint16_t> q_rows(size_t(heads) * kIndexerDim, 0), k_row(kIndexerDim, 0);
  const std::vector<float> w_row(size_t(heads), 0.0f);
  const int32_t request = r.row;
  const reference::IndexerStepHost step{1, q_rows.data(), k_row.data(), w_row.data(), k_row.data(), &position, &request};
  reference::IndexerQueryHost query;
  query.q_fp8 = q_codes;
  query.head_weights = weights;
  const int attention_heads = 2;
  std::vector<uint8_t> q(size_t(attention_heads) * kLatent);
  for (auto& c : q) c = uint8_t(f.rng() % 0x70);
  for (int64_t bad_pool : {int64_t{-1}, int64_t{3}, pools - 7}) {
    std::vector<float> gpu = exact;
    if (bad_pool >= 0) gpu[size_t(bad_pool)] = 2 * std::fabs(gpu[size_t(bad_pool)]) + 1;
    reference::IndexerRowsHost rows;
    ASSERT_TRUE(reference::indexer_select_on_logits(f.plan, step, {gpu}, state, &rows).ok());
    reference::SparseMlaHost a{};
    a.q = q.data();
    a.q_token_stride = attention_heads * kLatent;
    a.q_head_stride = kLatent;
    a.cache = f.model.kv().data();
    a.blocks = f.g.blocks;
    a.block_size = f.g.block_size;
    a.block_stride = int64_t{f.g.block_size} * kLatent;
    a.entry_stride = kLatent;
    a.indices = rows.slots.data();
    a.indices_token_stride = indexer_row_width(f.plan);
    a.m = 1;
    a.heads = attention_heads;
    a.top_k = indexer_row_width(f.plan);
    a.q_scale = a.k_scale = 0.02f;
    a.softmax_scale = 0.125f;
    const reference::SparseMlaResult want = reference::sparse_mla(a);
    for (int threads : {1, 4}) {
      SCOPED_TRACE("pool " + std::to_string(bad_pool) + ", threads " + std::to_string(threads));
      TokenCheckInputs in;
      in.position = position;
      in.row = r.row;
      in.step = &step;
      in.query = &query;
      in.gpu_logits = gpu.data();
      in.check_logits = true;
      in.gpu_slots = rows.slots.data();
      in.gpu_q_fp8 = q.data();
      in.gpu_latent = want.latent.data();
      in.gpu_lse = want.lse.data();
      in.heads = attention_heads;
      in.head_count = attention_heads;
      in.q_scale = in.k_scale = 0.02f;
      in.softmax_scale = 0.125f;
      in.threads = threads;
      const TokenCheck c = check_token(f.model, f.sched.table().entries(), in);
      EXPECT_EQ(c.pools_scored, pools);
      if (bad_pool < 0) {
        EXPECT_TRUE(c.ok) << c.why;
      } else {
        EXPECT_FALSE(c.ok);
        EXPECT_NE(c.why.find("1 of " + std::to_string(pools) + " logits outside"), std::string::npos) << c.why;
      }
    }
  }
}

// ---------------------------------------------------------------- faults

struct FaultFixture : ModelFixture {
  StepBatch batch;
  StepInputs clean;
  static constexpr int64_t kHidden = 32;

  // Steps until one holds `min_tokens` tokens of some request.
  void make_step(int min_tokens, bool caller_rows) {
    admit(1200);
    admit(5000 - 1 > g.max_context - 2 ? 2500 : 2500);
    admit(10);
    for (int attempt = 0; attempt < 200; ++attempt) {
      std::vector<int> starved;
      batch = sched.build_step(&starved);
      for (int i = 0; i < int(sched.live().size()); ++i) {
        if (int(batch.tokens_of(i).size()) >= min_tokens) {
          fill(caller_rows);
          return;
        }
      }
      sched.advance(batch);
    }
    FAIL() << "no step with " << min_tokens << " tokens of one request";
  }

  void fill(bool caller_rows) {
    const int m = batch.m();
    clean.hidden = rows(size_t(m) * kHidden, rng);
    clean.positions = batch.positions;
    clean.token_requests = batch.token_requests;
    clean.slot_mapping = batch.slot_mapping;
    clean.table = sched.table().entries();
    clean.topk.clear();
    if (caller_rows) {
      const int w = indexer_row_width(plan);
      clean.topk.assign(size_t(m) * w, -1);
      for (int t = 0; t < m; ++t) {
        if (batch.owner[size_t(t)] < 0) continue;
        for (int64_t j = 0; j <= std::min<int64_t>(batch.positions[size_t(t)], plan.topk - 1); ++j) {
          clean.topk[size_t(t) * w + size_t(j)] = int32_t(j);
        }
      }
    }
  }

  StepResult result(int m, uint32_t salt) const {
    StepResult r;
    r.m = m;
    r.D = 8;
    r.H = 2;
    r.latent_width = 4;
    r.row_width = indexer_row_width(plan);
    for (int i = 0; i < m * 8; ++i) r.out.push_back(uint16_t(0x3F80 + i + salt));
    for (int i = 0; i < m * 8; ++i) r.latent.push_back(uint16_t(0x3F00 + i + salt));
    for (int i = 0; i < m * 2; ++i) r.lse.push_back(float(i + salt));
    for (int i = 0; i < m * r.row_width; ++i) r.slots.push_back(i % 7 == 0 ? -1 : int32_t(i % 300));
    return r;
  }
};

TEST(ServeFaults, ParseNamesEveryKindAndRejectsUnknownOnes) {
  std::vector<FaultKind> kinds;
  ASSERT_TRUE(parse_faults("all", &kinds).ok());
  EXPECT_EQ(kinds.size(), size_t(FaultKind::kCount));
  ASSERT_TRUE(parse_faults("none", &kinds).ok());
  EXPECT_TRUE(kinds.empty());
  ASSERT_TRUE(parse_faults("nan-hidden,slot-past-cache,nan-hidden", &kinds).ok());
  EXPECT_EQ(kinds, (std::vector<FaultKind>{FaultKind::kNanHidden, FaultKind::kSlotPastCache}));
  testing::expect_rejected(parse_faults("nan-hidden,bogus", &kinds), "--faults", "'bogus' is not a fault kind");
  testing::expect_rejected(parse_faults("", &kinds), "--faults", "'' is not a fault kind");
  std::set<std::string> names;
  for (int k = 0; k < int(FaultKind::kCount); ++k) names.insert(fault_name(FaultKind(k)));
  EXPECT_EQ(names.size(), size_t(FaultKind::kCount));
}

// Every kind edits what its name says, only the victim's part of the step,
// and states what the contracts promise for the faulted tokens.
TEST(ServeFaults, EachKindEditsOnlyTheVictimsPart) {
  for (int k = 0; k < int(FaultKind::kCount); ++k) {
    const FaultKind kind = FaultKind(k);
    const bool single = kind == FaultKind::kPositionPastTable || kind == FaultKind::kPositionNegative ||
                        kind == FaultKind::kPositionFuture;
    FaultFixture f;
    f.make_step(single ? 1 : 2, kind == FaultKind::kTopkOutOfRange);
    if (HasFatalFailure()) return;
    FaultPlan plan;
    bool planned = false;
    for (int attempt = 0; attempt < 50 && !planned; ++attempt) {
      planned = plan_fault(kind, f.g, f.sched.live(), f.batch, f.clean, FaultFixture::kHidden,
                           indexer_row_width(f.plan), f.rng, &plan);
      if (!planned) {
        f.sched.advance(f.batch);
        std::vector<int> starved;
        f.batch = f.sched.build_step(&starved);
        f.fill(kind == FaultKind::kTopkOutOfRange);
      }
    }
    ASSERT_TRUE(planned) << fault_name(kind);
    SCOPED_TRACE(fault_name(kind));
    const ServeRequest& victim = f.sched.live()[size_t(plan.victim)];
    const StepInputs bad = apply_fault(plan, f.clean);
    ASSERT_FALSE(plan.faulted.empty());
    for (int t : plan.faulted) {
      EXPECT_EQ(f.batch.owner[size_t(t)], plan.victim);
      EXPECT_NE(std::find(plan.affected.begin(), plan.affected.end(), t), plan.affected.end());
    }
    // Tokens outside `affected` keep every input.
    for (int t = 0; t < f.batch.m(); ++t) {
      if (std::find(plan.affected.begin(), plan.affected.end(), t) != plan.affected.end()) continue;
      EXPECT_EQ(bad.positions[size_t(t)], f.clean.positions[size_t(t)]);
      EXPECT_EQ(bad.slot_mapping[size_t(t)], f.clean.slot_mapping[size_t(t)]);
      EXPECT_TRUE(std::equal(&bad.hidden[size_t(t) * FaultFixture::kHidden],
                             &bad.hidden[size_t(t + 1) * FaultFixture::kHidden],
                             &f.clean.hidden[size_t(t) * FaultFixture::kHidden]));
    }
    // The table differs at most in the victim's row.
    for (size_t e = 0; e < bad.table.size(); ++e) {
      if (int64_t(e) / f.g.width() != victim.row) {
        EXPECT_EQ(bad.table[e], f.clean.table[e]);
      }
    }
    EXPECT_EQ(bad.token_requests, f.clean.token_requests);
    const int t = plan.faulted.front();
    switch (kind) {
      case FaultKind::kBlockIdOutOfRange:
      case FaultKind::kBlockIdNegative: {
        ASSERT_EQ(plan.table_writes.size(), 1u);
        const int32_t block = plan.table_writes[0].second;
        EXPECT_TRUE(kind == FaultKind::kBlockIdOutOfRange ? block >= f.g.blocks : block < -1) << block;
        EXPECT_TRUE(plan.expect_counted);
        EXPECT_EQ(plan.allowed_blocks.size(), victim.blocks.size() - 1);
        for (const auto& [entry, slot] : plan.slot_writes) EXPECT_TRUE(slot < 0 || slot >= f.g.capacity()) << slot;
        break;
      }
      case FaultKind::kPositionPastTable:
        EXPECT_GE(bad.positions[size_t(t)], f.g.width() * f.g.block_size);
        EXPECT_TRUE(plan.expect_empty && plan.expect_counted);
        EXPECT_EQ(bad.slot_mapping[size_t(t)], -1);
        break;
      case FaultKind::kPositionNegative:
        EXPECT_LT(bad.positions[size_t(t)], 0);
        EXPECT_TRUE(plan.expect_empty && plan.expect_counted);
        break;
      case FaultKind::kPositionFuture: {
        const int64_t p = bad.positions[size_t(t)];
        EXPECT_GE(p, int64_t(victim.blocks.size()) * f.g.block_size);
        EXPECT_LT(p, f.g.max_context);
        EXPECT_EQ(bad.table[size_t(victim.row) * size_t(f.g.width()) + size_t(p / f.g.block_size)], -1);
        EXPECT_FALSE(plan.expect_empty);
        EXPECT_EQ(plan.allowed_blocks, victim.blocks);
        break;
      }
      case FaultKind::kSlotPastCache:
        EXPECT_GE(bad.slot_mapping[size_t(t)], f.g.capacity());
        EXPECT_TRUE(plan.expect_counted);
        break;
      case FaultKind::kTopkOutOfRange: {
        ASSERT_FALSE(plan.cleared_columns.empty());
        const int w = indexer_row_width(f.plan);
        for (int c : plan.cleared_columns) EXPECT_GT(bad.topk[size_t(t) * w + c], f.batch.positions[size_t(t)]);
        EXPECT_EQ(plan.affected, std::vector<int>{t});
        break;
      }
      case FaultKind::kNanHidden:
      case FaultKind::kInfHidden: {
        int odd = 0;
        for (int64_t i = 0; i < FaultFixture::kHidden; ++i) {
          const uint16_t v = bad.hidden[size_t(t) * FaultFixture::kHidden + size_t(i)];
          odd += (v & 0x7F80) == 0x7F80;
        }
        EXPECT_GE(odd, 1);
        EXPECT_FALSE(plan.expect_counted);
        break;
      }
      case FaultKind::kCount:
        break;
    }
  }
}

TEST(ServeFaults, PositionFaultsNeedASingleTokenVictimAndTopkNeedsCallerRows) {
  FaultFixture f;
  f.make_step(2, false);
  if (HasFatalFailure()) return;
  FaultPlan plan;
  EXPECT_FALSE(plan_fault(FaultKind::kTopkOutOfRange, f.g, f.sched.live(), f.batch, f.clean, FaultFixture::kHidden,
                          indexer_row_width(f.plan), f.rng, &plan));
  for (int i = 0; i < 20; ++i) {
    if (plan_fault(FaultKind::kPositionNegative, f.g, f.sched.live(), f.batch, f.clean, FaultFixture::kHidden,
                   indexer_row_width(f.plan), f.rng, &plan)) {
      EXPECT_EQ(f.batch.tokens_of(plan.victim).size(), 1u);
    }
  }
}

// The error word must count a fault only where a kernel meets the untrusted
// value (indexer.h, head_gemv.h). With caller rows the stage runs no indexer:
// a negative block id counts only when a caller position lies in its page (a
// slot from it is negative: skipped, not counted), and a future position
// (the rows hold positions below the clean context, in held pages) not at
// all; an id past the blocks always counts (its slot is past the capacity).
// Here caller rows are 0..min(pos, topk - 1): the bad page (the first
// victim token's) is in them exactly when that token's position is below topk.
TEST(ServeFaults, CountIsExpectedOnlyWhereAKernelMeetsTheFault) {
  int negative_counted = 0, negative_uncounted = 0, future_counted = 0, future_uncounted = 0, past_blocks = 0;
  for (int seed = 0; seed < 4; ++seed) {
    for (bool caller : {false, true}) {
      FaultFixture f;
      f.rng.seed(100 + seed);
      f.make_step(1, caller);
      if (HasFatalFailure()) return;
      for (int attempt = 0; attempt < 40; ++attempt) {
        for (FaultKind kind : {FaultKind::kBlockIdNegative, FaultKind::kBlockIdOutOfRange, FaultKind::kPositionFuture}) {
          FaultPlan plan;
          if (!plan_fault(kind, f.g, f.sched.live(), f.batch, f.clean, FaultFixture::kHidden, indexer_row_width(f.plan),
                          f.rng, &plan)) {
            continue;
          }
          const int64_t first_position = f.batch.positions[size_t(plan.affected.front())];
          SCOPED_TRACE(std::string(fault_name(kind)) + (caller ? " with caller rows" : "") + ", first position " +
                       std::to_string(first_position));
          if (kind == FaultKind::kBlockIdOutOfRange) {
            EXPECT_TRUE(plan.expect_counted);
            ++past_blocks;
          } else if (kind == FaultKind::kBlockIdNegative) {
            const bool met = !caller || first_position < f.plan.topk;
            EXPECT_EQ(plan.expect_counted, met);
            ++(met ? negative_counted : negative_uncounted);
          } else {
            EXPECT_EQ(plan.expect_counted, !caller);
            ++(caller ? future_uncounted : future_counted);
          }
        }
        f.sched.advance(f.batch);
        std::vector<int> starved;
        f.batch = f.sched.build_step(&starved);
        f.fill(caller);
      }
    }
  }
  EXPECT_GT(negative_counted, 0);
  EXPECT_GT(negative_uncounted, 0);
  EXPECT_GT(future_counted, 0);
  EXPECT_GT(future_uncounted, 0);
  EXPECT_GT(past_blocks, 0);
}

TEST(ServeFaults, IsolationFindsAnyChangeOutsideTheVictim) {
  FaultFixture f;
  FaultPlan plan;
  plan.kind = FaultKind::kNanHidden;
  plan.affected = {1};
  plan.faulted = {1};
  const StepResult clean = f.result(3, 0);
  StepResult faulty = clean;
  for (size_t i = 8; i < 16; ++i) faulty.out[i] ^= 1;  // token 1: the victim's, allowed
  std::vector<std::string> failures;
  check_isolation(plan, clean, faulty, &failures);
  EXPECT_TRUE(failures.empty()) << failures.front();
  faulty.lse[4] = -faulty.lse[4] - 1;  // token 2's lse
  faulty.slots[size_t(clean.row_width) * 0 + 9] = 1234;  // token 0's row
  check_isolation(plan, clean, faulty, &failures);
  ASSERT_EQ(failures.size(), 2u);
  EXPECT_NE(failures[0].find("token 0 (not the victim's) differs from the step without the fault in slots"),
            std::string::npos) << failures[0];
  EXPECT_NE(failures[1].find("token 2 (not the victim's) differs from the step without the fault in lse"),
            std::string::npos) << failures[1];
}

TEST(ServeFaults, VictimChecksHoldTheContracts) {
  FaultFixture f;
  const StepResult clean = f.result(2, 0);
  // Empty: rows of -1, latent +0, lse -inf, out zero, counted.
  FaultPlan plan;
  plan.kind = FaultKind::kPositionPastTable;
  plan.affected = plan.faulted = {1};
  plan.expect_counted = plan.expect_empty = true;
  StepResult faulty = clean;
  faulty.errors = 1;
  std::fill(faulty.slots.begin() + clean.row_width, faulty.slots.end(), -1);
  std::fill(faulty.latent.begin() + 8, faulty.latent.end(), 0);
  std::fill(faulty.lse.begin() + 2, faulty.lse.end(), -INFINITY);
  std::fill(faulty.out.begin() + 8, faulty.out.end(), uint16_t(0x8000));  // -0 is zero
  std::vector<std::string> failures;
  check_victim(plan, f.g, clean, faulty, &failures);
  EXPECT_TRUE(failures.empty()) << failures.front();
  faulty.errors = 0;
  faulty.slots[size_t(clean.row_width) + 100] = 3;
  faulty.lse[3] = 0.5f;
  check_victim(plan, f.g, clean, faulty, &failures);
  ASSERT_EQ(failures.size(), 3u);
  EXPECT_NE(failures[0].find("did not count"), std::string::npos);
  EXPECT_NE(failures[1].find("row entry 100 is 3, not -1"), std::string::npos) << failures[1];
  EXPECT_NE(failures[2].find("lse of head 1"), std::string::npos) << failures[2];
  // Allowed blocks: a slot in a block the victim does not hold is named.
  FaultPlan blocks;
  blocks.kind = FaultKind::kBlockIdNegative;
  blocks.affected = blocks.faulted = {0};
  blocks.allowed_blocks = {0, 1};  // slots 0..511 (the made-up rows hold 0..299)
  failures.clear();
  faulty = clean;
  check_victim(blocks, f.g, clean, faulty, &failures);
  EXPECT_TRUE(failures.empty());
  faulty.slots[17] = 256 * 5 + 1;
  check_victim(blocks, f.g, clean, faulty, &failures);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("outside the victim's valid blocks"), std::string::npos) << failures[0];
  // Cleared columns: -1 there, the clean row elsewhere.
  FaultPlan topk;
  topk.kind = FaultKind::kTopkOutOfRange;
  topk.affected = topk.faulted = {1};
  topk.cleared_columns = {4};
  faulty = clean;
  faulty.errors = 2;
  faulty.slots[size_t(clean.row_width) + 4] = -1;
  failures.clear();
  check_victim(topk, f.g, clean, faulty, &failures);
  EXPECT_TRUE(failures.empty()) << failures.front();
  faulty.slots[size_t(clean.row_width) + 9] = 77777;
  check_victim(topk, f.g, clean, faulty, &failures);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("(the clean row's)"), std::string::npos) << failures[0];
}

// ---------------------------------------------------------------- options and report

std::vector<const char*> argv_of(std::initializer_list<const char*> args) {
  std::vector<const char*> v{"dsa-serve"};
  v.insert(v.end(), args.begin(), args.end());
  return v;
}

TEST(ServeOptions, ParsesEveryOptionAndNamesBadOnes) {
  ServeOptions o;
  bool help = false;
  auto a = argv_of({"--steps", "300", "--seed", "9", "--max-context", "8192", "--tp", "1", "--path", "stock",
                    "--batch-invariant", "--faults", "nan-hidden", "--fault-every", "3", "--check-every", "7",
                    "--sample-tokens", "4", "--blocks", "100", "--rows", "5", "--json", "x.json"});
  ASSERT_TRUE(parse_serve_options(int(a.size()), a.data(), &o, &help).ok());
  EXPECT_FALSE(help);
  EXPECT_EQ(o.steps, 300);
  EXPECT_EQ(o.seed, 9u);
  EXPECT_EQ(o.max_context, 8192);
  EXPECT_EQ(o.tp, 1);
  EXPECT_EQ(o.path, "stock");
  EXPECT_TRUE(o.batch_invariant);
  EXPECT_EQ(o.faults, std::vector<FaultKind>{FaultKind::kNanHidden});
  EXPECT_EQ(o.fault_every, 3);
  EXPECT_EQ(o.check_every, 7);
  EXPECT_EQ(o.sample_tokens, 4);
  EXPECT_EQ(o.blocks, 100);
  EXPECT_EQ(o.rows, 5);
  EXPECT_EQ(o.json_path, "x.json");
  EXPECT_EQ(o.time_limit, 0);
  auto t = argv_of({"--time-limit", "270"});
  ASSERT_TRUE(parse_serve_options(int(t.size()), t.data(), &o, &help).ok());
  EXPECT_EQ(o.time_limit, 270);
  auto d = argv_of({});
  ASSERT_TRUE(parse_serve_options(int(d.size()), d.data(), &o, &help).ok());
  EXPECT_EQ(o.faults.size(), size_t(FaultKind::kCount));  // all by default
  EXPECT_EQ(o.path, "both");
  const auto rejected = [&](std::initializer_list<const char*> args, const std::string& name, const std::string& words) {
    auto v = argv_of(args);
    testing::expect_rejected(parse_serve_options(int(v.size()), v.data(), &o, &help), name, words);
  };
  rejected({"--tp", "4"}, "--tp", "1 or 8");
  rejected({"--max-context", "5000"}, "--max-context", "a multiple of 256");
  rejected({"--max-context", "512"}, "--max-context", "from 1024");
  rejected({"--path", "both2"}, "--path", "fused, stock or both");
  rejected({"--steps"}, "--steps", "got nothing");
  rejected({"--steps", "0"}, "--steps", "got '0'");
  rejected({"--faults", "x"}, "--faults", "'x' is not a fault kind");
  rejected({"--frobnicate"}, "--frobnicate", "an option of dsa-serve");
  rejected({"--time-limit", "-5"}, "--time-limit", "got '-5'");
  rejected({"--index-pool", "0"}, "--index-pool", "got '0'");
  auto shape = argv_of({"--index-heads", "16", "--index-pool", "16", "--index-topk", "1024"});
  ASSERT_TRUE(parse_serve_options(int(shape.size()), shape.data(), &o, &help).ok());
  EXPECT_EQ(o.index_heads, 16);
  EXPECT_EQ(o.index_pool, 16);
  EXPECT_EQ(o.index_topk, 1024);
  auto h = argv_of({"--help"});
  ASSERT_TRUE(parse_serve_options(int(h.size()), h.data(), &o, &help).ok());
  EXPECT_TRUE(help);
}

TEST(ServeOptions, ReportJsonHoldsTheFiguresAndTheVerdict) {
  ServeReport r;
  r.gpu = "NVIDIA H200";
  r.steps = 10;
  r.steps_planned = 10;
  r.requests_served = 3;
  r.tokens_checked = 20;
  r.faults[int(FaultKind::kSlotPastCache)] = 2;
  std::string json = report_json(r);
  EXPECT_NE(json.find("\"result\": \"PASS\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"steps\": 10"), std::string::npos);
  EXPECT_NE(json.find("\"requests_served\": 3"), std::string::npos);
  EXPECT_NE(json.find("\"tokens_checked\": 20"), std::string::npos);
  EXPECT_NE(json.find("\"faults_injected\": 2"), std::string::npos);
  EXPECT_NE(json.find("\"slot-past-cache\": 2"), std::string::npos);
  EXPECT_NE(json.find("\"memory_delta_bytes\": 0"), std::string::npos);
  // A run that ended early says so, with the steps it ran; a mismatch still fails it.
  r.steps_planned = 10000;
  r.stopped = "time limit";
  json = report_json(r);
  EXPECT_NE(json.find("\"result\": \"INCOMPLETE\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"complete\": false"), std::string::npos) << json;
  EXPECT_NE(json.find("\"stopped\": \"time limit\""), std::string::npos) << json;
  EXPECT_NE(report_text(r).find("10 steps of 10000 (stopped: time limit)"), std::string::npos) << report_text(r);
  r.fail("token 3 \"quoted\"");
  json = report_json(r);
  EXPECT_NE(json.find("\"result\": \"FAIL\""), std::string::npos);
  EXPECT_NE(json.find("\"mismatches\": 1"), std::string::npos);
  EXPECT_NE(json.find("token 3 \\\"quoted\\\""), std::string::npos) << json;
}

// The figures file is replaced whole (a reader during a rewrite sees the
// old or the new one), and an unwritable path is reported.
TEST(ServeOptions, FiguresFileIsReplacedWhole) {
  const std::string path = ::testing::TempDir() + "serve_figures_test.json";
  ASSERT_TRUE(write_file_atomically(path, "{\"steps\": 1}\n"));
  ASSERT_TRUE(write_file_atomically(path, "{\"steps\": 2}\n"));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  ASSERT_NE(f, nullptr);
  char text[64] = {};
  const size_t got = std::fread(text, 1, sizeof(text) - 1, f);
  std::fclose(f);
  EXPECT_EQ(std::string(text, got), "{\"steps\": 2}\n");
  EXPECT_EQ(std::fopen((path + ".tmp").c_str(), "rb"), nullptr);
  std::remove(path.c_str());
  EXPECT_FALSE(write_file_atomically("/nonexistent-dir/x/figures.json", "{}"));
}

// ---------------------------------------------------------------- GPU

// A few hundred steps of the simulation at a short context (so that prompts
// cross the indexer's 2048 boundary and blocks churn fast), both paths drawn
// per step, every fault kind.
void run_short(bool batch_invariant, int64_t steps, int index_heads = 0, int index_pool = 0) {
  ServeOptions o;
  o.index_heads = index_heads;
  o.index_pool = index_pool;
  o.steps = testing::quick_mode() ? steps / 4 : steps;
  o.seed = testing::test_seed();
  o.max_context = 8192;
  o.tp = 8;
  o.batch_invariant = batch_invariant;
  ASSERT_TRUE(parse_faults("all", &o.faults).ok());
  o.fault_every = 4;
  o.check_every = 25;
  o.sample_tokens = 3;
  o.blocks = 80;  // 2.5 requests at max_context: the pool runs short and blocks churn
  o.rows = 8;
  ServeReport r;
  const Status s = run_serve(o, &r);
  ASSERT_TRUE(s.ok()) << s.to_string();
  SCOPED_TRACE(report_text(r) + "DSA_TEST_SEED=" + std::to_string(o.seed));
  EXPECT_EQ(r.mismatches, 0);
  EXPECT_EQ(r.steps, o.steps);
  EXPECT_GT(r.tokens_checked, o.steps);
  EXPECT_GT(r.state_checks, 1);
  EXPECT_GT(r.requests_served + r.requests_ended_by_fault + r.requests_starved, 2);
  EXPECT_GT(r.fused_steps, 0);
  EXPECT_GT(r.stock_steps, 0);
  int64_t faults = 0;
  for (int64_t n : r.faults) faults += n;
  EXPECT_GT(faults, o.steps / 16);
  // Lazy module loading (the test binary's default) may load a kernel late;
  // the program runs with CUDA_MODULE_LOADING=EAGER and fails on any change.
  if (r.memory_strict) {
    EXPECT_EQ(r.memory_delta_bytes, 0);
  }
}

TEST(ServeGpu, DefaultPlanServesWithFaultsAndNoMismatch) {
  DSA_REQUIRE_GPU();
  run_short(false, 300);
}

TEST(ServeGpu, BatchInvariantPlanServesWithFaultsAndNoMismatch) {
  DSA_REQUIRE_GPU();
  run_short(true, 200);
}

TEST(ServeGpu, SixteenHeadsInPoolsOfSixteenServeWithFaultsAndNoMismatch) {
  DSA_REQUIRE_GPU();
  run_short(false, 200, 16, 16);
}

}  // namespace
}  // namespace dsa::serve
