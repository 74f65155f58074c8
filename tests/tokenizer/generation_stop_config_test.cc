#include "tokenizer/generation_stop_config.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"

namespace mobius::tokenizer {
namespace {

class GenerationStopConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokenizer_ = testing::QwenTokenizerOrFail();
    ASSERT_NE(tokenizer_, nullptr);
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("stop_config_") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& name, const std::string& contents) {
    std::ofstream(dir_ / name) << contents;
  }

  const Tokenizer* tokenizer_ = nullptr;
  std::filesystem::path dir_;
};

TEST_F(GenerationStopConfigTest, ReadsTheFixtureTokenizerConfig) {
  absl::StatusOr<GenerationStopConfig> stop =
      LoadGenerationStopConfig(testing::QwenTokenizerDir(), *tokenizer_);
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_EQ(stop->eos_token_ids, std::vector<int32_t>{151645});  // <|im_end|>
  EXPECT_TRUE(stop->IsStopToken(151645));
  EXPECT_FALSE(stop->IsStopToken(151643));
}

TEST_F(GenerationStopConfigTest, GenerationConfigListAndTokenizerConfigAreMerged) {
  Write("generation_config.json", R"({"eos_token_id": [151645, 151643]})");
  Write("tokenizer_config.json", R"({"eos_token": {"content": "<|im_end|>"}})");
  absl::StatusOr<GenerationStopConfig> stop = LoadGenerationStopConfig(dir_, *tokenizer_);
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_EQ(stop->eos_token_ids, (std::vector<int32_t>{151645, 151643}));
}

TEST_F(GenerationStopConfigTest, GenerationConfigAloneWithAnInteger) {
  Write("generation_config.json", R"({"eos_token_id": 151643, "bos_token_id": 151643})");
  absl::StatusOr<GenerationStopConfig> stop = LoadGenerationStopConfig(dir_, *tokenizer_);
  ASSERT_TRUE(stop.ok()) << stop.status();
  EXPECT_EQ(stop->eos_token_ids, std::vector<int32_t>{151643});
}

TEST_F(GenerationStopConfigTest, MissingOrBadEosIsAnError) {
  EXPECT_EQ(LoadGenerationStopConfig(dir_, *tokenizer_).status().code(),
            absl::StatusCode::kNotFound);
  Write("generation_config.json", R"({"eos_token_id": "x"})");
  EXPECT_EQ(LoadGenerationStopConfig(dir_, *tokenizer_).status().code(),
            absl::StatusCode::kInvalidArgument);
  Write("generation_config.json", R"({"eos_token_id": 99999999})");
  EXPECT_EQ(LoadGenerationStopConfig(dir_, *tokenizer_).status().code(),
            absl::StatusCode::kInvalidArgument);
  Write("generation_config.json", "{not json");
  EXPECT_EQ(LoadGenerationStopConfig(dir_, *tokenizer_).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(dir_ / "generation_config.json");
  Write("tokenizer_config.json", R"({"eos_token": "<|no_such_token|>"})");
  absl::Status status = LoadGenerationStopConfig(dir_, *tokenizer_).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("<|no_such_token|>"), std::string::npos);
}

}  // namespace
}  // namespace mobius::tokenizer
