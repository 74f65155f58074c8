// Stop strings on streamed text: text that could still turn out to be the start of a stop string
// is held back, so a client never sees part of a stop string; when one matches, the text ends
// just before it (or, when the request includes it, just after it). Text in and out is valid UTF-8
// (a held-back suffix begins where a stop string begins, at a character boundary).
#ifndef MOBIUS_ROUTER_CORE_STOP_STRING_MATCHER_H_
#define MOBIUS_ROUTER_CORE_STOP_STRING_MATCHER_H_

#include <optional>
#include <string>
#include <vector>

namespace mobius::router {

class StopStringMatcher {
 public:
  // Empty strings must have been rejected by validation; they are ignored here. With
  // `include_match` a matched stop string stays in the text (vLLM's include_stop_str_in_output).
  explicit StopStringMatcher(std::vector<std::string> stop_strings, bool include_match = false);

  struct Result {
    std::string text;  // safe to send now
    // Set once a stop string matched; the text ends before it, or after it with include_match.
    std::optional<std::string> matched;
  };

  // Adds streamed text. After a match, further calls return nothing.
  Result Push(const std::string& text);
  // End of the stream: the held-back text, which matched no stop string.
  std::string Flush();

  [[nodiscard]] bool matched() const { return matched_; }
  [[nodiscard]] size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stop_strings_;
  bool include_match_ = false;
  size_t max_length_ = 0;
  std::string held_;
  bool matched_ = false;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_STOP_STRING_MATCHER_H_
