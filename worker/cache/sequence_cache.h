// What the caches hold for one sequence: its DeltaNet state slot, its paged-KV block table and
// how many tokens have been processed into them.
#ifndef MOBIUS_WORKER_CACHE_SEQUENCE_CACHE_H_
#define MOBIUS_WORKER_CACHE_SEQUENCE_CACHE_H_

#include <cstdint>
#include <vector>

namespace mobius::worker {

struct SequenceCache {
  int32_t state_slot = -1;         // StateSlotPool slot, -1 when none
  std::vector<int32_t> kv_blocks;  // PagedKvCache blocks, in position order
  int32_t num_tokens = 0;          // tokens already in the caches
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_CACHE_SEQUENCE_CACHE_H_
