// The fp32 reference backend: every tensor lives in host memory as F32 (I32 for ids), dense
// products go through OpenBLAS and the sequence ops are plain loops parallelised with OpenMP
// over tokens, heads or experts. Its results are the yardstick for the CUDA backend.
#ifndef MOBIUS_KERNELS_CPU_CPU_BACKEND_H_
#define MOBIUS_KERNELS_CPU_CPU_BACKEND_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace mobius::kernels {

class CpuBackend : public Backend {
 public:
  // `num_threads` <= 0 uses every core.
  explicit CpuBackend(int num_threads);

  [[nodiscard]] Device device() const override { return Device::kCpu; }
  [[nodiscard]] std::string name() const override;
  [[nodiscard]] DType activation_dtype() const override { return DType::kF32; }
  [[nodiscard]] int num_threads() const { return num_threads_; }

  absl::StatusOr<Tensor> Allocate(DType dtype, std::vector<int64_t> shape) override;
  void CopyFromHost(const void* src, DType src_dtype, Tensor& dst) override;
  void CopyToHostF32(const Tensor& src, float* dst) override;
  void CopyToHostI32(const Tensor& src, int32_t* dst) override;
  void Synchronize() override {}
  void ZeroFill(Tensor& t) override;

  // Dense ops (cpu_backend.cc).
  void Linear(const Tensor& x, const Tensor& w, Tensor& y) override;
  void EmbeddingLookup(std::span<const int32_t> ids, const Tensor& table, Tensor& out) override;
  void GatherRows(const Tensor& x, std::span<const int32_t> rows, Tensor& out) override;
  void RmsNorm1p(const Tensor& x, const Tensor& w, float eps, Tensor& out) override;
  void AddRmsNorm1p(Tensor& residual, const Tensor& delta, const Tensor& w, float eps,
                    Tensor& out) override;
  void Add(Tensor& x, const Tensor& y) override;
  void SiluAndMul(const Tensor& gate_up, Tensor& out) override;
  void AddSigmoidScaled(Tensor& x, const Tensor& y, const Tensor& gate_logits) override;
  void MulSigmoid(Tensor& x, const Tensor& gate) override;

  // Gated DeltaNet (cpu_deltanet.cc).
  void CausalConv1dSilu(const Tensor& x, const Tensor& w, Tensor& conv_states,
                        std::span<const SequenceSegment> segments, Tensor& out) override;
  void DeltaRuleGates(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                      Tensor& g, Tensor& beta) override;
  void GatedDeltaRule(const Tensor& qkv, const Tensor& g, const Tensor& beta,
                      const DeltaRuleDims& dims, Tensor& recurrent_states,
                      std::span<const SequenceSegment> segments, DeltaRuleAlgorithm algorithm,
                      Tensor& out) override;
  void GatedRmsNorm(const Tensor& x, const Tensor& z, const Tensor& w, float eps,
                    Tensor& out) override;

  // Gated full attention (cpu_attention.cc).
  void QkNormRope(const Tensor& q_gate, Tensor& k, const Tensor& q_norm, const Tensor& k_norm,
                  float eps, const RopeParams& rope, std::span<const SequenceSegment> segments,
                  Tensor& q, Tensor& gate) override;
  void WriteKvCache(const Tensor& k, const Tensor& v, std::span<const SequenceSegment> segments,
                    Tensor& k_cache, Tensor& v_cache) override;
  void PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      std::span<const SequenceSegment> segments, float scale, Tensor& out) override;

  // Mixture of experts (cpu_moe.cc).
  void TopKSoftmax(const Tensor& logits, int k, bool renormalize, Tensor& ids,
                   Tensor& weights) override;
  void MoeExperts(const Tensor& x, const Tensor& ids, const Tensor& weights, const Tensor& gate_up,
                  const Tensor& down, int first_expert, Tensor& out,
                  std::span<int64_t> expert_tokens) override;

 private:
  int num_threads_;
};

}  // namespace mobius::kernels

#endif  // MOBIUS_KERNELS_CPU_CPU_BACKEND_H_
