// N ranks as threads of one process: the communicator for unit tests of sharded models. Every
// rank's thread calls the same collectives in the same order; ranks meet at a shared barrier
// and read each other's host tensors directly. Sums run in rank order in fp32, so every rank
// gets bit-identical results.
#ifndef MOBIUS_WORKER_DISTRIBUTED_LOCAL_COMMUNICATOR_H_
#define MOBIUS_WORKER_DISTRIBUTED_LOCAL_COMMUNICATOR_H_

#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "worker/distributed/communicator.h"

namespace mobius::worker {

// One communicator per rank (index = rank), sharing one group. A rank that waits longer than
// `timeout` for the others fails the whole group (DeadlineExceeded, for every rank and every
// later call). Tensors must be in host memory.
std::vector<std::unique_ptr<Communicator>> CreateLocalCommunicators(
    int n, absl::Duration timeout = absl::Seconds(30));

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_LOCAL_COMMUNICATOR_H_
