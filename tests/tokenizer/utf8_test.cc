#include "tokenizer/utf8.h"

#include "gtest/gtest.h"

namespace mobius::tokenizer {
namespace {

constexpr std::string_view kFffd = "\xEF\xBF\xBD";

TEST(Utf8Test, ValidTextIsUnchanged) {
  const std::string text = "plain ascii, caf\xC3\xA9, \xE4\xBD\xA0\xE5\xA5\xBD, \xF0\x9F\x98\x80";
  EXPECT_TRUE(IsValidUtf8(text));
  EXPECT_EQ(ReplaceInvalidUtf8(text), text);
}

TEST(Utf8Test, EachMaximalIllFormedSubsequenceBecomesOneReplacement) {
  const std::string f(kFffd);
  EXPECT_EQ(ReplaceInvalidUtf8("a\xFF"
                               "b"),
            "a" + f + "b");
  EXPECT_EQ(ReplaceInvalidUtf8("\xC3("), f + "(");
  EXPECT_EQ(ReplaceInvalidUtf8("\xE2\x82("), f + "(");               // Truncated 3-byte character.
  EXPECT_EQ(ReplaceInvalidUtf8("\xED\xA0\x80"), f + f + f);          // Surrogate: no valid prefix.
  EXPECT_EQ(ReplaceInvalidUtf8("\xC0\xAF"), f + f);                  // Overlong.
  EXPECT_EQ(ReplaceInvalidUtf8("\xF4\x90\x80\x80"), f + f + f + f);  // Above U+10FFFF.
  EXPECT_EQ(ReplaceInvalidUtf8("\xF0\x9F\x98"), f);                  // Truncated at the end.
  EXPECT_EQ(ReplaceInvalidUtf8("\x80\x80"), f + f);
  EXPECT_FALSE(IsValidUtf8("\xF0\x9F\x98"));
}

TEST(Utf8Test, StablePrefixHoldsBackOnlyACompletablePartialCharacter) {
  EXPECT_EQ(StableUtf8PrefixLength(""), 0u);
  EXPECT_EQ(StableUtf8PrefixLength("abc"), 3u);
  EXPECT_EQ(StableUtf8PrefixLength("ab\xF0\x9F"), 2u);
  EXPECT_EQ(StableUtf8PrefixLength("ab\xF0\x9F\x98"), 2u);
  EXPECT_EQ(StableUtf8PrefixLength("ab\xF0\x9F\x98\x80"), 6u);
  EXPECT_EQ(StableUtf8PrefixLength("ab\xE4"), 2u);
  // Sequences that can no longer become valid are final and need not wait.
  EXPECT_EQ(StableUtf8PrefixLength("ab\xFF"), 3u);
  EXPECT_EQ(StableUtf8PrefixLength("ab\xED\xA0"), 4u);
  EXPECT_EQ(StableUtf8PrefixLength("\x80\x80\x80\x80"), 4u);
}

TEST(Utf8Test, WhitespaceIsTheUnicodeWhiteSpaceProperty) {
  for (char32_t cp : {0x09, 0x0A, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x200A, 0x2028, 0x2029,
                      0x202F, 0x205F, 0x3000}) {
    EXPECT_TRUE(IsUnicodeWhitespace(cp)) << std::hex << static_cast<uint32_t>(cp);
  }
  for (char32_t cp : {0x08, 0x21, 0x180E, 0x200B, 0xFEFF}) {
    EXPECT_FALSE(IsUnicodeWhitespace(cp)) << std::hex << static_cast<uint32_t>(cp);
  }
}

}  // namespace
}  // namespace mobius::tokenizer
