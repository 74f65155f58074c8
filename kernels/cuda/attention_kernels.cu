// Gated full-attention kernels: q/k RMS norm + partial rotate-half RoPE, the paged KV write, and
// paged causal GQA attention with an online softmax.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/common.cuh"

namespace mobius::kernels::cuda {
namespace {

constexpr int kNormThreads = 128;
constexpr int kAttnWarps = 8;

// Rotation of frequency j at position `pos`, like the reference implementation: the inverse
// frequency and the angle in fp32 (the power and the sine/cosine evaluated in double, then
// rounded, as PyTorch's fp32 ops are accurate to the last bit).
__device__ __forceinline__ void RopeCosSin(float pos, int j, int rotary_dim, float theta, float* c,
                                           float* s) {
  const float inv_freq =
      static_cast<float>(1.0 / pow(static_cast<double>(theta), 2.0 * j / rotary_dim));
  const float angle = pos * inv_freq;
  double sn, cs;
  sincos(static_cast<double>(angle), &sn, &cs);
  *c = static_cast<float>(cs);
  *s = static_cast<float>(sn);
}

// Where head `head` of token t lives: query heads [0, nh) read q_gate (query half) and write q,
// key heads [nh, nh + nkv) are normalised and rotated in place in k.
struct QkHead {
  const uint16_t* src;
  uint16_t* dst;
  AnyPtr w;
  bool is_q;
};
__device__ __forceinline__ QkHead QkHeadOf(int64_t t, int head, const uint16_t* q_gate, uint16_t* k,
                                           uint16_t* q, AnyPtr q_norm, AnyPtr k_norm, int num_heads,
                                           int num_kv_heads, int head_dim) {
  if (head < num_heads) {
    return {q_gate + (t * num_heads + head) * 2 * head_dim, q + (t * num_heads + head) * head_dim,
            q_norm, true};
  }
  uint16_t* kh = k + (t * num_kv_heads + (head - num_heads)) * head_dim;
  return {kh, kh, k_norm, false};
}

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
  const QkHead h =
      QkHeadOf(t, head, q_gate, k, q, q_norm, k_norm, num_heads, num_kv_heads, head_dim);
  const uint16_t* src = h.src;
  uint16_t* dst = h.dst;
  const AnyPtr w = h.w;
  if (h.is_q) {
    uint16_t* gate_dst = gate + (t * num_heads + head) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) gate_dst[d] = src[head_dim + d];
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
      float c, s;
      RopeCosSin(pos, d < half ? d : d - half, rotary_dim, theta, &c, &s);
      y = d < half ? vals[d] * c - vals[d + half] * s : vals[d] * c + vals[d - half] * s;
    }
    dst[d] = F32ToBf16(y);
  }
}

// The cache row (block * block_size + offset) of token t's position, through its segment's block
// table: the kernels read only staged device metadata (a recorded step replays with new tables).
__device__ __forceinline__ int64_t KvCacheSlot(const int32_t* token_position,
                                               const int32_t* token_segment,
                                               const SegmentMeta& segs, int block_size, int64_t t) {
  const int pos = token_position[t];
  const int32_t* table = segs.block_tables + segs.block_table_begin[token_segment[t]];
  return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
}

// The same for head_dim % 8 == 0 (<= 256) with 16-byte aligned operands: a block per token (or,
// for a few tokens, per token and group of kRopeWarps heads: then no warp handles a second head
// after the first, at one token 7.8 us of a serial loop over 18 heads), one warp per head (lane l
// holds dims 8l .. 8l+7), so a head needs no block barrier, and a block's rotation angles are
// computed once for all its heads instead of once per element. With a cache write (kv.k_cache
// set) heads [nh + nkv, nh + 2 nkv) copy token t's value heads into the paged cache and each key
// head also stores its rotated row there, so no WriteKvCache launch follows.
constexpr int kRopeWarps = 8;

__global__ void __launch_bounds__(kRopeWarps * 32)
    QkNormRopeVecKernel(const uint16_t* q_gate, uint16_t* k, AnyPtr q_norm, AnyPtr k_norm,
                        float eps, int rotary_dim, float theta, int num_heads, int num_kv_heads,
                        int head_dim, const int32_t* token_position, uint16_t* q, uint16_t* gate,
                        const KvCacheWrite kv) {
  // Up to PdlWait: the rotation angles and the cache row, from the step's positions and block
  // tables (staged by copies, not by kernels), while the projection before this kernel finishes.
  extern __shared__ float smem[];
  const int half = rotary_dim / 2;
  float* cos_s = smem;         // [half]
  float* sin_s = smem + half;  // [half]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* vals = smem + rotary_dim + warp * head_dim;  // [head_dim] per warp
  const int64_t t = blockIdx.x;
  // Like the reference implementation: inverse frequencies and angles in fp32.
  const float pos = static_cast<float>(token_position[t]);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    RopeCosSin(pos, j, rotary_dim, theta, &cos_s[j], &sin_s[j]);
  }
  __syncthreads();
  const int d0 = lane * 8;
  const bool active = d0 < head_dim;
  const bool to_cache = kv.k_cache != nullptr;
  const int64_t cache_row =
      to_cache ? KvCacheSlot(token_position, kv.token_segment, kv.segs, kv.block_size, t) *
                     num_kv_heads * head_dim
               : 0;
  PdlWait();
  PdlTrigger();
  const int heads = num_heads + num_kv_heads * (to_cache ? 2 : 1);
  for (int head = blockIdx.y * kRopeWarps + warp; head < heads; head += gridDim.y * kRopeWarps) {
    if (head >= num_heads + num_kv_heads) {  // a value head: copied as it is
      const int64_t vh = head - num_heads - num_kv_heads;
      if (active) {
        *reinterpret_cast<uint4*>(kv.v_cache + cache_row + vh * head_dim + d0) =
            *reinterpret_cast<const uint4*>(kv.v + (t * num_kv_heads + vh) * head_dim + d0);
      }
      continue;
    }
    const QkHead h =
        QkHeadOf(t, head, q_gate, k, q, q_norm, k_norm, num_heads, num_kv_heads, head_dim);
    const bool is_q = h.is_q;
    const uint16_t* src = h.src;
    uint16_t* dst = h.dst;
    const AnyPtr w = h.w;
    float v[8] = {};
    float sum = 0.0f;
    if (active) {
      UnpackBf16x8(*reinterpret_cast<const uint4*>(src + d0), v);
      if (is_q) {
        *reinterpret_cast<uint4*>(gate + (t * num_heads + head) * head_dim + d0) =
            *reinterpret_cast<const uint4*>(src + head_dim + d0);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += v[i] * v[i];
    }
    sum = WarpSum(sum);
    const float inv = rsqrtf(sum / static_cast<float>(head_dim) + eps);
    if (active) {
      float wv[8];
      Load8(w, d0, wv);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = v[i] * inv * (1.0f + wv[i]);
        vals[d0 + i] = v[i];
      }
    }
    __syncwarp();
    if (active) {
      float y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int d = d0 + i;
        y[i] = v[i];
        if (d < rotary_dim) {
          const int j = d < half ? d : d - half;
          y[i] = d < half ? v[i] * cos_s[j] - vals[d + half] * sin_s[j]
                          : v[i] * cos_s[j] + vals[d - half] * sin_s[j];
        }
      }
      const uint4 packed = PackBf16x8(y);
      *reinterpret_cast<uint4*>(dst + d0) = packed;
      if (to_cache && !is_q) {
        *reinterpret_cast<uint4*>(kv.k_cache + cache_row + (head - num_heads) * head_dim + d0) =
            packed;
      }
    }
    __syncwarp();  // vals is rewritten by the warp's next head
  }
}

__global__ void WriteKvCacheKernel(const uint16_t* k, const uint16_t* v, TokenMeta tokens,
                                   SegmentMeta segs, int block_size, int64_t num_tokens,
                                   int64_t row_elems, uint16_t* k_cache, uint16_t* v_cache) {
  PdlWait();
  PdlTrigger();
  const int64_t n = num_tokens * row_elems;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / row_elems, e = i % row_elems;
    const int64_t dst =
        KvCacheSlot(tokens.token_position, tokens.token_segment, segs, block_size, t) * row_elems +
        e;
    k_cache[dst] = k[i];
    v_cache[dst] = v[i];
  }
}

// Block (t, h); each warp walks positions warp, warp + kAttnWarps, ... with its own online
// softmax, then the warps' partial results are merged. Lane l holds dims l, l + 32, ...
// The last fallback of LaunchPagedAttention, after the decode, flash and GQA kernels (head dims
// not multiples of 8, unaligned operands, GQA groups over kMaxGroup); those split long contexts
// and share K/V loads between a kv head's query heads, so this one stays simple.
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

// GQA-grouped, split (flash-decoding) attention for head_dim % 8 == 0, head_dim <= 256 and at
// most kMaxGroup query heads per kv head. Block (t, kv head, split) walks its share of the
// token's positions with 8 warps; lane l holds dims 8l .. 8l+7 (one 16-byte load of K and of V
// per position) and the scores of every query head of the group, so K/V are read once per kv
// head. With one split the block writes the output; otherwise it writes (m, l, acc) partials
// that CombineSplitsKernel merges.
constexpr int kMaxGroup = 8;

__device__ __forceinline__ float ScaleFor(float m, float m_all) {
  return m == -INFINITY ? 0.0f : __expf(m - m_all);
}

__global__ void __launch_bounds__(kAttnWarps * 32)
    PagedAttentionGqaKernel(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            int num_heads, int num_kv_heads, int head_dim, int block_size,
                            TokenMeta tokens, SegmentMeta segs, float scale, int splits,
                            float* partial, uint16_t* out) {
  __shared__ float acc_s[kMaxGroup][256];
  __shared__ float m_s[kMaxGroup], l_s[kMaxGroup];
  const int64_t t = blockIdx.x;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = num_heads / num_kv_heads;
  const int seg = tokens.token_segment[t];
  const int num_pos = tokens.token_position[t] + 1;
  const int chunk = (num_pos + splits - 1) / splits;
  const int begin = split * chunk, end = min(num_pos, begin + chunk);
  const int32_t* table = segs.block_tables + segs.block_table_begin[seg];
  const int d0 = lane * 8;
  const bool lane_active = d0 < head_dim;

  float qv[kMaxGroup][8], acc[kMaxGroup][8], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      qv[g][i] = 0.0f;
      acc[g][i] = 0.0f;
    }
    if (g < group && lane_active) {
      const uint16_t* qp = q + (t * num_heads + kvh * group + g) * head_dim + d0;
      UnpackBf16x8(*reinterpret_cast<const uint4*>(qp), qv[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[g][i] *= scale;
    }
  }
  for (int p = begin + warp; p < end; p += kAttnWarps) {
    const int64_t row =
        (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * num_kv_heads +
        kvh;
    float kv[8] = {}, vv[8] = {};
    if (lane_active) {
      UnpackBf16x8(*reinterpret_cast<const uint4*>(k_cache + row * head_dim + d0), kv);
      UnpackBf16x8(*reinterpret_cast<const uint4*>(v_cache + row * head_dim + d0), vv);
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) s += qv[g][i] * kv[i];
      s = WarpSum(s);
      const float m_new = fmaxf(m[g], s);
      const float corr = __expf(m[g] - m_new);
      const float e = __expf(s - m_new);
      l[g] = l[g] * corr + e;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * corr + e * vv[i];
      m[g] = m_new;
    }
  }
  // Merge the warps' partial softmaxes one warp at a time.
  for (int w = 0; w < kAttnWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= group) break;
        const float m_old = w == 0 ? -INFINITY : m_s[g];
        const float l_old = w == 0 ? 0.0f : l_s[g];
        const float m_all = fmaxf(m_old, m[g]);
        const float a = ScaleFor(m_old, m_all), b = ScaleFor(m[g], m_all);
        if (lane_active) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float prev = w == 0 ? 0.0f : acc_s[g][d0 + i];
            acc_s[g][d0 + i] = prev * a + acc[g][i] * b;
          }
        }
        __syncwarp();
        if (lane == 0) {
          m_s[g] = m_all;
          l_s[g] = l_old * a + l[g] * b;
        }
        __syncwarp();
      }
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < group * head_dim; e += blockDim.x) {
    const int g = e / head_dim, d = e % head_dim;
    const int h = kvh * group + g;
    if (splits == 1) {
      out[(t * num_heads + h) * head_dim + d] = F32ToBf16(acc_s[g][d] / l_s[g]);
    } else {
      float* part = partial + ((t * num_heads + h) * splits + split) * (head_dim + 2);
      if (d == 0) {
        part[0] = m_s[g];
        part[1] = l_s[g];
      }
      part[2 + d] = acc_s[g][d];
    }
  }
}

__global__ void CombineSplitsKernel(const float* partial, int num_heads, int head_dim, int splits,
                                    uint16_t* out) {
  PdlWait();
  PdlTrigger();
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const float* base = partial + (t * num_heads + h) * splits * (head_dim + 2);
  float m_all = -INFINITY;
  for (int s = 0; s < splits; ++s) m_all = fmaxf(m_all, base[s * (head_dim + 2)]);
  float l_all = 0.0f;
  for (int s = 0; s < splits; ++s) {
    l_all += base[s * (head_dim + 2) + 1] * ScaleFor(base[s * (head_dim + 2)], m_all);
  }
  const float inv = 1.0f / l_all;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* part = base + s * (head_dim + 2);
      o += part[2 + d] * ScaleFor(part[0], m_all);
    }
    out[(t * num_heads + h) * head_dim + d] = F32ToBf16(o * inv);
  }
}

bool GqaEligible(int num_heads, int num_kv_heads, int head_dim) {
  return head_dim % 8 == 0 && head_dim <= 256 && num_heads / num_kv_heads <= kMaxGroup;
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

bool LaunchQkNormRope(const uint16_t* q_gate, uint16_t* k, AnyPtr q_norm, AnyPtr k_norm, float eps,
                      int rotary_dim, float theta, int64_t num_tokens, int num_heads,
                      int num_kv_heads, int head_dim, const int32_t* token_position, uint16_t* q,
                      uint16_t* gate, cudaStream_t stream, const KvCacheWrite* kv) {
  if (num_tokens == 0) return kv != nullptr;
  if (head_dim % 8 == 0 && head_dim <= 256 && rotary_dim % 2 == 0 && rotary_dim <= head_dim &&
      IsAligned16(q_gate) && IsAligned16(k) && IsAligned16(q) && IsAligned16(gate) &&
      IsAligned16(q_norm.data) && IsAligned16(k_norm.data)) {
    // The cache write rides along only with 16-byte aligned v and caches; otherwise this kernel
    // still normalises (so q and k keep the bits QkNormRope gives) and the caller writes.
    const bool write =
        kv != nullptr && IsAligned16(kv->v) && IsAligned16(kv->k_cache) && IsAligned16(kv->v_cache);
    const size_t smem = sizeof(float) * (rotary_dim + kRopeWarps * head_dim);
    // Below a wave of blocks, a block per group of kRopeWarps heads.
    const int heads = num_heads + num_kv_heads * (write ? 2 : 1);
    const unsigned groups = num_tokens < 128 ? (heads + kRopeWarps - 1) / kRopeWarps : 1;
    LaunchPdl("QkNormRopeVecKernel", QkNormRopeVecKernel,
              dim3(static_cast<unsigned>(num_tokens), groups), kRopeWarps * 32, smem, stream,
              q_gate, k, q_norm, k_norm, eps, rotary_dim, theta, num_heads, num_kv_heads, head_dim,
              token_position, q, gate, write ? *kv : KvCacheWrite{});
    CheckLaunch("QkNormRope");
    return write;
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), num_heads + num_kv_heads);
  QkNormRopeKernel<<<grid, kNormThreads, sizeof(float) * head_dim, stream>>>(
      q_gate, k, q_norm, k_norm, eps, rotary_dim, theta, num_heads, num_kv_heads, head_dim,
      token_position, q, gate);
  CheckLaunch("QkNormRope");
  return false;
}

void LaunchWriteKvCache(const uint16_t* k, const uint16_t* v, const TokenMeta& tokens,
                        const SegmentMeta& segs, int block_size, int64_t num_tokens,
                        int64_t row_elems, uint16_t* k_cache, uint16_t* v_cache,
                        cudaStream_t stream) {
  if (num_tokens * row_elems == 0) return;
  LaunchPdl("WriteKvCacheKernel", WriteKvCacheKernel, GridFor(num_tokens * row_elems, 256), 256, 0,
            stream, k, v, tokens, segs, block_size, num_tokens, row_elems, k_cache, v_cache);
  CheckLaunch("WriteKvCache");
}

int PagedAttentionSplits(int64_t num_tokens, int num_segments, int num_heads, int num_kv_heads,
                         int head_dim, int max_positions, int num_sms) {
  if (num_tokens == 0) return 1;
  if (DecodeAttentionSupports(num_tokens, num_segments, num_heads, num_kv_heads, head_dim)) {
    return DecodeAttentionSplits(num_tokens, num_kv_heads, max_positions, num_sms);
  }
  if (FlashAttentionSupports(num_heads, num_kv_heads, head_dim)) {
    // Blocks per split: a tile per decode token, fewer for prefill (where one split suffices).
    const int64_t blocks = num_tokens * num_kv_heads;
    int64_t splits = (2LL * num_sms + blocks - 1) / blocks;
    splits = std::min<int64_t>(splits, (max_positions + 63) / 64);
    return static_cast<int>(std::clamp<int64_t>(splits, 1, 64));
  }
  if (!GqaEligible(num_heads, num_kv_heads, head_dim)) return 1;
  // Enough blocks for two waves, each split keeping at least 128 positions (16 per warp).
  const int64_t blocks = num_tokens * num_kv_heads;
  int64_t splits = (2LL * num_sms + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, (max_positions + 127) / 128);
  return static_cast<int>(std::clamp<int64_t>(splits, 1, 64));
}

size_t PagedAttentionScratchBytes(int64_t num_tokens, int num_heads, int head_dim, int splits) {
  return sizeof(float) * num_tokens * num_heads * splits * (head_dim + 2);
}

bool LaunchPagedAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          int64_t cache_blocks, int64_t num_tokens, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, const TokenMeta& tokens,
                          const SegmentMeta& segments, float scale, int splits, int num_sms,
                          void* scratch, uint16_t* out, cudaStream_t stream,
                          const uint16_t* out_gate) {
  if (num_tokens == 0) return true;
  const bool aligned = reinterpret_cast<uintptr_t>(q) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(v_cache) % 16 == 0;
  if (DecodeAttentionSupports(num_tokens, segments.num_segments, num_heads, num_kv_heads,
                              head_dim) &&
      aligned) {
    // The gate is read in 16-byte pieces where the output is written; an unaligned one is left
    // to the caller's MulSigmoid.
    const uint16_t* gate = IsAligned16(out_gate) ? out_gate : nullptr;
    LaunchDecodeAttention(q, k_cache, v_cache, cache_blocks, num_tokens, num_heads, num_kv_heads,
                          head_dim, block_size, tokens, segments, scale, splits, num_sms, scratch,
                          out, stream, gate);
    return gate == out_gate;
  }
  if (splits == 1 && PrefillAttentionSupports(num_heads, num_kv_heads, head_dim) && aligned) {
    LaunchPrefillAttention(q, k_cache, v_cache, cache_blocks, num_tokens, num_heads, num_kv_heads,
                           head_dim, block_size, tokens, segments, scale, out, stream);
    return false;
  }
  if (FlashAttentionSupports(num_heads, num_kv_heads, head_dim) && aligned) {
    float* partial = static_cast<float*>(scratch);
    LaunchFlashPagedAttention(q, k_cache, v_cache, num_tokens, num_heads, num_kv_heads, head_dim,
                              block_size, tokens, segments, scale, splits, partial, out, stream);
    if (splits > 1) {
      LaunchPdl("CombineSplitsKernel", CombineSplitsKernel,
                dim3(static_cast<unsigned>(num_tokens), num_heads), 128, 0, stream, partial,
                num_heads, head_dim, splits, out);
      CheckLaunch("PagedAttentionCombine");
    }
    return false;
  }
  if (GqaEligible(num_heads, num_kv_heads, head_dim) && aligned) {
    const dim3 grid(static_cast<unsigned>(num_tokens), num_kv_heads, splits);
    float* partial = static_cast<float*>(scratch);
    PagedAttentionGqaKernel<<<grid, kAttnWarps * 32, 0, stream>>>(
        q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, block_size, tokens, segments, scale,
        splits, partial, out);
    CheckLaunch("PagedAttentionGqa");
    if (splits > 1) {
      LaunchPdl("CombineSplitsKernel", CombineSplitsKernel,
                dim3(static_cast<unsigned>(num_tokens), num_heads), 128, 0, stream, partial,
                num_heads, head_dim, splits, out);
      CheckLaunch("PagedAttentionCombine");
    }
    return false;
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), num_heads);
  const size_t smem = sizeof(float) * kAttnWarps * head_dim;
  if (head_dim <= 128) {
    LaunchAttention<4>(grid, smem, stream, q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                       block_size, tokens, segments, scale, out);
  } else if (head_dim <= kMaxAttentionHeadDim) {
    LaunchAttention<8>(grid, smem, stream, q, k_cache, v_cache, num_heads, num_kv_heads, head_dim,
                       block_size, tokens, segments, scale, out);
  } else {
    std::fprintf(stderr, "mobius cuda: attention head dim %d > %d is not supported\n", head_dim,
                 kMaxAttentionHeadDim);
    std::abort();
  }
  CheckLaunch("PagedAttention");
  return false;
}

}  // namespace mobius::kernels::cuda
