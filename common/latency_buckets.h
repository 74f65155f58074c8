// Histogram buckets, in seconds, of every latency series the router and the worker export, so
// that the two processes' vLLM-named histograms can be compared and aggregated bucket by bucket.
#ifndef MOBIUS_COMMON_LATENCY_BUCKETS_H_
#define MOBIUS_COMMON_LATENCY_BUCKETS_H_

#include <vector>

namespace mobius {

inline std::vector<double> LatencyBucketsSeconds() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
          0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
}

}  // namespace mobius

#endif  // MOBIUS_COMMON_LATENCY_BUCKETS_H_
