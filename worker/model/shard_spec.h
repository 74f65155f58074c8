// Which part of the model one rank of a tensor/expert-parallel replica holds and computes
// (MODEL.md section 7; docs/distributed.md "Sharding").
//
// TP and EP run over the same ranks: a replica of W ranks has tp_size and ep_size each either 1
// or W. tp_size = W splits the mixers (attention by query heads, DeltaNet by key-head groups with
// their value heads) W ways; tp_size = 1 replicates them. ep_size = W gives each rank a
// contiguous range of E / W whole experts of every bank; ep_size = 1 splits every expert's
// intermediate dimension W ways instead. The shared expert (or a dense MLP) is always split on
// its intermediate dimension W ways, so the feed-forward of every layer is partitioned over all
// W ranks and one all-reduce (or reduce-scatter) sums it. With both W, a rank holds 1/W of the
// heads and 1/W of the experts.
#ifndef MOBIUS_WORKER_MODEL_SHARD_SPEC_H_
#define MOBIUS_WORKER_MODEL_SHARD_SPEC_H_

#include <algorithm>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/model/expert_placement.h"
#include "worker/model/model_config.h"

namespace mobius::worker {

struct ShardSpec {
  int tp_rank = 0, tp_size = 1;
  int ep_rank = 0, ep_size = 1;
  // The order of each routed bank's experts (expert_placement.h); null: contiguous. Rank r of
  // an expert-parallel replica holds positions [r E / ep_size, (r + 1) E / ep_size) of it.
  std::shared_ptr<const ExpertPlacement> placement;

  // Ranks of the replica, and this rank's index among them.
  [[nodiscard]] int world_size() const { return std::max(tp_size, ep_size); }
  [[nodiscard]] int rank() const { return tp_size > 1 ? tp_rank : ep_rank; }
  [[nodiscard]] bool sharded() const { return world_size() > 1; }

  // The spec of `rank` in a replica of `tp` x `ep` as described above (tp, ep in {1, world}).
  static ShardSpec ForRank(int rank, int tp, int ep) {
    ShardSpec s;
    s.tp_size = tp;
    s.ep_size = ep;
    s.tp_rank = tp > 1 ? rank : 0;
    s.ep_rank = ep > 1 ? rank : 0;
    return s;
  }
};

// The part of each head/intermediate dimension one rank holds, derived from a ShardSpec.
struct ShardDims {
  int world = 1, rank = 0;
  // Attention: query heads [q_head0, q_head0 + num_q_heads), kv heads [kv_head0, + num_kv_heads)
  // (replicated when tp_size > num_key_value_heads).
  int q_head0 = 0, num_q_heads = 0, kv_head0 = 0, num_kv_heads = 0;
  // DeltaNet: key heads [k_head0, + num_k_heads) (replicated when tp_size > key heads), value
  // heads [v_head0, + num_v_heads).
  int k_head0 = 0, num_k_heads = 0, v_head0 = 0, num_v_heads = 0;
  // Routed experts [expert0, + num_experts); intermediate columns [moe_i0, + moe_i) of each.
  int expert0 = 0, num_experts = 0, moe_i0 = 0, moe_i = 0;
  // Shared expert and dense MLP intermediate slices.
  int shared_i0 = 0, shared_i = 0, dense_i0 = 0, dense_i = 0;
};

// Checks that `shard` is a valid layout for `config` (tp/ep degrees and ranks, every split head
// or intermediate count divisible) and returns this rank's dims. InvalidArgument names the
// field that does not divide.
absl::StatusOr<ShardDims> ComputeShardDims(const ModelConfig& config, const ShardSpec& shard);

// `config` with this rank's local head counts and intermediate sizes (what the mixers, MoE and
// caches of one rank see). num_experts stays the bank's full count (the router is replicated).
ModelConfig LocalModelConfig(const ModelConfig& config, const ShardDims& dims);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_SHARD_SPEC_H_
