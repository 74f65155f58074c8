// SSE framing edge cases: events split across reads at every byte, several per read, the three
// line endings, comments and other fields, multi-line data, cut streams and runaway lines.
#include "bench/serve/sse_parser.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mobius::bench {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> ParseAll(const std::string& body) {
  SseParser parser;
  std::vector<std::string> events;
  EXPECT_TRUE(parser.Feed(body, events).ok());
  return events;
}

TEST(SseParserTest, SeveralEventsInOneRead) {
  EXPECT_THAT(ParseAll("data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n"),
              ElementsAre("{\"a\":1}", "{\"b\":2}", "[DONE]"));
}

TEST(SseParserTest, EventSplitAtEveryByte) {
  const std::string body = "data: {\"text\":\"hi\"}\r\n\r\ndata: [DONE]\r\n\r\n";
  for (size_t cut = 0; cut <= body.size(); ++cut) {
    SseParser parser;
    std::vector<std::string> events;
    ASSERT_TRUE(parser.Feed(body.substr(0, cut), events).ok());
    ASSERT_TRUE(parser.Feed(body.substr(cut), events).ok());
    EXPECT_THAT(events, ElementsAre("{\"text\":\"hi\"}", "[DONE]")) << "cut at " << cut;
    EXPECT_FALSE(parser.HasPartialEvent());
  }
}

TEST(SseParserTest, CrLfCrAndLfLineEndings) {
  EXPECT_THAT(ParseAll("data: a\r\n\r\ndata: b\r\rdata: c\n\n"), ElementsAre("a", "b", "c"));
}

TEST(SseParserTest, CommentsAndOtherFieldsAreSkipped) {
  EXPECT_THAT(ParseAll(": ping\n\nevent: message\nid: 7\nretry: 100\ndata: x\n\n"),
              ElementsAre("x"));
}

TEST(SseParserTest, DataLinesJoinAndSpacingRules) {
  // Only one space after the colon is dropped; "data" alone is an empty line of data.
  EXPECT_THAT(ParseAll("data: a\ndata:b\ndata:  c\n\ndata\n\n"), ElementsAre("a\nb\n c", ""));
}

TEST(SseParserTest, BlankLinesWithoutDataDispatchNothing) {
  EXPECT_TRUE(ParseAll("\n\n\r\n: only a comment\n\n").empty());
}

TEST(SseParserTest, ByteOrderMarkAtTheStartIsIgnored) {
  EXPECT_THAT(ParseAll("\xEF\xBB\xBF"
                       "data: x\n\n"),
              ElementsAre("x"));
}

TEST(SseParserTest, ReportsAPartialEvent) {
  SseParser parser;
  std::vector<std::string> events;
  ASSERT_TRUE(parser.Feed("data: {\"te", events).ok());
  EXPECT_TRUE(events.empty());
  EXPECT_TRUE(parser.HasPartialEvent());
  SseParser line_done;
  ASSERT_TRUE(line_done.Feed("data: x\n", events).ok());  // no blank line yet
  EXPECT_TRUE(line_done.HasPartialEvent());
}

TEST(SseParserTest, RunawayLineIsAnError) {
  SseParser parser(/*max_line_bytes=*/16);
  std::vector<std::string> events;
  absl::Status status = parser.Feed("data: " + std::string(100, 'x'), events);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("longer than 16 bytes"));
}

}  // namespace
}  // namespace mobius::bench
