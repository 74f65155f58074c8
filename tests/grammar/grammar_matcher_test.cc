#include "grammar/grammar_matcher.h"

#include <string>

#include "grammar/json_schema_compiler.h"
#include "gtest/gtest.h"

namespace mobius::grammar {
namespace {

// Whether `text` is a complete output of `g` (every byte accepted, the value complete).
bool Matches(const Grammar& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.FeedBytes(text) && m.Accepting();
}

// Whether `text` can begin an output of `g`.
bool Prefix(const Grammar& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.FeedBytes(text);
}

Grammar Schema(const std::string& text) {
  absl::StatusOr<Grammar> g = CompileJsonSchemaText(text);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *std::move(g) : Grammar{};
}

TEST(GrammarMatcherTest, JsonObjectAcceptsObjectsOnly) {
  const Grammar g = JsonObjectGrammar();
  for (const std::string ok :
       {"{}", "{ }", "{\"a\":1}", "{\"a\": [1, -2.5e+3, true, false, null, \"x\"]}",
        "{\"a\":{\"b\":{\"c\":[]}}}", "{\n  \"k\": \"v\\n\\u00e9\\\"\",\n  \"n\": 0\n}",
        "{\"\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80\": 0.5}"}) {
    EXPECT_TRUE(Matches(g, ok)) << ok;
  }
  for (const std::string bad : {"[]",
                                "1",
                                "\"x\"",
                                "{\"a\"}",
                                "{\"a\":}",
                                "{\"a\":1,}",
                                "{,}",
                                "{\"a\":01}",
                                "{\"a\":1.}",
                                "{\"a\":-}",
                                "{\"a\":tru}",
                                "{\"a\":\"\x01\"}",
                                "{\"a\":\"\\x\"}",
                                "{\"a\":\"\x80\"}",
                                "{\"a\":\"\xc0\xaf\"}",
                                "{\"a\":\"\xed\xa0\x80\"}",
                                " {}",
                                "{} ",
                                "{}{}",
                                "{\"a\":1 2}",
                                "{'a':1}"}) {
    EXPECT_FALSE(Matches(g, bad)) << bad;
  }
  // Incomplete but valid so far.
  EXPECT_TRUE(Prefix(g, "{\"a\": [1, {\"b\": \"x"));
  EXPECT_FALSE(Matches(g, "{\"a\": [1, {\"b\": \"x"));
}

TEST(GrammarMatcherTest, WhitespaceRunsAreBounded) {
  const Grammar g = JsonObjectGrammar();
  EXPECT_TRUE(Prefix(g, "{" + std::string(kMaxWhitespaceRun, ' ')));
  EXPECT_FALSE(Prefix(g, "{" + std::string(kMaxWhitespaceRun + 1, ' ')));
  // The count restarts after each token.
  EXPECT_TRUE(Matches(g, "{" + std::string(kMaxWhitespaceRun, ' ') + "\"a\"" +
                             std::string(kMaxWhitespaceRun, '\n') + ":1}"));
}

TEST(GrammarMatcherTest, NumbersAreBoundedAndEndAtTheirDelimiter) {
  const Grammar g = JsonObjectGrammar();
  EXPECT_TRUE(Matches(g, "{\"a\":" + std::string(kMaxNumberLength, '1') + "}"));
  EXPECT_FALSE(Prefix(g, "{\"a\":" + std::string(kMaxNumberLength + 1, '1')));
  const Grammar n = Schema(R"({"type": "number"})");
  EXPECT_TRUE(Matches(n, "12"));  // a number at the top is complete without a delimiter
  GrammarMatcher m(n);
  ASSERT_TRUE(m.FeedBytes("12"));
  EXPECT_TRUE(m.Accepting());
  EXPECT_FALSE(m.Finished());  // more digits may follow
  EXPECT_FALSE(Matches(n, "12,"));
  const Grammar i = Schema(R"({"type": "integer"})");
  EXPECT_TRUE(Matches(i, "-120"));
  EXPECT_FALSE(Prefix(i, "1.5"));
  EXPECT_FALSE(Prefix(i, "1e5"));
}

TEST(GrammarMatcherTest, DeclaredPropertiesInOrderWithRequiredOnesPresent) {
  const Grammar g = Schema(R"({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"]})");
  EXPECT_TRUE(Matches(g, R"({"name":"x","age":3,"tags":[]})"));
  EXPECT_TRUE(Matches(g, R"({"name": "x", "tags": ["a", "b"]})"));  // optional age skipped
  EXPECT_FALSE(Matches(g, R"({"name":"x"})"));                      // tags is required
  EXPECT_FALSE(Prefix(g, R"({"age":3)"));                           // name first
  EXPECT_FALSE(Prefix(g, R"({"name":"x","tags":[],"age")"));        // out of order
  EXPECT_FALSE(Prefix(g, R"({"name":"x","other")"));                // undeclared
  EXPECT_FALSE(Prefix(g, R"({"name":1)"));                          // wrong type
  EXPECT_FALSE(Prefix(g, R"({"name":"x","age":3.5)"));              // integer
  EXPECT_FALSE(Prefix(g, R"({"name":"x","tags":[1)"));
  EXPECT_FALSE(Prefix(g, R"({})"));  // required properties missing
}

TEST(GrammarMatcherTest, KeysThatSharePrefixes) {
  const Grammar g = Schema(R"({"properties": {"a": {"type": "integer"}, "ab": {"type":
    "integer"}, "abc": {"type": "integer"}}})");
  EXPECT_TRUE(Matches(g, R"({"a":1,"ab":2,"abc":3})"));
  EXPECT_TRUE(Matches(g, R"({"ab":2})"));
  EXPECT_TRUE(Matches(g, R"({"abc":3})"));
  EXPECT_TRUE(Matches(g, R"({})"));
  EXPECT_FALSE(Prefix(g, R"({"ab":2,"a")"));
}

TEST(GrammarMatcherTest, EnumsConstsAndUnions) {
  const Grammar g = Schema(R"({"type": "object", "properties": {
    "color": {"enum": ["red", "green", 1, 12, null]},
    "kind": {"const": "fixed"},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "flag": {"type": ["boolean", "null"]}},
    "required": ["color", "kind", "note", "flag"]})");
  EXPECT_TRUE(Matches(g, R"({"color":"red","kind":"fixed","note":null,"flag":true})"));
  EXPECT_TRUE(Matches(g, R"({"color":12,"kind":"fixed","note":"x","flag":null})"));
  EXPECT_TRUE(Matches(g, R"({"color":1,"kind":"fixed","note":"x","flag":false})"));
  EXPECT_TRUE(Matches(g, R"({"color":null,"kind":"fixed","note":"","flag":false})"));
  EXPECT_FALSE(Prefix(g, R"({"color":"blue")"));
  EXPECT_FALSE(Prefix(g, R"({"color":123)"));
  EXPECT_FALSE(Prefix(g, R"({"color":"red","kind":"other")"));
  EXPECT_FALSE(Prefix(g, R"({"color":"red","kind":"fixed","note":1)"));
}

// Objects told apart by their first property's value: the frame reads that value, then
// continues as the object it selects (pydantic's tagged unions, typed tool calls).
TEST(GrammarMatcherTest, ObjectsSwitchOnTheirFirstPropertysValue) {
  const Grammar g = Schema(R"({"anyOf": [
    {"$ref": "#/$defs/circle"},
    {"type": "object", "properties": {"shape": {"enum": ["square", "box"]},
      "side": {"type": "integer"}}, "required": ["shape", "side"]},
    {"type": "string"}],
    "discriminator": {"propertyName": "shape"},
    "$defs": {"circle": {"type": "object", "properties": {"shape": {"const": "circle"},
      "r": {"type": "number"}, "label": {"type": "string"}}, "required": ["shape", "r"]}}})");
  EXPECT_TRUE(Matches(g, R"({"shape": "circle", "r": 1.5})"));
  EXPECT_TRUE(Matches(g, R"({"shape":"circle","r":2,"label":"x"})"));
  EXPECT_TRUE(Matches(g, R"({ "shape" : "square" , "side" : 3 })"));
  EXPECT_TRUE(Matches(g, R"({"shape": "box", "side": 3})"));
  EXPECT_TRUE(Matches(g, R"("just text")"));
  // Each value's own properties only.
  EXPECT_FALSE(Prefix(g, R"({"shape": "circle", "side")"));
  EXPECT_FALSE(Prefix(g, R"({"shape": "square", "r")"));
  EXPECT_FALSE(Matches(g, R"({"shape": "circle"})"));
  EXPECT_FALSE(Prefix(g, R"({"shape": "triangle")"));
  EXPECT_FALSE(Prefix(g, R"({"side")"));
  EXPECT_FALSE(Prefix(g, R"({})"));
  // The state after the tag is the selected object's: a cache key tells them apart.
  GrammarMatcher circle(g), square(g);
  ASSERT_TRUE(circle.FeedBytes(R"({"shape": "circle",)"));
  ASSERT_TRUE(square.FeedBytes(R"({"shape": "square",)"));
  std::string a, b;
  circle.AppendStateKey(a, 16);
  square.AppendStateKey(b, 16);
  EXPECT_NE(a, b);
}

// minimum / maximum: a digit is taken only if some value within the bounds can still follow,
// and the number may end only within them.
TEST(GrammarMatcherTest, NumbersWithinTheirBounds) {
  const Grammar age = Schema(R"({"type": "integer", "minimum": 0, "maximum": 120})");
  for (const char* ok : {"0", "7", "99", "120"}) EXPECT_TRUE(Matches(age, ok)) << ok;
  for (const char* no : {"121", "-1", "1200", "-"}) EXPECT_FALSE(Prefix(age, no)) << no;
  EXPECT_FALSE(Matches(Schema(R"({"type": "integer", "minimum": -5, "maximum": 5})"), "-0"));
  EXPECT_TRUE(Prefix(age, "12"));
  EXPECT_TRUE(Matches(age, "13"));

  // One bound: a short prefix may still grow into range; past the bound anything goes.
  const Grammar big = Schema(R"({"type": "integer", "minimum": 100})");
  EXPECT_TRUE(Prefix(big, "5"));
  EXPECT_FALSE(Matches(big, "5"));
  EXPECT_FALSE(Matches(big, "99"));
  EXPECT_TRUE(Matches(big, "100"));
  EXPECT_TRUE(Matches(big, "123456789012345678901234567890"));
  EXPECT_FALSE(Prefix(big, "-"));

  const Grammar share = Schema(R"({"type": "number", "minimum": 0.5, "maximum": 1})");
  for (const char* ok : {"0.5", "0.75", "1", "1.0", "1.000000", "0.999999"}) {
    EXPECT_TRUE(Matches(share, ok)) << ok;
  }
  for (const char* no : {"0.4", "1.5", "1.0000001", "2", "-", "1e0", "0.5e1"}) {
    EXPECT_FALSE(Matches(share, no)) << no;
  }
  EXPECT_FALSE(Prefix(share, "0.4"));
  EXPECT_FALSE(Prefix(share, "1.1"));
  EXPECT_FALSE(Matches(share, "0"));
  EXPECT_TRUE(Prefix(share, "0."));

  // Exclusive bounds, in both drafts' forms; bounds that are not on the grid.
  const Grammar positive = Schema(R"({"type": "number", "exclusiveMinimum": 0})");
  EXPECT_FALSE(Matches(positive, "0"));
  EXPECT_FALSE(Matches(positive, "0.0000001"));
  EXPECT_TRUE(Matches(positive, "0.000001"));
  EXPECT_TRUE(Matches(positive, "31415926535897932.5"));
  const Grammar draft4 = Schema(R"({"type": "integer", "minimum": 5, "exclusiveMinimum": true})");
  EXPECT_FALSE(Matches(draft4, "5"));
  EXPECT_TRUE(Matches(draft4, "6"));
  const Grammar tenth = Schema(R"({"type": "number", "minimum": 0.1, "maximum": 2.5})");
  EXPECT_TRUE(Matches(tenth, "0.1"));
  EXPECT_TRUE(Matches(tenth, "2.5"));
  EXPECT_FALSE(Matches(tenth, "0.099999"));
  EXPECT_FALSE(Matches(tenth, "2.500001"));
  const Grammar half = Schema(R"({"type": "integer", "minimum": 0.5, "maximum": 2.5})");
  EXPECT_FALSE(Matches(half, "0"));
  EXPECT_TRUE(Matches(half, "1"));
  EXPECT_TRUE(Matches(half, "2"));
  EXPECT_FALSE(Matches(half, "3"));

  // Negative ranges.
  const Grammar below = Schema(R"({"type": "integer", "maximum": -10, "minimum": -300})");
  EXPECT_TRUE(Matches(below, "-10"));
  EXPECT_TRUE(Matches(below, "-300"));
  EXPECT_FALSE(Matches(below, "-9"));
  EXPECT_FALSE(Prefix(below, "-301"));
  EXPECT_FALSE(Prefix(below, "0"));
  EXPECT_FALSE(Prefix(below, "5"));
}

// A string's pattern applies to its characters as decoded: escapes and UTF-8 alike. Without
// anchors it may match anywhere in the string (JSON Schema's rule).
TEST(GrammarMatcherTest, StringsFollowTheirPattern) {
  const Grammar phone = Schema(R"({"type": "string", "pattern": "^\\d{3}-\\d{4}$"})");
  EXPECT_TRUE(Matches(phone, R"("555-1234")"));
  EXPECT_FALSE(Prefix(phone, R"("55a)"));
  EXPECT_FALSE(Prefix(phone, R"("555-12345)"));
  EXPECT_FALSE(Matches(phone, R"("555-123")"));
  EXPECT_TRUE(Matches(phone, R"("\u0035\u0035\u0035-1234")"));
  EXPECT_FALSE(Prefix(phone, R"("\u0061)"));
  EXPECT_FALSE(Prefix(phone, R"("\u01)"));  // no \u01XX is a digit; \u003X may be
  EXPECT_TRUE(Prefix(phone, R"("\u003)"));

  const Grammar lines = Schema(R"({"type": "string", "pattern": "^a\\nb$"})");
  EXPECT_TRUE(Matches(lines, R"("a\nb")"));
  EXPECT_TRUE(Matches(lines, R"("\u0061\u000ab")"));
  EXPECT_FALSE(Prefix(lines, R"("a\t)"));

  const Grammar smile = Schema(R"({"type": "string", "pattern": "^\\uD83D\\uDE00+$"})");
  EXPECT_TRUE(Matches(smile, "\"\xF0\x9F\x98\x80\xF0\x9F\x98\x80\""));
  EXPECT_TRUE(Matches(smile, R"("\ud83d\ude00")"));
  EXPECT_FALSE(Prefix(smile, "\"\xF0\x9F\x98\x81"));
  EXPECT_FALSE(Prefix(smile, "\"\xF0\x9F\x99"));  // no U+1F64x continues
  EXPECT_FALSE(Prefix(smile, R"("\ud83d\ude01)"));
  EXPECT_FALSE(Prefix(smile, R"("\ud83e)"));

  const Grammar inside = Schema(R"({"type": "string", "pattern": "abc"})");
  EXPECT_TRUE(Matches(inside, R"("xxabcyy")"));
  EXPECT_TRUE(Matches(inside, R"("abc")"));
  EXPECT_FALSE(Matches(inside, R"("xxab")"));

  // A maxLength alone is a count beside the automaton: far from the limit, states of a long
  // string share their cache key; near it a character is taken only if a match still fits.
  const Grammar word = Schema(R"({"type": "string", "pattern": "^[a-z]+!$", "maxLength": 40})");
  GrammarMatcher early(word), later(word), near(word);
  ASSERT_TRUE(early.FeedBytes(R"("abc)"));
  ASSERT_TRUE(later.FeedBytes(R"("abcdefghij)"));
  std::string early_key, later_key;
  early.AppendStateKey(early_key, 8);
  later.AppendStateKey(later_key, 8);
  EXPECT_EQ(early_key, later_key);
  const std::string full = "\"" + std::string(39, 'a');
  ASSERT_TRUE(near.FeedBytes(full));
  EXPECT_FALSE(Prefix(word, full + "a"));  // the '!' would not fit
  EXPECT_TRUE(Matches(word, full + "!\""));
  EXPECT_FALSE(
      CompileJsonSchemaText(R"({"type": "string", "pattern": "^a{5}$", "maxLength": 4})").ok());

  // Lengths and pattern together: "ab" pairs, 4 to 6 characters.
  const Grammar pairs =
      Schema(R"({"type": "string", "pattern": "^(ab)+$", "minLength": 3, "maxLength": 6})");
  EXPECT_FALSE(Matches(pairs, R"("ab")"));
  EXPECT_TRUE(Matches(pairs, R"("abab")"));
  EXPECT_TRUE(Matches(pairs, R"("ababab")"));
  EXPECT_FALSE(Prefix(pairs, R"("abababa)"));
}

// The string formats OpenAI enforces, as patterns; other formats stay annotations.
TEST(GrammarMatcherTest, StringFormats) {
  const Grammar when = Schema(R"({"type": "string", "format": "date-time"})");
  EXPECT_TRUE(Matches(when, R"("2024-05-06T10:20:30Z")"));
  EXPECT_TRUE(Matches(when, R"("1999-12-31T23:59:60.123+05:30")"));
  EXPECT_FALSE(Prefix(when, R"("2024-13)"));
  EXPECT_FALSE(Prefix(when, R"("2024-05-32)"));
  EXPECT_FALSE(Matches(when, R"("2024-05-06T10:20:30")"));  // RFC 3339 needs the offset
  EXPECT_TRUE(Matches(Schema(R"({"format": "date"})"), R"("2024-02-29")"));
  EXPECT_TRUE(Matches(Schema(R"({"type": "string", "format": "time"})"), R"("08:00:00Z")"));
  const Grammar id = Schema(R"({"type": "string", "format": "uuid"})");
  EXPECT_TRUE(Matches(id, R"("123e4567-e89b-12d3-a456-426614174000")"));
  EXPECT_FALSE(Prefix(id, R"("123e4567e)"));
  const Grammar ip = Schema(R"({"type": "string", "format": "ipv4"})");
  EXPECT_TRUE(Matches(ip, R"("192.168.0.255")"));
  EXPECT_FALSE(Prefix(ip, R"("256.)"));
  EXPECT_FALSE(Matches(ip, R"("1.2.3")"));
  const Grammar mail = Schema(R"({"type": "string", "format": "email", "maxLength": 20})");
  EXPECT_TRUE(Matches(mail, R"("ann.lee@example.org")"));
  EXPECT_FALSE(Prefix(mail, R"("ann@@)"));
  EXPECT_FALSE(Matches(mail, R"("ann")"));
  EXPECT_FALSE(Prefix(mail, R"("ann.lee@example.organ")"));  // 21 characters
  EXPECT_TRUE(Matches(Schema(R"({"type": "string", "format": "hostname"})"), R"("a-b.example")"));
  // Unknown formats annotate; a pattern beside a format wins.
  EXPECT_TRUE(Matches(Schema(R"({"type": "string", "format": "color"})"), R"("anything")"));
  EXPECT_TRUE(
      Matches(Schema(R"({"type": "string", "format": "uuid", "pattern": "^x+$"})"), R"("xx")"));
}

// guided_regex: raw text that the expression matches whole, ending where no byte can follow.
TEST(GrammarMatcherTest, RegexTextMatchesWhole) {
  absl::StatusOr<Grammar> g = RegexGrammar("(yes|no)!?|\\d{1,3}\u00e9");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(Matches(*g, "yes"));
  EXPECT_TRUE(Matches(*g, "no!"));
  EXPECT_TRUE(Matches(*g, "42\xc3\xa9"));
  EXPECT_FALSE(Matches(*g, "ye"));
  EXPECT_FALSE(Prefix(*g, "maybe"));
  EXPECT_FALSE(Prefix(*g, "yes!!"));
  EXPECT_FALSE(Prefix(*g, "42\xc3\xa8"));
  EXPECT_FALSE(Prefix(*g, "42\xc4"));  // no U+01xx continues
  EXPECT_FALSE(Prefix(*g, "1234"));
  GrammarMatcher m(*g);
  ASSERT_TRUE(m.FeedBytes("yes"));
  EXPECT_TRUE(m.Accepting());
  EXPECT_FALSE(m.Finished());  // "!" may follow
  ASSERT_TRUE(m.FeedBytes("!"));
  EXPECT_TRUE(m.Finished());
  EXPECT_FALSE(RegexGrammar("a{0}").ok());
  EXPECT_FALSE(RegexGrammar("(").ok());
}

TEST(GrammarMatcherTest, StringLengthsCountCharacters) {
  const Grammar g = Schema(R"({"type": "string", "minLength": 2, "maxLength": 3})");
  EXPECT_FALSE(Matches(g, R"("a")"));
  EXPECT_TRUE(Matches(g, R"("ab")"));
  EXPECT_TRUE(Matches(g, "\"\xc3\xa9\\n\xe4\xb8\xad\""));  // three characters, six bytes
  EXPECT_FALSE(Prefix(g, R"("abcd)"));
  GrammarMatcher m(g);
  ASSERT_TRUE(m.FeedBytes(R"("abc")"));
  EXPECT_TRUE(m.Finished());
}

TEST(GrammarMatcherTest, StateKeysCountOnlyWhatTheHorizonCanReach) {
  const Grammar g = Schema(R"({"type": "array", "items": {"type": "string", "maxLength": 40},
    "maxItems": 30})");
  auto key = [&g](const std::string& text, int horizon) {
    GrammarMatcher m(g);
    EXPECT_TRUE(m.FeedBytes(text)) << text;
    std::string k;
    m.AppendStateKey(k, horizon);
    return k;
  };
  // Far from every limit, the counts do not matter within a horizon of 4 bytes...
  EXPECT_EQ(key("[\"ab", 4), key("[\"abcdefgh", 4));
  EXPECT_EQ(key("[\"a\", \"b", 4), key("[\"a\", \"b\", \"c\", \"d", 4));
  // ...near one they do: 36 and 37 characters leave 4 and 3 before maxLength.
  EXPECT_NE(key("[\"" + std::string(36, 'x'), 4), key("[\"" + std::string(37, 'x'), 4));
  // A longer horizon tells more states apart.
  EXPECT_NE(key("[\"ab", 40), key("[\"abcdefgh", 40));
}

TEST(GrammarMatcherTest, SurrogateEscapesComeInPairs) {
  const Grammar one = Schema(R"({"type": "string", "maxLength": 1})");
  EXPECT_TRUE(Matches(one, R"("\ud83d\ude00")"));  // one character, as the raw emoji is
  EXPECT_TRUE(Matches(one, "\"\xf0\x9f\x98\x80\""));
  EXPECT_TRUE(Matches(one, R"("\u00e9")"));
  EXPECT_FALSE(Prefix(one, R"("\ud800")"));    // a high surrogate alone
  EXPECT_FALSE(Prefix(one, R"("\ud800\u0)"));  // followed by no low one
  EXPECT_FALSE(Prefix(one, R"("\udc)"));       // a low surrogate alone
  EXPECT_TRUE(Prefix(one, R"("\ud800\udc)"));
}

TEST(GrammarMatcherTest, NumbersNeverStartWhatTheyCannotFinish) {
  const Grammar g = Schema(R"({"type": "number"})");
  const std::string digits(kMaxNumberLength - 1, '1');
  EXPECT_FALSE(Prefix(g, digits + "."));  // no room for a fraction digit
  EXPECT_FALSE(Prefix(g, digits + "e"));
  EXPECT_TRUE(Prefix(g, digits.substr(1) + "."));
  EXPECT_TRUE(Matches(g, digits.substr(1) + ".5"));
  EXPECT_FALSE(Prefix(g, digits.substr(1) + "e-"));  // 'e' fits, the sign and a digit not
  EXPECT_TRUE(Matches(g, digits.substr(2) + "e-5"));
}

TEST(GrammarMatcherTest, ArrayLimits) {
  const Grammar g = Schema(R"({"type": "array", "items": {"type": "integer"}, "minItems": 1,
    "maxItems": 2})");
  EXPECT_FALSE(Matches(g, "[]"));
  EXPECT_TRUE(Matches(g, "[1]"));
  EXPECT_TRUE(Matches(g, "[1, 2]"));
  EXPECT_FALSE(Prefix(g, "[1, 2,"));
}

TEST(GrammarMatcherTest, RecursiveReferences) {
  const Grammar g = Schema(R"({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object",
    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items":
    {"$ref": "#/$defs/node"}}}, "required": ["v"]}}})");
  EXPECT_TRUE(Matches(g, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[{"v":4}]}]})"));
  EXPECT_FALSE(Prefix(g, R"({"v":1,"kids":[{"kids")"));
}

TEST(GrammarMatcherTest, NestingDepthIsBounded) {
  const Grammar g = JsonObjectGrammar();
  std::string deep;
  // The root frame and kMaxNestingDepth values.
  for (int i = 0; i < kMaxNestingDepth; ++i) deep += i == 0 ? "{\"a\":" : "[";
  EXPECT_TRUE(Prefix(g, deep));
  EXPECT_FALSE(Prefix(g, deep + "["));
}

TEST(GrammarMatcherTest, TaggedJsonIsTextValueText) {
  absl::StatusOr<Grammar> g = TaggedJsonGrammar(
      "<tool_call>\n",
      R"({"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object",
        "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, "required": ["name",
        "arguments"]})",
      "\n</tool_call>");
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string call =
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 3}}\n</tool_call>";
  EXPECT_TRUE(Matches(*g, call));
  GrammarMatcher m(*g);
  ASSERT_TRUE(m.FeedBytes(call));
  EXPECT_TRUE(m.Finished());
  EXPECT_FALSE(Prefix(*g, "Sure! <tool_call>"));
  EXPECT_FALSE(Prefix(*g, "<tool_call>{"));  // the newline is part of the text
  EXPECT_FALSE(Prefix(*g, "<tool_call>\n{\"name\": \"g\""));
  EXPECT_FALSE(Matches(*g, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 3}}"));
  // A number ending the value hands its delimiter to the closing text.
  absl::StatusOr<Grammar> n = TaggedJsonGrammar("<", R"({"type": "integer"})", ">");
  ASSERT_TRUE(n.ok());
  EXPECT_TRUE(Matches(*n, "<12>"));
  EXPECT_FALSE(Matches(*n, "<12"));
  EXPECT_FALSE(TaggedJsonGrammar("", "{}", ">").ok());
}

// Parallel tool calls: one block or more (up to max_blocks), the separator between them; the
// output may end after any whole block.
TEST(GrammarMatcherTest, TaggedBlocksRepeat) {
  absl::StatusOr<Grammar> any = TaggedJsonGrammar("<", R"({"type": "integer"})", ">", -1, "\n");
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_TRUE(Matches(*any, "<1>"));
  EXPECT_TRUE(Matches(*any, "<1>\n<22>\n<3>"));
  EXPECT_TRUE(Matches(*any, "<1>\n"));  // a white-space separator may trail the last block
  EXPECT_FALSE(Prefix(*any, "<1><2>"));
  EXPECT_FALSE(Prefix(*any, "<1>\n\n"));
  GrammarMatcher m(*any);
  ASSERT_TRUE(m.FeedBytes("<1>"));
  EXPECT_TRUE(m.Accepting());
  EXPECT_FALSE(m.Finished());  // another block may follow
  absl::StatusOr<Grammar> two = TaggedJsonGrammar("<", R"({"type": "integer"})", ">", 2, "\n");
  ASSERT_TRUE(two.ok());
  EXPECT_TRUE(Matches(*two, "<1>\n<2>"));
  EXPECT_FALSE(Prefix(*two, "<1>\n<2>\n"));
  GrammarMatcher full(*two);
  ASSERT_TRUE(full.FeedBytes("<1>\n<2>"));
  EXPECT_TRUE(full.Finished());
  // Behind a reasoning block too.
  Grammar reasoned = *any;
  ASSERT_TRUE(AddReasoningBlock(reasoned, "</think>").ok());
  EXPECT_TRUE(Matches(reasoned, "hm</think>\n\n<4>\n<5>"));
  EXPECT_FALSE(TaggedJsonGrammar("<", "{}", ">", 0, "\n").ok());
  EXPECT_FALSE(TaggedJsonGrammar("<", "{}", ">", 3, "").ok());
}

TEST(GrammarMatcherTest, AReasoningBlockComesFirst) {
  Grammar g = Schema(R"({"type": "object", "properties": {"a": {"type": "integer"}},
    "required": ["a"]})");
  ASSERT_TRUE(AddReasoningBlock(g, "</think>").ok());
  // Anything up to the marker, braces and near-misses of the marker included, then whitespace.
  EXPECT_TRUE(Matches(g, "<think>\nsay {\"a\": 1}? <</think <</thi</think>\n\n{\"a\": 1}"));
  EXPECT_TRUE(Matches(g, "</think>{\"a\":2}"));
  EXPECT_TRUE(Matches(g, "<</think>\n{\"a\":2}"));  // the marker's start repeated
  EXPECT_FALSE(Matches(g, "{\"a\": 1}"));           // still reasoning: no marker yet
  EXPECT_TRUE(Prefix(g, "{\"a\": 1}"));
  EXPECT_FALSE(Prefix(g, "</think>\n\nSure: {"));  // after the marker, the form
  GrammarMatcher m(g);
  ASSERT_TRUE(m.FeedBytes("x</think>\n{\"a\":3}"));
  EXPECT_TRUE(m.Finished());
  EXPECT_FALSE(AddReasoningBlock(g, "").ok());
}

TEST(GrammarMatcherTest, ChoicesAreRawTextAndMayPrefixEachOther) {
  absl::StatusOr<Grammar> g = ChoiceGrammar({"yes", "yes sir", "no"});
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(Matches(*g, "yes"));
  EXPECT_TRUE(Matches(*g, "yes sir"));
  EXPECT_TRUE(Matches(*g, "no"));
  EXPECT_FALSE(Matches(*g, "yes s"));
  EXPECT_FALSE(Prefix(*g, "maybe"));
  GrammarMatcher m(*g);
  ASSERT_TRUE(m.FeedBytes("yes"));
  EXPECT_TRUE(m.Accepting());
  EXPECT_FALSE(m.Finished());
  ASSERT_TRUE(m.FeedBytes(" sir"));
  EXPECT_TRUE(m.Finished());
  EXPECT_FALSE(ChoiceGrammar({}).ok());
  EXPECT_FALSE(ChoiceGrammar({"a", ""}).ok());
}

}  // namespace
}  // namespace mobius::grammar
