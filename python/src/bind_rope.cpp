// RoPE: the presets' rotary configurations, the cos/sin table, the softmax
// scale and the RoPE absorb (rope.h).
//
// A RopeConfig crosses as a tuple of its fields in RopeConfigFields' order
// (dsa_decode.ops.RopeConfig builds and reads it); the style and the target
// as names ("interleaved" | "half-split", "attention" | "indexer").
#include <cmath>
#include <cstdio>

#include "bind_common.h"
#include "bind_rope.h"
#include "dsa_decode/rope.h"

namespace dsa_python {

dsa::RopeConfig rope_config_from_fields(const RopeConfigFields& f, const std::string& name) {
  dsa::RopeConfig c;
  c.rope_dim = std::get<0>(f);
  c.theta = std::get<1>(f);
  c.factor = std::get<2>(f);
  c.original_max_position = std::get<3>(f);
  c.beta_fast = std::get<4>(f);
  c.beta_slow = std::get<5>(f);
  c.mscale = std::get<6>(f);
  c.mscale_all_dim = std::get<7>(f);
  c.max_position = std::get<8>(f);
  const std::string style_name = name.empty() ? "style" : name + ".style";
  c.style = parse_choice(kRopeStyleChoices, std::get<9>(f), style_name.c_str());
  const dsa::Status checked = dsa::check_rope_config(c);
  if (!checked.ok() && !name.empty()) {
    // check_rope_config names the field ("argument 'theta'"): name it within `name`.
    std::string message = checked.message();
    const std::string argument = "argument '";
    if (const size_t at = message.find(argument); at != std::string::npos) {
      message.insert(at + argument.size(), name + ".");
    }
    throw_if_error(dsa::Status(checked.code(), message));
  }
  throw_if_error(checked);
  return c;
}

RopeConfigFields rope_config_fields(const dsa::RopeConfig& c) {
  return {c.rope_dim, c.theta,  c.factor,         c.original_max_position, c.beta_fast,
          c.beta_slow, c.mscale, c.mscale_all_dim, c.max_position,          dsa::choice_name(kRopeStyleChoices, c.style)};
}

namespace {

constexpr dsa::Choice<dsa::RopeTarget> kRopeTargetChoices[] = {{dsa::RopeTarget::kAttention, "attention"},
                                                               {dsa::RopeTarget::kIndexer, "indexer"}};

dsa::RopeConfig to_config(const RopeConfigFields& f) { return rope_config_from_fields(f); }
RopeConfigFields to_fields(const dsa::RopeConfig& c) { return rope_config_fields(c); }

}  // namespace

void bind_rope(nb::module_& m) {
  m.attr("ROPE_STYLES") = choice_names(kRopeStyleChoices);
  m.attr("ROPE_TARGETS") = choice_names(kRopeTargetChoices);
  m.def(
      "rope_preset_config",
      [](const std::string& preset, const std::string& target) {
        dsa::RopeConfig c;
        throw_if_error(dsa::rope_preset_config(preset, parse_choice(kRopeTargetChoices, target, "target"), &c));
        return to_fields(c);
      },
      "preset"_a, "target"_a);
  m.def(
      "check_rope_config", [](const RopeConfigFields& f) { to_config(f); }, "config"_a);
  m.def(
      "rope_frequency",
      [](const RopeConfigFields& f, int pair) {
        const dsa::RopeConfig c = to_config(f);
        if (pair < 0 || pair >= c.rope_dim / 2) {
          throw_invalid("pair", "0.." + std::to_string(c.rope_dim / 2 - 1) + " (rope_dim / 2 pairs)",
                        std::to_string(pair));
        }
        return dsa::rope_frequency(c, pair);
      },
      "config"_a, "pair"_a);
  m.def(
      "rope_table_scale", [](const RopeConfigFields& f) { return dsa::rope_table_scale(to_config(f)); }, "config"_a);
  m.def(
      "rope_softmax_scale",
      [](const RopeConfigFields& f, int qk_head_dim) {
        const dsa::RopeConfig c = to_config(f);
        if (qk_head_dim < 1) {
          throw_invalid("qk_head_dim", "at least 1 (the model's qk_nope_head_dim + qk_rope_head_dim, e.g. 192)",
                        std::to_string(qk_head_dim));
        }
        return dsa::rope_softmax_scale(c, qk_head_dim);
      },
      "config"_a, "qk_head_dim"_a);
  m.def(
      "rope_cos_sin_table",
      [](const RopeConfigFields& f, int64_t first_position, std::optional<int64_t> rows) {
        const dsa::RopeConfig c = to_config(f);
        const int64_t n = rows ? *rows : c.max_position - first_position;
        // A host table: refuse what cannot be held before asking for it (2^31 floats is 8 GiB).
        if (n < 0 || n > (int64_t{1} << 31) / c.rope_dim) {
          throw_invalid("rows",
                        "0.." + std::to_string((int64_t{1} << 31) / c.rope_dim) +
                            " rows (default: max_position - first_position)",
                        std::to_string(n));
        }
        std::vector<float> table(size_t(n) * size_t(c.rope_dim));
        throw_if_error(dsa::rope_cos_sin_table(c, first_position, n, table.data()));
        return numpy_from(std::move(table), {size_t(n), size_t(c.rope_dim)});
      },
      "config"_a, "first_position"_a, "rows"_a.none());
  m.def(
      "rope_absorb",
      [](const Array& q_nope, const Array& q_pe, const Array& k_pe, const Array& positions, const Array& cos_sin,
         const Array& weight, const Array& out, const Array& k_pe_out, const std::string& style,
         const OptArray& error_count, uintptr_t stream) {
        dsa::RopeAbsorbArgs args;
        args.style = parse_choice(kRopeStyleChoices, style, "style");
        args.q_nope = to_view(q_nope, "q_nope");
        args.q_pe = to_view(q_pe, "q_pe");
        args.k_pe = to_view(k_pe, "k_pe");
        args.positions = to_view(positions, "positions");
        args.cos_sin = to_view(cos_sin, "cos_sin");
        args.weight = to_view(weight, "weight");
        args.out = to_view(out, "out");
        args.k_pe_out = to_view(k_pe_out, "k_pe_out");
        args.error_count = to_counter(error_count, "error_count");
        launch_released([&] { return dsa::rope_absorb(args, to_stream(stream)); });
      },
      "q_nope"_a, "q_pe"_a, "k_pe"_a, "positions"_a, "cos_sin"_a, "weight"_a, "out"_a, "k_pe_out"_a, "style"_a,
      "error_count"_a.none(), "stream"_a);
}

}  // namespace dsa_python
