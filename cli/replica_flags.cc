#include "cli/replica_flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/distributed/rendezvous.h"

ABSL_FLAG(int, tp, 1,
          "Tensor-parallel degree: 1, or --world-size to split attention and DeltaNet heads over "
          "every rank of the replica.");
ABSL_FLAG(int, ep, 1,
          "Expert-parallel degree: 1 (each expert's intermediate dimension split over the ranks), "
          "or --world-size (each rank holds a contiguous range of every bank's experts). TP and "
          "EP run over the same ranks.");
ABSL_FLAG(int, world_size, 1,
          "Ranks (processes, one per GPU) of this replica: max(--tp, --ep). 1: a replica of one "
          "process, no rendezvous.");
ABSL_FLAG(int, rank, 0,
          "This process's rank in [0, --world-size). Rank 0, the leader, serves mobius.v1.Worker "
          "and runs the scheduler; the others follow its step plans and serve only health.");
ABSL_FLAG(std::string, leader, "",
          "HOST:PORT of the leader's rendezvous service (the leader listens on that port on every "
          "interface). Required when --world-size > 1.");
ABSL_FLAG(uint64_t, rendezvous_generation, 0,
          "Generation of the group, bumped by the orchestrator at every restart: ranks of another "
          "generation are refused.");
ABSL_FLAG(int, rendezvous_timeout_s, 120, "How long the leader waits for every rank to join.");
ABSL_FLAG(bool, sequence_parallel, false,
          "Sequence parallel: reduce-scatter after each mixer and feed-forward, all-gather before "
          "them, instead of all-reduces (needs --tp equal to --world-size).");
ABSL_FLAG(std::string, expert_placement, "contiguous",
          "How experts map to ranks with --ep > 1: \"contiguous\" (rank r holds experts "
          "[r E/W, (r+1) E/W) of every bank) or \"load-aware\" (each rank's share of the "
          "measured load in --expert-load as even as equal expert counts allow: hot experts on "
          "different ranks; same outputs).");
ABSL_FLAG(std::string, expert_load, "",
          "With --expert-placement load-aware: a JSON file {\"banks\": [[load of expert 0, 1, "
          "...], ...]} (one array per bank, e.g. token counts); every rank reads the same file.");
ABSL_FLAG(int, expert_replicas, 0,
          "Load-aware placement (--expert-placement load-aware, and POST /expert_placement on "
          "mobius-worker): besides its E/W experts, every rank holds this many replicas of the "
          "hottest experts of each bank, and the tokens routed to a replicated expert are spread "
          "over its holders (same outputs; more expert memory per rank). 0: no replicas.");

namespace mobius::cli {

using worker::ShardSpec;

// The replica layout from the flags, checked before anything is loaded.
absl::StatusOr<ShardSpec> ShardFromFlags() {
  const int world = absl::GetFlag(FLAGS_world_size), rank = absl::GetFlag(FLAGS_rank);
  const int tp = absl::GetFlag(FLAGS_tp), ep = absl::GetFlag(FLAGS_ep);
  if (world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--world-size ", world, " must be at least 1"));
  }
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", rank, " is outside [0, --world-size ", world, ")"));
  }
  for (auto [name, degree] : {std::pair{"--tp", tp}, std::pair{"--ep", ep}}) {
    if (degree != 1 && degree != world) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " ", degree, " must be 1 or --world-size (", world,
                       "): tensor and expert parallelism run over the same ranks"));
    }
  }
  if (std::max(tp, ep) != world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world-size ", world, " must equal max(--tp ", tp, ", --ep ", ep, ")"));
  }
  if (absl::GetFlag(FLAGS_sequence_parallel) && tp != world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--sequence-parallel needs --tp equal to --world-size (", world, ")"));
  }
  const std::string placement = absl::GetFlag(FLAGS_expert_placement);
  const std::string load_file = absl::GetFlag(FLAGS_expert_load);
  if (placement != "contiguous" && placement != "load-aware") {
    return absl::InvalidArgumentError(absl::StrCat("--expert-placement \"", placement,
                                                   "\" is not one of contiguous, load-aware"));
  }
  if (placement == "load-aware" && (ep < 2 || load_file.empty())) {
    return absl::InvalidArgumentError(
        "--expert-placement load-aware needs --ep > 1 and --expert-load FILE");
  }
  if (placement == "contiguous" && !load_file.empty()) {
    return absl::InvalidArgumentError(
        "--expert-load is used only with --expert-placement load-aware");
  }
  const int replicas = absl::GetFlag(FLAGS_expert_replicas);
  if (replicas < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--expert-replicas ", replicas, " must be 0 or more"));
  }
  if (replicas > 0 && ep < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--expert-replicas ", replicas, " needs expert parallelism (--ep > 1)"));
  }
  if (world > 1 && absl::GetFlag(FLAGS_leader).empty()) {
    return absl::InvalidArgumentError("--leader HOST:PORT is required when --world-size > 1");
  }
  ShardSpec shard = ShardSpec::ForRank(rank, tp, ep);
  if (placement == "load-aware") {
    ASSIGN_OR_RETURN(worker::ExpertPlacement balanced,
                     worker::ExpertPlacement::FromLoadFile(load_file, ep, replicas));
    shard.placement = std::make_shared<const worker::ExpertPlacement>(std::move(balanced));
  }
  return shard;
}

int ExpertReplicasFromFlags() { return std::max(absl::GetFlag(FLAGS_expert_replicas), 0); }

absl::StatusOr<ReplicaRank> JoinReplicaFromFlags(
    const ShardSpec& shard, kernels::Backend& backend,
    std::function<void(const absl::Status&)> on_failure) {
  ReplicaRank rank;
  if (!shard.sharded()) return rank;
  worker::RendezvousOptions rv;
  rv.rank = shard.rank();
  rv.world_size = shard.world_size();
  rv.leader = absl::GetFlag(FLAGS_leader);
  rv.generation = absl::GetFlag(FLAGS_rendezvous_generation);
  rv.join_timeout = absl::Seconds(absl::GetFlag(FLAGS_rendezvous_timeout_s));
  rv.transport = backend.device() == kernels::Device::kCuda ? worker::Transport::kNccl
                                                            : worker::Transport::kUcx;
  rv.backend = &backend;
  rv.on_failure = std::move(on_failure);
  MOBIUS_LOG(INFO, "replica", "") << "rank " << rv.rank << " of " << rv.world_size
                                  << ": joining the replica at " << rv.leader;
  ASSIGN_OR_RETURN(rank.comm, worker::JoinReplica(rv));
  return rank;
}

absl::StatusOr<ReplicaRank> JoinReplicaForCommand(worker::ModelSource& source,
                                                  kernels::Backend& backend) {
  ASSIGN_OR_RETURN(source.shard, ShardFromFlags());
  ASSIGN_OR_RETURN(
      ReplicaRank rank, JoinReplicaFromFlags(source.shard, backend, [](const absl::Status& why) {
        std::fprintf(stderr, "mobius: replica failed: %s\n", std::string(why.message()).c_str());
        std::fflush(nullptr);
        std::_Exit(3);
      }));
  source.comm = rank.comm.get();
  return rank;
}

absl::Status AttachReplica(worker::HybridModel& model, ReplicaRank& rank) {
  RETURN_IF_ERROR(model.SetSequenceParallel(absl::GetFlag(FLAGS_sequence_parallel)));
  if (rank.sharded() && rank.comm->rank() == 0) {
    rank.followers = std::make_unique<worker::LeaderBroadcast>(*rank.comm);
    model.SetFollowers(rank.followers.get());
  }
  return absl::OkStatus();
}

void StopReplica(worker::HybridModel& model, ReplicaRank& rank) {
  if (rank.followers == nullptr) return;
  model.SetFollowers(nullptr);
  if (absl::Status s = rank.followers->Stop(); !s.ok()) {
    MOBIUS_LOG(WARNING, "replica", "") << "could not stop the followers: " << s;
  }
  rank.followers.reset();
}

}  // namespace mobius::cli
