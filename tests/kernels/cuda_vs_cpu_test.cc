// Every op of the CUDA backend against the CPU backend (the fp32 reference that matches the
// fixtures), on the same bf16-representable random inputs with the fixture models' shapes.
// Skipped without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/tuning_knobs.h"

namespace mobius::kernels {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Host values rounded to bf16 so both backends see identical inputs.
std::vector<float> Random(std::mt19937& rng, int64_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = BF16ToFloat(FloatToBF16(d(rng)));
  return v;
}

class Pair {
 public:
  explicit Pair(int cpu_threads = 2) : cpu_(CreateCpuBackend(cpu_threads)) {
    auto cuda = CreateCudaBackend(0);
    EXPECT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
  }
  // The same values on both backends, in each one's activation dtype (or `dtype`).
  std::pair<Tensor, Tensor> Make(std::vector<int64_t> shape, const std::vector<float>& v,
                                 std::optional<DType> dtype = std::nullopt) {
    Tensor a = *cpu_->Allocate(dtype.value_or(cpu_->activation_dtype()), shape);
    Tensor b = *cuda_->Allocate(dtype.value_or(cuda_->activation_dtype()), shape);
    if (a.dtype() != DType::kI32) {  // I32 outputs start as the allocation's zeros
      cpu_->CopyFromHost(v.data(), DType::kF32, a);
      cuda_->CopyFromHost(v.data(), DType::kF32, b);
    }
    return {a, b};
  }
  double Compare(const char* what, const Tensor& a, const Tensor& b) {
    std::vector<float> x(a.numel()), y(b.numel());
    cpu_->CopyToHostF32(a, x.data());
    cuda_->CopyToHostF32(b, y.data());
    double diff = 0, ref = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      diff = std::max(diff, double(std::fabs(x[i] - y[i])));
      ref = std::max(ref, double(std::fabs(x[i])));
    }
    const double err = ref > 0 ? diff / ref : diff;
    std::printf("[cuda-vs-cpu] %-28s rel err %.3e\n", what, err);
    return err;
  }
  // A CUDA tensor's values on the host, as fp32.
  std::vector<float> CudaHost(const Tensor& t) {
    std::vector<float> v(t.numel());
    cuda_->CopyToHostF32(t, v.data());
    return v;
  }
  Backend& cpu() { return *cpu_; }
  Backend& cuda() { return *cuda_; }

 private:
  std::unique_ptr<Backend> cpu_, cuda_;
};

constexpr double kTol = 2e-2;

// A DeltaNet mixer's inputs and weights (Hv = 2 Hk value heads of D, conv of 4 taps), the same
// random values on both backends, and the starting conv and recurrent states of `slots` slots.
struct MixerInputs {
  std::pair<Tensor, Tensor> mixed, z, a, b, conv_w, a_log, dt, norm_w;
  std::vector<float> conv0, state0;
};
MixerInputs RandomMixerInputs(Pair& p, std::mt19937& rng, int T, int Hk, int D, int slots) {
  const int Hv = 2 * Hk, C = 2 * Hk * D + Hv * D;
  MixerInputs in;
  in.mixed = p.Make({T, C}, Random(rng, T * C, -2, 2));
  in.z = p.Make({T, Hv * D}, Random(rng, T * Hv * D, -2, 2));
  in.a = p.Make({T, Hv}, Random(rng, T * Hv, -3, 3));
  in.b = p.Make({T, Hv}, Random(rng, T * Hv, -3, 3));
  in.conv_w = p.Make({C, 4}, Random(rng, C * 4, -0.5f, 0.5f));
  in.a_log = p.Make({Hv}, Random(rng, Hv, 0, 2.5f));
  in.dt = p.Make({Hv}, Random(rng, Hv, -1, 1));
  in.norm_w = p.Make({D}, Random(rng, D, 0.5f, 1.5f));
  in.conv0 = Random(rng, static_cast<int64_t>(slots) * C * 3, -2, 2);
  in.state0 = Random(rng, static_cast<int64_t>(slots) * Hv * D * D, -0.2f, 0.2f);
  return in;
}

TEST(CudaVsCpuTest, EveryOpAgrees) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(3);
  const int T = 40, H = 128;
  // Two sequences: one continuing from 9 cached tokens, one fresh.
  std::vector<int32_t> blocks0 = {3, 0, 5, 1}, blocks1 = {2, 4, 6};
  std::vector<SequenceSegment> segs(2);
  segs[0] = {0, 25, 9, 1, blocks0};
  segs[1] = {25, 15, 0, 0, blocks1};

  {  // dense
    auto x = p.Make({T, H}, Random(rng, T * H));
    auto w = p.Make({96, H}, Random(rng, 96 * H, -0.1f, 0.1f));
    auto y = p.Make({T, 96}, std::vector<float>(T * 96));
    p.cpu().Linear(x.first, w.first, y.first);
    p.cuda().Linear(x.second, w.second, y.second);
    EXPECT_LT(p.Compare("Linear", y.first, y.second), kTol);
    auto nw = p.Make({H}, Random(rng, H, -0.3f, 0.3f));
    auto out = p.Make({T, H}, std::vector<float>(T * H));
    p.cpu().RmsNorm1p(x.first, nw.first, 1e-6f, out.first);
    p.cuda().RmsNorm1p(x.second, nw.second, 1e-6f, out.second);
    EXPECT_LT(p.Compare("RmsNorm1p", out.first, out.second), kTol);
    auto d = p.Make({T, H}, Random(rng, T * H));
    p.cpu().AddRmsNorm1p(x.first, d.first, nw.first, 1e-6f, out.first);
    p.cuda().AddRmsNorm1p(x.second, d.second, nw.second, 1e-6f, out.second);
    EXPECT_LT(p.Compare("AddRmsNorm1p (residual)", x.first, x.second), kTol);
    EXPECT_LT(p.Compare("AddRmsNorm1p (normed)", out.first, out.second), kTol);
    auto gu = p.Make({T, 64}, Random(rng, T * 64, -3, 3));
    auto act = p.Make({T, 32}, std::vector<float>(T * 32));
    p.cpu().SiluAndMul(gu.first, act.first);
    p.cuda().SiluAndMul(gu.second, act.second);
    EXPECT_LT(p.Compare("SiluAndMul", act.first, act.second), kTol);
    auto gl = p.Make({T, 1}, Random(rng, T, -3, 3));
    p.cpu().AddSigmoidScaled(x.first, d.first, gl.first);
    p.cuda().AddSigmoidScaled(x.second, d.second, gl.second);
    EXPECT_LT(p.Compare("AddSigmoidScaled", x.first, x.second), kTol);
    p.cpu().MulSigmoid(x.first, d.first);
    p.cuda().MulSigmoid(x.second, d.second);
    EXPECT_LT(p.Compare("MulSigmoid", x.first, x.second), kTol);
  }
  // Projections of every shape the fixture models use, including the thin ones (N = 1 for the
  // shared-expert gate, N = Hv for b and a).
  for (int rows : {1, 7, 130}) {
    for (int n : {1, 4, 8, 64, 2048}) {
      auto x = p.Make({rows, H}, Random(rng, rows * H));
      auto w = p.Make({n, H}, Random(rng, n * H, -0.1f, 0.1f));
      auto y = p.Make({rows, n}, std::vector<float>(rows * n));
      p.cpu().Linear(x.first, w.first, y.first);
      p.cuda().Linear(x.second, w.second, y.second);
      const std::string what = "Linear T=" + std::to_string(rows) + " N=" + std::to_string(n);
      EXPECT_LT(p.Compare(what.c_str(), y.first, y.second), kTol);
    }
  }
  {  // DeltaNet with the fixture's dims: Hk 2, Hv 4, Dk = Dv = 32, K = 4
    const int Hk = 2, Hv = 4, D = 32, K = 4, C = 2 * Hk * D + Hv * D;
    auto x = p.Make({T, C}, Random(rng, T * C));
    auto w = p.Make({C, K}, Random(rng, C * K, -0.5f, 0.5f));
    auto conv_state = p.Make({3, C, K - 1}, Random(rng, 3 * C * (K - 1)), DType::kF32);
    auto conv_out = p.Make({T, C}, std::vector<float>(T * C));
    p.cpu().CausalConv1dSilu(x.first, w.first, conv_state.first, segs, conv_out.first);
    p.cuda().CausalConv1dSilu(x.second, w.second, conv_state.second, segs, conv_out.second);
    EXPECT_LT(p.Compare("CausalConv1dSilu", conv_out.first, conv_out.second), kTol);
    EXPECT_LT(p.Compare("CausalConv1dSilu (state)", conv_state.first, conv_state.second), kTol);
    auto a = p.Make({T, Hv}, Random(rng, T * Hv, -3, 3));
    auto b = p.Make({T, Hv}, Random(rng, T * Hv, -3, 3));
    auto a_log = p.Make({Hv}, Random(rng, Hv, 0, 2.5f));
    auto dt = p.Make({Hv}, Random(rng, Hv, -1, 1));
    auto g = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
    auto beta = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
    p.cpu().DeltaRuleGates(a.first, b.first, a_log.first, dt.first, g.first, beta.first);
    p.cuda().DeltaRuleGates(a.second, b.second, a_log.second, dt.second, g.second, beta.second);
    EXPECT_LT(p.Compare("DeltaRuleGates (g)", g.first, g.second), kTol);
    EXPECT_LT(p.Compare("DeltaRuleGates (beta)", beta.first, beta.second), kTol);
    DeltaRuleDims dims{Hk, Hv, D, D};
    auto state = p.Make({3, Hv, D, D}, Random(rng, 3 * Hv * D * D, -0.2f, 0.2f), DType::kF32);
    auto o = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
    p.cpu().GatedDeltaRule(conv_out.first, g.first, beta.first, dims, state.first, segs,
                           DeltaRuleAlgorithm::kAuto, o.first);
    p.cuda().GatedDeltaRule(conv_out.second, g.second, beta.second, dims, state.second, segs,
                            DeltaRuleAlgorithm::kAuto, o.second);
    EXPECT_LT(p.Compare("GatedDeltaRule (out)", o.first, o.second), kTol);
    EXPECT_LT(p.Compare("GatedDeltaRule (state)", state.first, state.second), kTol);
    auto z = p.Make({T * Hv, D}, Random(rng, T * Hv * D, -3, 3));
    auto nw = p.Make({D}, Random(rng, D, 0.5f, 1.5f));
    auto y = p.Make({T * Hv, D}, std::vector<float>(T * Hv * D));
    p.cpu().GatedRmsNorm(o.first.Reshape({T * Hv, D}), z.first, nw.first, 1e-6f, y.first);
    p.cuda().GatedRmsNorm(o.second.Reshape({T * Hv, D}), z.second, nw.second, 1e-6f, y.second);
    EXPECT_LT(p.Compare("GatedRmsNorm", y.first, y.second), kTol);
  }
  {  // attention with the qwen fixture's dims: 4 q heads, 2 kv heads, head dim 64, rotary 16
    const int nh = 4, nkv = 2, hd = 64;
    auto qg = p.Make({T, nh, 2 * hd}, Random(rng, T * nh * 2 * hd));
    auto k = p.Make({T, nkv, hd}, Random(rng, T * nkv * hd));
    auto v = p.Make({T, nkv, hd}, Random(rng, T * nkv * hd));
    auto qn = p.Make({hd}, Random(rng, hd, -0.3f, 0.3f));
    auto kn = p.Make({hd}, Random(rng, hd, -0.3f, 0.3f));
    auto q = p.Make({T, nh, hd}, std::vector<float>(T * nh * hd));
    auto gate = p.Make({T, nh, hd}, std::vector<float>(T * nh * hd));
    RopeParams rope{16, 10000.f};
    p.cpu().QkNormRope(qg.first, k.first, qn.first, kn.first, 1e-6f, rope, segs, q.first,
                       gate.first);
    p.cuda().QkNormRope(qg.second, k.second, qn.second, kn.second, 1e-6f, rope, segs, q.second,
                        gate.second);
    EXPECT_LT(p.Compare("QkNormRope (q)", q.first, q.second), kTol);
    EXPECT_LT(p.Compare("QkNormRope (k)", k.first, k.second), kTol);
    EXPECT_LT(p.Compare("QkNormRope (gate)", gate.first, gate.second), kTol);
    // Caches pre-filled with random history for the 9 cached tokens of sequence 0.
    const int blocks = 8, bs = 16;
    auto kc = p.Make({blocks, bs, nkv, hd}, Random(rng, blocks * bs * nkv * hd));
    auto vc = p.Make({blocks, bs, nkv, hd}, Random(rng, blocks * bs * nkv * hd));
    p.cpu().WriteKvCache(k.first, v.first, segs, kc.first, vc.first);
    p.cuda().WriteKvCache(k.second, v.second, segs, kc.second, vc.second);
    EXPECT_LT(p.Compare("WriteKvCache (k)", kc.first, kc.second), kTol);
    auto out = p.Make({T, nh, hd}, std::vector<float>(T * nh * hd));
    p.cpu().PagedAttention(q.first, kc.first, vc.first, segs, 0.125f, out.first);
    p.cuda().PagedAttention(q.second, kc.second, vc.second, segs, 0.125f, out.second);
    EXPECT_LT(p.Compare("PagedAttention", out.first, out.second), kTol);
  }
  {  // MoE with the mobius fixture's dims: 40 experts, top 4, I = 32
    const int E = 40, k = 4, I = 32;
    auto x = p.Make({T, H}, Random(rng, T * H));
    auto logits = p.Make({T, E}, Random(rng, T * E, -2, 2));
    auto ids = p.Make({T, k}, std::vector<float>(T * k), DType::kI32);
    auto wts = p.Make({T, k}, std::vector<float>(T * k), DType::kF32);
    p.cpu().TopKSoftmax(logits.first, k, true, ids.first, wts.first);
    p.cuda().TopKSoftmax(logits.second, k, true, ids.second, wts.second);
    std::vector<int32_t> ia(T * k), ib(T * k);
    p.cpu().CopyToHostI32(ids.first, ia.data());
    p.cuda().CopyToHostI32(ids.second, ib.data());
    EXPECT_EQ(ia, ib) << "TopKSoftmax ids";
    EXPECT_LT(p.Compare("TopKSoftmax (weights)", wts.first, wts.second), kTol);
    auto gu = p.Make({E, 2 * I, H}, Random(rng, E * 2 * I * H, -0.1f, 0.1f));
    auto dn = p.Make({E, H, I}, Random(rng, E * H * I, -0.1f, 0.1f));
    auto out = p.Make({T, H}, Random(rng, T * H));
    p.cpu().MoeExperts(x.first, ids.first, wts.first, gu.first, dn.first, 0, out.first, {});
    p.cuda().MoeExperts(x.second, ids.second, wts.second, gu.second, dn.second, 0, out.second, {});
    EXPECT_LT(p.Compare("MoeExperts", out.first, out.second), kTol);
  }
}

// MoE with many tokens per expert (several row tiles per expert), as in a 130-token prefill of
// the Qwen3-Next fixture (16 experts, top 4).
TEST(CudaVsCpuTest, MoeManyTokensPerExpert) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(11);
  for (int T : {40, 130, 300}) {
    const int H = 128, E = 16, k = 4, I = 32;
    auto x = p.Make({T, H}, Random(rng, T * H));
    auto logits = p.Make({T, E}, Random(rng, T * E, -2, 2));
    auto ids = p.Make({T, k}, std::vector<float>(T * k), DType::kI32);
    auto wts = p.Make({T, k}, std::vector<float>(T * k), DType::kF32);
    p.cpu().TopKSoftmax(logits.first, k, true, ids.first, wts.first);
    p.cuda().TopKSoftmax(logits.second, k, true, ids.second, wts.second);
    auto gu = p.Make({E, 2 * I, H}, Random(rng, E * 2 * I * H, -0.1f, 0.1f));
    auto dn = p.Make({E, H, I}, Random(rng, E * H * I, -0.1f, 0.1f));
    auto out = p.Make({T, H}, std::vector<float>(T * H));
    p.cpu().MoeExperts(x.first, ids.first, wts.first, gu.first, dn.first, 0, out.first, {});
    p.cuda().MoeExperts(x.second, ids.second, wts.second, gu.second, dn.second, 0, out.second, {});
    const std::string what = "MoeExperts T=" + std::to_string(T);
    EXPECT_LT(p.Compare(what.c_str(), out.first, out.second), kTol);
  }
}

// MoE at the release dims (H 2048, I 512, top 8 of a 2560-expert bank) as one expert-parallel
// rank holding 64 experts (first_expert 1024): T = 1 .. 4096 covers every token-tile width of
// the tensor-core grouped GEMM (8 at decode up to 64 with hundreds of pairs per expert); a
// quarter of the picks land in the local slice, the rest anywhere in the bank (mostly on other
// ranks, contributing nothing). The skewed case routes every token to one expert first.
TEST(CudaVsCpuTest, MoeReleaseDims) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p(0);  // every core: the CPU reference does up to ~60 GFLOP here
  std::mt19937 rng(17);
  const int H = 2048, I = 512, k = 8, bank = 2560, E = 64, first = 1024;
  auto gu = p.Make({E, 2 * I, H}, Random(rng, int64_t{E} * 2 * I * H, -0.05f, 0.05f));
  auto dn = p.Make({E, H, I}, Random(rng, int64_t{E} * H * I, -0.05f, 0.05f));
  struct Case {
    int T;
    bool skewed;
  };
  for (const Case c : {Case{1, false}, Case{8, false}, Case{32, false}, Case{64, false},
                       Case{256, false}, Case{4096, false}, Case{1024, true}}) {
    const int T = c.T;
    std::vector<float> ids_f(static_cast<size_t>(T) * k);
    std::vector<int64_t> ref_counts(E, 0);
    std::uniform_int_distribution<int> local(first, first + E - 1), any(0, bank - 1);
    std::uniform_real_distribution<float> coin(0.0f, 1.0f);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < k; ++j) {
        int e;
        bool dup;
        do {
          e = c.skewed && j == 0 ? first + 5 : (coin(rng) < 0.25f ? local(rng) : any(rng));
          dup = false;
          for (int i = 0; i < j; ++i) dup |= ids_f[t * k + i] == static_cast<float>(e);
        } while (dup);
        ids_f[t * k + j] = static_cast<float>(e);
        if (e >= first && e < first + E) ++ref_counts[e - first];
      }
    }
    auto x = p.Make({T, H}, Random(rng, int64_t{T} * H));
    auto ids = p.Make({T, k}, std::vector<float>(T * k), DType::kI32);
    std::vector<int32_t> ids_i(ids_f.begin(), ids_f.end());
    // I32 tensors: upload through the I32 path on both backends.
    p.cpu().CopyFromHost(ids_i.data(), DType::kI32, ids.first);
    p.cuda().CopyFromHost(ids_i.data(), DType::kI32, ids.second);
    auto wts = p.Make({T, k}, Random(rng, int64_t{T} * k, 0.05f, 0.5f), DType::kF32);
    const std::vector<float> out0 = Random(rng, int64_t{T} * H, -0.01f, 0.01f);
    auto out = p.Make({T, H}, out0);
    std::vector<int64_t> cpu_counts(E, 0), gpu_counts(E, 0);
    p.cpu().MoeExperts(x.first, ids.first, wts.first, gu.first, dn.first, first, out.first,
                       cpu_counts);
    p.cuda().MoeExperts(x.second, ids.second, wts.second, gu.second, dn.second, first, out.second,
                        gpu_counts);
    const std::string what =
        "MoeExperts release T=" + std::to_string(T) + (c.skewed ? " skewed" : "");
    EXPECT_LT(p.Compare(what.c_str(), out.first, out.second), 1e-2);
    EXPECT_EQ(gpu_counts, ref_counts) << what;
    EXPECT_EQ(cpu_counts, ref_counts) << what;
    // Nothing routed locally must leave out untouched (T = 1 may route nowhere local).
    if (std::accumulate(ref_counts.begin(), ref_counts.end(), int64_t{0}) == 0) {
      std::vector<float> y(out0.size());
      p.cuda().CopyToHostF32(out.second, y.data());
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_EQ(y[i], BF16ToFloat(FloatToBF16(out0[i]))) << i;
      }
    }
  }
}

// Long prefill segments and decode tokens deep into the context, where attention splits its
// work over several blocks and the delta rule runs many steps.
TEST(CudaVsCpuTest, LongSegmentsAgree) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(5);
  const int nh = 4, nkv = 2, hd = 64, bs = 16, blocks = 96;
  for (int cached : {0, 200, 600}) {
    std::vector<int32_t> table0(blocks / 2), table1(blocks / 2);
    for (int i = 0; i < blocks / 2; ++i) {
      table0[i] = 2 * i + 1;
      table1[i] = 2 * i;
    }
    std::vector<SequenceSegment> segs = {{0, 130, cached, 0, table0}, {130, 1, 700, 1, table1}};
    const int T = 131;
    auto q = p.Make({T, nh, hd}, Random(rng, T * nh * hd));
    auto k = p.Make({T, nkv, hd}, Random(rng, T * nkv * hd));
    auto v = p.Make({T, nkv, hd}, Random(rng, T * nkv * hd));
    auto kc = p.Make({blocks, bs, nkv, hd}, Random(rng, blocks * bs * nkv * hd));
    auto vc = p.Make({blocks, bs, nkv, hd}, Random(rng, blocks * bs * nkv * hd));
    p.cpu().WriteKvCache(k.first, v.first, segs, kc.first, vc.first);
    p.cuda().WriteKvCache(k.second, v.second, segs, kc.second, vc.second);
    auto out = p.Make({T, nh, hd}, std::vector<float>(T * nh * hd));
    p.cpu().PagedAttention(q.first, kc.first, vc.first, segs, 0.125f, out.first);
    p.cuda().PagedAttention(q.second, kc.second, vc.second, segs, 0.125f, out.second);
    const std::string what = "PagedAttention cached=" + std::to_string(cached);
    EXPECT_LT(p.Compare(what.c_str(), out.first, out.second), kTol);

    const int Hk = 2, Hv = 4, D = 32, C = 2 * Hk * D + Hv * D;
    auto qkv = p.Make({T, C}, Random(rng, T * C));
    auto g = p.Make({T, Hv}, Random(rng, T * Hv, -0.3f, 0.0f), DType::kF32);
    auto beta = p.Make({T, Hv}, Random(rng, T * Hv, 0.0f, 1.0f), DType::kF32);
    auto state = p.Make({2, Hv, D, D}, Random(rng, 2 * Hv * D * D, -0.2f, 0.2f), DType::kF32);
    auto o = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
    DeltaRuleDims dims{Hk, Hv, D, D};
    p.cpu().GatedDeltaRule(qkv.first, g.first, beta.first, dims, state.first, segs,
                           DeltaRuleAlgorithm::kAuto, o.first);
    p.cuda().GatedDeltaRule(qkv.second, g.second, beta.second, dims, state.second, segs,
                            DeltaRuleAlgorithm::kAuto, o.second);
    EXPECT_LT(p.Compare("GatedDeltaRule T=130 (out)", o.first, o.second), kTol);
    EXPECT_LT(p.Compare("GatedDeltaRule T=130 (state)", state.first, state.second), kTol);
  }
}

// The composite ops (SiluMulLinear, GatedDeltaRuleWithGates, MoeExpertsWithShared) against the
// CPU backend, whose defaults run their parts one by one, and against the CUDA backend's own
// parts: where CUDA fuses (one or two rows, decode segments, few MoE pairs) and where it falls
// back (more rows, chunked prefill, many pairs).
TEST(CudaVsCpuTest, FusedOpsEqualTheirParts) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(23);
  auto host = [&](Backend& b, const Tensor& t) {
    std::vector<float> v(t.numel());
    b.CopyToHostF32(t, v.data());
    return v;
  };
  // SiluMulLinear: fused (skinny kernel) at 1 row, two ops at 2-9 rows (the tensor-core GEMV up
  // to 8); either way the same bits as SiluAndMul + Linear.
  for (int T : {1, 2, 5, 9}) {
    const int H = 256, I = 512;
    auto gu = p.Make({T, 2 * I}, Random(rng, T * 2 * I, -3, 3));
    auto w = p.Make({H, I}, Random(rng, H * I, -0.1f, 0.1f));
    auto act = p.Make({T, I}, std::vector<float>(T * I));
    auto out = p.Make({T, H}, std::vector<float>(T * H));
    p.cpu().SiluMulLinear(gu.first, w.first, act.first, out.first);
    p.cuda().SiluMulLinear(gu.second, w.second, act.second, out.second);
    const std::string what = "SiluMulLinear T=" + std::to_string(T);
    EXPECT_LT(p.Compare(what.c_str(), out.first, out.second), kTol);
    // The fused kernel rounds the activation as SiluAndMul stores it: the same bits as the parts.
    auto parts = p.Make({T, H}, std::vector<float>(T * H));
    p.cuda().SiluAndMul(gu.second, act.second);
    p.cuda().Linear(act.second, w.second, parts.second);
    EXPECT_EQ(host(p.cuda(), out.second), host(p.cuda(), parts.second)) << what;
  }
  {  // GatedDeltaRuleWithGates: decode (the gates inside the recurrent kernel) and a prefill mix
    const int Hk = 2, Hv = 4, D = 32, C = 2 * Hk * D + Hv * D;
    std::vector<int32_t> none;
    const std::vector<std::vector<SequenceSegment>> layouts = {
        {{0, 1, 5, 0, none}, {1, 1, 0, 2, none}, {2, 1, 9, 1, none}},
        {{0, 40, 3, 1, none}, {40, 1, 7, 0, none}, {41, 3, 0, 2, none}}};
    for (const auto& segs : layouts) {
      const int T = segs.back().token_begin + segs.back().num_tokens;
      auto qkv = p.Make({T, C}, Random(rng, T * C));
      auto a = p.Make({T, Hv}, Random(rng, T * Hv, -3, 3));
      auto b = p.Make({T, Hv}, Random(rng, T * Hv, -3, 3));
      auto a_log = p.Make({Hv}, Random(rng, Hv, 0, 2.5f));
      auto dt = p.Make({Hv}, Random(rng, Hv, -1, 1));
      const std::vector<float> state0 = Random(rng, 3 * Hv * D * D, -0.2f, 0.2f);
      auto state = p.Make({3, Hv, D, D}, state0, DType::kF32);
      auto g = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto beta = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto o = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
      DeltaRuleDims dims{Hk, Hv, D, D};
      p.cpu().GatedDeltaRuleWithGates(qkv.first, a.first, b.first, a_log.first, dt.first, dims,
                                      state.first, segs, DeltaRuleAlgorithm::kAuto, g.first,
                                      beta.first, o.first);
      p.cuda().GatedDeltaRuleWithGates(qkv.second, a.second, b.second, a_log.second, dt.second,
                                       dims, state.second, segs, DeltaRuleAlgorithm::kAuto,
                                       g.second, beta.second, o.second);
      const std::string what = "GatedDeltaRuleWithGates T=" + std::to_string(T);
      EXPECT_LT(p.Compare((what + " (out)").c_str(), o.first, o.second), kTol);
      EXPECT_LT(p.Compare((what + " (state)").c_str(), state.first, state.second), kTol);
      EXPECT_LT(p.Compare((what + " (g)").c_str(), g.first, g.second), kTol);
      EXPECT_LT(p.Compare((what + " (beta)").c_str(), beta.first, beta.second), kTol);
      // The CUDA parts from the same starting state: identical bits.
      auto state2 = p.Make({3, Hv, D, D}, state0, DType::kF32);
      auto g2 = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto beta2 = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto o2 = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
      p.cuda().DeltaRuleGates(a.second, b.second, a_log.second, dt.second, g2.second, beta2.second);
      p.cuda().GatedDeltaRule(qkv.second, g2.second, beta2.second, dims, state2.second, segs,
                              DeltaRuleAlgorithm::kAuto, o2.second);
      EXPECT_EQ(host(p.cuda(), o.second), host(p.cuda(), o2.second)) << what;
      EXPECT_EQ(host(p.cuda(), state.second), host(p.cuda(), state2.second)) << what;
      EXPECT_EQ(host(p.cuda(), g.second), host(p.cuda(), g2.second)) << what;
      EXPECT_EQ(host(p.cuda(), beta.second), host(p.cuda(), beta2.second)) << what;
    }
  }
  // MoeExpertsWithShared: few pairs (the shared term fused into the down kernel) at T = 1, 4, 8;
  // the grouped path (fused into the combine kernel) at T = 40; and an expert-parallel slice that
  // some tokens do not route to at all. The grouped path also at hidden sizes off the combine's
  // 4-wide form: H = 36 (4-wide combine, CUDA-core GEMMs: H is not a multiple of 8) and H = 30
  // (the scalar combine).
  const std::tuple<int, int, int> moe_cases[] = {{0, 1, 128},   {0, 4, 128},  {0, 8, 128},
                                                 {0, 40, 128},  {24, 1, 128}, {24, 8, 128},
                                                 {24, 40, 128}, {0, 24, 36},  {0, 24, 30}};
  for (const auto& [first, T, H] : moe_cases) {
    const int E = 16, k = 4, I = 64, bank = 40;
    std::vector<int32_t> ids_i(T * k);
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < k; ++j) ids_i[t * k + j] = (t * 7 + j * 9 + first) % bank;
    }
    auto x = p.Make({T, H}, Random(rng, T * H));
    auto ids = p.Make({T, k}, std::vector<float>(T * k), DType::kI32);
    p.cpu().CopyFromHost(ids_i.data(), DType::kI32, ids.first);
    p.cuda().CopyFromHost(ids_i.data(), DType::kI32, ids.second);
    auto wts = p.Make({T, k}, Random(rng, T * k, 0.05f, 0.5f), DType::kF32);
    auto gu = p.Make({E, 2 * I, H}, Random(rng, E * 2 * I * H, -0.1f, 0.1f));
    auto dn = p.Make({E, H, I}, Random(rng, E * H * I, -0.1f, 0.1f));
    auto shared = p.Make({T, H}, Random(rng, T * H));
    auto gate = p.Make({T, 1}, Random(rng, T, -3, 3));
    // out starts as garbage: the op writes it.
    auto out = p.Make({T, H}, Random(rng, T * H, -9, 9));
    p.cpu().MoeExpertsWithShared(x.first, ids.first, wts.first, gu.first, dn.first, first,
                                 shared.first, gate.first, out.first, {});
    p.cuda().MoeExpertsWithShared(x.second, ids.second, wts.second, gu.second, dn.second, first,
                                  shared.second, gate.second, out.second, {});
    const std::string what = "MoeExpertsWithShared T=" + std::to_string(T) +
                             " H=" + std::to_string(H) + " first=" + std::to_string(first);
    EXPECT_LT(p.Compare(what.c_str(), out.first, out.second), kTol);
    auto parts = p.Make({T, H}, std::vector<float>(T * H));
    p.cuda().MoeExperts(x.second, ids.second, wts.second, gu.second, dn.second, first, parts.second,
                        {});
    p.cuda().AddSigmoidScaled(parts.second, shared.second, gate.second);
    // The down kernel (T <= 8) and the combine (T = 40) round as the parts do: the same bits.
    EXPECT_EQ(host(p.cuda(), out.second), host(p.cuda(), parts.second)) << what;
    if (H != 128) continue;  // the shared-expert form below at the model's hidden size only

    // MoeExpertsWithSharedExpert: the shared expert's down projection inside the few-token
    // kernels at T = 1 and 4 (up to kMoeSharedExpertFusedMaxTokens; at 4 the gate-up
    // kernel's first wave takes the rows), the default's
    // SiluMulLinear + MoeExpertsWithShared at T = 8 (few-token kernels) and T = 40 (grouped).
    // Is = 1040: 4 rows x 130 pieces per block, more (row, piece) pairs than the block's 256
    // threads, so the kernel's loop over the pairs past each thread's first runs too.
    const int Is = 1040;
    auto sgu = p.Make({T, 2 * Is}, Random(rng, T * 2 * Is, -3, 3));
    auto sdn = p.Make({H, Is}, Random(rng, H * Is, -0.1f, 0.1f));
    auto sact = p.Make({T, Is}, std::vector<float>(T * Is));
    // The default writes the shared expert's output to this scratch; the fused kernel does not.
    constexpr float kUnwritten = 7.0f;
    auto sout = p.Make({T, H}, std::vector<float>(T * H, kUnwritten));
    auto out2 = p.Make({T, H}, Random(rng, T * H, -9, 9));
    const SharedExpertOperands cpu_shared{sgu.first, sdn.first, gate.first, sact.first, sout.first};
    const SharedExpertOperands cuda_shared{sgu.second, sdn.second, gate.second, sact.second,
                                           sout.second};
    p.cpu().MoeExpertsWithSharedExpert(x.first, ids.first, wts.first, gu.first, dn.first, first,
                                       cpu_shared, out2.first, {});
    p.cuda().MoeExpertsWithSharedExpert(x.second, ids.second, wts.second, gu.second, dn.second,
                                        first, cuda_shared, out2.second, {});
    const std::string what2 =
        "MoeExpertsWithSharedExpert T=" + std::to_string(T) + " first=" + std::to_string(first);
    EXPECT_LT(p.Compare(what2.c_str(), out2.first, out2.second), kTol);
    // Which path ran: fused up to kMoeSharedExpertFusedMaxTokens tokens (or the count
    // MOBIUS_MOE_SHARED_EXPERT sets, read as the backend reads it), else the parts.
    const int fused_max =
        cuda::KnobInt("MOBIUS_MOE_SHARED_EXPERT", cuda::kMoeSharedExpertFusedMaxTokens, 0, 1 << 20);
    {
      const std::vector<float> scratch = host(p.cuda(), sout.second);
      const bool untouched =
          std::all_of(scratch.begin(), scratch.end(), [](float v) { return v == kUnwritten; });
      EXPECT_EQ(untouched, T <= fused_max) << what2 << ": the shared expert's scratch output";
    }
    // RoutedMoeWithSharedExpert from router logits over the whole bank: at
    // kMoeSharedBesideTopKMinTokens to kMoeSharedBesideTopKMaxTokens tokens (T = 4 and 8 here)
    // extra blocks of the top-k's grid write the shared expert's rows into its scratch output;
    // elsewhere the default (TopKSoftmax, then MoeExpertsWithSharedExpert as above). Is = 512:
    // one (row, piece) pair per thread there.
    {
      const int Ir = 512;
      auto logits = p.Make({T, bank}, Random(rng, T * bank, -2, 2), DType::kF32);
      auto rids = p.Make({T, k}, std::vector<float>(T * k), DType::kI32);
      auto rwts = p.Make({T, k}, std::vector<float>(T * k), DType::kF32);
      auto rgu = p.Make({T, 2 * Ir}, Random(rng, T * 2 * Ir, -3, 3));
      auto rdn = p.Make({H, Ir}, Random(rng, H * Ir, -0.1f, 0.1f));
      auto ract = p.Make({T, Ir}, std::vector<float>(T * Ir));
      auto rsout = p.Make({T, H}, std::vector<float>(T * H, kUnwritten));
      auto out3 = p.Make({T, H}, Random(rng, T * H, -9, 9));
      const SharedExpertOperands cpu_r{rgu.first, rdn.first, gate.first, ract.first, rsout.first};
      const SharedExpertOperands cuda_r{rgu.second, rdn.second, gate.second, ract.second,
                                        rsout.second};
      p.cpu().RoutedMoeWithSharedExpert(x.first, logits.first, k, true, rids.first, rwts.first,
                                        gu.first, dn.first, first, cpu_r, out3.first, {});
      p.cuda().RoutedMoeWithSharedExpert(x.second, logits.second, k, true, rids.second, rwts.second,
                                         gu.second, dn.second, first, cuda_r, out3.second, {});
      const std::string what3 =
          "RoutedMoeWithSharedExpert T=" + std::to_string(T) + " first=" + std::to_string(first);
      std::vector<int32_t> cpu_ids(T * k), cuda_ids(T * k);
      p.cpu().CopyToHostI32(rids.first, cpu_ids.data());
      p.cuda().CopyToHostI32(rids.second, cuda_ids.data());
      EXPECT_EQ(cpu_ids, cuda_ids) << what3;
      EXPECT_LT(p.Compare((what3 + " (weights)").c_str(), rwts.first, rwts.second), kTol);
      EXPECT_LT(p.Compare(what3.c_str(), out3.first, out3.second), kTol);
      // Which path ran, read as the backend reads its knob (0 unset, 1 auto, 2 on, 3 off).
      const int form = cuda::KnobChoice("MOBIUS_MOE_SHARED_BESIDE_TOPK", {"auto", "on", "off"});
      const bool beside = T <= cuda::kMoeSharedBesideTopKMaxTokens &&
                          (form == 2 || (form < 2 && T >= cuda::kMoeSharedBesideTopKMinTokens));
      const std::vector<float> scratch = host(p.cuda(), rsout.second);
      const bool untouched =
          std::all_of(scratch.begin(), scratch.end(), [](float v) { return v == kUnwritten; });
      EXPECT_EQ(untouched, !beside && T <= fused_max) << what3 << ": the shared scratch output";
      if (!untouched) {
        EXPECT_LT(p.Compare((what3 + " (shared rows)").c_str(), rsout.first, rsout.second), kTol);
      }
    }
    // Against the CUDA parts where the fused path ran (elsewhere the op is those parts): the
    // shared projection sums in its own order, so within a bf16 rounding step of the parts
    // rather than bit-equal.
    if (T > fused_max) continue;
    auto parts2 = p.Make({T, H}, std::vector<float>(T * H));
    p.cuda().SiluMulLinear(sgu.second, sdn.second, sact.second, sout.second);
    p.cuda().MoeExpertsWithShared(x.second, ids.second, wts.second, gu.second, dn.second, first,
                                  sout.second, gate.second, parts2.second, {});
    const std::vector<float> fused = host(p.cuda(), out2.second),
                             split = host(p.cuda(), parts2.second);
    double diff = 0, ref = 0;
    for (size_t i = 0; i < fused.size(); ++i) {
      diff = std::max(diff, double(std::fabs(fused[i] - split[i])));
      ref = std::max(ref, double(std::fabs(split[i])));
    }
    EXPECT_LT(diff, 1e-2 * ref) << what2 << ": fused vs the CUDA parts";
  }
}

// The attention layer's fused steps: QkNormRopeWriteKv (the norm + RoPE kernel also storing the
// step's keys and values into the paged caches) and GatedPagedAttention (the output gate applied
// where the decode kernels write the output, one split or several). Against the CPU backend's
// parts, and against the CUDA parts on the same inputs: the same bits. Decode steps (one token a
// sequence, short and long contexts), a verify step (five tokens a sequence) and a prefill, at
// head dims 64 (the fixtures), 128 and 256 (the release config).
TEST(CudaVsCpuTest, GatedAttentionStepsEqualTheirParts) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(31);
  auto host = [&](Backend& b, const Tensor& t) {
    std::vector<float> v(t.numel());
    b.CopyToHostF32(t, v.data());
    return v;
  };
  struct Dims {
    int nh, nkv, hd, rotary;
  };
  struct Layout {
    const char* name;
    std::vector<std::pair<int, int>> seqs;  // (tokens this step, cached before it)
  };
  const std::vector<Layout> layouts = {{"decode", {{1, 5}, {1, 0}, {1, 37}}},
                                       {"decode-long", {{1, 1500}, {1, 700}}},
                                       {"verify", {{5, 20}, {5, 300}}},
                                       {"prefill", {{40, 0}, {3, 17}}}};
  const int bs = 16;
  for (const Dims d : {Dims{4, 2, 64, 16}, Dims{8, 2, 128, 32}, Dims{16, 2, 256, 64}}) {
    for (const Layout& layout : layouts) {
      // Each sequence gets its own run of blocks, enough for its positions.
      std::vector<std::vector<int32_t>> tables;
      int blocks = 0;
      for (const auto& [n, cached] : layout.seqs) {
        std::vector<int32_t> table((cached + n + bs - 1) / bs);
        std::iota(table.begin(), table.end(), blocks);
        std::reverse(table.begin(), table.end());  // not in position order
        blocks += static_cast<int>(table.size());
        tables.push_back(std::move(table));
      }
      std::vector<SequenceSegment> segs;
      int T = 0;
      for (size_t i = 0; i < layout.seqs.size(); ++i) {
        segs.push_back({T, layout.seqs[i].first, layout.seqs[i].second, -1, tables[i]});
        T += layout.seqs[i].first;
      }
      const std::string what =
          std::string(layout.name) + " nh=" + std::to_string(d.nh) + " hd=" + std::to_string(d.hd);
      const int64_t cache_elems = int64_t{blocks} * bs * d.nkv * d.hd;
      const std::vector<float> qg0 = Random(rng, int64_t{T} * d.nh * 2 * d.hd, -2, 2);
      const std::vector<float> k0 = Random(rng, int64_t{T} * d.nkv * d.hd, -2, 2);
      const std::vector<float> v0 = Random(rng, int64_t{T} * d.nkv * d.hd);
      const std::vector<float> kc0 = Random(rng, cache_elems), vc0 = Random(rng, cache_elems);
      const std::vector<float> qn0 = Random(rng, d.hd, -0.3f, 0.3f);
      const std::vector<float> kn0 = Random(rng, d.hd, -0.3f, 0.3f);
      const RopeParams rope{d.rotary, 10000.f};
      const float scale = 1.0f / std::sqrt(static_cast<float>(d.hd));
      const std::vector<float> zeros(int64_t{T} * d.nh * d.hd);
      // Fused on both backends (the CPU backend runs the parts).
      auto qg = p.Make({T, d.nh, 2 * d.hd}, qg0);
      auto k = p.Make({T, d.nkv, d.hd}, k0);
      auto v = p.Make({T, d.nkv, d.hd}, v0);
      auto kc = p.Make({blocks, bs, d.nkv, d.hd}, kc0);
      auto vc = p.Make({blocks, bs, d.nkv, d.hd}, vc0);
      auto qn = p.Make({d.hd}, qn0);
      auto kn = p.Make({d.hd}, kn0);
      auto q = p.Make({T, d.nh, d.hd}, zeros);
      auto gate = p.Make({T, d.nh, d.hd}, zeros);
      auto out = p.Make({T, d.nh, d.hd}, zeros);
      p.cpu().QkNormRopeWriteKv(qg.first, k.first, v.first, qn.first, kn.first, 1e-6f, rope, segs,
                                q.first, gate.first, kc.first, vc.first);
      p.cuda().QkNormRopeWriteKv(qg.second, k.second, v.second, qn.second, kn.second, 1e-6f, rope,
                                 segs, q.second, gate.second, kc.second, vc.second);
      p.cpu().GatedPagedAttention(q.first, gate.first, kc.first, vc.first, segs, scale, out.first);
      p.cuda().GatedPagedAttention(q.second, gate.second, kc.second, vc.second, segs, scale,
                                   out.second);
      EXPECT_LT(p.Compare((what + " q").c_str(), q.first, q.second), kTol);
      EXPECT_LT(p.Compare((what + " k cache").c_str(), kc.first, kc.second), kTol);
      EXPECT_LT(p.Compare((what + " v cache").c_str(), vc.first, vc.second), kTol);
      EXPECT_LT(p.Compare((what + " gated out").c_str(), out.first, out.second), kTol);
      // The CUDA parts on the same inputs.
      auto qg2 = p.Make({T, d.nh, 2 * d.hd}, qg0);
      auto k2 = p.Make({T, d.nkv, d.hd}, k0);
      auto v2 = p.Make({T, d.nkv, d.hd}, v0);
      auto kc2 = p.Make({blocks, bs, d.nkv, d.hd}, kc0);
      auto vc2 = p.Make({blocks, bs, d.nkv, d.hd}, vc0);
      auto q2 = p.Make({T, d.nh, d.hd}, zeros);
      auto gate2 = p.Make({T, d.nh, d.hd}, zeros);
      auto out2 = p.Make({T, d.nh, d.hd}, zeros);
      p.cuda().QkNormRope(qg2.second, k2.second, qn.second, kn.second, 1e-6f, rope, segs, q2.second,
                          gate2.second);
      p.cuda().WriteKvCache(k2.second, v2.second, segs, kc2.second, vc2.second);
      p.cuda().PagedAttention(q2.second, kc2.second, vc2.second, segs, scale, out2.second);
      p.cuda().MulSigmoid(out2.second, gate2.second);
      EXPECT_EQ(host(p.cuda(), q.second), host(p.cuda(), q2.second)) << what << " q";
      EXPECT_EQ(host(p.cuda(), gate.second), host(p.cuda(), gate2.second)) << what << " gate";
      EXPECT_EQ(host(p.cuda(), k.second), host(p.cuda(), k2.second)) << what << " k";
      EXPECT_EQ(host(p.cuda(), kc.second), host(p.cuda(), kc2.second)) << what << " k cache";
      EXPECT_EQ(host(p.cuda(), vc.second), host(p.cuda(), vc2.second)) << what << " v cache";
      EXPECT_EQ(host(p.cuda(), out.second), host(p.cuda(), out2.second)) << what << " gated out";
    }
  }
}

// GatedDeltaNetMixer: the CUDA backend runs a decode or verify step (every segment 1 to 8 tokens)
// as one clustered kernel at Dk = Dv in {32, 64, 128} with Hv = 2 Hk (the fixtures' and the
// release shapes), and anything else through its parts. Against the CPU backend, and against the
// CUDA parts from the same states: the same bits.
TEST(CudaVsCpuTest, DeltaNetMixerDecodeStep) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(31);
  auto host = [&](const Tensor& t) { return p.CudaHost(t); };
  std::vector<int32_t> none;
  const std::vector<std::vector<SequenceSegment>> layouts = {
      {{0, 1, 7, 2, none}},
      {{0, 1, 5, 3, none},
       {1, 1, 0, 0, none},
       {2, 1, 9, -1, none},
       {3, 1, 2, 4, none},
       {4, 1, 1, 1, none}},
      {{0, 3, 4, 1, none}, {3, 1, 8, 3, none}},   // a 3-token segment beside a 1-token one
      {{0, 5, 11, 2, none}},                      // a verify step of 4 drafts
      {{0, 9, 0, 1, none}, {9, 2, 6, 4, none}}};  // 9 tokens: more than the step takes
  // 17 sequences run the parts (UseDeltaNetDecodeStep); 130, every other one without a slot,
  // the one-launch step in the delta rule's layout without split rows.
  std::vector<SequenceSegment> seventeen, many;
  for (int i = 0; i < 17; ++i) seventeen.push_back({i, 1, 3 + i, i < 16 ? i : -1, none});
  for (int i = 0; i < 130; ++i) many.push_back({i, 1, 3 + i, i % 2 == 0 ? i / 2 : -1, none});
  for (const auto& [Hk, D] : std::vector<std::pair<int, int>>{{2, 32}, {4, 64}, {16, 128}}) {
    const int Hv = 2 * Hk, C = 2 * Hk * D + Hv * D, slots = 65;
    std::vector<std::vector<SequenceSegment>> cases = layouts;
    cases.push_back(seventeen);
    cases.push_back(many);
    for (const auto& segs : cases) {
      const int T = segs.back().token_begin + segs.back().num_tokens;
      const std::string what = "GatedDeltaNetMixer D=" + std::to_string(D) +
                               " T=" + std::to_string(T) +
                               " segments=" + std::to_string(segs.size());
      auto [mixed, z, a, b, conv_w, a_log, dt, norm_w, conv0, state0] =
          RandomMixerInputs(p, rng, T, Hk, D, slots);
      auto conv_states = p.Make({slots, C, 3}, conv0, DType::kF32);
      auto states = p.Make({slots, Hv, D, D}, state0, DType::kF32);
      auto g = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto beta = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      // The scratch starts as a sentinel: the one-launch step leaves it, the parts overwrite it.
      constexpr float kSentinel = 7.0f;
      auto conv_out = p.Make({T, C}, std::vector<float>(T * C, kSentinel));
      auto core = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D, kSentinel));
      auto out = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
      const DeltaRuleDims dims{Hk, Hv, D, D};
      // Where the step should run: 1 to 8 tokens per segment, a block of D / 4 columns holding
      // the delta rule's layout (16 columns from 4 sequences), and the batches of
      // UseDeltaNetDecodeStep (below 16 and from 128).
      const int n = static_cast<int>(segs.size());
      const bool short_segments = std::all_of(
          segs.begin(), segs.end(),
          [](const SequenceSegment& s) { return s.num_tokens <= cuda::kMaxDeltaNetStepTokens; });
      const bool expect_step = short_segments && (D >= 64 || n < 4) && (n < 16 || n >= 128);
      // Knobs that force either path or another delta rule layout change where the step runs
      // (not its bits): the sentinel check holds for the defaults only.
      const bool defaults = std::getenv("MOBIUS_DELTANET_STEP") == nullptr &&
                            std::getenv("MOBIUS_DELTA_RULE_COLS") == nullptr &&
                            std::getenv("MOBIUS_DELTA_RULE_SPLIT") == nullptr &&
                            std::getenv("MOBIUS_DELTA_RULE_GENERIC") == nullptr;
      const float eps = 1e-6f;
      p.cpu().GatedDeltaNetMixer({mixed.first, z.first, a.first, b.first, conv_w.first, a_log.first,
                                  dt.first, norm_w.first, eps, dims, conv_states.first,
                                  states.first, g.first, beta.first, conv_out.first, core.first},
                                 segs, DeltaRuleAlgorithm::kAuto, out.first);
      p.cuda().GatedDeltaNetMixer(
          {mixed.second, z.second, a.second, b.second, conv_w.second, a_log.second, dt.second,
           norm_w.second, eps, dims, conv_states.second, states.second, g.second, beta.second,
           conv_out.second, core.second},
          segs, DeltaRuleAlgorithm::kAuto, out.second);
      // The output passes two bf16 roundings (the conv's and the delta rule's stored outputs) that
      // the fp32 CPU backend does not make, before a normalisation that scales them up where a
      // head's rows are small: 3e-2 here; the CUDA parts below are held to a bf16 step.
      EXPECT_LT(p.Compare((what + " (out)").c_str(), out.first, out.second), 3e-2);
      EXPECT_LT(p.Compare((what + " (conv states)").c_str(), conv_states.first, conv_states.second),
                kTol);
      EXPECT_LT(p.Compare((what + " (states)").c_str(), states.first, states.second), kTol);
      EXPECT_LT(p.Compare((what + " (g)").c_str(), g.first, g.second), kTol);
      EXPECT_LT(p.Compare((what + " (beta)").c_str(), beta.first, beta.second), kTol);

      const std::vector<float> scratch = host(conv_out.second);
      const bool untouched =
          std::all_of(scratch.begin(), scratch.end(), [](float v) { return v == kSentinel; });
      if (defaults) {
        EXPECT_EQ(untouched, expect_step)
            << what << ": the one-launch step " << (expect_step ? "did not run" : "ran");
      }
      // The CUDA parts from the same starting states.
      auto conv_states2 = p.Make({slots, C, 3}, conv0, DType::kF32);
      auto states2 = p.Make({slots, Hv, D, D}, state0, DType::kF32);
      auto g2 = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto beta2 = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto out2 = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
      p.cuda().CausalConv1dSilu(mixed.second, conv_w.second, conv_states2.second, segs,
                                conv_out.second);
      p.cuda().GatedDeltaRuleWithGates(conv_out.second, a.second, b.second, a_log.second, dt.second,
                                       dims, states2.second, segs, DeltaRuleAlgorithm::kAuto,
                                       g2.second, beta2.second, core.second);
      Tensor heads_out = out2.second.Reshape({T * Hv, D});
      p.cuda().GatedRmsNorm(core.second.Reshape({T * Hv, D}), z.second.Reshape({T * Hv, D}),
                            norm_w.second, eps, heads_out);
      EXPECT_EQ(host(conv_states.second), host(conv_states2.second)) << what;
      EXPECT_EQ(host(g.second), host(g2.second)) << what;
      EXPECT_EQ(host(beta.second), host(beta2.second)) << what;
      // The one-launch step keeps the parts' reduction orders (the delta rule's layout for this
      // many sequences, the norm's piece tree): which of the two a step takes depends on its
      // batch and token counts, and greedy tokens must not (a verify step's must equal a plain
      // decode step's).
      EXPECT_EQ(host(states2.second), host(states.second)) << what;
      EXPECT_EQ(host(out2.second), host(out.second)) << what;
      // Slots that no segment names (a segment of slot -1 has no state) keep their states.
      std::vector<bool> named(slots, false);
      for (const SequenceSegment& seg : segs) {
        if (seg.state_slot >= 0) named[seg.state_slot] = true;
      }
      const std::vector<float> after = host(states.second);
      const size_t per_slot = static_cast<size_t>(Hv) * D * D;
      for (int s = 0; s < slots; ++s) {
        if (named[s]) continue;
        EXPECT_TRUE(std::equal(after.begin() + s * per_slot, after.begin() + (s + 1) * per_slot,
                               state0.begin() + s * per_slot))
            << what << ": slot " << s << " changed";
      }
    }
  }
}

// Speculative decoding's rollback (Backend::ReplayDeltaRuleStates): the CUDA backend's one-launch
// replay of every layer against the CPU reference, and bit for bit against the separate CUDA
// kernels that the base class runs (Backend's default, called on the CUDA backend) and against a
// verify step of only the replayed tokens: a rolled-back state must be the one a step of the
// accepted tokens would have left.
TEST(CudaVsCpuTest, ReplayDeltaRuleStates) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(37);
  auto host = [&](const Tensor& t) { return p.CudaHost(t); };
  auto seg = [](int begin, int n, int slot) {
    SequenceSegment s;
    s.token_begin = begin;
    s.num_tokens = n;
    s.cached_tokens = 5;
    s.state_slot = slot;
    return s;
  };
  const int rows = 24;
  std::vector<std::vector<SequenceSegment>> cases = {
      {seg(0, 1, 2)},
      {seg(5, 4, 0), seg(12, 1, 3), seg(1, 3, 6)},  // out of order, with gaps between them
      {seg(16, 8, 1)},                              // the most a step takes
      {seg(3, 9, 1)},                               // more: the separate kernels run
  };
  std::vector<SequenceSegment> five, seventeen;
  for (int i = 0; i < 5; ++i) five.push_back(seg(4 * i, 2, 9 - i));
  for (int i = 0; i < 17; ++i) seventeen.push_back(seg(i, 1 + i % 3, 20 - i));
  cases.push_back(five);
  cases.push_back(seventeen);
  const bool defaults = std::getenv("MOBIUS_DELTA_RULE_COLS") == nullptr &&
                        std::getenv("MOBIUS_DELTA_RULE_SPLIT") == nullptr &&
                        std::getenv("MOBIUS_DELTA_RULE_GENERIC") == nullptr;
  // 34 layers at D = 32: more than one launch takes (kMaxReplayLayers).
  for (const auto& [Hk, D, L] :
       std::vector<std::tuple<int, int, int>>{{2, 32, 34}, {4, 64, 3}, {16, 128, 2}}) {
    const int Hv = 2 * Hk, C = 2 * Hk * D + Hv * D, slots = 21;
    struct Layer {
      std::pair<Tensor, Tensor> mixed, g, beta, conv_w, conv, state;
      std::vector<float> g_host, beta_host;
    };
    std::vector<Layer> layers(L);
    std::vector<std::vector<float>> conv0(L), state0(L);
    for (int l = 0; l < L; ++l) {
      Layer& y = layers[l];
      y.mixed = p.Make({rows, C}, Random(rng, rows * C, -2, 2));
      y.g_host = Random(rng, rows * Hv, 0.1f, 4.0f);
      for (float& v : y.g_host) v = -v;  // a decay's log: negative
      y.beta_host = Random(rng, rows * Hv, 0.05f, 0.95f);
      y.g = p.Make({rows, Hv}, y.g_host, DType::kF32);
      y.beta = p.Make({rows, Hv}, y.beta_host, DType::kF32);
      y.conv_w = p.Make({C, 4}, Random(rng, C * 4, -0.5f, 0.5f));
      conv0[l] = Random(rng, slots * C * 3, -2, 2);
      state0[l] = Random(rng, slots * Hv * D * D, -0.2f, 0.2f);
    }
    const DeltaRuleDims dims{Hk, Hv, D, D};
    for (const auto& segs : cases) {
      const std::string what = "Replay D=" + std::to_string(D) + " layers=" + std::to_string(L) +
                               " segments=" + std::to_string(segs.size()) +
                               " first=" + std::to_string(segs[0].num_tokens);
      std::vector<DeltaRuleReplayLayer> cpu_layers, cuda_layers, base_layers;
      std::vector<std::pair<Tensor, Tensor>> conv(L), state(L), conv_b(L), state_b(L);
      for (int l = 0; l < L; ++l) {
        Layer& y = layers[l];
        conv[l] = p.Make({slots, C, 3}, conv0[l], DType::kF32);
        state[l] = p.Make({slots, Hv, D, D}, state0[l], DType::kF32);
        conv_b[l] = p.Make({slots, C, 3}, conv0[l], DType::kF32);
        state_b[l] = p.Make({slots, Hv, D, D}, state0[l], DType::kF32);
        cpu_layers.push_back({&y.mixed.first, &y.g.first, &y.beta.first, &y.conv_w.first,
                              &conv[l].first, &state[l].first});
        cuda_layers.push_back({&y.mixed.second, &y.g.second, &y.beta.second, &y.conv_w.second,
                               &conv[l].second, &state[l].second});
        base_layers.push_back({&y.mixed.second, &y.g.second, &y.beta.second, &y.conv_w.second,
                               &conv_b[l].second, &state_b[l].second});
      }
      ASSERT_TRUE(p.cpu().ReplayDeltaRuleStates(cpu_layers, dims, segs).ok()) << what;
      ASSERT_TRUE(p.cuda().ReplayDeltaRuleStates(cuda_layers, dims, segs).ok()) << what;
      ASSERT_TRUE(p.cuda().Backend::ReplayDeltaRuleStates(base_layers, dims, segs).ok()) << what;
      for (int l = 0; l < L; ++l) {
        const std::string at = what + " layer " + std::to_string(l);
        if (l == 0 || l == L - 1) {
          EXPECT_LT(p.Compare((at + " (conv states)").c_str(), conv[l].first, conv[l].second),
                    kTol);
          EXPECT_LT(p.Compare((at + " (states)").c_str(), state[l].first, state[l].second), kTol);
        }
        EXPECT_EQ(host(conv[l].second), host(conv_b[l].second)) << at;
        if (defaults) {
          EXPECT_EQ(host(state[l].second), host(state_b[l].second)) << at;
        }
        // Slots no segment names keep their states.
        std::vector<bool> named(slots, false);
        for (const SequenceSegment& s : segs) named[s.state_slot] = true;
        const std::vector<float> after = host(state[l].second);
        const std::vector<float> conv_after = host(conv[l].second);
        const size_t per_slot = static_cast<size_t>(Hv) * D * D;
        const size_t conv_per_slot = static_cast<size_t>(C) * 3;
        for (int s = 0; s < slots; ++s) {
          if (named[s]) continue;
          EXPECT_TRUE(std::equal(after.begin() + s * per_slot, after.begin() + (s + 1) * per_slot,
                                 state0[l].begin() + s * per_slot))
              << at << ": slot " << s << " changed";
          EXPECT_TRUE(std::equal(conv_after.begin() + s * conv_per_slot,
                                 conv_after.begin() + (s + 1) * conv_per_slot,
                                 conv0[l].begin() + s * conv_per_slot))
              << at << ": conv slot " << s << " changed";
        }
      }
      // One sequence of up to 8 tokens: a verify step of those tokens alone (the one-launch step,
      // its gates made from a and b) leaves the replay's bits when the replay is handed the gates
      // that step computed, as the engine's kept inputs are.
      if (segs.size() == 1 && segs[0].num_tokens <= cuda::kMaxDeltaNetStepTokens && defaults &&
          std::getenv("MOBIUS_DELTANET_STEP") == nullptr) {
        const int n = segs[0].num_tokens, l = L - 1;
        Layer& y = layers[l];
        const std::vector<float> all = host(y.mixed.second);
        std::vector<float> rows_of(all.begin() + segs[0].token_begin * C,
                                   all.begin() + (segs[0].token_begin + n) * C);
        auto mixed = p.Make({n, C}, rows_of);
        auto z = p.Make({n, Hv * D}, Random(rng, n * Hv * D, -2, 2));
        auto a = p.Make({n, Hv}, Random(rng, n * Hv, -3, 3));
        auto b = p.Make({n, Hv}, Random(rng, n * Hv, -3, 3));
        auto a_log = p.Make({Hv}, Random(rng, Hv, 0, 2.5f));
        auto dt = p.Make({Hv}, Random(rng, Hv, -1, 1));
        auto norm_w = p.Make({D}, Random(rng, D, 0.5f, 1.5f));
        auto conv_s = p.Make({slots, C, 3}, conv0[l], DType::kF32);
        auto state_s = p.Make({slots, Hv, D, D}, state0[l], DType::kF32);
        auto g = p.Make({n, Hv}, std::vector<float>(n * Hv), DType::kF32);
        auto beta = p.Make({n, Hv}, std::vector<float>(n * Hv), DType::kF32);
        auto conv_out = p.Make({n, C}, std::vector<float>(n * C));
        auto core = p.Make({n, Hv * D}, std::vector<float>(n * Hv * D));
        auto out = p.Make({n, Hv * D}, std::vector<float>(n * Hv * D));
        std::vector<SequenceSegment> step = {seg(0, n, segs[0].state_slot)};
        p.cuda().GatedDeltaNetMixer(
            {mixed.second, z.second, a.second, b.second, y.conv_w.second, a_log.second, dt.second,
             norm_w.second, 1e-6f, dims, conv_s.second, state_s.second, g.second, beta.second,
             conv_out.second, core.second},
            step, DeltaRuleAlgorithm::kAuto, out.second);
        // The replay from the same start with the step's own gates at the kept rows.
        std::vector<float> g_rows = y.g_host, beta_rows = y.beta_host;
        const std::vector<float> gs = host(g.second), bs = host(beta.second);
        std::copy(gs.begin(), gs.end(), g_rows.begin() + segs[0].token_begin * Hv);
        std::copy(bs.begin(), bs.end(), beta_rows.begin() + segs[0].token_begin * Hv);
        auto g_kept = p.Make({rows, Hv}, g_rows, DType::kF32);
        auto beta_kept = p.Make({rows, Hv}, beta_rows, DType::kF32);
        auto conv_r = p.Make({slots, C, 3}, conv0[l], DType::kF32);
        auto state_r = p.Make({slots, Hv, D, D}, state0[l], DType::kF32);
        const std::vector<DeltaRuleReplayLayer> one = {{&y.mixed.second, &g_kept.second,
                                                        &beta_kept.second, &y.conv_w.second,
                                                        &conv_r.second, &state_r.second}};
        ASSERT_TRUE(p.cuda().ReplayDeltaRuleStates(one, dims, segs).ok()) << what;
        EXPECT_EQ(host(conv_r.second), host(conv_s.second)) << what << " (verify step)";
        EXPECT_EQ(host(state_r.second), host(state_s.second)) << what << " (verify step)";
      }
    }
  }
}

// A step that writes its states to other slots (SequenceSegment::state_out_slot, a speculative
// verify step's spare slot) leaves the bits of the in-place step there, and its state slots as
// they were: the one-launch step, the parts (the conv kernels, the recurrent delta rule at 17
// sequences, the chunked one for a 20-token segment) and the CPU reference.
TEST(CudaVsCpuTest, StepsWriteStatesToOutSlots) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  std::mt19937 rng(47);
  auto host = [&](const Tensor& t) { return p.CudaHost(t); };
  auto cpu_host = [&](const Tensor& t) {
    std::vector<float> v(t.numel());
    p.cpu().CopyToHostF32(t, v.data());
    return v;
  };
  std::vector<int32_t> none;
  std::vector<std::vector<SequenceSegment>> cases = {
      {{0, 1, 7, 2, none}},                                          // decode, batch 1
      {{0, 5, 11, 2, none}},                                         // a verify step of 4 drafts
      {{0, 3, 4, 1, none}, {3, 1, 8, 3, none}, {4, 4, 2, 0, none}},  // mixed lengths
      {{0, 20, 5, 2, none}, {20, 2, 9, 4, none}}};                   // chunked beside recurrent
  std::vector<SequenceSegment> seventeen;
  for (int i = 0; i < 17; ++i) seventeen.push_back({2 * i, 2, 3 + i, i < 16 ? i : -1, none});
  cases.push_back(seventeen);
  constexpr int kSlots = 20, kOut = 20;  // slot s writes to s + kOut
  for (const auto& [Hk, D] : std::vector<std::pair<int, int>>{{2, 32}, {16, 128}}) {
    const int Hv = 2 * Hk, C = 2 * Hk * D + Hv * D, slots = kSlots + kOut;
    const DeltaRuleDims dims{Hk, Hv, D, D};
    for (const auto& in_place : cases) {
      std::vector<SequenceSegment> moved = in_place;
      for (SequenceSegment& seg : moved) {
        if (seg.state_slot >= 0) seg.state_out_slot = seg.state_slot + kOut;
      }
      const int T = in_place.back().token_begin + in_place.back().num_tokens;
      const std::string what = "D=" + std::to_string(D) + " T=" + std::to_string(T) +
                               " segments=" + std::to_string(in_place.size());
      auto [mixed, z, a, b, conv_w, a_log, dt, norm_w, conv0, state0] =
          RandomMixerInputs(p, rng, T, Hk, D, slots);
      const float eps = 1e-6f;
      struct Run {
        std::pair<Tensor, Tensor> conv, states, g, beta, out;
      };
      // The mixer on both backends, from the same starting states.
      auto mixer = [&](std::span<const SequenceSegment> segs) {
        Run r{p.Make({slots, C, 3}, conv0, DType::kF32),
              p.Make({slots, Hv, D, D}, state0, DType::kF32),
              p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32),
              p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32),
              p.Make({T, Hv * D}, std::vector<float>(T * Hv * D))};
        auto conv_out = p.Make({T, C}, std::vector<float>(T * C));
        auto core = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
        p.cpu().GatedDeltaNetMixer(
            {mixed.first, z.first, a.first, b.first, conv_w.first, a_log.first, dt.first,
             norm_w.first, eps, dims, r.conv.first, r.states.first, r.g.first, r.beta.first,
             conv_out.first, core.first},
            segs, DeltaRuleAlgorithm::kAuto, r.out.first);
        p.cuda().GatedDeltaNetMixer(
            {mixed.second, z.second, a.second, b.second, conv_w.second, a_log.second, dt.second,
             norm_w.second, eps, dims, r.conv.second, r.states.second, r.g.second, r.beta.second,
             conv_out.second, core.second},
            segs, DeltaRuleAlgorithm::kAuto, r.out.second);
        return r;
      };
      const Run base = mixer(in_place);
      const Run out = mixer(moved);
      // Slot by slot: each out slot holds what the in-place step left in its state slot, the
      // state slots and every other slot hold their starting values.
      auto check = [&](const std::vector<float>& step, const std::vector<float>& reference,
                       const std::vector<float>& start, size_t per_slot, const std::string& name) {
        std::vector<int> source(slots, -1);  // the slot whose in-place result an out slot holds
        for (const SequenceSegment& seg : moved) {
          if (seg.state_slot >= 0) source[seg.state_out_slot] = seg.state_slot;
        }
        for (int s = 0; s < slots; ++s) {
          const float* want = source[s] >= 0 ? reference.data() + source[s] * per_slot
                                             : start.data() + s * per_slot;
          EXPECT_TRUE(std::equal(want, want + per_slot, step.begin() + s * per_slot))
              << what << " " << name << ": slot " << s
              << (source[s] >= 0 ? " (an out slot)" : " (not written)");
        }
      };
      const size_t conv_slot = static_cast<size_t>(C) * 3, state_slot = size_t{1} * Hv * D * D;
      check(host(out.conv.second), host(base.conv.second), conv0, conv_slot, "cuda conv states");
      check(host(out.states.second), host(base.states.second), state0, state_slot, "cuda states");
      check(cpu_host(out.conv.first), cpu_host(base.conv.first), conv0, conv_slot,
            "cpu conv states");
      check(cpu_host(out.states.first), cpu_host(base.states.first), state0, state_slot,
            "cpu states");
      EXPECT_EQ(host(out.out.second), host(base.out.second)) << what;
      EXPECT_EQ(host(out.g.second), host(base.g.second)) << what;
      EXPECT_EQ(cpu_host(out.out.first), cpu_host(base.out.first)) << what;
      // And the CUDA parts called one by one (the one-launch step takes some of these cases).
      auto conv2 = p.Make({slots, C, 3}, conv0, DType::kF32);
      auto states2 = p.Make({slots, Hv, D, D}, state0, DType::kF32);
      auto g2 = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto beta2 = p.Make({T, Hv}, std::vector<float>(T * Hv), DType::kF32);
      auto conv_out2 = p.Make({T, C}, std::vector<float>(T * C));
      auto core2 = p.Make({T, Hv * D}, std::vector<float>(T * Hv * D));
      p.cuda().CausalConv1dSilu(mixed.second, conv_w.second, conv2.second, moved, conv_out2.second);
      p.cuda().GatedDeltaRuleWithGates(
          conv_out2.second, a.second, b.second, a_log.second, dt.second, dims, states2.second,
          moved, DeltaRuleAlgorithm::kAuto, g2.second, beta2.second, core2.second);
      check(host(conv2.second), host(base.conv.second), conv0, conv_slot, "cuda parts conv");
      check(host(states2.second), host(base.states.second), state0, state_slot,
            "cuda parts states");
    }
  }
}

// Expert ids routed through a replicated placement's table (Backend::MapExpertIds): the CUDA
// kernel and the host default agree, ids outside the bank give -1.
TEST(CudaVsCpuTest, MapExpertIdsAgrees) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  Pair p;
  const int E = 12, stride = 4, T = 37, k = 3;
  std::vector<float> table(E * stride), ids(T * k);
  for (int e = 0; e < E; ++e) {
    const int holders = 1 + e % 3;
    table[e * stride] = holders;
    for (int h = 0; h < 3; ++h) table[e * stride + 1 + h] = h < holders && (e + h) % 2 ? e + h : -1;
  }
  for (int i = 0; i < T * k; ++i) ids[i] = (i * 5) % (E + 2) - 1;  // -1 and E out of range
  auto routes = p.Make({E * stride}, table, DType::kI32);
  auto id = p.Make({T, k}, ids, DType::kI32);
  std::vector<int32_t> ti(table.begin(), table.end()), ii(ids.begin(), ids.end());
  for (Backend* b : {&p.cpu(), &p.cuda()}) {
    b->CopyFromHost(ti.data(), DType::kI32, b == &p.cpu() ? routes.first : routes.second);
    b->CopyFromHost(ii.data(), DType::kI32, b == &p.cpu() ? id.first : id.second);
  }
  auto out = p.Make({T, k}, ids, DType::kI32);
  p.cpu().MapExpertIds(id.first, routes.first, stride, out.first);
  p.cuda().MapExpertIds(id.second, routes.second, stride, out.second);
  std::vector<int32_t> a(T * k), c(T * k);
  p.cpu().CopyToHostI32(out.first, a.data());
  p.cuda().CopyToHostI32(out.second, c.data());
  EXPECT_EQ(a, c);
  for (int i = 0; i < T * k; ++i) {
    const int e = ii[i], t = i / k;
    const int want = e < 0 || e >= E ? -1 : ti[e * stride + 1 + t % ti[e * stride]];
    EXPECT_EQ(c[i], want) << i;
  }
}

// Backend::CopyRows (one launch on the GPU) against the same copies made on the host: rows of
// fp32 (a DeltaNet state's shape, small) and of bf16; the other rows stay as they were.
TEST(CudaVsCpuTest, CopyRowsAgrees) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto cuda = CreateCudaBackend(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::mt19937 rng(29);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const int rows = 11, width = 4 * 32 * 32;
    std::vector<float> expected = Random(rng, rows * width);  // bf16-representable
    auto x = (*cuda)->Allocate(dtype, {rows, 4, 32, 32});
    ASSERT_TRUE(x.ok()) << x.status();
    (*cuda)->CopyFromHost(expected.data(), DType::kF32, *x);
    const std::vector<int32_t> from = {0, 3, 4, 9}, to = {7, 1, 10, 5};
    Tensor* xs[] = {&*x};
    (*cuda)->CopyRows(xs, from, to);
    for (size_t i = 0; i < from.size(); ++i) {
      std::copy_n(expected.begin() + from[i] * width, width, expected.begin() + to[i] * width);
    }
    std::vector<float> got(rows * width);
    (*cuda)->CopyToHostF32(*x, got.data());
    EXPECT_EQ(got, expected) << (dtype == DType::kF32 ? "f32" : "bf16");
    // A destination that is also a source (outside the contract): copied in order, one by one.
    const std::vector<int32_t> from2 = {0, 7}, to2 = {7, 2};
    (*cuda)->CopyRows(xs, from2, to2);
    for (size_t i = 0; i < from2.size(); ++i) {
      std::copy_n(expected.begin() + from2[i] * width, width, expected.begin() + to2[i] * width);
    }
    (*cuda)->CopyToHostF32(*x, got.data());
    EXPECT_EQ(got, expected) << "overlapping rows";
  }
  // Several tensors in one call (a snapshot of every layer's states): rows of different widths,
  // one of them not in 16-byte pieces (that tensor takes the row-by-row default after the launch,
  // which reads the row pairs its uploads would overwrite), and rows wider than one block's 16 KB
  // piece (128 KB, and 160 KB whose last piece is partial) between narrow ones.
  const int rows = 9;
  const std::vector<std::pair<DType, std::vector<int64_t>>> specs = {
      {DType::kF32, {rows, 4, 32, 32}},
      {DType::kF32, {rows, 2, 128, 128}},
      {DType::kBF16, {rows, 3, 40}},
      {DType::kF32, {rows, 40000}},
      {DType::kBF16, {rows, 5}}};
  std::vector<Tensor> xs;
  std::vector<std::vector<float>> expected;
  for (const auto& [dtype, shape] : specs) {
    auto x = (*cuda)->Allocate(dtype, shape);
    ASSERT_TRUE(x.ok()) << x.status();
    expected.push_back(Random(rng, x->numel()));
    (*cuda)->CopyFromHost(expected.back().data(), DType::kF32, *x);
    xs.push_back(*x);
  }
  std::vector<Tensor*> pointers;
  for (Tensor& x : xs) pointers.push_back(&x);
  const std::vector<int32_t> from = {2, 8, 0}, to = {5, 1, 7};
  (*cuda)->CopyRows(pointers, from, to);
  for (size_t t = 0; t < xs.size(); ++t) {
    const int64_t width = xs[t].numel() / rows;
    for (size_t i = 0; i < from.size(); ++i) {
      std::copy_n(expected[t].begin() + from[i] * width, width,
                  expected[t].begin() + to[i] * width);
    }
    std::vector<float> got(xs[t].numel());
    (*cuda)->CopyToHostF32(xs[t], got.data());
    EXPECT_EQ(got, expected[t]) << "tensor " << t << " of one call";
  }
}

// Backend::ArgmaxRows on the device against std::max_element: vocabulary-sized rows, a row whose
// maximum appears twice (the lower index wins), a row of one repeated value.
TEST(CudaVsCpuTest, ArgmaxRowsAgrees) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto cuda = CreateCudaBackend(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::mt19937 rng(31);
  // 5 rows: each split over a cluster of blocks; 40: a block per row.
  for (const int rows : {5, 40}) {
    const int vocab = 151936;
    std::vector<float> logits = Random(rng, int64_t{rows} * vocab, -20, 20);
    logits[1 * vocab + 70000] = 50;  // row 1: two equal maxima
    logits[1 * vocab + 90000] = 50;
    std::fill_n(logits.begin() + 2 * vocab, vocab, 3.0f);  // row 2: all equal
    logits[4 * vocab + vocab - 1] = 99;                    // row 4: the last entry
    auto t = (*cuda)->Allocate(DType::kF32, {rows, vocab});
    auto ids = (*cuda)->Allocate(DType::kI32, {rows});
    ASSERT_TRUE(t.ok() && ids.ok());
    (*cuda)->CopyFromHost(logits.data(), DType::kF32, *t);
    (*cuda)->ArgmaxRows(*t, *ids);
    std::vector<int32_t> got(rows);
    (*cuda)->CopyToHostI32(*ids, got.data());
    for (int r = 0; r < rows; ++r) {
      const float* row = logits.data() + int64_t{r} * vocab;
      EXPECT_EQ(got[r], std::max_element(row, row + vocab) - row) << "row " << r << " of " << rows;
    }
    EXPECT_EQ(got[1], 70000);
    EXPECT_EQ(got[2], 0);
  }
}

}  // namespace
}  // namespace mobius::kernels
