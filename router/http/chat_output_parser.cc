#include "router/http/chat_output_parser.h"

#include <utility>

namespace mobius::router::openai {

void ChatOutputParser::Step::Append(Step&& more) {
  reasoning += more.reasoning;
  content += more.content;
  calls.insert(calls.end(), std::make_move_iterator(more.calls.begin()),
               std::make_move_iterator(more.calls.end()));
}

ChatOutputParser::ChatOutputParser(bool reasoning, bool tool_calls, int max_tool_calls) {
  if (reasoning) reasoning_.emplace();
  if (tool_calls) tools_.emplace(max_tool_calls);
}

ChatOutputParser::Step ChatOutputParser::SplitContent(ReasoningParser::Step split, bool last) {
  Step step;
  step.reasoning = std::move(split.reasoning);
  if (!tools_.has_value()) {
    step.content = std::move(split.content);
    return step;
  }
  ToolCallParser::Step calls = tools_->Push(split.content);
  if (last) {
    ToolCallParser::Step rest = tools_->Finish();
    calls.content += rest.content;
    calls.calls.insert(calls.calls.end(), rest.calls.begin(), rest.calls.end());
  }
  step.content = std::move(calls.content);
  step.calls = std::move(calls.calls);
  return step;
}

ChatOutputParser::Step ChatOutputParser::Push(std::string_view text) {
  ReasoningParser::Step split;
  if (reasoning_.has_value()) {
    split = reasoning_->Push(text);
  } else {
    split.content = std::string(text);
  }
  return SplitContent(std::move(split), /*last=*/false);
}

ChatOutputParser::Step ChatOutputParser::Finish() {
  return SplitContent(reasoning_.has_value() ? reasoning_->Finish() : ReasoningParser::Step{},
                      /*last=*/true);
}

ChatOutputParser::Step ChatOutputParser::Parse(std::string_view text) {
  Step step = Push(text);
  step.Append(Finish());
  return step;
}

}  // namespace mobius::router::openai
