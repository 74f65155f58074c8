// The performance model of a decode step: the bytes it must read from memory. Decode is
// bandwidth-bound, so bytes / HBM bandwidth is the time bound every benchmark is reported
// against (docs/performance-model.md explains each term).
#ifndef MOBIUS_WORKER_MODEL_DECODE_COST_H_
#define MOBIUS_WORKER_MODEL_DECODE_COST_H_

#include <cstdint>
#include <vector>

#include "worker/model/model_config.h"

namespace mobius::worker {

struct DecodeStepBytes {
  double dense_weights = 0;  // every mixer, norm, router and shared-expert weight
  double lm_head = 0;
  double embedding_rows = 0;  // one row per sequence
  double routed_experts = 0;  // distinct experts touched, per MoE layer
  double distinct_experts_per_layer = 0;
  double kv_cache = 0;         // attention K/V read for the context (+ the new entries written)
  double recurrent_state = 0;  // DeltaNet conv + delta-rule state, read and written
  [[nodiscard]] double total() const {
    return dense_weights + lm_head + embedding_rows + routed_experts + kv_cache + recurrent_state;
  }
};

struct DecodeCostOptions {
  int batch = 1;  // tokens in the step (one per sequence when decoding)
  // Sequences the tokens belong to (0: `batch`, the decode case). A prefill step of one
  // sequence's N tokens has batch N and 1 sequence: its DeltaNet state is read and written once.
  int sequences = 0;
  int context = 0;       // tokens already cached per sequence
  int weight_bytes = 2;  // bf16
  int kv_bytes = 2;      // bf16 KV cache
  int state_bytes = 4;   // fp32 recurrent state
  // Distinct experts touched per MoE layer; <= 0 assumes uniform routing:
  // E * (1 - (1 - k/E)^batch), the expectation when each token picks k of E at random.
  double distinct_experts = 0;
};

// The mean number of distinct experts a step touched per MoE layer, from its per-layer
// (token, expert) counts (ForwardOptions::expert_tokens; layers without a MoE are empty).
[[nodiscard]] double MeanDistinctExperts(const std::vector<std::vector<int64_t>>& expert_tokens);

[[nodiscard]] DecodeStepBytes EstimateDecodeStepBytes(const ModelConfig& config,
                                                      const DecodeCostOptions& options);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_DECODE_COST_H_
