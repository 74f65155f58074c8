// The gated-attention ops of the CPU backend: q/k norm + partial RoPE, paged KV writes and causal
// GQA attention over non-contiguous block tables, against naive references.
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
using testing::RandomVector;
using testing::ToHost;
using testing::Zeros;

// Norm, then rotate-half RoPE with the angle formed as the reference does it (fp32 inv_freq and
// fp32 product), the rest in double.
std::vector<double> NaiveNormRope(const float* x, const std::vector<float>& w, double eps, int hd,
                                  int rd, float theta, int64_t pos) {
  double ss = 0;
  for (int i = 0; i < hd; ++i) ss += double{x[i]} * x[i];
  const double inv = 1.0 / std::sqrt(ss / hd + eps);
  std::vector<double> y(hd);
  for (int i = 0; i < hd; ++i) y[i] = x[i] * inv * (1.0 + w[i]);
  std::vector<double> r = y;
  for (int j = 0; j < rd / 2; ++j) {
    const float inv_freq = 1.0f / std::pow(theta, static_cast<float>(2 * j) / rd);
    const float angle = static_cast<float>(pos) * inv_freq;
    const double c = std::cos(double{angle}), s = std::sin(double{angle});
    r[j] = y[j] * c - y[j + rd / 2] * s;
    r[j + rd / 2] = y[j + rd / 2] * c + y[j] * s;
  }
  return r;
}

TEST(QkNormRopeTest, MatchesNaiveAtRaggedPositions) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(21);
  const int nh = 4, nkv = 2, hd = 32, rd = 16;  // rotary_dim < head_dim
  const float eps = 1e-6f, theta = 1e7f;
  std::vector<SequenceSegment> segments(3);
  const std::vector<int> lengths = {5, 1, 3}, cached = {0, 17, 131000};
  int T = 0;
  for (int s = 0; s < 3; ++s) {
    segments[s].token_begin = T;
    segments[s].num_tokens = lengths[s];
    segments[s].cached_tokens = cached[s];
    segments[s].state_slot = s;
    T += lengths[s];
  }
  const auto q_gate = RandomVector(rng, T * nh * 2 * hd, 2.0f);
  const auto k = RandomVector(rng, T * nkv * hd, 2.0f);
  const auto q_norm = RandomVector(rng, hd, 0.3f), k_norm = RandomVector(rng, hd, 0.3f);
  Tensor qgt = MakeF32(*backend, {T, nh, 2 * hd}, q_gate);
  Tensor kt = MakeF32(*backend, {T, nkv, hd}, k);
  Tensor qnt = MakeF32(*backend, {hd}, q_norm), knt = MakeF32(*backend, {hd}, k_norm);
  Tensor q = Zeros(*backend, {T, nh, hd}), gate = Zeros(*backend, {T, nh, hd});
  RopeParams rope;
  rope.rotary_dim = rd;
  rope.theta = theta;
  backend->QkNormRope(qgt, kt, qnt, knt, eps, rope, segments, q, gate);

  std::vector<double> eq, ek;
  std::vector<float> egate;
  for (const SequenceSegment& seg : segments) {
    for (int i = 0; i < seg.num_tokens; ++i) {
      const int t = seg.token_begin + i;
      const int64_t pos = seg.cached_tokens + i;
      for (int h = 0; h < nh; ++h) {
        const float* src = q_gate.data() + (t * nh + h) * 2 * hd;
        const auto r = NaiveNormRope(src, q_norm, eps, hd, rd, theta, pos);
        eq.insert(eq.end(), r.begin(), r.end());
        egate.insert(egate.end(), src + hd, src + 2 * hd);
      }
      for (int h = 0; h < nkv; ++h) {
        const auto r =
            NaiveNormRope(k.data() + (t * nkv + h) * hd, k_norm, eps, hd, rd, theta, pos);
        ek.insert(ek.end(), r.begin(), r.end());
      }
    }
  }
  ExpectAllClose(ToHost(*backend, q), eq, 1e-5, 1e-5, "q");
  ExpectAllClose(ToHost(*backend, kt), ek, 1e-5, 1e-5, "k");
  EXPECT_EQ(ToHost(*backend, gate), egate);
}

class PagedAttentionTest : public ::testing::TestWithParam<int> {};

// Several sequences with different cached lengths, each with a shuffled block table; the cached
// prefix is written by earlier WriteKvCache calls, this step's tokens by one ragged call.
TEST_P(PagedAttentionTest, MatchesNaiveCausalGqa) {
  const int group = GetParam();
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(30 + group);
  const int nkv = 2, nh = nkv * group, hd = 24, block_size = 16, num_blocks = 40;
  const std::vector<int> cached = {0, 37, 5, 100}, lengths = {20, 1, 12, 3};
  const int S = 4;

  std::vector<int32_t> block_ids(num_blocks);
  std::iota(block_ids.begin(), block_ids.end(), 0);
  std::shuffle(block_ids.begin(), block_ids.end(), rng);
  std::vector<std::vector<int32_t>> tables(S);
  int next_block = 0;
  for (int s = 0; s < S; ++s) {
    const int blocks = (cached[s] + lengths[s] + block_size - 1) / block_size;
    tables[s].assign(block_ids.begin() + next_block, block_ids.begin() + next_block + blocks);
    next_block += blocks;
  }
  ASSERT_LE(next_block, num_blocks);

  // Every sequence's keys and values over all its positions, [pos, nkv, hd].
  std::vector<std::vector<float>> keys(S), values(S);
  for (int s = 0; s < S; ++s) {
    keys[s] = RandomVector(rng, int64_t{cached[s] + lengths[s]} * nkv * hd);
    values[s] = RandomVector(rng, int64_t{cached[s] + lengths[s]} * nkv * hd);
  }
  Tensor k_cache = Zeros(*backend, {num_blocks, block_size, nkv, hd});
  Tensor v_cache = Zeros(*backend, {num_blocks, block_size, nkv, hd});
  const int row = nkv * hd;
  for (int s = 0; s < S; ++s) {  // earlier steps: the cached prefix, one sequence per call
    if (cached[s] == 0) continue;
    SequenceSegment seg;
    seg.num_tokens = cached[s];
    seg.kv_blocks = tables[s];
    Tensor kt = MakeF32(*backend, {cached[s], nkv, hd},
                        std::vector<float>(keys[s].begin(), keys[s].begin() + cached[s] * row));
    Tensor vt = MakeF32(*backend, {cached[s], nkv, hd},
                        std::vector<float>(values[s].begin(), values[s].begin() + cached[s] * row));
    backend->WriteKvCache(kt, vt, {&seg, 1}, k_cache, v_cache);
  }
  std::vector<SequenceSegment> segments(S);
  std::vector<float> step_k, step_v;
  int T = 0;
  for (int s = 0; s < S; ++s) {
    segments[s].token_begin = T;
    segments[s].num_tokens = lengths[s];
    segments[s].cached_tokens = cached[s];
    segments[s].state_slot = s;
    segments[s].kv_blocks = tables[s];
    step_k.insert(step_k.end(), keys[s].begin() + cached[s] * row, keys[s].end());
    step_v.insert(step_v.end(), values[s].begin() + cached[s] * row, values[s].end());
    T += lengths[s];
  }
  Tensor kt = MakeF32(*backend, {T, nkv, hd}, step_k), vt = MakeF32(*backend, {T, nkv, hd}, step_v);
  backend->WriteKvCache(kt, vt, segments, k_cache, v_cache);

  // The cache holds exactly every position at its paged address.
  const auto kc = ToHost(*backend, k_cache);
  for (int s = 0; s < S; ++s) {
    for (int p = 0; p < cached[s] + lengths[s]; ++p) {
      const int slot = tables[s][p / block_size] * block_size + p % block_size;
      ASSERT_TRUE(std::equal(kc.begin() + slot * row, kc.begin() + (slot + 1) * row,
                             keys[s].begin() + p * row))
          << "sequence " << s << " position " << p;
    }
  }

  const auto q = RandomVector(rng, T * nh * hd, 2.0f);
  Tensor qt = MakeF32(*backend, {T, nh, hd}, q);
  Tensor out = Zeros(*backend, {T, nh, hd});
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  backend->PagedAttention(qt, k_cache, v_cache, segments, scale, out);

  std::vector<double> expected(T * nh * hd, 0.0);
  for (int s = 0; s < S; ++s) {
    for (int i = 0; i < lengths[s]; ++i) {
      const int t = segments[s].token_begin + i, context = cached[s] + i + 1;
      for (int h = 0; h < nh; ++h) {
        const int kvh = h / group;
        std::vector<double> p(context);
        double mx = -1e300, sum = 0;
        for (int j = 0; j < context; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) {
            dot += double{q[(t * nh + h) * hd + d]} * keys[s][(j * nkv + kvh) * hd + d];
          }
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        for (double& v : p) sum += (v = std::exp(v - mx));
        for (int j = 0; j < context; ++j) {
          for (int d = 0; d < hd; ++d) {
            expected[(t * nh + h) * hd + d] += p[j] / sum * values[s][(j * nkv + kvh) * hd + d];
          }
        }
      }
    }
  }
  ExpectAllClose(ToHost(*backend, out), expected, 1e-5, 1e-4, "attention");
}

INSTANTIATE_TEST_SUITE_P(GqaRatios, PagedAttentionTest, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace mobius::kernels
