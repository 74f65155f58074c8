// Collectives over NCCL in GPU memory, queued on the CUDA backend's stream so that they order
// with the model's kernels (and can be captured in its CUDA graphs). Built only with CUDA.
#ifndef MOBIUS_WORKER_DISTRIBUTED_NCCL_COMMUNICATOR_H_
#define MOBIUS_WORKER_DISTRIBUTED_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/distributed/communicator.h"

namespace mobius::worker {

// A fresh NCCL unique id (the leader's part of the rendezvous), as opaque bytes.
absl::StatusOr<std::string> NcclUniqueId();

// Joins the NCCL group of `unique_id` as `rank` on the current device of `backend` (a CUDA
// backend). The collectives are asynchronous on the backend's stream: they return once queued
// (with any error NCCL reported so far); BroadcastBytes waits for its result. `timeout` bounds
// the group's initialisation and BroadcastBytes; a hung collective is released by Abort(), which
// the rendezvous calls when a rank dies (ncclCommAbort).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int rank, int world_size,
                                                                     const std::string& unique_id,
                                                                     kernels::Backend& backend,
                                                                     absl::Duration timeout);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_DISTRIBUTED_NCCL_COMMUNICATOR_H_
