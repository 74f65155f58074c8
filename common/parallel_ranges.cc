#include "common/parallel_ranges.h"

#include <algorithm>
#include <system_error>
#include <thread>
#include <vector>

namespace mobius {

void ForEachRangeInParallel(size_t n, size_t max_threads, size_t min_per_range,
                            const std::function<void(size_t begin, size_t end)>& fn) {
  if (n == 0) return;
  // Read once: glibc counts the CPUs with a system call (sched_getaffinity) on every ask, and
  // the engine asks on every step.
  static const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::max<size_t>(
      1, std::min({hardware, max_threads, n / std::max<size_t>(1, min_per_range)}));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> workers;
  size_t inline_from = threads;  // ranges this thread runs itself: 0 and those not started
  for (size_t t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(fn, n * t / threads, n * (t + 1) / threads);
    } catch (const std::system_error&) {
      inline_from = t;
      break;
    }
  }
  fn(0, n / threads);
  if (inline_from < threads) fn(n * inline_from / threads, n);
  for (std::thread& w : workers) w.join();
}

}  // namespace mobius
