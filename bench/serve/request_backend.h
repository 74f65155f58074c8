// The seam between the load generator and a protocol: one call sends one request and waits for
// the end of its stream, timing every chunk as it arrives.
#ifndef MOBIUS_BENCH_SERVE_REQUEST_BACKEND_H_
#define MOBIUS_BENCH_SERVE_REQUEST_BACKEND_H_

#include "bench/serve/serve_metrics.h"
#include "bench/serve/workload.h"

namespace mobius::bench {

class RequestBackend {
 public:
  virtual ~RequestBackend() = default;

  // Called from many threads at once. Never fails as a call: an unreachable server, an error
  // status or a broken stream comes back as an outcome with success false and the reason in
  // `error` (worded without request-specific details, so that reasons can be counted).
  virtual RequestOutcome Send(const BenchRequest& request) = 0;
};

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_REQUEST_BACKEND_H_
