// Function calls in a Qwen-family model's output. The Qwen3 chat template teaches the model to
// answer a tool request with blocks
//   <tool_call>
//   {"name": <function-name>, "arguments": <args-json-object>}
//   </tool_call>
// (the format vLLM's "hermes" parser reads). ToolCallParser splits streamed output text into the
// content shown to the client and the calls, block by block, so that a stream can send each call
// as soon as its block closes.
#ifndef MOBIUS_ROUTER_HTTP_TOOL_CALL_PARSER_H_
#define MOBIUS_ROUTER_HTTP_TOOL_CALL_PARSER_H_

#include <string>
#include <string_view>
#include <vector>

namespace mobius::router::openai {

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // the call's arguments object as JSON text (Python json.dumps form)
};

class ToolCallParser {
 public:
  // `max_calls`: calls past this many are dropped (OpenAI's parallel_tool_calls = false is 1).
  explicit ToolCallParser(int max_calls = 1 << 30) : max_calls_(max_calls) {}

  struct Step {
    std::string content;                // text to show as content now
    std::vector<ParsedToolCall> calls;  // calls whose blocks closed now, in order
  };

  // More output text. Content passes through until a block opens (a suffix that could be the
  // start of "<tool_call>" is held back until it is decided); a block's text is held until it
  // closes, then parsed. A block that is not a call (not a JSON object with a string `name`) is
  // given back as content, tags included, so no output is lost. Whitespace between and after
  // blocks, and at the end, is dropped.
  Step Push(std::string_view text);
  // The end of the output: what was held back. A block left open (the model stopped right after
  // the JSON, without the closing tag) is parsed as if closed, and given back as content if it is
  // not a call.
  Step Finish();

  // Calls returned so far (dropped ones not counted).
  [[nodiscard]] int calls() const { return calls_; }

 private:
  // Appends `text` to step.content; blank text right after a block waits in pending_space_.
  void AddContent(std::string_view text, Step& step);
  void CloseBlock(std::string_view block, bool closed, Step& step);

  const int max_calls_;
  std::string held_;
  size_t scanned_ = 0;  // held_[0, scanned_) holds no closing tag (a block's search resumes there)
  std::string pending_space_;
  bool after_block_ = false;  // only blank text since the last block closed
  bool in_block_ = false;
  int blocks_ = 0;  // blocks seen, calls or not
  int calls_ = 0;
};

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_TOOL_CALL_PARSER_H_
