#include "bench/serve/serve_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace mobius::bench {
namespace {

std::string PercentileName(double p) { return absl::StrCat("p", absl::StrFormat("%g", p)); }

void AppendLine(std::string& out, absl::string_view label, absl::string_view value) {
  absl::StrAppend(&out, absl::StrFormat("%-40s %s\n", label, value));
}

void AppendSection(std::string& out, absl::string_view title) {
  const int width = 50;
  const int pad = std::max(0, width - static_cast<int>(title.size()));
  absl::StrAppend(&out, std::string(pad / 2, '-'), title, std::string(pad - pad / 2, '-'), "\n");
}

void AppendLatency(std::string& out, absl::string_view title, absl::string_view name,
                   const LatencySummary& s) {
  AppendSection(out, title);
  AppendLine(out, absl::StrCat("Mean ", name, " (ms):"), absl::StrFormat("%.2f", s.mean_ms));
  AppendLine(out, absl::StrCat("Median ", name, " (ms):"), absl::StrFormat("%.2f", s.median_ms));
  AppendLine(out, absl::StrCat("Std ", name, " (ms):"), absl::StrFormat("%.2f", s.std_ms));
  for (const auto& [p, v] : s.percentiles_ms) {
    AppendLine(out, absl::StrCat("P", absl::StrFormat("%g", p), " ", name, " (ms):"),
               absl::StrFormat("%.2f", v));
  }
}

void AddLatency(nlohmann::json& j, absl::string_view name, const LatencySummary& s) {
  j[absl::StrCat("mean_", name, "_ms")] = s.mean_ms;
  j[absl::StrCat("median_", name, "_ms")] = s.median_ms;
  j[absl::StrCat("std_", name, "_ms")] = s.std_ms;
  for (const auto& [p, v] : s.percentiles_ms) {
    j[absl::StrCat(PercentileName(p), "_", name, "_ms")] = v;
  }
}

}  // namespace

std::string FormatServeReport(const ServeMetrics& m) {
  std::string out;
  absl::StrAppend(&out, "============ Serving Benchmark Result ============\n");
  AppendLine(out, "Successful requests:", absl::StrCat(m.completed));
  AppendLine(out, "Failed requests:", absl::StrCat(m.failed));
  AppendLine(out, "Benchmark duration (s):", absl::StrFormat("%.2f", m.duration_s));
  AppendLine(out, "Total input tokens:", absl::StrCat(m.total_input_tokens));
  AppendLine(out, "Total generated tokens:", absl::StrCat(m.total_output_tokens));
  AppendLine(out, "Request throughput (req/s):", absl::StrFormat("%.2f", m.request_throughput));
  AppendLine(out, "Output token throughput (tok/s):", absl::StrFormat("%.2f", m.output_throughput));
  AppendLine(out,
             "Total Token throughput (tok/s):", absl::StrFormat("%.2f", m.total_token_throughput));
  AppendLatency(out, "Time to First Token", "TTFT", m.ttft);
  AppendLatency(out, "Time per Output Token (excl. 1st token)", "TPOT", m.tpot);
  AppendLatency(out, "Inter-token Latency", "ITL", m.itl);
  AppendLatency(out, "End-to-end Latency", "E2EL", m.e2el);
  if (!m.errors.empty()) {
    AppendSection(out, "Failures");
    for (const auto& [reason, count] : m.errors) absl::StrAppend(&out, count, "x ", reason, "\n");
  }
  absl::StrAppend(&out, "==================================================\n");
  return out;
}

nlohmann::json ServeReportJson(const ServeMetrics& m, std::span<const RequestOutcome> outcomes,
                               const nlohmann::json& settings) {
  nlohmann::json j;
  j["settings"] = settings;
  j["duration"] = m.duration_s;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input_tokens;
  j["total_output_tokens"] = m.total_output_tokens;
  j["request_throughput"] = m.request_throughput;
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  AddLatency(j, "ttft", m.ttft);
  AddLatency(j, "tpot", m.tpot);
  AddLatency(j, "itl", m.itl);
  AddLatency(j, "e2el", m.e2el);
  nlohmann::json reasons = nlohmann::json::object();
  for (const auto& [reason, count] : m.errors) reasons[reason] = count;
  j["failure_reasons"] = reasons;
  // Per request, in request order (seconds, as vLLM's result file has them).
  nlohmann::json input_lens = nlohmann::json::array(), output_lens = nlohmann::json::array(),
                 ttfts = nlohmann::json::array(), itls = nlohmann::json::array(),
                 errors = nlohmann::json::array();
  for (const RequestOutcome& o : outcomes) {
    input_lens.push_back(o.prompt_tokens);
    output_lens.push_back(o.output_tokens);
    ttfts.push_back(o.ttft_s);
    itls.push_back(o.itl_s);
    errors.push_back(o.error);
  }
  j["input_lens"] = std::move(input_lens);
  j["output_lens"] = std::move(output_lens);
  j["ttfts"] = std::move(ttfts);
  j["itls"] = std::move(itls);
  j["errors"] = std::move(errors);
  return j;
}

}  // namespace mobius::bench
