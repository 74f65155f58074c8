// The collectives the ranks of one model replica use to run a sharded model together (tensor,
// expert and sequence parallel), behind one interface with three implementations: threads of
// one process (LocalCommunicator, for tests), UCX over host memory (processes and nodes without
// GPUs) and NCCL over GPU memory.
#ifndef MOBIUS_WORKER_DISTRIBUTED_COMMUNICATOR_H_
#define MOBIUS_WORKER_DISTRIBUTED_COMMUNICATOR_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/tensor.h"

namespace mobius::worker {

// Collectives among the ranks of one replica. Tensors live on the backend's device; every rank
// calls the same collectives in the same order. Errors (a dead peer, a timeout) are returned,
// never hang forever: each call has the communicator's timeout.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual absl::Status AllReduceSum(kernels::Tensor& t) = 0;  // in place, F32 or BF16
  // out = concat of every rank's `in` along dim 0, rank order
  virtual absl::Status AllGather(const kernels::Tensor& in, kernels::Tensor& out) = 0;
  // in dim0 = world*out dim0; rank r gets rows block r of the sum
  virtual absl::Status ReduceScatterSum(const kernels::Tensor& in, kernels::Tensor& out) = 0;
  virtual absl::Status Broadcast(kernels::Tensor& t, int root) = 0;
  // Host bytes (the leader's per-step batch plan), within the communicator's collective timeout.
  absl::Status BroadcastBytes(std::string& bytes, int root) {
    return BroadcastBytesFor(bytes, root, absl::ZeroDuration());
  }
  // The same within `timeout` instead (zero: the communicator's; InfiniteDuration: until the
  // group fails, which is how a follower rank waits for the leader's next step while the replica
  // is idle — dead peers still end the wait through Abort).
  virtual absl::Status BroadcastBytesFor(std::string& bytes, int root, absl::Duration timeout) = 0;

  // Marks the group failed (called from any thread, e.g. by the rendezvous liveness monitor when
  // a peer died): collectives in flight return `reason` promptly, and so does every later call.
  virtual void Abort(const absl::Status& reason) {}
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_COMMUNICATOR_H_
