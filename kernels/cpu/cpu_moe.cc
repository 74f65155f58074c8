// Mixture-of-experts ops of the CPU backend: router top-k and the routed expert MLPs.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_math.h"

namespace mobius::kernels {
namespace {

// Experts routed at least this many tokens go through sgemm; fewer run as dot products.
constexpr int64_t kGemmMinRows = 16;

float Dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

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
  std::vector<int64_t> pair_of_slot(static_cast<size_t>(T * k), -1);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = int64_t{idp[i]} - first_expert;
    if (e < 0 || e >= num_local) continue;
    const int64_t at = cursor[e]++;
    pair_token[at] = static_cast<int32_t>(i / k);
    pair_of_slot[i] = at;
  }

  const float* xp = x.data<float>();
  float* op = out.data<float>();
  const float* gate_up_p = gate_up.data<float>();
  const float* down_p = down.data<float>();

  // Expert outputs per pair, [num_pairs, H], in pair (expert-sorted) order.
  std::vector<float> y(static_cast<size_t>(num_pairs * H));
  std::vector<int64_t> big, small;
  for (int64_t e = 0; e < num_local; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n >= kGemmMinRows) {
      big.push_back(e);
    } else if (n > 0) {
      small.push_back(e);
    }
  }

  // Experts with many tokens: one sgemm each, threaded inside OpenBLAS.
  if (!big.empty()) {
    int64_t max_rows = 0;
    for (int64_t e : big) max_rows = std::max(max_rows, offsets[e + 1] - offsets[e]);
    std::vector<float> xe(static_cast<size_t>(max_rows * H)),
        gu(static_cast<size_t>(max_rows * 2 * I)), act(static_cast<size_t>(max_rows * I));
    for (int64_t e : big) {
      const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
      for (int64_t r = 0; r < n; ++r) {
        std::memcpy(xe.data() + r * H, xp + int64_t{pair_token[begin + r]} * H, H * sizeof(float));
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n),
                  static_cast<int>(2 * I), static_cast<int>(H), 1.0f, xe.data(),
                  static_cast<int>(H), gate_up_p + e * 2 * I * H, static_cast<int>(H), 0.0f,
                  gu.data(), static_cast<int>(2 * I));
      for (int64_t r = 0; r < n; ++r) {
        const float* g = gu.data() + r * 2 * I;
        float* a = act.data() + r * I;
        for (int64_t i = 0; i < I; ++i) a[i] = cpu::Silu(g[i]) * g[I + i];
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(H),
                  static_cast<int>(I), 1.0f, act.data(), static_cast<int>(I), down_p + e * H * I,
                  static_cast<int>(I), 0.0f, y.data() + begin * H, static_cast<int>(H));
    }
  }

  // Experts with a few tokens (decode): one expert per OpenMP thread, each weight row read once
  // and dotted with the expert's token rows. OpenBLAS is not called from inside the team.
#pragma omp parallel num_threads(num_threads_) if (small.size() > 1)
  {
    std::vector<float> gu(static_cast<size_t>(kGemmMinRows * 2 * I)),
        act(static_cast<size_t>(kGemmMinRows * I));
#pragma omp for schedule(dynamic, 1)
    for (size_t idx = 0; idx < small.size(); ++idx) {
      const int64_t e = small[idx];
      const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
      const float* wgu = gate_up_p + e * 2 * I * H;
      for (int64_t o = 0; o < 2 * I; ++o) {
        for (int64_t r = 0; r < n; ++r) {
          gu[r * 2 * I + o] = Dot(xp + int64_t{pair_token[begin + r]} * H, wgu + o * H, H);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t i = 0; i < I; ++i) {
          act[r * I + i] = cpu::Silu(gu[r * 2 * I + i]) * gu[r * 2 * I + I + i];
        }
      }
      const float* wd = down_p + e * H * I;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t r = 0; r < n; ++r)
          y[(begin + r) * H + h] = Dot(act.data() + r * I, wd + h * I, I);
      }
    }
  }

  // Weighted scatter-add, parallel over tokens; each token adds its experts in slot order, so the
  // result does not depend on the thread count.
#pragma omp parallel for num_threads(num_threads_) if (num_pairs * H > cpu::kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    float* orow = op + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = pair_of_slot[t * k + j];
      if (at < 0) continue;
      const float* yr = y.data() + at * H;
      const float weight = wp[t * k + j];
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] += weight * yr[i];
    }
  }
}

}  // namespace mobius::kernels
