#include "tokenizer/added_tokens.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"

namespace mobius::tokenizer {
namespace {

AddedToken Token(int32_t id, std::string content) {
  AddedToken token;
  token.id = id;
  token.content = std::move(content);
  return token;
}

// Renders a split as "text|<id>|text" for compact expectations.
std::string Render(const AddedTokenMatcher& matcher, std::string_view text,
                   bool match_special = true) {
  std::vector<TextSegment> segments;
  matcher.Split(text, match_special, segments);
  std::vector<std::string> parts;
  for (const TextSegment& segment : segments) {
    parts.push_back(segment.token_id >= 0 ? absl::StrCat("<", segment.token_id, ">")
                                          : std::string(segment.text));
  }
  const std::string out = absl::StrJoin(parts, "|");
  return out;
}

TEST(AddedTokenMatcherTest, LeftmostLongestMatch) {
  AddedTokenMatcher matcher({Token(1, "<a>"), Token(2, "<a><b>"), Token(3, "b>")});
  EXPECT_EQ(Render(matcher, "x<a><b>y"), "x|<2>|y");
  EXPECT_EQ(Render(matcher, "x<a>b>y"), "x|<1>|<3>|y");
  EXPECT_EQ(Render(matcher, "plain"), "plain");
  EXPECT_EQ(Render(matcher, ""), "");
}

TEST(AddedTokenMatcherTest, StripFlagsSwallowWhitespace) {
  AddedToken left = Token(1, "<L>");
  left.lstrip = true;
  AddedToken right = Token(2, "<R>");
  right.rstrip = true;
  AddedTokenMatcher matcher({left, right});
  EXPECT_EQ(Render(matcher, "a  \t<L> b"), "a|<1>| b");
  EXPECT_EQ(Render(matcher, "a <R> \n b"), "a |<2>|b");
  // Unicode white space (U+3000) counts too.
  EXPECT_EQ(Render(matcher, "a\xE3\x80\x80<L>"), "a|<1>");
}

TEST(AddedTokenMatcherTest, SingleWordOnlyMatchesOutsideWords) {
  AddedToken token = Token(7, "cat");
  token.single_word = true;
  AddedTokenMatcher matcher({token});
  EXPECT_EQ(Render(matcher, "a cat sat"), "a |<7>| sat");
  EXPECT_EQ(Render(matcher, "concat"), "concat");
  EXPECT_EQ(Render(matcher, "cats"), "cats");
  EXPECT_EQ(Render(matcher, "cat_"), "cat_");
  EXPECT_EQ(Render(matcher, "(cat)"), "(|<7>|)");
}

TEST(AddedTokenMatcherTest, SpecialTokensCanBeIgnored) {
  AddedToken special = Token(5, "<|s|>");
  special.special = true;
  AddedTokenMatcher matcher({special, Token(6, "<t>")});
  EXPECT_EQ(Render(matcher, "a<|s|>b<t>", /*match_special=*/false), "a<|s|>b|<6>");
  EXPECT_EQ(Render(matcher, "a<|s|>b<t>"), "a|<5>|b|<6>");
}

TEST(AddedTokenMatcherTest, TokenizerHonoursNormalizedFlag) {
  // "é" written decomposed in the text only matches a `normalized: true` token after NFC.
  nlohmann::json added = nlohmann::json::array();
  added.push_back({{"id", 300},
                   {"content", "caf\xC3\xA9"},
                   {"single_word", false},
                   {"lstrip", false},
                   {"rstrip", false},
                   {"normalized", true},
                   {"special", false}});
  added.push_back({{"id", 301},
                   {"content", "te\xCC\x81"},
                   {"single_word", false},
                   {"lstrip", false},
                   {"rstrip", false},
                   {"normalized", false},
                   {"special", false}});
  std::unique_ptr<Tokenizer> tokenizer =
      testing::TinyTokenizerOrFail(testing::TinyTokenizerJson({}, added));
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(testing::EncodeOrFail(*tokenizer, "cafe\xCC\x81"), std::vector<int32_t>{300});
  // The raw token matches before normalisation would have composed it.
  EXPECT_EQ(testing::EncodeOrFail(*tokenizer, "te\xCC\x81"), std::vector<int32_t>{301});
}

}  // namespace
}  // namespace mobius::tokenizer
