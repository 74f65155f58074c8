// Gated full-attention kernels: q/k RMS norm + partial rotate-half RoPE, the paged KV write, and
// paged causal GQA attention with an online softmax.
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kNormThreads = 128;
constexpr int kAttnWarps = 8;

// Block (t, head): heads [0, nh) are query heads (read from q_gate, which also yields the gate),
// heads [nh, nh + nkv) are key heads, normalised and rotated in place.
__global__ void QkNormRopeKernel(const uint16_t* q_gate, uint16_t* k, AnyPtr q_norm, AnyPtr k_norm,
                                 float eps, int rotary_dim, float theta, int num_heads,
                                 int num_kv_heads, int head_dim, const int32_t* token_position,
                                 uint16_t* q, uint16_t* gate) {
  extern __shared__ float vals[];  // [head_dim], normalised
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const int head = blockIdx.y;
  const bool is_q = head < num_heads;
  const uint16_t* src;
  uint16_t* dst;
  AnyPtr w;
  if (is_q) {
    src = q_gate + (t * num_heads + head) * 2 * head_dim;
    dst = q + (t * num_heads + head) * head_dim;
    w = q_norm;
    uint16_t* gate_dst = gate + (t * num_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) gate_dst[d] = src[head_dim + d];
  } else {
    dst = k + (t * num_kv_heads + (head - num_heads)) * head_dim;
    src = dst;
    w = k_norm;
  }
  float sum = 0.0f;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    const float v = Bf16ToF32(src[d]);
    vals[d] = v;
    sum += v * v;
  }
  sum = BlockSum(sum, red);  // also makes vals visible to the whole block
  const float inv = rsqrtf(sum / static_cast<float>(head_dim) + eps);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    vals[d] = vals[d] * inv * (1.0f + Load(w, d));
  }
  __syncthreads();
  const int half = rotary_dim / 2;
  // Like the reference implementation: inverse frequencies and angles in fp32.
  const float pos = static_cast<float>(token_position[t]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float y = vals[d];
    if (d < rotary_dim) {
      const int j = d < half ? d : d - half;
      const float inv_freq =
          static_cast<float>(1.0 / pow(static_cast<double>(theta), 2.0 * j / rotary_dim));
      const float angle = pos * inv_freq;
      double sn, cs;
      sincos(static_cast<double>(angle), &sn, &cs);
      const float c = static_cast<float>(cs), s = static_cast<float>(sn);
      y = d < half ? vals[d] * c - vals[d + half] * s : vals[d] * c + vals[d - half] * s;
    }
    dst[d] = F32ToBf16(y);
  }
}

__global__ void WriteKvCacheKernel(const uint16_t* k, const uint16_t* v, const int32_t* slots,
                                   int64_t num_tokens, int64_t row_elems, uint16_t* k_cache,
                                   uint16_t* v_cache) {
  const int64_t n = num_tokens * row_elems;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / row_elems, e = i % row_elems;
    const int64_t dst = static_cast<int64_t>(slots[t]) * row_elems + e;
    k_cache[dst] = k[i];
    v_cache[dst] = v[i];
  }
}

// Block (t, h); each warp walks positions warp, warp + kAttnWarps, ... with its own online
// softmax, then the warps' partial results are merged. Lane l holds dims l, l + 32, ...
// TODO(perf): split long contexts over several blocks (flash-decoding) and share K/V loads
// between the query heads of one kv head.
template <int kPerLane>
__global__ void __launch_bounds__(kAttnWarps * 32)
    PagedAttentionKernel(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                         int num_heads, int num_kv_heads, int head_dim, int block_size,
                         TokenMeta tokens, SegmentMeta segs, float scale, uint16_t* out) {
  extern __shared__ float acc_s[];  // [kAttnWarps, head_dim]
  __shared__ float m_s[kAttnWarps], l_s[kAttnWarps];
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = tokens.token_segment[t];
  const int num_pos = tokens.token_position[t] + 1;
  const int kvh = h / (num_heads / num_kv_heads);
  const int32_t* table = segs.block_tables + segs.block_table_begin[seg];

  float qv[kPerLane], acc[kPerLane];
  const uint16_t* qp = q + (t * num_heads + h) * head_dim;
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + 32 * r;
    qv[r] = d < head_dim ? Bf16ToF32(qp[d]) * scale : 0.0f;
    acc[r] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int p = warp; p < num_pos; p += kAttnWarps) {
    const int64_t row =
        (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * num_kv_heads +
        kvh;
    const uint16_t* kp = k_cache + row * head_dim;
    const uint16_t* vp = v_cache + row * head_dim;
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int d = lane + 32 * r;
      if (d < head_dim) s += qv[r] * Bf16ToF32(kp[d]);
    }
    s = WarpSum(s);
    const float m_new = fmaxf(m, s);
    const float corr = __expf(m - m_new);
    const float e = __expf(s - m_new);
    l = l * corr + e;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int d = lane + 32 * r;
      acc[r] = acc[r] * corr + (d < head_dim ? e * Bf16ToF32(vp[d]) : 0.0f);
    }
    m = m_new;
  }
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int d = lane + 32 * r;
    if (d < head_dim) acc_s[warp * head_dim + d] = acc[r];
  }
  if (lane == 0) {
    m_s[warp] = m;
    l_s[warp] = l;
  }
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) m_all = fmaxf(m_all, m_s[w]);
  float l_all = 0.0f;
  float factor[kAttnWarps];
  for (int w = 0; w < kAttnWarps; ++w) {
    factor[w] = m_s[w] == -INFINITY ? 0.0f : __expf(m_s[w] - m_all);
    l_all += l_s[w] * factor[w];
  }
  const float inv_l = 1.0f / l_all;
  uint16_t* op = out + (t * num_heads + h) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kAttnWarps; ++w) o += acc_s[w * head_dim + d] * factor[w];
    op[d] = F32ToBf16(o * inv_l);
  }
}

template <int kPerLane>
void LaunchAttention(dim3 grid, size_t smem, cudaStream_t stream, const uint16_t* q,
                     const uint16_t* k_cache, const uint16_t* v_cache, int nh, int nkv, int hd,
                     int block_size, const TokenMeta& tokens, const SegmentMeta& segs, float scale,
                     uint16_t* out) {
  PagedAttentionKernel<kPerLane><<<grid, kAttnWarps * 32, smem, stream>>>(
      q, k_cache, v_cache, nh, nkv, hd, block_size, tokens, segs, scale, out);
}

}  // namespace

void LaunchQkNormRope(const uint16_t* q_gate, uint16_t* k, AnyPtr q_norm, AnyPtr k_norm, float eps,
                      int rotary_dim, float theta, int64_t num_tokens, int num_heads,
                      int num_kv_heads, int head_dim, const int32_t* token_position, uint16_t* q,
                      uint16_t* gate, cudaStream_t stream) {
  if (num_tokens == 0) return;
  const dim3 grid(static_cast<unsigned>(num_tokens), num_heads + num_kv_heads);
  QkNormRopeKernel<<<grid, kNormThreads, sizeof(float) * head_dim, stream>>>(
      q_gate, k, q_norm, k_norm, eps, rotary_dim, theta, num_heads, num_kv_heads, head_dim,
      token_position, q, gate);
  CheckLaunch("QkNormRope");
}

void LaunchWriteKvCache(const uint16_t* k, const uint16_t* v, const int32_t* slots,
                        int64_t num_tokens, int64_t row_elems, uint16_t* k_cache, uint16_t* v_cache,
                        cudaStream_t stream) {
  if (num_tokens * row_elems == 0) return;
  WriteKvCacheKernel<<<GridFor(num_tokens * row_elems, 256), 256, 0, stream>>>(
      k, v, slots, num_tokens, row_elems, k_cache, v_cache);
  CheckLaunch("WriteKvCache");
}

void LaunchPagedAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                          int block_size, const TokenMeta& tokens, const SegmentMeta& segments,
                          float scale, uint16_t* out, cudaStream_t stream) {
  if (num_tokens == 0) return;
  const dim3 grid(static_cast<unsigned>(num_tokens), num_heads);
  const size_t smem = sizeof(float) * kAttnWarps * head_dim;
  if (head_dim <= 128) {
    LaunchAttention<4>(grid, smem, stream, q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                       block_size, tokens, segments, scale, out);
  } else if (head_dim <= 256) {
    LaunchAttention<8>(grid, smem, stream, q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                       block_size, tokens, segments, scale, out);
  } else {
    std::fprintf(stderr, "mobius cuda: attention head dim %d > 256 is not supported\n", head_dim);
    std::abort();
  }
  CheckLaunch("PagedAttention");
}

}  // namespace mobius::kernels::cuda
