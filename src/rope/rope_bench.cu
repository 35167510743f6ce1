// The RoPE absorb (rope.h) at the dsv32 and glm5 shapes, TP1 and TP8 (cold
// L2: weight copies rotated; graph replay; one run):
//   rope_absorb:  q_nope x W_UK_T -> out[..., :512] BF16 + rotated q_pe -> out[..., 512:]
//                 + rotated k_pe, one launch; baseline cuBLAS bmm of the latent
//                 columns alone (the stock path's product, before its RoPE launch)
//   rope_absorb (no rope): head_gemv's tensor-core absorb, BF16 out, on packed
//                 q_nope: what the RoPE rows add to the same launch
#include <string>
#include <vector>

#include "cublas_bmm.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/head_gemv.h"
#include "dsa_decode/rope.h"
#include "dsa_decode/stock.h"
#include "harness.h"

namespace dsa::bench {
namespace {

constexpr int kLatent = 512, kRope = 64, kTableRows = 65536;

struct Problem {
  const char* preset;
  int heads, rows, m;  // H, P, m
};

double floor_bytes(const Problem& p) {
  return 2.0 * p.heads * p.rows * kLatent                // weights
         + 2.0 * p.m * p.heads * (p.rows + kRope)       // q
         + 2.0 * p.m * kRope * 2                        // k_pe in and out
         + 2.0 * p.m * p.heads * (kLatent + kRope)      // out
         + 4.0 * p.m * kRope + 8.0 * p.m;               // table rows, positions
}

struct Buffers {
  DeviceMemory weights, q, q_packed, kv, positions, table, out, out_latent, k_out;
  int copies = 1;
  size_t weight_elems = 0;
};

Status make_buffers(const Context& ctx, const Problem& p, const std::vector<float>& table, Buffers* b) {
  b->weight_elems = size_t(p.heads) * p.rows * kLatent;
  b->copies = cold_copies(ctx, b->weight_elems * 2);
  DSA_RETURN_IF_ERROR(b->weights.allocate(b->weight_elems * 2 * b->copies));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->weights.get(), b->weight_elems * b->copies, 1, 0.05f, ctx.stream));
  const size_t q_elems = size_t(p.m) * p.heads * (p.rows + kRope);
  DSA_RETURN_IF_ERROR(b->q.allocate(q_elems * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->q.get(), q_elems, 2, 1.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->q_packed.allocate(size_t(p.m) * p.heads * p.rows * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->q_packed.get(), size_t(p.m) * p.heads * p.rows, 3, 1.0f, ctx.stream));
  DSA_RETURN_IF_ERROR(b->kv.allocate(size_t(p.m) * (kLatent + kRope) * 2));
  DSA_RETURN_IF_ERROR(fill_random_bf16(b->kv.get(), size_t(p.m) * (kLatent + kRope), 4, 1.0f, ctx.stream));
  std::vector<int64_t> positions(p.m);
  for (int t = 0; t < p.m; ++t) positions[t] = 4096 + int64_t(t) * 3001;  // past the original 4096, scattered
  DSA_RETURN_IF_ERROR(b->positions.allocate(sizeof(int64_t) * p.m));
  DSA_CUDA_RETURN(cudaMemcpy(b->positions.get(), positions.data(), sizeof(int64_t) * p.m, cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->table.allocate(table.size() * sizeof(float)));
  DSA_CUDA_RETURN(cudaMemcpy(b->table.get(), table.data(), table.size() * sizeof(float), cudaMemcpyHostToDevice));
  DSA_RETURN_IF_ERROR(b->out.allocate(size_t(p.m) * p.heads * (kLatent + kRope) * 2));
  DSA_RETURN_IF_ERROR(b->out_latent.allocate(size_t(p.m) * p.heads * kLatent * 2));
  DSA_RETURN_IF_ERROR(b->k_out.allocate(size_t(p.m) * kRope * 2));
  DSA_CUDA_RETURN(cudaStreamSynchronize(ctx.stream));
  return Status();
}

TensorView weight_view(const Problem& p, const Buffers& b, int i) {
  return make_tensor(b.weights.as<uint16_t>() + b.weight_elems * (i % b.copies), DType::kBF16,
                     {p.heads, p.rows, kLatent});
}

RopeAbsorbArgs rope_args(const Problem& p, const Buffers& b, const RopeConfig& config, int i) {
  const int64_t width = p.rows + kRope;
  RopeAbsorbArgs a;
  a.q_nope = make_strided(b.q.get(), DType::kBF16, {p.m, p.heads, p.rows}, {p.heads * width, width, 1});
  a.q_pe = make_strided(b.q.as<uint16_t>() + p.rows, DType::kBF16, {p.m, p.heads, kRope}, {p.heads * width, width, 1});
  a.k_pe = make_strided(b.kv.as<uint16_t>() + kLatent, DType::kBF16, {p.m, kRope}, {kLatent + kRope, 1});
  a.positions = make_tensor(b.positions.get(), DType::kI64, {p.m});
  a.cos_sin = make_tensor(b.table.get(), DType::kF32, {kTableRows, kRope});
  a.weight = weight_view(p, b, i);
  a.out = make_tensor(b.out.get(), DType::kBF16, {p.m, p.heads, kLatent + kRope});
  a.k_pe_out = make_tensor(b.k_out.get(), DType::kBF16, {p.m, kRope});
  a.style = config.style;
  return a;
}

Status run(Context& ctx, Report& report) {
  CublasHandle handle;
  DSA_RETURN_IF_ERROR(handle.create(ctx.stream));
  const Problem shapes[] = {{"dsv32", 128, 128, 0}, {"dsv32", 16, 128, 0}, {"glm5", 64, 192, 0}, {"glm5", 8, 192, 0}};
  for (const Problem& shape : shapes) {
    RopeConfig config;
    DSA_RETURN_IF_ERROR(rope_preset_config(shape.preset, RopeTarget::kAttention, &config));
    std::vector<float> table(size_t(kTableRows) * kRope);
    DSA_RETURN_IF_ERROR(rope_cos_sin_table(config, 0, kTableRows, table.data()));
    for (int m : {1, 2, 4, 8, 16}) {
      Problem p = shape;
      p.m = m;
      Buffers b;
      DSA_RETURN_IF_ERROR(make_buffers(ctx, p, table, &b));
      const int per_graph = std::max(20, b.copies);
      double fused_us = 0, plain_us = 0, bmm_us = 0;
      DSA_RETURN_IF_ERROR(time_graph(
          ctx, [&](cudaStream_t stream, int i) { return rope_absorb(rope_args(p, b, config, i), stream); }, &fused_us,
          per_graph));
      DSA_RETURN_IF_ERROR(time_graph(
          ctx,
          [&](cudaStream_t stream, int i) {
            HeadGemvArgs a;
            a.x = make_tensor(b.q_packed.get(), DType::kBF16, {p.m, p.heads, p.rows});
            a.weight = weight_view(p, b, i);
            a.out = make_tensor(b.out_latent.get(), DType::kBF16, {p.m, p.heads, kLatent});
            return head_gemv(a, stream);
          },
          &plain_us, per_graph));
      DSA_RETURN_IF_ERROR(time_graph(
          ctx,
          [&](cudaStream_t, int i) {
            return cublas_head_bmm(handle.get(), make_tensor(b.q_packed.get(), DType::kBF16, {p.m, p.heads, p.rows}),
                                   weight_view(p, b, i),
                                   make_tensor(b.out_latent.get(), DType::kBF16, {p.m, p.heads, kLatent}));
          },
          &bmm_us, per_graph));
      const std::vector<std::pair<std::string, double>> params = {{"H", p.heads}, {"P", p.rows}, {"m", m}};
      const std::string baseline = "cuBLAS bmm of the latent columns alone (no RoPE)";
      Row row{"rope_absorb", params, fused_us, baseline, bmm_us, floor_us(ctx, floor_bytes(p))};
      row.note = std::string(p.preset) + ": head_gemv tensor cores + RoPE rows (q_pe, k_pe), one launch";
      report.add(row);
      Row plain{"rope_absorb (no rope)", params, plain_us, baseline, bmm_us, row.floor_us};
      plain.note = "head_gemv tensor cores, BF16 out, packed q_nope: the same launch without the RoPE rows";
      report.add(plain);
    }
  }
  return Status();
}

}  // namespace
DSA_BENCH("rope", run);
}  // namespace dsa::bench
