#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "dsa_decode/cuda_check.h"
#include "dsa_decode/numerics.h"

namespace dsa::bench {

namespace {

std::string file_name_part(const std::string& text) {
  std::string out = text.empty() ? "unknown" : text;
  for (char& c : out) {
    const bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                         c == '_' || c == '-';
    if (!allowed) c = '_';
  }
  return out;
}

std::string params_text(const Row& row) {
  std::string text;
  for (const auto& [key, value] : row.params) {
    if (!text.empty()) text += ' ';
    text += key + '=' + json_number(value);
  }
  return text;
}

std::string fixed(double value, const char* format) {
  char text[32];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

}  // namespace

std::string Report::json_path(const Context& ctx, const std::string& dir) const {
  (void)ctx;  // the date and commit are inside the file: one file per benchmark, overwritten by each run
  const std::string file = file_name_part(bench_) + ".json";
  return (std::filesystem::path(dir) / file).string();
}

Status Report::write_json(const Context& ctx, const std::string& dir) const {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return invalid_argument("dir", "a directory that can be created", dir + " (" + error.message() + ")");

  std::ostringstream json;
  json << "{\"bench\": " << json_string(bench_) << ", \"gpu\": " << json_string(ctx.gpu_name)
       << ", \"commit\": " << json_string(ctx.commit) << ",\n \"date\": " << json_string(ctx.date)
       << ", \"copy_GBps\": " << json_number(ctx.copy_GBps) << ",\n \"rows\": [";
  for (size_t r = 0; r < rows_.size(); ++r) {
    const Row& row = rows_[r];
    json << (r == 0 ? "\n  " : ",\n  ") << "{\"name\": " << json_string(row.name) << ", \"params\": {";
    for (size_t p = 0; p < row.params.size(); ++p) {
      json << (p == 0 ? "" : ", ") << json_string(row.params[p].first) << ": " << json_number(row.params[p].second);
    }
    json << "}, \"us\": " << json_number(row.us);
    if (!row.baseline.empty()) {
      json << ", \"baseline\": " << json_string(row.baseline) << ", \"baseline_us\": " << json_number(row.baseline_us)
           << ", \"speedup\": " << json_number(row.us > 0 ? row.baseline_us / row.us : NAN);
    }
    if (row.floor_us > 0) {
      json << ", \"floor_us\": " << json_number(row.floor_us)
           << ", \"bw_fraction\": " << json_number(row.us > 0 ? row.floor_us / row.us : NAN);
    }
    if (row.tflops > 0) json << ", \"tflops\": " << json_number(row.tflops);
    if (!row.note.empty()) json << ", \"note\": " << json_string(row.note);
    json << "}";
  }
  json << "\n ]}\n";

  const std::string path = json_path(ctx, dir);
  std::ofstream file(path, std::ios::trunc);
  file << json.str();
  file.close();
  if (!file) return invalid_argument("dir", "a writable directory", "failed to write " + path);
  return Status();
}

void Report::print(const Context& ctx) const {
  struct Column {
    const char* title;
    bool left_aligned;
    std::function<std::string(const Row&)> cell;  // empty: not set for this row
  };
  const std::vector<Column> columns = {
      {"name", true, [](const Row& r) { return r.name; }},
      {"params", true, [](const Row& r) { return params_text(r); }},
      {"us", false, [](const Row& r) { return fixed(r.us, "%.2f"); }},
      {"floor_us", false, [](const Row& r) { return r.floor_us > 0 ? fixed(r.floor_us, "%.2f") : ""; }},
      {"bw_fraction", false,
       [](const Row& r) { return r.floor_us > 0 && r.us > 0 ? fixed(100 * r.floor_us / r.us, "%.0f%%") : ""; }},
      {"baseline_us", false, [](const Row& r) { return r.baseline.empty() ? "" : fixed(r.baseline_us, "%.2f"); }},
      {"speedup", false,
       [](const Row& r) { return !r.baseline.empty() && r.us > 0 ? fixed(r.baseline_us / r.us, "%.2fx") : ""; }},
      {"TFLOP/s", false, [](const Row& r) { return r.tflops > 0 ? fixed(r.tflops, "%.1f") : ""; }},
      {"baseline", true, [](const Row& r) { return r.baseline; }},
      {"note", true, [](const Row& r) { return r.note; }},
  };

  // Only the columns some row sets, each as wide as its widest cell.
  std::vector<const Column*> shown;
  std::vector<std::vector<std::string>> cells;
  std::vector<size_t> widths;
  for (const Column& column : columns) {
    std::vector<std::string> column_cells;
    bool any_set = false;
    size_t width = std::string(column.title).size();
    for (const Row& row : rows_) {
      column_cells.push_back(column.cell(row));
      any_set = any_set || !column_cells.back().empty();
      width = std::max(width, column_cells.back().size());
    }
    if (!any_set) continue;
    shown.push_back(&column);
    cells.push_back(std::move(column_cells));
    widths.push_back(width);
  }

  std::printf("== %s on %s (commit %s, %s, copy %.0f GB/s)\n", bench_.c_str(), ctx.gpu_name.c_str(),
              ctx.commit.c_str(), ctx.date.c_str(), ctx.copy_GBps);
  auto print_line = [&](auto cell_of) {
    std::string line;
    for (size_t c = 0; c < shown.size(); ++c) {
      std::string text = cell_of(c);
      if (text.empty()) text = "-";
      const std::string pad(widths[c] - std::min(widths[c], text.size()), ' ');
      line += shown[c]->left_aligned ? text + pad : pad + text;
      if (c + 1 < shown.size()) line += "  ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::printf("%s\n", line.c_str());
  };
  if (rows_.empty()) {
    std::printf("(no rows)\n");
    std::fflush(stdout);
    return;
  }
  print_line([&](size_t c) { return std::string(shown[c]->title); });
  for (size_t r = 0; r < rows_.size(); ++r) print_line([&](size_t c) { return cells[c][r]; });
  std::fflush(stdout);
}

// ---------------------------------------------------------------- registry

namespace {
// A function-local static: registrars in other translation units run during
// static initialization, in an order C++ leaves unspecified.
std::vector<RegisteredBench>& registry() {
  static std::vector<RegisteredBench> benches;
  return benches;
}
}  // namespace

Registrar::Registrar(const char* name, BenchFn fn) { registry().push_back({name, fn}); }

std::vector<RegisteredBench> registered_benches() {
  std::vector<RegisteredBench> benches = registry();
  std::stable_sort(benches.begin(), benches.end(),
                   [](const RegisteredBench& a, const RegisteredBench& b) { return a.name < b.name; });
  return benches;
}

}  // namespace dsa::bench
