#include "grammar/structured_output.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grammar/json_schema_compiler.h"

namespace mobius::grammar {

std::string StructuredOutputSpec::Key() const {
  if (!reasoning_end.empty()) {
    StructuredOutputSpec inner = *this;
    inner.reasoning_end.clear();
    return absl::StrCat("reasoning:", reasoning_end.size(), ":", reasoning_end, inner.Key());
  }
  switch (kind) {
    case Kind::kNone:
      return "none";
    case Kind::kJsonObject:
      return "json_object";
    case Kind::kJsonSchema:
      return absl::StrCat("json_schema:", json_schema);
    case Kind::kRegex:
      return absl::StrCat("regex:", regex);
    case Kind::kTaggedJson:
      // Length-prefixed, so that no two triples share a key.
      return absl::StrCat("tagged:", max_blocks, ":", separator.size(), ":", separator,
                          begin.size(), ":", begin, end.size(), ":", end, json_schema);
    case Kind::kChoice: {
      // Length-prefixed, so that no two lists share a key.
      std::string key = "choice";
      for (const std::string& c : choices) absl::StrAppend(&key, ":", c.size(), ":", c);
      return key;
    }
  }
  return "";
}

absl::StatusOr<Grammar> CompileStructuredOutput(const StructuredOutputSpec& spec) {
  if (!spec.reasoning_end.empty()) {
    StructuredOutputSpec inner = spec;
    inner.reasoning_end.clear();
    absl::StatusOr<Grammar> g = CompileStructuredOutput(inner);
    if (!g.ok()) return g.status();
    if (absl::Status s = AddReasoningBlock(*g, spec.reasoning_end); !s.ok()) return s;
    return g;
  }
  switch (spec.kind) {
    case StructuredOutputSpec::Kind::kJsonSchema:
      return CompileJsonSchemaText(spec.json_schema);
    case StructuredOutputSpec::Kind::kJsonObject:
      return JsonObjectGrammar();
    case StructuredOutputSpec::Kind::kChoice:
      return ChoiceGrammar(spec.choices);
    case StructuredOutputSpec::Kind::kTaggedJson:
      return TaggedJsonGrammar(spec.begin, spec.json_schema, spec.end, spec.max_blocks,
                               spec.separator);
    case StructuredOutputSpec::Kind::kRegex:
      return RegexGrammar(spec.regex);
    case StructuredOutputSpec::Kind::kNone:
      break;
  }
  return absl::InvalidArgumentError("no structured output was asked for");
}

std::shared_ptr<const TokenBitmask> CompiledGrammar::Mask(const GrammarMatcher& state,
                                                          const TokenVocabulary& vocab) {
  std::string key;
  state.AppendStateKey(key, static_cast<int>(vocab.max_token_bytes()));
  {
    absl::MutexLock lock(&mu_);
    if (auto it = masks_.find(key); it != masks_.end()) return it->second;
  }
  // Computed outside the lock: another thread may compute the same mask meanwhile, which only
  // costs the time.
  auto mask = std::make_shared<TokenBitmask>();
  vocab.ComputeMask(state, *mask);
  absl::MutexLock lock(&mu_);
  ++masks_computed_;
  if (masks_.size() >= kMaxMasks) masks_.clear();  // a state space this large rarely repeats
  masks_.emplace(std::move(key), mask);
  return mask;
}

int64_t CompiledGrammar::masks_computed() const {
  absl::MutexLock lock(&mu_);
  return masks_computed_;
}

absl::StatusOr<std::shared_ptr<CompiledGrammar>> GrammarCache::Get(
    const StructuredOutputSpec& spec) {
  const std::string key = spec.Key();
  {
    absl::MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->first != key) continue;
      entries_.splice(entries_.begin(), entries_, it);
      return entries_.front().second;
    }
  }
  absl::StatusOr<Grammar> grammar = CompileStructuredOutput(spec);
  if (!grammar.ok()) return grammar.status();
  auto compiled = std::make_shared<CompiledGrammar>(*std::move(grammar));
  absl::MutexLock lock(&mu_);
  entries_.emplace_front(key, compiled);
  while (entries_.size() > capacity_) entries_.pop_back();
  return compiled;
}

TokenConstraint::TokenConstraint(std::shared_ptr<CompiledGrammar> grammar,
                                 std::shared_ptr<const TokenVocabulary> vocab,
                                 std::vector<int32_t> end_tokens)
    : grammar_(std::move(grammar)),
      vocab_(std::move(vocab)),
      end_tokens_(std::move(end_tokens)),
      matcher_(grammar_->grammar()) {}

namespace {

// The ids set in `bits` (sorted), with `end_tokens` exactly when `accepting`.
void ListAllowed(const TokenBitmask& bits, bool accepting, std::span<const int32_t> end_tokens,
                 std::vector<int32_t>& out) {
  out.clear();
  for (size_t w = 0; w < bits.size(); ++w) {
    for (uint64_t word = bits[w]; word != 0; word &= word - 1) {
      out.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(word))));
    }
  }
  if (end_tokens.empty()) return;
  if (accepting) {
    out.insert(out.end(), end_tokens.begin(), end_tokens.end());
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  } else {
    // An end token ends the output whatever its bytes (a model's end-of-sequence id may spell
    // text in its tokenizer): it is offered only where the value is complete.
    std::erase_if(out, [&](int32_t id) {
      return std::find(end_tokens.begin(), end_tokens.end(), id) != end_tokens.end();
    });
  }
}

}  // namespace

void TokenConstraint::AllowedTokens(std::vector<int32_t>& out) const {
  const std::shared_ptr<const TokenBitmask> mask = grammar_->Mask(matcher_, *vocab_);
  ListAllowed(*mask, matcher_.Accepting(), end_tokens_, out);
}

void TokenConstraint::NextMask(std::vector<uint64_t>& out) const {
  const std::shared_ptr<const TokenBitmask> mask = grammar_->Mask(matcher_, *vocab_);
  out.assign(mask->begin(), mask->end());
  // The end tokens follow the value's completeness, whatever the mask says of them.
  const bool accepting = matcher_.Accepting();
  for (int32_t id : end_tokens_) {
    const size_t w = static_cast<size_t>(id) / 64;
    if (id < 0 || w >= out.size()) continue;
    const uint64_t bit = uint64_t{1} << (id % 64);
    out[w] = accepting ? out[w] | bit : out[w] & ~bit;
  }
}

bool TokenConstraint::Accept(int32_t token) {
  const std::string_view bytes = vocab_->bytes(token);
  if (bytes.empty()) return false;
  GrammarMatcher next(grammar_->grammar());
  next.CopyFrom(matcher_);
  if (!next.FeedBytes(bytes)) return false;
  matcher_.CopyFrom(next);
  return true;
}

}  // namespace mobius::grammar
