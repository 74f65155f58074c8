#include "worker/runtime/speculative_decoder.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace mobius::worker {
namespace {

int32_t ArgmaxRow(const std::vector<float>& logits, int64_t row, int64_t vocab) {
  const float* r = logits.data() + row * vocab;
  return static_cast<int32_t>(std::max_element(r, r + vocab) - r);
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

void SpeculativeDecoder::CopyStateSlot(int32_t from, int32_t to) {
  StateSlotPool& pool = *model_.state_slots();
  const int32_t rows[1] = {from};
  for (int l = 0; l < pool.num_layers(); ++l) {
    for (kernels::Tensor* states : {&pool.conv_states(l), &pool.recurrent_states(l)}) {
      const int64_t slots = states->shape()[0];
      const kernels::Tensor all = states->Reshape({slots, states->numel() / slots});
      kernels::Tensor dst = all.Rows(to, 1);
      model_.backend().GatherRows(all, rows, dst);
    }
  }
}

absl::Status SpeculativeDecoder::Generate(std::span<const SpeculativeRequest> requests,
                                          std::vector<std::vector<int32_t>>& outputs) {
  const int n = static_cast<int>(requests.size());
  const int64_t vocab = model_.config().vocab_size;
  if (model_.state_slots() == nullptr || model_.kv_cache() == nullptr) {
    return absl::FailedPreconditionError("speculative decoding: the model has no caches");
  }
  struct Sequence {
    SequenceCache cache;
    SequenceCache snapshot;        // spare state slot (speculating sequences only)
    std::vector<int32_t> context;  // prompt + generated tokens (the pending one last)
    std::vector<int32_t> step_tokens;
    int drafts = 0;  // drafts in this step's tokens
  };
  std::vector<Sequence> seqs(n);
  outputs.assign(n, {});
  auto release = [&] {
    for (Sequence& s : seqs) {
      model_.ReleaseSequence(s.cache);
      model_.ReleaseSequence(s.snapshot);
    }
  };
  absl::Status status;
  for (int i = 0; i < n && status.ok(); ++i) {
    if (requests[i].prompt.empty()) {
      status = absl::InvalidArgumentError(absl::StrFormat("request %d: empty prompt", i));
      break;
    }
    if (requests[i].spec_tokens < 0) {
      status = absl::InvalidArgumentError(absl::StrFormat(
          "request %d: spec_tokens (%d) must not be negative", i, requests[i].spec_tokens));
      break;
    }
    status = model_.StartSequence(seqs[i].cache);
    if (status.ok() && requests[i].spec_tokens > 0) status = model_.StartSequence(seqs[i].snapshot);
    seqs[i].context = requests[i].prompt;
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

  // Prefill: every prompt in one step; the greedy token after it becomes the pending token.
  std::vector<float> logits;
  {
    std::vector<SequenceStep> batch;
    for (Sequence& s : seqs) batch.push_back({s.context, &s.cache});
    status = model_.Forward(batch, ForwardOptions{}, logits);
    for (int i = 0; i < n && status.ok(); ++i) {
      const int32_t t = ArgmaxRow(logits, i, vocab);
      seqs[i].context.push_back(t);
      outputs[i].push_back(t);
    }
  }

  auto active = [&](int i) {
    return static_cast<int>(outputs[i].size()) < requests[i].max_new_tokens;
  };
  while (status.ok()) {
    std::vector<SequenceStep> batch;
    std::vector<int> members;
    for (int i = 0; i < n; ++i) {
      if (!active(i)) continue;
      Sequence& s = seqs[i];
      s.step_tokens.assign(1, s.context.back());
      // No point drafting past the request's end: the bonus token covers the last one.
      const int room = requests[i].max_new_tokens - static_cast<int>(outputs[i].size()) - 1;
      const int k = std::min(requests[i].spec_tokens, room);
      s.drafts = 0;
      if (k > 0) {
        std::vector<int32_t> d = drafter_.Draft(i, s.context, k);
        d.resize(std::min<size_t>(d.size(), static_cast<size_t>(k)));
        s.drafts = static_cast<int>(d.size());
        s.step_tokens.insert(s.step_tokens.end(), d.begin(), d.end());
        if (s.drafts > 0) CopyStateSlot(s.cache.state_slot, s.snapshot.state_slot);
      }
      batch.push_back({s.step_tokens, &s.cache});
      members.push_back(i);
    }
    if (batch.empty()) break;
    std::vector<int32_t> start_tokens;
    for (int i : members) start_tokens.push_back(seqs[i].cache.num_tokens);
    ForwardOptions verify;
    verify.logits = LogitsMode::kAllTokens;
    status = model_.Forward(batch, verify, logits);
    if (!status.ok()) break;

    // Accept, and collect the sequences that must roll back and recompute.
    std::vector<SequenceStep> redo;
    std::vector<std::vector<int32_t>> redo_tokens;
    redo_tokens.reserve(members.size());
    int64_t row = 0;
    for (size_t m = 0; m < members.size(); ++m) {
      const int i = members[m];
      Sequence& s = seqs[i];
      int accepted = 0;
      int32_t next = ArgmaxRow(logits, row, vocab);
      while (accepted < s.drafts && s.step_tokens[accepted + 1] == next) {
        ++accepted;
        next = ArgmaxRow(logits, row + accepted, vocab);
      }
      row += static_cast<int64_t>(s.step_tokens.size());
      if (s.drafts > 0) {
        ++stats_.verify_steps;
        stats_.emitted_tokens += accepted + 1;
        for (int p = 0; p < s.drafts; ++p) {
          ++stats_.proposed[p];
          if (p < accepted) ++stats_.accepted[p];
        }
      }
      for (int p = 1; p <= accepted; ++p) {
        s.context.push_back(s.step_tokens[p]);
        outputs[i].push_back(s.step_tokens[p]);
      }
      s.context.push_back(next);
      outputs[i].push_back(next);
      if (accepted < s.drafts) {
        // The DeltaNet state has absorbed rejected drafts and cannot be un-applied: restore the
        // snapshot taken before the verify step and recompute the accepted tokens.
        CopyStateSlot(s.snapshot.state_slot, s.cache.state_slot);
        s.cache.num_tokens = start_tokens[m];
        redo_tokens.emplace_back(s.step_tokens.begin(), s.step_tokens.begin() + accepted + 1);
        redo.push_back({redo_tokens.back(), &s.cache});
        ++stats_.recompute_steps;
      }
    }
    if (!redo.empty()) {
      std::vector<float> unused;
      ForwardOptions recompute;
      recompute.copy_logits = false;
      status = model_.Forward(redo, recompute, unused);
    }
  }
  for (int i = 0; i < n; ++i) {
    if (static_cast<int>(outputs[i].size()) > requests[i].max_new_tokens) {
      outputs[i].resize(requests[i].max_new_tokens);
    }
  }
  release();
  return status;
}

}  // namespace mobius::worker
