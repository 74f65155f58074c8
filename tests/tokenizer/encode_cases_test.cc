// The acceptance cases shipped with the Qwen3 tokenizer fixture: exact ids, exact decode, and
// streaming decode that matches the full decode.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

using testing::QwenTokenizerDir;
using testing::QwenTokenizerOrFail;
using testing::ReadJsonFileOrFail;

nlohmann::json LoadCases() {
  nlohmann::json cases = ReadJsonFileOrFail(QwenTokenizerDir() / "encode_cases.json");
  if (!cases.is_array() || cases.empty()) {
    ADD_FAILURE() << "encode_cases.json must be a non-empty array";
    return nlohmann::json::array();
  }
  return cases;
}

TEST(EncodeCasesTest, EveryCaseEncodesToTheListedIds) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const nlohmann::json cases = LoadCases();
  ASSERT_FALSE(cases.empty());
  for (const nlohmann::json& c : cases) {
    const std::string text = c["text"].get<std::string>();
    EXPECT_EQ(testing::EncodeOrFail(*tokenizer, text), c["ids"].get<std::vector<int32_t>>())
        << "text: " << text;
  }
}

TEST(EncodeCasesTest, EveryCaseDecodesToTheListedText) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  for (const nlohmann::json& c : LoadCases()) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    absl::StatusOr<std::string> text = tokenizer->Decode(ids);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, c["decoded"].get<std::string>());
  }
}

TEST(EncodeCasesTest, StreamingDecodeOfEveryCaseIsValidAndMatchesFullDecode) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  for (const nlohmann::json& c : LoadCases()) {
    IncrementalDetokenizer stream(*tokenizer);
    std::string streamed;
    for (int32_t id : c["ids"].get<std::vector<int32_t>>()) {
      absl::StatusOr<std::string> piece = stream.Push(id);
      ASSERT_TRUE(piece.ok()) << piece.status();
      EXPECT_TRUE(IsValidUtf8(*piece)) << "partial character emitted for id " << id;
      streamed += *piece;
    }
    const std::string tail = stream.Finish();
    EXPECT_TRUE(IsValidUtf8(tail));
    streamed += tail;
    EXPECT_EQ(streamed, c["decoded"].get<std::string>());
  }
}

TEST(EncodeCasesTest, VocabularyCountsAddedTokens) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  // 151643 BPE tokens plus 26 added tokens (value reported by Hugging Face tokenizers).
  EXPECT_EQ(tokenizer->vocab_size(), 151669u);
  EXPECT_EQ(tokenizer->TokenToId("<|im_end|>"), 151645);
  EXPECT_EQ(tokenizer->IdToToken(151644), "<|im_start|>");
  EXPECT_EQ(tokenizer->TokenToId("Hello"), 9707);
  EXPECT_EQ(tokenizer->IdToToken(1879), "Ġworld");
  EXPECT_EQ(tokenizer->TokenToId("no such token at all"), std::nullopt);
  EXPECT_TRUE(tokenizer->IsSpecialToken(151645));
  EXPECT_FALSE(tokenizer->IsSpecialToken(151657));  // <tool_call> is added but not special.
  EXPECT_FALSE(tokenizer->IsSpecialToken(9707));
}

TEST(EncodeCasesTest, UnknownIdIsAnErrorNamingTheId) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<int32_t> ids = {9707, 999999};
  absl::StatusOr<std::string> text = tokenizer->Decode(ids);
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(text.status().message().find("999999"), std::string::npos);
  const std::vector<int32_t> negative = {-1};
  EXPECT_FALSE(tokenizer->Decode(negative).ok());
}

TEST(EncodeCasesTest, SkipSpecialTokensDropsControlTokensOnly) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<int32_t> ids = {151644, 872, 198, 151657, 151645};
  absl::StatusOr<std::string> text = tokenizer->Decode(ids, {.skip_special_tokens = true});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "user\n<tool_call>");
}

TEST(EncodeCasesTest, SpecialTokensCanBeEncodedAsPlainText) {
  const Tokenizer* tokenizer = QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::string text = "<|im_end|>";
  const std::vector<int32_t> as_text =
      testing::EncodeOrFail(*tokenizer, text, {.parse_special_tokens = false});
  EXPECT_GT(as_text.size(), 1u);
  for (int32_t id : as_text) EXPECT_FALSE(tokenizer->IsSpecialToken(id));
  absl::StatusOr<std::string> decoded = tokenizer->Decode(as_text);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, text);
  EXPECT_EQ(testing::EncodeOrFail(*tokenizer, text), std::vector<int32_t>{151645});
}

}  // namespace
}  // namespace mobius::tokenizer
