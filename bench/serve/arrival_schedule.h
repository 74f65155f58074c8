// When each benchmark request is sent, as vLLM's `bench serve` spaces them: the first at once,
// then gaps drawn from a gamma distribution with shape `burstiness` and mean 1/rate (burstiness 1
// is exponential gaps, i.e. Poisson arrivals; below 1 burstier, above 1 more regular). An
// infinite rate sends everything at time 0.
#ifndef MOBIUS_BENCH_SERVE_ARRIVAL_SCHEDULE_H_
#define MOBIUS_BENCH_SERVE_ARRIVAL_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::bench {

// Send times in seconds from the start, non-decreasing, one per request; the same seed gives the
// same schedule. InvalidArgument for a rate <= 0 or NaN, or a burstiness <= 0.
absl::StatusOr<std::vector<double>> ArrivalOffsets(int num_requests, double request_rate,
                                                   double burstiness, uint64_t seed);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_ARRIVAL_SCHEDULE_H_
