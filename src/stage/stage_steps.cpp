#include "stage/stage_steps.h"

#include "dsa_decode/linear.h"

namespace dsa {

const char* step_name(Step step, bool projections_cublaslt) {
  switch (step) {
    case Step::kQkvAProj:
      return "qkv_a_proj (cuBLASLt)";
    case Step::kQkvAProjGemv:
      return "qkv_a_proj (GEMV)";
    case Step::kNorm:
      return "norm";
    case Step::kQbProj:
      return "q_b_proj (cuBLASLt)";
    case Step::kQbProjGemv:
      return "q_b_proj (GEMV)";
    case Step::kAbsorb:
      return "absorb + cache write (head_gemv)";
    case Step::kIndexerProject:
      return projections_cublaslt ? "indexer projections (cuBLASLt)" : "indexer projections (GEMV)";
    case Step::kIndexerPrepare:
      return "indexer prepare";
    case Step::kIndexerSelect:
      return "indexer select";
    case Step::kTopkRemap:
      return "top-k remap";
    case Step::kAttention:
      return "attention (sparse_mla)";
    case Step::kValueUpGemv:
      return "value_up (head_gemv)";
    case Step::kValueUpBmm:
      return "value_up (cuBLAS bmm)";
    case Step::kOProj:
      return "o_proj (cuBLASLt)";
    case Step::kOProjGemv:
      return "o_proj (GEMV)";
    case Step::kStockIndexerSelect:
      return "indexer select (top-k positions kept)";
    case Step::kStockCacheWrite:
      return "cache write (concat_and_cache_mla)";
    case Step::kStockAbsorbBmm:
      return "absorb (cuBLAS bmm)";
    case Step::kStockFp8Quant:
      return "static FP8 quant";
    case Step::kStockCounterMemset:
      return "split counter memset";
    case Step::kRopeAbsorb:
      return "rope_absorb (absorb + RoPE)";
    case Step::kV32CacheWrite:
      return "cache write (656-byte, sparse_mla_v32)";
    case Step::kV32Attention:
      return "attention (sparse_mla_v32)";
  }
  return "?";
}

bool on_indexer_lane(Step step) {
  return step == Step::kIndexerProject || step == Step::kIndexerPrepare || step == Step::kIndexerSelect ||
         step == Step::kTopkRemap;
}

StepList stage_steps(DsaPath path, const StepChoices& c, int64_t m, bool caller_rows) {
  // A projection of m tokens over k columns as linear_gemv: m in the plan's
  // set and within the kernel's shared-memory rule.
  // Batch invariant: linear_gemv at every m, in launches of the tokens it takes.
  const auto gemv_for = [&](int64_t k) {
    if (c.batch_invariant) return true;
    return c.projection_gemv_tokens.count(static_cast<int>(m)) > 0 && linear_gemv_supports(m, k);
  };
  const bool value_up_gemv = c.batch_invariant || c.value_up_tokens.count(static_cast<int>(m)) > 0;
  StepList list;
  // The top-k rows: the caller's remapped, or the indexer with this path's select.
  const auto add_rows = [&](Step select) {
    if (caller_rows) {
      list.add(Step::kTopkRemap);
      return;
    }
    list.add(Step::kIndexerProject);
    list.add(Step::kIndexerPrepare);
    list.add(select);
  };
  // qkv_a_proj is the same kernel in both paths: their KV cache bytes and
  // the indexer's inputs must agree bit for bit.
  list.add(gemv_for(c.hidden) ? Step::kQkvAProjGemv : Step::kQkvAProj);
  list.add(Step::kNorm);
  if (c.rope) {
    // A RoPE layer: rope_absorb and the 656-byte cache write in place of the
    // absorb (its cache write a launch of its own), sparse_mla_v32.
    if (path == DsaPath::kFused) {
      if (c.overlap_indexer) add_rows(Step::kIndexerSelect);
      list.add(gemv_for(c.q_lora) ? Step::kQbProjGemv : Step::kQbProj);
      list.add(Step::kRopeAbsorb);
      list.add(Step::kV32CacheWrite);
      if (!c.overlap_indexer) add_rows(Step::kIndexerSelect);
      list.add(Step::kV32Attention);
      list.add(value_up_gemv ? Step::kValueUpGemv : Step::kValueUpBmm);
      list.add(gemv_for(c.heads_v) ? Step::kOProjGemv : Step::kOProj);
    } else {
      // The engine's order: the rotary (rope_absorb, which also absorbs:
      // the library has no separate rotary kernel) after q_b_proj, then the
      // indexer, the cache write, the attention and the value-up bmm.
      list.add(Step::kQbProj);
      list.add(Step::kRopeAbsorb);
      add_rows(Step::kStockIndexerSelect);
      list.add(Step::kV32CacheWrite);
      list.add(Step::kV32Attention);
      list.add(Step::kValueUpBmm);
      list.add(Step::kOProj);
    }
    return list;
  }
  if (path == DsaPath::kFused) {
    // With the overlap the indexer's lane is issued first: its select is
    // the longer chain, so its kernels should take the SMs first.
    if (c.overlap_indexer) add_rows(Step::kIndexerSelect);
    list.add(gemv_for(c.q_lora) ? Step::kQbProjGemv : Step::kQbProj);
    list.add(Step::kAbsorb);
    if (!c.overlap_indexer) add_rows(Step::kIndexerSelect);
    list.add(Step::kAttention);
    list.add(value_up_gemv ? Step::kValueUpGemv : Step::kValueUpBmm);
    list.add(gemv_for(c.heads_v) ? Step::kOProjGemv : Step::kOProj);
  } else {
    list.add(Step::kQbProj);
    add_rows(Step::kStockIndexerSelect);
    list.add(Step::kStockCacheWrite);
    list.add(Step::kStockAbsorbBmm);
    list.add(Step::kStockFp8Quant);
    list.add(Step::kStockCounterMemset);
    list.add(Step::kAttention);
    list.add(Step::kValueUpBmm);
    list.add(Step::kOProj);
  }
  return list;
}

}  // namespace dsa
