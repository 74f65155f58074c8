#include "worker/runtime/sampler.h"

#include <algorithm>
#include <cstdint>
#include <numeric>

namespace mobius::worker {

void TokenHistory::Touch(int32_t token) {
  if (token < 0) return;
  if (static_cast<size_t>(token) >= in_prompt_.size()) {
    in_prompt_.resize(token + 1, 0);
    output_count_.resize(token + 1, 0);
  }
  if (!in_prompt_[token] && output_count_[token] == 0) seen_.push_back(token);
}

void TokenHistory::AddPrompt(std::span<const int32_t> tokens) {
  for (int32_t t : tokens) {
    if (t < 0) continue;
    Touch(t);
    in_prompt_[t] = 1;
  }
}

void TokenHistory::AddOutput(int32_t token) {
  if (token < 0) return;
  Touch(token);
  ++output_count_[token];
}

bool TokenHistory::InPrompt(int32_t token) const {
  return token >= 0 && static_cast<size_t>(token) < in_prompt_.size() && in_prompt_[token];
}

int TokenHistory::OutputCount(int32_t token) const {
  return token >= 0 && static_cast<size_t>(token) < output_count_.size() ? output_count_[token] : 0;
}

RequestSampler::RequestSampler(const SamplingParams& params, uint64_t fallback_seed)
    : params_(params), rng_(params.seed.value_or(fallback_seed)) {}

void RequestSampler::ApplyPenalties(std::span<float> logits, const TokenHistory& history) const {
  const int vocab = static_cast<int>(logits.size());
  // Penalties touch only the tokens the sequence has seen.
  for (int32_t t : history.seen()) {
    if (t >= vocab) continue;
    float& x = logits[t];
    const int count = history.OutputCount(t);
    if (params_.repetition_penalty != 1.0f) {
      x = x > 0 ? x / params_.repetition_penalty : x * params_.repetition_penalty;
    }
    x -= params_.frequency_penalty * count + params_.presence_penalty * (count > 0 ? 1 : 0);
  }
}

std::optional<kernels::SamplingRule> RequestSampler::DeviceRule() const {
  const bool penalties = params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f ||
                         params_.frequency_penalty != 0.0f;
  if (penalties || params_.logprobs > 0) return std::nullopt;
  return Rule();
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
    // The log-softmax of every token differs from the drawn token's by their logits' difference.
    const float temperature = params_.temperature > 0 ? params_.temperature : 1.0f;
    const float drawn_logit = logits[drawn.token];
    auto logprob = [&](int32_t t) {
      return drawn.logprob + (logits[t] - drawn_logit) / temperature;
    };
    std::vector<int32_t> top(vocab);
    std::iota(top.begin(), top.end(), 0);
    const int n = std::min(params_.logprobs, vocab);
    std::partial_sort(top.begin(), top.begin() + n, top.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int i = 0; i < n; ++i) result.top.push_back({top[i], logprob(top[i])});
  }
  return result;
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
