// The worker's engine seam: requests in, token streams out. One engine thread runs the loop
// schedule -> forward -> sample -> emit; servers call Enqueue / Cancel from any thread and get
// outputs through a callback (run on the engine thread: keep it short and non-blocking).
#ifndef MOBIUS_WORKER_RUNTIME_ENGINE_H_
#define MOBIUS_WORKER_RUNTIME_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grammar/structured_output.h"
#include "worker/model/hybrid_model.h"
#include "worker/runtime/engine_metrics.h"
#include "worker/runtime/sampler.h"
#include "worker/runtime/scheduler.h"
#include "worker/runtime/speculative_decoder.h"
#include "worker/runtime/speculative_sampling.h"

namespace mobius::worker {

enum class FinishReason { kNone, kStop, kLength, kAbort, kError };

struct GenerationRequest {
  std::string request_id;
  std::vector<int32_t> prompt;
  SamplingParams params;
  int priority = 0;
};

// One message of a request's stream. The last one has finish != kNone.
struct GenerationOutput {
  std::vector<int32_t> tokens;         // new tokens since the previous message
  std::vector<SampledToken> logprobs;  // per new token when requested
  // prompt_logprobs, in the first message only (which has no token when max_tokens is 0):
  // prompt_logprobs[i] scores prompt token i + 1 (ScorePromptToken).
  std::vector<SampledToken> prompt_logprobs;
  FinishReason finish = FinishReason::kNone;
  std::optional<int32_t> matched_stop_token;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  absl::Status error;  // set with kError
};

using OutputCallback = std::function<void(const GenerationOutput&)>;

struct EngineOptions {
  SchedulerOptions scheduler;
  int max_model_len = 4096;  // prompt + output tokens per sequence
  int kv_block_size = 16;
  int num_kv_blocks = 0;  // 0: enough for max_num_seqs * max_model_len
  std::vector<int32_t> eos_token_ids;
  uint64_t seed = 0;                  // seeds requests that bring no seed of their own
  EngineMetrics* metrics = nullptr;   // optional; must outlive the engine
  int expert_load_sample_every = 16;  // count expert load every N steps (0: never)
  // Speculative decoding: up to `spec_tokens` drafts per decoding sequence and step from
  // `drafter` (not owned; the MTP head in the worker), verified in the same target forward as
  // the step's other sequences. Sequences that ask for logprobs decode without drafts. Each
  // speculating sequence holds a second state slot (where its verify steps write its states, so
  // that rejected drafts roll back without a copy).
  int spec_tokens = 0;
  Drafter* drafter = nullptr;
  // Where sampled tokens are drawn. kAuto: by the backend (Backend::PenalizeRows, SampleRows and
  // for top-n logprobs TopLogitsRows) when it draws on the device and the step verifies no
  // drafts; steps with drafts copy every logits row. kHost: always on the host from a copy of
  // the logits. kBackend: as kAuto on any backend (tests: the CPU backend's ops go through the
  // host).
  enum class SamplingPlace { kAuto, kHost, kBackend };
  SamplingPlace sampling_place = SamplingPlace::kAuto;
  // The tokens' bytes (the model's tokenizer), for structured output; without them requests
  // that ask for it fail with FailedPrecondition.
  std::shared_ptr<const grammar::TokenVocabulary> vocabulary;
  // Test hook: a pause after every step that did work, so that process tests can make a step
  // long enough to tell "freed within one step" from "freed a few steps later".
  absl::Duration debug_step_delay = absl::ZeroDuration();
};

struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  int64_t outstanding_tokens = 0;
  float kv_cache_usage = 0;
  float state_slot_usage = 0;
  int64_t num_preemptions = 0;
  int64_t steps = 0;
  // Drafts of sampled requests checked by Backend::SampleRows (their rows stayed on the device)
  // rather than on the host.
  int64_t drafts_checked_on_backend = 0;
};

class Engine {
 public:
  // Creates the model's caches and starts the engine thread. The model must outlive the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(HybridModel& model,
                                                        const EngineOptions& options);
  ~Engine();

  // Validates and queues a request. InvalidArgument for bad prompts or parameters,
  // AlreadyExists for a duplicate id, Unavailable after Shutdown.
  absl::Status Enqueue(GenerationRequest request, OutputCallback callback);
  // Cancels a request; its slot is freed at the next step and its stream ends with kAbort.
  // Returns false when the id is unknown (already finished).
  bool Cancel(const std::string& request_id);
  // Stops accepting requests; with `drain`, finishes the ones in flight first.
  void Shutdown(bool drain);
  [[nodiscard]] EngineStats GetStats();
  // The sampled (token, expert) counts so far, per bank and expert id of the checkpoint (a
  // placement's order mapped back), summed over the layers that share a bank and, under expert
  // parallelism, over the ranks: the input of --expert-placement load-aware. Steps sampled so
  // far in `sampled_steps`.
  struct ExpertLoads {
    std::vector<std::vector<int64_t>> banks;
    int64_t sampled_steps = 0;
  };
  [[nodiscard]] ExpertLoads GetExpertLoads();

  // Load-aware expert placement on request, without a restart (issue 5): balances the loads
  // sampled so far over the expert-parallel ranks (ExpertPlacement::BalanceLoads) and applies
  // the placement on every rank between two steps; requests in flight continue with identical
  // outputs. Blocks until applied. FailedPrecondition without expert parallelism or before any
  // load was sampled; Unavailable once the engine stops.
  struct PlacementReport {
    int ranks = 0;
    int64_t sampled_steps = 0;
    double imbalance_before = 1;  // max / mean rank load under the old and new placement
    double imbalance_after = 1;
    int64_t experts_moved = 0;  // experts whose primary rank changed, over every bank
    int replicas_per_rank = 0;  // replicated hot experts per rank and bank
  };
  // `replicas_per_rank` > 0 also replicates the hottest experts (ExpertPlacement::BalanceLoads).
  absl::StatusOr<PlacementReport> RebalanceExperts(int replicas_per_rank = 0);

 private:
  Engine(HybridModel& model, const EngineOptions& options);
  void Loop();
  // The engine thread's half of RebalanceExperts.
  absl::StatusOr<PlacementReport> Rebalance(int replicas_per_rank);
  // Runs one scheduled step; returns false when there was nothing to do.
  bool Step();
  // Copies the scheduler's and caches' state into stats_ for GetStats.
  void PublishStats();
  void Finish(Sequence& seq, FinishReason reason, std::optional<int32_t> stop,
              absl::Status error = absl::OkStatus());
  void RecordFinish(const Sequence& seq, FinishReason reason);

  // Samples the given (chunk, row of `logits`) pairs on the host with each chunk's sampler, rows
  // spread over threads; nullopt for the other chunks.
  std::vector<std::optional<SampledToken>> SampleRows(
      const StepPlan& plan, const std::vector<std::pair<size_t, int64_t>>& rows,
      std::vector<float>& logits, int vocab);

  // Scores the prompt tokens whose logits rows this step computed (a row per token of the chunks
  // of sequences that ScoresPrompt, the last at own_row[i]), rows spread over threads, into
  // Sequence::prompt_scores.
  void ScorePromptRows(const StepPlan& plan, const std::vector<int64_t>& own_row,
                       const std::vector<float>& logits, int vocab);

  // Verifies the drafts of the given (chunk, first logits row) pairs against their sequences'
  // samplers (VerifyDraftsWithSampler), chunks spread over threads; nullopt for the other chunks.
  std::vector<std::optional<DraftVerdict>> VerifySampledDrafts(
      const StepPlan& plan, const std::vector<std::vector<int32_t>>& drafts,
      const std::vector<std::pair<size_t, int64_t>>& chunks, std::vector<float>& logits, int vocab);

  // ---- speculative decoding (engine thread) ----
  // Whether `seq` may carry drafts (and so needs the drafter to see its committed tokens).
  [[nodiscard]] bool Speculates(const Sequence& seq) const;
  // Drafts for the step's decoding sequences; appends them to `tokens` (k per chunk in `drafts`)
  // after reserving their KV positions and spare state slots; a chunk that cannot get either
  // decodes plainly.
  absl::Status DraftForStep(const StepPlan& plan, std::vector<std::vector<int32_t>>& tokens,
                            std::vector<std::vector<int32_t>>& drafts);
  // Frees a sequence's spare state slot and the drafter's state for it (finished, preempted).
  void ForgetSpeculation(Sequence& seq);
  // scheduler_->Remove, and ForgetSpeculation of what it removed.
  std::unique_ptr<Sequence> RemoveSequence(const std::string& request_id);

  HybridModel& model_;
  EngineOptions options_;
  std::unique_ptr<Scheduler> scheduler_;  // engine thread only
  int64_t step_index_ = 0;                // engine thread only
  // Compiled structured-output grammars, shared by the requests that ask the same.
  grammar::GrammarCache grammar_cache_;
  // Spare state slots of speculating sequences (a verify step writes the states there), by
  // arrival number (engine thread only).
  absl::flat_hash_map<uint64_t, SequenceCache> spare_slots_;

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Sequence>> incoming_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> cancelled_ ABSL_GUARDED_BY(mu_);
  // Work for the engine thread between steps (RebalanceExperts); each gets OK or why not.
  std::vector<std::function<void(absl::Status)>> tasks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, OutputCallback> callbacks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  ExpertLoads expert_loads_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_RUNTIME_ENGINE_H_
