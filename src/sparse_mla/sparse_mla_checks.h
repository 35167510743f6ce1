// Argument checks that sparse_mla (include/dsa_decode/sparse_mla.h) and
// sparse_mla_v32 (include/dsa_decode/sparse_mla_v32.h) make the same way:
// one definition (sparse_mla.cpp), so that the two APIs accept and word the
// same layouts alike. Each returns the first violation, as check_* of
// dsa_decode/tensor.h.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/status.h"
#include "dsa_decode/tensor.h"

namespace dsa {

// "low..high".
std::string check_range_text(int64_t low, int64_t high);

// q [m, H, width] (dtype, shape and device already checked): 1..max_tokens
// tokens, 1..max_heads heads, head and token strides in elements that are
// multiples of `multiple` (16 bytes) and do not overlap, 16-byte aligned.
Status check_query_layout(const TensorView& q, int64_t width, int64_t max_tokens, int64_t max_heads,
                          int64_t multiple);

// kv_cache [blocks, block_size, width] (dtype, shape and device already
// checked): at least one block of one entry, entry and block strides that
// are multiples of 16 and do not overlap, 16-byte aligned.
Status check_paged_cache_layout(const TensorView& c, int64_t width);

// indices [m, K] int32 on the GPU, 1..max_top_k entries per token, rows that
// do not overlap, 4-byte aligned.
Status check_index_rows(const TensorView& indices, int64_t m, int64_t max_top_k);

// A finite softmax_scale > 0.
Status check_softmax_scale(float softmax_scale);

// lse [m, H] f32 on the GPU, contiguous and 4-byte aligned.
Status check_lse(const TensorView& lse, int64_t m, int64_t heads);

// What a launch writes shares no memory with anything else it is given.
Status check_written_disjoint(const std::vector<std::pair<const TensorView*, const char*>>& written,
                              const std::vector<std::pair<const TensorView*, const char*>>& arguments);

}  // namespace dsa
