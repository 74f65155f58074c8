// The summary statistics against values computed by hand with vLLM's definitions (numpy's
// linear-interpolation percentiles, population std, TPOT over requests with > 1 output token).
#include "bench/serve/serve_metrics.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

constexpr double kTol = 1e-6;

TEST(PercentileTest, MatchesNumpyLinearInterpolation) {
  // np.percentile([1, 2, 3, 4], q) for q = 0, 25, 50, 99, 100.
  const std::vector<double> v = {4, 1, 3, 2};
  EXPECT_NEAR(Percentile(v, 0), 1.0, kTol);
  EXPECT_NEAR(Percentile(v, 25), 1.75, kTol);
  EXPECT_NEAR(Percentile(v, 50), 2.5, kTol);
  EXPECT_NEAR(Percentile(v, 99), 3.97, kTol);
  EXPECT_NEAR(Percentile(v, 100), 4.0, kTol);
  EXPECT_NEAR(Percentile({10, 1, 7}, 99), 9.94, kTol);
  EXPECT_NEAR(Percentile({5}, 99), 5.0, kTol);
  EXPECT_EQ(Percentile({}, 50), 0.0);  // vLLM summarises an empty list as [0]
}

TEST(SummarizeTest, MeanMedianPopulationStdInMilliseconds) {
  const std::vector<double> seconds = {0.001, 0.002, 0.003, 0.004};
  const std::vector<double> percentiles = {90, 99};
  LatencySummary s = Summarize(seconds, percentiles);
  EXPECT_NEAR(s.mean_ms, 2.5, kTol);
  EXPECT_NEAR(s.median_ms, 2.5, kTol);
  EXPECT_NEAR(s.std_ms, std::sqrt(1.25), kTol);  // np.std, ddof 0
  ASSERT_EQ(s.percentiles_ms.size(), 2u);
  EXPECT_EQ(s.percentiles_ms[0].first, 90);
  EXPECT_NEAR(s.percentiles_ms[0].second, 3.7, kTol);
  EXPECT_NEAR(s.percentiles_ms[1].second, 3.97, kTol);
  LatencySummary empty = Summarize({}, percentiles);
  EXPECT_EQ(empty.mean_ms, 0);
  EXPECT_EQ(empty.std_ms, 0);
  EXPECT_EQ(empty.percentiles_ms[1].second, 0);
}

RequestOutcome Ok(int prompt, int output, double ttft, double latency, std::vector<double> itl) {
  RequestOutcome o;
  o.success = true;
  o.prompt_tokens = prompt;
  o.output_tokens = output;
  o.ttft_s = ttft;
  o.latency_s = latency;
  o.itl_s = std::move(itl);
  return o;
}

TEST(ComputeServeMetricsTest, HandComputedRun) {
  std::vector<RequestOutcome> outcomes;
  outcomes.push_back(Ok(10, 5, 0.1, 0.5, {0.1, 0.1, 0.1, 0.1}));  // TPOT 0.4 / 4 = 0.1
  outcomes.push_back(Ok(20, 3, 0.2, 0.6, {0.1, 0.3}));            // TPOT 0.4 / 2 = 0.2
  outcomes.push_back(Ok(5, 1, 0.3, 0.3, {}));                     // one token: no TPOT
  RequestOutcome failed;
  failed.error = "HTTP 503: no replica";
  failed.output_tokens = 7;  // ignored: failures count nothing
  outcomes.push_back(failed);
  outcomes.push_back(failed);
  const std::vector<double> percentiles = {99};
  ServeMetrics m = ComputeServeMetrics(outcomes, 2.0, percentiles);

  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.errors.at("HTTP 503: no replica"), 2);
  EXPECT_EQ(m.total_input_tokens, 35);
  EXPECT_EQ(m.total_output_tokens, 9);
  EXPECT_NEAR(m.request_throughput, 1.5, kTol);
  EXPECT_NEAR(m.output_throughput, 4.5, kTol);
  EXPECT_NEAR(m.total_token_throughput, 22.0, kTol);

  // TTFT {100, 200, 300} ms.
  EXPECT_NEAR(m.ttft.mean_ms, 200, kTol);
  EXPECT_NEAR(m.ttft.median_ms, 200, kTol);
  EXPECT_NEAR(m.ttft.std_ms, std::sqrt(20000.0 / 3), kTol);
  EXPECT_NEAR(m.ttft.percentiles_ms[0].second, 298, kTol);
  // TPOT {100, 200} ms.
  EXPECT_NEAR(m.tpot.mean_ms, 150, kTol);
  EXPECT_NEAR(m.tpot.median_ms, 150, kTol);
  EXPECT_NEAR(m.tpot.std_ms, 50, kTol);
  EXPECT_NEAR(m.tpot.percentiles_ms[0].second, 199, kTol);
  // ITL: all gaps of all requests pooled, {100 x5, 300} ms.
  EXPECT_NEAR(m.itl.mean_ms, 800.0 / 6, kTol);
  EXPECT_NEAR(m.itl.median_ms, 100, kTol);
  EXPECT_NEAR(m.itl.std_ms, std::sqrt(33333.333333333 / 6), 1e-4);
  EXPECT_NEAR(m.itl.percentiles_ms[0].second, 290, kTol);
  // E2EL {500, 600, 300} ms.
  EXPECT_NEAR(m.e2el.mean_ms, 1400.0 / 3, kTol);
  EXPECT_NEAR(m.e2el.median_ms, 500, kTol);
  EXPECT_NEAR(m.e2el.percentiles_ms[0].second, 598, kTol);
}

TEST(ComputeServeMetricsTest, AllFailedGivesZerosNotNaN) {
  RequestOutcome failed;
  failed.error = "connect 127.0.0.1:1: Connection refused";
  std::vector<RequestOutcome> outcomes(3, failed);
  ServeMetrics m = ComputeServeMetrics(outcomes, 0.5, std::vector<double>{99});
  EXPECT_EQ(m.completed, 0);
  EXPECT_EQ(m.failed, 3);
  EXPECT_EQ(m.errors.at(failed.error), 3);
  EXPECT_EQ(m.request_throughput, 0);
  EXPECT_EQ(m.ttft.mean_ms, 0);
  EXPECT_FALSE(std::isnan(m.itl.std_ms));
}

}  // namespace
}  // namespace mobius::bench
