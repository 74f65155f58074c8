#include "worker/model/shard_spec.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace mobius::worker {
namespace {

// Splits `n` heads `parts` ways: each part gets n / parts of them, or, when there are fewer heads
// than parts but parts is a multiple of n, consecutive parts share (replicate) one head.
absl::Status SplitHeads(int n, int parts, int index, bool allow_replication, const char* field,
                        int& first, int& count) {
  if (n % parts == 0) {
    count = n / parts;
    first = index * count;
    return absl::OkStatus();
  }
  if (allow_replication && parts % n == 0) {
    count = 1;
    first = index / (parts / n);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("tensor parallel degree %d does not divide %s (%d)%s", parts, field, n,
                      allow_replication ? " and is not a multiple of it" : ""));
}

absl::Status SplitDim(int n, int parts, int index, const char* field, int& first, int& count) {
  if (n % parts != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d ranks do not divide %s (%d)", parts, field, n));
  }
  count = n / parts;
  first = index * count;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ShardDims> ComputeShardDims(const ModelConfig& c, const ShardSpec& s) {
  const int W = s.world_size();
  if (s.placement != nullptr) {
    if (s.placement->num_banks() != c.num_blocks) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "expert placement has %d banks, the model %d", s.placement->num_banks(), c.num_blocks));
    }
    if (s.placement->replicas_per_rank() > 0 && s.ep_size <= 1) {
      return absl::InvalidArgumentError(
          "an expert placement with replicas needs expert parallelism (ep > 1)");
    }
    RETURN_IF_ERROR(s.placement->Validate(std::max(s.ep_size, 1), c.num_experts));
  }
  if (s.tp_size < 1 || s.ep_size < 1 || (s.tp_size != 1 && s.tp_size != W) ||
      (s.ep_size != 1 && s.ep_size != W)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tp=%d ep=%d: tensor and expert parallelism run over the same ranks, so each degree must "
        "be 1 or the replica's %d ranks",
        s.tp_size, s.ep_size, W));
  }
  if (s.tp_rank < 0 || s.tp_rank >= s.tp_size || s.ep_rank < 0 || s.ep_rank >= s.ep_size ||
      (s.tp_size > 1 && s.ep_size > 1 && s.tp_rank != s.ep_rank)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tp_rank=%d (of %d) and ep_rank=%d (of %d) do not name one rank", s.tp_rank,
                        s.tp_size, s.ep_rank, s.ep_size));
  }
  ShardDims d;
  d.world = W;
  d.rank = s.rank();
  const int tp = s.tp_size, tr = s.tp_rank;
  // Counts of parts a model does not have stay whole.
  d.num_q_heads = c.num_attention_heads;
  d.num_kv_heads = c.num_key_value_heads;
  d.num_k_heads = c.linear_num_key_heads;
  d.num_v_heads = c.linear_num_value_heads;
  d.num_experts = c.num_experts;
  d.moe_i = c.moe_intermediate_size;
  d.shared_i = c.shared_expert_intermediate_size;
  d.dense_i = c.intermediate_size;
  absl::Status st;
  if (c.num_layers_of(LayerType::kFullAttention) > 0) {
    st = SplitHeads(c.num_attention_heads, tp, tr, false, "num_attention_heads", d.q_head0,
                    d.num_q_heads);
    if (!st.ok()) return st;
    st = SplitHeads(c.num_key_value_heads, tp, tr, true, "num_key_value_heads", d.kv_head0,
                    d.num_kv_heads);
    if (!st.ok()) return st;
  }
  if (c.has_linear_attention()) {
    st = SplitHeads(c.linear_num_value_heads, tp, tr, false, "linear_num_value_heads", d.v_head0,
                    d.num_v_heads);
    if (!st.ok()) return st;
    st = SplitHeads(c.linear_num_key_heads, tp, tr, true, "linear_num_key_heads", d.k_head0,
                    d.num_k_heads);
    if (!st.ok()) return st;
  }
  bool any_moe = false, any_dense = false;
  for (MlpType t : c.mlp_types) (t == MlpType::kMoe ? any_moe : any_dense) = true;
  if (any_moe) {
    st = SplitDim(c.shared_expert_intermediate_size, W, d.rank, "shared_expert_intermediate_size",
                  d.shared_i0, d.shared_i);
    if (!st.ok()) return st;
    if (s.ep_size > 1) {
      st = SplitDim(c.num_experts, W, d.rank, "num_experts", d.expert0, d.num_experts);
      if (!st.ok()) return st;
      d.moe_i = c.moe_intermediate_size;
    } else {
      st = SplitDim(c.moe_intermediate_size, W, d.rank, "moe_intermediate_size", d.moe_i0, d.moe_i);
      if (!st.ok()) return st;
    }
  }
  if (any_dense) {
    st = SplitDim(c.intermediate_size, W, d.rank, "intermediate_size", d.dense_i0, d.dense_i);
    if (!st.ok()) return st;
  }
  return d;
}

ModelConfig LocalModelConfig(const ModelConfig& config, const ShardDims& dims) {
  ModelConfig local = config;
  local.num_attention_heads = dims.num_q_heads;
  local.num_key_value_heads = dims.num_kv_heads;
  local.linear_num_key_heads = dims.num_k_heads;
  local.linear_num_value_heads = dims.num_v_heads;
  local.moe_intermediate_size = dims.moe_i;
  local.shared_expert_intermediate_size = dims.shared_i;
  local.intermediate_size = dims.dense_i;
  return local;
}

}  // namespace mobius::worker
