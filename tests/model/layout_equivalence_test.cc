// Generality beyond the fixtures: a model with other head counts, GQA ratio, DeltaNet head ratio,
// bank count, layer pattern and vocabulary, written once in the Mobius layout and once in the
// Qwen3-Next layout (interleaved qkvz/ba, per-expert tensors, one MoE per layer), must compute
// the same logits; and prefill in chunks, token-by-token decode and one forward must agree.
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/fixture_util.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/model_factory.h"
#include "worker/model/parameter_layout.h"

namespace mobius::testing {
namespace {

namespace fs = std::filesystem;

constexpr int H = 48, Hk = 2, Hv = 6, Dk = 8, Dv = 12, K = 3, NH = 4, NKV = 1, HD = 16;
constexpr int E = 10, TOPK = 3, I = 16, IS = 24, V = 97, LAYERS = 5, BANKS = 2;

nlohmann::json TextConfig() {
  nlohmann::json j = {
      {"hidden_size", H},
      {"num_hidden_layers", LAYERS},
      {"layer_types",
       {"linear_attention", "full_attention", "linear_attention", "linear_attention",
        "full_attention"}},
      {"num_attention_heads", NH},
      {"num_key_value_heads", NKV},
      {"head_dim", HD},
      {"linear_num_key_heads", Hk},
      {"linear_num_value_heads", Hv},
      {"linear_key_head_dim", Dk},
      {"linear_value_head_dim", Dv},
      {"linear_conv_kernel_dim", K},
      {"num_experts", E},
      {"num_experts_per_tok", TOPK},
      {"moe_intermediate_size", I},
      {"shared_expert_intermediate_size", IS},
      {"rms_norm_eps", 1e-6},
      {"vocab_size", V},
      {"max_position_embeddings", 1024},
      {"rope_parameters", {{"rope_theta", 5000.0}, {"partial_rotary_factor", 0.5}}}};
  return j;
}

using TensorMap = std::map<std::string, std::pair<std::vector<int64_t>, std::vector<uint16_t>>>;

void Write(const fs::path& dir, const nlohmann::json& config, const TensorMap& tensors) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump(2);
  std::vector<worker::TensorToWrite> list;
  for (const auto& [name, t] : tensors) {
    list.push_back({name, kernels::DType::kBF16, t.first, t.second.data(), t.second.size() * 2});
  }
  ASSERT_TRUE(worker::WriteSafetensors((dir / "model.safetensors").string(), list).ok());
}

// Rows [begin, begin + count) of a row-major [rows, H] matrix.
std::vector<uint16_t> Rows(const std::vector<uint16_t>& m, int begin, int count, int cols) {
  return {m.begin() + int64_t{begin} * cols, m.begin() + int64_t{begin + count} * cols};
}

class LayoutEquivalenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / "layout_equivalence";
    fs::remove_all(root_);
    backend_ = kernels::CreateCpuBackend(1);

    // Mobius checkpoint with random bf16 values for every tensor the engine reads.
    nlohmann::json mobius = {{"model_type", "interns2_mobius"}, {"text_config", TextConfig()}};
    mobius["text_config"]["model_type"] = "interns2_mobius_text";
    mobius["text_config"]["num_blocks"] = BANKS;
    auto config = worker::ParseModelConfig(mobius.dump(), "mobius");
    ASSERT_TRUE(config.ok()) << config.status();
    worker::LayoutOptions options;
    options.prefix = "model.language_model.";
    std::mt19937 rng(7);
    TensorMap m;
    for (const auto& spec : worker::ListParameters(*config, options, nullptr)) {
      for (const auto& piece : spec.layouts.front().pieces) {
        if (m.count(piece.tensor)) continue;
        int64_t n = 1;
        for (int64_t d : piece.tensor_shape) n *= d;
        std::vector<uint16_t> v(n);
        const bool norm = spec.role == worker::ParameterRole::kNorm1p;
        std::uniform_real_distribution<float> dist(norm ? -0.2f : -0.25f, norm ? 0.2f : 0.25f);
        for (auto& x : v) {
          float f = dist(rng);
          if (spec.role == worker::ParameterRole::kALog) f = std::log(1.0f + 8 * std::fabs(f));
          if (spec.role == worker::ParameterRole::kPlainNorm) f += 1.0f;
          x = kernels::FloatToBF16(f);
        }
        m[piece.tensor] = {piece.tensor_shape, std::move(v)};
      }
    }
    Write(root_ / "mobius", mobius, m);

    // The same weights in the Qwen3-Next layout.
    nlohmann::json qwen = TextConfig();
    qwen["model_type"] = "qwen3_next";
    TensorMap q;
    const std::string mp = "model.language_model.";
    for (const auto& [name, t] : m) {
      if (name.starts_with(mp) && name.find("meta_mlp") == std::string::npos &&
          name.find("in_proj_") == std::string::npos) {
        q["model." + name.substr(mp.size())] = t;
      } else if (name == "lm_head.weight") {
        q[name] = t;
      }
    }
    const int r = Hv / Hk;
    for (int l = 0; l < LAYERS; ++l) {
      const std::string lp = mp + "layers." + std::to_string(l) + ".linear_attn.";
      const std::string qp = "model.layers." + std::to_string(l) + ".";
      if (m.count(lp + "in_proj_qkv.weight")) {
        const auto& qkv = m[lp + "in_proj_qkv.weight"].second;
        const auto& z = m[lp + "in_proj_z.weight"].second;
        const auto& b = m[lp + "in_proj_b.weight"].second;
        const auto& a = m[lp + "in_proj_a.weight"].second;
        std::vector<uint16_t> qkvz, ba;
        auto append = [](std::vector<uint16_t>& dst, const std::vector<uint16_t>& src) {
          dst.insert(dst.end(), src.begin(), src.end());
        };
        for (int g = 0; g < Hk; ++g) {
          append(qkvz, Rows(qkv, g * Dk, Dk, H));
          append(qkvz, Rows(qkv, Hk * Dk + g * Dk, Dk, H));
          append(qkvz, Rows(qkv, 2 * Hk * Dk + g * r * Dv, r * Dv, H));
          append(qkvz, Rows(z, g * r * Dv, r * Dv, H));
          append(ba, Rows(b, g * r, r, H));
          append(ba, Rows(a, g * r, r, H));
        }
        q[qp + "linear_attn.in_proj_qkvz.weight"] = {{2 * Hk * Dk + 2 * Hv * Dv, H}, qkvz};
        q[qp + "linear_attn.in_proj_ba.weight"] = {{2 * Hv, H}, ba};
      }
      // Layer l's experts are bank l % BANKS, stored per expert.
      const std::string bank = mp + "meta_mlp." + std::to_string(l % BANKS) + ".";
      q[qp + "mlp.gate.weight"] = m[bank + "gate.weight"];
      const auto& gate_up = m[bank + "experts.gate_up_proj"].second;
      const auto& down = m[bank + "experts.down_proj"].second;
      for (int e = 0; e < E; ++e) {
        const std::string ep = qp + "mlp.experts." + std::to_string(e) + ".";
        q[ep + "gate_proj.weight"] = {{I, H}, Rows(gate_up, e * 2 * I, I, H)};
        q[ep + "up_proj.weight"] = {{I, H}, Rows(gate_up, e * 2 * I + I, I, H)};
        q[ep + "down_proj.weight"] = {{H, I}, Rows(down, e * H, H, I)};
      }
    }
    Write(root_ / "qwen", qwen, q);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::unique_ptr<worker::HybridModel> Load(const std::string& name) {
    auto model = LoadFixtureModel((root_ / name).string(), *backend_);
    if (model) {
      EXPECT_TRUE(model->CreateCaches(2, 64).ok());
    }
    return model;
  }

  std::vector<float> Run(worker::HybridModel& model, const std::vector<int32_t>& prompt,
                         size_t chunk) {
    worker::SequenceCache seq;
    EXPECT_TRUE(model.StartSequence(seq).ok());
    worker::ForwardOptions options;
    options.logits = worker::LogitsMode::kAllTokens;
    std::vector<float> all, logits;
    for (size_t b = 0; b < prompt.size(); b += chunk) {
      worker::SequenceStep step{std::span(prompt).subspan(b, std::min(chunk, prompt.size() - b)),
                                &seq};
      EXPECT_TRUE(model.Forward(std::span(&step, 1), options, logits).ok());
      all.insert(all.end(), logits.begin(), logits.end());
    }
    model.ReleaseSequence(seq);
    return all;
  }

  fs::path root_;
  std::unique_ptr<kernels::Backend> backend_;
};

TEST_F(LayoutEquivalenceTest, BothLayoutsComputeTheSameFunction) {
  auto mobius = Load("mobius");
  auto qwen = Load("qwen");
  ASSERT_NE(mobius, nullptr);
  ASSERT_NE(qwen, nullptr);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back((i * 37 + 11) % V);
  std::vector<float> a = Run(*mobius, prompt, prompt.size());
  std::vector<float> b = Run(*qwen, prompt, prompt.size());
  ASSERT_EQ(a.size(), prompt.size() * V);
  EXPECT_LT(RelativeError(b.data(), a.data(), a.size()), 1e-5);

  // The logits are not degenerate: different positions predict differently.
  EXPECT_GT(RelativeError(a.data(), a.data() + V, V), 1e-2);

  // Chunked prefill and token-by-token decode agree with the single forward.
  for (size_t chunk : {1, 3, 16}) {
    std::vector<float> c = Run(*mobius, prompt, chunk);
    EXPECT_LT(RelativeError(c.data(), a.data(), a.size()), 1e-4) << "chunk " << chunk;
  }
}

}  // namespace
}  // namespace mobius::testing
