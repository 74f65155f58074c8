// Host-side entry points of the CUDA kernels: plain pointers, sizes and dtype flags, launched
// asynchronously on `stream`. CudaBackend validates shapes and dtypes before calling these; the
// launchers only check the launch itself (a failed launch aborts: ops have no error channel).
#ifndef MOBIUS_KERNELS_CUDA_LAUNCH_H_
#define MOBIUS_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace mobius::kernels::cuda {

// A device array whose elements are either fp32 or bf16 (raw 16-bit patterns).
struct AnyPtr {
  const void* data = nullptr;
  bool f32 = false;
};
struct AnyMutPtr {
  void* data = nullptr;
  bool f32 = false;
};

// Per-token metadata of a ragged step, uploaded by the backend. All arrays live on the device.
struct TokenMeta {
  const int32_t* token_segment = nullptr;   // [T] segment index of each token
  const int32_t* token_position = nullptr;  // [T] cached_tokens + index within its segment
};
struct SegmentMeta {
  int num_segments = 0;
  const int32_t* token_begin = nullptr;    // [S]
  const int32_t* num_tokens = nullptr;     // [S]
  const int32_t* cached_tokens = nullptr;  // [S]
  const int32_t* state_slot = nullptr;     // [S]
  // [S] the slot each segment's updated states go to (kernels::WrittenStateSlot); nullptr: in
  // place. Read with StateOutSlot (common.cuh).
  const int32_t* state_out_slot = nullptr;
  const int32_t* block_table_begin = nullptr;  // [S] offset of the segment's kv_blocks in
  const int32_t* block_tables = nullptr;       //     the concatenated block tables
};

// ---- dense (elementwise_kernels.cu) ----
void LaunchGatherRows(AnyPtr src, const int32_t* rows, int64_t num_rows, int64_t width,
                      AnyMutPtr dst, cudaStream_t stream);
// Backend::ArgmaxRows: ids[r] = argmax of logits row r (fp32 [rows, vocab]).
void LaunchArgmaxRows(const float* logits, int64_t rows, int64_t vocab, int32_t* ids,
                      cudaStream_t stream);
// ---- sampling (sampling_kernels.cu) ----
// One row of Backend::SampleRows: its SamplingRule, uniform draw u in [0, 1) and mode (draft:
// kPlainDraw, or the draft the row checks, kNoDraft after the last one: kernels::CheckDraft).
struct SampleRowParams {
  float temperature = 1.0f;  // 0: greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  double u = 0.0;
  int32_t draft = -2;  // kernels::kPlainDraw (this header stays free of host headers)
  int32_t unused = 0;
};
// Its result: the token, its logprob (plain draws) and the draft's probability (checked rows),
// or token -1 when the row's truncation candidates exceed kMaxSampleCandidates (the caller then
// draws the row on the host).
struct SampleRowResult {
  int32_t token = 0;
  float logprob = 0.0f;
  double draft_probability = 0.0;
};
inline constexpr int kMaxSampleCandidates = 4096;
// Backend::SampleRows over fp32 logits [rows, vocab]: params and results are device arrays of
// `rows`. One block per row.
void LaunchSampleRows(const float* logits, int64_t rows, int64_t vocab,
                      const SampleRowParams* params, SampleRowResult* results, cudaStream_t stream);
// One row of Backend::PenalizeRows: its penalties and its (token, output count) entries,
// entries[first .. first + count) and entries[shared_first .. shared_first + shared_count) of
// the launch's int2 array (the second range may be another row's too), then its logit biases,
// entries[bias_first .. bias_first + bias_count) as (token, the bias's float bits).
struct PenaltyRowParams {
  float repetition = 1.0f;
  float frequency = 0.0f;
  float presence = 0.0f;
  int32_t first = 0;
  int32_t count = 0;
  int32_t shared_first = 0;
  int32_t shared_count = 0;
  int32_t bias_first = 0;
  int32_t bias_count = 0;
  int32_t unused = 0;
};
// Backend::PenalizeRows over fp32 logits [rows, vocab], in place: params (`rows` of them) and
// entries are device arrays. One block per row.
void LaunchPenalizeRows(float* logits, int64_t rows, int64_t vocab, const PenaltyRowParams* params,
                        const int2* entries, cudaStream_t stream);
// The allowed-token masks of Backend::PenalizeRows: row mask_rows[i] of fp32 logits [*, vocab]
// keeps the tokens whose bit is set in masks[i * words, (i + 1) * words) (words = ceil(vocab /
// 64)); the others become -infinity. mask_rows and masks are device arrays of `masked` rows.
void LaunchMaskRows(float* logits, int64_t masked, int64_t vocab, const int32_t* mask_rows,
                    const uint64_t* masks, cudaStream_t stream);
// Backend::TopLogitsRows: row r's counts[r] (<= kMaxTopLogits) best (token, logit) pairs into
// out[r * width, ...) and chosen_logits[r] = logits[r, chosen[r]]; counts, chosen, out and
// chosen_logits are device arrays of `rows` (out: rows * width).
inline constexpr int kMaxTopLogits = 20;
struct TopLogitResult {
  int32_t token = 0;
  float logit = 0.0f;
};
void LaunchTopLogitsRows(const float* logits, int64_t rows, int64_t vocab, const int32_t* counts,
                         const int32_t* chosen, int width, TopLogitResult* out,
                         float* chosen_logits, cudaStream_t stream);
// One tensor of Backend::CopyRows: its rows are row_bytes apart from `base`.
struct CopyRowsTarget {
  void* base = nullptr;
  int64_t row_bytes = 0;
};
inline constexpr int kMaxCopyRowsTargets = 64;
// Backend::CopyRows in one launch: rows to[i] = from[i] (device arrays of num_rows) of each of
// `num_targets` tensors. False, launching nothing, when a tensor's rows are not 16-byte pieces
// or there are more than kMaxCopyRowsTargets tensors.
bool LaunchCopyRows(const CopyRowsTarget* targets, int num_targets, const int32_t* from,
                    const int32_t* to, int64_t num_rows, cudaStream_t stream);
void LaunchRmsNorm1p(const uint16_t* x, AnyPtr w, float eps, int64_t rows, int64_t dim,
                     uint16_t* out, cudaStream_t stream);
void LaunchAddRmsNorm1p(uint16_t* residual, const uint16_t* delta, AnyPtr w, float eps,
                        int64_t rows, int64_t dim, uint16_t* out, cudaStream_t stream);
void LaunchAdd(uint16_t* x, const uint16_t* y, int64_t n, cudaStream_t stream);
void LaunchSiluAndMul(const uint16_t* gate_up, int64_t rows, int64_t inter, uint16_t* out,
                      cudaStream_t stream);
void LaunchAddSigmoidScaled(uint16_t* x, const uint16_t* y, AnyPtr gate_logits, int64_t rows,
                            int64_t dim, cudaStream_t stream);
void LaunchGatedRmsNorm(const uint16_t* x, const uint16_t* z, AnyPtr w, float eps, int64_t rows,
                        int64_t dim, uint16_t* out, cudaStream_t stream);
void LaunchMulSigmoid(uint16_t* x, const uint16_t* gate, int64_t n, cudaStream_t stream);

// Fallback GEMM (CUDA cores): c[m, n] = a[m, k] @ w[n, k]^T. Used when cuBLASLt has no algorithm
// for a shape (or rejects the pointers' alignment).
void LaunchGemmFallback(const uint16_t* a, const uint16_t* w, int64_t m, int64_t n, int64_t k,
                        AnyMutPtr c, cudaStream_t stream);

// ---- GEMMs with a few rows (skinny_gemm.cu) ----
// y[M, n] = x[M, K] @ w[n, K]^T for one of the weights of a skinny GEMM; y fp32 or bf16.
struct SkinnyTarget {
  const uint16_t* w = nullptr;
  int64_t n = 0;
  AnyMutPtr y;
};
inline constexpr int kMaxSkinnyTargets = 4;
inline constexpr int kMaxSkinnyRows = 2;
// True when LaunchSkinnyGemm takes x [m, k] and a weight at `w` (check every weight).
bool SkinnyGemmSupports(int64_t m, int64_t k, const void* x, const void* w);
// All targets in one launch (at most kMaxSkinnyTargets; every weight has K columns). With
// `silu_mul`, x is [m, 2K] (gate then up) and the product is taken with SiluAndMul(x).
void LaunchSkinnyGemm(const uint16_t* x, int64_t m, int64_t k, const SkinnyTarget* targets,
                      int num_targets, cudaStream_t stream, bool silu_mul = false);

// ---- projections of 1-40 rows on tensor cores (tc_gemv.cu) ----
inline constexpr int kMaxTcGemvRows = 40;  // x rows: up to five 8-row tiles (the mma's n = 8)
// The most rows the backend sends to it by default (MOBIUS_TC_GEMV_MAX_ROWS lowers it). At 40
// rows the five-tile form beat cuBLASLt on an H100 (session 49: DeltaNet in-projections 30.2
// against 40.7 us, decode batch 40 30.33 against 30.84 ms, verify of batch 8 with 4 drafts 29.14
// against 29.74 ms).
inline constexpr int kDefaultTcGemvMaxRows = 40;
// True when LaunchTcGemv takes x [m, k] and a weight at `w` (m <= kMaxTcGemvRows, k % 32 == 0,
// 16-byte aligned; check every weight).
bool TcGemvSupports(int64_t m, int64_t k, const void* x, const void* w);
// The skinny GEMM's fan-out (every weight has K columns) with mma.sync; the backend's path for
// 2-40 rows (MOBIUS_TC_GEMV in cuda_backend.cc).
void LaunchTcGemv(const uint16_t* x, int64_t m, int64_t k, const SkinnyTarget* targets,
                  int num_targets, cudaStream_t stream);

// ---- gated DeltaNet (deltanet_kernels.cu) ----
// Limits the model's shapes must meet (checked at load: CheckCudaModelOpShapes).
inline constexpr int kMaxConvKernel = 16;            // causal conv taps
inline constexpr int kMaxDeltaRuleKeyHeadDim = 256;  // recurrent delta rule: Dk in registers
// `single_token_segments`: every segment holds exactly one token (a decode step; the host knows,
// the device metadata would have to be read to find out), which the decode kernel requires.
void LaunchCausalConv1dSilu(const uint16_t* x, AnyPtr w, float* conv_states, int64_t num_tokens,
                            int64_t channels, int kernel_size, const TokenMeta& tokens,
                            const SegmentMeta& segments, bool single_token_segments, uint16_t* out,
                            cudaStream_t stream);
void LaunchDeltaRuleGates(const uint16_t* a, const uint16_t* b, AnyPtr a_log, AnyPtr dt_bias,
                          int64_t num_tokens, int num_v_heads, float* g, float* beta,
                          cudaStream_t stream);
// The raw inputs of the delta-rule gates (see LaunchDeltaRuleGates): a, b [T, Hv]; a_log,
// dt_bias [Hv].
struct DeltaGateInputs {
  const uint16_t* a = nullptr;
  const uint16_t* b = nullptr;
  AnyPtr a_log;
  AnyPtr dt_bias;
};
// How the recurrent warp kernel lays out a head's state for a step of `num_segments` sequences:
// `cols` value columns per group of `row_split` warps (which split the state rows); cols = 0 when
// the generic kernel is forced (MOBIUS_DELTA_RULE_GENERIC). The reduction order follows it.
struct DeltaRuleLayout {
  int cols = 0;
  int row_split = 1;
};
DeltaRuleLayout SelectDeltaRuleLayout(int num_segments);
// Token by token; segments longer than `max_tokens` are skipped (left to the chunked form).
// Without `gates` the kernel reads g and beta [num_tokens, Hv]; with them it computes the gates
// and writes them to g and beta too. `out_slots`: the form that stores each segment's state to
// its out slot (segments.state_out_slot); false: in place, which only the generic fallback kernel
// has in a form of its own. The warp kernel has one form: storing through StateOutSlot, which
// falls back to the slot read, measured 0.3-1% faster at decode batches 16-127 than the in-place
// instantiation it replaced (performance.md, session 48).
void LaunchGatedDeltaRuleRecurrent(const uint16_t* qkv, float* g, float* beta,
                                   const DeltaGateInputs* gates, int64_t num_tokens,
                                   int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                   float* states, const SegmentMeta& segments, int max_tokens,
                                   bool out_slots, uint16_t* out, cudaStream_t stream);
// Chunked (WY/UT) form over the segments of at least `min_tokens` tokens (chunked_delta_rule.cu).
// Supported: Dk 64 or 128, Dv a multiple of 32 up to 128 (ChunkedDeltaRuleSupports).
// `num_chunks` = sum over those segments of ceil(tokens / 64), `num_chunked_segments` their
// number; `scratch` holds ChunkedDeltaRuleScratchBytes(num_chunks, ...) bytes.
bool ChunkedDeltaRuleSupports(int k_head_dim, int v_head_dim);
size_t ChunkedDeltaRuleScratchBytes(int64_t num_chunks, int num_v_heads, int k_head_dim,
                                    int v_head_dim);
void LaunchGatedDeltaRuleChunked(const uint16_t* qkv, const float* g, const float* beta,
                                 int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                 float* states, const SegmentMeta& segments, int min_tokens,
                                 int64_t num_chunks, int num_chunked_segments, void* scratch,
                                 uint16_t* out, cudaStream_t stream);

// The DeltaNet mixer of a decode or speculative verify step in one launch
// (deltanet_decode_step.cu): the conv (kernel size 4) + SiLU of the in-projection's q, k, v, the
// gates, the recurrent delta rule and the gated RMSNorm, with the same roundings and summation
// orders as those kernels run one by one (conv output and delta-rule output to bf16). A cluster of
// eight blocks per key head and segment shares q and k and each value head's sums of squares
// through distributed shared memory. Every segment must hold 1 to kMaxDeltaNetStepTokens tokens.
inline constexpr int kMaxDeltaNetStepTokens = 8;
struct DeltaNetDecodeStepArgs {
  const uint16_t* mixed = nullptr;  // [T, 2*Hk*D + Hv*D]: q, k, v before the conv
  const uint16_t* z = nullptr;      // [T, Hv*D]
  const uint16_t* a = nullptr;      // [T, Hv]
  const uint16_t* b = nullptr;      // [T, Hv]
  AnyPtr conv_w;                    // [2*Hk*D + Hv*D, 4]
  AnyPtr a_log;                     // [Hv]
  AnyPtr dt_bias;                   // [Hv]
  AnyPtr norm_w;                    // [D]
  float eps = 0.0f;
  int num_k_heads = 0;
  int num_v_heads = 0;
  int head_dim = 0;              // Dk = Dv
  float* conv_states = nullptr;  // [slots, 2*Hk*D + Hv*D, 3]
  float* states = nullptr;       // [slots, Hv, D, D]
  float* g = nullptr;            // [T, Hv]
  float* beta = nullptr;         // [T, Hv]
  uint16_t* out = nullptr;       // [T, Hv*D]
};
// True when LaunchDeltaNetDecodeStep takes these shapes: Dk = Dv in {32, 64, 128}, Hv = 2 Hk,
// conv kernel size 4, a delta-rule layout for `num_segments` (SelectDeltaRuleLayout) that a block
// of D / 4 columns holds, and z, out, the conv and norm weights and the states 16-byte aligned.
bool DeltaNetDecodeStepSupports(int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                                int conv_kernel, int num_segments, const void* z, const void* out,
                                const void* conv_w, const void* norm_w, const void* conv_states,
                                const void* states);
// `max_tokens`: the longest segment (1 for a decode step, which takes a leaner kernel).
void LaunchDeltaNetDecodeStep(const DeltaNetDecodeStepArgs& args, const SegmentMeta& segments,
                              int max_tokens, cudaStream_t stream);
// Backend::ReplayDeltaRuleStates: the step's conv and delta rule (same arithmetic and layout, so
// the same bits as the separate kernels) over kept rows for up to kMaxReplayLayers layers in
// one launch (a grid dimension per layer), reading the gates the step kept.
inline constexpr int kMaxReplayLayers = 32;
struct DeltaNetReplayLayer {
  const uint16_t* mixed = nullptr;  // [R, 2*Hk*D + Hv*D]: kept q, k, v before the conv
  const float* g = nullptr;         // [R, Hv]
  const float* beta = nullptr;      // [R, Hv]
  AnyPtr conv_w;                    // [2*Hk*D + Hv*D, 4]
  float* conv_states = nullptr;     // [slots, 2*Hk*D + Hv*D, 3]
  float* states = nullptr;          // [slots, Hv, D, D]
};
struct DeltaNetReplayLayers {
  int count = 0;
  DeltaNetReplayLayer layer[kMaxReplayLayers];
};
// True when LaunchDeltaNetReplay takes these shapes (those of the step; with conv_w and the
// states 16-byte aligned, which the caller checks). Segments' token_begin index the kept rows;
// each holds 1 to kMaxDeltaNetStepTokens of them.
bool DeltaNetReplaySupports(int num_k_heads, int num_v_heads, int k_head_dim, int v_head_dim,
                            int conv_kernel, int num_segments);
void LaunchDeltaNetReplay(const DeltaNetReplayLayers& layers, int num_k_heads, int num_v_heads,
                          int head_dim, const SegmentMeta& segments, cudaStream_t stream);

// ---- gated attention (attention_kernels.cu) ----
// The largest head size the paged-attention kernels take (checked at load).
inline constexpr int kMaxAttentionHeadDim = 256;
// Where QkNormRope also stores this step's keys (as normalised and rotated) and values: the
// paged caches [blocks, block_size, nkv, head_dim], through each token's segment's block table
// (the WriteKvCache that otherwise follows it).
struct KvCacheWrite {
  const uint16_t* v = nullptr;  // [T, nkv, head_dim]
  uint16_t* k_cache = nullptr;
  uint16_t* v_cache = nullptr;
  int block_size = 0;
  const int32_t* token_segment = nullptr;
  SegmentMeta segs;
};
// With `kv`, returns whether the launch also wrote the caches (the vector kernel does; the
// fallback for odd head sizes does not, and the caller then launches LaunchWriteKvCache).
bool LaunchQkNormRope(const uint16_t* q_gate, uint16_t* k, AnyPtr q_norm, AnyPtr k_norm, float eps,
                      int rotary_dim, float theta, int64_t num_tokens, int num_heads,
                      int num_kv_heads, int head_dim, const int32_t* token_position, uint16_t* q,
                      uint16_t* gate, cudaStream_t stream, const KvCacheWrite* kv = nullptr);
// Stores token t's k/v row at position tokens.token_position[t] through its segment's block
// table (rows of `row_elems` = kv heads * head_dim).
void LaunchWriteKvCache(const uint16_t* k, const uint16_t* v, const TokenMeta& tokens,
                        const SegmentMeta& segs, int block_size, int64_t num_tokens,
                        int64_t row_elems, uint16_t* k_cache, uint16_t* v_cache,
                        cudaStream_t stream);
// Tensor-core (mma.sync) paged attention, flash_attention.cu: GQA groups dividing 64 and head
// dims 32/64/128/256 (MOBIUS_ATTENTION=simt turns it off). PagedAttention dispatches to it.
bool FlashAttentionSupports(int num_heads, int num_kv_heads, int head_dim);
void LaunchFlashPagedAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                               int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, const TokenMeta& tokens, const SegmentMeta& segs,
                               float scale, int splits, float* partial, uint16_t* out,
                               cudaStream_t stream);
// Warpgroup (wgmma) prefill attention, prefill_attention.cu: unsplit steps on sm_90, GQA groups
// dividing 128, head dims 64/128/256 (MOBIUS_ATTENTION_PREFILL=mma turns it off).
// PagedAttention dispatches to it when a step needs one split.
bool PrefillAttentionSupports(int num_heads, int num_kv_heads, int head_dim);
void LaunchPrefillAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            int64_t cache_blocks, int64_t num_tokens, int num_heads,
                            int num_kv_heads, int head_dim, int block_size, const TokenMeta& tokens,
                            const SegmentMeta& segs, float scale, uint16_t* out,
                            cudaStream_t stream);
// Tensor-core decode attention, flash_attention.cu: steps of at most one token per segment
// (num_tokens <= num_segments), GQA groups of up to 8 heads, head dims 64/128/256
// (MOBIUS_ATTENTION_DECODE=0 turns it off). PagedAttention dispatches to it.
bool DecodeAttentionSupports(int64_t num_tokens, int num_segments, int num_heads, int num_kv_heads,
                             int head_dim);
int DecodeAttentionSplits(int64_t num_tokens, int num_kv_heads, int max_positions, int num_sms);
// out_gate (optional, [T, nh, head_dim]): out *= sigmoid(out_gate) as Backend::MulSigmoid
// rounds it (out rounded to bf16 first), applied where out is written.
void LaunchDecodeAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                           int64_t cache_blocks, int64_t num_tokens, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, const TokenMeta& tokens,
                           const SegmentMeta& segs, float scale, int splits, int num_sms,
                           void* scratch, uint16_t* out, cudaStream_t stream,
                           const uint16_t* out_gate = nullptr);
// Number of position splits (flash-decoding) for a step whose longest attention span is
// `max_positions`, and the device scratch they need.
int PagedAttentionSplits(int64_t num_tokens, int num_segments, int num_heads, int num_kv_heads,
                         int head_dim, int max_positions, int num_sms);
size_t PagedAttentionScratchBytes(int64_t num_tokens, int num_heads, int head_dim, int splits);
// `cache_blocks`: the caches' first dimension ([blocks, block_size, nkv, head_dim]); `num_sms`:
// the device's SM count, as given to PagedAttentionSplits (the decode kernel's configuration
// depends on the grid's blocks per SM). With out_gate, returns whether the kernels applied it (the
// decode kernels do; otherwise the caller runs MulSigmoid).
bool LaunchPagedAttention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                          int64_t cache_blocks, int64_t num_tokens, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, const TokenMeta& tokens,
                          const SegmentMeta& segments, float scale, int splits, int num_sms,
                          void* scratch, uint16_t* out, cudaStream_t stream,
                          const uint16_t* out_gate = nullptr);

// ---- mixture of experts (topk_softmax.cu: the router top-k; moe_kernels.cu: many tokens;
// moe_few_tokens.cu: decode steps) ----
void LaunchTopKSoftmax(AnyPtr logits, int64_t num_tokens, int num_experts, int k, bool renormalize,
                       int32_t* ids, float* weights, cudaStream_t stream);
// The kernel LaunchTopKSoftmax takes (a host function, so that tests can check the choice
// without a GPU): one warp per token for prefill-sized batches, one block per token otherwise,
// in the first form whose limits (k, expert count, alignment) the call meets.
enum class TopKKernel {
  kWarpPerToken,
  kBlockFilter,
  kBlockRegisterLists,
  kBlockSharedMemory,
  kBlockGeneric
};
// kBlock / kWarp: use that form wherever it applies regardless of the batch (MOBIUS_TOPK).
enum class TopKOverride { kNone, kBlock, kWarp };
TopKKernel SelectTopKKernel(int64_t num_tokens, int num_experts, int k, bool logits_aligned16,
                            TopKOverride forced);

// Device scratch needed by LaunchMoeExperts, in bytes.
size_t MoeScratchBytes(int64_t num_tokens, int k, int num_local_experts, int64_t hidden,
                       int64_t inter);
struct MoeSharedTerm;  // below

// Returns the device array (inside `scratch`, [E_local] int32) holding the number of
// (token, expert) pairs routed to each local expert, valid once the stream reaches it.
// Without `shared` the routed sum is added to out (Backend::MoeExperts). With it (its finished
// `value` and `gate_logits`; num_tokens, k and num_local_experts all > 0, else it aborts), out =
// routed sum + sigmoid(gate) * value with the roundings of MoeExperts into a zeroed out followed
// by AddSigmoidScaled, and out is not read.
const int32_t* LaunchMoeExperts(const uint16_t* x, const int32_t* ids, const float* weights,
                                const uint16_t* gate_up, const uint16_t* down, int64_t num_tokens,
                                int k, int num_local_experts, int first_expert, int64_t hidden,
                                int64_t inter, void* scratch, const MoeSharedTerm* shared,
                                uint16_t* out, cudaStream_t stream);

// Backend::MapExpertIds: ids, out I32 [num_pairs] (k per token); routes I32 [experts * stride].
void LaunchMapExpertIds(const int32_t* ids, const int32_t* routes, int stride, int64_t experts,
                        int64_t num_pairs, int k, int32_t* out, cudaStream_t stream);

// The most (token, expert) pairs a MoE step may have to take the few-token kernels, for a bank of
// `num_experts` experts (the launcher's local ones), or MOBIUS_MOE_FEW_MAX_PAIRS (1-1024) for A/B
// runs. The few-token kernels request a shared expert's rows once per pair, so with n pairs they
// read the rows of s(n) = n - d(n) experts more than the grouped path, d(n) being the expected
// count of distinct experts; the grouped path pays launches, routing tiles and a combine, a cost
// that is fixed plus a little per expert. The limit is the most pairs, between
// kMoeFewTokensMinPairs and kMoeFewTokensMaxPairs, with s(n) <= kMoeGroupedFixedCost +
// kMoeGroupedCostPerExpert * d(n), both costs counted in experts' rows. The two constants put the
// crossover where it was measured (H100, dummy weights' near-uniform routes, top-8 / top-10, 2048
// x 512 experts): at 2560 experts the few-token kernels were 0.4-0.8 ms a step faster up to 256
// pairs, tied at 320 and lost from 512 (+1.8 ms); at 512 experts (Qwen3-Next's shapes, 12
// layers) they were 0.09-0.17 ms faster at 40-80 pairs and 0.01-0.02 ms slower at 100, 0.11
// slower at 130 and 0.5 at 190. That gives 256 pairs at 2560 experts (32 tokens at top-8), 95 at
// 512 (9 tokens at top-10) and the earlier 64 for banks up to ~280 experts (the MTP head's 256,
// the fixtures).
inline constexpr int kMoeFewTokensMinPairs = 64;
inline constexpr int kMoeFewTokensMaxPairs = 256;
inline constexpr double kMoeGroupedFixedCost = 4.0;
inline constexpr double kMoeGroupedCostPerExpert = 0.05;
int MoeFewTokensMaxPairs(int64_t num_experts);
// The same for a few tokens (at most MoeFewTokensMaxPairs pairs: decode), without routing tiles
// or a combine pass: returns false, launching nothing, for shapes it does not take. `act_scratch`
// holds MoeFewTokensScratchElems bf16 values. Counts no pairs (callers that want counts use the
// above).
// With `shared`, out is written (not added to) as routed sum + sigmoid(gate_logits[t]) * value[t]
// (a MoE layer's shared expert, Backend::MoeExpertsWithShared). Instead of `value`, the shared
// expert's own down projection can be left to the down kernel: value[t] = SiluMulLinear(gate_up[t],
// down) is then computed inside each block of the down kernel
// (Backend::MoeExpertsWithSharedExpert), which saves the separate projection's launch; the launcher
// returns false where it cannot. Up to this many tokens the few-token kernels take the shared
// expert's projection in (by default the gate-up kernel, see rows_in_gate_up; measured in one
// call against the separate projection: batch 3 -3.0%, 4 -1.5%, 5 -1.8%, 6 +0.5%, 8 +1.6%,
// performance.md twenty-fifth version); MoeSharedTerm::fused_max_tokens overrides it. (The
// model's MoE layers, Backend::RoutedMoeWithSharedExpert, take the rows beside the top-k from
// kMoeSharedBesideTopKMinTokens tokens, so there the gate-up kernel takes them at 1-3.)
inline constexpr int kMoeSharedExpertFusedMaxTokens = 5;
struct MoeSharedTerm {
  const uint16_t* value = nullptr;    // [T, hidden], or null with gate_up/down
  AnyPtr gate_logits;                 // [T]
  const uint16_t* gate_up = nullptr;  // [T, 2 inter]: the shared expert's gate and up rows
  const uint16_t* down = nullptr;     // [hidden, inter]
  int64_t inter = 0;
  int fused_max_tokens = kMoeSharedExpertFusedMaxTokens;  // more tokens: the launcher declines
  // Where the fused projection runs: the gate-up kernel (unless MOBIUS_MOE_SHARED_IN_GATEUP=0)
  // or, false, the down kernel. The same bits either way. The gate-up kernel reads gate_up and
  // writes its rows into act_scratch before its PDL wait, so the kernel launched just before
  // it must neither write gate_up nor touch act_scratch (the model's fan-out -> top-k -> MoE
  // order: top-k sits between and uses no scratch).
  bool rows_in_gate_up = true;
  // Set by the launcher (0 from callers): the gate-up kernel's blocks that take the rows, when
  // they are only the first wave's (SharedExpertInGateUp); 0: every block.
  int unit_blocks = 0;
};
// LaunchTopKSoftmax for 1 .. kMoeSharedBesideTopKMaxTokens tokens, with the shared expert's
// down projection (shared.gate_up, shared.down, shared.inter; value and gate_logits unused)
// computed into shared_out [num_tokens, hidden] by extra blocks of the top-k's grid, so that
// neither a projection launch nor the expert kernels carry it. The same bits as the few-token
// MoE kernels' shared rows. Returns false, launching nothing, where the filter top-k does not
// take the call or inter > 512 (one pair per thread). shared.gate_up is read after the kernel's
// PDL wait, shared.down before it.
inline constexpr int kMoeSharedBesideTopKMaxTokens = 8;
// From this many tokens Backend::RoutedMoeWithSharedExpert places the shared expert beside the
// top-k rather than in the gate-up kernel (measured: batch 4 -1.9%, 5 -1.6%, 6 -2.3%, 8 -1.5%;
// performance.md, twenty-sixth version).
inline constexpr int kMoeSharedBesideTopKMinTokens = 4;
bool LaunchTopKSoftmaxWithSharedRows(AnyPtr logits, int64_t num_tokens, int num_experts, int k,
                                     bool renormalize, int32_t* ids, float* weights,
                                     const MoeSharedTerm& shared, int64_t hidden,
                                     uint16_t* shared_out, cudaStream_t stream);
// The few-token kernels' scratch: the pairs' activations, then (from a 16-byte boundary, this
// element) the shared expert's finished rows [num_tokens, hidden].
inline int64_t MoeFewTokensSharedRowsOffset(int64_t num_tokens, int k, int64_t inter) {
  return (num_tokens * k * inter + 7) / 8 * 8;
}
inline int64_t MoeFewTokensScratchElems(int64_t num_tokens, int k, int64_t hidden, int64_t inter) {
  return MoeFewTokensSharedRowsOffset(num_tokens, k, inter) + num_tokens * hidden;
}
// act_scratch: MoeFewTokensScratchElems elements.
bool LaunchMoeExpertsFewTokens(const uint16_t* x, const int32_t* ids, const float* weights,
                               const uint16_t* gate_up, const uint16_t* down, int64_t num_tokens,
                               int k, int num_local_experts, int first_expert, int64_t hidden,
                               int64_t inter, uint16_t* act_scratch, uint16_t* out,
                               const MoeSharedTerm* shared, cudaStream_t stream);

}  // namespace mobius::kernels::cuda

#endif  // MOBIUS_KERNELS_CUDA_LAUNCH_H_
