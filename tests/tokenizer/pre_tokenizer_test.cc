#include "tokenizer/pre_tokenizer.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/tokenizer/test_util.h"

namespace mobius::tokenizer {
namespace {

std::vector<std::string> SplitWith(const nlohmann::json& config, std::string_view text) {
  absl::StatusOr<std::unique_ptr<PreTokenizer>> pre_tokenizer = PreTokenizer::FromJson(config);
  if (!pre_tokenizer.ok()) {
    ADD_FAILURE() << pre_tokenizer.status();
    return {};
  }
  WordList words;
  absl::Status status = (*pre_tokenizer)->Split(text, words);
  EXPECT_TRUE(status.ok()) << status;
  return {words.words.begin(), words.words.end()};
}

nlohmann::json ByteLevel(bool add_prefix_space, bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", false},
          {"use_regex", use_regex}};
}

nlohmann::json SplitThenByteLevel(const std::string& regex, const std::string& behavior,
                                  bool invert = false) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", regex}}},
             {"behavior", behavior},
             {"invert", invert}},
            ByteLevel(false, false)}}};
}

nlohmann::json QwenPreTokenizer() {
  const nlohmann::json json =
      testing::ReadJsonFileOrFail(testing::QwenTokenizerDir() / "tokenizer.json");
  return json.is_object() ? json["pre_tokenizer"] : nlohmann::json();
}

using Words = std::vector<std::string>;

TEST(PreTokenizerTest, QwenPatternSplitsLikeTheReference) {
  const nlohmann::json config = QwenPreTokenizer();
  ASSERT_TRUE(config.is_object());
  // Whitespace before a word joins it, except that the last space of a run goes with the word
  // and the rest stays alone (\s+(?!\S)).
  EXPECT_EQ(SplitWith(config, "a   b"), (Words{"a", "  ", " b"}));
  EXPECT_EQ(SplitWith(config, "x  \n"), (Words{"x", "  \n"}));
  EXPECT_EQ(SplitWith(config, "line1\n\nline2"), (Words{"line", "1", "\n\n", "line", "2"}));
  // Digits are split one by one.
  EXPECT_EQ(SplitWith(config, "12345"), (Words{"1", "2", "3", "4", "5"}));
  // Contractions match case-insensitively.
  EXPECT_EQ(SplitWith(config, "DON'T we'LL"), (Words{"DON", "'T", " we", "'LL"}));
  EXPECT_EQ(SplitWith(config, "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C"),
            (Words{"\xE4\xBD\xA0\xE5\xA5\xBD", "\xEF\xBC\x8C"}));
  // U+180E is not white space in Oniguruma (the reference) although PCRE2's \s includes it.
  EXPECT_EQ(SplitWith(config, "a!\xE1\xA0\x8E"), (Words{"a", "!\xE1\xA0\x8E"}));
}

TEST(PreTokenizerTest, SplitBehaviours) {
  const std::string text = "a-b--c";
  EXPECT_EQ(SplitWith(SplitThenByteLevel("-", "Isolated"), text),
            (Words{"a", "-", "b", "-", "-", "c"}));
  EXPECT_EQ(SplitWith(SplitThenByteLevel("-", "Removed"), text), (Words{"a", "b", "c"}));
  EXPECT_EQ(SplitWith(SplitThenByteLevel("-", "MergedWithPrevious"), text),
            (Words{"a-", "b-", "-", "c"}));
  EXPECT_EQ(SplitWith(SplitThenByteLevel("-", "MergedWithNext"), text),
            (Words{"a", "-b", "-", "-c"}));
  EXPECT_EQ(SplitWith(SplitThenByteLevel("-", "Contiguous"), text),
            (Words{"a", "-", "b", "--", "c"}));
  EXPECT_EQ(SplitWith(SplitThenByteLevel("-", "Removed", /*invert=*/true), text),
            (Words{"-", "-", "-"}));
}

TEST(PreTokenizerTest, LiteralStringPatternIsEscaped) {
  const nlohmann::json config = {{"type", "Sequence"},
                                 {"pretokenizers",
                                  {{{"type", "Split"},
                                    {"pattern", {{"String", "."}}},
                                    {"behavior", "Removed"},
                                    {"invert", false}},
                                   ByteLevel(false, false)}}};
  EXPECT_EQ(SplitWith(config, "a.b.c"), (Words{"a", "b", "c"}));
}

TEST(PreTokenizerTest, ByteLevelPrefixSpaceAndRegex) {
  EXPECT_EQ(SplitWith(ByteLevel(true, true), "Hello world"), (Words{" Hello", " world"}));
  EXPECT_EQ(SplitWith(ByteLevel(false, true), "Hello  world's"),
            (Words{"Hello", " ", " world", "'s"}));
  EXPECT_EQ(SplitWith(ByteLevel(false, false), "Hello world"), (Words{"Hello world"}));
}

TEST(PreTokenizerTest, UnsupportedConfigurationsNameTheProblem) {
  const auto error = [](const nlohmann::json& config) {
    absl::StatusOr<std::unique_ptr<PreTokenizer>> result = PreTokenizer::FromJson(config);
    return result.ok() ? std::string("ok") : std::string(result.status().message());
  };
  EXPECT_NE(error({{"type", "Whitespace"}}).find("Whitespace"), std::string::npos);
  EXPECT_NE(error(SplitThenByteLevel("x", "Sideways")).find("Sideways"), std::string::npos);
  EXPECT_NE(error(SplitThenByteLevel("(", "Isolated")).find("regex"), std::string::npos);
  EXPECT_NE(error({{"type", "Split"},
                   {"pattern", {{"Regex", "x"}}},
                   {"behavior", "Isolated"},
                   {"invert", false}})
                .find("ByteLevel"),
            std::string::npos);
}

TEST(RegexTest, WhitespaceClassesAreTranslated) {
  EXPECT_EQ(TranslateOnigurumaPattern("a\\sb"),
            "a[\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
            "\\x{205F}\\x{3000}]b");
  EXPECT_EQ(TranslateOnigurumaPattern("[^\\s\\p{L}]").substr(0, 6), "[^\\t-\\");
  EXPECT_EQ(TranslateOnigurumaPattern("\\\\s"), "\\\\s");  // An escaped backslash, then 's'.
  EXPECT_EQ(TranslateOnigurumaPattern("[\\S]"), "[\\S]");
  EXPECT_EQ(TranslateOnigurumaPattern("[]\\s]").find("[]\\t-\\r"), 0u);
}

}  // namespace
}  // namespace mobius::tokenizer
