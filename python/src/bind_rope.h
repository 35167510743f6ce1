// A RopeConfig as it crosses between C++ and Python: a tuple of its fields
// (dsa_decode.RopeConfig._fields() builds it, dsa_decode.RopeConfig(*fields)
// reads it back), shared by the rope functions (bind_rope.cpp) and the
// stage's layer configuration (bind_stage.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>

#include "bind_common.h"
#include "dsa_decode/rope.h"

namespace dsa_python {

// rope_dim, theta, factor, original_max_position, beta_fast, beta_slow,
// mscale, mscale_all_dim, max_position, style (a ROPE_STYLES name).
using RopeConfigFields =
    std::tuple<int, double, double, int64_t, double, double, double, double, int64_t, std::string>;

inline constexpr dsa::Choice<dsa::RopeStyle> kRopeStyleChoices[] = {{dsa::RopeStyle::kInterleaved, "interleaved"},
                                                                    {dsa::RopeStyle::kHalfSplit, "half-split"}};

// The fields as a RopeConfig, checked (check_rope_config: the error names
// the field, prefixed by `name` when given, e.g. "config.rope.theta").
dsa::RopeConfig rope_config_from_fields(const RopeConfigFields& fields, const std::string& name = "");
RopeConfigFields rope_config_fields(const dsa::RopeConfig& config);

}  // namespace dsa_python
