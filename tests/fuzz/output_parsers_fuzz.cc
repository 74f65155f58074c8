// Fuzzes the parsers that split a model's streamed output for the OpenAI API: the reasoning
// parser (<think> ... </think>) and the tool-call parser (<tool_call> blocks). The model's text is
// arbitrary, so neither may crash, and a stream must not change the answer: the same text pushed
// in any chunks gives the same reasoning, content and calls as pushed whole.
//
// Input: one byte choosing the chunk size pattern and the call limit, then the output text.
#include <string>
#include <string_view>
#include <vector>

#include "router/http/reasoning_parser.h"
#include "router/http/tool_call_parser.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using mobius::router::openai::ParsedToolCall;
using mobius::router::openai::ReasoningParser;
using mobius::router::openai::ToolCallParser;

// Chunk lengths 1, 2, 3 ... cycling up to `period` (1: byte by byte), as a detokenizer's pieces.
std::vector<std::string_view> Chunks(std::string_view text, int period) {
  std::vector<std::string_view> chunks;
  size_t pos = 0;
  for (int i = 0; pos < text.size(); ++i) {
    const size_t n = std::min<size_t>(1 + i % period, text.size() - pos);
    chunks.push_back(text.substr(pos, n));
    pos += n;
  }
  return chunks;
}

struct ReasoningResult {
  std::string reasoning, content;
};

ReasoningResult RunReasoning(const std::vector<std::string_view>& chunks) {
  ReasoningParser parser;
  ReasoningResult result;
  auto add = [&](const ReasoningParser::Step& step) {
    result.reasoning += step.reasoning;
    result.content += step.content;
  };
  for (std::string_view chunk : chunks) add(parser.Push(chunk));
  add(parser.Finish());
  return result;
}

struct ToolResult {
  std::string content;
  std::vector<ParsedToolCall> calls;
};

ToolResult RunToolCalls(const std::vector<std::string_view>& chunks, int max_calls) {
  ToolCallParser parser(max_calls);
  ToolResult result;
  auto add = [&](ToolCallParser::Step step) {
    result.content += step.content;
    for (ParsedToolCall& call : step.calls) result.calls.push_back(std::move(call));
  };
  for (std::string_view chunk : chunks) add(parser.Push(chunk));
  add(parser.Finish());
  FUZZ_CHECK(static_cast<int>(result.calls.size()) <= max_calls, "more calls than allowed");
  FUZZ_CHECK(parser.calls() == static_cast<int>(result.calls.size()), "call count disagrees");
  return result;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mobius::fuzz::InputCursor input(data, size);
  const uint8_t mode = input.TakeByte();
  const std::string_view text = input.Rest();
  const int period = 1 + (mode & 15);
  const int max_calls = (mode & 16) != 0 ? 1 : 1 << 30;
  const std::vector<std::string_view> whole =
      text.empty() ? std::vector<std::string_view>() : std::vector<std::string_view>{text};
  const std::vector<std::string_view> chunks = Chunks(text, period);

  const ReasoningResult r_whole = RunReasoning(whole);
  const ReasoningResult r_chunked = RunReasoning(chunks);
  FUZZ_CHECK(r_whole.reasoning == r_chunked.reasoning, "reasoning depends on the chunking");
  FUZZ_CHECK(r_whole.content == r_chunked.content, "reasoning content depends on the chunking");

  const ToolResult t_whole = RunToolCalls(whole, max_calls);
  const ToolResult t_chunked = RunToolCalls(chunks, max_calls);
  FUZZ_CHECK(t_whole.content == t_chunked.content, "tool-call content depends on the chunking");
  FUZZ_CHECK(t_whole.calls.size() == t_chunked.calls.size(), "call count depends on the chunking");
  for (size_t i = 0; i < t_whole.calls.size(); ++i) {
    FUZZ_CHECK(t_whole.calls[i].name == t_chunked.calls[i].name &&
                   t_whole.calls[i].arguments == t_chunked.calls[i].arguments,
               "call " + std::to_string(i) + " depends on the chunking");
  }
  return 0;
}
