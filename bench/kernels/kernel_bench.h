// mobius_kernel_bench's shared parts: its options, the release (and smoke) shapes, a prepared
// case and its timed result, and the Bench that builds the cases (kernel_bench_cases.cc) and
// times them (kernel_bench.cc, which also says how the timing works).
#ifndef MOBIUS_BENCH_KERNELS_KERNEL_BENCH_H_
#define MOBIUS_BENCH_KERNELS_KERNEL_BENCH_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/kernels/bench_device.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"

namespace mobius::bench {

using kernels::Backend;
using kernels::DeltaRuleAlgorithm;
using kernels::DeltaRuleDims;
using kernels::DType;
using kernels::RopeParams;
using kernels::SequenceSegment;
using kernels::Tensor;

// Prints "mobius_kernel_bench: msg" and exits 1.
[[noreturn]] void Die(const std::string& msg);
// Dies naming `what` unless err is cudaSuccess.
void CheckCuda(cudaError_t err, const char* what);

// ---- options -----------------------------------------------------------------------------------
struct Options {
  std::string filter = ".*";
  std::string json;
  std::string device = "cuda";
  std::string note;
  int iters = 100;
  double max_case_ms = 1500;  // measuring budget per case (iterations shrink to fit, >= 5)
  double bandwidth = 0;       // bytes/s; 0 = measure
  double matrix_rate = 0;     // FLOP/s; 0 = measure
  bool list = false;
  bool smoke = false;
  bool unstaged = false;  // segment ops: time only without staging (no StageStep)
  bool no_graph = false;  // staged ops: skip the recorded (CUDA graph) timing
  // --chain: each entry names cases recorded one after another, round after round, in one graph.
  std::vector<std::vector<std::string>> chains;
};

// ---- shapes ------------------------------------------------------------------------------------
// Release shapes (../shared/configs/intern-s2-mobius-35b/config.json); --smoke shrinks them.
struct Dims {
  int hidden = 2048;
  int hk = 16, hv = 32, dk = 128, dv = 128;  // gated DeltaNet
  int conv_k = 4;
  int nh = 16, nkv = 2, hd = 256, rotary = 64;  // gated attention (partial rotary 0.25)
  int block = 16;                               // paged-KV block size
  int experts = 2560, topk = 8, inter = 512, shared_inter = 512;
  int vocab = 248320;
  float rope_theta = 1e7f;
  float eps = 1e-6f;
  // Token counts.
  std::vector<int> decode_batches = {1, 8, 64, 256};
  std::vector<int> contexts = {1024, 8192};
  int prefill = 4096;  // 1 x 4096
  int multi_seqs = 8;  // 8 x 1024
  int multi_len = 1024;
  std::vector<int> rows = {64, 4096};  // elementwise ops: a decode batch and a prefill
  std::vector<int> moe_tokens = {1, 8, 64, 256, 4096, 8192};
  std::vector<int> topk_tokens = {1, 64, 256, 1024, 2048, 4096, 8192};
  int gemm = 8192;  // the matrix-rate probe: gemm x gemm x gemm
  [[nodiscard]] int conv_dim() const { return 2 * hk * dk + hv * dv; }
};

Dims SmokeDims();

// ---- results -----------------------------------------------------------------------------------
struct Result {
  std::string name, op, shape, timing;
  double time_us = 0, min_us = 0, host_us = 0;
  double unstaged_us = 0;  // segment ops: median without StageStep (0: not timed)
  double graph_us = 0;     // staged ops: per call in a replayed recording of many (0: not timed)
  double bytes = 0, flops = 0;
  double bound_us = 0;
  std::string bound_by;
  int sets = 1, iters = 0, gap_batches = 0;
  std::string note;
};

// A prepared case: `run(set)` queues the op on input set `set` (0 <= set < sets).
struct Case {
  std::string op, shape, note;
  double bytes = 0, flops = 0;
  int sets = 1;
  std::function<void(int)> run;
  // Ops with segments: stages the one step every set shares (Backend::StageStep); empty otherwise.
  std::function<void()> stage;
};

struct Spec {
  std::string name;
  std::function<Case()> make;
};

// A step's sequence segments and the block tables they point into.
struct SegmentSet {
  std::vector<SequenceSegment> segs;
  std::vector<std::vector<int32_t>> tables;
};

// ---- the bench ---------------------------------------------------------------------------------
class Bench {
 public:
  Bench(Options opt, std::unique_ptr<Backend> backend, cudaStream_t stream, bool cuda)
      : opt_(std::move(opt)),
        be_(std::move(backend)),
        stream_(stream),
        cuda_(cuda),
        d_(opt_.smoke ? SmokeDims() : Dims()) {
    act_ = be_->activation_dtype();
    if (cuda_) {
      cudaDeviceProp prop{};
      CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
      l2_bytes_ = prop.l2CacheSize;
      gpu_ = prop.name;
      events_.resize(2 * kBatch);
      for (auto& e : events_) CheckCuda(cudaEventCreate(&e), "cudaEventCreate");
    } else {
      gpu_ = "cpu";
    }
    rotate_bytes_ = 4.0 * static_cast<double>(l2_bytes_);
    BuildSpecs();
  }

  int Run();

 private:
  static constexpr int kBatch = 32;

  // ---- tensors ----
  Tensor Alloc(DType dtype, std::vector<int64_t> shape) {
    auto t = be_->Allocate(dtype, std::move(shape));
    if (!t.ok()) Die(std::string(t.status().message()));
    return *std::move(t);
  }
  Tensor Act(std::vector<int64_t> shape) { return Alloc(act_, std::move(shape)); }
  Tensor F32(std::vector<int64_t> shape) { return Alloc(DType::kF32, std::move(shape)); }
  // Fresh uniform random values in [lo, hi).
  void Fill(Tensor& t, float lo, float hi) {
    const uint64_t seed = ++seed_;
    if (cuda_) {
      be_->Synchronize();  // Allocate's memset is queued on the backend's stream
      CheckCuda(FillUniform(t.raw(), t.numel(), t.dtype() == DType::kBF16, lo, hi, seed, nullptr),
                "FillUniform");
      CheckCuda(cudaDeviceSynchronize(), "FillUniform");
      return;
    }
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> host(t.numel());
    for (float& v : host) v = u(rng);
    be_->CopyFromHost(host.data(), DType::kF32, t);
  }
  Tensor Rand(DType dtype, std::vector<int64_t> shape, float lo = -1.f, float hi = 1.f) {
    Tensor t = Alloc(dtype, std::move(shape));
    Fill(t, lo, hi);
    return t;
  }
  Tensor Ints(const std::vector<int32_t>& v, std::vector<int64_t> shape) {
    Tensor t = Alloc(DType::kI32, std::move(shape));
    be_->CopyFromHost(v.data(), DType::kI32, t);
    return t;
  }
  [[nodiscard]] size_t ActSize() const { return kernels::DTypeSize(act_); }
  // Input sets so that sets * bytes_per_set covers 4 x L2 (at most 64; 2 for the CPU check).
  [[nodiscard]] int Sets(double bytes_per_set) const {
    if (!cuda_) return 2;
    const double n = std::ceil(rotate_bytes_ / std::max(bytes_per_set, 1.0));
    return static_cast<int>(std::clamp(n, 1.0, 64.0));
  }
  std::vector<int32_t> Permutation(int n) {
    std::vector<int32_t> p(n);
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), rng_);
    return p;
  }

  // ---- cases ----
  void BuildSpecs();
  void Add(std::string name, std::function<Case()> make) {
    specs_.push_back({std::move(name), std::move(make)});
  }
  Case DeltaRule(int seqs, int len, DeltaRuleAlgorithm algo);
  Case Conv(int seqs, int len);
  // Backend::GatedDeltaNetMixer at a step of `seqs` sequences of `len` tokens (a decode step, or a
  // speculative verify step): the CUDA backend's default choice between its one clustered launch
  // and the parts; MOBIUS_DELTANET_STEP=0|1 forces either.
  Case DeltaNetMixerStep(int seqs, int len);
  Case Attention(int seqs, int ctx, bool prefill, bool gated = false);
  // Routed experts at `tokens` tokens: the release bank, or `experts` experts at top-`topk`.
  Case Moe(int tokens, int experts = 0, int topk = 0);
  // Backend::RoutedMoeWithSharedExpert (the model's MoE layer from its router logits, with the
  // shared expert's down projection): on CUDA at 4-8 tokens the top-k's grid computes the shared
  // rows; MOBIUS_MOE_SHARED_BESIDE_TOPK=on|off forces either form.
  Case RoutedMoeShared(int tokens);
  // The routed experts' gate_up and down weights, made once and shared by the MoE cases.
  std::shared_ptr<std::pair<Tensor, Tensor>> MoeBank();
  // Stages `segs` (with `tokens` placeholder token ids) for the timed calls of a case.
  std::function<void()> Stager(std::shared_ptr<SegmentSet> segs, int64_t tokens, int max_positions);
  Case Linear(int m, int n, int k);
  Case LinearFanOut(int m, std::vector<int> ns, int k);

  // ---- timing ----
  Result Time(const std::string& name, Case& c);
  void TimeCalls(Case& c, Result& r);
  // Staged cases: records many calls as one CUDA graph and sets r.graph_us from its replays.
  void TimeRecorded(Case& c, Result& r);
  // --chain: rounds of the named cases (one call each) recorded as one graph; prints us per round.
  void TimeChain(const std::vector<std::string>& names);
  // Replays `step` `replays` times between two events and returns the median microseconds per
  // call (`calls` recorded in it), the first replay (which uploads the graph) left out.
  absl::StatusOr<double> ReplayMedianUs(kernels::CapturedStep& step, int calls, int replays);
  void MeasureCeilings();
  void Print(const std::vector<Result>& results) const;
  void WriteJson(const std::vector<Result>& results) const;

  Options opt_;
  std::unique_ptr<Backend> be_;
  cudaStream_t stream_;
  bool cuda_;
  Dims d_;
  DType act_ = DType::kBF16;
  std::string gpu_;
  int64_t l2_bytes_ = 64 << 20;
  double rotate_bytes_ = 0;
  double bandwidth_ = 0, matrix_rate_ = 0;
  std::string bandwidth_src_, matrix_src_;
  std::vector<cudaEvent_t> events_;
  std::vector<Spec> specs_;
  uint64_t seed_ = 1234;
  std::mt19937_64 rng_{42};
  std::shared_ptr<std::pair<Tensor, Tensor>> moe_bank_;  // gate_up, down; shared by the MoE cases
};

// Segments of `seqs` sequences of `len` new tokens after `cached` tokens, state slots from
// `slot0`, with `blocks_per_seq` blocks each taken from `table` starting at `table_off`.

SegmentSet MakeSegments(int seqs, int len, int cached, int slot0, int blocks_per_seq,
                        const std::vector<int32_t>* table, size_t table_off);

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_KERNELS_KERNEL_BENCH_H_
