#include "dsa_decode/presets.h"

#include <cmath>

#include "dsa_decode/indexer.h"

namespace dsa {

namespace {
// DESIGN.md section 1. softmax scales: 256^-0.5 for the GLM presets (qk head
// dim 256 incl. rope), DeepSeek-V3.2's published 0.13523.
const ModelPreset kPresets[] = {
    {"glm5next", "GLM-5.3 DSA layer (NoPE, pooled indexer)", 4096, 64, 1536, 512, 256, 0, 256, 32, 128, 2048, 2176, 4,
     0.0625f},
    {"glm5", "GLM-5/5.1/5.2 (RoPE)", 6144, 64, 2048, 512, 192, 64, 256, 32, 128, 2048, 2048, 1, 0.0625f},
    {"dsv32", "DeepSeek-V3.2 (RoPE)", 7168, 128, 1536, 512, 128, 64, 128, 64, 128, 2048, 2048, 1, 0.13523f},
};
}  // namespace

const ModelPreset* model_presets(size_t* count) {
  *count = sizeof(kPresets) / sizeof(kPresets[0]);
  return kPresets;
}

std::string preset_names() {
  std::string names;
  for (const ModelPreset& p : kPresets) {
    if (!names.empty()) names += ", ";
    names += p.name;
  }
  return names;
}

Status find_preset(std::string_view name, ModelPreset* out) {
  for (const ModelPreset& p : kPresets) {
    if (name == p.name) {
      *out = p;
      return Status();
    }
  }
  return invalid_argument("preset", "one of " + preset_names(), "'" + std::string(name) + "'");
}

Status with_indexer_shape(const ModelPreset& preset, int heads, int pool, int topk, ModelPreset* out) {
  if (preset.pool_size <= 1) {
    return invalid_argument("preset", "a preset with a pooled indexer (pool_size > 1)",
                            std::string(preset.name) + " (pool_size " + std::to_string(preset.pool_size) + ")");
  }
  if (heads != 16 && heads != 32 && heads != 64) {
    return invalid_argument("index_heads", "16, 32 or 64 index heads", std::to_string(heads));
  }
  if (pool != 4 && pool != 8 && pool != 16) {
    return invalid_argument("pool_size", "4, 8 or 16 tokens per pool", std::to_string(pool));
  }
  if (topk < pool || topk % pool != 0 || topk / pool > kIndexerMaxTopPools) {
    return invalid_argument("topk",
                            "a multiple of the pool size " + std::to_string(pool) + " from " + std::to_string(pool) +
                                " to " + std::to_string(kIndexerMaxTopPools * pool) + " (at most " +
                                std::to_string(kIndexerMaxTopPools) + " pools)",
                            std::to_string(topk));
  }
  *out = preset;
  out->index_heads = heads;
  out->pool_size = pool;
  out->topk = topk;
  IndexerPlan plan;
  plan.heads = heads;
  plan.pool = pool;
  plan.topk = topk;
  out->topk_row_width = indexer_row_width(plan);
  return Status();
}

Status per_rank(const ModelPreset& preset, int tp, ModelPreset* out) {
  if (tp < 1 || preset.heads % tp != 0) {
    return invalid_argument("tp", "a positive divisor of " + std::to_string(preset.heads) + " heads (" +
                                      preset.name + ")",
                            std::to_string(tp));
  }
  *out = preset;
  out->heads = preset.heads / tp;
  out->tp = tp;
  return Status();
}

}  // namespace dsa
