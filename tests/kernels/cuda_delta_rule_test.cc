// The CUDA gated delta rule (recurrent and chunked WY/UT kernels) against the CPU backend's
// token-by-token fp32 reference on fresh random inputs: ragged segments of 1 .. 1000 tokens,
// nonzero starting states, state_slot -1, release dims and small ones; chunked prefill in pieces
// equals one piece. Timings with MOBIUS_CUDA_BENCH=1 (kernel time through CUDA events).
// Skipped without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/dtype.h"

namespace mobius::kernels {
namespace {

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

std::vector<float> Random(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = BF16ToFloat(FloatToBF16(d(rng)));
  return v;
}

// max |got - ref| / max |ref|; infinite on a NaN (unwritten output).
double RelErr(const std::vector<float>& got, const std::vector<float>& ref) {
  double diff = 0, mag = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, double(std::fabs(got[i] - ref[i])));
    mag = std::max(mag, double(std::fabs(ref[i])));
  }
  return mag > 0 ? diff / mag : diff;
}

std::vector<SequenceSegment> Segments(const std::vector<int>& lengths,
                                      const std::vector<int>& slots) {
  std::vector<SequenceSegment> segs;
  int begin = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    SequenceSegment s;
    s.token_begin = begin;
    s.num_tokens = lengths[i];
    s.cached_tokens = 5;
    s.state_slot = slots[i];
    segs.push_back(s);
    begin += lengths[i];
  }
  return segs;
}

const char* AlgName(DeltaRuleAlgorithm a) {
  return a == DeltaRuleAlgorithm::kRecurrent ? "recurrent"
         : a == DeltaRuleAlgorithm::kChunked ? "chunked"
                                             : "auto";
}

class CudaDeltaRuleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    cpu_ = CreateCpuBackend(8);
    auto cuda = CreateCudaBackend(0);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
  }
  Tensor Make(Backend& be, DType dtype, std::vector<int64_t> shape, const std::vector<float>& v) {
    auto t = be.Allocate(dtype, std::move(shape));
    EXPECT_TRUE(t.ok()) << t.status();
    be.CopyFromHost(v.data(), DType::kF32, *t);
    return *t;
  }
  std::vector<float> Host(Backend& be, const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    be.CopyToHostF32(t, v.data());
    return v;
  }

  // Runs one ragged case on the CPU (recurrent, fp32) and on the GPU with every algorithm.
  void RunCase(const char* name, const DeltaRuleDims& d, const std::vector<int>& lengths,
               const std::vector<int>& slots, int num_slots) {
    const int64_t row = 2LL * d.num_k_heads * d.k_head_dim + int64_t{d.num_v_heads} * d.v_head_dim;
    const int64_t t = std::accumulate(lengths.begin(), lengths.end(), 0);
    const int64_t hv = d.num_v_heads, width = hv * d.v_head_dim;
    const int64_t state_elems = int64_t{num_slots} * hv * d.k_head_dim * d.v_head_dim;
    const std::vector<float> qkv = Random(rng_, t * row, -1, 1);
    const std::vector<float> g = Random(rng_, t * hv, -0.4f, -0.005f);
    const std::vector<float> beta = Random(rng_, t * hv, 0.05f, 1.0f);
    const std::vector<float> state0 = Random(rng_, state_elems, -0.3f, 0.3f);
    const auto segs = Segments(lengths, slots);

    Tensor c_qkv = Make(*cpu_, DType::kF32, {t, row}, qkv);
    Tensor c_g = Make(*cpu_, DType::kF32, {t, hv}, g),
           c_b = Make(*cpu_, DType::kF32, {t, hv}, beta);
    Tensor c_st = Make(*cpu_, DType::kF32, {num_slots, hv, d.k_head_dim, d.v_head_dim}, state0);
    Tensor c_out = Make(*cpu_, DType::kF32, {t, width}, std::vector<float>(t * width));
    cpu_->GatedDeltaRule(c_qkv, c_g, c_b, d, c_st, segs, DeltaRuleAlgorithm::kRecurrent, c_out);
    const std::vector<float> ref_out = Host(*cpu_, c_out), ref_state = Host(*cpu_, c_st);

    Tensor qkv_t = Make(*cuda_, DType::kBF16, {t, row}, qkv);
    Tensor g_t = Make(*cuda_, DType::kF32, {t, hv}, g),
           b_t = Make(*cuda_, DType::kF32, {t, hv}, beta);
    for (DeltaRuleAlgorithm alg : {DeltaRuleAlgorithm::kRecurrent, DeltaRuleAlgorithm::kChunked,
                                   DeltaRuleAlgorithm::kAuto}) {
      Tensor st = Make(*cuda_, DType::kF32, {num_slots, hv, d.k_head_dim, d.v_head_dim}, state0);
      Tensor out = Make(*cuda_, DType::kBF16, {t, width}, std::vector<float>(t * width, NAN));
      cuda_->GatedDeltaRule(qkv_t, g_t, b_t, d, st, segs, alg, out);
      const double eo = RelErr(Host(*cuda_, out), ref_out);
      const double es = RelErr(Host(*cuda_, st), ref_state);
      std::printf("[delta-rule] %-28s %-9s out %.3e state %.3e\n", name, AlgName(alg), eo, es);
      EXPECT_LT(eo, 1e-2) << name << " " << AlgName(alg);
      // The chunked kernels multiply S and X in bf16 (fp32 accumulation).
      EXPECT_LT(es, alg == DeltaRuleAlgorithm::kRecurrent ? 1e-4 : 1e-2)
          << name << " " << AlgName(alg);
    }
  }

  std::mt19937 rng_{20261130};
  std::unique_ptr<Backend> cpu_, cuda_;
};

TEST_F(CudaDeltaRuleTest, RaggedReleaseDims) {
  const DeltaRuleDims d{16, 32, 128, 128};
  // Slot 3 starts from the random state like the others; slot -1 starts from zero, writes none.
  // kAuto sends the 1- and 10-token segments to the recurrent kernel, the rest to the chunked.
  RunCase("release 1,10,63,64,65,200,1000", d, {1, 10, 63, 64, 65, 200, 1000},
          {0, 5, 1, -1, 2, 3, 4}, 6);
}

TEST_F(CudaDeltaRuleTest, RaggedSmallDims) {
  RunCase("Hk2 Hv4 64x64", DeltaRuleDims{2, 4, 64, 64}, {1, 63, 64, 65, 200, 1000},
          {5, 0, 1, -1, 2, 3}, 6);
  RunCase("Hk1 Hv3 64x96", DeltaRuleDims{1, 3, 64, 96}, {130, 1, 7, 64}, {1, 0, -1, 2}, 3);
  // Dims the chunked kernels do not take (Dk 72, Dv 40; Dk 32): the recurrent kernel runs.
  RunCase("Hk1 Hv2 72x40 (fallback)", DeltaRuleDims{1, 2, 72, 40}, {65, 3, 128}, {0, -1, 1}, 2);
  RunCase("Hk2 Hv4 32x32 (fallback)", DeltaRuleDims{2, 4, 32, 32}, {100, 1}, {1, 0}, 2);
}

// Prefill in pieces (continuing from the state each piece leaves) equals one piece, and both
// equal the token-by-token recurrent kernel.
TEST_F(CudaDeltaRuleTest, ChunkedInPiecesEqualsOnePiece) {
  const DeltaRuleDims d{16, 32, 128, 128};
  const int64_t row = 2LL * 16 * 128 + 32 * 128, t = 1000, width = 32 * 128;
  const std::vector<float> qkv = Random(rng_, t * row, -1, 1);
  const std::vector<float> g = Random(rng_, t * 32, -0.4f, -0.005f);
  const std::vector<float> beta = Random(rng_, t * 32, 0.05f, 1.0f);
  const std::vector<float> state0 = Random(rng_, 32 * 128 * 128, -0.3f, 0.3f);
  Tensor qkv_t = Make(*cuda_, DType::kBF16, {t, row}, qkv);
  Tensor g_t = Make(*cuda_, DType::kF32, {t, 32}, g),
         b_t = Make(*cuda_, DType::kF32, {t, 32}, beta);

  auto run = [&](const std::vector<int>& pieces, DeltaRuleAlgorithm alg, std::vector<float>& out,
                 std::vector<float>& state) {
    Tensor st = Make(*cuda_, DType::kF32, {1, 32, 128, 128}, state0);
    Tensor o = Make(*cuda_, DType::kBF16, {t, width}, std::vector<float>(t * width, NAN));
    int begin = 0;
    for (int n : pieces) {
      Tensor o_piece = o.Rows(begin, n);
      cuda_->GatedDeltaRule(qkv_t.Rows(begin, n), g_t.Rows(begin, n), b_t.Rows(begin, n), d, st,
                            Segments({n}, {0}), alg, o_piece);
      begin += n;
    }
    out = Host(*cuda_, o);
    state = Host(*cuda_, st);
  };
  std::vector<float> one_out, one_state, rec_out, rec_state;
  run({1000}, DeltaRuleAlgorithm::kChunked, one_out, one_state);
  run({1000}, DeltaRuleAlgorithm::kRecurrent, rec_out, rec_state);
  const double e1 = RelErr(one_out, rec_out), e2 = RelErr(one_state, rec_state);
  std::printf("[delta-rule] chunked 1000 vs recurrent: out %.3e state %.3e\n", e1, e2);
  EXPECT_LT(e1, 1e-2);
  EXPECT_LT(e2, 1e-2);
  for (const std::vector<int>& pieces :
       {std::vector<int>{300, 700}, std::vector<int>{64, 64, 1, 871},
        std::vector<int>{500, 1, 499}}) {
    std::vector<float> out, state;
    run(pieces, DeltaRuleAlgorithm::kAuto, out, state);
    const double eo = RelErr(out, one_out), es = RelErr(state, one_state);
    std::printf("[delta-rule] pieces of %zu vs one piece: out %.3e state %.3e\n", pieces.size(), eo,
                es);
    EXPECT_LT(eo, 1e-2);
    EXPECT_LT(es, 1e-2);
  }
}

// ---- timings: MOBIUS_CUDA_BENCH=1 ----

struct DeviceSegments {
  std::vector<int32_t*> buffers;
  cuda::SegmentMeta meta;
  ~DeviceSegments() {
    for (int32_t* p : buffers) cudaFree(p);
  }
  int32_t* Put(const std::vector<int32_t>& v) {
    int32_t* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(int32_t) + 4), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
              cudaSuccess);
    buffers.push_back(p);
    return p;
  }
  DeviceSegments(const std::vector<int>& lengths, int first_slot) {
    std::vector<int32_t> begin, len, cached, slot;
    int b = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      begin.push_back(b);
      len.push_back(lengths[i]);
      cached.push_back(0);
      slot.push_back(first_slot + static_cast<int>(i));
      b += lengths[i];
    }
    meta.num_segments = static_cast<int>(lengths.size());
    meta.token_begin = Put(begin);
    meta.num_tokens = Put(len);
    meta.cached_tokens = Put(cached);
    meta.state_slot = Put(slot);
  }
};

class CudaDeltaRuleBench : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("MOBIUS_CUDA_BENCH");
    if (env == nullptr || std::string(env) != "1") GTEST_SKIP() << "set MOBIUS_CUDA_BENCH=1";
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    cudaEventCreate(&e0_);
    cudaEventCreate(&e1_);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void* Alloc(size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    ptrs_.push_back(p);
    return p;
  }
  ~CudaDeltaRuleBench() override {
    for (void* p : ptrs_) cudaFree(p);
  }
  // Fills with bf16 / f32 values uniform in [lo, hi).
  void FillBf16(uint16_t* d, int64_t n, float lo, float hi) {
    std::vector<float> v = Random(rng_, std::min<int64_t>(n, 1 << 22), lo, hi);
    std::vector<uint16_t> h(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) h[i] = FloatToBF16(v[i % v.size()]);
    cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice);
  }
  void FillF32(float* d, int64_t n, float lo, float hi) {
    std::vector<float> v = Random(rng_, std::min<int64_t>(n, 1 << 22), lo, hi);
    std::vector<float> h(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) h[i] = v[i % v.size()];
    cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice);
  }
  // Median over `reps` replays of a CUDA graph of `iters` launches (f(0) .. f(iters - 1)): the
  // kernel time without host launch overhead, in microseconds per launch.
  template <typename F>
  double TimeUs(F&& f, int iters, int reps = 5) {
    for (int i = 0; i < 2; ++i) f(i);  // warm-up outside the capture (function attributes)
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    for (int i = 0; i < iters; ++i) f(i);
    EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphLaunch(exec, stream_);
    cudaStreamSynchronize(stream_);
    std::vector<double> times;
    for (int r = 0; r < reps; ++r) {
      cudaEventRecord(e0_, stream_);
      cudaGraphLaunch(exec, stream_);
      cudaEventRecord(e1_, stream_);
      cudaEventSynchronize(e1_);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0_, e1_);
      times.push_back(1e3 * ms / iters);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }
  bool Part(const char* name) {
    const char* env = std::getenv("MOBIUS_DR_BENCH");
    return env == nullptr || std::string(env) == "all" || std::string(env) == name;
  }

  std::mt19937 rng_{7};
  cudaStream_t stream_ = nullptr;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
  std::vector<void*> ptrs_;
};

TEST_F(CudaDeltaRuleBench, ReleaseDims) {
  const int hk = 16, hv = 32, dk = 128, dv = 128;
  const int64_t row = 2LL * hk * dk + hv * dv;
  const int64_t state_bytes = int64_t{hv} * dk * dv * 4;
  const int kSlots = 512;  // 1 GiB of states: rotating through them keeps L2 out of the numbers
  float* states = static_cast<float*>(Alloc(kSlots * state_bytes));
  FillF32(states, kSlots * state_bytes / 4, -0.3f, 0.3f);
  const int64_t max_t = 8192;
  uint16_t* qkv = static_cast<uint16_t*>(Alloc(max_t * row * 2));
  float* g = static_cast<float*>(Alloc(max_t * hv * 4));
  float* beta = static_cast<float*>(Alloc(max_t * hv * 4));
  uint16_t* out = static_cast<uint16_t*>(Alloc(max_t * hv * dv * 2));
  FillBf16(qkv, max_t * row, -1, 1);
  FillF32(g, max_t * hv, -0.3f, -0.01f);
  FillF32(beta, max_t * hv, 0.1f, 0.9f);
  const char* generic = std::getenv("MOBIUS_DELTA_RULE_GENERIC");
  const char* rec_name =
      generic != nullptr && generic[0] == '1' ? "recurrent(generic)" : "recurrent";

  // Decode: B sequences x 1 token; bytes = state read + written, plus q/k/v/out rows.
  for (int batch : {1, 8, 64, 256}) {
    if (!Part("decode")) break;
    const int sets = kSlots / batch;
    std::vector<std::unique_ptr<DeviceSegments>> metas;
    for (int s = 0; s < sets; ++s) {
      metas.push_back(std::make_unique<DeviceSegments>(std::vector<int>(batch, 1), s * batch));
    }
    const double us = TimeUs(
        [&](int i) {
          cuda::LaunchGatedDeltaRuleRecurrent(qkv, g, beta, nullptr, 0, hk, hv, dk, dv, states,
                                              metas[i % sets]->meta, INT32_MAX,
                                              /*out_slots=*/false, out, stream_);
        },
        50);
    const double bytes = batch * (2.0 * state_bytes + row * 2 + hv * dv * 2 + hv * 8);
    std::printf("TIMING delta decode %-18s B=%3d: %8.2f us  bound %6.2f us (%.2fx)\n", rec_name,
                batch, us, bytes / 4.3e6, us / (bytes / 4.3e6));
  }

  // Prefill: 1 x 4096 and 8 x 1024 tokens, plus short segments for the kAuto threshold.
  struct Case {
    int segs, len;
  };
  for (const Case c : {Case{1, 4096}, Case{8, 1024}, Case{1, 8192}, Case{1, 16}, Case{1, 32},
                       Case{1, 64}, Case{1, 128}, Case{1, 256}, Case{8, 16}, Case{8, 32},
                       Case{8, 64}, Case{8, 128}, Case{8, 256}, Case{64, 64}}) {
    if (!Part("prefill") && !(Part("long") && c.len >= 1024)) continue;
    DeviceSegments meta(std::vector<int>(c.segs, c.len), 0);
    const int64_t tokens = int64_t{c.segs} * c.len;
    const int64_t chunks = int64_t{c.segs} * ((c.len + 63) / 64);
    void* scratch = Alloc(cuda::ChunkedDeltaRuleScratchBytes(chunks, hv, dk, dv));
    const double us_c = TimeUs(
        [&](int) {
          cuda::LaunchGatedDeltaRuleChunked(qkv, g, beta, hk, hv, dk, dv, states, meta.meta, 1,
                                            chunks, c.segs, scratch, out, stream_);
        },
        c.len >= 1024 ? 5 : 20);
    const int rec_iters = tokens >= 4096 ? 1 : 5;
    const double us_r =
        std::getenv("MOBIUS_DR_NO_RECURRENT") != nullptr
            ? 0.0
            : TimeUs(
                  [&](int) {
                    // Several tokens a segment: the backend's out-slot kernel.
                    cuda::LaunchGatedDeltaRuleRecurrent(qkv, g, beta, nullptr, 0, hk, hv, dk, dv,
                                                        states, meta.meta, INT32_MAX,
                                                        /*out_slots=*/c.len > 1, out, stream_);
                  },
                  rec_iters, tokens >= 4096 ? 3 : 5);
    // Bound: qkv rows + g/beta read, out written, states read+written once; multiply-adds of
    // the chunked form per token and value head: K K^T, Q K^T, T K (3 C Dk), T V, P X (2 C Dv),
    // w S, qg S, kd^T X (3 Dk Dv).
    const double bytes = tokens * (row * 2.0 + hv * 8 + hv * dv * 2) + c.segs * 2.0 * state_bytes;
    const double flops = tokens * hv * 2.0 * (3.0 * 64 * dk + 2.0 * 64 * dv + 3.0 * dk * dv);
    const double bound = std::max(bytes / 4.3e6, flops / 790e6);
    std::printf(
        "TIMING delta prefill %3d x %4d: chunked %8.1f us, %s %9.1f us; bound %.1f us "
        "(chunked %.1fx)\n",
        c.segs, c.len, us_c, rec_name, us_r, bound, us_c / bound);
  }
}

// One launch of each kernel at release dims, for a profiler (ncu): MOBIUS_CUDA_BENCH=1.
TEST_F(CudaDeltaRuleBench, ProfileOnce) {
  const int hk = 16, hv = 32, dk = 128, dv = 128;
  const int64_t row = 2LL * hk * dk + hv * dv, t = 8192;
  float* states = static_cast<float*>(Alloc(int64_t{256} * hv * dk * dv * 4));
  FillF32(states, int64_t{256} * hv * dk * dv, -0.3f, 0.3f);
  uint16_t* qkv = static_cast<uint16_t*>(Alloc(t * row * 2));
  float* g = static_cast<float*>(Alloc(t * hv * 4));
  float* beta = static_cast<float*>(Alloc(t * hv * 4));
  uint16_t* out = static_cast<uint16_t*>(Alloc(t * hv * dv * 2));
  FillBf16(qkv, t * row, -1, 1);
  FillF32(g, t * hv, -0.3f, -0.01f);
  FillF32(beta, t * hv, 0.1f, 0.9f);
  for (int batch : {1, 64}) {
    DeviceSegments meta(std::vector<int>(batch, 1), 0);
    cuda::LaunchGatedDeltaRuleRecurrent(qkv, g, beta, nullptr, 0, hk, hv, dk, dv, states, meta.meta,
                                        INT32_MAX, /*out_slots=*/false, out, stream_);
  }
  for (const std::vector<int>& lengths : {std::vector<int>{4096}, std::vector<int>(8, 1024)}) {
    DeviceSegments meta(lengths, 0);
    const int64_t chunks = 4096 / 64 * (lengths.size() == 1 ? 1 : 2);
    void* scratch = Alloc(cuda::ChunkedDeltaRuleScratchBytes(chunks, hv, dk, dv));
    cuda::LaunchGatedDeltaRuleChunked(qkv, g, beta, hk, hv, dk, dv, states, meta.meta, 1, chunks,
                                      static_cast<int>(lengths.size()), scratch, out, stream_);
  }
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

}  // namespace
}  // namespace mobius::kernels
