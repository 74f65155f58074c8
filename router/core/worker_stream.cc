#include "router/core/worker_stream.h"

#include <utility>

namespace mobius::router {

WorkerStream::WorkerStream(v1::Worker::Stub& stub, const v1::WorkerGenerateRequest& request,
                           absl::Time deadline)
    : request_(request) {
  if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
  stub.async()->Generate(&context_, &request_, this);
  // Reads after the first are started from the caller's thread, outside a reaction: the hold
  // keeps gRPC from finishing the call until the caller says it will read no more.
  AddHold();
  StartRead(&message_);
  StartCall();
}

WorkerStream::~WorkerStream() {
  if (!done_.HasBeenNotified()) Cancel();
  Finish();
}

WorkerStream::Event WorkerStream::Next(absl::Time wake_by, v1::WorkerGenerateResponse* out) {
  {
    absl::MutexLock lock(&mu_);
    if (hold_released_) return Event::kEnd;
    if (!mu_.AwaitWithDeadline(absl::Condition(&read_done_), wake_by)) return Event::kTimeout;
    read_done_ = false;
    if (!read_ok_) {
      ReleaseHold();
      return Event::kEnd;
    }
    *out = std::move(message_);
    message_.Clear();
  }
  StartRead(&message_);
  return Event::kMessage;
}

void WorkerStream::Cancel() {
  cancelled_.store(true);
  context_.TryCancel();
}

grpc::Status WorkerStream::Finish() {
  {
    absl::MutexLock lock(&mu_);
    ReleaseHold();
  }
  done_.WaitForNotification();
  return status_;
}

void WorkerStream::ReleaseHold() {
  if (hold_released_) return;
  hold_released_ = true;
  RemoveHold();
}

void WorkerStream::OnReadDone(bool ok) {
  absl::MutexLock lock(&mu_);
  read_done_ = true;
  read_ok_ = ok;
}

void WorkerStream::OnDone(const grpc::Status& status) {
  status_ = status;
  done_.Notify();
}

}  // namespace mobius::router
