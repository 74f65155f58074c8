// A reasoning model's answer "<think>\n{reasoning}\n</think>\n\n{answer}" (the Qwen3 form, which
// the Qwen3 chat template reads back from `reasoning_content`) split into vLLM's
// `reasoning_content` and the `content`, as the text streams. Output that does not open with
// <think> (leading whitespace aside) is content throughout; reasoning never closed by </think> is
// reasoning throughout. As the template renders them back: the reasoning without its leading and
// trailing newlines, the answer without its leading ones.
#ifndef MOBIUS_ROUTER_HTTP_REASONING_PARSER_H_
#define MOBIUS_ROUTER_HTTP_REASONING_PARSER_H_

#include <string>
#include <string_view>

namespace mobius::router::openai {

class ReasoningParser {
 public:
  struct Step {
    std::string reasoning;
    std::string content;
  };

  // More output text; returns what can be shown now (the rest is held until it is decided: a
  // possible opening or closing tag, newlines that may end the reasoning).
  Step Push(std::string_view text);
  // The end of the output: what was held.
  Step Finish();

 private:
  enum class State { kStart, kReasoning, kAnswer, kContent };
  State state_ = State::kStart;
  std::string held_;
  bool reasoning_started_ = false;  // some reasoning text was shown (leading newlines gone)
  bool answer_started_ = false;     // some answer text was shown (leading newlines gone)
};

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_REASONING_PARSER_H_
