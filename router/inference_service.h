// The router's engine-facing API, shared by its front ends (gRPC mobius.v1.Inference and the
// OpenAI-compatible HTTP server). Requests and stream messages are the mobius.v1 protos, so a
// front end only translates its wire format; everything else (tokenization, replica choice,
// retries, stop strings, detokenization, deadlines, admission control) lives behind this.
#ifndef MOBIUS_ROUTER_INFERENCE_SERVICE_H_
#define MOBIUS_ROUTER_INFERENCE_SERVICE_H_

#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/time/time.h"
#include "inference.pb.h"
#include "tokenizer/chat_template.h"

namespace mobius::router {

// An INVALID_ARGUMENT from the service may carry the GenerateRequest field it is about
// ("temperature", "stop", "input_ids", "text", ...: a sampling field without its
// "sampling_params." prefix) as a payload under this key, so that a front end can name the
// field in its own spelling (the OpenAI error's `param`).
inline constexpr char kRequestFieldPayload[] = "type.mobius.dev/generate_request.field";
// That field, or "" when the status carries none.
inline std::string RequestFieldOf(const absl::Status& status) {
  const auto field = status.GetPayload(kRequestFieldPayload);  // absl::optional
  return field.has_value() ? std::string(*field) : std::string();
}

// Per-call context supplied by a front end.
struct CallContext {
  absl::Time deadline = absl::InfiniteFuture();
  // Set by the front end when its client goes away; the service then aborts the request on its
  // worker (freeing the slot within one engine step) and returns CANCELLED.
  const std::atomic<bool>* cancelled = nullptr;
};

class InferenceService {
 public:
  virtual ~InferenceService() = default;

  // Runs one request. `on_response` receives every stream message in order (chunks with complete
  // UTF-8 text only, then exactly one `complete`); it returns false when the client can no longer
  // be written to, which cancels the request. The returned status is the RPC's: OK after a
  // complete message, or INVALID_ARGUMENT (bad request; named field), RESOURCE_EXHAUSTED (too
  // many queued; the message carries a retry hint), UNAVAILABLE (no healthy replica),
  // DEADLINE_EXCEEDED, CANCELLED, INTERNAL.
  virtual absl::Status Generate(
      const v1::GenerateRequest& request, const CallContext& context,
      const std::function<bool(const v1::GenerateResponse&)>& on_response) = 0;

  // Renders OpenAI-style chat messages into the model's prompt text (the Qwen3 chat template:
  // tokenizer/chat_template.h), with the tools and options in `args`.
  virtual absl::StatusOr<std::string> RenderChat(
      const std::vector<tokenizer::ChatMessage>& messages,
      const tokenizer::ChatTemplateArgs& args) = 0;

  virtual absl::StatusOr<v1::TokenizeResponse> Tokenize(const v1::TokenizeRequest& request) = 0;
  // INVALID_ARGUMENT naming the field "ids" for an id outside the tokenizer's vocabulary;
  // FAILED_PRECONDITION without a tokenizer.
  virtual absl::StatusOr<v1::DetokenizeResponse> Detokenize(
      const v1::DetokenizeRequest& request) = 0;
  virtual absl::StatusOr<v1::ModelInfo> GetModelInfo() = 0;
  virtual absl::StatusOr<v1::AbortResponse> Abort(const v1::AbortRequest& request) = 0;
  // True while at least one replica is healthy and the router is not draining.
  virtual bool Ready() = 0;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_INFERENCE_SERVICE_H_
