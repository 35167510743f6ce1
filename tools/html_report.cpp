#include "html_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

namespace dsa::cli {

namespace {

std::string escaped(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fixed(double value, int digits = 2) {
  if (!std::isfinite(value)) return "-";
  char text[48];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

double floor_us(const RunReport& r, double bytes) { return r.copy_GBps > 0 ? bytes / (r.copy_GBps * 1e3) : NAN; }

const char* path_colour(const std::string& path) {
  if (path == "fused") return "#2b6cb0";
  if (path == "stock") return "#c05621";
  return "#4a5568";
}

const char* kStyle =
    "body{font-family:system-ui,sans-serif;margin:2em;color:#1a202c}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #cbd5e0;padding:3px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left}.pass{color:#276749}.fail{color:#c53030;font-weight:bold}"
    ".info{color:#4a5568}svg{display:block;margin:1em 0}text{font-size:11px}";

void header(std::ostringstream& html, const RunReport& r) {
  const StepShape& s = r.shape;
  html << "<h1>dsa-decode: " << escaped(s.preset) << ", TP" << s.tp << ", H = " << s.H << ", m = " << s.m
       << ", context " << s.context << "</h1>\n<p>" << escaped(r.gpu) << "; commit " << escaped(r.commit) << "; "
       << escaped(r.date) << "; copy rate " << fixed(r.copy_GBps, 0) << " GB/s; " << r.steps << " steps over "
       << r.weight_copies << " weight copies; attention plan " << escaped(r.attention_plan) << ", indexer logits "
       << escaped(r.indexer_logits) << ", head_gemv sums " << escaped(r.head_gemv_sums)
       << (r.batch_invariant ? ", batch invariant" : "");
  if (s.rope()) {
    html << "; RoPE: " << s.R << " rotated dims a head, the 656-byte FP8 cache, the unpooled indexer (" << s.index_heads
         << " heads, top-" << s.index_topk << ")";
  }
  html << "</p>\n";
  if (!r.note.empty()) html << "<p>" << escaped(r.note) << "</p>\n";
}

void checks_table(std::ostringstream& html, const RunReport& r) {
  size_t failed = 0, judged = 0;
  for (const Check& c : r.checks) {
    failed += c.verdict == Check::Verdict::kFail;
    judged += c.verdict != Check::Verdict::kInfo;
  }
  html << "<h2>Checks: " << failed << " failed of " << judged
       << " judged</h2>\n<table><tr><th>check</th><th>result</th><th>detail</th></tr>\n";
  for (const Check& c : r.checks) {
    const char* cls = c.verdict == Check::Verdict::kPass ? "pass" : c.verdict == Check::Verdict::kFail ? "fail" : "info";
    const char* text = c.verdict == Check::Verdict::kPass ? "PASS" : c.verdict == Check::Verdict::kFail ? "FAIL" : "info";
    html << "<tr><td>" << escaped(c.name) << "</td><td class=\"" << cls << "\">" << text
         << "</td><td style=\"text-align:left\">" << escaped(c.detail) << "</td></tr>\n";
  }
  html << "</table>\n";
}

void speedup_table(std::ostringstream& html, const RunReport& r) {
  html << "<h2>Fused against stock</h2>\n<table><tr><th>step</th><th>fused us</th><th>stock us</th>"
          "<th>speedup</th><th>floor us</th><th>fused / floor</th></tr>\n";
  for (const Timing& t : r.timings) {
    if (t.baseline < 0 || t.baseline >= static_cast<int>(r.timings.size())) continue;
    const Timing& stock = r.timings[t.baseline];
    const double floor = floor_us(r, t.bytes);
    html << "<tr><td>" << escaped(t.label) << "</td><td>" << fixed(t.us) << "</td><td>" << fixed(stock.us)
         << "</td><td>" << fixed(stock.us / t.us) << "x</td><td>" << fixed(floor) << "</td><td>"
         << fixed(t.us / floor) << "x</td></tr>\n";
  }
  html << "</table>\n";
}

// One bar per timing (its path's colour) with a black mark at its memory floor.
void floor_bars(std::ostringstream& html, const RunReport& r) {
  if (r.timings.empty()) return;
  double largest = 0;
  for (const Timing& t : r.timings) largest = std::max({largest, t.us, std::isfinite(floor_us(r, t.bytes)) ? floor_us(r, t.bytes) : 0.0});
  const int label_w = 330, bar_w = 520, row_h = 18;
  const int height = row_h * static_cast<int>(r.timings.size()) + 24;
  const double scale = largest > 0 ? bar_w / largest : 0;
  html << "<h2>Each timing against its memory floor</h2>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\""
       << label_w + bar_w + 90 << "\" height=\"" << height << "\">\n";
  for (size_t i = 0; i < r.timings.size(); ++i) {
    const Timing& t = r.timings[i];
    const int y = static_cast<int>(i) * row_h;
    const double floor = floor_us(r, t.bytes);
    html << "<text x=\"0\" y=\"" << y + 13 << "\">" << escaped(t.label) << " (" << escaped(t.path) << ")</text>"
         << "<rect x=\"" << label_w << "\" y=\"" << y + 3 << "\" width=\"" << fixed(t.us * scale, 1)
         << "\" height=\"" << row_h - 6 << "\" fill=\"" << path_colour(t.path) << "\"><title>" << escaped(t.label)
         << ": " << fixed(t.us) << " us, floor " << fixed(floor) << " us</title></rect>";
    if (std::isfinite(floor)) {
      html << "<line x1=\"" << fixed(label_w + floor * scale, 1) << "\" x2=\"" << fixed(label_w + floor * scale, 1)
           << "\" y1=\"" << y + 1 << "\" y2=\"" << y + row_h - 1 << "\" stroke=\"black\" stroke-width=\"2\"/>";
    }
    html << "<text x=\"" << fixed(label_w + t.us * scale + 4, 1) << "\" y=\"" << y + 13 << "\">" << fixed(t.us)
         << " us</text>\n";
  }
  html << "<text x=\"" << label_w << "\" y=\"" << height - 4
       << "\">bar: median time of the graph replay; black mark: the bytes at the copy rate</text>\n</svg>\n";
}

// Lanes per stream; each kernel a rectangle from its start to its end, the
// critical path's outlined in red, the stretches with no kernel resident shaded.
void timeline(std::ostringstream& html, const StageTrace& t, double span_us) {
  const int label_w = 40, width = 900, lane_h = 22;
  const int lanes = static_cast<int>(std::max<size_t>(t.streams.size(), 1));
  const int height = lanes * lane_h + 40;
  const double scale = span_us > 0 ? width / span_us : 0;
  const std::vector<size_t> critical = estimated_critical_path(t);
  html << "<h2>Timeline, " << escaped(t.path) << " path: " << t.kernels.size() << " kernels, "
       << fixed(trace_span_us(t.kernels)) << " us, " << fixed(trace_idle_us(t.kernels))
       << " us with no kernel resident</h2>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\""
       << label_w + width + 20 << "\" height=\"" << height << "\">\n";
  // Idle stretches: no kernel resident between the end of everything before and the next start.
  uint64_t covered = t.kernels.empty() ? 0 : t.kernels.front().start_ns;
  for (const TracedKernel& k : t.kernels) {
    if (k.start_ns > covered) {
      html << "<rect x=\"" << fixed(label_w + covered / 1e3 * scale, 1) << "\" y=\"0\" width=\""
           << fixed((k.start_ns - covered) / 1e3 * scale, 1) << "\" height=\"" << lanes * lane_h
           << "\" fill=\"#fed7d7\"><title>idle " << fixed((k.start_ns - covered) / 1e3) << " us</title></rect>\n";
    }
    covered = std::max(covered, k.end_ns);
  }
  for (int lane = 0; lane < lanes; ++lane) {
    html << "<text x=\"0\" y=\"" << lane * lane_h + 15 << "\">s" << lane << "</text>\n";
  }
  for (size_t i = 0; i < t.kernels.size(); ++i) {
    const TracedKernel& k = t.kernels[i];
    const auto at = std::find(t.streams.begin(), t.streams.end(), k.stream);
    const int lane = at == t.streams.end() ? 0 : static_cast<int>(at - t.streams.begin());
    const bool on_path = std::find(critical.begin(), critical.end(), i) != critical.end();
    html << "<rect x=\"" << fixed(label_w + k.start_ns / 1e3 * scale, 1) << "\" y=\"" << lane * lane_h + 3
         << "\" width=\"" << fixed(std::max(1.0, (k.end_ns - k.start_ns) / 1e3 * scale), 1) << "\" height=\""
         << lane_h - 6 << "\" fill=\"" << path_colour(t.path) << "\" fill-opacity=\"0.75\""
         << (on_path ? " stroke=\"#e53e3e\" stroke-width=\"2\"" : "") << "><title>" << escaped(k.name) << ": "
         << fixed(k.start_ns / 1e3) << " .. " << fixed(k.end_ns / 1e3) << " us, " << k.ctas << " x " << k.threads
         << (on_path ? ", critical path" : "") << "</title></rect>\n";
  }
  for (int tick = 0; tick <= 10; ++tick) {
    const double x = label_w + tick * width / 10.0;
    html << "<line x1=\"" << fixed(x, 1) << "\" x2=\"" << fixed(x, 1) << "\" y1=\"" << lanes * lane_h
         << "\" y2=\"" << lanes * lane_h + 5 << "\" stroke=\"black\"/><text x=\"" << fixed(x - 8, 1) << "\" y=\""
         << lanes * lane_h + 18 << "\">" << fixed(span_us * tick / 10, 1) << "</text>\n";
  }
  html << "<text x=\"" << label_w << "\" y=\"" << height - 4
       << "\">us from the stage's first start; red outline: estimated critical path; pink: no kernel resident"
       << "</text>\n</svg>\n<table><tr><th>kernel</th><th>stream</th><th>start us</th><th>us</th></tr>\n";
  for (size_t i = 0; i < t.kernels.size(); ++i) {
    const TracedKernel& k = t.kernels[i];
    const auto at = std::find(t.streams.begin(), t.streams.end(), k.stream);
    const bool on_path = std::find(critical.begin(), critical.end(), i) != critical.end();
    html << "<tr><td>" << (on_path ? "<b>" : "") << escaped(k.name) << (on_path ? "</b>" : "") << "</td><td>s"
         << (at - t.streams.begin()) << "</td><td>" << fixed(k.start_ns / 1e3) << "</td><td>"
         << fixed((k.end_ns - k.start_ns) / 1e3) << "</td></tr>\n";
  }
  html << "</table>\n";
}

// The report files written by this process (report.h's note_report_written;
// here, beside write_html_report, so that every target that writes a report
// has it).
std::set<std::string>& written_reports() {
  static std::set<std::string> paths;
  return paths;
}

}  // namespace

void note_report_written(const std::string& path) { written_reports().insert(path); }

bool report_written(const std::string& path) { return written_reports().count(path) > 0; }

std::vector<size_t> estimated_critical_path(const StageTrace& trace) {
  const std::vector<TracedKernel>& k = trace.kernels;
  std::vector<size_t> path;
  if (k.empty()) return path;
  size_t at = 0;
  for (size_t i = 1; i < k.size(); ++i) {
    if (k[i].end_ns >= k[at].end_ns) at = i;
  }
  path.push_back(at);
  for (;;) {
    bool found = false;
    size_t previous = 0;
    for (size_t j = 0; j < k.size(); ++j) {
      if (k[j].start_ns >= k[at].start_ns || k[j].end_ns > k[at].end_ns || j == at) continue;
      if (!found || k[j].end_ns > k[previous].end_ns) previous = j, found = true;
    }
    if (!found) break;
    path.push_back(previous);
    at = previous;
  }
  std::reverse(path.begin(), path.end());
  return path;
}

std::string html_report(const RunReport& r) {
  std::ostringstream html;
  html << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>dsa-decode "
       << escaped(r.shape.preset) << " TP" << r.shape.tp << " m=" << r.shape.m << "</title><style>" << kStyle
       << "</style></head><body>\n";
  header(html, r);
  checks_table(html, r);
  speedup_table(html, r);
  floor_bars(html, r);
  if (!r.trace_problem.empty()) html << "<p>No trace: " << escaped(r.trace_problem) << "</p>\n";
  double span = 0;  // one time scale for every path's timeline
  for (const StageTrace& t : r.traces) span = std::max(span, trace_span_us(t.kernels));
  for (const StageTrace& t : r.traces) timeline(html, t, span);
  html << "</body></html>\n";
  return html.str();
}

Status write_html_report(const RunReport& r, const std::string& path) {
  std::ofstream file(path, std::ios::trunc);
  file << html_report(r);
  file.close();
  if (!file) return invalid_argument("--report", "a writable file", "'" + path + "' (could not be written)");
  note_report_written(path);
  return Status();
}

}  // namespace dsa::cli
