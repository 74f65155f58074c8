// Stop strings on streamed text: text that could still turn out to be the start of a stop string
// is held back, so a client never sees part of a stop string; when one matches, the text ends
// just before it. Text in and out is valid UTF-8 (a held-back suffix begins where a stop string
// begins, at a character boundary).
#ifndef MOBIUS_ROUTER_CORE_STOP_STRING_MATCHER_H_
#define MOBIUS_ROUTER_CORE_STOP_STRING_MATCHER_H_

#include <optional>
#include <string>
#include <vector>

namespace mobius::router {

class StopStringMatcher {
 public:
  // Empty strings must have been rejected by validation; they are ignored here.
  explicit StopStringMatcher(std::vector<std::string> stop_strings);

  struct Result {
    std::string text;                    // safe to send now
    std::optional<std::string> matched;  // set once a stop string matched; text ends before it
  };

  // Adds streamed text. After a match, further calls return nothing.
  Result Push(const std::string& text);
  // End of the stream: the held-back text, which matched no stop string.
  std::string Flush();

  [[nodiscard]] bool matched() const { return matched_; }
  [[nodiscard]] size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stop_strings_;
  size_t max_length_ = 0;
  std::string held_;
  bool matched_ = false;
};

}  // namespace mobius::router

#endif  // MOBIUS_ROUTER_CORE_STOP_STRING_MATCHER_H_
