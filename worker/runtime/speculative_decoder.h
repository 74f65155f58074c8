// Greedy speculative decoding over HybridModel with exact rollback: each step verifies a
// sequence's k draft tokens plus its pending token in one target forward (all-token logits),
// keeps the longest prefix of drafts that match the target's own greedy choices plus one
// corrected or bonus token, and rolls the DeltaNet state back to the last accepted token by
// restoring a snapshot of the sequence's state slot and recomputing the accepted tokens. KV
// positions roll back by resetting SequenceCache::num_tokens (stale entries are overwritten).
#ifndef MOBIUS_WORKER_RUNTIME_SPECULATIVE_DECODER_H_
#define MOBIUS_WORKER_RUNTIME_SPECULATIVE_DECODER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "worker/cache/sequence_cache.h"
#include "worker/model/hybrid_model.h"

namespace mobius::worker {

// Proposes draft tokens for one sequence. `context` is every token of the sequence so far
// (prompt, generated tokens and the pending token last). Returns at most k tokens.
class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::vector<int32_t> Draft(int sequence, std::span<const int32_t> context, int k) = 0;
};

// Acceptance statistics: accepted[i] counts drafts accepted at draft position i (0-based),
// proposed[i] drafts proposed there; verify_steps counts speculative steps.
struct SpeculationStats {
  std::vector<int64_t> proposed;
  std::vector<int64_t> accepted;
  int64_t verify_steps = 0;
  int64_t emitted_tokens = 0;   // tokens produced by speculative steps (accepted + 1 each)
  int64_t recompute_steps = 0;  // partial acceptances that restored and recomputed

  [[nodiscard]] double AcceptanceRate(int position) const;
  // Mean tokens emitted per verify step (accepted drafts + the corrected/bonus token).
  [[nodiscard]] double MeanAcceptedLength() const;
};

struct SpeculativeRequest {
  std::vector<int32_t> prompt;
  int max_new_tokens = 0;
  int spec_tokens = 0;  // 0: plain greedy decoding for this sequence
};

class SpeculativeDecoder {
 public:
  // `model` must have caches with room for two state slots per speculating sequence (its own
  // and the snapshot) and one per other sequence.
  SpeculativeDecoder(HybridModel& model, Drafter& drafter) : model_(model), drafter_(drafter) {}

  // Generates greedily for every request together (one ragged batch per step); `outputs[i]`
  // receives request i's new tokens (exactly max_new_tokens). Speculating and non-speculating
  // requests share the batch.
  absl::Status Generate(std::span<const SpeculativeRequest> requests,
                        std::vector<std::vector<int32_t>>& outputs);

  [[nodiscard]] const SpeculationStats& stats() const { return stats_; }

 private:
  // Copies the DeltaNet state of slot `from` into slot `to` (conv and recurrent, every layer).
  void CopyStateSlot(int32_t from, int32_t to);

  HybridModel& model_;
  Drafter& drafter_;
  SpeculationStats stats_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_SPECULATIVE_DECODER_H_
