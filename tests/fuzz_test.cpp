// Argument fuzzing of every public entry point's host-side checks (issue 40;
// the RoPE presets' rope_absorb, sparse_mla_v32 and its cache write: issue 39):
// each family builds a valid argument set on fake device addresses, mutates
// 1-3 fields (dtype, a size: 0, 1, huge, negative; a stride: 0, negative,
// not a multiple, overlapping, huge; alignment; null data; an output aliased
// onto an input; ndim; device CPU; a scalar out of range) and calls the
// check. The call must return OK only where an independent predicate (the
// header's rules: shapes that agree, packed dims, row alignment, no
// self-overlap, no overflowing byte span, outputs disjoint from everything)
// allows it, else kInvalidArgument or kUnsupported with a message naming an
// argument of the entry point in quotes ('name'); where the mutation is one
// whose blame is unambiguous (null data, CPU device, ndim, dtype, sub-element
// misalignment of one field) the message names that field. Never a crash or
// an exception. Seeded by testing::test_seed() (DSA_TEST_SEED), printed on
// failure with the case number. CPU tests: Fuzz.*.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dsa_decode/head_gemv.h"
#include "dsa_decode/indexer.h"
#include "dsa_decode/linear.h"
#include "dsa_decode/norm.h"
#include "dsa_decode/presets.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/sparse_mla.h"
#include "dsa_decode/sparse_mla_v32.h"
#include "dsa_decode/stage.h"
#include "dsa_decode/tensor.h"
#include "support.h"

namespace dsa {
namespace {

using Rng = std::mt19937_64;

// A tensor argument and the header's rules for it.
struct FieldSpec {
  std::string name;                 // as the errors name it
  TensorView* view = nullptr;
  std::vector<std::string> dims;    // per dim: a symbol shared with other fields (must agree), a constant, or "*"
  std::vector<DType> dtypes;        // accepted dtypes
  bool optional = false;            // null data accepted
  bool written = false;             // must overlap nothing
  size_t align = 16;                // data alignment in bytes
  int64_t row_align = 16;           // bytes: strides of the outer (non-packed) dims, multiples of this
  int packed = 1;                   // trailing dims packed (strides of a contiguous tensor)
  bool contiguous = false;          // every dim packed
  bool unread = false;              // not read by this entry point: an alias onto it is the caller's business
  std::function<size_t()> align_now;  // where the alignment depends on a scalar argument
  // Whether a size change in dim `d` breaks agreement with other fields or a constant.
  bool fixed(int d) const { return d >= int(dims.size()) || dims[d] != "*"; }
};

// A scalar argument: `mutate` changes it; `bad` says whether its value must be rejected.
struct ScalarSpec {
  std::string name;
  std::function<void(Rng&)> mutate;
  std::function<bool()> bad;
};

struct Case {
  std::string entry;
  std::vector<FieldSpec> fields;
  std::vector<ScalarSpec> scalars;
  std::vector<std::string> names;   // further argument names an error may give
  std::function<Status()> call;
  std::shared_ptr<void> keep;       // the argument structs the views live in
  std::map<std::string, std::vector<std::string>> related;  // a change of key may be blamed on these
  // The call passed its checks when it returns this (the stage: its
  // workspace's cudaMalloc on a machine without a GPU).
  bool ok_or_no_device = false;
};

// Fake device addresses far apart: field i at (i + 1) << 40.
void* fake(int i) { return reinterpret_cast<void*>(uintptr_t(i + 1) << 40); }

TensorView contiguous(int i, DType dtype, const std::vector<int64_t>& shape) {
  TensorView t;
  t.data = fake(i);
  t.dtype = dtype;
  t.ndim = int(shape.size());
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.strides[d] = stride;
    stride *= shape[d];
  }
  t.device = Device{DeviceKind::kCUDA, 0};
  return t;
}

template <class T>
T pick(Rng& rng, std::initializer_list<T> values) {
  std::uniform_int_distribution<size_t> u(0, values.size() - 1);
  return *(values.begin() + u(rng));
}
int64_t uniform(Rng& rng, int64_t low, int64_t high) { return std::uniform_int_distribution<int64_t>(low, high)(rng); }

// ---- the predicate -------------------------------------------------------

// Byte range [begin, end) a view can address; false when it overflows.
bool byte_range(const TensorView& t, __int128* begin, __int128* end) {
  __int128 low = 0, high = 0;
  for (int d = 0; d < std::clamp(t.ndim, 0, kMaxDims); ++d) {
    if (t.shape[d] == 0) {
      *begin = *end = (__int128)reinterpret_cast<uintptr_t>(t.data);
      return true;
    }
    const __int128 reach = (__int128)(t.shape[d] - 1) * t.strides[d];
    (reach < 0 ? low : high) += reach;
  }
  const __int128 size = (__int128)dtype_size(t.dtype);
  *begin = (__int128)reinterpret_cast<uintptr_t>(t.data) + low * size;
  *end = (__int128)reinterpret_cast<uintptr_t>(t.data) + (high + 1) * size;
  return *begin >= 0 && *end <= (__int128)std::numeric_limits<int64_t>::max();
}

bool empty(const TensorView& t) {
  for (int d = 0; d < std::clamp(t.ndim, 0, kMaxDims); ++d) {
    if (t.shape[d] == 0) return true;
  }
  return false;
}

// Whether a field's view breaks the header's rules by itself (its shape's
// agreement with the others is judged by the caller).
std::string field_violation(const FieldSpec& f) {
  const TensorView& t = *f.view;
  if (t.data == nullptr) return f.optional ? "" : "null data";
  if (t.ndim != int(f.dims.size())) return "ndim";
  if (t.device.kind != DeviceKind::kCUDA) return "device";
  if (std::find(f.dtypes.begin(), f.dtypes.end(), t.dtype) == f.dtypes.end()) return "dtype";
  if (reinterpret_cast<uintptr_t>(t.data) % (f.align_now ? f.align_now() : f.align) != 0) return "alignment";
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return "negative size";
  }
  __int128 begin, end;
  if (!byte_range(t, &begin, &end)) return "byte span overflows";
  const int esize = int(dtype_size(t.dtype));
  // Packed trailing dims, then outer strides: positive, aligned rows, not overlapping the inner extent.
  const int first_packed = f.contiguous ? 0 : t.ndim - f.packed;
  int64_t inner = 1;  // elements spanned by dims d+1..
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] > 1) {
      if (d >= first_packed) {
        if (t.strides[d] != inner) return "packed stride";
      } else {
        if (t.strides[d] <= 0) return "non-positive stride";
        if ((__int128)t.strides[d] * esize % f.row_align != 0) return "stride alignment";
        if (t.strides[d] < inner) return "overlapping stride";
      }
    }
    const int64_t stride = t.shape[d] > 1 ? t.strides[d] : inner;
    if (t.shape[d] > 0) inner = int64_t(std::min<__int128>((__int128)(t.shape[d] - 1) * stride + inner, int64_t{1} << 62));
  }
  return "";
}

bool overlapping(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr || empty(a) || empty(b)) return false;
  __int128 a0, a1, b0, b1;
  byte_range(a, &a0, &a1);
  byte_range(b, &b0, &b1);
  return a0 < b1 && b0 < a1;
}

// Every way the case's views break the rules (empty: none the predicate sees).
std::string violation(const Case& c) {
  std::map<std::string, int64_t> symbols;
  for (const FieldSpec& f : c.fields) {
    const std::string v = field_violation(f);
    if (!v.empty()) return f.name + ": " + v;
    const TensorView& t = *f.view;
    if (t.data == nullptr) continue;
    for (size_t d = 0; d < f.dims.size(); ++d) {
      const std::string& s = f.dims[d];
      if (s == "*") continue;
      if (std::isdigit(static_cast<unsigned char>(s[0]))) {
        if (t.shape[d] != std::stoll(s)) return f.name + ": size " + s + " in dim " + std::to_string(d);
        continue;
      }
      auto [it, inserted] = symbols.emplace(s, t.shape[d]);
      if (!inserted && it->second != t.shape[d]) return f.name + ": size " + s + " disagrees";
    }
  }
  for (const ScalarSpec& s : c.scalars) {
    if (s.bad()) return s.name + ": out of range";
  }
  for (const FieldSpec& f : c.fields) {
    if (!f.written) continue;
    for (const FieldSpec& g : c.fields) {
      if (&f != &g && !g.unread && overlapping(*f.view, *g.view)) return f.name + " overlaps " + g.name;
    }
  }
  return "";
}

// ---- mutations -----------------------------------------------------------

struct Mutation {
  std::string what;           // for the failure message
  bool must_reject = false;   // the rules say no, whatever else holds
  std::string blame;          // the field the error must name ("" = any argument)
};

const std::vector<DType> kAllDtypes = {DType::kBF16, DType::kF16, DType::kF32, DType::kFP8E4M3,
                                       DType::kI32,  DType::kI64, DType::kU8};

int64_t huge(Rng& rng) {
  return pick<int64_t>(rng, {int64_t{1} << 31, int64_t{1} << 40, int64_t{1} << 60, int64_t{1} << 62, std::numeric_limits<int64_t>::max(),
                             std::numeric_limits<int64_t>::max() / 2 + 1});
}

Mutation mutate(Case& c, Rng& rng) {
  Mutation m;
  if (!c.scalars.empty() && uniform(rng, 0, 9) == 0) {
    ScalarSpec& s = c.scalars[uniform(rng, 0, int64_t(c.scalars.size()) - 1)];
    m.what = "scalar " + s.name;
    s.mutate(rng);
    return m;
  }
  FieldSpec& f = c.fields[uniform(rng, 0, int64_t(c.fields.size()) - 1)];
  TensorView& t = *f.view;
  if (t.data == nullptr) {  // an absent optional field: only aliasing or nothing
    m.what = f.name + ": absent, untouched";
    return m;
  }
  std::ostringstream what;
  what << f.name << ": ";
  const int kind = int(uniform(rng, 0, 10));
  const int dim = t.ndim > 0 ? int(uniform(rng, 0, std::clamp(t.ndim, 1, kMaxDims) - 1)) : 0;
  switch (kind) {
    case 0: {  // dtype
      const DType d = kAllDtypes[uniform(rng, 0, int64_t(kAllDtypes.size()) - 1)];
      what << "dtype " << dtype_name(t.dtype) << " -> " << dtype_name(d);
      if (std::find(f.dtypes.begin(), f.dtypes.end(), d) == f.dtypes.end()) {
        m.must_reject = true;
        m.blame = f.name;
      }
      t.dtype = d;
      break;
    }
    case 1:
    case 2: {  // a size
      if (t.ndim < 1) break;
      const int64_t v = pick<int64_t>(rng, {0, 1, 2, 3, -1, t.shape[dim] + 1, t.shape[dim] - 1, t.shape[dim] * 2,
                                            huge(rng), std::numeric_limits<int64_t>::min()});
      what << "shape[" << dim << "] " << t.shape[dim] << " -> " << v;
      if (v != t.shape[dim] && f.fixed(dim)) m.must_reject = true;
      if (v < 0) m.must_reject = true;
      t.shape[dim] = v;
      break;
    }
    case 3:
    case 4: {  // a stride
      if (t.ndim < 1) break;
      const int64_t v = pick<int64_t>(rng, {0, -1, -t.strides[dim], t.strides[dim] + 1, t.strides[dim] + 8,
                                            t.strides[dim] + 16, t.strides[dim] * 2, t.strides[dim] / 2, 1, huge(rng),
                                            -huge(rng)});
      what << "stride[" << dim << "] " << t.strides[dim] << " -> " << v;
      t.strides[dim] = v;  // the predicate judges it
      break;
    }
    case 5: {  // alignment
      const int add = int(pick<int64_t>(rng, {1, 2, 4, 8}));
      what << "data + " << add << " bytes";
      t.data = static_cast<char*>(t.data) + add;
      if (add % dtype_size(t.dtype) != 0) m.blame = f.name;
      break;
    }
    case 6: {  // null data
      what << "null data";
      t.data = nullptr;
      if (!f.optional) {
        m.must_reject = true;
        m.blame = f.name;
      }
      break;
    }
    case 7: {  // alias onto another field
      const FieldSpec& g = c.fields[uniform(rng, 0, int64_t(c.fields.size()) - 1)];
      if (&g == &f || g.view->data == nullptr) break;
      what << "data aliased onto " << g.name;
      t.data = g.view->data;
      break;
    }
    case 8: {  // ndim
      const int n = int(pick<int64_t>(rng, {-1, 0, t.ndim - 1, t.ndim + 1, kMaxDims + 1, 100}));
      if (n == t.ndim) break;
      what << "ndim " << t.ndim << " -> " << n;
      if (n > t.ndim && n <= kMaxDims) {
        for (int d = t.ndim; d < n; ++d) {
          t.shape[d] = 1;
          t.strides[d] = 1;
        }
      }
      t.ndim = n;
      m.must_reject = true;
      m.blame = f.name;
      break;
    }
    case 9: {  // device
      what << "on the CPU";
      t.device.kind = DeviceKind::kCPU;
      m.must_reject = true;
      m.blame = f.name;
      break;
    }
    default: {  // empty or huge size with a matching stride
      if (t.ndim < 1) break;
      const int64_t v = uniform(rng, 0, 1) ? 0 : huge(rng);
      what << "shape[" << dim << "] " << t.shape[dim] << " -> " << v << " (huge/empty)";
      if (v != t.shape[dim] && f.fixed(dim)) m.must_reject = true;
      t.shape[dim] = v;
      break;
    }
  }
  m.what = what.str();
  return m;
}

// ---- checking one case ---------------------------------------------------

// The names of "argument '<name>'" in a message (status.h's format), first first.
std::vector<std::string> quoted(const std::string& message) {
  static const std::string kPrefix = "argument '";
  std::vector<std::string> out;
  size_t at = 0;
  while ((at = message.find(kPrefix, at)) != std::string::npos) {
    const size_t open = at + kPrefix.size(), close = message.find('\'', open);
    if (close == std::string::npos) break;
    out.push_back(message.substr(open, close - open));
    at = close + 1;
  }
  return out;
}

// Whether a quoted name refers to argument `name`: "name", "name.x",
// "name[3]", "name (...)" or "x (name.size(0))".
bool names(const std::string& q, const std::string& name) {
  if (q == name) return true;
  if (q.size() > name.size() && q.compare(0, name.size(), name) == 0) {
    const char next = q[name.size()];
    if (next == '.' || next == '[' || next == ' ') return true;
  }
  return q.find("(" + name + ".") != std::string::npos || q.find("(" + name + ")") != std::string::npos;
}

struct Tally {
  int cases = 0, accepted = 0, rejected = 0;
};

void run_case(Case c, Rng& rng, const std::string& label, Tally* tally) {
  SCOPED_TRACE(label + " " + c.entry + " (DSA_TEST_SEED=" + std::to_string(testing::test_seed()) + ")");
  {
    const std::string base_violation = violation(c);
    ASSERT_TRUE(base_violation.empty()) << "fuzzer's valid base breaks its own predicate: " << base_violation;
    const Status base = c.call();
    const bool base_ok = base.ok() || (c.ok_or_no_device && base.code() == ErrorCode::kNoDevice);
    ASSERT_TRUE(base_ok) << "valid base rejected: " << base.to_string();
  }
  const int count = int(uniform(rng, 1, 3));
  std::vector<Mutation> mutations;
  for (int i = 0; i < count; ++i) mutations.push_back(mutate(c, rng));
  std::string description;
  bool must_reject = false;
  std::set<std::string> blames;
  bool strict = count == 1;
  for (const Mutation& m : mutations) {
    description += (description.empty() ? "" : "; ") + m.what;
    if (!m.blame.empty()) blames.insert(m.blame);
  }
  const std::string rule = violation(c);
  must_reject |= !rule.empty();

  Status s;
  try {
    s = c.call();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "exception " << e.what() << " after " << description;
    return;
  } catch (...) {
    ADD_FAILURE() << "unknown exception after " << description;
    return;
  }
  ++tally->cases;
  const bool passed = s.ok() || (c.ok_or_no_device && s.code() == ErrorCode::kNoDevice);
  if (passed) {
    ++tally->accepted;
    EXPECT_FALSE(must_reject) << "accepted after " << description << " (breaks: " << (rule.empty() ? "mutation" : rule)
                              << ")";
    return;
  }
  ++tally->rejected;
  EXPECT_TRUE(s.code() == ErrorCode::kInvalidArgument || s.code() == ErrorCode::kUnsupported)
      << s.to_string() << " after " << description;
  if (s.code() == ErrorCode::kUnsupported) return;  // a layer feature: names the requirement, not an argument
  const std::vector<std::string> q = quoted(s.message());
  ASSERT_FALSE(q.empty()) << "no argument named in '" << s.message() << "' after " << description;
  bool known = false;
  for (const FieldSpec& f : c.fields) known |= names(q[0], f.name);
  for (const ScalarSpec& sc : c.scalars) known |= names(q[0], sc.name);
  for (const std::string& n : c.names) known |= names(q[0], n);
  EXPECT_TRUE(known) << "names '" << q[0] << "', not an argument of " << c.entry << ": " << s.message() << " after "
                     << description;
  if (strict && blames.size() == 1) {
    bool blamed = names(q[0], *blames.begin());
    for (const std::string& r : c.related[*blames.begin()]) blamed |= names(q[0], r);
    EXPECT_TRUE(blamed)
        << "blames '" << q[0] << "' for a change of '" << *blames.begin() << "': " << s.message() << " after "
        << description;
  }
}

// ---- families ------------------------------------------------------------

constexpr DType kBF16 = DType::kBF16, kFP8 = DType::kFP8E4M3, kF32 = DType::kF32, kI32 = DType::kI32,
                kI64 = DType::kI64, kU8 = DType::kU8;

FieldSpec field(std::string name, TensorView* v, std::vector<std::string> dims, std::vector<DType> dtypes) {
  FieldSpec f;
  f.name = std::move(name);
  f.view = v;
  f.dims = std::move(dims);
  f.dtypes = std::move(dtypes);
  return f;
}
FieldSpec scale_field(std::string name, TensorView* v) {
  FieldSpec f = field(std::move(name), v, {"1"}, {kF32});
  f.align = 4;
  f.contiguous = true;
  return f;
}

Case head_gemv_case(Rng& rng) {
  struct Holder {
    HeadGemvArgs a;
    KvCacheWrite w;
  };
  auto h = std::make_shared<Holder>();
  const int64_t m = uniform(rng, 1, kHeadGemvMaxTokens), H = pick<int64_t>(rng, {1, 2, 8, 16, 64, 128}),
                I = 8 * uniform(rng, 1, 96), J = pick<int64_t>(rng, {16, 128, 512});
  const bool fp8 = uniform(rng, 0, 1), cache = uniform(rng, 0, 1);
  HeadGemvArgs& a = h->a;
  a.x = contiguous(0, kBF16, {m, H, I});
  a.weight = contiguous(1, kBF16, {H, I, J});
  a.out = contiguous(2, fp8 ? kFP8 : kBF16, {m, H, J});
  if (fp8) a.scale = contiguous(3, kF32, {1});
  a.sums = uniform(rng, 0, 1) ? HeadGemvSums::kSeedOrder : HeadGemvSums::kTensorCores;
  Case c;
  c.entry = "check_head_gemv";
  c.fields = {field("x", &a.x, {"m", "H", "I"}, {kBF16}), field("weight", &a.weight, {"H", "I", "J"}, {kBF16}),
              field("out", &a.out, {"m", "H", "J"}, {kBF16, kFP8})};
  c.related["out"] = {"scale"};
  c.fields[0].packed = 2;
  c.fields[2].contiguous = true;
  c.fields[2].align = 8;
  c.fields[2].written = true;
  if (fp8) {
    c.fields.push_back(scale_field("scale", &a.scale));
    c.fields.back().optional = true;  // absent with a BF16 out: the "scale (FP8 out)" rule below pairs them
  }
  if (cache) {
    const int64_t width = 8 * uniform(rng, 1, 80), blocks = uniform(rng, 1, 64), block_size = pick<int64_t>(rng, {1, 16, 64});
    h->w.kv = contiguous(4, kBF16, {m, width});
    h->w.cache = contiguous(5, kFP8, {blocks, block_size, width});
    h->w.slot_mapping = contiguous(6, kI64, {uniform(rng, 0, 32)});
    h->w.k_scale = contiguous(7, kF32, {1});
    a.cache = &h->w;
    c.fields.push_back(field("cache.kv", &h->w.kv, {"m", "W"}, {kBF16}));
    c.fields.push_back(field("cache.cache", &h->w.cache, {"*", "*", "W"}, {kFP8}));
    c.fields.back().written = true;
    c.fields.back().align = 8;
    c.fields.back().row_align = 8;
    c.fields.push_back(field("cache.slot_mapping", &h->w.slot_mapping, {"*"}, {kI64}));
    c.fields.back().contiguous = true;
    c.fields.back().align = 8;
    c.fields.push_back(scale_field("cache.k_scale", &h->w.k_scale));
  }
  c.scalars = {{"sums",
                [h](Rng& r) { h->a.sums = static_cast<HeadGemvSums>(int(pick<int64_t>(r, {-1, 0, 1, 2, 1000}))); },
                [h] { return int(h->a.sums) != 0 && int(h->a.sums) != 1; }}};
  // The tensor-core epilogue stores four columns at once (8 bytes); seed order one value.
  c.fields[2].align_now = [h] { return h->a.sums == HeadGemvSums::kTensorCores ? size_t{8} : dtype_size(h->a.out.dtype); };
  c.scalars.push_back({"scale (FP8 out)", [](Rng&) {},
                       [h] { return (h->a.out.dtype == kFP8) != (h->a.scale.data != nullptr); }});
  c.names = {"tactic", "cache.error_count", "scale"};
  c.call = [h] { return check_head_gemv(h->a); };
  c.keep = h;
  return c;
}

Case norm_case(Rng& rng) {
  struct Holder {
    TensorView qkv, qw, kvw, qo, kvo;
    float eps = 1e-6f;
    QkvNormParams p;
  };
  auto h = std::make_shared<Holder>();
  const int64_t m = uniform(rng, 1, 16), kv = 8 * uniform(rng, 1, 64), q = kv + 8 * uniform(rng, 0, 64);
  h->qkv = contiguous(0, kBF16, {m, q + kv});
  h->qw = contiguous(1, kBF16, {q});
  h->kvw = contiguous(2, kBF16, {kv});
  h->qo = contiguous(3, kBF16, {m, q});
  h->kvo = contiguous(4, kBF16, {m, kv});
  Case c;
  c.entry = "make_qkv_norm_params";
  // qkv's width is q + kv: a symbol of its own that the predicate cannot
  // relate to q and kv, so a change of it, or of q or kv alone, is judged by
  // the shapes disagreeing elsewhere.
  c.fields = {field("qkv", &h->qkv, {"m", "QKV"}, {kBF16}), field("q_weight", &h->qw, {"Q"}, {kBF16}),
              field("kv_weight", &h->kvw, {"KV"}, {kBF16}), field("q_out", &h->qo, {"m", "Q"}, {kBF16}),
              field("kv_out", &h->kvo, {"m", "KV"}, {kBF16})};
  for (int i = 1; i < 5; ++i) c.fields[i].contiguous = true;
  c.fields[3].written = c.fields[4].written = true;
  c.scalars = {{"eps",
                [h](Rng& r) { h->eps = float(pick<double>(r, {-1.0, 0.0, 1e-5, NAN, INFINITY, -INFINITY, 1e30})); },
                [h] { return !(std::isfinite(h->eps) && h->eps >= 0); }}};
  c.names = {"m", "q_size", "kv_size", "qkv_row_pitch"};
  c.call = [h] { return make_qkv_norm_params(h->qkv, h->qw, h->kvw, h->eps, h->qo, h->kvo, &h->p); };
  c.keep = h;
  return c;
}

Case linear_case(Rng& rng) {
  auto h = std::make_shared<LinearGemvArgs>();
  const int64_t m = uniform(rng, 1, kLinearGemvMaxTokens), k = 8 * uniform(rng, 1, 512), n = uniform(rng, 1, 4096);
  h->x = contiguous(0, kBF16, {m, k});
  h->weight = contiguous(1, kBF16, {n, k});
  h->out = contiguous(2, kBF16, {m, n});
  Case c;
  c.entry = "check_linear_gemv";
  c.fields = {field("x", &h->x, {"m", "K"}, {kBF16}), field("weight", &h->weight, {"N", "K"}, {kBF16}),
              field("out", &h->out, {"m", "N"}, {kBF16})};
  c.fields[2].written = true;
  c.fields[2].align = 2;
  c.fields[2].row_align = 2;
  c.call = [h] { return check_linear_gemv(*h); };
  c.keep = h;
  return c;
}

Case sparse_mla_case(Rng& rng) {
  auto h = std::make_shared<SparseMlaArgs>();
  const int64_t m = uniform(rng, 1, 64), H = pick<int64_t>(rng, {1, 8, 16, 64, 128}), K = pick<int64_t>(rng, {1, 64, 2048, 2176}),
                blocks = uniform(rng, 1, 100), block_size = pick<int64_t>(rng, {1, 64, 256});
  SparseMlaArgs& a = *h;
  a.q = contiguous(0, kFP8, {m, H, 512});
  a.q_scale = contiguous(1, kF32, {1});
  a.kv_cache = contiguous(2, kFP8, {blocks, block_size, 512});
  a.k_scale = contiguous(3, kF32, {1});
  a.indices = contiguous(4, kI32, {m, K});
  a.softmax_scale = 0.0625f;
  a.latent = contiguous(5, kBF16, {m, H, 512});
  a.lse = contiguous(6, kF32, {m, H});
  a.split_counters = contiguous(7, kI32, {sparse_mla_split_counter_count(m, H, K) + uniform(rng, 0, 3)});
  const int64_t partials = sparse_mla_split_partials_count(m, H, K);
  a.split_partials = contiguous(8, kF32, {partials + uniform(rng, 0, 3)});
  a.plan = uniform(rng, 0, 1) ? SparseMlaPlan::kBatchInvariant : SparseMlaPlan::kAuto;
  Case c;
  c.entry = "check_sparse_mla";
  c.fields = {field("q", &a.q, {"m", "H", "512"}, {kFP8}),
              scale_field("q_scale", &a.q_scale),
              field("kv_cache", &a.kv_cache, {"*", "*", "512"}, {kFP8}),
              scale_field("k_scale", &a.k_scale),
              field("indices", &a.indices, {"m", "*"}, {kI32}),
              field("latent", &a.latent, {"m", "H", "512"}, {kBF16}),
              field("lse", &a.lse, {"m", "H"}, {kF32}),
              field("split_counters", &a.split_counters, {"*"}, {kI32}),
              field("split_partials", &a.split_partials, {"*"}, {kF32})};
  c.fields[4].align = 4;
  c.fields[4].row_align = 4;
  c.fields[5].packed = 2;
  for (int i : {5, 6, 7, 8}) c.fields[i].written = true;
  c.fields[6].contiguous = true;
  c.fields[6].align = 4;
  c.fields[7].contiguous = true;
  c.fields[7].align = 4;
  c.fields[8].contiguous = true;
  c.fields[8].optional = partials == 0;
  c.scalars = {{"softmax_scale",
                [h](Rng& r) { h->softmax_scale = float(pick<double>(r, {-1.0, 0.0, 0.5, NAN, INFINITY, 1e-30})); },
                [h] { return !(std::isfinite(h->softmax_scale) && h->softmax_scale > 0); }},
               {"plan", [h](Rng& r) { h->plan = static_cast<SparseMlaPlan>(int(pick<int64_t>(r, {-1, 0, 1, 2, 77}))); },
                [h] { return int(h->plan) != 0 && int(h->plan) != 1; }}};
  c.names = {"error_count"};
  c.call = [h] { return check_sparse_mla(*h); };
  c.keep = h;
  return c;
}

// The 656-byte V3.2 cache [blocks, block_size, 656] (u8 or FP8 bytes): entry
// and block strides multiples of 16, not overlapping.
FieldSpec v32_cache_field(TensorView* v) {
  FieldSpec f = field("kv_cache", v, {"*", "*", "656"}, {kU8, kFP8});
  f.row_align = 16;
  return f;
}

// [m, W] BF16 token rows: dim 1 contiguous, token stride a multiple of 8, 16 B aligned.
FieldSpec bf16_rows(std::string name, TensorView* v, std::vector<std::string> dims) {
  FieldSpec f = field(std::move(name), v, std::move(dims), {kBF16});
  f.row_align = 16;
  return f;
}

Case sparse_mla_v32_case(Rng& rng) {
  auto h = std::make_shared<SparseMlaV32Args>();
  const int64_t m = pick<int64_t>(rng, {1, 2, 3, 16, 64, 128}), H = pick<int64_t>(rng, {1, 16, 24, 64, 128}),
                K = pick<int64_t>(rng, {1, 100, 2048, 16384}), blocks = uniform(rng, 1, 100),
                block_size = pick<int64_t>(rng, {1, 16, 64, 256});
  SparseMlaV32Args& a = *h;
  a.q = contiguous(0, kBF16, {m, H, 576});
  a.kv_cache = contiguous(1, uniform(rng, 0, 1) ? kU8 : kFP8, {blocks, block_size, 656});
  a.indices = contiguous(2, kI32, {m, K});
  a.softmax_scale = 0.1352338f;
  a.latent = contiguous(3, kBF16, {m, H, 512});
  a.lse = contiguous(4, kF32, {m, H});
  if (uniform(rng, 0, 2) == 0) {  // vLLM's q with padded heads, a padded latent row
    a.q.strides[1] = 640;
    a.q.strides[0] = H * 640;
    a.latent.strides[0] = H * 512 + 64;
  }
  Case c;
  c.entry = "check_sparse_mla_v32";
  c.fields = {bf16_rows("q", &a.q, {"m", "H", "576"}), v32_cache_field(&a.kv_cache),
              field("indices", &a.indices, {"m", "*"}, {kI32}), bf16_rows("latent", &a.latent, {"m", "H", "512"}),
              field("lse", &a.lse, {"m", "H"}, {kF32})};
  c.fields[2].align = 4;
  c.fields[2].row_align = 4;
  c.fields[3].packed = 2;
  c.fields[3].written = c.fields[4].written = true;
  c.fields[4].contiguous = true;
  c.fields[4].align = 4;
  c.scalars = {{"softmax_scale",
                [h](Rng& r) { h->softmax_scale = float(pick<double>(r, {-1.0, 0.0, 0.5, NAN, INFINITY, -INFINITY, 1e-30})); },
                [h] { return !(std::isfinite(h->softmax_scale) && h->softmax_scale > 0); }}};
  c.names = {"error_count"};
  c.call = [h] { return check_sparse_mla_v32(*h); };
  c.keep = h;
  return c;
}

Case sparse_mla_v32_cache_write_case(Rng& rng) {
  auto h = std::make_shared<SparseMlaV32CacheWriteArgs>();
  const int64_t m = pick<int64_t>(rng, {1, 2, 7, 16, 1000}), blocks = uniform(rng, 1, 100),
                block_size = pick<int64_t>(rng, {1, 16, 64}), n = pick<int64_t>(rng, {1, m, m + 3});
  SparseMlaV32CacheWriteArgs& a = *h;
  a.kv_c = contiguous(0, kBF16, {m, 512});
  a.k_pe = contiguous(1, kBF16, {m, 64});
  if (uniform(rng, 0, 1)) {  // views into kv_a [m, 576]
    a.kv_c.strides[0] = 576;
    a.k_pe.strides[0] = 576;
  }
  a.slot_mapping = contiguous(2, kI64, {n});
  a.kv_cache = contiguous(3, uniform(rng, 0, 1) ? kU8 : kFP8, {blocks, block_size, 656});
  if (uniform(rng, 0, 2) == 0) {  // padded entries and blocks
    a.kv_cache.strides[1] = 672;
    a.kv_cache.strides[0] = block_size * 672 + 256;
  }
  Case c;
  c.entry = "check_sparse_mla_v32_cache_write";
  c.fields = {bf16_rows("kv_c", &a.kv_c, {"m", "512"}), bf16_rows("k_pe", &a.k_pe, {"m", "64"}),
              field("slot_mapping", &a.slot_mapping, {"*"}, {kI64}), v32_cache_field(&a.kv_cache)};
  c.fields[2].contiguous = true;
  c.fields[2].align = 8;
  c.fields[3].written = true;
  c.names = {"error_count"};
  c.call = [h] { return check_sparse_mla_v32_cache_write(*h); };
  c.keep = h;
  return c;
}

Case rope_absorb_case(Rng& rng) {
  auto h = std::make_shared<RopeAbsorbArgs>();
  const int64_t m = uniform(rng, 1, 16), H = pick<int64_t>(rng, {1, 8, 16, 64, 128}),
                P = pick<int64_t>(rng, {64, 128, 192, 1024}), L = pick<int64_t>(rng, {16, 128, 512}),
                R = pick<int64_t>(rng, {16, 32, 64, 128, 256}), rows = pick<int64_t>(rng, {1, 4096, 163840});
  RopeAbsorbArgs& a = *h;
  a.q_nope = contiguous(0, kBF16, {m, H, P});
  a.q_pe = contiguous(1, kBF16, {m, H, R});
  if (uniform(rng, 0, 1)) {  // views into vLLM's q [m, H, P + R]
    a.q_pe.data = static_cast<char*>(a.q_nope.data) + 2 * P;
    a.q_nope.strides[1] = a.q_pe.strides[1] = P + R;
    a.q_nope.strides[0] = a.q_pe.strides[0] = H * (P + R);
  }
  a.k_pe = contiguous(2, kBF16, {m, R});
  a.positions = contiguous(3, kI64, {m + uniform(rng, 0, 3)});
  a.cos_sin = contiguous(4, uniform(rng, 0, 1) ? kF32 : kBF16, {rows, R});
  a.weight = contiguous(5, kBF16, {H, P, L});
  a.out = contiguous(6, kBF16, {m, H, L + R});
  a.k_pe_out = contiguous(7, kBF16, {m, R});
  a.style = uniform(rng, 0, 1) ? RopeStyle::kHalfSplit : RopeStyle::kInterleaved;
  Case c;
  c.entry = "check_rope_absorb";
  c.fields = {bf16_rows("q_nope", &a.q_nope, {"m", "H", "P"}),
              bf16_rows("q_pe", &a.q_pe, {"m", "H", "R"}),
              bf16_rows("k_pe", &a.k_pe, {"m", "R"}),
              field("positions", &a.positions, {"*"}, {kI64}),
              field("cos_sin", &a.cos_sin, {"*", "R"}, {kF32, kBF16}),
              bf16_rows("weight", &a.weight, {"H", "P", "L"}),
              field("out", &a.out, {"m", "H", "*"}, {kBF16}),
              bf16_rows("k_pe_out", &a.k_pe_out, {"m", "R"})};
  c.fields[3].contiguous = true;
  c.fields[3].align = 8;
  c.fields[4].row_align = 16;
  c.fields[6].contiguous = true;
  c.fields[6].written = c.fields[7].written = true;
  c.related["out"] = {"weight", "q_pe"};  // its width is L + R
  c.scalars = {{"style",
                [h](Rng& r) { h->style = static_cast<RopeStyle>(int(pick<int64_t>(r, {-1, 0, 1, 2, 99}))); },
                [h] { return int(h->style) != 0 && int(h->style) != 1; }}};
  c.names = {"error_count"};
  c.call = [h] { return check_rope_absorb(*h); };
  c.keep = h;
  return c;
}

// The indexer's plan and state, shared by its five entry points.
struct IndexerBase {
  IndexerPlan plan;
  IndexerState state;
};

void indexer_state(Rng& rng, IndexerBase* b, int first) {
  b->plan.max_tokens = int(uniform(rng, 1, kIndexerMaxTokens));
  b->plan.max_context = pick<int64_t>(rng, {1, 2048, 131072});
  b->plan.ring = int(pick<int64_t>(rng, {4, 8}));
  b->plan.block_size = int(pick<int64_t>(rng, {128, 256}));
  b->plan.logits = uniform(rng, 0, 1) ? IndexerLogits::kExact : IndexerLogits::kFp32Accumulation;
  const int64_t requests = uniform(rng, 1, 8), width = uniform(rng, 1, 64), blocks = uniform(rng, 1, 256);
  b->state.block_table = contiguous(first, kI32, {requests, width});
  b->state.ring = contiguous(first + 1, kBF16, {requests, 2, b->plan.ring, 128});
  b->state.k_cache = contiguous(first + 2, kU8, {blocks, b->plan.block_size / 4 * 132});
}

void add_state_fields(Case& c, IndexerBase* b, bool written) {
  const std::string ring = std::to_string(b->plan.ring), page = std::to_string(b->plan.block_size / 4 * 132);
  c.fields.push_back(field("block_table", &b->state.block_table, {"R", "*"}, {kI32}));
  c.fields.back().align = 4;
  c.fields.back().row_align = 4;
  c.fields.push_back(field("ring", &b->state.ring, {"R", "2", ring, "128"}, {kBF16}));
  c.fields.back().packed = 3;
  c.fields.back().written = written;
  c.fields.push_back(field("k_cache", &b->state.k_cache, {"*", page}, {kU8}));
  c.fields.back().written = written;
}

void add_plan_scalars(Case& c, IndexerPlan* plan, std::function<bool()> state_agrees) {
  c.scalars.push_back({"plan.ring", [plan](Rng& r) { plan->ring = int(pick<int64_t>(r, {0, 3, 4, 8, 16, -4})); },
                       [plan, state_agrees] { return !state_agrees(); }});
  c.scalars.push_back({"plan.max_tokens", [plan](Rng& r) { plan->max_tokens = int(pick<int64_t>(r, {-1, 0, 17, 1 << 30})); },
                       [plan] { return plan->max_tokens < 1 || plan->max_tokens > kIndexerMaxTokens; }});
  c.scalars.push_back({"plan.max_context",
                       [plan](Rng& r) { plan->max_context = pick<int64_t>(r, {-1, 0, kIndexerMaxContext + 1, int64_t{1} << 62}); },
                       [plan] { return plan->max_context < 1 || plan->max_context > kIndexerMaxContext; }});
  c.scalars.push_back({"plan.block_size",
                       [plan](Rng& r) { plan->block_size = int(pick<int64_t>(r, {-128, 0, 64, 129, 384, 1 << 30})); },
                       [plan, state_agrees] { return plan->block_size < 128 || plan->block_size % 128 != 0 || !state_agrees(); }});
  c.scalars.push_back({"plan.logits", [plan](Rng& r) { plan->logits = static_cast<IndexerLogits>(int(pick<int64_t>(r, {-1, 2, 99}))); },
                       [plan] { return int(plan->logits) != 0 && int(plan->logits) != 1; }});
}

FieldSpec rows(std::string name, TensorView* v, std::vector<std::string> dims, DType dtype) {
  FieldSpec f = field(std::move(name), v, std::move(dims), {dtype});
  return f;
}
FieldSpec vector_field(std::string name, TensorView* v, DType dtype) {
  FieldSpec f = field(std::move(name), v, {"m"}, {dtype});
  f.contiguous = true;
  f.align = dtype_size(dtype);
  return f;
}
FieldSpec parameter(std::string name, TensorView* v, std::vector<std::string> dims) {
  FieldSpec f = field(std::move(name), v, std::move(dims), {kF32});
  f.contiguous = true;
  f.align = 4;
  return f;
}

Case indexer_prepare_case(Rng& rng) {
  struct Holder : IndexerBase {
    IndexerPrepareArgs a;
  };
  auto h = std::make_shared<Holder>();
  indexer_state(rng, h.get(), 10);
  IndexerPrepareArgs& a = h->a;
  const int64_t m = uniform(rng, 1, h->plan.max_tokens);
  a.index_q = contiguous(0, kBF16, {m, 32, 128});
  a.index_k = contiguous(1, kBF16, {m, 128});
  a.head_weights = contiguous(2, kF32, {m, 32});
  a.gate = contiguous(3, kBF16, {m, 128});
  a.k_norm_weight = contiguous(4, kF32, {128});
  a.k_norm_bias = contiguous(5, kF32, {128});
  a.ape = contiguous(6, kF32, {4, 128});
  a.positions = contiguous(7, kI64, {m});
  a.token_requests = contiguous(8, kI32, {m});
  a.workspace = contiguous(9, kU8, {indexer_workspace_layout(h->plan).bytes + uniform(rng, 0, 1000)});
  Case c;
  c.entry = "check_indexer_prepare";
  c.fields = {rows("index_q", &a.index_q, {"m", "32", "128"}, kBF16),
              rows("index_k", &a.index_k, {"m", "128"}, kBF16),
              rows("head_weights", &a.head_weights, {"m", "32"}, kF32),
              rows("gate", &a.gate, {"m", "128"}, kBF16),
              parameter("k_norm_weight", &a.k_norm_weight, {"128"}),
              parameter("k_norm_bias", &a.k_norm_bias, {"128"}),
              parameter("ape", &a.ape, {"4", "128"}),
              vector_field("positions", &a.positions, kI64),
              vector_field("token_requests", &a.token_requests, kI32),
              field("workspace", &a.workspace, {"*"}, {kU8})};
  c.fields[0].packed = 2;
  c.fields.back().align = 256;
  c.fields.back().written = true;
  add_state_fields(c, h.get(), true);
  add_plan_scalars(c, &h->plan, [b = static_cast<IndexerBase*>(h.get())] {
    return b->state.ring.ndim == 4 && b->state.ring.shape[2] == b->plan.ring && b->state.k_cache.ndim == 2 &&
           b->state.k_cache.shape[1] == int64_t(b->plan.block_size) / 4 * 132;
  });
  c.names = {"error_count"};
  c.call = [h] {
    h->a.plan = h->plan;
    h->a.state = h->state;
    return check_indexer_prepare(h->a);
  };
  c.keep = h;
  return c;
}

FieldSpec row_out(std::string name, TensorView* v, bool written) {
  FieldSpec f = field(std::move(name), v, {"m", "2176"}, {kI32});
  f.written = written;
  return f;
}

Case indexer_select_case(Rng& rng, bool remap) {
  struct Holder : IndexerBase {
    IndexerSelectArgs s;
    IndexerRemapArgs r;
  };
  auto h = std::make_shared<Holder>();
  indexer_state(rng, h.get(), 10);
  const int64_t m = uniform(rng, 1, h->plan.max_tokens);
  TensorView positions = contiguous(0, kI64, {m}), requests = contiguous(1, kI32, {m});
  Case c;
  if (!remap) {
    IndexerSelectArgs& a = h->s;
    a.positions = positions;
    a.token_requests = requests;
    a.workspace = contiguous(2, kU8, {indexer_workspace_layout(h->plan).bytes});
    if (uniform(rng, 0, 1)) a.topk_positions = contiguous(3, kI32, {m, kIndexerRowWidth});
    a.slots = contiguous(4, kI32, {m, kIndexerRowWidth});
    c.entry = "check_indexer_select";
    c.fields = {vector_field("positions", &a.positions, kI64), vector_field("token_requests", &a.token_requests, kI32),
                field("workspace", &a.workspace, {"*"}, {kU8}), row_out("topk_positions", &a.topk_positions, true),
                row_out("slots", &a.slots, true)};
    c.fields[2].align = 256;
    c.fields[2].written = true;
    c.fields[3].optional = true;
    add_state_fields(c, h.get(), false);
    c.call = [h] {
      h->s.plan = h->plan;
      h->s.state = h->state;
      return check_indexer_select(h->s);
    };
  } else {
    IndexerRemapArgs& a = h->r;
    a.positions = positions;
    a.token_requests = requests;
    a.topk_positions = contiguous(3, kI32, {m, kIndexerRowWidth});
    a.slots = contiguous(4, kI32, {m, kIndexerRowWidth});
    c.entry = "check_indexer_remap";
    c.fields = {vector_field("positions", &a.positions, kI64), vector_field("token_requests", &a.token_requests, kI32),
                row_out("topk_positions", &a.topk_positions, false), row_out("slots", &a.slots, true)};
    add_state_fields(c, h.get(), false);
    // remap does not read the ring (its check leaves it out).
    c.fields[c.fields.size() - 2].unread = true;
    c.call = [h] {
      h->r.plan = h->plan;
      h->r.state = h->state;
      return check_indexer_remap(h->r);
    };
  }
  add_plan_scalars(c, &h->plan, [b = static_cast<IndexerBase*>(h.get())] {
    return b->state.ring.ndim == 4 && b->state.ring.shape[2] == b->plan.ring && b->state.k_cache.ndim == 2 &&
           b->state.k_cache.shape[1] == int64_t(b->plan.block_size) / 4 * 132;
  });
  c.names = {"error_count"};
  c.keep = h;
  return c;
}

Case indexer_prefill_case(Rng& rng) {
  struct Holder : IndexerBase {
    IndexerPrefillArgs a;
  };
  auto h = std::make_shared<Holder>();
  indexer_state(rng, h.get(), 10);
  IndexerPrefillArgs& a = h->a;
  const int64_t width = h->state.block_table.shape[1];
  const int64_t n = uniform(rng, 1, std::min<int64_t>(h->plan.max_context, width * h->plan.block_size));
  a.index_k = contiguous(0, kBF16, {n, 128});
  a.gate = contiguous(1, kBF16, {n, 128});
  a.k_norm_weight = contiguous(4, kF32, {128});
  a.k_norm_bias = contiguous(5, kF32, {128});
  a.ape = contiguous(6, kF32, {4, 128});
  a.request = int(uniform(rng, 0, h->state.block_table.shape[0] - 1));
  Case c;
  c.entry = "check_indexer_prefill";
  // n is bounded by max_context and the table's width: "*" for the predicate.
  c.fields = {rows("index_k", &a.index_k, {"n", "128"}, kBF16), rows("gate", &a.gate, {"n", "128"}, kBF16),
              parameter("k_norm_weight", &a.k_norm_weight, {"128"}),
              parameter("k_norm_bias", &a.k_norm_bias, {"128"}), parameter("ape", &a.ape, {"4", "128"})};
  add_state_fields(c, h.get(), true);
  add_plan_scalars(c, &h->plan, [b = static_cast<IndexerBase*>(h.get())] {
    return b->state.ring.ndim == 4 && b->state.ring.shape[2] == b->plan.ring && b->state.k_cache.ndim == 2 &&
           b->state.k_cache.shape[1] == int64_t(b->plan.block_size) / 4 * 132;
  });
  c.scalars.push_back({"request",
                       [h](Rng& r) {
                         const int64_t requests = h->state.block_table.shape[0];
                         h->a.request = int(pick<int64_t>(r, {-1, requests, requests + 100, INT32_MIN, INT32_MAX, 0}));
                       },
                       [h] { return h->a.request < 0 || h->a.request >= h->state.block_table.shape[0]; }});
  c.names = {"error_count"};
  c.call = [h] {
    h->a.plan = h->plan;
    h->a.state = h->state;
    return check_indexer_prefill(h->a);
  };
  c.keep = h;
  return c;
}

Case indexer_project_case(Rng& rng, bool gemv) {
  auto h = std::make_shared<IndexerProjectArgs>();
  IndexerProjectArgs& a = *h;
  a.plan.max_tokens = int(uniform(rng, 1, 16));
  const int64_t m = uniform(rng, 1, a.plan.max_tokens), Q = 8 * uniform(rng, 1, 256), D = 8 * uniform(rng, 1, 768);
  a.q_c = contiguous(0, kBF16, {m, Q});
  a.x = contiguous(1, kBF16, {m, D});
  a.wq_b = contiguous(2, kBF16, {4096, Q});
  a.wk = contiguous(3, kBF16, {128, D});
  a.weights_proj = contiguous(4, kBF16, {32, D});
  a.compress_gate = contiguous(5, kBF16, {128, D});
  a.index_q = contiguous(6, kBF16, {m, 32, 128});
  a.index_k = contiguous(7, kBF16, {m, 128});
  a.head_weights = contiguous(8, kF32, {m, 32});
  a.gate = contiguous(9, kBF16, {m, 128});
  Case c;
  c.entry = gemv ? "check_indexer_project_gemv" : "check_indexer_project";
  c.fields = {rows("q_c", &a.q_c, {"m", "Q"}, kBF16),
              rows("x", &a.x, {"m", "D"}, kBF16),
              rows("wq_b", &a.wq_b, {"4096", "Q"}, kBF16),
              rows("wk", &a.wk, {"128", "D"}, kBF16),
              rows("weights_proj", &a.weights_proj, {"32", "D"}, kBF16),
              rows("compress_gate", &a.compress_gate, {"128", "D"}, kBF16),
              rows("index_q", &a.index_q, {"m", "32", "128"}, kBF16),
              rows("index_k", &a.index_k, {"m", "128"}, kBF16),
              rows("head_weights", &a.head_weights, {"m", "32"}, kF32),
              rows("gate", &a.gate, {"m", "128"}, kBF16)};
  c.fields[6].packed = 2;
  for (int i = 6; i < 10; ++i) c.fields[i].written = true;
  add_plan_scalars(c, &a.plan, [] { return true; });
  c.call = [h, gemv] { return gemv ? check_indexer_project_gemv(*h) : check_indexer_project(*h); };
  c.keep = h;
  return c;
}

// DsaAttentionStage::create on fake weight views: valid ones reach the
// workspace's cudaMalloc, which on this machine reports no device.
Case stage_case(Rng& rng) {
  struct Holder {
    DsaLayerConfig config;
    DsaLayerWeights w;
    DsaStagePlan plan;
  };
  auto h = std::make_shared<Holder>();
  ModelPreset preset;
  EXPECT_TRUE(find_preset("glm5next", &preset).ok());
  ModelPreset rank;
  const int tp = int(pick<int64_t>(rng, {1, 2, 4, 8}));
  EXPECT_TRUE(per_rank(preset, tp, &rank).ok());
  h->config = dsa_layer_config(rank, 1e-6f);
  const int64_t D = h->config.hidden_size, H = h->config.num_heads, Q = h->config.q_lora_rank,
                L = h->config.kv_lora_rank, P = h->config.qk_nope_head_dim, V = h->config.v_head_dim;
  // A valid indexer shape of the plan's (heads, pool, top-k, RING of one or S + 1 tokens a request).
  const int64_t HI = pick<int64_t>(rng, {16, 32, 64}), S = pick<int64_t>(rng, {4, 8, 16});
  h->plan.indexer_heads = int(HI);
  h->plan.indexer_pool = int(S);
  h->plan.indexer_topk = int(S * uniform(rng, 1, kIndexerMaxTopPools));
  h->plan.ring = int(S * pick<int64_t>(rng, {1, 2}));
  DsaLayerWeights& w = h->w;
  w.fused_qkv_a_proj = contiguous(0, kBF16, {Q + L, D});
  w.q_a_norm = contiguous(1, kBF16, {Q});
  w.kv_a_norm = contiguous(2, kBF16, {L});
  w.q_b_proj = contiguous(3, kBF16, {H * P, Q});
  w.w_uk_t = contiguous(4, kBF16, {H, P, L});
  w.w_uv = contiguous(5, kBF16, {H, L, V});
  w.o_proj = contiguous(6, kBF16, {D, H * V});
  w.q_scale = contiguous(7, kF32, {1});
  w.k_scale = contiguous(8, kF32, {1});
  w.index_wq_b = contiguous(9, kBF16, {HI * 128, Q});
  w.index_wk = contiguous(10, kBF16, {128, D});
  w.index_weights_proj = contiguous(11, kBF16, {HI, D});
  w.index_compress_gate = contiguous(12, kBF16, {128, D});
  w.index_k_norm_weight = contiguous(13, kF32, {128});
  w.index_k_norm_bias = contiguous(14, kF32, {128});
  w.index_ape = contiguous(15, kF32, {S, 128});
  h->plan.max_tokens = int(uniform(rng, 1, 16));
  h->plan.batch_invariant = uniform(rng, 0, 1);
  const std::string d = std::to_string(D), q = std::to_string(Q), l = std::to_string(L), qkv = std::to_string(Q + L),
                    hs = std::to_string(H), hp = std::to_string(H * P), p = std::to_string(P), v = std::to_string(V),
                    hv = std::to_string(H * V);
  Case c;
  c.entry = "DsaAttentionStage::create";
  auto weight = [&](const char* name, TensorView* t, std::vector<std::string> dims, DType dtype, size_t align = 16) {
    FieldSpec f = field(name, t, std::move(dims), {dtype});
    f.align = align;
    c.fields.push_back(f);
  };
  weight("fused_qkv_a_proj", &w.fused_qkv_a_proj, {qkv, d}, kBF16);
  weight("q_a_norm", &w.q_a_norm, {q}, kBF16);
  weight("kv_a_norm", &w.kv_a_norm, {l}, kBF16);
  weight("q_b_proj", &w.q_b_proj, {hp, q}, kBF16);
  weight("w_uk_t", &w.w_uk_t, {hs, p, l}, kBF16);
  weight("w_uv", &w.w_uv, {hs, l, v}, kBF16);
  weight("o_proj", &w.o_proj, {d, hv}, kBF16);
  weight("q_scale", &w.q_scale, {"1"}, kF32, 4);
  weight("k_scale", &w.k_scale, {"1"}, kF32, 4);
  weight("index_wq_b", &w.index_wq_b, {std::to_string(HI * 128), q}, kBF16);
  weight("index_wk", &w.index_wk, {"128", d}, kBF16);
  weight("index_weights_proj", &w.index_weights_proj, {std::to_string(HI), d}, kBF16);
  weight("index_compress_gate", &w.index_compress_gate, {"128", d}, kBF16);
  weight("index_k_norm_weight", &w.index_k_norm_weight, {"128"}, kF32, 4);
  weight("index_k_norm_bias", &w.index_k_norm_bias, {"128"}, kF32, 4);
  weight("index_ape", &w.index_ape, {std::to_string(S), "128"}, kF32, 4);
  for (FieldSpec& f : c.fields) {
    if (f.dims.size() == 1) f.contiguous = true;
    if (f.name == "index_ape") f.contiguous = true;  // a parameter, contiguous as the indexer takes it
  }
  c.scalars = {{"plan.max_tokens", [h](Rng& r) { h->plan.max_tokens = int(pick<int64_t>(r, {-1, 0, 17, 1 << 30})); },
                [h] { return h->plan.max_tokens < 1 || h->plan.max_tokens > 16; }},
               {"plan.ring", [h](Rng& r) { h->plan.ring = int(pick<int64_t>(r, {0, 3, 12, 64})); },
                [h] { return h->plan.ring != h->plan.indexer_pool && h->plan.ring != 2 * h->plan.indexer_pool; }},
               {"plan.indexer_heads", [h](Rng& r) { h->plan.indexer_heads = int(pick<int64_t>(r, {0, -32, 8, 48, 128})); },
                [h] { return h->plan.indexer_heads != 16 && h->plan.indexer_heads != 32 && h->plan.indexer_heads != 64; }},
               {"plan.indexer_pool", [h](Rng& r) { h->plan.indexer_pool = int(pick<int64_t>(r, {0, -4, 1, 2, 6, 32})); },
                [h] { return h->plan.indexer_pool != 4 && h->plan.indexer_pool != 8 && h->plan.indexer_pool != 16; }},
               {"plan.indexer_topk",
                [h](Rng& r) {
                  const int S = h->plan.indexer_pool;
                  h->plan.indexer_topk = int(pick<int64_t>(r, {0, -S, S - 1, S + 1, int64_t{S} * (kIndexerMaxTopPools + 1)}));
                },
                [h] {
                  const int S = h->plan.indexer_pool, K = h->plan.indexer_topk;
                  return K < S || K % S != 0 || K / S > kIndexerMaxTopPools;
                }},
               {"plan.block_size", [h](Rng& r) { h->plan.block_size = int(pick<int64_t>(r, {0, 100, -256})); },
                [h] { return h->plan.block_size < 128 || h->plan.block_size % 128 != 0; }},
               {"plan.max_context", [h](Rng& r) { h->plan.max_context = pick<int64_t>(r, {0, -5, int64_t{1} << 40}); },
                [h] { return h->plan.max_context < 1 || h->plan.max_context > kIndexerMaxContext; }}};
  c.names = {"plan", "workspace"};
  c.ok_or_no_device = true;
  c.call = [h] {
    std::unique_ptr<DsaAttentionStage> stage;
    return DsaAttentionStage::create(h->config, h->w, h->plan, &stage);
  };
  c.keep = h;
  return c;
}

struct Family {
  const char* name;
  std::function<Case(Rng&)> make;
  int cases;
};

std::vector<Family> families() {
  return {{"head_gemv", head_gemv_case, 800},
          {"qkv_norm", norm_case, 500},
          {"linear_gemv", linear_case, 400},
          {"sparse_mla", sparse_mla_case, 800},
          {"indexer_prepare", indexer_prepare_case, 400},
          {"indexer_select", [](Rng& r) { return indexer_select_case(r, false); }, 300},
          {"indexer_remap", [](Rng& r) { return indexer_select_case(r, true); }, 300},
          {"indexer_prefill", indexer_prefill_case, 300},
          {"indexer_project", [](Rng& r) { return indexer_project_case(r, false); }, 300},
          {"indexer_project_gemv", [](Rng& r) { return indexer_project_case(r, true); }, 300},
          {"sparse_mla_v32", sparse_mla_v32_case, 800},
          {"sparse_mla_v32_cache_write", sparse_mla_v32_cache_write_case, 400},
          {"rope_absorb", rope_absorb_case, 600}};
}

// Cases per family = its count x this (about 23,000 in all, well under a second here).
constexpr int kCaseScale = 5;

void fuzz_family(const Family& family, uint64_t salt) {
  Rng rng(testing::test_seed() ^ salt);
  Tally tally;
  const int n = testing::quick_mode() ? family.cases : family.cases * kCaseScale;
  for (int i = 0; i < n; ++i) {
    run_case(family.make(rng), rng, std::string(family.name) + " case " + std::to_string(i), &tally);
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf("[fuzz] %s: %d cases, %d accepted, %d rejected (seed %llu)\n", family.name, tally.cases, tally.accepted,
              tally.rejected, static_cast<unsigned long long>(testing::test_seed()));
}

TEST(Fuzz, HeadGemvChecks) { fuzz_family(families()[0], 0x100); }
TEST(Fuzz, QkvNormChecks) { fuzz_family(families()[1], 0x200); }
TEST(Fuzz, LinearGemvChecks) { fuzz_family(families()[2], 0x300); }
TEST(Fuzz, SparseMlaChecks) { fuzz_family(families()[3], 0x400); }
TEST(Fuzz, IndexerPrepareChecks) { fuzz_family(families()[4], 0x500); }
TEST(Fuzz, IndexerSelectChecks) { fuzz_family(families()[5], 0x600); }
TEST(Fuzz, IndexerRemapChecks) { fuzz_family(families()[6], 0x700); }
TEST(Fuzz, IndexerPrefillChecks) { fuzz_family(families()[7], 0x800); }
TEST(Fuzz, IndexerProjectChecks) { fuzz_family(families()[8], 0x900); }
TEST(Fuzz, IndexerProjectGemvChecks) { fuzz_family(families()[9], 0xA00); }
TEST(Fuzz, SparseMlaV32Checks) { fuzz_family(families()[10], 0xC00); }
TEST(Fuzz, SparseMlaV32CacheWriteChecks) { fuzz_family(families()[11], 0xD00); }
TEST(Fuzz, RopeAbsorbChecks) { fuzz_family(families()[12], 0xE00); }

// With a GPU, DsaAttentionStage::create allocates a real workspace on every
// valid case: too slow for a sweep there; on the CPU it stops at cudaMalloc.
TEST(Fuzz, StageCreateChecks) {
  if (testing::gpu_available()) GTEST_SKIP() << "host-only sweep (valid cases would allocate a workspace each)";
  fuzz_family({"stage_create", stage_case, 300}, 0xB00);
}

// ---- regression tests of the defects the sweep found ----------------------

TensorView cuda_view(uintptr_t address, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> strides) {
  TensorView t = make_strided(reinterpret_cast<void*>(address), dtype, shape, strides);
  return t;
}

// A view whose byte range overflows int64 was accepted (split_counters of
// 2^62 elements, a kv_cache block stride of 2^62, a row stride of -2^40)
// and its overlap test wrapped around.
TEST(TensorChecks, RejectsViewsWhoseByteRangeOverflows) {
  const TensorView counters = cuda_view(1ull << 40, DType::kI32, {int64_t{1} << 62}, {1});
  testing::expect_rejected(check_present(counters, "split_counters"), "split_counters", "fits in 63 bits");
  const TensorView cache = cuda_view(1ull << 40, DType::kFP8E4M3, {3, 64, 512}, {int64_t{1} << 62, 512, 1});
  testing::expect_rejected(check_present(cache, "kv_cache"), "kv_cache", "fits in 63 bits");
  const TensorView below = cuda_view(1ull << 40, DType::kBF16, {4, 8}, {-(int64_t{1} << 40), 1});
  testing::expect_rejected(check_present(below, "w"), "w", "fits in 63 bits");
  const TensorView wide = cuda_view(1ull << 40, DType::kI64, {int64_t{1} << 40, int64_t{1} << 40}, {int64_t{1} << 40, 1});
  testing::expect_rejected(check_present(wide, "x"), "x", "fits in 63 bits");
  EXPECT_EQ(wide.numel(), INT64_MAX);  // saturates, no undefined overflow
  // An empty view addresses nothing, whatever its strides.
  EXPECT_TRUE(check_present(cuda_view(1ull << 40, DType::kI32, {0, 4}, {INT64_MAX, 1}), "e").ok());
}

TEST(TensorChecks, OverlapSeesNegativeStridesAndHugeViews) {
  // Rows at 2^40 - 3 * 64 .. 2^40 + 16 bytes reach the view at 2^40 - 64.
  const TensorView backwards = cuda_view(1ull << 40, DType::kBF16, {4, 8}, {-32, 1});
  const TensorView before = cuda_view((1ull << 40) - 64, DType::kBF16, {8}, {1});
  EXPECT_TRUE(tensors_overlap(backwards, before));
  EXPECT_EQ(backwards.span_elements(), 3 * 32 + 8);
  const TensorView after = cuda_view((1ull << 40) + 16, DType::kBF16, {8}, {1});
  EXPECT_FALSE(tensors_overlap(backwards, after));
  // A range that cannot be computed overlaps everything (its check rejects it anyway).
  const TensorView huge = cuda_view(1ull << 41, DType::kI32, {int64_t{1} << 62}, {1});
  EXPECT_TRUE(tensors_overlap(huge, before));
}

// kSeedOrder stores out one value at a time: a BF16 out at an odd address was accepted.
TEST(HeadGemvChecks, SeedOrderRejectsOutMisalignedForItsDtype) {
  HeadGemvArgs a;
  a.x = cuda_view(1ull << 40, DType::kBF16, {2, 8, 64}, {512, 64, 1});
  a.weight = cuda_view(2ull << 40, DType::kBF16, {8, 64, 128}, {8192, 128, 1});
  a.out = cuda_view((3ull << 40) + 1, DType::kBF16, {2, 8, 128}, {1024, 128, 1});
  a.sums = HeadGemvSums::kSeedOrder;
  testing::expect_rejected(check_head_gemv(a), "out", "aligned to 2 bytes");
  a.out.data = reinterpret_cast<void*>((3ull << 40) + 2);
  EXPECT_TRUE(check_head_gemv(a).ok());
  a.out.dtype = DType::kFP8E4M3;
  a.out.data = reinterpret_cast<void*>((3ull << 40) + 1);
  a.scale = cuda_view(4ull << 40, DType::kF32, {1}, {1});
  EXPECT_TRUE(check_head_gemv(a).ok()) << "an FP8 value is one byte";
}

// A table row of 2^60 blocks times the block size overflowed int64 in the
// prefill's bound (undefined behaviour, a negative bound blaming index_k).
TEST(IndexerChecks, PrefillBoundOfAHugeBlockTableDoesNotOverflow) {
  IndexerPrefillArgs a;
  a.plan.max_context = 4096;
  a.index_k = cuda_view(1ull << 40, DType::kBF16, {100, 128}, {128, 1});
  a.gate = cuda_view(2ull << 40, DType::kBF16, {100, 128}, {128, 1});
  a.k_norm_weight = cuda_view(3ull << 40, DType::kF32, {128}, {1});
  a.k_norm_bias = cuda_view(4ull << 40, DType::kF32, {128}, {1});
  a.ape = cuda_view(5ull << 40, DType::kF32, {4, 128}, {128, 1});
  // Above every other view: its 2^62 bytes reach no other argument.
  a.state.block_table = cuda_view(64ull << 40, DType::kI32, {1, int64_t{1} << 60}, {int64_t{1} << 60, 1});
  a.state.ring = cuda_view(7ull << 40, DType::kBF16, {1, 2, 4, 128}, {1024, 512, 128, 1});
  a.state.k_cache = cuda_view(8ull << 40, DType::kU8, {4, 64 * 132}, {64 * 132, 1});
  EXPECT_TRUE(check_indexer_prefill(a).ok()) << check_indexer_prefill(a).to_string();
  const int64_t positions[1] = {4000};
  const int32_t requests[1] = {0};
  EXPECT_TRUE(check_indexer_batch(a.plan, 1, positions, requests, 1, int64_t{1} << 60).ok());
}

// Fake weights of the glm5next layer at TP8 (H = 8).
struct StageWeights {
  DsaLayerConfig config;
  DsaLayerWeights w;
  StageWeights() {
    ModelPreset preset, rank;
    EXPECT_TRUE(find_preset("glm5next", &preset).ok());
    EXPECT_TRUE(per_rank(preset, 8, &rank).ok());
    config = dsa_layer_config(rank, 1e-6f);
    const int64_t D = config.hidden_size, H = config.num_heads, Q = config.q_lora_rank, L = config.kv_lora_rank,
                  P = config.qk_nope_head_dim, V = config.v_head_dim;
    int i = 0;
    auto view = [&](DType dtype, const std::vector<int64_t>& shape) { return contiguous(i++, dtype, shape); };
    w.fused_qkv_a_proj = view(DType::kBF16, {Q + L, D});
    w.q_a_norm = view(DType::kBF16, {Q});
    w.kv_a_norm = view(DType::kBF16, {L});
    w.q_b_proj = view(DType::kBF16, {H * P, Q});
    w.w_uk_t = view(DType::kBF16, {H, P, L});
    w.w_uv = view(DType::kBF16, {H, L, V});
    w.o_proj = view(DType::kBF16, {D, H * V});
    w.q_scale = view(DType::kF32, {1});
    w.k_scale = view(DType::kF32, {1});
    w.index_wq_b = view(DType::kBF16, {4096, Q});
    w.index_wk = view(DType::kBF16, {128, D});
    w.index_weights_proj = view(DType::kBF16, {32, D});
    w.index_compress_gate = view(DType::kBF16, {128, D});
    w.index_k_norm_weight = view(DType::kF32, {128});
    w.index_k_norm_bias = view(DType::kF32, {128});
    w.index_ape = view(DType::kF32, {4, 128});
  }
  Status create() const {
    std::unique_ptr<DsaAttentionStage> stage;
    return DsaAttentionStage::create(config, w, DsaStagePlan{}, &stage);
  }
};

Status created(const Status& s) {  // the checks passed: the workspace's allocation is what failed here
  return s.code() == ErrorCode::kNoDevice || s.code() == ErrorCode::kCudaError ? Status() : s;
}

// Weight rows that overlap (a row stride below the row), a zero or negative
// row stride were accepted at creation; every projection then reads them as
// rows of their own.
TEST(StageChecks, CreateRejectsOverlappingOrNegativeWeightStrides) {
  if (testing::gpu_available()) GTEST_SKIP() << "fake weight views: host-only";
  StageWeights s;
  ASSERT_TRUE(created(s.create()).ok()) << s.create().to_string();
  for (int64_t stride : {int64_t{2048}, int64_t{0}, int64_t{-4096}}) {  // (-4096: a multiple of 8)
    StageWeights bad;
    bad.w.index_compress_gate.strides[0] = stride;
    testing::expect_rejected(bad.create(), "index_compress_gate", "do not overlap");
  }
  StageWeights heads;
  heads.w.w_uv.strides[0] = heads.w.w_uv.strides[1];  // heads overlapping
  testing::expect_rejected(heads.create(), "w_uv", "do not overlap");
}

// The indexer's k-norm parameters and ape are read as contiguous blocks
// (check_indexer_prepare): creation accepted a strided ape that the first step refused.
TEST(StageChecks, CreateRejectsStridedIndexerParameters) {
  if (testing::gpu_available()) GTEST_SKIP() << "fake weight views: host-only";
  StageWeights s;
  s.w.index_ape.strides[0] = int64_t{1} << 31;
  testing::expect_rejected(s.create(), "index_ape", "contiguous");
}

}  // namespace
}  // namespace dsa
