// Device-memory planning at start-up: after the weights are loaded, how many paged-KV blocks
// fit in what is left, next to the DeltaNet state slots and the step's activations. The plan
// is logged at start so that an operator sees where the GPU's memory went.
#ifndef MOBIUS_WORKER_MODEL_MEMORY_PLAN_H_
#define MOBIUS_WORKER_MODEL_MEMORY_PLAN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/model/model_config.h"

namespace mobius::worker {

struct MemoryPlanOptions {
  int max_num_seqs = 64;            // state slots (one per running sequence)
  int extra_state_slots = 0;        // speculative decoding's spare slots
  int max_model_len = 8192;         // longest sequence
  int kv_block_size = 16;           // positions per KV block
  int max_tokens_per_step = 8192;   // sizes the activation reserve (the scheduler's budget)
  int spec_tokens = 0;              // MTP drafts per sequence and step (verify steps carry them
                                    // beside the token budget, and keep their DeltaNet inputs)
  int prompt_score_rows = 0;        // logits rows a step may add to score prompts
                                    // (SchedulerOptions::max_prompt_score_rows_per_step)
  double memory_utilization = 0.9;  // share of the device's total memory the worker may use
  int activation_bytes = 2;         // bf16 activations and KV entries
};

struct MemoryPlan {
  int64_t total_bytes = 0;         // the device's memory
  int64_t free_bytes = 0;          // free when planning (weights already loaded)
  int64_t kv_block_bytes = 0;      // one block, every attention layer, keys and values
  int64_t state_slot_bytes = 0;    // one sequence's conv + recurrent states, every DeltaNet layer
  int64_t activation_reserve = 0;  // kept free for a step's intermediates and recorded steps
  int64_t num_kv_blocks = 0;       // blocks to create
  int64_t max_useful_blocks = 0;   // max_num_seqs sequences of max_model_len
  [[nodiscard]] std::string Summary() const;
};

// Plans from the backend's memory report (Backend::MemoryInfo). ResourceExhausted, with the
// numbers, when not even one sequence of max_model_len fits; Unimplemented on backends without
// device memory (the CPU: callers then size the cache from the options alone).
absl::StatusOr<MemoryPlan> PlanDeviceMemory(const ModelConfig& config, kernels::Backend& backend,
                                            const MemoryPlanOptions& options);

// Bytes of a step's intermediates for `tokens` tokens (the largest live set of one layer plus
// fp32 logits of `logit_rows` rows).
int64_t EstimateStepActivationBytes(const ModelConfig& config, int tokens, int logit_rows,
                                    int activation_bytes);

// Bytes a speculative verify step of `tokens` tokens keeps until the next step to roll rejected
// drafts back (ForwardOptions::keep_state_inputs): every DeltaNet layer's conv input, decay and
// beta.
int64_t EstimateKeptStateInputBytes(const ModelConfig& config, int tokens, int activation_bytes);

// What one step of `tokens` tokens needs, whether it runs op by op (the block cache) or recorded
// (the capture pool): its intermediates and, for a verify step (`keeps_state_inputs`), the
// kept DeltaNet inputs. MemoryPlan::activation_reserve holds two of the largest (one in each).
int64_t EstimateStepBytes(const ModelConfig& config, int tokens, int logit_rows,
                          bool keeps_state_inputs, int activation_bytes);

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_MEMORY_PLAN_H_
