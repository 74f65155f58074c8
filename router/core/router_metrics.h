// The router's Prometheus series. `mobius_router_*`: requests by protocol and final status,
// retries, requests in flight, and per-replica health, load and requests sent (read from the
// ReplicaSet at each scrape). `vllm:*`: the latency histograms and token counters that vLLM's
// dashboards and autoscalers read, under the worker's names and buckets, but measured at the
// router, so they include routing, the network and retries. docs/router.md lists every series.
#ifndef MOBIUS_ROUTER_CORE_ROUTER_METRICS_H_
#define MOBIUS_ROUTER_CORE_ROUTER_METRICS_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "router/core/replica_set.h"

namespace mobius::router {

class RouterMetrics final : public prometheus::Collectable {
 public:
  // `replicas` (may be null: no per-replica series) must outlive every Collect call.
  explicit RouterMetrics(const ReplicaSet* replicas = nullptr);

  // The `vllm:*` series of one served model (label `model_name`, as the worker's), looked up
  // once per request.
  struct ModelSeries {
    prometheus::Histogram* time_to_first_token;
    prometheus::Histogram* inter_token_latency;
    prometheus::Histogram* e2e_latency;
    prometheus::Counter* prompt_tokens;
    prometheus::Counter* generation_tokens;
  };
  ModelSeries ForModel(const std::string& model_name);

  // A Generate call of a front end ("grpc" or "http") ended with `code`.
  void RequestFinished(std::string_view protocol, absl::StatusCode code);
  // A request is tried again on another replica.
  void Retried() { retries_.Increment(); }
  [[nodiscard]] prometheus::Gauge& in_flight() { return in_flight_; }

  // The registry's series plus the per-replica ones, as of now.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const ReplicaSet* const replicas_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Counter& retries_;
  prometheus::Gauge& in_flight_;
  prometheus::Family<prometheus::Histogram>& time_to_first_token_;
  prometheus::Family<prometheus::Histogram>& inter_token_latency_;
  prometheus::Family<prometheus::Histogram>& e2e_latency_;
  prometheus::Family<prometheus::Counter>& prompt_tokens_;
  prometheus::Family<prometheus::Counter>& generation_tokens_;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_ROUTER_METRICS_H_
