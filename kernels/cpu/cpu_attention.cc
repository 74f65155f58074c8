// Gated full-attention ops of the CPU backend: q/k norm + RoPE, paged KV writes and causal GQA
// attention over the paged cache.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_math.h"

namespace mobius::kernels {
namespace {

// Absolute position of every packed token (cached_tokens + index within its segment).
std::vector<int64_t> TokenPositions(std::span<const SequenceSegment> segments, int64_t T) {
  std::vector<int64_t> pos(static_cast<size_t>(T), 0);
  for (const SequenceSegment& seg : segments) {
    for (int32_t i = 0; i < seg.num_tokens; ++i) {
      pos[seg.token_begin + i] = int64_t{seg.cached_tokens} + i;
    }
  }
  return pos;
}

// out = RmsNorm1p(x) then rotate-half RoPE on the first rotary_dim dims with the given cos/sin.
void NormRopeHead(const float* x, const float* w, float eps, int64_t hd, int64_t half,
                  const float* cos, const float* sin, float* out) {
  const float scale = cpu::RmsScale(x, hd, eps);
  for (int64_t i = 0; i < hd; ++i) out[i] = x[i] * scale * (1.0f + w[i]);
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = out[j], x2 = out[j + half];
    out[j] = x1 * cos[j] - x2 * sin[j];
    out[j + half] = x2 * cos[j] + x1 * sin[j];
  }
}

}  // namespace

void CpuBackend::QkNormRope(const Tensor& q_gate, Tensor& k, const Tensor& q_norm,
                            const Tensor& k_norm, float eps, const RopeParams& rope,
                            std::span<const SequenceSegment> segments, Tensor& q, Tensor& gate) {
  const int64_t hd = q_norm.numel();
  const int64_t T = q_gate.dim(0);
  if (T == 0 || hd == 0) return;
  const int64_t nh = q_gate.numel() / (T * 2 * hd);
  const int64_t nkv = k.numel() / (T * hd);
  const int64_t half = rope.rotary_dim / 2;

  // Matches the PyTorch reference bit for bit in its fp32 steps:
  // inv_freq = 1 / theta^(float(2j) / rd), angle = float(pos) * inv_freq, then cos/sin in fp32.
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(rope.rotary_dim);
    inv_freq[j] = 1.0f / std::pow(rope.theta, exponent);
  }
  const std::vector<int64_t> pos = TokenPositions(segments, T);
  const float* qg = q_gate.data<float>();
  float* kp = k.data<float>();
  float* qp = q.data<float>();
  float* gp = gate.data<float>();
  const float* qw = q_norm.data<float>();
  const float* kw = k_norm.data<float>();
  std::vector<float> head(static_cast<size_t>(hd));

#pragma omp parallel for num_threads(num_threads_) \
    firstprivate(head) if (T * (nh + nkv) * hd > cpu::kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> cos(static_cast<size_t>(half)), sin(static_cast<size_t>(half));
    const float p = static_cast<float>(pos[t]);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = p * inv_freq[j];
      cos[j] = std::cos(angle);
      sin[j] = std::sin(angle);
    }
    for (int64_t h = 0; h < nh; ++h) {
      const float* src = qg + (t * nh + h) * 2 * hd;
      NormRopeHead(src, qw, eps, hd, half, cos.data(), sin.data(), qp + (t * nh + h) * hd);
      std::memcpy(gp + (t * nh + h) * hd, src + hd, hd * sizeof(float));
    }
    for (int64_t h = 0; h < nkv; ++h) {
      float* kh = kp + (t * nkv + h) * hd;
      std::copy(kh, kh + hd, head.begin());
      NormRopeHead(head.data(), kw, eps, hd, half, cos.data(), sin.data(), kh);
    }
  }
}

void CpuBackend::WriteKvCache(const Tensor& k, const Tensor& v,
                              std::span<const SequenceSegment> segments, Tensor& k_cache,
                              Tensor& v_cache) {
  const int64_t block_size = k_cache.dim(1);
  const int64_t row = k_cache.dim(2) * k_cache.dim(3);
  const float* kp = k.data<float>();
  const float* vp = v.data<float>();
  float* kc = k_cache.data<float>();
  float* vc = v_cache.data<float>();
  for (const SequenceSegment& seg : segments) {
    for (int32_t i = 0; i < seg.num_tokens; ++i) {
      const int64_t p = int64_t{seg.cached_tokens} + i;
      const int64_t slot = int64_t{seg.kv_blocks[p / block_size]} * block_size + p % block_size;
      const int64_t t = seg.token_begin + i;
      std::memcpy(kc + slot * row, kp + t * row, row * sizeof(float));
      std::memcpy(vc + slot * row, vp + t * row, row * sizeof(float));
    }
  }
}

void CpuBackend::PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                std::span<const SequenceSegment> segments, float scale,
                                Tensor& out) {
  const int64_t block_size = k_cache.dim(1);
  const int64_t nkv = k_cache.dim(2);
  const int64_t hd = k_cache.dim(3);
  const int64_t T = q.dim(0);
  if (T == 0) return;
  const int64_t nh = q.numel() / (T * hd);
  const int64_t group = nh / nkv;
  const float* qp = q.data<float>();
  const float* kc = k_cache.data<float>();
  const float* vc = v_cache.data<float>();
  float* op = out.data<float>();

  std::vector<int32_t> segment_of(static_cast<size_t>(T), -1);
  for (size_t s = 0; s < segments.size(); ++s) {
    for (int32_t i = 0; i < segments[s].num_tokens; ++i) {
      segment_of[segments[s].token_begin + i] = static_cast<int32_t>(s);
    }
  }

#pragma omp parallel num_threads(num_threads_)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < T * nh; ++task) {
      const int64_t t = task / nh, h = task % nh, kvh = h / group;
      const float* qv = qp + task * hd;
      float* o = op + task * hd;
      std::fill(o, o + hd, 0.0f);
      if (segment_of[t] < 0) continue;
      const SequenceSegment& seg = segments[segment_of[t]];
      const int64_t context = int64_t{seg.cached_tokens} + (t - seg.token_begin) + 1;
      auto cache_offset = [&](int64_t p) {
        const int64_t slot = int64_t{seg.kv_blocks[p / block_size]} * block_size + p % block_size;
        return (slot * nkv + kvh) * hd;
      };
      scores.resize(static_cast<size_t>(context));
      float max_score = -INFINITY;
      for (int64_t p = 0; p < context; ++p) {
        const float* kv = kc + cache_offset(p);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < hd; ++i) dot += qv[i] * kv[i];
        scores[p] = dot * scale;
        max_score = std::max(max_score, scores[p]);
      }
      float sum = 0.0f;
      for (int64_t p = 0; p < context; ++p) {
        scores[p] = std::exp(scores[p] - max_score);
        sum += scores[p];
      }
      for (int64_t p = 0; p < context; ++p) {
        const float* vv = vc + cache_offset(p);
        const float weight = scores[p];
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) o[i] += weight * vv[i];
      }
      const float inv = 1.0f / sum;
      for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
    }
  }
}

}  // namespace mobius::kernels
