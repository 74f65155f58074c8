#include "bench/serve/arrival_schedule.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"

namespace mobius::bench {

absl::StatusOr<std::vector<double>> ArrivalOffsets(int num_requests, double request_rate,
                                                   double burstiness, uint64_t seed) {
  if (!(request_rate > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--request-rate must be > 0 (or inf), got ", request_rate));
  }
  if (!(burstiness > 0) || std::isinf(burstiness)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--burstiness must be a finite number > 0, got ", burstiness));
  }
  std::vector<double> offsets(std::max(num_requests, 0), 0.0);
  if (std::isinf(request_rate)) return offsets;
  std::mt19937_64 rng(seed);
  // Scale chosen so that the mean gap, shape * scale, is 1 / rate whatever the burstiness.
  std::gamma_distribution<double> gap(burstiness, 1.0 / (request_rate * burstiness));
  for (size_t i = 1; i < offsets.size(); ++i) offsets[i] = offsets[i - 1] + gap(rng);
  return offsets;
}

}  // namespace mobius::bench
