// ToolCallParser on model output fed whole and in pieces as small as a character: the content
// before, between and after <tool_call> blocks, the calls, and output that only looks like one.
#include "router/http/tool_call_parser.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace mobius::router::openai {
namespace {

struct Parsed {
  std::string content;
  std::vector<ParsedToolCall> calls;
};

// Feeds `text` in pieces of `piece` bytes (0: whole), then finishes.
Parsed Parse(const std::string& text, size_t piece, int max_calls = 1 << 30) {
  ToolCallParser parser(max_calls);
  Parsed out;
  auto take = [&](ToolCallParser::Step step) {
    out.content += step.content;
    out.calls.insert(out.calls.end(), step.calls.begin(), step.calls.end());
  };
  const size_t size = piece == 0 ? text.size() : piece;
  for (size_t at = 0; at < text.size(); at += size) take(parser.Push(text.substr(at, size)));
  take(parser.Finish());
  return out;
}

class ToolCallParserTest : public ::testing::TestWithParam<size_t> {};

TEST_P(ToolCallParserTest, TextWithoutCallsPassesThrough) {
  const Parsed p = Parse("a < b, and <tool is not a tag; <tool_cal neither", GetParam());
  EXPECT_EQ(p.content, "a < b, and <tool is not a tag; <tool_cal neither");
  EXPECT_TRUE(p.calls.empty());
}

TEST_P(ToolCallParserTest, ContentThenCalls) {
  const Parsed p = Parse(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": "
      "{}}\n</tool_call>\n",
      GetParam());
  EXPECT_EQ(p.content, "Let me check.\n");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(p.calls[0].arguments, "{\"city\": \"Paris\", \"days\": 2}");  // the model's order
  EXPECT_EQ(p.calls[1].name, "now");
  EXPECT_EQ(p.calls[1].arguments, "{}");
}

TEST_P(ToolCallParserTest, ABlockThatIsNotACallIsContent) {
  const Parsed p = Parse("<tool_call>\nnot json\n</tool_call>", GetParam());
  EXPECT_EQ(p.content, "<tool_call>\nnot json\n</tool_call>");
  EXPECT_TRUE(p.calls.empty());
  const Parsed no_name = Parse("<tool_call>{\"arguments\": {}}</tool_call>", GetParam());
  EXPECT_EQ(no_name.content, "<tool_call>{\"arguments\": {}}</tool_call>");
  const Parsed bad_arguments =
      Parse("<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", GetParam());
  EXPECT_TRUE(bad_arguments.calls.empty());
}

TEST_P(ToolCallParserTest, AnUnclosedLastBlockIsParsedAtTheEnd) {
  const Parsed call =
      Parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}", GetParam());
  ASSERT_EQ(call.calls.size(), 1u);
  EXPECT_EQ(call.calls[0].arguments, "{\"x\": 1}");
  EXPECT_EQ(call.content, "");
  // Cut off mid-JSON (max_tokens): given back as text.
  const Parsed cut = Parse("Sure <tool_call>\n{\"name\": \"f\", \"argu", GetParam());
  EXPECT_TRUE(cut.calls.empty());
  EXPECT_EQ(cut.content, "Sure <tool_call>\n{\"name\": \"f\", \"argu");
  // A possible start of a tag at the very end is content after all.
  EXPECT_EQ(Parse("done <tool_", GetParam()).content, "done <tool_");
}

TEST_P(ToolCallParserTest, TextAfterCallsIsKeptUnlessBlank) {
  const Parsed p = Parse("<tool_call>{\"name\": \"f\"}</tool_call>\n\n and then some", GetParam());
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, "{}");  // no arguments: an empty object
  EXPECT_EQ(p.content, "\n\n and then some");
}

// Text after a block keeps its own whitespace, however the pieces fall (a tokenizer often sends a
// newline as a token of its own); only blank text right after a block, or at the end after one,
// is dropped.
TEST_P(ToolCallParserTest, WhitespaceAfterTextFollowingABlockIsKept) {
  const Parsed p = Parse("<tool_call>{\"name\": \"f\"}</tool_call>\nhi \n", GetParam());
  EXPECT_EQ(p.content, "\nhi \n");
  const Parsed between = Parse(
      "<tool_call>{\"name\": \"f\"}</tool_call>\nNote: x\n<tool_call>{\"name\": \"g\"}"
      "</tool_call>\n",
      GetParam());
  EXPECT_EQ(between.content, "\nNote: x\n");
  EXPECT_EQ(between.calls.size(), 2u);
}

TEST_P(ToolCallParserTest, CallsPastTheLimitAreDropped) {
  const Parsed p =
      Parse("<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\"}</tool_call>",
            GetParam(), /*max_calls=*/1);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "a");
  EXPECT_EQ(p.content, "");
}

TEST_P(ToolCallParserTest, DeepJsonIsNotParsed) {
  const std::string deep =
      "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": " + std::string(100000, '[') +
      std::string(100000, ']') + "}}</tool_call>";
  const Parsed p = Parse(deep, GetParam() == 1 ? 4096 : GetParam());
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, deep);
}

INSTANTIATE_TEST_SUITE_P(Pieces, ToolCallParserTest, ::testing::Values(0, 1, 3, 7),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return info.param == 0 ? std::string("Whole")
                                                  : "Pieces" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace mobius::router::openai
