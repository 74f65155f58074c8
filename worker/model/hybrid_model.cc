#include "worker/model/hybrid_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/distributed/communicator.h"

namespace mobius::worker {

using kernels::DType;
using kernels::Tensor;

// Per-step metadata shared by the layers.
struct HybridModel::StepContext {
  int num_tokens = 0;
  std::vector<kernels::SequenceSegment> segments;
  ForwardOptions options;
  Tensor hidden_rows;  // the final post-norm rows the logits come from
  // A sharded step's first failure on this rank alone (a tensor that did not fit). The rank
  // then skips its sublayers but keeps taking part in the step's collectives, so that its peers
  // are not left waiting in them; Forward then fails the step on every rank (ShareStepStatus).
  absl::Status local_error;
};

HybridModel::HybridModel(ModelConfig config, ModelWeights weights, kernels::Backend& backend,
                         ShardSpec shard, Communicator* comm)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      backend_(backend),
      shard_(shard),
      comm_(comm),
      local_(config_) {
  absl::StatusOr<ShardDims> dims = ComputeShardDims(config_, shard_);
  if (!dims.ok()) {
    shard_error_ = dims.status();
  } else {
    local_ = LocalModelConfig(config_, *dims);
    first_expert_ = dims->expert0;
    if (absl::Status routes = BuildExpertRoutes(); !routes.ok()) shard_error_ = routes;
    if (shard_.sharded() && (comm_ == nullptr || comm_->world_size() != shard_.world_size() ||
                             comm_->rank() != shard_.rank())) {
      shard_error_ = absl::FailedPreconditionError(
          absl::StrFormat("shard rank %d of %d needs a communicator of that rank and size",
                          shard_.rank(), shard_.world_size()));
    }
  }
  int attention = 0, linear = 0;
  for (LayerType type : config_.layer_types) {
    cache_index_.push_back(type == LayerType::kFullAttention ? attention++ : linear++);
  }
}

absl::Status HybridModel::SetSequenceParallel(bool on) {
  if (on && shard_.sharded() && shard_.tp_size != shard_.world_size()) {
    return absl::InvalidArgumentError(
        "sequence parallel needs the mixers split over every rank (tp = world size)");
  }
  sequence_parallel_ = on;
  return absl::OkStatus();
}

absl::Status HybridModel::CreateCaches(int max_sequences, int max_tokens, int block_size,
                                       int num_kv_blocks) {
  if (max_sequences <= 0 || max_tokens <= 0 || block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cache sizes must be positive: max_sequences=%d max_tokens=%d", max_sequences, max_tokens));
  }
  PagedKvCacheOptions kv;
  kv.num_layers = config_.num_layers_of(LayerType::kFullAttention);
  kv.num_kv_heads = local_.num_key_value_heads;
  kv.head_dim = config_.head_dim;
  kv.block_size = block_size;
  kv.num_blocks = num_kv_blocks > 0 ? num_kv_blocks
                                    : max_sequences * ((max_tokens + block_size - 1) / block_size);
  decode_graphs_.clear();
  unrecordable_.clear();  // the memory left for recordings changes with the caches
  capture_error_ = absl::OkStatus();
  max_positions_ = max_tokens;
  ASSIGN_OR_RETURN(kv_cache_, PagedKvCache::Create(kv, backend_));

  if (followers_ != nullptr) {
    RETURN_IF_ERROR(followers_->CreateCaches(
        CacheGeometry{max_sequences, max_tokens, block_size, num_kv_blocks}));
  }

  StateSlotPoolOptions slots;
  slots.num_layers = config_.num_layers_of(LayerType::kLinearAttention);
  slots.conv_dim = local_.conv_dim();
  slots.conv_kernel = config_.linear_conv_kernel_dim;
  slots.num_v_heads = local_.linear_num_value_heads;
  slots.k_head_dim = config_.linear_key_head_dim;
  slots.v_head_dim = config_.linear_value_head_dim;
  slots.num_slots = max_sequences;
  ASSIGN_OR_RETURN(state_slots_, StateSlotPool::Create(slots, backend_));
  planned_blocks_.assign(max_sequences, {});
  if (shard_.sharded()) {
    // Allocated here, so that a step that runs out of memory can still tell the other ranks, and
    // the expert counts' all-reduce after it cannot fail on one rank alone.
    ASSIGN_OR_RETURN(step_codes_, backend_.Allocate(DType::kF32, {comm_->world_size()}));
    if (shard_.ep_size > 1) {
      ASSIGN_OR_RETURN(expert_counts_,
                       backend_.Allocate(DType::kF32, {int64_t{config_.num_hidden_layers} *
                                                       config_.num_experts}));
    }
  }
  return absl::OkStatus();
}

absl::Status HybridModel::StartSequence(SequenceCache& seq) {
  if (!state_slots_) return absl::FailedPreconditionError("CreateCaches was not called");
  seq.num_tokens = 0;
  return state_slots_->Acquire(seq);
}

void HybridModel::ReleaseSequence(SequenceCache& seq) {
  if (state_slots_) state_slots_->Release(seq);
  if (kv_cache_) kv_cache_->Release(seq);
  seq.num_tokens = 0;
}

absl::Status HybridModel::CopyStateSlots(std::span<const int32_t> from,
                                         std::span<const int32_t> to) {
  last_call_failed_together_ = false;
  if (!state_slots_) return absl::FailedPreconditionError("CreateCaches was not called");
  if (from.size() != to.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d source and %d destination state slots", from.size(), to.size()));
  }
  if (from.empty()) return absl::OkStatus();
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i] < 0 || to[i] < 0 || from[i] >= state_slots_->num_slots() ||
        to[i] >= state_slots_->num_slots() ||
        std::find(from.begin(), from.end(), to[i]) != from.end()) {
      // Checked on the leader before its followers are told, and the same on every rank.
      return absl::InvalidArgumentError(
          absl::StrFormat("state slot copy %d -> %d: outside [0, %d) or onto a source", from[i],
                          to[i], state_slots_->num_slots()));
    }
  }
  backend_.TakeOpError().IgnoreError();  // an earlier call's, which that call reported or dropped
  if (followers_ != nullptr) {
    RETURN_IF_ERROR(followers_->CopyStateSlots({from.begin(), from.end()}, {to.begin(), to.end()}));
  }
  std::vector<Tensor> rows;  // every state tensor as [slots, one slot's elements]
  for (int l = 0; l < state_slots_->num_layers(); ++l) {
    for (Tensor* states : {&state_slots_->conv_states(l), &state_slots_->recurrent_states(l)}) {
      const int64_t slots = states->shape()[0];
      rows.push_back(states->Reshape({slots, states->numel() / slots}));
    }
  }
  std::vector<Tensor*> xs;
  for (Tensor& t : rows) xs.push_back(&t);
  backend_.CopyRows(xs, from, to);
  // The copy's metadata may not have fit (ResourceExhausted); then nothing was copied.
  return ShareCallStatus(backend_.TakeOpError(), "state copy");
}

absl::Status HybridModel::ShareCallStatus(absl::Status local, absl::string_view what) {
  if (!shard_.sharded()) return local;
  // A rank whose part failed: the others learn it here, so the leader fails the call (the engine
  // fails the step's requests, drops its drafts, or ends the rolled-back sequences) and the
  // followers keep following; a call that ran on some ranks only is never used.
  ASSIGN_OR_RETURN(absl::Status group, ShareStepStatus(local, what));
  if (group.ok()) return local;
  last_call_failed_together_ = true;
  return local.ok() ? group : local;
}

absl::Status HybridModel::ReplayStateInputs(std::span<const StateReplay> replays) {
  last_call_failed_together_ = false;
  if (replays.empty()) return absl::OkStatus();
  const int layers = config_.num_layers_of(LayerType::kLinearAttention);
  if (static_cast<int>(kept_state_inputs_.size()) != layers) {
    return absl::FailedPreconditionError(
        "ReplayStateInputs needs the last Forward to have run with keep_state_inputs");
  }
  if (layers == 0) {
    for (const StateReplay& r : replays) r.cache->num_tokens += r.num_tokens;
    return absl::OkStatus();
  }
  // One segment per sequence, indexing the kept rows directly; CheckDeltaRuleReplay below checks
  // the rows and slots (one segment per state, as in Forward).
  std::vector<kernels::SequenceSegment> segments;
  for (size_t i = 0; i < replays.size(); ++i) {
    const StateReplay& r = replays[i];
    if (r.cache == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("replay %d has no sequence", i));
    }
    kernels::SequenceSegment seg;
    seg.token_begin = r.first_row;
    seg.num_tokens = r.num_tokens;
    seg.cached_tokens = r.cache->num_tokens;
    seg.state_slot = r.cache->state_slot;
    seg.kv_blocks = r.cache->kv_blocks;
    segments.push_back(seg);
  }
  kernels::DeltaRuleDims dims;
  dims.num_k_heads = local_.linear_num_key_heads;
  dims.num_v_heads = local_.linear_num_value_heads;
  dims.k_head_dim = config_.linear_key_head_dim;
  dims.v_head_dim = config_.linear_value_head_dim;
  std::vector<kernels::DeltaRuleReplayLayer> replay_layers;
  for (int layer = 0; layer < config_.num_hidden_layers; ++layer) {
    if (config_.layer_types[layer] != LayerType::kLinearAttention) continue;
    const int slot_layer = cache_index_[layer];
    const KeptStateInputs& kept = kept_state_inputs_[slot_layer];
    replay_layers.push_back(
        {&kept.mixed, &kept.g, &kept.beta, &weights_.layers[layer].linear->conv1d,
         &state_slots_->conv_states(slot_layer), &state_slots_->recurrent_states(slot_layer)});
  }
  // Checked here, before the followers are told: a replay they would refuse must not reach them.
  RETURN_IF_ERROR(
      kernels::CheckDeltaRuleReplay(replay_layers, dims, segments, backend_.activation_dtype()));
  // Validated: the followers replay the same (before this rank: their kept inputs are theirs).
  if (followers_ != nullptr) {
    std::vector<PlannedReplay> planned;
    for (const StateReplay& r : replays) {
      planned.push_back({r.cache->state_slot, r.cache->num_tokens, r.first_row, r.num_tokens});
    }
    RETURN_IF_ERROR(followers_->ReplayStateInputs(planned));
  }
  backend_.TakeOpError().IgnoreError();  // an earlier call's, which that call reported or dropped
  absl::Status local = backend_.ReplayDeltaRuleStates(replay_layers, dims, segments);
  // Ops of a replay run through the separate kernels that could not get their memory.
  if (local.ok()) local = backend_.TakeOpError();
  RETURN_IF_ERROR(ShareCallStatus(std::move(local), "state replay"));
  for (const StateReplay& r : replays) r.cache->num_tokens += r.num_tokens;
  return absl::OkStatus();
}

absl::StatusOr<Tensor> HybridModel::Alloc(std::vector<int64_t> shape) {
  return backend_.Allocate(backend_.activation_dtype(), std::move(shape));
}
absl::StatusOr<Tensor> HybridModel::Alloc(DType dtype, std::vector<int64_t> shape) {
  return backend_.Allocate(dtype, std::move(shape));
}
absl::StatusOr<Tensor> HybridModel::AllocOutput(std::vector<int64_t> shape) {
  return backend_.AllocateUninitialized(backend_.activation_dtype(), std::move(shape));
}
absl::StatusOr<Tensor> HybridModel::AllocOutput(DType dtype, std::vector<int64_t> shape) {
  return backend_.AllocateUninitialized(dtype, std::move(shape));
}

absl::Status HybridModel::Forward(std::span<SequenceStep> batch, const ForwardOptions& options,
                                  std::vector<float>& logits) {
  last_call_failed_together_ = false;
  RETURN_IF_ERROR(shard_error_);
  if (!kv_cache_ || !state_slots_) {
    return absl::FailedPreconditionError("CreateCaches was not called");
  }
  // Validate the whole batch before changing any state.
  if (options.expert_tokens != nullptr &&
      options.expert_tokens->size() != static_cast<size_t>(config_.num_hidden_layers)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("expert_tokens has %d layers; the model has %d",
                        options.expert_tokens->size(), config_.num_hidden_layers));
  }
  StepContext ctx;
  ctx.options = options;
  std::vector<int32_t> ids;
  int64_t draft_tokens = 0;
  bool moves_states = false;  // a sequence's states go to another slot (state_out_slot)
  // The step's sequence using each state slot (read, or written as an out slot): one hash map
  // pass, not a comparison of every pair (a batch-256 step would make ~33K).
  absl::flat_hash_map<int32_t, size_t> user;
  user.reserve(batch.size());
  for (size_t s = 0; s < batch.size(); ++s) {
    const SequenceStep& step = batch[s];
    if (step.cache == nullptr || step.cache->state_slot < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequence %d has no cache slot (call StartSequence)", s));
    }
    if (step.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat("sequence %d has no tokens", s));
    }
    // A sequence's tokens of a step form one segment: twice in a batch, its two segments would
    // read and write the same conv and recurrent state at once (the kernels of a step run every
    // segment in parallel).
    if (auto [it, fresh] = user.emplace(step.cache->state_slot, s); !fresh) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sequences %d and %d share state slot %d: a sequence may appear once in a step",
          it->second, s, step.cache->state_slot));
    }
    if (step.state_out_slot >= state_slots_->num_slots()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequence %d: state_out_slot %d outside the %d state slots", s,
                          step.state_out_slot, state_slots_->num_slots()));
    }
    moves_states |= step.state_out_slot >= 0 && step.state_out_slot != step.cache->state_slot;
    for (size_t i = 0; i < step.tokens.size(); ++i) {
      const int32_t id = step.tokens[i];
      if (id < 0 || id >= config_.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrFormat("sequence %d: token %d at index %d is outside the vocabulary [0, %d)",
                            s, id, i, config_.vocab_size));
      }
    }
    draft_tokens += static_cast<int64_t>(step.tokens.size());
    const int64_t end = int64_t{step.cache->num_tokens} + step.tokens.size();
    if (end > config_.max_position_embeddings) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sequence %d: %d tokens exceed max_position_embeddings (%d)", s, end,
                          config_.max_position_embeddings));
    }
  }
  if (moves_states) {
    // A slot that receives a sequence's states is read or written by no other sequence.
    for (size_t s = 0; s < batch.size(); ++s) {
      const int32_t out = batch[s].state_out_slot;
      if (out < 0 || out == batch[s].cache->state_slot) continue;
      auto [it, fresh] = user.emplace(out, s);
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sequence %d: state_out_slot %d is also used by sequence %d", s, out, it->second));
      }
    }
  }
  if (!options.logits_rows.empty()) {
    if (options.logits_rows.size() != batch.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("logits_rows has %d entries for a step of %d sequences",
                          options.logits_rows.size(), batch.size()));
    }
    for (size_t s = 0; s < batch.size(); ++s) {
      const int n = options.logits_rows[s];
      if (n < 1 || n > static_cast<int>(batch[s].tokens.size())) {
        return absl::InvalidArgumentError(
            absl::StrFormat("logits_rows[%d] = %d is outside [1, %d] (the sequence's tokens)", s, n,
                            batch[s].tokens.size()));
      }
    }
  }
  if (options.sampled_tokens != nullptr) {
    // One rule and draw per logits row: the rows of logits_rows, else one per sequence or token.
    int64_t rows = 0;
    if (!options.logits_rows.empty()) {
      for (int n : options.logits_rows) rows += n;
    } else if (options.logits == LogitsMode::kAllTokens) {
      for (const SequenceStep& step : batch) rows += static_cast<int64_t>(step.tokens.size());
    } else {
      rows = static_cast<int64_t>(batch.size());
    }
    if (static_cast<int64_t>(options.sampling_rules.size()) != rows ||
        options.sampling_uniforms.size() != options.sampling_rules.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sampled_tokens: %d sampling rules and %d uniforms for a step of %d logits rows",
          options.sampling_rules.size(), options.sampling_uniforms.size(), rows));
    }
    if (!options.sampling_penalties.empty() &&
        static_cast<int64_t>(options.sampling_penalties.size()) != rows) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sampling_penalties: %d entries for a step of %d logits rows",
                          options.sampling_penalties.size(), rows));
    }
    if (!options.sampling_drafts.empty() &&
        static_cast<int64_t>(options.sampling_drafts.size()) != rows) {
      return absl::InvalidArgumentError(
          absl::StrFormat("sampling_drafts: %d entries for a step of %d logits rows",
                          options.sampling_drafts.size(), rows));
    }
    if (!options.top_logits_counts.empty()) {
      if (static_cast<int64_t>(options.top_logits_counts.size()) != rows ||
          options.top_logits == nullptr || options.drawn_logits == nullptr) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "top_logits_counts: %d entries for a step of %d logits rows (top_logits and "
            "drawn_logits must be set)",
            options.top_logits_counts.size(), rows));
      }
      for (size_t r = 0; r < options.top_logits_counts.size(); ++r) {
        const int32_t n = options.top_logits_counts[r];
        // The logits' width: an MTP head with a draft vocabulary has fewer rows than the vocab.
        const int width = static_cast<int>(weights_.lm_head.dim(0));
        if (n < 0 || n > kernels::kMaxTopLogprobs || n > width) {
          return absl::InvalidArgumentError(
              absl::StrFormat("top_logits_counts[%d] = %d is outside [0, %d]", r, n,
                              std::min(kernels::kMaxTopLogprobs, width)));
        }
      }
    }
  }
  if (options.draft_hidden_in != nullptr) {
    if (!weights_.mtp.has_value()) {
      return absl::FailedPreconditionError(
          "draft_hidden_in is for an MTP draft model (MakeMtpDraftModel); this model has no fc");
    }
    if (shard_.sharded() || followers_ != nullptr) {
      return absl::UnimplementedError("the MTP draft model runs on one rank");
    }
    const int64_t want = draft_tokens * config_.hidden_size;
    if (static_cast<int64_t>(options.draft_hidden_in->size()) != want) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "draft_hidden_in has %d values; the step's %d tokens need %d (hidden size %d each)",
          options.draft_hidden_in->size(), draft_tokens, want, config_.hidden_size));
    }
    RETURN_IF_ERROR(UploadDraftHidden(*options.draft_hidden_in, draft_tokens));
  }
  for (SequenceStep& step : batch) {
    RETURN_IF_ERROR(kv_cache_->Reserve(*step.cache, step.cache->num_tokens + step.tokens.size()));
  }
  if (followers_ != nullptr) {
    ReplicaStepPlan plan;
    plan.logits_mode = static_cast<int>(options.logits);
    plan.delta_rule = options.delta_rule;
    plan.count_experts = options.expert_tokens != nullptr;
    plan.keep_state_inputs = options.keep_state_inputs;
    for (const SequenceStep& step : batch) {
      // Only the part of the block table the followers do not hold yet: the common prefix with
      // what this slot's last plan sent stays (none for a sequence that starts over).
      const std::vector<int32_t>& blocks = step.cache->kv_blocks;
      std::vector<int32_t>& sent = planned_blocks_[step.cache->state_slot];
      size_t known = 0;
      if (step.cache->num_tokens > 0) {
        while (known < sent.size() && known < blocks.size() && sent[known] == blocks[known]) {
          ++known;
        }
      }
      plan.sequences.push_back(PlannedSequence{
          std::vector<int32_t>(step.tokens.begin(), step.tokens.end()), step.cache->num_tokens,
          step.cache->state_slot, std::vector<int32_t>(blocks.begin() + known, blocks.end()),
          static_cast<int32_t>(known), step.state_out_slot});
      sent = blocks;
    }
    RETURN_IF_ERROR(followers_->Step(plan));
  }
  for (SequenceStep& step : batch) {
    kernels::SequenceSegment seg;
    seg.token_begin = static_cast<int32_t>(ids.size());
    seg.num_tokens = static_cast<int32_t>(step.tokens.size());
    seg.cached_tokens = step.cache->num_tokens;
    seg.state_slot = step.cache->state_slot;
    seg.state_out_slot = step.state_out_slot;
    seg.kv_blocks = step.cache->kv_blocks;
    ctx.segments.push_back(seg);
    ids.insert(ids.end(), step.tokens.begin(), step.tokens.end());
  }
  ctx.num_tokens = static_cast<int>(ids.size());
  if (ctx.num_tokens == 0) {
    logits.clear();
    return absl::OkStatus();
  }
  kept_state_inputs_.clear();
  if (options.keep_state_inputs) {
    kept_state_inputs_.resize(config_.num_layers_of(LayerType::kLinearAttention));
  }
  // An op failure left by ops run outside a step (their callers check it) is not this step's.
  backend_.TakeOpError().IgnoreError();
  // Every op of the step reads these from one staged device copy.
  backend_.StageStep(ids, ctx.segments, max_positions_);
  absl::Cleanup clear_step = [this] { backend_.ClearStep(); };
  // A step whose metadata could not be staged (out of memory) does not run: its ops would upload
  // their own, which a recording cannot. A sharded rank still makes the step's collectives.
  if (absl::Status staged = backend_.TakeOpError(); !staged.ok()) {
    if (!shard_.sharded()) return staged;
    ctx.local_error = staged;
  }
  // Collectives are host calls between ranks, so a sharded step is never recorded. A recorded
  // step has one token per sequence (decode), or the same m <= 8 tokens per sequence with the
  // logits of every token and the state inputs kept (a speculative verify step): no op then
  // needs host data that the staged step does not hold. (A prefill of as many tokens that scores
  // its prompt keeps no state inputs: recorded under the same key, its replay would leave a
  // verify step nothing to roll back with.)
  const int m = ctx.segments.empty() ? 0 : ctx.segments[0].num_tokens;
  bool all_rows = options.logits_rows.empty() ? options.logits == LogitsMode::kAllTokens : true;
  for (int r : options.logits_rows) all_rows &= r == m;
  // An MTP head's step of one token records too: its h_prev input waits in draft_hidden_ (uploaded
  // above), and its hidden_out comes from the recording's hidden rows. (With more tokens its
  // input interleaves rows by host indices, which a recording cannot hold.)
  const bool draft = options.draft_hidden_in != nullptr;
  bool recordable =
      decode_capture_max_batch_ > 0 && backend_.SupportsCapture() &&
      options.expert_tokens == nullptr && (!draft || ctx.num_tokens == 1) && !shard_.sharded() &&
      followers_ == nullptr && static_cast<int>(batch.size()) <= decode_capture_max_batch_ &&
      (m == 1 || (m <= 8 && all_rows && options.keep_state_inputs)) &&
      (m > 1 || (!options.keep_state_inputs && (options.hidden_out == nullptr || draft)));
  for (const kernels::SequenceSegment& seg : ctx.segments) {
    recordable &= seg.num_tokens == m;
    // A recorded one-token step holds the decode kernels, which update the states in place; one
    // whose states go to other slots (never a step of the engine's) runs op by op, where the
    // backend picks the kernels that write them there.
    recordable &= m > 1 || kernels::WrittenStateSlot(seg) == seg.state_slot;
  }
  recordable &= !unrecordable_.contains({static_cast<int>(ctx.segments.size()), m});
  Tensor out;
  if (recordable) {
    ASSIGN_OR_RETURN(out, RunDecodeGraph(ctx, ids));
  } else {
    ASSIGN_OR_RETURN(out, QueueStep(ctx, ids));
  }
  // A sharded step fails on every rank or on none: a rank that failed on its own still took part
  // in every collective (StepContext::local_error), and the ranks' statuses are shared before
  // anything else that pairs their collectives (the expert counts, the next step). The outputs
  // wait for them: another rank's failure leaves this rank's logits undefined (NaN, say), which
  // the samplers need not handle.
  absl::Status status = ctx.local_error;
  if (shard_.sharded()) {
    status.Update(backend_.TakeOpError());
    RETURN_IF_ERROR(ShareCallStatus(status, "step"));  // OK here: this rank's status was OK too
    if (options.expert_tokens != nullptr && shard_.ep_size > 1) {
      RETURN_IF_ERROR(SumExpertCounts(*options.expert_tokens));
    }
  }
  if (status.ok() && options.before_outputs) options.before_outputs();
  if (status.ok()) status = WriteStepOutputs(ctx, out, logits);
  RETURN_IF_ERROR(status);
  // An op that could not get its device memory skipped its launches: the step's outputs and the
  // states it wrote are not to be used, and the caller fails its sequences (the engine does).
  // A sharded step's were shared above; these are the outputs' (this rank's own).
  RETURN_IF_ERROR(backend_.TakeOpError());
  for (SequenceStep& step : batch) step.cache->num_tokens += step.tokens.size();
  return absl::OkStatus();
}

absl::Status HybridModel::WriteStepOutputs(StepContext& ctx, Tensor& out,
                                           std::vector<float>& logits) {
  const ForwardOptions& options = ctx.options;
  if (options.greedy_tokens != nullptr) {
    const int64_t rows = out.rank() >= 1 ? out.dim(0) : 0;
    ASSIGN_OR_RETURN(Tensor ids, Alloc(DType::kI32, {rows}));
    backend_.ArgmaxRows(out, ids);
    options.greedy_tokens->resize(static_cast<size_t>(rows));
    backend_.CopyToHostI32(ids, options.greedy_tokens->data());
    logits.clear();
  } else if (options.sampled_tokens != nullptr) {
    options.sampled_tokens->resize(options.sampling_rules.size());
    backend_.PenalizeRows(out, options.sampling_penalties);
    backend_.SampleRows(out, options.sampling_rules, options.sampling_uniforms,
                        options.sampling_drafts, *options.sampled_tokens);
    logits.clear();
    const std::span<const int32_t> counts = options.top_logits_counts;
    if (!counts.empty()) {
      const int32_t width = *std::max_element(counts.begin(), counts.end());
      std::vector<int32_t> chosen;
      for (const kernels::DrawnToken& d : *options.sampled_tokens) chosen.push_back(d.token);
      options.top_logits->assign(counts.size() * static_cast<size_t>(width), {});
      options.drawn_logits->assign(counts.size(), 0.0f);
      backend_.TopLogitsRows(out, counts, chosen, *options.top_logits, *options.drawn_logits);
    }
  } else if (options.copy_logits) {
    logits.resize(static_cast<size_t>(out.numel()));
    backend_.CopyToHostF32(out, logits.data());
  } else {
    logits.clear();
    backend_.Synchronize();
  }
  if (options.hidden_out != nullptr) {
    options.hidden_out->resize(static_cast<size_t>(ctx.hidden_rows.numel()));
    backend_.CopyToHostF32(ctx.hidden_rows, options.hidden_out->data());
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Status> HybridModel::ShareStepStatus(const absl::Status& status,
                                                          absl::string_view what) {
  // Each rank writes its status code at its own index; the sum gives every rank every code.
  const int world = comm_->world_size();
  std::vector<float> codes(static_cast<size_t>(world), 0.0f);
  codes[static_cast<size_t>(comm_->rank())] = static_cast<float>(status.code());
  backend_.CopyFromHost(codes.data(), DType::kF32, step_codes_);
  RETURN_IF_ERROR(comm_->AllReduceSum(step_codes_));  // the group itself failed
  backend_.CopyToHostF32(step_codes_, codes.data());
  for (int r = 0; r < world; ++r) {
    const int code = static_cast<int>(codes[r] + 0.5f);
    if (code == 0) continue;
    const auto status_code = static_cast<absl::StatusCode>(code);
    return absl::Status(status_code,
                        absl::StrCat("rank ", r, " of ", world, " could not run this ", what, " (",
                                     absl::StatusCodeToString(status_code), "; its log says why)"));
  }
  return absl::OkStatus();
}

absl::Status HybridModel::SumExpertCounts(std::vector<std::vector<int64_t>>& counts) {
  std::vector<float> flat;
  for (const auto& layer : counts) flat.insert(flat.end(), layer.begin(), layer.end());
  if (flat.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(flat.size()) > expert_counts_.numel()) {
    return absl::InternalError(absl::StrFormat("%d expert counts; the buffer holds %d", flat.size(),
                                               expert_counts_.numel()));
  }
  Tensor t = expert_counts_.Rows(0, static_cast<int64_t>(flat.size()));
  backend_.CopyFromHost(flat.data(), DType::kF32, t);
  RETURN_IF_ERROR(comm_->AllReduceSum(t));
  backend_.CopyToHostF32(t, flat.data());
  size_t i = 0;
  for (auto& layer : counts) {
    for (int64_t& n : layer) n = static_cast<int64_t>(flat[i++] + 0.5f);
  }
  return absl::OkStatus();
}

absl::Status HybridModel::ApplyExpertPlacement(std::shared_ptr<const ExpertPlacement> placement) {
  if (!bank_loader_) {
    return absl::FailedPreconditionError(
        "this model cannot reload its expert banks (it was not made by LoadHybridModel)");
  }
  if (placement == nullptr) {
    return absl::InvalidArgumentError("no expert placement given");
  }
  ShardSpec shard = shard_;
  shard.placement = placement->identity() ? nullptr : placement;
  // Validates the placement against the config (bank count, every order a permutation).
  RETURN_IF_ERROR(ComputeShardDims(config_, shard).status());
  if (followers_ != nullptr) RETURN_IF_ERROR(followers_->ApplyPlacement(*placement));
  ASSIGN_OR_RETURN(std::vector<ExpertBankWeights> banks, bank_loader_(shard));
  if (banks.size() != weights_.banks.size()) {
    return absl::InternalError(absl::StrFormat("reloaded %d banks, the model has %d", banks.size(),
                                               weights_.banks.size()));
  }
  backend_.Synchronize();  // no queued op still reads the old banks
  decode_graphs_.clear();
  weights_.banks = std::move(banks);
  shard_ = shard;
  return BuildExpertRoutes();
}

absl::Status HybridModel::BuildExpertRoutes() {
  expert_routes_.clear();
  held_positions_.clear();
  const ExpertPlacement* placement = shard_.placement.get();
  if (placement == nullptr || placement->replicas_per_rank() == 0) return absl::OkStatus();
  const int world = shard_.ep_size, rank = shard_.ep_rank;
  for (int b = 0; b < placement->num_banks(); ++b) {
    const std::vector<int32_t> table = placement->RouteTable(b, world, rank);
    ASSIGN_OR_RETURN(Tensor routes,
                     backend_.Allocate(DType::kI32, {static_cast<int64_t>(table.size())}));
    backend_.CopyFromHost(table.data(), DType::kI32, routes);
    expert_routes_.push_back(routes);
    held_positions_.push_back(placement->HeldPositions(b, world, rank));
  }
  return absl::OkStatus();
}

absl::Status HybridModel::ExecutePlan(const ReplicaStepPlan& plan) {
  // An error below, before Forward, is not a step the group failed together.
  last_call_failed_together_ = false;
  if (!kv_cache_ || !state_slots_) {
    return absl::FailedPreconditionError("a step plan arrived before the cache geometry");
  }
  // A sequence at position 0 starts from a zero state: the leader's slot was zeroed when it
  // was acquired (for a new or a preempted sequence), so this rank zeroes its copy now.
  for (const PlannedSequence& seq : plan.sequences) {
    if (seq.cached_tokens == 0) RETURN_IF_ERROR(state_slots_->Reset(seq.state_slot));
  }
  std::vector<SequenceCache> caches(plan.sequences.size());
  std::vector<SequenceStep> batch(plan.sequences.size());
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const PlannedSequence& seq = plan.sequences[i];
    caches[i].state_slot = seq.state_slot;
    if (seq.state_slot < 0 || seq.state_slot >= static_cast<int>(planned_blocks_.size())) {
      return absl::DataLossError(absl::StrFormat("a plan names state slot %d of %d", seq.state_slot,
                                                 planned_blocks_.size()));
    }
    std::vector<int32_t>& table = planned_blocks_[seq.state_slot];
    if (seq.kv_blocks_known < 0 || seq.kv_blocks_known > static_cast<int>(table.size())) {
      return absl::DataLossError(absl::StrFormat(
          "a plan keeps %d KV blocks of state slot %d, which holds %d: the ranks disagree",
          seq.kv_blocks_known, seq.state_slot, table.size()));
    }
    table.resize(seq.kv_blocks_known);
    table.insert(table.end(), seq.kv_blocks.begin(), seq.kv_blocks.end());
    caches[i].kv_blocks = table;
    caches[i].num_tokens = seq.cached_tokens;
    batch[i].tokens = seq.tokens;
    batch[i].cache = &caches[i];
    batch[i].state_out_slot = seq.state_out_slot;
  }
  ForwardOptions options;
  options.logits = static_cast<LogitsMode>(plan.logits_mode);
  options.delta_rule = plan.delta_rule;
  options.copy_logits = false;  // the leader samples; a follower only takes part
  options.keep_state_inputs = plan.keep_state_inputs;
  std::vector<std::vector<int64_t>> expert_tokens;
  if (plan.count_experts) {
    expert_tokens.resize(config_.num_hidden_layers);
    options.expert_tokens = &expert_tokens;
  }
  std::vector<float> unused;
  return Forward(batch, options, unused);
}

absl::StatusOr<Tensor> HybridModel::RunDecodeGraph(StepContext& ctx, std::span<const int32_t> ids) {
  const std::pair<int, int> key(static_cast<int>(ctx.segments.size()), ctx.segments[0].num_tokens);
  auto it = decode_graphs_.find(key);
  if (it != decode_graphs_.end()) {
    absl::Status replayed = backend_.Replay(*it->second.step);
    if (replayed.ok()) {
      // The replay left this step's results in the recording's (capture-pool) tensors.
      ctx.hidden_rows = it->second.hidden_rows;
      if (ctx.options.keep_state_inputs) kept_state_inputs_ = it->second.kept;
      return it->second.logits;
    }
    if (!absl::IsFailedPrecondition(replayed)) return replayed;
    decode_graphs_.erase(it);  // recorded against buffers that are gone: record it again
  }
  // Run this step op by op (which also sizes every lazily grown buffer), then record the same
  // ops for the next steps of this batch size; recording runs nothing.
  // A failed recording does not fail the step (it already ran): recording stops (out of device
  // memory, only for this shape) and the error is kept for capture_error().
  ASSIGN_OR_RETURN(Tensor out, QueueStep(ctx, ids));
  // What this (op by op) run computed; the recording below points ctx at tensors it fills only
  // when replayed.
  const Tensor hidden_rows = ctx.hidden_rows;
  const std::vector<KeptStateInputs> kept = kept_state_inputs_;
  absl::Cleanup restore = [&] {
    ctx.hidden_rows = hidden_rows;
    kept_state_inputs_ = kept;
  };
  absl::StatusOr<Tensor> recorded_logits;
  absl::StatusOr<std::unique_ptr<kernels::CapturedStep>> recorded;
  for (int attempt = 0;; ++attempt) {
    absl::Status began = backend_.BeginCapture();
    if (!began.ok()) {
      capture_error_ = began;
      decode_capture_max_batch_ = 0;
      return out;
    }
    recorded_logits = QueueStep(ctx, ids);
    recorded = backend_.EndCapture();
    if (recorded_logits.ok() && recorded.ok()) break;
    capture_error_ = !recorded_logits.ok() ? recorded_logits.status() : recorded.status();
    if (!absl::IsResourceExhausted(capture_error_)) {
      decode_capture_max_batch_ = 0;
      return out;
    }
    // Out of device memory for this recording. The op-by-op run just before it left its freed
    // blocks in the backend's cache, which a capture cannot return to the device: once they are
    // returned, try again. If that does not do, this shape runs op by op from now on, and the
    // shapes already recorded (or small enough to record) keep their recordings.
    if (attempt > 0 || !backend_.ReleaseCachedMemory()) {
      unrecordable_.insert(key);
      return out;
    }
  }
  capture_error_ = absl::OkStatus();
  decode_graphs_[key] = DecodeGraph{*std::move(recorded), *std::move(recorded_logits),
                                    ctx.hidden_rows, kept_state_inputs_};
  return out;
}

template <typename Sublayer>
absl::Status HybridModel::RunSharded(StepContext& ctx, bool partitioned, Sublayer&& sublayer,
                                     const Tensor& normed, Tensor& gathered, Tensor& partial,
                                     Tensor& delta) {
  auto run = [&](const Tensor& x, Tensor& y) {
    if (ctx.local_error.ok()) ctx.local_error = sublayer(x, y);
  };
  if (gathered.empty()) {
    run(normed, delta);
    if (partitioned && shard_.sharded()) RETURN_IF_ERROR(comm_->AllReduceSum(delta));
  } else {
    // Padding rows of `partial` are never written, so they stay zero.
    RETURN_IF_ERROR(comm_->AllGather(normed, gathered));
    Tensor out = partial.Rows(0, ctx.num_tokens);
    run(gathered.Rows(0, ctx.num_tokens), out);
    RETURN_IF_ERROR(comm_->ReduceScatterSum(partial, delta));
  }
  // Errors returned from here end the step at once: a collective's (the group has failed), or
  // an unsharded step's own. A sharded rank's own failure waits in ctx.local_error; an unsharded
  // one leaves it clear, since a failed recording attempt queues the same step again with ctx.
  if (shard_.sharded()) return absl::OkStatus();
  return std::exchange(ctx.local_error, absl::OkStatus());
}

absl::StatusOr<Tensor> HybridModel::QueueStep(StepContext& ctx, std::span<const int32_t> ids) {
  const int T = ctx.num_tokens, H = config_.hidden_size, L = config_.num_hidden_layers;
  const float eps = config_.rms_norm_eps;
  // Sequence parallel: this rank's residual rows are [rank * Tl, (rank + 1) * Tl) of the step's
  // tokens padded to Tp, a multiple of the world size.
  const bool sp = sequence_parallel_ && shard_.sharded();
  const int W = shard_.world_size();
  const int Tp = sp ? (T + W - 1) / W * W : T, Tl = Tp / (sp ? W : 1);

  // Sequence parallel leaves the padding rows of hidden unwritten (zero); otherwise the embedding
  // (or the draft input), the norms and every sublayer write these whole.
  auto alloc_rows = [&](std::vector<int64_t> shape) {
    return sp ? Alloc(std::move(shape)) : AllocOutput(std::move(shape));
  };
  // The residual stream and the collectives' buffers. Without them this rank cannot take part
  // in the step's collectives, so a sharded rank fails its group (the communicator returns the
  // error to the other ranks' collectives) instead of leaving it waiting.
  Tensor hidden, normed, delta;
  Tensor gathered, partial;  // [Tp, H], sequence parallel only
  if (absl::Status s = [&]() -> absl::Status {
        ASSIGN_OR_RETURN(hidden, alloc_rows({Tl, H}));
        ASSIGN_OR_RETURN(normed, alloc_rows({Tl, H}));
        ASSIGN_OR_RETURN(delta, alloc_rows({Tl, H}));
        if (sp) {
          ASSIGN_OR_RETURN(gathered, Alloc({Tp, H}));
          ASSIGN_OR_RETURN(partial, Alloc({Tp, H}));
        }
        return absl::OkStatus();
      }();
      !s.ok()) {
    if (shard_.sharded()) comm_->Abort(s);
    return s;
  }
  if (sp) {
    const int first = shard_.rank() * Tl, n = std::clamp(T - first, 0, Tl);
    if (n > 0) {
      Tensor rows = hidden.Rows(0, n);
      backend_.EmbeddingLookup(ids.subspan(first, n), weights_.embed, rows);
    }
  } else if (ctx.options.draft_hidden_in != nullptr) {
    RETURN_IF_ERROR(DraftInput(ids, hidden));
  } else {
    backend_.EmbeddingLookup(ids, weights_.embed, hidden);
  }
  backend_.RmsNorm1p(hidden, weights_.layers[0].input_norm, eps, normed);
  const bool mixer_partitioned = shard_.tp_size > 1;
  for (int i = 0; i < L; ++i) {
    const LayerWeights& lw = weights_.layers[i];
    auto mixer = [&](const Tensor& x, Tensor& out) {
      return config_.layer_types[i] == LayerType::kLinearAttention ? DeltaNetMixer(ctx, i, x, out)
                                                                   : AttentionMixer(ctx, i, x, out);
    };
    RETURN_IF_ERROR(RunSharded(ctx, mixer_partitioned, mixer, normed, gathered, partial, delta));
    if (ctx.local_error.ok()) backend_.AddRmsNorm1p(hidden, delta, lw.post_norm, eps, normed);
    auto ffn = [&](const Tensor& x, Tensor& out) { return FeedForward(ctx, i, x, out); };
    RETURN_IF_ERROR(RunSharded(ctx, /*partitioned=*/true, ffn, normed, gathered, partial, delta));
    const Tensor& next_norm = i + 1 < L ? weights_.layers[i + 1].input_norm : weights_.final_norm;
    if (ctx.local_error.ok()) backend_.AddRmsNorm1p(hidden, delta, next_norm, eps, normed);
  }
  Tensor final_normed = normed;  // [T, H]
  if (sp) {
    RETURN_IF_ERROR(comm_->AllGather(normed, gathered));
    final_normed = gathered.Rows(0, T);
  }
  // The step's last collective is behind: what follows is this rank's own.
  if (!ctx.local_error.ok()) return Tensor();
  absl::StatusOr<Tensor> out = Logits(ctx, final_normed);
  if (!out.ok() && shard_.sharded()) {
    ctx.local_error = out.status();
    return Tensor();
  }
  return out;
}

absl::StatusOr<Tensor> HybridModel::Logits(StepContext& ctx, const Tensor& final_normed) {
  const int T = ctx.num_tokens, H = config_.hidden_size;

  std::vector<int32_t> rows;
  if (!ctx.options.logits_rows.empty()) {
    for (size_t s = 0; s < ctx.segments.size(); ++s) {
      const kernels::SequenceSegment& seg = ctx.segments[s];
      for (int r = seg.num_tokens - ctx.options.logits_rows[s]; r < seg.num_tokens; ++r) {
        rows.push_back(seg.token_begin + r);
      }
    }
  } else if (ctx.options.logits == LogitsMode::kAllTokens) {
    for (int t = 0; t < T; ++t) rows.push_back(t);
  } else {
    for (const kernels::SequenceSegment& seg : ctx.segments) {
      rows.push_back(seg.token_begin + seg.num_tokens - 1);
    }
  }
  // The lm_head's rows, not config_.vocab_size: an MTP head with a draft vocabulary keeps only
  // some of them (MakeMtpDraftModel).
  const int R = static_cast<int>(rows.size()), V = static_cast<int>(weights_.lm_head.dim(0));
  Tensor selected = final_normed;
  if (R != T) {
    ASSIGN_OR_RETURN(selected, AllocOutput({R, H}));
    backend_.GatherRows(final_normed, rows, selected);
  }
  ctx.hidden_rows = ctx.options.hidden_all_tokens ? final_normed : selected;
  ASSIGN_OR_RETURN(Tensor out, AllocOutput(DType::kF32, {R, V}));
  backend_.Linear(selected, weights_.lm_head, out);
  return out;
}

absl::Status HybridModel::UploadDraftHidden(const std::vector<float>& h_prev, int64_t tokens) {
  if (draft_hidden_.empty() || draft_hidden_.dim(0) < tokens) {
    // Recorded head steps read the buffer they were recorded with: a new one drops them.
    decode_graphs_.clear();
    const int64_t rows =
        std::max<int64_t>({tokens, 64, draft_hidden_.empty() ? 0 : 2 * draft_hidden_.dim(0)});
    ASSIGN_OR_RETURN(draft_hidden_, Alloc({rows, config_.hidden_size}));
  }
  Tensor rows = draft_hidden_.Rows(0, tokens);
  backend_.CopyFromHost(h_prev.data(), DType::kF32, rows);
  return absl::OkStatus();
}

absl::Status HybridModel::DraftInput(std::span<const int32_t> ids, Tensor& hidden) {
  const MtpWeights& mtp = *weights_.mtp;
  const int T = static_cast<int>(ids.size()), H = config_.hidden_size;
  const float eps = config_.rms_norm_eps;
  const Tensor h_prev = draft_hidden_.Rows(0, T);  // uploaded by Forward
  // [e_0 .. e_{T-1}, h_0 .. h_{T-1}] normalised, then interleaved row by row into [T, 2H]: the
  // embedding half first, as fc expects.
  ASSIGN_OR_RETURN(Tensor stacked, AllocOutput({2 * T, H}));
  ASSIGN_OR_RETURN(Tensor raw, AllocOutput({T, H}));
  Tensor e = stacked.Rows(0, T), h = stacked.Rows(T, T);
  backend_.EmbeddingLookup(ids, weights_.embed, raw);
  backend_.RmsNorm1p(raw, mtp.pre_fc_norm_embedding, eps, e);
  backend_.RmsNorm1p(h_prev, mtp.pre_fc_norm_hidden, eps, h);
  // At one token [e; h] is already fc's input row; the gather (which uploads its order from the
  // host, so a recorded step cannot hold it) is needed from two tokens on.
  Tensor joined = stacked;
  if (T > 1) {
    std::vector<int32_t> order(2 * T);
    for (int t = 0; t < T; ++t) {
      order[2 * t] = t;
      order[2 * t + 1] = T + t;
    }
    ASSIGN_OR_RETURN(joined, AllocOutput({2 * T, H}));
    backend_.GatherRows(stacked, order, joined);
  }
  backend_.Linear(joined.Reshape({T, 2 * H}), mtp.fc, hidden);
  return absl::OkStatus();
}

absl::Status HybridModel::DeltaNetMixer(StepContext& ctx, int layer, const Tensor& x, Tensor& out) {
  const DeltaNetWeights& w = *weights_.layers[layer].linear;
  const int T = ctx.num_tokens, Hv = local_.linear_num_value_heads,
            Dv = config_.linear_value_head_dim;
  const int cd = local_.conv_dim(), vd = local_.value_dim();
  ASSIGN_OR_RETURN(Tensor mixed, AllocOutput({T, cd}));
  ASSIGN_OR_RETURN(Tensor z, AllocOutput({T, vd}));
  ASSIGN_OR_RETURN(Tensor b, AllocOutput({T, Hv}));
  ASSIGN_OR_RETURN(Tensor a, AllocOutput({T, Hv}));
  {
    const Tensor* ws[] = {&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a};
    Tensor* ys[] = {&mixed, &z, &b, &a};
    backend_.LinearFanOut(x, ws, ys);
  }

  const int slot_layer = cache_index_[layer];
  ASSIGN_OR_RETURN(Tensor conv_out, AllocOutput({T, cd}));
  ASSIGN_OR_RETURN(Tensor g, AllocOutput(DType::kF32, {T, Hv}));
  ASSIGN_OR_RETURN(Tensor beta, AllocOutput(DType::kF32, {T, Hv}));
  ASSIGN_OR_RETURN(Tensor core, AllocOutput({T, vd}));
  ASSIGN_OR_RETURN(Tensor gated, AllocOutput({T, vd}));
  kernels::DeltaRuleDims dims;
  dims.num_k_heads = local_.linear_num_key_heads;
  dims.num_v_heads = Hv;
  dims.k_head_dim = config_.linear_key_head_dim;
  dims.v_head_dim = Dv;
  const kernels::DeltaNetMixerOperands mixer{
      .mixed = mixed,
      .z = z,
      .a = a,
      .b = b,
      .conv_w = w.conv1d,
      .a_log = w.a_log,
      .dt_bias = w.dt_bias,
      .norm_w = w.norm,
      .eps = config_.rms_norm_eps,
      .dims = dims,
      .conv_states = state_slots_->conv_states(slot_layer),
      .recurrent_states = state_slots_->recurrent_states(slot_layer),
      .g = g,
      .beta = beta,
      .conv_out = conv_out,
      .core = core};
  backend_.GatedDeltaNetMixer(mixer, ctx.segments, ctx.options.delta_rule, gated);
  // The replay of a rejected speculative step re-runs the conv and the delta rule from these.
  if (ctx.options.keep_state_inputs) kept_state_inputs_[slot_layer] = {mixed, g, beta};
  backend_.Linear(gated, w.out_proj, out);
  return absl::OkStatus();
}

absl::Status HybridModel::AttentionMixer(StepContext& ctx, int layer, const Tensor& x,
                                         Tensor& out) {
  const AttentionWeights& w = *weights_.layers[layer].attention;
  const int T = ctx.num_tokens, nh = local_.num_attention_heads, nkv = local_.num_key_value_heads,
            hd = config_.head_dim;
  ASSIGN_OR_RETURN(Tensor q_gate, AllocOutput({T, nh, 2 * hd}));
  ASSIGN_OR_RETURN(Tensor k, AllocOutput({T, nkv, hd}));
  ASSIGN_OR_RETURN(Tensor v, AllocOutput({T, nkv, hd}));
  {
    Tensor q2 = q_gate.Reshape({T, nh * 2 * hd}), k2 = k.Reshape({T, nkv * hd}),
           v2 = v.Reshape({T, nkv * hd});
    const Tensor* ws[] = {&w.q_proj, &w.k_proj, &w.v_proj};
    Tensor* ys[] = {&q2, &k2, &v2};
    backend_.LinearFanOut(x, ws, ys);
  }
  ASSIGN_OR_RETURN(Tensor q, AllocOutput({T, nh, hd}));
  ASSIGN_OR_RETURN(Tensor gate, AllocOutput({T, nh, hd}));
  kernels::RopeParams rope;
  rope.rotary_dim = config_.rotary_dim();
  rope.theta = static_cast<float>(config_.rope_theta);
  const int kv_layer = cache_index_[layer];
  backend_.QkNormRopeWriteKv(q_gate, k, v, w.q_norm, w.k_norm, config_.rms_norm_eps, rope,
                             ctx.segments, q, gate, kv_cache_->keys(kv_layer),
                             kv_cache_->values(kv_layer));
  ASSIGN_OR_RETURN(Tensor attn, AllocOutput({T, nh, hd}));
  backend_.GatedPagedAttention(q, gate, kv_cache_->keys(kv_layer), kv_cache_->values(kv_layer),
                               ctx.segments, 1.0f / std::sqrt(static_cast<float>(hd)), attn);
  backend_.Linear(attn.Reshape({T, nh * hd}), w.o_proj, out);
  return absl::OkStatus();
}

absl::Status HybridModel::FeedForward(StepContext& ctx, int layer, const Tensor& x, Tensor& out) {
  const LayerWeights& lw = weights_.layers[layer];
  const int T = ctx.num_tokens;
  const int64_t I2 = lw.shared_expert.gate_up.dim(0);

  // Shared expert (or the dense MLP).
  ASSIGN_OR_RETURN(Tensor gate_up, AllocOutput({T, I2}));
  ASSIGN_OR_RETURN(Tensor act, AllocOutput({T, I2 / 2}));
  if (config_.mlp_types[layer] == MlpType::kDense) {
    backend_.Linear(x, lw.shared_expert.gate_up, gate_up);
    backend_.SiluMulLinear(gate_up, lw.shared_expert.down, act, out);
    return absl::OkStatus();
  }
  // The projections of x (shared expert, its gate, the router) in one fan-out.
  const ExpertBankWeights& bank = weights_.banks[config_.BankOfLayer(layer)];
  const int E = config_.num_experts, k = config_.num_experts_per_tok;
  ASSIGN_OR_RETURN(Tensor shared_gate, AllocOutput({T, 1}));
  // Router logits stay fp32 (MODEL.md section 5): rounding them to bf16 flips near-tied top-k
  // choices, which then changes the token's whole expert mix.
  ASSIGN_OR_RETURN(Tensor router_logits, AllocOutput(DType::kF32, {T, E}));
  {
    const Tensor* ws[] = {&lw.shared_expert.gate_up, &lw.shared_expert_gate, &bank.router};
    Tensor* ys[] = {&gate_up, &shared_gate, &router_logits};
    backend_.LinearFanOut(x, ws, ys);
  }
  ASSIGN_OR_RETURN(Tensor shared, AllocOutput({T, config_.hidden_size}));
  const kernels::SharedExpertOperands shared_expert{gate_up, lw.shared_expert.down, shared_gate,
                                                    act, shared};

  // Routed experts of this layer's bank.
  ASSIGN_OR_RETURN(Tensor ids, AllocOutput(DType::kI32, {T, k}));
  ASSIGN_OR_RETURN(Tensor weights, AllocOutput(DType::kF32, {T, k}));
  // With expert parallelism this rank counts (and computes) only its own experts.
  const int local_experts = static_cast<int>(bank.gate_up.dim(0));
  const int b = config_.BankOfLayer(layer);
  if (b < static_cast<int>(expert_routes_.size())) {
    backend_.TopKSoftmax(router_logits, k, config_.norm_topk_prob, ids, weights);
    // Replicated experts: the routed positions become local slots (or -1, another rank's pair).
    ASSIGN_OR_RETURN(Tensor slots, AllocOutput(DType::kI32, {T, k}));
    backend_.MapExpertIds(ids, expert_routes_[b], shard_.ep_size + 1, slots);
    std::vector<int64_t> slot_counts;
    if (ctx.options.expert_tokens != nullptr) slot_counts.assign(local_experts, 0);
    backend_.MoeExpertsWithSharedExpert(x, slots, weights, bank.gate_up, bank.down, 0,
                                        shared_expert, out, slot_counts);
    if (ctx.options.expert_tokens != nullptr) {
      std::vector<int64_t>& layer_counts = (*ctx.options.expert_tokens)[layer];
      layer_counts.resize(E, 0);
      for (int s = 0; s < local_experts && s < static_cast<int>(held_positions_[b].size()); ++s) {
        layer_counts[held_positions_[b][s]] += slot_counts[s];
      }
    }
    return absl::OkStatus();
  }
  std::span<int64_t> counts;
  if (ctx.options.expert_tokens != nullptr) {
    std::vector<int64_t>& layer_counts = (*ctx.options.expert_tokens)[layer];
    layer_counts.resize(E, 0);
    counts = std::span(layer_counts).subspan(first_expert_, local_experts);
  }
  backend_.RoutedMoeWithSharedExpert(x, router_logits, k, config_.norm_topk_prob, ids, weights,
                                     bank.gate_up, bank.down, first_expert_, shared_expert, out,
                                     counts);
  return absl::OkStatus();
}

}  // namespace mobius::worker
