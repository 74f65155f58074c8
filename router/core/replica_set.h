// The worker replicas a router sends requests to: one gRPC channel per replica, a background
// health/load poller, and the least-outstanding-tokens choice of where the next request goes.
#ifndef MOBIUS_ROUTER_CORE_REPLICA_SET_H_
#define MOBIUS_ROUTER_CORE_REPLICA_SET_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "worker.grpc.pb.h"

namespace mobius::router {

struct ReplicaSetOptions {
  // How often every replica gets a grpc.health.v1 Check and a Worker.GetLoads.
  absl::Duration health_check_interval = absl::Milliseconds(200);
  // Deadline of each probe; a replica that does not answer within it counts as unhealthy.
  absl::Duration health_check_timeout = absl::Milliseconds(500);
  // Upper bound of gRPC's reconnect backoff, so that a restarted worker is used again within
  // about this long rather than gRPC's default of two minutes.
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
};

// A point-in-time view of one replica, for logs, metrics and tests.
struct ReplicaSnapshot {
  std::string address;
  bool healthy = false;
  bool compatible = true;                   // false: serves another model than the first replica
  int64_t outstanding_tokens = 0;           // this router's own accounting
  int64_t reported_outstanding_tokens = 0;  // the worker's GetLoads, all routers together
  int num_running = 0;
  int num_waiting = 0;
  int64_t requests_sent = 0;
};

class ReplicaSet {
 public:
  // One replica per "host:port". Starts the poller; replicas count as unhealthy until their first
  // successful health check (call PollOnce to check at once).
  static absl::StatusOr<std::unique_ptr<ReplicaSet>> Create(std::vector<std::string> addresses,
                                                            const ReplicaSetOptions& options);
  ~ReplicaSet();

  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  // A request placed on a replica. Its tokens count against the replica until the lease ends:
  // the prompt until the first output token arrives (prefill is done then), and the output
  // tokens not generated yet.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();

    [[nodiscard]] int replica() const { return replica_; }
    [[nodiscard]] const std::string& address() const;
    [[nodiscard]] v1::Worker::Stub& worker() const;
    // `n` output tokens arrived.
    void OnTokens(int64_t n);

   private:
    friend class ReplicaSet;
    Lease(ReplicaSet* set, int replica, int64_t prompt_tokens, int64_t max_tokens);
    void Release();

    ReplicaSet* set_ = nullptr;
    int replica_ = -1;
    int64_t prompt_tokens_ = 0;
    int64_t remaining_tokens_ = 0;
  };

  // The healthy, compatible replica with the fewest outstanding tokens, counting a request of
  // `prompt_tokens` + `max_tokens` there. Replicas in `exclude` are skipped. Outstanding tokens
  // are the larger of this router's own count and the worker's last report (other routers' load);
  // ties go round-robin. UNAVAILABLE when no replica qualifies.
  absl::StatusOr<Lease> Pick(int64_t prompt_tokens, int64_t max_tokens,
                             absl::Span<const int> exclude = {});

  // A request saw the replica fail (connection lost, UNAVAILABLE): skip it until a health check
  // succeeds again.
  void ReportFailure(int replica);

  // Sends Worker.Abort(request_id) to the replica without waiting for the answer, so the worker
  // frees the request's slot at its next step even while its stream is still being torn down.
  // Failures are only logged: the stream's cancellation frees the slot too, a little later.
  void AbortOnReplica(int replica, const std::string& request_id);

  // The model served, from the first replica that answered GetModelInfo; max_context_length is
  // the smallest over the compatible replicas. nullopt until a replica answered.
  [[nodiscard]] std::optional<v1::ModelInfo> model_info() const;
  // True when some compatible replica is healthy.
  [[nodiscard]] bool AnyHealthy() const;
  [[nodiscard]] size_t size() const { return replicas_.size(); }
  [[nodiscard]] std::vector<ReplicaSnapshot> Snapshot() const;

  // Probes every replica now (health, loads, and model info where not known yet) and returns when
  // all probes have answered or timed out. The poller calls it every interval.
  void PollOnce();

 private:
  struct Replica;
  explicit ReplicaSet(const ReplicaSetOptions& options);
  void PollLoop();
  void CheckModelInfo(int index);
  void ReleaseTokens(int replica, int64_t tokens);

  const ReplicaSetOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;  // fixed after Create

  mutable absl::Mutex mu_;
  std::optional<v1::ModelInfo> model_info_ ABSL_GUARDED_BY(mu_);
  uint64_t round_robin_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Abort calls not answered yet; the destructor waits for them (each has a deadline). Shared
  // with the calls' callbacks, which may still be unlocking it when the destructor returns.
  struct PendingAborts {
    absl::Mutex mu;
    int count ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<PendingAborts> pending_aborts_ = std::make_shared<PendingAborts>();
  std::thread poller_;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_REPLICA_SET_H_
