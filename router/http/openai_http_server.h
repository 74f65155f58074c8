// OpenAI-compatible HTTP front end of the router: POST /v1/completions, POST
// /v1/chat/completions (both with `stream: true` as server-sent events ending in
// `data: [DONE]`), GET /v1/models, POST /tokenize and /detokenize, GET /health, GET /metrics. It
// translates JSON to and from the mobius.v1 protos and calls InferenceService; it owns no inference
// logic.
#ifndef MOBIUS_ROUTER_HTTP_OPENAI_HTTP_SERVER_H_
#define MOBIUS_ROUTER_HTTP_OPENAI_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "router/inference_service.h"

namespace prometheus {
class Collectable;
}

namespace mobius::router {

struct HttpServerOptions {
  std::string host = "0.0.0.0";
  int port = 8000;                  // 0 picks a free port (see OpenAiHttpServer::port)
  std::string served_model_name;    // the only name `model` may take; listed by /v1/models
  int num_threads = 4;              // I/O threads
  size_t max_body_bytes = 8 << 20;  // larger bodies get 413
  // Served at /metrics when set; must outlive the server.
  const prometheus::Collectable* metrics = nullptr;
  // Called once per completion or chat request with its final status (the one its HTTP status
  // or SSE error event came from; CANCELLED when the client went away), e.g. to count requests.
  std::function<void(absl::StatusCode)> on_generate_done;
  // Chat answers of a reasoning model: "<think>...</think>" becomes the message's
  // `reasoning_content` (vLLM's --reasoning-parser qwen3; router/http/reasoning_parser.h).
  bool parse_reasoning = false;
};

class OpenAiHttpServer {
 public:
  // Binds and starts serving. `service` must outlive the server.
  static absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> Start(InferenceService& service,
                                                                 const HttpServerOptions& options);
  virtual ~OpenAiHttpServer() = default;
  [[nodiscard]] virtual int port() const = 0;
  // Stops accepting connections; streams in flight may finish until `grace` has passed.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_HTTP_OPENAI_HTTP_SERVER_H_
