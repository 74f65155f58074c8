#include "router/core/request_validation.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grammar/json_schema_compiler.h"
#include "router/inference_service.h"

namespace mobius::router {
namespace {

absl::Status WithField(absl::Status status, std::string_view field) {
  status.SetPayload(kRequestFieldPayload, absl::Cord(std::string(field)));
  return status;
}

absl::Status Bad(std::string_view field, double value, std::string_view requirement) {
  return WithField(
      absl::InvalidArgumentError(absl::StrFormat("sampling_params.%s = %g is invalid: must be %s",
                                                 field, value, requirement)),
      field);
}

}  // namespace

absl::Status ValidateSamplingParams(const v1::SamplingParams& p, const v1::ModelInfo& model) {
  if (p.has_temperature() && !(std::isfinite(p.temperature()) && p.temperature() >= 0)) {
    return Bad("temperature", p.temperature(), "a finite number >= 0 (0 is greedy)");
  }
  if (p.has_top_k() && p.top_k() < -1) {
    return Bad("top_k", p.top_k(), "-1 or 0 (all tokens) or positive");
  }
  if (p.has_top_p() && !(p.top_p() > 0 && p.top_p() <= 1)) {
    return Bad("top_p", p.top_p(), "in (0, 1]");
  }
  if (p.has_min_p() && !(p.min_p() >= 0 && p.min_p() <= 1)) {
    return Bad("min_p", p.min_p(), "in [0, 1]");
  }
  if (p.has_repetition_penalty() &&
      !(std::isfinite(p.repetition_penalty()) && p.repetition_penalty() > 0)) {
    return Bad("repetition_penalty", p.repetition_penalty(), "a finite number > 0");
  }
  if (p.has_presence_penalty() && !(p.presence_penalty() >= -2 && p.presence_penalty() <= 2)) {
    return Bad("presence_penalty", p.presence_penalty(), "in [-2, 2]");
  }
  if (p.has_frequency_penalty() && !(p.frequency_penalty() >= -2 && p.frequency_penalty() <= 2)) {
    return Bad("frequency_penalty", p.frequency_penalty(), "in [-2, 2]");
  }
  if (p.has_max_tokens()) {
    if (p.max_tokens() < 0) return Bad("max_tokens", p.max_tokens(), ">= 0");
    if (p.max_tokens() > model.max_context_length()) {
      return WithField(
          absl::InvalidArgumentError(absl::StrFormat("sampling_params.max_tokens = %d is invalid: "
                                                     "it exceeds the model's context length %d",
                                                     p.max_tokens(), model.max_context_length())),
          "max_tokens");
    }
  }
  if (p.has_logprobs() && (p.logprobs() < 0 || p.logprobs() > 20)) {
    return Bad("logprobs", p.logprobs(), "in [0, 20]");
  }
  if (p.has_prompt_logprobs() && (p.prompt_logprobs() < 0 || p.prompt_logprobs() > 20)) {
    return Bad("prompt_logprobs", p.prompt_logprobs(), "in [0, 20]");
  }
  for (int i = 0; i < p.stop_token_ids_size(); ++i) {
    const int32_t id = p.stop_token_ids(i);
    if (id < 0 || id >= model.vocab_size()) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.stop_token_ids[%d] = %d is outside the model's "
                           "vocabulary [0, %d)",
                           i, id, model.vocab_size())),
                       "stop_token_ids");
    }
  }
  // OpenAI's limit on logit_bias entries is 300; more than this is not a bias but a vocabulary
  // restriction, which allowed_token_ids would express. Stop ids are capped alike.
  constexpr int kMaxLogitBias = 1024;
  constexpr int kMaxStopTokenIds = 1024;
  if (p.stop_token_ids_size() > kMaxStopTokenIds) {
    return WithField(absl::InvalidArgumentError(absl::StrFormat(
                         "sampling_params.stop_token_ids has %d entries; at most %d are taken",
                         p.stop_token_ids_size(), kMaxStopTokenIds)),
                     "stop_token_ids");
  }
  if (p.logit_bias_size() > kMaxLogitBias) {
    return WithField(absl::InvalidArgumentError(absl::StrFormat(
                         "sampling_params.logit_bias has %d entries; at most %d are taken",
                         p.logit_bias_size(), kMaxLogitBias)),
                     "logit_bias");
  }
  for (const auto& [id, bias] : p.logit_bias()) {
    if (id < 0 || id >= model.vocab_size()) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.logit_bias names token %d, outside the model's "
                           "vocabulary [0, %d)",
                           id, model.vocab_size())),
                       "logit_bias");
    }
    if (!(bias >= -100 && bias <= 100)) {
      return WithField(
          absl::InvalidArgumentError(absl::StrFormat(
              "sampling_params.logit_bias[%d] = %g is invalid: must be in [-100, 100]", id, bias)),
          "logit_bias");
    }
  }
  if (p.has_min_tokens()) {
    if (p.min_tokens() < 0) return Bad("min_tokens", p.min_tokens(), ">= 0");
    if (p.has_max_tokens() && p.min_tokens() > p.max_tokens()) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.min_tokens = %d is invalid: it exceeds max_tokens %d",
                           p.min_tokens(), p.max_tokens())),
                       "min_tokens");
    }
  }
  if (p.allowed_token_ids_size() > model.vocab_size()) {
    return WithField(absl::InvalidArgumentError(absl::StrFormat(
                         "sampling_params.allowed_token_ids has %d entries, more than the "
                         "vocabulary's %d tokens",
                         p.allowed_token_ids_size(), model.vocab_size())),
                     "allowed_token_ids");
  }
  for (int i = 0; i < p.allowed_token_ids_size(); ++i) {
    const int32_t id = p.allowed_token_ids(i);
    if (id < 0 || id >= model.vocab_size()) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.allowed_token_ids[%d] = %d is outside the model's "
                           "vocabulary [0, %d)",
                           i, id, model.vocab_size())),
                       "allowed_token_ids");
    }
  }
  // Each text becomes up to two token sequences (BadWordSequences); the worker takes 128.
  constexpr int kMaxBadWordTexts = 64, kMaxBadWordSequences = 128, kMaxBadWordTokens = 64;
  if (p.bad_words_size() > kMaxBadWordTexts) {
    return WithField(absl::InvalidArgumentError(absl::StrFormat(
                         "sampling_params.bad_words has %d entries; at most %d are taken",
                         p.bad_words_size(), kMaxBadWordTexts)),
                     "bad_words");
  }
  for (int i = 0; i < p.bad_words_size(); ++i) {
    if (p.bad_words(i).find_first_not_of(" \t\n\r\f\v") == std::string::npos) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.bad_words[%d] is empty or only whitespace", i)),
                       "bad_words");
    }
  }
  if (p.bad_words_token_ids_size() > kMaxBadWordSequences) {
    return WithField(absl::InvalidArgumentError(absl::StrFormat(
                         "sampling_params.bad_words_token_ids has %d entries; at most %d are taken",
                         p.bad_words_token_ids_size(), kMaxBadWordSequences)),
                     "bad_words_token_ids");
  }
  for (int w = 0; w < p.bad_words_token_ids_size(); ++w) {
    const v1::TokenSequence& word = p.bad_words_token_ids(w);
    if (word.ids_size() == 0 || word.ids_size() > kMaxBadWordTokens) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.bad_words_token_ids[%d] has %d tokens; it must have "
                           "1 to %d",
                           w, word.ids_size(), kMaxBadWordTokens)),
                       "bad_words_token_ids");
    }
    for (int32_t id : word.ids()) {
      if (id < 0 || id >= model.vocab_size()) {
        return WithField(absl::InvalidArgumentError(absl::StrFormat(
                             "sampling_params.bad_words_token_ids[%d] holds token %d, outside "
                             "the model's vocabulary [0, %d)",
                             w, id, model.vocab_size())),
                         "bad_words_token_ids");
      }
    }
  }
  if (p.has_structured_output()) {
    // Compiled here too (the worker compiles again) so that a schema outside the supported
    // subset is refused before a worker is chosen, with its location.
    const v1::StructuredOutput& so = p.structured_output();
    absl::StatusOr<grammar::Grammar> compiled = grammar::Grammar{};
    if (so.has_json_schema()) {
      compiled = grammar::CompileJsonSchemaText(so.json_schema());
    } else if (so.has_tagged_json()) {
      const v1::TaggedJson& t = so.tagged_json();
      compiled =
          grammar::TaggedJsonGrammar(t.begin(), t.json_schema(), t.end(),
                                     t.max_blocks() == 0 ? 1 : t.max_blocks(), t.separator());
    } else if (so.has_regex()) {
      compiled = grammar::RegexGrammar(so.regex());
    } else if (so.has_choice()) {
      compiled = grammar::ChoiceGrammar(
          std::vector<std::string>(so.choice().choices().begin(), so.choice().choices().end()));
    }
    if (!compiled.ok()) {
      return WithField(absl::InvalidArgumentError(absl::StrCat(
                           "sampling_params.structured_output: ", compiled.status().message())),
                       "structured_output");
    }
  }
  for (int i = 0; i < p.stop_size(); ++i) {
    if (p.stop(i).empty()) {
      return WithField(absl::InvalidArgumentError(absl::StrFormat(
                           "sampling_params.stop[%d] is empty; stop strings need a character", i)),
                       "stop");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePrompt(absl::Span<const int32_t> ids, std::string_view field,
                            const v1::ModelInfo& model) {
  if (ids.empty()) {
    return WithField(
        absl::InvalidArgumentError(absl::StrFormat("%s is empty: the prompt needs a token", field)),
        field);
  }
  const bool from_text = field == "text";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= model.vocab_size()) {
      return WithField(
          absl::InvalidArgumentError(absl::StrFormat(
              "%s: token %d at position %d is outside the model's vocabulary [0, %d)%s", field,
              ids[i], i, model.vocab_size(),
              from_text ? " (the router's --tokenizer does not match the served model)" : "")),
          field);
    }
  }
  const int64_t context = model.max_context_length();
  if (static_cast<int64_t>(ids.size()) >= context) {
    return WithField(
        absl::InvalidArgumentError(absl::StrFormat(
            "%s has %d tokens; the model's context length is %d, so a prompt may have at most %d "
            "(one position is left for the first generated token)",
            field, ids.size(), context, context - 1)),
        field);
  }
  return absl::OkStatus();
}

int EffectiveMaxTokens(const v1::SamplingParams& params, int prompt_tokens,
                       const v1::ModelInfo& model) {
  const int requested = params.has_max_tokens() ? params.max_tokens() : kDefaultMaxTokens;
  return std::max(0, std::min(requested, model.max_context_length() - prompt_tokens));
}

v1::SamplingParams WorkerSamplingParams(const v1::SamplingParams& params, int max_tokens) {
  v1::SamplingParams worker = params;
  worker.clear_bad_words();
  worker.clear_stop();
  worker.clear_skip_special_tokens();
  worker.clear_include_stop_str_in_output();
  worker.set_max_tokens(max_tokens);
  if (params.has_min_tokens()) worker.set_min_tokens(std::min(params.min_tokens(), max_tokens));
  return worker;
}

}  // namespace mobius::router
