// Model shapes of the DSA layers this library serves,
// whole-model and per tensor-parallel rank.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "dsa_decode/status.h"

namespace dsa {

inline constexpr int kMaxDecodeTokens = 16;  // larger steps take the stock path

struct ModelPreset {
  const char* name;
  const char* description;
  int hidden;          // D
  int heads;           // H (per rank after per_rank())
  int q_lora;          // Q, q_lora_rank
  int kv_lora;         // L, kv_lora_rank (latent width of the KV cache)
  int qk_nope;         // P, qk_nope_head_dim
  int qk_rope;         // rope dims per head (0 = NoPE)
  int v_head;          // V, v_head_dim
  // The indexer's shape (glm5next: the model config's index_n_heads,
  // index_head_dim, index_topk, index_kpool; the preset holds the default
  // shape, with_indexer_shape() another).
  int index_heads;     // indexer heads (not split across ranks)
  int index_dim;       // indexer head dim
  int topk;            // selected tokens per query token
  int topk_row_width;  // width of one top-k row (2176 for glm5next: 2048 pooled + tail + padding)
  int pool_size;       // tokens per indexer pool (1 = no pooling)
  float softmax_scale;
  int tp = 1;          // tensor-parallel degree these heads are for

  int q_head_dim() const { return qk_nope + qk_rope; }
  int cache_width() const { return kv_lora + qk_rope; }
};

// glm5next, glm5, dsv32 (whole model, tp = 1).
const ModelPreset* model_presets(size_t* count);
Status find_preset(std::string_view name, ModelPreset* out);
// The preset's shapes on one of `tp` ranks: heads / tp (must divide).
Status per_rank(const ModelPreset& preset, int tp, ModelPreset* out);
std::string preset_names();  // "glm5next, glm5, dsv32"

// The preset with another pooled indexer shape: index_heads = `heads` (16,
// 32 or 64), pool_size = `pool` (4, 8 or 16), topk = `topk` (a multiple of
// pool, at most 512 pools) and topk_row_width = topk + pool - 1 rounded up
// to 128 (indexer.h's indexer_row_width). Only a preset with a pooled
// indexer (pool_size > 1) takes one. Errors name the field ("index_heads",
// "pool_size", "topk", "preset"), what it must be and what it is.
Status with_indexer_shape(const ModelPreset& preset, int heads, int pool, int topk, ModelPreset* out);

}  // namespace dsa
