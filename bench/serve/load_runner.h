// Drives a benchmark: sends the requests at their arrival times (arrival_schedule.h) with at most
// `max_concurrency` in flight, one thread per request in flight, and reports progress while it
// runs. The duration runs from the first send to the end of the last stream, as in vLLM.
#ifndef MOBIUS_BENCH_SERVE_LOAD_RUNNER_H_
#define MOBIUS_BENCH_SERVE_LOAD_RUNNER_H_

#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/serve/request_backend.h"
#include "bench/serve/serve_metrics.h"
#include "bench/serve/workload.h"

namespace mobius::bench {

struct LoadOptions {
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1;
  int max_concurrency = 0;         // 0: no limit
  uint64_t seed = 0;               // of the arrival times
  double progress_interval_s = 1;  // 0: no progress lines
  FILE* progress = stderr;
  const char* label = "bench";  // prefix of progress lines
};

struct LoadResult {
  std::vector<RequestOutcome> outcomes;  // in request order
  double duration_s = 0;
};

// InvalidArgument for a bad rate, burstiness or concurrency; request failures are outcomes.
absl::StatusOr<LoadResult> RunLoad(RequestBackend& backend, std::span<const BenchRequest> requests,
                                   const LoadOptions& options);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_LOAD_RUNNER_H_
