// Step plans between the ranks of one replica (issue 5; docs/distributed.md "Step plans"). The
// leader (rank 0) runs the engine; its model hands every cache creation and step to
// LeaderBroadcast, which broadcasts it (mobius.v1.ReplicaMessage) over the replica's
// communicator. Every other rank runs FollowLeader, which receives each message and repeats it
// on its shard, so that all ranks run the same steps and their collectives in the same order.
#ifndef MOBIUS_WORKER_DISTRIBUTED_REPLICA_PLAN_H_
#define MOBIUS_WORKER_DISTRIBUTED_REPLICA_PLAN_H_

#include <string>

#include "absl/status/status.h"
#include "worker/distributed/communicator.h"
#include "worker/model/hybrid_model.h"
#include "worker/model/replica_followers.h"

namespace mobius::worker {

// The leader's view of its followers. Not thread-safe: the engine thread makes every call.
class LeaderBroadcast final : public ReplicaFollowers {
 public:
  explicit LeaderBroadcast(Communicator& comm) : comm_(comm) {}
  absl::Status CreateCaches(const CacheGeometry& geometry) override;
  absl::Status Step(const ReplicaStepPlan& plan) override;
  absl::Status ApplyPlacement(const ExpertPlacement& placement) override;
  absl::Status CopyStateSlots(const std::vector<int32_t>& from,
                              const std::vector<int32_t>& to) override;
  absl::Status ReplayStateInputs(const std::vector<PlannedReplay>& replays) override;
  // Ends the followers' loops (they return OK): the leader is shutting down cleanly.
  absl::Status Stop();

 private:
  absl::Status Send(std::string bytes);
  Communicator& comm_;
};

// Runs a follower rank until the leader's Stop (OK) or a failure: a dead or stalled peer (the
// communicator's error, after the rendezvous aborted it), or a plan this rank cannot execute.
// Waits for each message without a deadline: an idle replica sends nothing.
absl::Status FollowLeader(HybridModel& model, Communicator& comm);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_REPLICA_PLAN_H_
