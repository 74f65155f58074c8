#include "worker/runtime/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/parallel_ranges.h"
#include "common/status_macros.h"
#include "worker/runtime/prompt_scoring.h"
#include "worker/runtime/speculative_sampling.h"

namespace mobius::worker {

Engine::Engine(HybridModel& model, const EngineOptions& options)
    : model_(model), options_(options) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(HybridModel& model,
                                                       const EngineOptions& options) {
  if (options.max_model_len <= 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_model_len (%d) must be at least 2", options.max_model_len));
  }
  if (options.scheduler.max_num_seqs <= 0 || options.scheduler.max_tokens_per_step <= 0 ||
      options.scheduler.max_prompt_score_rows_per_step <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_num_seqs (%d), max_tokens_per_step (%d) and max_prompt_score_rows_per_step (%d; the "
        "worker's --max-prompt-score-rows) must be positive",
        options.scheduler.max_num_seqs, options.scheduler.max_tokens_per_step,
        options.scheduler.max_prompt_score_rows_per_step));
  }
  if (options.spec_tokens < 0 || (options.spec_tokens > 0 && options.drafter == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "spec_tokens (%d) must be >= 0, and > 0 needs a drafter", options.spec_tokens));
  }
  const int max_len = static_cast<int>(
      std::min<int64_t>(options.max_model_len, model.config().max_position_embeddings));
  // Speculating sequences hold a second state slot (their verify steps' output); the KV blocks stay
  // sized for max_num_seqs sequences.
  const int max_seqs = options.scheduler.max_num_seqs;
  const int blocks =
      options.num_kv_blocks > 0
          ? options.num_kv_blocks
          : max_seqs * ((max_len + options.kv_block_size - 1) / options.kv_block_size);
  RETURN_IF_ERROR(model.CreateCaches(options.spec_tokens > 0 ? 2 * max_seqs : max_seqs, max_len,
                                     options.kv_block_size, blocks));
  std::unique_ptr<Engine> engine(new Engine(model, options));
  engine->options_.max_model_len = max_len;
  engine->scheduler_ =
      std::make_unique<Scheduler>(options.scheduler, *model.kv_cache(), *model.state_slots());
  engine->thread_ = std::thread([e = engine.get()] { e->Loop(); });
  return engine;
}

Engine::~Engine() { Shutdown(/*drain=*/false); }

absl::Status Engine::Enqueue(GenerationRequest request, OutputCallback callback) {
  const int vocab = model_.config().vocab_size;
  if (request.prompt.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("request %s: the prompt is empty", request.request_id));
  }
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "request %s: prompt token %d at index %d is outside the vocabulary [0, %d)",
          request.request_id, request.prompt[i], i, vocab));
    }
  }
  if (static_cast<int>(request.prompt.size()) >= options_.max_model_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "request %s: the prompt has %d tokens; the maximum is %d (max_model_len %d leaves room "
        "for at least one generated token)",
        request.request_id, request.prompt.size(), options_.max_model_len - 1,
        options_.max_model_len));
  }
  RETURN_IF_ERROR(request.params.Validate(vocab));
  std::unique_ptr<grammar::TokenConstraint> constraint;
  if (request.params.structured_output.kind != grammar::StructuredOutputSpec::Kind::kNone) {
    if (options_.vocabulary == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "request %s asks for structured output, which needs the model's tokenizer: start the "
          "worker with --tokenizer DIR (the directory of tokenizer.json)",
          request.request_id));
    }
    absl::StatusOr<std::shared_ptr<grammar::CompiledGrammar>> compiled =
        grammar_cache_.Get(request.params.structured_output);
    if (!compiled.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "request %s: structured_output: %s", request.request_id, compiled.status().message()));
    }
    std::vector<int32_t> end_tokens = request.params.stop_token_ids;
    end_tokens.insert(end_tokens.end(), options_.eos_token_ids.begin(),
                      options_.eos_token_ids.end());
    constraint = std::make_unique<grammar::TokenConstraint>(
        *std::move(compiled), options_.vocabulary, std::move(end_tokens));
  }

  auto seq = std::make_unique<Sequence>();
  seq->constraint = std::move(constraint);
  seq->request_id = request.request_id;
  seq->priority = request.priority;
  seq->params = request.params;
  seq->prompt = std::move(request.prompt);
  seq->history.AddPrompt(seq->prompt);
  seq->arrival_time = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
    if (callbacks_.contains(seq->request_id)) {
      return absl::AlreadyExistsError(
          absl::StrFormat("request id %s is already in flight", seq->request_id));
    }
    // Unseeded requests draw from the engine's seed and their admission order.
    seq->sampler = std::make_unique<RequestSampler>(
        seq->params, options_.seed * 0x9e3779b97f4a7c15ull + stats_.steps + callbacks_.size(),
        options_.eos_token_ids);
    // max_tokens 0 asks for nothing to be generated: done at once, unless the prompt is to be
    // scored (a one-token prompt has nothing to score).
    if (seq->params.max_tokens == 0 &&
        (seq->params.prompt_logprobs < 0 || seq->prompt.size() < 2)) {
      GenerationOutput out;
      out.finish = FinishReason::kLength;
      out.prompt_tokens = static_cast<int>(seq->prompt.size());
      callback(out);
      return absl::OkStatus();
    }
    callbacks_[seq->request_id] = std::move(callback);
    incoming_.push_back(std::move(seq));
  }
  return absl::OkStatus();
}

bool Engine::Cancel(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  if (!callbacks_.contains(request_id)) return false;
  cancelled_.push_back(request_id);
  return true;
}

void Engine::Shutdown(bool drain) {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    drain_ = drain;
  }
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<Engine::PlacementReport> Engine::RebalanceExperts(int replicas_per_rank) {
  absl::Notification done;
  absl::StatusOr<PlacementReport> result = absl::UnavailableError("the engine stopped");
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
    tasks_.push_back([this, &done, &result, replicas_per_rank](absl::Status why_not) {
      result =
          why_not.ok() ? Rebalance(replicas_per_rank) : absl::StatusOr<PlacementReport>(why_not);
      done.Notify();
    });
  }
  done.WaitForNotification();
  return result;
}

absl::StatusOr<Engine::PlacementReport> Engine::Rebalance(int replicas_per_rank) {
  const ShardSpec& shard = model_.shard();
  if (shard.ep_size <= 1) {
    return absl::FailedPreconditionError(
        "expert placement needs expert parallelism (--ep > 1); this replica holds every expert");
  }
  ExpertLoads loads = GetExpertLoads();
  if (loads.sampled_steps == 0 || loads.banks.empty()) {
    return absl::FailedPreconditionError(
        "no expert load measured yet (the engine samples it every --expert-load-sample-every "
        "steps while serving)");
  }
  std::vector<std::vector<double>> load(loads.banks.size());
  for (size_t b = 0; b < loads.banks.size(); ++b) {
    load[b].assign(loads.banks[b].begin(), loads.banks[b].end());
  }
  const int world = shard.ep_size;
  ASSIGN_OR_RETURN(ExpertPlacement balanced,
                   ExpertPlacement::BalanceLoads(load, world, replicas_per_rank));
  const ExpertPlacement old =
      shard.placement != nullptr
          ? *shard.placement
          : ExpertPlacement::Contiguous(static_cast<int>(load.size()),
                                        static_cast<int>(load.empty() ? 0 : load[0].size()));
  PlacementReport report;
  report.ranks = world;
  report.sampled_steps = loads.sampled_steps;
  report.imbalance_before = old.Imbalance(load, world);
  report.imbalance_after = balanced.Imbalance(load, world);
  report.replicas_per_rank = balanced.replicas_per_rank();
  for (int b = 0; b < balanced.num_banks(); ++b) {
    const int E = static_cast<int>(balanced.order(b).size()), per_rank = E / world;
    std::vector<int> old_rank(E), new_rank(E);
    for (int j = 0; j < E; ++j) {
      old_rank[old.order(b)[j]] = j / per_rank;
      new_rank[balanced.order(b)[j]] = j / per_rank;
    }
    for (int e = 0; e < E; ++e) report.experts_moved += old_rank[e] != new_rank[e];
  }
  RETURN_IF_ERROR(
      model_.ApplyExpertPlacement(std::make_shared<const ExpertPlacement>(std::move(balanced))));
  return report;
}

Engine::ExpertLoads Engine::GetExpertLoads() {
  absl::MutexLock lock(&mu_);
  return expert_loads_;
}

EngineStats Engine::GetStats() {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Engine::RecordFinish(const Sequence& seq, FinishReason reason) {
  if (options_.metrics == nullptr) return;
  const char* name = "error";
  switch (reason) {
    case FinishReason::kStop:
      name = "stop";
      break;
    case FinishReason::kLength:
      name = "length";
      break;
    case FinishReason::kAbort:
      name = "abort";
      break;
    case FinishReason::kNone:
    case FinishReason::kError:
      break;
  }
  options_.metrics->RequestsFinished(name).Increment();
  options_.metrics->e2e_latency.Observe(absl::ToDoubleSeconds(absl::Now() - seq.arrival_time));
}

void Engine::Finish(Sequence& seq, FinishReason reason, std::optional<int32_t> stop,
                    absl::Status error) {
  RecordFinish(seq, reason);
  GenerationOutput out;
  out.finish = reason;
  out.matched_stop_token = stop;
  out.prompt_tokens = static_cast<int>(seq.prompt.size());
  out.completion_tokens = static_cast<int>(seq.output.size());
  out.error = std::move(error);
  OutputCallback callback;
  {
    absl::MutexLock lock(&mu_);
    auto it = callbacks_.find(seq.request_id);
    if (it == callbacks_.end()) return;
    callback = std::move(it->second);
    callbacks_.erase(it);
  }
  PublishStats();
  callback(out);
}

void Engine::Loop() {
  while (true) {
    std::vector<std::unique_ptr<Sequence>> incoming;
    std::vector<std::string> cancelled;
    std::vector<std::function<void(absl::Status)>> tasks;
    bool stopping, drain;
    const bool busy = scheduler_->num_running() + scheduler_->num_waiting() > 0;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, busy]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return busy || stopping_ || !incoming_.empty() || !cancelled_.empty() || !tasks_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      incoming.swap(incoming_);
      cancelled.swap(cancelled_);
      tasks.swap(tasks_);
      stopping = stopping_;
      drain = drain_;
    }
    // Between two steps: nothing of the model is in use.
    for (auto& task : tasks) task(absl::OkStatus());
    for (auto& seq : incoming) scheduler_->Add(std::move(seq));
    for (const std::string& id : cancelled) {
      if (std::unique_ptr<Sequence> seq = RemoveSequence(id)) {
        Finish(*seq, FinishReason::kAbort, std::nullopt);
      }
    }
    if (stopping && !drain) {
      for (auto& seq : scheduler_->RemoveAll()) {
        ForgetSpeculation(*seq);
        Finish(*seq, FinishReason::kAbort, std::nullopt);
      }
      return;
    }
    const bool worked = Step();
    PublishStats();
    if (worked && options_.debug_step_delay > absl::ZeroDuration()) {
      absl::SleepFor(options_.debug_step_delay);
    }
    if (stopping && !worked && scheduler_->num_running() + scheduler_->num_waiting() == 0) {
      return;
    }
  }
}

void Engine::PublishStats() {
  absl::MutexLock lock(&mu_);
  stats_.num_running = scheduler_->num_running();
  stats_.num_waiting = scheduler_->num_waiting();
  stats_.outstanding_tokens = scheduler_->outstanding_tokens();
  PagedKvCache& kv = *model_.kv_cache();
  stats_.kv_cache_usage = kv.num_blocks() ? 1.0f - float(kv.free_blocks()) / kv.num_blocks() : 0.0f;
  StateSlotPool& slots = *model_.state_slots();
  stats_.state_slot_usage =
      slots.num_slots() ? 1.0f - float(slots.free_slots()) / slots.num_slots() : 0.0f;
  if (EngineMetrics* m = options_.metrics) {
    m->running.Set(stats_.num_running);
    m->waiting.Set(stats_.num_waiting);
    m->kv_cache_usage.Set(stats_.kv_cache_usage);
    m->state_slot_usage.Set(stats_.state_slot_usage);
  }
}

bool Engine::Speculates(const Sequence& seq) const {
  // (A constrained sequence's drafts would each need the grammar state after the ones before
  // them; such sequences decode one token a step.)
  return options_.spec_tokens > 0 && options_.drafter != nullptr && seq.params.logprobs < 0 &&
         seq.constraint == nullptr;
}

std::unique_ptr<Sequence> Engine::RemoveSequence(const std::string& request_id) {
  std::unique_ptr<Sequence> seq = scheduler_->Remove(request_id);
  if (seq != nullptr) ForgetSpeculation(*seq);
  return seq;
}

void Engine::ForgetSpeculation(Sequence& seq) {
  if (options_.drafter == nullptr) return;
  auto it = spare_slots_.find(seq.arrival);
  if (it != spare_slots_.end()) {
    model_.state_slots()->Release(it->second);
    spare_slots_.erase(it);
  }
  options_.drafter->Finish(static_cast<int64_t>(seq.arrival));
}

absl::Status Engine::DraftForStep(const StepPlan& plan, std::vector<std::vector<int32_t>>& tokens,
                                  std::vector<std::vector<int32_t>>& drafts) {
  drafts.assign(plan.chunks.size(), {});
  if (options_.spec_tokens <= 0 || options_.drafter == nullptr) return absl::OkStatus();
  std::vector<DraftRequest> requests;
  std::vector<size_t> owners;
  std::vector<std::vector<int32_t>> contexts;
  contexts.reserve(plan.chunks.size());
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    Sequence& seq = *c.sequence;
    if (!Speculates(seq) || c.count != 1 || !c.completes_prefill() || seq.output.empty()) continue;
    // Every emitted token must fit max_tokens, and every drafted position max_model_len.
    const int k = std::min({options_.spec_tokens,
                            seq.params.max_tokens - static_cast<int>(seq.output.size()) - 1,
                            options_.max_model_len - seq.num_tokens()});
    if (k <= 0) continue;
    // The scheduler reserved the pending token's KV position; the drafts need k more.
    if (!model_.kv_cache()->Reserve(seq.cache, seq.num_computed + 1 + k).ok()) continue;
    if (!spare_slots_.contains(seq.arrival)) {
      SequenceCache spare;
      if (!model_.state_slots()->Acquire(spare).ok()) continue;
      spare_slots_[seq.arrival] = spare;
    }
    std::vector<int32_t>& context = contexts.emplace_back(seq.prompt);
    context.insert(context.end(), seq.output.begin(), seq.output.end());
    requests.push_back({static_cast<int64_t>(seq.arrival), context, k});
    owners.push_back(i);
  }
  if (requests.empty()) return absl::OkStatus();
  std::vector<std::vector<int32_t>> proposed;
  RETURN_IF_ERROR(options_.drafter->Draft(requests, proposed));
  const int vocab = model_.config().vocab_size;
  for (size_t r = 0; r < requests.size() && r < proposed.size(); ++r) {
    std::vector<int32_t>& d = proposed[r];
    d.resize(std::min<size_t>(d.size(), static_cast<size_t>(requests[r].k)));
    // A drafter's token outside the vocabulary would fail the whole step: drop from there on.
    auto bad = std::find_if(d.begin(), d.end(), [&](int32_t t) { return t < 0 || t >= vocab; });
    d.erase(bad, d.end());
    if (d.empty()) continue;
    tokens[owners[r]].insert(tokens[owners[r]].end(), d.begin(), d.end());
    drafts[owners[r]] = std::move(d);
  }
  return absl::OkStatus();
}

bool Engine::Step() {
  StepPlan plan = scheduler_->Schedule();
  for (Sequence* seq : plan.preempted) ForgetSpeculation(*seq);
  for (auto& seq : plan.rejected) {
    Finish(*seq, seq->output.empty() ? FinishReason::kError : FinishReason::kLength, std::nullopt,
           seq->output.empty()
               ? absl::ResourceExhaustedError("the prompt does not fit in the KV cache")
               : absl::OkStatus());
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.num_preemptions += plan.preempted.size();
  }
  if (options_.metrics) options_.metrics->preemptions.Increment(plan.preempted.size());
  if (plan.empty()) return !plan.rejected.empty();

  // Token spans of every chunk (prompt and output are stored apart), then the drafts.
  std::vector<std::vector<int32_t>> tokens(plan.chunks.size());
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    for (int t = c.begin; t < c.begin + c.count; ++t) tokens[i].push_back(c.sequence->token_at(t));
  }
  std::vector<std::vector<int32_t>> drafts;
  double draft_seconds = 0;
  {
    const absl::Time start = absl::Now();
    absl::Status drafted = DraftForStep(plan, tokens, drafts);
    draft_seconds += absl::ToDoubleSeconds(absl::Now() - start);
    if (!drafted.ok()) {
      // Drafts only save time (verification is exact whatever they are): decode plainly.
      std::fprintf(stderr, "mobius engine: drafting failed, decoding without drafts: %s\n",
                   std::string(drafted.message()).c_str());
      for (size_t i = 0; i < plan.chunks.size(); ++i) tokens[i].resize(plan.chunks[i].count);
      drafts.assign(plan.chunks.size(), {});
    }
  }
  // A verify step writes to the spare slot that DraftForStep acquired with the drafts; a chunk
  // with drafts and no spare slot (none by construction) decodes plainly instead.
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    if (!drafts[i].empty() && !spare_slots_.contains(plan.chunks[i].sequence->arrival)) {
      tokens[i].resize(plan.chunks[i].count);
      drafts[i].clear();
    }
  }
  bool any_drafts = false;
  for (const auto& d : drafts) any_drafts |= !d.empty();
  // Chunks that score their prompt (prompt_logprobs) take a logits row per token: count - 1 rows
  // ahead of the chunk's own last row, which scores too until the prompt's last token. (Such a
  // sequence has produced no output, so it carries no drafts.)
  std::vector<int> prompt_rows(plan.chunks.size(), 0);
  bool scoring = false;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    if (plan.chunks[i].sequence->ScoresPrompt()) {
      prompt_rows[i] = plan.chunks[i].count - 1;
      scoring = true;
    }
  }
  // The step's logits rows, chunk by chunk: its prompt rows, then 1 + its drafts' rows;
  // own_row[i] is the first of the latter (the row sampled, or the first verified).
  std::vector<int64_t> own_row(plan.chunks.size());
  for (size_t i = 0, next = 0; i < plan.chunks.size(); ++i) {
    next += prompt_rows[i];
    own_row[i] = static_cast<int64_t>(next);
    next += 1 + drafts[i].size();
  }
  std::vector<SequenceStep> steps;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    // A verify step writes the sequence's DeltaNet states to its spare slot (taken in
    // DraftForStep) and leaves its own slot as it was, for a rollback without a copy.
    Sequence& seq = *plan.chunks[i].sequence;
    const int32_t out_slot =
        drafts[i].empty() ? -1 : spare_slots_.find(seq.arrival)->second.state_slot;
    steps.push_back({tokens[i], &seq.cache, out_slot});
  }
  const absl::Time now = absl::Now();
  for (const ScheduledChunk& c : plan.chunks) {
    Sequence& seq = *c.sequence;
    if (seq.first_scheduled_time == absl::InfinitePast()) {
      seq.first_scheduled_time = now;
      if (options_.metrics) {
        options_.metrics->queue_time.Observe(absl::ToDoubleSeconds(now - seq.arrival_time));
        options_.metrics->prompt_tokens.Increment(seq.prompt.size());
      }
    }
  }
  ForwardOptions forward;
  // The drafter sees what every speculating sequence commits (with hidden states for MTP).
  bool observe = false;
  for (const ScheduledChunk& c : plan.chunks) observe |= Speculates(*c.sequence);
  std::vector<float> hidden;
  if (observe && options_.drafter->needs_target_hidden()) {
    forward.hidden_out = &hidden;
    forward.hidden_all_tokens = true;
  }
  if (any_drafts || scoring) {
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      forward.logits_rows.push_back(prompt_rows[i] + 1 + static_cast<int>(drafts[i].size()));
    }
  }
  if (any_drafts) forward.keep_state_inputs = true;  // for rolling back past rejected drafts
  std::vector<std::vector<int64_t>> expert_tokens;
  const bool sample_experts = options_.metrics != nullptr &&
                              options_.expert_load_sample_every > 0 &&
                              step_index_ % options_.expert_load_sample_every == 0;
  if (sample_experts) {
    expert_tokens.resize(model_.config().num_hidden_layers);
    forward.expert_tokens = &expert_tokens;
  }
  ++step_index_;
  // Structured output: each constrained sequence draws from the tokens its grammar allows now,
  // and from its end tokens once its output is a complete value. At a 151K vocabulary a state
  // seen before costs ~10 us (its cached mask in the shorter form), a new one a walk of the
  // vocabulary (0.03-0.12 ms; up to ~5 ms near a string's maxLength; performance.md,
  // "Structured output"): sequences spread over threads. The masks are computed while the device
  // runs the step (ForwardOptions::before_outputs), since only the draw at its end needs them;
  // the rows drawn on the device then take their penalties again, with the new mask.
  std::vector<size_t> constrained;  // chunk indices
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    if (c.sequence->constraint != nullptr && c.completes_prefill()) constrained.push_back(i);
  }
  bool constrained_ready = constrained.empty();
  std::vector<kernels::LogitPenalties> penalties;  // of rows drawn on the device
  auto constrain = [&] {
    if (constrained_ready) return;
    constrained_ready = true;
    ForEachRangeInParallel(constrained.size(), 16, 1, [&](size_t begin, size_t end) {
      for (size_t k = begin; k < end; ++k) {
        Sequence& seq = *plan.chunks[constrained[k]].sequence;
        std::vector<uint64_t> mask;
        seq.constraint->NextMask(mask);
        seq.sampler->ConstrainNext(std::move(mask));
      }
    });
    if (penalties.empty()) return;
    for (size_t i : constrained) {
      const Sequence& seq = *plan.chunks[i].sequence;
      penalties[static_cast<size_t>(own_row[i])] = seq.sampler->Penalties(seq.history);
    }
  };
  // A step whose sampled rows are all plain greedy (temperature 0, no penalties, no logprobs)
  // takes the argmax on the device: token ids come back instead of the [rows, vocab] logits
  // (254 MB of fp32 at batch 256 with a 248K vocabulary). Drafts are verified against the
  // argmax of every row of theirs (VerifyGreedyDrafts). A step that scores prompt rows needs
  // them on the host, and samples there.
  bool greedy_step = !scoring;
  for (const ScheduledChunk& c : plan.chunks) {
    if (c.completes_prefill()) greedy_step &= c.sequence->sampler->ArgmaxOnly();
  }
  std::vector<int32_t> greedy;
  if (greedy_step) forward.greedy_tokens = &greedy;
  // Otherwise rows are drawn on the device: each sampled row's penalties over its sequence's
  // tokens, its rule and the uniform its sampler would draw (a seeded request keeps its tokens),
  // and for top-n logprobs the row's best (token, logit) pairs. A chunk with drafts has a row per
  // draft and one after them: each checks its draft (its probability under the rule, penalties
  // counting the drafts before it, and a draw from the rest) with the uniforms the host's verify
  // would take from the stream (PeekVerifyUniforms). Only tokens, logits, logprobs and draft
  // probabilities come back, never the rows.
  using SamplingPlace = EngineOptions::SamplingPlace;
  const bool device_step =
      !greedy_step && !scoring &&
      (options_.sampling_place == SamplingPlace::kBackend ||
       (options_.sampling_place == SamplingPlace::kAuto && model_.samples_on_device()));
  std::vector<kernels::SamplingRule> rules;
  std::vector<double> uniforms;
  std::vector<int32_t> row_drafts;
  std::vector<int32_t> top_counts;
  std::vector<kernels::DrawnToken> drawn;
  std::vector<kernels::TokenLogit> top_logits;
  std::vector<float> drawn_logits;
  std::vector<std::vector<double>> verify_uniforms(plan.chunks.size());
  // The penalty lists of verifying chunks' rows (their drafts counted as output): penalties point
  // into them, so they are sized before.
  std::vector<RequestSampler::VerifyPenaltyLists> verify_penalty_lists(plan.chunks.size());
  if (device_step) {
    bool any_top = false;
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      RequestSampler& sampler = *plan.chunks[i].sequence->sampler;
      const TokenHistory& history = plan.chunks[i].sequence->history;
      const bool sampled = plan.chunks[i].completes_prefill();
      const std::vector<int32_t>& d = drafts[i];
      if (!d.empty()) {
        // (A chunk with drafts is a decode chunk of a speculating sequence: no logprobs.)
        verify_uniforms[i] = PeekVerifyUniforms(sampler.rng(), d.size());
        const std::vector<kernels::LogitPenalties> row_penalties =
            sampler.VerifyPenalties(history, d, verify_penalty_lists[i]);
        for (size_t j = 0; j <= d.size(); ++j) {
          rules.push_back(sampler.Rule());
          penalties.push_back(row_penalties[j]);
          uniforms.push_back(VerifyRowUniform(verify_uniforms[i], j, d.size()));
          row_drafts.push_back(j < d.size() ? d[j] : kernels::kNoDraft);
          top_counts.push_back(0);
        }
        continue;
      }
      // Chunks in mid-prefill have a row too: greedy, unpenalised and unused. (A constrained
      // row's penalties wait for its mask: `constrain`, during the step.)
      rules.push_back(sampled ? sampler.Rule() : kernels::SamplingRule{0.0f});
      const bool constrained_row = plan.chunks[i].sequence->constraint != nullptr;
      penalties.push_back(sampled && !constrained_row ? sampler.Penalties(history)
                                                      : kernels::LogitPenalties{});
      uniforms.push_back(sampled ? sampler.NextUniform() : 0.0);
      row_drafts.push_back(kernels::kPlainDraw);
      // (Sample reports at most the vocabulary's tokens.)
      top_counts.push_back(sampled ? std::min(sampler.TopLogprobCount(), model_.config().vocab_size)
                                   : 0);
      any_top |= top_counts.back() > 0;
    }
    forward.sampled_tokens = &drawn;
    forward.sampling_rules = rules;
    forward.sampling_penalties = penalties;
    forward.sampling_uniforms = uniforms;
    if (any_drafts) forward.sampling_drafts = row_drafts;
    if (any_top) {
      forward.top_logits_counts = top_counts;
      forward.top_logits = &top_logits;
      forward.drawn_logits = &drawn_logits;
    }
  }
  std::vector<float> logits;
  forward.before_outputs = constrain;
  const absl::Time forward_start = absl::Now();
  absl::Status status = model_.Forward(steps, forward, logits);
  if (status.ok() && device_step && !constrained_ready) {
    // (The model drew without calling before_outputs: the draws did not see the masks.)
    status = absl::InternalError("the step's draws ran before its structured-output masks");
  }
  constrain();  // for rows drawn on the host
  if (any_drafts && options_.metrics) {
    options_.metrics->spec_verify_time.Observe(absl::ToDoubleSeconds(absl::Now() - forward_start));
  }
  if (status.ok() && sample_experts) {
    // A bank's load aggregates the layers that share it.
    std::vector<std::vector<int64_t>> bank_tokens(model_.num_banks());
    for (size_t l = 0; l < expert_tokens.size(); ++l) {
      if (expert_tokens[l].empty()) continue;
      auto& bank = bank_tokens[model_.config().BankOfLayer(static_cast<int>(l))];
      bank.resize(expert_tokens[l].size(), 0);
      for (size_t e = 0; e < bank.size(); ++e) bank[e] += expert_tokens[l][e];
    }
    for (size_t b = 0; b < bank_tokens.size(); ++b) {
      int64_t routed = 0, touched = 0;
      for (int64_t n : bank_tokens[b]) {
        routed += n;
        touched += n > 0;
      }
      options_.metrics->bank_routed_tokens[b]->Increment(static_cast<double>(routed));
      options_.metrics->bank_experts_touched[b]->Set(static_cast<double>(touched));
    }
    // Cumulative per-expert loads, in the checkpoint's expert ids (the router's output j is
    // expert order[j] under a placement).
    const ExpertPlacement* placement = model_.shard().placement.get();
    absl::MutexLock lock(&mu_);
    expert_loads_.banks.resize(bank_tokens.size());
    ++expert_loads_.sampled_steps;
    for (size_t b = 0; b < bank_tokens.size(); ++b) {
      auto& total = expert_loads_.banks[b];
      total.resize(bank_tokens[b].size(), 0);
      for (size_t j = 0; j < bank_tokens[b].size(); ++j) {
        const size_t e = placement != nullptr && b < static_cast<size_t>(placement->num_banks())
                             ? static_cast<size_t>(placement->order(static_cast<int>(b))[j])
                             : j;
        if (e < total.size()) total[e] += bank_tokens[b][j];
      }
    }
  }
  if (options_.metrics) options_.metrics->steps.Increment();
  if (!status.ok()) {
    for (const ScheduledChunk& c : plan.chunks) {
      if (auto seq = RemoveSequence(c.sequence->request_id)) {
        Finish(*seq, FinishReason::kError, std::nullopt, status);
      }
    }
    return true;
  }
  const int vocab = model_.config().vocab_size;
  struct Delivery {
    OutputCallback callback;
    GenerationOutput output;
  };
  std::vector<Delivery> deliveries;
  std::vector<std::string> finished;
  const int64_t H = model_.config().hidden_size;
  std::vector<TargetStep> observed;
  std::vector<StateReplay> replays;  // rolled back: replay the accepted tokens' state updates
  std::vector<std::string> errored;
  std::vector<std::string> undrawable;  // sampled rows with no drawable token
  absl::Status replay_error;
  std::vector<std::optional<SampledToken>> presampled;
  std::vector<std::optional<DraftVerdict>> verdicts;  // sampled requests' drafts
  if (device_step) {
    presampled.resize(plan.chunks.size());
    verdicts.resize(plan.chunks.size());
    const size_t width =
        top_counts.empty() || top_logits.empty() ? 0 : top_logits.size() / top_counts.size();
    int64_t checked = 0;  // drafts checked on the backend
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      const size_t r = static_cast<size_t>(own_row[i]);
      RequestSampler& sampler = *plan.chunks[i].sequence->sampler;
      if (!drafts[i].empty()) {
        verdicts[i] = VerdictFromChecks(
            drafts[i], verify_uniforms[i],
            std::span<const kernels::DrawnToken>(drawn).subspan(r, drafts[i].size() + 1));
        ConsumeVerifyUniforms(sampler.rng(), *verdicts[i], drafts[i].size());
        checked += static_cast<int64_t>(drafts[i].size());
        continue;
      }
      presampled[i] = SampledToken{drawn[r].token, drawn[r].logprob, {}};
      if (width > 0 && top_counts[r] > 0) {
        presampled[i]->top = sampler.TopLogprobs(
            drawn[r], drawn_logits[r],
            std::span<const kernels::TokenLogit>(top_logits).subspan(r * width, top_counts[r]));
      }
    }
    if (checked > 0) {
      absl::MutexLock lock(&mu_);
      stats_.drafts_checked_on_backend += checked;
    }
  } else if (!greedy_step) {
    // Rows drawn on the host from the copied logits, in one pass over the chunks (each has
    // 1 + its drafts' rows): the last row of each chunk that completes a prefill or decodes
    // without drafts goes to a plain draw; a chunk with drafts is verified against its rows,
    // each sequence against its own rows and random stream, so the sequences go in parallel (one
    // takes 2-10 ms at a 248K vocabulary: performance.md, "Verifying drafts on the host").
    // Prompt rows are scored first: sampling penalises its rows in place.
    if (scoring) ScorePromptRows(plan, own_row, logits, vocab);
    std::vector<std::pair<size_t, int64_t>> plain, verified;  // (chunk, first logits row)
    for (size_t i = 0; i < plan.chunks.size(); ++i) {
      const ScheduledChunk& c = plan.chunks[i];
      // (A sequence with max_tokens 0 only scores its prompt.)
      if (c.completes_prefill() && c.sequence->params.max_tokens > 0) {
        (drafts[i].empty() ? plain : verified).push_back({i, own_row[i]});
      }
    }
    presampled = SampleRows(plan, plain, logits, vocab);
    if (!verified.empty()) verdicts = VerifySampledDrafts(plan, drafts, verified, logits, vocab);
  }
  int64_t hidden_row = 0;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    Sequence& seq = *c.sequence;
    const int d = static_cast<int>(drafts[i].size());
    const int64_t first_row = own_row[i], first_hidden = hidden_row;
    hidden_row += static_cast<int64_t>(tokens[i].size());
    // What the drafter is shown: `committed` tokens from c.begin on, then `next`.
    auto observe_commit = [&](int committed, int32_t next) {
      if (!observe || !Speculates(seq)) return;
      std::span<const float> h;
      if (!hidden.empty()) {
        h = std::span<const float>(hidden).subspan(first_hidden * H, int64_t{committed} * H);
      }
      observed.push_back({static_cast<int64_t>(seq.arrival), c.begin,
                          std::span<const int32_t>(tokens[i]).first(committed), h, next});
    };
    // Queues `out` for the sequence's callback (after the step's bookkeeping).
    auto deliver = [&](GenerationOutput out) {
      const bool done = out.finish != FinishReason::kNone;
      absl::MutexLock lock(&mu_);
      auto it = callbacks_.find(seq.request_id);
      if (it != callbacks_.end()) {
        deliveries.push_back({it->second, std::move(out)});
        if (done) callbacks_.erase(it);
      }
    };
    // The prompt's scores go out once, with the first message after its prefill.
    auto take_prompt_scores = [&](GenerationOutput& out) {
      if (!seq.ScoresPrompt()) return;
      out.prompt_logprobs = std::move(seq.prompt_scores);
      seq.prompt_scores.clear();
      seq.prompt_scores_sent = true;
    };
    if (!c.completes_prefill()) {
      seq.num_computed += c.count;
      observe_commit(c.count, seq.token_at(c.begin + c.count));
      continue;
    }
    if (seq.params.max_tokens == 0) {
      // Only the prompt's scores were asked for (prompt_logprobs): nothing is sampled.
      seq.num_computed += c.count;
      GenerationOutput out;
      take_prompt_scores(out);
      out.finish = FinishReason::kLength;
      out.prompt_tokens = static_cast<int>(seq.prompt.size());
      RecordFinish(seq, out.finish);
      deliver(std::move(out));
      finished.push_back(seq.request_id);
      continue;
    }
    std::vector<int32_t> new_tokens;
    std::optional<SampledToken> sampled;
    int accepted = 0;
    bool roll_back = false;  // drafts were rejected: the state must be rolled back (below)
    if (d == 0) {
      seq.num_computed += c.count;
      sampled = greedy_step ? SampledToken{greedy[first_row], 0.0f, {}} : *presampled[i];
      if (std::isnan(sampled->logprob)) {
        // Every token of the row was -inf (allowed_token_ids, bad_words and min_tokens can
        // exclude them all) or the logits were not numbers: the draw means nothing. The request
        // ends with the reason instead of a token outside its rules.
        undrawable.push_back(seq.request_id);
        continue;
      }
      new_tokens = {sampled->token};
    } else {
      const DraftVerdict verdict =
          greedy_step ? VerifyGreedyDrafts(drafts[i], std::span<const int32_t>(greedy).subspan(
                                                          first_row, static_cast<size_t>(d + 1)))
                      : *verdicts[i];
      accepted = verdict.accepted;
      new_tokens.assign(drafts[i].begin(), drafts[i].begin() + accepted);
      new_tokens.push_back(verdict.next);
      seq.num_computed += 1 + accepted;
      roll_back = accepted < d;
      // Every draft kept: the spare slot that the step wrote holds the sequence's states now,
      // and its old slot becomes the spare.
      if (!roll_back) {
        std::swap(seq.cache.state_slot, spare_slots_.find(seq.arrival)->second.state_slot);
      }
      if (EngineMetrics* m = options_.metrics) {
        m->spec_drafts.Increment();
        m->spec_draft_tokens.Increment(d);
        m->spec_accepted_tokens.Increment(accepted);
        for (int j = 0; j < d; ++j) {
          m->SpecDraftTokensAt(j).Increment();
          if (j < accepted) m->SpecAcceptedTokensAt(j).Increment();
        }
      }
    }
    const absl::Time token_time = absl::Now();
    if (EngineMetrics* m = options_.metrics) {
      if (seq.output.empty()) {
        m->time_to_first_token.Observe(absl::ToDoubleSeconds(token_time - seq.arrival_time));
      } else {
        m->inter_token_latency.Observe(absl::ToDoubleSeconds(token_time - seq.last_token_time));
      }
    }
    seq.last_token_time = token_time;

    GenerationOutput out;
    take_prompt_scores(out);
    if (sampled.has_value() && seq.params.logprobs >= 0) out.logprobs.push_back(*sampled);
    bool off_grammar = false;
    for (int32_t token : new_tokens) {
      seq.output.push_back(token);
      seq.history.AddOutput(token);
      out.tokens.push_back(token);
      // (A constrained output ends at an end-of-sequence token even with ignore_eos: its
      // grammar offered it only because the value was complete.)
      const bool eos = (!seq.params.ignore_eos || seq.constraint != nullptr) &&
                       std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(),
                                 token) != options_.eos_token_ids.end();
      const bool stop_id =
          std::find(seq.params.stop_token_ids.begin(), seq.params.stop_token_ids.end(), token) !=
          seq.params.stop_token_ids.end();
      if (seq.constraint != nullptr && !eos && !stop_id && !seq.constraint->Accept(token)) {
        // The draw honours the grammar's mask, so this means a bug, not a bad request.
        errored.push_back(seq.request_id);
        replay_error = absl::InternalError(
            absl::StrFormat("request %s drew token %d, which its structured output does not allow",
                            seq.request_id, token));
        off_grammar = true;
        break;
      }
      if (eos || stop_id) {
        out.finish = FinishReason::kStop;
        out.matched_stop_token = token;
      } else if (seq.constraint != nullptr && seq.constraint->Finished()) {
        out.finish = FinishReason::kStop;  // the value is complete and nothing can follow
      } else if (static_cast<int>(seq.output.size()) >= seq.params.max_tokens ||
                 seq.num_tokens() >= options_.max_model_len) {
        out.finish = FinishReason::kLength;
      }
      if (out.finish != FinishReason::kNone) break;
    }
    if (off_grammar) continue;  // ends with the error below; the token is not sent
    // The tokens sent, not those verified: a stop inside the accepted drafts drops the rest.
    // (The speculation counters above keep the verifier's view: they measure the drafter.)
    if (EngineMetrics* m = options_.metrics) {
      m->generation_tokens.Increment(static_cast<double>(out.tokens.size()));
    }
    out.prompt_tokens = static_cast<int>(seq.prompt.size());
    out.completion_tokens = static_cast<int>(seq.output.size());
    const bool done = out.finish != FinishReason::kNone;
    if (roll_back && !done) {
      // The states in the spare slot absorbed the rejected drafts; the sequence's own slot,
      // which the step only read, did not: the state updates of the pending token and the
      // accepted drafts are replayed onto it. (A sequence that finishes here needs neither.)
      seq.cache.num_tokens = c.begin;
      replays.push_back({&seq.cache, static_cast<int>(first_hidden), accepted + 1});
    }
    if (!done) observe_commit(c.count + accepted, new_tokens.back());
    if (done) RecordFinish(seq, out.finish);
    deliver(std::move(out));
    if (done) finished.push_back(seq.request_id);
  }
  if (!replays.empty()) {
    absl::Status replayed = model_.ReplayStateInputs(replays);
    if (!replayed.ok()) {
      // Their state is lost: end them with the error (the tokens delivered so far are exact).
      for (const ScheduledChunk& c : plan.chunks) {
        const bool rolled_back =
            std::any_of(replays.begin(), replays.end(),
                        [&](const StateReplay& r) { return r.cache == &c.sequence->cache; });
        if (rolled_back &&
            std::find(finished.begin(), finished.end(), c.sequence->request_id) == finished.end()) {
          errored.push_back(c.sequence->request_id);
        }
      }
      replay_error = replayed;
    }
  }
  if (!observed.empty()) {
    const absl::Time start = absl::Now();
    const absl::Status seen = options_.drafter->Observe(observed);
    draft_seconds += absl::ToDoubleSeconds(absl::Now() - start);
    if (!seen.ok()) {
      // The next drafts may be poor; outputs stay exact (drafts are verified).
      std::fprintf(stderr, "mobius engine: the drafter could not observe a step: %s\n",
                   std::string(seen.message()).c_str());
    }
  }
  if (observe && options_.metrics) options_.metrics->spec_draft_time.Observe(draft_seconds);
  // Free finished sequences and publish the new state before their streams end, so that a
  // client that sees its final message also sees the slot free.
  for (const std::string& id : finished) RemoveSequence(id);
  PublishStats();
  for (Delivery& d : deliveries) d.callback(d.output);
  for (const std::string& id : errored) {
    if (auto seq = RemoveSequence(id)) {
      Finish(*seq, FinishReason::kError, std::nullopt, replay_error);
    }
  }
  for (const std::string& id : undrawable) {
    if (auto seq = RemoveSequence(id)) {
      Finish(*seq, FinishReason::kError, std::nullopt,
             absl::InvalidArgumentError(absl::StrFormat(
                 "request %s: no token can be drawn after %d output tokens: every logit is "
                 "-inf (allowed_token_ids, bad_words, min_tokens and structured output "
                 "together exclude every token) or not a number",
                 id, seq->output.size())));
    }
  }

  absl::MutexLock lock(&mu_);
  ++stats_.steps;
  return true;
}

std::vector<std::optional<SampledToken>> Engine::SampleRows(
    const StepPlan& plan, const std::vector<std::pair<size_t, int64_t>>& rows,
    std::vector<float>& logits, int vocab) {
  // Each row touches only its own logits, its sequence's sampler and history: rows are
  // independent, and a request's random stream does not depend on which thread draws (seeded
  // requests stay reproducible).
  std::vector<std::optional<SampledToken>> sampled(plan.chunks.size());
  auto draw = [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      const auto [i, logits_row] = rows[r];
      Sequence& seq = *plan.chunks[i].sequence;
      sampled[i] = seq.sampler->Sample(
          std::span<float>(logits.data() + logits_row * vocab, static_cast<size_t>(vocab)),
          seq.history);
    }
  };
  // A 248K-token row takes 1-2 ms (performance.md, "Sampling on the host"): spread batches over
  // threads, at least two rows each.
  ForEachRangeInParallel(rows.size(), 16, 2, draw);
  return sampled;
}

void Engine::ScorePromptRows(const StepPlan& plan, const std::vector<int64_t>& own_row,
                             const std::vector<float>& logits, int vocab) {
  // Row r of a scoring chunk (position c.begin + r) scores prompt token c.begin + r + 1. Tokens
  // scored before (a prompt prefilled again after a preemption) and the row after the prompt's
  // last token (the first output's) are left out, so each sequence gets its next tokens in order.
  struct Job {
    Sequence* seq;
    int64_t row;
    int token;
  };
  std::vector<Job> jobs;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    Sequence& seq = *c.sequence;
    if (seq.ScoresPrompt()) {
      const int64_t first_row = own_row[i] - (c.count - 1);  // its rows: one per token
      const int prompt = static_cast<int>(seq.prompt.size());
      const int scored = static_cast<int>(seq.prompt_scores.size());
      for (int r = 0; r < c.count; ++r) {
        const int token = c.begin + r + 1;
        if (token > scored && token < prompt) jobs.push_back({&seq, first_row + r, token});
      }
    }
  }
  std::vector<SampledToken> scores(jobs.size());
  auto score = [&](size_t begin, size_t end) {
    for (size_t j = begin; j < end; ++j) {
      const Job& job = jobs[j];
      scores[j] = ScorePromptToken(
          std::span<const float>(logits.data() + job.row * vocab, static_cast<size_t>(vocab)),
          job.seq->prompt[static_cast<size_t>(job.token)], job.seq->params.prompt_logprobs);
    }
  };
  // A 248K-entry row takes about a millisecond (two passes and a top-n).
  ForEachRangeInParallel(jobs.size(), 16, 4, score);
  for (size_t j = 0; j < jobs.size(); ++j) {
    jobs[j].seq->prompt_scores.push_back(std::move(scores[j]));
  }
}

std::vector<std::optional<DraftVerdict>> Engine::VerifySampledDrafts(
    const StepPlan& plan, const std::vector<std::vector<int32_t>>& drafts,
    const std::vector<std::pair<size_t, int64_t>>& chunks, std::vector<float>& logits, int vocab) {
  // As SampleRows: each chunk reads only its own rows and draws only from its own sequence's
  // stream, so the verdicts do not depend on the threads.
  std::vector<std::optional<DraftVerdict>> verdicts(plan.chunks.size());
  auto verify = [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      const auto [i, first_row] = chunks[c];
      Sequence& seq = *plan.chunks[i].sequence;
      const size_t rows = drafts[i].size() + 1;
      verdicts[i] = VerifyDraftsWithSampler(
          drafts[i],
          std::span<float>(logits.data() + first_row * vocab, rows * static_cast<size_t>(vocab)),
          *seq.sampler, seq.history);
    }
  };
  ForEachRangeInParallel(chunks.size(), 16, 1, verify);
  return verdicts;
}

}  // namespace mobius::worker
