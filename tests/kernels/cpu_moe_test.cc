// Router top-k and routed experts of the CPU backend against naive references.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace mobius::kernels {
namespace {

using testing::ExpectAllClose;
using testing::MakeF32;
using testing::MakeI32;
using testing::RandomVector;
using testing::ToHost;
using testing::Zeros;

void NaiveTopK(const float* logits, int E, int k, bool renormalize, std::vector<int32_t>& ids,
               std::vector<double>& weights) {
  const double mx = *std::max_element(logits, logits + E);
  std::vector<double> p(E);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(double{logits[e]} - mx));
  for (double& v : p) v /= sum;
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
  double selected = 0;
  for (int j = 0; j < k; ++j) selected += p[order[j]];
  for (int j = 0; j < k; ++j) {
    ids.push_back(order[j]);
    weights.push_back(renormalize ? p[order[j]] / selected : p[order[j]]);
  }
}

class TopKSoftmaxTest : public ::testing::TestWithParam<bool> {};

TEST_P(TopKSoftmaxTest, MatchesNaiveOverThousandsOfExperts) {
  const bool renormalize = GetParam();
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(41);
  const int T = 9, E = 2560, k = 8;
  auto logits = RandomVector(rng, T * E, 2.0f);
  logits[E - 1] = 12.0f;  // the best expert is the last id
  Tensor lt = MakeF32(*backend, {T, E}, logits);
  Tensor ids = Zeros(*backend, {T, k}, DType::kI32), weights = Zeros(*backend, {T, k});
  backend->TopKSoftmax(lt, k, renormalize, ids, weights);
  std::vector<int32_t> eids;
  std::vector<double> ew;
  for (int t = 0; t < T; ++t) NaiveTopK(logits.data() + t * E, E, k, renormalize, eids, ew);
  std::vector<int32_t> got(T * k);
  backend->CopyToHostI32(ids, got.data());
  EXPECT_EQ(got, eids);
  EXPECT_EQ(got[0], E - 1);
  ExpectAllClose(ToHost(*backend, weights), ew, 1e-7, 1e-5, "weights");
}

INSTANTIATE_TEST_SUITE_P(Renormalize, TopKSoftmaxTest, ::testing::Bool());

TEST(TopKSoftmaxTieTest, TiesGoToTheLowerId) {
  auto backend = CreateCpuBackend(2);
  const int E = 3000, k = 4;
  std::vector<float> logits(E, 0.0f);
  for (int e : {2999, 1500, 7, 2048, 100}) logits[e] = 5.0f;  // five-way tie for four places
  Tensor lt = MakeF32(*backend, {1, E}, logits);
  Tensor ids = Zeros(*backend, {1, k}, DType::kI32), weights = Zeros(*backend, {1, k});
  backend->TopKSoftmax(lt, k, true, ids, weights);
  std::vector<int32_t> got(k);
  backend->CopyToHostI32(ids, got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{7, 100, 1500, 2048}));
  ExpectAllClose(ToHost(*backend, weights), std::vector<double>(k, 0.25), 1e-7, 1e-6, "weights");
}

// Local experts 5..10 of a bank of 16; tokens also route to experts outside that range, one local
// expert gets many tokens (a real gemm) and one gets none.
TEST(MoeExpertsTest, MatchesNaiveWithExpertParallelism) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(42);
  const int T = 37, H = 48, I = 40, k = 4, E_total = 16, first = 5, E_local = 6;
  std::vector<int32_t> ids(T * k);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> all(E_total);
    std::iota(all.begin(), all.end(), 0);
    all.erase(all.begin() + first + 4);  // local expert 4 (global 9) receives nothing
    std::shuffle(all.begin(), all.end(), rng);
    if (t % 2 == 0) {  // local expert 2 (global 7) is popular
      all.erase(std::find(all.begin(), all.end(), first + 2));
      all.insert(all.begin(), first + 2);
    }
    std::copy(all.begin(), all.begin() + k, ids.begin() + t * k);
  }
  const auto weights = testing::UniformVector(rng, T * k, 0.0f, 1.0f);
  const auto x = RandomVector(rng, T * H);
  const auto gate_up = RandomVector(rng, E_local * 2 * I * H, 0.2f);
  const auto down = RandomVector(rng, E_local * H * I, 0.2f);
  const auto out0 = RandomVector(rng, T * H);

  Tensor xt = MakeF32(*backend, {T, H}, x);
  Tensor idt = MakeI32(*backend, {T, k}, ids);
  Tensor wt = MakeF32(*backend, {T, k}, weights);
  Tensor gut = MakeF32(*backend, {E_local, 2 * I, H}, gate_up);
  Tensor dt = MakeF32(*backend, {E_local, H, I}, down);
  Tensor out = MakeF32(*backend, {T, H}, out0);
  std::vector<int64_t> counts(E_local, 100);
  backend->MoeExperts(xt, idt, wt, gut, dt, first, out, counts);

  std::vector<double> expected(out0.begin(), out0.end());
  std::vector<int64_t> expected_counts(E_local, 100);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j] - first;
      if (e < 0 || e >= E_local) continue;
      ++expected_counts[e];
      std::vector<double> act(I);
      for (int i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int h = 0; h < H; ++h) {
          g += double{gate_up[(e * 2 * I + i) * H + h]} * x[t * H + h];
          u += double{gate_up[(e * 2 * I + I + i) * H + h]} * x[t * H + h];
        }
        act[i] = testing::SiluD(g) * u;
      }
      for (int h = 0; h < H; ++h) {
        double y = 0;
        for (int i = 0; i < I; ++i) y += double{down[(e * H + h) * I + i]} * act[i];
        expected[t * H + h] += weights[t * k + j] * y;
      }
    }
  }
  EXPECT_EQ(counts, expected_counts);
  EXPECT_EQ(counts[4], 100);
  EXPECT_GE(counts[2], 100 + (T + 1) / 2);  // enough rows for the sgemm path
  ExpectAllClose(ToHost(*backend, out), expected, 1e-4, 1e-4, "moe out");

  // No counters requested: the same result, nothing else written.
  Tensor out2 = MakeF32(*backend, {T, H}, out0);
  backend->MoeExperts(xt, idt, wt, gut, dt, first, out2, {});
  EXPECT_EQ(ToHost(*backend, out2), ToHost(*backend, out));
}

}  // namespace
}  // namespace mobius::kernels
