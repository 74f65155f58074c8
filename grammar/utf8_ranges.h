// UTF-8 one byte at a time, as the grammar walks it: which code points a partial character can
// still become, so that a byte is taken only if one of them is allowed. (Whole-text decoding is
// tokenizer/utf8.h's.)
#ifndef MOBIUS_GRAMMAR_UTF8_RANGES_H_
#define MOBIUS_GRAMMAR_UTF8_RANGES_H_

#include <algorithm>
#include <cstdint>
#include <utility>

#include "grammar/regex.h"

namespace mobius::grammar {

// A UTF-8 lead byte: how many continuation bytes follow and its payload bits; false for a byte
// that cannot start a character of two or more bytes.
inline bool Utf8Lead(uint8_t byte, int& extra, uint32_t& payload) {
  if (byte >= 0xC2 && byte <= 0xDF) {
    extra = 1;
    payload = byte & 0x1F;
  } else if (byte >= 0xE0 && byte <= 0xEF) {
    extra = 2;
    payload = byte & 0x0F;
  } else if (byte >= 0xF0 && byte <= 0xF4) {
    extra = 3;
    payload = byte & 0x07;
  } else {
    return false;
  }
  return true;
}

// The code points a character can still become: `value` holds its bits so far, `pending`
// continuation bytes (6 bits each) still to come; `extra` is its whole count of them (for the
// least code point each length may encode: no overlong forms).
inline std::pair<uint32_t, uint32_t> Utf8Range(uint32_t value, int pending, int extra) {
  constexpr uint32_t kLeast[] = {0, 0x80, 0x800, 0x10000};
  const int shift = 6 * pending;
  return {std::max(value << shift, kLeast[extra]),
          std::min(((value + 1) << shift) - 1, kMaxCodePoint)};
}

// Whether `byte` may follow as the next continuation byte; `lead` is the lead byte while the
// first one is pending (some leads narrow it: no overlong forms, no surrogates, nothing past
// U+10FFFF), 0 after.
inline bool Utf8ContinuationOk(uint8_t lead, uint8_t byte) {
  uint8_t lo = 0x80, hi = 0xBF;
  if (lead == 0xE0) lo = 0xA0;
  if (lead == 0xED) hi = 0x9F;
  if (lead == 0xF0) lo = 0x90;
  if (lead == 0xF4) hi = 0x8F;
  return byte >= lo && byte <= hi;
}

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_UTF8_RANGES_H_
