#include "worker/distributed/replica_plan.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "step_plan.pb.h"

namespace mobius::worker {
namespace {

constexpr int kLeader = 0;

v1::CacheGeometry ToProto(const CacheGeometry& g) {
  v1::CacheGeometry p;
  p.set_max_sequences(g.max_sequences);
  p.set_max_tokens(g.max_tokens);
  p.set_block_size(g.block_size);
  p.set_num_kv_blocks(g.num_kv_blocks);
  return p;
}

CacheGeometry FromProto(const v1::CacheGeometry& p) {
  return CacheGeometry{p.max_sequences(), p.max_tokens(), p.block_size(), p.num_kv_blocks()};
}

v1::StepPlan ToProto(const ReplicaStepPlan& plan) {
  v1::StepPlan p;
  for (const PlannedSequence& seq : plan.sequences) {
    v1::PlannedSequence* s = p.add_sequences();
    s->mutable_tokens()->Add(seq.tokens.begin(), seq.tokens.end());
    s->set_cached_tokens(seq.cached_tokens);
    s->set_state_slot(seq.state_slot);
    s->mutable_kv_blocks()->Add(seq.kv_blocks.begin(), seq.kv_blocks.end());
    s->set_kv_blocks_known(seq.kv_blocks_known);
    if (seq.state_out_slot >= 0) s->set_state_out_slot(seq.state_out_slot);
  }
  p.set_logits_mode(plan.logits_mode);
  p.set_delta_rule_algorithm(static_cast<int>(plan.delta_rule));
  p.set_count_experts(plan.count_experts);
  p.set_keep_state_inputs(plan.keep_state_inputs);
  return p;
}

ReplicaStepPlan FromProto(const v1::StepPlan& p) {
  ReplicaStepPlan plan;
  for (const v1::PlannedSequence& s : p.sequences()) {
    plan.sequences.push_back(PlannedSequence{{s.tokens().begin(), s.tokens().end()},
                                             s.cached_tokens(),
                                             s.state_slot(),
                                             {s.kv_blocks().begin(), s.kv_blocks().end()},
                                             s.kv_blocks_known(),
                                             s.has_state_out_slot() ? s.state_out_slot() : -1});
  }
  plan.logits_mode = p.logits_mode();
  plan.delta_rule = static_cast<kernels::DeltaRuleAlgorithm>(p.delta_rule_algorithm());
  plan.count_experts = p.count_experts();
  plan.keep_state_inputs = p.keep_state_inputs();
  return plan;
}

}  // namespace

absl::Status LeaderBroadcast::Send(std::string bytes) {
  return comm_.BroadcastBytes(bytes, kLeader);
}

absl::Status LeaderBroadcast::CreateCaches(const CacheGeometry& geometry) {
  v1::ReplicaMessage m;
  *m.mutable_create_caches() = ToProto(geometry);
  return Send(m.SerializeAsString());
}

absl::Status LeaderBroadcast::Step(const ReplicaStepPlan& plan) {
  v1::ReplicaMessage m;
  *m.mutable_step() = ToProto(plan);
  return Send(m.SerializeAsString());
}

absl::Status LeaderBroadcast::ApplyPlacement(const ExpertPlacement& placement) {
  v1::ReplicaMessage m;
  const int replicas = placement.replicas_per_rank();
  for (int b = 0; b < placement.num_banks(); ++b) {
    const std::vector<int32_t>& order = placement.order(b);
    auto* bank = m.mutable_placement()->add_banks();
    bank->mutable_experts()->Add(order.begin(), order.end());
    for (int r = 0; replicas > 0 && r < comm_.world_size(); ++r) {
      const std::vector<int32_t>& rep = placement.replicas(b, r);
      bank->add_replicas()->mutable_positions()->Add(rep.begin(), rep.end());
    }
  }
  return Send(m.SerializeAsString());
}

absl::Status LeaderBroadcast::CopyStateSlots(const std::vector<int32_t>& from,
                                             const std::vector<int32_t>& to) {
  v1::ReplicaMessage m;
  m.mutable_copy_state()->mutable_from()->Add(from.begin(), from.end());
  m.mutable_copy_state()->mutable_to()->Add(to.begin(), to.end());
  return Send(m.SerializeAsString());
}

absl::Status LeaderBroadcast::ReplayStateInputs(const std::vector<PlannedReplay>& replays) {
  v1::ReplicaMessage m;
  for (const PlannedReplay& r : replays) {
    v1::StateReplay::Sequence* s = m.mutable_replay_state()->add_sequences();
    s->set_state_slot(r.state_slot);
    s->set_cached_tokens(r.cached_tokens);
    s->set_first_row(r.first_row);
    s->set_num_tokens(r.num_tokens);
  }
  return Send(m.SerializeAsString());
}

absl::Status LeaderBroadcast::Stop() {
  v1::ReplicaMessage m;
  m.mutable_stop();
  return Send(m.SerializeAsString());
}

absl::Status FollowLeader(HybridModel& model, Communicator& comm) {
  for (int64_t received = 0;; ++received) {
    std::string bytes;
    RETURN_IF_ERROR(comm.BroadcastBytesFor(bytes, kLeader, absl::InfiniteDuration()));
    v1::ReplicaMessage m;
    if (!m.ParseFromString(bytes)) {
      return absl::DataLossError(
          absl::StrFormat("rank %d: message %d from the leader (%d bytes) is not a ReplicaMessage",
                          comm.rank(), received, bytes.size()));
    }
    // A step, state copy or replay that failed on every rank together (some rank ran out of
    // memory) leaves the group in step: the leader fails that call's requests (or drops its
    // drafts) and sends the next message. Any other failure ends the follower.
    auto keep_following = [&](const absl::Status& s, const char* what) {
      if (s.ok()) return absl::OkStatus();
      if (!model.last_call_failed_together()) return s;
      MOBIUS_LOG(WARNING, "worker", "") << "rank " << comm.rank() << ": " << what << " " << received
                                        << " failed on the group: " << s;
      return absl::OkStatus();
    };
    switch (m.kind_case()) {
      case v1::ReplicaMessage::kCreateCaches: {
        const CacheGeometry g = FromProto(m.create_caches());
        RETURN_IF_ERROR(
            model.CreateCaches(g.max_sequences, g.max_tokens, g.block_size, g.num_kv_blocks));
        break;
      }
      case v1::ReplicaMessage::kStep:
        RETURN_IF_ERROR(keep_following(model.ExecutePlan(FromProto(m.step())), "step"));
        break;
      case v1::ReplicaMessage::kPlacement: {
        std::vector<std::vector<int32_t>> orders;
        std::vector<std::vector<std::vector<int32_t>>> replicas;
        for (const auto& bank : m.placement().banks()) {
          orders.emplace_back(bank.experts().begin(), bank.experts().end());
          if (bank.replicas_size() == 0) continue;
          replicas.emplace_back();
          for (const auto& rank : bank.replicas()) {
            replicas.back().emplace_back(rank.positions().begin(), rank.positions().end());
          }
        }
        // Validated by ApplyExpertPlacement (ComputeShardDims) like the leader's.
        RETURN_IF_ERROR(model.ApplyExpertPlacement(std::make_shared<const ExpertPlacement>(
            ExpertPlacement::FromOrders(std::move(orders), std::move(replicas)))));
        break;
      }
      case v1::ReplicaMessage::kCopyState:
        RETURN_IF_ERROR(keep_following(
            model.CopyStateSlots(
                std::vector<int32_t>(m.copy_state().from().begin(), m.copy_state().from().end()),
                std::vector<int32_t>(m.copy_state().to().begin(), m.copy_state().to().end())),
            "state copy"));
        break;
      case v1::ReplicaMessage::kReplayState: {
        std::vector<SequenceCache> caches(m.replay_state().sequences_size());
        std::vector<StateReplay> replays;
        for (int i = 0; i < m.replay_state().sequences_size(); ++i) {
          const v1::StateReplay::Sequence& s = m.replay_state().sequences(i);
          caches[i].state_slot = s.state_slot();
          caches[i].num_tokens = s.cached_tokens();
          replays.push_back({&caches[i], s.first_row(), s.num_tokens()});
        }
        RETURN_IF_ERROR(keep_following(model.ReplayStateInputs(replays), "state replay"));
        break;
      }
      case v1::ReplicaMessage::kStop:
        return absl::OkStatus();
      default:
        return absl::DataLossError(absl::StrFormat(
            "rank %d: message %d from the leader has no known kind", comm.rank(), received));
    }
  }
}

}  // namespace mobius::worker
