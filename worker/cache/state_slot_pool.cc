#include "worker/cache/state_slot_pool.h"

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace mobius::worker {

absl::StatusOr<std::unique_ptr<StateSlotPool>> StateSlotPool::Create(
    const StateSlotPoolOptions& options, kernels::Backend& backend) {
  if (options.num_slots < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("state slots: num_slots (%d) must not be negative", options.num_slots));
  }
  std::unique_ptr<StateSlotPool> pool(new StateSlotPool(options, backend));
  for (int l = 0; l < options.num_layers; ++l) {
    ASSIGN_OR_RETURN(kernels::Tensor conv,
                     backend.Allocate(kernels::DType::kF32, {options.num_slots, options.conv_dim,
                                                             options.conv_kernel - 1}));
    ASSIGN_OR_RETURN(
        kernels::Tensor rec,
        backend.Allocate(kernels::DType::kF32, {options.num_slots, options.num_v_heads,
                                                options.k_head_dim, options.v_head_dim}));
    pool->conv_.push_back(std::move(conv));
    pool->recurrent_.push_back(std::move(rec));
  }
  for (int s = options.num_slots - 1; s >= 0; --s) pool->free_.push_back(s);
  return pool;
}

absl::Status StateSlotPool::Acquire(SequenceCache& seq) {
  if (seq.state_slot >= 0) return absl::OkStatus();
  if (free_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("state slots: all %d slots are in use", options_.num_slots));
  }
  const int slot = free_.back();
  free_.pop_back();
  RETURN_IF_ERROR(Reset(slot));
  seq.state_slot = slot;
  return absl::OkStatus();
}

absl::Status StateSlotPool::Reset(int slot) {
  if (slot < 0 || slot >= options_.num_slots) {
    return absl::InvalidArgumentError(
        absl::StrFormat("state slot %d outside [0, %d)", slot, options_.num_slots));
  }
  for (int l = 0; l < options_.num_layers; ++l) {
    kernels::Tensor conv = conv_[l].Rows(slot, 1);
    kernels::Tensor rec = recurrent_[l].Rows(slot, 1);
    backend_.ZeroFill(conv);
    backend_.ZeroFill(rec);
  }
  return absl::OkStatus();
}

void StateSlotPool::Release(SequenceCache& seq) {
  if (seq.state_slot < 0) return;
  free_.push_back(seq.state_slot);
  seq.state_slot = -1;
}

int64_t StateSlotPool::bytes_per_slot() const {
  return int64_t{4} * options_.num_layers *
         (int64_t{options_.conv_dim} * (options_.conv_kernel - 1) +
          int64_t{options_.num_v_heads} * options_.k_head_dim * options_.v_head_dim);
}

}  // namespace mobius::worker
