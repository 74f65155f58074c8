#include "cli/bench_speculation.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/parallel_ranges.h"
#include "common/status_macros.h"
#include "worker/model/decode_cost.h"
#include "worker/model/mtp_draft_model.h"
#include "worker/runtime/mtp_drafter.h"
#include "worker/runtime/speculative_sampling.h"

namespace mobius::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Median-free mean of `steps` calls after two warm-up calls, in ms.
template <typename Fn>
absl::StatusOr<double> TimeMs(int steps, Fn&& call) {
  for (int w = 0; w < 2; ++w) RETURN_IF_ERROR(call());
  const auto t0 = Clock::now();
  for (int s = 0; s < steps; ++s) RETURN_IF_ERROR(call());
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / steps;
}

}  // namespace

absl::Status BenchSpeculation(worker::HybridModel& model, const SpeculationBenchOptions& options,
                              nlohmann::json& results) {
  const int K = options.max_spec_tokens, B = options.batch, C = options.context;
  const worker::ModelConfig& config = model.config();
  const int H = config.hidden_size;
  // Target caches: every sequence and its spare state slot (where its verify steps write the
  // states); positions for the context and the largest verify step.
  model.DropCaches();
  RETURN_IF_ERROR(model.CreateCaches(2 * B, C + K + 8));
  std::vector<worker::SequenceCache> seqs(B), spares(B);
  for (int i = 0; i < B; ++i) {
    RETURN_IF_ERROR(model.StartSequence(seqs[i]));
    RETURN_IF_ERROR(model.StartSequence(spares[i]));
    RETURN_IF_ERROR(model.kv_cache()->Reserve(seqs[i], C + K + 1));
    seqs[i].num_tokens = C;
  }
  // The head, with its own caches at the same context.
  ASSIGN_OR_RETURN(std::unique_ptr<worker::HybridModel> head,
                   worker::MakeMtpDraftModel(model, options.draft_vocabulary));
  worker::ApplyMtpHeadCapture(model, *head);
  RETURN_IF_ERROR(head->CreateCaches(B, C + K + 8));
  std::vector<worker::SequenceCache> head_seqs(B);
  for (auto& s : head_seqs) {
    RETURN_IF_ERROR(head->StartSequence(s));
    RETURN_IF_ERROR(head->kv_cache()->Reserve(s, C + K + 1));
    s.num_tokens = C;
  }

  // Verify steps of m = 1..K+1 tokens per sequence, as the speculative path runs them for
  // greedy requests: the argmax of all m logits rows on the device (VerifyGreedyDrafts; sampled
  // requests copy the rows), the hidden states for the head.
  std::vector<int32_t> tokens(static_cast<size_t>(B) * (K + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7919 + 13) % config.vocab_size;
  std::vector<double> verify_ms(K + 2, 0), verify_bound_ms(K + 2, 0), sampled_verify_ms(K + 2, 0);
  std::vector<double> backend_verify_ms(K + 2, 0), in_place_verify_ms(K + 2, 0);
  // Sampled requests (temperature 0.8, top-k 50, top-p 0.95): verified on the host, their verify
  // steps copy the k + 1 logits rows of every sequence and accept the drafts there
  // (VerifyDraftsWithSampler), the sequences spread over threads as the engine spreads them
  // (Engine::VerifySampledDrafts). Top-k because dummy weights give near-flat rows, whose 95%
  // nucleus alone holds most of the vocabulary: more candidates than the device sorts, so both
  // forms would draw those rows on the host (a 24 ms sort each).
  worker::SamplingParams sampled_params;
  sampled_params.temperature = 0.8f;
  sampled_params.top_k = 50;
  sampled_params.top_p = 0.95f;
  std::vector<worker::RequestSampler> samplers;
  for (int i = 0; i < B; ++i) samplers.emplace_back(sampled_params, 1000 + i);
  const worker::TokenHistory history;
  for (int m = 1; m <= K + 1; ++m) {
    std::vector<worker::SequenceStep> step;
    for (int i = 0; i < B; ++i) {
      // Past one token a step verifies drafts: its states go to the spare slot, as in the engine.
      step.push_back({std::span(tokens).subspan(static_cast<size_t>(i) * (K + 1), m), &seqs[i],
                      m > 1 ? spares[i].state_slot : -1});
    }
    // Experts this step touches, for its bound.
    std::vector<std::vector<int64_t>> expert_tokens(config.num_hidden_layers);
    std::vector<float> logits, hidden;
    worker::ForwardOptions counted;
    counted.expert_tokens = &expert_tokens;
    counted.copy_logits = false;
    RETURN_IF_ERROR(model.Forward(step, counted, logits));
    for (auto& s : seqs) s.num_tokens = C;
    std::vector<int32_t> argmax;
    worker::ForwardOptions verify;
    verify.logits_rows.assign(B, m);
    verify.greedy_tokens = &argmax;
    verify.hidden_out = &hidden;
    verify.hidden_all_tokens = true;
    verify.keep_state_inputs = true;
    ASSIGN_OR_RETURN(verify_ms[m], TimeMs(options.steps, [&]() -> absl::Status {
                       RETURN_IF_ERROR(model.Forward(step, verify, logits));
                       for (auto& s : seqs) s.num_tokens = C;
                       return absl::OkStatus();
                     }));
    if (m > 1) {
      // The same verify step updating the states in place, as it ran when every verify step
      // first copied the states to a snapshot slot (timed below): the reference for what the
      // spare slots save.
      std::vector<worker::SequenceStep> in_place = step;
      for (auto& s : in_place) s.state_out_slot = -1;
      ASSIGN_OR_RETURN(in_place_verify_ms[m], TimeMs(options.steps, [&]() -> absl::Status {
                         RETURN_IF_ERROR(model.Forward(in_place, verify, logits));
                         for (auto& s : seqs) s.num_tokens = C;
                         return absl::OkStatus();
                       }));
      worker::ForwardOptions sampled;
      sampled.logits_rows.assign(B, m);
      sampled.hidden_out = &hidden;
      sampled.hidden_all_tokens = true;
      sampled.keep_state_inputs = true;
      const size_t vocab = static_cast<size_t>(config.vocab_size);
      ASSIGN_OR_RETURN(sampled_verify_ms[m], TimeMs(options.steps, [&]() -> absl::Status {
                         RETURN_IF_ERROR(model.Forward(step, sampled, logits));
                         for (auto& s : seqs) s.num_tokens = C;
                         ForEachRangeInParallel(B, 16, 1, [&](size_t begin, size_t end) {
                           for (size_t i = begin; i < end; ++i) {
                             const std::span<const int32_t> drafts = std::span(tokens).subspan(
                                 i * (K + 1) + 1, static_cast<size_t>(m - 1));
                             worker::VerifyDraftsWithSampler(
                                 drafts, std::span<float>(logits).subspan(i * m * vocab, m * vocab),
                                 samplers[i], history);
                           }
                         });
                         return absl::OkStatus();
                       }));
      // The same verify on the backend (as the engine runs it when the backend samples): each
      // row checks its draft in Backend::SampleRows, with uniforms peeked from each stream; only
      // tokens and probabilities come back.
      const size_t k = static_cast<size_t>(m - 1);
      std::vector<kernels::SamplingRule> rules;
      std::vector<double> uniforms;
      std::vector<int32_t> row_drafts;
      std::vector<std::vector<double>> peeked(B);
      std::vector<kernels::DrawnToken> checks;
      worker::ForwardOptions on_backend = sampled;
      on_backend.sampled_tokens = &checks;
      ASSIGN_OR_RETURN(
          backend_verify_ms[m], TimeMs(options.steps, [&]() -> absl::Status {
            rules.clear();
            uniforms.clear();
            row_drafts.clear();
            for (int i = 0; i < B; ++i) {
              peeked[i] = worker::PeekVerifyUniforms(samplers[i].rng(), k);
              for (size_t j = 0; j <= k; ++j) {
                rules.push_back(samplers[i].Rule());
                uniforms.push_back(worker::VerifyRowUniform(peeked[i], j, k));
                row_drafts.push_back(j < k ? tokens[i * (K + 1) + 1 + j] : kernels::kNoDraft);
              }
            }
            on_backend.sampling_rules = rules;
            on_backend.sampling_uniforms = uniforms;
            on_backend.sampling_drafts = row_drafts;
            RETURN_IF_ERROR(model.Forward(step, on_backend, logits));
            for (auto& s : seqs) s.num_tokens = C;
            for (int i = 0; i < B; ++i) {
              const worker::DraftVerdict v = worker::VerdictFromChecks(
                  std::span(tokens).subspan(i * (K + 1) + 1, k), peeked[i],
                  std::span<const kernels::DrawnToken>(checks).subspan(i * (k + 1), k + 1));
              worker::ConsumeVerifyUniforms(samplers[i].rng(), v, k);
            }
            return absl::OkStatus();
          }));
    }
    worker::DecodeCostOptions cost;
    cost.batch = B * m;
    cost.sequences = B;
    cost.context = C;
    cost.weight_bytes = model.backend().activation_dtype() == kernels::DType::kF32 ? 4 : 2;
    cost.kv_bytes = cost.weight_bytes;
    cost.distinct_experts = worker::MeanDistinctExperts(expert_tokens);
    verify_bound_ms[m] = 1e3 * worker::EstimateDecodeStepBytes(config, cost).total() /
                         (options.bandwidth * options.world);
  }
  // Rollback after a rejection: replaying the state updates of the a accepted tokens (the kept
  // inputs of the last verify step, which had K + 1 tokens per sequence).
  std::vector<double> replay_ms(K + 2, 0);
  for (int a = 1; a <= K; ++a) {
    std::vector<worker::StateReplay> replays;
    for (int i = 0; i < B; ++i) replays.push_back({&seqs[i], i * (K + 1), a});
    ASSIGN_OR_RETURN(replay_ms[a], TimeMs(options.steps, [&]() -> absl::Status {
                       for (auto& s : seqs) s.num_tokens = C;
                       RETURN_IF_ERROR(model.ReplayStateInputs(replays));
                       model.backend().Synchronize();
                       return absl::OkStatus();
                     }));
  }
  for (auto& s : seqs) s.num_tokens = C;
  // One head step (every draft after the first, and the observe step of an all-rejected verify).
  std::vector<float> h_prev(static_cast<size_t>(B) * H, 0.5f), head_hidden, head_logits;
  std::vector<worker::SequenceStep> head_step;
  for (int i = 0; i < B; ++i) head_step.push_back({std::span(&tokens[i], 1), &head_seqs[i]});
  worker::ForwardOptions head_options;
  head_options.draft_hidden_in = &h_prev;
  head_options.hidden_out = &head_hidden;
  std::vector<int32_t> head_greedy;
  head_options.greedy_tokens = &head_greedy;  // as MtpDrafter runs it: only the argmax comes back
  ASSIGN_OR_RETURN(const double head_ms, TimeMs(options.steps, [&]() -> absl::Status {
                     RETURN_IF_ERROR(head->Forward(head_step, head_options, head_logits));
                     for (auto& s : head_seqs) s.num_tokens = C;
                     return absl::OkStatus();
                   }));
  // The observe step after a verify step that committed a tokens a sequence: the head's entries
  // of those a positions in one forward, whose last row gives the first draft (MtpDrafter::
  // Observe). One token a sequence is the head step above (recorded at batch 1); a step of two
  // or more tokens in all runs op by op, since its [embedding; hidden] rows are joined by host
  // indices that a recording cannot hold. Timed after the head step: these op-by-op forwards may
  // grow buffers that the head step's recording points at.
  std::vector<double> observe_ms(K + 2, head_ms);
  for (int a = 2; a <= K + 1; ++a) {
    std::vector<float> observe_h(static_cast<size_t>(B) * a * H, 0.5f);
    std::vector<worker::SequenceStep> observe;
    for (int i = 0; i < B; ++i) {
      observe.push_back(
          {std::span<const int32_t>(&tokens[static_cast<size_t>(i) * (K + 1)], a), &head_seqs[i]});
    }
    worker::ForwardOptions observe_options = head_options;
    observe_options.draft_hidden_in = &observe_h;
    ASSIGN_OR_RETURN(observe_ms[a], TimeMs(options.steps, [&]() -> absl::Status {
                       RETURN_IF_ERROR(head->Forward(observe, observe_options, head_logits));
                       for (auto& s : head_seqs) s.num_tokens = C;
                       return absl::OkStatus();
                     }));
  }
  if (!head->capture_error().ok()) {
    std::fprintf(stderr, "bench: MTP head steps not recorded: %s\n",
                 std::string(head->capture_error().message()).c_str());
  }
  // What a snapshot of every sequence's states would cost (a copy to the spare slots, one launch
  // per state tensor), which the verify steps above no longer need.
  std::vector<int32_t> copy_from, copy_to;
  for (int i = 0; i < B; ++i) {
    copy_from.push_back(seqs[i].state_slot);
    copy_to.push_back(spares[i].state_slot);
  }
  ASSIGN_OR_RETURN(const double snapshot_ms, TimeMs(options.steps, [&]() -> absl::Status {
                     RETURN_IF_ERROR(model.CopyStateSlots(copy_from, copy_to));
                     model.backend().Synchronize();
                     return absl::OkStatus();
                   }));
  const double plain_ms = options.plain_step_ms > 0 ? options.plain_step_ms : verify_ms[1];

  const std::string drafted_over =
      options.draft_vocabulary.empty()
          ? std::string("the whole vocabulary")
          : absl::StrFormat("%d tokens, --spec-token-map", options.draft_vocabulary.size());
  std::printf(
      "\nspeculative decoding (MTP), batch %d, context %d: plain decode step %.3f ms; one head "
      "step %.3f ms (drafting over %s); observe step of 2..%d committed tokens a sequence %s ms; "
      "state replay of 1 / %d tokens %.3f / %.3f ms\n",
      B, C, plain_ms, head_ms, drafted_over.c_str(), K + 1,
      [&] {
        std::string v;
        for (int a = 2; a <= K + 1; ++a)
          v += absl::StrFormat("%s%.3f", a > 2 ? " / " : "", observe_ms[a]);
        return v;
      }()
          .c_str(),
      K, replay_ms[1], replay_ms[K]);
  std::printf(
      "verify steps write the states to spare slots; updating them in place after a snapshot copy "
      "(%.3f ms) instead: %s\n",
      snapshot_ms,
      [&] {
        std::string v;
        for (int k = 1; k <= K; ++k) {
          v += absl::StrFormat("%sk=%d %.3f + %.3f ms (spare slot: %.3f)", k > 1 ? ", " : "", k,
                               snapshot_ms, in_place_verify_ms[k + 1], verify_ms[k + 1]);
        }
        return v;
      }()
          .c_str());
  std::printf(
      "verify of sampled requests (temperature 0.8, top-k 50, top-p 0.95), rows copied to the "
      "host and "
      "verified there / drafts checked on the backend: %s; the table below is for greedy "
      "requests\n",
      [&] {
        std::string v;
        for (int k = 1; k <= K; ++k) {
          v += absl::StrFormat("%sk=%d %.3f / %.3f ms", k > 1 ? ", " : "", k,
                               sampled_verify_ms[k + 1], backend_verify_ms[k + 1]);
        }
        return v;
      }()
          .c_str());
  std::printf("%4s %14s %12s %10s %8s %14s %14s %12s\n", "k", "verify(k+1)", "bound", "vs plain",
              "accept", "step", "per token", "speed-up");
  for (int k = 1; k <= K; ++k) {
    for (int a = 1; a <= k + 1; ++a) {
      // Drafting: the observe step of the a tokens the previous verify step committed (the same
      // a in a steady state), which yields the first draft, then k - 1 chained head steps.
      const double draft_ms = observe_ms[a] + (k - 1) * head_ms;
      // a tokens emitted: a - 1 drafts accepted; unless all were, replay the state updates of
      // the a committed tokens onto the sequence's slot, which the verify step only read.
      const double rollback_ms = a < k + 1 ? replay_ms[a] : 0;
      const double step_ms = draft_ms + verify_ms[k + 1] + rollback_ms;
      std::printf("%4d %11.3f ms %9.3f ms %9.2fx %8d %11.3f ms %11.3f ms %11.2fx\n", k,
                  verify_ms[k + 1], verify_bound_ms[k + 1], verify_ms[k + 1] / plain_ms, a, step_ms,
                  step_ms / a, plain_ms / (step_ms / a));
      results.push_back({{"phase", "speculative"},
                         {"batch", B},
                         {"context", C},
                         {"spec_tokens", k},
                         {"accepted_length", a},
                         {"verify_ms", verify_ms[k + 1]},
                         {"sampled_verify_ms", sampled_verify_ms[k + 1]},
                         {"backend_sampled_verify_ms", backend_verify_ms[k + 1]},
                         {"verify_bound_ms", verify_bound_ms[k + 1]},
                         {"plain_decode_ms", plain_ms},
                         {"draft_ms", draft_ms},
                         {"in_place_verify_ms", in_place_verify_ms[k + 1]},
                         {"snapshot_ms", snapshot_ms},
                         {"rollback_ms", rollback_ms},
                         {"head_step_ms", head_ms},
                         {"observe_ms", observe_ms[a]},
                         {"draft_vocabulary", options.draft_vocabulary.size()},
                         {"step_ms", step_ms},
                         {"ms_per_token", step_ms / a}});
    }
  }
  for (auto& s : seqs) model.ReleaseSequence(s);
  for (auto& s : spares) model.ReleaseSequence(s);
  model.DropCaches();
  return absl::OkStatus();
}

}  // namespace mobius::cli
