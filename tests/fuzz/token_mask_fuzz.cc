// Fuzzes structured output's token masks over the Qwen3 vocabulary: for a fuzzed spec and the
// states a fuzzed output walks through, the mask (the trie walk, with its plain-string shortcut)
// must allow exactly the tokens whose bytes the matcher accepts from that state, and two states
// with the same mask-cache key must have the same mask (the cache hands one state's mask to the
// other). A wrong bit either way is a wrong constraint: a token the grammar forbids, or a valid
// answer the model cannot give.
//
// Input: structured_output_input.h (a schema, a regex, choices or any object).
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "grammar/grammar_matcher.h"
#include "grammar/structured_output.h"
#include "grammar/token_mask.h"
#include "grammar/tokenizer_vocabulary.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_files.h"
#include "tests/fuzz/structured_output_input.h"
#include "tests/grammar/brute_force_mask.h"
#include "tokenizer/tokenizer.h"

namespace {

using mobius::grammar::GrammarMatcher;
using mobius::grammar::TokenBitmask;
using mobius::grammar::TokenVocabulary;

std::shared_ptr<const TokenVocabulary> g_vocab;

// States whose masks are checked per input: each check walks the whole vocabulary.
constexpr int kStatesChecked = 4;

std::string FirstDifference(const TokenBitmask& fast, const TokenBitmask& slow) {
  for (size_t id = 0; id < g_vocab->size(); ++id) {
    const bool a = mobius::grammar::TestToken(fast, static_cast<int32_t>(id));
    const bool b = mobius::grammar::TestToken(slow, static_cast<int32_t>(id));
    if (a != b) {
      return "token " + std::to_string(id) + " \"" + std::string(g_vocab->bytes(id)) + "\": mask " +
             (a ? "allows" : "forbids") + " it, the matcher " + (b ? "accepts" : "refuses") + " it";
    }
  }
  return "";
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const auto tokenizer = mobius::fuzz::QwenTokenizerOrDie();
  g_vocab = mobius::grammar::VocabularyFromTokenizer(*tokenizer, tokenizer->id_limit());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mobius::fuzz::InputCursor input(data, size);
  // The kinds without their own tags (tool calls, reasoning), whose masks are those of a schema.
  auto [spec, output] = mobius::fuzz::ReadStructuredOutputInput(input, /*kinds=*/4);
  auto grammar = mobius::grammar::CompileStructuredOutput(spec);
  if (!grammar.ok()) return 0;
  mobius::grammar::CompiledGrammar compiled(*std::move(grammar));
  const mobius::grammar::Grammar& g = compiled.grammar();

  // The states to check: the start and up to kStatesChecked - 1 more, spread over the output.
  GrammarMatcher state(g);
  GrammarMatcher next(g);
  std::map<std::string, TokenBitmask> by_key;
  const size_t stride = output.size() / kStatesChecked + 1;
  const int horizon = static_cast<int>(g_vocab->max_token_bytes());
  for (size_t pos = 0;; ++pos) {
    if (pos % stride == 0) {
      TokenBitmask fast;
      g_vocab->ComputeMask(state, fast);
      const TokenBitmask slow = mobius::grammar::testing::BruteForceMask(state, *g_vocab);
      FUZZ_CHECK(fast == slow,
                 "at byte " + std::to_string(pos) + ": " + FirstDifference(fast, slow));
      std::string key;
      state.AppendStateKey(key, horizon);
      const auto [it, inserted] = by_key.emplace(key, fast);
      FUZZ_CHECK(inserted || it->second == fast,
                 "two states with one cache key have different masks (at byte " +
                     std::to_string(pos) + ")");
      const auto cached = compiled.Mask(state, *g_vocab);
      FUZZ_CHECK(cached != nullptr && *cached == fast, "the cached mask differs");
    }
    if (pos >= output.size()) break;
    next.CopyFrom(state);
    if (!next.Feed(static_cast<uint8_t>(output[pos]))) break;
    state.CopyFrom(next);
  }
  return 0;
}
