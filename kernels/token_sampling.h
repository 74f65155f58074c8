// The rule that turns one row of logits into a token (temperature, top-k, top-p, min-p) and a
// uniform draw u in [0, 1): the host reference of Backend::SampleRows, and what the worker's
// RequestSampler applies after its penalties. Penalties, random streams and top-n logprobs stay
// with the request (worker/runtime/sampler.h); this is the part a device can do alone.
//
// The draw: with no truncation, the first token in id order whose cumulative weight
// exp((logit - max) / T) passes u times the total; with truncation, the kept candidates are
// ordered by logit (ties: lower id first) and the draw walks them in that order. Greedy rules
// (temperature 0) take the argmax (lowest id among equal maxima) and ignore u.
#ifndef MOBIUS_KERNELS_TOKEN_SAMPLING_H_
#define MOBIUS_KERNELS_TOKEN_SAMPLING_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace mobius::kernels {

struct SamplingRule {
  float temperature = 1.0f;  // 0: greedy
  int top_k = 0;             // 0 or -1: all tokens
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]

  // True when top-k, top-p or min-p can drop a token of a `vocab`-token row.
  [[nodiscard]] bool Truncates(int vocab) const {
    return (top_k > 0 && top_k < vocab) || top_p < 1.0f || min_p > 0.0f;
  }
};

// Penalties on the tokens a sequence has seen, applied to its logits before the rule: the
// multiplicative repetition penalty (a positive logit divided by it, a negative one multiplied)
// on every seen token, then logit -= frequency * count + presence * (count > 0), count being the
// token's occurrences in the output so far. tokens are distinct; counts[i] belongs to tokens[i].
// A second list (shared_tokens / shared_counts, distinct from the first) lets rows share most of
// their entries: the rows of a speculative verify step share their sequence's list and each
// carries only its drafted tokens' entries, so a backend uploads the shared list once.
struct LogitPenalties {
  float repetition = 1.0f;
  float frequency = 0.0f;
  float presence = 0.0f;
  std::span<const int32_t> tokens;
  std::span<const int32_t> counts;
  std::span<const int32_t> shared_tokens;
  std::span<const int32_t> shared_counts;
  // Added to those tokens' logits after the penalties (OpenAI's logit_bias; -infinity bans a
  // token, as min_tokens does with the stop tokens).
  std::span<const int32_t> bias_tokens;
  std::span<const float> biases;
  // When non-empty (sorted, distinct): every other token's logit becomes -infinity, last (vLLM's
  // allowed_token_ids).
  std::span<const int32_t> allowed_tokens;
  // When non-empty: the allowed tokens as a bitmask (token t allowed when bit t % 64 of word
  // t / 64 is set; tokens past the last word are not): every other token's logit becomes
  // -infinity, last, beside allowed_tokens (a token must pass both). A structured-output
  // grammar's mask comes in this form: ~31 KB a row at a 248K vocabulary whatever it allows,
  // where a list could hold 100K ids.
  std::span<const uint64_t> allowed_mask;

  // False when applying them changes nothing (neutral values or no tokens).
  [[nodiscard]] bool Active() const {
    return ((!tokens.empty() || !shared_tokens.empty()) &&
            (repetition != 1.0f || frequency != 0.0f || presence != 0.0f)) ||
           !bias_tokens.empty() || !allowed_tokens.empty() || !allowed_mask.empty();
  }
};

// One seen token's logit under `p` (count: its output occurrences). Every step is a single float
// operation, in this order, so that a device computing the same steps (correctly rounded, no
// fused multiply-add) gets the same bits.
inline float PenalizedLogit(float x, int32_t count, float repetition, float frequency,
                            float presence) {
  if (repetition != 1.0f) x = x > 0 ? x / repetition : x * repetition;
  const volatile float by_count = frequency * static_cast<float>(count);  // no contraction
  const float by_presence = count > 0 ? presence : 0.0f;
  return x - (by_count + by_presence);
}

// Applies `p` to one row of logits in place; tokens outside the row are ignored.
void ApplyLogitPenalties(std::span<float> logits, const LogitPenalties& p);

// The most top-n alternatives a request may ask for (OpenAI's top_logprobs limit).
inline constexpr int kMaxTopLogprobs = 20;

// One of a row's best tokens, for top-n logprobs; token -1 where the row has fewer rankable
// (non-NaN) logits than were asked for.
struct TokenLogit {
  int32_t token = 0;
  float logit = 0;
};

// The n largest logits of a row (ties: lower id first; NaN never ranked), best first, into
// out[0, n) (n <= out's size); entries past the row's rankable logits get token -1.
void TopLogits(std::span<const float> logits, int n, std::span<TokenLogit> out);

struct DrawnToken {
  int32_t token = 0;
  float logprob = 0;  // log-softmax at the rule's temperature (1 for greedy), before truncation
  // Rows of a speculative verify step only (CheckDraft): the rule's probability of the draft.
  // Such rows carry no logprob (0).
  double draft_probability = 0;
};

// Candidates of a truncating rule, sorted by logit (ties: lower id first) with their
// probabilities at the rule's temperature; the first `kept` of them survive top-k, top-p and
// min-p.
struct KeptCandidates {
  std::vector<int32_t> order;
  std::vector<double> p;
  size_t kept = 1;
};

// The index of the first positive weight whose running sum passes `target` (a uniform draw times
// the weights' total), skipping zero weights; the last positive index when rounding leaves
// target at or past the end, and 0 when none is positive.
template <typename Weight>
size_t DrawIndexAt(std::span<const Weight> weights, double target) {
  double acc = 0;
  size_t last = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!(weights[i] > 0)) continue;
    last = i;
    acc += weights[i];
    if (target < acc) break;
  }
  return last;
}

// weights[t] = exp((logits[t] - max_logit) / temperature) (0 for NaN and below e^-87); returns
// their sum. One vectorised pass: the library's expf is a call per element.
double Exponentiate(std::span<const float> logits, float max_logit, float temperature,
                    std::vector<float>& weights);

// Only for rule.Truncates(vocab) and temperature > 0: the candidates the rule keeps, from the
// row's weights (Exponentiate at the rule's temperature) summing to `sum`.
KeptCandidates TruncateCandidates(std::span<const float> logits, const SamplingRule& rule,
                                  float max_logit, std::span<const float> weights, double sum);

// A row's weights buffer for Exponentiate, one per thread: a vocabulary-sized vector per sequence
// would hold 1 MB for each of hundreds of sequences.
std::vector<float>& ThreadLocalWeights();

// One token of `logits` under `rule`, drawn with u in [0, 1).
DrawnToken DrawToken(std::span<const float> logits, const SamplingRule& rule, double u);

// The distribution DrawToken draws from, as probabilities over the vocabulary in `dist`
// (one-hot at the argmax for greedy rules). Speculative decoding accepts drafts against it.
void RuleDistribution(std::span<const float> logits, const SamplingRule& rule,
                      std::vector<double>& dist);

// Speculative verification of a deterministic draft x (worker/runtime/speculative_sampling.h):
// x is accepted with probability p(x) under the rule, and a rejection draws from the residual,
// p without x (normalised). `dist` holds p (RuleDistribution); returns the first token in id
// order whose running probability passes u times the residual's total (p itself when x holds
// all of it: a rejection then has probability 0). x outside the row (kNoDraft) leaves p whole:
// the draw after the last draft. `dist` is modified.
int32_t DrawWithoutDraft(std::vector<double>& dist, int32_t draft, double u);

// Per-row modes of Backend::SampleRows in a speculative verify step: a plain draw (DrawToken),
// or the check of a draft (CheckDraft; kNoDraft for the row after the last draft).
inline constexpr int32_t kPlainDraw = -2;
inline constexpr int32_t kNoDraft = -1;

// One row of a speculative verify step: draft_probability = p(draft) under the rule, token =
// DrawWithoutDraft(p, draft, u), logprob 0. The host reference of Backend::SampleRows' checked
// rows.
DrawnToken CheckDraft(std::span<const float> logits, const SamplingRule& rule, int32_t draft,
                      double u);

// One row of Backend::SampleRows on the host in its mode: DrawToken for kPlainDraw, otherwise
// CheckDraft of `draft`.
inline DrawnToken SampleRow(std::span<const float> logits, const SamplingRule& rule, int32_t draft,
                            double u) {
  return draft == kPlainDraw ? DrawToken(logits, rule, u) : CheckDraft(logits, rule, draft, u);
}

}  // namespace mobius::kernels

#endif  // MOBIUS_KERNELS_TOKEN_SAMPLING_H_
