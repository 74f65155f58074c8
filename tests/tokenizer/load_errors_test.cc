// Tokenizer files this library cannot reproduce exactly must fail to load with an error that
// names the unsupported component, instead of silently producing different ids.
#include <string>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/tokenizer.h"

namespace mobius::tokenizer {
namespace {

std::string LoadError(const nlohmann::json& json) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromJsonString(json.dump());
  if (tokenizer.ok()) return "loaded";
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(tokenizer.status().message());
}

TEST(LoadErrorsTest, TinyTokenizerLoads) {
  EXPECT_EQ(LoadError(testing::TinyTokenizerJson({{"a", "b"}})), "loaded");
}

TEST(LoadErrorsTest, UnsupportedComponentsAreNamed) {
  nlohmann::json json = testing::TinyTokenizerJson({});
  json["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(LoadError(json).find("Lowercase"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["pre_tokenizer"] = {{"type", "Metaspace"}};
  EXPECT_NE(LoadError(json).find("Metaspace"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["decoder"] = {{"type", "WordPiece"}};
  EXPECT_NE(LoadError(json).find("WordPiece"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["decoder"] = nullptr;
  EXPECT_NE(LoadError(json).find("decoder"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["post_processor"] = {{"type", "TemplateProcessing"}};
  EXPECT_NE(LoadError(json).find("TemplateProcessing"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["model"]["type"] = "Unigram";
  EXPECT_NE(LoadError(json).find("Unigram"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["truncation"] = {{"max_length", 8}};
  EXPECT_NE(LoadError(json).find("truncation"), std::string::npos);

  json = testing::TinyTokenizerJson({});
  json["pre_tokenizer"]["pretokenizers"] = {json["pre_tokenizer"]["pretokenizers"][1],
                                            json["pre_tokenizer"]["pretokenizers"][0]};
  EXPECT_NE(LoadError(json).find("after ByteLevel"), std::string::npos);
}

TEST(LoadErrorsTest, MalformedFiles) {
  EXPECT_FALSE(Tokenizer::FromJsonString("{ not json").ok());
  EXPECT_FALSE(Tokenizer::FromJsonString("[]").ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> missing =
      Tokenizer::FromDirectory("/nonexistent/tokenizer/dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/tokenizer/dir/tokenizer.json"),
            std::string::npos);
}

// A field of the wrong type is an error naming the section, the field and the value it got,
// never an exception out of the JSON library (the tokenizer_file_fuzz target found one: a
// non-string "model.type" aborted the process).
TEST(LoadErrorsTest, FieldsOfTheWrongTypeAreNamed) {
  nlohmann::json json = testing::TinyTokenizerJson({});
  json["model"]["type"] = {{"BPE", 1}};
  EXPECT_EQ(LoadError(json), "tokenizer.json model: \"type\" must be a string, got {\"BPE\":1}");

  json = testing::TinyTokenizerJson({});
  json["model"]["type"] = nullptr;  // null is as if absent: BPE
  EXPECT_EQ(LoadError(json), "loaded");

  json = testing::TinyTokenizerJson({});
  json["model"]["fuse_unk"] = "yes";
  EXPECT_EQ(LoadError(json), "tokenizer.json model: \"fuse_unk\" must be a boolean, got \"yes\"");

  json = testing::TinyTokenizerJson({});
  json["model"]["ignore_merges"] = 0;
  EXPECT_EQ(LoadError(json), "tokenizer.json model: \"ignore_merges\" must be a boolean, got 0");

  json = testing::TinyTokenizerJson({});
  json["model"]["unk_token"] = 5;
  EXPECT_EQ(LoadError(json), "tokenizer.json model: \"unk_token\" must be a string, got 5");

  json = testing::TinyTokenizerJson({});
  json["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = "false";
  EXPECT_EQ(LoadError(json),
            "tokenizer.json pre_tokenizer: \"use_regex\" must be a boolean, got \"false\"");

  json = testing::TinyTokenizerJson(
      {}, {{{"id", 300}, {"content", "<|x|>"}, {"special", 1}, {"normalized", false}}});
  EXPECT_EQ(LoadError(json), "tokenizer.json added_tokens: \"special\" must be a boolean, got 1");
}

// Ids index tables, so an id far past any real vocabulary is refused rather than sized for.
TEST(LoadErrorsTest, IdsPastTheLimitAreRefused) {
  nlohmann::json json = testing::TinyTokenizerJson({});
  json["model"]["vocab"]["huge"] = 2147483647;
  EXPECT_NE(LoadError(json).find("\"huge\" has an invalid id 2147483647"), std::string::npos);

  json = testing::TinyTokenizerJson(
      {}, {{{"id", 1 << 24}, {"content", "<|x|>"}, {"special", true}, {"normalized", false}}});
  EXPECT_NE(LoadError(json).find("invalid id 16777216"), std::string::npos);
}

// Added tokens past the vocabulary leave unknown ids in between: vocab_size() counts the ids,
// id_limit() bounds them, and the ids in the gap are refused.
TEST(LoadErrorsTest, AddedTokensPastTheVocabularyLeaveAGap) {
  const nlohmann::json json = testing::TinyTokenizerJson(
      {}, {{{"id", 300}, {"content", "<|x|>"}, {"special", true}, {"normalized", false}}});
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromJsonString(json.dump());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->vocab_size(), 257u);
  EXPECT_EQ((*tokenizer)->id_limit(), 301u);
  EXPECT_TRUE((*tokenizer)->TokenBytes(300).ok());
  EXPECT_FALSE((*tokenizer)->TokenBytes(280).ok());
  absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Encode("a<|x|>");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->back(), 300);
}

}  // namespace
}  // namespace mobius::tokenizer
