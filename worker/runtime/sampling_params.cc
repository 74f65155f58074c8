#include "worker/runtime/sampling_params.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "kernels/token_sampling.h"

namespace mobius::worker {
namespace {

absl::Status Bad(const char* field, double value, const char* range) {
  return absl::InvalidArgumentError(
      absl::StrFormat("sampling parameter %s = %g is invalid: must be %s", field, value, range));
}

}  // namespace

absl::Status SamplingParams::Validate(int vocab_size) const {
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    return Bad("temperature", temperature, ">= 0");
  }
  if (top_k < -1) return Bad("top_k", top_k, "-1, 0 (all) or positive");
  if (!(top_p > 0 && top_p <= 1)) return Bad("top_p", top_p, "in (0, 1]");
  if (!(min_p >= 0 && min_p <= 1)) return Bad("min_p", min_p, "in [0, 1]");
  if (!(repetition_penalty > 0) || !std::isfinite(repetition_penalty)) {
    return Bad("repetition_penalty", repetition_penalty, "> 0");
  }
  if (!(presence_penalty >= -2 && presence_penalty <= 2)) {
    return Bad("presence_penalty", presence_penalty, "in [-2, 2]");
  }
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2)) {
    return Bad("frequency_penalty", frequency_penalty, "in [-2, 2]");
  }
  if (max_tokens < 0) return Bad("max_tokens", max_tokens, ">= 0");
  static_assert(kernels::kMaxTopLogprobs == 20, "the message below names the limit");
  if (logprobs < -1 || logprobs > kernels::kMaxTopLogprobs) {
    return Bad("logprobs", logprobs, "in [0, 20] (or unset)");
  }
  if (prompt_logprobs < -1 || prompt_logprobs > kernels::kMaxTopLogprobs) {
    return Bad("prompt_logprobs", prompt_logprobs, "in [0, 20] (or unset)");
  }
  for (int32_t id : stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sampling parameter stop_token_ids contains %d, outside the vocabulary [0, %d)", id,
          vocab_size));
    }
  }
  if (logit_bias.size() > kMaxLogitBias) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling parameter logit_bias has %d entries; at most %d are taken",
                        logit_bias.size(), kMaxLogitBias));
  }
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sampling parameter logit_bias names token %d, outside the vocabulary [0, %d)", id,
          vocab_size));
    }
    if (!(bias >= -100 && bias <= 100)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sampling parameter logit_bias[%d] = %g is invalid: must be in [-100, 100]", id, bias));
    }
  }
  for (size_t i = 0; i < allowed_token_ids.size(); ++i) {
    if (allowed_token_ids[i] < 0 || allowed_token_ids[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sampling parameter allowed_token_ids[%d] = %d is outside the vocabulary [0, %d)", i,
          allowed_token_ids[i], vocab_size));
    }
  }
  if (bad_words.size() > kMaxBadWords) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sampling parameter bad_words has %d entries; at most %d are taken",
                        bad_words.size(), kMaxBadWords));
  }
  for (size_t w = 0; w < bad_words.size(); ++w) {
    if (bad_words[w].empty() || bad_words[w].size() > kMaxBadWordTokens) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sampling parameter bad_words[%d] has %d tokens; it must have 1 to %d", w,
                          bad_words[w].size(), kMaxBadWordTokens));
    }
    for (int32_t id : bad_words[w]) {
      if (id < 0 || id >= vocab_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sampling parameter bad_words[%d] holds token %d, outside the vocabulary [0, %d)", w,
            id, vocab_size));
      }
    }
  }
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sampling parameter min_tokens = %d is invalid: must be in [0, max_tokens = %d]",
        min_tokens, max_tokens));
  }
  return absl::OkStatus();
}

}  // namespace mobius::worker
