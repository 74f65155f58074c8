#include "worker/runtime/speculative_decoder.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "worker/runtime/sampler.h"
#include "worker/runtime/speculative_sampling.h"

namespace mobius::worker {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double SpeculationStats::AcceptanceRate(int position) const {
  if (position < 0 || position >= static_cast<int>(proposed.size()) || proposed[position] == 0) {
    return 0.0;
  }
  return static_cast<double>(accepted[position]) / static_cast<double>(proposed[position]);
}

double SpeculationStats::MeanAcceptedLength() const {
  return verify_steps == 0
             ? 0.0
             : static_cast<double>(emitted_tokens) / static_cast<double>(verify_steps);
}

absl::Status SpeculativeDecoder::Generate(std::span<const SpeculativeRequest> requests,
                                          std::vector<std::vector<int32_t>>& outputs) {
  using Clock = std::chrono::steady_clock;
  const int n = static_cast<int>(requests.size());
  const int64_t vocab = model_.config().vocab_size;
  const int64_t H = model_.config().hidden_size;
  if (model_.state_slots() == nullptr || model_.kv_cache() == nullptr) {
    return absl::FailedPreconditionError("speculative decoding: the model has no caches");
  }
  struct Sequence {
    SequenceCache cache;
    SequenceCache spare;           // spare state slot (speculating sequences only)
    std::vector<int32_t> context;  // prompt + generated tokens (the pending one last)
    std::vector<int32_t> step_tokens;
    std::vector<int32_t> drafts;
    TokenHistory history;  // prompt + outputs, for penalties
    bool done = false;
  };
  std::vector<Sequence> seqs(n);
  std::vector<RequestSampler> samplers;
  samplers.reserve(n);
  outputs.assign(n, {});
  auto release = [&] {
    for (int i = 0; i < n; ++i) {
      model_.ReleaseSequence(seqs[i].cache);
      model_.ReleaseSequence(seqs[i].spare);
      if (requests[i].spec_tokens > 0) drafter_.Finish(i);
    }
  };
  absl::Status status;
  for (int i = 0; i < n && status.ok(); ++i) {
    const SpeculativeRequest& r = requests[i];
    samplers.emplace_back(r.params, r.seed, r.stop_tokens);
    if (r.prompt.empty()) {
      status = absl::InvalidArgumentError(absl::StrFormat("request %d: empty prompt", i));
      break;
    }
    if (r.spec_tokens < 0) {
      status = absl::InvalidArgumentError(
          absl::StrFormat("request %d: spec_tokens (%d) must not be negative", i, r.spec_tokens));
      break;
    }
    status = r.params.Validate(static_cast<int>(vocab));
    if (!status.ok()) {
      status = absl::InvalidArgumentError(absl::StrFormat("request %d: %s", i, status.message()));
      break;
    }
    status = model_.StartSequence(seqs[i].cache);
    if (status.ok() && r.spec_tokens > 0) status = model_.StartSequence(seqs[i].spare);
    seqs[i].context = r.prompt;
    seqs[i].history.AddPrompt(r.prompt);
    seqs[i].done = r.max_new_tokens <= 0;
  }
  if (!status.ok()) {
    release();
    return status;
  }
  for (const SpeculativeRequest& r : requests) {
    if (static_cast<int>(stats_.proposed.size()) < r.spec_tokens) {
      stats_.proposed.resize(r.spec_tokens, 0);
      stats_.accepted.resize(r.spec_tokens, 0);
    }
  }
  const bool want_hidden = drafter_.needs_target_hidden();
  // Appends `token` to sequence i's output; false once the sequence has finished.
  auto emit = [&](int i, int32_t token) {
    Sequence& s = seqs[i];
    if (s.done) return false;
    s.context.push_back(token);
    s.history.AddOutput(token);
    outputs[i].push_back(token);
    const std::vector<int32_t>& stop = requests[i].stop_tokens;
    s.done = static_cast<int>(outputs[i].size()) >= requests[i].max_new_tokens ||
             std::find(stop.begin(), stop.end(), token) != stop.end();
    return !s.done;
  };

  // Prefill: every prompt in one step; the token sampled after it becomes the pending token.
  std::vector<float> logits, hidden;
  {
    std::vector<SequenceStep> batch;
    for (Sequence& s : seqs) batch.push_back({s.context, &s.cache});
    ForwardOptions prefill;
    if (want_hidden) {
      prefill.hidden_out = &hidden;
      prefill.hidden_all_tokens = true;
    }
    status = model_.Forward(batch, prefill, logits);
    std::vector<TargetStep> observed;
    int64_t first_row = 0;
    for (int i = 0; i < n && status.ok(); ++i) {
      const int64_t len = static_cast<int64_t>(requests[i].prompt.size());
      std::span<float> row(logits.data() + i * vocab, vocab);
      const int32_t t = samplers[i].Sample(row, seqs[i].history).token;
      emit(i, t);
      if (requests[i].spec_tokens > 0 && !seqs[i].done) {
        observed.push_back({i, 0, requests[i].prompt,
                            want_hidden
                                ? std::span<const float>(hidden).subspan(first_row * H, len * H)
                                : std::span<const float>(),
                            t});
      }
      first_row += len;
    }
    if (status.ok() && !observed.empty()) {
      const auto start = Clock::now();
      status = drafter_.Observe(observed);
      stats_.draft_seconds += SecondsSince(start);
    }
  }

  while (status.ok()) {
    // Drafts for the speculating sequences, all together.
    std::vector<int> members;
    std::vector<DraftRequest> draft_requests;
    std::vector<int> draft_owner;
    for (int i = 0; i < n; ++i) {
      if (seqs[i].done) continue;
      Sequence& s = seqs[i];
      members.push_back(i);
      s.drafts.clear();
      // No point drafting past the request's end: the bonus token covers the last one.
      const int room = requests[i].max_new_tokens - static_cast<int>(outputs[i].size()) - 1;
      const int k = std::min(requests[i].spec_tokens, room);
      if (k > 0) {
        draft_requests.push_back({i, s.context, k});
        draft_owner.push_back(i);
      }
    }
    if (members.empty()) break;
    if (!draft_requests.empty()) {
      std::vector<std::vector<int32_t>> drafts;
      const auto start = Clock::now();
      status = drafter_.Draft(draft_requests, drafts);
      stats_.draft_seconds += SecondsSince(start);
      if (!status.ok()) break;
      for (size_t r = 0; r < draft_requests.size() && r < drafts.size(); ++r) {
        std::vector<int32_t>& d = drafts[r];
        d.resize(std::min<size_t>(d.size(), static_cast<size_t>(draft_requests[r].k)));
        seqs[draft_owner[r]].drafts = std::move(d);
      }
    }
    std::vector<SequenceStep> batch;
    std::vector<int32_t> start_tokens;
    bool speculating = false;
    for (int i : members) {
      Sequence& s = seqs[i];
      s.step_tokens.assign(1, s.context.back());
      s.step_tokens.insert(s.step_tokens.end(), s.drafts.begin(), s.drafts.end());
      // A speculating sequence's verify step writes its DeltaNet states to the spare slot and
      // leaves those from before the step in its own (no snapshot copy).
      batch.push_back({s.step_tokens, &s.cache, s.drafts.empty() ? -1 : s.spare.state_slot});
      speculating |= !s.drafts.empty();
      start_tokens.push_back(s.cache.num_tokens);
    }
    ForwardOptions verify;
    verify.logits = LogitsMode::kAllTokens;
    verify.keep_state_inputs = speculating;
    if (want_hidden) verify.hidden_out = &hidden;
    // Greedy requests only: the argmax of every row, taken on the device, instead of the rows.
    bool greedy = true;
    for (int i : members) greedy &= samplers[i].ArgmaxOnly();
    std::vector<int32_t> argmax;
    if (greedy) verify.greedy_tokens = &argmax;
    const auto verify_start = Clock::now();
    status = model_.Forward(batch, verify, logits);
    if (speculating) stats_.verify_seconds += SecondsSince(verify_start);
    if (!status.ok()) break;

    // Accept, and collect the sequences that must roll back.
    std::vector<StateReplay> replays;
    std::vector<TargetStep> observed;
    int64_t row = 0;
    for (size_t m = 0; m < members.size(); ++m) {
      const int i = members[m];
      Sequence& s = seqs[i];
      const int d = static_cast<int>(s.drafts.size());
      int accepted = 0;
      int32_t next = 0;
      if (d == 0) {
        next = greedy ? argmax[row]
                      : samplers[i]
                            .Sample(std::span<float>(logits.data() + row * vocab, vocab), s.history)
                            .token;
      } else {
        const DraftVerdict verdict =
            greedy ? VerifyGreedyDrafts(s.drafts, std::span<const int32_t>(argmax).subspan(
                                                      row, static_cast<size_t>(d + 1)))
                   : VerifyDraftsWithSampler(s.drafts,
                                             std::span<float>(logits.data() + row * vocab,
                                                              static_cast<size_t>((d + 1) * vocab)),
                                             samplers[i], s.history);
        accepted = verdict.accepted;
        next = verdict.next;
        ++stats_.verify_steps;
        stats_.emitted_tokens += accepted + 1;
        for (int j = 0; j < d; ++j) {
          ++stats_.proposed[j];
          if (j < accepted) ++stats_.accepted[j];
        }
      }
      bool more = true;
      for (int j = 1; j <= accepted && more; ++j) more = emit(i, s.step_tokens[j]);
      if (more) emit(i, next);
      if (requests[i].spec_tokens > 0 && !s.done) {
        observed.push_back({i, start_tokens[m],
                            std::span<const int32_t>(s.step_tokens).first(accepted + 1),
                            want_hidden ? std::span<const float>(hidden).subspan(
                                              row * H, static_cast<int64_t>(accepted + 1) * H)
                                        : std::span<const float>(),
                            next});
      }
      const int64_t first_row = row;
      row += static_cast<int64_t>(s.step_tokens.size());
      if (d > 0 && accepted == d) {
        // Every draft kept: the spare slot holds the states after them and becomes the
        // sequence's; the old slot is the spare of the next verify step.
        std::swap(s.cache.state_slot, s.spare.state_slot);
      } else if (d > 0 && !s.done) {
        // The states in the spare slot absorbed rejected drafts and cannot be un-applied; the
        // sequence's own slot still holds those from before the step: the accepted tokens'
        // state updates are replayed onto it.
        s.cache.num_tokens = start_tokens[m];
        replays.push_back({&s.cache, static_cast<int>(first_row), accepted + 1});
        ++stats_.rollback_steps;
      }
    }
    if (status.ok() && !replays.empty()) {
      const auto start = Clock::now();
      status = model_.ReplayStateInputs(replays);
      stats_.rollback_seconds += SecondsSince(start);
    }
    if (status.ok() && !observed.empty()) {
      const auto start = Clock::now();
      status = drafter_.Observe(observed);
      stats_.draft_seconds += SecondsSince(start);
    }
  }
  release();
  return status;
}

}  // namespace mobius::worker
