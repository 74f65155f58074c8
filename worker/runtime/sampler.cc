#include "worker/runtime/sampler.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>

namespace mobius::worker {

size_t TokenHistory::Touch(int32_t token) {
  if (static_cast<size_t>(token) >= position_.size()) {
    position_.resize(static_cast<size_t>(token) + 1, 0);
    in_prompt_.resize(static_cast<size_t>(token) + 1, 0);
  }
  if (position_[token] == 0) {
    seen_.push_back(token);
    seen_counts_.push_back(0);
    position_[token] = static_cast<int32_t>(seen_.size());
  }
  return static_cast<size_t>(position_[token] - 1);
}

void TokenHistory::AddPrompt(std::span<const int32_t> tokens) {
  for (int32_t t : tokens) {
    if (t < 0) continue;
    Touch(t);
    in_prompt_[t] = 1;
  }
}

void TokenHistory::AddOutput(int32_t token) {
  ++output_length_;  // a position of the output, whatever token fills it
  output_.push_back(token);
  if (token < 0) return;
  ++seen_counts_[Touch(token)];
}

bool TokenHistory::InPrompt(int32_t token) const {
  return token >= 0 && static_cast<size_t>(token) < in_prompt_.size() && in_prompt_[token];
}

int TokenHistory::OutputCount(int32_t token) const {
  if (token < 0 || static_cast<size_t>(token) >= position_.size() || position_[token] == 0) {
    return 0;
  }
  return seen_counts_[position_[token] - 1];
}

RequestSampler::RequestSampler(const SamplingParams& params, uint64_t fallback_seed,
                               std::span<const int32_t> eos_token_ids)
    : params_(params), rng_(params.seed.value_or(fallback_seed)) {
  std::map<int32_t, float> bias(params.logit_bias.begin(), params.logit_bias.end());
  for (const auto& [token, b] : bias) {
    bias_tokens_.push_back(token);
    biases_.push_back(b);
  }
  allowed_ = params.allowed_token_ids;
  std::sort(allowed_.begin(), allowed_.end());
  allowed_.erase(std::unique(allowed_.begin(), allowed_.end()), allowed_.end());
  constrained_ = params.structured_output.kind != grammar::StructuredOutputSpec::Kind::kNone;
  if (params.min_tokens > 0) {
    std::map<int32_t, float> banned = bias;
    // (A constrained output ends at the end-of-sequence token even with ignore_eos.)
    if (!params.ignore_eos || constrained_) {
      for (int32_t t : eos_token_ids) banned[t] = -std::numeric_limits<float>::infinity();
    }
    for (int32_t t : params.stop_token_ids) banned[t] = -std::numeric_limits<float>::infinity();
    for (const auto& [token, b] : banned) {
      banned_tokens_.push_back(token);
      banned_biases_.push_back(b);
    }
  }
}

void RequestSampler::SetBiases(std::span<const int32_t> output, std::span<const int32_t> drafted,
                               std::vector<int32_t>& tokens, std::vector<float>& biases,
                               kernels::LogitPenalties& p) const {
  const bool short_output =
      static_cast<int64_t>(output.size() + drafted.size()) < params_.min_tokens;
  const std::vector<int32_t>& base_tokens = short_output ? banned_tokens_ : bias_tokens_;
  const std::vector<float>& base_biases = short_output ? banned_biases_ : biases_;
  p.bias_tokens = base_tokens;
  p.biases = base_biases;
  // bad_words (vLLM's): a word's last token is banned where the output ends with the rest of it
  // (a one-token word always). The output is `output` then `drafted`.
  const size_t length = output.size() + drafted.size();
  auto token_from_end = [&](size_t back) {  // back >= 1
    const size_t at = length - back;
    return at < output.size() ? output[at] : drafted[at - output.size()];
  };
  tokens.clear();
  for (const std::vector<int32_t>& word : params_.bad_words) {
    const size_t prefix = word.size() - 1;
    if (prefix > length) continue;
    bool match = true;
    for (size_t i = 0; i < prefix && match; ++i) match = token_from_end(prefix - i) == word[i];
    if (match) tokens.push_back(word.back());
  }
  if (tokens.empty()) return;
  const size_t bans = tokens.size();
  tokens.insert(tokens.begin(), base_tokens.begin(), base_tokens.end());
  biases.assign(base_biases.begin(), base_biases.end());
  biases.resize(biases.size() + bans, -std::numeric_limits<float>::infinity());
  p.bias_tokens = tokens;
  p.biases = biases;
}

void RequestSampler::ConstrainNext(std::vector<uint64_t> mask) {
  constrained_mask_ = std::move(mask);
}

kernels::LogitPenalties RequestSampler::Penalties(const TokenHistory& history) const {
  kernels::LogitPenalties p{params_.repetition_penalty,
                            params_.frequency_penalty,
                            params_.presence_penalty,
                            history.seen(),
                            history.counts(),
                            {},
                            {},
                            {},
                            {},
                            allowed_};
  if (constrained_) {
    // An empty mask would mean "no restriction": a grammar that has not given one yet bans
    // every token instead (the draw then reports that nothing could be drawn).
    static const uint64_t kNoToken[] = {0};
    p.allowed_mask = constrained_mask_.empty() ? std::span<const uint64_t>(kNoToken)
                                               : std::span<const uint64_t>(constrained_mask_);
  }
  SetBiases(history.output(), {}, row_bias_tokens_, row_biases_, p);
  return p;
}

std::vector<kernels::LogitPenalties> RequestSampler::VerifyPenalties(
    const TokenHistory& history, std::span<const int32_t> drafts, VerifyPenaltyLists& lists) const {
  const size_t k = drafts.size();
  const kernels::LogitPenalties base = Penalties(history);
  std::vector<kernels::LogitPenalties> rows(
      k + 1, kernels::LogitPenalties{
                 base.repetition, base.frequency, base.presence, {}, {}, {}, {}, {}, {}, allowed_});
  // Row j follows drafts[0, j): its output is j tokens longer (min_tokens, bad_words).
  lists.row_bias_tokens.assign(k + 1, {});
  lists.row_biases.assign(k + 1, {});
  for (size_t j = 0; j <= k; ++j) {
    SetBiases(history.output(), drafts.first(j), lists.row_bias_tokens[j], lists.row_biases[j],
              rows[j]);
  }
  lists.shared_tokens.clear();
  lists.shared_counts.clear();
  lists.row_tokens.assign(k + 1, {});
  lists.row_counts.assign(k + 1, {});
  if (base.repetition == 1.0f && base.frequency == 0.0f && base.presence == 0.0f) return rows;
  // The drafted tokens (distinct, at most k): every row lists them itself, with their counts as
  // of that row; the shared list holds the rest of the history.
  std::vector<int32_t> drafted;
  for (int32_t x : drafts) {
    if (x >= 0 && std::find(drafted.begin(), drafted.end(), x) == drafted.end()) {
      drafted.push_back(x);
    }
  }
  const std::vector<int32_t>& seen = history.seen();
  const std::vector<int32_t>& counts = history.counts();
  for (size_t i = 0; i < seen.size(); ++i) {
    if (std::find(drafted.begin(), drafted.end(), seen[i]) != drafted.end()) continue;
    lists.shared_tokens.push_back(seen[i]);
    lists.shared_counts.push_back(counts[i]);
  }
  std::vector<uint8_t> drafted_seen;  // seen before the step (prompt or output)
  for (int32_t x : drafted)
    drafted_seen.push_back(history.InPrompt(x) || history.OutputCount(x) > 0);
  for (size_t j = 0; j <= k; ++j) {
    for (size_t d = 0; d < drafted.size(); ++d) {
      // As TokenHistory::AddOutput for drafts[0, j): a token is listed once seen or drafted.
      const int32_t x = drafted[d];
      const int in_drafts = static_cast<int>(std::count(drafts.begin(), drafts.begin() + j, x));
      if (in_drafts == 0 && !drafted_seen[d]) continue;
      lists.row_tokens[j].push_back(x);
      lists.row_counts[j].push_back(history.OutputCount(x) + in_drafts);
    }
  }
  for (size_t j = 0; j <= k; ++j) {
    rows[j].tokens = lists.row_tokens[j];
    rows[j].counts = lists.row_counts[j];
    rows[j].shared_tokens = lists.shared_tokens;
    rows[j].shared_counts = lists.shared_counts;
  }
  return rows;
}

void RequestSampler::ApplyPenalties(std::span<float> logits, const TokenHistory& history) const {
  kernels::ApplyLogitPenalties(logits, Penalties(history));
}

double RequestSampler::NextUniform() {
  return params_.temperature > 0 ? std::uniform_real_distribution<double>(0.0, 1.0)(rng_) : 0.0;
}

SampledToken RequestSampler::Sample(std::span<float> logits, const TokenHistory& history) {
  const int vocab = static_cast<int>(logits.size());
  ApplyPenalties(logits, history);
  const kernels::DrawnToken drawn = kernels::DrawToken(logits, Rule(), NextUniform());
  SampledToken result{drawn.token, drawn.logprob, {}};
  if (params_.logprobs > 0 && vocab > 0) {
    const int n = std::min(params_.logprobs, vocab);
    std::vector<kernels::TokenLogit> top(static_cast<size_t>(n));
    kernels::TopLogits(logits, n, top);
    result.top = TopLogprobs(drawn, logits[drawn.token], top);
  }
  return result;
}

std::vector<TokenLogprob> RequestSampler::TopLogprobs(
    const kernels::DrawnToken& drawn, float drawn_logit,
    std::span<const kernels::TokenLogit> top) const {
  const float temperature = params_.temperature > 0 ? params_.temperature : 1.0f;
  std::vector<TokenLogprob> out;
  out.reserve(top.size());
  for (const kernels::TokenLogit& t : top) {
    if (t.token < 0) break;  // the row had fewer rankable logits
    out.push_back({t.token, drawn.logprob + (t.logit - drawn_logit) / temperature});
  }
  return out;
}

std::vector<double> RequestSampler::Distribution(std::span<float> logits,
                                                 const TokenHistory& history) const {
  std::vector<double> dist;
  Distribution(logits, history, dist);
  return dist;
}

void RequestSampler::Distribution(std::span<float> logits, const TokenHistory& history,
                                  std::vector<double>& dist) const {
  ApplyPenalties(logits, history);
  kernels::RuleDistribution(logits, Rule(), dist);
}

}  // namespace mobius::worker
