// Runs a function over contiguous ranges of [0, n) on a few threads: the host's share of work
// that is independent per row (sampling rows of logits), where a thread pool would be more
// machinery than the work needs.
#ifndef MOBIUS_COMMON_PARALLEL_RANGES_H_
#define MOBIUS_COMMON_PARALLEL_RANGES_H_

#include <cstddef>
#include <functional>

namespace mobius {

// Calls fn(begin, end) over [0, n) split into contiguous ranges: at most `max_threads` of them
// (fewer for hardware with fewer threads), each at least `min_per_range` long (the last ranges
// may be shorter only when n is). The calling thread takes the first range and every range
// whose thread cannot be created (a process limit); returns when all are done.
void ForEachRangeInParallel(size_t n, size_t max_threads, size_t min_per_range,
                            const std::function<void(size_t begin, size_t end)>& fn);

}  // namespace mobius

#endif  // MOBIUS_COMMON_PARALLEL_RANGES_H_
