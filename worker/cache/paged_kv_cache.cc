#include "worker/cache/paged_kv_cache.h"

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace mobius::worker {

absl::StatusOr<std::unique_ptr<PagedKvCache>> PagedKvCache::Create(
    const PagedKvCacheOptions& options, kernels::Backend& backend) {
  if (options.block_size <= 0 || options.num_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV cache: block_size (%d) must be positive and num_blocks (%d) non-negative",
        options.block_size, options.num_blocks));
  }
  std::unique_ptr<PagedKvCache> cache(new PagedKvCache(options));
  cache->dtype_ = backend.activation_dtype();
  const std::vector<int64_t> shape = {options.num_blocks, options.block_size, options.num_kv_heads,
                                      options.head_dim};
  for (int l = 0; l < options.num_layers; ++l) {
    ASSIGN_OR_RETURN(kernels::Tensor k, backend.Allocate(cache->dtype_, shape));
    ASSIGN_OR_RETURN(kernels::Tensor v, backend.Allocate(cache->dtype_, shape));
    cache->keys_.push_back(std::move(k));
    cache->values_.push_back(std::move(v));
  }
  // Hand out low block indices first.
  for (int b = options.num_blocks - 1; b >= 0; --b) cache->free_.push_back(b);
  return cache;
}

absl::Status PagedKvCache::Reserve(SequenceCache& seq, int num_tokens) {
  if (options_.num_layers == 0) return absl::OkStatus();
  const int needed = BlocksFor(num_tokens) - static_cast<int>(seq.kv_blocks.size());
  if (needed <= 0) return absl::OkStatus();
  if (needed > free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "KV cache: %d more blocks of %d tokens needed for %d tokens, only %d of %d free", needed,
        options_.block_size, num_tokens, free_blocks(), options_.num_blocks));
  }
  for (int i = 0; i < needed; ++i) {
    seq.kv_blocks.push_back(free_.back());
    free_.pop_back();
  }
  return absl::OkStatus();
}

void PagedKvCache::Release(SequenceCache& seq) {
  for (int32_t b : seq.kv_blocks) free_.push_back(b);
  seq.kv_blocks.clear();
}

int64_t PagedKvCache::bytes_per_token() const {
  return int64_t{2} * options_.num_layers * options_.num_kv_heads * options_.head_dim *
         static_cast<int64_t>(kernels::DTypeSize(dtype_));
}

}  // namespace mobius::worker
