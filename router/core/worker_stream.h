// One mobius.v1.Worker Generate stream read by a request thread that must also watch for
// cancellation, aborts and deadlines: the gRPC callback API delivers messages, and Next() waits for
// the next one with a timeout, so the caller can poll its flags between messages. Reads are
// pulled (one outstanding at a time), so a slow client slows the worker stream instead of
// buffering without bound.
#ifndef MOBIUS_ROUTER_CORE_WORKER_STREAM_H_
#define MOBIUS_ROUTER_CORE_WORKER_STREAM_H_

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/client_callback.h"
#include "worker.grpc.pb.h"

namespace mobius::router {

class WorkerStream final : public grpc::ClientReadReactor<v1::WorkerGenerateResponse> {
 public:
  enum class Event { kMessage, kEnd, kTimeout };

  // Starts the call at once. `stub` must outlive this object.
  WorkerStream(v1::Worker::Stub& stub, const v1::WorkerGenerateRequest& request,
               absl::Time deadline);
  // Cancels the call when it is still running and waits for gRPC to release it.
  ~WorkerStream() override;

  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;

  // Waits until the next message arrives (kMessage, stored in `out`), the stream has no more
  // messages (kEnd; then call Finish), or `wake_by` passes (kTimeout).
  Event Next(absl::Time wake_by, v1::WorkerGenerateResponse* out);

  // Cancels the call (thread-safe, idempotent); the worker frees the request's slot.
  void Cancel();
  [[nodiscard]] bool cancelled_by_us() const { return cancelled_.load(); }

  // Stops reading and waits for the call's final status. Idempotent.
  grpc::Status Finish();

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  void ReleaseHold() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  grpc::ClientContext context_;
  v1::WorkerGenerateRequest request_;
  v1::WorkerGenerateResponse message_;  // written by gRPC while a read is outstanding
  std::atomic<bool> cancelled_{false};

  absl::Mutex mu_;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ok_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  // OnDone's status, published by done_ (which, unlike a mutex, may be destroyed as soon as a
  // waiter has seen it notified).
  grpc::Status status_;
  absl::Notification done_;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_WORKER_STREAM_H_
