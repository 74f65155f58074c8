#include "common/parallel_ranges.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace mobius {
namespace {

// The ranges of one call, in the order their calls began.
std::vector<std::pair<size_t, size_t>> Ranges(size_t n, size_t max_threads, size_t min_per_range) {
  std::mutex mu;
  std::vector<std::pair<size_t, size_t>> ranges;
  ForEachRangeInParallel(n, max_threads, min_per_range, [&](size_t begin, size_t end) {
    std::lock_guard<std::mutex> lock(mu);
    ranges.push_back({begin, end});
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

TEST(ParallelRangesTest, RangesCoverEveryIndexOnce) {
  for (size_t n : {0u, 1u, 2u, 3u, 7u, 64u, 1000u}) {
    for (size_t max_threads : {1u, 2u, 16u}) {
      for (size_t min_per_range : {0u, 1u, 2u, 5u}) {
        const auto ranges = Ranges(n, max_threads, min_per_range);
        size_t next = 0;
        for (const auto& [begin, end] : ranges) {
          EXPECT_EQ(begin, next) << n << " " << max_threads << " " << min_per_range;
          EXPECT_LT(begin, end);
          next = end;
        }
        EXPECT_EQ(next, n);
        EXPECT_LE(ranges.size(), std::max<size_t>(1, max_threads));
        if (min_per_range > 0 && n >= min_per_range) {
          for (const auto& [begin, end] : ranges) EXPECT_GE(end - begin, min_per_range);
        }
      }
    }
  }
}

TEST(ParallelRangesTest, RangesRunOnSeveralThreads) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one hardware thread";
  std::mutex mu;
  std::vector<std::thread::id> ids;
  std::atomic<int> arrived{0};
  ForEachRangeInParallel(2, 2, 1, [&](size_t, size_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ids.push_back(std::this_thread::get_id());
    }
    // Both ranges are in flight together: neither returns before the other has started (run
    // one after the other, the first gives up after 10 s and the ids below are equal).
    ++arrived;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < 2 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
  });
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_NE(ids[0], ids[1]);
}

}  // namespace
}  // namespace mobius
