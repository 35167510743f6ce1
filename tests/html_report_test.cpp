// dsa-decode --report's page (tools/html_report.h): well-formed, both paths'
// timelines, the speedup table, escaped names, and the critical path rule.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tools/html_report.h"

namespace dsa::cli {
namespace {

TracedKernel kernel(const char* name, uint32_t stream, uint64_t start_ns, uint64_t end_ns) {
  TracedKernel k;
  k.name = name;
  k.stream = stream;
  k.start_ns = start_ns;
  k.end_ns = end_ns;
  k.ctas = 132;
  k.threads = 256;
  return k;
}

RunReport two_path_report() {
  RunReport r;
  r.gpu = "NVIDIA H200";
  r.commit = "abc1234";
  r.date = "2026-12-07";
  r.copy_GBps = 4000;
  r.shape.preset = "glm5next";
  r.shape.tp = 1;
  r.shape.H = 64;
  r.shape.m = 4;
  r.shape.context = 32768;
  r.checks = {{"latent vs float64", Check::Verdict::kPass, "rel 1e-3"},
              {"slots", Check::Verdict::kFail, "3 differ"},
              {"value-up kernel", Check::Verdict::kInfo, "head_gemv"}};
  Timing stock{"stock_whole_stage", "whole stage", "stock", false, 120.0, 2.4e8, -1};
  Timing fused{"whole_stage", "whole stage", "fused", false, 100.0, 2.4e8, 0};
  r.timings = {stock, fused};
  StageTrace f;
  f.path = "fused";
  f.streams = {7, 9};
  f.kernels = {kernel("norm<4>", 7, 0, 2000), kernel("indexer_select", 9, 500, 9000), kernel("absorb", 7, 2500, 5000),
               kernel("sparse_mla", 7, 9500, 20000)};
  StageTrace s = f;
  s.path = "stock";
  r.traces = {f, s};
  return r;
}

// Tags balance (void elements and "/>" aside); returns the first problem.
std::string tag_balance_problem(const std::string& html) {
  std::vector<std::string> open;
  for (size_t at = html.find('<'); at != std::string::npos; at = html.find('<', at + 1)) {
    const size_t end = html.find('>', at);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(at);
    std::string tag = html.substr(at + 1, end - at - 1);
    if (tag.empty() || tag[0] == '!') continue;
    const bool closing = tag[0] == '/';
    const bool self_closing = tag.back() == '/';
    std::string name = tag.substr(closing ? 1 : 0, tag.find_first_of(" />", closing ? 1 : 0) - (closing ? 1 : 0));
    if (name == "meta" || name == "br" || self_closing) continue;
    if (!closing) {
      open.push_back(name);
    } else if (open.empty() || open.back() != name) {
      return "</" + name + "> closes " + (open.empty() ? "nothing" : "<" + open.back() + ">");
    } else {
      open.pop_back();
    }
  }
  return open.empty() ? "" : "<" + open.back() + "> left open";
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(HtmlReport, IsOneWellFormedPageWithBothPathsTimelines) {
  const std::string html = html_report(two_path_report());
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(tag_balance_problem(html), "");
  EXPECT_EQ(count(html, "<svg"), 3u);  // the floor bars, then one timeline per path
  EXPECT_NE(html.find("Timeline, fused path: 4 kernels"), std::string::npos);
  EXPECT_NE(html.find("Timeline, stock path: 4 kernels"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);  // self-contained, nothing runs or loads
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));
}

TEST(HtmlReport, ShowsTheSpeedupTheFloorAndTheFailedCheck) {
  const std::string html = html_report(two_path_report());
  EXPECT_NE(html.find("<td>1.20x</td>"), std::string::npos);  // 120 / 100
  EXPECT_NE(html.find("<td>60.00</td>"), std::string::npos);  // 2.4e8 bytes at 4000 GB/s
  EXPECT_NE(html.find("Checks: 1 failed of 2 judged"), std::string::npos);
  EXPECT_NE(html.find("class=\"fail\">FAIL"), std::string::npos);
}

TEST(HtmlReport, EscapesKernelNames) {
  const std::string html = html_report(two_path_report());
  EXPECT_NE(html.find("norm&lt;4&gt;"), std::string::npos);
  EXPECT_EQ(html.find("norm<4>"), std::string::npos);
}

TEST(HtmlReport, CriticalPathRunsBackThroughTheLastToFinishBeforeEach) {
  // sparse_mla ends last; before it the latest to end is indexer_select (9000),
  // before that norm (absorb started after indexer_select).
  const std::vector<size_t> path = estimated_critical_path(two_path_report().traces[0]);
  EXPECT_EQ(path, (std::vector<size_t>{0, 1, 3}));
  EXPECT_TRUE(estimated_critical_path(StageTrace{}).empty());
}

TEST(HtmlReport, WriteNamesTheOptionWhenTheFileCannotBeWritten) {
  const Status status = write_html_report(two_path_report(), "/nonexistent-dir/report.html");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("--report"), std::string::npos);
  const std::string path = testing::TempDir() + "dsa_report_test.html";
  ASSERT_TRUE(write_html_report(two_path_report(), path).ok());
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_EQ(text.str(), html_report(two_path_report()));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace dsa::cli
