// The names of the kernels' choices, defined once for every front end (the
// dsa-decode options, the Python package): the first name of each list is
// the default.
//
//   head_gemv sums     tensor-cores | seed-order           (HeadGemvSums)
//   indexer logits     fp32-accumulation | exact           (IndexerLogits)
//   attention plan     auto | batch-invariant              (SparseMlaPlan)
#pragma once

#include <string>
#include <string_view>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/sparse_mla.h"

namespace dsa {

template <class E>
struct Choice {
  E value;
  const char* name;
};

inline constexpr Choice<HeadGemvSums> kHeadGemvSumsChoices[] = {{HeadGemvSums::kTensorCores, "tensor-cores"},
                                                                {HeadGemvSums::kSeedOrder, "seed-order"}};
inline constexpr Choice<IndexerLogits> kIndexerLogitsChoices[] = {
    {IndexerLogits::kFp32Accumulation, "fp32-accumulation"}, {IndexerLogits::kExact, "exact"}};
inline constexpr Choice<SparseMlaPlan> kSparseMlaPlanChoices[] = {{SparseMlaPlan::kAuto, "auto"},
                                                                  {SparseMlaPlan::kBatchInvariant, "batch-invariant"}};

template <class E, size_t N>
const char* choice_name(const Choice<E> (&choices)[N], E value) {
  for (const Choice<E>& c : choices) {
    if (c.value == value) return c.name;
  }
  return "?";
}

// The value named `name` (exact match); false when no choice has that name.
template <class E, size_t N>
bool parse_choice(const Choice<E> (&choices)[N], std::string_view name, E* value) {
  for (const Choice<E>& c : choices) {
    if (name == c.name) {
      *value = c.value;
      return true;
    }
  }
  return false;
}

// "a, b or c": for error messages.
template <class E, size_t N>
std::string choice_list(const Choice<E> (&choices)[N]) {
  std::string list;
  for (size_t i = 0; i < N; ++i) list += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(choices[i].name);
  return list;
}

}  // namespace dsa
