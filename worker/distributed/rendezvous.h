// Forms the communicator of one replica's ranks: rank 0 (the leader) serves mobius.v1.Rendezvous
// at --leader, collects every rank's transport endpoint (UCX worker addresses) or creates the
// NCCL unique id, and hands the set out; then every rank heartbeats the leader, so that a dead
// or stalled rank fails the whole group within a few seconds (docs/distributed.md).
#ifndef MOBIUS_WORKER_DISTRIBUTED_RENDEZVOUS_H_
#define MOBIUS_WORKER_DISTRIBUTED_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/distributed/communicator.h"

namespace mobius::worker {

enum class Transport { kUcx, kNccl };

struct RendezvousOptions {
  int rank = 0;
  int world_size = 1;
  // HOST:PORT of the leader's rendezvous service; the leader itself listens on
  // `listen_address`, or 0.0.0.0 and the port of `leader` when that is empty.
  std::string leader;
  std::string listen_address;
  // Set by the orchestrator, bumped at each restart of the group: the leader refuses ranks of
  // another generation, so a stale process cannot join a new group.
  uint64_t generation = 0;
  Transport transport = Transport::kUcx;
  // NCCL only: the CUDA backend whose stream the collectives run on.
  kernels::Backend* backend = nullptr;

  absl::Duration join_timeout = absl::Seconds(60);  // for every rank to join
  absl::Duration collective_timeout = absl::Seconds(30);
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // A rank not heard from for this long (or a leader unreachable for this long) fails the group.
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // Called once, from a background thread, when the group fails after it formed: the worker
  // reports NOT_SERVING and exits non-zero so that the orchestrator restarts the group. The
  // communicator's collectives fail from then on.
  std::function<void(const absl::Status&)> on_failure;
};

// Joins the replica described by `options` and returns this rank's communicator, which also owns
// the rendezvous session (the leader's service, the heartbeats): destroying it leaves the group
// cleanly. DeadlineExceeded when the group does not form within join_timeout.
absl::StatusOr<std::unique_ptr<Communicator>> JoinReplica(const RendezvousOptions& options);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_RENDEZVOUS_H_
