// The compiled form of a structured-output constraint (a JSON schema, "any JSON object", or a
// choice among fixed strings): a small graph of value kinds that GrammarMatcher walks byte by
// byte. Every alternative is decided by the first byte of a value, so the matcher never
// backtracks and its state is a stack of frames.
#ifndef MOBIUS_GRAMMAR_GRAMMAR_H_
#define MOBIUS_GRAMMAR_GRAMMAR_H_

#include <bitset>
#include <cstdint>
#include <string>
#include <vector>

#include "grammar/regex.h"

namespace mobius::grammar {

enum class NodeKind : uint8_t {
  kObject,    // declared properties in order, or free-form keys when none are declared
  kArray,     // items of one node
  kString,    // a JSON string, with optional length limits (in code points)
  kNumber,    // a JSON number
  kInteger,   // a JSON number without fraction or exponent
  kLiterals,  // exactly one of a fixed set of texts (enum, const, true/false, null, choices)
  kUnion,     // one of several nodes, told apart by their first byte
  kSequence,  // several nodes one after another, with nothing between them
  kUntil,     // free text up to and including literals[0], then whitespace (a reasoning block)
  // Objects told apart by the value of their shared first property (a discriminator such as
  // {"type": "circle", ...} | {"type": "square", ...}): one frame reads that property, then
  // becomes the object its value names.
  kObjectSwitch,
  kRegex,  // raw text (UTF-8) that the automaton regexes[regex] takes whole (guided_regex)
  // min_items to max_items (-1: no limit) values of `items`, literals[0] (not empty) between
  // them: several tool-call blocks.
  kRepeat,
};

struct Property {
  std::string key;  // as it appears in the output: the quoted, escaped JSON string
  int32_t value = -1;
  bool required = false;
};

// (Any JSON value is a union of an object, an array, a string, a number and the literals true,
// false and null, whose containers hold any values again: AddAnyValue.)
struct Node {
  Node() = default;
  explicit Node(NodeKind k) : kind(k) {}
  NodeKind kind = NodeKind::kLiterals;
  // kObject: declared properties, emitted in this order (optional ones may be left out). With
  // none declared the object is free-form: any string keys, values of `additional`.
  std::vector<Property> properties;
  int32_t additional = -1;
  // kArray, kRepeat
  int32_t items = -1;
  int32_t min_items = 0;
  int32_t max_items = -1;  // -1: no limit
  // kNumber / kInteger with minimum / maximum: the value times 10^scale_digits (0 for
  // integers, kBoundedFractionDigits for numbers) lies in [min_scaled, max_scaled], where each
  // side applies only if has_min / has_max. Bounded numbers are plain decimals: no exponent,
  // at most scale_digits digits after the point.
  bool has_min = false;
  bool has_max = false;
  int64_t min_scaled = 0;
  int64_t max_scaled = 0;
  int32_t scale_digits = 0;
  // kString
  int32_t min_length = 0;
  int32_t max_length = -1;  // -1: no limit
  // kString with a pattern: index into Grammar::regexes of the automaton its characters
  // (unescaped code points) must follow. A minLength is folded into it (min_length is then 0);
  // max_length stays here, checked against the automaton's distances to a match. kRegex: the
  // automaton of the whole text.
  int32_t regex = -1;
  // kLiterals: texts in output form (JSON texts, or raw strings for choices).
  std::vector<std::string> literals;
  // kUnion: alternatives whose first bytes are disjoint. kSequence: its parts, in order.
  // kObjectSwitch: the objects switched among.
  std::vector<int32_t> alternatives;
  // kObjectSwitch: properties[0] is the shared first property, required, whose value is a
  // kLiterals node of every object's allowed values; cases[i] is the object its literal i selects.
  std::vector<int32_t> cases;
};

// Limits that keep every output finite and every matcher state small.
inline constexpr int kMaxNestingDepth = 24;   // frames on the matcher's stack
inline constexpr int kMaxWhitespaceRun = 24;  // whitespace bytes in a row between tokens
inline constexpr int kMaxNumberLength = 32;   // bytes of one number
// Digits after the point of a number under minimum / maximum: the bounds are compared exactly on
// that grid (and the value's magnitude kept below 10^18 of its units while it matters).
inline constexpr int kBoundedFractionDigits = 6;

struct Grammar {
  std::vector<Node> nodes;
  int32_t root = -1;
  // Node index of a plain JSON string (the keys of free-form objects).
  int32_t string_node = -1;
  // Node index of "any JSON value" once AddAnyValue made it; -1 before.
  int32_t any_value = -1;
  // Per node: the bytes a value of it can start with, and the matcher frames its shortest
  // complete value needs (filled by the compilers; the matcher never starts a value it could not
  // finish within kMaxNestingDepth).
  std::vector<std::bitset<256>> first_bytes;
  std::vector<int32_t> min_depth;
  // The automata of string patterns and regex nodes (Node::regex).
  std::vector<RegexDfa> regexes;
};

// Adds the nodes of "any JSON value" (once per grammar: later calls return the same node).
int32_t AddAnyValue(Grammar& grammar);

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_GRAMMAR_H_
