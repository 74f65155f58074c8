#include "grammar/grammar_matcher.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "grammar/utf8_ranges.h"

namespace mobius::grammar {
namespace {

// Phases of each frame kind.
enum RootPhase : uint8_t { kRootStart, kRootDone };
enum ObjectPhase : uint8_t {
  kObjFirst,     // after '{': whitespace, a key or '}'
  kObjKeyStart,  // after ',': whitespace or a key
  kObjKeyLit,    // inside a declared key
  kObjKeyFree,   // a free-form key's string frame is open above
  kObjColon,     // after a key: whitespace or ':'
  kObjValue,     // after ':': whitespace or the value
  kObjInValue,   // the value's frame is open above
  kObjAfter,     // after a value: whitespace, ',' or '}'
};
enum ArrayPhase : uint8_t { kArrFirst, kArrNext, kArrInValue, kArrAfter };
enum UntilPhase : uint8_t { kUntilText, kUntilSpace };
enum RepeatPhase : uint8_t {
  kRepItem,   // an item's frame is open above
  kRepAfter,  // after an item: c bytes of the separator matched
};
enum StringPhase : uint8_t {
  kStrBody,
  kStrEscape,
  kStrHex,  // \u's digits (b: their value so far)
  kStrUtf8,
  kStrLowBackslash,  // after a high surrogate's \uD800-\uDBFF: its low half must follow
  kStrLowU,
  kStrLowHex,
};
enum NumberPhase : uint8_t {
  kNumMinus,
  kNumZero,
  kNumInt,
  kNumDot,
  kNumFrac,
  kNumExp,
  kNumExpSign,
  kNumExpDigits
};

bool IsWhitespace(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool IsDigit(uint8_t c) { return c >= '0' && c <= '9'; }
bool IsHex(uint8_t c) { return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
int HexValue(uint8_t c) { return IsDigit(c) ? c - '0' : (c | 0x20) - 'a' + 10; }

// Whitespace between tokens, up to kMaxWhitespaceRun in a row.
bool TakeWhitespace(uint8_t& run, uint8_t c) {
  if (!IsWhitespace(c) || run >= kMaxWhitespaceRun) return false;
  ++run;
  return true;
}

// The last declared property a key may name now: optional properties may be skipped, up to
// and including the next required one.
int32_t KeyLimit(const Node& node, int32_t next) {
  const int32_t n = static_cast<int32_t>(node.properties.size());
  for (int32_t i = next; i < n; ++i) {
    if (node.properties[i].required) return i;
  }
  return n - 1;
}

bool RequiredLeft(const Node& node, int32_t next) {
  for (size_t i = static_cast<size_t>(next); i < node.properties.size(); ++i) {
    if (node.properties[i].required) return true;
  }
  return false;
}

}  // namespace

GrammarMatcher::GrammarMatcher(const Grammar& grammar) : grammar_(&grammar) {
  frames_[0] = Frame{};
  frames_[0].phase = kRootStart;
  size_ = 1;
}

void GrammarMatcher::CopyFrom(const GrammarMatcher& other) {
  grammar_ = other.grammar_;
  size_ = other.size_;
  std::memcpy(frames_.data(), other.frames_.data(), sizeof(Frame) * size_);
}

void GrammarMatcher::AppendStateKey(std::string& key, int horizon) const {
  const int32_t cap = horizon + 1;
  auto distance = [cap](int32_t limit, int32_t count) {
    return limit < 0 ? -1 : std::clamp(limit - count, 0, cap);
  };
  for (uint8_t i = 0; i < size_; ++i) {
    Frame f = frames_[i];
    if (f.node >= 0) {
      const Node& node = grammar_->nodes[f.node];
      if (node.kind == NodeKind::kString) {
        if (node.regex < 0) {
          f.c = distance(node.max_length, f.a);  // (c is unused by plain strings)
          f.a = distance(node.min_length, f.a);
        } else if (node.max_length >= 0) {
          // A pattern (its automaton's state in c) under maxLength: the room left matters while
          // a token's characters plus the farthest match could reach the limit.
          const int32_t reach = horizon + 1 + grammar_->regexes[node.regex].max_distance();
          f.a = std::clamp(node.max_length - f.a, 0, reach);
        }
      } else if (node.kind == NodeKind::kRepeat) {
        // (c is the separator's progress; b is unused.)
        f.b = distance(node.max_items, f.a);
        f.a = distance(node.min_items, f.a);
      } else if (node.kind == NodeKind::kArray) {
        f.c = distance(node.max_items, f.a);
        f.a = distance(node.min_items, f.a);
      }
    }
    key.append(reinterpret_cast<const char*>(&f), sizeof(Frame));
  }
}

bool GrammarMatcher::FeedBytes(std::string_view bytes) {
  for (char c : bytes) {
    if (!Feed(static_cast<uint8_t>(c))) return false;
  }
  return true;
}

bool GrammarMatcher::Push(int32_t node_index, uint8_t byte) {
  // Unions pass to the alternative that can start with the byte. A cycle of unions that
  // consumes nothing is refused after as many hops as there are nodes.
  for (size_t hops = 0;; ++hops) {
    if (hops > grammar_->nodes.size() || !grammar_->first_bytes[node_index].test(byte)) {
      return false;
    }
    const Node& node = grammar_->nodes[node_index];
    if (node.kind != NodeKind::kUnion) break;
    int32_t next = -1;
    for (int32_t alt : node.alternatives) {
      if (grammar_->first_bytes[alt].test(byte)) {
        next = alt;
        break;
      }
    }
    if (next < 0) return false;
    node_index = next;
  }
  // A value whose shortest form would nest past kMaxNestingDepth here could never be finished.
  if (size_ + static_cast<size_t>(grammar_->min_depth[node_index]) > frames_.size()) return false;
  const Node& node = grammar_->nodes[node_index];
  Frame f{};
  f.node = node_index;
  switch (node.kind) {
    case NodeKind::kObject:
    case NodeKind::kObjectSwitch:
      f.phase = kObjFirst;
      break;
    case NodeKind::kArray:
      f.phase = kArrFirst;
      break;
    case NodeKind::kString:
      f.phase = kStrBody;
      break;
    case NodeKind::kNumber:
    case NodeKind::kInteger:
      f.a = 1;
      f.phase = byte == '-' ? kNumMinus : byte == '0' ? kNumZero : kNumInt;
      if ((node.has_min || node.has_max) && !BoundedStart(f, node, byte)) return false;
      break;
    case NodeKind::kLiterals:
      f.b = -1;
      for (size_t i = 0; i < node.literals.size(); ++i) {
        if (static_cast<uint8_t>(node.literals[i][0]) == byte) {
          f.b = static_cast<int32_t>(i);
          break;
        }
      }
      if (f.b < 0) return false;
      f.a = 1;
      break;
    case NodeKind::kUntil:
      f.phase = kUntilText;
      frames_[size_++] = f;
      if (FeedUntil(frames_[size_ - 1], node, byte) == kConsumed) return true;
      --size_;
      return false;
    case NodeKind::kRegex:
      f.c = grammar_->regexes[node.regex].start();
      frames_[size_++] = f;
      if (FeedRegex(frames_[size_ - 1], node, byte) == kConsumed) return true;
      --size_;
      return false;
    case NodeKind::kSequence:
      // The sequence's frame, then its first part's, which takes the byte.
      f.a = 0;
      frames_[size_++] = f;
      if (Push(node.alternatives[0], byte)) return true;
      --size_;
      return false;
    case NodeKind::kRepeat:
      // The repeat's frame, then its first item's, which takes the byte.
      f.phase = kRepItem;
      frames_[size_++] = f;
      if (Push(node.items, byte)) return true;
      --size_;
      return false;
    case NodeKind::kUnion:
      return false;
  }
  frames_[size_++] = f;
  return true;
}

void GrammarMatcher::ChildDone() {
  // A sequence whose last part completed completes too, and so on down.
  while (size_ > 1 && grammar_->nodes[frames_[size_ - 1].node].kind == NodeKind::kSequence) {
    Frame& seq = frames_[size_ - 1];
    if (static_cast<size_t>(++seq.a) < grammar_->nodes[seq.node].alternatives.size()) return;
    --size_;
  }
  Frame& f = frames_[size_ - 1];
  f.ws = 0;
  if (f.node < 0) {
    f.phase = kRootDone;
    return;
  }
  // A frame below another is an object, an array, a repeat or a sequence (above).
  const Node& node = grammar_->nodes[f.node];
  if (node.kind == NodeKind::kRepeat) {
    f.phase = kRepAfter;
    f.c = 0;
    // The count matters only up to the larger limit; past it, equal states stay equal.
    if (node.max_items >= 0 || f.a < node.min_items) ++f.a;
    return;
  }
  if (node.kind == NodeKind::kObject || node.kind == NodeKind::kObjectSwitch) {
    if (f.phase == kObjKeyFree) {
      f.phase = kObjColon;
    } else {
      f.phase = kObjAfter;
      if (!node.properties.empty()) f.a = f.b + 1;  // the next property after the value's
    }
    if (node.kind == NodeKind::kObjectSwitch) {
      // The shared first property's value was the literal frame just popped (it still lies
      // above the stack's top): the frame becomes the object that value selects, after its
      // first property.
      const int32_t literal =
          CompletedLiteral(frames_[size_], grammar_->nodes[node.properties[0].value]);
      f.node = node.cases[literal];
    }
    return;
  }
  f.phase = kArrAfter;
  // The count matters only up to the larger limit; past it, equal states stay equal.
  if (node.max_items >= 0 || f.a < node.min_items) ++f.a;
}

bool GrammarMatcher::Feed(uint8_t byte) {
  // A number or a literal ends at the first byte that cannot extend it, which the frame below
  // then takes: at most one hand-back per frame.
  while (size_ > 0) {
    switch (FeedFrame(frames_[size_ - 1], byte)) {
      case kReject:
        return false;
      case kConsumed:
        return true;
      case kPopAndRefeed:
        --size_;
        ChildDone();
        break;
    }
  }
  return false;
}

GrammarMatcher::Step GrammarMatcher::FeedFrame(Frame& f, uint8_t byte) {
  if (f.node < 0) {  // the root: one value, nothing after it
    if (f.phase != kRootStart) return kReject;
    return Push(grammar_->root, byte) ? kConsumed : kReject;
  }
  const Node& node = grammar_->nodes[f.node];
  switch (node.kind) {
    case NodeKind::kObject:
    case NodeKind::kObjectSwitch:
      return FeedObject(f, node, byte);
    case NodeKind::kArray:
      return FeedArray(f, node, byte);
    case NodeKind::kString:
      return FeedString(f, node, byte);
    case NodeKind::kNumber:
    case NodeKind::kInteger:
      return FeedNumber(f, node, byte);
    case NodeKind::kLiterals:
      return FeedLiteral(f, node, byte);
    case NodeKind::kUntil:
      return FeedUntil(f, node, byte);
    case NodeKind::kRegex:
      return FeedRegex(f, node, byte);
    case NodeKind::kRepeat:
      return FeedRepeat(f, node, byte);
    case NodeKind::kSequence:
      // Between parts (the previous one completed): the next part starts, nothing between.
      return Push(node.alternatives[f.a], byte) ? kConsumed : kReject;
    case NodeKind::kUnion:
      break;
  }
  return kReject;
}

GrammarMatcher::Step GrammarMatcher::FeedObject(Frame& f, const Node& node, uint8_t byte) {
  const bool declared = !node.properties.empty();
  const int32_t n = static_cast<int32_t>(node.properties.size());
  const bool can_close = declared ? !RequiredLeft(node, f.a) : true;
  // (A value that cannot fit under this object's frame is never offered: its key would lead
  // nowhere.)
  auto fits = [&](int32_t value) {
    return size_ + static_cast<size_t>(grammar_->min_depth[value]) <= frames_.size();
  };
  bool more_keys = !declared && node.additional >= 0 && fits(node.additional);
  if (declared) {
    const int32_t limit = f.a < n ? KeyLimit(node, f.a) : -1;
    for (int32_t i = f.a; i <= limit && !more_keys; ++i) more_keys = fits(node.properties[i].value);
  }
  auto start_key = [&]() -> Step {
    if (!more_keys) return kReject;
    f.ws = 0;
    if (!declared) {
      f.phase = kObjKeyFree;
      return Push(grammar_->string_node, byte) ? kConsumed : kReject;
    }
    // Every key starts with '"': the first candidate is the next property whose value fits.
    const int32_t limit = KeyLimit(node, f.a);
    f.b = -1;
    for (int32_t i = f.a; i <= limit && f.b < 0; ++i) {
      if (fits(node.properties[i].value)) f.b = i;
    }
    if (f.b < 0) return kReject;
    f.phase = kObjKeyLit;
    f.c = 1;
    return kConsumed;
  };
  switch (f.phase) {
    case kObjFirst:
      if (TakeWhitespace(f.ws, byte)) return kConsumed;
      if (byte == '"') return start_key();
      if (byte == '}' && can_close) return CloseTop();
      return kReject;
    case kObjKeyStart:
      if (TakeWhitespace(f.ws, byte)) return kConsumed;
      return byte == '"' ? start_key() : kReject;
    case kObjKeyLit: {
      const int32_t limit = KeyLimit(node, f.a);
      const std::string& current = node.properties[f.b].key;
      for (int32_t i = f.b; i <= limit; ++i) {
        const std::string& key = node.properties[i].key;
        if (!fits(node.properties[i].value)) continue;
        if (key.size() > static_cast<size_t>(f.c) && static_cast<uint8_t>(key[f.c]) == byte &&
            key.compare(0, f.c, current, 0, f.c) == 0) {
          f.b = i;
          if (static_cast<size_t>(++f.c) == key.size()) {
            f.phase = kObjColon;
            f.c = 0;
            f.ws = 0;
          }
          return kConsumed;
        }
      }
      return kReject;
    }
    case kObjColon:
      if (TakeWhitespace(f.ws, byte)) return kConsumed;
      if (byte != ':') return kReject;
      f.phase = kObjValue;
      f.ws = 0;
      return kConsumed;
    case kObjValue: {
      if (TakeWhitespace(f.ws, byte)) return kConsumed;
      const int32_t value = declared ? node.properties[f.b].value : node.additional;
      if (!Push(value, byte)) return kReject;
      f.phase = kObjInValue;  // (f is the frame below the value's now)
      return kConsumed;
    }
    case kObjAfter:
      return AfterMember(f, byte, more_keys, kObjKeyStart, '}', can_close);
    default:
      return kReject;
  }
}

GrammarMatcher::Step GrammarMatcher::CloseTop() {
  --size_;
  ChildDone();
  return kConsumed;
}

GrammarMatcher::Step GrammarMatcher::AfterMember(Frame& f, uint8_t byte, bool more,
                                                 uint8_t next_phase, char close, bool can_close) {
  if (TakeWhitespace(f.ws, byte)) return kConsumed;
  if (byte == ',' && more) {
    f.phase = next_phase;
    f.ws = 0;
    return kConsumed;
  }
  if (byte == static_cast<uint8_t>(close) && can_close) return CloseTop();
  return kReject;
}

GrammarMatcher::Step GrammarMatcher::FeedArray(Frame& f, const Node& node, uint8_t byte) {
  const bool can_close = f.a >= node.min_items;
  const bool more_items = node.max_items < 0 || f.a < node.max_items;
  auto start_item = [&]() -> Step {
    if (!more_items || !Push(node.items, byte)) return kReject;
    f.phase = kArrInValue;  // (f is the frame below the item's now)
    f.ws = 0;
    return kConsumed;
  };
  switch (f.phase) {
    case kArrFirst:
      if (TakeWhitespace(f.ws, byte)) return kConsumed;
      if (byte == ']' && can_close) return CloseTop();
      return start_item();
    case kArrNext:
      if (TakeWhitespace(f.ws, byte)) return kConsumed;
      return start_item();
    case kArrAfter:
      return AfterMember(f, byte, more_items, kArrNext, ']', can_close);
    default:
      return kReject;
  }
}

GrammarMatcher::Step GrammarMatcher::FeedString(Frame& f, const Node& node, uint8_t byte) {
  const bool room = node.max_length < 0 || f.a < node.max_length;
  // Under a pattern (its automaton's state in c) each character is a code point, decoded from
  // UTF-8 or from an escape, and every byte of it is taken only if some character it can still
  // become has a transition: no partial character leads nowhere.
  const RegexDfa* pattern = node.regex >= 0 ? &grammar_->regexes[node.regex] : nullptr;
  // Under a pattern and maxLength, the characters left after this one: a character is taken
  // only if a match is still that close (-1: no limit; at the limit itself, where the formula
  // also gives -1, `room` below refuses every byte but the closing quote first).
  const int32_t budget =
      pattern != nullptr && node.max_length >= 0 ? node.max_length - f.a - 1 : -1;
  auto possible = [&](uint32_t lo, uint32_t hi) {
    return pattern == nullptr || pattern->AnyNext(f.c, lo, hi, budget);
  };
  // \uXXXX values in [lo, hi] (some digits still to come): the characters they can give.
  auto possible_escaped = [&](uint32_t lo, uint32_t hi) {
    if (pattern == nullptr) return true;
    if (lo <= 0xD7FF && possible(lo, std::min<uint32_t>(hi, 0xD7FF))) return true;
    if (hi >= 0xE000 && possible(std::max<uint32_t>(lo, 0xE000), hi)) return true;
    const uint32_t high_lo = std::max<uint32_t>(lo, 0xD800),
                   high_hi = std::min<uint32_t>(hi, 0xDBFF);
    return high_lo <= high_hi && possible(0x10000 + ((high_lo - 0xD800) << 10),
                                          0x10000 + ((high_hi - 0xD800) << 10) + 0x3FF);
  };
  // A character completed: the pattern steps, and it is counted up to the larger limit (past
  // it, equal states stay equal).
  auto take_char = [&](uint32_t code_point) {
    if (pattern != nullptr) {
      const int32_t next = pattern->Next(f.c, code_point);
      if (next == RegexDfa::kNone) return false;
      if (budget >= 0 && pattern->DistanceToMatch(next) > budget) return false;
      f.c = next;
    }
    if (node.max_length >= 0 || f.a < node.min_length) ++f.a;
    return true;
  };
  switch (f.phase) {
    case kStrBody: {
      if (byte == '"') {
        if (f.a < node.min_length) return kReject;
        if (pattern != nullptr && !pattern->Accepting(f.c)) return kReject;
        return CloseTop();
      }
      if (!room || byte < 0x20) return kReject;
      if (byte == '\\') {
        if (!possible(0, kMaxCodePoint)) return kReject;  // (\u can give any character)
        f.phase = kStrEscape;
        return kConsumed;
      }
      if (byte < 0x80) return take_char(byte) ? kConsumed : kReject;
      // A lead byte, and the characters it can begin.
      // (A continuation byte without a lead, or an invalid lead, is refused.)
      if (!TakeLead(f, byte, pattern, budget)) return kReject;
      f.phase = kStrUtf8;
      return kConsumed;
    }
    case kStrUtf8: {
      const int64_t value = TakeContinuation(f, byte, pattern, budget);
      if (value == kCharRefused) return kReject;
      if (value == kCharPending) return kConsumed;
      f.phase = kStrBody;
      return take_char(static_cast<uint32_t>(value)) ? kConsumed : kReject;
    }
    case kStrEscape: {
      if (byte == 'u') {
        f.phase = kStrHex;
        f.pending = 4;
        f.b = 0;
        return kConsumed;
      }
      static constexpr char kEscapes[] = "\"\\/bfnrt";
      static constexpr char kMeanings[] = "\"\\/\b\f\n\r\t";
      const char* at = byte == 0 ? nullptr : std::strchr(kEscapes, byte);
      if (at == nullptr) return kReject;
      f.phase = kStrBody;
      return take_char(static_cast<uint8_t>(kMeanings[at - kEscapes])) ? kConsumed : kReject;
    }
    case kStrHex: {
      // \uXXXX is one character, except a UTF-16 surrogate: a high one (D800-DBFF) must be
      // followed by \u and a low one (DC00-DFFF), the pair one character; a low one alone is
      // refused (JSON parsers reject it). Checked digit by digit, so no prefix leads nowhere.
      if (!IsHex(byte)) return kReject;
      const int digit = HexValue(byte);
      if (f.pending == 3 && f.b == 0xD && digit >= 0xC) return kReject;
      const auto value = static_cast<uint32_t>(f.b * 16 + digit);
      f.b = static_cast<int32_t>(value);
      const int shift = 4 * --f.pending;
      if (!possible_escaped(value << shift, ((value + 1) << shift) - 1)) return kReject;
      if (f.pending > 0) return kConsumed;
      if (value >= 0xD800 && value <= 0xDBFF) {
        // The high half waits above the low half's digits, in b's upper bits.
        f.phase = kStrLowBackslash;
        f.b = static_cast<int32_t>((value - 0xD800 + 1) << 16);
        return kConsumed;
      }
      f.phase = kStrBody;
      f.b = 0;
      return take_char(value) ? kConsumed : kReject;
    }
    case kStrLowBackslash:
      if (byte != '\\') return kReject;
      f.phase = kStrLowU;
      return kConsumed;
    case kStrLowU:
      if (byte != 'u') return kReject;
      f.phase = kStrLowHex;
      f.pending = 4;
      return kConsumed;
    case kStrLowHex: {
      if (!IsHex(byte)) return kReject;
      const int digit = HexValue(byte);
      const int index = 4 - f.pending;
      if ((index == 0 && digit != 0xD) || (index == 1 && digit < 0xC)) return kReject;
      const auto high = static_cast<uint32_t>(f.b >> 16) - 1;
      const uint32_t low = static_cast<uint32_t>(f.b & 0xFFFF) * 16 + digit;
      f.b = static_cast<int32_t>(((high + 1) << 16) | low);
      const int shift = 4 * --f.pending;
      const uint32_t base = 0x10000 + (high << 10);
      const uint32_t lo = std::max<uint32_t>(low << shift, 0xDC00);
      const uint32_t hi = std::min<uint32_t>(((low + 1) << shift) - 1, 0xDFFF);
      if (lo > hi || !possible(base + lo - 0xDC00, base + hi - 0xDC00)) return kReject;
      if (f.pending > 0) return kConsumed;
      f.phase = kStrBody;
      f.b = 0;
      return take_char(base + low - 0xDC00) ? kConsumed : kReject;
    }
    default:
      return kReject;
  }
}

GrammarMatcher::Step GrammarMatcher::FeedNumber(Frame& f, const Node& node, uint8_t byte) {
  const bool integer = node.kind == NodeKind::kInteger;
  const bool bounded = node.has_min || node.has_max;
  // `digits_after`: the digits this byte still needs (a '.' or an exponent's 'e' / sign needs
  // one): refused when they would not fit in kMaxNumberLength, so no number is left unfinishable.
  auto next = [&](uint8_t phase, int digits_after = 0) {
    if (f.a + 1 + digits_after > kMaxNumberLength) return kReject;
    if (bounded && !BoundedStep(f, node, phase, byte)) return kReject;
    ++f.a;
    f.phase = phase;
    return kConsumed;
  };
  // (Bounded numbers have no exponent: it would move the value past any digit-wise check.)
  const bool exponent = !integer && !bounded && (byte == 'e' || byte == 'E');
  switch (f.phase) {
    case kNumMinus:
      if (byte == '0') return next(kNumZero);
      if (IsDigit(byte)) return next(kNumInt);
      return kReject;
    case kNumZero:
    case kNumInt:
      if (IsDigit(byte) && f.phase == kNumInt) return next(kNumInt);
      if (!integer && byte == '.') return next(kNumDot, 1);
      if (exponent) return next(kNumExp, 1);
      break;
    case kNumDot:
      return IsDigit(byte) ? next(kNumFrac) : kReject;
    case kNumFrac:
      if (IsDigit(byte)) return next(kNumFrac);
      if (exponent) return next(kNumExp, 1);
      break;
    case kNumExp:
      if (byte == '+' || byte == '-') return next(kNumExpSign, 1);
      return IsDigit(byte) ? next(kNumExpDigits) : kReject;
    case kNumExpSign:
      return IsDigit(byte) ? next(kNumExpDigits) : kReject;
    case kNumExpDigits:
      if (IsDigit(byte)) return next(kNumExpDigits);
      break;
  }
  return NumberComplete(f, node) ? kPopAndRefeed : kReject;
}

namespace {

constexpr uint8_t kNegative = 1;
constexpr uint8_t kSettled = 2;  // every continuation stays within the bounds: no more checks
// Magnitudes are compared in 128 bits, so no product of the checks below can overflow.
using Wide = __int128;
constexpr Wide kUnbounded = Wide(1) << 100;
// Integer digits a tracked value may have: its magnitude in units of 10^-scale stays < 10^18.
int IntegerDigitCap(const Node& node) { return 18 - node.scale_digits; }

Wide Pow10(int n) {
  Wide p = 1;
  while (n-- > 0) p *= 10;
  return p;
}

int64_t JoinHalves(int32_t low, int32_t high) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(high)) << 32) |
                              static_cast<uint32_t>(low));
}

// The magnitudes (in units of 10^-scale) a value of this sign may have to lie within the
// bounds: [first, second], empty when first > second. A bounded number's minus sign is
// followed by a nonzero magnitude.
std::pair<Wide, Wide> MagnitudeWindow(const Node& node, bool negative) {
  if (!negative) {
    return {node.has_min ? std::max<Wide>(node.min_scaled, 0) : 0,
            node.has_max ? Wide(node.max_scaled) : kUnbounded};
  }
  // (A minus sign needs a value below zero: no "-0" where only it would fit.)
  return {node.has_max ? std::max<Wide>(-Wide(node.max_scaled), 1) : 1,
          node.has_min ? -Wide(node.min_scaled) : kUnbounded};
}

// Whether a number in `phase` whose digits so far are `digits` (`fraction` of them after the
// point, `integer_digits` before it) can still be completed to a value within the bounds.
bool Reachable(const Node& node, bool negative, uint8_t phase, Wide digits, int fraction,
               int integer_digits) {
  const auto [lo, hi] = MagnitudeWindow(node, negative);
  if (lo > hi) return false;
  auto hits = [lo = lo, hi = hi](Wide a, Wide b) { return a <= hi && b >= lo; };
  const Wide unit = Pow10(node.scale_digits);
  const int cap = IntegerDigitCap(node);
  switch (phase) {
    case kNumMinus:  // any magnitude to come
      return hits(0, Pow10(cap) * unit - 1);
    case kNumZero:  // 0, or 0.xxx
      return hits(0, unit - 1);
    case kNumInt:
      // n more integer digits, then any fraction: [digits * 10^n, (digits + 1) * 10^n) units.
      for (int n = 0; integer_digits + n <= cap; ++n) {
        const Wide scale = Pow10(n) * unit;
        if (digits * scale > hi) break;
        if (hits(digits * scale, (digits + 1) * scale - 1)) return true;
      }
      return false;
    default: {  // after the point: the remaining fraction digits
      const Wide step = Pow10(node.scale_digits - fraction);
      return hits(digits * step, digits * step + step - 1);
    }
  }
}

}  // namespace

bool GrammarMatcher::BoundedStart(Frame& f, const Node& node, uint8_t byte) {
  const bool negative = byte == '-';
  const Wide digits = IsDigit(byte) ? byte - '0' : 0;
  if (!Reachable(node, negative, f.phase, digits, 0, negative ? 0 : 1)) return false;
  f.lead = negative ? kNegative : 0;
  f.b = static_cast<int32_t>(digits);
  f.c = 0;
  f.pending = 0;
  if (f.phase != kNumMinus && MagnitudeWindow(node, negative).second == kUnbounded &&
      digits * Pow10(node.scale_digits) >= MagnitudeWindow(node, negative).first) {
    f.lead |= kSettled;
    f.b = 0;
  }
  return true;
}

bool GrammarMatcher::BoundedStep(Frame& f, const Node& node, uint8_t phase, uint8_t byte) {
  if (f.lead & kSettled) return true;
  const bool negative = f.lead & kNegative;
  Wide digits = JoinHalves(f.b, f.c);
  int fraction = f.pending;
  switch (phase) {
    case kNumZero:
      digits = 0;
      break;
    case kNumInt:
      digits = digits * 10 + (byte - '0');
      break;
    case kNumDot:
      break;
    case kNumFrac:
      if (fraction >= node.scale_digits) return false;
      digits = digits * 10 + (byte - '0');
      ++fraction;
      break;
    default:
      return false;  // no exponent
  }
  const int integer_digits = phase == kNumInt ? f.a + 1 - (negative ? 1 : 0) : 0;
  if (!Reachable(node, negative, phase, digits, fraction, integer_digits)) return false;
  const uint64_t packed = static_cast<uint64_t>(static_cast<int64_t>(digits));
  f.b = static_cast<int32_t>(static_cast<uint32_t>(packed));
  f.c = static_cast<int32_t>(static_cast<uint32_t>(packed >> 32));
  f.pending = static_cast<uint8_t>(fraction);
  const auto [lo, hi] = MagnitudeWindow(node, negative);
  if (hi == kUnbounded && digits * Pow10(node.scale_digits - fraction) >= lo) {
    // Digits only grow the magnitude from here: every continuation is within the one bound.
    f.lead |= kSettled;
    f.b = f.c = 0;
    f.pending = 0;
  }
  return true;
}

bool GrammarMatcher::NumberComplete(const Frame& f, const Node& node) {
  if (f.phase != kNumZero && f.phase != kNumInt && f.phase != kNumFrac &&
      f.phase != kNumExpDigits) {
    return false;
  }
  if ((!node.has_min && !node.has_max) || (f.lead & kSettled)) return true;
  const auto [lo, hi] = MagnitudeWindow(node, f.lead & kNegative);
  const Wide value = Wide(JoinHalves(f.b, f.c)) * Pow10(node.scale_digits - f.pending);
  return lo <= value && value <= hi;
}

GrammarMatcher::Step GrammarMatcher::FeedRegex(Frame& f, const Node& node, uint8_t byte) {
  // The automaton's state in c; a character's bits so far in b, its continuation bytes still
  // expected in pending, its lead byte in lead while the first is pending. Like a number, the
  // text ends at the first byte that cannot extend it, if it is a match by then.
  const RegexDfa& dfa = grammar_->regexes[node.regex];
  if (f.pending > 0) {
    const int64_t value = TakeContinuation(f, byte, &dfa, -1);
    if (value == kCharRefused) return kReject;
    if (value == kCharPending) return kConsumed;
    const int32_t next = dfa.Next(f.c, static_cast<uint32_t>(value));
    if (next == RegexDfa::kNone) return kReject;
    f.c = next;
    return kConsumed;
  }
  const bool complete = dfa.Accepting(f.c);
  if (byte < 0x80) {
    const int32_t next = dfa.Next(f.c, byte);
    if (next == RegexDfa::kNone) return complete ? kPopAndRefeed : kReject;
    f.c = next;
    return kConsumed;
  }
  if (!TakeLead(f, byte, &dfa, -1)) return complete ? kPopAndRefeed : kReject;
  return kConsumed;
}

bool GrammarMatcher::TakeLead(Frame& f, uint8_t byte, const RegexDfa* dfa, int32_t budget) {
  int extra = 0;
  uint32_t payload = 0;
  if (!Utf8Lead(byte, extra, payload)) return false;
  const auto [lo, hi] = Utf8Range(payload, extra, extra);
  if (dfa != nullptr && !dfa->AnyNext(f.c, lo, hi, budget)) return false;
  f.pending = static_cast<uint8_t>(extra);
  f.lead = byte;
  f.b = static_cast<int32_t>(payload);
  return true;
}

int64_t GrammarMatcher::TakeContinuation(Frame& f, uint8_t byte, const RegexDfa* dfa,
                                         int32_t budget) {
  if (!Utf8ContinuationOk(f.lead, byte)) return kCharRefused;
  f.lead = 0;
  const uint32_t value = (static_cast<uint32_t>(f.b) << 6) | (byte & 0x3F);
  f.b = static_cast<int32_t>(value);
  if (--f.pending > 0) {
    const auto [lo, hi] = Utf8Range(value, f.pending, 0);
    return dfa == nullptr || dfa->AnyNext(f.c, lo, hi, budget) ? kCharPending : kCharRefused;
  }
  f.b = 0;
  return value;
}

GrammarMatcher::Step GrammarMatcher::FeedRepeat(Frame& f, const Node& node, uint8_t byte) {
  if (f.phase != kRepAfter) return kReject;
  const std::string& separator = node.literals[0];
  const bool more = node.max_items < 0 || f.a < node.max_items;
  if (static_cast<size_t>(f.c) < separator.size()) {
    if (more && static_cast<uint8_t>(separator[f.c]) == byte) {
      ++f.c;
      return kConsumed;
    }
    // Not another item: the repeat ends here if it has enough, and the byte is the next
    // frame's.
    return f.c == 0 && f.a >= node.min_items ? kPopAndRefeed : kReject;
  }
  if (!Push(node.items, byte)) {
    return f.a >= node.min_items && TrailingSeparator(f, node) ? kPopAndRefeed : kReject;
  }
  f.phase = kRepItem;  // (f is the frame below the item's now)
  return kConsumed;
}

bool GrammarMatcher::TrailingSeparator(const Frame& f, const Node& node) {
  const std::string& separator = node.literals[0];
  if (static_cast<size_t>(f.c) != separator.size()) return false;
  for (char c : separator) {
    if (!IsWhitespace(static_cast<uint8_t>(c))) return false;
  }
  return true;
}

GrammarMatcher::Step GrammarMatcher::FeedUntil(Frame& f, const Node& node, uint8_t byte) {
  const std::string& end = node.literals[0];
  if (f.phase == kUntilSpace) {
    // After the marker: whitespace, then the next part takes the first other byte.
    return TakeWhitespace(f.ws, byte) ? kConsumed : kPopAndRefeed;
  }
  // a: how much of the marker the text ends with. On a mismatch, the longest marker prefix that
  // is a suffix of what was matched plus this byte (the marker is short: tried directly).
  size_t matched = static_cast<size_t>(f.a);
  while (true) {
    if (static_cast<uint8_t>(end[matched]) == byte) {
      ++matched;
      break;
    }
    if (matched == 0) break;
    // The next shorter prefix of the marker that is also a suffix of its first `matched` bytes.
    size_t k = matched - 1;
    while (k > 0 && end.compare(0, k, end, matched - k, k) != 0) --k;
    matched = k;
  }
  f.a = static_cast<int32_t>(matched);
  if (matched == end.size()) {
    f.phase = kUntilSpace;
    f.a = 0;
    f.ws = 0;
  }
  return kConsumed;
}

int32_t GrammarMatcher::CompletedLiteral(const Frame& f, const Node& node) const {
  const std::string& current = node.literals[f.b];
  for (size_t i = static_cast<size_t>(f.b); i < node.literals.size(); ++i) {
    const std::string& l = node.literals[i];
    if (l.size() == static_cast<size_t>(f.a) && l.compare(0, f.a, current, 0, f.a) == 0) {
      return static_cast<int32_t>(i);
    }
  }
  return -1;
}

GrammarMatcher::Step GrammarMatcher::FeedLiteral(Frame& f, const Node& node, uint8_t byte) {
  const std::string& current = node.literals[f.b];
  for (size_t i = static_cast<size_t>(f.b); i < node.literals.size(); ++i) {
    const std::string& l = node.literals[i];
    if (l.size() > static_cast<size_t>(f.a) && static_cast<uint8_t>(l[f.a]) == byte &&
        l.compare(0, f.a, current, 0, f.a) == 0) {
      f.b = static_cast<int32_t>(i);
      ++f.a;
      return kConsumed;
    }
  }
  return CompletedLiteral(f, node) >= 0 ? kPopAndRefeed : kReject;
}

bool GrammarMatcher::ValueCompleteWithoutBytes(const Frame& f) const {
  const Node& node = grammar_->nodes[f.node];
  if (node.kind == NodeKind::kLiterals) return CompletedLiteral(f, node) >= 0;
  if (node.kind == NodeKind::kNumber || node.kind == NodeKind::kInteger) {
    return NumberComplete(f, node);
  }
  if (node.kind == NodeKind::kRegex) {
    return f.pending == 0 && grammar_->regexes[node.regex].Accepting(f.c);
  }
  if (node.kind == NodeKind::kRepeat) {
    return f.phase == kRepAfter && f.a >= node.min_items &&
           (f.c == 0 || TrailingSeparator(f, node));
  }
  return false;
}

bool GrammarMatcher::InPlainStringBody(int horizon) const {
  const Frame& f = frames_[size_ - 1];
  if (f.node < 0) return false;
  const Node& node = grammar_->nodes[f.node];
  return node.kind == NodeKind::kString && f.phase == kStrBody && node.regex < 0 &&
         (node.max_length < 0 || node.max_length - f.a > horizon);
}

bool GrammarMatcher::Accepting() const {
  if (size_ == 1) return frames_[0].phase == kRootDone;
  // A value completes without a byte of its own only as a number, literal, regex text or
  // repeat that can end here, directly under the root or as the last part of sequences (or an
  // item of a repeat that has enough with it) directly under it.
  if (!ValueCompleteWithoutBytes(frames_[size_ - 1])) return false;
  for (int i = size_ - 2; i >= 1; --i) {
    const Frame& f = frames_[i];
    const Node& node = grammar_->nodes[f.node];
    const bool last_part = node.kind == NodeKind::kSequence &&
                           static_cast<size_t>(f.a) + 1 == node.alternatives.size();
    const bool enough_items =
        node.kind == NodeKind::kRepeat && f.phase == kRepItem && f.a + 1 >= node.min_items;
    if (!last_part && !enough_items) return false;
  }
  return true;
}

bool GrammarMatcher::Finished() const {
  if (!Accepting()) return false;
  GrammarMatcher probe(*grammar_);
  for (int b = 0; b < 256; ++b) {
    probe.CopyFrom(*this);
    if (probe.Feed(static_cast<uint8_t>(b))) return false;
  }
  return true;
}

}  // namespace mobius::grammar
