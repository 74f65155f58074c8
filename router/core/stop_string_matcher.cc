#include "router/core/stop_string_matcher.h"

#include <algorithm>
#include <string_view>
#include <utility>

namespace mobius::router {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stop_strings, bool include_match)
    : include_match_(include_match) {
  for (std::string& s : stop_strings) {
    if (s.empty()) continue;
    max_length_ = std::max(max_length_, s.size());
    stop_strings_.push_back(std::move(s));
  }
}

StopStringMatcher::Result StopStringMatcher::Push(const std::string& text) {
  Result result;
  if (matched_) return result;
  if (stop_strings_.empty()) {
    result.text = text;
    return result;
  }
  held_ += text;
  // The match that ends first wins (among those ending at one place, the longest): that is where
  // the output first holds a stop string, so a stream cut into any chunks stops at the same
  // place as the whole text would. (Choosing the earliest start instead made "hello world" with
  // stops {"o w", "o"} end at "o w" when pushed whole but at "o" when "hello" came first.) For
  // one stop string the first occurrence is also the first to end.
  size_t best_pos = std::string::npos;
  size_t best_end = std::string::npos;
  const std::string* best = nullptr;
  for (const std::string& s : stop_strings_) {
    const size_t pos = held_.find(s);
    if (pos == std::string::npos) continue;
    const size_t end = pos + s.size();
    if (end < best_end || (end == best_end && pos < best_pos)) {
      best_pos = pos;
      best_end = end;
      best = &s;
    }
  }
  if (best != nullptr) {
    matched_ = true;
    result.text = held_.substr(0, include_match_ ? best_pos + best->size() : best_pos);
    result.matched = *best;
    held_.clear();
    return result;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string. It is shorter than
  // the longest stop string, so held_ stays small and the search above stays cheap.
  size_t keep = 0;
  const size_t longest = std::min(held_.size(), max_length_ - 1);
  for (size_t len = longest; len > 0 && keep == 0; --len) {
    const std::string_view suffix(held_.data() + held_.size() - len, len);
    for (const std::string& s : stop_strings_) {
      if (s.size() > len && std::string_view(s).substr(0, len) == suffix) {
        keep = len;
        break;
      }
    }
  }
  result.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return result;
}

std::string StopStringMatcher::Flush() {
  if (matched_) return {};
  return std::exchange(held_, {});
}

}  // namespace mobius::router
