// dsa-serve's host parallelism: the CPU references of a step (the sampled
// tokens' attention and logits, a prompt's prefill in the model) split over
// threads, each part writing only its own outputs, so the results are those
// of the sequential calls bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace dsa::serve {

// Threads for the host work: the machine's, at most 16 (DSA_SERVE_THREADS
// overrides; 1 runs everything on the calling thread).
int host_threads();

// fn(begin, end) over [0, count) in at most `threads` contiguous parts whose
// boundaries are multiples of `grain` (the last part takes the rest).
template <class F>
void parallel_for(int64_t count, int64_t grain, int threads, F fn) {
  if (count <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (count + grain - 1) / grain;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, units));
  if (parts == 1) {
    fn(int64_t{0}, count);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(size_t(parts - 1));
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t begin = std::min(count, units * i / parts * grain);
    const int64_t end = i + 1 == parts ? count : std::min(count, units * (i + 1) / parts * grain);
    if (i + 1 == parts) {
      fn(begin, end);
    } else {
      workers.emplace_back([=] { fn(begin, end); });
    }
  }
  for (std::thread& w : workers) w.join();
}

}  // namespace dsa::serve
