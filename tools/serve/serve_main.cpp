// dsa-serve: the serving simulation of the DSA attention stage
// (docs/reliability.md). Exit status 0 when every step ran and every check
// passed, 1 on any mismatch, 2 on a usage error or when the run could not be
// made, 3 when it ended early (--time-limit, SIGTERM, SIGINT) without a
// mismatch: the figures of the steps it ran are still printed and written.
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "serve_options.h"
#include "serve_run.h"

int main(int argc, char** argv) {
  // Every module loaded at context creation: a lazily loaded kernel would
  // change the free device memory the run checks.
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  dsa::serve::ServeOptions options;
  bool help = false;
  if (const dsa::Status s = dsa::serve::parse_serve_options(argc, argv, &options, &help); !s.ok()) {
    std::fprintf(stderr, "dsa-serve: %s (dsa-serve --help lists the options)\n", s.to_string().c_str());
    return 2;
  }
  if (help) {
    std::printf("%s", dsa::serve::serve_usage().c_str());
    return 0;
  }
  // A time limit's SIGTERM (timeout) or a ^C ends the run after its step, with its figures.
  std::signal(SIGTERM, [](int) { dsa::serve::request_serve_stop(); });
  std::signal(SIGINT, [](int) { dsa::serve::request_serve_stop(); });
  if (!options.json_path.empty() && !dsa::serve::write_file_atomically(options.json_path, "")) {
    std::fprintf(stderr, "dsa-serve: argument '--json': expected a writable file, got '%s'\n",
                 options.json_path.c_str());
    return 2;
  }
  dsa::serve::ServeReport report;
  if (const dsa::Status s = dsa::serve::run_serve(options, &report); !s.ok()) {
    std::fprintf(stderr, "dsa-serve: %s\n", s.to_string().c_str());
    // What ran before the error, for the record.
    report.stopped = "error: " + s.to_string();
    if (!options.json_path.empty()) dsa::serve::write_file_atomically(options.json_path, dsa::serve::report_json(report) + "\n");
    return 2;
  }
  const std::string json = dsa::serve::report_json(report);
  std::printf("%s%s\n", dsa::serve::report_text(report).c_str(), json.c_str());
  if (!options.json_path.empty() && !dsa::serve::write_file_atomically(options.json_path, json + "\n")) {
    std::fprintf(stderr, "dsa-serve: argument '--json': expected a writable file, got '%s'\n",
                 options.json_path.c_str());
    return 2;
  }
  if (report.mismatches > 0) {
    std::printf("FAIL: %lld mismatches\n", static_cast<long long>(report.mismatches));
    return 1;
  }
  if (!report.complete()) {
    std::printf("INCOMPLETE: %lld of %lld steps (%s), no mismatch\n", static_cast<long long>(report.steps),
                static_cast<long long>(report.steps_planned), report.stopped.c_str());
    return 3;
  }
  std::printf("PASS\n");
  return 0;
}
