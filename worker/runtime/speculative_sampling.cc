#include "worker/runtime/speculative_sampling.h"

#include <algorithm>

namespace mobius::worker {
namespace {

// A draw from the (unnormalised, non-negative) weights w (DrawIndex).
int32_t Draw(const std::vector<double>& w, std::mt19937_64& rng) {
  double total = 0;
  for (double x : w) total += x;
  return static_cast<int32_t>(DrawIndex(std::span<const double>(w), total, rng));
}

}  // namespace

DraftVerdict VerifyDrafts(std::span<const int32_t> drafts, std::span<const std::vector<double>> q,
                          std::span<const std::vector<double>> p, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  DraftVerdict verdict;
  for (size_t i = 0; i < drafts.size(); ++i) {
    const int32_t x = drafts[i];
    const double px = p[i][x], qx = q[i][x];
    const double ratio = qx > 0 ? px / qx : (px > 0 ? 1.0 : 0.0);
    if (uniform(rng) < ratio) {
      ++verdict.accepted;
      continue;
    }
    std::vector<double> residual(p[i].size());
    bool any = false;
    for (size_t y = 0; y < residual.size(); ++y) {
      residual[y] = std::max(0.0, p[i][y] - q[i][y]);
      any |= residual[y] > 0;
    }
    // p == q leaves no residual, but then a rejection has probability 0; draw from p to be safe.
    verdict.next = Draw(any ? residual : p[i], rng);
    return verdict;
  }
  verdict.next = Draw(p[drafts.size()], rng);
  return verdict;
}

std::vector<double> PeekVerifyUniforms(const std::mt19937_64& rng, size_t k) {
  std::mt19937_64 copy = rng;
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<double> u(k + 1);
  for (double& x : u) x = uniform(copy);
  return u;
}

void ConsumeVerifyUniforms(std::mt19937_64& rng, const DraftVerdict& verdict, size_t k) {
  const size_t accepted = static_cast<size_t>(verdict.accepted);
  const size_t used = accepted < k ? accepted + 2 : k + 1;
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (size_t i = 0; i < used; ++i) uniform(rng);
}

DraftVerdict VerdictFromChecks(std::span<const int32_t> drafts, std::span<const double> uniforms,
                               std::span<const kernels::DrawnToken> checks) {
  DraftVerdict verdict;
  const size_t k = drafts.size();
  // min(1, p(x) / q(x)) with q(x) = 1.
  while (static_cast<size_t>(verdict.accepted) < k &&
         uniforms[verdict.accepted] < checks[verdict.accepted].draft_probability) {
    ++verdict.accepted;
  }
  verdict.next = checks[verdict.accepted].token;
  return verdict;
}

DraftVerdict VerifyDraftsWithSampler(std::span<const int32_t> drafts, std::span<float> rows,
                                     RequestSampler& sampler, const TokenHistory& history) {
  // VerifyDrafts with q one-hot at each draft, p computed row by row only as far as the first
  // rejection, in one reused buffer: the same draws from the same stream in the same order. (A
  // fresh vocabulary-sized vector for each p and q cost ~100 ms a verify at 248K tokens, almost
  // all of it page faults.) The uniforms are peeked and consumed as a device verify takes them
  // (VerdictFromChecks), which is the order the stream gives them in.
  const size_t k = drafts.size(), vocab = rows.size() / (k + 1);
  thread_local std::vector<double> p;
  const std::vector<double> u = PeekVerifyUniforms(sampler.rng(), k);
  TokenHistory seen = history;
  DraftVerdict verdict;
  for (size_t j = 0;; ++j) {
    sampler.Distribution(rows.subspan(j * vocab, vocab), seen, p);
    const int32_t x = j < k ? drafts[j] : kernels::kNoDraft;
    const bool in_vocab = x >= 0 && static_cast<size_t>(x) < vocab;
    if (j < k && u[j] < (in_vocab ? p[x] : 0.0)) {
      ++verdict.accepted;
      seen.AddOutput(x);
      continue;
    }
    verdict.next = kernels::DrawWithoutDraft(p, x, VerifyRowUniform(u, j, k));
    break;
  }
  ConsumeVerifyUniforms(sampler.rng(), verdict, k);
  return verdict;
}

DraftVerdict VerifyGreedyDrafts(std::span<const int32_t> drafts,
                                std::span<const int32_t> row_argmax) {
  DraftVerdict verdict;
  while (static_cast<size_t>(verdict.accepted) < drafts.size() &&
         drafts[verdict.accepted] == row_argmax[verdict.accepted]) {
    ++verdict.accepted;
  }
  verdict.next = row_argmax[verdict.accepted];
  return verdict;
}

}  // namespace mobius::worker
