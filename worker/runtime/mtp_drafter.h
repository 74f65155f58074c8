// Drafts with the model's MTP head (MODEL.md section 6): the head's KV cache entry for position p
// pairs the token at p + 1 with the target's post-norm hidden state at p. Observe writes the
// entries of every committed position (the whole prompt after the prefill, the accepted tokens
// after each verify step) in one head forward over the batch, whose last row per sequence gives
// the first draft; Draft chains the head on its own post-norm output for the further drafts and
// then rolls its cache back to the committed positions (the head has no DeltaNet state, so
// resetting num_tokens is the whole rollback). Drafts are the head's argmax (over the draft
// vocabulary, when one is given). A sequence the head has not seen from its first position gets
// no drafts (it decodes plainly): drafts only ever cost or save time, so the drafter degrades
// instead of failing the step.
#ifndef MOBIUS_WORKER_RUNTIME_MTP_DRAFTER_H_
#define MOBIUS_WORKER_RUNTIME_MTP_DRAFTER_H_

#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/hybrid_model.h"
#include "worker/runtime/draft_vocabulary.h"
#include "worker/runtime/speculative_decoder.h"

namespace mobius::worker {

// Records the one-token draft steps of `head` (made by MakeMtpDraftModel(target)) as CUDA graphs
// up to the target's recorded batch size (--cuda-graph-max-batch; 0 records nothing), as the
// target records its decode steps, unless MOBIUS_MTP_HEAD_GRAPHS=0 or the target is a shard of a
// replica. MtpDrafter::Create applies it; so does `mobius bench engine`, so that its head-step
// time is the drafter's.
void ApplyMtpHeadCapture(const HybridModel& target, HybridModel& head);

class MtpDrafter : public Drafter {
 public:
  // The head of `target` with caches for `max_sequences` sequences of `max_tokens` positions
  // (prompt + output + the drafts of one step), drafting among the tokens of `vocabulary`
  // (default: all of them).
  static absl::StatusOr<std::unique_ptr<MtpDrafter>> Create(const HybridModel& target,
                                                            int max_sequences, int max_tokens,
                                                            DraftVocabulary vocabulary = {});

  [[nodiscard]] bool needs_target_hidden() const override { return true; }
  absl::Status Observe(std::span<const TargetStep> steps) override;
  absl::Status Draft(std::span<const DraftRequest> requests,
                     std::vector<std::vector<int32_t>>& drafts) override;
  void Finish(int64_t sequence) override;

  [[nodiscard]] HybridModel& head() { return *head_; }
  [[nodiscard]] const DraftVocabulary& vocabulary() const { return vocabulary_; }

 private:
  MtpDrafter(std::unique_ptr<HybridModel> head, DraftVocabulary vocabulary)
      : head_(std::move(head)), vocabulary_(std::move(vocabulary)) {}

  struct Sequence {
    SequenceCache cache;       // the head's KV positions; num_tokens = committed positions
    std::vector<float> h;      // the head's post-norm output at its last committed position
    int32_t first_draft = -1;  // argmax of the head's logits there
  };
  // Runs one head step over `batch` (inputs paired with `h_prev`, float32 [tokens, H]) and stores
  // each sequence's last-row draft and post-norm output in `targets`.
  absl::Status Step(std::span<SequenceStep> batch, const std::vector<float>& h_prev,
                    std::span<Sequence* const> targets);

  std::unique_ptr<HybridModel> head_;
  DraftVocabulary vocabulary_;  // the head's logits row r is token vocabulary_.TokenOfRow(r)
  std::map<int64_t, Sequence> sequences_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_MTP_DRAFTER_H_
