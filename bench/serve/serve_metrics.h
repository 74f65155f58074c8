// What one benchmark request measured and the run's summary, with the definitions of vLLM's
// `vllm bench serve` (benchmarks/benchmark_serving.py) so that numbers compare across tools:
// TTFT is the time to the first streamed chunk, ITL every gap between consecutive chunks, TPOT
// (latency - TTFT) / (output tokens - 1) over requests with more than one output token, E2E
// latency the time to the last chunk; percentiles interpolate linearly (numpy's default) and the
// standard deviation is the population one (numpy's np.std).
#ifndef MOBIUS_BENCH_SERVE_SERVE_METRICS_H_
#define MOBIUS_BENCH_SERVE_SERVE_METRICS_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace mobius::bench {

// One request as the client saw it. Times are seconds from the moment the request was sent.
struct RequestOutcome {
  bool success = false;
  std::string error;      // why it failed; empty on success
  int prompt_tokens = 0;  // the server's usage count when it reported one, else the workload's
  int output_tokens = 0;  // the server's usage count when it reported one, else tokens seen
  double ttft_s = 0;
  double latency_s = 0;       // to the last chunk (vLLM's "latency", E2EL)
  std::vector<double> itl_s;  // one per chunk after the first
};

struct LatencySummary {
  double mean_ms = 0;
  double median_ms = 0;
  double std_ms = 0;
  std::vector<std::pair<double, double>> percentiles_ms;  // (percentile, value)
};

struct ServeMetrics {
  int completed = 0;
  int failed = 0;
  int64_t total_input_tokens = 0;   // over completed requests
  int64_t total_output_tokens = 0;  // over completed requests
  double duration_s = 0;
  double request_throughput = 0;      // completed / duration
  double output_throughput = 0;       // output tokens / duration
  double total_token_throughput = 0;  // (input + output tokens) / duration
  LatencySummary ttft;
  LatencySummary tpot;
  LatencySummary itl;
  LatencySummary e2el;
  std::map<std::string, int> errors;  // failure reason -> requests
};

// numpy.percentile(values, p) with the default linear interpolation; 0 for no values (vLLM
// summarises an empty list as [0]).
double Percentile(std::vector<double> values, double p);

// Mean, median, population std and the given percentiles of `seconds`, in milliseconds.
LatencySummary Summarize(std::span<const double> seconds, std::span<const double> percentiles);

ServeMetrics ComputeServeMetrics(std::span<const RequestOutcome> outcomes, double duration_s,
                                 std::span<const double> percentiles);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_SERVE_METRICS_H_
