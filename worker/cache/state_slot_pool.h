// Fixed-size recurrent state for the DeltaNet layers, one slot per running sequence: per layer
// a conv state [slots, conv_dim, K-1] and an fp32 delta-rule state [slots, Hv, Dk, Dv]. The
// state does not grow with sequence length, so a slot is all a sequence ever needs.
#ifndef MOBIUS_WORKER_CACHE_STATE_SLOT_POOL_H_
#define MOBIUS_WORKER_CACHE_STATE_SLOT_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "worker/cache/sequence_cache.h"

namespace mobius::worker {

struct StateSlotPoolOptions {
  int num_layers = 0;  // DeltaNet layers
  int conv_dim = 0;
  int conv_kernel = 0;
  int num_v_heads = 0;
  int k_head_dim = 0;
  int v_head_dim = 0;
  int num_slots = 0;
};

class StateSlotPool {
 public:
  static absl::StatusOr<std::unique_ptr<StateSlotPool>> Create(const StateSlotPoolOptions& options,
                                                               kernels::Backend& backend);

  // Gives `seq` a slot with zeroed state (a fresh sequence). ResourceExhausted when none free.
  absl::Status Acquire(SequenceCache& seq);
  void Release(SequenceCache& seq);
  // Zeroes `slot` as Acquire does, without taking it from the free list: a follower rank of a
  // replica repeats the leader's acquisitions this way (the leader owns the bookkeeping).
  absl::Status Reset(int slot);

  [[nodiscard]] int free_slots() const { return static_cast<int>(free_.size()); }
  [[nodiscard]] int num_slots() const { return options_.num_slots; }
  [[nodiscard]] int num_layers() const { return options_.num_layers; }
  [[nodiscard]] kernels::Tensor& conv_states(int layer) { return conv_[layer]; }
  [[nodiscard]] kernels::Tensor& recurrent_states(int layer) { return recurrent_[layer]; }
  [[nodiscard]] int64_t bytes_per_slot() const;

 private:
  StateSlotPool(const StateSlotPoolOptions& options, kernels::Backend& backend)
      : options_(options), backend_(backend) {}

  StateSlotPoolOptions options_;
  kernels::Backend& backend_;
  std::vector<kernels::Tensor> conv_;
  std::vector<kernels::Tensor> recurrent_;
  std::vector<int32_t> free_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_CACHE_STATE_SLOT_POOL_H_
