// The tokenizer.json "model" of type BPE over the byte-level alphabet: a vocabulary and ranked
// merges that turn one pre-tokenised word into ids.
#ifndef MOBIUS_TOKENIZER_BPE_MODEL_H_
#define MOBIUS_TOKENIZER_BPE_MODEL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"

namespace mobius::tokenizer {

// Token ids (vocabulary entries and added tokens) must lie below this. Tables are indexed by id,
// so a corrupt file naming id 2^31 - 1 would otherwise ask for tens of GB; the largest real
// vocabularies are under 2^20.
inline constexpr int64_t kTokenIdLimit = int64_t{1} << 24;

class BpeModel {
 public:
  // Rejects settings that would change ids in ways this implementation does not reproduce
  // (dropout, byte_fallback, subword prefixes/suffixes), naming the setting.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model);

  // Appends the ids of `word`, given as raw bytes (the byte-level alphabet is applied here).
  // Runs in O(n log n) in the word's length. Thread-safe.
  void EncodeWord(std::string_view word, std::vector<int32_t>& ids) const;

  // Vocabulary lookups use the stored (byte-level alphabet) spelling of tokens.
  [[nodiscard]] std::optional<int32_t> TokenToId(std::string_view token) const;
  // Null for an id outside the vocabulary.
  [[nodiscard]] const std::string* IdToToken(int32_t id) const;
  [[nodiscard]] size_t vocab_size() const { return vocab_.size(); }
  // One past the largest id in the vocabulary.
  [[nodiscard]] int32_t id_limit() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };
  using CachedIds = absl::InlinedVector<int32_t, 4>;

  BpeModel() = default;
  [[nodiscard]] const Merge* FindMerge(int32_t left, int32_t right) const;
  // Initial symbols of `word`: one per byte, unknown bytes resolved as the model says.
  void InitialSymbols(std::string_view word, std::vector<int32_t>& symbols) const;
  void MergeShort(std::vector<int32_t>& symbols) const;
  void MergeLong(std::vector<int32_t>& symbols) const;
  void MergeVeryLong(std::vector<int32_t>& symbols) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_present_;
  std::array<int32_t, 256> byte_to_id_{};
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  // True when every merge's inputs are produced only by lower-ranked merges (true of merges
  // learned by BPE training). Then a merge only ever creates pairs of higher rank, and very long
  // words can be merged rank by rank instead of through a heap.
  bool merges_are_ordered_ = false;
  size_t num_merges_ = 0;

  // Natural text repeats words constantly; remembering their ids skips the merge loop.
  mutable absl::Mutex cache_mutex_;
  mutable absl::flat_hash_map<std::string, CachedIds> cache_ ABSL_GUARDED_BY(cache_mutex_);
  // Once the cache holds kMaxCacheEntries words, misses stop taking the writer lock.
  mutable std::atomic<bool> cache_full_{false};
};

}  // namespace mobius::tokenizer

#endif  // MOBIUS_TOKENIZER_BPE_MODEL_H_
