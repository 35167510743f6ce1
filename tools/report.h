// What the GPU path found: its checks, its timings, printed as tables and
// written as JSON in the benchmarks' style (DESIGN.md section 4).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dsa_decode/status.h"
#include "kernel_trace.h"
#include "synthetic_layer.h"

namespace dsa::cli {

struct Options;  // options.h

struct Check {
  enum class Verdict { kPass, kFail, kInfo };  // kInfo: reported, not judged
  std::string name;
  Verdict verdict;
  std::string detail;
};

// One timed CUDA graph: a step of the stage alone, or a run of its steps.
struct Timing {
  std::string name;   // JSON row name, e.g. "absorb"
  std::string label;  // table text, e.g. "absorb + cache write (head_gemv)"
  std::string path;   // "shared", "fused" or "stock"
  bool single_kernel = true;
  double us = 0;      // median per run of the graph's launches
  double bytes = 0;   // what its kernels must move at the least: the memory floor's bytes
  int baseline = -1;  // index of the stock timing a fused one replaces, -1: none
};

// Each fused timing's baseline: the stock timing it replaces, for every
// (fused, stock) pair of names both present in timings.
void set_baselines(std::vector<Timing>& timings, const std::vector<std::pair<const char*, const char*>>& pairs);

// --trace: one whole stage's kernels, the middle stage of one launch of the
// timed graph (every stage in turn), in order of start.
struct StageTrace {
  std::string path;                   // "fused" or "stock"
  std::vector<TracedKernel> kernels;  // times from the first kernel's start
  // CUPTI's stream ids in order of first appearance, printed as s0, s1, ...:
  // a graph launch runs its branches on streams of the runtime's choosing,
  // not on the ones they were captured on.
  std::vector<uint32_t> streams;
  StageNeighbours neighbours = {std::nan(""), std::nan("")};  // stage_neighbours (kernel_trace.h)
};

struct RunReport {
  std::string gpu, commit, date;
  double copy_GBps = 0;
  StepShape shape{};
  int steps = 0;
  int weight_copies = 0;        // one stage each
  std::string value_up_kernel;  // what the fused path's value-up ran: "head_gemv" or "cuBLAS bmm"
  std::string value_up_reason;  // why (choose_value_up)
  std::string projections_option;  // --projections: "auto", "gemv" or "cublaslt"
  // The kernel ("GEMV" or "cuBLASLt") of each of the fused path's projections, in step order:
  // qkv_a_proj (both paths'), q_b_proj, o_proj (the stock path's: cuBLASLt).
  std::vector<std::pair<std::string, std::string>> fused_projection_kernels;
  std::string indexer_projections_kernel;  // both paths': "indexer_project_gemv" or "indexer_project"
  std::string indexer_logits;   // both selects' (dsa_decode/choices.h names)
  std::string head_gemv_sums;   // the fused path's head_gemv
  std::string attention_plan;   // both paths' sparse_mla plan
  bool batch_invariant = false;  // --batch-invariant
  std::vector<Check> checks;
  std::vector<Timing> timings;
  std::vector<StageTrace> traces;  // --trace
  std::string trace_problem;       // --trace: why there is no trace (the run's checks and timings stand)
  std::string note;                // the JSON's note on what ran; empty: the NoPE stage's
};

// printf into a std::string (up to 511 characters).
std::string format(const char* pattern, ...) __attribute__((format(printf, 1, 2)));
// A judged check (PASS or FAIL), or one only reported (info).
Check judged(std::string name, bool pass, std::string detail);
Check reported(std::string name, std::string detail);
size_t failed_checks(const std::vector<Check>& checks);
size_t judged_checks(const std::vector<Check>& checks);  // PASS or FAIL, not info

// What the CPU path computed and found (dsa-decode without a GPU, or --cpu).
struct CpuRow {
  std::string kernel;  // e.g. "absorb"; several outputs of one kernel share it
  std::string output;  // e.g. "q_fp8 [4, 64, 512] e4m3"
  double ms = -1;      // CPU time; < 0: the row's kernel is the previous row's
  uint64_t fingerprint = 0;
};

struct CpuReport {
  std::string commit, date;
  std::string why_cpu;  // "--cpu", or why no GPU was used
  StepShape shape{};
  uint64_t seed = 0;
  std::vector<CpuRow> rows;
  std::vector<Check> checks;  // the chain's products against float64 (the contract's bounds)
  double chain_ms = 0, prefill_ms = 0, elapsed_s = 0;
};

void print_check(const Check& check);
void print_timings(const RunReport& report);
void print_trace(const StageTrace& trace, int weight_copies);
Status write_json(const RunReport& report, const std::string& path);
Status write_cpu_json(const CpuReport& report, const std::string& path);

// The report files this process wrote (write_json, write_cpu_json,
// write_html_report record each path they wrote; defined in
// html_report.cpp, which every target writing a report links), so that
// dsa-decode can refuse to end as if a --json or --report it was given had
// been written.
void note_report_written(const std::string& path);
bool report_written(const std::string& path);

// One timing of the RoPE presets' stage on the GPU path (tools/gpu_path_rope.cpp):
// the path ("fused" or "stock"), the step (a name from
// DsaAttentionStage::step_names, or "attention half (norm .. value_up)" or
// "whole stage (qkv_a_proj .. o_proj)") and its median microseconds.
struct StageStepTime {
  std::string path, step;
  double us = 0;
};

// The RoPE presets' GPU run (the step kernel by kernel, then the stage) as
// the report --json and --report write (RunReport, the NoPE path's form):
// the checks in the order run (the chain's, then the stage's); one timing
// per stage step of each path (the NoPE rows' names where the step is the
// same, "rope_absorb" and "cache_write_v32" for the RoPE ones; stock rows
// "stock_<name>"), the attention halves ("chain", "stock_chain"), the whole
// stages ("whole_stage", "stock_whole_stage") and the GPU chain kernel by
// kernel ("gpu_chain": one weight copy, not rotated), each with the bytes of
// its memory floor; the fused q_b_proj, value-up, o_proj, halves and whole
// stage against the stock ones they replace. An unknown step name is an
// error naming it (the stage changed: the rows would be mislabelled).
// With options.trace (--report turns it on): trace_problem says that this
// path takes no trace.
Status rope_run_report(const StepShape& s, const Options& options, const std::string& gpu, double copy_GBps,
                       int weight_copies, const std::vector<Check>& checks, const std::vector<StageStepTime>& times,
                       double gpu_chain_us, RunReport* report);

// Writes --json (write_json) and --report (write_html_report) where the
// options name them, printing "wrote FILE" for each; the first failure.
Status write_run_reports(const RunReport& report, const Options& options);

}  // namespace dsa::cli
