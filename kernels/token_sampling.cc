#include "kernels/token_sampling.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace mobius::kernels {
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

}  // namespace

std::vector<float>& ThreadLocalWeights() {
  thread_local std::vector<float> weights;
  return weights;
}

double Exponentiate(std::span<const float> logits, float max_logit, float temperature,
                    std::vector<float>& weights) {
  weights.resize(logits.size());
  const size_t n = logits.size();
  const float* in = logits.data();
  float* out = weights.data();
  for (size_t t = 0; t < n; ++t) out[t] = ExpNonPositive((in[t] - max_logit) / temperature);
  double sum = 0;  // in its own loop: the one above vectorises, a double reduction would not
  for (size_t t = 0; t < n; ++t) sum += out[t];
  return sum;
}
KeptCandidates TruncateCandidates(std::span<const float> logits, const SamplingRule& rule,
                                  float max_logit, std::span<const float> weights, double sum) {
  const int vocab = static_cast<int>(logits.size());
  const float temperature = rule.temperature;  // > 0: greedy rows never get here
  const double inv_sum = 1.0 / sum;
  auto prob = [&](int32_t t) { return weights[t] * inv_sum; };
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  KeptCandidates c;
  const bool top_k = rule.top_k > 0 && rule.top_k < vocab;
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
      if (seen >= rule.top_k) {
        last = b;
        break;
      }
    }
    for (int t = 0; t < vocab; ++t) {
      if (bin_of(logits[t]) <= last) c.order.push_back(t);
    }
    std::nth_element(c.order.begin(), c.order.begin() + rule.top_k, c.order.end(), by_logit);
    c.order.resize(rule.top_k);
  } else {
    // min-p keeps only logits >= max + T ln(min_p) (the top token's probability times min_p).
    const float floor_logit = rule.min_p > 0.0f ? max_logit + temperature * std::log(rule.min_p)
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
      if (cumulative >= rule.top_p * mass_all * (1 + 1e-9)) {
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
    if (n > 0 && c.p[n] < rule.min_p * p_max) break;
    cumulative += c.p[n];
    if (cumulative >= rule.top_p * total) {
      ++n;
      break;
    }
  }
  c.kept = std::max<size_t>(n, 1);
  return c;
}

DrawnToken DrawToken(std::span<const float> logits, const SamplingRule& rule, double u) {
  DrawnToken result;
  const int vocab = static_cast<int>(logits.size());
  if (vocab == 0) return result;
  // Log-softmax at the rule's temperature (1 for greedy): what the logprob reports.
  const float temperature = rule.temperature > 0 ? rule.temperature : 1.0f;
  const auto max_it = std::max_element(logits.begin(), logits.end());
  const float max_logit = *max_it;
  std::vector<float>& weights = ThreadLocalWeights();
  const double sum = Exponentiate(logits, max_logit, temperature, weights);
  if (rule.temperature == 0) {
    result.token = static_cast<int32_t>(max_it - logits.begin());
  } else if (!rule.Truncates(vocab)) {
    // Every token can be drawn: walk the weights in id order, no candidate list (sorting 248K
    // logits took 24 ms a row; building the list took 0.3 ms of the 1.45 ms left).
    result.token = static_cast<int32_t>(
        DrawIndexAt(std::span<const float>(weights.data(), weights.size()), u * sum));
  } else {
    const KeptCandidates c = TruncateCandidates(logits, rule, max_logit, weights, sum);
    double kept = 0;
    for (size_t i = 0; i < c.kept; ++i) kept += c.p[i];
    result.token = c.order[DrawIndexAt(std::span<const double>(c.p.data(), c.kept), u * kept)];
  }
  result.logprob =
      (logits[result.token] - max_logit) / temperature - static_cast<float>(std::log(sum));
  return result;
}

void TopLogits(std::span<const float> logits, int n, std::span<TokenLogit> out) {
  const size_t count = std::min(static_cast<size_t>(std::max(n, 0)), out.size());
  if (count == 0) return;
  // A bounded selection: the best `count` seen so far, kept sorted (count is at most ~20).
  auto better = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::vector<int32_t> best;
  best.reserve(count + 1);
  for (size_t t = 0; t < logits.size(); ++t) {
    const auto id = static_cast<int32_t>(t);
    if (std::isnan(logits[t])) continue;
    if (best.size() == count && !better(id, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), id, better), id);
    if (best.size() > count) best.pop_back();
  }
  for (size_t i = 0; i < count; ++i) {
    out[i] = i < best.size() ? TokenLogit{best[i], logits[best[i]]} : TokenLogit{-1, 0.0f};
  }
}

void ApplyLogitPenalties(std::span<float> logits, const LogitPenalties& p) {
  if (!p.Active()) return;
  const size_t vocab = logits.size();
  auto apply = [&](std::span<const int32_t> tokens, std::span<const int32_t> counts) {
    for (size_t i = 0; i < tokens.size() && i < counts.size(); ++i) {
      const int32_t t = tokens[i];
      if (t < 0 || static_cast<size_t>(t) >= vocab) continue;
      logits[t] = PenalizedLogit(logits[t], counts[i], p.repetition, p.frequency, p.presence);
    }
  };
  if (p.repetition != 1.0f || p.frequency != 0.0f || p.presence != 0.0f) {
    apply(p.tokens, p.counts);
    apply(p.shared_tokens, p.shared_counts);
  }
  for (size_t i = 0; i < p.bias_tokens.size() && i < p.biases.size(); ++i) {
    const int32_t t = p.bias_tokens[i];
    if (t < 0 || static_cast<size_t>(t) >= vocab) continue;
    // A ban is a ban whatever the logit was (a NaN logit plus -infinity stays NaN).
    if (p.biases[i] == -std::numeric_limits<float>::infinity()) {
      logits[t] = p.biases[i];
    } else {
      logits[t] += p.biases[i];
    }
  }
  if (!p.allowed_tokens.empty()) {
    std::vector<float> kept;
    kept.reserve(p.allowed_tokens.size());
    for (int32_t t : p.allowed_tokens) {
      kept.push_back(t >= 0 && static_cast<size_t>(t) < vocab ? logits[t] : 0.0f);
    }
    std::fill(logits.begin(), logits.end(), -std::numeric_limits<float>::infinity());
    for (size_t i = 0; i < kept.size(); ++i) {
      const int32_t t = p.allowed_tokens[i];
      if (t >= 0 && static_cast<size_t>(t) < vocab) logits[t] = kept[i];
    }
  }
  if (!p.allowed_mask.empty()) {
    // Word by word, visiting only the tokens the mask leaves out (a word that allows none is
    // filled at once: outside a string a grammar allows a few hundred tokens).
    for (size_t w = 0; w * 64 < vocab; ++w) {
      uint64_t missing = w < p.allowed_mask.size() ? ~p.allowed_mask[w] : ~uint64_t{0};
      if (vocab - w * 64 < 64) {
        missing &= (uint64_t{1} << (vocab - w * 64)) - 1;
      } else if (missing == ~uint64_t{0}) {
        std::fill_n(logits.begin() + static_cast<std::ptrdiff_t>(w * 64), 64,
                    -std::numeric_limits<float>::infinity());
        continue;
      }
      for (; missing != 0; missing &= missing - 1) {
        logits[w * 64 + static_cast<size_t>(__builtin_ctzll(missing))] =
            -std::numeric_limits<float>::infinity();
      }
    }
  }
}

void RuleDistribution(std::span<const float> logits, const SamplingRule& rule,
                      std::vector<double>& dist) {
  const int vocab = static_cast<int>(logits.size());
  dist.assign(vocab, 0.0);
  if (vocab == 0) return;
  const auto max_it = std::max_element(logits.begin(), logits.end());
  if (rule.temperature == 0) {
    dist[max_it - logits.begin()] = 1.0;
    return;
  }
  std::vector<float>& weights = ThreadLocalWeights();
  const double sum = Exponentiate(logits, *max_it, rule.temperature, weights);
  if (!rule.Truncates(vocab)) {
    for (int t = 0; t < vocab; ++t) dist[t] = weights[t] / sum;
    return;
  }
  const KeptCandidates c = TruncateCandidates(logits, rule, *max_it, weights, sum);
  double kept = 0;
  for (size_t i = 0; i < c.kept; ++i) kept += c.p[i];
  for (size_t i = 0; i < c.kept; ++i) dist[c.order[i]] = c.p[i] / kept;
}

int32_t DrawWithoutDraft(std::vector<double>& dist, int32_t draft, double u) {
  const bool in_row = draft >= 0 && static_cast<size_t>(draft) < dist.size();
  const double p_draft = in_row ? dist[draft] : 0.0;
  if (in_row) dist[draft] = 0.0;
  double total = 0;  // in id order, as the walk
  for (double p : dist) total += p;
  if (!(total > 0) && in_row) {
    dist[draft] = p_draft;
    total = p_draft;
  }
  return static_cast<int32_t>(DrawIndexAt(std::span<const double>(dist), u * total));
}

DrawnToken CheckDraft(std::span<const float> logits, const SamplingRule& rule, int32_t draft,
                      double u) {
  thread_local std::vector<double> dist;
  RuleDistribution(logits, rule, dist);
  DrawnToken result;
  const bool in_row = draft >= 0 && static_cast<size_t>(draft) < dist.size();
  result.draft_probability = in_row ? dist[draft] : 0.0;
  result.token = DrawWithoutDraft(dist, draft, u);  // (an empty row: token 0)
  return result;
}

}  // namespace mobius::kernels
