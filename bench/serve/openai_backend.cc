#include "bench/serve/openai_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/json_parse.h"
#include "nlohmann/json.hpp"

namespace mobius::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxErrorBodyBytes = 64 << 10;
constexpr std::chrono::seconds kWaitForBodyEndAfterDone(1);

Clock::time_point DeadlineAfter(absl::Duration timeout) {
  return Clock::now() + absl::ToChronoNanoseconds(timeout);
}

// Reads the rest of a (non-streamed) body, up to `limit` bytes.
absl::StatusOr<std::string> ReadWholeBody(HttpConnection& connection, Clock::time_point deadline,
                                          size_t limit) {
  std::string body;
  while (body.size() < limit) {
    absl::StatusOr<bool> more = connection.ReadBody(body, deadline);
    if (!more.ok()) return more.status();
    if (!*more) break;
  }
  return body;
}

RequestOutcome Failed(std::string reason) {
  RequestOutcome outcome;
  outcome.error = std::move(reason);
  return outcome;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OpenAiBackend>> OpenAiBackend::Create(OpenAiBackendOptions options) {
  absl::StatusOr<HttpUrl> url = ParseBaseUrl(options.base_url);
  if (!url.ok()) return url.status();
  OpenAiEndpoint endpoint;
  if (absl::EndsWith(options.endpoint, "/chat/completions")) {
    endpoint = OpenAiEndpoint::kChatCompletions;
  } else if (absl::EndsWith(options.endpoint, "/completions")) {
    endpoint = OpenAiEndpoint::kCompletions;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--endpoint \"", options.endpoint,
                     "\": expected a path ending in /completions or /chat/completions"));
  }
  if (!absl::StartsWith(options.endpoint, "/")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--endpoint \"", options.endpoint, "\" must start with /"));
  }
  if (options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--request-timeout-s must be > 0");
  }
  return std::unique_ptr<OpenAiBackend>(new OpenAiBackend(std::move(options), *url, endpoint));
}

OpenAiBackend::OpenAiBackend(OpenAiBackendOptions options, HttpUrl url, OpenAiEndpoint endpoint)
    : options_(std::move(options)), url_(std::move(url)), endpoint_(endpoint) {}

std::unique_ptr<HttpConnection> OpenAiBackend::TakeIdle() {
  absl::MutexLock lock(&mu_);
  if (idle_.empty()) return nullptr;
  std::unique_ptr<HttpConnection> connection = std::move(idle_.back());
  idle_.pop_back();
  return connection;
}

void OpenAiBackend::ReturnIdle(std::unique_ptr<HttpConnection> connection) {
  absl::MutexLock lock(&mu_);
  idle_.push_back(std::move(connection));
}

RequestOutcome OpenAiBackend::Send(const BenchRequest& request) {
  const std::string body = OpenAiRequestBody(request, endpoint_, options_.model);
  const std::string target = url_.path_prefix + options_.endpoint;
  // As in vLLM, the clock starts before a connection is taken, so a connect is part of TTFT.
  const Clock::time_point sent = Clock::now();
  const Clock::time_point deadline = sent + absl::ToChronoNanoseconds(options_.request_timeout);
  std::unique_ptr<HttpConnection> connection;
  absl::StatusOr<int> status_code = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    connection = attempt == 0 ? TakeIdle() : nullptr;
    const bool reused = connection != nullptr;
    if (!reused) {
      absl::StatusOr<std::unique_ptr<HttpConnection>> fresh =
          HttpConnection::Connect(url_, deadline);
      if (!fresh.ok()) return Failed(std::string(fresh.status().message()));
      connection = *std::move(fresh);
    }
    absl::Status sent_status = connection->Send("POST", target, body, deadline);
    status_code = sent_status.ok() ? connection->ReadHeader(deadline) : sent_status;
    // A kept-alive connection the server has closed meanwhile fails at once; one retry on a
    // fresh connection is what every HTTP client does.
    if (status_code.ok() || !reused) break;
  }
  if (!status_code.ok()) return Failed(std::string(status_code.status().message()));
  if (*status_code != 200) {
    absl::StatusOr<std::string> error_body =
        ReadWholeBody(*connection, deadline, kMaxErrorBodyBytes);
    return Failed(absl::StrCat("HTTP ", *status_code, ": ",
                               error_body.ok() ? OpenAiErrorMessage(*error_body)
                                               : std::string(error_body.status().message())));
  }
  if (!absl::StartsWith(connection->ContentType(), "text/event-stream")) {
    return Failed(absl::StrCat("expected a text/event-stream response, got \"",
                               connection->ContentType(), "\""));
  }
  OpenAiStreamRecorder recorder(sent);
  absl::Status transport;
  std::string bytes;
  while (true) {
    bytes.clear();
    // After [DONE] the request is complete; the body's end is awaited only briefly, to keep the
    // connection for the next request, so that a server holding the stream open does not turn
    // a finished request into a timeout.
    const Clock::time_point read_deadline =
        recorder.done() ? std::min(deadline, Clock::now() + kWaitForBodyEndAfterDone) : deadline;
    absl::StatusOr<bool> more = connection->ReadBody(bytes, read_deadline);
    const Clock::time_point now = Clock::now();
    if (!bytes.empty()) transport = recorder.OnBytes(bytes, now);
    if (!more.ok()) {
      if (transport.ok() && !recorder.done()) transport = more.status();
      break;
    }
    if (!transport.ok() || !*more) break;
  }
  RequestOutcome outcome = recorder.Finish(transport, request.prompt_len);
  if (transport.ok() && connection->Reusable()) ReturnIdle(std::move(connection));
  return outcome;
}

absl::StatusOr<std::string> FetchFirstModelId(const std::string& base_url, absl::Duration timeout) {
  absl::StatusOr<HttpUrl> url = ParseBaseUrl(base_url);
  if (!url.ok()) return url.status();
  const Clock::time_point deadline = DeadlineAfter(timeout);
  absl::StatusOr<std::unique_ptr<HttpConnection>> connection =
      HttpConnection::Connect(*url, deadline);
  if (!connection.ok()) return connection.status();
  const std::string target = url->path_prefix + "/v1/models";
  if (absl::Status s = (*connection)->Send("GET", target, "", deadline); !s.ok()) return s;
  absl::StatusOr<int> code = (*connection)->ReadHeader(deadline);
  if (!code.ok()) return code.status();
  absl::StatusOr<std::string> body = ReadWholeBody(**connection, deadline, 1 << 20);
  if (!body.ok()) return body.status();
  const std::string where = absl::StrCat("GET ", target);
  if (*code != 200) {
    return absl::UnavailableError(
        absl::StrCat(where, ": HTTP ", *code, ": ", OpenAiErrorMessage(*body)));
  }
  absl::StatusOr<nlohmann::json> parsed = ParseJson(*body);
  if (!parsed.ok())
    return absl::DataLossError(absl::StrCat(where, ": ", parsed.status().message()));
  if (parsed->is_object()) {
    auto data = parsed->find("data");
    if (data != parsed->end() && data->is_array() && !data->empty() && (*data)[0].is_object()) {
      auto id = (*data)[0].find("id");
      if (id != (*data)[0].end() && id->is_string()) return id->get<std::string>();
    }
  }
  return absl::DataLossError(absl::StrCat(where, ": no data[0].id in the answer"));
}

}  // namespace mobius::bench
