#include "worker/model/memory_plan.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace mobius::worker {
namespace {

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

}  // namespace

int64_t EstimateStepActivationBytes(const ModelConfig& config, int tokens, int logit_rows,
                                    int activation_bytes) {
  const int64_t t = tokens, a = activation_bytes;
  // Residual, normed and delta streams live through the whole step.
  const int64_t stream = 3 * t * config.hidden_size * a;
  // DeltaNet mixer: projections, conv output, core output and the gated norm's output.
  const int64_t deltanet =
      t * (2 * int64_t{config.conv_dim()} + 3 * int64_t{config.value_dim()}) * a;
  // Attention mixer: q+gate, k, v, q, gate, output.
  const int64_t heads = int64_t{config.num_attention_heads} * config.head_dim;
  const int64_t attention =
      t * (4 * heads + 2 * int64_t{config.num_key_value_heads} * config.head_dim) * a;
  // MoE: fp32 router logits, and per (token, expert) pair the gate/up intermediate and the fp32
  // down output, plus the shared expert.
  const int64_t k = config.num_experts_per_tok;
  const int64_t moe =
      t * (4 * int64_t{config.num_experts} +
           k * (2 * int64_t{config.moe_intermediate_size} * a + 4 * int64_t{config.hidden_size}) +
           2 * int64_t{config.shared_expert_intermediate_size} * a);
  const int64_t logits = 4 * int64_t{logit_rows} * config.vocab_size;
  return stream + std::max({deltanet, attention, moe}) + logits;
}

int64_t EstimateKeptStateInputBytes(const ModelConfig& config, int tokens, int activation_bytes) {
  const int64_t per_token = int64_t{config.conv_dim()} * activation_bytes +
                            2 * 4 * int64_t{config.linear_num_value_heads};
  return int64_t{tokens} * config.num_layers_of(LayerType::kLinearAttention) * per_token;
}

int64_t EstimateStepBytes(const ModelConfig& config, int tokens, int logit_rows,
                          bool keeps_state_inputs, int activation_bytes) {
  const int64_t live =
      EstimateStepActivationBytes(config, tokens, logit_rows, activation_bytes) +
      (keeps_state_inputs ? EstimateKeptStateInputBytes(config, tokens, activation_bytes) : 0);
  // Both allocators round a block up to a quarter-power-of-two bucket (at most 25% more), and a
  // step's many small blocks (ids, weights, metadata) are at least 512 bytes each. Measured on
  // the H200 (docs/cuda-backend.md, "Memory of recorded steps"): a recording took 1.06-1.27x
  // the live estimate.
  return live + live / 4 + (int64_t{1} << 20);
}

std::string MemoryPlan::Summary() const {
  return absl::StrFormat(
      "device memory %.1f GiB, free after loading %.1f GiB; activation reserve %.2f GiB; "
      "KV cache %d blocks x %.2f MiB = %.2f GiB (%d wanted for every sequence at full length); "
      "state slot %.2f MiB per sequence",
      GiB(total_bytes), GiB(free_bytes), GiB(activation_reserve), num_kv_blocks,
      kv_block_bytes / 1048576.0, GiB(num_kv_blocks * kv_block_bytes), max_useful_blocks,
      state_slot_bytes / 1048576.0);
}

absl::StatusOr<MemoryPlan> PlanDeviceMemory(const ModelConfig& config, kernels::Backend& backend,
                                            const MemoryPlanOptions& options) {
  if (options.memory_utilization <= 0 || options.memory_utilization > 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("memory utilization %g is outside (0, 1]", options.memory_utilization));
  }
  if (options.max_num_seqs <= 0 || options.max_model_len <= 0 || options.kv_block_size <= 0) {
    return absl::InvalidArgumentError("max_num_seqs, max_model_len and kv_block_size must be > 0");
  }
  ASSIGN_OR_RETURN(kernels::DeviceMemoryInfo info, backend.MemoryInfo());
  MemoryPlan plan;
  plan.total_bytes = info.total_bytes;
  plan.free_bytes = info.free_bytes;
  const int64_t a = options.activation_bytes;
  plan.kv_block_bytes = int64_t{2} * config.num_layers_of(LayerType::kFullAttention) *
                        options.kv_block_size * config.num_key_value_heads * config.head_dim * a;
  plan.state_slot_bytes =
      int64_t{4} * config.num_layers_of(LayerType::kLinearAttention) *
      (int64_t{config.conv_dim()} * std::max(0, config.linear_conv_kernel_dim - 1) +
       int64_t{config.linear_num_value_heads} * config.linear_key_head_dim *
           config.linear_value_head_dim);
  // The largest step: the token budget, plus every running sequence's drafts on top of it (a
  // verify chunk is scheduled as one token), with a logits row per sequence and per draft, and
  // the rows of prompts being scored (prompt_logprobs).
  const int64_t spec = std::max(0, options.spec_tokens);
  // A budget beyond what max_num_seqs sequences of max_model_len could ever fill is not planned.
  const int64_t budget = std::min<int64_t>(options.max_tokens_per_step,
                                           int64_t{options.max_num_seqs} * options.max_model_len);
  const int64_t step_tokens = budget + options.max_num_seqs * spec;
  const int64_t logit_rows =
      options.max_num_seqs * (1 + spec) + std::max(0, options.prompt_score_rows);
  if (step_tokens > std::numeric_limits<int>::max() ||
      logit_rows > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_tokens_per_step %d + max_num_seqs %d x spec_tokens %d is too large a step",
        options.max_tokens_per_step, options.max_num_seqs, options.spec_tokens));
  }
  // Twice the largest step (the block cache keeps an op-by-op step's freed blocks, and recorded
  // steps have a pool of their own) plus 1 GiB for library workspaces and fragmentation.
  plan.activation_reserve =
      2 * EstimateStepBytes(config, static_cast<int>(step_tokens), static_cast<int>(logit_rows),
                            spec > 0, options.activation_bytes) +
      (int64_t{1} << 30);
  const int64_t blocks_per_seq =
      (int64_t{options.max_model_len} + options.kv_block_size - 1) / options.kv_block_size;
  plan.max_useful_blocks = blocks_per_seq * options.max_num_seqs;
  // What this worker may still take: its share of the device minus what is already in use.
  const int64_t used = info.total_bytes - info.free_bytes;
  const int64_t allowed =
      static_cast<int64_t>(options.memory_utilization * static_cast<double>(info.total_bytes)) -
      used;
  const int64_t for_kv =
      allowed - plan.activation_reserve -
      plan.state_slot_bytes * (options.max_num_seqs + std::max(0, options.extra_state_slots));
  const int64_t fit = plan.kv_block_bytes > 0 ? std::max<int64_t>(0, for_kv) / plan.kv_block_bytes
                                              : plan.max_useful_blocks;
  plan.num_kv_blocks = std::min(fit, plan.max_useful_blocks);
  if (plan.num_kv_blocks < blocks_per_seq) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "not enough device memory for one sequence of max_model_len %d: %d KV blocks fit, %d "
        "needed (%s); lower max_model_len or max_num_seqs, or raise the memory utilization",
        options.max_model_len, plan.num_kv_blocks, blocks_per_seq, plan.Summary()));
  }
  return plan;
}

}  // namespace mobius::worker
