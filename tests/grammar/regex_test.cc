#include "grammar/regex.h"

#include <random>
#include <regex>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::grammar {
namespace {

using ::testing::HasSubstr;

// Whether the DFA takes `text` (ASCII, or code points given as UTF-32) whole.
bool Takes(const RegexDfa& dfa, const std::u32string& text) {
  int32_t s = dfa.start();
  for (char32_t c : text) {
    s = dfa.Next(s, static_cast<uint32_t>(c));
    if (s == RegexDfa::kNone) return false;
  }
  return dfa.Accepting(s);
}

std::u32string Wide(const std::string& ascii) { return std::u32string(ascii.begin(), ascii.end()); }

// Whether the automaton agrees with std::regex (ECMAScript, a backtracking engine) on `text`:
// whole-match or search, as `mode` says.
::testing::AssertionResult AgreesWithStdRegex(const RegexDfa& dfa, const std::regex& reference,
                                              RegexMode mode, const std::string& pattern,
                                              const std::string& text) {
  const bool whole = mode == RegexMode::kWhole;
  const bool expected =
      whole ? std::regex_match(text, reference) : std::regex_search(text, reference);
  if (Takes(dfa, Wide(text)) == expected) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "pattern " << pattern << (whole ? " whole" : " search")
                                       << " text \"" << text << "\": std::regex says " << expected;
}

// Against std::regex (ECMAScript, the flavor JSON Schema names) on random texts over an
// alphabet that exercises the patterns: whole matches for kWhole, searches for kSearch.
TEST(RegexTest, AgreesWithStdRegexOnRandomTexts) {
  const std::vector<std::string> patterns = {
      "abc",
      "a*b+c?",
      "(ab|cd)*",
      "[a-c]{2,3}x",
      "[^ab]+",
      "\\d{3}-\\d{4}",
      "\\w+@\\w+\\.com",
      "(?:a|b){0,2}c",
      "a.c",
      "[\\d\\s]+",
      "x{2}",
      "x{2,}",
      "(a|ab)(c|bcd)",
      "[-a]+",
      "a\\.b\\*",
      "^ab",
      "ab$",
      "^a|b$",
      "^(a|b)*$",
      "[A-Z][a-z]*",
      "\\D\\W\\S",
      "a{0,0}b",
      "(a*)*b",
      "a{3,5}?",
      "[a\\-c]",
  };
  const std::string alphabet = "abcdx-@.*1 9AZz\n_";
  std::mt19937 rng(5);
  for (const std::string& p : patterns) {
    for (RegexMode mode : {RegexMode::kWhole, RegexMode::kSearch}) {
      absl::StatusOr<RegexDfa> dfa = CompileRegex(p, mode);
      ASSERT_TRUE(dfa.ok()) << p << ": " << dfa.status();
      const std::regex reference(p, std::regex::ECMAScript);
      for (int i = 0; i < 400; ++i) {
        std::string text;
        const int n = static_cast<int>(rng() % 9);
        for (int k = 0; k < n; ++k) text += alphabet[rng() % alphabet.size()];
        if (i % 4 == 0 && p.size() < 12) text = p;  // the pattern's own text now and then
        EXPECT_TRUE(AgreesWithStdRegex(*dfa, reference, mode, p, text));
      }
    }
  }
}

// A random expression over {a, b, c} of literals, '.', classes, groups, alternation and
// quantifiers, at most `depth` levels deep.
std::string RandomPattern(std::mt19937& rng, int depth) {
  const int kind = static_cast<int>(rng() % (depth > 0 ? 9 : 4));
  const char* atoms[] = {"a", "b", ".", "[ab]", "[^a]", "c", "\\w", "[a-c]"};
  switch (kind) {
    case 0:
    case 1:
    case 2:
    case 3:
      return atoms[rng() % 8];
    case 4:
    case 5: {  // a sequence
      std::string out;
      for (int i = 0, n = 2 + static_cast<int>(rng() % 2); i < n; ++i) {
        out += RandomPattern(rng, depth - 1);
      }
      return out;
    }
    case 6:  // an alternation in a group
      return "(" + RandomPattern(rng, depth - 1) + "|" + RandomPattern(rng, depth - 1) + ")";
    default: {  // a quantified group
      const char* quantifiers[] = {"*", "+", "?", "{2}", "{0,2}", "{1,}", "*?", "{1,3}"};
      return "(?:" + RandomPattern(rng, depth - 1) + ")" + quantifiers[rng() % 8];
    }
  }
}

// Random expressions against std::regex on random texts: the automaton's construction (nested
// repetition, alternation, classes, the search wrapper) agrees with a backtracking engine.
TEST(RegexTest, RandomPatternsAgreeWithStdRegex) {
  std::mt19937 rng(17);
  const std::string alphabet = "abc\n";
  for (int p = 0; p < 150; ++p) {
    const std::string pattern = RandomPattern(rng, 3);
    for (RegexMode mode : {RegexMode::kWhole, RegexMode::kSearch}) {
      absl::StatusOr<RegexDfa> dfa = CompileRegex(pattern, mode);
      ASSERT_TRUE(dfa.ok()) << pattern << ": " << dfa.status();
      const std::regex reference(pattern, std::regex::ECMAScript);
      for (int i = 0; i < 60; ++i) {
        std::string text;
        for (int k = 0, n = static_cast<int>(rng() % 7); k < n; ++k) {
          text += alphabet[rng() % alphabet.size()];
        }
        ASSERT_TRUE(AgreesWithStdRegex(*dfa, reference, mode, pattern, text));
      }
    }
  }
}

TEST(RegexTest, CodePointsBeyondAscii) {
  absl::StatusOr<RegexDfa> dfa = CompileRegex("[\xc3\xa9-\xc3\xbf]+\\u4e2d.", RegexMode::kWhole);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_TRUE(Takes(*dfa, U"\u00e9\u00ff\u4e2d\U0001F600"));
  EXPECT_FALSE(Takes(*dfa, U"e\u4e2dx"));
  EXPECT_FALSE(Takes(*dfa, U"\u00e9\u4e2d\n"));  // '.' is no line break
  absl::StatusOr<RegexDfa> emoji = CompileRegex("\\uD83D\\uDE00", RegexMode::kWhole);
  ASSERT_TRUE(emoji.ok()) << emoji.status();
  EXPECT_TRUE(Takes(*emoji, U"\U0001F600"));
  // No surrogate half ever has a transition, even under a negated class.
  absl::StatusOr<RegexDfa> any = CompileRegex("[^a]", RegexMode::kWhole);
  ASSERT_TRUE(any.ok());
  EXPECT_EQ(any->Next(any->start(), 0xD800), RegexDfa::kNone);
  EXPECT_TRUE(any->AnyNext(any->start(), 0xD800, 0xE000));
  EXPECT_FALSE(any->AnyNext(any->start(), 'a', 'a'));
}

// Class escapes that every reading (ECMA-262's ASCII classes, Python's and Rust's Unicode ones)
// agrees on: \W, \D and \S leave out what any reading counts as a word character, digit or space.
TEST(RegexTest, NegatedClassesAgreeWithEveryReading) {
  absl::StatusOr<RegexDfa> w = CompileRegex("\\W", RegexMode::kWhole);
  absl::StatusOr<RegexDfa> d = CompileRegex("\\D", RegexMode::kWhole);
  absl::StatusOr<RegexDfa> s = CompileRegex("\\S", RegexMode::kWhole);
  absl::StatusOr<RegexDfa> sp = CompileRegex("\\s", RegexMode::kWhole);
  ASSERT_TRUE(w.ok() && d.ok() && s.ok() && sp.ok());
  EXPECT_TRUE(Takes(*w, U"-"));
  EXPECT_FALSE(Takes(*w, U"\u00e9"));  // a letter to Python and Rust
  EXPECT_FALSE(Takes(*w, U"\u0301"));  // a combining mark
  EXPECT_TRUE(Takes(*w, U"\u00bf"));
  EXPECT_FALSE(Takes(*w, U"\u24b6"));  // CIRCLED LATIN CAPITAL A: Alphabetic to Rust
  EXPECT_TRUE(Takes(*d, U"a"));
  EXPECT_FALSE(Takes(*d, U"\u0663"));  // ARABIC-INDIC DIGIT THREE
  EXPECT_TRUE(Takes(*d, U"\u00e9"));
  EXPECT_FALSE(Takes(*s, U"\u001c"));
  EXPECT_FALSE(Takes(*s, U"\ufeff"));
  EXPECT_TRUE(Takes(*s, U"x"));
  EXPECT_FALSE(Takes(*sp, U"\ufeff"));
  EXPECT_TRUE(Takes(*sp, U"\u3000"));
}

// Many ranges in one class cost one class of the automaton, not one per range.
TEST(RegexTest, ClassesWithManyRangesStaySmall) {
  std::string alternating = "[";
  for (uint32_t cp = 0x100; cp < 0x7FE; cp += 2) {
    alternating += static_cast<char>(0xC0 | (cp >> 6));
    alternating += static_cast<char>(0x80 | (cp & 0x3F));
  }
  alternating += "]+";
  absl::StatusOr<RegexDfa> dfa = CompileRegex(alternating, RegexMode::kWhole);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  EXPECT_LE(dfa->table_size(), 3u * 3u);
  absl::StatusOr<RegexDfa> limited = dfa->WithLength(0, 19000);
  ASSERT_TRUE(limited.ok()) << limited.status();
  EXPECT_TRUE(Takes(*limited, U"\u0100\u0102"));
  EXPECT_FALSE(Takes(*limited, U"\u0101"));
}

TEST(RegexTest, EveryStateCanStillMatch) {
  // "a(b|cx)" with "c" then only "x": no state is a dead end, and one that would be is gone.
  absl::StatusOr<RegexDfa> dfa = CompileRegex("a(b|c[])|ad", RegexMode::kWhole);
  ASSERT_TRUE(dfa.ok()) << dfa.status();
  const int32_t after_a = dfa->Next(dfa->start(), 'a');
  ASSERT_NE(after_a, RegexDfa::kNone);
  EXPECT_EQ(dfa->Next(after_a, 'c'), RegexDfa::kNone);  // [] matches nothing
  EXPECT_NE(dfa->Next(after_a, 'b'), RegexDfa::kNone);
}

TEST(RegexTest, LengthLimitsFoldIntoTheAutomaton) {
  absl::StatusOr<RegexDfa> dfa = CompileRegex("(ab)+", RegexMode::kWhole);
  ASSERT_TRUE(dfa.ok());
  absl::StatusOr<RegexDfa> limited = dfa->WithLength(3, 6);
  ASSERT_TRUE(limited.ok()) << limited.status();
  EXPECT_FALSE(Takes(*limited, U"ab"));
  EXPECT_TRUE(Takes(*limited, U"abab"));
  EXPECT_TRUE(Takes(*limited, U"ababab"));
  EXPECT_FALSE(Takes(*limited, U"abababab"));
  // After "ababab" nothing may follow (the automaton ends there rather than at a dead end).
  int32_t s = limited->start();
  for (char32_t c : std::u32string(U"ababab")) s = limited->Next(s, c);
  EXPECT_FALSE(limited->AnyNext(s, 0, kMaxCodePoint));
  EXPECT_THAT(std::string(dfa->WithLength(3, 3).status().message()),
              HasSubstr("no text within minLength / maxLength"));
}

TEST(RegexTest, RefusesWhatItCannotEnforceByName) {
  struct Case {
    std::string pattern;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {"(a)\\1", "backreferences are not supported (at offset 3)"},
           {"a(?=b)", "lookaround assertions are not supported"},
           {"(?<!a)b", "lookaround"},
           {"\\bword", "word boundaries"},
           {"(?i)abc", "inline flags"},
           {"a^b", "^ is supported only at the start"},
           {"a$b", "$ is supported only at the end"},
           {"(a", "missing ')'"},
           {"a)", "unmatched ')'"},
           {"[ab", "missing ']'"},
           {"*a", "nothing to repeat"},
           {"a**", "a quantifier cannot follow another"},
           {"a{3,2}", "m below n"},
           {"a{1001}", "repetition counts above 1000"},
           {"[z-a]", "out of order"},
           {"\\p{L}", "the escape \\p is not supported"},
           {"\\x4", "malformed hex escape"},
           {"\\uD800", "a lone surrogate half"},
           {"[]", "it matches no text"},
           {"(a{1000}){1000}", "too large"},
           {"abc\\", "cannot end with a backslash"},
           {std::string(100, '(') + "a" + std::string(100, ')'), "groups nested deeper than 64"},
           {std::string(5000, 'a'), "longer than 4096 bytes"},
           {"\\01", "\\0 followed by a digit is ambiguous"},
           {"a{,5}", "{,n} is a quantifier in some readings"},
           {"\xF5\x80\x80", "not valid UTF-8"},
           {"^(?:(?:a?){1000}){9}$", "too complex"},
       }) {
    absl::StatusOr<RegexDfa> dfa = CompileRegex(c.pattern, RegexMode::kWhole);
    ASSERT_FALSE(dfa.ok()) << c.pattern;
    EXPECT_EQ(dfa.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(dfa.status().message()), HasSubstr(c.message)) << c.pattern;
  }
}

}  // namespace
}  // namespace mobius::grammar
