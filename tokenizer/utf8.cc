#include "tokenizer/utf8.h"

namespace mobius::tokenizer {
namespace {

// Range of the second byte allowed after each lead byte (Unicode Table 3-7); the ranges exclude
// overlong forms, surrogates and code points above U+10FFFF.
struct LeadInfo {
  int length;  // 0 when the byte cannot start a character.
  uint8_t second_min;
  uint8_t second_max;
};

LeadInfo GetLeadInfo(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

}  // namespace

Utf8Step DecodeUtf8Step(std::string_view text, size_t pos) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  const uint8_t lead = p[pos];
  const LeadInfo info = GetLeadInfo(lead);
  if (info.length == 1) return {Utf8Step::Kind::kValid, 1, lead};
  if (info.length == 0) return {Utf8Step::Kind::kIllFormed, 1, 0};
  char32_t cp = lead & (0x7F >> info.length);
  for (int i = 1; i < info.length; ++i) {
    if (pos + i >= n) return {Utf8Step::Kind::kIncomplete, static_cast<size_t>(i), 0};
    const uint8_t b = p[pos + i];
    const uint8_t lo = i == 1 ? info.second_min : 0x80;
    const uint8_t hi = i == 1 ? info.second_max : 0xBF;
    if (b < lo || b > hi) return {Utf8Step::Kind::kIllFormed, static_cast<size_t>(i), 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {Utf8Step::Kind::kValid, static_cast<size_t>(info.length), cp};
}

bool IsValidUtf8(std::string_view text) {
  size_t pos = 0;
  const size_t n = text.size();
  while (pos < n) {
    // ASCII dominates real prompts; skip it eight bytes at a time.
    while (pos + 8 <= n) {
      uint64_t word;
      __builtin_memcpy(&word, text.data() + pos, 8);
      if (word & 0x8080808080808080ULL) break;
      pos += 8;
    }
    if (pos >= n) break;
    const Utf8Step step = DecodeUtf8Step(text, pos);
    if (step.kind != Utf8Step::Kind::kValid) return false;
    pos += step.length;
  }
  return true;
}

std::string ReplaceInvalidUtf8(std::string_view text) {
  if (IsValidUtf8(text)) return std::string(text);
  std::string out;
  out.reserve(text.size() + 16);
  size_t pos = 0;
  while (pos < text.size()) {
    const Utf8Step step = DecodeUtf8Step(text, pos);
    if (step.kind == Utf8Step::Kind::kValid) {
      out.append(text.substr(pos, step.length));
    } else {
      AppendUtf8(kReplacementCharacter, out);
    }
    pos += step.length;
  }
  return out;
}

size_t StableUtf8PrefixLength(std::string_view text) {
  // A byte >= 0xC0 always starts a new unit of the lossy decoding (a continuation byte is never
  // >= 0xC0), so only the last such byte within a character's length of the end can open an
  // unfinished character.
  const size_t n = text.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t pos = n - back;
    const auto byte = static_cast<uint8_t>(text[pos]);
    if ((byte & 0xC0) == 0x80) continue;
    if (DecodeUtf8Step(text, pos).kind == Utf8Step::Kind::kIncomplete) return pos;
    break;
  }
  return n;
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsUnicodeWhitespace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

}  // namespace mobius::tokenizer
