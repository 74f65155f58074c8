// Paged key/value storage for the full-attention layers: per layer, K and V tensors of
// [num_blocks, block_size, kv_heads, head_dim], and one allocator of blocks shared by all layers
// (a block index addresses the same positions in every layer).
#ifndef MOBIUS_WORKER_CACHE_PAGED_KV_CACHE_H_
#define MOBIUS_WORKER_CACHE_PAGED_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/cache/sequence_cache.h"

namespace mobius::worker {

struct PagedKvCacheOptions {
  int num_layers = 0;  // full-attention layers
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;
  int num_blocks = 0;
};

class PagedKvCache {
 public:
  static absl::StatusOr<std::unique_ptr<PagedKvCache>> Create(const PagedKvCacheOptions& options,
                                                              kernels::Backend& backend);

  // Grows `seq`'s block table to cover `num_tokens` positions. ResourceExhausted (and no
  // change) when too few blocks are free.
  absl::Status Reserve(SequenceCache& seq, int num_tokens);
  // Returns every block of `seq` to the pool.
  void Release(SequenceCache& seq);

  [[nodiscard]] int BlocksFor(int num_tokens) const {
    return (num_tokens + options_.block_size - 1) / options_.block_size;
  }
  [[nodiscard]] int free_blocks() const { return static_cast<int>(free_.size()); }
  [[nodiscard]] int num_blocks() const { return options_.num_blocks; }
  [[nodiscard]] int block_size() const { return options_.block_size; }
  [[nodiscard]] kernels::Tensor& keys(int layer) { return keys_[layer]; }
  [[nodiscard]] kernels::Tensor& values(int layer) { return values_[layer]; }
  // Bytes of K and V per token over all layers.
  [[nodiscard]] int64_t bytes_per_token() const;

 private:
  explicit PagedKvCache(const PagedKvCacheOptions& options) : options_(options) {}

  PagedKvCacheOptions options_;
  kernels::DType dtype_ = kernels::DType::kF32;
  std::vector<kernels::Tensor> keys_;
  std::vector<kernels::Tensor> values_;
  std::vector<int32_t> free_;  // a stack of free block indices
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_CACHE_PAGED_KV_CACHE_H_
