#include "worker/distributed/local_communicator.h"

#include <cstring>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "worker/distributed/collective_util.h"

namespace mobius::worker {
namespace {

using kernels::Tensor;

// What one rank posts for the collective in progress: the other ranks read it between the
// first and the second barrier of that collective.
struct Posted {
  const void* in = nullptr;
  std::string* bytes = nullptr;
  kernels::DType dtype = kernels::DType::kF32;
  int64_t numel = 0;
  int root = 0;
};

class LocalGroup {
 public:
  LocalGroup(int n, absl::Duration timeout) : n_(n), timeout_(timeout), posted_(n) {}

  int size() const { return n_; }
  Posted& posted(int rank) { return posted_[rank]; }

  // Returns once every rank arrived, or the group's failure (a timeout fails the group).
  absl::Status Barrier() {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return failed_;
    const uint64_t phase = phase_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++phase_;
      return absl::OkStatus();
    }
    auto done = [&]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return phase_ != phase || !failed_.ok(); };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout_)) {
      failed_ = absl::DeadlineExceededError(
          absl::StrFormat("local communicator: %d of %d ranks reached the barrier within %s",
                          arrived_, n_, absl::FormatDuration(timeout_)));
    }
    if (phase_ != phase) return absl::OkStatus();
    return failed_;
  }

  void Abort(const absl::Status& reason) {
    absl::MutexLock lock(&mu_);
    if (failed_.ok()) failed_ = reason.ok() ? absl::AbortedError("aborted") : reason;
  }

 private:
  const int n_;
  const absl::Duration timeout_;
  std::vector<Posted> posted_;  // slot r written only by rank r, outside the read window
  absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t phase_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return group_->size(); }

  absl::Status AllReduceSum(Tensor& t) override {
    if (absl::Status s = Check(t, "AllReduceSum", true); !s.ok()) return s;
    if (absl::Status s = Post(t.raw(), t, 0); !s.ok()) return s;
    if (absl::Status s = CheckSameAsRoot("AllReduceSum", 0); !s.ok()) return s;
    std::vector<float> acc(t.numel(), 0.0f);
    for (int r = 0; r < world_size(); ++r) {
      AccumulateF32(acc.data(), group_->posted(r).in, t.dtype(), t.numel());
    }
    if (absl::Status s = group_->Barrier(); !s.ok()) return s;
    StoreF32As(acc.data(), t.raw(), t.dtype(), t.numel());
    return absl::OkStatus();
  }

  absl::Status AllGather(const Tensor& in, Tensor& out) override {
    if (absl::Status s = CheckAllGather(in, out, world_size()); !s.ok()) return s;
    if (absl::Status s = CheckHost(in, "AllGather"); !s.ok()) return s;
    if (absl::Status s = CheckHost(out, "AllGather"); !s.ok()) return s;
    if (absl::Status s = Post(in.raw(), in, 0); !s.ok()) return s;
    if (absl::Status s = CheckSameAsRoot("AllGather", 0); !s.ok()) return s;
    // Gather into a private buffer first: `out` may alias another rank's input.
    std::string gathered(out.nbytes(), '\0');
    for (int r = 0; r < world_size(); ++r) {
      std::memcpy(gathered.data() + r * in.nbytes(), group_->posted(r).in, in.nbytes());
    }
    if (absl::Status s = group_->Barrier(); !s.ok()) return s;
    std::memcpy(out.raw(), gathered.data(), out.nbytes());
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSum(const Tensor& in, Tensor& out) override {
    if (absl::Status s = CheckReduceScatter(in, out, world_size()); !s.ok()) return s;
    if (absl::Status s = CheckHost(in, "ReduceScatterSum"); !s.ok()) return s;
    if (absl::Status s = CheckHost(out, "ReduceScatterSum"); !s.ok()) return s;
    if (absl::Status s = Post(in.raw(), in, 0); !s.ok()) return s;
    if (absl::Status s = CheckSameAsRoot("ReduceScatterSum", 0); !s.ok()) return s;
    const int64_t n = out.numel();
    const size_t offset = static_cast<size_t>(rank_ * n) * kernels::DTypeSize(in.dtype());
    std::vector<float> acc(n, 0.0f);
    for (int r = 0; r < world_size(); ++r) {
      AccumulateF32(acc.data(), static_cast<const char*>(group_->posted(r).in) + offset, in.dtype(),
                    n);
    }
    if (absl::Status s = group_->Barrier(); !s.ok()) return s;
    StoreF32As(acc.data(), out.raw(), out.dtype(), n);
    return absl::OkStatus();
  }

  absl::Status Broadcast(Tensor& t, int root) override {
    if (absl::Status s = CheckRoot(root, world_size(), "Broadcast"); !s.ok()) return s;
    if (absl::Status s = Check(t, "Broadcast", false); !s.ok()) return s;
    if (absl::Status s = Post(t.raw(), t, root); !s.ok()) return s;
    if (absl::Status s = CheckSameAsRoot("Broadcast", root); !s.ok()) return s;
    if (rank_ != root) std::memcpy(t.raw(), group_->posted(root).in, t.nbytes());
    return group_->Barrier();
  }

  absl::Status BroadcastBytesFor(std::string& bytes, int root, absl::Duration) override {
    if (absl::Status s = CheckRoot(root, world_size(), "BroadcastBytes"); !s.ok()) return s;
    Posted& mine = group_->posted(rank_);
    mine = Posted{.bytes = &bytes, .root = root};
    if (absl::Status s = group_->Barrier(); !s.ok()) return s;
    if (absl::Status s = CheckSameAsRoot("BroadcastBytes", root); !s.ok()) return s;
    if (rank_ != root) bytes = *group_->posted(root).bytes;
    return group_->Barrier();
  }

  void Abort(const absl::Status& reason) override { group_->Abort(reason); }

 private:
  absl::Status Check(const Tensor& t, std::string_view op, bool reduce) {
    if (reduce) {
      if (absl::Status s = CheckReducible(t, op); !s.ok()) return s;
    } else if (t.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: empty tensor", op));
    }
    return CheckHost(t, op);
  }

  absl::Status Post(const void* in, const Tensor& t, int root) {
    group_->posted(rank_) = Posted{.in = in, .dtype = t.dtype(), .numel = t.numel(), .root = root};
    return group_->Barrier();
  }

  // Every rank compares its call with the root's: all see the same posts, so all fail alike
  // (and skip the second barrier together) on a mismatch.
  absl::Status CheckSameAsRoot(std::string_view op, int root) {
    const Posted& theirs = group_->posted(root);
    for (int r = 0; r < world_size(); ++r) {
      const Posted& p = group_->posted(r);
      if (p.dtype != theirs.dtype || p.numel != theirs.numel || p.root != theirs.root ||
          (p.bytes == nullptr) != (theirs.bytes == nullptr)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: rank %d called with %s x %d (root %d), rank %d with %s x %d (root %d)", op, r,
            DTypeName(p.dtype), p.numel, p.root, root, DTypeName(theirs.dtype), theirs.numel,
            theirs.root));
      }
    }
    return absl::OkStatus();
  }

  std::shared_ptr<LocalGroup> group_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> CreateLocalCommunicators(int n, absl::Duration timeout) {
  auto group = std::make_shared<LocalGroup>(n, timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < n; ++r) comms.push_back(std::make_unique<LocalCommunicator>(group, r));
  return comms;
}

}  // namespace mobius::worker
