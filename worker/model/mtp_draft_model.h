// The MTP draft head (MODEL.md section 6) as a model of its own: one full-attention decoder layer
// with its own MoE, fed fc([RMSNorm1p_e(embed(token)); RMSNorm1p_h(h_prev)]), ending in its own
// norm and the target's lm_head. It reuses HybridModel (a one-layer config whose only bank is the
// head's MoE), so it runs on every backend and keeps its own paged KV cache; the embedding and
// lm_head tensors are shared with the target, not copied (unless a draft vocabulary narrows the
// lm_head, below).
#ifndef MOBIUS_WORKER_MODEL_MTP_DRAFT_MODEL_H_
#define MOBIUS_WORKER_MODEL_MTP_DRAFT_MODEL_H_

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "worker/model/hybrid_model.h"

namespace mobius::worker {

// The draft model's configuration: `target` reduced to the head's single full-attention layer
// and its MoE (mtp_num_experts, mtp_num_experts_per_tok, one bank).
ModelConfig MtpDraftConfig(const ModelConfig& target);

// FailedPrecondition when the target was loaded without `mtp.*` tensors. The head is never
// sharded: on a replica of several ranks the leader runs it alone (its tensors, the embedding
// and lm_head are whole on every rank). Call with each Forward the draft model's
// `ForwardOptions::draft_hidden_in`.
//
// With `draft_vocabulary` (ascending, distinct ids of the target's vocabulary; empty: all of
// it) the head's lm_head is a copy of just those rows, gathered once here, and its logits row r
// is the score of token draft_vocabulary[r] (see runtime/draft_vocabulary.h). Token inputs are
// still ids of the whole vocabulary. InvalidArgument for ids out of range or out of order.
absl::StatusOr<std::unique_ptr<HybridModel>> MakeMtpDraftModel(
    const HybridModel& target, std::span<const int32_t> draft_vocabulary = {});

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_MTP_DRAFT_MODEL_H_
