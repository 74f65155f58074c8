// The performance model of a step: the bytes it must read from memory and the matrix FLOPs it
// must compute. Decode is bandwidth-bound, so bytes / HBM bandwidth is the time bound decode
// benchmarks are reported against; a long prefill also does enough arithmetic that the FLOPs /
// matrix rate bound and the serial bound below tell where its floor is
// (docs/performance-model.md explains each term).
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
  int context = 0;  // tokens already cached per sequence
  // Rows the lm_head computes (0: one per sequence, the last token's, as a step does unless it
  // is asked for every token's logits).
  int logits_rows = 0;
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

// The multiply-adds of a step (2 FLOPs each), by the kind of work, term for term beside
// DecodeStepBytes: the matrix products a tensor-core backend runs, plus the delta rule's
// recurrence. Element-wise work (norms, the conv, gates, routing) is left out: it is small and
// bandwidth-bound.
struct DecodeStepFlops {
  double dense_projections = 0;  // mixer in/out projections, router, shared expert: 2 per weight
                                 // per token
  double lm_head = 0;            // 2 x vocab x hidden per logits row
  double routed_experts = 0;     // 2 x 3 x intermediate x hidden per (token, expert) pair
  double attention = 0;          // QK^T and PV: 4 x heads x head_dim per (query, position seen)
  double delta_rule = 0;         // 7 x Dk x Dv per (token, value head): the recurrence's work
  [[nodiscard]] double total() const {
    return dense_projections + lm_head + routed_experts + attention + delta_rule;
  }
};

// The step's tokens are split evenly over its sequences (batch / sequences each), each sequence
// attending to its context and its own earlier tokens of the step.
[[nodiscard]] DecodeStepFlops EstimateDecodeStepFlops(const ModelConfig& config,
                                                      const DecodeCostOptions& options);

// A step's time bounds, in seconds, from its bytes and FLOPs on a machine that moves `bandwidth`
// bytes/s and multiplies at `matrix_rate` FLOP/s.
struct StepBound {
  double bytes = 0;  // every byte at the bandwidth
  double flops = 0;  // every FLOP at the matrix rate
  // The roofline: the step can be no faster than either. Benchmarks report against it.
  [[nodiscard]] double roofline() const { return bytes > flops ? bytes : flops; }
  // Each kind of work at its own limit, summed: dense projections (with the embedding rows),
  // lm_head, routed experts, attention (with the KV cache), delta rule (with the recurrent
  // state). Summing each kind's limit is never more than summing each operation's, so this is a
  // lower bound for an implementation that runs one operation after another, as a forward pass
  // must where each layer's experts need its mixer's output (not a limit of the hardware). Where
  // some kinds are compute-bound and others bandwidth-bound (a long prefill) it exceeds the
  // roofline.
  double serial = 0;
};

[[nodiscard]] StepBound BoundStep(const DecodeStepBytes& bytes, const DecodeStepFlops& flops,
                                  double bandwidth, double matrix_rate);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_DECODE_COST_H_
