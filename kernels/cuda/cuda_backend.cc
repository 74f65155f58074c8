// CudaBackend: validates each op's tensors, uploads the per-step host metadata (segments, block
// tables, row ids) to the device, and queues the kernels of launch.h on the backend's stream.
// Interface misuse (wrong dtype, shape or device) aborts with a message: ops have no error
// channel, and running on regardless would corrupt device memory. Running out of device memory
// is not misuse: tensors come back as ResourceExhausted, and an op whose scratch does not fit
// skips its launches and reports it through TakeOpError, which fails the step.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/parallel_ranges.h"
#include "common/status_macros.h"
#include "kernels/cuda/capture_pool.h"
#include "kernels/cuda/device_block_cache.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/tuning_knobs.h"
#include "kernels/token_sampling.h"

namespace mobius::kernels {
namespace {

using cuda::AnyMutPtr;
using cuda::AnyPtr;

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "mobius cuda backend: %s\n", message.c_str());
  std::abort();
}

void Check(bool ok, const char* op, const std::string& what) {
  if (!ok) Fail(absl::StrFormat("%s: %s", op, what));
}

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Fail(absl::StrFormat("%s: %s", what, cudaGetErrorString(err)));
}

void CheckTensor(const Tensor& t, DType dtype, const char* op, const char* name) {
  Check(!t.empty() && t.device() == Device::kCuda, op,
        absl::StrFormat("%s must be a CUDA tensor", name));
  Check(t.dtype() == dtype, op,
        absl::StrFormat("%s has dtype %s, expected %s", name, DTypeName(t.dtype()),
                        DTypeName(dtype)));
}

// Small weights (norms, gates' parameters, conv taps) may be F32 or BF16.
AnyPtr Any(const Tensor& t, const char* op, const char* name) {
  Check(!t.empty() && t.device() == Device::kCuda, op,
        absl::StrFormat("%s must be a CUDA tensor", name));
  Check(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16, op,
        absl::StrFormat("%s has dtype %s, expected F32 or BF16", name, DTypeName(t.dtype())));
  return AnyPtr{t.raw(), t.dtype() == DType::kF32};
}

const uint16_t* Bf16(const Tensor& t) { return static_cast<const uint16_t*>(t.raw()); }
uint16_t* MutBf16(const Tensor& t) { return static_cast<uint16_t*>(t.raw()); }

// Up to this many tokens the few-token MoE kernels compute the shared expert's down projection
// (MoeSharedTerm::fused_max_tokens). MOBIUS_MOE_SHARED_EXPERT=N (A/B runs): N instead of the
// default; 0 never.
int SharedExpertFusedMaxTokens() {
  static const int max_tokens =
      cuda::KnobInt("MOBIUS_MOE_SHARED_EXPERT", cuda::kMoeSharedExpertFusedMaxTokens, 0, 1 << 20);
  return max_tokens;
}

// Host-side layout of the segment metadata uploaded for one op (int32 offsets into one buffer).
struct PackedSegments {
  std::vector<int32_t> data;
  bool staged = false;  // the step's staged copy (StageStep) holds these; `data` is empty
  size_t token_segment = 0, token_position = 0, token_begin = 0, num_tokens = 0, cached_tokens = 0,
         state_slot = 0, state_out_slot = 0, block_table_begin = 0, block_tables = 0;
};

// A CUDA graph of one recorded step and the buffer generation it was recorded against.
class CudaCapturedStep final : public CapturedStep {
 public:
  CudaCapturedStep(cudaGraphExec_t exec, uint64_t generation)
      : exec_(exec), generation_(generation) {}
  ~CudaCapturedStep() override { cudaGraphExecDestroy(exec_); }
  [[nodiscard]] cudaGraphExec_t exec() const { return exec_; }
  [[nodiscard]] uint64_t generation() const { return generation_; }

 private:
  cudaGraphExec_t exec_;
  uint64_t generation_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, cudaStream_t stream, std::unique_ptr<cuda::LtGemm> gemm,
              std::string device_name, int num_sms)
      : device_(device),
        stream_(stream),
        gemm_(std::move(gemm)),
        device_name_(std::move(device_name)),
        num_sms_(num_sms) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    gemm_.reset();
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (meta_ != nullptr) cudaFree(meta_);
    if (step_meta_ != nullptr) cudaFree(step_meta_);
    if (step_host_ != nullptr) cudaFreeHost(step_host_);
    if (step_copied_ != nullptr) cudaEventDestroy(step_copied_);
    cudaStreamDestroy(stream_);
  }

  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  [[nodiscard]] Device device() const override { return Device::kCuda; }
  [[nodiscard]] std::string name() const override {
    return absl::StrFormat("cuda:%d (%s)", device_, device_name_);
  }
  [[nodiscard]] DType activation_dtype() const override { return DType::kBF16; }

  absl::StatusOr<Tensor> Allocate(DType dtype, std::vector<int64_t> shape) override {
    return AllocateAndFill(dtype, std::move(shape), /*zero=*/true);
  }
  absl::StatusOr<Tensor> AllocateUninitialized(DType dtype, std::vector<int64_t> shape) override {
    return AllocateAndFill(dtype, std::move(shape), /*zero=*/false);
  }

  absl::StatusOr<DeviceMemoryInfo> MemoryInfo() override {
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    size_t free_bytes = 0, total_bytes = 0;
    const cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (err != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(err)));
    }
    // Blocks the cache holds for reuse are free for planning purposes.
    return DeviceMemoryInfo{static_cast<int64_t>(free_bytes + blocks_->cached_bytes()),
                            static_cast<int64_t>(total_bytes),
                            static_cast<int64_t>(pool_->reserved_bytes()),
                            static_cast<int64_t>(pool_->peak_bytes())};
  }

  bool ReleaseCachedMemory() override {
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    Check(!capturing_, "ReleaseCachedMemory", "cannot release memory while recording a step");
    return blocks_->Trim() > 0;
  }
  absl::Status TakeOpError() override { return std::exchange(op_error_, absl::OkStatus()); }

  absl::StatusOr<double> MeasureCopyBandwidth(size_t bytes) override {
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    std::shared_ptr<void> a = blocks_->Get(bytes), b = blocks_->Get(bytes);
    if (!a || !b) return absl::ResourceExhaustedError("no memory for the bandwidth probe");
    CheckCuda(cudaMemsetAsync(a.get(), 1, bytes, stream_), "probe memset");
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    float best_ms = 1e30f;
    for (int i = 0; i < 8; ++i) {
      cudaEventRecord(start, stream_);
      cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream_);
      cudaEventRecord(stop, stream_);
      CheckCuda(cudaEventSynchronize(stop), "probe copy");
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (i >= 2) best_ms = std::min(best_ms, ms);  // the first copies warm up
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return 2.0 * static_cast<double>(bytes) / (best_ms * 1e-3);
  }

  void CopyFromHost(const void* src, DType src_dtype, Tensor& dst) override {
    Check(!dst.empty() && dst.device() == Device::kCuda, "CopyFromHost", "dst must be on CUDA");
    Check(!capturing_, "capture", "host copies cannot be recorded in a step capture");
    const int64_t n = dst.numel();
    if (n == 0) return;
    std::vector<char> staged;
    const void* bytes = src;
    auto convert = [&](auto to_dst, size_t elem) {
      staged.resize(static_cast<size_t>(n) * elem);
      for (int64_t i = 0; i < n; ++i) to_dst(i, LoadAsFloat(src, src_dtype, i));
    };
    switch (dst.dtype()) {
      case DType::kBF16:
        if (src_dtype == DType::kBF16) break;
        Check(src_dtype == DType::kF32 || src_dtype == DType::kF16, "CopyFromHost",
              absl::StrFormat("cannot convert %s to BF16", DTypeName(src_dtype)));
        convert([&](int64_t i,
                    float v) { reinterpret_cast<uint16_t*>(staged.data())[i] = FloatToBF16(v); },
                sizeof(uint16_t));
        bytes = staged.data();
        break;
      case DType::kF32:
        if (src_dtype == DType::kF32) break;
        Check(src_dtype == DType::kBF16 || src_dtype == DType::kF16, "CopyFromHost",
              absl::StrFormat("cannot convert %s to F32", DTypeName(src_dtype)));
        convert([&](int64_t i, float v) { reinterpret_cast<float*>(staged.data())[i] = v; },
                sizeof(float));
        bytes = staged.data();
        break;
      case DType::kI32:
        Check(src_dtype == DType::kI32, "CopyFromHost", "I32 tensors take I32 sources");
        break;
      case DType::kF16:
        Check(src_dtype == DType::kF16, "CopyFromHost", "F16 tensors take F16 sources");
        break;
    }
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(cudaMemcpyAsync(dst.raw(), bytes, dst.nbytes(), cudaMemcpyHostToDevice, stream_),
              "CopyFromHost");
    CheckCuda(cudaStreamSynchronize(stream_), "CopyFromHost");
  }

  // Page-locked, so that CopyFromHost's DMA reads it directly (the dummy-weight loader stages
  // its chunks here); ordinary memory when pinning fails.
  HostBuffer AllocateHostBuffer(size_t bytes) override {
    void* p = nullptr;
    if (cudaSetDevice(device_) == cudaSuccess && cudaMallocHost(&p, bytes) == cudaSuccess) {
      return HostBuffer(
          p, +[](void* q) { cudaFreeHost(q); });
    }
    cudaGetLastError();  // (the failed allocation's error is not the next launch's)
    return Backend::AllocateHostBuffer(bytes);
  }

  void CopyToHostF32(const Tensor& src, float* dst) override {
    Check(!src.empty() && src.device() == Device::kCuda, "CopyToHostF32", "src must be on CUDA");
    Check(!capturing_, "capture", "host copies cannot be recorded in a step capture");
    const int64_t n = src.numel();
    if (n == 0) return;
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    if (src.dtype() == DType::kF32) {
      CheckCuda(cudaMemcpyAsync(dst, src.raw(), src.nbytes(), cudaMemcpyDeviceToHost, stream_),
                "CopyToHostF32");
      CheckCuda(cudaStreamSynchronize(stream_), "CopyToHostF32");
      return;
    }
    Check(src.dtype() == DType::kBF16, "CopyToHostF32",
          absl::StrFormat("src has dtype %s, expected F32 or BF16", DTypeName(src.dtype())));
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    CheckCuda(
        cudaMemcpyAsync(bits.data(), src.raw(), src.nbytes(), cudaMemcpyDeviceToHost, stream_),
        "CopyToHostF32");
    CheckCuda(cudaStreamSynchronize(stream_), "CopyToHostF32");
    for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(bits[i]);
  }

  void CopyToHostI32(const Tensor& src, int32_t* dst) override {
    CheckTensor(src, DType::kI32, "CopyToHostI32", "src");
    Check(!capturing_, "capture", "host copies cannot be recorded in a step capture");
    if (src.numel() == 0) return;
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(cudaMemcpyAsync(dst, src.raw(), src.nbytes(), cudaMemcpyDeviceToHost, stream_),
              "CopyToHostI32");
    CheckCuda(cudaStreamSynchronize(stream_), "CopyToHostI32");
  }

  void Synchronize() override {
    Check(!capturing_, "capture", "Synchronize cannot be recorded in a step capture");
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(cudaStreamSynchronize(stream_), "Synchronize (an earlier kernel failed)");
  }

  void ZeroFill(Tensor& t) override {
    Check(!t.empty() && t.device() == Device::kCuda, "ZeroFill", "t must be on CUDA");
    if (t.nbytes() == 0) return;
    CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(cudaMemsetAsync(t.raw(), 0, t.nbytes(), stream_), "ZeroFill");
  }

  // ---- step staging and capture ----
  void StageStep(std::span<const int32_t> ids, std::span<const SequenceSegment> segments,
                 int max_positions) override;
  void ClearStep() override { staged_ = StagedStep{}; }
  [[nodiscard]] bool SupportsCapture() const override { return true; }
  absl::Status CheckModelOpShapes(const ModelOpShapes& shapes) const override {
    return CheckCudaModelOpShapes(shapes);
  }
  absl::Status BeginCapture() override;
  absl::StatusOr<std::unique_ptr<CapturedStep>> EndCapture() override;
  absl::Status Replay(CapturedStep& step) override;

  // ---- dense ----
  void Linear(const Tensor& x, const Tensor& w, Tensor& y) override;
  void LinearFanOut(const Tensor& x, std::span<const Tensor* const> ws,
                    std::span<Tensor* const> ys) override;
  void EmbeddingLookup(std::span<const int32_t> ids, const Tensor& table, Tensor& out) override;
  void GatherRows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) override;
  void CopyRows(std::span<Tensor* const> xs, std::span<const int32_t> from,
                std::span<const int32_t> to) override;
  void ArgmaxRows(const Tensor& logits, Tensor& ids) override;
  bool SamplesOnDevice() const override { return true; }
  void PenalizeRows(Tensor& logits, std::span<const LogitPenalties> rows) override;
  void TopLogitsRows(const Tensor& logits, std::span<const int32_t> counts,
                     std::span<const int32_t> chosen, std::span<TokenLogit> out,
                     std::span<float> chosen_logits) override;
  void SampleRows(const Tensor& logits, std::span<const SamplingRule> rules,
                  std::span<const double> uniforms, std::span<const int32_t> drafts,
                  std::span<DrawnToken> out) override;
  void RmsNorm1p(const Tensor& x, const Tensor& w, float eps, Tensor& out) override;
  void AddRmsNorm1p(Tensor& residual, const Tensor& delta, const Tensor& w, float eps,
                    Tensor& out) override;
  void Add(Tensor& x, const Tensor& y) override;
  void SiluAndMul(const Tensor& gate_up, Tensor& out) override;
  void AddSigmoidScaled(Tensor& x, const Tensor& y, const Tensor& gate_logits) override;
  void SiluMulLinear(const Tensor& gate_up, const Tensor& w, Tensor& act, Tensor& out) override;

  // ---- gated DeltaNet ----
  void CausalConv1dSilu(const Tensor& x, const Tensor& w, Tensor& conv_states,
                        std::span<const SequenceSegment> segments, Tensor& out) override;
  void DeltaRuleGates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                      Tensor& g, Tensor& beta) override;
  void GatedDeltaRule(const Tensor& qkv, const Tensor& g, const Tensor& beta,
                      const DeltaRuleDims& dims, Tensor& recurrent_states,
                      std::span<const SequenceSegment> segments, DeltaRuleAlgorithm algorithm,
                      Tensor& out) override;
  void GatedDeltaRuleWithGates(const Tensor& qkv, const Tensor& a, const Tensor& b,
                               const Tensor& a_log, const Tensor& dt_bias,
                               const DeltaRuleDims& dims, Tensor& recurrent_states,
                               std::span<const SequenceSegment> segments,
                               DeltaRuleAlgorithm algorithm, Tensor& g, Tensor& beta,
                               Tensor& out) override;
  void GatedRmsNorm(const Tensor& x, const Tensor& z, const Tensor& w, float eps,
                    Tensor& out) override;
  void GatedDeltaNetMixer(const DeltaNetMixerOperands& op,
                          std::span<const SequenceSegment> segments, DeltaRuleAlgorithm algorithm,
                          Tensor& out) override;
  absl::Status ReplayDeltaRuleStates(std::span<const DeltaRuleReplayLayer> layers,
                                     const DeltaRuleDims& dims,
                                     std::span<const SequenceSegment> segments) override;

  // ---- gated attention ----
  void QkNormRope(const Tensor& q_gate, Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                  float eps, const RopeParams& rope, std::span<const SequenceSegment> segments,
                  Tensor& q, Tensor& gate) override;
  void WriteKvCache(const Tensor& k, const Tensor& v, std::span<const SequenceSegment> segments,
                    Tensor& k_cache, Tensor& v_cache) override;
  void PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      std::span<const SequenceSegment> segments, float scale, Tensor& out) override;
  void MulSigmoid(Tensor& x, const Tensor& gate) override;
  void QkNormRopeWriteKv(const Tensor& q_gate, Tensor& k, const Tensor& v, const Tensor& q_norm,
                         const Tensor& k_norm, float eps, const RopeParams& rope,
                         std::span<const SequenceSegment> segments, Tensor& q, Tensor& gate,
                         Tensor& k_cache, Tensor& v_cache) override;
  void GatedPagedAttention(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                           const Tensor& v_cache, std::span<const SequenceSegment> segments,
                           float scale, Tensor& out) override;

  // ---- mixture of experts ----
  void TopKSoftmax(const Tensor& logits, int k, bool renormalize, Tensor& ids,
                   Tensor& weights) override;
  void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights, const Tensor& gate_up,
                  const Tensor& down, int first_expert, Tensor& out,
                  std::span<int64_t> expert_tokens) override;
  void MoeExpertsWithShared(const Tensor& x, const Tensor& ids, const Tensor& weights,
                            const Tensor& gate_up, const Tensor& down, int first_expert,
                            const Tensor& shared, const Tensor& shared_gate, Tensor& out,
                            std::span<int64_t> expert_tokens) override;
  void MoeExpertsWithSharedExpert(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                  const Tensor& gate_up, const Tensor& down, int first_expert,
                                  const SharedExpertOperands& shared, Tensor& out,
                                  std::span<int64_t> expert_tokens) override;
  void RoutedMoeWithSharedExpert(const Tensor& x, const Tensor& router_logits, int k,
                                 bool renormalize, Tensor& ids, Tensor& weights,
                                 const Tensor& gate_up, const Tensor& down, int first_expert,
                                 const SharedExpertOperands& shared, Tensor& out,
                                 std::span<int64_t> expert_tokens) override;
  void MapExpertIds(const Tensor& ids, const Tensor& routes, int stride, Tensor& out) override;

 private:
  // The delta rule, computing its gates from `gates` (and storing them to g and beta) when given.
  void RunGatedDeltaRule(const Tensor& qkv, Tensor& g, Tensor& beta,
                         const cuda::DeltaGateInputs* gates, const DeltaRuleDims& dims,
                         Tensor& recurrent_states, std::span<const SequenceSegment> segments,
                         DeltaRuleAlgorithm algorithm, Tensor& out);
  // MoeExperts on the grouped kernels (routing, gate-up, down, combine) after CheckMoe; with
  // `shared`, the combine writes out = routed sum + gated shared expert (LaunchMoeExperts).
  void RunMoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                     const Tensor& gate_up, const Tensor& down, int first_expert,
                     const cuda::MoeSharedTerm* shared, Tensor& out,
                     std::span<int64_t> expert_tokens);
  // The few-token MoE kernels (<= MoeFewTokensMaxPairs pairs), with the shared expert's term
  // when given; false, launching nothing, for shapes they do not take. Inputs already checked.
  bool TryMoeFewTokens(const Tensor& x, const Tensor& ids, const Tensor& weights,
                       const Tensor& gate_up, const Tensor& down, int first_expert,
                       const cuda::MoeSharedTerm* shared, Tensor& out);
  // TopKSoftmax's checks; returns the logits.
  AnyPtr CheckTopK(const Tensor& logits, int k, const Tensor& ids, const Tensor& weights);
  // MoeExpertsWithSharedExpert's checks of `shared` for t tokens; returns its gate logits.
  AnyPtr CheckSharedExpert(const SharedExpertOperands& shared, int64_t t, int64_t hidden,
                           const Tensor& out, const char* op);
  // MoeExperts's checks; returns the number of tokens.
  int64_t CheckMoe(const Tensor& x, const Tensor& ids, const Tensor& weights, const Tensor& gate_up,
                   const Tensor& down, const Tensor& out, std::span<const int64_t> expert_tokens);
  struct LinearShape {
    int64_t m, n, k;
  };
  // Validates y[m, n] = x[m, k] @ w[n, k]^T operands (aborting with `op` named) and returns m, n,
  // k.
  LinearShape CheckLinear(const char* op, const Tensor& x, const Tensor& w, const Tensor& y);

  // Makes this backend's device current for the calling thread.
  void Enter() { CheckCuda(cudaSetDevice(device_), "cudaSetDevice"); }

  // The caches QkNormRope also writes this step's keys and values into (QkNormRopeWriteKv).
  struct KvWriteTarget {
    const Tensor& v;
    Tensor& k_cache;
    Tensor& v_cache;
  };
  void QkNormRopeThenWrite(const char* op, const Tensor& q_gate, Tensor& k, const Tensor& q_norm,
                           const Tensor& k_norm, float eps, const RopeParams& rope,
                           std::span<const SequenceSegment> segments, Tensor& q, Tensor& gate,
                           const KvWriteTarget* kv);
  // WriteKvCache's checks of its operands against the segments (the block tables cover every
  // position written); returns the number of tokens.
  int64_t CheckKvWrite(const char* op, const Tensor& k, const Tensor& v,
                       std::span<const SequenceSegment> segments, const Tensor& k_cache,
                       const Tensor& v_cache);
  // PagedAttention, with out *= sigmoid(gate) when gate is given (in the attention kernels'
  // last write where they take it, else by MulSigmoid).
  void PagedAttentionGated(const char* op, const Tensor& q, const Tensor* gate,
                           const Tensor& k_cache, const Tensor& v_cache,
                           std::span<const SequenceSegment> segments, float scale, Tensor& out);

  // Device scratch of at least `bytes`, valid until the next call. Stream order makes reuse
  // across ops safe; growing waits for queued work that may still read the old buffer. Null
  // when the device cannot hold it: the caller skips its launches, and the failure is the
  // step's error (op_error_ outside a capture, refused at EndCapture inside one).
  void* Scratch(size_t bytes);
  // Allocates a device buffer of `wanted` bytes, or of `needed` after the block cache gave its
  // held blocks back, and returns the size allocated; 0 (and *ptr null) when neither fits.
  size_t TryGrowBuffer(void** ptr, size_t needed, size_t wanted);
  // ResourceExhausted for `bytes` of `what` that the device could not give, with its free memory:
  // the one form of every out-of-memory error this backend returns.
  absl::Status OutOfMemory(size_t bytes, const std::string& what) const;
  // Copies `data` into the device metadata buffer (reused by every op) and returns its address.
  // Null when the buffer cannot grow to hold it: the caller skips its launches and the step fails
  // with op_error_, as for the op scratch.
  const int32_t* Upload(const std::vector<int32_t>& data);

  // Packs the segments (and, with `block_tables`, their kv block tables) of a step of
  // `num_tokens` tokens; aborts when the segments do not tile [0, num_tokens).
  PackedSegments PackSegments(const char* op, std::span<const SequenceSegment> segments,
                              int64_t num_tokens, bool block_tables) const;
  // False when Upload failed (the caller skips its launches).
  [[nodiscard]] bool UploadSegments(const PackedSegments& packed, int num_segments,
                                    cuda::TokenMeta* tokens, cuda::SegmentMeta* segs);

  void Gather(const char* op, const Tensor& src, std::span<const int32_t> rows, Tensor& out);

  const int device_;
  cudaStream_t stream_;
  std::unique_ptr<cuda::LtGemm> gemm_;
  const std::string device_name_;
  const int num_sms_;
  // MOBIUS_SKINNY_GEMM=0 sends few-row GEMMs to cuBLASLt (skinny kernel and tensor-core GEMV
  // both off), for before/after timings.
  const bool skinny_off_ = cuda::KnobChoice("MOBIUS_SKINNY_GEMM", {"0", "1"}) == 1;
  // Projections of 2-40 rows go to the tensor-core GEMV (tc_gemv.cu); against cuBLASLt a
  // batch-4 decode step 6.35 -> 5.58 ms, batch 8 8.41 -> 7.60 ms, and at 2 rows against the
  // skinny kernel 4.66 -> 4.54 ms; at 1 row the skinny kernel stays ahead (3.61 vs 3.85 ms;
  // performance.md, eleventh version). Up to 16 rows since 9-16 took two x tiles (cuBLASLt
  // before: batch 10 11.79 -> 11.00 ms, 16 16.05 -> 15.20 on an H100), up to 32 with four, up to
  // 40 with five (batch 40 30.84 -> 30.33 ms). MOBIUS_TC_GEMV=N (1-40) sets the fewest rows it
  // takes, 0 turns it off; MOBIUS_TC_GEMV_MAX_ROWS=N (1-40, default 40) the most (more go to
  // cuBLASLt; A/B runs).
  const int tc_gemv_min_rows_ = [this] {
    const int rows = cuda::KnobInt("MOBIUS_TC_GEMV", 2, 0, cuda::kMaxTcGemvRows);
    return skinny_off_ || rows <= 0 ? cuda::kMaxTcGemvRows + 1 : rows;
  }();
  const int tc_gemv_max_rows_ = cuda::KnobInt("MOBIUS_TC_GEMV_MAX_ROWS",
                                              cuda::kDefaultTcGemvMaxRows, 1, cuda::kMaxTcGemvRows);
  bool TcGemvFor(int64_t m) const { return m >= tc_gemv_min_rows_ && m <= tc_gemv_max_rows_; }
  // A single projection (not a fan-out) of more than 16 rows whose weight has no more 16-row
  // groups than the GPU has SMs (the DeltaNet and attention out-projections, N = 2048) runs the
  // GEMV as one wave of one block an SM, where its three and four x tiles streamed ~1.07 TB/s
  // against cuBLASLt's ~1.28 (H100, 2048 x 4096 at 24 and 32 rows: 15.9 / 17.7 us against 13.3 /
  // 13.6; performance.md, session 48). Fan-outs stay on the GEMV: cuBLASLt runs them as one GEMM
  // a target (0.65 TB/s). MOBIUS_TC_GEMV_NARROW=1 sends those projections to the GEMV too (A/B).
  const bool tc_gemv_narrow_ = cuda::KnobChoice("MOBIUS_TC_GEMV_NARROW", {"0", "1"}) == 2;
  bool TcGemvForSingle(int64_t m, int64_t n) const {
    return TcGemvFor(m) && (m <= 16 || tc_gemv_narrow_ || n > int64_t{16} * num_sms_);
  }
  std::shared_ptr<cuda::DeviceBlockCache> blocks_ =
      std::make_shared<cuda::DeviceBlockCache>(device_);
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  void* meta_ = nullptr;
  size_t meta_bytes_ = 0;

  // The staged step (StageStep): its host spans identify it; its metadata lives in step_meta_
  // ([ids][packed segments]), copied there from the pinned step_host_.
  struct StagedStep {
    bool active = false;
    const int32_t* ids = nullptr;
    size_t num_ids = 0;
    const SequenceSegment* segments = nullptr;
    size_t num_segments = 0;
    int max_positions = 0;
    PackedSegments packed;  // offsets relative to segments_offset; data cleared
    size_t segments_offset = 0;
  };
  StagedStep staged_;
  int32_t* step_meta_ = nullptr;
  int32_t* step_host_ = nullptr;
  size_t step_capacity_ = 0;  // int32 elements of both
  cudaEvent_t step_copied_ = nullptr;

  // Capture: allocations come from pool_ (cuda::CapturePool). `generation_` changes whenever a
  // buffer that a captured step may point at (step_meta_) is reallocated. A capture that ran out
  // of device memory (capture_out_of_memory_) is refused at EndCapture, so that its recording,
  // which points at buffers it did not get, is never replayed.
  absl::StatusOr<Tensor> AllocateAndFill(DType dtype, std::vector<int64_t> shape, bool zero);
  absl::Status CaptureScratchError() const;  // the capture's failed scratch block, with sizes
  // The first op failure outside a capture since TakeOpError (an op scratch that did not fit).
  absl::Status op_error_;
  // Keeps `error` in op_error_ unless an earlier failure is already waiting there.
  void RecordOpError(absl::Status error) {
    if (op_error_.ok()) op_error_ = std::move(error);
  }
  bool capturing_ = false;
  bool capture_out_of_memory_ = false;
  size_t capture_failed_bytes_ = 0;
  std::shared_ptr<cuda::CapturePool> pool_ = std::make_shared<cuda::CapturePool>(
      device_, cuda::KnobChoice("MOBIUS_CAPTURE_POOL_REUSE", {"0", "1"}) != 1);
  uint64_t generation_ = 0;
};

void* CudaBackend::Scratch(size_t bytes) {
  // A captured step keeps its own scratch: the shared buffer may be reallocated later.
  if (capturing_) {
    // Nothing runs while capturing: a capture out of memory only has to be refused at
    // EndCapture, and its ops skip their launches on the nullptr returned here.
    void* ptr = pool_->Scratch(bytes);
    if (ptr == nullptr && !capture_out_of_memory_) {
      capture_out_of_memory_ = true;
      capture_failed_bytes_ = bytes;
    }
    return ptr;
  }
  if (bytes > scratch_bytes_) {
    if (scratch_ != nullptr) {
      CheckCuda(cudaStreamSynchronize(stream_), "Scratch");
      cudaFree(scratch_);
      scratch_ = nullptr;
    }
    scratch_bytes_ =
        TryGrowBuffer(&scratch_, bytes, std::max(bytes, scratch_bytes_ + scratch_bytes_ / 2));
    if (scratch_bytes_ == 0) {
      // The op skips its launches; its step fails with this error (HybridModel::Forward takes
      // it), and the next op that asks for less may still get it.
      RecordOpError(OutOfMemory(bytes, "op scratch"));
      return nullptr;
    }
  }
  return scratch_;
}

size_t CudaBackend::TryGrowBuffer(void** ptr, size_t needed, size_t wanted) {
  if (cudaMalloc(ptr, wanted) == cudaSuccess) return wanted;
  cudaGetLastError();
  // Blocks the cache holds for other shapes' steps go back to the device, and only what is
  // needed is asked for again: a cache grown by earlier steps must not make this one fail.
  blocks_->Trim();
  if (cudaMalloc(ptr, needed) == cudaSuccess) return needed;
  cudaGetLastError();
  *ptr = nullptr;
  return 0;
}

absl::Status CudaBackend::OutOfMemory(size_t bytes, const std::string& what) const {
  size_t free_bytes = 0, total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  return absl::ResourceExhaustedError(
      absl::StrFormat("cuda:%d: cannot allocate %d bytes of %s (%d of %d bytes free)", device_,
                      bytes, what, free_bytes, total_bytes));
}

const int32_t* CudaBackend::Upload(const std::vector<int32_t>& data) {
  Check(!capturing_, "capture",
        "an op uploads host metadata that StageStep did not stage; it cannot be recorded");
  const size_t bytes = data.size() * sizeof(int32_t);
  // (Also after a failed growth left no buffer: null means failure to the callers.)
  if (bytes > meta_bytes_ || meta_ == nullptr) {
    if (meta_ != nullptr) {
      CheckCuda(cudaStreamSynchronize(stream_), "Upload");
      cudaFree(meta_);
      meta_ = nullptr;
    }
    meta_bytes_ = TryGrowBuffer(&meta_, bytes, std::max<size_t>({bytes, 2 * meta_bytes_, 4096}));
    if (meta_bytes_ == 0) {
      RecordOpError(OutOfMemory(bytes, "op metadata"));
      return nullptr;
    }
  }
  // A pageable source is staged before cudaMemcpyAsync returns, so `data` may die right after.
  if (bytes > 0) {
    CheckCuda(cudaMemcpyAsync(meta_, data.data(), bytes, cudaMemcpyHostToDevice, stream_),
              "metadata upload");
  }
  return static_cast<const int32_t*>(meta_);
}

PackedSegments CudaBackend::PackSegments(const char* op, std::span<const SequenceSegment> segments,
                                         int64_t num_tokens, bool block_tables) const {
  if (staged_.active && segments.data() == staged_.segments &&
      segments.size() == staged_.num_segments && num_tokens == staged_.packed.token_position) {
    return staged_.packed;  // staged with block tables, which ops without them ignore
  }
  PackedSegments p;
  const size_t s = segments.size();
  const size_t t = static_cast<size_t>(num_tokens);
  p.token_segment = 0;
  p.token_position = t;
  p.token_begin = 2 * t;
  p.num_tokens = p.token_begin + s;
  p.cached_tokens = p.num_tokens + s;
  p.state_slot = p.cached_tokens + s;
  p.state_out_slot = p.state_slot + s;
  p.block_table_begin = p.state_out_slot + s;
  p.block_tables = p.block_table_begin + s;
  p.data.assign(p.block_tables, 0);
  int64_t next = 0;
  for (size_t i = 0; i < s; ++i) {
    const SequenceSegment& seg = segments[i];
    Check(seg.token_begin == next && seg.num_tokens >= 0 && seg.cached_tokens >= 0, op,
          absl::StrFormat("segment %d (begin %d, %d tokens) does not continue at token %d", i,
                          seg.token_begin, seg.num_tokens, next));
    for (int32_t j = 0; j < seg.num_tokens; ++j) {
      p.data[p.token_segment + seg.token_begin + j] = static_cast<int32_t>(i);
      p.data[p.token_position + seg.token_begin + j] = seg.cached_tokens + j;
    }
    next += seg.num_tokens;
    Check(next <= num_tokens, op,
          absl::StrFormat("segments cover more than the %d tokens of the step", num_tokens));
    p.data[p.token_begin + i] = seg.token_begin;
    p.data[p.num_tokens + i] = seg.num_tokens;
    p.data[p.cached_tokens + i] = seg.cached_tokens;
    p.data[p.state_slot + i] = seg.state_slot;
    p.data[p.state_out_slot + i] = WrittenStateSlot(seg);
    p.data[p.block_table_begin + i] = static_cast<int32_t>(p.data.size() - p.block_tables);
    if (block_tables) p.data.insert(p.data.end(), seg.kv_blocks.begin(), seg.kv_blocks.end());
  }
  Check(next == num_tokens, op,
        absl::StrFormat("segments cover %d of the %d tokens of the step", next, num_tokens));
  return p;
}

bool CudaBackend::UploadSegments(const PackedSegments& packed, int num_segments,
                                 cuda::TokenMeta* tokens, cuda::SegmentMeta* segs) {
  const int32_t* d = packed.staged ? step_meta_ + staged_.segments_offset : Upload(packed.data);
  if (d == nullptr) return false;
  tokens->token_segment = d + packed.token_segment;
  tokens->token_position = d + packed.token_position;
  segs->num_segments = num_segments;
  segs->token_begin = d + packed.token_begin;
  segs->num_tokens = d + packed.num_tokens;
  segs->cached_tokens = d + packed.cached_tokens;
  segs->state_slot = d + packed.state_slot;
  segs->state_out_slot = d + packed.state_out_slot;
  segs->block_table_begin = d + packed.block_table_begin;
  segs->block_tables = d + packed.block_tables;
  return true;
}

// ---- step staging and capture ----

void CudaBackend::StageStep(std::span<const int32_t> ids, std::span<const SequenceSegment> segments,
                            int max_positions) {
  Check(!capturing_, "StageStep", "cannot stage a step while capturing");
  staged_ = StagedStep{};
  PackedSegments packed = PackSegments("StageStep", segments, ids.size(), /*block_tables=*/true);
  const size_t total = ids.size() + packed.data.size();
  Enter();
  if (step_copied_ == nullptr) {
    CheckCuda(cudaEventCreateWithFlags(&step_copied_, cudaEventDisableTiming), "StageStep event");
  }
  // The previous step's copy must have left the pinned buffer before it is rewritten.
  CheckCuda(cudaEventSynchronize(step_copied_), "StageStep");
  if (total > step_capacity_) {
    // Captured steps point into step_meta_: a new buffer retires them (generation_).
    CheckCuda(cudaStreamSynchronize(stream_), "StageStep");
    if (step_meta_ != nullptr) cudaFree(step_meta_);
    if (step_host_ != nullptr) cudaFreeHost(step_host_);
    step_meta_ = nullptr;
    step_host_ = nullptr;
    const size_t grown = std::max<size_t>({total, 2 * step_capacity_, size_t{1} << 20});
    step_capacity_ = 0;
    ++generation_;
    // When either buffer cannot be had the step is not staged: it fails with op_error_
    // (HybridModel::Forward takes it before the step runs), and the next one tries again.
    void* meta = nullptr;
    const size_t capacity =
        TryGrowBuffer(&meta, total * sizeof(int32_t), grown * sizeof(int32_t)) / sizeof(int32_t);
    if (capacity == 0) {
      RecordOpError(OutOfMemory(total * sizeof(int32_t), "step metadata"));
      return;
    }
    if (cudaMallocHost(&step_host_, capacity * sizeof(int32_t)) != cudaSuccess) {
      cudaGetLastError();
      cudaFree(meta);
      step_host_ = nullptr;
      RecordOpError(absl::ResourceExhaustedError(absl::StrFormat(
          "cuda:%d: cannot allocate %d bytes of pinned host memory for the step metadata", device_,
          capacity * sizeof(int32_t))));
      return;
    }
    step_meta_ = static_cast<int32_t*>(meta);
    step_capacity_ = capacity;
  }
  std::copy(ids.begin(), ids.end(), step_host_);
  std::copy(packed.data.begin(), packed.data.end(), step_host_ + ids.size());
  CheckCuda(cudaMemcpyAsync(step_meta_, step_host_, total * sizeof(int32_t), cudaMemcpyHostToDevice,
                            stream_),
            "StageStep upload");
  CheckCuda(cudaEventRecord(step_copied_, stream_), "StageStep event");
  staged_.active = true;
  staged_.ids = ids.data();
  staged_.num_ids = ids.size();
  staged_.segments = segments.data();
  staged_.num_segments = segments.size();
  staged_.max_positions = max_positions;
  staged_.segments_offset = ids.size();
  packed.data.clear();
  packed.staged = true;
  staged_.packed = std::move(packed);
}

absl::StatusOr<Tensor> CudaBackend::AllocateAndFill(DType dtype, std::vector<int64_t> shape,
                                                    bool zero) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Allocate: negative dimension in %s",
                          Tensor({}, nullptr, dtype, shape, Device::kCuda).ShapeString()));
    }
    numel *= d;
  }
  // Zero-sized tensors still get a (tiny) allocation so that they are not empty().
  const size_t bytes = std::max<size_t>(static_cast<size_t>(numel) * DTypeSize(dtype), 16);
  CheckCuda(cudaSetDevice(device_), "cudaSetDevice");
  // A recording already out of memory is refused at its end: its first failure is the error.
  if (capturing_ && capture_out_of_memory_) return CaptureScratchError();
  std::shared_ptr<void> storage = capturing_ ? pool_->Get(bytes) : blocks_->Get(bytes);
  if (storage == nullptr) {
    return OutOfMemory(
        bytes, absl::StrCat(std::string(DTypeName(dtype)), " ",
                            Tensor({}, nullptr, dtype, shape, Device::kCuda).ShapeString(),
                            capturing_ ? " while recording a step (the capture pool's limit or "
                                         "the device's memory)"
                                       : ""));
  }
  void* ptr = storage.get();
  // MOBIUS_UNINITIALIZED_FILL=zero fills uninitialised tensors as Allocate does (the timing
  // baseline), =poison with 0xff bytes (NaN in bf16 and fp32) or, in int32, 0x7f bytes (an id far
  // outside any table: -1 would read as "another rank's pair"), so that a test shows an op that
  // reads what it was supposed to write first.
  static const int fill = cuda::KnobChoice("MOBIUS_UNINITIALIZED_FILL", {"none", "zero", "poison"});
  const int poison = dtype == DType::kI32 ? 0x7f : 0xff;
  const int byte = (zero || fill == 2) ? 0 : (fill == 3 ? poison : -1);  // -1: no fill
  if (byte >= 0) CheckCuda(cudaMemsetAsync(ptr, byte, bytes, stream_), "Allocate memset");
  return Tensor(std::move(storage), ptr, dtype, std::move(shape), Device::kCuda);
}

absl::Status CudaBackend::BeginCapture() {
  if (capturing_) return absl::FailedPreconditionError("BeginCapture: already capturing");
  if (!staged_.active) {
    return absl::FailedPreconditionError("BeginCapture: no staged step (call StageStep first)");
  }
  Enter();
  pool_->Begin();
  capture_out_of_memory_ = false;
  const cudaError_t err = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamBeginCapture: ", cudaGetErrorString(err)));
  }
  capturing_ = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::CaptureScratchError() const {
  return OutOfMemory(capture_failed_bytes_,
                     absl::StrFormat("op scratch while recording a step (the capture pool's "
                                     "limit or the device's memory; %d bytes held for recorded "
                                     "steps)",
                                     pool_->reserved_bytes()));
}

absl::StatusOr<std::unique_ptr<CapturedStep>> CudaBackend::EndCapture() {
  if (!capturing_) return absl::FailedPreconditionError("EndCapture: not capturing");
  Enter();
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamEndCapture(stream_, &graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaStreamEndCapture: ", cudaGetErrorString(err)));
  }
  if (capture_out_of_memory_) {
    cudaGraphDestroy(graph);
    return CaptureScratchError();
  }
  static const bool census = cuda::KnobChoice("MOBIUS_GRAPH_CENSUS", {"0", "1"}) == 2;
  if (census) {
    size_t count = 0;
    cudaGraphGetNodes(graph, nullptr, &count);
    std::vector<cudaGraphNode_t> nodes(count);
    cudaGraphGetNodes(graph, nodes.data(), &count);
    int kernels = 0, memsets = 0, copies = 0, others = 0;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      cudaGraphNodeGetType(node, &type);
      if (type == cudaGraphNodeTypeKernel)
        ++kernels;
      else if (type == cudaGraphNodeTypeMemset)
        ++memsets;
      else if (type == cudaGraphNodeTypeMemcpy)
        ++copies;
      else
        ++others;
    }
    std::fprintf(stderr, "graph census: %zu nodes: %d kernels, %d memsets, %d copies, %d other\n",
                 count, kernels, memsets, copies, others);
  }
  cudaGraphExec_t exec = nullptr;
  err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaGraphInstantiate: ", cudaGetErrorString(err)));
  }
  return std::make_unique<CudaCapturedStep>(exec, generation_);
}

absl::Status CudaBackend::Replay(CapturedStep& step) {
  auto* captured = dynamic_cast<CudaCapturedStep*>(&step);
  if (captured == nullptr) return absl::InvalidArgumentError("Replay: not a CUDA captured step");
  if (captured->generation() != generation_) {
    return absl::FailedPreconditionError("Replay: the step's buffers were reallocated");
  }
  Enter();
  const cudaError_t err = cudaGraphLaunch(captured->exec(), stream_);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGraphLaunch: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

// ---- dense ----

CudaBackend::LinearShape CudaBackend::CheckLinear(const char* op, const Tensor& x, const Tensor& w,
                                                  const Tensor& y) {
  CheckTensor(x, DType::kBF16, op, "x");
  CheckTensor(w, DType::kBF16, op, "w");
  Check(!y.empty() && y.device() == Device::kCuda &&
            (y.dtype() == DType::kBF16 || y.dtype() == DType::kF32),
        op, "y must be a CUDA BF16 or F32 tensor");
  Check(w.rank() == 2, op, "w must be [N, K]");
  const int64_t n = w.dim(0), k = w.dim(1);
  Check(k > 0 && x.numel() % k == 0, op,
        absl::StrFormat("x %s does not have rows of K = %d", x.ShapeString(), k));
  const int64_t m = x.numel() / k;
  Check(y.numel() == m * n, op, absl::StrFormat("y %s is not [%d, %d]", y.ShapeString(), m, n));
  return {m, n, k};
}

void CudaBackend::Linear(const Tensor& x, const Tensor& w, Tensor& y) {
  const LinearShape s = CheckLinear("Linear", x, w, y);
  if (s.m == 0 || s.n == 0) return;
  Enter();
  const bool y_f32 = y.dtype() == DType::kF32;
  // 2-40 rows on the tensor-core GEMV (the lm_head included; above 16 rows only weights wider
  // than a wave): it streams weights faster than cuBLASLt and the skinny kernel do there.
  if (TcGemvForSingle(s.m, s.n) && cuda::TcGemvSupports(s.m, s.k, x.raw(), w.raw())) {
    const cuda::SkinnyTarget target{Bf16(w), s.n, AnyMutPtr{y.raw(), y_f32}};
    cuda::LaunchTcGemv(Bf16(x), s.m, s.k, &target, 1, stream_);
    return;
  }
  // Otherwise one or two rows through weights of up to 32 MB: the skinny kernel beat cuBLASLt on
  // the release shapes (1 x 2048 x 4096: 9.2 vs 10.3 us, 1 x 2048 x 512: 4.9 vs 5.5 us; a gate
  // projection of a few columns: one launch instead of a GEMV plus a reduction). Larger weights
  // stay with cuBLASLt, which was as fast there (skinny_gemm.cu).
  if (s.n * s.k <= (int64_t{16} << 20) && cuda::SkinnyGemmSupports(s.m, s.k, x.raw(), w.raw()) &&
      !skinny_off_) {
    const cuda::SkinnyTarget target{Bf16(w), s.n, AnyMutPtr{y.raw(), y_f32}};
    cuda::LaunchSkinnyGemm(Bf16(x), s.m, s.k, &target, 1, stream_);
    return;
  }
  if (!gemm_->Run(Bf16(x), Bf16(w), y.raw(), y_f32, s.m, s.n, s.k, stream_)) {
    cuda::LaunchGemmFallback(Bf16(x), Bf16(w), s.m, s.n, s.k, AnyMutPtr{y.raw(), y_f32}, stream_);
  }
}

void CudaBackend::LinearFanOut(const Tensor& x, std::span<const Tensor* const> ws,
                               std::span<Tensor* const> ys) {
  Check(ws.size() == ys.size(), "LinearFanOut",
        absl::StrFormat("%d weights but %d outputs", ws.size(), ys.size()));
  std::vector<cuda::SkinnyTarget> targets;
  int64_t m = -1, k = -1;
  bool skinny = !skinny_off_, tc = true;
  for (size_t i = 0; i < ws.size(); ++i) {
    const LinearShape s = CheckLinear("LinearFanOut", x, *ws[i], *ys[i]);
    m = s.m;
    k = s.k;
    skinny = skinny && cuda::SkinnyGemmSupports(s.m, s.k, x.raw(), ws[i]->raw());
    tc = tc && (ws.size() > 1 ? TcGemvFor(s.m) : TcGemvForSingle(s.m, s.n)) &&
         cuda::TcGemvSupports(s.m, s.k, x.raw(), ws[i]->raw());
    targets.push_back({Bf16(*ws[i]), s.n, AnyMutPtr{ys[i]->raw(), ys[i]->dtype() == DType::kF32}});
  }
  if ((!skinny && !tc) || m <= 0) {
    for (size_t i = 0; i < ws.size(); ++i) Linear(x, *ws[i], *ys[i]);
    return;
  }
  Enter();
  for (size_t i = 0; i < targets.size(); i += cuda::kMaxSkinnyTargets) {
    const int count =
        static_cast<int>(std::min<size_t>(cuda::kMaxSkinnyTargets, targets.size() - i));
    if (tc) {
      cuda::LaunchTcGemv(Bf16(x), m, k, targets.data() + i, count, stream_);
    } else {
      cuda::LaunchSkinnyGemm(Bf16(x), m, k, targets.data() + i, count, stream_);
    }
  }
}

void CudaBackend::Gather(const char* op, const Tensor& src, std::span<const int32_t> rows,
                         Tensor& out) {
  const AnyPtr s = Any(src, op, "source");
  Check(!out.empty() && out.device() == Device::kCuda &&
            (out.dtype() == DType::kBF16 || out.dtype() == DType::kF32),
        op, "out must be a CUDA BF16 or F32 tensor");
  Check(src.rank() >= 1, op, "source must have rows");
  const int64_t num_src_rows = src.dim(0);
  const int64_t width = num_src_rows == 0 ? 0 : src.numel() / num_src_rows;
  Check(out.numel() == static_cast<int64_t>(rows.size()) * width, op,
        absl::StrFormat("out %s is not [%d, %d]", out.ShapeString(), rows.size(), width));
  for (int32_t r : rows) {
    Check(r >= 0 && r < num_src_rows, op,
          absl::StrFormat("row %d outside [0, %d)", r, num_src_rows));
  }
  if (rows.empty()) return;
  Enter();
  const bool staged =
      staged_.active && rows.data() == staged_.ids && rows.size() == staged_.num_ids;
  const int32_t* d_rows =
      staged ? step_meta_ : Upload(std::vector<int32_t>(rows.begin(), rows.end()));
  if (d_rows == nullptr) return;  // out of memory: the step fails (Upload)
  cuda::LaunchGatherRows(s, d_rows, static_cast<int64_t>(rows.size()), width,
                         AnyMutPtr{out.raw(), out.dtype() == DType::kF32}, stream_);
}

void CudaBackend::EmbeddingLookup(std::span<const int32_t> ids, const Tensor& table, Tensor& out) {
  Gather("EmbeddingLookup", table, ids, out);
}

void CudaBackend::GatherRows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) {
  Gather("GatherRows", x, rows, out);
}

void CudaBackend::CopyRows(std::span<Tensor* const> xs, std::span<const int32_t> from,
                           std::span<const int32_t> to) {
  Check(from.size() == to.size(), "CopyRows",
        absl::StrFormat("%d source rows but %d destination rows", from.size(), to.size()));
  std::vector<cuda::CopyRowsTarget> targets;  // those whose rows are 16-byte pieces
  std::vector<Tensor*> target_tensors;        // the same, as tensors
  std::vector<Tensor*> row_by_row;            // the others
  for (Tensor* x : xs) {
    Check(x != nullptr && !x->empty() && x->device() == Device::kCuda && x->rank() >= 1, "CopyRows",
          "every x must be a CUDA tensor with rows");
    const int64_t rows = x->dim(0);
    for (size_t i = 0; i < from.size(); ++i) {
      Check(from[i] >= 0 && from[i] < rows && to[i] >= 0 && to[i] < rows, "CopyRows",
            absl::StrFormat("row pair %d -> %d outside [0, %d)", from[i], to[i], rows));
    }
    if (rows == 0) continue;  // then `from` is empty (checked above): nothing to copy
    const int64_t row_bytes = x->numel() / rows * static_cast<int64_t>(DTypeSize(x->dtype()));
    if (row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(x->raw()) % 16 == 0) {
      targets.push_back({x->raw(), row_bytes});
      target_tensors.push_back(x);
    } else {
      row_by_row.push_back(x);
    }
  }
  if (from.empty()) return;
  // The rows are copied in parallel: a row that is both a source and a destination would race.
  // The interface forbids it; should it happen, the row-by-row default keeps its order.
  std::vector<int32_t> sources(from.begin(), from.end());
  std::sort(sources.begin(), sources.end());
  for (int32_t r : to) {
    if (std::binary_search(sources.begin(), sources.end(), r)) {
      Backend::CopyRows(xs, from, to);
      return;
    }
  }
  Enter();
  if (!targets.empty()) {
    // One upload (sources then destinations) for every row of the call, and one launch per
    // kMaxCopyRowsTargets tensors. The row-by-row copies below upload too (into the same
    // buffer), so they come after every launch that reads these pairs.
    std::vector<int32_t> pairs(from.begin(), from.end());
    pairs.insert(pairs.end(), to.begin(), to.end());
    const int32_t* d = Upload(pairs);
    if (d == nullptr) return;  // out of memory: TakeOpError says so (Upload)
    const auto n = static_cast<int64_t>(from.size());
    for (size_t first = 0; first < targets.size(); first += cuda::kMaxCopyRowsTargets) {
      const int count =
          static_cast<int>(std::min<size_t>(cuda::kMaxCopyRowsTargets, targets.size() - first));
      if (!cuda::LaunchCopyRows(targets.data() + first, count, d, d + n, n, stream_)) {
        // Rows too wide for one launch's grid (over 1 GiB).
        row_by_row.insert(row_by_row.end(), target_tensors.begin() + first,
                          target_tensors.begin() + first + count);
      }
    }
  }
  if (!row_by_row.empty()) Backend::CopyRows(row_by_row, from, to);
}

void CudaBackend::ArgmaxRows(const Tensor& logits, Tensor& ids) {
  CheckTensor(logits, DType::kF32, "ArgmaxRows", "logits");
  CheckTensor(ids, DType::kI32, "ArgmaxRows", "ids");
  const int64_t rows = ids.numel();
  Check(rows == 0 || (logits.numel() % rows == 0 && logits.numel() / rows > 0 &&
                      logits.numel() / rows <= INT32_MAX),
        "ArgmaxRows", absl::StrFormat("logits %s for %d rows", logits.ShapeString(), rows));
  if (rows == 0) return;
  Enter();
  cuda::LaunchArgmaxRows(logits.data<float>(), rows, logits.numel() / rows, ids.data<int32_t>(),
                         stream_);
}

void CudaBackend::PenalizeRows(Tensor& logits, std::span<const LogitPenalties> rows) {
  CheckTensor(logits, DType::kF32, "PenalizeRows", "logits");
  const int64_t count = static_cast<int64_t>(rows.size());
  Check(count == 0 || (logits.numel() % count == 0 && logits.numel() / count > 0 &&
                       logits.numel() / count <= INT32_MAX),
        "PenalizeRows", absl::StrFormat("logits %s for %d rows", logits.ShapeString(), count));
  // Only the active rows are launched; their parameters, then every (token, count) and (token,
  // bias) entry, then the rows' allowed-token masks go up with the metadata upload (int32
  // words). A shared list that several rows point at (the rows of a verify step) goes up once.
  // Everything is applied on the device: a structured-output row used to make a host round trip
  // of its whole row for its mask (1 MB each way at a 248K vocabulary, behind a synchronize).
  static_assert(sizeof(cuda::PenaltyRowParams) % sizeof(int2) == 0);
  constexpr size_t kParamWords = sizeof(cuda::PenaltyRowParams) / sizeof(int32_t);
  std::vector<int64_t> active, masked;
  size_t entries = 0;
  // A shared list (its tokens' and counts' addresses and size) -> its first entry.
  using SharedList = std::tuple<const int32_t*, const int32_t*, size_t>;
  auto shared_key = [](const LogitPenalties& p) {
    return SharedList{p.shared_tokens.data(), p.shared_counts.data(), p.shared_tokens.size()};
  };
  std::map<SharedList, int32_t> shared_first;
  for (int64_t r = 0; r < count; ++r) {
    const LogitPenalties& p = rows[r];
    if (!p.Active()) continue;
    Check(p.counts.size() == p.tokens.size() && p.shared_counts.size() == p.shared_tokens.size() &&
              p.biases.size() == p.bias_tokens.size(),
          "PenalizeRows",
          absl::StrFormat("row %d has %d tokens and %d counts, %d shared tokens and %d counts, "
                          "%d bias tokens and %d biases",
                          r, p.tokens.size(), p.counts.size(), p.shared_tokens.size(),
                          p.shared_counts.size(), p.bias_tokens.size(), p.biases.size()));
    active.push_back(r);
    entries += p.tokens.size() + p.bias_tokens.size();
    // (-1: not yet written.)
    if (!p.shared_tokens.empty() && shared_first.emplace(shared_key(p), -1).second) {
      entries += p.shared_tokens.size();
    }
    if (!p.allowed_tokens.empty() || !p.allowed_mask.empty()) masked.push_back(r);
  }
  if (active.empty()) return;
  Check(entries <= INT32_MAX, "PenalizeRows", absl::StrFormat("%d entries", entries));
  const int64_t vocab = logits.numel() / count;
  const size_t mask_words = static_cast<size_t>((vocab + 63) / 64);
  // Layout: params, entries (int2), the masked rows' indices (padded to an even count, so that
  // the masks after them are 8-byte aligned), the masks (uint64, two words each).
  const size_t entries_at = active.size() * kParamWords;
  const size_t mask_rows_at = entries_at + 2 * entries;
  const size_t masks_at = mask_rows_at + (masked.size() + 1) / 2 * 2;
  std::vector<int32_t> words(masks_at + 2 * mask_words * masked.size(), 0);
  int32_t* const entry_base = words.data() + entries_at;
  int32_t next = 0;  // the next free entry
  auto put = [&](std::span<const int32_t> tokens, auto values) {
    const int32_t first = next;
    for (size_t j = 0; j < tokens.size(); ++j) {
      entry_base[2 * static_cast<size_t>(next)] = tokens[j];
      std::memcpy(&entry_base[2 * static_cast<size_t>(next) + 1], &values[j], sizeof(int32_t));
      ++next;
    }
    return first;
  };
  for (size_t i = 0; i < active.size(); ++i) {
    const LogitPenalties& p = rows[active[i]];
    const int32_t first = put(p.tokens, p.counts);
    int32_t shared = 0;
    if (!p.shared_tokens.empty()) {
      int32_t& at = shared_first[shared_key(p)];
      if (at < 0) at = put(p.shared_tokens, p.shared_counts);
      shared = at;
    }
    const int32_t bias_first = put(p.bias_tokens, p.biases);
    const cuda::PenaltyRowParams params{p.repetition,
                                        p.frequency,
                                        p.presence,
                                        first,
                                        static_cast<int32_t>(p.tokens.size()),
                                        shared,
                                        static_cast<int32_t>(p.shared_tokens.size()),
                                        bias_first,
                                        static_cast<int32_t>(p.bias_tokens.size()),
                                        0};
    std::memcpy(words.data() + i * kParamWords, &params, sizeof(params));
  }
  // Each masked row's mask: its allowed_mask (all ones without one), and with allowed_tokens
  // the bits of the listed tokens alone.
  std::vector<uint64_t> mask(mask_words), listed(mask_words);
  for (size_t i = 0; i < masked.size(); ++i) {
    const LogitPenalties& p = rows[masked[i]];
    words[mask_rows_at + i] = static_cast<int32_t>(masked[i]);
    std::fill(mask.begin(), mask.end(), ~uint64_t{0});
    if (!p.allowed_mask.empty()) {
      for (size_t w = 0; w < mask_words; ++w) {
        mask[w] = w < p.allowed_mask.size() ? p.allowed_mask[w] : 0;
      }
    }
    if (!p.allowed_tokens.empty()) {
      std::fill(listed.begin(), listed.end(), 0);
      for (int32_t t : p.allowed_tokens) {
        if (t >= 0 && t < vocab) listed[static_cast<size_t>(t) / 64] |= uint64_t{1} << (t % 64);
      }
      for (size_t w = 0; w < mask_words; ++w) mask[w] &= listed[w];
    }
    std::memcpy(words.data() + masks_at + 2 * mask_words * i, mask.data(),
                mask_words * sizeof(uint64_t));
  }
  Enter();
  const int32_t* meta = Upload(words);
  if (meta == nullptr) return;  // out of memory: the step fails (Upload)
  // One launch per run of consecutive active rows (usually one run: every row, or a single row).
  size_t i = 0;
  while (i < active.size()) {
    size_t j = i + 1;
    while (j < active.size() && active[j] == active[j - 1] + 1) ++j;
    cuda::LaunchPenalizeRows(logits.data<float>() + active[i] * vocab, static_cast<int64_t>(j - i),
                             vocab, reinterpret_cast<const cuda::PenaltyRowParams*>(meta) + i,
                             reinterpret_cast<const int2*>(meta + entries_at), stream_);
    i = j;
  }
  // The masks last, as on the host (ApplyLogitPenalties).
  cuda::LaunchMaskRows(logits.data<float>(), static_cast<int64_t>(masked.size()), vocab,
                       meta + mask_rows_at, reinterpret_cast<const uint64_t*>(meta + masks_at),
                       stream_);
}

void CudaBackend::TopLogitsRows(const Tensor& logits, std::span<const int32_t> counts,
                                std::span<const int32_t> chosen, std::span<TokenLogit> out,
                                std::span<float> chosen_logits) {
  CheckTensor(logits, DType::kF32, "TopLogitsRows", "logits");
  const int64_t rows = static_cast<int64_t>(counts.size());
  Check(rows == 0 || (logits.numel() % rows == 0 && logits.numel() / rows > 0 &&
                      logits.numel() / rows <= INT32_MAX),
        "TopLogitsRows", absl::StrFormat("logits %s for %d rows", logits.ShapeString(), rows));
  if (rows == 0) return;
  const int64_t vocab = logits.numel() / rows;
  const int32_t width = *std::max_element(counts.begin(), counts.end());
  Check(width <= cuda::kMaxTopLogits && width <= vocab && chosen.size() == counts.size() &&
            chosen_logits.size() == counts.size() &&
            out.size() >= static_cast<size_t>(rows) * std::max(width, 0),
        "TopLogitsRows",
        absl::StrFormat("counts up to %d (at most %d and the vocabulary %d), %d chosen, %d chosen "
                        "logits and %d outputs for %d rows",
                        width, cuda::kMaxTopLogits, vocab, chosen.size(), chosen_logits.size(),
                        out.size(), rows));
  if (width <= 0) return;
  // counts, chosen, then room for the results (pairs, then the chosen logits) in one upload.
  static_assert(sizeof(cuda::TopLogitResult) == 2 * sizeof(int32_t));
  static_assert(cuda::kMaxTopLogits >= kMaxTopLogprobs, "every request's top-n fits the kernel");
  const size_t pairs = static_cast<size_t>(rows) * width;
  std::vector<int32_t> words(2 * static_cast<size_t>(rows) + 2 * pairs + rows, 0);
  std::copy(counts.begin(), counts.end(), words.begin());
  std::copy(chosen.begin(), chosen.end(), words.begin() + rows);
  Enter();
  const int32_t* meta = Upload(words);
  if (meta == nullptr) return;  // out of memory: the step fails (Upload)
  auto* results = reinterpret_cast<cuda::TopLogitResult*>(const_cast<int32_t*>(meta) + 2 * rows);
  auto* device_chosen = reinterpret_cast<float*>(const_cast<int32_t*>(meta) + 2 * rows + 2 * pairs);
  cuda::LaunchTopLogitsRows(logits.data<float>(), rows, vocab, meta, meta + rows, width, results,
                            device_chosen, stream_);
  std::vector<int32_t> host(2 * pairs + rows);
  CheckCuda(cudaMemcpyAsync(host.data(), results, host.size() * sizeof(int32_t),
                            cudaMemcpyDeviceToHost, stream_),
            "TopLogitsRows results");
  CheckCuda(cudaStreamSynchronize(stream_), "TopLogitsRows results");
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t j = 0; j < counts[r]; ++j) {
      const size_t at = static_cast<size_t>(r) * width + j;
      out[at] = {host[2 * at], std::bit_cast<float>(host[2 * at + 1])};
    }
    if (counts[r] > 0) chosen_logits[r] = std::bit_cast<float>(host[2 * pairs + r]);
  }
}

void CudaBackend::SampleRows(const Tensor& logits, std::span<const SamplingRule> rules,
                             std::span<const double> uniforms, std::span<const int32_t> drafts,
                             std::span<DrawnToken> out) {
  CheckTensor(logits, DType::kF32, "SampleRows", "logits");
  const int64_t rows = static_cast<int64_t>(rules.size());
  Check(uniforms.size() == rules.size() && out.size() == rules.size() &&
            (drafts.empty() || drafts.size() == rules.size()),
        "SampleRows",
        absl::StrFormat("%d rules, %d uniforms, %d drafts, %d outputs", rules.size(),
                        uniforms.size(), drafts.size(), out.size()));
  Check(rows == 0 || (logits.numel() % rows == 0 && logits.numel() / rows > 0 &&
                      logits.numel() / rows <= INT32_MAX),
        "SampleRows", absl::StrFormat("logits %s for %d rows", logits.ShapeString(), rows));
  if (rows == 0) return;
  const int64_t vocab = logits.numel() / rows;
  auto draft_of = [&](int64_t r) { return drafts.empty() ? kPlainDraw : drafts[r]; };
  // The rows' parameters go up with the metadata upload, followed by room for the results, so
  // that the op allocates nothing (int32 words; the structs' sizes are multiples of 8, so their
  // doubles stay aligned in the allocation).
  static_assert(sizeof(cuda::SampleRowParams) % sizeof(double) == 0);
  static_assert(sizeof(cuda::SampleRowResult) % sizeof(double) == 0);
  constexpr size_t kParamWords = sizeof(cuda::SampleRowParams) / sizeof(int32_t);
  constexpr size_t kResultWords = sizeof(cuda::SampleRowResult) / sizeof(int32_t);
  std::vector<int32_t> words(static_cast<size_t>(rows) * (kParamWords + kResultWords), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const cuda::SampleRowParams p{rules[r].temperature, rules[r].top_k, rules[r].top_p,
                                  rules[r].min_p,       uniforms[r],    draft_of(r)};
    std::memcpy(words.data() + r * kParamWords, &p, sizeof(p));
  }
  Enter();
  const int32_t* meta = Upload(words);
  if (meta == nullptr) return;  // out of memory: the step fails (Upload)
  int32_t* device_results = const_cast<int32_t*>(meta) + rows * kParamWords;
  cuda::LaunchSampleRows(logits.data<float>(), rows, vocab,
                         reinterpret_cast<const cuda::SampleRowParams*>(meta),
                         reinterpret_cast<cuda::SampleRowResult*>(device_results), stream_);
  std::vector<cuda::SampleRowResult> host(static_cast<size_t>(rows));
  CheckCuda(cudaMemcpyAsync(host.data(), device_results, host.size() * sizeof(host[0]),
                            cudaMemcpyDeviceToHost, stream_),
            "SampleRows results");
  CheckCuda(cudaStreamSynchronize(stream_), "SampleRows results");
  std::vector<int64_t> on_host;  // rows with more candidates than the kernel sorts
  for (int64_t r = 0; r < rows; ++r) {
    if (host[r].token >= 0) {
      out[r] = {host[r].token, host[r].logprob, host[r].draft_probability};
    } else {
      on_host.push_back(r);
    }
  }
  if (on_host.empty()) return;
  // Those rows are drawn on the host from copies of them alone, spread over threads as the
  // engine spreads the rows it draws itself (1-2 ms each).
  std::vector<float> copies(on_host.size() * static_cast<size_t>(vocab));
  const Tensor matrix = logits.Reshape({rows, vocab});
  for (size_t i = 0; i < on_host.size(); ++i) {
    CopyToHostF32(matrix.Rows(on_host[i], 1), copies.data() + i * vocab);
  }
  ForEachRangeInParallel(on_host.size(), 16, 1, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const int64_t r = on_host[i];
      out[r] = SampleRow(std::span<const float>(copies).subspan(i * vocab, vocab), rules[r],
                         draft_of(r), uniforms[r]);
    }
  });
}

void CudaBackend::RmsNorm1p(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  CheckTensor(x, DType::kBF16, "RmsNorm1p", "x");
  CheckTensor(out, DType::kBF16, "RmsNorm1p", "out");
  const AnyPtr wp = Any(w, "RmsNorm1p", "w");
  const int64_t d = w.numel();
  Check(d > 0 && x.numel() % d == 0 && out.numel() == x.numel(), "RmsNorm1p",
        absl::StrFormat("x %s, w %s, out %s", x.ShapeString(), w.ShapeString(), out.ShapeString()));
  Enter();
  cuda::LaunchRmsNorm1p(Bf16(x), wp, eps, x.numel() / d, d, MutBf16(out), stream_);
}

void CudaBackend::AddRmsNorm1p(Tensor& residual, const Tensor& delta, const Tensor& w, float eps,
                               Tensor& out) {
  CheckTensor(residual, DType::kBF16, "AddRmsNorm1p", "residual");
  CheckTensor(delta, DType::kBF16, "AddRmsNorm1p", "delta");
  CheckTensor(out, DType::kBF16, "AddRmsNorm1p", "out");
  const AnyPtr wp = Any(w, "AddRmsNorm1p", "w");
  const int64_t d = w.numel();
  Check(d > 0 && residual.numel() % d == 0 && delta.numel() == residual.numel() &&
            out.numel() == residual.numel(),
        "AddRmsNorm1p",
        absl::StrFormat("residual %s, delta %s, w %s, out %s", residual.ShapeString(),
                        delta.ShapeString(), w.ShapeString(), out.ShapeString()));
  Enter();
  cuda::LaunchAddRmsNorm1p(MutBf16(residual), Bf16(delta), wp, eps, residual.numel() / d, d,
                           MutBf16(out), stream_);
}

void CudaBackend::Add(Tensor& x, const Tensor& y) {
  CheckTensor(x, DType::kBF16, "Add", "x");
  CheckTensor(y, DType::kBF16, "Add", "y");
  Check(x.numel() == y.numel(), "Add",
        absl::StrFormat("x %s, y %s", x.ShapeString(), y.ShapeString()));
  Enter();
  cuda::LaunchAdd(MutBf16(x), Bf16(y), x.numel(), stream_);
}

void CudaBackend::SiluAndMul(const Tensor& gate_up, Tensor& out) {
  CheckTensor(gate_up, DType::kBF16, "SiluAndMul", "gate_up");
  CheckTensor(out, DType::kBF16, "SiluAndMul", "out");
  const int64_t two_i = gate_up.dim(-1);
  Check(two_i % 2 == 0 && out.numel() * 2 == gate_up.numel(), "SiluAndMul",
        absl::StrFormat("gate_up %s, out %s", gate_up.ShapeString(), out.ShapeString()));
  if (two_i == 0) return;
  Enter();
  cuda::LaunchSiluAndMul(Bf16(gate_up), gate_up.numel() / two_i, two_i / 2, MutBf16(out), stream_);
}

void CudaBackend::SiluMulLinear(const Tensor& gate_up, const Tensor& w, Tensor& act, Tensor& out) {
  CheckTensor(gate_up, DType::kBF16, "SiluMulLinear", "gate_up");
  // The projection's input is [T, K] with K = w's columns; gate_up is [T, 2K].
  Check(w.rank() == 2 && act.numel() * 2 == gate_up.numel(), "SiluMulLinear",
        absl::StrFormat("gate_up %s, act %s, w %s", gate_up.ShapeString(), act.ShapeString(),
                        w.ShapeString()));
  const LinearShape s = CheckLinear("SiluMulLinear", act, w, out);
  // Where Linear takes the skinny kernel (one row; two with MOBIUS_TC_GEMV=0 or >2) it forms
  // silu(gate) * up as it reads the row, one launch instead of two and the same bits as the
  // parts. Rows the tensor-core GEMV takes stay two ops: its silu-mul form measured 19.6 us
  // against ~5.7 us for the plain one at 4 rows (performance.md, eleventh version).
  if (s.m > 0 && s.n > 0 && !TcGemvFor(s.m) && s.n * s.k <= (int64_t{16} << 20) && !skinny_off_ &&
      cuda::SkinnyGemmSupports(s.m, s.k, gate_up.raw(), w.raw())) {
    Enter();
    const cuda::SkinnyTarget target{Bf16(w), s.n, AnyMutPtr{out.raw(), out.dtype() == DType::kF32}};
    cuda::LaunchSkinnyGemm(Bf16(gate_up), s.m, s.k, &target, 1, stream_, /*silu_mul=*/true);
    return;
  }
  Backend::SiluMulLinear(gate_up, w, act, out);
}

void CudaBackend::AddSigmoidScaled(Tensor& x, const Tensor& y, const Tensor& gate_logits) {
  CheckTensor(x, DType::kBF16, "AddSigmoidScaled", "x");
  CheckTensor(y, DType::kBF16, "AddSigmoidScaled", "y");
  const AnyPtr gp = Any(gate_logits, "AddSigmoidScaled", "gate_logits");
  const int64_t rows = gate_logits.numel();
  Check(x.numel() == y.numel() && (rows == 0 ? x.numel() == 0 : x.numel() % rows == 0),
        "AddSigmoidScaled",
        absl::StrFormat("x %s, y %s, gate_logits %s", x.ShapeString(), y.ShapeString(),
                        gate_logits.ShapeString()));
  if (rows == 0) return;
  Enter();
  cuda::LaunchAddSigmoidScaled(MutBf16(x), Bf16(y), gp, rows, x.numel() / rows, stream_);
}

// ---- gated DeltaNet ----

// Whether a segment writes its updated states to another slot than it reads (state_out_slot):
// the kernels for decode steps update in place only, so the host takes the multi-token forms then.
bool WritesStatesElsewhere(std::span<const SequenceSegment> segments) {
  return std::any_of(segments.begin(), segments.end(), [](const SequenceSegment& seg) {
    return WrittenStateSlot(seg) != seg.state_slot;
  });
}

void CudaBackend::CausalConv1dSilu(const Tensor& x, const Tensor& w, Tensor& conv_states,
                                   std::span<const SequenceSegment> segments, Tensor& out) {
  CheckTensor(x, DType::kBF16, "CausalConv1dSilu", "x");
  CheckTensor(out, DType::kBF16, "CausalConv1dSilu", "out");
  CheckTensor(conv_states, DType::kF32, "CausalConv1dSilu", "conv_states");
  const AnyPtr wp = Any(w, "CausalConv1dSilu", "w");
  Check(w.rank() >= 2, "CausalConv1dSilu", "w must be [C, K]");
  const int64_t channels = w.dim(0);
  const int kernel = static_cast<int>(w.numel() / std::max<int64_t>(channels, 1));
  Check(x.rank() == 2 && x.dim(1) == channels && out.numel() == x.numel() &&
            conv_states.rank() == 3 && conv_states.dim(1) == channels &&
            conv_states.dim(2) == kernel - 1,
        "CausalConv1dSilu",
        absl::StrFormat("x %s, w %s, conv_states %s, out %s", x.ShapeString(), w.ShapeString(),
                        conv_states.ShapeString(), out.ShapeString()));
  for (const SequenceSegment& seg : segments) {
    Check(seg.state_slot < conv_states.dim(0) && WrittenStateSlot(seg) < conv_states.dim(0),
          "CausalConv1dSilu",
          absl::StrFormat("state slot %d (out %d) >= %d slots", seg.state_slot,
                          WrittenStateSlot(seg), conv_states.dim(0)));
  }
  const int64_t t = x.dim(0);
  if (t == 0) return;
  Enter();
  const PackedSegments packed = PackSegments("CausalConv1dSilu", segments, t, false);
  cuda::TokenMeta tokens;
  cuda::SegmentMeta segs;
  if (!UploadSegments(packed, static_cast<int>(segments.size()), &tokens, &segs)) return;
  // The decode kernel updates the states in place (WritesStatesElsewhere).
  const bool single_token_segments =
      std::all_of(segments.begin(), segments.end(),
                  [](const SequenceSegment& seg) { return seg.num_tokens == 1; }) &&
      !WritesStatesElsewhere(segments);
  cuda::LaunchCausalConv1dSilu(Bf16(x), wp, conv_states.data<float>(), t, channels, kernel, tokens,
                               segs, single_token_segments, MutBf16(out), stream_);
}

void CudaBackend::DeltaRuleGates(const Tensor& a, const Tensor& b, const Tensor& a_log,
                                 const Tensor& dt_bias, Tensor& g, Tensor& beta) {
  CheckTensor(a, DType::kBF16, "DeltaRuleGates", "a");
  CheckTensor(b, DType::kBF16, "DeltaRuleGates", "b");
  CheckTensor(g, DType::kF32, "DeltaRuleGates", "g");
  CheckTensor(beta, DType::kF32, "DeltaRuleGates", "beta");
  const AnyPtr al = Any(a_log, "DeltaRuleGates", "a_log");
  const AnyPtr db = Any(dt_bias, "DeltaRuleGates", "dt_bias");
  const int64_t hv = a_log.numel();
  Check(hv > 0 && dt_bias.numel() == hv && a.numel() % hv == 0 && b.numel() == a.numel() &&
            g.numel() == a.numel() && beta.numel() == a.numel(),
        "DeltaRuleGates",
        absl::StrFormat("a %s, b %s, a_log %s, g %s", a.ShapeString(), b.ShapeString(),
                        a_log.ShapeString(), g.ShapeString()));
  Enter();
  cuda::LaunchDeltaRuleGates(Bf16(a), Bf16(b), al, db, a.numel() / hv, static_cast<int>(hv),
                             g.data<float>(), beta.data<float>(), stream_);
}

void CudaBackend::GatedDeltaRule(const Tensor& qkv, const Tensor& g, const Tensor& beta,
                                 const DeltaRuleDims& dims, Tensor& recurrent_states,
                                 std::span<const SequenceSegment> segments,
                                 DeltaRuleAlgorithm algorithm, Tensor& out) {
  // Without gate inputs the kernels only read g and beta.
  RunGatedDeltaRule(qkv, const_cast<Tensor&>(g), const_cast<Tensor&>(beta), nullptr, dims,
                    recurrent_states, segments, algorithm, out);
}

void CudaBackend::GatedDeltaRuleWithGates(const Tensor& qkv, const Tensor& a, const Tensor& b,
                                          const Tensor& a_log, const Tensor& dt_bias,
                                          const DeltaRuleDims& dims, Tensor& recurrent_states,
                                          std::span<const SequenceSegment> segments,
                                          DeltaRuleAlgorithm algorithm, Tensor& g, Tensor& beta,
                                          Tensor& out) {
  CheckTensor(a, DType::kBF16, "GatedDeltaRuleWithGates", "a");
  CheckTensor(b, DType::kBF16, "GatedDeltaRuleWithGates", "b");
  const AnyPtr al = Any(a_log, "GatedDeltaRuleWithGates", "a_log");
  const AnyPtr db = Any(dt_bias, "GatedDeltaRuleWithGates", "dt_bias");
  Check(a_log.numel() == dims.num_v_heads && dt_bias.numel() == dims.num_v_heads &&
            a.numel() == g.numel() && b.numel() == g.numel(),
        "GatedDeltaRuleWithGates",
        absl::StrFormat("a %s, b %s, a_log %s, dt_bias %s, g %s for Hv = %d", a.ShapeString(),
                        b.ShapeString(), a_log.ShapeString(), dt_bias.ShapeString(),
                        g.ShapeString(), dims.num_v_heads));
  const cuda::DeltaGateInputs gates{Bf16(a), Bf16(b), al, db};
  RunGatedDeltaRule(qkv, g, beta, &gates, dims, recurrent_states, segments, algorithm, out);
}

void CudaBackend::RunGatedDeltaRule(const Tensor& qkv, Tensor& g, Tensor& beta,
                                    const cuda::DeltaGateInputs* gates, const DeltaRuleDims& dims,
                                    Tensor& recurrent_states,
                                    std::span<const SequenceSegment> segments,
                                    DeltaRuleAlgorithm algorithm, Tensor& out) {
  CheckTensor(qkv, DType::kBF16, "GatedDeltaRule", "qkv");
  CheckTensor(g, DType::kF32, "GatedDeltaRule", "g");
  CheckTensor(beta, DType::kF32, "GatedDeltaRule", "beta");
  CheckTensor(out, DType::kBF16, "GatedDeltaRule", "out");
  CheckTensor(recurrent_states, DType::kF32, "GatedDeltaRule", "recurrent_states");
  const int hk = dims.num_k_heads, hv = dims.num_v_heads, dk = dims.k_head_dim,
            dv = dims.v_head_dim;
  Check(hk > 0 && hv > 0 && hv % hk == 0 && dk > 0 && dv > 0, "GatedDeltaRule",
        absl::StrFormat("bad dims Hk=%d Hv=%d Dk=%d Dv=%d", hk, hv, dk, dv));
  const int64_t row = 2LL * hk * dk + static_cast<int64_t>(hv) * dv;
  Check(qkv.rank() == 2 && qkv.dim(1) == row, "GatedDeltaRule",
        absl::StrFormat("qkv %s does not have rows of %d", qkv.ShapeString(), row));
  const int64_t t = qkv.dim(0);
  Check(g.numel() == t * hv && beta.numel() == t * hv && out.numel() == t * hv * dv &&
            recurrent_states.rank() == 4 && recurrent_states.dim(1) == hv &&
            recurrent_states.dim(2) == dk && recurrent_states.dim(3) == dv,
        "GatedDeltaRule",
        absl::StrFormat("g %s, beta %s, out %s, recurrent_states %s", g.ShapeString(),
                        beta.ShapeString(), out.ShapeString(), recurrent_states.ShapeString()));
  for (const SequenceSegment& seg : segments) {
    Check(
        seg.state_slot < recurrent_states.dim(0) && WrittenStateSlot(seg) < recurrent_states.dim(0),
        "GatedDeltaRule",
        absl::StrFormat("state slot %d (out %d) >= %d slots", seg.state_slot, WrittenStateSlot(seg),
                        recurrent_states.dim(0)));
  }
  if (t == 0) return;
  Enter();
  // kAuto: segments of at least kChunkedMinTokens tokens take the chunked (WY/UT) kernels and
  // shorter ones the recurrent kernel; dims the chunked kernels do not take (see
  // ChunkedDeltaRuleSupports) and misaligned views always run the recurrent one.
  constexpr int kChunkedMinTokens = 16;
  const bool chunk_ok = cuda::ChunkedDeltaRuleSupports(dk, dv) &&
                        reinterpret_cast<uintptr_t>(qkv.raw()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(out.raw()) % 16 == 0;
  int min_chunked = INT32_MAX;
  if (chunk_ok && algorithm == DeltaRuleAlgorithm::kChunked) min_chunked = 1;
  if (chunk_ok && algorithm == DeltaRuleAlgorithm::kAuto) min_chunked = kChunkedMinTokens;
  int64_t num_chunks = 0;
  int chunked_segments = 0;
  bool any_recurrent = false;
  for (const SequenceSegment& seg : segments) {
    if (seg.num_tokens >= min_chunked) {
      num_chunks += (seg.num_tokens + 63) / 64;
      ++chunked_segments;
    } else if (seg.num_tokens > 0) {
      any_recurrent = true;
    }
  }
  const bool moved = WritesStatesElsewhere(segments);
  if (moved && num_chunks > 0) {
    // The chunked kernels update in place: a chunked segment whose states go elsewhere has them
    // copied there first (verify steps of 16 or more tokens only, which are never recorded), and
    // the kernels run on its out slot. (Before the segments' upload, which shares its buffer.)
    std::vector<int32_t> from, to;
    for (const SequenceSegment& seg : segments) {
      if (seg.num_tokens >= min_chunked && WrittenStateSlot(seg) != seg.state_slot) {
        from.push_back(seg.state_slot);
        to.push_back(WrittenStateSlot(seg));
      }
    }
    Tensor rows = recurrent_states.Reshape(
        {recurrent_states.dim(0), recurrent_states.numel() / recurrent_states.dim(0)});
    Tensor* xs[] = {&rows};
    CopyRows(xs, from, to);
  }
  const PackedSegments packed = PackSegments("GatedDeltaRule", segments, t, false);
  cuda::TokenMeta tokens;
  cuda::SegmentMeta segs;
  if (!UploadSegments(packed, static_cast<int>(segments.size()), &tokens, &segs)) return;
  // Only the recurrent kernel computes gates itself: with chunked segments (whose kernels read
  // g and beta) or no recurrent one, the gates kernel runs first, for every token.
  if (gates != nullptr && (num_chunks > 0 || !any_recurrent)) {
    cuda::LaunchDeltaRuleGates(gates->a, gates->b, gates->a_log, gates->dt_bias, t, hv,
                               g.data<float>(), beta.data<float>(), stream_);
    gates = nullptr;
  }
  if (any_recurrent) {
    // Steps of one token a segment (decode) that update in place take the generic kernel's
    // in-place form, every other step its out-slot form, so that a recorded step of a given shape
    // (HybridModel records one-token steps only without out slots) always holds the same kernel.
    // (The warp kernel has one form for both.)
    const bool out_slots =
        moved || std::any_of(segments.begin(), segments.end(),
                             [](const SequenceSegment& seg) { return seg.num_tokens > 1; });
    cuda::LaunchGatedDeltaRuleRecurrent(Bf16(qkv), g.data<float>(), beta.data<float>(), gates, t,
                                        hk, hv, dk, dv, recurrent_states.data<float>(), segs,
                                        min_chunked - 1, out_slots, MutBf16(out), stream_);
  }
  if (num_chunks > 0) {
    void* scratch = Scratch(cuda::ChunkedDeltaRuleScratchBytes(num_chunks, hv, dk, dv));
    if (scratch == nullptr) return;  // out of memory: the step fails (Scratch)
    // The chunked kernels update in place: they run on the out slots, copied above.
    cuda::SegmentMeta chunk_segs = segs;
    if (moved) chunk_segs.state_slot = segs.state_out_slot;
    cuda::LaunchGatedDeltaRuleChunked(Bf16(qkv), g.data<float>(), beta.data<float>(), hk, hv, dk,
                                      dv, recurrent_states.data<float>(), chunk_segs, min_chunked,
                                      num_chunks, chunked_segments, scratch, MutBf16(out), stream_);
  }
}

void CudaBackend::GatedRmsNorm(const Tensor& x, const Tensor& z, const Tensor& w, float eps,
                               Tensor& out) {
  CheckTensor(x, DType::kBF16, "GatedRmsNorm", "x");
  CheckTensor(z, DType::kBF16, "GatedRmsNorm", "z");
  CheckTensor(out, DType::kBF16, "GatedRmsNorm", "out");
  const AnyPtr wp = Any(w, "GatedRmsNorm", "w");
  const int64_t d = w.numel();
  Check(d > 0 && x.numel() % d == 0 && z.numel() == x.numel() && out.numel() == x.numel(),
        "GatedRmsNorm",
        absl::StrFormat("x %s, z %s, w %s, out %s", x.ShapeString(), z.ShapeString(),
                        w.ShapeString(), out.ShapeString()));
  Enter();
  cuda::LaunchGatedRmsNorm(Bf16(x), Bf16(z), wp, eps, x.numel() / d, d, MutBf16(out), stream_);
}

// The batches (sequences in a decode step) that take the one-launch DeltaNet step by default,
// from engine A/B runs on the H200 at release shapes (docs/performance.md, eighteenth version):
// it saved 0.06-0.11 ms a step at batch 1-4, 0.1 at 128 and 0.49-0.59 at 256, was even at 8, and
// cost 0.04-0.08 ms at 16-64, where its clusters start later behind the in-projection than the
// separate kernels do (not diagnosed further).
bool UseDeltaNetDecodeStep(size_t num_segments) { return num_segments < 16 || num_segments >= 128; }

void CudaBackend::GatedDeltaNetMixer(const DeltaNetMixerOperands& op,
                                     std::span<const SequenceSegment> segments,
                                     DeltaRuleAlgorithm algorithm, Tensor& out) {
  // MOBIUS_DELTANET_STEP=0 runs decode and verify steps through the separate kernels (three for
  // a decode step, four for a verify step), =1 through the one-launch step at any batch (A/B
  // runs); by default the step takes the batches where it measured faster in the engine
  // (UseDeltaNetDecodeStep).
  static const int forced = cuda::KnobChoice("MOBIUS_DELTANET_STEP", {"0", "1"});
  const bool step_off = forced == 1 || (forced != 2 && !UseDeltaNetDecodeStep(segments.size()));
  const DeltaRuleDims& d = op.dims;
  const int64_t channels =
      2LL * d.num_k_heads * d.k_head_dim + static_cast<int64_t>(d.num_v_heads) * d.v_head_dim;
  const int64_t t = op.mixed.rank() == 2 ? op.mixed.dim(0) : -1;
  // Decode and speculative verify steps: every segment 1 to kMaxDeltaNetStepTokens tokens.
  int64_t step_tokens = 0;
  int max_tokens = 0;
  bool short_segments = !segments.empty();
  for (const SequenceSegment& s : segments) {
    step_tokens += s.num_tokens;
    max_tokens = std::max(max_tokens, s.num_tokens);
    short_segments =
        short_segments && s.num_tokens >= 1 && s.num_tokens <= cuda::kMaxDeltaNetStepTokens;
  }
  // kChunked asks for the chunked kernels even at one token (the parts honour it).
  if (step_off || !short_segments || algorithm == DeltaRuleAlgorithm::kChunked) {
    Backend::GatedDeltaNetMixer(op, segments, algorithm, out);
    return;
  }
  // The parts would abort on these with the same messages.
  CheckTensor(op.mixed, DType::kBF16, "GatedDeltaNetMixer", "mixed");
  CheckTensor(op.z, DType::kBF16, "GatedDeltaNetMixer", "z");
  CheckTensor(op.a, DType::kBF16, "GatedDeltaNetMixer", "a");
  CheckTensor(op.b, DType::kBF16, "GatedDeltaNetMixer", "b");
  CheckTensor(out, DType::kBF16, "GatedDeltaNetMixer", "out");
  CheckTensor(op.conv_states, DType::kF32, "GatedDeltaNetMixer", "conv_states");
  CheckTensor(op.recurrent_states, DType::kF32, "GatedDeltaNetMixer", "recurrent_states");
  CheckTensor(op.g, DType::kF32, "GatedDeltaNetMixer", "g");
  CheckTensor(op.beta, DType::kF32, "GatedDeltaNetMixer", "beta");
  const bool shapes =
      t == step_tokens && op.mixed.dim(1) == channels &&
      op.z.numel() == t * d.num_v_heads * d.v_head_dim && out.numel() == op.z.numel() &&
      op.a.numel() == t * d.num_v_heads && op.b.numel() == op.a.numel() &&
      op.g.numel() == op.a.numel() && op.beta.numel() == op.a.numel() &&
      op.a_log.numel() == d.num_v_heads && op.dt_bias.numel() == d.num_v_heads &&
      op.norm_w.numel() == d.v_head_dim && op.conv_w.rank() >= 2 && op.conv_w.dim(0) == channels &&
      op.conv_w.numel() == channels * 4 && op.conv_states.rank() == 3 &&
      op.conv_states.dim(1) == channels && op.conv_states.dim(2) == 3 &&
      op.recurrent_states.rank() == 4 && op.recurrent_states.dim(1) == d.num_v_heads &&
      op.recurrent_states.dim(2) == d.k_head_dim && op.recurrent_states.dim(3) == d.v_head_dim;
  // Where the scratch tensors are misaligned the parts take the generic delta rule kernel, whose
  // bits differ: run the parts then too.
  const bool scratch_aligned = reinterpret_cast<uintptr_t>(op.conv_out.raw()) % 8 == 0 &&
                               reinterpret_cast<uintptr_t>(op.core.raw()) % 8 == 0;
  if (!shapes || !scratch_aligned ||
      !cuda::DeltaNetDecodeStepSupports(d.num_k_heads, d.num_v_heads, d.k_head_dim, d.v_head_dim,
                                        static_cast<int>(op.conv_w.dim(op.conv_w.rank() - 1)),
                                        static_cast<int>(segments.size()), op.z.raw(), out.raw(),
                                        op.conv_w.raw(), op.norm_w.raw(), op.conv_states.raw(),
                                        op.recurrent_states.raw())) {
    Backend::GatedDeltaNetMixer(op, segments, algorithm, out);
    return;
  }
  for (const SequenceSegment& seg : segments) {
    const int64_t slots = std::min(op.conv_states.dim(0), op.recurrent_states.dim(0));
    Check(
        seg.state_slot < slots && WrittenStateSlot(seg) < slots, "GatedDeltaNetMixer",
        absl::StrFormat("state slot %d (out %d) >= %d conv / %d recurrent slots", seg.state_slot,
                        WrittenStateSlot(seg), op.conv_states.dim(0), op.recurrent_states.dim(0)));
  }
  cuda::DeltaNetDecodeStepArgs args;
  args.mixed = Bf16(op.mixed);
  args.z = Bf16(op.z);
  args.a = Bf16(op.a);
  args.b = Bf16(op.b);
  args.conv_w = Any(op.conv_w, "GatedDeltaNetMixer", "conv_w");
  args.a_log = Any(op.a_log, "GatedDeltaNetMixer", "a_log");
  args.dt_bias = Any(op.dt_bias, "GatedDeltaNetMixer", "dt_bias");
  args.norm_w = Any(op.norm_w, "GatedDeltaNetMixer", "norm_w");
  args.eps = op.eps;
  args.num_k_heads = d.num_k_heads;
  args.num_v_heads = d.num_v_heads;
  args.head_dim = d.k_head_dim;
  args.conv_states = op.conv_states.data<float>();
  args.states = op.recurrent_states.data<float>();
  args.g = op.g.data<float>();
  args.beta = op.beta.data<float>();
  args.out = MutBf16(out);
  Enter();
  const PackedSegments packed = PackSegments("GatedDeltaNetMixer", segments, t, false);
  cuda::TokenMeta tokens;
  cuda::SegmentMeta segs;
  if (!UploadSegments(packed, static_cast<int>(segments.size()), &tokens, &segs)) return;
  // Only the kernel for several tokens a segment writes states to out slots (it takes one-token
  // segments too).
  if (WritesStatesElsewhere(segments)) max_tokens = std::max(max_tokens, 2);
  cuda::LaunchDeltaNetDecodeStep(args, segs, max_tokens, stream_);
}

absl::Status CudaBackend::ReplayDeltaRuleStates(std::span<const DeltaRuleReplayLayer> layers,
                                                const DeltaRuleDims& dims,
                                                std::span<const SequenceSegment> segments) {
  RETURN_IF_ERROR(CheckDeltaRuleReplay(layers, dims, segments, activation_dtype()));
  if (layers.empty() || segments.empty()) return absl::OkStatus();
  // MOBIUS_DELTANET_REPLAY=0 replays through the separate kernels (Backend's default: ~5 launches
  // a layer), for A/B runs; the bits are the same.
  static const int forced = cuda::KnobChoice("MOBIUS_DELTANET_REPLAY", {"0", "1"});
  bool fused = forced != 1 && static_cast<int>(segments.size()) <= 65535;
  for (const SequenceSegment& seg : segments) {
    fused = fused && seg.num_tokens <= cuda::kMaxDeltaNetStepTokens;
  }
  const int conv_kernel = static_cast<int>(layers[0].conv_w->dim(layers[0].conv_w->rank() - 1));
  fused = fused && cuda::DeltaNetReplaySupports(dims.num_k_heads, dims.num_v_heads, dims.k_head_dim,
                                                dims.v_head_dim, conv_kernel,
                                                static_cast<int>(segments.size()));
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  for (const DeltaRuleReplayLayer& layer : layers) {
    fused = fused && layer.conv_states->dim(2) == conv_kernel - 1 && aligned(layer.conv_w->raw()) &&
            aligned(layer.conv_states->raw()) && aligned(layer.recurrent_states->raw());
  }
  if (!fused) return Backend::ReplayDeltaRuleStates(layers, dims, segments);
  // Only token_begin, num_tokens and state_slot are read (the kernel's segment metadata).
  const size_t n = segments.size();
  std::vector<int32_t> meta(3 * n);
  for (size_t i = 0; i < n; ++i) {
    meta[i] = segments[i].token_begin;
    meta[n + i] = segments[i].num_tokens;
    meta[2 * n + i] = segments[i].state_slot;
  }
  Enter();
  const int32_t* d = Upload(meta);
  if (d == nullptr) return TakeOpError();
  cuda::SegmentMeta segs;
  segs.num_segments = static_cast<int>(n);
  segs.token_begin = d;
  segs.num_tokens = d + n;
  segs.state_slot = d + 2 * n;
  for (size_t first = 0; first < layers.size(); first += cuda::kMaxReplayLayers) {
    cuda::DeltaNetReplayLayers table;
    table.count = static_cast<int>(std::min<size_t>(cuda::kMaxReplayLayers, layers.size() - first));
    for (int l = 0; l < table.count; ++l) {
      const DeltaRuleReplayLayer& layer = layers[first + l];
      table.layer[l] = {Bf16(*layer.mixed),
                        layer.g->data<float>(),
                        layer.beta->data<float>(),
                        Any(*layer.conv_w, "ReplayDeltaRuleStates", "conv_w"),
                        layer.conv_states->data<float>(),
                        layer.recurrent_states->data<float>()};
    }
    cuda::LaunchDeltaNetReplay(table, dims.num_k_heads, dims.num_v_heads, dims.k_head_dim, segs,
                               stream_);
  }
  return absl::OkStatus();
}

// ---- gated attention ----

void CudaBackend::QkNormRope(const Tensor& q_gate, Tensor& k, const Tensor& q_norm,
                             const Tensor& k_norm, float eps, const RopeParams& rope,
                             std::span<const SequenceSegment> segments, Tensor& q, Tensor& gate) {
  QkNormRopeThenWrite("QkNormRope", q_gate, k, q_norm, k_norm, eps, rope, segments, q, gate,
                      nullptr);
}

void CudaBackend::QkNormRopeWriteKv(const Tensor& q_gate, Tensor& k, const Tensor& v,
                                    const Tensor& q_norm, const Tensor& k_norm, float eps,
                                    const RopeParams& rope,
                                    std::span<const SequenceSegment> segments, Tensor& q,
                                    Tensor& gate, Tensor& k_cache, Tensor& v_cache) {
  const KvWriteTarget kv{v, k_cache, v_cache};
  QkNormRopeThenWrite("QkNormRopeWriteKv", q_gate, k, q_norm, k_norm, eps, rope, segments, q, gate,
                      &kv);
}

void CudaBackend::QkNormRopeThenWrite(const char* op, const Tensor& q_gate, Tensor& k,
                                      const Tensor& q_norm, const Tensor& k_norm, float eps,
                                      const RopeParams& rope,
                                      std::span<const SequenceSegment> segments, Tensor& q,
                                      Tensor& gate, const KvWriteTarget* kv) {
  CheckTensor(q_gate, DType::kBF16, op, "q_gate");
  CheckTensor(k, DType::kBF16, op, "k");
  CheckTensor(q, DType::kBF16, op, "q");
  CheckTensor(gate, DType::kBF16, op, "gate");
  const AnyPtr qn = Any(q_norm, op, "q_norm");
  const AnyPtr kn = Any(k_norm, op, "k_norm");
  Check(q.rank() == 3 && k.rank() == 3, op, "q and k must be [T, heads, hd]");
  const int64_t t = q.dim(0);
  const int nh = static_cast<int>(q.dim(1)), nkv = static_cast<int>(k.dim(1)),
            hd = static_cast<int>(q.dim(2));
  Check(q_gate.numel() == t * nh * 2 * hd && gate.numel() == q.numel() && k.dim(0) == t &&
            k.dim(2) == hd && q_norm.numel() == hd && k_norm.numel() == hd &&
            rope.rotary_dim >= 0 && rope.rotary_dim <= hd && rope.rotary_dim % 2 == 0,
        op,
        absl::StrFormat("q_gate %s, k %s, q %s, gate %s, rotary_dim %d", q_gate.ShapeString(),
                        k.ShapeString(), q.ShapeString(), gate.ShapeString(), rope.rotary_dim));
  if (kv != nullptr) {
    Check(CheckKvWrite(op, k, kv->v, segments, kv->k_cache, kv->v_cache) == t, op,
          absl::StrFormat("k %s holds %d tokens, q %s", k.ShapeString(), t, q.ShapeString()));
  }
  if (t == 0) return;
  Enter();
  const PackedSegments packed = PackSegments(op, segments, t, kv != nullptr);
  cuda::TokenMeta tokens;
  cuda::SegmentMeta segs;
  if (!UploadSegments(packed, static_cast<int>(segments.size()), &tokens, &segs)) return;
  cuda::KvCacheWrite write;
  if (kv != nullptr) {
    write.v = Bf16(kv->v);
    write.k_cache = MutBf16(kv->k_cache);
    write.v_cache = MutBf16(kv->v_cache);
    write.block_size = static_cast<int>(kv->k_cache.dim(1));
    write.token_segment = tokens.token_segment;
    write.segs = segs;
  }
  const bool written = cuda::LaunchQkNormRope(
      Bf16(q_gate), MutBf16(k), qn, kn, eps, rope.rotary_dim, rope.theta, t, nh, nkv, hd,
      tokens.token_position, MutBf16(q), MutBf16(gate), stream_, kv != nullptr ? &write : nullptr);
  if (kv != nullptr && !written) {
    cuda::LaunchWriteKvCache(Bf16(k), write.v, tokens, segs, write.block_size, t, int64_t{nkv} * hd,
                             write.k_cache, write.v_cache, stream_);
  }
}

void CudaBackend::WriteKvCache(const Tensor& k, const Tensor& v,
                               std::span<const SequenceSegment> segments, Tensor& k_cache,
                               Tensor& v_cache) {
  const int64_t t = CheckKvWrite("WriteKvCache", k, v, segments, k_cache, v_cache);
  if (t == 0) return;
  Enter();
  const PackedSegments packed = PackSegments("WriteKvCache", segments, t, true);
  cuda::TokenMeta tokens;
  cuda::SegmentMeta segs;
  if (!UploadSegments(packed, static_cast<int>(segments.size()), &tokens, &segs)) return;
  cuda::LaunchWriteKvCache(Bf16(k), Bf16(v), tokens, segs, static_cast<int>(k_cache.dim(1)), t,
                           k_cache.dim(2) * k_cache.dim(3), MutBf16(k_cache), MutBf16(v_cache),
                           stream_);
}

int64_t CudaBackend::CheckKvWrite(const char* op, const Tensor& k, const Tensor& v,
                                  std::span<const SequenceSegment> segments, const Tensor& k_cache,
                                  const Tensor& v_cache) {
  CheckTensor(k, DType::kBF16, op, "k");
  CheckTensor(v, DType::kBF16, op, "v");
  CheckTensor(k_cache, DType::kBF16, op, "k_cache");
  CheckTensor(v_cache, DType::kBF16, op, "v_cache");
  Check(k_cache.rank() == 4 && v_cache.shape() == k_cache.shape() && k.numel() == v.numel(), op,
        absl::StrFormat("k %s, v %s, k_cache %s, v_cache %s", k.ShapeString(), v.ShapeString(),
                        k_cache.ShapeString(), v_cache.ShapeString()));
  const int64_t num_blocks = k_cache.dim(0), block_size = k_cache.dim(1);
  const int64_t row = k_cache.dim(2) * k_cache.dim(3);
  Check(row > 0 && k.numel() % row == 0, op,
        absl::StrFormat("k %s does not match cache rows of %d", k.ShapeString(), row));
  const int64_t t = k.numel() / row;
  int64_t covered = 0;
  for (const SequenceSegment& seg : segments) {
    Check(seg.token_begin == covered && seg.token_begin + seg.num_tokens <= t, op,
          absl::StrFormat("segment at token %d does not continue at %d", seg.token_begin, covered));
    for (int32_t i = 0; i < seg.num_tokens; ++i) {
      const int64_t pos = seg.cached_tokens + i;
      const int64_t b = pos / block_size;
      Check(b < static_cast<int64_t>(seg.kv_blocks.size()), op,
            absl::StrFormat("position %d needs block %d but the table has %d", pos, b,
                            seg.kv_blocks.size()));
      const int32_t block = seg.kv_blocks[b];
      Check(block >= 0 && block < num_blocks, op,
            absl::StrFormat("block %d outside [0, %d)", block, num_blocks));
    }
    covered += seg.num_tokens;
  }
  Check(covered == t, op, absl::StrFormat("segments cover %d of %d tokens", covered, t));
  return t;
}

void CudaBackend::PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                 std::span<const SequenceSegment> segments, float scale,
                                 Tensor& out) {
  PagedAttentionGated("PagedAttention", q, nullptr, k_cache, v_cache, segments, scale, out);
}

void CudaBackend::GatedPagedAttention(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                                      const Tensor& v_cache,
                                      std::span<const SequenceSegment> segments, float scale,
                                      Tensor& out) {
  PagedAttentionGated("GatedPagedAttention", q, &gate, k_cache, v_cache, segments, scale, out);
}

void CudaBackend::PagedAttentionGated(const char* op, const Tensor& q, const Tensor* gate,
                                      const Tensor& k_cache, const Tensor& v_cache,
                                      std::span<const SequenceSegment> segments, float scale,
                                      Tensor& out) {
  CheckTensor(q, DType::kBF16, op, "q");
  CheckTensor(k_cache, DType::kBF16, op, "k_cache");
  CheckTensor(v_cache, DType::kBF16, op, "v_cache");
  CheckTensor(out, DType::kBF16, op, "out");
  Check(q.rank() == 3 && k_cache.rank() == 4 && v_cache.shape() == k_cache.shape() &&
            out.numel() == q.numel() && k_cache.dim(3) == q.dim(2) &&
            q.dim(1) % k_cache.dim(2) == 0,
        op,
        absl::StrFormat("q %s, k_cache %s, v_cache %s, out %s", q.ShapeString(),
                        k_cache.ShapeString(), v_cache.ShapeString(), out.ShapeString()));
  if (gate != nullptr) {
    CheckTensor(*gate, DType::kBF16, op, "gate");
    Check(gate->numel() == out.numel(), op,
          absl::StrFormat("gate %s, out %s", gate->ShapeString(), out.ShapeString()));
  }
  const int64_t t = q.dim(0);
  const int block_size = static_cast<int>(k_cache.dim(1));
  for (const SequenceSegment& seg : segments) {
    const int64_t needed =
        (int64_t{seg.cached_tokens} + seg.num_tokens + block_size - 1) / block_size;
    Check(static_cast<int64_t>(seg.kv_blocks.size()) >= needed, op,
          absl::StrFormat("segment at token %d needs %d kv blocks, has %d", seg.token_begin, needed,
                          seg.kv_blocks.size()));
    for (int64_t b = 0; b < needed; ++b) {
      Check(seg.kv_blocks[b] >= 0 && seg.kv_blocks[b] < k_cache.dim(0), op,
            absl::StrFormat("block %d outside [0, %d)", seg.kv_blocks[b], k_cache.dim(0)));
    }
  }
  if (t == 0) return;
  Enter();
  int max_positions = 0;
  for (const SequenceSegment& seg : segments) {
    max_positions = std::max(max_positions, seg.cached_tokens + seg.num_tokens);
  }
  const PackedSegments packed = PackSegments(op, segments, t, true);
  // A recorded step is replayed at longer contexts: split for the longest it will see. A staged
  // step of a shape the model records (every sequence the same 1..8 tokens: decode, speculative
  // verify) splits the same way when it runs op by op, so that it and its recording compute the
  // same sums: the tensor-core kernel rounds P to bf16 against each split's running max, so its
  // output moves by ~1 bf16 ulp with the number of splits.
  const int32_t m = segments.empty() ? 0 : segments[0].num_tokens;
  const bool recordable_shape =
      m <= 8 && std::all_of(segments.begin(), segments.end(),
                            [m](const SequenceSegment& s) { return s.num_tokens == m; });
  if (capturing_ || (packed.staged && recordable_shape)) {
    max_positions = std::max(max_positions, staged_.max_positions);
  }
  const int nh = static_cast<int>(q.dim(1)), nkv = static_cast<int>(k_cache.dim(2)),
            hd = static_cast<int>(q.dim(2));
  const int splits = cuda::PagedAttentionSplits(t, static_cast<int>(segments.size()), nh, nkv, hd,
                                                max_positions, num_sms_);
  void* scratch =
      splits > 1 ? Scratch(cuda::PagedAttentionScratchBytes(t, nh, hd, splits)) : nullptr;
  if (splits > 1 && scratch == nullptr) return;  // out of memory: the step fails (Scratch)
  cuda::TokenMeta tokens;
  cuda::SegmentMeta segs;
  if (!UploadSegments(packed, static_cast<int>(segments.size()), &tokens, &segs)) return;
  const bool gated =
      cuda::LaunchPagedAttention(Bf16(q), Bf16(k_cache), Bf16(v_cache), k_cache.dim(0), t, nh, nkv,
                                 hd, block_size, tokens, segs, scale, splits, num_sms_, scratch,
                                 MutBf16(out), stream_, gate != nullptr ? Bf16(*gate) : nullptr);
  if (gate != nullptr && !gated) {
    cuda::LaunchMulSigmoid(MutBf16(out), Bf16(*gate), out.numel(), stream_);
  }
}

void CudaBackend::MulSigmoid(Tensor& x, const Tensor& gate) {
  CheckTensor(x, DType::kBF16, "MulSigmoid", "x");
  CheckTensor(gate, DType::kBF16, "MulSigmoid", "gate");
  Check(x.numel() == gate.numel(), "MulSigmoid",
        absl::StrFormat("x %s, gate %s", x.ShapeString(), gate.ShapeString()));
  Enter();
  cuda::LaunchMulSigmoid(MutBf16(x), Bf16(gate), x.numel(), stream_);
}

// ---- mixture of experts ----

AnyPtr CudaBackend::CheckTopK(const Tensor& logits, int k, const Tensor& ids,
                              const Tensor& weights) {
  const AnyPtr lp = Any(logits, "TopKSoftmax", "logits");
  CheckTensor(ids, DType::kI32, "TopKSoftmax", "ids");
  CheckTensor(weights, DType::kF32, "TopKSoftmax", "weights");
  Check(logits.rank() == 2, "TopKSoftmax", "logits must be [T, E]");
  const int64_t t = logits.dim(0), e = logits.dim(1);
  Check(k > 0 && k <= e && ids.numel() == t * k && weights.numel() == t * k, "TopKSoftmax",
        absl::StrFormat("logits %s, k %d, ids %s, weights %s", logits.ShapeString(), k,
                        ids.ShapeString(), weights.ShapeString()));
  return lp;
}

void CudaBackend::TopKSoftmax(const Tensor& logits, int k, bool renormalize, Tensor& ids,
                              Tensor& weights) {
  const AnyPtr lp = CheckTopK(logits, k, ids, weights);
  Enter();
  cuda::LaunchTopKSoftmax(lp, logits.dim(0), static_cast<int>(logits.dim(1)), k, renormalize,
                          ids.data<int32_t>(), weights.data<float>(), stream_);
}

int64_t CudaBackend::CheckMoe(const Tensor& x, const Tensor& ids, const Tensor& weights,
                              const Tensor& gate_up, const Tensor& down, const Tensor& out,
                              std::span<const int64_t> expert_tokens) {
  CheckTensor(x, DType::kBF16, "MoeExperts", "x");
  CheckTensor(ids, DType::kI32, "MoeExperts", "ids");
  CheckTensor(weights, DType::kF32, "MoeExperts", "weights");
  CheckTensor(gate_up, DType::kBF16, "MoeExperts", "gate_up");
  CheckTensor(down, DType::kBF16, "MoeExperts", "down");
  CheckTensor(out, DType::kBF16, "MoeExperts", "out");
  Check(gate_up.rank() == 3 && down.rank() == 3 && gate_up.dim(1) % 2 == 0, "MoeExperts",
        "gate_up must be [E, 2I, H] and down [E, H, I]");
  const int64_t experts = gate_up.dim(0), inter = gate_up.dim(1) / 2, hidden = gate_up.dim(2);
  Check(down.dim(0) == experts && down.dim(1) == hidden && down.dim(2) == inter &&
            x.numel() % std::max<int64_t>(hidden, 1) == 0 && out.numel() == x.numel(),
        "MoeExperts",
        absl::StrFormat("x %s, gate_up %s, down %s, out %s", x.ShapeString(), gate_up.ShapeString(),
                        down.ShapeString(), out.ShapeString()));
  const int64_t t = hidden == 0 ? 0 : x.numel() / hidden;
  Check(ids.rank() == 2 && ids.dim(0) == t && weights.numel() == ids.numel(), "MoeExperts",
        absl::StrFormat("ids %s, weights %s for %d tokens", ids.ShapeString(),
                        weights.ShapeString(), t));
  Check(
      expert_tokens.empty() || static_cast<int64_t>(expert_tokens.size()) == experts, "MoeExperts",
      absl::StrFormat("expert_tokens has %d entries, expected %d", expert_tokens.size(), experts));
  Check(expert_tokens.empty() || !capturing_, "MoeExperts",
        "expert_tokens reads counts back to the host; it cannot be recorded in a step capture");
  return t;
}

void CudaBackend::MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                             const Tensor& gate_up, const Tensor& down, int first_expert,
                             Tensor& out, std::span<int64_t> expert_tokens) {
  const int64_t t = CheckMoe(x, ids, weights, gate_up, down, out, expert_tokens);
  if (t == 0 || ids.dim(1) == 0 || gate_up.dim(0) == 0) return;
  Enter();
  if (expert_tokens.empty() &&
      TryMoeFewTokens(x, ids, weights, gate_up, down, first_expert, nullptr, out)) {
    return;
  }
  RunMoeExperts(x, ids, weights, gate_up, down, first_expert, nullptr, out, expert_tokens);
}

void CudaBackend::RunMoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                const Tensor& gate_up, const Tensor& down, int first_expert,
                                const cuda::MoeSharedTerm* shared, Tensor& out,
                                std::span<int64_t> expert_tokens) {
  const int64_t t = ids.dim(0), inter = gate_up.dim(1) / 2, hidden = gate_up.dim(2);
  const int k = static_cast<int>(ids.dim(1)), num_local = static_cast<int>(gate_up.dim(0));
  void* scratch = Scratch(cuda::MoeScratchBytes(t, k, num_local, hidden, inter));
  if (scratch == nullptr) return;  // out of memory: the step fails (Scratch)
  const int32_t* counts = cuda::LaunchMoeExperts(
      Bf16(x), ids.data<int32_t>(), weights.data<float>(), Bf16(gate_up), Bf16(down), t, k,
      num_local, first_expert, hidden, inter, scratch, shared, MutBf16(out), stream_);
  if (!expert_tokens.empty()) {
    std::vector<int32_t> host(static_cast<size_t>(num_local));
    CheckCuda(cudaMemcpyAsync(host.data(), counts, host.size() * sizeof(int32_t),
                              cudaMemcpyDeviceToHost, stream_),
              "MoeExperts counts");
    CheckCuda(cudaStreamSynchronize(stream_), "MoeExperts counts");
    for (int e = 0; e < num_local; ++e) expert_tokens[e] += host[e];
  }
}

bool CudaBackend::TryMoeFewTokens(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                  const Tensor& gate_up, const Tensor& down, int first_expert,
                                  const cuda::MoeSharedTerm* shared, Tensor& out) {
  const int64_t t = ids.dim(0), inter = gate_up.dim(1) / 2;
  const int k = static_cast<int>(ids.dim(1));
  if (t * k > cuda::MoeFewTokensMaxPairs(gate_up.dim(0))) return false;
  auto* act = static_cast<uint16_t*>(
      Scratch(sizeof(uint16_t) * cuda::MoeFewTokensScratchElems(t, k, gate_up.dim(2), inter)));
  if (act == nullptr) return true;  // out of memory: the step fails (Scratch)
  return cuda::LaunchMoeExpertsFewTokens(Bf16(x), ids.data<int32_t>(), weights.data<float>(),
                                         Bf16(gate_up), Bf16(down), t, k,
                                         static_cast<int>(gate_up.dim(0)), first_expert,
                                         gate_up.dim(2), inter, act, MutBf16(out), shared, stream_);
}

void CudaBackend::MapExpertIds(const Tensor& ids, const Tensor& routes, int stride, Tensor& out) {
  CheckTensor(ids, DType::kI32, "MapExpertIds", "ids");
  CheckTensor(routes, DType::kI32, "MapExpertIds", "routes");
  CheckTensor(out, DType::kI32, "MapExpertIds", "out");
  Check(stride > 0 && routes.numel() % stride == 0 && out.numel() == ids.numel() && ids.rank() == 2,
        "MapExpertIds",
        absl::StrFormat("ids %s, routes %s (stride %d), out %s", ids.ShapeString(),
                        routes.ShapeString(), stride, out.ShapeString()));
  if (ids.numel() == 0) return;
  Enter();
  cuda::LaunchMapExpertIds(ids.data<int32_t>(), routes.data<int32_t>(), stride,
                           routes.numel() / stride, ids.numel(), static_cast<int>(ids.dim(1)),
                           out.data<int32_t>(), stream_);
}

void CudaBackend::MoeExpertsWithShared(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                       const Tensor& gate_up, const Tensor& down, int first_expert,
                                       const Tensor& shared, const Tensor& shared_gate, Tensor& out,
                                       std::span<int64_t> expert_tokens) {
  const int64_t t = CheckMoe(x, ids, weights, gate_up, down, out, expert_tokens);
  CheckTensor(shared, DType::kBF16, "MoeExpertsWithShared", "shared");
  const AnyPtr gp = Any(shared_gate, "MoeExpertsWithShared", "shared_gate");
  Check(shared.numel() == out.numel() && shared_gate.numel() == t, "MoeExpertsWithShared",
        absl::StrFormat("shared %s, shared_gate %s for out %s", shared.ShapeString(),
                        shared_gate.ShapeString(), out.ShapeString()));
  // Few tokens: the down kernel completes each output row in one block, so it writes
  // routed sum + gated shared expert directly (no zero fill, no separate add).
  const cuda::MoeSharedTerm term{Bf16(shared), gp};
  if (t > 0 && ids.dim(1) > 0 && gate_up.dim(0) > 0 && expert_tokens.empty()) {
    Enter();
    if (TryMoeFewTokens(x, ids, weights, gate_up, down, first_expert, &term, out)) return;
  }
  // More tokens: the combine kernel writes routed sum + gated shared expert (no zero fill, no
  // separate add). Without local experts (expert parallelism) nothing combines: the default.
  if (t > 0 && ids.dim(1) > 0 && gate_up.dim(0) > 0) {
    Enter();
    RunMoeExperts(x, ids, weights, gate_up, down, first_expert, &term, out, expert_tokens);
    return;
  }
  Backend::MoeExpertsWithShared(x, ids, weights, gate_up, down, first_expert, shared, shared_gate,
                                out, expert_tokens);
}

AnyPtr CudaBackend::CheckSharedExpert(const SharedExpertOperands& shared, int64_t t, int64_t hidden,
                                      const Tensor& out, const char* op) {
  CheckTensor(shared.gate_up, DType::kBF16, op, "shared.gate_up");
  CheckTensor(shared.down, DType::kBF16, op, "shared.down");
  const AnyPtr gp = Any(shared.gate_logits, op, "shared.gate_logits");
  Check(shared.down.rank() == 2 && shared.down.dim(0) == hidden &&
            shared.gate_up.numel() == t * 2 * shared.down.dim(1) && shared.gate_logits.numel() == t,
        op,
        absl::StrFormat("shared gate_up %s, down %s, gate_logits %s for out %s",
                        shared.gate_up.ShapeString(), shared.down.ShapeString(),
                        shared.gate_logits.ShapeString(), out.ShapeString()));
  return gp;
}

void CudaBackend::MoeExpertsWithSharedExpert(const Tensor& x, const Tensor& ids,
                                             const Tensor& weights, const Tensor& gate_up,
                                             const Tensor& down, int first_expert,
                                             const SharedExpertOperands& shared, Tensor& out,
                                             std::span<int64_t> expert_tokens) {
  const int64_t t = CheckMoe(x, ids, weights, gate_up, down, out, expert_tokens);
  // (CheckMoe checked x, out and the weights against the hidden size.)
  const AnyPtr gp = CheckSharedExpert(shared, t, gate_up.dim(2), out, "MoeExpertsWithSharedExpert");
  // Few tokens: the few-token kernels compute the shared expert's rows, so that projection is
  // not a launch of its own (SharedExpertInGateUp, MoeFewDownRowsKernel).
  const cuda::MoeSharedTerm term{nullptr,
                                 gp,
                                 Bf16(shared.gate_up),
                                 Bf16(shared.down),
                                 shared.down.dim(1),
                                 SharedExpertFusedMaxTokens()};
  if (t > 0 && ids.dim(1) > 0 && gate_up.dim(0) > 0 && expert_tokens.empty()) {
    Enter();
    if (TryMoeFewTokens(x, ids, weights, gate_up, down, first_expert, &term, out)) return;
  }
  Backend::MoeExpertsWithSharedExpert(x, ids, weights, gate_up, down, first_expert, shared, out,
                                      expert_tokens);
}

void CudaBackend::RoutedMoeWithSharedExpert(const Tensor& x, const Tensor& router_logits, int k,
                                            bool renormalize, Tensor& ids, Tensor& weights,
                                            const Tensor& gate_up, const Tensor& down,
                                            int first_expert, const SharedExpertOperands& shared,
                                            Tensor& out, std::span<int64_t> expert_tokens) {
  // At 4-8 tokens the shared expert's down projection runs in extra blocks of the top-k's grid,
  // instead of in the gate-up kernel's first wave (up to 5 tokens) or a SiLU and a projection
  // launch of its own (performance.md, twenty-sixth version). MOBIUS_MOE_SHARED_BESIDE_TOPK
  // (A/B runs): auto; on: at 1-8 tokens; off: never. (KnobChoice: 0 unset, 1 auto, 2 on, 3 off.)
  static const int form = cuda::KnobChoice("MOBIUS_MOE_SHARED_BESIDE_TOPK", {"auto", "on", "off"});
  const int64_t t = router_logits.rank() == 2 ? router_logits.dim(0) : 0;
  const int64_t first = form == 2   ? 1
                        : form == 3 ? cuda::kMoeSharedBesideTopKMaxTokens + 1  // off: none
                                    : cuda::kMoeSharedBesideTopKMinTokens;
  if (t >= first && t <= cuda::kMoeSharedBesideTopKMaxTokens && expert_tokens.empty() &&
      gate_up.rank() == 3 && gate_up.dim(0) > 0 &&
      t * k <= cuda::MoeFewTokensMaxPairs(gate_up.dim(0))) {
    // What the top-k's grid reads and writes; MoeExpertsWithShared checks the rest.
    const AnyPtr lp = CheckTopK(router_logits, k, ids, weights);
    const int64_t hidden = gate_up.dim(2);
    const AnyPtr gp = CheckSharedExpert(shared, t, hidden, out, "RoutedMoeWithSharedExpert");
    CheckTensor(shared.out, DType::kBF16, "RoutedMoeWithSharedExpert", "shared.out");
    Check(shared.out.numel() == t * hidden, "RoutedMoeWithSharedExpert",
          absl::StrFormat("shared.out %s for out %s", shared.out.ShapeString(), out.ShapeString()));
    const cuda::MoeSharedTerm term{nullptr, gp, Bf16(shared.gate_up), Bf16(shared.down),
                                   shared.down.dim(1)};
    Enter();
    if (cuda::LaunchTopKSoftmaxWithSharedRows(
            lp, t, static_cast<int>(router_logits.dim(1)), k, renormalize, ids.data<int32_t>(),
            weights.data<float>(), term, hidden, MutBf16(shared.out), stream_)) {
      MoeExpertsWithShared(x, ids, weights, gate_up, down, first_expert, shared.out,
                           shared.gate_logits, out, expert_tokens);
      return;
    }
  }
  Backend::RoutedMoeWithSharedExpert(x, router_logits, k, renormalize, ids, weights, gate_up, down,
                                     first_expert, shared, out, expert_tokens);
}

}  // namespace

absl::Status CheckCudaModelOpShapes(const ModelOpShapes& shapes) {
  auto too_large = [](const char* field, int value, int limit, const char* which) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s = %d is not supported by the CUDA backend: its %s take at most %d",
                        field, value, which, limit));
  };
  if (shapes.head_dim > cuda::kMaxAttentionHeadDim) {
    return too_large("head_dim", shapes.head_dim, cuda::kMaxAttentionHeadDim,
                     "paged-attention kernels");
  }
  if (shapes.linear_key_head_dim > cuda::kMaxDeltaRuleKeyHeadDim) {
    return too_large("linear_key_head_dim", shapes.linear_key_head_dim,
                     cuda::kMaxDeltaRuleKeyHeadDim, "gated delta rule kernels");
  }
  if (shapes.linear_conv_kernel_dim > cuda::kMaxConvKernel) {
    return too_large("linear_conv_kernel_dim", shapes.linear_conv_kernel_dim, cuda::kMaxConvKernel,
                     "causal conv kernels");
  }
  return absl::OkStatus();
}

CUstream_st* CudaBackendStream(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  return cuda == nullptr ? nullptr : cuda->stream();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_ordinal) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || device_ordinal < 0 || device_ordinal >= count) {
    cudaGetLastError();
    return absl::NotFoundError(absl::StrFormat(
        "no CUDA device %d (%d found%s%s)", device_ordinal, err == cudaSuccess ? count : 0,
        err == cudaSuccess ? "" : ": ", err == cudaSuccess ? "" : cudaGetErrorString(err)));
  }
  err = cudaSetDevice(device_ordinal);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrFormat("cudaSetDevice(%d): %s", device_ordinal, cudaGetErrorString(err)));
  }
  cudaDeviceProp prop{};
  err = cudaGetDeviceProperties(&prop, device_ordinal);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrFormat("cudaGetDeviceProperties(%d): %s", device_ordinal,
                                               cudaGetErrorString(err)));
  }
  if (prop.major < 9) {
    return absl::FailedPreconditionError(
        absl::StrFormat("cuda:%d (%s) has compute capability %d.%d; this build targets sm_90a",
                        device_ordinal, prop.name, prop.major, prop.minor));
  }
  cudaStream_t stream = nullptr;
  err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrFormat("cudaStreamCreate: %s", cudaGetErrorString(err)));
  }
  auto gemm = cuda::LtGemm::Create();
  if (!gemm.ok()) {
    cudaStreamDestroy(stream);
    return gemm.status();
  }
  return std::unique_ptr<Backend>(new CudaBackend(device_ordinal, stream, *std::move(gemm),
                                                  prop.name, prop.multiProcessorCount));
}

}  // namespace mobius::kernels
