#include "worker/runtime/prompt_scoring.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/token_sampling.h"

namespace mobius::worker {

SampledToken ScorePromptToken(std::span<const float> logits, int32_t next, int top_n) {
  // The log-sum-exp in double: a 248K-entry sum in float loses the small terms.
  float max = -std::numeric_limits<float>::infinity();
  for (float x : logits) max = std::max(max, x);
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  const double log_total = max + std::log(sum);
  auto logprob = [&](float x) { return static_cast<float>(x - log_total); };

  SampledToken scored;
  scored.token = next;
  const float own = logits[static_cast<size_t>(next)];
  scored.logprob = logprob(own);
  scored.rank = static_cast<int32_t>(
      std::count_if(logits.begin(), logits.end(), [own](float x) { return x >= own; }));
  const int n = std::min<int>(top_n, static_cast<int>(logits.size()));
  if (n > 0) {
    std::vector<kernels::TokenLogit> top(static_cast<size_t>(n));
    kernels::TopLogits(logits, n, top);
    for (const kernels::TokenLogit& t : top) {
      if (t.token < 0) break;
      scored.top.push_back({t.token, logprob(t.logit)});
    }
  }
  return scored;
}

}  // namespace mobius::worker
