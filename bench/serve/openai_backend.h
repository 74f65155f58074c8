// Benchmark requests over the OpenAI-compatible HTTP API (/v1/completions or
// /v1/chat/completions, streamed), on keep-alive connections reused across requests so that
// connection set-up is not in every TTFT.
#ifndef MOBIUS_BENCH_SERVE_OPENAI_BACKEND_H_
#define MOBIUS_BENCH_SERVE_OPENAI_BACKEND_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bench/serve/http_connection.h"
#include "bench/serve/openai_stream.h"
#include "bench/serve/request_backend.h"

namespace mobius::bench {

struct OpenAiBackendOptions {
  std::string base_url;                      // http://HOST:PORT
  std::string endpoint = "/v1/completions";  // or /v1/chat/completions
  std::string model;                         // empty: requests carry no "model"
  absl::Duration request_timeout = absl::Minutes(10);
};

class OpenAiBackend final : public RequestBackend {
 public:
  // InvalidArgument for a bad --base-url or --endpoint; nothing is contacted yet.
  static absl::StatusOr<std::unique_ptr<OpenAiBackend>> Create(OpenAiBackendOptions options);

  RequestOutcome Send(const BenchRequest& request) override;

 private:
  OpenAiBackend(OpenAiBackendOptions options, HttpUrl url, OpenAiEndpoint endpoint);
  std::unique_ptr<HttpConnection> TakeIdle();
  void ReturnIdle(std::unique_ptr<HttpConnection> connection);

  const OpenAiBackendOptions options_;
  const HttpUrl url_;
  const OpenAiEndpoint endpoint_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<HttpConnection>> idle_ ABSL_GUARDED_BY(mu_);
};

// The id of the first model that GET {base_url}/v1/models lists.
absl::StatusOr<std::string> FetchFirstModelId(const std::string& base_url, absl::Duration timeout);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_OPENAI_BACKEND_H_
