// `mobius generate`: prefill a prompt of token ids, then decode token by token, printing
// {"prompt_ids": [...], "token_ids": [...]}; optionally dumps the prompt's logits.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/model_flags.h"
#include "cli/replica_flags.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/generation_defaults.h"

ABSL_FLAG(std::string, prompt_ids, "", "Comma-separated prompt token ids, e.g. 1,2,3 (required).");
ABSL_FLAG(int, max_tokens, 16, "Number of tokens to generate after the prompt (>= 0).");
ABSL_FLAG(double, temperature, 0.0,
          "Sampling temperature; 0 is greedy (argmax). Above 0, tokens are sampled from "
          "softmax(logits / temperature) with --sample-seed.");
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

int32_t ChooseToken(const float* logits, int vocab, double temperature, std::mt19937_64& rng) {
  if (temperature <= 0) {
    int32_t best = 0;
    for (int v = 1; v < vocab; ++v) {
      if (logits[v] > logits[best]) best = v;
    }
    return best;
  }
  float max_logit = logits[0];
  for (int v = 1; v < vocab; ++v) max_logit = std::max(max_logit, logits[v]);
  std::vector<double> p(vocab);
  for (int v = 0; v < vocab; ++v) p[v] = std::exp((logits[v] - max_logit) / temperature);
  std::discrete_distribution<int32_t> dist(p.begin(), p.end());
  return dist(rng);
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

  ASSIGN_OR_RETURN(worker::ModelSource source, ModelSourceFromFlags());
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

  // Decode token by token.
  const std::vector<int32_t> eos = absl::GetFlag(FLAGS_ignore_eos)
                                       ? std::vector<int32_t>{}
                                       : worker::ReadEosTokenIds(source.model_dir);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_sample_seed));
  std::vector<int32_t> generated;
  options.logits = worker::LogitsMode::kLastToken;
  const float* last = logits.data() + logits.size() - vocab;
  while (static_cast<int>(generated.size()) < max_tokens) {
    const int32_t token = ChooseToken(last, vocab, temperature, rng);
    generated.push_back(token);
    if (std::find(eos.begin(), eos.end(), token) != eos.end()) break;
    if (static_cast<int>(generated.size()) == max_tokens) break;
    worker::SequenceStep s{std::span<const int32_t>(&generated.back(), 1), &seq};
    RETURN_IF_ERROR(model->Forward(std::span(&s, 1), options, logits));
    last = logits.data();
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
