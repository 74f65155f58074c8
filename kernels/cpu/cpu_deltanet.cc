// Gated DeltaNet ops of the CPU backend: the causal conv, the gates, the delta rule dispatch and
// the gated norm. The per-head delta-rule math lives in delta_rule_head.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_math.h"
#include "kernels/cpu/delta_rule_head.h"

namespace mobius::kernels {

// A segment with state_slot < 0 has no recurrent state: it starts from zeros and its final state
// is dropped (the interface always passes a slot; this only keeps a bad slot from writing out of
// bounds). States are read from state_slot and written to WrittenStateSlot.
void CpuBackend::CausalConv1dSilu(const Tensor& x, const Tensor& w, Tensor& conv_states,
                                  std::span<const SequenceSegment> segments, Tensor& out) {
  // w may be [C, K] or the checkpoint's [C, 1, K].
  const int64_t K = w.dim(-1);
  const int64_t C = w.numel() / K;
  const int64_t km1 = K - 1;
  const int64_t T = x.numel() / C;
  const int64_t num_segments = static_cast<int64_t>(segments.size());
  if (T == 0) return;
  const float* xp = x.data<float>();
  float* states = conv_states.data<float>();
  float* op = out.data<float>();

  // Time-major copies so that the inner loops run over contiguous channels: weights [K, C] and
  // each segment's history [K-1, C] (oldest first), taken before any state is overwritten.
  std::vector<float> wt(static_cast<size_t>(K * C));
  const float* wp = w.data<float>();
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t j = 0; j < K; ++j) wt[j * C + c] = wp[c * K + j];
  }
  std::vector<float> hist(static_cast<size_t>(num_segments * km1 * C), 0.0f);
  std::vector<int32_t> segment_of(static_cast<size_t>(T), -1);
  for (int64_t s = 0; s < num_segments; ++s) {
    const SequenceSegment& seg = segments[s];
    for (int32_t i = 0; i < seg.num_tokens; ++i) segment_of[seg.token_begin + i] = s;
    if (seg.state_slot < 0) continue;
    const float* st = states + seg.state_slot * C * km1;
    float* h = hist.data() + s * km1 * C;
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t i = 0; i < km1; ++i) h[i * C + c] = st[c * km1 + i];
    }
  }

#pragma omp parallel for num_threads(num_threads_) \
    schedule(static) if (T * C * K > cpu::kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    float* o = op + t * C;
    std::fill(o, o + C, 0.0f);
    const int32_t s = segment_of[t];
    if (s < 0) continue;
    const int64_t begin = segments[s].token_begin;
    const int64_t rel = t - begin;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t src = rel - km1 + j;  // position relative to the segment start
      const float* row =
          src >= 0 ? xp + (begin + src) * C : hist.data() + (s * km1 + km1 + src) * C;
      const float* wj = wt.data() + j * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += wj[c] * row[c];
    }
    for (int64_t c = 0; c < C; ++c) o[c] = cpu::Silu(o[c]);
  }

  // New state: the last K-1 inputs of (old history, this segment's inputs).
#pragma omp parallel for num_threads(num_threads_) if (num_segments * C * km1 > cpu::kParallelGrain)
  for (int64_t s = 0; s < num_segments; ++s) {
    const SequenceSegment& seg = segments[s];
    if (seg.state_slot < 0 || seg.num_tokens == 0) continue;
    // The history was taken above, so the new state may go to another slot as well as in place.
    float* st = states + int64_t{WrittenStateSlot(seg)} * C * km1;
    const float* h = hist.data() + s * km1 * C;
    for (int64_t i = 0; i < km1; ++i) {
      const int64_t p = seg.num_tokens - km1 + i;
      const float* row = p >= 0 ? xp + (seg.token_begin + p) * C : h + (p + km1) * C;
      for (int64_t c = 0; c < C; ++c) st[c * km1 + i] = row[c];
    }
  }
}

void CpuBackend::DeltaRuleGates(const Tensor& a, const Tensor& b, const Tensor& a_log,
                                const Tensor& dt_bias, Tensor& g, Tensor& beta) {
  const int64_t Hv = a_log.numel();
  const int64_t T = Hv == 0 ? 0 : a.numel() / Hv;
  const float* ap = a.data<float>();
  const float* bp = b.data<float>();
  const float* alog = a_log.data<float>();
  const float* bias = dt_bias.data<float>();
  float* gp = g.data<float>();
  float* betap = beta.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t i = t * Hv + h;
      const float u = ap[i] + bias[h];
      const float softplus = u > 20.0f ? u : std::log1p(std::exp(u));
      gp[i] = -std::exp(alog[h]) * softplus;
      betap[i] = cpu::Sigmoid(bp[i]);
    }
  }
}

void CpuBackend::GatedDeltaRule(const Tensor& qkv, const Tensor& g, const Tensor& beta,
                                const DeltaRuleDims& dims, Tensor& recurrent_states,
                                std::span<const SequenceSegment> segments,
                                DeltaRuleAlgorithm algorithm, Tensor& out) {
  const int Hk = dims.num_k_heads, Hv = dims.num_v_heads, Dk = dims.k_head_dim,
            Dv = dims.v_head_dim;
  const int64_t key_dim = int64_t{Hk} * Dk;
  const int64_t conv_dim = 2 * key_dim + int64_t{Hv} * Dv;
  const int64_t T = qkv.numel() / conv_dim;
  if (T == 0 || Hv == 0) return;
  const int group = Hv / Hk;
  const float* in = qkv.data<float>();

  // l2-normalised q (scaled by Dk^-0.5) and k, [T, Hk, Dk] each.
  std::vector<float> qn(static_cast<size_t>(T * key_dim)), kn(static_cast<size_t>(T * key_dim));
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
#pragma omp parallel for num_threads(num_threads_) if (T * key_dim > cpu::kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < 2 * Hk; ++h) {
      const float* src = in + t * conv_dim + h * Dk;
      float* dst = (h < Hk ? qn.data() + h * Dk : kn.data() + (h - Hk) * Dk) + t * key_dim;
      float sum = 0.0f;
      for (int i = 0; i < Dk; ++i) sum += src[i] * src[i];
      const float scale = (h < Hk ? q_scale : 1.0f) / std::sqrt(sum + 1e-6f);
      for (int i = 0; i < Dk; ++i) dst[i] = src[i] * scale;
    }
  }

  // One task per (segment, value head); each owns its state slice, so they run independently.
  const int64_t num_tasks = static_cast<int64_t>(segments.size()) * Hv;
  const int64_t state_elems = int64_t{Dk} * Dv;
  float* states = recurrent_states.data<float>();
#pragma omp parallel for num_threads(num_threads_) schedule(dynamic, 1)
  for (int64_t task = 0; task < num_tasks; ++task) {
    const SequenceSegment& seg = segments[task / Hv];
    const int vh = static_cast<int>(task % Hv);
    if (seg.num_tokens <= 0) continue;
    const int kh = vh / group;
    const int64_t begin = seg.token_begin;
    cpu::DeltaRuleHeadView view;
    view.q = qn.data() + begin * key_dim + kh * Dk;
    view.k = kn.data() + begin * key_dim + kh * Dk;
    view.qk_stride = key_dim;
    view.v = in + begin * conv_dim + 2 * key_dim + int64_t{vh} * Dv;
    view.v_stride = conv_dim;
    view.g = g.data<float>() + begin * Hv + vh;
    view.beta = beta.data<float>() + begin * Hv + vh;
    view.gate_stride = Hv;
    view.out = out.data<float>() + begin * Hv * Dv + int64_t{vh} * Dv;
    view.out_stride = int64_t{Hv} * Dv;
    view.num_tokens = seg.num_tokens;
    view.dk = Dk;
    view.dv = Dv;

    std::vector<float> scratch_state;
    float* state;
    if (seg.state_slot >= 0) {
      // Continued from state_slot; the head's slice is updated where it is to end up.
      state = states + (int64_t{WrittenStateSlot(seg)} * Hv + vh) * state_elems;
      if (WrittenStateSlot(seg) != seg.state_slot) {
        const float* from = states + (int64_t{seg.state_slot} * Hv + vh) * state_elems;
        std::copy(from, from + state_elems, state);
      }
    } else {
      scratch_state.assign(static_cast<size_t>(state_elems), 0.0f);
      state = scratch_state.data();
    }
    const bool recurrent = algorithm == DeltaRuleAlgorithm::kRecurrent ||
                           (algorithm == DeltaRuleAlgorithm::kAuto && seg.num_tokens == 1);
    if (recurrent) {
      cpu::DeltaRuleRecurrentHead(view, state);
    } else {
      cpu::DeltaRuleChunkedHead(view, state);
    }
  }
}

void CpuBackend::GatedRmsNorm(const Tensor& x, const Tensor& z, const Tensor& w, float eps,
                              Tensor& out) {
  const int64_t D = w.numel();
  const int64_t R = D == 0 ? 0 : x.numel() / D;
  const float* xp = x.data<float>();
  const float* zp = z.data<float>();
  const float* wp = w.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for num_threads(num_threads_) if (R * D > cpu::kParallelGrain)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = xp + r * D;
    const float* zr = zp + r * D;
    float* orow = op + r * D;
    const float scale = cpu::RmsScale(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) orow[i] = xr[i] * scale * wp[i] * cpu::Silu(zr[i]);
  }
}

}  // namespace mobius::kernels
