// Flags that make a process one rank of a model replica spread over several processes (issue 5;
// docs/distributed.md): --tp, --ep, --world-size, --rank, --leader, --rendezvous-generation,
// --rendezvous-timeout-s, --sequence-parallel, --expert-placement, --expert-load,
// --expert-replicas. Shared by mobius-worker and
// the commands that load a model (`mobius generate`, `mobius bench engine`): rank 0 runs the
// command and plans every step; the other ranks follow it (FollowLeader).
#ifndef MOBIUS_CLI_REPLICA_FLAGS_H_
#define MOBIUS_CLI_REPLICA_FLAGS_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/distributed/communicator.h"
#include "worker/distributed/replica_plan.h"
#include "worker/model/hybrid_model.h"
#include "worker/model/model_factory.h"
#include "worker/model/shard_spec.h"

namespace mobius::cli {

// The layout from the flags, checked before anything is loaded (InvalidArgument names the flag
// and value; load-aware placement is Unimplemented).
absl::StatusOr<worker::ShardSpec> ShardFromFlags();
// --expert-replicas: replicas per rank and bank for load-aware placements.
int ExpertReplicasFromFlags();

// This process's part of a replica of several ranks.
struct ReplicaRank {
  std::unique_ptr<worker::Communicator> comm;          // null for a replica of one process
  std::unique_ptr<worker::LeaderBroadcast> followers;  // rank 0 of a sharded replica
  [[nodiscard]] bool sharded() const { return comm != nullptr; }
  [[nodiscard]] bool leader() const { return comm == nullptr || comm->rank() == 0; }
};

// Joins the replica when `shard` has more than one rank (UCX for a CPU backend, NCCL for CUDA);
// `on_failure` runs once, on a background thread, if the group fails later.
absl::StatusOr<ReplicaRank> JoinReplicaFromFlags(
    const worker::ShardSpec& shard, kernels::Backend& backend,
    std::function<void(const absl::Status&)> on_failure);

// For the CLI commands: the shard from the flags into `source` (shard and communicator) and the
// replica joined, a failed group ending the process with status 3.
absl::StatusOr<ReplicaRank> JoinReplicaForCommand(worker::ModelSource& source,
                                                  kernels::Backend& backend);

// After loading: sequence parallel from the flags, and on rank 0 the followers attached to the
// model (every cache creation and step is sent to the other ranks first).
absl::Status AttachReplica(worker::HybridModel& model, ReplicaRank& rank);

// Ends a sharded replica cleanly from rank 0 (the followers exit their loops); no-op otherwise.
void StopReplica(worker::HybridModel& model, ReplicaRank& rank);

}  // namespace mobius::cli

#endif  // MOBIUS_CLI_REPLICA_FLAGS_H_
