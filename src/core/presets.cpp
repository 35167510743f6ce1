#include "dsa_decode/presets.h"

#include <cmath>

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
