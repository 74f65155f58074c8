#include "worker/distributed/rendezvous.h"

#include <grpcpp/grpcpp.h>

#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "rendezvous.grpc.pb.h"
#include "worker/distributed/ucx_communicator.h"
#ifdef MOBIUS_HAVE_NCCL
#include "worker/distributed/nccl_communicator.h"
#endif

namespace mobius::worker {
namespace {

std::string_view TransportName(Transport t) {
  switch (t) {
    case Transport::kUcx:
      return "ucx";
    case Transport::kNccl:
      return "nccl";
  }
  return "?";
}

// The failure of a formed group, raised once: by the leader's monitor, a heartbeat's answer, an
// unreachable leader. It aborts the communicator and tells the worker.
class GroupHealth {
 public:
  explicit GroupHealth(std::function<void(const absl::Status&)> on_failure)
      : on_failure_(std::move(on_failure)) {}

  void Attach(Communicator* comm) {
    absl::MutexLock lock(&mu_);
    comm_ = comm;
    if (!failed_.ok()) comm_->Abort(failed_);
  }

  // The worker hears first (it reports NOT_SERVING), then the collectives in flight fail.
  void Fail(const absl::Status& reason) {
    Communicator* comm;
    {
      absl::MutexLock lock(&mu_);
      if (!failed_.ok()) return;
      failed_ = reason;
      comm = comm_;
    }
    if (on_failure_) on_failure_(reason);
    if (comm != nullptr) comm->Abort(reason);
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

 private:
  std::function<void(const absl::Status&)> on_failure_;
  absl::Mutex mu_;
  Communicator* comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

// The leader's side: collects the endpoints, then watches the heartbeats.
class LeaderService final : public v1::Rendezvous::Service {
 public:
  LeaderService(const RendezvousOptions& options, std::string own_endpoint)
      : options_(options),
        endpoints_(options.world_size),
        joined_(options.world_size, false),
        left_(options.world_size, false),
        last_seen_(options.world_size) {
    endpoints_[0] = std::move(own_endpoint);
    joined_[0] = true;
    joined_count_ = 1;
  }

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinRequest* req,
                    v1::JoinResponse* resp) override {
    if (req->generation() < options_.generation) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrFormat("rank %d is of generation %d; the group is at %d",
                                          req->rank(), req->generation(), options_.generation));
    }
    if (req->generation() > options_.generation) {
      return grpc::Status(grpc::StatusCode::ABORTED,
                          absl::StrFormat("the leader is of generation %d, older than the "
                                          "joining rank's %d",
                                          options_.generation, req->generation()));
    }
    if (req->world_size() != options_.world_size || req->rank() <= 0 ||
        req->rank() >= options_.world_size ||
        req->transport() != TransportName(options_.transport)) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrFormat("rank %d of %d over %s does not fit the group (%d ranks over %s)",
                          req->rank(), req->world_size(), req->transport(), options_.world_size,
                          TransportName(options_.transport)));
    }
    absl::MutexLock lock(&mu_);
    if (formed_) {
      // The rank restarted after the group formed: its peers' state is gone with it. The
      // liveness check fails the group on the leader's side.
      if (failed_.ok()) {
        failed_ = absl::AbortedError(
            absl::StrFormat("rank %d joined again after the group formed", req->rank()));
      }
      return grpc::Status(grpc::StatusCode::ABORTED, failed_.ToString());
    }
    if (!joined_[req->rank()]) ++joined_count_;
    joined_[req->rank()] = true;  // a retried join replaces the endpoint
    endpoints_[req->rank()] = req->endpoint();
    if (joined_count_ == options_.world_size) {
      formed_ = true;
      for (absl::Time& t : last_seen_) t = absl::Now();
    }
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return formed_ || !failed_.ok() || cancelled_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&done), deadline_);
    if (!formed_) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrFormat("%d of %d ranks joined before the leader's deadline",
                                          joined_count_, options_.world_size));
    }
    resp->set_generation(options_.generation);
    for (const std::string& e : endpoints_) resp->add_endpoints(e);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    absl::MutexLock lock(&mu_);
    if (req->generation() != options_.generation || req->rank() <= 0 ||
        req->rank() >= options_.world_size) {
      resp->set_group_ok(false);
      resp->set_reason(absl::StrFormat("rank %d of generation %d is not in this group (%d)",
                                       req->rank(), req->generation(), options_.generation));
      return grpc::Status::OK;
    }
    last_seen_[req->rank()] = absl::Now();
    if (req->leaving()) left_[req->rank()] = true;
    resp->set_group_ok(failed_.ok());
    if (!failed_.ok()) resp->set_reason(failed_.ToString());
    return grpc::Status::OK;
  }

  // The leader's own wait for the group, bounded by the join deadline.
  absl::StatusOr<std::vector<std::string>> AwaitGroup(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    deadline_ = deadline;
    if (joined_count_ == options_.world_size) formed_ = true;
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return formed_ || !failed_.ok(); };
    mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
    if (!failed_.ok()) return failed_;
    if (!formed_) {
      std::string missing;
      for (int r = 0; r < options_.world_size; ++r) {
        if (!joined_[r]) absl::StrAppend(&missing, missing.empty() ? "" : ",", r);
      }
      return absl::DeadlineExceededError(absl::StrFormat(
          "rendezvous: %d of %d ranks joined within %s (missing ranks %s)", joined_count_,
          options_.world_size, absl::FormatDuration(options_.join_timeout), missing));
    }
    return endpoints_;
  }

  // One pass of the liveness check; fails the group when a rank went quiet.
  void CheckLiveness(GroupHealth& health) {
    absl::Status stale;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (int r = 1; r < options_.world_size && failed_.ok(); ++r) {
        if (left_[r] || now - last_seen_[r] <= options_.heartbeat_timeout) continue;
        failed_ = absl::UnavailableError(
            absl::StrFormat("rank %d sent no heartbeat for %s (timeout %s)", r,
                            absl::FormatDuration(now - last_seen_[r]),
                            absl::FormatDuration(options_.heartbeat_timeout)));
      }
      stale = failed_;
    }
    if (!stale.ok()) health.Fail(stale);
  }

  // Called when the local communicator failed: the other ranks learn it from their heartbeats.
  void RecordFailure(const absl::Status& reason) {
    absl::MutexLock lock(&mu_);
    if (failed_.ok()) failed_ = reason;
  }

  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }

 private:
  const RendezvousOptions options_;
  absl::Mutex mu_;
  std::vector<std::string> endpoints_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> joined_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> left_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> last_seen_ ABSL_GUARDED_BY(mu_);
  int joined_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool formed_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

// This rank's communicator, with the rendezvous session it depends on: the leader's service or
// the heartbeats to the leader. Destroying it stops the watch first, then the transport.
class ReplicaCommunicator final : public Communicator {
 public:
  explicit ReplicaCommunicator(const RendezvousOptions& options)
      : options_(options), health_(options.on_failure) {}

  // The transport, once created (before Form() for UCX, after it for NCCL, whose unique id
  // comes out of the rendezvous).
  void SetTransport(std::unique_ptr<Communicator> comm) {
    comm_ = std::move(comm);
    health_.Attach(comm_.get());
  }

  ~ReplicaCommunicator() override {
    stop_.Notify();
    if (watcher_.joinable()) watcher_.join();
    if (leader_ != nullptr) leader_->Cancel();
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  absl::Status Form(const std::string& endpoint, std::vector<std::string>& endpoints) {
    const absl::Time deadline = absl::Now() + options_.join_timeout;
    if (options_.world_size == 1) {  // a group of one: nobody to meet or watch
      endpoints = {endpoint};
      return absl::OkStatus();
    }
    if (options_.rank == 0) {
      leader_ = std::make_unique<LeaderService>(options_, endpoint);
      std::string listen = options_.listen_address;
      if (listen.empty()) {
        std::vector<std::string> parts = absl::StrSplit(options_.leader, absl::MaxSplits(':', 1));
        if (parts.size() != 2) {
          return absl::InvalidArgumentError(
              absl::StrFormat("--leader '%s' is not HOST:PORT", options_.leader));
        }
        listen = "0.0.0.0:" + parts[1];
      }
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(leader_.get());
      server_ = builder.BuildAndStart();
      if (server_ == nullptr || port == 0) {
        return absl::UnavailableError(
            absl::StrFormat("rendezvous leader cannot listen on %s", listen));
      }
      absl::StatusOr<std::vector<std::string>> all = leader_->AwaitGroup(deadline);
      if (!all.ok()) return all.status();
      endpoints = *std::move(all);
      return absl::OkStatus();
    }
    // Ranks usually start before their leader listens: retry the connection every 100 ms to
    // 1 s rather than gRPC's default backoff from 1 s up to 2 min.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    channel_ = grpc::CreateCustomChannel(options_.leader, grpc::InsecureChannelCredentials(), args);
    stub_ = v1::Rendezvous::NewStub(channel_);
    v1::JoinRequest req;
    req.set_generation(options_.generation);
    req.set_rank(options_.rank);
    req.set_world_size(options_.world_size);
    req.set_transport(std::string(TransportName(options_.transport)));
    req.set_endpoint(endpoint);
    while (true) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      ctx.set_wait_for_ready(true);  // the leader may start after us
      v1::JoinResponse resp;
      grpc::Status s = stub_->Join(&ctx, req, &resp);
      if (s.ok()) {
        if (resp.endpoints_size() != options_.world_size) {
          return absl::InternalError(
              absl::StrFormat("rendezvous: leader sent %d endpoints for %d ranks",
                              resp.endpoints_size(), options_.world_size));
        }
        endpoints.assign(resp.endpoints().begin(), resp.endpoints().end());
        return absl::OkStatus();
      }
      // A leader restarting between our connection and its answer: try again while time is left.
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(100));
        continue;
      }
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrFormat("rendezvous with leader %s as rank %d: %s",
                                          options_.leader, options_.rank, s.error_message()));
    }
  }

  void StartWatch() {
    if (options_.world_size == 1) return;
    watcher_ = std::thread([this] { options_.rank == 0 ? WatchRanks() : Heartbeat(); });
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  absl::Status AllReduceSum(kernels::Tensor& t) override { return Watched(comm_->AllReduceSum(t)); }
  absl::Status AllGather(const kernels::Tensor& in, kernels::Tensor& out) override {
    return Watched(comm_->AllGather(in, out));
  }
  absl::Status ReduceScatterSum(const kernels::Tensor& in, kernels::Tensor& out) override {
    return Watched(comm_->ReduceScatterSum(in, out));
  }
  absl::Status Broadcast(kernels::Tensor& t, int root) override {
    return Watched(comm_->Broadcast(t, root));
  }
  absl::Status BroadcastBytesFor(std::string& bytes, int root, absl::Duration timeout) override {
    return Watched(comm_->BroadcastBytesFor(bytes, root, timeout));
  }
  void Abort(const absl::Status& reason) override {
    if (leader_ != nullptr) leader_->RecordFailure(reason);
    health_.Fail(reason);
  }

 private:
  // A transport failure (a peer's endpoint broke, a timeout) fails the group as a whole.
  absl::Status Watched(absl::Status s) {
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) {
      if (leader_ != nullptr) leader_->RecordFailure(s);
      health_.Fail(s);
    }
    return s;
  }

  void WatchRanks() {
    while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
      leader_->CheckLiveness(health_);
    }
  }

  void Heartbeat() {
    absl::Time last_ok = absl::Now();
    bool leaving = false;
    while (true) {
      leaving = stop_.WaitForNotificationWithTimeout(options_.heartbeat_interval);
      v1::HeartbeatRequest req;
      req.set_generation(options_.generation);
      req.set_rank(options_.rank);
      req.set_leaving(leaving);
      v1::HeartbeatResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.heartbeat_interval));
      grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
      if (leaving) return;
      if (s.ok()) {
        last_ok = absl::Now();
        if (!resp.group_ok())
          health_.Fail(absl::UnavailableError(
              absl::StrFormat("the leader failed the group: %s", resp.reason())));
      } else if (absl::Now() - last_ok > options_.heartbeat_timeout) {
        health_.Fail(absl::UnavailableError(
            absl::StrFormat("leader %s unreachable for %s: %s", options_.leader,
                            absl::FormatDuration(absl::Now() - last_ok), s.error_message())));
      }
    }
  }

  const RendezvousOptions options_;
  std::unique_ptr<Communicator> comm_;
  GroupHealth health_;
  std::unique_ptr<LeaderService> leader_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
  absl::Notification stop_;
  std::thread watcher_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> JoinReplica(const RendezvousOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrFormat("rendezvous: rank %d outside a world of %d",
                                                      options.rank, options.world_size));
  }
  if (options.world_size > 1 && options.leader.empty()) {
    return absl::InvalidArgumentError("rendezvous: --leader HOST:PORT is required");
  }
  switch (options.transport) {
    case Transport::kUcx: {
      absl::StatusOr<std::unique_ptr<UcxCommunicator>> ucx =
          UcxCommunicator::Create(options.rank, options.world_size, options.collective_timeout);
      if (!ucx.ok()) return ucx.status();
      UcxCommunicator* transport = ucx->get();
      const std::string endpoint = transport->address();
      auto replica = std::make_unique<ReplicaCommunicator>(options);
      replica->SetTransport(*std::move(ucx));
      std::vector<std::string> endpoints;
      if (absl::Status s = replica->Form(endpoint, endpoints); !s.ok()) return s;
      if (absl::Status s = transport->Connect(endpoints); !s.ok()) return s;
      replica->StartWatch();
      return replica;
    }
    case Transport::kNccl: {
#ifdef MOBIUS_HAVE_NCCL
      if (options.backend == nullptr) {
        return absl::InvalidArgumentError("rendezvous: NCCL needs the CUDA backend");
      }
      std::string endpoint;
      if (options.rank == 0) {
        absl::StatusOr<std::string> id = NcclUniqueId();
        if (!id.ok()) return id.status();
        endpoint = *std::move(id);
      }
      auto replica = std::make_unique<ReplicaCommunicator>(options);
      std::vector<std::string> endpoints;
      if (absl::Status s = replica->Form(endpoint, endpoints); !s.ok()) return s;
      absl::StatusOr<std::unique_ptr<Communicator>> nccl =
          CreateNcclCommunicator(options.rank, options.world_size, endpoints[0], *options.backend,
                                 options.collective_timeout);
      if (!nccl.ok()) return nccl.status();
      replica->SetTransport(*std::move(nccl));
      replica->StartWatch();
      return replica;
#else
      return absl::UnimplementedError("rendezvous: this build has no NCCL (no CUDA toolkit)");
#endif
    }
  }
  return absl::InvalidArgumentError("rendezvous: unknown transport");
}

}  // namespace mobius::worker
