// A rank of a sharded replica that fails a step on its own (a tensor that does not fit, an op
// that could not get its memory) must fail that step on every rank, promptly, and leave the group
// in step: the next step runs and gives the same logits as before the failure. Before, the
// failing rank returned at once while the others waited in the step's next collective, and the
// leader's next step then paired its collectives with the followers' stale ones. Ranks are threads
// joined by a LocalCommunicator, on CPU.
#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/model/fixture_util.h"
#include "worker/distributed/local_communicator.h"
#include "worker/distributed/replica_plan.h"
#include "worker/model/model_config.h"
#include "worker/model/model_factory.h"

namespace mobius::testing {
namespace {

using worker::ForwardOptions;
using worker::LogitsMode;
using worker::SequenceCache;
using worker::SequenceStep;
using worker::ShardSpec;

constexpr char kInjected[] = "injected: out of memory";

// The CPU reference with failures on demand.
class FaultyCpuBackend final : public kernels::CpuBackend {
 public:
  FaultyCpuBackend() : CpuBackend(1) {}

  // The n-th allocation from now (1-based) fails with ResourceExhausted, once.
  void FailAllocation(int n) { fail_in_ = n; }
  // An op of the next step cannot get its memory: the step's first allocation marks it failed,
  // and TakeOpError then reports it as the CUDA backend's does. (Arming the error itself would
  // not do: Forward drops errors left from before the step.)
  void FailAnOp() { fail_an_op_ = true; }
  // The next state-slot copy or state replay skips its work and TakeOpError reports it, as the
  // CUDA backend's do when their metadata cannot grow.
  void FailAStateOp() { fail_a_state_op_ = true; }
  [[nodiscard]] int64_t allocations() const { return allocations_; }

  absl::StatusOr<kernels::Tensor> Allocate(kernels::DType dtype,
                                           std::vector<int64_t> shape) override {
    ++allocations_;
    op_failed_ |= std::exchange(fail_an_op_, false);
    if (fail_in_ > 0 && --fail_in_ == 0) return absl::ResourceExhaustedError(kInjected);
    return CpuBackend::Allocate(dtype, std::move(shape));
  }
  void CopyRows(std::span<kernels::Tensor* const> xs, std::span<const int32_t> from,
                std::span<const int32_t> to) override {
    if (std::exchange(fail_a_state_op_, false)) {
      op_failed_ = true;
      return;
    }
    CpuBackend::CopyRows(xs, from, to);
  }
  absl::Status ReplayDeltaRuleStates(std::span<const kernels::DeltaRuleReplayLayer> layers,
                                     const kernels::DeltaRuleDims& dims,
                                     std::span<const kernels::SequenceSegment> segments) override {
    if (std::exchange(fail_a_state_op_, false)) {
      op_failed_ = true;
      return absl::OkStatus();
    }
    return CpuBackend::ReplayDeltaRuleStates(layers, dims, segments);
  }
  absl::Status TakeOpError() override {
    if (!op_failed_) return absl::OkStatus();
    op_failed_ = false;
    return absl::ResourceExhaustedError(kInjected);
  }

 private:
  int fail_in_ = 0;
  bool fail_an_op_ = false, fail_a_state_op_ = false, op_failed_ = false;
  int64_t allocations_ = 0;
};

struct Layout {
  std::string name;
  int tp, ep;
  bool sequence_parallel;
};

enum class Fault {
  kSublayerTensor,  // an allocation halfway through the step (inside a layer)
  kLogitsTensor,    // the step's last allocation (the logits, after its last collective)
  kOpMemory,        // an op that skipped its launches (TakeOpError)
  kResidualStream,  // the step's first allocation: the rank cannot take part at all
};

struct Case {
  Layout layout;
  Fault fault;
  std::string name;
};

constexpr int kFaultyRank = 1;

struct RankResult {
  absl::Status setup;
  std::vector<float> before;  // logits of the prompt, the step before the failure
  absl::Status failed_step;   // the step with the fault
  bool failed_together = false;
  absl::Duration failed_step_time;
  absl::Status after_status;  // the step after it
  std::vector<float> after;
};

RankResult RunRank(const std::string& dir, const std::vector<int32_t>& prompt, const Case& c,
                   int rank, worker::Communicator& comm) {
  RankResult r;
  FaultyCpuBackend backend;
  worker::ModelSource source;
  source.model_dir = dir;
  source.shard = ShardSpec::ForRank(rank, c.layout.tp, c.layout.ep);
  source.comm = &comm;
  auto loaded = worker::LoadHybridModel(source, backend);
  if (!loaded.ok()) {
    r.setup = loaded.status();
    comm.Abort(r.setup);
    return r;
  }
  worker::HybridModel& model = **loaded;
  r.setup = model.SetSequenceParallel(c.layout.sequence_parallel);
  if (r.setup.ok()) r.setup = model.CreateCaches(4, 64);
  if (!r.setup.ok()) {
    comm.Abort(r.setup);
    return r;
  }
  // Expert parallelism also sums the step's expert counts over the ranks: one more collective
  // after the step, which a failed step must skip on every rank alike.
  std::vector<std::vector<int64_t>> expert_tokens(model.config().num_hidden_layers);
  ForwardOptions options;
  options.logits = LogitsMode::kAllTokens;
  if (c.layout.ep > 1) options.expert_tokens = &expert_tokens;
  auto prefill = [&](std::vector<float>& logits) {
    SequenceCache seq;
    absl::Status s = model.StartSequence(seq);
    SequenceStep step{prompt, &seq};
    if (s.ok()) s = model.Forward(std::span(&step, 1), options, logits);
    model.ReleaseSequence(seq);
    return s;
  };

  const int64_t first = backend.allocations();
  if (r.setup = prefill(r.before); !r.setup.ok()) return r;
  const int64_t per_step = backend.allocations() - first;
  if (rank == kFaultyRank) {
    switch (c.fault) {
      case Fault::kSublayerTensor:
        backend.FailAllocation(static_cast<int>(per_step / 2));
        break;
      case Fault::kLogitsTensor:
        backend.FailAllocation(static_cast<int>(per_step));
        break;
      case Fault::kOpMemory:
        backend.FailAnOp();
        break;
      case Fault::kResidualStream:
        backend.FailAllocation(1);
        break;
    }
  }
  std::vector<float> unused;
  const absl::Time start = absl::Now();
  r.failed_step = prefill(unused);
  r.failed_step_time = absl::Now() - start;
  r.failed_together = model.last_call_failed_together();
  if (c.fault != Fault::kResidualStream) r.after_status = prefill(r.after);
  return r;
}

class ShardedStepFailureTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedStepFailureTest, FailsOnEveryRankAndTheNextStepRuns) {
  const Case& c = GetParam();
  const std::string dir = FixtureModelDir("intern-s2-mobius-tiny");
  const ModelReference ref = LoadReference(dir);
  const int world = std::max(c.layout.tp, c.layout.ep);
  // A group that waited for the failed rank would fail only at this timeout.
  constexpr absl::Duration kTimeout = absl::Seconds(20);
  auto comms = worker::CreateLocalCommunicators(world, kTimeout);
  std::vector<RankResult> results(world);
  {
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back(
          [&, rank] { results[rank] = RunRank(dir, ref.prompts[0], c, rank, *comms[rank]); });
    }
    for (std::thread& t : threads) t.join();
  }
  for (int rank = 0; rank < world; ++rank) {
    const RankResult& r = results[rank];
    ASSERT_TRUE(r.setup.ok()) << "rank " << rank << ": " << r.setup;
    EXPECT_LT(r.failed_step_time, kTimeout / 2) << "rank " << rank << " waited for the failed rank";
    if (rank == kFaultyRank) {
      EXPECT_TRUE(absl::IsResourceExhausted(r.failed_step)) << r.failed_step;
      EXPECT_EQ(r.failed_step.message(), kInjected);
    } else if (c.fault == Fault::kResidualStream) {
      // The failed rank aborted the group with its error.
      EXPECT_EQ(r.failed_step.message(), kInjected) << "rank " << rank << ": " << r.failed_step;
    } else {
      EXPECT_TRUE(absl::IsResourceExhausted(r.failed_step))
          << "rank " << rank << ": " << r.failed_step;
      EXPECT_NE(r.failed_step.message().find(absl::StrFormat("rank %d of %d", kFaultyRank, world)),
                std::string::npos)
          << r.failed_step;
    }
    // Only a failure that left the group in step may be followed by another step.
    EXPECT_EQ(r.failed_together, c.fault != Fault::kResidualStream) << "rank " << rank;
    if (c.fault == Fault::kResidualStream) continue;
    ASSERT_TRUE(r.after_status.ok()) << "rank " << rank << ": " << r.after_status;
    // Same step, same shapes, same ranks: the same logits as before the failure.
    EXPECT_EQ(r.after, r.before) << "rank " << rank;
    EXPECT_EQ(r.after, results[0].after) << "rank " << rank;
  }
}

const Layout kTp2{"tp2", 2, 1, false}, kTp2Sp{"tp2_sp", 2, 1, true}, kEp2{"ep2", 1, 2, false},
    kTp2Ep2{"tp2_ep2", 2, 2, false};

INSTANTIATE_TEST_SUITE_P(
    Faults, ShardedStepFailureTest,
    ::testing::Values(Case{kTp2, Fault::kSublayerTensor, "tp2_sublayer_tensor"},
                      Case{kTp2, Fault::kLogitsTensor, "tp2_logits_tensor"},
                      Case{kTp2, Fault::kOpMemory, "tp2_op_memory"},
                      Case{kTp2, Fault::kResidualStream, "tp2_residual_stream"},
                      Case{kTp2Sp, Fault::kSublayerTensor, "tp2_sp_sublayer_tensor"},
                      Case{kTp2Sp, Fault::kLogitsTensor, "tp2_sp_logits_tensor"},
                      Case{kTp2Sp, Fault::kResidualStream, "tp2_sp_residual_stream"},
                      Case{kEp2, Fault::kSublayerTensor, "ep2_sublayer_tensor"},
                      Case{kEp2, Fault::kOpMemory, "ep2_op_memory"},
                      Case{kTp2Ep2, Fault::kSublayerTensor, "tp2_ep2_sublayer_tensor"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// A worker replica of two ranks on threads: the leader hands each call to its follower through
// LeaderBroadcast, and the follower runs FollowLeader until Finish stops it.
class TwoRankReplica {
 public:
  explicit TwoRankReplica(const std::string& dir)
      : comms_(worker::CreateLocalCommunicators(2, absl::Seconds(20))) {
    auto load = [&](int rank, kernels::Backend& backend) {
      worker::ModelSource source;
      source.model_dir = dir;
      source.shard = ShardSpec::ForRank(rank, 2, 1);
      source.comm = comms_[rank].get();
      return worker::LoadHybridModel(source, backend);
    };
    auto leader = load(0, leader_backend);
    auto follower = load(1, follower_backend);
    if (!leader.ok() || !follower.ok()) {
      setup = leader.ok() ? follower.status() : leader.status();
      return;
    }
    leader_ = *std::move(leader);
    follower_ = *std::move(follower);
    follower_thread_ =
        std::thread([this] { followed_ = worker::FollowLeader(*follower_, *comms_[1]); });
    leader_->SetFollowers(&broadcast_);
  }
  ~TwoRankReplica() {
    if (follower_thread_.joinable()) Finish().IgnoreError();
  }

  worker::HybridModel& leader() { return *leader_; }
  // Stops the follower; returns what its FollowLeader returned.
  absl::Status Finish() {
    const absl::Status stopped = broadcast_.Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
    if (!stopped.ok()) comms_[0]->Abort(stopped);
    follower_thread_.join();
    return followed_;
  }

  absl::Status setup;
  // The follower's thread waits for the next message between the leader's calls, so a test may
  // arm the follower's backend then.
  FaultyCpuBackend leader_backend, follower_backend;

 private:
  std::vector<std::unique_ptr<worker::Communicator>> comms_;
  std::unique_ptr<worker::HybridModel> leader_, follower_;
  worker::LeaderBroadcast broadcast_{*comms_[0]};
  std::thread follower_thread_;
  absl::Status followed_;
};

// A worker replica: the leader hands each step to its follower through LeaderBroadcast, and the
// follower (FollowLeader) fails one step on its own. The leader's step fails naming the
// follower, the follower keeps following, and the next step runs.
TEST(ShardedStepFailureTest, AFollowerThatFailsAStepKeepsFollowing) {
  const std::string dir = FixtureModelDir("intern-s2-mobius-tiny");
  const ModelReference ref = LoadReference(dir);
  TwoRankReplica replica(dir);
  ASSERT_TRUE(replica.setup.ok()) << replica.setup;
  worker::HybridModel& leader = replica.leader();

  ForwardOptions options;
  options.logits = LogitsMode::kAllTokens;
  auto prefill = [&](std::vector<float>& logits) {
    SequenceCache seq;
    absl::Status s = leader.StartSequence(seq);
    SequenceStep step{ref.prompts[1], &seq};
    if (s.ok()) s = leader.Forward(std::span(&step, 1), options, logits);
    leader.ReleaseSequence(seq);
    return s;
  };
  std::vector<float> before, failed, after;
  absl::Status caches = leader.CreateCaches(4, 64);
  EXPECT_TRUE(caches.ok()) << caches;
  absl::Status first = caches.ok() ? prefill(before) : caches;
  EXPECT_TRUE(first.ok()) << first;
  replica.follower_backend.FailAllocation(10);
  const absl::Status failed_step = first.ok() ? prefill(failed) : first;
  EXPECT_TRUE(absl::IsResourceExhausted(failed_step)) << failed_step;
  EXPECT_NE(failed_step.message().find("rank 1 of 2"), std::string::npos) << failed_step;
  const absl::Status next = first.ok() ? prefill(after) : first;
  EXPECT_TRUE(next.ok()) << next;
  EXPECT_EQ(after, before);
  const absl::Status followed = replica.Finish();
  EXPECT_TRUE(followed.ok()) << followed;
}

// Speculative decoding's state snapshot (CopyStateSlots) and rollback (ReplayStateInputs) run
// between steps on every rank of a replica. One that fails on a single rank (leader or follower)
// fails on both, the follower keeps following, and the next copy, replay and step run. Before,
// a follower's failure ended its FollowLeader and the group failed as for a dead peer.
TEST(ShardedStepFailureTest, AStateCopyOrReplayThatFailsOnOneRankFailsOnBoth) {
  const std::string dir = FixtureModelDir("intern-s2-mobius-tiny");
  const ModelReference ref = LoadReference(dir);
  TwoRankReplica replica(dir);
  ASSERT_TRUE(replica.setup.ok()) << replica.setup;
  worker::HybridModel& leader = replica.leader();

  const std::vector<int32_t>& prompt = ref.prompts[1];
  ForwardOptions options;
  options.logits = LogitsMode::kAllTokens;
  options.keep_state_inputs = true;  // for the replays
  std::vector<float> before, after;
  SequenceCache seq, snapshot;
  absl::Status s = leader.CreateCaches(4, 64);
  if (s.ok()) s = leader.StartSequence(seq);
  if (s.ok()) s = leader.StartSequence(snapshot);
  SequenceStep step{prompt, &seq};
  if (s.ok()) s = leader.Forward(std::span(&step, 1), options, before);
  EXPECT_TRUE(s.ok()) << s;

  // Each call with its fault on `rank`'s backend, then the same call with none.
  auto copy = [&] { return leader.CopyStateSlot(seq.state_slot, snapshot.state_slot); };
  auto replay = [&]() -> absl::Status {
    // The last token again, from the kept inputs, onto the snapshot taken above. A replay that
    // failed leaves the sequence's position where it was.
    const int start = static_cast<int>(prompt.size()) - 1;
    SequenceCache rolled = snapshot;
    rolled.num_tokens = start;
    const worker::StateReplay r{&rolled, start, 1};
    absl::Status replayed = leader.ReplayStateInputs(std::span(&r, 1));
    EXPECT_EQ(rolled.num_tokens, replayed.ok() ? start + 1 : start) << replayed;
    return replayed;
  };
  struct Call {
    const char* name;
    std::function<absl::Status()> run;
  };
  for (const Call& call : {Call{"copy", copy}, Call{"replay", replay}}) {
    for (int rank : {1, 0}) {
      if (!s.ok()) break;
      (rank == 0 ? replica.leader_backend : replica.follower_backend).FailAStateOp();
      const absl::Status failed = call.run();
      EXPECT_TRUE(absl::IsResourceExhausted(failed))
          << call.name << " on rank " << rank << ": " << failed;
      if (rank == 0) {
        EXPECT_EQ(failed.message(), kInjected) << call.name;
      } else {
        EXPECT_NE(failed.message().find("rank 1 of 2"), std::string::npos)
            << call.name << ": " << failed;
      }
      EXPECT_TRUE(leader.last_call_failed_together()) << call.name << " on rank " << rank;
      s = call.run();
      EXPECT_TRUE(s.ok()) << call.name << " after the fault on rank " << rank << ": " << s;
      EXPECT_FALSE(leader.last_call_failed_together()) << call.name;
    }
  }
  leader.ReleaseSequence(seq);
  leader.ReleaseSequence(snapshot);
  // The group is still in step: a fresh prefill gives the first one's logits.
  SequenceCache fresh;
  if (s.ok()) s = leader.StartSequence(fresh);
  SequenceStep again{prompt, &fresh};
  if (s.ok()) s = leader.Forward(std::span(&again, 1), options, after);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(after, before);
  leader.ReleaseSequence(fresh);
  const absl::Status followed = replica.Finish();
  EXPECT_TRUE(followed.ok()) << followed;
}

}  // namespace
}  // namespace mobius::testing
