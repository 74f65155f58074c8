// Which experts of each routed bank live on which rank of an expert-parallel replica (issue 5;
// docs/distributed.md "Expert placement").
//
// A placement is an order of every bank's experts: with W ranks, rank r holds the experts at
// positions [r E / W, (r + 1) E / W) of its bank's order. The contiguous placement is the
// identity. A load-aware placement orders experts so that each rank's share of the measured
// (token, expert) load is as even as the equal expert counts allow: the hot experts of a skewed
// routing end up on different ranks. Applying an order permutes the bank's expert weights and the
// rows of its router together (router output j is expert order[j]), so the model computes the
// same function: only which rank does the work changes (a top-k tie between two equal router
// logits may resolve differently, since ties go to the lower index).
#ifndef MOBIUS_WORKER_MODEL_EXPERT_PLACEMENT_H_
#define MOBIUS_WORKER_MODEL_EXPERT_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mobius::worker {

class ExpertPlacement {
 public:
  // The identity order for `banks` banks of `experts` experts each.
  static ExpertPlacement Contiguous(int banks, int experts);
  // Balances loads[b][e] (non-negative, e.g. token counts) over `world` ranks holding E / world
  // experts each: heaviest expert first onto the rank with the least load that still has room
  // (ties: lower rank). Deterministic, so every rank computes the same placement from the same
  // loads. InvalidArgument when world does not divide the expert count, or loads are ragged or
  // negative.
  static absl::StatusOr<ExpertPlacement> BalanceLoads(const std::vector<std::vector<double>>& loads,
                                                      int world);
  // A placement from explicit orders (validated against a model by ComputeShardDims).
  static ExpertPlacement FromOrders(std::vector<std::vector<int32_t>> orders) {
    return ExpertPlacement(std::move(orders));
  }
  // Reads {"banks": [[load of expert 0, 1, ...], ...]} (one array per bank) and balances it.
  // Errors name the file and what is wrong.
  static absl::StatusOr<ExpertPlacement> FromLoadFile(const std::string& path, int world);

  [[nodiscard]] int num_banks() const { return static_cast<int>(order_.size()); }
  // Bank b's order: order(b)[j] is the expert at position j.
  [[nodiscard]] const std::vector<int32_t>& order(int bank) const { return order_[bank]; }
  [[nodiscard]] bool identity() const;
  // The largest share of `loads` on one rank divided by the mean share (1 = perfectly even),
  // for this placement over `world` ranks, summed over banks.
  [[nodiscard]] double Imbalance(const std::vector<std::vector<double>>& loads, int world) const;

 private:
  explicit ExpertPlacement(std::vector<std::vector<int32_t>> order) : order_(std::move(order)) {}
  std::vector<std::vector<int32_t>> order_;
};

}  // namespace mobius::worker

#endif  // MOBIUS_WORKER_MODEL_EXPERT_PLACEMENT_H_
