#include "bench/serve/openai_stream.h"

#include "absl/strings/str_cat.h"
#include "common/json_parse.h"
#include "nlohmann/json.hpp"

namespace mobius::bench {
namespace {

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// An integer usage field, absent when missing or not an integer.
std::optional<int> UsageCount(const nlohmann::json& usage, const char* key) {
  auto it = usage.find(key);
  if (it == usage.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<int>();
}

}  // namespace

std::string OpenAiRequestBody(const BenchRequest& request, OpenAiEndpoint endpoint,
                              const std::string& model) {
  nlohmann::json body = {{"temperature", 0.0},
                         {"ignore_eos", true},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
  if (!model.empty()) body["model"] = model;
  switch (endpoint) {
    case OpenAiEndpoint::kCompletions:
      if (request.is_text) {
        body["prompt"] = request.prompt_text;
      } else {
        body["prompt"] = request.prompt_ids;
      }
      body["max_tokens"] = request.output_len;
      break;
    case OpenAiEndpoint::kChatCompletions:
      body["messages"] =
          nlohmann::json::array({{{"role", "user"}, {"content", request.prompt_text}}});
      body["max_completion_tokens"] = request.output_len;
      break;
  }
  if (!request.json_schema.empty()) {
    // (The text was checked when the workload was made: bench serve --json-schema.)
    body["response_format"] = {
        {"type", "json_schema"},
        {"json_schema",
         {{"name", "bench"},
          {"schema", nlohmann::json::parse(request.json_schema, nullptr, false)}}}};
  }
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string OpenAiErrorMessage(absl::string_view body) {
  constexpr size_t kMaxChars = 200;
  absl::StatusOr<nlohmann::json> parsed = ParseJson(body);
  std::string message(body);
  if (parsed.ok() && parsed->is_object()) {
    auto error = parsed->find("error");
    if (error != parsed->end() && error->is_object()) {
      auto text = error->find("message");
      if (text != error->end() && text->is_string()) message = text->get<std::string>();
    }
  }
  if (message.size() > kMaxChars) message = message.substr(0, kMaxChars) + "...";
  return message;
}

absl::Status OpenAiStreamRecorder::OnBytes(absl::string_view bytes, Clock::time_point now) {
  events_.clear();
  if (absl::Status s = sse_.Feed(bytes, events_); !s.ok()) {
    return absl::DataLossError(absl::StrCat("malformed SSE stream: ", s.message()));
  }
  for (const std::string& event : events_) {
    if (absl::Status s = OnEvent(event, now); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status OpenAiStreamRecorder::OnEvent(const std::string& data, Clock::time_point now) {
  if (done_) return absl::OkStatus();  // anything after [DONE] is ignored, as clients do
  if (data == "[DONE]") {
    done_ = true;
    return absl::OkStatus();
  }
  absl::StatusOr<nlohmann::json> parsed = ParseJson(data);
  if (!parsed.ok()) {
    return absl::DataLossError(absl::StrCat("malformed SSE event: ", parsed.status().message()));
  }
  if (!parsed->is_object()) {
    return absl::DataLossError("malformed SSE event: not a JSON object");
  }
  if (auto error = parsed->find("error"); error != parsed->end() && !error->is_null()) {
    return absl::AbortedError(absl::StrCat("error event: ", OpenAiErrorMessage(data)));
  }
  if (auto choices = parsed->find("choices");
      choices != parsed->end() && choices->is_array() && !choices->empty()) {
    if (chunks_ == 0) {
      ttft_s_ = Seconds(now - sent_);
    } else {
      itl_s_.push_back(Seconds(now - last_chunk_));
    }
    last_chunk_ = now;
    ++chunks_;
  }
  if (auto usage = parsed->find("usage"); usage != parsed->end() && usage->is_object()) {
    if (auto n = UsageCount(*usage, "completion_tokens")) completion_tokens_ = n;
    if (auto n = UsageCount(*usage, "prompt_tokens")) prompt_tokens_ = n;
  }
  return absl::OkStatus();
}

RequestOutcome OpenAiStreamRecorder::Finish(const absl::Status& transport, int prompt_len) const {
  RequestOutcome outcome;
  if (!transport.ok()) {
    outcome.error = std::string(transport.message());
  } else if (!done_) {
    outcome.error = sse_.HasPartialEvent() ? "stream cut in the middle of an event"
                                           : "stream ended without data: [DONE]";
  } else if (chunks_ == 0) {
    outcome.error = "stream had no chunk with choices";
  }
  if (!outcome.error.empty()) return outcome;
  outcome.success = true;
  outcome.ttft_s = ttft_s_;
  outcome.latency_s = Seconds(last_chunk_ - sent_);
  outcome.itl_s = itl_s_;
  // Without usage, chunks stand in for tokens (exact when the server sends one token per chunk).
  outcome.output_tokens = completion_tokens_.value_or(chunks_);
  outcome.prompt_tokens = prompt_tokens_.value_or(prompt_len);
  return outcome;
}

}  // namespace mobius::bench
