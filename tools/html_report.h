// dsa-decode --report FILE.html: a run's results as one self-contained page
// (inline SVG and CSS, no scripts, nothing fetched): the checks, the fused
// against the stock table, each timing as a bar beside its memory floor, and
// with traces (--trace) a timeline per path of the kernels on their streams,
// the idle gaps and the estimated critical path.
#pragma once

#include <string>
#include <vector>

#include "report.h"

namespace dsa::cli {

// The critical path of one traced stage, estimated from the records alone:
// from the kernel that ends last, back through the kernel that ended last
// among those that started before it (and ended no later). Indices into
// trace.kernels, in order of start.
std::vector<size_t> estimated_critical_path(const StageTrace& trace);

std::string html_report(const RunReport& report);
Status write_html_report(const RunReport& report, const std::string& path);

}  // namespace dsa::cli
