#include "router/core/replica_set.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"

namespace mobius::router {
namespace {

// The largest message the router takes from a worker: a whole context's prompt scores with 20
// alternatives a token (~240 bytes each) fit many times over.
constexpr int kMaxWorkerMessageBytes = 256 << 20;

}  // namespace

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

struct ReplicaSet::Replica {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Worker::Stub> worker;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;

  // Guarded by the set's mu_.
  bool healthy = false;
  bool compatible = true;
  bool info_checked = false;
  int64_t outstanding_tokens = 0;
  int64_t requests_sent = 0;
  v1::GetLoadsResponse loads;
};

absl::StatusOr<std::unique_ptr<ReplicaSet>> ReplicaSet::Create(std::vector<std::string> addresses,
                                                               const ReplicaSetOptions& options) {
  if (addresses.empty()) {
    return absl::InvalidArgumentError("no worker replicas: pass at least one --worker HOST:PORT");
  }
  if (options.health_check_interval <= absl::ZeroDuration() ||
      options.health_check_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("health check interval and timeout must be positive");
  }
  std::unique_ptr<ReplicaSet> set(new ReplicaSet(options));
  for (std::string& address : addresses) {
    if (address.empty() || address.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker address \"", address, "\" is not HOST:PORT"));
    }
    for (const auto& r : set->replicas_) {
      if (r->address == address) {
        return absl::InvalidArgumentError(absl::StrCat("worker ", address, " is listed twice"));
      }
    }
    grpc::ChannelArguments args;
    const int max_backoff_ms =
        static_cast<int>(absl::ToInt64Milliseconds(options.max_reconnect_backoff));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(100, max_backoff_ms));
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::min(100, max_backoff_ms));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_backoff_ms);
    // A worker's first message carries a scored prompt's logprobs whole (prompt_logprobs): 20
    // alternatives a token pass gRPC's default 4 MiB from ~18K tokens on.
    args.SetMaxReceiveMessageSize(kMaxWorkerMessageBytes);
    auto replica = std::make_unique<Replica>();
    replica->address = std::move(address);
    replica->channel =
        grpc::CreateCustomChannel(replica->address, grpc::InsecureChannelCredentials(), args);
    replica->worker = v1::Worker::NewStub(replica->channel);
    replica->health = grpc::health::v1::Health::NewStub(replica->channel);
    set->replicas_.push_back(std::move(replica));
  }
  set->poller_ = std::thread([s = set.get()] { s->PollLoop(); });
  return set;
}

ReplicaSet::ReplicaSet(const ReplicaSetOptions& options) : options_(options) {}

ReplicaSet::~ReplicaSet() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (poller_.joinable()) poller_.join();
  PendingAborts& aborts = *pending_aborts_;
  absl::MutexLock lock(&aborts.mu);
  aborts.mu.Await(absl::Condition(
      +[](int* count) { return *count == 0; }, &aborts.count));
}

void ReplicaSet::PollLoop() {
  while (true) {
    const absl::Time next = absl::Now() + options_.health_check_interval;
    PollOnce();
    absl::MutexLock lock(&mu_);
    if (mu_.AwaitWithDeadline(absl::Condition(&stopping_), next)) return;
  }
}

void ReplicaSet::PollOnce() {
  struct Probe {
    grpc::ClientContext health_context;
    HealthCheckRequest health_request;
    HealthCheckResponse health_response;
    grpc::Status health_status;
    grpc::ClientContext loads_context;
    v1::GetLoadsRequest loads_request;
    v1::GetLoadsResponse loads_response;
    grpc::Status loads_status;
  };
  const size_t n = replicas_.size();
  std::vector<Probe> probes(n);
  // All probes run at once, so one slow replica delays no other's verdict.
  absl::BlockingCounter pending(static_cast<int>(2 * n));
  const auto deadline = absl::ToChronoTime(absl::Now() + options_.health_check_timeout);
  for (size_t i = 0; i < n; ++i) {
    Probe& p = probes[i];
    p.health_context.set_deadline(deadline);
    p.loads_context.set_deadline(deadline);
    replicas_[i]->health->async()->Check(&p.health_context, &p.health_request, &p.health_response,
                                         [&p, &pending](grpc::Status s) {
                                           p.health_status = std::move(s);
                                           pending.DecrementCount();
                                         });
    replicas_[i]->worker->async()->GetLoads(&p.loads_context, &p.loads_request, &p.loads_response,
                                            [&p, &pending](grpc::Status s) {
                                              p.loads_status = std::move(s);
                                              pending.DecrementCount();
                                            });
  }
  pending.Wait();

  std::vector<int> need_info;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < n; ++i) {
      Replica& r = *replicas_[i];
      const Probe& p = probes[i];
      const bool healthy =
          p.health_status.ok() && p.health_response.status() == HealthCheckResponse::SERVING;
      if (healthy != r.healthy) {
        if (healthy) {
          MOBIUS_LOG(INFO, "router", "") << "replica " << r.address << " is healthy";
        } else {
          MOBIUS_LOG(WARNING, "router", "")
              << "replica " << r.address << " is unhealthy: "
              << (p.health_status.ok() ? std::string(HealthCheckResponse::ServingStatus_Name(
                                             p.health_response.status()))
                                       : p.health_status.error_message());
        }
      }
      r.healthy = healthy;
      if (p.loads_status.ok()) r.loads = p.loads_response;
      if (healthy && !r.info_checked) need_info.push_back(static_cast<int>(i));
    }
  }
  for (int i : need_info) CheckModelInfo(i);
}

void ReplicaSet::CheckModelInfo(int index) {
  Replica& r = *replicas_[index];
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.health_check_timeout));
  v1::ModelInfo info;
  grpc::Status status = r.worker->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return;  // tried again at the next poll
  absl::MutexLock lock(&mu_);
  r.info_checked = true;
  if (!model_info_) {
    model_info_ = info;
    MOBIUS_LOG(INFO, "router", "")
        << "model " << info.model_name() << " (" << info.model_type() << ", vocabulary "
        << info.vocab_size() << ", context " << info.max_context_length() << ") from " << r.address;
    return;
  }
  if (info.vocab_size() != model_info_->vocab_size() ||
      info.model_type() != model_info_->model_type()) {
    r.compatible = false;
    MOBIUS_LOG(ERROR, "router", "")
        << "replica " << r.address << " serves " << info.model_type() << " with vocabulary "
        << info.vocab_size() << ", not " << model_info_->model_type() << " with vocabulary "
        << model_info_->vocab_size() << "; it gets no requests";
    return;
  }
  if (info.max_context_length() < model_info_->max_context_length()) {
    model_info_->set_max_context_length(info.max_context_length());
  }
}

absl::StatusOr<ReplicaSet::Lease> ReplicaSet::Pick(int64_t prompt_tokens, int64_t max_tokens,
                                                   absl::Span<const int> exclude) {
  absl::MutexLock lock(&mu_);
  const size_t n = replicas_.size();
  const size_t start = round_robin_++ % n;
  int best = -1;
  int64_t best_load = std::numeric_limits<int64_t>::max();
  for (size_t k = 0; k < n; ++k) {
    const int i = static_cast<int>((start + k) % n);
    const Replica& r = *replicas_[i];
    if (!r.healthy || !r.compatible) continue;
    if (std::find(exclude.begin(), exclude.end(), i) != exclude.end()) continue;
    const int64_t load = std::max(r.outstanding_tokens, r.loads.outstanding_tokens());
    if (load < best_load) {
      best = i;
      best_load = load;
    }
  }
  if (best < 0) {
    return absl::UnavailableError(exclude.empty() ? "no healthy worker replica"
                                                  : "no other healthy worker replica to retry on");
  }
  Replica& r = *replicas_[best];
  r.outstanding_tokens += prompt_tokens + max_tokens;
  ++r.requests_sent;
  return Lease(this, best, prompt_tokens, max_tokens);
}

void ReplicaSet::ReportFailure(int replica) {
  absl::MutexLock lock(&mu_);
  Replica& r = *replicas_[replica];
  if (r.healthy) {
    MOBIUS_LOG(WARNING, "router", "")
        << "replica " << r.address << " failed a request; skipped until its next health check";
  }
  r.healthy = false;
}

void ReplicaSet::AbortOnReplica(int replica, const std::string& request_id) {
  struct Call {
    grpc::ClientContext context;
    v1::AbortRequest request;
    v1::AbortResponse response;
  };
  auto* call = new Call;
  call->request.set_request_id(request_id);
  call->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.health_check_timeout));
  {
    absl::MutexLock lock(&pending_aborts_->mu);
    ++pending_aborts_->count;
  }
  Replica& r = *replicas_[replica];
  r.worker->async()->Abort(
      &call->context, &call->request, &call->response,
      [call, address = r.address, pending = pending_aborts_](grpc::Status status) {
        if (!status.ok()) {
          MOBIUS_LOG(WARNING, "router", call->request.request_id())
              << "Abort on replica " << address << " failed: " << status.error_message();
        }
        delete call;
        absl::MutexLock lock(&pending->mu);
        --pending->count;
      });
}

std::optional<v1::ModelInfo> ReplicaSet::model_info() const {
  absl::MutexLock lock(&mu_);
  return model_info_;
}

bool ReplicaSet::AnyHealthy() const {
  absl::MutexLock lock(&mu_);
  for (const auto& r : replicas_) {
    if (r->healthy && r->compatible) return true;
  }
  return false;
}

std::vector<ReplicaSnapshot> ReplicaSet::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<ReplicaSnapshot> out;
  for (const auto& r : replicas_) {
    ReplicaSnapshot s;
    s.address = r->address;
    s.healthy = r->healthy;
    s.compatible = r->compatible;
    s.outstanding_tokens = r->outstanding_tokens;
    s.reported_outstanding_tokens = r->loads.outstanding_tokens();
    s.num_running = r->loads.num_running();
    s.num_waiting = r->loads.num_waiting();
    s.requests_sent = r->requests_sent;
    out.push_back(std::move(s));
  }
  return out;
}

void ReplicaSet::ReleaseTokens(int replica, int64_t tokens) {
  if (tokens <= 0) return;
  absl::MutexLock lock(&mu_);
  replicas_[replica]->outstanding_tokens -= tokens;
}

ReplicaSet::Lease::Lease(ReplicaSet* set, int replica, int64_t prompt_tokens, int64_t max_tokens)
    : set_(set), replica_(replica), prompt_tokens_(prompt_tokens), remaining_tokens_(max_tokens) {}

ReplicaSet::Lease::Lease(Lease&& other) noexcept { *this = std::move(other); }

ReplicaSet::Lease& ReplicaSet::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    set_ = std::exchange(other.set_, nullptr);
    replica_ = std::exchange(other.replica_, -1);
    prompt_tokens_ = std::exchange(other.prompt_tokens_, 0);
    remaining_tokens_ = std::exchange(other.remaining_tokens_, 0);
  }
  return *this;
}

ReplicaSet::Lease::~Lease() { Release(); }

void ReplicaSet::Lease::Release() {
  if (set_ == nullptr) return;
  set_->ReleaseTokens(replica_, prompt_tokens_ + remaining_tokens_);
  set_ = nullptr;
  prompt_tokens_ = remaining_tokens_ = 0;
}

const std::string& ReplicaSet::Lease::address() const { return set_->replicas_[replica_]->address; }

v1::Worker::Stub& ReplicaSet::Lease::worker() const { return *set_->replicas_[replica_]->worker; }

void ReplicaSet::Lease::OnTokens(int64_t n) {
  if (set_ == nullptr || n <= 0) return;
  const int64_t done = prompt_tokens_ + std::min(n, remaining_tokens_);
  remaining_tokens_ -= std::min(n, remaining_tokens_);
  prompt_tokens_ = 0;
  set_->ReleaseTokens(replica_, done);
}

}  // namespace mobius::router
