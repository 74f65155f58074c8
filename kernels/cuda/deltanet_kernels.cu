// Gated DeltaNet kernels: the causal depthwise conv (+ SiLU) with its rolling state, the gate
// activations, and the gated delta rule in its recurrent form.
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxConvKernel = 16;
constexpr int kDeltaCols = 32;
constexpr int kDeltaThreads = 4 * kDeltaCols;

// out[t, c] = silu(sum_j w[c, j] * x[t - K + 1 + j, c]); inputs before the segment start come
// from conv_states[slot, c, :] (oldest first). Reads the states only: the update runs after.
__global__ void CausalConvKernel(const uint16_t* x, AnyPtr w, const float* conv_states,
                                 int64_t num_tokens, int64_t channels, int kernel_size,
                                 TokenMeta tokens, SegmentMeta segs, uint16_t* out) {
  const int64_t n = num_tokens * channels;
  const int hist = kernel_size - 1;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = e / channels, c = e % channels;
    const int seg = tokens.token_segment[t];
    const int begin = segs.token_begin[seg];
    const int i = static_cast<int>(t) - begin;
    const int slot = segs.state_slot[seg];
    const float* state = slot < 0 ? nullptr : conv_states + (slot * channels + c) * hist;
    float acc = 0.0f;
    for (int j = 0; j < kernel_size; ++j) {
      const int p = i - hist + j;  // position relative to the segment start
      const float xv = p >= 0             ? Bf16ToF32(x[(begin + p) * channels + c])
                       : state != nullptr ? state[hist + p]
                                          : 0.0f;
      acc += Load(w, c * kernel_size + j) * xv;
    }
    out[e] = F32ToBf16(Silu(acc));
  }
}

// conv_states[slot, c, :] = the last K-1 inputs of (old state ++ segment inputs).
__global__ void ConvStateUpdateKernel(const uint16_t* x, float* conv_states, int64_t channels,
                                      int kernel_size, SegmentMeta segs) {
  const int64_t n = segs.num_segments * channels;
  const int hist = kernel_size - 1;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int seg = static_cast<int>(e / channels);
    const int64_t c = e % channels;
    const int begin = segs.token_begin[seg], len = segs.num_tokens[seg];
    if (segs.state_slot[seg] < 0) continue;
    float* state = conv_states + (segs.state_slot[seg] * channels + c) * hist;
    float old[kMaxConvKernel];
    for (int j = 0; j < hist; ++j) old[j] = state[j];
    for (int j = 0; j < hist; ++j) {
      const int p = len - hist + j;
      state[j] = p >= 0 ? Bf16ToF32(x[(begin + p) * channels + c]) : old[j + len];
    }
  }
}

__global__ void DeltaRuleGatesKernel(const uint16_t* a, const uint16_t* b, AnyPtr a_log,
                                     AnyPtr dt_bias, int64_t n, int num_v_heads, float* g,
                                     float* beta) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % num_v_heads);
    const float av = Bf16ToF32(a[i]) + Load(dt_bias, h);
    const float softplus = av > 20.0f ? av : log1pf(expf(av));
    g[i] = -expf(Load(a_log, h)) * softplus;
    beta[i] = 1.0f / (1.0f + expf(-Bf16ToF32(b[i])));
  }
}

// Columns of the state evolve independently (u_j, o_j and the update of column j read only
// column j, k, q and v_j), so one block handles kDeltaCols columns of one value head of one
// segment: grid (Hv, segments, Dv / kDeltaCols). Thread (j, s) = (tid / 4, tid % 4) owns rows
// i = s, s + 4, s + 8, ... of column j of the state S [Dk, Dv], kept in registers for the whole
// segment; the reductions over i are two shuffles inside each group of 4 lanes.
// TODO(chunked): prefill runs this token-by-token form for every segment length; a chunked
// WY/UT kernel (tensor cores over chunks of 64 tokens) should replace it for long segments.
template <int kRows>
__global__ void __launch_bounds__(kDeltaThreads)
    GatedDeltaRuleKernel(const uint16_t* qkv, const float* g, const float* beta, int num_k_heads,
                         int num_v_heads, int dk, int dv, float* states, SegmentMeta segs,
                         uint16_t* out) {
  extern __shared__ float smem[];
  float* q_s = smem;
  float* k_s = smem + dk;
  float* v_s = smem + 2 * dk;

  const int h = blockIdx.x, seg = blockIdx.y;
  const int slot = segs.state_slot[seg];
  const int begin = segs.token_begin[seg], len = segs.num_tokens[seg];
  if (len == 0) return;
  const int kh = h / (num_v_heads / num_k_heads);
  const int64_t row_elems = 2LL * num_k_heads * dk + static_cast<int64_t>(num_v_heads) * dv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j = blockIdx.z * kDeltaCols + (tid >> 2), s = tid & 3;
  const bool active = j < dv;

  // A segment without a state slot starts from zeros and keeps no final state.
  float* state =
      slot < 0 ? nullptr : states + (static_cast<int64_t>(slot) * num_v_heads + h) * dk * dv;
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = s + 4 * r;
    S[r] = (state != nullptr && active && i < dk) ? state[static_cast<int64_t>(i) * dv + j] : 0.0f;
  }
  const float q_scale = rsqrtf(static_cast<float>(dk));

  for (int step = 0; step < len; ++step) {
    const int64_t t = begin + step;
    const uint16_t* row = qkv + t * row_elems;
    // Warp 0 normalises q, warp 1 normalises k, the other warps (and all, for v) load v.
    if (warp < 2) {
      const uint16_t* src = row + (warp == 0 ? 0 : num_k_heads * dk) + kh * dk;
      float* dst = warp == 0 ? q_s : k_s;
      float sum = 0.0f;
      for (int d = lane; d < dk; d += 32) {
        const float v = Bf16ToF32(src[d]);
        dst[d] = v;
        sum += v * v;
      }
      sum = WarpSum(sum);
      const float inv = rsqrtf(sum + 1e-6f) * (warp == 0 ? q_scale : 1.0f);
      for (int d = lane; d < dk; d += 32) dst[d] *= inv;
    }
    if (tid < kDeltaCols && blockIdx.z * kDeltaCols + tid < dv) {
      v_s[tid] = Bf16ToF32(row[2 * num_k_heads * dk + h * dv + blockIdx.z * kDeltaCols + tid]);
    }
    __syncthreads();

    const float decay = expf(g[t * num_v_heads + h]);
    const float b = beta[t * num_v_heads + h];
    float u = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = s + 4 * r;
      if (i < dk) u += S[r] * k_s[i];
    }
    u += __shfl_xor_sync(0xffffffffu, u, 1);
    u += __shfl_xor_sync(0xffffffffu, u, 2);
    const float delta = active ? b * (v_s[tid >> 2] - decay * u) : 0.0f;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = s + 4 * r;
      if (i < dk) {
        S[r] = decay * S[r] + k_s[i] * delta;
        o += S[r] * q_s[i];
      }
    }
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);
    if (active && s == 0) {
      out[t * num_v_heads * dv + static_cast<int64_t>(h) * dv + j] = F32ToBf16(o);
    }
    __syncthreads();  // q_s, k_s, v_s are rewritten by the next token
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = s + 4 * r;
    if (state != nullptr && active && i < dk) state[static_cast<int64_t>(i) * dv + j] = S[r];
  }
}

template <int kRows>
void LaunchDeltaRule(dim3 grid, int threads, size_t smem, cudaStream_t stream, const uint16_t* qkv,
                     const float* g, const float* beta, int hk, int hv, int dk, int dv,
                     float* states, const SegmentMeta& segs, uint16_t* out) {
  GatedDeltaRuleKernel<kRows>
      <<<grid, threads, smem, stream>>>(qkv, g, beta, hk, hv, dk, dv, states, segs, out);
}

}  // namespace

void LaunchCausalConv1dSilu(const uint16_t* x, AnyPtr w, float* conv_states, int64_t num_tokens,
                            int64_t channels, int kernel_size, const TokenMeta& tokens,
                            const SegmentMeta& segments, uint16_t* out, cudaStream_t stream) {
  if (num_tokens == 0 || channels == 0) return;
  if (kernel_size < 1 || kernel_size > kMaxConvKernel) {
    std::fprintf(stderr, "mobius cuda: conv kernel size %d outside [1, %d]\n", kernel_size,
                 kMaxConvKernel);
    std::abort();
  }
  CausalConvKernel<<<GridFor(num_tokens * channels, kThreads), kThreads, 0, stream>>>(
      x, w, conv_states, num_tokens, channels, kernel_size, tokens, segments, out);
  CheckLaunch("CausalConv1dSilu");
  if (kernel_size > 1) {
    ConvStateUpdateKernel<<<GridFor(segments.num_segments * channels, kThreads), kThreads, 0,
                            stream>>>(x, conv_states, channels, kernel_size, segments);
    CheckLaunch("ConvStateUpdate");
  }
}

void LaunchDeltaRuleGates(const uint16_t* a, const uint16_t* b, AnyPtr a_log, AnyPtr dt_bias,
                          int64_t num_tokens, int num_v_heads, float* g, float* beta,
                          cudaStream_t stream) {
  const int64_t n = num_tokens * num_v_heads;
  if (n == 0) return;
  DeltaRuleGatesKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(a, b, a_log, dt_bias, n,
                                                                      num_v_heads, g, beta);
  CheckLaunch("DeltaRuleGates");
}

void LaunchGatedDeltaRuleRecurrent(const uint16_t* qkv, const float* g, const float* beta,
                                   int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                   float* states, const SegmentMeta& segments, uint16_t* out,
                                   cudaStream_t stream) {
  if (segments.num_segments == 0 || num_v_heads == 0) return;
  if (k_head_dim > 256 || k_head_dim < 1 || v_head_dim < 1) {
    std::fprintf(stderr, "mobius cuda: delta rule key head dim %d outside [1, 256]\n", k_head_dim);
    std::abort();
  }
  const int threads = kDeltaThreads;
  const size_t smem = sizeof(float) * (2 * k_head_dim + kDeltaCols);
  const dim3 grid(num_v_heads, segments.num_segments, (v_head_dim + kDeltaCols - 1) / kDeltaCols);
  const int rows = (k_head_dim + 3) / 4;
  if (rows <= 16) {
    LaunchDeltaRule<16>(grid, threads, smem, stream, qkv, g, beta, num_k_heads, num_v_heads,
                        k_head_dim, v_head_dim, states, segments, out);
  } else if (rows <= 32) {
    LaunchDeltaRule<32>(grid, threads, smem, stream, qkv, g, beta, num_k_heads, num_v_heads,
                        k_head_dim, v_head_dim, states, segments, out);
  } else {
    LaunchDeltaRule<64>(grid, threads, smem, stream, qkv, g, beta, num_k_heads, num_v_heads,
                        k_head_dim, v_head_dim, states, segments, out);
  }
  CheckLaunch("GatedDeltaRule");
}

}  // namespace mobius::kernels::cuda
