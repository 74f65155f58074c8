#include "router/http/choice_fan_out.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

namespace mobius::router::openai {
namespace {

// Messages one call may have waiting for the consumer before it waits too.
constexpr size_t kQueuedPerChoice = 4;
// How often a waiting consumer looks at the client's cancelled flag (the service's calls poll
// theirs at a similar pace).
constexpr auto kCancelPoll = std::chrono::milliseconds(20);

struct Message {
  int choice;
  v1::GenerateResponse response;
};

// What the calls' threads and the consumer share. (std::mutex rather than absl::Mutex: the
// condition waits below have predicates over several fields, which reads plainer this way.)
class FanOutState {
 public:
  explicit FanOutState(size_t choices) : capacity_(kQueuedPerChoice * choices) {}

  // A call's message: waits while the queue is full. False once the calls are stopped.
  bool Push(int choice, const v1::GenerateResponse& response) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [&] { return queue_.size() < capacity_ || stopped_; });
    if (stopped_) return false;
    queue_.push_back(Message{choice, response});
    changed_.notify_all();
    return true;
  }

  void CallStarted() {
    std::lock_guard<std::mutex> lock(mu_);
    ++running_;
  }

  // Call `choice` has returned `status`. The first failure that nothing else caused (a call
  // stopped because a sibling failed or the client left returns CANCELLED, which is not news)
  // stops the rest and becomes the response's status.
  void CallReturned(int choice, const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && !stopped_) {
      failure_ = status;
      failed_choice_ = choice;
      StopLocked(/*client_gone=*/false);
    }
    --running_;
    changed_.notify_all();
  }

  // The consumer's next message; nullopt once every call has returned and the queue is empty.
  // While waiting it stops the calls when `cancelled` (the client's flag) is raised.
  std::optional<Message> Next(const std::atomic<bool>* cancelled) {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      if (cancelled != nullptr && cancelled->load()) StopLocked(/*client_gone=*/true);
      if (!queue_.empty() || running_ == 0) break;
      changed_.wait_for(lock, kCancelPoll);
    }
    if (queue_.empty()) return std::nullopt;
    Message message = std::move(queue_.front());
    queue_.pop_front();
    changed_.notify_all();  // room for a waiting call
    return message;
  }

  // The client can no longer be written to (or never started a call): every call stops.
  void Stop(bool client_gone) {
    std::lock_guard<std::mutex> lock(mu_);
    StopLocked(client_gone);
  }

  bool client_gone() {
    std::lock_guard<std::mutex> lock(mu_);
    return client_gone_;
  }

  // Call `choice` could not start: the response fails with `status` unless something came first.
  void StartFailed(int choice, const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopped_) {
      failure_ = status;
      failed_choice_ = choice;
    }
    StopLocked(/*client_gone=*/false);
  }

  absl::Status Result(int* failed_choice) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_choice != nullptr) *failed_choice = failed_choice_;
    if (!failure_.ok()) return failure_;
    if (client_gone_) return absl::CancelledError("the client went away");
    return absl::OkStatus();
  }

  // The calls' cancelled flag: raised with `stopped_`.
  const std::atomic<bool>* stop_flag() const { return &stop_flag_; }

 private:
  void StopLocked(bool client_gone) {
    if (client_gone) client_gone_ = true;
    stopped_ = true;
    stop_flag_.store(true);
    changed_.notify_all();
  }

  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable changed_;  // a message queued or taken, a call returned, a stop
  std::deque<Message> queue_;
  int running_ = 0;
  bool stopped_ = false;
  bool client_gone_ = false;
  absl::Status failure_;
  int failed_choice_ = -1;
  std::atomic<bool> stop_flag_{false};
};

}  // namespace

absl::Status RunChoices(InferenceService& service, const std::vector<v1::GenerateRequest>& choices,
                        const CallContext& call, const ChoiceConsumer& consume,
                        int* failed_choice) {
  if (choices.size() == 1) {  // no other call to wait beside: this thread makes it
    absl::Status status = service.Generate(
        choices.front(), call, [&](const v1::GenerateResponse& r) { return consume(0, r); });
    if (failed_choice != nullptr) *failed_choice = status.ok() ? -1 : 0;
    return status;
  }
  FanOutState state(choices.size());
  CallContext child;
  child.deadline = call.deadline;
  child.cancelled = state.stop_flag();
  std::vector<std::thread> threads;
  threads.reserve(choices.size());
  // Whatever leaves this function (an exception from `consume` or an allocation included), the
  // calls are stopped and their threads joined before `state` and `child` go away.
  absl::Cleanup join = [&] {
    state.Stop(/*client_gone=*/false);
    for (std::thread& thread : threads) {
      if (thread.joinable()) thread.join();
    }
  };
  for (size_t i = 0; i < choices.size(); ++i) {
    const int choice = static_cast<int>(i);
    state.CallStarted();
    auto run = [&, choice] {
      const absl::Status status =
          service.Generate(choices[choice], child,
                           [&](const v1::GenerateResponse& r) { return state.Push(choice, r); });
      state.CallReturned(choice, status);
    };
    // std::thread reports a failure to start one (a thread limit reached) only by throwing.
    try {
      threads.emplace_back(std::move(run));
    } catch (const std::system_error& e) {
      state.CallReturned(choice, absl::OkStatus());
      state.StartFailed(choice, absl::UnavailableError(absl::StrCat(
                                    "cannot start a thread for choice ", i, " of ", choices.size(),
                                    ": ", e.what(), "; ask for fewer choices (n) or retry")));
      break;
    }
  }
  while (std::optional<Message> message = state.Next(call.cancelled)) {
    // Once the client is gone nothing more is written. After a failure the messages queued before
    // it still are (nothing is queued after it).
    if (state.client_gone()) continue;
    if (!consume(message->choice, message->response)) state.Stop(/*client_gone=*/true);
  }
  for (std::thread& thread : threads) thread.join();
  return state.Result(failed_choice);
}

}  // namespace mobius::router::openai
