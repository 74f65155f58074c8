#include "worker/distributed/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/distributed/collective_util.h"

namespace mobius::worker {
namespace {

using kernels::DType;
using kernels::Tensor;

absl::Status NcclError(std::string_view what, ncclResult_t r) {
  return absl::InternalError(absl::StrFormat("%s: %s", what, ncclGetErrorString(r)));
}

absl::Status CheckDevice(const Tensor& t, std::string_view op) {
  if (t.empty() || t.device() != kernels::Device::kCuda) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tensor %s is not in GPU memory", op, t.ShapeString()));
  }
  return absl::OkStatus();
}

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
  }
  return ncclUint8;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int world, cudaStream_t stream, absl::Duration timeout)
      : rank_(rank), world_(world), stream_(stream), timeout_(timeout) {}

  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      // A failed group's operations may never finish: abort rather than wait for them.
      if (aborted_) {
        ncclCommAbort(comm_);
      } else {
        ncclCommFinalize(comm_);
        WaitForComm("ncclCommFinalize", absl::Now() + timeout_).IgnoreError();
        ncclCommDestroy(comm_);
      }
    }
    if (staging_ != nullptr) cudaFree(staging_);
  }

  absl::Status Init(const std::string& unique_id) {
    if (unique_id.size() != sizeof(ncclUniqueId)) {
      return absl::InvalidArgumentError(absl::StrFormat("NCCL unique id of %d bytes, want %d",
                                                        unique_id.size(), sizeof(ncclUniqueId)));
    }
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that initialisation and errors can be waited for with a deadline
    ncclResult_t r = ncclCommInitRankConfig(&comm_, world_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) return NcclError("ncclCommInitRankConfig", r);
    return WaitForComm("ncclCommInitRankConfig", absl::Now() + timeout_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  absl::Status AllReduceSum(Tensor& t) override {
    if (aborted_) return Failed();  // comm_ is gone
    if (absl::Status s = CheckReducible(t, "AllReduceSum"); !s.ok()) return s;
    if (absl::Status s = CheckDevice(t, "AllReduceSum"); !s.ok()) return s;
    return Queued("ncclAllReduce", ncclAllReduce(t.raw(), t.raw(), t.numel(), NcclType(t.dtype()),
                                                 ncclSum, comm_, stream_));
  }

  absl::Status AllGather(const Tensor& in, Tensor& out) override {
    if (aborted_) return Failed();  // comm_ is gone
    if (absl::Status s = CheckAllGather(in, out, world_); !s.ok()) return s;
    if (absl::Status s = CheckDevice(in, "AllGather"); !s.ok()) return s;
    if (absl::Status s = CheckDevice(out, "AllGather"); !s.ok()) return s;
    return Queued("ncclAllGather",
                  ncclAllGather(in.raw(), out.raw(), in.nbytes(), ncclUint8, comm_, stream_));
  }

  absl::Status ReduceScatterSum(const Tensor& in, Tensor& out) override {
    if (aborted_) return Failed();  // comm_ is gone
    if (absl::Status s = CheckReduceScatter(in, out, world_); !s.ok()) return s;
    if (absl::Status s = CheckDevice(in, "ReduceScatterSum"); !s.ok()) return s;
    if (absl::Status s = CheckDevice(out, "ReduceScatterSum"); !s.ok()) return s;
    return Queued("ncclReduceScatter",
                  ncclReduceScatter(in.raw(), out.raw(), out.numel(), NcclType(in.dtype()), ncclSum,
                                    comm_, stream_));
  }

  absl::Status Broadcast(Tensor& t, int root) override {
    if (aborted_) return Failed();  // comm_ is gone
    if (absl::Status s = CheckRoot(root, world_, "Broadcast"); !s.ok()) return s;
    if (absl::Status s = CheckDevice(t, "Broadcast"); !s.ok()) return s;
    return Queued("ncclBroadcast",
                  ncclBroadcast(t.raw(), t.raw(), t.nbytes(), ncclUint8, root, comm_, stream_));
  }

  // Host bytes through a device staging buffer: the size first, then the payload.
  absl::Status BroadcastBytesFor(std::string& bytes, int root, absl::Duration timeout) override {
    if (aborted_) return Failed();  // comm_ is gone
    if (absl::Status s = CheckRoot(root, world_, "BroadcastBytes"); !s.ok()) return s;
    const absl::Time deadline =
        absl::Now() + (timeout == absl::ZeroDuration() ? timeout_ : timeout);
    uint64_t size = bytes.size();
    if (absl::Status s = Stage(sizeof(size)); !s.ok()) return s;
    if (rank_ == root)
      cudaMemcpyAsync(staging_, &size, sizeof(size), cudaMemcpyHostToDevice, stream_);
    if (absl::Status s = Queued("ncclBroadcast", ncclBroadcast(staging_, staging_, sizeof(size),
                                                               ncclUint8, root, comm_, stream_));
        !s.ok()) {
      return s;
    }
    cudaMemcpyAsync(&size, staging_, sizeof(size), cudaMemcpyDeviceToHost, stream_);
    if (absl::Status s = WaitForStream(deadline); !s.ok()) return s;
    if (rank_ != root) bytes.resize(size);
    if (size == 0) return absl::OkStatus();
    if (absl::Status s = Stage(size); !s.ok()) return s;
    if (rank_ == root)
      cudaMemcpyAsync(staging_, bytes.data(), size, cudaMemcpyHostToDevice, stream_);
    if (absl::Status s = Queued("ncclBroadcast", ncclBroadcast(staging_, staging_, size, ncclUint8,
                                                               root, comm_, stream_));
        !s.ok()) {
      return s;
    }
    cudaMemcpyAsync(bytes.data(), staging_, size, cudaMemcpyDeviceToHost, stream_);
    return WaitForStream(deadline);
  }

  void Abort(const absl::Status& reason) override {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;
    failed_ = reason.ok() ? absl::AbortedError("aborted") : reason;
    aborted_ = true;
    // Releases kernels waiting on a dead peer; the communicator is unusable afterwards.
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  absl::Status Failed() {
    absl::MutexLock lock(&mu_);
    return failed_;
  }

  absl::Status Queued(std::string_view op, ncclResult_t r) {
    if (aborted_) return Failed();
    if (r == ncclSuccess || r == ncclInProgress) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async == ncclSuccess || async == ncclInProgress) return absl::OkStatus();
      r = async;
    }
    return NcclError(op, r);
  }

  absl::Status WaitForComm(std::string_view op, absl::Time deadline) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclError(op, state);
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrFormat("%s: not done within %s", op, absl::FormatDuration(timeout_)));
      }
      absl::SleepFor(absl::Microseconds(100));
    }
  }

  // Waits for the stream (BroadcastBytes' host copy), failing on a NCCL error, an abort or the
  // deadline instead of blocking in cudaStreamSynchronize.
  absl::Status WaitForStream(absl::Time deadline) {
    while (true) {
      if (aborted_) return Failed();
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) {
        return absl::InternalError(absl::StrFormat("NCCL stream: %s", cudaGetErrorString(e)));
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) return NcclError("NCCL", async);
      if (absl::Now() > deadline) {
        absl::Status s = absl::DeadlineExceededError(
            absl::StrFormat("NCCL BroadcastBytes on rank %d: not done within %s", rank_,
                            absl::FormatDuration(timeout_)));
        Abort(s);
        return s;
      }
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  absl::Status Stage(size_t bytes) {
    if (bytes <= staging_bytes_) return absl::OkStatus();
    if (staging_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaFree(staging_);
      staging_ = nullptr;
    }
    if (cudaError_t e = cudaMalloc(&staging_, bytes); e != cudaSuccess) {
      staging_bytes_ = 0;
      return absl::ResourceExhaustedError(
          absl::StrFormat("NCCL staging buffer of %d bytes: %s", bytes, cudaGetErrorString(e)));
    }
    staging_bytes_ = bytes;
    return absl::OkStatus();
  }

  const int rank_, world_;
  cudaStream_t stream_;
  const absl::Duration timeout_;
  ncclComm_t comm_ = nullptr;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::atomic<bool> aborted_{false};
  absl::Mutex mu_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::string> NcclUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError("ncclGetUniqueId", r);
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int rank, int world_size,
                                                                     const std::string& unique_id,
                                                                     kernels::Backend& backend,
                                                                     absl::Duration timeout) {
  cudaStream_t stream = kernels::CudaBackendStream(backend);
  if (stream == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NCCL communicator: backend %s is not a CUDA backend", backend.name()));
  }
  auto comm = std::make_unique<NcclCommunicator>(rank, world_size, stream, timeout);
  if (absl::Status s = comm->Init(unique_id); !s.ok()) return s;
  return comm;
}

}  // namespace mobius::worker
