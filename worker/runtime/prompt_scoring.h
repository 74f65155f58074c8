// Scores of a prompt's own tokens under the model (vLLM's prompt_logprobs). Nothing of a prompt
// was sampled, so a row is scored raw: the log-softmax of the model's logits, without the
// request's temperature, penalties or biases.
#ifndef MOBIUS_WORKER_RUNTIME_PROMPT_SCORING_H_
#define MOBIUS_WORKER_RUNTIME_PROMPT_SCORING_H_

#include <cstdint>
#include <span>

#include "worker/runtime/sampler.h"

namespace mobius::worker {

// The most logits rows one step computes for prompt scoring, over all its sequences: each row is
// a vocabulary of float32 copied to the host (256 rows of a 248K vocabulary: 254 MB), so a
// scored prompt prefills in chunks of at most this many tokens.
inline constexpr int kDefaultMaxPromptScoreRowsPerStep = 256;

// `logits` is the row after some prompt position; `next` the prompt's token that follows it
// (in [0, logits.size())). Returns next's log-probability, its rank (1 + the tokens with a
// larger logit: vLLM counts every token at least as likely, itself included) and the row's
// best `top_n` tokens (kernels::TopLogits' order) with their log-probabilities.
SampledToken ScorePromptToken(std::span<const float> logits, int32_t next, int top_n);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_PROMPT_SCORING_H_
