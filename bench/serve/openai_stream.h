// The OpenAI streaming protocol as the benchmark uses it: the request body of one benchmark
// request, and the recorder that turns a response's SSE events into a RequestOutcome with vLLM's
// timing rules (every event with a non-empty "choices" array is a chunk, timed when the bytes
// holding it arrived; "usage" gives the token counts; "[DONE]" ends the stream).
#ifndef MOBIUS_BENCH_SERVE_OPENAI_STREAM_H_
#define MOBIUS_BENCH_SERVE_OPENAI_STREAM_H_

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "bench/serve/serve_metrics.h"
#include "bench/serve/sse_parser.h"
#include "bench/serve/workload.h"

namespace mobius::bench {

enum class OpenAiEndpoint { kCompletions, kChatCompletions };

// Greedy (temperature 0) and ignore_eos, so that every request generates exactly its output
// length whatever the weights; streamed with usage. A chat request sends the prompt as one user
// message (text prompts only: the caller checks).
std::string OpenAiRequestBody(const BenchRequest& request, OpenAiEndpoint endpoint,
                              const std::string& model);

// The message of an OpenAI error body ({"error": {"message": ...}}), else the body itself, cut
// to a readable length.
std::string OpenAiErrorMessage(absl::string_view body);

class OpenAiStreamRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  explicit OpenAiStreamRecorder(Clock::time_point sent) : sent_(sent) {}

  // Body bytes that arrived at `now`. An error (malformed event, an error event from the server)
  // ends the request: stop reading and pass the status to Finish.
  absl::Status OnBytes(absl::string_view bytes, Clock::time_point now);

  // The request's outcome once the body ended; `transport` is the read's error, if any.
  // `prompt_len` is used when the server reported no usage.
  RequestOutcome Finish(const absl::Status& transport, int prompt_len) const;

  // "data: [DONE]" has arrived.
  [[nodiscard]] bool done() const { return done_; }

 private:
  absl::Status OnEvent(const std::string& data, Clock::time_point now);

  Clock::time_point sent_;
  SseParser sse_;
  std::vector<std::string> events_;
  int chunks_ = 0;
  Clock::time_point last_chunk_;
  double ttft_s_ = 0;
  std::vector<double> itl_s_;
  std::optional<int> completion_tokens_;
  std::optional<int> prompt_tokens_;
  bool done_ = false;
};

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_SERVE_OPENAI_STREAM_H_
