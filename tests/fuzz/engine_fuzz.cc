// Fuzzes the worker's engine (scheduler, sampler, structured output, stop tokens, cancellation,
// preemption) on the Intern-S2-Mobius tiny fixture on the CPU: a few requests at once with fuzzed
// prompts and sampling parameters (as the worker receives them: a serialized SamplingParams
// through FromProto), in a small KV cache so that they chunk their prefills and preempt each
// other. Every request must be refused with InvalidArgument or finish exactly once, and a finished
// stream must keep its promises: tokens within the vocabulary and max_tokens, completion_tokens
// counting them, one logprob entry per token when asked, no stop token before min_tokens, only
// allowed_token_ids, and output bytes that the request's grammar accepts.
//
// Input: a flags byte (requests 1-3, which to cancel), then per request a prompt length byte, that
// many prompt bytes (ids), a parameters length byte and that many bytes of SamplingParams.
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grammar/grammar_matcher.h"
#include "grammar/structured_output.h"
#include "kernels/backend.h"
#include "sampling.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_files.h"
#include "tests/runtime/piece_vocabulary.h"
#include "worker/model/generation_defaults.h"
#include "worker/model/model_factory.h"
#include "worker/runtime/engine.h"
#include "worker/server/proto_convert.h"

namespace {

using mobius::worker::Engine;
using mobius::worker::FinishReason;
using mobius::worker::GenerationOutput;
using mobius::worker::GenerationRequest;

constexpr int kMaxTokens = 12;  // outputs are capped here to keep an input short

struct Fixture {
  std::unique_ptr<mobius::kernels::Backend> backend;
  std::unique_ptr<mobius::worker::HybridModel> model;
  std::shared_ptr<const mobius::grammar::TokenVocabulary> vocabulary;
  std::unique_ptr<Engine> engine;
  int vocab_size = 0;
  std::vector<int32_t> eos;
};
Fixture* g_fixture = nullptr;

// One request's stream as it arrives.
struct Stream {
  std::vector<int32_t> tokens;
  int logprob_entries = 0;
  int final_messages = 0;
  GenerationOutput last;
  absl::Notification done;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const std::string dir = mobius::fuzz::FixturePath("intern-s2-mobius-tiny").string();
  auto* f = new Fixture;
  f->backend = mobius::kernels::CreateCpuBackend(1);
  mobius::worker::ModelSource source;
  source.model_dir = dir;
  auto model = mobius::worker::LoadHybridModel(source, *f->backend);
  if (!model.ok()) {
    std::fprintf(stderr, "engine_fuzz: %s\n", model.status().ToString().c_str());
    std::abort();
  }
  f->model = *std::move(model);
  f->vocab_size = f->model->config().vocab_size;
  f->eos = mobius::worker::ReadEosTokenIds(dir);
  if (f->eos.empty()) f->eos = {0};
  f->vocabulary = mobius::testing::PieceVocabulary(f->vocab_size, f->eos.front());
  mobius::worker::EngineOptions options;
  options.max_model_len = 96;
  options.kv_block_size = 16;
  options.num_kv_blocks = 10;  // fewer than three full sequences: preemption
  options.scheduler.max_num_seqs = 3;
  options.scheduler.max_tokens_per_step = 24;  // long prompts prefill in chunks
  options.eos_token_ids = f->eos;
  options.vocabulary = f->vocabulary;
  auto engine = Engine::Create(*f->model, options);
  if (!engine.ok()) {
    std::fprintf(stderr, "engine_fuzz: %s\n", engine.status().ToString().c_str());
    std::abort();
  }
  f->engine = *std::move(engine);
  g_fixture = f;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = *g_fixture;
  mobius::fuzz::InputCursor input(data, size);
  const uint8_t flags = input.TakeByte();
  const int requests = 1 + flags % 3;
  static int serial = 0;

  std::vector<GenerationRequest> accepted;
  std::map<std::string, std::unique_ptr<Stream>> streams;
  absl::Mutex mu;
  for (int r = 0; r < requests; ++r) {
    GenerationRequest request;
    request.request_id = "f" + std::to_string(serial++);
    const int prompt_length = input.TakeByte() % 80;
    for (int i = 0; i < prompt_length; ++i) {
      request.prompt.push_back((input.TakeByte() * 7 + i) % f.vocab_size);
    }
    const int params_length = input.TakeByte();
    std::string params_bytes;
    for (int i = 0; i < params_length && !input.Rest().empty(); ++i) {
      params_bytes.push_back(static_cast<char>(input.TakeByte()));
    }
    mobius::v1::SamplingParams proto;
    if (!proto.ParseFromString(params_bytes)) proto.Clear();
    if (!proto.has_max_tokens() || proto.max_tokens() > kMaxTokens)
      proto.set_max_tokens(kMaxTokens);
    request.params = mobius::worker::FromProto(proto);
    if (request.params.min_tokens > request.params.max_tokens) {
      request.params.min_tokens = request.params.max_tokens;  // as the router caps it
    }
    auto stream = std::make_unique<Stream>();
    Stream* s = stream.get();
    const absl::Status status = f.engine->Enqueue(request, [s, &mu](const GenerationOutput& out) {
      absl::MutexLock lock(&mu);
      s->tokens.insert(s->tokens.end(), out.tokens.begin(), out.tokens.end());
      s->logprob_entries += static_cast<int>(out.logprobs.size());
      if (out.finish != FinishReason::kNone) {
        ++s->final_messages;
        s->last = out;
        if (!s->done.HasBeenNotified()) s->done.Notify();
      }
    });
    if (!status.ok()) {
      FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                     status.code() == absl::StatusCode::kFailedPrecondition,
                 status.ToString());
      continue;
    }
    streams[request.request_id] = std::move(stream);
    accepted.push_back(std::move(request));
  }
  for (size_t r = 0; r < accepted.size(); ++r) {
    if ((flags >> (3 + r)) & 1) f.engine->Cancel(accepted[r].request_id);
  }

  for (const GenerationRequest& request : accepted) {
    Stream& s = *streams[request.request_id];
    FUZZ_CHECK(s.done.WaitForNotificationWithTimeout(absl::Seconds(60)),
               "request " + request.request_id + " never finished");
  }
  absl::MutexLock lock(&mu);
  for (const GenerationRequest& request : accepted) {
    const Stream& s = *streams[request.request_id];
    const mobius::worker::SamplingParams& p = request.params;
    const std::string id = request.request_id;
    FUZZ_CHECK(s.final_messages == 1, id + ": final messages " + std::to_string(s.final_messages));
    if (std::getenv("MOBIUS_FUZZ_VERBOSE") != nullptr) {
      std::fprintf(stderr, "engine_fuzz: %s: prompt %zu, %zu tokens, finish %d %s\n", id.c_str(),
                   request.prompt.size(), s.tokens.size(), static_cast<int>(s.last.finish),
                   s.last.error.ToString().c_str());
    }
    if (s.last.finish == FinishReason::kError) continue;  // refused inside: its status says why
    FUZZ_CHECK(static_cast<int>(s.tokens.size()) <= p.max_tokens, id + ": past max_tokens");
    FUZZ_CHECK(s.last.completion_tokens == static_cast<int>(s.tokens.size()),
               id + ": completion_tokens " + std::to_string(s.last.completion_tokens) + " for " +
                   std::to_string(s.tokens.size()) + " tokens");
    if (p.logprobs >= 0) {
      FUZZ_CHECK(s.logprob_entries == static_cast<int>(s.tokens.size()), id + ": logprobs");
    }
    for (size_t i = 0; i < s.tokens.size(); ++i) {
      const int32_t t = s.tokens[i];
      FUZZ_CHECK(t >= 0 && t < f.vocab_size, id + ": token " + std::to_string(t));
      if (!p.allowed_token_ids.empty() && s.last.matched_stop_token != t) {
        FUZZ_CHECK(std::find(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), t) !=
                       p.allowed_token_ids.end(),
                   id + ": token " + std::to_string(t) + " is not allowed");
      }
    }
    if (s.last.matched_stop_token.has_value() && s.last.finish == FinishReason::kStop) {
      FUZZ_CHECK(static_cast<int>(s.tokens.size()) > p.min_tokens,
                 id + ": stopped before min_tokens");
    }
    if (p.structured_output.kind != mobius::grammar::StructuredOutputSpec::Kind::kNone) {
      auto grammar = mobius::grammar::CompileStructuredOutput(p.structured_output);
      FUZZ_CHECK(grammar.ok(), id + ": an accepted grammar does not compile");
      mobius::grammar::GrammarMatcher matcher(*grammar);
      for (const int32_t t : s.tokens) {
        if (s.last.matched_stop_token == t) continue;  // the stop token spells nothing
        FUZZ_CHECK(matcher.FeedBytes(f.vocabulary->bytes(t)),
                   id + ": token " + std::to_string(t) + " breaks the grammar");
      }
    }
  }
  return 0;
}
