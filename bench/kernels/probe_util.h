// What the kernel benchmarks share: the median of a run's timings (all three), and for the
// standalone probes (mobius_chain_bench, mobius_persistent_bench) exiting on a failed CUDA call and
// whole-number flag values. Header-only and CUDA-runtime-only, so the probes still run on a GPU
// host with cudart alone.
#ifndef MOBIUS_BENCH_KERNELS_PROBE_UTIL_H_
#define MOBIUS_BENCH_KERNELS_PROBE_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mobius::bench {

// Exits with status 1 and "<tool>: <what>: <CUDA error>" when `err` is not cudaSuccess.
inline void CheckCudaOrExit(const char* tool, cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s: %s\n", tool, what, cudaGetErrorString(err));
  std::exit(1);
}

// The median of `v` (the mean of the middle two for an even count; 0 for none).
template <typename T>
T Median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n == 0) return T{0};
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / T{2};
}

// `text` as a whole decimal number in [lo, hi]; nullopt for anything else.
inline std::optional<long> ParseWholeNumber(std::string_view text, long lo, long hi) {
  const std::string s(text);
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno != 0 || v < lo || v > hi) return std::nullopt;
  return v;
}

}  // namespace mobius::bench

#endif  // MOBIUS_BENCH_KERNELS_PROBE_UTIL_H_
