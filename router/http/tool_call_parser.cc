#include "router/http/tool_call_parser.h"

#include <nlohmann/json.hpp>

#include "router/http/partial_tag.h"
#include "router/http/python_json.h"

namespace mobius::router::openai {
namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";
// Model output is not trusted to be shallow: deeper JSON than this is not parsed as a call (the
// parser and the value's destructor recurse).
constexpr int kMaxDepth = 64;

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

// True when brackets outside strings nest deeper than `limit`.
bool NestsDeeperThan(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

}  // namespace

void ToolCallParser::AddContent(std::string_view text, Step& step) {
  if (text.empty()) return;
  if (after_block_ && Trim(text).empty()) {
    // Blank text right after a block waits: it is dropped before the next block or the end, and
    // kept before more text, whatever pieces the output arrives in.
    pending_space_.append(text);
    return;
  }
  step.content.append(pending_space_);
  pending_space_.clear();
  after_block_ = false;
  step.content.append(text);
}

void ToolCallParser::CloseBlock(std::string_view block, bool closed, Step& step) {
  ++blocks_;
  after_block_ = true;
  const std::string_view body = Trim(block);
  nlohmann::ordered_json call;
  if (!NestsDeeperThan(body, kMaxDepth)) {
    call = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  }
  const bool valid = call.is_object() && call.contains("name") && call["name"].is_string() &&
                     (!call.contains("arguments") || call["arguments"].is_object());
  if (!valid) {
    step.content.append(kOpen);
    step.content.append(block);
    if (closed) step.content.append(kClose);
    return;
  }
  if (calls_ >= max_calls_) return;
  ++calls_;
  step.calls.push_back(ParsedToolCall{
      call["name"].get<std::string>(),
      call.contains("arguments") ? PythonJsonDumps(call["arguments"]) : std::string("{}")});
}

ToolCallParser::Step ToolCallParser::Push(std::string_view text) {
  Step step;
  held_.append(text);
  while (true) {
    if (in_block_) {
      const size_t close = held_.find(kClose, scanned_);
      if (close == std::string::npos) {
        // The next search starts where a tag split across pieces could begin.
        scanned_ = held_.size() >= kClose.size() ? held_.size() - (kClose.size() - 1) : 0;
        break;
      }
      scanned_ = 0;
      CloseBlock(std::string_view(held_).substr(0, close), /*closed=*/true, step);
      held_.erase(0, close + kClose.size());
      in_block_ = false;
      continue;
    }
    const size_t open = held_.find(kOpen);
    if (open == std::string::npos) {
      const size_t keep = PartialTagSuffix(held_, kOpen);
      AddContent(std::string_view(held_).substr(0, held_.size() - keep), step);
      held_.erase(0, held_.size() - keep);
      break;
    }
    AddContent(std::string_view(held_).substr(0, open), step);
    pending_space_.clear();
    held_.erase(0, open + kOpen.size());
    scanned_ = 0;
    in_block_ = true;
  }
  return step;
}

ToolCallParser::Step ToolCallParser::Finish() {
  Step step;
  if (in_block_) {
    CloseBlock(held_, /*closed=*/false, step);
    in_block_ = false;
  } else {
    AddContent(held_, step);
  }
  held_.clear();
  scanned_ = 0;
  pending_space_.clear();
  return step;
}

}  // namespace mobius::router::openai
