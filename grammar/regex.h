// Regular expressions as structured output takes them: JSON Schema's "pattern" (ECMA-262
// syntax, matched anywhere in the string unless anchored by ^ / $) and whole-text expressions.
// They are compiled to a DFA over Unicode code points in which every state can still reach a
// match, so a matcher that only takes characters with a transition never reaches a dead end.
//
// The syntax: literals; escapes \d \D \w \W \s \S \t \n \r \f \v \0 \xHH \uHHHH and escaped
// punctuation; '.' (any character but a line break); classes [...] with ranges, negation and
// the class escapes; groups (...), (?:...), (?<name>...), (?P<name>...); alternation |;
// quantifiers * + ? {n} {n,} {n,m} (lazy forms match the same texts); ^ at the start and $ at
// the end of a top-level alternative. Refused by name: backreferences, lookaround, \b / \B,
// inline flags, anchors elsewhere.
#ifndef MOBIUS_GRAMMAR_REGEX_H_
#define MOBIUS_GRAMMAR_REGEX_H_

#include <bitset>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::grammar {

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

class RegexDfa {
 public:
  static constexpr int32_t kNone = -1;

  [[nodiscard]] int32_t start() const { return 0; }
  // The state after `code_point`, or kNone when no match continues with it.
  [[nodiscard]] int32_t Next(int32_t state, uint32_t code_point) const;
  // Whether some code point in [lo, hi] continues a match from `state`; with `budget` >= 0, to a
  // state from which a match is at most `budget` characters away.
  [[nodiscard]] bool AnyNext(int32_t state, uint32_t lo, uint32_t hi, int32_t budget = -1) const;
  // The fewest characters from `state` to a match, and the most that takes from any state.
  [[nodiscard]] int32_t DistanceToMatch(int32_t state) const { return distance_[state]; }
  [[nodiscard]] int32_t max_distance() const { return max_distance_; }
  // Whether the text up to `state` is a match.
  [[nodiscard]] bool Accepting(int32_t state) const { return accepting_[state] != 0; }
  [[nodiscard]] size_t num_states() const { return accepting_.size(); }
  // The bytes that begin, in UTF-8, a character with a transition from the start.
  [[nodiscard]] std::bitset<256> FirstBytes() const;
  // Entries of the transition table (states x classes): the automaton's size.
  [[nodiscard]] size_t table_size() const { return next_.size(); }

  // The same language restricted to texts of [min_length, max_length] code points
  // (max_length -1: no upper limit). InvalidArgument when the product grows too large.
  [[nodiscard]] absl::StatusOr<RegexDfa> WithLength(int32_t min_length, int32_t max_length) const;

 private:
  friend class RegexDfaBuilder;
  [[nodiscard]] size_t IntervalOf(uint32_t code_point) const;
  // Drops the states from which no match can be reached (their transitions become kNone) and
  // renumbers the rest from the start; false when the start itself cannot reach a match.
  bool Prune();

  // The code points in intervals that no set of the pattern splits: interval i is
  // [interval_starts_[i], interval_starts_[i + 1]), the last up to kMaxCodePoint. Intervals that
  // every set holds alike share a class (interval_class_), and every code point of a class
  // moves every state alike.
  std::vector<uint32_t> interval_starts_;
  std::vector<int32_t> interval_class_;
  size_t classes_ = 0;
  std::vector<int32_t> next_;  // [state * classes_ + class]
  std::vector<uint8_t> accepting_;
  std::vector<int32_t> distance_;  // per state: DistanceToMatch
  int32_t max_distance_ = 0;
};

// How a pattern relates to the text: the whole text matches it (kWhole), or JSON Schema's
// "pattern" (kSearch: some part matches, unless ^ / $ tie it to the start / end).
enum class RegexMode { kWhole, kSearch };

// InvalidArgument naming what is unsupported or malformed and where (the byte offset); the
// message names no field, for the caller to prefix.
absl::StatusOr<RegexDfa> CompileRegex(std::string_view pattern, RegexMode mode);

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_REGEX_H_
