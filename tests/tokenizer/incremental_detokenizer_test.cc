#include "tokenizer/incremental_detokenizer.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

// Id of the single-byte token for `byte` in the Qwen vocabulary.
int32_t ByteId(const Tokenizer& tokenizer, uint8_t byte) {
  return *tokenizer.TokenToId(BytesToAlphabet(std::string(1, static_cast<char>(byte))));
}

TEST(IncrementalDetokenizerTest, HoldsBackACharacterSplitAcrossIds) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  IncrementalDetokenizer stream(*tokenizer);
  // U+1F600 is F0 9F 98 80; feed it one byte token at a time after some text.
  absl::StatusOr<std::string> piece = stream.Push(9707);  // "Hello"
  ASSERT_TRUE(piece.ok());
  EXPECT_EQ(*piece, "Hello");
  for (uint8_t byte : {0xF0, 0x9F, 0x98}) {
    piece = stream.Push(ByteId(*tokenizer, byte));
    ASSERT_TRUE(piece.ok());
    EXPECT_EQ(*piece, "");
  }
  EXPECT_EQ(stream.pending_bytes(), 3u);
  piece = stream.Push(ByteId(*tokenizer, 0x80));
  ASSERT_TRUE(piece.ok());
  EXPECT_EQ(*piece, "\xF0\x9F\x98\x80");
  EXPECT_EQ(stream.Finish(), "");
}

TEST(IncrementalDetokenizerTest, UnfinishedCharacterAtTheEndMatchesFullDecode) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<int32_t> ids = {ByteId(*tokenizer, 'a'), ByteId(*tokenizer, 0xE4),
                                    ByteId(*tokenizer, 0xBD)};
  IncrementalDetokenizer stream(*tokenizer);
  std::string streamed;
  for (int32_t id : ids) streamed += *stream.Push(id);
  EXPECT_EQ(streamed, "a");
  streamed += stream.Finish();
  EXPECT_EQ(streamed, *tokenizer->Decode(ids));
  EXPECT_EQ(streamed, "a\xEF\xBF\xBD");
  EXPECT_EQ(stream.pending_bytes(), 0u);
}

TEST(IncrementalDetokenizerTest, InvalidBytesAreReplacedWithoutWaiting) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  IncrementalDetokenizer stream(*tokenizer);
  // A lone continuation byte can never become valid, so it is final at once.
  absl::StatusOr<std::string> piece = stream.Push(ByteId(*tokenizer, 0x80));
  ASSERT_TRUE(piece.ok());
  EXPECT_EQ(*piece, "\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizerTest, UnknownIdLeavesStateUnchanged) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  IncrementalDetokenizer stream(*tokenizer);
  ASSERT_TRUE(stream.Push(ByteId(*tokenizer, 0xC3)).ok());
  absl::StatusOr<std::string> bad = stream.Push(1 << 30);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*stream.Push(ByteId(*tokenizer, 0xA9)), "\xC3\xA9");
}

TEST(IncrementalDetokenizerTest, SkipsSpecialTokensWhenAsked) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  IncrementalDetokenizer stream(*tokenizer, {.skip_special_tokens = true});
  EXPECT_EQ(*stream.Push(9707), "Hello");
  EXPECT_EQ(*stream.Push(151645), "");
}

TEST(IncrementalDetokenizerTest, LongGenerationStreamsEverything) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::string text =
      "Streaming \xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD"
      " caf\xC3\xA9 \xD8\xB9\xD8\xB1\xD8\xA8\xD9\x8A \xF0\x9F\x87\xAF\xF0\x9F\x87\xB5 done";
  const std::vector<int32_t> ids = testing::EncodeOrFail(*tokenizer, text);
  IncrementalDetokenizer stream(*tokenizer);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = *stream.Push(id);
    EXPECT_TRUE(IsValidUtf8(piece));
    streamed += piece;
  }
  streamed += stream.Finish();
  EXPECT_EQ(streamed, text);
}

}  // namespace
}  // namespace mobius::tokenizer
