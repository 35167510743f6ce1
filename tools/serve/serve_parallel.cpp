#include "serve_parallel.h"

#include <cstdlib>
#include <thread>

namespace dsa::serve {

int host_threads() {
  if (const char* text = std::getenv("DSA_SERVE_THREADS")) {
    const int n = std::atoi(text);
    if (n >= 1) return std::min(n, 64);
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(std::min(n, 16u));
}

}  // namespace dsa::serve
