// Prometheus metrics of one engine, with the vLLM names that autoscalers and schedulers already
// read (`vllm:*`) and `mobius_*` for what is ours. The engine thread records events; the
// registry is scraped from another thread (prometheus-cpp metrics are thread-safe).
#ifndef MOBIUS_WORKER_RUNTIME_ENGINE_METRICS_H_
#define MOBIUS_WORKER_RUNTIME_ENGINE_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace mobius::worker {

class EngineMetrics {
 public:
  // `model_name` becomes the `model_name` label of every series, as in vLLM.
  EngineMetrics(std::shared_ptr<prometheus::Registry> registry, const std::string& model_name,
                int num_banks);

  [[nodiscard]] const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // Gauges, set after every engine step.
  prometheus::Gauge& running;
  prometheus::Gauge& waiting;
  prometheus::Gauge& kv_cache_usage;
  prometheus::Gauge& state_slot_usage;
  // Latencies in seconds.
  prometheus::Histogram& time_to_first_token;
  prometheus::Histogram& inter_token_latency;
  prometheus::Histogram& e2e_latency;
  prometheus::Histogram& queue_time;
  // Counters.
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& generation_tokens;
  prometheus::Counter& preemptions;
  prometheus::Counter& steps;
  // Requests by how they ended: "stop", "length", "abort", "error".
  prometheus::Counter& RequestsFinished(const std::string& reason);
  // Speculative decoding (vLLM's names): verify steps with drafts, draft tokens proposed and
  // accepted, and both per draft position (0-based), so acceptance per position is
  // accepted_per_pos / draft_tokens_per_pos and the mean accepted length per verify step is
  // 1 + accepted / drafts.
  prometheus::Counter& spec_drafts;
  prometheus::Counter& spec_draft_tokens;
  prometheus::Counter& spec_accepted_tokens;
  prometheus::Counter& SpecDraftTokensAt(int position);
  prometheus::Counter& SpecAcceptedTokensAt(int position);
  // Seconds per step in the drafter (MTP head) and in the target's verify forward.
  prometheus::Histogram& spec_draft_time;
  prometheus::Histogram& spec_verify_time;
  // Per bank of routed experts: (token, expert) assignments, and distinct experts touched in the
  // last sampled step (aggregated over the layers that share the bank).
  std::vector<prometheus::Counter*> bank_routed_tokens;
  std::vector<prometheus::Gauge*> bank_experts_touched;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* finished_family_;
  prometheus::Family<prometheus::Counter>* draft_per_pos_family_;
  prometheus::Family<prometheus::Counter>* accepted_per_pos_family_;
  std::string model_name_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_ENGINE_METRICS_H_
