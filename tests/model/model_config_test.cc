// Config loading: both layouts, derived fields, and clear errors naming the bad field.
#include "worker/model/model_config.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/fixture_util.h"
#include "worker/model/generation_defaults.h"

namespace mobius::worker {
namespace {

using ::testing::HasSubstr;

nlohmann::json MobiusConfig() {
  return nlohmann::json::parse(R"({
    "model_type": "interns2_mobius",
    "tie_word_embeddings": false,
    "text_config": {
      "model_type": "interns2_mobius_text", "hidden_size": 64, "num_hidden_layers": 6,
      "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
      "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 8,
      "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3, "num_experts": 10,
      "num_experts_per_tok": 3, "moe_intermediate_size": 16,
      "shared_expert_intermediate_size": 24, "num_blocks": 2, "rms_norm_eps": 1e-6,
      "vocab_size": 100, "max_position_embeddings": 512,
      "rope_parameters": {"rope_theta": 5000.0, "partial_rotary_factor": 0.5}
    }
  })");
}

TEST(ModelConfigTest, LoadsBothFixtureLayouts) {
  auto qwen = LoadModelConfig(testing::FixtureModelDir("qwen3next-tiny"));
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_EQ(qwen->family, ModelFamily::kQwen3Next);
  EXPECT_EQ(qwen->num_blocks, qwen->num_hidden_layers);
  EXPECT_EQ(qwen->BankOfLayer(5), 5);
  EXPECT_EQ(qwen->head_dim, 64);
  EXPECT_EQ(qwen->rotary_dim(), 16);

  auto mobius = LoadModelConfig(testing::FixtureModelDir("intern-s2-mobius-tiny"));
  ASSERT_TRUE(mobius.ok()) << mobius.status();
  EXPECT_EQ(mobius->family, ModelFamily::kInternS2Mobius);
  EXPECT_EQ(mobius->num_blocks, 3);
  EXPECT_EQ(mobius->BankOfLayer(7), 1);  // strided, not contiguous
  EXPECT_EQ(mobius->num_experts, 40);
  EXPECT_EQ(mobius->mtp_num_experts, 16);
  EXPECT_DOUBLE_EQ(mobius->rope_theta, 1e7);
  EXPECT_EQ(mobius->layer_types[3], LayerType::kFullAttention);
  EXPECT_EQ(mobius->layer_types[4], LayerType::kLinearAttention);
}

TEST(ModelConfigTest, DerivesLayerTypesAndReadsTopLevelRope) {
  nlohmann::json j = MobiusConfig();
  j["text_config"].erase("rope_parameters");
  j["text_config"]["rope_theta"] = 1234.0;
  j["text_config"]["partial_rotary_factor"] = 0.25;
  j["text_config"]["full_attention_interval"] = 3;
  auto c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->layer_types.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(c->layer_types[i],
              (i + 1) % 3 == 0 ? LayerType::kFullAttention : LayerType::kLinearAttention)
        << i;
  }
  EXPECT_DOUBLE_EQ(c->rope_theta, 1234.0);
  EXPECT_EQ(c->rotary_dim(), 4);
  EXPECT_EQ(c->num_blocks, 2);
  EXPECT_EQ(c->conv_dim(), 2 * 16 + 72);
}

TEST(ModelConfigTest, DefaultIntervalIsFour) {
  nlohmann::json j = MobiusConfig();
  auto c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layer_types[3], LayerType::kFullAttention);
  EXPECT_EQ(c->layer_types[2], LayerType::kLinearAttention);
  EXPECT_EQ(c->num_layers_of(LayerType::kFullAttention), 1);
}

TEST(ModelConfigTest, MissingRequiredFieldIsNamed) {
  for (const char* field : {"hidden_size", "num_hidden_layers", "vocab_size", "num_experts",
                            "linear_num_key_heads", "num_attention_heads"}) {
    nlohmann::json j = MobiusConfig();
    j["text_config"].erase(field);
    auto c = ParseModelConfig(j.dump(), "config.json");
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_THAT(c.status().message(), HasSubstr(field));
  }
}

TEST(ModelConfigTest, InconsistentValuesAreNamed) {
  struct Case {
    const char* field;
    nlohmann::json value;
  };
  for (const Case& bad :
       {Case{"num_key_value_heads", 3}, Case{"linear_num_value_heads", 5},
        Case{"num_experts_per_tok", 11}, Case{"hidden_size", -4}, Case{"num_blocks", 7},
        Case{"layer_types", {"full_attention"}}, Case{"vocab_size", "many"}}) {
    nlohmann::json j = MobiusConfig();
    j["text_config"][bad.field] = bad.value;
    auto c = ParseModelConfig(j.dump(), "config.json");
    ASSERT_FALSE(c.ok()) << bad.field;
    EXPECT_THAT(c.status().message(), HasSubstr(bad.field));
  }
  // The MTP head's routing: more experts per token than its bank holds (given, or inherited
  // from num_experts_per_tok) would fail only in the first draft step.
  for (const int per_tok : {5, 0}) {
    nlohmann::json j = MobiusConfig();
    j["text_config"]["mtp_num_hidden_layers"] = 1;
    j["text_config"]["mtp_num_experts"] = per_tok == 0 ? 2 : 4;
    if (per_tok > 0) j["text_config"]["mtp_num_experts_per_tok"] = per_tok;
    auto c = ParseModelConfig(j.dump(), "config.json");
    ASSERT_FALSE(c.ok()) << per_tok;
    EXPECT_THAT(c.status().message(), HasSubstr("mtp_num_experts_per_tok"));
  }
}

// Each field within its own bound, but sizes derived from them past what the engine's types hold
// (found by tests/fuzz/model_config_fuzz: 2 x 2^30 overflowed an int in the parameter layout).
TEST(ModelConfigTest, SizesBeyondTheEngineAreNamed) {
  struct Case {
    std::vector<std::pair<const char*, int64_t>> fields;
    const char* named;
  };
  const int64_t big = int64_t{1} << 30;  // each field's own upper bound
  for (const Case& bad : {
           Case{{{"num_hidden_layers", 5000}}, "num_hidden_layers"},
           Case{{{"num_experts", int64_t{1} << 21}}, "num_experts"},
           Case{{{"moe_intermediate_size", big}}, "moe_intermediate_size"},
           Case{{{"vocab_size", big + 1}}, "vocab_size"},
           Case{{{"num_attention_heads", 1 << 16}, {"head_dim", 1 << 15}}, "num_attention_heads"},
           Case{{{"linear_value_head_dim", 1 << 28}}, "linear_num_value_heads"},
           Case{{{"hidden_size", 1 << 20}, {"vocab_size", 1 << 24}}, "parameters"},
           Case{{{"max_position_embeddings", 0}}, "max_position_embeddings"},
       }) {
    nlohmann::json j = MobiusConfig();
    for (const auto& [field, value] : bad.fields) j["text_config"][field] = value;
    auto c = ParseModelConfig(j.dump(), "config.json");
    ASSERT_FALSE(c.ok()) << bad.named;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), HasSubstr(bad.named));
  }
  // The release config is far inside every limit.
  const auto release =
      LoadModelConfig(std::string(MOBIUS_CONFIGS_DIR) + "/intern-s2-mobius-35b/config.json");
  EXPECT_TRUE(release.ok()) << release.status();
}

TEST(ModelConfigTest, RejectsUnknownModelTypeAndBadJson) {
  nlohmann::json j = MobiusConfig();
  j["model_type"] = "llama";
  j["text_config"]["model_type"] = "llama";
  EXPECT_THAT(ParseModelConfig(j.dump(), "c.json").status().message(), HasSubstr("llama"));
  EXPECT_THAT(ParseModelConfig("{not json", "c.json").status().message(), HasSubstr("JSON"));
  EXPECT_EQ(LoadModelConfig("/nonexistent/dir").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelConfigTest, QwenDenseLayers) {
  auto base = LoadModelConfig(testing::FixtureModelDir("qwen3next-tiny"));
  ASSERT_TRUE(base.ok());
  nlohmann::json j = MobiusConfig()["text_config"];
  j["model_type"] = "qwen3_next";
  j["mlp_only_layers"] = {1};
  j["intermediate_size"] = 32;
  auto c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->mlp_types[1], MlpType::kDense);
  EXPECT_EQ(c->mlp_types[0], MlpType::kMoe);
  j.erase("intermediate_size");
  EXPECT_THAT(ParseModelConfig(j.dump(), "config.json").status().message(),
              HasSubstr("intermediate_size"));
}

// EOS ids from generation_config.json, then config.json: an id or a list; entries that are not
// token ids (negative, past int32, not integers) are skipped rather than wrapped to another id.
TEST(GenerationDefaultsTest, ReadsEosIdsAndSkipsInvalidOnes) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "mobius_generation_defaults_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "generation_config.json")
      << R"({"eos_token_id": [7, -1, 4294967304, "9", 7, 11]})";
  std::ofstream(dir / "config.json") << R"({"eos_token_id": 12})";
  EXPECT_EQ(ReadEosTokenIds(dir.string()), (std::vector<int32_t>{7, 11, 12}));
  std::filesystem::remove_all(dir);
  EXPECT_TRUE(ReadEosTokenIds(dir.string()).empty());
}

}  // namespace
}  // namespace mobius::worker
