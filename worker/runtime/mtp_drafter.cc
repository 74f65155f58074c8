#include "worker/runtime/mtp_drafter.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "worker/model/mtp_draft_model.h"

namespace mobius::worker {

void ApplyMtpHeadCapture(const HybridModel& target, HybridModel& head) {
  // The head shares the target's backend and so its capture pool: replaying a head step
  // overwrites the tensors of the target's last replay (logits, hidden rows, kept state inputs).
  // The speculative decoder and the engine read those before the head runs; keep it so
  // (CudaSpeculativeTest.RecordedTargetAndHeadStepsMatchOpByOpSteps runs both recorded).
  bool record = true;
  if (const char* env = std::getenv("MOBIUS_MTP_HEAD_GRAPHS"); env != nullptr && env[0] != '\0') {
    const std::string_view value(env);
    if (value == "0") {
      record = false;
    } else if (value != "1") {
      std::fprintf(stderr,
                   "mobius: MOBIUS_MTP_HEAD_GRAPHS=%s ignored (accepted: 0, 1); head steps are "
                   "recorded\n",
                   env);
    }
  }
  // On a sharded replica the leader's head has never run recorded on GPUs (no machine of several
  // GPUs has been lent): it keeps running op by op there.
  if (target.shard().sharded()) record = false;
  head.SetDecodeCapture(record ? target.decode_capture_max_batch() : 0);
}

absl::StatusOr<std::unique_ptr<MtpDrafter>> MtpDrafter::Create(const HybridModel& target,
                                                               int max_sequences, int max_tokens,
                                                               DraftVocabulary vocabulary) {
  ASSIGN_OR_RETURN(std::unique_ptr<HybridModel> head, MakeMtpDraftModel(target, vocabulary.ids()));
  RETURN_IF_ERROR(head->CreateCaches(max_sequences, max_tokens));
  ApplyMtpHeadCapture(target, *head);
  return std::unique_ptr<MtpDrafter>(new MtpDrafter(std::move(head), std::move(vocabulary)));
}

absl::Status MtpDrafter::Step(std::span<SequenceStep> batch, const std::vector<float>& h_prev,
                              std::span<Sequence* const> targets) {
  ForwardOptions options;
  options.draft_hidden_in = &h_prev;
  std::vector<float> hidden, logits;
  std::vector<int32_t> greedy;
  options.hidden_out = &hidden;
  options.greedy_tokens = &greedy;  // the head drafts greedily: only the argmax leaves the device
  RETURN_IF_ERROR(head_->Forward(batch, options, logits));
  const int64_t H = head_->config().hidden_size;
  if (greedy.size() < targets.size()) {
    return absl::InternalError(absl::StrFormat("MTP head: %d draft tokens for %d sequences",
                                               greedy.size(), targets.size()));
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    const int32_t token = vocabulary_.TokenOfRow(greedy[i]);
    if (token < 0) {
      return absl::InternalError(
          absl::StrFormat("MTP head: draft row %d is outside its logits", greedy[i]));
    }
    targets[i]->first_draft = token;
    targets[i]->h.assign(hidden.begin() + i * H, hidden.begin() + (i + 1) * H);
  }
  return absl::OkStatus();
}

absl::Status MtpDrafter::Observe(std::span<const TargetStep> steps) {
  const int64_t H = head_->config().hidden_size;
  std::vector<SequenceStep> batch;
  std::vector<std::vector<int32_t>> tokens(steps.size());
  std::vector<Sequence*> targets;
  std::vector<float> h_prev;
  for (size_t i = 0; i < steps.size(); ++i) {
    const TargetStep& step = steps[i];
    const int64_t n = static_cast<int64_t>(step.tokens.size());
    if (n == 0 || static_cast<int64_t>(step.hidden.size()) != n * H) {
      return absl::InvalidArgumentError(
          absl::StrFormat("MTP observe: sequence %d has %d tokens and %d hidden values (H = %d)",
                          step.sequence, n, step.hidden.size(), H));
    }
    auto it = sequences_.find(step.sequence);
    if (it == sequences_.end()) {
      // A sequence the head has not seen from its first position (it was forgotten after a gap,
      // or this is not its first step) gets no drafts: no head slot is taken for it.
      if (step.start > 0) continue;
      it = sequences_.try_emplace(step.sequence).first;
      if (!head_->StartSequence(it->second.cache).ok()) {
        // No head slot: this sequence decodes without drafts; the others still observe.
        sequences_.erase(it);
        continue;
      }
    }
    Sequence& s = it->second;
    if (step.start > s.cache.num_tokens) {
      // A gap (an earlier observation of this sequence failed): its drafts could only be noise,
      // so forget it: the sequence decodes without drafts from here on.
      Finish(step.sequence);
      continue;
    }
    // Positions past `start` hold the previous step's drafts: overwrite them.
    s.cache.num_tokens = step.start;
    // Entry p pairs the token at p + 1 with the target's hidden state at p.
    tokens[i].assign(step.tokens.begin() + 1, step.tokens.end());
    tokens[i].push_back(step.next);
    h_prev.insert(h_prev.end(), step.hidden.begin(), step.hidden.end());
    batch.push_back({tokens[i], &s.cache});
    targets.push_back(&s);
  }
  if (batch.empty()) return absl::OkStatus();
  return Step(batch, h_prev, targets);
}

absl::Status MtpDrafter::Draft(std::span<const DraftRequest> requests,
                               std::vector<std::vector<int32_t>>& drafts) {
  drafts.assign(requests.size(), {});
  std::vector<Sequence*> seqs(requests.size());
  std::vector<int> committed(requests.size());
  int max_k = 0;
  for (size_t r = 0; r < requests.size(); ++r) {
    auto it = sequences_.find(requests[r].sequence);
    if (it == sequences_.end() || it->second.first_draft < 0) {
      continue;  // never observed, or forgotten after a gap: no drafts, it decodes plainly
    }
    seqs[r] = &it->second;
    committed[r] = seqs[r]->cache.num_tokens;
    if (requests[r].k > 0) drafts[r].push_back(seqs[r]->first_draft);
    max_k = std::max(max_k, requests[r].k);
  }
  // Chained drafts: (previous draft, the head's own output) at the next position. The chain's
  // outputs stay out of the Sequence: its h and first draft are those of committed positions.
  std::vector<std::vector<float>> chain_h(requests.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    if (seqs[r] != nullptr) chain_h[r] = seqs[r]->h;
  }
  absl::Status status;
  for (int j = 1; j < max_k && status.ok(); ++j) {
    std::vector<SequenceStep> batch;
    std::vector<float> h_prev;
    std::vector<int32_t> inputs;
    inputs.reserve(requests.size());
    std::vector<size_t> owners;
    for (size_t r = 0; r < requests.size(); ++r) {
      if (seqs[r] == nullptr || requests[r].k <= j) continue;
      inputs.push_back(drafts[r].back());
      h_prev.insert(h_prev.end(), chain_h[r].begin(), chain_h[r].end());
      batch.push_back({std::span<const int32_t>(&inputs.back(), 1), &seqs[r]->cache});
      owners.push_back(r);
    }
    if (batch.empty()) break;
    std::vector<Sequence> outs(owners.size());
    std::vector<Sequence*> out_ptrs;
    for (Sequence& s : outs) out_ptrs.push_back(&s);
    status = Step(batch, h_prev, out_ptrs);
    for (size_t t = 0; t < owners.size() && status.ok(); ++t) {
      drafts[owners[t]].push_back(outs[t].first_draft);
      chain_h[owners[t]] = std::move(outs[t].h);
    }
  }
  for (size_t r = 0; r < requests.size(); ++r) {
    if (seqs[r] != nullptr) seqs[r]->cache.num_tokens = committed[r];
  }
  return status;
}

void MtpDrafter::Finish(int64_t sequence) {
  auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return;
  head_->ReleaseSequence(it->second.cache);
  sequences_.erase(it);
}

}  // namespace mobius::worker
