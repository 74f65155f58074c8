// The acceptance rule of speculative decoding (issue 6): keeps the output distribution exactly
// the target's whatever the drafts (Leviathan et al. 2023; Chen et al. 2023). Draft i, drawn from
// the draft distribution q_i, is accepted with probability min(1, p_i(x) / q_i(x)); at the first
// rejection the step emits a token drawn from the residual max(0, p_i - q_i) (normalised) and
// stops; when every draft is accepted it emits a bonus token drawn from p_k. With one-hot p and q
// (greedy requests and a greedy draft) this is "longest matching prefix plus the target's
// token". p comes from RequestSampler::Distribution, so penalties, temperature and top-k/top-p/
// min-p are honoured.
#ifndef MOBIUS_WORKER_RUNTIME_SPECULATIVE_SAMPLING_H_
#define MOBIUS_WORKER_RUNTIME_SPECULATIVE_SAMPLING_H_

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "worker/runtime/sampler.h"

namespace mobius::worker {

struct DraftVerdict {
  int accepted = 0;  // leading drafts kept
  int32_t next = 0;  // then this token: the residual draw after a rejection, or the bonus token
};

// drafts: k tokens; q: their k draft distributions; p: k + 1 target distributions (p[i] at the
// position of draft i, p[k] after the last draft), each over the same vocabulary.
DraftVerdict VerifyDrafts(std::span<const int32_t> drafts, std::span<const std::vector<double>> q,
                          std::span<const std::vector<double>> p, std::mt19937_64& rng);

// VerifyDrafts for deterministic drafts (q one-hot at each draft) against one request's sampler:
// `rows` holds the target's logits at the pending token and at each draft, (k + 1) x vocab
// (modified in place, as Sample does). p at position j sees drafts 0..j-1 as part of `history`,
// so penalties count them. Draws from the sampler's own random stream.
DraftVerdict VerifyDraftsWithSampler(std::span<const int32_t> drafts, std::span<float> rows,
                                     RequestSampler& sampler, const TokenHistory& history);

// The uniform draws a verify of k drafts against a sampler may use, in the order
// VerifyDraftsWithSampler takes them from the request's stream: k + 1 from a copy of `rng` (the
// stream itself does not move). The acceptance of draft j uses [j], the residual draw after a
// rejection at j [j + 1], the draw after k accepted drafts [k]. So every row's draw can be made
// at once (on a device) and the stream stays as a row-by-row verify leaves it
// (ConsumeVerifyUniforms).
std::vector<double> PeekVerifyUniforms(const std::mt19937_64& rng, size_t k);

// The uniform a verify row's draw takes (kernels::CheckDraft): [j + 1] for draft j, [k] for the
// row after the last draft.
inline double VerifyRowUniform(std::span<const double> uniforms, size_t j, size_t k) {
  return uniforms[j < k ? j + 1 : k];
}

// The verdict from every row's check (kernels::CheckDraft of row j with draft j and
// VerifyRowUniform; the row after the last draft with kernels::kNoDraft), and the uniforms of
// PeekVerifyUniforms: what VerifyDraftsWithSampler decides from the same rows.
DraftVerdict VerdictFromChecks(std::span<const int32_t> drafts, std::span<const double> uniforms,
                               std::span<const kernels::DrawnToken> checks);

// Advances `rng` past the uniforms a verify of k drafts used for `verdict`: accepted + 2 after a
// rejection, k + 1 when every draft was accepted.
void ConsumeVerifyUniforms(std::mt19937_64& rng, const DraftVerdict& verdict, size_t k);

// VerifyDraftsWithSampler for a greedy request (RequestSampler::ArgmaxOnly) from the argmax of
// each of its k + 1 logits rows alone (taken on the device): with one-hot p and q the rule is the
// longest prefix of drafts that match the argmaxes, then the argmax after it. Draws nothing.
DraftVerdict VerifyGreedyDrafts(std::span<const int32_t> drafts,
                                std::span<const int32_t> row_argmax);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_SPECULATIVE_SAMPLING_H_
