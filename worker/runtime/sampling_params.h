// Per-request sampling parameters, with the semantics of the OpenAI / vLLM APIs.
#ifndef MOBIUS_WORKER_RUNTIME_SAMPLING_PARAMS_H_
#define MOBIUS_WORKER_RUNTIME_SAMPLING_PARAMS_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "grammar/structured_output.h"

namespace mobius::worker {

// The most logit_bias entries a request may carry (OpenAI allows 300); more is not a bias but a
// vocabulary restriction.
inline constexpr size_t kMaxLogitBias = 1024;
// The most bad_words sequences a request may carry, and tokens in each: each costs a comparison
// per step.
inline constexpr size_t kMaxBadWords = 128;
inline constexpr size_t kMaxBadWordTokens = 64;

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy
  int top_k = 0;                    // 0 or -1: all tokens
  float top_p = 1.0f;               // nucleus mass, (0, 1]
  float min_p = 0.0f;               // drop tokens with p < min_p * p_max, [0, 1]
  float repetition_penalty = 1.0f;  // > 0; divides positive / multiplies negative logits of seen
                                    // tokens (prompt and output), as in vLLM / HF
  float presence_penalty = 0.0f;    // [-2, 2]; subtracted once per token present in the output
  float frequency_penalty = 0.0f;   // [-2, 2]; subtracted per occurrence in the output
  std::optional<uint64_t> seed;     // same seed + same inputs: same tokens
  int max_tokens = 16;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int logprobs = -1;  // -1: none; n >= 0: chosen token's logprob plus top n
  // Added to the tokens' logits after the penalties (OpenAI's logit_bias), each in [-100, 100].
  std::vector<std::pair<int32_t, float>> logit_bias;
  // The stop tokens (EOS unless ignore_eos, and stop_token_ids) cannot be drawn before this many
  // output tokens (vLLM's min_tokens), <= max_tokens.
  int min_tokens = 0;
  // -1: none; n >= 0: every prompt token after the first scored (logprob and rank, raw logits)
  // with the top n, delivered with the first output (vLLM's prompt_logprobs).
  int prompt_logprobs = -1;
  // When non-empty: only these tokens can be drawn (vLLM's allowed_token_ids).
  std::vector<int32_t> allowed_token_ids;
  // Token sequences that must not be generated (vLLM's bad_words, tokenized by the router): the
  // last token of each is banned wherever the output ends with the rest of it.
  std::vector<std::vector<int32_t>> bad_words;
  // What the output must be (a JSON schema, any JSON object, one of fixed strings); kind kNone:
  // free text. Compiled by the engine, which needs the tokenizer's vocabulary for it.
  grammar::StructuredOutputSpec structured_output;

  // InvalidArgument naming the field, its value and the allowed range.
  [[nodiscard]] absl::Status Validate(int vocab_size) const;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_SAMPLING_PARAMS_H_
