// ReasoningParser on answers fed whole and in pieces as small as a character: the reasoning and the
// answer as the Qwen3 template would render them back, whatever the piece boundaries.
#include "router/http/reasoning_parser.h"

#include <string>

#include <gtest/gtest.h>

namespace mobius::router::openai {
namespace {

struct Split {
  std::string reasoning;
  std::string content;
};

Split Parse(const std::string& text, size_t piece) {
  ReasoningParser parser;
  Split out;
  auto take = [&](const ReasoningParser::Step& step) {
    out.reasoning += step.reasoning;
    out.content += step.content;
  };
  const size_t size = piece == 0 ? text.size() : piece;
  for (size_t at = 0; at < text.size(); at += size) take(parser.Push(text.substr(at, size)));
  take(parser.Finish());
  return out;
}

class ReasoningParserTest : public ::testing::TestWithParam<size_t> {};

TEST_P(ReasoningParserTest, ThinkBlockThenAnswer) {
  const Split s =
      Parse("<think>\nFirst, 2+2.\n\nThat is 4.\n</think>\n\nThe answer is 4.\n", GetParam());
  EXPECT_EQ(s.reasoning, "First, 2+2.\n\nThat is 4.");  // inner newlines kept, outer ones not
  EXPECT_EQ(s.content, "The answer is 4.\n");
}

TEST_P(ReasoningParserTest, LeadingWhitespaceBeforeTheBlock) {
  const Split s = Parse("\n  <think>why</think>because", GetParam());
  EXPECT_EQ(s.reasoning, "why");
  EXPECT_EQ(s.content, "because");
}

TEST_P(ReasoningParserTest, NoBlockIsAllContent) {
  const Split s = Parse("Plain answer, with <think> later and </think> too.", GetParam());
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "Plain answer, with <think> later and </think> too.");
  EXPECT_EQ(Parse("<thin", GetParam()).content, "<thin");  // never became the tag
  EXPECT_EQ(Parse("", GetParam()).content, "");
}

TEST_P(ReasoningParserTest, UnclosedBlockIsAllReasoning) {
  const Split s = Parse("<think>\nstill thinking when max_tokens hit\n</thi", GetParam());
  EXPECT_EQ(s.reasoning, "still thinking when max_tokens hit\n</thi");
  EXPECT_EQ(s.content, "");
}

TEST_P(ReasoningParserTest, EmptyBlock) {
  // What enable_thinking = false leads to when the model repeats the empty block.
  const Split s = Parse("<think>\n\n</think>\n\nHi.", GetParam());
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "Hi.");
}

TEST_P(ReasoningParserTest, AngleBracketsInsideTheReasoning) {
  const Split s = Parse("<think>a < b and </thin> is not the end</think>ok", GetParam());
  EXPECT_EQ(s.reasoning, "a < b and </thin> is not the end");
  EXPECT_EQ(s.content, "ok");
}

INSTANTIATE_TEST_SUITE_P(Pieces, ReasoningParserTest, ::testing::Values(0, 1, 2, 5),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return info.param == 0 ? std::string("Whole")
                                                  : "Pieces" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace mobius::router::openai
