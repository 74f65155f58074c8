#include "worker/runtime/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

namespace mobius::worker {
namespace {

// exp(x) for x <= 0 in float (within 2 ulp of std::exp), 0 below -87 and for NaN (a masked
// logit), written without calls or branches so that the loop over a row vectorises: the
// library's expf is a call per element, and 248K of them were most of a sampled row's time.
// x = n ln 2 + r with |r| <= ln 2 / 2; e^r by Cephes' expf polynomial; 2^n through the exponent
// bits (n >= -126 above the cut: a normal float).
inline float ExpNonPositive(float x) {
  // Selections by bit masks, not branches: the compiler will not turn float selects into vector
  // blends while float operations may trap.
  const uint32_t keep = 0u - static_cast<uint32_t>(x >= -87.0f);  // all ones, or 0 (also NaN)
  x = std::bit_cast<float>((std::bit_cast<uint32_t>(x) & keep) |
                           (std::bit_cast<uint32_t>(-87.0f) & ~keep));
  const int n = static_cast<int>(x * 1.44269504088896341f - 0.5f);  // round: x <= 0
  const float fn = static_cast<float>(n);
  const float r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>(static_cast<uint32_t>(n + 127) << 23);
  return std::bit_cast<float>(std::bit_cast<uint32_t>(e * scale) & keep);
}

// A row's weights (RequestSampler::Exponentiate), one buffer per thread: a vocabulary-sized
// vector per sequence would hold 1 MB for each of hundreds of sequences.
std::vector<float>& WeightsScratch() {
  thread_local std::vector<float> weights;
  return weights;
}

}  // namespace

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

double RequestSampler::Exponentiate(std::span<const float> logits, float max_logit,
                                    float temperature, std::vector<float>& weights) {
  weights.resize(logits.size());
  const size_t n = logits.size();
  const float* in = logits.data();
  float* out = weights.data();
  for (size_t t = 0; t < n; ++t) out[t] = ExpNonPositive((in[t] - max_logit) / temperature);
  double sum = 0;  // in its own loop: the one above vectorises, a double reduction would not
  for (size_t t = 0; t < n; ++t) sum += out[t];
  return sum;
}

RequestSampler::Candidates RequestSampler::Truncate(std::span<const float> logits, float max_logit,
                                                    std::span<const float> weights,
                                                    double sum) const {
  const int vocab = static_cast<int>(logits.size());
  const float temperature = params_.temperature;  // > 0: greedy rows never get here
  const double inv_sum = 1.0 / sum;
  auto prob = [&](int32_t t) { return weights[t] * inv_sum; };
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  Candidates c;
  const bool top_k = params_.top_k > 0 && params_.top_k < vocab;
  double mass_all = 0;  // every token's probability mass (top-p's reference without top-k)
  // Candidates that the rule below could keep, then sorted by probability (logit; ties: lower id
  // first). Top-k: its k largest. Otherwise the smallest set of the largest logits that surely
  // holds the nucleus: tokens are binned by logit from the top (kBins bins over kSpan temperatures
  // below the maximum, the rest in one last bin) and bins are taken until their mass reaches
  // top_p of the total; with min-p, tokens below min_p of the top probability never count.
  constexpr int kBins = 1024;
  constexpr float kSpan = 40.0f;  // e^-40 of the top probability and below: the last bin
  const float width = kSpan * temperature / kBins;
  auto bin_of = [&](float x) {
    const float d = (max_logit - x) / width;
    return d < static_cast<float>(kBins) ? static_cast<int>(d) : kBins;
  };
  if (top_k) {
    // The k largest lie in the top bins whose counts reach k (bins follow the logit): only those
    // tokens go through nth_element.
    std::vector<int32_t> count(kBins + 1, 0);
    for (int t = 0; t < vocab; ++t) ++count[bin_of(logits[t])];
    int last = kBins;
    for (int b = 0, seen = 0; b < kBins; ++b) {
      seen += count[b];
      if (seen >= params_.top_k) {
        last = b;
        break;
      }
    }
    for (int t = 0; t < vocab; ++t) {
      if (bin_of(logits[t]) <= last) c.order.push_back(t);
    }
    std::nth_element(c.order.begin(), c.order.begin() + params_.top_k, c.order.end(), by_logit);
    c.order.resize(params_.top_k);
  } else {
    // min-p keeps only logits >= max + T ln(min_p) (the top token's probability times min_p).
    const float floor_logit = params_.min_p > 0.0f
                                  ? max_logit + temperature * std::log(params_.min_p)
                                  : -std::numeric_limits<float>::infinity();
    std::vector<double> mass(kBins + 1, 0.0);
    for (int t = 0; t < vocab; ++t) {
      const double p = prob(t);
      mass_all += p;
      mass[bin_of(logits[t])] += p;
    }
    // Bins up to the one where the mass reaches top_p of the total; a margin of one bin covers
    // the difference between this sum and the rule's sum in sorted order.
    int last = kBins;
    double cumulative = 0;
    for (int b = 0; b < kBins; ++b) {
      cumulative += mass[b];
      if (cumulative >= params_.top_p * mass_all * (1 + 1e-9)) {
        last = std::min(b + 1, kBins);
        break;
      }
    }
    // (The rule below decides min-p exactly; the filter only leaves out what it surely drops.)
    const float floor_kept = floor_logit - 1e-3f * temperature;
    for (int t = 0; t < vocab; ++t) {
      if (bin_of(logits[t]) <= last && logits[t] >= floor_kept) c.order.push_back(t);
    }
    if (c.order.empty()) {
      c.order.push_back(
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    }
  }
  std::sort(c.order.begin(), c.order.end(), by_logit);
  c.p.resize(c.order.size());
  double total = 0;
  for (size_t i = 0; i < c.order.size(); ++i) {
    c.p[i] = prob(c.order[i]);
    total += c.p[i];
  }
  if (!top_k) total = mass_all;  // top_p is a share of every token's mass, not the candidates'.
  const double p_max = c.p[0];
  double cumulative = 0;
  size_t n = 0;
  for (; n < c.order.size(); ++n) {
    if (n > 0 && c.p[n] < params_.min_p * p_max) break;
    cumulative += c.p[n];
    if (cumulative >= params_.top_p * total) {
      ++n;
      break;
    }
  }
  c.kept = std::max<size_t>(n, 1);
  return c;
}

SampledToken RequestSampler::Sample(std::span<float> logits, const TokenHistory& history) {
  const int vocab = static_cast<int>(logits.size());
  ApplyPenalties(logits, history);

  // Log-softmax at the request's temperature (1 for greedy): what logprobs report.
  const float temperature = params_.temperature > 0 ? params_.temperature : 1.0f;
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<float>& weights = WeightsScratch();
  const double sum = Exponentiate(logits, max_logit, temperature, weights);
  const float log_z = static_cast<float>(std::log(sum));
  auto logprob = [&](int32_t t) { return (logits[t] - max_logit) / temperature - log_z; };

  SampledToken result;
  if (params_.temperature == 0) {
    result.token =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  } else if (!Truncates(vocab)) {
    // Every token can be drawn: walk the weights in id order, no candidate list (sorting 248K
    // logits took 24 ms a row; building the list took 0.3 ms of the 1.45 ms left).
    result.token = static_cast<int32_t>(
        DrawIndex(std::span<const float>(weights.data(), weights.size()), sum, rng_));
  } else {
    const Candidates c = Truncate(logits, max_logit, weights, sum);
    double kept = 0;
    for (size_t i = 0; i < c.kept; ++i) kept += c.p[i];
    result.token = c.order[DrawIndex(std::span<const double>(c.p.data(), c.kept), kept, rng_)];
  }
  result.logprob = logprob(result.token);
  if (params_.logprobs > 0) {
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
  const int vocab = static_cast<int>(logits.size());
  std::vector<double> dist(vocab, 0.0);
  if (vocab == 0) return dist;
  ApplyPenalties(logits, history);
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  if (params_.temperature == 0) {
    dist[std::max_element(logits.begin(), logits.end()) - logits.begin()] = 1.0;
    return dist;
  }
  const float temperature = params_.temperature;
  std::vector<float>& weights = WeightsScratch();
  const double sum = Exponentiate(logits, max_logit, temperature, weights);
  if (!Truncates(vocab)) {
    for (int t = 0; t < vocab; ++t) dist[t] = weights[t] / sum;
    return dist;
  }
  const Candidates c = Truncate(logits, max_logit, weights, sum);
  double kept = 0;
  for (size_t i = 0; i < c.kept; ++i) kept += c.p[i];
  for (size_t i = 0; i < c.kept; ++i) dist[c.order[i]] = c.p[i] / kept;
  return dist;
}

}  // namespace mobius::worker
