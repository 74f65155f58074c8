// The router's InferenceService: validates and tokenizes requests, admits them up to a limit,
// places each on the least-loaded healthy worker replica, streams its tokens back as text
// (incremental detokenization, stop strings), retries a request on another replica when its
// worker fails before the first token, and propagates cancellation, aborts and deadlines.
#ifndef MOBIUS_ROUTER_CORE_ROUTER_SERVICE_H_
#define MOBIUS_ROUTER_CORE_ROUTER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "router/core/replica_set.h"
#include "router/core/router_metrics.h"
#include "router/inference_service.h"
#include "tokenizer/tokenizer.h"

namespace mobius::router {

struct RouterOptions {
  // Requests in flight (queued at workers or streaming) beyond this get RESOURCE_EXHAUSTED.
  int max_queued_requests = 1024;
  // Upper bound on every request's duration; 0 means only the client's deadline applies.
  absl::Duration request_timeout = absl::ZeroDuration();
  // Reported as ModelInfo.model_name when set (otherwise the workers' name).
  std::string served_model_name;
  // Replicas a request is tried on, at most, when workers fail before its first token.
  int max_attempts = 3;
  // How often a request waiting for its worker checks for client cancellation and aborts.
  absl::Duration cancel_poll_interval = absl::Milliseconds(10);
  // Where the service records its series; must outlive it. Null: a private, unexported set.
  RouterMetrics* metrics = nullptr;
};

class RouterService final : public InferenceService {
 public:
  // `tokenizer` may be null: then requests must carry input_ids, stop strings are refused, and
  // chunks carry token ids with empty text.
  RouterService(std::unique_ptr<ReplicaSet> replicas,
                std::unique_ptr<const tokenizer::Tokenizer> tokenizer, RouterOptions options);
  ~RouterService() override;

  absl::Status Generate(
      const v1::GenerateRequest& request, const CallContext& context,
      const std::function<bool(const v1::GenerateResponse&)>& on_response) override;
  absl::StatusOr<std::string> RenderChat(const std::vector<tokenizer::ChatMessage>& messages,
                                         const tokenizer::ChatTemplateArgs& args) override;
  absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& request) override;
  absl::StatusOr<v1::DetokenizeResponse> Detokenize(const v1::DetokenizeRequest& request) override;
  absl::StatusOr<v1::ModelInfo> GetModelInfo() override;
  absl::StatusOr<v1::AbortResponse> Abort(const v1::AbortRequest& request) override;
  bool Ready() override;

  // Refuses new requests (UNAVAILABLE) and turns Ready() false; requests in flight go on.
  void StartDrain();
  // Waits until no request is in flight or `deadline` passes; true when idle.
  bool WaitUntilIdle(absl::Time deadline);
  [[nodiscard]] int in_flight() const;
  [[nodiscard]] ReplicaSet& replicas() { return *replicas_; }
  [[nodiscard]] RouterMetrics& metrics() { return metrics_; }

 private:
  struct ActiveRequest {
    std::atomic<bool> aborted{false};
  };
  struct Prepared;
  class RequestRun;

  // Validates and tokenizes; fills `prepared`.
  absl::Status Prepare(const v1::GenerateRequest& request, const v1::ModelInfo& model,
                       Prepared& prepared) const;
  // Milliseconds until a slot is likely to free up, for the RESOURCE_EXHAUSTED message.
  int64_t RetryAfterMs() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<ReplicaSet> replicas_;
  std::unique_ptr<const tokenizer::Tokenizer> tokenizer_;
  const RouterOptions options_;
  std::unique_ptr<RouterMetrics> owned_metrics_;  // when options_.metrics is null
  RouterMetrics& metrics_;
  // Ids given to requests that came without one: "router-<id_prefix_>-<n>". The prefix is drawn
  // at start, so that ids do not repeat across routers or restarts (logs, traces, the worker's
  // request ids).
  const std::string id_prefix_;
  std::atomic<uint64_t> next_id_{0};
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, ActiveRequest*> active_ ABSL_GUARDED_BY(mu_);
  // Exponential moving average of request durations, for retry hints.
  double mean_request_ms_ ABSL_GUARDED_BY(mu_) = 1000;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_ROUTER_SERVICE_H_
