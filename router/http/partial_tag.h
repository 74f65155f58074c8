// Where a tag may begin at the end of streamed text: the parsers of model output
// (ToolCallParser, ReasoningParser) hold such a suffix back until the next piece decides it.
#ifndef MOBIUS_ROUTER_HTTP_PARTIAL_TAG_H_
#define MOBIUS_ROUTER_HTTP_PARTIAL_TAG_H_

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace mobius::router::openai {

// The length of the longest suffix of `text` that is a proper prefix of `tag`.
inline size_t PartialTagSuffix(std::string_view text, std::string_view tag) {
  for (size_t len = std::min(text.size(), tag.size() - 1); len > 0; --len) {
    if (text.substr(text.size() - len) == tag.substr(0, len)) return len;
  }
  return 0;
}

}  // namespace mobius::router::openai

#endif  // MOBIUS_ROUTER_HTTP_PARTIAL_TAG_H_
