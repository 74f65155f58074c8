// Turns one row of logits into the next token of one sequence, applying the request's
// penalties, temperature and truncations (top-k, top-p, min-p), with a per-request random stream
// so that a seeded request is reproducible whatever else shares its batch.
#ifndef MOBIUS_WORKER_RUNTIME_SAMPLER_H_
#define MOBIUS_WORKER_RUNTIME_SAMPLER_H_

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "kernels/token_sampling.h"
#include "worker/runtime/sampling_params.h"

namespace mobius::worker {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;  // of the distribution after penalties and temperature, before truncation
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0;
  std::vector<TokenLogprob> top;  // top-n alternatives when logprobs > 0, best first
  // Prompt scores only (ScorePromptToken): 1-based rank in the vocabulary; 0: not computed.
  int32_t rank = 0;
};

// Counts of the tokens a sequence has seen, for penalties.
class TokenHistory {
 public:
  void AddPrompt(std::span<const int32_t> tokens);
  void AddOutput(int32_t token);
  [[nodiscard]] bool InPrompt(int32_t token) const;
  [[nodiscard]] int OutputCount(int32_t token) const;
  [[nodiscard]] const std::vector<int32_t>& seen() const { return seen_; }  // distinct tokens
  // counts()[i]: the output occurrences of seen()[i] (0 for a token seen only in the prompt).
  [[nodiscard]] const std::vector<int32_t>& counts() const { return seen_counts_; }
  // Output tokens added so far.
  [[nodiscard]] int output_length() const { return output_length_; }
  // The output tokens in order (bad_words match on its end).
  [[nodiscard]] const std::vector<int32_t>& output() const { return output_; }

 private:
  // The position of `token` in seen_, added if new.
  size_t Touch(int32_t token);
  std::vector<int32_t> seen_;
  std::vector<int32_t> seen_counts_;
  std::vector<uint8_t> in_prompt_;
  std::vector<int32_t> position_;  // token -> 1 + its index in seen_; 0: not seen
  std::vector<int32_t> output_;
  int output_length_ = 0;
};

// The index of one draw from non-negative weights that sum to `total` (kernels::DrawIndexAt with
// a uniform draw from [0, total)).
template <typename Weight>
size_t DrawIndex(std::span<const Weight> weights, double total, std::mt19937_64& rng) {
  return kernels::DrawIndexAt(weights, std::uniform_real_distribution<double>(0.0, total)(rng));
}

class RequestSampler {
 public:
  // `fallback_seed` seeds the stream when the request has none. `eos_token_ids` are the model's
  // (min_tokens bans them with the request's stop_token_ids until the output is long enough).
  RequestSampler(const SamplingParams& params, uint64_t fallback_seed,
                 std::span<const int32_t> eos_token_ids = {});

  // Samples from `logits` (one row, vocab entries; modified in place).
  SampledToken Sample(std::span<float> logits, const TokenHistory& history);
  // True when Sample's token is the argmax of the raw logits and nothing else of its result is
  // used (greedy, no penalties, no logprobs): the engine then takes the argmax on the device.
  [[nodiscard]] bool ArgmaxOnly() const {
    return params_.temperature == 0 && params_.repetition_penalty == 1.0f &&
           params_.presence_penalty == 0.0f && params_.frequency_penalty == 0.0f &&
           params_.logprobs < 0 && bias_tokens_.empty() && banned_tokens_.empty() &&
           allowed_.empty() && params_.bad_words.empty() && !constrained_;
  }
  // Structured output: the tokens the request's grammar allows at the next draw, as a bitmask
  // over the vocabulary (grammar::TokenConstraint::NextMask), which Sample and Penalties apply
  // beside allowed_token_ids (a token must pass both).
  void ConstrainNext(std::vector<uint64_t> mask);
  // The distribution Sample draws from (penalties, temperature, top-k/top-p/min-p; one-hot at the
  // argmax for greedy requests), as probabilities over the vocabulary; `logits` is modified in
  // place as Sample does. Speculative decoding accepts drafts against it. Draws nothing.
  [[nodiscard]] std::vector<double> Distribution(std::span<float> logits,
                                                 const TokenHistory& history) const;
  // The same into `dist` (resized to the vocabulary), so that a caller can keep one buffer: a
  // fresh 2 MB vector per row costs more in page faults than the distribution itself.
  void Distribution(std::span<float> logits, const TokenHistory& history,
                    std::vector<double>& dist) const;
  // Sample in parts, for a backend that draws on the device: Penalties() for
  // Backend::PenalizeRows, then Rule() with NextUniform() for Backend::SampleRows, then
  // TopLogprobs() from Backend::TopLogitsRows when TopLogprobCount() > 0.
  [[nodiscard]] kernels::SamplingRule Rule() const {
    return {params_.temperature, params_.top_k, params_.top_p, params_.min_p};
  }
  // The request's penalties over `history`'s tokens, its logit biases as of its output (with the
  // tokens its bad_words ban there at -infinity) and its allowed tokens (inactive when it has
  // none); the spans point into `history` and into this sampler, until the next call.
  [[nodiscard]] kernels::LogitPenalties Penalties(const TokenHistory& history) const;
  // The penalties of the k + 1 rows of a speculative verify step of `drafts`, row j counting
  // drafts[0, j) as output beyond `history`. The rows share one list, the history's tokens
  // without the drafted ones; each row's own list holds the drafted tokens' entries as of that
  // row. The spans point into `lists` (left empty, the penalties inactive, when the request has
  // none) and, for the biases (row j's as of j more output tokens), into this sampler.
  struct VerifyPenaltyLists {
    std::vector<int32_t> shared_tokens, shared_counts;
    std::vector<std::vector<int32_t>> row_tokens, row_counts;
    // Rows where bad_words ban tokens: their whole bias lists (the biases, then the bans).
    std::vector<std::vector<int32_t>> row_bias_tokens;
    std::vector<std::vector<float>> row_biases;
  };
  [[nodiscard]] std::vector<kernels::LogitPenalties> VerifyPenalties(
      const TokenHistory& history, std::span<const int32_t> drafts,
      VerifyPenaltyLists& lists) const;
  // The top-n alternatives Sample reports, from the row's n best (token, logit) pairs (penalised,
  // TopLogits' order) and the drawn token with its logit: the log-softmax of every token differs
  // from the drawn token's by their logits' difference over the temperature.
  [[nodiscard]] std::vector<TokenLogprob> TopLogprobs(
      const kernels::DrawnToken& drawn, float drawn_logit,
      std::span<const kernels::TokenLogit> top) const;
  // The number of top-n alternatives the request asks for (0: none).
  [[nodiscard]] int TopLogprobCount() const { return params_.logprobs > 0 ? params_.logprobs : 0; }
  // The uniform draw Sample would make next from the request's stream (none for greedy
  // requests: 0), so that sampling on the device keeps a seeded request's tokens.
  double NextUniform();
  // The request's random stream, for draws made outside Sample (speculative acceptance), so a
  // seeded request stays reproducible.
  [[nodiscard]] std::mt19937_64& rng() { return rng_; }

 private:
  void ApplyPenalties(std::span<float> logits, const TokenHistory& history) const;

  // The logit biases of a row whose output so far is `output` then `drafted`: logit_bias, plus
  // -infinity on the stop tokens while it is shorter than min_tokens (spans into the members),
  // and -infinity on the tokens its bad_words ban after it (then the lists are built in
  // `tokens` and `biases`, the row's own storage).
  void SetBiases(std::span<const int32_t> output, std::span<const int32_t> drafted,
                 std::vector<int32_t>& tokens, std::vector<float>& biases,
                 kernels::LogitPenalties& p) const;

  SamplingParams params_;
  std::mt19937_64 rng_;
  // logit_bias by token (sorted), and the same with the stop tokens at -infinity (min_tokens).
  std::vector<int32_t> bias_tokens_, banned_tokens_;
  std::vector<float> biases_, banned_biases_;
  std::vector<int32_t> allowed_;  // allowed_token_ids, sorted and distinct
  // Structured output: whether the request has a grammar, and its mask at the next draw
  // (ConstrainNext).
  bool constrained_ = false;
  std::vector<uint64_t> constrained_mask_;
  // Penalties()' bias lists when bad_words ban tokens (a sequence samples one row at a time).
  mutable std::vector<int32_t> row_bias_tokens_;
  mutable std::vector<float> row_biases_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_SAMPLER_H_
