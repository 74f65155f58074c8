// The host cost of structured output per decode step, on the Qwen3 tokenizer's vocabulary
// (151,669 tokens): a state's token mask computed from scratch (the prefix-tree walk), and a
// step that finds its state's mask cached (the allowed ids listed from the mask's bits).
// $MOBIUS_TOKENIZER_DIR, else ../shared/fixtures/tokenizer-qwen3 beside the repository.
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "grammar/json_schema_compiler.h"
#include "grammar/structured_output.h"
#include "grammar/tokenizer_vocabulary.h"
#include "tokenizer/tokenizer.h"

namespace mobius::grammar {
namespace {

std::filesystem::path TokenizerDir() {
  if (const char* dir = std::getenv("MOBIUS_TOKENIZER_DIR"); dir != nullptr) return dir;
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "shared" /
         "fixtures" / "tokenizer-qwen3";
}

std::shared_ptr<const TokenVocabulary> Vocabulary() {
  static std::shared_ptr<const TokenVocabulary> vocab = [] {
    auto tok = tokenizer::Tokenizer::FromDirectory(TokenizerDir());
    if (!tok.ok()) {
      std::fprintf(stderr, "tokenizer: %s\n", std::string(tok.status().message()).c_str());
      std::exit(1);
    }
    return VocabularyFromTokenizer(**tok, (*tok)->id_limit());
  }();
  return vocab;
}

// Output prefixes whose states differ in what they allow: the object's start, a key, inside a
// string (most tokens allowed), inside a number (few).
const char* const kPrefixes[] = {"{", "{\"na", "{\"name\": \"Jo", "{\"name\": \"Jo\", \"age\": 4"};

// The mask of `g`'s state after `prefix`, computed from scratch each iteration.
void MeasureComputeMask(benchmark::State& state, const Grammar& g, const std::string& prefix) {
  GrammarMatcher m(g);
  if (!m.FeedBytes(prefix)) state.SkipWithError("prefix rejected");
  const std::shared_ptr<const TokenVocabulary> vocab = Vocabulary();
  TokenBitmask mask;
  for (auto _ : state) {
    vocab->ComputeMask(m, mask);
    benchmark::DoNotOptimize(mask.data());
  }
  size_t allowed = 0;
  for (uint64_t w : mask) allowed += static_cast<size_t>(__builtin_popcountll(w));
  state.counters["allowed"] = static_cast<double>(allowed);
  state.SetLabel(prefix);
}

void BM_ComputeMask(benchmark::State& state) {
  MeasureComputeMask(state, JsonObjectGrammar(), kPrefixes[state.range(0)]);
}
BENCHMARK(BM_ComputeMask)->DenseRange(0, 3)->Unit(benchmark::kMillisecond);

// A constrained step whose state's mask is cached: AllowedTokens lists the ids (the engine's
// per-step cost once a state repeats).
void BM_AllowedTokensCached(benchmark::State& state) {
  GrammarCache cache;
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonObject;
  std::shared_ptr<CompiledGrammar> compiled = *cache.Get(spec);
  TokenConstraint constraint(compiled, Vocabulary(), {151645});
  const std::string prefix = kPrefixes[state.range(0)];
  // Feed the prefix one byte-token at a time through the vocabulary's single-byte tokens.
  for (char c : prefix) {
    bool fed = false;
    for (int32_t id = 0; id < static_cast<int32_t>(Vocabulary()->size()) && !fed; ++id) {
      if (Vocabulary()->bytes(id) == std::string(1, c)) fed = constraint.Accept(id);
    }
    if (!fed) state.SkipWithError("prefix rejected");
  }
  std::vector<int32_t> allowed;
  constraint.AllowedTokens(allowed);  // computes and caches the mask
  for (auto _ : state) {
    constraint.AllowedTokens(allowed);
    benchmark::DoNotOptimize(allowed.data());
  }
  state.counters["allowed"] = static_cast<double>(allowed.size());
  state.SetLabel(prefix);
}
BENCHMARK(BM_AllowedTokensCached)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);

// The same step as the engine takes it: the cached mask copied as a bitmask, with the end
// tokens set (a word per 64 tokens whatever the set).
void BM_NextMaskCached(benchmark::State& state) {
  GrammarCache cache;
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonObject;
  TokenConstraint constraint(*cache.Get(spec), Vocabulary(), {151645});
  for (char c : std::string(kPrefixes[state.range(0)])) {
    bool fed = false;
    for (int32_t id = 0; id < static_cast<int32_t>(Vocabulary()->size()) && !fed; ++id) {
      if (Vocabulary()->bytes(id) == std::string(1, c)) fed = constraint.Accept(id);
    }
    if (!fed) state.SkipWithError("prefix rejected");
  }
  std::vector<uint64_t> mask;
  constraint.NextMask(mask);
  for (auto _ : state) {
    constraint.NextMask(mask);
    benchmark::DoNotOptimize(mask.data());
  }
  state.counters["words"] = static_cast<double>(mask.size());
  state.SetLabel(kPrefixes[state.range(0)]);
}
BENCHMARK(BM_NextMaskCached)->DenseRange(0, 3)->Unit(benchmark::kMicrosecond);

// Compiling a request's form, which the router does twice (its HTTP parse and its request
// validation) and the worker once per distinct spec (GrammarCache): a pydantic-like model, the
// same with formats and patterns (each a regex automaton, lengths folded in), and a forced call
// among eight tools (an object switch).
std::string CompileCase(int which) {
  const std::string person = R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
      "maximum": 150}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
      "home": {"$ref": "#/$defs/Address"}}, "required": ["name", "age"],
      "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"},
      "zip": {"type": "string"}}, "required": ["city"]}}})";
  if (which == 0) return person;
  if (which == 1) {
    return R"({"type": "object", "properties": {
      "when": {"type": "string", "format": "date-time"},
      "mail": {"type": "string", "format": "email", "maxLength": 64},
      "id": {"type": "string", "format": "uuid"},
      "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,4}$"}},
      "required": ["when", "mail", "id", "code"]})";
  }
  // (Each tool's arguments: the model without its reference, as a forced call's wrapper would
  // move the definitions up.)
  const std::string arguments = R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
      "maximum": 150}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
      "required": ["name", "age"]})";
  std::string calls = R"({"anyOf": [)";
  for (int k = 0; k < 8; ++k) {
    if (k > 0) calls += ",";
    calls += R"({"type": "object", "required": ["name", "arguments"], "properties": {"name":)"
             R"( {"const": "tool)" +
             std::to_string(k) + R"("}, "arguments": )" + arguments + "}}";
  }
  return calls + "]}";
}

void BM_CompileSchema(benchmark::State& state) {
  const std::string schema = CompileCase(static_cast<int>(state.range(0)));
  size_t nodes = 0, regex_states = 0;
  for (auto _ : state) {
    absl::StatusOr<Grammar> g = CompileJsonSchemaText(schema);
    if (!g.ok()) {
      state.SkipWithError(std::string(g.status().message()).c_str());
      break;
    }
    nodes = g->nodes.size();
    regex_states = 0;
    for (const RegexDfa& r : g->regexes) regex_states += r.num_states();
    benchmark::DoNotOptimize(g->root);
  }
  state.counters["nodes"] = static_cast<double>(nodes);
  state.counters["regex_states"] = static_cast<double>(regex_states);
  state.SetLabel(state.range(0) == 0   ? "pydantic model"
                 : state.range(0) == 1 ? "formats, pattern"
                                       : "8-tool call");
}
BENCHMARK(BM_CompileSchema)->DenseRange(0, 2)->Unit(benchmark::kMicrosecond);

// A mask from scratch where characters follow an automaton (no plain-string shortcut): inside a
// date-time string, inside a pattern, and guided_regex's raw text.
void BM_ComputeMaskUnderPattern(benchmark::State& state) {
  struct Case {
    std::string schema_or_regex;
    std::string prefix;
    bool regex;
  };
  const Case cases[] = {
      {CompileCase(1), R"({"when": "2024-0)", false},
      {CompileCase(1), R"({"when": "2024-05-06T10:20:30Z", "mail": "ann.l)", false},
      {"[A-Z][a-z]{2,12} [A-Z][a-z]{2,12}( [0-9]{1,4})?", "Ann Le", true},
  };
  const Case& c = cases[state.range(0)];
  absl::StatusOr<Grammar> g =
      c.regex ? RegexGrammar(c.schema_or_regex) : CompileJsonSchemaText(c.schema_or_regex);
  if (!g.ok()) {
    state.SkipWithError(std::string(g.status().message()).c_str());
    return;
  }
  MeasureComputeMask(state, *g, c.prefix);
}
BENCHMARK(BM_ComputeMaskUnderPattern)->DenseRange(0, 2)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace mobius::grammar

BENCHMARK_MAIN();
