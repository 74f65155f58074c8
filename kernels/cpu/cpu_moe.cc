// Mixture-of-experts ops of the CPU backend: router top-k and the routed expert MLPs.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_math.h"

namespace mobius::kernels {

// If k > E the surplus columns get id -1 and weight 0 (the interface leaves this undefined).
void CpuBackend::TopKSoftmax(const Tensor& logits, int k, bool renormalize, Tensor& ids,
                             Tensor& weights) {
  const int64_t E = logits.dim(-1);
  const int64_t T = E == 0 ? 0 : logits.numel() / E;
  if (T == 0 || k <= 0) return;
  const float* lp = logits.data<float>();
  int32_t* idp = ids.data<int32_t>();
  float* wp = weights.data<float>();

#pragma omp parallel num_threads(num_threads_) if (T * E > cpu::kParallelGrain)
  {
    std::vector<float> probs(static_cast<size_t>(E));
#pragma omp for
    for (int64_t t = 0; t < T; ++t) {
      const float* row = lp + t * E;
      float max_logit = -INFINITY;
      for (int64_t e = 0; e < E; ++e) max_logit = std::max(max_logit, row[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        probs[e] = std::exp(row[e] - max_logit);
        sum += probs[e];
      }
      const float inv_sum = 1.0f / sum;
      for (int64_t e = 0; e < E; ++e) probs[e] *= inv_sum;

      // Sorted insertion into the k best, scanning ids upwards: a later id displaces an entry
      // only when strictly larger, so ties keep the lower id first.
      int32_t* best_id = idp + t * k;
      float* best_p = wp + t * k;
      int filled = 0;
      for (int64_t e = 0; e < E; ++e) {
        const float p = probs[e];
        if (filled == k && !(p > best_p[k - 1])) continue;
        int pos = filled < k ? filled : k - 1;
        while (pos > 0 && best_p[pos - 1] < p) {
          best_p[pos] = best_p[pos - 1];
          best_id[pos] = best_id[pos - 1];
          --pos;
        }
        best_p[pos] = p;
        best_id[pos] = static_cast<int32_t>(e);
        if (filled < k) ++filled;
      }
      for (int j = filled; j < k; ++j) {
        best_id[j] = -1;
        best_p[j] = 0.0f;
      }
      if (renormalize) {
        float selected = 0.0f;
        for (int j = 0; j < filled; ++j) selected += best_p[j];
        const float inv = 1.0f / selected;
        for (int j = 0; j < filled; ++j) best_p[j] *= inv;
      }
    }
  }
}

void CpuBackend::MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                            const Tensor& gate_up, const Tensor& down, int first_expert,
                            Tensor& out, std::span<int64_t> expert_tokens) {
  const int64_t H = x.dim(-1);
  const int64_t T = H == 0 ? 0 : x.numel() / H;
  const int64_t k = T == 0 ? 0 : ids.numel() / T;
  const int64_t num_local = gate_up.dim(0);
  const int64_t I = gate_up.dim(1) / 2;
  if (T == 0 || k == 0 || num_local == 0) return;
  const int32_t* idp = ids.data<int32_t>();
  const float* wp = weights.data<float>();

  // Counting sort of the (token, slot) pairs by local expert, tokens ascending within an expert.
  std::vector<int64_t> offsets(static_cast<size_t>(num_local + 1), 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = int64_t{idp[i]} - first_expert;
    if (e >= 0 && e < num_local) ++offsets[e + 1];
  }
  if (!expert_tokens.empty()) {
    for (int64_t e = 0; e < num_local; ++e) expert_tokens[e] += offsets[e + 1];
  }
  for (int64_t e = 0; e < num_local; ++e) offsets[e + 1] += offsets[e];
  const int64_t num_pairs = offsets[num_local];
  if (num_pairs == 0) return;
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  std::vector<int32_t> pair_token(static_cast<size_t>(num_pairs));
  std::vector<float> pair_weight(static_cast<size_t>(num_pairs));
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = int64_t{idp[i]} - first_expert;
    if (e < 0 || e >= num_local) continue;
    const int64_t at = cursor[e]++;
    pair_token[at] = static_cast<int32_t>(i / k);
    pair_weight[at] = wp[i];
  }

  int64_t max_rows = 0;
  for (int64_t e = 0; e < num_local; ++e)
    max_rows = std::max(max_rows, offsets[e + 1] - offsets[e]);
  std::vector<float> xe(static_cast<size_t>(max_rows * H)),
      gu(static_cast<size_t>(max_rows * 2 * I)), act(static_cast<size_t>(max_rows * I)),
      ye(static_cast<size_t>(max_rows * H));
  const float* xp = x.data<float>();
  float* op = out.data<float>();

  // Experts run one after another so that the scatter-add into `out` needs no synchronisation;
  // the parallelism is inside the sgemm calls.
  for (int64_t e = 0; e < num_local; ++e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    if (n == 0) continue;
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(xe.data() + r * H, xp + int64_t{pair_token[begin + r]} * H, H * sizeof(float));
    }
    const float* w_gate_up = gate_up.data<float>() + e * 2 * I * H;
    const float* w_down = down.data<float>() + e * H * I;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n),
                static_cast<int>(2 * I), static_cast<int>(H), 1.0f, xe.data(), static_cast<int>(H),
                w_gate_up, static_cast<int>(H), 0.0f, gu.data(), static_cast<int>(2 * I));
    for (int64_t r = 0; r < n; ++r) {
      const float* g = gu.data() + r * 2 * I;
      float* a = act.data() + r * I;
      for (int64_t i = 0; i < I; ++i) a[i] = cpu::Silu(g[i]) * g[I + i];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(H),
                static_cast<int>(I), 1.0f, act.data(), static_cast<int>(I), w_down,
                static_cast<int>(I), 0.0f, ye.data(), static_cast<int>(H));
    for (int64_t r = 0; r < n; ++r) {
      float* orow = op + int64_t{pair_token[begin + r]} * H;
      const float* y = ye.data() + r * H;
      const float weight = pair_weight[begin + r];
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] += weight * y[i];
    }
  }
}

}  // namespace mobius::kernels
