// The op interface every compute backend implements (cpu: fp32 reference with OpenBLAS; cuda:
// bf16 on sm_90a). Ops are plain math over tensors and a little per-sequence metadata; they
// know nothing of models, checkpoints or requests.
//
// Conventions:
// - Tensors are contiguous, row-major, on the backend's device, in its activation dtype
//   (activation_dtype()) unless a parameter says otherwise. Shapes below use T = tokens of the
//   step, H = hidden size; [T, N] means T rows of N elements.
// - Ragged batches: one step packs the tokens of several sequences back to back. Sequence-aware
//   ops take one SequenceSegment per sequence, in packing order, covering all T tokens.
// - Outputs never alias inputs unless the parameter says "in place".
#ifndef MOBIUS_KERNELS_BACKEND_H_
#define MOBIUS_KERNELS_BACKEND_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "kernels/tensor.h"
#include "kernels/token_sampling.h"

namespace mobius::kernels {

// The tokens of one sequence within a step.
struct SequenceSegment {
  int32_t token_begin = 0;    // first row of this sequence in the packed [T, ...] tensors
  int32_t num_tokens = 0;     // rows of this sequence in this step (1 for a decode token)
  int32_t cached_tokens = 0;  // tokens already processed before this step: the position of the
                              // first token, and the number of valid KV entries before it
  int32_t state_slot = -1;    // recurrent-state slot (conv + delta-rule state) of the sequence
  std::span<const int32_t> kv_blocks;  // paged-KV block table, enough blocks for
                                       // cached_tokens + num_tokens positions
  // Where the step's updated conv and delta-rule states go: -1 (or state_slot) in place; another
  // slot receives them and state_slot is only read. A speculative verify step writes to the
  // sequence's spare slot, so that rejected drafts need no snapshot copy: the old state is still
  // in state_slot. No other segment of the step may read or write this slot. (A segment without
  // tokens leaves both slots as they are.)
  int32_t state_out_slot = -1;
};

// The slot that receives a segment's updated states (SequenceSegment::state_out_slot).
inline int32_t WrittenStateSlot(const SequenceSegment& seg) {
  return seg.state_slot >= 0 && seg.state_out_slot >= 0 ? seg.state_out_slot : seg.state_slot;
}

// Dimensions of a gated-delta-rule (linear attention) mixer.
struct DeltaRuleDims {
  int num_k_heads = 0;  // Hk
  int num_v_heads = 0;  // Hv, a multiple of Hk; value head h reads key head h / (Hv / Hk)
  int k_head_dim = 0;   // Dk
  int v_head_dim = 0;   // Dv
};

enum class DeltaRuleAlgorithm {
  kAuto,       // recurrent for single-token segments, chunked for longer ones
  kRecurrent,  // token by token (reference for the chunked form)
  kChunked,    // chunked WY/UT form for every segment
};

struct RopeParams {
  int rotary_dim = 0;  // leading dims of each head that rotate (even); the rest pass through
  float theta = 10000.f;
};

// A MoE layer's shared expert as Backend::MoeExpertsWithSharedExpert takes it: its gate and up
// projections of the layer input, its down projection, the logit of its sigmoid gate, and
// scratch for the backend that computes its output separately.
struct SharedExpertOperands {
  const Tensor& gate_up;      // [T, 2 Is]: gate rows, then up rows
  const Tensor& down;         // [H, Is]
  const Tensor& gate_logits;  // [T, 1]
  Tensor& act;                // [T, Is] scratch
  Tensor& out;                // [T, H] scratch
};

// A gated DeltaNet mixer between its in- and out-projections, as Backend::GatedDeltaNetMixer
// takes it: the in-projection's outputs, the layer's mixer weights, the sequence states it
// updates in place, the gates it writes (speculative decoding replays a step from mixed, g and
// beta), and scratch for the backend that runs the parts separately.
struct DeltaNetMixerOperands {
  const Tensor& mixed;    // [T, 2*Hk*Dk + Hv*Dv]: q, k, v before the conv
  const Tensor& z;        // [T, Hv*Dv]
  const Tensor& a;        // [T, Hv]
  const Tensor& b;        // [T, Hv]
  const Tensor& conv_w;   // [2*Hk*Dk + Hv*Dv, K]
  const Tensor& a_log;    // [Hv]
  const Tensor& dt_bias;  // [Hv]
  const Tensor& norm_w;   // [Dv]
  float eps;
  DeltaRuleDims dims;
  Tensor& conv_states;       // F32 [slots, 2*Hk*Dk + Hv*Dv, K-1]
  Tensor& recurrent_states;  // F32 [slots, Hv, Dk, Dv]
  Tensor& g;                 // F32 [T, Hv]
  Tensor& beta;              // F32 [T, Hv]
  Tensor& conv_out;          // [T, 2*Hk*Dk + Hv*Dv] scratch
  Tensor& core;              // [T, Hv*Dv] scratch
};

// One DeltaNet layer's part in Backend::ReplayDeltaRuleStates: what a step kept of its inputs
// (the pre-conv q/k/v rows and the gates its delta rule used) and the layer's states.
struct DeltaRuleReplayLayer {
  const Tensor* mixed = nullptr;       // [R, 2*Hk*Dk + Hv*Dv]: the kept rows
  const Tensor* g = nullptr;           // F32 [R, Hv]
  const Tensor* beta = nullptr;        // F32 [R, Hv]
  const Tensor* conv_w = nullptr;      // [2*Hk*Dk + Hv*Dv, K]
  Tensor* conv_states = nullptr;       // F32 [slots, 2*Hk*Dk + Hv*Dv, K-1], in place
  Tensor* recurrent_states = nullptr;  // F32 [slots, Hv, Dk, Dv], in place
};

// The dimensions of a model's ops that a backend's kernels may bound (head sizes, conv taps),
// checked once before any weight is loaded. Each field is named after the Hugging Face config
// field it comes from; 0 means the model has no such op.
struct ModelOpShapes {
  int head_dim = 0;                // gated attention: head size
  int linear_key_head_dim = 0;     // gated DeltaNet: Dk
  int linear_value_head_dim = 0;   // Dv
  int linear_conv_kernel_dim = 0;  // causal conv taps
};

// A recorded step (a CUDA graph): the ops queued between Backend::BeginCapture and EndCapture,
// replayed by Backend::Replay with whatever the tensors they read hold at that time.
class CapturedStep {
 public:
  virtual ~CapturedStep() = default;
};

struct DeviceMemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
  // Held for the intermediates of recorded steps (BeginCapture), and the most that one
  // recording has used of it.
  int64_t recorded_step_bytes = 0;
  int64_t recorded_step_peak_bytes = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  [[nodiscard]] virtual Device device() const = 0;
  [[nodiscard]] virtual std::string name() const = 0;
  // dtype in which the backend keeps weights and activations (cpu: F32, cuda: BF16).
  [[nodiscard]] virtual DType activation_dtype() const = 0;

  // OK when this backend runs every op of a model with these shapes; otherwise InvalidArgument
  // naming the field, its value and the backend's limit, so that loading fails before any
  // weight is read instead of an op failing mid-step. The default (the CPU reference) takes any.
  virtual absl::Status CheckModelOpShapes(const ModelOpShapes& shapes) const {
    return absl::OkStatus();
  }
  // Zero-initialised storage. ResourceExhausted when it does not fit.
  virtual absl::StatusOr<Tensor> Allocate(DType dtype, std::vector<int64_t> shape) = 0;
  // Storage whose contents are unspecified, for a tensor that the op producing it writes whole
  // (every element, on every call) before anything reads it. The CUDA backend then queues no
  // fill: a recorded decode step allocates several hundred such temporaries, and each zero-fill
  // would be a node of its graph. The default zero-fills (Allocate).
  virtual absl::StatusOr<Tensor> AllocateUninitialized(DType dtype, std::vector<int64_t> shape) {
    return Allocate(dtype, std::move(shape));
  }
  // Copies `count` host elements of type `src_dtype` into `dst` (count == dst.numel()),
  // converting to dst's dtype (F32/BF16/F16 sources into F32 or BF16; I32 into I32).
  virtual void CopyFromHost(const void* src, DType src_dtype, Tensor& dst) = 0;
  // Host memory to stage large uploads in (CopyFromHost sources): where the backend can pin it
  // (CUDA: page-locked) the copies run at the host link's rate instead of going through the
  // driver's staging of ordinary memory. The default is ordinary memory. Null when even that
  // could not be allocated.
  using HostBuffer = std::unique_ptr<void, void (*)(void*)>;
  virtual HostBuffer AllocateHostBuffer(size_t bytes) {
    return HostBuffer(std::malloc(bytes), std::free);
  }
  // Copies a tensor to host memory as fp32 (`dst` holds src.numel() floats). F32/BF16 sources.
  virtual void CopyToHostF32(const Tensor& src, float* dst) = 0;
  // Copies I32 tensor to host.
  virtual void CopyToHostI32(const Tensor& src, int32_t* dst) = 0;
  // Waits for queued work (no-op on the CPU).
  virtual void Synchronize() = 0;
  // Measures device-memory bandwidth with a large device-to-device copy, in bytes per second
  // counting bytes read plus bytes written: the roofline that benchmarks report against.
  // Unimplemented where it means nothing (the CPU backend).
  virtual absl::StatusOr<double> MeasureCopyBandwidth(size_t bytes) {
    return absl::UnimplementedError("no device memory to measure");
  }
  // Free and total memory of the backend's device. Unimplemented where there is no device
  // memory to plan (the CPU backend).
  virtual absl::StatusOr<DeviceMemoryInfo> MemoryInfo() {
    return absl::UnimplementedError("no device memory");
  }
  // Gives the blocks an allocator keeps for reuse back to the device (waiting for queued work
  // first), so that a larger allocation elsewhere can succeed. False when nothing was held.
  virtual bool ReleaseCachedMemory() { return false; }
  // The first failure of an op since the last call, then cleared. Ops return no status: one
  // that cannot get its device memory (the CUDA backend's op scratch) skips its launches, leaves
  // its outputs unwritten and reports ResourceExhausted here, so that the step it belongs to
  // fails with that error instead of the process aborting. OK when nothing failed.
  virtual absl::Status TakeOpError() { return absl::OkStatus(); }
  // Sets every byte of `t` to zero. The default goes through CopyFromHost; backends with a
  // device memset override it.
  virtual void ZeroFill(Tensor& t);

  // ---- step staging and capture (CUDA graphs) ----
  // Per-step host inputs, staged once: until ClearStep, ops handed these same spans (same data
  // pointers and sizes) read the staged device copy instead of uploading their own. The staged
  // layout depends only on the numbers of tokens and segments (block tables are data in it), so
  // a step captured while one step was staged can be replayed after StageStep has staged another
  // step of the same shape. `max_positions` bounds cached_tokens + num_tokens of the segments of
  // every step a capture will replay (attention sizes its work split from it). The default does
  // nothing.
  virtual void StageStep(std::span<const int32_t> ids, std::span<const SequenceSegment> segments,
                         int max_positions) {}
  virtual void ClearStep() {}
  // True when BeginCapture/EndCapture/Replay work (the CUDA backend).
  [[nodiscard]] virtual bool SupportsCapture() const { return false; }
  // Ops queued from here to EndCapture are recorded, not run. Needs a staged step: ops must not
  // upload other host data (GatherRows, MoeExperts with expert_tokens) or read back to the host.
  // Allocate() returns memory of a capture pool that every capture reuses from its start, so a
  // tensor allocated while capturing is valid until the next capture or the replay of any other
  // captured step.
  virtual absl::Status BeginCapture() { return absl::UnimplementedError("no step capture"); }
  virtual absl::StatusOr<std::unique_ptr<CapturedStep>> EndCapture() {
    return absl::UnimplementedError("no step capture");
  }
  // Queues a replay. FailedPrecondition when the step was captured against buffers that have
  // since been reallocated (capture it again).
  virtual absl::Status Replay(CapturedStep& step) {
    return absl::UnimplementedError("no step capture");
  }

  // ---- dense ----
  // y[T, N] = x[T, K] @ w[N, K]^T.
  virtual void Linear(const Tensor& x, const Tensor& w, Tensor& y) = 0;
  // ys[i] = x @ ws[i]^T for every i (ws.size() == ys.size()), each exactly as Linear: several
  // projections of one input. The default runs them one by one; a backend may fuse them (the
  // CUDA backend streams all the weights in one launch when x has a few rows).
  virtual void LinearFanOut(const Tensor& x, std::span<const Tensor* const> ws,
                            std::span<Tensor* const> ys);
  // out[i, :] = table[ids[i], :]. ids are host values, already validated against the table.
  virtual void EmbeddingLookup(std::span<const int32_t> ids, const Tensor& table, Tensor& out) = 0;
  // out[i, :] = x[rows[i], :] (rows are host values).
  virtual void GatherRows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) = 0;
  // In place, for every x of `xs`: x[to[i], :] = x[from[i], :] for every i (host values; no row
  // in `to` may appear in `from`). Speculative decoding's state snapshots and restores of a whole
  // step, every layer's conv and recurrent states, in one call. The default copies row by row
  // through GatherRows; the CUDA backend copies every row of up to 64 tensors in one launch.
  virtual void CopyRows(std::span<Tensor* const> xs, std::span<const int32_t> from,
                        std::span<const int32_t> to);
  // out = x / sqrt(mean(x^2) + eps) * (1 + w) per row, computed in fp32. x [R, D], w [D].
  virtual void RmsNorm1p(const Tensor& x, const Tensor& w, float eps, Tensor& out) = 0;
  // In place: residual += delta; then out = RmsNorm1p(residual, w, eps).
  virtual void AddRmsNorm1p(Tensor& residual, const Tensor& delta, const Tensor& w, float eps,
                            Tensor& out) = 0;
  // In place: x += y (same shape).
  virtual void Add(Tensor& x, const Tensor& y) = 0;
  // out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:], gate_up [T, 2I].
  virtual void SiluAndMul(const Tensor& gate_up, Tensor& out) = 0;
  // In place: x[t, :] += sigmoid(gate_logits[t]) * y[t, :]. x, y [T, H]; gate_logits [T, 1].
  virtual void AddSigmoidScaled(Tensor& x, const Tensor& y, const Tensor& gate_logits) = 0;
  // out = SiluAndMul(gate_up) @ w^T: an MLP's down projection of its gate/up projection.
  // `act` [T, I] receives SiluAndMul(gate_up) where a backend computes it separately (the
  // default); a backend that forms the activation inside the projection leaves it unwritten.
  virtual void SiluMulLinear(const Tensor& gate_up, const Tensor& w, Tensor& act, Tensor& out);

  // ---- gated DeltaNet (linear attention) ----
  // Causal depthwise conv over time followed by SiLU, per sequence:
  //   out[t, c] = silu(sum_j w[c, j] * x[t - K + 1 + j, c]),
  // where positions before the segment come from conv_states[slot] (the last K-1 inputs of the
  // sequence, zero for a fresh sequence) and conv_states[slot] is updated in place to the last
  // K-1 inputs (pre-conv), or conv_states[state_out_slot] receives them (WrittenStateSlot).
  // x, out [T, C]; w [C, K]; conv_states F32 [slots, C, K-1].
  virtual void CausalConv1dSilu(const Tensor& x, const Tensor& w, Tensor& conv_states,
                                std::span<const SequenceSegment> segments, Tensor& out) = 0;
  // g = -exp(a_log) * softplus(a + dt_bias) and beta = sigmoid(b), in fp32.
  // a, b [T, Hv] (activation dtype); a_log, dt_bias [Hv]; g, beta F32 [T, Hv].
  virtual void DeltaRuleGates(const Tensor& a, const Tensor& b, const Tensor& a_log,
                              const Tensor& dt_bias, Tensor& g, Tensor& beta) = 0;
  // The gated delta rule over each segment, continuing from the fp32 recurrent states [slots, Hv,
  // Dk, Dv] of its state_slot and writing the final ones to WrittenStateSlot (in place unless the
  // segment names a state_out_slot):
  //   q, k = l2norm per head (x / sqrt(sum x^2 + 1e-6)); q *= Dk^-0.5;
  //   per token: S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q.
  // qkv [T, 2*Hk*Dk + Hv*Dv] holds q (all heads), then k, then v per row (the conv output);
  // g, beta F32 [T, Hv]; out [T, Hv * Dv].
  virtual void GatedDeltaRule(const Tensor& qkv, const Tensor& g, const Tensor& beta,
                              const DeltaRuleDims& dims, Tensor& recurrent_states,
                              std::span<const SequenceSegment> segments,
                              DeltaRuleAlgorithm algorithm, Tensor& out) = 0;
  // DeltaRuleGates(a, b, a_log, dt_bias, g, beta), then GatedDeltaRule with those gates: the
  // gates are written to g and beta either way (speculative decoding keeps them to replay the
  // step). Backends compute the gates inside the delta rule where it pays (one launch less per
  // DeltaNet layer in a decode step).
  virtual void GatedDeltaRuleWithGates(const Tensor& qkv, const Tensor& a, const Tensor& b,
                                       const Tensor& a_log, const Tensor& dt_bias,
                                       const DeltaRuleDims& dims, Tensor& recurrent_states,
                                       std::span<const SequenceSegment> segments,
                                       DeltaRuleAlgorithm algorithm, Tensor& g, Tensor& beta,
                                       Tensor& out);
  // out[r, :] = x[r, :] / sqrt(mean(x[r]^2) + eps) * w * silu(z[r, :]). x, z, out [R, D]; w [D]
  // (a plain weight, not 1 + w).
  virtual void GatedRmsNorm(const Tensor& x, const Tensor& z, const Tensor& w, float eps,
                            Tensor& out) = 0;
  // The mixer between a DeltaNet layer's projections: CausalConv1dSilu(mixed) into conv_out,
  // GatedDeltaRuleWithGates(conv_out) into core, then GatedRmsNorm(core per value head, z) into
  // out [T, Hv*Dv]. Backends fuse the parts where it pays (the CUDA backend: decode and
  // speculative verify steps in one launch), leaving the scratch tensors unwritten; the states, g
  // and beta are updated either way.
  virtual void GatedDeltaNetMixer(const DeltaNetMixerOperands& op,
                                  std::span<const SequenceSegment> segments,
                                  DeltaRuleAlgorithm algorithm, Tensor& out);
  // Speculative decoding's rollback past rejected drafts: for every layer, CausalConv1dSilu and
  // then GatedDeltaRule (kAuto) over each segment's kept rows [token_begin, token_begin +
  // num_tokens), continuing from and updating the segment's state slot in place; their outputs
  // are not formed. Here token_begin indexes the R kept rows directly (segments need not be
  // packed or cover them); no two segments may share a state slot. InvalidArgument (naming the
  // layer or segment) for rows outside the kept ones or mismatched shapes, before any state is
  // touched. The default gathers each layer's rows and runs the two ops; the CUDA backend runs
  // every layer in one launch with the same bits (a replay was ~150 launches: 0.8-1.1 ms at
  // batch 1 on an H200, for ~28 us of state traffic).
  virtual absl::Status ReplayDeltaRuleStates(std::span<const DeltaRuleReplayLayer> layers,
                                             const DeltaRuleDims& dims,
                                             std::span<const SequenceSegment> segments);

  // ---- gated full attention ----
  // Splits q_gate [T, nh, 2*hd] (per head: query then gate) into q [T, nh, hd] and gate
  // [T, nh, hd]; applies RmsNorm1p(q_norm) to each q head and RmsNorm1p(k_norm) to each head of
  // k [T, nkv, hd] (in place), then rotate-half RoPE on the first rope.rotary_dim dims of q and k
  // at position cached_tokens + i of each segment's i-th token.
  virtual void QkNormRope(const Tensor& q_gate, Tensor& k, const Tensor& q_norm,
                          const Tensor& k_norm, float eps, const RopeParams& rope,
                          std::span<const SequenceSegment> segments, Tensor& q, Tensor& gate) = 0;
  // Stores k, v [T, nkv, hd] at positions cached_tokens + i into the paged caches
  // [num_blocks, block_size, nkv, hd] through each segment's block table.
  virtual void WriteKvCache(const Tensor& k, const Tensor& v,
                            std::span<const SequenceSegment> segments, Tensor& k_cache,
                            Tensor& v_cache) = 0;
  // Causal GQA attention of q [T, nh, hd] over the paged caches (which already hold this step's
  // keys and values): token i of a segment attends to positions 0 .. cached_tokens + i. Query
  // head h reads kv head h / (nh / nkv). out [T, nh, hd].
  virtual void PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              std::span<const SequenceSegment> segments, float scale,
                              Tensor& out) = 0;
  // In place: x *= sigmoid(gate), elementwise.
  virtual void MulSigmoid(Tensor& x, const Tensor& gate) = 0;
  // An attention layer's steps before its attention: QkNormRope, then WriteKvCache of the
  // normalised and rotated k and of v. Backends fuse them where it pays (the CUDA backend: one
  // launch), with the bits of the separate ops.
  virtual void QkNormRopeWriteKv(const Tensor& q_gate, Tensor& k, const Tensor& v,
                                 const Tensor& q_norm, const Tensor& k_norm, float eps,
                                 const RopeParams& rope, std::span<const SequenceSegment> segments,
                                 Tensor& q, Tensor& gate, Tensor& k_cache, Tensor& v_cache);
  // PagedAttention into out, then MulSigmoid(out, gate): the gated attention's output. Backends
  // fuse the gate into the attention's last write where they can, with the same bits.
  virtual void GatedPagedAttention(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                                   const Tensor& v_cache, std::span<const SequenceSegment> segments,
                                   float scale, Tensor& out);

  // ---- mixture of experts ----
  // p = softmax(logits[t, :]) in fp32; the k largest (ties: lower id first) and their
  // probabilities, renormalised to sum to 1 when `renormalize`. logits [T, E] (any E);
  // ids I32 [T, k]; weights F32 [T, k].
  virtual void TopKSoftmax(const Tensor& logits, int k, bool renormalize, Tensor& ids,
                           Tensor& weights) = 0;
  // In place: out[t, :] += sum_j weights[t, j] * Expert_{ids[t, j]}(x[t, :]) where
  // Expert_e(x) = (silu(g) * u) @ down[e]^T with [g; u] = x @ gate_up[e]^T (gate rows first).
  // gate_up [E_local, 2I, H], down [E_local, H, I] hold experts first_expert ..
  // first_expert + E_local - 1; routed ids outside that range contribute nothing (expert
  // parallelism). Each touched expert's weights are read once per call. If expert_tokens is
  // non-empty (size E_local) the number of (token, expert) pairs routed to each local expert is
  // added to it.
  virtual void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights,
                          const Tensor& gate_up, const Tensor& down, int first_expert, Tensor& out,
                          std::span<int64_t> expert_tokens) = 0;
  // ids[r] = the index of the largest entry of row r of logits F32 [R, V] (the lowest index
  // among equal maxima, as std::max_element): greedy decoding without copying the logits.
  // ids I32 [R]. The default goes through the host.
  virtual void ArgmaxRows(const Tensor& logits, Tensor& ids);
  // out[r] = a token of row r of logits F32 [R, V] (R = rules.size()) drawn under rules[r] with
  // the uniform draw uniforms[r] in [0, 1): DrawToken's rule (kernels/token_sampling.h), with its
  // kept candidates and their order; a draw whose u lies within rounding of a boundary between two
  // tokens may take the neighbour. The tokens are on the host when it returns. The default goes
  // through the host.
  // `drafts` is empty (every row a plain draw) or holds each row's mode in a speculative verify
  // step: kPlainDraw, or the draft the row checks (kNoDraft for the row after the last draft):
  // then out[r] is CheckDraft's (the draft's probability under the rule and a draw from the rest
  // in id order), with the same rounding caveat.
  virtual void SampleRows(const Tensor& logits, std::span<const SamplingRule> rules,
                          std::span<const double> uniforms, std::span<const int32_t> drafts,
                          std::span<DrawnToken> out);
  // In place: row r of logits F32 [R, V] (R = rows.size()) under rows[r]'s penalties
  // (ApplyLogitPenalties, kernels/token_sampling.h; inactive entries leave their rows as they
  // are), ahead of SampleRows. The default goes through the host, row by row.
  virtual void PenalizeRows(Tensor& logits, std::span<const LogitPenalties> rows);
  // For top-n logprobs without the rows on the host: the counts[r] largest logits of row r of
  // logits F32 [R, V] (R = counts.size(); TopLogits' order: ties to the lower id), best first,
  // into out[r * width, r * width + counts[r]) with width = the largest count, and
  // chosen_logits[r] = logits[r, chosen[r]] (the logprobs are taken relative to the drawn
  // token's). Rows of count 0 are skipped. On the host when it returns; the default goes through
  // the host.
  virtual void TopLogitsRows(const Tensor& logits, std::span<const int32_t> counts,
                             std::span<const int32_t> chosen, std::span<TokenLogit> out,
                             std::span<float> chosen_logits);
  // True when SampleRows draws on the device, so that callers pass it their rows instead of
  // copying the logits to the host.
  [[nodiscard]] virtual bool SamplesOnDevice() const { return false; }
  // Routes (token, expert) pairs to this rank's local expert slots under an expert placement
  // with replicas (worker/model/expert_placement.h, RouteTable):
  //   out[t, j] = routes[e * stride + 1 + t mod routes[e * stride]],  e = ids[t, j],
  // a local slot, or -1 where another rank computes the pair (or e is outside [0, E)).
  // ids, out I32 [T, k]; routes I32 [E * stride]. The default goes through the host.
  virtual void MapExpertIds(const Tensor& ids, const Tensor& routes, int stride, Tensor& out);
  // A MoE layer's output, written (not added) to out:
  //   out[t, :] = sum_j weights[t, j] * Expert_{ids[t, j]}(x[t, :])
  //               + sigmoid(shared_gate[t]) * shared[t, :],
  // i.e. ZeroFill(out), MoeExperts(...), AddSigmoidScaled(out, shared, shared_gate) (the
  // default). Backends fold the zeroing and the shared term into the expert kernels where a row's
  // routed sum is complete in one place (CUDA: the few-token down kernel, or the grouped path's
  // combine). shared [T, H]; shared_gate [T, 1].
  virtual void MoeExpertsWithShared(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                    const Tensor& gate_up, const Tensor& down, int first_expert,
                                    const Tensor& shared, const Tensor& shared_gate, Tensor& out,
                                    std::span<int64_t> expert_tokens);
  // The same with the shared expert's down projection left to the op (the model's form):
  //   SiluMulLinear(shared.gate_up, shared.down, shared.act, shared.out);
  //   MoeExpertsWithShared(x, ..., shared.out, shared.gate_logits, out, expert_tokens)
  // (the default). A backend that completes a row's routed sum in one place computes the shared
  // expert's part of that row there too, and may leave shared.act and shared.out unwritten.
  // Callers launch at least one op (the routing) between the op that writes shared.gate_up and
  // this one: the CUDA backend reads it ahead of its wait for the previous kernel.
  virtual void MoeExpertsWithSharedExpert(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                          const Tensor& gate_up, const Tensor& down,
                                          int first_expert, const SharedExpertOperands& shared,
                                          Tensor& out, std::span<int64_t> expert_tokens);
  // A MoE layer from its router logits (the model's form without expert replication):
  //   TopKSoftmax(router_logits, k, renormalize, ids, weights);
  //   MoeExpertsWithSharedExpert(x, ids, weights, gate_up, down, first_expert, shared, out, ...)
  // (the default). A backend may place the shared expert's down projection beside the routing
  // instead (shared.out then holds it); ids and weights are written either way.
  virtual void RoutedMoeWithSharedExpert(const Tensor& x, const Tensor& router_logits, int k,
                                         bool renormalize, Tensor& ids, Tensor& weights,
                                         const Tensor& gate_up, const Tensor& down,
                                         int first_expert, const SharedExpertOperands& shared,
                                         Tensor& out, std::span<int64_t> expert_tokens);
};

inline void Backend::ArgmaxRows(const Tensor& logits, Tensor& ids) {
  const int64_t rows = ids.numel(), vocab = rows > 0 ? logits.numel() / rows : 0;
  std::vector<float> host(static_cast<size_t>(logits.numel()));
  CopyToHostF32(logits, host.data());
  std::vector<int32_t> best(static_cast<size_t>(rows), 0);
  for (int64_t r = 0; r < rows && vocab > 0; ++r) {
    const float* row = host.data() + r * vocab;
    best[r] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
  }
  CopyFromHost(best.data(), DType::kI32, ids);
}

inline void Backend::SampleRows(const Tensor& logits, std::span<const SamplingRule> rules,
                                std::span<const double> uniforms, std::span<const int32_t> drafts,
                                std::span<DrawnToken> out) {
  const size_t rows = rules.size();
  if (rows == 0) return;
  const size_t vocab = static_cast<size_t>(logits.numel()) / rows;
  std::vector<float> host(static_cast<size_t>(logits.numel()));
  CopyToHostF32(logits, host.data());
  for (size_t r = 0; r < rows && r < uniforms.size() && r < out.size(); ++r) {
    out[r] = SampleRow(std::span<const float>(host).subspan(r * vocab, vocab), rules[r],
                       r < drafts.size() ? drafts[r] : kPlainDraw, uniforms[r]);
  }
}

inline void Backend::PenalizeRows(Tensor& logits, std::span<const LogitPenalties> rows) {
  const int64_t count = static_cast<int64_t>(rows.size());
  if (count == 0 || logits.numel() % count != 0) return;  // (callers check the shapes)
  const int64_t vocab = logits.numel() / count;
  Tensor matrix = logits.Reshape({count, vocab});
  std::vector<float> host(static_cast<size_t>(vocab));
  for (int64_t r = 0; r < count; ++r) {
    if (!rows[r].Active()) continue;
    Tensor row = matrix.Rows(r, 1);
    CopyToHostF32(row, host.data());
    ApplyLogitPenalties(host, rows[r]);
    CopyFromHost(host.data(), DType::kF32, row);
  }
}

inline void Backend::TopLogitsRows(const Tensor& logits, std::span<const int32_t> counts,
                                   std::span<const int32_t> chosen, std::span<TokenLogit> out,
                                   std::span<float> chosen_logits) {
  const int64_t rows = static_cast<int64_t>(counts.size());
  if (rows == 0 || logits.numel() % rows != 0) return;  // (callers check the shapes)
  const int64_t vocab = logits.numel() / rows;
  const int32_t width = std::max(0, *std::max_element(counts.begin(), counts.end()));
  if (chosen.size() < counts.size() || chosen_logits.size() < counts.size() ||
      out.size() < static_cast<size_t>(rows) * width) {
    return;
  }
  const Tensor matrix = logits.Reshape({rows, vocab});
  std::vector<float> host(static_cast<size_t>(vocab));
  for (int64_t r = 0; r < rows; ++r) {
    if (counts[r] <= 0) continue;
    CopyToHostF32(matrix.Rows(r, 1), host.data());
    TopLogits(host, counts[r], out.subspan(r * width, static_cast<size_t>(counts[r])));
    chosen_logits[r] = chosen[r] >= 0 && chosen[r] < vocab
                           ? host[static_cast<size_t>(chosen[r])]
                           : std::numeric_limits<float>::quiet_NaN();
  }
}

inline void Backend::MapExpertIds(const Tensor& ids, const Tensor& routes, int stride,
                                  Tensor& out) {
  std::vector<int32_t> id(static_cast<size_t>(ids.numel())),
      table(static_cast<size_t>(routes.numel()));
  CopyToHostI32(ids, id.data());
  CopyToHostI32(routes, table.data());
  const int64_t k = ids.rank() == 2 ? ids.dim(1) : 1;
  const int64_t experts = stride > 0 ? routes.numel() / stride : 0;
  for (size_t p = 0; p < id.size(); ++p) {
    const int64_t e = id[p], t = static_cast<int64_t>(p) / k;
    if (e < 0 || e >= experts || table[e * stride] <= 0) {
      id[p] = -1;
      continue;
    }
    id[p] = table[e * stride + 1 + t % table[e * stride]];
  }
  CopyFromHost(id.data(), DType::kI32, out);
}

inline void Backend::SiluMulLinear(const Tensor& gate_up, const Tensor& w, Tensor& act,
                                   Tensor& out) {
  SiluAndMul(gate_up, act);
  Linear(act, w, out);
}

inline void Backend::GatedDeltaRuleWithGates(const Tensor& qkv, const Tensor& a, const Tensor& b,
                                             const Tensor& a_log, const Tensor& dt_bias,
                                             const DeltaRuleDims& dims, Tensor& recurrent_states,
                                             std::span<const SequenceSegment> segments,
                                             DeltaRuleAlgorithm algorithm, Tensor& g, Tensor& beta,
                                             Tensor& out) {
  DeltaRuleGates(a, b, a_log, dt_bias, g, beta);
  GatedDeltaRule(qkv, g, beta, dims, recurrent_states, segments, algorithm, out);
}

inline void Backend::GatedDeltaNetMixer(const DeltaNetMixerOperands& op,
                                        std::span<const SequenceSegment> segments,
                                        DeltaRuleAlgorithm algorithm, Tensor& out) {
  CausalConv1dSilu(op.mixed, op.conv_w, op.conv_states, segments, op.conv_out);
  GatedDeltaRuleWithGates(op.conv_out, op.a, op.b, op.a_log, op.dt_bias, op.dims,
                          op.recurrent_states, segments, algorithm, op.g, op.beta, op.core);
  const int64_t rows = op.core.numel() / std::max(op.dims.v_head_dim, 1);
  Tensor heads_out = out.Reshape({rows, op.dims.v_head_dim});
  GatedRmsNorm(op.core.Reshape({rows, op.dims.v_head_dim}),
               op.z.Reshape({rows, op.dims.v_head_dim}), op.norm_w, op.eps, heads_out);
}

// The checks every backend's ReplayDeltaRuleStates makes before touching a state: each layer's
// tensors present and shaped for `dims` (mixed in the backend's `activation` dtype, the gates and
// states F32), each segment's rows among the R kept ones (R of layer 0, the same in every layer),
// its state slot within every layer's slots and not shared.
inline absl::Status CheckDeltaRuleReplay(std::span<const DeltaRuleReplayLayer> layers,
                                         const DeltaRuleDims& dims,
                                         std::span<const SequenceSegment> segments,
                                         DType activation) {
  const int64_t channels = 2LL * dims.num_k_heads * dims.k_head_dim +
                           static_cast<int64_t>(dims.num_v_heads) * dims.v_head_dim;
  const int64_t hv = dims.num_v_heads;
  if (dims.num_k_heads <= 0 || hv <= 0 || hv % dims.num_k_heads != 0 || dims.k_head_dim <= 0 ||
      dims.v_head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ReplayDeltaRuleStates: bad dims Hk=%d Hv=%d Dk=%d Dv=%d", dims.num_k_heads,
                        hv, dims.k_head_dim, dims.v_head_dim));
  }
  int64_t rows = -1, slots = -1;
  for (size_t l = 0; l < layers.size(); ++l) {
    const DeltaRuleReplayLayer& L = layers[l];
    if (L.mixed == nullptr || L.g == nullptr || L.beta == nullptr || L.conv_w == nullptr ||
        L.conv_states == nullptr || L.recurrent_states == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("ReplayDeltaRuleStates: layer %d lacks a tensor", l));
    }
    const int64_t r = L.mixed->rank() == 2 ? L.mixed->dim(0) : -1;
    const int64_t s = L.conv_states->rank() == 3 ? L.conv_states->dim(0) : -1;
    const bool shapes =
        r >= 0 && (rows < 0 || r == rows) && L.mixed->dim(1) == channels &&
        L.mixed->dtype() == activation && L.g->dtype() == DType::kF32 &&
        L.beta->dtype() == DType::kF32 && L.g->rank() == 2 && L.g->dim(0) == r &&
        L.g->dim(1) == hv && L.beta->rank() == 2 && L.beta->dim(0) == r && L.beta->dim(1) == hv &&
        L.conv_w->rank() >= 2 && L.conv_w->dim(0) == channels && s >= 0 &&
        L.conv_states->dim(1) == channels &&
        L.conv_w->numel() == channels * (L.conv_states->dim(2) + 1) &&
        L.conv_states->dtype() == DType::kF32 && L.recurrent_states->rank() == 4 &&
        L.recurrent_states->dtype() == DType::kF32 && L.recurrent_states->dim(0) == s &&
        L.recurrent_states->dim(1) == hv && L.recurrent_states->dim(2) == dims.k_head_dim &&
        L.recurrent_states->dim(3) == dims.v_head_dim;
    if (!shapes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ReplayDeltaRuleStates: layer %d: mixed %s, g %s, beta %s, conv_w %s, conv_states %s, "
          "recurrent_states %s do not fit %d channels, Hv = %d and %d kept rows",
          l, L.mixed->ShapeString(), L.g->ShapeString(), L.beta->ShapeString(),
          L.conv_w->ShapeString(), L.conv_states->ShapeString(), L.recurrent_states->ShapeString(),
          channels, hv, rows < 0 ? r : rows));
    }
    rows = r;
    slots = slots < 0 ? s : std::min(slots, s);
  }
  for (size_t i = 0; i < segments.size(); ++i) {
    const SequenceSegment& seg = segments[i];
    if (seg.token_begin < 0 || seg.num_tokens <= 0 ||
        (rows >= 0 && int64_t{seg.token_begin} + seg.num_tokens > rows)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "ReplayDeltaRuleStates: segment %d: rows [%d, +%d) outside the %d kept rows", i,
          seg.token_begin, seg.num_tokens, rows));
    }
    if (seg.state_slot < 0 || (slots >= 0 && seg.state_slot >= slots)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("ReplayDeltaRuleStates: segment %d: state slot %d outside [0, %d)", i,
                          seg.state_slot, slots));
    }
    if (WrittenStateSlot(seg) != seg.state_slot) {
      return absl::InvalidArgumentError(
          absl::StrFormat("ReplayDeltaRuleStates: segment %d: state_out_slot %d; a replay updates "
                          "its state slot %d in place",
                          i, seg.state_out_slot, seg.state_slot));
    }
    for (size_t o = 0; o < i; ++o) {
      if (segments[o].state_slot == seg.state_slot) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "ReplayDeltaRuleStates: segments %d and %d share state slot %d", o, i, seg.state_slot));
      }
    }
  }
  return absl::OkStatus();
}

inline absl::Status Backend::ReplayDeltaRuleStates(std::span<const DeltaRuleReplayLayer> layers,
                                                   const DeltaRuleDims& dims,
                                                   std::span<const SequenceSegment> segments) {
  if (absl::Status checked = CheckDeltaRuleReplay(layers, dims, segments, activation_dtype());
      !checked.ok()) {
    return checked;
  }
  // The kept rows of every segment, packed as the ops take a step's tokens.
  std::vector<int32_t> rows;
  std::vector<SequenceSegment> packed;
  for (const SequenceSegment& seg : segments) {
    SequenceSegment p = seg;
    p.token_begin = static_cast<int32_t>(rows.size());
    for (int32_t t = 0; t < seg.num_tokens; ++t) rows.push_back(seg.token_begin + t);
    packed.push_back(p);
  }
  if (rows.empty() || layers.empty()) return absl::OkStatus();
  const int64_t t = static_cast<int64_t>(rows.size());
  const int64_t hv = dims.num_v_heads;
  auto mixed = Allocate(activation_dtype(), {t, layers[0].mixed->dim(1)});
  auto conv_out = Allocate(activation_dtype(), {t, layers[0].mixed->dim(1)});
  auto g = Allocate(DType::kF32, {t, hv});
  auto beta = Allocate(DType::kF32, {t, hv});
  auto core = Allocate(activation_dtype(), {t, hv * dims.v_head_dim});
  for (const auto* a : {&mixed, &conv_out, &g, &beta, &core}) {
    if (!a->ok()) return a->status();
  }
  for (const DeltaRuleReplayLayer& layer : layers) {
    GatherRows(*layer.mixed, rows, *mixed);
    GatherRows(*layer.g, rows, *g);
    GatherRows(*layer.beta, rows, *beta);
    CausalConv1dSilu(*mixed, *layer.conv_w, *layer.conv_states, packed, *conv_out);
    GatedDeltaRule(*conv_out, *g, *beta, dims, *layer.recurrent_states, packed,
                   DeltaRuleAlgorithm::kAuto, *core);
  }
  return absl::OkStatus();
}

inline void Backend::QkNormRopeWriteKv(const Tensor& q_gate, Tensor& k, const Tensor& v,
                                       const Tensor& q_norm, const Tensor& k_norm, float eps,
                                       const RopeParams& rope,
                                       std::span<const SequenceSegment> segments, Tensor& q,
                                       Tensor& gate, Tensor& k_cache, Tensor& v_cache) {
  QkNormRope(q_gate, k, q_norm, k_norm, eps, rope, segments, q, gate);
  WriteKvCache(k, v, segments, k_cache, v_cache);
}

inline void Backend::GatedPagedAttention(const Tensor& q, const Tensor& gate, const Tensor& k_cache,
                                         const Tensor& v_cache,
                                         std::span<const SequenceSegment> segments, float scale,
                                         Tensor& out) {
  PagedAttention(q, k_cache, v_cache, segments, scale, out);
  MulSigmoid(out, gate);
}

inline void Backend::MoeExpertsWithShared(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                          const Tensor& gate_up, const Tensor& down,
                                          int first_expert, const Tensor& shared,
                                          const Tensor& shared_gate, Tensor& out,
                                          std::span<int64_t> expert_tokens) {
  ZeroFill(out);
  MoeExperts(x, ids, weights, gate_up, down, first_expert, out, expert_tokens);
  AddSigmoidScaled(out, shared, shared_gate);
}

inline void Backend::MoeExpertsWithSharedExpert(const Tensor& x, const Tensor& ids,
                                                const Tensor& weights, const Tensor& gate_up,
                                                const Tensor& down, int first_expert,
                                                const SharedExpertOperands& shared, Tensor& out,
                                                std::span<int64_t> expert_tokens) {
  SiluMulLinear(shared.gate_up, shared.down, shared.act, shared.out);
  MoeExpertsWithShared(x, ids, weights, gate_up, down, first_expert, shared.out, shared.gate_logits,
                       out, expert_tokens);
}

inline void Backend::RoutedMoeWithSharedExpert(const Tensor& x, const Tensor& router_logits, int k,
                                               bool renormalize, Tensor& ids, Tensor& weights,
                                               const Tensor& gate_up, const Tensor& down,
                                               int first_expert, const SharedExpertOperands& shared,
                                               Tensor& out, std::span<int64_t> expert_tokens) {
  TopKSoftmax(router_logits, k, renormalize, ids, weights);
  MoeExpertsWithSharedExpert(x, ids, weights, gate_up, down, first_expert, shared, out,
                             expert_tokens);
}

inline void Backend::LinearFanOut(const Tensor& x, std::span<const Tensor* const> ws,
                                  std::span<Tensor* const> ys) {
  for (size_t i = 0; i < ws.size() && i < ys.size(); ++i) Linear(x, *ws[i], *ys[i]);
}

inline void Backend::CopyRows(std::span<Tensor* const> xs, std::span<const int32_t> from,
                              std::span<const int32_t> to) {
  for (Tensor* x : xs) {
    for (size_t i = 0; i < from.size() && i < to.size(); ++i) {
      Tensor dst = x->Rows(to[i], 1);
      GatherRows(*x, from.subspan(i, 1), dst);
    }
  }
}

inline void Backend::ZeroFill(Tensor& t) {
  std::vector<float> zeros(static_cast<size_t>(t.numel()), 0.0f);  // 4 bytes per element
  CopyFromHost(zeros.data(), t.dtype() == DType::kI32 ? DType::kI32 : DType::kF32, t);
}

// Creates the fp32 CPU backend. `num_threads` <= 0 uses every core.
std::unique_ptr<Backend> CreateCpuBackend(int num_threads = 0);

}  // namespace mobius::kernels

#endif  // MOBIUS_KERNELS_BACKEND_H_
