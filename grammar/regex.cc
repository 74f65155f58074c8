#include "grammar/regex.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grammar/utf8_ranges.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace mobius::grammar {
namespace {

// Sizes that keep a hostile pattern from exhausting the worker: the automata grow with counted
// repetition ({1000}) and with the subset construction.
constexpr size_t kMaxPatternBytes = 4096;
constexpr int kMaxGroupDepth = 64;
constexpr size_t kMaxNfaStates = 50000;
constexpr size_t kMaxDfaStates = 4096;
constexpr size_t kMaxLengthProductStates = 100000;
// Transition-table entries of one automaton (states x classes: 16 MB), and the NFA states held
// by all subsets of the construction together.
constexpr size_t kMaxTableEntries = size_t{1} << 22;
constexpr size_t kMaxSubsetEntries = size_t{1} << 21;
constexpr int kMaxRepeat = 1000;

struct Range {
  uint32_t lo, hi;  // inclusive
};
using RangeSet = std::vector<Range>;  // sorted, disjoint, not adjacent

// Surrogate halves are not characters: no set holds them, so every transition is a code point
// that UTF-8 text or a JSON string can carry.
const RangeSet& Universe() {
  static const RangeSet kUniverse = {{0, 0xD7FF}, {0xE000, kMaxCodePoint}};
  return kUniverse;
}

RangeSet Normalize(RangeSet s) {
  std::sort(s.begin(), s.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
  RangeSet out;
  for (const Range& r : s) {
    if (!out.empty() && r.lo <= out.back().hi + 1) {
      out.back().hi = std::max(out.back().hi, r.hi);
    } else {
      out.push_back(r);
    }
  }
  // Within the universe only.
  RangeSet clipped;
  for (const Range& r : out) {
    for (const Range& u : Universe()) {
      const uint32_t lo = std::max(r.lo, u.lo), hi = std::min(r.hi, u.hi);
      if (lo <= hi) clipped.push_back({lo, hi});
    }
  }
  return clipped;
}

RangeSet Complement(const RangeSet& s) {
  RangeSet out;
  uint32_t next = 0;
  for (const Range& r : s) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return Normalize(out);
}

// The code points `class_body` (PCRE2 syntax, Unicode properties) matches, found once by
// running it over every code point in order.
RangeSet UnicodeSet(const char* class_body) {
  std::string subject;
  subject.reserve(4500000);
  for (const Range& r : Universe()) {
    for (uint32_t cp = r.lo; cp <= r.hi; ++cp) tokenizer::AppendUtf8(cp, subject);
  }
  absl::StatusOr<std::unique_ptr<tokenizer::Regex>> regex =
      tokenizer::Regex::Compile(absl::StrCat("[", class_body, "]+"));
  std::vector<std::pair<size_t, size_t>> matches;
  if (!regex.ok() || !(*regex)->FindAll(subject, matches).ok()) {
    // Fails closed (not expected: the class bodies are fixed): every non-ASCII character is a
    // member, so a complement keeps ASCII alone.
    return {{0x80, kMaxCodePoint}};
  }
  RangeSet out;
  for (const auto& [begin, end] : matches) {
    size_t last = end - 1;
    while ((static_cast<uint8_t>(subject[last]) & 0xC0) == 0x80) --last;
    out.push_back({static_cast<uint32_t>(tokenizer::DecodeUtf8Step(subject, begin).code_point),
                   static_cast<uint32_t>(tokenizer::DecodeUtf8Step(subject, last).code_point)});
  }
  return out;
}

// The class escapes. The pattern may be checked by an ECMA-262 validator (ASCII classes), by
// Python or Rust (Unicode classes) or by vLLM's Python: each class here is one every reading
// agrees on. \d and \w are ASCII (their narrowest reading); \D and \W exclude every Unicode
// digit / word character (the widest reading of \d / \w), so that no reading calls their output
// a digit or a word character. \s is ECMA-262's white space less U+FEFF (which Python and Rust
// do not count), \S excludes the white space of any reading.
const RangeSet& Digits() {
  static const RangeSet k = {{'0', '9'}};
  return k;
}
const RangeSet& NotDigits() {
  static const RangeSet k = Complement(Normalize(UnicodeSet("\\p{Nd}")));
  return k;
}
const RangeSet& WordChars() {
  static const RangeSet k = Normalize({{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}});
  return k;
}
const RangeSet& NotWordChars() {
  static const RangeSet k = Complement(Normalize([] {
    // (Alphabetic: Rust's \w holds symbols such as U+24B6 that are in no letter category.)
    RangeSet word = UnicodeSet("\\p{L}\\p{N}\\p{M}\\p{Pc}\\p{Alphabetic}");
    word.push_back({0x200C, 0x200D});  // Join_Control: Rust's \w holds it
    return word;
  }()));
  return k;
}
const RangeSet& Spaces() {
  static const RangeSet k = Normalize({{'\t', '\r'},
                                       {' ', ' '},
                                       {0xA0, 0xA0},
                                       {0x1680, 0x1680},
                                       {0x2000, 0x200A},
                                       {0x2028, 0x2029},
                                       {0x202F, 0x202F},
                                       {0x205F, 0x205F},
                                       {0x3000, 0x3000}});
  return k;
}
const RangeSet& NotSpaces() {
  static const RangeSet k = Complement(Normalize([] {
    RangeSet any_space = Spaces();
    any_space.push_back({0x1C, 0x1F});      // Python's \s
    any_space.push_back({0x85, 0x85});      // Python's and Rust's
    any_space.push_back({0xFEFF, 0xFEFF});  // ECMA-262's
    return any_space;
  }()));
  return k;
}
// '.': anything but a line terminator (ECMA-262's; Python's '.' excludes only \n).
const RangeSet& Dot() {
  static const RangeSet k = Complement(Normalize({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
  return k;
}

// The parsed expression.
struct Ast {
  enum Kind { kSet, kConcat, kAlt, kRepeat };
  Kind kind = kConcat;
  int set = -1;               // kSet: index into the parser's sets
  std::vector<int> children;  // kConcat, kAlt; kRepeat: one
  int min = 0, max = -1;      // kRepeat; max -1: no limit
};

class Parser {
 public:
  Parser(std::string_view pattern, RegexMode mode) : p_(pattern), mode_(mode) {}

  absl::StatusOr<int> Parse() {
    if (p_.size() > kMaxPatternBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("longer than ", kMaxPatternBytes, " bytes, the most supported"));
    }
    absl::StatusOr<int> root = ParseAlternation(/*top=*/true);
    if (!root.ok()) return root.status();
    if (pos_ < p_.size()) return Error("unmatched ')'");
    return *root;
  }

  std::vector<Ast>& nodes() { return nodes_; }
  std::vector<RangeSet>& sets() { return sets_; }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(what, " (at offset ", pos_, ")"));
  }

  int Add(Ast a) {
    nodes_.push_back(std::move(a));
    return static_cast<int>(nodes_.size() - 1);
  }
  int SetNode(RangeSet s) {
    sets_.push_back(std::move(s));
    Ast a;
    a.kind = Ast::kSet;
    a.set = static_cast<int>(sets_.size() - 1);
    return Add(std::move(a));
  }
  int AnyRun() {  // any text: what an unanchored side of a search pattern may hold
    Ast r;
    r.kind = Ast::kRepeat;
    r.children = {SetNode(Universe())};
    return Add(std::move(r));
  }

  bool AtEnd() const { return pos_ >= p_.size(); }
  char Peek(size_t ahead = 0) const { return pos_ + ahead < p_.size() ? p_[pos_ + ahead] : '\0'; }

  absl::StatusOr<int> ParseAlternation(bool top) {
    Ast alt;
    alt.kind = Ast::kAlt;
    while (true) {
      absl::StatusOr<int> branch = ParseBranch(top);
      if (!branch.ok()) return branch.status();
      alt.children.push_back(*branch);
      if (Peek() != '|' || AtEnd()) break;
      ++pos_;
    }
    if (alt.children.size() == 1) return alt.children[0];
    return Add(std::move(alt));
  }

  // A sequence up to '|', ')' or the end. At the top level it may start with ^ and end with $;
  // in search mode a side without its anchor may hold any text.
  absl::StatusOr<int> ParseBranch(bool top) {
    Ast seq;
    seq.kind = Ast::kConcat;
    bool anchored_start = false, anchored_end = false;
    if (top && Peek() == '^' && !AtEnd()) {
      anchored_start = true;
      ++pos_;
    }
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (Peek() == '^') return Error("^ is supported only at the start of the pattern");
      if (Peek() == '$') {
        if (top && (pos_ + 1 == p_.size() || p_[pos_ + 1] == '|')) {
          anchored_end = true;
          ++pos_;
          break;
        }
        return Error("$ is supported only at the end of the pattern");
      }
      absl::StatusOr<int> atom = ParseQuantified();
      if (!atom.ok()) return atom.status();
      seq.children.push_back(*atom);
    }
    if (top && mode_ == RegexMode::kSearch) {
      if (!anchored_start) seq.children.insert(seq.children.begin(), AnyRun());
      if (!anchored_end) seq.children.push_back(AnyRun());
    }
    return Add(std::move(seq));
  }

  absl::StatusOr<int> ParseQuantified() {
    absl::StatusOr<int> atom = ParseAtom();
    if (!atom.ok()) return atom.status();
    int min = 0, max = -1;
    if (Peek() == '*') {
      ++pos_;
    } else if (Peek() == '+') {
      min = 1;
      ++pos_;
    } else if (Peek() == '?') {
      max = 1;
      ++pos_;
    } else if (Peek() == '{' && AmbiguousCount()) {
      return Error("{,n} is a quantifier in some readings and text in others; write {0,n}");
    } else if (Peek() == '{' && ReadCount(min, max)) {
      if (min > kMaxRepeat || max > kMaxRepeat) {
        return Error(absl::StrCat("repetition counts above ", kMaxRepeat, " are not supported"));
      }
      if (max >= 0 && max < min) return Error("repetition {n,m} with m below n");
    } else {
      return *atom;
    }
    if (Peek() == '?') ++pos_;  // lazy: the same texts match
    if (Peek() == '*' || Peek() == '+' || Peek() == '?' || (Peek() == '{' && IsCount())) {
      return Error("a quantifier cannot follow another");
    }
    Ast r;
    r.kind = Ast::kRepeat;
    r.children = {*atom};
    r.min = min;
    r.max = max;
    return Add(std::move(r));
  }

  // {n}, {n,}, {n,m} at pos_: consumed and true; anything else is left (a literal '{').
  bool IsCount() const {
    int min = 0, max = 0;
    size_t pos = pos_;
    return ScanCount(pos, min, max);
  }
  bool ReadCount(int& min, int& max) { return ScanCount(pos_, min, max); }
  // "{,n}": a quantifier to Python, literal text to ECMA-262.
  bool AmbiguousCount() const {
    size_t i = pos_ + 1;
    if (i >= p_.size() || p_[i] != ',') return false;
    for (++i; i < p_.size() && p_[i] >= '0' && p_[i] <= '9'; ++i) {
    }
    return i < p_.size() && p_[i] == '}' && i > pos_ + 2;
  }
  bool ScanCount(size_t& pos, int& min, int& max) const {
    size_t i = pos + 1;
    auto number = [&](int& out) {
      const size_t begin = i;
      long long v = 0;
      while (i < p_.size() && p_[i] >= '0' && p_[i] <= '9') {
        v = std::min<long long>(v * 10 + (p_[i] - '0'), 1 << 30);
        ++i;
      }
      out = static_cast<int>(v);
      return i > begin;
    };
    if (!number(min)) return false;
    max = min;
    if (i < p_.size() && p_[i] == ',') {
      ++i;
      if (!number(max)) max = -1;
    }
    if (i >= p_.size() || p_[i] != '}') return false;
    pos = i + 1;
    return true;
  }

  absl::StatusOr<int> ParseAtom() {
    const char c = Peek();
    if (c == '*' || c == '+' || c == '?' || (c == '{' && IsCount())) {
      return Error("nothing to repeat");
    }
    if (c == '(') return ParseGroup();
    if (c == '[') return ParseClass();
    if (c == '.') {
      ++pos_;
      return SetNode(Dot());
    }
    if (c == '\\') {
      absl::StatusOr<RangeSet> set = ParseEscape(/*in_class=*/false);
      if (!set.ok()) return set.status();
      return SetNode(*std::move(set));
    }
    absl::StatusOr<uint32_t> cp = ReadUtf8();
    if (!cp.ok()) return cp.status();
    return SetNode(Normalize({{*cp, *cp}}));
  }

  absl::StatusOr<int> ParseGroup() {
    // (Errors about the group's kind point at its '('.)
    if (Peek(1) == '?') {
      if (Peek(2) == ':') {
        pos_ += 3;
      } else if (Peek(2) == '=' || Peek(2) == '!' ||
                 (Peek(2) == '<' && (Peek(3) == '=' || Peek(3) == '!'))) {
        return Error("lookaround assertions are not supported");
      } else if (Peek(2) == '<' || (Peek(2) == 'P' && Peek(3) == '<')) {
        const size_t close = p_.find('>', pos_);
        if (close == std::string_view::npos) return Error("unterminated group name");
        pos_ = close + 1;
      } else {
        return Error("inline flags and other (? groups are not supported");
      }
    } else {
      ++pos_;
    }
    if (++depth_ > kMaxGroupDepth) {
      return Error(absl::StrCat("groups nested deeper than ", kMaxGroupDepth, " levels"));
    }
    absl::StatusOr<int> inner = ParseAlternation(/*top=*/false);
    if (!inner.ok()) return inner.status();
    if (Peek() != ')' || AtEnd()) return Error("missing ')'");
    ++pos_;
    --depth_;
    return *inner;
  }

  absl::StatusOr<int> ParseClass() {
    ++pos_;  // '['
    bool negate = false;
    if (Peek() == '^') {
      negate = true;
      ++pos_;
    }
    RangeSet set;
    while (true) {
      if (AtEnd()) return Error("missing ']'");
      if (Peek() == ']') {
        ++pos_;
        break;
      }
      absl::StatusOr<RangeSet> first = ClassAtom();
      if (!first.ok()) return first.status();
      if (Peek() == '-' && Peek(1) != ']' && pos_ + 1 < p_.size()) {
        ++pos_;
        absl::StatusOr<RangeSet> last = ClassAtom();
        if (!last.ok()) return last.status();
        const bool single = first->size() == 1 && (*first)[0].lo == (*first)[0].hi &&
                            last->size() == 1 && (*last)[0].lo == (*last)[0].hi;
        if (!single) return Error("a class range needs single characters at both ends");
        if ((*last)[0].lo < (*first)[0].lo) return Error("a class range out of order");
        set.push_back({(*first)[0].lo, (*last)[0].lo});
        continue;
      }
      set.insert(set.end(), first->begin(), first->end());
    }
    RangeSet normal = Normalize(std::move(set));
    return SetNode(negate ? Complement(normal) : normal);
  }

  absl::StatusOr<RangeSet> ClassAtom() {
    if (Peek() == '\\') return ParseEscape(/*in_class=*/true);
    absl::StatusOr<uint32_t> cp = ReadUtf8();
    if (!cp.ok()) return cp.status();
    return RangeSet{{*cp, *cp}};
  }

  absl::StatusOr<uint32_t> Hex(int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char h = Peek();
      int d = -1;
      if (h >= '0' && h <= '9') d = h - '0';
      if (h >= 'a' && h <= 'f') d = h - 'a' + 10;
      if (h >= 'A' && h <= 'F') d = h - 'A' + 10;
      if (d < 0 || AtEnd()) return Error("malformed hex escape");
      v = v * 16 + static_cast<uint32_t>(d);
      ++pos_;
    }
    return v;
  }

  absl::StatusOr<RangeSet> ParseEscape(bool in_class) {
    const size_t start = pos_;  // errors point at the backslash
    ++pos_;
    if (AtEnd()) return Error("a pattern cannot end with a backslash");
    const char c = p_[pos_++];
    auto one = [](uint32_t cp) { return RangeSet{{cp, cp}}; };
    switch (c) {
      case 'd':
        return Digits();
      case 'D':
        return NotDigits();
      case 'w':
        return WordChars();
      case 'W':
        return NotWordChars();
      case 's':
        return Spaces();
      case 'S':
        return NotSpaces();
      case 't':
        return one('\t');
      case 'n':
        return one('\n');
      case 'r':
        return one('\r');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case '0':
        if (Peek() >= '0' && Peek() <= '9') {
          pos_ = start;  // an octal escape in some readings, NUL and a digit in others
          return Error("\\0 followed by a digit is ambiguous (octal); write \\x00 or \\x01...");
        }
        return one(0);
      case 'b':
        if (in_class) return one('\b');
        pos_ = start;
        return Error("word boundaries (\\b) are not supported");
      case 'B':
        pos_ = start;
        return Error("word boundaries (\\B) are not supported");
      case 'x': {
        absl::StatusOr<uint32_t> v = Hex(2);
        if (!v.ok()) return v.status();
        return one(*v);
      }
      case 'u': {
        absl::StatusOr<uint32_t> v = Hex(4);
        if (!v.ok()) return v.status();
        if (*v >= 0xD800 && *v <= 0xDBFF && Peek() == '\\' && Peek(1) == 'u') {
          pos_ += 2;
          absl::StatusOr<uint32_t> low = Hex(4);
          if (!low.ok()) return low.status();
          if (*low < 0xDC00 || *low > 0xDFFF) return Error("a high surrogate without its low half");
          return one(0x10000 + ((*v - 0xD800) << 10) + (*low - 0xDC00));
        }
        if (*v >= 0xD800 && *v <= 0xDFFF) return Error("a lone surrogate half");
        return one(*v);
      }
      default:
        break;
    }
    if (c >= '1' && c <= '9') {
      pos_ = start;
      return Error("backreferences are not supported");
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      pos_ = start;
      return Error(absl::StrCat("the escape \\", std::string(1, c), " is not supported"));
    }
    --pos_;
    absl::StatusOr<uint32_t> cp = ReadUtf8();  // escaped punctuation (or any other character)
    if (!cp.ok()) return cp.status();
    return one(*cp);
  }

  absl::StatusOr<uint32_t> ReadUtf8() {
    const tokenizer::Utf8Step step = tokenizer::DecodeUtf8Step(p_, pos_);
    if (step.kind != tokenizer::Utf8Step::Kind::kValid) return Error("not valid UTF-8");
    pos_ += step.length;
    return static_cast<uint32_t>(step.code_point);
  }

  std::string_view p_;
  RegexMode mode_;
  size_t pos_ = 0;
  int depth_ = 0;  // groups open
  std::vector<Ast> nodes_;
  std::vector<RangeSet> sets_;
};

// A Thompson automaton: each state has at most one character edge (a set) and any number of
// empty edges.
struct Nfa {
  struct State {
    int32_t set = -1;
    int32_t out = -1;
    std::vector<int32_t> empty;
  };
  std::vector<State> states;
  std::vector<RangeSet> sets;
};

class NfaBuilder {
 public:
  explicit NfaBuilder(const std::vector<Ast>& ast) : ast_(ast) {}

  // Fills `nfa`; returns {start, accept}.
  absl::StatusOr<std::pair<int32_t, int32_t>> Build(int root, Nfa& nfa) {
    nfa_ = &nfa;
    return Emit(root);
  }

 private:
  absl::StatusOr<int32_t> NewState() {
    if (nfa_->states.size() >= kMaxNfaStates) {
      return absl::InvalidArgumentError(
          "too large (its repetitions expand past the supported size)");
    }
    nfa_->states.emplace_back();
    return static_cast<int32_t>(nfa_->states.size() - 1);
  }

  absl::StatusOr<std::pair<int32_t, int32_t>> Emit(int index) {
    const Ast& a = ast_[index];
    absl::StatusOr<int32_t> s = NewState();
    if (!s.ok()) return s.status();
    int32_t cur = *s;
    switch (a.kind) {
      case Ast::kSet: {
        absl::StatusOr<int32_t> e = NewState();
        if (!e.ok()) return e.status();
        nfa_->states[cur].set = a.set;
        nfa_->states[cur].out = *e;
        return std::make_pair(*s, *e);
      }
      case Ast::kConcat:
        for (int child : a.children) {
          absl::StatusOr<std::pair<int32_t, int32_t>> f = Emit(child);
          if (!f.ok()) return f.status();
          nfa_->states[cur].empty.push_back(f->first);
          cur = f->second;
        }
        return std::make_pair(*s, cur);
      case Ast::kAlt: {
        absl::StatusOr<int32_t> e = NewState();
        if (!e.ok()) return e.status();
        for (int child : a.children) {
          absl::StatusOr<std::pair<int32_t, int32_t>> f = Emit(child);
          if (!f.ok()) return f.status();
          nfa_->states[*s].empty.push_back(f->first);
          nfa_->states[f->second].empty.push_back(*e);
        }
        return std::make_pair(*s, *e);
      }
      case Ast::kRepeat: {
        for (int i = 0; i < a.min; ++i) {
          absl::StatusOr<std::pair<int32_t, int32_t>> f = Emit(a.children[0]);
          if (!f.ok()) return f.status();
          nfa_->states[cur].empty.push_back(f->first);
          cur = f->second;
        }
        absl::StatusOr<int32_t> e = NewState();
        if (!e.ok()) return e.status();
        if (a.max < 0) {
          // A loop: cur -> body -> cur, or on to e.
          absl::StatusOr<std::pair<int32_t, int32_t>> f = Emit(a.children[0]);
          if (!f.ok()) return f.status();
          nfa_->states[cur].empty.push_back(f->first);
          nfa_->states[f->second].empty.push_back(cur);
          nfa_->states[cur].empty.push_back(*e);
          return std::make_pair(*s, *e);
        }
        for (int i = a.min; i < a.max; ++i) {
          absl::StatusOr<std::pair<int32_t, int32_t>> f = Emit(a.children[0]);
          if (!f.ok()) return f.status();
          nfa_->states[cur].empty.push_back(*e);
          nfa_->states[cur].empty.push_back(f->first);
          cur = f->second;
        }
        nfa_->states[cur].empty.push_back(*e);
        return std::make_pair(*s, *e);
      }
    }
    return absl::InternalError("regex: unknown node");
  }

  const std::vector<Ast>& ast_;
  Nfa* nfa_ = nullptr;
};

}  // namespace

class RegexDfaBuilder {
 public:
  static bool Prune(RegexDfa& dfa) { return dfa.Prune(); }

  // The subset construction over the code-point classes that no set boundary splits.
  static absl::StatusOr<RegexDfa> FromNfa(const Nfa& nfa, int32_t start, int32_t accept) {
    RegexDfa dfa;
    std::vector<uint32_t> cuts = {0};
    for (const RangeSet& s : nfa.sets) {
      for (const Range& r : s) {
        cuts.push_back(r.lo);
        if (r.hi < kMaxCodePoint) cuts.push_back(r.hi + 1);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    dfa.interval_starts_ = cuts;
    const size_t intervals = cuts.size();
    // Per interval, the sets that hold it (an interval lies wholly inside or outside every set);
    // intervals held by the same sets are one class.
    std::vector<std::vector<int32_t>> held_by(intervals);
    size_t coverage = 0;
    for (size_t i = 0; i < nfa.sets.size(); ++i) {
      for (const Range& r : nfa.sets[i]) {
        for (size_t k = dfa.IntervalOf(r.lo); k < intervals && cuts[k] <= r.hi; ++k) {
          held_by[k].push_back(static_cast<int32_t>(i));
          if (++coverage > kMaxTableEntries) {
            return absl::InvalidArgumentError("too complex (too many character classes)");
          }
        }
      }
    }
    std::map<std::vector<int32_t>, int32_t> class_ids;
    std::vector<int32_t> representative;  // an interval of each class
    for (size_t k = 0; k < intervals; ++k) {
      auto [it, fresh] =
          class_ids.emplace(std::move(held_by[k]), static_cast<int32_t>(representative.size()));
      if (fresh) representative.push_back(static_cast<int32_t>(k));
      dfa.interval_class_.push_back(it->second);
    }
    const size_t classes = representative.size();
    dfa.classes_ = classes;
    // holds[set][class]
    std::vector<std::vector<uint8_t>> holds(nfa.sets.size(), std::vector<uint8_t>(classes, 0));
    for (const auto& [sets, id] : class_ids) {
      for (int32_t set : sets) holds[set][id] = 1;
    }
    std::vector<uint32_t> mark(nfa.states.size(), 0);
    uint32_t stamp = 0;
    auto closure = [&](const std::vector<int32_t>& seeds) {
      ++stamp;
      std::vector<int32_t> out, stack;
      for (int32_t s : seeds) {
        if (mark[s] != stamp) {
          mark[s] = stamp;
          stack.push_back(s);
        }
      }
      while (!stack.empty()) {
        const int32_t s = stack.back();
        stack.pop_back();
        out.push_back(s);
        for (int32_t t : nfa.states[s].empty) {
          if (mark[t] != stamp) {
            mark[t] = stamp;
            stack.push_back(t);
          }
        }
      }
      std::sort(out.begin(), out.end());
      return out;
    };
    // Each subset is stored once, as its map key.
    std::map<std::vector<int32_t>, int32_t> ids;
    std::vector<const std::vector<int32_t>*> subsets;
    size_t stored = 0;
    absl::Status too_large = absl::OkStatus();
    auto intern = [&](std::vector<int32_t> set) -> int32_t {
      if (auto it = ids.find(set); it != ids.end()) return it->second;
      stored += set.size();
      if (subsets.size() >= kMaxDfaStates || stored > kMaxSubsetEntries) {
        too_large = absl::InvalidArgumentError(
            absl::StrCat("too complex (its automaton passes ", kMaxDfaStates, " states)"));
        return RegexDfa::kNone;
      }
      auto [it, fresh] = ids.emplace(std::move(set), static_cast<int32_t>(subsets.size()));
      subsets.push_back(&it->first);
      return it->second;
    };
    intern(closure({start}));
    for (size_t d = 0; d < subsets.size(); ++d) {
      if ((d + 1) * classes > kMaxTableEntries) {
        return absl::InvalidArgumentError("too complex (its automaton's table is too large)");
      }
      const std::vector<int32_t>& current = *subsets[d];
      dfa.accepting_.push_back(std::binary_search(current.begin(), current.end(), accept));
      for (size_t c = 0; c < classes; ++c) {
        std::vector<int32_t> moved;
        for (int32_t s : current) {
          const Nfa::State& st = nfa.states[s];
          if (st.set >= 0 && holds[st.set][c]) moved.push_back(st.out);
        }
        dfa.next_.push_back(moved.empty() ? RegexDfa::kNone : intern(closure(moved)));
        if (!too_large.ok()) return too_large;
      }
    }
    return dfa;
  }
};

size_t RegexDfa::IntervalOf(uint32_t code_point) const {
  return static_cast<size_t>(
      std::upper_bound(interval_starts_.begin(), interval_starts_.end(), code_point) -
      interval_starts_.begin() - 1);
}

int32_t RegexDfa::Next(int32_t state, uint32_t code_point) const {
  if (code_point > kMaxCodePoint) return kNone;
  return next_[static_cast<size_t>(state) * classes_ + interval_class_[IntervalOf(code_point)]];
}

std::bitset<256> RegexDfa::FirstBytes() const {
  std::bitset<256> bytes;
  for (uint32_t b = 0; b < 0x80; ++b) {
    if (Next(start(), b) != kNone) bytes.set(b);
  }
  for (uint32_t b = 0x80; b < 0x100; ++b) {
    int extra = 0;
    uint32_t payload = 0;
    if (!Utf8Lead(static_cast<uint8_t>(b), extra, payload)) continue;
    const auto [lo, hi] = Utf8Range(payload, extra, extra);
    if (AnyNext(start(), lo, hi)) bytes.set(b);
  }
  return bytes;
}

bool RegexDfa::AnyNext(int32_t state, uint32_t lo, uint32_t hi, int32_t budget) const {
  hi = std::min(hi, kMaxCodePoint);
  if (lo > hi) return false;
  const int32_t* row = &next_[static_cast<size_t>(state) * classes_];
  for (size_t k = IntervalOf(lo); k < interval_starts_.size() && interval_starts_[k] <= hi; ++k) {
    const int32_t t = row[interval_class_[k]];
    if (t != kNone && (budget < 0 || distance_[t] <= budget)) return true;
  }
  return false;
}

bool RegexDfa::Prune() {
  const size_t n = accepting_.size(), classes = classes_;
  // States that can reach a match: backwards from the accepting ones.
  std::vector<std::vector<int32_t>> incoming(n);
  for (size_t s = 0; s < n; ++s) {
    for (size_t c = 0; c < classes; ++c) {
      const int32_t t = next_[s * classes + c];
      if (t != kNone) incoming[t].push_back(static_cast<int32_t>(s));
    }
  }
  std::vector<uint8_t> live(n, 0);
  std::vector<int32_t> stack;
  for (size_t s = 0; s < n; ++s) {
    if (accepting_[s]) {
      live[s] = 1;
      stack.push_back(static_cast<int32_t>(s));
    }
  }
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    for (int32_t p : incoming[s]) {
      if (!live[p]) {
        live[p] = 1;
        stack.push_back(p);
      }
    }
  }
  if (n == 0 || !live[0]) return false;
  // The live states reachable from the start, renumbered in visiting order (the start stays 0).
  std::vector<int32_t> id(n, kNone);
  std::vector<int32_t> order = {0};
  id[0] = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    for (size_t c = 0; c < classes; ++c) {
      const int32_t t = next_[static_cast<size_t>(order[i]) * classes + c];
      if (t != kNone && live[t] && id[t] == kNone) {
        id[t] = static_cast<int32_t>(order.size());
        order.push_back(t);
      }
    }
  }
  std::vector<int32_t> next;
  std::vector<uint8_t> accepting;
  for (int32_t s : order) {
    accepting.push_back(accepting_[s]);
    for (size_t c = 0; c < classes; ++c) {
      const int32_t t = next_[static_cast<size_t>(s) * classes + c];
      next.push_back(t != kNone && live[t] ? id[t] : kNone);
    }
  }
  next_ = std::move(next);
  accepting_ = std::move(accepting);
  // The fewest characters from each state to a match: backwards from the accepting states.
  const size_t kept = accepting_.size();
  std::vector<std::vector<int32_t>> sources(kept);
  for (size_t s = 0; s < kept; ++s) {
    for (size_t c = 0; c < classes; ++c) {
      const int32_t t = next_[s * classes + c];
      if (t != kNone) sources[t].push_back(static_cast<int32_t>(s));
    }
  }
  distance_.assign(kept, -1);
  std::vector<int32_t> queue;
  for (size_t s = 0; s < kept; ++s) {
    if (accepting_[s]) {
      distance_[s] = 0;
      queue.push_back(static_cast<int32_t>(s));
    }
  }
  for (size_t i = 0; i < queue.size(); ++i) {
    for (int32_t p : sources[queue[i]]) {
      if (distance_[p] < 0) {
        distance_[p] = distance_[queue[i]] + 1;
        queue.push_back(p);
      }
    }
  }
  max_distance_ = 0;
  for (int32_t d : distance_) max_distance_ = std::max(max_distance_, d);
  return true;
}

absl::StatusOr<RegexDfa> RegexDfa::WithLength(int32_t min_length, int32_t max_length) const {
  // States (state, characters so far), the count capped where it stops mattering: at
  // max_length (no more characters), or at min_length when there is no upper limit.
  const int32_t cap = max_length >= 0 ? max_length : min_length;
  const size_t classes = classes_;
  RegexDfa out;
  out.interval_starts_ = interval_starts_;
  out.interval_class_ = interval_class_;
  out.classes_ = classes_;
  std::map<std::pair<int32_t, int32_t>, int32_t> ids;
  std::vector<std::pair<int32_t, int32_t>> order = {{0, 0}};
  ids[{0, 0}] = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order.size() > kMaxLengthProductStates || order.size() * classes > kMaxTableEntries) {
      return absl::InvalidArgumentError("too complex together with minLength / maxLength");
    }
    const auto [state, count] = order[i];
    out.accepting_.push_back(accepting_[state] && count >= min_length);
    for (size_t c = 0; c < classes; ++c) {
      const int32_t t = next_[static_cast<size_t>(state) * classes + c];
      if (t == kNone || (max_length >= 0 && count >= max_length)) {
        out.next_.push_back(kNone);
        continue;
      }
      const std::pair<int32_t, int32_t> key = {t, std::min(count + 1, cap)};
      auto [it, fresh] = ids.emplace(key, static_cast<int32_t>(order.size()));
      if (fresh) order.push_back(key);
      out.next_.push_back(it->second);
    }
  }
  if (!out.Prune()) {
    return absl::InvalidArgumentError("no text within minLength / maxLength matches the pattern");
  }
  return out;
}

absl::StatusOr<RegexDfa> CompileRegex(std::string_view pattern, RegexMode mode) {
  Parser parser(pattern, mode);
  absl::StatusOr<int> root = parser.Parse();
  if (!root.ok()) return root.status();
  Nfa nfa;
  absl::StatusOr<std::pair<int32_t, int32_t>> ends = NfaBuilder(parser.nodes()).Build(*root, nfa);
  if (!ends.ok()) return ends.status();
  nfa.sets = std::move(parser.sets());
  absl::StatusOr<RegexDfa> dfa = RegexDfaBuilder::FromNfa(nfa, ends->first, ends->second);
  if (!dfa.ok()) return dfa.status();
  if (!RegexDfaBuilder::Prune(*dfa)) return absl::InvalidArgumentError("it matches no text");
  return dfa;
}

}  // namespace mobius::grammar
