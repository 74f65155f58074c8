#include "worker/distributed/ucx_communicator.h"

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "worker/distributed/collective_util.h"

namespace mobius::worker {
namespace {

using kernels::DType;
using kernels::Tensor;

// One point-to-point transfer of a collective step.
struct Transfer {
  bool send = false;
  int peer = 0;
  void* buffer = nullptr;
  size_t bytes = 0;
  int step = 0;
};

class UcxCommunicatorImpl;

struct PeerErrorArg {
  UcxCommunicatorImpl* self = nullptr;
  int peer = 0;
};

class UcxCommunicatorImpl final : public UcxCommunicator {
 public:
  UcxCommunicatorImpl(int rank, int world, absl::Duration timeout)
      : rank_(rank), world_(world), timeout_(timeout), peer_args_(world) {}

  ~UcxCommunicatorImpl() override {
    CloseEndpoints();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  absl::Status Init() {
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
      return UcxError("ucp_config_read", s);
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
    params.features = UCP_FEATURE_TAG;
    params.estimated_num_eps = static_cast<size_t>(world_);
    ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK) return UcxError("ucp_init", s);
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;  // one thread runs the collectives
    if (s = ucp_worker_create(context_, &wparams, &worker_); s != UCS_OK) {
      return UcxError("ucp_worker_create", s);
    }
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    if (s = ucp_worker_get_address(worker_, &addr, &len); s != UCS_OK) {
      return UcxError("ucp_worker_get_address", s);
    }
    address_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }

  absl::Status Connect(const std::vector<std::string>& addresses) override {
    if (static_cast<int>(addresses.size()) != world_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("UCX Connect: %d addresses for a world of %d", addresses.size(), world_));
    }
    eps_.assign(world_, nullptr);
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_) continue;
      peer_args_[peer] = PeerErrorArg{this, peer};
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(addresses[peer].data());
      // Peer error handling: a dead peer fails our operations on it instead of hanging them.
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &UcxCommunicatorImpl::OnPeerError;
      ep.err_handler.arg = &peer_args_[peer];
      if (ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[peer]); s != UCS_OK) {
        return UcxError(absl::StrFormat("ucp_ep_create to rank %d", peer), s);
      }
    }
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  absl::Status AllReduceSum(Tensor& t) override {
    if (absl::Status s = CheckReducible(t, "AllReduceSum"); !s.ok()) return s;
    if (absl::Status s = CheckHost(t, "AllReduceSum"); !s.ok()) return s;
    const int64_t n = t.numel();
    std::vector<float>& buf = Scratch(0, n);
    LoadAsF32(t.raw(), t.dtype(), buf.data(), n);
    const uint64_t seq = NextSeq();
    if (absl::Status s = RingReduceScatter(buf.data(), n, seq); !s.ok()) return s;
    if (absl::Status s =
            RingAllGather(reinterpret_cast<char*>(buf.data()), n, sizeof(float), seq, world_);
        !s.ok()) {
      return s;
    }
    StoreF32As(buf.data(), t.raw(), t.dtype(), n);
    return absl::OkStatus();
  }

  absl::Status AllGather(const Tensor& in, Tensor& out) override {
    if (absl::Status s = CheckAllGather(in, out, world_); !s.ok()) return s;
    if (absl::Status s = CheckHost(in, "AllGather"); !s.ok()) return s;
    if (absl::Status s = CheckHost(out, "AllGather"); !s.ok()) return s;
    const int64_t n = out.numel();
    const size_t elem = kernels::DTypeSize(in.dtype());
    char* dst = static_cast<char*>(out.raw());
    std::memmove(dst + static_cast<size_t>(rank_) * in.nbytes(), in.raw(), in.nbytes());
    return RingAllGather(dst, n, elem, NextSeq(), 0);
  }

  absl::Status ReduceScatterSum(const Tensor& in, Tensor& out) override {
    if (absl::Status s = CheckReduceScatter(in, out, world_); !s.ok()) return s;
    if (absl::Status s = CheckHost(in, "ReduceScatterSum"); !s.ok()) return s;
    if (absl::Status s = CheckHost(out, "ReduceScatterSum"); !s.ok()) return s;
    const int64_t n = in.numel();
    std::vector<float>& buf = Scratch(0, n);
    LoadAsF32(in.raw(), in.dtype(), buf.data(), n);
    if (absl::Status s = RingReduceScatter(buf.data(), n, NextSeq()); !s.ok()) return s;
    StoreF32As(buf.data() + ChunkBegin(n, rank_), out.raw(), out.dtype(), out.numel());
    return absl::OkStatus();
  }

  absl::Status Broadcast(Tensor& t, int root) override {
    if (absl::Status s = CheckRoot(root, world_, "Broadcast"); !s.ok()) return s;
    if (absl::Status s = CheckHost(t, "Broadcast"); !s.ok()) return s;
    return BroadcastBuffer(t.raw(), t.nbytes(), root, NextSeq(), 0);
  }

  absl::Status BroadcastBytesFor(std::string& bytes, int root, absl::Duration timeout) override {
    if (absl::Status s = CheckRoot(root, world_, "BroadcastBytes"); !s.ok()) return s;
    const uint64_t seq = NextSeq();
    uint64_t size = bytes.size();
    const absl::Duration wait = timeout == absl::ZeroDuration() ? timeout_ : timeout;
    if (absl::Status s = BroadcastBuffer(&size, sizeof(size), root, seq, 0, wait); !s.ok()) {
      return s;
    }
    if (rank_ != root) bytes.resize(size);
    return BroadcastBuffer(bytes.data(), size, root, seq, 1, timeout_);
  }

  void Abort(const absl::Status& reason) override {
    absl::MutexLock lock(&mu_);
    if (failed_.ok()) {
      failed_ = reason.ok() ? absl::AbortedError("aborted") : reason;
      aborted_.store(true, std::memory_order_release);
    }
  }

 private:
  static absl::Status UcxError(std::string_view what, ucs_status_t s) {
    return absl::InternalError(absl::StrFormat("%s: %s", what, ucs_status_string(s)));
  }

  static void OnPeerError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* p = static_cast<PeerErrorArg*>(arg);
    p->self->Abort(absl::UnavailableError(absl::StrFormat(
        "UCX: rank %d lost rank %d: %s", p->self->rank_, p->peer, ucs_status_string(status))));
  }

  absl::Status Failed() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

  uint64_t NextSeq() { return seq_++; }

  // Tag = collective sequence number (40 bits) | step within it (8 bits) | sender rank (16 bits):
  // every message of a rank's collective is matched by exactly one receive.
  static ucp_tag_t Tag(uint64_t seq, int step, int sender) {
    return ((seq & 0xffffffffffull) << 24) | (static_cast<uint64_t>(step & 0xff) << 16) |
           static_cast<uint64_t>(sender & 0xffff);
  }

  std::vector<float>& Scratch(int i, int64_t n) {
    scratch_[i].resize(static_cast<size_t>(n));
    return scratch_[i];
  }

  int64_t ChunkBegin(int64_t n, int chunk) const { return n * chunk / world_; }
  static int Mod(int a, int m) { return ((a % m) + m) % m; }

  // Runs the transfers of one step to completion, or fails them on the timeout or an abort.
  // `timeout` overrides the communicator's (a follower waiting for the leader's next plan).
  absl::Status Run(std::initializer_list<Transfer> transfers, uint64_t seq,
                   std::optional<absl::Duration> timeout = std::nullopt) {
    if (aborted_.load(std::memory_order_acquire)) return Failed();
    std::vector<void*> pending;
    absl::Status status;
    for (const Transfer& x : transfers) {
      ucp_request_param_t param{};
      void* req;
      if (x.send) {
        req = ucp_tag_send_nbx(eps_[x.peer], x.buffer, x.bytes, Tag(seq, x.step, rank_), &param);
      } else {
        req = ucp_tag_recv_nbx(worker_, x.buffer, x.bytes, Tag(seq, x.step, x.peer), ~ucp_tag_t{0},
                               &param);
      }
      if (UCS_PTR_IS_ERR(req)) {
        status =
            UcxError(absl::StrFormat("%s rank %d", x.send ? "send to" : "receive from", x.peer),
                     UCS_PTR_STATUS(req));
        break;
      }
      if (req != nullptr) pending.push_back(req);
    }
    const absl::Duration limit = timeout.value_or(timeout_);
    const absl::Time deadline = absl::Now() + limit;
    int idle = 0;
    while (status.ok() && !pending.empty()) {
      if (ucp_worker_progress(worker_) != 0) {
        idle = 0;
      } else if (++idle > 256) {
        // Nothing moved for a while: give the core to the peer processes (CI runs 4 ranks on
        // 2 cores) and check the clock; a long wait (an idle replica) polls every millisecond.
        std::this_thread::sleep_for(std::chrono::microseconds(idle > 100000 ? 1000 : 20));
        if (absl::Now() > deadline) {
          status = absl::DeadlineExceededError(
              absl::StrFormat("UCX collective %d on rank %d: no completion within %s", seq, rank_,
                              absl::FormatDuration(limit)));
        }
      }
      for (size_t i = 0; i < pending.size();) {
        const ucs_status_t s = ucp_request_check_status(pending[i]);
        if (s == UCS_INPROGRESS) {
          ++i;
          continue;
        }
        ucp_request_free(pending[i]);
        pending.erase(pending.begin() + static_cast<ptrdiff_t>(i));
        if (s != UCS_OK && status.ok()) status = UcxError("UCX transfer", s);
      }
      if (aborted_.load(std::memory_order_acquire)) status = Failed();
    }
    if (!status.ok()) {
      // The group is over: cancel what is left (UCX releases the requests when they end) and
      // keep every later call failing fast.
      for (void* req : pending) {
        ucp_request_cancel(worker_, req);
        ucp_request_free(req);
      }
      Abort(status);
    }
    return status;
  }

  // Ring reduce-scatter of n fp32 values in world chunks: after world-1 steps, rank r holds
  // chunk r summed over every rank.
  absl::Status RingReduceScatter(float* buf, int64_t n, uint64_t seq) {
    if (world_ == 1) return absl::OkStatus();
    const int next = Mod(rank_ + 1, world_), prev = Mod(rank_ - 1, world_);
    std::vector<float>& tmp = Scratch(1, n / world_ + 1);
    for (int step = 0; step < world_ - 1; ++step) {
      const int send_chunk = Mod(rank_ - step - 1, world_);
      const int recv_chunk = Mod(rank_ - step - 2, world_);
      const int64_t sb = ChunkBegin(n, send_chunk), se = ChunkBegin(n, send_chunk + 1);
      const int64_t rb = ChunkBegin(n, recv_chunk), re = ChunkBegin(n, recv_chunk + 1);
      absl::Status s =
          Run({Transfer{false, prev, tmp.data(), static_cast<size_t>(re - rb) * 4, step},
               Transfer{true, next, buf + sb, static_cast<size_t>(se - sb) * 4, step}},
              seq);
      if (!s.ok()) return s;
      AccumulateF32(buf + rb, tmp.data(), DType::kF32, re - rb);
    }
    return absl::OkStatus();
  }

  // Ring all-gather of world chunks of n elements (rank r starts with chunk r); steps are tagged
  // from `first_step` so that it can follow a reduce-scatter within one collective.
  absl::Status RingAllGather(char* buf, int64_t n, size_t elem, uint64_t seq, int first_step) {
    if (world_ == 1) return absl::OkStatus();
    const int next = Mod(rank_ + 1, world_), prev = Mod(rank_ - 1, world_);
    for (int step = 0; step < world_ - 1; ++step) {
      const int send_chunk = Mod(rank_ - step, world_);
      const int recv_chunk = Mod(rank_ - step - 1, world_);
      const int64_t sb = ChunkBegin(n, send_chunk), se = ChunkBegin(n, send_chunk + 1);
      const int64_t rb = ChunkBegin(n, recv_chunk), re = ChunkBegin(n, recv_chunk + 1);
      absl::Status s = Run({Transfer{false, prev, buf + rb * elem,
                                     static_cast<size_t>(re - rb) * elem, first_step + step},
                            Transfer{true, next, buf + sb * elem,
                                     static_cast<size_t>(se - sb) * elem, first_step + step}},
                           seq);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // The root sends to every rank along a binary tree rooted at it (log2(world) rounds).
  absl::Status BroadcastBuffer(void* buf, size_t bytes, int root, uint64_t seq, int step,
                               std::optional<absl::Duration> receive_timeout = std::nullopt) {
    const int me = Mod(rank_ - root, world_);  // position in the tree
    if (me != 0) {
      const int parent = Mod((me - 1) / 2 + root, world_);
      if (absl::Status s = Run({Transfer{false, parent, buf, bytes, step}}, seq, receive_timeout);
          !s.ok()) {
        return s;
      }
    }
    for (int child = 2 * me + 1; child <= 2 * me + 2 && child < world_; ++child) {
      if (absl::Status s = Run({Transfer{true, Mod(child + root, world_), buf, bytes, step}}, seq);
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }

  void CloseEndpoints() {
    for (ucp_ep_h& ep : eps_) {
      if (ep == nullptr) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;  // peers may be gone; never wait on them
      void* req = ucp_ep_close_nbx(ep, &param);
      if (UCS_PTR_IS_PTR(req)) {
        const absl::Time deadline = absl::Now() + absl::Seconds(1);
        while (ucp_request_check_status(req) == UCS_INPROGRESS && absl::Now() < deadline) {
          ucp_worker_progress(worker_);
        }
        ucp_request_free(req);
      }
      ep = nullptr;
    }
  }

  const int rank_, world_;
  const absl::Duration timeout_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::vector<ucp_ep_h> eps_;
  std::vector<PeerErrorArg> peer_args_;
  std::vector<float> scratch_[2];
  uint64_t seq_ = 0;
  std::atomic<bool> aborted_{false};
  absl::Mutex mu_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<UcxCommunicator>> UcxCommunicator::Create(int rank, int world_size,
                                                                         absl::Duration timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("UCX communicator: rank %d outside a world of %d", rank, world_size));
  }
  auto comm = std::make_unique<UcxCommunicatorImpl>(rank, world_size, timeout);
  if (absl::Status s = comm->Init(); !s.ok()) return s;
  return comm;
}

}  // namespace mobius::worker
