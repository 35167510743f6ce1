#include "serve_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "dsa_decode/numerics.h"
#include "dsa_decode/sparse_mla.h"
#include "serve_parallel.h"
#include "sparse_mla/sparse_mla_reference.h"

namespace dsa::serve {

namespace {
TokenCheck failed(TokenCheck c, std::string why) {
  c.ok = false;
  if (c.why.empty()) c.why = std::move(why);
  return c;
}
}  // namespace

TokenCheck check_token(StateModel& model, const std::vector<int32_t>& table, const TokenCheckInputs& in) {
  TokenCheck c;
  if (model.latent() != kSparseMlaLatent) {
    return failed(c, "the model's KV entries are " + std::to_string(model.latent()) + " wide; the attention's reference reads " +
                         std::to_string(kSparseMlaLatent));
  }
  const IndexerPlan& plan = model.plan();
  const int row_width = indexer_row_width(plan);
  const int heads = plan.heads;
  reference::IndexerStateHost state = model.view(table);
  const int64_t context = in.position + 1;
  // The row the model gives.
  std::vector<int32_t> want(size_t(row_width), -1);
  if (in.caller_positions != nullptr) {
    reference::remap_row(plan, state, in.row, in.caller_positions, row_width, want.data());
  } else {
    if (in.step == nullptr || in.query == nullptr) return failed(c, "no indexer step or query for an indexer token");
    const int t = in.token;
    const reference::IndexerStepHost one{1,
                                         in.step->index_q + size_t(t) * heads * kIndexerDim,
                                         in.step->index_k + size_t(t) * kIndexerDim,
                                         in.step->head_weights + size_t(t) * heads,
                                         in.step->gate + size_t(t) * kIndexerDim,
                                         in.step->positions + t,
                                         in.step->token_requests + t};
    reference::IndexerRowsHost rows;
    const uint8_t* q = &in.query->q_fp8[size_t(t) * heads * kIndexerDim];
    const float* w = &in.query->head_weights[size_t(t) * heads];
    if (plan.logits == IndexerLogits::kExact) {
      reference::IndexerQueryHost query;
      query.q_fp8.assign(q, q + heads * kIndexerDim);
      query.head_weights.assign(w, w + heads);
      const Status s = reference::indexer_select(plan, one, query, state, &rows);
      if (!s.ok()) return failed(c, "the reference select refused the token: " + s.to_string());
    } else {
      std::vector<std::vector<float>> logits(1);
      const int64_t pools = context / plan.pool;
      if (context > plan.topk) {
        if (in.gpu_logits == nullptr) return failed(c, "no GPU logits for a token of L > plan.topk");
        logits[0].assign(in.gpu_logits, in.gpu_logits + pools);
        if (in.check_logits) {
          // In parts of whole pages (the reference over the table row from
          // the part's first page, pools numbered from it): the same
          // per-pool verdicts as one call.
          const int64_t per_page = indexer_pools_per_page(plan);
          std::vector<reference::LogitDeviation> parts(size_t(std::max(1, in.threads)));
          std::vector<int64_t> starts(parts.size(), -1);
          int64_t next_part = 0;
          std::mutex lock;
          parallel_for(pools, per_page * 4, in.threads, [&](int64_t begin, int64_t end) {
            reference::IndexerStateHost part = state;
            part.block_table = state.block_table + begin / per_page;
            const reference::LogitDeviation d =
                reference::indexer_logit_deviation(plan, part, in.row, end - begin, q, w, in.gpu_logits + begin);
            std::lock_guard<std::mutex> hold(lock);
            parts[size_t(next_part)] = d;
            starts[size_t(next_part++)] = begin;
          });
          reference::LogitDeviation d;
          for (size_t i = 0; i < parts.size(); ++i) {
            if (starts[i] < 0) continue;
            d.outside += parts[i].outside;
            d.worst = std::max(d.worst, parts[i].worst);
          }
          c.pools_scored = pools;
          if (d.outside > 0) {
            c = failed(c, std::to_string(d.outside) + " of " + std::to_string(pools) +
                              " logits outside their bound (worst " + std::to_string(d.worst) + " x the bound)");
          }
        }
      }
      const Status s = reference::indexer_select_on_logits(plan, one, logits, state, &rows);
      if (!s.ok()) return failed(c, "the reference select refused the token: " + s.to_string());
    }
    want = rows.slots;
  }
  for (int j = 0; j < row_width; ++j) {
    if (want[size_t(j)] != in.gpu_slots[j]) {
      return failed(c, "slot " + std::to_string(j) + " of the row is " + std::to_string(in.gpu_slots[j]) +
                           ", the model's " + std::to_string(want[size_t(j)]));
    }
  }
  // The attention of heads first_head.. over the model's cache at the model's row.
  const ServeGeometry& g = model.geometry();
  const int64_t L = model.latent();
  reference::SparseMlaHost a{};
  a.q = in.gpu_q_fp8 + size_t(in.first_head) * size_t(L);
  a.q_token_stride = in.heads * L;
  a.q_head_stride = L;
  a.cache = model.kv().data();
  a.blocks = g.blocks;
  a.block_size = g.block_size;
  a.block_stride = int64_t{g.block_size} * L;
  a.entry_stride = L;
  a.indices = want.data();
  a.indices_token_stride = row_width;
  a.m = 1;
  a.heads = 1;
  a.top_k = row_width;
  a.q_scale = in.q_scale;
  a.k_scale = in.k_scale;
  a.softmax_scale = in.softmax_scale;
  // One head per call, the heads on threads: each head's result is the
  // reference's of all the heads at once (it treats them one by one).
  reference::SparseMlaResult r;
  r.latent.assign(size_t(in.head_count) * size_t(L), 0);
  r.lse.assign(size_t(in.head_count), 0.0f);
  parallel_for(in.head_count, 1, in.threads, [&](int64_t first, int64_t end) {
    for (int64_t h = first; h < end; ++h) {
      reference::SparseMlaHost one = a;
      one.q = a.q + size_t(h) * size_t(L);
      const reference::SparseMlaResult head = reference::sparse_mla(one);
      std::copy(head.latent.begin(), head.latent.end(), r.latent.begin() + h * L);
      r.lse[size_t(h)] = head.lse[0];
    }
  });
  double diff = 0, norm = 0;
  const uint16_t* got = in.gpu_latent + size_t(in.first_head) * size_t(L);
  for (size_t i = 0; i < r.latent.size(); ++i) {
    const double w = num::bf16_to_float(r.latent[i]), x = num::bf16_to_float(got[i]);
    diff += (x - w) * (x - w);
    norm += w * w;
  }
  if (norm == 0) {
    c.latent_error = diff == 0 ? 0 : INFINITY;
  } else {
    c.latent_error = std::sqrt(diff / norm);
  }
  if (!(c.latent_error <= kLatentTolerance)) {
    c = failed(c, "latent of heads " + std::to_string(in.first_head) + ".." +
                      std::to_string(in.first_head + in.head_count - 1) + " off by " + std::to_string(c.latent_error) +
                      " (relative Frobenius; bound " + std::to_string(kLatentTolerance) + ")");
  }
  for (int h = 0; h < in.head_count; ++h) {
    const float want_lse = r.lse[size_t(h)], got_lse = in.gpu_lse[in.first_head + h];
    const bool both_empty = std::isinf(want_lse) && want_lse < 0 && std::isinf(got_lse) && got_lse < 0;
    const double e = both_empty ? 0.0 : std::fabs(double(got_lse) - double(want_lse));
    c.lse_error = std::max(c.lse_error, std::isnan(e) ? INFINITY : e);
  }
  if (!(c.lse_error <= kLseTolerance)) {
    c = failed(c, "lse off by " + std::to_string(c.lse_error) + " (bound " + std::to_string(kLseTolerance) + ")");
  }
  return c;
}

}  // namespace dsa::serve
