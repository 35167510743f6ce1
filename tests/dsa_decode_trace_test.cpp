// dsa-decode --trace's host logic (tools/kernel_trace.h): the kernel names it
// prints, the span and idle time of a trace, and the cut of one graph
// launch's kernels into its stages. The CUPTI part runs on the
// GPU only (gpu-check's dsa-decode runs).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
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

TracedKernel named(const char* name, uint64_t start_ns) {
  TracedKernel k = span(start_ns, start_ns + 500);
  k.name = name;
  return k;
}

TEST(KernelTraceStages, CutsOneLaunchIntoItsStagesInOrderOfStart) {
  // Two stages of three kernels; within a stage the kernels may start in any order of names.
  const std::vector<TracedKernel> kernels = {named("a", 0),    named("c", 100),  named("b", 200),
                                             named("a", 1000), named("b", 1100), named("c", 1200)};
  std::vector<std::vector<TracedKernel>> per_stage;
  ASSERT_TRUE(split_stages(kernels, 2, &per_stage).ok());
  ASSERT_EQ(per_stage.size(), 2u);
  EXPECT_EQ(per_stage[0].size(), 3u);
  EXPECT_EQ(per_stage[1].front().start_ns, 1000u);
  EXPECT_EQ(per_stage[1].back().name, "c");
}

TEST(KernelTraceStages, RefusesCountsAndStagesThatDoNotMatch) {
  std::vector<std::vector<TracedKernel>> per_stage;
  const std::vector<TracedKernel> five = {named("a", 0), named("b", 1), named("a", 2), named("b", 3), named("a", 4)};
  const Status uneven = split_stages(five, 2, &per_stage);
  EXPECT_FALSE(uneven.ok());
  EXPECT_NE(uneven.message().find("5 kernels for 2 stages"), std::string::npos) << uneven.message();
  EXPECT_FALSE(split_stages(five, 0, &per_stage).ok());
  EXPECT_FALSE(split_stages({}, 1, &per_stage).ok());
  // A kernel of stage 1 that started among stage 0's: the cut would mix them.
  const std::vector<TracedKernel> mixed = {named("a", 0), named("a", 1), named("b", 2), named("b", 3)};
  const Status other = split_stages(mixed, 2, &per_stage);
  EXPECT_FALSE(other.ok());
  EXPECT_NE(other.message().find("stage 1 ran other kernels"), std::string::npos) << other.message();
}

TEST(KernelTraceStages, NeighboursGiveThePeriodAndTheOverlap) {
  // Stage 0 [0, 5000], stage 1 [4000, 9000] (starts under stage 0's tail), stage 2 from 10000.
  const std::vector<std::vector<TracedKernel>> three = {
      {span(0, 3000), span(1000, 5000)}, {span(4000, 9000)}, {span(10000, 12000)}};
  const StageNeighbours middle = stage_neighbours(three, 1);
  EXPECT_DOUBLE_EQ(middle.next_stage_start_us, 6.0);
  EXPECT_DOUBLE_EQ(middle.previous_stage_end_us, 1.0);  // the previous stage's last end, 1 us into this one
  const StageNeighbours first = stage_neighbours(three, 0);
  EXPECT_DOUBLE_EQ(first.next_stage_start_us, 4.0);
  EXPECT_TRUE(std::isnan(first.previous_stage_end_us));
  EXPECT_TRUE(std::isnan(stage_neighbours(three, 2).next_stage_start_us));
  const StageNeighbours alone = stage_neighbours({{span(0, 1000)}}, 0);
  EXPECT_TRUE(std::isnan(alone.next_stage_start_us));
  EXPECT_TRUE(std::isnan(alone.previous_stage_end_us));
  EXPECT_TRUE(std::isnan(stage_neighbours(three, 3).next_stage_start_us));  // no such stage
}

}  // namespace
}  // namespace dsa::cli
