// Iteration-level continuous batching: decides, before every model step, which sequences run and
// how many of their tokens. Decode tokens of running sequences go first; prefill chunks fill the
// rest of the step's token budget (chunked prefill mixed into decode steps). Admission is FCFS
// within priority and bounded by the caches: a sequence needs a DeltaNet state slot and enough
// KV blocks; when the KV cache runs out, the newest, lowest-priority running sequence is
// preempted by recompute (its caches are freed and it goes back to the queue, to re-prefill its
// prompt plus what it has generated) rather than failing anyone.
#ifndef MOBIUS_WORKER_RUNTIME_SCHEDULER_H_
#define MOBIUS_WORKER_RUNTIME_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grammar/structured_output.h"
#include "worker/cache/paged_kv_cache.h"
#include "worker/cache/sequence_cache.h"
#include "worker/cache/state_slot_pool.h"
#include "worker/runtime/prompt_scoring.h"
#include "worker/runtime/sampler.h"
#include "worker/runtime/sampling_params.h"

namespace mobius::worker {

// One request's life inside the worker.
struct Sequence {
  std::string request_id;
  int priority = 0;
  uint64_t arrival = 0;  // admission order, for FCFS
  SamplingParams params;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SequenceCache cache;
  int num_computed = 0;  // tokens of prompt + output already in the caches
  int num_preemptions = 0;
  // Request timeline, for latency metrics.
  absl::Time arrival_time;
  absl::Time first_scheduled_time = absl::InfinitePast();
  absl::Time last_token_time;
  bool cancelled = false;
  std::unique_ptr<RequestSampler> sampler;
  TokenHistory history;
  // prompt_logprobs: the scores of the prompt's tokens 1.. computed so far (entry k - 1 scores
  // token k), delivered with the first output message.
  std::vector<SampledToken> prompt_scores;
  bool prompt_scores_sent = false;
  // Structured output: the request's place in its grammar (null for free text).
  std::unique_ptr<grammar::TokenConstraint> constraint;

  // Whether this sequence's prefill chunks need a logits row per token (to score the prompt).
  [[nodiscard]] bool ScoresPrompt() const {
    return params.prompt_logprobs >= 0 && !prompt_scores_sent;
  }

  // Tokens that must be in the caches before the next token can be sampled.
  [[nodiscard]] int num_tokens() const { return static_cast<int>(prompt.size() + output.size()); }
  [[nodiscard]] int32_t token_at(int i) const {
    return i < static_cast<int>(prompt.size()) ? prompt[i] : output[i - prompt.size()];
  }
};

// The default token budget of one step. At release scale a prefill step costs about the same
// from ~2K tokens up, because it reads every expert of every bank (16 GB a layer); a budget
// that holds a whole max_model_len prompt prefills it in one step. Measured on one H200
// (docs/performance.md, "Serving at release scale: the step token budget"): 8000-token prompts'
// TTFT 691 ms at 2048 against 264 ms at 8192. The cost is longer gaps for running sequences during
// a long prefill.
inline constexpr int kDefaultMaxTokensPerStep = 8192;

struct SchedulerOptions {
  int max_num_seqs = 64;                               // running sequences (each a state slot)
  int max_tokens_per_step = kDefaultMaxTokensPerStep;  // decode tokens + prefill chunks
  // Tokens of a step's chunks that score their prompt (Sequence::ScoresPrompt), each a logits
  // row on the host: bounds those chunks apart from the token budget.
  int max_prompt_score_rows_per_step = kDefaultMaxPromptScoreRowsPerStep;
};

// What one step runs: per sequence, tokens [begin, begin + count) of prompt + output.
struct ScheduledChunk {
  Sequence* sequence = nullptr;
  int begin = 0;
  int count = 0;
  [[nodiscard]] bool completes_prefill() const { return begin + count == sequence->num_tokens(); }
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;
  std::vector<Sequence*> preempted;                 // went back to the queue this step
  std::vector<std::unique_ptr<Sequence>> rejected;  // can never fit; fail them
  [[nodiscard]] bool empty() const { return chunks.empty(); }
  [[nodiscard]] int num_tokens() const;
};

class Scheduler {
 public:
  // The caches must outlive the scheduler; it acquires and releases their slots and blocks.
  Scheduler(const SchedulerOptions& options, PagedKvCache& kv_cache, StateSlotPool& state_slots);

  void Add(std::unique_ptr<Sequence> sequence);
  // Plans the next step and reserves what it needs: every planned sequence holds a state slot
  // and KV blocks for its chunk when this returns. Sequences that can never fit (a prompt longer
  // than the whole KV cache) are returned in `plan.rejected`.
  StepPlan Schedule();
  // Removes a finished or cancelled sequence (running or waiting), frees its caches and returns
  // it; null when unknown.
  std::unique_ptr<Sequence> Remove(const std::string& request_id);
  // Removes every sequence, freeing caches (shutdown without drain).
  std::vector<std::unique_ptr<Sequence>> RemoveAll();

  [[nodiscard]] Sequence* Find(const std::string& request_id);
  [[nodiscard]] int num_running() const { return static_cast<int>(running_.size()); }
  [[nodiscard]] int num_waiting() const { return static_cast<int>(waiting_.size()); }
  [[nodiscard]] const SchedulerOptions& options() const { return options_; }
  [[nodiscard]] int64_t outstanding_tokens() const;
  [[nodiscard]] const std::vector<std::unique_ptr<Sequence>>& running() const { return running_; }

 private:
  // Frees the caches of running_[index] and puts it back at the head of its priority.
  void Preempt(size_t index, StepPlan& plan);
  void InsertWaiting(std::unique_ptr<Sequence> sequence);
  void ReleaseCaches(Sequence& sequence);

  SchedulerOptions options_;
  PagedKvCache& kv_cache_;
  StateSlotPool& state_slots_;
  uint64_t next_arrival_ = 0;
  std::vector<std::unique_ptr<Sequence>> running_;  // in admission order
  std::deque<std::unique_ptr<Sequence>> waiting_;   // sorted: priority desc, arrival asc
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_SCHEDULER_H_
