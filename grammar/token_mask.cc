#include "grammar/token_mask.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace mobius::grammar {

// Tokens longer than this are left out of every mask (no tokenizer has them; a state copy per
// byte of depth is kept while walking).
constexpr size_t kMaxTokenBytes = std::numeric_limits<uint16_t>::max();

TokenVocabulary::TokenVocabulary(std::vector<std::string> token_bytes)
    : token_bytes_(std::move(token_bytes)) {
  std::vector<int32_t> order;
  for (size_t i = 0; i < token_bytes_.size(); ++i) {
    if (!token_bytes_[i].empty() && token_bytes_[i].size() <= kMaxTokenBytes) {
      order.push_back(static_cast<int32_t>(i));
    }
  }
  std::sort(order.begin(), order.end(), [this](int32_t x, int32_t y) {
    return token_bytes_[x] != token_bytes_[y] ? token_bytes_[x] < token_bytes_[y] : x < y;
  });
  // Sorted strings give the tree in depth-first order: each string opens the nodes past its
  // common prefix with the previous one, after closing the previous one's deeper nodes.
  std::vector<uint32_t> path;  // open nodes, by depth - 1
  std::string_view previous;
  for (int32_t id : order) {
    const std::string_view s = token_bytes_[id];
    size_t common = 0;
    while (common < s.size() && common < previous.size() && s[common] == previous[common]) {
      ++common;
    }
    while (path.size() > common) {
      end_[path.back()] = static_cast<uint32_t>(byte_.size());
      path.pop_back();
    }
    for (size_t d = common; d < s.size(); ++d) {
      path.push_back(static_cast<uint32_t>(byte_.size()));
      byte_.push_back(static_cast<uint8_t>(s[d]));
      depth_.push_back(static_cast<uint16_t>(d + 1));
      end_.push_back(0);
      token_begin_.push_back(static_cast<uint32_t>(tokens_.size()));
    }
    // The token ends at the deepest open node; tokens_ is filled in node order because the
    // strings come sorted (equal strings are adjacent).
    tokens_.push_back(id);
    max_depth_ = std::max(max_depth_, s.size());
    previous = s;
  }
  while (!path.empty()) {
    end_[path.back()] = static_cast<uint32_t>(byte_.size());
    path.pop_back();
  }
  token_begin_.push_back(static_cast<uint32_t>(tokens_.size()));
}

void TokenVocabulary::ComputeMask(const GrammarMatcher& state, TokenBitmask& mask) const {
  mask.assign((token_bytes_.size() + 63) / 64, 0);
  // states[d]: the matcher after the first d bytes of the current path.
  std::vector<GrammarMatcher> states(max_depth_ + 1, state);
  const size_t n = byte_.size();
  size_t i = 0;
  while (i < n) {
    const size_t d = depth_[i];
    GrammarMatcher& s = states[d];
    s.CopyFrom(states[d - 1]);
    if (!s.Feed(byte_[i])) {
      i = end_[i];
      continue;
    }
    for (uint32_t t = token_begin_[i]; t < token_begin_[i + 1]; ++t) {
      const int32_t id = tokens_[t];
      mask[id / 64] |= uint64_t{1} << (id % 64);
    }
    ++i;
  }
}

}  // namespace mobius::grammar
