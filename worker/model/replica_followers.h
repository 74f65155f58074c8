// The other ranks of a replica, as the leader rank's model sees them (issue 5): before the
// leader's HybridModel changes its caches or runs a step, it hands the same call to its
// followers, so that every rank runs the step on its shard and takes part in its collectives in
// the same order. worker/distributed/replica_plan.h sends these over the replica's
// communicator; HybridModel::ExecutePlan repeats them on a follower.
#ifndef MOBIUS_WORKER_MODEL_REPLICA_FOLLOWERS_H_
#define MOBIUS_WORKER_MODEL_REPLICA_FOLLOWERS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "worker/model/expert_placement.h"

namespace mobius::worker {

// One sequence of a planned step: exactly what HybridModel::Forward needs of it.
struct PlannedSequence {
  std::vector<int32_t> tokens;  // the step's new tokens
  int32_t cached_tokens = 0;    // tokens already in its caches
  int32_t state_slot = -1;      // its DeltaNet state slot
  // Its KV block table, covering cached_tokens + tokens, sent as a difference: the first
  // kv_blocks_known entries are those the previous plan of this state slot ended with, and
  // kv_blocks holds the rest (every entry when kv_blocks_known is 0). A long sequence's table is
  // then sent once, not with every step.
  std::vector<int32_t> kv_blocks;
  int32_t kv_blocks_known = 0;
  int32_t state_out_slot = -1;  // SequenceStep::state_out_slot
};

struct ReplicaStepPlan {
  std::vector<PlannedSequence> sequences;
  int logits_mode = 0;  // LogitsMode
  // Speculative verify step: every rank keeps its DeltaNet state inputs for a rollback.
  bool keep_state_inputs = false;
  // The leader counts (token, expert) assignments this step: under expert parallelism every
  // rank counts its own experts and the counts are summed over the ranks after the step.
  bool count_experts = false;
  kernels::DeltaRuleAlgorithm delta_rule = kernels::DeltaRuleAlgorithm::kAuto;
};

// One sequence's rollback after rejected drafts (HybridModel::ReplayStateInputs).
struct PlannedReplay {
  int32_t state_slot = -1;
  int32_t cached_tokens = 0;  // its position before the replayed tokens
  int32_t first_row = 0;      // rows of the last step's packed tokens
  int32_t num_tokens = 0;
};

struct CacheGeometry {
  int max_sequences = 0, max_tokens = 0, block_size = 0, num_kv_blocks = 0;
};

class ReplicaFollowers {
 public:
  virtual ~ReplicaFollowers() = default;
  virtual absl::Status CreateCaches(const CacheGeometry& geometry) = 0;
  // Sent before the leader runs the step; the collectives of the step follow.
  virtual absl::Status Step(const ReplicaStepPlan& plan) = 0;
  // A new expert placement: every rank reloads its banks for it (between steps).
  virtual absl::Status ApplyPlacement(const ExpertPlacement& placement) = 0;
  // Speculative decoding: copy a sequence's DeltaNet state between slots (the snapshot),
  // and replay the accepted tokens of the last step, on every rank's shard of the state.
  virtual absl::Status CopyStateSlots(const std::vector<int32_t>& from,
                                      const std::vector<int32_t>& to) = 0;
  virtual absl::Status ReplayStateInputs(const std::vector<PlannedReplay>& replays) = 0;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_REPLICA_FOLLOWERS_H_
