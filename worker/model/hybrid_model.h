// The forward pass of the hybrid Gated-DeltaNet + gated-attention MoE model over a ragged batch:
// several sequences per step, each a prefill chunk of any length (continuing from its cached
// state) or one decode token. This is the interface the scheduler drives.
#ifndef MOBIUS_WORKER_MODEL_HYBRID_MODEL_H_
#define MOBIUS_WORKER_MODEL_HYBRID_MODEL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "worker/cache/paged_kv_cache.h"
#include "worker/cache/sequence_cache.h"
#include "worker/cache/state_slot_pool.h"
#include "worker/model/model_config.h"
#include "worker/model/model_weights.h"
#include "worker/model/replica_followers.h"
#include "worker/model/shard_spec.h"

namespace mobius::worker {

class Communicator;  // worker/distributed/communicator.h

// One sequence's share of a step.
struct SequenceStep {
  std::span<const int32_t> tokens;  // new tokens, at positions cache->num_tokens ...
  SequenceCache* cache = nullptr;   // advanced by tokens.size() on success
  // -1: the step updates the sequence's DeltaNet states in cache->state_slot. Otherwise another
  // slot (held by the caller, used by no other sequence of the step) receives them and
  // cache->state_slot keeps the states from before the step: a speculative verify step writes to
  // the sequence's spare slot, keeps that slot when every draft is accepted and replays the
  // accepted tokens onto the untouched one otherwise, with no snapshot copy.
  int32_t state_out_slot = -1;
};

enum class LogitsMode {
  kLastToken,  // one row per sequence: its last token of the step
  kAllTokens,  // one row per token, in packing order
};

struct ForwardOptions {
  LogitsMode logits = LogitsMode::kLastToken;
  // When non-empty (one entry per sequence of the step, each in [1, its tokens]): the logits rows
  // are each sequence's last logits_rows[s] tokens, in packing order, instead of `logits`. A
  // speculative step asks for k + 1 rows of a verifying sequence and one of a prefill chunk.
  std::vector<int> logits_rows;
  kernels::DeltaRuleAlgorithm delta_rule = kernels::DeltaRuleAlgorithm::kAuto;
  // When set ([num_hidden_layers][num_experts]), the (token, expert) assignments of every MoE
  // layer are added to that layer's counts (bank of layer i: ModelConfig::BankOfLayer). On a GPU
  // this costs a device synchronisation per layer, so callers sample it. Under expert
  // parallelism each rank counts its own experts and Forward sums the counts over the ranks
  // (every rank must then ask for them in the same step: followers do through the step plan).
  std::vector<std::vector<int64_t>>* expert_tokens = nullptr;
  // False: the logits stay on the device (`logits` comes back empty); the step is still
  // finished (synchronised) when Forward returns. Benchmarks time the model alone this way.
  bool copy_logits = true;
  // When set, receives the argmax token of every logits row (greedy decoding), computed on the
  // device: only the token ids come back, `logits` comes back empty.
  std::vector<int32_t>* greedy_tokens = nullptr;
  // When set, receives a token of every logits row drawn on the backend (Backend::SampleRows)
  // under sampling_rules[r] with sampling_uniforms[r] (one per row), and `logits` comes back
  // empty: token ids cross to the host instead of [rows, vocab] logits.
  std::vector<kernels::DrawnToken>* sampled_tokens = nullptr;
  std::span<const kernels::SamplingRule> sampling_rules;
  std::span<const double> sampling_uniforms;
  // With sampled_tokens: empty, or each row's penalties (one per row), applied to the row on the
  // backend before its draw (Backend::PenalizeRows).
  std::span<const kernels::LogitPenalties> sampling_penalties;
  // With sampled_tokens: empty (plain draws), or each row's mode in a speculative verify step
  // (Backend::SampleRows' drafts: kernels::kPlainDraw, or the draft the row checks).
  std::span<const int32_t> sampling_drafts;
  // With sampled_tokens: empty, or the number of top-n alternatives each row asks for (0 to
  // kMaxTopLogprobs; 0: none). Then top_logits receives each row's best (token, logit) pairs,
  // packed [rows, largest count], and drawn_logits each row's drawn token's logit, both after
  // the penalties (Backend::TopLogitsRows): the sampler's top-n logprobs, without the rows.
  std::span<const int32_t> top_logits_counts;
  std::vector<kernels::TokenLogit>* top_logits = nullptr;
  std::vector<float>* drawn_logits = nullptr;
  // When set, receives the final post-norm hidden states of the logits rows, float32 [rows, H]
  // (what the MTP draft head reads as h_prev), or of every token with `hidden_all_tokens`. Such
  // steps run op by op, except verify steps and an MTP head's one-token steps, which are recorded
  // with their hidden rows.
  std::vector<float>* hidden_out = nullptr;
  bool hidden_all_tokens = false;
  // MTP draft head only (a model made by MakeMtpDraftModel): the hidden state h_prev paired with
  // each token of the step, float32 [tokens, H] in packing order. The step's input is then
  // fc([RMSNorm1p_e(embed(token)); RMSNorm1p_h(h_prev)]) (MODEL.md section 6) instead of the
  // embedding alone.
  const std::vector<float>* draft_hidden_in = nullptr;
  // Keep every DeltaNet layer's state inputs of this step (pre-conv projections, gates) until the
  // next Forward, for ReplayStateInputs: a speculative verify step does, so that rolling back past
  // rejected drafts replays the state updates of the accepted tokens instead of a whole forward.
  bool keep_state_inputs = false;
  // When set, called once after the step's work is queued on the backend and before any output
  // is read: before the sampling inputs above are used (their spans keep their sizes; their
  // contents may change in the call) and before the logits are copied. What it does on the host
  // then overlaps the device's step: the engine computes its structured-output masks there.
  // Not called when the step fails before its outputs.
  std::function<void()> before_outputs;
};

// Accepted tokens of the last Forward (kept with keep_state_inputs) to apply again to a
// sequence's DeltaNet state from before that step (the slot the step only read): rows [first_row,
// first_row + num_tokens) of that step's packed tokens, at positions cache->num_tokens onward.
struct StateReplay {
  SequenceCache* cache = nullptr;  // advanced by num_tokens on success
  int first_row = 0;
  int num_tokens = 0;
};

class HybridModel {
 public:
  // `weights` must have been made for `config` (LoadCheckpointWeights / CreateDummyWeights).
  // A rank of a tensor/expert-parallel replica passes its `shard` (the one its weights were made
  // for) and the replica's communicator (rank() == shard.rank()); every rank then runs the same
  // Forward calls with the same batches, and each gets the full logits.
  HybridModel(ModelConfig config, ModelWeights weights, kernels::Backend& backend,
              ShardSpec shard = {}, Communicator* comm = nullptr);

  // Sequence parallel (sharded models with tp = every rank): the residual stream, norms and
  // residual adds run on this rank's 1/W of the step's tokens (padded to a multiple of W);
  // all-gather before each mixer and feed-forward, reduce-scatter after, instead of all-reduce.
  absl::Status SetSequenceParallel(bool on);
  [[nodiscard]] bool sequence_parallel() const { return sequence_parallel_; }
  [[nodiscard]] const ShardSpec& shard() const { return shard_; }
  // The config as this rank sees it: local head counts and intermediate sizes.
  [[nodiscard]] const ModelConfig& local_config() const { return local_; }

  // Creates caches: `max_sequences` state slots and KV blocks of `block_size` positions, enough
  // for max_sequences sequences of max_tokens tokens unless `num_kv_blocks` > 0 says otherwise.
  absl::Status CreateCaches(int max_sequences, int max_tokens, int block_size = 16,
                            int num_kv_blocks = 0);

  // Frees the caches (every sequence's state is lost), e.g. before re-creating them larger.
  // Recorded decode steps point at them, so they go too.
  void DropCaches() {
    decode_graphs_.clear();
    unrecordable_.clear();
    kv_cache_.reset();
    state_slots_.reset();
  }

  // Records decode-only steps of up to `max_batch` sequences (one token each) the first time
  // each batch size is seen, and replays the recording afterwards (CUDA graphs: one launch
  // instead of hundreds). Speculative verify steps where every sequence has the same 2..8
  // tokens and every token's logits are wanted are recorded the same way, per (batch, tokens).
  // 0 turns it off; backends that cannot record ignore it. Steps that count expert tokens, or
  // that prefill, always run op by op.
  void SetDecodeCapture(int max_batch) {
    decode_capture_max_batch_ = max_batch;
    decode_graphs_.clear();
    unrecordable_.clear();
    capture_error_ = absl::OkStatus();
  }
  [[nodiscard]] int decode_capture_max_batch() const { return decode_capture_max_batch_; }
  // Why the last recording failed (OK if it succeeded, or none was tried since the caches or
  // SetDecodeCapture). A recording that ran out of device memory (also after the allocator's
  // cached blocks were returned) leaves only its own shape (sequences, tokens each) to run op by
  // op; any other failure stops recording.
  [[nodiscard]] const absl::Status& capture_error() const { return capture_error_; }
  // Batch sizes with a recorded decode step.
  [[nodiscard]] int num_decode_graphs() const { return static_cast<int>(decode_graphs_.size()); }
  // Shapes (sequences, tokens each) whose recording ran out of device memory: op by op.
  [[nodiscard]] const std::set<std::pair<int, int>>& unrecordable_shapes() const {
    return unrecordable_;
  }
  // Whether steps of `sequences` sequences of `tokens` tokens each replay a recording.
  [[nodiscard]] bool HasRecording(int sequences, int tokens) const {
    return decode_graphs_.contains({sequences, tokens});
  }
  // Recorded steps with `tokens` tokens per sequence (1: decode; more: speculative verify).
  [[nodiscard]] int num_recorded_steps(int tokens) const {
    int n = 0;
    for (const auto& [key, graph] : decode_graphs_) n += key.second == tokens;
    return n;
  }

  // True when the backend draws sampled tokens on the device (ForwardOptions::sampled_tokens)
  // rather than through a copy of the logits.
  [[nodiscard]] bool samples_on_device() const { return backend_.SamplesOnDevice(); }

  // Gives `seq` a fresh state slot. Free with ReleaseSequence.
  absl::Status StartSequence(SequenceCache& seq);
  void ReleaseSequence(SequenceCache& seq);
  // Copies the DeltaNet state (conv and recurrent, every layer) of slot `from` into slot `to`
  // (speculative decoding needs no copy: its verify steps write to a spare slot, see
  // SequenceStep::state_out_slot). Queued on the backend. A leader rank first hands it
  // to its followers (every rank holds a shard of the state); a sharded model's ranks then share
  // the outcome (one small all-reduce and a host wait), so a copy that failed on one rank fails
  // on all.
  absl::Status CopyStateSlot(int32_t from, int32_t to) {
    return CopyStateSlots(std::span(&from, 1), std::span(&to, 1));
  }
  // Every copy from[i] -> to[i] of a step at once (one backend call per state tensor); no slot in
  // `to` may appear in `from`.
  absl::Status CopyStateSlots(std::span<const int32_t> from, std::span<const int32_t> to);
  // Re-applies the kept state inputs of the last Forward (keep_state_inputs) for `replays`: for
  // every DeltaNet layer, the causal conv and the delta rule over those tokens (outputs not
  // formed; Backend::ReplayDeltaRuleStates, one launch on the GPU), so a state slot that the step
  // only read (SequenceStep::state_out_slot) reaches the state after the accepted tokens without
  // running the model.
  // Attention KV entries of those positions are already right (the verify step wrote them). A
  // leader rank first hands it to its followers, and a sharded model's ranks then share the
  // outcome (one small all-reduce), as after CopyStateSlots.
  absl::Status ReplayStateInputs(std::span<const StateReplay> replays);

  // Runs one step. Validates every token id against the vocabulary and every position against
  // max_position_embeddings before touching any state (InvalidArgument naming the sequence,
  // index and value), reserves KV blocks (ResourceExhausted when out of blocks), and writes
  // float32 logits, [rows, vocab] row-major, to `logits`.
  absl::Status Forward(std::span<SequenceStep> batch, const ForwardOptions& options,
                       std::vector<float>& logits);

  // ---- a replica over several processes (issue 5) ----
  // Leader rank: every CreateCaches and Forward is first handed to `followers` (not owned; null
  // detaches), which repeat them on the other ranks. hidden_out stays the leader's; with
  // expert parallelism expert_tokens is counted on every rank and summed over them.
  void SetFollowers(ReplicaFollowers* followers) { followers_ = followers; }
  // ---- expert placement on request (issue 5) ----
  // How this rank's routed banks are (re)loaded for a shard: LoadHybridModel sets it (same
  // checkpoint or dummy seed as the first load).
  using BankLoader =
      std::function<absl::StatusOr<std::vector<ExpertBankWeights>>(const ShardSpec& shard)>;
  void SetBankLoader(BankLoader loader) { bank_loader_ = std::move(loader); }
  // Moves to `placement` without a restart: the followers first (the leader's call), then this
  // rank reloads the experts it holds under it and the routers' row order, between steps. The
  // function stays the same (outputs identical up to top-k ties); which rank computes which
  // expert changes. Recorded decode steps are dropped (they point at the old weights). While it
  // runs, this rank holds its old and new banks. FailedPrecondition without a bank loader;
  // InvalidArgument for a placement that does not fit the model.
  absl::Status ApplyExpertPlacement(std::shared_ptr<const ExpertPlacement> placement);

  // Follower rank: repeats one of the leader's steps on this rank's shard (zeroes the state slots
  // of sequences at position 0, then runs the sequences with the plan's block tables and slots).
  absl::Status ExecutePlan(const ReplicaStepPlan& plan);
  // True when the last Forward, CopyStateSlots or ReplayStateInputs of a sharded model failed on
  // every rank together: some rank could not run it on its own (a tensor or an op's memory did
  // not fit) and still took part in all of its collectives, so the group is still in step and
  // can run the next call. False after a success, an error found before the leader told the
  // other ranks, or a failure of the group itself (a collective's error, or a rank that could
  // not allocate the step's residual stream and so aborted the communicator).
  [[nodiscard]] bool last_call_failed_together() const { return last_call_failed_together_; }

  [[nodiscard]] const ModelConfig& config() const { return config_; }
  [[nodiscard]] int num_banks() const { return static_cast<int>(weights_.banks.size()); }
  [[nodiscard]] const ModelWeights& weights() const { return weights_; }
  [[nodiscard]] kernels::Backend& backend() const { return backend_; }
  [[nodiscard]] PagedKvCache* kv_cache() { return kv_cache_.get(); }
  [[nodiscard]] StateSlotPool* state_slots() { return state_slots_.get(); }

 private:
  struct StepContext;
  // The last Forward's DeltaNet state inputs of one DeltaNet layer (keep_state_inputs).
  struct KeptStateInputs {
    kernels::Tensor mixed;  // [T, conv_dim], before the conv
    kernels::Tensor g;      // [T, Hv] f32
    kernels::Tensor beta;   // [T, Hv] f32
  };
  // A recorded step and the (capture-pool) tensors its replay leaves the logits, the hidden rows
  // and the kept DeltaNet state inputs in.
  struct DecodeGraph {
    std::unique_ptr<kernels::CapturedStep> step;
    kernels::Tensor logits;
    kernels::Tensor hidden_rows;
    std::vector<KeptStateInputs> kept;
  };

  // Queues the whole step (embedding to lm_head) and returns the logits tensor [rows, lm_head
  // rows] (the vocabulary, or an MTP head's draft vocabulary).
  absl::StatusOr<kernels::Tensor> QueueStep(StepContext& ctx, std::span<const int32_t> ids);
  // The lm_head over the rows the step's options select of the final normalised hidden states.
  absl::StatusOr<kernels::Tensor> Logits(StepContext& ctx, const kernels::Tensor& final_normed);
  // The step's outputs from its logits `out` (penalised in place): greedy or sampled tokens, the
  // logits on the host, the hidden rows.
  absl::Status WriteStepOutputs(StepContext& ctx, kernels::Tensor& out, std::vector<float>& logits);
  // Sharded steps: an all-reduce gives every rank each rank's status code for the step. Returns
  // the group's status for the step (OK, or the first failed rank's code, naming the rank), or
  // the collective's own error (the group itself failed).
  absl::StatusOr<absl::Status> ShareStepStatus(const absl::Status& status,
                                               absl::string_view what = "step");
  // The end of a sharded model's Forward, CopyStateSlots or ReplayStateInputs once every rank
  // runs it: `local` (this rank's outcome) shared through ShareStepStatus, so that a call that
  // failed on one rank fails on every rank and the group stays in step (sets
  // last_call_failed_together). Returns `local` where it failed, else the group's error.
  // Unsharded: `local`.
  absl::Status ShareCallStatus(absl::Status local, absl::string_view what);
  // Runs a decode step through its recording (recording it after running it op by op the first
  // time). Returns the logits tensor.
  // Expert parallelism: sums every rank's (token, expert) counts of the step over the ranks.
  absl::Status SumExpertCounts(std::vector<std::vector<int64_t>>& counts);
  absl::StatusOr<kernels::Tensor> RunDecodeGraph(StepContext& ctx, std::span<const int32_t> ids);

  // An MTP draft step's h_prev into draft_hidden_ (rows [0, tokens)), before the step, so that
  // a recorded step finds its input where its recording reads it.
  absl::Status UploadDraftHidden(const std::vector<float>& h_prev, int64_t tokens);
  // The MTP draft head's input: fc over the normalised embedding and h_prev (draft_hidden_) of
  // each token.
  absl::Status DraftInput(std::span<const int32_t> ids, kernels::Tensor& hidden);
  absl::Status DeltaNetMixer(StepContext& ctx, int layer, const kernels::Tensor& x,
                             kernels::Tensor& out);
  absl::Status AttentionMixer(StepContext& ctx, int layer, const kernels::Tensor& x,
                              kernels::Tensor& out);
  absl::Status FeedForward(StepContext& ctx, int layer, const kernels::Tensor& x,
                           kernels::Tensor& out);
  // Runs a mixer or feed-forward (`sublayer`: every token of x in, its partial sum out) and
  // leaves this rank's rows of the sum over ranks in `delta`: an all-reduce when the sublayer is
  // `partitioned` across ranks, or, sequence parallel, all-gather of `normed` before and
  // reduce-scatter after (through the padded [Tp, H] buffers `gathered` and `partial`).
  // A sharded rank whose sublayer fails keeps the error in ctx.local_error and from then on runs
  // only the collectives; errors returned end the step (a collective's, or an unsharded step's).
  template <typename Sublayer>
  absl::Status RunSharded(StepContext& ctx, bool partitioned, Sublayer&& sublayer,
                          const kernels::Tensor& normed, kernels::Tensor& gathered,
                          kernels::Tensor& partial, kernels::Tensor& delta);
  // Builds expert_routes_ / held_positions_ from shard_.placement (clears them without
  // replicas).
  absl::Status BuildExpertRoutes();
  // Zero-filled scratch in the backend's activation dtype, or in `dtype`.
  absl::StatusOr<kernels::Tensor> Alloc(std::vector<int64_t> shape);
  absl::StatusOr<kernels::Tensor> Alloc(kernels::DType dtype, std::vector<int64_t> shape);
  // Scratch with unspecified contents, for an op's output that the op writes whole
  // (Backend::AllocateUninitialized): a layer's temporaries, so that a recorded step holds no
  // fill for them.
  absl::StatusOr<kernels::Tensor> AllocOutput(std::vector<int64_t> shape);
  absl::StatusOr<kernels::Tensor> AllocOutput(kernels::DType dtype, std::vector<int64_t> shape);

  ModelConfig config_;
  ModelWeights weights_;
  kernels::Backend& backend_;
  ShardSpec shard_;
  Communicator* comm_ = nullptr;
  ModelConfig local_;     // config_ with this rank's head counts and intermediate sizes
  int first_expert_ = 0;  // of this rank's experts in every bank
  // Under a placement with replicas (expert_placement.h): per bank, the device route table that
  // maps routed positions to this rank's local slots (MapExpertIds), and each local slot's
  // position (to count expert load by position). Empty otherwise.
  std::vector<kernels::Tensor> expert_routes_;
  std::vector<std::vector<int32_t>> held_positions_;
  absl::Status shard_error_;  // why shard_/comm_ cannot run (Forward returns it)
  bool sequence_parallel_ = false;
  // Index of each layer in the KV cache (attention) or the state pool (DeltaNet).
  std::vector<int> cache_index_;
  std::unique_ptr<PagedKvCache> kv_cache_;
  std::unique_ptr<StateSlotPool> state_slots_;
  int max_positions_ = 0;  // the caches' per-sequence capacity (CreateCaches max_tokens)
  int decode_capture_max_batch_ = 0;
  ReplicaFollowers* followers_ = nullptr;
  // By state slot: the KV block table the followers hold (on the leader: the last one planned;
  // on a follower: the one the plans built), so that plans send only what changed.
  std::vector<std::vector<int32_t>> planned_blocks_;
  BankLoader bank_loader_;
  absl::Status capture_error_;
  // By (sequences, tokens per sequence): decode steps, and uniform speculative verify steps.
  std::map<std::pair<int, int>, DecodeGraph> decode_graphs_;
  std::set<std::pair<int, int>> unrecordable_;  // shapes whose recording ran out of memory
  std::vector<KeptStateInputs> kept_state_inputs_;
  // MTP draft head: the step's h_prev rows on the device (UploadDraftHidden); grown, never shrunk.
  kernels::Tensor draft_hidden_;
  // Sharded: F32 [world], each rank's status code for the step (ShareStepStatus); with expert
  // parallelism F32 [layers * experts], the step's expert counts (SumExpertCounts).
  kernels::Tensor step_codes_;
  kernels::Tensor expert_counts_;
  bool last_call_failed_together_ = false;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_HYBRID_MODEL_H_
