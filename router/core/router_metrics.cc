#include "router/core/router_metrics.h"

#include <algorithm>
#include <utility>

#include "common/latency_buckets.h"
#include "prometheus/metric_family.h"

namespace mobius::router {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

prometheus::MetricFamily ReplicaFamily(std::string name, std::string help,
                                       prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  return family;
}

void AddReplicaValue(prometheus::MetricFamily& family, const std::string& replica, double value) {
  prometheus::ClientMetric metric;
  metric.label.push_back({"replica", replica});
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
}

}  // namespace

RouterMetrics::RouterMetrics(const ReplicaSet* replicas)
    : replicas_(replicas),
      registry_(std::make_shared<prometheus::Registry>()),
      requests_(BuildCounter()
                    .Name("mobius_router_requests_total")
                    .Help("Generate requests by front end (protocol: grpc, http) and final status "
                          "(code: the canonical status name, e.g. OK, INVALID_ARGUMENT).")
                    .Register(*registry_)),
      retries_(BuildCounter()
                   .Name("mobius_router_retries_total")
                   .Help("Requests tried again on another replica after theirs failed before "
                         "the first token.")
                   .Register(*registry_)
                   .Add({})),
      in_flight_(BuildGauge()
                     .Name("mobius_router_requests_in_flight")
                     .Help("Requests admitted and not finished (streaming or waiting at a "
                           "worker).")
                     .Register(*registry_)
                     .Add({})),
      time_to_first_token_(BuildHistogram()
                               .Name("vllm:time_to_first_token_seconds")
                               .Help("Time from arrival at the router to the first token sent "
                                     "to the client.")
                               .Register(*registry_)),
      inter_token_latency_(BuildHistogram()
                               .Name("vllm:inter_token_latency_seconds")
                               .Help("Time between consecutive token chunks sent to a client.")
                               .Register(*registry_)),
      e2e_latency_(BuildHistogram()
                       .Name("vllm:e2e_request_latency_seconds")
                       .Help("Time from arrival at the router to the final message of a "
                             "request that completed.")
                       .Register(*registry_)),
      prompt_tokens_(BuildCounter()
                         .Name("vllm:prompt_tokens_total")
                         .Help("Prompt tokens of requests placed on a replica (once per request, "
                               "retries not counted again).")
                         .Register(*registry_)),
      generation_tokens_(BuildCounter()
                             .Name("vllm:generation_tokens_total")
                             .Help("Generated tokens sent to clients.")
                             .Register(*registry_)) {
  // The success series exist from the start, so that rate() has a baseline before the first
  // request.
  for (const char* protocol : {"grpc", "http"})
    requests_.Add({{"protocol", protocol}, {"code", "OK"}});
}

RouterMetrics::ModelSeries RouterMetrics::ForModel(const std::string& model_name) {
  const prometheus::Labels labels = {{"model_name", model_name}};
  return ModelSeries{
      &time_to_first_token_.Add(labels, LatencyBucketsSeconds()),
      &inter_token_latency_.Add(labels, LatencyBucketsSeconds()),
      &e2e_latency_.Add(labels, LatencyBucketsSeconds()),
      &prompt_tokens_.Add(labels),
      &generation_tokens_.Add(labels),
  };
}

void RouterMetrics::RequestFinished(std::string_view protocol, absl::StatusCode code) {
  requests_.Add({{"protocol", std::string(protocol)}, {"code", absl::StatusCodeToString(code)}})
      .Increment();
}

std::vector<prometheus::MetricFamily> RouterMetrics::Collect() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  if (replicas_ == nullptr) return families;
  prometheus::MetricFamily healthy = ReplicaFamily(
      "mobius_router_replica_healthy",
      "1 while the replica passes health checks and serves the router's model, else 0.",
      prometheus::MetricType::Gauge);
  prometheus::MetricFamily outstanding = ReplicaFamily(
      "mobius_router_replica_outstanding_tokens",
      "Outstanding tokens the router routes by: the larger of its own count and the worker's "
      "last GetLoads report.",
      prometheus::MetricType::Gauge);
  prometheus::MetricFamily sent =
      ReplicaFamily("mobius_router_replica_requests_total",
                    "Request attempts the router placed on the replica (retries included).",
                    prometheus::MetricType::Counter);
  for (const ReplicaSnapshot& r : replicas_->Snapshot()) {
    AddReplicaValue(healthy, r.address, r.healthy && r.compatible ? 1 : 0);
    AddReplicaValue(
        outstanding, r.address,
        static_cast<double>(std::max(r.outstanding_tokens, r.reported_outstanding_tokens)));
    AddReplicaValue(sent, r.address, static_cast<double>(r.requests_sent));
  }
  families.push_back(std::move(healthy));
  families.push_back(std::move(outstanding));
  families.push_back(std::move(sent));
  return families;
}

}  // namespace mobius::router
