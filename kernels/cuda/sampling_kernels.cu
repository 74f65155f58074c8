// From logits to tokens on the device: the greedy argmax (Backend::ArgmaxRows), a request's
// penalties (Backend::PenalizeRows) and the draw under a sampling rule (Backend::SampleRows), one
// block (or cluster) per row, so that only token ids come back to the host instead of
// [rows, vocab] fp32 logits (254 MB at batch 256 with a 248K vocabulary).
//
// SampleRows follows the host rule of kernels/token_sampling.cc step by step: the same weights
// exp((logit - max) / T), the same logit bins to find the truncation candidates, the same order
// (logit, ties: lower id first), kept set and walk of the draw. Sums are taken in a different
// order (per-thread chunks, then a block scan), so a draw whose u falls within rounding of a
// boundary between two tokens may pick the neighbour.
//
// In a speculative verify step a row may instead check a draft (kernels::CheckDraft): the
// draft's probability under the rule, and a draw from the rule's distribution without the draft
// whose walk goes in id order (the host's order for that draw), also over the kept candidates of
// a truncating rule, which block 0 then sorts a second time, by id.
#include <cfloat>
#include <climits>
#include <cstdint>

#include <cooperative_groups.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ranked_lists.cuh"
#include "kernels/token_sampling.h"

namespace mobius::kernels::cuda {
namespace {

namespace cg = cooperative_groups;

// (value, index) merge for the argmax: the larger value, the lower index among equals.
__device__ __forceinline__ void ArgmaxMerge(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

// ids[r] = argmax of row r (fp32, lowest index among equal maxima): a strided scan per thread,
// then warp and block reductions on (value, index). With kCluster > 1 a row is split over a
// cluster of that many blocks (small batches: one block reads a 1 MB row at ~35 GB/s), whose
// results block 0 merges through distributed shared memory.
constexpr int kArgmaxThreads = 512;
template <int kCluster>
__global__ void __launch_bounds__(kArgmaxThreads)
    ArgmaxRowsKernel(const float* logits, int64_t vocab, int32_t* ids) {
  PdlWait();
  PdlTrigger();
  __shared__ float best_v[kArgmaxThreads / 32];
  __shared__ int best_i[kArgmaxThreads / 32];
  const int64_t row_index = blockIdx.x / kCluster;
  const int rank = static_cast<int>(blockIdx.x % kCluster);
  const float* row = logits + row_index * vocab;
  const int64_t piece = (vocab + kCluster - 1) / kCluster;
  const int64_t begin = min(vocab, rank * piece), end = min(vocab, begin + piece);
  float v = -INFINITY;
  int i = INT_MAX;
  for (int64_t c = begin + threadIdx.x; c < end; c += kArgmaxThreads) {
    ArgmaxMerge(v, i, row[c], static_cast<int>(c));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgmaxMerge(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w) ArgmaxMerge(v, i, best_v[w], best_i[w]);
    best_v[0] = v;
    best_i[0] = i;
  }
  if constexpr (kCluster > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's result is published
    if (rank == 0 && threadIdx.x == 0) {
      for (int r = 1; r < kCluster; ++r) {
        ArgmaxMerge(v, i, *cluster.map_shared_rank(&best_v[0], r),
                    *cluster.map_shared_rank(&best_i[0], r));
      }
    }
    cluster.sync();  // read before any block exits
  }
  if (rank == 0 && threadIdx.x == 0) ids[row_index] = i == INT_MAX ? 0 : i;  // all NaN/-inf: 0
}

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
static_assert(kSampleWarps == 32, "the block scan's second level is one warp");
// As TruncateCandidates: kBins bins over kSpan temperatures below the maximum, the rest in one
// last bin.
constexpr int kBins = 1024;
constexpr float kSpan = 40.0f;
static_assert(kBins == kSampleThreads, "one bin per thread in the bin scans");
constexpr int kCandidatesPerThread = kMaxSampleCandidates / kSampleThreads;
static_assert(kMaxSampleCandidates % kSampleThreads == 0);

// exp((x - max) / T) as the host's weights: 0 below e^-87 and for NaN.
__device__ __forceinline__ float SampleWeight(float x, float max_logit, float temperature) {
  const float d = (x - max_logit) / temperature;
  return d >= -87.0f ? expf(d) : 0.0f;
}

// Sort key of a candidate: ascending keys are descending logits, ties by ascending id.
__device__ __forceinline__ unsigned long long CandidateKey(float logit, int id) {
  uint32_t b = __float_as_uint(logit == 0.0f ? 0.0f : logit);  // -0 ties with +0, as on the host
  b = (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);         // ascending with the float
  return (static_cast<unsigned long long>(~b) << 32) | static_cast<uint32_t>(id);
}

// The warp's inclusive and exclusive prefix sums of one value per lane.
template <typename T>
__device__ __forceinline__ void WarpScan(T v, T& inclusive, T& exclusive) {
  const int lane = threadIdx.x & 31;
  inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = T(0);
}

// Exclusive scan of one value per thread of the block; `total` receives the block's sum.
// `warp_sums` holds kSampleWarps + 1 entries. Every thread must call it.
template <typename T>
__device__ T BlockExclusiveScan(T v, T* warp_sums, T& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T inclusive, exclusive;
  WarpScan(v, inclusive, exclusive);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    T w_inclusive, w_exclusive;
    WarpScan(warp_sums[lane], w_inclusive, w_exclusive);
    __syncwarp();
    warp_sums[lane] = w_exclusive;
    if (lane == 31) warp_sums[kSampleWarps] = w_inclusive;
  }
  __syncthreads();
  const T result = warp_sums[warp] + exclusive;
  total = warp_sums[kSampleWarps];
  __syncthreads();  // warp_sums may be reused once every thread has read it
  return result;
}

// Sorts keys[0, padded) ascending (padded: a power of two); every thread of the block calls it.
__device__ void BlockBitonicSort(unsigned long long* keys, int padded) {
  for (int k = 2; k <= padded; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < padded; i += kSampleThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const unsigned long long a = keys[i], b = keys[partner];
          if ((a > b) == ((i & k) == 0)) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// The probabilities of this thread's sorted candidates i = tid * kCandidatesPerThread + j (ids in
// the keys' low 32 bits) below `count`, 0 past it and for the token `skip`; returns their sum.
__device__ __forceinline__ double CandidateProbabilities(const unsigned long long* keys, int count,
                                                         int skip, const float* row,
                                                         float max_logit, float temperature,
                                                         double inv_z,
                                                         double (&p)[kCandidatesPerThread]) {
  double local = 0.0;
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    const int i = threadIdx.x * kCandidatesPerThread + j;
    p[j] = 0.0;
    const int id = i < count ? static_cast<int>(keys[i] & 0xffffffffu) : -1;
    if (id >= 0 && id != skip) {
      p[j] = static_cast<double>(SampleWeight(row[id], max_logit, temperature)) * inv_z;
    }
    local += p[j];
  }
  return local;
}

// The draw's walk over this thread's candidates below `count` with positive probability p[j]:
// the first whose running sum (from `before`, the block's exclusive scan) passes `target` goes to
// *pick (atomic min), each to *last_positive (atomic max: rounding may leave the target past
// every candidate).
__device__ __forceinline__ void MarkDraw(const double (&p)[kCandidatesPerThread], double before,
                                         int count, double target, int* pick, int* last_positive) {
  double acc = before;
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    const int i = threadIdx.x * kCandidatesPerThread + j;
    acc += p[j];
    if (i >= count || !(p[j] > 0.0)) continue;
    atomicMax(last_positive, i);
    if (target < acc) atomicMin(pick, i);
  }
}

// One row per block, or (kCluster > 1, small batches) per cluster of kCluster blocks that each
// take a contiguous piece of the row and combine through distributed shared memory: the maximum,
// the weight sums (each block's offset in id order), the bins, and in the end the candidates,
// which block 0 sorts and draws from alone.
template <int kCluster>
__global__ void __launch_bounds__(kSampleThreads)
    SampleRowsKernel(const float* logits, int64_t vocab, const SampleRowParams* params,
                     SampleRowResult* results) {
  __shared__ float best_v[kSampleWarps];
  __shared__ int best_i[kSampleWarps];
  __shared__ double double_sums[kSampleWarps + 1];
  __shared__ int int_sums[kSampleWarps + 1];
  // The bins while the candidates are found, then the candidates' sort keys.
  __shared__ union {
    struct {
      int count[kBins + 1];
      float mass[kBins + 1];
    } bins;
    unsigned long long keys[kMaxSampleCandidates];
  } shared;
  __shared__ int s_token, s_last_bin, s_num_candidates, s_cut, s_pick, s_last_positive;
  __shared__ double s_block_sum, s_p_max, s_kept_mass, s_draft_p;

  PdlWait();
  PdlTrigger();
  const int64_t row_index = blockIdx.x / kCluster;
  const int rank = static_cast<int>(blockIdx.x % kCluster);
  const float* row = logits + row_index * vocab;
  const SampleRowParams prm = params[row_index];
  const int tid = threadIdx.x;
  // A checked row (CheckDraft): the draft (kNoDraft: none) is left out of the draw's walk.
  const bool check = prm.draft != kPlainDraw;
  const int draft = check && prm.draft >= 0 && prm.draft < vocab ? prm.draft : -1;
  // A barrier of the blocks that share the row (of the block alone without a cluster).
  auto row_sync = [] {
    if constexpr (kCluster > 1) {
      cg::this_cluster().sync();
    } else {
      __syncthreads();
    }
  };
  // `var` of the row's block `r` (this block's own without a cluster).
  auto of_rank = [](auto* var, int r) {
    if constexpr (kCluster > 1) {
      return cg::this_cluster().map_shared_rank(var, r);
    } else {
      return var;
    }
  };
  const int64_t piece = (vocab + kCluster - 1) / kCluster;
  const int64_t piece_begin = min(vocab, rank * piece);
  const int64_t piece_end = min(vocab, piece_begin + piece);

  // 1. The maximum (and argmax: the greedy token).
  float v = -INFINITY;
  int arg = INT_MAX;
  for (int64_t c = piece_begin + tid; c < piece_end; c += kSampleThreads) {
    ArgmaxMerge(v, arg, row[c], static_cast<int>(c));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgmaxMerge(v, arg, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, arg, o));
  }
  if ((tid & 31) == 0) {
    best_v[tid >> 5] = v;
    best_i[tid >> 5] = arg;
  }
  const bool greedy = !(prm.temperature > 0.0f);
  const float temperature = greedy ? 1.0f : prm.temperature;
  const bool top_k = !greedy && prm.top_k > 0 && prm.top_k < vocab;
  const bool truncates = top_k || (!greedy && (prm.top_p < 1.0f || prm.min_p > 0.0f));
  if (truncates) {
    for (int b = tid; b <= kBins; b += kSampleThreads) {
      shared.bins.count[b] = 0;
      shared.bins.mass[b] = 0.0f;
    }
  }
  if (tid == 0) {
    s_token = INT_MAX;
    s_last_bin = kBins;
    s_num_candidates = 0;
    s_last_positive = -1;
  }
  __syncthreads();
  if (tid < 32) {
    v = best_v[tid];
    arg = best_i[tid];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ArgmaxMerge(v, arg, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, arg, o));
    }
    // Lane 0 holds this block's result; best_v[0] / best_i[0] publish it to the cluster.
    if (tid == 0) {
      best_v[0] = v;
      best_i[0] = arg;
    }
  }
  row_sync();
  float max_logit = best_v[0];
  int argmax = best_i[0];
  if constexpr (kCluster > 1) {
    // Every block merges the pieces in rank order: the same result everywhere.
    max_logit = -INFINITY;
    argmax = INT_MAX;
    for (int r = 0; r < kCluster; ++r) {
      ArgmaxMerge(max_logit, argmax, *of_rank(&best_v[0], r), *of_rank(&best_i[0], r));
    }
  }
  if (argmax == INT_MAX) argmax = 0;  // an all-NaN or -inf row: token 0

  // 2. Weights over contiguous chunks (id order, for the draw's walk) and, when truncating, the
  // bins: counts (top-k and the candidates' number) and weight mass (top-p).
  const float width = kSpan * temperature / kBins;
  auto bin_of = [&](float x) {
    const float d = (max_logit - x) / width;
    return d < static_cast<float>(kBins) ? static_cast<int>(d) : kBins;
  };
  const int64_t chunk = (piece_end - piece_begin + kSampleThreads - 1) / kSampleThreads;
  const int64_t begin = min(piece_end, piece_begin + tid * chunk);
  const int64_t end = min(piece_end, begin + chunk);
  double sum = 0.0;
  int last_positive = -1;
  for (int64_t c = begin; c < end; ++c) {
    const float x = row[c];
    const float w = SampleWeight(x, max_logit, temperature);
    sum += w;
    if (w > 0.0f && c != draft) last_positive = static_cast<int>(c);
    if (truncates) {
      const int b = bin_of(x);
      atomicAdd(&shared.bins.count[b], 1);
      if (!top_k) atomicAdd(&shared.bins.mass[b], w);
    }
  }
  if (last_positive >= 0) atomicMax(&s_last_positive, last_positive);
  double block_sum = 0.0;
  double prefix = BlockExclusiveScan(sum, double_sums, block_sum);
  if (tid == 0) s_block_sum = block_sum;
  row_sync();  // block sums, bins and last positive weights are published
  double z = block_sum;
  int row_last_positive = s_last_positive;
  if constexpr (kCluster > 1) {
    z = 0.0;
    row_last_positive = -1;
    for (int r = 0; r < kCluster; ++r) {
      const double b = *of_rank(&s_block_sum, r);
      if (r < rank) prefix += b;
      z += b;
      row_last_positive = max(row_last_positive, *of_rank(&s_last_positive, r));
    }
  }
  const float log_z = static_cast<float>(log(z));
  // draft_p: a checked row's probability of its draft.
  auto finish = [&](int token, double draft_p) {
    if (rank == 0 && tid == 0) {
      results[row_index].token = token;
      results[row_index].logprob = check ? 0.0f : (row[token] - max_logit) / temperature - log_z;
      results[row_index].draft_probability = check ? draft_p : 0.0;
    }
  };
  // Blocks of a cluster leave together: none may go while another can still read its memory.
  auto leave = [&] {
    if constexpr (kCluster > 1) cg::this_cluster().sync();
  };
  if (greedy) {  // one-hot at the argmax: a draft elsewhere is rejected for the argmax
    finish(argmax, draft == argmax ? 1.0 : 0.0);
    leave();
    return;
  }

  if (!truncates) {
    // 3a. The first token in id order whose running weight passes u * z: the thread whose chunk
    // holds the target walks it. Every later thread with weight takes its first positive token
    // (at once: its running weight starts past the target), and the lowest id wins, so a target
    // that rounding leaves between two threads' ranges takes the next token, not the last. A
    // checked row's draft has no weight in the walk.
    const double w_draft = draft >= 0 ? SampleWeight(row[draft], max_logit, temperature) : 0.0;
    const double rest = z - w_draft;
    const double target = prm.u * rest;
    const double own_prefix = prefix - (draft >= 0 && draft < begin ? w_draft : 0.0);
    const double own_sum = sum - (draft >= begin && draft < end ? w_draft : 0.0);
    if (rest > 0.0 && own_sum > 0.0 && target < own_prefix + own_sum) {
      double acc = own_prefix;
      int found = -1;
      for (int64_t c = begin; c < end; ++c) {
        const float w = SampleWeight(row[c], max_logit, temperature);
        if (!(w > 0.0f) || c == draft) continue;
        found = static_cast<int>(c);
        acc += w;
        if (target < acc) break;
      }
      if (found >= 0) atomicMin(&s_token, found);
    }
    row_sync();
    if (rank == 0 && tid == 0) {
      int token = INT_MAX;
      for (int r = 0; r < kCluster; ++r) token = min(token, *of_rank(&s_token, r));
      // Rounding may leave the target past every chunk: the last positive weight, as the host;
      // a draft that holds all the weight is drawn itself (a rejection has probability 0).
      if (!(rest > 0.0) && draft >= 0 && w_draft > 0.0) token = draft;
      finish(token != INT_MAX ? token : (row_last_positive >= 0 ? row_last_positive : 0),
             w_draft / z);
    }
    leave();
    return;
  }

  // 3b. The last bin that may hold a kept candidate. Top-k: the first bin where the count from
  // the top reaches k. Top-p: the first where the mass reaches top_p of the total, plus two bins
  // of margin (the host takes one; these float bin sums round differently from its doubles).
  const int bin = tid;
  int count = 0;
  float mass = 0.0f;
  for (int r = 0; r < kCluster; ++r) {  // the row's bins: every block's, in rank order
    count += of_rank(&shared.bins.count[0], r)[bin];
    mass += of_rank(&shared.bins.mass[0], r)[bin];
  }
  if (top_k) {
    int total = 0;
    const int before = BlockExclusiveScan(count, int_sums, total);
    if (before < prm.top_k && before + count >= prm.top_k) atomicMin(&s_last_bin, bin);
  } else if (prm.top_p < 1.0f) {
    // (With top_p = 1, min-p alone: the host's double sums never reach the nucleus, and these
    // float ones must not cut where they would by rounding.)
    double total = 0.0;
    const double before = BlockExclusiveScan(static_cast<double>(mass), double_sums, total);
    const double nucleus = static_cast<double>(prm.top_p) * z * (1 + 1e-9);
    if (before + mass >= nucleus) atomicMin(&s_last_bin, min(bin + 2, kBins));
  }
  __syncthreads();
  const int last_bin = s_last_bin;
  // min-p keeps only logits >= max + T ln(min_p); this filter leaves out only what it surely
  // drops (the rule below decides exactly).
  const float floor_kept = !top_k && prm.min_p > 0.0f
                               ? max_logit + temperature * logf(prm.min_p) - 1e-3f * temperature
                               : -INFINITY;
  row_sync();  // every block has read the bins: their memory becomes the keys
  for (int64_t c = begin; c < end; ++c) {
    const float x = row[c];
    if (bin_of(x) <= last_bin && x >= floor_kept) {
      const int slot = atomicAdd(&s_num_candidates, 1);
      if (slot < kMaxSampleCandidates) shared.keys[slot] = CandidateKey(x, static_cast<int>(c));
    }
  }
  row_sync();  // every block's candidates are gathered
  int n = 0;
  for (int r = 0; r < kCluster; ++r) n += *of_rank(&s_num_candidates, r);
  if constexpr (kCluster > 1) {
    // Block 0 collects the other blocks' candidates behind its own.
    if (rank == 0 && n <= kMaxSampleCandidates) {
      int offset = s_num_candidates;
      for (int r = 1; r < kCluster; ++r) {
        const int m = *of_rank(&s_num_candidates, r);
        const unsigned long long* keys = of_rank(&shared.keys[0], r);
        for (int i = tid; i < m; i += kSampleThreads) shared.keys[offset + i] = keys[i];
        offset += m;
      }
    }
    cg::this_cluster().sync();  // collected: the other blocks may leave
    if (rank != 0) return;
  }
  if (n > kMaxSampleCandidates) {
    if (tid == 0) {
      results[row_index].token = -1;  // too many: the host draws this row
      results[row_index].logprob = 0.0f;
    }
    return;
  }
  if (n == 0) {  // as the host: the argmax alone
    finish(argmax, draft == argmax ? 1.0 : 0.0);
    return;
  }

  // 4. Sort the candidates (bitonic, padded to a power of two).
  int padded = 2;
  while (padded < n) padded <<= 1;
  for (int i = n + tid; i < padded; i += kSampleThreads) shared.keys[i] = ~0ull;
  __syncthreads();
  BlockBitonicSort(shared.keys, padded);

  // 5. The rule over the sorted candidates (top-k: the first k), as the host's loop: stop before
  // the first candidate under min_p * p_max, or after the one whose running mass reaches top_p
  // of the total (top-k: the k candidates' mass; otherwise every token's, 1).
  const int considered = top_k ? prm.top_k : n;
  const double inv_z = 1.0 / z;
  double p[kCandidatesPerThread];
  const double local =
      CandidateProbabilities(shared.keys, considered, -1, row, max_logit, temperature, inv_z, p);
  if (tid == 0) {
    s_p_max = p[0];
    s_cut = considered;
    s_pick = INT_MAX;
    s_last_positive = -1;
    s_draft_p = 0.0;
  }
  double considered_mass = 0.0;
  const double before = BlockExclusiveScan(local, double_sums, considered_mass);
  const double total = top_k ? considered_mass : 1.0;
  const double nucleus = static_cast<double>(prm.top_p) * total;
  const double p_floor = static_cast<double>(prm.min_p) * s_p_max;
  double running[kCandidatesPerThread];
  double acc = before;
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    const int i = tid * kCandidatesPerThread + j;
    acc += p[j];
    running[j] = acc;
    if (i >= considered) continue;
    if (i > 0 && p[j] < p_floor) atomicMin(&s_cut, i);
    if (acc >= nucleus) atomicMin(&s_cut, i + 1);
  }
  __syncthreads();
  const int kept = max(1, s_cut);
  // The walk's pick after MarkDraw and a barrier: rounding may leave the target past every kept
  // candidate, then the last positive one.
  auto picked = [&] {
    return s_pick != INT_MAX ? s_pick : (s_last_positive >= 0 ? s_last_positive : 0);
  };
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    if (tid * kCandidatesPerThread + j == kept - 1) s_kept_mass = running[j];
  }
  __syncthreads();
  if (!check) {
    // 6. The draw: the first kept candidate whose running mass passes u times the kept mass.
    MarkDraw(p, before, kept, prm.u * s_kept_mass, &s_pick, &s_last_positive);
    __syncthreads();
    finish(static_cast<int>(shared.keys[picked()] & 0xffffffffu), 0.0);
    return;
  }

  // 6'. A checked row: the draft's probability among the kept candidates, then the draw from the
  // others in id order (the kept candidates sorted again, by id alone).
#pragma unroll
  for (int j = 0; j < kCandidatesPerThread; ++j) {
    const int i = tid * kCandidatesPerThread + j;
    if (i < kept && static_cast<int>(shared.keys[i] & 0xffffffffu) == draft) s_draft_p = p[j];
  }
  int padded_kept = 2;
  while (padded_kept < kept) padded_kept <<= 1;
  __syncthreads();  // every key is read
  for (int i = tid; i < padded_kept; i += kSampleThreads) {
    shared.keys[i] = i < kept ? (shared.keys[i] & 0xffffffffull) : ~0ull;
  }
  __syncthreads();
  BlockBitonicSort(shared.keys, padded_kept);
  double q[kCandidatesPerThread];
  const double q_local =
      CandidateProbabilities(shared.keys, kept, draft, row, max_logit, temperature, inv_z, q);
  double rest = 0.0;
  const double q_before = BlockExclusiveScan(q_local, double_sums, rest);
  const double draft_p = s_draft_p / s_kept_mass;
  if (!(rest > 0.0)) {  // the draft holds the kept mass: it is drawn itself
    finish(s_draft_p > 0.0 ? draft : 0, draft_p);  // (no weight at all: token 0, as the host)
    return;
  }
  MarkDraw(q, q_before, kept, prm.u * rest, &s_pick, &s_last_positive);
  __syncthreads();
  finish(static_cast<int>(shared.keys[picked()]), draft_p);
}

// Backend::PenalizeRows: block r applies row r's penalties to its seen tokens (distinct, so no
// two threads touch one logit), then its logit biases. Each penalty step is one correctly
// rounded float operation in kernels::PenalizedLogit's order, with no fused multiply-add, so the
// row gets the host's bits. A bias list may name a token twice (a logit_bias beside the
// -infinity of min_tokens or bad_words), but at most once with a finite bias: the finite one is
// added atomically and a ban stored, which in either order gives the host's result (-infinity).
constexpr int kPenaltyThreads = 256;
__global__ void __launch_bounds__(kPenaltyThreads)
    PenalizeRowsKernel(float* logits, int64_t vocab, const PenaltyRowParams* params,
                       const int2* entries) {
  PdlWait();
  PdlTrigger();
  const PenaltyRowParams p = params[blockIdx.x];
  float* row = logits + static_cast<int64_t>(blockIdx.x) * vocab;
  for (int i = threadIdx.x; i < p.count + p.shared_count; i += kPenaltyThreads) {
    const int2 e = entries[i < p.count ? p.first + i : p.shared_first + (i - p.count)];
    if (e.x < 0 || e.x >= vocab) continue;
    float x = row[e.x];
    if (p.repetition != 1.0f) {
      x = x > 0.0f ? __fdiv_rn(x, p.repetition) : __fmul_rn(x, p.repetition);
    }
    const float by_count = __fmul_rn(p.frequency, static_cast<float>(e.y));
    const float by_presence = e.y > 0 ? p.presence : 0.0f;
    row[e.x] = __fsub_rn(x, __fadd_rn(by_count, by_presence));
  }
  if (p.bias_count == 0) return;
  __syncthreads();  // the biases come after the penalties
  for (int i = threadIdx.x; i < p.bias_count; i += kPenaltyThreads) {
    const int2 e = entries[p.bias_first + i];
    if (e.x < 0 || e.x >= vocab) continue;
    const float bias = __int_as_float(e.y);
    if (bias == -INFINITY) {
      row[e.x] = bias;  // a ban is a ban whatever the logit was (NaN too)
    } else {
      atomicAdd(row + e.x, bias);
    }
  }
}

// Backend::PenalizeRows' allowed-token masks: a thread per mask word (64 tokens), storing
// -infinity only at the tokens whose bit is clear (a grammar inside a string bans ~2% of them).
constexpr int kMaskThreads = 256;
__global__ void __launch_bounds__(kMaskThreads)
    MaskRowsKernel(float* logits, int64_t vocab, const int32_t* mask_rows, const uint64_t* masks) {
  PdlWait();
  PdlTrigger();
  const int64_t words = (vocab + 63) / 64;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kMaskThreads + threadIdx.x;
  if (w >= words) return;
  uint64_t missing = ~masks[blockIdx.y * words + w];
  if (vocab - w * 64 < 64) missing &= (uint64_t{1} << (vocab - w * 64)) - 1;
  float* row = logits + static_cast<int64_t>(mask_rows[blockIdx.y]) * vocab + w * 64;
  for (; missing != 0; missing &= missing - 1)
    row[__ffsll(static_cast<long long>(missing)) - 1] = -INFINITY;
}

// Backend::TopLogitsRows: each thread keeps a sorted list of the kList best (logit, id)
// of its stretch of the row (ties: lower id first, as kernels::TopLogits); the row's n best are
// then merged head by head, n rounds each: the lanes' lists by each warp, the warps' by warp 0,
// and with kCluster > 1 the blocks' by block 0 through distributed shared memory.
constexpr int kTopLogitsThreads = 256;
constexpr int kTopLogitsWarps = kTopLogitsThreads / 32;

// kList >= every row's count: the lists' length (their inserts cost ~kList each).
template <int kCluster, int kList>
__global__ void __launch_bounds__(kTopLogitsThreads)
    TopLogitsRowsKernel(const float* logits, int64_t vocab, const int32_t* counts,
                        const int32_t* chosen, int width, TopLogitResult* out,
                        float* chosen_logits) {
  PdlWait();
  PdlTrigger();
  __shared__ float list_v[kTopLogitsWarps][kList];
  __shared__ int list_i[kTopLogitsWarps][kList];
  const int64_t r = blockIdx.x / kCluster;
  const int rank = static_cast<int>(blockIdx.x % kCluster);
  const int n = min(counts[r], kList);
  if (n <= 0) return;  // every block of the row's cluster returns: no barrier is left waiting
  const float* row = logits + r * vocab;
  const int64_t piece = (vocab + kCluster - 1) / kCluster;
  const int64_t begin = min(vocab, rank * piece), end = min(vocab, begin + piece);
  float lv[kList];
  int li[kList];
  ClearList(lv, li);
  constexpr int kLoads = 4;
  for (int64_t c0 = begin + threadIdx.x; c0 < end; c0 += kTopLogitsThreads * kLoads) {
    float v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t c = c0 + u * kTopLogitsThreads;
      v[u] = c < end ? row[c] : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t c = c0 + u * kTopLogitsThreads;
      if (c < end) InsertSorted(v[u], static_cast<int>(c), lv, li);
    }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float mv[kList];
  int mi[kList];
  WarpMergeLists(lv, li, n, mv, mi);
  if (lane == 0) {
#pragma unroll
    for (int q = 0; q < kList; ++q) {
      list_v[warp][q] = q < n ? mv[q] : -INFINITY;
      list_i[warp][q] = q < n ? mi[q] : INT_MAX;
    }
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int q = 0; q < kList; ++q) {
      lv[q] = lane < kTopLogitsWarps ? list_v[lane][q] : -INFINITY;
      li[q] = lane < kTopLogitsWarps ? list_i[lane][q] : INT_MAX;
    }
    WarpMergeLists(lv, li, n, mv, mi);
  }
  if constexpr (kCluster > 1) {
    static_assert(kCluster <= 32, "block 0's lanes take one block's list each");
    cg::cluster_group cluster = cg::this_cluster();
    __syncthreads();  // warp 0 has read the warps' lists: row 0 of them is reused
    if (threadIdx.x == 0) {
#pragma unroll
      for (int q = 0; q < kList; ++q) {
        list_v[0][q] = q < n ? mv[q] : -INFINITY;
        list_i[0][q] = q < n ? mi[q] : INT_MAX;
      }
    }
    cluster.sync();  // every block's list is published
    if (rank == 0 && warp == 0) {
#pragma unroll
      for (int q = 0; q < kList; ++q) {
        lv[q] = lane < kCluster ? *cluster.map_shared_rank(&list_v[0][q], lane) : -INFINITY;
        li[q] = lane < kCluster ? *cluster.map_shared_rank(&list_i[0][q], lane) : INT_MAX;
      }
      WarpMergeLists(lv, li, n, mv, mi);
    }
    cluster.sync();  // read before any block exits
  }
  if (rank == 0 && warp == 0) {
#pragma unroll
    for (int q = 0; q < kList; ++q) {
      if (q < n && lane == q) {  // an empty slot (fewer non-NaN logits than n): token -1
        out[r * width + q] =
            mi[q] == INT_MAX ? TopLogitResult{-1, 0.0f} : TopLogitResult{mi[q], mv[q]};
      }
    }
    if (lane == 0) {
      const int32_t t = chosen[r];
      chosen_logits[r] = t >= 0 && t < vocab ? row[t] : NAN;
    }
  }
}

// Batches of up to kSmallBatchRows rows split each row over a cluster of kRowCluster blocks
// (a block alone reads a 1 MB row at ~35 GB/s: 30 us for an argmax).
constexpr int kRowCluster = 8;
constexpr int64_t kSmallBatchRows = 16;

}  // namespace

void LaunchArgmaxRows(const float* logits, int64_t rows, int64_t vocab, int32_t* ids,
                      cudaStream_t stream) {
  if (rows == 0) return;
  if (rows <= kSmallBatchRows) {
    LaunchPdlInClusters("ArgmaxRowsKernel", kRowCluster, ArgmaxRowsKernel<kRowCluster>,
                        static_cast<unsigned>(rows * kRowCluster), kArgmaxThreads, 0, stream,
                        logits, vocab, ids);
  } else {
    LaunchPdl("ArgmaxRowsKernel", ArgmaxRowsKernel<1>, static_cast<unsigned>(rows), kArgmaxThreads,
              0, stream, logits, vocab, ids);
  }
  CheckLaunch("ArgmaxRows");
}

void LaunchPenalizeRows(float* logits, int64_t rows, int64_t vocab, const PenaltyRowParams* params,
                        const int2* entries, cudaStream_t stream) {
  if (rows == 0) return;
  LaunchPdl("PenalizeRowsKernel", PenalizeRowsKernel, static_cast<unsigned>(rows), kPenaltyThreads,
            0, stream, logits, vocab, params, entries);
  CheckLaunch("PenalizeRows");
}

void LaunchMaskRows(float* logits, int64_t masked, int64_t vocab, const int32_t* mask_rows,
                    const uint64_t* masks, cudaStream_t stream) {
  if (masked == 0) return;
  const int64_t words = (vocab + 63) / 64;
  const dim3 grid(static_cast<unsigned>((words + kMaskThreads - 1) / kMaskThreads),
                  static_cast<unsigned>(masked));
  LaunchPdl("MaskRowsKernel", MaskRowsKernel, grid, kMaskThreads, 0, stream, logits, vocab,
            mask_rows, masks);
  CheckLaunch("MaskRows");
}

void LaunchTopLogitsRows(const float* logits, int64_t rows, int64_t vocab, const int32_t* counts,
                         const int32_t* chosen, int width, TopLogitResult* out,
                         float* chosen_logits, cudaStream_t stream) {
  if (rows == 0) return;
  // The shortest lists that hold `width` (OpenAI clients mostly ask for up to 5).
  static_assert(kMaxTopLogits == 20);
  using Kernel =
      void (*)(const float*, int64_t, const int32_t*, const int32_t*, int, TopLogitResult*, float*);
  const bool clustered = rows <= kSmallBatchRows;
  const Kernel kernel =
      width <= 5 ? (clustered ? TopLogitsRowsKernel<kRowCluster, 5> : TopLogitsRowsKernel<1, 5>)
      : width <= 10
          ? (clustered ? TopLogitsRowsKernel<kRowCluster, 10> : TopLogitsRowsKernel<1, 10>)
          : (clustered ? TopLogitsRowsKernel<kRowCluster, 20> : TopLogitsRowsKernel<1, 20>);
  LaunchPdlInClusters("TopLogitsRowsKernel", clustered ? kRowCluster : 1, kernel,
                      static_cast<unsigned>(clustered ? rows * kRowCluster : rows),
                      kTopLogitsThreads, 0, stream, logits, vocab, counts, chosen, width, out,
                      chosen_logits);
  CheckLaunch("TopLogitsRows");
}

void LaunchSampleRows(const float* logits, int64_t rows, int64_t vocab,
                      const SampleRowParams* params, SampleRowResult* results,
                      cudaStream_t stream) {
  if (rows == 0) return;
  if (rows <= kSmallBatchRows) {
    LaunchPdlInClusters("SampleRowsKernel", kRowCluster, SampleRowsKernel<kRowCluster>,
                        static_cast<unsigned>(rows * kRowCluster), kSampleThreads, 0, stream,
                        logits, vocab, params, results);
  } else {
    LaunchPdl("SampleRowsKernel", SampleRowsKernel<1>, static_cast<unsigned>(rows), kSampleThreads,
              0, stream, logits, vocab, params, results);
  }
  CheckLaunch("SampleRows");
}

}  // namespace mobius::kernels::cuda
