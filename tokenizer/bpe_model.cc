#include "tokenizer/bpe_model.h"

#include <algorithm>
#include <optional>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/json_fields.h"

namespace mobius::tokenizer {
namespace {

// Words up to this many symbols are merged by rescanning a small array, which beats a heap for
// the short words of natural text.
constexpr size_t kShortWordSymbols = 48;
// Words from this many symbols on use the rank-by-rank merge when the merges allow it; its
// per-rank buckets cost more to set up than a heap but far less per merge.
constexpr size_t kVeryLongWordSymbols = 4096;
// Bounds on what the word cache keeps, so adversarial input cannot grow it without limit.
constexpr size_t kMaxCachedWordBytes = 64;
constexpr size_t kMaxCacheEntries = size_t{1} << 18;

// This Abseil build has its own string_view type, so heterogeneous lookups convert explicitly.
absl::string_view AsAbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

absl::Status CheckEmptyString(const nlohmann::json& model, const char* key) {
  if (!model.contains(key) || model[key].is_null()) return absl::OkStatus();
  if (model[key].is_string() && model[key].get<std::string>().empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json model: unsupported BPE setting \"",
                                                 key, "\" = ", model[key].dump(),
                                                 " (only empty is supported)"));
}

absl::Status CheckFalse(const nlohmann::json& model, const char* key) {
  if (!model.contains(key) || model[key].is_null()) return absl::OkStatus();
  if (model[key].is_boolean() && !model[key].get<bool>()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json model: unsupported BPE setting \"",
                                                 key, "\" = ", model[key].dump()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const nlohmann::json& model) {
  if (!model.is_object()) return absl::InvalidArgumentError("tokenizer.json: missing \"model\"");
  constexpr char kSection[] = "tokenizer.json model";
  ASSIGN_OR_RETURN(const std::optional<std::string> type_field,
                   OptionalString(model, "type", kSection));
  const std::string type = type_field.value_or("BPE");
  if (type != "BPE") {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json model: unsupported type \"", type, "\" (supported: BPE)"));
  }
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer.json model: unsupported BPE setting \"dropout\" = ", model["dropout"].dump(),
        " (dropout makes encoding random)"));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (absl::Status s = CheckEmptyString(model, key); !s.ok()) return s;
  }
  if (absl::Status s = CheckFalse(model, "byte_fallback"); !s.ok()) return s;
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError("tokenizer.json model: \"vocab\" must be an object");
  }
  if (!model.contains("merges") || !model["merges"].is_array()) {
    return absl::InvalidArgumentError("tokenizer.json model: \"merges\" must be an array");
  }

  auto bpe = std::unique_ptr<BpeModel>(new BpeModel());
  const nlohmann::json& vocab = model["vocab"];
  bpe->vocab_.reserve(vocab.size());
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 ||
        id_json.get<int64_t>() >= kTokenIdLimit) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json model: vocab entry \"", token, "\" has an invalid id ",
                       id_json.dump(), " (ids must be integers in [0, ", kTokenIdLimit, "))"));
    }
    const auto id = static_cast<int32_t>(id_json.get<int64_t>());
    bpe->vocab_[token] = id;
    if (static_cast<size_t>(id) >= bpe->id_to_token_.size()) {
      bpe->id_to_token_.resize(id + 1);
      bpe->id_present_.resize(id + 1, false);
    }
    bpe->id_to_token_[id] = token;
    bpe->id_present_[id] = true;
  }

  for (int b = 0; b < 256; ++b) {
    const auto it = bpe->vocab_.find(BytesToAlphabet(std::string(1, static_cast<char>(b))));
    bpe->byte_to_id_[b] = it == bpe->vocab_.end() ? -1 : it->second;
  }

  const nlohmann::json& merges = model["merges"];
  bpe->merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const nlohmann::json& entry = merges[rank];
    std::string left;
    std::string right;
    if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else if (entry.is_string()) {
      // The older format stores each merge as "left right".
      const std::string text = entry.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.json model: merge ", rank, " (\"", text, "\") is malformed"));
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json model: merge ", rank, " is malformed"));
    }
    const auto left_it = bpe->vocab_.find(left);
    const auto right_it = bpe->vocab_.find(right);
    const auto merged_it = bpe->vocab_.find(left + right);
    if (left_it == bpe->vocab_.end() || right_it == bpe->vocab_.end() ||
        merged_it == bpe->vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json model: merge ", rank, " (\"",
                                                     left, "\", \"", right,
                                                     "\") uses a token missing from the vocab"));
    }
    // Like the reference, a repeated pair keeps its last rank.
    bpe->merges_[PairKey(left_it->second, right_it->second)] = {static_cast<uint32_t>(rank),
                                                                merged_it->second};
  }
  bpe->num_merges_ = merges.size();
  // Highest rank of a merge that produces each token (-1: none, e.g. single bytes).
  absl::flat_hash_map<int32_t, int64_t> produced_at;
  for (const auto& [key, merge] : bpe->merges_) {
    int64_t& rank = produced_at.try_emplace(merge.new_id, -1).first->second;
    rank = std::max<int64_t>(rank, merge.rank);
  }
  bpe->merges_are_ordered_ = true;
  for (const auto& [key, merge] : bpe->merges_) {
    for (const auto input : {static_cast<int32_t>(key >> 32), static_cast<int32_t>(key)}) {
      const auto it = produced_at.find(input);
      if (it != produced_at.end() && it->second >= merge.rank) bpe->merges_are_ordered_ = false;
    }
  }

  ASSIGN_OR_RETURN(const std::optional<std::string> unk_token,
                   OptionalString(model, "unk_token", kSection));
  if (unk_token.has_value()) {
    const std::string& unk = *unk_token;
    const auto it = bpe->vocab_.find(unk);
    if (it == bpe->vocab_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json model: unk_token \"", unk, "\" is not in the vocab"));
    }
    bpe->unk_id_ = it->second;
  }
  ASSIGN_OR_RETURN(bpe->fuse_unk_, OptionalBool(model, "fuse_unk", false, kSection));
  ASSIGN_OR_RETURN(bpe->ignore_merges_, OptionalBool(model, "ignore_merges", false, kSection));
  return bpe;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  const auto it = vocab_.find(AsAbslView(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !id_present_[id]) {
    return nullptr;
  }
  return &id_to_token_[id];
}

const BpeModel::Merge* BpeModel::FindMerge(int32_t left, int32_t right) const {
  const auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

void BpeModel::InitialSymbols(std::string_view word, std::vector<int32_t>& symbols) const {
  symbols.reserve(word.size());
  for (char c : word) {
    const int32_t id = byte_to_id_[static_cast<uint8_t>(c)];
    if (id >= 0) {
      symbols.push_back(id);
    } else if (unk_id_.has_value()) {
      if (!(fuse_unk_ && !symbols.empty() && symbols.back() == *unk_id_)) {
        symbols.push_back(*unk_id_);
      }
    }
    // Without an unk token the reference drops bytes missing from the vocabulary.
  }
}

void BpeModel::MergeShort(std::vector<int32_t>& symbols) const {
  // ranks[i] is the rank of the merge of symbols[i] and symbols[i + 1] (UINT32_MAX if none).
  absl::InlinedVector<uint32_t, kShortWordSymbols> ranks(symbols.size(), UINT32_MAX);
  absl::InlinedVector<int32_t, kShortWordSymbols> merged(symbols.size(), -1);
  const auto refresh = [&](size_t i) {
    const Merge* merge = FindMerge(symbols[i], symbols[i + 1]);
    ranks[i] = merge == nullptr ? UINT32_MAX : merge->rank;
    merged[i] = merge == nullptr ? -1 : merge->new_id;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) refresh(i);
  while (symbols.size() > 1) {
    // The lowest rank wins; among equal ranks (the same pair repeated) the leftmost.
    size_t best = 0;
    for (size_t i = 1; i + 1 < symbols.size(); ++i) {
      if (ranks[i] < ranks[best]) best = i;
    }
    if (ranks[best] == UINT32_MAX) break;
    symbols[best] = merged[best];
    symbols.erase(symbols.begin() + best + 1);
    ranks.erase(ranks.begin() + best + 1);
    merged.erase(merged.begin() + best + 1);
    ranks.resize(symbols.size());
    merged.resize(symbols.size());
    if (best + 1 < symbols.size())
      refresh(best);
    else
      ranks[best] = UINT32_MAX;
    if (best > 0) refresh(best - 1);
  }
}

void BpeModel::MergeLong(std::vector<int32_t>& symbols) const {
  // A doubly linked list over the symbols plus a min-heap of candidate merges keyed by
  // (rank, position). Entries go stale when a neighbour changes; they are recognised on pop by
  // checking that the pair at that position still has the same rank.
  const auto n = static_cast<int32_t>(symbols.size());
  std::vector<int32_t> prev(n);
  std::vector<int32_t> next(n);
  std::vector<bool> alive(n, true);
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  using Candidate = std::pair<uint32_t, int32_t>;  // (rank, left position)
  std::vector<Candidate> initial;
  initial.reserve(n);
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const Merge* merge = FindMerge(symbols[i], symbols[i + 1]); merge != nullptr) {
      initial.emplace_back(merge->rank, i);
    }
  }
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap(std::greater<>(),
                                                                              std::move(initial));
  while (!heap.empty()) {
    const auto [rank, left] = heap.top();
    heap.pop();
    if (!alive[left] || next[left] < 0) continue;
    const int32_t right = next[left];
    const Merge* merge = FindMerge(symbols[left], symbols[right]);
    if (merge == nullptr || merge->rank != rank) continue;
    symbols[left] = merge->new_id;
    alive[right] = false;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    if (prev[left] >= 0) {
      if (const Merge* m = FindMerge(symbols[prev[left]], symbols[left]); m != nullptr) {
        heap.emplace(m->rank, prev[left]);
      }
    }
    if (next[left] >= 0) {
      if (const Merge* m = FindMerge(symbols[left], symbols[next[left]]); m != nullptr) {
        heap.emplace(m->rank, left);
      }
    }
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0 && i < n; i = next[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

void BpeModel::MergeVeryLong(std::vector<int32_t>& symbols) const {
  // Same result as MergeLong: all candidates of one rank exist before the first of them is
  // applied (merges only create higher ranks), so applying ranks in increasing order, and each
  // rank's positions left to right, reproduces the (rank, position) heap order.
  const auto n = static_cast<int32_t>(symbols.size());
  std::vector<int32_t> prev(n);
  std::vector<int32_t> next(n);
  std::vector<bool> alive(n, true);
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  std::vector<std::vector<int32_t>> buckets(num_merges_);
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const Merge* merge = FindMerge(symbols[i], symbols[i + 1]); merge != nullptr) {
      buckets[merge->rank].push_back(i);
    }
  }
  for (size_t rank = 0; rank < buckets.size(); ++rank) {
    std::vector<int32_t> positions = std::move(buckets[rank]);
    if (positions.empty()) continue;
    if (!std::is_sorted(positions.begin(), positions.end())) {
      std::sort(positions.begin(), positions.end());
    }
    for (const int32_t left : positions) {
      if (!alive[left] || next[left] < 0) continue;
      const int32_t right = next[left];
      const Merge* merge = FindMerge(symbols[left], symbols[right]);
      if (merge == nullptr || merge->rank != rank) continue;
      symbols[left] = merge->new_id;
      alive[right] = false;
      next[left] = next[right];
      if (next[right] >= 0) prev[next[right]] = left;
      if (prev[left] >= 0) {
        if (const Merge* m = FindMerge(symbols[prev[left]], symbols[left]); m != nullptr) {
          buckets[m->rank].push_back(prev[left]);
        }
      }
      if (next[left] >= 0) {
        if (const Merge* m = FindMerge(symbols[left], symbols[next[left]]); m != nullptr) {
          buckets[m->rank].push_back(left);
        }
      }
    }
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0 && i < n; i = next[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

void BpeModel::EncodeWord(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    absl::ReaderMutexLock lock(&cache_mutex_);
    const auto it = cache_.find(AsAbslView(word));
    if (it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  // Reused by all words of a thread, which saves an allocation per word.
  thread_local std::vector<int32_t> scratch;
  std::vector<int32_t>& symbols = scratch;
  symbols.clear();
  bool whole_word = false;
  if (ignore_merges_) {
    if (const auto it = vocab_.find(BytesToAlphabet(word)); it != vocab_.end()) {
      symbols.push_back(it->second);
      whole_word = true;
    }
  }
  if (!whole_word) {
    InitialSymbols(word, symbols);
    if (symbols.size() <= kShortWordSymbols) {
      MergeShort(symbols);
    } else if (symbols.size() >= kVeryLongWordSymbols && merges_are_ordered_) {
      MergeVeryLong(symbols);
    } else {
      MergeLong(symbols);
    }
  }
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  if (cacheable && !cache_full_.load(std::memory_order_relaxed)) {
    absl::MutexLock lock(&cache_mutex_);
    cache_.try_emplace(std::string(word), CachedIds(symbols.begin(), symbols.end()));
    if (cache_.size() >= kMaxCacheEntries) cache_full_.store(true, std::memory_order_relaxed);
  }
  // Do not keep the memory of a giant word alive for the rest of the thread.
  if (symbols.capacity() > kVeryLongWordSymbols) std::vector<int32_t>().swap(symbols);
}

}  // namespace mobius::tokenizer
