#include "bench/serve/load_runner.h"

#include <chrono>
#include <system_error>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/serve/arrival_schedule.h"

namespace mobius::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Counters {
  absl::Mutex mu;
  int in_flight ABSL_GUARDED_BY(mu) = 0;
  int done ABSL_GUARDED_BY(mu) = 0;
  int failed ABSL_GUARDED_BY(mu) = 0;
  bool finished ABSL_GUARDED_BY(mu) = false;
  std::vector<size_t> exited ABSL_GUARDED_BY(mu);  // requests whose thread is ready to join
};

}  // namespace

absl::StatusOr<LoadResult> RunLoad(RequestBackend& backend, std::span<const BenchRequest> requests,
                                   const LoadOptions& options) {
  if (options.max_concurrency < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-concurrency must be >= 0, got ", options.max_concurrency));
  }
  absl::StatusOr<std::vector<double>> offsets = ArrivalOffsets(
      static_cast<int>(requests.size()), options.request_rate, options.burstiness, options.seed);
  if (!offsets.ok()) return offsets.status();
  const int limit =
      options.max_concurrency > 0 ? options.max_concurrency : std::numeric_limits<int>::max();
  LoadResult result;
  result.outcomes.resize(requests.size());
  Counters counters;
  const Clock::time_point start = Clock::now();

  std::thread progress;
  if (options.progress != nullptr && options.progress_interval_s > 0) {
    progress = std::thread([&] {
      const absl::Duration interval = absl::Seconds(options.progress_interval_s);
      absl::MutexLock lock(&counters.mu);
      while (!counters.mu.AwaitWithTimeout(absl::Condition(&counters.finished), interval)) {
        std::fprintf(options.progress, "%s: %d/%zu done, %d failed, %d in flight, %.1f s\n",
                     options.label, counters.done, requests.size(), counters.failed,
                     counters.in_flight,
                     std::chrono::duration<double>(Clock::now() - start).count());
        std::fflush(options.progress);
      }
    });
  }

  // Threads are joined as their requests end, so that a long run holds only the stacks of the
  // requests in flight.
  std::vector<std::thread> threads(requests.size());
  std::vector<size_t> exited;
  auto join_exited = [&] {
    {
      absl::MutexLock lock(&counters.mu);
      exited.swap(counters.exited);
    }
    for (size_t j : exited) threads[j].join();
    exited.clear();
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>((*offsets)[i])));
    {
      absl::MutexLock lock(&counters.mu);
      auto has_slot = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(counters.mu) {
        return counters.in_flight < limit;
      };
      counters.mu.Await(absl::Condition(&has_slot));
      ++counters.in_flight;
    }
    auto run = [&, i] {
      RequestOutcome outcome = backend.Send(requests[i]);
      const bool failed = !outcome.success;
      result.outcomes[i] = std::move(outcome);
      absl::MutexLock lock(&counters.mu);
      --counters.in_flight;
      ++counters.done;
      counters.failed += failed;
      counters.exited.push_back(i);
    };
    join_exited();
    try {
      threads[i] = std::thread(run);
    } catch (const std::system_error& e) {
      // Out of threads is a failed request, not a crashed benchmark.
      result.outcomes[i].error = absl::StrCat("cannot start a request thread: ", e.what());
      absl::MutexLock lock(&counters.mu);
      --counters.in_flight;
      ++counters.done;
      ++counters.failed;
    }
  }
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
  result.duration_s = std::chrono::duration<double>(Clock::now() - start).count();
  {
    absl::MutexLock lock(&counters.mu);
    counters.finished = true;
  }
  if (progress.joinable()) progress.join();
  return result;
}

}  // namespace mobius::bench
