#include "bench/serve/serve_metrics.h"

#include <algorithm>
#include <cmath>

namespace mobius::bench {

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(rank));
  const size_t above = std::min(below + 1, values.size() - 1);
  const double fraction = rank - static_cast<double>(below);
  return values[below] + (values[above] - values[below]) * fraction;
}

LatencySummary Summarize(std::span<const double> seconds, std::span<const double> percentiles) {
  LatencySummary s;
  std::vector<double> ms(seconds.begin(), seconds.end());
  for (double& v : ms) v *= 1e3;
  if (!ms.empty()) {
    double sum = 0;
    for (double v : ms) sum += v;
    s.mean_ms = sum / static_cast<double>(ms.size());
    double squares = 0;
    for (double v : ms) squares += (v - s.mean_ms) * (v - s.mean_ms);
    s.std_ms = std::sqrt(squares / static_cast<double>(ms.size()));
  }
  s.median_ms = Percentile(ms, 50);
  for (double p : percentiles) s.percentiles_ms.emplace_back(p, Percentile(ms, p));
  return s;
}

ServeMetrics ComputeServeMetrics(std::span<const RequestOutcome> outcomes, double duration_s,
                                 std::span<const double> percentiles) {
  ServeMetrics m;
  m.duration_s = duration_s;
  std::vector<double> ttfts, tpots, itls, e2els;
  for (const RequestOutcome& o : outcomes) {
    if (!o.success) {
      ++m.failed;
      ++m.errors[o.error.empty() ? "unknown error" : o.error];
      continue;
    }
    ++m.completed;
    m.total_input_tokens += o.prompt_tokens;
    m.total_output_tokens += o.output_tokens;
    // A single output token has no decode time to spread; vLLM leaves such requests out of TPOT.
    if (o.output_tokens > 1) tpots.push_back((o.latency_s - o.ttft_s) / (o.output_tokens - 1));
    itls.insert(itls.end(), o.itl_s.begin(), o.itl_s.end());
    ttfts.push_back(o.ttft_s);
    e2els.push_back(o.latency_s);
  }
  if (duration_s > 0) {
    m.request_throughput = m.completed / duration_s;
    m.output_throughput = static_cast<double>(m.total_output_tokens) / duration_s;
    m.total_token_throughput =
        static_cast<double>(m.total_input_tokens + m.total_output_tokens) / duration_s;
  }
  m.ttft = Summarize(ttfts, percentiles);
  m.tpot = Summarize(tpots, percentiles);
  m.itl = Summarize(itls, percentiles);
  m.e2el = Summarize(e2els, percentiles);
  return m;
}

}  // namespace mobius::bench
