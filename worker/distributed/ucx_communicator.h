// Collectives over UCX (Debian's libucx) in host memory, for ranks in separate processes or on
// separate nodes without GPUs: one UCP worker per rank, tagged send/receive over endpoints to
// every peer, ring algorithms (reduce-scatter + all-gather) with bf16 carried and summed in fp32.
// UCX picks the transport (shared memory between processes of one host, TCP otherwise; see
// docs/distributed.md for UCX_TLS in containers).
#ifndef MOBIUS_WORKER_DISTRIBUTED_UCX_COMMUNICATOR_H_
#define MOBIUS_WORKER_DISTRIBUTED_UCX_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/distributed/communicator.h"

namespace mobius::worker {

// Formed in two steps around the rendezvous: Create() opens the UCP worker, whose address the
// rank publishes; Connect() takes every rank's address (index = rank) and opens the endpoints.
class UcxCommunicator : public Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<UcxCommunicator>> Create(int rank, int world_size,
                                                                 absl::Duration timeout);
  // This rank's UCP worker address, opaque bytes for the other ranks' Connect().
  [[nodiscard]] virtual std::string address() const = 0;
  virtual absl::Status Connect(const std::vector<std::string>& addresses) = 0;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_UCX_COMMUNICATOR_H_
