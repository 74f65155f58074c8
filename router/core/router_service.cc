#include "router/core/router_service.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "router/core/bad_words.h"
#include "router/core/request_validation.h"
#include "router/core/stop_string_matcher.h"
#include "router/core/worker_stream.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/incremental_detokenizer.h"

namespace mobius::router {

struct RouterService::Prepared {
  std::string request_id;
  std::vector<int32_t> prompt;
  int max_tokens = 0;
  // The stream opens with the prompt (TextChunk.prompt): GenerateRequest.echo, or prompt_logprobs.
  bool send_prompt = false;
  v1::WorkerGenerateRequest worker_request;
};

// One request's trip through the replicas: the stream of one attempt at a time, and the output
// state (detokenizer, stop strings, counts) that the client sees.
class RouterService::RequestRun {
 public:
  RequestRun(RouterService& service, const Prepared& prepared, const v1::SamplingParams& params,
             const CallContext& context, const ActiveRequest& active, absl::Time start,
             absl::Time deadline, RouterMetrics::ModelSeries series,
             const std::function<bool(const v1::GenerateResponse&)>& on_response)
      : service_(service),
        prepared_(prepared),
        context_(context),
        active_(active),
        start_(start),
        deadline_(deadline),
        series_(series),
        on_response_(on_response),
        matcher_({params.stop().begin(), params.stop().end()}, params.include_stop_str_in_output()),
        min_tokens_(params.min_tokens()) {
    if (service.tokenizer_ != nullptr) {
      tokenizer::DecodeOptions options;
      options.skip_special_tokens =
          params.has_skip_special_tokens() ? params.skip_special_tokens() : true;
      detokenizer_.emplace(*service.tokenizer_, options);
    }
  }

  absl::Status Run() {
    ReplicaSet& replicas = *service_.replicas_;
    const int attempts =
        std::max(1, std::min<int>(service_.options_.max_attempts, replicas.size()));
    std::vector<int> tried;
    absl::Status last_error;
    for (int attempt = 0; attempt < attempts; ++attempt) {
      if (absl::Status s = CheckInterrupted(); !s.ok()) return s;
      absl::StatusOr<ReplicaSet::Lease> lease =
          replicas.Pick(static_cast<int64_t>(prepared_.prompt.size()), prepared_.max_tokens, tried);
      if (!lease.ok()) {
        if (attempt > 0) return last_error;
        return absl::UnavailableError(
            absl::StrCat("request ", prepared_.request_id, ": ", lease.status().message()));
      }
      tried.push_back(lease->replica());
      replica_ = lease->address();
      if (attempt == 0) {
        series_.prompt_tokens->Increment(static_cast<double>(prepared_.prompt.size()));
      } else {
        service_.metrics_.Retried();
      }
      MOBIUS_LOG(DEBUG, "router", prepared_.request_id)
          << "attempt " << attempt + 1 << " on replica " << replica_;
      bool retry = false;
      absl::Status status = RunOnReplica(*lease, retry);
      if (!retry) return status;
      last_error = status;
      MOBIUS_LOG(WARNING, "router", prepared_.request_id)
          << status.message() << "; no token was produced, trying another replica";
    }
    return last_error;
  }

  [[nodiscard]] const std::string& replica() const { return replica_; }
  [[nodiscard]] int completion_tokens() const { return completion_tokens_; }
  [[nodiscard]] v1::FinishReason finish_reason() const { return finish_reason_; }

 private:
  // CANCELLED / DEADLINE_EXCEEDED when the client went away or time ran out.
  absl::Status CheckInterrupted() const {
    if (context_.cancelled != nullptr && context_.cancelled->load()) {
      return absl::CancelledError(
          absl::StrCat("request ", prepared_.request_id, " was cancelled by the client"));
    }
    if (absl::Now() >= deadline_) {
      return absl::DeadlineExceededError(
          absl::StrFormat("request %s exceeded its deadline after %d output tokens",
                          prepared_.request_id, completion_tokens_));
    }
    return absl::OkStatus();
  }

  absl::Status RunOnReplica(ReplicaSet::Lease& lease, bool& retry) {
    WorkerStream stream(lease.worker(), prepared_.worker_request, deadline_);
    v1::WorkerGenerateResponse message;
    std::optional<v1::GenerateComplete> complete;
    while (true) {
      if (absl::Status s = CheckInterrupted(); !s.ok()) {
        service_.replicas_->AbortOnReplica(lease.replica(), prepared_.request_id);
        stream.Cancel();
        stream.Finish();
        return s;
      }
      if (active_.aborted.load()) {
        service_.replicas_->AbortOnReplica(lease.replica(), prepared_.request_id);
        stream.Cancel();
        stream.Finish();
        return Complete(v1::FINISH_REASON_ABORT, std::nullopt, 0, /*flush=*/true);
      }
      const WorkerStream::Event event =
          stream.Next(absl::Now() + service_.options_.cancel_poll_interval, &message);
      if (event == WorkerStream::Event::kTimeout) continue;
      if (event == WorkerStream::Event::kEnd) break;
      if (message.has_complete()) {
        complete = message.complete();
        continue;  // the stream's status comes next
      }
      lease.OnTokens(message.chunk().token_ids_size());
      if (!SendChunk(message.chunk())) {
        stream.Cancel();
        stream.Finish();
        return absl::CancelledError(absl::StrCat("request ", prepared_.request_id,
                                                 ": the client stopped reading the stream"));
      }
      if (matched_stop_) {
        // The worker would go on generating. Abort frees its slot at the worker's next step;
        // cancelling the stream alone would wait for the worker to notice the cancelled call.
        service_.replicas_->AbortOnReplica(lease.replica(), prepared_.request_id);
        stream.Cancel();
        stream.Finish();
        return Complete(v1::FINISH_REASON_STOP, std::nullopt, 0, /*flush=*/false);
      }
    }
    const grpc::Status status = stream.Finish();
    if (complete) {
      std::optional<int32_t> token;
      if (complete->has_matched_stop_token_id()) token = complete->matched_stop_token_id();
      return Complete(complete->finish_reason(), token, complete->usage().cached_tokens(),
                      /*flush=*/true);
    }
    if (absl::Status s = CheckInterrupted(); !s.ok()) return s;
    if (status.ok()) {
      return absl::InternalError(absl::StrCat("request ", prepared_.request_id, ": replica ",
                                              replica_, " ended the stream without completing"));
    }
    const grpc::StatusCode code = status.error_code();
    if (code == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::DeadlineExceededError(
          absl::StrFormat("request %s exceeded its deadline after %d output tokens",
                          prepared_.request_id, completion_tokens_));
    }
    // A lost connection, a worker shutting down, or the worker's server cancelling the call.
    const bool replica_failed = code == grpc::StatusCode::UNAVAILABLE ||
                                code == grpc::StatusCode::ABORTED ||
                                (code == grpc::StatusCode::CANCELLED && !stream.cancelled_by_us());
    if (replica_failed) {
      service_.replicas_->ReportFailure(lease.replica());
      if (completion_tokens_ == 0) {
        retry = true;
        return absl::UnavailableError(absl::StrFormat("request %s: replica %s failed: %s",
                                                      prepared_.request_id, replica_,
                                                      status.error_message()));
      }
      return absl::UnavailableError(absl::StrFormat(
          "request %s: replica %s failed after %d output tokens: %s", prepared_.request_id,
          replica_, completion_tokens_, status.error_message()));
    }
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrFormat("request %s: replica %s: %s", prepared_.request_id,
                                        replica_, status.error_message()));
  }

  // Forwards a worker chunk: ids (up to a stop string's end), their logprobs, and the text that
  // is complete and cannot be part of a stop string. False when the client is gone.
  bool SendChunk(const v1::TokenChunk& chunk) {
    v1::GenerateResponse response;
    response.set_request_id(prepared_.request_id);
    v1::TextChunk* out = response.mutable_chunk();
    if (prepared_.send_prompt && !prompt_sent_) {
      FillPrompt(chunk.prompt_logprobs(), *out->mutable_prompt());
      prompt_sent_ = true;
    }
    std::string text;
    for (int k = 0; k < chunk.token_ids_size() && !matched_stop_; ++k) {
      const int32_t id = chunk.token_ids(k);
      out->add_token_ids(id);
      if (k < chunk.logprobs_size()) {
        v1::OutputLogprobs* logprobs = out->add_logprobs();
        *logprobs = chunk.logprobs(k);
        AddTokenBytes(id, *logprobs);
      }
      ++completion_tokens_;
      if (!detokenizer_) continue;
      // An id the tokenizer lacks (embedding rows past its vocabulary) has no text.
      absl::StatusOr<std::string> piece = detokenizer_->Push(id);
      if (!piece.ok()) continue;
      // No stop string matches until the output is longer than min_tokens (vLLM v1 checks stop
      // strings only then): the text goes out as it comes. (A stop string that begins in that
      // text and ends after it is not matched; vLLM would match it.)
      if (completion_tokens_ <= min_tokens_) {
        text += *piece;
        continue;
      }
      StopStringMatcher::Result r = matcher_.Push(*piece);
      text += r.text;
      if (r.matched) matched_stop_ = std::move(r.matched);
    }
    out->set_text(std::move(text));
    if (out->token_ids_size() > 0) {
      // Latencies as the client sees them: from arrival here, per chunk sent.
      const absl::Time now = absl::Now();
      if (last_chunk_sent_ == absl::InfinitePast()) {
        series_.time_to_first_token->Observe(absl::ToDoubleSeconds(now - start_));
      } else {
        series_.inter_token_latency->Observe(absl::ToDoubleSeconds(now - last_chunk_sent_));
      }
      last_chunk_sent_ = now;
      series_.generation_tokens->Increment(out->token_ids_size());
    }
    return on_response_(response);
  }

  // The chosen and the top tokens' bytes (TokenLogprob.token_bytes), so that a front end can
  // show the tokens themselves; nothing without a tokenizer, or for an id it lacks. Special
  // tokens keep their text here whatever skip_special_tokens says: a logprob entry names a
  // token, it is not output text.
  void AddTokenBytes(int32_t chosen, v1::OutputLogprobs& logprobs) const {
    const tokenizer::Tokenizer* tokenizer = service_.tokenizer_.get();
    if (tokenizer == nullptr) return;
    if (absl::StatusOr<std::string_view> b = tokenizer->TokenBytes(chosen); b.ok()) {
      logprobs.set_token_bytes(std::string(*b));
    }
    for (v1::TokenLogprob& t : *logprobs.mutable_top()) {
      if (absl::StatusOr<std::string_view> b = tokenizer->TokenBytes(t.token_id()); b.ok()) {
        t.set_token_bytes(std::string(*b));
      }
    }
  }

  // The prompt as the worker saw it, with the worker's scores of its tokens (prompt_logprobs):
  // the text with special tokens kept, each token's bytes (empty for an id the tokenizer lacks),
  // and the scored and top tokens' bytes. Ids only without a tokenizer.
  void FillPrompt(const google::protobuf::RepeatedPtrField<v1::OutputLogprobs>& scores,
                  v1::PromptEcho& echo) const {
    const std::vector<int32_t>& prompt = prepared_.prompt;
    echo.mutable_token_ids()->Assign(prompt.begin(), prompt.end());
    for (int k = 0; k < scores.size() && k + 1 < static_cast<int>(prompt.size()); ++k) {
      *echo.add_logprobs() = scores[k];
      AddTokenBytes(prompt[k + 1], *echo.mutable_logprobs(k));
    }
    const tokenizer::Tokenizer* tokenizer = service_.tokenizer_.get();
    if (tokenizer == nullptr) return;
    tokenizer::DecodeOptions keep_special;
    keep_special.skip_special_tokens = false;
    if (absl::StatusOr<std::string> text = tokenizer->Decode(prompt, keep_special); text.ok()) {
      echo.set_text(*std::move(text));
    }
    for (int32_t id : prompt) {
      absl::StatusOr<std::string_view> b = tokenizer->TokenBytes(id);
      echo.add_token_bytes(b.ok() ? std::string(*b) : std::string());
    }
  }

  // Sends the held-back text (when `flush`) and the one `complete` message.
  absl::Status Complete(v1::FinishReason reason, std::optional<int32_t> matched_token,
                        int cached_tokens, bool flush) {
    if (prepared_.send_prompt && !prompt_sent_) {
      // No chunk came (max_tokens 0 without prompt_logprobs): the prompt goes out on its own.
      v1::GenerateResponse response;
      response.set_request_id(prepared_.request_id);
      FillPrompt({}, *response.mutable_chunk()->mutable_prompt());
      prompt_sent_ = true;
      if (!on_response_(response)) {
        return absl::CancelledError(absl::StrCat("request ", prepared_.request_id,
                                                 ": the client stopped reading the stream"));
      }
    }
    if (flush && detokenizer_) {
      std::string tail = detokenizer_->Finish();
      // Past min_tokens the tail may still complete a stop string; before, it is text (a request
      // aborted early must not end as a stop-string match).
      if (min_tokens_ == 0 || completion_tokens_ > min_tokens_) {
        StopStringMatcher::Result r = matcher_.Push(tail);
        tail = std::move(r.text);
        if (r.matched) {
          matched_stop_ = std::move(r.matched);
        } else {
          tail += matcher_.Flush();
        }
      }
      if (!tail.empty()) {
        v1::GenerateResponse response;
        response.set_request_id(prepared_.request_id);
        response.mutable_chunk()->set_text(std::move(tail));
        if (!on_response_(response)) {
          return absl::CancelledError(absl::StrCat("request ", prepared_.request_id,
                                                   ": the client stopped reading the stream"));
        }
      }
    }
    v1::GenerateResponse response;
    response.set_request_id(prepared_.request_id);
    v1::TextComplete* complete = response.mutable_complete();
    if (matched_stop_) {
      reason = v1::FINISH_REASON_STOP;
      complete->set_matched_string(*matched_stop_);
    } else if (matched_token) {
      complete->set_matched_token_id(*matched_token);
    }
    complete->set_finish_reason(reason);
    complete->mutable_usage()->set_prompt_tokens(static_cast<int>(prepared_.prompt.size()));
    complete->mutable_usage()->set_completion_tokens(completion_tokens_);
    complete->mutable_usage()->set_cached_tokens(cached_tokens);
    finish_reason_ = reason;
    if (!on_response_(response)) {
      return absl::CancelledError(absl::StrCat("request ", prepared_.request_id,
                                               ": the client stopped reading the stream"));
    }
    series_.e2e_latency->Observe(absl::ToDoubleSeconds(absl::Now() - start_));
    return absl::OkStatus();
  }

  RouterService& service_;
  const Prepared& prepared_;
  const CallContext& context_;
  const ActiveRequest& active_;
  const absl::Time start_;
  const absl::Time deadline_;
  const RouterMetrics::ModelSeries series_;
  absl::Time last_chunk_sent_ = absl::InfinitePast();
  const std::function<bool(const v1::GenerateResponse&)>& on_response_;
  std::optional<tokenizer::IncrementalDetokenizer> detokenizer_;
  StopStringMatcher matcher_;
  const int min_tokens_;  // stop strings match only past this many output tokens
  std::optional<std::string> matched_stop_;
  bool prompt_sent_ = false;
  int completion_tokens_ = 0;
  v1::FinishReason finish_reason_ = v1::FINISH_REASON_UNSPECIFIED;
  std::string replica_;
};

RouterService::RouterService(std::unique_ptr<ReplicaSet> replicas,
                             std::unique_ptr<const tokenizer::Tokenizer> tokenizer,
                             RouterOptions options)
    : replicas_(std::move(replicas)),
      tokenizer_(std::move(tokenizer)),
      options_(std::move(options)),
      owned_metrics_(options_.metrics == nullptr ? std::make_unique<RouterMetrics>() : nullptr),
      metrics_(options_.metrics != nullptr ? *options_.metrics : *owned_metrics_),
      id_prefix_(absl::StrFormat("%08x", absl::Uniform<uint32_t>(absl::BitGen()))) {}

RouterService::~RouterService() = default;

absl::Status RouterService::Prepare(const v1::GenerateRequest& request, const v1::ModelInfo& model,
                                    Prepared& prepared) const {
  const v1::SamplingParams& params = request.sampling_params();
  RETURN_IF_ERROR(ValidateSamplingParams(params, model));
  if (params.stop_size() > 0 && tokenizer_ == nullptr) {
    return absl::InvalidArgumentError(
        "sampling_params.stop needs text output, but the router runs without --tokenizer");
  }
  if (params.bad_words_size() > 0 && tokenizer_ == nullptr) {
    absl::Status status = absl::InvalidArgumentError(
        "sampling_params.bad_words needs the router's tokenizer, but the router runs without "
        "--tokenizer: send bad_words_token_ids instead");
    status.SetPayload(kRequestFieldPayload, absl::Cord("bad_words"));
    return status;
  }
  std::string_view field;
  switch (request.input_case()) {
    case v1::GenerateRequest::kText: {
      field = "text";
      if (tokenizer_ == nullptr) {
        return absl::InvalidArgumentError(
            "text input needs a tokenizer, but the router runs without --tokenizer: send "
            "input_ids instead");
      }
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(request.text());
      if (!ids.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message()));
      }
      prepared.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kInputIds:
      field = "input_ids";
      prepared.prompt.assign(request.input_ids().ids().begin(), request.input_ids().ids().end());
      break;
    case v1::GenerateRequest::INPUT_NOT_SET:
      return absl::InvalidArgumentError("the request has no input: set text or input_ids");
  }
  if (request.has_truncate_prompt_tokens()) {
    const int32_t keep = request.truncate_prompt_tokens();
    if (keep != -1 && keep < 1) {
      absl::Status status = absl::InvalidArgumentError(absl::StrFormat(
          "truncate_prompt_tokens = %d is invalid: must be -1 (fit the context) or >= 1", keep));
      status.SetPayload(kRequestFieldPayload, absl::Cord("truncate_prompt_tokens"));
      return status;
    }
    const size_t limit =
        static_cast<size_t>(keep == -1 ? std::max(1, model.max_context_length() - 1) : keep);
    if (prepared.prompt.size() > limit) {
      prepared.prompt.erase(prepared.prompt.begin(),
                            prepared.prompt.end() - static_cast<std::ptrdiff_t>(limit));
    }
  }
  RETURN_IF_ERROR(ValidatePrompt(prepared.prompt, field, model));
  prepared.max_tokens = EffectiveMaxTokens(params, static_cast<int>(prepared.prompt.size()), model);

  v1::WorkerGenerateRequest& w = prepared.worker_request;
  w.set_request_id(prepared.request_id);
  w.mutable_input_ids()->Assign(prepared.prompt.begin(), prepared.prompt.end());
  *w.mutable_sampling_params() = WorkerSamplingParams(params, prepared.max_tokens);
  // Bad words become token sequences here, beside any the client sent as ids.
  for (int i = 0; i < params.bad_words_size(); ++i) {
    absl::StatusOr<std::vector<std::vector<int32_t>>> sequences =
        BadWordSequences(*tokenizer_, params.bad_words(i));
    if (!sequences.ok()) {
      absl::Status status = absl::InvalidArgumentError(
          absl::StrFormat("sampling_params.bad_words[%d]: %s", i, sequences.status().message()));
      status.SetPayload(kRequestFieldPayload, absl::Cord("bad_words"));
      return status;
    }
    for (const std::vector<int32_t>& ids : *sequences) {
      w.mutable_sampling_params()->add_bad_words_token_ids()->mutable_ids()->Assign(ids.begin(),
                                                                                    ids.end());
    }
  }
  if (params.bad_words_size() > 0) {
    // The sequences must fit the worker's limits and the model's vocabulary.
    v1::SamplingParams check;
    *check.mutable_bad_words_token_ids() = w.sampling_params().bad_words_token_ids();
    if (absl::Status s = ValidateSamplingParams(check, model); !s.ok()) {
      absl::Status status = absl::InvalidArgumentError(
          absl::StrCat("sampling_params.bad_words, as tokens: ", s.message()));
      status.SetPayload(kRequestFieldPayload, absl::Cord("bad_words"));
      return status;
    }
  }
  w.set_priority(request.priority());
  prepared.send_prompt = request.echo() || params.has_prompt_logprobs();
  return absl::OkStatus();
}

int64_t RouterService::RetryAfterMs() const {
  // With the limit's worth of requests in flight, one finishes about every mean/limit.
  const double ms = mean_request_ms_ / std::max(1, options_.max_queued_requests);
  return std::clamp<int64_t>(static_cast<int64_t>(ms), 10, 10000);
}

absl::Status RouterService::Generate(
    const v1::GenerateRequest& request, const CallContext& context,
    const std::function<bool(const v1::GenerateResponse&)>& on_response) {
  const absl::Time start = absl::Now();
  if (draining_.load()) {
    return absl::UnavailableError(
        "the router is shutting down and takes no new requests; send them to another router");
  }
  const std::string id = request.request_id().empty()
                             ? absl::StrCat("router-", id_prefix_, "-", next_id_.fetch_add(1))
                             : request.request_id();
  ActiveRequest active;
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(active_.size()) >= options_.max_queued_requests) {
      const int64_t retry_ms = RetryAfterMs();
      MOBIUS_LOG(WARNING, "router", id) << "rejected: " << active_.size() << " requests in flight";
      return absl::ResourceExhaustedError(absl::StrFormat(
          "request %s: %d requests are in flight, the router's limit (--max-queued-requests); "
          "retry after %d ms",
          id, active_.size(), retry_ms));
    }
    if (!active_.emplace(id, &active).second) {
      return absl::AlreadyExistsError(
          absl::StrFormat("request_id %s is already in flight on this router", id));
    }
  }
  metrics_.in_flight().Increment();
  absl::Cleanup leave = [&] {
    metrics_.in_flight().Decrement();
    absl::MutexLock lock(&mu_);
    active_.erase(id);
    mean_request_ms_ =
        0.9 * mean_request_ms_ + 0.1 * absl::ToDoubleMilliseconds(absl::Now() - start);
  };

  std::optional<v1::ModelInfo> model = replicas_->model_info();
  if (!model) {
    return absl::UnavailableError(
        absl::StrCat("request ", id, ": no worker replica has answered yet"));
  }
  Prepared prepared;
  prepared.request_id = id;
  if (absl::Status s = Prepare(request, *model, prepared); !s.ok()) {
    MOBIUS_LOG(INFO, "router", id) << "invalid request: " << s.message();
    return s;
  }
  absl::Time deadline = context.deadline;
  if (options_.request_timeout > absl::ZeroDuration()) {
    deadline = std::min(deadline, start + options_.request_timeout);
  }
  const std::string& model_name =
      options_.served_model_name.empty() ? model->model_name() : options_.served_model_name;
  RequestRun run(*this, prepared, request.sampling_params(), context, active, start, deadline,
                 metrics_.ForModel(model_name), on_response);
  const absl::Status status = run.Run();
  MOBIUS_LOG(INFO, "router", id) << "finished on " << (run.replica().empty() ? "-" : run.replica())
                                 << ": "
                                 << (status.ok() ? v1::FinishReason_Name(run.finish_reason())
                                                 : status.ToString())
                                 << ", prompt " << prepared.prompt.size() << " tokens, output "
                                 << run.completion_tokens() << " tokens, "
                                 << absl::ToInt64Milliseconds(absl::Now() - start) << " ms";
  return status;
}

absl::StatusOr<std::string> RouterService::RenderChat(
    const std::vector<tokenizer::ChatMessage>& messages, const tokenizer::ChatTemplateArgs& args) {
  return tokenizer::RenderChatMessages(messages, args);
}

absl::StatusOr<v1::TokenizeResponse> RouterService::Tokenize(const v1::TokenizeRequest& request) {
  if (tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        "the router runs without --tokenizer, so it cannot tokenize text");
  }
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(request.text());
  if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message()));
  v1::TokenizeResponse response;
  response.mutable_ids()->Assign(ids->begin(), ids->end());
  return response;
}

absl::StatusOr<v1::DetokenizeResponse> RouterService::Detokenize(
    const v1::DetokenizeRequest& request) {
  if (tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        "the router runs without --tokenizer, so it cannot detokenize ids");
  }
  const int64_t vocab = static_cast<int64_t>(tokenizer_->id_limit());
  for (int k = 0; k < request.ids_size(); ++k) {
    if (request.ids(k) < 0 || request.ids(k) >= vocab) {
      absl::Status status = absl::InvalidArgumentError(
          absl::StrFormat("ids[%d] = %d is not a token id of the tokenizer (its ids are [0, %d))",
                          k, request.ids(k), vocab));
      status.SetPayload(kRequestFieldPayload, absl::Cord("ids"));
      return status;
    }
  }
  tokenizer::DecodeOptions options;
  options.skip_special_tokens = request.skip_special_tokens();
  absl::StatusOr<std::string> text = tokenizer_->Decode(request.ids(), options);
  if (!text.ok()) {
    absl::Status status =
        absl::InvalidArgumentError(absl::StrCat("ids: ", text.status().message()));
    status.SetPayload(kRequestFieldPayload, absl::Cord("ids"));
    return status;
  }
  v1::DetokenizeResponse response;
  response.set_text(*std::move(text));
  return response;
}

absl::StatusOr<v1::ModelInfo> RouterService::GetModelInfo() {
  std::optional<v1::ModelInfo> info = replicas_->model_info();
  if (!info) return absl::UnavailableError("no worker replica has answered yet");
  if (!options_.served_model_name.empty()) info->set_model_name(options_.served_model_name);
  return *std::move(info);
}

absl::StatusOr<v1::AbortResponse> RouterService::Abort(const v1::AbortRequest& request) {
  v1::AbortResponse response;
  absl::MutexLock lock(&mu_);
  auto it = active_.find(request.request_id());
  if (it != active_.end()) {
    it->second->aborted.store(true);
    response.set_found(true);
    MOBIUS_LOG(INFO, "router", request.request_id()) << "abort requested";
  }
  return response;
}

bool RouterService::Ready() {
  return !draining_.load() && replicas_->AnyHealthy() && replicas_->model_info().has_value();
}

void RouterService::StartDrain() {
  if (!draining_.exchange(true)) {
    MOBIUS_LOG(INFO, "router", "") << "draining: " << in_flight() << " requests in flight";
  }
}

bool RouterService::WaitUntilIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](absl::flat_hash_map<std::string, ActiveRequest*>* active) { return active->empty(); },
          &active_),
      deadline);
}

int RouterService::in_flight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(active_.size());
}

}  // namespace mobius::router
