// Benchmark harness: the result rows, the JSON report of DESIGN.md section 4
// (one file per benchmark, <dir>/<bench>.json) and the registry. Each
// benchmark is a function registered with DSA_BENCH; `dsa-bench` runs them.
// The measuring kit (timing, cold copies, buffers) is timing.h.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "timing.h"

namespace dsa::bench {

// One result row; params are written as a JSON object in the given order.
struct Row {
  std::string name;
  std::vector<std::pair<std::string, double>> params;
  double us = 0;
  std::string baseline;  // empty: no baseline fields written
  double baseline_us = 0;
  double floor_us = 0;  // 0: no floor fields written
  double tflops = 0;    // 0: not written
  std::string note;     // free text (e.g. the tactic), written when not empty
};

class Report {
 public:
  explicit Report(std::string bench) : bench_(std::move(bench)) {}
  void add(Row row) { rows_.push_back(std::move(row)); }
  const std::string& bench() const { return bench_; }
  const std::vector<Row>& rows() const { return rows_; }
  // Writes <dir>/<bench>.json (overwritten); speedup and bw_fraction are derived.
  Status write_json(const Context& ctx, const std::string& dir) const;
  // A fixed-width table on stdout.
  void print(const Context& ctx) const;
  // The file write_json writes: <dir>/<bench>.json, with any character
  // outside [A-Za-z0-9._-] in bench replaced by '_'.
  std::string json_path(const Context& ctx, const std::string& dir) const;

 private:
  std::string bench_;
  std::vector<Row> rows_;
};

using BenchFn = Status (*)(Context& ctx, Report& report);
struct Registrar {
  Registrar(const char* name, BenchFn fn);
};
#define DSA_BENCH(name, fn) static ::dsa::bench::Registrar dsa_bench_registrar_##fn(name, fn)

struct RegisteredBench {
  std::string name;
  BenchFn fn;
};
// Every benchmark registered with DSA_BENCH, sorted by name (duplicates kept,
// so that dsa-bench can report them).
std::vector<RegisteredBench> registered_benches();

}  // namespace dsa::bench
