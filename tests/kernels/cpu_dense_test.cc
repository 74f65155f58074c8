// Allocation, copies and the dense ops of the CPU backend against naive references.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace mobius::kernels {
namespace {

using testing::ExpectAllClose;
using testing::MakeF32;
using testing::RandomVector;
using testing::ToHost;

TEST(CpuBackendTest, DescribesItself) {
  auto backend = CreateCpuBackend(2);
  EXPECT_EQ(backend->device(), Device::kCpu);
  EXPECT_EQ(backend->activation_dtype(), DType::kF32);
  EXPECT_FALSE(backend->name().empty());
}

TEST(CpuBackendTest, AllocateIsZeroedAndAligned) {
  auto backend = CreateCpuBackend(2);
  for (int64_t rows : {1, 7, 1000, 300000}) {  // small (heap) and large (mapped) allocations
    auto t = backend->Allocate(DType::kF32, {rows, 3});
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->raw()) % 64, 0u);
    EXPECT_EQ(t->shape(), (std::vector<int64_t>{rows, 3}));
    const float* p = t->data<float>();
    for (int64_t i = 0; i < t->numel(); ++i) ASSERT_EQ(p[i], 0.0f) << i;
  }
  auto empty_rows = backend->Allocate(DType::kF32, {0, 16});
  ASSERT_TRUE(empty_rows.ok());
  EXPECT_EQ(empty_rows->numel(), 0);
}

TEST(CpuBackendTest, AllocateRejectsAbsurdSizes) {
  auto backend = CreateCpuBackend(2);
  auto huge = backend->Allocate(DType::kF32, {int64_t{1} << 40, 1024});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(huge.status().message().find("4503599627370496 bytes"), std::string::npos)
      << huge.status();
  auto overflow = backend->Allocate(DType::kF32, {int64_t{1} << 62, int64_t{1} << 62});
  ASSERT_FALSE(overflow.ok());
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kResourceExhausted);
  auto negative = backend->Allocate(DType::kF32, {-1, 4});
  EXPECT_FALSE(negative.ok());
}

TEST(CpuBackendTest, CopyFromHostConvertsToF32) {
  auto backend = CreateCpuBackend(2);
  const std::vector<float> values = {1.0f, -2.5f, 3.140625f, 0.0f, 65504.0f, -1e-3f};
  // bf16: 1.0 = 0x3F80, -2.5 = 0xC020, 3.140625 = 0x4049, 0, 65504 -> 0x4780 (65536), -1e-3.
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC020, 0x4049, 0x0000, 0x4780, 0xBA83};
  // f16: 1.0 = 0x3C00, -2.5 = 0xC100, 3.140625 = 0x4248, 0, 65504 = 0x7BFF, subnormal 0x0001.
  const std::vector<uint16_t> f16 = {0x3C00, 0xC100, 0x4248, 0x0000, 0x7BFF, 0x0001};
  auto t = backend->Allocate(DType::kF32, {2, 3});
  ASSERT_TRUE(t.ok());

  backend->CopyFromHost(values.data(), DType::kF32, *t);
  EXPECT_EQ(ToHost(*backend, *t), values);

  backend->CopyFromHost(bf16.data(), DType::kBF16, *t);
  const std::vector<float> from_bf16 = ToHost(*backend, *t);
  EXPECT_EQ(from_bf16[0], 1.0f);
  EXPECT_EQ(from_bf16[1], -2.5f);
  EXPECT_EQ(from_bf16[2], 3.140625f);
  EXPECT_EQ(from_bf16[4], 65536.0f);
  EXPECT_NEAR(from_bf16[5], -1e-3f, 1e-5f);

  backend->CopyFromHost(f16.data(), DType::kF16, *t);
  const std::vector<float> from_f16 = ToHost(*backend, *t);
  EXPECT_EQ(from_f16[0], 1.0f);
  EXPECT_EQ(from_f16[1], -2.5f);
  EXPECT_EQ(from_f16[2], 3.140625f);
  EXPECT_EQ(from_f16[4], 65504.0f);
  EXPECT_EQ(from_f16[5], std::ldexp(1.0f, -24));

  const std::vector<int32_t> ints = {7, -3, 1 << 30};
  auto it = backend->Allocate(DType::kI32, {3});
  ASSERT_TRUE(it.ok());
  backend->CopyFromHost(ints.data(), DType::kI32, *it);
  std::vector<int32_t> back(3);
  backend->CopyToHostI32(*it, back.data());
  EXPECT_EQ(back, ints);

  backend->ZeroFill(*t);
  EXPECT_EQ(ToHost(*backend, *t), std::vector<float>(6, 0.0f));
}

TEST(CpuBackendTest, LinearMatchesNaive) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(1);
  const int T = 13, K = 70, N = 33;
  const auto x = RandomVector(rng, T * K), w = RandomVector(rng, N * K);
  Tensor xt = MakeF32(*backend, {T, K}, x), wt = MakeF32(*backend, {N, K}, w);
  Tensor y = testing::Zeros(*backend, {T, N});
  backend->Linear(xt, wt, y);
  std::vector<double> expected(T * N);
  for (int t = 0; t < T; ++t) {
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += double{x[t * K + k]} * w[n * K + k];
      expected[t * N + n] = s;
    }
  }
  ExpectAllClose(ToHost(*backend, y), expected, 1e-4, 1e-4, "linear");

  // No tokens: a no-op that must not touch memory.
  Tensor x0 = testing::Zeros(*backend, {0, K}), y0 = testing::Zeros(*backend, {0, N});
  backend->Linear(x0, wt, y0);
}

TEST(CpuBackendTest, EmbeddingLookupAndGatherRows) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(2);
  const int V = 11, D = 9;
  const auto table = RandomVector(rng, V * D);
  Tensor tt = MakeF32(*backend, {V, D}, table);
  const std::vector<int32_t> ids = {3, 0, 10, 3};
  Tensor out = testing::Zeros(*backend, {4, D});
  backend->EmbeddingLookup(ids, tt, out);
  std::vector<float> expected;
  for (int32_t id : ids) expected.insert(expected.end(), &table[id * D], &table[id * D + D]);
  EXPECT_EQ(ToHost(*backend, out), expected);

  Tensor gathered = testing::Zeros(*backend, {2, D});
  const std::vector<int32_t> rows = {2, 1};
  backend->GatherRows(out, rows, gathered);
  std::vector<float> expected_rows(&expected[2 * D], &expected[3 * D]);
  expected_rows.insert(expected_rows.end(), &expected[D], &expected[2 * D]);
  EXPECT_EQ(ToHost(*backend, gathered), expected_rows);
}

std::vector<double> NaiveRmsNorm(const std::vector<float>& x, const std::vector<float>& w,
                                 double eps, bool one_plus) {
  const size_t D = w.size(), R = x.size() / D;
  std::vector<double> out(x.size());
  for (size_t r = 0; r < R; ++r) {
    double ss = 0;
    for (size_t i = 0; i < D; ++i) ss += double{x[r * D + i]} * x[r * D + i];
    const double inv = 1.0 / std::sqrt(ss / D + eps);
    for (size_t i = 0; i < D; ++i) {
      out[r * D + i] = x[r * D + i] * inv * (one_plus ? 1.0 + w[i] : double{w[i]});
    }
  }
  return out;
}

TEST(CpuBackendTest, RmsNormsMatchNaive) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(3);
  const int R = 5, D = 96;
  const float eps = 1e-6f;
  const auto x = RandomVector(rng, R * D, 3.0f), w = RandomVector(rng, D, 0.2f);
  const auto delta = RandomVector(rng, R * D), z = RandomVector(rng, R * D);
  Tensor xt = MakeF32(*backend, {R, D}, x), wt = MakeF32(*backend, {D}, w);
  Tensor out = testing::Zeros(*backend, {R, D});

  backend->RmsNorm1p(xt, wt, eps, out);
  ExpectAllClose(ToHost(*backend, out), NaiveRmsNorm(x, w, eps, true), 1e-5, 1e-5, "rmsnorm1p");

  Tensor dt = MakeF32(*backend, {R, D}, delta);
  backend->AddRmsNorm1p(xt, dt, wt, eps, out);
  std::vector<float> sum(x.size());
  for (size_t i = 0; i < x.size(); ++i) sum[i] = x[i] + delta[i];
  ExpectAllClose(ToHost(*backend, xt), sum, 1e-6, 1e-6, "residual");
  ExpectAllClose(ToHost(*backend, out), NaiveRmsNorm(sum, w, eps, true), 1e-5, 1e-5,
                 "add_rmsnorm1p");

  Tensor zt = MakeF32(*backend, {R, D}, z);
  Tensor xt2 = MakeF32(*backend, {R, D}, x);
  backend->GatedRmsNorm(xt2, zt, wt, eps, out);
  std::vector<double> gated = NaiveRmsNorm(x, w, eps, false);
  for (size_t i = 0; i < gated.size(); ++i) gated[i] *= testing::SiluD(z[i]);
  ExpectAllClose(ToHost(*backend, out), gated, 1e-5, 1e-5, "gated_rmsnorm");
}

TEST(CpuBackendTest, ElementwiseOpsMatchNaive) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(4);
  const int T = 6, I = 20, H = 17;
  const auto gu = RandomVector(rng, T * 2 * I, 3.0f);
  Tensor gut = MakeF32(*backend, {T, 2 * I}, gu);
  Tensor act = testing::Zeros(*backend, {T, I});
  backend->SiluAndMul(gut, act);
  std::vector<double> expected(T * I);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < I; ++i) {
      expected[t * I + i] = testing::SiluD(gu[t * 2 * I + i]) * gu[t * 2 * I + I + i];
    }
  }
  ExpectAllClose(ToHost(*backend, act), expected, 1e-5, 1e-5, "silu_and_mul");

  const auto x = RandomVector(rng, T * H), y = RandomVector(rng, T * H);
  const auto logits = RandomVector(rng, T, 4.0f);
  Tensor xt = MakeF32(*backend, {T, H}, x), yt = MakeF32(*backend, {T, H}, y);
  Tensor lt = MakeF32(*backend, {T, 1}, logits);
  backend->AddSigmoidScaled(xt, yt, lt);
  std::vector<double> scaled(T * H);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      scaled[t * H + h] = x[t * H + h] + testing::SigmoidD(logits[t]) * y[t * H + h];
    }
  }
  ExpectAllClose(ToHost(*backend, xt), scaled, 1e-6, 1e-5, "add_sigmoid_scaled");

  Tensor xa = MakeF32(*backend, {T, H}, x);
  backend->Add(xa, yt);
  std::vector<double> added(T * H);
  for (int i = 0; i < T * H; ++i) added[i] = double{x[i]} + y[i];
  ExpectAllClose(ToHost(*backend, xa), added, 1e-6, 1e-6, "add");

  Tensor xm = MakeF32(*backend, {T, H}, x);
  backend->MulSigmoid(xm, yt);
  std::vector<double> gated(T * H);
  for (int i = 0; i < T * H; ++i) gated[i] = x[i] * testing::SigmoidD(y[i]);
  ExpectAllClose(ToHost(*backend, xm), gated, 1e-6, 1e-5, "mul_sigmoid");
}

TEST(CpuBackendTest, DeltaRuleGatesMatchNaive) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(5);
  const int T = 7, Hv = 6;
  auto a = RandomVector(rng, T * Hv, 5.0f);
  a[3] = 30.0f;  // the softplus(x) = x branch
  const auto b = RandomVector(rng, T * Hv, 3.0f), a_log = RandomVector(rng, Hv),
             dt_bias = RandomVector(rng, Hv);
  Tensor at = MakeF32(*backend, {T, Hv}, a), bt = MakeF32(*backend, {T, Hv}, b);
  Tensor alt = MakeF32(*backend, {Hv}, a_log), dtt = MakeF32(*backend, {Hv}, dt_bias);
  Tensor g = testing::Zeros(*backend, {T, Hv}), beta = testing::Zeros(*backend, {T, Hv});
  backend->DeltaRuleGates(at, bt, alt, dtt, g, beta);
  std::vector<double> eg(T * Hv), eb(T * Hv);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < Hv; ++h) {
      const double u = double{a[t * Hv + h]} + dt_bias[h];
      eg[t * Hv + h] = -std::exp(double{a_log[h]}) * std::log1p(std::exp(u));
      eb[t * Hv + h] = testing::SigmoidD(b[t * Hv + h]);
    }
  }
  ExpectAllClose(ToHost(*backend, g), eg, 1e-5, 1e-5, "g");
  ExpectAllClose(ToHost(*backend, beta), eb, 1e-6, 1e-5, "beta");
}

}  // namespace
}  // namespace mobius::kernels
