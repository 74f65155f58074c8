// Large inputs must encode in (near) linear time: 10 MB of mixed text and 10 MB that is one
// single "word" (no spaces), which is the worst case for BPE merging. Time limits are generous
// for a loaded CI machine; the quadratic behaviours they guard against take minutes or hours.
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"
#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

constexpr size_t kTenMegabytes = size_t{10} << 20;

double SecondsToEncode(const Tokenizer& tokenizer, const std::string& text,
                       std::vector<int32_t>& ids) {
  const auto start = std::chrono::steady_clock::now();
  ids = testing::EncodeOrFail(tokenizer, text);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Round-trips `text` and checks the time budget.
void ExpectFastRoundTrip(const Tokenizer& tokenizer, const std::string& text, double max_seconds) {
  std::vector<int32_t> ids;
  const double seconds = SecondsToEncode(tokenizer, text, ids);
  EXPECT_LT(seconds, max_seconds) << "encoding " << text.size() << " bytes took " << seconds
                                  << " s";
  ASSERT_FALSE(ids.empty());
  absl::StatusOr<std::string> decoded = tokenizer.Decode(ids);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(*decoded == text) << "round trip changed the text";
}

TEST(LargeInputTest, TenMegabytesOfMixedText) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  const std::vector<std::string> pieces = {"The ",
                                           "quick ",
                                           "brown ",
                                           "fox ",
                                           "jumps ",
                                           "over ",
                                           "the ",
                                           "lazy ",
                                           "dog. ",
                                           "\n\n",
                                           "12345 ",
                                           "\xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C",
                                           "\xEF\xBC\x8C",
                                           "\xD0\x9F\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82 ",
                                           "\xF0\x9F\x98\x80 ",
                                           "    ",
                                           "if (x) { return y; }\n",
                                           "<|im_end|>",
                                           "don't ",
                                           "caf\xC3\xA9 "};
  std::mt19937 rng(1);
  std::string text;
  text.reserve(kTenMegabytes + 64);
  while (text.size() < kTenMegabytes) text += pieces[rng() % pieces.size()];
  ExpectFastRoundTrip(*tokenizer, text, 20.0);
}

TEST(LargeInputTest, TenMegabytesWithoutSpacesIsNotQuadratic) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  std::mt19937 rng(2);
  std::string letters;
  letters.reserve(kTenMegabytes);
  while (letters.size() < kTenMegabytes) letters.push_back(static_cast<char>('a' + rng() % 26));
  ExpectFastRoundTrip(*tokenizer, letters, 30.0);
}

TEST(LargeInputTest, TenMegabytesOfOneRepeatedLetter) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  ExpectFastRoundTrip(*tokenizer, std::string(kTenMegabytes, 'a'), 30.0);
}

TEST(LargeInputTest, TenMegabytesOfWhitespaceAndOfCjk) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  ExpectFastRoundTrip(*tokenizer, std::string(kTenMegabytes, ' ') + "x", 30.0);
  std::string cjk;
  while (cjk.size() < kTenMegabytes) cjk += "\xE4\xBB\x8A\xE5\xA4\xA9\xE5\xA4\xA9\xE6\xB0\x94";
  ExpectFastRoundTrip(*tokenizer, cjk, 30.0);
}

TEST(LargeInputTest, RandomBytesEncodeDeterministically) {
  const Tokenizer* tokenizer = testing::QwenTokenizerOrFail();
  ASSERT_NE(tokenizer, nullptr);
  std::mt19937 rng(3);
  std::string bytes;
  for (int i = 0; i < (1 << 20); ++i) bytes.push_back(static_cast<char>(rng()));
  const std::vector<int32_t> first = testing::EncodeOrFail(*tokenizer, bytes);
  EXPECT_EQ(first, testing::EncodeOrFail(*tokenizer, bytes));
  EXPECT_EQ(first, testing::EncodeOrFail(*tokenizer, ReplaceInvalidUtf8(bytes)));
  absl::StatusOr<std::string> decoded = tokenizer->Decode(first);
  ASSERT_TRUE(decoded.ok());
  EXPECT_TRUE(IsValidUtf8(*decoded));
  // The decoded text is the replaced, NFC-normalised input, which encodes to the same ids.
  EXPECT_TRUE(testing::EncodeOrFail(*tokenizer, *decoded) == first);
}

}  // namespace
}  // namespace mobius::tokenizer
