// dsa-decode --trace's host logic (tools/kernel_trace.h): the kernel names it
// prints and the span and idle time of a trace. The CUPTI part runs on the
// GPU only (gpu-check's dsa-decode runs).
#include <gtest/gtest.h>

#include <vector>

#include "tools/kernel_trace.h"

namespace dsa::cli {
namespace {

TEST(KernelTraceNames, DropScopesTemplateArgumentsAndParameters) {
  EXPECT_EQ(kernel_short_name("_ZN3dsa12_GLOBAL__N_118linear_gemv_kernelILi4EEEvNS0_16LinearGemvParamsE"),
            "linear_gemv_kernel");
  EXPECT_EQ(kernel_short_name("_Z13select_kernelPKfi"), "select_kernel");
  EXPECT_EQ(kernel_short_name("_ZN3cub17CUB_300001_SM_9006detail11EmptyKernelIvEEvv"), "EmptyKernel");
}

TEST(KernelTraceNames, KeepsNamesThatDoNotDemangle) {
  EXPECT_EQ(kernel_short_name("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT"), "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT");
  EXPECT_EQ(kernel_short_name(""), "");
}

TracedKernel span(uint64_t start_ns, uint64_t end_ns) {
  TracedKernel k;
  k.start_ns = start_ns;
  k.end_ns = end_ns;
  return k;
}

TEST(KernelTraceTimes, SpanAndTheTimeNoKernelIsResident) {
  EXPECT_EQ(trace_span_us({}), 0);
  EXPECT_EQ(trace_idle_us({}), 0);
  // [1000, 5000] and [2000, 3000] overlap; then 1 us with nothing; then [6000, 9000].
  const std::vector<TracedKernel> kernels = {span(1000, 5000), span(2000, 3000), span(6000, 9000)};
  EXPECT_DOUBLE_EQ(trace_span_us(kernels), 8.0);
  EXPECT_DOUBLE_EQ(trace_idle_us(kernels), 1.0);
  // A kernel inside an earlier one's time adds no idle time and no span.
  const std::vector<TracedKernel> nested = {span(0, 10000), span(2000, 3000), span(4000, 5000)};
  EXPECT_DOUBLE_EQ(trace_span_us(nested), 10.0);
  EXPECT_DOUBLE_EQ(trace_idle_us(nested), 0.0);
}

}  // namespace
}  // namespace dsa::cli
