// Structured output for one request: what the request asked for (StructuredOutputSpec), its
// compiled grammar shared by every request that asks the same (GrammarCache, with the token
// masks of the states seen so far), and the request's own walk through it (TokenConstraint).
#ifndef MOBIUS_GRAMMAR_STRUCTURED_OUTPUT_H_
#define MOBIUS_GRAMMAR_STRUCTURED_OUTPUT_H_

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grammar/grammar.h"
#include "grammar/grammar_matcher.h"
#include "grammar/token_mask.h"

namespace mobius::grammar {

struct StructuredOutputSpec {
  enum class Kind { kNone, kJsonSchema, kJsonObject, kChoice, kTaggedJson, kRegex };
  Kind kind = Kind::kNone;
  std::string json_schema;           // kJsonSchema, kTaggedJson: the schema's JSON text
  std::vector<std::string> choices;  // kChoice
  std::string regex;                 // kRegex: the pattern the whole output matches
  std::string begin, end;            // kTaggedJson: raw text around the value
  int32_t max_blocks = 1;            // kTaggedJson: blocks (-1: no limit), `separator` between
  std::string separator;
  // Non-empty: free text up to and including this marker (and whitespace) comes first, the form
  // after it (a reasoning model's "<think>...</think>").
  std::string reasoning_end;
  // A text that identifies the spec (equal specs, equal keys).
  [[nodiscard]] std::string Key() const;
};

// InvalidArgument (naming the schema location and why) when the spec cannot be compiled.
absl::StatusOr<Grammar> CompileStructuredOutput(const StructuredOutputSpec& spec);

// A compiled grammar and the token masks of the matcher states seen so far: states repeat
// (every byte inside a plain string value leaves the same state), so most steps find theirs.
class CompiledGrammar {
 public:
  explicit CompiledGrammar(Grammar grammar) : grammar_(std::move(grammar)) {}
  [[nodiscard]] const Grammar& grammar() const { return grammar_; }
  // The mask of `state`'s next tokens, computed on the first call for an equal state.
  std::shared_ptr<const TokenBitmask> Mask(const GrammarMatcher& state,
                                           const TokenVocabulary& vocab);
  [[nodiscard]] int64_t masks_computed() const;

 private:
  // Masks kept per grammar (~19 KB each at a 151K vocabulary: 4.9 MB). A miss costs 0.03-0.12
  // ms in most states (performance.md, "Structured output"); within a token's length of a
  // string's maxLength, or inside a UTF-8 character, it is the whole walk (~5 ms).
  static constexpr size_t kMaxMasks = 256;
  Grammar grammar_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const TokenBitmask>> masks_ ABSL_GUARDED_BY(mu_);
  int64_t masks_computed_ ABSL_GUARDED_BY(mu_) = 0;
};

// Compiled grammars by spec, the most recently used kept (with their masks: at most ~160 MB at
// a 151K vocabulary; requests in flight keep theirs alive past eviction).
class GrammarCache {
 public:
  explicit GrammarCache(size_t capacity = 32) : capacity_(capacity) {}
  absl::StatusOr<std::shared_ptr<CompiledGrammar>> Get(const StructuredOutputSpec& spec);

 private:
  const size_t capacity_;
  absl::Mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<CompiledGrammar>>> entries_
      ABSL_GUARDED_BY(mu_);  // most recent first
};

// One request's position in its grammar, in tokens.
class TokenConstraint {
 public:
  // `end_tokens`: the request's end-of-sequence and stop tokens, which end the output whatever
  // their bytes: offered exactly when the output is a complete value.
  TokenConstraint(std::shared_ptr<CompiledGrammar> grammar,
                  std::shared_ptr<const TokenVocabulary> vocab, std::vector<int32_t> end_tokens);

  // The tokens that may come next, sorted: those the grammar allows, and the end tokens when
  // the output is a complete value.
  void AllowedTokens(std::vector<int32_t>& out) const;
  // The same set as a bitmask over the vocabulary (token t allowed when bit t % 64 of word t / 64
  // is set): the state's cached mask, copied (~31 KB at a 248K vocabulary), with the end tokens
  // set as above. What a step's draw applies (kernels::LogitPenalties::allowed_mask): its size
  // does not depend on the set, where a list inside a string names ~147K allowed or, with the
  // model's vocabulary padded past the tokenizer's, ~100K banned ids.
  void NextMask(std::vector<uint64_t>& out) const;
  // Advances past `token`; false (nothing changed) when the grammar does not allow it.
  bool Accept(int32_t token);
  // The output is a complete value and nothing can follow it: generation must end.
  [[nodiscard]] bool Finished() const { return matcher_.Finished(); }
  [[nodiscard]] bool Accepting() const { return matcher_.Accepting(); }

 private:
  std::shared_ptr<CompiledGrammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  std::vector<int32_t> end_tokens_;
  GrammarMatcher matcher_;
};

}  // namespace mobius::grammar

#endif  // MOBIUS_GRAMMAR_STRUCTURED_OUTPUT_H_
