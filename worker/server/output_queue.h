// Hands a request's outputs from the engine thread to the gRPC thread that streams them.
#ifndef MOBIUS_WORKER_SERVER_OUTPUT_QUEUE_H_
#define MOBIUS_WORKER_SERVER_OUTPUT_QUEUE_H_

#include <deque>
#include <optional>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/runtime/engine.h"

namespace mobius::worker {

class OutputQueue {
 public:
  void Push(const GenerationOutput& output) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(output);
  }
  // The next output, or nullopt after `timeout` with nothing queued.
  std::optional<GenerationOutput> Pop(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) return std::nullopt;
    GenerationOutput out = std::move(queue_.front());
    queue_.pop_front();
    return out;
  }

 private:
  absl::Mutex mu_;
  std::deque<GenerationOutput> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_SERVER_OUTPUT_QUEUE_H_
