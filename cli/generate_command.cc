// `mobius generate`: prefill a prompt of token ids, then decode token by token, printing
// {"prompt_ids": [...], "token_ids": [...]}; optionally dumps the prompt's logits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/model_flags.h"
#include "cli/replica_flags.h"
#include "common/status_macros.h"
#include "kernels/token_sampling.h"
#include "nlohmann/json.hpp"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/generation_defaults.h"
#include "worker/runtime/speculative_decoder.h"

ABSL_FLAG(std::string, prompt_ids, "", "Comma-separated prompt token ids, e.g. 1,2,3 (required).");
ABSL_FLAG(int, max_tokens, 16, "Number of tokens to generate after the prompt (>= 0).");
ABSL_FLAG(double, temperature, 0.0,
          "Sampling temperature; 0 is greedy (argmax). Above 0, tokens are sampled from "
          "softmax(logits / temperature) with --sample-seed (on the GPU with --device cuda).");
ABSL_FLAG(uint64_t, sample_seed, 0, "Seed of the sampler when --temperature > 0.");
ABSL_FLAG(std::string, dump_logits, "",
          "Write the logits of a single forward over the prompt to this safetensors file: one "
          "float32 tensor \"logits\" of shape [prompt_len, vocab].");
ABSL_FLAG(int, prefill_chunk, 0,
          "Prefill the prompt in chunks of this many tokens, each continuing from the cached "
          "state (0: the whole prompt in one step).");
ABSL_FLAG(std::string, delta_rule, "auto",
          "DeltaNet algorithm for prefill: \"auto\" (chunked for prompts, recurrent for decode), "
          "\"chunked\" or \"recurrent\" (token by token; a reference for the chunked form).");
ABSL_FLAG(bool, ignore_eos, false,
          "Keep generating after an end-of-sequence token from <model>/generation_config.json.");

namespace mobius::cli {
namespace {

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int32_t id;
    if (!absl::SimpleAtoi(part, &id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt-ids: \"", part, "\" is not an integer token id"));
    }
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError("--prompt-ids is required and non-empty");
  return ids;
}

// --spec-tokens k: the MTP head drafts, one target forward verifies (SpeculativeDecoder). Prints
// the same JSON as plain decoding, and the acceptance statistics on stderr.
absl::Status GenerateSpeculatively(worker::HybridModel& model, const std::vector<int32_t>& prompt,
                                   int max_tokens, double temperature,
                                   const std::vector<int32_t>& eos, int spec_tokens,
                                   worker::DraftVocabulary vocabulary) {
  // In 64 bits and capped at the model's positions (the forward refuses more; drafts past the
  // end are never proposed): a huge --max-tokens must not overflow the sum.
  const int sequence_len = static_cast<int>(std::min<int64_t>(
      static_cast<int64_t>(prompt.size()) + max_tokens, model.config().max_position_embeddings));
  // The sequence's state slot and its spare (where verify steps write), with room for one step's
  // drafts; the drafter adds that room to the head's caches itself.
  RETURN_IF_ERROR(model.CreateCaches(/*max_sequences=*/2, sequence_len + spec_tokens));
  ASSIGN_OR_RETURN(
      std::unique_ptr<worker::MtpDrafter> drafter,
      MtpDrafterFromFlags(model, /*max_sequences=*/1, sequence_len, std::move(vocabulary)));
  worker::SpeculativeRequest request;
  request.prompt = prompt;
  request.max_new_tokens = max_tokens;
  request.spec_tokens = spec_tokens;
  request.stop_tokens = eos;
  if (temperature > 0) {
    request.params.temperature = static_cast<float>(temperature);
    request.seed = absl::GetFlag(FLAGS_sample_seed);
  }
  worker::SpeculativeDecoder decoder(model, *drafter);
  std::vector<std::vector<int32_t>> outputs;
  RETURN_IF_ERROR(decoder.Generate(std::span(&request, 1), outputs));
  nlohmann::json out;
  out["prompt_ids"] = prompt;
  out["token_ids"] = outputs[0];
  std::printf("%s\n", out.dump().c_str());
  const worker::SpeculationStats& stats = decoder.stats();
  std::string per_position;
  for (size_t j = 0; j < stats.proposed.size(); ++j) {
    absl::StrAppend(&per_position, j == 0 ? "" : " ",
                    absl::StrFormat("%.3f", stats.AcceptanceRate(static_cast<int>(j))));
  }
  const worker::DraftVocabulary& drafts_from = drafter->vocabulary();
  const std::string over = drafts_from.whole() ? std::string("the whole vocabulary")
                                               : absl::StrFormat("%d tokens (--spec-token-map)",
                                                                 drafts_from.ids().size());
  std::fprintf(stderr,
               "speculation: %lld verify steps, mean accepted length %.3f tokens/step, acceptance "
               "per draft position [%s], %lld rollbacks; draft %.1f ms, verify %.1f ms, rollback "
               "%.1f ms; the head drafts over %s\n",
               static_cast<long long>(stats.verify_steps), stats.MeanAcceptedLength(),
               per_position.c_str(), static_cast<long long>(stats.rollback_steps),
               1e3 * stats.draft_seconds, 1e3 * stats.verify_seconds, 1e3 * stats.rollback_seconds,
               over.c_str());
  return absl::OkStatus();
}

absl::Status Generate() {
  ASSIGN_OR_RETURN(std::vector<int32_t> prompt, ParseIds(absl::GetFlag(FLAGS_prompt_ids)));
  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  const double temperature = absl::GetFlag(FLAGS_temperature);
  const int chunk = absl::GetFlag(FLAGS_prefill_chunk);
  if (max_tokens < 0) return absl::InvalidArgumentError("--max-tokens must be >= 0");
  if (!(temperature >= 0)) return absl::InvalidArgumentError("--temperature must be >= 0");
  if (chunk < 0) return absl::InvalidArgumentError("--prefill-chunk must be >= 0");
  const std::string dump_path = absl::GetFlag(FLAGS_dump_logits);

  ASSIGN_OR_RETURN(const int spec_tokens, SpecTokensFromFlags());
  if (spec_tokens > 0 && (!dump_path.empty() || chunk > 0)) {
    return absl::InvalidArgumentError(
        "--spec-tokens cannot be combined with --dump-logits or --prefill-chunk (the speculative "
        "decoder prefills the whole prompt in one step)");
  }
  ASSIGN_OR_RETURN(worker::ModelSource source, ModelSourceFromFlags());
  ASSIGN_OR_RETURN(worker::DraftVocabulary draft_vocabulary, DraftVocabularyFromFlags(source));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, BackendFromFlags());
  // With --world-size > 1 this process is one rank of a replica: rank 0 runs the command, the
  // others follow its steps until it stops them.
  ASSIGN_OR_RETURN(ReplicaRank replica, JoinReplicaForCommand(source, *backend));
  ASSIGN_OR_RETURN(std::unique_ptr<worker::HybridModel> model,
                   worker::LoadHybridModel(source, *backend));
  ApplyModelRuntimeFlags(*model);
  RETURN_IF_ERROR(AttachReplica(*model, replica));
  if (!replica.leader()) return worker::FollowLeader(*model, *replica.comm);
  absl::Cleanup stop_replica = [&] { StopReplica(*model, replica); };
  const std::vector<int32_t> eos = absl::GetFlag(FLAGS_ignore_eos)
                                       ? std::vector<int32_t>{}
                                       : worker::ReadEosTokenIds(source.model_dir);
  if (spec_tokens > 0) {
    return GenerateSpeculatively(*model, prompt, max_tokens, temperature, eos, spec_tokens,
                                 std::move(draft_vocabulary));
  }
  const int vocab = model->config().vocab_size;
  RETURN_IF_ERROR(
      model->CreateCaches(/*max_sequences=*/1, static_cast<int>(prompt.size()) + max_tokens));
  worker::SequenceCache seq;
  RETURN_IF_ERROR(model->StartSequence(seq));

  // Prefill. With --dump-logits every prompt position's logits are kept.
  worker::ForwardOptions options;
  const std::string algorithm = absl::GetFlag(FLAGS_delta_rule);
  if (algorithm == "recurrent") {
    options.delta_rule = kernels::DeltaRuleAlgorithm::kRecurrent;
  } else if (algorithm == "chunked") {
    options.delta_rule = kernels::DeltaRuleAlgorithm::kChunked;
  } else if (algorithm != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--delta-rule \"", algorithm, "\" is not one of auto, chunked, recurrent"));
  }
  options.logits =
      dump_path.empty() ? worker::LogitsMode::kLastToken : worker::LogitsMode::kAllTokens;
  std::vector<float> logits, prompt_logits;
  const size_t step = chunk > 0 ? static_cast<size_t>(chunk) : prompt.size();
  for (size_t begin = 0; begin < prompt.size(); begin += step) {
    const size_t count = std::min(step, prompt.size() - begin);
    worker::SequenceStep s{std::span<const int32_t>(prompt).subspan(begin, count), &seq};
    RETURN_IF_ERROR(model->Forward(std::span(&s, 1), options, logits));
    if (!dump_path.empty()) prompt_logits.insert(prompt_logits.end(), logits.begin(), logits.end());
  }
  if (!dump_path.empty()) {
    worker::TensorToWrite t{"logits",
                            kernels::DType::kF32,
                            {static_cast<int64_t>(prompt.size()), vocab},
                            prompt_logits.data(),
                            prompt_logits.size() * sizeof(float)};
    RETURN_IF_ERROR(worker::WriteSafetensors(dump_path, {t}));
  }

  // Decode token by token under the serving rule (kernels/token_sampling.h): the first token from
  // the prompt's last logits on the host, the others drawn by the backend (on the GPU with
  // --device cuda: only the token comes back).
  std::mt19937_64 rng(absl::GetFlag(FLAGS_sample_seed));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const kernels::SamplingRule rule{static_cast<float>(temperature)};
  auto next_uniform = [&] { return temperature > 0 ? uniform(rng) : 0.0; };
  std::vector<int32_t> generated;
  options.logits = worker::LogitsMode::kLastToken;
  std::vector<kernels::DrawnToken> drawn;
  double u = next_uniform();
  options.sampled_tokens = &drawn;
  options.sampling_rules = std::span<const kernels::SamplingRule>(&rule, 1);
  options.sampling_uniforms = std::span<const double>(&u, 1);
  int32_t token = kernels::DrawToken(
                      std::span<const float>(logits).subspan(logits.size() - vocab, vocab), rule, u)
                      .token;
  while (max_tokens > 0) {
    generated.push_back(token);
    if (std::find(eos.begin(), eos.end(), token) != eos.end()) break;
    if (static_cast<int>(generated.size()) >= max_tokens) break;
    u = next_uniform();
    worker::SequenceStep s{std::span<const int32_t>(&generated.back(), 1), &seq};
    RETURN_IF_ERROR(model->Forward(std::span(&s, 1), options, logits));
    token = drawn[0].token;
  }

  nlohmann::json out;
  out["prompt_ids"] = prompt;
  out["token_ids"] = generated;
  std::printf("%s\n", out.dump().c_str());
  return absl::OkStatus();
}

}  // namespace

int RunGenerateCommand() {
  absl::Status status = Generate();
  if (!status.ok()) {
    std::fprintf(stderr, "mobius generate: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace mobius::cli
