// A chat answer split into what OpenAI's message carries: the reasoning (ReasoningParser, when
// asked for), then the rest through the tool-call parser (ToolCallParser, when tools are in use)
// into content and calls. Streams push their pieces; a whole answer is one push and the finish,
// so both give the same split.
#ifndef MOBIUS_ROUTER_HTTP_CHAT_OUTPUT_PARSER_H_
#define MOBIUS_ROUTER_HTTP_CHAT_OUTPUT_PARSER_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "router/http/reasoning_parser.h"
#include "router/http/tool_call_parser.h"

namespace mobius::router::openai {

class ChatOutputParser {
 public:
  struct Step {
    std::string reasoning;
    std::string content;
    std::vector<ParsedToolCall> calls;
    void Append(Step&& more);
  };

  // `reasoning`: split off a leading <think> block; `tool_calls`: read <tool_call> blocks, at most
  // `max_tool_calls` of them. With neither, text passes through as content.
  ChatOutputParser(bool reasoning, bool tool_calls, int max_tool_calls);

  // More answer text; what can be shown now.
  Step Push(std::string_view text);
  // The end of the answer: what was held back.
  Step Finish();
  // A whole answer: Push then Finish.
  Step Parse(std::string_view text);

 private:
  // The reasoning parser's output of one step through the tool-call parser (finishing it when
  // `last`).
  Step SplitContent(ReasoningParser::Step split, bool last);

  std::optional<ReasoningParser> reasoning_;
  std::optional<ToolCallParser> tools_;
};

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_CHAT_OUTPUT_PARSER_H_
