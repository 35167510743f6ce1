// Compiles against the installed headers and links the installed library.
#include <dsa_decode/head_gemv.h>
#include <dsa_decode/presets.h>

#include <cstdio>

int main() {
  dsa::ModelPreset preset;
  if (!dsa::find_preset("glm5next", &preset).ok()) return 1;
  const dsa::HeadGemvTactic absorb = dsa::head_gemv_tactic(preset.heads, preset.qk_nope, preset.kv_lora, 1);
  if (!dsa::check_head_gemv_tactic(preset.qk_nope, preset.kv_lora, 1, absorb).ok()) return 1;
  std::printf("installed dsa_decode: %s absorb tactic %d/%d\n", preset.name, absorb.tile, absorb.rows_per_thread);
  return 0;
}
