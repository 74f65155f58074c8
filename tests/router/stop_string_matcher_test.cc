#include "router/core/stop_string_matcher.h"

#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mobius::router {
namespace {

TEST(StopStringMatcherTest, WithoutStopStringsTextPassesThrough) {
  StopStringMatcher m({});
  EXPECT_EQ(m.Push("abc").text, "abc");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, HoldsBackAPossibleStartAndReleasesItWhenItIsNot) {
  StopStringMatcher m({"STOP"});
  StopStringMatcher::Result r = m.Push("hello ST");
  EXPECT_EQ(r.text, "hello ");
  EXPECT_FALSE(r.matched);
  EXPECT_EQ(m.held_bytes(), 2u);
  r = m.Push("ART");
  EXPECT_EQ(r.text, "START");
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringMatcherTest, MatchAcrossPushesTruncatesBeforeIt) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(m.Push("one S").text, "one ");
  EXPECT_EQ(m.Push("T").text, "");
  StopStringMatcher::Result r = m.Push("OP and more");
  EXPECT_EQ(r.text, "");
  ASSERT_TRUE(r.matched);
  EXPECT_EQ(*r.matched, "STOP");
  EXPECT_TRUE(m.matched());
  EXPECT_EQ(m.Push("later").text, "");
  EXPECT_EQ(m.Flush(), "");
}

// include_stop_str_in_output: the text ends just after the match, wherever the match began.
TEST(StopStringMatcherTest, IncludedMatchEndsTheTextAfterIt) {
  StopStringMatcher m({"STOP", "TOP"}, /*include_match=*/true);
  EXPECT_EQ(m.Push("one S").text, "one ");
  StopStringMatcher::Result r = m.Push("TOP and more");
  EXPECT_EQ(r.text, "STOP");  // the longest of the matches that end first
  ASSERT_TRUE(r.matched);
  EXPECT_EQ(*r.matched, "STOP");
  EXPECT_EQ(m.Push("later").text, "");
  EXPECT_EQ(m.Flush(), "");
}

// The stop string that is complete first wins, whether the text comes whole or in pieces (found
// by tests/fuzz/stop_strings_fuzz: the earliest start used to win, which depended on the pieces).
TEST(StopStringMatcherTest, FirstCompletedMatchWinsHoweverTheTextIsCut) {
  for (const std::vector<std::string>& pieces : {std::vector<std::string>{"hello world"},
                                                 {"hello", " world"},
                                                 {"hell", "o", " w", "orld"}}) {
    StopStringMatcher m({"world", "o w", "o"});
    std::string text;
    std::optional<std::string> matched;
    for (const std::string& piece : pieces) {
      StopStringMatcher::Result r = m.Push(piece);
      text += r.text;
      if (r.matched) matched = r.matched;
    }
    ASSERT_TRUE(matched) << pieces.size();
    EXPECT_EQ(*matched, "o") << pieces.size();
    EXPECT_EQ(text, "hell") << pieces.size();
  }
  // Two ending at one place: the longer (it started first).
  StopStringMatcher m({"lo", "llo"});
  StopStringMatcher::Result r = m.Push("hello");
  ASSERT_TRUE(r.matched);
  EXPECT_EQ(*r.matched, "llo");
  EXPECT_EQ(r.text, "he");
}

TEST(StopStringMatcherTest, FlushReleasesAnUnfinishedPrefix) {
  StopStringMatcher m({"\n\n"});
  EXPECT_EQ(m.Push("line\n").text, "line");
  EXPECT_EQ(m.Flush(), "\n");
}

TEST(StopStringMatcherTest, MultiByteCharactersAreHeldWhole) {
  StopStringMatcher m({"\xe4\xb8\xad\xe6\x96\x87"});  // "中文"
  StopStringMatcher::Result r = m.Push("a\xe4\xb8\xad");
  EXPECT_EQ(r.text, "a");
  r = m.Push("\xe5\x9b\xbd");  // "国": not a match, release both characters
  EXPECT_EQ(r.text, "\xe4\xb8\xad\xe5\x9b\xbd");
}

}  // namespace
}  // namespace mobius::router
