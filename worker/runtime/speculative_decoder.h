// Speculative decoding over HybridModel with exact rollback: each step verifies a sequence's k
// draft tokens plus its pending token in one target forward (all-token logits) and keeps drafts
// by the rejection rule of speculative_sampling.h (greedy requests: the longest prefix of drafts
// that match the target's own choices), then one corrected or bonus token. The verify step writes
// the DeltaNet states to the sequence's spare slot and leaves its own untouched: with every draft
// accepted the two slots swap roles; otherwise the state rolls back to the last accepted token by
// replaying the accepted tokens onto the untouched slot. KV positions roll back by resetting
// SequenceCache::num_tokens (stale entries are overwritten).
#ifndef MOBIUS_WORKER_RUNTIME_SPECULATIVE_DECODER_H_
#define MOBIUS_WORKER_RUNTIME_SPECULATIVE_DECODER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "worker/cache/sequence_cache.h"
#include "worker/model/hybrid_model.h"
#include "worker/runtime/sampling_params.h"

namespace mobius::worker {

// What the target committed for one sequence in a step: `tokens` at positions [start, start +
// tokens.size()), their final post-norm hidden states (float32 [tokens.size(), H]; empty unless
// the drafter needs them) and `next`, the token chosen after them (pending: not run yet).
struct TargetStep {
  int64_t sequence = 0;
  int start = 0;
  std::span<const int32_t> tokens;
  std::span<const float> hidden;
  int32_t next = 0;
};

struct DraftRequest {
  int64_t sequence = 0;
  std::span<const int32_t> context;  // every token so far: prompt, outputs, the pending one last
  int k = 0;                         // at most this many drafts
};

// Proposes draft tokens. Drafts are deterministic choices (the draft distribution q is one-hot at
// each draft), which the acceptance rule takes into account.
class Drafter {
 public:
  virtual ~Drafter() = default;
  // Whether Observe needs the target's hidden states (they cost a device-to-host copy).
  [[nodiscard]] virtual bool needs_target_hidden() const { return false; }
  // Called after the prefill and after every verify step with what each speculating sequence
  // committed, before the next Draft.
  virtual absl::Status Observe(std::span<const TargetStep> /*steps*/) { return absl::OkStatus(); }
  // drafts[i] receives at most requests[i].k tokens for requests[i].
  virtual absl::Status Draft(std::span<const DraftRequest> requests,
                             std::vector<std::vector<int32_t>>& drafts) = 0;
  // The sequence is done: its draft-side state may go.
  virtual void Finish(int64_t /*sequence*/) {}
};

// Acceptance statistics: accepted[i] counts drafts accepted at draft position i (0-based),
// proposed[i] drafts proposed there; verify_steps counts speculative steps.
struct SpeculationStats {
  std::vector<int64_t> proposed;
  std::vector<int64_t> accepted;
  int64_t verify_steps = 0;
  int64_t emitted_tokens = 0;   // tokens produced by speculative steps (accepted + 1 each)
  int64_t rollback_steps = 0;   // partial acceptances: the accepted tokens replayed
  double draft_seconds = 0;     // in the drafter (Observe + Draft)
  double verify_seconds = 0;    // target forwards of steps with drafts
  double rollback_seconds = 0;  // state replays

  [[nodiscard]] double AcceptanceRate(int position) const;
  // Mean tokens emitted per verify step (accepted drafts + the corrected/bonus token).
  [[nodiscard]] double MeanAcceptedLength() const;
};

struct SpeculativeRequest {
  std::vector<int32_t> prompt;
  int max_new_tokens = 0;
  int spec_tokens = 0;  // 0: plain decoding for this sequence
  // Greedy by default; any sampling parameters otherwise (seed: params.seed, else `seed`).
  SamplingParams params = GreedyParams();
  uint64_t seed = 0;
  std::vector<int32_t> stop_tokens;  // generation ends after the first of these (it is emitted)

  static SamplingParams GreedyParams() {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }
};

class SpeculativeDecoder {
 public:
  // `model` must have caches with room for two state slots per speculating sequence (its own
  // and the spare its verify steps write to) and one per other sequence.
  SpeculativeDecoder(HybridModel& model, Drafter& drafter) : model_(model), drafter_(drafter) {}

  // Generates for every request together (one ragged batch per step); `outputs[i]` receives
  // request i's new tokens (max_new_tokens, or fewer when a stop token ends it). Speculating and
  // non-speculating requests share the batch.
  absl::Status Generate(std::span<const SpeculativeRequest> requests,
                        std::vector<std::vector<int32_t>>& outputs);

  [[nodiscard]] const SpeculationStats& stats() const { return stats_; }

 private:
  HybridModel& model_;
  Drafter& drafter_;
  SpeculationStats stats_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_SPECULATIVE_DECODER_H_
