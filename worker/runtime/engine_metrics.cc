#include "worker/runtime/engine_metrics.h"

#include "common/latency_buckets.h"

namespace mobius::worker {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

Histogram::BucketBoundaries LatencyBuckets() { return LatencyBucketsSeconds(); }

}  // namespace

EngineMetrics::EngineMetrics(std::shared_ptr<prometheus::Registry> registry,
                             const std::string& model_name, int num_banks)
    : running(BuildGauge()
                  .Name("vllm:num_requests_running")
                  .Help("Requests in the running batch.")
                  .Register(*registry)
                  .Add({{"model_name", model_name}})),
      waiting(BuildGauge()
                  .Name("vllm:num_requests_waiting")
                  .Help("Requests queued, waiting for a slot.")
                  .Register(*registry)
                  .Add({{"model_name", model_name}})),
      kv_cache_usage(BuildGauge()
                         .Name("vllm:kv_cache_usage_perc")
                         .Help("Fraction of paged KV-cache blocks in use (1 = full).")
                         .Register(*registry)
                         .Add({{"model_name", model_name}})),
      state_slot_usage(BuildGauge()
                           .Name("mobius_state_slot_usage_perc")
                           .Help("Fraction of DeltaNet state slots in use (1 = full).")
                           .Register(*registry)
                           .Add({{"model_name", model_name}})),
      time_to_first_token(BuildHistogram()
                              .Name("vllm:time_to_first_token_seconds")
                              .Help("Time from arrival to the first generated token.")
                              .Register(*registry)
                              .Add({{"model_name", model_name}}, LatencyBuckets())),
      inter_token_latency(BuildHistogram()
                              .Name("vllm:inter_token_latency_seconds")
                              .Help("Time between consecutive generated tokens of a request.")
                              .Register(*registry)
                              .Add({{"model_name", model_name}}, LatencyBuckets())),
      e2e_latency(BuildHistogram()
                      .Name("vllm:e2e_request_latency_seconds")
                      .Help("Time from arrival to the last token of a request.")
                      .Register(*registry)
                      .Add({{"model_name", model_name}}, LatencyBuckets())),
      queue_time(BuildHistogram()
                     .Name("vllm:request_queue_time_seconds")
                     .Help("Time a request waited before its first scheduled step.")
                     .Register(*registry)
                     .Add({{"model_name", model_name}}, LatencyBuckets())),
      prompt_tokens(BuildCounter()
                        .Name("vllm:prompt_tokens_total")
                        .Help("Prompt tokens of admitted requests.")
                        .Register(*registry)
                        .Add({{"model_name", model_name}})),
      generation_tokens(BuildCounter()
                            .Name("vllm:generation_tokens_total")
                            .Help("Generated tokens.")
                            .Register(*registry)
                            .Add({{"model_name", model_name}})),
      preemptions(BuildCounter()
                      .Name("mobius_preemptions_total")
                      .Help("Sequences preempted (by recompute) under KV-cache pressure.")
                      .Register(*registry)
                      .Add({{"model_name", model_name}})),
      steps(BuildCounter()
                .Name("mobius_engine_steps_total")
                .Help("Model steps the engine ran.")
                .Register(*registry)
                .Add({{"model_name", model_name}})),
      spec_drafts(BuildCounter()
                      .Name("vllm:spec_decode_num_drafts_total")
                      .Help("Speculative verify steps of a sequence that carried drafts.")
                      .Register(*registry)
                      .Add({{"model_name", model_name}})),
      spec_draft_tokens(BuildCounter()
                            .Name("vllm:spec_decode_num_draft_tokens_total")
                            .Help("Draft tokens proposed.")
                            .Register(*registry)
                            .Add({{"model_name", model_name}})),
      spec_accepted_tokens(BuildCounter()
                               .Name("vllm:spec_decode_num_accepted_tokens_total")
                               .Help("Draft tokens accepted.")
                               .Register(*registry)
                               .Add({{"model_name", model_name}})),
      spec_draft_time(BuildHistogram()
                          .Name("mobius_spec_decode_draft_seconds")
                          .Help("Time per step in the draft head (observe + draft).")
                          .Register(*registry)
                          .Add({{"model_name", model_name}}, LatencyBuckets())),
      spec_verify_time(BuildHistogram()
                           .Name("mobius_spec_decode_verify_seconds")
                           .Help("Time of the target forward of a step that verified drafts.")
                           .Register(*registry)
                           .Add({{"model_name", model_name}}, LatencyBuckets())),
      registry_(std::move(registry)),
      model_name_(model_name) {
  finished_family_ = &BuildCounter()
                          .Name("vllm:request_success_total")
                          .Help("Finished requests by finish reason.")
                          .Register(*registry_);
  draft_per_pos_family_ = &BuildCounter()
                               .Name("mobius_spec_decode_num_draft_tokens_per_pos")
                               .Help("Draft tokens proposed at each draft position (0-based).")
                               .Register(*registry_);
  accepted_per_pos_family_ = &BuildCounter()
                                  .Name("vllm:spec_decode_num_accepted_tokens_per_pos")
                                  .Help("Draft tokens accepted at each draft position (0-based).")
                                  .Register(*registry_);
  auto& routed = BuildCounter()
                     .Name("mobius_bank_routed_tokens_total")
                     .Help(
                         "(token, expert) assignments routed to each expert bank, summed over "
                         "the layers that share the bank (sampled steps only).")
                     .Register(*registry_);
  auto& touched = BuildGauge()
                      .Name("mobius_bank_experts_touched")
                      .Help(
                          "Distinct experts of each bank touched by the last sampled step, "
                          "over the layers that share the bank.")
                      .Register(*registry_);
  for (int b = 0; b < num_banks; ++b) {
    const std::string bank = std::to_string(b);
    bank_routed_tokens.push_back(&routed.Add({{"model_name", model_name}, {"bank", bank}}));
    bank_experts_touched.push_back(&touched.Add({{"model_name", model_name}, {"bank", bank}}));
  }
}

prometheus::Counter& EngineMetrics::RequestsFinished(const std::string& reason) {
  return finished_family_->Add({{"model_name", model_name_}, {"finished_reason", reason}});
}

prometheus::Counter& EngineMetrics::SpecDraftTokensAt(int position) {
  return draft_per_pos_family_->Add(
      {{"model_name", model_name_}, {"position", std::to_string(position)}});
}

prometheus::Counter& EngineMetrics::SpecAcceptedTokensAt(int position) {
  return accepted_per_pos_family_->Add(
      {{"model_name", model_name_}, {"position", std::to_string(position)}});
}

}  // namespace mobius::worker
