#include "serve_options.h"

#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "dsa_decode/indexer.h"

namespace dsa::serve {

std::string serve_usage() {
  return "usage: dsa-serve [options]\n"
         "  A serving simulation of the DSA attention stage on the GPU: requests with random prompts share a\n"
         "  pool of KV blocks and indexer pages, decode in steps of 1..16 tokens, finish and free their blocks;\n"
         "  every step checked against the CPU references, the whole state every --check-every steps, faults\n"
         "  injected and isolated.\n"
         "  --steps N            decode steps (default 1000)\n"
         "  --seed N             seed of everything drawn (default 1)\n"
         "  --max-context N      the plan's max_context, a multiple of 256 from 1024 (default 131072)\n"
         "  --tp 1|8             glm5next on one of 1 or 8 ranks (default 8)\n"
         "  --path fused|stock|both  the stage's path; both: drawn per step (default both)\n"
         "  --batch-invariant    DsaStagePlan::batch_invariant\n"
         "  --index-heads N, --index-pool N, --index-topk N\n"
         "                       the indexer's shape (default the preset's: 32, 4, 2048)\n"
         "  --faults LIST        all, none or a comma-separated list of fault kinds (default all)\n"
         "  --fault-every N      a fault on about one step in N (default 8)\n"
         "  --check-every N      the whole-state check every N steps (default 100)\n"
         "  --sample-tokens N    tokens per step checked against the references (default 2)\n"
         "  --blocks N           KV blocks in the pool (default 3 * max_context / 256 + 64)\n"
         "  --rows N             block table rows: the most live requests (default 16)\n"
         "  --json FILE          also write the summary to FILE (rewritten at every state check)\n"
         "  --time-limit S       begin no step after S seconds; the run then ends as at --steps, reports the\n"
         "                       steps it ran and exits 3 (0 = no limit, the default; SIGTERM and SIGINT\n"
         "                       end it the same way)\n";
}

namespace {

Status parse_int(const std::string& option, const char* text, int64_t low, int64_t high, int64_t* out) {
  const std::string expected = "an integer from " + std::to_string(low) + " to " + std::to_string(high);
  if (text == nullptr) return invalid_argument(option, expected, "nothing");
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < low || value > high) {
    return invalid_argument(option, expected, std::string("'") + text + "'");
  }
  *out = value;
  return Status();
}

}  // namespace

Status parse_serve_options(int argc, const char* const* argv, ServeOptions* o, bool* help) {
  *help = false;
  *o = ServeOptions{};
  DSA_RETURN_IF_ERROR(parse_faults("all", &o->faults));
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : nullptr;
    int64_t n = 0;
    if (arg == "--help" || arg == "-h") {
      *help = true;
      return Status();
    } else if (arg == "--batch-invariant") {
      o->batch_invariant = true;
      continue;
    } else if (arg == "--steps") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 1, int64_t{1} << 40, &n));
      o->steps = n;
    } else if (arg == "--seed") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 0, INT64_MAX, &n));
      o->seed = uint64_t(n);
    } else if (arg == "--max-context") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 1024, kIndexerMaxContext, &n));
      if (n % 256 != 0) return invalid_argument(arg, "a multiple of 256 (the block size)", std::string("'") + value + "'");
      o->max_context = n;
    } else if (arg == "--tp") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 1, 8, &n));
      if (n != 1 && n != 8) return invalid_argument(arg, "1 or 8", std::string("'") + value + "'");
      o->tp = int(n);
    } else if (arg == "--path") {
      if (value == nullptr || (std::string(value) != "fused" && std::string(value) != "stock" &&
                               std::string(value) != "both")) {
        return invalid_argument(arg, "fused, stock or both", value == nullptr ? "nothing" : std::string("'") + value + "'");
      }
      o->path = value;
    } else if (arg == "--faults") {
      if (value == nullptr) return invalid_argument(arg, "all, none or a list of fault kinds", "nothing");
      DSA_RETURN_IF_ERROR(parse_faults(value, &o->faults));
    } else if (arg == "--fault-every") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 0, 1000000, &n));
      o->fault_every = int(n);
    } else if (arg == "--check-every") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 1, 1000000, &n));
      o->check_every = int(n);
    } else if (arg == "--sample-tokens") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 0, 16, &n));
      o->sample_tokens = int(n);
    } else if (arg == "--blocks") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 16, int64_t{1} << 22, &n));
      o->blocks = n;
    } else if (arg == "--rows") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 1, 1024, &n));
      o->rows = int(n);
    } else if (arg == "--time-limit") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 0, 1000000, &n));
      o->time_limit = double(n);
    } else if (arg == "--index-heads" || arg == "--index-pool" || arg == "--index-topk") {
      DSA_RETURN_IF_ERROR(parse_int(arg, value, 1, 1 << 20, &n));
      (arg == "--index-heads" ? o->index_heads : arg == "--index-pool" ? o->index_pool : o->index_topk) = int(n);
    } else if (arg == "--json") {
      if (value == nullptr) return invalid_argument(arg, "a file name", "nothing");
      o->json_path = value;
    } else {
      return invalid_argument(arg, "an option of dsa-serve (--help lists them)", "'" + arg + "'");
    }
    ++i;  // the option's value
  }
  return Status();
}

}  // namespace dsa::serve
