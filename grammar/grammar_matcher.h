// Walks a Grammar one output byte at a time: a pushdown automaton whose stack holds one frame
// per open value (object, array, string, number, literal) under a root frame. Each byte either
// extends the text (true) or cannot follow it (false). The state is a few dozen bytes, copied
// cheaply, which is what checking every vocabulary token against it needs (TokenMaskComputer).
#ifndef MOBIUS_GRAMMAR_GRAMMAR_MATCHER_H_
#define MOBIUS_GRAMMAR_GRAMMAR_MATCHER_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "grammar/grammar.h"

namespace mobius::grammar {

class GrammarMatcher {
 public:
  // The state before any output; `grammar` must outlive the matcher.
  explicit GrammarMatcher(const Grammar& grammar);

  // Consumes one byte. On false the byte cannot follow the text so far and the matcher's state
  // is left undefined: callers that probe keep a copy (CopyFrom).
  bool Feed(uint8_t byte);
  // Feed over every byte; false at the first that cannot follow.
  bool FeedBytes(std::string_view bytes);
  // Whether the text ends inside a string's characters (no escape or UTF-8 sequence pending)
  // with room for more than `horizon` further characters: every plain character run of up to
  // `horizon` bytes is accepted there and leaves the stack as it is (TokenVocabulary's shortcut).
  [[nodiscard]] bool InPlainStringBody(int horizon) const;
  // Whether the text so far is a complete value (generation may end here).
  [[nodiscard]] bool Accepting() const;
  // Whether the text is complete and no byte can follow (generation must end here).
  [[nodiscard]] bool Finished() const;
  // This matcher becomes a copy of `other` (same grammar), copying only the live frames.
  void CopyFrom(const GrammarMatcher& other);
  // Appends a byte string that identifies the state as far as texts of at most `horizon` bytes
  // can tell (equal keys: the same texts of that length are accepted): the key of the token-mask
  // cache, with the vocabulary's longest token as the horizon. Counters (a string's characters,
  // an array's items) enter as their distances to the node's limits, capped past the horizon, so
  // that a long string under maxLength keeps one key until its last few characters.
  void AppendStateKey(std::string& key, int horizon) const;

 private:
  // One open value. Fields are plain 32-bit and 8-bit integers, so the live frames can be
  // compared and hashed as bytes.
  struct Frame {
    int32_t node = -1;  // grammar node; -1 for the root frame
    int32_t a = 0;      // object: next property; array: items; string: code points; number:
                        // bytes; literal: matched bytes
    int32_t b = 0;      // object: current property; literal: candidate; bounded number: its
                        // digits as an integer (low half)
    int32_t c = 0;      // object: matched bytes of a declared key; bounded number: high half
    uint8_t phase = 0;
    uint8_t ws = 0;       // whitespace bytes in a row
    uint8_t pending = 0;  // UTF-8 continuation bytes, or \u hex digits, still expected; bounded
                          // number: digits after the point
    uint8_t lead = 0;     // UTF-8 lead byte while its first continuation byte is pending;
                          // bounded number: kNegative | kSettled
  };
  static_assert(sizeof(Frame) == 20);

  enum Step { kReject, kConsumed, kPopAndRefeed };

  bool Push(int32_t node, uint8_t byte);  // a value of `node` starting with `byte`
  Step FeedFrame(Frame& f, uint8_t byte);
  Step FeedObject(Frame& f, const Node& node, uint8_t byte);
  Step FeedArray(Frame& f, const Node& node, uint8_t byte);
  Step FeedString(Frame& f, const Node& node, uint8_t byte);
  Step FeedNumber(Frame& f, const Node& node, uint8_t byte);
  // Numbers under minimum / maximum keep their value in the frame. A number's first byte
  // (BoundedStart) or next byte, leading to `phase` (BoundedStep), is taken only if some value
  // within the bounds can still be completed; false otherwise, with `f` unchanged.
  static bool BoundedStart(Frame& f, const Node& node, uint8_t byte);
  static bool BoundedStep(Frame& f, const Node& node, uint8_t phase, uint8_t byte);
  // Whether the number's text so far is a whole number (within its bounds, if it has any).
  [[nodiscard]] static bool NumberComplete(const Frame& f, const Node& node);
  Step FeedLiteral(Frame& f, const Node& node, uint8_t byte);
  Step FeedUntil(Frame& f, const Node& node, uint8_t byte);
  Step FeedRegex(Frame& f, const Node& node, uint8_t byte);
  Step FeedRepeat(Frame& f, const Node& node, uint8_t byte);
  // Whether a repeat's frame has just taken a whole separator of white space: the output may
  // end there too (a model that writes a newline after its last tool call, then stops, is not
  // forced into another call).
  static bool TrailingSeparator(const Frame& f, const Node& node);
  // Takes a UTF-8 continuation byte of the character pending in `f` (its bits in b, the bytes
  // still expected in pending, its lead byte in lead while the first is pending): the whole
  // character's code point once complete, kCharPending while bytes remain, kCharRefused when
  // the byte cannot continue it or, under `dfa` (its state in c), no character it can still
  // become has a transition (to a state at most `budget` characters from a match, if >= 0).
  // Starts a character of two or more bytes at lead byte `byte` (its count in pending, its bits
  // in b): false for a byte that cannot lead one or, under `dfa`, when no character it can
  // begin has a transition (within `budget` as above).
  static bool TakeLead(Frame& f, uint8_t byte, const RegexDfa* dfa, int32_t budget);
  static constexpr int64_t kCharPending = -1;
  static constexpr int64_t kCharRefused = -2;
  static int64_t TakeContinuation(Frame& f, uint8_t byte, const RegexDfa* dfa, int32_t budget);
  // The top frame's value ends with this byte: popped, and the frame below advances.
  Step CloseTop();
  // After an object's member or an array's item: whitespace, ',' when `more` may follow (then
  // `next_phase`), or `close` when the container `can_close`.
  Step AfterMember(Frame& f, uint8_t byte, bool more, uint8_t next_phase, char close,
                   bool can_close);
  // After the top frame's value completed and was popped: the frame below advances.
  void ChildDone();
  // The literal a literal frame's text is, whole; -1 while it is only a prefix of one.
  [[nodiscard]] int32_t CompletedLiteral(const Frame& f, const Node& node) const;
  [[nodiscard]] bool ValueCompleteWithoutBytes(const Frame& f) const;

  const Grammar* grammar_;
  uint8_t size_ = 0;
  std::array<Frame, kMaxNestingDepth + 1> frames_{};
};

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_GRAMMAR_MATCHER_H_
