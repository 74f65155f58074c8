#include "worker/runtime/scheduler.h"

#include <algorithm>
#include <limits>

namespace mobius::worker {
namespace {

// The most tokens a chunk of `seq` may have when `score_rows` scored-prompt rows are left.
int ScoreRowLimit(const Sequence& seq, int score_rows) {
  return seq.ScoresPrompt() ? score_rows : std::numeric_limits<int>::max();
}

}  // namespace

int StepPlan::num_tokens() const {
  int n = 0;
  for (const ScheduledChunk& c : chunks) n += c.count;
  return n;
}

Scheduler::Scheduler(const SchedulerOptions& options, PagedKvCache& kv_cache,
                     StateSlotPool& state_slots)
    : options_(options), kv_cache_(kv_cache), state_slots_(state_slots) {}

void Scheduler::InsertWaiting(std::unique_ptr<Sequence> sequence) {
  auto before = [](const std::unique_ptr<Sequence>& a, const std::unique_ptr<Sequence>& b) {
    return a->priority > b->priority || (a->priority == b->priority && a->arrival < b->arrival);
  };
  auto it = std::upper_bound(waiting_.begin(), waiting_.end(), sequence, before);
  waiting_.insert(it, std::move(sequence));
}

void Scheduler::Add(std::unique_ptr<Sequence> sequence) {
  sequence->arrival = next_arrival_++;
  InsertWaiting(std::move(sequence));
}

void Scheduler::ReleaseCaches(Sequence& sequence) {
  kv_cache_.Release(sequence.cache);
  state_slots_.Release(sequence.cache);
  sequence.cache.num_tokens = 0;
  sequence.num_computed = 0;
}

void Scheduler::Preempt(size_t index, StepPlan& plan) {
  std::unique_ptr<Sequence> victim = std::move(running_[index]);
  running_.erase(running_.begin() + index);
  ReleaseCaches(*victim);
  ++victim->num_preemptions;
  plan.preempted.push_back(victim.get());
  InsertWaiting(std::move(victim));
}

StepPlan Scheduler::Schedule() {
  StepPlan plan;
  int budget = options_.max_tokens_per_step;
  int score_rows = options_.max_prompt_score_rows_per_step;  // Sequence::ScoresPrompt chunks
  // Running sequences, oldest and highest priority first, so that preemption takes the newest.
  std::stable_sort(running_.begin(), running_.end(), [](const auto& a, const auto& b) {
    return a->priority > b->priority || (a->priority == b->priority && a->arrival < b->arrival);
  });
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& seq = *running_[i];
    const int remaining = seq.num_tokens() - seq.num_computed;
    const int count = std::min({remaining, budget, ScoreRowLimit(seq, score_rows)});
    if (count <= 0) {
      ++i;
      continue;
    }
    absl::Status reserved = kv_cache_.Reserve(seq.cache, seq.num_computed + count);
    while (!reserved.ok() && running_.size() > i + 1) {
      Preempt(running_.size() - 1, plan);  // the newest, lowest-priority sequence
      reserved = kv_cache_.Reserve(seq.cache, seq.num_computed + count);
    }
    if (!reserved.ok()) {
      // Alone and still too big: give the cache back to the queue's head later.
      Preempt(i, plan);
      continue;
    }
    plan.chunks.push_back({&seq, seq.num_computed, count});
    budget -= count;
    if (seq.ScoresPrompt()) score_rows -= count;
    ++i;
  }

  // Admit waiting sequences in order while the budget, the slots and the blocks allow. A
  // sequence that scores its prompt waits, keeping its place, while the step has no scored rows
  // left; those behind it that score nothing go ahead (the rows are not what they need). Slots and
  // blocks are FCFS: nobody overtakes a head that cannot get them.
  for (auto it = waiting_.begin(); budget > 0 && it != waiting_.end() &&
                                   static_cast<int>(running_.size()) < options_.max_num_seqs;) {
    Sequence& seq = **it;
    if (kv_cache_.num_blocks() > 0 &&
        kv_cache_.BlocksFor(seq.num_tokens() + 1) > kv_cache_.num_blocks()) {
      plan.rejected.push_back(std::move(*it));
      it = waiting_.erase(it);
      continue;
    }
    const int count = std::min({seq.num_tokens(), budget, ScoreRowLimit(seq, score_rows)});
    if (count <= 0) {
      ++it;
      continue;
    }
    if (!state_slots_.Acquire(seq.cache).ok()) break;
    if (!kv_cache_.Reserve(seq.cache, count).ok()) {
      state_slots_.Release(seq.cache);
      break;
    }
    seq.num_computed = 0;
    plan.chunks.push_back({&seq, 0, count});
    budget -= count;
    if (seq.ScoresPrompt()) score_rows -= count;
    running_.push_back(std::move(*it));
    it = waiting_.erase(it);
  }
  return plan;
}

std::unique_ptr<Sequence> Scheduler::Remove(const std::string& request_id) {
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i]->request_id == request_id) {
      std::unique_ptr<Sequence> seq = std::move(running_[i]);
      running_.erase(running_.begin() + i);
      ReleaseCaches(*seq);
      return seq;
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->request_id == request_id) {
      std::unique_ptr<Sequence> seq = std::move(*it);
      waiting_.erase(it);
      return seq;
    }
  }
  return nullptr;
}

std::vector<std::unique_ptr<Sequence>> Scheduler::RemoveAll() {
  std::vector<std::unique_ptr<Sequence>> all;
  for (auto& s : running_) {
    ReleaseCaches(*s);
    all.push_back(std::move(s));
  }
  for (auto& s : waiting_) all.push_back(std::move(s));
  running_.clear();
  waiting_.clear();
  return all;
}

Sequence* Scheduler::Find(const std::string& request_id) {
  for (auto& s : running_) {
    if (s->request_id == request_id) return s.get();
  }
  for (auto& s : waiting_) {
    if (s->request_id == request_id) return s.get();
  }
  return nullptr;
}

int64_t Scheduler::outstanding_tokens() const {
  int64_t n = 0;
  auto add = [&](const Sequence& s) {
    n += s.num_tokens() - s.num_computed;
    n += std::max<int64_t>(0, s.params.max_tokens - static_cast<int64_t>(s.output.size()));
  };
  for (const auto& s : running_) add(*s);
  for (const auto& s : waiting_) add(*s);
  return n;
}

}  // namespace mobius::worker
