#include "router/http/reasoning_parser.h"

#include "router/http/partial_tag.h"

namespace mobius::router::openai {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

std::string_view DropLeading(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}

}  // namespace

ReasoningParser::Step ReasoningParser::Push(std::string_view text) {
  Step step;
  held_.append(text);
  while (true) {
    switch (state_) {
      case State::kStart: {
        std::string_view rest = held_;
        while (!rest.empty() && IsSpace(rest.front())) rest.remove_prefix(1);
        if (rest.starts_with(kOpen)) {
          held_ = std::string(rest.substr(kOpen.size()));
          state_ = State::kReasoning;
          continue;
        }
        if (kOpen.starts_with(rest)) return step;  // may still become the tag
        state_ = State::kContent;
        continue;
      }
      case State::kReasoning: {
        const size_t close = held_.find(kClose);
        // [0, end) is reasoning; past it, what may be the closing tag waits.
        const size_t end =
            close != std::string::npos ? close : held_.size() - PartialTagSuffix(held_, kClose);
        // Newlines at its end wait too: they end the reasoning (dropped) if the tag follows.
        size_t text_end = end;
        while (text_end > 0 && held_[text_end - 1] == '\n') --text_end;
        size_t begin = 0;
        if (!reasoning_started_) {
          while (begin < text_end && held_[begin] == '\n') ++begin;
        }
        if (begin < text_end) {
          step.reasoning.append(held_, begin, text_end - begin);
          reasoning_started_ = true;
        }
        if (close == std::string::npos) {
          held_.erase(0, text_end);
          return step;
        }
        held_.erase(0, close + kClose.size());
        state_ = State::kAnswer;
        continue;
      }
      case State::kAnswer: {
        std::string_view shown = held_;
        if (!answer_started_) shown = DropLeading(shown, '\n');
        if (!shown.empty()) answer_started_ = true;
        step.content.append(shown);
        held_.clear();
        return step;
      }
      case State::kContent:
        step.content.append(held_);
        held_.clear();
        return step;
    }
  }
}

ReasoningParser::Step ReasoningParser::Finish() {
  Step step;
  switch (state_) {
    case State::kStart:
    case State::kAnswer:
    case State::kContent:
      // An output of blanks (or a lone "<thi"), or what the answer's leading newlines left.
      if (state_ == State::kAnswer && !answer_started_) break;
      step.content = held_;
      break;
    case State::kReasoning: {
      // Never closed: all of it was reasoning.
      std::string_view rest = held_;
      while (!rest.empty() && rest.back() == '\n') rest.remove_suffix(1);
      if (!reasoning_started_) rest = DropLeading(rest, '\n');
      step.reasoning = std::string(rest);
      break;
    }
  }
  held_.clear();
  return step;
}

}  // namespace mobius::router::openai
