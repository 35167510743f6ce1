// linear_gemv against cuBLASLt (src/core/linear.h, the stage's GEMMs) on the
// stage's projections at glm5next: qkv_a_proj [2048, 4096], q_b_proj at TP1
// [16384, 1536] and TP8 [2048, 1536], o_proj at TP1 [4096, 16384] and TP8
// [4096, 2048]; m = 1, 2, 4, 8 (o_proj at TP1 to m = 4: x's rows must fit in
// shared memory). Cold L2: weight copies rotated, twice the L2 in all. Both
// in CUDA graphs of back-to-back launches, so the GEMV's PDL overlap of its
// weight stream with the launch before it counts, as in the stage's chain.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "core/linear.h"
#include "dsa_decode/cuda_check.h"
#include "dsa_decode/linear.h"
#include "harness.h"

namespace dsa {
namespace {

Status bench_linear(bench::Context& ctx, bench::Report& report) {
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const std::vector<Shape> shapes = {{"qkv_a_proj", 2048, 4096},
                                     {"q_b_proj TP1", 16384, 1536},
                                     {"q_b_proj TP8", 2048, 1536},
                                     {"o_proj TP1", 4096, 16384},
                                     {"o_proj TP8", 4096, 2048}};
  LinearContext cublaslt;
  DSA_RETURN_IF_ERROR(LinearContext::create(&cublaslt));
  for (const Shape& s : shapes) {
    const size_t weight_bytes = size_t(s.n) * size_t(s.k) * 2;
    const int copies = bench::cold_copies(ctx, weight_bytes);
    std::vector<bench::DeviceMemory> weights(copies);
    for (int c = 0; c < copies; ++c) {
      DSA_RETURN_IF_ERROR(weights[c].allocate(weight_bytes));
      DSA_RETURN_IF_ERROR(bench::fill_random_bf16(weights[c].get(), weight_bytes / 2, 0x6c696e + c, 0.02f, ctx.stream));
    }
    bench::DeviceMemory x, out;
    DSA_RETURN_IF_ERROR(x.allocate(size_t(kLinearGemvMaxTokens) * s.k * 2));
    DSA_RETURN_IF_ERROR(bench::fill_random_bf16(x.get(), size_t(kLinearGemvMaxTokens) * s.k, 0x78, 1.0f, ctx.stream));
    DSA_RETURN_IF_ERROR(out.allocate(size_t(kLinearGemvMaxTokens) * s.n * 2));
    for (int m : {1, 2, 4, 8}) {
      if (!linear_gemv_supports(m, s.k)) continue;
      const TensorView in = make_tensor(x.get(), DType::kBF16, {m, s.k});
      const auto weight = [&](int i) { return make_tensor(weights[i % copies].get(), DType::kBF16, {s.n, s.k}); };
      DSA_RETURN_IF_ERROR(cublaslt.prepare(s.name, in, weight(0), s.n, CUDA_R_16BF));
      double gemv_us = 0, cublaslt_us = 0;
      DSA_RETURN_IF_ERROR(bench::time_graph(
          ctx,
          [&](cudaStream_t stream, int i) {
            return linear_gemv(LinearGemvArgs{in, weight(i), make_tensor(out.get(), DType::kBF16, {m, s.n})}, stream);
          },
          &gemv_us));
      DSA_RETURN_IF_ERROR(bench::time_graph(
          ctx,
          [&](cudaStream_t stream, int i) {
            return cublaslt.run(s.name, in, weight(i), out.get(), s.n, CUDA_R_16BF, stream);
          },
          &cublaslt_us));
      const double bytes = double(weight_bytes) + double(m) * double(s.k + s.n) * 2;
      report.add(bench::Row{std::string("linear_gemv ") + s.name,
                            {{"m", double(m)}, {"N", double(s.n)}, {"K", double(s.k)}},
                            gemv_us,
                            "cuBLASLt (the stage's LinearContext)",
                            cublaslt_us,
                            bench::floor_us(ctx, bytes),
                            0,
                            ""});
    }
  }
  return Status();
}

DSA_BENCH("linear", bench_linear);

}  // namespace
}  // namespace dsa
