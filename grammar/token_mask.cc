#include "grammar/token_mask.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace mobius::grammar {

namespace {

// Whether `bytes` is a run of characters a JSON string takes as they are: printable ASCII other
// than '"' and '\\', and whole, valid UTF-8 characters (the matcher's rules).
bool PlainStringContent(std::string_view bytes) {
  for (size_t i = 0; i < bytes.size();) {
    const uint8_t b = static_cast<uint8_t>(bytes[i]);
    if (b < 0x80) {
      if (b < 0x20 || b == '"' || b == '\\') return false;
      ++i;
      continue;
    }
    size_t need = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      need = 1;
    } else if (b >= 0xE0 && b <= 0xEF) {
      need = 2;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      need = 3;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + need >= bytes.size()) return false;  // the character is cut off
    for (size_t k = 1; k <= need; ++k) {
      const uint8_t c = static_cast<uint8_t>(bytes[i + k]);
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return false;
    }
    i += need + 1;
  }
  return true;
}

}  // namespace

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
  std::vector<uint32_t> path;    // open nodes, by depth - 1
  std::vector<uint32_t> parent;  // of each node (its own index at depth 1)
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
      parent.push_back(path.empty() ? static_cast<uint32_t>(byte_.size()) : path.back());
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

  plain_string_.assign((token_bytes_.size() + 63) / 64, 0);
  has_other_.assign(byte_.size(), 0);
  for (size_t i = 0; i < byte_.size(); ++i) {
    for (uint32_t t = token_begin_[i]; t < token_begin_[i + 1]; ++t) {
      const int32_t id = tokens_[t];
      if (PlainStringContent(token_bytes_[id])) {
        plain_string_[id / 64] |= uint64_t{1} << (id % 64);
      } else {
        has_other_[i] = 1;
      }
    }
  }
  // Children follow their parent in depth-first order: one backward pass carries the marks up.
  for (size_t i = byte_.size(); i-- > 0;) {
    if (has_other_[i] && parent[i] != i) has_other_[parent[i]] = 1;
  }
}

void TokenVocabulary::ComputeMask(const GrammarMatcher& state, TokenBitmask& mask) const {
  // Inside a string with room for any token, the plain ones are allowed as they are and only
  // subtrees holding other tokens (with a quote, a backslash, a partial character...) are walked.
  const bool in_string = state.InPlainStringBody(static_cast<int>(max_depth_));
  if (in_string) {
    mask = plain_string_;
  } else {
    mask.assign((token_bytes_.size() + 63) / 64, 0);
  }
  // states[d]: the matcher after the first d bytes of the current path.
  std::vector<GrammarMatcher> states(max_depth_ + 1, state);
  const size_t n = byte_.size();
  size_t i = 0;
  while (i < n) {
    if (in_string && !has_other_[i]) {
      i = end_[i];
      continue;
    }
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
