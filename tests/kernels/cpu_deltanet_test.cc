// The gated DeltaNet ops of the CPU backend: causal conv with carried state, and the gated delta
// rule in its recurrent and chunked forms, against naive double-precision references and each
// other, across ragged batches and incremental prefill.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/kernels/kernel_test_util.h"

namespace mobius::kernels {
namespace {

using testing::ExpectAllClose;
using testing::MakeF32;
using testing::MaxRelativeError;
using testing::RandomVector;
using testing::ToHost;
using testing::UniformVector;
using testing::Zeros;

std::vector<SequenceSegment> Pack(const std::vector<int>& lengths, const std::vector<int>& slots) {
  std::vector<SequenceSegment> segments;
  int begin = 0;
  for (size_t s = 0; s < lengths.size(); ++s) {
    SequenceSegment seg;
    seg.token_begin = begin;
    seg.num_tokens = lengths[s];
    seg.cached_tokens = 3 * static_cast<int>(s);  // irrelevant to these ops; nonzero anyway
    seg.state_slot = slots[s];
    segments.push_back(seg);
    begin += lengths[s];
  }
  return segments;
}

// ---- causal conv ----

TEST(CausalConv1dSiluTest, MatchesNaiveWithCarriedState) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(11);
  const int C = 24, K = 4, slots = 5;
  const std::vector<int> lengths = {7, 1, 2, 5};  // 1 and 2 are shorter than K - 1
  const std::vector<int> slot_of = {3, 0, 1, 4};
  const std::vector<bool> fresh = {false, true, false, false};
  const auto segments = Pack(lengths, slot_of);
  const int T = 15;
  const auto x = RandomVector(rng, T * C), w = RandomVector(rng, C * K, 0.5f);
  std::vector<float> states(slots * C * (K - 1), 0.0f);
  // prior[s][c][i]: the K-1 inputs each sequence saw before this step (zeros when fresh).
  std::vector<std::vector<float>> prior(lengths.size());
  for (size_t s = 0; s < lengths.size(); ++s) {
    prior[s] = fresh[s] ? std::vector<float>(C * (K - 1), 0.0f) : RandomVector(rng, C * (K - 1));
    std::copy(prior[s].begin(), prior[s].end(), states.begin() + slot_of[s] * C * (K - 1));
  }
  Tensor xt = MakeF32(*backend, {T, C}, x), wt = MakeF32(*backend, {C, 1, K}, w);
  Tensor st = MakeF32(*backend, {slots, C, K - 1}, states);
  Tensor out = Zeros(*backend, {T, C});
  backend->CausalConv1dSilu(xt, wt, st, segments, out);

  std::vector<double> expected(T * C);
  std::vector<float> expected_states = states;
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int n = lengths[s], begin = segments[s].token_begin;
    for (int c = 0; c < C; ++c) {
      std::vector<double> hist;  // prior inputs then this step's, oldest first
      for (int i = 0; i < K - 1; ++i) hist.push_back(prior[s][c * (K - 1) + i]);
      for (int t = 0; t < n; ++t) hist.push_back(x[(begin + t) * C + c]);
      for (int t = 0; t < n; ++t) {
        double acc = 0;
        for (int j = 0; j < K; ++j) acc += double{w[c * K + j]} * hist[t + j];
        expected[(begin + t) * C + c] = testing::SiluD(acc);
      }
      for (int i = 0; i < K - 1; ++i) {
        expected_states[(slot_of[s] * C + c) * (K - 1) + i] =
            static_cast<float>(hist[hist.size() - (K - 1) + i]);
      }
    }
  }
  ExpectAllClose(ToHost(*backend, out), expected, 1e-5, 1e-5, "conv out");
  EXPECT_EQ(ToHost(*backend, st), expected_states);
}

// ---- gated delta rule ----

struct DeltaRuleCase {
  DeltaRuleDims dims;
  int T = 0;
  std::vector<float> qkv, g, beta;
};

DeltaRuleCase RandomDeltaRuleCase(std::mt19937& rng, const DeltaRuleDims& dims, int T) {
  DeltaRuleCase c;
  c.dims = dims;
  c.T = T;
  const int conv_dim = 2 * dims.num_k_heads * dims.k_head_dim + dims.num_v_heads * dims.v_head_dim;
  c.qkv = RandomVector(rng, int64_t{T} * conv_dim);
  // g in about [-1.65, -0.018]: from nearly no decay to strong decay.
  c.g = UniformVector(rng, int64_t{T} * dims.num_v_heads, -4.0f, 0.5f);
  for (float& v : c.g) v = -std::exp(v);
  c.beta = UniformVector(rng, int64_t{T} * dims.num_v_heads, 0.05f, 0.95f);
  return c;
}

// The per-token definition, in double, from each segment's initial state.
void NaiveDeltaRule(const DeltaRuleCase& c, std::span<const SequenceSegment> segments,
                    std::vector<double>& states, std::vector<double>& out) {
  const int Hk = c.dims.num_k_heads, Hv = c.dims.num_v_heads, Dk = c.dims.k_head_dim,
            Dv = c.dims.v_head_dim;
  const int key_dim = Hk * Dk, conv_dim = 2 * key_dim + Hv * Dv;
  out.assign(static_cast<size_t>(c.T) * Hv * Dv, 0.0);
  for (const SequenceSegment& seg : segments) {
    for (int h = 0; h < Hv; ++h) {
      const int kh = h / (Hv / Hk);
      double* S = states.data() + (static_cast<size_t>(seg.state_slot) * Hv + h) * Dk * Dv;
      for (int i = 0; i < seg.num_tokens; ++i) {
        const int t = seg.token_begin + i;
        const float* row = c.qkv.data() + static_cast<size_t>(t) * conv_dim;
        std::vector<double> q(Dk), k(Dk), u(Dv, 0.0);
        double qq = 0, kk = 0;
        for (int d = 0; d < Dk; ++d) {
          q[d] = row[kh * Dk + d];
          k[d] = row[key_dim + kh * Dk + d];
          qq += q[d] * q[d];
          kk += k[d] * k[d];
        }
        for (int d = 0; d < Dk; ++d) {
          q[d] /= std::sqrt(qq + 1e-6) * std::sqrt(double(Dk));
          k[d] /= std::sqrt(kk + 1e-6);
        }
        const double decay = std::exp(double{c.g[t * Hv + h]}), beta = c.beta[t * Hv + h];
        for (int d = 0; d < Dk * Dv; ++d) S[d] *= decay;
        for (int d = 0; d < Dk; ++d) {
          for (int e = 0; e < Dv; ++e) u[e] += S[d * Dv + e] * k[d];
        }
        for (int e = 0; e < Dv; ++e) {
          const double delta = beta * (row[2 * key_dim + h * Dv + e] - u[e]);
          for (int d = 0; d < Dk; ++d) S[d * Dv + e] += k[d] * delta;
        }
        for (int e = 0; e < Dv; ++e) {
          double o = 0;
          for (int d = 0; d < Dk; ++d) o += S[d * Dv + e] * q[d];
          out[(static_cast<size_t>(t) * Hv + h) * Dv + e] = o;
        }
      }
    }
  }
}

struct DeltaRuleResult {
  std::vector<float> out, states;
};

DeltaRuleResult RunDeltaRule(Backend& backend, const DeltaRuleCase& c,
                             std::span<const SequenceSegment> segments,
                             const std::vector<float>& initial_states, int slots,
                             DeltaRuleAlgorithm algorithm) {
  const DeltaRuleDims& d = c.dims;
  const int conv_dim = 2 * d.num_k_heads * d.k_head_dim + d.num_v_heads * d.v_head_dim;
  Tensor qkv = MakeF32(backend, {c.T, conv_dim}, c.qkv);
  Tensor g = MakeF32(backend, {c.T, d.num_v_heads}, c.g);
  Tensor beta = MakeF32(backend, {c.T, d.num_v_heads}, c.beta);
  Tensor states =
      MakeF32(backend, {slots, d.num_v_heads, d.k_head_dim, d.v_head_dim}, initial_states);
  Tensor out = Zeros(backend, {c.T, d.num_v_heads * d.v_head_dim});
  backend.GatedDeltaRule(qkv, g, beta, d, states, segments, algorithm, out);
  return {ToHost(backend, out), ToHost(backend, states)};
}

DeltaRuleDims Dims(int hk, int hv, int dk, int dv) {
  DeltaRuleDims d;
  d.num_k_heads = hk;
  d.num_v_heads = hv;
  d.k_head_dim = dk;
  d.v_head_dim = dv;
  return d;
}

TEST(GatedDeltaRuleTest, BothFormsMatchNaiveOnARaggedBatch) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(12);
  const DeltaRuleDims dims = Dims(2, 4, 16, 24);  // Hv / Hk = 2
  const std::vector<int> lengths = {3, 1, 70, 9};
  const std::vector<int> slot_of = {2, 0, 3, 5};
  const int T = 83, slots = 6;
  const auto c = RandomDeltaRuleCase(rng, dims, T);
  const auto segments = Pack(lengths, slot_of);
  auto initial = RandomVector(rng, int64_t{slots} * 4 * 16 * 24, 0.3f);
  std::fill(initial.begin(), initial.begin() + 4 * 16 * 24, 0.0f);  // slot 0 is fresh

  std::vector<double> expected_states(initial.begin(), initial.end()), expected_out;
  NaiveDeltaRule(c, segments, expected_states, expected_out);
  for (DeltaRuleAlgorithm algorithm :
       {DeltaRuleAlgorithm::kRecurrent, DeltaRuleAlgorithm::kChunked, DeltaRuleAlgorithm::kAuto}) {
    SCOPED_TRACE(static_cast<int>(algorithm));
    const DeltaRuleResult r = RunDeltaRule(*backend, c, segments, initial, slots, algorithm);
    EXPECT_LT(MaxRelativeError(r.out, expected_out), 2e-5);
    EXPECT_LT(MaxRelativeError(r.states, expected_states), 2e-5);
    ExpectAllClose(r.out, expected_out, 1e-4, 1e-4, "out");
    ExpectAllClose(r.states, expected_states, 1e-4, 1e-4, "states");
  }
}

class ChunkedVsRecurrentTest : public ::testing::TestWithParam<int> {};

TEST_P(ChunkedVsRecurrentTest, AgreeFromANonzeroState) {
  const int T = GetParam();
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(100 + T);
  const DeltaRuleDims dims = Dims(2, 4, 64, 64);
  const int slots = 3;
  const auto c = RandomDeltaRuleCase(rng, dims, T);
  const auto segments = Pack({T}, {1});
  const auto initial = RandomVector(rng, int64_t{slots} * 4 * 64 * 64, 0.3f);
  const DeltaRuleResult rec =
      RunDeltaRule(*backend, c, segments, initial, slots, DeltaRuleAlgorithm::kRecurrent);
  const DeltaRuleResult chunked =
      RunDeltaRule(*backend, c, segments, initial, slots, DeltaRuleAlgorithm::kChunked);
  const double out_err = MaxRelativeError(chunked.out, rec.out);
  const double state_err = MaxRelativeError(chunked.states, rec.states);
  EXPECT_LT(out_err, 1e-5);
  EXPECT_LT(state_err, 1e-5);
  ExpectAllClose(chunked.out, rec.out, 1e-5, 1e-4, "chunked vs recurrent out");
  ExpectAllClose(chunked.states, rec.states, 1e-5, 1e-4, "chunked vs recurrent states");
  // Other slots are untouched.
  for (int s : {0, 2}) {
    const size_t n = 4 * 64 * 64;
    EXPECT_TRUE(std::equal(chunked.states.begin() + s * n, chunked.states.begin() + (s + 1) * n,
                           initial.begin() + s * n));
  }
}

INSTANTIATE_TEST_SUITE_P(SegmentLengths, ChunkedVsRecurrentTest,
                         ::testing::Values(1, 5, 63, 64, 65, 130, 200));

// Prefilling a sequence 5 tokens at a time (state carried between steps) must equal prefilling it
// in one step, for the conv and the delta rule together.
TEST(DeltaNetPrefillTest, ChunksOfFiveEqualOneShot) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(13);
  const DeltaRuleDims dims = Dims(2, 8, 32, 16);  // Hv / Hk = 4
  const int key_dim = 64, conv_dim = 2 * key_dim + 8 * 16, K = 4, total = 137, slots = 2, slot = 1;
  const auto x = RandomVector(rng, int64_t{total} * conv_dim);
  const auto w = RandomVector(rng, conv_dim * K, 0.5f);
  auto g = UniformVector(rng, total * 8, -4.0f, 0.5f);
  for (float& v : g) v = -std::exp(v);
  const auto beta = UniformVector(rng, total * 8, 0.05f, 0.95f);
  Tensor wt = MakeF32(*backend, {conv_dim, K}, w);

  struct Run {
    std::vector<float> out, conv_state, state;
  };
  auto run = [&](int step) {
    Tensor conv_state = Zeros(*backend, {slots, conv_dim, K - 1});
    Tensor state = Zeros(*backend, {slots, 8, 32, 16});
    Run r;
    for (int begin = 0; begin < total; begin += step) {
      const int n = std::min(step, total - begin);
      SequenceSegment seg;
      seg.num_tokens = n;
      seg.cached_tokens = begin;
      seg.state_slot = slot;
      Tensor xt = MakeF32(
          *backend, {n, conv_dim},
          std::vector<float>(x.begin() + begin * conv_dim, x.begin() + (begin + n) * conv_dim));
      Tensor gt = MakeF32(*backend, {n, 8},
                          std::vector<float>(g.begin() + begin * 8, g.begin() + (begin + n) * 8));
      Tensor bt =
          MakeF32(*backend, {n, 8},
                  std::vector<float>(beta.begin() + begin * 8, beta.begin() + (begin + n) * 8));
      Tensor conv_out = Zeros(*backend, {n, conv_dim});
      Tensor out = Zeros(*backend, {n, 8 * 16});
      backend->CausalConv1dSilu(xt, wt, conv_state, {&seg, 1}, conv_out);
      backend->GatedDeltaRule(conv_out, gt, bt, dims, state, {&seg, 1}, DeltaRuleAlgorithm::kAuto,
                              out);
      const auto host = ToHost(*backend, out);
      r.out.insert(r.out.end(), host.begin(), host.end());
    }
    r.conv_state = ToHost(*backend, conv_state);
    r.state = ToHost(*backend, state);
    return r;
  };
  const Run whole = run(total), pieces = run(5), tokens = run(1);
  EXPECT_EQ(pieces.conv_state, whole.conv_state);
  EXPECT_LT(MaxRelativeError(pieces.out, whole.out), 1e-5);
  EXPECT_LT(MaxRelativeError(pieces.state, whole.state), 1e-5);
  EXPECT_LT(MaxRelativeError(tokens.out, whole.out), 1e-5);
  EXPECT_LT(MaxRelativeError(tokens.state, whole.state), 1e-5);
  ExpectAllClose(pieces.out, whole.out, 1e-5, 1e-4, "5-token prefill out");
  // The state of slot 0 was never touched.
  for (size_t i = 0; i < whole.state.size() / 2; ++i) ASSERT_EQ(pieces.state[i], 0.0f);
}

// A replay of kept rows [begin, begin + n) into state slot `slot`.
SequenceSegment ReplaySegment(int begin, int n, int slot) {
  SequenceSegment s;
  s.token_begin = begin;
  s.num_tokens = n;
  s.state_slot = slot;
  return s;
}

// Speculative decoding's rollback (Backend::ReplayDeltaRuleStates): replaying kept rows of a
// step, for two layers and two sequences at once, leaves the states that running only those
// rows through the conv and the delta rule leaves, and touches no other slot.
TEST(DeltaRuleReplayTest, EqualsRunningTheKeptRows) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(17);
  const DeltaRuleDims dims = Dims(2, 4, 8, 8);
  const int conv_dim = 2 * 2 * 8 + 4 * 8, K = 4, rows = 12, slots = 4, layers = 2;
  // Sequence A: kept rows 6..8 into slot 2; sequence B: row 1 into slot 0.
  const std::vector<SequenceSegment> replays = {ReplaySegment(6, 3, 2), ReplaySegment(1, 1, 0)};
  struct Layer {
    std::vector<float> x, g, beta, w, conv0, state0;
  };
  std::vector<Layer> host(layers);
  for (Layer& l : host) {
    l.x = RandomVector(rng, int64_t{rows} * conv_dim);
    l.g = UniformVector(rng, rows * 4, -4.0f, 0.5f);
    for (float& v : l.g) v = -std::exp(v);
    l.beta = UniformVector(rng, rows * 4, 0.05f, 0.95f);
    l.w = RandomVector(rng, conv_dim * K, 0.5f);
    l.conv0 = RandomVector(rng, slots * conv_dim * (K - 1));
    l.state0 = RandomVector(rng, slots * 4 * 8 * 8, 0.2f);
  }
  std::vector<Tensor> x, g, beta, w, conv, state;
  for (const Layer& l : host) {
    x.push_back(MakeF32(*backend, {rows, conv_dim}, l.x));
    g.push_back(MakeF32(*backend, {rows, 4}, l.g));
    beta.push_back(MakeF32(*backend, {rows, 4}, l.beta));
    w.push_back(MakeF32(*backend, {conv_dim, K}, l.w));
    conv.push_back(MakeF32(*backend, {slots, conv_dim, K - 1}, l.conv0));
    state.push_back(MakeF32(*backend, {slots, 4, 8, 8}, l.state0));
  }
  std::vector<DeltaRuleReplayLayer> replay_layers;
  for (int l = 0; l < layers; ++l) {
    replay_layers.push_back({&x[l], &g[l], &beta[l], &w[l], &conv[l], &state[l]});
  }
  ASSERT_TRUE(backend->ReplayDeltaRuleStates(replay_layers, dims, replays).ok());

  for (int l = 0; l < layers; ++l) {
    // The same rows, packed as a step of two sequences, through the ops.
    std::vector<float> px, pg, pb;
    for (const SequenceSegment& r : replays) {
      for (int t = r.token_begin; t < r.token_begin + r.num_tokens; ++t) {
        px.insert(px.end(), host[l].x.begin() + t * conv_dim,
                  host[l].x.begin() + (t + 1) * conv_dim);
        pg.insert(pg.end(), host[l].g.begin() + t * 4, host[l].g.begin() + (t + 1) * 4);
        pb.insert(pb.end(), host[l].beta.begin() + t * 4, host[l].beta.begin() + (t + 1) * 4);
      }
    }
    const auto step = Pack({3, 1}, {2, 0});
    Tensor conv_ref = MakeF32(*backend, {slots, conv_dim, K - 1}, host[l].conv0);
    Tensor state_ref = MakeF32(*backend, {slots, 4, 8, 8}, host[l].state0);
    Tensor conv_out = Zeros(*backend, {4, conv_dim}), out = Zeros(*backend, {4, 4 * 8});
    backend->CausalConv1dSilu(MakeF32(*backend, {4, conv_dim}, px), w[l], conv_ref, step, conv_out);
    backend->GatedDeltaRule(conv_out, MakeF32(*backend, {4, 4}, pg), MakeF32(*backend, {4, 4}, pb),
                            dims, state_ref, step, DeltaRuleAlgorithm::kAuto, out);
    EXPECT_EQ(ToHost(*backend, conv[l]), ToHost(*backend, conv_ref)) << "layer " << l;
    EXPECT_EQ(ToHost(*backend, state[l]), ToHost(*backend, state_ref)) << "layer " << l;
    // Slots 1 and 3 are nobody's: unchanged (and changed where a sequence was replayed).
    const auto after = ToHost(*backend, state[l]);
    const size_t per_slot = 4 * 8 * 8;
    for (int s : {1, 3}) {
      EXPECT_TRUE(std::equal(after.begin() + s * per_slot, after.begin() + (s + 1) * per_slot,
                             host[l].state0.begin() + s * per_slot));
    }
    EXPECT_FALSE(std::equal(after.begin() + 2 * per_slot, after.begin() + 3 * per_slot,
                            host[l].state0.begin() + 2 * per_slot));
    const auto conv_after = ToHost(*backend, conv[l]);
    const size_t conv_per_slot = static_cast<size_t>(conv_dim) * (K - 1);
    for (int s : {1, 3}) {
      EXPECT_TRUE(std::equal(conv_after.begin() + s * conv_per_slot,
                             conv_after.begin() + (s + 1) * conv_per_slot,
                             host[l].conv0.begin() + s * conv_per_slot));
    }
  }
}

// Bad replays fail with InvalidArgument naming what is wrong, before any state changes.
TEST(DeltaRuleReplayTest, RejectsBadRowsSlotsAndShapes) {
  auto backend = CreateCpuBackend(2);
  std::mt19937 rng(19);
  const DeltaRuleDims dims = Dims(2, 4, 8, 8);
  const int conv_dim = 2 * 2 * 8 + 4 * 8, K = 4, rows = 6, slots = 3;
  Tensor x = MakeF32(*backend, {rows, conv_dim}, RandomVector(rng, rows * conv_dim));
  Tensor g = MakeF32(*backend, {rows, 4}, UniformVector(rng, rows * 4, -2.0f, -0.1f));
  Tensor beta = MakeF32(*backend, {rows, 4}, UniformVector(rng, rows * 4, 0.1f, 0.9f));
  Tensor w = MakeF32(*backend, {conv_dim, K}, RandomVector(rng, conv_dim * K));
  const auto conv0 = RandomVector(rng, slots * conv_dim * (K - 1));
  const auto state0 = RandomVector(rng, slots * 4 * 8 * 8);
  Tensor conv = MakeF32(*backend, {slots, conv_dim, K - 1}, conv0);
  Tensor state = MakeF32(*backend, {slots, 4, 8, 8}, state0);
  Tensor short_g = MakeF32(*backend, {rows - 1, 4}, std::vector<float>((rows - 1) * 4, -1.0f));
  Tensor flat_g = MakeF32(*backend, {rows * 4}, std::vector<float>(rows * 4, -1.0f));
  Tensor short_x =
      MakeF32(*backend, {rows - 1, conv_dim}, std::vector<float>((rows - 1) * conv_dim, 0.5f));
  Tensor wide_w = MakeF32(*backend, {conv_dim, K + 1}, std::vector<float>(conv_dim * (K + 1)));
  const DeltaRuleReplayLayer layer{&x, &g, &beta, &w, &conv, &state};
  auto seg = ReplaySegment;
  struct Case {
    std::vector<DeltaRuleReplayLayer> layers;
    std::vector<SequenceSegment> segments;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{layer}, {seg(4, 3, 0)}, "segment 0: rows [4, +3) outside the 6 kept rows"},
      {{layer}, {seg(-1, 1, 0)}, "segment 0: rows [-1, +1)"},
      {{layer}, {seg(0, 0, 0)}, "segment 0: rows [0, +0)"},
      {{layer}, {seg(0, 1, 3)}, "segment 0: state slot 3 outside [0, 3)"},
      {{layer}, {seg(0, 1, 1), seg(2, 1, 1)}, "segments 0 and 1 share state slot 1"},
      {{layer, {&x, &short_g, &beta, &w, &conv, &state}}, {seg(0, 1, 0)}, "layer 1: mixed"},
      {{layer, {&x, nullptr, &beta, &w, &conv, &state}}, {seg(0, 1, 0)}, "layer 1 lacks a tensor"},
      {{layer}, {seg(0, 1, -1)}, "segment 0: state slot -1 outside [0, 3)"},
      {{layer, {&x, &flat_g, &beta, &w, &conv, &state}}, {seg(0, 1, 0)}, "layer 1: mixed"},
      {{layer, {&short_x, &short_g, &beta, &w, &conv, &state}}, {seg(0, 1, 0)}, "layer 1: mixed"},
      {{layer, {&x, &g, &beta, &wide_w, &conv, &state}}, {seg(0, 1, 0)}, "layer 1: mixed"},
  };
  // Hv must be a multiple of Hk.
  const absl::Status bad_dims =
      backend->ReplayDeltaRuleStates({&layer, 1}, Dims(3, 4, 8, 8), std::vector{seg(0, 1, 0)});
  EXPECT_TRUE(absl::IsInvalidArgument(bad_dims)) << bad_dims;
  EXPECT_NE(bad_dims.message().find("bad dims Hk=3 Hv=4"), std::string::npos) << bad_dims;
  for (const Case& c : cases) {
    const absl::Status s = backend->ReplayDeltaRuleStates(c.layers, dims, c.segments);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s.message();
    EXPECT_EQ(ToHost(*backend, conv), conv0);
    EXPECT_EQ(ToHost(*backend, state), state0);
  }
}

}  // namespace
}  // namespace mobius::kernels
