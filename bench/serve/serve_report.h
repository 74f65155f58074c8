// The benchmark's results as text (vLLM's "Serving Benchmark Result" table, plus std and the
// failure reasons) and as JSON (vLLM's result keys, plus per-request arrays and the run's
// settings).
#ifndef MOBIUS_BENCH_SERVE_SERVE_REPORT_H_
#define MOBIUS_BENCH_SERVE_SERVE_REPORT_H_

#include <span>
#include <string>

#include "bench/serve/serve_metrics.h"
#include "nlohmann/json.hpp"

namespace mobius::bench {

std::string FormatServeReport(const ServeMetrics& metrics);

// `settings` (the command line's choices) is copied in under "settings".
nlohmann::json ServeReportJson(const ServeMetrics& metrics,
                               std::span<const RequestOutcome> outcomes,
                               const nlohmann::json& settings);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_SERVE_REPORT_H_
